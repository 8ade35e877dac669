//! Compares lora-memory's CUDA predictions for Stable Diffusion UNet LoRA training with the
//! allocator peaks measured on a GPU by `benches/gpu/sd_mem_check.py` (diffusers + PEFT, the runs
//! of `benches/gpu/sd_mem_configs.json`: cached latents and text-encoder outputs, fp32 adapters on
//! `to_q/to_k/to_v/to_out.0`, alpha = rank, AdamW).
//!
//! Run: `cargo run -p lora-memory --example sd_gpu_check -- measured.json`

use lora_memory::{BaseDtype, Bytes, MixedPrecision, ModelDescriptor, Profile, Settings, estimate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: sd_gpu_check MEASURED.json (written by benches/gpu/sd_mem_check.py)")?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let results = v["results"]
        .as_array()
        .ok_or("no `results` array: did sd_mem_check.py run on a GPU?")?;
    println!(
        "{:<4} {:<5} {:>5} {:>3}×{:<5} {:>5} {:>3} | {:>10} {:>10} | {:>8} {:>8} {:>7} | {:>8} {:>8} {:>7}",
        "id",
        "model",
        "dtype",
        "b",
        "res",
        "ckpt",
        "r",
        "trainable",
        "pred",
        "alloc GB",
        "pred",
        "err",
        "resv GB",
        "pred",
        "err"
    );
    let (mut abs_err, mut worst, mut n) = (0.0f64, 0.0f64, 0usize);
    for r in results {
        let id = r["id"].as_str().unwrap_or("?");
        if let Some(e) = r.get("error") {
            let last = e.as_str().unwrap_or("").lines().last().unwrap_or("");
            println!("{id}: failed: {last}");
            continue;
        }
        let (Some(ma), Some(mr)) = (r["max_allocated"].as_f64(), r["max_reserved"].as_f64()) else {
            println!("{id}: no allocator peaks (not a CUDA run)");
            continue;
        };
        let model = ModelDescriptor::preset(r["model"].as_str().ok_or("model")?)?;
        let (base, mp) = match r["dtype"].as_str() {
            Some("fp32") => (BaseDtype::F32, MixedPrecision::No),
            Some("fp16") => (BaseDtype::F16, MixedPrecision::Fp16),
            _ => (BaseDtype::Bf16, MixedPrecision::Bf16),
        };
        let rank = r["rank"].as_u64().ok_or("rank")? as u32;
        let s = Settings::default()
            .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
            .with_rank(rank)
            .with_alpha(rank as f32)
            .with_lora_dropout(0.0)
            .with_base_dtype(base)
            .with_mixed_precision(mp)
            .with_micro_batch(r["batch"].as_u64().ok_or("batch")? as u32)
            .with_resolution(r["res"].as_u64().ok_or("res")? as u32)
            .with_gradient_checkpointing(r["checkpointing"].as_bool().unwrap_or(false))
            .with_cache_latents(true)
            .with_cache_text_encoder_outputs(true)
            .with_train_text_encoder(false)
            .with_profile(Profile::peft_transformers());
        let e = estimate(&model, &s)?;
        let ea = (e.peak_allocated.0 as f64 - ma) / ma;
        let er = (e.peak_reserved.0 as f64 - mr) / mr;
        for x in [ea, er] {
            abs_err += x.abs();
            if x.abs() > worst.abs() {
                worst = x;
            }
            n += 1;
        }
        println!(
            "{:<4} {:<5} {:>5} {:>3}×{:<5} {:>5} {:>3} | {:>10} {:>10} | {:>8.3} {:>8.3} {:>+6.1}% | {:>8.3} {:>8.3} {:>+6.1}%",
            id,
            r["model"].as_str().unwrap_or("?"),
            r["dtype"].as_str().unwrap_or("?"),
            r["batch"],
            r["res"],
            r["checkpointing"],
            rank,
            r["trainable_params"],
            e.trainable_params,
            Bytes(ma as u64).gb(),
            e.peak_allocated.gb(),
            ea * 100.0,
            Bytes(mr as u64).gb(),
            e.peak_reserved.gb(),
            er * 100.0
        );
    }
    if n > 0 {
        println!(
            "MAPE {:.1}% over {n} values; worst {:+.1}%",
            100.0 * abs_err / n as f64,
            100.0 * worst
        );
    }
    Ok(())
}
