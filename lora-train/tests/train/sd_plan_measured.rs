//! The SD plan against the SD job's own measurement: the tiny SD 1.x pipeline of
//! `tests/sd_interop/make_pipeline.py` trained on CPU (a few steps of
//! `examples/configs/sd15-emoji-tiny.yaml`, sample images included), the counting allocator's
//! peak of live tensor bytes over the training steps (`memory.tensor_peak`) against the plan's
//! `peak_allocated`.

use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::sd;
use std::path::{Path, PathBuf};

use crate::sd_fixture::{make_pipeline, root};

fn fixture(dir: &Path) {
    make_pipeline(dir, &[]);
}

fn config(dir: &Path, out: &str, resolution: u32, batch: u32, checkpointing: bool) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/sd15-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.data.resolution = Some([resolution, resolution]);
    cfg.data.cache_latents = Some(false);
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg.train.batch_size = batch;
    cfg.train.gradient_checkpointing = checkpointing;
    cfg.train.max_steps = Some(4);
    cfg.logging.sample_every_n_steps = 2;
    cfg.logging.sample_steps = 2;
    cfg
}

#[test]
fn the_sd_plan_predicts_the_tiny_runs_tensor_peak_within_5_percent() {
    let _serial = crate::serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sd_plan_measured");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    fixture(&dir);
    // the example as it is (32 px, batch 4, text encoder trained), then a bigger run
    for (name, res, batch, ckpt) in [("b4-32", 32, 4, false), ("b2-64-ckpt", 64, 2, true)] {
        let s = sd::run(config(&dir, name, res, batch, ckpt), &RunOptions::default()).unwrap();
        let plan = s.plan.as_ref().expect("the SD job plans its run");
        let d = plan.estimate.diffusion.as_ref().unwrap();
        assert_eq!(d.image_size, [res, res]);
        assert!(d.vae_weights.0 > 0, "the job keeps the VAE loaded");
        let predicted = plan.estimate.peak_allocated.as_f64();
        let measured = s.memory.tensor_peak as f64;
        assert!(measured > 0.0, "no tensor peak measured");
        let err = predicted / measured - 1.0;
        println!(
            "{name}: tensor peak measured {:.2} MB, predicted {:.2} MB ({:+.1}%)",
            measured / 1e6,
            predicted / 1e6,
            100.0 * err
        );
        assert!(err.abs() <= 0.05, "{name}: {:+.1}%", 100.0 * err);
    }
}
