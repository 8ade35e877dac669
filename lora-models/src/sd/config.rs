//! The configurations of the SD models: diffusers' `UNet2DConditionModel` and `AutoencoderKL`
//! `config.json` files (every key of diffusers 0.42.1, its constructors' defaults, named
//! presets), their validation, and the per-level numbers the models are built from.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::load::read_config_json;
use crate::error::{Error, Result};

/// An integer or one integer per level (`attention_head_dim`, `layers_per_block`, …).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PerLevel {
    /// The same value for every level.
    One(i64),
    /// One value per level (down-block order).
    List(Vec<i64>),
}

impl PerLevel {
    /// The value of each of `n` levels.
    fn expand(&self, n: usize, key: &str) -> std::result::Result<Vec<i64>, String> {
        match self {
            PerLevel::One(v) => Ok(vec![*v; n]),
            PerLevel::List(v) if v.len() == n => Ok(v.clone()),
            PerLevel::List(v) => Err(format!(
                "`{key}` has {} entries, expected one per block ({n})",
                v.len()
            )),
        }
    }
}

/// A flag or one flag per level (`only_cross_attention`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum FlagPerLevel {
    /// One flag for all levels.
    One(bool),
    /// One flag per level.
    List(Vec<bool>),
}

/// A diffusers `UNet2DConditionModel` `config.json` (every key of diffusers 0.42.1; defaults are
/// diffusers' constructor defaults). Keys starting with `_` (`_class_name`, `_diffusers_version`)
/// are ignored; any other unknown key is an error. Values this crate does not implement (class
/// embeddings, `encoder_hid_dim`, other block types, …) are refused by [`UNetConfig::plan`]
/// with the key named.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(missing_docs)]
pub struct UNetConfig {
    pub sample_size: Option<serde_json::Value>,
    pub in_channels: i64,
    pub out_channels: i64,
    pub center_input_sample: bool,
    pub flip_sin_to_cos: bool,
    pub freq_shift: f64,
    pub down_block_types: Vec<String>,
    pub mid_block_type: Option<String>,
    pub up_block_types: Vec<String>,
    pub only_cross_attention: FlagPerLevel,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: PerLevel,
    pub downsample_padding: i64,
    pub mid_block_scale_factor: f64,
    pub dropout: f64,
    pub act_fn: String,
    pub norm_num_groups: Option<i64>,
    pub norm_eps: f64,
    pub cross_attention_dim: PerLevel,
    pub transformer_layers_per_block: serde_json::Value,
    pub reverse_transformer_layers_per_block: Option<serde_json::Value>,
    pub encoder_hid_dim: Option<i64>,
    pub encoder_hid_dim_type: Option<String>,
    pub attention_head_dim: PerLevel,
    pub num_attention_heads: Option<serde_json::Value>,
    pub dual_cross_attention: bool,
    pub use_linear_projection: bool,
    pub class_embed_type: Option<String>,
    pub addition_embed_type: Option<String>,
    pub addition_time_embed_dim: Option<i64>,
    pub num_class_embeds: Option<i64>,
    pub upcast_attention: bool,
    pub resnet_time_scale_shift: String,
    pub resnet_skip_time_act: bool,
    pub resnet_out_scale_factor: f64,
    pub time_embedding_type: String,
    pub time_embedding_dim: Option<i64>,
    pub time_embedding_act_fn: Option<String>,
    pub timestep_post_act: Option<String>,
    pub time_cond_proj_dim: Option<i64>,
    pub conv_in_kernel: i64,
    pub conv_out_kernel: i64,
    pub projection_class_embeddings_input_dim: Option<i64>,
    pub attention_type: String,
    pub class_embeddings_concat: bool,
    pub mid_block_only_cross_attention: Option<bool>,
    pub cross_attention_norm: Option<String>,
    pub addition_embed_type_num_heads: i64,
}

impl Default for UNetConfig {
    fn default() -> Self {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        Self {
            sample_size: None,
            in_channels: 4,
            out_channels: 4,
            center_input_sample: false,
            flip_sin_to_cos: true,
            freq_shift: 0.0,
            down_block_types: s(&[
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
                "DownBlock2D",
            ]),
            mid_block_type: Some("UNetMidBlock2DCrossAttn".into()),
            up_block_types: s(&[
                "UpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
                "CrossAttnUpBlock2D",
            ]),
            only_cross_attention: FlagPerLevel::One(false),
            block_out_channels: vec![320, 640, 1280, 1280],
            layers_per_block: PerLevel::One(2),
            downsample_padding: 1,
            mid_block_scale_factor: 1.0,
            dropout: 0.0,
            act_fn: "silu".into(),
            norm_num_groups: Some(32),
            norm_eps: 1e-5,
            cross_attention_dim: PerLevel::One(1280),
            transformer_layers_per_block: serde_json::Value::from(1),
            reverse_transformer_layers_per_block: None,
            encoder_hid_dim: None,
            encoder_hid_dim_type: None,
            attention_head_dim: PerLevel::One(8),
            num_attention_heads: None,
            dual_cross_attention: false,
            use_linear_projection: false,
            class_embed_type: None,
            addition_embed_type: None,
            addition_time_embed_dim: None,
            num_class_embeds: None,
            upcast_attention: false,
            resnet_time_scale_shift: "default".into(),
            resnet_skip_time_act: false,
            resnet_out_scale_factor: 1.0,
            time_embedding_type: "positional".into(),
            time_embedding_dim: None,
            time_embedding_act_fn: None,
            timestep_post_act: None,
            time_cond_proj_dim: None,
            conv_in_kernel: 3,
            conv_out_kernel: 3,
            projection_class_embeddings_input_dim: None,
            attention_type: "default".into(),
            class_embeddings_concat: false,
            mid_block_only_cross_attention: None,
            cross_attention_norm: None,
            addition_embed_type_num_heads: 64,
        }
    }
}

/// The derived per-level numbers the model is built from.
#[derive(Debug, Clone, PartialEq)]
pub struct UNetPlan {
    /// Channels per level.
    pub channels: Vec<i64>,
    /// ResNets per down level.
    pub layers: Vec<i64>,
    /// Whether each down level has cross-attention transformers.
    pub down_attn: Vec<bool>,
    /// Whether each up level (lowest resolution first) has transformers.
    pub up_attn: Vec<bool>,
    /// Heads per level (down order), see the module docs on `attention_head_dim`.
    pub heads: Vec<i64>,
    /// Transformer blocks per `Transformer2DModel`, per level (down order).
    pub transformer_layers: Vec<i64>,
    /// Cross-attention context width per level.
    pub cross_attention_dim: Vec<i64>,
    /// GroupNorm groups.
    pub groups: i64,
    /// Time-embedding width (`4 · block_out_channels[0]`).
    pub time_embed_dim: i64,
    /// SDXL `text_time` additional embedding: `(addition_time_embed_dim, projection_class_embeddings_input_dim)`.
    pub text_time: Option<(i64, i64)>,
}

fn unsupported(key: &str, value: impl std::fmt::Debug, hint: &str) -> Error {
    Error::Unsupported {
        what: "UNet2DConditionModel config value",
        value: format!("{key} = {value:?}"),
        hint: hint.to_string(),
    }
}

impl UNetConfig {
    /// Parses a `config.json` object: `_`-prefixed keys are dropped, unknown keys are an error
    /// naming the key.
    ///
    /// # Errors
    /// [`Error::Config`] with the file and the offending key.
    pub fn from_json(
        path: &Path,
        mut obj: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        obj.retain(|k, _| !k.starts_with('_'));
        serde_json::from_value(serde_json::Value::Object(obj)).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: format!("{e} (UNet2DConditionModel keys of diffusers 0.42.1 are accepted)"),
        })
    }

    /// Reads `<dir>/config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`].
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(path, read_config_json(path)?)
    }

    /// SD 1.5's UNet config (`runwayml/stable-diffusion-v1-5/unet/config.json`): 4 levels of
    /// `[320, 640, 1280, 1280]`, `layers_per_block` 2, `attention_head_dim` 8 (8 heads),
    /// `cross_attention_dim` 768, conv `proj_in`/`proj_out`, `sample_size` 64.
    pub fn sd15() -> Self {
        Self {
            sample_size: Some(64.into()),
            cross_attention_dim: PerLevel::One(768),
            ..Self::default()
        }
    }

    /// SDXL base's UNet config (`stabilityai/stable-diffusion-xl-base-1.0/unet/config.json`):
    /// levels `[320, 640, 1280]` (`DownBlock2D`, then two `CrossAttnDownBlock2D`),
    /// `attention_head_dim` `[5, 10, 20]`, `transformer_layers_per_block` `[1, 2, 10]`,
    /// `cross_attention_dim` 2048, `use_linear_projection`, `addition_embed_type` `"text_time"`,
    /// `addition_time_embed_dim` 256, `projection_class_embeddings_input_dim` 2816
    /// (= 1280 pooled text + 6 · 256), `sample_size` 128.
    pub fn sdxl_base() -> Self {
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        Self {
            sample_size: Some(128.into()),
            down_block_types: s(&[
                "DownBlock2D",
                "CrossAttnDownBlock2D",
                "CrossAttnDownBlock2D",
            ]),
            up_block_types: s(&["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]),
            block_out_channels: vec![320, 640, 1280],
            cross_attention_dim: PerLevel::One(2048),
            attention_head_dim: PerLevel::List(vec![5, 10, 20]),
            transformer_layers_per_block: serde_json::json!([1, 2, 10]),
            use_linear_projection: true,
            addition_embed_type: Some("text_time".into()),
            addition_time_embed_dim: Some(256),
            projection_class_embeddings_input_dim: Some(2816),
            ..Self::default()
        }
    }

    /// Checks every value against what this crate implements and derives the per-level plan.
    ///
    /// # Errors
    /// [`Error::Unsupported`] naming the key and value; [`Error::InvalidArgument`] for
    /// inconsistent lengths.
    pub fn plan(&self) -> Result<UNetPlan> {
        let n = self.block_out_channels.len();
        let bad = |m: String| Error::InvalidArgument(format!("UNet config: {m}"));
        if n == 0 || self.down_block_types.len() != n || self.up_block_types.len() != n {
            return Err(bad(format!(
                "`down_block_types` ({}), `up_block_types` ({}) and `block_out_channels` ({n}) must have the same non-zero length",
                self.down_block_types.len(),
                self.up_block_types.len()
            )));
        }
        let down_attn = self
            .down_block_types
            .iter()
            .map(|t| match t.as_str() {
                "CrossAttnDownBlock2D" => Ok(true),
                "DownBlock2D" => Ok(false),
                other => Err(unsupported(
                    "down_block_types",
                    other,
                    "supported: CrossAttnDownBlock2D, DownBlock2D",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        let up_attn = self
            .up_block_types
            .iter()
            .map(|t| match t.as_str() {
                "CrossAttnUpBlock2D" => Ok(true),
                "UpBlock2D" => Ok(false),
                other => Err(unsupported(
                    "up_block_types",
                    other,
                    "supported: CrossAttnUpBlock2D, UpBlock2D",
                )),
            })
            .collect::<Result<Vec<_>>>()?;
        match self.mid_block_type.as_deref() {
            Some("UNetMidBlock2DCrossAttn") => {}
            other => {
                return Err(unsupported(
                    "mid_block_type",
                    other,
                    "supported: UNetMidBlock2DCrossAttn",
                ));
            }
        }
        if self
            .num_attention_heads
            .as_ref()
            .is_some_and(|v| !v.is_null())
        {
            return Err(unsupported(
                "num_attention_heads",
                &self.num_attention_heads,
                "diffusers' UNet2DConditionModel refuses it too; give the head count as `attention_head_dim`",
            ));
        }
        let checks: [(&str, bool, String); 22] = [
            (
                "center_input_sample",
                !self.center_input_sample,
                format!("{}", self.center_input_sample),
            ),
            (
                "only_cross_attention",
                matches!(&self.only_cross_attention, FlagPerLevel::One(false))
                    || matches!(&self.only_cross_attention, FlagPerLevel::List(v) if v.iter().all(|b| !b)),
                format!("{:?}", self.only_cross_attention),
            ),
            ("act_fn", self.act_fn == "silu", self.act_fn.clone()),
            (
                "reverse_transformer_layers_per_block",
                self.reverse_transformer_layers_per_block
                    .as_ref()
                    .is_none_or(|v| v.is_null()),
                format!("{:?}", self.reverse_transformer_layers_per_block),
            ),
            (
                "encoder_hid_dim",
                self.encoder_hid_dim.is_none(),
                format!("{:?}", self.encoder_hid_dim),
            ),
            (
                "encoder_hid_dim_type",
                self.encoder_hid_dim_type.is_none(),
                format!("{:?}", self.encoder_hid_dim_type),
            ),
            (
                "dual_cross_attention",
                !self.dual_cross_attention,
                format!("{}", self.dual_cross_attention),
            ),
            (
                "class_embed_type",
                self.class_embed_type.is_none(),
                format!("{:?}", self.class_embed_type),
            ),
            (
                "num_class_embeds",
                self.num_class_embeds.is_none(),
                format!("{:?}", self.num_class_embeds),
            ),
            (
                "resnet_time_scale_shift",
                self.resnet_time_scale_shift == "default",
                self.resnet_time_scale_shift.clone(),
            ),
            (
                "resnet_skip_time_act",
                !self.resnet_skip_time_act,
                format!("{}", self.resnet_skip_time_act),
            ),
            (
                "resnet_out_scale_factor",
                self.resnet_out_scale_factor == 1.0,
                format!("{}", self.resnet_out_scale_factor),
            ),
            (
                "time_embedding_type",
                self.time_embedding_type == "positional",
                self.time_embedding_type.clone(),
            ),
            (
                "time_embedding_dim",
                self.time_embedding_dim.is_none(),
                format!("{:?}", self.time_embedding_dim),
            ),
            (
                "time_embedding_act_fn",
                self.time_embedding_act_fn.is_none(),
                format!("{:?}", self.time_embedding_act_fn),
            ),
            (
                "timestep_post_act",
                self.timestep_post_act.is_none(),
                format!("{:?}", self.timestep_post_act),
            ),
            (
                "time_cond_proj_dim",
                self.time_cond_proj_dim.is_none(),
                format!("{:?}", self.time_cond_proj_dim),
            ),
            (
                "conv_in_kernel",
                self.conv_in_kernel == 3,
                format!("{}", self.conv_in_kernel),
            ),
            (
                "conv_out_kernel",
                self.conv_out_kernel == 3,
                format!("{}", self.conv_out_kernel),
            ),
            (
                "attention_type",
                self.attention_type == "default",
                self.attention_type.clone(),
            ),
            (
                "class_embeddings_concat",
                !self.class_embeddings_concat,
                format!("{}", self.class_embeddings_concat),
            ),
            (
                "cross_attention_norm",
                self.cross_attention_norm.is_none(),
                format!("{:?}", self.cross_attention_norm),
            ),
        ];
        for (key, ok, value) in checks {
            if !ok {
                return Err(unsupported(
                    key,
                    value,
                    "only the SD 1.x / 2.x / SDXL value (diffusers' default) is implemented",
                ));
            }
        }
        if self.mid_block_only_cross_attention == Some(true) {
            return Err(unsupported(
                "mid_block_only_cross_attention",
                true,
                "only false/null is implemented",
            ));
        }
        let text_time = match self.addition_embed_type.as_deref() {
            None => None,
            Some("text_time") => {
                let t = self.addition_time_embed_dim.ok_or_else(|| {
                    bad("`addition_embed_type: text_time` needs `addition_time_embed_dim`".into())
                })?;
                let p = self.projection_class_embeddings_input_dim.ok_or_else(|| {
                    bad("`addition_embed_type: text_time` needs `projection_class_embeddings_input_dim`".into())
                })?;
                Some((t, p))
            }
            Some(other) => {
                return Err(unsupported(
                    "addition_embed_type",
                    other,
                    "supported: null, \"text_time\" (SDXL)",
                ));
            }
        };
        let layers = self
            .layers_per_block
            .expand(n, "layers_per_block")
            .map_err(bad)?;
        if layers.iter().any(|&l| l != layers[0]) {
            return Err(unsupported(
                "layers_per_block",
                &layers,
                "one value for all levels is implemented",
            ));
        }
        let heads = self
            .attention_head_dim
            .expand(n, "attention_head_dim")
            .map_err(bad)?;
        let cross_attention_dim = self
            .cross_attention_dim
            .expand(n, "cross_attention_dim")
            .map_err(bad)?;
        let transformer_layers = match &self.transformer_layers_per_block {
            serde_json::Value::Number(v) => vec![v.as_i64().unwrap_or(1); n],
            serde_json::Value::Array(v) if v.len() == n && v.iter().all(|x| x.is_i64()) => {
                v.iter().map(|x| x.as_i64().unwrap_or(1)).collect()
            }
            other => {
                return Err(unsupported(
                    "transformer_layers_per_block",
                    other,
                    "an integer or one integer per level is implemented (per-layer nested lists are not)",
                ));
            }
        };
        let groups = self.norm_num_groups.ok_or_else(|| {
            unsupported("norm_num_groups", "null", "a group count (32) is required")
        })?;
        for (i, (&c, &h)) in self.block_out_channels.iter().zip(&heads).enumerate() {
            if h <= 0 || c % h != 0 {
                return Err(bad(format!(
                    "level {i}: block_out_channels {c} is not divisible by attention_head_dim (= heads) {h}"
                )));
            }
        }
        Ok(UNetPlan {
            channels: self.block_out_channels.clone(),
            layers,
            down_attn,
            up_attn,
            heads,
            transformer_layers,
            cross_attention_dim,
            groups,
            time_embed_dim: 4 * self.block_out_channels[0],
            text_time,
        })
    }
}

/// A diffusers `AutoencoderKL` `config.json` (all keys of 0.42.1; defaults are the constructor's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[allow(missing_docs)]
pub struct VaeConfig {
    pub in_channels: i64,
    pub out_channels: i64,
    pub down_block_types: Vec<String>,
    pub up_block_types: Vec<String>,
    pub block_out_channels: Vec<i64>,
    pub layers_per_block: i64,
    pub act_fn: String,
    pub latent_channels: i64,
    pub norm_num_groups: i64,
    pub sample_size: Option<serde_json::Value>,
    pub scaling_factor: f64,
    pub shift_factor: Option<f64>,
    pub latents_mean: Option<serde_json::Value>,
    pub latents_std: Option<serde_json::Value>,
    pub force_upcast: bool,
    pub use_quant_conv: bool,
    pub use_post_quant_conv: bool,
    pub mid_block_add_attention: bool,
}

impl Default for VaeConfig {
    fn default() -> Self {
        Self {
            in_channels: 3,
            out_channels: 3,
            down_block_types: vec!["DownEncoderBlock2D".into()],
            up_block_types: vec!["UpDecoderBlock2D".into()],
            block_out_channels: vec![64],
            layers_per_block: 1,
            act_fn: "silu".into(),
            latent_channels: 4,
            norm_num_groups: 32,
            sample_size: None,
            scaling_factor: 0.18215,
            shift_factor: None,
            latents_mean: None,
            latents_std: None,
            force_upcast: true,
            use_quant_conv: true,
            use_post_quant_conv: true,
            mid_block_add_attention: true,
        }
    }
}

impl VaeConfig {
    /// The SD 1.x / 2.x VAE (`runwayml/stable-diffusion-v1-5/vae/config.json`): block channels
    /// `[128, 256, 512, 512]`, `layers_per_block` 2, 4 latent channels, `scaling_factor` 0.18215,
    /// `sample_size` 512.
    pub fn sd15() -> Self {
        Self {
            down_block_types: vec!["DownEncoderBlock2D".into(); 4],
            up_block_types: vec!["UpDecoderBlock2D".into(); 4],
            block_out_channels: vec![128, 256, 512, 512],
            layers_per_block: 2,
            sample_size: Some(512.into()),
            ..Self::default()
        }
    }

    /// The SDXL VAE: the SD 1.x architecture with `scaling_factor` 0.13025 and `sample_size` 1024.
    pub fn sdxl() -> Self {
        Self {
            scaling_factor: 0.13025,
            sample_size: Some(1024.into()),
            ..Self::sd15()
        }
    }

    /// The FLUX.1 autoencoder (`black-forest-labs/FLUX.1-dev/vae/config.json`, BFL's
    /// `ae.safetensors`): the SD block layout (`[128, 256, 512, 512]`, `layers_per_block` 2) with
    /// 16 latent channels, no `quant_conv` / `post_quant_conv`, `scaling_factor` 0.3611,
    /// `shift_factor` 0.1159 and `sample_size` 1024.
    pub fn flux() -> Self {
        Self {
            latent_channels: 16,
            scaling_factor: 0.3611,
            shift_factor: Some(0.1159),
            use_quant_conv: false,
            use_post_quant_conv: false,
            sample_size: Some(1024.into()),
            ..Self::sd15()
        }
    }

    /// Parses a `config.json` object (`_`-prefixed keys dropped; unknown keys are an error).
    ///
    /// # Errors
    /// [`Error::Config`] naming the file and key.
    pub fn from_json(
        path: &Path,
        mut obj: serde_json::Map<String, serde_json::Value>,
    ) -> Result<Self> {
        obj.retain(|k, _| !k.starts_with('_'));
        serde_json::from_value(serde_json::Value::Object(obj)).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: format!("{e} (AutoencoderKL keys of diffusers 0.42.1 are accepted)"),
        })
    }

    /// Reads a `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`].
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(path, read_config_json(path)?)
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let n = self.block_out_channels.len();
        let unsupported = |key: &str, value: String, hint: &str| Error::Unsupported {
            what: "AutoencoderKL config value",
            value: format!("{key} = {value}"),
            hint: hint.into(),
        };
        if n == 0 || self.down_block_types.len() != n || self.up_block_types.len() != n {
            return Err(Error::InvalidArgument(format!(
                "VAE config: `down_block_types`, `up_block_types` and `block_out_channels` must have the same non-zero length ({n})"
            )));
        }
        if let Some(t) = self
            .down_block_types
            .iter()
            .find(|t| *t != "DownEncoderBlock2D")
        {
            return Err(unsupported(
                "down_block_types",
                t.clone(),
                "supported: DownEncoderBlock2D",
            ));
        }
        if let Some(t) = self
            .up_block_types
            .iter()
            .find(|t| *t != "UpDecoderBlock2D")
        {
            return Err(unsupported(
                "up_block_types",
                t.clone(),
                "supported: UpDecoderBlock2D",
            ));
        }
        if self.act_fn != "silu" {
            return Err(unsupported(
                "act_fn",
                self.act_fn.clone(),
                "supported: silu",
            ));
        }
        if self.latents_mean.as_ref().is_some_and(|v| !v.is_null())
            || self.latents_std.as_ref().is_some_and(|v| !v.is_null())
        {
            return Err(unsupported(
                "latents_mean/latents_std",
                "set".into(),
                "per-channel latent statistics are not implemented (SD 1.x / SDXL VAEs have none)",
            ));
        }
        Ok(())
    }
}
