//! Diffusion training and sampling math, independent of the denoiser: the DDPM noise schedule
//! ([`NoiseSchedule`]), the training loss ([`DiffusionLoss`]: ε / v targets, min-SNR-γ, noise
//! offset, timestep range), DDIM and Euler samplers with classifier-free guidance
//! ([`sample`]), and a PNG grid writer ([`save_grid`]); and rectified flow for FLUX.1: the
//! flow-matching loss with kohya's timestep samplings ([`FlowMatchingLoss`]) and the Euler
//! flow-matching sampler ([`FlowMatchEulerSampler`], [`sample_flow`]).
//!
//! The denoiser is a closure `(noisy_latents, timesteps) -> prediction`, so the same code serves
//! any UNet.
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_models::diffusion::{
//!     DdimOptions, DdimSampler, DiffusionLoss, LossConfig, NoiseSchedule, ScheduleConfig, sample,
//! };
//! use tch::{Device, Kind, Tensor};
//!
//! let denoiser = |x: &Tensor, _t: &Tensor| Ok(x * 0.9); // stands for the UNet
//! let cfg = LossConfig { min_snr_gamma: Some(5.0), ..Default::default() };
//! let objective = DiffusionLoss::new(NoiseSchedule::new(ScheduleConfig::sd())?, cfg)?;
//! let latents = Tensor::randn([2, 4, 64, 64], (Kind::Float, Device::Cpu));
//! let loss = objective.loss(&latents, denoiser)?; // 0-d f32, backward() from here
//!
//! let ddim = DdimSampler::new(objective.schedule(), 30, &DdimOptions::default())?;
//! let noise = Tensor::randn([1, 4, 64, 64], (Kind::Float, Device::Cpu));
//! // with guidance 7.5 the closure gets [uncond; cond] stacked on the batch axis
//! let z = sample(&ddim, &noise, 7.5, |x, _t| Ok(x * 0.9))?;
//! # let _ = (loss, z); Ok(()) }
//! ```

mod flow;
mod grid;
mod objective;
mod sampler;
mod schedule;

pub use flow::{
    FlowMatchConfig, FlowMatchEulerSampler, FlowMatchingLoss, FlowNoisedBatch, LossWeighting,
    TimestepSampling, calculate_shift, sample_flow, shift_sigma, time_shift,
};
pub use grid::{make_grid, save_grid, to_rgb_images};
pub use objective::{DiffusionLoss, LossConfig, MultiresNoise, NoisedBatch, multires_noise};
pub use sampler::{
    DdimOptions, DdimSampler, EulerOptions, EulerSampler, Sampler, StepOutput, TimestepSpacing,
    sample,
};
pub use schedule::{
    BetaSchedule, NoiseSchedule, PredictionType, ScheduleConfig, rescale_zero_terminal_snr,
};
