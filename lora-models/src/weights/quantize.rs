//! Quantization at load: a [`TensorSource`] wrapper whose frozen linear weights come back
//! block-quantized although the checkpoint stores them dense — QLoRA's base (Dettmers et al.
//! 2023, arXiv:2305.14314), as `BitsAndBytesConfig(load_in_4bit=True,
//! bnb_4bit_quant_type="nf4")` applies it in transformers (`integrations/bitsandbytes.py`
//! `replace_with_bnb_linear`) and diffusers, or kohya's `fp8_base`.

use std::path::PathBuf;

use lora_core::base::BaseWeight;
use lora_core::quant::{NF4_BLOCK, QuantKind, QuantWeight};
use tch::{Kind, Tensor};

use super::TensorSource;
use crate::error::Result;

/// Which weights a [`QuantizeOnLoad`] leaves dense, by full tensor name
/// (`model.layers.0.mlp.up_proj.weight`).
type KeepDense<'a> = Box<dyn Fn(&str) -> bool + 'a>;

/// Whether a `[out, in]` weight can be stored as `kind`: NF4 quantizes blocks of
/// [`NF4_BLOCK`] (64) over the flattened matrix, so `out·in` must be a multiple of 64
/// (bitsandbytes pads the last block instead; here such a weight stays dense); the GGUF kinds
/// quantize rows in blocks of 32 (256 for the k-quants), so `in` must be a multiple of that;
/// fp8 takes any shape.
pub fn quantizable(kind: QuantKind, shape: [i64; 2]) -> bool {
    if shape[0] <= 0 || shape[1] <= 0 {
        return false;
    }
    match kind {
        QuantKind::Nf4 { .. } => (shape[0] * shape[1]) % NF4_BLOCK as i64 == 0,
        QuantKind::Fp8E4m3 => true,
        _ => kind
            .gguf_block_weights()
            .is_some_and(|bw| shape[1] % bw as i64 == 0),
    }
}

/// A [`TensorSource`] whose [`TensorSource::base`] quantizes the dense weights of `inner` to one
/// [`QuantKind`] as they are loaded ([`QuantWeight::quantize`], from the f32 values, so a value
/// is rounded once whatever the file's dtype). Left as `inner` gives them:
///
/// - weights `inner` already keeps quantized (a GGUF file's blocks);
/// - a weight whose shape the kind cannot hold ([`quantizable`]: NF4 needs `out·in` a multiple
///   of 64), read dense in the requested dtype;
/// - the names [`QuantizeOnLoad::keeping_dense`] selects (a decoder's embedding and LM head,
///   which bitsandbytes does not convert), read dense in the requested dtype.
///
/// Every other tensor ([`TensorSource::tensor`]: norms, biases) passes through unchanged.
///
/// ```no_run
/// # fn main() -> lora_models::Result<()> {
/// use std::path::Path;
///
/// use lora_core::quant::QuantKind;
/// use lora_models::weights::{QuantizeOnLoad, SafetensorsFiles, TensorSource};
/// use tch::{Device, Kind};
///
/// let files = SafetensorsFiles::open_dir(Path::new("Llama-3.2-1B"), "model", Device::Cpu)?;
/// let src = QuantizeOnLoad::new(&files, QuantKind::Nf4 { double_quant: true })
///     .keeping_dense(|name| !name.starts_with("model.layers."));
/// let w = src.base("model.layers.0.mlp.up_proj.weight", [8192, 2048], Kind::Float, None)?;
/// assert!(w.is_quantized()); // NF4 blocks of 64, double-quantized absmax
/// # Ok(()) }
/// ```
pub struct QuantizeOnLoad<'a> {
    inner: &'a dyn TensorSource,
    kind: QuantKind,
    keep_dense: Option<KeepDense<'a>>,
}

impl std::fmt::Debug for QuantizeOnLoad<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantizeOnLoad")
            .field("origin", &self.inner.origin())
            .field("kind", &self.kind)
            .field("keep_dense", &self.keep_dense.is_some())
            .finish()
    }
}

impl<'a> QuantizeOnLoad<'a> {
    /// `inner`'s 2-D base weights quantized to `kind` at load.
    pub fn new(inner: &'a dyn TensorSource, kind: QuantKind) -> Self {
        Self {
            inner,
            kind,
            keep_dense: None,
        }
    }

    /// Leaves dense every base weight whose full tensor name `keep` accepts.
    pub fn keeping_dense(mut self, keep: impl Fn(&str) -> bool + 'a) -> Self {
        self.keep_dense = Some(Box::new(keep));
        self
    }

    /// The kind weights are quantized to.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }
}

impl TensorSource for QuantizeOnLoad<'_> {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        self.inner.tensor(name, kind)
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
        if self.keep_dense.as_ref().is_some_and(|keep| keep(name)) {
            return self.inner.base(name, shape, kind, rope_head_dim);
        }
        match self.inner.base(name, shape, Kind::Float, rope_head_dim)? {
            BaseWeight::Dense(t) if quantizable(self.kind, shape) => {
                Ok(BaseWeight::Quant(QuantWeight::quantize(&t, self.kind)?))
            }
            BaseWeight::Dense(t) => Ok(BaseWeight::Dense(t.f_to_kind(kind)?)),
            b => Ok(b),
        }
    }
}
