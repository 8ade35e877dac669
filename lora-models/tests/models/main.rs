//! lora-models' integration tests in one test executable (one link against libtorch): the
//! real SmolLM2 GGUF ([`smollm2`]) and its logits against transformers ([`interop`]), tiny
//! random-weight LLaMA-family models ([`tiny`], [`gguf_tiny`]), and Stable Diffusion: the CLIP
//! tokenizer and text encoders ([`clip`]), the noise schedule, loss and samplers
//! ([`diffusion`]), the UNet ([`unet`]) and the VAE ([`vae`]); FLUX.1: the transformer and its
//! key mapping ([`flux`]), the T5 encoder ([`t5`]), flow matching ([`flow`]) and the whole
//! pipeline ([`flux_pipeline`]) — each against its Python reference.

mod clip;
mod common;
mod diffusion;
mod flow;
mod flux;
mod flux_bases;
mod flux_lora;
mod flux_pipeline;
mod gguf_tiny;
mod interop;
mod smollm2;
mod t5;
mod tiny;
mod unet;
mod vae;

/// libtorch's generator is process-wide: tests that seed it or draw from it (seeded sampling,
/// adapter initialisation, dropout) must not interleave, across all modules of this executable.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Holds the generator for the calling test (a test that panicked while holding it does not
/// poison it for the others).
fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}
