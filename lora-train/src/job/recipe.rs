//! The [`Recipe`] trait: what a model family's job offers the front-ends (the CLI, an app).
//!
//! A recipe recognises its configs, plans them from headers alone and trains them; the engine
//! below knows none of this. The recipes of this crate are registered in [`crate::recipes`]
//! (one line each, behind their features); a front-end asks [`crate::recipes::for_config`]
//! which one a config is for.

use crate::config::TrainConfig;
use crate::job::error::Result;
use crate::job::options::RunOptions;
use crate::job::plan::Plan;
use lora_memory::Budget;
use std::path::Path;

/// A model family's job.
pub trait Recipe: Sync {
    /// The recipe's name (`"llm"`, `"sd"`), as in cargo features and messages.
    fn name(&self) -> &'static str;

    /// Whether `cfg` is for this recipe (`model.kind`, or what `model.base_model` is). Reads
    /// headers at most, never weights.
    fn detect(&self, cfg: &TrainConfig, config_dir: Option<&Path>) -> bool;

    /// The memory plan of `cfg` against `budget` (else the config's) on CUDA or the CPU. With
    /// `memory.auto_fit` the plan carries the fitted settings and the changes; `cfg` is not
    /// touched ([`Plan::apply_to`] writes them into a config).
    ///
    /// # Errors
    /// Config, header and budget errors; not fitting is not an error ([`Plan::fits`]).
    fn plan(
        &self,
        cfg: &TrainConfig,
        config_dir: Option<&Path>,
        budget: Option<Budget>,
        cuda: bool,
    ) -> Result<Plan>;

    /// Runs the job (plan → load → inject → data → train → export) and returns its summary as
    /// written to `summary.json`.
    ///
    /// # Errors
    /// [`crate::job::JobError`]: bad input (exit 2 in the CLI), not fitting, interrupted, or
    /// a failure at run time.
    fn train(&self, cfg: TrainConfig, opts: &RunOptions) -> Result<serde_json::Value>;
}
