//! CLIP text encoders of Stable Diffusion and the CLIP BPE tokenizer.
//!
//! - [`ClipTextModel`]: transformers `CLIPTextModel` (SD1.x/SD2 `text_encoder`, SDXL's first
//!   encoder); [`ClipTextModelWithProjection`]: `CLIPTextModelWithProjection` (SDXL's
//!   `text_encoder_2`). Both load a transformers folder (`config.json` + `model.safetensors`)
//!   in f32/f16/bf16 and expose every linear layer as a LoRA site under transformers' module
//!   names.
//! - [`ClipTokenizer`]: `tokenizer.json` or `vocab.json` + `merges.txt`, rows of 77 ids.

mod config;
mod model;
mod tokenizer;
mod weights;

pub use config::{ClipActivation, ClipTextConfig};
pub use model::{
    ClipTextModel, ClipTextModelWithProjection, ClipTextOutput, canonical_module_path,
    canonicalize_adapter, sdxl_conditioning,
};
pub use tokenizer::{BOS_TOKEN, CLIP_MAX_LENGTH, CLIP_SPLIT_REGEX, ClipTokenizer, EOS_TOKEN};
