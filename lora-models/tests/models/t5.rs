//! T5EncoderModel against transformers 5.24 on tiny random-weight encoders that
//! `tests/interop/t5_encoder.py` builds and writes: the gated-GELU encoder with and without a
//! padding mask, the relu encoder with an inner width other than `d_model`, the f16 single-file
//! layout loaded in f32 and bf16, the tied embedding's other name, LoRA sites, and the T5
//! tokenizer's padding and truncation.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use lora_core::inject::{Adaptable, site_names};
use lora_models::t5::{T5Config, T5EncoderModel, T5Tokenizer};
use safetensors::SafeTensors;
use tch::{Device, Kind, Tensor};

fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("t5_encoder.py"))
        .path()
}

fn r(name: &str) -> Tensor {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes = R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap());
    crate::common::st_tensor(bytes, name)
}

/// max |a − b| / max |b|
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    crate::common::diff(a, b).1
}

fn check(label: &str, ours: &Tensor, reference: &str, tol: f64) {
    let rel = rel_diff(ours, &r(reference));
    println!("{label}: max relative error {rel:.3e} against transformers' {reference}");
    assert!(rel < tol, "{label}: relative error {rel:.3e} ≥ {tol:.0e}");
}

#[test]
fn t5_encoder_matches_transformers() {
    tch::set_num_threads(1);
    let _g = tch::no_grad_guard();
    let m =
        T5EncoderModel::from_pretrained(fixtures().join("t5"), Kind::Float, Device::Cpu).unwrap();
    assert!(m.config().is_gated());
    assert_eq!(
        m.num_params(),
        i64::try_from(r("num_params").get(0)).unwrap()
    );
    assert_eq!(m.num_params(), m.config().encoder_param_count());
    let (ids, mask) = (r("ids"), r("mask"));
    let h = m.forward_t(&ids, Some(&mask), false).unwrap();
    check("gated-gelu, padding mask", &h, "hidden", 1e-5);
    let h = m.forward_t(&ids, None, false).unwrap();
    check("gated-gelu, no mask", &h, "hidden_nomask", 1e-5);
    // the mask matters: the padded row differs from the unmasked run
    assert!(rel_diff(&r("hidden"), &r("hidden_nomask")) > 1e-2);
    // a bool mask is the same mask
    let h = m
        .forward_t(&ids, Some(&mask.to_kind(Kind::Bool)), false)
        .unwrap();
    check("gated-gelu, bool mask", &h, "hidden", 1e-5);
    let e = m
        .forward_t(&ids, Some(&mask.narrow(1, 0, 3)), false)
        .unwrap_err();
    assert!(e.to_string().contains("attention_mask"), "{e}");

    let relu =
        T5EncoderModel::from_pretrained(fixtures().join("t5_relu"), Kind::Float, Device::Cpu)
            .unwrap();
    assert!(!relu.config().is_gated());
    assert_eq!(
        relu.num_params(),
        i64::try_from(r("num_params_relu").get(0)).unwrap()
    );
    let h = relu.forward_t(&ids, Some(&mask), false).unwrap();
    check("relu, inner 24 ≠ d_model 32", &h, "hidden_relu", 1e-5);
}

#[test]
fn t5xxl_single_file_layout_loads_in_f32_and_bf16() {
    tch::set_num_threads(1);
    let _g = tch::no_grad_guard();
    let cfg = T5Config::from_file(fixtures().join("t5/config.json")).unwrap();
    let file = fixtures().join("t5xxl_layout.safetensors");
    let (ids, mask) = (r("ids"), r("mask"));
    // f16 weights, computed in f32: the reference ran on the same f16-rounded weights
    let m = T5EncoderModel::from_single_file(&file, cfg.clone(), Kind::Float, Device::Cpu).unwrap();
    let h = m.forward_t(&ids, Some(&mask), false).unwrap();
    check("f16 file in f32", &h, "hidden_f16w", 1e-5);
    // bf16 and f16 compute: as close to the f32 result as transformers' own run in that dtype
    // (and close to that run)
    for (kind, theirs) in [(Kind::BFloat16, "hidden_bf16"), (Kind::Half, "hidden_f16")] {
        let m = T5EncoderModel::from_single_file(&file, cfg.clone(), kind, Device::Cpu).unwrap();
        assert_eq!(m.kind(), kind);
        let h = m.forward_t(&ids, Some(&mask), false).unwrap();
        assert_eq!(h.kind(), kind);
        let ours = rel_diff(&h, &r("hidden_f16w"));
        let base = rel_diff(&r(theirs), &r("hidden_f16w"));
        let between = rel_diff(&h, &r(theirs));
        println!(
            "{kind:?}: relative error vs f32 {ours:.3e} (transformers in {kind:?}: {base:.3e}), \
             vs transformers in {kind:?} {between:.3e}"
        );
        assert!(
            ours < 2.0 * base + 1e-3,
            "{kind:?}: {ours:.3e} vs {base:.3e}"
        );
        assert!(between < 2.0 * base + 1e-3, "{kind:?}: {between:.3e}");
    }
    let m = T5EncoderModel::from_single_file(&file, cfg.clone(), Kind::Half, Device::Cpu).unwrap();
    assert_eq!(
        m.weights_resident_bytes(),
        2 * u64::try_from(cfg.encoder_param_count()).unwrap()
    );

    // a file holding the tied embedding only as `encoder.embed_tokens.weight`
    let mut map: HashMap<String, Tensor> = Tensor::read_safetensors(&file)
        .unwrap()
        .into_iter()
        .collect();
    let shared = map.remove("shared.weight").unwrap();
    map.insert("encoder.embed_tokens.weight".into(), shared);
    let m = T5EncoderModel::from_tensors(cfg.clone(), &map, Kind::Float, Device::Cpu).unwrap();
    let h = m.forward_t(&ids, Some(&mask), false).unwrap();
    check("embed_tokens name", &h, "hidden_f16w", 1e-5);
    // a missing tensor is named
    map.remove("encoder.block.1.layer.1.DenseReluDense.wi_1.weight");
    let e = T5EncoderModel::from_tensors(cfg, &map, Kind::Float, Device::Cpu).unwrap_err();
    assert!(
        e.to_string()
            .contains("encoder.block.1.layer.1.DenseReluDense.wi_1.weight"),
        "{e}"
    );
}

#[test]
fn t5_sites_are_the_transformers_linear_modules() {
    let mut m =
        T5EncoderModel::from_pretrained(fixtures().join("t5"), Kind::Float, Device::Cpu).unwrap();
    let names: Vec<String> = site_names(&mut m)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.len(), 2 * 7);
    assert_eq!(names[0], "encoder.block.0.layer.0.SelfAttention.q");
    assert_eq!(names[6], "encoder.block.0.layer.1.DenseReluDense.wo");
    let bytes = std::fs::read(fixtures().join("t5/model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for n in &names {
        assert!(st.tensor(&format!("{n}.weight")).is_ok(), "{n}.weight");
    }
    // every 2-D weight but the embedding and the bias table is a site
    let n2d = st
        .names()
        .iter()
        .filter(|k| st.tensor(k).unwrap().shape().len() == 2)
        .count();
    assert_eq!(names.len(), n2d - 2);
    assert_eq!(m.frozen_param_count(), Some(m.num_params()));
}

#[derive(serde::Deserialize)]
struct TokCase {
    max_length: usize,
    input_ids: Vec<Vec<i64>>,
    attention_mask: Vec<Vec<i64>>,
}

#[derive(serde::Deserialize)]
struct Tokens {
    texts: Vec<String>,
    cases: Vec<TokCase>,
    unpadded: Vec<Vec<i64>>,
}

#[test]
fn t5_tokenizer_pads_and_truncates_like_transformers() {
    let tok = T5Tokenizer::from_file(fixtures().join("tok/tokenizer.json")).unwrap();
    assert_eq!((tok.pad_id(), tok.eos_id()), (0, 1));
    let refs: Tokens =
        serde_json::from_slice(&std::fs::read(fixtures().join("tokens.json")).unwrap()).unwrap();
    let texts: Vec<&str> = refs.texts.iter().map(String::as_str).collect();
    for (t, want) in texts.iter().zip(&refs.unpadded) {
        assert_eq!(&tok.encode(t).unwrap(), want, "{t}");
    }
    for case in &refs.cases {
        let (ids, mask) = tok.encode_batch(&texts, case.max_length).unwrap();
        let ids: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&ids).unwrap();
        let mask: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&mask).unwrap();
        assert_eq!(ids, case.input_ids, "max_length {}", case.max_length);
        assert_eq!(mask, case.attention_mask, "max_length {}", case.max_length);
    }
}
