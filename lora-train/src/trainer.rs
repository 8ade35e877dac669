//! The training loop: [`TrainStep`] (the app's model and loss), [`Trainer`] (accumulation,
//! clipping, mixed precision, OOM back-off, NaN/Inf policy, checkpoints, exact resume) and the
//! crate's error type.

use std::path::PathBuf;

use lora_core::sys::ShimError;

/// Errors of the training engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A libtorch call failed (out of memory, shape mismatch, …).
    #[error("libtorch error: {0}")]
    Torch(#[from] tch::TchError),
    /// The libtorch shim failed (autocast, allocator statistics, RNG state).
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// A file could not be read or written.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done ("write checkpoint", "read", …).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A hyper-parameter or setting is invalid.
    #[error("invalid {what} `{value}`: {hint}")]
    Invalid {
        /// The setting.
        what: String,
        /// The offending value.
        value: String,
        /// What to use instead.
        hint: String,
    },
    /// Saved state (checkpoint, optimizer state) is missing or does not match this run.
    #[error("bad {what}: {message}")]
    State {
        /// Which state.
        what: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// Loss or gradient norm became NaN/Inf and the policy is to stop.
    #[error("non-finite {what} at step {step}: {value} (policy: stop; lower the learning rate or use bf16/fp32)")]
    NonFinite {
        /// "loss" or "grad norm".
        what: &'static str,
        /// The optimizer step.
        step: u64,
        /// The value seen.
        value: f64,
    },
    /// Out of memory even with a micro-batch of one sample.
    #[error("out of memory at step {step} with micro-batch {micro_batch}: {message} (lower seq length / rank, enable gradient checkpointing or a quantized base)")]
    OutOfMemory {
        /// The optimizer step.
        step: u64,
        /// Samples per micro-batch when it failed.
        micro_batch: usize,
        /// libtorch's message.
        message: String,
    },
    /// An error raised by the application's [`TrainStep`] or a callback.
    #[error("{0}")]
    App(String),
}

/// `Result` with a [`TrainError`].
pub type Result<T> = std::result::Result<T, TrainError>;

impl TrainError {
    /// True for libtorch out-of-memory errors: CUDA ("CUDA out of memory", "out of memory") and CPU
    /// ("DefaultCPUAllocator: can't allocate memory").
    pub fn is_oom(&self) -> bool {
        match self {
            TrainError::Torch(e) => is_oom_message(&e.to_string()),
            TrainError::OutOfMemory { .. } => true,
            _ => false,
        }
    }
}

/// True when a libtorch error message reports an allocation failure.
pub fn is_oom_message(msg: &str) -> bool {
    msg.contains("out of memory") || msg.contains("can't allocate memory")
}

/// Summary of a finished (or stopped) run.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct TrainReport {
    /// Optimizer steps done (including steps done before a resume).
    pub steps: u64,
    /// Epochs completed.
    pub epochs: u64,
    /// `(step, loss)` of every step run in this process.
    pub losses: Vec<(u64, f64)>,
    /// Loss of the last step.
    pub final_loss: Option<f64>,
    /// Steps whose update was skipped (non-finite values, fp16 overflow).
    pub skipped_steps: u64,
    /// Out-of-memory back-offs (each halves the micro-batch).
    pub oom_backoffs: u64,
    /// Final split of each loader batch (1 = no back-off).
    pub micro_batch_split: usize,
    /// True when a callback stopped the run before the planned steps.
    pub stopped_early: bool,
    /// The step the run resumed from, if it did.
    pub resumed_from: Option<u64>,
    /// The last checkpoint written.
    pub last_checkpoint: Option<PathBuf>,
    /// Peak memory on the training device, bytes (CUDA allocator peak, or CPU tensor peak).
    pub peak_bytes: u64,
    /// Wall time of this process's part of the run, seconds.
    pub elapsed_s: f64,
    /// Samples seen (whole run).
    pub samples: u64,
    /// Tokens seen (whole run).
    pub tokens: u64,
}
