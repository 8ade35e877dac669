//! Shared helpers of the integration tests: the real SmolLM2 GGUF, loaded once per test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock};

use lora_models::llama::{Llama, WeightMode};
use lora_models::tokenizer::{Tokenizer, load_tokenizer_from_gguf};
use tch::{Device, Kind};

/// `assets/models/SmolLM2-135M-Instruct.Q4_1.gguf` (fetched by `cargo xtask setup`).
pub fn gguf_path() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask setup` to fetch the test assets (see shared ASSETS.md)",
        p.display()
    );
    p
}

pub fn init_threads() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| tch::set_num_threads(2));
}

fn load(mode: WeightMode) -> Mutex<Llama> {
    init_threads();
    Mutex::new(Llama::from_gguf(gguf_path(), mode, Device::Cpu).unwrap())
}

fn lock(m: &'static Mutex<Llama>) -> MutexGuard<'static, Llama> {
    tch::set_num_threads(2);
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The model with every weight dequantised to float32 (the golden values' setting).
pub fn dense_f32() -> MutexGuard<'static, Llama> {
    static M: OnceLock<Mutex<Llama>> = OnceLock::new();
    lock(M.get_or_init(|| load(WeightMode::Dense(Kind::Float))))
}

/// The model with Q4_1/Q8_0 weights kept quantised.
pub fn quantized() -> MutexGuard<'static, Llama> {
    static M: OnceLock<Mutex<Llama>> = OnceLock::new();
    lock(M.get_or_init(|| load(WeightMode::KeepQuantized)))
}

pub fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| load_tokenizer_from_gguf(gguf_path()).unwrap())
}

pub const ONCE: &str = "Once upon a time";
pub const FOX: &str = "The quick brown fox jumps over the lazy dog. It was a sunny day and the children were playing in the park.";
