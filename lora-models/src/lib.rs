//! Architectures over tch with injectable linear sites: the LLaMA family (HF safetensors, GGUF)
//! and Stable Diffusion.
//!
//! - [`gguf`]: a memory-mapped GGUF v2/v3 reader and the reference dequantisation of its block
//!   formats.
//! - [`tokenizer`]: tokenizers from `tokenizer.json` or GGUF metadata; chat templates.
//! - [`checkpoint`]: activation checkpointing by segment recomputation.
//! - [`llama`]: the LLaMA family (Llama 2/3, Mistral, Qwen2/3, SmolLM2).
//! - [`sd`]: Stable Diffusion 1.x / 2.x / SDXL UNet and VAE (diffusers folders, single files).
//! - [`clip`]: the CLIP text encoders of Stable Diffusion (SD1.x, SD2, SDXL) and the CLIP BPE
//!   tokenizer.
//! - [`diffusion`]: the DDPM noise schedule, the diffusion training loss (ε / v targets, min-SNR-γ,
//!   noise offset), DDIM / Euler samplers with classifier-free guidance, and a PNG grid writer.
#![deny(missing_docs)]

pub mod checkpoint;
pub mod clip;
pub mod diffusion;
pub mod error;
pub mod gguf;
pub mod llama;
pub mod sd;
pub mod tokenizer;

pub use error::{Error, Result};
