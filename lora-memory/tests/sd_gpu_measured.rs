//! lora-memory's CUDA predictions for Stable Diffusion UNet LoRA training against allocator peaks
//! measured on an NVIDIA H200 (`benches/gpu/sd_mem_check.py`: diffusers 0.42.1 + PEFT 0.21.0,
//! torch 2.11.0+cu130; SD 1.5 and SDXL UNets with random weights, fp16/bf16 autocast and fp32,
//! checkpointing on/off, cached latents and text-encoder outputs; results committed in
//! `benches/gpu/results/`). Print the table with
//! `cargo run -p lora-memory --example sd_gpu_check -- benches/gpu/results/h200-diffusers-sd-2026-11-30.json`.
//!
//! Bounds: allocated peak within −10% / +10% of the measured one (worst today: SD 1.5 fp16 at
//! 768 px, −8.4%), mean absolute error under 6%; the trainable-parameter count exact.

use lora_memory::{BaseDtype, MixedPrecision, ModelDescriptor, Profile, Settings, estimate};

#[test]
fn sd_predictions_bound_the_h200_measurements() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../benches/gpu/results/h200-diffusers-sd-2026-11-30.json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let results: Vec<&serde_json::Value> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["model"] != "tiny")
        .collect();
    assert_eq!(results.len(), 10);
    let mut abs = 0.0;
    for r in &results {
        let model = ModelDescriptor::preset(r["model"].as_str().unwrap()).unwrap();
        let (base, mp) = match r["dtype"].as_str().unwrap() {
            "fp32" => (BaseDtype::F32, MixedPrecision::No),
            "fp16" => (BaseDtype::F16, MixedPrecision::Fp16),
            _ => (BaseDtype::Bf16, MixedPrecision::Bf16),
        };
        let rank = r["rank"].as_u64().unwrap() as u32;
        let s = Settings::default()
            .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
            .with_rank(rank)
            .with_alpha(rank as f32)
            .with_lora_dropout(0.0)
            .with_base_dtype(base)
            .with_mixed_precision(mp)
            .with_micro_batch(r["batch"].as_u64().unwrap() as u32)
            .with_resolution(r["res"].as_u64().unwrap() as u32)
            .with_gradient_checkpointing(r["checkpointing"].as_bool().unwrap())
            .with_cache_latents(true)
            .with_cache_text_encoder_outputs(true)
            .with_profile(Profile::peft_transformers());
        let e = estimate(&model, &s).unwrap();
        assert_eq!(
            e.trainable_params,
            r["trainable_params"].as_u64().unwrap(),
            "{}",
            r["id"]
        );
        let measured = r["max_allocated"].as_f64().unwrap();
        let err = (e.peak_allocated.0 as f64 - measured) / measured;
        assert!(
            (-0.10..=0.10).contains(&err),
            "{}: allocated {:.3} GB predicted vs {:.3} GB measured ({:+.1}%)",
            r["id"],
            e.peak_allocated.0 as f64 / 1e9,
            measured / 1e9,
            100.0 * err
        );
        abs += err.abs();
    }
    let mape = abs / results.len() as f64;
    assert!(mape < 0.06, "MAPE {:.1}%", 100.0 * mape);
}
