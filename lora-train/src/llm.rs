//! The causal-LM job: plan → load → inject → train → export → summary.
//!
//! [`plan`] is pure (lora-memory only): it reads the model's header, turns the [`TrainConfig`]
//! into lora-memory [`Settings`], estimates the peak, checks it against the budget and, with
//! `memory.auto_fit`, applies lora-memory's `fit()`.

use crate::config::{BaseWeights, Dtype, OptimizerKind, Precision, TargetModules, TrainConfig};
use lora_memory::{
    BaseDtype, Budget, Change, Device, Estimate, FitError, MixedPrecision, ModelDescriptor,
    Optimizer, Settings,
};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Errors of the causal-LM job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// Reading the model header, a budget or estimating failed.
    #[error(transparent)]
    Memory(#[from] lora_memory::Error),
    /// The run is predicted not to fit its budget and was not forced.
    #[error(
        "predicted peak {peak} does not fit the budget {budget} ({source_desc}); set memory.auto_fit: true to let lora-memory pick settings that fit, change the settings by hand, or pass --force"
    )]
    DoesNotFit {
        /// Predicted peak.
        peak: lora_memory::Bytes,
        /// The budget.
        budget: lora_memory::Bytes,
        /// Where the budget came from.
        source_desc: String,
    },
    /// A file given in the config does not exist.
    #[error("{key} = {path:?}: not found (looked in {looked}); {hint}")]
    MissingFile {
        /// The config key.
        key: String,
        /// The path as written.
        path: String,
        /// Where it was looked for.
        looked: String,
        /// What to do.
        hint: String,
    },
    /// An input is unusable: a command-line argument (`--resume` without a checkpoint), an
    /// empty training file, a model file that is truncated or not a model. The message names the
    /// file or argument and what to do; the CLI exits 2.
    #[error("{0}")]
    Input(String),
    /// The run was stopped by [`crate::trainer::request_stop`] (Ctrl-C in the CLI).
    #[error("interrupted at step {step}; {}", match checkpoint {
        Some(c) => format!("the last checkpoint is {}", c.display()),
        None => "no checkpoint was saved".to_string(),
    })]
    Interrupted {
        /// Optimizer steps done when it stopped.
        step: u64,
        /// The newest checkpoint of the run (the one `--resume` continues from), if any.
        checkpoint: Option<PathBuf>,
    },
    /// Anything else at run time (training, I/O), with context.
    #[error("{0}")]
    Runtime(String),
}

/// `Result` with a [`JobError`].
pub type Result<T> = std::result::Result<T, JobError>;

/// Resolves a path from the config: as written relative to the current directory when it exists
/// there, else relative to the config file's folder.
///
/// # Errors
/// [`JobError::MissingFile`] naming the key and both places looked.
pub fn resolve_path(key: &str, written: &str, config_dir: Option<&Path>) -> Result<PathBuf> {
    let p = PathBuf::from(written);
    if p.exists() {
        return Ok(p);
    }
    let mut looked = vec![
        std::env::current_dir()
            .map(|d| d.join(&p))
            .unwrap_or_else(|_| p.clone())
            .display()
            .to_string(),
    ];
    if p.is_relative()
        && let Some(dir) = config_dir
    {
        let q = dir.join(&p);
        if q.exists() {
            return Ok(q);
        }
        looked.push(q.display().to_string());
    }
    Err(JobError::MissingFile {
        key: key.into(),
        path: written.into(),
        looked: looked.join(" and "),
        hint: if written.starts_with("assets/") {
            "the assets are provisioned by `cargo xtask setup`".into()
        } else {
            "fix the path (relative paths are tried from the current directory, then from the config file's folder)".into()
        },
    })
}

/// The memory plan of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Model name from the header.
    pub model: String,
    /// Where the descriptor came from (file path or preset).
    pub model_source: String,
    /// Settings estimated (after `auto_fit`, if applied).
    pub settings: Settings,
    /// The estimate for `settings`.
    pub estimate: Estimate,
    /// The budget, when one is known.
    pub budget: Option<Budget>,
    /// `Some(true/false)` when a budget is known.
    pub fits: Option<bool>,
    /// Changes made by `auto_fit`.
    pub changes: Vec<Change>,
    /// Notes (assumed units, approximations).
    pub notes: Vec<String>,
    /// When the plan does not fit and `auto_fit` is off: the changes `fit()` would make and the
    /// peak they reach (`memory.auto_fit: true` applies them). Empty when nothing fits.
    pub suggestion: Vec<Change>,
}

impl Plan {
    /// A human-readable report: settings, the breakdown table and the verdict. A Stable
    /// Diffusion plan (one with diffusion detail) is printed by [`crate::sd_plan::report`].
    pub fn report(&self) -> String {
        if self.estimate.diffusion.is_some() {
            return crate::sd_plan::report(self);
        }
        let s = &self.settings;
        let mut out = String::new();
        // The model's name (GGUF `general.name` as written, else the architecture or preset)
        // once, in this header; the table's own title line repeats it, so it is dropped.
        let e = &self.estimate;
        out += &format!(
            "plan: {} ({}), trainable params: {}\n",
            self.model, self.model_source, e.trainable_params
        );
        out += &format!(
            "  device {}  base {:?}  mixed precision {:?}  LoRA r{} α{} on {:?}\n",
            if s.device.is_cuda() { "cuda" } else { "cpu" },
            s.base_dtype,
            s.mixed_precision,
            s.lora.rank,
            s.lora.alpha,
            s.lora.target_modules
        );
        out += &format!(
            "  micro_batch {} × gradient_accumulation_steps {}  seq_len {}  gradient checkpointing {}  optimizer {:?}\n",
            s.micro_batch,
            s.gradient_accumulation_steps,
            s.seq_len,
            if s.gradient_checkpointing {
                "on"
            } else {
                "off"
            },
            s.optimizer
        );
        let table = e.to_table();
        let title = format!("{}  (trainable params: {})\n", e.model, e.trainable_params);
        out += table.strip_prefix(title.as_str()).unwrap_or(&table);
        for c in &self.changes {
            out += &format!(
                "auto_fit: {} {} → {} ({}); peak after {}\n",
                c.setting, c.from, c.to, c.reason, c.peak_after
            );
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        if !self.suggestion.is_empty() {
            out += "would fit with (set memory.auto_fit: true to apply, or change the config):\n";
            for c in &self.suggestion {
                out += &format!(
                    "  {} {} → {} ({}); peak after {}\n",
                    c.setting, c.from, c.to, c.reason, c.peak_after
                );
            }
        }
        out += &self.verdict();
        out
    }

    /// The verdict line of [`Plan::report`] (LLM and SD plans): the predicted peak against the
    /// budget, the budget in both units (the one it was written in first) and where it came
    /// from; then, for a CUDA plan with a decimal budget near a GPU's size,
    /// [`Budget::unit_hint`] on a `hint:` line.
    pub fn verdict(&self) -> String {
        let peak = self.estimate.peak;
        let mut out = match (&self.budget, self.fits) {
            (Some(b), Some(true)) => format!(
                "verdict: fits — predicted peak {peak} of budget {} ({}), headroom {}\n",
                b.amount(),
                budget_source(b),
                b.bytes.saturating_sub(peak)
            ),
            (Some(b), _) => format!(
                "verdict: DOES NOT FIT — predicted peak {peak} exceeds budget {} ({}) by {}\n",
                b.amount(),
                budget_source(b),
                peak.saturating_sub(b.bytes)
            ),
            (None, _) => format!("verdict: predicted peak {peak} (no budget given)\n"),
        };
        if self.settings.device.is_cuda()
            && let Some(h) = self.budget.as_ref().and_then(Budget::unit_hint)
        {
            out += &format!("hint: {h}\n");
        }
        out
    }
}

/// Describes a budget's origin in words.
pub fn budget_source(b: &Budget) -> String {
    match &b.source {
        lora_memory::BudgetSource::Size { input, assumed } => match assumed {
            Some(a) => format!("{input:?}, {a}"),
            None => format!("{input:?}"),
        },
        lora_memory::BudgetSource::Gpu { name } => format!("GPU preset {name}"),
        lora_memory::BudgetSource::NvmlFree { device_index } => {
            format!("free memory of cuda:{device_index} (NVML)")
        }
    }
}

/// Reads the base model's header (no tensor data): GGUF, safetensors file/folder, `config.json`,
/// or a lora-memory preset name. Returns the descriptor, a source description, and the GGUF
/// storage type of the layer linears when the file is GGUF.
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no preset; header errors.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String, Option<BaseDtype>)> {
    let written = cfg.base_model()?;
    let path = match resolve_path("model.base_model", written, config_dir) {
        Ok(p) => p,
        Err(e) => {
            return match ModelDescriptor::preset(written) {
                Ok(d) => Ok((d, format!("preset {written}"), None)),
                Err(_) => Err(e),
            };
        }
    };
    let lower = path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".gguf") {
        let desc = ModelDescriptor::from_gguf(&path)?;
        let header = lora_memory::gguf::read_header(&path)?;
        let q = header
            .tensors
            .iter()
            .find(|t| t.name.ends_with("attn_q.weight"))
            .and_then(|t| match t.ggml_type {
                2 => Some(BaseDtype::Q4_0),
                3 => Some(BaseDtype::Q4_1),
                8 => Some(BaseDtype::Q8_0),
                1 => Some(BaseDtype::F16),
                30 => Some(BaseDtype::Bf16),
                0 => Some(BaseDtype::F32),
                _ => None,
            });
        Ok((desc, path.display().to_string(), q))
    } else if path.is_dir() && path.join("config.json").is_file() && !has_safetensors(&path) {
        Ok((
            ModelDescriptor::from_hf_config_json(path.join("config.json"))?,
            path.display().to_string(),
            None,
        ))
    } else if lower.ends_with("config.json") {
        Ok((
            ModelDescriptor::from_hf_config_json(&path)?,
            path.display().to_string(),
            None,
        ))
    } else {
        Ok((
            ModelDescriptor::from_safetensors(&path)?,
            path.display().to_string(),
            None,
        ))
    }
}

fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}

/// lora-memory settings for a config. `file_quant` is the storage type of the file's layer
/// linears (GGUF), used when `model.weights: quantized`; `cuda` selects the device model.
pub fn settings_for(
    cfg: &TrainConfig,
    file_quant: Option<BaseDtype>,
    cuda: bool,
) -> (Settings, Vec<String>) {
    let mut notes = Vec::new();
    let base_dtype = match cfg.model.weights {
        BaseWeights::Dense => match cfg.model.dtype {
            Dtype::F32 => BaseDtype::F32,
            Dtype::Bf16 => BaseDtype::Bf16,
            Dtype::F16 => BaseDtype::F16,
        },
        BaseWeights::Quantized => match file_quant {
            Some(q) if q.is_quantized() => q,
            _ => BaseDtype::Nf4 { double_quant: true },
        },
    };
    let mixed_precision = match cfg.train.mixed_precision {
        Precision::No => MixedPrecision::No,
        Precision::Fp16 => MixedPrecision::Fp16,
        Precision::Bf16 => MixedPrecision::Bf16,
        Precision::FullBf16 => MixedPrecision::FullBf16,
    };
    let targets = match &cfg.lora.target_modules {
        TargetModules::List(l) => l.clone(),
        TargetModules::Regex(r) => {
            if r != "all-linear" {
                notes.push(format!(
                    "lora.target_modules is a regex ({r:?}); the plan counts the sites whose name matches it as a plain name"
                ));
            }
            vec![r.clone()]
        }
    };
    let optimizer = match cfg.train.optimizer {
        OptimizerKind::AdamW => Optimizer::AdamW,
        OptimizerKind::AdamW8bit => Optimizer::AdamW8bit,
        OptimizerKind::Adafactor => Optimizer::Adafactor,
        OptimizerKind::Sgd => Optimizer::Sgd {
            momentum: cfg.train.momentum as f32,
        },
    };
    let mut s = Settings::default()
        .with_base_dtype(base_dtype)
        .with_mixed_precision(mixed_precision)
        .with_method(if cfg.lora.use_dora {
            lora_memory::Method::Dora
        } else {
            lora_memory::Method::Lora
        })
        .with_rank(cfg.lora.rank)
        .with_alpha(cfg.lora.alpha as f32)
        .with_target_modules(&targets)
        .with_lora_dropout(cfg.lora.dropout as f32)
        .with_micro_batch(cfg.train.batch_size)
        .with_gradient_accumulation_steps(cfg.train.gradient_accumulation_steps)
        .with_seq_len(cfg.data.seq_len)
        .with_gradient_checkpointing(cfg.train.gradient_checkpointing)
        .with_optimizer(optimizer)
        .with_device(if cuda { Device::cuda() } else { Device::cpu() });
    if let Some([w, h]) = cfg.data.resolution {
        s = s.with_resolution(w.max(h));
    }
    if let Some(c) = cfg.data.cache_latents {
        s = s.with_cache_latents(c);
    }
    (s, notes)
}

/// Writes fitted settings back into the config (what `auto_fit` changes).
pub fn apply_settings(cfg: &mut TrainConfig, s: &Settings) {
    cfg.train.batch_size = s.micro_batch;
    cfg.train.gradient_accumulation_steps = s.gradient_accumulation_steps;
    cfg.data.seq_len = s.seq_len;
    cfg.train.gradient_checkpointing = s.gradient_checkpointing;
    cfg.lora.rank = s.lora.rank;
    cfg.lora.alpha = f64::from(s.lora.alpha);
    cfg.train.mixed_precision = match s.mixed_precision {
        MixedPrecision::No => Precision::No,
        MixedPrecision::Fp16 => Precision::Fp16,
        MixedPrecision::Bf16 => Precision::Bf16,
        MixedPrecision::FullBf16 => Precision::FullBf16,
    };
    cfg.train.optimizer = match s.optimizer {
        Optimizer::AdamW => OptimizerKind::AdamW,
        Optimizer::AdamW8bit => OptimizerKind::AdamW8bit,
        Optimizer::Adafactor => OptimizerKind::Adafactor,
        Optimizer::Sgd { .. } => OptimizerKind::Sgd,
    };
    match s.base_dtype {
        BaseDtype::F32 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::F32),
        BaseDtype::Bf16 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::Bf16),
        BaseDtype::F16 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::F16),
        _ => cfg.model.weights = BaseWeights::Quantized,
    }
}

/// The budget for a run: an explicit override, else `memory.gpu` / `memory.budget` from the
/// config, else none.
///
/// # Errors
/// Unknown GPU names (with the list of known ones).
pub fn budget_for(cfg: &TrainConfig, override_budget: Option<Budget>) -> Result<Option<Budget>> {
    if override_budget.is_some() {
        return Ok(override_budget);
    }
    if let Some(g) = &cfg.memory.gpu {
        return Ok(Some(Budget::gpu(g)?));
    }
    if let Some(b) = &cfg.memory.budget {
        return Ok(Some(Budget::parse(&b.text)?));
    }
    Ok(None)
}

/// Plans a run: header → settings → estimate → budget check → (auto_fit) `fit()`.
///
/// With `memory.auto_fit` and a budget, the returned plan carries the fitted settings and the
/// changes; `cfg` is updated to match (see [`apply_settings`]).
///
/// # Errors
/// Config / header / budget errors. Not fitting is *not* an error here (see [`Plan::fits`]).
pub fn plan(
    cfg: &mut TrainConfig,
    config_dir: Option<&Path>,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    let (desc, model_source, file_quant) = read_descriptor(cfg, config_dir)?;
    let (settings, mut notes) = settings_for(cfg, file_quant, cuda);
    notes.extend(cfg.notes());
    let budget = budget_for(cfg, override_budget)?;
    let estimate = lora_memory::estimate(&desc, &settings)?;
    let mut plan = Plan {
        model: desc.name().to_string(),
        model_source,
        settings,
        fits: budget.as_ref().map(|b| estimate.peak <= b.bytes),
        estimate,
        budget,
        changes: Vec::new(),
        notes,
        suggestion: Vec::new(),
    };
    if !cfg.memory.auto_fit
        && let Some(b) = plan.budget.clone()
        && plan.fits == Some(false)
    {
        match lora_memory::fit(&desc, &plan.settings, b.bytes) {
            Ok(f) => plan.suggestion = f.changes,
            Err(FitError::DoesNotFit { smallest_peak, .. }) => plan.notes.push(format!(
                "nothing on the fitting ladder (micro-batch, precision, checkpointing, optimizer, rank, quantized base, sequence length) fits this budget; the smallest peak reachable is {smallest_peak}"
            )),
            Err(_) => {}
        }
    }
    if cfg.memory.auto_fit
        && let Some(b) = plan.budget.clone()
        && plan.fits == Some(false)
    {
        match lora_memory::fit(&desc, &plan.settings, b.bytes) {
            Ok(f) => {
                apply_settings(cfg, &f.settings);
                plan.fits = Some(f.estimate.peak <= b.bytes);
                plan.settings = f.settings;
                plan.estimate = f.estimate;
                plan.changes = f.changes;
            }
            Err(FitError::DoesNotFit {
                smallest_peak,
                changes,
                ..
            }) => {
                plan.notes.push(format!(
                    "auto_fit: nothing on the ladder fits; the smallest peak reached is {smallest_peak} after {} changes",
                    changes.len()
                ));
            }
            Err(FitError::Estimate(e)) => return Err(e.into()),
            Err(other) => return Err(JobError::Runtime(other.to_string())),
        }
    }
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

/// How [`run`] is called.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Folder of the config file (relative paths are tried there after the current directory).
    pub config_dir: Option<PathBuf>,
    /// Start even when the plan predicts the run does not fit.
    pub force: bool,
    /// Print progress and the report to stderr/stdout.
    pub verbose: bool,
    /// `None`: start fresh; `Some(None)`: resume from the newest checkpoint of the run's output
    /// folder; `Some(Some(dir))`: resume from that checkpoint. Either is [`JobError::Input`]
    /// before anything loads when there is no such checkpoint (see [`resume_checkpoint`]).
    pub resume: Option<Option<PathBuf>>,
}

/// Held-out evaluation of the model.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct EvalResult {
    /// Mean next-token NLL (nats).
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Tokens scored.
    pub tokens: usize,
}

/// Measured memory of the run.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct MeasuredMemory {
    /// Process resident set right before the first training step (bytes, `/proc/self/status` VmRSS).
    pub rss_before_steps: u64,
    /// Peak resident set during the training steps (VmHWM after resetting it before the steps).
    pub rss_peak_steps: u64,
    /// `rss_peak_steps − rss_before_steps`: what lora-memory's `step_delta` predicts on CPU.
    pub rss_step_delta: u64,
    /// Peak live CPU tensor bytes (the shim's counting allocator), weights included.
    pub tensor_peak: u64,
    /// Peak resident set of the whole process since start (VmHWM before the reset).
    pub rss_peak_process: u64,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The plan it started with.
    pub plan: Plan,
    /// Optimizer steps done.
    pub steps: u64,
    /// Training tokens seen (non-padding).
    pub tokens: u64,
    /// Seconds spent in the training steps.
    pub train_seconds: f64,
    /// Seconds for the whole run.
    pub total_seconds: f64,
    /// `(step, loss)` per logged step.
    pub losses: Vec<(u64, f64)>,
    /// Held-out evaluation before training.
    pub eval_before: Option<EvalResult>,
    /// Held-out evaluation after training.
    pub eval_after: Option<EvalResult>,
    /// Sample generation before training (greedy).
    pub sample_before: Option<String>,
    /// Sample generation after training (greedy).
    pub sample_after: Option<String>,
    /// Measured memory.
    pub memory: MeasuredMemory,
    /// Files written (adapters, summary).
    pub outputs: Vec<PathBuf>,
}

impl RunSummary {
    /// A human-readable summary.
    pub fn report(&self) -> String {
        let mut out = String::new();
        out += &format!(
            "summary: {} optimizer steps, {} tokens in {:.1} s of training ({:.0} tokens/s), {:.1} s in all\n",
            self.steps,
            self.tokens,
            self.train_seconds,
            self.tokens as f64 / self.train_seconds.max(1e-9),
            self.total_seconds
        );
        if let (Some(b), Some(a)) = (self.eval_before, self.eval_after) {
            out += &format!(
                "held-out perplexity: {:.3} → {:.3} ({:+.1}%), mean NLL {:.4} → {:.4} over {} tokens\n",
                b.perplexity,
                a.perplexity,
                100.0 * (a.perplexity / b.perplexity - 1.0),
                b.mean_nll,
                a.mean_nll,
                a.tokens
            );
        }
        if let Some(s) = &self.sample_before {
            out += &format!("sample before: {s:?}\n");
        }
        if let Some(s) = &self.sample_after {
            out += &format!("sample after:  {s:?}\n");
        }
        if self.losses.is_empty() {
            out += "memory: no training step ran in this process; nothing measured\n";
            for o in &self.outputs {
                out += &format!("wrote {}\n", o.display());
            }
            return out;
        }
        let e = &self.plan.estimate;
        let m = &self.memory;
        let pct = |pred: u64, meas: u64| 100.0 * (pred as f64 - meas as f64) / (meas.max(1) as f64);
        out += &format!(
            "memory (CPU): step RSS delta measured {} vs predicted {} ({:+.1}%)\n",
            lora_memory::Bytes(m.rss_step_delta),
            e.step_delta,
            pct(e.step_delta.0, m.rss_step_delta)
        );
        out += &format!(
            "              tensor peak (counting allocator) {} vs predicted allocated peak {} ({:+.1}%)\n",
            lora_memory::Bytes(m.tensor_peak),
            e.peak_allocated,
            pct(e.peak_allocated.0, m.tensor_peak)
        );
        out += &format!(
            "              process peak RSS {} vs predicted process peak {} ({:+.1}%)\n",
            lora_memory::Bytes(m.rss_peak_process.max(m.rss_peak_steps)),
            e.peak_process,
            pct(e.peak_process.0, m.rss_peak_process.max(m.rss_peak_steps))
        );
        for o in &self.outputs {
            out += &format!("wrote {}\n", o.display());
        }
        out
    }
}

fn rt<E: std::fmt::Display>(ctx: &str) -> impl FnOnce(E) -> JobError + '_ {
    move |e| JobError::Runtime(format!("{ctx}: {e}"))
}

/// `VmRSS` and `VmHWM` of this process in bytes (Linux; zeros elsewhere).
pub fn proc_rss() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = |key: &str| {
        s.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// Resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`, Linux ≥ 4.0), so the
/// next `VmHWM` is the peak from now on. Returns false when not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Reads the training text: one file, or every `.txt` file of a folder (sorted), cut to
/// `max_bytes` at a character boundary.
/// Prepares `train.output_dir` before anything is loaded: it must be a folder (or not exist
/// yet). When it holds a previous run's `checkpoints/` (and `logs/`) and this run is not a
/// `--resume`, those are moved aside as `<name>.prev-<unix time>`: a fresh run never interleaves
/// its checkpoints and metrics with an old run's (a later `--resume` would continue the wrong
/// one), and nothing the old run left is deleted.
///
/// # Errors
/// [`JobError::Config`] naming `train.output_dir` when it is a file; [`JobError::Runtime`] when
/// moving fails.
pub fn check_output_dir(cfg: &TrainConfig, opts: &RunOptions) -> Result<()> {
    let out = PathBuf::from(&cfg.train.output_dir);
    if out.exists() && !out.is_dir() {
        return Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.output_dir".into(),
            value: format!("{:?}", cfg.train.output_dir),
            expected: "a folder, but a file of that name exists; choose another output_dir".into(),
        }));
    }
    check_writable(cfg)?;
    resume_checkpoint(cfg, opts)?;
    let ckpt = out.join("checkpoints");
    let has_run = std::fs::read_dir(&ckpt)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("step-"))
        })
        .unwrap_or(false);
    if !has_run || opts.resume.is_some() {
        return Ok(());
    }
    let mut names = vec!["checkpoints".to_string()];
    if cfg.logging.logging_dir.is_none() {
        names.push("logs".into());
    }
    if opts.verbose {
        eprintln!(
            "{} holds a previous run; starting a new one (use --resume to continue it)",
            out.display()
        );
    }
    move_aside(&out, &names, opts.verbose)?;
    Ok(())
}

/// Creates `train.output_dir` and writes (then removes) a probe file in it, so a read-only or
/// otherwise unwritable folder is reported before the model loads rather than at the first
/// checkpoint.
///
/// # Errors
/// [`JobError::Config`] naming `train.output_dir`, the OS error and what to do.
pub fn check_writable(cfg: &TrainConfig) -> Result<()> {
    let out = PathBuf::from(&cfg.train.output_dir);
    let bad = |what: String| {
        JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.output_dir".into(),
            value: format!("{:?}", cfg.train.output_dir),
            expected: format!(
                "a folder this user can write, but {what}; choose another output_dir or fix its permissions"
            ),
        })
    };
    std::fs::create_dir_all(&out)
        .map_err(|e| bad(format!("creating {} failed: {e}", out.display())))?;
    let probe = out.join(format!(".lora-train-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .map_err(|e| bad(format!("writing a file in {} failed: {e}", out.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The checkpoint a `--resume` run continues from and its loop counters, read before the model
/// loads: the newest complete `step-*` folder under `<train.output_dir>/checkpoints` for
/// `--resume`, or the folder given to `--resume DIR`. `None` when the run does not resume.
///
/// # Errors
/// [`JobError::Input`] naming the folder searched when there is no checkpoint, or the folder
/// given when it is not a checkpoint (with the newest checkpoint inside it as a hint when it is
/// a run's output folder).
pub fn resume_checkpoint(
    cfg: &TrainConfig,
    opts: &RunOptions,
) -> Result<Option<(PathBuf, crate::checkpoint::TrainerCounters)>> {
    use crate::checkpoint::{Checkpoint, CheckpointManager};
    let Some(resume) = &opts.resume else {
        return Ok(None);
    };
    let ckpt_dir = PathBuf::from(&cfg.train.output_dir).join("checkpoints");
    let latest_in = |d: &Path| CheckpointManager::new(d, 1).latest().ok().flatten();
    let path = match resume {
        None => latest_in(&ckpt_dir).ok_or_else(|| {
            JobError::Input(format!(
                "--resume: no checkpoint in {} (the checkpoints of train.output_dir {:?}); \
                 nothing to resume — run without --resume to start fresh, or pass --resume DIR \
                 with a step-* folder of another run",
                ckpt_dir.display(),
                cfg.train.output_dir
            ))
        })?,
        Some(dir) => {
            if !dir.is_dir() {
                return Err(JobError::Input(format!(
                    "--resume {}: no such folder; pass one of the step-* folders under {}, or \
                     --resume alone for the newest",
                    dir.display(),
                    ckpt_dir.display()
                )));
            }
            if !CheckpointManager::is_checkpoint(dir) {
                let hint = latest_in(dir)
                    .or_else(|| latest_in(&dir.join("checkpoints")))
                    .map(|p| format!("did you mean {}?", p.display()))
                    .unwrap_or_else(|| {
                        format!(
                            "pass one of the step-* folders under {}, or --resume alone for the newest",
                            ckpt_dir.display()
                        )
                    });
                return Err(JobError::Input(format!(
                    "--resume {}: not a checkpoint (a checkpoint is a step-* folder holding \
                     state.json); {hint}",
                    dir.display()
                )));
            }
            dir.clone()
        }
    };
    let counters = Checkpoint::read_counters(&path)
        .map_err(|e| JobError::Input(format!("--resume {}: {e}", path.display())))?;
    check_resume_adapter(cfg, &path)?;
    Ok(Some((path, counters)))
}

/// Compares the adapter settings a checkpoint was written with ([`crate::checkpoint::ADAPTER_CONFIG_KEYS`]:
/// rank, alpha, target_modules, …) with the run's, before any tensor is read: a changed rank
/// would otherwise fail late on a tensor shape, a changed alpha silently train another adapter.
/// With `memory.auto_fit` the rank and alpha are not compared (the fit may choose them after
/// this check).
///
/// # Errors
/// [`JobError::Input`] naming each key with the checkpoint's and the config's value.
fn check_resume_adapter(cfg: &TrainConfig, checkpoint: &Path) -> Result<()> {
    use crate::checkpoint::{Checkpoint, adapter_config_mismatches};
    let saved = Checkpoint::read_config(checkpoint)
        .map_err(|e| JobError::Input(format!("--resume {}: {e}", checkpoint.display())))?;
    let run = serde_json::to_value(cfg).map_err(rt("serializing the config"))?;
    let skip: &[&str] = if cfg.memory.auto_fit {
        &["lora.rank", "lora.alpha"]
    } else {
        &[]
    };
    let diffs = adapter_config_mismatches(&saved, &run, skip);
    let Some(first) = diffs.first() else {
        return Ok(());
    };
    let each: Vec<String> = diffs
        .iter()
        .map(|d| {
            format!(
                "{} is {} in the checkpoint but {} in the config",
                d.key, d.checkpoint, d.config
            )
        })
        .collect();
    Err(JobError::Input(format!(
        "--resume {}: the checkpoint's adapter does not match the config: {}. A resumed run \
         continues the same adapter: set {}: {} in the config again, or run without --resume \
         to start a new run",
        checkpoint.display(),
        each.join("; "),
        first.key,
        first.checkpoint
    )))
}

/// Renames each existing `dir/<name>` to `dir/<name>.prev-<unix time>` (nothing is deleted), and
/// says so when `verbose`.
fn move_aside(dir: &Path, names: &[String], verbose: bool) -> Result<()> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    for name in names {
        let p = dir.join(name);
        if p.exists() {
            let kept = dir.join(format!("{name}.prev-{stamp}"));
            std::fs::rename(&p, &kept).map_err(rt(&format!(
                "moving the existing {} aside to {}",
                p.display(),
                kept.display()
            )))?;
            if verbose {
                eprintln!("kept the existing {} as {}", p.display(), kept.display());
            }
        }
    }
    Ok(())
}

/// Refuses `system.device: cuda` / `cuda:N` when libtorch sees no such CUDA device, before
/// anything loads (libtorch's own error comes only at the first tensor moved there).
///
/// # Errors
/// [`JobError::Config`] naming `system.device`, what libtorch sees and what to do.
pub fn check_device(cfg: &TrainConfig) -> Result<()> {
    let d = cfg.system.device.as_str();
    let index = match d {
        "cuda" => 0,
        _ => match d.strip_prefix("cuda:").and_then(|n| n.parse::<i64>().ok()) {
            Some(i) => i,
            None => return Ok(()),
        },
    };
    let count = if tch::Cuda::is_available() {
        tch::Cuda::device_count()
    } else {
        0
    };
    if index < count {
        return Ok(());
    }
    Err(JobError::Config(crate::config::ConfigError::InvalidValue {
        key: "system.device".into(),
        value: format!("{d:?}"),
        expected: if count == 0 {
            "a device this machine has, but libtorch sees no CUDA device here (no GPU, no driver, \
             or a CPU-only libtorch); use \"cpu\" or \"auto\", and see `lora-train doctor`"
                .into()
        } else {
            format!(
                "a device this machine has, but libtorch sees {count} CUDA device(s) (cuda:0…cuda:{}); use one of those or \"auto\"",
                count - 1
            )
        },
    }))
}

/// Checks plain training text before the model loads: not empty, and (with
/// `data.eval_fraction` > 0 and no `data.eval_file`) a held-out tail that is not empty either.
///
/// # Errors
/// [`JobError::Input`] naming the file and what to do.
fn check_plain_text(cfg: &TrainConfig, path: &Path, text: &str) -> Result<()> {
    if text.trim().is_empty() {
        return Err(JobError::Input(format!(
            "data.train_data_dir {}: {}; point data.train_data_dir at a UTF-8 text file, or a \
             folder of .txt files, with the text to train on",
            path.display(),
            if path.is_dir() {
                "its .txt files hold no text"
            } else {
                "the file holds no text"
            }
        )));
    }
    if cfg.data.eval_file.is_none() && cfg.data.eval_fraction > 0.0 {
        let (_, held) = split_tail(text, cfg.data.eval_fraction);
        if held.trim().is_empty() {
            return Err(JobError::Input(format!(
                "data.train_data_dir {}: the held-out split (the last {}% of its {} bytes, from a \
                 line start) is empty; use more text (several lines), set data.eval_fraction: 0, or \
                 give data.eval_file",
                path.display(),
                100.0 * cfg.data.eval_fraction,
                text.len()
            )));
        }
    }
    Ok(())
}

/// When `out_dir/summary.json` says the run ended and exported at `step`, the summary of that
/// run (what a `--resume` of a finished run returns: nothing left to do).
fn finished_run(out_dir: &Path, step: u64, plan: Plan) -> Option<RunSummary> {
    let text = std::fs::read_to_string(out_dir.join("summary.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    if v["steps"].as_u64() != Some(step) {
        return None;
    }
    let outputs = v["outputs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_str().map(PathBuf::from))
                .collect()
        })
        .unwrap_or_default();
    Some(RunSummary {
        plan,
        steps: step,
        tokens: v["tokens"].as_u64().unwrap_or(0),
        train_seconds: 0.0,
        total_seconds: 0.0,
        losses: Vec::new(),
        eval_before: None,
        eval_after: None,
        sample_before: None,
        sample_after: None,
        memory: MeasuredMemory::default(),
        outputs,
    })
}

fn already_finished(step: u64, out_dir: &Path) -> String {
    format!(
        "run already finished at step {step}; nothing to do (its adapter and summary.json are in \
         {}). To train further, raise train.max_steps (or train.epochs) and --resume again",
        out_dir.display()
    )
}

/// Writes a report to stdout, turning a failed write (a full disk) into an error instead of
/// `print!`'s panic.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut so = std::io::stdout().lock();
    so.write_all(text.as_bytes())
        .and_then(|()| so.flush())
        .map_err(|e| JobError::Runtime(format!("writing to stdout failed: {e}")))
}

fn read_text(path: &Path, max_bytes: Option<u64>) -> Result<(String, Vec<PathBuf>)> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .map_err(rt(&format!("reading folder {}", path.display())))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    let mut text = String::new();
    for f in &files {
        let bytes = std::fs::read(f).map_err(rt(&format!("reading {}", f.display())))?;
        let t = String::from_utf8(bytes).map_err(|e| {
            JobError::Config(crate::config::ConfigError::InvalidValue {
                key: "data.train_data_dir".into(),
                value: format!("{:?}", f.display().to_string()),
                expected: format!(
                    "UTF-8 text, but byte {} of {} is not valid UTF-8; convert the file \
                     (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or remove it from the folder",
                    e.utf8_error().valid_up_to(),
                    f.display()
                ),
            })
        })?;
        text.push_str(&t);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        if max_bytes.is_some_and(|m| text.len() as u64 >= m) {
            break;
        }
    }
    if let Some(m) = max_bytes {
        let mut cut = (m as usize).min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    Ok((text, files))
}

/// Splits `text` into (train, held-out): the last `fraction` of it, starting at a line boundary.
pub fn split_tail(text: &str, fraction: f64) -> (&str, &str) {
    if fraction <= 0.0 {
        return (text, "");
    }
    let mut at = ((1.0 - fraction) * text.len() as f64) as usize;
    while at < text.len() && !text.is_char_boundary(at) {
        at += 1;
    }
    let at = text[at..]
        .find('\n')
        .map(|i| at + i + 1)
        .unwrap_or(at)
        .min(text.len());
    (&text[..at], &text[at..])
}

fn evaluate(
    model: &lora_models::llama::Llama,
    ids: &[i64],
    seq_len: usize,
) -> Result<Option<EvalResult>> {
    if ids.len() < 2 {
        return Ok(None);
    }
    let opts = lora_models::llama::PerplexityOptions {
        max_length: seq_len,
        stride: seq_len,
    };
    let r = model
        .perplexity_ids(ids, &opts)
        .map_err(rt("held-out perplexity"))?;
    Ok(Some(EvalResult {
        mean_nll: r.mean_nll,
        perplexity: r.perplexity,
        tokens: r.tokens_scored,
    }))
}

fn sample(
    model: &lora_models::llama::Llama,
    tok: &lora_models::tokenizer::Tokenizer,
    prompt: &str,
    max_new: u32,
) -> Result<String> {
    let ids = tok
        .encode(prompt, false)
        .map_err(rt("tokenizing the sample prompt"))?;
    let opts = lora_models::llama::GenerateOptions {
        max_new_tokens: max_new as usize,
        ..Default::default()
    };
    let g = model
        .generate(&ids, &opts)
        .map_err(rt("sample generation"))?;
    tok.decode(&g.tokens, true)
        .map_err(rt("decoding the sample"))
}

/// The PEFT `LoraConfig` of a run.
///
/// # Errors
/// [`JobError::Runtime`] when lora-core rejects the settings.
pub fn lora_config(cfg: &TrainConfig, base_model: &str) -> Result<lora_core::config::LoraConfig> {
    let mut v = cfg.lora.to_peft_json();
    if let serde_json::Value::Object(m) = &mut v {
        m.insert("task_type".into(), "CAUSAL_LM".into());
        m.insert("base_model_name_or_path".into(), base_model.into());
        m.insert("peft_type".into(), "LORA".into());
    }
    let c: lora_core::config::LoraConfig =
        serde_json::from_value(v).map_err(rt("building the LoRA config"))?;
    c.validate().map_err(rt("validating the LoRA config"))?;
    Ok(c)
}

/// Loads a LLaMA-family base and its tokenizer from a GGUF file or an HF folder.
///
/// # Errors
/// [`JobError::Runtime`] with the loader's message.
pub fn load_base(
    path: &Path,
    weights: BaseWeights,
    dtype: Dtype,
    device: tch::Device,
) -> Result<(lora_models::llama::Llama, lora_models::tokenizer::Tokenizer)> {
    use lora_models::llama::{Llama, WeightMode};
    let kind = match dtype {
        Dtype::F32 => tch::Kind::Float,
        Dtype::Bf16 => tch::Kind::BFloat16,
        Dtype::F16 => tch::Kind::Half,
    };
    let mode = match weights {
        BaseWeights::Dense => WeightMode::Dense(kind),
        BaseWeights::Quantized => WeightMode::KeepQuantized,
    };
    let ctx = format!("loading {}", path.display());
    // A malformed file is bad input (exit 2 in the CLI), named with what to do; a libtorch
    // failure while loading (out of memory, …) stays a runtime error.
    let rt = |ctx: &str| {
        let ctx = ctx.to_string();
        move |e: lora_models::Error| {
            use lora_models::Error as M;
            match e {
                M::Gguf { .. }
                | M::Safetensors { .. }
                | M::Metadata { .. }
                | M::MissingTensor { .. }
                | M::Shape { .. }
                | M::Config { .. }
                | M::Unsupported { .. } => JobError::Input(format!(
                    "{e}; the file is damaged (a truncated download?) or not a model this \
                     tool reads — check its size and checksum, or download it again"
                )),
                other => JobError::Runtime(format!("{ctx}: {other}")),
            }
        }
    };
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let model = Llama::from_gguf(path, mode, device).map_err(rt(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer_from_gguf(path).map_err(rt(&ctx))?;
        Ok((model, tok))
    } else {
        let model = Llama::from_safetensors(path, mode, device).map_err(rt(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer(path.join("tokenizer.json"))
            .map_err(rt(&ctx))?;
        Ok((model, tok))
    }
}

/// The causal-LM [`crate::trainer::TrainStep`]: a LLaMA-family model with LoRA adapters and
/// packed text batches; loss = mean next-token NLL over labels ≠ −100 ([`lora_models::llama::Llama::loss`]).
pub struct LlamaTask<'a> {
    /// The model (adapters injected).
    pub model: &'a lora_models::llama::Llama,
    /// Adapter tensors by VarStore name (`<module>.lora_A.default.weight`, …), sorted.
    pub named: Vec<(String, tch::Tensor)>,
    /// LoRA+ ratio for the B matrices, if any.
    pub loraplus_lr_ratio: Option<f64>,
}

fn model_err(e: lora_models::Error) -> crate::trainer::TrainError {
    match e {
        lora_models::Error::Torch(t) => crate::trainer::TrainError::Torch(t),
        other => crate::trainer::TrainError::App(other.to_string()),
    }
}

impl crate::trainer::TrainStep for LlamaTask<'_> {
    type Batch = lora_data::text::TextBatch;

    fn loss(&mut self, b: &Self::Batch, train: bool) -> crate::trainer::Result<tch::Tensor> {
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss(&ids, &labels, Some(&mask), Some(&pos), train)
            .map_err(model_err)
    }

    /// With gradient checkpointing on, the model recomputes each decoder layer during backward
    /// ([`Llama::loss_backward`](lora_models::llama::Llama::loss_backward)); otherwise the
    /// trainer's plain path runs.
    fn loss_backward(
        &mut self,
        b: &Self::Batch,
        scale: f64,
    ) -> crate::trainer::Result<Option<tch::Tensor>> {
        if !self.model.gradient_checkpointing() {
            return Ok(None);
        }
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss_backward(&ids, &labels, Some(&mask), Some(&pos), true, scale)
            .map(Some)
            .map_err(model_err)
    }

    fn named_trainable(&self) -> Vec<(String, tch::Tensor)> {
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

    fn micro_batch_len(&self, b: &Self::Batch) -> usize {
        b.input_ids.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(
        &self,
        b: &Self::Batch,
        parts: usize,
    ) -> crate::trainer::Result<Vec<Self::Batch>> {
        let n = parts.max(1) as i64;
        let ids = b.input_ids.f_chunk(n, 0)?;
        let labels = b.labels.f_chunk(n, 0)?;
        let mask = b.attention_mask.f_chunk(n, 0)?;
        let pos = b.position_ids.f_chunk(n, 0)?;
        let docs = match &b.doc_ids {
            Some(t) => Some(t.f_chunk(n, 0)?),
            None => None,
        };
        let mut out = Vec::new();
        for i in 0..ids.len() {
            out.push(lora_data::text::TextBatch {
                input_ids: ids[i].shallow_clone(),
                labels: labels[i].shallow_clone(),
                attention_mask: mask[i].shallow_clone(),
                position_ids: pos[i].shallow_clone(),
                doc_ids: docs.as_ref().map(|d| d[i].shallow_clone()),
            });
        }
        Ok(out)
    }

    fn batch_tokens(&self, b: &Self::Batch) -> u64 {
        b.attention_mask
            .f_sum(tch::Kind::Int64)
            .and_then(|t| t.f_int64_value(&[]))
            .unwrap_or(0)
            .max(0) as u64
    }
}

/// The trainer's batch source over lora-data's text loader: the loader's seeded per-epoch plan,
/// batches built in the training thread; the position (epoch, batch index) is checkpointed.
pub struct TextSource {
    loader: lora_data::loader::Loader<lora_data::text::TextDataset, lora_data::text::TextCollate>,
    collate: lora_data::text::TextCollate,
    plan: Vec<Vec<usize>>,
    epoch: u64,
    next: usize,
}

impl TextSource {
    /// Wraps a loader.
    pub fn new(
        loader: lora_data::loader::Loader<
            lora_data::text::TextDataset,
            lora_data::text::TextCollate,
        >,
    ) -> Self {
        let collate = loader.dataset().collate();
        TextSource {
            loader,
            collate,
            plan: Vec::new(),
            epoch: 0,
            next: 0,
        }
    }
}

fn data_err(e: lora_data::Error) -> crate::trainer::TrainError {
    crate::trainer::TrainError::App(format!("data: {e}"))
}

impl crate::trainer::BatchSource<lora_data::text::TextBatch> for TextSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::trainer::Result<()> {
        self.plan = self.loader.plan(epoch);
        self.epoch = epoch;
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::trainer::Result<Option<lora_data::text::TextBatch>> {
        use lora_data::loader::{Collate, Dataset};
        let Some(idx) = self.plan.get(self.next) else {
            return Ok(None);
        };
        let items = idx
            .iter()
            .map(|&i| self.loader.dataset().get(i))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(data_err)?;
        self.next += 1;
        self.collate.collate(items).map(Some).map_err(data_err)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "next": self.next, "rows": lora_data::loader::Dataset::len(self.loader.dataset())})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::trainer::Result<()> {
        let bad = |m: &str| crate::trainer::TrainError::State {
            what: "loader position".into(),
            message: m.into(),
        };
        let rows = state["rows"].as_u64().ok_or_else(|| bad("no row count"))?;
        if rows != lora_data::loader::Dataset::len(self.loader.dataset()) as u64 {
            return Err(bad(&format!(
                "the checkpoint was taken over {rows} rows, this dataset has {}; resume with the same data and seq_len",
                lora_data::loader::Dataset::len(self.loader.dataset())
            )));
        }
        let epoch = state["epoch"].as_u64().ok_or_else(|| bad("no epoch"))?;
        let next = state["next"]
            .as_u64()
            .ok_or_else(|| bad("no batch index"))? as usize;
        self.start_epoch(epoch)?;
        self.next = next.min(self.plan.len());
        Ok(())
    }
}

/// The engine's settings for a config.
///
/// # Errors
/// [`JobError::Runtime`] for settings the engine rejects.
pub fn trainer_config(
    cfg: &TrainConfig,
    device: tch::Device,
    out_dir: &Path,
    total_steps: u64,
) -> Result<crate::trainer::TrainerConfig> {
    use crate::config::{NanPolicy, SchedulerKind as S};
    use crate::optim::{AdafactorConfig, AdamWConfig, OptimizerKind as O, SgdConfig};
    use crate::sched::SchedulerKind as E;
    let t = &cfg.train;
    let adamw = AdamWConfig {
        weight_decay: t.weight_decay,
        ..AdamWConfig::default()
    };
    let optimizer = match t.optimizer {
        OptimizerKind::AdamW => O::AdamW(adamw),
        OptimizerKind::AdamW8bit => O::AdamW8bit(adamw),
        OptimizerKind::Adafactor => O::Adafactor(AdafactorConfig::default()),
        OptimizerKind::Sgd => O::Sgd(SgdConfig {
            momentum: t.momentum,
            weight_decay: t.weight_decay,
            ..SgdConfig::default()
        }),
    };
    let scheduler = match t.lr_scheduler {
        S::Constant => E::Constant,
        S::ConstantWithWarmup => E::ConstantWithWarmup,
        S::Linear => E::Linear,
        S::Cosine => E::Cosine { num_cycles: 0.5 },
        S::CosineWithRestarts => E::CosineWithRestarts {
            num_cycles: f64::from(t.num_cycles.max(1)),
        },
        S::Polynomial => E::Polynomial {
            lr_end: 1e-7,
            power: t.power,
        },
    };
    let precision = match t.mixed_precision {
        Precision::No => crate::precision::Precision::Fp32,
        Precision::Bf16 => crate::precision::Precision::Bf16,
        Precision::Fp16 => crate::precision::Precision::Fp16,
        Precision::FullBf16 => crate::precision::Precision::FullBf16,
    };
    Ok(crate::trainer::TrainerConfig {
        lr: t.learning_rate,
        optimizer,
        scheduler,
        warmup_steps: t.warmup_steps,
        epochs: u64::from(t.epochs),
        max_steps: Some(total_steps),
        gradient_accumulation_steps: t.gradient_accumulation_steps.max(1) as usize,
        max_grad_norm: (t.max_grad_norm > 0.0).then_some(t.max_grad_norm),
        precision,
        device,
        non_finite: match t.nan_policy {
            NanPolicy::Skip => crate::trainer::NonFinitePolicy::Skip,
            NanPolicy::LowerLr => crate::trainer::NonFinitePolicy::LowerLr { factor: 0.5 },
            NanPolicy::Stop => crate::trainer::NonFinitePolicy::Stop,
        },
        checkpoint_dir: Some(out_dir.join("checkpoints")),
        save_every_n_steps: t.save_every_n_steps,
        save_every_n_epochs: t.save_every_n_epochs.map(u64::from),
        keep_last: t.keep_last_checkpoints.max(1) as usize,
        seed: Some(cfg.system.seed),
        track_cpu_memory: true,
        run_config: serde_json::to_value(cfg).map_err(rt("serializing the config"))?,
        ..crate::trainer::TrainerConfig::default()
    })
}

/// After training: warns when steps were skipped as non-finite, and refuses a run whose
/// evaluation loss (`what`, e.g. "held-out loss"; `None` when nothing was evaluated) ended
/// non-finite, so that no diverged adapter is
/// exported (it would only break the tools that load it). Shared by the LLM and SD jobs.
///
/// # Errors
/// [`JobError::Runtime`] naming the loss, the skipped steps, what to change and the last
/// checkpoint.
pub(crate) fn check_not_diverged(
    report: &crate::trainer::TrainReport,
    what: &str,
    loss: Option<f64>,
) -> Result<()> {
    if report.skipped_steps > 0 {
        eprintln!(
            "warning: {} of {} optimizer steps were skipped (non-finite loss or gradients; see logs/metrics.jsonl)",
            report.skipped_steps, report.steps
        );
    }
    let Some(loss) = loss.filter(|l| !l.is_finite()) else {
        return Ok(());
    };
    Err(JobError::Runtime(format!(
        "training diverged: the {what} after training is {loss} ({} of {} steps skipped as non-finite); nothing was exported. Lower train.learning_rate or set train.max_grad_norm (e.g. 1.0){}",
        report.skipped_steps,
        report.steps,
        report
            .last_checkpoint
            .as_ref()
            .map(|c| format!("; last checkpoint: {}", c.display()))
            .unwrap_or_default()
    )))
}

/// Runs the causal-LM job: plan (refusing a run predicted not to fit unless forced) → load →
/// inject → data → train → export → summary.
///
/// # Errors
/// [`JobError::DoesNotFit`] before loading anything; config, file and runtime errors.
pub fn run(mut cfg: TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    use lora_data::loader::{Loader, LoaderConfig};
    use lora_data::text::{TextConfig, TextDataset, TextFormat};
    let t_start = std::time::Instant::now();
    let say = |s: &str| {
        if opts.verbose {
            eprintln!("[{:6.1} s] {s}", t_start.elapsed().as_secs_f64());
        }
    };
    // Count tensor bytes from the start so the weights are in the allocator peak.
    let _ = lora_core::sys::install_counting_cpu_allocator();
    if let Some(n) = cfg.system.num_threads {
        tch::set_num_threads(n as i32);
    }
    check_device(&cfg)?;
    let cuda = match cfg.system.device.as_str() {
        "cpu" => false,
        "auto" => tch::Cuda::is_available(),
        _ => true,
    };
    let device = match cfg.system.device.as_str() {
        "cpu" => tch::Device::Cpu,
        "auto" => tch::Device::cuda_if_available(),
        d => tch::Device::Cuda(
            d.strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
        ),
    };

    // 1–3. plan
    let plan = plan(&mut cfg, opts.config_dir.as_deref(), None, cuda)?;
    if opts.verbose {
        write_stdout(&plan.report())?;
    }
    if plan.fits == Some(false) {
        let b = plan
            .budget
            .clone()
            .map(|b| (b.bytes, budget_source(&b)))
            .unwrap_or_default();
        if !(opts.force || cfg.memory.force) {
            return Err(JobError::DoesNotFit {
                peak: plan.estimate.peak,
                budget: b.0,
                source_desc: b.1,
            });
        }
        say("warning: predicted not to fit; starting anyway (forced)");
    }

    // CPU: freed tensors go back to the OS so RSS follows the plan (see MemorySection).
    if !cuda
        && cfg.memory.cpu_return_freed
        && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && lora_core::sys::set_malloc_mmap_threshold(lora_core::sys::RETURN_FREED_MMAP_THRESHOLD)
    {
        say("CPU allocator: blocks ≥ 128 KiB are returned to the OS when freed");
    }

    check_output_dir(&cfg, opts)?;
    let out_dir = PathBuf::from(&cfg.train.output_dir);
    let resume_from = resume_checkpoint(&cfg, opts)?;
    if let Some((path, counters)) = &resume_from {
        say(&format!(
            "resuming from {} (step {}{})",
            path.display(),
            counters.step,
            cfg.train
                .max_steps
                .map(|m| format!(" of {m}"))
                .unwrap_or_default()
        ));
        if let Some(m) = cfg.train.max_steps
            && counters.step >= m
            && let Some(done) = finished_run(&out_dir, counters.step, plan.clone())
        {
            say(&already_finished(counters.step, &out_dir));
            return Ok(done);
        }
    }

    // Data first: a missing or unreadable (non-UTF-8) data file fails before the model loads.
    let data_written =
        cfg.data
            .train_data_dir
            .clone()
            .ok_or_else(|| crate::config::ConfigError::Missing {
                key: "data.train_data_dir".into(),
                hint: "set it to a text file or a folder of .txt files".into(),
            })?;
    let data_path = resolve_path(
        "data.train_data_dir",
        &data_written,
        opts.config_dir.as_deref(),
    )?;
    let mut plain_text = if matches!(cfg.data.format, crate::config::DataFormat::Text) {
        let (text, files) = read_text(&data_path, cfg.data.max_bytes)?;
        check_plain_text(&cfg, &data_path, &text)?;
        Some((text, files))
    } else {
        None
    };

    // 4. load, inject
    let base_written = cfg.base_model()?.to_string();
    let base_path = resolve_path(
        "model.base_model",
        &base_written,
        opts.config_dir.as_deref(),
    )?;
    say(&format!(
        "loading {} ({:?}, {:?}) on {device:?}",
        base_path.display(),
        cfg.model.weights,
        cfg.model.dtype
    ));
    let (mut model, tok) = load_base(&base_path, cfg.model.weights, cfg.model.dtype, device)?;
    let interrupted_before_training = || JobError::Interrupted {
        step: resume_from.as_ref().map(|r| r.1.step).unwrap_or(0),
        checkpoint: resume_from.as_ref().map(|r| r.0.clone()),
    };
    if crate::trainer::stop_requested() {
        return Err(interrupted_before_training());
    }
    model.set_gradient_checkpointing(cfg.train.gradient_checkpointing);
    tch::manual_seed(cfg.system.seed as i64);
    let lcfg = lora_config(&cfg, &base_written)?;
    let vs = tch::nn::VarStore::new(device);
    let report = lora_core::inject::inject(&mut model, &lcfg, "default", &vs.root())
        .map_err(rt("injecting LoRA"))?;
    say(&format!(
        "LoRA r{} α{} on {} modules: {} trainable of {} parameters ({:.3}%)",
        cfg.lora.rank,
        cfg.lora.alpha,
        report.modules.len(),
        report.trainable_params,
        report.all_params,
        report.trainable_percent()
    ));

    // data (read above, before the model)
    let seq_len = cfg.data.seq_len as usize;
    let text_cfg = TextConfig {
        format: match cfg.data.format {
            crate::config::DataFormat::Text => TextFormat::Plain,
            crate::config::DataFormat::Jsonl => TextFormat::Jsonl {
                text_field: "text".into(),
            },
            crate::config::DataFormat::Alpaca => TextFormat::Alpaca,
            crate::config::DataFormat::Chat => TextFormat::Conversations,
            crate::config::DataFormat::Images => {
                return Err(crate::config::ConfigError::InvalidValue {
                    key: "data.format".into(),
                    value: "\"images\"".into(),
                    expected: "a text format (text, jsonl, alpaca, chat) for the causal-LM job"
                        .into(),
                }
                .into());
            }
        },
        seq_len,
        packing: true,
        eos_token_id: tok.eos_id,
        pad_token_id: tok.pad_id.or(tok.eos_id).unwrap_or(0),
        seed: cfg.system.seed,
        ..TextConfig::default()
    };
    let (train_ds, eval_ids, data_stats) = if matches!(text_cfg.format, TextFormat::Plain) {
        let (text, files) = match plain_text.take() {
            Some(t) => t,
            None => read_text(&data_path, cfg.data.max_bytes)?,
        };
        let (train_text, mut held) = split_tail(
            &text,
            if cfg.data.eval_file.is_some() {
                0.0
            } else {
                cfg.data.eval_fraction
            },
        );
        let eval_text;
        if let Some(e) = &cfg.data.eval_file {
            let p = resolve_path("data.eval_file", e, opts.config_dir.as_deref())?;
            eval_text =
                std::fs::read_to_string(&p).map_err(rt(&format!("reading {}", p.display())))?;
            held = &eval_text;
        }
        let ds = TextDataset::from_texts(&[(&data_written, train_text)], tok.inner(), text_cfg)
            .map_err(rt("building the text dataset"))?;
        let eval_ids = if held.is_empty() {
            Vec::new()
        } else {
            tok.encode(held, false)
                .map_err(rt("tokenizing held-out text"))?
        };
        let st = ds.stats();
        let stats = serde_json::json!({
            "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            "train_bytes": train_text.len(),
            "eval_bytes": held.len(),
            "train_tokens": st.tokens,
            "rows": st.rows,
            "seq_len": seq_len,
            "eval_tokens": eval_ids.len(),
        });
        (ds, eval_ids, stats)
    } else {
        let full = TextDataset::from_files(&[&data_path], tok.inner(), text_cfg)
            .map_err(rt("building the dataset"))?;
        let (t, v) = full
            .split(cfg.data.eval_fraction, cfg.system.seed)
            .map_err(rt("splitting the dataset"))?;
        let eval_ids: Vec<i64> = v
            .documents()
            .iter()
            .flat_map(|d| d.ids.iter().copied())
            .collect();
        let st = t.stats();
        let stats = serde_json::json!({
            "files": [data_path.display().to_string()],
            "documents": st.documents, "train_tokens": st.tokens, "rows": st.rows,
            "seq_len": seq_len, "eval_tokens": eval_ids.len(),
        });
        (t, eval_ids, stats)
    };
    let rows = lora_data::loader::Dataset::len(&train_ds);
    let train_tokens = data_stats["train_tokens"].as_u64().unwrap_or(0);
    if train_tokens < 2 {
        return Err(JobError::Input(format!(
            "{}: the training text is empty ({train_tokens} tokens after the held-out split); \
             point data.train_data_dir at a file with text",
            data_path.display()
        )));
    }
    if cfg.data.eval_fraction > 0.0 && eval_ids.len() < 2 {
        return Err(JobError::Input(format!(
            "{}: the held-out split (data.eval_fraction {}) has {} tokens; use more text or set \
             data.eval_fraction: 0",
            data_path.display(),
            cfg.data.eval_fraction,
            eval_ids.len()
        )));
    }
    if rows == 0 {
        return Err(JobError::Input(format!(
            "{}: no training rows of {seq_len} tokens; use more text or a smaller data.seq_len",
            data_path.display()
        )));
    }
    let collate = train_ds.collate();
    let micro = cfg.train.batch_size as usize;
    let loader = Loader::new(
        train_ds,
        collate,
        LoaderConfig {
            batch_size: micro,
            shuffle: cfg.data_loader.shuffle,
            drop_last: false,
            seed: cfg.system.seed,
            num_workers: cfg.data_loader.num_workers as usize,
            prefetch_factor: cfg.data_loader.prefetch_factor.max(1) as usize,
            persistent_workers: cfg.data_loader.persistent_workers,
        },
    )
    .map_err(rt("building the data loader"))?;
    let accum = cfg.train.gradient_accumulation_steps.max(1) as usize;
    let per_epoch = loader.batches_per_epoch().div_ceil(accum) as u64;
    let total_steps = cfg
        .train
        .max_steps
        .unwrap_or(per_epoch * u64::from(cfg.train.epochs))
        .max(1);
    if cfg.train.max_steps.is_some() {
        // train.max_steps wins over train.epochs (HF Trainer `max_steps`, kohya
        // `max_train_steps`): run as many epochs as the steps need.
        let need = total_steps.div_ceil(per_epoch.max(1));
        cfg.train.epochs = u32::try_from(need)
            .unwrap_or(u32::MAX)
            .max(cfg.train.epochs);
    }
    let trainer_total = total_steps;
    let capped = if cfg.train.max_steps.is_some() && per_epoch > 0 && total_steps > per_epoch {
        format!(" ({} epochs)", total_steps.div_ceil(per_epoch))
    } else {
        String::new()
    };
    say(&format!(
        "data: {rows} rows of {seq_len} tokens, {} micro-batches of {micro} per epoch; {trainer_total} optimizer steps{capped} (gradient_accumulation_steps {accum}); {} held-out tokens",
        loader.batches_per_epoch(),
        eval_ids.len()
    ));

    // before
    if !eval_ids.is_empty() {
        say("evaluating held-out perplexity before training");
    }
    if let Some((_, counters)) = &resume_from
        && counters.step >= trainer_total
    {
        if let Some(done) = finished_run(&out_dir, counters.step, plan.clone()) {
            say(&already_finished(counters.step, &out_dir));
            return Ok(done);
        }
        say(&format!(
            "training already finished at step {} of {trainer_total}, but the run was not exported; evaluating and exporting",
            counters.step
        ));
    }
    let eval_before = evaluate(&model, &eval_ids, seq_len)?;
    if let Some(e) = eval_before {
        say(&format!(
            "held-out perplexity before: {:.3} ({} tokens)",
            e.perplexity, e.tokens
        ));
    }
    let sample_before = match &cfg.logging.sample_prompt {
        Some(p) => Some(sample(&model, &tok, p, cfg.logging.sample_max_new_tokens)?),
        None => None,
    };
    if crate::trainer::stop_requested() {
        return Err(interrupted_before_training());
    }

    // 5. train (the engine's Trainer: accumulation, clipping, mixed precision, OOM back-off,
    // NaN policy, checkpoints, exact resume)
    std::fs::create_dir_all(&out_dir).map_err(rt(&format!("creating {}", out_dir.display())))?;
    if cfg.train.gradient_checkpointing {
        say("gradient checkpointing: each decoder layer is recomputed during backward");
    }
    let mut named: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut task = LlamaTask {
        model: &model,
        named,
        loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
    };
    let mut source = TextSource::new(loader);
    let tcfg = trainer_config(&cfg, device, &out_dir, total_steps)?;
    let mut trainer: crate::trainer::Trainer<LlamaTask<'_>> = crate::trainer::Trainer::new(tcfg);
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
    // metrics.jsonl (appended on resume), TensorBoard event files when `logging.tensorboard`, and
    // loss.png at the end.
    trainer.add_callback(Box::new(
        crate::metrics::MetricsLogger::new(&log_dir, cfg.logging.tensorboard)
            .map_err(|e| JobError::Runtime(e.to_string()))?
            .with_every(cfg.logging.log_every_n_steps),
    ));
    let resume = match &resume_from {
        None => crate::trainer::Resume::No,
        Some((dir, _)) => crate::trainer::Resume::From(dir.clone()),
    };
    let (rss_before_steps, hwm_process) = proc_rss();
    let _ = reset_peak_rss();
    let _ = lora_core::sys::cpu_reset_peak();
    let t_train = std::time::Instant::now();
    let report = trainer
        .fit(&mut task, &mut source, resume)
        .map_err(|e| match e {
            crate::trainer::TrainError::NonFinite { .. }
            | crate::trainer::TrainError::OutOfMemory { .. } => JobError::Runtime(e.to_string()),
            other => JobError::Runtime(format!("training: {other}")),
        })?;
    let step = report.steps;
    let tokens = report.tokens;
    let losses = report.losses.clone();
    if report.interrupted || crate::trainer::stop_requested() {
        return Err(JobError::Interrupted {
            step: report.steps,
            checkpoint: report.last_checkpoint.clone(),
        });
    }
    if let Some(from) = report.resumed_from {
        say(&format!(
            "resumed at step {from}; trained steps {}–{}",
            from + 1,
            report.steps
        ));
    }
    if report.oom_backoffs > 0 {
        say(&format!(
            "out-of-memory back-offs: {} (final micro-batch split {})",
            report.oom_backoffs, report.micro_batch_split
        ));
    }
    let train_seconds = t_train.elapsed().as_secs_f64();
    let (_, hwm_steps) = proc_rss();
    let tensor_peak = lora_core::sys::cpu_mem_stats()
        .map(|s| s.peak_bytes)
        .unwrap_or(0);
    let memory = MeasuredMemory {
        rss_before_steps,
        rss_peak_steps: hwm_steps,
        rss_step_delta: hwm_steps.saturating_sub(rss_before_steps),
        tensor_peak,
        rss_peak_process: hwm_process.max(hwm_steps),
    };

    // after
    if !eval_ids.is_empty() {
        say("evaluating held-out perplexity after training");
    }
    let eval_after = evaluate(&model, &eval_ids, seq_len)?;
    check_not_diverged(
        &report,
        "held-out loss",
        eval_after.as_ref().map(|a| a.mean_nll),
    )?;
    let sample_after = match &cfg.logging.sample_prompt {
        Some(p) => Some(sample(&model, &tok, p, cfg.logging.sample_max_new_tokens)?),
        None => None,
    };

    // 6. export
    let sha = if base_path.is_file() {
        Some(crate::export::sha256_file(&base_path).map_err(rt("hashing the base model"))?)
    } else {
        None
    };
    let meta = crate::export::metadata_for(
        &cfg,
        &crate::export::RunMetadata {
            base_model: base_written.clone(),
            base_model_sha256: sha,
            dataset: data_stats,
            steps: step,
            epochs: 1 + step.saturating_sub(1) / per_epoch.max(1),
        },
    );
    // Never overwrite what an earlier run (or the user) left under the same names: move it aside.
    move_aside(
        &out_dir,
        &[
            cfg.train.output_name.clone(),
            format!("{}.safetensors", cfg.train.output_name),
            "summary.json".to_string(),
        ],
        opts.verbose,
    )?;
    let mut outputs = crate::export::export_run(&mut model, "default", &lcfg, &cfg, meta, &out_dir)
        .map_err(rt("exporting the adapter"))?;
    let mut summary = RunSummary {
        plan,
        steps: step,
        tokens,
        train_seconds,
        total_seconds: 0.0,
        losses,
        eval_before,
        eval_after,
        sample_before,
        sample_after,
        memory,
        outputs: Vec::new(),
    };
    summary.total_seconds = t_start.elapsed().as_secs_f64();
    let summary_path = out_dir.join("summary.json");
    outputs.push(summary_path.clone());
    summary.outputs = outputs;
    let text = serde_json::to_string_pretty(&summary).map_err(rt("serializing the summary"))?;
    std::fs::write(&summary_path, text)
        .map_err(rt(&format!("writing {}", summary_path.display())))?;
    if opts.verbose {
        write_stdout(&summary.report())?;
    }
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_follow_the_config() {
        let mut cfg = TrainConfig::from_yaml_str(
            "lora: {rank: 16, alpha: 32}\ntrain: {batch_size: 4, gradient_accumulation_steps: 2, optimizer: AdamW8bit, mixed_precision: bf16}\ndata: {seq_len: 512}\n",
        )
        .unwrap();
        let (s, _) = settings_for(&cfg, Some(BaseDtype::Q4_1), false);
        assert_eq!(
            (
                s.lora.rank,
                s.micro_batch,
                s.gradient_accumulation_steps,
                s.seq_len
            ),
            (16, 4, 2, 512)
        );
        assert_eq!(s.optimizer, Optimizer::AdamW8bit);
        assert_eq!(s.mixed_precision, MixedPrecision::Bf16);
        assert_eq!(s.base_dtype, BaseDtype::F32, "dense weights default to f32");
        assert!(!s.device.is_cuda());
        cfg.model.weights = BaseWeights::Quantized;
        let (s, _) = settings_for(&cfg, Some(BaseDtype::Q4_1), true);
        assert_eq!(s.base_dtype, BaseDtype::Q4_1);
        assert!(s.device.is_cuda());
    }

    #[test]
    fn preset_plan_against_a_small_gpu_does_not_fit_and_auto_fit_fixes_it() {
        let y = "model: {base_model: llama-2-7b, weights: dense, dtype: bf16}\ntrain: {batch_size: 8}\ndata: {seq_len: 2048}\nmemory: {gpu: RTX 3060}\n";
        let mut cfg = TrainConfig::from_yaml_str(y).unwrap();
        let p = plan(&mut cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(false), "{}", p.report());
        assert!(p.report().contains("DOES NOT FIT"));
        let mut cfg = TrainConfig::from_yaml_str(
            &format!("{y}memory: {{gpu: RTX 3060, auto_fit: true}}\n")
                .replace("memory: {gpu: RTX 3060}\n", ""),
        )
        .unwrap();
        let p = plan(&mut cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(true), "{}", p.report());
        assert!(!p.changes.is_empty());
        assert!(p.estimate.peak.0 <= 12 << 30);
        // the config now carries the fitted settings
        assert_eq!(cfg.train.batch_size, p.settings.micro_batch);
        assert_eq!(
            u64::from(cfg.train.batch_size) * u64::from(cfg.train.gradient_accumulation_steps),
            8,
            "effective batch kept"
        );
    }
}
