//! Hugging Face Hub model ids (`owner/name`, optionally `@revision`) resolved from the local
//! Hugging Face cache, without network.
//!
//! The cache is laid out as `huggingface_hub` lays it out (`file_download.py`,
//! `try_to_load_from_cache`; `constants.py` for the folder):
//!
//! ```text
//! <cache>/models--<owner>--<name>/
//!     refs/main                  the commit hash `main` points to (other branches and tags beside it)
//!     snapshots/<commit hash>/   the repository's files at that commit (links into blobs/)
//!     blobs/
//! ```
//!
//! `<cache>` is `$HF_HUB_CACHE`, else `$HUGGINGFACE_HUB_CACHE` (the older name), else
//! `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`
//! (see [`HubCache::from_env`]). A model is put there by `hf download owner/name` (or, with older
//! `huggingface_hub`, `huggingface-cli download owner/name`), or by any transformers /
//! diffusers `from_pretrained`.
//!
//! ```no_run
//! use lora_train::hub::{HubCache, HubId};
//!
//! let id = HubId::parse("HuggingFaceTB/SmolLM2-135M-Instruct").expect("an owner/name id");
//! let cache = HubCache::from_env().expect("a home folder or HF_HUB_CACHE");
//! let snapshot = cache.resolve(&id)?; // …/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/<hash>
//! # Ok::<(), lora_train::hub::HubError>(())
//! ```

use std::path::{Path, PathBuf};

/// A Hugging Face Hub model id: `owner/name`, optionally followed by `@revision` (a branch or
/// tag name under `refs/`, or a commit hash, full or a unique prefix).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubId {
    /// `owner/name`.
    pub repo: String,
    /// The revision after `@`, if any (`main` otherwise).
    pub revision: Option<String>,
}

/// Whether `part` is a valid owner or name of a Hub repository id (`huggingface_hub`'s
/// `validate_repo_id`): 1 to 96 of ASCII letters, digits, `-`, `_`, `.`; no `--` or `..`; not
/// starting or ending with `-` or `.`.
fn valid_part(part: &str) -> bool {
    !part.is_empty()
        && part.len() <= 96
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !part.contains("--")
        && !part.contains("..")
        && !part.starts_with(['-', '.'])
        && !part.ends_with(['-', '.'])
}

/// File extensions that make `owner/name.ext` a file path, not a repository id.
const FILE_EXTENSIONS: [&str; 7] = [
    ".gguf",
    ".safetensors",
    ".bin",
    ".json",
    ".ckpt",
    ".pt",
    ".pth",
];

impl HubId {
    /// Parses `owner/name` or `owner/name@revision`; `None` for anything else (absolute or
    /// `./` paths, more than one `/`, characters a Hub id cannot hold, a name ending in a model
    /// file extension such as `.gguf` or `.safetensors`).
    pub fn parse(written: &str) -> Option<HubId> {
        let (repo, revision) = match written.split_once('@') {
            Some((r, rev)) => {
                let rev = rev.trim();
                if rev.is_empty() || rev.contains("..") || rev.starts_with('/') {
                    return None;
                }
                (r, Some(rev.to_string()))
            }
            None => (written, None),
        };
        let (owner, name) = repo.split_once('/')?;
        if !valid_part(owner) || !valid_part(name) {
            return None;
        }
        let lower = name.to_ascii_lowercase();
        if FILE_EXTENSIONS.iter().any(|e| lower.ends_with(e)) {
            return None;
        }
        Some(HubId {
            repo: repo.to_string(),
            revision,
        })
    }

    /// The repository's folder name in the cache: `models--<owner>--<name>`
    /// (`huggingface_hub`'s `repo_folder_name`).
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }

    /// The commands that download it into the cache: `hf download …` (huggingface_hub ≥ 0.34)
    /// and the older `huggingface-cli download …`, with `--revision` when one was asked for.
    pub fn download_commands(&self) -> [String; 2] {
        let rev = self
            .revision
            .as_deref()
            .map(|r| format!(" --revision {r}"))
            .unwrap_or_default();
        [
            format!("hf download {}{rev}", self.repo),
            format!("huggingface-cli download {}{rev}", self.repo),
        ]
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.revision {
            Some(r) => write!(f, "{}@{r}", self.repo),
            None => f.write_str(&self.repo),
        }
    }
}

/// Why a Hub id did not resolve from the cache.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HubError {
    /// The cache has no folder for the repository.
    #[error(
        "{id} is not in the Hugging Face cache (looked in {}); download it with `{}` (older \
         huggingface_hub: `{}`), or set HF_HUB_CACHE / HF_HOME to the cache that holds it",
        looked.display(),
        id.download_commands()[0],
        id.download_commands()[1]
    )]
    NotCached {
        /// The id (boxed: keeps the error small).
        id: Box<HubId>,
        /// The repository folder that does not exist.
        looked: PathBuf,
    },
    /// The repository is cached but not at the revision asked for (or `refs/main` points to a
    /// snapshot that is not there).
    #[error(
        "{id}: revision {revision:?} is not in the cache at {} (refs: [{}]; snapshots: [{}]); \
         download it with `{}`",
        repo_folder.display(),
        refs.join(", "),
        snapshots.join(", "),
        id.download_commands()[0]
    )]
    NoSuchRevision {
        /// The id (boxed: keeps the error small).
        id: Box<HubId>,
        /// The revision looked for (`main` when none was given).
        revision: String,
        /// The repository's cache folder.
        repo_folder: PathBuf,
        /// The refs (branches, tags) the cache knows.
        refs: Vec<String>,
        /// The cached snapshots (commit hashes).
        snapshots: Vec<String>,
    },
    /// No revision was given, the cache has no `refs/main`, and there are several snapshots.
    #[error(
        "{id}: the cache at {} has no refs/main and {} snapshots ({}); pick one with \
         {}@<commit hash>",
        repo_folder.display(),
        snapshots.len(),
        snapshots.join(", "),
        id.repo
    )]
    Ambiguous {
        /// The id (boxed: keeps the error small).
        id: Box<HubId>,
        /// The repository's cache folder.
        repo_folder: PathBuf,
        /// The cached snapshots (commit hashes).
        snapshots: Vec<String>,
    },
    /// A cache file or folder could not be read.
    #[error("reading the Hugging Face cache at {path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The local Hugging Face Hub cache folder (`huggingface_hub`'s `HF_HUB_CACHE`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubCache {
    /// The folder holding the `models--<owner>--<name>` folders.
    pub dir: PathBuf,
}

/// `~` or `~/…` expanded with `home` (as Python's `os.path.expanduser` does).
fn expand_home(p: &str, home: Option<&str>) -> PathBuf {
    match (p.strip_prefix('~'), home) {
        (Some(""), Some(h)) => PathBuf::from(h),
        (Some(rest), Some(h)) if rest.starts_with('/') => {
            Path::new(h).join(rest.trim_start_matches('/'))
        }
        _ => PathBuf::from(p),
    }
}

impl HubCache {
    /// The cache at `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        HubCache { dir: dir.into() }
    }

    /// The cache `huggingface_hub` uses in this process's environment; see [`Self::from_vars`].
    pub fn from_env() -> Option<Self> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// The cache folder as `huggingface_hub` chooses it (`constants.py`), with `var` reading
    /// the environment: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `HF_HOME/hub`, else
    /// `XDG_CACHE_HOME/huggingface/hub`, else `HOME/.cache/huggingface/hub`; a leading `~` is
    /// the home folder. Empty variables count as unset. `None` when none of them is set.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Option<Self> {
        let get = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = get("HOME");
        let expand = |p: String| expand_home(&p, home.as_deref());
        let dir = if let Some(d) = get("HF_HUB_CACHE").or_else(|| get("HUGGINGFACE_HUB_CACHE")) {
            expand(d)
        } else if let Some(h) = get("HF_HOME") {
            expand(h).join("hub")
        } else if let Some(x) = get("XDG_CACHE_HOME") {
            expand(x).join("huggingface").join("hub")
        } else {
            PathBuf::from(home.as_deref()?)
                .join(".cache")
                .join("huggingface")
                .join("hub")
        };
        Some(HubCache { dir })
    }

    /// The snapshot folder of `id` in this cache: the commit that `refs/<revision>` names
    /// (`refs/main` without a revision), else the snapshot named by the revision (a full commit
    /// hash, or a prefix only one snapshot has). Without a revision and without `refs/main`, the
    /// only snapshot when there is exactly one. Reads the file system only.
    ///
    /// # Errors
    /// [`HubError::NotCached`] naming the folder looked in and the download commands;
    /// [`HubError::NoSuchRevision`] / [`HubError::Ambiguous`] listing what the cache holds;
    /// [`HubError::Io`].
    pub fn resolve(&self, id: &HubId) -> Result<PathBuf, HubError> {
        let repo_folder = self.dir.join(id.folder_name());
        if !repo_folder.is_dir() {
            return Err(HubError::NotCached {
                id: Box::new(id.clone()),
                looked: repo_folder,
            });
        }
        let snapshots_dir = repo_folder.join("snapshots");
        let snapshots = list_dirs(&snapshots_dir)?;
        let revision = id.revision.as_deref().unwrap_or("main");
        let ref_file = repo_folder.join("refs").join(revision);
        let commit = if ref_file.is_file() {
            let text = std::fs::read_to_string(&ref_file).map_err(|source| HubError::Io {
                path: ref_file.clone(),
                source,
            })?;
            Some(text.trim().to_string())
        } else if snapshots.iter().any(|s| s == revision) {
            Some(revision.to_string())
        } else if id.revision.is_some() {
            let mut matching = snapshots.iter().filter(|s| s.starts_with(revision));
            match (matching.next(), matching.next()) {
                (Some(one), None) if revision.len() >= 4 => Some(one.clone()),
                _ => None,
            }
        } else if snapshots.len() == 1 {
            Some(snapshots[0].clone())
        } else if snapshots.len() > 1 {
            return Err(HubError::Ambiguous {
                id: Box::new(id.clone()),
                repo_folder,
                snapshots,
            });
        } else {
            None
        };
        match commit {
            Some(c) if !c.is_empty() && snapshots.contains(&c) => Ok(snapshots_dir.join(c)),
            _ => Err(HubError::NoSuchRevision {
                id: Box::new(id.clone()),
                revision: revision.to_string(),
                refs: list_refs(&repo_folder.join("refs"))?,
                repo_folder,
                snapshots,
            }),
        }
    }
}

/// The names of the folders in `dir`, sorted; empty when `dir` does not exist.
fn list_dirs(dir: &Path) -> Result<Vec<String>, HubError> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let io = |source| HubError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).map_err(io)? {
        let e = e.map_err(io)?;
        if e.path().is_dir() {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    Ok(out)
}

/// The refs under `refs/` (`main`, tags, `pr/1` …), sorted; empty when there is no `refs/`.
fn list_refs(refs: &Path) -> Result<Vec<String>, HubError> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<(), HubError> {
        let io = |source| HubError::Io {
            path: dir.to_path_buf(),
            source,
        };
        for e in std::fs::read_dir(dir).map_err(io)? {
            let p = e.map_err(io)?.path();
            if p.is_dir() {
                walk(root, &p, out)?;
            } else if let Ok(rel) = p.strip_prefix(root) {
                out.push(rel.to_string_lossy().into_owned());
            }
        }
        Ok(())
    }
    let mut out = Vec::new();
    if refs.is_dir() {
        walk(refs, refs, &mut out)?;
    }
    out.sort();
    Ok(out)
}

/// Resolves `written` as a Hub id from `cache`: `None` when it is not an `owner/name[@revision]`
/// id ([`HubId::parse`]), else [`HubCache::resolve`]'s answer.
pub fn resolve_hub_id(written: &str, cache: &HubCache) -> Option<Result<PathBuf, HubError>> {
    HubId::parse(written).map(|id| cache.resolve(&id))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAIN: &str = "1c6bdbc9a8e2b07e9d0c1f4a2b3c4d5e6f708192";
    const OLD: &str = "39be3f3bbd0f7a5c1e2d3c4b5a69788796a5b4c3";

    /// A cache laid out as huggingface_hub writes it: `refs/main`, two snapshots whose files
    /// link into `blobs/`, and a tag.
    fn cache_with(repo: &str, refs: &[(&str, &str)], snapshots: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir
            .path()
            .join(format!("models--{}", repo.replace('/', "--")));
        std::fs::create_dir_all(root.join("blobs")).unwrap();
        std::fs::write(root.join("blobs/0a1b2c"), r#"{"model_type": "llama"}"#).unwrap();
        for (name, commit) in refs {
            let f = root.join("refs").join(name);
            std::fs::create_dir_all(f.parent().unwrap()).unwrap();
            // huggingface_hub writes the hash without a newline
            std::fs::write(f, commit).unwrap();
        }
        for s in snapshots {
            let snap = root.join("snapshots").join(s);
            std::fs::create_dir_all(&snap).unwrap();
            #[cfg(unix)]
            std::os::unix::fs::symlink("../../blobs/0a1b2c", snap.join("config.json")).unwrap();
            #[cfg(not(unix))]
            std::fs::write(snap.join("config.json"), "{}").unwrap();
        }
        dir
    }

    fn snap(dir: &Path, repo: &str, commit: &str) -> PathBuf {
        dir.join(format!("models--{}", repo.replace('/', "--")))
            .join("snapshots")
            .join(commit)
    }

    #[test]
    fn ids_parse_and_paths_do_not() {
        let id = HubId::parse("runwayml/stable-diffusion-v1-5").unwrap();
        assert_eq!(id.repo, "runwayml/stable-diffusion-v1-5");
        assert_eq!(id.revision, None);
        assert_eq!(id.folder_name(), "models--runwayml--stable-diffusion-v1-5");
        let id = HubId::parse("HuggingFaceTB/SmolLM2-135M-Instruct@v1.0").unwrap();
        assert_eq!(id.revision.as_deref(), Some("v1.0"));
        assert_eq!(id.to_string(), "HuggingFaceTB/SmolLM2-135M-Instruct@v1.0");
        assert_eq!(
            id.download_commands()[0],
            "hf download HuggingFaceTB/SmolLM2-135M-Instruct --revision v1.0"
        );
        assert!(HubId::parse("Qwen/Qwen2.5-0.5B").is_some());
        for path in [
            "/models/x",
            "./a/b",
            "../a/b",
            "a/b/c",
            "model.gguf",
            "assets/models/SmolLM2-135M-Instruct.Q4_1.gguf",
            "models/sd15.safetensors",
            "a--b/c",
            "a/b@",
            "-a/b",
            "a b/c",
        ] {
            assert_eq!(HubId::parse(path), None, "{path}");
        }
    }

    #[test]
    fn the_cache_folder_is_chosen_as_huggingface_hub_chooses_it() {
        static ALL: [(&str, &str); 5] = [
            ("HF_HUB_CACHE", "/c/hub"),
            ("HUGGINGFACE_HUB_CACHE", "/legacy"),
            ("HF_HOME", "/h"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/home/u"),
        ];
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };

        let dir = |p: &'static [(&'static str, &'static str)]| {
            HubCache::from_vars(vars(p)).map(|c| c.dir)
        };
        assert_eq!(dir(&ALL[..]), Some("/c/hub".into()));
        assert_eq!(dir(&ALL[1..]), Some("/legacy".into()));
        assert_eq!(dir(&ALL[2..]), Some("/h/hub".into()));
        assert_eq!(dir(&ALL[3..]), Some("/x/huggingface/hub".into()));
        assert_eq!(
            dir(&ALL[4..]),
            Some("/home/u/.cache/huggingface/hub".into())
        );
        assert_eq!(
            dir(&[("HF_HOME", "~/hf"), ("HOME", "/home/u")]),
            Some("/home/u/hf/hub".into())
        );
        assert_eq!(
            dir(&[("HF_HUB_CACHE", ""), ("HOME", "/home/u")]),
            Some("/home/u/.cache/huggingface/hub".into())
        );
        assert_eq!(dir(&[]), None);
    }

    #[test]
    fn refs_main_picks_the_snapshot_and_a_revision_picks_another() {
        let repo = "HuggingFaceTB/SmolLM2-135M-Instruct";
        let dir = cache_with(repo, &[("main", MAIN), ("v1", OLD)], &[MAIN, OLD]);
        let cache = HubCache::new(dir.path());
        let got = resolve_hub_id(repo, &cache).unwrap().unwrap();
        assert_eq!(got, snap(dir.path(), repo, MAIN));
        // the files are reachable through the blob links
        assert_eq!(
            std::fs::read_to_string(got.join("config.json")).unwrap(),
            r#"{"model_type": "llama"}"#
        );
        let at = |rev: &str| resolve_hub_id(&format!("{repo}@{rev}"), &cache).unwrap();
        assert_eq!(at("v1").unwrap(), snap(dir.path(), repo, OLD));
        assert_eq!(at(OLD).unwrap(), snap(dir.path(), repo, OLD));
        assert_eq!(at("39be3f").unwrap(), snap(dir.path(), repo, OLD));
        let e = at("nope").unwrap_err();
        assert!(matches!(e, HubError::NoSuchRevision { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("\"nope\"") && msg.contains("main, v1"),
            "{msg}"
        );
        assert!(msg.contains(OLD) && msg.contains(MAIN), "{msg}");
        // a prefix must be long enough to mean one commit
        assert!(at("3").is_err());
    }

    #[test]
    fn without_refs_main_the_only_snapshot_is_used_and_two_are_ambiguous() {
        let repo = "runwayml/stable-diffusion-v1-5";
        let one = cache_with(repo, &[], &[OLD]);
        let got = resolve_hub_id(repo, &HubCache::new(one.path()))
            .unwrap()
            .unwrap();
        assert_eq!(got, snap(one.path(), repo, OLD));
        let two = cache_with(repo, &[], &[OLD, MAIN]);
        let e = resolve_hub_id(repo, &HubCache::new(two.path()))
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, HubError::Ambiguous { .. }), "{e}");
        // listed sorted
        assert!(e.to_string().contains(&format!("({MAIN}, {OLD})")), "{e}");
        assert!(
            e.to_string().contains(&format!("{repo}@<commit hash>")),
            "{e}"
        );
        // refs/main naming a snapshot that is not there
        let gone = cache_with(repo, &[("main", MAIN)], &[OLD]);
        let e = resolve_hub_id(repo, &HubCache::new(gone.path()))
            .unwrap()
            .unwrap_err();
        assert!(matches!(e, HubError::NoSuchRevision { .. }), "{e}");
    }

    #[test]
    fn a_missing_repo_names_the_folder_and_the_download_commands() {
        let dir = tempfile::tempdir().unwrap();
        let e = resolve_hub_id("runwayml/stable-diffusion-v1-5", &HubCache::new(dir.path()))
            .unwrap()
            .unwrap_err();
        let msg = e.to_string();
        let folder = dir.path().join("models--runwayml--stable-diffusion-v1-5");
        assert!(msg.contains(&folder.display().to_string()), "{msg}");
        assert!(
            msg.contains("`hf download runwayml/stable-diffusion-v1-5`"),
            "{msg}"
        );
        assert!(
            msg.contains("`huggingface-cli download runwayml/stable-diffusion-v1-5`"),
            "{msg}"
        );
        assert!(resolve_hub_id("not/a/hub/id", &HubCache::new(dir.path())).is_none());
    }
}
