//! Architectures over tch with injectable linear sites: the LLaMA family (HF safetensors, GGUF),
//! Stable Diffusion and FLUX.1.
//!
//! These are the base models adapters are trained on and evaluated with. Each model loads from
//! the files it is published in and implements [`lora_core::inject::Adaptable`], so LoRA is
//! injected by the module paths of its checkpoint (`model.layers.0.self_attn.q_proj`); the LLaMA
//! family also generates text and measures perplexity.
//!
//! Loading SmolLM2-135M-Instruct from a GGUF file (its weights kept in Q4_1 blocks) and
//! generating greedily:
//!
//! ```no_run
//! use lora_models::gguf::GgufFile;
//! use lora_models::llama::{GenerateOptions, Llama, WeightMode};
//! use lora_models::tokenizer::{ChatMessage, ChatTemplate, tokenizer_from_gguf};
//! use tch::Device;
//!
//! let file = GgufFile::open("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let tokenizer = tokenizer_from_gguf(&file)?; // the vocabulary stored in the GGUF
//! // the model's own chat template (ChatML when the file has none)
//! let template = ChatTemplate::from_gguf(&file)?.unwrap_or_else(ChatTemplate::chatml);
//! let model = Llama::from_gguf_file(&file, WeightMode::KeepQuantized, Device::Cpu)?;
//! // temperature 0 (the default) is greedy decoding
//! let opts = GenerateOptions { max_new_tokens: 16, ..GenerateOptions::default() };
//!
//! let prompt = tokenizer.encode("The capital of France is", true)?;
//! let generation = model.generate(&prompt, &opts)?; // new token ids and why it stopped
//! println!("{}", tokenizer.decode(&generation.tokens, true)?);
//!
//! let question = [ChatMessage::user("What is the capital of France?")];
//! println!("{}", model.chat(&tokenizer, &template, &question, &opts)?);
//! # Ok::<(), lora_models::Error>(())
//! ```
//!
//! - [`gguf`]: a memory-mapped GGUF v2/v3 reader and the reference dequantisation of its block
//!   formats.
//! - [`tokenizer`]: tokenizers from `tokenizer.json` or GGUF metadata; chat templates.
//! - [`weights`]: the one weights layer every model loads through: a [`weights::TensorSource`]
//!   over safetensors files (single or sharded), GGUF or an in-memory map, and the
//!   [`weights::WeightPath`] builder that writes each weight name once.
//! - [`checkpoint`]: activation checkpointing by segment recomputation.
//! - [`llama`]: the LLaMA family (Llama 2/3, Mistral, Qwen2/3, SmolLM2).
//! - [`sd`]: Stable Diffusion 1.x / 2.x / SDXL UNet and VAE (diffusers folders, single files).
//! - [`flux`]: the FLUX.1 transformer (dev, schnell) from diffusers folders or BFL single files,
//!   the BFL ↔ diffusers key mapping, latent packing, and the FLUX.1 pipeline (text encoders,
//!   autoencoder, sampling) from diffusers folders or ComfyUI's single files.
//! - [`clip`]: the CLIP text encoders of Stable Diffusion (SD1.x, SD2, SDXL) and the CLIP BPE
//!   tokenizer.
//! - [`t5`]: the T5 v1.1 text encoder of FLUX.1 (transformers `T5EncoderModel`) and its tokenizer.
//! - [`diffusion`]: the DDPM noise schedule, the diffusion training loss (ε / v targets, min-SNR-γ,
//!   noise offset), DDIM / Euler samplers with classifier-free guidance, a PNG grid writer, and
//!   FLUX.1's flow matching (loss with timestep sampling, Euler flow sampler).
#![deny(missing_docs)]

pub mod checkpoint;
pub mod clip;
pub mod diffusion;
pub mod error;
pub mod flux;
pub mod gguf;
pub mod llama;
pub mod sd;
pub mod t5;
pub mod tokenizer;
pub mod weights;

/// libtorch's generator is process-wide: the unit tests that seed it or draw from it hold this
/// lock, so that parallel tests do not interleave their draws.
#[cfg(test)]
pub(crate) fn test_rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}

pub use error::{Error, Result};
