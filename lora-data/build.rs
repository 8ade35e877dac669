fn main() {
    lora_build::link_libtorch_at_runtime();
}
