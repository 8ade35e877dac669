//! Exact tensor bytes of the VAE decode that sample grids use, counted by the shim's CPU
//! allocator (`lora_core::sys::cpu_mem_stats`): [`AutoencoderKL::decode_each`] holds one
//! image's decoder activations at a time, [`AutoencoderKL::decode`] the whole batch's. One test
//! in this file: the counter is process-wide, so no other test may allocate meanwhile.

#[path = "models/common.rs"]
#[allow(dead_code)]
mod common;

use lora_core::sys;
use lora_models::sd::{AutoencoderKL, LoadOptions};
use tch::{Device, Kind, Tensor};

#[test]
fn decoding_one_image_at_a_time_holds_one_images_activations() {
    sys::install_counting_cpu_allocator().unwrap();
    tch::set_num_threads(1);
    // diffusers' AutoencoderKL with block_out_channels (32, 64), random weights
    let dir = common::interop_fixtures("sd_vae.py");
    let vae = AutoencoderKL::from_diffusers(dir.path(), &LoadOptions::default()).unwrap();
    tch::manual_seed(0);
    // four 128 × 128 images (latents 64 × 64)
    let z = Tensor::randn([4, 4, 64, 64], (Kind::Float, Device::Cpu));
    let _g = tch::no_grad_guard();
    let peak_of = |f: &dyn Fn() -> Tensor| {
        let before = sys::cpu_mem_stats().unwrap().current_bytes as i64;
        sys::cpu_reset_peak().unwrap();
        let img = f();
        let peak = sys::cpu_mem_stats().unwrap().peak_bytes as i64 - before;
        (img, peak)
    };
    let (all, batch_peak) = peak_of(&|| vae.decode(&z).unwrap());
    let (each, each_peak) = peak_of(&|| vae.decode_each(&z).unwrap());
    assert_eq!(each.size(), vec![4, 3, 128, 128]);
    let (abs, rel) = common::diff(&each, &all);
    println!(
        "decode of 4 images of 128 × 128: the batch at once peaks {:.1} MB above its input, one \
         at a time {:.1} MB ({:.2}×); max abs diff {abs:.2e}",
        batch_peak as f64 / 1e6,
        each_peak as f64 / 1e6,
        each_peak as f64 / batch_peak as f64
    );
    assert!(
        rel < 1e-5,
        "decode_each differs from decode: {abs:.3e} ({rel:.3e})"
    );
    // the images themselves (4 × 0.2 MB, kept and concatenated) are all the batch adds
    let images = 4 * 3 * 128 * 128 * 4;
    assert!(
        each_peak < batch_peak / 3 + 2 * images,
        "one at a time {each_peak} B vs the batch {batch_peak} B"
    );
}
