//! Hooks into the training loop: a [`Callback`] sees every step, epoch, checkpoint and event and
//! answers with a [`Control`] (continue, checkpoint now, stop). Progress bars and metric writers
//! are callbacks (`crate::engine::progress::ProgressBar` with the `progress` feature,
//! [`crate::engine::metrics::MetricsLogger`]).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::engine::error::Result;
use crate::engine::report::TrainReport;

/// What the loop should do after a callback returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Control {
    /// Keep training.
    #[default]
    Continue,
    /// Write a checkpoint now, then continue.
    Checkpoint,
    /// Stop after this step (a final checkpoint is written when checkpointing is on).
    Stop,
}

impl Control {
    /// Combines two answers: `Stop` beats `Checkpoint` beats `Continue`.
    pub fn merge(self, other: Control) -> Control {
        match (self, other) {
            (Control::Stop, _) | (_, Control::Stop) => Control::Stop,
            (Control::Checkpoint, _) | (_, Control::Checkpoint) => Control::Checkpoint,
            _ => Control::Continue,
        }
    }
}

/// Memory at the end of a step, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MemSnapshot {
    /// Live CPU tensor bytes (counting allocator; 0 when not installed).
    pub cpu_current_bytes: u64,
    /// Peak CPU tensor bytes since the run started.
    pub cpu_peak_bytes: u64,
    /// CUDA bytes held by tensors (training device), if on CUDA.
    pub cuda_allocated_bytes: Option<u64>,
    /// CUDA peak allocated bytes since the run started, if on CUDA.
    pub cuda_peak_bytes: Option<u64>,
    /// CUDA peak reserved bytes since the run started (the caching allocator's segments,
    /// `torch.cuda.max_memory_reserved`), if on CUDA (`null` on the CPU; missing in metrics files
    /// written before it existed, read as `None`).
    #[serde(default)]
    pub cuda_peak_reserved_bytes: Option<u64>,
}

impl MemSnapshot {
    /// The peak on the training device: CUDA peak when on CUDA, else the CPU peak.
    pub fn peak_bytes(&self) -> u64 {
        self.cuda_peak_bytes.unwrap_or(self.cpu_peak_bytes)
    }
}

/// What happened in one optimizer step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepInfo {
    /// Optimizer steps done after this one (1-based).
    pub step: u64,
    /// Planned optimizer steps of the run.
    pub total_steps: u64,
    /// Epoch (0-based).
    pub epoch: u64,
    /// Mean training loss of the step (over its micro-batches, sample-weighted).
    pub loss: f64,
    /// Learning rate used (base; groups multiply by their `lr_scale`).
    pub lr: f64,
    /// Global L2 norm of the gradients before clipping (`None` if the step was skipped before it
    /// was computed).
    pub grad_norm: Option<f64>,
    /// True when the update was skipped (non-finite loss/gradients, or fp16 overflow).
    pub skipped: bool,
    /// Loader batches per optimizer step (`gradient_accumulation_steps`).
    pub grad_accum: usize,
    /// Micro-batches each loader batch is split into (OOM back-off).
    pub micro_batch_split: usize,
    /// Samples in this step.
    pub samples: u64,
    /// Tokens in this step (0 when the task reports none).
    pub tokens: u64,
    /// Wall time of this step, seconds.
    pub step_time_s: f64,
    /// Optimizer steps per second (this step).
    pub it_per_s: f64,
    /// Tokens per second (this step).
    pub tokens_per_s: f64,
    /// Seconds since the run (or resume) started.
    pub elapsed_s: f64,
    /// Memory after the step.
    pub mem: MemSnapshot,
}

/// Notable events the loop reports besides steps.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TrainEvent {
    /// Out of memory: the step's tensors were dropped, the micro-batch halved and the step retried.
    OomBackoff {
        /// The step being retried (1-based).
        step: u64,
        /// The new split of each loader batch.
        micro_batch_split: usize,
        /// libtorch's message.
        message: String,
    },
    /// Non-finite loss or gradient norm.
    NonFinite {
        /// The step (1-based).
        step: u64,
        /// "loss" or "grad_norm".
        what: String,
        /// The value.
        value: f64,
        /// What the policy did ("skip", "lower_lr", "stop").
        action: String,
    },
    /// fp16 loss-scaler overflow: step skipped, scale lowered.
    ScalerOverflow {
        /// The step (1-based).
        step: u64,
        /// The new loss scale.
        scale: f64,
    },
    /// The run resumed from a checkpoint.
    Resumed {
        /// The step the checkpoint was taken after.
        step: u64,
        /// The checkpoint folder.
        path: String,
    },
    /// A checkpoint was not written (e.g. non-finite values).
    CheckpointRefused {
        /// The step.
        step: u64,
        /// Why.
        reason: String,
    },
}

/// A hook into the training loop. Every method has a default that does nothing.
pub trait Callback {
    /// Called once before the first step with the planned number of optimizer steps and the step
    /// the run starts from (non-zero after a resume).
    ///
    /// # Errors
    /// Stops the run with the error.
    fn on_start(&mut self, _total_steps: u64, _start_step: u64) -> Result<()> {
        Ok(())
    }
    /// Called after every optimizer step (skipped ones included).
    ///
    /// # Errors
    /// Stops the run with the error.
    fn on_step(&mut self, _info: &StepInfo) -> Result<Control> {
        Ok(Control::Continue)
    }
    /// Called at the end of each epoch (0-based), with the last step's info.
    ///
    /// # Errors
    /// Stops the run with the error.
    fn on_epoch(&mut self, _epoch: u64, _last: Option<&StepInfo>) -> Result<Control> {
        Ok(Control::Continue)
    }
    /// Called after a checkpoint was written.
    ///
    /// # Errors
    /// Stops the run with the error.
    fn on_checkpoint(&mut self, _step: u64, _path: &Path) -> Result<Control> {
        Ok(Control::Continue)
    }
    /// Called on OOM back-off, non-finite values, resume, refused checkpoints.
    ///
    /// # Errors
    /// Stops the run with the error.
    fn on_event(&mut self, _event: &TrainEvent) -> Result<()> {
        Ok(())
    }
    /// Called once when the run ends (normally or stopped).
    ///
    /// # Errors
    /// Reported as the run's error.
    fn on_end(&mut self, _report: &TrainReport) -> Result<()> {
        Ok(())
    }
}

/// Stops the run after a given optimizer step (e.g. to split a run in two).
#[derive(Debug, Clone, Copy)]
pub struct StopAfter(pub u64);

impl Callback for StopAfter {
    fn on_step(&mut self, info: &StepInfo) -> Result<Control> {
        Ok(if info.step >= self.0 {
            Control::Stop
        } else {
            Control::Continue
        })
    }
}

/// Stops the run when the training loss stops improving: after `patience` optimizer steps in
/// which its moving average did not fall below the best value so far by more than `min_delta`.
///
/// The average is exponential, `ema_t = β·ema_(t−1) + (1 − β)·loss_t` with `ema_1 = loss_1`
/// (default `β = 0.9`, about the last ten steps), so one noisy step neither stops nor extends the
/// run. Skipped steps (non-finite loss or gradients) are not counted. This is the rule of
/// Keras' and transformers' `EarlyStopping` (`patience`, `min_delta`), applied to the smoothed
/// training loss because the engine has no evaluation metric of its own; the run's
/// [`TrainReport::stopped_early`] says when it fired.
#[derive(Debug, Clone)]
pub struct EarlyStopping {
    patience: u64,
    min_delta: f64,
    beta: f64,
    ema: Option<f64>,
    best: f64,
    since_best: u64,
}

impl EarlyStopping {
    /// Stops after `patience` steps (at least 1) without improvement; `min_delta` 0, `β` 0.9.
    pub fn new(patience: u64) -> Self {
        Self {
            patience: patience.max(1),
            min_delta: 0.0,
            beta: 0.9,
            ema: None,
            best: f64::INFINITY,
            since_best: 0,
        }
    }

    /// The least fall of the averaged loss (in loss units) that counts as an improvement.
    pub fn with_min_delta(mut self, min_delta: f64) -> Self {
        self.min_delta = min_delta.max(0.0);
        self
    }

    /// The averaging factor `β` in `[0, 1)`; 0 compares raw step losses.
    pub fn with_smoothing(mut self, beta: f64) -> Self {
        self.beta = beta.clamp(0.0, 0.999);
        self
    }

    /// The smoothed loss after the last counted step (`None` before the first).
    pub fn smoothed_loss(&self) -> Option<f64> {
        self.ema
    }
}

impl Callback for EarlyStopping {
    fn on_start(&mut self, _total_steps: u64, _start_step: u64) -> Result<()> {
        self.ema = None;
        self.best = f64::INFINITY;
        self.since_best = 0;
        Ok(())
    }

    fn on_step(&mut self, info: &StepInfo) -> Result<Control> {
        if info.skipped || !info.loss.is_finite() {
            return Ok(Control::Continue);
        }
        let ema = match self.ema {
            None => info.loss,
            Some(prev) => self.beta * prev + (1.0 - self.beta) * info.loss,
        };
        self.ema = Some(ema);
        if ema < self.best - self.min_delta {
            self.best = ema;
            self.since_best = 0;
        } else {
            self.since_best += 1;
        }
        Ok(if self.since_best >= self.patience {
            Control::Stop
        } else {
            Control::Continue
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(n: u64, loss: f64) -> StepInfo {
        StepInfo {
            step: n,
            loss,
            ..StepInfo::default()
        }
    }

    /// Feeds `losses` and returns the 1-based step at which the callback said stop.
    fn stops_at(cb: &mut EarlyStopping, losses: &[f64]) -> Option<u64> {
        cb.on_start(losses.len() as u64, 0).unwrap();
        for (i, &l) in losses.iter().enumerate() {
            if cb.on_step(&step(i as u64 + 1, l)).unwrap() == Control::Stop {
                return Some(i as u64 + 1);
            }
        }
        None
    }

    #[test]
    fn early_stopping_waits_patience_steps_after_the_best() {
        // raw losses (β = 0): best 1.0 at step 3, then three steps without a fall
        let mut cb = EarlyStopping::new(3).with_smoothing(0.0);
        assert_eq!(
            stops_at(&mut cb, &[3.0, 2.0, 1.0, 1.0, 1.5, 1.2, 0.5]),
            Some(6)
        );
        // a fall smaller than min_delta does not count
        let mut cb = EarlyStopping::new(2)
            .with_smoothing(0.0)
            .with_min_delta(0.1);
        assert_eq!(stops_at(&mut cb, &[1.0, 0.95, 0.92, 0.5]), Some(3));
        // a loss that keeps falling never stops
        let mut cb = EarlyStopping::new(1).with_smoothing(0.0);
        assert_eq!(stops_at(&mut cb, &[4.0, 3.0, 2.0, 1.0]), None);
    }

    #[test]
    fn early_stopping_smooths_and_ignores_skipped_steps() {
        // β = 0.5: 2.0 → ema 2.0; 1.0 → 1.5; 3.0 (one bad step) → 2.25 (no improvement, 1);
        // 1.0 → 1.625 (no improvement, 2 = patience)
        let mut cb = EarlyStopping::new(2).with_smoothing(0.5);
        assert_eq!(stops_at(&mut cb, &[2.0, 1.0, 3.0, 1.0]), Some(4));
        assert_eq!(cb.smoothed_loss(), Some(1.625));
        // skipped and non-finite steps leave the state alone
        let mut cb = EarlyStopping::new(1).with_smoothing(0.0);
        cb.on_start(4, 0).unwrap();
        assert_eq!(cb.on_step(&step(1, 2.0)).unwrap(), Control::Continue);
        let mut skipped = step(2, 5.0);
        skipped.skipped = true;
        assert_eq!(cb.on_step(&skipped).unwrap(), Control::Continue);
        assert_eq!(cb.on_step(&step(3, f64::NAN)).unwrap(), Control::Continue);
        assert_eq!(cb.on_step(&step(4, 1.0)).unwrap(), Control::Continue);
        assert_eq!(cb.on_step(&step(5, 1.0)).unwrap(), Control::Stop);
    }

    #[test]
    fn control_merge_prefers_stop() {
        assert_eq!(
            Control::Continue.merge(Control::Checkpoint),
            Control::Checkpoint
        );
        assert_eq!(Control::Checkpoint.merge(Control::Stop), Control::Stop);
        assert_eq!(
            Control::Continue.merge(Control::Continue),
            Control::Continue
        );
    }

    #[test]
    fn mem_snapshot_carries_the_reserved_peak_and_reads_older_lines() {
        let m = MemSnapshot {
            cuda_allocated_bytes: Some(10),
            cuda_peak_bytes: Some(30),
            cuda_peak_reserved_bytes: Some(64),
            ..Default::default()
        };
        let v = serde_json::to_value(m).unwrap();
        assert_eq!(v["cuda_peak_reserved_bytes"], 64);
        assert_eq!(v["cuda_peak_bytes"], 30);
        assert_eq!(serde_json::from_value::<MemSnapshot>(v).unwrap(), m);
        // a CPU snapshot writes null
        let v = serde_json::to_value(MemSnapshot::default()).unwrap();
        assert!(v["cuda_peak_reserved_bytes"].is_null(), "{v}");
        // a metrics line written before the field existed
        let old = r#"{"cpu_current_bytes":1,"cpu_peak_bytes":2,"cuda_allocated_bytes":3,"cuda_peak_bytes":4}"#;
        let m: MemSnapshot = serde_json::from_str(old).unwrap();
        assert_eq!(
            (m.cuda_peak_bytes, m.cuda_peak_reserved_bytes),
            (Some(4), None)
        );
    }
}
