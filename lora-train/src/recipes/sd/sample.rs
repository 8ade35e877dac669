//! Sample grids during training and the fixed-noise evaluation before and after it.

use super::*;

/// Writes a sample grid every `every` optimizer steps (see [`SdPipeline::sample_images`]).
pub struct SampleCallback {
    pipe: Rc<SdPipeline>,
    prompts: Vec<String>,
    every: u64,
    dir: PathBuf,
    opts: SampleOptions,
    /// Files written.
    pub written: Rc<RefCell<Vec<PathBuf>>>,
}

impl SampleCallback {
    /// Writes `<dir>/step-N.png` for `prompts` every `every` steps (0 = never during training;
    /// [`Self::write`] can still be called).
    pub fn new(
        pipe: Rc<SdPipeline>,
        prompts: Vec<String>,
        every: u64,
        dir: PathBuf,
        opts: SampleOptions,
    ) -> Self {
        SampleCallback {
            pipe,
            prompts,
            every,
            dir,
            opts,
            written: Rc::new(RefCell::new(Vec::new())),
        }
    }

    /// Samples now and writes `<dir>/step-{step}.png` (one column per prompt).
    ///
    /// # Errors
    /// Model errors; I/O errors naming the file.
    pub fn write(&self, step: u64) -> std::result::Result<PathBuf, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let imgs = self
            .pipe
            .sample_images(&self.prompts, &self.opts)
            .map_err(|e| format!("sampling: {e}"))?;
        let path = self.dir.join(format!("step-{step}.png"));
        lora_models::diffusion::save_grid(&imgs, self.prompts.len().max(1), &path)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        self.written.borrow_mut().push(path.clone());
        Ok(path)
    }
}

impl crate::engine::callbacks::Callback for SampleCallback {
    fn on_step(
        &mut self,
        info: &crate::engine::callbacks::StepInfo,
    ) -> crate::engine::Result<crate::engine::callbacks::Control> {
        if self.every > 0 && !self.prompts.is_empty() && info.step % self.every == 0 {
            self.write(info.step).map_err(TrainError::App)?;
        }
        Ok(crate::engine::callbacks::Control::Continue)
    }
}

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
