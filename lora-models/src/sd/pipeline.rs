//! The Stable Diffusion pipeline: UNet, VAE, CLIP text encoder(s), tokenizer(s) and noise
//! schedule of an SD 1.x/2.x or SDXL model, loaded from a diffusers folder or an original
//! single-file checkpoint; text conditioning (SDXL's two encoders and micro-conditioning),
//! latents, and sample images with DDIM or Euler.
//!
//! - **SDXL**: two text encoders (CLIP ViT-L `text_encoder`, OpenCLIP bigG `text_encoder_2` with
//!   projection); the UNet is conditioned on the penultimate hidden states of both, without the
//!   final LayerNorm, concatenated on the feature axis (`[n, 77, 2048]`), and — through its
//!   `text_time` added embedding — on `text_encoder_2`'s projected pooled output and the six
//!   time ids of each sample ([`sdxl_time_ids`]), as diffusers' `StableDiffusionXLPipeline` and
//!   kohya sd-scripts' `sdxl_train_network.py` do.
//! - **Memory**: the frozen VAE and text encoders can leave the device
//!   ([`SdPipeline::move_frozen`]) and come back for a call.

use crate::clip::{ClipTextModel, ClipTextModelWithProjection, ClipTokenizer};
use crate::diffusion::{
    DdimOptions, DdimSampler, EulerOptions, EulerSampler, NoiseSchedule, Sampler, ScheduleConfig,
};
use crate::error::{Error, Result};
use crate::sd::{AutoencoderKL, LoadOptions, UNet2DConditionModel};
use serde::Serialize;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// Adds what was being done to a lower error ([`Error::Context`]).
trait During<T> {
    fn during(self, what: impl Into<String>) -> Result<T>;
}

impl<T, E: Into<Error>> During<T> for std::result::Result<T, E> {
    fn during(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            during: what.into(),
            source: Box::new(e.into()),
        })
    }
}

/// The folder a single-file checkpoint takes its tokenizer (and component configs) from:
/// `tokenizer` (`model.tokenizer`, resolved) when given, else the file's own folder when it has
/// a `tokenizer/`. The tokenizer is read from its `tokenizer/` folder when there is one, else
/// from the folder itself, and must be `tokenizer.json` or `vocab.json` + `merges.txt` there.
/// `sdxl` only shapes the message. Used by [`SdPipeline::from_single_file`] and, before anything
/// loads, by lora-train's plan (where `tokenizer` is the config's `model.tokenizer`, the name the
/// message uses).
///
/// # Errors
/// [`Error::Unusable`] naming the file and what to set `model.tokenizer` to.
pub fn single_file_companion(path: &Path, tokenizer: Option<&Path>, sdxl: bool) -> Result<PathBuf> {
    let what = format!(
        "a CLIP tokenizer folder (vocab.json + merges.txt or tokenizer.json) or a diffusers {} folder (its tokenizer/{} and configs are used)",
        if sdxl { "SDXL" } else { "SD 1.5" },
        if sdxl { ", tokenizer_2/" } else { "" }
    );
    let Some(comp) = tokenizer.map(Path::to_path_buf).or_else(|| {
        path.parent()
            .filter(|d| d.join("tokenizer").is_dir())
            .map(Path::to_path_buf)
    }) else {
        return Err(Error::Unusable {
            what: path.display().to_string(),
            reason: format!(
                "a single-file checkpoint holds no tokenizer: set model.tokenizer to {what}"
            ),
        });
    };
    // the loader reads `<comp>/tokenizer` when it is a folder, else `<comp>` itself
    let tok_dir = if comp.join("tokenizer").is_dir() {
        comp.join("tokenizer")
    } else {
        comp.clone()
    };
    let holds_tokenizer = tok_dir.join("tokenizer.json").is_file()
        || (tok_dir.join("vocab.json").is_file() && tok_dir.join("merges.txt").is_file());
    if !holds_tokenizer {
        return Err(Error::Unusable {
            what: path.display().to_string(),
            reason: format!(
                "no tokenizer.json or vocab.json + merges.txt in {} ({}); set model.tokenizer to {what}",
                tok_dir.display(),
                if tokenizer.is_some() {
                    "model.tokenizer"
                } else {
                    "the file's folder, as model.tokenizer is not set"
                }
            ),
        });
    }
    Ok(comp)
}

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

    /// The same conditioning on device `d`.
    ///
    /// # Errors
    /// libtorch errors.
    pub fn to_device(&self, d: Device) -> std::result::Result<Self, tch::TchError> {
        Ok(TextCond {
            hidden: self.hidden.f_to_device(d)?,
            pooled: self.pooled.as_ref().map(|p| p.f_to_device(d)).transpose()?,
        })
    }

    /// Stacks per-sample conditionings (`hidden` `[77, D]`, `pooled` `[P]`) into a batch.
    pub fn stack(items: &[TextCond]) -> std::result::Result<Self, tch::TchError> {
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
    pub fn row(&self, i: i64) -> std::result::Result<Self, tch::TchError> {
        Ok(TextCond {
            hidden: self.hidden.f_select(0, i)?,
            pooled: self.pooled.as_ref().map(|p| p.f_select(0, i)).transpose()?,
        })
    }

    /// The batch split into `n` chunks along the batch axis.
    ///
    /// # Errors
    /// libtorch errors.
    pub fn chunk(&self, n: i64) -> std::result::Result<Vec<Self>, tch::TchError> {
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
/// given as `(width, height)` and the crop as `(x, y)` (lora-data's `ImageSample` convention:
/// the original size before resizing, the top-left of the bucket crop in the resized image, the
/// bucket).
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
    Err(Error::Unusable {
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
    /// [`Error::Context`] naming the component, with the loader's error as the source;
    /// [`Error::Unusable`] for a UNet this pipeline does not run.
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
    /// [`Error::Unusable`]: no UNet in the file, an SD 2.x file (OpenCLIP-H text encoder, not
    /// read here: convert it with diffusers), no tokenizer (naming `model.tokenizer`), and the
    /// loaders' errors naming the component.
    pub fn from_single_file(
        path: &Path,
        companion: Option<&Path>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        use crate::sd::load as ld;
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
            return Err(Error::Unusable {
                what: path.display().to_string(),
                reason: format!(
                    "no `model.diffusion_model.*` tensors: not an original SD 1.x / SDXL checkpoint; set model.base_model to a diffusers folder {convert_hint}"
                ),
            });
        }
        if sd2 && !sdxl {
            return Err(Error::Unusable {
                what: path.display().to_string(),
                reason: format!(
                    "an SD 2.x single file (OpenCLIP-H text encoder under `cond_stage_model.model.`) is not read by the SD job; {convert_hint}"
                ),
            });
        }
        if !has_te {
            return Err(Error::Unusable {
                what: path.display().to_string(),
                reason: format!(
                    "no text encoder (`cond_stage_model.transformer.*` / `conditioner.embedders.0.transformer.*`) in the file; {convert_hint}"
                ),
            });
        }
        // the check `lora-train plan` makes too
        let comp = single_file_companion(path, companion, sdxl)?;
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
            move |e: Error| Error::Context {
                during: at.clone(),
                source: Box::new(e),
            }
        };
        let unet_cfg = match config_file("unet") {
            Some(f) => crate::sd::UNetConfig::from_file(&f).map_err(cfg_err("unet"))?,
            None if sdxl => crate::sd::UNetConfig::sdxl_base(),
            None => crate::sd::UNetConfig::sd15(),
        };
        let vae_cfg = match config_file("vae") {
            Some(f) => crate::sd::VaeConfig::from_file(&f).map_err(cfg_err("vae"))?,
            None if sdxl => crate::sd::VaeConfig::sdxl(),
            None => crate::sd::VaeConfig::sd15(),
        };
        let te_cfg = |c: &str| -> Result<Option<crate::clip::ClipTextConfig>> {
            config_file(c)
                .map(|f| crate::clip::ClipTextConfig::from_file(f).map_err(cfg_err(c)))
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
    ) -> crate::Result<(Tensor, Option<Tensor>)> {
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
    pub fn encode_prompts<S: AsRef<str>>(&self, prompts: &[S]) -> crate::Result<TextCond> {
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
    /// Model errors; [`crate::Error::InvalidArgument`] when an SDXL pipeline gets no
    /// `ids_2`.
    pub fn condition(
        &self,
        ids: &Tensor,
        ids_2: Option<&Tensor>,
        train: bool,
    ) -> crate::Result<TextCond> {
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
    ) -> crate::Result<TextCond> {
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
            crate::Error::InvalidArgument(
                "SDXL conditioning needs the token ids of tokenizer_2".into(),
            )
        })?;
        let out2 = te2.forward_t(&ids_2.f_to_device(te.device())?, train)?;
        let skip = self.clip_skip.max(1) + 1;
        let h1 = te.skip_hidden(&out, skip, false)?;
        let h2 = te2.skip_hidden(&out2, skip, false)?.f_to_kind(h1.kind())?;
        let pooled = out2.text_embeds.ok_or_else(|| {
            crate::Error::InvalidArgument("text_encoder_2 returned no text_embeds".into())
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
    pub fn encode_images(&self, pixels: &Tensor) -> crate::Result<Tensor> {
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

    /// The device the UNet (and training) runs on.
    pub fn unet_device(&self) -> Device {
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
    /// [`Error::Context`] naming the component and the file when loading fails;
    /// [`Error::Unusable`] for text encoders that carry LoRA adapters (trained or loaded),
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
                return Err(Error::Unusable {
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
    fn load_vae(&self, device: Device) -> crate::Result<AutoencoderKL> {
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
    ) -> crate::Result<(ClipTextModel, Option<ClipTextModelWithProjection>)> {
        use crate::sd::load as ld;
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
    fn on_device(&self, vae: bool, text: bool) -> crate::Result<OnDevice> {
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
    /// Model errors; [`crate::Error::InvalidArgument`] when SDXL inputs are missing.
    pub fn predict(
        &self,
        x: &Tensor,
        t: &Tensor,
        cond: &TextCond,
        time_ids: Option<&Tensor>,
        train: bool,
    ) -> crate::Result<Tensor> {
        match (&cond.pooled, time_ids) {
            (Some(p), Some(ids)) => self.unet.forward_t(
                x,
                t,
                &cond.hidden,
                Some((p, &ids.f_to_device(x.device())?)),
                train,
            ),
            (None, None) => self.unet.forward_t(x, t, &cond.hidden, None, train),
            _ => Err(crate::Error::InvalidArgument(
                "SDXL needs both the pooled text embedding and the time ids".into(),
            )),
        }
    }

    /// Generates one image per prompt with DDIM or Euler (`opts.steps` steps, classifier-free
    /// guidance against the empty prompt) from seeded noise; `[n, 3, H, W]` f32 in ≈ `[-1, 1]`
    /// on the CPU. SDXL: time ids `(H, W, 0, 0, H, W)` of the sample size, and zeros as the
    /// unconditional embeddings (diffusers' `force_zeros_for_empty_prompt`, set in SDXL base's
    /// `model_index.json`). The global CPU generator is restored afterwards, so sampling during
    /// training does not change the training noise. The prompts are sampled one at a time (the
    /// UNet at batch 2 with guidance, 1 without: the grid's memory does not grow with the number
    /// of prompts; prompt `i` starts from row `i` of one seeded `[n, C, h, w]` noise tensor), and
    /// each image is decoded on its own and moved to the CPU before the next prompt.
    ///
    /// # Errors
    /// Model / sampler errors.
    pub fn sample_images<S: AsRef<str>>(
        &self,
        prompts: &[S],
        opts: &SampleOptions,
    ) -> crate::Result<Tensor> {
        let (size, steps, guidance_scale, seed) =
            (opts.size, opts.steps, opts.guidance_scale, opts.seed);
        let dev = self.unet_device();
        let saved = lora_core::sys::rng_state(Device::Cpu).ok();
        let _g = tch::no_grad_guard();
        // the VAE and text encoders on the UNet's device for this grid (copies of those moved
        // off it, dropped at the end)
        let on = self.on_device(true, true)?;
        let encode = |p: &[&str]| -> crate::Result<TextCond> {
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
        // one prompt at a time (kohya's sd-scripts draws its samples the same way): the UNet
        // runs at batch 2 (unconditional + conditional) whatever the number of prompts, so the
        // grid's memory does not grow with it
        let row = |t: &Tensor, i: i64| t.f_narrow(0, i, 1);
        let cond_of = |i: i64| -> crate::Result<TextCond> {
            Ok(if guidance_scale > 1.0 {
                TextCond {
                    hidden: Tensor::f_cat(&[row(&uncond.hidden, i)?, row(&cond.hidden, i)?], 0)?,
                    pooled: match (&uncond.pooled, &cond.pooled) {
                        (Some(u), Some(c)) => Some(Tensor::f_cat(&[row(u, i)?, row(c, i)?], 0)?),
                        _ => None,
                    },
                }
            } else {
                TextCond {
                    hidden: row(&cond.hidden, i)?,
                    pooled: cond.pooled.as_ref().map(|p| row(p, i)).transpose()?,
                }
            })
        };
        let time_ids = if self.is_sdxl() {
            let rows = if guidance_scale > 1.0 { 2 } else { 1 };
            let ids: Vec<f32> = (0..rows)
                .flat_map(|_| sdxl_time_ids(size, (0, 0), size))
                .collect();
            Some(
                Tensor::f_from_slice(&ids)?
                    .f_view([rows, 6])?
                    .f_to_device(dev)?,
            )
        } else {
            None
        };
        let f = self.vae_factor();
        let c = self.unet.config().in_channels;
        // the noise of the whole grid from one seed, as before: prompt i gets row i
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
        let vae = on.vae.as_ref().unwrap_or(&self.vae);
        let mut images = Vec::with_capacity(prompts.len());
        for i in 0..n {
            let c = cond_of(i)?;
            let z = crate::diffusion::sample(
                sampler.as_ref(),
                &row(&noise, i)?,
                guidance_scale,
                |x, t| {
                    let ts = Tensor::f_from_slice(&[t as f32])?.f_to_device(dev)?;
                    self.predict(x, &ts, &c, time_ids.as_ref(), false)
                },
            )?;
            // decoded on its own and moved off the device at once: one image's decoder
            // activations at a time, and no finished images on the device
            let img = vae.decode(&vae.unscale_latents(&z)?)?;
            images.push(img.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?);
        }
        drop(on);
        if let Some(s) = saved {
            let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
        }
        Ok(Tensor::f_cat(&images, 0)?)
    }

    /// The VAE's spatial factor `2^(levels − 1)` (8 for SD).
    pub fn vae_factor(&self) -> i64 {
        1i64 << (self.vae.config().block_out_channels.len().saturating_sub(1))
    }
}

// ---------------------------------------------------------------------------------------------
// Batches, the train step, the batch source
// ---------------------------------------------------------------------------------------------
