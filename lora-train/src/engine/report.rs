//! What a run did: [`TrainReport`].

use std::path::PathBuf;

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
    /// True when the run stopped because of [`crate::engine::request_stop`] (Ctrl-C in the CLI); the last
    /// checkpoint is [`TrainReport::last_checkpoint`].
    #[serde(default)]
    pub interrupted: bool,
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
