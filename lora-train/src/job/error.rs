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
    #[error("predicted peak {peak} does not fit the budget {budget} ({source_desc}); {hint}")]
    DoesNotFit {
        /// Predicted peak.
        peak: lora_memory::Bytes,
        /// The budget.
        budget: lora_memory::Bytes,
        /// Where the budget came from.
        source_desc: String,
        /// What to do: take the suggested settings (`memory.auto_fit`), or, when nothing on
        /// the fitting ladder fits, what is left (a larger budget, a smaller job, `--force`).
        hint: String,
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
    /// The training engine failed (out of memory, a non-finite loss under `stop`, a checkpoint).
    #[error("{during}: {source}")]
    Train {
        /// What the job was doing ("training", "evaluating before training", …).
        during: String,
        /// The engine's error.
        #[source]
        source: crate::engine::TrainError,
    },
    /// A model failed to load, run or save.
    #[error("{during}: {source}")]
    Model {
        /// What the job was doing.
        during: String,
        /// The model layer's error.
        #[source]
        source: lora_models::Error,
    },
    /// LoRA layers, injection or an adapter file failed.
    #[error("{during}: {source}")]
    Lora {
        /// What the job was doing.
        during: String,
        /// lora-core's error.
        #[source]
        source: lora_core::Error,
    },
    /// The data could not be read, scanned or batched.
    #[error("{during}: {source}")]
    Data {
        /// What the job was doing.
        during: String,
        /// lora-data's error.
        #[source]
        source: lora_data::Error,
    },
    /// A libtorch call failed outside the engine.
    #[error("{during}: {source}")]
    Torch {
        /// What the job was doing.
        during: String,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// A file or folder could not be read or written.
    #[error("{during}: {source}")]
    Io {
        /// What the job was doing (names the file).
        during: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// An adapter could not be written.
    #[error("{during}: {source}")]
    Export {
        /// What the job was doing.
        during: String,
        /// The exporter's error.
        #[source]
        source: crate::export::ExportError,
    },
    /// A summary or metadata could not be (de)serialized.
    #[error("{during}: {source}")]
    Json {
        /// What the job was doing.
        during: String,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The engine stopped the run: a non-finite loss under the `stop` policy, or out of memory
    /// even at one sample per micro-batch.
    #[error(transparent)]
    Engine(crate::engine::TrainError),
    /// Training ended with a non-finite evaluation loss; nothing was exported.
    #[error(
        "training diverged: the {what} after training is {loss} ({skipped} of {steps} steps skipped as non-finite); nothing was exported. Lower train.learning_rate or set train.max_grad_norm (e.g. 1.0){}",
        checkpoint.as_ref().map(|c| format!("; last checkpoint: {}", c.display())).unwrap_or_default()
    )]
    Diverged {
        /// What was evaluated (`"held-out loss"`, …).
        what: String,
        /// Its value (NaN or ±inf).
        loss: f64,
        /// Optimizer steps skipped as non-finite.
        skipped: u64,
        /// Optimizer steps done.
        steps: u64,
        /// The run's last checkpoint, if any.
        checkpoint: Option<std::path::PathBuf>,
    },
    /// A model file or setting this recipe does not train (an SD 2.x single file, a language
    /// model given to the SD job, …), with what to do instead.
    #[error("{what}: {reason}")]
    Unsupported {
        /// The file or key (`"model.base_model = …"`).
        what: String,
        /// Why, and what to do.
        reason: String,
    },
    /// The output folder's lock file is created and removed again and again: another run is
    /// starting on the same `train.output_dir`.
    #[error("{}: another process keeps creating the lock file; is a second run starting on this output_dir?", path.display())]
    LockContended {
        /// The lock file.
        path: std::path::PathBuf,
    },
    /// `lora_memory::fit` failed in a way other than not fitting.
    #[error(transparent)]
    Fit(lora_memory::FitError),
    /// A broken invariant of the job itself (a bug to report).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

/// `Result` with a [`JobError`].
pub type Result<T> = std::result::Result<T, JobError>;

/// Context for a failed call: `result.during("loading the UNet")?` turns the lower layer's error
/// into the [`JobError`] variant that keeps it as its `#[source]`, with what the job was doing in
/// front of its message.
pub trait During<T> {
    /// The error as a [`JobError`] with `what` as context.
    ///
    /// # Errors
    /// The wrapped error, when `self` is one.
    fn during(self, what: impl Into<String>) -> Result<T>;
}

macro_rules! during_for {
    ($err:ty, $variant:ident) => {
        impl<T> During<T> for std::result::Result<T, $err> {
            fn during(self, what: impl Into<String>) -> Result<T> {
                self.map_err(|source| JobError::$variant {
                    during: what.into(),
                    source,
                })
            }
        }
    };
}

during_for!(crate::engine::TrainError, Train);
during_for!(lora_models::Error, Model);
during_for!(lora_core::Error, Lora);
during_for!(lora_data::Error, Data);
during_for!(tch::TchError, Torch);
during_for!(std::io::Error, Io);
during_for!(serde_json::Error, Json);
during_for!(crate::export::ExportError, Export);

/// A model error inside a training step, as the engine reports it: libtorch's errors stay
/// [`crate::engine::TrainError::Torch`] and a LoRA layer's stay
/// [`crate::engine::TrainError::Lora`] (so an out-of-memory in either is recognised and backed
/// off), the rest become [`crate::engine::TrainError::App`].
pub(crate) fn model_step_err(e: lora_models::Error) -> crate::engine::TrainError {
    match e {
        lora_models::Error::Torch(t) => crate::engine::TrainError::Torch(t),
        lora_models::Error::Core(c) => crate::engine::TrainError::Lora(c),
        other => crate::engine::TrainError::App(other.to_string()),
    }
}
