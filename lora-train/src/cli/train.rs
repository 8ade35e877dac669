//! `lora-train train`: the whole job.

use super::{CliError, EXIT_OK};
use lora_train::config::TrainConfig;
use lora_train::llm::{self, RunOptions};
use std::path::{Path, PathBuf};

/// Runs `train`.
pub fn run(config: &Path, resume: Option<Option<PathBuf>>, force: bool) -> Result<i32, CliError> {
    let cfg = TrainConfig::from_file(config)?;
    let opts = RunOptions {
        config_dir: config.parent().map(Path::to_path_buf),
        force,
        verbose: true,
        resume,
    };
    llm::run(cfg, &opts)?;
    Ok(EXIT_OK)
}
