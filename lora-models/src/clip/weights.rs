//! Tensors by name from memory-mapped safetensors files or an in-memory map.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};
use crate::sd::load::{SafetensorsFiles, TensorSource, weight_files};

/// Where the tensors come from.
pub(crate) enum Tensors<'a> {
    /// Memory-mapped safetensors files (one or the shards of an index), read on the CPU.
    Files(SafetensorsFiles),
    /// Tensors already in memory.
    Map(&'a HashMap<String, Tensor>),
}

impl Tensors<'_> {
    /// Maps `<dir>/<stem>.safetensors`, or the shards listed by `<dir>/<stem>.safetensors.index.json`.
    pub(crate) fn open_dir(dir: &Path, stem: &str) -> Result<Self> {
        let paths = weight_files(dir, &[format!("{stem}.safetensors")])?;
        Ok(Tensors::Files(SafetensorsFiles::open(
            &paths,
            dir,
            Device::Cpu,
        )?))
    }

    /// Whether a tensor named `name` exists.
    pub(crate) fn has(&self, name: &str) -> bool {
        match self {
            Tensors::Files(f) => f.contains(name),
            Tensors::Map(m) => m.contains_key(name),
        }
    }

    /// Where the tensors come from (for messages).
    pub(crate) fn origin(&self) -> PathBuf {
        match self {
            Tensors::Files(f) => f.origin(),
            Tensors::Map(_) => "<tensor map>".into(),
        }
    }

    /// The tensor `name` converted to `kind` on `device` (a copy: the map need not outlive it);
    /// `None` when absent.
    pub(crate) fn get(&self, name: &str, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        let t = match self {
            Tensors::Map(m) => match m.get(name) {
                None => return Ok(None),
                Some(t) => t.f_detach()?.f_to_kind(kind)?,
            },
            Tensors::Files(f) => match f.tensor(name, kind)? {
                None => return Ok(None),
                Some(t) => t,
            },
        };
        Ok(Some(t.f_to_device(device)?))
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
