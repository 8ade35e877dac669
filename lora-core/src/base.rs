//! The frozen base weight of a LoRA layer: dense or quantized.

use crate::error::{Result, TchContext};
use crate::quant::QuantWeight;
use tch::{Kind, Tensor};

/// A frozen base weight.
///
/// Dense weights are used as they are (fp32 / fp16 / bf16, any shape: `[out, in]` for Linear,
/// `[out, in, kh, kw]` for Conv2d, `[num_embeddings, dim]` for Embedding). Quantized weights are 2-D
/// `[out, in]` and dequantized on every call to [`BaseWeight::weight`].
#[derive(Debug)]
pub enum BaseWeight {
    /// A dense tensor (not trained: it lives in the base VarStore or is a plain tensor).
    Dense(Tensor),
    /// A weight kept quantized in memory.
    Quant(QuantWeight),
}

impl BaseWeight {
    /// The weight as a dense tensor of dtype `kind` (a no-copy view when a dense weight already has
    /// that dtype; a fresh dequantization for quantized weights).
    ///
    /// # Errors
    /// [`crate::Error::Torch`] when the cast / dequantization fails.
    pub fn weight(&self, kind: Kind) -> Result<Tensor> {
        match self {
            BaseWeight::Dense(t) => {
                if t.kind() == kind {
                    Ok(t.shallow_clone())
                } else {
                    t.f_to_kind(kind)
                        .ctx(|| format!("casting base weight to {kind:?}"))
                }
            }
            BaseWeight::Quant(q) => q.dequantize(kind),
        }
    }

    /// The logical shape.
    pub fn shape(&self) -> Vec<i64> {
        match self {
            BaseWeight::Dense(t) => t.size(),
            BaseWeight::Quant(q) => q.shape().to_vec(),
        }
    }

    /// Number of parameters (elements of the logical shape).
    pub fn numel(&self) -> i64 {
        self.shape().iter().product()
    }

    /// Bytes held in memory by this weight.
    pub fn storage_bytes(&self) -> u64 {
        match self {
            BaseWeight::Dense(t) => (t.numel() * t.kind().elt_size_in_bytes()) as u64,
            BaseWeight::Quant(q) => q.storage_bytes(),
        }
    }

    /// The dtype a dense weight computes in by default (`Float` for quantized weights).
    pub fn kind(&self) -> Kind {
        match self {
            BaseWeight::Dense(t) => t.kind(),
            BaseWeight::Quant(_) => Kind::Float,
        }
    }

    /// The device the weight lives on.
    pub fn device(&self) -> tch::Device {
        match self {
            BaseWeight::Dense(t) => t.device(),
            BaseWeight::Quant(q) => q.device(),
        }
    }

    /// Whether the weight is quantized.
    pub fn is_quantized(&self) -> bool {
        matches!(self, BaseWeight::Quant(_))
    }
}
