//! `lora-train train`: the whole job.

use super::CliError;
use std::path::{Path, PathBuf};

/// Runs `train`.
pub fn run(_config: &Path, _resume: Option<Option<PathBuf>>, _force: bool) -> Result<i32, CliError> {
    Err(CliError::runtime("train: the causal-LM job is not wired yet"))
}
