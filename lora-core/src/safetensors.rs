//! The workspace's one safetensors reader: a file memory-mapped with `memmap2`, its header parsed
//! by the `safetensors` crate, tensors read by name into tch tensors.
//!
//! tch's own `read_safetensors` reads whole files into RAM and drops `__metadata__`; this reader
//! touches only the pages of the tensors asked for. safetensors does not align tensor data
//! (offsets are multiples of nothing in particular), so a tensor whose bytes are aligned for its
//! dtype is read through a view of the map and converted from there, and an unaligned one is
//! copied out first. Either way the returned tensor owns its memory: the map may be dropped as
//! soon as the tensors are read.
//!
//! ```no_run
//! # fn main() -> lora_core::Result<()> {
//! use lora_core::safetensors::SafetensorsFile;
//! use tch::{Device, Kind};
//!
//! let file = SafetensorsFile::open("adapter_model.safetensors".as_ref())?;
//! for name in file.names() {
//!     println!("{name}: {:?}", file.shape(name));
//! }
//! let w = file.tensor_as("lora_A.weight", Kind::Float, Device::Cpu)?; // Option<Tensor>
//! # let _ = w; Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ::safetensors::tensor::{Metadata, TensorInfo};
use ::safetensors::{Dtype, SafeTensors};
use memmap2::Mmap;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result, TchContext};

/// The tch dtype of a safetensors dtype, or `None` for dtypes tch cannot hold (U16/U32/U64,
/// the fnuz F8 variants, sub-byte types). `F8_E4M3` is `float8_e4m3fn` (what PyTorch writes for
/// it, e.g. `flux1-dev-fp8.safetensors`), `F8_E5M2` is `float8_e5m2`.
pub fn kind_of(dtype: Dtype) -> Option<Kind> {
    Some(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::F64 => Kind::Double,
        Dtype::I64 => Kind::Int64,
        Dtype::I32 => Kind::Int,
        Dtype::I16 => Kind::Int16,
        Dtype::I8 => Kind::Int8,
        Dtype::U8 => Kind::Uint8,
        Dtype::BOOL => Kind::Bool,
        Dtype::F8_E4M3 => Kind::Float8e4m3fn,
        Dtype::F8_E5M2 => Kind::Float8e5m2,
        _ => return None,
    })
}

/// The safetensors dtype of a tch dtype, for the dtypes this workspace writes (the inverse of
/// [`kind_of`]: f32, f16, bf16, f64, i64, i32, i16, i8, u8, bool, fp8 e4m3fn / e5m2); `None`
/// for others.
pub fn dtype_of(kind: Kind) -> Option<Dtype> {
    Some(match kind {
        Kind::Float => Dtype::F32,
        Kind::Half => Dtype::F16,
        Kind::BFloat16 => Dtype::BF16,
        Kind::Double => Dtype::F64,
        Kind::Int64 => Dtype::I64,
        Kind::Int => Dtype::I32,
        Kind::Int16 => Dtype::I16,
        Kind::Int8 => Dtype::I8,
        Kind::Uint8 => Dtype::U8,
        Kind::Bool => Dtype::BOOL,
        Kind::Float8e4m3fn => Dtype::F8_E4M3,
        Kind::Float8e5m2 => Dtype::F8_E5M2,
        _ => return None,
    })
}

/// A stored tensor's dtype, shape and little-endian bytes, borrowed from the map.
pub type RawTensor<'a> = (Dtype, Vec<usize>, &'a [u8]);

/// A memory-mapped safetensors file with its parsed header.
///
/// The map is read-only; the file must not be modified while it is open (the contract of every
/// mmap-based safetensors reader).
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Mmap,
    /// Length of the JSON header (the data starts at `8 + header_len`).
    header_len: usize,
    meta: Metadata,
    /// Tensor names in data order.
    names: Vec<String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.names.len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Maps `path` and parses its header (only the header's pages are read).
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or mapped; [`Error::SafeTensors`] for a
    /// malformed header; both name the file.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| Error::Io {
            path: path.to_path_buf(),
            source,
        };
        let f = std::fs::File::open(path).map_err(io)?;
        // SAFETY: a read-only map; the file is not expected to change while it is open (the same
        // contract as every mmap-based safetensors reader). Tensors are copied or converted out
        // of the map before they are handed out, so nothing outlives it.
        let mmap = unsafe { Mmap::map(&f) }.map_err(io)?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&mmap).map_err(|source| Error::SafeTensors {
                path: path.to_path_buf(),
                source,
            })?;
        let names = meta.offset_keys();
        Ok(Self {
            path: path.to_path_buf(),
            mmap,
            header_len,
            meta,
            names,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor names, in the order their data is stored.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.names.iter().map(String::as_str)
    }

    /// Whether a tensor named `name` is stored.
    pub fn contains(&self, name: &str) -> bool {
        self.meta.info(name).is_some()
    }

    /// The stored dtype and shape of `name` (nothing is read), or `None` when absent.
    pub fn info(&self, name: &str) -> Option<(Dtype, Vec<usize>)> {
        self.meta.info(name).map(|i| (i.dtype, i.shape.clone()))
    }

    /// The stored shape of `name` in torch's `i64` form (nothing is read), or `None` when absent.
    pub fn shape(&self, name: &str) -> Option<Vec<i64>> {
        self.meta
            .info(name)
            .map(|i| i.shape.iter().map(|&d| d as i64).collect())
    }

    /// The header's `__metadata__` (string → string; empty when absent).
    pub fn metadata(&self) -> BTreeMap<String, String> {
        self.meta
            .metadata()
            .as_ref()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    fn info_and_bytes(&self, name: &str) -> Result<Option<(&TensorInfo, &[u8])>> {
        let Some(info) = self.meta.info(name) else {
            return Ok(None);
        };
        let start = 8 + self.header_len + info.data_offsets.0;
        let end = 8 + self.header_len + info.data_offsets.1;
        let bytes = self.mmap.get(start..end).ok_or_else(|| Error::Format {
            file: self.path.clone(),
            reason: format!(
                "tensor `{name}` data {start}..{end} lies outside the file ({} bytes): the file \
                 is truncated (an incomplete download or copy?); fetch it again",
                self.mmap.len()
            ),
        })?;
        Ok(Some((info, bytes)))
    }

    /// The raw little-endian bytes of `name` and its stored dtype and shape, borrowed from the
    /// map; `None` when absent.
    ///
    /// # Errors
    /// [`Error::Format`] when the header points outside the file.
    pub fn bytes(&self, name: &str) -> Result<Option<RawTensor<'_>>> {
        Ok(self
            .info_and_bytes(name)?
            .map(|(i, b)| (i.dtype, i.shape.clone(), b)))
    }

    /// The tensor `name` in its stored dtype on the CPU (a copy owning its memory), or `None`
    /// when absent.
    ///
    /// # Errors
    /// As [`SafetensorsFile::tensor_as`].
    pub fn tensor(&self, name: &str) -> Result<Option<Tensor>> {
        let Some((info, _)) = self.info_and_bytes(name)? else {
            return Ok(None);
        };
        let kind = self.stored_kind(name, info)?;
        self.tensor_as(name, kind, Device::Cpu)
    }

    fn stored_kind(&self, name: &str, info: &TensorInfo) -> Result<Kind> {
        kind_of(info.dtype).ok_or_else(|| Error::Dtype {
            key: name.to_string(),
            found: format!("{:?}", info.dtype),
            what: format!(
                "in {}: readable dtypes are F32, F16, BF16, F64, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2",
                self.path.display()
            ),
        })
    }

    /// The tensor `name` converted to `kind` on `device`, or `None` when absent. The result
    /// owns its memory. When the stored bytes are aligned for their dtype the conversion reads
    /// the map directly (no intermediate copy: a bf16 → f32 load allocates only the f32
    /// tensor); unaligned bytes are copied out first. bf16 is built from bytes (tch-rs #995).
    ///
    /// # Errors
    /// [`Error::Dtype`] for a stored dtype tch cannot hold; [`Error::Format`] when the header
    /// points outside the file; [`Error::Torch`] when the conversion or the copy to `device`
    /// fails (out of memory included).
    pub fn tensor_as(&self, name: &str, kind: Kind, device: Device) -> Result<Option<Tensor>> {
        let Some((info, bytes)) = self.info_and_bytes(name)? else {
            return Ok(None);
        };
        let src_kind = self.stored_kind(name, info)?;
        let shape: Vec<i64> = info.shape.iter().map(|&d| d as i64).collect();
        let ctx = || format!("reading `{name}` from {}", self.path.display());
        let elt = src_kind.elt_size_in_bytes();
        let numel: usize = info.shape.iter().product();
        if numel > 0 && bytes.len() != numel * elt {
            return Err(Error::Format {
                file: self.path.clone(),
                reason: format!(
                    "tensor `{name}` has {} data bytes, its shape {:?} and dtype {:?} need {}",
                    bytes.len(),
                    info.shape,
                    info.dtype,
                    numel * elt
                ),
            });
        }
        let aligned = numel > 0 && (bytes.as_ptr() as usize).is_multiple_of(elt);
        if !aligned {
            // `from_data_size` copies (memcpy), so any alignment is fine.
            let t = Tensor::f_from_data_size(bytes, &shape, src_kind).ctx(ctx)?;
            return Ok(Some(
                t.f_to_kind(kind)
                    .and_then(|t| t.f_to_device(device))
                    .ctx(ctx)?,
            ));
        }
        let strides = contiguous_strides(&shape);
        // SAFETY: `bytes` lies inside the read-only map, holds `numel · elt` bytes and is aligned
        // for `src_kind`; the view is only read, and is dropped before this function returns:
        // what is returned is either a conversion (new storage) or an explicit copy.
        let view =
            unsafe { Tensor::f_from_blob(bytes.as_ptr(), &shape, &strides, src_kind, Device::Cpu) }
                .ctx(ctx)?;
        let t = if kind == src_kind && device == Device::Cpu {
            view.f_detach_copy().ctx(ctx)?
        } else if kind == src_kind {
            view.f_to_device(device).ctx(ctx)?
        } else {
            view.f_to_kind(kind)
                .and_then(|t| t.f_to_device(device))
                .ctx(ctx)?
        };
        Ok(Some(t))
    }

    /// Every tensor of the file in its stored dtype on the CPU, by name.
    ///
    /// # Errors
    /// As [`SafetensorsFile::tensor_as`].
    pub fn tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for name in &self.names {
            if let Some(t) = self.tensor(name)? {
                out.insert(name.clone(), t);
            }
        }
        Ok(out)
    }
}

fn contiguous_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `F8_E4M3` tensors (PyTorch's `float8_e4m3fn`, as in `flux1-dev-fp8.safetensors`) read as
    /// `Float8e4m3fn` and convert exactly: 0x38 = 1, 0xC0 = −2, 0x7E = 448 (largest finite),
    /// 0x01 = 2⁻⁹ (smallest subnormal), 0x30 = 0.5.
    #[test]
    fn reads_fp8_e4m3_tensors() {
        let header = br#"{"w":{"dtype":"F8_E4M3","shape":[5],"data_offsets":[0,5]}}"#;
        let mut header = header.to_vec();
        while !header.len().is_multiple_of(8) {
            header.push(b' ');
        }
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(&header);
        file.extend([0x38u8, 0xC0, 0x7E, 0x01, 0x30]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f8.safetensors");
        std::fs::write(&path, file).unwrap();
        let f = SafetensorsFile::open(&path).unwrap();
        let t = f.tensor("w").unwrap().unwrap();
        assert_eq!(t.kind(), Kind::Float8e4m3fn);
        let v = f.tensor_as("w", Kind::Float, Device::Cpu).unwrap().unwrap();
        let v: Vec<f32> = Vec::try_from(v).unwrap();
        assert_eq!(v, [1.0, -2.0, 448.0, 2f32.powi(-9), 0.5]);
        assert_eq!(dtype_of(Kind::Float8e4m3fn), Some(Dtype::F8_E4M3));
    }

    #[test]
    fn reads_aligned_and_unaligned_tensors() {
        // Written by hand: a 1-byte tensor first puts the f32 data at offset 1 (unaligned), a
        // bf16 tensor follows at offset 17 (unaligned for 2-byte data too), then an aligned f32.
        let a: [f32; 4] = [1.5, -2.0, 3.25, 4.0];
        let b = Tensor::from_slice(&[0.5f32, 8.0, -1.0]).to_kind(Kind::BFloat16);
        let mut b_bytes = vec![0u8; 6];
        b.copy_data_u8(&mut b_bytes, 3);
        let c: [f32; 2] = [9.0, -9.5];
        let mut data = vec![7u8];
        data.extend(a.iter().flat_map(|v| v.to_le_bytes()));
        data.extend(&b_bytes);
        data.push(0); // padding to offset 24
        data.extend(c.iter().flat_map(|v| v.to_le_bytes()));
        let header = r#"{"__metadata__":{"k":"v"},"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"F32","shape":[2,2],"data_offsets":[1,17]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[17,23]},"p":{"dtype":"U8","shape":[1],"data_offsets":[23,24]},"c":{"dtype":"F32","shape":[2],"data_offsets":[24,32]}}"#;
        let mut header = header.as_bytes().to_vec();
        while !header.len().is_multiple_of(8) {
            header.push(b' ');
        }
        let mut file = (header.len() as u64).to_le_bytes().to_vec();
        file.extend(&header);
        file.extend(&data);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.safetensors");
        std::fs::write(&path, file).unwrap();

        let f = SafetensorsFile::open(&path).unwrap();
        assert_eq!(f.metadata().get("k").map(String::as_str), Some("v"));
        assert_eq!(f.shape("a"), Some(vec![2, 2]));
        assert!(f.contains("b") && !f.contains("z"));
        assert!(f.tensor("z").unwrap().is_none());
        assert_eq!(f.names().collect::<Vec<_>>(), ["u", "a", "b", "p", "c"]);
        let want_a = Tensor::from_slice(&a).reshape([2, 2]);
        let a2 = f.tensor("a").unwrap().unwrap();
        assert_eq!(a2.kind(), Kind::Float);
        assert!(a2.equal(&want_a));
        let a3 = f.tensor_as("a", Kind::Half, Device::Cpu).unwrap().unwrap();
        assert!(a3.equal(&want_a.to_kind(Kind::Half)));
        let b2 = f.tensor_as("b", Kind::Float, Device::Cpu).unwrap().unwrap();
        assert!(b2.equal(&b.to_kind(Kind::Float)));
        let c2 = f.tensor("c").unwrap().unwrap();
        let c3 = f
            .tensor_as("c", Kind::Double, Device::Cpu)
            .unwrap()
            .unwrap();
        assert!(c2.equal(&Tensor::from_slice(&c)));
        assert!(c3.equal(&Tensor::from_slice(&c).to_kind(Kind::Double)));
        assert_eq!(f.tensors().unwrap().len(), 5);
        // the tensors own their memory: they outlive the map
        drop(f);
        assert!(a2.equal(&want_a) && c2.equal(&Tensor::from_slice(&c)));
    }
}
