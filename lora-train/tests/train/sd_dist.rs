//! The Stable Diffusion job data-parallel: two Gloo ranks of this test binary (started as
//! torchrun starts them) on a micro-batch of 2 each train the adapter one process trains on a
//! micro-batch of 2 with `gradient_accumulation_steps: 2` — the same images in the same steps
//! (the loader's seeded plan, rank `r` taking batches `r, r + 2, …`), and the same timesteps and
//! noise for each of them (each batch seeds its draws from its index in the epoch's whole plan,
//! see `SdBatch::noise_seed`).

use crate::sd_fixture::{make_pipeline, root};
use lora_core::dist::ProcessGroup;
use lora_train::config::TrainConfig;
use lora_train::job::RunOptions;
use lora_train::sd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tch::Tensor;

/// The tiny SD 1.x job: 3 optimizer steps of 4 images, no samples, the kohya file only.
fn config(dir: &Path, out: &str, batch_size: u32, accumulation: u32) -> TrainConfig {
    let mut cfg =
        TrainConfig::from_file(root().join("examples/configs/sd15-emoji-tiny.yaml")).unwrap();
    cfg.model.base_model = Some(dir.join("pipeline").display().to_string());
    cfg.data.train_data_dir = Some(dir.join("data").display().to_string());
    cfg.train.output_dir = dir.join(out).display().to_string();
    cfg.train.batch_size = batch_size;
    cfg.train.gradient_accumulation_steps = accumulation;
    cfg.train.max_steps = Some(3);
    cfg.train.save_every_n_steps = None;
    cfg.logging.sample_prompts = Vec::new();
    cfg.system.num_threads = Some(1);
    cfg
}

/// A rank's role when this binary was started as a worker by the test below, or the
/// single-process reference (`LORA_SD_DIST_ROLE=single`).
#[test]
fn sd_data_parallel_worker() {
    let Ok(dir) = std::env::var("LORA_SD_DIST_DIR") else {
        return; // not started as a worker
    };
    let cfg = if std::env::var("LORA_SD_DIST_ROLE").as_deref() == Ok("single") {
        config(Path::new(&dir), "single", 2, 2)
    } else {
        config(Path::new(&dir), "dp", 2, 1)
    };
    let report = sd::run(cfg, &RunOptions::default()).unwrap();
    assert_eq!(report.steps, 3);
}

/// Starts this test binary as a worker on `dir` with `env` added; stdout discarded.
fn worker(dir: &Path, env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "sd_dist::sd_data_parallel_worker",
        "--exact",
        "--test-threads=1",
        "--nocapture",
    ])
    .env("OMP_NUM_THREADS", "1")
    .env("LORA_SD_DIST_DIR", dir)
    .stdout(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Waits for `workers` (named by index in messages) until `deadline`; each must succeed.
fn wait_all(workers: &mut [std::process::Child], what: &str, deadline: Instant) {
    for (rank, w) in workers.iter_mut().enumerate() {
        loop {
            if let Some(status) = w.try_wait().unwrap() {
                assert!(status.success(), "{what} {rank} failed: {status}");
                break;
            }
            assert!(Instant::now() < deadline, "{what} {rank} did not finish");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn kohya(out: &Path) -> Vec<(String, Tensor)> {
    let mut t = Tensor::read_safetensors(out.join("emoji-tiny.safetensors")).unwrap();
    t.sort_by(|a, b| a.0.cmp(&b.0));
    t
}

#[test]
fn two_sd_ranks_train_the_adapter_of_one_process_accumulating_two_micro_batches() {
    if std::env::var("LORA_SD_DIST_DIR").is_ok() {
        return; // a worker runs only its own test
    }
    assert!(ProcessGroup::gloo_available(), "this build has no Gloo");
    let _serial = crate::serial();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("sd_dist");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    make_pipeline(&dir, &[]);
    let deadline = Instant::now() + Duration::from_secs(600);
    // one process, 2 micro-batches of 2 per step: a process of its own too, so that tests
    // running beside this one in the harness (and the intra-op thread count they set, which is
    // process-wide) cannot change its last bits
    let mut single = [worker(&dir, &[("LORA_SD_DIST_ROLE", "single".into())])];
    wait_all(&mut single, "the single-process run", deadline);
    // two ranks, 1 micro-batch of 2 each per step
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut workers: Vec<_> = (0..2)
        .map(|rank| {
            worker(
                &dir,
                &[
                    ("RANK", rank.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("WORLD_SIZE", "2".into()),
                    ("LOCAL_WORLD_SIZE", "2".into()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.to_string()),
                    ("LORA_DIST_TIMEOUT_S", "300".into()),
                ],
            )
        })
        .collect();
    wait_all(&mut workers, "rank", deadline);
    let (a, b) = (kohya(&dir.join("dp")), kohya(&dir.join("single")));
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    let mut moved = 0f64;
    for ((n, x), (m, y)) in a.iter().zip(&b) {
        assert_eq!(n, m);
        worst = worst.max((x - y).abs().max().double_value(&[]));
        if n.contains("lora_up") {
            moved = moved.max(x.abs().max().double_value(&[]));
        }
    }
    eprintln!(
        "SD: 2 ranks × micro-batch 2 vs 1 process × 2 accumulated micro-batches of 2: max |diff| {worst:.2e} ({} tensors)",
        a.len()
    );
    assert!(moved > 1e-4, "lora_up did not train: {moved}");
    // bit for bit: one process adds two gradients of the loss scaled by 1/2, the ranks add the
    // two unscaled gradients and halve the sum; halving is exact in binary floating point, so
    // g₁/2 + g₂/2 and (g₁ + g₂)/2 are the same numbers (with 4 ranks the order of the additions
    // would differ, and so would the last bits)
    assert_eq!(worst, 0.0);
}
