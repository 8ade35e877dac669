//! A Stable Diffusion descriptor from a diffusers pipeline folder, reading only `config.json`
//! files and safetensors headers (no tensor data).
//!
//! Folder layout (diffusers `save_pretrained`): `unet/config.json` +
//! `diffusion_pytorch_model[.fp16].safetensors` (or a `.index.json` of shards), `vae/` likewise,
//! `text_encoder/` and, for SDXL, `text_encoder_2/` with transformers' `config.json` +
//! `model[.fp16].safetensors`. Levels, heads and transformer depths come from the UNet config
//! (`block_out_channels`, `layers_per_block`, `down_block_types`, `attention_head_dim` — which
//! in `UNet2DConditionModel` configs is the number of heads —, `transformer_layers_per_block`,
//! `cross_attention_dim`); parameter counts are summed from the headers.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::flux::FluxDescriptor;
use crate::model::{DiffusionDescriptor, DiffusionFamily, TextEncoderDescriptor, UnetLevel};
use crate::safetensors_header::read_header;

fn read_json(path: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.into(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| Error::Json {
        path: path.into(),
        source,
    })
}

fn cfg_err(path: &Path, key: &str, reason: &str) -> Error {
    Error::Config {
        path: path.into(),
        key: key.into(),
        reason: reason.into(),
    }
}

/// The safetensors files of a component folder: `<stem>.safetensors`, `<stem>.fp16.safetensors`,
/// or the shards listed by either's `.index.json`.
fn weight_files(dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    for name in [
        format!("{stem}.safetensors"),
        format!("{stem}.fp16.safetensors"),
    ] {
        let single = dir.join(&name);
        if single.exists() {
            return Ok(vec![single]);
        }
        let index = dir.join(format!("{name}.index.json"));
        if index.exists() {
            let v = read_json(&index)?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| cfg_err(&index, "weight_map", "missing or not an object"))?;
            let mut files: Vec<PathBuf> = map
                .values()
                .filter_map(|f| f.as_str().map(|f| dir.join(f)))
                .collect();
            files.sort();
            files.dedup();
            return Ok(files);
        }
    }
    Err(Error::Io {
        path: dir.join(format!("{stem}.safetensors")),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no safetensors weights (plain, fp16 variant or sharded) in the folder",
        ),
    })
}

fn param_count(files: &[PathBuf]) -> Result<u64> {
    let mut n = 0;
    for f in files {
        n += read_header(f)?.values().map(|t| t.elements()).sum::<u64>();
    }
    Ok(n)
}

/// An integer or one integer per level.
fn per_level(
    path: &Path,
    v: Option<&serde_json::Value>,
    key: &str,
    n: usize,
    default: u64,
) -> Result<Vec<u64>> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(vec![default; n]),
        Some(serde_json::Value::Number(x)) => x
            .as_u64()
            .map(|x| vec![x; n])
            .ok_or_else(|| cfg_err(path, key, "not a non-negative integer")),
        Some(serde_json::Value::Array(a)) if a.len() == n => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| cfg_err(path, key, "entries must be non-negative integers"))
            })
            .collect(),
        Some(_) => Err(cfg_err(
            path,
            key,
            &format!("expected an integer or a list of {n} integers"),
        )),
    }
}

/// The text encoder in `dir/<name>` (its `config.json` and safetensors headers): a CLIP text
/// model (`hidden_size`, `intermediate_size`, …) or a T5 encoder (`d_model`, `d_ff`,
/// `num_layers`, `num_heads`; 512 tokens, FLUX's longest); `None` when the folder has no
/// config.
pub(crate) fn text_encoder(dir: &Path, name: &str) -> Result<Option<TextEncoderDescriptor>> {
    let sub = dir.join(name);
    let cfg_path = sub.join("config.json");
    if !cfg_path.exists() {
        return Ok(None);
    }
    let c = read_json(&cfg_path)?;
    // CLIPTextModel(WithProjection) configs keep the sizes at the top level (older ones under `text_config`)
    let c = c.get("text_config").cloned().unwrap_or(c);
    let get = |key: &str| {
        c.get(key)
            .and_then(|v| v.as_u64())
            .ok_or_else(|| cfg_err(&cfg_path, key, "missing or not an integer"))
    };
    let params = param_count(&weight_files(&sub, "model")?)?;
    if c.get("d_model").is_some() {
        // transformers' T5Config
        return Ok(Some(TextEncoderDescriptor {
            name: name.into(),
            params,
            hidden: get("d_model")?,
            intermediate: get("d_ff")?,
            layers: get("num_layers")?,
            heads: get("num_heads")?,
            max_tokens: 512,
        }));
    }
    Ok(Some(TextEncoderDescriptor {
        name: name.into(),
        params,
        hidden: get("hidden_size")?,
        intermediate: get("intermediate_size")?,
        layers: get("num_hidden_layers")?,
        heads: get("num_attention_heads")?,
        max_tokens: get("max_position_embeddings")?,
    }))
}

/// The autoencoder in `dir/vae` as `(parameters, latent channels, down-scaling factor)` (the
/// factor `2^(levels − 1)` of its `block_out_channels`); `None` without `vae/config.json`.
pub(crate) fn vae(dir: &Path) -> Result<Option<(u64, u64, u64)>> {
    let vae_dir = dir.join("vae");
    let vp = vae_dir.join("config.json");
    if !vp.exists() {
        return Ok(None);
    }
    let v = read_json(&vp)?;
    let levels = v
        .get("block_out_channels")
        .and_then(|x| x.as_array())
        .map_or(4, |a| a.len()) as u32;
    let latent = v
        .get("latent_channels")
        .and_then(|x| x.as_u64())
        .unwrap_or(4);
    Ok(Some((
        param_count(&weight_files(&vae_dir, "diffusion_pytorch_model")?)?,
        latent,
        1u64 << levels.saturating_sub(1),
    )))
}

/// Describes the Stable Diffusion pipeline in diffusers folder `dir` (or a bare `unet` folder)
/// from its configs and safetensors headers.
///
/// The family is [`DiffusionFamily::Sdxl`] when the UNet has `addition_embed_type: "text_time"`,
/// else [`DiffusionFamily::Sd1`] (SD 2.x included: its 1024-wide context is kept in
/// `cross_attention_dim`). The VAE and text encoders are counted when their folders exist
/// (otherwise `vae_params` is 0 and `text_encoders` is empty); `vae_scale` is
/// `2^(levels − 1)` of the VAE (8 when there is no `vae/`).
///
/// # Errors
/// [`Error::Io`] / [`Error::Json`] for unreadable files; [`Error::Config`] naming the file and
/// key for a missing or mistyped config value; [`Error::Safetensors`] for a bad header.
pub fn diffusion_from_diffusers_folder(dir: &Path) -> Result<DiffusionDescriptor> {
    let unet_dir = if dir.join("unet/config.json").exists() {
        dir.join("unet")
    } else {
        dir.to_path_buf()
    };
    let cfg_path = unet_dir.join("config.json");
    let c = read_json(&cfg_path)?;
    let channels: Vec<u64> = c
        .get("block_out_channels")
        .and_then(|v| v.as_array())
        .ok_or_else(|| cfg_err(&cfg_path, "block_out_channels", "missing or not a list"))?
        .iter()
        .map(|x| {
            x.as_u64()
                .ok_or_else(|| cfg_err(&cfg_path, "block_out_channels", "entries must be integers"))
        })
        .collect::<Result<_>>()?;
    let n = channels.len();
    let types: Vec<String> = c
        .get("down_block_types")
        .and_then(|v| v.as_array())
        .ok_or_else(|| cfg_err(&cfg_path, "down_block_types", "missing or not a list"))?
        .iter()
        .map(|x| x.as_str().unwrap_or_default().to_string())
        .collect();
    if types.len() != n {
        return Err(cfg_err(
            &cfg_path,
            "down_block_types",
            "must have one entry per block_out_channels entry",
        ));
    }
    let layers = per_level(
        &cfg_path,
        c.get("layers_per_block"),
        "layers_per_block",
        n,
        2,
    )?;
    let heads = per_level(
        &cfg_path,
        c.get("attention_head_dim"),
        "attention_head_dim",
        n,
        8,
    )?;
    let depth = per_level(
        &cfg_path,
        c.get("transformer_layers_per_block"),
        "transformer_layers_per_block",
        n,
        1,
    )?;
    let ctx = per_level(
        &cfg_path,
        c.get("cross_attention_dim"),
        "cross_attention_dim",
        n,
        1280,
    )?;
    let levels = (0..n)
        .map(|i| UnetLevel {
            channels: channels[i],
            resnets: layers[i],
            transformer_depth: if types[i].starts_with("CrossAttn") {
                depth[i]
            } else {
                0
            },
            heads: heads[i],
        })
        .collect();
    let family = match c.get("addition_embed_type").and_then(|v| v.as_str()) {
        Some("text_time") => DiffusionFamily::Sdxl,
        _ => DiffusionFamily::Sd1,
    };
    let unet_params = param_count(&weight_files(&unet_dir, "diffusion_pytorch_model")?)?;
    let (vae_params, latent_channels, vae_scale) = match vae(dir)? {
        Some(v) => v,
        None => (
            0,
            c.get("in_channels").and_then(|x| x.as_u64()).unwrap_or(4),
            8,
        ),
    };
    let (vae_block_out_channels, vae_layers_per_block) = vae_decoder(dir)?;
    let text_encoders = ["text_encoder", "text_encoder_2"]
        .iter()
        .filter_map(|name| text_encoder(dir, name).transpose())
        .collect::<Result<Vec<_>>>()?;
    Ok(DiffusionDescriptor {
        name: dir
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "diffusers".into()),
        family,
        unet_params,
        levels,
        mid_transformer_depth: depth[n - 1],
        cross_attention_dim: ctx[n - 1],
        text_encoders,
        vae_params,
        latent_channels,
        vae_scale,
        vae_block_out_channels,
        vae_layers_per_block,
    })
}

/// The VAE's `block_out_channels` and `layers_per_block` from `dir/vae/config.json` (empty and
/// 0 when there is no such file: the planner then assumes SD's VAE).
pub(crate) fn vae_decoder(dir: &Path) -> Result<(Vec<u64>, u64)> {
    let vp = dir.join("vae/config.json");
    if !vp.exists() {
        return Ok((Vec::new(), 0));
    }
    let v = read_json(&vp)?;
    let channels = match v.get("block_out_channels").and_then(|x| x.as_array()) {
        Some(a) => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .ok_or_else(|| cfg_err(&vp, "block_out_channels", "entries must be integers"))
            })
            .collect::<Result<Vec<_>>>()?,
        None => Vec::new(),
    };
    let layers = v
        .get("layers_per_block")
        .and_then(|x| x.as_u64())
        .unwrap_or(0);
    Ok((channels, layers))
}

// Reading a diffusers FLUX folder's components is header reading: it lives here, so that
// `flux` needs nothing of this module.
impl FluxDescriptor {
    /// This descriptor with the text encoders and autoencoder of the diffusers FLUX folder
    /// `dir` (`text_encoder/`, `text_encoder_2/`, `vae/`: their configs and safetensors
    /// headers) in place of FLUX.1's, for each component the folder holds.
    ///
    /// # Errors
    /// I/O, JSON and safetensors-header errors naming the file; a config missing a size key.
    pub fn with_diffusers_components(mut self, dir: &Path) -> Result<Self> {
        for name in ["text_encoder", "text_encoder_2"] {
            if let Some(te) = text_encoder(dir, name)? {
                match self.text_encoders.iter_mut().find(|t| t.name == name) {
                    Some(t) => *t = te,
                    None => self.text_encoders.push(te),
                }
            }
        }
        if let Some((params, latent, scale)) = vae(dir)? {
            self.vae_params = params;
            self.latent_channels = latent;
            self.vae_scale = scale;
            (self.vae_block_out_channels, self.vae_layers_per_block) = vae_decoder(dir)?;
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors_header::write_test_file;

    #[test]
    fn sdxl_folder_from_configs_and_headers() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tiny-sdxl");
        for sub in ["unet", "vae", "text_encoder"] {
            std::fs::create_dir_all(root.join(sub)).unwrap();
        }
        std::fs::write(
            root.join("unet/config.json"),
            r#"{"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64],
                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"], "layers_per_block": 2,
                "attention_head_dim": [2, 4], "transformer_layers_per_block": [1, 3],
                "cross_attention_dim": 48, "addition_embed_type": "text_time"}"#,
        )
        .unwrap();
        write_test_file(
            &root.join("unet/diffusion_pytorch_model.fp16.safetensors"),
            &[
                ("conv_in.weight", "F16", &[32, 4, 3, 3]),
                ("conv_in.bias", "F16", &[32]),
            ],
        )
        .unwrap();
        std::fs::write(
            root.join("vae/config.json"),
            r#"{"block_out_channels": [32, 64, 64], "latent_channels": 4}"#,
        )
        .unwrap();
        write_test_file(
            &root.join("vae/diffusion_pytorch_model.safetensors"),
            &[("x", "F32", &[10, 10])],
        )
        .unwrap();
        std::fs::write(
            root.join("text_encoder/config.json"),
            r#"{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "max_position_embeddings": 77}"#,
        )
        .unwrap();
        write_test_file(
            &root.join("text_encoder/model.safetensors"),
            &[("t", "F32", &[7])],
        )
        .unwrap();

        let d = diffusion_from_diffusers_folder(&root).unwrap();
        assert_eq!(d.family, DiffusionFamily::Sdxl);
        assert_eq!(d.unet_params, 32 * 4 * 9 + 32);
        assert_eq!(
            d.levels
                .iter()
                .map(|l| l.transformer_depth)
                .collect::<Vec<_>>(),
            [0, 3]
        );
        assert_eq!(d.levels.iter().map(|l| l.heads).collect::<Vec<_>>(), [2, 4]);
        assert_eq!(
            (
                d.levels[1].resnets,
                d.mid_transformer_depth,
                d.cross_attention_dim
            ),
            (2, 3, 48)
        );
        assert_eq!((d.vae_params, d.vae_scale, d.latent_channels), (100, 4, 4));
        assert_eq!(d.text_encoders.len(), 1);
        assert_eq!(
            (d.text_encoders[0].params, d.text_encoders[0].layers),
            (7, 2)
        );
        assert_eq!(d.name, "tiny-sdxl");

        // a missing key is named
        std::fs::write(root.join("unet/config.json"), r#"{"down_block_types": []}"#).unwrap();
        let e = diffusion_from_diffusers_folder(&root)
            .unwrap_err()
            .to_string();
        assert!(e.contains("block_out_channels"), "{e}");
    }
}
