//! The frozen base weight of a LoRA layer: dense, quantized, or kept on a host device and
//! copied to the compute device per use (block swapping).

use crate::error::{Error, Result, TchContext};
use crate::quant::QuantWeight;
use tch::{Device, Kind, Tensor};

/// A frozen base weight.
///
/// Dense weights are used as they are (fp32 / fp16 / bf16, any shape: `[out, in]` for Linear,
/// `[out, in, kh, kw]` for Conv2d, `[num_embeddings, dim]` for Embedding). Quantized weights are 2-D
/// `[out, in]` and dequantized on every call to [`BaseWeight::weight`]. An offloaded weight
/// ([`OffloadedWeight`]) keeps a dense or quantized weight on a host device and copies it to its
/// compute device on every use.
#[derive(Debug)]
pub enum BaseWeight {
    /// A dense tensor (not trained: it lives in the base VarStore or is a plain tensor).
    Dense(Tensor),
    /// A weight kept quantized in memory.
    Quant(QuantWeight),
    /// A weight stored on a host device, copied to the compute device for each use.
    Offloaded(OffloadedWeight),
}

/// A frozen weight whose storage stays on a host device (the CPU) while the layer computes on
/// another (a GPU): each use copies it to the compute device, and the copy is dropped when the
/// op that used it is done — kohya sd-scripts' block swapping (`--blocks_to_swap`,
/// `library/custom_offloading_utils.py`, which moves a block's `weight` tensors and leaves its
/// biases and norms on the device), at the granularity of one layer and without prefetching.
///
/// A quantized weight moves as stored (its codes and scales: 1 byte/param for fp8, 0.56 for
/// Q4_K, …) and is dequantized on the compute device; nothing is dequantized on the host.
///
/// Under autograd the device copy (or its dequantized matrix) is what the product saves for the
/// input's gradient, so it stays alive until the backward pass: offloading saves device memory
/// when the forward runs without a graph (inference, or the no-grad forward of activation
/// checkpointing, whose recomputation then holds one segment's weights at a time).
#[derive(Debug)]
pub struct OffloadedWeight {
    stored: Box<BaseWeight>,
    compute: Device,
}

impl OffloadedWeight {
    /// The weight as stored (dense or quantized, on the host device).
    pub fn stored(&self) -> &BaseWeight {
        &self.stored
    }

    /// The device the weight is copied to for each use.
    pub fn compute_device(&self) -> Device {
        self.compute
    }

    /// A copy of the stored weight on the compute device (the stored tensors themselves when
    /// both devices are the same).
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy fails (out of device memory included).
    pub fn fetch(&self) -> Result<BaseWeight> {
        self.stored.moved_to(self.compute)
    }
}

impl BaseWeight {
    /// The weight as a dense tensor of dtype `kind` on the device it computes on (a no-copy view
    /// when a dense weight already has that dtype; a fresh dequantization for quantized weights;
    /// a copy from the host for offloaded ones, cast or dequantized on the compute device).
    ///
    /// # Errors
    /// [`crate::Error::Torch`] when the cast / dequantization / copy fails.
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
            BaseWeight::Offloaded(o) => o.fetch()?.weight(kind),
        }
    }

    /// Calls `f` with the weight ready for use on its compute device: `self` for a dense or
    /// quantized weight, the fetched copy ([`OffloadedWeight::fetch`], never itself offloaded)
    /// for an offloaded one, dropped when `f` returns. Layers call this once per forward.
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy fails; whatever `f` returns.
    pub fn with_resident<R>(&self, f: impl FnOnce(&BaseWeight) -> Result<R>) -> Result<R> {
        match self {
            BaseWeight::Offloaded(o) => f(&o.fetch()?),
            b => f(b),
        }
    }

    /// The logical shape.
    pub fn shape(&self) -> Vec<i64> {
        match self {
            BaseWeight::Dense(t) => t.size(),
            BaseWeight::Quant(q) => q.shape().to_vec(),
            BaseWeight::Offloaded(o) => o.stored.shape(),
        }
    }

    /// Number of parameters (elements of the logical shape).
    pub fn numel(&self) -> i64 {
        self.shape().iter().product()
    }

    /// Bytes held in memory by this weight (on [`BaseWeight::storage_device`]).
    pub fn storage_bytes(&self) -> u64 {
        match self {
            BaseWeight::Dense(t) => (t.numel() * t.kind().elt_size_in_bytes()) as u64,
            BaseWeight::Quant(q) => q.storage_bytes(),
            BaseWeight::Offloaded(o) => o.stored.storage_bytes(),
        }
    }

    /// The dtype a dense weight computes in by default (`Float` for quantized weights).
    pub fn kind(&self) -> Kind {
        match self {
            BaseWeight::Dense(t) => t.kind(),
            BaseWeight::Quant(_) => Kind::Float,
            BaseWeight::Offloaded(o) => o.stored.kind(),
        }
    }

    /// The device the weight computes on: where its storage lives, or for an offloaded weight
    /// the device it is copied to (where the layer's inputs and adapters must be).
    pub fn device(&self) -> Device {
        match self {
            BaseWeight::Dense(t) => t.device(),
            BaseWeight::Quant(q) => q.device(),
            BaseWeight::Offloaded(o) => o.compute,
        }
    }

    /// The device the weight's bytes live on (the host device of an offloaded weight, else
    /// [`BaseWeight::device`]).
    pub fn storage_device(&self) -> Device {
        match self {
            BaseWeight::Offloaded(o) => o.stored.storage_device(),
            b => b.device(),
        }
    }

    /// Whether the weight is quantized (an offloaded weight: whether its stored weight is).
    pub fn is_quantized(&self) -> bool {
        match self {
            BaseWeight::Dense(_) => false,
            BaseWeight::Quant(_) => true,
            BaseWeight::Offloaded(o) => o.stored.is_quantized(),
        }
    }

    /// Whether the weight is offloaded ([`BaseWeight::Offloaded`]).
    pub fn is_offloaded(&self) -> bool {
        matches!(self, BaseWeight::Offloaded(_))
    }

    /// This weight computing on `device`: a dense or quantized weight is copied there (as
    /// stored: a quantized weight moves its blocks; the same tensors when already there); an
    /// offloaded weight keeps its host copy and is copied to `device` for each use from now on.
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy fails (out of memory included).
    pub fn moved_to(&self, device: Device) -> Result<BaseWeight> {
        match self {
            BaseWeight::Dense(t) => {
                Ok(BaseWeight::Dense(t.f_to_device(device).ctx(|| {
                    format!("moving a {:?} base weight to {device:?}", t.size())
                })?))
            }
            BaseWeight::Quant(q) => Ok(BaseWeight::Quant(q.to_device(device)?)),
            BaseWeight::Offloaded(o) => Ok(BaseWeight::Offloaded(OffloadedWeight {
                stored: Box::new(o.stored.moved_to(o.stored.storage_device())?),
                compute: device,
            })),
        }
    }

    /// This weight stored on `host` and copied to the device it computes on now
    /// ([`BaseWeight::device`]) for each use ([`OffloadedWeight`]); an offloaded weight moves
    /// its stored copy to `host`. A quantized weight moves its blocks, never dequantized.
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy to `host` fails.
    pub fn offloaded(&self, host: Device) -> Result<BaseWeight> {
        let (stored, compute) = match self {
            BaseWeight::Offloaded(o) => (&*o.stored, o.compute),
            b => (b, b.device()),
        };
        Ok(BaseWeight::Offloaded(OffloadedWeight {
            stored: Box::new(stored.moved_to(host)?),
            compute,
        }))
    }

    /// This weight back on the device it computes on (an offloaded weight's copy, kept); a dense
    /// or quantized weight unchanged (the same tensors).
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy fails (out of device memory included).
    pub fn onloaded(&self) -> Result<BaseWeight> {
        self.moved_to(self.device()).and_then(|b| match b {
            BaseWeight::Offloaded(o) => o.fetch(),
            b => Ok(b),
        })
    }

    /// The dense tensor of a dense weight (no copy), for in-place operations (merging an
    /// adapter).
    ///
    /// # Errors
    /// [`Error::Unsupported`] for quantized and offloaded weights, saying what to do; `what`
    /// names the operation.
    pub fn dense(&self, what: &str) -> Result<Tensor> {
        match self {
            BaseWeight::Dense(t) => Ok(t.shallow_clone()),
            BaseWeight::Quant(q) => Err(Error::Unsupported(format!(
                "{what} into a quantized {:?} base; dequantize the base (BaseWeight::Dense) first",
                q.kind()
            ))),
            BaseWeight::Offloaded(o) => Err(Error::Unsupported(format!(
                "{what} into a base offloaded to {:?}; bring it back to {:?} first \
                 (BaseWeight::onloaded, or stop block swapping)",
                o.stored.storage_device(),
                o.compute
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::linear::LoraLinear;
    use crate::quant::QuantKind;

    /// An offloaded weight computes as the weight it stores, keeps its bytes on the host,
    /// moves quantized blocks as stored, and refuses in-place merges.
    #[test]
    fn offloaded_weights_compute_as_stored_and_report_their_devices() {
        tch::manual_seed(3);
        let w = Tensor::randn([6, 64], (Kind::Float, Device::Cpu));
        let x = Tensor::randn([2, 3, 64], (Kind::Float, Device::Cpu));
        let b = Tensor::randn([6], (Kind::Float, Device::Cpu));
        let bases = [
            BaseWeight::Dense(w.copy()),
            BaseWeight::Quant(QuantWeight::quantize(&w, QuantKind::Q8_0).unwrap()),
            BaseWeight::Quant(QuantWeight::quantize(&w, QuantKind::Fp8E4m3).unwrap()),
        ];
        for base in bases {
            let quantized = base.is_quantized();
            let bytes = base.storage_bytes();
            let want = LoraLinear::new(base.moved_to(Device::Cpu).unwrap(), Some(b.copy()))
                .unwrap()
                .forward_t(&x, false)
                .unwrap();
            let off = base.offloaded(Device::Cpu).unwrap();
            assert!(off.is_offloaded());
            assert_eq!(off.is_quantized(), quantized);
            assert_eq!(off.storage_bytes(), bytes);
            assert_eq!(
                (off.device(), off.storage_device()),
                (Device::Cpu, Device::Cpu)
            );
            assert_eq!(off.shape(), [6, 64]);
            assert!(
                off.weight(Kind::Float)
                    .unwrap()
                    .equal(&base.weight(Kind::Float).unwrap())
            );
            let e = off.dense("merge").unwrap_err().to_string();
            assert!(e.contains("offloaded"), "{e}");
            // offloading an offloaded weight keeps one level
            let twice = off.offloaded(Device::Cpu).unwrap();
            let BaseWeight::Offloaded(o) = &twice else {
                panic!("not offloaded")
            };
            assert!(!o.stored().is_offloaded());
            assert_eq!(o.compute_device(), Device::Cpu);
            let back = twice.onloaded().unwrap();
            assert!(!back.is_offloaded());
            assert_eq!(back.is_quantized(), quantized);
            // a layer over the offloaded base gives the same output, bit for bit
            let mut layer = LoraLinear::new(base, Some(b.copy())).unwrap();
            let old = layer.replace_base(off).unwrap();
            assert!(!old.is_offloaded());
            let y = layer.forward_t(&x, false).unwrap();
            assert!(y.equal(&want));
            layer.move_frozen(Device::Cpu).unwrap();
            assert!(layer.forward_t(&x, false).unwrap().equal(&want));
            // the replacement must have the same shape
            let wrong = BaseWeight::Dense(Tensor::zeros([5, 64], (Kind::Float, Device::Cpu)));
            assert!(layer.replace_base(wrong).is_err());
        }
    }
}
