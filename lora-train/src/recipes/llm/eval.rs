//! Held-out perplexity and sample generation before and after training.

use super::*;

pub(crate) fn evaluate(
    model: &lora_models::llama::Llama,
    ids: &[i64],
    seq_len: usize,
) -> Result<Option<EvalResult>> {
    if ids.len() < 2 {
        return Ok(None);
    }
    let opts = lora_models::llama::PerplexityOptions {
        max_length: seq_len,
        stride: seq_len,
    };
    let r = model
        .perplexity_ids(ids, &opts)
        .during("held-out perplexity")?;
    Ok(Some(EvalResult {
        mean_nll: r.mean_nll,
        perplexity: r.perplexity,
        tokens: r.tokens_scored,
    }))
}

pub(crate) fn sample(
    model: &lora_models::llama::Llama,
    tok: &lora_models::tokenizer::Tokenizer,
    prompt: &str,
    max_new: u32,
) -> Result<String> {
    let ids = tok
        .encode(prompt, false)
        .during("tokenizing the sample prompt")?;
    let opts = lora_models::llama::GenerateOptions {
        max_new_tokens: max_new as usize,
        ..Default::default()
    };
    let g = model.generate(&ids, &opts).during("sample generation")?;
    tok.decode(&g.tokens, true).during("decoding the sample")
}
