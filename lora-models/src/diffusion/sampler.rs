//! Samplers over a denoiser closure, with classifier-free guidance: DDIM with η = 0 (Song et al.
//! 2021, "Denoising Diffusion Implicit Models", arXiv:2010.02502, Eq. 12) and Euler
//! (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models",
//! arXiv:2206.00364, Algorithm 1 without churn; optional Karras σ spacing, Eq. 5, ρ = 7),
//! following diffusers' `DDIMScheduler` and `EulerDiscreteScheduler` step for step.
//!
//! Unlike diffusers' schedulers these keep no step counter: every call names the step index.

use tch::{Kind, Tensor};

use super::schedule::{NoiseSchedule, PredictionType};
use crate::error::{Error, Result};

/// How inference timesteps are placed in `0..T` (diffusers `timestep_spacing`; Lin et al. 2023,
/// Table 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimestepSpacing {
    /// `leading`: `k · (T / n) + steps_offset` for k = n−1 … 0 (SD1.x/SD2/SDXL configs, with
    /// `steps_offset` 1).
    Leading,
    /// `linspace`: `round(linspace(0, T − 1, n))` reversed.
    Linspace,
    /// `trailing`: `round(arange(T, 0, −T/n)) − 1`.
    Trailing,
}

/// The result of one step.
#[derive(Debug)]
pub struct StepOutput {
    /// The sample at the next (less noisy) step, the input's shape.
    pub prev_sample: Tensor,
    /// The model's estimate of x₀.
    pub pred_original_sample: Tensor,
}

/// A sampler: a fixed list of steps, each with the timestep the model is called with.
pub trait Sampler {
    /// The model timesteps, one per step (floats: Euler's Karras timesteps are fractional).
    fn timesteps(&self) -> &[f64];
    /// The standard deviation to scale initial N(0, I) noise by.
    fn init_noise_sigma(&self) -> f64;
    /// The model input at step `i` for the current sample `x`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a step out of range; [`Error::Torch`].
    fn scale_model_input(&self, x: &Tensor, i: usize) -> Result<Tensor>;
    /// One step from `x` at step `i` given the (guided) model output.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a step out of range; [`Error::Torch`].
    fn step(&self, model_output: &Tensor, i: usize, x: &Tensor) -> Result<StepOutput>;
}

fn out_of_range(i: usize, n: usize) -> Error {
    Error::InvalidArgument(format!(
        "step {i} is out of range (the sampler has {n} steps)"
    ))
}

/// Inference timesteps, largest first. `round_linspace`: DDIM rounds `linspace` timesteps to
/// integers, Euler keeps them fractional.
fn spaced_timesteps(
    t: i64,
    n: usize,
    spacing: TimestepSpacing,
    offset: i64,
    round_linspace: bool,
) -> Result<Vec<f64>> {
    if n == 0 || n as i64 > t {
        return Err(Error::InvalidArgument(format!(
            "num_inference_steps must be in 1..={t}, got {n}"
        )));
    }
    let n_i = n as i64;
    Ok(match spacing {
        TimestepSpacing::Leading => {
            let ratio = t / n_i;
            (0..n_i)
                .rev()
                .map(|k| (k * ratio + offset) as f64)
                .collect()
        }
        TimestepSpacing::Linspace => {
            let step = (t - 1) as f64 / (n_i - 1).max(1) as f64;
            (0..n_i)
                .rev()
                .map(|k| {
                    let v = if n == 1 { 0.0 } else { k as f64 * step };
                    if round_linspace {
                        v.round_ties_even()
                    } else {
                        v
                    }
                })
                .collect()
        }
        TimestepSpacing::Trailing => {
            let ratio = t as f64 / n as f64;
            let mut v = Vec::with_capacity(n);
            let mut x = t as f64;
            while x > 0.0 && v.len() < n {
                v.push(x.round_ties_even() - 1.0);
                x -= ratio;
            }
            v
        }
    })
}

/// Options of [`DdimSampler`]; the defaults are SD's `scheduler_config.json` values.
#[derive(Debug, Clone, PartialEq)]
pub struct DdimOptions {
    /// Timestep placement (SD: `leading`).
    pub timestep_spacing: TimestepSpacing,
    /// Added to `leading` timesteps (SD: 1).
    pub steps_offset: i64,
    /// ᾱ of the step after the last: 1 when true, ᾱ_0 when false (SD: false).
    pub set_alpha_to_one: bool,
    /// Clamp the x₀ estimate to `[−c, c]` (SD: off; diffusers' class default is 1.0).
    pub clip_sample: Option<f64>,
}

impl Default for DdimOptions {
    fn default() -> Self {
        Self {
            timestep_spacing: TimestepSpacing::Leading,
            steps_offset: 1,
            set_alpha_to_one: false,
            clip_sample: None,
        }
    }
}

/// Deterministic DDIM (η = 0), diffusers `DDIMScheduler.step`:
/// `x̂₀ = (x − √(1−ᾱ_t)·ε̂)/√ᾱ_t` (ε) or `√ᾱ_t·x − √(1−ᾱ_t)·v̂` (v), then
/// `x_prev = √ᾱ_prev·x̂₀ + √(1−ᾱ_prev)·ε̂` with `prev = t − T/n`.
#[derive(Debug, Clone)]
pub struct DdimSampler {
    ac: Vec<f32>,
    final_ac: f32,
    timesteps: Vec<f64>,
    step_ratio: i64,
    prediction: PredictionType,
    clip_sample: Option<f64>,
}

impl DdimSampler {
    /// `num_inference_steps` steps over `schedule`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 steps or more than `T`.
    pub fn new(
        schedule: &NoiseSchedule,
        num_inference_steps: usize,
        opts: &DdimOptions,
    ) -> Result<Self> {
        let t = schedule.num_train_timesteps();
        let timesteps = spaced_timesteps(
            t,
            num_inference_steps,
            opts.timestep_spacing,
            opts.steps_offset,
            true,
        )?;
        let ac = schedule.alphas_cumprod_values().to_vec();
        let final_ac = if opts.set_alpha_to_one { 1.0 } else { ac[0] };
        if timesteps.iter().any(|&x| x < 0.0 || x >= t as f64) {
            return Err(Error::InvalidArgument(format!(
                "steps_offset {} puts timesteps outside 0..{t}",
                opts.steps_offset
            )));
        }
        Ok(Self {
            ac,
            final_ac,
            timesteps,
            step_ratio: t / num_inference_steps as i64,
            prediction: schedule.config().prediction_type,
            clip_sample: opts.clip_sample,
        })
    }
}

impl Sampler for DdimSampler {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        1.0
    }

    fn scale_model_input(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        if i >= self.timesteps.len() {
            return Err(out_of_range(i, self.timesteps.len()));
        }
        Ok(x.shallow_clone())
    }

    fn step(&self, out: &Tensor, i: usize, x: &Tensor) -> Result<StepOutput> {
        let t = *self
            .timesteps
            .get(i)
            .ok_or_else(|| out_of_range(i, self.timesteps.len()))? as i64;
        let prev = t - self.step_ratio;
        let a_t = f64::from(self.ac[t as usize]);
        let a_prev = if prev >= 0 {
            f64::from(self.ac[prev as usize])
        } else {
            f64::from(self.final_ac)
        };
        let b_t = 1.0 - a_t;
        let (x0, eps) = match self.prediction {
            PredictionType::Epsilon => (
                x.f_sub(&out.f_mul_scalar(b_t.sqrt())?)?
                    .f_div_scalar(a_t.sqrt())?,
                out.shallow_clone(),
            ),
            PredictionType::VPrediction => (
                x.f_mul_scalar(a_t.sqrt())?
                    .f_sub(&out.f_mul_scalar(b_t.sqrt())?)?,
                out.f_mul_scalar(a_t.sqrt())?
                    .f_add(&x.f_mul_scalar(b_t.sqrt())?)?,
            ),
        };
        let x0 = match self.clip_sample {
            Some(c) => x0.f_clamp(-c, c)?,
            None => x0,
        };
        let prev_sample = x0
            .f_mul_scalar(a_prev.sqrt())?
            .f_add(&eps.f_mul_scalar((1.0 - a_prev).sqrt())?)?;
        Ok(StepOutput {
            prev_sample,
            pred_original_sample: x0,
        })
    }
}

/// Options of [`EulerSampler`]; the defaults are SD's `scheduler_config.json` values.
#[derive(Debug, Clone, PartialEq)]
pub struct EulerOptions {
    /// Timestep placement (SD: `leading`).
    pub timestep_spacing: TimestepSpacing,
    /// Added to `leading` timesteps (SD: 1).
    pub steps_offset: i64,
    /// Karras σ spacing (`use_karras_sigmas`): `σ_i = (σ_max^{1/ρ} + i/(n−1)·(σ_min^{1/ρ} −
    /// σ_max^{1/ρ}))^ρ`, ρ = 7, between the interpolated schedule's extremes; timesteps are then
    /// the (fractional) t whose σ is σ_i, by log-σ interpolation.
    pub use_karras_sigmas: bool,
}

impl Default for EulerOptions {
    fn default() -> Self {
        Self {
            timestep_spacing: TimestepSpacing::Leading,
            steps_offset: 1,
            use_karras_sigmas: false,
        }
    }
}

/// The Euler sampler of diffusers' `EulerDiscreteScheduler` (no churn, final σ 0):
/// σ_t = √((1 − ᾱ_t)/ᾱ_t); model input `x/√(σ²+1)`; `x̂₀ = x − σ·ε̂` (ε) or
/// `−σ/√(σ²+1)·v̂ + x/(σ²+1)` (v); `x ← x + (x − x̂₀)/σ · (σ_next − σ)`, in float32.
#[derive(Debug, Clone)]
pub struct EulerSampler {
    sigmas: Vec<f64>,
    timesteps: Vec<f64>,
    init_sigma: f64,
    prediction: PredictionType,
}

impl EulerSampler {
    /// `num_inference_steps` steps over `schedule` (with a zero-terminal-SNR schedule the last
    /// ᾱ is taken as 2⁻²⁴, as diffusers does, so that σ stays finite).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 steps or more than `T`.
    pub fn new(
        schedule: &NoiseSchedule,
        num_inference_steps: usize,
        opts: &EulerOptions,
    ) -> Result<Self> {
        let t = schedule.num_train_timesteps();
        let mut ac = schedule.alphas_cumprod_values().to_vec();
        if schedule.config().rescale_betas_zero_snr
            && let Some(last) = ac.last_mut()
        {
            *last = 2f32.powi(-24);
        }
        // σ table in f32 (diffusers computes it as a float32 tensor)
        let table: Vec<f64> = ac
            .iter()
            .map(|&a| f64::from(((1.0 - a) / a).sqrt()))
            .collect();
        let mut timesteps = spaced_timesteps(
            t,
            num_inference_steps,
            opts.timestep_spacing,
            opts.steps_offset,
            false,
        )?
        .into_iter()
        .map(|x| f64::from(x as f32))
        .collect::<Vec<_>>();
        // np.interp(timesteps, arange(T), sigmas)
        let interp = |x: f64| -> f64 {
            if x <= 0.0 {
                return table[0];
            }
            let last = table.len() - 1;
            if x >= last as f64 {
                return table[last];
            }
            let lo = x.floor() as usize;
            let w = x - lo as f64;
            table[lo] + w * (table[lo + 1] - table[lo])
        };
        let mut sigmas: Vec<f64> = timesteps.iter().map(|&x| interp(x)).collect();
        if opts.use_karras_sigmas {
            let rho = 7.0;
            let (smin, smax) = (sigmas[sigmas.len() - 1], sigmas[0]);
            let n = num_inference_steps;
            let (lo, hi) = (smin.powf(1.0 / rho), smax.powf(1.0 / rho));
            sigmas = (0..n)
                .map(|i| {
                    let r = if n == 1 {
                        0.0
                    } else {
                        i as f64 / (n - 1) as f64
                    };
                    (hi + r * (lo - hi)).powf(rho)
                })
                .collect();
            let log_table: Vec<f64> = table.iter().map(|s| f64::from((*s as f32).ln())).collect();
            timesteps = sigmas.iter().map(|&s| sigma_to_t(s, &log_table)).collect();
            timesteps = timesteps.into_iter().map(|x| f64::from(x as f32)).collect();
        }
        sigmas.push(0.0);
        let sigmas: Vec<f64> = sigmas.into_iter().map(|s| f64::from(s as f32)).collect();
        let max = sigmas.iter().copied().fold(0.0, f64::max);
        let init_sigma = match opts.timestep_spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max,
            TimestepSpacing::Leading => (max * max + 1.0).sqrt(),
        };
        Ok(Self {
            sigmas,
            timesteps,
            init_sigma,
            prediction: schedule.config().prediction_type,
        })
    }

    /// σ per step, plus the final 0 (`n + 1` values).
    pub fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }
}

/// The fractional timestep whose σ is `sigma`, interpolating linearly in log σ between the two
/// neighbouring table entries (diffusers `EulerDiscreteScheduler._sigma_to_t`).
fn sigma_to_t(sigma: f64, log_sigmas: &[f64]) -> f64 {
    let ls = sigma.max(1e-10).ln();
    let n = log_sigmas.len();
    // last index whose log σ is ≤ ls (σ increases with t), clipped to n − 2
    let mut low = 0usize;
    for (i, &l) in log_sigmas.iter().enumerate() {
        if ls - l >= 0.0 {
            low = i;
        }
    }
    let low = low.min(n - 2);
    let (lo, hi) = (log_sigmas[low], log_sigmas[low + 1]);
    let w = ((lo - ls) / (lo - hi)).clamp(0.0, 1.0);
    (1.0 - w) * low as f64 + w * (low + 1) as f64
}

impl Sampler for EulerSampler {
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    fn init_noise_sigma(&self) -> f64 {
        self.init_sigma
    }

    fn scale_model_input(&self, x: &Tensor, i: usize) -> Result<Tensor> {
        let s = *self
            .sigmas
            .get(i)
            .filter(|_| i < self.timesteps.len())
            .ok_or_else(|| out_of_range(i, self.timesteps.len()))?;
        Ok(x.f_div_scalar((s * s + 1.0).sqrt())?)
    }

    fn step(&self, out: &Tensor, i: usize, x: &Tensor) -> Result<StepOutput> {
        if i >= self.timesteps.len() {
            return Err(out_of_range(i, self.timesteps.len()));
        }
        let (s, s_next) = (self.sigmas[i], self.sigmas[i + 1]);
        let xf = x.f_to_kind(Kind::Float)?;
        let x0 = match self.prediction {
            PredictionType::Epsilon => xf.f_sub(&out.f_mul_scalar(s)?)?,
            PredictionType::VPrediction => out
                .f_mul_scalar(-s / (s * s + 1.0).sqrt())?
                .f_add(&xf.f_div_scalar(s * s + 1.0)?)?,
        };
        let d = xf.f_sub(&x0)?.f_div_scalar(s)?;
        let prev = xf
            .f_add(&d.f_mul_scalar(s_next - s)?)?
            .f_to_kind(out.kind())?;
        Ok(StepOutput {
            prev_sample: prev,
            pred_original_sample: x0,
        })
    }
}

/// Runs `sampler` from `noise` `[batch, C, H, W]` (N(0, I); scaled by the sampler's
/// `init_noise_sigma` here) and returns the final latents, same shape.
///
/// `model(x, t)` is the denoiser at timestep `t`. With `guidance_scale > 1` (classifier-free
/// guidance, Ho & Salimans 2022, arXiv:2207.12598; diffusers `do_classifier_free_guidance`)
/// it receives `[2·batch, …]` — the batch twice, the first half to be run with the
/// unconditional (empty-prompt) embeddings, the second with the prompt's — and must return
/// `[2·batch, …]`; the guided output is `u + s·(c − u)`. Otherwise it receives the batch once.
///
/// # Errors
/// Errors of `model` or the sampler; [`Error::InvalidArgument`] when the model returns another
/// shape.
pub fn sample<S, F>(
    sampler: &S,
    noise: &Tensor,
    guidance_scale: f64,
    mut model: F,
) -> Result<Tensor>
where
    S: Sampler + ?Sized,
    F: FnMut(&Tensor, f64) -> Result<Tensor>,
{
    if noise.dim() == 0 {
        return Err(Error::InvalidArgument(
            "noise must be [batch, C, H, W], got a 0-d tensor".into(),
        ));
    }
    let cfg = guidance_scale > 1.0;
    let mut x = noise.f_mul_scalar(sampler.init_noise_sigma())?;
    for (i, &t) in sampler.timesteps().iter().enumerate() {
        let xin = sampler.scale_model_input(&x, i)?;
        let out = if cfg {
            let both = model(&Tensor::f_cat(&[&xin, &xin], 0)?, t)?;
            let want = {
                let mut s = xin.size();
                s[0] *= 2;
                s
            };
            if both.size() != want {
                return Err(Error::InvalidArgument(format!(
                    "the model returned {:?} for an input of {want:?}",
                    both.size()
                )));
            }
            let halves = both.f_chunk(2, 0)?;
            let (u, c) = (&halves[0], &halves[1]);
            u.f_add(&c.f_sub(u)?.f_mul_scalar(guidance_scale)?)?
        } else {
            let o = model(&xin, t)?;
            if o.size() != xin.size() {
                return Err(Error::InvalidArgument(format!(
                    "the model returned {:?} for an input of {:?}",
                    o.size(),
                    xin.size()
                )));
            }
            o
        };
        x = sampler.step(&out, i, &x)?.prev_sample;
    }
    Ok(x)
}
