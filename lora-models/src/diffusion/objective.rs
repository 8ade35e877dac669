//! The diffusion training loss of a batch of latents, as diffusers'
//! `examples/text_to_image/train_text_to_image_lora.py` and kohya sd-scripts
//! (`train_network.py`, `library/custom_train_functions.py`) compute it:
//! sample t uniformly, sample ε (plus kohya's noise offset), noise the latents, predict, take the
//! per-sample MSE against ε or v in float32, weight it by min-SNR-γ, and average.

use tch::{Device, Kind, Tensor};

use super::schedule::{NoiseSchedule, PredictionType};
use crate::error::{Error, Result};

/// Options of the loss.
#[derive(Debug, Clone, PartialEq)]
pub struct LossConfig {
    /// Smallest timestep sampled (kohya `min_timestep`, default 0).
    pub min_timestep: i64,
    /// One past the largest timestep sampled (kohya `max_timestep`); `None` = `T`.
    pub max_timestep: Option<i64>,
    /// kohya `noise_offset` (Guttenberg 2023, "Diffusion with Offset Noise"):
    /// `ε ← ε + offset · randn(batch, channels, 1, 1)`; 0 = off. Typical 0.0357–0.1.
    pub noise_offset: f64,
    /// min-SNR-γ (Hang et al. 2023, "Efficient Diffusion Training via Min-SNR Weighting
    /// Strategy", arXiv:2303.09556, §3.4): per-sample weight `min(SNR, γ)/SNR` for ε-prediction,
    /// `min(SNR, γ)/(SNR + 1)` for v-prediction (as diffusers' training scripts and kohya
    /// `apply_snr_weight`); the paper recommends γ = 5. `None` = unweighted.
    pub min_snr_gamma: Option<f64>,
    /// Multi-resolution ("pyramid") noise, applied after the offset: see [`MultiresNoise`].
    /// `None` = off.
    pub multires_noise: Option<MultiresNoise>,
}

/// Multi-resolution noise (J. Whitaker, "Multi-Resolution Noise for Diffusion Model Training",
/// 2023; kohya `multires_noise_iterations` / `multires_noise_discount`): for level
/// `i = 0, 1, …, iterations − 1`, a random factor `r ∈ [2, 4)` is drawn, white noise of size
/// `(⌊H / rⁱ⌋, ⌊W / rⁱ⌋)` (at least 1) is upsampled bilinearly to `(H, W)` and added with
/// weight `discountⁱ`; the levels stop after the first that is 1 pixel wide or high, and the
/// sum is divided by its standard deviation (so ε keeps unit variance).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultiresNoise {
    /// Levels (kohya's typical 6–10).
    pub iterations: u32,
    /// Weight ratio between consecutive levels, in (0, 1] (kohya default 0.3).
    pub discount: f64,
}

impl Default for LossConfig {
    fn default() -> Self {
        Self {
            min_timestep: 0,
            max_timestep: None,
            noise_offset: 0.0,
            min_snr_gamma: None,
            multires_noise: None,
        }
    }
}

/// The tensors of one training step before the model runs.
#[derive(Debug)]
pub struct NoisedBatch {
    /// ε `[batch, C, H, W]` (offset included), latents' dtype.
    pub noise: Tensor,
    /// `[batch]` int64.
    pub timesteps: Tensor,
    /// `x_t` `[batch, C, H, W]`, latents' dtype.
    pub noisy_latents: Tensor,
    /// ε or v `[batch, C, H, W]`.
    pub target: Tensor,
}

/// The loss of [`NoiseSchedule`] + [`LossConfig`], generic over the denoiser.
#[derive(Debug)]
pub struct DiffusionLoss {
    schedule: NoiseSchedule,
    config: LossConfig,
}

impl DiffusionLoss {
    /// Checks the timestep range and γ.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `min_timestep ≥ max_timestep`, a range outside `0..=T`,
    /// γ ≤ 0, or a negative / non-finite noise offset.
    pub fn new(schedule: NoiseSchedule, config: LossConfig) -> Result<Self> {
        let t = schedule.num_train_timesteps();
        let max = config.max_timestep.unwrap_or(t);
        if config.min_timestep < 0 || max > t || config.min_timestep >= max {
            return Err(Error::InvalidArgument(format!(
                "timestep range {}..{max} must be non-empty and inside 0..{t}",
                config.min_timestep
            )));
        }
        if let Some(g) = config.min_snr_gamma
            && !(g.is_finite() && g > 0.0)
        {
            return Err(Error::InvalidArgument(format!(
                "min_snr_gamma must be positive, got {g}"
            )));
        }
        if let Some(m) = config.multires_noise
            && !(m.iterations >= 1 && m.discount > 0.0 && m.discount <= 1.0)
        {
            return Err(Error::InvalidArgument(format!(
                "multires noise needs iterations >= 1 and a discount in (0, 1], got {} and {}",
                m.iterations, m.discount
            )));
        }
        if !(config.noise_offset.is_finite() && config.noise_offset >= 0.0) {
            return Err(Error::InvalidArgument(format!(
                "noise_offset must be ≥ 0, got {}",
                config.noise_offset
            )));
        }
        Ok(Self { schedule, config })
    }

    /// The schedule.
    pub fn schedule(&self) -> &NoiseSchedule {
        &self.schedule
    }

    /// The options.
    pub fn config(&self) -> &LossConfig {
        &self.config
    }

    /// `[batch]` int64 timesteps drawn uniformly from `min_timestep..max_timestep` on `device`
    /// (torch's global generator).
    ///
    /// # Errors
    /// [`Error::Torch`].
    pub fn sample_timesteps(&self, batch: i64, device: tch::Device) -> Result<Tensor> {
        let max = self
            .config
            .max_timestep
            .unwrap_or(self.schedule.num_train_timesteps());
        Ok(Tensor::f_randint_low(
            self.config.min_timestep,
            max,
            [batch],
            (Kind::Int64, device),
        )?)
    }

    /// ε ~ N(0, I) like `latents` `[batch, C, H, W]`, plus the noise offset
    /// `offset · randn(batch, C, 1, 1)` when configured (kohya `train_network.py`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for latents that are not 4-D when an offset is set;
    /// [`Error::Torch`].
    pub fn sample_noise(&self, latents: &Tensor) -> Result<Tensor> {
        let mut noise = latents.f_randn_like()?;
        if self.config.noise_offset == 0.0 && self.config.multires_noise.is_none() {
            return Ok(noise);
        }
        let s = latents.size();
        if s.len() != 4 {
            return Err(Error::InvalidArgument(format!(
                "noise_offset and multires noise need latents [batch, C, H, W], got {s:?}"
            )));
        }
        if self.config.noise_offset != 0.0 {
            let off = Tensor::f_randn([s[0], s[1], 1, 1], (latents.kind(), latents.device()))?;
            noise = noise.f_add(&off.f_mul_scalar(self.config.noise_offset)?)?;
        }
        if let Some(m) = self.config.multires_noise {
            noise = multires_noise(noise, m)?;
        }
        Ok(noise)
    }

    /// `x_t` and the target for given noise and timesteps.
    ///
    /// # Errors
    /// As [`NoiseSchedule::add_noise`].
    pub fn noised(
        &self,
        latents: &Tensor,
        noise: Tensor,
        timesteps: Tensor,
    ) -> Result<NoisedBatch> {
        let noisy_latents = self.schedule.add_noise(latents, &noise, &timesteps)?;
        let target = self.schedule.target(latents, &noise, &timesteps)?;
        Ok(NoisedBatch {
            noise,
            timesteps,
            noisy_latents,
            target,
        })
    }

    /// The min-SNR-γ weights `[batch]` float32 for `timesteps`, or `None` without γ.
    ///
    /// ε: `min(SNR, γ)/SNR`, computed as `min(1, γ/SNR)` — the same number, and 1 (not 0/0) at
    /// SNR 0 (the last step of a zero-terminal-SNR schedule). v: `min(SNR, γ)/(SNR + 1)`.
    ///
    /// # Errors
    /// As [`NoiseSchedule::snr`].
    pub fn snr_weights(&self, timesteps: &Tensor) -> Result<Option<Tensor>> {
        let Some(g) = self.config.min_snr_gamma else {
            return Ok(None);
        };
        let snr = self.schedule.snr(timesteps)?;
        let w = match self.schedule.config().prediction_type {
            PredictionType::Epsilon => snr.f_reciprocal()?.f_mul_scalar(g)?.f_clamp_max(1.0)?,
            PredictionType::VPrediction => snr.f_clamp_max(g)?.f_div(&snr.f_add_scalar(1.0)?)?,
        };
        Ok(Some(w))
    }

    /// The loss of a prediction `[batch, C, H, W]` against `batch.target`: per-sample mean
    /// squared error in float32 (over all but the batch dim), times the min-SNR weights when
    /// set, averaged over the batch. A 0-d float32 tensor that carries the prediction's graph.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when shapes differ; [`Error::Torch`].
    pub fn loss_from_prediction(&self, pred: &Tensor, batch: &NoisedBatch) -> Result<Tensor> {
        if pred.size() != batch.target.size() {
            return Err(Error::InvalidArgument(format!(
                "model prediction {:?} does not match the target {:?}",
                pred.size(),
                batch.target.size()
            )));
        }
        let d = pred
            .f_to_kind(Kind::Float)?
            .f_sub(&batch.target.f_to_kind(Kind::Float)?)?;
        let dims: Vec<i64> = (1..pred.dim() as i64).collect();
        let per_sample = d
            .f_square()?
            .f_mean_dim(dims.as_slice(), false, Kind::Float)?;
        let per_sample = match self.snr_weights(&batch.timesteps)? {
            Some(w) => per_sample.f_mul(&w.f_to_device(per_sample.device())?)?,
            None => per_sample,
        };
        Ok(per_sample.f_mean(Kind::Float)?)
    }

    /// The loss for given noise and timesteps: `model(noisy_latents, timesteps)` must return the
    /// prediction `[batch, C, H, W]` (it closes over the conditioning).
    ///
    /// # Errors
    /// Errors of `model`; as [`DiffusionLoss::loss_from_prediction`].
    pub fn loss_with<F>(
        &self,
        latents: &Tensor,
        noise: Tensor,
        timesteps: Tensor,
        mut model: F,
    ) -> Result<Tensor>
    where
        F: FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    {
        let batch = self.noised(latents, noise, timesteps)?;
        let pred = model(&batch.noisy_latents, &batch.timesteps)?;
        self.loss_from_prediction(&pred, &batch)
    }

    /// One training loss for `latents` `[batch, C, H, W]` (already scaled by the VAE's
    /// `scaling_factor`): samples timesteps and noise, then [`DiffusionLoss::loss_with`].
    ///
    /// # Errors
    /// As [`DiffusionLoss::loss_with`].
    pub fn loss<F>(&self, latents: &Tensor, model: F) -> Result<Tensor>
    where
        F: FnMut(&Tensor, &Tensor) -> Result<Tensor>,
    {
        let batch = *latents.size().first().ok_or_else(|| {
            Error::InvalidArgument("latents must be [batch, C, H, W], got a 0-d tensor".into())
        })?;
        let t = self.sample_timesteps(batch, latents.device())?;
        let noise = self.sample_noise(latents)?;
        self.loss_with(latents, noise, t, model)
    }
}

/// Adds the coarser levels of [`MultiresNoise`] to `noise` `[batch, C, H, W]` and rescales the
/// sum to unit standard deviation; works in float32 and returns `noise`'s dtype.
///
/// # Errors
/// [`Error::Torch`].
pub fn multires_noise(noise: Tensor, m: MultiresNoise) -> Result<Tensor> {
    let s = noise.size();
    let (h, w) = (s[2], s[3]);
    let kind = noise.kind();
    let dev = noise.device();
    let mut sum = noise.f_to_kind(Kind::Float)?;
    // level 0's factor r⁰ = 1: one more full-size noise, as in the reference loop
    for level in 0..m.iterations.min(64) as i32 {
        let r = 2.0 + 2.0 * Tensor::f_rand([], (Kind::Double, Device::Cpu))?.f_double_value(&[])?;
        let scale = r.powi(level);
        let hn = ((h as f64 / scale) as i64).max(1);
        let wn = ((w as f64 / scale) as i64).max(1);
        let coarse = Tensor::f_randn([s[0], s[1], hn, wn], (Kind::Float, dev))?;
        let up = coarse.f_upsample_bilinear2d([h, w], false, None, None)?;
        sum = sum.f_add(&up.f_mul_scalar(m.discount.powi(level))?)?;
        if hn == 1 || wn == 1 {
            break;
        }
    }
    let std = sum.f_std(true)?;
    Ok(sum.f_div(&std)?.f_to_kind(kind)?)
}
