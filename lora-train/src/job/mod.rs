//! What every job shares: its error type, how it is called ([`RunOptions`]), config paths,
//! the memory plan ([`plan`]), the lowering of a [`crate::config::TrainConfig`] to the engine's
//! and lora-core's settings ([`lower`]), and the checks and measurements around a run
//! ([`run`]). A recipe (`crate::llm`, `crate::sd`) uses this module; this module uses no
//! recipe.

pub mod error;
pub mod lower;
pub mod options;
pub mod plan;
pub mod recipe;
pub mod run;
pub mod sequence;
pub mod snapshots;

pub use error::{JobError, Result};
pub use lower::{lora_config, trainer_config};
pub use options::{RunOptions, resolve_base_model, resolve_path};
pub use plan::Plan;
pub use plan::{apply_settings, budget_for, budget_source, diffusion_report, settings_for};
pub use recipe::Recipe;
pub use run::{
    MeasuredMemory, OutputLock, available_ram, check_device, check_fits_this_machine,
    check_output_dir, check_output_name, check_writable, proc_rss, reset_peak_rss,
    resume_checkpoint,
};
pub use sequence::{LoadedRun, RunContext, RunOutcome, RunSteps};
