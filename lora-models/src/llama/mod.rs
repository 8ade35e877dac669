//! The LLaMA family: Llama 2/3, Mistral, Qwen2/Qwen3, SmolLM2 — over tch, every linear a LoRA
//! site, loaded from HF safetensors or GGUF.

mod config;
mod generate;
mod model;
mod weights;

pub use crate::weights::WeightMode;
pub use config::{LlamaConfig, RopeScaling};
pub use generate::{
    GenerateOptions, Generation, PerplexityOptions, PerplexityReport, StopReason, sample_token,
};
pub(crate) use model::RmsNorm;
pub use model::{IGNORE_INDEX, KvCache, Llama};
pub use weights::random_weights;
