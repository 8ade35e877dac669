// libtorch's folder as an rpath (and libtorch_cuda kept linked): the app starts without
// LD_LIBRARY_PATH.
fn main() {
    lora_build::link_libtorch_at_runtime();
}
