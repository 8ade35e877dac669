//! Tensors by name from memory-mapped safetensors files or an in-memory map.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

/// One mapped safetensors file: path, map, header length, header.
type Mapped = (PathBuf, Mmap, usize, safetensors::tensor::Metadata);

/// Where the tensors come from.
pub(crate) enum Tensors<'a> {
    /// Memory-mapped safetensors files (one or the shards of an index).
    Files {
        origin: PathBuf,
        files: Vec<Mapped>,
        index: HashMap<String, usize>,
    },
    /// Tensors already in memory.
    Map(&'a HashMap<String, Tensor>),
}

impl Tensors<'_> {
    /// Maps `<dir>/<stem>.safetensors`, or the shards listed by `<dir>/<stem>.safetensors.index.json`.
    pub(crate) fn open_dir(dir: &Path, stem: &str) -> Result<Self> {
        let single = dir.join(format!("{stem}.safetensors"));
        let index_path = dir.join(format!("{stem}.safetensors.index.json"));
        let paths: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
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
            files.into_iter().map(|f| dir.join(f)).collect()
        } else {
            return Err(Error::Io {
                path: single,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!(
                        "neither {stem}.safetensors nor {stem}.safetensors.index.json in the folder"
                    ),
                ),
            });
        };
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for path in paths {
            let f = File::open(&path).map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            // SAFETY: read-only map; the file must not change while the model loads.
            let mmap = unsafe { Mmap::map(&f) }.map_err(|source| Error::Io {
                path: path.clone(),
                source,
            })?;
            let (n, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
                path: path.clone(),
                msg: e.to_string(),
            })?;
            for name in meta.tensors().keys() {
                index.insert(name.clone(), files.len());
            }
            files.push((path, mmap, n, meta));
        }
        Ok(Tensors::Files {
            origin: dir.to_path_buf(),
            files,
            index,
        })
    }

    /// Whether a tensor named `name` exists.
    pub(crate) fn has(&self, name: &str) -> bool {
        match self {
            Tensors::Files { index, .. } => index.contains_key(name),
            Tensors::Map(m) => m.contains_key(name),
        }
    }

    /// Where the tensors come from (for messages).
    pub(crate) fn origin(&self) -> PathBuf {
        match self {
            Tensors::Files { origin, .. } => origin.clone(),
            Tensors::Map(_) => "<tensor map>".into(),
        }
    }

    /// The tensor `name` converted to `kind` on `device` (a copy: the map need not outlive it);
    /// `None` when absent.
    pub(crate) fn get(&self, name: &str, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        match self {
            Tensors::Map(m) => match m.get(name) {
                None => Ok(None),
                Some(t) => Ok(Some(t.f_detach()?.f_to_kind(kind)?.f_to_device(device)?)),
            },
            Tensors::Files { files, index, .. } => {
                let Some(&fi) = index.get(name) else {
                    return Ok(None);
                };
                let (path, mmap, n, meta) = &files[fi];
                let info = meta.info(name).ok_or_else(|| Error::MissingTensor {
                    name: name.into(),
                    path: path.clone(),
                })?;
                let src_kind = match info.dtype {
                    Dtype::F32 => Kind::Float,
                    Dtype::F16 => Kind::Half,
                    Dtype::BF16 => Kind::BFloat16,
                    Dtype::F64 => Kind::Double,
                    Dtype::I64 => Kind::Int64,
                    other => {
                        return Err(Error::Unsupported {
                            what: "safetensors dtype",
                            value: format!("{other:?} (tensor `{name}` in {})", path.display()),
                            hint: "supported: F32, F16, BF16, F64, I64".into(),
                        });
                    }
                };
                let (start, end) = (8 + n + info.data_offsets.0, 8 + n + info.data_offsets.1);
                let bytes = mmap.get(start..end).ok_or_else(|| Error::Safetensors {
                    path: path.clone(),
                    msg: format!("tensor `{name}` data {start}..{end} lies outside the file"),
                })?;
                let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
                // `from_data_size` copies (alignment-safe; bf16 from bytes, tch-rs #995); the
                // cast below is a no-op when the stored dtype is already `kind`.
                let t = Tensor::f_from_data_size(bytes, &shape, src_kind)?;
                Ok(Some(t.f_to_kind(kind)?.f_to_device(device)?))
            }
        }
    }

    /// As [`Tensors::get`], but a missing tensor or another shape is an error.
    pub(crate) fn require(
        &self,
        name: &str,
        shape: &[i64],
        kind: Kind,
        device: Device,
    ) -> Result<Tensor> {
        let t = self
            .get(name, kind, device)?
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                path: self.origin(),
            })?;
        if t.size() != shape {
            return Err(Error::Shape {
                name: name.into(),
                expected: shape.to_vec(),
                found: t.size(),
            });
        }
        Ok(t)
    }
}
