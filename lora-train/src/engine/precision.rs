//! Mixed precision: bf16 autocast (CPU and CUDA, through the libtorch shim), fp16 autocast with
//! dynamic loss scaling (CUDA), and full-bf16 training. Adapters stay fp32 unless full-bf16.
//!
//! The loss scaler follows `torch.amp.GradScaler` (`torch/amp/grad_scaler.py`): scale the loss,
//! unscale the gradients with `_amp_non_finite_check_and_unscale_` (recording whether any
//! gradient is inf/NaN), skip the optimizer step when one is, and update the scale with
//! `_amp_update_scale_` (×`backoff_factor` on overflow, ×`growth_factor` after `growth_interval`
//! clean steps).

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use lora_core::sys::AutocastGuard;

use crate::engine::error::{Result, TrainError};

/// How the forward/backward runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Everything fp32 (`mixed_precision: "no"`, accelerate's and kohya's name, which is also
    /// how it is written; `"fp32"` reads as this too).
    #[default]
    #[serde(rename = "no", alias = "fp32")]
    Fp32,
    /// bf16 autocast for matmuls/convs; fp32 adapters, gradients and optimizer (CPU and CUDA).
    Bf16,
    /// fp16 autocast with dynamic loss scaling; fp32 adapters (CUDA).
    Fp16,
    /// Adapters (and the base) in bf16, no autocast, no loss scaling.
    FullBf16,
}

impl Precision {
    /// Parses `mixed_precision` values: `"no"`/`"fp32"`, `"bf16"`, `"fp16"`, `"full_bf16"`.
    ///
    /// # Errors
    /// Another value, listing the accepted ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "no" | "fp32" | "float32" | "none" => Self::Fp32,
            "bf16" | "bfloat16" => Self::Bf16,
            "fp16" | "float16" | "half" => Self::Fp16,
            "full_bf16" => Self::FullBf16,
            _ => {
                return Err(TrainError::Invalid {
                    what: "mixed_precision".into(),
                    value: name.into(),
                    hint: "use one of \"no\", \"bf16\", \"fp16\", \"full_bf16\"".into(),
                });
            }
        })
    }

    /// The `mixed_precision` name (accelerate's and kohya's: `no`, `bf16`, `fp16`; kohya's
    /// `full_bf16`), as serialized.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fp32 => "no",
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
            Self::FullBf16 => "full_bf16",
        }
    }

    /// The dtype trainable adapter tensors should have (`Float`, or `BFloat16` for full-bf16).
    pub fn adapter_kind(self) -> Kind {
        match self {
            Self::FullBf16 => Kind::BFloat16,
            _ => Kind::Float,
        }
    }

    /// Whether the loss is scaled ([`GradScaler`]).
    pub fn uses_loss_scaling(self) -> bool {
        self == Self::Fp16
    }

    /// Checks the precision is usable on `device` (fp16 autocast needs CUDA).
    ///
    /// # Errors
    /// fp16 on CPU, with a hint to use bf16.
    pub fn check_device(self, device: Device) -> Result<()> {
        if self == Self::Fp16 && device == Device::Cpu {
            return Err(TrainError::Invalid {
                what: "mixed_precision".into(),
                value: "fp16".into(),
                hint: "fp16 with loss scaling needs a CUDA device; use \"bf16\" on CPU".into(),
            });
        }
        Ok(())
    }

    /// Enters autocast for one forward pass (bf16 or fp16), or nothing for fp32/full-bf16.
    /// Hold the guard across the forward and loss, drop it before `backward`.
    ///
    /// # Errors
    /// A shim error.
    pub fn autocast(self, device: Device) -> Result<Option<AutocastGuard>> {
        Ok(match self {
            Self::Bf16 => Some(AutocastGuard::new(device, Kind::BFloat16)?),
            Self::Fp16 => Some(AutocastGuard::new(device, Kind::Half)?),
            Self::Fp32 | Self::FullBf16 => None,
        })
    }
}

/// Saved state of a [`GradScaler`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ScalerState {
    /// The current loss scale.
    pub scale: f64,
    /// Clean steps since the last change of scale.
    pub growth_tracker: i64,
}

/// Dynamic loss scaling for fp16 (`torch.amp.GradScaler` defaults: init 2¹⁶, growth 2,
/// backoff 0.5, interval 2000).
#[derive(Debug)]
pub struct GradScaler {
    scale: Tensor,
    growth_tracker: Tensor,
    /// Multiplier after `growth_interval` clean steps.
    pub growth_factor: f64,
    /// Multiplier after an overflow.
    pub backoff_factor: f64,
    /// Clean steps before growing.
    pub growth_interval: i64,
}

impl GradScaler {
    /// A scaler with `torch.amp.GradScaler`'s defaults on `device`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn new(device: Device) -> Result<Self> {
        Self::with_scale(device, 65536.0)
    }

    /// A scaler starting at `init_scale`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn with_scale(device: Device, init_scale: f64) -> Result<Self> {
        Ok(Self {
            scale: Tensor::f_full([1], init_scale, (Kind::Float, device))?,
            growth_tracker: Tensor::f_zeros([1], (Kind::Int, device))?,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        })
    }

    /// The current scale.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn scale_value(&self) -> Result<f64> {
        Ok(self.scale.f_double_value(&[0])?)
    }

    /// `loss · scale` (fp32).
    ///
    /// # Errors
    /// A libtorch error.
    pub fn scale_loss(&self, loss: &Tensor) -> Result<Tensor> {
        Ok(loss
            .f_to_kind(Kind::Float)?
            .f_mul(&self.scale.f_to_device(loss.device())?.f_squeeze()?)?)
    }

    /// Divides every defined gradient of `params` by the scale in place and reports whether any
    /// gradient had an inf/NaN (`_amp_non_finite_check_and_unscale_` on CUDA; the same arithmetic
    /// on CPU, where that kernel does not exist).
    ///
    /// # Errors
    /// A libtorch error.
    pub fn unscale(&self, params: &[Tensor]) -> Result<bool> {
        let _ng = tch::no_grad_guard();
        let mut found_inf = Tensor::f_zeros([1], (Kind::Float, self.scale.device()))?;
        let inv_scale = self.scale.f_reciprocal()?;
        for p in params {
            let mut g = p.f_grad()?;
            if !g.defined() {
                continue;
            }
            if g.device().is_cuda() {
                g.f_internal_amp_non_finite_check_and_unscale(&mut found_inf, &inv_scale)?;
            } else {
                let _ = g.f_mul_(&inv_scale.f_to_device(g.device())?)?;
                let all_finite = g.f_isfinite()?.f_all()?.f_int64_value(&[])? != 0;
                if !all_finite {
                    let _ = found_inf.f_fill_(1.0)?;
                }
            }
        }
        Ok(found_inf.f_double_value(&[0])? != 0.0)
    }

    /// Updates the scale after a step (`_amp_update_scale_`): backs off when `found_inf`, grows
    /// after `growth_interval` clean steps.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn update(&mut self, found_inf: bool) -> Result<()> {
        let found = Tensor::f_full(
            [1],
            if found_inf { 1.0 } else { 0.0 },
            (Kind::Float, self.scale.device()),
        )?;
        if self.scale.device().is_cuda() {
            let _ = self.scale.f_internal_amp_update_scale_(
                &self.growth_tracker,
                &found,
                self.growth_factor,
                self.backoff_factor,
                self.growth_interval,
            )?;
        } else {
            let mut st = self.state()?;
            if found_inf {
                st.scale *= self.backoff_factor;
                st.growth_tracker = 0;
            } else {
                st.growth_tracker += 1;
                if st.growth_tracker == self.growth_interval {
                    st.scale *= self.growth_factor;
                    st.growth_tracker = 0;
                }
            }
            self.load_state(st)?;
        }
        Ok(())
    }

    /// The state to checkpoint.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn state(&self) -> Result<ScalerState> {
        Ok(ScalerState {
            scale: self.scale.f_double_value(&[0])?,
            growth_tracker: self.growth_tracker.f_int64_value(&[0])?,
        })
    }

    /// Restores a checkpointed state.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn load_state(&mut self, st: ScalerState) -> Result<()> {
        let _ = self.scale.f_fill_(st.scale)?;
        let _ = self.growth_tracker.f_fill_(st.growth_tracker)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        assert_eq!(Precision::from_name("no").unwrap(), Precision::Fp32);
        assert_eq!(Precision::from_name("BF16").unwrap(), Precision::Bf16);
        assert!(
            Precision::from_name("fp8")
                .unwrap_err()
                .to_string()
                .contains("full_bf16")
        );
        assert!(Precision::Fp16.check_device(Device::Cpu).is_err());
        assert_eq!(Precision::FullBf16.adapter_kind(), Kind::BFloat16);
    }

    #[test]
    fn bf16_autocast_runs_linear_in_bf16_and_restores() {
        let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        let w = Tensor::ones([4, 3], (Kind::Float, Device::Cpu));
        {
            let _g = Precision::Bf16.autocast(Device::Cpu).unwrap();
            assert_eq!(x.linear::<Tensor>(&w, None).kind(), Kind::BFloat16);
        }
        assert_eq!(x.linear::<Tensor>(&w, None).kind(), Kind::Float);
        assert!(Precision::Fp32.autocast(Device::Cpu).unwrap().is_none());
    }

    #[test]
    fn scaler_unscales_detects_inf_and_updates() {
        let p = Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut s = GradScaler::with_scale(Device::Cpu, 8.0).unwrap();
        s.growth_interval = 2;
        let loss = (&p + 1.0).sum(Kind::Float);
        s.scale_loss(&loss).unwrap().backward();
        assert_eq!(p.grad().double_value(&[0]), 8.0);
        assert!(!s.unscale(std::slice::from_ref(&p)).unwrap());
        assert_eq!(p.grad().double_value(&[0]), 1.0);
        s.update(false).unwrap();
        s.update(false).unwrap();
        assert_eq!(
            s.state().unwrap(),
            ScalerState {
                scale: 16.0,
                growth_tracker: 0
            }
        );
        let _ = p.grad().fill_(f64::INFINITY);
        assert!(s.unscale(std::slice::from_ref(&p)).unwrap());
        s.update(true).unwrap();
        assert_eq!(
            s.state().unwrap(),
            ScalerState {
                scale: 8.0,
                growth_tracker: 0
            }
        );
    }
}
