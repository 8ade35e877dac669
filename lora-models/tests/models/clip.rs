//! CLIP tokenizer and text encoders against Python transformers / PEFT
//! (`tests/interop/sd_clip.py` builds a small BPE vocabulary, tiny random-weight
//! `CLIPTextModel` / `CLIPTextModelWithProjection` folders, a PEFT LoRA, and the reference
//! outputs).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use lora_core::config::LoraConfig;
use lora_core::formats::{AdapterWeights, kohya, peft};
use lora_core::inject::{inject, site_names};
use lora_models::clip::{
    ClipTextModel, ClipTextModelWithProjection, ClipTokenizer, canonicalize_adapter,
    sdxl_conditioning,
};
use safetensors::SafeTensors;
use tch::{Device, Kind, Tensor};

fn python() -> PathBuf {
    let py = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing: run `cargo xtask setup` (it creates the interop venv)",
        py.display()
    );
    py
}

/// Runs the reference script once per test binary; returns its output folder.
fn reference() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/interop/sd_clip.py");
        let res = Command::new(python())
            .arg(&script)
            .arg("--out")
            .arg(dir.path())
            .env("OMP_NUM_THREADS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(
            res.status.success(),
            "sd_clip.py failed:\n{}",
            String::from_utf8_lossy(&res.stderr)
        );
        dir
    })
    .path()
}

fn tokens_json() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(reference().join("tokens.json")).unwrap())
        .unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
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

/// `(max |a − b|, max |b|)`.
fn diff(a: &Tensor, b: &Tensor) -> (f64, f64) {
    assert_eq!(a.size(), b.size());
    let a = a.to_kind(Kind::Float);
    (
        (&a - b).abs().max().double_value(&[]),
        b.abs().max().double_value(&[]),
    )
}

#[test]
fn tokenizer_matches_transformers_and_reference_bpe() {
    let t = tokens_json();
    let strings: Vec<&str> = t["strings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap())
        .collect();
    // SD `tokenizer/` layout: vocab.json + merges.txt only
    let tok = ClipTokenizer::from_dir(reference().join("tokenizer")).unwrap();
    assert_eq!(i64::from(tok.bos_id()), t["bos"].as_i64().unwrap());
    assert_eq!(i64::from(tok.eos_id()), t["eos"].as_i64().unwrap());
    assert_eq!(tok.pad_id(), tok.eos_id());
    // SDXL `tokenizer_2/` layout as transformers saves it: tokenizer.json, pad_token "!"
    let tok2 = ClipTokenizer::from_dir(reference().join("tokenizer_2")).unwrap();
    assert_eq!(tok2.pad_id(), 0, "pad token `!` is id 0");
    let mut longest = 0;
    for (i, s) in strings.iter().enumerate() {
        let raw = tok.encode_ids(s).unwrap();
        let raw: Vec<i64> = raw.iter().map(|&x| i64::from(x)).collect();
        assert_eq!(raw, ids(&t["raw"][i]), "BPE ids of {s:?} vs transformers");
        assert_eq!(
            raw,
            ids(&t["raw_slow"][i]),
            "BPE ids of {s:?} vs simple_tokenizer"
        );
        longest = longest.max(raw.len());
        let row = tok.encode(s).unwrap();
        assert_eq!(row.len(), 77);
        assert_eq!(row, ids(&t["ids"][i]), "77-id row of {s:?} (CLIPTokenizer)");
        assert_eq!(
            row,
            ids(&t["ids_fast"][i]),
            "77-id row of {s:?} (CLIPTokenizerFast)"
        );
        assert_eq!(
            tok2.encode(s).unwrap(),
            ids(&t["ids_pad_bang"][i]),
            "77-id row of {s:?} padded with `!`"
        );
        assert_eq!(
            tok.decode(&raw, true).unwrap(),
            t["decoded"][i].as_str().unwrap(),
            "decode of {s:?}"
        );
        for (tk, key) in [(&tok, "chunks3"), (&tok2, "chunks3_pad_bang")] {
            let got = tk.encode_chunks(s, 3).unwrap();
            let want: Vec<Vec<i64>> = t[key][i].as_array().unwrap().iter().map(ids).collect();
            assert_eq!(got, want, "kohya chunks ({key}) of {s:?}");
        }
    }
    // one string runs past 77 tokens: the row is truncated and still ends in EOS
    assert!(
        longest > 75 * 2,
        "the long test string has {longest} tokens"
    );
    let batch = tok.encode_batch(&strings).unwrap();
    assert_eq!(batch.size(), [strings.len() as i64, 77]);
    let last = strings.len() as i64 - 1;
    assert_eq!(
        batch.int64_value(&[last, 76]),
        i64::from(tok.eos_id()),
        "truncated row ends in EOS"
    );
}

fn reference_tensors() -> &'static Vec<u8> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| std::fs::read(reference().join("reference.safetensors")).unwrap())
}

#[test]
fn text_encoders_match_transformers() {
    let st = SafeTensors::deserialize(reference_tensors()).unwrap();
    let te1 =
        ClipTextModel::from_pretrained(reference().join("text_encoder"), Kind::Float, Device::Cpu)
            .unwrap();
    let ids1 = tensor(&st, "ids1");
    let out = tch::no_grad(|| te1.forward_t(&ids1, false)).unwrap();
    assert_eq!(out.hidden_states.len(), 4);
    let cases = [
        ("te1.last", out.last_hidden_state.shallow_clone()),
        ("te1.pooled", out.pooled.shallow_clone()),
        ("te1.embeddings", out.hidden_states[0].shallow_clone()),
        ("te1.penultimate", te1.skip_hidden(&out, 2, false).unwrap()),
        ("te1.clip_skip2", te1.skip_hidden(&out, 2, true).unwrap()),
    ];
    let mut worst = 0.0f64;
    for (name, got) in &cases {
        let (d, scale) = diff(got, &tensor(&st, name));
        println!("{name}: max |Δ| = {d:.2e} (max |ref| {scale:.2})");
        worst = worst.max(d);
    }
    // SDXL-style encoder 2: gelu, projection, first-EOS pooling with `!` padding
    let te2 = ClipTextModelWithProjection::from_pretrained(
        reference().join("text_encoder_2"),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap();
    let ids2 = tensor(&st, "ids2");
    let out2 = tch::no_grad(|| te2.forward_t(&ids2, false)).unwrap();
    let cases2 = [
        ("te2.last", out2.last_hidden_state.shallow_clone()),
        (
            "te2.text_embeds",
            out2.text_embeds.as_ref().unwrap().shallow_clone(),
        ),
        ("te2.penultimate", te2.skip_hidden(&out2, 2, false).unwrap()),
    ];
    for (name, got) in &cases2 {
        let (d, scale) = diff(got, &tensor(&st, name));
        println!("{name}: max |Δ| = {d:.2e} (max |ref| {scale:.2})");
        worst = worst.max(d);
    }
    // f32 on both sides; differences are summation order (measured ~1e-6)
    assert!(worst < 1e-4, "max |Δ| {worst}");
    // the pooling rules: encoder 1 (eos_token_id 2) argmax, encoder 2 first EOS; the rows of
    // ids2 are padded with `!` (id 0), so both find the first EOS
    let eos = tokens_json()["eos"].as_i64().unwrap();
    let first_eos = |ids: &Tensor| -> Vec<i64> {
        (0..ids.size()[0])
            .map(|r| (0..77).find(|&c| ids.int64_value(&[r, c]) == eos).unwrap())
            .collect()
    };
    assert_eq!(
        Vec::<i64>::try_from(&te1.eos_positions(&ids1).unwrap().to_kind(Kind::Int64)).unwrap(),
        first_eos(&ids1)
    );
    assert_eq!(
        Vec::<i64>::try_from(
            &te2.text_model()
                .eos_positions(&ids2)
                .unwrap()
                .to_kind(Kind::Int64)
        )
        .unwrap(),
        first_eos(&ids2)
    );

    // bf16 / f16 weights and activations: same outputs within half precision
    for kind in [Kind::BFloat16, Kind::Half] {
        let te =
            ClipTextModel::from_pretrained(reference().join("text_encoder"), kind, Device::Cpu)
                .unwrap();
        let o = tch::no_grad(|| te.forward_t(&ids1, false)).unwrap();
        assert_eq!(o.last_hidden_state.kind(), kind);
        let (d, scale) = diff(&o.last_hidden_state, &tensor(&st, "te1.last"));
        println!("te1.last {kind:?}: max |Δ| = {d:.2e} (max |ref| {scale:.2})");
        assert!(d / scale < 0.05, "{kind:?} relative error {}", d / scale);
    }

    // bad input is refused with the offending key / shape named
    let e = ClipTextModel::from_tensors(
        te1.config().clone(),
        &std::collections::HashMap::new(),
        "",
        Kind::Float,
        Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("text_model.embeddings.token_embedding.weight"),
        "{e}"
    );
    let too_long = Tensor::zeros([1, 78], (Kind::Int64, Device::Cpu));
    let e = te1.forward_t(&too_long, false).unwrap_err().to_string();
    assert!(e.contains("[1, 78]"), "{e}");
    let e = ClipTextModel::from_pretrained(reference().join("tokenizer"), Kind::Float, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn peft_lora_matches_and_kohya_names_map() {
    // adapter initialisation draws from the process-wide generator
    let _lock = crate::rng_lock();
    let st = SafeTensors::deserialize(reference_tensors()).unwrap();
    let mut te1 =
        ClipTextModel::from_pretrained(reference().join("text_encoder"), Kind::Float, Device::Cpu)
            .unwrap();
    // transformers 5 names the modules of a bare CLIPTextModel without `text_model.`
    let (_cfg, mut w) = peft::load(&reference().join("peft_te1")).unwrap();
    assert!(w.modules.keys().all(|k| k.starts_with("encoder.layers.")));
    canonicalize_adapter(&mut w);
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let report = w.load_into(&mut te1, "default", &vs.root(), 0.0).unwrap();
    assert_eq!(report.modules.len(), 12, "3 layers × q/k/v/out_proj");
    let ids1 = tensor(&st, "ids1");
    let out = tch::no_grad(|| te1.forward_t(&ids1, false)).unwrap();
    let mut worst = 0.0f64;
    for (name, got) in [
        ("te1_lora.last", out.last_hidden_state.shallow_clone()),
        ("te1_lora.pooled", out.pooled.shallow_clone()),
        (
            "te1_lora.penultimate",
            te1.skip_hidden(&out, 2, false).unwrap(),
        ),
    ] {
        let want = tensor(&st, name);
        let (d, scale) = diff(&got, &want);
        println!("{name}: max |Δ| = {d:.2e} (max |ref| {scale:.2})");
        worst = worst.max(d);
        // the adapter matters: the LoRA output differs from the base output
        let base = tensor(&st, &name.replace("te1_lora", "te1"));
        assert!(diff(&base, &want).0 > 1e-2, "{name}: LoRA changes nothing");
    }
    assert!(worst < 1e-4, "max |Δ| {worst}");

    // kohya: the sites are named so that `lora_te_<path with _>` is sd-scripts' name, and an
    // adapter written in kohya layout maps back onto every site
    let sites: Vec<String> = site_names(&mut te1)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(sites.len(), 18, "3 layers × (q, k, v, out_proj, fc1, fc2)");
    assert_eq!(
        kohya::kohya_name("lora_te", &sites[0]),
        "lora_te_text_model_encoder_layers_0_self_attn_q_proj"
    );
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("te.safetensors");
    let weights = AdapterWeights::from_model(&mut te1, "default").unwrap();
    kohya::write(&path, &[("lora_te1", &weights)]).unwrap();
    let mut file = kohya::read(&path).unwrap();
    let back = file.take_prefix("lora_te1", &sites).unwrap();
    assert_eq!(back.modules.len(), 12);
    assert!(
        back.modules
            .contains_key("text_model.encoder.layers.2.self_attn.out_proj")
    );

    // injection by PEFT target names on the projection model too
    let mut te2 = ClipTextModelWithProjection::from_pretrained(
        reference().join("text_encoder_2"),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap();
    let vs2 = tch::nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig::new(4, 8.0, &["fc1", "fc2", "text_projection"]);
    let rep = inject(&mut te2, &cfg, "default", &vs2.root()).unwrap();
    assert_eq!(rep.modules.len(), 7);
    assert_eq!(rep.modules.last().unwrap(), "text_projection");

    // training: gradients reach the adapters (B starts at zero, so only B gets a gradient at
    // the first step, as in PEFT) and nothing else
    let ids2 = tensor(&st, "ids2");
    let out2 = te2.forward_t(&ids2, true).unwrap();
    let loss = out2
        .text_embeds
        .as_ref()
        .unwrap()
        .square()
        .mean(Kind::Float)
        + out2.last_hidden_state.square().mean(Kind::Float);
    loss.backward();
    let vars = vs2.variables();
    assert_eq!(vars.len(), 14, "A and B of 7 modules");
    for (name, v) in &vars {
        let g = v.grad();
        let n = g.abs().sum(Kind::Float).double_value(&[]);
        assert!(n.is_finite(), "{name}: grad {n}");
        if name.contains("lora_B") {
            assert!(n > 0.0, "{name}: no gradient");
        } else {
            assert_eq!(n, 0.0, "{name}: gradient through a zero B");
        }
    }

    // SDXL conditioning: both penultimate states side by side, encoder 2's projection pooled
    let (embeds, pooled) = {
        let o1 = tch::no_grad(|| te1.forward_t(&ids2, false)).unwrap();
        let o2 = tch::no_grad(|| te2.forward_t(&ids2, false)).unwrap();
        let (e, p) = sdxl_conditioning(&te1, &o1, &te2, &o2).unwrap();
        assert_eq!(diff(&e.narrow(2, 0, 32), &o1.hidden_states[2]).0, 0.0);
        assert_eq!(diff(&e.narrow(2, 32, 32), &o2.hidden_states[2]).0, 0.0);
        (e, p)
    };
    assert_eq!(embeds.size(), [3, 77, 64]);
    assert_eq!(pooled.size(), [3, 24]);
}
