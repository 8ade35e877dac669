//! Plan a training config for a GPU before loading anything, and fit it when it does not fit.
//!
//! ```sh
//! cargo run -p lora-examples --bin plan_fit -- [CONFIG] [GPU] [BATCH] [SEQ_LEN]
//! # defaults: examples/configs/smollm2-shakespeare.yaml "GTX 1060 6GB" 64 2048
//! ```
//!
//! The recipe for the config (LLM or Stable Diffusion) is found from the config itself; the plan
//! reads only the model file's header. With `memory.auto_fit` the planner walks its ladder
//! (micro-batch, precision, checkpointing, optimizer, …) and returns the changed settings;
//! `Plan::apply_to` writes them into the config, so training with it would use them.

use anyhow::{Context, Result, bail};
use lora_train::config::TrainConfig;
use lora_train::memory::Budget;
use lora_train::recipes;
use std::path::Path;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, default: &str| args.get(i).cloned().unwrap_or_else(|| default.into());
    let config = arg(0, "examples/configs/smollm2-shakespeare.yaml");
    let gpu = arg(1, "GTX 1060 6GB");
    if args.len() > 4 {
        bail!(
            "usage: plan_fit [CONFIG] [GPU] [BATCH] [SEQ_LEN] (got {} arguments)",
            args.len()
        );
    }
    let number = |i: usize, name: &str, default: &str| -> Result<u32> {
        let text = arg(i, default);
        text.parse()
            .ok()
            .filter(|&n| n > 0)
            .with_context(|| format!("{name}: expected a whole number above 0, got {text:?}"))
    };
    let batch = number(2, "BATCH", "64")?;
    let seq_len = number(3, "SEQ_LEN", "2048")?;

    let mut cfg = TrainConfig::from_file(&config)?;
    let dir = Path::new(&config).parent();
    let Some(recipe) = recipes::for_config(&cfg, dir) else {
        bail!("{config}: no recipe of this build trains this model");
    };
    // what the user asks for: a bigger batch and longer sequences than the demo
    cfg.train.batch_size = batch;
    cfg.data.seq_len = seq_len;
    let budget = Budget::gpu(&gpu)?;

    cfg.memory.auto_fit = false;
    let plan = recipe.plan(&cfg, dir, Some(budget.clone()), true)?;
    println!(
        "{} recipe, {} on {gpu}: batch {batch} × {seq_len} tokens → predicted peak {} of {}: {}",
        recipe.name(),
        plan.model,
        plan.estimate.peak,
        budget.bytes,
        if plan.fits == Some(true) {
            "fits"
        } else {
            "does not fit"
        }
    );
    if plan.fits == Some(true) {
        return Ok(());
    }

    cfg.memory.auto_fit = true;
    let fitted = recipe.plan(&cfg, dir, Some(budget.clone()), true)?;
    // the plan carries the fitted settings; the config changes only when asked to
    fitted.apply_to(&mut cfg);
    for c in &fitted.changes {
        println!(
            "  {}: {} → {} ({}; peak {})",
            c.setting, c.from, c.to, c.reason, c.peak_after
        );
    }
    println!(
        "fitted: predicted peak {} ({}), batch {} with {} accumulation steps, gradient checkpointing {}",
        fitted.estimate.peak,
        if fitted.fits == Some(true) {
            "fits"
        } else {
            "still does not fit"
        },
        cfg.train.batch_size,
        cfg.train.gradient_accumulation_steps,
        cfg.train.gradient_checkpointing
    );
    Ok(())
}
