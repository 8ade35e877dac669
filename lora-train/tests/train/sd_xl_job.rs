//! The SD job on an SDXL pipeline end to end on CPU, and its adapters against diffusers 0.42.1.
//!
//! `tests/sd_interop/make_pipeline.py --sdxl` writes a tiny SDXL-style pipeline with random
//! weights (diffusers `StableDiffusionXLPipeline.save_pretrained`: two text encoders, the
//! second with projection, a `text_time` UNet) and a kohya folder of 16 real emoji;
//! `examples/configs/sdxl-emoji-tiny.yaml` is trained on it (40 steps, LoRA on the UNet and
//! both text encoders); `tests/sd_interop/check_adapters_xl.py` loads the files we wrote into
//! diffusers and makes a PEFT adapter with diffusers for us to load. The same weights are also
//! written as one original `sgm`-layout checkpoint (`single/model.safetensors`, checked there
//! with diffusers' converters), which the job reads as a single file.

use lora_train::config::TrainConfig;
use lora_train::core::inject::Adaptable;
use lora_train::job::RunOptions;
use lora_train::sd::{self, SdRunSummary};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Kind, Tensor};

use crate::sd_fixture::{make_pipeline, root, script};

/// UNet modules adapted by the example config: 4 attentions (down_blocks.1: 1, mid: 1,
/// up_blocks.0: 2) with `proj_in` + `proj_out`, holding 8 transformer blocks (2 layers each) ×
/// (attn1 and attn2 × to_q/to_k/to_v/to_out.0 + ff.net.0.proj + ff.net.2).
const MODULES: usize = 4 * 2 + 8 * (2 * 4 + 2);
/// UNet modules of the adapter diffusers makes in `check_adapters_xl.py`: 8 blocks × (attn1,
/// attn2) × (to_q, to_k, to_v, to_out.0).
const PEFT_MODULES: usize = 8 * 2 * 4;
/// Text-encoder modules per encoder (`train_text_encoder: true`): 2 layers × q/k/v/out_proj.
const TE_MODULES: usize = 2 * 4;

use crate::serial;

struct Run {
    dir: PathBuf,
    summary: SdRunSummary,
}

fn config(dir: &Path, out: &str) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/sdxl-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline_xl").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg
}

fn run() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sd_xl_job");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        make_pipeline(&dir, &["--sdxl", "--single-file"]);
        let _serial = serial();
        let summary = sd::run(
            config(&dir, "out"),
            &RunOptions {
                verbose: true,
                ..RunOptions::default()
            },
        )
        .unwrap();
        Run { dir, summary }
    })
}

fn read(path: &Path) -> Vec<(String, Tensor)> {
    Tensor::read_safetensors(path).unwrap()
}

fn get(ts: &[(String, Tensor)], name: &str) -> Tensor {
    ts.iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} missing"))
        .1
        .shallow_clone()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn sdxl_job_lowers_the_fixed_noise_loss_and_writes_te1_te2_adapters() {
    let r = run();
    let s = &r.summary;
    let out = r.dir.join("out");
    assert_eq!(s.steps, 30);
    assert_eq!((s.images, s.items), (16, 32));
    assert_eq!(s.vae_encodings, 16, "each image encoded once");
    eprintln!(
        "SDXL fixed-noise loss {:.5} → {:.5}",
        s.eval_loss_before, s.eval_loss_after
    );
    assert!(
        s.eval_loss_after < 0.9 * s.eval_loss_before,
        "loss {} → {}",
        s.eval_loss_before,
        s.eval_loss_after
    );
    // one sample grid at the end: 2 prompts side by side at 32 × 32, guidance 5
    let img = image::open(out.join("samples/step-30.png"))
        .unwrap()
        .to_rgb8();
    assert_eq!(img.dimensions(), (2 * 32, 32));
    // kohya: lora_unet_ / lora_te1_ / lora_te2_, SDXL metadata
    let kohya = out.join("emoji-xl-tiny.safetensors");
    let t = read(&kohya);
    assert_eq!(t.len(), 3 * (MODULES + 2 * TE_MODULES));
    let te_up = |prefix: &str, layer: usize| {
        get(
            &t,
            &format!(
                "{prefix}_text_model_encoder_layers_{layer}_self_attn_out_proj.lora_up.weight"
            ),
        )
        .abs()
        .max()
        .double_value(&[])
    };
    assert!(te_up("lora_te1", 0) > 0.0, "text_encoder trained");
    assert!(te_up("lora_te2", 1) > 0.0, "text_encoder_2 trained");
    // SDXL reads text_encoder's penultimate state: its last layer gets no gradient
    assert_eq!(te_up("lora_te1", 1), 0.0);
    assert!(!t.iter().any(|(k, _)| k.starts_with("lora_te_")));
    let h = lora_train::core::formats::read_header(&kohya).unwrap();
    assert_eq!(h.metadata["ss_base_model_version"], "sdxl_base_v1-0");
    assert_eq!(h.metadata["ss_v2"], "False");
    assert_eq!(h.metadata["ss_network_train_unet_only"], "False");
    // diffusers layout: unet., text_encoder., text_encoder_2.
    let d = read(&out.join("emoji-xl-tiny/pytorch_lora_weights.safetensors"));
    assert_eq!(d.len(), 2 * (MODULES + 2 * TE_MODULES));
    let b = get(
        &d,
        "text_encoder_2.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight",
    );
    let up = get(
        &t,
        "lora_te2_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight",
    );
    assert!(max_abs(&b, &(&up * 0.5)) < 1e-7, "B = up · alpha/r");
}

/// Our kohya file with the UNet modules renamed as sd-scripts names SDXL modules (original
/// `input_blocks` / `middle_block` / `output_blocks` paths).
fn write_sgm_named(pipe: &mut sd::SdPipeline, from: &Path, to: &Path) -> usize {
    let mut sites = Vec::new();
    pipe.unet
        .visit_sites(&mut |s, _| {
            sites.push(s.to_string());
            Ok(())
        })
        .unwrap();
    let mut renamed = 0;
    let mut t = read(from);
    for site in &sites {
        let d = lora_train::core::formats::kohya::kohya_name("lora_unet", site);
        let Some(orig) = sd::original_unet_module(site, &pipe.unet) else {
            continue;
        };
        let o = lora_train::core::formats::kohya::kohya_name("lora_unet", &orig);
        for (k, _) in t.iter_mut() {
            if let Some(rest) = k.strip_prefix(&format!("{d}.")) {
                *k = format!("{o}.{rest}");
                renamed += 1;
            }
        }
    }
    Tensor::write_safetensors(&t, to).unwrap();
    renamed / 3
}

#[test]
fn sdxl_adapters_load_in_diffusers_with_our_outputs_and_theirs_load_in_ours() {
    let r = run();
    let dir = r.dir.as_path();
    let pipe_dir = dir.join("pipeline_xl");
    let kohya = dir.join("out/emoji-xl-tiny.safetensors");
    let diffusers_file = dir.join("out/emoji-xl-tiny/pytorch_lora_weights.safetensors");
    let sgm = dir.join("sgm_named.safetensors");
    let check = dir.join("check");
    {
        let _serial = serial();
        let mut p =
            sd::SdPipeline::from_diffusers(&pipe_dir, Kind::Float, tch::Device::Cpu).unwrap();
        assert_eq!(write_sgm_named(&mut p, &kohya, &sgm), MODULES);
    }
    let arg = |name: &str, p: &Path| format!("{name}={}", p.display());
    let (a1, a2, a3) = (
        arg("kohya", &kohya),
        arg("diffusers", &diffusers_file),
        arg("sgm", &sgm),
    );
    script(
        "check_adapters_xl.py",
        &[
            "--pipeline".as_ref(),
            pipe_dir.as_os_str(),
            "--out".as_ref(),
            check.as_os_str(),
            "--adapter".as_ref(),
            a1.as_ref(),
            "--adapter".as_ref(),
            a2.as_ref(),
            "--adapter".as_ref(),
            a3.as_ref(),
        ],
    );
    let _serial = serial();
    let inputs = read(&check.join("inputs.safetensors"));
    let outputs = read(&check.join("outputs.safetensors"));
    let i = |n: &str| get(&inputs, n);
    let o = |n: &str| get(&outputs, n);
    let (ids, ids_2) = (o("ids"), o("ids_2"));
    // (UNet output, conditioning, pooled) of our pipeline with `adapter` loaded
    let forward = |adapter: Option<&Path>| {
        let mut p =
            sd::SdPipeline::from_diffusers(&pipe_dir, Kind::Float, tch::Device::Cpu).unwrap();
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        let n = adapter.map(|a| sd::load_adapter(&mut p, a, "default", &vs.root()).unwrap());
        let _g = tch::no_grad_guard();
        let unet = p
            .unet
            .forward(
                &i("sample"),
                &i("timesteps"),
                &i("encoder_hidden_states"),
                Some((&i("text_embeds"), &i("time_ids"))),
            )
            .unwrap();
        let c = p.condition(&ids, Some(&ids_2), false).unwrap();
        (n, unet, c.hidden, c.pooled.unwrap())
    };
    let (_, base, base_te, base_pooled) = forward(None);
    let tol = 1e-4;
    assert!(max_abs(&base, &o("base")) < tol, "base UNet");
    assert!(max_abs(&base_te, &o("base_te")) < tol, "base conditioning");
    assert!(
        max_abs(&base_pooled, &o("base_pooled")) < tol,
        "base pooled"
    );
    let expect = [MODULES as i64, TE_MODULES as i64, TE_MODULES as i64];
    for (name, file) in [
        ("kohya", &kohya),
        ("diffusers", &diffusers_file),
        ("sgm", &sgm),
        ("peft", &check.join("peft/pytorch_lora_weights.safetensors")),
    ] {
        if name != "peft" {
            let m = o(&format!("{name}_modules"));
            let got: Vec<i64> = (0..3).map(|j| m.int64_value(&[j])).collect();
            assert_eq!(got, expect, "{name}: modules diffusers adapted");
        }
        let (n, unet, te, pooled) = forward(Some(file));
        let n = n.unwrap();
        assert_eq!(
            (
                n.unet_modules,
                n.text_encoder_modules,
                n.text_encoder_2_modules
            ),
            (
                if name == "peft" {
                    PEFT_MODULES
                } else {
                    MODULES
                },
                TE_MODULES,
                TE_MODULES
            ),
            "{name}: modules we adapted"
        );
        for (what, ours, theirs, b) in [
            ("UNet", &unet, o(name), &base),
            ("conditioning", &te, o(&format!("{name}_te")), &base_te),
            (
                "pooled",
                &pooled,
                o(&format!("{name}_pooled")),
                &base_pooled,
            ),
        ] {
            let effect = max_abs(&theirs, b);
            let diff = max_abs(ours, &theirs);
            eprintln!("{name} adapter, {what}: effect {effect:.3e}, ours vs diffusers {diff:.3e}");
            assert!(
                effect > 1e-3,
                "{name}: the adapter changes the {what} ({effect})"
            );
            assert!(diff < tol * effect.max(1.0), "{name} {what}: {diff}");
        }
    }
}

#[test]
fn sdxl_frozen_text_encoders_checkpointing_and_samples_without_guidance_run() {
    let r = run();
    let _serial = serial();
    let mut cfg = config(&r.dir, "variants");
    cfg.train.max_steps = Some(3);
    cfg.train.train_text_encoder = false;
    cfg.train.gradient_checkpointing = true;
    cfg.train.save_every_n_steps = None;
    cfg.data.cache_latents = Some(false);
    cfg.logging.sample_every_n_steps = 3;
    cfg.logging.sample_guidance_scale = 1.0;
    cfg.logging.sample_sampler = "ddim".into();
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 3);
    assert!(s.losses.iter().all(|(_, l)| l.is_finite() && *l > 0.0));
    let t = read(&r.dir.join("variants/emoji-xl-tiny.safetensors"));
    assert_eq!(t.len(), 3 * MODULES, "UNet modules only");
    let h =
        lora_train::core::formats::read_header(&r.dir.join("variants/emoji-xl-tiny.safetensors"))
            .unwrap();
    assert_eq!(h.metadata["ss_network_train_unet_only"], "True");
    assert!(r.dir.join("variants/samples/step-3.png").is_file());
}

#[test]
fn an_sdxl_single_file_loads_like_the_folder_and_trains() {
    let r = run();
    let _serial = serial();
    let folder_dir = r.dir.join("pipeline_xl");
    let file = r.dir.join("single/model.safetensors");
    assert!(
        lora_train::sd_plan::is_sd_model(&file),
        "a single file is recognised by its header"
    );
    let (k, d) = (Kind::Float, tch::Device::Cpu);
    let folder = sd::SdPipeline::from_diffusers(&folder_dir, k, d).unwrap();
    let single = sd::SdPipeline::from_single_file(&file, Some(&folder_dir), k, d).unwrap();
    assert!(single.is_sdxl());
    let g = tch::no_grad_guard();
    tch::manual_seed(3);
    let x = Tensor::randn([2, 4, 8, 8], (Kind::Float, d));
    let t = Tensor::from_slice(&[10i64, 700]);
    let ids = sd::sdxl_time_ids((40, 36), (0, 2), (32, 32));
    let time_ids = Tensor::from_slice(&[ids, ids].concat()).view([2, 6]);
    let prompts = ["emoji, grinning face", "emoji, smiling face with halo"];
    let out = |p: &sd::SdPipeline| {
        let c = p.encode_prompts(&prompts).unwrap();
        let y = p.predict(&x, &t, &c, Some(&time_ids), false).unwrap();
        let z = p
            .encode_images(&(x.narrow(1, 0, 3).repeat([1, 1, 2, 2]).tanh()))
            .unwrap();
        (y, c.hidden, c.pooled.unwrap(), z)
    };
    let (a, b) = (out(&folder), out(&single));
    for (what, u, v) in [
        ("UNet", &a.0, &b.0),
        ("conditioning", &a.1, &b.1),
        ("pooled (OpenCLIP projection)", &a.2, &b.2),
        ("VAE latents", &a.3, &b.3),
    ] {
        let diff = max_abs(u, v);
        eprintln!("single file vs folder, {what}: max |diff| {diff:.3e}");
        assert_eq!(diff, 0.0, "{what}");
    }
    drop(g);
    // no tokenizer beside the file and none configured: the error says what to set
    let lone = r.dir.join("lone");
    std::fs::create_dir_all(&lone).unwrap();
    std::fs::hard_link(&file, lone.join("model.safetensors"))
        .or_else(|_| std::fs::copy(&file, lone.join("model.safetensors")).map(|_| ()))
        .unwrap();
    let e = sd::SdPipeline::from_single_file(&lone.join("model.safetensors"), None, k, d)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.tokenizer") && e.contains("tokenizer_2"),
        "{e}"
    );
    // the job trains from the single file (model.kind auto, model.tokenizer = the folder)
    let mut cfg = config(&r.dir, "from_single");
    cfg.model.base_model = Some(file.display().to_string());
    cfg.model.kind = lora_train::config::ModelKind::Auto;
    cfg.model.tokenizer = Some(folder_dir.display().to_string());
    assert!(lora_train::sd_plan::wants_sd_job(&cfg, None));
    cfg.train.max_steps = Some(2);
    cfg.train.save_every_n_steps = None;
    cfg.logging.sample_prompts.clear();
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 2);
    let first = &r.summary.losses[..2];
    for (x, y) in first.iter().zip(&s.losses) {
        assert!((x.1 - y.1).abs() < 1e-5, "step {}: {} vs {}", x.0, x.1, y.1);
    }
    assert!((s.eval_loss_before - r.summary.eval_loss_before).abs() < 1e-6);
}

#[test]
fn the_sdxl_character_config_reads_as_written() {
    use lora_train::config::{ModelKind, OptimizerName};
    let c = TrainConfig::from_file(root().join("examples/configs/sdxl-character.yaml")).unwrap();
    assert_eq!(c.model.kind, ModelKind::Sdxl);
    assert_eq!(
        c.model.base_model.as_deref(),
        Some("models/sd_xl_base_1.0.safetensors")
    );
    assert_eq!(
        c.model.tokenizer.as_deref(),
        Some("models/sdxl-base-tokenizers")
    );
    assert_eq!((c.lora.rank, c.lora.alpha), (16, 8.0));
    assert_eq!(c.data.resolution, Some([1024, 1024]));
    assert_eq!(c.train.optimizer, OptimizerName::AdamW8bit);
    assert!(c.train.gradient_checkpointing && !c.train.train_text_encoder);
    assert!(
        lora_train::sd_plan::wants_sd_job(&c, None),
        "model.kind sdxl goes to the SD job"
    );
    let e = TrainConfig::from_yaml_str("model:\n  tokeniser: x\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.tokenizer"), "{e}");
}
