//! `TrainConfig`: the run configuration, read from YAML or TOML.
//!
//! One canonical model with nested sections (`model`, `lora`, `data`, `train`, `memory`,
//! `logging`, `system`, `data_loader`, and an optional `tagger`), and a reader that accepts, as
//! written, the key names people already have in their files:
//!
//! - the low-VRAM LoRA guides' YAML (`train.py --config low_vram_config.yaml`):
//!   `model.base_model`, `model.lora_rank`, `model.lora_alpha`, `data.train_data_dir`,
//!   `data.resolution`, `data.batch_size`, `data.gradient_accumulation_steps`, `train.batch_size`,
//!   `train.gradient_accumulation_steps`, `train.epochs`, `train.learning_rate`,
//!   `train.mixed_precision`, `train.gradient_checkpointing`, `train.use_8bit_adam`, top-level
//!   `use_fp16` and `save_steps`, `system.seed`, `data_loader.{num_workers,persistent_workers,prefetch_factor}`;
//! - kohya-ss sd-scripts' flat argument names (`network_dim`, `network_alpha`, `train_batch_size`,
//!   `max_train_epochs`, `optimizer_type`, `lr_scheduler`, …), at the top level or inside kohya's
//!   TOML sections (`[model_arguments]`, `[training_arguments]`, … — kohya's `read_config_from_file`
//!   flattens every section, and so do we);
//! - the LLM tagging guides' `config.yaml` keys (`model_settings`, `generation_settings`,
//!   `memory_management`) inside a `tagger:` section.
//!
//! Aliases are normalised into one field (`network_dim` → `lora.rank`). Two spellings of the
//! same setting that disagree are an error ([`ConfigError::Conflict`]); an unknown key is an error
//! naming its path and value with a "did you mean" hint ([`ConfigError::UnknownKeys`]); a value of
//! the wrong type or outside its allowed set is an error naming the key, the value and what is
//! allowed ([`ConfigError::InvalidValue`]). Sizes (`"6GB"`, `"12GiB"`) are parsed by
//! [`lora_memory::parse_size`] and the assumed unit, if any, is kept in [`Size::assumed`].

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Errors reading or validating a configuration file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not valid YAML / TOML.
    #[error("{path} is not valid {format}: {message}")]
    Syntax {
        /// The file.
        path: PathBuf,
        /// `"YAML"` or `"TOML"`.
        format: &'static str,
        /// The parser's message (with line/column).
        message: String,
    },
    /// The file extension is neither YAML nor TOML.
    #[error("{path}: unknown config extension; use .yaml, .yml or .toml")]
    Extension {
        /// The file.
        path: PathBuf,
    },
    /// The document is not a mapping at the top level.
    #[error(
        "the config must be a mapping of sections (model:, lora:, data:, train:, …), found {found}"
    )]
    NotAMapping {
        /// What was found instead.
        found: String,
    },
    /// Keys that no section knows.
    #[error("{}", format_unknown(.0))]
    UnknownKeys(Vec<UnknownKey>),
    /// A value of the wrong type or outside its allowed set.
    #[error("invalid value for `{key}`: {value}; expected {expected}")]
    InvalidValue {
        /// The key path as written in the file.
        key: String,
        /// The value as written (JSON rendering).
        value: String,
        /// What is allowed.
        expected: String,
    },
    /// Two spellings of one setting disagree.
    #[error(
        "conflicting values for {canonical}: `{first_key}` = {first_value} but `{second_key}` = {second_value}; keep one of them"
    )]
    Conflict {
        /// The canonical key.
        canonical: String,
        /// First spelling.
        first_key: String,
        /// Its value.
        first_value: String,
        /// Second spelling.
        second_key: String,
        /// Its value.
        second_value: String,
    },
    /// A required key is missing.
    #[error("missing `{key}`: {hint}")]
    Missing {
        /// The canonical key.
        key: String,
        /// What to write.
        hint: String,
    },
}

/// One unknown key, with a suggestion.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownKey {
    /// The key path as written (`train.learnig_rate`).
    pub key: String,
    /// The value (JSON rendering).
    pub value: String,
    /// The closest known key, if one is close.
    pub suggestion: Option<String>,
    /// An extra hint (e.g. "tagger keys belong under `tagger:`").
    pub hint: Option<String>,
}

fn format_unknown(keys: &[UnknownKey]) -> String {
    let mut s = String::new();
    for (i, k) in keys.iter().enumerate() {
        if i > 0 {
            s.push('\n');
        }
        s.push_str(&format!("unknown key `{}` (value {})", k.key, k.value));
        if let Some(sug) = &k.suggestion {
            s.push_str(&format!("; did you mean `{sug}`?"));
        }
        if let Some(h) = &k.hint {
            s.push_str(&format!("; {h}"));
        }
    }
    s
}

/// Result alias for this module.
pub type Result<T> = std::result::Result<T, ConfigError>;

// ---------------------------------------------------------------------------------------------
// The canonical model
// ---------------------------------------------------------------------------------------------

/// A memory size given as text (`"6GB"`), with its parsed byte count (one type for every config
/// of the SDK: [`lora_memory::Size`]).
pub use lora_memory::Size;

/// Parses a size setting; `key` names it in the error.
///
/// # Errors
/// [`ConfigError::InvalidValue`] when the text is not a size.
fn parse_size_key(key: &str, text: &str) -> Result<Size> {
    Size::parse(text).map_err(|e| ConfigError::InvalidValue {
        key: key.to_string(),
        value: format!("{text:?}"),
        expected: format!("a size like \"6GB\", \"12GiB\" or \"512MB\" ({e})"),
    })
}

/// `target_modules`: a list (exact name or `.`-suffix match) or one regex string (full match),
/// as in PEFT's `LoraConfig` — lora-core's type, which injection reads.
pub use lora_core::config::TargetModules;

/// PEFT `init_lora_weights`: `true`, `false` or `"gaussian"` — lora-core's type.
pub use lora_core::config::InitLoraWeights;

/// `lora.target_modules` when unset: PEFT's default for LLaMA-family models. The SD job reads an
/// unset list as its UNet attention default instead (`sd_plan::DEFAULT_UNET_TARGETS`).
pub const DEFAULT_TARGET_MODULES: [&str; 2] = ["q_proj", "v_proj"];

/// [`DEFAULT_TARGET_MODULES`] as a [`TargetModules`].
pub fn default_target_modules() -> TargetModules {
    TargetModules::list(&DEFAULT_TARGET_MODULES)
}

/// How the frozen base weights are held in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BaseWeights {
    /// Dequantize quantized files once at load into `model.dtype` (fastest on CPU).
    #[default]
    Dense,
    /// Keep GGUF blocks quantized; dequantize per forward (least memory).
    Quantized,
}

/// Storage dtype of dense base weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    /// 32-bit float.
    #[default]
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
}

/// Which job a model is trained by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelKind {
    /// A diffusers Stable Diffusion folder (`model_index.json` or `unet/config.json`) goes to
    /// the SD job, anything else to the causal-LM job.
    #[default]
    Auto,
    /// A causal LM (LLaMA family).
    Llm,
    /// Stable Diffusion 1.x / 2.x.
    Sd15,
    /// Stable Diffusion XL (the SD job, with two text encoders).
    Sdxl,
}

/// `[model]`: the base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct ModelSection {
    /// Path to the base: a `.gguf` file, a `.safetensors` file or an HF folder with `config.json`
    /// (aliases: `model.base_model`, `model.path`, kohya `pretrained_model_name_or_path`).
    pub base_model: Option<String>,
    /// Frozen weights dense or quantized (alias `model.weight_mode`).
    pub weights: BaseWeights,
    /// Dtype of dense base weights (alias `model.dtype`; kohya `full_bf16: true` → bf16).
    pub dtype: Dtype,
    /// `auto` (default), `llm`, `sd15`, `sdxl`: which job trains the model.
    pub kind: ModelKind,
    /// For a single-file Stable Diffusion base (which holds no tokenizer): a CLIP tokenizer
    /// folder, or a diffusers pipeline folder whose `tokenizer/` (SDXL: and `tokenizer_2/`) and
    /// component `config.json` files are used. Default: the base file's folder when it has a
    /// `tokenizer/`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<String>,
}

/// `[lora]`: the adapter.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoraSection {
    /// Rank `r` (default 8; aliases `lora.r`, `model.lora_rank`, kohya `network_dim`).
    pub rank: u32,
    /// `alpha` (default 8 like PEFT; `scaling = alpha / rank`; aliases `lora.lora_alpha`,
    /// `model.lora_alpha`, kohya `network_alpha`).
    pub alpha: f64,
    /// Dropout on the adapter input (default 0; aliases `lora.lora_dropout`, kohya `network_dropout`).
    pub dropout: f64,
    /// Target modules (default `["q_proj","v_proj"]`, PEFT's default for LLaMA).
    pub target_modules: TargetModules,
    /// Modules never adapted (PEFT `exclude_modules`).
    pub exclude_modules: Option<TargetModules>,
    /// rsLoRA scaling `alpha / sqrt(r)` (arXiv:2312.03732).
    pub use_rslora: bool,
    /// DoRA (arXiv:2402.09353).
    pub use_dora: bool,
    /// PEFT `init_lora_weights`: `true` (Kaiming-uniform A, zero B), `false` or `"gaussian"`.
    pub init_lora_weights: InitLoraWeights,
    /// Per-module rank overrides (PEFT `rank_pattern`).
    pub rank_pattern: BTreeMap<String, u32>,
    /// Per-module alpha overrides (PEFT `alpha_pattern`).
    pub alpha_pattern: BTreeMap<String, f64>,
    /// kohya `network_module` (only `networks.lora` is LoRA; kept for the kohya metadata).
    pub network_module: Option<String>,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: 8,
            alpha: 8.0,
            dropout: 0.0,
            target_modules: default_target_modules(),
            exclude_modules: None,
            use_rslora: false,
            use_dora: false,
            init_lora_weights: InitLoraWeights::Kaiming,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            network_module: None,
        }
    }
}

impl LoraSection {
    /// lora-core's `LoraConfig` of this section (PEFT's field names and meanings; `bias`
    /// `"none"`), for a base named `base_model` and PEFT task `task_type` (`"CAUSAL_LM"`, or
    /// `None` for diffusion), with `target_modules` as given (the SD job substitutes its UNet
    /// default for an unset list).
    pub fn to_lora_config(
        &self,
        target_modules: TargetModules,
        base_model: &str,
        task_type: Option<&str>,
    ) -> lora_core::config::LoraConfig {
        lora_core::config::LoraConfig {
            r: i64::from(self.rank),
            lora_alpha: self.alpha,
            target_modules: Some(target_modules),
            exclude_modules: self.exclude_modules.clone(),
            lora_dropout: self.dropout,
            use_rslora: self.use_rslora,
            use_dora: self.use_dora,
            init_lora_weights: self.init_lora_weights,
            rank_pattern: self
                .rank_pattern
                .iter()
                .map(|(k, v)| (k.clone(), i64::from(*v)))
                .collect(),
            alpha_pattern: self.alpha_pattern.clone(),
            bias: "none".into(),
            peft_type: "LORA".into(),
            task_type: task_type.map(str::to_string),
            base_model_name_or_path: Some(base_model.to_string()),
            ..lora_core::config::LoraConfig::default()
        }
    }
}

/// Text dataset layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DataFormat {
    /// Plain text, tokenized and packed into `seq_len` blocks.
    #[default]
    Text,
    /// JSON lines with a text field.
    Jsonl,
    /// Alpaca instruction/input/output records.
    Alpaca,
    /// Chat messages (ChatML).
    Chat,
    /// kohya image folders with caption sidecars.
    Images,
}

/// `[data]`: the training data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataSection {
    /// Training file or folder (aliases `data.train_data_dir`, `data.path`, kohya `train_data_dir`).
    pub train_data_dir: Option<String>,
    /// Layout.
    pub format: DataFormat,
    /// Held-out text for perplexity before/after (file); when absent, `eval_fraction` of the
    /// training text is held out.
    pub eval_file: Option<String>,
    /// Fraction of the text held out for evaluation when `eval_file` is absent (default 0.05).
    pub eval_fraction: f64,
    /// Use at most this many bytes of the training text (a slice of a larger corpus).
    pub max_bytes: Option<u64>,
    /// Tokens per training sequence (aliases `data.max_seq_len`, `data.block_size`, kohya
    /// `max_token_length`; default 256).
    pub seq_len: u32,
    /// Square training resolution in pixels, or `[w, h]` (images; kohya `resolution: "512,512"`).
    pub resolution: Option<[u32; 2]>,
    /// kohya `caption_extension` (default `.caption`).
    pub caption_extension: Option<String>,
    /// kohya `keep_tokens`.
    pub keep_tokens: Option<u32>,
    /// kohya `shuffle_caption`.
    pub shuffle_caption: Option<bool>,
    /// kohya `enable_bucket`.
    pub enable_bucket: Option<bool>,
    /// kohya `min_bucket_reso`.
    pub min_bucket_reso: Option<u32>,
    /// kohya `max_bucket_reso`.
    pub max_bucket_reso: Option<u32>,
    /// kohya `bucket_reso_steps`.
    pub bucket_reso_steps: Option<u32>,
    /// kohya `cache_latents`.
    pub cache_latents: Option<bool>,
    /// What the image jobs do with images that cannot be used (an empty, cut-short or corrupt
    /// file, an unsupported format, an unreadable caption): `skip` them, each named in a
    /// warning (the default), or `stop` before training with every one listed (exit 2).
    pub bad_images: BadImages,
}

/// `data.bad_images`: skip unusable images with a warning, or stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum BadImages {
    /// Leave them out; each is named in a warning.
    #[default]
    Skip,
    /// Refuse to start, listing every one.
    Stop,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            train_data_dir: None,
            format: DataFormat::Text,
            eval_file: None,
            eval_fraction: 0.05,
            max_bytes: None,
            seq_len: 256,
            resolution: None,
            caption_extension: None,
            keep_tokens: None,
            shuffle_caption: None,
            enable_bucket: None,
            min_bucket_reso: None,
            max_bucket_reso: None,
            bucket_reso_steps: None,
            cache_latents: None,
            bad_images: BadImages::Skip,
        }
    }
}

/// The optimizer a config names: the engine's [`OptimizerName`] (one table of names, defaults
/// and planner terms for the config, the trainer and the plan).
pub use crate::engine::optim::OptimizerName;

/// Learning-rate schedule (names of transformers' `get_scheduler` / kohya `lr_scheduler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum SchedulerKind {
    /// Constant (kohya's default).
    #[default]
    Constant,
    /// Linear warmup then constant.
    ConstantWithWarmup,
    /// Linear warmup then linear decay to 0.
    Linear,
    /// Linear warmup then half-cosine to 0.
    Cosine,
    /// Cosine with hard restarts (`lr_scheduler_num_cycles`).
    CosineWithRestarts,
    /// Polynomial decay (`lr_scheduler_power`).
    Polynomial,
}

/// Mixed precision (accelerate / kohya `mixed_precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// fp32 compute.
    #[default]
    No,
    /// fp16 autocast with dynamic loss scaling (CUDA).
    Fp16,
    /// bf16 autocast (CPU and CUDA).
    Bf16,
    /// Everything in bf16 (kohya `full_bf16`).
    FullBf16,
}

/// Export formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "snake_case")]
pub enum ExportFormat {
    /// PEFT `adapter_config.json` + `adapter_model.safetensors`.
    Peft,
    /// kohya single-file `lora_down`/`lora_up`/`alpha` safetensors.
    Kohya,
}

/// What to do on a non-finite loss or gradient norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum NanPolicy {
    /// Skip the optimizer step.
    #[default]
    Skip,
    /// Skip and halve the learning rate.
    LowerLr,
    /// Stop the run (the last good checkpoint stays).
    Stop,
}

/// `[train]`: the optimisation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainSection {
    /// Micro-batch size (aliases `data.batch_size`, kohya `train_batch_size`; default 1).
    pub batch_size: u32,
    /// Gradient accumulation (alias `data.gradient_accumulation_steps`; default 1).
    pub gradient_accumulation_steps: u32,
    /// Epochs (alias kohya `max_train_epochs`; default 1).
    pub epochs: u32,
    /// Optimizer steps; overrides `epochs` when set (kohya `max_train_steps`).
    pub max_steps: Option<u64>,
    /// Peak learning rate (default 1e-4).
    pub learning_rate: f64,
    /// Optimizer (`train.use_8bit_adam: true` → AdamW8bit; kohya `optimizer_type`).
    pub optimizer: OptimizerName,
    /// Decoupled weight decay (default 0).
    pub weight_decay: f64,
    /// SGD momentum μ. Unset: 0 for `SGD` (`torch.optim.SGD`'s and kohya's default) and 0.9 for
    /// `SGDNesterov` (kohya's), as the engine's optimizer names give them
    /// ([`OptimizerName::default_momentum`]).
    pub momentum: Option<f64>,
    /// LoRA+ ratio `lr_B / lr_A` (arXiv:2402.12354); `None` = plain LoRA.
    pub loraplus_lr_ratio: Option<f64>,
    /// Scheduler (kohya `lr_scheduler`).
    pub lr_scheduler: SchedulerKind,
    /// Warmup steps (kohya `lr_warmup_steps`).
    pub warmup_steps: u64,
    /// Cycles for `cosine_with_restarts` (kohya `lr_scheduler_num_cycles`).
    pub num_cycles: u32,
    /// Power for `polynomial` (kohya `lr_scheduler_power`).
    pub power: f64,
    /// Mixed precision (`use_fp16: true` → fp16).
    pub mixed_precision: Precision,
    /// Recompute each block in the backward pass.
    pub gradient_checkpointing: bool,
    /// Gradient clipping by global norm (default 1.0, as transformers and kohya; 0 = off).
    pub max_grad_norm: f64,
    /// Non-finite loss policy.
    pub nan_policy: NanPolicy,
    /// Checkpoint every N optimizer steps (aliases top-level `save_steps`, kohya `save_every_n_steps`).
    pub save_every_n_steps: Option<u64>,
    /// Checkpoint every N epochs (kohya `save_every_n_epochs`).
    pub save_every_n_epochs: Option<u32>,
    /// Checkpoints kept (default 3; kohya `save_last_n_steps_state` is not the same thing).
    pub keep_last_checkpoints: u32,
    /// Evaluate held-out loss every N steps (0 = only before/after).
    pub eval_every_n_steps: u64,
    /// Output folder (kohya `output_dir`; default `output`).
    pub output_dir: String,
    /// Adapter name in the output (kohya `output_name`; default `adapter`).
    pub output_name: String,
    /// Export formats (default `[peft]`).
    pub export_formats: Vec<ExportFormat>,
    /// Diffusion: kohya `noise_offset` (0 = off; Guttenberg 2023, typical 0.0357–0.1).
    pub noise_offset: f64,
    /// Diffusion: min-SNR-γ loss weighting (kohya `min_snr_gamma`; Hang et al. 2023 recommend 5).
    pub min_snr_gamma: Option<f64>,
    /// Diffusion: `epsilon` or `v_prediction`; default: the model's scheduler config.
    pub prediction_type: Option<String>,
    /// Diffusion: text-encoder layer used for conditioning (kohya / A1111 `clip_skip`; 1 = last).
    pub clip_skip: Option<u32>,
    /// Diffusion: LoRA on the text encoder too (its `q_proj`, `k_proj`, `v_proj`, `out_proj`);
    /// default false = UNet only (kohya `network_train_unet_only: true`), text-encoder outputs
    /// cached.
    pub train_text_encoder: bool,
}

impl Default for TrainSection {
    fn default() -> Self {
        TrainSection {
            batch_size: 1,
            gradient_accumulation_steps: 1,
            epochs: 1,
            max_steps: None,
            learning_rate: 1e-4,
            optimizer: OptimizerName::AdamW,
            weight_decay: 0.0,
            momentum: None,
            loraplus_lr_ratio: None,
            lr_scheduler: SchedulerKind::Constant,
            warmup_steps: 0,
            num_cycles: 1,
            power: 1.0,
            mixed_precision: Precision::No,
            gradient_checkpointing: false,
            max_grad_norm: 1.0,
            nan_policy: NanPolicy::Skip,
            save_every_n_steps: None,
            save_every_n_epochs: None,
            keep_last_checkpoints: 3,
            eval_every_n_steps: 0,
            output_dir: "output".into(),
            output_name: "adapter".into(),
            export_formats: vec![ExportFormat::Peft],
            noise_offset: 0.0,
            min_snr_gamma: None,
            prediction_type: None,
            clip_skip: None,
            train_text_encoder: false,
        }
    }
}

/// `[memory]`: the budget and what to do when the plan does not fit it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemorySection {
    /// Budget as a size (`"6GB"`; aliases `memory.max_memory`).
    pub budget: Option<Size>,
    /// Budget as a GPU name (`"RTX 3060"`), from lora-memory's preset table.
    pub gpu: Option<String>,
    /// Apply lora-memory's `fit()` to the settings before starting.
    pub auto_fit: bool,
    /// Start even when predicted not to fit.
    pub force: bool,
    /// CPU runs: fix glibc's mmap threshold at 128 KiB so freed tensors leave the process and the
    /// resident memory follows the plan (`lora_core::sys::set_malloc_mmap_threshold`; default
    /// true). `false` keeps glibc's dynamic threshold, under which RSS measured ~40% above the
    /// live tensors on the README demo. Ignored when `MALLOC_MMAP_THRESHOLD_` is set.
    pub cpu_return_freed: bool,
}

impl Default for MemorySection {
    fn default() -> Self {
        MemorySection {
            budget: None,
            gpu: None,
            auto_fit: false,
            force: false,
            cpu_return_freed: true,
        }
    }
}

/// `[logging]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoggingSection {
    /// Log every N optimizer steps (default 1).
    pub log_every_n_steps: u64,
    /// Folder for JSONL metrics / TensorBoard events (kohya `logging_dir`; default `<output_dir>/logs`).
    pub logging_dir: Option<String>,
    /// Show a progress bar (default true).
    pub progress: bool,
    /// Write TensorBoard event files.
    pub tensorboard: bool,
    /// Prompt sampled before and after training.
    pub sample_prompt: Option<String>,
    /// Tokens generated for the sample.
    pub sample_max_new_tokens: u32,
    /// Diffusion: write a sample grid every N optimizer steps (kohya `sample_every_n_steps`;
    /// 0 = only at the end).
    pub sample_every_n_steps: u64,
    /// Diffusion: prompts of the sample grid (one image each).
    pub sample_prompts: Vec<String>,
    /// Diffusion: `ddim` (default) or `euler` (kohya `sample_sampler`).
    pub sample_sampler: String,
    /// Diffusion: sampler steps (default 20).
    pub sample_steps: u32,
    /// Diffusion: classifier-free guidance scale (default 7.5).
    pub sample_guidance_scale: f64,
}

impl Default for LoggingSection {
    fn default() -> Self {
        LoggingSection {
            log_every_n_steps: 1,
            logging_dir: None,
            progress: true,
            tensorboard: false,
            sample_prompt: None,
            sample_max_new_tokens: 32,
            sample_every_n_steps: 0,
            sample_prompts: Vec::new(),
            sample_sampler: "ddim".into(),
            sample_steps: 20,
            sample_guidance_scale: 7.5,
        }
    }
}

/// `[system]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SystemSection {
    /// Seed (default 42; kohya `seed`).
    pub seed: u64,
    /// `"cpu"`, `"cuda"`, `"cuda:N"` or `"auto"` (default).
    pub device: String,
    /// Intra-op threads (default: libtorch's choice).
    pub num_threads: Option<u32>,
}

impl Default for SystemSection {
    fn default() -> Self {
        SystemSection {
            seed: 42,
            device: "auto".into(),
            num_threads: None,
        }
    }
}

/// `[data_loader]` (names of PyTorch's `DataLoader`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataLoaderSection {
    /// Worker threads (kohya `max_data_loader_n_workers`; default 0 = in the training thread).
    pub num_workers: u32,
    /// Keep workers across epochs.
    pub persistent_workers: bool,
    /// Batches prefetched per worker (default 2, PyTorch's).
    pub prefetch_factor: u32,
    /// Shuffle each epoch (default true).
    pub shuffle: bool,
}

impl Default for DataLoaderSection {
    fn default() -> Self {
        DataLoaderSection {
            num_workers: 0,
            persistent_workers: false,
            prefetch_factor: 2,
            shuffle: true,
        }
    }
}

/// `tagger.model_settings` of the LLM tagging guides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TaggerModelSettings {
    /// `"fp16"`, `"bf16"`, `"fp32"`, `"int8"`, `"int4"`.
    pub precision: Option<String>,
    /// `"cuda"`, `"cpu"`, `"auto"`.
    pub device: Option<String>,
    /// accelerate `device_map`.
    pub device_map: Option<String>,
    /// accelerate `low_cpu_mem_usage`.
    pub low_cpu_mem_usage: Option<bool>,
    /// accelerate `max_memory`.
    pub max_memory: TaggerMaxMemory,
}

/// `tagger.model_settings.max_memory`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TaggerMaxMemory {
    /// GPU budget.
    pub cuda: Option<Size>,
    /// CPU budget.
    pub cpu: Option<Size>,
}

/// `tagger.generation_settings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TaggerGenerationSettings {
    /// Largest batch.
    pub max_batch_size: Option<u32>,
    /// Seconds per request.
    pub timeout: Option<f64>,
    /// Retries.
    pub retry_attempts: Option<u32>,
}

/// `tagger.memory_management`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TaggerMemoryManagement {
    /// Clear caches every N items.
    pub auto_clear_interval: Option<u32>,
    /// Cache entries.
    pub cache_size: Option<u32>,
}

/// `[tagger]`: recognised and validated here, used by lora-tagger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TaggerSection {
    /// `model_settings`.
    pub model_settings: TaggerModelSettings,
    /// `generation_settings`.
    pub generation_settings: TaggerGenerationSettings,
    /// `memory_management`.
    pub memory_management: TaggerMemoryManagement,
}

/// The whole run configuration (canonical form; see the module docs for accepted spellings).
///
/// Serializing a `TrainConfig` writes the canonical keys, which [`TrainConfig::from_yaml_str`]
/// reads back unchanged.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// Base model.
    pub model: ModelSection,
    /// Adapter.
    pub lora: LoraSection,
    /// Data.
    pub data: DataSection,
    /// Optimisation.
    pub train: TrainSection,
    /// Memory budget.
    pub memory: MemorySection,
    /// Logging.
    pub logging: LoggingSection,
    /// System.
    pub system: SystemSection,
    /// Data loader.
    pub data_loader: DataLoaderSection,
    /// Tagger settings, when present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tagger: Option<TaggerSection>,
}

// ---------------------------------------------------------------------------------------------
// Accepted spellings
// ---------------------------------------------------------------------------------------------

/// Every canonical key and its accepted spellings (dotted paths after flattening; kohya names are
/// top-level). The first spelling is the canonical one.
const KEYS: &[&[&str]] = &[
    // model
    &[
        "model.base_model",
        "model.path",
        "pretrained_model_name_or_path",
    ],
    &["model.weights", "model.weight_mode"],
    &["model.dtype"],
    &["model.kind"],
    &["model.tokenizer"],
    // lora
    &["lora.rank", "lora.r", "model.lora_rank", "network_dim"],
    &[
        "lora.alpha",
        "lora.lora_alpha",
        "model.lora_alpha",
        "network_alpha",
    ],
    &["lora.dropout", "lora.lora_dropout", "network_dropout"],
    &["lora.target_modules"],
    &["lora.exclude_modules"],
    &["lora.use_rslora"],
    &["lora.use_dora"],
    &["lora.init_lora_weights"],
    &["lora.rank_pattern"],
    &["lora.alpha_pattern"],
    &["lora.network_module", "network_module"],
    // data
    &[
        "data.train_data_dir",
        "data.path",
        "data.train_file",
        "train_data_dir",
    ],
    &["data.format"],
    &["data.eval_file"],
    &["data.eval_fraction"],
    &["data.max_bytes"],
    &[
        "data.seq_len",
        "data.max_seq_len",
        "data.block_size",
        "max_token_length",
    ],
    &["data.resolution", "resolution"],
    &["data.caption_extension", "caption_extension"],
    &["data.keep_tokens", "keep_tokens"],
    &["data.shuffle_caption", "shuffle_caption"],
    &["data.enable_bucket", "enable_bucket"],
    &["data.min_bucket_reso", "min_bucket_reso"],
    &["data.max_bucket_reso", "max_bucket_reso"],
    &["data.bucket_reso_steps", "bucket_reso_steps"],
    &["data.cache_latents", "cache_latents"],
    &["data.bad_images"],
    // train
    &["train.batch_size", "data.batch_size", "train_batch_size"],
    &[
        "train.gradient_accumulation_steps",
        "data.gradient_accumulation_steps",
        "gradient_accumulation_steps",
    ],
    &["train.epochs", "max_train_epochs"],
    &["train.max_steps", "max_train_steps"],
    &["train.learning_rate", "learning_rate"],
    &["train.optimizer", "optimizer_type"],
    &["train.weight_decay"],
    &["train.momentum"],
    &["train.loraplus_lr_ratio", "loraplus_lr_ratio"],
    &["train.lr_scheduler", "lr_scheduler"],
    &[
        "train.warmup_steps",
        "train.lr_warmup_steps",
        "lr_warmup_steps",
    ],
    &["train.num_cycles", "lr_scheduler_num_cycles"],
    &["train.power", "lr_scheduler_power"],
    &["train.mixed_precision", "mixed_precision"],
    &["train.gradient_checkpointing", "gradient_checkpointing"],
    &["train.max_grad_norm", "max_grad_norm"],
    &["train.nan_policy"],
    &[
        "train.save_every_n_steps",
        "save_steps",
        "save_every_n_steps",
        "train.save_steps",
    ],
    &["train.save_every_n_epochs", "save_every_n_epochs"],
    &["train.keep_last_checkpoints"],
    &["train.eval_every_n_steps"],
    &["train.output_dir", "output_dir"],
    &["train.output_name", "output_name"],
    &["train.export_formats"],
    &["train.noise_offset", "noise_offset"],
    &["train.min_snr_gamma", "min_snr_gamma"],
    &["train.prediction_type"],
    &["train.clip_skip", "clip_skip"],
    &["train.train_text_encoder"],
    // memory
    &["memory.budget", "memory.max_memory"],
    &["memory.gpu"],
    &["memory.auto_fit"],
    &["memory.force"],
    &["memory.cpu_return_freed"],
    // logging
    &["logging.log_every_n_steps"],
    &["logging.logging_dir", "logging_dir"],
    &["logging.progress"],
    &["logging.tensorboard"],
    &["logging.sample_prompt"],
    &["logging.sample_max_new_tokens"],
    &["logging.sample_every_n_steps", "sample_every_n_steps"],
    &["logging.sample_prompts"],
    &["logging.sample_sampler", "sample_sampler"],
    &["logging.sample_steps"],
    &["logging.sample_guidance_scale"],
    // system
    &["system.seed", "seed"],
    &["system.device"],
    &["system.num_threads"],
    // data_loader
    &["data_loader.num_workers", "max_data_loader_n_workers"],
    &[
        "data_loader.persistent_workers",
        "persistent_data_loader_workers",
    ],
    &["data_loader.prefetch_factor"],
    &["data_loader.shuffle"],
    // tagger
    &["tagger.model_settings.precision"],
    &["tagger.model_settings.device"],
    &["tagger.model_settings.device_map"],
    &["tagger.model_settings.low_cpu_mem_usage"],
    &["tagger.model_settings.max_memory.cuda"],
    &["tagger.model_settings.max_memory.cpu"],
    &["tagger.generation_settings.max_batch_size"],
    &["tagger.generation_settings.timeout"],
    &["tagger.generation_settings.retry_attempts"],
    &["tagger.memory_management.auto_clear_interval"],
    &["tagger.memory_management.cache_size"],
];

/// Spellings that carry a transformed value (handled in code, not by [`KEYS`]).
const SPECIAL_KEYS: &[&str] = &[
    "use_fp16",
    "train.use_fp16",
    "train.use_8bit_adam",
    "use_8bit_adam",
    "full_bf16",
];

/// Keys whose value is itself a mapping (not flattened).
const MAP_VALUED: &[&str] = &["lora.rank_pattern", "lora.alpha_pattern"];

/// kohya TOML section names; their contents are read as top-level keys, as kohya does.
const KOHYA_SECTIONS: &[&str] = &[
    "general",
    "model_arguments",
    "additional_network_arguments",
    "optimizer_arguments",
    "dataset_arguments",
    "training_arguments",
    "saving_arguments",
    "sample_prompt_arguments",
    "logging_arguments",
    "dreambooth_arguments",
];

/// Tagger sections that belong under `tagger:`.
const TAGGER_SECTIONS: &[&str] = &["model_settings", "generation_settings", "memory_management"];

/// A flattened document entry.
#[derive(Debug)]
struct Entry {
    path: String,
    value: Value,
    used: bool,
}

struct Doc {
    entries: Vec<Entry>,
}

fn render(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

fn flatten(prefix: &str, map: &Map<String, Value>, out: &mut Vec<Entry>) {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Object(inner) if prefix.is_empty() && KOHYA_SECTIONS.contains(&k.as_str()) => {
                flatten("", inner, out);
            }
            Value::Object(inner) if !MAP_VALUED.contains(&path.as_str()) => {
                flatten(&path, inner, out);
            }
            Value::Null => {} // `key:` with nothing after it means "default"
            _ => out.push(Entry {
                path,
                value: v.clone(),
                used: false,
            }),
        }
    }
}

fn spellings(canonical: &str) -> &'static [&'static str] {
    KEYS.iter()
        .find(|s| s[0] == canonical)
        .copied()
        .unwrap_or(&[])
}

impl Doc {
    fn new(root: &Map<String, Value>) -> Doc {
        let mut entries = Vec::new();
        flatten("", root, &mut entries);
        Doc { entries }
    }

    /// All (path, value) written for one canonical key, marking them used.
    fn raw(&mut self, canonical: &str) -> Vec<(String, Value)> {
        let names = spellings(canonical);
        let mut hits = Vec::new();
        for e in self.entries.iter_mut() {
            if names.contains(&e.path.as_str()) || e.path == canonical {
                e.used = true;
                hits.push((e.path.clone(), e.value.clone()));
            }
        }
        hits
    }

    /// Reads a canonical key through `conv`, checking that all spellings agree.
    fn get_with<T: PartialEq + fmt::Debug>(
        &mut self,
        canonical: &str,
        conv: impl Fn(&str, &Value) -> Result<T>,
    ) -> Result<Option<(T, String)>> {
        let mut found: Option<(T, String, Value)> = None;
        for (path, v) in self.raw(canonical) {
            let t = conv(&path, &v)?;
            match &found {
                None => found = Some((t, path, v)),
                Some((prev, prev_path, prev_v)) => {
                    if *prev != t {
                        return Err(ConfigError::Conflict {
                            canonical: canonical.to_string(),
                            first_key: prev_path.clone(),
                            first_value: render(prev_v),
                            second_key: path,
                            second_value: render(&v),
                        });
                    }
                }
            }
        }
        Ok(found.map(|(t, p, _)| (t, p)))
    }

    fn get<T: DeserializeOwned + PartialEq + fmt::Debug>(
        &mut self,
        canonical: &str,
        expected: &str,
    ) -> Result<Option<T>> {
        Ok(self
            .get_with(canonical, |k, v| typed(k, v, expected))?
            .map(|(t, _)| t))
    }

    fn set<T: DeserializeOwned + PartialEq + fmt::Debug>(
        &mut self,
        canonical: &str,
        expected: &str,
        slot: &mut T,
    ) -> Result<()> {
        if let Some(v) = self.get(canonical, expected)? {
            *slot = v;
        }
        Ok(())
    }

    fn set_choice<T: Copy + PartialEq + fmt::Debug>(
        &mut self,
        canonical: &str,
        table: &[(&str, T)],
        slot: &mut T,
    ) -> Result<()> {
        if let Some((v, _)) = self.get_with(canonical, |k, v| choose(k, v, table))? {
            *slot = v;
        }
        Ok(())
    }
}

fn invalid(key: &str, value: &Value, expected: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        value: render(value),
        expected: expected.into(),
    }
}

fn typed<T: DeserializeOwned>(key: &str, v: &Value, expected: &str) -> Result<T> {
    // YAML/TOML users write numbers as strings now and then ("1e-4" in YAML 1.1 is a string).
    match serde_json::from_value::<T>(v.clone()) {
        Ok(t) => Ok(t),
        Err(first) => {
            if let Value::String(s) = v {
                if let Ok(n) = s.trim().parse::<f64>() {
                    let num = if n.fract() == 0.0 && n.abs() < 9.0e15 {
                        Value::from(n as i64)
                    } else {
                        Value::from(n)
                    };
                    if let Ok(t) = serde_json::from_value::<T>(num) {
                        return Ok(t);
                    }
                }
                match s.trim().to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" => {
                        if let Ok(t) = serde_json::from_value::<T>(Value::Bool(true)) {
                            return Ok(t);
                        }
                    }
                    "false" | "no" | "off" => {
                        if let Ok(t) = serde_json::from_value::<T>(Value::Bool(false)) {
                            return Ok(t);
                        }
                    }
                    _ => {}
                }
            }
            Err(invalid(key, v, format!("{expected} ({first})")))
        }
    }
}

fn normalise_choice(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, '_' | '-' | ' ' | '.'))
        .flat_map(|c| c.to_lowercase())
        .collect()
}

fn choose<T: Copy>(key: &str, v: &Value, table: &[(&str, T)]) -> Result<T> {
    let allowed = || {
        let mut names: Vec<&str> = Vec::new();
        for (n, _) in table {
            if !names.contains(n) {
                names.push(n);
            }
        }
        format!(
            "one of {}",
            names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let s = match v {
        Value::String(s) => s.as_str(),
        _ => return Err(invalid(key, v, allowed())),
    };
    let norm = normalise_choice(s);
    table
        .iter()
        .find(|(n, _)| normalise_choice(n) == norm)
        .map(|(_, t)| *t)
        .ok_or_else(|| invalid(key, v, allowed()))
}

const OPTIMIZERS: &[(&str, OptimizerName)] = OptimizerName::SPELLINGS;

const SCHEDULERS: &[(&str, SchedulerKind)] = &[
    ("constant", SchedulerKind::Constant),
    ("constant_with_warmup", SchedulerKind::ConstantWithWarmup),
    ("linear", SchedulerKind::Linear),
    ("cosine", SchedulerKind::Cosine),
    ("cosine_with_restarts", SchedulerKind::CosineWithRestarts),
    ("polynomial", SchedulerKind::Polynomial),
];

const PRECISIONS: &[(&str, Precision)] = &[
    ("no", Precision::No),
    ("fp16", Precision::Fp16),
    ("bf16", Precision::Bf16),
    ("full_bf16", Precision::FullBf16),
    ("fp32", Precision::No),
    ("none", Precision::No),
];

const WEIGHT_MODES: &[(&str, BaseWeights)] = &[
    ("dense", BaseWeights::Dense),
    ("quantized", BaseWeights::Quantized),
];

const DTYPES: &[(&str, Dtype)] = &[
    ("f32", Dtype::F32),
    ("bf16", Dtype::Bf16),
    ("f16", Dtype::F16),
    ("fp32", Dtype::F32),
    ("float32", Dtype::F32),
    ("bfloat16", Dtype::Bf16),
    ("fp16", Dtype::F16),
    ("float16", Dtype::F16),
];

const BAD_IMAGES: &[(&str, BadImages)] = &[("skip", BadImages::Skip), ("stop", BadImages::Stop)];

const FORMATS: &[(&str, DataFormat)] = &[
    ("text", DataFormat::Text),
    ("jsonl", DataFormat::Jsonl),
    ("alpaca", DataFormat::Alpaca),
    ("chat", DataFormat::Chat),
    ("images", DataFormat::Images),
];

const MODEL_KINDS: &[(&str, ModelKind)] = &[
    ("auto", ModelKind::Auto),
    ("llm", ModelKind::Llm),
    ("sd15", ModelKind::Sd15),
    ("sdxl", ModelKind::Sdxl),
];

const NAN_POLICIES: &[(&str, NanPolicy)] = &[
    ("skip", NanPolicy::Skip),
    ("lower_lr", NanPolicy::LowerLr),
    ("stop", NanPolicy::Stop),
];

const EXPORTS: &[(&str, ExportFormat)] =
    &[("peft", ExportFormat::Peft), ("kohya", ExportFormat::Kohya)];

// Levenshtein distance over chars (the `strsim` crate).
use strsim::levenshtein as edit_distance;

/// The closest known spelling to an unknown key path.
fn suggest(path: &str) -> Option<String> {
    let all: Vec<&str> = KEYS
        .iter()
        .flat_map(|s| s.iter().copied())
        .chain(SPECIAL_KEYS.iter().copied())
        .collect();
    let last = path.rsplit('.').next().unwrap_or(path);
    // The same leaf name under another section names the setting's own key, the first of its
    // spellings (`train.seq_len` → `data.seq_len`, `lora.network_dim` → `lora.rank`, not the
    // top-level kohya alias `network_dim`).
    if let Some(k) = all
        .iter()
        .find(|k| k.rsplit('.').next() == Some(last) && **k != path)
    {
        let canonical = KEYS
            .iter()
            .find(|group| group.contains(k))
            .and_then(|group| group.first())
            .unwrap_or(k);
        return Some((*canonical).to_string());
    }
    let mut best: Option<(usize, &str)> = None;
    for k in &all {
        let d_full = edit_distance(path, k);
        let d_leaf = edit_distance(last, k.rsplit('.').next().unwrap_or(k))
            + usize::from(!same_section(path, k));
        let d = d_full.min(d_leaf);
        if best.map(|(bd, _)| d < bd).unwrap_or(true) {
            best = Some((d, k));
        }
    }
    let (d, k) = best?;
    let limit = (last.len() / 3).max(2);
    (d <= limit).then(|| k.to_string())
}

fn same_section(a: &str, b: &str) -> bool {
    let sec = |s: &str| {
        s.rsplit_once('.')
            .map(|(p, _)| p.to_string())
            .unwrap_or_default()
    };
    sec(a) == sec(b)
}

fn check_range<T: PartialOrd + fmt::Display + Copy>(
    key: &str,
    v: T,
    ok: bool,
    expected: &str,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(ConfigError::InvalidValue {
            key: key.to_string(),
            value: v.to_string(),
            expected: expected.to_string(),
        })
    }
}

fn resolution(key: &str, v: &Value) -> Result<[u32; 2]> {
    let bad = || invalid(key, v, "a size in pixels: 512, \"512,768\" or [512, 768]");
    let one = |x: &Value| -> Option<u32> {
        match x {
            Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        }
    };
    let parts: Vec<u32> = match v {
        Value::Array(a) => a
            .iter()
            .map(one)
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?,
        Value::String(s) => s
            .split(',')
            .map(|p| p.trim().parse().ok())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(bad)?,
        Value::Number(_) => vec![one(v).ok_or_else(bad)?],
        _ => return Err(bad()),
    };
    match parts.as_slice() {
        [s] if *s > 0 => Ok([*s, *s]),
        [w, h] if *w > 0 && *h > 0 => Ok([*w, *h]),
        _ => Err(bad()),
    }
}

fn size_of(key: &str, v: &Value) -> Result<Size> {
    match v {
        Value::String(s) => parse_size_key(key, s),
        Value::Number(n) => parse_size_key(key, &n.to_string()),
        _ => Err(invalid(
            key,
            v,
            "a size like \"6GB\", \"12GiB\" or \"512MB\"",
        )),
    }
}

fn targets(key: &str, v: &Value) -> Result<TargetModules> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(TargetModules::Regex(s.clone())),
        Value::Array(a) if !a.is_empty() => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .map(TargetModules::List)
            .ok_or_else(|| invalid(key, v, "a list of module names or one regex string")),
        _ => Err(invalid(
            key,
            v,
            "a non-empty list of module names (e.g. [q_proj, v_proj]) or one regex string",
        )),
    }
}

impl TrainConfig {
    /// Reads a config file; the format is chosen by extension (`.yaml`/`.yml` or `.toml`).
    ///
    /// # Errors
    /// Any [`ConfigError`]: I/O, syntax, unknown keys (with hints), invalid values, conflicts.
    pub fn from_file(path: impl AsRef<Path>) -> Result<TrainConfig> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        let value = match ext.as_deref() {
            Some("yaml" | "yml") => parse_yaml(&text).map_err(|m| ConfigError::Syntax {
                path: path.to_path_buf(),
                format: "YAML",
                message: m,
            })?,
            Some("toml") => parse_toml(&text).map_err(|m| ConfigError::Syntax {
                path: path.to_path_buf(),
                format: "TOML",
                message: m,
            })?,
            _ => {
                return Err(ConfigError::Extension {
                    path: path.to_path_buf(),
                });
            }
        };
        TrainConfig::from_value(&value)
    }

    /// Reads a YAML document.
    ///
    /// # Errors
    /// As [`TrainConfig::from_file`].
    pub fn from_yaml_str(text: &str) -> Result<TrainConfig> {
        let v = parse_yaml(text).map_err(|m| ConfigError::Syntax {
            path: PathBuf::from("<string>"),
            format: "YAML",
            message: m,
        })?;
        TrainConfig::from_value(&v)
    }

    /// Reads a TOML document.
    ///
    /// # Errors
    /// As [`TrainConfig::from_file`].
    pub fn from_toml_str(text: &str) -> Result<TrainConfig> {
        let v = parse_toml(text).map_err(|m| ConfigError::Syntax {
            path: PathBuf::from("<string>"),
            format: "TOML",
            message: m,
        })?;
        TrainConfig::from_value(&v)
    }

    /// Canonical YAML.
    ///
    /// # Errors
    /// Never in practice (serialization of plain data); kept for API symmetry.
    pub fn to_yaml(&self) -> std::result::Result<String, serde_yaml_ng::Error> {
        serde_yaml_ng::to_string(self)
    }

    /// Builds the config from a parsed document (any serde format converted to JSON values).
    ///
    /// # Errors
    /// As [`TrainConfig::from_file`].
    pub fn from_value(root: &Value) -> Result<TrainConfig> {
        let map = match root {
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            other => {
                return Err(ConfigError::NotAMapping {
                    found: render(other),
                });
            }
        };
        let mut doc = Doc::new(&map);
        let mut c = TrainConfig::default();

        // model
        doc.set(
            "model.base_model",
            "a path to a .gguf / .safetensors file or a model folder",
            &mut c.model.base_model,
        )?;
        doc.set_choice("model.weights", WEIGHT_MODES, &mut c.model.weights)?;
        doc.set_choice("model.dtype", DTYPES, &mut c.model.dtype)?;
        doc.set_choice("model.kind", MODEL_KINDS, &mut c.model.kind)?;
        doc.set(
            "model.tokenizer",
            "a tokenizer folder or a diffusers pipeline folder",
            &mut c.model.tokenizer,
        )?;

        // lora
        doc.set(
            "lora.rank",
            "a positive integer (the LoRA rank r)",
            &mut c.lora.rank,
        )?;
        check_range(
            "lora.rank",
            c.lora.rank,
            c.lora.rank >= 1,
            "an integer >= 1",
        )?;
        doc.set(
            "lora.alpha",
            "a positive number (scaling = alpha / rank)",
            &mut c.lora.alpha,
        )?;
        check_range(
            "lora.alpha",
            c.lora.alpha,
            c.lora.alpha > 0.0 && c.lora.alpha.is_finite(),
            "a number > 0",
        )?;
        doc.set(
            "lora.dropout",
            "a probability in [0, 1)",
            &mut c.lora.dropout,
        )?;
        check_range(
            "lora.dropout",
            c.lora.dropout,
            (0.0..1.0).contains(&c.lora.dropout),
            "a probability in [0, 1)",
        )?;
        if let Some((t, _)) = doc.get_with("lora.target_modules", targets)? {
            c.lora.target_modules = t;
        }
        if let Some((t, _)) = doc.get_with("lora.exclude_modules", targets)? {
            c.lora.exclude_modules = Some(t);
        }
        doc.set("lora.use_rslora", "true or false", &mut c.lora.use_rslora)?;
        doc.set("lora.use_dora", "true or false", &mut c.lora.use_dora)?;
        if let Some((v, _)) = doc.get_with("lora.init_lora_weights", |k, v| match v {
            Value::Bool(true) => Ok(InitLoraWeights::Kaiming),
            Value::Bool(false) => Ok(InitLoraWeights::Random),
            Value::String(s) if s == "gaussian" => Ok(InitLoraWeights::Gaussian),
            _ => Err(invalid(k, v, "true, false or \"gaussian\"")),
        })? {
            c.lora.init_lora_weights = v;
        }
        doc.set(
            "lora.rank_pattern",
            "a mapping module pattern -> rank",
            &mut c.lora.rank_pattern,
        )?;
        doc.set(
            "lora.alpha_pattern",
            "a mapping module pattern -> alpha",
            &mut c.lora.alpha_pattern,
        )?;
        if let Some((m, _)) = doc.get_with("lora.network_module", |k, v| match v.as_str() {
            Some("networks.lora") => Ok("networks.lora".to_string()),
            _ => Err(invalid(
                k,
                v,
                "\"networks.lora\" (other kohya network modules, e.g. LyCORIS, are not supported)",
            )),
        })? {
            c.lora.network_module = Some(m);
        }

        // data
        doc.set("data.train_data_dir", "a path", &mut c.data.train_data_dir)?;
        doc.set_choice("data.format", FORMATS, &mut c.data.format)?;
        doc.set("data.eval_file", "a path", &mut c.data.eval_file)?;
        doc.set(
            "data.eval_fraction",
            "a fraction in [0, 1)",
            &mut c.data.eval_fraction,
        )?;
        check_range(
            "data.eval_fraction",
            c.data.eval_fraction,
            (0.0..1.0).contains(&c.data.eval_fraction),
            "a fraction in [0, 1)",
        )?;
        if let Some((b, _)) = doc.get_with("data.max_bytes", |k, v| match v {
            Value::Number(n) => n
                .as_u64()
                .ok_or_else(|| invalid(k, v, "a byte count or a size like \"200KB\"")),
            _ => size_of(k, v).map(|s| s.bytes),
        })? {
            c.data.max_bytes = Some(b);
        }
        doc.set(
            "data.seq_len",
            "a positive integer (tokens per sequence)",
            &mut c.data.seq_len,
        )?;
        check_range(
            "data.seq_len",
            c.data.seq_len,
            c.data.seq_len >= 2,
            "an integer >= 2",
        )?;
        if let Some((r, _)) = doc.get_with("data.resolution", resolution)? {
            c.data.resolution = Some(r);
        }
        doc.set(
            "data.caption_extension",
            "a file extension such as \".txt\"",
            &mut c.data.caption_extension,
        )?;
        doc.set(
            "data.keep_tokens",
            "a non-negative integer",
            &mut c.data.keep_tokens,
        )?;
        doc.set(
            "data.shuffle_caption",
            "true or false",
            &mut c.data.shuffle_caption,
        )?;
        doc.set(
            "data.enable_bucket",
            "true or false",
            &mut c.data.enable_bucket,
        )?;
        doc.set(
            "data.min_bucket_reso",
            "pixels",
            &mut c.data.min_bucket_reso,
        )?;
        doc.set(
            "data.max_bucket_reso",
            "pixels",
            &mut c.data.max_bucket_reso,
        )?;
        doc.set(
            "data.bucket_reso_steps",
            "pixels",
            &mut c.data.bucket_reso_steps,
        )?;
        doc.set(
            "data.cache_latents",
            "true or false",
            &mut c.data.cache_latents,
        )?;
        doc.set_choice("data.bad_images", BAD_IMAGES, &mut c.data.bad_images)?;

        // train
        let t = &mut c.train;
        doc.set(
            "train.batch_size",
            "a positive integer (micro-batch)",
            &mut t.batch_size,
        )?;
        check_range(
            "train.batch_size",
            t.batch_size,
            t.batch_size >= 1,
            "an integer >= 1",
        )?;
        doc.set(
            "train.gradient_accumulation_steps",
            "a positive integer",
            &mut t.gradient_accumulation_steps,
        )?;
        check_range(
            "train.gradient_accumulation_steps",
            t.gradient_accumulation_steps,
            t.gradient_accumulation_steps >= 1,
            "an integer >= 1",
        )?;
        doc.set("train.epochs", "a positive integer", &mut t.epochs)?;
        check_range("train.epochs", t.epochs, t.epochs >= 1, "an integer >= 1")?;
        doc.set("train.max_steps", "a positive integer", &mut t.max_steps)?;
        if let Some(s) = t.max_steps {
            check_range("train.max_steps", s, s >= 1, "an integer >= 1")?;
        }
        doc.set(
            "train.learning_rate",
            "a positive number such as 1e-4",
            &mut t.learning_rate,
        )?;
        check_range(
            "train.learning_rate",
            t.learning_rate,
            t.learning_rate > 0.0 && t.learning_rate.is_finite(),
            "a number > 0",
        )?;
        doc.set_choice("train.optimizer", OPTIMIZERS, &mut t.optimizer)?;
        doc.set("train.weight_decay", "a number >= 0", &mut t.weight_decay)?;
        check_range(
            "train.weight_decay",
            t.weight_decay,
            t.weight_decay >= 0.0,
            "a number >= 0",
        )?;
        doc.set("train.momentum", "a number in [0, 1)", &mut t.momentum)?;
        doc.set(
            "train.loraplus_lr_ratio",
            "a number > 0",
            &mut t.loraplus_lr_ratio,
        )?;
        doc.set_choice("train.lr_scheduler", SCHEDULERS, &mut t.lr_scheduler)?;
        doc.set(
            "train.warmup_steps",
            "a non-negative integer",
            &mut t.warmup_steps,
        )?;
        doc.set("train.num_cycles", "a positive integer", &mut t.num_cycles)?;
        doc.set("train.power", "a number > 0", &mut t.power)?;
        doc.set_choice("train.mixed_precision", PRECISIONS, &mut t.mixed_precision)?;
        doc.set(
            "train.gradient_checkpointing",
            "true or false",
            &mut t.gradient_checkpointing,
        )?;
        doc.set(
            "train.max_grad_norm",
            "a number >= 0 (0 = no clipping)",
            &mut t.max_grad_norm,
        )?;
        doc.set_choice("train.nan_policy", NAN_POLICIES, &mut t.nan_policy)?;
        doc.set(
            "train.save_every_n_steps",
            "a positive integer",
            &mut t.save_every_n_steps,
        )?;
        doc.set(
            "train.save_every_n_epochs",
            "a positive integer",
            &mut t.save_every_n_epochs,
        )?;
        doc.set(
            "train.keep_last_checkpoints",
            "a positive integer",
            &mut t.keep_last_checkpoints,
        )?;
        doc.set(
            "train.eval_every_n_steps",
            "a non-negative integer",
            &mut t.eval_every_n_steps,
        )?;
        doc.set("train.output_dir", "a folder", &mut t.output_dir)?;
        doc.set(
            "train.output_name",
            "a file name without extension",
            &mut t.output_name,
        )?;
        if let Some((f, _)) = doc.get_with("train.export_formats", |k, v| {
            let items: Vec<Value> = match v {
                Value::Array(a) => a.clone(),
                Value::String(_) => vec![v.clone()],
                _ => return Err(invalid(k, v, "a list of \"peft\" and/or \"kohya\"")),
            };
            let mut out: Vec<ExportFormat> = items
                .iter()
                .map(|x| choose(k, x, EXPORTS))
                .collect::<Result<_>>()?;
            out.sort();
            out.dedup();
            if out.is_empty() {
                return Err(invalid(k, v, "at least one of \"peft\", \"kohya\""));
            }
            Ok(out)
        })? {
            t.export_formats = f;
        }
        doc.set("train.noise_offset", "a number >= 0", &mut t.noise_offset)?;
        check_range(
            "train.noise_offset",
            t.noise_offset,
            t.noise_offset >= 0.0 && t.noise_offset.is_finite(),
            "a number >= 0",
        )?;
        doc.set("train.min_snr_gamma", "a number > 0", &mut t.min_snr_gamma)?;
        if let Some(g) = t.min_snr_gamma {
            check_range(
                "train.min_snr_gamma",
                g,
                g > 0.0 && g.is_finite(),
                "a number > 0 (5 is the paper's choice)",
            )?;
        }
        if let Some((p, _)) = doc.get_with("train.prediction_type", |k, v| match v.as_str() {
            Some(s @ ("epsilon" | "v_prediction")) => Ok(s.to_string()),
            _ => Err(invalid(k, v, "\"epsilon\" or \"v_prediction\"")),
        })? {
            t.prediction_type = Some(p);
        }
        doc.set("train.clip_skip", "a positive integer", &mut t.clip_skip)?;
        doc.set(
            "train.train_text_encoder",
            "true or false",
            &mut t.train_text_encoder,
        )?;
        if let Some(n) = t.clip_skip {
            check_range(
                "train.clip_skip",
                n,
                n >= 1,
                "an integer >= 1 (1 = last layer)",
            )?;
        }

        // special spellings: use_fp16, use_8bit_adam, full_bf16
        let mp_written = spellings("train.mixed_precision")
            .iter()
            .any(|k| doc.entries.iter().any(|e| e.path == *k));
        for key in ["use_fp16", "train.use_fp16"] {
            if let Some(e) = doc.entries.iter_mut().find(|e| e.path == key) {
                e.used = true;
                let on: bool = typed(key, &e.value, "true or false")?;
                let implied = if on { Precision::Fp16 } else { Precision::No };
                if mp_written
                    && (on != (c.train.mixed_precision == Precision::Fp16))
                    && (on || c.train.mixed_precision == Precision::Fp16)
                {
                    return Err(ConfigError::Conflict {
                        canonical: "train.mixed_precision".into(),
                        first_key: "train.mixed_precision".into(),
                        first_value: format!("{:?}", c.train.mixed_precision).to_lowercase(),
                        second_key: key.into(),
                        second_value: on.to_string(),
                    });
                }
                if !mp_written {
                    c.train.mixed_precision = implied;
                }
            }
        }
        if let Some(e) = doc.entries.iter_mut().find(|e| e.path == "full_bf16") {
            e.used = true;
            let on: bool = typed("full_bf16", &e.value, "true or false")?;
            if on {
                if mp_written
                    && !matches!(
                        c.train.mixed_precision,
                        Precision::Bf16 | Precision::FullBf16
                    )
                {
                    return Err(ConfigError::Conflict {
                        canonical: "train.mixed_precision".into(),
                        first_key: "mixed_precision".into(),
                        first_value: format!("{:?}", c.train.mixed_precision).to_lowercase(),
                        second_key: "full_bf16".into(),
                        second_value: "true".into(),
                    });
                }
                c.train.mixed_precision = Precision::FullBf16;
            }
        }
        let opt_written = spellings("train.optimizer")
            .iter()
            .any(|k| doc.entries.iter().any(|e| e.path == *k));
        for key in ["train.use_8bit_adam", "use_8bit_adam"] {
            if let Some(e) = doc.entries.iter_mut().find(|e| e.path == key) {
                e.used = true;
                let on: bool = typed(key, &e.value, "true or false")?;
                if opt_written {
                    let is8 = c.train.optimizer == OptimizerName::AdamW8bit;
                    if on != is8 && (on || is8) {
                        return Err(ConfigError::Conflict {
                            canonical: "train.optimizer".into(),
                            first_key: "train.optimizer".into(),
                            first_value: format!("{:?}", c.train.optimizer),
                            second_key: key.into(),
                            second_value: on.to_string(),
                        });
                    }
                } else if on {
                    c.train.optimizer = OptimizerName::AdamW8bit;
                }
            }
        }

        // memory
        if let Some((s, _)) = doc.get_with("memory.budget", size_of)? {
            c.memory.budget = Some(s);
        }
        doc.set(
            "memory.gpu",
            "a GPU name such as \"RTX 3060\"",
            &mut c.memory.gpu,
        )?;
        if c.memory.gpu.is_some() && c.memory.budget.is_some() {
            return Err(ConfigError::Conflict {
                canonical: "memory budget".into(),
                first_key: "memory.budget".into(),
                first_value: c
                    .memory
                    .budget
                    .as_ref()
                    .map(|s| format!("{:?}", s.text))
                    .unwrap_or_default(),
                second_key: "memory.gpu".into(),
                second_value: c
                    .memory
                    .gpu
                    .as_ref()
                    .map(|s| format!("{s:?}"))
                    .unwrap_or_default(),
            });
        }
        doc.set("memory.auto_fit", "true or false", &mut c.memory.auto_fit)?;
        doc.set("memory.force", "true or false", &mut c.memory.force)?;
        doc.set(
            "memory.cpu_return_freed",
            "true or false",
            &mut c.memory.cpu_return_freed,
        )?;

        // logging
        doc.set(
            "logging.log_every_n_steps",
            "a positive integer",
            &mut c.logging.log_every_n_steps,
        )?;
        doc.set(
            "logging.logging_dir",
            "a folder",
            &mut c.logging.logging_dir,
        )?;
        doc.set("logging.progress", "true or false", &mut c.logging.progress)?;
        doc.set(
            "logging.tensorboard",
            "true or false",
            &mut c.logging.tensorboard,
        )?;
        doc.set(
            "logging.sample_prompt",
            "a string",
            &mut c.logging.sample_prompt,
        )?;
        doc.set(
            "logging.sample_max_new_tokens",
            "a positive integer",
            &mut c.logging.sample_max_new_tokens,
        )?;
        doc.set(
            "logging.sample_every_n_steps",
            "a non-negative integer",
            &mut c.logging.sample_every_n_steps,
        )?;
        doc.set(
            "logging.sample_prompts",
            "a list of prompts",
            &mut c.logging.sample_prompts,
        )?;
        if let Some((s, _)) = doc.get_with("logging.sample_sampler", |k, v| {
            match v.as_str().map(str::to_ascii_lowercase).as_deref() {
                Some("ddim") => Ok("ddim".to_string()),
                Some("euler") => Ok("euler".to_string()),
                _ => Err(invalid(k, v, "\"ddim\" or \"euler\"")),
            }
        })? {
            c.logging.sample_sampler = s;
        }
        doc.set(
            "logging.sample_steps",
            "a positive integer",
            &mut c.logging.sample_steps,
        )?;
        check_range(
            "logging.sample_steps",
            c.logging.sample_steps,
            c.logging.sample_steps >= 1,
            "an integer >= 1",
        )?;
        doc.set(
            "logging.sample_guidance_scale",
            "a number >= 1 (1 = no guidance)",
            &mut c.logging.sample_guidance_scale,
        )?;

        // system
        doc.set("system.seed", "a non-negative integer", &mut c.system.seed)?;
        if let Some((d, _)) = doc.get_with("system.device", |k, v| {
            let s = v.as_str().unwrap_or_default();
            let ok = matches!(s, "cpu" | "cuda" | "auto")
                || s.strip_prefix("cuda:")
                    .map(|n| n.parse::<u32>().is_ok())
                    .unwrap_or(false);
            if ok {
                Ok(s.to_string())
            } else {
                Err(invalid(
                    k,
                    v,
                    "one of \"auto\", \"cpu\", \"cuda\", \"cuda:N\"",
                ))
            }
        })? {
            c.system.device = d;
        }
        doc.set(
            "system.num_threads",
            "a positive integer",
            &mut c.system.num_threads,
        )?;

        // data_loader
        doc.set(
            "data_loader.num_workers",
            "a non-negative integer",
            &mut c.data_loader.num_workers,
        )?;
        doc.set(
            "data_loader.persistent_workers",
            "true or false",
            &mut c.data_loader.persistent_workers,
        )?;
        doc.set(
            "data_loader.prefetch_factor",
            "a positive integer",
            &mut c.data_loader.prefetch_factor,
        )?;
        doc.set(
            "data_loader.shuffle",
            "true or false",
            &mut c.data_loader.shuffle,
        )?;

        // tagger
        if doc.entries.iter().any(|e| e.path.starts_with("tagger.")) {
            let mut tg = TaggerSection::default();
            let ms = &mut tg.model_settings;
            doc.set(
                "tagger.model_settings.precision",
                "a string such as \"fp16\"",
                &mut ms.precision,
            )?;
            doc.set(
                "tagger.model_settings.device",
                "a string such as \"cuda\"",
                &mut ms.device,
            )?;
            doc.set(
                "tagger.model_settings.device_map",
                "a string such as \"auto\"",
                &mut ms.device_map,
            )?;
            doc.set(
                "tagger.model_settings.low_cpu_mem_usage",
                "true or false",
                &mut ms.low_cpu_mem_usage,
            )?;
            if let Some((s, _)) = doc.get_with("tagger.model_settings.max_memory.cuda", size_of)? {
                ms.max_memory.cuda = Some(s);
            }
            if let Some((s, _)) = doc.get_with("tagger.model_settings.max_memory.cpu", size_of)? {
                ms.max_memory.cpu = Some(s);
            }
            let g = &mut tg.generation_settings;
            doc.set(
                "tagger.generation_settings.max_batch_size",
                "a positive integer",
                &mut g.max_batch_size,
            )?;
            doc.set(
                "tagger.generation_settings.timeout",
                "seconds",
                &mut g.timeout,
            )?;
            doc.set(
                "tagger.generation_settings.retry_attempts",
                "a non-negative integer",
                &mut g.retry_attempts,
            )?;
            let m = &mut tg.memory_management;
            doc.set(
                "tagger.memory_management.auto_clear_interval",
                "a positive integer",
                &mut m.auto_clear_interval,
            )?;
            doc.set(
                "tagger.memory_management.cache_size",
                "a non-negative integer",
                &mut m.cache_size,
            )?;
            c.tagger = Some(tg);
        }

        // leftovers
        let unknown: Vec<UnknownKey> = doc
            .entries
            .iter()
            .filter(|e| !e.used)
            .map(|e| {
                let top = e.path.split('.').next().unwrap_or_default();
                let hint = if TAGGER_SECTIONS.contains(&top) {
                    Some(format!(
                        "`{top}` is a tagger setting: put it under a `tagger:` section"
                    ))
                } else {
                    None
                };
                let suggestion = if hint.is_some() {
                    Some(format!("tagger.{}", e.path))
                } else {
                    suggest(&e.path)
                };
                UnknownKey {
                    key: e.path.clone(),
                    value: render(&e.value),
                    suggestion,
                    hint,
                }
            })
            .collect();
        if !unknown.is_empty() {
            return Err(ConfigError::UnknownKeys(unknown));
        }
        Ok(c)
    }

    /// The path of the base model, or an error saying what to write.
    ///
    /// # Errors
    /// [`ConfigError::Missing`].
    pub fn base_model(&self) -> Result<&str> {
        self.model
            .base_model
            .as_deref()
            .ok_or_else(|| ConfigError::Missing {
                key: "model.base_model".into(),
                hint: "set it to a .gguf file, a .safetensors file or a folder with config.json"
                    .into(),
            })
    }

    /// Notes about how values were read (assumed size units), for printing at start.
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(b) = &self.memory.budget
            && let Some(a) = &b.assumed
        {
            out.push(format!("memory.budget {:?}: {a}", b.text));
        }
        out
    }
}

fn parse_yaml(text: &str) -> std::result::Result<Value, String> {
    let y: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    Ok(yaml_to_json(&y))
}

/// YAML → JSON values. JSON has no NaN/Infinity (serde_json turns them into `null`, which would
/// read as "key absent" and silently keep the default): they become strings that no numeric key
/// accepts, so `learning_rate: .nan` is an error naming the key.
fn yaml_to_json(y: &serde_yaml_ng::Value) -> Value {
    use serde_yaml_ng::Value as Y;
    match y {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(*b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .unwrap_or_else(|| Value::String(format!("{f} (not a finite number)")))
            }
        }
        Y::String(s) => Value::String(s.clone()),
        Y::Sequence(v) => Value::Array(v.iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s.clone(),
                        other => serde_yaml_ng::to_string(other)
                            .map(|t| t.trim().to_string())
                            .unwrap_or_default(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => yaml_to_json(&t.value),
    }
}

fn parse_toml(text: &str) -> std::result::Result<Value, String> {
    let t: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    Ok(toml_to_json(&toml::Value::Table(t)))
}

/// TOML → JSON values, with non-finite floats kept visible as for YAML.
fn toml_to_json(t: &toml::Value) -> Value {
    match t {
        toml::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or_else(|| Value::String(format!("{f} (not a finite number)"))),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
        other => serde_json::to_value(other).unwrap_or(Value::Null),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_numbers_are_errors_not_defaults() {
        for text in [
            "train:\n  learning_rate: .nan\n",
            "train:\n  learning_rate: .inf\n",
        ] {
            let e = TrainConfig::from_yaml_str(text).unwrap_err().to_string();
            assert!(e.contains("train.learning_rate"), "{e}");
        }
        let e = TrainConfig::from_toml_str("[train]\nlearning_rate = nan\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("train.learning_rate"), "{e}");
    }

    #[test]
    fn edit_distance_counts_single_edits() {
        assert_eq!(edit_distance("learnig_rate", "learning_rate"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn aliases_agreeing_are_accepted_and_disagreeing_conflict() {
        let c = TrainConfig::from_yaml_str("train:\n  batch_size: 4\ndata:\n  batch_size: 4\n")
            .unwrap();
        assert_eq!(c.train.batch_size, 4);
        let e = TrainConfig::from_yaml_str("train:\n  batch_size: 4\ndata:\n  batch_size: 2\n")
            .unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ConfigError::Conflict { .. }), "{msg}");
        assert!(
            msg.contains("train.batch_size") && msg.contains("data.batch_size"),
            "{msg}"
        );
    }

    #[test]
    fn a_known_spelling_under_the_wrong_section_points_at_the_settings_own_key() {
        let e = TrainConfig::from_yaml_str("lora:\n  network_dim: 16\n").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("did you mean `lora.rank`"), "{msg}");
    }

    #[test]
    fn unknown_key_gets_a_hint() {
        let e = TrainConfig::from_yaml_str("train:\n  learnig_rate: 0.001\n").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("train.learnig_rate")
                && msg.contains("did you mean `train.learning_rate`"),
            "{msg}"
        );
        assert!(msg.contains("0.001"), "{msg}");
    }

    #[test]
    fn choices_report_allowed_values() {
        let e = TrainConfig::from_yaml_str("train:\n  mixed_precision: fp8\n").unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("\"fp8\"")
                && msg.contains("\"bf16\"")
                && msg.contains("train.mixed_precision"),
            "{msg}"
        );
    }

    #[test]
    fn canonical_yaml_round_trips() {
        let mut c = TrainConfig::default();
        c.lora.rank = 16;
        c.lora.target_modules = TargetModules::Regex(".*proj".into());
        c.memory.budget = Some(parse_size_key("memory.budget", "6GB").unwrap());
        c.train.export_formats = vec![ExportFormat::Peft, ExportFormat::Kohya];
        let y = c.to_yaml().unwrap();
        let back = TrainConfig::from_yaml_str(&y).unwrap();
        assert_eq!(back, c, "{y}");
    }

    /// A config with every documented key set to a value other than its default, built in code
    /// (the Rust builder of the round-trip test below).
    fn every_key_set() -> TrainConfig {
        let mut c = TrainConfig::default();
        let size = |t: &str| parse_size_key("size", t).unwrap();
        c.model.base_model = Some("models/base.gguf".into());
        c.model.weights = BaseWeights::Quantized;
        c.model.dtype = Dtype::Bf16;
        c.model.kind = ModelKind::Llm;
        c.model.tokenizer = Some("tok".into());
        c.lora.rank = 16;
        c.lora.alpha = 32.0;
        c.lora.dropout = 0.1;
        c.lora.target_modules = TargetModules::list(&["q_proj", "k_proj", "v_proj", "o_proj"]);
        c.lora.exclude_modules = Some(TargetModules::list(&["lm_head"]));
        c.lora.use_rslora = true;
        c.lora.use_dora = true;
        c.lora.init_lora_weights = InitLoraWeights::Gaussian;
        c.lora.rank_pattern = [("q_proj".to_string(), 4)].into();
        c.lora.alpha_pattern = [("q_proj".to_string(), 8.0)].into();
        c.lora.network_module = Some("networks.lora".into());
        c.data.train_data_dir = Some("data/train.txt".into());
        c.data.format = DataFormat::Jsonl;
        c.data.eval_file = Some("data/eval.txt".into());
        c.data.eval_fraction = 0.2;
        c.data.max_bytes = Some(1000);
        c.data.seq_len = 512;
        c.data.resolution = Some([768, 512]);
        c.data.caption_extension = Some(".txt".into());
        c.data.keep_tokens = Some(1);
        c.data.shuffle_caption = Some(true);
        c.data.enable_bucket = Some(true);
        c.data.min_bucket_reso = Some(256);
        c.data.max_bucket_reso = Some(1024);
        c.data.bucket_reso_steps = Some(64);
        c.data.cache_latents = Some(true);
        c.data.bad_images = BadImages::Stop;
        c.train.batch_size = 4;
        c.train.gradient_accumulation_steps = 2;
        c.train.epochs = 3;
        c.train.max_steps = Some(100);
        c.train.learning_rate = 2e-4;
        c.train.optimizer = OptimizerName::SgdNesterov;
        c.train.weight_decay = 0.01;
        c.train.momentum = Some(0.8);
        c.train.loraplus_lr_ratio = Some(16.0);
        c.train.lr_scheduler = SchedulerKind::CosineWithRestarts;
        c.train.warmup_steps = 10;
        c.train.num_cycles = 2;
        c.train.power = 2.0;
        c.train.mixed_precision = Precision::Bf16;
        c.train.gradient_checkpointing = true;
        c.train.max_grad_norm = 0.5;
        c.train.nan_policy = NanPolicy::LowerLr;
        c.train.save_every_n_steps = Some(50);
        c.train.save_every_n_epochs = Some(1);
        c.train.keep_last_checkpoints = 5;
        c.train.eval_every_n_steps = 25;
        c.train.output_dir = "out/run".into();
        c.train.output_name = "run".into();
        c.train.export_formats = vec![ExportFormat::Kohya];
        c.train.noise_offset = 0.05;
        c.train.min_snr_gamma = Some(5.0);
        c.train.prediction_type = Some("v_prediction".into());
        c.train.clip_skip = Some(2);
        c.train.train_text_encoder = true;
        c.memory.budget = Some(size("12GiB")); // `memory.gpu` is the alternative: see below
        c.memory.auto_fit = true;
        c.memory.force = true;
        c.memory.cpu_return_freed = !MemorySection::default().cpu_return_freed;
        c.logging.log_every_n_steps = 7;
        c.logging.logging_dir = Some("logs".into());
        c.logging.progress = !LoggingSection::default().progress;
        c.logging.tensorboard = !LoggingSection::default().tensorboard;
        c.logging.sample_prompt = Some("Once".into());
        c.logging.sample_max_new_tokens = 12;
        c.logging.sample_every_n_steps = 30;
        c.logging.sample_prompts = vec!["a cat".into(), "a dog".into()];
        c.logging.sample_sampler = "euler".into();
        c.logging.sample_steps = 12;
        c.logging.sample_guidance_scale = 3.5;
        c.system.seed = 7;
        c.system.device = "cuda:1".into();
        c.system.num_threads = Some(3);
        c.data_loader.num_workers = 3;
        c.data_loader.persistent_workers = !DataLoaderSection::default().persistent_workers;
        c.data_loader.prefetch_factor = 4;
        c.data_loader.shuffle = !DataLoaderSection::default().shuffle;
        let mut t = TaggerSection::default();
        t.model_settings.precision = Some("bf16".into());
        t.model_settings.device = Some("cpu".into());
        t.model_settings.device_map = Some("auto".into());
        t.model_settings.low_cpu_mem_usage = Some(true);
        t.model_settings.max_memory.cuda = Some(size("6GB"));
        t.model_settings.max_memory.cpu = Some(size("16GB"));
        t.generation_settings.max_batch_size = Some(8);
        t.generation_settings.timeout = Some(30.0);
        t.generation_settings.retry_attempts = Some(2);
        t.memory_management.auto_clear_interval = Some(10);
        t.memory_management.cache_size = Some(100);
        c.tagger = Some(t);
        c
    }

    /// The value at a dotted key path of a serialized config.
    fn at<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
        key.split('.').try_fold(v, |v, k| v.get(k))
    }

    #[test]
    fn every_documented_key_reaches_the_engine_alike_from_yaml_toml_and_code() {
        // two settings that exclude each other (a budget, or a GPU to take it from) are set in
        // a second variant
        let mut with_gpu = every_key_set();
        with_gpu.memory.budget = None;
        with_gpu.memory.gpu = Some("RTX 3060 12GB".into());
        let variants = [every_key_set(), with_gpu];
        let as_json: Vec<Value> = variants
            .iter()
            .map(|c| serde_json::to_value(c).unwrap())
            .collect();
        let defaults = serde_json::to_value(TrainConfig::default()).unwrap();
        // every documented key is a field of the config, and the test gives it a value of its own
        for names in KEYS {
            let key = names[0];
            let values: Vec<&Value> = as_json.iter().filter_map(|v| at(v, key)).collect();
            assert!(!values.is_empty(), "{key}: not a config field");
            assert!(
                values.iter().any(|v| Some(*v) != at(&defaults, key)),
                "{key} is left at its default by the test"
            );
        }
        // ... and every field of the config is documented
        fn leaves(v: &Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
            match v {
                Value::Object(m) if !MAP_VALUED.contains(&prefix) => {
                    for (k, v) in m {
                        let p = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        leaves(v, &p, out);
                    }
                }
                _ => {
                    out.insert(prefix.to_string());
                }
            }
        }
        let mut fields = std::collections::BTreeSet::new();
        for v in &as_json {
            leaves(v, "", &mut fields);
        }
        for f in &fields {
            assert!(
                KEYS.iter().any(|names| names[0] == f),
                "{f}: a config field without a KEYS entry"
            );
        }
        assert_eq!(fields.len(), KEYS.len());
        // every alias spelling sets its key's field to the same value
        for names in KEYS {
            let key = names[0];
            let Some(value) = as_json
                .iter()
                .filter_map(|v| at(v, key))
                .find(|v| Some(*v) != at(&defaults, key))
            else {
                continue;
            };
            for alias in &names[1..] {
                let mut doc = serde_json::Map::new();
                let parts: Vec<&str> = alias.split('.').collect();
                let mut leaf = value.clone();
                for p in parts.iter().skip(1).rev() {
                    leaf = serde_json::json!({ *p: leaf });
                }
                doc.insert(parts[0].to_string(), leaf);
                let yaml = serde_yaml_ng::to_string(&Value::Object(doc)).unwrap();
                let cfg = TrainConfig::from_yaml_str(&yaml)
                    .unwrap_or_else(|e| panic!("{alias} (for {key}): {e}\n{yaml}"));
                let got = serde_json::to_value(&cfg).unwrap();
                assert_eq!(
                    at(&got, key),
                    Some(value),
                    "{alias} does not set {key}:\n{yaml}"
                );
            }
        }
        for built in &variants {
            round_trip_and_lower(built);
        }
        // the values the engine gets are the ones set
        let t = crate::job::trainer_config(&variants[0], tch::Device::Cpu, Path::new("out"), 100)
            .unwrap();
        assert_eq!(
            t.optimizer,
            crate::engine::optim::OptimizerKind::Sgd(crate::engine::optim::SgdConfig {
                momentum: 0.8,
                weight_decay: 0.01,
                nesterov: true,
                ..Default::default()
            })
        );
        assert_eq!(
            (t.lr, t.warmup_steps, t.gradient_accumulation_steps),
            (2e-4, 10, 2)
        );
    }

    /// `built` read back from YAML (canonical keys) and TOML is equal, and lowers to the same
    /// engine, lora-core and lora-memory settings.
    fn round_trip_and_lower(built: &TrainConfig) {
        // the same config from YAML (canonical keys), TOML and code
        let yaml = built.to_yaml().unwrap();
        let from_yaml = TrainConfig::from_yaml_str(&yaml).unwrap();
        assert_eq!(&from_yaml, built, "YAML:\n{yaml}");
        let toml_text = toml::to_string(built).unwrap();
        let from_toml = TrainConfig::from_toml_str(&toml_text).unwrap();
        assert_eq!(&from_toml, built, "TOML:\n{toml_text}");

        // ... lowered to the engine, lora-core and lora-memory alike
        for cfg in [&from_yaml, &from_toml] {
            let lower = |c: &TrainConfig| {
                let t =
                    crate::job::trainer_config(c, tch::Device::Cpu, Path::new("out"), 100).unwrap();
                let l = crate::job::lora_config(c, "base").unwrap();
                let (s, _) = crate::job::settings_for(c, None, true);
                format!("{t:?}\n{l:?}\n{s:?}")
            };
            assert_eq!(lower(cfg), lower(built));
        }
    }
}
