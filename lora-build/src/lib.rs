//! Build-script helper for crates and apps that link libtorch through `tch`: bakes libtorch's
//! library folder into the binaries as an rpath, so they start without `LD_LIBRARY_PATH`, keeps
//! `libtorch_cuda.so` linked, so CUDA is found on GPU machines, and checks that the libtorch is a
//! version the SDK works with.
//!
//! Plain tch binaries carry no rpath (they fail with "libtorch_cpu.so: cannot open shared object
//! file"), and the linker's `--as-needed` drops `libtorch_cuda.so` because nothing references it
//! by symbol, so CUDA reads as unavailable on a GPU box (tch-rs issue #980). A dependency's
//! `cargo:rustc-link-arg` does not reach the binaries of the packages that use it, so every
//! package with binaries, tests or examples that link libtorch calls this from its `build.rs`:
//!
//! ```no_run
//! // build.rs of an app with `lora-train` in [dependencies] and `lora-build` in
//! // [build-dependencies]
//! fn main() {
//!     lora_build::link_libtorch_at_runtime();
//! }
//! ```
//!
//! The folder comes from `torch-sys` (`DEP_TCH_LIBTORCH_LIB`, for packages that depend on it
//! directly) or from `lora-train` (`DEP_LORA_TRAIN_LIBTORCH_LIB`, for apps that depend on the
//! SDK).
//!
//! # Versions
//!
//! tch 0.26 is generated from PyTorch 2.13.0's operator list, and `torch-sys` refuses any other
//! version unless `LIBTORCH_BYPASS_VERSION_CHECK` is set, but only where it can read the version
//! (a libtorch zip's `build-version`, or `LIBTORCH_USE_PYTORCH`); a Python wheel's `torch/`
//! folder passes unchecked. [`check_libtorch_version`] (lora-core's build script calls it) is the
//! check that always runs once torch-sys has built: the versions in [`SUPPORTED_TORCH`] build and
//! pass the SDK's tests, anything else stops the build with a message naming them, unless
//! [`ALLOW_ANY_TORCH_VAR`] is set. It cannot run before torch-sys's own C++ compile: a libtorch
//! older than the operators tch's bindings call fails there first, with errors such as
//! `'_philox_key_split' is not a member of 'torch'` (PyTorch 2.11). `cargo xtask setup` checks
//! `LIBTORCH` against the same list before any build.
#![deny(missing_docs)]

use std::path::{Path, PathBuf};

/// The environment variables a build script may find libtorch's library folder in, in order.
pub const LIBTORCH_LIB_VARS: [&str; 2] = ["DEP_TCH_LIBTORCH_LIB", "DEP_LORA_TRAIN_LIBTORCH_LIB"];

/// The PyTorch releases (`major.minor`, any patch and local suffix such as `+cu130`) whose
/// libtorch tch 0.26's bindings and lora-core's C++ shim compile against and the lora-core,
/// lora-models and lora-train tests pass with (the README's "Other PyTorch versions" has the
/// runs). 2.11 is not among them: tch 0.26's generated bindings call 13 operators that 2.11 does
/// not have (`_philox_key_split`, `_upsample_lanczos2d_aa`, `_flash_attention_forward_no_dropout_inplace`,
/// …) and `_scaled_dot_product_attention_math_for_mps` with an argument 2.11 lacks, so
/// torch-sys's C++ does not compile.
pub const SUPPORTED_TORCH: [&str; 2] = ["2.12", "2.13"];

/// Set (to anything) to build against a libtorch outside [`SUPPORTED_TORCH`] anyway; a version
/// whose C++ API differs fails later, in the C++ compile or at link time.
pub const ALLOW_ANY_TORCH_VAR: &str = "LORA_ALLOW_ANY_LIBTORCH";

/// Replaces the rpath [`link_libtorch_at_runtime`] writes (the build machine's libtorch folder)
/// with this value, which may use `$ORIGIN` (the folder of the binary): how `cargo xtask bundle`
/// builds a binary that looks for libtorch beside itself instead of on the build machine.
pub const RPATH_VAR: &str = "LORA_BUILD_RPATH";

/// libtorch's library folder as the build script sees it, or `None` in builds that link no
/// libtorch (docs.rs `doc-only` builds).
pub fn libtorch_lib_dir() -> Option<PathBuf> {
    LIBTORCH_LIB_VARS.iter().find_map(|v| {
        println!("cargo:rerun-if-env-changed={v}");
        std::env::var_os(v).map(PathBuf::from)
    })
}

/// Emits the link arguments for this package's binaries, tests, examples and benches: an rpath
/// to libtorch's library folder (or [`RPATH_VAR`]'s value when set), and `libtorch_cuda.so` kept
/// as a dependency when the folder has it. Does nothing when no folder is known (see
/// [`libtorch_lib_dir`]).
pub fn link_libtorch_at_runtime() {
    let Some(lib) = libtorch_lib_dir() else {
        return;
    };
    println!("cargo:rerun-if-env-changed={RPATH_VAR}");
    match std::env::var(RPATH_VAR) {
        Ok(rpath) if !rpath.is_empty() => println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}"),
        _ => println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display()),
    }
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}

/// The PyTorch version of a libtorch folder (the one holding `lib/` and `include/`): a libtorch
/// zip's `build-version` or a Python wheel's `version.py` (`__version__ = '2.13.0+cu130'`),
/// returned as written, local suffix included. `None` when neither file is there or readable.
pub fn libtorch_version(root: &Path) -> Option<String> {
    if let Ok(s) = std::fs::read_to_string(root.join("build-version")) {
        let v = s.trim();
        if !v.is_empty() {
            return Some(v.to_string());
        }
    }
    let s = std::fs::read_to_string(root.join("version.py")).ok()?;
    let line = s.lines().find(|l| l.starts_with("__version__"))?;
    let v = line.split(['\'', '"']).nth(1)?.trim();
    (!v.is_empty()).then(|| v.to_string())
}

/// `major.minor` of a version such as `2.13.0+cu130`, or `None` when it does not start with two
/// numbers.
pub fn major_minor(version: &str) -> Option<String> {
    let core = version.split('+').next()?;
    let mut parts = core.split('.');
    let major: u32 = parts.next()?.trim().parse().ok()?;
    let minor: u32 = parts.next()?.trim().parse().ok()?;
    Some(format!("{major}.{minor}"))
}

/// Whether `version` (e.g. `2.13.0+cu130`) is a release of [`SUPPORTED_TORCH`].
pub fn is_supported(version: &str) -> bool {
    major_minor(version).is_some_and(|mm| SUPPORTED_TORCH.contains(&mm.as_str()))
}

/// Checks the libtorch this build links (found as in [`libtorch_lib_dir`]; its version from
/// [`libtorch_version`] of the folder above `lib/`) against [`SUPPORTED_TORCH`].
///
/// Returns the version found (`None` when the build links no libtorch or the folder carries no
/// version file, which is let through: a source build may have neither).
///
/// # Errors
/// A message naming the folder, the version found, the supported ones and the ways out, when
/// the version is outside [`SUPPORTED_TORCH`] and [`ALLOW_ANY_TORCH_VAR`] is not set. Build
/// scripts print it and exit non-zero.
pub fn check_libtorch_version() -> Result<Option<String>, String> {
    println!("cargo:rerun-if-env-changed={ALLOW_ANY_TORCH_VAR}");
    let Some(lib) = libtorch_lib_dir() else {
        return Ok(None);
    };
    let root = lib.parent().map(Path::to_path_buf).unwrap_or(lib);
    let Some(version) = libtorch_version(&root) else {
        return Ok(None);
    };
    if is_supported(&version) || std::env::var_os(ALLOW_ANY_TORCH_VAR).is_some() {
        return Ok(Some(version));
    }
    Err(format!(
        "libtorch at {} is PyTorch {version}; lora-sdk builds against PyTorch {} (tch 0.26's bindings \
         and lora-core's C++ shim are tested with those). Point LIBTORCH at one of them (a libtorch \
         folder or a Python wheel's torch/ folder), or unset LIBTORCH to use the project's .venv \
         (`cargo xtask setup`); set {ALLOW_ANY_TORCH_VAR}=1 to try this version anyway, at your own risk \
         (with a libtorch zip, tch also needs LIBTORCH_BYPASS_VERSION_CHECK=1).",
        root.display(),
        supported_list(),
    ))
}

/// [`SUPPORTED_TORCH`] as prose: `2.13.x`, or `2.12.x or 2.13.x` for two.
pub fn supported_list() -> String {
    let v: Vec<String> = SUPPORTED_TORCH.iter().map(|s| format!("{s}.x")).collect();
    match v.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} or {last}", rest.join(", ")),
        Some((last, _)) => last.clone(),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn major_minor_reads_release_and_local_versions() {
        assert_eq!(major_minor("2.13.0+cu130").as_deref(), Some("2.13"));
        assert_eq!(major_minor("2.11.0").as_deref(), Some("2.11"));
        assert_eq!(major_minor("2.12.1+cpu").as_deref(), Some("2.12"));
        assert_eq!(major_minor("garbage"), None);
        assert_eq!(major_minor("2"), None);
    }

    #[test]
    fn supported_versions_are_the_tested_releases() {
        assert!(is_supported("2.13.0+cu130"));
        assert!(is_supported("2.13.1"));
        assert!(is_supported("2.12.0+cu130"));
        // tch 0.26's bindings do not compile against 2.11's headers
        assert!(!is_supported("2.11.0"));
        assert!(!is_supported("2.10.0"));
        assert!(!is_supported("2.1.3"));
        assert!(!is_supported("3.13.0"));
        assert!(supported_list().ends_with("2.13.x"), "{}", supported_list());
    }

    #[test]
    fn version_is_read_from_build_version_then_version_py() {
        let dir = std::env::temp_dir().join(format!("lora-build-version-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        assert_eq!(libtorch_version(&dir), None);
        std::fs::write(
            dir.join("version.py"),
            "from typing import Optional\n__version__ = '2.11.0+cu128'\ndebug = False\n",
        )
        .expect("write version.py");
        assert_eq!(libtorch_version(&dir).as_deref(), Some("2.11.0+cu128"));
        std::fs::write(dir.join("build-version"), "2.13.0+cpu\n").expect("write build-version");
        assert_eq!(libtorch_version(&dir).as_deref(), Some("2.13.0+cpu"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
