//! The FLUX.1 LoRA job: plan → load → inject → cache latents and T5/CLIP outputs → train →
//! sample → export.

use super::task::{FluxBatch, FluxConditioning, FluxImages, FluxObjective, FluxTask};
use crate::config::{ExportFormat, TargetModules, TrainConfig};
use crate::job::error::During;
use crate::job::sequence::{LoadedRun, RunContext, RunOutcome, RunSteps};
use crate::job::{JobError, Plan, Result, RunOptions, resolve_path};
use crate::recipes::images::{self, GridSampler, ImageSource, SampleCallback};
use lora_core::formats::AdapterWeights;
use lora_data::image::ImageDataset;
use lora_data::loader::Dataset;
use lora_memory::FLUX_BLOCK_LINEARS;
use lora_models::flux::{FluxBaseFormat, FluxFiles, FluxPipeline, FluxSampleOptions};
use serde::Serialize;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tch::{Device, Kind, Tensor};

/// What a FLUX run did.
#[derive(Debug, Clone, Serialize)]
pub struct FluxRunSummary {
    /// The memory plan.
    pub plan: Option<Plan>,
    /// Optimizer steps done.
    pub steps: u64,
    /// Images per epoch (repeats included).
    pub items: usize,
    /// Distinct images.
    pub images: usize,
    /// `(step, loss)` per logged step.
    pub losses: Vec<(u64, f64)>,
    /// Flow-matching loss on fixed noise at fixed σ over the first images, before training.
    pub eval_loss_before: f64,
    /// The same after training.
    pub eval_loss_after: f64,
    /// Autoencoder encodings done (the latent cache's misses).
    pub vae_encodings: u64,
    /// Seconds spent training.
    pub train_seconds: f64,
    /// Measured memory of the training steps (CPU runs).
    pub memory: crate::job::MeasuredMemory,
    /// Sample grids written.
    pub samples: Vec<PathBuf>,
    /// Adapter and summary files written.
    pub outputs: Vec<PathBuf>,
}

/// The module paths of the transformer a FLUX adapter goes on: in the double-stream blocks
/// `double` (`None` = all) and the single-stream blocks `single`, the linears named by
/// `leaves` (module-path suffixes; by default [`FLUX_BLOCK_LINEARS`], every block linear, as
/// kohya's `networks.lora_flux` targets the blocks' attention, MLP and modulation linears) — a
/// full-match regex, so the embedders and the output head (whose `proj_out` shares a block
/// leaf's name) stay out.
pub fn block_targets_regex(
    double: Option<&[u32]>,
    single: Option<&[u32]>,
    leaves: &[String],
) -> String {
    let leaves: Vec<String> = leaves.iter().map(|l| regex_escape(l)).collect();
    let leaves = leaves.join("|");
    let part = |prefix: &str, idx: Option<&[u32]>| -> Option<String> {
        let idx = match idx {
            None => r"\d+".to_string(),
            Some([]) => return None,
            Some(v) => v.iter().map(u32::to_string).collect::<Vec<_>>().join("|"),
        };
        Some(format!(r"{prefix}\.(?:{idx})\.(?:.*\.)?(?:{leaves})"))
    };
    [
        part("transformer_blocks", double),
        part("single_transformer_blocks", single),
    ]
    .into_iter()
    .flatten()
    .collect::<Vec<_>>()
    .join("|")
}

/// `s` with the regex metacharacters a module name can hold escaped.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        if ".+*?()|[]{}^$\\".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out
}

/// The LoRA config of a FLUX run on a transformer of `double` + `single` blocks: `lora.*`, with
/// the block linears ([`block_targets_regex`]) unless `lora.target_modules` names other
/// modules, restricted to the blocks `flux.train_blocks` and the block indices select.
///
/// # Errors
/// As [`super::plan::trained_blocks`]; [`JobError::Input`] for a `lora.target_modules` regex
/// together with a block selection (they cannot be combined: put the blocks in the regex).
pub fn flux_lora_config(
    cfg: &TrainConfig,
    base_model: &str,
    double: u32,
    single: u32,
) -> Result<lora_core::config::LoraConfig> {
    let (d, s) = super::plan::trained_blocks(cfg, double, single)?;
    let default: Vec<String> = FLUX_BLOCK_LINEARS.iter().map(|l| l.to_string()).collect();
    let targets = match &cfg.lora.target_modules {
        t if *t == crate::config::default_target_modules() => {
            TargetModules::Regex(block_targets_regex(d.as_deref(), s.as_deref(), &default))
        }
        TargetModules::Regex(r) if r == "all-linear" => {
            TargetModules::Regex(block_targets_regex(d.as_deref(), s.as_deref(), &default))
        }
        TargetModules::List(l) => {
            TargetModules::Regex(block_targets_regex(d.as_deref(), s.as_deref(), l))
        }
        TargetModules::Regex(r) => {
            if d.is_some() || s.is_some() {
                return Err(JobError::Input(format!(
                    "lora.target_modules is a regex ({r:?}) and flux.train_blocks / block indices select blocks: write the blocks into the regex, or give target_modules as a list"
                )));
            }
            TargetModules::Regex(r.clone())
        }
    };
    Ok(cfg.lora.to_lora_config(targets, base_model, None))
}

/// Loads the pipeline a FLUX config names: a diffusers `FluxPipeline` folder, or BFL's single
/// transformer file with `flux.t5xxl`, `flux.clip_l`, `flux.ae` and `model.tokenizer` (a folder
/// holding `tokenizer/` and `tokenizer_2/`, e.g. a diffusers FLUX folder).
///
/// # Errors
/// [`crate::config::ConfigError::Missing`] naming the key a single-file base needs; model
/// errors.
fn load_pipeline(
    cfg: &TrainConfig,
    base: &Path,
    config_dir: Option<&Path>,
    kind: Kind,
    device: Device,
) -> Result<FluxPipeline> {
    let err = |e| super::pipeline_err(e);
    let format = base_format(cfg, base);
    if base.is_dir() {
        return FluxPipeline::from_diffusers_with_base(base, kind, device, format).map_err(err);
    }
    let files = single_files(cfg, base, config_dir)?;
    FluxPipeline::from_single_files_with_base(&files, kind, device, format).map_err(err)
}

/// The companion files a single-file FLUX base needs (`flux.t5xxl`, `flux.clip_l`, `flux.ae`,
/// `model.tokenizer`), resolved against the config's folder.
///
/// # Errors
/// [`crate::config::ConfigError::Missing`] naming every key that is not set, at once, and
/// what each must point at; [`JobError::MissingFile`] for a set path that does not exist.
fn single_files(cfg: &TrainConfig, base: &Path, config_dir: Option<&Path>) -> Result<FluxFiles> {
    let wanted: [(&str, &Option<String>, &str); 4] = [
        (
            "flux.t5xxl",
            &cfg.flux.t5xxl,
            "the T5-XXL file (t5xxl_fp16.safetensors)",
        ),
        (
            "flux.clip_l",
            &cfg.flux.clip_l,
            "the CLIP-L file (clip_l.safetensors)",
        ),
        (
            "flux.ae",
            &cfg.flux.ae,
            "BFL's autoencoder file (ae.safetensors)",
        ),
        (
            "model.tokenizer",
            &cfg.model.tokenizer,
            "a folder with tokenizer/ (CLIP) and tokenizer_2/ (T5), such as a diffusers FLUX.1 folder",
        ),
    ];
    let unset: Vec<&(&str, &Option<String>, &str)> =
        wanted.iter().filter(|(_, v, _)| v.is_none()).collect();
    if !unset.is_empty() {
        return Err(crate::config::ConfigError::Missing {
            key: unset.iter().map(|(k, ..)| *k).collect::<Vec<_>>().join(", "),
            hint: format!(
                "model.base_model {} is a single transformer file: set {} (or use a diffusers FLUX.1 folder as the base)",
                base.display(),
                unset
                    .iter()
                    .map(|(k, _, what)| format!("{k} to {what}"))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        }
        .into());
    }
    let path = |i: usize| -> Result<PathBuf> {
        let (key, v, _) = wanted[i];
        resolve_path(key, v.as_deref().unwrap_or_default(), config_dir)
    };
    Ok(FluxFiles {
        transformer: base.to_path_buf(),
        t5xxl: path(0)?,
        clip_l: path(1)?,
        ae: path(2)?,
        tokenizers: path(3)?,
    })
}

/// How the frozen transformer is held: a GGUF file as stored (its own block types); float8
/// (e4m3fn, upcast per layer) with `flux.fp8_base` or a file stored in fp8; NF4 (double
/// quant) with `model.weights: quantized`; else dense in `model.dtype`. What
/// [`super::plan::settings_for`] plans.
pub fn base_format(cfg: &TrainConfig, base: &Path) -> FluxBaseFormat {
    let t = super::plan::transformer_path(base);
    if t.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        FluxBaseFormat::Dense
    } else if cfg.flux.fp8_base || super::plan::stored_in_fp8(&t) {
        FluxBaseFormat::Fp8
    } else if cfg.model.weights == crate::config::BaseWeights::Quantized {
        FluxBaseFormat::Nf4 { double_quant: true }
    } else {
        FluxBaseFormat::Dense
    }
}

/// The seed of the fixed evaluation's noise.
fn eval_seed(cfg: &TrainConfig) -> u64 {
    cfg.system.seed ^ 0x5eed
}

/// The FLUX run before its pipeline loads: the scanned dataset.
#[derive(Default)]
pub(super) struct FluxSteps {
    data: Option<(PathBuf, ImageDataset)>,
}

impl RunSteps for FluxSteps {
    type Loaded = FluxRun;
    type Summary = FluxRunSummary;

    fn check(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()> {
        super::plan::read_descriptor(cfg, ctx.config_dir())?;
        super::plan::check_resolution(cfg)?;
        let base = ctx.base_path()?;
        if base.is_dir() && !base.join("transformer").is_dir() {
            let parent = base
                .parent()
                .filter(|p| p.join("model_index.json").is_file() || p.join("vae").is_dir());
            return Err(JobError::Input(format!(
                "model.base_model {} is a transformer folder, not a FLUX.1 pipeline: training needs the text encoders, tokenizers and autoencoder too — {}",
                base.display(),
                match parent {
                    Some(p) => format!("use the pipeline folder above it ({})", p.display()),
                    None => "give a diffusers FLUX.1 folder (transformer/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/, vae/) or BFL's single file with flux.t5xxl, flux.clip_l, flux.ae and model.tokenizer".into(),
                }
            )));
        }
        if base.is_file() {
            single_files(cfg, &base, ctx.config_dir())?;
        }
        if cfg.train.train_text_encoder {
            return Err(JobError::Input(
                "train.train_text_encoder: FLUX.1 LoRA here trains the transformer only (kohya's network_train_unet_only); T5 and CLIP stay frozen and their outputs are cached — remove the key or set it to false".into(),
            ));
        }
        Ok(())
    }

    /// The plan from the headers [`RunSteps::check`] read: a plan that fails is a config error
    /// (targets that match nothing, blocks to swap or train that do not exist), reported before
    /// anything loads.
    fn plan(&self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Option<Plan>> {
        super::plan::plan(cfg, ctx.config_dir(), None, ctx.cuda).map(Some)
    }

    fn read_data(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()> {
        self.data = Some(images::read_dataset(cfg, ctx)?);
        Ok(())
    }

    /// Every image's latents, and the T5/CLIP outputs of its caption unless the captions change
    /// between epochs (FLUX caches both, see `source`).
    fn kept_data(&self, _cfg: &TrainConfig) -> Option<lora_memory::KeptData> {
        let (_, ds) = self.data.as_ref()?;
        let aug = images::Augmentations::of(ds.config());
        Some(images::kept_data(ds, !aug.varying_captions))
    }

    fn load(
        self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        vs: &tch::nn::VarStore,
    ) -> Result<FluxRun> {
        let (data_path, ds) = self
            .data
            .ok_or(JobError::Internal("the image dataset was not read"))?;
        let kind = cfg.model.dtype.kind();
        let base_path = ctx.base_path()?;
        ctx.say(&format!(
            "loading {} ({}) on {}",
            base_path.display(),
            cfg.model.dtype.name(),
            lora_core::sys::device_name(ctx.device)
        ));
        let mut pipe = load_pipeline(cfg, &base_path, ctx.config_dir(), kind, ctx.device)?;
        pipe.transformer
            .set_gradient_checkpointing(cfg.train.gradient_checkpointing);
        let format = base_format(cfg, &base_path);
        if format != FluxBaseFormat::Dense {
            ctx.say(&format!(
                "the frozen transformer is held as {format:?}, each layer decoded to {kind:?} when it runs"
            ));
        }
        let n = cfg.flux.blocks_to_swap;
        if n > 0 {
            pipe.transformer
                .set_blocks_to_swap(n, Device::Cpu)
                .map_err(|e| {
                    JobError::Config(crate::config::ConfigError::InvalidValue {
                        key: "flux.blocks_to_swap".into(),
                        value: n.to_string(),
                        expected: format!("a number of blocks this transformer can swap ({e})"),
                    })
                })?;
            let b = pipe.transformer.weight_bytes();
            ctx.say(&format!(
                "blocks_to_swap {n}: {} of the frozen weights stay in host memory and are copied in layer by layer{}; gradient checkpointing is on",
                lora_memory::Bytes(b.host),
                if ctx.cuda {
                    ""
                } else {
                    " (a CPU run: host and device are the same memory, nothing is saved)"
                }
            ));
        }
        if cfg.flux.apply_t5_attn_mask {
            ctx.say("apply_t5_attn_mask: T5 masks its padding tokens; the transformer's joint attention sees every token");
        }
        tch::manual_seed(cfg.system.seed as i64);
        let fc = pipe.transformer.config();
        let lcfg = flux_lora_config(
            cfg,
            &ctx.base_written,
            fc.num_layers as u32,
            fc.num_single_layers as u32,
        )?;
        let report = lora_core::inject::inject(&mut pipe.transformer, &lcfg, "default", &vs.root())
            .during("injecting LoRA into the FLUX transformer")?;
        ctx.say(&format!(
            "LoRA r{} α{} on {} transformer modules: {} trainable of {} parameters ({:.3}%)",
            cfg.lora.rank,
            cfg.lora.alpha,
            report.modules.len(),
            report.trainable_params,
            report.all_params,
            report.trainable_percent()
        ));
        let snapshot_template =
            if cfg.train.save_every_n_steps.is_some() || cfg.train.save_every_n_epochs.is_some() {
                Some(crate::job::snapshots::AdapterLayout::of(
                    &AdapterWeights::from_model(&mut pipe.transformer, "default")
                        .during("reading the injected adapters")?,
                ))
            } else {
                None
            };
        let cond = FluxConditioning::of(&cfg.flux, &pipe);
        Ok(FluxRun {
            snapshot_template,
            images: Rc::new(FluxImages { pipe, cond }),
            kind,
            data_path,
            dataset: Some(ds),
            image_count: 0,
            items: 0,
            encoded: Rc::new(RefCell::new(0)),
            objective: None,
            eval_batches: Vec::new(),
            eval_loss_before: f64::NAN,
            eval_loss_after: f64::NAN,
            prompts: Vec::new(),
            written: Rc::new(RefCell::new(Vec::new())),
        })
    }
}

/// The FLUX run once the pipeline is loaded and LoRA injected.
pub(super) struct FluxRun {
    snapshot_template: Option<crate::job::snapshots::AdapterLayout>,
    images: Rc<FluxImages>,
    kind: Kind,
    data_path: PathBuf,
    dataset: Option<ImageDataset>,
    image_count: usize,
    items: usize,
    encoded: Rc<RefCell<u64>>,
    objective: Option<FluxObjective>,
    eval_batches: Vec<FluxBatch>,
    eval_loss_before: f64,
    eval_loss_after: f64,
    prompts: Vec<String>,
    written: Rc<RefCell<Vec<PathBuf>>>,
}

/// The FLUX pipeline drawing sample grids: Euler flow-matching steps with FLUX.1's
/// resolution-dependent shift (`logging.sample_steps`, the training size, `system.seed`;
/// dev's guidance embedding at `logging.sample_guidance_scale`).
struct FluxSampler {
    images: Rc<FluxImages>,
    opts: FluxSampleOptions,
}

impl GridSampler for FluxSampler {
    fn sample(&self, prompts: &[String]) -> std::result::Result<Tensor, String> {
        let _g = tch::no_grad_guard();
        let pipe = &self.images.pipe;
        let c = &self.images.cond;
        let caps: Vec<&str> = prompts.iter().map(String::as_str).collect();
        let cond = pipe
            .encode_prompts(&caps, c.max_sequence_length, c.apply_t5_attn_mask)
            .map_err(|e| e.to_string())?;
        pipe.sample(&cond, &self.opts).map_err(|e| e.to_string())
    }
}

/// The sampling options of a config (`logging.sample_*`, the training resolution).
fn sample_options(cfg: &TrainConfig) -> FluxSampleOptions {
    let res = cfg.data.resolution.unwrap_or([1024, 1024]);
    FluxSampleOptions {
        size: (res[0], res[1]),
        steps: cfg.logging.sample_steps.max(1) as usize,
        guidance_scale: cfg.logging.sample_guidance_scale,
        seed: cfg.system.seed,
    }
}

/// kohya metadata of a FLUX adapter on top of `base` (sd-scripts `flux_train_network.py`):
/// `ss_base_model_version = flux1`, `ss_network_module = networks.lora_flux`, the training's
/// FLUX options.
fn flux_metadata(
    mut base: std::collections::BTreeMap<String, String>,
    cfg: &TrainConfig,
) -> std::collections::BTreeMap<String, String> {
    let f = &cfg.flux;
    let py_bool = |b: bool| if b { "True" } else { "False" };
    base.insert("ss_base_model_version".into(), "flux1".into());
    base.insert("ss_network_module".into(), "networks.lora_flux".into());
    base.insert("ss_network_train_unet_only".into(), "True".into());
    base.insert(
        "ss_apply_t5_attn_mask".into(),
        py_bool(f.apply_t5_attn_mask).into(),
    );
    base.insert("ss_guidance_scale".into(), f.guidance_scale.to_string());
    base.insert(
        "ss_timestep_sampling".into(),
        serde_json::to_value(f.timestep_sampling)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
    );
    base.insert("ss_sigmoid_scale".into(), f.sigmoid_scale.to_string());
    base.insert(
        "ss_model_prediction_type".into(),
        serde_json::to_value(f.model_prediction_type)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default(),
    );
    base.insert(
        "ss_discrete_flow_shift".into(),
        f.discrete_flow_shift.to_string(),
    );
    base
}

/// Writes `w` in each of `formats` into `dir` under `stem`: kohya / ComfyUI
/// `<stem>.safetensors` (BFL's fused modules) and diffusers
/// `<stem>/pytorch_lora_weights.safetensors`; returns what was written.
fn write_formats(
    w: &AdapterWeights,
    config: &lora_models::flux::FluxConfig,
    formats: &[ExportFormat],
    dir: &Path,
    stem: &str,
) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for f in formats {
        match f {
            ExportFormat::Kohya => {
                let p = dir.join(format!("{stem}.safetensors"));
                lora_models::flux::lora::write_kohya(w, config, &p).map_err(super::pipeline_err)?;
                out.push(p);
            }
            ExportFormat::Peft => {
                let d = dir.join(stem);
                std::fs::create_dir_all(&d).during(format!("creating {}", d.display()))?;
                let p = d.join("pytorch_lora_weights.safetensors");
                lora_models::flux::lora::write_diffusers(w, &p).map_err(super::pipeline_err)?;
                out.push(d);
            }
        }
    }
    Ok(out)
}

impl LoadedRun for FluxRun {
    type Batch = FluxBatch;
    type Task<'a> = FluxTask;
    type Source = ImageSource<FluxImages>;
    type Summary = FluxRunSummary;

    fn source(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Self::Source> {
        let ds = self
            .dataset
            .take()
            .ok_or(JobError::Internal("the image dataset was taken twice"))?;
        self.image_count = ds.num_images();
        self.items = ds.len();
        let loader = images::image_loader(ds, cfg, ctx)?;
        let base_path = ctx.base_path()?;
        let disk = images::disk_cache(cfg, &ctx.out_dir)?;
        let ae = match &cfg.flux.ae {
            Some(p) => resolve_path("flux.ae", p, ctx.config_dir())?,
            None => base_path,
        };
        let model_id = images::vae_model_id(&ae, self.kind);
        // FLUX caches unless told not to (kohya's FLUX guides always cache): latents unless
        // crops are random, T5/CLIP outputs unless captions change between epochs
        let aug = images::Augmentations::of(loader.dataset().config());
        let cache = cfg.data.cache_latents != Some(false);
        let pre = (cache && !aug.random_crop, cache && !aug.varying_captions);
        if cache && aug.random_crop {
            ctx.say("random_crop: latents are encoded as the crops are drawn; the autoencoder stays on the device");
        }
        if cache && aug.varying_captions {
            ctx.say("captions change between epochs (shuffle_caption, caption or tag dropout): T5 and CLIP encode each batch's captions; they stay on the device");
        }
        let Some(source) = images::cached_source(
            &mut self.images,
            loader,
            model_id,
            disk,
            pre,
            !aug.varying_captions,
            ctx,
            |images, (latents, text)| {
                images
                    .pipe
                    .move_frozen(Device::Cpu, latents, text)
                    .map_err(super::pipeline_err)
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
        source: &mut Self::Source,
    ) -> Result<()> {
        let objective = FluxObjective::of(cfg)?;
        self.eval_batches = source
            .fixed_batches(crate::recipes::images::EVAL_SAMPLES)
            .during("the evaluation batches")?;
        self.eval_loss_before = super::task::fixed_eval_loss(
            &self.images,
            &objective,
            &self.eval_batches,
            eval_seed(cfg),
        )
        .map_err(super::pipeline_err)?;
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
        let prompts = images::sample_prompts(cfg, ctx)?;
        let sampler = SampleCallback::new(
            FluxSampler {
                images: self.images.clone(),
                opts: sample_options(cfg),
            },
            prompts.clone(),
            cfg.logging.sample_every_n_steps,
            ctx.out_dir.join("samples"),
        );
        self.written = sampler.written.clone();
        self.prompts = prompts;
        let mut callbacks: Vec<Box<dyn crate::engine::Callback>> = vec![Box::new(sampler)];
        if let Some(template) = self.snapshot_template.take() {
            let formats = cfg.train.export_formats.clone();
            let config = self.images.pipe.transformer.config().clone();
            let writer: crate::job::snapshots::SnapshotWriter =
                Box::new(move |parts, dir, stem| match parts.first() {
                    Some((_, w)) => write_formats(w, &config, &formats, dir, stem),
                    None => Ok(Vec::new()),
                });
            let parts = vec![crate::job::snapshots::SnapshotPart {
                component: "transformer",
                var_prefix: String::new(),
                template,
            }];
            callbacks.push(Box::new(crate::job::snapshots::AdapterSnapshots::for_run(
                parts,
                writer,
                cfg,
                &ctx.out_dir,
            )));
        }
        Ok(callbacks)
    }

    fn task(&self, cfg: &TrainConfig, named: Vec<(String, Tensor)>) -> Result<FluxTask> {
        Ok(FluxTask {
            images: self.images.clone(),
            objective: FluxObjective::of(cfg)?,
            named,
            loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
        })
    }

    fn after(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        source: Self::Source,
        _report: &crate::engine::TrainReport,
    ) -> Result<Option<(&'static str, f64)>> {
        drop(source);
        let objective = match self.objective.take() {
            Some(o) => o,
            None => FluxObjective::of(cfg)?,
        };
        self.eval_loss_after = super::task::fixed_eval_loss(
            &self.images,
            &objective,
            &self.eval_batches,
            eval_seed(cfg),
        )
        .map_err(super::pipeline_err)?;
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
        images::final_grid(
            FluxSampler {
                images: self.images.clone(),
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
            "images": self.image_count,
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
        let images = Rc::get_mut(&mut self.images).ok_or(JobError::Internal(
            "the pipeline is still shared after training",
        ))?;
        let mut w = AdapterWeights::from_model(&mut images.pipe.transformer, "default")
            .during("reading the trained adapter")?;
        if let Some(p) = cfg.train.save_precision {
            w = w.to_kind(p.kind()).during("casting the adapter")?;
        }
        w.metadata = flux_metadata(metadata, cfg);
        write_formats(
            &w,
            images.pipe.transformer.config(),
            &cfg.train.export_formats,
            &ctx.out_dir,
            &cfg.train.output_name,
        )
    }

    fn summary(self, outcome: RunOutcome) -> Result<FluxRunSummary> {
        let samples = self.written.borrow().clone();
        Ok(FluxRunSummary {
            plan: outcome.plan,
            steps: outcome.report.steps,
            items: self.items,
            images: self.image_count,
            losses: outcome.report.losses,
            eval_loss_before: self.eval_loss_before,
            eval_loss_after: self.eval_loss_after,
            vae_encodings: *self.encoded.borrow(),
            train_seconds: outcome.train_seconds,
            memory: outcome.memory,
            samples,
            outputs: outcome.outputs,
        })
    }

    fn report(summary: &FluxRunSummary, ctx: &RunContext<'_>) -> String {
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

/// Runs the FLUX job (see the module docs), with the app's own engine callbacks after the
/// job's own.
///
/// # Errors
/// [`JobError::DoesNotFit`], config, file and runtime errors.
pub fn run_with(
    cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn crate::engine::Callback>>,
) -> Result<FluxRunSummary> {
    crate::job::sequence::run(FluxSteps::default(), cfg, opts, callbacks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_targets_are_the_block_linears_and_not_the_head() {
        let cfg = TrainConfig::default();
        let l = flux_lora_config(&cfg, "flux1-dev.safetensors", 19, 38).unwrap();
        let re = lora_core::config::TargetMatcher::new(&l).unwrap();
        for m in [
            "transformer_blocks.0.attn.to_q",
            "transformer_blocks.18.attn.to_add_out",
            "transformer_blocks.3.ff_context.net.0.proj",
            "transformer_blocks.3.norm1_context.linear",
            "single_transformer_blocks.37.proj_out",
            "single_transformer_blocks.0.proj_mlp",
            "single_transformer_blocks.5.norm.linear",
        ] {
            assert!(re.matches(m, true), "{m}");
        }
        for m in [
            "proj_out",
            "norm_out.linear",
            "x_embedder",
            "context_embedder",
            "time_text_embed.timestep_embedder.linear_1",
            "transformer_blocks.0.attn.norm_q",
        ] {
            assert!(!re.matches(m, true), "{m}");
        }
    }

    #[test]
    fn kohya_block_selection_narrows_the_targets() {
        let mut cfg = TrainConfig::default();
        cfg.flux.train_blocks = crate::config::FluxTrainBlocks::Single;
        cfg.flux.train_single_block_indices = Some("0,2-3".into());
        let l = flux_lora_config(&cfg, "x", 19, 38).unwrap();
        let re = lora_core::config::TargetMatcher::new(&l).unwrap();
        assert!(!re.matches("transformer_blocks.0.attn.to_q", true));
        assert!(re.matches("single_transformer_blocks.0.attn.to_q", true));
        assert!(!re.matches("single_transformer_blocks.1.attn.to_q", true));
        assert!(re.matches("single_transformer_blocks.3.proj_mlp", true));
        assert!(!re.matches("single_transformer_blocks.30.proj_mlp", true));
        // a list of leaves: those leaves in the selected blocks
        cfg.lora.target_modules = TargetModules::list(&["to_q", "to_v"]);
        let l = flux_lora_config(&cfg, "x", 19, 38).unwrap();
        let re = lora_core::config::TargetMatcher::new(&l).unwrap();
        assert!(re.matches("single_transformer_blocks.2.attn.to_q", true));
        assert!(!re.matches("single_transformer_blocks.2.attn.to_k", true));
        // indices past the model's blocks name the key
        cfg.flux.train_single_block_indices = Some("40".into());
        let e = flux_lora_config(&cfg, "x", 19, 38).unwrap_err().to_string();
        assert!(
            e.contains("flux.train_single_block_indices") && e.contains("40"),
            "{e}"
        );
        // nothing left to train
        cfg.flux.train_single_block_indices = Some("none".into());
        let e = flux_lora_config(&cfg, "x", 19, 38).unwrap_err().to_string();
        assert!(e.contains("flux.train_blocks"), "{e}");
    }

    #[test]
    fn kohya_metadata_names_flux_and_its_options() {
        let mut cfg = TrainConfig::default();
        cfg.flux.timestep_sampling = crate::config::TimestepSampling::FluxShift;
        let m = flux_metadata(Default::default(), &cfg);
        assert_eq!(m["ss_base_model_version"], "flux1");
        assert_eq!(m["ss_network_module"], "networks.lora_flux");
        assert_eq!(m["ss_timestep_sampling"], "flux_shift");
        assert_eq!(m["ss_model_prediction_type"], "raw");
        assert_eq!(m["ss_apply_t5_attn_mask"], "False");
    }
}
