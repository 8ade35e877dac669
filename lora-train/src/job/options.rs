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

/// Resolves `model.base_model`: a path as [`resolve_path`] finds it; else, when it is a Hugging
/// Face Hub id (`owner/name`, optionally `@revision`; [`crate::hub::HubId::parse`]), its snapshot
/// folder in the local Hugging Face cache ([`crate::hub::HubCache::from_env`]), without network.
/// Every recipe resolves the base model through this, so the LLM and Stable Diffusion jobs accept
/// the same ids.
///
/// # Errors
/// [`JobError::MissingFile`] naming the places looked (the paths, and for a Hub id its cache
/// folder) and, for a Hub id, the command that downloads it; [`JobError::Input`] when the
/// repository is cached but not at the revision asked for, or its cache cannot be read.
pub fn resolve_base_model(written: &str, config_dir: Option<&Path>) -> Result<PathBuf> {
    resolve_base_model_in(written, config_dir, crate::hub::HubCache::from_env())
}

/// [`resolve_base_model`] with the Hub cache given (`None`: no cache, paths only).
pub(crate) fn resolve_base_model_in(
    written: &str,
    config_dir: Option<&Path>,
    cache: Option<crate::hub::HubCache>,
) -> Result<PathBuf> {
    let key = "model.base_model";
    let missing = match resolve_path(key, written, config_dir) {
        Err(e @ JobError::MissingFile { .. }) => e,
        other => return other,
    };
    // `assets/…` is the repository's own folder (its hint says how to provision it)
    if written.starts_with("assets/") {
        return Err(missing);
    }
    let (Some(id), Some(cache)) = (crate::hub::HubId::parse(written), cache) else {
        return Err(missing);
    };
    match cache.resolve(&id) {
        Ok(p) => Ok(p),
        Err(crate::hub::HubError::NotCached { looked, .. }) => {
            let JobError::MissingFile {
                key,
                path,
                looked: paths,
                ..
            } = missing
            else {
                return Err(missing);
            };
            let [hf, legacy] = id.download_commands();
            Err(JobError::MissingFile {
                key,
                path,
                looked: format!(
                    "{paths}, and as a Hugging Face Hub id in the cache folder {}",
                    looked.display()
                ),
                hint: format!(
                    "download it with `{hf}` (older huggingface_hub: `{legacy}`; HF_HUB_CACHE or \
                     HF_HOME choose the cache), or fix the path (relative paths are tried from the \
                     current directory, then from the config file's folder)"
                ),
            })
        }
        Err(e) => Err(JobError::Input(format!("{key} = {written:?}: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hub::HubCache;

    const COMMIT: &str = "1c6bdbc9a8e2b07e9d0c1f4a2b3c4d5e6f708192";

    #[test]
    fn a_base_model_is_a_path_first_then_a_hub_id_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache
            .path()
            .join("models--HuggingFaceTB--SmolLM2-135M-Instruct");
        let snapshot = repo.join("snapshots").join(COMMIT);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), COMMIT).unwrap();
        std::fs::write(snapshot.join("config.json"), "{}").unwrap();
        let hub = || Some(HubCache::new(cache.path()));

        let got =
            resolve_base_model_in("HuggingFaceTB/SmolLM2-135M-Instruct", None, hub()).unwrap();
        assert_eq!(got, snapshot);

        // A folder of that name next to the config wins over the cache.
        let cfg_dir = tempfile::tempdir().unwrap();
        let local = cfg_dir.path().join("HuggingFaceTB/SmolLM2-135M-Instruct");
        std::fs::create_dir_all(&local).unwrap();
        let got = resolve_base_model_in(
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            Some(cfg_dir.path()),
            hub(),
        )
        .unwrap();
        assert_eq!(got, local);

        // Not cached: the paths and the cache folder looked in, and the download command.
        let e = resolve_base_model_in("runwayml/stable-diffusion-v1-5", None, hub()).unwrap_err();
        assert!(matches!(e, JobError::MissingFile { .. }), "{e}");
        let msg = e.to_string();
        let folder = cache.path().join("models--runwayml--stable-diffusion-v1-5");
        assert!(msg.contains(&folder.display().to_string()), "{msg}");
        assert!(msg.contains("runwayml/stable-diffusion-v1-5"), "{msg}");
        assert!(
            msg.contains("`hf download runwayml/stable-diffusion-v1-5`"),
            "{msg}"
        );
        let cwd = std::env::current_dir().unwrap();
        assert!(
            msg.contains(
                &cwd.join("runwayml/stable-diffusion-v1-5")
                    .display()
                    .to_string()
            ),
            "{msg}"
        );

        // Cached, but not at that revision: an input error listing what is there.
        let e = resolve_base_model_in("HuggingFaceTB/SmolLM2-135M-Instruct@v2", None, hub())
            .unwrap_err();
        assert!(matches!(e, JobError::Input(_)), "{e}");
        assert!(e.to_string().contains(COMMIT), "{e}");

        // Paths that are no Hub id keep the plain message.
        for written in ["models/missing.gguf", "assets/models/x/y"] {
            let msg = resolve_base_model_in(written, None, hub())
                .unwrap_err()
                .to_string();
            assert!(!msg.contains("hf download"), "{msg}");
        }
    }
}
