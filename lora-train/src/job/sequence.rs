//! The one sequence every recipe's run follows, written once:
//!
//! 1. device and thread settings, the counting CPU allocator;
//! 2. the recipe's own checks ([`RunSteps::check`]), then the memory plan ([`RunSteps::plan`]):
//!    a run predicted not to fit its budget (or this machine's RAM, on the CPU) is refused before
//!    anything loads, unless forced; `memory.auto_fit`'s settings are applied to the run's copy
//!    of the config;
//! 3. the output folder's lock, the checkpoint to resume from (a finished run returns at once);
//! 4. the training data read and checked ([`RunSteps::read_data`]) — before the model, so bad
//!    data fails fast;
//! 5. the base loaded and LoRA injected ([`RunSteps::load`]);
//! 6. the batch source ([`LoadedRun::source`]), the step count (`train.max_steps` wins over
//!    `train.epochs`, as kohya's `max_train_steps` and HF's `max_steps`);
//! 7. the evaluation before training ([`LoadedRun::before`]);
//! 8. training by the engine's [`Trainer`](crate::engine::Trainer) with the progress bar, the
//!    metrics log, the recipe's callbacks and the app's, measuring memory;
//! 9. the evaluation after training ([`LoadedRun::after`]), refusing to export a diverged adapter,
//!    then what a finished run adds ([`LoadedRun::finish`]: sample images, generations);
//! 10. export ([`LoadedRun::export`]) without writing over files the run did not make, then
//!     `summary.json` ([`LoadedRun::summary`]).
//!
//! A recipe implements [`RunSteps`] (before the model loads) and [`LoadedRun`] (after); its
//! `run` function is one call of [`run`].

use crate::config::TrainConfig;
use crate::engine::{BatchSource, Callback, TrainReport, TrainStep};
use crate::job::error::{During, JobError, Result};
use crate::job::options::RunOptions;
use crate::job::plan::{Plan, budget_source};
use crate::job::run::{
    ExportAside, MeasuredMemory, check_device, check_fits_this_machine, check_not_diverged,
    check_output_dir, proc_rss, reset_peak_rss, resume_checkpoint,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::time::Instant;
use tch::Device;

/// What a run knows about itself, handed to every step.
#[derive(Debug)]
pub struct RunContext<'o> {
    /// How the run was called.
    pub opts: &'o RunOptions,
    /// The training device (`system.device`).
    pub device: Device,
    /// Whether it is a CUDA device.
    pub cuda: bool,
    /// `model.base_model` as written in the config.
    pub base_written: String,
    /// `train.output_dir`.
    pub out_dir: PathBuf,
    /// The checkpoint the run resumes from and its optimizer step.
    pub resume_from: Option<(PathBuf, u64)>,
    /// This process's place in a data-parallel run (torchrun / SLURM variables), or `None`.
    pub data_parallel: Option<crate::engine::dist::DistEnv>,
    started: Instant,
}

impl RunContext<'_> {
    /// Prints `s` to stderr with the seconds since the run started, when the run is verbose
    /// (in a data-parallel run, on rank 0 only).
    pub fn say(&self, s: &str) {
        if self.opts.verbose && self.writes_files() {
            eprintln!("[{:6.1} s] {s}", self.started.elapsed().as_secs_f64());
        }
    }

    /// Says which of one of lora-core's CPU kernels and libtorch's own ops computes `what`
    /// (the kernel where `chosen`), as the environment variable `var` asked (`request`), with a
    /// warning first for a value it ignores or a kernel this CPU lacks (`available` false).
    pub(crate) fn say_cpu_kernel(
        &self,
        what: &str,
        var: &str,
        request: &lora_core::sys::CpuKernelRequest,
        available: bool,
        chosen: (bool, &str, &str),
    ) {
        if let Some(w) = request.warning(var, available) {
            self.say(&w);
        }
        let (lsdk, ours, theirs) = chosen;
        self.say(
            &if lsdk && *request == lora_core::sys::CpuKernelRequest::Lsdk {
                format!("{what}: {ours} ({var}=lsdk)")
            } else if lsdk {
                format!("{what}: {ours} ({var}=libtorch for libtorch's)")
            } else if *request == lora_core::sys::CpuKernelRequest::Libtorch {
                format!("{what}: {theirs} ({var}=libtorch)")
            } else {
                format!("{what}: {theirs}")
            },
        );
    }

    /// Whether this process writes the run's files (checkpoints, adapters, logs, samples): a
    /// single-process run, or rank 0 of a data-parallel one.
    pub fn writes_files(&self) -> bool {
        self.data_parallel
            .as_ref()
            .is_none_or(crate::engine::dist::DistEnv::writes_files)
    }

    /// `(num_replicas, rank)` for the data loader: the data-parallel world and this rank, or
    /// `(1, 0)`.
    pub fn loader_shard(&self) -> (usize, usize) {
        self.data_parallel
            .as_ref()
            .map_or((1, 0), |d| (d.world_size, d.rank))
    }

    /// `model.base_model` resolved ([`crate::job::resolve_base_model`]: as written, else next to
    /// the config file, else a Hugging Face Hub id from the local cache).
    ///
    /// # Errors
    /// [`JobError::MissingFile`] naming the key and the places looked (a planning preset has
    /// no file: the plan reads it, loading it fails here).
    pub fn base_path(&self) -> Result<PathBuf> {
        crate::job::resolve_base_model(&self.base_written, self.config_dir())
    }

    /// The config file's folder (relative paths are also tried there).
    pub fn config_dir(&self) -> Option<&Path> {
        self.opts.config_dir.as_deref()
    }

    /// Seconds since the run started.
    pub fn elapsed_seconds(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// [`JobError::Interrupted`] for a stop request before training: at the resumed step and
    /// checkpoint, or step 0 without one.
    pub fn interrupted_before_training(&self) -> JobError {
        JobError::Interrupted {
            step: self.resume_from.as_ref().map(|r| r.1).unwrap_or(0),
            checkpoint: self.resume_from.as_ref().map(|r| r.0.clone()),
        }
    }
}

/// What every run measures, handed to [`LoadedRun::summary`].
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// The plan the run started with (`None` when the recipe trains without one).
    pub plan: Option<Plan>,
    /// The engine's report of the training.
    pub report: TrainReport,
    /// Micro-batches per epoch ÷ `gradient_accumulation_steps`: optimizer steps per epoch.
    pub steps_per_epoch: u64,
    /// Seconds spent in the training steps.
    pub train_seconds: f64,
    /// Seconds for the whole run (up to the summary).
    pub total_seconds: f64,
    /// Memory measured around the training steps.
    pub memory: MeasuredMemory,
    /// Files written: the adapters, then `summary.json`.
    pub outputs: Vec<PathBuf>,
}

/// A recipe's run before its model loads.
pub trait RunSteps: Sized {
    /// The run once the base is loaded and LoRA injected.
    type Loaded: LoadedRun<Summary = Self::Summary>;
    /// What the run returns and writes to `summary.json`.
    type Summary: Serialize;

    /// Checks the config as `lora-train plan` does, before anything is planned, loaded or
    /// written. The default checks nothing.
    ///
    /// # Errors
    /// [`JobError::Config`] / [`JobError::Input`] naming the key and what to do.
    fn check(&mut self, _cfg: &TrainConfig, _ctx: &RunContext<'_>) -> Result<()> {
        Ok(())
    }

    /// The memory plan of `cfg` on the run's device (`Ok(None)`: the recipe trains without
    /// one).
    ///
    /// # Errors
    /// Header, config and budget errors.
    fn plan(&self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Option<Plan>>;

    /// The summary of a run that finished and exported at `step` in the output folder (what
    /// `--resume` of a finished run returns), or `None` to train (or re-export) as usual. The
    /// default is `None`.
    fn finished(_ctx: &RunContext<'_>, _step: u64, _plan: Option<&Plan>) -> Option<Self::Summary> {
        None
    }

    /// Reads and checks the training data before the model loads.
    ///
    /// # Errors
    /// [`JobError::Input`] naming the file and what to do; I/O and data errors.
    fn read_data(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()>;

    /// After [`Self::read_data`]: what the run's data source will keep in memory for the whole
    /// run, for the plan ([`Plan::with_kept_data`]). The default, `None`: nothing to add.
    fn kept_data(&self, _cfg: &TrainConfig) -> Option<lora_memory::KeptData> {
        None
    }

    /// Loads the base on `ctx.device` and injects LoRA, its adapter variables in `vs`.
    ///
    /// # Errors
    /// Model, LoRA and config errors naming the file or key.
    fn load(
        self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        vs: &tch::nn::VarStore,
    ) -> Result<Self::Loaded>;
}

/// A recipe's run after its model loaded: data, evaluation, training step, export.
pub trait LoadedRun: Sized {
    /// A training batch.
    type Batch;
    /// The engine's training step over the loaded model (it may borrow it).
    type Task<'a>: TrainStep<Batch = Self::Batch>
    where
        Self: 'a;
    /// The engine's batch source.
    type Source: BatchSource<Self::Batch>;
    /// What the run returns and writes to `summary.json`.
    type Summary: Serialize;

    /// The batch source over the data read in [`RunSteps::read_data`] (caching what the
    /// recipe caches before training).
    ///
    /// # Errors
    /// [`JobError::Input`] for data too small to train on; data and model errors.
    fn source(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Self::Source>;

    /// Says what the data gives (`total_steps` optimizer steps in all); the default says
    /// nothing.
    fn describe_data(&self, _cfg: &TrainConfig, _ctx: &RunContext<'_>, _total_steps: u64) {}

    /// Evaluates before training.
    ///
    /// # Errors
    /// Model errors.
    fn before(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        source: &mut Self::Source,
    ) -> Result<()>;

    /// The recipe's own engine callbacks (sample images, …), added after the progress bar and
    /// the metrics log and before the app's. The default has none.
    ///
    /// # Errors
    /// As the recipe's callbacks' set-up.
    fn callbacks(
        &mut self,
        _cfg: &TrainConfig,
        _ctx: &RunContext<'_>,
    ) -> Result<Vec<Box<dyn Callback>>> {
        Ok(Vec::new())
    }

    /// The training step over the adapter tensors `named` (VarStore names, sorted).
    ///
    /// # Errors
    /// Model errors while building it.
    fn task(&self, cfg: &TrainConfig, named: Vec<(String, tch::Tensor)>) -> Result<Self::Task<'_>>;

    /// Evaluates after training (the source is handed back for what it counted). Returns what
    /// was evaluated and its value when a non-finite value there means the run diverged.
    ///
    /// # Errors
    /// Model errors.
    fn after(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        source: Self::Source,
        report: &TrainReport,
    ) -> Result<Option<(&'static str, f64)>>;

    /// What comes after a run that did not diverge and before export (final sample images,
    /// sample generations); the default does nothing.
    ///
    /// # Errors
    /// Model errors.
    fn finish(
        &mut self,
        _cfg: &TrainConfig,
        _ctx: &RunContext<'_>,
        _report: &TrainReport,
    ) -> Result<()> {
        Ok(())
    }

    /// The dataset's entry of the run metadata ([`crate::export::RunMetadata::dataset`]).
    fn dataset_metadata(&self) -> serde_json::Value;

    /// The base model's sha256 for the run metadata; the default is none.
    ///
    /// # Errors
    /// I/O errors while hashing.
    fn base_sha256(&self, _ctx: &RunContext<'_>) -> Result<Option<String>> {
        Ok(None)
    }

    /// Writes the adapter files under `out_dir` with `metadata`; returns their paths.
    ///
    /// # Errors
    /// [`JobError::Export`] and I/O errors naming the file.
    fn export(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        metadata: std::collections::BTreeMap<String, String>,
    ) -> Result<Vec<PathBuf>>;

    /// The run's summary.
    ///
    /// # Errors
    /// [`JobError::Internal`] when the outcome lacks what the summary needs.
    fn summary(self, outcome: RunOutcome) -> Result<Self::Summary>;

    /// The summary as printed at the end of a verbose run.
    fn report(summary: &Self::Summary, ctx: &RunContext<'_>) -> String;
}

/// Writes a report to stdout, turning a failed write (a full disk) into an error instead of
/// `print!`'s panic.
///
/// # Errors
/// [`JobError::Io`].
pub fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut so = std::io::stdout().lock();
    so.write_all(text.as_bytes())
        .and_then(|()| so.flush())
        .during("writing to stdout")
}

/// The training device `system.device` names (`cpu`, `cuda`, `cuda:N`, `auto`).
pub fn device_of(cfg: &TrainConfig) -> Device {
    match cfg.system.device.as_str() {
        "cpu" => Device::Cpu,
        "auto" => Device::cuda_if_available(),
        d => Device::Cuda(
            d.strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
        ),
    }
}

/// Optimizer steps per epoch and in all for `batches_per_epoch` micro-batches; with
/// `train.max_steps` (which wins over `train.epochs`, as kohya's `max_train_steps` and HF
/// Trainer's `max_steps`) `cfg.train.epochs` is raised to the epochs the steps need.
pub fn step_counts(cfg: &mut TrainConfig, batches_per_epoch: u64) -> (u64, u64) {
    let accum = u64::from(cfg.train.gradient_accumulation_steps.max(1));
    let per_epoch = batches_per_epoch.div_ceil(accum);
    let total = cfg
        .train
        .max_steps
        .unwrap_or(per_epoch.saturating_mul(u64::from(cfg.train.epochs)))
        .max(1);
    if cfg.train.max_steps.is_some() {
        let need = total.div_ceil(per_epoch.max(1));
        cfg.train.epochs = u32::try_from(need)
            .unwrap_or(u32::MAX)
            .max(cfg.train.epochs);
    }
    (per_epoch, total)
}

/// Runs a recipe's steps in the one sequence (see the module docs), with the app's engine
/// callbacks after the job's own.
///
/// # Errors
/// [`JobError::DoesNotFit`] before loading anything; [`JobError::Interrupted`] after a stop
/// request; config, file, data, model and engine errors.
pub fn run<S: RunSteps>(
    mut steps: S,
    mut cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn Callback>>,
) -> Result<S::Summary> {
    // Count tensor bytes from the start so the weights are in the allocator peak.
    let _ = lora_core::sys::install_counting_cpu_allocator();
    if let Some(n) = cfg.system.num_threads {
        tch::set_num_threads(n as i32);
    }
    // a data-parallel run (torchrun / srun / `--nproc-per-node`): join the group first, so a
    // rank that fails its checks does not leave the others waiting at the rendezvous
    let data_parallel = crate::engine::dist::DistEnv::from_env().map_err(|e| JobError::Train {
        during: "reading the data-parallel environment".into(),
        source: e,
    })?;
    if let Some(d) = &data_parallel
        && device_of(&cfg) != Device::Cpu
    {
        // one CUDA device per process, picked by the local rank (as torchrun's workers call
        // `torch.cuda.set_device(LOCAL_RANK)`)
        cfg.system.device = format!("cuda:{}", d.local_rank);
    }
    check_device(&cfg)?;
    if let Some(e) = cfg.unwritable_export() {
        return Err(JobError::Config(e));
    }
    let device = device_of(&cfg);
    // a precision the device cannot run is a config error, found before anything loads (in
    // the engine's words)
    if let Err(crate::engine::TrainError::Invalid { value, hint, .. }) =
        cfg.train.mixed_precision.check_device(device)
    {
        return Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.mixed_precision".into(),
            value: format!("{value:?}"),
            expected: format!("a precision the CPU runs: {hint}"),
        }));
    }
    let base_written = cfg.base_model()?.to_string();
    let mut group = None;
    // the other ranks say nothing: rank 0 prints the plan, progress and summary
    let quiet;
    let opts = match &data_parallel {
        Some(d) if !d.writes_files() => {
            quiet = RunOptions {
                verbose: false,
                ..opts.clone()
            };
            &quiet
        }
        _ => opts,
    };
    if let Some(d) = &data_parallel {
        group = Some(
            d.join(dist_timeout(), device)
                .map_err(|e| JobError::Train {
                    during: format!(
                        "joining the data-parallel group at {}:{} as rank {} of {}",
                        d.master_addr, d.master_port, d.rank, d.world_size
                    ),
                    source: e,
                })?,
        );
    }
    let mut ctx = RunContext {
        opts,
        device,
        cuda: device != Device::Cpu,
        base_written,
        out_dir: PathBuf::from(&cfg.train.output_dir),
        resume_from: None,
        data_parallel,
        started: Instant::now(),
    };
    if let Some(d) = &ctx.data_parallel {
        ctx.say(&format!(
            "data-parallel: {} processes (Gloo over c10d, store at {}:{}); rank 0 writes the files",
            d.world_size, d.master_addr, d.master_port
        ));
    }
    let forced = opts.force || cfg.memory.force;

    // checks, then the plan
    steps.check(&cfg, &ctx)?;
    let mut plan = steps.plan(&cfg, &ctx)?;
    // data-parallel: the plan is per rank, with the all-reduce's buffer
    if let Some(d) = &ctx.data_parallel
        && let Some(p) = plan.take()
    {
        plan = Some(p.for_world_size(d.world_size as u32)?);
    }
    if let Some(p) = &plan {
        p.apply_to(&mut cfg);
        if opts.verbose {
            write_stdout(&p.report())?;
        }
        judge_before_loading(p, forced, None, &ctx)?;
    }
    // CPU: freed tensors go back to the OS so RSS follows the plan (see MemorySection).
    if !ctx.cuda
        && cfg.memory.cpu_return_freed
        && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && lora_core::sys::set_malloc_mmap_threshold(lora_core::sys::RETURN_FREED_MMAP_THRESHOLD)
    {
        ctx.say("CPU allocator: blocks ≥ 128 KiB are returned to the OS when freed");
    }
    if !ctx.cuda {
        if let lora_core::sys::F32GemmRequest::Unknown(other) =
            lora_core::sys::cpu_f32_gemm_request()
        {
            ctx.say(&format!(
                "warning: LORA_CPU_F32_GEMM={other:?} is not \"onednn\" or \"mkl\"; ignored (the CPU's default is used)"
            ));
        }
        ctx.say(if lora_core::sys::cpu_f32_gemm_by_onednn() {
            "f32 matrix products: oneDNN (LORA_CPU_F32_GEMM=mkl for MKL's sgemm)"
        } else {
            "f32 matrix products: MKL's sgemm (LORA_CPU_F32_GEMM=onednn for oneDNN)"
        });
        ctx.say_cpu_kernel(
            "LoRA branches of f32 linears",
            "LORA_CPU_LORA",
            &lora_core::sys::cpu_lora_request(),
            lora_core::sys::lora_branch_available(),
            (
                lora_core::sys::cpu_lora_branch_by_lsdk(),
                "lora-core's AVX2 kernel where it applies (f32 outside autocast, plain LoRA), libtorch's GEMMs otherwise",
                "libtorch's GEMMs",
            ),
        );
        if cfg.memory.cpu_cache {
            ctx.say(
                "CPU block cache: blocks a step frees are kept for the next steps, within the step's live peak (memory.cpu_cache)",
            );
        }
    }

    // the output folder (rank 0's), and where to resume
    let mut lock = if ctx.writes_files() {
        Some(check_output_dir(&cfg, opts)?)
    } else {
        None
    };
    if let Some((path, counters)) = resume_checkpoint(&cfg, opts)? {
        ctx.say(&format!(
            "resuming from {} (step {}{})",
            path.display(),
            counters.step,
            cfg.train
                .max_steps
                .map(|m| format!(" of {m}"))
                .unwrap_or_default()
        ));
        ctx.resume_from = Some((path, counters.step));
        if let Some(m) = cfg.train.max_steps
            && counters.step >= m
            && let Some(done) = S::finished(&ctx, counters.step, plan.as_ref())
        {
            ctx.say(&already_finished(counters.step, &ctx.out_dir));
            return Ok(done);
        }
    }

    // data first: bad data fails before the model loads
    steps.read_data(&cfg, &ctx)?;
    // what the data source will keep joins the plan (an image job's cached latents and
    // embeddings on a CPU run), judged again when that changes the verdict (or, without a
    // budget, the peak the machine's RAM is checked against)
    if let Some(kept) = steps.kept_data(&cfg)
        && let Some(p) = plan.take()
    {
        let before = (p.verdict_kind(), p.estimate.peak);
        let p = p.with_kept_data(kept)?;
        let bytes = p.estimate.breakdown.kept_data;
        if bytes.0 > 0 {
            ctx.say(&format!(
                "plan: the data kept in memory for the run adds {bytes} ({} latents, {} captions' text-encoder outputs, {} evaluation samples): peak {}",
                kept.latents, kept.captions, kept.eval_samples, p.estimate.peak
            ));
        }
        if p.verdict_kind() != before.0 || (p.budget.is_none() && p.estimate.peak != before.1) {
            let hint = format!(
                "the {bytes} of latents and text-encoder outputs the run keeps in memory tip it over: \
                 train on fewer or smaller images (flip_aug keeps two latents per image), raise the \
                 budget, or pass --force"
            );
            judge_before_loading(&p, forced, Some(hint), &ctx)?;
        }
        plan = Some(p);
    }

    // load, inject
    let vs = tch::nn::VarStore::new(device);
    let mut loaded = steps.load(&cfg, &ctx, &vs)?;
    if crate::engine::stop_requested() {
        return Err(ctx.interrupted_before_training());
    }

    // the batch source and the step count
    let mut source = loaded.source(&cfg, &ctx)?;
    let (per_epoch, total_steps) = step_counts(&mut cfg, source.batches_per_epoch().unwrap_or(0));
    loaded.describe_data(&cfg, &ctx, total_steps);
    if let Ok((_, kind)) = cfg.optimizer_and_schedule()
        && let Some(w) = crate::job::lower::warmup_warning(
            &kind,
            crate::job::lower::warmup_steps(&cfg.train, total_steps),
            total_steps,
        )
    {
        ctx.say(&w);
    }
    if let Some(step) = ctx.resume_from.as_ref().map(|r| r.1)
        && step >= total_steps
    {
        if let Some(done) = S::finished(&ctx, step, plan.as_ref()) {
            ctx.say(&already_finished(step, &ctx.out_dir));
            return Ok(done);
        }
        ctx.say(&format!(
            "training already finished at step {step} of {total_steps}; evaluating and exporting"
        ));
    }

    // before
    loaded.before(&cfg, &ctx, &mut source)?;
    if crate::engine::stop_requested() {
        return Err(ctx.interrupted_before_training());
    }

    // train
    std::fs::create_dir_all(&ctx.out_dir).during(format!("creating {}", ctx.out_dir.display()))?;
    let tcfg = crate::job::trainer_config(&cfg, device, &ctx.out_dir, total_steps)?;
    let mut job_callbacks: Vec<Box<dyn Callback>> = Vec::new();
    #[cfg(feature = "progress")]
    if cfg.logging.progress && opts.verbose {
        job_callbacks.push(Box::new(
            crate::engine::progress::ProgressBar::new().every(cfg.logging.log_every_n_steps),
        ));
    }
    // a previous run in this folder: its files go aside now that this run really starts
    if let Some(lock) = lock.as_mut() {
        lock.set_aside_previous_run()?;
    }
    let mut log_dir = cfg
        .logging
        .logging_dir
        .clone()
        .map(PathBuf::from)
        .unwrap_or_else(|| ctx.out_dir.join("logs"));
    // kohya `log_prefix`: the run's own folder under logging_dir, named by prefix and run
    if let Some(prefix) = &cfg.logging.log_prefix {
        log_dir = log_dir.join(format!("{prefix}{}", cfg.train.output_name));
    }
    // metrics.jsonl (appended on resume), TensorBoard event files when `logging.tensorboard`,
    // and loss.png at the end; with the recipe's callbacks (snapshots, samples), rank 0's
    if ctx.writes_files() {
        job_callbacks.push(Box::new(
            crate::engine::metrics::MetricsLogger::new(&log_dir, cfg.logging.tensorboard)
                .during("the metrics log")?
                .with_every(cfg.logging.log_every_n_steps),
        ));
        job_callbacks.extend(loaded.callbacks(&cfg, &ctx)?);
    } else {
        job_callbacks.clear(); // no progress bar either
    }
    job_callbacks.extend(callbacks);
    let resume = match &ctx.resume_from {
        None => crate::engine::Resume::No,
        Some((dir, _)) => crate::engine::Resume::From(dir.clone()),
    };
    let mut named: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let (fitted, rss_before_steps, hwm_process, train_seconds) = {
        let mut task = loaded.task(&cfg, named)?;
        let mut trainer = crate::engine::Trainer::new(tcfg);
        for cb in job_callbacks {
            trainer.add_callback(cb);
        }
        if let Some(pg) = group.take() {
            trainer.set_grad_sync(Box::new(pg));
        }
        let (rss_before_steps, hwm_process) = proc_rss();
        let _ = reset_peak_rss();
        let _ = lora_core::sys::cpu_reset_peak();
        let t_train = Instant::now();
        let fitted = trainer.fit(&mut task, &mut source, resume);
        (
            fitted,
            rss_before_steps,
            hwm_process,
            t_train.elapsed().as_secs_f64(),
        )
    };
    let report = fitted.map_err(|e| match e {
        crate::engine::TrainError::NonFinite { .. }
        | crate::engine::TrainError::OutOfMemory { .. } => JobError::Engine(e),
        other => JobError::Train {
            during: "training".into(),
            source: other,
        },
    })?;
    let (_, hwm_steps) = proc_rss();
    let memory = MeasuredMemory {
        rss_before_steps,
        rss_peak_steps: hwm_steps,
        rss_step_delta: hwm_steps.saturating_sub(rss_before_steps),
        tensor_peak: lora_core::sys::cpu_mem_stats()
            .map(|s| s.peak_bytes)
            .unwrap_or(0),
        rss_peak_process: hwm_process.max(hwm_steps),
    };
    let interrupted = |report: &TrainReport| JobError::Interrupted {
        step: report.steps,
        checkpoint: report.last_checkpoint.clone(),
    };
    if report.interrupted || crate::engine::stop_requested() {
        // Ctrl-C: the trainer saved a checkpoint; no evaluation or export of a half-trained
        // adapter (the CLI prints how to resume)
        return Err(interrupted(&report));
    }
    if let Some(from) = report.resumed_from {
        ctx.say(&if report.steps > from {
            format!(
                "resumed at step {from}; trained steps {}–{}",
                from + 1,
                report.steps
            )
        } else {
            format!("resumed at step {from}; no steps were left to train")
        });
    }
    if report.oom_backoffs > 0 {
        ctx.say(&format!(
            "out-of-memory back-offs: {} (final micro-batch split {})",
            report.oom_backoffs, report.micro_batch_split
        ));
    }

    if !ctx.writes_files() {
        // the other ranks trained the same adapter; rank 0 evaluates and exports it
        return loaded.summary(RunOutcome {
            plan,
            report,
            steps_per_epoch: per_epoch,
            train_seconds,
            total_seconds: ctx.elapsed_seconds(),
            memory,
            outputs: Vec::new(),
        });
    }

    // after
    let evaluated = loaded.after(&cfg, &ctx, source, &report)?;
    if crate::engine::stop_requested() {
        return Err(interrupted(&report));
    }
    match evaluated {
        Some((what, value)) => check_not_diverged(&report, what, Some(value))?,
        None => check_not_diverged(&report, "loss", None)?,
    }
    loaded.finish(&cfg, &ctx, &report)?;
    if crate::engine::stop_requested() {
        return Err(interrupted(&report));
    }

    // export
    let meta = crate::export::metadata_for(
        &cfg,
        &crate::export::RunMetadata {
            base_model: ctx.base_written.clone(),
            base_model_sha256: loaded.base_sha256(&ctx)?,
            dataset: loaded.dataset_metadata(),
            steps: report.steps,
            epochs: 1 + report.steps.saturating_sub(1) / per_epoch.max(1),
        },
    );
    let kept = ExportAside::take(&cfg, opts)?;
    let mut outputs = loaded.export(&cfg, &ctx, meta)?;
    kept.exported();
    let summary_path = ctx.out_dir.join("summary.json");
    outputs.push(summary_path.clone());
    let summary = loaded.summary(RunOutcome {
        plan,
        report,
        steps_per_epoch: per_epoch,
        train_seconds,
        total_seconds: ctx.elapsed_seconds(),
        memory,
        outputs,
    })?;
    let text = serde_json::to_string_pretty(&summary).during("serializing the summary")?;
    std::fs::write(&summary_path, text).during(format!("writing {}", summary_path.display()))?;
    if opts.verbose {
        write_stdout(&S::Loaded::report(&summary, &ctx))?;
    }
    Ok(summary)
}

/// Refuses a run its plan says does not fit (unless forced: then a warning), warns when it is
/// tight, and on a CPU run without a budget checks the machine's available RAM. `hint`, when
/// given, replaces the hint the plan's fitting findings give.
///
/// # Errors
/// [`JobError::DoesNotFit`] with a hint that says what to change.
fn judge_before_loading(
    p: &Plan,
    forced: bool,
    hint: Option<String>,
    ctx: &RunContext<'_>,
) -> Result<()> {
    if p.fits == Some(false) {
        if !forced && let Some(b) = &p.budget {
            return Err(JobError::DoesNotFit {
                peak: p.estimate.peak,
                budget: b.bytes,
                source_desc: budget_source(b),
                hint: hint.unwrap_or_else(|| {
                    match (p.suggestion.is_empty(), p.ladder_smallest_peak) {
                        (false, _) => "set memory.auto_fit: true to take the settings that fit \
                                   (`lora-train plan` lists them), change the settings by \
                                   hand, or pass --force"
                            .into(),
                        (true, Some(smallest)) => format!(
                            "nothing on the fitting ladder fits it (the smallest peak it reaches \
                         is {smallest}): raise the budget, make the job smaller (model, \
                         sequence length or resolution, batch), or pass --force"
                        ),
                        (true, None) => "change the settings by hand (`lora-train plan` prints \
                                     the plan's terms), or pass --force"
                            .into(),
                    }
                }),
            });
        }
        ctx.say("warning: predicted not to fit; starting anyway (forced)");
    }
    if p.verdict_kind() == Some(lora_memory::Verdict::Tight)
        && let Some(c) = &p.check
    {
        // the summary starts with the verdict: "tight — needs …"
        ctx.say(&format!(
            "warning: the plan is {}; on out-of-memory the trainer splits the micro-batch and retries the step",
            c.summary()
        ));
    }
    check_fits_this_machine(p, ctx.cuda, forced)?;
    Ok(())
}

/// How long a data-parallel rank waits for the others at the rendezvous and in each
/// collective: `LORA_DIST_TIMEOUT_S` seconds, else 30 minutes (`torch.distributed`'s default).
fn dist_timeout() -> std::time::Duration {
    std::time::Duration::from_secs(
        std::env::var("LORA_DIST_TIMEOUT_S")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(30 * 60),
    )
}

/// What a `--resume` of a run that already finished says.
pub fn already_finished(step: u64, out_dir: &Path) -> String {
    format!(
        "run already finished at step {step}; nothing to do (its adapter and summary.json are in \
         {}). To train further, raise train.max_steps (or train.epochs) and --resume again",
        out_dir.display()
    )
}
