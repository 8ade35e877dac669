//! libtorch and the Python interop venv.
//!
//! tch 0.26 links libtorch 2.13.0. PyPI's `torch==2.13.0` wheel carries a complete libtorch
//! (`torch/lib/*.so` + `torch/include`), and it is what the interop peers (transformers, peft, …)
//! need anyway, so one venv serves both: `.venv/libtorch` links to the wheel's `torch/` folder and
//! `.cargo/config.toml` points `LIBTORCH` there. A user who already has libtorch 2.13.0 sets
//! `LIBTORCH` themselves; it is version-checked and used for linking.

use crate::util::{self, output, require_free, sha256_file};
use crate::{Env, TORCH_VERSION};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Disk the torch wheel and its CUDA dependencies take once installed (measured: ~4.7 GB) plus pip's
/// temporary copies.
const TORCH_DISK_BYTES: u64 = 8_000_000_000;

fn venv(root: &Path) -> PathBuf {
    root.join(".venv")
}

fn venv_python(root: &Path) -> PathBuf {
    venv(root).join("bin/python")
}

/// The `torch/` folder inside the venv's site-packages, if torch is installed there.
fn venv_torch_dir(root: &Path) -> Option<PathBuf> {
    let lib = venv(root).join("lib");
    let rd = std::fs::read_dir(&lib).ok()?;
    for e in rd.flatten() {
        let cand = e.path().join("site-packages/torch");
        if cand.join("lib").is_dir() {
            return Some(cand);
        }
    }
    None
}

/// Version of a libtorch folder without its local suffix (`2.13.0`, not `2.13.0+cu130`):
/// `build-version` (libtorch zip) or `version.py` (PyPI wheel).
pub fn libtorch_version(dir: &Path) -> Option<String> {
    let v = lora_build::libtorch_version(dir)?;
    Some(v.split('+').next().unwrap_or(&v).to_string())
}

fn base_python() -> String {
    std::env::var("LORA_SDK_PYTHON_BASE")
        .ok()
        .or_else(|| std::env::var("LORA_SDK_PYTHON").ok())
        .filter(|p| !p.contains(".venv"))
        .unwrap_or_else(|| "python3".to_string())
}

/// Makes sure the project venv has torch 2.13.0 (the interop peers need it) and returns the
/// libtorch to build with: the user's `LIBTORCH` when set and of a supported version
/// ([`lora_build::SUPPORTED_TORCH`]), else the venv's; plus the venv python.
pub fn ensure_libtorch(root: &Path) -> Result<Env> {
    ensure_venv_torch(root)?;
    let python = venv_python(root);
    let torch_dir = venv_torch_dir(root).context(
        "setup/libtorch: torch was installed but its folder was not found under .venv/lib/*/site-packages. \
         Remove .venv and run `cargo xtask setup` again.",
    )?;
    // `.venv/libtorch` -> the wheel's torch folder (relative, so the checkout can move).
    let link = venv(root).join("libtorch");
    let rel = torch_dir
        .strip_prefix(venv(root))
        .map(Path::to_path_buf)
        .unwrap_or_else(|_| torch_dir.clone());
    let current = std::fs::read_link(&link).ok();
    if current.as_deref() != Some(rel.as_path()) {
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&rel, &link).with_context(|| {
            format!("setup/libtorch: cannot create the link {}", link.display())
        })?;
    }

    // An LIBTORCH the user set (not the project default injected by .cargo/config.toml) wins.
    let default = link.clone();
    let (libtorch, libtorch_version) = match std::env::var_os("LIBTORCH").map(PathBuf::from) {
        Some(p) if !same_path(&p, &default) => {
            let v = libtorch_version(&p).with_context(|| {
                format!(
                    "setup/libtorch: LIBTORCH={} has neither build-version nor version.py: it does not look \
                     like a libtorch folder. Point LIBTORCH at libtorch {TORCH_VERSION} (the folder with lib/ \
                     and include/) or unset it to use the project's .venv.",
                    p.display()
                )
            })?;
            if !lora_build::is_supported(&v)
                && std::env::var_os(lora_build::ALLOW_ANY_TORCH_VAR).is_none()
            {
                bail!(
                    "setup/libtorch: LIBTORCH={} is libtorch {v}, but lora-sdk builds against PyTorch {} \
                     (tch 0.26's bindings and lora-core's shim are tested with those). Point LIBTORCH at \
                     one of them, or unset LIBTORCH so setup uses the project's .venv (PyPI \
                     torch=={TORCH_VERSION}); {}=1 tries this version anyway.",
                    p.display(),
                    lora_build::supported_list(),
                    lora_build::ALLOW_ANY_TORCH_VAR,
                );
            }
            eprintln!("   using your LIBTORCH={} ({v})", p.display());
            (p, v)
        }
        _ => {
            eprintln!(
                "   using .venv/libtorch -> {} ({TORCH_VERSION})",
                torch_dir.display()
            );
            (default, TORCH_VERSION.to_string())
        }
    };
    Ok(Env {
        libtorch,
        libtorch_version,
        python,
    })
}

fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

fn ensure_venv_torch(root: &Path) -> Result<()> {
    let python = venv_python(root);
    if !python.exists() {
        let base = base_python();
        if output(Command::new(&base).arg("--version")).is_none() {
            bail!(
                "setup/python: `{base}` was not found. Install Python 3.9+ with pip and venv (Debian/Ubuntu: \
                 `apt-get install python3 python3-venv python3-pip`), or set LORA_SDK_PYTHON_BASE to a python \
                 executable, and run `cargo xtask setup` again."
            );
        }
        eprintln!("   creating .venv with {base}");
        let status = Command::new(&base)
            .args(["-m", "venv"])
            .arg(venv(root))
            .status();
        if !matches!(status, Ok(s) if s.success()) || !python.exists() {
            let _ = std::fs::remove_dir_all(venv(root));
            bail!(
                "setup/python: `{base} -m venv .venv` failed. Install the venv module (Debian/Ubuntu: \
                 `apt-get install python3-venv`) and run `cargo xtask setup` again."
            );
        }
    }
    let installed = venv_torch_dir(root).and_then(|d| libtorch_version(&d));
    if installed.as_deref() == Some(TORCH_VERSION) {
        return Ok(());
    }
    if let Some(v) = &installed {
        eprintln!("   .venv has torch {v}; tch 0.26 needs {TORCH_VERSION}: reinstalling");
    }
    require_free(root, TORCH_DISK_BYTES, "setup/libtorch (torch wheel)")?;
    eprintln!(
        "   installing torch=={TORCH_VERSION} from PyPI into .venv (~4.7 GB with its CUDA libraries; a few minutes)"
    );
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
    ])
    .arg(format!("torch=={TORCH_VERSION}"));
    if util::run(&mut cmd, "pip install torch").is_err() {
        bail!(
            "setup/libtorch: `pip install torch=={TORCH_VERSION}` into .venv failed (see pip's output above). \
             Check that PyPI is reachable and that there is ~8 GB of free disk, then run `cargo xtask setup` \
             again; pip leaves no half-installed package behind."
        );
    }
    match venv_torch_dir(root).and_then(|d| libtorch_version(&d)) {
        Some(v) if v == TORCH_VERSION => Ok(()),
        other => bail!(
            "setup/libtorch: after installing, .venv reports torch {other:?} instead of {TORCH_VERSION}. \
             Remove .venv and run `cargo xtask setup` again."
        ),
    }
}

/// cmake options for building llama-cpp-python's bundled llama.cpp: no multimodal (llava/mtmd),
/// tests, examples, tools, server binary or libcurl; names from llama.cpp's and llama-cpp-python's
/// `CMakeLists.txt`.
const LLAMA_CPP_CMAKE_ARGS: &str = "-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
     -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF";

/// Added on x86-64: llama.cpp's `-march=native` build turns on its AMX int8 path (gated by
/// `__AMX_INT8__`) on CPUs with AMX, and with llama-cpp-python 0.3.36 the first decode of a Q4_1
/// model then segfaults on this project's CPU machines; without it the model runs.
const LLAMA_CPP_CMAKE_ARGS_X86_64: &str =
    " -DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8";

/// Installs `python/requirements.txt` into the venv unless the same file was installed before.
pub fn ensure_requirements(root: &Path, python: &Path) -> Result<()> {
    let req = root.join("python/requirements.txt");
    let want =
        sha256_file(&req).context("setup/python peers: python/requirements.txt is missing")?;
    let stamp = venv(root).join(".requirements.sha256");
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        eprintln!("   up to date");
        return Ok(());
    }
    require_free(root, 2_000_000_000, "setup/python peers")?;
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
        "--progress-bar",
        "off",
        "--quiet",
        "-r",
    ])
    .arg(&req);
    // llama-cpp-python ships only an sdist: pip builds llama.cpp with cmake (fetched by pip as a
    // build dependency, with a C/C++ compiler from the system). Only the library its server needs
    // is built (measured with these options: ~10 min on 2 cores); a CMAKE_ARGS already set
    // (e.g. -DGGML_CUDA=on) wins.
    if std::env::var_os("CMAKE_ARGS").is_none() {
        let mut args = LLAMA_CPP_CMAKE_ARGS.to_string();
        if cfg!(target_arch = "x86_64") {
            args.push_str(LLAMA_CPP_CMAKE_ARGS_X86_64);
        }
        cmd.env("CMAKE_ARGS", args);
    }
    if util::run(&mut cmd, "pip install -r python/requirements.txt").is_err() {
        let _ = std::fs::remove_file(&stamp);
        bail!(
            "setup/python peers: `pip install -r python/requirements.txt` failed (see pip's output above). \
             Check that PyPI is reachable and the disk has room, then run `cargo xtask setup` again."
        );
    }
    std::fs::write(&stamp, want)
        .context("setup/python peers: cannot write the install stamp in .venv")?;
    Ok(())
}

/// Prints what is installed, changing nothing.
pub fn report(root: &Path) {
    let python = venv_python(root);
    println!(
        "venv python:     {}",
        if python.exists() {
            python.display().to_string()
        } else {
            "missing (run `cargo xtask setup`)".into()
        }
    );
    match venv_torch_dir(root) {
        Some(d) => println!(
            "venv torch:      {} at {}",
            libtorch_version(&d).unwrap_or_else(|| "unknown".into()),
            d.display()
        ),
        None => println!("venv torch:      missing"),
    }
    if let Some(p) = std::env::var_os("LIBTORCH") {
        let p = PathBuf::from(p);
        println!(
            "LIBTORCH:        {} ({})",
            p.display(),
            libtorch_version(&p).unwrap_or_else(|| "not found".into())
        );
    }
    let req = root.join("python/requirements.txt");
    let stamp = venv(root).join(".requirements.sha256");
    let ok = sha256_file(&req).ok() == std::fs::read_to_string(&stamp).ok();
    println!(
        "interop peers:   {}",
        if ok {
            "installed"
        } else {
            "not installed or outdated"
        }
    );
}
