//! Rectified flow (flow matching) for FLUX.1: the training objective with its timestep
//! sampling, and the Euler sampler of diffusers' `FlowMatchEulerDiscreteScheduler`.
//!
//! Rectified flow (Liu et al. 2022, arXiv:2209.03003; Esser et al. 2024, "Scaling Rectified Flow
//! Transformers", arXiv:2403.03206, SD3) moves on the straight line between data and noise:
//! `x_σ = (1 − σ)·x0 + σ·ε`, `σ ∈ [0, 1]`, and the model predicts the velocity
//! `v = dx_σ/dσ = ε − x0`. FLUX.1 takes `σ` itself as its timestep input (kohya sd-scripts
//! passes `timesteps / 1000 = σ`; diffusers' `FluxPipeline` passes `t / 1000`).
//!
//! - [`TimestepSampling`] / [`FlowMatchingLoss`]: kohya sd-scripts
//!   `library/flux_train_utils.py::get_noisy_model_input_and_timesteps` (`--timestep_sampling`
//!   `uniform`, `sigmoid`, `shift`, `flux_shift`, and the `sigma` branch with
//!   `--weighting_scheme` `uniform`, `logit_normal` or `mode`), the loss of diffusers'
//!   `examples/dreambooth/train_dreambooth_lora_flux.py` (raw velocity prediction, MSE in f32,
//!   optional SD3 loss weighting `sigma_sqrt` / `cosmap`).
//! - [`FlowMatchEulerSampler`] / [`sample_flow`]: `FlowMatchEulerDiscreteScheduler` of
//!   diffusers 0.42.1 (`set_timesteps` with static or dynamic shifting, `step`) driven as
//!   `FluxPipeline.__call__` drives it.

use std::f64::consts::PI;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// FLUX.1's resolution-dependent shift `μ` (diffusers `pipeline_flux.py::calculate_shift`,
/// kohya `flux_train_utils.get_lin_function`): linear in the packed image sequence length, from
/// `base_shift` at `base_seq_len` to `max_shift` at `max_seq_len` (0.5 at 256 tokens, 1.15 at
/// 4096 = a 1024² image: latents `[16, 128, 128]` packed 2×2 into 64·64 tokens).
pub fn calculate_shift(
    image_seq_len: f64,
    base_seq_len: f64,
    max_seq_len: f64,
    base_shift: f64,
    max_shift: f64,
) -> f64 {
    let m = (max_shift - base_shift) / (max_seq_len - base_seq_len);
    let b = base_shift - m * base_seq_len;
    image_seq_len * m + b
}

/// The exponential time shift `e^μ / (e^μ + (1/t − 1)^s)` (diffusers
/// `FlowMatchEulerDiscreteScheduler._time_shift_exponential`, kohya `time_shift`, BFL
/// `sampling.py::time_shift`); `t = 0` maps to 0 and `t = 1` to 1.
pub fn time_shift(mu: f64, sigma: f64, t: f64) -> f64 {
    if t <= 0.0 {
        return 0.0;
    }
    mu.exp() / (mu.exp() + (1.0 / t - 1.0).powf(sigma))
}

/// The static shift `s·σ / (1 + (s − 1)·σ)` (diffusers `FlowMatchEulerDiscreteScheduler`
/// `shift`, kohya `discrete_flow_shift`, SD3 §5.3.2 "resolution-dependent shifting").
pub fn shift_sigma(shift: f64, sigma: f64) -> f64 {
    shift * sigma / (1.0 + (shift - 1.0) * sigma)
}

/// How training draws `σ ∈ (0, 1)` per sample: kohya sd-scripts' `--timestep_sampling` (and
/// its `--weighting_scheme` densities for the `sigma` choice).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TimestepSampling {
    /// `σ ~ U(0, 1)` (`uniform`).
    Uniform,
    /// `σ = sigmoid(sigmoid_scale · z)`, `z ~ N(0, 1)` (`sigmoid`, from XLabs' x-flux; kohya's
    /// default scale 1.0).
    Sigmoid {
        /// `--sigmoid_scale`.
        sigmoid_scale: f64,
    },
    /// `σ = shift(sigmoid(sigmoid_scale · z))` with [`shift_sigma`] (`shift`; kohya's default
    /// `discrete_flow_shift` is 3.0).
    Shift {
        /// `--sigmoid_scale`.
        sigmoid_scale: f64,
        /// `--discrete_flow_shift`.
        discrete_flow_shift: f64,
    },
    /// `σ = time_shift(μ, 1, sigmoid(sigmoid_scale · z))` with `μ` from the packed sequence
    /// length `(H/2)·(W/2)` of the latents by [`calculate_shift`] (256 → 0.5, 4096 → 1.15)
    /// (`flux_shift`).
    FluxShift {
        /// `--sigmoid_scale`.
        sigmoid_scale: f64,
    },
    /// kohya's default `sigma`: `u ~ U(0, 1)` (its `--weighting_scheme` `uniform` / `none`), then
    /// the discrete training sigma of index `⌊u·1000⌋`, `σ = shift(1 − ⌊1000·u⌋ / 1000)`
    /// ([`shift_sigma`] with `discrete_flow_shift`, kohya's default 3.0).
    Sigma {
        /// `--discrete_flow_shift` of the training scheduler.
        discrete_flow_shift: f64,
    },
    /// SD3's logit-normal density (Esser et al. 2024 §3.1): `u = sigmoid(n)`,
    /// `n ~ N(logit_mean, logit_std²)`, then, as kohya's `sigma` branch and diffusers' FLUX
    /// training script do, the discrete training sigma of index `⌊u·1000⌋`:
    /// `σ = shift(1 − ⌊1000·u⌋ / 1000)` ([`shift_sigma`] with `discrete_flow_shift`, 1.0 =
    /// none).
    LogitNormal {
        /// `--logit_mean` (default 0).
        logit_mean: f64,
        /// `--logit_std` (default 1).
        logit_std: f64,
        /// `--discrete_flow_shift` of the training scheduler.
        discrete_flow_shift: f64,
    },
    /// SD3's mode density (§3.1, "mode sampling with heavy tails"):
    /// `u = 1 − v − mode_scale·(cos²(π·v/2) − 1 + v)`, `v ~ U(0, 1)`, then the discrete sigma as
    /// for [`TimestepSampling::LogitNormal`].
    Mode {
        /// `--mode_scale` (default 1.29).
        mode_scale: f64,
        /// `--discrete_flow_shift` of the training scheduler.
        discrete_flow_shift: f64,
    },
}

/// kohya's and diffusers' training scheduler size (`num_train_timesteps`).
const TRAIN_TIMESTEPS: f64 = 1000.0;

impl TimestepSampling {
    fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f64| {
            Err(Error::InvalidArgument(format!(
                "timestep sampling: {what} must be positive and finite, got {v}"
            )))
        };
        match *self {
            Self::Uniform => Ok(()),
            Self::Sigmoid { sigmoid_scale } | Self::FluxShift { sigmoid_scale }
                if !(sigmoid_scale.is_finite() && sigmoid_scale > 0.0) =>
            {
                bad("sigmoid_scale", sigmoid_scale)
            }
            Self::Shift {
                sigmoid_scale,
                discrete_flow_shift,
            } => {
                if !(sigmoid_scale.is_finite() && sigmoid_scale > 0.0) {
                    bad("sigmoid_scale", sigmoid_scale)
                } else if !(discrete_flow_shift.is_finite() && discrete_flow_shift > 0.0) {
                    bad("discrete_flow_shift", discrete_flow_shift)
                } else {
                    Ok(())
                }
            }
            Self::LogitNormal {
                logit_std,
                logit_mean,
                discrete_flow_shift,
            } => {
                if !(logit_std.is_finite() && logit_std > 0.0) {
                    bad("logit_std", logit_std)
                } else if !logit_mean.is_finite() {
                    Err(Error::InvalidArgument(format!(
                        "timestep sampling: logit_mean must be finite, got {logit_mean}"
                    )))
                } else if !(discrete_flow_shift.is_finite() && discrete_flow_shift > 0.0) {
                    bad("discrete_flow_shift", discrete_flow_shift)
                } else {
                    Ok(())
                }
            }
            Self::Sigma {
                discrete_flow_shift,
            } if !(discrete_flow_shift.is_finite() && discrete_flow_shift > 0.0) => {
                bad("discrete_flow_shift", discrete_flow_shift)
            }
            Self::Mode {
                mode_scale,
                discrete_flow_shift,
            } => {
                if !mode_scale.is_finite() {
                    Err(Error::InvalidArgument(format!(
                        "timestep sampling: mode_scale must be finite, got {mode_scale}"
                    )))
                } else if !(discrete_flow_shift.is_finite() && discrete_flow_shift > 0.0) {
                    bad("discrete_flow_shift", discrete_flow_shift)
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }

    /// Draws `σ` `[batch]` f32 on `device` from libtorch's default generator, for latents of
    /// spatial size `latent_hw` (`(H, W)` of `[B, 16, H, W]`; only
    /// [`TimestepSampling::FluxShift`] uses it).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for invalid parameters or `batch < 1`; [`Error::Torch`].
    pub fn sample_sigmas(
        &self,
        batch: i64,
        latent_hw: (i64, i64),
        device: Device,
    ) -> Result<Tensor> {
        self.check()?;
        if batch < 1 {
            return Err(Error::InvalidArgument(format!(
                "timestep sampling needs batch ≥ 1, got {batch}"
            )));
        }
        let opts = (Kind::Float, device);
        let sig = |scale: f64| -> Result<Tensor> {
            Ok(Tensor::f_randn([batch], opts)?
                .f_mul_scalar(scale)?
                .f_sigmoid()?)
        };
        // σ of the discrete training schedule at index ⌊1000·u⌋ (u < 1)
        let discrete = |u: Tensor, shift: f64| -> Result<Tensor> {
            let i = u
                .f_mul_scalar(TRAIN_TIMESTEPS)?
                .f_floor()?
                .f_clamp(0.0, TRAIN_TIMESTEPS - 1.0)?;
            let s = i.f_div_scalar(-TRAIN_TIMESTEPS)?.f_add_scalar(1.0)?;
            shift_tensor(&s, shift)
        };
        match *self {
            Self::Uniform => Ok(Tensor::f_rand([batch], opts)?),
            Self::Sigmoid { sigmoid_scale } => sig(sigmoid_scale),
            Self::Shift {
                sigmoid_scale,
                discrete_flow_shift,
            } => shift_tensor(&sig(sigmoid_scale)?, discrete_flow_shift),
            Self::FluxShift { sigmoid_scale } => {
                let (h, w) = latent_hw;
                let mu = calculate_shift(((h / 2) * (w / 2)) as f64, 256.0, 4096.0, 0.5, 1.15);
                time_shift_tensor(&sig(sigmoid_scale)?, mu)
            }
            Self::Sigma {
                discrete_flow_shift,
            } => discrete(Tensor::f_rand([batch], opts)?, discrete_flow_shift),
            Self::LogitNormal {
                logit_mean,
                logit_std,
                discrete_flow_shift,
            } => {
                let u = Tensor::f_randn([batch], opts)?
                    .f_mul_scalar(logit_std)?
                    .f_add_scalar(logit_mean)?
                    .f_sigmoid()?;
                discrete(u, discrete_flow_shift)
            }
            Self::Mode {
                mode_scale,
                discrete_flow_shift,
            } => {
                let v = Tensor::f_rand([batch], opts)?;
                let c = v.f_mul_scalar(PI / 2.0)?.f_cos()?.f_square()?;
                let u = v
                    .f_neg()?
                    .f_add_scalar(1.0)?
                    .f_sub(&c.f_sub_scalar(1.0)?.f_add(&v)?.f_mul_scalar(mode_scale)?)?;
                discrete(u, discrete_flow_shift)
            }
        }
    }
}

/// [`shift_sigma`] elementwise.
fn shift_tensor(s: &Tensor, shift: f64) -> Result<Tensor> {
    Ok(s.f_mul_scalar(shift)?
        .f_div(&s.f_mul_scalar(shift - 1.0)?.f_add_scalar(1.0)?)?)
}

/// [`time_shift`] with exponent 1 elementwise: `e^μ / (e^μ + 1/t − 1)`.
fn time_shift_tensor(t: &Tensor, mu: f64) -> Result<Tensor> {
    let e = mu.exp();
    let d = t.f_reciprocal()?.f_sub_scalar(1.0)?.f_add_scalar(e)?;
    Ok(d.f_reciprocal()?.f_mul_scalar(e)?)
}

/// SD3's loss weighting (diffusers `training_utils.compute_loss_weighting_for_sd3`, kohya
/// `compute_loss_weighting_for_sd3`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossWeighting {
    /// Weight 1 (`none`, `uniform`, `logit_normal`, `mode`: their density is in the sampling).
    #[default]
    None,
    /// `σ⁻²` (`sigma_sqrt`).
    SigmaSqrt,
    /// `2 / (π·(1 − 2σ + 2σ²))` (`cosmap`, SD3 §3.1).
    CosMap,
}

/// The tensors of one flow-matching step before the model runs.
#[derive(Debug)]
pub struct FlowNoisedBatch {
    /// ε `[batch, …]`, latents' dtype.
    pub noise: Tensor,
    /// σ `[batch]` f32: also the model's timestep input (FLUX takes `t = σ`).
    pub sigmas: Tensor,
    /// `x_σ = (1 − σ)·x0 + σ·ε` `[batch, …]`, latents' dtype.
    pub noisy_latents: Tensor,
    /// The velocity `ε − x0` `[batch, …]`, latents' dtype.
    pub target: Tensor,
}

/// The flow-matching training loss: timestep sampling plus loss weighting, generic over the
/// model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlowMatchingLoss {
    /// How σ is drawn.
    pub sampling: TimestepSampling,
    /// How each sample's MSE is weighted.
    pub weighting: LossWeighting,
}

impl FlowMatchingLoss {
    /// Checks the sampling parameters.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-positive scale, std or shift.
    pub fn new(sampling: TimestepSampling, weighting: LossWeighting) -> Result<Self> {
        sampling.check()?;
        Ok(Self {
            sampling,
            weighting,
        })
    }

    /// `x_σ = (1 − σ)·x0 + σ·ε` and the target `ε − x0` for given `noise` and `sigmas`
    /// `[batch]` (kohya `get_noisy_model_input_and_timesteps` without its `ip_noise_gamma`).
    /// The arithmetic runs in f32; the results take the latents' dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the shapes disagree; [`Error::Torch`].
    pub fn noised_with(
        &self,
        latents: &Tensor,
        noise: &Tensor,
        sigmas: &Tensor,
    ) -> Result<FlowNoisedBatch> {
        let sz = latents.size();
        if sz.is_empty() || noise.size() != sz || sigmas.size() != [sz[0]] {
            return Err(Error::InvalidArgument(format!(
                "flow matching needs latents and noise of one shape [batch, …] and sigmas [batch]: \
                 got {sz:?}, {:?}, {:?}",
                noise.size(),
                sigmas.size()
            )));
        }
        let kind = latents.kind();
        let mut view = vec![sz[0]];
        view.extend(std::iter::repeat_n(1, sz.len() - 1));
        let s = sigmas.f_to_kind(Kind::Float)?.f_view(view.as_slice())?;
        let x0 = latents.f_to_kind(Kind::Float)?;
        let eps = noise.f_to_kind(Kind::Float)?;
        let noisy = x0
            .f_mul(&s.f_neg()?.f_add_scalar(1.0)?)?
            .f_add(&eps.f_mul(&s)?)?;
        Ok(FlowNoisedBatch {
            noise: noise.shallow_clone(),
            sigmas: sigmas.f_to_kind(Kind::Float)?,
            noisy_latents: noisy.f_to_kind(kind)?,
            target: eps.f_sub(&x0)?.f_to_kind(kind)?,
        })
    }

    /// Draws ε ~ N(0, 1) like `latents` and σ by [`TimestepSampling::sample_sigmas`] (spatial
    /// size from the last two axes), then [`Self::noised_with`].
    ///
    /// # Errors
    /// As [`Self::noised_with`].
    pub fn noised(&self, latents: &Tensor) -> Result<FlowNoisedBatch> {
        let sz = latents.size();
        if sz.len() < 3 {
            return Err(Error::InvalidArgument(format!(
                "flow matching latents must be [batch, channels, height, width], got {sz:?}"
            )));
        }
        let hw = (sz[sz.len() - 2], sz[sz.len() - 1]);
        let sigmas = self.sampling.sample_sigmas(sz[0], hw, latents.device())?;
        let noise = latents.f_randn_like()?;
        self.noised_with(latents, &noise, &sigmas)
    }

    /// Per-sample weights `[batch]` f32 for `sigmas` ([`LossWeighting`]).
    ///
    /// # Errors
    /// [`Error::Torch`].
    pub fn weights(&self, sigmas: &Tensor) -> Result<Tensor> {
        let s = sigmas.f_to_kind(Kind::Float)?;
        Ok(match self.weighting {
            LossWeighting::None => s.f_ones_like()?,
            LossWeighting::SigmaSqrt => s.f_square()?.f_reciprocal()?,
            LossWeighting::CosMap => {
                let bot = s
                    .f_mul_scalar(-2.0)?
                    .f_add_scalar(1.0)?
                    .f_add(&s.f_square()?.f_mul_scalar(2.0)?)?;
                bot.f_mul_scalar(PI)?.f_reciprocal()?.f_mul_scalar(2.0)?
            }
        })
    }

    /// `mean_b(w_b · mean((pred − target)²))` in f32, a 0-d tensor (diffusers'
    /// `train_dreambooth_lora_flux.py`: `mean((w·(pred − target)²).reshape(b, −1), 1).mean()`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `pred` is not shaped like the target; [`Error::Torch`].
    pub fn loss_from_prediction(&self, pred: &Tensor, batch: &FlowNoisedBatch) -> Result<Tensor> {
        if pred.size() != batch.target.size() {
            return Err(Error::InvalidArgument(format!(
                "the model's prediction {:?} is not shaped like the target {:?}",
                pred.size(),
                batch.target.size()
            )));
        }
        let b = pred.size()[0];
        let se = pred
            .f_to_kind(Kind::Float)?
            .f_sub(&batch.target.f_to_kind(Kind::Float)?)?
            .f_square()?
            .f_reshape([b, -1])?
            .f_mean_dim(1, false, Kind::Float)?;
        Ok(se
            .f_mul(&self.weights(&batch.sigmas)?)?
            .f_mean(Kind::Float)?)
    }

    /// One training loss: [`Self::noised`], `model(noisy_latents, sigmas)` (the velocity
    /// prediction; FLUX's timestep input is σ), [`Self::loss_from_prediction`].
    ///
    /// # Errors
    /// What `model` returns; as the steps above.
    pub fn loss<F>(&self, latents: &Tensor, model: F) -> Result<Tensor>
    where
        F: FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
    {
        let batch = self.noised(latents)?;
        let pred = model(&batch.noisy_latents, &batch.sigmas)?;
        self.loss_from_prediction(&pred, &batch)
    }
}

/// diffusers `FlowMatchEulerDiscreteScheduler`'s configuration (`scheduler_config.json`; the
/// keys FLUX uses, other keys ignored).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FlowMatchConfig {
    /// Training steps (1000).
    pub num_train_timesteps: i64,
    /// Static shift ([`shift_sigma`]); unused with dynamic shifting.
    pub shift: f64,
    /// Resolution-dependent shifting by [`time_shift`] with `μ` from [`calculate_shift`].
    pub use_dynamic_shifting: bool,
    /// `μ` at `base_image_seq_len`.
    pub base_shift: f64,
    /// `μ` at `max_image_seq_len`.
    pub max_shift: f64,
    /// Packed sequence length of `base_shift` (256).
    pub base_image_seq_len: i64,
    /// Packed sequence length of `max_shift` (4096).
    pub max_image_seq_len: i64,
}

impl Default for FlowMatchConfig {
    /// diffusers' constructor defaults.
    fn default() -> Self {
        Self {
            num_train_timesteps: 1000,
            shift: 1.0,
            use_dynamic_shifting: false,
            base_shift: 0.5,
            max_shift: 1.15,
            base_image_seq_len: 256,
            max_image_seq_len: 4096,
        }
    }
}

impl FlowMatchConfig {
    /// FLUX.1-dev's `scheduler/scheduler_config.json`: `shift` 3.0, dynamic shifting on.
    pub fn flux_dev() -> Self {
        Self {
            shift: 3.0,
            use_dynamic_shifting: true,
            ..Self::default()
        }
    }

    /// FLUX.1-schnell's: static shift 1.0 (no shift).
    pub fn flux_schnell() -> Self {
        Self::default()
    }

    /// Reads `scheduler_config.json` (`_`-prefixed and unknown keys ignored).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`].
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })
    }

    /// `μ` for a packed image sequence length ([`calculate_shift`] with this config's ends).
    pub fn mu(&self, image_seq_len: i64) -> f64 {
        calculate_shift(
            image_seq_len as f64,
            self.base_image_seq_len as f64,
            self.max_image_seq_len as f64,
            self.base_shift,
            self.max_shift,
        )
    }

    /// The shift of `set_timesteps`: static, or [`time_shift`] with `mu`.
    fn apply(&self, s: f64, mu: Option<f64>) -> Result<f64> {
        if self.use_dynamic_shifting {
            let mu = mu.ok_or_else(|| {
                Error::InvalidArgument(
                    "this scheduler shifts dynamically: give mu (FlowMatchConfig::mu of the \
                     packed image sequence length)"
                        .into(),
                )
            })?;
            Ok(time_shift(mu, 1.0, s))
        } else {
            Ok(shift_sigma(self.shift, s))
        }
    }
}

/// The Euler sampler of rectified flow: diffusers `FlowMatchEulerDiscreteScheduler`
/// (`set_timesteps`, `step`), without its Karras / exponential / beta sigma options,
/// `shift_terminal` or stochastic sampling.
#[derive(Debug, Clone)]
pub struct FlowMatchEulerSampler {
    config: FlowMatchConfig,
    sigmas: Vec<f64>,
    timesteps: Vec<f64>,
}

impl FlowMatchEulerSampler {
    /// The schedule `FluxPipeline.__call__` sets: `sigmas = linspace(1, 1/n, n)`, shifted (with
    /// `μ = config.mu(image_seq_len)` when the config shifts dynamically), then a final 0.
    /// `image_seq_len` is the packed latent length `(H/2)·(W/2)` of `[16, H, W]` latents
    /// (4096 at 1024²).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `num_inference_steps < 1`.
    pub fn flux(
        config: FlowMatchConfig,
        num_inference_steps: usize,
        image_seq_len: i64,
    ) -> Result<Self> {
        if num_inference_steps == 0 {
            return Err(Error::InvalidArgument(
                "num_inference_steps must be at least 1".into(),
            ));
        }
        let n = num_inference_steps;
        let first = 1.0;
        let last = 1.0 / n as f64;
        let sigmas: Vec<f64> = (0..n)
            .map(|i| {
                if n == 1 {
                    first
                } else {
                    first + (last - first) * i as f64 / (n - 1) as f64
                }
            })
            .collect();
        let mu = config.mu(image_seq_len);
        Self::from_sigmas(config, &sigmas, Some(mu))
    }

    /// `set_timesteps(num_inference_steps, mu=mu)` without given sigmas: timesteps evenly from
    /// `σ_max·T` to `σ_min·T` of the training schedule (whose sigmas carry the static shift
    /// when dynamic shifting is off), divided by `T`, shifted once more.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `num_inference_steps < 1`, or no `mu` under dynamic
    /// shifting.
    pub fn new(
        config: FlowMatchConfig,
        num_inference_steps: usize,
        mu: Option<f64>,
    ) -> Result<Self> {
        if num_inference_steps == 0 {
            return Err(Error::InvalidArgument(
                "num_inference_steps must be at least 1".into(),
            ));
        }
        let t = config.num_train_timesteps as f64;
        let train_min = 1.0 / t;
        let (s_max, s_min) = if config.use_dynamic_shifting {
            (1.0, train_min)
        } else {
            (
                shift_sigma(config.shift, 1.0),
                shift_sigma(config.shift, train_min),
            )
        };
        let n = num_inference_steps;
        let sigmas: Vec<f64> = (0..n)
            .map(|i| {
                let ts = if n == 1 {
                    s_max * t
                } else {
                    s_max * t + (s_min * t - s_max * t) * i as f64 / (n - 1) as f64
                };
                ts / t
            })
            .collect();
        Self::from_sigmas(config, &sigmas, mu)
    }

    /// `set_timesteps(sigmas=sigmas, mu=mu)`: the given sigmas shifted, a final 0 appended;
    /// timesteps `σ·T`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no sigmas, sigmas outside `(0, 1]`, no `mu` under
    /// dynamic shifting, or `num_train_timesteps < 1`.
    pub fn from_sigmas(config: FlowMatchConfig, sigmas: &[f64], mu: Option<f64>) -> Result<Self> {
        if config.num_train_timesteps < 1 {
            return Err(Error::InvalidArgument(format!(
                "num_train_timesteps must be at least 1, got {}",
                config.num_train_timesteps
            )));
        }
        if sigmas.is_empty() || sigmas.iter().any(|s| !(*s > 0.0 && *s <= 1.0)) {
            return Err(Error::InvalidArgument(format!(
                "flow-matching sigmas must be a non-empty list in (0, 1], got {sigmas:?}"
            )));
        }
        let t = config.num_train_timesteps as f64;
        let mut out = sigmas
            .iter()
            .map(|&s| config.apply(s, mu))
            .collect::<Result<Vec<f64>>>()?;
        let timesteps = out.iter().map(|s| s * t).collect();
        out.push(0.0);
        Ok(Self {
            config,
            sigmas: out,
            timesteps,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &FlowMatchConfig {
        &self.config
    }

    /// The `n + 1` sigmas, decreasing, ending with 0.
    pub fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }

    /// The `n` timesteps `σ·T` (the model gets `t / T`).
    pub fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// Number of steps.
    pub fn len(&self) -> usize {
        self.timesteps.len()
    }

    /// Whether there is no step (never true for a built sampler).
    pub fn is_empty(&self) -> bool {
        self.timesteps.is_empty()
    }

    /// Step `i`: `x + (σ_{i+1} − σ_i)·v` computed in f32, returned in `velocity`'s dtype
    /// (diffusers `FlowMatchEulerDiscreteScheduler.step`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `i ≥ len`; [`Error::Torch`] for mismatched shapes.
    pub fn step(&self, i: usize, velocity: &Tensor, sample: &Tensor) -> Result<Tensor> {
        if i >= self.len() {
            return Err(Error::InvalidArgument(format!(
                "step {i} of a {}-step schedule",
                self.len()
            )));
        }
        let dt = self.sigmas[i + 1] - self.sigmas[i];
        let x = sample
            .f_to_kind(Kind::Float)?
            .f_add(&velocity.f_to_kind(Kind::Float)?.f_mul_scalar(dt)?)?;
        Ok(x.f_to_kind(velocity.kind())?)
    }
}

/// Runs the sampler from `noise` `[batch, …]` (`σ = 1`): at each step
/// `model(x, t, guidance)` with `t = timesteps[i] / T` `[batch]` f32 (≈ σ, FLUX's timestep
/// input, as `FluxPipeline` divides by 1000) and `guidance` `[batch]` f32 filled with
/// `guidance` when given (FLUX.1-dev's distilled guidance, e.g. 3.5; `None` for schnell);
/// the model returns the velocity, shaped like `x`. The result has the noise's dtype.
///
/// # Errors
/// What `model` returns; [`Error::InvalidArgument`] for an empty `noise`.
pub fn sample_flow<F>(
    sampler: &FlowMatchEulerSampler,
    noise: &Tensor,
    guidance: Option<f64>,
    mut model: F,
) -> Result<Tensor>
where
    F: FnMut(&Tensor, &Tensor, Option<&Tensor>) -> Result<Tensor>,
{
    let sz = noise.size();
    if sz.is_empty() || sz[0] < 1 {
        return Err(Error::InvalidArgument(format!(
            "sampling needs noise [batch ≥ 1, …], got {sz:?}"
        )));
    }
    let (b, dev) = (sz[0], noise.device());
    let g = match guidance {
        Some(v) => Some(Tensor::f_full([b], v, (Kind::Float, dev))?),
        None => None,
    };
    let t_train = sampler.config.num_train_timesteps as f64;
    let mut x = noise.shallow_clone();
    for i in 0..sampler.len() {
        let t = Tensor::f_full([b], sampler.timesteps[i] / t_train, (Kind::Float, dev))?;
        let v = model(&x, &t, g.as_ref())?;
        x = sampler.step(i, &v, &x)?;
    }
    Ok(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shifts_match_their_formulas() {
        assert!((calculate_shift(256.0, 256.0, 4096.0, 0.5, 1.15) - 0.5).abs() < 1e-12);
        assert!((calculate_shift(4096.0, 256.0, 4096.0, 0.5, 1.15) - 1.15).abs() < 1e-12);
        // shift 3 at σ = 0.5: 1.5 / 2 = 0.75
        assert!((shift_sigma(3.0, 0.5) - 0.75).abs() < 1e-12);
        // μ = 0: the identity
        assert!((time_shift(0.0, 1.0, 0.3) - 0.3).abs() < 1e-12);
        assert_eq!(time_shift(1.15, 1.0, 0.0), 0.0);
        assert!((time_shift(1.15, 1.0, 1.0) - 1.0).abs() < 1e-12);
    }
}
