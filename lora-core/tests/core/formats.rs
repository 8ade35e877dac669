//! Adapter files: kohya / diffusers round trips, conversions that keep the strength (alpha ≠ rank,
//! rsLoRA), adapters written by other tools (alpha as bf16 / f16 / int64, missing alpha), header-only
//! reads, and refusals that name the key.

use crate::common;

use common::{SITES, Tiny, ids, image, max_abs_diff};
use lora_core::Error;
use lora_core::config::{InitLoraWeights, LoraConfig, TargetModules};
use lora_core::formats::{
    AdapterWeights, diffusers, kohya, peft, read_header, read_safetensors, write_safetensors,
};
use lora_core::inject::{Adaptable, inject, site_names};
use safetensors::Dtype;
use std::collections::BTreeMap;
use tch::{Device, Kind, Tensor, nn};

fn adapted(cfg: &LoraConfig) -> (Tiny, nn::VarStore) {
    let mut t = Tiny::new(None);
    let vs = nn::VarStore::new(Device::Cpu);
    inject(&mut t, cfg, "default", &vs.root()).unwrap();
    (t, vs)
}

fn linear_conv_cfg(r: i64, alpha: f64, rslora: bool) -> LoraConfig {
    let mut cfg = LoraConfig::new(
        r,
        alpha,
        &["q_proj", "v_proj", "up_proj", "down_proj", "conv_in"],
    );
    cfg.init_lora_weights = InitLoraWeights::Random;
    cfg.use_rslora = rslora;
    cfg.rank_pattern.insert("down_proj".into(), 2);
    cfg.alpha_pattern.insert("conv_in".into(), 7.0);
    cfg
}

fn outputs(t: &Tiny) -> (Tensor, Tensor) {
    (t.forward_t(&ids(), false), t.conv_forward(&image(), false))
}

fn names(t: &mut Tiny) -> Vec<String> {
    site_names(t).unwrap().into_iter().map(|(n, _)| n).collect()
}

#[test]
fn kohya_round_trip_keeps_strength_and_writes_f32_alpha_and_metadata() {
    for rslora in [false, true] {
        let (mut t, _vs) = adapted(&linear_conv_cfg(4, 3.0, rslora));
        let want = outputs(&t);
        let mut w = AdapterWeights::from_model(&mut t, "default").unwrap();
        w.metadata
            .insert("ss_base_model_version".into(), "sd_v1".into());
        w.metadata.insert("ss_v2".into(), "False".into());
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lora.safetensors");
        kohya::write(&path, &[("lora_unet", &w)]).unwrap();

        // header only (mmap): names, alpha dtype/shape, ss_* metadata
        let h = read_header(&path).unwrap();
        let name = kohya::kohya_name("lora_unet", "model.layers.0.self_attn.q_proj");
        assert_eq!(name, "lora_unet_model_layers_0_self_attn_q_proj");
        assert_eq!(h.tensors[&format!("{name}.alpha")], (Dtype::F32, vec![]));
        assert_eq!(
            h.tensors[&format!("{name}.lora_down.weight")].1,
            vec![4, common::DIM as usize]
        );
        assert_eq!(
            h.tensors["lora_unet_conv_in.lora_up.weight"].1,
            vec![4, 4, 1, 1]
        );
        assert_eq!(h.metadata["ss_network_module"], "networks.lora");
        assert_eq!(h.metadata["ss_network_dim"], "4");
        assert_eq!(h.metadata["ss_base_model_version"], "sd_v1");
        assert!(h.metadata["ss_network_args"].contains("conv_dim"));
        let (tensors, _) = read_safetensors(&path).unwrap();
        let alpha = f64::try_from(&tensors[&format!("{name}.alpha")]).unwrap();
        let expect_alpha = if rslora { 3.0 * 2.0 } else { 3.0 }; // alpha·sqrt(r) keeps alpha/sqrt(r)
        assert_eq!(alpha, expect_alpha);
        assert_eq!(tensors[&format!("{name}.alpha")].kind(), Kind::Float);

        // read back into a fresh model: same outputs
        let mut file = kohya::read(&path).unwrap();
        let mut t2 = Tiny::new(None);
        let sites = names(&mut t2);
        let w2 = file.take_prefix("lora_unet", &sites).unwrap();
        assert!(!w2.use_rslora);
        let vs2 = nn::VarStore::new(Device::Cpu);
        w2.load_into(&mut t2, "default", &vs2.root(), 0.0).unwrap();
        let got = outputs(&t2);
        assert!(max_abs_diff(&got.0, &want.0) < 1e-5, "rslora={rslora}");
        assert!(max_abs_diff(&got.1, &want.1) < 1e-5, "rslora={rslora}");
        assert!(max_abs_diff(&want.0, &Tiny::new(None).forward_t(&ids(), false)) > 1e-3);
    }
}

#[test]
fn peft_to_kohya_to_diffusers_to_peft_preserves_strength() {
    let (mut t, _vs) = adapted(&linear_conv_cfg(8, 2.5, true));
    let want = outputs(&t);
    let dir = tempfile::tempdir().unwrap();
    peft::save_adapter(&mut t, "default", None, &dir.path().join("peft")).unwrap();
    // PEFT → kohya
    let (_, w) = peft::load(&dir.path().join("peft")).unwrap();
    let kpath = dir.path().join("k.safetensors");
    kohya::write(&kpath, &[("lora_unet", &w)]).unwrap();
    // kohya → diffusers
    let mut t2 = Tiny::new(None);
    let sites = names(&mut t2);
    let wk = kohya::read(&kpath)
        .unwrap()
        .take_prefix("lora_unet", &sites)
        .unwrap();
    let dpath = dir.path().join(diffusers::WEIGHTS_FILE);
    diffusers::write(&dpath, &[("unet", &wk)]).unwrap();
    let h = read_header(&dpath).unwrap();
    assert!(
        h.tensors
            .contains_key("unet.model.layers.0.self_attn.q_proj.lora_A.weight")
    );
    // diffusers → PEFT
    let mut parts = diffusers::read(&dpath).unwrap();
    let wd = parts.remove("unet").unwrap();
    for m in wd.modules.values() {
        assert_eq!(m.alpha, m.rank() as f64); // scaling folded into B
    }
    peft::save(&wd, None, &dir.path().join("peft2")).unwrap();
    let vs2 = nn::VarStore::new(Device::Cpu);
    let (cfg2, _) =
        peft::load_adapter(&mut t2, &dir.path().join("peft2"), "default", &vs2.root()).unwrap();
    assert_eq!(cfg2.r, 8);
    assert_eq!(
        cfg2.rank_pattern.values().copied().collect::<Vec<_>>(),
        vec![2]
    );
    let got = outputs(&t2);
    assert!(max_abs_diff(&got.0, &want.0) < 1e-5);
    assert!(max_abs_diff(&got.1, &want.1) < 1e-5);
}

fn write(path: &std::path::Path, tensors: Vec<(&str, Tensor)>) {
    let m: BTreeMap<String, Tensor> = tensors
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    write_safetensors(path, &m, &BTreeMap::new()).unwrap();
}

#[test]
fn kohya_alpha_any_dtype_and_missing_alpha_means_rank() {
    let dir = tempfile::tempdir().unwrap();
    let down = common::dense(&[4, common::DIM], 1);
    let up = common::dense(&[common::DIM, 4], 2);
    let cases: Vec<(&str, Option<Tensor>, f64)> = vec![
        (
            "bf16",
            Some(
                Tensor::from_slice(&[3.0f32])
                    .to_kind(Kind::BFloat16)
                    .reshape([0i64; 0]),
            ),
            3.0,
        ),
        (
            "f16",
            Some(
                Tensor::from_slice(&[2.5f32])
                    .to_kind(Kind::Half)
                    .reshape([0i64; 0]),
            ),
            2.5,
        ),
        (
            "i64",
            Some(Tensor::from_slice(&[8i64]).reshape([0i64; 0])),
            8.0,
        ),
        ("one-element", Some(Tensor::from_slice(&[6.0f32])), 6.0),
        ("missing", None, 4.0),
        (
            "zero",
            Some(Tensor::from_slice(&[0.0f32]).reshape([0i64; 0])),
            4.0,
        ),
    ];
    for (what, alpha, expect) in cases {
        let p = dir.path().join(format!("{what}.safetensors"));
        let mut v = vec![
            (
                "lora_unet_model_layers_0_self_attn_q_proj.lora_down.weight",
                down.copy(),
            ),
            (
                "lora_unet_model_layers_0_self_attn_q_proj.lora_up.weight",
                up.copy(),
            ),
        ];
        if let Some(a) = alpha {
            v.push(("lora_unet_model_layers_0_self_attn_q_proj.alpha", a));
        }
        write(&p, v);
        let mut f = kohya::read(&p).unwrap();
        let w = f.take_prefix("lora_unet", &SITES).unwrap();
        assert_eq!(w.modules[SITES[1]].alpha, expect, "{what}");
        assert_eq!(w.scaling(SITES[1]).unwrap(), expect / 4.0, "{what}");
    }
}

#[test]
fn refusals_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let k = "lora_unet_model_layers_0_self_attn_q_proj";
    let p = dir.path().join("x.safetensors");
    let d = common::dense(&[4, common::DIM], 1);
    let u = common::dense(&[common::DIM, 4], 2);

    // wrong rank in lora_up
    write(
        &p,
        vec![
            (&format!("{k}.lora_down.weight"), d.copy()),
            (
                &format!("{k}.lora_up.weight"),
                common::dense(&[common::DIM, 3], 2),
            ),
        ],
    );
    match kohya::read(&p).unwrap_err() {
        Error::Shape { key, .. } => assert_eq!(key, format!("{k}.lora_up.weight")),
        e => panic!("{e}"),
    }
    // integer weights
    write(
        &p,
        vec![
            (&format!("{k}.lora_down.weight"), d.to_kind(Kind::Int64)),
            (&format!("{k}.lora_up.weight"), u.copy()),
        ],
    );
    match kohya::read(&p).unwrap_err() {
        Error::Dtype { key, .. } => assert_eq!(key, format!("{k}.lora_down.weight")),
        e => panic!("{e}"),
    }
    // half a pair
    write(&p, vec![(&format!("{k}.lora_down.weight"), d.copy())]);
    match kohya::read(&p).unwrap_err() {
        Error::MissingKey { key, .. } => assert_eq!(key, format!("{k}.lora_up.weight")),
        e => panic!("{e}"),
    }
    // a key that is not LoRA (LyCORIS DoRA scale)
    write(
        &p,
        vec![
            (&format!("{k}.lora_down.weight"), d.copy()),
            (&format!("{k}.lora_up.weight"), u.copy()),
            (&format!("{k}.dora_scale"), u.copy()),
        ],
    );
    let e = kohya::read(&p).unwrap_err();
    assert!(e.to_string().contains("dora_scale"), "{e}");
    // a module the model does not have
    write(
        &p,
        vec![
            ("lora_unet_nope.lora_down.weight", d.copy()),
            ("lora_unet_nope.lora_up.weight", u.copy()),
        ],
    );
    let e = kohya::read(&p)
        .unwrap()
        .take_prefix("lora_unet", &SITES)
        .unwrap_err();
    assert!(e.to_string().contains("lora_unet_nope"), "{e}");
    // shapes that do not fit the model's site
    write(
        &p,
        vec![
            (&format!("{k}.lora_down.weight"), common::dense(&[4, 7], 1)),
            (&format!("{k}.lora_up.weight"), u.copy()),
        ],
    );
    let w = kohya::read(&p)
        .unwrap()
        .take_prefix("lora_unet", &SITES)
        .unwrap();
    let mut t = Tiny::new(None);
    let vs = nn::VarStore::new(Device::Cpu);
    match w.load_into(&mut t, "default", &vs.root(), 0.0).unwrap_err() {
        Error::Shape {
            key,
            expected,
            found,
        } => {
            assert_eq!(key, "model.layers.0.self_attn.q_proj.lora_A");
            assert_eq!(expected, vec![4, common::DIM]);
            assert_eq!(found, vec![4, 7]);
        }
        e => panic!("{e}"),
    }

    // PEFT: missing lora_B, rank not matching the config, non-LoRA key
    let (mut t, _vs) = adapted(&LoraConfig::new(4, 8.0, &["q_proj"]));
    let pd = dir.path().join("peft");
    peft::save_adapter(&mut t, "default", None, &pd).unwrap();
    let wf = pd.join(peft::WEIGHTS_FILE);
    let (mut tensors, _) = read_safetensors(&wf).unwrap();
    let kb = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
    let b = tensors.remove(kb).unwrap();
    write_safetensors(&wf, &tensors, &BTreeMap::new()).unwrap();
    match peft::load(&pd).unwrap_err() {
        Error::MissingKey { key, .. } => assert_eq!(key, kb),
        e => panic!("{e}"),
    }
    tensors.insert(kb.into(), b);
    tensors.insert(
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight".into(),
        common::dense(&[4, 4], 3),
    );
    write_safetensors(&wf, &tensors, &BTreeMap::new()).unwrap();
    let e = peft::load(&pd).unwrap_err();
    assert!(e.to_string().contains("lora_A.default.weight"), "{e}");
    tensors.remove("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight");
    write_safetensors(&wf, &tensors, &BTreeMap::new()).unwrap();
    let mut cfg: LoraConfig = peft::read_config(&pd).unwrap();
    cfg.r = 5;
    std::fs::write(
        pd.join(peft::CONFIG_FILE),
        serde_json::to_string(&cfg).unwrap(),
    )
    .unwrap();
    match peft::load(&pd).unwrap_err() {
        Error::Shape { key, .. } => assert!(key.ends_with("q_proj.lora_A.weight"), "{key}"),
        e => panic!("{e}"),
    }
}

#[test]
fn nothing_matched_lists_existing_modules_and_report_reads_like_peft() {
    let mut t = Tiny::new(None);
    let vs = nn::VarStore::new(Device::Cpu);
    let e = inject(
        &mut t,
        &LoraConfig::new(4, 8.0, &["qkv"]),
        "default",
        &vs.root(),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::NoTargetMatched { .. }));
    for s in SITES {
        assert!(msg.contains(s), "{msg}");
    }
    assert!(vs.variables().is_empty());

    // regex + exclusion
    let mut cfg = LoraConfig {
        target_modules: Some(TargetModules::Regex(r"model\.layers\.\d+\..*_proj".into())),
        ..Default::default()
    };
    cfg.exclude_modules = Some(TargetModules::list(&["v_proj"]));
    cfg.r = 2;
    let r = inject(&mut t, &cfg, "default", &vs.root()).unwrap();
    assert_eq!(r.modules, vec![SITES[1], SITES[3], SITES[4]]);
    let d = common::DIM;
    let h = common::HIDDEN;
    assert_eq!(r.params_added, 2 * (d + d) + 2 * (d + h) + 2 * (h + d));
    let frozen = 16 * d + (d * d + d) + d * d + (h * d + h) + d * h + (4 * 3 * 9 + 4);
    assert_eq!(r.all_params, frozen + r.params_added);
    let pct = 100.0 * r.params_added as f64 / (frozen + r.params_added) as f64;
    assert_eq!(
        r.to_string(),
        format!(
            "trainable params: {} || all params: {} || trainable%: {pct:.4}",
            r.params_added,
            thousands(frozen + r.params_added)
        )
    );
    // only adapter tensors are in the adapter VarStore
    assert_eq!(
        vs.trainable_variables()
            .iter()
            .map(|t| t.numel() as i64)
            .sum::<i64>(),
        r.params_added
    );
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    assert_eq!(
        names[0],
        "model.layers.0.mlp.down_proj.lora_A.default.weight"
    );
    // all-linear
    let mut t = Tiny::new(None);
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig {
        target_modules: Some(TargetModules::Regex("all-linear".into())),
        ..Default::default()
    };
    let r = inject(&mut t, &cfg, "x", &vs.root()).unwrap();
    assert_eq!(r.modules.len(), 4);
    let _ = t.visit_sites(&mut |_, _| Ok(()));
}

fn thousands(n: i64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A write cut short (a kill mid-export) leaves only `.<file>.partial/` beside the file; the next
/// write of that file clears it, and a finished write leaves nothing but the file.
#[test]
fn a_cut_short_write_is_cleared_by_the_next_and_leaves_nothing_beside_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("adapter.safetensors");
    // what a kill during the safetensors writer leaves: its random `.tmpXXXXXX` in our staging
    let staging = dir.path().join(".adapter.safetensors.partial");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::write(staging.join(".tmpAbC123"), b"half a file").unwrap();
    let t = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]);
    write(&file, vec![("w", t.shallow_clone())]);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, vec!["adapter.safetensors".to_string()]);
    let (back, _) = read_safetensors(&file).unwrap();
    assert!(back["w"].equal(&t));
}
