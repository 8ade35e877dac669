//! What the Stable Diffusion tests share: the workspace root, the interop venv's Python, the
//! scripts of `tests/sd_interop/`, and the tiny random-weight pipelines (with a kohya folder of
//! real emoji) that `make_pipeline.py` writes.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The interop venv's Python (`cargo xtask setup` creates it).
pub fn python() -> PathBuf {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `cargo xtask setup` (it creates the interop venv)",
        py.display()
    );
    py
}

/// Runs `tests/sd_interop/<name>` with `args`, one OpenMP thread, asserting it succeeds.
pub fn script(name: &str, args: &[&OsStr]) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sd_interop")
        .join(name);
    let res = Command::new(python())
        .arg(&path)
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{name} failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
}

/// Writes the tiny pipeline and the emoji folder into `out` (`make_pipeline.py --assets assets
/// --out <out>` and `extra`: `--sdxl`, `--single-file`, `--n N`).
pub fn make_pipeline(out: &Path, extra: &[&str]) {
    let assets = root().join("assets");
    assert!(
        assets.join("emoji/openmoji.csv").is_file(),
        "assets/emoji is missing: run `cargo xtask setup`"
    );
    let mut args: Vec<&OsStr> = vec![
        "--assets".as_ref(),
        assets.as_os_str(),
        "--out".as_ref(),
        out.as_os_str(),
    ];
    args.extend(extra.iter().map(OsStr::new));
    script("make_pipeline.py", &args);
}
