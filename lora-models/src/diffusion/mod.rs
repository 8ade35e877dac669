//! Diffusion training and sampling math, independent of the denoiser: the DDPM noise schedule
//! ([`NoiseSchedule`]), the training loss ([`DiffusionLoss`]: ε / v targets, min-SNR-γ, noise
//! offset, timestep range), DDIM and Euler samplers with classifier-free guidance
//! ([`sample`]), and a PNG grid writer ([`save_grid`]).
//!
//! The denoiser is a closure `(noisy_latents, timesteps) -> prediction`, so the same code serves
//! any UNet.

mod grid;
mod objective;
mod sampler;
mod schedule;

pub use grid::{make_grid, save_grid, to_rgb_images};
pub use objective::{DiffusionLoss, LossConfig, NoisedBatch};
pub use sampler::{
    DdimOptions, DdimSampler, EulerOptions, EulerSampler, Sampler, StepOutput, TimestepSpacing,
    sample,
};
pub use schedule::{
    BetaSchedule, NoiseSchedule, PredictionType, ScheduleConfig, rescale_zero_terminal_snr,
};
