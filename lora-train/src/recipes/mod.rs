//! The recipes this build has, in the order they are asked whether a config is theirs: every
//! family that recognises its own configs first, the causal-LM recipe (which takes any other
//! model) last. Adding a family is its folder plus one line here.

#[cfg(feature = "flux")]
pub mod flux;
#[cfg(feature = "sd")]
pub mod images;
#[cfg(feature = "llm")]
pub mod llm;
#[cfg(feature = "sd")]
pub mod sd;

use crate::config::TrainConfig;
use crate::job::recipe::Recipe;
use std::path::Path;

/// Every recipe compiled in (features `flux`, `sd`, `llm`), in detection order.
pub fn all() -> Vec<&'static dyn Recipe> {
    let mut v: Vec<&'static dyn Recipe> = Vec::new();
    #[cfg(feature = "flux")]
    v.push(&flux::FluxRecipe);
    #[cfg(feature = "sd")]
    v.push(&crate::sd::SdRecipe);
    #[cfg(feature = "llm")]
    v.push(&crate::llm::LlmRecipe);
    v
}

/// The recipe `cfg` is for, or `None` when no compiled-in recipe takes it.
pub fn for_config(cfg: &TrainConfig, config_dir: Option<&Path>) -> Option<&'static dyn Recipe> {
    all().into_iter().find(|r| r.detect(cfg, config_dir))
}
