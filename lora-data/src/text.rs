//! Text datasets: plain text, JSONL, alpaca and chat conversations → token ids, labels and masks.
//!
//! Pipeline ([`TextDataset::from_files`]):
//! 1. **read**: every file is read as UTF-8 (BOM stripped, CRLF → LF) and parsed according to
//!    [`TextFormat`] into *documents*, each a list of [`Segment`]s marked trainable or not;
//! 2. **tokenize** in parallel (rayon) with the caller's `tokenizers::Tokenizer`; labels are the
//!    token ids where the token starts inside a trainable segment, `-100` elsewhere (the
//!    `ignore_index` of PyTorch's `cross_entropy`);
//! 3. **chunk**: a document longer than `seq_len` is cut into `seq_len` pieces (plain text files are
//!    one long document each, so they become `seq_len` chunks);
//! 4. **pack** (default) into rows of exactly `seq_len` tokens by best-fit decreasing, with position
//!    ids restarting at 0 for every document and a document id per token (0 = padding), so no
//!    token attends across documents ([`TextBatch::attention_mask_4d`]); or **pad** each document
//!    to the longest of its batch, batches grouped by length bucket ([`crate::loader::Dataset::group`]).
//!
//! Labels are *not* shifted: the model shifts them (Hugging Face convention). In packed rows the first
//! token of every document has label `-100`, as in `transformers`' `DataCollatorWithFlattening`,
//! so the last token of one document is never trained to predict the first of the next.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use rayon::prelude::*;
use serde_json::Value;
use tch::{Kind, Tensor};
use tokenizers::Tokenizer;

use crate::loader::{Collate, Dataset};
use crate::rng::Rng;
use crate::{Error, Result};

/// Label value ignored by the loss (`ignore_index` of `torch.nn.functional.cross_entropy`).
pub const IGNORE_INDEX: i64 = -100;

/// How the files are laid out.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextFormat {
    /// Plain text: each file is one document, cut into `seq_len` chunks.
    Plain,
    /// JSONL (or a JSON array) of objects with a string field holding the text.
    Jsonl {
        /// The field name, usually `"text"`.
        text_field: String,
    },
    /// Alpaca instruction data: `instruction`, optional `input`, `output`, optional `system`.
    /// The user turn is `instruction` or `instruction + "\n\n" + input`.
    Alpaca,
    /// Conversations: ShareGPT `{"conversations": [{"from", "value"}]}` or
    /// `{"messages": [{"role", "content"}]}`, with an optional top-level `system`.
    Conversations,
}

/// Speaker of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// System prompt.
    System,
    /// The user (ShareGPT `human`).
    User,
    /// The model (ShareGPT `gpt`); these turns are trained on.
    Assistant,
    /// A tool result (ShareGPT `observation`, `function_response`, role `tool`).
    Tool,
}

impl Role {
    /// The role name written by ChatML.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }

    /// Parses ShareGPT `from` and OpenAI `role` names; `None` when unknown.
    pub fn parse(name: &str) -> Option<Role> {
        match name.to_ascii_lowercase().as_str() {
            "system" => Some(Role::System),
            "user" | "human" => Some(Role::User),
            "assistant" | "gpt" | "model" | "chatgpt" | "bing" | "bard" => Some(Role::Assistant),
            "tool" | "observation" | "function" | "function_response" | "ipython" => {
                Some(Role::Tool)
            }
            _ => None,
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Speaker.
    pub role: Role,
    /// Text.
    pub content: String,
}

/// A piece of rendered text and whether its tokens are trained on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Text (may contain special-token strings like `<|im_start|>`).
    pub text: String,
    /// `true`: tokens starting inside this text get labels; `false`: `-100` (when masking is on).
    pub trainable: bool,
}

/// Renders a conversation to text with the trainable parts marked. [`ChatMl`] is built in (the
/// fallback for a model without a template); [`crate::jinja::JinjaChatTemplate`] renders a
/// model's own Jinja template.
pub trait ChatTemplate: Send + Sync + fmt::Debug {
    /// Renders `messages` in order. Assistant content (and its end-of-turn marker) should be the only
    /// trainable segments.
    ///
    /// # Errors
    /// A template may refuse a conversation it cannot render: [`Error::TemplateRaised`] (its own
    /// `raise_exception`), [`Error::Template`], [`Error::TemplateNotPrefixStable`].
    fn render(&self, messages: &[Message]) -> Result<Vec<Segment>>;
}

/// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message (the format of SmolLM2, Qwen,
/// OpenAI's ChatML spec). Trainable: each assistant `content<|im_end|>`, as in the `{% generation %}`
/// blocks of Hugging Face assistant-mask templates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChatMl {
    /// System prompt inserted when a conversation has none (e.g. SmolLM2's
    /// "You are a helpful AI assistant named SmolLM, trained by Hugging Face").
    pub default_system: Option<String>,
}

impl ChatMl {
    /// The token string that ends a turn.
    pub const END_OF_TURN: &'static str = "<|im_end|>";
    /// The text that opens the assistant's turn: the end of a prompt to generate from.
    pub const GENERATION_PROMPT: &'static str = "<|im_start|>assistant\n";

    /// Renders turns given as `(role, content)` (any role name), in order. Assistant content and
    /// its `<|im_end|>` are the trainable segments. With `add_generation_prompt` the assistant turn
    /// is opened at the end ([`ChatMl::GENERATION_PROMPT`], not trainable).
    pub fn render_turns<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> Vec<Segment> {
        let fixed = |text: String| Segment {
            text,
            trainable: false,
        };
        let mut turns = turns.into_iter().peekable();
        let mut out = Vec::with_capacity(turns.size_hint().0 * 3 + 2);
        if let Some(sys) = &self.default_system
            && turns.peek().map(|&(role, _)| role) != Some(Role::System.as_str())
        {
            out.push(fixed(format!(
                "<|im_start|>system\n{sys}{}\n",
                Self::END_OF_TURN
            )));
        }
        for (role, content) in turns {
            if role == Role::Assistant.as_str() {
                out.push(fixed(Self::GENERATION_PROMPT.to_string()));
                out.push(Segment {
                    text: format!("{content}{}", Self::END_OF_TURN),
                    trainable: true,
                });
                out.push(fixed("\n".to_string()));
            } else {
                out.push(fixed(format!(
                    "<|im_start|>{role}\n{content}{}\n",
                    Self::END_OF_TURN
                )));
            }
        }
        if add_generation_prompt {
            out.push(fixed(Self::GENERATION_PROMPT.to_string()));
        }
        out
    }

    /// The text of [`ChatMl::render_turns`]: the prompt a model generates from when
    /// `add_generation_prompt`.
    pub fn prompt<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> String {
        self.render_turns(turns, add_generation_prompt)
            .into_iter()
            .map(|s| s.text)
            .collect()
    }
}

impl ChatTemplate for ChatMl {
    fn render(&self, messages: &[Message]) -> Result<Vec<Segment>> {
        Ok(self.render_turns(
            messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str())),
            false,
        ))
    }
}

/// How text becomes training rows.
#[derive(Clone)]
pub struct TextConfig {
    /// File layout.
    pub format: TextFormat,
    /// Tokens per row (packing) or maximum tokens per document (padding). Default 512.
    pub seq_len: usize,
    /// Pack documents into rows of exactly `seq_len` (default) or pad per batch.
    pub packing: bool,
    /// Only assistant turns get labels (chat formats). Default `true`.
    pub mask_prompt: bool,
    /// Appended to every document of `Plain` and `Jsonl` formats (trainable). Default `None`.
    pub eos_token_id: Option<u32>,
    /// Padding token id (its labels are always `-100`). Default 0.
    pub pad_token_id: u32,
    /// Padded batches are rounded up to a multiple of this many tokens. Default 8.
    pub pad_to_multiple_of: usize,
    /// Width in tokens of a length bucket when padding. Default 64.
    pub bucket_width: usize,
    /// Seed for document order before packing and for [`TextDataset::split`]. Default 42.
    pub seed: u64,
    /// Chat template for `Alpaca` and `Conversations`: the model's own
    /// ([`crate::jinja::JinjaChatTemplate`]) when it has one. Default [`ChatMl`].
    pub template: Arc<dyn ChatTemplate>,
}

impl Default for TextConfig {
    fn default() -> Self {
        TextConfig {
            format: TextFormat::Plain,
            seq_len: 512,
            packing: true,
            mask_prompt: true,
            eos_token_id: None,
            pad_token_id: 0,
            pad_to_multiple_of: 8,
            bucket_width: 64,
            seed: 42,
            template: Arc::new(ChatMl::default()),
        }
    }
}

impl fmt::Debug for TextConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TextConfig")
            .field("format", &self.format)
            .field("seq_len", &self.seq_len)
            .field("packing", &self.packing)
            .field("mask_prompt", &self.mask_prompt)
            .field("eos_token_id", &self.eos_token_id)
            .field("pad_token_id", &self.pad_token_id)
            .field("pad_to_multiple_of", &self.pad_to_multiple_of)
            .field("bucket_width", &self.bucket_width)
            .field("seed", &self.seed)
            .field("template", &self.template)
            .finish()
    }
}

/// A tokenized document (at most `seq_len` tokens).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// Token ids.
    pub ids: Vec<i64>,
    /// Labels (`-100` = not trained on), same length.
    pub labels: Vec<i64>,
    /// Where it came from (`file:line`, `#chunk` for pieces of longer documents).
    pub source: String,
}

/// One row handed to the collate: token ids, labels, position ids and document ids (all the same
/// length; `doc_ids` 1-based per row, 0 = padding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextSample {
    /// Token ids.
    pub input_ids: Vec<i64>,
    /// Labels, `-100` = ignored.
    pub labels: Vec<i64>,
    /// Position of each token within its document.
    pub position_ids: Vec<i64>,
    /// Document number within the row (1, 2, …; 0 = padding).
    pub doc_ids: Vec<i64>,
}

/// Counts describing a [`TextDataset`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TextStats {
    /// Documents kept (after chunking).
    pub documents: usize,
    /// Documents dropped: fewer than 2 tokens, or no trainable token.
    pub dropped: usize,
    /// Rows (samples) of the dataset.
    pub rows: usize,
    /// Token positions holding real tokens.
    pub tokens: usize,
    /// Tokens with a label other than `-100`.
    pub trainable_tokens: usize,
    /// Padding positions inside packed rows (0 when padding per batch: that happens in collate).
    pub padding: usize,
}

/// A tokenized text dataset: documents and the rows built from them.
#[derive(Debug, Clone)]
pub struct TextDataset {
    docs: Vec<Document>,
    rows: Vec<Vec<usize>>,
    config: TextConfig,
    dropped: usize,
}

/// One document before tokenization.
struct RawDoc {
    stream: usize,
    source: String,
    segments: Vec<Segment>,
}

impl TextDataset {
    /// Reads, tokenizes (in parallel) and packs `paths` according to `config`.
    ///
    /// # Errors
    /// [`Error::Io`] for unreadable files, [`Error::Format`] (file, line, what is expected) for
    /// non-UTF-8 text, bad JSON or missing fields, [`Error::Tokenizer`], [`Error::Config`] for
    /// `seq_len < 2`.
    pub fn from_files<P: AsRef<Path>>(
        paths: &[P],
        tokenizer: &Tokenizer,
        config: TextConfig,
    ) -> Result<Self> {
        let mut raws = Vec::new();
        let mut stream = 0usize;
        for p in paths {
            let path = p.as_ref();
            let text = read_text(path)?;
            parse_into(&text, path, &config, &mut stream, &mut raws)?;
        }
        Self::from_raw(raws, tokenizer, config)
    }

    /// As [`TextDataset::from_files`] for in-memory text; `texts` are `(name, content)` pairs, the
    /// name standing in for the file in messages.
    ///
    /// # Errors
    /// As [`TextDataset::from_files`].
    pub fn from_texts(
        texts: &[(&str, &str)],
        tokenizer: &Tokenizer,
        config: TextConfig,
    ) -> Result<Self> {
        let mut raws = Vec::new();
        let mut stream = 0usize;
        for (name, content) in texts {
            let text = normalize_text(content);
            parse_into(&text, Path::new(name), &config, &mut stream, &mut raws)?;
        }
        Self::from_raw(raws, tokenizer, config)
    }

    /// Builds a dataset from already tokenized documents (each ≤ `seq_len`; longer ones are cut).
    ///
    /// # Errors
    /// [`Error::Config`] for `seq_len < 2` or a length mismatch between ids and labels.
    pub fn from_documents(docs: Vec<Document>, config: TextConfig) -> Result<Self> {
        check_config(&config)?;
        let mut kept = Vec::with_capacity(docs.len());
        let mut dropped = 0;
        for d in docs {
            if d.ids.len() != d.labels.len() {
                return Err(Error::config(
                    "labels",
                    format!("{} labels for {} ids", d.labels.len(), d.ids.len()),
                    format!("document {} needs one label per token", d.source),
                ));
            }
            for piece in chunk(d, config.seq_len) {
                if piece.ids.len() < 2 || piece.labels.iter().all(|&l| l == IGNORE_INDEX) {
                    dropped += 1;
                } else {
                    kept.push(piece);
                }
            }
        }
        let mut ds = TextDataset {
            docs: kept,
            rows: Vec::new(),
            config,
            dropped,
        };
        ds.build_rows();
        Ok(ds)
    }

    fn from_raw(raws: Vec<RawDoc>, tokenizer: &Tokenizer, config: TextConfig) -> Result<Self> {
        check_config(&config)?;
        let mask = config.mask_prompt;
        let encoded: Vec<(usize, String, Vec<i64>, Vec<i64>)> = raws
            .into_par_iter()
            .map(|raw| {
                let (ids, labels) = encode_segments(tokenizer, &raw.segments, mask, &raw.source)?;
                Ok((raw.stream, raw.source, ids, labels))
            })
            .collect::<Result<_>>()?;
        // Concatenate the pieces of each stream (plain files are tokenized in pieces).
        let mut docs: Vec<Document> = Vec::new();
        let mut current: Option<usize> = None;
        for (stream, source, ids, labels) in encoded {
            if current == Some(stream)
                && let Some(last) = docs.last_mut()
            {
                last.ids.extend(ids);
                last.labels.extend(labels);
            } else {
                docs.push(Document {
                    ids,
                    labels,
                    source,
                });
                current = Some(stream);
            }
        }
        let eos_formats = matches!(config.format, TextFormat::Plain | TextFormat::Jsonl { .. });
        if let (Some(eos), true) = (config.eos_token_id, eos_formats) {
            for d in &mut docs {
                d.ids.push(eos as i64);
                d.labels.push(eos as i64);
            }
        }
        Self::from_documents(docs, config)
    }

    fn build_rows(&mut self) {
        let mut order: Vec<usize> = (0..self.docs.len()).collect();
        Rng::derived(&[self.config.seed, 0x7061_636b]).shuffle(&mut order);
        if !self.config.packing {
            self.rows = order.into_iter().map(|i| vec![i]).collect();
            return;
        }
        // Best-fit decreasing: longest documents first, each into the open row with the least
        // room that still fits it (ties: lowest row), else a new row.
        order.sort_by_key(|&i| std::cmp::Reverse(self.docs[i].ids.len()));
        let cap = self.config.seq_len;
        let mut rows: Vec<Vec<usize>> = Vec::new();
        let mut by_room: std::collections::BTreeMap<(usize, usize), ()> = Default::default();
        for i in order {
            let len = self.docs[i].ids.len();
            let found = by_room.range((len, 0)..).next().map(|(k, _)| *k);
            let (room, r) = match found {
                Some(key) => {
                    by_room.remove(&key);
                    key
                }
                None => {
                    rows.push(Vec::new());
                    (cap, rows.len() - 1)
                }
            };
            rows[r].push(i);
            if room - len > 0 {
                by_room.insert((room - len, r), ());
            }
        }
        self.rows = rows;
    }

    /// The configuration.
    pub fn config(&self) -> &TextConfig {
        &self.config
    }

    /// The tokenized documents.
    pub fn documents(&self) -> &[Document] {
        &self.docs
    }

    /// Document indices of each row.
    pub fn rows(&self) -> &[Vec<usize>] {
        &self.rows
    }

    /// Counts of documents, rows, tokens and padding.
    pub fn stats(&self) -> TextStats {
        let tokens: usize = self.docs.iter().map(|d| d.ids.len()).sum();
        let trainable_tokens = self
            .docs
            .iter()
            .flat_map(|d| &d.labels)
            .filter(|&&l| l != IGNORE_INDEX)
            .count();
        let padding = if self.config.packing {
            self.rows.len() * self.config.seq_len - tokens
        } else {
            0
        };
        TextStats {
            documents: self.docs.len(),
            dropped: self.dropped,
            rows: self.rows.len(),
            tokens,
            trainable_tokens,
            padding,
        }
    }

    /// Splits the *documents* into (train, validation), `fraction` of them (rounded, at least 1 when
    /// `fraction > 0` and there are 2+ documents) going to validation, chosen by `seed`; each part
    /// is packed again. To split by file instead, build two datasets from two file lists.
    ///
    /// # Errors
    /// [`Error::Config`] when `fraction` is outside `[0, 1)`.
    pub fn split(&self, fraction: f64, seed: u64) -> Result<(TextDataset, TextDataset)> {
        if !(0.0..1.0).contains(&fraction) {
            return Err(Error::config(
                "validation_fraction",
                fraction,
                "must be in [0, 1), e.g. 0.05",
            ));
        }
        let n = self.docs.len();
        let mut order: Vec<usize> = (0..n).collect();
        Rng::derived(&[seed, 0x0073_706c_6974]).shuffle(&mut order);
        let mut n_val = (fraction * n as f64).round() as usize;
        if fraction > 0.0 && n_val == 0 && n >= 2 {
            n_val = 1;
        }
        let (val, train) = order.split_at(n_val);
        let pick = |idx: &[usize]| {
            let mut idx = idx.to_vec();
            idx.sort_unstable();
            idx.into_iter()
                .map(|i| self.docs[i].clone())
                .collect::<Vec<_>>()
        };
        let t = TextDataset::from_documents(pick(train), self.config.clone())?;
        let v = TextDataset::from_documents(pick(val), self.config.clone())?;
        Ok((t, v))
    }

    /// A [`Loader`](crate::loader::Loader) over this dataset with its collate function.
    ///
    /// # Errors
    /// As [`crate::loader::Loader::new`].
    pub fn into_loader(
        self,
        config: crate::loader::LoaderConfig,
    ) -> Result<crate::loader::Loader<TextDataset, TextCollate>> {
        let collate = self.collate();
        crate::loader::Loader::new(self, collate, config)
    }

    /// A collate function matching this dataset's padding settings.
    pub fn collate(&self) -> TextCollate {
        TextCollate {
            pad_token_id: self.config.pad_token_id as i64,
            pad_to_multiple_of: self.config.pad_to_multiple_of,
            seq_len: if self.config.packing {
                Some(self.config.seq_len)
            } else {
                None
            },
        }
    }
}

impl Dataset for TextDataset {
    type Item = TextSample;

    fn len(&self) -> usize {
        self.rows.len()
    }

    fn get(&self, index: usize) -> Result<TextSample> {
        let row = self.rows.get(index).ok_or(Error::IndexOutOfRange {
            index,
            len: self.rows.len(),
        })?;
        let packed = self.config.packing;
        let mut s = TextSample {
            input_ids: Vec::new(),
            labels: Vec::new(),
            position_ids: Vec::new(),
            doc_ids: Vec::new(),
        };
        for (k, &d) in row.iter().enumerate() {
            let doc = &self.docs[d];
            s.input_ids.extend_from_slice(&doc.ids);
            let first = s.labels.len();
            s.labels.extend_from_slice(&doc.labels);
            if packed {
                s.labels[first] = IGNORE_INDEX;
            }
            s.position_ids.extend(0..doc.ids.len() as i64);
            s.doc_ids
                .extend(std::iter::repeat_n(k as i64 + 1, doc.ids.len()));
        }
        Ok(s)
    }

    fn group(&self, index: usize) -> u64 {
        if self.config.packing {
            return 0;
        }
        let len: usize = self
            .rows
            .get(index)
            .map(|r| r.iter().map(|&d| self.docs[d].ids.len()).sum())
            .unwrap_or(0);
        len.div_ceil(self.config.bucket_width.max(1)) as u64
    }
}

/// A batch of token rows.
///
/// # Shapes
/// `b` rows of `s` tokens; all tensors `[b, s]` `Kind::Int64` on the CPU.
#[derive(Debug)]
pub struct TextBatch {
    /// Token ids (padding = `pad_token_id`).
    pub input_ids: Tensor,
    /// Labels, `-100` = ignored (prompt tokens, padding, first token of a packed document).
    pub labels: Tensor,
    /// 1 = real token, 0 = padding.
    pub attention_mask: Tensor,
    /// Position of each token within its document (restarts at 0 per packed document).
    pub position_ids: Tensor,
    /// Document id per token within its row (1, 2, …; 0 = padding) for packed rows; `None` when
    /// every row holds one document.
    pub doc_ids: Option<Tensor>,
}

impl TextBatch {
    /// The boolean attention mask `[b, 1, s, s]` (`true` = may attend): causal, within the same
    /// document, never to padding keys. Each position may always attend to itself so that softmax
    /// rows of padding queries stay finite. Pass it as `attn_mask` of
    /// `scaled_dot_product_attention` (PyTorch: boolean `True` = take part in attention).
    ///
    /// # Errors
    /// [`Error::Tensor`] if libtorch fails (out of memory for very long rows).
    pub fn attention_mask_4d(&self) -> Result<Tensor> {
        let ctx = "building the 4-D attention mask";
        let size = self.input_ids.size();
        let (b, s) = match size.as_slice() {
            [b, s] => (*b, *s),
            _ => {
                return Err(Error::config(
                    "input_ids",
                    format!("{size:?}"),
                    "expected shape [batch, seq]",
                ));
            }
        };
        let dev = self.input_ids.device();
        let causal = Tensor::f_ones([s, s], (Kind::Bool, dev))
            .and_then(|t| t.f_tril(0))
            .map_err(Error::tensor(ctx))?;
        let key_ok = self
            .attention_mask
            .f_ne(0)
            .and_then(|t| t.f_view([b, 1, 1, s]))
            .map_err(Error::tensor(ctx))?;
        let mut mask = causal
            .f_view([1, 1, s, s])
            .and_then(|c| c.f_logical_and(&key_ok))
            .map_err(Error::tensor(ctx))?;
        if let Some(doc) = &self.doc_ids {
            let same = doc
                .f_view([b, 1, s, 1])
                .and_then(|q| q.f_eq_tensor(&doc.f_view([b, 1, 1, s])?))
                .map_err(Error::tensor(ctx))?;
            mask = mask.f_logical_and(&same).map_err(Error::tensor(ctx))?;
        }
        let eye = Tensor::f_eye(s, (Kind::Bool, dev))
            .and_then(|e| e.f_view([1, 1, s, s]))
            .map_err(Error::tensor(ctx))?;
        mask.f_logical_or(&eye).map_err(Error::tensor(ctx))
    }

    /// Number of rows.
    pub fn batch_size(&self) -> i64 {
        self.input_ids.size().first().copied().unwrap_or(0)
    }
}

/// Stacks [`TextSample`]s into a [`TextBatch`], padding to the longest row (rounded up to
/// `pad_to_multiple_of`, or exactly `seq_len` for packed rows).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextCollate {
    /// Padding token id.
    pub pad_token_id: i64,
    /// Round padded lengths up to a multiple of this.
    pub pad_to_multiple_of: usize,
    /// `Some(seq_len)` for packed datasets: rows are padded to exactly this and `doc_ids` is set.
    pub seq_len: Option<usize>,
}

impl Collate<TextSample> for TextCollate {
    type Batch = TextBatch;

    fn collate(&self, items: Vec<TextSample>) -> Result<TextBatch> {
        let b = items.len();
        let longest = items.iter().map(|s| s.input_ids.len()).max().unwrap_or(0);
        let s = match self.seq_len {
            Some(n) => n.max(longest),
            None => {
                longest.div_ceil(self.pad_to_multiple_of.max(1)) * self.pad_to_multiple_of.max(1)
            }
        };
        let mut ids = vec![self.pad_token_id; b * s];
        let mut labels = vec![IGNORE_INDEX; b * s];
        let mut att = vec![0i64; b * s];
        let mut pos = vec![0i64; b * s];
        let mut doc = vec![0i64; b * s];
        for (r, item) in items.iter().enumerate() {
            let n = item.input_ids.len();
            let o = r * s;
            ids[o..o + n].copy_from_slice(&item.input_ids);
            labels[o..o + n].copy_from_slice(&item.labels);
            att[o..o + n].fill(1);
            pos[o..o + n].copy_from_slice(&item.position_ids);
            doc[o..o + n].copy_from_slice(&item.doc_ids);
        }
        let ctx = "collating a text batch";
        let t = |v: &[i64]| {
            Tensor::f_from_slice(v)
                .and_then(|t| t.f_view([b as i64, s as i64]))
                .map_err(Error::tensor(ctx))
        };
        Ok(TextBatch {
            input_ids: t(&ids)?,
            labels: t(&labels)?,
            attention_mask: t(&att)?,
            position_ids: t(&pos)?,
            doc_ids: if self.seq_len.is_some() {
                Some(t(&doc)?)
            } else {
                None
            },
        })
    }
}

fn check_config(config: &TextConfig) -> Result<()> {
    if config.seq_len < 2 {
        return Err(Error::config(
            "seq_len",
            config.seq_len,
            "must be at least 2 tokens (one input, one target)",
        ));
    }
    Ok(())
}

fn chunk(doc: Document, seq_len: usize) -> Vec<Document> {
    if doc.ids.len() <= seq_len {
        return vec![doc];
    }
    doc.ids
        .chunks(seq_len)
        .zip(doc.labels.chunks(seq_len))
        .enumerate()
        .map(|(k, (i, l))| Document {
            ids: i.to_vec(),
            labels: l.to_vec(),
            source: format!("{}#{k}", doc.source),
        })
        .collect()
}

/// Reads a text file as UTF-8, BOM stripped, CRLF → LF.
fn read_text(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    match String::from_utf8(bytes) {
        Ok(s) => Ok(normalize_text(&s)),
        Err(e) => {
            let at = e.utf8_error().valid_up_to();
            let line = e.as_bytes()[..at].iter().filter(|&&c| c == b'\n').count() + 1;
            Err(Error::Format {
                path: path.to_path_buf(),
                line,
                message: format!(
                    "not valid UTF-8 at byte {at}; re-save the file as UTF-8 \
                     (e.g. `iconv -f latin1 -t utf-8`)"
                ),
            })
        }
    }
}

fn normalize_text(s: &str) -> String {
    let s = s.strip_prefix('\u{feff}').unwrap_or(s);
    if s.contains('\r') {
        s.replace("\r\n", "\n")
    } else {
        s.to_string()
    }
}

/// Pieces of roughly this many bytes, cut after a newline, are tokenized in parallel.
const PIECE_BYTES: usize = 16 * 1024;

fn parse_into(
    text: &str,
    path: &Path,
    config: &TextConfig,
    stream: &mut usize,
    out: &mut Vec<RawDoc>,
) -> Result<()> {
    let name = path.display().to_string();
    match &config.format {
        TextFormat::Plain => {
            let mut start = 0;
            while start < text.len() {
                let mut end = (start + PIECE_BYTES).min(text.len());
                if end < text.len() {
                    end = text[end..].find('\n').map_or(text.len(), |p| end + p + 1);
                }
                out.push(RawDoc {
                    stream: *stream,
                    source: name.clone(),
                    segments: vec![Segment {
                        text: text[start..end].to_string(),
                        trainable: true,
                    }],
                });
                start = end;
            }
            *stream += 1;
        }
        _ => {
            for (line, obj) in json_records(text, path)? {
                let source = format!("{name}:{line}");
                let fail = |message: String| Error::Format {
                    path: path.to_path_buf(),
                    line,
                    message,
                };
                let segments = match &config.format {
                    TextFormat::Jsonl { text_field } => {
                        let t = obj.get(text_field).and_then(Value::as_str).ok_or_else(|| {
                            fail(format!(
                                "no string field `{text_field}` (keys: {}); set TextFormat::Jsonl \
                                 {{ text_field }} to the field holding the text",
                                keys(&obj)
                            ))
                        })?;
                        vec![Segment {
                            text: t.to_string(),
                            trainable: true,
                        }]
                    }
                    TextFormat::Alpaca => {
                        let messages = alpaca_messages(&obj).map_err(fail)?;
                        render_record(config, &messages, path, line)?
                    }
                    TextFormat::Conversations => {
                        let messages = conversation_messages(&obj).map_err(fail)?;
                        render_record(config, &messages, path, line)?
                    }
                    TextFormat::Plain => Vec::new(),
                };
                out.push(RawDoc {
                    stream: *stream,
                    source,
                    segments,
                });
                *stream += 1;
            }
        }
    }
    Ok(())
}

/// Renders one record's messages with the configured template; a template error names the
/// record ([`Error::Record`]).
fn render_record(
    config: &TextConfig,
    messages: &[Message],
    path: &Path,
    line: usize,
) -> Result<Vec<Segment>> {
    config.template.render(messages).map_err(|e| Error::Record {
        path: path.to_path_buf(),
        line,
        source: Box::new(e),
    })
}

fn keys(obj: &Value) -> String {
    obj.as_object()
        .map(|m| m.keys().cloned().collect::<Vec<_>>().join(", "))
        .unwrap_or_else(|| "not an object".into())
}

/// JSON objects of a JSONL file (one per non-blank line) or of a top-level JSON array, with their
/// 1-based line numbers (array elements: their index + 1).
fn json_records(text: &str, path: &Path) -> Result<Vec<(usize, Value)>> {
    let trimmed = text.trim_start();
    if trimmed.starts_with('[') {
        let v: Value = serde_json::from_str(trimmed).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            line: e.line(),
            message: format!("invalid JSON array: {e}"),
        })?;
        let arr = v.as_array().cloned().unwrap_or_default();
        return Ok(arr
            .into_iter()
            .enumerate()
            .map(|(i, v)| (i + 1, v))
            .collect());
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: Value = serde_json::from_str(line).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            line: i + 1,
            message: format!("invalid JSON ({e}); each line must hold one JSON object"),
        })?;
        out.push((i + 1, v));
    }
    Ok(out)
}

fn alpaca_messages(obj: &Value) -> std::result::Result<Vec<Message>, String> {
    let field = |k: &str| obj.get(k).and_then(Value::as_str);
    let instruction = field("instruction").ok_or_else(|| {
        format!(
            "alpaca record without a string `instruction` (keys: {})",
            keys(obj)
        )
    })?;
    let output = field("output").ok_or_else(|| {
        format!(
            "alpaca record without a string `output` (keys: {})",
            keys(obj)
        )
    })?;
    let mut messages = Vec::new();
    if let Some(sys) = field("system").filter(|s| !s.is_empty()) {
        messages.push(Message {
            role: Role::System,
            content: sys.to_string(),
        });
    }
    let user = match field("input").filter(|s| !s.trim().is_empty()) {
        Some(input) => format!("{instruction}\n\n{input}"),
        None => instruction.to_string(),
    };
    messages.push(Message {
        role: Role::User,
        content: user,
    });
    messages.push(Message {
        role: Role::Assistant,
        content: output.to_string(),
    });
    Ok(messages)
}

fn conversation_messages(obj: &Value) -> std::result::Result<Vec<Message>, String> {
    let (list, role_key, content_key) = if let Some(c) = obj.get("conversations") {
        (c, "from", "value")
    } else if let Some(m) = obj.get("messages") {
        (m, "role", "content")
    } else {
        return Err(format!(
            "no `conversations` (ShareGPT) or `messages` list (keys: {})",
            keys(obj)
        ));
    };
    let list = list
        .as_array()
        .ok_or_else(|| format!("`{role_key}` turns must be in a JSON list"))?;
    let mut messages = Vec::with_capacity(list.len() + 1);
    if let Some(sys) = obj
        .get("system")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
    {
        messages.push(Message {
            role: Role::System,
            content: sys.to_string(),
        });
    }
    for (i, turn) in list.iter().enumerate() {
        let name = turn
            .get(role_key)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("turn {i} has no string `{role_key}`"))?;
        let role = Role::parse(name).ok_or_else(|| {
            format!(
                "turn {i}: unknown speaker `{name}`; use system, user/human, assistant/gpt or tool"
            )
        })?;
        let content = turn
            .get(content_key)
            .and_then(Value::as_str)
            .ok_or_else(|| format!("turn {i} has no string `{content_key}`"))?;
        messages.push(Message {
            role,
            content: content.to_string(),
        });
    }
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err("conversation without an assistant turn: nothing to train on".into());
    }
    Ok(messages)
}

/// Encodes the concatenation of `segments` once (so tokens merge as in the full text) and labels
/// each token by the segment holding its first byte.
fn encode_segments(
    tokenizer: &Tokenizer,
    segments: &[Segment],
    mask: bool,
    source: &str,
) -> Result<(Vec<i64>, Vec<i64>)> {
    let mut text = String::new();
    let mut spans = Vec::with_capacity(segments.len());
    for s in segments {
        let start = text.len();
        text.push_str(&s.text);
        spans.push((start, text.len(), s.trainable));
    }
    let enc = tokenizer
        .encode(text.as_str(), false)
        .map_err(|e| Error::Tokenizer {
            context: source.to_string(),
            message: e.to_string(),
        })?;
    let ids: Vec<i64> = enc.get_ids().iter().map(|&i| i as i64).collect();
    let labels = if mask {
        enc.get_offsets()
            .iter()
            .zip(&ids)
            .map(|(&(start, _), &id)| {
                let trainable = spans
                    .iter()
                    .find(|&&(a, b, _)| start >= a && start < b)
                    .is_some_and(|s| s.2);
                if trainable { id } else { IGNORE_INDEX }
            })
            .collect()
    } else {
        ids.clone()
    };
    Ok((ids, labels))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_marks_only_assistant_content_and_end_marker() {
        let t = ChatMl {
            default_system: Some("Be brief.".into()),
        };
        let segs = t
            .render(&[
                Message {
                    role: Role::User,
                    content: "Hi".into(),
                },
                Message {
                    role: Role::Assistant,
                    content: "Hello".into(),
                },
            ])
            .unwrap();
        let full: String = segs.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(
            full,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello<|im_end|>\n"
        );
        let trained: Vec<&str> = segs
            .iter()
            .filter(|s| s.trainable)
            .map(|s| s.text.as_str())
            .collect();
        assert_eq!(trained, vec!["Hello<|im_end|>"]);
    }

    #[test]
    fn chatml_prompts_open_the_assistant_turn_and_recognise_jinja() {
        let t = ChatMl {
            default_system: Some("Be brief.".into()),
        };
        let turns = [("user", "Hi"), ("assistant", "Hello"), ("user", "Again")];
        let prompt = t.prompt(turns, true);
        assert_eq!(
            prompt,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n\
             <|im_start|>assistant\n"
        );
        let segs = t.render_turns(turns, true);
        assert!(!segs.last().unwrap().trainable);
        assert_eq!(
            t.prompt([("system", "S")], false),
            "<|im_start|>system\nS<|im_end|>\n"
        );
    }

    #[test]
    fn roles_parse_sharegpt_and_openai_names() {
        assert_eq!(Role::parse("human"), Some(Role::User));
        assert_eq!(Role::parse("GPT"), Some(Role::Assistant));
        assert_eq!(Role::parse("observation"), Some(Role::Tool));
        assert_eq!(Role::parse("narrator"), None);
    }

    #[test]
    fn alpaca_joins_instruction_and_input() {
        let v: Value = serde_json::from_str(
            r#"{"instruction":"Translate","input":"chat","output":"cat","system":""}"#,
        )
        .unwrap();
        let m = alpaca_messages(&v).unwrap();
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].content, "Translate\n\nchat");
        let v: Value = serde_json::from_str(r#"{"instruction":"x"}"#).unwrap();
        assert!(alpaca_messages(&v).unwrap_err().contains("output"));
    }

    #[test]
    fn chunking_and_normalization() {
        let d = Document {
            ids: (0..10).collect(),
            labels: (0..10).collect(),
            source: "f".into(),
        };
        let c = chunk(d, 4);
        assert_eq!(c.len(), 3);
        assert_eq!(c[2].ids, vec![8, 9]);
        assert_eq!(c[1].source, "f#1");
        assert_eq!(normalize_text("\u{feff}a\r\nb"), "a\nb");
    }
}
