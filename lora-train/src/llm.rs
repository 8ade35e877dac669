//! The causal-LM job: plan → load → inject → train → export → summary.
//!
//! [`plan`] is pure (lora-memory only): it reads the model's header, turns the [`TrainConfig`]
//! into lora-memory [`Settings`], estimates the peak, checks it against the budget and, with
//! `memory.auto_fit`, applies lora-memory's `fit()`.

use crate::config::{BaseWeights, Dtype, OptimizerKind, Precision, TargetModules, TrainConfig};
use lora_memory::{BaseDtype, Budget, Change, Device, Estimate, FitError, MixedPrecision, ModelDescriptor, Optimizer, Settings};
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
    let mut looked = vec![std::env::current_dir().map(|d| d.join(&p)).unwrap_or_else(|_| p.clone()).display().to_string()];
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
}

impl Plan {
    /// A human-readable report: settings, the breakdown table and the verdict.
    pub fn report(&self) -> String {
        let s = &self.settings;
        let mut out = String::new();
        out += &format!("plan: {} ({})\n", self.model, self.model_source);
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
            if s.gradient_checkpointing { "on" } else { "off" },
            s.optimizer
        );
        out += &self.estimate.to_table();
        for c in &self.changes {
            out += &format!(
                "auto_fit: {} {} → {} ({}); peak after {}\n",
                c.setting, c.from, c.to, c.reason, c.peak_after
            );
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        match (&self.budget, self.fits) {
            (Some(b), Some(true)) => {
                out += &format!(
                    "verdict: fits — predicted peak {} of budget {} ({}), headroom {}\n",
                    self.estimate.peak,
                    b.bytes,
                    budget_source(b),
                    b.bytes.saturating_sub(self.estimate.peak)
                )
            }
            (Some(b), _) => {
                out += &format!(
                    "verdict: DOES NOT FIT — predicted peak {} exceeds budget {} ({}) by {}\n",
                    self.estimate.peak,
                    b.bytes,
                    budget_source(b),
                    self.estimate.peak.saturating_sub(b.bytes)
                )
            }
            (None, _) => out += &format!("verdict: predicted peak {} (no budget given)\n", self.estimate.peak),
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
        lora_memory::BudgetSource::NvmlFree { device_index } => format!("free memory of cuda:{device_index} (NVML)"),
    }
}

/// Reads the base model's header (no tensor data): GGUF, safetensors file/folder, `config.json`,
/// or a lora-memory preset name. Returns the descriptor, a source description, and the GGUF
/// storage type of the layer linears when the file is GGUF.
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no preset; header errors.
pub fn read_descriptor(cfg: &TrainConfig, config_dir: Option<&Path>) -> Result<(ModelDescriptor, String, Option<BaseDtype>)> {
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
        Ok((ModelDescriptor::from_hf_config_json(path.join("config.json"))?, path.display().to_string(), None))
    } else if lower.ends_with("config.json") {
        Ok((ModelDescriptor::from_hf_config_json(&path)?, path.display().to_string(), None))
    } else {
        Ok((ModelDescriptor::from_safetensors(&path)?, path.display().to_string(), None))
    }
}

fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| rd.flatten().any(|e| e.path().extension().is_some_and(|x| x == "safetensors")))
        .unwrap_or(false)
}

/// lora-memory settings for a config. `file_quant` is the storage type of the file's layer
/// linears (GGUF), used when `model.weights: quantized`; `cuda` selects the device model.
pub fn settings_for(cfg: &TrainConfig, file_quant: Option<BaseDtype>, cuda: bool) -> (Settings, Vec<String>) {
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
        OptimizerKind::Sgd => Optimizer::Sgd { momentum: cfg.train.momentum as f32 },
    };
    let mut s = Settings::default()
        .with_base_dtype(base_dtype)
        .with_mixed_precision(mixed_precision)
        .with_method(if cfg.lora.use_dora { lora_memory::Method::Dora } else { lora_memory::Method::Lora })
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
pub fn plan(cfg: &mut TrainConfig, config_dir: Option<&Path>, override_budget: Option<Budget>, cuda: bool) -> Result<Plan> {
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
    };
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
            Err(FitError::DoesNotFit { smallest_peak, changes, .. }) => {
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
        assert_eq!((s.lora.rank, s.micro_batch, s.gradient_accumulation_steps, s.seq_len), (16, 4, 2, 512));
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
        let mut cfg = TrainConfig::from_yaml_str(&format!("{y}memory: {{gpu: RTX 3060, auto_fit: true}}\n").replace("memory: {gpu: RTX 3060}\n", "")).unwrap();
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
