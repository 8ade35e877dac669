//! LoRA fine-tuning that knows its memory: plan, train, survive, export.
#![deny(missing_docs)]

pub use lora_core as core;
pub use lora_data as data;
pub use lora_memory as memory;
pub use lora_models as models;
pub use tch;

pub mod callbacks;
pub mod checkpoint;
pub mod config;
pub mod export;
pub mod llm;
pub mod metrics;
pub mod optim;
pub mod plot;
pub mod precision;
pub mod sched;
pub mod sd;
pub mod sd_plan;
pub mod trainer;
