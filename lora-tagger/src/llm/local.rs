//! In-process LLM tagger over [`lora_models::llama`]: any LLaMA-family instruct model (GGUF file
//! or HF safetensors folder) prompted through its own chat template (ChatML when it has none);
//! SmolLM2-135M-Instruct (Q4_1 GGUF from the
//! project's assets) by default.
//!
//! Batching: prompts of the same token length run together as one `[batch, seq]` micro-batch
//! through the KV-cached decoder ([`Llama::forward_cached`] has no padding mask, so only
//! equal-length prompts can share a batch); the micro-batch is sized to the memory available and
//! halved on out-of-memory.

use std::path::{Path, PathBuf};

use lora_data::rng::Rng;
use lora_models::gguf::GgufFile;
use lora_models::llama::{GenerateOptions, KvCache, Llama, WeightMode, sample_token};
use lora_models::tokenizer::{ChatTemplate, Tokenizer, load_tokenizer, tokenizer_from_gguf};
use tch::{Device, Kind, Tensor};

use super::prompt::{TagPrompt, parse_scored};
use crate::batch::{AdaptiveBatcher, ResourceSnapshot, is_oom_message, start_micro_batch};
use crate::error::{Error, Result};
use crate::{ItemResult, Tagger};

/// File name of the embedded default model under `<assets>/models/`.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The embedded default model: `$LORA_SDK_ASSETS/models/SmolLM2-135M-Instruct.Q4_1.gguf`
/// (`LORA_SDK_ASSETS` defaults to `assets`, the folder `cargo xtask setup` fills).
pub fn default_model_path() -> PathBuf {
    let assets = std::env::var_os("LORA_SDK_ASSETS").unwrap_or_else(|| "assets".into());
    PathBuf::from(assets)
        .join("models")
        .join(DEFAULT_MODEL_FILE)
}

/// Generation and batching settings of [`LocalLlmTagger`].
#[derive(Debug, Clone, PartialEq)]
pub struct LocalLlmOptions {
    /// The most tokens generated per description (default 48).
    pub max_new_tokens: usize,
    /// Softmax temperature; `0` (default) = greedy (argmax).
    pub temperature: f64,
    /// Nucleus sampling threshold in (0, 1]; `1` (default) = off.
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens when sampling; `0` (default) = off.
    pub top_k: usize,
    /// Seed of the sampler; description `i` of a call samples from seed `seed + i`, so results do
    /// not depend on how descriptions are grouped into micro-batches.
    pub seed: u64,
    /// Upper bound of the micro-batch (config `generation_settings.max_batch_size`, default 8).
    pub max_batch_size: usize,
    /// Where the model runs (default CPU).
    pub device: Device,
    /// How weights are held (default `Dense(Kind::Float)`: dequantized once at load, ~4 bytes per
    /// parameter, 540 MB for SmolLM2-135M; measured ~5× faster generation on CPU than
    /// [`WeightMode::KeepQuantized`], which dequantizes every weight on every forward).
    pub weight_mode: WeightMode,
    /// The prompt.
    pub prompt: TagPrompt,
}

impl Default for LocalLlmOptions {
    fn default() -> Self {
        Self {
            max_new_tokens: 48,
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            max_batch_size: 8,
            device: Device::Cpu,
            weight_mode: WeightMode::Dense(Kind::Float),
            prompt: TagPrompt::default(),
        }
    }
}

/// An instruct model run in this process that turns descriptions into tags.
///
/// ```no_run
/// use lora_tagger::Tagger;
/// use lora_tagger::llm::local::{LocalLlmOptions, LocalLlmTagger};
/// # fn main() -> lora_tagger::Result<()> {
/// let mut t = LocalLlmTagger::load(None, LocalLlmOptions::default())?; // SmolLM2-135M-Instruct
/// let out = t.tag_descriptions(&["A tabby cat asleep on a sofa.".to_string()])?;
/// if let Ok(tags) = &out[0] {
///     for tag in tags {
///         println!("{} {:.3}", tag.tag, tag.score);
///     }
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct LocalLlmTagger {
    model: Llama,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    opts: LocalLlmOptions,
    source: PathBuf,
    source_bytes: u64,
    stop_ids: Vec<i64>,
    micro_batch: usize,
}

/// Samples a token id from one row of logits with temperature, top-k and top-p: the sampler of
/// [`Llama::generate`] ([`sample_token`]) with this tagger's settings.
fn sample_row(logits: &[f32], opts: &LocalLlmOptions, rng: &mut Rng) -> Result<i64> {
    let sampling = GenerateOptions {
        temperature: opts.temperature,
        top_p: opts.top_p,
        top_k: opts.top_k,
        ..GenerateOptions::default()
    };
    Ok(sample_token(logits, &sampling, rng)?)
}

impl LocalLlmTagger {
    /// Loads a model: `None` = the embedded default ([`default_model_path`]); a path ending in
    /// `.gguf` = a GGUF file (`llama`/`qwen2`/`qwen3` architecture, tokenizer and chat template
    /// from its metadata); a folder = an HF checkpoint (`config.json`, `model.safetensors`,
    /// `tokenizer.json`, chat template from `tokenizer_config.json`).
    ///
    /// The prompt is rendered with the model's own chat template (Jinja, as `transformers`
    /// renders it); a model without one gets plain ChatML. Generation stops at the template's
    /// end-of-turn token as well as the model's EOS ids.
    ///
    /// # Errors
    /// [`Error::Config`] for `max_batch_size` 0, `max_new_tokens` 0 or `top_p` outside (0, 1];
    /// [`Error::Io`] when the path does not exist; [`Error::Model`] when loading fails.
    pub fn load(path: Option<&Path>, opts: LocalLlmOptions) -> Result<Self> {
        if opts.max_batch_size == 0 {
            return Err(Error::Config {
                key: "generation_settings.max_batch_size".into(),
                value: "0".into(),
                hint: "use 1 or more".into(),
            });
        }
        if opts.max_new_tokens == 0 {
            return Err(Error::Config {
                key: "llm.max_new_tokens".into(),
                value: "0".into(),
                hint: "use 1 or more (32-64 is enough for a tag list)".into(),
            });
        }
        if !(opts.top_p > 0.0 && opts.top_p <= 1.0) {
            return Err(Error::Config {
                key: "llm.top_p".into(),
                value: opts.top_p.to_string(),
                hint: "use a value in (0, 1]".into(),
            });
        }
        let source = path.map_or_else(default_model_path, Path::to_path_buf);
        let meta = std::fs::metadata(&source).map_err(|e| Error::Io {
            path: source.clone(),
            source: std::io::Error::new(
                e.kind(),
                format!("{e} (the LLM tagger's model; run `cargo xtask setup` for the default)"),
            ),
        })?;
        let (model, tokenizer, template, source_bytes) = if meta.is_dir() {
            let model = Llama::from_safetensors(&source, opts.weight_mode, opts.device)?;
            let tokenizer = load_tokenizer(source.join("tokenizer.json"))?;
            let template = ChatTemplate::from_folder(&source)?.unwrap_or_else(ChatTemplate::chatml);
            let bytes = std::fs::read_dir(&source)
                .map(|d| {
                    d.filter_map(|e| e.ok()?.metadata().ok())
                        .map(|m| m.len())
                        .sum()
                })
                .unwrap_or(0);
            (model, tokenizer, template, bytes)
        } else {
            let file = GgufFile::open(&source)?;
            let model = Llama::from_gguf_file(&file, opts.weight_mode, opts.device)?;
            let tokenizer = tokenizer_from_gguf(&file)?;
            let template = ChatTemplate::from_gguf(&file)?.unwrap_or_else(ChatTemplate::chatml);
            (model, tokenizer, template, meta.len())
        };
        let mut stop_ids: Vec<i64> = model.config().eos_token_id.clone();
        if let Some(eot) = template
            .end_of_turn()
            .and_then(|t| tokenizer.token_to_id(&t))
        {
            stop_ids.push(eot.into());
        }
        let micro_batch = opts.max_batch_size;
        Ok(Self {
            model,
            tokenizer,
            template,
            opts,
            source,
            source_bytes,
            stop_ids,
            micro_batch,
        })
    }

    /// The model file or folder this tagger was loaded from.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The loaded model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The micro-batch the next call starts from (after halvings on out-of-memory).
    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }

    /// The model's shapes as a lora-memory descriptor (for [`LocalLlmTagger::row_bytes`]).
    fn descriptor(&self) -> Option<lora_memory::DecoderDescriptor> {
        let c = self.model.config();
        lora_memory::DecoderDescriptor::builder("tagger")
            .hidden(c.hidden_size as u64)
            .intermediate(c.intermediate_size as u64)
            .layers(c.num_hidden_layers as u64)
            .heads(c.num_attention_heads as u64)
            .kv_heads(c.n_kv_heads() as u64)
            .head_dim(c.head_dim() as u64)
            .vocab(c.vocab_size as u64)
            .build()
            .ok()
    }

    /// Estimated peak bytes of one row of a micro-batch whose prompts are `prompt_len` tokens,
    /// in the model's compute dtype: [`lora_memory::inference::generation_row_bytes`] (KV cache
    /// of prompt + `max_new_tokens`, the prompt's logits, the MLP's activations). 0 when the
    /// config's shapes do not make a descriptor.
    pub fn row_bytes(&self, prompt_len: usize) -> u64 {
        let elem = self.model.kind().elt_size_in_bytes() as u64;
        self.descriptor().map_or(0, |d| {
            lora_memory::inference::generation_row_bytes(
                &d,
                prompt_len,
                self.opts.max_new_tokens,
                elem,
            )
            .0
        })
    }

    /// The micro-batch for prompts of `prompt_len` tokens: [`start_micro_batch`] of the free
    /// memory on the device ([`ResourceSnapshot::free_for`]) and [`LocalLlmTagger::row_bytes`],
    /// at most the current micro-batch (`max_batch_size`, lowered by earlier out-of-memory
    /// halvings).
    pub fn plan_micro_batch(&self, prompt_len: usize) -> usize {
        let free = ResourceSnapshot::take(self.opts.device).free_for(self.opts.device, None);
        start_micro_batch(self.micro_batch, free, Some(self.row_bytes(prompt_len)))
    }

    /// Token ids of the full prompt (template applied, assistant turn opened) for `description`
    /// ([`render_prompt`]).
    ///
    /// # Errors
    /// [`Error::Model`] when the chat template refuses the conversation or tokenizing fails.
    pub fn prompt_ids(&self, description: &str) -> Result<Vec<i64>> {
        let text = render_prompt(&self.template, &self.opts.prompt, description)?;
        Ok(self.tokenizer.encode(&text, false)?)
    }

    /// Generates continuations for equal-length prompts `rows` as one batch; `seeds` per row.
    fn generate_group(&self, rows: &[&Vec<i64>], seeds: &[u64]) -> Result<Vec<Vec<i64>>> {
        let _guard = tch::no_grad_guard();
        let b = rows.len() as i64;
        let s = rows[0].len() as i64;
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        let mut input = Tensor::f_from_slice(&flat)?.f_view([b, s])?;
        let mut cache = KvCache::new(self.model.num_layers());
        let max_ctx = self.model.config().max_position_embeddings;
        let mut out: Vec<Vec<i64>> = vec![Vec::new(); rows.len()];
        let mut done = vec![false; rows.len()];
        let mut rngs: Vec<Rng> = seeds.iter().map(|&s| Rng::new(s)).collect();
        let filler = self.stop_ids.first().copied().unwrap_or(0);
        for _ in 0..self.opts.max_new_tokens {
            if cache.seq_len() + input.size()[1] > max_ctx {
                break;
            }
            let logits = self.model.forward_cached(&input, &mut cache)?;
            let last = logits
                .f_select(1, -1)?
                .f_to_kind(Kind::Float)?
                .f_to_device(Device::Cpu)?; // [b, vocab]
            let next: Vec<i64> = if self.opts.temperature <= 0.0 {
                Vec::<i64>::try_from(&last.f_argmax(-1, false)?)?
            } else {
                let v = last.size()[1] as usize;
                let all = Vec::<f32>::try_from(&last.f_contiguous()?.f_view([-1])?)?;
                all.chunks(v)
                    .zip(rngs.iter_mut())
                    .map(|(row, rng)| sample_row(row, &self.opts, rng))
                    .collect::<Result<_>>()?
            };
            let mut fed = Vec::with_capacity(rows.len());
            for (r, &t) in next.iter().enumerate() {
                if !done[r] {
                    if self.stop_ids.contains(&t) {
                        done[r] = true;
                    } else {
                        out[r].push(t);
                    }
                }
                fed.push(if done[r] { filler } else { t });
            }
            if done.iter().all(|&d| d) {
                break;
            }
            input = Tensor::f_from_slice(&fed)?.f_view([b, 1])?;
        }
        Ok(out)
    }

    /// The model's raw replies for `descriptions` (one per description, in order), generated in
    /// micro-batches of equal-length prompts.
    ///
    /// # Errors
    /// Outer: [`Error::OutOfMemory`] when a micro-batch of one does not fit; [`Error::Model`] or
    /// [`Error::Torch`] when the model fails. Inner (per description): tokenizing or decoding
    /// errors, and a prompt longer than the model's context.
    pub fn replies(&mut self, descriptions: &[String]) -> Result<Vec<Result<String>>> {
        let mut out: Vec<Option<Result<String>>> = (0..descriptions.len()).map(|_| None).collect();
        let max_ctx = self.model.config().max_position_embeddings as usize;
        let mut prompts: Vec<(usize, Vec<i64>)> = Vec::new();
        for (i, d) in descriptions.iter().enumerate() {
            match self.prompt_ids(d) {
                Ok(ids) if ids.len() >= max_ctx => {
                    out[i] = Some(Err(Error::Config {
                        key: format!("descriptions[{i}]"),
                        value: format!("{} prompt tokens", ids.len()),
                        hint: format!("shorten it: the model's context is {max_ctx} tokens"),
                    }))
                }
                Ok(ids) => prompts.push((i, ids)),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        // group equal lengths; stable, so equal prompts keep their order
        prompts.sort_by_key(|(_, ids)| ids.len());
        let model_id = self.model_id();
        let mut start = 0;
        while start < prompts.len() {
            let len = prompts[start].1.len();
            let end = prompts[start..]
                .iter()
                .position(|(_, ids)| ids.len() != len)
                .map_or(prompts.len(), |n| start + n);
            let mut batcher = AdaptiveBatcher::new(self.plan_micro_batch(len), self.opts.device);
            let this = &*self;
            let replies = batcher.run(&prompts[start..end], &model_id, |chunk| {
                let rows: Vec<&Vec<i64>> = chunk.iter().map(|(_, ids)| ids).collect();
                let seeds: Vec<u64> = chunk
                    .iter()
                    .map(|(i, _)| this.opts.seed.wrapping_add(*i as u64))
                    .collect();
                let gens = this.generate_group(&rows, &seeds).map_err(|e| {
                    let msg = e.to_string();
                    if is_oom_message(&msg) {
                        Error::OutOfMemory {
                            model: model_id.clone(),
                            msg,
                        }
                    } else {
                        e
                    }
                })?;
                Ok(gens
                    .iter()
                    .map(|toks| this.tokenizer.decode(toks, true).map_err(Error::from))
                    .collect::<Vec<_>>())
            })?;
            self.micro_batch = self.micro_batch.min(batcher.micro_batch());
            for ((i, _), r) in prompts[start..end].iter().zip(replies) {
                out[*i] = Some(r);
            }
            start = end;
        }
        Ok(out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Err(Error::Unparseable {
                        reply: String::new(),
                    })
                })
            })
            .collect())
    }
}

impl Tagger for LocalLlmTagger {
    /// The plan for prompts as long as `sample`'s: the resident weights
    /// ([`Llama::weights_resident_bytes`]), the CUDA context on a GPU, and
    /// [`LocalLlmTagger::row_bytes`] per description.
    fn batch_plan(
        &self,
        sample: &str,
        budget: Option<lora_memory::Bytes>,
    ) -> Option<lora_memory::inference::BatchPlan> {
        use lora_memory::Bytes;
        let prompt_len = self.prompt_ids(sample).ok()?.len();
        let weights = Bytes(self.model.weights_resident_bytes());
        let memory = lora_memory::inference::InferenceMemory {
            weights,
            fixed: match self.opts.device {
                Device::Cuda(_) => lora_memory::inference::cuda_fixed_bytes(),
                _ => Bytes(0),
            },
            per_item: Bytes(self.row_bytes(prompt_len)),
        };
        let budget = budget.or_else(|| {
            ResourceSnapshot::take(self.opts.device)
                .free_for(self.opts.device, None)
                .map(|f| Bytes(f + weights.0))
        })?;
        Some(lora_memory::inference::batch_for(
            &memory,
            budget,
            self.micro_batch,
        ))
    }

    /// `local:<file name>:<bytes>B:<sampling>:n<max_new_tokens>`, e.g.
    /// `local:SmolLM2-135M-Instruct.Q4_1.gguf:98362432B:greedy:n48`.
    fn model_id(&self) -> String {
        let name = self.source.file_name().map_or_else(
            || self.source.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let sampling = if self.opts.temperature <= 0.0 {
            "greedy".to_string()
        } else {
            format!(
                "t{}-p{}-k{}-s{}",
                self.opts.temperature, self.opts.top_p, self.opts.top_k, self.opts.seed
            )
        };
        let prompt = if self.opts.prompt == TagPrompt::default() {
            String::new()
        } else {
            ":custom-prompt".to_string()
        };
        format!(
            "local:{name}:{}B:{sampling}:n{}{prompt}",
            self.source_bytes, self.opts.max_new_tokens
        )
    }

    /// Always [`Error::Unsupported`]: a text model does not see images.
    fn tag_images(&mut self, _paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        Err(Error::Unsupported {
            tagger: self.model_id(),
            what: "images (an LLM tagger turns descriptions into tags)",
        })
    }

    /// [`LocalLlmTagger::replies`] parsed with [`parse_scored`]; a reply without tags is an inner
    /// [`Error::Unparseable`].
    fn tag_descriptions(&mut self, descriptions: &[String]) -> Result<Vec<ItemResult>> {
        Ok(self
            .replies(descriptions)?
            .into_iter()
            .map(|r| r.and_then(|text| parse_scored(&text)))
            .collect())
    }
}

/// The prompt text for `description` through `template`, assistant turn opened. A template that
/// refuses the system turn (Gemma's raise "System role not supported") gets the conversation
/// with the system prompt folded into the first user turn
/// ([`TagPrompt::messages_without_system`]) instead.
///
/// # Errors
/// [`Error::Model`] with the template's first error when both renderings fail.
pub fn render_prompt(
    template: &ChatTemplate,
    prompt: &TagPrompt,
    description: &str,
) -> Result<String> {
    match template.apply(&prompt.messages(description), true) {
        Ok(text) => Ok(text),
        Err(first) => template
            .apply(&prompt.messages_without_system(description), true)
            .map_err(|_| first.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampler_is_seeded_and_respects_top_k() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let opts = LocalLlmOptions {
            temperature: 1.0,
            top_k: 2,
            ..Default::default()
        };
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..50)
                .map(|_| sample_row(&logits, &opts, &mut rng).unwrap())
                .collect::<Vec<_>>()
        };
        let a = draw(7);
        assert_eq!(a, draw(7));
        assert!(a.iter().all(|&t| t == 1 || t == 3), "{a:?}");
        assert!(a.contains(&1) && a.contains(&3));
    }

    #[test]
    fn a_template_without_a_system_role_gets_the_system_prompt_in_the_user_turn() {
        // Gemma 2's own template (llama.cpp's models/templates, fetched by `cargo xtask setup`)
        let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "../assets".into());
        let path = std::path::Path::new(&assets).join("chat_templates/google-gemma-2-2b-it.jinja");
        let src = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}; run `cargo xtask setup`", path.display()));
        let gemma = ChatTemplate::from_jinja(&src, "<bos>", "<eos>").unwrap();
        let prompt = TagPrompt::default();
        // the plain conversation is refused...
        let refused = gemma
            .apply(&prompt.messages("A red fox."), true)
            .unwrap_err();
        assert!(
            refused.to_string().contains("System role not supported"),
            "{refused}"
        );
        // ...so the system prompt opens the first user turn
        let text = render_prompt(&gemma, &prompt, "A red fox.").unwrap();
        let first_user = format!(
            "<start_of_turn>user\n{}\n\n{}<end_of_turn>",
            prompt.system,
            super::super::prompt::FEW_SHOT.0
        );
        assert!(text.starts_with(&format!("<bos>{first_user}")), "{text}");
        assert!(
            text.ends_with("<start_of_turn>user\nA red fox.<end_of_turn>\n<start_of_turn>model\n"),
            "{text}"
        );
        // ChatML keeps its system turn
        let chatml = render_prompt(&ChatTemplate::chatml(), &prompt, "A red fox.").unwrap();
        assert!(chatml.starts_with("<|im_start|>system\n"), "{chatml}");
    }
}
