//! lora-memory's Stable Diffusion model against peaks measured on CPU with this SDK's SD job.
//!
//! The pipeline is the tiny SD 1.x-style one of `lora-train/tests/sd_interop/make_pipeline.py`
//! (UNet 32/64 channels, one ResNet per level, 4 heads, cross-attention 32; VAE 32/64 channels,
//! factor 2; CLIP text encoder hidden 32, 2 layers), fp32 on CPU, LoRA r8 α4 on
//! `to_q, to_k, to_v, to_out.0, proj_in, proj_out` unless stated, AdamW, latents cached, VAE and
//! text encoder loaded. Each row was measured with
//! `lora-train train --config <examples/configs/sd15-emoji-tiny.yaml with the row's changes>`
//! (`max_steps: 8`, sample images every 4 steps) and read from `summary.json`:
//! `memory.tensor_peak` is the counting allocator's peak of live CPU tensor bytes over the
//! training steps, weights included — what `peak_allocated` predicts on CPU.

use lora_memory::model::{DiffusionFamily, TextEncoderDescriptor, UnetLevel};
use lora_memory::{BaseDtype, DiffusionDescriptor, ModelDescriptor, Settings, estimate};

fn tiny() -> ModelDescriptor {
    ModelDescriptor::Diffusion(DiffusionDescriptor {
        name: "sd-tiny".into(),
        family: DiffusionFamily::Sd1,
        unet_params: 792_964,
        levels: vec![
            UnetLevel {
                channels: 32,
                resnets: 1,
                transformer_depth: 1,
                heads: 4,
            },
            UnetLevel {
                channels: 64,
                resnets: 1,
                transformer_depth: 0,
                heads: 4,
            },
        ],
        mid_transformer_depth: 1,
        cross_attention_dim: 32,
        text_encoders: vec![TextEncoderDescriptor {
            name: "text_encoder".into(),
            params: 43_808,
            hidden: 32,
            intermediate: 64,
            layers: 2,
            heads: 4,
            max_tokens: 77,
        }],
        vae_params: 658_375,
        latent_channels: 4,
        vae_scale: 2,
        vae_block_out_channels: vec![32, 64],
        vae_layers_per_block: 1,
    })
}

struct Run {
    name: &'static str,
    resolution: u32,
    batch: u32,
    train_te: bool,
    checkpointing: bool,
    rank: u32,
    targets: &'static [&'static str],
    /// `memory.tensor_peak` of the run's summary.json, bytes.
    measured: u64,
}

const ATTN_PROJ: &[&str] = &["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out"];

const RUNS: &[Run] = &[
    // the example config as it is (the sd_job test's run)
    Run {
        name: "32px b4 te",
        resolution: 32,
        batch: 4,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 27_887_832,
    },
    Run {
        name: "32px b4",
        resolution: 32,
        batch: 4,
        train_te: false,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 27_329_496,
    },
    Run {
        name: "32px b1 te",
        resolution: 32,
        batch: 1,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 11_870_560,
    },
    Run {
        name: "32px b8 te",
        resolution: 32,
        batch: 8,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 49_216_888,
    },
    Run {
        name: "64px b4 te",
        resolution: 64,
        batch: 4,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 87_675_096,
    },
    Run {
        name: "128px b4 te",
        resolution: 128,
        batch: 4,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 326_824_152,
    },
    Run {
        name: "128px b1 te",
        resolution: 128,
        batch: 1,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 87_403_360,
    },
    Run {
        name: "64px b4 te ckpt",
        resolution: 64,
        batch: 4,
        train_te: true,
        checkpointing: true,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 42_640_376,
    },
    // held out (not used to set the model): other rank, targets, batch and size
    Run {
        name: "96px b3 r16 attn only",
        resolution: 96,
        batch: 3,
        train_te: false,
        checkpointing: false,
        rank: 16,
        targets: &["to_q", "to_k", "to_v", "to_out.0"],
        measured: 143_489_648,
    },
    Run {
        name: "256px b1 te",
        resolution: 256,
        batch: 1,
        train_te: true,
        checkpointing: false,
        rank: 8,
        targets: ATTN_PROJ,
        measured: 329_108_320,
    },
    Run {
        name: "64px b6 te ckpt +ff",
        resolution: 64,
        batch: 6,
        train_te: true,
        checkpointing: true,
        rank: 8,
        targets: &[
            "to_q",
            "to_k",
            "to_v",
            "to_out.0",
            "ff.net.0.proj",
            "ff.net.2",
        ],
        measured: 64_670_672,
    },
];

fn settings(r: &Run) -> Settings {
    Settings::default()
        .with_base_dtype(BaseDtype::F32)
        .with_device(lora_memory::Device::cpu())
        .with_target_modules(r.targets)
        .with_rank(r.rank)
        .with_alpha(4.0)
        .with_micro_batch(r.batch)
        .with_resolution(r.resolution)
        .with_gradient_checkpointing(r.checkpointing)
        .with_cache_latents(true)
        .with_keep_models_loaded(true)
        .with_train_text_encoder(r.train_te)
        .with_cache_text_encoder_outputs(!r.train_te)
}

#[test]
fn tiny_sd_tensor_peaks_are_predicted_within_7_percent() {
    let m = tiny();
    let mut abs = 0.0;
    for r in RUNS {
        let e = estimate(&m, &settings(r)).unwrap();
        let err = e.peak_allocated.as_f64() / r.measured as f64 - 1.0;
        println!(
            "{:<24} measured {:>8.2} MB  predicted {:>8.2} MB  {:+.1}%",
            r.name,
            r.measured as f64 / 1e6,
            e.peak_allocated.as_f64() / 1e6,
            100.0 * err
        );
        assert!(err.abs() <= 0.07, "{}: {:+.1}%", r.name, 100.0 * err);
        abs += err.abs();
    }
    let mape = abs / RUNS.len() as f64;
    assert!(mape <= 0.03, "MAPE {:.1}%", 100.0 * mape);
}

#[test]
fn the_vae_and_text_encoder_count_only_while_they_are_loaded() {
    let m = tiny();
    let r = &RUNS[1];
    let kept = estimate(&m, &settings(r)).unwrap();
    let moved = estimate(&m, &settings(r).with_keep_models_loaded(false)).unwrap();
    let d = kept.diffusion.as_ref().unwrap();
    assert_eq!(d.vae_weights.0, 658_375 * 4);
    assert_eq!(d.text_encoder_weights.0, 43_808 * 4);
    let gone = moved.diffusion.as_ref().unwrap();
    assert_eq!((gone.vae_weights.0, gone.text_encoder_weights.0), (0, 0));
    assert_eq!(
        kept.peak_allocated.0 - moved.peak_allocated.0,
        (658_375 + 43_808) * 4
    );
    assert_eq!(d.latent_size, [16, 16]);
    assert_eq!(d.image_size, [32, 32]);
}
