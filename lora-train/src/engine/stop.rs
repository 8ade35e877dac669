//! The process-wide stop request: Ctrl-C in the CLI, or an app's own signal, asks every running
//! [`crate::engine::Trainer::fit`] (and the recipes' long loops: caching, evaluation) to end at
//! the next step boundary.

/// Set by [`request_stop`]: every running [`crate::engine::Trainer::fit`] stops after its current optimizer
/// step, saves a checkpoint and returns with [`crate::engine::TrainReport::interrupted`].
static STOP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Asks every running [`crate::engine::Trainer::fit`] to stop at the next step boundary (after saving a
/// checkpoint when a `checkpoint_dir` is set). One atomic store: async-signal-safe, so a SIGINT
/// handler may call it (the `lora-train` CLI does, for Ctrl-C).
pub fn request_stop() {
    STOP_REQUESTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// True once [`request_stop`] was called (until [`clear_stop_request`]).
pub fn stop_requested() -> bool {
    STOP_REQUESTED.load(std::sync::atomic::Ordering::SeqCst)
}

/// Forgets an earlier [`request_stop`], so the next [`crate::engine::Trainer::fit`] runs to its end.
pub fn clear_stop_request() {
    STOP_REQUESTED.store(false, std::sync::atomic::Ordering::SeqCst);
}
