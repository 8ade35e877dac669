//! The Stable Diffusion LoRA job end to end on CPU, and its adapters against diffusers 0.42.1.
//!
//! `tests/sd_interop/make_pipeline.py` writes a tiny SD 1.x-style pipeline with random weights
//! (diffusers `StableDiffusionPipeline.save_pretrained`) and a kohya folder of 16 real emoji with
//! openmoji captions; `examples/configs/sd15-emoji-tiny.yaml` is trained on it (60 steps);
//! `tests/sd_interop/check_adapters.py` loads the kohya file we wrote into diffusers and makes a
//! PEFT adapter with diffusers for us to load.

use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::sd::{self, SdRunSummary};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use tch::{Kind, Tensor};

use crate::sd_fixture::{make_pipeline, root, script};

/// UNet modules adapted by the example config: 4 transformers (down 0, mid, up 1 twice) ×
/// (2 attentions × 4 projections + `proj_in` + `proj_out`).
const MODULES: usize = 4 * (2 * 4 + 2);
/// Text-encoder modules (`train_text_encoder: true`): 2 layers × `q/k/v/out_proj`.
const TE_MODULES: usize = 2 * 4;

use crate::serial;

struct Run {
    dir: PathBuf,
    summary: SdRunSummary,
}

fn config(dir: &Path, out: &str) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/sd15-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg
}

/// Builds the fixture and runs the job once per test binary.
fn run() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        // alone: the measured peaks of this run and of the plan tests are process-wide counts
        let _serial = serial();
        // one folder per test binary, emptied at each start (a static is never dropped)
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sd_job");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        make_pipeline(&dir, &["--single-file"]);
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
fn sd_job_lowers_the_fixed_noise_loss_and_writes_samples_and_a_kohya_file() {
    let r = run();
    let s = &r.summary;
    let out = r.dir.as_path().join("out");
    assert_eq!(s.steps, 60);
    assert_eq!(s.images, 16);
    assert_eq!(s.items, 32, "2 repeats of 16 images");
    // no flip / random crop: each image is encoded once and then served from the cache
    assert_eq!(s.vae_encodings, 16);
    let cached = walk(&out.join("latent_cache"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "latent"))
        .count();
    assert_eq!(cached, 16);
    // the same images, noise and timesteps before and after: the adapter lowered the loss
    eprintln!(
        "fixed-noise loss {:.5} → {:.5}",
        s.eval_loss_before, s.eval_loss_after
    );
    assert!(s.eval_loss_before.is_finite() && s.eval_loss_after.is_finite());
    assert!(
        s.eval_loss_after < 0.9 * s.eval_loss_before,
        "loss {} → {}",
        s.eval_loss_before,
        s.eval_loss_after
    );
    // samples at step 30 and 60: 2 prompts side by side at 32 × 32
    for step in [30, 60] {
        let p = out.join(format!("samples/step-{step}.png"));
        let img = image::open(&p).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (2 * 32, 32), "{}", p.display());
        let (lo, hi) = img
            .pixels()
            .fold((255u8, 0u8), |(lo, hi), px| (lo.min(px[0]), hi.max(px[0])));
        assert!(hi > lo, "a flat sample image");
    }
    // kohya file: lora_unet_ names, f32 0-d alpha = 4, ss_* metadata
    let kohya = out.join("emoji-tiny.safetensors");
    let t = read(&kohya);
    let name = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q";
    let down = get(&t, &format!("{name}.lora_down.weight"));
    let up = get(&t, &format!("{name}.lora_up.weight"));
    assert_eq!(down.size(), [8, 32]);
    assert_eq!(up.size(), [32, 8]);
    assert!(up.abs().max().double_value(&[]) > 0.0, "B was trained");
    let alpha = get(&t, &format!("{name}.alpha"));
    assert_eq!(alpha.kind(), Kind::Float);
    assert_eq!(alpha.dim(), 0);
    assert_eq!(alpha.double_value(&[]), 4.0);
    // 4 transformers (down 0, mid, up 1 ×2) × (2 attentions × 4 projections + proj_in, proj_out)
    assert_eq!(t.len(), 3 * (MODULES + TE_MODULES));
    let te = get(
        &t,
        "lora_te_text_model_encoder_layers_1_self_attn_out_proj.lora_up.weight",
    );
    assert!(
        te.abs().max().double_value(&[]) > 0.0,
        "text-encoder B was trained"
    );
    let h = lora_train::core::formats::read_header(&kohya).unwrap();
    assert_eq!(h.metadata["ss_base_model_version"], "sd_v1");
    assert_eq!(h.metadata["ss_v2"], "False");
    assert_eq!(h.metadata["ss_network_train_unet_only"], "False");
    assert_eq!(h.metadata["ss_network_dim"], "8");
    assert_eq!(h.metadata["ss_network_module"], "networks.lora");
    // diffusers layout too
    let d = read(&out.join("emoji-tiny/pytorch_lora_weights.safetensors"));
    assert_eq!(d.len(), 2 * (MODULES + TE_MODULES));
    let b = get(
        &d,
        "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.lora_B.weight",
    );
    assert!(
        max_abs(&b, &(&up * 0.5)) < 1e-7,
        "diffusers B = kohya up · alpha/r"
    );
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[test]
fn kohya_adapter_loads_in_diffusers_and_a_diffusers_peft_adapter_loads_in_ours() {
    let r = run();
    let dir = r.dir.as_path();
    let pipe = dir.join("pipeline");
    let kohya = dir.join("out/emoji-tiny.safetensors");
    let check = dir.join("check");
    script(
        "check_adapters.py",
        &[
            "--pipeline".as_ref(),
            pipe.as_os_str(),
            "--kohya".as_ref(),
            kohya.as_os_str(),
            "--out".as_ref(),
            check.as_os_str(),
        ],
    );
    let _serial = serial();
    let inputs = read(&check.join("inputs.safetensors"));
    let outputs = read(&check.join("outputs.safetensors"));
    let (x, t, ctx) = (
        get(&inputs, "sample"),
        get(&inputs, "timesteps"),
        get(&inputs, "encoder_hidden_states"),
    );
    // diffusers put our adapter on every module we trained
    assert_eq!(
        get(&outputs, "kohya_modules").int64_value(&[0]),
        MODULES as i64
    );
    assert_eq!(
        get(&outputs, "kohya_te_modules").int64_value(&[0]),
        TE_MODULES as i64
    );
    let ids = get(&outputs, "te_ids");
    // (UNet output, text-encoder output) of our pipeline with the adapter file loaded
    let forward_both = |adapter: Option<&Path>, expect: Option<(usize, usize)>| {
        let mut p = sd::SdPipeline::from_diffusers(&pipe, Kind::Float, tch::Device::Cpu).unwrap();
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        if let Some(a) = adapter {
            let n = sd::load_adapter(&mut p, a, "default", &vs.root()).unwrap();
            if let Some((u, te)) = expect {
                assert_eq!((n.unet_modules, n.text_encoder_modules), (u, te));
            }
        }
        tch::no_grad(|| {
            (
                p.unet.forward(&x, &t, &ctx, None).unwrap(),
                p.condition(&ids, None, false).unwrap().hidden,
            )
        })
    };
    let forward = |adapter: Option<&Path>| forward_both(adapter, None).0;
    let base = get(&outputs, "base");
    let ours_base = forward(None);
    let tol = 1e-4;
    assert!(max_abs(&ours_base, &base) < tol, "base UNet");
    // our kohya adapter in diffusers = our adapter in ours (UNet and text encoder)
    let theirs = get(&outputs, "kohya");
    let (ours, ours_te) = forward_both(Some(&kohya), Some((MODULES, TE_MODULES)));
    let (te_base, te_theirs) = (get(&outputs, "te_base"), get(&outputs, "te_kohya"));
    let te_effect = max_abs(&te_theirs, &te_base);
    let te_diff = max_abs(&ours_te, &te_theirs);
    eprintln!(
        "kohya adapter, text encoder: effect {te_effect:.3e}, ours vs diffusers {te_diff:.3e}"
    );
    assert!(
        te_effect > 1e-3,
        "the text-encoder adapter changes the output ({te_effect})"
    );
    assert!(te_diff < tol * te_effect.max(1.0), "{te_diff}");
    let effect = max_abs(&theirs, &base);
    let diff = max_abs(&ours, &theirs);
    eprintln!("kohya adapter: effect {effect:.3e}, ours vs diffusers {diff:.3e}");
    assert!(effect > 1e-3, "the adapter changes the output ({effect})");
    assert!(diff < tol * effect.max(1.0), "{diff}");
    // diffusers' own PEFT adapter in ours = in diffusers
    let theirs = get(&outputs, "peft");
    let ours = forward(Some(&check.join("peft/pytorch_lora_weights.safetensors")));
    let effect = max_abs(&theirs, &base);
    let diff = max_abs(&ours, &theirs);
    eprintln!("diffusers PEFT adapter: effect {effect:.3e}, ours vs diffusers {diff:.3e}");
    assert!(effect > 1e-3, "the adapter changes the output ({effect})");
    assert!(diff < tol * effect.max(1.0), "{diff}");
}

#[test]
fn each_save_writes_a_loadable_adapter_beside_the_checkpoint_named_as_kohya_names_it() {
    let r = run();
    let out = r.dir.join("out");
    let fin = read(&out.join("emoji-tiny.safetensors"));
    let s30 = read(&out.join("emoji-tiny-step00000030.safetensors"));
    let s60 = read(&out.join("emoji-tiny-step00000060.safetensors"));
    let names = |ts: &[(String, Tensor)]| {
        let mut n: Vec<String> = ts.iter().map(|(n, _)| n.clone()).collect();
        n.sort();
        n
    };
    assert_eq!(names(&s30), names(&fin));
    assert_eq!(names(&s60), names(&fin));
    // the step-60 snapshot is the state the final file holds; step 30 is half-way
    let (mut at60, mut at30) = (0f64, 0f64);
    for (name, t) in &fin {
        at60 = at60.max(max_abs(t, &get(&s60, name)));
        at30 = at30.max(max_abs(t, &get(&s30, name)));
    }
    assert_eq!(at60, 0.0);
    assert!(at30 > 1e-4, "{at30}");
    // the diffusers layout too (the run's second export format)
    assert!(
        out.join("emoji-tiny-step00000030/pytorch_lora_weights.safetensors")
            .is_file()
    );
}

#[test]
fn a_run_resumed_from_its_step_30_checkpoint_with_loader_workers_ends_with_the_same_adapter() {
    let r = run();
    let _serial = serial();
    let ck = r.dir.join("out/checkpoints/step-00000030");
    assert!(ck.is_dir(), "{} missing", ck.display());
    // the first run decoded images in the training thread; this one has two workers that
    // decode ahead (kept between epochs): the same images, crops and captions reach the step
    let mut cfg = config(&r.dir, "resumed");
    assert_eq!(cfg.data_loader.num_workers, 0);
    cfg.data_loader.num_workers = 2;
    cfg.data_loader.prefetch_factor = 3;
    cfg.data_loader.persistent_workers = true;
    let s = sd::run(
        cfg,
        &RunOptions {
            resume: Some(Some(ck)),
            ..RunOptions::default()
        },
    )
    .unwrap();
    assert_eq!(s.steps, 60);
    assert_eq!(
        s.losses.first().map(|l| l.0),
        Some(31),
        "trained steps 31-60 only"
    );
    let a = read(&r.dir.join("out/emoji-tiny.safetensors"));
    let b = read(&r.dir.join("resumed/emoji-tiny.safetensors"));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    for (name, t) in &a {
        worst = worst.max(max_abs(t, &get(&b, name)));
    }
    eprintln!("resumed vs uninterrupted adapter: max |diff| {worst:.3e}");
    assert!(worst < 1e-5, "{worst}");
    // the same per-step losses after the resume point
    for (x, y) in r.summary.losses[30..].iter().zip(&s.losses) {
        assert_eq!(x.0, y.0);
        assert!((x.1 - y.1).abs() < 1e-5, "step {}: {} vs {}", x.0, x.1, y.1);
    }
}

#[test]
fn the_sd15_character_config_reads_as_written_and_bad_sd_keys_are_named() {
    use lora_train::config::{ModelKind, OptimizerName, TargetModules};
    let c = TrainConfig::from_file(root().join("examples/configs/sd15-character.yaml")).unwrap();
    assert_eq!(c.model.kind, ModelKind::Sd15);
    assert_eq!((c.lora.rank, c.lora.alpha), (16, 8.0));
    assert_eq!(
        c.lora.target_modules,
        TargetModules::List(
            [
                "to_q",
                "to_k",
                "to_v",
                "to_out.0",
                "proj_in",
                "proj_out",
                "ff.net.0.proj",
                "ff.net.2"
            ]
            .map(String::from)
            .to_vec()
        )
    );
    assert_eq!(c.data.resolution, Some([512, 512]));
    assert_eq!(c.train.optimizer, OptimizerName::AdamW8bit);
    assert_eq!(c.train.noise_offset, 0.05);
    assert_eq!(c.train.min_snr_gamma, Some(5.0));
    assert_eq!(c.train.clip_skip, Some(1));
    assert_eq!(c.logging.sample_every_n_steps, 250);
    assert_eq!(c.logging.sample_prompts.len(), 2);
    assert_eq!(c.logging.sample_sampler, "euler");
    assert_eq!(c.logging.sample_steps, 25);
    // a diffusers folder goes to the SD job even with model.kind left at auto
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("model_index.json"), "{}").unwrap();
    let mut auto = c.clone();
    auto.model.kind = ModelKind::Auto;
    auto.model.base_model = Some(dir.path().display().to_string());
    assert!(lora_train::sd_plan::wants_sd_job(&auto, None));
    auto.model.base_model = Some(root().join("Cargo.toml").display().to_string());
    assert!(!lora_train::sd_plan::wants_sd_job(&auto, None));
    // kohya spellings, and errors that name the key
    let c = TrainConfig::from_toml_str(
        "noise_offset = 0.1\nmin_snr_gamma = 5.0\nclip_skip = 2\nsample_every_n_steps = 10\nsample_sampler = \"euler\"\n",
    )
    .unwrap();
    assert_eq!(c.train.noise_offset, 0.1);
    assert_eq!(c.train.min_snr_gamma, Some(5.0));
    assert_eq!(c.train.clip_skip, Some(2));
    assert_eq!(c.logging.sample_every_n_steps, 10);
    assert_eq!(c.logging.sample_sampler, "euler");
    for (text, key) in [
        ("train:\n  min_snr_gama: 5\n", "min_snr_gamma"),
        ("train:\n  prediction_type: x0\n", "v_prediction"),
        ("train:\n  noise_offset: -0.1\n", "train.noise_offset"),
        ("logging:\n  sample_sampler: dpm\n", "euler"),
        ("model:\n  kind: sd3\n", "sd15"),
    ] {
        let e = TrainConfig::from_yaml_str(text).unwrap_err().to_string();
        assert!(e.contains(key), "{text:?}: {e}");
    }
}

#[test]
fn v_prediction_noise_offset_checkpointing_bf16_and_euler_samples_run_end_to_end() {
    let r = run();
    let _serial = serial();
    let mut cfg = config(&r.dir, "variants");
    cfg.train.max_steps = Some(4);
    cfg.train.prediction_type = Some("v_prediction".into());
    cfg.train.noise_offset = 0.1;
    cfg.train.gradient_checkpointing = true;
    cfg.train.train_text_encoder = false;
    cfg.train.mixed_precision = lora_train::config::Precision::Bf16;
    cfg.train.save_every_n_steps = None;
    cfg.logging.sample_every_n_steps = 2;
    cfg.logging.sample_sampler = "euler".into();
    cfg.logging.sample_steps = 4;
    cfg.data.cache_latents = Some(false);
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 4);
    assert!(s.losses.iter().all(|(_, l)| l.is_finite() && *l > 0.0));
    assert!(s.eval_loss_before.is_finite() && s.eval_loss_after.is_finite());
    // the text encoder is frozen: the kohya file holds UNet modules only
    let t = read(&r.dir.join("variants/emoji-tiny.safetensors"));
    assert_eq!(t.len(), 3 * MODULES);
    assert!(!r.dir.join("variants/latent_cache").exists());
    for step in [2, 4] {
        assert!(
            r.dir
                .join(format!("variants/samples/step-{step}.png"))
                .is_file()
        );
    }
}

#[test]
fn an_sd15_single_file_loads_like_the_folder() {
    let r = run();
    let _serial = serial();
    let folder_dir = r.dir.join("pipeline");
    let file = r.dir.join("single/model.safetensors");
    assert!(lora_train::sd_plan::is_sd_model(&file));
    assert!(
        !lora_train::sd_plan::is_sd_model(&r.dir.join("out/emoji-tiny.safetensors")),
        "an adapter is not a model"
    );
    let (k, d) = (Kind::Float, tch::Device::Cpu);
    let folder = sd::SdPipeline::from_diffusers(&folder_dir, k, d).unwrap();
    // a tokenizer folder alone does not describe the tiny UNet: SD 1.5's config is assumed
    let e = sd::SdPipeline::from_single_file(&file, Some(&folder_dir.join("tokenizer")), k, d)
        .unwrap_err()
        .to_string();
    assert!(e.contains("UNet"), "{e}");
    let single = sd::SdPipeline::from_single_file(&file, Some(&folder_dir), k, d).unwrap();
    assert!(!single.is_sdxl());
    let _g = tch::no_grad_guard();
    tch::manual_seed(3);
    let x = Tensor::randn([2, 4, 8, 8], (Kind::Float, d));
    let t = Tensor::from_slice(&[10i64, 700]);
    let prompts = ["emoji, grinning face", "emoji"];
    let out = |p: &sd::SdPipeline| {
        let c = p.encode_prompts(&prompts).unwrap();
        let y = p.predict(&x, &t, &c, None, false).unwrap();
        let z = p
            .encode_images(&x.narrow(1, 0, 3).repeat([1, 1, 2, 2]).tanh())
            .unwrap();
        (y, c.hidden, z)
    };
    let (a, b) = (out(&folder), out(&single));
    for (what, u, v) in [
        ("UNet", &a.0, &b.0),
        ("text encoder", &a.1, &b.1),
        ("VAE", &a.2, &b.2),
    ] {
        let diff = max_abs(u, v);
        eprintln!("SD 1.x single file vs folder, {what}: max |diff| {diff:.3e}");
        assert_eq!(diff, 0.0, "{what}");
    }
}

/// The kohya file of a run: its tensors, and the LoCon `lora_down` weights among them (4-d,
/// `[rank, in, 3, 3]`).
fn kohya_file(path: &Path) -> (Vec<(String, Tensor)>, Vec<(String, Vec<i64>)>) {
    let t = read(path);
    let conv = t
        .iter()
        .filter(|(n, w)| n.ends_with(".lora_down.weight") && w.dim() == 4 && w.size()[2] == 3)
        .map(|(n, w)| (n.clone(), w.size()))
        .collect();
    (t, conv)
}

#[test]
fn a_kohya_toml_as_the_gui_exports_it_plans_and_trains_two_steps() {
    let r = run();
    let _serial = serial();
    let out = r.dir.join("kohya-toml");
    let toml = format!(
        r#"# sections as kohya_ss writes them; every value as a kohya user writes it
[model_arguments]
pretrained_model_name_or_path = "{pipe}"
v2 = false
v_parameterization = false

[additional_network_arguments]
network_module = "networks.lora"
network_dim = 4
network_alpha = 2
network_args = [ "conv_dim=2", "conv_alpha=1",]
unet_lr = 1e-3
text_encoder_lr = 5e-4
network_train_unet_only = false

[optimizer_arguments]
optimizer_type = "AdamW"
learning_rate = 1e-3
max_grad_norm = 1.0
lr_scheduler = "cosine"
lr_warmup_steps = 0.5
optimizer_args = [ "weight_decay=0.01", "betas=0.9,0.99",]

[dataset_arguments]
train_data_dir = "{data}"
resolution = "32,32"
enable_bucket = false
caption_extension = ".txt"
shuffle_caption = true
keep_tokens = 1
flip_aug = true
cache_latents = true
cache_latents_to_disk = true
max_data_loader_n_workers = 1
persistent_data_loader_workers = true

[training_arguments]
output_dir = "{out}"
output_name = "kohya-toml"
save_model_as = "safetensors"
save_precision = "fp16"
save_every_n_steps = 1
save_last_n_steps = 1
train_batch_size = 2
max_train_steps = 2
mixed_precision = "no"
xformers = true
sdpa = false
seed = 7
min_snr_gamma = 5.0
multires_noise_iterations = 6
multires_noise_discount = 0.3
clip_skip = 1
max_token_length = 75

[logging_arguments]
logging_dir = "{out}/logs"
log_prefix = "kohya-"
"#,
        pipe = r.dir.join("pipeline").display(),
        data = r.dir.join("data").display(),
        out = out.display(),
    );
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("config.toml");
    std::fs::write(&file, toml).unwrap();
    let cfg = TrainConfig::from_file(&file).unwrap();
    assert_eq!(
        cfg.train.export_formats,
        vec![lora_train::config::ExportFormat::Kohya],
        "sd-scripts writes one kohya file"
    );
    // warned, not refused: xformers and max_token_length have no effect here
    let notes = cfg.notes();
    assert!(notes.iter().any(|n| n.contains("xformers")), "{notes:#?}");
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    let plan = s.plan.as_ref().expect("planned before training");
    assert!(plan.estimate.peak_allocated.0 > 0);
    assert_eq!(s.steps, 2);
    assert!(s.losses.iter().all(|(_, l)| l.is_finite()));
    let (t, conv) = kohya_file(&out.join("kohya-toml.safetensors"));
    assert!(!conv.is_empty(), "no LoCon conv weights");
    assert!(conv.iter().all(|(_, shape)| shape[0] == 2), "{conv:?}");
    assert!(
        t.iter()
            .all(|(n, w)| n.ends_with(".alpha") || w.kind() == Kind::Half),
        "save_precision fp16"
    );
    assert!(
        t.iter().any(|(n, _)| n.starts_with("lora_te_")),
        "text_encoder_lr > 0"
    );
    // one file per save, kohya-named; save_last_n_steps 1 keeps the saves of the last step
    // before this one too (kohya removes step − n − 1 = 0 at step 2: nothing yet)
    for step in [1, 2] {
        let f = out.join(format!("kohya-toml-step{step:08}.safetensors"));
        assert!(f.is_file(), "{} missing", f.display());
    }
    // kohya's single file only: no diffusers folder beside it
    assert!(!out.join("kohya-toml").exists());
    // logging_dir turns TensorBoard on, in a run folder named with kohya's prefix
    let logs: Vec<_> = std::fs::read_dir(out.join("logs/kohya-kohya-toml/tensorboard"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        logs.iter().any(|n| n.starts_with("events.out.tfevents")),
        "{logs:?}"
    );
}

#[test]
fn a_kohya_ss_gui_json_plans_and_trains_two_steps() {
    let r = run();
    let _serial = serial();
    let out = r.dir.join("gui-json");
    std::fs::create_dir_all(&out).unwrap();
    let mut gui: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("tests/fixtures/kohya/kohya_ss_gui_locon.json"),
        )
        .unwrap(),
    )
    .unwrap();
    // the GUI's saved file, pointed at the tiny pipeline and sized for CI (strings where the
    // GUI writes strings)
    for (k, v) in [
        (
            "pretrained_model_name_or_path",
            serde_json::json!(r.dir.join("pipeline").display().to_string()),
        ),
        ("model_list", serde_json::json!("custom")),
        (
            "train_data_dir",
            serde_json::json!(r.dir.join("data").display().to_string()),
        ),
        ("output_dir", serde_json::json!(out.display().to_string())),
        (
            "logging_dir",
            serde_json::json!(out.join("logs").display().to_string()),
        ),
        ("max_resolution", serde_json::json!("32,32")),
        ("enable_bucket", serde_json::json!(false)),
        ("epoch", serde_json::json!("")),
        ("max_train_steps", serde_json::json!("2")),
        ("gradient_accumulation_steps", serde_json::json!(1)),
        ("network_dim", serde_json::json!(4)),
        ("network_alpha", serde_json::json!("2")),
        ("conv_dim", serde_json::json!("2")),
        ("sample_every_n_epochs", serde_json::json!(0)),
        ("sample_prompts", serde_json::json!("")),
    ] {
        gui[k] = v;
    }
    let file = out.join("gui.json");
    std::fs::write(&file, serde_json::to_string_pretty(&gui).unwrap()).unwrap();
    let cfg = TrainConfig::from_file(&file).unwrap();
    assert_eq!(cfg.lora.conv_rank, Some(2));
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    assert!(s.plan.is_some());
    assert_eq!(s.steps, 2);
    assert!(s.losses.iter().all(|(_, l)| l.is_finite()));
    let (t, conv) = kohya_file(&out.join("locon-test.safetensors"));
    assert!(
        !conv.is_empty() && conv.iter().all(|(_, shape)| shape[0] == 2),
        "{conv:?}"
    );
    assert!(
        t.iter()
            .all(|(n, w)| n.ends_with(".alpha") || w.kind() == Kind::Half),
        "the GUI's save_precision fp16"
    );
}
