//! UNet2DConditionModel against diffusers 0.42.1 on tiny random-weight models that
//! `tests/interop/sd_unet.py` builds and writes (SD 1.x-style and SDXL-style), loaded from the
//! diffusers folder and from the original single-file layout, and with a PEFT LoRA adapter.

use std::path::Path;
use std::sync::OnceLock;

use crate::common::diff;
use crate::rng_lock;
use lora_core::inject::{Adaptable, site_names};
use lora_core::layer::SiteKind;
use lora_models::sd::{AttentionBackend, LoadOptions, UNet2DConditionModel, UNetConfig};
use safetensors::SafeTensors;
use tch::{Kind, Tensor};

/// Runs the script once per test binary; returns its output folder.
fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("sd_unet.py"))
        .path()
}

fn reference() -> &'static [u8] {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap())
}

fn r(name: &str) -> Tensor {
    crate::common::st_tensor(reference(), name)
}

fn opts(kind: Kind, attention: AttentionBackend) -> LoadOptions {
    LoadOptions {
        kind,
        attention,
        ..LoadOptions::default()
    }
}

fn sd1(backend: AttentionBackend) -> UNet2DConditionModel {
    tch::set_num_threads(1);
    UNet2DConditionModel::from_diffusers(&fixtures().join("sd1"), &opts(Kind::Float, backend))
        .unwrap()
}

fn run(unet: &UNet2DConditionModel, case: &str) -> Tensor {
    let _g = tch::no_grad_guard();
    let added = if case == "sdxl" {
        Some((r("sdxl.text_embeds"), r("sdxl.time_ids")))
    } else {
        None
    };
    unet.forward(
        &r(&format!("{case}.sample")),
        &r(&format!("{case}.t")),
        &r(&format!("{case}.ctx")),
        added.as_ref().map(|(a, b)| (a, b)),
    )
    .unwrap()
}

const TOL_F32: f64 = 1e-4;

#[test]
fn sd1_unet_matches_diffusers() {
    for backend in [AttentionBackend::Sdpa, AttentionBackend::Math] {
        let unet = sd1(backend);
        assert_eq!(
            unet.num_params(),
            i64::try_from(r("sd1.num_params").get(0)).unwrap()
        );
        for case in ["sd1", "sd1_odd"] {
            let out = run(&unet, case);
            let (abs, rel) = diff(&out, &r(&format!("{case}.out")));
            println!("{case} {backend:?}: max abs diff {abs:.3e}, relative {rel:.3e}");
            assert!(
                rel < TOL_F32,
                "{case} {backend:?}: relative diff {rel:.3e} (abs {abs:.3e})"
            );
        }
    }
}

#[test]
fn sdxl_unet_matches_diffusers() {
    tch::set_num_threads(1);
    let unet = UNet2DConditionModel::from_diffusers(
        &fixtures().join("sdxl"),
        &opts(Kind::Float, AttentionBackend::Sdpa),
    )
    .unwrap();
    let p = unet.plan();
    assert_eq!(p.heads, [2, 4]);
    assert_eq!(p.transformer_layers, [1, 2]);
    assert_eq!(p.text_time, Some((8, 64)));
    assert_eq!(
        unet.num_params(),
        i64::try_from(r("sdxl.num_params").get(0)).unwrap()
    );
    // the planner's header-only descriptor agrees with the loaded model
    let d =
        lora_memory::sd_header::diffusion_from_diffusers_folder(&fixtures().join("sdxl")).unwrap();
    assert_eq!(d.unet_params as i64, unet.num_params());
    assert_eq!(d.family, lora_memory::model::DiffusionFamily::Sdxl);
    let depths: Vec<u64> = d.levels.iter().map(|l| l.transformer_depth).collect();
    assert_eq!(
        (depths, d.mid_transformer_depth, d.cross_attention_dim),
        (vec![0, 2], 2, 32)
    );
    let out = run(&unet, "sdxl");
    let (abs, rel) = diff(&out, &r("sdxl.out"));
    println!("sdxl: max abs diff {abs:.3e}, relative {rel:.3e}");
    assert!(
        rel < TOL_F32,
        "sdxl: relative diff {rel:.3e} (abs {abs:.3e})"
    );
    // SDXL needs the added conditioning
    let e = unet
        .forward(&r("sdxl.sample"), &r("sdxl.t"), &r("sdxl.ctx"), None)
        .unwrap_err()
        .to_string();
    assert!(e.contains("text_time"), "{e}");
}

#[test]
fn single_file_checkpoints_load_like_the_diffusers_folder() {
    tch::set_num_threads(1);
    for case in ["sd1", "sdxl"] {
        let dir = fixtures().join(case);
        let o = opts(Kind::Float, AttentionBackend::Sdpa);
        let folder = UNet2DConditionModel::from_diffusers(&dir, &o).unwrap();
        let config = UNetConfig::from_file(&dir.join("unet/config.json")).unwrap();
        let single = UNet2DConditionModel::from_single_file(
            &fixtures().join(format!("{case}_single.safetensors")),
            config,
            &o,
        )
        .unwrap();
        let (a, b) = (run(&folder, case), run(&single, case));
        let (abs, _) = diff(&a, &b);
        println!("{case}: single file vs folder max abs diff {abs:.3e}");
        assert_eq!(abs, 0.0, "{case}: the two loads differ");
        let (_, rel) = diff(&b, &r(&format!("{case}.out")));
        assert!(rel < TOL_F32);
    }
}

#[test]
fn peft_lora_on_attention_and_conv_matches_diffusers() {
    let _lock = rng_lock();
    let mut unet = sd1(AttentionBackend::Sdpa);
    let base = run(&unet, "sd1");
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let dir = fixtures().join("lora");
    let (cfg, report) =
        lora_core::formats::peft::load_adapter(&mut unet, &dir, "default", &vs.root()).unwrap();
    assert_eq!((cfg.r, cfg.lora_alpha), (4, 8.0));
    let want: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("modules.json")).unwrap()).unwrap();
    let mut got = report.modules.clone();
    got.sort();
    assert_eq!(got, want, "the adapter landed on other modules than PEFT's");
    assert!(
        got.iter().any(|m| m.ends_with("resnets.0.conv1"))
            && got.iter().any(|m| m.ends_with("attn2.to_out.0"))
    );
    let out = run(&unet, "sd1");
    let (abs, rel) = diff(&out, &r("lora.out"));
    let (moved, _) = diff(&base, &r("lora.out"));
    println!(
        "lora: max abs diff {abs:.3e}, relative {rel:.3e}; the adapter moves the output by {moved:.3e}"
    );
    assert!(rel < TOL_F32, "lora: relative diff {rel:.3e}");
    assert!(
        moved > 100.0 * abs,
        "the adapter barely changes the output: {moved:.3e}"
    );
}

#[test]
fn sites_are_named_as_diffusers_names_modules() {
    let mut unet = sd1(AttentionBackend::Sdpa);
    let names = site_names(&mut unet).unwrap();
    let has = |n: &str, k: SiteKind| names.iter().any(|(m, kind)| m == n && *kind == k);
    for (n, k) in [
        ("conv_in", SiteKind::Conv2d),
        ("time_embedding.linear_1", SiteKind::Linear),
        ("down_blocks.0.resnets.0.conv1", SiteKind::Conv2d),
        ("down_blocks.0.resnets.0.time_emb_proj", SiteKind::Linear),
        ("down_blocks.0.attentions.0.proj_in", SiteKind::Conv2d),
        (
            "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
            SiteKind::Linear,
        ),
        (
            "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_out.0",
            SiteKind::Linear,
        ),
        (
            "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.0.proj",
            SiteKind::Linear,
        ),
        (
            "down_blocks.0.attentions.0.transformer_blocks.0.ff.net.2",
            SiteKind::Linear,
        ),
        ("down_blocks.0.downsamplers.0.conv", SiteKind::Conv2d),
        ("down_blocks.1.resnets.0.conv_shortcut", SiteKind::Conv2d),
        (
            "mid_block.attentions.0.transformer_blocks.0.attn1.to_v",
            SiteKind::Linear,
        ),
        ("up_blocks.0.upsamplers.0.conv", SiteKind::Conv2d),
        ("up_blocks.1.attentions.1.proj_out", SiteKind::Conv2d),
        ("conv_out", SiteKind::Conv2d),
    ] {
        assert!(has(n, k), "site {n} ({k:?}) missing");
    }
    // every name is a real module of the diffusers state dict
    let bytes =
        std::fs::read(fixtures().join("sd1/unet/diffusion_pytorch_model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (n, _) in &names {
        assert!(
            st.tensor(&format!("{n}.weight")).is_ok(),
            "{n}.weight not in the checkpoint"
        );
    }
    let n_weights = st
        .names()
        .iter()
        .filter(|k| k.ends_with(".weight") && st.tensor(k).unwrap().shape().len() >= 2)
        .count();
    assert_eq!(
        names.len(),
        n_weights,
        "every linear and conv weight is a site"
    );
    assert_eq!(unet.frozen_param_count(), Some(unet.num_params()));
}

#[test]
fn half_precision_weights_stay_close() {
    tch::set_num_threads(1);
    let unet = UNet2DConditionModel::from_diffusers(
        &fixtures().join("sd1"),
        &opts(Kind::BFloat16, AttentionBackend::Sdpa),
    )
    .unwrap();
    assert_eq!(unet.kind(), Kind::BFloat16);
    let out = run(&unet, "sd1");
    assert_eq!(out.kind(), Kind::BFloat16);
    let (abs, rel) = diff(&out, &r("sd1.out"));
    println!("bf16: max abs diff {abs:.3e}, relative {rel:.3e}");
    assert!(rel < 0.05, "bf16: relative diff {rel:.3e}");
}

#[test]
fn bad_configs_name_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let base: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("sd1/unet/config.json")).unwrap(),
    )
    .unwrap();
    let cases = [
        ("unknown_key", serde_json::json!(3), "unknown_key"),
        (
            "class_embed_type",
            serde_json::json!("timestep"),
            "class_embed_type",
        ),
        (
            "num_attention_heads",
            serde_json::json!(8),
            "num_attention_heads",
        ),
        (
            "down_block_types",
            serde_json::json!(["SimpleCrossAttnDownBlock2D", "DownBlock2D"]),
            "SimpleCrossAttnDownBlock2D",
        ),
        (
            "addition_embed_type",
            serde_json::json!("text"),
            "addition_embed_type",
        ),
    ];
    for (key, value, needle) in cases {
        let mut cfg = base.clone();
        cfg[key] = value;
        std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
        std::fs::copy(
            fixtures().join("sd1/unet/diffusion_pytorch_model.safetensors"),
            dir.path().join("diffusion_pytorch_model.safetensors"),
        )
        .unwrap();
        let e = UNet2DConditionModel::from_diffusers(dir.path(), &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{key}: {e}");
    }
    // a mismatching weight file names the tensor
    let mut cfg = base.clone();
    cfg["cross_attention_dim"] = serde_json::json!(48);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    let e = UNet2DConditionModel::from_diffusers(dir.path(), &LoadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("attn2.to_k.weight"), "{e}");
    // the presets describe the published models
    let p = UNetConfig::sd15().plan().unwrap();
    assert_eq!((p.heads.clone(), p.time_embed_dim), (vec![8; 4], 1280));
    let p = UNetConfig::sdxl_base().plan().unwrap();
    assert_eq!(
        (p.heads.clone(), p.transformer_layers.clone(), p.text_time),
        (vec![5, 10, 20], vec![1, 2, 10], Some((256, 2816)))
    );
}

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    let _lock = rng_lock();
    use lora_core::config::{LoraConfig, TargetModules};
    let mut unet = sd1(AttentionBackend::Sdpa);
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    lora_core::formats::peft::load_adapter(
        &mut unet,
        &fixtures().join("lora"),
        "default",
        &vs.root(),
    )
    .unwrap();
    // a second adapter with dropout on the time embedding and the projections: gradients must
    // reach the time embedding through every ResNet, and recomputation must redraw the same masks
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 2.0,
        lora_dropout: 0.2,
        target_modules: Some(TargetModules::List(vec![
            "time_embedding.linear_1".into(),
            "time_embedding.linear_2".into(),
            "proj_in".into(),
            "ff.net.2".into(),
        ])),
        ..LoraConfig::default()
    };
    lora_core::inject::inject(&mut unet, &cfg, "extra", &vs.root()).unwrap();
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    assert!(vars.len() > 40);
    let target = r("sd1.out").randn_like();
    let ctx = r("sd1.ctx").set_requires_grad(true);
    let mut run = |ck: bool| -> (f64, Vec<Tensor>, Tensor) {
        unet.set_gradient_checkpointing(ck);
        for v in &vars {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        let mut gc = ctx.grad();
        if gc.defined() {
            let _ = gc.zero_();
        }
        tch::manual_seed(11);
        let loss = unet
            .loss_backward(
                &r("sd1.sample"),
                &r("sd1.t"),
                &ctx,
                None,
                true,
                0.5,
                |pred| Ok(pred.f_sub(&target)?.f_square()?.f_mean(Kind::Float)?),
            )
            .unwrap();
        let after = Tensor::randn([4], (Kind::Float, tch::Device::Cpu));
        let grads = vars
            .iter()
            .map(|v| v.grad().copy())
            .chain([after])
            .collect();
        (loss.double_value(&[]), grads, ctx.grad().copy())
    };
    let (l_plain, g_plain, c_plain) = run(false);
    let (l_ck, g_ck, c_ck) = run(true);
    assert!((l_plain - l_ck).abs() < 1e-9, "{l_plain} vs {l_ck}");
    let mut worst = 0.0f64;
    for (a, b) in g_plain.iter().zip(&g_ck) {
        let scale = f64::try_from(a.abs().max()).unwrap().max(1e-12);
        worst = worst.max(f64::try_from((a - b).abs().max()).unwrap() / scale);
    }
    let (_, ctx_rel) = diff(&c_ck, &c_plain);
    println!(
        "checkpointing: loss {l_ck:.6}, worst relative gradient diff {worst:.3e}, context grad {ctx_rel:.3e}"
    );
    assert!(worst < 1e-4, "gradients differ: {worst:.3e}");
    assert!(ctx_rel < 1e-4);
    // gradients reach the time embedding (through every ResNet) and the first conv1
    for needle in [
        "time_embedding.linear_1.lora_B",
        "down_blocks.0.resnets.0.conv1.lora_A",
    ] {
        let i = named.iter().position(|(n, _)| n.contains(needle)).unwrap();
        assert!(
            f64::try_from(g_ck[i].abs().sum(Kind::Float)).unwrap() > 0.0,
            "{needle}: zero gradient"
        );
    }
}
