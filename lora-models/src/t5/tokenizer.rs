//! The T5 tokenizer (a SentencePiece unigram model) from a transformers `tokenizer.json`, with
//! the padding and truncation FLUX pipelines use.

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::tokenizer::{Tokenizer, load_tokenizer};

/// A T5 tokenizer: [`Tokenizer`] over a `tokenizer.json` (`tokenizer_2/tokenizer.json` of a
/// FLUX.1 diffusers folder), whose post-processor appends `</s>`; `<pad>` (id 0) pads.
#[derive(Debug, Clone)]
pub struct T5Tokenizer {
    inner: Tokenizer,
    pad_id: i64,
    eos_id: i64,
}

impl T5Tokenizer {
    /// Loads `tokenizer.json`; the padding and end ids are those of `<pad>` and `</s>`.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the file cannot be read or parsed, or has no `<pad>` or `</s>`
    /// token (it is then not a T5 tokenizer).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let inner = load_tokenizer(path)?;
        let id = |t: &str| {
            inner.token_to_id(t).map(i64::from).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "{}: no `{t}` token: not a T5 tokenizer (give FLUX's tokenizer_2/tokenizer.json)",
                    path.display()
                ))
            })
        };
        let (pad_id, eos_id) = (id("<pad>")?, id("</s>")?);
        Ok(Self {
            inner,
            pad_id,
            eos_id,
        })
    }

    /// The wrapped tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    /// The id of `<pad>`.
    pub fn pad_id(&self) -> i64 {
        self.pad_id
    }

    /// The id of `</s>`.
    pub fn eos_id(&self) -> i64 {
        self.eos_id
    }

    /// The ids of `text` with the file's post-processing (`</s>` appended), no padding.
    ///
    /// # Errors
    /// [`Error::Tokenizer`] when the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let enc = self
            .inner
            .inner()
            .encode(text, true)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().iter().map(|&i| i64::from(i)).collect())
    }

    /// Rows of exactly `max_length` ids for `texts`, as
    /// `tokenizer(texts, padding="max_length", max_length=max_length, truncation=True)` gives
    /// them (diffusers `FluxPipeline._get_t5_prompt_embeds`: 512 for FLUX.1-dev, 256 for
    /// schnell): a longer text is cut to `max_length − 1` tokens and ends with `</s>`; shorter
    /// ones are padded with `<pad>`.
    ///
    /// Returns `(ids, attention_mask)`, both `[batch, max_length]` int64 on the CPU (mask 1 for
    /// tokens, 0 for padding).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `max_length < 1`; [`Error::Tokenizer`].
    pub fn encode_batch(&self, texts: &[&str], max_length: usize) -> Result<(Tensor, Tensor)> {
        if max_length == 0 {
            return Err(Error::InvalidArgument(
                "T5 max_length must be at least 1".into(),
            ));
        }
        let mut ids = Vec::with_capacity(texts.len() * max_length);
        let mut mask = Vec::with_capacity(texts.len() * max_length);
        for t in texts {
            let mut row = self.encode(t)?;
            if row.len() > max_length {
                let ends_with_eos = row.last() == Some(&self.eos_id);
                row.truncate(max_length);
                if ends_with_eos && let Some(last) = row.last_mut() {
                    *last = self.eos_id;
                }
            }
            let n = row.len();
            ids.extend(row);
            ids.extend(std::iter::repeat_n(self.pad_id, max_length - n));
            mask.extend(std::iter::repeat_n(1i64, n));
            mask.extend(std::iter::repeat_n(0i64, max_length - n));
        }
        let shape = [texts.len() as i64, max_length as i64];
        let t = |v: &[i64]| -> Result<Tensor> {
            Ok(Tensor::f_from_slice(v)?
                .f_view(shape)?
                .f_to_kind(Kind::Int64)?
                .f_to_device(Device::Cpu)?)
        };
        Ok((t(&ids)?, t(&mask)?))
    }
}
