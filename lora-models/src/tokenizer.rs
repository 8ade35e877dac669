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
use std::sync::Arc;

use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;

use lora_data::jinja::JinjaChatTemplate;
use lora_data::text::{ChatMl, ChatTemplate as DataChatTemplate};

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

/// A model's chat template: its own Jinja template when it ships one (`tokenizer.chat_template`
/// of a GGUF file, `chat_template` of `tokenizer_config.json` or a `chat_template.jinja` file),
/// rendered as `transformers` renders it ([`JinjaChatTemplate`]); built-in ChatML otherwise.
///
/// A shipped template is always rendered through Jinja, ChatML ones included: the model's own
/// template is the reference, and recognising "ChatML" from its source would miss what such
/// templates do beyond it (Qwen2.5's default system prompt, tool sections). For a ChatML
/// template the Jinja rendering and the built-in one give the same text and the same trained
/// segments (`lora-data`'s `chatml_through_jinja_gives_the_builtin_segments` test).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChatTemplate {
    /// ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message and, for generation,
    /// `<|im_start|>assistant\n`. When `default_system` is set and the first message is not a
    /// system message, `<|im_start|>system\n{default_system}<|im_end|>\n` comes first (as in
    /// SmolLM2-Instruct's template). The fallback for a model without a template.
    ChatMl {
        /// The system prompt inserted when the conversation has none.
        default_system: Option<String>,
    },
    /// The model's own Jinja template with its BOS/EOS strings.
    Jinja(JinjaChatTemplate),
}

/// A token given in a `tokenizer_config.json` entry: a string or an `AddedToken` object with
/// `content`.
fn config_token(v: Option<&serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Plain ChatML without a default system prompt.
    pub fn chatml() -> Self {
        ChatTemplate::ChatMl {
            default_system: None,
        }
    }

    /// Compiles a Jinja chat template; `bos_token` / `eos_token` are the model's token strings
    /// (`""` when it has none).
    ///
    /// # Errors
    /// [`Error::Data`] ([`lora_data::Error::Template`]) when the source is not valid Jinja.
    pub fn from_jinja(src: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        Ok(ChatTemplate::Jinja(JinjaChatTemplate::new(
            src, bos_token, eos_token,
        )?))
    }

    /// The template stored under `tokenizer.chat_template` of a GGUF file, with the BOS/EOS
    /// strings of its vocabulary (`tokenizer.ggml.tokens` at `tokenizer.ggml.{bos,eos}_token_id`);
    /// `None` when the file has none.
    ///
    /// # Errors
    /// [`Error::Data`] when the template is not valid Jinja.
    pub fn from_gguf(g: &GgufFile) -> Result<Option<Self>> {
        let Some(src) = g.get("tokenizer.chat_template").and_then(|v| v.as_str()) else {
            return Ok(None);
        };
        let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap_or_default();
        let token = |key: &str| -> String {
            g.get(key)
                .and_then(|v| v.as_i64())
                .and_then(|i| usize::try_from(i).ok())
                .and_then(|i| tokens.get(i))
                .map(|t| t.to_string())
                .unwrap_or_default()
        };
        let t = JinjaChatTemplate::named(
            format!("tokenizer.chat_template of {}", g.path().display()),
            src,
            token("tokenizer.ggml.bos_token_id"),
            token("tokenizer.ggml.eos_token_id"),
        )?;
        Ok(Some(ChatTemplate::Jinja(t)))
    }

    /// The template of an HF model folder: `chat_template.jinja` when present (as
    /// `transformers` saves it), else `chat_template` of `tokenizer_config.json` (a string, or a
    /// list of `{name, template}` of which `default` is taken), with that file's `bos_token` /
    /// `eos_token`; `None` when the folder has neither.
    ///
    /// # Errors
    /// [`Error::Io`] for an unreadable file, [`Error::Config`] for invalid JSON, [`Error::Data`]
    /// when the template is not valid Jinja.
    pub fn from_folder(dir: &Path) -> Result<Option<Self>> {
        let cfg_path = dir.join("tokenizer_config.json");
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.to_path_buf(),
                source,
            })
        };
        let cfg: serde_json::Value = if cfg_path.is_file() {
            serde_json::from_str(&read(&cfg_path)?).map_err(|e| Error::Config {
                path: cfg_path.clone(),
                msg: e.to_string(),
            })?
        } else {
            serde_json::Value::Null
        };
        let jinja_path = dir.join("chat_template.jinja");
        let (src, from) = if jinja_path.is_file() {
            (read(&jinja_path)?, jinja_path)
        } else {
            let src = match cfg.get("chat_template") {
                Some(serde_json::Value::String(s)) => Some(s.clone()),
                Some(serde_json::Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                    .and_then(|t| t.get("template")?.as_str().map(String::from)),
                _ => None,
            };
            match src {
                Some(s) => (s, cfg_path),
                None => return Ok(None),
            }
        };
        let t = JinjaChatTemplate::named(
            from.display().to_string(),
            src,
            config_token(cfg.get("bos_token")),
            config_token(cfg.get("eos_token")),
        )?;
        Ok(Some(ChatTemplate::Jinja(t)))
    }

    /// The chat template of a model: a `.gguf` file's ([`ChatTemplate::from_gguf`]) or an HF
    /// folder's ([`ChatTemplate::from_folder`]); built-in ChatML when the model has none.
    ///
    /// # Errors
    /// As [`ChatTemplate::from_gguf`] / [`ChatTemplate::from_folder`], and [`Error::Io`] /
    /// [`Error::Gguf`] for an unreadable GGUF file.
    pub fn for_model(path: &Path) -> Result<Self> {
        let found = if path.is_dir() {
            Self::from_folder(path)?
        } else {
            Self::from_gguf(&GgufFile::open(path)?)?
        };
        Ok(found.unwrap_or_else(Self::chatml))
    }

    /// The renderer of training data (`lora-data`'s [`lora_data::text::ChatTemplate`]), so a
    /// model is trained on the text it is prompted with.
    pub fn to_data_template(&self) -> Arc<dyn DataChatTemplate> {
        match self {
            ChatTemplate::ChatMl { default_system } => Arc::new(ChatMl {
                default_system: default_system.clone(),
            }),
            ChatTemplate::Jinja(t) => Arc::new(t.clone()),
        }
    }

    /// Renders `messages`; with `add_generation_prompt` the assistant turn is opened. The text
    /// of the training data's renderer ([`ChatTemplate::to_data_template`]), so a model is
    /// prompted exactly as it was trained.
    ///
    /// # Errors
    /// [`Error::Data`] when a Jinja template refuses the conversation
    /// ([`lora_data::Error::TemplateRaised`], e.g. Gemma given a system message) or fails.
    pub fn apply(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let turns = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()));
        match self {
            ChatTemplate::ChatMl { default_system } => Ok(ChatMl {
                default_system: default_system.clone(),
            }
            .prompt(turns, add_generation_prompt)),
            ChatTemplate::Jinja(t) => Ok(t.prompt(turns, add_generation_prompt)?),
        }
    }

    /// The token string that ends an assistant turn, for a stop token: `<|im_end|>` for
    /// ChatML; for a Jinja template what it writes after a reply (`<|eot_id|>` Llama 3, `</s>`
    /// Mistral, `<end_of_turn>` Gemma, `<|im_end|>` Qwen) or its EOS token
    /// ([`JinjaChatTemplate::end_of_turn`]); `None` when neither exists.
    pub fn end_of_turn(&self) -> Option<String> {
        match self {
            ChatTemplate::ChatMl { .. } => Some(ChatMl::END_OF_TURN.to_string()),
            ChatTemplate::Jinja(t) => t.end_of_turn(),
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
            t.apply(&msgs, true).unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(t.end_of_turn().as_deref(), Some("<|im_end|>"));
        // a model's ChatML template goes through Jinja and renders as the built-in renderer
        let jinja = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
                     {{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}\
                     {{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}\
                     {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let t = ChatTemplate::from_jinja(jinja, "<|im_start|>", "<|im_end|>").unwrap();
        let builtin = ChatTemplate::ChatMl {
            default_system: Some("You are helpful".into()),
        };
        let with_sys = [ChatMessage::new("system", "S"), ChatMessage::user("Hi")];
        for msgs in [&msgs[..], &with_sys[..]] {
            for agp in [false, true] {
                assert_eq!(
                    t.apply(msgs, agp).unwrap(),
                    builtin.apply(msgs, agp).unwrap()
                );
            }
        }
        assert_eq!(
            t.apply(&msgs, false).unwrap(),
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        assert_eq!(t.end_of_turn().as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn folder_template_comes_from_tokenizer_config_or_chat_template_jinja() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(ChatTemplate::from_folder(dir.path()).unwrap(), None);
        assert_eq!(
            ChatTemplate::for_model(dir.path()).unwrap(),
            ChatTemplate::chatml()
        );
        let cfg = serde_json::json!({
            "bos_token": {"content": "<s>", "special": true},
            "eos_token": "</s>",
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% else %}{{ m.content }}{% endif %}{% endfor %}"}
            ]
        });
        std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
        let t = ChatTemplate::for_model(dir.path()).unwrap();
        assert_eq!(
            t.apply(&[ChatMessage::user("Hi")], true).unwrap(),
            "<s>[INST]Hi[/INST]"
        );
        // no text after a reply: the EOS token ends the turn
        assert_eq!(t.end_of_turn().as_deref(), Some("</s>"));
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}",
        )
        .unwrap();
        let t = ChatTemplate::for_model(dir.path()).unwrap();
        assert_eq!(
            t.apply(&[ChatMessage::user("Hi")], false).unwrap(),
            "<user>Hi</s>"
        );
        std::fs::write(dir.path().join("chat_template.jinja"), "{% if %}").unwrap();
        let err = ChatTemplate::for_model(dir.path()).unwrap_err();
        assert!(err.to_string().contains("chat_template.jinja"), "{err}");
    }
}
