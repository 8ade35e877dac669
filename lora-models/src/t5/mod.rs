//! The T5 text encoder of FLUX.1 (T5 v1.1 XXL) and its tokenizer.
//!
//! - [`T5EncoderModel`]: transformers `T5EncoderModel`, loaded from a transformers folder
//!   (`config.json` + `model.safetensors`, FLUX's `text_encoder_2/`) or from the single file
//!   `t5xxl_fp16.safetensors` of ComfyUI and kohya, in f32/f16/bf16; every linear layer is a
//!   LoRA site under transformers' module names.
//! - [`T5Config`]: `T5Config` of `config.json`, with the [`T5Config::t5_xxl`] preset.
//! - [`T5Tokenizer`]: `tokenizer.json`, rows padded to `max_length` with an attention mask.
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::t5::{T5EncoderModel, T5Tokenizer};
//! use tch::{Device, Kind};
//!
//! let flux = std::path::Path::new("FLUX.1-dev");
//! let tok = T5Tokenizer::from_file(flux.join("tokenizer_2/tokenizer.json"))?;
//! let t5 = T5EncoderModel::from_pretrained(flux.join("text_encoder_2"), Kind::BFloat16, Device::Cpu)?;
//! let (ids, _mask) = tok.encode_batch(&["a photo of a cat"], 512)?; // [1, 512]
//! let txt = tch::no_grad(|| t5.forward_t(&ids, None, false))?; // [1, 512, 4096]
//! # let _ = txt; Ok(()) }
//! ```

mod config;
mod model;
mod tokenizer;

pub use config::{T5Activation, T5Config};
pub use model::{T5EncoderModel, relative_position_buckets};
pub use tokenizer::T5Tokenizer;
