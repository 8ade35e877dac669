//! lora-train's integration tests, one executable (one link against libtorch): the config files,
//! the engine (optimizers, schedules, resume, NaN and out-of-memory policies, a run killed and
//! resumed), and the jobs (checkpointing, the Stable Diffusion job's training, caching, targets
//! and measured plan).
//!
//! The tests share one process, and libtorch's generator, its thread count, the shim's counting
//! allocator (limit and peak) and the stop request are process-wide: every test that trains or
//! measures holds [`serial`] while it does.

mod config_files;
mod config_kohya;
mod engine_common;
mod engine_dist;
mod engine_kill;
mod engine_oom;
mod engine_optim;
mod engine_sys;
mod engine_tensorboard;
mod engine_trainer;
mod flux_job;
mod job_checkpointing;
mod job_long_sequence_plan;
mod job_nf4_base;
mod job_quantized_plan;
mod sd_caching;
mod sd_dist;
mod sd_fixture;
mod sd_job;
mod sd_plan_measured;
mod sd_sample_memory;
mod sd_targets;
mod sd_xl_job;

/// One test at a time for whatever touches process-wide state (see the crate docs); a test that
/// failed while holding it does not block the others.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}
