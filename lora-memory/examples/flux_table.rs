//! The planner's FLUX.1-dev answers beside the published ones: kohya sd-scripts' VRAM table
//! (docs/flux_train_network.md §6.1), Hugging Face's FLUX QLoRA post (peaks ≈ 9 GB NF4,
//! ≈ 26 GB bf16), and what `fit()` picks for 8, 12, 16 and 24 GiB cards from a bf16 rank-16 start.
//!
//! `cargo run -p lora-memory --example flux_table`
use lora_memory::{
    BaseDtype, Bytes, Check, MixedPrecision, ModelDescriptor, Optimizer, Settings, estimate, fit,
};

/// Every linear of the blocks (kohya's `networks.lora_flux` default).
const BLOCK_LINEARS: [&str; 17] = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "norm1.linear",
    "norm1_context.linear",
    "proj_mlp",
    "proj_out",
    "norm.linear",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let m = ModelDescriptor::preset("FLUX.1-dev")?;
    // kohya's sample command: fp8 base, r4, checkpointing, bf16, AdamW8bit, caches, 1024 px
    let kohya = Settings::default()
        .with_base_dtype(BaseDtype::Fp8)
        .with_mixed_precision(MixedPrecision::Bf16)
        .with_rank(4)
        .with_alpha(1.0)
        .with_target_modules(&BLOCK_LINEARS)
        .with_gradient_checkpointing(true)
        .with_optimizer(Optimizer::AdamW8bit)
        .with_cache_latents(true)
        .with_cache_text_encoder_outputs(true)
        .with_resolution(1024);
    let t5_fp8 = Some(BaseDtype::Fp8);
    println!("| card | kohya's setting | allocated | process | caching phase | verdict |");
    println!("|---|---|---|---|---|---|");
    for (card, what, s) in [
        (24.0, "batch 2", kohya.clone().with_micro_batch(2)),
        (16.0, "batch 1", kohya.clone()),
        (
            12.0,
            "blocks_to_swap 16",
            kohya.clone().with_blocks_to_swap(16),
        ),
        (
            10.0,
            "blocks_to_swap 22, fp8 T5",
            kohya
                .clone()
                .with_blocks_to_swap(22)
                .with_text_encoder_dtype(t5_fp8),
        ),
        (
            8.0,
            "blocks_to_swap 28, fp8 T5",
            kohya
                .clone()
                .with_blocks_to_swap(28)
                .with_text_encoder_dtype(t5_fp8),
        ),
    ] {
        let e = estimate(&m, &s)?;
        let c = Check::new(&e, Bytes::from_gib(card), Bytes::ZERO);
        let caching = e.flux.as_ref().map_or(Bytes::ZERO, |f| f.caching_peak);
        println!(
            "| {card} GiB | {what} | {:.2} GB | {:.2} GB | {:.2} GB | {:?} |",
            e.peak_allocated.gb(),
            e.peak_process.gb(),
            caching.gb(),
            c.verdict
        );
    }
    let hf = Settings::default()
        .with_mixed_precision(MixedPrecision::Fp16)
        .with_rank(4)
        .with_alpha(4.0)
        .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
        .with_gradient_checkpointing(true)
        .with_optimizer(Optimizer::AdamW8bit)
        .with_cache_latents(true)
        .with_cache_text_encoder_outputs(true)
        .with_resolution(1024)
        .with_text_tokens(Some(77));
    println!();
    for (dtype, reported) in [
        (
            BaseDtype::Nf4 {
                double_quant: false,
            },
            9.0,
        ),
        (BaseDtype::Bf16, 26.0),
    ] {
        let e = estimate(&m, &hf.clone().with_base_dtype(dtype))?;
        let gb = e.peak_allocated.gb();
        println!(
            "HF post, {} base: planned {gb:.2} GB allocated vs ≈ {reported} GB reported ({:+.1}%)",
            dtype.name(),
            100.0 * (gb - reported) / reported
        );
    }
    let start = Settings::default()
        .with_mixed_precision(MixedPrecision::Bf16)
        .with_rank(16)
        .with_alpha(16.0)
        .with_target_modules(&BLOCK_LINEARS)
        .with_resolution(1024);
    println!();
    for card in [8.0, 12.0, 16.0, 24.0] {
        match fit(&m, &start, Bytes::from_gib(card)) {
            Ok(f) => {
                let mut last: Vec<(String, String, String)> = Vec::new();
                for c in &f.changes {
                    match last.last_mut() {
                        Some(l) if l.0 == c.setting => l.2 = c.to.clone(),
                        _ => last.push((c.setting.clone(), c.from.clone(), c.to.clone())),
                    }
                }
                let changes: Vec<String> = last
                    .iter()
                    .map(|(s, a, b)| format!("{s} {a} → {b}"))
                    .collect();
                println!(
                    "fit {card} GiB: {:.2} GB: {}",
                    f.estimate.peak.gb(),
                    changes.join("; ")
                );
            }
            Err(e) => println!("fit {card} GiB: {e}"),
        }
    }
    Ok(())
}
