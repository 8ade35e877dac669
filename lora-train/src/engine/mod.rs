//! The training engine: it trains any tch model with LoRA (or any trainable tensors) and knows
//! no model family, config file or command line.
//!
//! - [`TrainStep`]: the app's side — loss on a batch, the trainable tensors, how to split a
//!   batch when memory runs out; [`BatchSource`]: batches, epoch by epoch, with a position that
//!   checkpoints can save.
//! - [`Trainer`]: gradient accumulation, clipping, mixed precision ([`precision`]), the
//!   optimizer ([`optim`], any [`optim::Optimizer`]), the learning-rate schedule ([`sched`]),
//!   out-of-memory back-off, the NaN/Inf policy, checkpoints and exact resume ([`checkpoint`]),
//!   hooks that return decisions ([`callbacks`], [`metrics`]).
//! - [`TrainError`] / [`Result`], [`TrainReport`], and the process-wide stop request
//!   ([`request_stop`]).
//!
//! The recipes of this crate (`llm`, `sd`) are users of this module, not parts of it.

pub mod callbacks;
pub mod checkpoint;
pub mod dist;
pub mod error;
pub mod metrics;
pub mod optim;
#[cfg(feature = "plot")]
pub mod plot;
pub mod precision;
#[cfg(feature = "progress")]
pub mod progress;
pub mod report;
pub mod sched;
pub mod stop;
pub mod trainer;

pub use callbacks::{Callback, Control, EarlyStopping, StepInfo, StopAfter, TrainEvent};
pub use error::{Result, TrainError, is_oom_message};
pub use report::TrainReport;
pub use stop::{clear_stop_request, request_stop, stop_requested};
pub use trainer::{
    BatchSource, NonFinitePolicy, Resume, TrainStep, Trainer, TrainerConfig, clip_grads,
    global_grad_norm,
};
