//! Where Stable Diffusion weights come from: diffusers folders and single-file original
//! checkpoints, both memory-mapped safetensors.
//!
//! - **diffusers folder** (`save_pretrained` layout): `<root>/unet/config.json` +
//!   `diffusion_pytorch_model.safetensors` (or the `fp16` variant
//!   `diffusion_pytorch_model.fp16.safetensors`, or shards listed by
//!   `diffusion_pytorch_model[.fp16].safetensors.index.json`); the same for `vae/`.
//! - **single file** (`v1-5-pruned-emaonly.safetensors` style, the original CompVis
//!   latent-diffusion / `sgm` layout): UNet under `model.diffusion_model.`, VAE under
//!   `first_stage_model.`, SD 1.x text encoder under `cond_stage_model.transformer.`, SDXL text
//!   encoders under `conditioner.embedders.0.transformer.` (CLIP ViT-L, transformers layout) and
//!   `conditioner.embedders.1.model.` (OpenCLIP bigG: read by
//!   [`crate::clip::ClipTextModelWithProjection::from_open_clip`]). Models ask for diffusers
//!   names; [`ldm_unet_key`] and [`ldm_vae_key`] translate them to the original names (the
//!   inverse of diffusers' `convert_ldm_unet_checkpoint` / `convert_ldm_vae_checkpoint` in
//!   `diffusers/loaders/single_file_utils.py`), and [`ldm_text_encoder_key`] maps the SD 1.x
//!   text-encoder keys to transformers' `text_model.…` names.
//!
//! The files are read through the crate's weights layer ([`crate::weights`]); this module holds
//! only what is SD's own: the diffusers folder layout and the original ↔ diffusers key maps.

use std::path::{Path, PathBuf};

use tch::{Device, Kind};

use crate::error::{Error, Result};
pub(crate) use crate::weights::read_config_json;
use crate::weights::weight_files;
/// The crate's weights layer, re-exported under the paths SD code has used.
pub use crate::weights::{SafetensorsFiles, TensorMap, TensorSource};

/// Options for loading a UNet or VAE.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The dtype weights are converted to and the model computes in (`Float`, `Half`, `BFloat16`).
    pub kind: Kind,
    /// The device the weights go to.
    pub device: Device,
    /// How attention is computed.
    pub attention: super::attention::AttentionBackend,
    /// The weights variant of a diffusers folder (`Some("fp16")` reads
    /// `diffusion_pytorch_model.fp16.safetensors`); `None` takes the plain file and falls back to
    /// the `fp16` variant when the plain file is absent.
    pub variant: Option<String>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            kind: Kind::Float,
            device: Device::Cpu,
            attention: super::attention::AttentionBackend::Sdpa,
            variant: None,
        }
    }
}

/// The component folder of a diffusers model: `dir` itself when it holds `config.json`, else
/// `dir/<component>` (a pipeline root).
///
/// # Errors
/// [`Error::Io`] when neither has a `config.json`.
pub fn component_dir(dir: &Path, component: &str) -> Result<PathBuf> {
    let sub = dir.join(component);
    if sub.join("config.json").exists() {
        return Ok(sub);
    }
    if dir.join("config.json").exists() {
        return Ok(dir.to_path_buf());
    }
    Err(Error::Io {
        path: sub.join("config.json"),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "no config.json in {} nor in {}: give a diffusers pipeline folder or its `{component}` subfolder",
                dir.display(),
                sub.display()
            ),
        ),
    })
}

/// The weight files of a diffusers component folder: `diffusion_pytorch_model[.variant].safetensors`
/// or the shards its `.index.json` lists.
///
/// # Errors
/// [`Error::Io`] when no weights file exists (the message lists what was looked for);
/// [`Error::Config`] for an index without `weight_map`.
pub fn diffusers_weight_files(dir: &Path, variant: Option<&str>) -> Result<Vec<PathBuf>> {
    let stems: Vec<String> = match variant {
        Some(v) => vec![format!("diffusion_pytorch_model.{v}.safetensors")],
        None => vec![
            "diffusion_pytorch_model.safetensors".into(),
            "diffusion_pytorch_model.fp16.safetensors".into(),
        ],
    };
    weight_files(dir, &stems)
}

/// Prefix of the UNet in an original single-file checkpoint.
pub const LDM_UNET_PREFIX: &str = "model.diffusion_model.";
/// Prefix of the VAE in an original single-file checkpoint.
pub const LDM_VAE_PREFIX: &str = "first_stage_model.";
/// Prefix of the SD 1.x text encoder (transformers `CLIPTextModel` without its `text_model.`).
pub const LDM_TEXT_ENCODER_PREFIX: &str = "cond_stage_model.transformer.";
/// Prefix of SDXL's first text encoder (CLIP ViT-L, transformers layout).
pub const SGM_TEXT_ENCODER_PREFIX: &str = "conditioner.embedders.0.transformer.";
/// Prefix of SDXL's second text encoder (OpenCLIP ViT-bigG, OpenCLIP layout: fused `in_proj`
/// attention weights; see [`crate::clip::ClipTextModelWithProjection::from_open_clip`]).
pub const SGM_TEXT_ENCODER_2_PREFIX: &str = "conditioner.embedders.1.model.";
/// Prefix of SD 2.x's text encoder (OpenCLIP ViT-H, OpenCLIP layout).
pub const LDM_OPEN_CLIP_PREFIX: &str = "cond_stage_model.model.";

/// The UNet layout numbers the key translation needs: `layers_per_block` and, per level, whether
/// the down / up blocks carry attentions (`CrossAttn…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnetLayout {
    /// ResNets per down block (`layers_per_block`); up blocks have one more.
    pub layers_per_block: usize,
    /// Per down level: has attentions.
    pub down_attn: Vec<bool>,
    /// Per up level (diffusers order, lowest resolution first): has attentions.
    pub up_attn: Vec<bool>,
}

fn resnet_ldm(rest: &str) -> Option<String> {
    // diffusers ResnetBlock2D → original ResBlock (`ldm/modules/diffusionmodules/openaimodel.py`)
    let (m, leaf) = rest.split_once('.')?;
    let m = match m {
        "norm1" => "in_layers.0",
        "conv1" => "in_layers.2",
        "time_emb_proj" => "emb_layers.1",
        "norm2" => "out_layers.0",
        "conv2" => "out_layers.3",
        "conv_shortcut" => "skip_connection",
        _ => return None,
    };
    Some(format!("{m}.{leaf}"))
}

/// Translates a diffusers UNet parameter name (`down_blocks.1.attentions.0.proj_in.weight`) to
/// its name in an original single-file checkpoint, with [`LDM_UNET_PREFIX`]
/// (`model.diffusion_model.input_blocks.4.1.proj_in.weight`). Layout of the original
/// (`openaimodel.py::UNetModel`): `input_blocks.0.0` is `conv_in`; level `i` layer `j` is
/// `input_blocks.{1 + i·(L+1) + j}` (`.0` ResNet, `.1` transformer); the down-sampler of level
/// `i` is `input_blocks.{(i+1)·(L+1)}.0.op`; `middle_block.{0,1,2}` is ResNet, transformer,
/// ResNet; up level `i` layer `j` is `output_blocks.{i·(L+2) + j}` with `.0` ResNet, `.1`
/// transformer and the up-sampler `.{1|2}.conv` after the last layer; `time_embed.{0,2}`,
/// `label_emb.0.{0,2}` (SDXL), `out.{0,2}`. Transformer internals keep their names.
/// Returns `None` for names that have no original counterpart.
pub fn ldm_unet_key(name: &str, layout: &UnetLayout) -> Option<String> {
    let l = layout.layers_per_block;
    let p = LDM_UNET_PREFIX;
    let simple = [
        ("conv_in.", "input_blocks.0.0."),
        ("time_embedding.linear_1.", "time_embed.0."),
        ("time_embedding.linear_2.", "time_embed.2."),
        ("add_embedding.linear_1.", "label_emb.0.0."),
        ("add_embedding.linear_2.", "label_emb.0.2."),
        ("conv_norm_out.", "out.0."),
        ("conv_out.", "out.2."),
    ];
    for (d, o) in simple {
        if let Some(rest) = name.strip_prefix(d) {
            return Some(format!("{p}{o}{rest}"));
        }
    }
    if let Some(rest) = name.strip_prefix("down_blocks.") {
        let (i, rest) = rest.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let (kind, rest) = rest.split_once('.')?;
        let (j, rest) = rest.split_once('.')?;
        let j: usize = j.parse().ok()?;
        return match kind {
            "resnets" => Some(format!(
                "{p}input_blocks.{}.0.{}",
                1 + i * (l + 1) + j,
                resnet_ldm(rest)?
            )),
            "attentions" => Some(format!("{p}input_blocks.{}.1.{rest}", 1 + i * (l + 1) + j)),
            "downsamplers" => {
                let leaf = rest.strip_prefix("conv.")?;
                Some(format!("{p}input_blocks.{}.0.op.{leaf}", (i + 1) * (l + 1)))
            }
            _ => None,
        };
    }
    if let Some(rest) = name.strip_prefix("mid_block.") {
        let (kind, rest) = rest.split_once('.')?;
        let (j, rest) = rest.split_once('.')?;
        return match (kind, j) {
            ("resnets", "0") => Some(format!("{p}middle_block.0.{}", resnet_ldm(rest)?)),
            ("attentions", "0") => Some(format!("{p}middle_block.1.{rest}")),
            ("resnets", "1") => Some(format!("{p}middle_block.2.{}", resnet_ldm(rest)?)),
            _ => None,
        };
    }
    if let Some(rest) = name.strip_prefix("up_blocks.") {
        let (i, rest) = rest.split_once('.')?;
        let i: usize = i.parse().ok()?;
        let (kind, rest) = rest.split_once('.')?;
        let (j, rest) = rest.split_once('.')?;
        let j: usize = j.parse().ok()?;
        let per = l + 1;
        return match kind {
            "resnets" => Some(format!(
                "{p}output_blocks.{}.0.{}",
                i * per + j,
                resnet_ldm(rest)?
            )),
            "attentions" => Some(format!("{p}output_blocks.{}.1.{rest}", i * per + j)),
            "upsamplers" => {
                let leaf = rest.strip_prefix("conv.")?;
                let k = if *layout.up_attn.get(i)? { 2 } else { 1 };
                Some(format!(
                    "{p}output_blocks.{}.{k}.conv.{leaf}",
                    i * per + per - 1
                ))
            }
            _ => None,
        };
    }
    None
}

/// Translates a diffusers `AutoencoderKL` parameter name to its name in an original single-file
/// checkpoint, with [`LDM_VAE_PREFIX`] (`ldm/modules/diffusionmodules/model.py` `Encoder` /
/// `Decoder`): `down_blocks.i.resnets.j` ↔ `down.i.block.j`, `downsamplers.0` ↔ `downsample`,
/// `up_blocks.i` ↔ `up.{n−1−i}` (the original numbers up levels from the highest resolution),
/// `upsamplers.0` ↔ `upsample`, `mid_block.resnets.{0,1}` ↔ `mid.block_{1,2}`,
/// `mid_block.attentions.0.{group_norm,to_q,to_k,to_v,to_out.0}` ↔ `mid.attn_1.{norm,q,k,v,proj_out}`
/// (stored there as 1×1 convolutions `[C, C, 1, 1]`), `conv_norm_out` ↔ `norm_out`,
/// `conv_shortcut` ↔ `nin_shortcut`. `n_up` is the number of up levels.
pub fn ldm_vae_key(name: &str, n_up: usize) -> Option<String> {
    let p = LDM_VAE_PREFIX;
    if name.starts_with("quant_conv.") || name.starts_with("post_quant_conv.") {
        return Some(format!("{p}{name}"));
    }
    let (coder, rest) = name.split_once('.')?;
    if coder != "encoder" && coder != "decoder" {
        return None;
    }
    let res = |r: &str| r.replace("conv_shortcut.", "nin_shortcut.");
    for (d, o) in [
        ("conv_in.", "conv_in."),
        ("conv_out.", "conv_out."),
        ("conv_norm_out.", "norm_out."),
    ] {
        if let Some(leaf) = rest.strip_prefix(d) {
            return Some(format!("{p}{coder}.{o}{leaf}"));
        }
    }
    if let Some(r) = rest.strip_prefix("mid_block.") {
        if let Some(r) = r.strip_prefix("resnets.0.") {
            return Some(format!("{p}{coder}.mid.block_1.{}", res(r)));
        }
        if let Some(r) = r.strip_prefix("resnets.1.") {
            return Some(format!("{p}{coder}.mid.block_2.{}", res(r)));
        }
        let r = r.strip_prefix("attentions.0.")?;
        let (m, leaf) = r.rsplit_once('.')?;
        let m = match m {
            "group_norm" => "norm",
            "to_q" => "q",
            "to_k" => "k",
            "to_v" => "v",
            "to_out.0" => "proj_out",
            _ => return None,
        };
        return Some(format!("{p}{coder}.mid.attn_1.{m}.{leaf}"));
    }
    let (blocks, r) = rest.split_once('.')?;
    let (i, r) = r.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let (level, sampler) = match blocks {
        "down_blocks" => (format!("down.{i}"), "downsample"),
        "up_blocks" => (format!("up.{}", n_up.checked_sub(1 + i)?), "upsample"),
        _ => return None,
    };
    if let Some(r) = r.strip_prefix("resnets.") {
        let (j, leaf) = r.split_once('.')?;
        return Some(format!("{p}{coder}.{level}.block.{j}.{}", res(leaf)));
    }
    let leaf = r
        .strip_prefix("downsamplers.0.")
        .or_else(|| r.strip_prefix("upsamplers.0."))?;
    Some(format!("{p}{coder}.{level}.{sampler}.{leaf}"))
}

/// Translates a stored single-file text-encoder key to transformers' `CLIPTextModel` name:
/// `cond_stage_model.transformer.text_model.X` (SD 1.x) and
/// `conditioner.embedders.0.transformer.text_model.X` (SDXL's first encoder) → `text_model.X`;
/// older SD 1.x files without the `text_model.` level (`cond_stage_model.transformer.encoder.X`)
/// get it added. Other keys → `None` (OpenCLIP `conditioner.embedders.1.model.*` has a different
/// layout: fused `in_proj` attention weights).
pub fn ldm_text_encoder_key(stored: &str) -> Option<String> {
    let rest = stored
        .strip_prefix(LDM_TEXT_ENCODER_PREFIX)
        .or_else(|| stored.strip_prefix(SGM_TEXT_ENCODER_PREFIX))?;
    if rest.starts_with("text_model.") {
        Some(rest.to_string())
    } else {
        Some(format!("text_model.{rest}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_keys_follow_the_original_layout() {
        // SD 1.5: layers_per_block 2, attention on down levels 0..3 and up levels 1..4
        let lay = UnetLayout {
            layers_per_block: 2,
            down_attn: vec![true, true, true, false],
            up_attn: vec![false, true, true, true],
        };
        let k = |n: &str| {
            ldm_unet_key(n, &lay)
                .unwrap()
                .strip_prefix(LDM_UNET_PREFIX)
                .unwrap()
                .to_string()
        };
        assert_eq!(k("conv_in.weight"), "input_blocks.0.0.weight");
        assert_eq!(
            k("down_blocks.0.resnets.1.conv1.weight"),
            "input_blocks.2.0.in_layers.2.weight"
        );
        assert_eq!(
            k("down_blocks.1.attentions.0.proj_in.weight"),
            "input_blocks.4.1.proj_in.weight"
        );
        assert_eq!(
            k("down_blocks.2.downsamplers.0.conv.bias"),
            "input_blocks.9.0.op.bias"
        );
        assert_eq!(
            k("down_blocks.3.resnets.1.norm2.weight"),
            "input_blocks.11.0.out_layers.0.weight"
        );
        assert_eq!(
            k("mid_block.resnets.1.time_emb_proj.weight"),
            "middle_block.2.emb_layers.1.weight"
        );
        assert_eq!(
            k("up_blocks.0.upsamplers.0.conv.weight"),
            "output_blocks.2.1.conv.weight"
        );
        assert_eq!(
            k("up_blocks.1.upsamplers.0.conv.weight"),
            "output_blocks.5.2.conv.weight"
        );
        assert_eq!(
            k("up_blocks.3.resnets.0.conv_shortcut.weight"),
            "output_blocks.9.0.skip_connection.weight"
        );
        assert_eq!(
            k("up_blocks.3.attentions.2.transformer_blocks.0.attn2.to_k.weight"),
            "output_blocks.11.1.transformer_blocks.0.attn2.to_k.weight"
        );
        assert_eq!(k("conv_norm_out.bias"), "out.0.bias");
    }

    #[test]
    fn vae_and_text_keys() {
        assert_eq!(
            ldm_vae_key("decoder.up_blocks.0.resnets.2.conv_shortcut.weight", 4).unwrap(),
            "first_stage_model.decoder.up.3.block.2.nin_shortcut.weight"
        );
        assert_eq!(
            ldm_vae_key("encoder.mid_block.attentions.0.to_out.0.bias", 4).unwrap(),
            "first_stage_model.encoder.mid.attn_1.proj_out.bias"
        );
        assert_eq!(
            ldm_vae_key("encoder.down_blocks.1.downsamplers.0.conv.weight", 4).unwrap(),
            "first_stage_model.encoder.down.1.downsample.conv.weight"
        );
        assert_eq!(
            ldm_text_encoder_key(
                "cond_stage_model.transformer.text_model.encoder.layers.0.self_attn.q_proj.weight"
            )
            .unwrap(),
            "text_model.encoder.layers.0.self_attn.q_proj.weight"
        );
        assert_eq!(
            ldm_text_encoder_key("cond_stage_model.transformer.embeddings.position_ids").unwrap(),
            "text_model.embeddings.position_ids"
        );
        assert_eq!(
            ldm_text_encoder_key("model.diffusion_model.out.0.bias"),
            None
        );
    }
}
