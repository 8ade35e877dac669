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
//!   [`LatentCache`]).
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

use crate::config::{Dtype, ExportFormat, TargetModules, TrainConfig};
use crate::engine::{BatchSource, TrainError, TrainStep};
use crate::job::error::During;
use crate::job::{JobError, Plan, Result, RunOptions, resolve_path};
use crate::sd_plan::DEFAULT_UNET_TARGETS;
use lora_core::formats::AdapterWeights;
use lora_data::cache::{CacheKey, LatentCache};
use lora_data::image::{ImageCollate, ImageDataset, config::DatasetConfig};
use lora_data::loader::{Dataset, Loader, LoaderConfig};
use lora_models::clip::{ClipTextModel, ClipTextModelWithProjection, ClipTokenizer};
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
/// kohya prefix of SDXL's first text encoder, CLIP ViT-L (`LORA_PREFIX_TEXT_ENCODER1`).
pub const KOHYA_TE1_PREFIX: &str = "lora_te1";
/// kohya prefix of SDXL's second text encoder, OpenCLIP bigG (`LORA_PREFIX_TEXT_ENCODER2`).
pub const KOHYA_TE2_PREFIX: &str = "lora_te2";
/// The text-encoder modules adapted with `train.train_text_encoder`: CLIP's attention
/// projections, as diffusers' `train_text_to_image_lora.py` / `train_dreambooth_lora.py`
/// (`target_modules=["q_proj", "k_proj", "v_proj", "out_proj"]`).
pub const TEXT_ENCODER_TARGETS: [&str; 4] = ["q_proj", "k_proj", "v_proj", "out_proj"];

/// The training noise schedule of a pipeline folder (`scheduler/scheduler_config.json`), else
/// SD's (`ScheduleConfig::sd`).
fn read_schedule(dir: &Path) -> Result<ScheduleConfig> {
    let file = dir.join("scheduler/scheduler_config.json");
    if file.is_file() {
        ScheduleConfig::from_file(&file).during(format!("reading {}", file.display()))
    } else {
        Ok(ScheduleConfig::sd())
    }
}

fn model_err(e: lora_models::Error) -> TrainError {
    match e {
        lora_models::Error::Torch(t) => TrainError::Torch(t),
        other => TrainError::App(other.to_string()),
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

/// Text conditioning of a batch of prompts.
///
/// # Shapes
/// `hidden` `[n, 77, D]` in the text encoder's dtype (SD 1.x `D` = 768, SD 2.x 1024, SDXL 2048);
/// `pooled` (SDXL only) `[n, P]`: `text_encoder_2`'s projected pooled output (`text_embeds`,
/// SDXL 1280).
#[derive(Debug)]
pub struct TextCond {
    /// The UNet's `encoder_hidden_states`.
    pub hidden: Tensor,
    /// SDXL's pooled text embedding (the `text_embeds` of the added conditioning).
    pub pooled: Option<Tensor>,
}

impl TextCond {
    /// A second handle on the same tensors.
    pub fn shallow_clone(&self) -> Self {
        TextCond {
            hidden: self.hidden.shallow_clone(),
            pooled: self.pooled.as_ref().map(Tensor::shallow_clone),
        }
    }

    fn to_device(&self, d: Device) -> std::result::Result<Self, tch::TchError> {
        Ok(TextCond {
            hidden: self.hidden.f_to_device(d)?,
            pooled: self.pooled.as_ref().map(|p| p.f_to_device(d)).transpose()?,
        })
    }

    /// Stacks per-sample conditionings (`hidden` `[77, D]`, `pooled` `[P]`) into a batch.
    fn stack(items: &[TextCond]) -> std::result::Result<Self, tch::TchError> {
        let hidden: Vec<&Tensor> = items.iter().map(|c| &c.hidden).collect();
        let pooled: Option<Vec<&Tensor>> = items.iter().map(|c| c.pooled.as_ref()).collect();
        Ok(TextCond {
            hidden: Tensor::f_stack(&hidden, 0)?,
            pooled: match pooled {
                Some(p) if !p.is_empty() => Some(Tensor::f_stack(&p, 0)?),
                _ => None,
            },
        })
    }

    /// Row `i` of a batch (`hidden` `[77, D]`, `pooled` `[P]`).
    fn row(&self, i: i64) -> std::result::Result<Self, tch::TchError> {
        Ok(TextCond {
            hidden: self.hidden.f_select(0, i)?,
            pooled: self.pooled.as_ref().map(|p| p.f_select(0, i)).transpose()?,
        })
    }

    fn chunk(&self, n: i64) -> std::result::Result<Vec<Self>, tch::TchError> {
        let h = self.hidden.f_chunk(n, 0)?;
        let p: Vec<Option<Tensor>> = match &self.pooled {
            Some(p) => p.f_chunk(n, 0)?.into_iter().map(Some).collect(),
            None => (0..h.len()).map(|_| None).collect(),
        };
        Ok(h.into_iter()
            .zip(p)
            .map(|(hidden, pooled)| TextCond { hidden, pooled })
            .collect())
    }
}

/// SDXL's micro-conditioning of one image: the six `add_time_ids` (diffusers
/// `StableDiffusionXLPipeline._get_add_time_ids`, kohya `sdxl_train_util.get_size_embeddings`)
/// `[original_h, original_w, crop_top, crop_left, target_h, target_w]` in pixels, from sizes
/// given as `(width, height)` and the crop as `(x, y)` (lora-data's [`ImageSample`]
/// convention: the original size before resizing, the top-left of the bucket crop in the resized
/// image, the bucket).
///
/// [`ImageSample`]: lora_data::image::ImageSample
pub fn sdxl_time_ids(original: (u32, u32), crop: (u32, u32), target: (u32, u32)) -> [f32; 6] {
    [
        original.1 as f32,
        original.0 as f32,
        crop.1 as f32,
        crop.0 as f32,
        target.1 as f32,
        target.0 as f32,
    ]
}

/// UNet + VAE + CLIP text encoder(s) + tokenizer(s) + noise schedule of an SD 1.x/2.x or SDXL
/// pipeline.
#[derive(Debug)]
pub struct SdPipeline {
    /// The denoiser (adapters are injected here).
    pub unet: UNet2DConditionModel,
    /// The autoencoder (frozen).
    pub vae: AutoencoderKL,
    /// The (first) text encoder: SD 1.x/2.x's only one, SDXL's CLIP ViT-L.
    pub text_encoder: ClipTextModel,
    /// The tokenizer (rows of 77 ids).
    pub tokenizer: ClipTokenizer,
    /// SDXL's second text encoder (OpenCLIP bigG with projection); `None` for SD 1.x/2.x.
    pub text_encoder_2: Option<ClipTextModelWithProjection>,
    /// SDXL's second tokenizer (padding `!`); `None` for SD 1.x/2.x.
    pub tokenizer_2: Option<ClipTokenizer>,
    /// The training noise schedule (`scheduler/scheduler_config.json`, else SD's).
    pub schedule: ScheduleConfig,
    /// kohya / A1111 clip skip (1 = last layer, 2 = penultimate; see
    /// [`ClipTextModel::skip_hidden`]). SDXL counts from its penultimate default: 1 =
    /// `hidden_states[-2]` of both encoders, 2 = `hidden_states[-3]` (diffusers' `clip_skip=1`).
    pub clip_skip: usize,
    /// The device the UNet (and training) runs on.
    device: Device,
    /// The device the VAE is on (the text encoders know theirs).
    vae_device: Device,
    /// The dtype the frozen models were loaded in.
    kind: Kind,
    /// The files the VAE and the text encoders are loaded again from (see
    /// [`SdPipeline::move_frozen`]).
    origin: FrozenOrigin,
}

/// Where a pipeline's VAE and text encoders come from, to load them again on another device.
#[derive(Debug, Clone)]
enum FrozenOrigin {
    /// A diffusers folder (`vae/`, `text_encoder/`, `text_encoder_2/`).
    Folder(PathBuf),
    /// An original single-file checkpoint (the component configs are the loaded models').
    SingleFile(PathBuf),
}

/// Copies of the VAE / text encoders loaded on the UNet's device for one call, for the ones that
/// were moved off it (see [`SdPipeline::move_frozen`]); dropped when the call ends.
#[derive(Default)]
struct OnDevice {
    vae: Option<AutoencoderKL>,
    text_encoder: Option<ClipTextModel>,
    text_encoder_2: Option<ClipTextModelWithProjection>,
}

/// Whether the UNet's added conditioning fits the text encoders found (`sdxl`: a second one).
fn sdxl_unet_check(unet: &UNet2DConditionModel, sdxl: bool, origin: &Path) -> Result<()> {
    let msg = match (unet.config().addition_embed_type.as_deref(), sdxl) {
        (None, false) | (Some("text_time"), true) => return Ok(()),
        (Some("text_time"), false) => {
            "an SDXL UNet (`addition_embed_type: text_time`) without `text_encoder_2/` and `tokenizer_2/`"
                .to_string()
        }
        (None, true) => {
            "a second text encoder (SDXL) but the UNet has no `addition_embed_type: text_time`"
                .to_string()
        }
        (Some(other), _) => format!(
            "UNet `addition_embed_type: {other}` is not trained by the SD job (SD 1.x/2.x: none, SDXL: text_time)"
        ),
    };
    Err(JobError::Unsupported {
        what: origin.display().to_string(),
        reason: msg,
    })
}

impl SdPipeline {
    /// Loads a diffusers pipeline folder in dtype `kind` on `device`: SDXL when it has
    /// `text_encoder_2/` (then `tokenizer_2/` is required and the UNet must have
    /// `addition_embed_type: text_time`). A `.safetensors` file goes to
    /// [`Self::from_single_file`] (tokenizers and configs from a diffusers folder beside it).
    ///
    /// # Errors
    /// [`JobError::Model`] / [`JobError::Io`] naming the component, with the loader's error as
    /// the source; [`JobError::Unsupported`] for a UNet this job does not train.
    pub fn from_diffusers(dir: &Path, kind: Kind, device: Device) -> Result<Self> {
        if dir.is_file() {
            return Self::from_single_file(dir, None, kind, device);
        }
        let opts = LoadOptions {
            kind,
            device,
            ..LoadOptions::default()
        };
        let ctx = |c: &str| format!("loading {} of {}", c, dir.display());
        let unet = UNet2DConditionModel::from_diffusers(dir, &opts).during(&ctx("the UNet"))?;
        let sdxl = dir.join("text_encoder_2").is_dir();
        sdxl_unet_check(&unet, sdxl, dir)?;
        let vae = AutoencoderKL::from_diffusers(dir, &opts).during(&ctx("the VAE"))?;
        let text_encoder = ClipTextModel::from_pretrained(dir.join("text_encoder"), kind, device)
            .during(&ctx("text_encoder"))?;
        let tokenizer = ClipTokenizer::from_dir(dir.join("tokenizer")).during(&ctx("tokenizer"))?;
        let (text_encoder_2, tokenizer_2) = if sdxl {
            let te2 = ClipTextModelWithProjection::from_pretrained(
                dir.join("text_encoder_2"),
                kind,
                device,
            )
            .during(&ctx("text_encoder_2"))?;
            let tok2 =
                ClipTokenizer::from_dir(dir.join("tokenizer_2")).during(&ctx("tokenizer_2"))?;
            (Some(te2), Some(tok2))
        } else {
            (None, None)
        };
        let schedule = read_schedule(dir)?;
        Ok(SdPipeline {
            unet,
            vae,
            text_encoder,
            tokenizer,
            text_encoder_2,
            tokenizer_2,
            schedule,
            clip_skip: 1,
            device,
            vae_device: device,
            kind,
            origin: FrozenOrigin::Folder(dir.to_path_buf()),
        })
    }

    /// Loads an original single-file checkpoint (`v1-5-pruned.safetensors` — CompVis
    /// `ldm` keys — or `sd_xl_base_1.0.safetensors` — Stability `sgm` keys): UNet
    /// (`model.diffusion_model.`), VAE (`first_stage_model.`), the text encoder(s)
    /// (`cond_stage_model.transformer.`; SDXL `conditioner.embedders.0.transformer.` and the
    /// OpenCLIP `conditioner.embedders.1.model.`), translated by lora-models' key maps.
    ///
    /// A single file holds no tokenizer and no configs: they come from `companion` (config
    /// `model.tokenizer`) — a CLIP tokenizer folder, or a diffusers pipeline folder whose
    /// `tokenizer/`, `tokenizer_2/`, `scheduler/` and component `config.json` files are used
    /// (as diffusers' `from_single_file(config=…)`) — or, when `companion` is `None`, from the
    /// file's own folder if it has a `tokenizer/`. Missing configs: SD 1.5's or SDXL base's
    /// UNet/VAE configs, text-encoder sizes read off the stored shapes, SDXL's `tokenizer_2`
    /// = the tokenizer padded with `!`, SD's noise schedule.
    ///
    /// # Errors
    /// [`JobError::Unsupported`]: no UNet in the file, an SD 2.x file (OpenCLIP-H text encoder, not
    /// read here: convert it with diffusers), no tokenizer (naming `model.tokenizer`), and the
    /// loaders' errors naming the component.
    pub fn from_single_file(
        path: &Path,
        companion: Option<&Path>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        use lora_models::sd::load as ld;
        let ctx = |c: &str| format!("loading {} of {}", c, path.display());
        let (sdxl, sd2, has_unet, has_te) = {
            let files = ld::SafetensorsFiles::open(&[path.to_path_buf()], path, Device::Cpu)
                .during(&ctx("the header"))?;
            let has = |p: &str| files.names().any(|n| n.starts_with(p));
            (
                has(ld::SGM_TEXT_ENCODER_2_PREFIX),
                has(ld::LDM_OPEN_CLIP_PREFIX),
                has(ld::LDM_UNET_PREFIX),
                has(ld::LDM_TEXT_ENCODER_PREFIX) || has(ld::SGM_TEXT_ENCODER_PREFIX),
            )
        };
        let convert_hint = "or convert it to a diffusers folder (diffusers `StableDiffusionPipeline.from_single_file(path).save_pretrained(dir)`, `StableDiffusionXLPipeline` for SDXL)";
        if !has_unet {
            return Err(JobError::Unsupported {
                what: path.display().to_string(),
                reason: format!(
                    "no `model.diffusion_model.*` tensors: not an original SD 1.x / SDXL checkpoint; set model.base_model to a diffusers folder {convert_hint}"
                ),
            });
        }
        if sd2 && !sdxl {
            return Err(JobError::Unsupported {
                what: path.display().to_string(),
                reason: format!(
                    "an SD 2.x single file (OpenCLIP-H text encoder under `cond_stage_model.model.`) is not read by the SD job; {convert_hint}"
                ),
            });
        }
        if !has_te {
            return Err(JobError::Unsupported {
                what: path.display().to_string(),
                reason: format!(
                    "no text encoder (`cond_stage_model.transformer.*` / `conditioner.embedders.0.transformer.*`) in the file; {convert_hint}"
                ),
            });
        }
        // the check `lora-train plan` makes too
        let comp = crate::sd_plan::single_file_companion(path, companion, sdxl)?;
        let tok_dir = if comp.join("tokenizer").is_dir() {
            comp.join("tokenizer")
        } else {
            comp.clone()
        };
        let tokenizer = ClipTokenizer::from_dir(&tok_dir).during(format!(
            "model.tokenizer: reading the tokenizer {}",
            tok_dir.display()
        ))?;
        let tokenizer_2 = if !sdxl {
            None
        } else if comp.join("tokenizer_2").is_dir() {
            Some(
                ClipTokenizer::from_dir(comp.join("tokenizer_2"))
                    .during(format!("reading {}/tokenizer_2", comp.display()))?,
            )
        } else {
            // SDXL's tokenizer_2 is CLIP's BPE padded with "!"
            Some(
                tokenizer
                    .clone()
                    .with_pad_token("!")
                    .during("SDXL tokenizer_2 from the tokenizer")?,
            )
        };
        let config_file = |c: &str| {
            let f = comp.join(c).join("config.json");
            f.is_file().then_some(f)
        };
        let cfg_err = |c: &str| {
            let at = format!("reading {}/{c}/config.json", comp.display());
            move |e: lora_models::Error| JobError::Model {
                during: at.clone(),
                source: e,
            }
        };
        let unet_cfg = match config_file("unet") {
            Some(f) => lora_models::sd::UNetConfig::from_file(&f).map_err(cfg_err("unet"))?,
            None if sdxl => lora_models::sd::UNetConfig::sdxl_base(),
            None => lora_models::sd::UNetConfig::sd15(),
        };
        let vae_cfg = match config_file("vae") {
            Some(f) => lora_models::sd::VaeConfig::from_file(&f).map_err(cfg_err("vae"))?,
            None if sdxl => lora_models::sd::VaeConfig::sdxl(),
            None => lora_models::sd::VaeConfig::sd15(),
        };
        let te_cfg = |c: &str| -> Result<Option<lora_models::clip::ClipTextConfig>> {
            config_file(c)
                .map(|f| lora_models::clip::ClipTextConfig::from_file(f).map_err(cfg_err(c)))
                .transpose()
        };
        let opts = LoadOptions {
            kind,
            device,
            ..LoadOptions::default()
        };
        let unet = UNet2DConditionModel::from_single_file(path, unet_cfg, &opts)
            .during(&ctx("the UNet"))?;
        sdxl_unet_check(&unet, sdxl, path)?;
        let vae = AutoencoderKL::from_single_file(path, vae_cfg, &opts).during(&ctx("the VAE"))?;
        let prefix = if sdxl {
            ld::SGM_TEXT_ENCODER_PREFIX
        } else {
            ld::LDM_TEXT_ENCODER_PREFIX
        };
        let text_encoder =
            ClipTextModel::from_single_file(path, prefix, te_cfg("text_encoder")?, kind, device)
                .during(&ctx("the text encoder"))?;
        let text_encoder_2 = if sdxl {
            Some(
                ClipTextModelWithProjection::from_open_clip(
                    path,
                    ld::SGM_TEXT_ENCODER_2_PREFIX,
                    te_cfg("text_encoder_2")?,
                    kind,
                    device,
                )
                .during(&ctx("text_encoder_2 (OpenCLIP)"))?,
            )
        } else {
            None
        };
        let schedule = read_schedule(&comp)?;
        Ok(SdPipeline {
            unet,
            vae,
            text_encoder,
            tokenizer,
            text_encoder_2,
            tokenizer_2,
            schedule,
            clip_skip: 1,
            device,
            vae_device: device,
            kind,
            origin: FrozenOrigin::SingleFile(path.to_path_buf()),
        })
    }

    /// Whether this is an SDXL pipeline (two text encoders, `text_time` added conditioning).
    pub fn is_sdxl(&self) -> bool {
        self.text_encoder_2.is_some()
    }

    /// Token ids of `prompts` for the text encoder(s): `[n, 77]` int64, and SDXL's
    /// `tokenizer_2` rows (padded with its own pad token).
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn tokenize<S: AsRef<str>>(
        &self,
        prompts: &[S],
    ) -> lora_models::Result<(Tensor, Option<Tensor>)> {
        let ids = self.tokenizer.encode_batch(prompts)?;
        let ids_2 = match &self.tokenizer_2 {
            Some(t) => Some(t.encode_batch(prompts)?),
            None => None,
        };
        Ok((ids, ids_2))
    }

    /// The UNet conditioning of `prompts` ([`Self::condition`]) computed without grad.
    ///
    /// # Errors
    /// Tokenizer / model errors.
    pub fn encode_prompts<S: AsRef<str>>(&self, prompts: &[S]) -> lora_models::Result<TextCond> {
        let _g = tch::no_grad_guard();
        let (ids, ids_2) = self.tokenize(prompts)?;
        self.condition(&ids, ids_2.as_ref(), false)
    }

    /// The UNet conditioning of token ids `[n, 77]` int64 (SDXL: and `ids_2`, the
    /// `tokenizer_2` rows), in the text encoder's dtype, with autograd as the caller's grad mode
    /// says (text-encoder LoRA training); `train` switches LoRA dropout on.
    ///
    /// SD 1.x/2.x: `hidden` `[n, 77, D]` at `clip_skip` with the final LayerNorm (as kohya
    /// does). SDXL (diffusers `StableDiffusionXLPipeline.encode_prompt`): `hidden_states[-2]`
    /// of both encoders (`[-(clip_skip + 1)]`), no final LayerNorm, concatenated on the feature
    /// axis → `[n, 77, D1 + D2]`, and `pooled` = `text_encoder_2`'s `text_embeds` `[n, P]`.
    ///
    /// # Errors
    /// Model errors; [`lora_models::Error::InvalidArgument`] when an SDXL pipeline gets no
    /// `ids_2`.
    pub fn condition(
        &self,
        ids: &Tensor,
        ids_2: Option<&Tensor>,
        train: bool,
    ) -> lora_models::Result<TextCond> {
        let on = self.on_device(false, true)?;
        self.condition_with(&on, ids, ids_2, train)
    }

    /// [`Self::condition`] with the text encoders of `on` where it has them.
    fn condition_with(
        &self,
        on: &OnDevice,
        ids: &Tensor,
        ids_2: Option<&Tensor>,
        train: bool,
    ) -> lora_models::Result<TextCond> {
        let te = on.text_encoder.as_ref().unwrap_or(&self.text_encoder);
        let ids = ids.f_to_device(te.device())?;
        let out = te.forward_t(&ids, train)?;
        let Some(te2) = on.text_encoder_2.as_ref().or(self.text_encoder_2.as_ref()) else {
            return Ok(TextCond {
                hidden: te.skip_hidden(&out, self.clip_skip, true)?,
                pooled: None,
            });
        };
        let ids_2 = ids_2.ok_or_else(|| {
            lora_models::Error::InvalidArgument(
                "SDXL conditioning needs the token ids of tokenizer_2".into(),
            )
        })?;
        let out2 = te2.forward_t(&ids_2.f_to_device(te.device())?, train)?;
        let skip = self.clip_skip.max(1) + 1;
        let h1 = te.skip_hidden(&out, skip, false)?;
        let h2 = te2.skip_hidden(&out2, skip, false)?.f_to_kind(h1.kind())?;
        let pooled = out2.text_embeds.ok_or_else(|| {
            lora_models::Error::InvalidArgument("text_encoder_2 returned no text_embeds".into())
        })?;
        Ok(TextCond {
            hidden: Tensor::f_cat(&[h1, h2], -1)?,
            pooled: Some(pooled),
        })
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
        let on = self.on_device(true, false)?;
        let vae = on.vae.as_ref().unwrap_or(&self.vae);
        let x = pixels.f_to_device(self.device)?;
        let z = vae.encode(&x)?.mode();
        Ok(vae
            .scale_latents(&z)?
            .f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?)
    }

    fn unet_device(&self) -> Device {
        self.device
    }

    /// The device the UNet runs on (where training happens).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The device the VAE is on: the UNet's, or another after [`Self::move_frozen`].
    pub fn vae_device(&self) -> Device {
        self.vae_device
    }

    /// The device the text encoder(s) are on.
    pub fn text_encoder_device(&self) -> Device {
        self.text_encoder.device()
    }

    /// Moves the VAE (`vae`) and the text encoder(s) (`text_encoders`) to `to`, as kohya
    /// sd-scripts move them to the CPU once latents and text-encoder outputs are cached: the
    /// copies on `to` are loaded again from the pipeline's files (see [`Self::reload_frozen`])
    /// and the old ones dropped, which frees their memory on the device. A component already on
    /// `to` stays as it is, so on a CPU run the call changes nothing.
    ///
    /// While a component is away from the UNet's device, [`Self::encode_images`],
    /// [`Self::condition`] / [`Self::encode_prompts`] and [`Self::sample_images`] load a copy
    /// on the UNet's device for the call and drop it afterwards (back only for sampling, then
    /// off again).
    ///
    /// Returns the components moved (`"vae"`, `"text_encoder"`, `"text_encoder_2"`).
    ///
    /// # Errors
    /// [`JobError::Model`] naming the component and the file when loading fails;
    /// [`JobError::Unsupported`] for text encoders that carry LoRA adapters (trained or loaded),
    /// as loading them again
    /// would drop the adapters.
    pub fn move_frozen(
        &mut self,
        to: Device,
        vae: bool,
        text_encoders: bool,
    ) -> Result<Vec<&'static str>> {
        let vae = vae && self.vae_device != to;
        let text_encoders = text_encoders && self.text_encoder.device() != to;
        self.reload_frozen(to, vae, text_encoders)
    }

    /// Loads the VAE (`vae`) and the text encoder(s) (`text_encoders`) again from the
    /// pipeline's files (the diffusers folder's `vae/`, `text_encoder/`, `text_encoder_2/`, or
    /// the single file with the loaded models' configs) onto `device` in the pipeline's dtype,
    /// replacing the current copies; what [`Self::move_frozen`] does for components not on
    /// `device` yet. The new copies compute exactly what the old ones did.
    ///
    /// Returns the components loaded.
    ///
    /// # Errors
    /// As [`Self::move_frozen`].
    pub fn reload_frozen(
        &mut self,
        device: Device,
        vae: bool,
        text_encoders: bool,
    ) -> Result<Vec<&'static str>> {
        let origin = match &self.origin {
            FrozenOrigin::Folder(p) | FrozenOrigin::SingleFile(p) => p.clone(),
        };
        let ctx = |c: &str| format!("loading {c} of {} on {device:?}", origin.display());
        let mut moved = Vec::new();
        if text_encoders {
            let mut adapters = lora_core::inject::count_params(&mut self.text_encoder)
                .during(&ctx("text_encoder"))?
                .0;
            if let Some(te2) = self.text_encoder_2.as_mut() {
                adapters += lora_core::inject::count_params(te2)
                    .during(&ctx("text_encoder_2"))?
                    .0;
            }
            if adapters > 0 {
                return Err(JobError::Unsupported {
                    what: origin.display().to_string(),
                    reason: format!(
                        "the text encoders carry LoRA adapters ({adapters} parameters) and are not moved (loading them again would drop the adapters)"
                    ),
                });
            }
            let (te, te2) = self
                .load_text_encoders(device)
                .during(&ctx("the text encoders"))?;
            self.text_encoder = te;
            moved.push("text_encoder");
            if te2.is_some() {
                self.text_encoder_2 = te2;
                moved.push("text_encoder_2");
            }
        }
        if vae {
            self.vae = self.load_vae(device).during(&ctx("the VAE"))?;
            self.vae_device = device;
            moved.push("vae");
        }
        Ok(moved)
    }

    /// The VAE loaded from the pipeline's files onto `device`.
    fn load_vae(&self, device: Device) -> lora_models::Result<AutoencoderKL> {
        let opts = LoadOptions {
            kind: self.kind,
            device,
            ..LoadOptions::default()
        };
        match &self.origin {
            FrozenOrigin::Folder(dir) => AutoencoderKL::from_diffusers(dir, &opts),
            FrozenOrigin::SingleFile(path) => {
                AutoencoderKL::from_single_file(path, self.vae.config().clone(), &opts)
            }
        }
    }

    /// The text encoder(s), without adapters, loaded from the pipeline's files onto `device`.
    fn load_text_encoders(
        &self,
        device: Device,
    ) -> lora_models::Result<(ClipTextModel, Option<ClipTextModelWithProjection>)> {
        use lora_models::sd::load as ld;
        let kind = self.kind;
        match &self.origin {
            FrozenOrigin::Folder(dir) => {
                let te = ClipTextModel::from_pretrained(dir.join("text_encoder"), kind, device)?;
                let te2 = match &self.text_encoder_2 {
                    Some(_) => Some(ClipTextModelWithProjection::from_pretrained(
                        dir.join("text_encoder_2"),
                        kind,
                        device,
                    )?),
                    None => None,
                };
                Ok((te, te2))
            }
            FrozenOrigin::SingleFile(path) => {
                let prefix = if self.is_sdxl() {
                    ld::SGM_TEXT_ENCODER_PREFIX
                } else {
                    ld::LDM_TEXT_ENCODER_PREFIX
                };
                let te = ClipTextModel::from_single_file(
                    path,
                    prefix,
                    Some(self.text_encoder.config().clone()),
                    kind,
                    device,
                )?;
                let te2 = match &self.text_encoder_2 {
                    Some(t) => Some(ClipTextModelWithProjection::from_open_clip(
                        path,
                        ld::SGM_TEXT_ENCODER_2_PREFIX,
                        Some(t.config().clone()),
                        kind,
                        device,
                    )?),
                    None => None,
                };
                Ok((te, te2))
            }
        }
    }

    /// Copies on the UNet's device of the VAE (`vae`) and the text encoders (`text`) that were
    /// moved off it; empty when they are there.
    fn on_device(&self, vae: bool, text: bool) -> lora_models::Result<OnDevice> {
        let mut on = OnDevice::default();
        if vae && self.vae_device != self.device {
            on.vae = Some(self.load_vae(self.device)?);
        }
        if text && self.text_encoder.device() != self.device {
            let (te, te2) = self.load_text_encoders(self.device)?;
            on.text_encoder = Some(te);
            on.text_encoder_2 = te2;
        }
        Ok(on)
    }

    /// The UNet prediction for `x` at `t` under `cond` (SDXL: with `time_ids` `[n, 6]` f32 as
    /// the added conditioning next to `cond.pooled`).
    ///
    /// # Errors
    /// Model errors; [`lora_models::Error::InvalidArgument`] when SDXL inputs are missing.
    pub fn predict(
        &self,
        x: &Tensor,
        t: &Tensor,
        cond: &TextCond,
        time_ids: Option<&Tensor>,
        train: bool,
    ) -> lora_models::Result<Tensor> {
        match (&cond.pooled, time_ids) {
            (Some(p), Some(ids)) => self.unet.forward_t(
                x,
                t,
                &cond.hidden,
                Some((p, &ids.f_to_device(x.device())?)),
                train,
            ),
            (None, None) => self.unet.forward_t(x, t, &cond.hidden, None, train),
            _ => Err(lora_models::Error::InvalidArgument(
                "SDXL needs both the pooled text embedding and the time ids".into(),
            )),
        }
    }

    /// Generates one image per prompt with DDIM or Euler (`opts.steps` steps, classifier-free
    /// guidance against the empty prompt) from seeded noise; `[n, 3, H, W]` f32 in ≈ `[-1, 1]`
    /// on the CPU. SDXL: time ids `(H, W, 0, 0, H, W)` of the sample size, and zeros as the
    /// unconditional embeddings (diffusers' `force_zeros_for_empty_prompt`, set in SDXL base's
    /// `model_index.json`). The global CPU generator is restored afterwards, so sampling during
    /// training does not change the training noise.
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
        // the VAE and text encoders on the UNet's device for this grid (copies of those moved
        // off it, dropped at the end)
        let on = self.on_device(true, true)?;
        let encode = |p: &[&str]| -> lora_models::Result<TextCond> {
            let (ids, ids_2) = self.tokenize(p)?;
            self.condition_with(&on, &ids, ids_2.as_ref(), false)
        };
        let n = prompts.len() as i64;
        let texts: Vec<&str> = prompts.iter().map(AsRef::as_ref).collect();
        let cond = encode(&texts)?;
        let uncond = if self.is_sdxl() {
            TextCond {
                hidden: cond.hidden.f_zeros_like()?,
                pooled: cond.pooled.as_ref().map(Tensor::f_zeros_like).transpose()?,
            }
        } else {
            encode(&vec![""; prompts.len()])?
        };
        let both = TextCond {
            hidden: Tensor::f_cat(&[&uncond.hidden, &cond.hidden], 0)?,
            pooled: match (&uncond.pooled, &cond.pooled) {
                (Some(u), Some(c)) => Some(Tensor::f_cat(&[u, c], 0)?),
                _ => None,
            },
        };
        let time_ids = if self.is_sdxl() {
            let row = sdxl_time_ids(size, (0, 0), size);
            let rows: Vec<f32> = (0..2 * n).flat_map(|_| row).collect();
            Some(
                Tensor::f_from_slice(&rows)?
                    .f_view([2 * n, 6])?
                    .f_to_device(dev)?,
            )
        } else {
            None
        };
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
                let (c, ids) = if guidance_scale > 1.0 {
                    (
                        both.shallow_clone(),
                        time_ids.as_ref().map(Tensor::shallow_clone),
                    )
                } else {
                    (
                        TextCond {
                            hidden: both.hidden.f_narrow(0, n, n)?,
                            pooled: both
                                .pooled
                                .as_ref()
                                .map(|p| p.f_narrow(0, n, n))
                                .transpose()?,
                        },
                        time_ids.as_ref().map(|t| t.f_narrow(0, n, n)).transpose()?,
                    )
                };
                self.predict(x, &ts, &c, ids.as_ref(), false)
            })?;
        let vae = on.vae.as_ref().unwrap_or(&self.vae);
        let img = vae.decode(&vae.unscale_latents(&z)?)?;
        drop(on);
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
        match self.loraplus_lr_ratio {
            Some(r) => crate::engine::optim::lora_plus_groups(self.named_trainable(), r),
            None => vec![crate::engine::optim::ParamGroup::new(
                "adapters",
                self.named.iter().map(|(_, t)| t.shallow_clone()).collect(),
            )],
        }
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

/// The trainer's batch source over an [`ImageDataset`]: the loader's seeded per-epoch plan
/// (batches never mix buckets), each image encoded by the VAE once per (file content, bucket,
/// crop, flip, VAE) and kept in memory (and on disk with a [`LatentCache`]), each caption
/// tokenized and, when the text encoders are frozen, encoded once; SDXL time ids from each
/// sample's original size, crop and bucket. The position (epoch, batch index) is checkpointed.
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
    text: HashMap<String, TextCond>,
    cache_text: bool,
    bucket_batches: std::collections::BTreeMap<(u32, u32), u64>,
    /// VAE encodings done (cache misses).
    pub encoded: Rc<RefCell<u64>>,
}

impl ImageSource {
    /// Wraps a loader; `model_id` names the VAE (and its dtype) in cache keys; `disk` adds an
    /// on-disk cache; `cache_text` caches text-encoder outputs per caption (only valid while
    /// the text encoders are frozen).
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
            bucket_batches: Default::default(),
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
    fn build(&mut self, idx: &[usize], seeds: &[u64]) -> crate::engine::Result<SdBatch> {
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        let mut lats = Vec::with_capacity(idx.len());
        let mut conds = Vec::with_capacity(idx.len());
        let mut caps = Vec::with_capacity(idx.len());
        let mut time_ids = Vec::with_capacity(6 * idx.len());
        for (&i, &s) in idx.iter().zip(seeds) {
            let sample = self.loader.dataset().get_seeded(i, s).map_err(data)?;
            let key: CacheKey = sample.cache_key(&self.model_id).map_err(data)?;
            let (lat, _) = cached_latents(
                &self.pipe,
                &sample.pixels,
                &key,
                &mut self.latents,
                self.disk.as_ref(),
                &mut self.encoded.borrow_mut(),
            )?;
            if self.cache_text {
                conds.push(cached_text(&self.pipe, &sample.caption, &mut self.text)?);
            }
            time_ids.extend(sdxl_time_ids(
                sample.original_size,
                sample.crop,
                sample.bucket,
            ));
            lats.push(lat);
            caps.push(sample.caption);
        }
        let (ids, ids_2) = self.pipe.tokenize(&caps).map_err(model_err)?;
        let time_ids = if self.pipe.is_sdxl() {
            Some(Tensor::f_from_slice(&time_ids)?.f_view([idx.len() as i64, 6])?)
        } else {
            None
        };
        Ok(SdBatch {
            latents: Tensor::f_stack(&lats, 0)?,
            ids,
            ids_2,
            cond: if self.cache_text {
                Some(TextCond::stack(&conds)?)
            } else {
                None
            },
            time_ids,
            captions: caps,
        })
    }

    /// Adds what [`precache`] computed to the in-memory caches (its VAE encodings to
    /// [`Self::encoded`]).
    pub fn preload(&mut self, p: Precached) {
        self.latents.extend(p.latents);
        self.text.extend(p.text);
        *self.encoded.borrow_mut() += p.encoded;
    }

    /// The fixed evaluation set: `n` items spread evenly over the epoch's item list (so
    /// repeats of one image are not picked twice when `n` ≤ the number of images), built with
    /// seed 0 (centred crops, no flips, captions as seed 0 shuffles them), as one batch per
    /// aspect bucket (latents of different buckets differ in shape and cannot be stacked),
    /// buckets in the order their first item appears.
    ///
    /// # Errors
    /// Data / model errors.
    pub fn fixed_batches(&mut self, n: usize) -> crate::engine::Result<Vec<SdBatch>> {
        let ds = self.loader.dataset();
        let len = ds.len();
        let k = n.min(len).max(1);
        let mut groups: Vec<(Option<(u32, u32)>, Vec<usize>)> = Vec::new();
        for i in (0..k).map(|j| j * len / k) {
            let bucket = ds.bucket_of(i);
            match groups.iter_mut().find(|(b, _)| *b == bucket) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((bucket, vec![i])),
            }
        }
        groups
            .into_iter()
            .map(|(_, idx)| self.build(&idx, &vec![0u64; idx.len()]))
            .collect()
    }

    /// Training batches drawn so far in this process, per bucket `(width, height)`, in bucket
    /// order.
    pub fn bucket_batches(&self) -> Vec<((u32, u32), u64)> {
        self.bucket_batches.iter().map(|(b, n)| (*b, *n)).collect()
    }
}

/// The latents of the image `pixels` `[3, H, W]` under `key`: from `mem`, else from the disk
/// cache, else encoded by the VAE (then written to the disk cache, atomically); kept in `mem`.
/// Also says where they came from (`encoded` counts the VAE runs).
fn cached_latents(
    pipe: &SdPipeline,
    pixels: &Tensor,
    key: &CacheKey,
    mem: &mut HashMap<String, Tensor>,
    disk: Option<&LatentCache>,
    encoded: &mut u64,
) -> crate::engine::Result<(Tensor, LatentsFrom)> {
    let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
    let digest = key.digest();
    if let Some(t) = mem.get(&digest) {
        return Ok((t.shallow_clone(), LatentsFrom::Memory));
    }
    let from_disk = match disk {
        Some(c) => c.get(key).map_err(data)?,
        None => None,
    };
    let (t, from) = match from_disk {
        Some(t) => (t, LatentsFrom::Disk),
        None => {
            let t = pipe
                .encode_images(&pixels.f_unsqueeze(0)?)
                .map_err(model_err)?
                .f_squeeze_dim(0)?;
            *encoded += 1;
            if let Some(c) = disk {
                c.put(key, &t).map_err(data)?;
            }
            (t, LatentsFrom::Vae)
        }
    };
    mem.insert(digest, t.shallow_clone());
    Ok((t, from))
}

/// Where [`cached_latents`] found an image's latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LatentsFrom {
    /// Already in memory.
    Memory,
    /// Read from the disk cache.
    Disk,
    /// Encoded by the VAE.
    Vae,
}

/// The text-encoder conditioning of one caption (`hidden` `[77, D]`, SDXL `pooled` `[P]`) from
/// `mem`, else computed and kept there; held on the CPU (a step moves its batch to the device).
fn cached_text(
    pipe: &SdPipeline,
    caption: &str,
    mem: &mut HashMap<String, TextCond>,
) -> crate::engine::Result<TextCond> {
    if let Some(t) = mem.get(caption) {
        return Ok(t.shallow_clone());
    }
    let t = pipe
        .encode_prompts(&[caption])
        .map_err(model_err)?
        .row(0)?
        .to_device(Device::Cpu)?;
    mem.insert(caption.to_string(), t.shallow_clone());
    Ok(t)
}

/// The random augmentations of a dataset's subsets, which decide what can be computed before
/// training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Augmentations {
    /// Some subset crops at random (`random_crop`): latents differ per epoch.
    pub random_crop: bool,
    /// Some subset flips (`flip_aug`): both orientations of an image are cached.
    pub flip: bool,
    /// Some subset changes its captions between epochs (`shuffle_caption`,
    /// `caption_dropout_rate`, `caption_tag_dropout_rate`, `random_caption_line`).
    pub varying_captions: bool,
}

impl Augmentations {
    /// The augmentations of every subset of `dc`.
    pub fn of(dc: &DatasetConfig) -> Self {
        let mut a = Augmentations::default();
        for sub in dc.datasets.iter().flat_map(|d| &d.subsets) {
            a.random_crop |= sub.random_crop;
            a.flip |= sub.flip_aug;
            a.varying_captions |= sub.shuffle_caption
                || sub.caption_dropout_rate > 0.0
                || sub.caption_tag_dropout_rate > 0.0
                || sub.random_caption_line;
        }
        a
    }
}

/// What the SD job computes before training and then moves off the device, as
/// `(latents, text_encoder_outputs)`: with `data.cache_latents: true`, every latent unless
/// crops are random, and the text-encoder outputs of every caption unless the text encoders are
/// trained or the captions change between epochs. The VAE leaves the device when the first is
/// true, the text encoders when the second is (kohya sd-scripts' `cache_latents` /
/// `cache_text_encoder_outputs`).
pub fn precomputed(cfg: &TrainConfig, aug: Augmentations) -> (bool, bool) {
    let cache = cfg.data.cache_latents == Some(true);
    (
        cache && !aug.random_crop,
        cache && !cfg.train.train_text_encoder && !aug.varying_captions,
    )
}

/// Sets the lora-memory settings that say which frozen models the SD job keeps on the device
/// during the training steps: `cache_latents` / `cache_text_encoder_outputs` as
/// [`precomputed`] says, `random_crop` / `varying_captions` from the dataset's subsets
/// (`aug`), and `keep_models_loaded` on a CPU run (`cuda` false), where moving them to the CPU
/// keeps them in the same memory.
pub fn frozen_model_settings(
    s: &mut lora_memory::Settings,
    cfg: &TrainConfig,
    aug: Augmentations,
    cuda: bool,
) {
    let cache = cfg.data.cache_latents == Some(true);
    s.cache_latents = cache;
    s.cache_text_encoder_outputs = cache && !cfg.train.train_text_encoder;
    s.random_crop = aug.random_crop;
    s.varying_captions = aug.varying_captions;
    s.keep_models_loaded = !cuda;
}

/// The augmentations of the dataset `cfg` names (`data.train_data_dir`, relative paths against
/// `config_dir`); the config's own `data.shuffle_caption` when the dataset cannot be read.
pub fn augmentations_of(cfg: &TrainConfig, config_dir: Option<&Path>) -> Augmentations {
    let read = || -> Option<Augmentations> {
        let written = cfg.data.train_data_dir.as_deref()?;
        let path = resolve_path("data.train_data_dir", written, config_dir).ok()?;
        Some(Augmentations::of(&dataset_config(cfg, &path).ok()?))
    };
    read().unwrap_or(Augmentations {
        varying_captions: cfg.data.shuffle_caption == Some(true),
        ..Augmentations::default()
    })
}

/// Latents and text-encoder outputs computed before training by [`precache`].
#[derive(Debug, Default)]
pub struct Precached {
    /// Latents by [`CacheKey::digest`] (f32, CPU).
    pub latents: HashMap<String, Tensor>,
    /// Conditioning by caption (CPU).
    pub text: HashMap<String, TextCond>,
    /// VAE encodings done (the rest came from the disk cache).
    pub encoded: u64,
}

/// Encodes, before training, the latents of every item of `ds` (`latents`; both orientations
/// when a subset flips, which needs crops that are not random) and the text-encoder outputs of
/// every caption (`text`; captions that do not change between epochs), reading and writing the
/// disk cache `disk` as training would. Between images it checks
/// [`crate::engine::stop_requested`] and returns `None` when a stop was asked for: what was
/// encoded so far stays on disk as complete entries (each written atomically), nothing is
/// marked as done, and a rerun encodes the rest. `progress` gets a line now and then (count /
/// total).
///
/// # Errors
/// Data, model and cache errors.
pub fn precache(
    pipe: &SdPipeline,
    ds: &ImageDataset,
    model_id: &str,
    disk: Option<&LatentCache>,
    (latents, text): (bool, bool),
    progress: &dyn Fn(&str),
) -> crate::engine::Result<Option<Precached>> {
    let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
    let mut out = Precached::default();
    if !latents && !text {
        return Ok(Some(out));
    }
    let flip = latents && Augmentations::of(ds.config()).flip;
    let total = ds.len();
    let what = match (latents, text) {
        (true, true) => "latents and text-encoder outputs",
        (true, false) => "latents",
        _ => "text-encoder outputs",
    };
    let started = std::time::Instant::now();
    let mut last = started;
    let mut from_disk = 0u64;
    for i in 0..total {
        if crate::engine::stop_requested() {
            progress(&format!(
                "caching {what}: stopped at {i}/{total} items ({} encoded, {from_disk} from disk); the cache holds only complete entries, a rerun encodes the rest",
                out.encoded
            ));
            return Ok(None);
        }
        if i == 0 || last.elapsed().as_secs_f64() >= 2.0 {
            last = std::time::Instant::now();
            progress(&format!(
                "caching {what}: {i}/{total} items ({} encoded, {from_disk} from disk, {} captions)",
                out.encoded,
                out.text.len()
            ));
        }
        // seed 0: centred crop (no random crop here), the caption as every epoch has it
        let sample = ds.get_seeded(i, 0).map_err(data)?;
        if latents {
            let key = sample.cache_key(model_id).map_err(data)?;
            let (_, from) = cached_latents(
                pipe,
                &sample.pixels,
                &key,
                &mut out.latents,
                disk,
                &mut out.encoded,
            )?;
            from_disk += u64::from(from == LatentsFrom::Disk);
            if flip {
                // the other orientation: lora-data flips the cropped image, a pure permutation
                let key = CacheKey {
                    flip: !key.flip,
                    ..key
                };
                let mirrored = sample.pixels.f_flip([2])?;
                let (_, from) = cached_latents(
                    pipe,
                    &mirrored,
                    &key,
                    &mut out.latents,
                    disk,
                    &mut out.encoded,
                )?;
                from_disk += u64::from(from == LatentsFrom::Disk);
            }
        }
        if text {
            cached_text(pipe, &sample.caption, &mut out.text)?;
        }
    }
    progress(&format!(
        "caching {what}: {total}/{total} items in {:.1} s ({} latents, {} encoded; {} captions)",
        started.elapsed().as_secs_f64(),
        out.latents.len(),
        out.encoded,
        out.text.len()
    ));
    Ok(Some(out))
}

impl BatchSource<SdBatch> for ImageSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::engine::Result<()> {
        self.plan = self.loader.plan(epoch);
        self.epoch = epoch;
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::engine::Result<Option<SdBatch>> {
        let Some(idx) = self.plan.get(self.next).cloned() else {
            return Ok(None);
        };
        self.next += 1;
        if let Some(b) = idx
            .first()
            .and_then(|&i| self.loader.dataset().bucket_of(i))
        {
            *self.bucket_batches.entry(b).or_default() += 1;
        }
        let seeds: Vec<u64> = idx.iter().map(|&i| self.item_seed(i)).collect();
        self.build(&idx, &seeds).map(Some)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "next": self.next, "items": self.loader.dataset().len()})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::engine::Result<()> {
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

/// The Stable Diffusion generation a pipeline belongs to (kohya's `ss_base_model_version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SdVersion {
    /// SD 1.x (cross-attention 768).
    V1,
    /// SD 2.x (cross-attention 1024, OpenCLIP-H).
    V2,
    /// SDXL (two text encoders, `text_time` added conditioning).
    Xl,
}

impl SdVersion {
    /// The version of `pipe`: SDXL with a second text encoder, else SD 2.x when the UNet's
    /// cross-attention width is 1024, else SD 1.x.
    pub fn of(pipe: &SdPipeline) -> Self {
        if pipe.is_sdxl() {
            SdVersion::Xl
        } else if pipe.unet.plan().cross_attention_dim.first() == Some(&1024) {
            SdVersion::V2
        } else {
            SdVersion::V1
        }
    }

    /// sd-scripts' `ss_base_model_version` (`sd_v1`, `sd_v2`, `sdxl_base_v1-0`).
    pub fn kohya_name(self) -> &'static str {
        match self {
            SdVersion::V1 => "sd_v1",
            SdVersion::V2 => "sd_v2",
            SdVersion::Xl => "sdxl_base_v1-0",
        }
    }
}

/// kohya metadata of an SD adapter on top of `base`: `ss_base_model_version` (as sd-scripts
/// writes it, see [`SdVersion::kohya_name`]), `ss_v2`, `ss_network_train_unet_only`.
pub fn sd_metadata(
    mut base: std::collections::BTreeMap<String, String>,
    version: SdVersion,
    unet_only: bool,
) -> std::collections::BTreeMap<String, String> {
    let py_bool = |b: bool| if b { "True" } else { "False" };
    base.insert("ss_base_model_version".into(), version.kohya_name().into());
    base.insert("ss_v2".into(), py_bool(version == SdVersion::V2).into());
    base.insert(
        "ss_network_train_unet_only".into(),
        py_bool(unet_only).into(),
    );
    base
}

/// The adapters of a pipeline by component (`unet`, and `text_encoder` / `text_encoder_2`
/// when they carry the adapter).
///
/// # Errors
/// [`lora_core::Error::Adapter`] when the UNet lacks the adapter.
fn pipeline_weights(
    pipe: &mut SdPipeline,
    adapter_name: &str,
) -> lora_core::Result<Vec<(&'static str, AdapterWeights)>> {
    let optional = |r: lora_core::Result<AdapterWeights>| match r {
        Ok(w) => Ok(Some(w)),
        Err(lora_core::Error::Adapter { .. }) => Ok(None),
        Err(e) => Err(e),
    };
    let mut parts = vec![(
        "unet",
        AdapterWeights::from_model(&mut pipe.unet, adapter_name)?,
    )];
    if let Some(w) = optional(AdapterWeights::from_model(
        &mut pipe.text_encoder,
        adapter_name,
    ))? {
        parts.push(("text_encoder", w));
    }
    if let Some(te2) = pipe.text_encoder_2.as_mut()
        && let Some(w) = optional(AdapterWeights::from_model(te2, adapter_name))?
    {
        parts.push(("text_encoder_2", w));
    }
    Ok(parts)
}

/// The kohya prefix of a pipeline component: `lora_unet`; the text encoder `lora_te` (SD
/// 1.x/2.x) or `lora_te1` (SDXL); `lora_te2` (SDXL's `text_encoder_2`) — sd-scripts
/// `networks/lora.py` `LORA_PREFIX_UNET`, `LORA_PREFIX_TEXT_ENCODER{,1,2}`.
pub fn kohya_prefix(component: &str, sdxl: bool) -> &'static str {
    match (component, sdxl) {
        ("unet", _) => KOHYA_UNET_PREFIX,
        ("text_encoder", false) => KOHYA_TE_PREFIX,
        ("text_encoder", true) => KOHYA_TE1_PREFIX,
        _ => KOHYA_TE2_PREFIX,
    }
}

/// Writes adapter `adapter_name` of `pipe` as one kohya file at `path`: UNet modules under
/// `lora_unet_` (diffusers module names, which diffusers, ComfyUI and A1111/Forge map), text
/// encoder modules (when trained) under `lora_te_` — SDXL: `lora_te1_` / `lora_te2_` — (see
/// [`kohya_prefix`]), f32 `.alpha`, `metadata` in the header.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_kohya(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    metadata: std::collections::BTreeMap<String, String>,
    path: &Path,
) -> lora_core::Result<()> {
    let sdxl = pipe.is_sdxl();
    let mut parts = pipeline_weights(pipe, adapter_name)?;
    if let Some((_, unet)) = parts.first_mut() {
        unet.metadata = metadata;
    }
    let refs: Vec<(&str, &AdapterWeights)> = parts
        .iter()
        .map(|(c, w)| (kohya_prefix(c, sdxl), w))
        .collect();
    lora_core::formats::kohya::write(path, &refs)
}

/// Writes adapter `adapter_name` of `pipe` as diffusers' `pytorch_lora_weights.safetensors`
/// into `dir` (`unet.…`, and `text_encoder.…` / `text_encoder_2.…` when the text encoders were
/// trained; the file `StableDiffusion[XL]Pipeline.load_lora_weights(dir)` reads). Returns the
/// file.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_diffusers(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    dir: &Path,
) -> lora_core::Result<PathBuf> {
    let parts = pipeline_weights(pipe, adapter_name)?;
    std::fs::create_dir_all(dir).map_err(|e| lora_core::Error::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let path = dir.join(lora_core::formats::diffusers::WEIGHTS_FILE);
    let refs: Vec<(&str, &AdapterWeights)> = parts.iter().map(|(c, w)| (*c, w)).collect();
    lora_core::formats::diffusers::write(&path, &refs)?;
    Ok(path)
}

/// How many modules [`load_adapter`] put on each component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoadedAdapter {
    /// UNet modules.
    pub unet_modules: usize,
    /// Text-encoder modules (SDXL: the first encoder's).
    pub text_encoder_modules: usize,
    /// SDXL `text_encoder_2` modules.
    pub text_encoder_2_modules: usize,
}

fn site_list(model: &mut dyn lora_core::inject::Adaptable) -> lora_core::Result<Vec<String>> {
    let mut sites = Vec::new();
    model.visit_sites(&mut |p, _| {
        sites.push(p.to_string());
        Ok(())
    })?;
    Ok(sites)
}

/// The module path of UNet site `site` (diffusers name) in the original (CompVis / Stability
/// `sgm`) UNet, which sd-scripts' SDXL LoRA names its `lora_unet_` modules after
/// (`down_blocks.1.attentions.0.proj_in` → `input_blocks.4.1.proj_in`, `…resnets.0.conv1` →
/// `…in_layers.2`); lora-models' [`ldm_unet_key`] layout. `None` for sites without one.
///
/// [`ldm_unet_key`]: lora_models::sd::load::ldm_unet_key
pub fn original_unet_module(site: &str, unet: &UNet2DConditionModel) -> Option<String> {
    let plan = unet.plan();
    let layout = lora_models::sd::load::UnetLayout {
        layers_per_block: usize::try_from(*plan.layers.first()?).ok()?,
        down_attn: plan.down_attn.clone(),
        up_attn: plan.up_attn.clone(),
    };
    let key = lora_models::sd::load::ldm_unet_key(&format!("{site}.weight"), &layout)?;
    key.strip_prefix(lora_models::sd::load::LDM_UNET_PREFIX)?
        .strip_suffix(".weight")
        .map(String::from)
}

/// Loads an SD 1.x/2.x or SDXL LoRA file into `pipe` as adapter `adapter_name` (tensors in
/// `vs`), told apart by the keys:
/// - kohya: `lora_unet_…` with diffusers module names or, as sd-scripts writes SDXL adapters,
///   original ones (`lora_unet_input_blocks_4_1_…`, see [`original_unet_module`]); `lora_te_…`
///   (SD 1.x/2.x) or `lora_te1_…` / `lora_te2_…` (SDXL); alpha honoured, missing = rank;
/// - diffusers / PEFT for diffusers: `unet.<module>.lora_A.weight`, `text_encoder.<module>…`,
///   `text_encoder_2.<module>…` (transformers 5 text-encoder names without `text_model.` are
///   accepted).
///
/// # Errors
/// lora-core format errors naming the file and the modules that match no site; an error for
/// text-encoder prefixes or components the pipeline does not have (SDXL adapters on SD 1.x and
/// the reverse).
pub fn load_adapter(
    pipe: &mut SdPipeline,
    path: &Path,
    adapter_name: &str,
    vs: &tch::nn::Path,
) -> lora_core::Result<LoadedAdapter> {
    let sdxl = pipe.is_sdxl();
    let header = lora_core::formats::read_header(path)?;
    let kohya = header.tensors.keys().any(|k| {
        ["lora_unet_", "lora_te_", "lora_te1_", "lora_te2_"]
            .iter()
            .any(|p| k.starts_with(p))
    });
    let fmt_err = |reason: String| lora_core::Error::Format {
        file: path.to_path_buf(),
        reason,
    };
    let what = if sdxl {
        "an SDXL pipeline has lora_unet_, lora_te1_ and lora_te2_"
    } else {
        "an SD 1.x/2.x pipeline has lora_unet_ and lora_te_ (lora_te1_/lora_te2_ are SDXL's)"
    };
    let (unet, mut te, mut te2) = if kohya {
        let mut f = lora_core::formats::kohya::read(path)?;
        let unet_sites = site_list(&mut pipe.unet)?;
        // sd-scripts' SDXL names: original UNet module paths
        for site in &unet_sites {
            if let Some(orig) = original_unet_module(site, &pipe.unet) {
                let from = lora_core::formats::kohya::kohya_name(KOHYA_UNET_PREFIX, &orig);
                if let Some(m) = f.modules.remove(&from) {
                    f.modules.insert(
                        lora_core::formats::kohya::kohya_name(KOHYA_UNET_PREFIX, site),
                        m,
                    );
                }
            }
        }
        let unet = f.take_prefix(KOHYA_UNET_PREFIX, &unet_sites)?;
        let te = f.take_prefix(
            kohya_prefix("text_encoder", sdxl),
            &site_list(&mut pipe.text_encoder)?,
        )?;
        let te2 = match pipe.text_encoder_2.as_mut() {
            Some(m) => f.take_prefix(KOHYA_TE2_PREFIX, &site_list(m)?)?,
            None => AdapterWeights::default(),
        };
        if let Some(k) = f.modules.keys().next() {
            return Err(fmt_err(format!(
                "module {k:?} belongs to no component of this pipeline: {what}"
            )));
        }
        (unet, te, te2)
    } else {
        let mut parts = lora_core::formats::diffusers::read(path)?;
        let unet = parts.remove("unet").unwrap_or_default();
        let te = parts.remove("text_encoder").unwrap_or_default();
        let te2 = if sdxl {
            parts.remove("text_encoder_2").unwrap_or_default()
        } else {
            AdapterWeights::default()
        };
        if let Some(k) = parts.keys().next() {
            return Err(fmt_err(format!(
                "component {k:?}: {}",
                if sdxl {
                    "an SDXL pipeline has `unet`, `text_encoder` and `text_encoder_2`"
                } else {
                    "an SD 1.x/2.x pipeline has `unet` and `text_encoder`"
                }
            )));
        }
        (unet, te, te2)
    };
    lora_models::clip::canonicalize_adapter(&mut te);
    lora_models::clip::canonicalize_adapter(&mut te2);
    let mut n = LoadedAdapter {
        unet_modules: unet.modules.len(),
        text_encoder_modules: te.modules.len(),
        text_encoder_2_modules: te2.modules.len(),
    };
    if n.unet_modules + n.text_encoder_modules + n.text_encoder_2_modules == 0 {
        return Err(fmt_err("no LoRA module in the file".into()));
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
    if n.text_encoder_2_modules > 0
        && let Some(m) = pipe.text_encoder_2.as_mut()
    {
        n.text_encoder_2_modules = te2
            .load_into(m, adapter_name, &(vs / "text_encoder_2"), 0.0)?
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

fn dataset_config(cfg: &TrainConfig, data_path: &Path) -> Result<DatasetConfig> {
    let lower = data_path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".toml") {
        return DatasetConfig::from_toml_file(data_path)
            .during(format!("reading {}", data_path.display()));
    }
    let d = &cfg.data;
    let mut set = lora_data::image::config::ImageSetConfig {
        bucket: crate::sd_plan::bucket_config(cfg),
        ..Default::default()
    };
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
        .during(format!("listing {}", data_path.display()))?;
    if dc.datasets.iter().all(|s| s.subsets.is_empty()) {
        // a plain folder of images: one subset, one repeat
        return Ok(DatasetConfig {
            datasets: vec![set],
        });
    }
    Ok(dc)
}

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
    mut cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn crate::engine::Callback>>,
) -> Result<SdRunSummary> {
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

    // the checks `lora-train plan` makes (resolution, target_modules, model.kind, a single
    // file's tokenizer), before anything loads or is written
    let desc = crate::sd_plan::descriptor_of_path(&base_path, &base_written).ok();
    crate::sd_plan::check_sd_config(
        &cfg,
        Some(&base_path),
        desc.as_ref(),
        opts.config_dir.as_deref(),
    )?;
    let mut lock = crate::job::check_output_dir(&cfg, opts)?;
    // plan
    let plan = match sd_plan(&cfg, &base_path, cuda) {
        Ok(p) => {
            p.apply_to(&mut cfg);
            if opts.verbose {
                print!("{}", p.report());
            }
            if p.fits == Some(false) && !(opts.force || cfg.memory.force) {
                let b = p
                    .budget
                    .clone()
                    .map(|b| (b.bytes, crate::job::budget_source(&b)));
                if let Some((bytes, src)) = b {
                    return Err(JobError::DoesNotFit {
                        peak: p.estimate.peak,
                        budget: bytes,
                        source_desc: src,
                    });
                }
            }
            crate::job::check_fits_this_machine(&p, cuda, opts.force || cfg.memory.force)?;
            Some(p)
        }
        Err(e) => {
            say(&format!("memory plan unavailable: {e}"));
            None
        }
    };

    // CPU: freed tensors go back to the OS so RSS follows the plan (as in the LLM job).
    if !cuda
        && cfg.memory.cpu_return_freed
        && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && lora_core::sys::set_malloc_mmap_threshold(lora_core::sys::RETURN_FREED_MMAP_THRESHOLD)
    {
        say("CPU allocator: blocks ≥ 128 KiB are returned to the OS when freed");
    }

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
    let mut pipe = if base_path.is_file() {
        let companion = match &cfg.model.tokenizer {
            Some(t) => Some(resolve_path(
                "model.tokenizer",
                t,
                opts.config_dir.as_deref(),
            )?),
            None => None,
        };
        SdPipeline::from_single_file(&base_path, companion.as_deref(), kind, device)?
    } else {
        SdPipeline::from_diffusers(&base_path, kind, device)?
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
    // an unset target list means the UNet's attention projections here
    let unet_targets = if cfg.lora.target_modules == crate::config::default_target_modules() {
        TargetModules::list(&DEFAULT_UNET_TARGETS)
    } else {
        cfg.lora.target_modules.clone()
    };
    let lcfg = cfg.lora.to_lora_config(unet_targets, &base_written, None);
    // the text encoders: CLIP's attention projections, with no per-module patterns (they name
    // UNet modules)
    let te_cfg = lora_core::config::LoraConfig {
        target_modules: Some(TargetModules::list(&TEXT_ENCODER_TARGETS)),
        exclude_modules: None,
        rank_pattern: Default::default(),
        alpha_pattern: Default::default(),
        ..lcfg.clone()
    };
    let vs = tch::nn::VarStore::new(device);
    let report = lora_core::inject::inject(&mut pipe.unet, &lcfg, "default", &vs.root())
        .during("injecting LoRA into the UNet")?;
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
        let r = lora_core::inject::inject(
            &mut pipe.text_encoder,
            &te_cfg,
            "default",
            &(vs.root() / "text_encoder"),
        )
        .during("injecting LoRA into the text encoder")?;
        say(&format!(
            "LoRA on {} text-encoder modules: {} trainable parameters",
            r.modules.len(),
            r.trainable_params
        ));
        if let Some(te2) = pipe.text_encoder_2.as_mut() {
            let r =
                lora_core::inject::inject(te2, &te_cfg, "default", &(vs.root() / "text_encoder_2"))
                    .during("injecting LoRA into text_encoder_2")?;
            say(&format!(
                "LoRA on {} text_encoder_2 modules: {} trainable parameters",
                r.modules.len(),
                r.trainable_params
            ));
        }
    }
    let interrupted = || JobError::Interrupted {
        step: 0,
        checkpoint: None,
    };
    if crate::engine::stop_requested() {
        return Err(interrupted());
    }

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
    let policy = match cfg.data.bad_images {
        crate::config::BadImages::Skip => lora_data::validate::Policy::Skip,
        crate::config::BadImages::Stop => lora_data::validate::Policy::Fail,
    };
    let ds = ImageDataset::new(dcfg, policy).map_err(|e| match e {
        // unusable images (with `stop`) or none usable at all: the user's data, exit 2
        lora_data::Error::Invalid { .. } => JobError::Input(format!(
            "data.train_data_dir {}: {e}\nfix or remove those files{}",
            data_path.display(),
            if cfg.data.bad_images == crate::config::BadImages::Stop {
                ", or set data.bad_images: skip to train without them"
            } else {
                ""
            }
        )),
        other => JobError::Data {
            during: format!("scanning {}", data_path.display()),
            source: other,
        },
    })?;
    let images = ds.num_images();
    let items = ds.len();
    say(&format!(
        "data: {images} images, {items} items per epoch\n{}",
        ds.bucket_report()
    ));
    // name every file left out or without a caption (the Display of a problem gives the path,
    // what is wrong and what to do)
    for p in ds.problems() {
        eprintln!("warning: {p}");
    }
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
        .during("building the image loader")?;
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
    std::fs::create_dir_all(&out_dir).during(format!("creating {}", out_dir.display()))?;
    let disk = if cfg.data.cache_latents == Some(true) {
        Some(LatentCache::new(out_dir.join("latent_cache")).during("opening the latent cache")?)
    } else {
        None
    };
    // the VAE (its file or folder) and the dtype it encodes in name the cached latents
    let model_id = format!(
        "vae:{}:{kind:?}",
        std::fs::canonicalize(&base_path)
            .unwrap_or_else(|_| base_path.clone())
            .display()
    );
    // Cache before training what can be (kohya's cache_latents / cache_text_encoder_outputs),
    // then move the VAE and the frozen text encoders off the device: they come back only to
    // draw sample images.
    let aug = Augmentations::of(loader.dataset().config());
    let (pre_latents, pre_text) = precomputed(&cfg, aug);
    if cfg.data.cache_latents == Some(true) {
        if aug.random_crop {
            say(
                "random_crop: latents are encoded as the crops are drawn; the VAE stays on the device",
            );
        }
        if !train_te && aug.varying_captions {
            say(
                "captions change between epochs (shuffle_caption, caption or tag dropout, random caption lines): text-encoder outputs are cached as they come; the text encoders stay on the device",
            );
        }
    }
    let precached = precache(
        &pipe,
        loader.dataset(),
        &model_id,
        disk.as_ref(),
        (pre_latents, pre_text),
        &say,
    )
    .during("caching before training")?;
    let Some(precached) = precached else {
        return Err(interrupted());
    };
    if pre_latents || pre_text {
        let moved = pipe.move_frozen(Device::Cpu, pre_latents, pre_text)?;
        let (which, verb) = match (pre_latents, pre_text) {
            (true, true) => ("the VAE and the text encoders", "stay"),
            (true, false) => ("the VAE", "stays"),
            _ => ("the text encoders", "stay"),
        };
        if moved.is_empty() {
            say(&format!(
                "{which} {verb} in memory (a CPU run: the device is the CPU)"
            ));
        } else {
            say(&format!(
                "moved {} to the CPU until sample images are drawn",
                moved.join(", ")
            ));
        }
    }
    let pipe = Rc::new(pipe);
    let mut source = ImageSource::new(
        pipe.clone(),
        loader,
        cfg.system.seed,
        model_id,
        disk,
        !train_te,
    );
    source.preload(precached);
    let encoded = source.encoded.clone();

    // the objective
    let loss_cfg = LossConfig {
        noise_offset: cfg.train.noise_offset,
        min_snr_gamma: cfg.train.min_snr_gamma,
        ..LossConfig::default()
    };
    let schedule = NoiseSchedule::new(pipe.schedule.clone()).during("the noise schedule")?;
    let objective = DiffusionLoss::new(schedule, loss_cfg).during("the diffusion loss")?;

    // before
    let eval_batches = source.fixed_batches(8).during("the evaluation batches")?;
    let eval_seed = cfg.system.seed ^ 0x5eed;
    let eval_loss_before =
        fixed_eval_loss(&pipe, &objective, &eval_batches, &EVAL_TIMESTEPS, eval_seed)
            .during("evaluating before training")?;
    say(&format!("fixed-noise loss before: {eval_loss_before:.5}"));
    if crate::engine::stop_requested() {
        return Err(interrupted());
    }

    // train
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut task = SdTask {
        pipe: pipe.clone(),
        objective,
        named,
        loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
    };
    let tcfg = crate::job::trainer_config(&cfg, device, &out_dir, total_steps)?;
    let mut trainer: crate::engine::Trainer<SdTask> = crate::engine::Trainer::new(tcfg);
    #[cfg(feature = "progress")]
    if cfg.logging.progress && opts.verbose {
        trainer.add_callback(Box::new(
            crate::engine::progress::ProgressBar::new().every(cfg.logging.log_every_n_steps),
        ));
    }
    // a previous run in this folder: its files go aside now that this run really starts
    lock.set_aside_previous_run()?;
    let log_dir = cfg
        .logging
        .logging_dir
        .clone()
        .map(PathBuf::from)
        .unwrap_or_else(|| out_dir.join("logs"));
    trainer.add_callback(Box::new(
        crate::engine::metrics::MetricsLogger::new(&log_dir, cfg.logging.tensorboard)
            .during("the metrics log")?
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
    for cb in callbacks {
        trainer.add_callback(cb);
    }
    let resume = match &opts.resume {
        None => crate::engine::Resume::No,
        Some(None) => crate::engine::Resume::Latest,
        Some(Some(dir)) => crate::engine::Resume::From(dir.clone()),
    };
    let (rss_before_steps, hwm_process) = crate::job::proc_rss();
    let _ = crate::job::reset_peak_rss();
    let _ = lora_core::sys::cpu_reset_peak();
    let t_train = std::time::Instant::now();
    let rep = trainer
        .fit(&mut task, &mut source, resume)
        .during("training")?;
    let train_seconds = t_train.elapsed().as_secs_f64();
    let (_, hwm_steps) = crate::job::proc_rss();
    let memory = crate::job::MeasuredMemory {
        rss_before_steps,
        rss_peak_steps: hwm_steps,
        rss_step_delta: hwm_steps.saturating_sub(rss_before_steps),
        tensor_peak: lora_core::sys::cpu_mem_stats()
            .map(|s| s.peak_bytes)
            .unwrap_or(0),
        rss_peak_process: hwm_process.max(hwm_steps),
    };
    drop(trainer);
    if rep.interrupted || crate::engine::stop_requested() {
        // Ctrl-C: the trainer saved a checkpoint; no evaluation, samples or export of a
        // half-trained adapter (the CLI prints how to resume).
        return Err(JobError::Interrupted {
            step: rep.steps,
            checkpoint: rep.last_checkpoint.clone(),
        });
    }
    if let Some(from) = rep.resumed_from {
        say(&format!("resumed at step {from}"));
    }

    // after
    let eval_loss_after = fixed_eval_loss(
        &pipe,
        &task.objective,
        &eval_batches,
        &EVAL_TIMESTEPS,
        eval_seed,
    )
    .during("evaluating after training")?;
    if crate::engine::stop_requested() {
        return Err(JobError::Interrupted {
            step: rep.steps,
            checkpoint: rep.last_checkpoint.clone(),
        });
    }
    say(&format!(
        "fixed-noise loss: {eval_loss_before:.5} → {eval_loss_after:.5}"
    ));
    crate::job::check_not_diverged(&rep, "fixed-noise loss", Some(eval_loss_after))?;
    if !prompts.is_empty()
        && !written
            .borrow()
            .iter()
            .any(|p| p.ends_with(format!("step-{}.png", rep.steps)))
    {
        let p = final_sampler
            .write(rep.steps)
            .map_err(crate::engine::TrainError::App)
            .during("writing the final sample grid")?;
        written.borrow_mut().push(p);
    }
    let samples = written.borrow().clone();
    let bucket_batches = source.bucket_batches();
    drop(final_sampler);
    drop(task);
    drop(source);

    // export
    let mut pipe = Rc::try_unwrap(pipe)
        .map_err(|_| JobError::Internal("the pipeline is still shared after training"))?;
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
    let meta = sd_metadata(meta, SdVersion::of(&pipe), !train_te);
    let kept = crate::job::run::ExportAside::take(&cfg, opts)?;
    let mut outputs = Vec::new();
    for f in &cfg.train.export_formats {
        match f {
            ExportFormat::Kohya => {
                let p = out_dir.join(format!("{}.safetensors", cfg.train.output_name));
                write_kohya(&mut pipe, "default", meta.clone(), &p)
                    .during("writing the kohya adapter")?;
                outputs.push(p);
            }
            ExportFormat::Peft => {
                let p =
                    write_diffusers(&mut pipe, "default", &out_dir.join(&cfg.train.output_name))
                        .during("writing the diffusers adapter")?;
                outputs.push(p);
            }
        }
    }
    kept.exported();
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
        bucket_batches,
        outputs,
    };
    let text = serde_json::to_string_pretty(&summary).during("serializing the summary")?;
    std::fs::write(&summary_path, text).during(format!("writing {}", summary_path.display()))?;
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
                .with_target_modules(&DEFAULT_UNET_TARGETS)
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
