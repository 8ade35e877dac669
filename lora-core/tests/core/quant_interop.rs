//! Quantized kinds against the real Python tools (`tests/interop/gguf_kquants.py`, run through the
//! project venv): every GGUF block type we read decodes exactly as the `gguf` package's
//! `gguf.quants.dequantize`, on random blocks and on tensors of a file quantized by llama.cpp
//! itself (SmolLM2 re-quantized to `Q4_K_M` and `Q5_K_M` with llama-cpp-python); fp8 e4m3fn bytes
//! equal PyTorch's `.to(torch.float8_e4m3fn)` and decode to PyTorch's values. These tests fail (they
//! never skip) when the venv, `gguf`, `llama_cpp` or the SmolLM2 asset is missing: run
//! `cargo xtask setup`.

use lora_core::quant::{QuantKind, QuantWeight, dequantize_gguf_reference, fp8_e4m3_to_f32};
use lora_memory::gguf::read_header;
use std::path::{Path, PathBuf};
use std::process::Command;
use tch::{Device, Kind, Tensor};

fn python() -> PathBuf {
    let py = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} not found: run `cargo xtask setup` to create the project venv",
        py.display()
    );
    py
}

/// Runs `gguf_kquants.py` with `args`, failing the test with its output when it fails.
fn script(args: &[&str]) {
    let out = Command::new(python())
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/interop/gguf_kquants.py"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gguf_kquants.py {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn kind_named(name: &str) -> QuantKind {
    match name {
        "Q8_0" => QuantKind::Q8_0,
        "Q4_0" => QuantKind::Q4_0,
        "Q4_1" => QuantKind::Q4_1,
        "Q5_0" => QuantKind::Q5_0,
        "Q5_1" => QuantKind::Q5_1,
        "Q4_K" => QuantKind::Q4_K,
        "Q5_K" => QuantKind::Q5_K,
        "Q6_K" => QuantKind::Q6_K,
        other => panic!("no quant kind for the GGUF type {other}"),
    }
}

fn values(t: &Tensor) -> Vec<f32> {
    let t = t.to_kind(Kind::Float).contiguous().view([-1]);
    Vec::<f32>::try_from(&t).unwrap()
}

/// Both decoders (the plain-Rust reference and the tensor ops) equal `theirs` bit for bit, rows
/// picked by `dequantize_rows` too, and the tiled kernel's product equals the dense one.
fn check_exact(what: &str, kind: QuantKind, raw: &[u8], shape: [i64; 2], theirs: &[f32]) {
    let reference = dequantize_gguf_reference(kind, raw).unwrap();
    assert_eq!(reference.len(), theirs.len(), "{what}");
    let q = QuantWeight::from_gguf_blocks(kind, raw, shape, Device::Cpu).unwrap();
    let dense = q.dequantize(Kind::Float).unwrap();
    let ours = values(&dense);
    for (i, ((r, o), t)) in reference.iter().zip(&ours).zip(theirs).enumerate() {
        assert_eq!(
            r.to_bits(),
            t.to_bits(),
            "{what} reference value {i}: {r} vs gguf {t}"
        );
        assert_eq!(
            o.to_bits(),
            t.to_bits(),
            "{what} tensor value {i}: {o} vs gguf {t}"
        );
    }
    let last = shape[0] - 1;
    let rows = q
        .dequantize_rows(&Tensor::from_slice(&[last, 0]), Kind::Float)
        .unwrap();
    assert!(rows.get(0).equal(&dense.get(last)), "{what} rows");
    tch::manual_seed(5);
    let x = Tensor::randn([5, shape[1]], (Kind::Float, Device::Cpu));
    let y = q.linear(&x).unwrap();
    let yr = x.matmul(&dense.tr());
    let err = f64::try_from((&y - &yr).abs().max()).unwrap()
        / f64::try_from(yr.abs().max()).unwrap().max(1e-30);
    assert!(
        err < 1e-5,
        "{what} kernel vs dense product: relative {err:.2e}"
    );
}

#[test]
fn gguf_blocks_decode_as_the_gguf_package_does() {
    let dir = tempfile::tempdir().unwrap();
    script(&["blocks", dir.path().to_str().unwrap()]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    let entries = manifest.as_array().unwrap();
    assert_eq!(entries.len(), 8);
    for e in entries {
        let name = e["type"].as_str().unwrap();
        let shape: Vec<i64> = e["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        let raw = std::fs::read(dir.path().join(e["raw"].as_str().unwrap())).unwrap();
        let theirs = read_f32(&dir.path().join(e["values"].as_str().unwrap()));
        check_exact(
            &format!("random {name} blocks"),
            kind_named(name),
            &raw,
            [shape[0], shape[1]],
            &theirs,
        );
    }
}

#[test]
fn tensors_quantized_by_llama_cpp_decode_as_the_gguf_package_does() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        src.exists(),
        "{} is missing: run `cargo xtask setup`",
        src.display()
    );
    let dir = tempfile::tempdir().unwrap();
    script(&[
        "requant",
        src.to_str().unwrap(),
        dir.path().to_str().unwrap(),
        "Q4_K_M",
        "Q5_K_M",
    ]);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for e in manifest.as_array().unwrap() {
        let file = dir.path().join(e["file"].as_str().unwrap());
        let header = read_header(&file).unwrap();
        let name = e["tensor"].as_str().unwrap();
        let info = header.tensors.iter().find(|t| t.name == name).unwrap();
        let range = header.data_range(info).unwrap();
        let bytes = std::fs::read(&file).unwrap();
        let raw = &bytes[range.start as usize..range.end as usize];
        let kind = kind_named(e["type"].as_str().unwrap());
        assert_eq!(kind.ggml_type(), Some(info.ggml_type.id()));
        let shape = info.torch_shape();
        let theirs = read_f32(&dir.path().join(e["values"].as_str().unwrap()));
        check_exact(
            &format!("{} {name} ({kind:?})", e["file"]),
            kind,
            raw,
            [shape[0], shape[1]],
            &theirs,
        );
        seen.insert(format!("{kind:?}"));
    }
    // llama.cpp falls back to Q5_0 / Q5_1 / Q8_0 for the 576-wide rows (not a multiple of 256)
    for k in ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q8_0"] {
        assert!(seen.contains(k), "no {k} tensor was checked: {seen:?}");
    }
}

#[test]
fn fp8_matches_pytorch_cast_and_decode() {
    let dir = tempfile::tempdir().unwrap();
    script(&["fp8", dir.path().to_str().unwrap()]);
    let table = read_f32(&dir.path().join("fp8_table.f32"));
    assert_eq!(table.len(), 256);
    for (b, t) in table.iter().enumerate() {
        let ours = fp8_e4m3_to_f32(b as u8);
        assert!(
            ours.to_bits() == t.to_bits() || (ours.is_nan() && t.is_nan()),
            "byte {b:#04x}: {ours} vs torch {t}"
        );
    }
    let x = read_f32(&dir.path().join("fp8_in.f32"));
    let theirs = std::fs::read(dir.path().join("fp8_out.u8")).unwrap();
    let w = Tensor::from_slice(&x).view([-1, 4]);
    let q = QuantWeight::quantize(&w, QuantKind::Fp8E4m3).unwrap();
    let bits = q.fp8_bits().unwrap().view([-1]);
    let ours = Vec::<u8>::try_from(&bits).unwrap();
    assert_eq!(ours, theirs);
    // the dense weight is the table's value of each byte; the kernel agrees with it
    let dense = values(&q.dequantize(Kind::Float).unwrap());
    for (i, (&b, d)) in theirs.iter().zip(&dense).enumerate() {
        let t = table[usize::from(b)];
        assert!(
            d.to_bits() == t.to_bits() || (d.is_nan() && t.is_nan()),
            "value {i}"
        );
    }
    assert_eq!(q.bytes_per_param(), 1.0);
    let finite = Tensor::from_slice(&x[..4000]).view([-1, 32]) * 1e-3;
    let q = QuantWeight::quantize(&finite, QuantKind::Fp8E4m3).unwrap();
    let dense = q.dequantize(Kind::Float).unwrap();
    tch::manual_seed(6);
    let xin = Tensor::randn([3, 32], (Kind::Float, Device::Cpu));
    let y = q.linear(&xin).unwrap();
    let yr = xin.matmul(&dense.tr());
    let err =
        f64::try_from((&y - &yr).abs().max()).unwrap() / f64::try_from(yr.abs().max()).unwrap();
    assert!(
        err < 1e-5,
        "fp8 kernel vs dense product: relative {err:.2e}"
    );
}
