//! Safetensors files as a [`TensorSource`]: one file or the shards of a folder, through
//! lora-core's memory-mapped reader.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use lora_core::safetensors::SafetensorsFile;
use tch::{Device, Kind, Tensor};

use super::TensorSource;
use crate::error::{Error, Result};

/// lora-core's reader errors in this crate's terms (the file named in each).
fn from_core(path: &Path, e: lora_core::Error) -> Error {
    match e {
        lora_core::Error::Io { path, source } => Error::Io { path, source },
        lora_core::Error::SafeTensors { path, source } => Error::Safetensors {
            path,
            msg: source.to_string(),
        },
        lora_core::Error::Format { file, reason } => Error::Safetensors {
            path: file,
            msg: reason,
        },
        lora_core::Error::Dtype { key, found, what } => Error::Unsupported {
            what: "safetensors dtype",
            value: format!("{found} (tensor `{key}` in {})", path.display()),
            hint: what,
        },
        e => Error::Core(e),
    }
}

type KeyMap = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// Memory-mapped safetensors files (the shards of one model), optionally with a name
/// translation (requested name → stored name) for single-file checkpoints.
///
/// Tensors are converted out of the maps at each request (to the requested dtype, on the
/// source's device), so a model built from them does not keep the maps alive.
pub struct SafetensorsFiles {
    origin: PathBuf,
    files: Vec<SafetensorsFile>,
    index: HashMap<String, usize>,
    key_map: Option<KeyMap>,
    device: Device,
}

impl std::fmt::Debug for SafetensorsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFiles")
            .field("origin", &self.origin)
            .field("tensors", &self.index.len())
            .field("key_map", &self.key_map.is_some())
            .finish()
    }
}

impl SafetensorsFiles {
    /// Maps `paths` (the shards of one model) for tensors on `device`; `origin` names the whole
    /// for messages.
    ///
    /// # Errors
    /// [`Error::Io`] when a file cannot be opened or mapped; [`Error::Safetensors`] for a bad
    /// header.
    pub fn open(paths: &[PathBuf], origin: &Path, device: Device) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for path in paths {
            let f = SafetensorsFile::open(path).map_err(|e| from_core(path, e))?;
            for name in f.names() {
                index.insert(name.to_string(), files.len());
            }
            files.push(f);
        }
        Ok(Self {
            origin: origin.to_path_buf(),
            files,
            index,
            key_map: None,
            device,
        })
    }

    /// Maps a folder's `<stem>.safetensors`, or the shards its `<stem>.safetensors.index.json`
    /// lists ([`weight_files`]), for tensors on `device`.
    ///
    /// # Errors
    /// As [`weight_files`] and [`SafetensorsFiles::open`].
    pub fn open_dir(dir: &Path, stem: &str, device: Device) -> Result<Self> {
        let paths = weight_files(dir, &[format!("{stem}.safetensors")])?;
        Self::open(&paths, dir, device)
    }

    /// Translates every requested name with `map` before the lookup (a `None` from `map` reads
    /// as an absent tensor).
    pub fn with_key_map(
        mut self,
        map: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.key_map = Some(Box::new(map));
        self
    }

    /// The stored tensor names.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The shape of the stored tensor `name` (no key translation; nothing is read), or `None`
    /// when absent.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        self.files[*self.index.get(name)?].shape(name)
    }

    fn stored_name(&self, name: &str) -> Option<String> {
        match &self.key_map {
            None => Some(name.to_string()),
            Some(m) => m(name),
        }
    }

    /// The stored tensor `name` (no key translation) in `kind` on the source's device, or
    /// `None` when absent.
    ///
    /// # Errors
    /// As [`TensorSource::tensor`].
    pub fn stored(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        let Some(&fi) = self.index.get(name) else {
            return Ok(None);
        };
        let f = &self.files[fi];
        f.tensor_as(name, kind, self.device)
            .map_err(|e| from_core(f.path(), e))
    }
}

impl TensorSource for SafetensorsFiles {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        match self.stored_name(name) {
            None => Ok(None),
            Some(stored) => self.stored(&stored, kind),
        }
    }

    /// Whether a tensor is stored under `name` after the key translation.
    fn contains(&self, name: &str) -> bool {
        self.stored_name(name)
            .is_some_and(|s| self.index.contains_key(&s))
    }

    fn origin(&self) -> PathBuf {
        self.origin.clone()
    }
}

/// The first of `names` (e.g. `model.safetensors`) that exists in `dir`, or the shards listed by
/// its `<name>.index.json` (`weight_map`), in file-name order.
///
/// # Errors
/// [`Error::Io`] when none exists (the message lists what was looked for); [`Error::Config`] for
/// an index without `weight_map`.
pub fn weight_files(dir: &Path, names: &[String]) -> Result<Vec<PathBuf>> {
    let stems = names;
    for stem in stems {
        let single = dir.join(stem);
        if single.exists() {
            return Ok(vec![single]);
        }
        let index_path = dir.join(format!("{stem}.index.json"));
        if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|source| Error::Io {
                path: index_path.clone(),
                source,
            })?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
                path: index_path.clone(),
                msg: e.to_string(),
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::Config {
                    path: index_path.clone(),
                    msg: "no `weight_map` object".into(),
                })?;
            let mut files: Vec<String> = map
                .values()
                .filter_map(|f| f.as_str().map(String::from))
                .collect();
            files.sort();
            files.dedup();
            return Ok(files.into_iter().map(|f| dir.join(f)).collect());
        }
    }
    Err(Error::Io {
        path: dir.join(stems.first().map_or("model.safetensors", String::as_str)),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "none of {stems:?} (or their .index.json) in the folder; .bin weights are not read, convert them to safetensors"
            ),
        ),
    })
}

/// Reads a `config.json` into a JSON object.
pub(crate) fn read_config_json(path: &Path) -> Result<serde_json::Map<String, serde_json::Value>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    match serde_json::from_str(&text) {
        Ok(serde_json::Value::Object(m)) => Ok(m),
        Ok(_) => Err(Error::Config {
            path: path.to_path_buf(),
            msg: "not a JSON object".into(),
        }),
        Err(e) => Err(Error::Config {
            path: path.to_path_buf(),
            msg: e.to_string(),
        }),
    }
}
