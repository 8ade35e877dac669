//! The SD job's caching before training, on the tiny pipelines of `tests/sd_interop/make_pipeline.py`
//! (random weights, 16 real emoji in a kohya folder with 2 repeats):
//!
//! - a stop request (Ctrl-C in the CLI) while latents are being encoded ends the job at the next
//!   image with the interrupted outcome, leaves only complete cache entries, and a rerun encodes
//!   the images that were missing;
//! - with `data.cache_latents` and frozen text encoders, the job caches every latent and caption
//!   before training and moves the VAE and the text encoders off the device (a no-op on the CPU,
//!   where these tests run): the run matches one that keeps them loaded step for step, samples
//!   included;
//! - the VAE and text encoders loaded again from the pipeline's files (what the move to another
//!   device does) compute exactly what they did, SD 1.x and SDXL, folder and single file.
//!
//! The stop request is process-wide: every test here takes one lock, and clears it when done.

use lora_train::config::TrainConfig;
use lora_train::engine::{clear_stop_request, request_stop};
use lora_train::job::{JobError, RunOptions};
use lora_train::sd::{self, SampleOptions, SamplerKind, SdPipeline};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

use crate::sd_fixture::{make_pipeline, python, root};

/// Writes the tiny pipeline (folder and single file) and the emoji folder once per kind.
fn fixture(sdxl: bool) -> &'static Path {
    static SD: OnceLock<PathBuf> = OnceLock::new();
    static XL: OnceLock<PathBuf> = OnceLock::new();
    let cell = if sdxl { &XL } else { &SD };
    cell.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(if sdxl {
            "sd_caching_xl"
        } else {
            "sd_caching"
        });
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let extra: &[&str] = if sdxl {
            &["--single-file", "--sdxl"]
        } else {
            &["--single-file"]
        };
        make_pipeline(&dir, extra);
        dir
    })
}

use crate::serial;

/// Clears the stop request when a test ends, passed or failed.
struct ClearStop;

impl Drop for ClearStop {
    fn drop(&mut self) {
        clear_stop_request();
    }
}

/// The tiny SD 1.x example config on the fixture, with frozen text encoders and fixed captions
/// (what lets everything be cached before training), latents cached on disk, 2 steps.
fn config(dir: &Path, out: &str) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/sd15-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg.train.train_text_encoder = false;
    cfg.data.shuffle_caption = Some(false);
    cfg.data.cache_latents = Some(true);
    cfg.train.max_steps = Some(2);
    cfg.train.save_every_n_steps = None;
    cfg
}

/// The files under `dir` (recursively), none when it does not exist.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(files(&p));
        } else {
            out.push(p);
        }
    }
    out
}

fn latents_in(cache: &Path) -> usize {
    files(cache)
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "latent"))
        .count()
}

#[test]
fn a_stop_while_latents_are_cached_ends_the_job_at_once_and_a_rerun_encodes_the_rest() {
    let dir = fixture(false);
    let _serial = serial();
    let _clear = ClearStop;
    clear_stop_request();
    let out = dir.join("stopped");
    let _ = std::fs::remove_dir_all(&out);
    let mut cfg = config(dir, "stopped");
    // 128 px: the tiny VAE takes long enough per image for the stop to land mid-way
    cfg.data.resolution = Some([128, 128]);
    cfg.train.max_steps = Some(1);
    cfg.logging.sample_prompts.clear();
    cfg.logging.sample_every_n_steps = 0;
    let cache = out.join("latent_cache");
    let watched = cache.clone();
    // Ctrl-C as soon as the first latent is on disk
    let watcher = std::thread::spawn(move || {
        let t = Instant::now();
        while latents_in(&watched) == 0 {
            assert!(
                t.elapsed() < Duration::from_secs(300),
                "no latent was cached"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        request_stop();
        Instant::now()
    });
    let res = sd::run(
        cfg.clone(),
        &RunOptions {
            verbose: true,
            ..RunOptions::default()
        },
    );
    let returned = Instant::now();
    let asked = watcher.join().unwrap();
    match &res {
        Err(JobError::Interrupted {
            step: 0,
            checkpoint: None,
        }) => {}
        other => panic!("expected the interrupted outcome, got {other:?}"),
    }
    let waited = returned.saturating_duration_since(asked);
    let done = latents_in(&cache);
    eprintln!("stopped {waited:?} after the request, with {done} of 16 latents cached");
    assert!(
        waited < Duration::from_secs(10),
        "the job went on for {waited:?} after the stop"
    );
    assert!((1..16).contains(&done), "{done} latents cached");
    // only complete entries: no temporary file, nothing a rerun could mistake for a latent
    let stray: Vec<PathBuf> = files(&cache)
        .into_iter()
        .filter(|p| p.extension().is_none_or(|e| e != "latent"))
        .collect();
    assert!(stray.is_empty(), "{stray:?}");
    // nothing of a finished run
    assert!(!out.join("summary.json").exists());
    assert!(!out.join("emoji-tiny.safetensors").exists());
    assert!(files(&out.join("checkpoints")).is_empty());

    clear_stop_request();
    let s = sd::run(cfg, &RunOptions::default()).unwrap();
    assert_eq!(s.steps, 1);
    assert_eq!(
        s.vae_encodings as usize,
        16 - done,
        "the rerun encodes exactly the images the stopped run had not cached"
    );
    assert_eq!(latents_in(&cache), 16);
}

#[test]
fn cached_runs_move_the_frozen_models_off_and_match_runs_that_keep_them() {
    let dir = fixture(false);
    let _serial = serial();
    let _clear = ClearStop;
    clear_stop_request();
    let run = |out: &str, cache: bool| {
        let _ = std::fs::remove_dir_all(dir.join(out));
        let mut cfg = config(dir, out);
        cfg.data.cache_latents = Some(cache);
        cfg.logging.sample_every_n_steps = 1;
        cfg.logging.sample_steps = 3;
        sd::run(
            cfg,
            &RunOptions {
                verbose: true,
                ..RunOptions::default()
            },
        )
        .unwrap()
    };
    // cache_latents: every latent and caption before training, then the VAE and the text
    // encoder "move" to the CPU they are on; samples bring them back for each grid
    let moved = run("moved", true);
    // no caching before training: latents and conditioning as the batches come, models kept
    let kept = run("kept", false);
    assert_eq!(moved.vae_encodings, 16, "each image once, before training");
    assert_eq!(latents_in(&dir.join("moved/latent_cache")), 16);
    assert_eq!(moved.steps, 2);
    assert_eq!(moved.losses, kept.losses);
    assert_eq!(moved.eval_loss_before, kept.eval_loss_before);
    assert_eq!(moved.eval_loss_after, kept.eval_loss_after);
    for step in [1, 2] {
        let a = std::fs::read(dir.join(format!("moved/samples/step-{step}.png"))).unwrap();
        let b = std::fs::read(dir.join(format!("kept/samples/step-{step}.png"))).unwrap();
        assert!(a == b, "sample grid of step {step} differs");
        let img = image::load_from_memory(&a).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (2 * 32, 32));
        let (lo, hi) = img
            .pixels()
            .fold((255u8, 0u8), |(lo, hi), px| (lo.min(px[0]), hi.max(px[0])));
        assert!(hi > lo, "a flat sample image");
    }
    let read = |f: &str| {
        let mut t = Tensor::read_safetensors(dir.join(f)).unwrap();
        t.sort_by(|x, y| x.0.cmp(&y.0));
        t
    };
    let (a, b) = (
        read("moved/emoji-tiny.safetensors"),
        read("kept/emoji-tiny.safetensors"),
    );
    assert_eq!(a.len(), b.len());
    for ((na, ta), (nb, tb)) in a.iter().zip(&b) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na}");
    }
}

#[test]
fn random_crops_and_changing_captions_are_encoded_as_drawn_and_not_kept() {
    let dir = fixture(false);
    let _serial = serial();
    let _clear = ClearStop;
    clear_stop_request();
    let run = |out: &str, vary: bool| {
        let _ = std::fs::remove_dir_all(dir.join(out));
        let mut cfg = config(dir, out);
        cfg.data.random_crop = Some(vary);
        cfg.data.shuffle_caption = Some(vary);
        // 16 images in batches of 4: 6 steps are an epoch and a half
        cfg.train.max_steps = Some(6);
        cfg.logging.sample_every_n_steps = 0;
        cfg.logging.sample_prompts.clear();
        sd::run(
            cfg,
            &RunOptions {
                verbose: true,
                ..RunOptions::default()
            },
        )
        .unwrap()
    };
    let kept_bytes = |s: &sd::SdRunSummary| {
        s.plan
            .as_ref()
            .expect("a plan")
            .estimate
            .breakdown
            .kept_data
            .as_f64()
    };
    // fixed crops and captions: each image encoded once before training, kept for the run
    let fixed = run("fixed-crops", false);
    assert_eq!(fixed.vae_encodings, 16);
    assert_eq!(latents_in(&dir.join("fixed-crops/latent_cache")), 16);
    // random crops: each drawn item encoded (24 over 6 steps of 4), and the 8 evaluation
    // samples once; nothing written to the latent cache
    let varying = run("random-crops", true);
    assert_eq!(varying.steps, 6);
    assert_eq!(varying.vae_encodings, 6 * 4 + 8);
    assert_eq!(latents_in(&dir.join("random-crops/latent_cache")), 0);
    // the plan keeps only the evaluation samples: no latents or captions per image
    let (a, b) = (kept_bytes(&varying), kept_bytes(&fixed));
    assert!(
        a > 0.0 && a < b,
        "kept data {a} B with random crops, {b} B without"
    );
    assert!(varying.losses.iter().all(|(_, l)| l.is_finite()));
}

/// The text conditioning, latents and a 3-step sample grid of `p`.
fn outputs(p: &SdPipeline) -> Vec<(&'static str, Tensor)> {
    let prompts = ["emoji, grinning face", "emoji"];
    let c = p.encode_prompts(&prompts).unwrap();
    tch::manual_seed(5);
    let x = Tensor::randn([2, 3, 32, 32], (Kind::Float, Device::Cpu)).tanh();
    let opts = SampleOptions {
        size: (32, 32),
        steps: 3,
        guidance_scale: 5.0,
        seed: 1,
        sampler: SamplerKind::Ddim,
    };
    let mut out = vec![
        ("text encoder", c.hidden),
        ("VAE", p.encode_images(&x).unwrap()),
        ("samples", p.sample_images(&prompts, &opts).unwrap()),
    ];
    if let Some(pooled) = c.pooled {
        out.push(("pooled", pooled));
    }
    out
}

#[test]
fn frozen_models_loaded_again_compute_what_they_did() {
    let _serial = serial();
    for sdxl in [false, true] {
        let dir = fixture(sdxl);
        let folder = dir.join(if sdxl { "pipeline_xl" } else { "pipeline" });
        let file = dir.join("single/model.safetensors");
        for single in [false, true] {
            let what = format!(
                "{} {}",
                if sdxl { "SDXL" } else { "SD 1.x" },
                if single { "single file" } else { "folder" }
            );
            let mut p = if single {
                SdPipeline::from_single_file(&file, Some(&folder), Kind::Float, Device::Cpu)
            } else {
                SdPipeline::from_diffusers(&folder, Kind::Float, Device::Cpu)
            }
            .unwrap();
            let before = outputs(&p);
            // everything is on the CPU already: nothing to move
            assert!(p.move_frozen(Device::Cpu, true, true).unwrap().is_empty());
            let names = p.reload_frozen(Device::Cpu, true, true).unwrap();
            let want: &[&str] = if sdxl {
                &["text_encoder", "text_encoder_2", "vae"]
            } else {
                &["text_encoder", "vae"]
            };
            assert_eq!(names, want, "{what}");
            assert_eq!(
                (p.device(), p.vae_device(), p.text_encoder_device()),
                (Device::Cpu, Device::Cpu, Device::Cpu)
            );
            let after = outputs(&p);
            assert_eq!(before.len(), after.len());
            for ((name, a), (_, b)) in before.iter().zip(&after) {
                assert!(
                    a.equal(b),
                    "{what}, {name}: outputs differ after loading again"
                );
            }
        }
    }
    // text encoders with LoRA are not loaded again (the adapters would be lost)
    let dir = fixture(false);
    let mut p =
        SdPipeline::from_diffusers(&dir.join("pipeline"), Kind::Float, Device::Cpu).unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let lcfg = lora_train::core::config::LoraConfig::new(4, 4.0, &["q_proj"]);
    lora_train::core::inject::inject(&mut p.text_encoder, &lcfg, "default", &vs.root()).unwrap();
    let e = p
        .reload_frozen(Device::Cpu, false, true)
        .unwrap_err()
        .to_string();
    assert!(e.contains("adapters"), "{e}");
    assert_eq!(p.reload_frozen(Device::Cpu, true, false).unwrap(), ["vae"]);
}

/// A kohya folder `<dir>/mixed/1_mixed/` of 4 emoji (square, RGBA) from the fixture and 4 of
/// scikit-image's photos of other sizes: `chelsea.png` 451×300 and `coffee.png` 600×400
/// (landscape), `rocket.jpg` turned to 427×640 (portrait), `camera.png` 512×512 (grayscale),
/// each with a caption.
fn mixed_folder(dir: &Path) -> PathBuf {
    let photos = root().join("assets/skimage");
    assert!(
        photos.join("chelsea.png").is_file(),
        "assets/skimage is missing: run `cargo xtask setup`"
    );
    let out = dir.join("mixed");
    let sub = out.join("1_mixed");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&sub).unwrap();
    let emoji_dir = std::fs::read_dir(dir.join("data"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.is_dir())
        .unwrap();
    let mut emoji: Vec<PathBuf> = files(&emoji_dir)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "png"))
        .collect();
    emoji.sort();
    for png in &emoji[..4] {
        std::fs::copy(png, sub.join(png.file_name().unwrap())).unwrap();
        let txt = png.with_extension("txt");
        std::fs::copy(&txt, sub.join(txt.file_name().unwrap())).unwrap();
    }
    for (name, caption) in [
        ("chelsea.png", "photo, a cat"),
        ("coffee.png", "photo, a cup of coffee"),
        ("camera.png", "photo, a man with a camera, grayscale"),
    ] {
        std::fs::copy(photos.join(name), sub.join(name)).unwrap();
        let stem = Path::new(name).file_stem().unwrap().to_str().unwrap();
        std::fs::write(sub.join(format!("{stem}.txt")), caption).unwrap();
    }
    // scikit-image has no portrait photo: the rocket (640×427) turned upright
    image::open(photos.join("rocket.jpg"))
        .unwrap()
        .rotate90()
        .save(sub.join("rocket_portrait.png"))
        .unwrap();
    std::fs::write(
        sub.join("rocket_portrait.txt"),
        "photo, a rocket on its launch pad, portrait",
    )
    .unwrap();
    out
}

/// Real datasets mix aspect ratios: the evaluation batches, caching, training batches and
/// samples of the SD 1.x and SDXL jobs take images of three buckets (32×32, 40×24, 24×40) with
/// and without caching before training; the loss stays finite and every bucket is trained on.
#[test]
fn mixed_aspect_buckets_train_evaluate_and_sample_sd_and_sdxl() {
    let _serial = serial();
    let _clear = ClearStop;
    clear_stop_request();
    for sdxl in [false, true] {
        let dir = fixture(sdxl);
        let data = mixed_folder(dir);
        for cache in [true, false] {
            let what = format!(
                "{}, cache_latents {cache}",
                if sdxl { "SDXL" } else { "SD 1.x" }
            );
            let out = format!("mixed-out-{cache}");
            let _ = std::fs::remove_dir_all(dir.join(&out));
            let yaml = if sdxl {
                "examples/configs/sdxl-emoji-tiny.yaml"
            } else {
                "examples/configs/sd15-emoji-tiny.yaml"
            };
            let mut cfg = TrainConfig::from_file(root().join(yaml)).unwrap();
            cfg.model.base_model = Some(
                dir.join(if sdxl { "pipeline_xl" } else { "pipeline" })
                    .display()
                    .to_string(),
            );
            cfg.data.train_data_dir = Some(data.display().to_string());
            cfg.data.enable_bucket = Some(true);
            cfg.data.min_bucket_reso = Some(16);
            cfg.data.max_bucket_reso = Some(64);
            cfg.data.bucket_reso_steps = Some(8);
            cfg.data.cache_latents = Some(cache);
            cfg.data.shuffle_caption = Some(false);
            cfg.train.train_text_encoder = false;
            cfg.train.output_dir = dir.join(&out).display().to_string();
            cfg.train.batch_size = 2;
            // 5 batches per epoch: 32×32 holds the emoji and the camera (3 batches), 40×24
            // chelsea and coffee, 24×40 the upright rocket
            cfg.train.max_steps = Some(5);
            cfg.train.save_every_n_steps = None;
            cfg.logging.sample_every_n_steps = 3;
            cfg.logging.sample_steps = 2;
            let s = sd::run(
                cfg,
                &RunOptions {
                    verbose: true,
                    ..RunOptions::default()
                },
            )
            .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!((s.images, s.items, s.steps), (8, 8, 5), "{what}");
            assert!(
                s.eval_loss_before.is_finite() && s.eval_loss_after.is_finite(),
                "{what}: {} → {}",
                s.eval_loss_before,
                s.eval_loss_after
            );
            assert!(
                s.losses.iter().all(|(_, l)| l.is_finite()),
                "{what}: {:?}",
                s.losses
            );
            assert_eq!(
                s.bucket_batches,
                vec![((24, 40), 1), ((32, 32), 3), ((40, 24), 1)],
                "{what}: every bucket trained on"
            );
            if cache {
                // both orientations are cached only with flip augmentation: one per image
                assert_eq!(s.vae_encodings, 8, "{what}");
            }
            assert_eq!(s.samples.len(), 2, "{what}: steps 3 and 5");
            for p in &s.samples {
                assert!(p.is_file(), "{what}: {}", p.display());
            }
        }
    }
}

/// The dirty dataset of `lora-data/tests/fixtures/make_dirty_dataset.py` (EXIF-rotated, CMYK,
/// 16-bit, upper-case extensions, a BOM + CRLF caption, a missing caption; a truncated JPEG, an
/// empty file, a corrupt file, a `.jxl`): with `data.bad_images: stop` the job refuses before
/// loading, naming every bad file; with the default `skip` it trains on the 7 usable images
/// (latents cached first), and the cut JPEG is not among them.
#[test]
fn a_dirty_dataset_trains_on_its_usable_images_and_stop_names_every_bad_file() {
    let dir = fixture(false);
    let _serial = serial();
    let _clear = ClearStop;
    clear_stop_request();
    let data = dir.join("dirty");
    let _ = std::fs::remove_dir_all(&data);
    let res = Command::new(python())
        .arg(root().join("lora-data/tests/fixtures/make_dirty_dataset.py"))
        .arg("--assets")
        .arg(root().join("assets"))
        .arg("--out")
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "make_dirty_dataset.py failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let run = |out: &str, stop: bool| {
        let _ = std::fs::remove_dir_all(dir.join(out));
        let mut cfg = config(dir, out);
        cfg.data.train_data_dir = Some(data.display().to_string());
        cfg.data.enable_bucket = Some(true);
        cfg.data.min_bucket_reso = Some(16);
        cfg.data.max_bucket_reso = Some(64);
        cfg.data.bucket_reso_steps = Some(8);
        cfg.train.batch_size = 2;
        cfg.train.max_steps = Some(3);
        cfg.logging.sample_every_n_steps = 0;
        cfg.logging.sample_prompts.clear();
        if stop {
            cfg.data.bad_images = lora_train::config::BadImages::Stop;
        }
        sd::run(
            cfg,
            &RunOptions {
                verbose: true,
                ..RunOptions::default()
            },
        )
    };
    match run("dirty-stop", true) {
        Err(JobError::Input(msg)) => {
            for f in ["broken.jpg", "empty.png", "noise.bmp", "scan.jxl"] {
                assert!(msg.contains(f), "{f} not named in:\n{msg}");
            }
            assert!(
                msg.contains("ends early") && msg.contains("data.bad_images: skip"),
                "{msg}"
            );
        }
        Err(e) => panic!("expected bad input, got {e}"),
        Ok(_) => panic!("data.bad_images: stop trained on a dataset with bad files"),
    }
    let s = run("dirty-skip", false).unwrap();
    assert_eq!((s.images, s.items, s.steps), (7, 14, 3));
    assert!(
        s.losses.iter().all(|(_, l)| l.is_finite()),
        "{:?}",
        s.losses
    );
    assert!(s.eval_loss_before.is_finite() && s.eval_loss_after.is_finite());
    assert_eq!(
        s.vae_encodings, 7,
        "each usable image encoded once before training"
    );
}
