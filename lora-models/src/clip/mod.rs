//! CLIP text encoders of Stable Diffusion and the CLIP BPE tokenizer.
//!
//! - [`ClipTextModel`]: transformers `CLIPTextModel` (SD1.x/SD2 `text_encoder`, SDXL's first
//!   encoder); [`ClipTextModelWithProjection`]: `CLIPTextModelWithProjection` (SDXL's
//!   `text_encoder_2`). Both load a transformers folder (`config.json` + `model.safetensors`)
//!   in f32/f16/bf16 and expose every linear layer as a LoRA site under transformers' module
//!   names.
//! - [`ClipTokenizer`]: `tokenizer.json` or `vocab.json` + `merges.txt`, rows of 77 ids.
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::clip::{ClipTextModel, ClipTokenizer};
//! use tch::{Device, Kind};
//!
//! let sd = std::path::Path::new("stable-diffusion-v1-5");
//! let tok = ClipTokenizer::from_dir(sd.join("tokenizer"))?;
//! let te = ClipTextModel::from_pretrained(sd.join("text_encoder"), Kind::BFloat16, Device::Cpu)?;
//! let ids = tok.encode_batch(&["a photo of a cat", ""])?; // [2, 77] int64
//! let out = tch::no_grad(|| te.forward_t(&ids, false))?;
//! let cond = te.skip_hidden(&out, 2, true)?; // clip_skip 2: [2, 77, 768]
//! # let _ = cond; Ok(()) }
//! ```

mod config;
mod convert;
mod model;
mod tokenizer;

pub use config::{ClipActivation, ClipTextConfig};
pub use convert::{canonical_module_path, canonicalize_adapter};
pub use model::{ClipTextModel, ClipTextModelWithProjection, ClipTextOutput, sdxl_conditioning};
pub(crate) use model::{linear_bytes, linear_numel};
pub use tokenizer::{BOS_TOKEN, CLIP_MAX_LENGTH, CLIP_SPLIT_REGEX, ClipTokenizer, EOS_TOKEN};
