//! The FLUX.1 transformer's configuration: diffusers' `FluxTransformer2DModel` `config.json`
//! (`transformer/config.json` of `black-forest-labs/FLUX.1-dev` / `FLUX.1-schnell`), the two
//! published presets, the parameter count, and what a checkpoint's key names and shapes say
//! about the model when it comes without a config (a single `flux1-dev.safetensors`).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::weights::read_config_json;

/// Width of the sinusoidal timestep / guidance features fed to the time embedders
/// (diffusers `Timesteps(num_channels=256)` in `CombinedTimestep*TextProjEmbeddings`; BFL's
/// `timestep_embedding(t, 256)`).
pub const TIME_PROJ_DIM: i64 = 256;

/// Hidden width of the feed-forward networks and of a single-stream block's MLP, in multiples of
/// the model width (`mlp_ratio = 4.0` in BFL's `FluxParams` and diffusers' blocks).
pub const MLP_RATIO: i64 = 4;

/// Base of the rotary position frequencies (`FluxPosEmbed(theta=10000)`).
pub const ROPE_THETA: f64 = 10000.0;

/// `FluxTransformer2DModel`'s `config.json`, as diffusers 0.42.1 reads it (keys starting with
/// `_` are ignored; an unknown key is an error). Defaults are diffusers' constructor defaults
/// (the FLUX.1 shape without guidance embedding, i.e. schnell).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FluxConfig {
    /// Side of the square patches of `proj_out`'s output (1 for FLUX.1: the 2×2 latent patches
    /// are packed outside the model, see [`super::pack_latents`]).
    pub patch_size: i64,
    /// Channels of a packed latent token (64 = 16 latent channels × 2 × 2).
    pub in_channels: i64,
    /// Output channels per token; `None` means `in_channels`.
    pub out_channels: Option<i64>,
    /// Double-stream blocks (`transformer_blocks`; BFL `double_blocks`), 19 for FLUX.1.
    pub num_layers: i64,
    /// Single-stream blocks (`single_transformer_blocks`; BFL `single_blocks`), 38 for FLUX.1.
    pub num_single_layers: i64,
    /// Width of one attention head (128).
    pub attention_head_dim: i64,
    /// Attention heads (24); the model width is `heads · head_dim` (3072).
    pub num_attention_heads: i64,
    /// Width of the text-encoder states (T5-XXL: 4096).
    pub joint_attention_dim: i64,
    /// Width of the pooled text embedding (CLIP-L: 768).
    pub pooled_projection_dim: i64,
    /// Whether the model embeds a guidance scale (FLUX.1-dev: true; schnell: false).
    pub guidance_embeds: bool,
    /// Rotary dimensions per position axis (`[16, 56, 56]`: index, row, column); they sum to
    /// `attention_head_dim`.
    pub axes_dims_rope: Vec<i64>,
}

impl Default for FluxConfig {
    fn default() -> Self {
        Self {
            patch_size: 1,
            in_channels: 64,
            out_channels: None,
            num_layers: 19,
            num_single_layers: 38,
            attention_head_dim: 128,
            num_attention_heads: 24,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            guidance_embeds: false,
            axes_dims_rope: vec![16, 56, 56],
        }
    }
}

impl FluxConfig {
    /// FLUX.1-dev (`black-forest-labs/FLUX.1-dev/transformer/config.json`): 19 double and 38
    /// single blocks, 24 heads × 128, T5 width 4096, CLIP pooled 768, 64 input channels, RoPE
    /// axes (16, 56, 56), guidance embedding on.
    pub fn dev() -> Self {
        Self {
            guidance_embeds: true,
            ..Self::default()
        }
    }

    /// FLUX.1-schnell: the shape of [`FluxConfig::dev`] without the guidance embedding.
    pub fn schnell() -> Self {
        Self::default()
    }

    /// Parses a `config.json` object (keys starting with `_` dropped).
    ///
    /// # Errors
    /// [`Error::Config`] naming `path` for unknown keys or wrong types.
    pub fn from_json(
        path: &Path,
        mut obj: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        obj.retain(|k, _| !k.starts_with('_'));
        serde_json::from_value(serde_json::Value::Object(obj)).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: format!("{e} (FluxTransformer2DModel keys of diffusers 0.42.1 are accepted)"),
        })
    }

    /// Reads a `config.json` file.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`] for a missing or malformed file.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(path, read_config_json(path)?)
    }

    /// Model width `num_attention_heads · attention_head_dim` (3072).
    pub fn inner_dim(&self) -> i64 {
        self.num_attention_heads * self.attention_head_dim
    }

    /// Output channels per token before patch unfolding (`out_channels` or `in_channels`).
    pub fn out_channels(&self) -> i64 {
        self.out_channels.unwrap_or(self.in_channels)
    }

    /// Output width of `proj_out`: `patch_size² · out_channels` (64).
    pub fn proj_out_dim(&self) -> i64 {
        self.patch_size * self.patch_size * self.out_channels()
    }

    /// Hidden width of the MLPs, `4 · inner_dim` (12288).
    pub fn mlp_hidden_dim(&self) -> i64 {
        MLP_RATIO * self.inner_dim()
    }

    /// Checks that the numbers describe a buildable model.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming the field: non-positive sizes, RoPE axes with an odd
    /// entry or a sum other than `attention_head_dim`.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("patch_size", self.patch_size),
            ("in_channels", self.in_channels),
            ("out_channels", self.out_channels()),
            ("attention_head_dim", self.attention_head_dim),
            ("num_attention_heads", self.num_attention_heads),
            ("joint_attention_dim", self.joint_attention_dim),
            ("pooled_projection_dim", self.pooled_projection_dim),
        ];
        for (name, v) in positive {
            if v <= 0 {
                return Err(Error::InvalidArgument(format!(
                    "FLUX config: `{name}` must be positive, got {v}"
                )));
            }
        }
        if self.num_layers < 0 || self.num_single_layers < 0 {
            return Err(Error::InvalidArgument(format!(
                "FLUX config: block counts must not be negative, got num_layers {} and \
                 num_single_layers {}",
                self.num_layers, self.num_single_layers
            )));
        }
        let sum: i64 = self.axes_dims_rope.iter().sum();
        if self.axes_dims_rope.is_empty()
            || self.axes_dims_rope.iter().any(|&d| d <= 0 || d % 2 != 0)
            || sum != self.attention_head_dim
        {
            return Err(Error::InvalidArgument(format!(
                "FLUX config: `axes_dims_rope` {:?} must be positive even numbers summing to \
                 attention_head_dim = {}",
                self.axes_dims_rope, self.attention_head_dim
            )));
        }
        Ok(())
    }

    /// Parameters of the transformer (weights and biases of every linear, the RMSNorm scales),
    /// from the layer shapes of diffusers' `FluxTransformer2DModel`. FLUX.1-dev: 11 901 408 320;
    /// schnell (no guidance embedder): 11 891 178 560 (both checked against diffusers' model
    /// built on the meta device).
    pub fn num_params(&self) -> i64 {
        let d = self.inner_dim();
        let h = self.attention_head_dim;
        let m = self.mlp_hidden_dim();
        let lin = |i: i64, o: i64| i * o + o;
        let mlp2 = |i: i64, o: i64| lin(i, o) + lin(o, o);
        let mut n = mlp2(TIME_PROJ_DIM, d) + mlp2(self.pooled_projection_dim, d);
        if self.guidance_embeds {
            n += mlp2(TIME_PROJ_DIM, d);
        }
        n += lin(self.joint_attention_dim, d) + lin(self.in_channels, d);
        let double = 2 * lin(d, 6 * d)   // norm1, norm1_context
            + 8 * lin(d, d)             // q, k, v, out for image and text
            + 4 * h                     // norm_q, norm_k, norm_added_q, norm_added_k
            + 2 * (lin(d, m) + lin(m, d)); // ff, ff_context
        let single = lin(d, 3 * d) + 3 * lin(d, d) + lin(d, m) + lin(d + m, d) + 2 * h;
        n += self.num_layers * double + self.num_single_layers * single;
        n + lin(d, 2 * d) + lin(d, self.proj_out_dim())
    }
}

/// The key layout of a FLUX transformer checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FluxLayout {
    /// diffusers' `FluxTransformer2DModel` names (`transformer_blocks.0.attn.to_q.weight`).
    Diffusers,
    /// Black Forest Labs' original names (`double_blocks.0.img_attn.qkv.weight`), as in
    /// `flux1-dev.safetensors` and the files ComfyUI, kohya and city96's GGUF conversions use.
    Bfl,
}

/// What a checkpoint's tensor names and shapes say about the model (see
/// [`FluxCheckpointInfo::detect`]).
#[derive(Debug, Clone, PartialEq)]
pub struct FluxCheckpointInfo {
    /// The key layout.
    pub layout: FluxLayout,
    /// The prefix every transformer key carries (`""`, `"model.diffusion_model."` in ComfyUI
    /// full checkpoints, `"transformer."` in some diffusers single files).
    pub prefix: String,
    /// The configuration read off the names and shapes; `axes_dims_rope` is not stored in a
    /// checkpoint: FLUX.1's `[16, 56, 56]` when the head width is 128, else the caller's.
    pub config: FluxConfig,
}

/// Known prefixes of the transformer inside a larger file.
const PREFIXES: [&str; 3] = ["model.diffusion_model.", "transformer.", ""];

impl FluxCheckpointInfo {
    /// Reads the layout, prefix, block counts, guidance embedding (dev vs schnell) and widths
    /// from a checkpoint's tensor `names` and their shapes (`shape(name)`, torch order). The
    /// head width comes from the query RMSNorm scale (`…norm_q.weight` / `…query_norm.scale`),
    /// so the head count is `inner_dim / head_dim`. `axes_dims_rope` is taken from
    /// `axes_dims_rope` when given, else FLUX.1's `[16, 56, 56]` if the head width is 128.
    ///
    /// # Errors
    /// [`Error::Unusable`] naming `origin` when the names are neither layout's (the message
    /// lists a few of them), a key the widths come from is missing, or the head width is not
    /// 128 and no `axes_dims_rope` was given.
    pub fn detect<'n>(
        origin: &Path,
        names: impl IntoIterator<Item = &'n str>,
        shape: impl Fn(&str) -> Option<Vec<i64>>,
        axes_dims_rope: Option<Vec<i64>>,
    ) -> Result<Self> {
        let names: Vec<&str> = names.into_iter().collect();
        let unusable = |reason: String| Error::Unusable {
            what: origin.display().to_string(),
            reason,
        };
        let found = PREFIXES.iter().find_map(|p| {
            if names.contains(&format!("{p}double_blocks.0.img_attn.qkv.weight").as_str())
                || names.contains(&format!("{p}img_in.weight").as_str())
            {
                Some((FluxLayout::Bfl, *p))
            } else if names.contains(&format!("{p}x_embedder.weight").as_str()) {
                Some((FluxLayout::Diffusers, *p))
            } else {
                None
            }
        });
        let Some((layout, prefix)) = found else {
            let mut some: Vec<&str> = names.iter().copied().take(5).collect();
            some.sort_unstable();
            return Err(unusable(format!(
                "not a FLUX transformer checkpoint: no `img_in.weight` (BFL layout) nor \
                 `x_embedder.weight` (diffusers layout) under any known prefix; first keys: {some:?}"
            )));
        };
        let (double, single, guidance, img_in, txt_in, vec_in, q_norm, out) = match layout {
            FluxLayout::Bfl => (
                "double_blocks.",
                "single_blocks.",
                "guidance_in.in_layer.weight",
                "img_in.weight",
                "txt_in.weight",
                "vector_in.in_layer.weight",
                "double_blocks.0.img_attn.norm.query_norm.scale",
                "final_layer.linear.weight",
            ),
            FluxLayout::Diffusers => (
                "transformer_blocks.",
                "single_transformer_blocks.",
                "time_text_embed.guidance_embedder.linear_1.weight",
                "x_embedder.weight",
                "context_embedder.weight",
                "time_text_embed.text_embedder.linear_1.weight",
                "transformer_blocks.0.attn.norm_q.weight",
                "proj_out.weight",
            ),
        };
        let count = |block: &str| -> i64 {
            let head = format!("{prefix}{block}");
            names
                .iter()
                .filter_map(|n| n.strip_prefix(head.as_str()))
                .filter_map(|rest| rest.split('.').next()?.parse::<i64>().ok())
                .map(|i| i + 1)
                .max()
                .unwrap_or(0)
        };
        let num_layers = count(double);
        let num_single_layers = count(single);
        let dims = |key: &str| -> Result<Vec<i64>> {
            let full = format!("{prefix}{key}");
            shape(&full).ok_or_else(|| {
                unusable(format!(
                    "FLUX checkpoint without `{full}`: cannot read the model widths"
                ))
            })
        };
        let img = dims(img_in)?;
        let txt = dims(txt_in)?;
        let vec = dims(vec_in)?;
        let proj = dims(out)?;
        // head width: from the first block's query norm, else from a single block's
        let head_dim = if num_layers > 0 {
            dims(q_norm)?[0]
        } else {
            let key = match layout {
                FluxLayout::Bfl => "single_blocks.0.norm.query_norm.scale",
                FluxLayout::Diffusers => "single_transformer_blocks.0.attn.norm_q.weight",
            };
            dims(key)?[0]
        };
        let (inner, in_channels) = (img[0], img[1]);
        if head_dim <= 0 || inner % head_dim != 0 {
            return Err(unusable(format!(
                "FLUX checkpoint: model width {inner} is not a multiple of the head width {head_dim}"
            )));
        }
        let axes_dims_rope = match axes_dims_rope {
            Some(a) => a,
            None if head_dim == 128 => vec![16, 56, 56],
            None => {
                return Err(unusable(format!(
                    "FLUX checkpoint with head width {head_dim}: give `axes_dims_rope` (it is \
                     not stored in the file; FLUX.1 uses [16, 56, 56] for width 128)"
                )));
            }
        };
        let config = FluxConfig {
            patch_size: 1,
            in_channels,
            out_channels: (proj[0] != in_channels).then_some(proj[0]),
            num_layers,
            num_single_layers,
            attention_head_dim: head_dim,
            num_attention_heads: inner / head_dim,
            joint_attention_dim: txt[1],
            pooled_projection_dim: vec[1],
            guidance_embeds: names.contains(&format!("{prefix}{guidance}").as_str()),
            axes_dims_rope,
        };
        config.validate()?;
        Ok(Self {
            layout,
            prefix: prefix.to_string(),
            config,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_differ_only_in_guidance() {
        let (dev, schnell) = (FluxConfig::dev(), FluxConfig::schnell());
        assert!(dev.guidance_embeds && !schnell.guidance_embeds);
        assert_eq!(
            FluxConfig {
                guidance_embeds: false,
                ..dev.clone()
            },
            schnell
        );
        dev.validate().unwrap();
        assert_eq!(dev.inner_dim(), 3072);
        assert_eq!(dev.mlp_hidden_dim(), 12288);
        // the guidance embedder is two linears 256 → 3072 → 3072
        assert_eq!(
            dev.num_params() - schnell.num_params(),
            256 * 3072 + 3072 + 3072 * 3072 + 3072
        );
    }

    #[test]
    fn config_json_parses_and_unknown_keys_fail() {
        let json = r#"{"_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.30.0",
            "attention_head_dim": 128, "axes_dims_rope": [16, 56, 56], "guidance_embeds": true,
            "in_channels": 64, "joint_attention_dim": 4096, "num_attention_heads": 24,
            "num_layers": 19, "num_single_layers": 38, "patch_size": 1,
            "pooled_projection_dim": 768, "out_channels": null}"#;
        let obj: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).unwrap();
        let c = FluxConfig::from_json(Path::new("config.json"), obj).unwrap();
        assert_eq!(c, FluxConfig::dev());
        let bad: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"num_layer": 2}"#).unwrap();
        let e = FluxConfig::from_json(Path::new("x.json"), bad).unwrap_err();
        assert!(e.to_string().contains("num_layer"), "{e}");
    }

    /// Names and shapes of a checkpoint of `c`'s shape in `layout` under `prefix`, from the
    /// conversion table (BFL) or its inverse (diffusers).
    fn checkpoint(c: &FluxConfig, layout: FluxLayout, prefix: &str) -> Vec<(String, Vec<i64>)> {
        let map = super::super::convert::BflKeyMap::new(c);
        let d = c.inner_dim();
        let names: Vec<String> = match layout {
            FluxLayout::Bfl => map.bfl_names().map(String::from).collect(),
            FluxLayout::Diffusers => map.diffusers_names().map(String::from).collect(),
        };
        // only the shapes `detect` reads need to be right
        let shape = |n: &str| -> Vec<i64> {
            if n.contains("norm_q") || n.contains("query_norm") {
                vec![c.attention_head_dim]
            } else if n.ends_with("img_in.weight") || n.ends_with("x_embedder.weight") {
                vec![d, c.in_channels]
            } else if n.ends_with("txt_in.weight") || n.ends_with("context_embedder.weight") {
                vec![d, c.joint_attention_dim]
            } else if n.contains("vector_in.in_layer.weight")
                || n.contains("text_embedder.linear_1.weight")
            {
                vec![d, c.pooled_projection_dim]
            } else if n == "final_layer.linear.weight" || n == "proj_out.weight" {
                vec![c.proj_out_dim(), d]
            } else {
                vec![d]
            }
        };
        names
            .iter()
            .map(|n| (format!("{prefix}{n}"), shape(n)))
            .collect()
    }

    #[test]
    fn detection_reads_layout_prefix_variant_and_shape() {
        let cases = [
            (FluxConfig::dev(), FluxLayout::Bfl, "model.diffusion_model."),
            (FluxConfig::schnell(), FluxLayout::Bfl, ""),
            (
                FluxConfig {
                    num_layers: 0,
                    num_single_layers: 3,
                    ..FluxConfig::schnell()
                },
                FluxLayout::Diffusers,
                "transformer.",
            ),
            (
                FluxConfig {
                    num_layers: 2,
                    num_single_layers: 1,
                    ..FluxConfig::dev()
                },
                FluxLayout::Diffusers,
                "",
            ),
        ];
        for (c, layout, prefix) in cases {
            let ck = checkpoint(&c, layout, prefix);
            let shapes: std::collections::HashMap<&str, &Vec<i64>> =
                ck.iter().map(|(n, s)| (n.as_str(), s)).collect();
            let info = FluxCheckpointInfo::detect(
                Path::new("x.safetensors"),
                ck.iter().map(|(n, _)| n.as_str()),
                |n| shapes.get(n).map(|s| (*s).clone()),
                None,
            )
            .unwrap();
            assert_eq!(info.layout, layout);
            assert_eq!(info.prefix, prefix);
            assert_eq!(info.config, c, "{layout:?} {prefix:?}");
        }
        let e = FluxCheckpointInfo::detect(
            Path::new("unet.safetensors"),
            ["conv_in.weight"],
            |_| None,
            None,
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("unet.safetensors") && e.contains("conv_in.weight"),
            "{e}"
        );
    }

    #[test]
    fn validation_names_the_rope_axes() {
        let c = FluxConfig {
            axes_dims_rope: vec![16, 56, 54],
            ..FluxConfig::dev()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("axes_dims_rope"), "{e}");
    }
}
