//! `CLIPTextConfig` as transformers writes it to `config.json`
//! (`transformers/models/clip/configuration_clip.py`).

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The activation of the encoder MLP (`hidden_act` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClipActivation {
    /// `quick_gelu`: `x · sigmoid(1.702 x)` (OpenAI CLIP; SD1.x's ViT-L/14 and SDXL's first
    /// encoder). transformers `activations.py::QuickGELUActivation`.
    QuickGelu,
    /// `gelu`: the exact erf GELU (OpenCLIP ViT-H/14 of SD2.x and ViT-bigG/14 of SDXL's
    /// `text_encoder_2`).
    Gelu,
    /// `gelu_new` / `gelu_pytorch_tanh`: the tanh approximation.
    GeluTanh,
}

impl ClipActivation {
    /// Parses transformers' `hidden_act` names.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for other names.
    pub fn from_hf(name: &str) -> Result<Self> {
        match name {
            "quick_gelu" => Ok(Self::QuickGelu),
            "gelu" => Ok(Self::Gelu),
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Ok(Self::GeluTanh),
            other => Err(Error::Unsupported {
                what: "CLIP hidden_act",
                value: other.to_string(),
                hint: "supported: quick_gelu, gelu, gelu_new, gelu_pytorch_tanh".into(),
            }),
        }
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum IdOrList {
    One(i64),
    Many(Vec<i64>),
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default = "d_vocab")]
    vocab_size: i64,
    #[serde(default = "d_hidden")]
    hidden_size: i64,
    #[serde(default = "d_inter")]
    intermediate_size: i64,
    #[serde(default)]
    projection_dim: Option<i64>,
    #[serde(default = "d_layers")]
    num_hidden_layers: i64,
    #[serde(default = "d_heads")]
    num_attention_heads: i64,
    #[serde(default = "d_pos")]
    max_position_embeddings: i64,
    #[serde(default = "d_act")]
    hidden_act: String,
    #[serde(default)]
    layer_norm_eps: Option<f64>,
    #[serde(default)]
    bos_token_id: Option<i64>,
    #[serde(default)]
    eos_token_id: Option<IdOrList>,
    #[serde(default)]
    pad_token_id: Option<i64>,
}

fn d_vocab() -> i64 {
    49408
}
fn d_hidden() -> i64 {
    512
}
fn d_inter() -> i64 {
    2048
}
fn d_layers() -> i64 {
    12
}
fn d_heads() -> i64 {
    8
}
fn d_pos() -> i64 {
    77
}
fn d_act() -> String {
    "quick_gelu".into()
}

/// The CLIP text-encoder configuration (the keys of `config.json`; missing keys take
/// transformers' `CLIPTextConfig` defaults).
///
/// Real values (the `text_encoder*/config.json` of the public checkpoints):
///
/// | key | SD1.x ViT-L/14 (`text_encoder`, also SDXL's first) | SD2.x ViT-H/14 | SDXL ViT-bigG/14 (`text_encoder_2`) |
/// |---|---|---|---|
/// | `hidden_size` | 768 | 1024 | 1280 |
/// | `intermediate_size` | 3072 | 4096 | 5120 |
/// | `num_hidden_layers` | 12 | 23 | 32 |
/// | `num_attention_heads` | 12 | 16 | 20 |
/// | `hidden_act` | `quick_gelu` | `gelu` | `gelu` |
/// | `projection_dim` | 768 | 512 | 1280 |
/// | `vocab_size` / `max_position_embeddings` | 49408 / 77 | 49408 / 77 | 49408 / 77 |
/// | `layer_norm_eps` | 1e-5 | 1e-5 | 1e-5 |
/// | `bos` / `eos` / `pad` token id | 0 / 2 / 1 | 0 / 2 / 1 | 0 / 2 / 1 |
///
/// SD2's `text_encoder` is OpenCLIP ViT-H/14 with its last layer left out (23 of 24), so its
/// `last_hidden_state` is OpenCLIP's penultimate layer, final norm applied.
///
/// The token ids in those files are stale values (the real tokenizer has
/// `<|startoftext|>` = 49406, `<|endoftext|>` = 49407); `eos_token_id == 2` is exactly the case
/// in which transformers pools at the position of the *largest* token id instead (see
/// [`super::ClipTextModel::forward_t`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ClipTextConfig {
    /// Token vocabulary size.
    pub vocab_size: i64,
    /// Width `D` of the residual stream.
    pub hidden_size: i64,
    /// Width of the MLP.
    pub intermediate_size: i64,
    /// Output width of `text_projection` (only [`super::ClipTextModelWithProjection`] uses it);
    /// `None` = `hidden_size`.
    pub projection_dim: Option<i64>,
    /// Number of encoder layers.
    pub num_hidden_layers: i64,
    /// Number of attention heads (`head_dim = hidden_size / num_attention_heads`).
    pub num_attention_heads: i64,
    /// Maximum sequence length (77 for every SD checkpoint).
    pub max_position_embeddings: i64,
    /// The MLP activation.
    pub hidden_act: ClipActivation,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// `bos_token_id` (informational).
    pub bos_token_id: i64,
    /// `eos_token_id`: selects the pooling rule (2 = position of the maximal token id).
    pub eos_token_id: i64,
    /// `pad_token_id` (informational; padding is the tokenizer's business).
    pub pad_token_id: i64,
}

impl ClipTextConfig {
    /// SD1.x's ViT-L/14 text encoder (`openai/clip-vit-large-patch14`, as in
    /// `runwayml/stable-diffusion-v1-5/text_encoder/config.json`).
    pub fn sd15() -> Self {
        Self {
            vocab_size: 49408,
            hidden_size: 768,
            intermediate_size: 3072,
            projection_dim: Some(768),
            num_hidden_layers: 12,
            num_attention_heads: 12,
            max_position_embeddings: 77,
            hidden_act: ClipActivation::QuickGelu,
            layer_norm_eps: 1e-5,
            bos_token_id: 0,
            eos_token_id: 2,
            pad_token_id: 1,
        }
    }

    /// SDXL's `text_encoder_2`: OpenCLIP ViT-bigG/14
    /// (`stabilityai/stable-diffusion-xl-base-1.0/text_encoder_2/config.json`).
    pub fn sdxl_bigg() -> Self {
        Self {
            hidden_size: 1280,
            intermediate_size: 5120,
            projection_dim: Some(1280),
            num_hidden_layers: 32,
            num_attention_heads: 20,
            hidden_act: ClipActivation::Gelu,
            ..Self::sd15()
        }
    }

    /// Parses a `config.json` text (`path` is for messages).
    ///
    /// # Errors
    /// [`Error::Config`] for invalid JSON or inconsistent values (hidden size not divisible by
    /// the head count, non-positive sizes); [`Error::Unsupported`] for an unknown `hidden_act`.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let eos = match raw.eos_token_id {
            None => 49407,
            Some(IdOrList::One(i)) => i,
            Some(IdOrList::Many(v)) => v.first().copied().ok_or_else(|| Error::Config {
                path: path.to_path_buf(),
                msg: "`eos_token_id` is an empty list".into(),
            })?,
        };
        let cfg = Self {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            projection_dim: raw.projection_dim,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            max_position_embeddings: raw.max_position_embeddings,
            hidden_act: ClipActivation::from_hf(&raw.hidden_act)?,
            layer_norm_eps: raw.layer_norm_eps.unwrap_or(1e-5),
            bos_token_id: raw.bos_token_id.unwrap_or(49406),
            eos_token_id: eos,
            pad_token_id: raw.pad_token_id.unwrap_or(1),
        };
        cfg.validate().map_err(|msg| Error::Config {
            path: path.to_path_buf(),
            msg,
        })?;
        Ok(cfg)
    }

    /// Reads `config.json` (a `CLIPTextConfig`; a full `CLIPConfig` is read through its
    /// `text_config` object).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; as [`ClipTextConfig::from_json_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        match v.get("text_config") {
            Some(tc) => Self::from_json_str(&tc.to_string(), path),
            None => Self::from_json_str(&text, path),
        }
    }

    /// Checks sizes; returns what is wrong.
    fn validate(&self) -> std::result::Result<(), String> {
        let sizes = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (k, v) in sizes {
            if v <= 0 {
                return Err(format!("`{k}` must be positive, got {v}"));
            }
        }
        if self.hidden_size % self.num_attention_heads != 0 {
            return Err(format!(
                "`hidden_size` {} is not divisible by `num_attention_heads` {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if let Some(p) = self.projection_dim
            && p <= 0
        {
            return Err(format!("`projection_dim` must be positive, got {p}"));
        }
        Ok(())
    }

    /// `hidden_size / num_attention_heads`.
    pub fn head_dim(&self) -> i64 {
        self.hidden_size / self.num_attention_heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sd15_style_config_and_rejects_bad_values() {
        let text = r#"{"architectures":["CLIPTextModel"],"hidden_act":"quick_gelu",
            "hidden_size":768,"intermediate_size":3072,"num_attention_heads":12,
            "num_hidden_layers":12,"projection_dim":768,"bos_token_id":0,"eos_token_id":2,
            "pad_token_id":1,"torch_dtype":"float32","vocab_size":49408}"#;
        let c = ClipTextConfig::from_json_str(text, Path::new("config.json")).unwrap();
        assert_eq!(c, ClipTextConfig::sd15());
        let bad = r#"{"hidden_size":30,"num_attention_heads":4}"#;
        let e = ClipTextConfig::from_json_str(bad, Path::new("x.json")).unwrap_err();
        assert!(e.to_string().contains("not divisible"), "{e}");
        let act = r#"{"hidden_act":"relu"}"#;
        assert!(ClipTextConfig::from_json_str(act, Path::new("x.json")).is_err());
        let list = r#"{"eos_token_id":[7, 8]}"#;
        let c = ClipTextConfig::from_json_str(list, Path::new("x.json")).unwrap();
        assert_eq!(c.eos_token_id, 7);
    }
}
