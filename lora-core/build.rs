/// Compiles `shim/shim.cpp` (bf16 autocast, allocator statistics, RNG state) and
/// `shim/qlinear.cpp` (linear layers over quantized weights) against the libtorch
/// that torch-sys found. torch-sys publishes its library folder as `DEP_TCH_LIBTORCH_LIB`; the
/// headers sit next to it in `../include`.
fn build_shim() {
    for f in ["shim/shim.cpp", "shim/qlinear.cpp", "shim/guard.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        // doc-only builds link nothing, so there is nothing to compile against.
        return;
    };
    let include = std::path::Path::new(&lib).join("..").join("include");
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    cc::Build::new()
        .cpp(true)
        .file("shim/shim.cpp")
        .file("shim/qlinear.cpp")
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

fn main() {
    lora_build::link_libtorch_at_runtime();
    build_shim();
}
