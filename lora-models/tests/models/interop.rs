//! Numerics against Python transformers loading the same GGUF file
//! (`tests/interop/hf_logits.py` writes the reference logits and token ids).

use crate::common;

use std::path::PathBuf;
use std::process::Command;

use safetensors::SafeTensors;
use tch::{Kind, Tensor};

fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `cargo xtask setup` (it creates the interop venv)",
        py.display()
    );
    let ok = Command::new(&py)
        .args(["-c", "import transformers, gguf, safetensors, torch"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "transformers/gguf/safetensors are not importable in {}: run `cargo xtask setup`",
        py.display()
    );
    py
}

fn tensor(st: &SafeTensors<'_>, name: &str) -> Tensor {
    let v = st.tensor(name).unwrap();
    let kind = match v.dtype() {
        safetensors::Dtype::F32 => Kind::Float,
        safetensors::Dtype::I64 => Kind::Int64,
        d => panic!("unexpected dtype {d:?}"),
    };
    let shape: Vec<i64> = v.shape().iter().map(|&d| d as i64).collect();
    Tensor::from_data_size(v.data(), &shape, kind)
}

#[test]
fn logits_and_token_ids_match_transformers() {
    let py = python();
    let gguf = common::gguf_path();
    let out = tempfile::tempdir().unwrap();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/hf_logits.py");
    let res = Command::new(&py)
        .arg(&script)
        .arg("--gguf")
        .arg(&gguf)
        .arg("--out")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "hf_logits.py failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );

    // token ids: ours (built from the GGUF vocabulary + merges) vs transformers' GGUF tokenizer
    let tok = common::tokenizer();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("tokens.json")).unwrap())
            .unwrap();
    let extra = json["extra"].as_object().unwrap();
    assert!(extra.len() >= 6);
    // and transformers' tokenizer saved as tokenizer.json, read by `load_tokenizer`
    let from_json =
        lora_models::tokenizer::load_tokenizer(out.path().join("tokenizer/tokenizer.json"))
            .unwrap();
    assert_eq!(from_json.token_to_id("<|im_end|>"), Some(2));
    for (text, ids) in extra {
        let want: Vec<i64> = ids
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_i64().unwrap())
            .collect();
        assert_eq!(
            tok.encode(text, false).unwrap(),
            want,
            "token ids of {text:?}"
        );
        assert_eq!(
            from_json.encode(text, false).unwrap(),
            want,
            "tokenizer.json ids of {text:?}"
        );
        assert_eq!(
            from_json.decode(&want, false).unwrap(),
            tok.decode(&want, false).unwrap()
        );
    }

    // logits: our f32 forward on the dequantised weights vs transformers' f32 forward
    let bytes = std::fs::read(out.path().join("reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let model = common::dense_f32();
    let n_cases = json["cases"].as_array().unwrap().len();
    let mut worst = 0.0f64;
    for i in 0..n_cases {
        let ids = tensor(&st, &format!("ids.{i}"));
        let want = tensor(&st, &format!("logits.{i}"));
        let got = model.forward_t(&ids, None, None, false).unwrap();
        assert_eq!(got.size(), want.size());
        let d = (&got - &want).abs().max().double_value(&[]);
        let scale = want.abs().max().double_value(&[]);
        println!(
            "case {i}: {} tokens, max |Δlogit| = {d:.3e} (max |logit| {scale:.1})",
            ids.size()[1]
        );
        worst = worst.max(d);
        // same argmax everywhere
        let a = got.argmax(-1, false);
        let b = want.argmax(-1, false);
        assert!(
            bool::try_from(a.eq_tensor(&b).all()).unwrap(),
            "argmax differs in case {i}"
        );
    }
    // Both sides are f32 on the same dequantised weights; the remaining differences are
    // summation order: tolerance 5e-4 on logits of magnitude ~30 (measured: < 1e-4).
    assert!(worst < 5e-4, "max |Δlogit| {worst}");
}
