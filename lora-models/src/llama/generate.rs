//! Text generation (greedy, temperature, top-k, top-p; stop tokens; seeded) and perplexity.

use std::path::Path;

use lora_data::rng::Rng;
use tch::{Kind, Tensor};

use super::model::{IGNORE_INDEX, KvCache, Llama};
use crate::error::{Error, Result};
use crate::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

/// Sampling options for [`Llama::generate`].
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// The most tokens to generate (default 128).
    pub max_new_tokens: usize,
    /// Softmax temperature; `0` (default) = greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling (Holtzman et al., arXiv:1904.09751): sample from the smallest set of
    /// most likely tokens whose probability sum reaches `top_p`; `1.0` (default) = off.
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens; `0` (default) = off.
    pub top_k: usize,
    /// Ids that end generation (not included in the output). The model's `eos_token_id`s are
    /// always stop tokens too.
    pub stop_tokens: Vec<i64>,
    /// Seed of the sampler's own generator (libtorch's global generator is not used), so the same
    /// seed gives the same text.
    pub seed: u64,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            stop_tokens: Vec::new(),
            seed: 0,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token (given) was produced.
    StopToken(i64),
    /// `max_new_tokens` were produced.
    MaxTokens,
    /// The context reached `max_position_embeddings`.
    ContextFull,
}

/// The result of [`Llama::generate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generation {
    /// The new tokens (without the prompt and without the stop token).
    pub tokens: Vec<i64>,
    /// Why it ended.
    pub stop_reason: StopReason,
}

/// Picks the next token from one row of logits `[vocab]`: argmax when `opts.temperature <= 0`;
/// otherwise a draw from `softmax(logits / temperature)` restricted to the `top_k` most likely
/// tokens, then to the smallest set whose probability reaches `top_p` (nucleus sampling,
/// Holtzman et al., arXiv:1904.09751). `rng` is the seeded SplitMix64 of `lora-data`, so a seed
/// gives the same draws on every platform. Only the sampling fields of `opts` are read.
///
/// # Errors
/// [`Error::InvalidArgument`] for empty logits.
pub fn sample_token(logits: &[f32], opts: &GenerateOptions, rng: &mut Rng) -> Result<i64> {
    if logits.is_empty() {
        return Err(Error::InvalidArgument("empty logits".into()));
    }
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold((0usize, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                if v > bv { (i, v) } else { (bi, bv) }
            })
            .0 as i64
    };
    if opts.temperature <= 0.0 {
        return Ok(argmax());
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i, ((l as f64 - max) / opts.temperature).exp()))
        .collect();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    if opts.top_k > 0 {
        probs.truncate(opts.top_k);
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    if opts.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (n, p) in probs.iter().enumerate() {
            acc += p.1 / total;
            if acc >= opts.top_p {
                keep = n + 1;
                break;
            }
        }
        probs.truncate(keep.max(1));
    }
    let total: f64 = probs.iter().map(|p| p.1).sum();
    let mut u = rng.next_f64() * total;
    for &(i, p) in &probs {
        if u < p {
            return Ok(i as i64);
        }
        u -= p;
    }
    Ok(probs.last().map_or(0, |p| p.0 as i64))
}

/// Options of [`Llama::perplexity`]: HF's strided sliding window ("Perplexity of fixed-length
/// models" in the transformers docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PerplexityOptions {
    /// Window length in tokens (the context each scored token may see at most).
    pub max_length: usize,
    /// Step between windows; each window scores only its last `stride` tokens (the ones not
    /// scored before), the rest serve as context. `stride = max_length` = disjoint windows.
    pub stride: usize,
}

impl Default for PerplexityOptions {
    fn default() -> Self {
        Self {
            max_length: 512,
            stride: 256,
        }
    }
}

/// The result of a perplexity run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerplexityReport {
    /// Mean negative log-likelihood per scored token (nats).
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Number of tokens scored.
    pub tokens_scored: usize,
    /// Number of windows run.
    pub windows: usize,
}

impl Llama {
    /// Generates a continuation of `prompt` (ids) with a [`KvCache`]: the prompt is run once,
    /// then one token per step. Single sequence.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty prompt or `top_p` outside (0, 1];
    /// [`Error::Torch`] for op failures.
    pub fn generate(&self, prompt: &[i64], opts: &GenerateOptions) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::InvalidArgument(
                "generate: the prompt is empty".into(),
            ));
        }
        if !(opts.top_p > 0.0 && opts.top_p <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "top_p must be in (0, 1], got {}",
                opts.top_p
            )));
        }
        let _guard = tch::no_grad_guard();
        let mut rng = Rng::new(opts.seed);
        let mut cache = KvCache::new(self.num_layers());
        let max_ctx = self.config().max_position_embeddings;
        let mut stops = opts.stop_tokens.clone();
        stops.extend(&self.config().eos_token_id);
        let mut input = Tensor::f_from_slice(prompt)?.f_view([1, -1])?;
        let mut tokens = Vec::new();
        loop {
            if tokens.len() >= opts.max_new_tokens {
                return Ok(Generation {
                    tokens,
                    stop_reason: StopReason::MaxTokens,
                });
            }
            if cache.seq_len() + input.size()[1] > max_ctx {
                return Ok(Generation {
                    tokens,
                    stop_reason: StopReason::ContextFull,
                });
            }
            let logits = self.forward_cached(&input, &mut cache)?;
            let last = logits
                .f_select(1, -1)?
                .f_select(0, 0)?
                .f_to_kind(Kind::Float)?
                .f_to_device(tch::Device::Cpu)?;
            let row = Vec::<f32>::try_from(&last)?;
            let next = sample_token(&row, opts, &mut rng)?;
            if stops.contains(&next) {
                return Ok(Generation {
                    tokens,
                    stop_reason: StopReason::StopToken(next),
                });
            }
            tokens.push(next);
            input = Tensor::f_from_slice(&[next])?.f_view([1, 1])?;
        }
    }

    /// Renders `messages` with `template`, generates the assistant's reply, and decodes it (the
    /// template's end-of-turn token is a stop token).
    ///
    /// # Errors
    /// As [`Llama::generate`], plus [`Error::Tokenizer`].
    pub fn chat(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        opts: &GenerateOptions,
    ) -> Result<String> {
        let prompt = template.apply(messages, true)?;
        let ids = tokenizer.encode(&prompt, false)?;
        let mut opts = opts.clone();
        if let Some(eot) = template
            .end_of_turn()
            .and_then(|t| tokenizer.token_to_id(&t))
        {
            opts.stop_tokens.push(eot.into());
        }
        let g = self.generate(&ids, &opts)?;
        tokenizer.decode(&g.tokens, true)
    }

    /// Perplexity of a token sequence with strided windows (see [`PerplexityOptions`]): every
    /// token but the first is scored exactly once, given up to `max_length − 1` tokens of context.
    /// The head and its log-softmax run as in the training loss ([`Llama::loss`]): in chunks of
    /// rows, so a window holds one chunk of logits rather than `[max_length, vocab]` logits and
    /// log-probabilities, and a tied quantized head is never dequantized whole — evaluation
    /// peaks below a training step of the same tokens.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for fewer than 2 tokens or `stride` not in `1..=max_length`;
    /// [`Error::Torch`] for op failures.
    pub fn perplexity_ids(
        &self,
        ids: &[i64],
        opts: &PerplexityOptions,
    ) -> Result<PerplexityReport> {
        let n = ids.len();
        if n < 2 || opts.max_length < 2 || opts.stride == 0 || opts.stride > opts.max_length {
            return Err(Error::InvalidArgument(format!(
                "perplexity needs ≥ 2 tokens (got {n}) and 1 ≤ stride ({}) ≤ max_length ({}), max_length ≥ 2",
                opts.stride, opts.max_length
            )));
        }
        let _guard = tch::no_grad_guard();
        let (mut nll_sum, mut scored, mut windows) = (0.0f64, 0usize, 0usize);
        let mut prev_end = 0usize;
        let mut begin = 0usize;
        while prev_end < n {
            let end = (begin + opts.max_length).min(n);
            // tokens [prev_end, end) are new; each needs its predecessor inside the window
            let first_scored = prev_end.max(begin + 1);
            let input = Tensor::f_from_slice(&ids[begin..end])?.f_view([1, -1])?;
            // Labels: the window's own ids where they are scored, IGNORE_INDEX elsewhere; the
            // chunked head loss then gives their mean NLL without the window's `[s, V]` logits.
            let labels: Vec<i64> = (begin..end)
                .map(|t| {
                    if t >= first_scored {
                        ids[t]
                    } else {
                        IGNORE_INDEX
                    }
                })
                .collect();
            let labels = Tensor::f_from_slice(&labels)?.f_view([1, -1])?;
            let cnt = end.saturating_sub(first_scored);
            if cnt > 0 {
                let h = self.hidden_states(&input, None, None, false)?;
                let mean = self.head_loss(&h, &labels)?.f_double_value(&[])?;
                nll_sum += mean * cnt as f64;
                scored += cnt;
            }
            windows += 1;
            prev_end = end;
            if end == n {
                break;
            }
            begin += opts.stride;
        }
        let mean_nll = nll_sum / scored.max(1) as f64;
        Ok(PerplexityReport {
            mean_nll,
            perplexity: mean_nll.exp(),
            tokens_scored: scored,
            windows,
        })
    }

    /// Perplexity of a UTF-8 text file, tokenized whole (no BOS added unless the tokenizer adds
    /// one), with strided windows.
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable file, [`Error::Tokenizer`], and as
    /// [`Llama::perplexity_ids`].
    pub fn perplexity(
        &self,
        tokenizer: &Tokenizer,
        path: impl AsRef<Path>,
        opts: &PerplexityOptions,
    ) -> Result<PerplexityReport> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let ids = tokenizer.encode(&text, true)?;
        self.perplexity_ids(&ids, opts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_greedy_top_k_top_p_and_seed() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let mut rng = Rng::new(1);
        let greedy = GenerateOptions::default();
        assert_eq!(sample_token(&logits, &greedy, &mut rng).unwrap(), 1);
        // top_k = 1 is greedy whatever the temperature
        let k1 = GenerateOptions {
            temperature: 5.0,
            top_k: 1,
            ..Default::default()
        };
        for _ in 0..20 {
            assert_eq!(sample_token(&logits, &k1, &mut rng).unwrap(), 1);
        }
        // top_p small enough keeps only the best two (p ≈ 0.45, 0.41 at T = 1)
        let p = GenerateOptions {
            temperature: 1.0,
            top_p: 0.8,
            ..Default::default()
        };
        let mut seen = [0usize; 4];
        for _ in 0..400 {
            seen[sample_token(&logits, &p, &mut rng).unwrap() as usize] += 1;
        }
        assert_eq!(seen[0] + seen[2], 0, "{seen:?}");
        assert!(seen[1] > 100 && seen[3] > 100, "{seen:?}");
        // same seed, same draws
        let hot = GenerateOptions {
            temperature: 2.0,
            ..Default::default()
        };
        let draw = |seed| {
            let mut r = Rng::new(seed);
            (0..32)
                .map(|_| sample_token(&logits, &hot, &mut r).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }
}
