//! FLUX.1 (Black Forest Labs, 2024): the rectified-flow transformer
//! ([`model::FluxTransformer2DModel`], dev and schnell), numerically matching diffusers 0.42.1,
//! loaded from diffusers folders or from BFL's original single files ([`convert`]), and the
//! latent packing of diffusers' `FluxPipeline`, and the pipeline itself ([`pipeline::FluxPipeline`]:
//! transformer, CLIP-L, T5-XXL, tokenizers, autoencoder and flow-matching schedule from a
//! diffusers folder or ComfyUI's single files; prompt encoding, latents, sampling).
//!
//! Every linear is a LoRA site named as diffusers names the module
//! (`transformer_blocks.0.attn.to_q`, `single_transformer_blocks.0.proj_mlp`, `norm1.linear`), so
//! PEFT / diffusers adapter keys map onto them unchanged; [`convert::bfl_modules`] says which of
//! them make up each fused module of the BFL / kohya / ComfyUI layout; [`lora`] writes and reads
//! adapters in diffusers' and in kohya / ComfyUI's keys through it.
//!
//! Frozen weights can be held compact ([`base`]): fp8 as kohya's `fp8_base` and NF4 as QLoRA
//! ([`FluxBaseFormat`], [`FluxTransformer2DModel::from_single_file_with_base`]), or a GGUF file's
//! blocks as stored ([`FluxTransformer2DModel::from_gguf`]), fused BFL rows cut as blocks. Block
//! swapping ([`FluxTransformer2DModel::set_blocks_to_swap`]) keeps some blocks' base weights on
//! the host and copies them in per use.
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::flux::{FluxInputs, FluxTransformer2DModel, latent_image_ids, pack_latents};
//! use lora_models::sd::LoadOptions;
//! use tch::{Device, Kind, Tensor};
//! let opts = LoadOptions { kind: Kind::BFloat16, ..LoadOptions::default() };
//! let model = FluxTransformer2DModel::from_single_file("flux1-dev.safetensors".as_ref(), &opts, None)?;
//! let f = (Kind::BFloat16, Device::Cpu);
//! let latents = Tensor::zeros([1, 16, 128, 128], f);           // VAE latents of 1024×1024
//! let packed = pack_latents(&latents)?;                         // [1, 4096, 64]
//! let img_ids = latent_image_ids(64, 64, Device::Cpu)?;         // [4096, 3]
//! let t5 = Tensor::zeros([1, 512, 4096], f);
//! let txt_ids = Tensor::zeros([512, 3], (Kind::Float, Device::Cpu));
//! let pooled = Tensor::zeros([1, 768], f);
//! let (t, g) = (Tensor::from_slice(&[1.0f32]), Tensor::from_slice(&[3.5f32]));
//! let v = model.forward(&FluxInputs {
//!     hidden_states: &packed, encoder_hidden_states: &t5, pooled_projections: &pooled,
//!     timestep: &t, img_ids: &img_ids, txt_ids: &txt_ids, guidance: Some(&g),
//! })?;                                                          // [1, 4096, 64]
//! # let _ = v; Ok(()) }
//! ```

pub mod base;
pub mod config;
pub mod convert;
pub mod lora;
pub mod model;
pub mod pipeline;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

pub use base::{FluxBaseFormat, FluxBaseSource};
pub use config::{FluxCheckpointInfo, FluxConfig, FluxLayout};
pub use convert::{BflKeyMap, BflModule, BflSource, bfl_modules};
pub use model::{BlockInputs, FluxBlock, FluxInputs, FluxTransformer2DModel, FluxWeightBytes};
pub use pipeline::{FluxFiles, FluxPipeline, FluxSampleOptions, FluxTextCond};

/// Packs VAE latents into the transformer's tokens: each 2×2 patch of `C` channels becomes one
/// token of `4C` values, channel-major then row, column (diffusers
/// `FluxPipeline._pack_latents`).
///
/// # Shapes
/// `[B, C, H, W]` → `[B, (H/2)·(W/2), 4C]` (FLUX.1: `[B, 16, H, W]` → `[B, HW/4, 64]`).
///
/// # Errors
/// [`Error::InvalidArgument`] when `latents` is not 4-D with even `H` and `W`.
pub fn pack_latents(latents: &Tensor) -> Result<Tensor> {
    let sz = latents.size();
    if sz.len() != 4 || sz[2] % 2 != 0 || sz[3] % 2 != 0 {
        return Err(Error::InvalidArgument(format!(
            "FLUX latents must be [batch, channels, height, width] with even height and width, \
             got {sz:?} (the image side must be a multiple of 16 pixels)"
        )));
    }
    let (b, c, h, w) = (sz[0], sz[1], sz[2], sz[3]);
    Ok(latents
        .f_view([b, c, h / 2, 2, w / 2, 2])?
        .f_permute([0, 2, 4, 1, 3, 5])?
        .f_reshape([b, (h / 2) * (w / 2), c * 4])?)
}

/// The inverse of [`pack_latents`] for latents of `height × width` (latent pixels, even)
/// (diffusers `FluxPipeline._unpack_latents`, which takes the image size and the VAE scale
/// factor instead: `height = 2 · (image_height / (2 · vae_scale_factor))`).
///
/// # Shapes
/// `[B, (height/2)·(width/2), 4C]` → `[B, C, height, width]`.
///
/// # Errors
/// [`Error::InvalidArgument`] when the token count or width does not fit.
pub fn unpack_latents(packed: &Tensor, height: i64, width: i64) -> Result<Tensor> {
    let sz = packed.size();
    if sz.len() != 3
        || height % 2 != 0
        || width % 2 != 0
        || sz[1] != (height / 2) * (width / 2)
        || sz[2] % 4 != 0
    {
        return Err(Error::InvalidArgument(format!(
            "packed FLUX latents {sz:?} do not fit a {height}×{width} latent (expected \
             [batch, {}, 4·channels] with even height and width)",
            (height / 2) * (width / 2)
        )));
    }
    let (b, c) = (sz[0], sz[2] / 4);
    Ok(packed
        .f_view([b, height / 2, width / 2, c, 2, 2])?
        .f_permute([0, 3, 1, 4, 2, 5])?
        .f_reshape([b, c, height, width])?)
}

/// Position ids of the packed image tokens of a `h2 × w2` token grid (latent size / 2): row
/// `r·w2 + c` is `(0, r, c)` (diffusers `FluxPipeline._prepare_latent_image_ids`).
///
/// # Shapes
/// → `[h2·w2, 3]` float32 on `device`.
///
/// # Errors
/// [`Error::Torch`] when the tensor cannot be built on `device`.
pub fn latent_image_ids(h2: i64, w2: i64, device: Device) -> Result<Tensor> {
    let f = (Kind::Float, device);
    let rows = Tensor::f_arange(h2, f)?
        .f_unsqueeze(1)?
        .f_expand([h2, w2], false)?;
    let cols = Tensor::f_arange(w2, f)?
        .f_unsqueeze(0)?
        .f_expand([h2, w2], false)?;
    let zero = Tensor::f_zeros([h2, w2], f)?;
    Ok(Tensor::f_stack(&[zero, rows, cols], -1)?.f_reshape([h2 * w2, 3])?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packing_round_trips_and_groups_2x2_patches() {
        let x = Tensor::arange(2 * 3 * 4 * 6, (Kind::Float, Device::Cpu)).reshape([2, 3, 4, 6]);
        let p = pack_latents(&x).unwrap();
        assert_eq!(p.size(), [2, 6, 12]);
        // token 0 of batch 0 = channel 0's top-left 2×2 patch, then channel 1's …
        let t0: Vec<f32> = Vec::try_from(p.get(0).get(0)).unwrap();
        assert_eq!(&t0[..4], &[0.0, 1.0, 6.0, 7.0]);
        assert_eq!(t0[4], 24.0);
        assert!(unpack_latents(&p, 4, 6).unwrap().equal(&x));
        assert!(pack_latents(&x.narrow(2, 0, 3)).is_err());
        assert!(unpack_latents(&p, 4, 8).is_err());
    }

    #[test]
    fn image_ids_are_row_then_column() {
        let ids = latent_image_ids(2, 3, Device::Cpu).unwrap();
        let v: Vec<f32> = Vec::try_from(ids.reshape([-1])).unwrap();
        assert_eq!(
            v,
            [
                0., 0., 0., 0., 0., 1., 0., 0., 2., 0., 1., 0., 0., 1., 1., 0., 1., 2.
            ]
        );
    }
}
