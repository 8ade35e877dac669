//! The FLUX.1 LoRA job end to end on CPU, and its adapters against diffusers 0.42.1.
//!
//! `tests/flux_interop/make_fixture.py` writes a tiny FLUX.1-dev-shaped pipeline with random
//! weights (diffusers `FluxPipeline.save_pretrained`) and a kohya folder of 16 real emoji with
//! openmoji captions; `examples/configs/flux-emoji-tiny.yaml` is trained on it (30 steps);
//! `tests/flux_interop/check_adapters.py` loads the diffusers file we wrote with diffusers'
//! `FluxPipeline.load_lora_weights`, applies the kohya file as ComfyUI applies a LoRA to BFL
//! weights, and runs the transformer on fixed inputs, which ours must reproduce with the same
//! files.

use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::models::flux::{FluxInputs, FluxTransformer2DModel};
use lora_train::models::sd::LoadOptions;
use lora_train::recipes::flux::run::{FluxRunSummary, run_with};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use tch::{Kind, Tensor};

use crate::sd_fixture::{python, root};
use crate::serial;

struct Run {
    dir: PathBuf,
    summary: FluxRunSummary,
}

/// Runs `tests/flux_interop/<name>` with `args`, one OpenMP thread, asserting it succeeds.
fn script(name: &str, args: &[&OsStr]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/flux_interop")
        .join(name);
    let res = Command::new(python())
        .arg(&path)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{name} failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
}

fn config(dir: &Path, out: &str) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/flux-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg
}

/// Builds the fixture and runs the job once per test binary.
fn run() -> &'static Run {
    static RUN: OnceLock<Run> = OnceLock::new();
    RUN.get_or_init(|| {
        let _serial = serial();
        // one folder per test binary, emptied at each start (a static is never dropped)
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("flux_job");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let assets = root().join("assets");
        assert!(
            assets.join("emoji/openmoji.csv").is_file(),
            "assets/emoji is missing: run `cargo xtask setup`"
        );
        script(
            "make_fixture.py",
            &[
                "--assets".as_ref(),
                assets.as_os_str(),
                "--out".as_ref(),
                dir.as_os_str(),
            ],
        );
        let summary = run_with(
            config(&dir, "out"),
            &RunOptions {
                verbose: true,
                ..RunOptions::default()
            },
            Vec::new(),
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
fn flux_job_lowers_the_fixed_noise_loss_and_writes_samples_snapshots_and_both_layouts() {
    let r = run();
    let s = &r.summary;
    let out = r.dir.join("out");
    assert_eq!(s.steps, 30);
    assert_eq!(s.images, 16);
    assert_eq!(s.items, 32, "2 repeats of 16 images");
    // latents cached before training: each image encoded once
    assert_eq!(s.vae_encodings, 16);
    eprintln!(
        "fixed-noise loss {:.5} → {:.5}; losses {:?}",
        s.eval_loss_before, s.eval_loss_after, s.losses
    );
    assert!(s.eval_loss_before.is_finite() && s.eval_loss_after.is_finite());
    assert!(
        s.eval_loss_after < 0.95 * s.eval_loss_before,
        "loss {} → {}",
        s.eval_loss_before,
        s.eval_loss_after
    );
    // samples at steps 15 and 30: 2 prompts side by side at 32 × 32
    for step in [15, 30] {
        let p = out.join(format!("samples/step-{step}.png"));
        let img = image::open(&p).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (2 * 32, 32), "{}", p.display());
        let (lo, hi) = img
            .pixels()
            .fold((255u8, 0u8), |(lo, hi), px| (lo.min(px[0]), hi.max(px[0])));
        assert!(hi > lo, "a flat sample image");
    }
    // kohya / ComfyUI: BFL's fused modules, f32 0-d alpha, sd-scripts' metadata
    let kohya = out.join("emoji-flux-tiny.safetensors");
    let t = read(&kohya);
    let qkv = "lora_unet_double_blocks_0_img_attn_qkv";
    let down = get(&t, &format!("{qkv}.lora_down.weight"));
    let up = get(&t, &format!("{qkv}.lora_up.weight"));
    assert_eq!(down.size()[0], 3 * 4, "to_q ‖ to_k ‖ to_v at rank 4");
    assert_eq!(up.size()[1], 3 * 4);
    assert!(up.abs().max().double_value(&[]) > 0.0, "B was trained");
    let alpha = get(&t, &format!("{qkv}.alpha"));
    assert_eq!((alpha.kind(), alpha.dim()), (Kind::Float, 0));
    assert!(
        t.iter()
            .all(|(n, _)| n.starts_with("lora_unet_double_blocks_")
                || n.starts_with("lora_unet_single_blocks_")),
        "blocks only (not the embedders or the head)"
    );
    let h = lora_train::core::formats::read_header(&kohya).unwrap();
    assert_eq!(h.metadata["ss_base_model_version"], "flux1");
    assert_eq!(h.metadata["ss_network_module"], "networks.lora_flux");
    assert_eq!(h.metadata["ss_timestep_sampling"], "shift");
    // diffusers: transformer.<module>.lora_A / lora_B
    let d = read(&out.join("emoji-flux-tiny/pytorch_lora_weights.safetensors"));
    let a = get(
        &d,
        "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
    );
    assert_eq!(a.size()[0], 4);
    let b = get(
        &d,
        "transformer.single_transformer_blocks.0.proj_mlp.lora_B.weight",
    );
    assert_eq!(b.size()[1], 4);
    // the snapshot at step 15, in both layouts
    let snap = out.join("emoji-flux-tiny-step00000015.safetensors");
    assert!(snap.is_file(), "{}", snap.display());
    assert!(
        out.join("emoji-flux-tiny-step00000015/pytorch_lora_weights.safetensors")
            .is_file()
    );
}

#[test]
fn both_flux_adapter_layouts_give_in_diffusers_and_comfyui_style_the_outputs_ours_gives() {
    let r = run();
    let dir = r.dir.as_path();
    let pipe = dir.join("pipeline");
    let kohya = dir.join("out/emoji-flux-tiny.safetensors");
    let diffusers = dir.join("out/emoji-flux-tiny/pytorch_lora_weights.safetensors");
    let check = dir.join("check");
    script(
        "check_adapters.py",
        &[
            "--pipeline".as_ref(),
            pipe.as_os_str(),
            "--kohya".as_ref(),
            kohya.as_os_str(),
            "--diffusers".as_ref(),
            diffusers.as_os_str(),
            "--out".as_ref(),
            check.as_os_str(),
        ],
    );
    let _serial = serial();
    let inputs = read(&check.join("inputs.safetensors"));
    let outputs = read(&check.join("outputs.safetensors"));
    let forward = |adapter: Option<&Path>| {
        let opts = LoadOptions::default();
        let mut m = FluxTransformer2DModel::from_diffusers(&pipe, &opts).unwrap();
        let vs = tch::nn::VarStore::new(tch::Device::Cpu);
        if let Some(a) = adapter {
            let w = lora_train::models::flux::lora::read_adapter(a, m.config()).unwrap();
            w.load_into(&mut m, "default", &vs.root(), 0.0).unwrap();
        }
        let g = inputs.iter().find(|(n, _)| n == "guidance").map(|(_, t)| t);
        tch::no_grad(|| {
            m.forward(&FluxInputs {
                hidden_states: &get(&inputs, "hidden_states"),
                encoder_hidden_states: &get(&inputs, "encoder_hidden_states"),
                pooled_projections: &get(&inputs, "pooled_projections"),
                timestep: &get(&inputs, "timestep"),
                img_ids: &get(&inputs, "img_ids"),
                txt_ids: &get(&inputs, "txt_ids"),
                guidance: g,
            })
            .unwrap()
        })
    };
    let base = get(&outputs, "base");
    let tol = 1e-4;
    assert!(max_abs(&forward(None), &base) < tol, "base transformer");
    // diffusers put a LoRA on every module we trained: 2 double blocks × 14 linears (q, k, v,
    // out, the context stream's four, both MLPs' two, both modulations) and 2 single blocks × 6
    assert_eq!(
        get(&outputs, "diffusers_modules").int64_value(&[0]),
        2 * 14 + 2 * 6
    );
    for (name, file) in [("kohya", &kohya), ("diffusers", &diffusers)] {
        let theirs = get(&outputs, name);
        let ours = forward(Some(file));
        let effect = max_abs(&theirs, &base);
        let diff = max_abs(&ours, &theirs);
        eprintln!("{name} adapter: effect {effect:.3e}, ours vs theirs {diff:.3e}");
        assert!(
            effect > 1e-4,
            "{name}: the adapter changes the output ({effect})"
        );
        assert!(diff < tol * effect.max(1.0), "{name}: {diff}");
    }
}

#[test]
fn an_fp8_base_trains_and_a_swap_count_the_model_cannot_hold_names_the_key() {
    let r = run();
    let _serial = serial();
    let mut cfg = config(&r.dir, "out-fp8");
    cfg.flux.fp8_base = true;
    cfg.train.max_steps = Some(10);
    cfg.train.save_every_n_steps = None;
    cfg.logging.sample_every_n_steps = 0;
    cfg.logging.sample_prompts.clear();
    let s = run_with(cfg.clone(), &RunOptions::default(), Vec::new()).unwrap();
    eprintln!(
        "fp8 base: fixed-noise loss {:.5} → {:.5}",
        s.eval_loss_before, s.eval_loss_after
    );
    assert_eq!(s.steps, 10);
    assert!(s.eval_loss_after < s.eval_loss_before, "{s:?}");
    // the fp8 base's loss differs from the dense base's (its weights are rounded)
    assert!((s.eval_loss_before - r.summary.eval_loss_before).abs() > 1e-6);
    // 2 double- and 2 single-stream blocks: kohya's counting keeps two of each on the device
    cfg.flux.fp8_base = false;
    cfg.flux.blocks_to_swap = 1;
    cfg.train.output_dir = r.dir.join("out-swap").display().to_string();
    let e = run_with(cfg, &RunOptions::default(), Vec::new())
        .unwrap_err()
        .to_string();
    assert!(e.contains("flux.blocks_to_swap"), "{e}");
}

/// A FLUX sample grid against the plan's sample-grid term: the counting allocator's peak over
/// `FluxPipeline::sample` (2 prompts, one at a time) on the tiny pipeline, fp32 on the CPU,
/// against `diffusion`'s `sample_images` of the plan for the same config, at 128 and 256 px.
#[test]
fn a_flux_sample_grid_peaks_within_the_plan_and_does_not_grow_with_its_prompts() {
    use lora_train::core::sys;
    use lora_train::models::flux::{FluxPipeline, FluxSampleOptions};
    let r = run();
    let _serial = serial();
    sys::install_counting_cpu_allocator().unwrap();
    tch::set_num_threads(1);
    let pipe = FluxPipeline::from_diffusers(&r.dir.join("pipeline"), Kind::Float, tch::Device::Cpu)
        .unwrap();
    let prompts = ["emoji, grinning face", "emoji, red heart"];
    let measure = |n: usize, size: u32| {
        let cond = pipe.encode_prompts(&prompts[..n], 16, false).unwrap();
        let opts = FluxSampleOptions {
            size: (size, size),
            steps: 2,
            guidance_scale: 3.5,
            seed: 7,
        };
        let before = sys::cpu_mem_stats().unwrap().current_bytes as i64;
        sys::cpu_reset_peak().unwrap();
        let img = pipe.sample(&cond, &opts).unwrap();
        (
            sys::cpu_mem_stats().unwrap().peak_bytes as i64 - before,
            img,
        )
    };
    for size in [128u32, 256] {
        let (one, img1) = measure(1, size);
        let (two, img2) = measure(2, size);
        // the first prompt's image is the same alone and in the grid
        assert!(max_abs(&img2.narrow(0, 0, 1), &img1) < 1e-5, "{size}px");
        // one prompt at a time: the second prompt adds its image and its noise only (this VAE's
        // factor is 2: 16 latent channels at `size/2`²)
        let side = i64::from(size);
        let per_prompt = 3 * 4 * side * side + 16 * 4 * (side / 2) * (side / 2);
        assert!(
            two <= one + per_prompt + 16 * 1024,
            "{size}px: 2 prompts {two} B, 1 prompt {one} B"
        );
        let mut cfg = config(&r.dir, "plan-samples");
        cfg.data.resolution = Some([size, size]);
        cfg.logging.sample_prompts = prompts.iter().map(|p| p.to_string()).collect();
        let plan = lora_train::recipes::flux::plan::plan(&cfg, None, None, false).unwrap();
        let predicted = plan.estimate.flux.as_ref().unwrap().sample_images.as_f64();
        let err = predicted / two as f64 - 1.0;
        println!(
            "{size}px, 2 prompts: sample grid peak measured {:.3} MB (1 prompt {:.3} MB), planned {:.3} MB ({:+.1}%)",
            two as f64 / 1e6,
            one as f64 / 1e6,
            predicted / 1e6,
            100.0 * err
        );
        assert!(
            (0.0..=0.25).contains(&err),
            "{size}px: {:+.1}%",
            100.0 * err
        );
    }
}
