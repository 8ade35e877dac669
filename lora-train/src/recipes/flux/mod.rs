//! The FLUX.1 recipe: FLUX.1-dev / schnell LoRA configs (kohya sd-scripts' FLUX names
//! accepted) are recognised and planned from headers — BFL's single file (bf16 or fp8), a
//! ComfyUI GGUF file, a diffusers folder or a preset name — with the `flux.*` options that
//! change memory (`fp8_base`, `blocks_to_swap`, an fp8 T5, `t5xxl_max_token_length`).
//!
//! Training a FLUX adapter is not in this version: [`FluxRecipe::train`] refuses with a message
//! saying so, after the same checks `plan` makes.

pub mod plan;

use crate::config::TrainConfig;
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
        // the same refusals as `plan` first, so a config error is reported as such
        plan::read_descriptor(&cfg, opts.config_dir.as_deref())?;
        Err(JobError::Input(
            "FLUX.1 LoRA training is not in this version yet: `lora-train plan` answers for this config (memory per card, blocks_to_swap, fp8); SD 1.x/SDXL and LLM adapters train today".into(),
        ))
    }
}
