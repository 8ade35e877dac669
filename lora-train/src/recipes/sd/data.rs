//! The SD batch source: the shared image source ([`crate::recipes::images`]) over the SD
//! pipeline — images through the VAE, captions through the text encoders, SDXL's time ids.

use super::*;
use crate::recipes::images::LatentPipeline;
pub use crate::recipes::images::{
    Augmentations, Precached, augmentations_of, precache, precomputed,
};

/// The SD job's batch source (see [`crate::recipes::images::ImageSource`]).
pub type ImageSource = crate::recipes::images::ImageSource<SdPipeline>;

impl LatentPipeline for SdPipeline {
    type Cond = TextCond;
    type Batch = SdBatch;

    fn encode_latents(&self, pixels: &Tensor) -> lora_models::Result<Tensor> {
        self.encode_images(pixels)
    }

    /// The caption's conditioning (`hidden` `[77, D]`, SDXL `pooled` `[P]`) on the CPU.
    fn encode_caption(&self, caption: &str) -> lora_models::Result<TextCond> {
        Ok(self
            .encode_prompts(&[caption])?
            .row(0)?
            .to_device(Device::Cpu)?)
    }

    fn share(cond: &TextCond) -> TextCond {
        cond.shallow_clone()
    }

    /// Token ids of the captions, the cached conditioning stacked, SDXL time ids from each
    /// sample's original size, crop and bucket.
    fn make_batch(
        &self,
        latents: Tensor,
        conds: Option<Vec<TextCond>>,
        batch: ImageBatch,
        noise_seed: Option<u64>,
    ) -> crate::engine::Result<SdBatch> {
        let n = batch.captions.len();
        let (ids, ids_2) = self.tokenize(&batch.captions).map_err(model_err)?;
        let time_ids = if self.is_sdxl() {
            let mut v = Vec::with_capacity(6 * n);
            for k in 0..n {
                v.extend(sdxl_time_ids(
                    batch.original_sizes[k],
                    batch.crops[k],
                    batch.bucket,
                ));
            }
            Some(Tensor::f_from_slice(&v)?.f_view([n as i64, 6])?)
        } else {
            None
        };
        Ok(SdBatch {
            latents,
            ids,
            ids_2,
            cond: match conds {
                Some(c) => Some(TextCond::stack(&c)?),
                None => None,
            },
            time_ids,
            captions: batch.captions,
            noise_seed,
        })
    }
}

/// Sets the lora-memory settings that say which frozen models the SD job keeps on the device
/// during the training steps: `cache_latents` / `cache_text_encoder_outputs` as
/// [`precomputed`] says, `random_crop` / `varying_captions` from the dataset's subsets
/// (`aug`), and `keep_models_loaded` on a CPU run (`cuda` false), where moving them to the CPU
/// keeps them in the same memory.
pub fn frozen_model_settings(
    s: &mut lora_memory::Settings,
    cfg: &TrainConfig,
    aug: Augmentations,
    cuda: bool,
) {
    let cache = cfg.data.cache_latents == Some(true);
    s.cache_latents = cache;
    s.cache_text_encoder_outputs = cache && !cfg.train.train_text_encoder;
    s.random_crop = aug.random_crop;
    s.varying_captions = aug.varying_captions;
    s.keep_models_loaded = !cuda;
}
