//! The error type of `lora-data`.

use std::path::PathBuf;

/// Every failure of this crate, with the offending file, key or value and what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or folder could not be read.
    #[error("cannot read {path}: {source}; check that it exists and is readable")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A file could not be written (latent cache).
    #[error("cannot write {path}: {source}; check free space and permissions")]
    Write {
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A data file has content this crate cannot use.
    #[error("{path}:{line}: {message}")]
    Format {
        /// The data file.
        path: PathBuf,
        /// 1-based line (0 when the problem is not tied to a line).
        line: usize,
        /// What is wrong and what to do.
        message: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer failed on {context}: {message}")]
    Tokenizer {
        /// Which document (file and line).
        context: String,
        /// The tokenizer's message.
        message: String,
    },
    /// A libtorch operation failed.
    #[error("tensor operation failed while {context}: {source}")]
    Tensor {
        /// What was being built.
        context: String,
        /// The libtorch error.
        source: tch::TchError,
    },
    /// A configuration value is out of range or inconsistent.
    #[error("invalid configuration `{key}` = {value}: {message}")]
    Config {
        /// The key.
        key: String,
        /// The offending value, as written.
        value: String,
        /// What is allowed.
        message: String,
    },
    /// A dataset TOML has a key this crate does not know.
    #[error("{path}: unknown key `{key}` in [{table}]{hint}")]
    UnknownKey {
        /// The TOML file.
        path: PathBuf,
        /// The table holding the key (`general`, `datasets`, `datasets.subsets`).
        table: String,
        /// The unknown key.
        key: String,
        /// `; did you mean `x`?` or empty.
        hint: String,
    },
    /// An image could not be decoded.
    #[error("{path}: cannot decode image: {message}")]
    Image {
        /// The image file.
        path: PathBuf,
        /// The decoder's message and what to do.
        message: String,
    },
    /// A dataset index was out of range.
    #[error("index {index} out of range for a dataset of {len} items")]
    IndexOutOfRange {
        /// The requested index.
        index: usize,
        /// The dataset length.
        len: usize,
    },
    /// A loader worker thread stopped without sending its batch.
    #[error("loader worker {worker} stopped before sending batch {step}: {message}")]
    Worker {
        /// Worker number.
        worker: usize,
        /// Batch index in the epoch.
        step: usize,
        /// What happened.
        message: String,
    },
    /// A chat template is not valid Jinja or failed while rendering.
    #[error("chat template {template}: {message}")]
    Template {
        /// Which template (e.g. `tokenizer.chat_template of model.gguf`).
        template: String,
        /// minijinja's message, naming the problem and the template line.
        message: String,
    },
    /// A chat template refused the conversation through its `raise_exception(message)`.
    #[error("chat template {template} refused the conversation: {message}")]
    TemplateRaised {
        /// Which template.
        template: String,
        /// The template's own message (e.g. "Conversation roles must alternate user/assistant/...").
        message: String,
    },
    /// A chat template renders the beginning of a conversation differently once more messages
    /// follow, so the text an assistant message adds cannot be marked for training.
    #[error(
        "chat template {template} is not prefix-stable at message {index}: {message}; the \
         trained tokens cannot be located — drop the record's system prompt (Mistral's templates \
         write it only into a final user turn) or train with a ChatML template"
    )]
    TemplateNotPrefixStable {
        /// Which template.
        template: String,
        /// 0-based index of the assistant message concerned.
        index: usize,
        /// Which rendering did not start with which.
        message: String,
    },
    /// A record of a data file could not be rendered (a chat template error), with its place.
    #[error("{path}:{line}: {source}")]
    Record {
        /// The data file.
        path: PathBuf,
        /// 1-based line (array element index + 1 for a JSON array).
        line: usize,
        /// What failed.
        source: Box<Error>,
    },
    /// Validation found problems and the policy is to fail.
    #[error("dataset validation found {count} problem(s):\n{report}")]
    Invalid {
        /// Number of problems.
        count: usize,
        /// One line per problem: file, what, fix.
        report: String,
    },
}

impl Error {
    /// Wraps a libtorch error with what was being done.
    pub(crate) fn tensor(context: impl Into<String>) -> impl FnOnce(tch::TchError) -> Error {
        let context = context.into();
        move |source| Error::Tensor { context, source }
    }

    /// Wraps an I/O error with the path.
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { path, source }
    }

    /// A configuration error.
    pub(crate) fn config(key: &str, value: impl ToString, message: impl Into<String>) -> Error {
        Error::Config {
            key: key.to_string(),
            value: value.to_string(),
            message: message.into(),
        }
    }
}
