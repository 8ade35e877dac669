//! Stable Diffusion 1.x / 2.x and SDXL: the denoising [`unet::UNet2DConditionModel`] and the
//! [`vae::AutoencoderKL`], numerically matching diffusers 0.42.1, loaded from diffusers folders
//! or original single-file checkpoints ([`load`]), and the pipeline of both with its CLIP
//! text encoder(s) ([`pipeline::SdPipeline`]).
//!
//! Every linear layer and convolution is a LoRA site named as diffusers names the module
//! (`down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`, `…resnets.0.conv1`), so
//! PEFT / diffusers / kohya adapter keys map onto them unchanged ([`lora_core::inject::Adaptable`]).
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::sd::{LoadOptions, unet::UNet2DConditionModel, vae::AutoencoderKL};
//! use tch::{Kind, Tensor};
//! let opts = LoadOptions::default();                     // float32, CPU, SDPA attention
//! let unet = UNet2DConditionModel::from_diffusers("stable-diffusion-v1-5".as_ref(), &opts)?;
//! let vae = AutoencoderKL::from_diffusers("stable-diffusion-v1-5".as_ref(), &opts)?;
//! let image = Tensor::zeros([1, 3, 512, 512], (Kind::Float, tch::Device::Cpu));
//! let latents = vae.scale_latents(&vae.encode(&image)?.sample(Some(0))?)?;   // [1, 4, 64, 64]
//! let text = Tensor::zeros([1, 77, 768], (Kind::Float, tch::Device::Cpu));
//! let eps = unet.forward(&latents, &Tensor::from_slice(&[999i64]), &text, None)?;
//! # let _ = eps; Ok(()) }
//! ```

pub mod attention;
pub mod blocks;
pub mod config;
pub mod load;
pub mod pipeline;
pub mod unet;
pub mod vae;

pub use attention::AttentionBackend;
pub use load::LoadOptions;
pub use pipeline::{
    SampleOptions, SamplerKind, SdPipeline, TextCond, sdxl_time_ids, single_file_companion,
};
pub use unet::{UNet2DConditionModel, UNetConfig};
pub use vae::{AutoencoderKL, DiagonalGaussian, VaeConfig};
