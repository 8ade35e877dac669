//! `T5Config` as transformers writes it to `config.json`
//! (`transformers/models/t5/configuration_t5.py`), the encoder's part of it.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The feed-forward activation (the last part of `feed_forward_proj`, transformers
/// `T5Config.dense_act_fn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum T5Activation {
    /// `relu` (the original T5 of Raffel et al. 2020).
    Relu,
    /// `gelu`: the exact erf GELU.
    Gelu,
    /// `gelu_new`: the tanh approximation, what `gated-gelu` means (T5 v1.1, T5-XXL of FLUX,
    /// flan-T5). transformers `activations.py::NewGELUActivation`.
    GeluTanh,
    /// `silu` (`gated-silu`).
    Silu,
}

/// The encoder's part of a transformers `T5Config` (missing keys take transformers' defaults;
/// decoder-only keys are ignored).
///
/// `feed_forward_proj` is `"relu"`, `"gelu"`, `"silu"`, or one of them with a `"gated-"` prefix
/// (two input projections `wi_0`, `wi_1` whose product goes into `wo`, Shazeer 2020 "GLU Variants
/// Improve Transformer"); `"gated-gelu"` uses the tanh GELU, as transformers maps it to
/// `gelu_new`.
///
/// T5-XXL (`google/t5-v1_1-xxl`, the text encoder of FLUX.1 as `text_encoder_2/config.json`):
/// [`T5Config::t5_xxl`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct T5Config {
    /// Token vocabulary size (32128 for every public T5).
    pub vocab_size: i64,
    /// Width `D` of the residual stream.
    pub d_model: i64,
    /// Width of one attention head (the attention's inner width is `num_heads · d_kv`, which may
    /// differ from `d_model`).
    pub d_kv: i64,
    /// Width of the feed-forward layer.
    pub d_ff: i64,
    /// Number of encoder blocks.
    pub num_layers: i64,
    /// Number of attention heads.
    pub num_heads: i64,
    /// Buckets of the relative position bias (half per direction in the bidirectional encoder).
    pub relative_attention_num_buckets: i64,
    /// Relative distance from which every position falls into the last bucket.
    pub relative_attention_max_distance: i64,
    /// Epsilon of the RMS norms (`T5LayerNorm`).
    pub layer_norm_epsilon: f64,
    /// `relu`, `gated-gelu`, … (see the type's docs).
    pub feed_forward_proj: String,
    /// Dropout of the original training (unused: the encoder runs without dropout).
    pub dropout_rate: f64,
    /// Padding token id (informational; the tokenizer pads).
    pub pad_token_id: i64,
    /// End-of-sequence token id (informational).
    pub eos_token_id: i64,
    /// Every other key of `config.json` (`architectures`, `num_decoder_layers`, `torch_dtype`,
    /// …), kept as written.
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

impl Default for T5Config {
    /// transformers' `T5Config()` defaults (t5-small).
    fn default() -> Self {
        Self {
            vocab_size: 32128,
            d_model: 512,
            d_kv: 64,
            d_ff: 2048,
            num_layers: 6,
            num_heads: 8,
            relative_attention_num_buckets: 32,
            relative_attention_max_distance: 128,
            layer_norm_epsilon: 1e-6,
            feed_forward_proj: "relu".into(),
            dropout_rate: 0.1,
            pad_token_id: 0,
            eos_token_id: 1,
            extra: serde_json::Map::new(),
        }
    }
}

impl T5Config {
    /// T5 v1.1 XXL (`google/t5-v1_1-xxl/config.json`, also FLUX.1's
    /// `text_encoder_2/config.json` and the architecture of ComfyUI's `t5xxl_fp16.safetensors`):
    /// `d_model` 4096, `d_ff` 10240, 24 layers, 64 heads × 64, `gated-gelu`, vocabulary 32128.
    /// The encoder has 4,762,310,656 parameters ([`T5Config::encoder_param_count`]).
    pub fn t5_xxl() -> Self {
        Self {
            d_model: 4096,
            d_kv: 64,
            d_ff: 10240,
            num_layers: 24,
            num_heads: 64,
            feed_forward_proj: "gated-gelu".into(),
            ..Self::default()
        }
    }

    /// Parses a `config.json` text (`path` is for messages) and checks it.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid JSON or values (non-positive sizes, an unknown
    /// `feed_forward_proj`).
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let cfg: Self = serde_json::from_str(text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        cfg.validate().map_err(|msg| Error::Config {
            path: path.to_path_buf(),
            msg,
        })?;
        Ok(cfg)
    }

    /// Reads and checks `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; as [`T5Config::from_json_str`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Whether the feed-forward layer is gated (`wi_0`, `wi_1`) rather than plain (`wi`).
    pub fn is_gated(&self) -> bool {
        self.feed_forward_proj.starts_with("gated-")
    }

    /// The feed-forward activation (transformers `T5Config.__init__`: the part after `gated-`,
    /// `gated-gelu` meaning `gelu_new`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for other names.
    pub fn activation(&self) -> Result<T5Activation> {
        let p = self.feed_forward_proj.as_str();
        let (gated, act) = match p.strip_prefix("gated-") {
            Some(a) => (true, a),
            None => (false, p),
        };
        match (gated, act) {
            (_, "relu") => Ok(T5Activation::Relu),
            (true, "gelu") | (_, "gelu_new") | (_, "gelu_pytorch_tanh") => {
                Ok(T5Activation::GeluTanh)
            }
            (false, "gelu") => Ok(T5Activation::Gelu),
            (_, "silu") | (_, "swish") => Ok(T5Activation::Silu),
            _ => Err(Error::Unsupported {
                what: "T5 feed_forward_proj",
                value: p.to_string(),
                hint: "supported: relu, gelu, gelu_new, silu, each optionally `gated-`".into(),
            }),
        }
    }

    /// The attention's inner width `num_heads · d_kv`.
    pub fn inner_dim(&self) -> i64 {
        self.num_heads * self.d_kv
    }

    /// The number of parameters of the encoder (`T5EncoderModel`): the shared embedding, per block
    /// q/k/v/o (`4 · D · inner`), the feed-forward (`(2 or 3) · D · d_ff`) and two norms (`2 · D`),
    /// the relative position bias of block 0 (`buckets · heads`) and the final norm (`D`).
    pub fn encoder_param_count(&self) -> i64 {
        let (d, inner) = (self.d_model, self.inner_dim());
        let ff = if self.is_gated() { 3 } else { 2 } * d * self.d_ff;
        let block = 4 * d * inner + ff + 2 * d;
        self.vocab_size * d
            + self.num_layers * block
            + self.relative_attention_num_buckets * self.num_heads
            + d
    }

    /// Checks sizes and the activation; returns what is wrong.
    fn validate(&self) -> std::result::Result<(), String> {
        for (k, v) in [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("d_kv", self.d_kv),
            ("d_ff", self.d_ff),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            (
                "relative_attention_num_buckets",
                self.relative_attention_num_buckets,
            ),
            (
                "relative_attention_max_distance",
                self.relative_attention_max_distance,
            ),
        ] {
            if v <= 0 {
                return Err(format!("`{k}` must be positive, got {v}"));
            }
        }
        if self.relative_attention_num_buckets < 4 {
            return Err(format!(
                "`relative_attention_num_buckets` must be at least 4 (half per direction, half of \
                 those exact), got {}",
                self.relative_attention_num_buckets
            ));
        }
        self.activation().map(|_| ()).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_t5_v1_1_xxl_config() {
        // google/t5-v1_1-xxl/config.json (as FLUX.1's text_encoder_2/config.json)
        let text = r#"{"architectures":["T5EncoderModel"],"d_ff":10240,"d_kv":64,
            "d_model":4096,"decoder_start_token_id":0,"dense_act_fn":"gelu_new",
            "dropout_rate":0.1,"eos_token_id":1,"feed_forward_proj":"gated-gelu",
            "initializer_factor":1.0,"is_encoder_decoder":true,"is_gated_act":true,
            "layer_norm_epsilon":1e-06,"model_type":"t5","num_decoder_layers":24,"num_heads":64,
            "num_layers":24,"output_past":true,"pad_token_id":0,
            "relative_attention_max_distance":128,"relative_attention_num_buckets":32,
            "tie_word_embeddings":false,"torch_dtype":"bfloat16","use_cache":true,
            "vocab_size":32128}"#;
        let c = T5Config::from_json_str(text, Path::new("config.json")).unwrap();
        let x = T5Config::t5_xxl();
        assert_eq!(
            (
                c.d_model,
                c.d_ff,
                c.num_layers,
                c.num_heads,
                c.d_kv,
                c.vocab_size
            ),
            (
                x.d_model,
                x.d_ff,
                x.num_layers,
                x.num_heads,
                x.d_kv,
                x.vocab_size
            )
        );
        assert_eq!(c.activation().unwrap(), T5Activation::GeluTanh);
        assert!(c.is_gated());
        assert_eq!(c.extra["num_decoder_layers"], 24);
        assert_eq!(x.encoder_param_count(), 4_762_310_656);
        let bad = r#"{"feed_forward_proj":"gated-tanh"}"#;
        let e = T5Config::from_json_str(bad, Path::new("x.json")).unwrap_err();
        assert!(e.to_string().contains("gated-tanh"), "{e}");
        let bad = r#"{"num_heads":0}"#;
        assert!(T5Config::from_json_str(bad, Path::new("x.json")).is_err());
        let relu = T5Config::default();
        assert_eq!(relu.activation().unwrap(), T5Activation::Relu);
        assert!(!relu.is_gated());
    }
}
