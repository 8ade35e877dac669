//! `lora-train eval`: perplexity of a text file, with or without an adapter.

use super::{CliError, EXIT_OK};
use lora_models::llama::PerplexityOptions;
use std::path::Path;

/// Runs `eval`.
pub fn run(
    model: &Path,
    adapter: Option<&Path>,
    text: &Path,
    max_length: usize,
    stride: Option<usize>,
    json: bool,
) -> Result<i32, CliError> {
    if max_length < 2 {
        return Err(CliError::usage(format!(
            "--max-length {max_length}: a window needs at least 2 tokens (one to predict from, one to score)"
        )));
    }
    if let Some(s) = stride
        && !(1..=max_length).contains(&s)
    {
        return Err(CliError::usage(format!(
            "--stride {s}: must be between 1 and --max-length ({max_length}); leave it out for disjoint windows"
        )));
    }
    let body = std::fs::read_to_string(text)
        .map_err(|e| CliError::usage(format!("--text {}: {e}", text.display())))?;
    let m = super::model::load(model, adapter)?;
    let ids = m
        .tokenizer
        .encode(&body, false)
        .map_err(CliError::runtime)?;
    let opts = PerplexityOptions {
        max_length,
        stride: stride.unwrap_or(max_length),
    };
    if ids.len() < 2 {
        return Err(CliError::usage(format!(
            "--text {}: {} tokens; perplexity needs at least 2",
            text.display(),
            ids.len()
        )));
    }
    let r = m
        .model
        .perplexity_ids(&ids, &opts)
        .map_err(CliError::runtime)?;
    if json {
        let v = serde_json::json!({
            "model": model.display().to_string(),
            "adapter": adapter.map(|a| a.display().to_string()),
            "adapter_modules": m.adapter_modules,
            "text": text.display().to_string(),
            "mean_nll": r.mean_nll,
            "perplexity": r.perplexity,
            "tokens_scored": r.tokens_scored,
            "windows": r.windows,
            "max_length": opts.max_length,
            "stride": opts.stride,
        });
        super::outln(v)?;
    } else {
        super::outln(format_args!(
            "perplexity {:.4} (mean NLL {:.4} nats) over {} tokens in {} windows of {} (stride {}){}",
            r.perplexity,
            r.mean_nll,
            r.tokens_scored,
            r.windows,
            opts.max_length,
            opts.stride,
            adapter
                .map(|a| format!(", adapter {} ({} modules)", a.display(), m.adapter_modules))
                .unwrap_or_default()
        ))?;
    }
    Ok(EXIT_OK)
}
