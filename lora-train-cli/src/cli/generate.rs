//! `lora-train generate`: text from a prompt, optionally as a user turn of the model's chat
//! template (ChatML when it has none), with an adapter.

use super::{CliError, EXIT_OK};
use lora_models::llama::GenerateOptions;
use lora_models::tokenizer::{ChatMessage, ChatTemplate};
use std::path::Path;

/// Options of `generate`.
pub struct GenerateArgs<'a> {
    /// Base model.
    pub model: &'a Path,
    /// Adapter.
    pub adapter: Option<&'a Path>,
    /// Prompt text.
    pub prompt: &'a str,
    /// Wrap the prompt as a user turn of the model's chat template and open the assistant turn.
    pub chat: bool,
    /// System prompt for `--chat`.
    pub system: Option<&'a str>,
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// Softmax temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus sampling threshold, in (0, 1].
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Sampler seed.
    pub seed: u64,
}

/// Checks the sampling options before the model loads.
///
/// # Errors
/// Exit 2 naming the option: an empty prompt (without `--chat`, whose template adds tokens), a
/// temperature that is negative or not finite, `top_p` outside (0, 1].
pub fn check(a: &GenerateArgs<'_>) -> Result<(), CliError> {
    if a.prompt.is_empty() && !a.chat {
        return Err(CliError::usage(
            "--prompt is empty: give the text to continue (or --chat, whose template adds the turn markers)",
        ));
    }
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(CliError::usage(format!(
            "--temperature {}: must be ≥ 0 (0 = greedy; 0.7–1.0 is usual for sampling)",
            a.temperature
        )));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(CliError::usage(format!(
            "--top-p {}: must be in (0, 1] (1 = off; 0.9 is usual)",
            a.top_p
        )));
    }
    Ok(())
}

/// Runs `generate`; prints only the generated text.
pub fn run(a: &GenerateArgs<'_>) -> Result<i32, CliError> {
    check(a)?;
    let m = super::model::load(a.model, a.adapter)?;
    let template = if a.chat {
        Some(
            ChatTemplate::for_model(a.model)
                .map_err(|e| super::bad_input(a.model, format!("chat template: {e}")))?,
        )
    } else {
        None
    };
    let text = match &template {
        Some(t) => {
            let mut msgs = Vec::new();
            if let Some(s) = a.system {
                msgs.push(ChatMessage::new("system", s));
            }
            msgs.push(ChatMessage::user(a.prompt));
            t.apply(&msgs, true)
                .map_err(|e| CliError::usage(format!("--chat: {e}")))?
        }
        None => a.prompt.to_string(),
    };
    let ids = m
        .tokenizer
        .encode(&text, false)
        .map_err(CliError::runtime)?;
    let mut opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        ..Default::default()
    };
    if let Some(id) = template
        .as_ref()
        .and_then(|t| t.end_of_turn())
        .and_then(|eot| m.tokenizer.token_to_id(&eot))
    {
        opts.stop_tokens.push(i64::from(id));
    }
    let g = m.model.generate(&ids, &opts).map_err(CliError::runtime)?;
    super::outln(
        m.tokenizer
            .decode(&g.tokens, true)
            .map_err(CliError::runtime)?,
    )?;
    Ok(EXIT_OK)
}
