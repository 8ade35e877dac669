fn main() {
    lora_build::link_libtorch_at_runtime();
    // What `lora-train doctor` reports as the PyTorch this binary was built against.
    let version = lora_build::libtorch_lib_dir()
        .and_then(|lib| lib.parent().and_then(lora_build::libtorch_version))
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=LORA_BUILT_FOR_PYTORCH={version}");
}
