//! Data-parallel collectives over PyTorch's own distributed engine (c10d), through the shim.
//!
//! A [`ProcessGroup`] is what `torch.distributed.init_process_group("gloo")` builds: rank 0
//! serves a `TCPStore` at `MASTER_ADDR:MASTER_PORT`, every rank connects to it, and the
//! collectives run over `ProcessGroupGloo` — the code in the `libtorch_cpu.so` this crate links,
//! so processes of this SDK and of PyTorch speak the same protocol. Gloo over loopback makes
//! data parallelism testable on one CPU machine.
//!
//! Data parallelism as PyTorch's `DistributedDataParallel` does it: every rank starts from the
//! same parameters ([`ProcessGroup::broadcast_tensors`] from rank 0), trains on its own shard
//! of the batches, and before each optimizer step the gradients are averaged over the ranks
//! ([`ProcessGroup::average_gradients`]), so every rank takes the same step.
//!
//! On CUDA the collectives run over `ProcessGroupNCCL` instead ([`ProcessGroup::new_nccl`],
//! one device per local rank, as `init_process_group("nccl")`), the code in the
//! `libtorch_cuda.so` this crate links.
//!
//! The Gloo backend needs gloo's C++ headers when this crate is compiled
//! ([`ProcessGroup::gloo_available`]), the NCCL backend `nccl.h` and CUDA's runtime headers
//! ([`ProcessGroup::nccl_available`]); see the build script for where they are looked for.
//!
//! ```no_run
//! use lora_core::dist::ProcessGroup;
//! use std::time::Duration;
//! // in each of 2 processes, with RANK 0 and 1:
//! let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
//! let pg = ProcessGroup::new_gloo("127.0.0.1", 29500, rank, 2, Duration::from_secs(60))?;
//! let t = tch::Tensor::from_slice(&[rank as f32 + 1.0]);
//! pg.all_reduce_sum(&t)?; // 3.0 on both ranks
//! # Ok::<(), lora_core::Error>(())
//! ```

use crate::error::{Error, Result, TchContext};
use crate::sys::dist as raw;
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// A group of `world_size` processes joined through a c10d `TCPStore`, with collectives over
/// Gloo (CPU tensors) or NCCL (tensors on this rank's CUDA device). Dropping it leaves the
/// group.
pub struct ProcessGroup {
    raw: raw::RawGroup,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    device: Device,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessGroup")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("device", &self.device)
            .finish()
    }
}

fn shim(context: &str, e: crate::sys::ShimError) -> Error {
    Error::Torch {
        context: context.to_string(),
        source: tch::TchError::from(e),
    }
}

impl ProcessGroup {
    /// Whether this build has the Gloo backend (gloo's headers were found at compile time).
    pub fn gloo_available() -> bool {
        raw::has_gloo().unwrap_or(false)
    }

    /// Whether this build has the NCCL backend (libtorch_cuda, `nccl.h` and the CUDA runtime
    /// headers were found at compile time). A CUDA device is still needed to use it.
    pub fn nccl_available() -> bool {
        raw::has_nccl().unwrap_or(false)
    }

    /// Joins the group as [`ProcessGroup::new_gloo`] does, with collectives over NCCL on
    /// `cuda:device_index` (torchrun's `LOCAL_RANK`, one device per process), which becomes
    /// this thread's current device. Collectives take tensors on any device: those not on the
    /// group's device are copied there and back.
    ///
    /// A collective that times out (a rank that hangs) is an error, not an abort: unless set,
    /// `TORCH_NCCL_BLOCKING_WAIT=1` and `TORCH_NCCL_ASYNC_ERROR_HANDLING=0` are set for the
    /// process before the group is made.
    ///
    /// # Errors
    /// [`Error::Config`] for a rank outside `0..world_size`; [`Error::Torch`] when this build has
    /// no NCCL, the process sees no CUDA device or not `device_index`, the port is taken, the
    /// rendezvous times out, or NCCL fails to start.
    pub fn new_nccl(
        master_addr: &str,
        master_port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        device_index: usize,
    ) -> Result<ProcessGroup> {
        Self::join(
            master_addr,
            master_port,
            rank,
            world_size,
            timeout,
            Device::Cuda(device_index),
        )
    }

    /// Joins the group: rank 0 listens at `master_addr:master_port` (torchrun's `MASTER_ADDR`
    /// and `MASTER_PORT`), the other ranks connect there; returns once all `world_size` ranks
    /// have joined. `timeout` bounds the rendezvous and every later collective.
    ///
    /// # Errors
    /// [`Error::Config`] for a rank outside `0..world_size`; [`Error::Torch`] when this build has
    /// no Gloo, the port is taken (rank 0), the rendezvous times out, or Gloo cannot open its
    /// connections.
    pub fn new_gloo(
        master_addr: &str,
        master_port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<ProcessGroup> {
        Self::join(
            master_addr,
            master_port,
            rank,
            world_size,
            timeout,
            Device::Cpu,
        )
    }

    /// Gloo for `Device::Cpu`, NCCL on the device otherwise.
    fn join(
        master_addr: &str,
        master_port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
        device: Device,
    ) -> Result<ProcessGroup> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::Config(format!(
                "process rank {rank} is outside 0..{world_size} (world_size {world_size})"
            )));
        }
        let (backend, nccl_device) = match device {
            Device::Cuda(i) => ("NCCL", Some(i)),
            _ => ("Gloo", None),
        };
        let raw = raw::group_new(
            master_addr,
            master_port,
            rank,
            world_size,
            timeout.as_millis() as u64,
            "lora-sdk/",
            nccl_device,
        )
        .map_err(|e| {
            shim(
                &format!(
                    "joining the process group at {master_addr}:{master_port} as rank {rank} of {world_size} ({backend})"
                ),
                e,
            )
        })?;
        Ok(ProcessGroup {
            raw,
            rank,
            world_size,
            timeout,
            device,
        })
    }

    /// Where the collectives run: the CPU (Gloo) or this rank's CUDA device (NCCL).
    pub fn device(&self) -> Device {
        self.device
    }

    /// `t` itself when it is on the group's device, else a contiguous copy there (written back
    /// by [`ProcessGroup::write_back`] after an in-place collective).
    fn on_device(&self, t: &Tensor) -> Result<Tensor> {
        if t.device() == self.device {
            Ok(t.shallow_clone())
        } else {
            t.f_to_device(self.device)
                .and_then(|d| d.f_contiguous())
                .ctx(|| format!("copying a tensor to {:?} for a collective", self.device))
        }
    }

    /// Copies the result of an in-place collective on `moved` back into `t` when
    /// [`ProcessGroup::on_device`] had to copy it.
    fn write_back(t: &Tensor, moved: &Tensor) -> Result<()> {
        if t.device() != moved.device() {
            let mut t = t.shallow_clone();
            t.f_copy_(moved)
                .ctx(|| "copying a collective's result back")?;
        }
        Ok(())
    }

    /// This process's rank, `0..world_size`.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of processes in the group.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// How long the rendezvous and each collective wait for the other ranks.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// In place: `t` becomes the element-wise sum of every rank's `t`.
    ///
    /// # Shapes
    /// Any shape, the same on every rank; contiguous (a non-contiguous tensor is an error).
    ///
    /// # Errors
    /// [`Error::Torch`] on a mismatch between ranks, a timeout or a lost peer.
    pub fn all_reduce_sum(&self, t: &Tensor) -> Result<()> {
        let moved = self.on_device(t)?;
        raw::all_reduce_sum(&self.raw, &moved).map_err(|e| shim("all-reducing a tensor", e))?;
        Self::write_back(t, &moved)
    }

    /// In place: `t` becomes rank `root`'s `t`.
    ///
    /// # Errors
    /// As [`ProcessGroup::all_reduce_sum`].
    pub fn broadcast(&self, t: &Tensor, root: usize) -> Result<()> {
        let moved = self.on_device(t)?;
        raw::broadcast(&self.raw, &moved, root).map_err(|e| shim("broadcasting a tensor", e))?;
        Self::write_back(t, &moved)
    }

    /// Waits until every rank has called it.
    ///
    /// # Errors
    /// A timeout or a lost peer.
    pub fn barrier(&self) -> Result<()> {
        raw::barrier(&self.raw).map_err(|e| shim("waiting at a barrier", e))
    }

    /// Every rank's `t`, stacked in rank order (`torch.distributed.all_gather` into one tensor):
    /// row `r` of the result is rank `r`'s `t`.
    ///
    /// # Shapes
    /// `t`: any shape and dtype, the same on every rank → `[world_size, *t.shape]`, `t`'s dtype,
    /// on `t`'s device.
    ///
    /// # Errors
    /// [`Error::Torch`] when the ranks' shapes or dtypes differ (Gloo reports it, or the
    /// collective times out), on a timeout or a lost peer — never an abort.
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let input = self
            .on_device(t)?
            .f_contiguous()
            .ctx(|| "making the all-gather input contiguous")?;
        let mut shape = vec![self.world_size as i64];
        shape.extend(input.size());
        let out = Tensor::f_empty(shape.as_slice(), (input.kind(), input.device()))
            .ctx(|| "allocating the all-gather output")?;
        raw::all_gather(&self.raw, &input, &out).map_err(|e| shim("all-gathering a tensor", e))?;
        if t.device() == out.device() {
            Ok(out)
        } else {
            out.f_to_device(t.device())
                .ctx(|| "copying the all-gather result back")
        }
    }

    /// After a failed collective: the ranks that are gone. This rank marks itself present in
    /// the rendezvous store, then waits up to `wait` for every other rank to do the same (each
    /// survivor calls this when its own collective fails); the ranks that never do are returned,
    /// in order. A peer that died mid-step leaves Gloo with a closed connection whose address
    /// does not say which rank it was; this does.
    ///
    /// # Errors
    /// [`Error::Torch`] when the store does not answer: rank 0, which serves it, is gone (or the
    /// network to it is).
    pub fn absent_ranks(&self, wait: Duration) -> Result<Vec<usize>> {
        const KEY: &str = "present-after-failure/";
        let shim = |e| shim("asking the rendezvous store which ranks are still there", e);
        raw::store_add(&self.raw, &format!("{KEY}{}", self.rank), 1).map_err(shim)?;
        let deadline = std::time::Instant::now() + wait;
        loop {
            let mut absent = Vec::new();
            for r in (0..self.world_size).filter(|&r| r != self.rank) {
                if !raw::store_check(&self.raw, &format!("{KEY}{r}")).map_err(shim)? {
                    absent.push(r);
                }
            }
            if absent.is_empty() || std::time::Instant::now() >= deadline {
                return Ok(absent);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Averages the gradients of `params` over the ranks, in place, as
    /// `DistributedDataParallel` does before the optimizer step: `g ← (Σ_ranks g) / world_size`.
    /// The gradients travel as one flat fp32 buffer (one collective per step, not one per
    /// tensor) with one more element: this rank's `skip` vote (a non-finite loss, say). Returns
    /// `true` when any rank voted to skip — then no gradient is written back and every rank
    /// should skip the step alike, or the ranks' parameters would drift apart. With one rank
    /// this only returns `skip`.
    ///
    /// # Errors
    /// [`Error::Config`] when a parameter has no gradient on a rank that does not skip; as
    /// [`ProcessGroup::all_reduce_sum`] otherwise. Ranks must pass the same parameters in the
    /// same order.
    pub fn average_gradients(&self, params: &[Tensor], skip: bool) -> Result<bool> {
        if self.world_size == 1 {
            return Ok(skip);
        }
        let _no_grad = tch::no_grad_guard();
        let mut grads = Vec::with_capacity(params.len() + 1);
        for (i, p) in params.iter().enumerate() {
            let g = p.grad();
            if g.defined() {
                grads.push(g);
            } else if skip {
                grads.push(p.f_zeros_like().ctx(|| "a zero gradient")?);
            } else {
                return Err(Error::Config(format!(
                    "parameter {i} of {} has no gradient on rank {}: every rank must train every parameter (one the loss does not reach would leave the ranks apart)",
                    params.len(),
                    self.rank
                )));
            }
        }
        grads.push(Tensor::from_slice(&[if skip { 1f32 } else { 0f32 }]));
        let mut flat = flatten_f32(&grads, self.device)?;
        self.all_reduce_sum(&flat)?;
        let votes = flat
            .f_get(flat.numel() as i64 - 1)
            .and_then(|v| v.f_double_value(&[]))
            .ctx(|| "reading the skip votes")?;
        if votes > 0.0 {
            return Ok(true);
        }
        let _ = flat
            .f_div_scalar_(self.world_size as f64)
            .ctx(|| "dividing the summed gradients")?;
        let n = grads.len() - 1;
        for (g, chunk) in grads[..n].iter().zip(unflatten(&flat, &grads[..n])?) {
            let mut g = g.shallow_clone();
            g.f_copy_(&chunk).ctx(|| "writing an averaged gradient")?;
        }
        Ok(false)
    }

    /// In place: every rank's `tensors` become rank `root`'s (one flat fp32 buffer), e.g. the
    /// initial adapter weights, as `DistributedDataParallel` broadcasts rank 0's parameters
    /// when it wraps a model.
    ///
    /// # Errors
    /// As [`ProcessGroup::broadcast`].
    pub fn broadcast_tensors(&self, tensors: &[Tensor], root: usize) -> Result<()> {
        if self.world_size == 1 || tensors.is_empty() {
            return Ok(());
        }
        let _no_grad = tch::no_grad_guard();
        let flat = flatten_f32(tensors, self.device)?;
        self.broadcast(&flat, root)?;
        for (t, chunk) in tensors.iter().zip(unflatten(&flat, tensors)?) {
            let mut t = t.shallow_clone();
            t.f_copy_(&chunk).ctx(|| "writing a broadcast tensor")?;
        }
        Ok(())
    }
}

/// The tensors, flattened and converted to fp32, concatenated into one contiguous buffer on
/// `device` (the group's).
fn flatten_f32(ts: &[Tensor], device: Device) -> Result<Tensor> {
    let parts = ts
        .iter()
        .map(|t| {
            t.f_to_device(device)
                .and_then(|t| t.f_to_kind(Kind::Float))
                .and_then(|t| t.f_reshape([-1]))
                .ctx(|| "flattening a tensor for a collective")
        })
        .collect::<Result<Vec<_>>>()?;
    Tensor::f_cat(&parts, 0)
        .and_then(|t| t.f_contiguous())
        .ctx(|| "concatenating tensors for a collective")
}

/// Views of `flat` shaped as `like`, in order.
fn unflatten(flat: &Tensor, like: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut at = 0i64;
    like.iter()
        .map(|t| {
            let n = t.numel() as i64;
            let v = flat
                .f_narrow(0, at, n)
                .and_then(|v| v.f_view(t.size().as_slice()))
                .ctx(|| "splitting a collective's buffer")?;
            at += n;
            Ok(v)
        })
        .collect()
}
