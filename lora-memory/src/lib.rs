//! Peak-memory planning for LoRA training runs (pure Rust, no libtorch).
//!
//! Answers, before anything is loaded, "will this run fit, and if not, what is the best config
//! that does?":
//! - [`ModelDescriptor`]: shapes and parameter counts from a preset, an HF `config.json`, a GGUF
//!   header or a safetensors header;
//! - [`Settings`]: everything about the run that changes memory;
//! - [`estimate()`]: the peak, term by term ([`Breakdown`]), for a stated [`Metric`];
//! - [`fit()`]: walk the usual ladder of changes until the run fits a [`Budget`];
//! - [`Check`]: the safe verdict — fits / tight / does not fit — on the memory that runs out
//!   (reserved + CUDA context + other processes, with a stated margin);
//! - [`max_seq_len`], [`max_micro_batch`], [`frontier`]: the longest sequence and the largest
//!   batch that fit a card;
//! - [`inference`]: batch sizes for auto-labeling (taggers, captioners) from the model's memory.
//!
//! ```
//! use lora_memory::{estimate, fit, Budget, ModelDescriptor, Settings};
//! let model = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
//! let settings = Settings::default().with_micro_batch(4).with_seq_len(2048);
//! let e = estimate(&model, &settings).unwrap();
//! println!("{}", e.to_table());
//! let budget = Budget::gpu("RTX 3090").unwrap();
//! match fit(&model, &settings, budget.bytes) {
//!     Ok(f) => println!("fits with {} changes, headroom {}", f.changes.len(), f.headroom),
//!     Err(e) => println!("{e}"),
//! }
//! ```
#![deny(missing_docs)]
// docs.rs (nightly rustdoc): badges on items that need a feature
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod budget;
pub mod cases;
pub mod error;
pub mod estimate;
pub mod fit;
pub mod flux;
pub mod gguf;
pub mod host;
pub mod inference;
pub mod model;
mod parts;
pub mod safetensors_header;
pub mod sd_header;
pub mod settings;
pub mod units;
pub mod verdict;

pub use budget::{Budget, BudgetSource, GPU_PRESETS};
pub use error::{Error, Result};
pub use estimate::{Breakdown, Estimate, Metric, Term, estimate};
pub use fit::{
    Change, Fit, FitError, FrontierRow, fit, frontier, frontier_cards, max_micro_batch, max_seq_len,
};
pub use flux::{FLUX_BLOCK_LINEARS, FluxDescriptor, FluxVariant};
pub use model::{
    DecoderBuilder, DecoderDescriptor, DiffusionDescriptor, DiffusionFamily, GENERIC_DECODER,
    LinearSite, ModelDescriptor, NormKind, SUPPORTED_MODEL_TYPES, TextEncoderDescriptor, UnetLevel,
};
pub use settings::{
    Attention, BaseDtype, DeepSpeedZero, Device, Framework, GptqKernel, KeptData, LoraSettings,
    Method, MixedPrecision, Optimizer, Profile, SampleImages, Settings,
};
pub use units::{Bytes, ParsedSize, Size, parse_size};
pub use verdict::{Check, Verdict};
