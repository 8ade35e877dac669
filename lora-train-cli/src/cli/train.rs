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

/// `train --nproc-per-node N`: starts N workers of this binary with torchrun's variables
/// (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, a free
/// `MASTER_PORT`) and supervises them as torchrun's elastic agent does with no restarts: the
/// first worker to fail stops the others, and its exit code is returned with its rank named.
pub fn launch(
    n: u32,
    config: &Path,
    resume: Option<Option<PathBuf>>,
    force: bool,
) -> Result<i32, CliError> {
    if n == 0 {
        return Err(CliError::usage(
            "--nproc-per-node 0: use 1 or more processes",
        ));
    }
    if std::env::var_os("WORLD_SIZE").is_some() {
        return Err(CliError::usage(
            "--nproc-per-node inside a launcher that already set WORLD_SIZE (torchrun, srun): drop one of the two",
        ));
    }
    if n == 1 {
        return run(config, resume, force);
    }
    let exe = std::env::current_exe().map_err(|e| {
        CliError::runtime(format!("cannot find this program to start workers: {e}"))
    })?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| {
            CliError::runtime(format!("cannot find a free port for the rendezvous: {e}"))
        })?;
    let mut args: Vec<std::ffi::OsString> = vec!["train".into(), "--config".into(), config.into()];
    if let Some(r) = &resume {
        args.push("--resume".into());
        if let Some(dir) = r {
            args.push(dir.into());
        }
    }
    if force {
        args.push("--force".into());
    }
    eprintln!("starting {n} data-parallel workers (MASTER_ADDR=127.0.0.1 MASTER_PORT={port})");
    let mut children = Vec::with_capacity(n as usize);
    for rank in 0..n {
        let child = std::process::Command::new(&exe)
            .args(&args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in children.iter_mut() {
                    let _ = c.kill();
                }
                return Err(CliError::runtime(format!(
                    "cannot start worker {rank}: {e}"
                )));
            }
        }
    }
    install_stop_handlers();
    let mut running: Vec<Option<std::process::Child>> = children.into_iter().map(Some).collect();
    let mut forwarded = false;
    loop {
        // a stop signal sent to this launcher alone (a scheduler's SIGTERM) goes to the workers,
        // which agree on the step to stop at and checkpoint there
        #[cfg(unix)]
        if !forwarded && lora_train::engine::stop_requested() {
            forwarded = true;
            for c in running.iter().flatten() {
                // SAFETY: kill(2) on our own child's pid.
                unsafe {
                    libc::kill(c.id() as libc::pid_t, libc::SIGTERM);
                }
            }
        }
        let mut all_done = true;
        for rank in 0..running.len() {
            let Some(child) = running[rank].as_mut() else {
                continue;
            };
            match child.try_wait() {
                Ok(Some(status)) if status.success() => running[rank] = None,
                Ok(Some(status)) => {
                    // one worker failed: the others would wait at the next collective
                    for c in running.iter_mut().flatten() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    let code = status.code().unwrap_or(1);
                    eprintln!(
                        "data-parallel worker {rank} of {n} failed ({status}); the other workers were stopped"
                    );
                    return Ok(code);
                }
                Ok(None) => all_done = false,
                Err(e) => {
                    return Err(CliError::runtime(format!("waiting for worker {rank}: {e}")));
                }
            }
        }
        if all_done {
            return Ok(if forwarded {
                stopped_exit_code()
            } else {
                EXIT_OK
            });
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
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
