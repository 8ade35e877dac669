//! Small helpers shared by the tasks.

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;
use std::process::Command;

/// Runs `cmd` with inherited stdio; a failure names `what` and the exit status.
pub fn run(cmd: &mut Command, what: &str) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("could not start {what} ({:?})", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Runs `cmd` capturing stdout; `Ok(None)` when the program is missing or exits non-zero.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Hex sha256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// Free bytes on the file system holding `path` (via `df`; `None` when it cannot be read).
pub fn free_bytes(path: &Path) -> Option<u64> {
    let out = output(Command::new("df").arg("-Pk").arg(path))?;
    let line = out.lines().nth(1)?;
    let avail_kib: u64 = line.split_whitespace().nth(3)?.parse().ok()?;
    Some(avail_kib * 1024)
}

/// Fails with a clear message when fewer than `need` bytes are free under `path`.
pub fn require_free(path: &Path, need: u64, step: &str) -> Result<()> {
    if let Some(free) = free_bytes(path)
        && free < need
    {
        bail!(
            "{step}: only {:.1} GB free under {}, {:.1} GB needed. Free some disk space (or move the \
             checkout to a larger disk) and run `cargo xtask setup` again.",
            free as f64 / 1e9,
            path.display(),
            need as f64 / 1e9
        );
    }
    Ok(())
}

/// Total size in bytes and file count of a folder tree.
pub fn tree_size(path: &Path) -> (u64, u64) {
    let mut bytes = 0;
    let mut files = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&p) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(md) = e.metadata() else { continue };
            if md.is_dir() {
                stack.push(e.path());
            } else {
                bytes += md.len();
                files += 1;
            }
        }
    }
    (bytes, files)
}

/// Human-readable size (MB = 1e6 bytes).
pub fn human(bytes: u64) -> String {
    if bytes >= 1_000_000_000 {
        format!("{:.2} GB", bytes as f64 / 1e9)
    } else if bytes >= 1_000_000 {
        format!("{:.1} MB", bytes as f64 / 1e6)
    } else {
        format!("{:.1} kB", bytes as f64 / 1e3)
    }
}
