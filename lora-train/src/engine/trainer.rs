//! The training loop: [`TrainStep`] (the app's model and loss), [`BatchSource`] (its data) and
//! [`Trainer`] (accumulation, clipping, mixed precision, OOM back-off, NaN/Inf policy,
//! checkpoints, exact resume).

use std::path::{Path, PathBuf};
use std::time::Instant;

use lora_core::sys;
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::engine::callbacks::{Callback, Control, MemSnapshot, StepInfo, TrainEvent};
use crate::engine::checkpoint::{Checkpoint, CheckpointManager, TrainerCounters};
use crate::engine::error::{Result, TrainError};
use crate::engine::optim::{Optimizer, OptimizerKind, ParamGroup};
use crate::engine::precision::{GradScaler, Precision};
use crate::engine::report::TrainReport;
use crate::engine::sched::{Scheduler, SchedulerKind};
use crate::engine::stop::stop_requested;

/// The application side of training: the model's loss on a batch and its trainable tensors.
///
/// The trainer owns the loop; the app owns the model. `loss` runs the forward pass (the trainer
/// wraps it in autocast when mixed precision is on) and returns a 0-d loss tensor, the mean over
/// the batch's samples (or tokens).
pub trait TrainStep {
    /// One batch as the loader produces it (e.g. token ids `[batch, seq]` and labels).
    type Batch;

    /// The mean loss of `batch` as a 0-d tensor attached to the autograd graph.
    /// `train` is true during training (dropout on).
    ///
    /// # Errors
    /// Any libtorch error; out-of-memory errors must be returned (through tch's `f_*`
    /// functions), not panics, for the OOM back-off to work.
    fn loss(&mut self, batch: &Self::Batch, train: bool) -> Result<Tensor>;

    /// The trainable tensors by stable name (e.g. PEFT keys). Checkpoints save and restore these;
    /// the names must be identical across runs.
    fn named_trainable(&self) -> Vec<(String, Tensor)>;

    /// Parameter groups for the optimizer (default: one group of all trainable tensors). Use
    /// [`crate::engine::optim::lora_plus_groups`] for LoRA+.
    fn param_groups(&self) -> Vec<ParamGroup> {
        vec![ParamGroup::new(
            "adapters",
            self.named_trainable().into_iter().map(|(_, t)| t).collect(),
        )]
    }

    /// Number of samples in `batch` (the micro-batch size).
    fn micro_batch_len(&self, batch: &Self::Batch) -> usize;

    /// Splits `batch` into `parts` smaller batches, in order, covering every sample once (used to
    /// halve the micro-batch after an out-of-memory error). `parts` never exceeds
    /// `micro_batch_len(batch)`.
    ///
    /// # Errors
    /// The default returns an error: OOM back-off then stops the run.
    fn split_batch(&self, batch: &Self::Batch, parts: usize) -> Result<Vec<Self::Batch>> {
        let _ = (batch, parts);
        Err(TrainError::App(
            "this TrainStep cannot split batches (implement split_batch for OOM back-off)".into(),
        ))
    }

    /// Tokens in `batch`, for tokens/s (default 0).
    fn batch_tokens(&self, _batch: &Self::Batch) -> u64 {
        0
    }

    /// Computes the loss of `batch` **and** backpropagates `loss · scale` itself, returning the
    /// unscaled loss (0-d, detached); `None` (the default) lets the trainer call
    /// [`TrainStep::loss`] and backpropagate.
    ///
    /// Implement it when the backward pass is not a plain `loss.backward()`, e.g. activation
    /// (gradient) checkpointing that recomputes segments during backward
    /// (`lora_models::llama::Llama::loss_backward`). `scale` is the micro-batch's share of the
    /// effective batch (`len / total` over gradient accumulation) times the fp16 loss scale.
    /// The trainer still checks the returned loss for NaN/Inf (gradients of a non-finite loss are
    /// discarded by the next `zero_grad`).
    ///
    /// # Errors
    /// As [`TrainStep::loss`].
    fn loss_backward(&mut self, batch: &Self::Batch, scale: f64) -> Result<Option<Tensor>> {
        let _ = (batch, scale);
        Ok(None)
    }
}

/// Where batches come from: a resumable, epoch-based loader (e.g. `lora_data`'s loader).
pub trait BatchSource<B> {
    /// Starts epoch `epoch` (0-based): reshuffle, rewind.
    ///
    /// # Errors
    /// Loader errors.
    fn start_epoch(&mut self, epoch: u64) -> Result<()>;
    /// The next batch of the current epoch, or `None` at its end.
    ///
    /// # Errors
    /// Loader errors.
    fn next_batch(&mut self) -> Result<Option<B>>;
    /// Batches per epoch, if known (needed when no `max_steps` is set).
    fn batches_per_epoch(&self) -> Option<u64>;
    /// The position to checkpoint (opaque JSON): after `load_state` the loader must yield exactly
    /// the batches it would have yielded next.
    fn state(&self) -> serde_json::Value;
    /// Restores a position from [`BatchSource::state`].
    ///
    /// # Errors
    /// A state from another dataset or loader configuration.
    fn load_state(&mut self, state: &serde_json::Value) -> Result<()>;
}

/// What to do when the loss or the gradient norm is NaN/Inf.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "policy", deny_unknown_fields)]
pub enum NonFinitePolicy {
    /// Skip the update (the step still counts).
    Skip,
    /// Skip the update and multiply the learning rate by `factor` for the rest of the run.
    LowerLr {
        /// Multiplier, in (0, 1) ([`NonFinitePolicy::LOWER_LR_FACTOR`] when not written).
        #[serde(default = "lower_lr_factor")]
        factor: f64,
    },
    /// Stop with [`TrainError::NonFinite`].
    Stop,
}

fn lower_lr_factor() -> f64 {
    NonFinitePolicy::LOWER_LR_FACTOR
}

impl NonFinitePolicy {
    /// The learning-rate factor of `lower_lr` when a name gives none (halve it).
    pub const LOWER_LR_FACTOR: f64 = 0.5;

    /// The policy's `nan_policy` name (`skip`, `lower_lr`, `stop`), without its factor.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::LowerLr { .. } => "lower_lr",
            Self::Stop => "stop",
        }
    }

    /// Checks the policy's arguments: a `lower_lr` factor in (0, 1).
    ///
    /// # Errors
    /// [`TrainError::Invalid`] naming the factor.
    pub fn validate(&self) -> Result<()> {
        match self {
            Self::LowerLr { factor } if !(*factor > 0.0 && *factor < 1.0) => {
                Err(TrainError::Invalid {
                    what: "nan_policy lower_lr factor".into(),
                    value: factor.to_string(),
                    hint: "use a value in (0, 1), e.g. 0.5".into(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Parses `nan_policy` names: `skip`, `lower_lr` (factor [`Self::LOWER_LR_FACTOR`]), `stop`.
    ///
    /// # Errors
    /// [`TrainError::Invalid`] for another name, listing the accepted ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "skip" => Self::Skip,
            "lower_lr" => Self::LowerLr {
                factor: Self::LOWER_LR_FACTOR,
            },
            "stop" => Self::Stop,
            _ => {
                return Err(TrainError::Invalid {
                    what: "nan_policy".into(),
                    value: name.into(),
                    hint: "use one of \"skip\", \"lower_lr\", \"stop\"".into(),
                });
            }
        })
    }
}

impl Default for NonFinitePolicy {
    /// [`NonFinitePolicy::Skip`], the config's `train.nan_policy` default.
    fn default() -> Self {
        NonFinitePolicy::Skip
    }
}

/// The counting allocator's block cache for the span of one `fit` ([`TrainerConfig::cpu_cache`]):
/// the first `fit` of the process to start empties it (the bound restarts from what is live
/// after loading) and switches it on; the last one to end switches it off, which frees what it
/// holds. The cache is one per process, so `fit`s running at once on other threads share it.
struct CpuCacheGuard;

/// How many [`CpuCacheGuard`]s are alive.
static CPU_CACHE_USERS: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

impl CpuCacheGuard {
    fn start() -> Result<Self> {
        let mut users = CPU_CACHE_USERS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if *users == 0 {
            sys::cpu_empty_cache()?;
            sys::set_cpu_cache(true)?;
        }
        *users += 1;
        Ok(Self)
    }
}

impl Drop for CpuCacheGuard {
    fn drop(&mut self) {
        let mut users = CPU_CACHE_USERS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *users = users.saturating_sub(1);
        if *users == 0 {
            let _ = sys::set_cpu_cache(false);
        }
    }
}

/// Which checkpoint a run starts from.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Resume {
    /// Start fresh.
    #[default]
    No,
    /// The newest checkpoint in `checkpoint_dir`, or fresh when there is none.
    Latest,
    /// A given checkpoint folder.
    From(PathBuf),
}

/// Settings of the training loop. Field names follow the field (kohya / transformers).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainerConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Optimizer and its hyper-parameters.
    pub optimizer: OptimizerKind,
    /// Learning-rate schedule.
    pub scheduler: SchedulerKind,
    /// Warm-up steps of the schedule (`lr_warmup_steps`).
    pub warmup_steps: u64,
    /// Epochs (`max_train_epochs`). With `max_steps` too, the run ends at whichever comes
    /// first: `max_steps: Some(80)` over an 8-step epoch trains 8 steps unless `epochs` is at
    /// least 10 (the config's `train.max_steps` wins because the recipes raise `epochs` to
    /// cover it). With a loader of unknown length only `max_steps` counts.
    pub epochs: u64,
    /// Stop after this many optimizer steps (`max_train_steps`), or earlier when `epochs` run
    /// out (see [`TrainerConfig::epochs`]).
    pub max_steps: Option<u64>,
    /// Loader batches per optimizer step (`gradient_accumulation_steps`).
    pub gradient_accumulation_steps: usize,
    /// Clip the global gradient L2 norm to this value (`max_grad_norm`; `None` = no clipping).
    pub max_grad_norm: Option<f64>,
    /// Mixed precision.
    pub precision: Precision,
    /// Training device (where the model lives).
    #[serde(skip, default = "default_device")]
    pub device: Device,
    /// NaN/Inf policy.
    pub non_finite: NonFinitePolicy,
    /// Halve the micro-batch and retry after an out-of-memory error.
    pub oom_backoff: bool,
    /// Largest split of a loader batch the OOM back-off may reach.
    pub max_micro_batch_split: usize,
    /// Checkpoint folder (`None` = no checkpoints).
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N optimizer steps (`save_every_n_steps`).
    pub save_every_n_steps: Option<u64>,
    /// Checkpoint every N epochs (`save_every_n_epochs`).
    pub save_every_n_epochs: Option<u64>,
    /// Checkpoints to keep.
    pub keep_last: usize,
    /// Seed for libtorch's generators at the start of a fresh run (`system.seed`).
    pub seed: Option<u64>,
    /// Install the counting CPU allocator to report exact CPU tensor memory.
    pub track_cpu_memory: bool,
    /// On a CPU run with `track_cpu_memory`, keep freed tensor blocks of 128 KiB or more for
    /// reuse by the next steps ([`lora_core::sys::set_cpu_cache`]; bounded by the step's live
    /// peak, emptied and switched off when `fit` returns), so a step does not fault its
    /// activations' pages in afresh every time. Default true.
    pub cpu_cache: bool,
    /// The run's configuration as JSON, stored in checkpoints.
    pub run_config: serde_json::Value,
}

fn default_device() -> Device {
    Device::Cpu
}

impl Default for TrainerConfig {
    fn default() -> Self {
        Self {
            lr: 1e-4,
            optimizer: OptimizerKind::default(),
            scheduler: SchedulerKind::default(),
            warmup_steps: 0,
            epochs: 1,
            max_steps: None,
            gradient_accumulation_steps: 1,
            max_grad_norm: Some(1.0),
            precision: Precision::Fp32,
            device: Device::Cpu,
            non_finite: NonFinitePolicy::default(),
            oom_backoff: true,
            max_micro_batch_split: 64,
            checkpoint_dir: None,
            save_every_n_steps: None,
            save_every_n_epochs: None,
            keep_last: 3,
            seed: None,
            track_cpu_memory: true,
            cpu_cache: true,
            run_config: serde_json::Value::Null,
        }
    }
}

impl TrainerConfig {
    fn validate(&self) -> Result<()> {
        let bad = |what: &str, value: String, hint: &str| {
            Err(TrainError::Invalid {
                what: what.into(),
                value,
                hint: hint.into(),
            })
        };
        if self.gradient_accumulation_steps == 0 {
            return bad("gradient_accumulation_steps", "0".into(), "use 1 or more");
        }
        if let Some(m) = self.max_grad_norm
            && !(m > 0.0 && m.is_finite())
        {
            return bad(
                "max_grad_norm",
                m.to_string(),
                "use a positive value or leave it unset",
            );
        }
        self.non_finite.validate()?;
        self.scheduler.validate()?;
        if self.epochs == 0 && self.max_steps.is_none() {
            return bad("epochs", "0".into(), "set epochs >= 1 or max_steps");
        }
        self.precision.check_device(self.device)
    }
}

enum StepOutcome {
    Done {
        loss: f64,
        samples: u64,
        tokens: u64,
    },
    NonFiniteLoss {
        value: f64,
        samples: u64,
        tokens: u64,
    },
}

/// The training loop over a [`TrainStep`].
///
/// ```no_run
/// # use lora_train::engine::*;
/// # fn run<S: TrainStep>(mut task: S, mut data: impl BatchSource<S::Batch>) -> Result<()> {
/// let cfg = TrainerConfig { lr: 2e-4, epochs: 3, gradient_accumulation_steps: 4, ..Default::default() };
/// let mut trainer: Trainer<S> = Trainer::new(cfg);
/// trainer.add_callback(Box::new(lora_train::engine::progress::ProgressBar::new()));
/// let report = trainer.fit(&mut task, &mut data, Resume::Latest)?;
/// println!("final loss {:?}", report.final_loss);
/// # Ok(()) }
/// ```
pub struct Trainer<S: TrainStep> {
    cfg: TrainerConfig,
    callbacks: Vec<Box<dyn Callback>>,
    grad_sync: Option<Box<dyn super::dist::GradSync>>,
    _task: std::marker::PhantomData<fn(&mut S)>,
}

impl<S: TrainStep> std::fmt::Debug for Trainer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("cfg", &self.cfg)
            .field("callbacks", &self.callbacks.len())
            .finish()
    }
}

struct Run<'a> {
    opt: Box<dyn Optimizer>,
    sched: Scheduler,
    scaler: Option<GradScaler>,
    counters: TrainerCounters,
    ckpt: Option<CheckpointManager>,
    last_saved: Option<u64>,
    report: TrainReport,
    params: Vec<Tensor>,
    cfg: &'a TrainerConfig,
}

fn emit(callbacks: &mut [Box<dyn Callback>], ev: &TrainEvent) -> Result<()> {
    for c in callbacks.iter_mut() {
        c.on_event(ev)?;
    }
    Ok(())
}

fn mem_snapshot(device: Device, track_cpu: bool) -> MemSnapshot {
    let mut m = MemSnapshot::default();
    if track_cpu && let Ok(s) = sys::cpu_mem_stats() {
        m.cpu_current_bytes = s.current_bytes;
        m.cpu_peak_bytes = s.peak_bytes;
    }
    if let Device::Cuda(i) = device
        && let Ok(Some(s)) = sys::cuda_mem_stats(i)
    {
        m.cuda_allocated_bytes = Some(s.allocated_bytes);
        m.cuda_peak_bytes = Some(s.peak_allocated_bytes);
        m.cuda_peak_reserved_bytes = Some(s.peak_reserved_bytes);
    }
    m
}

/// Global L2 norm of the defined gradients of `params` (fp32), like `clip_grad_norm_`.
///
/// # Errors
/// A libtorch error.
pub fn global_grad_norm(params: &[Tensor]) -> Result<f64> {
    let _ng = tch::no_grad_guard();
    let _threads = crate::engine::optim::CpuStepThreads::for_params(params);
    let mut norms = Vec::new();
    for p in params {
        let g = p.f_grad()?;
        if g.defined() {
            norms.push(g.f_to_kind(Kind::Float)?.f_norm()?);
        }
    }
    if norms.is_empty() {
        return Ok(0.0);
    }
    Ok(Tensor::f_stack(&norms, 0)?.f_norm()?.f_double_value(&[])?)
}

/// Scales gradients so their global norm is at most `max_norm` (`torch.nn.utils.clip_grad_norm_`:
/// coefficient `max_norm / (norm + 1e-6)`, applied only when below 1).
///
/// # Errors
/// A libtorch error.
pub fn clip_grads(params: &[Tensor], norm: f64, max_norm: f64) -> Result<()> {
    let coef = max_norm / (norm + 1e-6);
    if coef >= 1.0 {
        return Ok(());
    }
    let _ng = tch::no_grad_guard();
    let _threads = crate::engine::optim::CpuStepThreads::for_params(params);
    for p in params {
        let mut g = p.f_grad()?;
        if g.defined() {
            let _ = g.f_mul_scalar_(coef)?;
        }
    }
    Ok(())
}

impl<S: TrainStep> Trainer<S> {
    /// A trainer with `cfg` and no callbacks.
    pub fn new(cfg: TrainerConfig) -> Self {
        Self {
            cfg,
            callbacks: Vec::new(),
            grad_sync: None,
            _task: std::marker::PhantomData,
        }
    }

    /// Trains data-parallel: every rank starts from rank 0's trainable parameters, and before
    /// each optimizer step the gradients are averaged over the ranks through `sync` (a
    /// non-finite loss on any rank skips the step on all). Give each rank its own shard of the
    /// batches (`LoaderConfig::num_replicas` / `rank`) and let one rank write checkpoints.
    pub fn set_grad_sync(&mut self, sync: Box<dyn super::dist::GradSync>) -> &mut Self {
        self.grad_sync = Some(sync);
        self
    }

    /// Adds a callback (called in the order added).
    pub fn add_callback(&mut self, cb: Box<dyn Callback>) -> &mut Self {
        self.callbacks.push(cb);
        self
    }

    /// The settings.
    pub fn config(&self) -> &TrainerConfig {
        &self.cfg
    }

    /// Planned optimizer steps for `data`.
    ///
    /// # Errors
    /// Neither `max_steps` nor a known epoch length.
    pub fn total_steps<B>(&self, data: &dyn BatchSource<B>) -> Result<u64> {
        let per_epoch = data
            .batches_per_epoch()
            .map(|b| b.div_ceil(self.cfg.gradient_accumulation_steps as u64));
        match (self.cfg.max_steps, per_epoch) {
            (Some(m), Some(p)) => Ok(m.min(p.saturating_mul(self.cfg.epochs.max(1)))),
            (Some(m), None) => Ok(m),
            (None, Some(p)) => Ok(p.saturating_mul(self.cfg.epochs)),
            (None, None) => Err(TrainError::Invalid {
                what: "max_steps".into(),
                value: "unset".into(),
                hint: "the loader does not know its length; set max_steps (max_train_steps)".into(),
            }),
        }
    }

    /// Trains `task` on `data` until the planned steps are done or a callback stops the run.
    ///
    /// # Errors
    /// Invalid settings, a non-finite loss under the `Stop` policy, OOM even at one sample per
    /// micro-batch, checkpoint I/O errors, or errors from the task, loader or callbacks.
    pub fn fit(
        &mut self,
        task: &mut S,
        data: &mut dyn BatchSource<S::Batch>,
        resume: Resume,
    ) -> Result<TrainReport> {
        self.cfg.validate()?;
        let cfg = self.cfg.clone();
        let started = Instant::now();
        if cfg.track_cpu_memory {
            sys::install_counting_cpu_allocator()?;
            sys::cpu_reset_peak()?;
        }
        let _cache = (cfg.track_cpu_memory && cfg.cpu_cache && cfg.device == Device::Cpu)
            .then(CpuCacheGuard::start)
            .transpose()?;
        if let Device::Cuda(i) = cfg.device {
            let _ = sys::cuda_reset_peak(i)?;
        }
        let total = self.total_steps(data)?;
        let world_size = self.grad_sync.as_ref().map_or(1, |s| s.world_size()).max(1);
        let opt = cfg.optimizer.build(task.param_groups(), cfg.lr)?;
        let params = opt.params();
        let mut run = Run {
            params,
            opt,
            sched: Scheduler::new(cfg.scheduler.clone(), cfg.lr, cfg.warmup_steps, total)?,
            scaler: if cfg.precision.uses_loss_scaling() {
                Some(GradScaler::new(cfg.device)?)
            } else {
                None
            },
            counters: TrainerCounters {
                micro_batch_split: 1,
                lr_factor: 1.0,
                world_size: world_size as u64,
                global_batches_per_step: (cfg.gradient_accumulation_steps * world_size) as u64,
                ..Default::default()
            },
            ckpt: cfg
                .checkpoint_dir
                .as_ref()
                .map(|d| CheckpointManager::new(d, cfg.keep_last)),
            last_saved: None,
            report: TrainReport::default(),
            cfg: &cfg,
        };
        let resume_from = match resume {
            Resume::No => None,
            Resume::From(p) => {
                if !p.is_dir() {
                    return Err(TrainError::Invalid {
                        what: "resume".into(),
                        value: p.display().to_string(),
                        hint:
                            "no checkpoint folder there; pass one of the step-* folders under the \
                               run's checkpoints/ folder, or --resume alone for the newest"
                                .into(),
                    });
                }
                Some(p)
            }
            Resume::Latest => match &run.ckpt {
                Some(m) => m.latest()?,
                None => {
                    return Err(TrainError::Invalid {
                        what: "resume".into(),
                        value: "latest".into(),
                        hint: "set checkpoint_dir to resume from its newest checkpoint".into(),
                    });
                }
            },
        };
        match resume_from {
            Some(path) => self.restore(&path, task, data, &mut run)?,
            None => {
                if let Some(seed) = cfg.seed {
                    sys::manual_seed(seed)?;
                }
            }
        }
        if let Some(sync) = self.grad_sync.as_mut() {
            sync.broadcast_parameters(&run.params)?;
        }
        for c in self.callbacks.iter_mut() {
            c.on_start(total, run.counters.step)?;
        }
        let mut last_info: Option<StepInfo> = None;
        let mut stop = false;
        if stop_requested() {
            // Interrupted while restoring or before the first step: nothing new to save.
            stop = true;
            run.report.interrupted = true;
            run.report.stopped_early = run.counters.step < total;
        }
        while !stop
            && run.counters.step < total
            && (run.counters.epoch < cfg.epochs || cfg.max_steps.is_some())
        {
            if run.counters.batches_in_epoch == 0 {
                data.start_epoch(run.counters.epoch)?;
            }
            let mut epoch_ended = false;
            while run.counters.step < total {
                let mut batches = Vec::with_capacity(cfg.gradient_accumulation_steps);
                while batches.len() < cfg.gradient_accumulation_steps {
                    match data.next_batch()? {
                        Some(b) => batches.push(b),
                        None => break,
                    }
                }
                if batches.is_empty() {
                    epoch_ended = true;
                    break;
                }
                run.counters.batches_in_epoch += batches.len() as u64;
                let info = self.one_step(task, &batches, &mut run, total, started)?;
                drop(batches);
                let mut control = Control::Continue;
                for c in self.callbacks.iter_mut() {
                    control = control.merge(c.on_step(&info)?);
                }
                let mut stop_now = stop_requested();
                if let Some(sync) = self.grad_sync.as_mut() {
                    // every rank stops at the same step, or one would wait for the others at
                    // the next collective: a signal on any rank is an interruption on all of
                    // them; a callback's stop on any rank (early stopping on rank 0's
                    // evaluation, …) is a stop on all of them, not an interruption
                    let votes = sync.any_rank(&[stop_now, control == Control::Stop])?;
                    if votes.first() == Some(&true) {
                        stop_now = true;
                    } else if votes.get(1) == Some(&true) {
                        control = Control::Stop;
                    }
                }
                if stop_now && run.counters.step < total {
                    run.report.interrupted = true;
                    control = Control::Stop;
                }
                last_info = Some(info);
                let every = cfg
                    .save_every_n_steps
                    .is_some_and(|n| n > 0 && run.counters.step % n == 0);
                if every || control != Control::Continue {
                    self.checkpoint(task, data, &mut run)?;
                }
                if control == Control::Stop {
                    stop = true;
                    run.report.stopped_early = run.counters.step < total;
                    break;
                }
            }
            if stop {
                break;
            }
            if !epoch_ended && data.batches_per_epoch() != Some(run.counters.batches_in_epoch) {
                // Reached the planned steps mid-epoch.
                break;
            }
            let finished_epoch = run.counters.epoch;
            run.counters.epoch += 1;
            run.counters.batches_in_epoch = 0;
            run.report.epochs = run.counters.epoch;
            let mut control = Control::Continue;
            for c in self.callbacks.iter_mut() {
                control = control.merge(c.on_epoch(finished_epoch, last_info.as_ref())?);
            }
            let every = cfg
                .save_every_n_epochs
                .is_some_and(|n| n > 0 && run.counters.epoch % n == 0);
            if every || control != Control::Continue {
                self.checkpoint(task, data, &mut run)?;
            }
            if control == Control::Stop {
                run.report.stopped_early = run.counters.step < total;
                break;
            }
            if cfg.max_steps.is_none() && run.counters.epoch >= cfg.epochs {
                break;
            }
        }
        if run.ckpt.is_some() && run.last_saved != Some(run.counters.step) && run.counters.step > 0
        {
            self.checkpoint(task, data, &mut run)?;
        }
        let mut report = std::mem::take(&mut run.report);
        report.steps = run.counters.step;
        // a run whose last checkpoint closed an epoch (a resume with no step left) counts that
        // epoch, as the run that wrote it did
        report.epochs = run.counters.epoch
            + u64::from(
                run.counters.batches_in_epoch > 0
                    && data.batches_per_epoch() == Some(run.counters.batches_in_epoch),
            );
        report.skipped_steps = run.counters.skipped_steps;
        report.oom_backoffs = run.counters.oom_backoffs;
        report.micro_batch_split = run.counters.micro_batch_split;
        report.samples = run.counters.samples;
        report.tokens = run.counters.tokens;
        report.elapsed_s = started.elapsed().as_secs_f64();
        report.peak_bytes = mem_snapshot(cfg.device, cfg.track_cpu_memory).peak_bytes();
        for c in self.callbacks.iter_mut() {
            c.on_end(&report)?;
        }
        Ok(report)
    }

    fn restore(
        &mut self,
        path: &Path,
        task: &mut S,
        data: &mut dyn BatchSource<S::Batch>,
        run: &mut Run<'_>,
    ) -> Result<()> {
        let ck = Checkpoint::read_from(path)?;
        {
            let _ng = tch::no_grad_guard();
            for (name, t) in task.named_trainable() {
                let src = ck.adapter.iter().find(|(n, _)| *n == name).map(|(_, t)| t).ok_or_else(|| {
                    TrainError::State {
                        what: "checkpoint".into(),
                        message: format!("`{}` has no tensor `{name}`; was it written by another model or LoRA config?", path.display()),
                    }
                })?;
                if src.size() != t.size() {
                    return Err(TrainError::State {
                        what: "checkpoint".into(),
                        message: format!(
                            "`{name}` is {:?} in `{}` but {:?} here",
                            src.size(),
                            path.display(),
                            t.size()
                        ),
                    });
                }
                let mut dst = t.shallow_clone();
                dst.f_copy_(&src.f_to_device(t.device())?.f_to_kind(t.kind())?)?;
            }
        }
        run.opt.load_state_dict(&ck.optimizer)?;
        run.counters = ck.counters.clone();
        // a checkpoint of another world size: its position, in the new ranks' batches
        let world_size = self.grad_sync.as_ref().map_or(1, |s| s.world_size());
        run.counters
            .remap_world_size(world_size, self.cfg.gradient_accumulation_steps)?;
        if run.counters.micro_batch_split == 0 {
            run.counters.micro_batch_split = 1;
        }
        // each rank its own generator state when the checkpoint has one per rank of this world
        // size (rank 0's otherwise: a single-process checkpoint, or another world size)
        let rank = self.grad_sync.as_ref().map_or(0, |s| s.rank());
        let own = |ranks: &[Vec<u8>]| {
            if ranks.len() == world_size {
                ranks.get(rank).cloned()
            } else {
                None
            }
        };
        let cpu = own(&ck.rng_cpu_ranks).unwrap_or_else(|| ck.rng_cpu.clone());
        sys::set_rng_state(Device::Cpu, &cpu)?;
        if let Device::Cuda(i) = self.cfg.device
            && let Some(st) = own(&ck.rng_cuda_ranks).or_else(|| ck.rng_cuda.clone())
        {
            sys::set_rng_state(Device::Cuda(i), &st)?;
        }
        if let (Some(s), Some(st)) = (run.scaler.as_mut(), ck.scaler) {
            s.load_state(st)?;
        }
        data.load_state(&ck.loader)?;
        run.last_saved = Some(run.counters.step);
        run.report.resumed_from = Some(run.counters.step);
        run.report.last_checkpoint = Some(path.to_path_buf());
        emit(
            &mut self.callbacks,
            &TrainEvent::Resumed {
                step: run.counters.step,
                path: path.display().to_string(),
            },
        )
    }

    fn checkpoint(
        &mut self,
        task: &S,
        data: &dyn BatchSource<S::Batch>,
        run: &mut Run<'_>,
    ) -> Result<()> {
        let Some(mgr) = run.ckpt.clone() else {
            return Ok(());
        };
        let rng_cpu = sys::rng_state(Device::Cpu)?;
        let rng_cuda = match self.cfg.device {
            Device::Cuda(i) => Some(sys::rng_state(Device::Cuda(i))?),
            _ => None,
        };
        // data-parallel: every rank's generator states go to the writer (a collective, so every
        // rank takes part); one rank writes what every rank holds
        let (mut rng_cpu_ranks, mut rng_cuda_ranks) = (Vec::new(), Vec::new());
        if let Some(sync) = self.grad_sync.as_mut() {
            rng_cpu_ranks = sync.gather_bytes(&rng_cpu)?;
            if let Some(st) = &rng_cuda {
                rng_cuda_ranks = sync.gather_bytes(st)?;
            }
            if !sync.writes_checkpoints() {
                run.last_saved = Some(run.counters.step);
                return Ok(());
            }
        }
        let ck = Checkpoint {
            adapter: task.named_trainable(),
            optimizer: run.opt.state_dict()?,
            scheduler: Some(run.sched.clone()),
            counters: run.counters.clone(),
            rng_cpu,
            rng_cuda,
            rng_cpu_ranks,
            rng_cuda_ranks,
            loader: data.state(),
            config: self.cfg.run_config.clone(),
            scaler: run.scaler.as_ref().map(|s| s.state()).transpose()?,
        };
        match mgr.save(&ck) {
            Ok(path) => {
                run.last_saved = Some(run.counters.step);
                run.report.last_checkpoint = Some(path.clone());
                for c in self.callbacks.iter_mut() {
                    // A checkpoint callback's Control is advisory only.
                    let _ = c.on_checkpoint(run.counters.step, &path)?;
                }
                Ok(())
            }
            Err(TrainError::State { message, .. }) if message.contains("NaN/Inf") => {
                run.last_saved = Some(run.counters.step);
                emit(
                    &mut self.callbacks,
                    &TrainEvent::CheckpointRefused {
                        step: run.counters.step,
                        reason: message,
                    },
                )
            }
            Err(e) => Err(e),
        }
    }

    fn forward_backward(
        &self,
        task: &mut S,
        batches: &[S::Batch],
        split: usize,
        scaler: Option<&GradScaler>,
    ) -> Result<StepOutcome> {
        let lens: Vec<usize> = batches.iter().map(|b| task.micro_batch_len(b)).collect();
        let total_len: usize = lens.iter().sum();
        let samples = total_len as u64;
        let tokens: u64 = batches.iter().map(|b| task.batch_tokens(b)).sum();
        let n_pieces = batches.len() * split;
        let mut loss_sum = 0.0;
        // The fp16 loss scale is fixed within a step: read it (a device sync) once, not per piece.
        let fp16_scale = match scaler {
            Some(s) => s.scale_value()?,
            None => 1.0,
        };
        for b in batches {
            let pieces = if split > 1 {
                Some(task.split_batch(b, split)?)
            } else {
                None
            };
            let list: Vec<&S::Batch> = match &pieces {
                Some(p) => p.iter().collect(),
                None => vec![b],
            };
            for piece in list {
                let w = if total_len > 0 {
                    task.micro_batch_len(piece) as f64 / total_len as f64
                } else {
                    1.0 / n_pieces as f64
                };
                let loss_scale = w * fp16_scale;
                let own = {
                    let _ac = self.cfg.precision.autocast(self.cfg.device)?;
                    task.loss_backward(piece, loss_scale)?
                };
                if let Some(loss) = own {
                    let lv = loss.f_double_value(&[])?;
                    if !lv.is_finite() {
                        return Ok(StepOutcome::NonFiniteLoss {
                            value: lv,
                            samples,
                            tokens,
                        });
                    }
                    loss_sum += lv * w;
                    continue;
                }
                let loss = {
                    let _ac = self.cfg.precision.autocast(self.cfg.device)?;
                    task.loss(piece, true)?
                };
                let lv = loss.f_double_value(&[])?;
                if !lv.is_finite() {
                    return Ok(StepOutcome::NonFiniteLoss {
                        value: lv,
                        samples,
                        tokens,
                    });
                }
                let mut scaled = loss.f_to_kind(Kind::Float)?.f_mul_scalar(w)?;
                if let Some(s) = scaler {
                    scaled = s.scale_loss(&scaled)?;
                }
                scaled.f_backward()?;
                loss_sum += lv * w;
            }
        }
        Ok(StepOutcome::Done {
            loss: loss_sum,
            samples,
            tokens,
        })
    }

    fn one_step(
        &mut self,
        task: &mut S,
        batches: &[S::Batch],
        run: &mut Run<'_>,
        total: u64,
        started: Instant,
    ) -> Result<StepInfo> {
        let t0 = Instant::now();
        let step_no = run.counters.step + 1;
        let outcome = loop {
            run.opt.zero_grad()?;
            // catch_oom: an allocation failure inside a tch op that takes a Scalar surfaces as
            // a panic (see lora_core::oom); it takes the same back-off path as any OOM error.
            let split = run.counters.micro_batch_split;
            let scaler = run.scaler.as_ref();
            match lora_core::oom::catch_oom(|| self.forward_backward(task, batches, split, scaler))
            {
                Ok(o) => break o,
                Err(e) if e.is_oom() && run.cfg.oom_backoff => {
                    run.opt.zero_grad()?;
                    let _ = sys::cuda_empty_cache();
                    let min_len = batches
                        .iter()
                        .map(|b| task.micro_batch_len(b))
                        .min()
                        .unwrap_or(1);
                    let next = run.counters.micro_batch_split * 2;
                    if next > min_len || next > run.cfg.max_micro_batch_split {
                        return Err(TrainError::OutOfMemory {
                            step: step_no,
                            micro_batch: min_len / run.counters.micro_batch_split.max(1),
                            message: e.to_string(),
                        });
                    }
                    run.counters.micro_batch_split = next;
                    run.counters.oom_backoffs += 1;
                    emit(
                        &mut self.callbacks,
                        &TrainEvent::OomBackoff {
                            step: step_no,
                            micro_batch_split: next,
                            message: e.to_string(),
                        },
                    )?;
                }
                Err(e) => return Err(e),
            }
        };
        let outcome = match self.grad_sync.as_mut() {
            Some(sync) => {
                let skip = matches!(outcome, StepOutcome::NonFiniteLoss { .. });
                match (sync.sync_gradients(&run.params, skip)?, outcome) {
                    // another rank's loss was not finite: skip here too, as the policy says
                    (
                        true,
                        StepOutcome::Done {
                            samples, tokens, ..
                        },
                    ) => StepOutcome::NonFiniteLoss {
                        value: f64::NAN,
                        samples,
                        tokens,
                    },
                    (_, o) => o,
                }
            }
            None => outcome,
        };
        let lr = run.sched.lr_at(run.counters.step) * run.counters.lr_factor;
        let (loss, samples, tokens, grad_norm, skipped) = match outcome {
            StepOutcome::NonFiniteLoss {
                value,
                samples,
                tokens,
            } => {
                self.non_finite(run, step_no, "loss", value)?;
                (value, samples, tokens, None, true)
            }
            StepOutcome::Done {
                loss,
                samples,
                tokens,
            } => {
                let mut overflow = false;
                if let Some(s) = run.scaler.as_mut() {
                    overflow = s.unscale(&run.params)?;
                    if overflow {
                        s.update(true)?;
                        let scale = s.scale_value()?;
                        emit(
                            &mut self.callbacks,
                            &TrainEvent::ScalerOverflow {
                                step: step_no,
                                scale,
                            },
                        )?;
                    }
                }
                if overflow {
                    run.counters.skipped_steps += 1;
                    (loss, samples, tokens, None, true)
                } else {
                    let norm = global_grad_norm(&run.params)?;
                    if !norm.is_finite() {
                        self.non_finite(run, step_no, "grad_norm", norm)?;
                        (loss, samples, tokens, Some(norm), true)
                    } else {
                        if let Some(m) = run.cfg.max_grad_norm {
                            clip_grads(&run.params, norm, m)?;
                        }
                        run.opt.set_lr(lr);
                        run.opt.step()?;
                        if let Some(s) = run.scaler.as_mut() {
                            s.update(false)?;
                        }
                        (loss, samples, tokens, Some(norm), false)
                    }
                }
            }
        };
        run.opt.zero_grad()?;
        // data-parallel: the step trained on every rank's samples and tokens
        let (samples, tokens) = match self.grad_sync.as_mut() {
            Some(sync) => sync.sum_counts(samples, tokens)?,
            None => (samples, tokens),
        };
        run.counters.step = step_no;
        run.counters.samples += samples;
        run.counters.tokens += tokens;
        run.report.losses.push((step_no, loss));
        run.report.final_loss = Some(loss);
        let dt = t0.elapsed().as_secs_f64().max(1e-9);
        Ok(StepInfo {
            step: step_no,
            total_steps: total,
            epoch: run.counters.epoch,
            loss,
            lr,
            grad_norm,
            skipped,
            grad_accum: run.cfg.gradient_accumulation_steps,
            micro_batch_split: run.counters.micro_batch_split,
            samples,
            tokens,
            step_time_s: dt,
            it_per_s: 1.0 / dt,
            tokens_per_s: tokens as f64 / dt,
            elapsed_s: started.elapsed().as_secs_f64(),
            mem: mem_snapshot(run.cfg.device, run.cfg.track_cpu_memory),
        })
    }

    fn non_finite(
        &mut self,
        run: &mut Run<'_>,
        step: u64,
        what: &'static str,
        value: f64,
    ) -> Result<()> {
        let action = run.cfg.non_finite.name();
        emit(
            &mut self.callbacks,
            &TrainEvent::NonFinite {
                step,
                what: what.into(),
                value,
                action: action.into(),
            },
        )?;
        run.opt.zero_grad()?;
        match run.cfg.non_finite {
            NonFinitePolicy::Stop => Err(TrainError::NonFinite { what, step, value }),
            NonFinitePolicy::Skip => {
                run.counters.skipped_steps += 1;
                Ok(())
            }
            NonFinitePolicy::LowerLr { factor } => {
                run.counters.skipped_steps += 1;
                run.counters.lr_factor *= factor;
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two `fit`s at once share the process's cache: it stays on until the last one ends.
    #[test]
    fn the_cpu_block_cache_stays_on_until_the_last_fit_ends() {
        let hits = || sys::cpu_mem_stats().unwrap().cache_hits;
        // a freed block of 1 MiB and a new one of its size: a hit when the cache is on
        let reuse = || {
            drop(Tensor::zeros(
                [1 << 18],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
            drop(Tensor::zeros(
                [1 << 18],
                (tch::Kind::Float, tch::Device::Cpu),
            ));
        };
        let first = CpuCacheGuard::start().unwrap();
        let second = CpuCacheGuard::start().unwrap();
        drop(first);
        let h0 = hits();
        reuse();
        assert!(hits() > h0, "the cache went off while a fit still ran");
        drop(second);
        let h1 = hits();
        reuse();
        assert_eq!(hits(), h1, "the cache stayed on after the last fit");
    }
}
