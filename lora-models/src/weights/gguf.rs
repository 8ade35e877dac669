//! A GGUF file as a [`TensorSource`]: tensors dequantised, or linear weights kept in their block
//! format ([`WeightMode`]).

use std::path::PathBuf;

use lora_core::base::BaseWeight;
use lora_core::quant::{QuantKind, QuantWeight};
use tch::{Device, Kind, Tensor};

use super::{TensorSource, check_shape};
use crate::error::{Error, Result};
use crate::gguf::{GgmlType, GgufFile, dequantize, permute_rows, unpermute_qk_src_row};

/// How frozen base weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightMode {
    /// GGUF `Q8_0`/`Q4_0`/`Q4_1`/`Q5_0`/`Q5_1`/`Q4_K`/`Q5_K`/`Q6_K` linear and embedding weights
    /// stay in their block format
    /// ([`QuantWeight`], dequantised per forward); everything else (norms, f16/f32 tensors) is
    /// float32, and the model computes in float32. A dense safetensors checkpoint loaded this
    /// way gets QLoRA's base: its layer linears are quantized to NF4 with double quantization
    /// at load (`Llama::from_safetensors`, [`super::QuantizeOnLoad`]).
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

fn dense_tensor(values: &[f32], shape: &[i64], kind: Kind, device: Device) -> Result<Tensor> {
    Ok(Tensor::f_from_slice(values)?
        .f_reshape(shape)?
        .f_to_kind(kind)?
        .f_to_device(device)?)
}

fn quant_kind(ty: GgmlType) -> Option<QuantKind> {
    QuantKind::from_ggml_type(ty.id())
}

type KeyMap = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Tensors of a GGUF file, asked for by the model's names and translated to the stored ones by
/// a key map (a name the map does not know is looked up as stored: llama.cpp-only tensors such
/// as `rope_freqs.weight`).
pub struct GgufSource<'a> {
    file: &'a GgufFile,
    mode: WeightMode,
    device: Device,
    key_map: Option<KeyMap>,
    permute_qk: bool,
}

impl std::fmt::Debug for GgufSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufSource")
            .field("path", &self.file.path())
            .field("mode", &self.mode)
            .field("device", &self.device)
            .field("permute_qk", &self.permute_qk)
            .finish()
    }
}

impl<'a> GgufSource<'a> {
    /// Tensors of `file` on `device`, base weights held as `mode` says.
    pub fn new(file: &'a GgufFile, mode: WeightMode, device: Device) -> Self {
        Self {
            file,
            mode,
            device,
            key_map: None,
            permute_qk: false,
        }
    }

    /// Translates every requested name with `map` (requested → stored); names it returns `None`
    /// for are looked up unchanged.
    pub fn with_key_map(
        mut self,
        map: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key_map = Some(Box::new(map));
        self
    }

    /// Whether the file's query/key projection rows are in llama.cpp's permuted order (its
    /// converter permutes them for the `llama` architecture only, `LlamaModel.permute`); base
    /// weights asked for with a `rope_head_dim` are then un-permuted.
    pub fn with_permuted_qk(mut self, permuted: bool) -> Self {
        self.permute_qk = permuted;
        self
    }

    fn stored_name(&self, name: &str) -> String {
        self.key_map
            .as_ref()
            .and_then(|m| m(name))
            .unwrap_or_else(|| name.to_string())
    }
}

impl TensorSource for GgufSource<'_> {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        let gname = self.stored_name(name);
        if self.file.tensor_info(&gname).is_none() {
            return Ok(None);
        }
        let (shape, v) = self.file.tensor_f32(&gname)?;
        Ok(Some(dense_tensor(&v, &shape, kind, self.device)?))
    }

    fn contains(&self, name: &str) -> bool {
        self.file.tensor_info(&self.stored_name(name)).is_some()
    }

    fn origin(&self) -> PathBuf {
        self.file.path().to_path_buf()
    }

    fn base(
        &self,
        name: &str,
        shape: [i64; 2],
        kind: Kind,
        rope_head_dim: Option<i64>,
    ) -> Result<BaseWeight> {
        let gname = self.stored_name(name);
        let (info, raw) = self.file.tensor_bytes(&gname)?;
        check_shape(&gname, &shape, &info.torch_shape())?;
        let raw: std::borrow::Cow<'_, [u8]> = match rope_head_dim {
            // Rows are whole (row-major blocks along `in`), so the permutation moves row bytes
            // and never touches a block's contents: it works on quantised data as is.
            Some(hd) if self.permute_qk => permute_rows(raw, shape[0] as usize, |r| {
                unpermute_qk_src_row(r, hd as usize)
            })?
            .into(),
            _ => raw.into(),
        };
        match (self.mode, quant_kind(info.ggml_type)) {
            (WeightMode::KeepQuantized, Some(q)) => Ok(BaseWeight::Quant(
                QuantWeight::from_gguf_blocks(q, &raw, shape, self.device)?,
            )),
            _ => {
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
                    kind,
                    self.device,
                )?))
            }
        }
    }
}
