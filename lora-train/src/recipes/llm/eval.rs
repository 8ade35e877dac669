//! Held-out perplexity and sample generation before and after training.

use super::*;

/// Windows of held-out text scored between two looks at [`crate::engine::stop_requested`]:
/// Ctrl-C during a long evaluation takes effect after at most this many forwards.
const EVAL_WINDOWS_PER_CHECK: usize = 8;

/// Held-out perplexity over non-overlapping windows of `seq_len` tokens, as
/// `Llama::perplexity_ids` with `stride = max_length` computes it (each window scores its
/// tokens after the first), run a few windows at a time: `None` for fewer than 2 tokens, or when
/// a stop was requested (Ctrl-C) before it finished — the job then ends as interrupted.
pub(crate) fn evaluate(
    model: &lora_models::llama::Llama,
    ids: &[i64],
    seq_len: usize,
) -> Result<Option<EvalResult>> {
    evaluate_until(model, ids, seq_len, crate::engine::stop_requested)
}

/// [`evaluate`] with its stop condition as a parameter.
fn evaluate_until(
    model: &lora_models::llama::Llama,
    ids: &[i64],
    seq_len: usize,
    stop: impl Fn() -> bool,
) -> Result<Option<EvalResult>> {
    if ids.len() < 2 {
        return Ok(None);
    }
    let opts = lora_models::llama::PerplexityOptions {
        max_length: seq_len,
        stride: seq_len,
    };
    // chunks end on window boundaries, so their windows are the whole run's windows
    let (mut nll_sum, mut tokens) = (0.0f64, 0usize);
    for chunk in ids.chunks(seq_len.max(1) * EVAL_WINDOWS_PER_CHECK) {
        if stop() {
            return Ok(None);
        }
        if chunk.len() < 2 {
            continue; // a last window of one token scores nothing
        }
        let r = model
            .perplexity_ids(chunk, &opts)
            .during("held-out perplexity")?;
        nll_sum += r.mean_nll * r.tokens_scored as f64;
        tokens += r.tokens_scored;
    }
    let mean_nll = nll_sum / tokens.max(1) as f64;
    Ok(Some(EvalResult {
        mean_nll,
        perplexity: mean_nll.exp(),
        tokens,
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

#[cfg(test)]
mod tests {
    use super::*;
    use lora_models::llama::{Llama, LlamaConfig, PerplexityOptions};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tch::{Device, Kind};

    /// A one-layer LLaMA with random weights (vocabulary 50, width 16).
    fn tiny() -> Llama {
        let c = LlamaConfig {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: Some(1),
            max_position_embeddings: 64,
            ..LlamaConfig::smollm2_135m()
        };
        let w = lora_models::llama::random_weights(&c, 1).unwrap();
        Llama::from_tensors(c, &w, Kind::Float, Device::Cpu).unwrap()
    }

    #[test]
    fn windows_a_few_at_a_time_give_the_one_pass_perplexity_and_a_stop_ends_it() {
        let m = tiny();
        // 8 windows of 7 per look: 61 tokens are one chunk of 56 and one of 5; 57 leave a
        // last chunk of one token, which scores nothing in either form
        for n in [61usize, 57, 20] {
            let ids: Vec<i64> = (0..n as i64).map(|i| (i * 17 + 3) % 50).collect();
            let one = m
                .perplexity_ids(
                    &ids,
                    &PerplexityOptions {
                        max_length: 7,
                        stride: 7,
                    },
                )
                .unwrap();
            let ours = evaluate_until(&m, &ids, 7, || false).unwrap().unwrap();
            assert_eq!(ours.tokens, one.tokens_scored, "{n} tokens");
            assert!(
                (ours.mean_nll - one.mean_nll).abs() < 1e-12 * one.mean_nll,
                "{n}: {} vs {}",
                ours.mean_nll,
                one.mean_nll
            );
            assert!((ours.perplexity - one.perplexity).abs() < 1e-9 * one.perplexity);
        }
        // a stop after the first look: no result, and no further window is scored
        let ids: Vec<i64> = (0..200).map(|i| (i * 7) % 50).collect();
        let looks = AtomicUsize::new(0);
        let r = evaluate_until(&m, &ids, 7, || looks.fetch_add(1, Ordering::SeqCst) >= 1).unwrap();
        assert!(r.is_none());
        assert_eq!(looks.load(Ordering::SeqCst), 2);
        assert!(evaluate_until(&m, &[3], 7, || false).unwrap().is_none());
    }
}
