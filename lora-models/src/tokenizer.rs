//! Tokenizers (through the `tokenizers` crate) from `tokenizer.json` or from GGUF metadata, and
//! chat templates.
//!
//! A GGUF file carries a byte-level BPE tokenizer as metadata (`gguf.md`, "Tokenizer" section):
//! `tokenizer.ggml.model` (`"gpt2"` for byte-level BPE), `tokenizer.ggml.tokens` (the vocabulary,
//! index = id), `tokenizer.ggml.merges` (`"left right"` strings in rank order),
//! `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`: 1 normal, 2 unknown, 3 control,
//! 4 user-defined, 5 unused, 6 byte), `tokenizer.ggml.{bos,eos,padding}_token_id`,
//! `tokenizer.ggml.add_bos_token` and `tokenizer.ggml.pre` (the pre-tokenizer family).

use std::path::Path;

use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use lora_data::text::ChatMl;

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// llama.cpp's `LLAMA_TOKEN_TYPE_CONTROL`.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// llama.cpp's `LLAMA_TOKEN_TYPE_USER_DEFINED`.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A tokenizer plus the special ids a causal LM needs.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence id, if the model has one.
    pub bos_id: Option<u32>,
    /// End-of-sequence id (generation stops on it by default).
    pub eos_id: Option<u32>,
    /// Padding id (falls back to `eos_id` when the file names none).
    pub pad_id: Option<u32>,
    /// Whether [`Tokenizer::encode`] with `add_special_tokens = true` prepends `bos_id`.
    pub add_bos: bool,
}

fn tok_err(e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Wraps a `tokenizers::Tokenizer` with explicit special ids.
    pub fn new(
        inner: tokenizers::Tokenizer,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        pad_id: Option<u32>,
        add_bos: bool,
    ) -> Self {
        Self {
            inner,
            bos_id,
            eos_id,
            pad_id: pad_id.or(eos_id),
            add_bos,
        }
    }

    /// The wrapped `tokenizers::Tokenizer`.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Encodes `text` to ids. Special tokens written in the text (`<|im_start|>`) are matched as
    /// single tokens. With `add_special_tokens`, `bos_id` is prepended when [`Tokenizer::add_bos`].
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the underlying tokenizer fails.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        let enc = self.inner.encode(text, false).map_err(tok_err)?;
        let mut ids: Vec<i64> = Vec::with_capacity(enc.len() + 1);
        if add_special_tokens && self.add_bos {
            if let Some(b) = self.bos_id {
                ids.push(b.into());
            }
        }
        ids.extend(enc.get_ids().iter().map(|&i| i64::from(i)));
        Ok(ids)
    }

    /// Decodes ids to text, dropping special tokens when `skip_special_tokens`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for a negative or unknown id.
    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&i| {
                u32::try_from(i).map_err(|_| Error::Tokenizer(format!("token id {i} is negative")))
            })
            .collect::<Result<_>>()?;
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(tok_err)
    }

    /// The id of one token string (e.g. `"<|im_end|>"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// Loads an HF `tokenizer.json`. Special ids are looked up from the usual token strings
/// (`<|endoftext|>`, `<s>`, `</s>`, `<|im_end|>`, `<|begin_of_text|>`, `<|end_of_text|>`); pass
/// the ids of the model's `config.json` with [`Tokenizer::new`] when they differ.
///
/// # Errors
/// [`Error::Tokenizer`] when the file cannot be read or parsed.
pub fn load_tokenizer(path: impl AsRef<Path>) -> Result<Tokenizer> {
    let path = path.as_ref();
    let inner = tokenizers::Tokenizer::from_file(path)
        .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))?;
    let find = |names: &[&str]| names.iter().find_map(|n| inner.token_to_id(n));
    let bos = find(&["<|begin_of_text|>", "<s>", "<|im_start|>", "<|endoftext|>"]);
    let eos = find(&["<|end_of_text|>", "</s>", "<|im_end|>", "<|endoftext|>"]);
    Ok(Tokenizer::new(inner, bos, eos, None, false))
}

/// Builds the tokenizer of a GGUF file from its vocabulary and merges (byte-level BPE only, i.e.
/// `tokenizer.ggml.model = "gpt2"`).
///
/// Pre-tokenizer: for `tokenizer.ggml.pre` = `smollm` (and `gpt2`-like families that split
/// digits singly) digits are split one by one, then byte-level with the GPT-2 regex and no prefix
/// space — the same as SmolLM2's `tokenizer.json`. Tokens of type control become special tokens,
/// user-defined ones added tokens. No BOS is added unless `tokenizer.ggml.add_bos_token` is true.
///
/// # Errors
/// [`Error::Io`]/[`Error::Gguf`] for an unreadable file, [`Error::Metadata`] for missing keys,
/// [`Error::Unsupported`] for a non-BPE tokenizer model, [`Error::Tokenizer`] for a bad merge.
pub fn load_tokenizer_from_gguf(path: impl AsRef<Path>) -> Result<Tokenizer> {
    tokenizer_from_gguf(&GgufFile::open(path)?)
}

/// As [`load_tokenizer_from_gguf`], from an already opened file.
///
/// # Errors
/// As [`load_tokenizer_from_gguf`].
pub fn tokenizer_from_gguf(g: &GgufFile) -> Result<Tokenizer> {
    let model = g.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(Error::Unsupported {
            what: "GGUF tokenizer model",
            value: model.to_string(),
            hint: "only byte-level BPE (`gpt2`) is built from GGUF metadata; load the model's \
                   tokenizer.json with `load_tokenizer` instead"
                .into(),
        });
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let merges = g.get_str_array("tokenizer.ggml.merges")?;
    let types = match g.get("tokenizer.ggml.token_type") {
        Some(_) => g.get_i64_array("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    Error::Tokenizer(format!("merge `{m}` is not two space-separated tokens"))
                })
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    let byte_level = ByteLevel::new(false, true, true);
    // Families whose HF tokenizer.json splits digits one by one before the byte-level step
    // (llama.cpp `llm_tokenizer_bpe` pre-types with a `\p{N}` single-digit regex).
    let split_digits = matches!(
        pre,
        "smollm" | "starcoder" | "refact" | "codeshell" | "command-r"
    );
    let pre_tok: PreTokenizerWrapper = if split_digits {
        Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into()
    } else {
        byte_level.into()
    };
    inner.with_pre_tokenizer(Some(pre_tok));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    let mut special = Vec::new();
    let mut added = Vec::new();
    for (i, &t) in types.iter().enumerate() {
        let Some(tok) = tokens.get(i) else { break };
        match t {
            TOKEN_TYPE_CONTROL => special.push(AddedToken::from(tok.to_string(), true)),
            TOKEN_TYPE_USER_DEFINED => {
                added.push(AddedToken::from(tok.to_string(), false).normalized(false))
            }
            _ => {}
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&added);
    let id = |k: &str| -> Result<Option<u32>> {
        match g.get(k) {
            None => Ok(None),
            Some(_) => Ok(u32::try_from(g.get_i64(k)?).ok()),
        }
    };
    let add_bos = g
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_i64())
        .unwrap_or(0)
        != 0;
    Ok(Tokenizer::new(
        inner,
        id("tokenizer.ggml.bos_token_id")?,
        id("tokenizer.ggml.eos_token_id")?,
        id("tokenizer.ggml.padding_token_id")?,
        add_bos,
    ))
}

/// A chat message (`role` is `system`, `user` or `assistant`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    /// A `user` message.
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
}

/// A chat template for generation prompts, rendered in Rust (no Jinja engine) by `lora-data`'s
/// [`ChatMl`], the renderer of the training data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message and, for generation,
    /// `<|im_start|>assistant\n`. When `default_system` is set and the first message is not a
    /// system message, `<|im_start|>system\n{default_system}<|im_end|>\n` comes first (as in
    /// SmolLM2-Instruct's template).
    ChatMl {
        /// The system prompt inserted when the conversation has none.
        default_system: Option<String>,
    },
}

impl ChatTemplate {
    /// Plain ChatML without a default system prompt.
    pub fn chatml() -> Self {
        ChatTemplate::ChatMl {
            default_system: None,
        }
    }

    /// Recognises the Jinja template stored under `tokenizer.chat_template` of a GGUF file.
    /// Returns `None` when the file has no template or a non-ChatML one.
    pub fn from_gguf(g: &GgufFile) -> Option<Self> {
        Self::from_jinja(g.get("tokenizer.chat_template")?.as_str()?)
    }

    /// Recognises a Jinja chat template: ChatML (it contains `<|im_start|>`); a literal default
    /// system message (`'<|im_start|>system\n…<|im_end|>` in the template source) is extracted.
    /// The recognition is [`lora_data::text::ChatMl::from_jinja`].
    pub fn from_jinja(src: &str) -> Option<Self> {
        ChatMl::from_jinja(src).map(|t| ChatTemplate::ChatMl {
            default_system: t.default_system,
        })
    }

    /// The template as `lora-data`'s ChatML renderer, the one that renders training data.
    pub fn to_chatml(&self) -> ChatMl {
        match self {
            ChatTemplate::ChatMl { default_system } => ChatMl {
                default_system: default_system.clone(),
            },
        }
    }

    /// Renders `messages`; with `add_generation_prompt` the assistant turn is opened. The text is
    /// that of [`lora_data::text::ChatMl::prompt`], so a model is prompted exactly as it was trained.
    pub fn apply(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> String {
        self.to_chatml().prompt(
            messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str())),
            add_generation_prompt,
        )
    }

    /// The token string that ends an assistant turn (`<|im_end|>` for ChatML).
    pub fn end_of_turn(&self) -> &'static str {
        match self {
            ChatTemplate::ChatMl { .. } => ChatMl::END_OF_TURN,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_renders_with_and_without_default_system() {
        let t = ChatTemplate::chatml();
        let msgs = [ChatMessage::user("Hi")];
        assert_eq!(
            t.apply(&msgs, true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let jinja = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
                     {{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}\
                     {{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}";
        let t = ChatTemplate::from_jinja(jinja).unwrap();
        assert_eq!(
            t,
            ChatTemplate::ChatMl {
                default_system: Some("You are helpful".into())
            }
        );
        assert_eq!(
            t.apply(&msgs, false),
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        let with_sys = [ChatMessage::new("system", "S"), ChatMessage::user("Hi")];
        assert!(
            t.apply(&with_sys, false)
                .starts_with("<|im_start|>system\nS<|im_end|>")
        );
        assert_eq!(ChatTemplate::from_jinja("{{ bos_token }}[INST]"), None);
    }
}
