//! The time of one data-parallel gradient sync: `--world` processes of this binary on loopback
//! (Gloo over c10d, as `lora-train train --nproc-per-node N` runs them) average the gradient of
//! one parameter of `--elements` fp32 values with `ProcessGroup::average_gradients` — the flat
//! buffer and the one all-reduce each optimizer step makes. The default, 921,600, is the
//! SmolLM2-135M demo adapter (r8 on q/k/v/o of 30 layers).
//!
//! ```text
//! bench-allreduce [--elements 921600] [--world 2] [--iters 50] [--warmup 5]
//! ```
//!
//! Prints one JSON line: elements, bytes, world, and the median / min / max milliseconds per
//! sync over `--iters` (after `--warmup`), as rank 0 measured them. Started by `benches/dist.sh`.

use lora_core::dist::ProcessGroup;
use std::process::Command;
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

fn flag(args: &[String], name: &str, default: u64) -> Result<u64, String> {
    match args.iter().position(|a| a == name) {
        Some(i) => {
            let v = args
                .get(i + 1)
                .ok_or_else(|| format!("{name} needs a value"))?;
            v.parse().map_err(|e| format!("{name} {v:?}: {e}"))
        }
        None => Ok(default),
    }
}

/// One rank: joins the group and times the syncs; rank 0 prints the summary.
fn worker(
    rank: usize,
    world: usize,
    port: u16,
    elements: i64,
    iters: u64,
    warmup: u64,
) -> Result<(), String> {
    tch::set_num_threads(1);
    let pg = ProcessGroup::new_gloo("127.0.0.1", port, rank, world, Duration::from_secs(120))
        .map_err(|e| e.to_string())?;
    let p = Tensor::zeros([elements], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    p.sum(Kind::Float).backward();
    let params = [p];
    let mut ms = Vec::with_capacity(iters as usize);
    for i in 0..warmup + iters {
        pg.barrier().map_err(|e| e.to_string())?;
        let t = Instant::now();
        let skipped = pg
            .average_gradients(&params, false)
            .map_err(|e| e.to_string())?;
        if skipped {
            return Err("a rank voted to skip".into());
        }
        if i >= warmup {
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    ms.sort_by(f64::total_cmp);
    if rank == 0 {
        println!(
            "{}",
            serde_json::json!({
                "elements": elements,
                "bytes": 4 * (elements + 1),
                "world": world,
                "iters": iters,
                "median_ms": ms[ms.len() / 2],
                "min_ms": ms[0],
                "max_ms": ms[ms.len() - 1],
            })
        );
    }
    Ok(())
}

fn run() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let elements = flag(&args, "--elements", 921_600)? as i64;
    let world = flag(&args, "--world", 2)?.max(1) as usize;
    let iters = flag(&args, "--iters", 50)?.max(1);
    let warmup = flag(&args, "--warmup", 5)?;
    if let (Ok(rank), Ok(port)) = (std::env::var("RANK"), std::env::var("MASTER_PORT")) {
        let rank = rank.parse().map_err(|e| format!("RANK {rank:?}: {e}"))?;
        let port = port
            .parse()
            .map_err(|e| format!("MASTER_PORT {port:?}: {e}"))?;
        return worker(rank, world, port, elements, iters, warmup);
    }
    // the launcher: `world` copies of this binary, as torchrun would start them
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port: {e}"))?
        .port();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        children.push(
            Command::new(&exe)
                .args(&args)
                .env("RANK", rank.to_string())
                .env("MASTER_PORT", port.to_string())
                .env("OMP_NUM_THREADS", "1")
                .spawn()
                .map_err(|e| format!("starting rank {rank}: {e}"))?,
        );
    }
    let mut failed = None;
    for (rank, mut c) in children.into_iter().enumerate() {
        let status = c.wait().map_err(|e| e.to_string())?;
        if !status.success() && failed.is_none() {
            failed = Some(format!("rank {rank} failed: {status}"));
        }
    }
    failed.map_or(Ok(()), Err)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("bench-allreduce: {e}");
        std::process::exit(1);
    }
}
