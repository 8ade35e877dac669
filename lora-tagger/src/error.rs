//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong while loading a tagger, tagging, or writing captions.
///
/// Messages name the offending file, key, URL or value and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file or folder could not be read, created or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A folder cannot be written (read-only file system, permissions, immutable attribute).
    #[error(
        "cannot write into {folder}: {source}; make the folder writable (e.g. `chmod u+w`), copy the images to a writable folder, or run with --dry-run to see what would be written"
    )]
    NotWritable {
        /// The folder.
        folder: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// An image could not be decoded.
    #[error("cannot decode image {path}: {msg}")]
    Image {
        /// The image file.
        path: PathBuf,
        /// What the decoder said.
        msg: String,
    },
    /// A label file (`selected_tags.csv`), config or model file is malformed.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What was wrong, with the line or key where known.
        msg: String,
    },
    /// A config value is invalid.
    #[error("config key `{key}` = {value}: {hint}")]
    Config {
        /// The key, e.g. `generation_settings.max_batch_size`.
        key: String,
        /// The offending value as written.
        value: String,
        /// What to write instead.
        hint: String,
    },
    /// An HTTP backend could not be reached or answered with an error status.
    #[error("{url}: {msg}")]
    Http {
        /// The endpoint (never includes the API key).
        url: String,
        /// What went wrong (status and body excerpt, or the transport error).
        msg: String,
    },
    /// A request did not complete within its timeout (after all retries).
    #[error(
        "{what} timed out after {seconds} s (after {attempts} attempt(s)); raise `generation_settings.timeout` or check the server"
    )]
    Timeout {
        /// What timed out (the URL or the model).
        what: String,
        /// The timeout per attempt, seconds.
        seconds: f64,
        /// How many attempts were made.
        attempts: u32,
    },
    /// A model answered, but no tags (or, for a captioner, no caption) could be parsed from its
    /// reply.
    #[error("no tags or caption could be parsed from the reply {reply:?}")]
    Unparseable {
        /// The reply (truncated to 200 characters).
        reply: String,
    },
    /// This tagger cannot do what was asked (e.g. descriptions given to an image-only tagger).
    #[error("{tagger} does not support {what}")]
    Unsupported {
        /// The tagger's model id.
        tagger: String,
        /// What was asked.
        what: &'static str,
    },
    /// Memory ran out even at a micro-batch of one.
    #[error("out of memory tagging a batch of 1 with {model}: {msg}")]
    OutOfMemory {
        /// The tagger's model id.
        model: String,
        /// libtorch's message.
        msg: String,
    },
    /// ONNX Runtime could not be found or loaded, or a session could not be created or run.
    #[error("onnx runtime: {what}: {msg}")]
    OnnxRuntime {
        /// What was being done (loading the library, the model file, running a batch).
        what: String,
        /// What ONNX Runtime said, or where the library was looked for and how to get it.
        msg: String,
    },
    /// A libtorch call failed.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// The model crate failed (loading, tokenizing, generating).
    #[error(transparent)]
    Model(#[from] lora_models::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
