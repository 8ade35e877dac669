//! The FLUX.1 recipe: FLUX.1-dev / schnell LoRA configs (kohya sd-scripts' FLUX names
//! accepted) are recognised and planned from headers — BFL's single file (bf16 or fp8), a
//! ComfyUI GGUF file, a diffusers folder or a preset name — with the `flux.*` options that
//! change memory (`fp8_base`, `blocks_to_swap`, an fp8 T5, `t5xxl_max_token_length`).
//!
//! [`FluxRecipe::train`] runs [`run::run_with`]: the pipeline (a diffusers `FluxPipeline`
//! folder, or BFL's transformer file with `flux.t5xxl`, `flux.clip_l`, `flux.ae` and the
//! tokenizers of `model.tokenizer`) loads; LoRA goes on the blocks' linears
//! ([`run::block_targets_regex`], kohya `networks.lora_flux`'s set) unless
//! `lora.target_modules` says otherwise; latents and the T5/CLIP outputs of every caption are
//! computed before training (the shared image source of [`crate::recipes::images`]) and the
//! autoencoder and text encoders leave the device; each step draws σ by
//! `flux.timestep_sampling` and trains the rectified-flow objective ([`task::FluxObjective`],
//! `flux.model_prediction_type`) with dev's guidance embedding at `flux.guidance_scale`;
//! sample grids come from the Euler flow-matching sampler; the adapter is written in kohya /
//! ComfyUI keys and, with the `peft` format, diffusers' keys.

pub mod plan;
pub mod run;
pub mod task;

use crate::config::TrainConfig;
use crate::job::error::During;
use crate::job::options::RunOptions;
use crate::job::recipe::Recipe;
use crate::job::{JobError, Plan, Result};
use lora_memory::Budget;
use std::path::Path;

/// The FLUX.1 recipe (feature `flux`).
pub struct FluxRecipe;

impl Recipe for FluxRecipe {
    fn name(&self) -> &'static str {
        "flux"
    }

    fn detect(&self, cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
        plan::is_flux_config(cfg, config_dir)
    }

    fn plan(
        &self,
        cfg: &TrainConfig,
        config_dir: Option<&Path>,
        budget: Option<Budget>,
        cuda: bool,
    ) -> Result<Plan> {
        plan::plan(cfg, config_dir, budget, cuda)
    }

    fn train(&self, cfg: TrainConfig, opts: &RunOptions) -> Result<serde_json::Value> {
        let (_, from) = plan::read_descriptor(&cfg, opts.config_dir.as_deref())?;
        let written = cfg.base_model()?;
        if crate::job::resolve_base_model(written, opts.config_dir.as_deref()).is_err() {
            // a preset name: enough for planning, not for training
            return Err(JobError::Input(format!(
                "model.base_model {written:?} is a memory-planning preset ({from}); training needs the weights: a diffusers FLUX.1 folder (transformer/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/, vae/) or BFL's flux1-dev/schnell .safetensors with flux.t5xxl, flux.clip_l, flux.ae and model.tokenizer"
            )));
        }
        let summary = run::run_with(cfg, opts, Vec::new())?;
        serde_json::to_value(&summary).during("serializing the summary")
    }
}

/// A pipeline error as the FLUX job reports it: a model it cannot train is
/// [`JobError::Unsupported`], a failed step [`JobError::Model`].
pub fn pipeline_err(e: lora_models::Error) -> JobError {
    match e {
        lora_models::Error::Unusable { what, reason } => JobError::Unsupported { what, reason },
        lora_models::Error::Context { during, source } => JobError::Model {
            during,
            source: *source,
        },
        other => JobError::Model {
            during: "the FLUX.1 pipeline".into(),
            source: other,
        },
    }
}
