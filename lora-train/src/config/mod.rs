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

mod gui;
mod keys;
mod kohya;

pub use kohya::{ConfigWarning, ConfigWarnings};

use keys::{
    BOOLEAN, ByName, Choice, Doc, KeySpec, Listed, Mapping, Named, Reader, Section, Spellings, Sub,
    Typed, invalid, parse, parse_toml, parse_yaml, render, section, some, typed,
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The engine's schedules, by their `lr_scheduler` names.
pub use crate::engine::sched::SchedulerKind;

/// The engine's mixed-precision modes, by their `mixed_precision` names.
pub use crate::engine::precision::Precision;

/// The engine's policy for a non-finite loss or gradient norm (`train.nan_policy`).
pub use crate::engine::NonFinitePolicy;

/// The optimizer a config names: the engine's [`OptimizerName`] (one table of names, defaults
/// and planner terms for the config, the trainer and the plan).
pub use crate::engine::optim::OptimizerName;

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
        /// `"YAML"`, `"TOML"` or `"JSON"`.
        format: &'static str,
        /// The parser's message (with line/column).
        message: String,
    },
    /// The file extension is neither YAML nor TOML.
    #[error(
        "{path}: unknown config extension; use .yaml, .yml, .toml, or .json (a kohya_ss GUI config)"
    )]
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
    /// Keep the base quantized, dequantized per forward (least memory): a GGUF file's blocks as
    /// stored; a dense safetensors base as QLoRA's NF4 with double quantization at load (an LLM
    /// folder's decoder-layer linears, the embedding and head staying dense; a FLUX
    /// transformer's linears).
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

impl BaseWeights {
    /// The mode as configs spell it (`dense`, `quantized`).
    pub fn name(self) -> &'static str {
        WEIGHT_MODES
            .iter()
            .find(|(_, m)| *m == self)
            .map_or("dense", |(n, _)| n)
    }
}

impl Dtype {
    /// The dtype as configs spell it first (`f32`, `bf16`, `f16`).
    pub fn name(self) -> &'static str {
        DTYPES
            .iter()
            .find(|(_, d)| *d == self)
            .map_or("f32", |(n, _)| n)
    }

    /// The tensor dtype.
    pub fn kind(self) -> tch::Kind {
        match self {
            Dtype::F32 => tch::Kind::Float,
            Dtype::Bf16 => tch::Kind::BFloat16,
            Dtype::F16 => tch::Kind::Half,
        }
    }
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
    /// FLUX.1 (dev or schnell): the rectified-flow transformer with T5-XXL and CLIP-L.
    Flux,
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
    /// Chat messages, rendered with the model's chat template (ChatML when it has none).
    Chat,
    /// kohya image folders with caption sidecars.
    Images,
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

/// dtype of the adapter files (`train.save_precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SavePrecision {
    /// 32-bit float (kohya `float`).
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
}

impl SavePrecision {
    /// The tensor dtype of the adapter files.
    pub fn kind(self) -> tch::Kind {
        match self {
            SavePrecision::F32 => tch::Kind::Float,
            SavePrecision::F16 => tch::Kind::Half,
            SavePrecision::Bf16 => tch::Kind::BFloat16,
        }
    }
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

section! {
    /// `[model]`: the base model.
    pub struct ModelSection at "model" {
        /// The base: a `.gguf` file, a `.safetensors` file or an HF folder with `config.json`,
        /// or a Hugging Face Hub id (`owner/name`, optionally `@revision`) found in the local
        /// Hugging Face cache ([`crate::hub`]; resolved by [`crate::job::resolve_base_model`])
        /// (aliases: `model.path`, kohya `pretrained_model_name_or_path`).
        base_model: Option<String> = None,
            Typed("a path to a .gguf / .safetensors file or a model folder, or a Hub id owner/name"),
            aka ["model.path", "pretrained_model_name_or_path"];
        /// Frozen weights dense or quantized (alias `model.weight_mode`).
        weights: BaseWeights = BaseWeights::Dense, Choice(WEIGHT_MODES), aka ["model.weight_mode"];
        /// Dtype of dense base weights (kohya `full_bf16: true` → bf16).
        dtype: Dtype = Dtype::F32, Choice(DTYPES);
        /// `auto` (default), `llm`, `sd15`, `sdxl`: which job trains the model.
        kind: ModelKind = ModelKind::Auto, Choice(MODEL_KINDS);
        /// The HF `model_type` to read the base's `config.json` as, for the plan (default: the
        /// file's own `model_type`, which must then be present). `generic` reads any
        /// LLaMA-shaped decoder (RMSNorm, RoPE, SwiGLU) whose `config.json` lacks one.
        #[serde(skip_serializing_if = "Option::is_none")]
        model_type: Option<String> = None,
            Typed("an HF model_type (llama, mistral, qwen2, qwen3, …) or \"generic\"");
        /// For a single-file Stable Diffusion base (which holds no tokenizer): a CLIP tokenizer
        /// folder, or a diffusers pipeline folder whose `tokenizer/` (SDXL: and `tokenizer_2/`)
        /// and component `config.json` files are used. Default: the base file's folder when it
        /// has a `tokenizer/`.
        #[serde(skip_serializing_if = "Option::is_none")]
        tokenizer: Option<String> = None,
            Typed("a tokenizer folder or a diffusers pipeline folder");
    }
}

section! {
    /// `[lora]`: the adapter.
    pub struct LoraSection at "lora" {
        /// Rank `r` (default 8; aliases `lora.r`, `model.lora_rank`, kohya `network_dim`).
        rank: u32 = 8, Typed("a positive integer (the LoRA rank r)"),
            aka ["lora.r", "model.lora_rank", "network_dim"],
            check |r| *r >= 1 => "an integer >= 1";
        /// `alpha` (default 8 like PEFT; `scaling = alpha / rank`; aliases `lora.lora_alpha`,
        /// `model.lora_alpha`, kohya `network_alpha`).
        alpha: f64 = 8.0, Typed("a positive number (scaling = alpha / rank)"),
            aka ["lora.lora_alpha", "model.lora_alpha", "network_alpha"],
            check |a| *a > 0.0 && a.is_finite() => "a number > 0";
        /// Dropout on the adapter input (default 0; aliases `lora.lora_dropout`, kohya
        /// `network_dropout`).
        dropout: f64 = 0.0, Typed("a probability in [0, 1)"),
            aka ["lora.lora_dropout", "network_dropout"],
            check |p| (0.0..1.0).contains(p) => "a probability in [0, 1)";
        /// Target modules (default `["q_proj","v_proj"]`, PEFT's default for LLaMA).
        target_modules: TargetModules = default_target_modules(), parse(targets);
        /// Modules never adapted (PEFT `exclude_modules`).
        exclude_modules: Option<TargetModules> = None, some(targets);
        /// rsLoRA scaling `alpha / sqrt(r)` (arXiv:2312.03732).
        use_rslora: bool = false, Typed(BOOLEAN);
        /// DoRA (arXiv:2402.09353).
        use_dora: bool = false, Typed(BOOLEAN);
        /// PEFT `init_lora_weights`: `true` (Kaiming-uniform A, zero B), `false` or `"gaussian"`.
        init_lora_weights: InitLoraWeights = InitLoraWeights::Kaiming, parse(|k, v| match v {
            Value::Bool(true) => Ok(InitLoraWeights::Kaiming),
            Value::Bool(false) => Ok(InitLoraWeights::Random),
            Value::String(s) if s == "gaussian" => Ok(InitLoraWeights::Gaussian),
            _ => Err(invalid(k, v, "true, false or \"gaussian\"")),
        });
        /// Per-module rank overrides (PEFT `rank_pattern`).
        rank_pattern: BTreeMap<String, u32> = BTreeMap::new(),
            Mapping("a mapping module pattern -> rank");
        /// Per-module alpha overrides (PEFT `alpha_pattern`).
        alpha_pattern: BTreeMap<String, f64> = BTreeMap::new(),
            Mapping("a mapping module pattern -> alpha");
        /// kohya `network_module` (only `networks.lora` is LoRA; kept for the kohya metadata).
        network_module: Option<String> = None, some(|k, v| match v.as_str() {
            Some(m @ ("networks.lora" | "lycoris.kohya" | "networks.lora_flux")) => Ok(m.to_string()),
            _ => Err(invalid(
                k,
                v,
                "\"networks.lora\", \"networks.lora_flux\" (FLUX.1), or \"lycoris.kohya\" with \
                 `algo=locon` in network_args (other network modules — DyLoRA, OFT, LoHa, LoKr, \
                 IA3 — are not supported yet)",
            )),
        }), aka ["network_module"];
        /// LoCon: the rank of the LoRA on the UNet's 3×3 convolutions (ResNet blocks,
        /// down/upsamplers); unset = linear layers and 1×1 convolutions only (kohya
        /// `network_args = ["conv_dim=N"]`).
        #[serde(skip_serializing_if = "Option::is_none")]
        conv_rank: Option<u32> = None, Typed("a positive integer (the LoCon rank)"),
            check |r| r.is_none_or(|r| r >= 1) => "an integer >= 1";
        /// LoCon alpha of the 3×3 convolutions (kohya `conv_alpha`; default: `conv_rank`, as
        /// kohya, so the scaling is 1).
        #[serde(skip_serializing_if = "Option::is_none")]
        conv_alpha: Option<f64> = None, Typed("a positive number"),
            check |a| a.is_none_or(|a| a > 0.0 && a.is_finite()) => "a number > 0";
    }
}

section! {
    /// `[data]`: the training data.
    pub struct DataSection at "data" {
        /// Training file or folder (aliases `data.path`, `data.train_file`, kohya
        /// `train_data_dir`).
        train_data_dir: Option<String> = None, Typed("a path"),
            aka ["data.path", "data.train_file", "train_data_dir"];
        /// Layout.
        format: DataFormat = DataFormat::Text, Choice(FORMATS);
        /// Held-out text for perplexity before/after (file); when absent, `eval_fraction` of the
        /// training text is held out.
        eval_file: Option<String> = None, Typed("a path");
        /// Fraction of the text held out for evaluation when `eval_file` is absent (default 0.05).
        eval_fraction: f64 = 0.05, Typed("a fraction in [0, 1)"),
            check |f| (0.0..1.0).contains(f) => "a fraction in [0, 1)";
        /// Use at most this many bytes of the training text (a slice of a larger corpus).
        max_bytes: Option<u64> = None, some(|k, v| match v {
            Value::Number(n) => n
                .as_u64()
                .ok_or_else(|| invalid(k, v, "a byte count or a size like \"200KB\"")),
            _ => size_of(k, v).map(|s| s.bytes),
        });
        /// Tokens per training sequence (aliases `data.max_seq_len`, `data.block_size`, kohya
        /// `max_token_length`; default 256).
        seq_len: u32 = 256, Typed("a positive integer (tokens per sequence)"),
            aka ["data.max_seq_len", "data.block_size", "max_token_length"],
            check |n| *n >= 2 => "an integer >= 2";
        /// Square training resolution in pixels, or `[w, h]` (images; kohya
        /// `resolution: "512,512"`).
        resolution: Option<[u32; 2]> = None, some(resolution), aka ["resolution"];
        /// kohya `caption_extension` (default `.caption`).
        caption_extension: Option<String> = None,
            Typed("a file extension such as \".txt\""),
            aka ["caption_extension", "caption_extention"];
        /// kohya `reg_data_dir`: regularization images (DreamBooth prior preservation), in the
        /// same `<repeats>_<name>` folder layout.
        #[serde(skip_serializing_if = "Option::is_none")]
        reg_data_dir: Option<String> = None, Typed("a folder"), aka ["reg_data_dir"];
        /// kohya `flip_aug`: mirror images at random.
        #[serde(skip_serializing_if = "Option::is_none")]
        flip_aug: Option<bool> = None, Typed(BOOLEAN), aka ["flip_aug"];
        /// kohya `random_crop`: crop at a random place instead of the centre.
        #[serde(skip_serializing_if = "Option::is_none")]
        random_crop: Option<bool> = None, Typed(BOOLEAN), aka ["random_crop"];
        /// kohya `caption_dropout_rate`: probability of training a step on an empty caption.
        #[serde(skip_serializing_if = "Option::is_none")]
        caption_dropout_rate: Option<f64> = None, Typed("a probability in [0, 1]"),
            aka ["caption_dropout_rate"],
            check |p| p.is_none_or(|p| (0.0..=1.0).contains(&p)) => "a probability in [0, 1]";
        /// kohya `caption_tag_dropout_rate`: probability of dropping each tag of a caption.
        #[serde(skip_serializing_if = "Option::is_none")]
        caption_tag_dropout_rate: Option<f64> = None, Typed("a probability in [0, 1]"),
            aka ["caption_tag_dropout_rate"],
            check |p| p.is_none_or(|p| (0.0..=1.0).contains(&p)) => "a probability in [0, 1]";
        /// kohya `caption_prefix`: text put before every caption.
        #[serde(skip_serializing_if = "Option::is_none")]
        caption_prefix: Option<String> = None, Typed("a string"), aka ["caption_prefix"];
        /// kohya `caption_suffix`: text put after every caption.
        #[serde(skip_serializing_if = "Option::is_none")]
        caption_suffix: Option<String> = None, Typed("a string"), aka ["caption_suffix"];
        /// kohya `caption_separator` between tags (default `,`).
        #[serde(skip_serializing_if = "Option::is_none")]
        caption_separator: Option<String> = None, Typed("a string"), aka ["caption_separator"];
        /// kohya `keep_tokens`.
        keep_tokens: Option<u32> = None, Typed("a non-negative integer"), aka ["keep_tokens"];
        /// kohya `shuffle_caption`.
        shuffle_caption: Option<bool> = None, Typed(BOOLEAN), aka ["shuffle_caption"];
        /// kohya `enable_bucket`.
        enable_bucket: Option<bool> = None, Typed(BOOLEAN), aka ["enable_bucket"];
        /// kohya `min_bucket_reso`.
        min_bucket_reso: Option<u32> = None, Typed("pixels"), aka ["min_bucket_reso"];
        /// kohya `max_bucket_reso`.
        max_bucket_reso: Option<u32> = None, Typed("pixels"), aka ["max_bucket_reso"];
        /// kohya `bucket_reso_steps`.
        bucket_reso_steps: Option<u32> = None, Typed("pixels"), aka ["bucket_reso_steps"];
        /// kohya `cache_latents`.
        cache_latents: Option<bool> = None, Typed(BOOLEAN), aka ["cache_latents"];
        /// What the image jobs do with images that cannot be used (an empty, cut-short or
        /// corrupt file, an unsupported format, an unreadable caption): `skip` them, each named
        /// in a warning (the default), or `stop` before training with every one listed (exit 2).
        bad_images: BadImages = BadImages::Skip, Choice(BAD_IMAGES);
    }
}

section! {
    /// `[train]`: the optimisation. The schedule, precision, optimizer and NaN policy are the
    /// engine's own types ([`SchedulerKind`], [`Precision`], [`OptimizerName`],
    /// [`NonFinitePolicy`]) with the engine's defaults.
    pub struct TrainSection at "train" {
        /// Micro-batch size (aliases `data.batch_size`, kohya `train_batch_size`; default 1).
        batch_size: u32 = 1, Typed("a positive integer (micro-batch)"),
            aka ["data.batch_size", "train_batch_size"],
            check |n| *n >= 1 => "an integer >= 1";
        /// Gradient accumulation (alias `data.gradient_accumulation_steps`; default 1).
        gradient_accumulation_steps: u32 = 1, Typed("a positive integer"),
            aka ["data.gradient_accumulation_steps", "gradient_accumulation_steps"],
            check |n| *n >= 1 => "an integer >= 1";
        /// Epochs (alias kohya `max_train_epochs`; default 1).
        epochs: u32 = 1, Typed("a positive integer"), aka ["max_train_epochs"],
            check |n| *n >= 1 => "an integer >= 1";
        /// Optimizer steps; overrides `epochs` when set (kohya `max_train_steps`).
        max_steps: Option<u64> = None, Typed("a positive integer"), aka ["max_train_steps"],
            check |n| n.is_none_or(|n| n >= 1) => "an integer >= 1";
        /// Peak learning rate (default 1e-4).
        learning_rate: f64 = 1e-4, Typed("a positive number such as 1e-4"),
            aka ["learning_rate"],
            check |lr| *lr > 0.0 && lr.is_finite() => "a number > 0";
        /// Optimizer (`train.use_8bit_adam: true` → AdamW8bit; kohya `optimizer_type`).
        optimizer: OptimizerName = OptimizerName::default(), parse(|k, v| match v {
            Value::String(s) => OptimizerName::parse(s).map_err(|e| invalid(k, v, engine_name_error(e))),
            _ => Err(invalid(k, v, "an optimizer name such as \"AdamW8bit\"")),
        }),
            aka ["optimizer_type"];
        /// Decoupled weight decay (default 0).
        weight_decay: f64 = 0.0, Typed("a number >= 0"),
            check |w| *w >= 0.0 => "a number >= 0";
        /// SGD momentum μ. Unset: 0 for `SGD` (`torch.optim.SGD`'s and kohya's default) and 0.9
        /// for `SGDNesterov` (kohya's), as the engine's optimizer names give them
        /// ([`OptimizerName::default_momentum`]).
        momentum: Option<f64> = None, Typed("a number in [0, 1)");
        /// LoRA+ ratio `lr_B / lr_A` (arXiv:2402.12354); `None` = plain LoRA.
        loraplus_lr_ratio: Option<f64> = None, Typed("a number > 0"),
            aka ["loraplus_lr_ratio"];
        /// Schedule (kohya `lr_scheduler`): a name (`constant`, the default; `cosine`,
        /// `cosine_with_restarts`, `polynomial`, …) or the engine's mapping with its arguments
        /// (`{type: cosine_with_restarts, num_cycles: 2.0}`). kohya's
        /// `lr_scheduler_num_cycles` (`train.num_cycles`) sets the restarts of
        /// `cosine_with_restarts` and `lr_scheduler_power` (`train.power`) the power of
        /// `polynomial`; as in kohya, they do nothing for other schedules.
        #[serde(with = "keys::by_name")]
        lr_scheduler: SchedulerKind = SchedulerKind::default(),
            Schedule {
                num_cycles: &["train.num_cycles", "lr_scheduler_num_cycles"],
                power: &["train.power", "lr_scheduler_power"],
            },
            aka ["lr_scheduler"];
        /// Warmup steps (kohya `lr_warmup_steps`).
        warmup_steps: u64 = 0, Typed("a non-negative integer");
        /// Warmup as a fraction of the optimizer steps (transformers' `warmup_ratio`; kohya
        /// `lr_warmup_steps` below 1, e.g. `0.1`); wins over `warmup_steps` when set.
        #[serde(skip_serializing_if = "Option::is_none")]
        warmup_ratio: Option<f64> = None, Typed("a fraction in [0, 1)"),
            check |r| r.is_none_or(|r| (0.0..1.0).contains(&r)) => "a fraction in [0, 1)";
        /// Diffusion: learning rate of the UNet's adapter (kohya `unet_lr`; default
        /// `learning_rate`).
        #[serde(skip_serializing_if = "Option::is_none")]
        unet_lr: Option<f64> = None, Typed("a number > 0"), aka ["unet_lr"],
            check |x| x.is_none_or(|x| x >= 0.0 && x.is_finite()) => "a number >= 0";
        /// Diffusion: learning rate of the text encoders' adapters (kohya `text_encoder_lr`;
        /// one number, or one per text encoder for SDXL; default `learning_rate`). A value
        /// above 0 in a kohya config trains the text encoders too, as kohya does unless
        /// `network_train_unet_only` is set.
        #[serde(skip_serializing_if = "Vec::is_empty")]
        text_encoder_lr: Vec<f64> = Vec::new(), parse(numbers), aka ["text_encoder_lr"];
        /// Optimizer arguments on top of the name's defaults (kohya `optimizer_args`: a list
        /// of `name=value`, or a mapping): `betas`, `eps`, `weight_decay`, `momentum`,
        /// `scale_parameter`, `relative_step`, … — the names of the optimizer's own
        /// settings; another name is an error listing them.
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        optimizer_args: BTreeMap<String, Value> = BTreeMap::new(), Listed,
            aka ["optimizer_args"];
        /// Schedule arguments on top of `lr_scheduler` (kohya `lr_scheduler_args`: a list of
        /// `name=value`, or a mapping), e.g. `num_cycles=2`, `power=2`.
        #[serde(skip_serializing_if = "BTreeMap::is_empty")]
        lr_scheduler_args: BTreeMap<String, Value> = BTreeMap::new(),
            Listed, aka ["lr_scheduler_args"];
        /// dtype of the adapter files written at each save and at the end (kohya
        /// `save_precision`: `float`, `fp16`, `bf16`; default: the training dtype, fp32).
        #[serde(skip_serializing_if = "Option::is_none")]
        save_precision: Option<SavePrecision> = None, some(|k, v| keys::choose(k, v, SAVE_PRECISIONS)),
            aka ["save_precision"];
        /// Adapter files kept from the saves (see `save_every_n_steps`): those of the step
        /// saves taken within the last N steps (kohya `save_last_n_steps`; unset = all; the
        /// final adapter is always kept).
        #[serde(skip_serializing_if = "Option::is_none")]
        save_last_n_steps: Option<u64> = None, Typed("a positive integer"),
            aka ["save_last_n_steps"];
        /// Adapter files kept from the epoch saves: the last N (kohya `save_last_n_epochs`).
        #[serde(skip_serializing_if = "Option::is_none")]
        save_last_n_epochs: Option<u32> = None, Typed("a positive integer"),
            aka ["save_last_n_epochs"];
        /// Diffusion: smallest timestep trained on (kohya `min_timestep`; default 0).
        #[serde(skip_serializing_if = "Option::is_none")]
        min_timestep: Option<u32> = None, Typed("a timestep >= 0"), aka ["min_timestep"];
        /// Diffusion: one past the largest timestep trained on (kohya `max_timestep`; default
        /// the schedule's 1000).
        #[serde(skip_serializing_if = "Option::is_none")]
        max_timestep: Option<u32> = None, Typed("a timestep >= 1"), aka ["max_timestep"],
            check |t| t.is_none_or(|t| t >= 1) => "a timestep >= 1";
        /// Diffusion: multi-resolution (pyramid) noise iterations (kohya
        /// `multires_noise_iterations`; typical 6–10; unset = off).
        #[serde(skip_serializing_if = "Option::is_none")]
        multires_noise_iterations: Option<u32> = None, Typed("a positive integer"),
            aka ["multires_noise_iterations"];
        /// Diffusion: weight of each coarser level of the pyramid noise (kohya
        /// `multires_noise_discount`, default 0.3).
        multires_noise_discount: f64 = 0.3, Typed("a number in (0, 1]"),
            aka ["multires_noise_discount"],
            check |d| *d > 0.0 && *d <= 1.0 => "a number in (0, 1]";
        /// Mixed precision (`no`, `bf16`, `fp16`, `full_bf16`; `use_fp16: true` → fp16).
        mixed_precision: Precision = Precision::default(), ByName, aka ["mixed_precision"];
        /// Recompute each block in the backward pass.
        gradient_checkpointing: bool = false, Typed(BOOLEAN),
            aka ["gradient_checkpointing"];
        /// Gradient clipping by global norm (default 1.0, as transformers and kohya; 0 = off).
        max_grad_norm: f64 = 1.0, Typed("a number >= 0 (0 = no clipping)"),
            aka ["max_grad_norm"],
            check |m| *m >= 0.0 && m.is_finite() => "a number >= 0 (0 = no clipping)";
        /// Non-finite loss policy: `skip` (default), `lower_lr` (halve the learning rate) or
        /// `stop`; or the engine's mapping (`{policy: lower_lr, factor: 0.25}`).
        #[serde(with = "keys::by_name")]
        nan_policy: NonFinitePolicy = NonFinitePolicy::default(), ByName;
        /// Save every N optimizer steps: a resume checkpoint under `checkpoints/` and a
        /// loadable adapter `<output_name>-step%08d` in each export format (aliases top-level
        /// `save_steps`, kohya `save_every_n_steps`).
        save_every_n_steps: Option<u64> = None, Typed("a positive integer"),
            aka ["save_steps", "save_every_n_steps", "train.save_steps"];
        /// Save every N epochs: a resume checkpoint and an adapter `<output_name>-%06d`
        /// (the epoch; kohya `save_every_n_epochs`).
        save_every_n_epochs: Option<u32> = None, Typed("a positive integer"),
            aka ["save_every_n_epochs"];
        /// Checkpoints kept (default 3; kohya `save_last_n_steps_state` is not the same thing).
        keep_last_checkpoints: u32 = 3, Typed("a positive integer");
        /// Evaluate held-out loss every N steps (0 = only before/after).
        eval_every_n_steps: u64 = 0, Typed("a non-negative integer");
        /// Output folder (kohya `output_dir`; default `output`).
        output_dir: String = "output".into(), Typed("a folder"), aka ["output_dir"];
        /// Adapter name in the output (kohya `output_name`; default `adapter`).
        output_name: String = "adapter".into(), Typed("a file name without extension"),
            aka ["output_name"];
        /// Export formats (default `[peft]`).
        export_formats: Vec<ExportFormat> = vec![ExportFormat::Peft], parse(export_formats);
        /// Diffusion: kohya `noise_offset` (0 = off; Guttenberg 2023, typical 0.0357–0.1).
        noise_offset: f64 = 0.0, Typed("a number >= 0"), aka ["noise_offset"],
            check |x| *x >= 0.0 && x.is_finite() => "a number >= 0";
        /// Diffusion: min-SNR-γ loss weighting (kohya `min_snr_gamma`; Hang et al. 2023
        /// recommend 5).
        min_snr_gamma: Option<f64> = None, Typed("a number > 0"), aka ["min_snr_gamma"],
            check |g| g.is_none_or(|g| g > 0.0 && g.is_finite())
                => "a number > 0 (5 is the paper's choice)";
        /// Diffusion: `epsilon` or `v_prediction`; default: the model's scheduler config.
        prediction_type: Option<String> = None, some(|k, v| match v.as_str() {
            Some(s @ ("epsilon" | "v_prediction")) => Ok(s.to_string()),
            _ => Err(invalid(k, v, "\"epsilon\" or \"v_prediction\"")),
        });
        /// Diffusion: text-encoder layer used for conditioning (kohya / A1111 `clip_skip`;
        /// 1 = last).
        clip_skip: Option<u32> = None, Typed("a positive integer"), aka ["clip_skip"],
            check |n| n.is_none_or(|n| n >= 1) => "an integer >= 1 (1 = last layer)";
        /// Diffusion: LoRA on the text encoder too (its `q_proj`, `k_proj`, `v_proj`,
        /// `out_proj`); default false = UNet only (kohya `network_train_unet_only: true`),
        /// text-encoder outputs cached.
        train_text_encoder: bool = false, Typed(BOOLEAN);
    }
}

section! {
    /// `[memory]`: the budget and what to do when the plan does not fit it.
    pub struct MemorySection at "memory" {
        /// Budget as a size (`"6GB"`; alias `memory.max_memory`).
        budget: Option<Size> = None, some(size_of), aka ["memory.max_memory"];
        /// Budget as a GPU name (`"RTX 3060"`), from lora-memory's preset table, or `local` /
        /// `local:N` for this machine's card as it is now (its free memory from the driver).
        gpu: Option<String> = None, Typed("a GPU name such as \"RTX 3060\"");
        /// Apply lora-memory's `fit()` to the settings before starting.
        auto_fit: bool = false, Typed(BOOLEAN);
        /// Start even when predicted not to fit.
        force: bool = false, Typed(BOOLEAN);
        /// CPU runs: fix glibc's mmap threshold at 128 KiB so freed tensors leave the process
        /// and the resident memory follows the plan
        /// (`lora_core::sys::set_malloc_mmap_threshold`; default true). `false` keeps glibc's
        /// dynamic threshold, under which RSS measured ~40% above the live tensors on the
        /// README demo. Ignored when `MALLOC_MMAP_THRESHOLD_` is set.
        cpu_return_freed: bool = true, Typed(BOOLEAN);
        /// CPU runs: keep freed tensor blocks of 128 KiB or more for the next steps instead of
        /// handing them back (`TrainerConfig::cpu_cache`; default true). Bounded by the step's
        /// live peak, so RSS still follows the plan; `false` maps and faults every large block
        /// in afresh each step (measured: the benchmark step 40% slower).
        cpu_cache: bool = true, Typed(BOOLEAN);
    }
}

section! {
    /// `[logging]`.
    pub struct LoggingSection at "logging" {
        /// Log every N optimizer steps (default 1).
        log_every_n_steps: u64 = 1, Typed("a positive integer");
        /// Folder for JSONL metrics / TensorBoard events (kohya `logging_dir`; default
        /// `<output_dir>/logs`).
        logging_dir: Option<String> = None, Typed("a folder"), aka ["logging_dir"];
        /// Show a progress bar (default true).
        progress: bool = true, Typed(BOOLEAN);
        /// Write TensorBoard event files (also on whenever kohya's `logging_dir` or `log_with`
        /// is written).
        tensorboard: bool = false, Typed(BOOLEAN);
        /// kohya `log_with`: `tensorboard` (the only tracker here), `wandb` or `all` (both
        /// write TensorBoard files, with a warning that W&B is not available).
        #[serde(skip_serializing_if = "Option::is_none")]
        log_with: Option<String> = None, some(|k, v| {
            match v.as_str().map(|s| s.trim().to_ascii_lowercase()).as_deref() {
                Some(s @ ("tensorboard" | "wandb" | "all")) => Ok(s.to_string()),
                _ => Err(invalid(k, v, "\"tensorboard\", \"wandb\" or \"all\"")),
            }
        }), aka ["log_with"];
        /// kohya `log_prefix`: put before the run's folder name under `logging_dir`.
        #[serde(skip_serializing_if = "Option::is_none")]
        log_prefix: Option<String> = None, Typed("a string"), aka ["log_prefix"];
        /// Diffusion: a kohya prompt file (kohya `sample_prompts`): one prompt per line with
        /// `--n` negative prompt, `--w`/`--h` size, `--d` seed, `--l` guidance scale, `--s`
        /// steps; `#` lines are comments.
        #[serde(skip_serializing_if = "Option::is_none")]
        sample_prompts_file: Option<String> = None, Typed("a path to a prompt file"),
            aka ["sample_prompts"];
        /// Prompt sampled before and after training.
        sample_prompt: Option<String> = None, Typed("a string");
        /// Tokens generated for the sample.
        sample_max_new_tokens: u32 = 32, Typed("a positive integer");
        /// Diffusion: write a sample grid every N optimizer steps (kohya
        /// `sample_every_n_steps`; 0 = only at the end).
        sample_every_n_steps: u64 = 0, Typed("a non-negative integer"),
            aka ["sample_every_n_steps"];
        /// Diffusion: prompts of the sample grid (one image each).
        sample_prompts: Vec<String> = Vec::new(), Typed("a list of prompts");
        /// Diffusion: `ddim` (default) or `euler` (kohya `sample_sampler`).
        sample_sampler: String = "ddim".into(), parse(|k, v| {
            match v.as_str().map(str::to_ascii_lowercase).as_deref() {
                Some("ddim") => Ok("ddim".to_string()),
                Some("euler") => Ok("euler".to_string()),
                _ => Err(invalid(k, v, "\"ddim\" or \"euler\"")),
            }
        }), aka ["sample_sampler"];
        /// Diffusion: sampler steps (default 20).
        sample_steps: u32 = 20, Typed("a positive integer"),
            check |n| *n >= 1 => "an integer >= 1";
        /// Diffusion: classifier-free guidance scale (default 7.5).
        sample_guidance_scale: f64 = 7.5, Typed("a number >= 1 (1 = no guidance)");
    }
}

section! {
    /// `[system]`.
    pub struct SystemSection at "system" {
        /// Seed (default 42; kohya `seed`).
        seed: u64 = 42, Typed("a non-negative integer"), aka ["seed"];
        /// `"cpu"`, `"cuda"`, `"cuda:N"` or `"auto"` (default).
        device: String = "auto".into(), parse(|k, v| {
            let s = v.as_str().unwrap_or_default();
            let ok = matches!(s, "cpu" | "cuda" | "auto")
                || s.strip_prefix("cuda:")
                    .map(|n| n.parse::<u32>().is_ok())
                    .unwrap_or(false);
            if ok {
                Ok(s.to_string())
            } else {
                Err(invalid(k, v, "one of \"auto\", \"cpu\", \"cuda\", \"cuda:N\""))
            }
        });
        /// Intra-op threads (default: libtorch's choice).
        num_threads: Option<u32> = None, Typed("a positive integer"),
            check |n| n.is_none_or(|n| n >= 1) => "an integer >= 1 (leave it out for libtorch's choice)";
    }
}

section! {
    /// `[flux]`: FLUX.1 components and training options, with the names of kohya sd-scripts'
    /// `flux_train_network.py` accepted as written.
    pub struct FluxSection at "flux" {
        /// The T5-XXL encoder file (ComfyUI's `t5xxl_fp16.safetensors` or
        /// `t5xxl_fp8_e4m3fn.safetensors`, transformers keys) or a transformers folder; default:
        /// the base's diffusers folder (`text_encoder_2/`).
        #[serde(skip_serializing_if = "Option::is_none")]
        t5xxl: Option<String> = None, Typed("a path to the T5-XXL encoder"), aka ["t5xxl"];
        /// The CLIP-L text encoder file (`clip_l.safetensors`) or folder; default: the base's
        /// diffusers folder (`text_encoder/`).
        #[serde(skip_serializing_if = "Option::is_none")]
        clip_l: Option<String> = None, Typed("a path to the CLIP-L text encoder"), aka ["clip_l"];
        /// The autoencoder file (BFL's `ae.safetensors`) or folder; default: the base's
        /// diffusers folder (`vae/`).
        #[serde(skip_serializing_if = "Option::is_none")]
        ae: Option<String> = None, Typed("a path to the FLUX autoencoder"), aka ["ae"];
        /// Store the frozen transformer in float8 (e4m3fn), upcast per layer (kohya
        /// `fp8_base`, `fp8_base_unet`).
        fp8_base: bool = false, Typed(BOOLEAN), aka ["fp8_base", "fp8_base_unet"];
        /// Transformer blocks kept in host memory and copied in for their forward and backward
        /// passes, counted as kohya does (`n / 2` double-stream, `2·(n − n / 2)` single-stream
        /// blocks; at most 35 for FLUX.1).
        blocks_to_swap: u32 = 0, Typed("a non-negative integer"), aka ["blocks_to_swap"];
        /// T5 tokens per caption (kohya `t5xxl_max_token_length`; default 512 for dev, 256 for
        /// schnell).
        #[serde(skip_serializing_if = "Option::is_none")]
        t5xxl_max_token_length: Option<u32> = None, Typed("a positive integer"),
            aka ["t5xxl_max_token_length"],
            check |n| n.is_none_or(|n| (1..=512).contains(&n)) => "an integer from 1 to 512";
        /// Mask T5's padding tokens in the joint attention (kohya `apply_t5_attn_mask`).
        apply_t5_attn_mask: bool = false, Typed(BOOLEAN), aka ["apply_t5_attn_mask"];
        /// How timesteps are drawn (kohya `timestep_sampling`).
        timestep_sampling: TimestepSampling = TimestepSampling::Sigma, Choice(TIMESTEP_SAMPLINGS),
            aka ["timestep_sampling"];
        /// Scale of the normal draw of `sigmoid`, `shift` and `flux_shift` (kohya
        /// `sigmoid_scale`, default 1).
        sigmoid_scale: f64 = 1.0, Typed("a positive number"), aka ["sigmoid_scale"],
            check |x| *x > 0.0 && x.is_finite() => "a number > 0";
        /// The time shift of `shift` sampling (kohya `discrete_flow_shift`, default 3.0).
        discrete_flow_shift: f64 = 3.0, Typed("a positive number"), aka ["discrete_flow_shift"],
            check |x| *x > 0.0 && x.is_finite() => "a number > 0";
        /// Mean of the logit-normal draw (SD3 `logit_mean`).
        logit_mean: f64 = 0.0, Typed("a number"), aka ["logit_mean"];
        /// Standard deviation of the logit-normal draw (SD3 `logit_std`).
        logit_std: f64 = 1.0, Typed("a positive number"), aka ["logit_std"],
            check |x| *x > 0.0 && x.is_finite() => "a number > 0";
        /// The guidance value fed to FLUX.1-dev's guidance embedder in training (kohya
        /// `guidance_scale`, default 1.0; schnell has none).
        guidance_scale: f64 = 1.0, Typed("a number"), aka ["guidance_scale"];
        /// Which blocks get LoRA (kohya `network_args = ["train_blocks=single"]`): `all`
        /// (default), `single` (the single-stream blocks only) or `double`.
        train_blocks: FluxTrainBlocks = FluxTrainBlocks::All, Choice(FLUX_TRAIN_BLOCKS),
            aka ["train_blocks"];
        /// The double-stream blocks that get LoRA (kohya `train_double_block_indices`): `all`,
        /// `none`, or indices and ranges such as `"0,1,8-12"`.
        #[serde(skip_serializing_if = "Option::is_none")]
        train_double_block_indices: Option<String> = None, Typed("\"all\", \"none\" or indices such as \"0,1,8-12\""),
            aka ["train_double_block_indices"],
            check |v| v.as_deref().is_none_or(|s| parse_block_indices(s, u32::MAX).is_ok()) => "\"all\", \"none\" or comma-separated indices and ranges such as \"0,1,8-12\"";
        /// The single-stream blocks that get LoRA (kohya `train_single_block_indices`), as
        /// `train_double_block_indices`.
        #[serde(skip_serializing_if = "Option::is_none")]
        train_single_block_indices: Option<String> = None, Typed("\"all\", \"none\" or indices such as \"0,1,8-12\""),
            aka ["train_single_block_indices"],
            check |v| v.as_deref().is_none_or(|s| parse_block_indices(s, u32::MAX).is_ok()) => "\"all\", \"none\" or comma-separated indices and ranges such as \"0,1,8-12\"";
        /// How the transformer's output becomes the prediction (kohya
        /// `model_prediction_type`; default `raw`, which kohya's FLUX guide recommends —
        /// sd-scripts' own default is `sigma_scaled`).
        model_prediction_type: ModelPredictionType = ModelPredictionType::Raw,
            Choice(MODEL_PREDICTION_TYPES), aka ["model_prediction_type"];
    }
}

section! {
    /// `[data_loader]` (names of PyTorch's `DataLoader`).
    pub struct DataLoaderSection at "data_loader" {
        /// Worker threads (kohya `max_data_loader_n_workers`; default 0 = in the training
        /// thread).
        num_workers: u32 = 0, Typed("a non-negative integer"),
            aka ["max_data_loader_n_workers"];
        /// Keep workers across epochs.
        persistent_workers: bool = false, Typed(BOOLEAN),
            aka ["persistent_data_loader_workers"];
        /// Batches prefetched per worker (default 2, PyTorch's).
        prefetch_factor: u32 = 2, Typed("a positive integer");
        /// Shuffle each epoch (default true).
        shuffle: bool = true, Typed(BOOLEAN);
    }
}

section! {
    /// `tagger.model_settings` of the LLM tagging guides.
    pub struct TaggerModelSettings at "tagger.model_settings" {
        /// `"fp16"`, `"bf16"`, `"fp32"`, `"int8"`, `"int4"`.
        precision: Option<String> = None, Typed("a string such as \"fp16\"");
        /// `"cuda"`, `"cpu"`, `"auto"`.
        device: Option<String> = None, Typed("a string such as \"cuda\"");
        /// accelerate `device_map`.
        device_map: Option<String> = None, Typed("a string such as \"auto\"");
        /// accelerate `low_cpu_mem_usage`.
        low_cpu_mem_usage: Option<bool> = None, Typed(BOOLEAN);
        /// accelerate `max_memory`.
        max_memory: TaggerMaxMemory = TaggerMaxMemory::default(), Sub;
    }
}

section! {
    /// `tagger.model_settings.max_memory`.
    pub struct TaggerMaxMemory at "tagger.model_settings.max_memory" {
        /// GPU budget.
        cuda: Option<Size> = None, some(size_of);
        /// CPU budget.
        cpu: Option<Size> = None, some(size_of);
    }
}

section! {
    /// `tagger.generation_settings`.
    pub struct TaggerGenerationSettings at "tagger.generation_settings" {
        /// Largest batch.
        max_batch_size: Option<u32> = None, Typed("a positive integer");
        /// Seconds per request.
        timeout: Option<f64> = None, Typed("seconds");
        /// Retries.
        retry_attempts: Option<u32> = None, Typed("a non-negative integer");
    }
}

section! {
    /// `tagger.memory_management`.
    pub struct TaggerMemoryManagement at "tagger.memory_management" {
        /// Clear caches every N items.
        auto_clear_interval: Option<u32> = None, Typed("a positive integer");
        /// Cache entries.
        cache_size: Option<u32> = None, Typed("a non-negative integer");
    }
}

section! {
    /// `[tagger]`: recognised and validated here, used by lora-tagger.
    pub struct TaggerSection at "tagger" {
        /// `model_settings`.
        model_settings: TaggerModelSettings = TaggerModelSettings::default(), Sub;
        /// `generation_settings`.
        generation_settings: TaggerGenerationSettings = TaggerGenerationSettings::default(), Sub;
        /// `memory_management`.
        memory_management: TaggerMemoryManagement = TaggerMemoryManagement::default(), Sub;
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
    ("flux", ModelKind::Flux),
    ("flux1", ModelKind::Flux),
];

/// `flux.timestep_sampling` names (kohya sd-scripts' `--timestep_sampling`, plus SD3's
/// logit-normal).
const TIMESTEP_SAMPLINGS: &[(&str, TimestepSampling)] = &[
    ("sigma", TimestepSampling::Sigma),
    ("uniform", TimestepSampling::Uniform),
    ("sigmoid", TimestepSampling::Sigmoid),
    ("shift", TimestepSampling::Shift),
    ("flux_shift", TimestepSampling::FluxShift),
    ("logit_normal", TimestepSampling::LogitNormal),
];

/// How FLUX training draws its timesteps (kohya sd-scripts `library/flux_train_utils.py`,
/// `get_noisy_model_input_and_timesteps`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TimestepSampling {
    /// The DDPM-style sigma schedule of the scheduler (kohya's default `sigma`).
    #[default]
    Sigma,
    /// `t ~ U(0, 1)`.
    Uniform,
    /// `t = sigmoid(sigmoid_scale · n)`, `n ~ N(0, 1)`.
    Sigmoid,
    /// [`Self::Sigmoid`] followed by the time shift `s·t / (1 + (s − 1)·t)` with
    /// `s = discrete_flow_shift`.
    Shift,
    /// [`Self::Sigmoid`] shifted by `exp(μ)`, `μ` from the image's token count (FLUX.1's own
    /// resolution-dependent shift, 0.5 at 256 tokens to 1.15 at 4096).
    FluxShift,
    /// `t = sigmoid(n)`, `n ~ N(logit_mean, logit_std)` (SD3's logit-normal).
    LogitNormal,
}

/// `flux.train_blocks` names (kohya sd-scripts' `networks/lora_flux.py`).
const FLUX_TRAIN_BLOCKS: &[(&str, FluxTrainBlocks)] = &[
    ("all", FluxTrainBlocks::All),
    ("single", FluxTrainBlocks::Single),
    ("double", FluxTrainBlocks::Double),
];

/// Which FLUX blocks get LoRA (kohya's `train_blocks` network argument).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum FluxTrainBlocks {
    /// Double- and single-stream blocks.
    #[default]
    All,
    /// The single-stream blocks only.
    Single,
    /// The double-stream blocks only.
    Double,
}

/// The block indices a kohya `train_double_block_indices` / `train_single_block_indices`
/// value names (`all`, `none`, or comma-separated indices and inclusive ranges `a-b`), sorted
/// and without repeats; `None` for `all`. `n_blocks` bounds the indices (`u32::MAX` checks the
/// syntax only).
///
/// # Errors
/// A message saying what is wrong with `text`.
pub fn parse_block_indices(
    text: &str,
    n_blocks: u32,
) -> std::result::Result<Option<Vec<u32>>, String> {
    let t = text.trim().to_ascii_lowercase();
    match t.as_str() {
        "all" => return Ok(None),
        "none" | "" => return Ok(Some(Vec::new())),
        _ => {}
    }
    let mut out = Vec::new();
    for part in t.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |x: &str| {
            x.trim()
                .parse::<u32>()
                .map_err(|_| format!("{x:?} in {text:?} is not a block index"))
        };
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => {
                let a = num(part)?;
                (a, a)
            }
        };
        if a > b {
            return Err(format!("the range {part:?} in {text:?} runs backwards"));
        }
        if b >= n_blocks {
            return Err(format!(
                "block {b} in {text:?} does not exist: this model has {n_blocks} (0 to {})",
                n_blocks.saturating_sub(1)
            ));
        }
        out.extend(a..=b);
    }
    out.sort_unstable();
    out.dedup();
    Ok(Some(out))
}

/// `flux.model_prediction_type` names (kohya sd-scripts).
const MODEL_PREDICTION_TYPES: &[(&str, ModelPredictionType)] = &[
    ("raw", ModelPredictionType::Raw),
    ("additive", ModelPredictionType::Additive),
    ("sigma_scaled", ModelPredictionType::SigmaScaled),
];

/// How the FLUX transformer's output becomes the prediction compared with the target (kohya
/// sd-scripts' `--model_prediction_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum ModelPredictionType {
    /// The output as is (the velocity `noise − latents`): the default here, kohya's
    /// recommendation (`docs/flux_train_network.md`).
    #[default]
    Raw,
    /// The output added to the noisy input.
    Additive,
    /// sd-scripts' argparse default: the output becomes `output · (−σ) + noisy input` (an
    /// estimate of the clean latents), compared with the same target as [`Self::Raw`]
    /// (`flux_train_utils.apply_model_prediction_type`, as written there).
    SigmaScaled,
}

/// `train.save_precision` names (kohya's `float` is fp32).
const SAVE_PRECISIONS: &[(&str, SavePrecision)] = &[
    ("float", SavePrecision::F32),
    ("fp32", SavePrecision::F32),
    ("fp16", SavePrecision::F16),
    ("bf16", SavePrecision::Bf16),
];

const EXPORTS: &[(&str, ExportFormat)] =
    &[("peft", ExportFormat::Peft), ("kohya", ExportFormat::Kohya)];

/// Spellings that carry a transformed value (read in [`TrainConfig::from_value`], not by a
/// section).
const SPECIAL_KEYS: &[&str] = &[
    "use_fp16",
    "train.use_fp16",
    "train.use_8bit_adam",
    "use_8bit_adam",
    "full_bf16",
];

/// Tagger sections that belong under `tagger:`.
const TAGGER_SECTIONS: &[&str] = &["model_settings", "generation_settings", "memory_management"];

fn engine_name_error(e: crate::engine::TrainError) -> String {
    match e {
        crate::engine::TrainError::Invalid { hint, .. } => hint
            .strip_prefix("use ")
            .map(str::to_string)
            .unwrap_or(hint),
        other => other.to_string(),
    }
}

impl Named for SchedulerKind {
    fn name(&self) -> &'static str {
        SchedulerKind::name(self)
    }
    fn from_name(name: &str) -> std::result::Result<Self, String> {
        SchedulerKind::from_name(name).map_err(engine_name_error)
    }
    fn check(&self) -> std::result::Result<(), String> {
        self.validate().map_err(|e| e.to_string())
    }
}

impl Named for Precision {
    fn name(&self) -> &'static str {
        Precision::name(*self)
    }
    fn from_name(name: &str) -> std::result::Result<Self, String> {
        Precision::from_name(name).map_err(engine_name_error)
    }
}

impl Named for NonFinitePolicy {
    fn name(&self) -> &'static str {
        NonFinitePolicy::name(self)
    }
    fn from_name(name: &str) -> std::result::Result<Self, String> {
        NonFinitePolicy::from_name(name).map_err(engine_name_error)
    }
    fn check(&self) -> std::result::Result<(), String> {
        self.validate().map_err(|e| e.to_string())
    }
}

/// Reads `train.lr_scheduler` (a name or the engine's mapping) and then kohya's flat scheduler
/// arguments: `num_cycles` sets the restarts of `cosine_with_restarts`, `power` the power of
/// `polynomial` (kohya's `get_scheduler_fix` passes each to that schedule only).
struct Schedule {
    num_cycles: Spellings,
    power: Spellings,
}

/// A schedule mapping's argument and a flat spelling of it (`written`) that disagree.
fn argument_conflict(
    key: &str,
    arg: &str,
    in_mapping: f64,
    written: &str,
    given: f64,
) -> ConfigError {
    ConfigError::Conflict {
        canonical: format!("the {arg} of {key}"),
        first_key: format!("{key}.{arg}"),
        first_value: in_mapping.to_string(),
        second_key: written.to_string(),
        second_value: given.to_string(),
    }
}

impl Reader<SchedulerKind> for Schedule {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut SchedulerKind) -> Result<()> {
        ByName.fill(doc, key, slot)?;
        // a mapping that set the argument itself must agree with a flat spelling of it
        let from_mapping = !slot.is_plain();
        let cycles = doc.get_written(self.num_cycles, |k, v| {
            let n: u32 = typed(k, v, "a positive integer")?;
            if n == 0 {
                return Err(invalid(k, v, "an integer >= 1"));
            }
            Ok(f64::from(n))
        })?;
        let power = doc.get_written(self.power, |k, v| {
            let p: f64 = typed(k, v, "a number > 0")?;
            if !(p > 0.0 && p.is_finite()) {
                return Err(invalid(k, v, "a number > 0"));
            }
            Ok(p)
        })?;
        let (name, arg, flat) = match &mut *slot {
            SchedulerKind::CosineWithRestarts { num_cycles } => ("num_cycles", num_cycles, cycles),
            SchedulerKind::Polynomial { power: p, .. } => ("power", p, power),
            _ => return Ok(()),
        };
        if let Some((given, written)) = flat {
            if from_mapping && *arg != given {
                return Err(argument_conflict(key[0], name, *arg, &written, given));
            }
            *arg = given;
        }
        Ok(())
    }

    fn keys(&self, key: Spellings, out: &mut Vec<KeySpec>) {
        <ByName as Reader<SchedulerKind>>::keys(&ByName, key, out);
        for spellings in [self.num_cycles, self.power] {
            out.push(KeySpec {
                spellings,
                mapping: false,
                field: false,
            });
        }
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

/// One number or a list of numbers (kohya `nargs="*"` float arguments such as
/// `text_encoder_lr`).
fn numbers(k: &str, v: &Value) -> Result<Vec<f64>> {
    let one = |x: &Value| -> Result<f64> {
        let n: f64 = typed(k, x, "a number >= 0")?;
        if n >= 0.0 && n.is_finite() {
            Ok(n)
        } else {
            Err(invalid(k, v, "numbers >= 0"))
        }
    };
    match v {
        Value::Array(a) => a.iter().map(one).collect(),
        Value::String(s) if s.contains([',', ' ']) => s
            .split([',', ' '])
            .filter(|p| !p.trim().is_empty())
            .map(|p| one(&Value::String(p.trim().to_string())))
            .collect(),
        _ => Ok(vec![one(v)?]),
    }
}

fn export_formats(k: &str, v: &Value) -> Result<Vec<ExportFormat>> {
    let items: Vec<Value> = match v {
        Value::Array(a) => a.clone(),
        Value::String(_) => vec![v.clone()],
        _ => return Err(invalid(k, v, "a list of \"peft\" and/or \"kohya\"")),
    };
    let mut out: Vec<ExportFormat> = items
        .iter()
        .map(|x| keys::choose(k, x, EXPORTS))
        .collect::<Result<_>>()?;
    out.sort();
    out.dedup();
    if out.is_empty() {
        return Err(invalid(k, v, "at least one of \"peft\", \"kohya\""));
    }
    Ok(out)
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
    /// FLUX.1 components and options.
    pub flux: FluxSection,
    /// Tagger settings, when present.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tagger: Option<TaggerSection>,
    /// kohya keys read without effect here, with why (printed with [`TrainConfig::notes`];
    /// not part of the settings: `==` ignores them and they are not serialized).
    #[serde(skip)]
    pub warnings: ConfigWarnings,
}

impl TrainConfig {
    /// The export format a run of this config cannot write, as a config error: kohya files for
    /// DoRA adapters (`lora.use_dora: true`; the kohya `lora_down`/`lora_up` format has no
    /// magnitude vector), which `train` would find only when it first saves. `train` refuses
    /// before loading; `plan` says so in a note.
    pub fn unwritable_export(&self) -> Option<ConfigError> {
        (self.lora.use_dora && self.train.export_formats.contains(&ExportFormat::Kohya)).then(|| {
            ConfigError::InvalidValue {
                key: "train.export_formats".into(),
                value: format!("{:?}", self.train.export_formats).to_lowercase(),
                expected: "peft only with lora.use_dora: true (the kohya format has no DoRA magnitude): drop kohya, or train plain LoRA".into(),
            }
        })
    }

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
            Some("json") => serde_json::from_str(&text).map_err(|e| ConfigError::Syntax {
                path: path.to_path_buf(),
                format: "JSON",
                message: e.to_string(),
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

    /// Reads a JSON document: a kohya_ss GUI config (what its "Save config" writes: fields
    /// such as `LoRA_type`, `epoch`, `max_resolution`, numbers as strings, `""` for unset),
    /// mapped onto kohya's argument names as the GUI maps them; or this SDK's own keys.
    ///
    /// # Errors
    /// As [`TrainConfig::from_file`]; a GUI `LoRA_type` this SDK does not train is
    /// [`ConfigError::InvalidValue`] naming the value.
    pub fn from_json_str(text: &str) -> Result<TrainConfig> {
        let v: Value = serde_json::from_str(text).map_err(|e| ConfigError::Syntax {
            path: PathBuf::from("<string>"),
            format: "JSON",
            message: e.to_string(),
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
        let mut warnings = ConfigWarnings::default();
        let map = match root {
            Value::Object(m) if gui::is_gui_config(m) => gui::to_kohya(m, &mut warnings)?,
            Value::Object(m) => m.clone(),
            Value::Null => Map::new(),
            other => {
                return Err(ConfigError::NotAMapping {
                    found: render(other),
                });
            }
        };
        let keys = TrainConfig::key_specs();
        let mut doc = Doc::new(&map, &keys);
        kohya::rewrite(&mut doc, &mut warnings)?;
        let mut c = TrainConfig::default();
        c.model.read(&mut doc)?;
        c.lora.read(&mut doc)?;
        c.data.read(&mut doc)?;
        c.train.read(&mut doc)?;
        c.memory.read(&mut doc)?;
        c.logging.read(&mut doc)?;
        c.system.read(&mut doc)?;
        c.data_loader.read(&mut doc)?;
        c.flux.read(&mut doc)?;
        if doc.entries.iter().any(|e| e.path.starts_with("tagger.")) {
            let mut tagger = TaggerSection::default();
            tagger.read(&mut doc)?;
            c.tagger = Some(tagger);
        }
        let spellings = |canonical: &str| {
            keys.iter()
                .find(|k| k.canonical() == canonical)
                .map(|k| k.spellings)
                .unwrap_or(&[])
        };

        // special spellings: use_fp16, use_8bit_adam, full_bf16
        let mp_written = doc.has(spellings("train.mixed_precision"));
        for key in ["use_fp16", "train.use_fp16"] {
            if let Some(e) = doc.entries.iter_mut().find(|e| e.path == key) {
                e.used = true;
                let on: bool = typed(key, &e.value, BOOLEAN)?;
                let implied = if on { Precision::Fp16 } else { Precision::Fp32 };
                if mp_written
                    && (on != (c.train.mixed_precision == Precision::Fp16))
                    && (on || c.train.mixed_precision == Precision::Fp16)
                {
                    return Err(ConfigError::Conflict {
                        canonical: "train.mixed_precision".into(),
                        first_key: "train.mixed_precision".into(),
                        first_value: c.train.mixed_precision.name().to_string(),
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
            let on: bool = typed("full_bf16", &e.value, BOOLEAN)?;
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
                        first_value: c.train.mixed_precision.name().to_string(),
                        second_key: "full_bf16".into(),
                        second_value: "true".into(),
                    });
                }
                c.train.mixed_precision = Precision::FullBf16;
            }
        }
        let opt_written = doc.has(spellings("train.optimizer"));
        for key in ["train.use_8bit_adam", "use_8bit_adam"] {
            if let Some(e) = doc.entries.iter_mut().find(|e| e.path == key) {
                e.used = true;
                let on: bool = typed(key, &e.value, BOOLEAN)?;
                if opt_written {
                    // `false` asks for nothing (kohya's store_true flag left off)
                    let is8 = c.train.optimizer == OptimizerName::AdamW8bit;
                    if on && !is8 {
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

        kohya::apply(&mut doc, &mut c, &mut warnings, |doc, canonical| {
            doc.has(spellings(canonical))
        })?;
        c.warnings = warnings;

        // optimizer and schedule arguments name settings the engine has
        if let Err(e) = c.optimizer_and_schedule() {
            let (key, value, expected) = match e {
                crate::engine::TrainError::Invalid { what, value, hint } => (what, value, hint),
                other => (
                    "train.optimizer_args".to_string(),
                    String::new(),
                    other.to_string(),
                ),
            };
            return Err(ConfigError::InvalidValue {
                key: if key.starts_with("lr_scheduler") || key.starts_with("optimizer") {
                    format!("train.{key}")
                } else {
                    key
                },
                value,
                expected,
            });
        }

        // a polynomial schedule ends below the learning rate it starts from
        if let SchedulerKind::Polynomial { lr_end, .. } = c.train.lr_scheduler
            && lr_end > c.train.learning_rate
        {
            return Err(ConfigError::InvalidValue {
                key: "train.lr_scheduler".into(),
                value: format!("lr_end {lr_end}"),
                expected: format!(
                    "an lr_end at or below train.learning_rate ({})",
                    c.train.learning_rate
                ),
            });
        }

        // memory: a budget or a GPU, not both
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
                    let extra: Vec<&str> =
                        SPECIAL_KEYS.iter().chain(kohya::SPECIAL).copied().collect();
                    keys::suggest(&e.path, &keys, &extra)
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

    /// Every documented key with its spellings, in declaration order (sections first to last).
    fn key_specs() -> Vec<KeySpec> {
        let mut out = Vec::new();
        ModelSection::keys(&mut out);
        LoraSection::keys(&mut out);
        DataSection::keys(&mut out);
        TrainSection::keys(&mut out);
        MemorySection::keys(&mut out);
        LoggingSection::keys(&mut out);
        SystemSection::keys(&mut out);
        DataLoaderSection::keys(&mut out);
        FluxSection::keys(&mut out);
        TaggerSection::keys(&mut out);
        out
    }

    /// The optimizer and schedule this config trains with: `train.optimizer` with
    /// `weight_decay`, `momentum` and then `optimizer_args` applied, and `train.lr_scheduler`
    /// with `lr_scheduler_args` applied.
    ///
    /// # Errors
    /// [`crate::engine::TrainError::Invalid`] for an argument the optimizer or schedule does
    /// not take, or a value of the wrong type.
    pub fn optimizer_and_schedule(
        &self,
    ) -> std::result::Result<
        (crate::engine::optim::OptimizerKind, SchedulerKind),
        crate::engine::TrainError,
    > {
        let t = &self.train;
        let base = t.optimizer.with(&crate::engine::optim::OptimizerArgs {
            weight_decay: t.weight_decay,
            momentum: t.momentum,
        });
        let optimizer =
            crate::engine::error::with_named_args(&base, "optimizer_args", &t.optimizer_args)?;
        let scheduler = crate::engine::error::with_named_args(
            &t.lr_scheduler,
            "lr_scheduler_args",
            &t.lr_scheduler_args,
        )?;
        scheduler.validate()?;
        Ok((optimizer, scheduler))
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
                hint: "set it to a .gguf file, a .safetensors file, a folder with config.json, or \
                       a Hugging Face Hub id (owner/name) in the local Hugging Face cache"
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
        out.extend(self.warnings.0.iter().map(ToString::to_string));
        out
    }

    /// The settings that only image-model (SD 1.x / SDXL) runs read, each with its value as
    /// JSON, when set away from its default: LoCon ranks, image augmentation and captions,
    /// buckets, latent caching, per-model learning rates, the diffusion loss's noise and
    /// timestep options, sample-image options. A language-model run lists them as settings
    /// without effect.
    pub fn image_only_settings(&self) -> Vec<(&'static str, String)> {
        let d = TrainConfig::default();
        let mut out = Vec::new();
        macro_rules! differs {
            ($($section:ident . $field:ident),* $(,)?) => {$(
                if self.$section.$field != d.$section.$field {
                    out.push((
                        concat!(stringify!($section), ".", stringify!($field)),
                        serde_json::to_string(&self.$section.$field).unwrap_or_default(),
                    ));
                }
            )*};
        }
        differs!(
            lora.conv_rank,
            lora.conv_alpha,
            data.resolution,
            data.caption_extension,
            data.reg_data_dir,
            data.flip_aug,
            data.random_crop,
            data.caption_dropout_rate,
            data.caption_tag_dropout_rate,
            data.caption_prefix,
            data.caption_suffix,
            data.caption_separator,
            data.keep_tokens,
            data.shuffle_caption,
            data.enable_bucket,
            data.min_bucket_reso,
            data.max_bucket_reso,
            data.bucket_reso_steps,
            data.cache_latents,
            data.bad_images,
            train.unet_lr,
            train.text_encoder_lr,
            train.min_timestep,
            train.max_timestep,
            train.multires_noise_iterations,
            train.multires_noise_discount,
            train.noise_offset,
            train.min_snr_gamma,
            train.prediction_type,
            train.clip_skip,
            train.train_text_encoder,
            logging.sample_prompts,
            logging.sample_prompts_file,
            logging.sample_sampler,
            logging.sample_steps,
            logging.sample_guidance_scale,
        );
        out
    }
}

#[cfg(test)]
mod tests;
