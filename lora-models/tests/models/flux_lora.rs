//! FLUX LoRA export ([`lora_models::flux::lora`]) loaded by diffusers 0.42.1: an adapter injected
//! on the tiny dev-like model of `tests/interop/flux_transformer.py` (attention, MLP and
//! modulation linears of double and single blocks and the final layer; rank 4, alpha 6, one
//! member with its own alpha, one fused member left out) is written in diffusers' and in
//! kohya / ComfyUI's keys; `tests/interop/flux_lora_export.py` loads each file with
//! `FluxPipeline.load_lora_weights` (and the kohya file as ComfyUI applies it) and runs the
//! transformer on the reference inputs; the outputs are compared with ours. Both files are also
//! read back into per-module adapters.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::flux::{diff, fixtures, python, run};
use crate::rng_lock;
use lora_core::config::{LoraConfig, TargetModules};
use lora_core::formats::{AdapterWeights, read_header};
use lora_models::flux::lora::{read_adapter, to_bfl_lora, write_diffusers, write_kohya};
use lora_models::flux::{FluxConfig, FluxTransformer2DModel};
use lora_models::sd::LoadOptions;
use safetensors::SafeTensors;
use tch::{Kind, Tensor};

fn dev() -> FluxTransformer2DModel {
    FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
        .unwrap()
}

/// `scaling · B·A` of every module of `w`.
fn deltas(w: &AdapterWeights) -> BTreeMap<String, Tensor> {
    w.modules
        .iter()
        .map(|(k, m)| {
            let s = w.scaling(k).unwrap();
            (
                k.clone(),
                m.lora_b
                    .to_kind(Kind::Double)
                    .matmul(&m.lora_a.to_kind(Kind::Double))
                    * s,
            )
        })
        .collect()
}

/// max over modules of max |Δa − Δb| / max |Δb|; the module sets must be equal.
fn worst_delta(a: &AdapterWeights, b: &AdapterWeights) -> f64 {
    let (da, db) = (deltas(a), deltas(b));
    assert_eq!(da.keys().collect::<Vec<_>>(), db.keys().collect::<Vec<_>>());
    da.iter()
        .map(|(k, x)| {
            let y = &db[k];
            f64::try_from((x - y).abs().max()).unwrap() / f64::try_from(y.abs().max()).unwrap()
        })
        .fold(0.0, f64::max)
}

fn load(w: &AdapterWeights) -> (FluxTransformer2DModel, tch::nn::VarStore) {
    let mut m = dev();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    w.load_into(&mut m, "loaded", &vs.root(), 0.0).unwrap();
    (m, vs)
}

fn python_outputs(files: &[(&str, &Path)], dir: &Path) -> Vec<u8> {
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/flux_lora_export.py");
    let out = dir.join("diffusers_outputs.safetensors");
    let mut cmd = Command::new(python());
    cmd.arg(&script)
        .arg("--model")
        .arg(fixtures().join("dev/transformer"))
        .arg("--inputs")
        .arg(fixtures().join("reference.safetensors"))
        .arg("--out")
        .arg(&out)
        .env("OMP_NUM_THREADS", "1");
    for (flag, path) in files {
        cmd.arg(format!("--{flag}")).arg(path);
    }
    let res = cmd.output().unwrap();
    assert!(
        res.status.success(),
        "flux_lora_export.py failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    println!("{}", String::from_utf8_lossy(&res.stdout));
    std::fs::read(out).unwrap()
}

fn tensor(bytes: &[u8], name: &str) -> Tensor {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let v = st.tensor(name).unwrap();
    let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
    Tensor::from_data_size(v.data(), &shape, Kind::Float)
}

fn is_single_linear1_member(module: &str) -> bool {
    module.starts_with("single_transformer_blocks.")
        && ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"]
            .iter()
            .any(|s| module.ends_with(s))
}

/// A FLUX.1-dev-shaped config with one double and one single block, and a random rank-4 adapter
/// (alpha 6; `proj_mlp` alpha 2) on its attention, MLP and modulation linears. Seeds and draws
/// from the global generator: the caller holds [`rng_lock`].
fn full_width_adapter() -> (FluxConfig, AdapterWeights) {
    let cfg = FluxConfig {
        num_layers: 1,
        num_single_layers: 1,
        ..FluxConfig::dev()
    };
    let (d, mlp) = (cfg.inner_dim(), cfg.mlp_hidden_dim());
    tch::manual_seed(3);
    let mut w = AdapterWeights::default();
    let f = (Kind::Float, tch::Device::Cpu);
    for (name, out, inp, alpha) in [
        ("transformer_blocks.0.attn.to_q", d, d, 6.0),
        ("transformer_blocks.0.attn.to_k", d, d, 6.0),
        ("transformer_blocks.0.attn.to_v", d, d, 6.0),
        ("transformer_blocks.0.norm1.linear", 6 * d, d, 6.0),
        ("transformer_blocks.0.ff.net.2", d, mlp, 6.0),
        ("single_transformer_blocks.0.attn.to_q", d, d, 6.0),
        ("single_transformer_blocks.0.attn.to_k", d, d, 6.0),
        ("single_transformer_blocks.0.attn.to_v", d, d, 6.0),
        ("single_transformer_blocks.0.proj_mlp", mlp, d, 2.0),
        ("single_transformer_blocks.0.proj_out", d, d + mlp, 6.0),
    ] {
        w.modules.insert(
            name.into(),
            lora_core::formats::ModuleLora {
                kind: lora_core::layer::SiteKind::Linear,
                lora_a: Tensor::randn([4, inp], f) * 0.1,
                lora_b: Tensor::randn([out, 4], f) * 0.1,
                alpha,
                magnitude: None,
            },
        );
    }
    (cfg, w)
}

#[test]
fn exported_adapters_load_in_diffusers_with_our_outputs() {
    // the whole test: injecting and loading adapters initialise their factors from the global
    // generator, which tests replaying seeded draws beside this one must not see move
    let _lock = rng_lock();
    let mut m = dev();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let cfg = LoraConfig {
        r: 4,
        lora_alpha: 6.0,
        target_modules: Some(TargetModules::List(
            [
                "to_q",
                "to_k",
                "to_v",
                "to_out.0",
                "add_q_proj",
                "add_k_proj",
                "to_add_out",
                "ff.net.0.proj",
                "ff_context.net.2",
                "norm1.linear",
                "norm1_context.linear",
                "proj_mlp",
                "proj_out",
                "norm.linear",
                "norm_out.linear",
                "timestep_embedder.linear_1",
            ]
            .map(String::from)
            .to_vec(),
        )),
        // txt_attn.qkv: add_q (scaling 1.5), add_k (0.75), add_v without adapter
        alpha_pattern: [("add_k_proj".to_string(), 3.0)].into(),
        ..LoraConfig::default()
    };
    lora_core::inject::inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    tch::manual_seed(21);
    tch::no_grad(|| {
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (_, mut v) in vars {
            v.copy_(&(v.randn_like() * 0.2));
        }
    });
    let (ours, base) = run(&m, "dev");
    let (_, effect) = diff(&ours, &base);
    println!("the adapter changes the output by {effect:.3e} (relative)");
    assert!(effect > 0.05, "the adapter barely changes the output");
    let w = AdapterWeights::from_model(&mut m, "default").unwrap();
    assert!(
        w.modules
            .contains_key("transformer_blocks.1.attn.add_k_proj")
    );
    assert!(
        !w.modules
            .contains_key("transformer_blocks.1.attn.add_v_proj")
    );
    assert!(
        w.modules
            .contains_key("single_transformer_blocks.1.proj_mlp")
    );

    let dir = tempfile::tempdir().unwrap();
    let diffusers_file = dir.path().join("pytorch_lora_weights.safetensors");
    let kohya_file = dir.path().join("flux_kohya.safetensors");
    let kohya_no_linear1 = dir.path().join("flux_kohya_no_linear1.safetensors");
    let config = m.config().clone();
    write_diffusers(&w, &diffusers_file).unwrap();
    write_kohya(&w, &config, &kohya_file).unwrap();
    // diffusers' kohya converter (0.42.1) splits linear1 only at FLUX.1's widths, and keys the
    // modules outside the blocks (time_in, final_layer, …) without the `transformer.` prefix,
    // so that `load_lora_weights` leaves them out: the same adapter on the blocks without the
    // single blocks' linear1 members, and our output with it
    let mut sub = w.clone_shallow();
    sub.modules.retain(|k, _| {
        !is_single_linear1_member(k)
            && (k.starts_with("transformer_blocks.") || k.starts_with("single_transformer_blocks."))
    });
    assert!(sub.modules.len() < w.modules.len());
    write_kohya(&sub, &config, &kohya_no_linear1).unwrap();
    let (m_sub, _vs_sub) = load(&sub);
    let (ours_sub, _) = run(&m_sub, "dev");

    // the kohya file's fused layout
    let h = read_header(&kohya_file).unwrap();
    let shape = |k: &str| h.tensors[k].1.clone();
    let qkv = "lora_unet_double_blocks_0_img_attn_qkv";
    assert_eq!(shape(&format!("{qkv}.lora_down.weight")), [12, 32]);
    assert_eq!(shape(&format!("{qkv}.lora_up.weight")), [96, 12]);
    assert_eq!(shape(&format!("{qkv}.alpha")), Vec::<usize>::new());
    assert_eq!(
        shape("lora_unet_single_blocks_0_linear1.lora_up.weight"),
        [3 * 32 + 128, 16]
    );
    assert_eq!(
        shape("lora_unet_double_blocks_1_txt_attn_qkv.lora_down.weight"),
        [8, 32]
    );
    for k in [
        "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_img_mlp_0",
        "lora_unet_double_blocks_0_txt_mlp_2",
        "lora_unet_double_blocks_0_img_mod_lin",
        "lora_unet_double_blocks_0_txt_mod_lin",
        "lora_unet_single_blocks_1_linear2",
        "lora_unet_single_blocks_1_modulation_lin",
        "lora_unet_final_layer_linear",
        "lora_unet_final_layer_adaLN_modulation_1",
        "lora_unet_time_in_in_layer",
    ] {
        assert_eq!(
            shape(&format!("{k}.lora_down.weight"))[0],
            4,
            "{k}: a module of its own"
        );
    }
    let alpha = |k: &str| {
        let bytes = std::fs::read(&kohya_file).unwrap();
        f64::try_from(tensor(&bytes, &format!("{k}.alpha"))).unwrap()
    };
    // same scaling 6/4 for q, k, v: alpha = 1.5 · 12; mixed scalings: folded, alpha = r_total
    assert_eq!(alpha(qkv), 18.0);
    assert_eq!(alpha("lora_unet_double_blocks_0_txt_attn_qkv"), 8.0);
    assert_eq!(alpha("lora_unet_double_blocks_0_img_attn_proj"), 6.0);
    assert_eq!(alpha("lora_unet_final_layer_adaLN_modulation_1"), 4.0);
    assert_eq!(h.metadata["ss_network_module"], "networks.lora_flux");
    assert_eq!(h.metadata["ss_base_model_version"], "flux1");
    assert_eq!(h.metadata["ss_network_dim"], "4");
    assert_eq!(h.metadata["ss_network_alpha"], "6");
    // the diffusers file: transformer.<module> keys, no alpha
    let hd = read_header(&diffusers_file).unwrap();
    assert!(
        hd.tensors
            .contains_key("transformer.transformer_blocks.0.attn.to_q.lora_A.weight")
    );
    assert!(hd.tensors.keys().all(|k| !k.ends_with(".alpha")));

    // FLUX.1-dev's widths, one block of each kind: linear1 through diffusers' converter
    let (full_cfg, full) = full_width_adapter();
    let full_file = dir.path().join("flux1_widths_kohya.safetensors");
    let converted = dir.path().join("flux1_widths_converted.safetensors");
    write_kohya(&full, &full_cfg, &full_file).unwrap();

    // diffusers (and ComfyUI's formula) on the three files
    let out = python_outputs(
        &[
            ("diffusers", &diffusers_file),
            ("kohya", &kohya_no_linear1),
            ("comfy", &kohya_file),
            ("convert", &full_file),
            ("converted", &converted),
        ],
        dir.path(),
    );
    let mut conv = lora_core::formats::diffusers::read(&converted).unwrap();
    let conv = conv.remove("transformer").unwrap();
    let worst = worst_delta(&conv, &full);
    println!(
        "kohya keys at FLUX.1-dev widths through FluxPipeline.lora_state_dict: worst relative \
         module delta {worst:.3e}"
    );
    assert!(worst < 1e-6, "{worst:.3e}");
    // the block-diagonal up was recognised: each member came back with its own rank
    assert_eq!(
        conv.modules["single_transformer_blocks.0.proj_mlp"].rank(),
        4
    );
    // diffusers loaded every module of the files (add_v_proj's zero block included)
    let loaded = |k: &str| f64::try_from(tensor(&out, k)).unwrap() as usize;
    assert_eq!(loaded("diffusers.modules"), w.modules.len());
    assert_eq!(loaded("kohya.modules"), sub.modules.len() + 2);
    for (name, want, what) in [
        (
            "diffusers.out",
            &ours,
            "diffusers keys, FluxPipeline.load_lora_weights",
        ),
        (
            "kohya.out",
            &ours_sub,
            "kohya keys without linear1, FluxPipeline.load_lora_weights",
        ),
        (
            "comfy.out",
            &ours,
            "kohya keys, applied to BFL weights as ComfyUI does",
        ),
    ] {
        let (abs, rel) = diff(&tensor(&out, name), want);
        println!("{what}: max abs err {abs:.3e}, max rel err {rel:.3e}");
        assert!(rel < 1e-5, "{what}: relative error {rel:.3e}");
    }

    // read back: per-module products equal, and the same output once loaded
    for (file, what) in [(&diffusers_file, "diffusers"), (&kohya_file, "kohya")] {
        let back = read_adapter(file, &config).unwrap();
        let worst = worst_delta(&back, &w);
        println!("{what} read back: worst relative module delta {worst:.3e}");
        assert!(worst < 1e-6, "{what}: {worst:.3e}");
        let (mb, _vsb) = load(&back);
        let (o, _) = run(&mb, "dev");
        let (_, rel) = diff(&o, &ours);
        assert!(rel < 1e-5, "{what} read back and loaded: {rel:.3e}");
    }
    // the kohya read-back recovers each member's own rank
    let back = read_adapter(&kohya_file, &config).unwrap();
    assert_eq!(back.modules["transformer_blocks.0.attn.to_k"].rank(), 4);
    assert_eq!(back.modules["norm_out.linear"].rank(), 4);
    assert!(
        !back
            .modules
            .contains_key("transformer_blocks.0.attn.add_v_proj")
    );
}

#[test]
fn export_refuses_what_kohya_cannot_hold() {
    let m = dev();
    let config = m.config().clone();
    let f = (Kind::Float, tch::Device::Cpu);
    let mut w = AdapterWeights::default();
    w.modules.insert(
        "not_a_module".into(),
        lora_core::formats::ModuleLora {
            kind: lora_core::layer::SiteKind::Linear,
            lora_a: Tensor::ones([2, 32], f),
            lora_b: Tensor::ones([32, 2], f),
            alpha: 2.0,
            magnitude: None,
        },
    );
    let e = to_bfl_lora(&w, &config).unwrap_err().to_string();
    assert!(e.contains("not_a_module"), "{e}");
    // a B with the wrong number of rows for to_k is named
    let mut w = AdapterWeights::default();
    w.modules.insert(
        "transformer_blocks.0.attn.to_k".into(),
        lora_core::formats::ModuleLora {
            kind: lora_core::layer::SiteKind::Linear,
            lora_a: Tensor::ones([2, 32], f),
            lora_b: Tensor::ones([31, 2], f),
            alpha: 2.0,
            magnitude: None,
        },
    );
    let e = to_bfl_lora(&w, &config).unwrap_err().to_string();
    assert!(e.contains("transformer_blocks.0.attn.to_k.lora_B"), "{e}");
}
