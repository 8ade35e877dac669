//! Activation (gradient) checkpointing by segment recomputation.
//!
//! The idea is Chen et al., "Training Deep Nets with Sublinear Memory Cost" (arXiv:1604.06174),
//! as done by `torch.utils.checkpoint`: keep only each segment's input during the forward pass,
//! and recompute the segment with autograd on during the backward pass. tch exposes no custom
//! autograd function and `run_backward` takes no output gradients, so the backward pass is driven
//! from here, segment by segment, from the last to the first: for segment `i` with stored input
//! `xᵢ` and output gradient `gᵢ₊₁`, recompute `y = fᵢ(xᵢ)` with `xᵢ` a fresh leaf that requires
//! grad, backprop the scalar `Σ(y ⊙ gᵢ₊₁)` (whose gradient w.r.t. `y` is exactly `gᵢ₊₁`), and
//! read `gᵢ = ∂/∂xᵢ`. Parameter gradients accumulate into `.grad()` as in an ordinary backward.
//!
//! Usage (the caller owns the head/loss part):
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::checkpoint::SegmentTape;
//! use tch::{Kind, Tensor};
//! let ws: Vec<Tensor> = (0..3).map(|_| Tensor::randn([4, 4], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true)).collect();
//! let seg = |i: usize, x: &Tensor| -> lora_models::Result<Tensor> { Ok(x.f_matmul(&ws[i])?.f_tanh()?) };
//! let x0 = Tensor::randn([2, 4], (Kind::Float, tch::Device::Cpu));
//! let (h, tape) = SegmentTape::forward(&x0, ws.len(), seg)?;   // no graph kept for the segments
//! let loss = h.f_sum(Kind::Float)?;                             // the head, with a graph
//! loss.f_backward()?;                                           // h is a leaf: h.grad() is filled
//! let _grad_x0 = tape.backward(&h.grad(), seg)?;                // recompute + backprop each segment
//! # Ok(()) }
//! ```
//!
//! Randomness: a segment that draws random numbers (LoRA dropout) must draw the same ones when
//! recomputed, or the gradients belong to a different forward pass. As `torch.utils.checkpoint`
//! does (`preserve_rng_state=True`), [`SegmentTape`] saves the default generator state (CPU, and
//! the input's CUDA device) before each segment's forward and restores it before the
//! recomputation; after [`SegmentTape::backward`] the generator is back where it was.

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// The generator states of the devices a segment may draw from.
type RngStates = Vec<(Device, Vec<u8>)>;

fn rng_devices(x: &Tensor) -> Vec<Device> {
    match x.device() {
        Device::Cpu => vec![Device::Cpu],
        d => vec![Device::Cpu, d],
    }
}

fn save_rng(devices: &[Device]) -> Result<RngStates> {
    devices
        .iter()
        .map(|&d| Ok((d, lora_core::sys::rng_state(d)?)))
        .collect()
}

fn restore_rng(states: &RngStates) -> Result<()> {
    for (d, s) in states {
        lora_core::sys::set_rng_state(*d, s)?;
    }
    Ok(())
}

/// The stored segment inputs of one checkpointed forward pass.
#[derive(Debug)]
pub struct SegmentTape {
    inputs: Vec<Tensor>,
    rng: Vec<RngStates>,
    devices: Vec<Device>,
}

impl SegmentTape {
    /// Runs segments `0..n` in order on `x0` with autograd off, keeping each segment's input
    /// (one activation per segment) and the generator state before it.
    ///
    /// Returns the last output as a leaf that requires grad (so the head's backward pass
    /// fills its `.grad()`), and the tape.
    ///
    /// # Errors
    /// Whatever a segment returns; [`Error::Torch`] from libtorch; [`Error::Shim`] when the
    /// generator state cannot be read.
    pub fn forward<F>(x0: &Tensor, n: usize, mut f: F) -> Result<(Tensor, Self)>
    where
        F: FnMut(usize, &Tensor) -> Result<Tensor>,
    {
        let devices = rng_devices(x0);
        let mut inputs = Vec::with_capacity(n);
        let mut rng = Vec::with_capacity(n);
        let mut x = x0.f_detach()?;
        {
            let _guard = tch::no_grad_guard();
            for i in 0..n {
                inputs.push(x.shallow_clone());
                rng.push(save_rng(&devices)?);
                x = f(i, &x)?;
            }
        }
        let out = x.f_detach()?.f_set_requires_grad(true)?;
        Ok((
            out,
            Self {
                inputs,
                rng,
                devices,
            },
        ))
    }

    /// Number of segments.
    pub fn len(&self) -> usize {
        self.inputs.len()
    }

    /// Whether there are no segments.
    pub fn is_empty(&self) -> bool {
        self.inputs.is_empty()
    }

    /// Backpropagates `grad_out` (the gradient of the last segment's output, same shape) through
    /// all segments in reverse, recomputing each with `f` (which must be the function given to
    /// [`SegmentTape::forward`]). Parameter gradients accumulate; returns the gradient w.r.t. `x0`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `grad_out` is undefined (the head's backward did not reach
    /// the tape's output); whatever a segment returns; [`Error::Torch`] from libtorch;
    /// [`Error::Shim`] when the generator state cannot be restored.
    pub fn backward<F>(self, grad_out: &Tensor, mut f: F) -> Result<Tensor>
    where
        F: FnMut(usize, &Tensor) -> Result<Tensor>,
    {
        if !grad_out.defined() {
            return Err(Error::InvalidArgument(
                "checkpoint backward: the output gradient is undefined; backpropagate the loss \
                 to the tape's output first"
                    .into(),
            ));
        }
        let now = save_rng(&self.devices)?;
        let res = tch::with_grad(|| {
            let mut g = grad_out.f_detach()?;
            for i in (0..self.inputs.len()).rev() {
                let x = self.inputs[i].f_detach()?.f_set_requires_grad(true)?;
                restore_rng(&self.rng[i])?;
                let y = f(i, &x)?;
                if y.requires_grad() {
                    y.f_mul(&g.f_to_kind(y.kind())?)?
                        .f_sum(Kind::Float)?
                        .f_backward()?;
                }
                let gx = x.f_grad()?;
                g = if gx.defined() {
                    gx.f_detach()?
                } else {
                    x.f_zeros_like()?
                };
            }
            Ok(g)
        });
        restore_rng(&now)?;
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpointed_gradients_equal_plain_ones() {
        let _lock = crate::test_rng_lock();
        tch::manual_seed(0);
        let opts = (Kind::Double, Device::Cpu);
        let ws: Vec<Tensor> = (0..4)
            .map(|_| Tensor::randn([5, 5], opts).set_requires_grad(true))
            .collect();
        // dropout inside: the recomputation must see the same masks
        let seg = |i: usize, x: &Tensor| -> Result<Tensor> {
            Ok(x.f_matmul(&ws[i])?.f_tanh()?.f_dropout(0.3, true)?)
        };
        let x0 = Tensor::randn([3, 5], opts).set_requires_grad(true);

        tch::manual_seed(7);
        let (h, tape) = SegmentTape::forward(&x0, 4, seg).unwrap();
        let loss_ck = h
            .f_pow_tensor_scalar(2)
            .unwrap()
            .f_sum(Kind::Double)
            .unwrap();
        loss_ck.backward();
        let g0 = tape.backward(&h.grad(), seg).unwrap();
        // the generator is back where the forward pass left it
        let after_ck = Tensor::randn([8], opts);
        let grads_ck: Vec<Tensor> = ws.iter().map(|w| w.grad().copy()).collect();
        for w in &ws {
            let _ = w.grad().zero_();
        }

        // plain run from the same generator state
        tch::manual_seed(7);
        let mut x = x0.shallow_clone();
        for i in 0..4 {
            x = seg(i, &x).unwrap();
        }
        let after_plain = Tensor::randn([8], opts);
        assert_eq!(
            Vec::<f64>::try_from(&after_ck).unwrap(),
            Vec::<f64>::try_from(&after_plain).unwrap()
        );
        let loss = x.pow_tensor_scalar(2).sum(Kind::Double);
        let (l1, l2) = (loss.double_value(&[]), loss_ck.double_value(&[]));
        assert!((l1 - l2).abs() < 1e-12, "{l1} vs {l2}");
        loss.backward();
        for (a, w) in grads_ck.iter().zip(&ws) {
            let diff = (a - w.grad()).abs().max().double_value(&[]);
            assert!(diff < 1e-12, "weight grad differs by {diff}");
            assert!(a.abs().sum(Kind::Double).double_value(&[]) > 0.0);
        }
        let diff = (g0 - x0.grad()).abs().max().double_value(&[]);
        assert!(diff < 1e-12, "input grad differs by {diff}");
    }

    #[test]
    fn undefined_output_gradient_is_an_error() {
        let _lock = crate::test_rng_lock();
        let x0 = Tensor::ones([2], (Kind::Float, Device::Cpu));
        let seg = |_: usize, x: &Tensor| -> Result<Tensor> { Ok(x.f_mul_scalar(2.0)?) };
        let (_h, tape) = SegmentTape::forward(&x0, 2, seg).unwrap();
        assert_eq!(tape.len(), 2);
        assert!(matches!(
            tape.backward(&Tensor::new(), seg),
            Err(Error::InvalidArgument(_))
        ));
    }
}
