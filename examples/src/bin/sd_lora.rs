//! A Stable Diffusion 1.x LoRA from code, on a tiny pipeline (CPU-sized).
//!
//! ```sh
//! .venv/bin/python lora-train/tests/sd_interop/make_pipeline.py --assets assets --out output/sd-tiny
//! cargo run -p lora-examples --release --bin sd_lora -- [PIPELINE] [DATA] [STEPS] [OUTPUT_DIR]
//! # defaults: output/sd-tiny/pipeline output/sd-tiny/data 20 output/examples/sd_lora
//! ```
//!
//! The script writes a diffusers folder with random weights in the shapes of SD 1.x (no SD
//! checkpoint ships with the registries) and a kohya folder `2_emoji/` of real emoji with
//! captions. The config starts from `examples/configs/sd15-emoji-tiny.yaml` and is changed in
//! code; the SD recipe caches latents, trains LoRA on the UNet's attention and writes a kohya
//! file (`lora_unet_…`), a diffusers file and a grid of sample images drawn at the end.

use anyhow::Result;
use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let mut cfg = TrainConfig::from_file("examples/configs/sd15-emoji-tiny.yaml")?;
    cfg.model.base_model = Some(arg(0, "output/sd-tiny/pipeline"));
    cfg.data.train_data_dir = Some(arg(1, "output/sd-tiny/data"));
    cfg.train.max_steps = Some(arg(2, "20").parse()?);
    cfg.train.output_dir = arg(3, "output/examples/sd_lora");
    cfg.train.train_text_encoder = false; // the UNet only
    cfg.logging.sample_every_n_steps = 0; // sample grids at the end only
    cfg.system.device = "cpu".into();

    let s = lora_train::sd::run(cfg, &RunOptions::default())?;
    println!(
        "{} images ({} items) in buckets {:?}; {} steps in {:.1} s",
        s.images, s.items, s.bucket_batches, s.steps, s.train_seconds
    );
    println!(
        "fixed-noise loss {:.5} → {:.5}; {} VAE encodings",
        s.eval_loss_before, s.eval_loss_after, s.vae_encodings
    );
    for p in s.samples.iter().chain(&s.outputs) {
        println!("wrote {}", p.display());
    }
    Ok(())
}
