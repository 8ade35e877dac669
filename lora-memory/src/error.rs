//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while reading a model header, parsing a size or estimating.
///
/// Each variant carries the offending input (file, key, value) and says what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A size string such as `"6GB"` could not be parsed.
    #[error(
        "invalid size {input:?}: {reason} (write e.g. \"6GB\", \"12GiB\", \"512MB\" or a byte count)"
    )]
    InvalidSize {
        /// The text as given.
        input: String,
        /// What was wrong with it.
        reason: String,
    },
    /// A model preset name is not in the table.
    #[error("unknown model preset {name:?}; known presets: {known}")]
    UnknownPreset {
        /// The name as given.
        name: String,
        /// Comma-separated list of the known names.
        known: String,
    },
    /// A GPU name is not in the preset table.
    #[error(
        "unknown GPU {name:?}; known GPUs: {known} (for a size such as \"6GB\", give a budget instead: `--budget` / `memory.budget`)"
    )]
    UnknownGpu {
        /// The name as given.
        name: String,
        /// Comma-separated list of the known names.
        known: String,
    },
    /// Reading a file failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file (config.json, safetensors header) is not valid JSON.
    #[error("{path}: invalid JSON: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// A key of a model configuration is missing or has the wrong type.
    #[error("{path}: key {key:?}: {reason}")]
    Config {
        /// The file (config.json, GGUF, safetensors).
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong and what to do.
        reason: String,
    },
    /// A GGUF file is malformed or uses an unsupported version.
    #[error("{path}: malformed GGUF at byte {offset}: {reason}")]
    Gguf {
        /// The file.
        path: PathBuf,
        /// Byte offset where the problem was found.
        offset: u64,
        /// What is wrong.
        reason: String,
    },
    /// A safetensors header is malformed.
    #[error("{path}: malformed safetensors header: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint is of an architecture this crate does not describe.
    #[error("{path}: unsupported architecture {arch:?}: {hint}")]
    UnsupportedArchitecture {
        /// The file or folder.
        path: PathBuf,
        /// The architecture name found (or a summary of the keys).
        arch: String,
        /// What is supported.
        hint: String,
    },
    /// A model descriptor built in code has an impossible shape.
    #[error("model {name:?}: invalid {field}: {reason}")]
    InvalidDescriptor {
        /// The descriptor's display name.
        name: String,
        /// The field (`hidden`, `kv_heads`, …).
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A setting is out of range or does not apply to the model.
    #[error("invalid setting {key}: {reason}")]
    InvalidSetting {
        /// The setting's field name.
        key: &'static str,
        /// What is wrong and what to do.
        reason: String,
    },
    /// No NVIDIA GPU (or no driver) is available for a live memory probe. A normal answer on CPU
    /// machines.
    #[error("no NVIDIA GPU: {reason}")]
    NoGpu {
        /// Why (driver library missing, no device at that index, …).
        reason: String,
    },
}

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
