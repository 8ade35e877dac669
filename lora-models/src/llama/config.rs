//! The LLaMA-family configuration, from HF `config.json` or GGUF metadata.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Rotary-embedding frequency scaling (HF `rope_scaling` / `rope_parameters`).
///
/// Formulas from transformers' `modeling_rope_utils.py` (`_compute_linear_scaling_rope_parameters`,
/// `_compute_llama3_parameters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = θ^(−2i/d)`.
    Default,
    /// Position interpolation: `inv_freq / factor`.
    Linear {
        /// The interpolation factor (> 0).
        factor: f64,
    },
    /// Llama 3.1's piecewise scaling: wavelengths longer than
    /// `original_max_position_embeddings / low_freq_factor` are divided by `factor`, shorter than
    /// `… / high_freq_factor` kept, and the band between interpolated smoothly.
    Llama3 {
        /// Divisor for low frequencies (8 for Llama 3.1).
        factor: f64,
        /// 1 for Llama 3.1.
        low_freq_factor: f64,
        /// 4 for Llama 3.1.
        high_freq_factor: f64,
        /// The pre-training context (8192 for Llama 3.1).
        original_max_position_embeddings: f64,
    },
}

/// A LLaMA-family decoder configuration; field names and defaults are HF `LlamaConfig`'s
/// (`transformers/models/llama/configuration_llama.py`). Qwen2 (`model_type = "qwen2"`: q/k/v
/// bias) and Qwen3 (`"qwen3"`: per-head RMSNorm of q and k) and Mistral (`"mistral"`, without
/// sliding-window attention) are variants of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// `llama`, `mistral`, `qwen2`, `qwen3` or `smollm` (treated as `llama`).
    #[serde(default = "default_model_type")]
    pub model_type: String,
    /// Number of token ids.
    pub vocab_size: i64,
    /// Model width `d`.
    pub hidden_size: i64,
    /// SwiGLU inner width.
    pub intermediate_size: i64,
    /// Number of decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (GQA); `None` = `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<i64>,
    /// Per-head width; `None` = `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<i64>,
    /// RMSNorm ε (HF default 1e-6).
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base θ (HF default 10000).
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// RoPE scaling; `None` = plain RoPE.
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Maximum context.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: i64,
    /// Whether the output head reuses `model.embed_tokens.weight`.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v/o projections (Llama); Qwen2 has q/k/v bias whatever this says.
    #[serde(default)]
    pub attention_bias: bool,
    /// Bias on the MLP projections.
    #[serde(default)]
    pub mlp_bias: bool,
    /// Activation; only `silu` is supported.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Beginning-of-sequence id.
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    /// End-of-sequence ids (HF allows one id or a list).
    #[serde(default, deserialize_with = "one_or_many")]
    pub eos_token_id: Vec<i64>,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> i64 {
    2048
}
fn default_act() -> String {
    "silu".into()
}

fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Vec<i64>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(i64),
        Many(Vec<i64>),
        Null(()),
    }
    Ok(match OneOrMany::deserialize(d)? {
        OneOrMany::One(x) => vec![x],
        OneOrMany::Many(v) => v,
        OneOrMany::Null(()) => vec![],
    })
}

impl LlamaConfig {
    /// SmolLM2-135M(-Instruct): 30 layers, d 576, 9 query / 3 kv heads of 64, SwiGLU 1536,
    /// θ 100000, ε 1e-5, vocab 49152, tied embeddings (HF `HuggingFaceTB/SmolLM2-135M-Instruct`
    /// config.json, confirmed by the GGUF metadata in `ASSETS.md`).
    pub fn smollm2_135m() -> Self {
        Self {
            model_type: "llama".into(),
            vocab_size: 49152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: Some(3),
            head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 100000.0,
            rope_scaling: None,
            max_position_embeddings: 8192,
            tie_word_embeddings: true,
            attention_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            bos_token_id: Some(1),
            eos_token_id: vec![2],
        }
    }

    /// Key/value heads.
    pub fn n_kv_heads(&self) -> i64 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width.
    pub fn head_dim(&self) -> i64 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Whether q/k/v projections carry a bias (Qwen2 always; others per `attention_bias`).
    pub fn qkv_bias(&self) -> bool {
        self.attention_bias || self.model_type == "qwen2"
    }

    /// Whether the output projection carries a bias.
    pub fn o_bias(&self) -> bool {
        self.attention_bias && self.model_type != "qwen2"
    }

    /// Whether q and k go through a per-head RMSNorm before RoPE (Qwen3).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3"
    }

    /// Checks the numbers are consistent.
    ///
    /// # Errors
    /// [`Error::Config`] naming the offending field.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| {
            Err(Error::Config {
                path: "<config>".into(),
                msg,
            })
        };
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.n_kv_heads()),
            ("head_dim", self.head_dim()),
        ] {
            if v <= 0 {
                return bad(format!("{name} = {v} must be positive"));
            }
        }
        if self.num_attention_heads % self.n_kv_heads() != 0 {
            return bad(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.n_kv_heads()
            ));
        }
        if self.head_dim() % 2 != 0 {
            return bad(format!(
                "head_dim {} must be even for RoPE",
                self.head_dim()
            ));
        }
        if self.hidden_act != "silu" {
            return Err(Error::Unsupported {
                what: "hidden_act",
                value: self.hidden_act.clone(),
                hint: "the LLaMA family uses `silu` (SwiGLU)".into(),
            });
        }
        if !matches!(
            self.model_type.as_str(),
            "llama" | "mistral" | "qwen2" | "qwen3" | "smollm"
        ) {
            return Err(Error::Unsupported {
                what: "model_type",
                value: self.model_type.clone(),
                hint: "supported: llama, mistral, qwen2, qwen3".into(),
            });
        }
        Ok(())
    }

    /// Parses an HF `config.json` (text). Accepts both the classic `rope_theta` + `rope_scaling`
    /// (with `type` or `rope_type`) and transformers 5's `rope_parameters`.
    ///
    /// # Errors
    /// [`Error::Config`] for invalid JSON, missing fields or an unknown rope type.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let err = |msg: String| Error::Config {
            path: path.to_path_buf(),
            msg,
        };
        let mut v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
        if let Some(obj) = v.as_object_mut() {
            // transformers ≥ 5: rope_parameters {rope_type, rope_theta, factor, …}
            let rope = obj
                .remove("rope_parameters")
                .or_else(|| obj.remove("rope_scaling"));
            if let Some(serde_json::Value::Object(mut r)) = rope {
                if let Some(theta) = r.remove("rope_theta") {
                    obj.insert("rope_theta".into(), theta);
                }
                if let Some(t) = r.remove("type") {
                    r.entry("rope_type").or_insert(t);
                }
                let ty = r
                    .get("rope_type")
                    .and_then(|t| t.as_str())
                    .unwrap_or("default")
                    .to_string();
                if !matches!(ty.as_str(), "default" | "linear" | "llama3") {
                    return Err(Error::Unsupported {
                        what: "rope_type",
                        value: ty,
                        hint: "supported: default, linear, llama3".into(),
                    });
                }
                if ty != "default" {
                    obj.insert("rope_scaling".into(), serde_json::Value::Object(r));
                }
            }
        }
        let cfg: Self = serde_json::from_value(v).map_err(|e| err(e.to_string()))?;
        cfg.validate().map_err(|e| match e {
            Error::Config { msg, .. } => err(msg),
            e => e,
        })?;
        Ok(cfg)
    }

    /// Reads an HF `config.json`.
    ///
    /// # Errors
    /// [`Error::Io`] when unreadable; otherwise as [`LlamaConfig::from_json_str`].
    pub fn from_hf_json(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json_str(&text, path)
    }

    /// Builds the configuration from GGUF metadata (`{arch}.*` keys of llama.cpp's
    /// `LLM_KV_*` table: `block_count`, `embedding_length`, `feed_forward_length`,
    /// `attention.head_count(_kv)`, `attention.layer_norm_rms_epsilon`, `attention.key_length`,
    /// `rope.freq_base`, `rope.scaling.{type,factor,original_context_length}`, `context_length`,
    /// `vocab_size`); `architecture` = `llama`, `qwen2` or `qwen3`. Tied embeddings = no
    /// `output.weight` tensor.
    ///
    /// # Errors
    /// [`Error::Metadata`] for missing keys, [`Error::Unsupported`] for other architectures.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let arch = g.get_str("general.architecture")?.to_string();
        if !matches!(arch.as_str(), "llama" | "qwen2" | "qwen3") {
            return Err(Error::Unsupported {
                what: "GGUF architecture",
                value: arch,
                hint: "supported: llama (incl. Mistral, SmolLM), qwen2, qwen3".into(),
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let opt_i = |s: &str| -> Result<Option<i64>> {
            let key = k(s);
            if g.get(&key).is_some() {
                g.get_i64(&key).map(Some)
            } else {
                Ok(None)
            }
        };
        let n_head = g.get_i64(&k("attention.head_count"))?;
        let hidden = g.get_i64(&k("embedding_length"))?;
        let vocab = match opt_i("vocab_size")? {
            Some(v) => v,
            None => g.get_str_array("tokenizer.ggml.tokens")?.len() as i64,
        };
        let rope_scaling = match g.get(&k("rope.scaling.type")).and_then(|v| v.as_str()) {
            None | Some("none") => None,
            Some("linear") => Some(RopeScaling::Linear {
                factor: g.get_f64(&k("rope.scaling.factor"))?,
            }),
            Some(other) => {
                return Err(Error::Unsupported {
                    what: "GGUF rope scaling",
                    value: other.to_string(),
                    hint: "supported: none, linear (Llama 3 scaling comes as the `rope_freqs.weight` tensor)".into(),
                });
            }
        };
        let cfg = Self {
            model_type: arch.clone(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: g.get_i64(&k("feed_forward_length"))?,
            num_hidden_layers: g.get_i64(&k("block_count"))?,
            num_attention_heads: n_head,
            num_key_value_heads: opt_i("attention.head_count_kv")?,
            head_dim: opt_i("attention.key_length")?.or(Some(hidden / n_head.max(1))),
            rms_norm_eps: g.get_f64(&k("attention.layer_norm_rms_epsilon"))?,
            rope_theta: if g.get(&k("rope.freq_base")).is_some() {
                g.get_f64(&k("rope.freq_base"))?
            } else {
                10000.0
            },
            rope_scaling,
            max_position_embeddings: opt_i("context_length")?.unwrap_or(2048),
            tie_word_embeddings: g.tensor_info("output.weight").is_none(),
            attention_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            bos_token_id: g
                .get("tokenizer.ggml.bos_token_id")
                .and_then(|v| v.as_i64()),
            eos_token_id: g
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.as_i64())
                .into_iter()
                .collect(),
        };
        cfg.validate().map_err(|e| match e {
            Error::Config { msg, .. } => Error::Config {
                path: g.path().to_path_buf(),
                msg,
            },
            e => e,
        })?;
        Ok(cfg)
    }

    /// RoPE inverse frequencies `[head_dim / 2]` (f64) with the configured scaling; `freq_factors`
    /// (GGUF `rope_freqs.weight`, llama.cpp's Llama 3 form) divide them when given.
    ///
    /// `inv_freq[i] = 1 / θ^(2i/d)` (RoFormer, arXiv:2104.09864, eq. 15); scaling per
    /// transformers' `modeling_rope_utils.py`.
    pub fn inv_freq(&self, freq_factors: Option<&[f32]>) -> Vec<f64> {
        let d = self.head_dim() as f64;
        let mut inv: Vec<f64> = (0..self.head_dim() / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / d))
            .collect();
        match &self.rope_scaling {
            None | Some(RopeScaling::Default) => {}
            Some(RopeScaling::Linear { factor }) => inv.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            }) => {
                let old = *original_max_position_embeddings;
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                for f in inv.iter_mut() {
                    let wavelen = 2.0 * std::f64::consts::PI / *f;
                    if wavelen > low_wavelen {
                        *f /= factor;
                    } else if wavelen >= high_wavelen {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
        }
        if let Some(ff) = freq_factors {
            for (f, &s) in inv.iter_mut().zip(ff) {
                *f /= f64::from(s);
            }
        }
        inv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hf_config_variants() {
        let p = Path::new("config.json");
        let smol = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":49152,
            "hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,"num_attention_heads":9,
            "num_key_value_heads":3,"rms_norm_eps":1e-05,"rope_theta":100000,"rope_scaling":null,
            "max_position_embeddings":8192,"tie_word_embeddings":true,"bos_token_id":1,"eos_token_id":2,
            "hidden_act":"silu","torch_dtype":"bfloat16"}"#;
        let c = LlamaConfig::from_json_str(smol, p).unwrap();
        assert_eq!(c, LlamaConfig::smollm2_135m());
        let llama31 = r#"{"model_type":"llama","vocab_size":128256,"hidden_size":4096,"intermediate_size":14336,
            "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,"rope_theta":500000.0,
            "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192,"rope_type":"llama3"},"eos_token_id":[128001,128008,128009]}"#;
        let c = LlamaConfig::from_json_str(llama31, p).unwrap();
        assert_eq!(c.eos_token_id, vec![128001, 128008, 128009]);
        assert_eq!(c.head_dim(), 128);
        assert!(
            matches!(c.rope_scaling, Some(RopeScaling::Llama3 { factor, .. }) if factor == 8.0)
        );
        // transformers 5 style
        let v5 = r#"{"model_type":"qwen3","vocab_size":10,"hidden_size":8,"intermediate_size":16,
            "num_hidden_layers":1,"num_attention_heads":2,"head_dim":4,
            "rope_parameters":{"rope_type":"default","rope_theta":1000000.0}}"#;
        let c = LlamaConfig::from_json_str(v5, p).unwrap();
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.rope_scaling.is_none() && c.qk_norm() && !c.qkv_bias());
        let bad = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":3,"num_key_value_heads":2}"#;
        assert!(
            LlamaConfig::from_json_str(bad, p)
                .unwrap_err()
                .to_string()
                .contains("multiple")
        );
        let yarn = r#"{"vocab_size":10,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
            "num_attention_heads":2,"rope_scaling":{"type":"yarn","factor":4.0}}"#;
        assert!(matches!(
            LlamaConfig::from_json_str(yarn, p),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn llama3_rope_scaling_matches_transformers() {
        // Reference values from transformers 5 `_compute_llama3_parameters` with θ = 500000,
        // head_dim 128, factor 8, low 1, high 4, original 8192:
        //   import torch; from transformers import LlamaConfig
        //   from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        //   inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu"); inv[[0, 20, 40, 63]]
        // High frequencies are unchanged, the lowest are divided by 8, the band is smoothed;
        // here we check those three regimes from the definition.
        let mut c = LlamaConfig::smollm2_135m();
        c.head_dim = Some(128);
        c.rope_theta = 500000.0;
        let plain = c.inv_freq(None);
        c.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        });
        let scaled = c.inv_freq(None);
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-18);
        let mid: Vec<usize> = (0..64)
            .filter(|&i| {
                let w = 2.0 * std::f64::consts::PI / plain[i];
                (2048.0..=8192.0).contains(&w)
            })
            .collect();
        assert!(!mid.is_empty());
        for i in mid {
            assert!(
                scaled[i] < plain[i] && scaled[i] > plain[i] / 8.0,
                "band {i}"
            );
        }
        assert_eq!(c.inv_freq(Some(&[2.0; 64]))[0], plain[0] / 2.0);
    }
}
