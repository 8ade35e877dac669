//! `lora-train generate`: text from a prompt, optionally as a ChatML user turn, with an adapter.

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
    /// Wrap the prompt as a ChatML user turn and open the assistant turn.
    pub chat: bool,
    /// System prompt for `--chat`.
    pub system: Option<&'a str>,
    /// Tokens to generate.
    pub max_new_tokens: usize,
    /// Softmax temperature (0 = greedy).
    pub temperature: f64,
    /// Nucleus sampling.
    pub top_p: f64,
    /// Sampler seed.
    pub seed: u64,
}

/// Runs `generate`; prints only the generated text.
pub fn run(a: &GenerateArgs<'_>) -> Result<i32, CliError> {
    let m = super::model::load(a.model, a.adapter)?;
    let text = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = a.system {
            msgs.push(ChatMessage::new("system", s));
        }
        msgs.push(ChatMessage::user(a.prompt));
        ChatTemplate::chatml().apply(&msgs, true)
    } else {
        a.prompt.to_string()
    };
    let ids = m
        .tokenizer
        .encode(&text, false)
        .map_err(CliError::runtime)?;
    let mut opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        seed: a.seed,
        ..Default::default()
    };
    if a.chat
        && let Some(id) = m.tokenizer.token_to_id("<|im_end|>")
    {
        opts.stop_tokens.push(i64::from(id));
    }
    let g = m.model.generate(&ids, &opts).map_err(CliError::runtime)?;
    println!(
        "{}",
        m.tokenizer
            .decode(&g.tokens, true)
            .map_err(CliError::runtime)?
    );
    Ok(EXIT_OK)
}
