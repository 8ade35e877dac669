//! An app that plans LoRA runs with `lora-memory` alone: no libtorch, no model weights.
//!
//! `plan-app <SmolLM2 .gguf>`: estimates a run from the GGUF header, fits an 8B QLoRA config
//! to a 24 GB card and checks that a 13B full fine-tune is refused for a 12 GB one.

use lora_memory::{
    BaseDtype, Budget, FitError, Method, ModelDescriptor, Optimizer, Settings, estimate, fit,
};

fn check(ok: bool, what: &str) {
    if !ok {
        eprintln!("plan-app: FAILED: {what}");
        std::process::exit(1);
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let gguf = std::env::args()
        .nth(1)
        .ok_or("usage: plan-app <SmolLM2-135M-Instruct.Q4_1.gguf>")?;

    // 1. a model read from its file header only
    let smol = ModelDescriptor::from_gguf(&gguf)?;
    let settings = Settings::default()
        .with_rank(8)
        .with_micro_batch(4)
        .with_seq_len(128);
    let e = estimate(&smol, &settings)?;
    println!(
        "SmolLM2 from {gguf}: {} trainable parameters, peak {}",
        e.trainable_params, e.peak
    );
    // rank 8 on q_proj and v_proj of 30 layers: 30 · 8 · ((576 + 576) + (576 + 192))
    check(
        e.trainable_params == 30 * 8 * ((576 + 576) + (576 + 192)),
        "trainable parameters of SmolLM2-135M with r=8 on q_proj, v_proj",
    );
    check(
        e.peak.gb() > 0.1 && e.peak.gb() < 8.0,
        "a plausible SmolLM2 peak",
    );

    // 2. QLoRA of an 8B model fitted to a 24 GB card
    let llama = ModelDescriptor::preset("llama-3.1-8b")?;
    let want = Settings::default()
        .with_base_dtype(BaseDtype::Nf4 { double_quant: true })
        .with_micro_batch(16)
        .with_seq_len(2048)
        .with_rank(16)
        .with_optimizer(Optimizer::AdamW8bit);
    let budget = Budget::gpu("RTX 4090 24GB")?;
    let fitted = fit(&llama, &want, budget.bytes)?;
    println!(
        "Llama-3.1-8B QLoRA on {}: peak {} after {} changes",
        budget.bytes,
        fitted.estimate.peak,
        fitted.changes.len()
    );
    for c in &fitted.changes {
        println!("  {}: {} -> {} ({})", c.setting, c.from, c.to, c.reason);
    }
    check(
        fitted.estimate.peak <= budget.bytes,
        "the fitted peak is inside the budget",
    );
    check(
        !fitted.changes.is_empty(),
        "micro-batch 16 at 2048 tokens needs changes to fit 24 GB",
    );

    // 3. a run no setting makes fit
    let big = ModelDescriptor::preset("llama-2-13b")?;
    let full = Settings::default().with_method(Method::Full);
    match fit(&big, &full, Budget::gpu("RTX 3060 12GB")?.bytes) {
        Err(FitError::DoesNotFit { smallest_peak, .. }) => {
            println!("Llama-2-13B full fine-tune on 12 GB: refused (smallest peak {smallest_peak})")
        }
        other => check(
            false,
            &format!("a 13B full fine-tune must not fit 12 GB: {other:?}"),
        ),
    }
    println!("plan-app: ok");
    Ok(())
}
