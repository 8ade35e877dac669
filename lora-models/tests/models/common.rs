//! Shared helpers of the integration tests: the real SmolLM2 GGUF, loaded once per test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use safetensors::SafeTensors;
use tch::Tensor;

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

/// The interop venv's Python (`.venv/bin/python`, created by `cargo xtask setup`).
pub fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `cargo xtask setup` (it creates the interop venv)",
        py.display()
    );
    py
}

/// Runs `tests/interop/<script> --out <a new temporary folder>` with one OpenMP thread and
/// returns the folder (callers keep it in a `OnceLock`, so each script runs once per binary).
pub fn interop_fixtures(script: &str) -> tempfile::TempDir {
    let out = tempfile::tempdir().unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/interop")
        .join(script);
    let res = Command::new(python())
        .arg(&path)
        .arg("--out")
        .arg(out.path())
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "{script} failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    out
}

/// The tensor `name` of safetensors `bytes` (F32 → `Kind::Float`, I64 → `Kind::Int64`).
pub fn st_tensor(bytes: &[u8], name: &str) -> Tensor {
    let st = SafeTensors::deserialize(bytes).unwrap();
    let v = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("reference tensor {name} missing"));
    let kind = match v.dtype() {
        safetensors::Dtype::F32 => Kind::Float,
        safetensors::Dtype::I64 => Kind::Int64,
        d => panic!("unexpected dtype {d:?} of {name}"),
    };
    let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
    Tensor::from_data_size(v.data(), &shape, kind)
}

/// (max |a − b|, max |a − b| / max |b|), `a` compared in f32.
pub fn diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    assert_eq!(a.size(), b.size());
    let d = f64::try_from((&a.to_kind(Kind::Float) - b).abs().max()).unwrap();
    (d, d / f64::try_from(b.abs().max()).unwrap())
}
