//! How a job is called and where the files its config names are found.

use crate::job::error::{JobError, Result};
use std::path::{Path, PathBuf};

/// How a job's `run` is called (`crate::llm::run`, `crate::sd::run`).
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Folder of the config file (relative paths are tried there after the current directory).
    pub config_dir: Option<PathBuf>,
    /// Start even when the plan predicts the run does not fit.
    pub force: bool,
    /// Print progress and the report to stderr/stdout.
    pub verbose: bool,
    /// `None`: start fresh; `Some(None)`: resume from the newest checkpoint of the run's output
    /// folder; `Some(Some(dir))`: resume from that checkpoint. Either is [`JobError::Input`]
    /// before anything loads when there is no such checkpoint (see [`resume_checkpoint`](crate::job::resume_checkpoint)).
    pub resume: Option<Option<PathBuf>>,
}

/// Resolves a path from the config: as written relative to the current directory when it exists
/// there, else relative to the config file's folder.
///
/// # Errors
/// [`JobError::MissingFile`] naming the key and both places looked.
pub fn resolve_path(key: &str, written: &str, config_dir: Option<&Path>) -> Result<PathBuf> {
    let p = PathBuf::from(written);
    if p.exists() {
        return Ok(p);
    }
    let mut looked = vec![
        std::env::current_dir()
            .map(|d| d.join(&p))
            .unwrap_or_else(|_| p.clone())
            .display()
            .to_string(),
    ];
    if p.is_relative()
        && let Some(dir) = config_dir
    {
        let q = dir.join(&p);
        if q.exists() {
            return Ok(q);
        }
        looked.push(q.display().to_string());
    }
    Err(JobError::MissingFile {
        key: key.into(),
        path: written.into(),
        looked: looked.join(" and "),
        hint: if written.starts_with("assets/") {
            "the assets are provisioned by `cargo xtask setup`".into()
        } else {
            "fix the path (relative paths are tried from the current directory, then from the config file's folder)".into()
        },
    })
}
