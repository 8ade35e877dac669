//! LoRA fine-tuning that knows its memory: plan, train, survive, export.
//!
//! # Layout
//! - [`engine`] (always built): the training engine — [`engine::Trainer`] over any
//!   [`engine::TrainStep`] and [`engine::BatchSource`], optimizers, schedulers, mixed precision,
//!   checkpoints with exact resume, OOM back-off and the NaN policy. It knows no model family,
//!   config file or command line: an app trains its own tch model with LoRA through it.
//! - `config`, `job`, `export` (feature `jobs`, on with either recipe): the YAML/TOML config,
//!   what the recipes share (errors, the memory plan, the config's lowering to the engine's and
//!   lora-core's settings, checks around a run) and adapter export with run metadata.
//! - `llm` (feature `llm`): the causal-LM recipe (LLaMA family, GGUF or safetensors bases).
//! - `sd`, `sd_plan` (feature `sd`): the Stable Diffusion 1.x / SDXL recipe and its plan.
//! - `recipes`: the recipes compiled in, behind the `job::Recipe` trait; `recipes::for_config`
//!   says which one a config is for.
//!
//! # Features
//! | feature | default | what it adds |
//! |---|---|---|
//! | `llm` | yes | the causal-LM recipe (`jobs`, lora-models, lora-data) |
//! | `sd` | yes | the Stable Diffusion recipe (`jobs`, image decoding) |
//! | `jobs` | with a recipe | `config`, `job`, `export` |
//! | `plot` | yes | the loss-curve PNG of [`engine::metrics::MetricsLogger`] |
//! | `progress` | yes | the terminal progress bar callback |
//! | `nvml` | no | budgets from a GPU's free memory (NVML) |
//!
//! An app that only wants the engine depends on `lora-train` with `default-features = false`.
//! The `lora-train` command line is the `lora-train-cli` package.
#![deny(missing_docs)]
// docs.rs (nightly rustdoc): badges on items that need a feature
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use lora_core as core;
#[cfg(feature = "jobs")]
pub use lora_data as data;
pub use lora_memory as memory;
#[cfg(feature = "jobs")]
pub use lora_models as models;
pub use tch;

#[cfg(feature = "jobs")]
pub mod config;
pub mod engine;
#[cfg(feature = "jobs")]
pub mod export;
#[cfg(feature = "jobs")]
pub mod job;
#[cfg(feature = "llm")]
pub mod llm;
#[cfg(feature = "jobs")]
pub mod recipes;
#[cfg(feature = "sd")]
pub mod sd;
#[cfg(feature = "sd")]
pub mod sd_plan;
