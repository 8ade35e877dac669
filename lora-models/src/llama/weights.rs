//! Where the weights come from: GGUF files, HF safetensors folders, or in-memory tensors.
//!
//! Every source answers in HF names (`model.layers.0.self_attn.q_proj.weight`); the GGUF source
//! translates them to llama.cpp's names (`blk.0.attn_q.weight`, table in `llama-arch.cpp`,
//! `LLM_TENSOR_NAMES`) and undoes the converter's Q/K row permutation.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use lora_core::base::BaseWeight;
use lora_core::quant::{QuantKind, QuantWeight};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, dequantize, permute_rows, unpermute_qk_src_row};
use crate::sd::load::{SafetensorsFiles, TensorSource, weight_files};

/// How frozen base weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMode {
    /// GGUF `Q8_0`/`Q4_0`/`Q4_1` linear and embedding weights stay in their block format
    /// ([`QuantWeight`], dequantised per forward); everything else (norms, f16/f32 tensors) is
    /// float32, and the model computes in float32. For safetensors checkpoints (never quantised)
    /// this is the same as `Dense(Kind::Float)`.
    KeepQuantized,
    /// Every weight dequantised / converted to this dtype once at load; the model computes in it.
    Dense(Kind),
}

impl WeightMode {
    /// The dtype activations are computed in.
    pub fn compute_kind(self) -> Kind {
        match self {
            WeightMode::KeepQuantized => Kind::Float,
            WeightMode::Dense(k) => k,
        }
    }
}

/// A provider of weights by HF name.
pub(crate) trait WeightSource {
    /// A 2-D weight (`[out, in]` torch order) as a frozen base, checked against `shape`.
    /// `qk_head_dim` is set for `q_proj`/`k_proj` weights (for sources that permute them).
    fn base(&self, name: &str, shape: [i64; 2], qk_head_dim: Option<i64>) -> Result<BaseWeight>;
    /// A dense tensor (norm weights, biases) in `kind`; `None` when absent.
    fn dense(&self, name: &str, kind: Kind) -> Result<Option<Tensor>>;
    /// llama.cpp's Llama 3 RoPE frequency factors (`rope_freqs.weight`), if present.
    fn rope_freq_factors(&self) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
    /// Whether a tensor exists.
    fn has(&self, name: &str) -> bool;
    /// Where the weights come from (for messages).
    fn origin(&self) -> PathBuf;
}

fn check_shape(name: &str, expected: &[i64], found: &[i64]) -> Result<()> {
    if expected != found {
        return Err(Error::Shape {
            name: name.to_string(),
            expected: expected.to_vec(),
            found: found.to_vec(),
        });
    }
    Ok(())
}

fn dense_tensor(values: &[f32], shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(values)?
        .f_reshape(shape)?
        .f_to_kind(kind)?
        .f_to_device(device)?)
}

/// Maps an HF parameter name to llama.cpp's GGUF tensor name.
pub(crate) fn hf_to_gguf_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Weights read from a GGUF file.
pub(crate) struct GgufSource<'a> {
    pub(crate) file: &'a GgufFile,
    pub(crate) mode: WeightMode,
    pub(crate) device: Device,
    /// llama.cpp permutes Q/K rows only for the `llama` architecture (`LlamaModel.permute`).
    pub(crate) permute_qk: bool,
}

impl GgufSource<'_> {
    fn gguf_name(&self, name: &str) -> Result<String> {
        hf_to_gguf_name(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            path: self.file.path().into(),
        })
    }
}

fn quant_kind(ty: GgmlType) -> Option<QuantKind> {
    match ty {
        GgmlType::Q8_0 => Some(QuantKind::Q8_0),
        GgmlType::Q4_0 => Some(QuantKind::Q4_0),
        GgmlType::Q4_1 => Some(QuantKind::Q4_1),
        _ => None,
    }
}

impl WeightSource for GgufSource<'_> {
    fn base(&self, name: &str, shape: [i64; 2], qk_head_dim: Option<i64>) -> Result<BaseWeight> {
        let gname = self.gguf_name(name)?;
        let (info, raw) = self.file.tensor_bytes(&gname)?;
        check_shape(&gname, &shape, &info.torch_shape())?;
        let raw: std::borrow::Cow<'_, [u8]> = match qk_head_dim {
            // Rows are whole (row-major blocks along `in`), so the permutation moves row bytes
            // and never touches a block's contents: it works on quantised data as is.
            Some(hd) if self.permute_qk => permute_rows(raw, shape[0] as usize, |r| {
                unpermute_qk_src_row(r, hd as usize)
            })?
            .into(),
            _ => raw.into(),
        };
        match (self.mode, quant_kind(info.ggml_type)) {
            (WeightMode::KeepQuantized, Some(kind)) => Ok(BaseWeight::Quant(
                QuantWeight::from_gguf_blocks(kind, &raw, shape, self.device)?,
            )),
            (mode, _) => {
                let v = dequantize(info.ggml_type, &raw, info.numel() as usize).map_err(
                    |e| match e {
                        Error::Unsupported { what, value, hint } => Error::Unsupported {
                            what,
                            value: format!("{value} (tensor `{gname}`)"),
                            hint,
                        },
                        e => e,
                    },
                )?;
                Ok(BaseWeight::Dense(dense_tensor(
                    &v,
                    &shape,
                    mode.compute_kind(),
                    self.device,
                )?))
            }
        }
    }

    fn dense(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        let gname = self.gguf_name(name)?;
        if self.file.tensor_info(&gname).is_none() {
            return Ok(None);
        }
        let (shape, v) = self.file.tensor_f32(&gname)?;
        Ok(Some(dense_tensor(&v, &shape, kind, self.device)?))
    }

    fn rope_freq_factors(&self) -> Result<Option<Vec<f32>>> {
        if self.file.tensor_info("rope_freqs.weight").is_none() {
            return Ok(None);
        }
        Ok(Some(self.file.tensor_f32("rope_freqs.weight")?.1))
    }

    fn has(&self, name: &str) -> bool {
        hf_to_gguf_name(name).is_some_and(|g| self.file.tensor_info(&g).is_some())
    }

    fn origin(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }
}

/// An HF safetensors checkpoint: one `model.safetensors` or shards listed by
/// `model.safetensors.index.json` (`{"weight_map": {name: file}}`), memory-mapped through the
/// crate's one safetensors reader ([`crate::sd::load::SafetensorsFiles`]).
pub(crate) struct SafetensorsSource {
    dir: PathBuf,
    files: SafetensorsFiles,
    pub(crate) mode: WeightMode,
}

impl SafetensorsSource {
    pub(crate) fn open(dir: &Path, mode: WeightMode, device: Device) -> Result<Self> {
        let paths = weight_files(dir, &["model.safetensors".to_string()])?;
        Ok(Self {
            dir: dir.to_path_buf(),
            files: SafetensorsFiles::open(&paths, dir, device)?,
            mode,
        })
    }

    fn load(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        self.files.tensor(name, kind)
    }
}

impl WeightSource for SafetensorsSource {
    fn base(&self, name: &str, shape: [i64; 2], _qk: Option<i64>) -> Result<BaseWeight> {
        let t = self
            .load(name, self.mode.compute_kind())?
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                path: self.dir.clone(),
            })?;
        check_shape(name, &shape, &t.size())?;
        Ok(BaseWeight::Dense(t))
    }

    fn dense(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        self.load(name, kind)
    }

    fn has(&self, name: &str) -> bool {
        self.files.contains(name)
    }

    fn origin(&self) -> PathBuf {
        self.dir.clone()
    }
}

/// In-memory tensors by HF name (tests, converters).
pub(crate) struct MapSource<'a> {
    pub(crate) map: &'a HashMap<String, Tensor>,
    pub(crate) kind: Kind,
    pub(crate) device: Device,
}

impl WeightSource for MapSource<'_> {
    fn base(&self, name: &str, shape: [i64; 2], _qk: Option<i64>) -> Result<BaseWeight> {
        let t = self
            .dense(name, self.kind)?
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                path: "<map>".into(),
            })?;
        check_shape(name, &shape, &t.size())?;
        Ok(BaseWeight::Dense(t))
    }

    fn dense(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(t) => Ok(Some(
                t.f_detach()?.f_to_kind(kind)?.f_to_device(self.device)?,
            )),
        }
    }

    fn has(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn origin(&self) -> PathBuf {
        "<map>".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_hf_names_to_gguf() {
        assert_eq!(
            hf_to_gguf_name("model.layers.12.self_attn.q_proj.weight").unwrap(),
            "blk.12.attn_q.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.0.self_attn.k_proj.bias").unwrap(),
            "blk.0.attn_k.bias"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.post_attention_layernorm.weight").unwrap(),
            "blk.3.ffn_norm.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.mlp.down_proj.weight").unwrap(),
            "blk.3.ffn_down.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.embed_tokens.weight").unwrap(),
            "token_embd.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.self_attn.rotary_emb.inv_freq"),
            None
        );
    }
}
