//! `lora-train train`: the whole job.
//!
//! Ctrl-C (SIGINT) — or SIGTERM, what `kill`, `timeout`, Docker and job schedulers send — asks
//! the trainer to stop after the current optimizer step; it saves a checkpoint, and the command
//! prints where it is and the exact command that continues the run, then exits 128 + the signal
//! (130 for SIGINT, 143 for SIGTERM). A second signal ends the process at once (the default
//! action is restored by the first).

use super::{CliError, EXIT_INTERRUPTED, EXIT_OK, EXIT_TERMINATED};
use lora_train::config::TrainConfig;
use lora_train::engine::checkpoint::CheckpointManager;
use lora_train::job::{JobError, RunOptions};
use std::path::{Path, PathBuf};

/// Runs `train`.
pub fn run(config: &Path, resume: Option<Option<PathBuf>>, force: bool) -> Result<i32, CliError> {
    let cfg = TrainConfig::from_file(config)?;
    // Both jobs: `system.device: cuda` without CUDA is refused before anything loads.
    lora_train::job::check_device(&cfg)?;
    let out_dir = PathBuf::from(&cfg.train.output_dir);
    let opts = RunOptions {
        config_dir: config.parent().map(Path::to_path_buf),
        force,
        verbose: true,
        resume,
    };
    let recipe = super::plan::recipe_for(&cfg, opts.config_dir.as_deref())?;
    install_stop_handlers();
    let result = recipe.train(cfg, &opts).map(|_| ());
    match result {
        Err(JobError::Interrupted { step, checkpoint }) => {
            interrupted(config, &out_dir, step, checkpoint)
        }
        // A job that does not check the stop request itself (the trainer still stops at a step
        // boundary and saves) ends normally: report the interrupt the same way.
        Ok(()) if lora_train::engine::stop_requested() => interrupted(config, &out_dir, 0, None),
        Ok(()) => Ok(EXIT_OK),
        Err(e) => Err(e.into()),
    }
}

/// Says where the run stopped and how to continue it; exit 130.
fn interrupted(
    config: &Path,
    out_dir: &Path,
    step: u64,
    checkpoint: Option<PathBuf>,
) -> Result<i32, CliError> {
    let checkpoint = checkpoint.or_else(|| {
        CheckpointManager::new(out_dir.join("checkpoints"), 1)
            .latest()
            .ok()
            .flatten()
    });
    match checkpoint {
        Some(c) => {
            let at = if step > 0 {
                format!(" at step {step}")
            } else {
                String::new()
            };
            eprintln!(
                "interrupted{at}; the last checkpoint is {}\ncontinue with: lora-train train --config {} --resume {}",
                c.display(),
                shell_quote(&config.display().to_string()),
                shell_quote(&c.display().to_string())
            );
        }
        None => eprintln!(
            "interrupted before the first checkpoint; nothing was saved (start again with: \
             lora-train train --config {})",
            shell_quote(&config.display().to_string())
        ),
    }
    Err(CliError {
        code: stopped_exit_code(),
        // Said above.
        message: String::new(),
    })
}

/// `s` as one POSIX shell word: unchanged when it has only safe characters, else in single
/// quotes (a `'` inside becomes `'\''`).
fn shell_quote(s: &str) -> String {
    let safe = !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./=:,+@%".contains(c));
    if safe {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The signal that asked the run to stop (0 = none yet).
static STOP_SIGNAL: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

/// The SIGINT / SIGTERM handler: atomic stores and one `write(2)`, all async-signal-safe. The
/// loop acts on the flag at the next step boundary.
#[cfg(unix)]
extern "C" fn on_stop_signal(sig: libc::c_int) {
    STOP_SIGNAL.store(sig, std::sync::atomic::Ordering::SeqCst);
    lora_train::engine::request_stop();
    let msg: &[u8] = if sig == libc::SIGTERM {
        b"\nSIGTERM: stopping after the current step and saving a checkpoint (a second signal quits at once)\n"
    } else {
        b"\nCtrl-C: stopping after the current step and saving a checkpoint (Ctrl-C again quits at once)\n"
    };
    // SAFETY: write(2) on fd 2 with a valid buffer of the given length.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// Installs [`on_stop_signal`] for SIGINT and SIGTERM with `SA_RESETHAND`, so a second signal
/// gets the default action.
fn install_stop_handlers() {
    #[cfg(unix)]
    // SAFETY: a zeroed sigaction with a handler of the right signature, an emptied mask and
    // plain flags; sigaction(2) copies it.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_stop_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

/// The exit code of a run a signal stopped: 128 + the signal, as shells report it.
fn stopped_exit_code() -> i32 {
    #[cfg(unix)]
    if STOP_SIGNAL.load(std::sync::atomic::Ordering::SeqCst) == libc::SIGTERM {
        return EXIT_TERMINATED;
    }
    EXIT_INTERRUPTED
}

#[cfg(test)]
mod tests {
    use super::shell_quote;

    #[test]
    fn shell_quote_leaves_plain_paths_and_quotes_the_rest() {
        assert_eq!(
            shell_quote("out/run/checkpoints/step-00000004"),
            "out/run/checkpoints/step-00000004"
        );
        assert_eq!(shell_quote("my runs/a.yaml"), "'my runs/a.yaml'");
        assert_eq!(shell_quote("it's.yaml"), r"'it'\''s.yaml'");
    }
}
