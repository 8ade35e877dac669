//! The SD training step: the diffusion loss of a batch through the LoRA-injected UNet.

use super::*;

/// One training batch of the SD job.
///
/// # Shapes
/// `latents` `[b, 4, h, w]` f32 (scaled); `ids` (and SDXL's `ids_2`) `[b, 77]` int64; `cond`
/// see [`TextCond`]; `time_ids` (SDXL) `[b, 6]` f32.
#[derive(Debug)]
pub struct SdBatch {
    /// Scaled VAE latents.
    pub latents: Tensor,
    /// Caption token ids.
    pub ids: Tensor,
    /// SDXL: the caption's `tokenizer_2` ids.
    pub ids_2: Option<Tensor>,
    /// Cached text-encoder conditioning (`None` when a text encoder is trained: it is then
    /// computed from the ids in the step, with grad).
    pub cond: Option<TextCond>,
    /// SDXL: the time ids of each sample ([`sdxl_time_ids`]).
    pub time_ids: Option<Tensor>,
    /// The processed captions.
    pub captions: Vec<String>,
}

/// The diffusion [`TrainStep`]: LoRA on the UNet, loss = [`DiffusionLoss`].
pub struct SdTask {
    /// The pipeline (shared with the batch source and the sampler).
    pub pipe: Rc<SdPipeline>,
    /// The objective.
    pub objective: DiffusionLoss,
    /// Adapter tensors by VarStore name, sorted.
    pub named: Vec<(String, Tensor)>,
    /// LoRA+ ratio for the B matrices.
    pub loraplus_lr_ratio: Option<f64>,
}

impl SdTask {
    fn inputs(&self, b: &SdBatch, train: bool) -> crate::engine::Result<(Tensor, TextCond)> {
        let d = self.pipe.unet_device();
        let cond = match &b.cond {
            Some(c) => c.to_device(d)?,
            None => self
                .pipe
                .condition(&b.ids, b.ids_2.as_ref(), train)
                .map_err(model_err)?,
        };
        Ok((b.latents.f_to_device(d)?, cond))
    }
}

impl TrainStep for SdTask {
    type Batch = SdBatch;

    fn loss(&mut self, b: &SdBatch, train: bool) -> crate::engine::Result<Tensor> {
        let (lat, cond) = self.inputs(b, train)?;
        let pipe = &self.pipe;
        let ids = b.time_ids.as_ref();
        self.objective
            .loss(&lat, |x, t| pipe.predict(x, t, &cond, ids, train))
            .map_err(model_err)
    }

    /// With gradient checkpointing on, the UNet recomputes its units during backward
    /// ([`UNet2DConditionModel::loss_backward`]); otherwise the trainer's plain path runs.
    fn loss_backward(&mut self, b: &SdBatch, scale: f64) -> crate::engine::Result<Option<Tensor>> {
        if !self.pipe.unet.gradient_checkpointing() {
            return Ok(None);
        }
        let (lat, cond) = self.inputs(b, true)?;
        let n = lat.size()[0];
        let t = self
            .objective
            .sample_timesteps(n, lat.device())
            .map_err(model_err)?;
        let noise = self.objective.sample_noise(&lat).map_err(model_err)?;
        let nb = self.objective.noised(&lat, noise, t).map_err(model_err)?;
        let obj = &self.objective;
        let time_ids = b
            .time_ids
            .as_ref()
            .map(|t| t.f_to_device(lat.device()))
            .transpose()?;
        let added = match (&cond.pooled, &time_ids) {
            (Some(p), Some(t)) => Some((p, t)),
            _ => None,
        };
        self.pipe
            .unet
            .loss_backward(
                &nb.noisy_latents,
                &nb.timesteps,
                &cond.hidden,
                added,
                true,
                scale,
                |p| obj.loss_from_prediction(p, &nb),
            )
            .map(Some)
            .map_err(model_err)
    }

    fn named_trainable(&self) -> Vec<(String, Tensor)> {
        self.named
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn param_groups(&self) -> Vec<crate::engine::optim::ParamGroup> {
        crate::engine::optim::adapter_groups(self.named_trainable(), self.loraplus_lr_ratio)
    }

    fn micro_batch_len(&self, b: &SdBatch) -> usize {
        b.latents.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(&self, b: &SdBatch, parts: usize) -> crate::engine::Result<Vec<SdBatch>> {
        let n = parts.max(1) as i64;
        let l = b.latents.f_chunk(n, 0)?;
        let k = l.len();
        let opt_chunks = |t: Option<&Tensor>| -> crate::engine::Result<Vec<Option<Tensor>>> {
            Ok(match t {
                Some(t) => t.f_chunk(n, 0)?.into_iter().map(Some).collect(),
                None => (0..k).map(|_| None).collect(),
            })
        };
        let ids = b.ids.f_chunk(n, 0)?;
        let ids_2 = opt_chunks(b.ids_2.as_ref())?;
        let time_ids = opt_chunks(b.time_ids.as_ref())?;
        let c: Vec<Option<TextCond>> = match &b.cond {
            Some(c) => c.chunk(n)?.into_iter().map(Some).collect(),
            None => (0..k).map(|_| None).collect(),
        };
        let per = b.captions.len().div_ceil(k.max(1)).max(1);
        let caps: Vec<Vec<String>> = b.captions.chunks(per).map(<[String]>::to_vec).collect();
        Ok(l.into_iter()
            .zip(ids)
            .zip(ids_2)
            .zip(time_ids)
            .zip(c)
            .enumerate()
            .map(|(i, ((((latents, ids), ids_2), time_ids), cond))| SdBatch {
                latents,
                ids,
                ids_2,
                cond,
                time_ids,
                captions: caps.get(i).cloned().unwrap_or_default(),
            })
            .collect())
    }
}
