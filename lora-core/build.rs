/// Compiles `shim/shim.cpp` (bf16 autocast, allocator statistics, RNG state),
/// `shim/qlinear.cpp` (linear layers over quantized weights) and `shim/dist.cpp` (c10d
/// collectives; with Gloo when [`gloo_include`] finds gloo's headers) against the libtorch
/// that torch-sys found. torch-sys publishes its library folder as `DEP_TCH_LIBTORCH_LIB`; the
/// headers sit next to it in `../include`.
fn build_shim() {
    println!("cargo::rustc-check-cfg=cfg(lora_gloo)");
    for f in [
        "shim/shim.cpp",
        "shim/qlinear.cpp",
        "shim/dist.cpp",
        "shim/guard.h",
    ] {
        println!("cargo:rerun-if-changed={f}");
    }
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        // doc-only builds link nothing, so there is nothing to compile against.
        return;
    };
    let include = std::path::Path::new(&lib).join("..").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    let mut build = cc::Build::new();
    if let Some(gloo) = gloo_include(&include) {
        build.include(&gloo).define("USE_C10D_GLOO", None);
        println!("cargo:rustc-cfg=lora_gloo");
    }
    build
        .cpp(true)
        .file("shim/shim.cpp")
        .file("shim/qlinear.cpp")
        .file("shim/dist.cpp")
        // the quantized-linear kernels are hot loops: optimized in every profile
        .opt_level(3)
        .include(&include)
        .include(
            include
                .join("torch")
                .join("csrc")
                .join("api")
                .join("include"),
        )
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false)
        .compile("lora_core_shim");
}

/// The folder holding gloo's headers (`gloo/algorithm.h`), which c10d's `ProcessGroupGloo.hpp`
/// includes and the torch wheel does not ship: `LORA_GLOO_INCLUDE` (what `cargo xtask setup`
/// provisions from Debian's libgloo-dev), else libtorch's own include folder (a source build
/// carries them), else the system's (`apt-get install libgloo-dev`).
fn gloo_include(libtorch_include: &std::path::Path) -> Option<std::path::PathBuf> {
    println!("cargo:rerun-if-env-changed=LORA_GLOO_INCLUDE");
    let from_env = std::env::var_os("LORA_GLOO_INCLUDE").map(std::path::PathBuf::from);
    let candidates = from_env.iter().cloned().chain([
        libtorch_include.to_path_buf(),
        std::path::PathBuf::from("/usr/include"),
    ]);
    for dir in candidates {
        let header = dir.join("gloo").join("algorithm.h");
        if header.is_file() {
            println!("cargo:rerun-if-changed={}", header.display());
            return Some(dir);
        }
    }
    // Not there yet: watch the nearest folder that exists on the way to LORA_GLOO_INCLUDE, so
    // provisioning the headers later rebuilds the shim with Gloo (a path that does not exist
    // would make cargo rerun this script on every build).
    if let Some(dir) = from_env
        && let Some(existing) = dir.ancestors().find(|a| a.is_dir())
    {
        println!("cargo:rerun-if-changed={}", existing.display());
    }
    None
}

fn main() {
    // A libtorch outside the tested versions stops here, with the versions that work, before
    // the shim's C++ compile can fail on an API difference.
    if let Err(message) = lora_build::check_libtorch_version() {
        eprintln!("error: {message}");
        std::process::exit(1);
    }
    lora_build::link_libtorch_at_runtime();
    build_shim();
}
