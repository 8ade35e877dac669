//! Op-level profiles of libtorch work: which operators a training step spends its time in.
//!
//! [`Profiler::start`] switches on libtorch's own profiler (Kineto, the engine behind Python's
//! `torch.profiler`, through the shim: [`crate::sys::profiler_start`]); [`Profiler::stop`] returns
//! a [`Profile`] and can write the Chrome trace-event JSON that `torch.profiler`'s
//! `export_chrome_trace` writes (open it in Perfetto or chrome://tracing). [`Profile::ops`] sums
//! the events per operator name as `torch.profiler`'s `key_averages()` does, so a table of ours
//! and one of a PyTorch run line up name by name.
//!
//! ```
//! use lora_core::profile::{Profiler, ProfilerOptions};
//! use tch::{Device, Kind, Tensor};
//!
//! # fn main() -> lora_core::Result<()> {
//! let a = Tensor::randn([64, 64], (Kind::Float, Device::Cpu));
//! let profiler = Profiler::start(ProfilerOptions::default())?;
//! let _ = a.matmul(&a).relu();
//! let profile = profiler.stop(None)?;
//! let ops = profile.ops();
//! assert!(ops.iter().any(|o| o.name == "aten::mm" && o.calls == 1));
//! println!("{}", profile.table(10));
//! # Ok(())
//! # }
//! ```

use std::collections::HashMap;
use std::path::Path;

use crate::sys::{self, ProfilerEvent};
use crate::{Error, Result};

/// What a [`Profiler`] records besides every CPU-side operator's name and time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfilerOptions {
    /// Also record CUDA kernels, copies and memsets (a CUDA build of libtorch with CUPTI).
    pub cuda: bool,
    /// Also record every operator's input shapes (in the trace, and for
    /// [`Profile::ops_by_shapes`]); costs a little time per operator.
    pub record_shapes: bool,
}

/// A running profiler. Stop it with [`Profiler::stop`]; dropping it stops it and discards what it
/// recorded. One may run per process.
#[derive(Debug)]
pub struct Profiler {
    running: bool,
}

impl Profiler {
    /// Starts recording every libtorch operator run from this thread (and the threads libtorch
    /// hands its work to), with what `options` adds.
    ///
    /// # Errors
    /// A profiler already runs in this process, or libtorch refused to start one.
    pub fn start(options: ProfilerOptions) -> Result<Self> {
        sys::profiler_start(options.cuda, options.record_shapes)
            .map_err(|e| torch_error("starting the profiler", e))?;
        Ok(Self { running: true })
    }

    /// Stops recording and returns what was recorded; with `trace`, also writes the Chrome
    /// trace-event JSON there (overwriting the file).
    ///
    /// # Errors
    /// The trace file could not be written (the profile is lost with it; stop again is not
    /// possible), or libtorch failed to stop.
    pub fn stop(mut self, trace: Option<&Path>) -> Result<Profile> {
        self.running = false;
        let events = sys::profiler_stop(trace).map_err(|e| {
            torch_error(
                &match trace {
                    Some(p) => format!("stopping the profiler and writing {}", p.display()),
                    None => "stopping the profiler".to_string(),
                },
                e,
            )
        })?;
        Ok(Profile { events })
    }
}

impl Drop for Profiler {
    fn drop(&mut self) {
        if self.running {
            let _ = sys::profiler_stop(None);
        }
    }
}

fn torch_error(context: &str, e: sys::ShimError) -> Error {
    Error::Torch {
        context: context.to_string(),
        source: e.into(),
    }
}

/// The events one [`Profiler`] recorded.
#[derive(Debug, Clone, Default)]
pub struct Profile {
    /// Every event, in the profiler's order.
    pub events: Vec<ProfilerEvent>,
}

/// One operator's sums over a [`Profile`].
#[derive(Debug, Clone, PartialEq)]
pub struct OpStats {
    /// The operator's name (`aten::mm`, `MmBackward0`, a CUDA kernel's name …).
    pub name: String,
    /// Its input shapes for [`Profile::ops_by_shapes`] (see [`ProfilerEvent::shapes`]); empty
    /// for [`Profile::ops`].
    pub shapes: String,
    /// Whether these are device events (CUDA kernels) rather than CPU-side operators.
    pub cuda: bool,
    /// How many times it ran.
    pub calls: u64,
    /// Time inside it, the operators it called included, seconds (summed over calls; a call
    /// nested in another call of the same name counts in both).
    pub total_s: f64,
    /// Time inside it minus the time of the events nested directly in it on the same thread,
    /// seconds: `torch.profiler`'s "self CPU time". Self times of all operators sum to the time
    /// covered by operators.
    pub self_s: f64,
}

impl Profile {
    /// Sums per operator name (CPU operators and device events apart), sorted by self time,
    /// largest first. Nesting is by time on each thread: an event that starts and ends inside
    /// another on the same thread is its child, as in `torch.profiler`'s event tree.
    pub fn ops(&self) -> Vec<OpStats> {
        self.sums(false)
    }

    /// As [`Profile::ops`], per operator name and input shapes (`key_averages(
    /// group_by_input_shape=True)`): which GEMM shapes take the time. Needs
    /// [`ProfilerOptions::record_shapes`], else every shape reads empty.
    pub fn ops_by_shapes(&self) -> Vec<OpStats> {
        self.sums(true)
    }

    fn sums(&self, by_shapes: bool) -> Vec<OpStats> {
        // Parents are found among the events of the same thread and device, sorted by start
        // (the outer one first when two start together).
        let mut order: Vec<usize> = (0..self.events.len()).collect();
        order.sort_by_key(|&i| {
            let e = &self.events[i];
            (e.cuda, e.thread, e.start_ns, std::cmp::Reverse(e.end_ns))
        });
        let mut child_ns = vec![0u64; self.events.len()];
        let mut stack: Vec<usize> = Vec::new();
        let mut lane = None;
        for &i in &order {
            let e = &self.events[i];
            if lane != Some((e.cuda, e.thread)) {
                stack.clear();
                lane = Some((e.cuda, e.thread));
            }
            while let Some(&top) = stack.last() {
                if self.events[top].end_ns <= e.start_ns || self.events[top].end_ns < e.end_ns {
                    stack.pop();
                } else {
                    break;
                }
            }
            if let Some(&parent) = stack.last() {
                child_ns[parent] += e.end_ns - e.start_ns;
            }
            stack.push(i);
        }
        let mut by_name: HashMap<(&str, &str, bool), OpStats> = HashMap::new();
        for (i, e) in self.events.iter().enumerate() {
            let dur = e.end_ns - e.start_ns;
            let shapes = if by_shapes { e.shapes.as_str() } else { "" };
            let s = by_name
                .entry((e.name.as_str(), shapes, e.cuda))
                .or_insert_with(|| OpStats {
                    name: e.name.clone(),
                    shapes: shapes.to_string(),
                    cuda: e.cuda,
                    calls: 0,
                    total_s: 0.0,
                    self_s: 0.0,
                });
            s.calls += 1;
            s.total_s += dur as f64 * 1e-9;
            s.self_s += dur.saturating_sub(child_ns[i]) as f64 * 1e-9;
        }
        let mut ops: Vec<OpStats> = by_name.into_values().collect();
        ops.sort_by(|a, b| {
            b.self_s
                .total_cmp(&a.self_s)
                .then_with(|| a.name.cmp(&b.name))
                .then_with(|| a.shapes.cmp(&b.shapes))
        });
        ops
    }

    /// A Markdown table of the `top` operators by self time: name, calls, self and total
    /// milliseconds, share of all self time; a last row sums the rest.
    pub fn table(&self, top: usize) -> String {
        let ops = self.ops();
        let all: f64 = ops.iter().map(|o| o.self_s).sum();
        let mut out = String::from(
            "| operator | calls | self ms | total ms | self % |\n|---|---|---|---|---|\n",
        );
        let pct = |s: f64| if all > 0.0 { 100.0 * s / all } else { 0.0 };
        for o in ops.iter().take(top) {
            out.push_str(&format!(
                "| {}{} | {} | {:.1} | {:.1} | {:.1} |\n",
                o.name,
                if o.cuda { " (cuda)" } else { "" },
                o.calls,
                o.self_s * 1e3,
                o.total_s * 1e3,
                pct(o.self_s)
            ));
        }
        if ops.len() > top {
            let rest = &ops[top..];
            let s: f64 = rest.iter().map(|o| o.self_s).sum();
            let calls: u64 = rest.iter().map(|o| o.calls).sum();
            out.push_str(&format!(
                "| {} other operators | {calls} | {:.1} | | {:.1} |\n",
                rest.len(),
                s * 1e3,
                pct(s)
            ));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(name: &str, thread: u64, start_ns: u64, end_ns: u64) -> ProfilerEvent {
        ProfilerEvent {
            name: name.into(),
            shapes: String::new(),
            thread,
            start_ns,
            end_ns,
            cuda: false,
        }
    }

    #[test]
    fn self_time_subtracts_direct_children_on_the_same_thread_only() {
        // linear [0, 100) ⊃ matmul [10, 90) ⊃ mm [20, 80); a second thread's mm [30, 60) is
        // not a child of anything on thread 1.
        let p = Profile {
            events: vec![
                ev("aten::mm", 1, 20, 80),
                ev("aten::linear", 1, 0, 100),
                ev("aten::matmul", 1, 10, 90),
                ev("aten::mm", 2, 30, 60),
                ev("aten::add", 1, 100, 110),
            ],
        };
        let ops = p.ops();
        let get = |n: &str| ops.iter().find(|o| o.name == n).unwrap();
        assert_eq!(get("aten::mm").calls, 2);
        assert!((get("aten::mm").self_s - 90e-9).abs() < 1e-15);
        assert!((get("aten::mm").total_s - 90e-9).abs() < 1e-15);
        assert!((get("aten::matmul").self_s - 20e-9).abs() < 1e-15);
        assert!((get("aten::linear").self_s - 20e-9).abs() < 1e-15);
        assert!((get("aten::linear").total_s - 100e-9).abs() < 1e-15);
        // an event starting where the previous one ended is its sibling, not its child
        assert!((get("aten::add").self_s - 10e-9).abs() < 1e-15);
        assert_eq!(ops[0].name, "aten::mm");
        // every nanosecond covered by some operator is counted once in the self times
        let total: f64 = ops.iter().map(|o| o.self_s).sum();
        assert!((total - 140e-9).abs() < 1e-15);
    }

    #[test]
    fn table_lists_the_top_and_sums_the_rest() {
        let p = Profile {
            events: vec![
                ev("aten::mm", 1, 0, 3_000_000),
                ev("aten::add", 1, 3_000_000, 4_000_000),
                ev("aten::mul", 1, 4_000_000, 4_500_000),
            ],
        };
        let t = p.table(1);
        assert!(t.contains("| aten::mm | 1 | 3.0 | 3.0 | 66.7 |"), "{t}");
        assert!(
            t.contains("| 2 other operators | 2 | 1.5 | | 33.3 |"),
            "{t}"
        );
    }
}
