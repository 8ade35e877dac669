//! The CLIP byte-level BPE tokenizer, with SD's fixed-length (77) id layout.
//!
//! CLIP's tokenizer (OpenAI `clip/simple_tokenizer.py`; transformers
//! `models/clip/tokenization_clip.py`, which builds it on the `tokenizers` library):
//! - normalise: NFC, every whitespace run → one space, lowercase;
//! - split by the regex
//!   `<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+`
//!   (whitespace is dropped; every digit is its own word), then map bytes to GPT-2's printable
//!   byte alphabet;
//! - BPE per word with the end-of-word suffix `</w>` on the last symbol (no continuing prefix);
//! - `<|startoftext|>` (BOS, id 49406 in the real vocabulary) before, `<|endoftext|>` (EOS,
//!   49407) after; SD pads to 77 ids with `pad_token`: `<|endoftext|>` for SD1.x/SD2's
//!   `tokenizer/`, `!` (id 0) for SDXL's `tokenizer_2/`; longer prompts are truncated to
//!   BOS + 75 tokens + EOS.
//!
//! OpenAI's original also runs `ftfy.fix_text` and HTML unescaping; transformers' tokenizer (and
//! this one) does not.

use std::collections::HashMap;
use std::path::Path;

use tch::Tensor;
use tokenizers::AddedToken;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::normalizers::utils::{Lowercase, Sequence as NormSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::error::{Error, Result};

/// CLIP's pre-tokenisation regex (transformers `CLIPTokenizer.__init__`, OpenAI
/// `simple_tokenizer.py` `self.pat`).
pub const CLIP_SPLIT_REGEX: &str =
    r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";
/// The begin-of-text token.
pub const BOS_TOKEN: &str = "<|startoftext|>";
/// The end-of-text token (also SD1.x's padding token).
pub const EOS_TOKEN: &str = "<|endoftext|>";
/// The sequence length of every SD text encoder (`model_max_length` in `tokenizer_config.json`).
pub const CLIP_MAX_LENGTH: usize = 77;

/// A CLIP tokenizer producing SD's fixed-length id rows.
#[derive(Clone)]
pub struct ClipTokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: u32,
    eos_id: u32,
    pad_id: u32,
    max_length: usize,
}

impl std::fmt::Debug for ClipTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClipTokenizer")
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("pad_id", &self.pad_id)
            .field("max_length", &self.max_length)
            .finish()
    }
}

fn tok_err(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Tokenizer(format!("{}: {e}", path.display()))
}

/// A token given in a `special_tokens_map.json` / `tokenizer_config.json` entry: a string or an
/// `AddedToken` object with `content`.
fn token_string(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(String::from),
        _ => None,
    }
}

/// The `pad_token` of a tokenizer folder (`special_tokens_map.json`, then
/// `tokenizer_config.json`), if one is named.
fn folder_pad_token(dir: &Path) -> Result<Option<String>> {
    for name in ["special_tokens_map.json", "tokenizer_config.json"] {
        let p = dir.join(name);
        if !p.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&p).map_err(|source| Error::Io {
            path: p.clone(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: p.clone(),
            msg: e.to_string(),
        })?;
        if let Some(t) = v.get("pad_token").and_then(token_string) {
            return Ok(Some(t));
        }
    }
    Ok(None)
}

impl ClipTokenizer {
    /// Loads a tokenizer folder (SD's `tokenizer/` or `tokenizer_2/`): `tokenizer.json` when
    /// present, else `vocab.json` + `merges.txt`; the padding token is the folder's `pad_token`
    /// (`special_tokens_map.json` / `tokenizer_config.json`), `<|endoftext|>` when none is named.
    ///
    /// # Errors
    /// [`Error::Io`] when neither `tokenizer.json` nor `vocab.json` + `merges.txt` exist;
    /// [`Error::Tokenizer`] for unreadable files or a vocabulary without the CLIP special tokens.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let json = dir.join("tokenizer.json");
        let tok = if json.exists() {
            Self::from_tokenizer_json(&json)?
        } else {
            let (v, m) = (dir.join("vocab.json"), dir.join("merges.txt"));
            if !v.exists() || !m.exists() {
                return Err(Error::Io {
                    path: dir.to_path_buf(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::NotFound,
                        "a CLIP tokenizer folder needs tokenizer.json or vocab.json + merges.txt",
                    ),
                });
            }
            Self::from_vocab_merges(&v, &m)?
        };
        match folder_pad_token(dir)? {
            Some(p) => tok.with_pad_token(&p),
            None => Ok(tok),
        }
    }

    /// Loads an HF `tokenizer.json` (as transformers saves a `CLIPTokenizer`). Padding is
    /// `<|endoftext|>` until [`ClipTokenizer::with_pad_token`].
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the file cannot be parsed or lacks the CLIP special tokens.
    pub fn from_tokenizer_json(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path).map_err(|e| tok_err(path, e))?;
        Self::wrap(inner, path)
    }

    /// Builds the tokenizer from `vocab.json` (`{token: id}`) and `merges.txt` (one merge per
    /// line, an optional `#version` header), with CLIP's normaliser, pre-tokeniser, `</w>`
    /// suffix and byte-level decoder, as transformers' `CLIPTokenizer` does.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] for unreadable or inconsistent files (a merge whose parts are not in
    /// the vocabulary, no `<|startoftext|>`/`<|endoftext|>` token).
    pub fn from_vocab_merges(vocab: impl AsRef<Path>, merges: impl AsRef<Path>) -> Result<Self> {
        let (vocab, merges) = (vocab.as_ref(), merges.as_ref());
        let utf8 = |p: &Path| {
            p.to_str()
                .map(String::from)
                .ok_or_else(|| tok_err(p, "path is not valid UTF-8"))
        };
        let bpe = BPE::from_file(&utf8(vocab)?, &utf8(merges)?)
            .continuing_subword_prefix(String::new())
            .end_of_word_suffix("</w>".into())
            .unk_token(EOS_TOKEN.into())
            .fuse_unk(false)
            .build()
            .map_err(|e| tok_err(merges, e))?;
        let mut inner = tokenizers::Tokenizer::new(bpe);
        let ws = Replace::new(
            tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()),
            " ",
        )
        .map_err(|e| tok_err(vocab, e))?;
        let norm = NormSequence::new(vec![
            NormalizerWrapper::NFC(NFC),
            NormalizerWrapper::Replace(ws),
            NormalizerWrapper::Lowercase(Lowercase),
        ]);
        inner.with_normalizer(Some(norm));
        let split = Split::new(
            SplitPattern::Regex(CLIP_SPLIT_REGEX.into()),
            SplitDelimiterBehavior::Removed,
            true,
        )
        .map_err(|e| tok_err(vocab, e))?;
        let pre = PreSequence::new(vec![
            PreTokenizerWrapper::Split(split),
            // as transformers' `CLIPTokenizer`: `ByteLevel(add_prefix_space=False)`, GPT-2 regex on
            PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true)),
        ]);
        inner.with_pre_tokenizer(Some(pre));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        inner.add_special_tokens(&[
            AddedToken::from(BOS_TOKEN.to_string(), true),
            AddedToken::from(EOS_TOKEN.to_string(), true),
        ]);
        Self::wrap(inner, vocab)
    }

    fn wrap(inner: tokenizers::Tokenizer, path: &Path) -> Result<Self> {
        let id = |t: &str| {
            inner.token_to_id(t).ok_or_else(|| {
                tok_err(
                    path,
                    format!("the vocabulary has no {t:?}: not a CLIP tokenizer"),
                )
            })
        };
        let (bos_id, eos_id) = (id(BOS_TOKEN)?, id(EOS_TOKEN)?);
        Ok(Self {
            inner,
            bos_id,
            eos_id,
            pad_id: eos_id,
            max_length: CLIP_MAX_LENGTH,
        })
    }

    /// Pads with `token` instead (SDXL `tokenizer_2`: `"!"`, id 0).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when `token` is not in the vocabulary.
    pub fn with_pad_token(mut self, token: &str) -> Result<Self> {
        self.pad_id = self.inner.token_to_id(token).ok_or_else(|| {
            Error::Tokenizer(format!("pad token {token:?} is not in the vocabulary"))
        })?;
        Ok(self)
    }

    /// Uses rows of `max_length` ids instead of 77 (must be ≥ 2).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `max_length < 2`.
    pub fn with_max_length(mut self, max_length: usize) -> Result<Self> {
        if max_length < 2 {
            return Err(Error::InvalidArgument(format!(
                "CLIP max_length must be ≥ 2 (BOS + EOS), got {max_length}"
            )));
        }
        self.max_length = max_length;
        Ok(self)
    }

    /// `<|startoftext|>`'s id.
    pub fn bos_id(&self) -> u32 {
        self.bos_id
    }

    /// `<|endoftext|>`'s id.
    pub fn eos_id(&self) -> u32 {
        self.eos_id
    }

    /// The padding id.
    pub fn pad_id(&self) -> u32 {
        self.pad_id
    }

    /// The row length (77).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// The id of a token string, if it is in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The BPE ids of `text` without BOS/EOS, untruncated.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the tokenizer fails.
    pub fn encode_ids(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// One SD row of exactly `max_length` (77) ids: BOS, the first `max_length − 2` ids of
    /// `text`, EOS, then padding (transformers `tokenizer(text, padding="max_length",
    /// max_length=77, truncation=True)`).
    ///
    /// # Errors
    /// As [`ClipTokenizer::encode_ids`].
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let ids = self.encode_ids(text)?;
        Ok(self.row(&ids[..ids.len().min(self.max_length - 2)]))
    }

    fn row(&self, content: &[u32]) -> Vec<i64> {
        let mut row = Vec::with_capacity(self.max_length);
        row.push(i64::from(self.bos_id));
        row.extend(content.iter().map(|&i| i64::from(i)));
        row.push(i64::from(self.eos_id));
        row.resize(self.max_length, i64::from(self.pad_id));
        row
    }

    /// [`ClipTokenizer::encode`] for a batch: `[batch, 77]` int64 on the CPU.
    ///
    /// # Errors
    /// As [`ClipTokenizer::encode_ids`]; [`Error::Torch`].
    pub fn encode_batch<S: AsRef<str>>(&self, texts: &[S]) -> Result<Tensor> {
        let mut all = Vec::with_capacity(texts.len() * self.max_length);
        for t in texts {
            all.extend(self.encode(t.as_ref())?);
        }
        Ok(Tensor::f_from_slice(&all)?.f_view([texts.len() as i64, self.max_length as i64])?)
    }

    /// kohya-style long prompts (sd-scripts `library/train_util.py::get_input_ids` with
    /// `max_token_length` = `n_chunks · 75`): the text's ids, truncated to `n_chunks · 75`, are
    /// laid out as `[BOS, ids…, EOS, pad…]` of length `n_chunks · 75 + 2` and cut into
    /// `n_chunks` rows `[BOS] + 75 ids + [last id of that sequence]` (77 each). When padding is not EOS (SD2,
    /// SDXL `tokenizer_2`), a row whose last content id is neither EOS nor padding ends in EOS,
    /// and a row that starts with padding gets EOS in its place, as sd-scripts does. The caller
    /// encodes each row and concatenates the states (sd-scripts keeps BOS of the first row,
    /// the 75 middle states of each, and EOS of the last).
    ///
    /// # Errors
    /// As [`ClipTokenizer::encode_ids`]; [`Error::InvalidArgument`] for `n_chunks == 0` or a
    /// max length other than 77.
    pub fn encode_chunks(&self, text: &str, n_chunks: usize) -> Result<Vec<Vec<i64>>> {
        if n_chunks == 0 || self.max_length != CLIP_MAX_LENGTH {
            return Err(Error::InvalidArgument(format!(
                "encode_chunks needs n_chunks ≥ 1 and rows of 77 ids (got {n_chunks}, {})",
                self.max_length
            )));
        }
        let inner = self.max_length - 2;
        let ids = self.encode_ids(text)?;
        let ids = &ids[..ids.len().min(n_chunks * inner)];
        let mut flat: Vec<i64> = Vec::with_capacity(n_chunks * inner + 2);
        flat.push(i64::from(self.bos_id));
        flat.extend(ids.iter().map(|&i| i64::from(i)));
        flat.push(i64::from(self.eos_id));
        flat.resize(n_chunks * inner + 2, i64::from(self.pad_id));
        let (bos, eos, pad) = (
            i64::from(self.bos_id),
            i64::from(self.eos_id),
            i64::from(self.pad_id),
        );
        // sd-scripts closes every chunk with the last id of the padded sequence (EOS when
        // padding is EOS, else padding unless the text filled every chunk)
        let last = flat[flat.len() - 1];
        let mut rows = Vec::with_capacity(n_chunks);
        for c in 0..n_chunks {
            let start = 1 + c * inner;
            let mut row = Vec::with_capacity(self.max_length);
            row.push(bos);
            row.extend_from_slice(&flat[start..start + inner]);
            row.push(last);
            if pad != eos {
                let n = row.len();
                if row[n - 2] != eos && row[n - 2] != pad {
                    row[n - 1] = eos;
                }
                if row[1] == pad {
                    row[1] = eos;
                }
            }
            rows.push(row);
        }
        Ok(rows)
    }

    /// Decodes ids to text (special tokens skipped when `skip_special`), with `</w>` turned into
    /// spaces and the result trimmed, as transformers' `CLIPTokenizer.decode`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when decoding fails.
    pub fn decode(&self, ids: &[i64], skip_special: bool) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let text = self
            .inner
            .decode(&ids, skip_special)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(text.replace("</w>", " ").trim().to_string())
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The vocabulary (token → id) including the special tokens.
    pub fn vocab(&self) -> HashMap<String, u32> {
        self.inner.get_vocab(true)
    }
}
