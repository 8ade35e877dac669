//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading, running or sampling a model of this crate.
///
/// Messages name the offending file, key or value and, where there is one, what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file could not be opened, mapped or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A GGUF file is malformed (bad magic, truncated, an offset out of range, …).
    #[error("{path}: malformed GGUF: {msg}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What was wrong, with the byte offset where known.
        msg: String,
    },
    /// A metadata key that the model needs is absent or has the wrong type.
    #[error("{path}: metadata key `{key}`: {msg}")]
    Metadata {
        /// The file (GGUF or `config.json`).
        path: PathBuf,
        /// The key, e.g. `llama.block_count`.
        key: String,
        /// What was expected.
        msg: String,
    },
    /// A tensor that the architecture needs is not in the checkpoint.
    #[error("tensor `{name}` not found in {path}; the checkpoint does not match the configuration")]
    MissingTensor {
        /// The tensor's name as stored in the file.
        name: String,
        /// The file or folder searched.
        path: PathBuf,
    },
    /// A tensor has a shape other than the configuration implies.
    #[error("tensor `{name}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        /// The tensor's name.
        name: String,
        /// The shape the configuration implies (torch order).
        expected: Vec<i64>,
        /// The shape found in the file (torch order).
        found: Vec<i64>,
    },
    /// A feature of the file or configuration that this crate does not implement.
    #[error("unsupported {what} `{value}`: {hint}")]
    Unsupported {
        /// What kind of thing (tensor type, rope scaling, architecture, …).
        what: &'static str,
        /// The value found.
        value: String,
        /// What is supported / what to do.
        hint: String,
    },
    /// A model that loads but that a pipeline cannot be built from or run as asked (an SD 2.x
    /// single file, an SDXL UNet without its second text encoder, a single file without a
    /// tokenizer, …); `reason` says why and what to do.
    #[error("{what}: {reason}")]
    Unusable {
        /// The file or folder.
        what: String,
        /// Why, and what to do.
        reason: String,
    },
    /// A step of loading or running failed; `during` names the step and the file.
    #[error("{during}: {source}")]
    Context {
        /// What was being done (`"loading the VAE of <dir>"`, …).
        during: String,
        /// The error of that step.
        #[source]
        source: Box<Error>,
    },
    /// A `config.json` or similar configuration file could not be parsed.
    #[error("config {path}: {msg}")]
    Config {
        /// The file.
        path: PathBuf,
        /// The parse error or inconsistency.
        msg: String,
    },
    /// A safetensors file could not be parsed.
    #[error("{path}: safetensors: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// The parse error.
        msg: String,
    },
    /// Building or running the tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// An argument is out of range or inconsistent (shapes of inputs, sampling options, …).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A LoRA-layer or quantisation operation of `lora-core` failed.
    #[error(transparent)]
    Core(#[from] lora_core::Error),
    /// A call into the libtorch shim of `lora-core` (generator state, …) failed.
    #[error(transparent)]
    Shim(#[from] lora_core::sys::ShimError),
    /// A chat template failed to compile or render (`lora-data`'s template errors:
    /// [`lora_data::Error::Template`], [`lora_data::Error::TemplateRaised`], …).
    #[error(transparent)]
    Data(#[from] lora_data::Error),
    /// A libtorch operation failed (this includes out-of-memory on CPU and CUDA).
    #[error("torch: {0}")]
    Torch(#[from] tch::TchError),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
