//! Auto-labeling of LoRA training data: LLM and WD14-style image taggers, tag post-processing,
//! caption sidecars.
//!
//! It writes the captions a LoRA trainer reads: the tags of each image in a folder, cleaned up
//! and written as `<image stem>.txt` (or another `caption_extension`) beside the image, the
//! layout kohya-ss sd-scripts reads. A caption already there is kept unless the mode says
//! `append` or `overwrite`.
//!
//! ```no_run
//! use lora_tagger::run::{list_images, tag_to_captions};
//! use lora_tagger::{CaptionWriter, ImageTagger, TaggerConfig};
//!
//! let mut cfg = TaggerConfig::default(); // or TaggerConfig::from_path("examples/configs/tagger.yaml")?
//! cfg.image.model = Some("assets/mobilenet_v2".into()); // model.safetensors + selected_tags.csv
//! cfg.tags.always_first = vec!["mychar".into()]; // the trigger word leads every caption
//! cfg.tags.max_tags = Some(8);
//! let mut tagger = ImageTagger::from_config(&cfg)?; // on CUDA when libtorch sees a GPU
//! let images = list_images("train/10_mychar".as_ref())?; // the images directly in the folder
//! let writer = CaptionWriter::new(cfg.captions.clone()); // `.txt`, existing captions kept
//! let run = tag_to_captions(&mut tagger, &images, &cfg.tags, &writer)?;
//! println!("{}", run.report); // per image: written, skipped or failed, and the caption
//! println!("{} images tagged, {:.1} images/s", run.tagged, run.images_per_s());
//! # Ok::<(), lora_tagger::Error>(())
//! ```
//!
//! `cfg.captions.dry_run = true` reports what would be written and touches no file.
//! [`llm::vlm::from_config`] builds a captioner over a vision-language model behind an
//! OpenAI-compatible server (config section `vlm`); [`run::caption_to_files_with_progress`]
//! writes its captions. Batch sizes come from lora-memory
//! ([`lora_memory::inference::batch_for`]; [`Tagger::batch_plan`] shows a tagger's plan).
//! [`llm::from_config`] builds the LLM tagger, which turns free-text descriptions into tags: a
//! LLaMA-family instruct model in-process (SmolLM2-135M-Instruct by default) or any
//! OpenAI-compatible server (config section `llm`).
//!
//! Every tagger implements [`Tagger`]: it turns images and/or free-text descriptions into
//! [`ScoredTag`]s. Batches are per item: one unreadable image or one garbage reply fails that item
//! ([`ItemResult`]), not the batch.
#![deny(missing_docs)]

pub mod batch;
pub mod cache;
pub mod caption;
pub mod config;
pub mod error;
pub mod image;
pub mod llm;
pub mod run;
pub mod tags;

pub use cache::{CachedTagger, TagCache};
pub use caption::{CaptionMode, CaptionReport, CaptionSettings, CaptionWriter};
pub use config::TaggerConfig;
pub use error::{Error, Result};
pub use image::ImageTagger;
pub use tags::PostProcess;

use std::path::PathBuf;

/// The category of a tag, as the WD14 label file (`selected_tags.csv`, column `category`) gives it:
/// `0` general, `4` character, `9` rating. LLM taggers produce [`TagCategory::General`] only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TagCategory {
    /// Content tags (`1girl`, `outdoors`, `tabby cat`, …); category 0.
    General,
    /// Named characters; category 4.
    Character,
    /// Content ratings (`general`, `sensitive`, `questionable`, `explicit`); category 9.
    Rating,
}

/// One tag with its confidence.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ScoredTag {
    /// The tag as the model names it (post-processing normalizes it later).
    pub tag: String,
    /// Confidence in `[0, 1]`: a sigmoid/softmax probability for image models; LLM taggers give
    /// `1.0` to every parsed tag, decreasing slightly with position to keep the model's order.
    pub score: f32,
    /// The tag's category.
    pub category: TagCategory,
}

/// The outcome for one item of a batch: its tags, or why that item failed.
pub type ItemResult = Result<Vec<ScoredTag>>;

/// A model that labels training data.
///
/// Implementations decide their own micro-batch (adapting it to free memory and halving it on
/// out-of-memory); callers pass whole lists.
pub trait Tagger {
    /// A stable identifier of the model and its settings, used in cache keys and reports
    /// (e.g. `mobilenet_v2@<sha256 prefix>` or `http:Qwen3-32B`). Never contains secrets.
    fn model_id(&self) -> String;

    /// Tags images read from `paths`; the result has one entry per path, in order.
    ///
    /// # Errors
    /// The outer error is for failures that stop the whole batch (the model cannot run);
    /// per-image failures (unreadable file, undecodable image) are inner errors.
    fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>>;

    /// Turns free-text descriptions into tags; one entry per description, in order.
    ///
    /// # Errors
    /// As for [`Tagger::tag_images`]; image-only taggers return [`Error::Unsupported`].
    fn tag_descriptions(&mut self, descriptions: &[String]) -> Result<Vec<ItemResult>>;

    /// How this tagger sizes its batches, for showing before a run: lora-memory's
    /// [`lora_memory::inference::batch_for`] of the model's weights and the peak of one item like
    /// `sample` (a description; image taggers ignore it), in `budget` bytes free before loading
    /// (`None`: this machine's free memory now plus the loaded weights). `None` (the default) for
    /// taggers whose model runs elsewhere (an HTTP server).
    fn batch_plan(
        &self,
        _sample: &str,
        _budget: Option<lora_memory::Bytes>,
    ) -> Option<lora_memory::inference::BatchPlan> {
        None
    }
}

/// A model that writes a free-text caption per image (a vision-language model,
/// [`llm::vlm::VlmTagger`]).
pub trait Captioner {
    /// A stable identifier of the model and its settings (never contains secrets).
    fn model_id(&self) -> String;

    /// One caption per path, in order: a single line of text.
    ///
    /// # Errors
    /// As [`Tagger::tag_images`]: the outer error stops the batch, inner errors fail one image.
    fn caption_images(&mut self, paths: &[PathBuf]) -> Result<Vec<Result<String>>>;
}

/// A boxed tagger (e.g. what `llm::from_settings` returns) is a tagger, so wrappers such as
/// [`CachedTagger`] take it as they take a concrete one.
impl<T: Tagger + ?Sized> Tagger for Box<T> {
    fn model_id(&self) -> String {
        (**self).model_id()
    }

    fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        (**self).tag_images(paths)
    }

    fn tag_descriptions(&mut self, descriptions: &[String]) -> Result<Vec<ItemResult>> {
        (**self).tag_descriptions(descriptions)
    }

    fn batch_plan(
        &self,
        sample: &str,
        budget: Option<lora_memory::Bytes>,
    ) -> Option<lora_memory::inference::BatchPlan> {
        (**self).batch_plan(sample, budget)
    }
}
