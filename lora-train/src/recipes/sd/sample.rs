//! Sample grids during training and the fixed-noise evaluation before and after it.

use super::*;

/// The SD pipeline drawing sample grids with fixed options (see [`SdPipeline::sample_images`]).
pub struct SdSampler {
    /// The pipeline (shared with the batch source and the training step).
    pub pipe: Rc<SdPipeline>,
    /// Size, steps, guidance, seed and sampler.
    pub opts: SampleOptions,
}

impl crate::recipes::images::GridSampler for SdSampler {
    fn sample(&self, prompts: &[String]) -> std::result::Result<Tensor, String> {
        self.pipe
            .sample_images(prompts, &self.opts)
            .map_err(|e| e.to_string())
    }
}

/// The SD job's sample-grid callback.
pub type SampleCallback = crate::recipes::images::SampleCallback<SdSampler>;

// ---------------------------------------------------------------------------------------------
// Evaluation, export
// ---------------------------------------------------------------------------------------------

/// The diffusion loss of `batches` (one per aspect bucket, see [`ImageSource::fixed_batches`])
/// on fixed noise and fixed timesteps: every latent is scored at each of `timesteps` with noise
/// drawn from `seed` (batch by batch, timestep by timestep); the mean over all items and
/// timesteps (f64). Identical inputs before and after training, so the difference is the
/// adapter's doing.
///
/// # Errors
/// Model errors.
pub fn fixed_eval_loss(
    pipe: &SdPipeline,
    objective: &DiffusionLoss,
    batches: &[SdBatch],
    timesteps: &[i64],
    seed: u64,
) -> lora_models::Result<f64> {
    let _g = tch::no_grad_guard();
    let saved = lora_core::sys::rng_state(Device::Cpu).ok();
    let d = pipe.unet_device();
    tch::manual_seed(seed as i64);
    let mut total = 0.0;
    let mut items = 0i64;
    'batches: for batch in batches {
        let lat = batch.latents.f_to_device(d)?;
        let cond = match &batch.cond {
            Some(c) => c.to_device(d)?,
            None => pipe.condition(&batch.ids, batch.ids_2.as_ref(), false)?,
        };
        let time_ids = batch.time_ids.as_ref();
        let n = lat.size()[0];
        for &t in timesteps {
            // Ctrl-C: answered between forward passes (the caller reports the interruption)
            if crate::engine::stop_requested() {
                break 'batches;
            }
            let noise = Tensor::f_randn(lat.size(), (Kind::Float, Device::Cpu))?
                .f_to_device(d)?
                .f_to_kind(lat.kind())?;
            let ts = Tensor::f_full([n], t, (Kind::Int64, d))?;
            let l = objective.loss_with(&lat, noise, ts, |x, t| {
                pipe.predict(x, t, &cond, time_ids, false)
            })?;
            total += l.f_double_value(&[])? * n as f64;
        }
        items += n;
    }
    if let Some(s) = saved {
        let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
    }
    Ok(total / (items.max(1) as f64 * timesteps.len().max(1) as f64))
}
