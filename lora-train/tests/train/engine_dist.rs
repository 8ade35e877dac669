//! Data-parallel training over c10d's Gloo on loopback: two or four processes of this test
//! binary (started as torchrun would start them: `RANK`, `WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT`) train the toy LoRA task on equal shares of each batch, averaging gradients
//! before every step; the adapter they end with is the one a single process trains on the whole
//! batches.

use crate::engine_common::{self, Batch, ToyLora};
use lora_core::dist::ProcessGroup;
use lora_train::engine::dist::DistEnv;
use lora_train::engine::optim::{AdamWConfig, OptimizerKind};
use lora_train::engine::sched::SchedulerKind;
use lora_train::engine::{BatchSource, Resume, Trainer, TrainerConfig};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};

const ROWS: i64 = 40;
const GLOBAL_BATCH: i64 = 8;

/// `ROWS` rows of inputs and targets, the same in every process (seeded).
fn rows() -> (Tensor, Tensor) {
    tch::manual_seed(11);
    let x = Tensor::randn([ROWS, engine_common::IN], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([ROWS, engine_common::OUT], (Kind::Float, Device::Cpu));
    (x, y)
}

/// Step `k` takes rows `8k..8k+8`; a rank of `world` takes its contiguous share of them.
struct Shard {
    x: Tensor,
    y: Tensor,
    rank: i64,
    world: i64,
    next: i64,
}

impl BatchSource<Batch> for Shard {
    fn start_epoch(&mut self, _epoch: u64) -> lora_train::engine::Result<()> {
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> lora_train::engine::Result<Option<Batch>> {
        if self.next * GLOBAL_BATCH >= ROWS {
            return Ok(None);
        }
        let share = GLOBAL_BATCH / self.world;
        let start = self.next * GLOBAL_BATCH + self.rank * share;
        self.next += 1;
        Ok(Some(Batch {
            x: self.x.f_narrow(0, start, share)?,
            y: self.y.f_narrow(0, start, share)?,
        }))
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some((ROWS / GLOBAL_BATCH) as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "next": self.next })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> lora_train::engine::Result<()> {
        self.next = state["next"].as_i64().unwrap_or(0);
        Ok(())
    }
}

/// Checkpointing of a [`train`] run: every step into `dir`; `resume` continues from the latest.
/// Such a run draws LoRA dropout (0.3) from a generator seeded per rank, so that the ranks'
/// generator states differ.
struct Checkpoints {
    dir: std::path::PathBuf,
    resume: bool,
}

/// Trains 5 steps of AdamW (clipped) on this process's shard; with `dist`, data-parallel;
/// with `stop_at`, a callback of this process stops the run after that step.
fn train(
    rank: i64,
    world: i64,
    dist: Option<ProcessGroup>,
    nan_on_call: Option<u64>,
    stop_at: Option<u64>,
    ckpt: Option<Checkpoints>,
) -> serde_json::Value {
    tch::set_num_threads(1);
    let (x, y) = rows();
    let mut task = ToyLora::new();
    task.dropout = if ckpt.is_some() { 0.3 } else { 0.0 };
    task.nan_on_call = nan_on_call;
    if rank != 0 {
        // a rank that starts elsewhere is brought to rank 0's parameters
        let _g = tch::no_grad_guard();
        let _ = task.a1.shallow_clone().f_add_scalar_(0.5).unwrap();
    }
    let mut data = Shard {
        x,
        y,
        rank,
        world,
        next: 0,
    };
    let mut trainer: Trainer<ToyLora> = Trainer::new(TrainerConfig {
        lr: 5e-2,
        optimizer: OptimizerKind::AdamW(AdamWConfig::default()),
        scheduler: SchedulerKind::Constant,
        epochs: 1,
        max_grad_norm: Some(1.0),
        seed: Some(7 + if ckpt.is_some() { rank as u64 } else { 0 }),
        checkpoint_dir: ckpt.as_ref().map(|c| c.dir.clone()),
        save_every_n_steps: ckpt.as_ref().map(|_| 1),
        ..Default::default()
    });
    if let Some(pg) = dist {
        trainer.set_grad_sync(Box::new(pg));
    }
    if let Some(at) = stop_at {
        trainer.add_callback(Box::new(lora_train::engine::StopAfter(at)));
    }
    let resume = match &ckpt {
        Some(c) if c.resume => Resume::Latest,
        _ => Resume::No,
    };
    let report = trainer.fit(&mut task, &mut data, resume).unwrap();
    serde_json::json!({
        "adapter": task.trainable_bits(),
        "steps": report.steps,
        "interrupted": report.interrupted,
        "stopped_early": report.stopped_early,
        "skipped": report.skipped_steps,
        "losses": report.losses.iter().map(|l| l.1).collect::<Vec<f64>>(),
    })
}

/// The rank's role when this binary was started as a worker by the test below.
#[test]
fn data_parallel_worker() {
    let Ok(out) = std::env::var("LORA_DIST_TEST_OUT") else {
        return; // not started as a worker
    };
    let env = DistEnv::from_env().unwrap().expect("WORLD_SIZE > 1");
    let pg = env.join(Duration::from_secs(60), Device::Cpu).unwrap();
    assert_eq!((pg.rank(), pg.world_size()), (env.rank, env.world_size));
    // every rank's row, in rank order, in the tensor's own dtype
    let g = pg
        .all_gather(&Tensor::from_slice(&[env.rank as i64, 7]))
        .unwrap();
    let want: Vec<i64> = (0..env.world_size as i64).flat_map(|r| [r, 7]).collect();
    assert_eq!(Vec::<i64>::try_from(&g.reshape([-1])).unwrap(), want);
    let nan_on_call = std::env::var("LORA_DIST_TEST_NAN")
        .ok()
        .and_then(|v| v.parse().ok());
    let stop_at = std::env::var("LORA_DIST_TEST_STOP_AT")
        .ok()
        .and_then(|v| v.parse().ok());
    let ckpt = std::env::var("LORA_DIST_TEST_CKPT")
        .ok()
        .map(|dir| Checkpoints {
            dir: dir.into(),
            resume: std::env::var("LORA_DIST_TEST_RESUME").is_ok(),
        });
    let r = train(
        env.rank as i64,
        env.world_size as i64,
        Some(pg),
        nan_on_call,
        stop_at,
        ckpt,
    );
    std::fs::write(out, r.to_string()).unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What one rank of a [`launch`] does besides training: a non-finite loss at a call, or a
/// callback stop after a step; or what every rank does: checkpoint into a folder (`Resume`:
/// and continue from its latest checkpoint), stopping after a step if given.
#[derive(Clone)]
enum Event {
    NanOnCall(u64),
    StopAfterStep(u64),
    Checkpoint(std::path::PathBuf, Option<u64>),
    Resume(std::path::PathBuf),
}

/// Starts `world` workers of this test binary and returns each rank's result; `event` happens
/// on the rank given with it only.
fn launch(dir: &Path, world: usize, event: Option<(usize, Event)>) -> Vec<serde_json::Value> {
    let port = free_port();
    let exe = std::env::current_exe().unwrap();
    let mut children = Vec::new();
    for rank in 0..world {
        let mut c = Command::new(&exe);
        c.args([
            "engine_dist::data_parallel_worker",
            "--exact",
            "--test-threads=1",
            "--nocapture",
        ])
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("OMP_NUM_THREADS", "1")
        .env("LORA_DIST_TEST_OUT", dir.join(format!("rank{rank}.json")))
        .stdout(Stdio::null());
        match &event {
            Some((r, Event::NanOnCall(call))) if *r == rank => {
                c.env("LORA_DIST_TEST_NAN", call.to_string());
            }
            Some((r, Event::StopAfterStep(step))) if *r == rank => {
                c.env("LORA_DIST_TEST_STOP_AT", step.to_string());
            }
            Some((_, Event::Checkpoint(dir, stop))) => {
                c.env("LORA_DIST_TEST_CKPT", dir);
                if let Some(step) = stop {
                    c.env("LORA_DIST_TEST_STOP_AT", step.to_string());
                }
            }
            Some((_, Event::Resume(dir))) => {
                c.env("LORA_DIST_TEST_CKPT", dir)
                    .env("LORA_DIST_TEST_RESUME", "1");
            }
            _ => {}
        }
        children.push(c.spawn().unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(180);
    for (rank, child) in children.iter_mut().enumerate() {
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert!(status.success(), "rank {rank} failed: {status}");
                break;
            }
            if Instant::now() > deadline {
                for c in children.iter_mut() {
                    let _ = c.kill();
                }
                panic!("rank {rank} did not finish within 180 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    (0..world)
        .map(|r| {
            let text = std::fs::read_to_string(dir.join(format!("rank{r}.json"))).unwrap();
            serde_json::from_str(&text).unwrap()
        })
        .collect()
}

fn adapter(v: &serde_json::Value) -> Vec<Vec<f32>> {
    serde_json::from_value(v["adapter"].clone()).unwrap()
}

#[test]
fn two_gloo_ranks_on_half_batches_train_the_single_process_adapter() {
    if std::env::var("LORA_DIST_TEST_OUT").is_ok() {
        return; // a worker runs only its own test
    }
    assert!(
        ProcessGroup::gloo_available(),
        "this build has no Gloo: run `cargo xtask setup` (it provisions assets/gloo) and rebuild"
    );
    let _serial = engine_common::serial();
    let worst = ranks_against_single_process(2);
    assert!(worst < 1e-5, "{worst}");
    let dir = tempfile::tempdir().unwrap();

    // a non-finite loss on rank 1 only (its 2nd step): both ranks skip that step
    let ranks = launch(dir.path(), 2, Some((1, Event::NanOnCall(2))));
    assert_eq!(ranks[0]["skipped"], 1, "{}", ranks[0]);
    assert_eq!(ranks[1]["skipped"], 1, "{}", ranks[1]);
    assert_eq!(adapter(&ranks[0]), adapter(&ranks[1]));

    // a callback on rank 0 stops the run after step 2 (early stopping on rank 0's evaluation):
    // both ranks stop there, and neither calls it an interruption
    let ranks = launch(dir.path(), 2, Some((0, Event::StopAfterStep(2))));
    for r in &ranks {
        assert_eq!(r["steps"], 2, "{r}");
        assert_eq!(r["stopped_early"], true, "{r}");
        assert_eq!(r["interrupted"], false, "{r}");
    }
    assert_eq!(adapter(&ranks[0]), adapter(&ranks[1]));

    // LoRA dropout drawn from generators seeded per rank: a run stopped after step 2 and
    // resumed ends bit-identical to an uninterrupted one, because each rank gets its own
    // generator state back (not rank 0's)
    let full = launch(
        dir.path(),
        2,
        Some((0, Event::Checkpoint(dir.path().join("full"), None))),
    );
    let part = dir.path().join("part");
    let first = launch(
        dir.path(),
        2,
        Some((0, Event::Checkpoint(part.clone(), Some(2)))),
    );
    assert_eq!(first[0]["steps"], 2, "{}", first[0]);
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(part.join("step-00000002/state.json")).unwrap(),
    )
    .unwrap();
    let gens = state["rng_cpu_ranks"].as_array().unwrap();
    assert_eq!(gens.len(), 2);
    assert_ne!(gens[0], gens[1], "the ranks' generators should differ");
    let resumed = launch(dir.path(), 2, Some((0, Event::Resume(part))));
    assert_eq!(resumed[0]["steps"], 5, "{}", resumed[0]);
    assert_eq!(adapter(&resumed[0]), adapter(&full[0]));
    assert_eq!(adapter(&resumed[1]), adapter(&full[1]));
}

/// The adapters of `world` Gloo ranks on `GLOBAL_BATCH / world` rows each against one process on
/// the whole batches; prints the loss curves side by side and returns the worst difference.
fn ranks_against_single_process(world: usize) -> f32 {
    let single = train(0, 1, None, None, None, None);
    let dir = tempfile::tempdir().unwrap();
    let ranks = launch(dir.path(), world, None);
    let a0 = adapter(&ranks[0]);
    for (r, v) in ranks.iter().enumerate() {
        assert_eq!(adapter(v), a0, "rank {r}'s adapter differs from rank 0's");
        assert_eq!(v["steps"], 5);
    }
    // the B matrices moved off zero: the comparison is not between two untrained adapters
    assert!(a0[1].iter().any(|v| v.abs() > 1e-3));
    let losses = |v: &serde_json::Value| -> Vec<f64> {
        serde_json::from_value(v["losses"].clone()).unwrap()
    };
    let one = losses(&single);
    eprintln!("step  1 process  {world} ranks (mean of the ranks' losses)");
    for (i, l) in one.iter().enumerate() {
        // equal shares: the mean of the ranks' batch means is the whole batch's mean
        let mean = ranks.iter().map(|v| losses(v)[i]).sum::<f64>() / world as f64;
        eprintln!("{:>4}  {l:.7}  {mean:.7}", i + 1);
        assert!((l - mean).abs() < 1e-5, "step {}: {l} vs {mean}", i + 1);
    }
    let mut worst = 0f32;
    for (p, q) in a0.iter().zip(adapter(&single)) {
        for (u, v) in p.iter().zip(&q) {
            worst = worst.max((u - v).abs());
        }
    }
    eprintln!(
        "data-parallel ({world} ranks × {} rows) vs single process ({GLOBAL_BATCH} rows): max |diff| {worst:.2e}",
        GLOBAL_BATCH / world as i64
    );
    worst
}

/// 4 ranks on 2 rows each: the same adapter as one process on 8 rows, to float rounding. Not
/// bit-identical, and it cannot be: the single process sums the 8 rows' gradients inside one
/// matmul, the ranks sum 2 rows each and Gloo adds the 4 partial sums in its ring order, so the
/// additions happen in another order (fp32 addition is not associative); AdamW's first steps
/// (update ≈ lr · sign(g)) carry such differences of ~1e-8 into the parameters. The bound: 1e-5,
/// as for 2 ranks.
#[test]
fn four_gloo_ranks_on_quarter_batches_train_the_single_process_adapter() {
    if std::env::var("LORA_DIST_TEST_OUT").is_ok() {
        return;
    }
    assert!(ProcessGroup::gloo_available(), "this build has no Gloo");
    let _serial = engine_common::serial();
    let worst = ranks_against_single_process(4);
    assert!(worst < 1e-5, "{worst}");
}

/// Rank 1 of the interop test: PyTorch's own Python bindings of the same c10d objects.
const PYTORCH_RANK1: &str = r#"
import sys, datetime, torch, torch.distributed as dist
port = int(sys.argv[1])
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
pg = dist.ProcessGroupGloo(dist.PrefixStore("lora-sdk/", store), 1, 2, datetime.timedelta(seconds=60))
t = torch.tensor([10.0, 20.0, 30.0])
pg.allreduce([t]).wait()
b = torch.zeros(2)
pg.broadcast(b, 0).wait()
pg.barrier().wait()
g = [torch.zeros(2), torch.zeros(2)]
pg.allgather([g], [torch.tensor([5.0, 6.0])]).wait()
print(" ".join(str(float(v)) for v in list(t) + list(b) + list(g[0]) + list(g[1])), flush=True)
# leave without running c10d's destructors: the peer may already be gone, and a Gloo teardown
# racing with it can abort the interpreter after the work is done ("terminate called without an
# active exception")
import os
os._exit(0)
"#;

#[test]
fn a_pytorch_process_joins_our_group_as_a_peer() {
    if std::env::var("LORA_DIST_TEST_OUT").is_ok() {
        return;
    }
    assert!(ProcessGroup::gloo_available(), "this build has no Gloo");
    let python =
        std::env::var("LORA_SDK_PYTHON").expect("LORA_SDK_PYTHON (set by .cargo/config.toml)");
    let port = free_port();
    let child = Command::new(&python)
        .args(["-c", PYTORCH_RANK1, &port.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // rank 0: this process, through the shim
    let pg = ProcessGroup::new_gloo("127.0.0.1", port, 0, 2, Duration::from_secs(60)).unwrap();
    let t = Tensor::from_slice(&[1f32, 2.0, 3.0]);
    pg.all_reduce_sum(&t).unwrap();
    let b = Tensor::from_slice(&[7f32, 8.0]);
    pg.broadcast(&b, 0).unwrap();
    pg.barrier().unwrap();
    let g = pg.all_gather(&Tensor::from_slice(&[1f32, 2.0])).unwrap();
    assert_eq!(g.size(), [2, 2]);
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python rank 1 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(Vec::<f32>::try_from(&t).unwrap(), vec![11.0, 22.0, 33.0]);
    assert_eq!(
        Vec::<f32>::try_from(&g.reshape([-1])).unwrap(),
        vec![1.0, 2.0, 5.0, 6.0]
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "11.0 22.0 33.0 7.0 8.0 1.0 2.0 5.0 6.0",
        "what PyTorch's rank saw"
    );
    // the peer has exited: a collective is an error (not an abort, not a hang), and the store
    // rank 0 serves names the rank that is gone
    let t0 = Instant::now();
    let e = pg
        .all_gather(&Tensor::from_slice(&[1f32, 2.0]))
        .unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert!(e.to_string().contains("all-gathering"), "{e}");
    assert_eq!(
        pg.absent_ranks(Duration::from_millis(500)).unwrap(),
        vec![1]
    );
}

#[test]
fn rendezvous_failures_are_errors_that_say_where() {
    if std::env::var("LORA_DIST_TEST_OUT").is_ok() {
        return;
    }
    assert!(ProcessGroup::gloo_available(), "this build has no Gloo");
    // rank 0 cannot serve the store on a port another program holds
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let e = ProcessGroup::new_gloo("127.0.0.1", port, 0, 2, Duration::from_secs(5))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!("127.0.0.1:{port}")) && e.contains("rank 0 of 2"),
        "{e}"
    );
    drop(held);
    // rank 1 waits for a rank 0 that never comes: a timeout, not a hang
    let port = free_port();
    let t = Instant::now();
    let e = ProcessGroup::new_gloo("127.0.0.1", port, 1, 2, Duration::from_secs(3))
        .unwrap_err()
        .to_string();
    assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
    assert!(e.contains("rank 1 of 2"), "{e}");
    // a rank outside the world is refused before any connection
    let e = ProcessGroup::new_gloo("127.0.0.1", port, 2, 2, Duration::from_secs(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 2") && e.contains("world_size 2"), "{e}");
}

/// This build carries c10d's NCCL process group (the set-up provisions the CUDA headers it
/// needs); on a machine without a CUDA device joining over NCCL is an error that says so,
/// before any rendezvous — not an abort.
#[test]
fn nccl_is_built_in_and_without_a_gpu_it_is_an_error() {
    if std::env::var("LORA_DIST_TEST_OUT").is_ok() {
        return;
    }
    assert!(
        ProcessGroup::nccl_available(),
        "this build has no NCCL: run `cargo xtask setup` (it provisions assets/cuda/include) and rebuild"
    );
    if tch::Cuda::device_count() > 0 {
        return; // the GPU check (benches/gpu/run.sh) covers a machine with devices
    }
    let e = ProcessGroup::new_nccl("127.0.0.1", free_port(), 0, 2, Duration::from_secs(2), 0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("NCCL") && e.contains("CUDA device") && e.contains("rank 0 of 2"),
        "{e}"
    );
}
