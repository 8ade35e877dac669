//! How a FLUX transformer's frozen weights are held in memory ([`FluxBaseFormat`]), applied at
//! load by a source wrapper ([`FluxBaseSource`]).
//!
//! - [`FluxBaseFormat::Fp8`] is kohya sd-scripts' `--fp8_base` for FLUX
//!   (`flux_train_network.py` `load_target_model`, `train_network.py`): kohya casts the WHOLE
//!   transformer with `model.to(torch.float8_e4m3fn)` — every linear weight, but also every
//!   bias and the q/k RMSNorm scales (`unet.to(dtype=unet_weight_dtype)`; `cast_unet` is true
//!   for FLUX) — and computes under bf16/fp16 autocast, which upcasts each weight per op
//!   (`library/flux_models.py` `RMSNorm.forward` upcasts its scale with `.float()`). No module
//!   is kept in higher precision. Here every linear weight is stored as fp8 e4m3fn
//!   ([`lora_core::quant::QuantKind::Fp8E4m3`], one byte per weight, upcast per layer to the
//!   compute dtype), and the biases and norm scales take the same fp8 values held in the
//!   compute dtype (what kohya's upcast yields; they are about 0.01 % of the bytes). A file
//!   already in fp8 (`flux1-dev-fp8.safetensors`, `F8_E4M3` tensors) keeps its bits; other
//!   dtypes are read as f32 and rounded once (round to nearest even, saturating at ±448, as
//!   PyTorch's cast).
//! - [`FluxBaseFormat::Nf4`] is QLoRA on FLUX (Dettmers et al. 2023, arXiv:2305.14314): every
//!   linear weight is quantized to NF4 at load (blocks of 64, optional double quantization),
//!   as diffusers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` does to
//!   every `nn.Linear` of `FluxTransformer2DModel`; biases and norm scales stay in the compute
//!   dtype. A weight whose `out·in` is not a multiple of 64 stays dense.
//! - GGUF files are not a format chosen here: they keep the types they were written with
//!   ([`super::FluxTransformer2DModel::from_gguf`]).

use std::path::PathBuf;

use lora_core::base::BaseWeight;
use lora_core::quant::QuantKind;
use tch::{Kind, Tensor};

use crate::error::Result;
use crate::weights::{QuantizeOnLoad, TensorSource};

/// How the frozen weights of a FLUX transformer loaded from a dense checkpoint are held (see the
/// module docs for what each does and where it comes from).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FluxBaseFormat {
    /// Every tensor in the load dtype (`LoadOptions::kind`).
    #[default]
    Dense,
    /// kohya's `fp8_base`: linear weights as fp8 e4m3fn (1 byte/param), upcast per layer;
    /// biases and norm scales rounded through fp8 and held in the compute dtype.
    Fp8,
    /// QLoRA: linear weights as NF4 (0.5625 bytes/param, 0.5159 with `double_quant`).
    Nf4 {
        /// Quantize the per-block absmax constants to 8 bits (QLoRA §3).
        double_quant: bool,
    },
}

impl FluxBaseFormat {
    /// The quantization kind linear weights take, `None` for [`FluxBaseFormat::Dense`].
    pub fn quant_kind(self) -> Option<QuantKind> {
        match self {
            FluxBaseFormat::Dense => None,
            FluxBaseFormat::Fp8 => Some(QuantKind::Fp8E4m3),
            FluxBaseFormat::Nf4 { double_quant } => Some(QuantKind::Nf4 { double_quant }),
        }
    }
}

/// Rounds a float tensor through fp8 e4m3fn and back to `kind` (PyTorch's cast both ways).
fn round_fp8(t: &Tensor, kind: Kind) -> Result<Tensor> {
    Ok(t.f_to_kind(Kind::Float8e4m3fn)?.f_to_kind(kind)?)
}

/// A [`TensorSource`] that applies a [`FluxBaseFormat`] to the tensors of `inner` (diffusers
/// names): [`TensorSource::base`] quantizes the linear weights the inner source gives dense
/// through the shared [`QuantizeOnLoad`] (weights it already keeps quantized, a GGUF file's
/// blocks, are passed on as they are; an NF4 weight whose `out·in` is not a multiple of 64 stays
/// dense), and for [`FluxBaseFormat::Fp8`] [`TensorSource::tensor`] rounds the other tensors
/// through fp8. Both read the inner tensors as f32, so a value is rounded once whatever the
/// file's dtype.
pub struct FluxBaseSource<'a> {
    inner: &'a dyn TensorSource,
    format: FluxBaseFormat,
    quantized: Option<QuantizeOnLoad<'a>>,
}

impl std::fmt::Debug for FluxBaseSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FluxBaseSource")
            .field("origin", &self.inner.origin())
            .field("format", &self.format)
            .finish()
    }
}

impl<'a> FluxBaseSource<'a> {
    /// `inner`'s tensors held as `format` says.
    pub fn new(inner: &'a dyn TensorSource, format: FluxBaseFormat) -> Self {
        Self {
            inner,
            format,
            quantized: format.quant_kind().map(|q| QuantizeOnLoad::new(inner, q)),
        }
    }
}

impl TensorSource for FluxBaseSource<'_> {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        match self.format {
            FluxBaseFormat::Fp8 => match self.inner.tensor(name, Kind::Float)? {
                Some(t) if t.is_floating_point() => Ok(Some(round_fp8(&t, kind)?)),
                Some(t) => Ok(Some(t)),
                None => Ok(None),
            },
            _ => self.inner.tensor(name, kind),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn origin(&self) -> PathBuf {
        self.inner.origin()
    }

    fn base(
        &self,
        name: &str,
        shape: [i64; 2],
        kind: Kind,
        rope_head_dim: Option<i64>,
    ) -> Result<BaseWeight> {
        match &self.quantized {
            Some(q) => q.base(name, shape, kind, rope_head_dim),
            None => self.inner.base(name, shape, kind, rope_head_dim),
        }
    }
}
