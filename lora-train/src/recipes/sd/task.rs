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
    /// The seed of this batch's timesteps and noise (and the text encoders' dropout): torch's
    /// generator is seeded with it before they are drawn. Training batches derive it from the
    /// loader's seed, the epoch and the batch's index in the epoch's whole plan — the same
    /// batch gets the same noise whether one process draws it as a micro-batch of an
    /// accumulated step or a data-parallel rank draws it — and from nothing else, so a resumed
    /// run draws what an uninterrupted one draws. `None`: the generator as it stands.
    pub noise_seed: Option<u64>,
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
    /// Learning-rate multipliers of the UNet's adapters and of the text encoders' (first,
    /// second): kohya's `unet_lr` / `text_encoder_lr` over `learning_rate`. `None` = one rate
    /// for all.
    pub lr_scales: Option<LrScales>,
}

/// Per-model learning-rate multipliers (see [`SdTask::lr_scales`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrScales {
    /// The UNet's adapters.
    pub unet: f64,
    /// The (first) text encoder's adapters.
    pub text_encoder: f64,
    /// SDXL's second text encoder's adapters.
    pub text_encoder_2: f64,
}

impl LrScales {
    /// The multipliers of kohya's `unet_lr` / `text_encoder_lr` (one rate, or one per text
    /// encoder) over `learning_rate`; `None` when neither is set.
    pub fn of(t: &crate::config::TrainSection) -> Option<LrScales> {
        if t.unet_lr.is_none() && t.text_encoder_lr.is_empty() {
            return None;
        }
        let lr = t.learning_rate;
        let te = t.text_encoder_lr.first().copied().unwrap_or(lr);
        Some(LrScales {
            unet: t.unet_lr.unwrap_or(lr) / lr,
            text_encoder: te / lr,
            text_encoder_2: t.text_encoder_lr.get(1).copied().unwrap_or(te) / lr,
        })
    }
}

/// The parameter groups of the SD job's adapters: with `scales`, one set per model (names
/// `unet.…` — the UNet's adapters are the names without a `text_encoder` prefix —,
/// `text_encoder.…`, `text_encoder_2.…`), each at its model's rate times the LoRA+ ratio of
/// its `lora_B`/`lora_up` tensors; without, [`crate::engine::optim::adapter_groups`].
pub fn model_groups(
    named: Vec<(String, Tensor)>,
    loraplus_lr_ratio: Option<f64>,
    scales: Option<LrScales>,
) -> Vec<crate::engine::optim::ParamGroup> {
    let Some(scales) = scales else {
        return crate::engine::optim::adapter_groups(named, loraplus_lr_ratio);
    };
    let mut parts: [(&str, f64, Vec<(String, Tensor)>); 3] = [
        ("unet", scales.unet, Vec::new()),
        ("text_encoder", scales.text_encoder, Vec::new()),
        ("text_encoder_2", scales.text_encoder_2, Vec::new()),
    ];
    for (name, t) in named {
        let i = if name.starts_with("text_encoder_2") {
            2
        } else if name.starts_with("text_encoder") {
            1
        } else {
            0
        };
        parts[i].2.push((name, t));
    }
    let mut groups = Vec::new();
    for (model, scale, named) in parts {
        if named.is_empty() {
            continue;
        }
        for g in crate::engine::optim::adapter_groups(named, loraplus_lr_ratio) {
            let lr_scale = g.lr_scale * scale;
            let mut g = g.with_lr_scale(lr_scale);
            g.name = format!("{model}.{}", g.name);
            groups.push(g);
        }
    }
    groups
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
        seed_noise(b);
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
        seed_noise(b);
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
        model_groups(
            self.named_trainable(),
            self.loraplus_lr_ratio,
            self.lr_scales,
        )
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
                // each part of a split batch its own draws
                noise_seed: b
                    .noise_seed
                    .map(|s| lora_data::rng::mix(&[s, parts as u64, i as u64])),
            })
            .collect())
    }
}

/// Seeds torch's generator with the batch's [`SdBatch::noise_seed`], if it has one.
fn seed_noise(b: &SdBatch) {
    if let Some(s) = b.noise_seed {
        // torch's manual_seed takes the 64 bits as they are
        tch::manual_seed(s as i64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unet_and_text_encoder_rates_make_one_group_per_model() {
        let t = |v: f32| Tensor::from_slice(&[v]);
        let named = || {
            vec![
                ("down.lora_A".to_string(), t(1.0)),
                ("down.lora_B".to_string(), t(2.0)),
                ("text_encoder.q.lora_A".to_string(), t(3.0)),
                ("text_encoder_2.q.lora_A".to_string(), t(4.0)),
            ]
        };
        let cfg = crate::config::TrainConfig::from_toml_str(
            "learning_rate = 0.0002\nunet_lr = 0.0004\ntext_encoder_lr = [0.0001, 0.00005]\n",
        )
        .unwrap();
        let scales = LrScales::of(&cfg.train).unwrap();
        assert_eq!(
            scales,
            LrScales {
                unet: 2.0,
                text_encoder: 0.5,
                text_encoder_2: 0.25
            }
        );
        let groups = model_groups(named(), Some(4.0), Some(scales));
        let got: Vec<(String, usize, f64)> = groups
            .iter()
            .map(|g| (g.name.clone(), g.params.len(), g.lr_scale))
            .collect();
        assert_eq!(
            got,
            vec![
                ("unet.lora_A".to_string(), 1, 2.0),
                ("unet.lora_B".to_string(), 1, 8.0),
                ("text_encoder.lora_A".to_string(), 1, 0.5),
                ("text_encoder_2.lora_A".to_string(), 1, 0.25),
            ]
        );
        // neither rate set: the groups every other run has
        let plain = crate::config::TrainConfig::default();
        assert_eq!(LrScales::of(&plain.train), None);
        assert_eq!(model_groups(named(), None, None).len(), 1);
    }
}
