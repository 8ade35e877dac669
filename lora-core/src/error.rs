//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in `lora-core`.
///
/// Messages are lowercase, name the offending key / file / value, and say what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A libtorch operation failed (shape mismatch inside an op, out of memory, device error, ...).
    #[error("torch error while {context}: {source}")]
    Torch {
        /// What was being done.
        context: String,
        /// The error libtorch reported.
        #[source]
        source: tch::TchError,
    },
    /// A tensor had the wrong shape.
    #[error("shape mismatch for {key}: expected {expected:?}, found {found:?}")]
    Shape {
        /// The tensor / key concerned.
        key: String,
        /// The shape that was required.
        expected: Vec<i64>,
        /// The shape that was found.
        found: Vec<i64>,
    },
    /// A tensor had a dtype that is not accepted here.
    #[error("unsupported dtype for {key}: {found} ({what})")]
    Dtype {
        /// The tensor / key concerned.
        key: String,
        /// The dtype found.
        found: String,
        /// What is accepted.
        what: String,
    },
    /// Raw quantized data did not have the expected layout.
    #[error("invalid quantized data ({kind}): {reason}")]
    Quant {
        /// The quantization kind, as text.
        kind: String,
        /// What was wrong.
        reason: String,
    },
    /// The configuration is invalid.
    #[error("invalid lora config: {0}")]
    Config(String),
    /// A `target_modules` / `exclude_modules` / pattern regex failed to compile.
    #[error("invalid regex {pattern:?} in {field}: {source}")]
    Regex {
        /// The field (`target_modules`, `rank_pattern`, ...).
        field: String,
        /// The pattern as written.
        pattern: String,
        /// The regex compiler's message.
        #[source]
        source: regex::Error,
    },
    /// `target_modules` matched no site of the model.
    #[error(
        "target_modules {targets} matched no module of the model; existing modules: [{available}]"
    )]
    NoTargetMatched {
        /// The target specification, as written.
        targets: String,
        /// The module paths that exist (comma-separated).
        available: String,
    },
    /// An adapter with this name already exists / does not exist / was misused.
    #[error("adapter {name:?}: {reason}")]
    Adapter {
        /// The adapter name.
        name: String,
        /// What was wrong.
        reason: String,
    },
    /// Merging would have produced NaN or Inf in the base weight (safe merge).
    #[error(
        "safe merge refused for {module}: merged weight of adapter {adapter:?} contains NaN/Inf"
    )]
    NonFinite {
        /// The module path.
        module: String,
        /// The adapter name.
        adapter: String,
    },
    /// The operation is not supported for this layer / base.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A key required by a file format was missing.
    #[error("missing key {key:?} in {file}")]
    MissingKey {
        /// The key that was expected.
        key: String,
        /// The file.
        file: PathBuf,
    },
    /// A file had content we could not accept (unknown keys, bad metadata, ...).
    #[error("invalid adapter file {file}: {reason}")]
    Format {
        /// The file.
        file: PathBuf,
        /// What was wrong.
        reason: String,
    },
    /// Reading or writing a file failed.
    #[error("i/o error on {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A safetensors file could not be parsed or written.
    #[error("safetensors error on {path}: {source}")]
    SafeTensors {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: safetensors::SafeTensorError,
    },
    /// A JSON file could not be parsed or written.
    #[error("json error on {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },
}

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Adds context to a `tch` error.
pub(crate) trait TchContext<T> {
    /// Wraps the error as [`Error::Torch`] with `context` (evaluated lazily).
    fn ctx<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T>;
}

impl<T> TchContext<T> for std::result::Result<T, tch::TchError> {
    fn ctx<S: Into<String>>(self, context: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|source| Error::Torch {
            context: context().into(),
            source,
        })
    }
}
