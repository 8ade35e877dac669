//! The Stable Diffusion LoRA job: plan → load → inject → data → train → sample → export.
//!
//! - **Model**: a diffusers pipeline folder (`StableDiffusionPipeline` /
//!   `StableDiffusionXLPipeline.save_pretrained` layout: `unet/`, `vae/`, `text_encoder/`,
//!   `tokenizer/`, SDXL's `text_encoder_2/` + `tokenizer_2/`, `scheduler/`), SD 1.x / 2.x or
//!   SDXL; or an original single-file checkpoint (`v1-5-pruned.safetensors`,
//!   `sd_xl_base_1.0.safetensors`; see [`SdPipeline::from_single_file`]).
//! - **SDXL**: two text encoders (CLIP ViT-L `text_encoder`, OpenCLIP bigG `text_encoder_2` with
//!   projection); the UNet is conditioned on the penultimate hidden states of both, without the
//!   final LayerNorm, concatenated on the feature axis (`[n, 77, 2048]`), and — through its
//!   `text_time` added embedding — on `text_encoder_2`'s projected pooled output and the six
//!   time ids (original size, crop top-left, target size; height first) of each sample
//!   ([`sdxl_time_ids`]), as diffusers' `StableDiffusionXLPipeline` and kohya sd-scripts'
//!   `sdxl_train_network.py` do.
//! - **Adapter**: LoRA on the UNet's attention projections (`to_q`, `to_k`, `to_v`, `to_out.0`
//!   by default — the modules of diffusers' `train_text_to_image_lora.py`); any UNet site can
//!   be targeted through `lora.target_modules` (e.g. `ff.net.0.proj`, `ff.net.2`, `proj_in`,
//!   or the 3×3 `conv1`/`conv2` of the ResNets for LoCon-style adapters). With
//!   `train.train_text_encoder` the text encoder(s) get LoRA on `q/k/v/out_proj` too; otherwise
//!   they are frozen and their outputs are cached per caption.
//! - **Data**: a kohya-style image folder (`<repeats>_<concept>` subfolders) or a kohya dataset
//!   TOML (`data.train_data_dir` ending in `.toml`), captions from sidecar files
//!   (`caption_extension`, `shuffle_caption`, `keep_tokens`), aspect buckets; latents are
//!   encoded once per (image, bucket, crop, flip, VAE, dtype) and kept in memory, and also on
//!   disk under `<output_dir>/latent_cache` with `data.cache_latents: true` (lora-data's
//!   [`LatentCache`](lora_data::cache::LatentCache)).
//! - **Caching before training** (`data.cache_latents: true`, as kohya's `cache_latents` /
//!   `cache_text_encoder_outputs`): every latent (both orientations with `flip_aug`) and, with
//!   frozen text encoders, every caption's conditioning are computed before the first step
//!   ([`precache`], progress as count / total, a stop request honoured between images); the
//!   VAE and the frozen text encoders then move to the CPU and come back to the device only to
//!   draw sample grids ([`SdPipeline::move_frozen`]). Random crops keep the VAE, captions that
//!   change between epochs (`shuffle_caption`, caption or tag dropout) keep the text encoders.
//! - **Objective**: lora-models' [`DiffusionLoss`] (ε or v target from the scheduler config or
//!   `train.prediction_type`, `train.min_snr_gamma`, `train.noise_offset`), the UNet's
//!   checkpointed backward with `train.gradient_checkpointing`; conditioning at
//!   `train.clip_skip`.
//! - **Engine**: the [`crate::engine::Trainer`] as for LLMs: gradient accumulation, mixed
//!   precision, OOM back-off (batches split), NaN policy, checkpoints and exact resume (the
//!   loader position is part of the checkpoint).
//! - **Evaluation**: the loss on fixed noise and fixed timesteps ([`EVAL_TIMESTEPS`]) over the
//!   8 items spread over the epoch, one batch per aspect bucket, before and after training
//!   ([`fixed_eval_loss`]).
//! - **Sampling**: DDIM or Euler (`logging.sample_sampler`, `sample_steps`,
//!   `sample_guidance_scale`) on `logging.sample_prompts` (or the lines of
//!   `logging.sample_prompt`) every `logging.sample_every_n_steps` steps and at the end, a PNG
//!   grid `<output_dir>/samples/step-N.png` (one column per prompt).
//! - **Export**: kohya `<output_dir>/<output_name>.safetensors` (`lora_unet_…` modules,
//!   `lora_te_…` — SDXL: `lora_te1_…` / `lora_te2_…` — f32 `.alpha`, `ss_*` metadata incl.
//!   `ss_base_model_version` and `ss_v2`) and, for the `peft` export format, diffusers'
//!   `<output_dir>/<output_name>/pytorch_lora_weights.safetensors`
//!   (`unet.<module>.lora_A/B.weight`, `text_encoder.…`, `text_encoder_2.…`, scaling folded
//!   into B) — the file `StableDiffusion[XL]Pipeline.load_lora_weights` reads.

use crate::config::{ExportFormat, TargetModules, TrainConfig};
use crate::engine::TrainStep;
use crate::job::error::During;
use crate::job::sequence::{LoadedRun, RunContext, RunOutcome, RunSteps};
use crate::job::{JobError, Plan, Result, RunOptions, resolve_path};
use lora_core::formats::AdapterWeights;
use lora_data::image::{ImageBatch, ImageDataset};
use lora_data::loader::Dataset;
use lora_models::diffusion::{DiffusionLoss, LossConfig, NoiseSchedule, PredictionType};
use lora_models::sd::UNet2DConditionModel;
mod adapter;
mod data;
pub mod plan;
mod sample;
mod task;

pub use adapter::*;
pub use data::*;
pub use lora_models::sd::pipeline::{
    SampleOptions, SamplerKind, SdPipeline, TextCond, sdxl_time_ids,
};
pub use sample::*;
pub use task::*;

use serde::Serialize;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

pub use lora_core::formats::kohya::{
    KOHYA_TE_PREFIX, KOHYA_TE1_PREFIX, KOHYA_TE2_PREFIX, KOHYA_UNET_PREFIX, kohya_prefix,
};
/// A pipeline error as the job reports it: a model the SD job cannot train is
/// [`JobError::Unsupported`], a failed step [`JobError::Model`] naming it.
pub fn pipeline_err(e: lora_models::Error) -> JobError {
    match e {
        lora_models::Error::Unusable { what, reason } => JobError::Unsupported { what, reason },
        lora_models::Error::Context { during, source } => JobError::Model {
            during,
            source: *source,
        },
        other => JobError::Model {
            during: "the Stable Diffusion pipeline".into(),
            source: other,
        },
    }
}

pub(crate) use crate::job::error::model_step_err as model_err;

/// The text-encoder modules adapted with `train.train_text_encoder`: CLIP's attention
/// projections, as diffusers' `train_text_to_image_lora.py` / `train_dreambooth_lora.py`
/// (`target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]`).
pub const TEXT_ENCODER_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "out_proj"];

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
    pub memory: crate::job::MeasuredMemory,
    /// Sample grids written.
    pub samples: Vec<PathBuf>,
    /// Training batches drawn in this process per aspect bucket `(width, height)` (a resumed
    /// run counts only the batches after the resume point).
    pub bucket_batches: Vec<((u32, u32), u64)>,
    /// Adapter and summary files written.
    pub outputs: Vec<PathBuf>,
}

/// Timesteps of the fixed evaluation (spread over the schedule).
pub const EVAL_TIMESTEPS: [i64; 5] = [50, 250, 450, 650, 850];

pub use crate::recipes::images::dataset_config;

fn sd_plan(cfg: &TrainConfig, path: &Path, cuda: bool) -> Result<Plan> {
    // what the job loads: a diffusers folder or a single-file checkpoint (its header);
    // `lora-train plan` reads presets too (crate::sd_plan::plan)
    let desc = crate::sd_plan::descriptor_of_path(path, &path.display().to_string())?;
    crate::sd_plan::plan_with(cfg, &desc, path.display().to_string(), None, cuda)
}

/// Runs the SD job: plan (printed; a run predicted not to fit its budget is refused unless
/// forced) → load → inject → data → fixed-noise eval → train → eval → samples → export →
/// `summary.json`.
///
/// Config keys used beyond the LLM job's: `model.kind` (`sd15` / `sdxl` must match the
/// pipeline found), `model.tokenizer` (for a single-file base, see
/// [`SdPipeline::from_single_file`]), `data.resolution`, the bucket keys,
/// `data.caption_extension`, `data.keep_tokens`, `data.shuffle_caption`,
/// `data.cache_latents` (also on disk), the diffusion `train.*` keys and the sampling
/// `logging.*` keys — see the module docs. `train.max_steps` wins over `train.epochs` (kohya's
/// `max_train_steps`). The `peft` export format writes diffusers' layout.
///
/// # Errors
/// [`JobError::DoesNotFit`], config, file and runtime errors.
pub fn run(cfg: TrainConfig, opts: &RunOptions) -> Result<SdRunSummary> {
    run_with(cfg, opts, Vec::new())
}

/// [`run`] with the app's own engine callbacks, called after the job's progress bar, metrics
/// logger and sample-image callback. A callback returning
/// [`Control::Stop`](crate::engine::Control::Stop) ends training early; the adapter is still
/// exported.
///
/// # Errors
/// As [`run`]; an error a callback returns stops the run with that error.
pub fn run_with(
    cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn crate::engine::Callback>>,
) -> Result<SdRunSummary> {
    crate::job::sequence::run(SdSteps::default(), cfg, opts, callbacks)
}

/// The SD run before its pipeline loads: the scanned dataset.
#[derive(Default)]
struct SdSteps {
    data: Option<(PathBuf, ImageDataset)>,
}

impl RunSteps for SdSteps {
    type Loaded = SdRun;
    type Summary = SdRunSummary;

    fn check(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()> {
        // the checks `lora-train plan` makes (resolution, target_modules, model.kind, a single
        // file's tokenizer), before anything loads or is written
        let base_path = ctx.base_path()?;
        let desc = crate::sd_plan::descriptor_of_path(&base_path, &ctx.base_written).ok();
        crate::sd_plan::check_sd_config(cfg, Some(&base_path), desc.as_ref(), ctx.config_dir())
    }

    fn plan(&self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Option<Plan>> {
        match sd_plan(cfg, &ctx.base_path()?, ctx.cuda) {
            Ok(p) => Ok(Some(p)),
            Err(e) => {
                ctx.say(&format!("memory plan unavailable: {e}"));
                Ok(None)
            }
        }
    }

    fn read_data(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()> {
        self.data = Some(crate::recipes::images::read_dataset(cfg, ctx)?);
        Ok(())
    }

    /// Every image's latents, and its caption's text-encoder outputs while the text encoders
    /// are frozen (the source caches them per caption, see `source`).
    fn kept_data(&self, cfg: &TrainConfig) -> Option<lora_memory::KeptData> {
        let (_, ds) = self.data.as_ref()?;
        Some(crate::recipes::images::kept_data(
            ds,
            !cfg.train.train_text_encoder,
        ))
    }

    fn load(
        self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        vs: &tch::nn::VarStore,
    ) -> Result<SdRun> {
        let (data_path, ds) = self
            .data
            .ok_or(JobError::Internal("the image dataset was not read"))?;
        let kind = cfg.model.dtype.kind();
        let base_path = &ctx.base_path()?;
        ctx.say(&format!(
            "loading {} ({}) on {}",
            base_path.display(),
            cfg.model.dtype.name(),
            lora_core::sys::device_name(ctx.device)
        ));
        let mut pipe = if base_path.is_file() {
            let companion = match &cfg.model.tokenizer {
                Some(t) => Some(resolve_path("model.tokenizer", t, ctx.config_dir())?),
                None => None,
            };
            SdPipeline::from_single_file(base_path, companion.as_deref(), kind, ctx.device)
                .map_err(pipeline_err)?
        } else {
            SdPipeline::from_diffusers(base_path, kind, ctx.device).map_err(pipeline_err)?
        };
        crate::sd_plan::check_model_kind(
            cfg.model.kind,
            pipe.is_sdxl(),
            &base_path.display().to_string(),
            false,
        )?;
        if let Some(p) = &cfg.train.prediction_type {
            pipe.schedule.prediction_type =
                PredictionType::from_diffusers(p).during("train.prediction_type")?;
        }
        if let Some(n) = cfg.train.clip_skip {
            pipe.clip_skip = n as usize;
        }
        pipe.unet
            .set_gradient_checkpointing(cfg.train.gradient_checkpointing);
        tch::manual_seed(cfg.system.seed as i64);
        // an unset target list means the UNet's attention projections here; LoCon adds the
        // 3×3 convolutions at the conv rank
        let lcfg = crate::sd_plan::unet_lora_config(&cfg, &ctx.base_written);
        // the text encoders: CLIP's attention projections, with no per-module patterns (they
        // name UNet modules)
        let te_cfg = lora_core::config::LoraConfig {
            target_modules: Some(TargetModules::list(&TEXT_ENCODER_TARGETS)),
            exclude_modules: None,
            rank_pattern: Default::default(),
            alpha_pattern: Default::default(),
            ..lcfg.clone()
        };
        let report = lora_core::inject::inject(&mut pipe.unet, &lcfg, "default", &vs.root())
            .during("injecting LoRA into the UNet")?;
        ctx.say(&format!(
            "LoRA r{} α{} on {} UNet modules: {} trainable of {} parameters ({:.3}%)",
            cfg.lora.rank,
            cfg.lora.alpha,
            report.modules.len(),
            report.trainable_params,
            report.all_params,
            report.trainable_percent()
        ));
        if cfg.train.train_text_encoder {
            let r = lora_core::inject::inject(
                &mut pipe.text_encoder,
                &te_cfg,
                "default",
                &(vs.root() / "text_encoder"),
            )
            .during("injecting LoRA into the text encoder")?;
            ctx.say(&format!(
                "LoRA on {} text-encoder modules: {} trainable parameters",
                r.modules.len(),
                r.trainable_params
            ));
            if let Some(te2) = pipe.text_encoder_2.as_mut() {
                let r = lora_core::inject::inject(
                    te2,
                    &te_cfg,
                    "default",
                    &(vs.root() / "text_encoder_2"),
                )
                .during("injecting LoRA into text_encoder_2")?;
                ctx.say(&format!(
                    "LoRA on {} text_encoder_2 modules: {} trainable parameters",
                    r.modules.len(),
                    r.trainable_params
                ));
            }
        }
        // the adapters' layouts as injected (no copy of their tensors): what each save fills in
        let snapshot_parts =
            if cfg.train.save_every_n_steps.is_some() || cfg.train.save_every_n_epochs.is_some() {
                let meta = sd_metadata(
                    Default::default(),
                    SdVersion::of(&pipe),
                    !cfg.train.train_text_encoder,
                );
                let mut parts = pipeline_weights_as_trained(&mut pipe, "default")
                    .during("reading the injected adapters")?;
                if let Some((_, unet)) = parts.first_mut() {
                    unet.metadata = meta;
                }
                let parts = parts
                    .into_iter()
                    .map(
                        |(component, template)| crate::job::snapshots::SnapshotPart {
                            component,
                            var_prefix: if component == "unet" {
                                String::new()
                            } else {
                                format!("{component}.")
                            },
                            template: crate::job::snapshots::AdapterLayout::of(&template),
                        },
                    )
                    .collect();
                Some((pipe.is_sdxl(), parts))
            } else {
                None
            };
        Ok(SdRun {
            snapshot_parts,
            pipe: Rc::new(pipe),
            kind,
            data_path,
            dataset: Some(ds),
            images: 0,
            items: 0,
            encoded: Rc::new(RefCell::new(0)),
            objective: None,
            eval_batches: Vec::new(),
            eval_loss_before: f64::NAN,
            eval_loss_after: f64::NAN,
            prompts: Vec::new(),
            written: Rc::new(RefCell::new(Vec::new())),
            bucket_batches: Vec::new(),
        })
    }
}

/// The SD run once the pipeline is loaded and LoRA injected.
struct SdRun {
    /// The injected adapters (and whether the pipeline is SDXL), for the snapshots at each save
    /// (when the run saves).
    snapshot_parts: Option<(bool, Vec<crate::job::snapshots::SnapshotPart>)>,
    pipe: Rc<SdPipeline>,
    kind: Kind,
    data_path: PathBuf,
    dataset: Option<ImageDataset>,
    images: usize,
    items: usize,
    encoded: Rc<RefCell<u64>>,
    objective: Option<DiffusionLoss>,
    eval_batches: Vec<SdBatch>,
    eval_loss_before: f64,
    eval_loss_after: f64,
    prompts: Vec<String>,
    written: Rc<RefCell<Vec<PathBuf>>>,
    bucket_batches: Vec<((u32, u32), u64)>,
}

pub use crate::recipes::images::kohya_prompts;

/// The seed of the fixed evaluation's noise.
fn eval_seed(cfg: &TrainConfig) -> u64 {
    cfg.system.seed ^ 0x5eed
}

/// The diffusion objective of a pipeline's schedule with the config's loss settings.
fn objective_of(pipe: &SdPipeline, cfg: &TrainConfig) -> Result<DiffusionLoss> {
    let loss_cfg = LossConfig {
        noise_offset: cfg.train.noise_offset,
        min_snr_gamma: cfg.train.min_snr_gamma,
        min_timestep: cfg.train.min_timestep.map_or(0, i64::from),
        max_timestep: cfg.train.max_timestep.map(i64::from),
        multires_noise: cfg.train.multires_noise_iterations.map(|iterations| {
            lora_models::diffusion::MultiresNoise {
                iterations,
                discount: cfg.train.multires_noise_discount,
            }
        }),
    };
    let schedule = NoiseSchedule::new(pipe.schedule.clone()).during("the noise schedule")?;
    DiffusionLoss::new(schedule, loss_cfg).during("the diffusion loss")
}

/// The sampling options of a config (`logging.sample_*`, the training resolution).
fn sample_options(cfg: &TrainConfig) -> SampleOptions {
    let res = cfg.data.resolution.unwrap_or([512, 512]);
    SampleOptions {
        size: (res[0], res[1]),
        steps: cfg.logging.sample_steps.max(1) as usize,
        guidance_scale: cfg.logging.sample_guidance_scale,
        seed: cfg.system.seed,
        sampler: if cfg.logging.sample_sampler == "euler" {
            SamplerKind::Euler
        } else {
            SamplerKind::Ddim
        },
    }
}

impl LoadedRun for SdRun {
    type Batch = SdBatch;
    type Task<'a> = SdTask;
    type Source = ImageSource;
    type Summary = SdRunSummary;

    fn source(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<ImageSource> {
        let ds = self
            .dataset
            .take()
            .ok_or(JobError::Internal("the image dataset was taken twice"))?;
        self.images = ds.num_images();
        self.items = ds.len();
        let loader = crate::recipes::images::image_loader(ds, cfg, ctx)?;
        let base_path = ctx.base_path()?;
        let disk = crate::recipes::images::disk_cache(cfg, &ctx.out_dir)?;
        // the VAE (its file or folder) and the dtype it encodes in name the cached latents
        let model_id = crate::recipes::images::vae_model_id(&base_path, self.kind);
        // Cache before training what can be (kohya's cache_latents / cache_text_encoder_outputs),
        // then move the VAE and the frozen text encoders off the device: they come back only to
        // draw sample images.
        let train_te = cfg.train.train_text_encoder;
        let aug = Augmentations::of(loader.dataset().config());
        let (pre_latents, pre_text) = precomputed(cfg, aug);
        if cfg.data.cache_latents == Some(true) {
            if aug.random_crop {
                ctx.say(
                    "random_crop: latents are encoded as the crops are drawn; the VAE stays on the device",
                );
            }
            if !train_te && aug.varying_captions {
                ctx.say(
                    "captions change between epochs (shuffle_caption, caption or tag dropout, random caption lines): text-encoder outputs are computed per batch, not cached; the text encoders stay on the device",
                );
            }
        }
        let Some(source) = crate::recipes::images::cached_source(
            &mut self.pipe,
            loader,
            model_id,
            disk,
            (pre_latents, pre_text),
            !train_te,
            ctx,
            |pipe, (latents, text)| {
                pipe.move_frozen(Device::Cpu, latents, text)
                    .map_err(pipeline_err)
            },
        )?
        else {
            return Err(ctx.interrupted_before_training());
        };
        self.encoded = source.encoded.clone();
        Ok(source)
    }

    fn before(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        source: &mut ImageSource,
    ) -> Result<()> {
        let objective = objective_of(&self.pipe, cfg)?;
        self.eval_batches = source
            .fixed_batches(crate::recipes::images::EVAL_SAMPLES)
            .during("the evaluation batches")?;
        self.eval_loss_before = fixed_eval_loss(
            &self.pipe,
            &objective,
            &self.eval_batches,
            &EVAL_TIMESTEPS,
            eval_seed(cfg),
        )
        .during("evaluating before training")?;
        self.objective = Some(objective);
        ctx.say(&format!(
            "fixed-noise loss before: {:.5}",
            self.eval_loss_before
        ));
        Ok(())
    }

    fn callbacks(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
    ) -> Result<Vec<Box<dyn crate::engine::Callback>>> {
        let prompts = crate::recipes::images::sample_prompts(cfg, ctx)?;
        let sampler = SampleCallback::new(
            SdSampler {
                pipe: self.pipe.clone(),
                opts: sample_options(cfg),
            },
            prompts.clone(),
            cfg.logging.sample_every_n_steps,
            ctx.out_dir.join("samples"),
        );
        self.written = sampler.written.clone();
        self.prompts = prompts;
        let mut callbacks: Vec<Box<dyn crate::engine::Callback>> = vec![Box::new(sampler)];
        if let Some((sdxl, parts)) = self.snapshot_parts.take() {
            let formats = cfg.train.export_formats.clone();
            let writer: crate::job::snapshots::SnapshotWriter =
                Box::new(move |parts, dir, stem| {
                    let mut out = Vec::new();
                    for f in &formats {
                        match f {
                            ExportFormat::Kohya => {
                                let p = dir.join(format!("{stem}.safetensors"));
                                write_kohya_parts(parts, sdxl, &p)
                                    .during("writing a kohya adapter snapshot")?;
                                out.push(p);
                            }
                            ExportFormat::Peft => {
                                let d = dir.join(stem);
                                write_diffusers_parts(parts, &d)
                                    .during("writing a diffusers adapter snapshot")?;
                                out.push(d);
                            }
                        }
                    }
                    Ok(out)
                });
            callbacks.push(Box::new(crate::job::snapshots::AdapterSnapshots::for_run(
                parts,
                writer,
                cfg,
                &ctx.out_dir,
            )));
        }
        Ok(callbacks)
    }

    fn task(&self, cfg: &TrainConfig, named: Vec<(String, Tensor)>) -> Result<SdTask> {
        Ok(SdTask {
            pipe: self.pipe.clone(),
            objective: objective_of(&self.pipe, cfg)?,
            named,
            loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
            lr_scales: task::LrScales::of(&cfg.train),
        })
    }

    fn after(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        source: ImageSource,
        _report: &crate::engine::TrainReport,
    ) -> Result<Option<(&'static str, f64)>> {
        self.bucket_batches = source.bucket_batches();
        drop(source);
        let objective = match self.objective.take() {
            Some(o) => o,
            None => objective_of(&self.pipe, cfg)?,
        };
        self.eval_loss_after = fixed_eval_loss(
            &self.pipe,
            &objective,
            &self.eval_batches,
            &EVAL_TIMESTEPS,
            eval_seed(cfg),
        )
        .during("evaluating after training")?;
        if crate::engine::stop_requested() {
            return Ok(None);
        }
        ctx.say(&format!(
            "fixed-noise loss: {:.5} → {:.5}",
            self.eval_loss_before, self.eval_loss_after
        ));
        Ok(Some(("fixed-noise loss", self.eval_loss_after)))
    }

    fn finish(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        report: &crate::engine::TrainReport,
    ) -> Result<()> {
        crate::recipes::images::final_grid(
            SdSampler {
                pipe: self.pipe.clone(),
                opts: sample_options(cfg),
            },
            &self.prompts,
            &self.written,
            ctx.out_dir.join("samples"),
            report.steps,
        )?;
        Ok(())
    }

    fn dataset_metadata(&self) -> serde_json::Value {
        serde_json::json!({
            "path": self.data_path.display().to_string(),
            "images": self.images,
            "items": self.items,
        })
    }

    fn export(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        metadata: std::collections::BTreeMap<String, String>,
    ) -> Result<Vec<PathBuf>> {
        self.eval_batches.clear();
        let pipe = Rc::get_mut(&mut self.pipe).ok_or(JobError::Internal(
            "the pipeline is still shared after training",
        ))?;
        let meta = sd_metadata(metadata, SdVersion::of(pipe), !cfg.train.train_text_encoder);
        let mut outputs = Vec::new();
        for f in &cfg.train.export_formats {
            match f {
                ExportFormat::Kohya => {
                    let p = ctx
                        .out_dir
                        .join(format!("{}.safetensors", cfg.train.output_name));
                    write_kohya_as(
                        pipe,
                        "default",
                        meta.clone(),
                        &p,
                        cfg.train
                            .save_precision
                            .map(crate::config::SavePrecision::kind),
                    )
                    .during("writing the kohya adapter")?;
                    outputs.push(p);
                }
                ExportFormat::Peft => {
                    let p = write_diffusers_as(
                        pipe,
                        "default",
                        &ctx.out_dir.join(&cfg.train.output_name),
                        cfg.train
                            .save_precision
                            .map(crate::config::SavePrecision::kind),
                    )
                    .during("writing the diffusers adapter")?;
                    outputs.push(p);
                }
            }
        }
        Ok(outputs)
    }

    fn summary(self, outcome: RunOutcome) -> Result<SdRunSummary> {
        let samples = self.written.borrow().clone();
        Ok(SdRunSummary {
            plan: outcome.plan,
            steps: outcome.report.steps,
            items: self.items,
            images: self.images,
            losses: outcome.report.losses,
            eval_loss_before: self.eval_loss_before,
            eval_loss_after: self.eval_loss_after,
            vae_encodings: *self.encoded.borrow(),
            train_seconds: outcome.train_seconds,
            memory: outcome.memory,
            samples,
            bucket_batches: self.bucket_batches,
            outputs: outcome.outputs,
        })
    }

    fn report(summary: &SdRunSummary, ctx: &RunContext<'_>) -> String {
        let files: Vec<PathBuf> = summary
            .outputs
            .iter()
            .chain(&summary.samples)
            .cloned()
            .collect();
        crate::recipes::images::run_report(
            summary.steps,
            summary.train_seconds,
            (summary.eval_loss_before, summary.eval_loss_after),
            summary.plan.as_ref(),
            &summary.memory,
            &files,
            ctx,
        )
    }
}

/// The Stable Diffusion 1.x / 2.x / SDXL recipe: `model.kind: sd15 | sdxl`, a diffusers SD
/// folder, an original single-file checkpoint, or (for planning only) a diffusion preset.
#[derive(Debug, Clone, Copy)]
pub struct SdRecipe;

impl crate::job::Recipe for SdRecipe {
    fn name(&self) -> &'static str {
        "sd"
    }

    fn detect(&self, cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
        crate::sd_plan::is_sd_config(cfg, config_dir)
    }

    fn plan(
        &self,
        cfg: &TrainConfig,
        config_dir: Option<&Path>,
        budget: Option<lora_memory::Budget>,
        cuda: bool,
    ) -> Result<Plan> {
        crate::sd_plan::plan(cfg, config_dir, budget, cuda)
    }

    fn train(&self, cfg: TrainConfig, opts: &RunOptions) -> Result<serde_json::Value> {
        if !crate::sd_plan::wants_sd_job(&cfg, opts.config_dir.as_deref()) {
            // a diffusion preset name: enough for planning, not for training
            return Err(JobError::Input(format!(
                "model.base_model {:?} is a memory-planning preset (`lora-train plan` reads it); training needs the weights: a diffusers folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/) or a single-file .safetensors checkpoint",
                cfg.base_model().unwrap_or_default()
            )));
        }
        let summary = run(cfg, opts)?;
        serde_json::to_value(&summary).during("serializing the summary")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sd_plan::is_sd_model;

    #[test]
    fn frozen_model_settings_charge_what_the_job_keeps_on_the_device() {
        let sdxl = lora_memory::ModelDescriptor::preset("SDXL").unwrap();
        let mut cfg = TrainConfig::default();
        cfg.data.cache_latents = Some(true);
        let charged = |cfg: &TrainConfig, aug: Augmentations, cuda: bool| {
            let mut s = lora_memory::Settings::default()
                .with_target_modules(&crate::sd_plan::DEFAULT_UNET_TARGETS)
                .with_resolution(1024);
            frozen_model_settings(&mut s, cfg, aug, cuda);
            let d = lora_memory::estimate(&sdxl, &s).unwrap().diffusion.unwrap();
            (d.vae_weights.0 > 0, d.text_encoder_weights.0 > 0)
        };
        let fixed = Augmentations::default();
        // cache_latents, frozen text encoders, fixed captions: both leave the device on CUDA
        assert_eq!(precomputed(&cfg, fixed), (true, true));
        assert_eq!(charged(&cfg, fixed, true), (false, false));
        // on the CPU the move keeps them in the same memory
        assert_eq!(charged(&cfg, fixed, false), (true, true));
        // shuffled captions keep the text encoders, random crops the VAE
        let shuffled = Augmentations {
            varying_captions: true,
            ..fixed
        };
        assert_eq!(precomputed(&cfg, shuffled), (true, false));
        assert_eq!(charged(&cfg, shuffled, true), (false, true));
        let cropped = Augmentations {
            random_crop: true,
            ..fixed
        };
        assert_eq!(precomputed(&cfg, cropped), (false, true));
        assert_eq!(charged(&cfg, cropped, true), (true, false));
        // trained text encoders stay; without cache_latents nothing is cached ahead
        cfg.train.train_text_encoder = true;
        assert_eq!(precomputed(&cfg, fixed), (true, false));
        assert_eq!(charged(&cfg, fixed, true), (false, true));
        cfg.train.train_text_encoder = false;
        cfg.data.cache_latents = None;
        assert_eq!(precomputed(&cfg, fixed), (false, false));
        assert_eq!(charged(&cfg, fixed, true), (true, true));
    }

    #[test]
    fn kohya_metadata_names_the_base_version_as_sd_scripts_does() {
        let m = sd_metadata(Default::default(), SdVersion::V1, true);
        assert_eq!(m["ss_base_model_version"], "sd_v1");
        assert_eq!(m["ss_v2"], "False");
        assert_eq!(m["ss_network_train_unet_only"], "True");
        let m = sd_metadata(Default::default(), SdVersion::V2, false);
        assert_eq!(m["ss_base_model_version"], "sd_v2");
        assert_eq!(m["ss_v2"], "True");
        assert_eq!(m["ss_network_train_unet_only"], "False");
        let m = sd_metadata(Default::default(), SdVersion::Xl, false);
        assert_eq!(m["ss_base_model_version"], "sdxl_base_v1-0");
        assert_eq!(m["ss_v2"], "False");
    }

    #[test]
    fn sdxl_time_ids_are_height_first_and_kohya_prefixes_follow_sd_scripts() {
        // a 640 × 480 (w × h) image, cropped at x = 16, y = 8 into a 512 × 384 bucket
        assert_eq!(
            sdxl_time_ids((640, 480), (16, 8), (512, 384)),
            [480.0, 640.0, 8.0, 16.0, 384.0, 512.0]
        );
        assert_eq!(kohya_prefix("unet", true), "lora_unet");
        assert_eq!(kohya_prefix("text_encoder", false), "lora_te");
        assert_eq!(kohya_prefix("text_encoder", true), "lora_te1");
        assert_eq!(kohya_prefix("text_encoder_2", true), "lora_te2");
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
