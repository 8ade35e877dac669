//! Adaptive micro-batching shared by the taggers: start from what fits, halve on out-of-memory.
//!
//! **Start.** [`start_micro_batch`]: with `free` bytes available on the device and a tagger's
//! estimate of the bytes one item needs at its peak (`per_item`), the first micro-batch is
//!
//! ```text
//! micro_batch = clamp(floor(free · headroom / per_item), 1, max_batch_size)
//! ```
//!
//! with `headroom` = 0.8 (a fifth of the free memory is left to the allocator's rounding and
//! fragmentation, libtorch's workspace buffers and the rest of the process). `free` is
//! [`ResourceSnapshot::free_for`]: on CUDA the driver's free memory (`cudaMemGetInfo`) plus what
//! the caching allocator holds unused, on CPU `MemAvailable` from `/proc/meminfo`, each capped by
//! `model_settings.max_memory` and, on CPU, by the shim's allocation limit when one is set
//! ([`lora_core::sys::set_cpu_alloc_limit`]).
//!
//! **Back-off.** [`AdaptiveBatcher::run`] runs the items chunk by chunk; when a chunk fails with a
//! libtorch out-of-memory error ([`is_oom`]: "out of memory" from CUDA, "can't allocate memory"
//! from the CPU allocator — the test `lora-train` uses for its trainer) the chunk's tensors are
//! dropped with the failed call, the micro-batch is halved and the *same* chunk is retried; the
//! smaller size is kept for the rest of the run. At a micro-batch of 1 the error is
//! [`Error::OutOfMemory`].

use std::fmt;

use tch::Device;

use crate::error::{Error, Result};

/// Fraction of the free memory a micro-batch may plan for (lora-memory's, re-exported).
pub use lora_memory::inference::HEADROOM;

/// True for libtorch's out-of-memory messages (the one definition, in lora-core).
pub use lora_core::oom::is_oom_message;

/// True when `e` is a libtorch out-of-memory error.
pub fn is_oom(e: &Error) -> bool {
    match e {
        Error::Torch(t) => is_oom_message(&t.to_string()),
        Error::OutOfMemory { .. } => true,
        _ => false,
    }
}

/// The first micro-batch: `clamp(floor(free · HEADROOM / per_item), 1, max_batch_size)`, i.e.
/// [`lora_memory::inference::batch_for`] with the model already loaded (its weights are no longer
/// in `free`); with no estimate (`free` or `per_item` unknown or zero) it is `max_batch_size`.
///
/// ```
/// use lora_tagger::batch::start_micro_batch;
/// // 100 MB free, 30 MB per image: floor(80 / 30) = 2.
/// assert_eq!(start_micro_batch(8, Some(100_000_000), Some(30_000_000)), 2);
/// assert_eq!(start_micro_batch(8, Some(1_000), Some(30_000_000)), 1);
/// assert_eq!(start_micro_batch(8, None, Some(30_000_000)), 8);
/// ```
pub fn start_micro_batch(max_batch_size: usize, free: Option<u64>, per_item: Option<u64>) -> usize {
    use lora_memory::Bytes;
    use lora_memory::inference::{InferenceMemory, batch_for};
    match (free, per_item) {
        (Some(f), Some(p)) if p > 0 => {
            let loaded = InferenceMemory {
                weights: Bytes(0),
                fixed: Bytes(0),
                per_item: Bytes(p),
            };
            batch_for(&loaded, Bytes(f), max_batch_size).batch
        }
        _ => max_batch_size.max(1),
    }
}

/// Memory in use and free right now, for logging and for the first micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ResourceSnapshot {
    /// Total RAM (`MemTotal`), bytes; 0 when unknown.
    pub ram_total: u64,
    /// RAM available to new allocations (`MemAvailable`), bytes.
    pub ram_available: u64,
    /// This process's resident set (`VmRSS`), bytes.
    pub process_rss: u64,
    /// Live CPU tensor bytes and the limit, when the shim's counting allocator is installed.
    pub cpu_tensors: Option<(u64, Option<u64>)>,
    /// `(free, total)` of the CUDA device, bytes, when the run is on CUDA.
    pub vram: Option<(u64, u64)>,
    /// `(allocated, reserved)` by libtorch's caching allocator on that device, bytes.
    pub cuda_allocator: Option<(u64, u64)>,
}

impl ResourceSnapshot {
    /// Reads `/proc/meminfo`, `/proc/self/status`, the shim's CPU counters and, for a CUDA
    /// `device`, `cudaMemGetInfo` and the caching allocator's statistics. Missing sources read as
    /// zero / `None` (never an error).
    pub fn take(device: Device) -> Self {
        let (ram_total, ram_available) = lora_memory::host::ram().unwrap_or((0, 0));
        let (process_rss, _) = lora_memory::host::process_rss();
        let cpu_tensors = match lora_core::sys::counting_cpu_allocator_installed() {
            Ok(true) => lora_core::sys::cpu_mem_stats()
                .ok()
                .map(|s| (s.current_bytes, s.limit_bytes)),
            _ => None,
        };
        let (vram, cuda_allocator) = match device {
            Device::Cuda(i) => (
                lora_core::sys::cuda_mem_info(i).ok().flatten(),
                lora_core::sys::cuda_mem_stats(i)
                    .ok()
                    .flatten()
                    .map(|s| (s.allocated_bytes, s.reserved_bytes)),
            ),
            _ => (None, None),
        };
        ResourceSnapshot {
            ram_total,
            ram_available,
            process_rss,
            cpu_tensors,
            vram,
            cuda_allocator,
        }
    }

    /// RAM in use as a percentage of the total (`100 · (total − available) / total`).
    pub fn ram_used_pct(&self) -> f64 {
        if self.ram_total == 0 {
            return 0.0;
        }
        100.0 * self.ram_total.saturating_sub(self.ram_available) as f64 / self.ram_total as f64
    }

    /// Bytes a batch on `device` may plan for, capped by `cap` (`model_settings.max_memory`):
    /// CUDA: driver free + reserved-but-unallocated; CPU: `MemAvailable`, and at most
    /// `limit − live tensor bytes` when the shim's CPU limit is set. `None` when unknown.
    pub fn free_for(&self, device: Device, cap: Option<u64>) -> Option<u64> {
        let free = match device {
            Device::Cuda(_) => {
                let (free, _) = self.vram?;
                let cached = self
                    .cuda_allocator
                    .map(|(a, r)| r.saturating_sub(a))
                    .unwrap_or(0);
                Some(free + cached)
            }
            _ => {
                let mut f = (self.ram_available > 0).then_some(self.ram_available);
                if let Some((cur, Some(limit))) = self.cpu_tensors {
                    let room = limit.saturating_sub(cur);
                    f = Some(f.map_or(room, |x| x.min(room)));
                }
                f
            }
        };
        match (free, cap) {
            (Some(f), Some(c)) => Some(f.min(c)),
            (None, Some(c)) => Some(c),
            (f, None) => f,
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

impl fmt::Display for ResourceSnapshot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "RAM {:.0}/{:.0} MiB used ({:.1}%), process RSS {:.0} MiB",
            mib(self.ram_total.saturating_sub(self.ram_available)),
            mib(self.ram_total),
            self.ram_used_pct(),
            mib(self.process_rss)
        )?;
        if let Some((cur, limit)) = self.cpu_tensors {
            write!(f, ", CPU tensors {:.1} MiB", mib(cur))?;
            if let Some(l) = limit {
                write!(f, " (limit {:.1} MiB)", mib(l))?;
            }
        }
        if let Some((free, total)) = self.vram {
            write!(
                f,
                ", VRAM {:.0} MiB used, {:.0} MiB free of {:.0} MiB",
                mib(total.saturating_sub(free)),
                mib(free),
                mib(total)
            )?;
        }
        if let Some((a, r)) = self.cuda_allocator {
            write!(
                f,
                " (allocated {:.0} MiB, reserved {:.0} MiB)",
                mib(a),
                mib(r)
            )?;
        }
        Ok(())
    }
}

/// What the batcher reports as it goes.
#[derive(Debug, Clone)]
pub enum BatchEvent {
    /// A chunk finished.
    Done {
        /// Index of its first item.
        start: usize,
        /// Items in it.
        len: usize,
        /// Memory right after it.
        snapshot: ResourceSnapshot,
    },
    /// A chunk ran out of memory; it is retried with a smaller micro-batch.
    OomHalved {
        /// Index of its first item.
        start: usize,
        /// The micro-batch that failed.
        from: usize,
        /// The micro-batch tried next.
        to: usize,
        /// libtorch's message.
        message: String,
    },
}

impl fmt::Display for BatchEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BatchEvent::Done {
                start,
                len,
                snapshot,
            } => write!(f, "items {}..{}: {snapshot}", start, start + len),
            BatchEvent::OomHalved {
                start,
                from,
                to,
                message,
            } => {
                let first = message.lines().next().unwrap_or("");
                write!(
                    f,
                    "items from {start}: out of memory at micro-batch {from}, retrying with {to} ({first})"
                )
            }
        }
    }
}

/// Callback receiving [`BatchEvent`]s.
pub type BatchCallback = Box<dyn FnMut(&BatchEvent) + Send>;

/// Runs items in micro-batches, halving on out-of-memory (see the module docs).
pub struct AdaptiveBatcher {
    micro_batch: usize,
    halvings: u32,
    device: Device,
    clear_interval: usize,
    batches: usize,
    callback: Option<BatchCallback>,
}

impl fmt::Debug for AdaptiveBatcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveBatcher")
            .field("micro_batch", &self.micro_batch)
            .field("halvings", &self.halvings)
            .field("device", &self.device)
            .finish()
    }
}

impl AdaptiveBatcher {
    /// A batcher starting at `micro_batch` (at least 1) for work on `device`.
    pub fn new(micro_batch: usize, device: Device) -> Self {
        AdaptiveBatcher {
            micro_batch: micro_batch.max(1),
            halvings: 0,
            device,
            clear_interval: 0,
            batches: 0,
            callback: None,
        }
    }

    /// Every `n` chunks, return unused cached CUDA blocks to the driver
    /// (`memory_management.auto_clear_interval`; 0 = never).
    pub fn with_clear_interval(mut self, n: usize) -> Self {
        self.clear_interval = n;
        self
    }

    /// Sets the callback that receives every [`BatchEvent`] (e.g. to log a resource snapshot per
    /// batch to stderr).
    pub fn set_callback(&mut self, cb: Option<BatchCallback>) {
        self.callback = cb;
    }

    /// Takes the callback back out (to reuse it for the next run).
    pub fn take_callback(&mut self) -> Option<BatchCallback> {
        self.callback.take()
    }

    /// The current micro-batch.
    pub fn micro_batch(&self) -> usize {
        self.micro_batch
    }

    /// How many times the micro-batch was halved.
    pub fn halvings(&self) -> u32 {
        self.halvings
    }

    /// Runs `f` over `items` in chunks of the current micro-batch and concatenates the outputs.
    /// `f` must return exactly one output per input item.
    ///
    /// # Errors
    /// [`Error::OutOfMemory`] naming `model` when a chunk of one item runs out of memory; any
    /// other error of `f` as is; [`Error::Format`] if `f` returns the wrong number of outputs.
    pub fn run<I, O>(
        &mut self,
        items: &[I],
        model: &str,
        mut f: impl FnMut(&[I]) -> Result<Vec<O>>,
    ) -> Result<Vec<O>> {
        let mut out = Vec::with_capacity(items.len());
        let mut pos = 0;
        while pos < items.len() {
            let n = self.micro_batch.min(items.len() - pos);
            let chunk = &items[pos..pos + n];
            // catch_oom: an allocation failure inside a tch op taking a Scalar is a panic in
            // tch; it takes the same halving path as an OOM error.
            match lora_core::oom::catch_oom(|| f(chunk)) {
                Ok(o) => {
                    if o.len() != n {
                        return Err(Error::Format {
                            path: model.into(),
                            msg: format!("a batch of {n} items returned {} outputs", o.len()),
                        });
                    }
                    out.extend(o);
                    self.batches += 1;
                    if self.clear_interval > 0
                        && self.batches % self.clear_interval == 0
                        && matches!(self.device, Device::Cuda(_))
                    {
                        let _ = lora_core::sys::cuda_empty_cache();
                    }
                    if let Some(cb) = self.callback.as_mut() {
                        cb(&BatchEvent::Done {
                            start: pos,
                            len: n,
                            snapshot: ResourceSnapshot::take(self.device),
                        });
                    }
                    pos += n;
                }
                Err(e) if is_oom(&e) => {
                    let message = match &e {
                        Error::OutOfMemory { msg, .. } => msg.clone(),
                        other => other.to_string(),
                    };
                    if n <= 1 {
                        return Err(Error::OutOfMemory {
                            model: model.to_string(),
                            msg: message,
                        });
                    }
                    let to = (n / 2).max(1);
                    self.halvings += 1;
                    if matches!(self.device, Device::Cuda(_)) {
                        let _ = lora_core::sys::cuda_empty_cache();
                    }
                    if let Some(cb) = self.callback.as_mut() {
                        cb(&BatchEvent::OomHalved {
                            start: pos,
                            from: n,
                            to,
                            message,
                        });
                    }
                    self.micro_batch = to;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_memory_is_capped() {
        let s = ResourceSnapshot {
            ram_total: 24 << 30,
            ram_available: 20 << 30,
            process_rss: 1 << 30,
            cpu_tensors: Some((10 << 20, Some(50 << 20))),
            vram: None,
            cuda_allocator: None,
        };
        assert_eq!(s.free_for(Device::Cpu, None), Some(40 << 20));
        assert_eq!(s.free_for(Device::Cpu, Some(1 << 20)), Some(1 << 20));
        assert_eq!(s.free_for(Device::Cuda(0), None), None);
        assert!((s.ram_used_pct() - 100.0 / 6.0).abs() < 1e-9);
        let line = s.to_string();
        assert!(
            line.contains("16.7%") && line.contains("limit 50.0 MiB"),
            "{line}"
        );
        let g = ResourceSnapshot {
            vram: Some((6 << 30, 8 << 30)),
            cuda_allocator: Some((1 << 30, 3 << 30)),
            ..s
        };
        assert_eq!(g.free_for(Device::Cuda(0), None), Some(8 << 30));
    }

    #[test]
    fn non_oom_errors_pass_through_and_outputs_keep_order() {
        let mut b = AdaptiveBatcher::new(3, Device::Cpu);
        let items: Vec<u32> = (0..10).collect();
        let out = b
            .run(&items, "m", |c| Ok(c.iter().map(|x| x * 2).collect()))
            .unwrap();
        assert_eq!(out, (0..10).map(|x| x * 2).collect::<Vec<_>>());
        let err = b
            .run(&items, "m", |_| -> Result<Vec<u32>> {
                Err(Error::Unsupported {
                    tagger: "m".into(),
                    what: "x",
                })
            })
            .unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }));
        assert!(is_oom_message(
            "DefaultCPUAllocator: can't allocate memory: you tried"
        ));
        assert!(is_oom_message(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ));
        assert!(!is_oom_message("shape mismatch"));
    }
}
