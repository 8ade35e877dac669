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
