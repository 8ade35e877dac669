//! Data-parallel training: where this process stands in a multi-process run, read from the
//! launcher's environment, and the hook through which the [`Trainer`](super::Trainer) averages
//! gradients over the ranks.
//!
//! Launchers speak one protocol, torchrun's (`torch.distributed.run`, "Environment variables"):
//! `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. Under
//! SLURM's `srun` without torchrun, `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`,
//! `SLURM_NTASKS_PER_NODE` and the first host of `SLURM_JOB_NODELIST` stand in for them (the
//! mapping Lightning's and accelerate's SLURM environments use). Kubernetes' PyTorchJob sets
//! torchrun's variables itself.
//!
//! # Where a sharded frozen base plugs in (next)
//!
//! Data parallelism replicates the frozen base on every rank; only the adapter's gradients
//! travel. Sharding the base (FSDP-style, the way Answer.AI's fsdp_qlora fits a 70B QLoRA on
//! 2 × 24 GB) keeps this hook and adds one below the model: each rank loads only its slice of
//! every frozen linear (the GGUF / safetensors readers already load by tensor and by row range),
//! and a layer's forward all-gathers the full weight just before use and drops it right after
//! (`all_gather` through the same process group), the backward doing the same; the quantized
//! bases gather their packed codes, not dequantized weights. The adapter stays replicated and
//! [`GradSync`] stays as it is. The planner's per-rank terms then divide the base by the world
//! size and add one gathered layer of working set.

use super::{Result, TrainError};
use tch::Tensor;

/// Averages gradients over data-parallel ranks before each optimizer step, and makes every
/// rank start from the same parameters. [`lora_core::dist::ProcessGroup`] implements it over
/// c10d.
pub trait GradSync {
    /// Averages the gradients of `params` over the ranks in place; `skip` is this rank's vote
    /// to skip the step (a non-finite loss). Returns `true` when any rank voted to skip: every
    /// rank then skips alike.
    ///
    /// # Errors
    /// A failed collective (a lost peer, a timeout).
    fn sync_gradients(&mut self, params: &[Tensor], skip: bool) -> Result<bool>;

    /// Makes every rank's `params` rank 0's (at the start of a run, as
    /// `DistributedDataParallel` does when it wraps a model).
    ///
    /// # Errors
    /// A failed collective.
    fn broadcast_parameters(&mut self, params: &[Tensor]) -> Result<()>;

    /// The sums over the ranks of this rank's `(samples, tokens)` of a step (one small
    /// all-reduce), so that a step reports what all ranks trained on. Default: as given.
    ///
    /// # Errors
    /// A failed collective.
    fn sum_counts(&mut self, samples: u64, tokens: u64) -> Result<(u64, u64)> {
        Ok((samples, tokens))
    }

    /// For each of `flags`, whether it is set on any rank (one small all-reduce for all of
    /// them): how the ranks agree to stop at the same step when a stop signal (or a callback's
    /// stop) reaches them at different moments. Every rank passes the same number of flags.
    /// Default: `flags` as given.
    ///
    /// # Errors
    /// A failed collective.
    fn any_rank(&mut self, flags: &[bool]) -> Result<Vec<bool>> {
        Ok(flags.to_vec())
    }

    /// Every rank's `bytes`, in rank order (an all-gather): how the rank that writes checkpoints
    /// records each rank's generator state. Default: `[bytes]`.
    ///
    /// # Errors
    /// A failed collective; [`TrainError::App`] when the ranks' lengths differ.
    fn gather_bytes(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        Ok(vec![bytes.to_vec()])
    }

    /// This rank's number (`RANK`; rank 0 writes checkpoints). Default 0.
    fn rank(&self) -> usize {
        0
    }

    /// Whether this rank writes checkpoints (every rank holds the same state, so one writes:
    /// rank 0). Default `true`.
    fn writes_checkpoints(&self) -> bool {
        true
    }

    /// Number of ranks (`WORLD_SIZE`): a checkpoint records it so that a resume on another
    /// world size can map the loader's position. Default 1.
    fn world_size(&self) -> usize {
        1
    }
}

/// How long a rank whose collective failed waits for the other survivors to mark themselves
/// present (see [`lora_core::dist::ProcessGroup::absent_ranks`]) before naming the ranks that
/// did not.
pub const ABSENT_RANK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The error of a failed collective (`what`), naming the rank that is gone when the store can
/// tell: a killed peer shows in Gloo only as a closed connection.
fn collective(pg: &lora_core::dist::ProcessGroup, what: &str, e: lora_core::Error) -> TrainError {
    let who = match pg.absent_ranks(ABSENT_RANK_WAIT) {
        Ok(absent) if absent.is_empty() => format!(
            "every rank is still there: one was slower than the collective timeout ({} s, \
             LORA_DIST_TIMEOUT_S) or the network failed",
            pg.timeout().as_secs()
        ),
        Ok(absent) => format!(
            "{} {} gone (killed, crashed or unreachable: its own output says why)",
            plural_ranks(&absent),
            if absent.len() == 1 { "is" } else { "are" }
        ),
        Err(_) => "rank 0, which serves the rendezvous store, is gone (killed, crashed or \
                   unreachable: its own output says why)"
            .into(),
    };
    TrainError::App(format!(
        "data-parallel {what} failed on rank {} of {}: {who}; start every rank again with \
         --resume to continue from the last checkpoint ({e})",
        pg.rank(),
        pg.world_size()
    ))
}

/// `rank 3` or `ranks 1, 2`.
fn plural_ranks(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

impl GradSync for lora_core::dist::ProcessGroup {
    fn sync_gradients(&mut self, params: &[Tensor], skip: bool) -> Result<bool> {
        self.average_gradients(params, skip)
            .map_err(|e| collective(self, "gradient all-reduce", e))
    }

    fn broadcast_parameters(&mut self, params: &[Tensor]) -> Result<()> {
        self.broadcast_tensors(params, 0)
            .map_err(|e| collective(self, "broadcast of rank 0's parameters", e))
    }

    fn sum_counts(&mut self, samples: u64, tokens: u64) -> Result<(u64, u64)> {
        // f64 holds counts exactly up to 2^53
        let t = Tensor::from_slice(&[samples as f64, tokens as f64]);
        self.all_reduce_sum(&t)
            .map_err(|e| collective(self, "all-reduce of the step's sample counts", e))?;
        let get = |i: i64| {
            t.f_double_value(&[i])
                .map(|v| v as u64)
                .map_err(|e| TrainError::App(format!("data-parallel counts: {e}")))
        };
        Ok((get(0)?, get(1)?))
    }

    fn any_rank(&mut self, flags: &[bool]) -> Result<Vec<bool>> {
        let votes: Vec<f32> = flags.iter().map(|&f| if f { 1.0 } else { 0.0 }).collect();
        let t = Tensor::f_from_slice(&votes)
            .map_err(|e| TrainError::App(format!("data-parallel stop vote: {e}")))?;
        self.all_reduce_sum(&t)
            .map_err(|e| collective(self, "stop vote", e))?;
        (0..flags.len())
            .map(|i| {
                t.f_double_value(&[i as i64])
                    .map(|v| v > 0.0)
                    .map_err(|e| TrainError::App(format!("data-parallel stop vote: {e}")))
            })
            .collect()
    }

    fn gather_bytes(&mut self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let app = |e: tch::TchError| TrainError::App(format!("data-parallel state gather: {e}"));
        let world = lora_core::dist::ProcessGroup::world_size(self);
        let lens = self
            .all_gather(&Tensor::from_slice(&[bytes.len() as i64]))
            .map_err(|e| collective(self, "all-gather of the generator states' lengths", e))?;
        let lens = Vec::<i64>::try_from(&lens.f_reshape([-1]).map_err(app)?).map_err(app)?;
        if lens.iter().any(|&l| l != bytes.len() as i64) {
            return Err(TrainError::App(format!(
                "data-parallel state gather: the ranks' generator states have different lengths \
                 ({lens:?} bytes); every rank must run the same libtorch on the same kind of device"
            )));
        }
        let all = self
            .all_gather(&Tensor::from_slice(bytes))
            .map_err(|e| collective(self, "all-gather of the generator states", e))?;
        (0..world as i64)
            .map(|r| {
                let row = all.f_get(r).map_err(app)?;
                Vec::<u8>::try_from(&row).map_err(app)
            })
            .collect()
    }

    fn rank(&self) -> usize {
        lora_core::dist::ProcessGroup::rank(self)
    }

    fn writes_checkpoints(&self) -> bool {
        lora_core::dist::ProcessGroup::rank(self) == 0
    }

    fn world_size(&self) -> usize {
        lora_core::dist::ProcessGroup::world_size(self)
    }
}

/// Which launcher's variables described the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// torchrun's variables (also set by Kubernetes' PyTorchJob and by `--nproc-per-node`).
    Torchrun,
    /// SLURM's, mapped onto torchrun's.
    Slurm,
}

/// This process's place in a data-parallel run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// Number of processes (`WORLD_SIZE`).
    pub world_size: usize,
    /// Rank on this machine (`LOCAL_RANK`): the CUDA device a GPU run uses.
    pub local_rank: usize,
    /// Processes on this machine (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// Host of rank 0's rendezvous store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Its port (`MASTER_PORT`; 29500, torchrun's default, when unset).
    pub master_port: u16,
    /// Where the values came from.
    pub launcher: Launcher,
}

/// torchrun's default `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

impl DistEnv {
    /// Reads the process environment; `Ok(None)` for a single-process run (no `WORLD_SIZE` /
    /// `SLURM_NTASKS`, or a world of 1).
    ///
    /// # Errors
    /// [`TrainError::Invalid`] naming the variable whose value is not a number, a rank outside
    /// the world, or a multi-process run without `MASTER_ADDR`.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`DistEnv::from_env`] over any source of variables (tests, a launcher's own map).
    ///
    /// # Errors
    /// As [`DistEnv::from_env`].
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let get = |k: &str| {
            get(k)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let num = |k: &str, v: String| -> Result<usize> {
            v.parse().map_err(|_| TrainError::Invalid {
                what: k.into(),
                value: v,
                hint: "a non-negative integer (set by torchrun / srun)".into(),
            })
        };
        let (launcher, rank, world, local_rank, local_world) = if let Some(w) = get("WORLD_SIZE") {
            let world = num("WORLD_SIZE", w)?;
            let rank = get("RANK")
                .map(|v| num("RANK", v))
                .transpose()?
                .unwrap_or(0);
            let local_rank = get("LOCAL_RANK")
                .map(|v| num("LOCAL_RANK", v))
                .transpose()?
                .unwrap_or(rank);
            let local_world = get("LOCAL_WORLD_SIZE")
                .map(|v| num("LOCAL_WORLD_SIZE", v))
                .transpose()?
                .unwrap_or(world);
            (Launcher::Torchrun, rank, world, local_rank, local_world)
        } else if let Some(n) = get("SLURM_NTASKS") {
            let world = num("SLURM_NTASKS", n)?;
            let rank = get("SLURM_PROCID")
                .map(|v| num("SLURM_PROCID", v))
                .transpose()?
                .unwrap_or(0);
            let local_rank = get("SLURM_LOCALID")
                .map(|v| num("SLURM_LOCALID", v))
                .transpose()?
                .unwrap_or(0);
            // "2(x3),1": the first node's count is this layout's common case
            let local_world = match get("SLURM_NTASKS_PER_NODE") {
                Some(v) => {
                    let first = v.split([',', '(']).next().unwrap_or_default().to_string();
                    num("SLURM_NTASKS_PER_NODE", first)?
                }
                None => world,
            };
            (Launcher::Slurm, rank, world, local_rank, local_world)
        } else {
            return Ok(None);
        };
        if world <= 1 {
            return Ok(None);
        }
        let var = |torchrun: &'static str, slurm: &'static str| match launcher {
            Launcher::Torchrun => torchrun,
            Launcher::Slurm => slurm,
        };
        if rank >= world {
            return Err(TrainError::Invalid {
                what: var("RANK", "SLURM_PROCID").into(),
                value: rank.to_string(),
                hint: format!("a rank in 0..{world} (the world size)"),
            });
        }
        if local_rank >= local_world.max(1) {
            return Err(TrainError::Invalid {
                what: var("LOCAL_RANK", "SLURM_LOCALID").into(),
                value: local_rank.to_string(),
                hint: format!("a local rank in 0..{local_world} (the processes on this machine)"),
            });
        }
        let master_addr = match (get("MASTER_ADDR"), launcher) {
            (Some(a), _) => a,
            (None, Launcher::Slurm) => get("SLURM_JOB_NODELIST")
                .or_else(|| get("SLURM_NODELIST"))
                .map(|l| first_host(&l))
                .ok_or_else(|| TrainError::Invalid {
                    what: "MASTER_ADDR".into(),
                    value: "unset".into(),
                    hint: "set MASTER_ADDR to the first node's host name (SLURM_JOB_NODELIST is unset too)".into(),
                })?,
            (None, Launcher::Torchrun) => {
                return Err(TrainError::Invalid {
                    what: "MASTER_ADDR".into(),
                    value: "unset".into(),
                    hint: "a multi-process run needs the host of rank 0 (torchrun sets it; by hand: MASTER_ADDR=127.0.0.1 on one machine)".into(),
                });
            }
        };
        let master_port = match get("MASTER_PORT") {
            Some(p) => p.parse().map_err(|_| TrainError::Invalid {
                what: "MASTER_PORT".into(),
                value: p,
                hint: "a TCP port, 1-65535".into(),
            })?,
            None => DEFAULT_MASTER_PORT,
        };
        Ok(Some(DistEnv {
            rank,
            world_size: world,
            local_rank,
            local_world_size: local_world,
            master_addr,
            master_port,
            launcher,
        }))
    }

    /// Joins the run's process group: over Gloo for a CPU run
    /// ([`lora_core::dist::ProcessGroup::new_gloo`]), over NCCL on `device` for a CUDA run
    /// ([`lora_core::dist::ProcessGroup::new_nccl`]; `device` is this rank's, normally
    /// `cuda:LOCAL_RANK`).
    ///
    /// # Errors
    /// The backend missing from this build (or no such CUDA device), a rendezvous timeout, a
    /// port in use.
    pub fn join(
        &self,
        timeout: std::time::Duration,
        device: tch::Device,
    ) -> Result<lora_core::dist::ProcessGroup> {
        use lora_core::dist::ProcessGroup;
        match device {
            tch::Device::Cuda(i) => ProcessGroup::new_nccl(
                &self.master_addr,
                self.master_port,
                self.rank,
                self.world_size,
                timeout,
                i,
            ),
            _ => ProcessGroup::new_gloo(
                &self.master_addr,
                self.master_port,
                self.rank,
                self.world_size,
                timeout,
            ),
        }
        .map_err(|e| TrainError::App(format!("data-parallel set-up: {e}")))
    }

    /// Whether this process writes the run's files (checkpoints, adapters, logs): rank 0.
    pub fn writes_files(&self) -> bool {
        self.rank == 0
    }
}

/// The first host of a SLURM node list: `gpu[01-04,07],cpu3` → `gpu01`; `a,b` → `a`.
pub fn first_host(list: &str) -> String {
    let head = match (list.find('['), list.find(',')) {
        (Some(b), Some(c)) if c < b => return list[..c].to_string(),
        (Some(b), _) => {
            let prefix = &list[..b];
            let inner = &list[b + 1..];
            let first = inner
                .split([',', ']'])
                .next()
                .unwrap_or_default()
                .split('-')
                .next()
                .unwrap_or_default();
            return format!("{prefix}{first}");
        }
        (None, Some(c)) => &list[..c],
        (None, None) => list,
    };
    head.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        DistEnv::from_vars(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_variables_describe_the_process() {
        let e = env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "29511"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            e,
            DistEnv {
                rank: 3,
                world_size: 4,
                local_rank: 1,
                local_world_size: 2,
                master_addr: "node7".into(),
                master_port: 29511,
                launcher: Launcher::Torchrun,
            }
        );
        assert!(!e.writes_files());
        // one process, or nothing set: not a data-parallel run
        assert_eq!(env(&[("WORLD_SIZE", "1"), ("RANK", "0")]).unwrap(), None);
        assert_eq!(env(&[]).unwrap(), None);
        // torchrun's default port
        let e = env(&[("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", "h")])
            .unwrap()
            .unwrap();
        assert_eq!(e.master_port, DEFAULT_MASTER_PORT);
        assert_eq!(e.local_rank, 0);
    }

    #[test]
    fn slurm_variables_map_onto_torchrun_and_torchrun_wins() {
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[03-04]"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (e.rank, e.world_size, e.local_rank, e.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(e.master_addr, "gpu03");
        assert_eq!(e.launcher, Launcher::Slurm);
        // torchrun started inside an srun step sets its own variables: those count
        let e = env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!((e.rank, e.launcher), (1, Launcher::Torchrun));
    }

    #[test]
    fn bad_values_name_the_variable() {
        for (pairs, var) in [
            (
                vec![("WORLD_SIZE", "two"), ("MASTER_ADDR", "h")],
                "WORLD_SIZE",
            ),
            (
                vec![("WORLD_SIZE", "2"), ("RANK", "2"), ("MASTER_ADDR", "h")],
                "RANK",
            ),
            (vec![("WORLD_SIZE", "2"), ("RANK", "1")], "MASTER_ADDR"),
            (
                vec![
                    ("WORLD_SIZE", "2"),
                    ("MASTER_ADDR", "h"),
                    ("MASTER_PORT", "99999"),
                ],
                "MASTER_PORT",
            ),
            (
                vec![("SLURM_NTASKS", "2"), ("SLURM_PROCID", "x")],
                "SLURM_PROCID",
            ),
        ] {
            let e = env(&pairs).unwrap_err().to_string();
            assert!(e.contains(var), "{pairs:?}: {e}");
        }
    }

    #[test]
    fn first_host_of_slurm_node_lists() {
        for (list, host) in [
            ("gpu[01-04,07],cpu3", "gpu01"),
            ("node12", "node12"),
            ("a,b[1-2]", "a"),
            ("n[7,9]", "n7"),
        ] {
            assert_eq!(first_host(list), host, "{list}");
        }
    }
}
