fn main() {
    // `links = "lora_train"`: an app's build script sees this as DEP_LORA_TRAIN_LIBTORCH_LIB
    if let Some(lib) = lora_build::libtorch_lib_dir() {
        println!("cargo:libtorch_lib={}", lib.display());
    }
    lora_build::link_libtorch_at_runtime();
}
