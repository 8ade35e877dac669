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
    if lora_train::sd::wants_sd_job(&cfg, opts.config_dir.as_deref()) {
        lora_train::sd::run(cfg, &opts)?;
    } else {
        llm::run(cfg, &opts)?;
    }
    Ok(EXIT_OK)
}
