//! SIGKILL at several points of a run, resume, and compare: the final adapter must be
//! bit-identical to an uninterrupted run's. The child is this test binary re-run with the
//! ignored `child_train` test selected (so no extra binary ships with the crate).

use crate::engine_common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use engine_common::{ToyData, ToyLora};
use lora_train::engine::callbacks::{Callback, Control, StepInfo};
use lora_train::engine::checkpoint::{Checkpoint, CheckpointManager};
use lora_train::engine::optim::OptimizerKind;
use lora_train::engine::sched::SchedulerKind;
use lora_train::engine::{Resume, Trainer, TrainerConfig};

const TOTAL_STEPS: u64 = 30;

struct Announce;

impl Callback for Announce {
    fn on_step(&mut self, info: &StepInfo) -> lora_train::engine::Result<Control> {
        println!("STEP {}", info.step);
        std::thread::sleep(Duration::from_millis(15));
        Ok(Control::Continue)
    }
}

/// The child: trains (or resumes) in `LORA_TRAIN_KILL_DIR`, checkpointing every 2 steps.
#[test]
#[ignore = "run by kill_and_resume_is_bit_identical as a child process"]
fn child_train() {
    let _serial = crate::serial();
    let Ok(dir) = std::env::var("LORA_TRAIN_KILL_DIR") else {
        return;
    };
    tch::set_num_threads(1);
    let mut task = ToyLora::new();
    let mut data = ToyData::new(24, 4, 9);
    let cfg = TrainerConfig {
        lr: 2e-2,
        optimizer: OptimizerKind::from_name("AdamW8bit").unwrap(),
        scheduler: SchedulerKind::Linear,
        warmup_steps: 3,
        epochs: 10,
        max_steps: Some(TOTAL_STEPS),
        gradient_accumulation_steps: 2,
        checkpoint_dir: Some(dir.into()),
        save_every_n_steps: Some(2),
        keep_last: 2,
        seed: Some(42),
        ..Default::default()
    };
    let mut trainer: Trainer<ToyLora> = Trainer::new(cfg);
    trainer.add_callback(Box::new(Announce));
    let report = trainer.fit(&mut task, &mut data, Resume::Latest).unwrap();
    println!("DONE {}", report.steps);
}

fn child(dir: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "engine_kill::child_train",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LORA_TRAIN_KILL_DIR", dir)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Runs a child to completion; returns whether it printed DONE.
fn run_to_end(dir: &Path) -> bool {
    let out = child(dir).wait_with_output().unwrap();
    String::from_utf8_lossy(&out.stdout).contains(&format!("DONE {TOTAL_STEPS}"))
}

/// Starts a child and SIGKILLs it once it has printed `STEP k` (plus `delay_ms`).
fn run_and_kill(dir: &Path, k: u64, delay_ms: u64) -> u64 {
    let mut c = child(dir);
    let stdout = c.stdout.take().unwrap();
    let mut last = 0;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(s) = line.strip_prefix("STEP ") {
            last = s.trim().parse().unwrap();
            if last >= k {
                std::thread::sleep(Duration::from_millis(delay_ms));
                c.kill().unwrap(); // SIGKILL on Unix
                break;
            }
        }
    }
    let _ = c.wait();
    last
}

fn final_adapter(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let m = CheckpointManager::new(dir, 2);
    let (step, path) = m.list().unwrap().pop().unwrap();
    assert_eq!(step, TOTAL_STEPS);
    let ck = Checkpoint::read_from(&path).unwrap();
    ck.adapter
        .into_iter()
        .map(|(n, t)| {
            let v = Vec::<f32>::try_from(t.flatten(0, -1)).unwrap();
            (n, v.iter().flat_map(|x| x.to_le_bytes()).collect())
        })
        .collect()
}

#[test]
fn kill_and_resume_is_bit_identical() {
    let _serial = crate::serial();
    let straight = tempfile::tempdir().unwrap();
    assert!(run_to_end(straight.path()));
    let want = final_adapter(straight.path());
    assert!(
        want.iter().any(|(_, b)| b.iter().any(|&x| x != 0)),
        "the adapter trained"
    );

    // Kill points: before the first checkpoint, mid-run (at and between checkpoint steps, with
    // delays landing inside checkpoint writes), and near the end.
    let killed = tempfile::tempdir().unwrap();
    let mut kills = Vec::new();
    for (k, delay) in [(1u64, 0u64), (5, 7), (12, 0), (13, 3), (22, 11), (29, 1)] {
        let reached = run_and_kill(killed.path(), k, delay);
        kills.push(reached);
    }
    assert!(run_to_end(killed.path()));
    let got = final_adapter(killed.path());
    println!("killed after steps {kills:?}; final adapter compared bit for bit");
    assert_eq!(want.len(), got.len());
    for ((n1, a), (n2, b)) in want.iter().zip(&got) {
        assert_eq!(n1, n2);
        assert!(a == b, "`{n1}` differs after kill-and-resume");
    }
    // Leftover temporaries of killed writes are cleaned by later saves.
    let leftovers: Vec<_> = std::fs::read_dir(killed.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(leftovers.is_empty());
}
