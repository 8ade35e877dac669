//! Around a run: the output folder (writable, a previous run's checkpoints moved aside), the
//! `--resume` checkpoint and its adapter check, the device check, process memory measurements
//! and the divergence check before export.

use crate::config::TrainConfig;
use crate::job::error::{During, JobError, Result};
use crate::job::options::RunOptions;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Measured memory of the run.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct MeasuredMemory {
    /// Process resident set right before the first training step (bytes, `/proc/self/status` VmRSS).
    pub rss_before_steps: u64,
    /// Peak resident set during the training steps (VmHWM after resetting it before the steps).
    pub rss_peak_steps: u64,
    /// `rss_peak_steps − rss_before_steps`: what lora-memory's `step_delta` predicts on CPU.
    pub rss_step_delta: u64,
    /// Peak live CPU tensor bytes (the shim's counting allocator), weights included.
    pub tensor_peak: u64,
    /// Peak resident set of the whole process since start (VmHWM before the reset).
    pub rss_peak_process: u64,
}

/// A plan's error against a measurement, for the run summaries: `(predicted − measured) /
/// measured` in percent with its sign (`+1.7%`), and, when the plan was under the measurement
/// however slightly, two decimals and the words "the plan was below the measurement" (so `-0.0%` never hides it).
pub(crate) fn vs_plan(predicted: u64, measured: u64) -> String {
    let p = 100.0 * (predicted as f64 - measured as f64) / (measured.max(1) as f64);
    if predicted < measured {
        format!("{p:+.2}%: the plan was below the measurement")
    } else {
        format!("{p:+.1}%")
    }
}

/// `VmRSS` and `VmHWM` of this process in bytes (Linux; zeros elsewhere).
pub fn proc_rss() -> (u64, u64) {
    lora_memory::host::process_rss()
}

/// Resets the kernel's peak-RSS counter (`echo 5 > /proc/self/clear_refs`, Linux ≥ 4.0), so the
/// next `VmHWM` is the peak from now on. Returns false when not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Prepares `train.output_dir` before anything is loaded: it must be a folder (or not exist
/// yet). When it holds a previous run's `checkpoints/` (and `logs/`) and this run is not a
/// `--resume`, those are moved aside as `<name>.prev-<unix time>`: a fresh run never interleaves
/// its checkpoints and metrics with an old run's (a later `--resume` would continue the wrong
/// one), and nothing the old run left is deleted.
///
/// The run owns the folder while the returned [`OutputLock`] lives (keep it until the run
/// ends): a second run on the same folder is refused before it touches anything.
///
/// # Errors
/// [`JobError::Config`] naming `train.output_dir` when it is a file; [`JobError::Input`] when
/// another live run holds the folder; [`JobError::Io`] when moving fails.
pub fn check_output_dir(cfg: &TrainConfig, opts: &RunOptions) -> Result<OutputLock> {
    let out = PathBuf::from(&cfg.train.output_dir);
    if out.exists() && !out.is_dir() {
        return Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.output_dir".into(),
            value: format!("{:?}", cfg.train.output_dir),
            expected: "a folder, but a file of that name exists; choose another output_dir".into(),
        }));
    }
    check_output_name(&cfg.train.output_name)?;
    check_writable(cfg)?;
    let lock = OutputLock::acquire(&out, opts.verbose)?;
    resume_checkpoint(cfg, opts)?;
    let mut lock = lock;
    let ckpt = out.join("checkpoints");
    let has_run = std::fs::read_dir(&ckpt)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("step-"))
        })
        .unwrap_or(false)
        || out.join("summary.json").is_file();
    if !has_run || opts.resume.is_some() {
        return Ok(lock);
    }
    let mut names = vec!["checkpoints".to_string()];
    if cfg.logging.logging_dir.is_none() {
        names.push("logs".into());
    }
    // its adapters and summary go aside when this run exports ([`ExportAside`])
    names.push("samples".to_string());
    // its adapter snapshots (`<name>-step00000500.safetensors`, `<name>-000002/`, …): this run
    // writes the same names at its saves
    names.extend(previous_snapshots(&out, &cfg.train.output_name));
    if opts.verbose {
        eprintln!(
            "{} holds a previous run; a new one starts (use --resume to continue it); its files are kept aside once training begins",
            out.display()
        );
    }
    // moved only when this run really starts (`OutputLock::set_aside_previous_run`): a run refused
    // on its data or model leaves the previous one as it was, resumable
    lock.previous_run = names;
    lock.verbose = opts.verbose;
    Ok(lock)
}

/// The adapter snapshots a run named `output_name` left in `out` (files and folders
/// `<output_name>-step<8 digits>[.safetensors]` and `<output_name>-<6 digits>[.safetensors]`,
/// sd-scripts' names, see [`crate::job::snapshots::AdapterSnapshots::stem`]), by name.
fn previous_snapshots(out: &Path, output_name: &str) -> Vec<String> {
    let is_snapshot = |name: &str| {
        let Some(rest) = name
            .strip_prefix(output_name)
            .and_then(|r| r.strip_prefix('-'))
        else {
            return false;
        };
        let stem = rest.strip_suffix(".safetensors").unwrap_or(rest);
        let digits = |d: &str, n: usize| d.len() == n && d.bytes().all(|b| b.is_ascii_digit());
        match stem.strip_prefix("step") {
            Some(d) => digits(d, 8),
            None => digits(stem, 6),
        }
    };
    let mut names: Vec<String> = std::fs::read_dir(out)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| is_snapshot(n))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `train.output_name` names files inside `train.output_dir` (`<name>.safetensors`, `<name>/`):
/// a plain file name, so the outputs cannot land outside the folder or over a file of the user's.
///
/// # Errors
/// [`JobError::Config`] naming `train.output_name` when it is empty, has a path separator or
/// `..`, starts with a dot, or holds a control character.
pub fn check_output_name(name: &str) -> Result<()> {
    let bad = if name.trim().is_empty() {
        Some("is empty")
    } else if name.contains('/') || name.contains('\\') {
        Some("holds a path separator")
    } else if name.starts_with('.') {
        Some("starts with a dot (a hidden file, or a way out of the folder)")
    } else if name.chars().any(char::is_control) {
        Some("holds a control character")
    } else {
        None
    };
    match bad {
        None => Ok(()),
        Some(why) => Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.output_name".into(),
            value: format!("{name:?}"),
            expected: format!(
                "a plain file name such as \"my-lora\" (the outputs go inside train.output_dir), but it {why}"
            ),
        })),
    }
}

/// Creates `train.output_dir` and writes (then removes) a probe file in it, so a read-only or
/// otherwise unwritable folder is reported before the model loads rather than at the first
/// checkpoint.
///
/// # Errors
/// [`JobError::Config`] naming `train.output_dir`, the OS error and what to do.
pub fn check_writable(cfg: &TrainConfig) -> Result<()> {
    let out = PathBuf::from(&cfg.train.output_dir);
    let bad = |what: String| {
        JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "train.output_dir".into(),
            value: format!("{:?}", cfg.train.output_dir),
            expected: format!(
                "a folder this user can write, but {what}; choose another output_dir or fix its permissions"
            ),
        })
    };
    std::fs::create_dir_all(&out)
        .map_err(|e| bad(format!("creating {} failed: {e}", out.display())))?;
    let probe = out.join(format!(".lora-train-write-test-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .map_err(|e| bad(format!("writing a file in {} failed: {e}", out.display())))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

/// The checkpoint a `--resume` run continues from and its loop counters, read before the model
/// loads: the newest complete `step-*` folder under `<train.output_dir>/checkpoints` for
/// `--resume`, or the folder given to `--resume DIR`. `None` when the run does not resume.
///
/// # Errors
/// [`JobError::Input`] naming the folder searched when there is no checkpoint, or the folder
/// given when it is not a checkpoint (with the newest checkpoint inside it as a hint when it is
/// a run's output folder).
pub fn resume_checkpoint(
    cfg: &TrainConfig,
    opts: &RunOptions,
) -> Result<Option<(PathBuf, crate::engine::checkpoint::TrainerCounters)>> {
    use crate::engine::checkpoint::{Checkpoint, CheckpointManager};
    let Some(resume) = &opts.resume else {
        return Ok(None);
    };
    let ckpt_dir = PathBuf::from(&cfg.train.output_dir).join("checkpoints");
    let latest_in = |d: &Path| CheckpointManager::new(d, 1).latest().ok().flatten();
    let path = match resume {
        None => latest_in(&ckpt_dir).ok_or_else(|| {
            JobError::Input(format!(
                "--resume: no checkpoint in {} (the checkpoints of train.output_dir {:?}); \
                 nothing to resume — run without --resume to start fresh, or pass --resume DIR \
                 with a step-* folder of another run",
                ckpt_dir.display(),
                cfg.train.output_dir
            ))
        })?,
        Some(dir) => {
            if !dir.is_dir() {
                return Err(JobError::Input(format!(
                    "--resume {}: no such folder; pass one of the step-* folders under {}, or \
                     --resume alone for the newest",
                    dir.display(),
                    ckpt_dir.display()
                )));
            }
            if !CheckpointManager::is_checkpoint(dir) {
                let hint = latest_in(dir)
                    .or_else(|| latest_in(&dir.join("checkpoints")))
                    .map(|p| format!("did you mean {}?", p.display()))
                    .unwrap_or_else(|| {
                        format!(
                            "pass one of the step-* folders under {}, or --resume alone for the newest",
                            ckpt_dir.display()
                        )
                    });
                return Err(JobError::Input(format!(
                    "--resume {}: not a checkpoint (a checkpoint is a step-* folder holding \
                     state.json); {hint}",
                    dir.display()
                )));
            }
            dir.clone()
        }
    };
    let counters = Checkpoint::read_counters(&path)
        .map_err(|e| JobError::Input(format!("--resume {}: {e}", path.display())))?;
    check_resume_adapter(cfg, &path)?;
    Ok(Some((path, counters)))
}

/// Compares the adapter settings a checkpoint was written with ([`crate::engine::checkpoint::ADAPTER_CONFIG_KEYS`]:
/// rank, alpha, target_modules, …) with the run's, before any tensor is read: a changed rank
/// would otherwise fail late on a tensor shape, a changed alpha silently train another adapter.
/// With `memory.auto_fit` the rank and alpha are not compared (the fit may choose them after
/// this check).
///
/// # Errors
/// [`JobError::Input`] naming each key with the checkpoint's and the config's value.
fn check_resume_adapter(cfg: &TrainConfig, checkpoint: &Path) -> Result<()> {
    use crate::engine::checkpoint::{Checkpoint, adapter_config_mismatches};
    let saved = Checkpoint::read_config(checkpoint)
        .map_err(|e| JobError::Input(format!("--resume {}: {e}", checkpoint.display())))?;
    let run = serde_json::to_value(cfg).during("serializing the config")?;
    let skip: &[&str] = if cfg.memory.auto_fit {
        &["lora.rank", "lora.alpha"]
    } else {
        &[]
    };
    let diffs = adapter_config_mismatches(&saved, &run, skip);
    let Some(first) = diffs.first() else {
        return Ok(());
    };
    let each: Vec<String> = diffs
        .iter()
        .map(|d| {
            format!(
                "{} is {} in the checkpoint but {} in the config",
                d.key, d.checkpoint, d.config
            )
        })
        .collect();
    Err(JobError::Input(format!(
        "--resume {}: the checkpoint's adapter does not match the config: {}. A resumed run \
         continues the same adapter: set {}: {} in the config again, or run without --resume \
         to start a new run",
        checkpoint.display(),
        each.join("; "),
        first.key,
        first.checkpoint
    )))
}

/// What stood under a run's output names (`<output_name>`, `<output_name>.safetensors`,
/// `summary.json`) when its export began, kept aside as `.prev-*` copies: the export never
/// writes over a file it did not make. Once the new files are written
/// ([`ExportAside::exported`]), a resumed run's copies go (they were this run's own earlier
/// export, cut short or finished); a fresh run keeps them (another run's, or the user's).
#[derive(Debug)]
#[must_use = "call `exported` once the adapter files are written"]
pub struct ExportAside {
    kept: Vec<PathBuf>,
    resumed: bool,
    verbose: bool,
}

impl ExportAside {
    /// Moves what stands under `cfg`'s output names aside.
    ///
    /// # Errors
    /// [`JobError::Io`] when a rename fails.
    pub fn take(cfg: &TrainConfig, opts: &RunOptions) -> Result<Self> {
        let name = &cfg.train.output_name;
        let kept = move_aside(
            Path::new(&cfg.train.output_dir),
            &[
                name.clone(),
                format!("{name}.safetensors"),
                "summary.json".to_string(),
            ],
            opts.verbose,
        )?;
        Ok(Self {
            kept,
            resumed: opts.resume.is_some(),
            verbose: opts.verbose,
        })
    }

    /// The new files are in place: a resumed run's own earlier copies are removed.
    pub fn exported(self) {
        if !self.resumed {
            return;
        }
        for k in &self.kept {
            let removed = if k.is_dir() {
                std::fs::remove_dir_all(k)
            } else {
                std::fs::remove_file(k)
            };
            if removed.is_ok() && self.verbose {
                eprintln!(
                    "removed {} (this run's earlier output, now re-exported)",
                    k.display()
                );
            }
        }
    }
}

/// Renames each existing `dir/<name>` to `dir/<name>.prev-<unix time>` (nothing is deleted), and
/// says so when `verbose`; returns the copies kept.
fn move_aside(dir: &Path, names: &[String], verbose: bool) -> Result<Vec<PathBuf>> {
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut kept_copies = Vec::new();
    for name in names {
        let p = dir.join(name);
        if p.exists() {
            let kept = dir.join(format!("{name}.prev-{stamp}"));
            std::fs::rename(&p, &kept).during(format!(
                "moving the existing {} aside to {}",
                p.display(),
                kept.display()
            ))?;
            if verbose {
                eprintln!("kept the existing {} as {}", p.display(), kept.display());
            }
            kept_copies.push(kept);
        }
    }
    Ok(kept_copies)
}

/// Refuses `system.device: cuda` / `cuda:N` when libtorch sees no such CUDA device, before
/// anything loads (libtorch's own error comes only at the first tensor moved there).
///
/// # Errors
/// [`JobError::Config`] naming `system.device`, what libtorch sees and what to do.
pub fn check_device(cfg: &TrainConfig) -> Result<()> {
    let d = cfg.system.device.as_str();
    let index = match d {
        "cuda" => 0,
        _ => match d
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok())
        {
            Some(i) => i,
            None => return Ok(()),
        },
    };
    match lora_core::sys::cuda_device_problem(index) {
        None => Ok(()),
        Some(problem) => Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "system.device".into(),
            value: format!("{d:?}"),
            expected: format!("a CUDA device this machine has; {problem}"),
        })),
    }
}

/// After training: warns when steps were skipped as non-finite, and refuses a run whose
/// evaluation loss (`what`, e.g. "held-out loss"; `None` when nothing was evaluated) ended
/// non-finite, so that no diverged adapter is
/// exported (it would only break the tools that load it). Shared by the LLM and SD jobs.
///
/// # Errors
/// [`JobError::Diverged`] naming the loss, the skipped steps, what to change and the last
/// checkpoint.
pub(crate) fn check_not_diverged(
    report: &crate::engine::TrainReport,
    what: &str,
    loss: Option<f64>,
) -> Result<()> {
    if report.skipped_steps > 0 {
        eprintln!(
            "warning: {} of {} optimizer steps were skipped (non-finite loss or gradients; see logs/metrics.jsonl)",
            report.skipped_steps, report.steps
        );
    }
    let Some(loss) = loss.filter(|l| !l.is_finite()) else {
        return Ok(());
    };
    Err(JobError::Diverged {
        what: what.to_string(),
        loss,
        skipped: report.skipped_steps,
        steps: report.steps,
        checkpoint: report.last_checkpoint.clone(),
    })
}

/// The memory the kernel says a new process can still use without swapping (`MemAvailable` of
/// `/proc/meminfo`), in bytes; `None` where there is no such file (not Linux).
pub fn available_ram() -> Option<u64> {
    lora_memory::host::ram().map(|(_, available)| available)
}

/// Refuses, before anything loads, a CPU run with no budget (`memory.budget` / `memory.gpu` unset)
/// whose predicted peak is above this machine's available memory ([`available_ram`]): without
/// it such a run would start and swap or be killed minutes later. `forced` (`--force`,
/// `memory.force`) starts it anyway.
///
/// # Errors
/// [`JobError::DoesNotFit`] with the available memory as the budget.
pub fn check_fits_this_machine(plan: &crate::job::Plan, cuda: bool, forced: bool) -> Result<()> {
    if cuda || forced || plan.budget.is_some() {
        return Ok(());
    }
    match available_ram() {
        Some(avail) if plan.estimate.peak.0 > avail => Err(JobError::DoesNotFit {
            peak: plan.estimate.peak,
            budget: lora_memory::Bytes(avail),
            source_desc: "no memory.budget or memory.gpu is set: this machine's available RAM, MemAvailable in /proc/meminfo".into(),
            hint: "set memory.budget with memory.auto_fit: true to let lora-memory pick settings \
                   that fit, change the settings by hand, or pass --force"
                .into(),
        }),
        _ => Ok(()),
    }
}

/// The name of the lock file a run keeps in its output folder.
pub const LOCK_FILE: &str = ".lora-train.lock";

/// A run's claim on its output folder: `<train.output_dir>/.lora-train.lock`, created
/// exclusively (`O_EXCL`), holding the owner's pid, host and start time as JSON; removed when
/// dropped. A lock left by a process that no longer runs on this host is taken over with a
/// message; one held by a live process, or by another host, refuses the second run.
#[derive(Debug)]
pub struct OutputLock {
    path: PathBuf,
    /// A previous run's files to keep aside when this run starts training.
    previous_run: Vec<String>,
    verbose: bool,
}

/// This machine's host name (Linux `/proc/sys/kernel/hostname`, else `$HOSTNAME`, else
/// `"localhost"`).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// Whether process `pid` runs on this machine (`/proc/<pid>` exists; on systems without
/// `/proc` every pid counts as alive, so a lock is never taken over by mistake).
fn process_alive(pid: u64) -> bool {
    let proc = Path::new("/proc");
    !proc.is_dir() || proc.join(pid.to_string()).exists()
}

impl OutputLock {
    /// Claims `dir` (which must exist) for this process.
    ///
    /// # Errors
    /// [`JobError::Input`] naming the folder and the run (pid, host, start) that holds it;
    /// [`JobError::Io`] when the lock file cannot be written or read; [`JobError::LockContended`]
    /// when it keeps reappearing.
    pub fn acquire(dir: &Path, verbose: bool) -> Result<OutputLock> {
        use std::io::Write;
        let path = dir.join(LOCK_FILE);
        let host = host_name();
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let me = serde_json::json!({"pid": std::process::id(), "host": host, "started": started});
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    f.write_all(me.to_string().as_bytes())
                        .during(format!("writing {}", path.display()))?;
                    return Ok(OutputLock {
                        path,
                        previous_run: Vec::new(),
                        verbose,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    let owner: serde_json::Value =
                        serde_json::from_str(&text).unwrap_or(serde_json::Value::Null);
                    let pid = owner["pid"].as_u64();
                    let their_host = owner["host"].as_str().unwrap_or("");
                    let stale = match pid {
                        // a lock without a readable owner was cut short while being written
                        None => true,
                        Some(p) => their_host == host && !process_alive(p),
                    };
                    if !stale {
                        return Err(JobError::Input(format!(
                            "train.output_dir {}: another run is using it (pid {}{}, started at \
                             unix time {}; lock file {}); wait for it to end, or choose another \
                             output_dir{}",
                            dir.display(),
                            pid.unwrap_or(0),
                            if their_host.is_empty() {
                                String::new()
                            } else {
                                format!(" on {their_host}")
                            },
                            owner["started"].as_u64().unwrap_or(0),
                            path.display(),
                            if their_host == host {
                                String::new()
                            } else {
                                format!(
                                    " (if no run on {their_host} uses it any more, delete the lock file)"
                                )
                            }
                        )));
                    }
                    if verbose {
                        eprintln!(
                            "{}: taking over the lock of a run that no longer runs (pid {}{})",
                            dir.display(),
                            pid.map(|p| p.to_string())
                                .unwrap_or_else(|| "unknown".into()),
                            if their_host.is_empty() {
                                String::new()
                            } else {
                                format!(" on {their_host}")
                            }
                        );
                    }
                    std::fs::remove_file(&path)
                        .during(format!("removing the stale lock {}", path.display()))?;
                }
                Err(e) => {
                    return Err(e).during(format!("creating the lock file {}", path.display()));
                }
            }
        }
        Err(JobError::LockContended { path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Just before the first training step of a fresh run in a folder that holds a previous
    /// run: renames that run's checkpoints, logs and samples to
    /// `<name>.prev-<unix time>` (nothing is deleted) and returns the copies kept; once only.
    ///
    /// # Errors
    /// [`JobError::Io`] when a rename fails.
    pub fn set_aside_previous_run(&mut self) -> Result<Vec<PathBuf>> {
        let names = std::mem::take(&mut self.previous_run);
        if names.is_empty() {
            return Ok(Vec::new());
        }
        let dir = self.path.parent().unwrap_or_else(|| Path::new("."));
        move_aside(dir, &names, self.verbose)
    }
}

impl Drop for OutputLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_plan_under_its_measurement_says_so_at_any_size() {
        assert_eq!(super::vs_plan(1_017, 1_000), "+1.7%");
        assert_eq!(super::vs_plan(1_000, 1_000), "+0.0%");
        assert_eq!(
            super::vs_plan(99_990, 100_000),
            "-0.01%: the plan was below the measurement"
        );
        assert_eq!(super::vs_plan(5, 0), "+500.0%");
    }

    use super::*;

    #[test]
    fn a_previous_runs_snapshots_are_found_by_sd_scripts_names() {
        let d = tempfile::tempdir().unwrap();
        for f in [
            "lora-step00000015.safetensors",
            "lora-000002.safetensors",
            "lora.safetensors",
            "lora-step15.safetensors",
            "other-step00000015.safetensors",
        ] {
            std::fs::write(d.path().join(f), b"x").unwrap();
        }
        std::fs::create_dir(d.path().join("lora-step00000015")).unwrap();
        assert_eq!(
            previous_snapshots(d.path(), "lora"),
            [
                "lora-000002.safetensors",
                "lora-step00000015",
                "lora-step00000015.safetensors"
            ]
        );
    }

    #[test]
    fn output_names_stay_inside_the_output_folder() {
        for ok in ["adapter", "my-lora_v2", "sks style 1.5"] {
            assert!(check_output_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            " ",
            "../../escaped",
            "/tmp/victim",
            "a/b",
            "..",
            ".hidden",
            "a\\b",
            "x\ny",
        ] {
            let e = check_output_name(bad).unwrap_err().to_string();
            assert!(
                e.contains("train.output_name") && e.contains("plain file name"),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn a_live_owner_refuses_a_second_lock_and_a_dead_one_is_taken_over() {
        let dir = tempfile::tempdir().unwrap();
        let first = OutputLock::acquire(dir.path(), false).unwrap();
        let text = std::fs::read_to_string(first.path()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["pid"].as_u64(), Some(u64::from(std::process::id())));
        assert_eq!(v["host"].as_str(), Some(host_name().as_str()));
        let e = OutputLock::acquire(dir.path(), false).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, JobError::Input(_)), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id()))
                && msg.contains(&dir.path().display().to_string())
                && msg.contains("choose another output_dir"),
            "{msg}"
        );
        drop(first);
        assert!(!dir.path().join(LOCK_FILE).exists(), "released on drop");
        // a lock left by a process that is gone (pid beyond the kernel's pid_max)
        std::fs::write(
            dir.path().join(LOCK_FILE),
            format!(
                r#"{{"pid": 4294967295, "host": "{}", "started": 1}}"#,
                host_name()
            ),
        )
        .unwrap();
        let taken = OutputLock::acquire(dir.path(), false).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(taken.path()).unwrap()).unwrap();
        assert_eq!(v["pid"].as_u64(), Some(u64::from(std::process::id())));
        drop(taken);
        // another host's lock is not taken over: its owner cannot be checked from here
        std::fs::write(
            dir.path().join(LOCK_FILE),
            r#"{"pid": 1, "host": "some-other-node", "started": 1}"#,
        )
        .unwrap();
        let msg = OutputLock::acquire(dir.path(), false)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("on some-other-node") && msg.contains("delete the lock file"),
            "{msg}"
        );
    }
}
