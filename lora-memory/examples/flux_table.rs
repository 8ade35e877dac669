//! The planner's FLUX.1-dev answers beside the published ones — kohya sd-scripts' VRAM table
//! (boundary cases `KF-*`), Hugging Face's FLUX QLoRA post (cases `FX-*`) — and what `fit()`
//! picks for 8, 12, 16 and 24 GiB cards from a bf16 rank-16 start at 1024 px.
//!
//! `cargo run -p lora-memory --example flux_table`
use lora_memory::cases::{boundary_cases, evaluate, evaluate_boundaries, public_cases};
use lora_memory::{Bytes, FLUX_BLOCK_LINEARS, MixedPrecision, ModelDescriptor, Settings, fit};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("| case | card | planned (process) | caching phase | verdict | source |");
    println!("|---|---|---|---|---|---|");
    let flux = |m: &str| m.starts_with("FLUX");
    let cases: Vec<_> = boundary_cases()
        .into_iter()
        .filter(|c| flux(c.model))
        .collect();
    for r in evaluate_boundaries(&cases)? {
        let m = ModelDescriptor::preset(r.case.model)?;
        let e = lora_memory::estimate(&m, &r.case.settings)?;
        let caching = e.flux.as_ref().map_or(Bytes::ZERO, |f| f.caching_peak);
        println!(
            "| {} | {} | {:.2} GB | {:.2} GB | {:?} | {} |",
            r.case.id,
            r.case.card,
            r.check.need.gb(),
            caching.gb(),
            r.check.verdict,
            r.case.note
        );
    }
    println!();
    let cases: Vec<_> = public_cases()
        .into_iter()
        .filter(|c| flux(c.model))
        .collect();
    for r in evaluate(&cases)? {
        println!(
            "{}: planned {:.2} GB vs {:.2} GB reported ({:+.1}%) — {}",
            r.case.id,
            r.predicted.gb(),
            r.case.measured.gb(),
            100.0 * r.error,
            r.case.note
        );
    }
    let m = ModelDescriptor::preset("FLUX.1-dev")?;
    let start = Settings::default()
        .with_mixed_precision(MixedPrecision::Bf16)
        .with_rank(16)
        .with_alpha(16.0)
        .with_target_modules(&FLUX_BLOCK_LINEARS)
        .with_resolution(1024);
    println!();
    for card in [8.0, 12.0, 16.0, 24.0] {
        match fit(&m, &start, Bytes::from_gib(card)) {
            Ok(f) => {
                // one entry per setting: its first and last value
                let mut steps: Vec<(String, String, String)> = Vec::new();
                for c in &f.changes {
                    match steps.last_mut() {
                        Some(l) if l.0 == c.setting => l.2 = c.to.clone(),
                        _ => steps.push((c.setting.clone(), c.from.clone(), c.to.clone())),
                    }
                }
                let steps: Vec<String> = steps
                    .iter()
                    .map(|(s, a, b)| format!("{s} {a} → {b}"))
                    .collect();
                println!(
                    "fit {card} GiB: {:.2} GB: {}",
                    f.estimate.peak.gb(),
                    steps.join("; ")
                );
            }
            Err(e) => println!("fit {card} GiB: {e}"),
        }
    }
    Ok(())
}
