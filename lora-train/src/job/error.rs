//! The jobs' error type.

use std::path::PathBuf;

/// Errors of the jobs (the LLM and Stable Diffusion recipes) and of planning.
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
    /// The run was stopped by [`crate::engine::request_stop`] (Ctrl-C in the CLI).
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

/// `map_err` helper: a runtime error with `ctx` in front of the cause's message.
pub(crate) fn rt<E: std::fmt::Display>(ctx: &str) -> impl FnOnce(E) -> JobError + '_ {
    move |e| JobError::Runtime(format!("{ctx}: {e}"))
}
