//! Interop with the real Python PEFT (pinned in the project venv): adapters we save load with
//! `PeftModel.from_pretrained` and give the same outputs; adapters PEFT saves load here and give the
//! same outputs. Tolerance: |ours − peft| ≤ 1e-5 · max(1, max |peft|) on f32 outputs (observed
//! differences are printed; they come from summation order only: ~1e-7 relative).
//!
//! The Python side is `tests/interop/peft_roundtrip.py`. This test fails (it never skips) when the
//! venv or `peft` is missing: run `cargo xtask setup`.

use crate::common;

use common::{dense, max_abs_diff};
use lora_core::Result;
use lora_core::base::BaseWeight;
use lora_core::config::{InitLoraWeights, LoraConfig};
use lora_core::conv::{Conv2dParams, LoraConv2d};
use lora_core::embedding::LoraEmbedding;
use lora_core::formats::{peft, read_safetensors, write_safetensors};
use lora_core::inject::{Adaptable, SiteMut, inject};
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Device, Kind, Tensor, nn};

const TOL: f64 = 1e-5;

struct Net {
    emb: LoraEmbedding,
    fc1: LoraLinear,
    fc2: LoraLinear,
    conv: LoraConv2d,
}

impl Adaptable for Net {
    fn visit_sites(&mut self, f: &mut dyn FnMut(&str, SiteMut<'_>) -> Result<()>) -> Result<()> {
        f("emb", SiteMut::Embedding(&mut self.emb))?;
        f("fc1", SiteMut::Linear(&mut self.fc1))?;
        f("fc2", SiteMut::Linear(&mut self.fc2))?;
        f("conv", SiteMut::Conv2d(&mut self.conv))
    }
}

fn base_tensors() -> BTreeMap<String, Tensor> {
    let mut t = BTreeMap::new();
    t.insert("emb.weight".to_string(), dense(&[20, 16], 1));
    t.insert("fc1.weight".to_string(), dense(&[24, 16], 2));
    t.insert("fc1.bias".to_string(), dense(&[24], 3));
    t.insert("fc2.weight".to_string(), dense(&[16, 24], 4));
    t.insert("fc2.bias".to_string(), dense(&[16], 5));
    t.insert("conv.weight".to_string(), dense(&[5, 3, 3, 3], 6));
    t.insert("conv.bias".to_string(), dense(&[5], 7));
    t.insert(
        "ids".to_string(),
        Tensor::from_slice(&[0i64, 4, 19, 7, 7, 11, 2, 13]).reshape([2, 4]),
    );
    t.insert("img".to_string(), dense(&[2, 3, 6, 5], 8));
    t
}

impl Net {
    fn new(t: &BTreeMap<String, Tensor>) -> Self {
        let g = |k: &str| t[k].copy();
        Net {
            emb: LoraEmbedding::new(BaseWeight::Dense(g("emb.weight"))).unwrap(),
            fc1: LoraLinear::new(BaseWeight::Dense(g("fc1.weight")), Some(g("fc1.bias"))).unwrap(),
            fc2: LoraLinear::new(BaseWeight::Dense(g("fc2.weight")), Some(g("fc2.bias"))).unwrap(),
            conv: LoraConv2d::new(
                BaseWeight::Dense(g("conv.weight")),
                Some(g("conv.bias")),
                Conv2dParams {
                    padding: [1, 1],
                    ..Default::default()
                },
            )
            .unwrap(),
        }
    }

    fn forward(&self, t: &BTreeMap<String, Tensor>) -> (Tensor, Tensor) {
        let h = self.emb.forward(&t["ids"]).unwrap();
        let h = self
            .fc2
            .forward_t(&self.fc1.forward_t(&h, false).unwrap().relu(), false)
            .unwrap();
        (h, self.conv.forward_t(&t["img"], false).unwrap())
    }
}

fn python() -> PathBuf {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} not found: run `cargo xtask setup` to create the project venv with peft",
        py.display()
    );
    let ok = Command::new(&py)
        .args(["-c", "import peft, safetensors, torch"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(
        ok,
        "`import peft` fails in {}: run `cargo xtask setup` (installs the pinned peft/transformers/safetensors)",
        py.display()
    );
    py
}

fn compare(name: &str, ours: (Tensor, Tensor), file: &Path) -> f64 {
    let (theirs, _) = read_safetensors(file).unwrap();
    let mut worst = 0f64;
    for (what, a, b) in [
        ("linear/embedding path", &ours.0, &theirs["h"]),
        ("conv", &ours.1, &theirs["c"]),
    ] {
        let scale = f64::try_from(b.abs().max()).unwrap().max(1.0);
        let d = max_abs_diff(a, b);
        println!(
            "{name} [{what}]: max |ours - peft| = {d:.3e}, max |peft| = {scale:.2}, relative {:.3e}",
            d / scale
        );
        assert!(
            d <= TOL * scale,
            "{name} [{what}]: outputs differ from PEFT by {d:.3e} (> {TOL:e} * {scale:.2})"
        );
        worst = worst.max(d / scale);
    }
    worst
}

#[test]
fn peft_loads_ours_and_we_load_peft() {
    let py = python();
    let work = tempfile::tempdir().unwrap();
    let w = work.path();
    let t = base_tensors();
    write_safetensors(&w.join("base.safetensors"), &t, &BTreeMap::new()).unwrap();

    // ours: alpha != rank, rank / alpha patterns, rsLoRA, embeddings and convs, non-zero B
    let mut plain = LoraConfig::new(4, 6.0, &["emb", "fc1", "fc2", "conv"]);
    plain.rank_pattern.insert("fc1".into(), 2);
    plain.alpha_pattern.insert("emb".into(), 3.0);
    plain.use_rslora = true;
    plain.init_lora_weights = InitLoraWeights::Random;
    let mut dora = LoraConfig::new(3, 5.0, &["fc1", "fc2", "conv"]);
    dora.use_dora = true;
    dora.init_lora_weights = InitLoraWeights::Random;
    let mut ours = Vec::new();
    for (name, cfg) in [("ours", &plain), ("ours_dora", &dora)] {
        let mut net = Net::new(&t);
        let vs = nn::VarStore::new(Device::Cpu);
        inject(&mut net, cfg, "default", &vs.root()).unwrap();
        if cfg.use_dora {
            let _g = tch::no_grad_guard();
            net.visit_sites(&mut |_, site| {
                if let Some(m) = site
                    .layer_ref()
                    .adapter("default")
                    .and_then(|a| a.magnitude())
                {
                    let mut m = m.shallow_clone();
                    let f = dense(&m.size(), 99).abs() + 1.0;
                    let v = &m * f;
                    m.copy_(&v);
                }
                Ok(())
            })
            .unwrap();
        }
        peft::save_adapter(&mut net, "default", Some(cfg), &w.join(name)).unwrap();
        ours.push((name, net.forward(&t)));
    }

    let out = Command::new(&py)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/interop/peft_roundtrip.py"
        ))
        .arg(w)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "peft_roundtrip.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    // (a) PEFT's outputs with our adapters
    for (name, y) in ours {
        compare(
            &format!("{name} loaded by PeftModel.from_pretrained"),
            y,
            &w.join(format!("out_{name}.safetensors")),
        );
    }

    // (b) PEFT's adapters loaded here
    for name in ["theirs", "theirs_dora"] {
        let mut net = Net::new(&t);
        let base = net.forward(&t);
        let vs = nn::VarStore::new(Device::Cpu);
        let (cfg, report) =
            peft::load_adapter(&mut net, &w.join(name), "default", &vs.root()).unwrap();
        assert_eq!(cfg.use_dora, name == "theirs_dora");
        let expected_modules = if name == "theirs" { 4 } else { 3 };
        assert_eq!(report.modules.len(), expected_modules);
        let y = net.forward(&t);
        assert!(
            max_abs_diff(&y.0, &base.0) > 1e-3,
            "{name}: adapter has no effect"
        );
        compare(
            &format!("{name} (saved by PEFT) loaded here"),
            y,
            &w.join(format!("out_{name}.safetensors")),
        );
        if name == "theirs" {
            // the rank / alpha patterns and rsLoRA survived
            assert_eq!(net.fc2.adapter("default").unwrap().rank(), 2);
            assert!((net.conv.adapter("default").unwrap().scaling() - 3.0 / 2.0).abs() < 1e-12);
            assert!((net.fc1.adapter("default").unwrap().scaling() - 12.0 / 2.0).abs() < 1e-12);
        }
    }
    let _ = Kind::Float;
}
