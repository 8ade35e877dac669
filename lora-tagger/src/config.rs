//! `TaggerConfig`: the tagger's settings, read from YAML or TOML.
//!
//! The first three sections carry, as written, the keys of the `config.yaml` that the LLM tagging
//! guides copy around (`model_settings`, `generation_settings`, `memory_management`); the others are
//! this crate's own (`image`, `tags`, `captions`, `llm`). Every section and key is optional and has
//! a documented default. A file whose only top-level key is `tagger:` (the section of a
//! `lora-train` training config) is read as that section.
//!
//! An unknown key is an error naming its path and value, with a "did you mean" hint (the same leaf
//! under another section, or the closest spelling by edit distance); a value of the wrong type or
//! outside its set is an error naming the key, the value and what is allowed. Sizes (`"6GB"`,
//! `"12GiB"`, a plain number of bytes) go through [`lora_memory::parse_size`]; the unit it assumed,
//! if any, is kept in [`Size::assumed`].
//!
//! ```
//! let cfg = lora_tagger::config::TaggerConfig::from_yaml_str(
//!     "generation_settings:\n  max_batch_size: 4\nimage:\n  general_threshold: 0.2\n",
//! )
//! .unwrap();
//! assert_eq!(cfg.generation_settings.max_batch_size, 4);
//! let err = lora_tagger::config::TaggerConfig::from_yaml_str("image:\n  general_treshold: 0.2\n")
//!     .unwrap_err()
//!     .to_string();
//! assert!(err.contains("did you mean `image.general_threshold`"), "{err}");
//! ```

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::caption::CaptionSettings;
use crate::error::{Error, Result};
use crate::tags::PostProcess;

/// Numeric precision of the model's weights and activations (`model_settings.precision`).
///
/// Accepted spellings: `fp32`/`float32`/`no`, `fp16`/`float16`/`half`, `bf16`/`bfloat16`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// 32-bit float (the default).
    #[default]
    #[serde(alias = "float32", alias = "no")]
    Fp32,
    /// IEEE half precision; CUDA only (libtorch's CPU half convolutions are slow or missing).
    #[serde(alias = "float16", alias = "half")]
    Fp16,
    /// bfloat16.
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// The tch kind.
    pub fn kind(self) -> tch::Kind {
        match self {
            Precision::Fp32 => tch::Kind::Float,
            Precision::Fp16 => tch::Kind::Half,
            Precision::Bf16 => tch::Kind::BFloat16,
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }
}

/// A size as written and in bytes (serialized as the text): [`lora_memory::Size`].
pub use lora_memory::Size;

/// `model_settings.max_memory`: caps on the memory the tagger may plan its batches for.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MaxMemory {
    /// Cap on GPU memory (`"6GB"`); the batch planner uses `min(cap, free VRAM)`.
    pub cuda: Option<Size>,
    /// Cap on CPU memory (`"8GB"`); the batch planner uses `min(cap, MemAvailable)`.
    pub cpu: Option<Size>,
}

/// `model_settings` (keys of the LLM tagging guides' `config.yaml`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelSettings {
    /// Weights/activations precision; default `fp32`.
    pub precision: Precision,
    /// `"auto"` (CUDA device 0 when libtorch sees one, else CPU; the default), `"cpu"`, `"cuda"`
    /// or `"cuda:N"`.
    pub device: String,
    /// Accepted for compatibility: `"auto"` or a single device name; the whole model is placed on
    /// one device (`device`), no layer-wise split.
    pub device_map: Option<String>,
    /// Accepted for compatibility; weights are always read through a memory map and converted one
    /// tensor at a time, which is what this flag asks transformers for.
    pub low_cpu_mem_usage: bool,
    /// Memory caps for batch planning.
    pub max_memory: MaxMemory,
}

impl Default for ModelSettings {
    fn default() -> Self {
        ModelSettings {
            precision: Precision::Fp32,
            device: "auto".into(),
            device_map: None,
            low_cpu_mem_usage: true,
            max_memory: MaxMemory::default(),
        }
    }
}

impl ModelSettings {
    /// The device `device` names.
    ///
    /// # Errors
    /// [`Error::Config`] for an unknown device string, or `cuda` when libtorch sees no CUDA device.
    pub fn resolve_device(&self) -> Result<tch::Device> {
        let d = self.device.trim().to_ascii_lowercase();
        let bad = |hint: &str| Error::Config {
            key: "model_settings.device".into(),
            value: format!("{:?}", self.device),
            hint: hint.into(),
        };
        let cuda_count = lora_core::sys::cuda_device_count().unwrap_or(0);
        match d.as_str() {
            "auto" => Ok(if cuda_count > 0 {
                tch::Device::Cuda(0)
            } else {
                tch::Device::Cpu
            }),
            "cpu" => Ok(tch::Device::Cpu),
            _ => {
                let idx = if d == "cuda" || d == "gpu" {
                    0
                } else if let Some(n) = d.strip_prefix("cuda:") {
                    n.parse::<usize>()
                        .map_err(|_| bad("write \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""))?
                } else {
                    return Err(bad("write \"auto\", \"cpu\", \"cuda\" or \"cuda:N\""));
                };
                if let Some(problem) = lora_core::sys::cuda_device_problem(idx) {
                    return Err(bad(&problem));
                }
                Ok(tch::Device::Cuda(idx))
            }
        }
    }
}

/// `generation_settings`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct GenerationSettings {
    /// The largest micro-batch (images or prompts per forward pass); the start is lowered to what
    /// fits the free memory and halved on out-of-memory ([`crate::batch`]). Default 8.
    pub max_batch_size: usize,
    /// Seconds per request (HTTP backend) or per item (in-process generation). Default 60.
    pub timeout: f64,
    /// Attempts after the first for a request that timed out or failed transiently. Default 3.
    pub retry_attempts: u32,
}

impl Default for GenerationSettings {
    fn default() -> Self {
        GenerationSettings {
            max_batch_size: 8,
            timeout: 60.0,
            retry_attempts: 3,
        }
    }
}

/// `memory_management`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryManagement {
    /// Every this many batches, return cached, unused CUDA blocks to the driver
    /// (`torch.cuda.empty_cache`); 0 = never (the default).
    pub auto_clear_interval: usize,
    /// Entries kept in the result cache ([`crate::cache`]); 0 disables it. Default 1000.
    pub cache_size: usize,
    /// Optional JSON file the cache is loaded from and saved to (ours, not in the guides).
    pub cache_file: Option<PathBuf>,
}

impl Default for MemoryManagement {
    fn default() -> Self {
        MemoryManagement {
            auto_clear_interval: 0,
            cache_size: 1000,
            cache_file: None,
        }
    }
}

/// The image backbone (`image.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Architecture {
    /// Read from the weights' tensor names (the default).
    #[default]
    Auto,
    /// torchvision MobileNetV2.
    MobilenetV2,
    /// An ONNX graph (`model.onnx`) run by ONNX Runtime: SmilingWolf's WD14 taggers
    /// ([`crate::image::onnx`]; needs the crate feature `onnx`).
    Onnx,
}

/// The preprocessing preset (`image.preprocess`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreprocessKind {
    /// The backbone's own preset (ImageNet for MobileNetV2; the default).
    #[default]
    Auto,
    /// WD14: pad to square on white, resize, BGR, float 0–255.
    Wd14,
    /// ImageNet: resize the short side, center crop, RGB, /255, mean/std normalised.
    Imagenet,
}

/// The output activation (`image.head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Head {
    /// Sigmoid for multi-label models (WD14), softmax for single-label classifiers, as the
    /// backbone declares (the default).
    #[default]
    Auto,
    /// Independent per-tag probabilities (multi-label heads, WD14).
    Sigmoid,
    /// One distribution over all labels (single-label classifiers, ImageNet).
    Softmax,
    /// The model's outputs are already probabilities, used as they are (WD14 ONNX exports end in
    /// a sigmoid; `auto` picks this for them).
    Probabilities,
}

/// `image`: the image tagger.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageSettings {
    /// Model folder holding `model.safetensors` (or a WD14 `model.onnx`) and `selected_tags.csv`
    /// (default: `$LORA_SDK_ASSETS/mobilenet_v2`, else `assets/mobilenet_v2`).
    pub model: Option<PathBuf>,
    /// The ONNX Runtime shared library (file, or the folder holding it) for `model.onnx` models;
    /// default: `ORT_DYLIB_PATH`, else the `onnxruntime` Python package of the project's venv
    /// ([`crate::image::onnx::find_onnxruntime`]).
    pub onnxruntime: Option<PathBuf>,
    /// Backbone; default `auto`.
    pub architecture: Architecture,
    /// Preprocessing preset; default `auto`.
    pub preprocess: PreprocessKind,
    /// Square input side in pixels; default the backbone's (224 for MobileNetV2, 448 for WD14 v3).
    pub input_size: Option<u32>,
    /// Output activation; default `auto`.
    pub head: Head,
    /// Minimum probability for a general tag (category 0). Default (`None`): by the head,
    /// [`DEFAULT_GENERAL_THRESHOLD_SIGMOID`] (0.35, the WD14 taggers' default) for multi-label
    /// sigmoid heads, [`DEFAULT_GENERAL_THRESHOLD_SOFTMAX`] (0.05) for single-label softmax
    /// classifiers, whose probabilities share one unit of mass over all labels (0.35 would leave
    /// most photos without a tag). [`ImageSettings::general_threshold_for`] resolves it.
    pub general_threshold: Option<f32>,
    /// Minimum probability for a character tag (category 4). Default 0.85 (the WD14 taggers' default).
    pub character_threshold: f32,
    /// Pick the general-tag threshold per image by MCut (the largest gap between sorted
    /// probabilities; [`crate::image::mcut_threshold`]) instead of `general_threshold`, as the
    /// WD14 v3 taggers' reference app offers (`general_mcut_enabled`). Default false.
    pub general_mcut: bool,
    /// The same for character tags, never below 0.15 (the reference's floor;
    /// `character_mcut_enabled`). Default false.
    pub character_mcut: bool,
}

impl Default for ImageSettings {
    fn default() -> Self {
        ImageSettings {
            model: None,
            onnxruntime: None,
            architecture: Architecture::Auto,
            preprocess: PreprocessKind::Auto,
            input_size: None,
            head: Head::Auto,
            general_threshold: None,
            character_threshold: 0.85,
            general_mcut: false,
            character_mcut: false,
        }
    }
}

/// The default `image.general_threshold` of multi-label (sigmoid) heads: the WD14 taggers' 0.35.
pub const DEFAULT_GENERAL_THRESHOLD_SIGMOID: f32 = 0.35;

/// The default `image.general_threshold` of single-label (softmax) classifiers such as the
/// ImageNet MobileNetV2: 0.05 (one probability mass shared by 1000 labels; at 0.35 about half of
/// scikit-image's photos get no tag).
pub const DEFAULT_GENERAL_THRESHOLD_SOFTMAX: f32 = 0.05;

impl ImageSettings {
    /// The general-tag threshold in effect: `general_threshold` when set, else the default for
    /// the head (`sigmoid`: multi-label) — see [`ImageSettings::general_threshold`].
    pub fn general_threshold_for(&self, sigmoid: bool) -> f32 {
        self.general_threshold.unwrap_or(if sigmoid {
            DEFAULT_GENERAL_THRESHOLD_SIGMOID
        } else {
            DEFAULT_GENERAL_THRESHOLD_SOFTMAX
        })
    }

    /// The model folder: `model`, else `$LORA_SDK_ASSETS/mobilenet_v2`, else `assets/mobilenet_v2`.
    pub fn model_dir(&self) -> PathBuf {
        if let Some(m) = &self.model {
            return m.clone();
        }
        let assets = std::env::var_os("LORA_SDK_ASSETS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("assets"));
        assets.join("mobilenet_v2")
    }
}

/// LLM backend kind (`llm.backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LlmBackend {
    /// An in-process model (`llm.model_path`).
    Local,
    /// An OpenAI-compatible server (`llm.base_url`, `llm.model`).
    Http,
}

/// `llm`: the description tagger (implemented in [`crate::llm`]); every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LlmSettings {
    /// `local` or `http`.
    pub backend: Option<LlmBackend>,
    /// In-process model file or folder (GGUF or HF safetensors).
    pub model_path: Option<PathBuf>,
    /// OpenAI-compatible server root, e.g. `http://127.0.0.1:8080/v1`.
    pub base_url: Option<String>,
    /// Model name sent to the server.
    pub model: Option<String>,
    /// Name of the environment variable holding the API key (the key itself never goes in a file).
    pub api_key_env: Option<String>,
    /// Requests in flight at once (HTTP backend).
    pub concurrency: Option<usize>,
    /// Prompt template; `{description}` is replaced by the item's text.
    pub prompt: Option<String>,
}

/// `vlm`: a vision-language model behind an OpenAI-compatible server that captions or tags the
/// images (implemented in [`crate::llm::vlm`]); when `base_url` is set, `lora-train tag --images`
/// uses it instead of the image model. Every field optional.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VlmSettings {
    /// OpenAI-compatible server root, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: Option<String>,
    /// Model name sent to the server (vLLM: `--served-model-name`; Ollama: the tag).
    pub model: Option<String>,
    /// Name of the environment variable holding the API key (default `OPENAI_API_KEY`).
    pub api_key_env: Option<String>,
    /// Requests in flight at once (default 4).
    pub concurrency: Option<usize>,
    /// `tags`, `short` (default) or `detailed`.
    pub preset: Option<VlmPreset>,
    /// An instruction replacing the preset's.
    pub prompt: Option<String>,
    /// `max_tokens` per request (default by preset: 96 / 64 / 300).
    pub max_tokens: Option<usize>,
    /// Longer side images are scaled down to before sending, pixels (default 1024; 0 = send the
    /// files as they are).
    pub max_image_side: Option<u32>,
}

/// The whole tagger configuration. Every section defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TaggerConfig {
    /// Model precision, device and memory caps.
    pub model_settings: ModelSettings,
    /// Batch size, timeouts, retries.
    pub generation_settings: GenerationSettings,
    /// Cache size and CUDA cache clearing.
    pub memory_management: MemoryManagement,
    /// The image tagger.
    pub image: ImageSettings,
    /// Tag post-processing.
    pub tags: PostProcess,
    /// Caption sidecar files.
    pub captions: CaptionSettings,
    /// The description (LLM) tagger.
    pub llm: LlmSettings,
    /// The image captioner (VLM over HTTP).
    pub vlm: VlmSettings,
}

/// The value type a key accepts.
#[derive(Clone, Copy)]
enum Ty {
    Bool,
    /// A non-negative integer.
    UInt,
    /// A positive integer.
    PosInt,
    /// A number in `[lo, hi]`.
    Float(f64, f64),
    Str,
    /// A string from the set.
    Enum(&'static [&'static str]),
    StrList,
    /// `"6GB"` or a number of bytes.
    Size,
    /// A `from=to` list.
    Replacements,
}

const PRECISIONS: &[&str] = &[
    "fp32", "float32", "no", "fp16", "float16", "half", "bf16", "bfloat16",
];

/// Every key this config accepts, with its type.
const KEYS: &[(&str, Ty)] = &[
    ("model_settings.precision", Ty::Enum(PRECISIONS)),
    ("model_settings.device", Ty::Str),
    ("model_settings.device_map", Ty::Str),
    ("model_settings.low_cpu_mem_usage", Ty::Bool),
    ("model_settings.max_memory.cuda", Ty::Size),
    ("model_settings.max_memory.cpu", Ty::Size),
    ("generation_settings.max_batch_size", Ty::PosInt),
    ("generation_settings.timeout", Ty::Float(0.0, 1e9)),
    ("generation_settings.retry_attempts", Ty::UInt),
    ("memory_management.auto_clear_interval", Ty::UInt),
    ("memory_management.cache_size", Ty::UInt),
    ("memory_management.cache_file", Ty::Str),
    ("image.model", Ty::Str),
    ("image.onnxruntime", Ty::Str),
    (
        "image.architecture",
        Ty::Enum(&["auto", "mobilenet_v2", "onnx"]),
    ),
    ("image.preprocess", Ty::Enum(&["auto", "wd14", "imagenet"])),
    ("image.input_size", Ty::PosInt),
    (
        "image.head",
        Ty::Enum(&["auto", "sigmoid", "softmax", "probabilities"]),
    ),
    ("image.general_threshold", Ty::Float(0.0, 1.0)),
    ("image.character_threshold", Ty::Float(0.0, 1.0)),
    ("image.general_mcut", Ty::Bool),
    ("image.character_mcut", Ty::Bool),
    ("tags.replace_underscores", Ty::Bool),
    ("tags.lowercase", Ty::Bool),
    ("tags.escape_parentheses", Ty::Bool),
    ("tags.undesired_tags", Ty::StrList),
    ("tags.replacements", Ty::Replacements),
    ("tags.always_first", Ty::StrList),
    ("tags.first_if_found", Ty::StrList),
    ("tags.tag_replacement", Ty::Str),
    ("tags.max_tags", Ty::PosInt),
    ("tags.include_rating", Ty::Bool),
    ("tags.character_first", Ty::Bool),
    ("captions.caption_extension", Ty::Str),
    ("captions.mode", Ty::Enum(&["skip", "overwrite", "append"])),
    ("captions.dry_run", Ty::Bool),
    ("llm.backend", Ty::Enum(&["local", "http"])),
    ("llm.model_path", Ty::Str),
    ("llm.base_url", Ty::Str),
    ("llm.model", Ty::Str),
    ("llm.api_key_env", Ty::Str),
    ("llm.concurrency", Ty::PosInt),
    ("llm.prompt", Ty::Str),
    ("vlm.base_url", Ty::Str),
    ("vlm.model", Ty::Str),
    ("vlm.api_key_env", Ty::Str),
    ("vlm.concurrency", Ty::PosInt),
    ("vlm.preset", Ty::Enum(&["tags", "short", "detailed"])),
    ("vlm.prompt", Ty::Str),
    ("vlm.max_tokens", Ty::PosInt),
    ("vlm.max_image_side", Ty::UInt),
];

/// Spellings of other tools mapped to ours (kohya's `undesired_tags` is a comma-separated string,
/// accepted too by [`Ty::StrList`]).
const ALIASES: &[(&str, &str)] = &[
    ("tags.trigger", "tags.always_first"),
    ("tags.keep_tokens", "tags.always_first"),
    // kohya's `--always_first_tags` moves found tags only
    ("tags.always_first_tags", "tags.first_if_found"),
    ("captions.extension", "captions.caption_extension"),
    // the WD14 reference app's names
    ("image.general_mcut_enabled", "image.general_mcut"),
    ("image.character_mcut_enabled", "image.character_mcut"),
];

impl TaggerConfig {
    /// Reads a `.yaml`/`.yml` or `.toml` file.
    ///
    /// # Errors
    /// [`Error::Io`] when unreadable; [`Error::Format`] for syntax errors or another extension;
    /// [`Error::Config`] for unknown keys (with a "did you mean" hint) and invalid values.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .unwrap_or("")
            .to_ascii_lowercase();
        let fmt_err = |msg: String| Error::Format {
            path: path.to_path_buf(),
            msg,
        };
        let value = match ext.as_str() {
            "yaml" | "yml" => serde_yaml_ng::from_str::<Value>(&text)
                .map_err(|e| fmt_err(format!("not valid YAML: {e}")))?,
            "toml" => {
                let t: toml::Table =
                    toml::from_str(&text).map_err(|e| fmt_err(format!("not valid TOML: {e}")))?;
                serde_json::to_value(t).map_err(|e| fmt_err(e.to_string()))?
            }
            _ => {
                return Err(fmt_err(
                    "unknown config extension; use .yaml, .yml or .toml".into(),
                ));
            }
        };
        Self::from_value(value)
    }

    /// Parses YAML text.
    ///
    /// # Errors
    /// As [`TaggerConfig::from_path`] (the path in [`Error::Format`] is `<yaml>`).
    pub fn from_yaml_str(text: &str) -> Result<Self> {
        let v = serde_yaml_ng::from_str::<Value>(text).map_err(|e| Error::Format {
            path: PathBuf::from("<yaml>"),
            msg: format!("not valid YAML: {e}"),
        })?;
        Self::from_value(v)
    }

    /// Parses TOML text.
    ///
    /// # Errors
    /// As [`TaggerConfig::from_path`] (the path in [`Error::Format`] is `<toml>`).
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let t: toml::Table = toml::from_str(text).map_err(|e| Error::Format {
            path: PathBuf::from("<toml>"),
            msg: format!("not valid TOML: {e}"),
        })?;
        let v = serde_json::to_value(t).map_err(|e| Error::Format {
            path: PathBuf::from("<toml>"),
            msg: e.to_string(),
        })?;
        Self::from_value(v)
    }

    /// Validates and converts a parsed document.
    ///
    /// # Errors
    /// [`Error::Config`] for unknown keys, wrong types and out-of-range values.
    pub fn from_value(value: Value) -> Result<Self> {
        let mut value = match value {
            Value::Null => Value::Object(Default::default()),
            Value::Object(mut m) => {
                // A training config's `tagger:` section, alone in the file.
                if m.len() == 1
                    && let Some(Value::Object(inner)) = m.remove("tagger")
                {
                    Value::Object(inner)
                } else {
                    Value::Object(m)
                }
            }
            other => {
                return Err(Error::Config {
                    key: "<top level>".into(),
                    value: other.to_string(),
                    hint: "the config must be a mapping of sections (model_settings:, \
                           generation_settings:, memory_management:, image:, tags:, captions:, llm:, vlm:)"
                        .into(),
                });
            }
        };
        apply_aliases(&mut value);
        let mut leaves = Vec::new();
        flatten("", &value, &mut leaves);
        for (key, v) in &leaves {
            let Some((_, ty)) = KEYS.iter().find(|(k, _)| k == key) else {
                let hint = match suggest(key) {
                    Some(s) => format!("unknown key; did you mean `{s}`?"),
                    None => "unknown key; known sections: model_settings, generation_settings, \
                             memory_management, image, tags, captions, llm, vlm (see \
                             examples/configs/tagger.yaml)"
                        .to_string(),
                };
                return Err(Error::Config {
                    key: key.clone(),
                    value: v.to_string(),
                    hint,
                });
            };
            check_type(key, v, *ty)?;
        }
        // `undesired_tags` may be kohya's comma-separated string.
        if let Some(Value::String(s)) = value.pointer("/tags/undesired_tags").cloned()
            && let Some(t) = value.pointer_mut("/tags/undesired_tags")
        {
            *t = Value::Array(split_list(&s).into_iter().map(Value::String).collect());
        }
        // kohya's `tag_replacement` string joins the `from=to` list.
        if let Some(Value::String(spec)) = value
            .pointer_mut("/tags")
            .and_then(|t| t.as_object_mut())
            .and_then(|t| t.remove("tag_replacement"))
        {
            let parsed =
                crate::tags::parse_kohya_tag_replacement(&spec).map_err(|hint| Error::Config {
                    key: "tags.tag_replacement".into(),
                    value: format!("{spec:?}"),
                    hint,
                })?;
            if let Some(tags) = value.pointer_mut("/tags").and_then(|t| t.as_object_mut()) {
                let list = tags
                    .entry("replacements")
                    .or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(a) = list {
                    a.extend(parsed.into_iter().map(Value::String));
                }
            }
        }
        for key in ["/tags/always_first", "/tags/first_if_found"] {
            if let Some(Value::String(s)) = value.pointer(key).cloned()
                && let Some(t) = value.pointer_mut(key)
            {
                *t = Value::Array(split_list(&s).into_iter().map(Value::String).collect());
            }
        }
        serde_json::from_value(value).map_err(|e| Error::Config {
            key: "<config>".into(),
            value: String::new(),
            hint: e.to_string(),
        })
    }

    /// The config as YAML (every key, defaults included).
    ///
    /// # Errors
    /// [`Error::Format`] if serialization fails (it does not for valid configs).
    pub fn to_yaml(&self) -> Result<String> {
        serde_yaml_ng::to_string(self).map_err(|e| Error::Format {
            path: PathBuf::from("<yaml>"),
            msg: e.to_string(),
        })
    }
}

fn split_list(s: &str) -> Vec<String> {
    s.split(',')
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect()
}

fn apply_aliases(v: &mut Value) {
    for (from, to) in ALIASES {
        let (fs, fk) = from.split_once('.').unwrap_or(("", from));
        let (ts, tk) = to.split_once('.').unwrap_or(("", to));
        let Some(Value::Object(sec)) = v.get_mut(fs) else {
            continue;
        };
        if let Some(x) = sec.remove(fk) {
            if fs == ts && !sec.contains_key(tk) {
                sec.insert(tk.to_string(), x);
            } else {
                sec.insert(fk.to_string(), x);
            }
        }
    }
}

fn flatten(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                // A mapping where the key expects a scalar is reported at the key itself.
                if x.is_object() && !KEYS.iter().any(|(kk, _)| *kk == key) {
                    flatten(&key, x, out);
                } else {
                    out.push((key, x.clone()));
                }
            }
        }
        other => out.push((prefix.to_string(), other.clone())),
    }
}

fn check_type(key: &str, v: &Value, ty: Ty) -> Result<()> {
    let bad = |expected: &str| Error::Config {
        key: key.to_string(),
        value: v.to_string(),
        hint: format!("expected {expected}"),
    };
    if v.is_null() {
        return Ok(());
    }
    match ty {
        Ty::Bool => v.as_bool().map(|_| ()).ok_or_else(|| bad("true or false")),
        Ty::UInt => v
            .as_u64()
            .map(|_| ())
            .ok_or_else(|| bad("a whole number ≥ 0")),
        Ty::PosInt => match v.as_u64() {
            Some(n) if n > 0 => Ok(()),
            _ => Err(bad("a whole number ≥ 1")),
        },
        Ty::Float(lo, hi) => match v.as_f64() {
            Some(x) if x >= lo && x <= hi => Ok(()),
            _ => Err(bad(&format!("a number in [{lo}, {hi}]"))),
        },
        Ty::Str => v.as_str().map(|_| ()).ok_or_else(|| bad("a string")),
        Ty::Enum(set) => match v.as_str() {
            Some(s) if set.contains(&s.to_ascii_lowercase().as_str()) => Ok(()),
            _ => Err(bad(&format!("one of {}", set.join(", ")))),
        },
        Ty::StrList => match v {
            Value::String(_) => Ok(()),
            Value::Array(a) if a.iter().all(|x| x.is_string()) => Ok(()),
            _ => Err(bad("a list of strings (or one comma-separated string)")),
        },
        Ty::Size => {
            let text = match v {
                Value::String(s) => s.clone(),
                Value::Number(n) => n.to_string(),
                _ => return Err(bad("a size like \"6GB\" or \"12GiB\"")),
            };
            lora_memory::parse_size(&text)
                .map(|_| ())
                .map_err(|e| bad(&format!("a size like \"6GB\" or \"12GiB\" ({e})")))
        }
        Ty::Replacements => {
            let Value::Array(a) = v else {
                return Err(bad("a list of \"from=to\" strings"));
            };
            for x in a {
                match x.as_str() {
                    Some(s) if s.split_once('=').is_some_and(|(f, _)| !f.trim().is_empty()) => {}
                    _ => {
                        return Err(Error::Config {
                            key: key.to_string(),
                            value: x.to_string(),
                            hint: "each replacement is \"from=to\" (e.g. \"1girl=one girl\"); an \
                                   empty `to` removes the tag"
                                .into(),
                        });
                    }
                }
            }
            Ok(())
        }
    }
}

// Levenshtein distance over chars (the `strsim` crate).
use strsim::levenshtein as edit_distance;

/// The closest known key: the same leaf under another section, else the smallest edit distance
/// (on the whole path or on the leaf within the same section) within a third of the leaf's length.
fn suggest(path: &str) -> Option<String> {
    let leaf = |s: &str| s.rsplit('.').next().unwrap_or(s).to_string();
    let section = |s: &str| s.rsplit_once('.').map(|(p, _)| p.to_string());
    let last = leaf(path);
    if let Some((k, _)) = KEYS.iter().find(|(k, _)| leaf(k) == last) {
        return Some((*k).to_string());
    }
    let mut best: Option<(usize, &str)> = None;
    for (k, _) in KEYS {
        let d_full = edit_distance(path, k);
        let d_leaf = edit_distance(&last, &leaf(k)) + usize::from(section(path) != section(k));
        let d = d_full.min(d_leaf);
        if best.is_none_or(|(bd, _)| d < bd) {
            best = Some((d, k));
        }
    }
    let (d, k) = best?;
    (d <= (last.len() / 3).max(2)).then(|| k.to_string())
}

/// What to ask the model for (`vlm.preset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum VlmPreset {
    /// Booru-style tags (`1girl, red scarf, outdoors`), post-processed like any tagger's.
    Tags,
    /// One sentence naming the subject and the setting (the default).
    #[default]
    Short,
    /// A paragraph: subject, appearance, action, setting, lighting, style and composition.
    Detailed,
}

impl VlmPreset {
    /// Every preset with its config name.
    pub const ALL: [(VlmPreset, &'static str); 3] = [
        (VlmPreset::Tags, "tags"),
        (VlmPreset::Short, "short"),
        (VlmPreset::Detailed, "detailed"),
    ];

    /// The config name (`tags`, `short`, `detailed`).
    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(p, _)| *p == self)
            .map_or("short", |(_, n)| n)
    }

    /// Parses a config name.
    ///
    /// # Errors
    /// [`Error::Config`] naming `vlm.preset` and the names that exist.
    pub fn parse(name: &str) -> Result<Self> {
        let n = name.trim().to_ascii_lowercase();
        Self::ALL
            .iter()
            .find(|(_, s)| *s == n)
            .map(|(p, _)| *p)
            .ok_or_else(|| Error::Config {
                key: "vlm.preset".into(),
                value: format!("{name:?}"),
                hint: "use \"tags\" (booru tags), \"short\" (a one-sentence caption) or \
                       \"detailed\" (a paragraph)"
                    .into(),
            })
    }

    /// The instruction sent with each image.
    pub fn instruction(self) -> &'static str {
        match self {
            VlmPreset::Tags => {
                "Tag this image for a training dataset. Reply with booru-style tags only: short \
                 lowercase tags of one to three words, separated by commas, most important first \
                 (the subject, then details, colors, setting and style). No sentences."
            }
            VlmPreset::Short => {
                "Write a caption for this image for a training dataset: one plain sentence that \
                 names the main subject and the setting. Reply with the caption only."
            }
            VlmPreset::Detailed => {
                "Describe this image for a training dataset in one paragraph of three to five \
                 sentences: the main subject and its appearance, what it is doing, the setting, \
                 the lighting and colors, and the style and composition. Describe only what is \
                 visible. Reply with the description only."
            }
        }
    }

    /// `max_tokens` when the config sets none: 96 for tags, 64 for a short caption, 300 for a
    /// detailed one (a 5-sentence paragraph is ~120–200 tokens in the Llama-3/Qwen2 tokenizers).
    pub fn default_max_tokens(self) -> usize {
        match self {
            VlmPreset::Tags => 96,
            VlmPreset::Short => 64,
            VlmPreset::Detailed => 300,
        }
    }

    /// Whether replies are tags (post-processed) rather than free text.
    pub fn is_tags(self) -> bool {
        self == VlmPreset::Tags
    }
}

impl fmt::Display for VlmPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::caption::CaptionMode;

    #[test]
    fn guide_keys_are_read_as_written() {
        let yaml = "\
model_settings:
  precision: bfloat16
  device: cpu
  device_map: auto
  low_cpu_mem_usage: true
  max_memory:
    cuda: 6GB
    cpu: 12GiB
generation_settings:
  max_batch_size: 4
  timeout: 30
  retry_attempts: 2
memory_management:
  auto_clear_interval: 10
  cache_size: 500
";
        let c = TaggerConfig::from_yaml_str(yaml).unwrap();
        assert_eq!(c.model_settings.precision, Precision::Bf16);
        assert_eq!(c.model_settings.resolve_device().unwrap(), tch::Device::Cpu);
        assert_eq!(
            c.model_settings.max_memory.cuda.as_ref().unwrap().bytes,
            6_000_000_000
        );
        assert_eq!(
            c.model_settings.max_memory.cpu.as_ref().unwrap().bytes,
            12 << 30
        );
        assert_eq!(c.generation_settings.max_batch_size, 4);
        assert_eq!(c.generation_settings.timeout, 30.0);
        assert_eq!(c.generation_settings.retry_attempts, 2);
        assert_eq!(c.memory_management.auto_clear_interval, 10);
        assert_eq!(c.memory_management.cache_size, 500);
        // Untouched sections keep their defaults (the threshold then follows the head).
        assert_eq!(c.image.general_threshold, None);
        assert_eq!(c.image.general_threshold_for(true), 0.35);
        assert_eq!(c.image.general_threshold_for(false), 0.05);
        assert_eq!(c.captions.caption_extension, ".txt");
    }

    #[test]
    fn the_example_config_reads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/tagger.yaml");
        let c = TaggerConfig::from_path(&path).unwrap();
        assert_eq!(c.image.general_threshold, Some(0.05));
        assert_eq!(c.tags.always_first, vec!["sks"]);
        assert_eq!(c.tags.replacements, vec!["tiger cat=tabby cat"]);
        assert_eq!(
            c.model_settings.max_memory.cpu.as_ref().unwrap().bytes,
            8 << 30
        );
        assert_eq!(c.llm.backend, Some(LlmBackend::Local));
        assert_eq!(c.captions.mode, CaptionMode::Skip);
    }

    #[test]
    fn toml_and_the_tagger_wrapper_work() {
        let t = "[tagger.image]\ngeneral_threshold = 0.1\n[tagger.captions]\nmode = \"append\"\n";
        let c = TaggerConfig::from_toml_str(t).unwrap();
        assert_eq!(c.image.general_threshold, Some(0.1));
        assert_eq!(c.captions.mode, CaptionMode::Append);
    }

    #[test]
    fn unknown_keys_get_a_hint() {
        let e = |y: &str| TaggerConfig::from_yaml_str(y).unwrap_err().to_string();
        let m = e("generation_settings:\n  max_batch_sise: 4\n");
        assert!(
            m.contains("generation_settings.max_batch_sise")
                && m.contains("did you mean `generation_settings.max_batch_size`"),
            "{m}"
        );
        // The same leaf in the wrong section.
        let m = e("image:\n  cache_size: 10\n");
        assert!(
            m.contains("did you mean `memory_management.cache_size`"),
            "{m}"
        );
        let m = e("caption_extension: .caption\n");
        assert!(
            m.contains("did you mean `captions.caption_extension`"),
            "{m}"
        );
        let m = e("zzz: 1\n");
        assert!(m.contains("known sections"), "{m}");
    }

    #[test]
    fn bad_values_name_the_key() {
        let e = |y: &str| TaggerConfig::from_yaml_str(y).unwrap_err().to_string();
        let m = e("model_settings:\n  max_memory:\n    cuda: lots\n");
        assert!(
            m.contains("model_settings.max_memory.cuda") && m.contains("lots"),
            "{m}"
        );
        let m = e("image:\n  general_threshold: 1.5\n");
        assert!(
            m.contains("image.general_threshold") && m.contains("[0, 1]"),
            "{m}"
        );
        let m = e("generation_settings:\n  max_batch_size: 0\n");
        assert!(m.contains("≥ 1"), "{m}");
        let m = e("tags:\n  replacements: [\"no equals sign\"]\n");
        assert!(m.contains("from=to"), "{m}");
        let m = e("model_settings:\n  precision: int3\n");
        assert!(m.contains("bf16"), "{m}");
        let c = TaggerConfig::from_yaml_str("model_settings:\n  device: tpu\n").unwrap();
        let m = c.model_settings.resolve_device().unwrap_err().to_string();
        assert!(
            m.contains("model_settings.device") && m.contains("tpu"),
            "{m}"
        );
    }

    #[test]
    fn kohya_style_lists_and_aliases() {
        let c = TaggerConfig::from_yaml_str(
            "tags:\n  undesired_tags: \"monochrome, greyscale\"\n  trigger: sks\n",
        )
        .unwrap();
        assert_eq!(c.tags.undesired_tags, vec!["monochrome", "greyscale"]);
        assert_eq!(c.tags.always_first, vec!["sks"]);
        let c = TaggerConfig::from_yaml_str("llm:\n  backend: http\n  concurrency: 4\n").unwrap();
        assert_eq!(c.llm.backend, Some(LlmBackend::Http));
        assert_eq!(c.llm.concurrency, Some(4));
        // kohya's tagger options as written
        let c = TaggerConfig::from_yaml_str(
            "tags:\n  always_first_tags: \"1girl, 1boy\"\n  tag_replacement: \"a\\\\,b,c;d,e\"\n  \
             replacements: [\"x=y\"]\nimage:\n  general_mcut_enabled: true\n  onnxruntime: /opt/ort\n",
        )
        .unwrap();
        assert_eq!(c.tags.first_if_found, vec!["1girl", "1boy"]);
        assert_eq!(c.tags.replacements, vec!["x=y", "a,b=c", "d=e"]);
        assert!(c.image.general_mcut && !c.image.character_mcut);
        assert_eq!(c.image.onnxruntime.as_deref(), Some(Path::new("/opt/ort")));
        let m = TaggerConfig::from_yaml_str("tags:\n  tag_replacement: \"a,b,c\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            m.contains("tags.tag_replacement") && m.contains("source,target"),
            "{m}"
        );
        // The full default config round-trips through YAML.
        let d = TaggerConfig::default();
        let y = d.to_yaml().unwrap();
        assert_eq!(TaggerConfig::from_yaml_str(&y).unwrap(), d);
    }
}
