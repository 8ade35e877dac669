//! The FLUX training step: the rectified-flow loss of a batch through the LoRA-injected
//! transformer, and the fixed-noise evaluation before and after training.

use crate::config::{FluxSection, ModelPredictionType, TimestepSampling, TrainConfig};
use crate::engine::TrainStep;
use crate::job::error::model_step_err as model_err;
use crate::recipes::images::LatentPipeline;
use lora_data::image::ImageBatch;
use lora_models::diffusion::{self as flow, FlowMatchingLoss, FlowNoisedBatch, LossWeighting};
use lora_models::flux::pipeline::{FluxPipeline, FluxTextCond};
use lora_models::flux::{FluxInputs, latent_image_ids, pack_latents, unpack_latents};
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

/// One training batch of the FLUX job.
///
/// # Shapes
/// `latents` `[b, C, h, w]` f32 (scaled and shifted autoencoder latents, `C` = 16 for FLUX.1,
/// `h = H/8`); `cond` see [`FluxTextCond`].
#[derive(Debug)]
pub struct FluxBatch {
    /// The autoencoder's latents.
    pub latents: Tensor,
    /// Cached text conditioning (T5 states, CLIP pooled output); `None` when the captions
    /// change between epochs and are encoded in the step.
    pub cond: Option<FluxTextCond>,
    /// The processed captions.
    pub captions: Vec<String>,
    /// The seed of this batch's σ and noise draws (see
    /// [`crate::sd::SdBatch::noise_seed`]: the same batch draws the same noise however it is
    /// reached, resumed runs included); `None`: the generator as it stands.
    pub noise_seed: Option<u64>,
}

/// How a FLUX run encodes captions and conditions the transformer: `flux.t5xxl_max_token_length`
/// (default 512 for dev, 256 for schnell, as kohya), `flux.apply_t5_attn_mask` and the guidance
/// value of FLUX.1-dev (`flux.guidance_scale`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FluxConditioning {
    /// T5 tokens per caption.
    pub max_sequence_length: usize,
    /// Mask T5's padding tokens in the T5 encoder.
    pub apply_t5_attn_mask: bool,
    /// The guidance embedder's input while training (dev); `None` for schnell.
    pub guidance: Option<f64>,
}

impl FluxConditioning {
    /// The conditioning settings of `cfg` for `pipe`.
    pub fn of(cfg: &FluxSection, pipe: &FluxPipeline) -> Self {
        let dev = pipe.is_dev();
        FluxConditioning {
            max_sequence_length: cfg
                .t5xxl_max_token_length
                .map_or(if dev { 512 } else { 256 }, |n| n as usize),
            apply_t5_attn_mask: cfg.apply_t5_attn_mask,
            guidance: dev.then_some(cfg.guidance_scale),
        }
    }
}

/// The pipeline as the shared image source sees it: latents by the autoencoder, captions by
/// CLIP-L + T5 with the run's [`FluxConditioning`].
pub struct FluxImages {
    /// The pipeline (shared with the step and the sampler).
    pub pipe: FluxPipeline,
    /// How captions are encoded.
    pub cond: FluxConditioning,
}

impl LatentPipeline for FluxImages {
    type Cond = FluxTextCond;
    type Batch = FluxBatch;

    fn encode_latents(&self, pixels: &Tensor) -> lora_models::Result<Tensor> {
        let _g = tch::no_grad_guard();
        Ok(self.pipe.encode_images(pixels)?.f_to_device(Device::Cpu)?)
    }

    fn encode_caption(&self, caption: &str) -> lora_models::Result<FluxTextCond> {
        let _g = tch::no_grad_guard();
        self.pipe
            .encode_prompts(
                &[caption],
                self.cond.max_sequence_length,
                self.cond.apply_t5_attn_mask,
            )?
            .row(0)?
            .to_device(Device::Cpu)
    }

    fn share(cond: &FluxTextCond) -> FluxTextCond {
        cond.shallow_clone()
    }

    fn make_batch(
        &self,
        latents: Tensor,
        conds: Option<Vec<FluxTextCond>>,
        batch: ImageBatch,
        noise_seed: Option<u64>,
    ) -> crate::engine::Result<FluxBatch> {
        Ok(FluxBatch {
            latents,
            cond: match conds {
                Some(c) => Some(FluxTextCond::stack(&c).map_err(model_err)?),
                None => None,
            },
            captions: batch.captions,
            noise_seed,
        })
    }
}

/// The flow-matching objective of a run: kohya's `timestep_sampling` (with `sigmoid_scale`,
/// `discrete_flow_shift`, `logit_mean` / `logit_std`) and `model_prediction_type`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FluxObjective {
    /// σ sampling and loss weighting.
    pub loss: FlowMatchingLoss,
    /// How the transformer's output becomes the prediction.
    pub prediction: ModelPredictionType,
}

impl FluxObjective {
    /// The objective of `cfg.flux`.
    ///
    /// # Errors
    /// [`crate::job::JobError::Model`] for sampling parameters lora-models rejects.
    pub fn of(cfg: &TrainConfig) -> crate::job::Result<Self> {
        let f = &cfg.flux;
        let sampling = match f.timestep_sampling {
            TimestepSampling::Sigma => flow::TimestepSampling::Sigma {
                discrete_flow_shift: f.discrete_flow_shift,
            },
            TimestepSampling::Uniform => flow::TimestepSampling::Uniform,
            TimestepSampling::Sigmoid => flow::TimestepSampling::Sigmoid {
                sigmoid_scale: f.sigmoid_scale,
            },
            TimestepSampling::Shift => flow::TimestepSampling::Shift {
                sigmoid_scale: f.sigmoid_scale,
                discrete_flow_shift: f.discrete_flow_shift,
            },
            TimestepSampling::FluxShift => flow::TimestepSampling::FluxShift {
                sigmoid_scale: f.sigmoid_scale,
            },
            TimestepSampling::LogitNormal => flow::TimestepSampling::LogitNormal {
                logit_mean: f.logit_mean,
                logit_std: f.logit_std,
                discrete_flow_shift: f.discrete_flow_shift,
            },
        };
        let loss = FlowMatchingLoss::new(sampling, LossWeighting::None).map_err(|e| {
            crate::job::JobError::Model {
                during: "the flow-matching loss (flux.timestep_sampling)".into(),
                source: e,
            }
        })?;
        Ok(FluxObjective {
            loss,
            prediction: f.model_prediction_type,
        })
    }

    /// The prediction compared with the target `ε − x₀` from the transformer's unpacked output
    /// `out` (kohya sd-scripts `flux_train_utils.apply_model_prediction_type`): `raw` → `out`;
    /// `additive` → `out + x_σ`; `sigma_scaled` → `out · (−σ) + x_σ`, kohya's expression
    /// as it stands (an estimate of `x₀`, compared with the velocity target all the same).
    ///
    /// # Errors
    /// libtorch errors.
    pub fn prediction(&self, out: &Tensor, nb: &FlowNoisedBatch) -> lora_models::Result<Tensor> {
        let x = nb.noisy_latents.f_to_kind(out.kind())?;
        Ok(match self.prediction {
            ModelPredictionType::Raw => out.shallow_clone(),
            ModelPredictionType::Additive => out.f_add(&x)?,
            ModelPredictionType::SigmaScaled => {
                let b = out.size()[0];
                let s = nb
                    .sigmas
                    .f_to_kind(out.kind())?
                    .f_to_device(out.device())?
                    .f_view([b, 1, 1, 1])?;
                out.f_mul(&s.f_neg()?)?.f_add(&x)?
            }
        })
    }
}

/// The transformer's inputs for noisy latents `noisy` `[b, C, h, w]` at σ `sigmas` `[b]` with
/// conditioning `cond` (on the transformer's device), packed as FLUX packs them; returns the
/// packed latents, image ids, text ids and guidance `[b]` (dev).
fn packed_inputs(
    noisy: &Tensor,
    cond: &FluxTextCond,
    kind: Kind,
    guidance: Option<f64>,
) -> lora_models::Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
    let sz = noisy.size();
    let d = noisy.device();
    let packed = pack_latents(&noisy.f_to_kind(kind)?)?;
    let img_ids = latent_image_ids(sz[2] / 2, sz[3] / 2, d)?;
    let txt_ids = cond.txt_ids()?.f_to_device(d)?;
    let g = match guidance {
        Some(g) => Some(Tensor::f_full([sz[0]], g, (Kind::Float, d))?),
        None => None,
    };
    Ok((packed, img_ids, txt_ids, g))
}

/// The velocity the transformer predicts for `nb` under `cond` ([`FluxPipeline::predict`]),
/// unpacked to the latents' shape `[b, C, h, w]` (inference or training forward by `train`).
///
/// # Errors
/// Model errors.
pub fn predict(
    pipe: &FluxPipeline,
    nb: &FlowNoisedBatch,
    cond: &FluxTextCond,
    guidance: Option<f64>,
    train: bool,
) -> lora_models::Result<Tensor> {
    // the pipeline's own forward on packed latents (ids, dtype and device as it samples)
    let sz = nb.noisy_latents.size();
    let packed = pack_latents(&nb.noisy_latents.f_to_kind(pipe.kind())?)?;
    let g = match guidance {
        Some(g) => Some(Tensor::f_full([sz[0]], g, (Kind::Float, packed.device()))?),
        None => None,
    };
    let out = pipe.predict(&packed, &nb.sigmas, cond, (sz[2], sz[3]), g.as_ref(), train)?;
    unpack_latents(&out, sz[2], sz[3])
}

/// The FLUX [`TrainStep`]: LoRA on the transformer, loss = flow matching
/// ([`FluxObjective`]), the T5/CLIP conditioning cached or encoded under no-grad.
pub struct FluxTask {
    /// The pipeline (shared with the batch source and the sampler).
    pub images: Rc<FluxImages>,
    /// The objective.
    pub objective: FluxObjective,
    /// Adapter tensors by VarStore name, sorted.
    pub named: Vec<(String, Tensor)>,
    /// LoRA+ ratio for the B matrices.
    pub loraplus_lr_ratio: Option<f64>,
}

impl FluxTask {
    /// The batch's latents and conditioning on the transformer's device.
    fn inputs(&self, b: &FluxBatch) -> crate::engine::Result<(Tensor, FluxTextCond)> {
        let pipe = &self.images.pipe;
        let d = pipe.device();
        let cond = match &b.cond {
            Some(c) => c.to_device(d).map_err(model_err)?,
            None => {
                let _g = tch::no_grad_guard();
                let caps: Vec<&str> = b.captions.iter().map(String::as_str).collect();
                let c = &self.images.cond;
                pipe.encode_prompts(&caps, c.max_sequence_length, c.apply_t5_attn_mask)
                    .and_then(|t| t.to_device(d))
                    .map_err(model_err)?
            }
        };
        Ok((b.latents.f_to_device(d)?, cond))
    }
}

impl TrainStep for FluxTask {
    type Batch = FluxBatch;

    fn loss(&mut self, b: &FluxBatch, train: bool) -> crate::engine::Result<Tensor> {
        seed_noise(b);
        let (lat, cond) = self.inputs(b)?;
        let nb = self.objective.loss.noised(&lat).map_err(model_err)?;
        let out = predict(
            &self.images.pipe,
            &nb,
            &cond,
            self.images.cond.guidance,
            train,
        )
        .map_err(model_err)?;
        let pred = self.objective.prediction(&out, &nb).map_err(model_err)?;
        self.objective
            .loss
            .loss_from_prediction(&pred, &nb)
            .map_err(model_err)
    }

    /// With gradient checkpointing on, the transformer recomputes its blocks one by one during
    /// backward ([`lora_models::flux::FluxTransformer2DModel::loss_backward`]); otherwise the
    /// trainer's plain path runs.
    fn loss_backward(
        &mut self,
        b: &FluxBatch,
        scale: f64,
    ) -> crate::engine::Result<Option<Tensor>> {
        let pipe = &self.images.pipe;
        if !pipe.transformer.gradient_checkpointing() {
            return Ok(None);
        }
        seed_noise(b);
        let (lat, cond) = self.inputs(b)?;
        let nb = self.objective.loss.noised(&lat).map_err(model_err)?;
        let sz = lat.size();
        let (packed, img_ids, txt_ids, g) = packed_inputs(
            &nb.noisy_latents,
            &cond,
            pipe.transformer.kind(),
            self.images.cond.guidance,
        )
        .map_err(model_err)?;
        let obj = &self.objective;
        pipe.transformer
            .loss_backward(
                &FluxInputs {
                    hidden_states: &packed,
                    encoder_hidden_states: &cond.t5,
                    pooled_projections: &cond.pooled,
                    timestep: &nb.sigmas,
                    img_ids: &img_ids,
                    txt_ids: &txt_ids,
                    guidance: g.as_ref(),
                },
                true,
                scale,
                |out| {
                    let out = unpack_latents(out, sz[2], sz[3])?;
                    let pred = obj.prediction(&out, &nb)?;
                    obj.loss.loss_from_prediction(&pred, &nb)
                },
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

    fn micro_batch_len(&self, b: &FluxBatch) -> usize {
        b.latents.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(&self, b: &FluxBatch, parts: usize) -> crate::engine::Result<Vec<FluxBatch>> {
        let n = parts.max(1) as i64;
        let l = b.latents.f_chunk(n, 0)?;
        let k = l.len();
        let conds: Vec<Option<FluxTextCond>> = match &b.cond {
            Some(c) => {
                let rows = c.t5.size()[0];
                let k = k.max(1) as i64;
                let per = ((rows + k - 1) / k).max(1);
                (0..k)
                    .map(|i| {
                        let idx: Vec<FluxTextCond> = (i * per..((i + 1) * per).min(rows))
                            .map(|r| c.row(r))
                            .collect::<lora_models::Result<_>>()?;
                        Ok(Some(FluxTextCond::stack(&idx)?))
                    })
                    .collect::<lora_models::Result<_>>()
                    .map_err(model_err)?
            }
            None => (0..k).map(|_| None).collect(),
        };
        let per = b.captions.len().div_ceil(k.max(1)).max(1);
        let caps: Vec<Vec<String>> = b.captions.chunks(per).map(<[String]>::to_vec).collect();
        Ok(l.into_iter()
            .zip(conds)
            .enumerate()
            .map(|(i, (latents, cond))| FluxBatch {
                latents,
                cond,
                captions: caps.get(i).cloned().unwrap_or_default(),
                // each part of a split batch its own draws
                noise_seed: b
                    .noise_seed
                    .map(|s| lora_data::rng::mix(&[s, parts as u64, i as u64])),
            })
            .collect())
    }
}

/// Seeds torch's generator with the batch's [`FluxBatch::noise_seed`], if it has one.
fn seed_noise(b: &FluxBatch) {
    if let Some(s) = b.noise_seed {
        // torch's manual_seed takes the 64 bits as they are
        tch::manual_seed(s as i64);
    }
}

/// σ values of the fixed evaluation (spread over the flow from nearly clean to nearly noise).
pub const EVAL_SIGMAS: [f64; 5] = [0.1, 0.3, 0.5, 0.7, 0.9];

/// The flow-matching loss of `batches` on fixed noise at fixed σ ([`EVAL_SIGMAS`]): every
/// latent is scored at each σ with noise drawn from `seed` (batch by batch, σ by σ); the mean
/// over all items and σ (f64). Identical inputs before and after training, so the difference is
/// the adapter's doing. torch's CPU generator is restored afterwards.
///
/// # Errors
/// Model errors.
pub fn fixed_eval_loss(
    images: &FluxImages,
    objective: &FluxObjective,
    batches: &[FluxBatch],
    seed: u64,
) -> lora_models::Result<f64> {
    let _g = tch::no_grad_guard();
    let saved = lora_core::sys::rng_state(Device::Cpu).ok();
    let pipe = &images.pipe;
    let d = pipe.device();
    tch::manual_seed(seed as i64);
    let mut total = 0.0;
    let mut items = 0i64;
    'batches: for batch in batches {
        let lat = batch.latents.f_to_device(d)?;
        let cond = match &batch.cond {
            Some(c) => c.to_device(d)?,
            None => {
                let caps: Vec<&str> = batch.captions.iter().map(String::as_str).collect();
                pipe.encode_prompts(
                    &caps,
                    images.cond.max_sequence_length,
                    images.cond.apply_t5_attn_mask,
                )?
                .to_device(d)?
            }
        };
        let n = lat.size()[0];
        for &s in &EVAL_SIGMAS {
            // Ctrl-C: answered between forward passes (the caller reports the interruption)
            if crate::engine::stop_requested() {
                break 'batches;
            }
            let noise = Tensor::f_randn(lat.size(), (Kind::Float, Device::Cpu))?
                .f_to_device(d)?
                .f_to_kind(lat.kind())?;
            let sigmas = Tensor::f_full([n], s, (Kind::Float, d))?;
            let nb = objective.loss.noised_with(&lat, &noise, &sigmas)?;
            let out = predict(pipe, &nb, &cond, images.cond.guidance, false)?;
            let pred = objective.prediction(&out, &nb)?;
            let l = objective.loss.loss_from_prediction(&pred, &nb)?;
            total += l.f_double_value(&[])? * n as f64;
        }
        items += n;
    }
    if let Some(s) = saved {
        let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
    }
    Ok(total / (items.max(1) as f64 * EVAL_SIGMAS.len() as f64))
}
