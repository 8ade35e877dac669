//! LoRA layers over tch, quantized frozen bases, target matching and injection, and the adapter
//! file formats other tools load (PEFT, kohya, diffusers).
//!
//! - [`linear::LoraLinear`], [`conv::LoraConv2d`] (LoCon), [`embedding::LoraEmbedding`]: a frozen base
//!   ([`base::BaseWeight`]: dense fp32/fp16/bf16, or [`quant::QuantWeight`] NF4 / GGUF Q8_0 / Q4_0 /
//!   Q4_1 kept quantized) plus named adapters, `y = base(x) + B(A(dropout(x))) · scaling · weight`.
//! - [`config::LoraConfig`]: PEFT's field names and defaults; [`inject::inject`] with PEFT's
//!   `target_modules` semantics over any model implementing [`inject::Adaptable`].
//! - [`layer::LoraLayer`]: merge / unmerge (safe merge), enable / disable, adapter weights.
#![deny(missing_docs)]

pub mod base;
pub mod config;
pub mod conv;
pub mod embedding;
mod error;
pub mod formats;
pub mod inject;
pub mod layer;
pub mod linear;
pub mod quant;
pub mod sys;

pub use error::{Error, Result};
pub use tch;
