//! The Stable Diffusion LoRA job: plan → load → inject → data → train → sample → export.
//!
//! - **Model**: a diffusers pipeline folder (`StableDiffusionPipeline.save_pretrained` layout:
//!   `unet/`, `vae/`, `text_encoder/`, `tokenizer/`, `scheduler/`), SD 1.x / 2.x.
//! - **Adapter**: LoRA on the UNet's attention projections (`to_q`, `to_k`, `to_v`, `to_out.0`
//!   by default — the modules of diffusers' `train_text_to_image_lora.py`); any UNet site can
//!   be targeted through `lora.target_modules` (e.g. `ff.net.0.proj`, `ff.net.2`, `proj_in`,
//!   or the 3×3 `conv1`/`conv2` of the ResNets for LoCon-style adapters). The text encoder is
//!   frozen and its outputs are cached per caption.
//! - **Data**: a kohya-style image folder (`<repeats>_<concept>` subfolders) or a kohya dataset
//!   TOML (`data.train_data_dir` ending in `.toml`), captions from sidecar files
//!   (`caption_extension`, `shuffle_caption`, `keep_tokens`), aspect buckets; latents are
//!   encoded once per (image, bucket, crop, flip) and kept in memory, and also on disk under
//!   `<output_dir>/latent_cache` with `data.cache_latents: true` (lora-data's [`LatentCache`]).
//! - **Objective**: lora-models' [`DiffusionLoss`] (ε or v target from the scheduler config or
//!   `train.prediction_type`, `train.min_snr_gamma`, `train.noise_offset`), the UNet's
//!   checkpointed backward with `train.gradient_checkpointing`; conditioning at
//!   `train.clip_skip`.
//! - **Engine**: the [`crate::trainer::Trainer`] as for LLMs: gradient accumulation, mixed
//!   precision, OOM back-off (batches split), NaN policy, checkpoints and exact resume (the
//!   loader position is part of the checkpoint).
//! - **Evaluation**: the loss on fixed noise and fixed timesteps ([`EVAL_TIMESTEPS`]) over the
//!   8 items spread over the epoch, before and after training ([`fixed_eval_loss`]).
//! - **Sampling**: DDIM or Euler (`logging.sample_sampler`, `sample_steps`,
//!   `sample_guidance_scale`) on `logging.sample_prompts` (or the lines of
//!   `logging.sample_prompt`) every `logging.sample_every_n_steps` steps and at the end, a PNG
//!   grid `<output_dir>/samples/step-N.png` (one column per prompt).
//! - **Export**: kohya `<output_dir>/<output_name>.safetensors` (`lora_unet_…` modules, f32
//!   `.alpha`, `ss_*` metadata incl. `ss_base_model_version` and `ss_v2`) and, for the `peft`
//!   export format, diffusers' `<output_dir>/<output_name>/pytorch_lora_weights.safetensors`
//!   (`unet.<module>.lora_A/B.weight`, scaling folded into B) — the file
//!   `StableDiffusionPipeline.load_lora_weights` reads.

use crate::config::{Dtype, ExportFormat, ModelKind, TargetModules, TrainConfig};
use crate::llm::{JobError, Plan, Result, RunOptions, resolve_path};
use crate::trainer::{BatchSource, TrainError, TrainStep};
use lora_core::formats::AdapterWeights;
use lora_data::cache::{CacheKey, LatentCache};
use lora_data::image::{ImageCollate, ImageDataset, config::DatasetConfig};
use lora_data::loader::{Dataset, Loader, LoaderConfig};
use lora_models::clip::{ClipTextModel, ClipTokenizer};
use lora_models::diffusion::{
    DdimOptions, DdimSampler, DiffusionLoss, EulerOptions, EulerSampler, LossConfig, NoiseSchedule,
    PredictionType, Sampler, ScheduleConfig,
};
use lora_models::sd::{AutoencoderKL, LoadOptions, UNet2DConditionModel};
use serde::Serialize;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

/// kohya module-name prefix of UNet adapters (sd-scripts `networks/lora.py`
/// `LORA_PREFIX_UNET`).
pub const KOHYA_UNET_PREFIX: &str = "lora_unet";
/// kohya prefix of the SD 1.x/2.x text encoder (`LORA_PREFIX_TEXT_ENCODER`).
pub const KOHYA_TE_PREFIX: &str = "lora_te";
/// The UNet modules adapted when `lora.target_modules` is left at its default: the attention
/// projections, as diffusers' `train_text_to_image_lora.py` (`target_modules=["to_k", "to_q",
/// "to_v", "to_out.0"]`).
pub const DEFAULT_UNET_TARGETS: [&str; 4] = ["to_q", "to_k", "to_v", "to_out.0"];
/// The text-encoder modules adapted with `train.train_text_encoder`: CLIP's attention
/// projections, as diffusers' `train_text_to_image_lora.py` / `train_dreambooth_lora.py`
/// (`target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]`).
pub const TEXT_ENCODER_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "out_proj"];

fn rt<E: std::fmt::Display>(ctx: &str) -> impl FnOnce(E) -> JobError + '_ {
    move |e| JobError::Runtime(format!("{ctx}: {e}"))
}

fn model_err(e: lora_models::Error) -> TrainError {
    match e {
        lora_models::Error::Torch(t) => TrainError::Torch(t),
        other => TrainError::App(other.to_string()),
    }
}

/// Whether `path` looks like a diffusers Stable Diffusion folder (`model_index.json` or a
/// `unet/config.json`): what the CLI uses to send a run to this job.
pub fn is_sd_model(path: &Path) -> bool {
    path.is_dir()
        && (path.join("model_index.json").is_file() || path.join("unet/config.json").is_file())
}

/// Whether `cfg` is for this job: `model.kind` `sd15`/`sdxl`, or `auto` with a base model that
/// [`is_sd_model`] (resolved as [`resolve_path`] does).
pub fn wants_sd_job(cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
    match cfg.model.kind {
        ModelKind::Sd15 | ModelKind::Sdxl => true,
        ModelKind::Llm => false,
        ModelKind::Auto => cfg
            .base_model()
            .ok()
            .and_then(|b| resolve_path("model.base_model", b, config_dir).ok())
            .is_some_and(|p| is_sd_model(&p)),
    }
}

/// The sampler of the sample grids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SamplerKind {
    /// DDIM (Song et al. 2020), η = 0.
    Ddim,
    /// Euler (Karras et al. 2022), diffusers `EulerDiscreteScheduler`.
    Euler,
}

/// How sample grids are made.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SampleOptions {
    /// Image size `(width, height)` in pixels (multiples of the VAE factor).
    pub size: (u32, u32),
    /// Sampler steps.
    pub steps: usize,
    /// Classifier-free guidance scale (≤ 1 = none).
    pub guidance_scale: f64,
    /// Seed of the initial noise.
    pub seed: u64,
    /// The sampler.
    pub sampler: SamplerKind,
}

// ---------------------------------------------------------------------------------------------
// The pipeline
// ---------------------------------------------------------------------------------------------

/// UNet + VAE + CLIP text encoder + tokenizer + noise schedule of an SD 1.x/2.x pipeline.
#[derive(Debug)]
pub struct SdPipeline {
    /// The denoiser (adapters are injected here).
    pub unet: UNet2DConditionModel,
    /// The autoencoder (frozen).
    pub vae: AutoencoderKL,
    /// The text encoder (frozen).
    pub text_encoder: ClipTextModel,
    /// The tokenizer (rows of 77 ids).
    pub tokenizer: ClipTokenizer,
    /// The training noise schedule (`scheduler/scheduler_config.json`, else SD's).
    pub schedule: ScheduleConfig,
    /// kohya / A1111 clip skip (1 = last layer, 2 = penultimate; see
    /// [`ClipTextModel::skip_hidden`]).
    pub clip_skip: usize,
}

impl SdPipeline {
    /// Loads a diffusers pipeline folder in dtype `kind` on `device`.
    ///
    /// # Errors
    /// [`JobError::Runtime`] naming the component and the loader's message; a single-file
    /// checkpoint is refused with the hint to convert it (its text encoder is not read here).
    pub fn from_diffusers(dir: &Path, kind: Kind, device: Device) -> Result<Self> {
        if dir.is_file() {
            return Err(JobError::Runtime(format!(
                "{}: single-file SD checkpoints are not read by the SD job yet; convert it to a diffusers folder (diffusers `StableDiffusionPipeline.from_single_file(path).save_pretrained(dir)`)",
                dir.display()
            )));
        }
        let opts = LoadOptions {
            kind,
            device,
            ..LoadOptions::default()
        };
        let ctx = |c: &str| format!("loading {} of {}", c, dir.display());
        let unet =
            UNet2DConditionModel::from_diffusers(dir, &opts).map_err(rt(&ctx("the UNet")))?;
        if unet.config().addition_embed_type.is_some() {
            return Err(JobError::Runtime(format!(
                "{}: an SDXL UNet (addition_embed_type set); the SD job trains SD 1.x/2.x pipelines",
                dir.display()
            )));
        }
        let vae = AutoencoderKL::from_diffusers(dir, &opts).map_err(rt(&ctx("the VAE")))?;
        let text_encoder = ClipTextModel::from_pretrained(dir.join("text_encoder"), kind, device)
            .map_err(rt(&ctx("text_encoder")))?;
        let tokenizer =
            ClipTokenizer::from_dir(dir.join("tokenizer")).map_err(rt(&ctx("tokenizer")))?;
        let sched_file = dir.join("scheduler/scheduler_config.json");
        let schedule = if sched_file.is_file() {
            ScheduleConfig::from_file(&sched_file).map_err(rt(&ctx("the scheduler config")))?
        } else {
            ScheduleConfig::sd()
        };
        Ok(SdPipeline {
            unet,
            vae,
            text_encoder,
            tokenizer,
            schedule,
            clip_skip: 1,
        })
    }

    /// The UNet conditioning of `prompts`: `[n, 77, cross_attention_dim]` in the model dtype,
    /// computed without grad (clip skip applied, with the final LayerNorm as kohya does for
    /// SD 1.x/2.x).
    ///
    /// # Errors
    /// Tokenizer / model errors.
    pub fn encode_prompts<S: AsRef<str>>(&self, prompts: &[S]) -> lora_models::Result<Tensor> {
        let _g = tch::no_grad_guard();
        let ids = self.tokenizer.encode_batch(prompts)?;
        self.condition(&ids, false)
    }

    /// The UNet conditioning of token ids `[n, 77]` int64: `[n, 77, D]` in the text encoder's
    /// dtype, with autograd as the caller's grad mode says (text-encoder LoRA training); `train`
    /// switches LoRA dropout on.
    ///
    /// # Errors
    /// Model errors.
    pub fn condition(&self, ids: &Tensor, train: bool) -> lora_models::Result<Tensor> {
        let ids = ids.f_to_device(self.text_encoder.device())?;
        let out = self.text_encoder.forward_t(&ids, train)?;
        self.text_encoder.skip_hidden(&out, self.clip_skip, true)
    }

    /// Scaled latents of `pixels` `[b, 3, H, W]` in `[-1, 1]` → `[b, 4, H/f, W/f]` f32 on the
    /// CPU (`f` = 2^(VAE levels − 1)): the mean of the VAE's latent distribution times
    /// `scaling_factor` (diffusers `latent_dist.mode()`; a cached latent fixes one draw either
    /// way, the mean is the reproducible one). Computed without grad.
    ///
    /// # Errors
    /// Model errors.
    pub fn encode_images(&self, pixels: &Tensor) -> lora_models::Result<Tensor> {
        let _g = tch::no_grad_guard();
        let x = pixels.f_to_device(self.unet_device())?;
        let z = self.vae.encode(&x)?.mode();
        Ok(self
            .vae
            .scale_latents(&z)?
            .f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?)
    }

    fn unet_device(&self) -> Device {
        self.text_encoder.device()
    }

    /// Generates one image per prompt with DDIM or Euler (`opts.steps` steps, classifier-free
    /// guidance against the empty prompt) from seeded noise; `[n, 3, H, W]` f32 in ≈ `[-1, 1]`
    /// on the CPU. The global CPU generator is restored afterwards, so sampling during training
    /// does not change the training noise.
    ///
    /// # Errors
    /// Model / sampler errors.
    pub fn sample_images<S: AsRef<str>>(
        &self,
        prompts: &[S],
        opts: &SampleOptions,
    ) -> lora_models::Result<Tensor> {
        let (size, steps, guidance_scale, seed) =
            (opts.size, opts.steps, opts.guidance_scale, opts.seed);
        let dev = self.unet_device();
        let saved = lora_core::sys::rng_state(Device::Cpu).ok();
        let _g = tch::no_grad_guard();
        let n = prompts.len() as i64;
        let cond = self.encode_prompts(prompts)?;
        let uncond = self.encode_prompts(&vec![""; prompts.len()])?;
        let ctx = Tensor::f_cat(&[uncond, cond], 0)?;
        let f = self.vae_factor();
        let c = self.unet.config().in_channels;
        tch::manual_seed(seed as i64);
        let noise = Tensor::f_randn(
            [n, c, i64::from(size.1) / f, i64::from(size.0) / f],
            (Kind::Float, Device::Cpu),
        )?
        .f_to_device(dev)?;
        let schedule = NoiseSchedule::new(self.schedule.clone())?;
        let sampler: Box<dyn Sampler> = match opts.sampler {
            SamplerKind::Ddim => {
                Box::new(DdimSampler::new(&schedule, steps, &DdimOptions::default())?)
            }
            SamplerKind::Euler => Box::new(EulerSampler::new(
                &schedule,
                steps,
                &EulerOptions::default(),
            )?),
        };
        let z =
            lora_models::diffusion::sample(sampler.as_ref(), &noise, guidance_scale, |x, t| {
                let ts = Tensor::f_from_slice(&[t as f32])?.f_to_device(dev)?;
                let c = if guidance_scale > 1.0 {
                    ctx.shallow_clone()
                } else {
                    ctx.f_narrow(0, n, n)?
                };
                self.unet.forward(x, &ts, &c, None)
            })?;
        let img = self.vae.decode(&self.vae.unscale_latents(&z)?)?;
        if let Some(s) = saved {
            let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
        }
        Ok(img.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?)
    }

    /// The VAE's spatial factor `2^(levels − 1)` (8 for SD).
    pub fn vae_factor(&self) -> i64 {
        1i64 << (self.vae.config().block_out_channels.len().saturating_sub(1))
    }
}

// ---------------------------------------------------------------------------------------------
// Batches, the train step, the batch source
// ---------------------------------------------------------------------------------------------

/// One training batch of the SD job.
///
/// # Shapes
/// `latents` `[b, 4, h, w]` f32 (scaled); `ids` `[b, 77]` int64; `cond` `[b, 77, D]` in the text
/// encoder's dtype.
#[derive(Debug)]
pub struct SdBatch {
    /// Scaled VAE latents.
    pub latents: Tensor,
    /// Caption token ids.
    pub ids: Tensor,
    /// Cached text-encoder conditioning (`None` when the text encoder is trained: it is then
    /// computed from `ids` in the step, with grad).
    pub cond: Option<Tensor>,
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
    fn inputs(&self, b: &SdBatch, train: bool) -> crate::trainer::Result<(Tensor, Tensor)> {
        let d = self.pipe.unet_device();
        let cond = match &b.cond {
            Some(c) => c.f_to_device(d)?,
            None => self.pipe.condition(&b.ids, train).map_err(model_err)?,
        };
        Ok((b.latents.f_to_device(d)?, cond))
    }
}

impl TrainStep for SdTask {
    type Batch = SdBatch;

    fn loss(&mut self, b: &SdBatch, train: bool) -> crate::trainer::Result<Tensor> {
        let (lat, cond) = self.inputs(b, train)?;
        let unet = &self.pipe.unet;
        self.objective
            .loss(&lat, |x, t| unet.forward_t(x, t, &cond, None, train))
            .map_err(model_err)
    }

    /// With gradient checkpointing on, the UNet recomputes its units during backward
    /// ([`UNet2DConditionModel::loss_backward`]); otherwise the trainer's plain path runs.
    fn loss_backward(&mut self, b: &SdBatch, scale: f64) -> crate::trainer::Result<Option<Tensor>> {
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
        self.pipe
            .unet
            .loss_backward(
                &nb.noisy_latents,
                &nb.timesteps,
                &cond,
                None,
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

    fn param_groups(&self) -> Vec<crate::optim::ParamGroup> {
        match self.loraplus_lr_ratio {
            Some(r) => crate::optim::lora_plus_groups(self.named_trainable(), r),
            None => vec![crate::optim::ParamGroup::new(
                "adapters",
                self.named.iter().map(|(_, t)| t.shallow_clone()).collect(),
            )],
        }
    }

    fn micro_batch_len(&self, b: &SdBatch) -> usize {
        b.latents.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(&self, b: &SdBatch, parts: usize) -> crate::trainer::Result<Vec<SdBatch>> {
        let n = parts.max(1) as i64;
        let l = b.latents.f_chunk(n, 0)?;
        let ids = b.ids.f_chunk(n, 0)?;
        let c: Vec<Option<Tensor>> = match &b.cond {
            Some(c) => c.f_chunk(n, 0)?.into_iter().map(Some).collect(),
            None => (0..l.len()).map(|_| None).collect(),
        };
        let per = b.captions.len().div_ceil(l.len().max(1)).max(1);
        let caps: Vec<Vec<String>> = b.captions.chunks(per).map(<[String]>::to_vec).collect();
        Ok(l.into_iter()
            .zip(ids)
            .zip(c)
            .enumerate()
            .map(|(i, ((latents, ids), cond))| SdBatch {
                latents,
                ids,
                cond,
                captions: caps.get(i).cloned().unwrap_or_default(),
            })
            .collect())
    }
}

/// The trainer's batch source over an [`ImageDataset`]: the loader's seeded per-epoch plan
/// (batches never mix buckets), each image encoded by the VAE once per (file content, bucket,
/// crop, flip) and kept in memory (and on disk with a [`LatentCache`]), each caption tokenized
/// and, when the text encoder is frozen, encoded once. The position (epoch, batch index) is
/// checkpointed.
pub struct ImageSource {
    pipe: Rc<SdPipeline>,
    loader: Loader<ImageDataset, ImageCollate>,
    plan: Vec<Vec<usize>>,
    epoch: u64,
    next: usize,
    seed: u64,
    model_id: String,
    disk: Option<LatentCache>,
    latents: HashMap<String, Tensor>,
    text: HashMap<String, Tensor>,
    cache_text: bool,
    /// VAE encodings done (cache misses).
    pub encoded: Rc<RefCell<u64>>,
}

impl ImageSource {
    /// Wraps a loader; `model_id` names the VAE in cache keys; `disk` adds an on-disk cache;
    /// `cache_text` caches text-encoder outputs per caption (only valid while the text encoder
    /// is frozen).
    pub fn new(
        pipe: Rc<SdPipeline>,
        loader: Loader<ImageDataset, ImageCollate>,
        seed: u64,
        model_id: String,
        disk: Option<LatentCache>,
        cache_text: bool,
    ) -> Self {
        ImageSource {
            pipe,
            loader,
            plan: Vec::new(),
            epoch: 0,
            next: 0,
            seed,
            model_id,
            disk,
            latents: HashMap::new(),
            text: HashMap::new(),
            cache_text,
            encoded: Rc::new(RefCell::new(0)),
        }
    }

    fn item_seed(&self, index: usize) -> u64 {
        // splitmix64 of (seed, epoch, index): per-item caption shuffles / crops / flips
        let mut z = self
            .seed
            .wrapping_add(self.epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add((index as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The batch of dataset items `idx` with seed function `seed_of`.
    fn build(&mut self, idx: &[usize], seeds: &[u64]) -> crate::trainer::Result<SdBatch> {
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        let mut lats = Vec::with_capacity(idx.len());
        let mut conds = Vec::with_capacity(idx.len());
        let mut caps = Vec::with_capacity(idx.len());
        for (&i, &s) in idx.iter().zip(seeds) {
            let sample = self.loader.dataset().get_seeded(i, s).map_err(data)?;
            let key: CacheKey = sample.cache_key(&self.model_id).map_err(data)?;
            let digest = key.digest();
            let lat = match self.latents.get(&digest) {
                Some(t) => t.shallow_clone(),
                None => {
                    let from_disk = match &self.disk {
                        Some(c) => c.get(&key).map_err(data)?,
                        None => None,
                    };
                    let t = match from_disk {
                        Some(t) => t,
                        None => {
                            let t = self
                                .pipe
                                .encode_images(&sample.pixels.f_unsqueeze(0)?)
                                .map_err(model_err)?
                                .f_squeeze_dim(0)?;
                            *self.encoded.borrow_mut() += 1;
                            if let Some(c) = &self.disk {
                                c.put(&key, &t).map_err(data)?;
                            }
                            t
                        }
                    };
                    self.latents.insert(digest, t.shallow_clone());
                    t
                }
            };
            if self.cache_text {
                let cond = match self.text.get(&sample.caption) {
                    Some(t) => t.shallow_clone(),
                    None => {
                        let t = self
                            .pipe
                            .encode_prompts(&[sample.caption.as_str()])
                            .map_err(model_err)?
                            .f_squeeze_dim(0)?;
                        self.text.insert(sample.caption.clone(), t.shallow_clone());
                        t
                    }
                };
                conds.push(cond);
            }
            lats.push(lat);
            caps.push(sample.caption);
        }
        let ids = self.pipe.tokenizer.encode_batch(&caps).map_err(model_err)?;
        Ok(SdBatch {
            latents: Tensor::f_stack(&lats, 0)?,
            ids,
            cond: if self.cache_text {
                Some(Tensor::f_stack(&conds, 0)?)
            } else {
                None
            },
            captions: caps,
        })
    }

    /// A fixed batch of `n` items spread evenly over the epoch's item list (so repeats of one
    /// image are not picked twice when `n` ≤ the number of images), built with seed 0
    /// (centred crops, no flips, captions as seed 0 shuffles them) for the fixed-noise
    /// evaluation.
    ///
    /// # Errors
    /// Data / model errors.
    pub fn fixed_batch(&mut self, n: usize) -> crate::trainer::Result<SdBatch> {
        let len = self.loader.dataset().len();
        let k = n.min(len).max(1);
        let idx: Vec<usize> = (0..k).map(|j| j * len / k).collect();
        let seeds = vec![0u64; idx.len()];
        self.build(&idx, &seeds)
    }
}

impl BatchSource<SdBatch> for ImageSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::trainer::Result<()> {
        self.plan = self.loader.plan(epoch);
        self.epoch = epoch;
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::trainer::Result<Option<SdBatch>> {
        let Some(idx) = self.plan.get(self.next).cloned() else {
            return Ok(None);
        };
        self.next += 1;
        let seeds: Vec<u64> = idx.iter().map(|&i| self.item_seed(i)).collect();
        self.build(&idx, &seeds).map(Some)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "next": self.next, "items": self.loader.dataset().len()})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::trainer::Result<()> {
        let bad = |m: &str| TrainError::State {
            what: "image loader position".into(),
            message: m.into(),
        };
        let items = state["items"]
            .as_u64()
            .ok_or_else(|| bad("no item count"))?;
        if items != self.loader.dataset().len() as u64 {
            return Err(bad(&format!(
                "the checkpoint was taken over {items} items, this dataset has {}; resume with the same images and repeats",
                self.loader.dataset().len()
            )));
        }
        let epoch = state["epoch"].as_u64().ok_or_else(|| bad("no epoch"))?;
        let next = state["next"].as_u64().ok_or_else(|| bad("no position"))? as usize;
        self.start_epoch(epoch)?;
        self.next = next.min(self.plan.len());
        Ok(())
    }
}

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

impl crate::callbacks::Callback for SampleCallback {
    fn on_step(
        &mut self,
        info: &crate::callbacks::StepInfo,
    ) -> crate::trainer::Result<crate::callbacks::Control> {
        if self.every > 0 && !self.prompts.is_empty() && info.step % self.every == 0 {
            self.write(info.step).map_err(TrainError::App)?;
        }
        Ok(crate::callbacks::Control::Continue)
    }
}

// ---------------------------------------------------------------------------------------------
// Evaluation, export
// ---------------------------------------------------------------------------------------------

/// The diffusion loss of `batch` on fixed noise and fixed timesteps: every latent is scored at
/// each of `timesteps` with noise drawn from `seed`; the mean loss (f64). Identical inputs
/// before and after training, so the difference is the adapter's doing.
///
/// # Errors
/// Model errors.
pub fn fixed_eval_loss(
    pipe: &SdPipeline,
    objective: &DiffusionLoss,
    batch: &SdBatch,
    timesteps: &[i64],
    seed: u64,
) -> lora_models::Result<f64> {
    let _g = tch::no_grad_guard();
    let saved = lora_core::sys::rng_state(Device::Cpu).ok();
    let d = pipe.unet_device();
    let lat = batch.latents.f_to_device(d)?;
    let cond = match &batch.cond {
        Some(c) => c.f_to_device(d)?,
        None => pipe.condition(&batch.ids, false)?,
    };
    let n = lat.size()[0];
    tch::manual_seed(seed as i64);
    let mut total = 0.0;
    for &t in timesteps {
        let noise = Tensor::f_randn(lat.size(), (Kind::Float, Device::Cpu))?
            .f_to_device(d)?
            .f_to_kind(lat.kind())?;
        let ts = Tensor::f_full([n], t, (Kind::Int64, d))?;
        let l =
            objective.loss_with(&lat, noise, ts, |x, t| pipe.unet.forward(x, t, &cond, None))?;
        total += l.f_double_value(&[])?;
    }
    if let Some(s) = saved {
        let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
    }
    Ok(total / timesteps.len().max(1) as f64)
}

/// kohya metadata of an SD 1.x/2.x adapter on top of `base`: `ss_base_model_version`
/// (`sd_v1` / `sd_v2` as sd-scripts writes it), `ss_v2`, `ss_network_train_unet_only`.
pub fn sd_metadata(
    mut base: std::collections::BTreeMap<String, String>,
    v2: bool,
    unet_only: bool,
) -> std::collections::BTreeMap<String, String> {
    let py_bool = |b: bool| if b { "True" } else { "False" };
    base.insert(
        "ss_base_model_version".into(),
        if v2 { "sd_v2" } else { "sd_v1" }.into(),
    );
    base.insert("ss_v2".into(), py_bool(v2).into());
    base.insert(
        "ss_network_train_unet_only".into(),
        py_bool(unet_only).into(),
    );
    base
}

/// The adapters of a pipeline: UNet, and the text encoder's when it has one.
///
/// # Errors
/// [`lora_core::Error::Adapter`] when the UNet lacks the adapter.
fn pipeline_weights(
    pipe: &mut SdPipeline,
    adapter_name: &str,
) -> lora_core::Result<(AdapterWeights, Option<AdapterWeights>)> {
    let unet = AdapterWeights::from_model(&mut pipe.unet, adapter_name)?;
    let te = match AdapterWeights::from_model(&mut pipe.text_encoder, adapter_name) {
        Ok(w) => Some(w),
        Err(lora_core::Error::Adapter { .. }) => None,
        Err(e) => return Err(e),
    };
    Ok((unet, te))
}

/// Writes adapter `adapter_name` of `pipe` as one kohya file at `path`: UNet modules under
/// `lora_unet_`, text-encoder modules (when trained) under `lora_te_` (sd-scripts
/// `networks/lora.py` prefixes for SD 1.x/2.x), f32 `.alpha`, `metadata` in the header.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_kohya(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    metadata: std::collections::BTreeMap<String, String>,
    path: &Path,
) -> lora_core::Result<()> {
    let (mut unet, te) = pipeline_weights(pipe, adapter_name)?;
    unet.metadata = metadata;
    let mut parts = vec![(KOHYA_UNET_PREFIX, &unet)];
    if let Some(te) = &te {
        parts.push((KOHYA_TE_PREFIX, te));
    }
    lora_core::formats::kohya::write(path, &parts)
}

/// Writes adapter `adapter_name` of `pipe` as diffusers' `pytorch_lora_weights.safetensors`
/// into `dir` (`unet.…`, and `text_encoder.…` when the text encoder was trained; the file
/// `StableDiffusionPipeline.load_lora_weights(dir)` reads). Returns the file.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_diffusers(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    dir: &Path,
) -> lora_core::Result<PathBuf> {
    let (unet, te) = pipeline_weights(pipe, adapter_name)?;
    std::fs::create_dir_all(dir).map_err(|e| lora_core::Error::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let path = dir.join(lora_core::formats::diffusers::WEIGHTS_FILE);
    let mut parts = vec![("unet", &unet)];
    if let Some(te) = &te {
        parts.push(("text_encoder", te));
    }
    lora_core::formats::diffusers::write(&path, &parts)?;
    Ok(path)
}

/// How many modules [`load_adapter`] put on each component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoadedAdapter {
    /// UNet modules.
    pub unet_modules: usize,
    /// Text-encoder modules.
    pub text_encoder_modules: usize,
}

fn site_list(model: &mut dyn lora_core::inject::Adaptable) -> lora_core::Result<Vec<String>> {
    let mut sites = Vec::new();
    model.visit_sites(&mut |p, _| {
        sites.push(p.to_string());
        Ok(())
    })?;
    Ok(sites)
}

/// Loads an SD 1.x/2.x LoRA file into `pipe` as adapter `adapter_name` (tensors in `vs`):
/// kohya (`lora_unet_…`, `lora_te_…`; alpha honoured, missing = rank) or diffusers / PEFT for
/// diffusers (`unet.<module>.lora_A.weight`, `text_encoder.<module>…`; transformers 5 text-encoder
/// names without `text_model.` are accepted), told apart by the keys.
///
/// # Errors
/// lora-core format errors naming the file and the modules that match no site; an error for
/// kohya modules under other prefixes (SDXL's `lora_te1_`/`lora_te2_`) or diffusers components
/// other than `unet` / `text_encoder`.
pub fn load_adapter(
    pipe: &mut SdPipeline,
    path: &Path,
    adapter_name: &str,
    vs: &tch::nn::Path,
) -> lora_core::Result<LoadedAdapter> {
    let header = lora_core::formats::read_header(path)?;
    let kohya = header
        .tensors
        .keys()
        .any(|k| k.starts_with("lora_unet_") || k.starts_with("lora_te_"));
    let (unet, mut te) = if kohya {
        let mut f = lora_core::formats::kohya::read(path)?;
        let unet = f.take_prefix(KOHYA_UNET_PREFIX, &site_list(&mut pipe.unet)?)?;
        let te = f.take_prefix(KOHYA_TE_PREFIX, &site_list(&mut pipe.text_encoder)?)?;
        if let Some(k) = f.modules.keys().next() {
            return Err(lora_core::Error::Format {
                file: path.to_path_buf(),
                reason: format!(
                    "module {k:?} is neither lora_unet_ nor lora_te_ (an SDXL adapter? this pipeline is SD 1.x/2.x)"
                ),
            });
        }
        (unet, te)
    } else {
        let mut parts = lora_core::formats::diffusers::read(path)?;
        let unet = parts.remove("unet").unwrap_or_default();
        let te = parts.remove("text_encoder").unwrap_or_default();
        if let Some(k) = parts.keys().next() {
            return Err(lora_core::Error::Format {
                file: path.to_path_buf(),
                reason: format!(
                    "component {k:?}: an SD 1.x/2.x pipeline has `unet` and `text_encoder`"
                ),
            });
        }
        (unet, te)
    };
    lora_models::clip::canonicalize_adapter(&mut te);
    let mut n = LoadedAdapter {
        unet_modules: unet.modules.len(),
        text_encoder_modules: te.modules.len(),
    };
    if n.unet_modules + n.text_encoder_modules == 0 {
        return Err(lora_core::Error::Format {
            file: path.to_path_buf(),
            reason: "no LoRA module in the file".into(),
        });
    }
    if n.unet_modules > 0 {
        n.unet_modules = unet
            .load_into(&mut pipe.unet, adapter_name, &(vs / "unet"), 0.0)?
            .modules
            .len();
    }
    if n.text_encoder_modules > 0 {
        n.text_encoder_modules = te
            .load_into(
                &mut pipe.text_encoder,
                adapter_name,
                &(vs / "text_encoder"),
                0.0,
            )?
            .modules
            .len();
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

/// What an SD run did.
#[derive(Debug, Clone, Serialize)]
pub struct SdRunSummary {
    /// The memory plan, when lora-memory could describe the model.
    pub plan: Option<Plan>,
    /// Optimizer steps done.
    pub steps: u64,
    /// Images per epoch (repeats included).
    pub items: usize,
    /// Distinct images.
    pub images: usize,
    /// `(step, loss)` per logged step.
    pub losses: Vec<(u64, f64)>,
    /// Loss on fixed noise and timesteps over the first images, before training.
    pub eval_loss_before: f64,
    /// The same after training.
    pub eval_loss_after: f64,
    /// VAE encodings done (the latent cache's misses).
    pub vae_encodings: u64,
    /// Seconds spent training.
    pub train_seconds: f64,
    /// Measured memory of the training steps (CPU runs; as the causal-LM job measures it).
    pub memory: crate::llm::MeasuredMemory,
    /// Sample grids written.
    pub samples: Vec<PathBuf>,
    /// Adapter and summary files written.
    pub outputs: Vec<PathBuf>,
}

/// Timesteps of the fixed evaluation (spread over the schedule).
pub const EVAL_TIMESTEPS: [i64; 5] = [50, 250, 450, 650, 850];

fn dataset_config(cfg: &TrainConfig, data_path: &Path) -> Result<DatasetConfig> {
    let lower = data_path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".toml") {
        return DatasetConfig::from_toml_file(data_path)
            .map_err(rt(&format!("reading {}", data_path.display())));
    }
    let d = &cfg.data;
    let mut set = lora_data::image::config::ImageSetConfig::default();
    if let Some([w, h]) = d.resolution {
        set.bucket.resolution = (w, h);
    }
    if let Some(b) = d.enable_bucket {
        set.bucket.enable_bucket = b;
    }
    if let Some(v) = d.min_bucket_reso {
        set.bucket.min_bucket_reso = v;
    }
    if let Some(v) = d.max_bucket_reso {
        set.bucket.max_bucket_reso = v;
    }
    if let Some(v) = d.bucket_reso_steps {
        set.bucket.bucket_reso_steps = v;
    }
    set.batch_size = cfg.train.batch_size.max(1) as usize;
    let mut sub = lora_data::image::config::SubsetConfig::new(data_path);
    if let Some(e) = &d.caption_extension {
        sub.caption_extension = if e.starts_with('.') {
            e.clone()
        } else {
            format!(".{e}")
        };
    }
    if let Some(k) = d.keep_tokens {
        sub.keep_tokens = k as usize;
    }
    if let Some(s) = d.shuffle_caption {
        sub.shuffle_caption = s;
    }
    set.subsets.push(sub);
    let dc = DatasetConfig::from_kohya_folders(data_path, None, &set)
        .map_err(rt(&format!("listing {}", data_path.display())))?;
    if dc.datasets.iter().all(|s| s.subsets.is_empty()) {
        // a plain folder of images: one subset, one repeat
        return Ok(DatasetConfig {
            datasets: vec![set],
        });
    }
    Ok(dc)
}

fn sd_plan(cfg: &mut TrainConfig, path: &Path, cuda: bool) -> Result<Plan> {
    let desc = lora_memory::ModelDescriptor::Diffusion(
        lora_memory::sd_header::diffusion_from_diffusers_folder(path)?,
    );
    let (mut settings, mut notes) = crate::llm::settings_for(cfg, None, cuda);
    let res = cfg.data.resolution.unwrap_or([512, 512]);
    settings.resolution = res[0].max(res[1]);
    settings.cache_latents = true;
    let te = cfg.train.train_text_encoder;
    settings.cache_text_encoder_outputs = !te;
    settings.train_text_encoder = te;
    notes.push(if te {
        "VAE latents are cached; the text encoder is trained (LoRA) and runs every step".into()
    } else {
        "VAE latents and text-encoder outputs are cached; the text encoder is not trained".into()
    });
    let budget = crate::llm::budget_for(cfg, None)?;
    let estimate = lora_memory::estimate(&desc, &settings)?;
    Ok(Plan {
        model: desc.name().to_string(),
        model_source: path.display().to_string(),
        settings,
        fits: budget.as_ref().map(|b| estimate.peak <= b.bytes),
        estimate,
        budget,
        changes: Vec::new(),
        notes,
        suggestion: Vec::new(),
    })
}

/// Runs the SD job: plan (printed; a run predicted not to fit its budget is refused unless
/// forced) → load → inject → data → fixed-noise eval → train → eval → samples → export →
/// `summary.json`.
///
/// Config keys used beyond the LLM job's: `data.resolution`, the bucket keys,
/// `data.caption_extension`, `data.keep_tokens`, `data.shuffle_caption`,
/// `data.cache_latents` (also on disk), the diffusion `train.*` keys and the sampling
/// `logging.*` keys — see the module docs. `train.max_steps` wins over `train.epochs` (kohya's
/// `max_train_steps`). The `peft` export format writes diffusers' layout.
///
/// # Errors
/// [`JobError::DoesNotFit`], config, file and runtime errors.
pub fn run(mut cfg: TrainConfig, opts: &RunOptions) -> Result<SdRunSummary> {
    let t_start = std::time::Instant::now();
    let say = |s: &str| {
        if opts.verbose {
            eprintln!("[{:6.1} s] {s}", t_start.elapsed().as_secs_f64());
        }
    };
    // count tensor bytes from the start so the weights are in the allocator peak
    let _ = lora_core::sys::install_counting_cpu_allocator();
    if let Some(n) = cfg.system.num_threads {
        tch::set_num_threads(n as i32);
    }
    let device = match cfg.system.device.as_str() {
        "cpu" => Device::Cpu,
        "auto" => Device::cuda_if_available(),
        d => Device::Cuda(
            d.strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
        ),
    };
    let cuda = device != Device::Cpu;
    let base_written = cfg.base_model()?.to_string();
    let base_path = resolve_path(
        "model.base_model",
        &base_written,
        opts.config_dir.as_deref(),
    )?;

    crate::llm::check_output_dir(&cfg, opts)?;
    // plan
    let plan = match sd_plan(&mut cfg, &base_path, cuda) {
        Ok(p) => {
            if opts.verbose {
                print!("{}", p.report());
            }
            if p.fits == Some(false) && !(opts.force || cfg.memory.force) {
                let b = p
                    .budget
                    .clone()
                    .map(|b| (b.bytes, crate::llm::budget_source(&b)));
                if let Some((bytes, src)) = b {
                    return Err(JobError::DoesNotFit {
                        peak: p.estimate.peak,
                        budget: bytes,
                        source_desc: src,
                    });
                }
            }
            Some(p)
        }
        Err(e) => {
            say(&format!("memory plan unavailable: {e}"));
            None
        }
    };

    // load, inject
    let kind = match cfg.model.dtype {
        Dtype::F32 => Kind::Float,
        Dtype::Bf16 => Kind::BFloat16,
        Dtype::F16 => Kind::Half,
    };
    say(&format!(
        "loading {} ({kind:?}) on {device:?}",
        base_path.display()
    ));
    if cfg.model.kind == ModelKind::Sdxl {
        return Err(JobError::Runtime(format!(
            "{}: model.kind sdxl: the SD job trains SD 1.x/2.x pipelines; SDXL training (two text encoders, size/crop conditioning) is not implemented yet",
            base_path.display()
        )));
    }
    let mut pipe = SdPipeline::from_diffusers(&base_path, kind, device)?;
    if let Some(p) = &cfg.train.prediction_type {
        pipe.schedule.prediction_type =
            PredictionType::from_diffusers(p).map_err(rt("train.prediction_type"))?;
    }
    if let Some(n) = cfg.train.clip_skip {
        pipe.clip_skip = n as usize;
    }
    pipe.unet
        .set_gradient_checkpointing(cfg.train.gradient_checkpointing);
    tch::manual_seed(cfg.system.seed as i64);
    let mut lcfg_json = cfg.lora.to_peft_json();
    if cfg.lora.target_modules == TargetModules::default()
        && let serde_json::Value::Object(m) = &mut lcfg_json
    {
        m.insert(
            "target_modules".into(),
            serde_json::json!(DEFAULT_UNET_TARGETS),
        );
    }
    if let serde_json::Value::Object(m) = &mut lcfg_json {
        m.insert("peft_type".into(), "LORA".into());
        m.insert(
            "base_model_name_or_path".into(),
            base_written.clone().into(),
        );
    }
    let te_json = {
        let mut v = lcfg_json.clone();
        if let serde_json::Value::Object(m) = &mut v {
            m.insert(
                "target_modules".into(),
                serde_json::json!(TEXT_ENCODER_TARGETS),
            );
            m.insert("exclude_modules".into(), serde_json::Value::Null);
            m.insert("rank_pattern".into(), serde_json::json!({}));
            m.insert("alpha_pattern".into(), serde_json::json!({}));
        }
        v
    };
    let lcfg: lora_core::config::LoraConfig =
        serde_json::from_value(lcfg_json).map_err(rt("building the LoRA config"))?;
    let vs = tch::nn::VarStore::new(device);
    let report = lora_core::inject::inject(&mut pipe.unet, &lcfg, "default", &vs.root())
        .map_err(rt("injecting LoRA into the UNet"))?;
    say(&format!(
        "LoRA r{} α{} on {} UNet modules: {} trainable of {} parameters ({:.3}%)",
        cfg.lora.rank,
        cfg.lora.alpha,
        report.modules.len(),
        report.trainable_params,
        report.all_params,
        report.trainable_percent()
    ));
    let train_te = cfg.train.train_text_encoder;
    if train_te {
        let te_cfg: lora_core::config::LoraConfig =
            serde_json::from_value(te_json).map_err(rt("building the text-encoder LoRA config"))?;
        let r = lora_core::inject::inject(
            &mut pipe.text_encoder,
            &te_cfg,
            "default",
            &(vs.root() / "text_encoder"),
        )
        .map_err(rt("injecting LoRA into the text encoder"))?;
        say(&format!(
            "LoRA on {} text-encoder modules: {} trainable parameters",
            r.modules.len(),
            r.trainable_params
        ));
    }
    let pipe = Rc::new(pipe);

    // data
    let data_written = cfg.data.train_data_dir.clone().ok_or_else(|| {
        crate::config::ConfigError::Missing {
            key: "data.train_data_dir".into(),
            hint: "set it to a kohya image folder (`<repeats>_<concept>` subfolders) or a dataset TOML".into(),
        }
    })?;
    let data_path = resolve_path(
        "data.train_data_dir",
        &data_written,
        opts.config_dir.as_deref(),
    )?;
    let dcfg = dataset_config(&cfg, &data_path)?;
    let ds = ImageDataset::new(dcfg, lora_data::validate::Policy::Skip)
        .map_err(rt(&format!("scanning {}", data_path.display())))?;
    let images = ds.num_images();
    let items = ds.len();
    say(&format!(
        "data: {images} images, {items} items per epoch\n{}",
        ds.bucket_report()
    ));
    let micro = cfg.train.batch_size.max(1) as usize;
    let loader = ds
        .into_loader(LoaderConfig {
            batch_size: micro,
            shuffle: cfg.data_loader.shuffle,
            drop_last: false,
            seed: cfg.system.seed,
            num_workers: 0,
            prefetch_factor: 1,
            persistent_workers: false,
        })
        .map_err(rt("building the image loader"))?;
    let accum = cfg.train.gradient_accumulation_steps.max(1) as usize;
    let per_epoch = loader.batches_per_epoch().div_ceil(accum) as u64;
    let total_steps = cfg
        .train
        .max_steps
        .unwrap_or(per_epoch * u64::from(cfg.train.epochs))
        .max(1);
    if cfg.train.max_steps.is_some() {
        // kohya: max_train_steps wins over the epoch count
        let need = total_steps.div_ceil(per_epoch.max(1));
        cfg.train.epochs = u32::try_from(need)
            .unwrap_or(u32::MAX)
            .max(cfg.train.epochs);
    }
    let out_dir = PathBuf::from(&cfg.train.output_dir);
    std::fs::create_dir_all(&out_dir).map_err(rt(&format!("creating {}", out_dir.display())))?;
    let disk = if cfg.data.cache_latents == Some(true) {
        Some(
            LatentCache::new(out_dir.join("latent_cache"))
                .map_err(rt("opening the latent cache"))?,
        )
    } else {
        None
    };
    let model_id = format!(
        "vae:{}",
        std::fs::canonicalize(&base_path)
            .unwrap_or_else(|_| base_path.clone())
            .display()
    );
    let mut source = ImageSource::new(
        pipe.clone(),
        loader,
        cfg.system.seed,
        model_id,
        disk,
        !train_te,
    );
    let encoded = source.encoded.clone();

    // the objective
    let loss_cfg = LossConfig {
        noise_offset: cfg.train.noise_offset,
        min_snr_gamma: cfg.train.min_snr_gamma,
        ..LossConfig::default()
    };
    let schedule = NoiseSchedule::new(pipe.schedule.clone()).map_err(rt("the noise schedule"))?;
    let objective = DiffusionLoss::new(schedule, loss_cfg).map_err(rt("the diffusion loss"))?;

    // before
    let eval_batch = source
        .fixed_batch(8)
        .map_err(|e| JobError::Runtime(format!("the evaluation batch: {e}")))?;
    let eval_seed = cfg.system.seed ^ 0x5eed;
    let eval_loss_before =
        fixed_eval_loss(&pipe, &objective, &eval_batch, &EVAL_TIMESTEPS, eval_seed)
            .map_err(rt("evaluating before training"))?;
    say(&format!("fixed-noise loss before: {eval_loss_before:.5}"));

    // train
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut task = SdTask {
        pipe: pipe.clone(),
        objective,
        named,
        loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
    };
    let tcfg = crate::llm::trainer_config(&cfg, device, &out_dir, total_steps)?;
    let mut trainer: crate::trainer::Trainer<SdTask> = crate::trainer::Trainer::new(tcfg);
    if cfg.logging.progress && opts.verbose {
        trainer.add_callback(Box::new(
            crate::callbacks::ProgressBar::new().every(cfg.logging.log_every_n_steps),
        ));
    }
    let log_dir = cfg
        .logging
        .logging_dir
        .clone()
        .map(PathBuf::from)
        .unwrap_or_else(|| out_dir.join("logs"));
    trainer.add_callback(Box::new(
        crate::metrics::MetricsLogger::new(&log_dir, cfg.logging.tensorboard)
            .map_err(|e| JobError::Runtime(e.to_string()))?
            .with_every(cfg.logging.log_every_n_steps),
    ));
    // sample prompts: logging.sample_prompts, else the lines of logging.sample_prompt
    let mut prompts: Vec<String> = cfg.logging.sample_prompts.clone();
    if prompts.is_empty() {
        prompts = cfg
            .logging
            .sample_prompt
            .as_deref()
            .unwrap_or("")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
    }
    let res = cfg.data.resolution.unwrap_or([512, 512]);
    let sample_opts = SampleOptions {
        size: (res[0], res[1]),
        steps: cfg.logging.sample_steps.max(1) as usize,
        guidance_scale: cfg.logging.sample_guidance_scale,
        seed: cfg.system.seed,
        sampler: if cfg.logging.sample_sampler == "euler" {
            SamplerKind::Euler
        } else {
            SamplerKind::Ddim
        },
    };
    let sampler = SampleCallback::new(
        pipe.clone(),
        prompts.clone(),
        cfg.logging.sample_every_n_steps,
        out_dir.join("samples"),
        sample_opts.clone(),
    );
    let written = sampler.written.clone();
    let final_sampler = SampleCallback::new(
        pipe.clone(),
        prompts.clone(),
        0,
        out_dir.join("samples"),
        sample_opts,
    );
    trainer.add_callback(Box::new(sampler));
    let resume = match &opts.resume {
        None => crate::trainer::Resume::No,
        Some(None) => crate::trainer::Resume::Latest,
        Some(Some(dir)) => crate::trainer::Resume::From(dir.clone()),
    };
    let (rss_before_steps, hwm_process) = crate::llm::proc_rss();
    let _ = crate::llm::reset_peak_rss();
    let _ = lora_core::sys::cpu_reset_peak();
    let t_train = std::time::Instant::now();
    let rep = trainer
        .fit(&mut task, &mut source, resume)
        .map_err(|e| JobError::Runtime(format!("training: {e}")))?;
    let train_seconds = t_train.elapsed().as_secs_f64();
    let (_, hwm_steps) = crate::llm::proc_rss();
    let memory = crate::llm::MeasuredMemory {
        rss_before_steps,
        rss_peak_steps: hwm_steps,
        rss_step_delta: hwm_steps.saturating_sub(rss_before_steps),
        tensor_peak: lora_core::sys::cpu_mem_stats()
            .map(|s| s.peak_bytes)
            .unwrap_or(0),
        rss_peak_process: hwm_process.max(hwm_steps),
    };
    drop(trainer);
    if let Some(from) = rep.resumed_from {
        say(&format!("resumed at step {from}"));
    }

    // after
    let eval_loss_after = fixed_eval_loss(
        &pipe,
        &task.objective,
        &eval_batch,
        &EVAL_TIMESTEPS,
        eval_seed,
    )
    .map_err(rt("evaluating after training"))?;
    say(&format!(
        "fixed-noise loss: {eval_loss_before:.5} → {eval_loss_after:.5}"
    ));
    if !prompts.is_empty()
        && !written
            .borrow()
            .iter()
            .any(|p| p.ends_with(format!("step-{}.png", rep.steps)))
    {
        let p = final_sampler.write(rep.steps).map_err(JobError::Runtime)?;
        written.borrow_mut().push(p);
    }
    let samples = written.borrow().clone();
    drop(final_sampler);
    drop(task);
    drop(source);

    // export
    let mut pipe = Rc::try_unwrap(pipe)
        .map_err(|_| JobError::Runtime("the pipeline is still shared after training".into()))?;
    let meta = crate::export::metadata_for(
        &cfg,
        &crate::export::RunMetadata {
            base_model: base_written.clone(),
            base_model_sha256: None,
            dataset: serde_json::json!({"path": data_path.display().to_string(), "images": images, "items": items}),
            steps: rep.steps,
            epochs: 1 + rep.steps.saturating_sub(1) / per_epoch.max(1),
        },
    );
    let v2 = pipe.unet.plan().cross_attention_dim.first() == Some(&1024);
    let meta = sd_metadata(meta, v2, !train_te);
    let mut outputs = Vec::new();
    for f in &cfg.train.export_formats {
        match f {
            ExportFormat::Kohya => {
                let p = out_dir.join(format!("{}.safetensors", cfg.train.output_name));
                write_kohya(&mut pipe, "default", meta.clone(), &p)
                    .map_err(rt("writing the kohya adapter"))?;
                outputs.push(p);
            }
            ExportFormat::Peft => {
                let p =
                    write_diffusers(&mut pipe, "default", &out_dir.join(&cfg.train.output_name))
                        .map_err(rt("writing the diffusers adapter"))?;
                outputs.push(p);
            }
        }
    }
    let summary_path = out_dir.join("summary.json");
    outputs.push(summary_path.clone());
    let summary = SdRunSummary {
        plan,
        steps: rep.steps,
        items,
        images,
        losses: rep.losses.clone(),
        eval_loss_before,
        eval_loss_after,
        vae_encodings: *encoded.borrow(),
        train_seconds,
        memory,
        samples,
        outputs,
    };
    let text = serde_json::to_string_pretty(&summary).map_err(rt("serializing the summary"))?;
    std::fs::write(&summary_path, text)
        .map_err(rt(&format!("writing {}", summary_path.display())))?;
    if opts.verbose {
        println!(
            "summary: {} optimizer steps in {:.1} s; fixed-noise loss {:.5} → {:.5} ({:+.1}%)",
            summary.steps,
            train_seconds,
            eval_loss_before,
            eval_loss_after,
            100.0 * (eval_loss_after / eval_loss_before - 1.0)
        );
        if let Some(p) = &summary.plan
            && !cuda
        {
            println!(
                "memory (CPU): tensor peak (counting allocator) {} vs predicted allocated peak {}; process peak RSS {} vs predicted {}",
                lora_memory::Bytes(memory.tensor_peak),
                p.estimate.peak_allocated,
                lora_memory::Bytes(memory.rss_peak_process),
                p.estimate.peak_process
            );
        }
        for o in summary.outputs.iter().chain(&summary.samples) {
            println!("wrote {}", o.display());
        }
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kohya_folders_give_subsets_with_repeats_and_a_plain_folder_is_one_subset() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("3_cat")).unwrap();
        std::fs::create_dir_all(d.path().join("notes")).unwrap();
        let mut cfg = TrainConfig::default();
        cfg.data.resolution = Some([64, 96]);
        cfg.data.caption_extension = Some("caption".into());
        cfg.data.keep_tokens = Some(2);
        cfg.data.shuffle_caption = Some(true);
        cfg.train.batch_size = 3;
        let dc = dataset_config(&cfg, d.path()).unwrap();
        let set = &dc.datasets[0];
        assert_eq!(set.bucket.resolution, (64, 96));
        assert_eq!(set.batch_size, 3);
        assert_eq!(set.subsets.len(), 1);
        let s = &set.subsets[0];
        assert_eq!(s.image_dir, d.path().join("3_cat"));
        assert_eq!(s.num_repeats, 3);
        assert_eq!(s.class_tokens.as_deref(), Some("cat"));
        assert_eq!(s.caption_extension, ".caption");
        assert_eq!((s.keep_tokens, s.shuffle_caption), (2, true));
        // no `<repeats>_<name>` folder: the folder itself, one repeat
        let plain = tempfile::tempdir().unwrap();
        let dc = dataset_config(&cfg, plain.path()).unwrap();
        let s = &dc.datasets[0].subsets[0];
        assert_eq!(s.image_dir, plain.path());
        assert_eq!(s.num_repeats, 1);
    }

    #[test]
    fn kohya_metadata_names_the_base_version_as_sd_scripts_does() {
        let m = sd_metadata(Default::default(), false, true);
        assert_eq!(m["ss_base_model_version"], "sd_v1");
        assert_eq!(m["ss_v2"], "False");
        assert_eq!(m["ss_network_train_unet_only"], "True");
        let m = sd_metadata(Default::default(), true, false);
        assert_eq!(m["ss_base_model_version"], "sd_v2");
        assert_eq!(m["ss_v2"], "True");
        assert_eq!(m["ss_network_train_unet_only"], "False");
    }

    #[test]
    fn sd_folders_are_recognised_by_model_index_or_unet_config() {
        let d = tempfile::tempdir().unwrap();
        assert!(!is_sd_model(d.path()));
        std::fs::create_dir_all(d.path().join("unet")).unwrap();
        std::fs::write(d.path().join("unet/config.json"), "{}").unwrap();
        assert!(is_sd_model(d.path()));
        assert!(!is_sd_model(&d.path().join("unet/config.json")));
    }
}
