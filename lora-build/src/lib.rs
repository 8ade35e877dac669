//! Build-script helper for crates and apps that link libtorch through `tch`: bakes libtorch's
//! library folder into the binaries as an rpath, so they start without `LD_LIBRARY_PATH`, and
//! keeps `libtorch_cuda.so` linked, so CUDA is found on GPU machines.
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
#![deny(missing_docs)]

use std::path::PathBuf;

/// The environment variables a build script may find libtorch's library folder in, in order.
pub const LIBTORCH_LIB_VARS: [&str; 2] = ["DEP_TCH_LIBTORCH_LIB", "DEP_LORA_TRAIN_LIBTORCH_LIB"];

/// libtorch's library folder as the build script sees it, or `None` in builds that link no
/// libtorch (docs.rs `doc-only` builds).
pub fn libtorch_lib_dir() -> Option<PathBuf> {
    LIBTORCH_LIB_VARS.iter().find_map(|v| {
        println!("cargo:rerun-if-env-changed={v}");
        std::env::var_os(v).map(PathBuf::from)
    })
}

/// Emits the link arguments for this package's binaries, tests, examples and benches: an rpath
/// to libtorch's library folder, and `libtorch_cuda.so` kept as a dependency when the folder has
/// it. Does nothing when no folder is known (see [`libtorch_lib_dir`]).
pub fn link_libtorch_at_runtime() {
    let Some(lib) = libtorch_lib_dir() else {
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
