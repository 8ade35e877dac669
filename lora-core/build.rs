/// Compiles `shim/shim.cpp` (bf16 autocast, allocator statistics, RNG state),
/// `shim/qlinear.cpp` (linear layers over quantized weights), `shim/bf16_linear.cpp` (bf16
/// autocast's linear by f32 GEMMs), `shim/dist.cpp` (c10d
/// collectives; with Gloo when [`gloo_include`] finds gloo's headers) and, when
/// [`nccl_includes`] finds what it needs, `shim/dist_nccl.cpp` (c10d's NCCL process group)
/// against the libtorch that torch-sys found. torch-sys publishes its library folder as `DEP_TCH_LIBTORCH_LIB`; the
/// headers sit next to it in `../include`.
fn build_shim() {
    println!("cargo::rustc-check-cfg=cfg(lora_gloo)");
    println!("cargo::rustc-check-cfg=cfg(lora_nccl)");
    for f in [
        "shim/shim.cpp",
        "shim/qlinear.cpp",
        "shim/bf16_linear.cpp",
        "shim/dist.cpp",
        "shim/dist.h",
        "shim/profiler.cpp",
        "shim/f32_linear.cpp",
        "shim/decoder_ops.cpp",
        "shim/attention.cpp",
        "shim/lora_branch.cpp",
        "shim/dist_nccl.cpp",
        "shim/guard.h",
        "shim/cpu_math.h",
        "shim/cpu_gemm.h",
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
    let gcc = {
        let tool = build.get_compiler();
        tool.is_like_gnu() && !tool.is_like_clang()
    };
    let openmp = if gcc {
        openmp_runtime(std::path::Path::new(&lib), &include)
    } else {
        None
    };
    if openmp.is_some() {
        build.flag("-fopenmp");
    }
    let nccl = nccl_includes(std::path::Path::new(&lib), &include);
    if let Some(dirs) = &nccl {
        for d in dirs {
            build.include(d);
        }
        build
            .define("USE_C10D_NCCL", None)
            .file("shim/dist_nccl.cpp");
        println!("cargo:rustc-cfg=lora_nccl");
    }
    build
        .cpp(true)
        .file("shim/shim.cpp")
        .file("shim/qlinear.cpp")
        .file("shim/bf16_linear.cpp")
        .file("shim/dist.cpp")
        .file("shim/profiler.cpp")
        .file("shim/f32_linear.cpp")
        .file("shim/decoder_ops.cpp")
        .file("shim/attention.cpp")
        .file("shim/lora_branch.cpp")
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
        // lets GCC vectorize loops with float compares (decoder_ops.cpp's clamps) on AVX2 and
        // SSE: no value changes, only which floating-point exception flags could be raised
        .flag_if_supported("-fno-trapping-math")
        // and loops with `sqrt` (the fused AdamW): no `errno` is ever read
        .flag_if_supported("-fno-math-errno")
        // no multiply-adds fused by the compiler: the AVX-512 and AVX2 builds of a loop (only the
        // first has FMA) give the same bits, and each operation rounds as written
        .flag_if_supported("-ffp-contract=off")
        .define("_GLIBCXX_USE_CXX11_ABI", abi.as_str())
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false)
        .compile("lora_core_shim");
    if let Some(runtime) = &openmp {
        println!("cargo:rustc-link-lib=dylib:+verbatim={runtime}");
    }
    if nccl.is_some() {
        // ProcessGroupNCCL and c10::cuda live in these; named after the shim so they resolve it
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
}

/// The file name of libtorch's own GNU OpenMP runtime to build the shim against, or `None` (the
/// shim's loops then run on the calling thread). libtorch's `at::parallel_for` is a header
/// template: in an OpenMP build of libtorch (`AT_PARALLEL_OPENMP 1` in `ATen/Config.h`, the Linux
/// wheels) it opens an `omp parallel` region only when the including file is compiled with
/// `-fopenmp`, and silently runs the whole range on one thread otherwise. Linking the very
/// `libgomp` that libtorch loads — `libgomp.so.1` (the PyPI wheels) or `libgomp-<hash>.so.1` (the
/// libtorch archives) beside `libtorch_cpu.so`, same soname — keeps one runtime and one thread
/// pool per process, so `at::set_num_threads` governs the shim's loops too. Where no such file
/// is there (a libtorch on Intel's OpenMP, or on a system libgomp it does not ship) the shim
/// stays without OpenMP rather than risk a second runtime. Linux with GCC only.
fn openmp_runtime(lib: &std::path::Path, include: &std::path::Path) -> Option<String> {
    if std::env::var("CARGO_CFG_TARGET_OS").ok().as_deref() != Some("linux") {
        return None;
    }
    let config = std::fs::read_to_string(include.join("ATen").join("Config.h")).ok()?;
    if !config
        .lines()
        .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["#define", "AT_PARALLEL_OPENMP", "1"])
    {
        return None;
    }
    let mut found: Vec<String> = std::fs::read_dir(lib)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n == "libgomp.so.1" || (n.starts_with("libgomp-") && n.ends_with(".so.1")))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// The include folders c10d's `ProcessGroupNCCL.hpp` needs besides libtorch's, or `None` (the
/// shim is then built without NCCL) when libtorch has no `libtorch_cuda.so` or a header is
/// missing: `nccl.h`, the CUDA runtime's `cuda_runtime_api.h`, `crt/host_config.h` and CCCL's
/// `nv/target`. Looked for in `LORA_CUDA_INCLUDE` (folders separated by `:`; `cargo xtask
/// setup` provisions `assets/cuda/include`), the NVIDIA wheels beside a Python torch
/// (`site-packages/nvidia/{cu13,nccl,…}/include`), `$CUDA_HOME/include`,
/// `/usr/local/cuda/include` and `/usr/include`.
fn nccl_includes(
    lib: &std::path::Path,
    libtorch_include: &std::path::Path,
) -> Option<Vec<std::path::PathBuf>> {
    use std::path::PathBuf;
    println!("cargo:rerun-if-env-changed=LORA_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if !lib.join("libtorch_cuda.so").exists()
        || !libtorch_include
            .join("torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
            .is_file()
    {
        return None;
    }
    let mut candidates: Vec<PathBuf> = std::env::var("LORA_CUDA_INCLUDE")
        .map(|v| {
            v.split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default();
    // a Python torch: <site-packages>/torch/lib → <site-packages>/nvidia/*/include
    if let Ok(real) = lib.canonicalize()
        && let Some(site) = real.parent().and_then(|t| t.parent())
        && let Ok(entries) = std::fs::read_dir(site.join("nvidia"))
    {
        let mut wheels: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path().join("include"))
            .filter(|p| p.is_dir())
            .collect();
        wheels.sort();
        candidates.extend(wheels);
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    candidates.push(PathBuf::from("/usr/include"));
    let mut dirs = Vec::new();
    for header in [
        "nccl.h",
        "cuda_runtime_api.h",
        "crt/host_config.h",
        "nv/target",
    ] {
        let dir = candidates.iter().find(|d| d.join(header).is_file())?;
        println!("cargo:rerun-if-changed={}", dir.join(header).display());
        if !dirs.contains(dir) {
            dirs.push(dir.clone());
        }
    }
    Some(dirs)
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
