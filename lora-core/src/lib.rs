//! LoRA for models written with tch: frozen base layers (dense or kept quantized) with trainable
//! low-rank adapters, injected by module path with PEFT's `target_modules` semantics, merged or
//! switched off at inference, and saved in the files PEFT, kohya and diffusers load.
//!
//! - [`linear::LoraLinear`], [`conv::LoraConv2d`] (LoCon), [`embedding::LoraEmbedding`]: a frozen base
//!   ([`base::BaseWeight`]: dense fp32/fp16/bf16, or [`quant::QuantWeight`] NF4 / fp8 e4m3fn / GGUF
//!   Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K kept quantized, or either kept on a host device
//!   and copied in per use, [`base::OffloadedWeight`]) plus named adapters, `y = base(x) + B(A(dropout(x))) · scaling · weight`.
//! - [`config::LoraConfig`]: PEFT's field names and defaults; [`inject::inject`] with PEFT's
//!   `target_modules` semantics over any model implementing [`inject::Adaptable`].
//! - [`layer::LoraLayer`]: merge / unmerge (safe merge), enable / disable, adapter weights;
//!   [`inject::param_groups`] for LoRA+.
//! - [`formats`]: PEFT / kohya / diffusers files through a format-neutral
//!   [`formats::AdapterWeights`]; [`safetensors::SafetensorsFile`]: the workspace's one
//!   memory-mapped safetensors reader.
//!
//! Base weights and adapters live in separate VarStores: only adapter tensors reach the optimizer.
//!
//! ```
//! use lora_core::base::BaseWeight;
//! use lora_core::config::LoraConfig;
//! use lora_core::inject::{Adaptable, SiteMut, inject};
//! use lora_core::linear::LoraLinear;
//! use tch::{Device, Kind, Tensor, nn};
//!
//! struct Mlp {
//!     up: LoraLinear,
//!     down: LoraLinear,
//! }
//!
//! impl Adaptable for Mlp {
//!     fn visit_sites(
//!         &mut self,
//!         f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()>,
//!     ) -> lora_core::Result<()> {
//!         f("mlp.up_proj", SiteMut::Linear(&mut self.up))?;
//!         f("mlp.down_proj", SiteMut::Linear(&mut self.down))
//!     }
//! }
//!
//! # fn main() -> lora_core::Result<()> {
//! let w = |o: i64, i: i64| Tensor::randn([o, i], (Kind::Float, Device::Cpu));
//! let mut mlp = Mlp {
//!     up: LoraLinear::new(BaseWeight::Dense(w(64, 32)), None)?,
//!     down: LoraLinear::new(BaseWeight::Dense(w(32, 64)), None)?,
//! };
//! let adapters = nn::VarStore::new(Device::Cpu); // the optimizer sees only this store
//! let report = inject(&mut mlp, &LoraConfig::new(8, 16.0, &["up_proj"]), "default", &adapters.root())?;
//! assert_eq!(report.modules, ["mlp.up_proj"]);
//! assert_eq!(report.params_added, 8 * (32 + 64));
//! let y = mlp.up.forward_t(&Tensor::ones([2, 32], (Kind::Float, Device::Cpu)), true)?;
//! assert_eq!(y.size(), [2, 64]);
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

pub mod base;
pub mod config;
pub mod conv;
pub mod dist;
pub mod embedding;
mod error;
pub mod formats;
pub mod inject;
pub mod layer;
pub mod linear;
pub mod oom;
pub mod profile;
pub mod quant;
pub mod safetensors;
pub mod sys;

pub use error::{Error, Result};
pub use tch;
