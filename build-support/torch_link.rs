// Shared by the build scripts of every crate that links libtorch (`include!`d, not a crate).
//
// Plain tch binaries carry no rpath, so a test executable or `lora-train` built here would fail to
// start with "libtorch_cpu.so: cannot open shared object file" unless LD_LIBRARY_PATH is set; and
// the linker's `--as-needed` drops `libtorch_cuda.so` (nothing references it by symbol), so CUDA
// reads as unavailable on a GPU machine (tch-rs issue #980). torch-sys publishes the libtorch
// library folder as `DEP_TCH_LIBTORCH_LIB` (its `links = "tch"` metadata); we bake it in as an
// rpath and force `libtorch_cuda.so` to stay a dependency when the folder has it.
//
// `cargo:rustc-link-arg` applies to this package's binaries, tests, examples and benches only,
// which is why each tch crate's build script calls this.

/// Emits the rpath / no-as-needed link arguments for libtorch.
#[allow(dead_code)]
fn link_libtorch_at_runtime() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        // doc-only builds: nothing is linked.
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    if std::path::Path::new(&lib).join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}
