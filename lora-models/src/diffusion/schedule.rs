//! The DDPM forward process (Ho et al. 2020, "Denoising Diffusion Probabilistic Models",
//! arXiv:2006.11239): β schedules, ᾱ_t = ∏(1 − β_s), `x_t = √ᾱ_t·x₀ + √(1 − ᾱ_t)·ε`, the
//! v-prediction target (Salimans & Ho 2022, arXiv:2202.00512) and SNR(t) = ᾱ_t / (1 − ᾱ_t),
//! computed as diffusers' `DDPMScheduler` does (f32, `schedulers/scheduling_ddpm.py`).

use std::path::Path;

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// How β_t runs from `beta_start` to `beta_end` (diffusers `beta_schedule`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BetaSchedule {
    /// `linear`: β evenly spaced (DDPM).
    Linear,
    /// `scaled_linear`: √β evenly spaced, squared (latent diffusion / every SD checkpoint).
    ScaledLinear,
    /// `squaredcos_cap_v2`: the cosine schedule of Nichol & Dhariwal 2021 (arXiv:2102.09672),
    /// `ᾱ(t) = cos²((t + 0.008)/1.008 · π/2)`, β capped at 0.999 (diffusers
    /// `betas_for_alpha_bar`).
    SquaredCosCapV2,
}

impl BetaSchedule {
    /// Parses diffusers' names.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for other names.
    pub fn from_diffusers(name: &str) -> Result<Self> {
        match name {
            "linear" => Ok(Self::Linear),
            "scaled_linear" => Ok(Self::ScaledLinear),
            "squaredcos_cap_v2" => Ok(Self::SquaredCosCapV2),
            other => Err(Error::Unsupported {
                what: "beta_schedule",
                value: other.into(),
                hint: "supported: linear, scaled_linear, squaredcos_cap_v2".into(),
            }),
        }
    }
}

/// What the denoiser predicts (diffusers `prediction_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PredictionType {
    /// `epsilon`: the added noise ε (SD1.x, SD2-base, SDXL).
    Epsilon,
    /// `v_prediction`: `v = √ᾱ·ε − √(1−ᾱ)·x₀` (SD2.x 768-v models).
    VPrediction,
}

impl PredictionType {
    /// Parses diffusers' names.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for other names (`sample` is not supported).
    pub fn from_diffusers(name: &str) -> Result<Self> {
        match name {
            "epsilon" => Ok(Self::Epsilon),
            "v_prediction" => Ok(Self::VPrediction),
            other => Err(Error::Unsupported {
                what: "prediction_type",
                value: other.into(),
                hint: "supported: epsilon, v_prediction".into(),
            }),
        }
    }
}

/// The training noise schedule (the keys of diffusers' `scheduler/scheduler_config.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleConfig {
    /// Number of training timesteps `T` (1000 for SD).
    pub num_train_timesteps: i64,
    /// β at t = 0.
    pub beta_start: f64,
    /// β at t = T − 1.
    pub beta_end: f64,
    /// The β curve.
    pub beta_schedule: BetaSchedule,
    /// Rescale β so that the last step has SNR 0 (Lin et al. 2023, "Common Diffusion Noise
    /// Schedules and Sample Steps are Flawed", arXiv:2305.08891, Algorithm 1; diffusers
    /// `rescale_zero_terminal_snr`).
    pub rescale_betas_zero_snr: bool,
    /// The model's target.
    pub prediction_type: PredictionType,
}

impl ScheduleConfig {
    /// Stable Diffusion's schedule (SD1.x, SD2, SDXL `scheduler_config.json`): 1000 steps,
    /// `scaled_linear` from 0.00085 to 0.012, ε-prediction.
    pub fn sd() -> Self {
        Self {
            num_train_timesteps: 1000,
            beta_start: 0.00085,
            beta_end: 0.012,
            beta_schedule: BetaSchedule::ScaledLinear,
            rescale_betas_zero_snr: false,
            prediction_type: PredictionType::Epsilon,
        }
    }

    /// Reads a diffusers `scheduler_config.json` (any scheduler class; missing keys take
    /// [`ScheduleConfig::sd`]'s values; keys that only concern sampling are ignored).
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Config`] for an unreadable file or wrongly typed values;
    /// [`Error::Unsupported`] for unknown schedule or prediction names, or `trained_betas`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        let bad = |k: &str, want: &str| Error::Config {
            path: path.to_path_buf(),
            msg: format!("`{k}` must be {want}"),
        };
        let mut c = Self::sd();
        if let Some(x) = v.get("num_train_timesteps") {
            c.num_train_timesteps = x
                .as_i64()
                .ok_or_else(|| bad("num_train_timesteps", "an integer"))?;
        }
        if let Some(x) = v.get("beta_start") {
            c.beta_start = x.as_f64().ok_or_else(|| bad("beta_start", "a number"))?;
        }
        if let Some(x) = v.get("beta_end") {
            c.beta_end = x.as_f64().ok_or_else(|| bad("beta_end", "a number"))?;
        }
        if let Some(x) = v.get("beta_schedule") {
            c.beta_schedule = BetaSchedule::from_diffusers(
                x.as_str().ok_or_else(|| bad("beta_schedule", "a string"))?,
            )?;
        }
        if let Some(x) = v.get("prediction_type") {
            c.prediction_type = PredictionType::from_diffusers(
                x.as_str()
                    .ok_or_else(|| bad("prediction_type", "a string"))?,
            )?;
        }
        if let Some(x) = v.get("rescale_betas_zero_snr") {
            c.rescale_betas_zero_snr = x
                .as_bool()
                .ok_or_else(|| bad("rescale_betas_zero_snr", "a boolean"))?;
        }
        if v.get("trained_betas").is_some_and(|x| !x.is_null()) {
            return Err(Error::Unsupported {
                what: "scheduler option",
                value: format!("trained_betas in {}", path.display()),
                hint: "only beta_schedule curves are supported".into(),
            });
        }
        Ok(c)
    }
}

/// The forward-process tables of a [`ScheduleConfig`] (float32 on the CPU, as diffusers keeps
/// them), and the operations on batches that use them.
///
/// Timestep tensors are `[batch]` int64 in `0..T`; sample tensors `[batch, …]` (latents
/// `[batch, 4, h/8, w/8]`) of any float dtype, on any device.
#[derive(Debug)]
pub struct NoiseSchedule {
    config: ScheduleConfig,
    betas: Tensor,
    alphas_cumprod: Tensor,
    ac: Vec<f32>,
}

impl NoiseSchedule {
    /// Builds β and ᾱ for `config`, in float32 exactly as diffusers (`torch.linspace` in f32;
    /// `scaled_linear` = `linspace(√β₀, √β₁)²`; cumulative product in f32).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `num_train_timesteps < 2` or β outside (0, 1);
    /// [`Error::Torch`].
    pub fn new(config: ScheduleConfig) -> Result<Self> {
        let t = config.num_train_timesteps;
        if t < 2 {
            return Err(Error::InvalidArgument(format!(
                "num_train_timesteps must be ≥ 2, got {t}"
            )));
        }
        let opts = (Kind::Float, Device::Cpu);
        let betas = match config.beta_schedule {
            BetaSchedule::Linear => {
                Tensor::f_linspace(config.beta_start, config.beta_end, t, opts)?
            }
            BetaSchedule::ScaledLinear => {
                Tensor::f_linspace(config.beta_start.sqrt(), config.beta_end.sqrt(), t, opts)?
                    .f_square()?
            }
            BetaSchedule::SquaredCosCapV2 => {
                let abar = |x: f64| {
                    ((x + 0.008) / 1.008 * std::f64::consts::PI / 2.0)
                        .cos()
                        .powi(2)
                };
                let b: Vec<f32> = (0..t)
                    .map(|i| {
                        let (t1, t2) = (i as f64 / t as f64, (i + 1) as f64 / t as f64);
                        (1.0 - abar(t2) / abar(t1)).min(0.999) as f32
                    })
                    .collect();
                Tensor::f_from_slice(&b)?
            }
        };
        let betas = if config.rescale_betas_zero_snr {
            rescale_zero_terminal_snr(&betas)?
        } else {
            betas
        };
        let alphas_cumprod = betas
            .f_neg()?
            .f_add_scalar(1.0)?
            .f_cumprod(0, Kind::Float)?;
        let ac = Vec::<f32>::try_from(&alphas_cumprod)?;
        if ac
            .iter()
            .any(|a| !(a.is_finite() && *a >= 0.0 && *a <= 1.0))
        {
            return Err(Error::InvalidArgument(format!(
                "beta_start {} / beta_end {} give ᾱ outside [0, 1]",
                config.beta_start, config.beta_end
            )));
        }
        Ok(Self {
            config,
            betas,
            alphas_cumprod,
            ac,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ScheduleConfig {
        &self.config
    }

    /// `T`.
    pub fn num_train_timesteps(&self) -> i64 {
        self.config.num_train_timesteps
    }

    /// β `[T]` float32, CPU.
    pub fn betas(&self) -> &Tensor {
        &self.betas
    }

    /// ᾱ `[T]` float32, CPU.
    pub fn alphas_cumprod(&self) -> &Tensor {
        &self.alphas_cumprod
    }

    /// ᾱ_t as f32 values.
    pub fn alphas_cumprod_values(&self) -> &[f32] {
        &self.ac
    }

    fn check_t(&self, t: &Tensor, x: &Tensor) -> Result<()> {
        let (ts, xs) = (t.size(), x.size());
        if ts.len() != 1 || xs.is_empty() || xs[0] != ts[0] {
            return Err(Error::InvalidArgument(format!(
                "timesteps must be [batch] matching samples [batch, …]: got {ts:?} and {xs:?}"
            )));
        }
        if !matches!(t.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::InvalidArgument(format!(
                "timesteps must be integer, got {:?}",
                t.kind()
            )));
        }
        Ok(())
    }

    /// `(√ᾱ_t, √(1 − ᾱ_t))` for each sample, shaped `[batch, 1, …]` to broadcast over `x`, in
    /// `x`'s dtype: ᾱ is cast to that dtype *before* the square roots, as diffusers does.
    fn coefs(&self, x: &Tensor, t: &Tensor) -> Result<(Tensor, Tensor)> {
        self.check_t(t, x)?;
        let ac = self
            .alphas_cumprod
            .f_to_device(x.device())?
            .f_to_kind(x.kind())?
            .f_index_select(0, &t.f_to_device(x.device())?.f_to_kind(Kind::Int64)?)?;
        let mut shape = vec![x.size()[0]];
        shape.resize(x.dim(), 1);
        let a = ac.f_sqrt()?.f_view(shape.as_slice())?;
        let s = ac
            .f_neg()?
            .f_add_scalar(1.0)?
            .f_sqrt()?
            .f_view(shape.as_slice())?;
        Ok((a, s))
    }

    /// `x_t = √ᾱ_t·x₀ + √(1 − ᾱ_t)·ε` (diffusers `DDPMScheduler.add_noise`).
    ///
    /// `x0`, `noise` `[batch, …]` same shape and dtype; `t` `[batch]` int64. Returns `x0`'s shape
    /// and dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for mismatching shapes; [`Error::Torch`] for `t` out of range.
    pub fn add_noise(&self, x0: &Tensor, noise: &Tensor, t: &Tensor) -> Result<Tensor> {
        let (a, s) = self.coefs(x0, t)?;
        Ok(x0.f_mul(&a)?.f_add(&noise.f_mul(&s)?)?)
    }

    /// The v-prediction target `v = √ᾱ_t·ε − √(1 − ᾱ_t)·x₀` (diffusers
    /// `DDPMScheduler.get_velocity`).
    ///
    /// # Errors
    /// As [`NoiseSchedule::add_noise`].
    pub fn velocity(&self, x0: &Tensor, noise: &Tensor, t: &Tensor) -> Result<Tensor> {
        let (a, s) = self.coefs(x0, t)?;
        Ok(noise.f_mul(&a)?.f_sub(&x0.f_mul(&s)?)?)
    }

    /// The training target for the configured prediction type: ε or v.
    ///
    /// # Errors
    /// As [`NoiseSchedule::add_noise`].
    pub fn target(&self, x0: &Tensor, noise: &Tensor, t: &Tensor) -> Result<Tensor> {
        match self.config.prediction_type {
            PredictionType::Epsilon => Ok(noise.shallow_clone()),
            PredictionType::VPrediction => self.velocity(x0, noise, t),
        }
    }

    /// SNR(t) = (√ᾱ_t / √(1 − ᾱ_t))² as float32 `[batch]` on `t`'s device (diffusers
    /// `training_utils.compute_snr`; infinite never, 0 at the last step of a zero-terminal-SNR
    /// schedule).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a non-1-D or non-integer `t`; [`Error::Torch`].
    pub fn snr(&self, t: &Tensor) -> Result<Tensor> {
        if t.dim() != 1 || !matches!(t.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::InvalidArgument(format!(
                "timesteps must be [batch] integers, got {:?} {:?}",
                t.size(),
                t.kind()
            )));
        }
        let ac = self
            .alphas_cumprod
            .f_to_device(t.device())?
            .f_index_select(0, &t.f_to_kind(Kind::Int64)?)?;
        let a = ac.f_sqrt()?;
        let s = ac.f_neg()?.f_add_scalar(1.0)?.f_sqrt()?;
        Ok(a.f_div(&s)?.f_square()?)
    }
}

/// Lin et al. 2023 Algorithm 1 on f32 β `[T]` (diffusers `rescale_zero_terminal_snr`): shift
/// and scale √ᾱ so that √ᾱ_{T−1} = 0 while √ᾱ_0 stays, then recover β.
///
/// # Errors
/// [`Error::InvalidArgument`] when `betas` is not 1-D with ≥ 2 entries; [`Error::Torch`].
pub fn rescale_zero_terminal_snr(betas: &Tensor) -> Result<Tensor> {
    if betas.dim() != 1 || betas.size()[0] < 2 {
        return Err(Error::InvalidArgument(format!(
            "betas must be [T] with T ≥ 2, got {:?}",
            betas.size()
        )));
    }
    let ac = betas
        .f_neg()?
        .f_add_scalar(1.0)?
        .f_cumprod(0, Kind::Float)?;
    let s = ac.f_sqrt()?;
    let n = s.size()[0];
    let s0 = s.f_get(0)?;
    let st = s.f_get(n - 1)?;
    let s = s.f_sub(&st)?;
    let s = s.f_mul(&s0.f_div(&s0.f_sub(&st)?)?)?;
    let abar = s.f_square()?;
    let alphas = abar
        .f_narrow(0, 1, n - 1)?
        .f_div(&abar.f_narrow(0, 0, n - 1)?)?;
    let alphas = Tensor::f_cat(&[abar.f_narrow(0, 0, 1)?, alphas], 0)?;
    Ok(alphas.f_neg()?.f_add_scalar(1.0)?)
}
