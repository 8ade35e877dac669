//! A reader for GGUF v2/v3 files (llama.cpp's model container), memory-mapped.
//!
//! Layout (from `ggml/docs/gguf.md` in the ggml repository), all little endian:
//! ```text
//! u32 magic "GGUF" | u32 version | u64 tensor_count | u64 metadata_kv_count
//! metadata_kv_count × { string key | u32 value_type | value }
//! tensor_count × { string name | u32 n_dims | u64 dims[n_dims] (innermost first) | u32 ggml_type | u64 offset }
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset
//! ```
//! A string is `u64 len | len bytes` (UTF-8, not NUL-terminated); an array is
//! `u32 item_type | u64 n | n items`.
//!
//! Dequantisation of the block formats (`F32`, `F16`, `BF16`, `Q8_0`, `Q4_0`, `Q4_1`) follows
//! `ggml/src/ggml-quants.c` (`dequantize_row_q8_0`, `_q4_0`, `_q4_1`).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

/// The default tensor-data alignment when `general.alignment` is absent (gguf.md).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value of a GGUF file.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    /// type 0
    U8(u8),
    /// type 1
    I8(i8),
    /// type 2
    U16(u16),
    /// type 3
    I16(i16),
    /// type 4
    U32(u32),
    /// type 5
    I32(i32),
    /// type 6
    F32(f32),
    /// type 7
    Bool(bool),
    /// type 8
    String(String),
    /// type 9 (items all of one type)
    Array(Vec<GgufValue>),
    /// type 10
    U64(u64),
    /// type 11
    I64(i64),
    /// type 12
    F64(f64),
}

impl GgufValue {
    /// The value as a signed integer when it is any integer type (or a bool) that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::U64(v) => i64::try_from(v).ok(),
            GgufValue::I64(v) => Some(v),
            GgufValue::Bool(v) => Some(v.into()),
            _ => None,
        }
    }

    /// The value as a float when it is any numeric type.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice when it is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The items when the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// A tensor element / block type of ggml (`enum ggml_type` in `ggml.h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 0: f32
    F32,
    /// 1: IEEE f16
    F16,
    /// 2: blocks of 32: f16 scale `d` + 16 bytes of 4-bit codes; `w = d·(q − 8)`
    Q4_0,
    /// 3: blocks of 32: f16 `d`, f16 `m` + 16 bytes of 4-bit codes; `w = d·q + m`
    Q4_1,
    /// 6: blocks of 32 with a 5th bit plane (not dequantised here)
    Q5_0,
    /// 7: (not dequantised here)
    Q5_1,
    /// 8: blocks of 32: f16 `d` + 32 × i8; `w = d·q`
    Q8_0,
    /// 9: (not dequantised here)
    Q8_1,
    /// 10: k-quant super-blocks of 256 (not dequantised here)
    Q2K,
    /// 11
    Q3K,
    /// 12
    Q4K,
    /// 13
    Q5K,
    /// 14
    Q6K,
    /// 15
    Q8K,
    /// 30: bfloat16
    BF16,
    /// Any other id; its size is unknown to this reader.
    Other(u32),
}

impl GgmlType {
    /// Maps the numeric id stored in the file.
    pub fn from_id(id: u32) -> Self {
        match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            9 => GgmlType::Q8_1,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            15 => GgmlType::Q8K,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// `(weights per block, bytes per block)` from `ggml.c`'s `type_traits`; `None` for unknown ids.
    pub fn block_layout(self) -> Option<(u64, u64)> {
        Some(match self {
            GgmlType::F32 => (1, 4),
            GgmlType::F16 | GgmlType::BF16 => (1, 2),
            GgmlType::Q4_0 => (32, 18),
            GgmlType::Q4_1 => (32, 20),
            GgmlType::Q5_0 => (32, 22),
            GgmlType::Q5_1 => (32, 24),
            GgmlType::Q8_0 => (32, 34),
            GgmlType::Q8_1 => (32, 36),
            GgmlType::Q2K => (256, 84),
            GgmlType::Q3K => (256, 110),
            GgmlType::Q4K => (256, 144),
            GgmlType::Q5K => (256, 176),
            GgmlType::Q6K => (256, 210),
            GgmlType::Q8K => (256, 292),
            GgmlType::Other(_) => return None,
        })
    }

    /// Whether [`dequantize`] handles this type.
    pub fn is_supported(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q8_0
                | GgmlType::Q4_0
                | GgmlType::Q4_1
        )
    }
}

/// One entry of the tensor-info table.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensorInfo {
    /// The name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions as stored: innermost (contiguous) first, so a linear weight is `[in, out]`.
    pub dims: Vec<u64>,
    /// Element / block type.
    pub ggml_type: GgmlType,
    /// Byte offset relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// The shape in torch order (outermost first): a linear weight is `[out, in]`.
    pub fn torch_shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }

    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Size of the stored data in bytes; `None` for an unknown type or a row length that is not
    /// a whole number of blocks.
    pub fn nbytes(&self) -> Option<u64> {
        let (block, bytes) = self.ggml_type.block_layout()?;
        let inner = *self.dims.first().unwrap_or(&1);
        if inner % block != 0 {
            return None;
        }
        Some(self.numel() / block * bytes)
    }
}

/// An open, memory-mapped GGUF file: metadata, tensor infos and zero-copy access to tensor bytes.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    version: u32,
    metadata: BTreeMap<String, GgufValue>,
    tensors: Vec<GgufTensorInfo>,
    index: BTreeMap<String, usize>,
    data_start: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_start", &self.data_start)
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.to_path_buf(),
            msg: format!("{} (at byte {})", msg.into(), self.pos),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(self.err(format!(
                "truncated: need {n} more bytes, file has {}",
                self.buf.len()
            ))),
        }
    }

    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }

    fn len(&mut self, what: &str) -> Result<usize> {
        let n = self.u64()?;
        // Any count larger than the file cannot be honest.
        if n > self.buf.len() as u64 {
            return Err(self.err(format!("{what} {n} exceeds the file size")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.len("string length")?;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| self.err(format!("string is not UTF-8: {e}")))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.arr::<1>()?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.arr()?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => GgufValue::Bool(self.arr::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(self.err("arrays nested deeper than 4 levels"));
                }
                let item_ty = self.u32()?;
                let n = self.len("array length")?;
                let mut items = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    items.push(self.value(item_ty, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, parsing the header, the metadata and the tensor infos.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be opened or mapped; [`Error::Gguf`] when the magic is
    /// not `GGUF`, the version is not 2 or 3, the file is truncated, or a tensor's data lies
    /// outside the file.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        // SAFETY: the map is read-only; the file must not be truncated while mapped (a documented
        // requirement of memory-mapped model files, as in llama.cpp and safetensors).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        Self::parse(path, mmap)
    }

    fn parse(path: PathBuf, mmap: Mmap) -> Result<Self> {
        let mut c = Cursor {
            buf: &mmap,
            pos: 0,
            path: &path,
        };
        let magic = c.arr::<4>()?;
        if &magic != b"GGUF" {
            return Err(c.err(format!("bad magic {magic:?}, expected \"GGUF\"")));
        }
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(c.err(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        let n_tensors = c.len("tensor count")?;
        let n_kv = c.len("metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        let mut index = BTreeMap::new();
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims > 8 {
                return Err(c.err(format!("tensor `{name}` has {n_dims} dims")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let ggml_type = GgmlType::from_id(c.u32()?);
            let offset = c.u64()?;
            index.insert(name.clone(), tensors.len());
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i64() {
                Some(a) if a > 0 => a as u64,
                _ => {
                    return Err(c.err(format!("general.alignment {v:?} is not a positive integer")));
                }
            },
        };
        let pos = c.pos as u64;
        let data_start = pos.div_ceil(alignment) * alignment;
        let file_len = mmap.len() as u64;
        for t in &tensors {
            if let Some(n) = t.nbytes() {
                let end = data_start
                    .checked_add(t.offset)
                    .and_then(|s| s.checked_add(n));
                if end.is_none_or(|e| e > file_len) {
                    return Err(Error::Gguf {
                        path: path.clone(),
                        msg: format!(
                            "tensor `{}` ({} bytes at offset {}) lies outside the file ({file_len} bytes)",
                            t.name, n, t.offset
                        ),
                    });
                }
            }
        }
        Ok(Self {
            path,
            mmap,
            version,
            metadata,
            tensors,
            index,
            data_start,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.metadata
    }

    /// The tensor infos in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.tensors
    }

    /// Byte offset of the data section from the start of the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }

    /// The info of the tensor called `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn meta_err(&self, key: &str, msg: impl Into<String>) -> Error {
        Error::Metadata {
            path: self.path.clone(),
            key: key.to_string(),
            msg: msg.into(),
        }
    }

    /// An integer metadata value.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is absent or not an integer.
    pub fn get_i64(&self, key: &str) -> Result<i64> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        v.as_i64()
            .ok_or_else(|| self.meta_err(key, format!("expected an integer, found {v:?}")))
    }

    /// A numeric metadata value as `f64`.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is absent or not numeric.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        v.as_f64()
            .ok_or_else(|| self.meta_err(key, format!("expected a number, found {v:?}")))
    }

    /// A string metadata value.
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is absent or not a string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        v.as_str()
            .ok_or_else(|| self.meta_err(key, "expected a string"))
    }

    /// A string-array metadata value (e.g. `tokenizer.ggml.tokens`).
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is absent or not an array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        let a = v
            .as_array()
            .ok_or_else(|| self.meta_err(key, "expected an array"))?;
        a.iter()
            .map(|x| {
                x.as_str()
                    .ok_or_else(|| self.meta_err(key, "expected an array of strings"))
            })
            .collect()
    }

    /// An integer-array metadata value (e.g. `tokenizer.ggml.token_type`).
    ///
    /// # Errors
    /// [`Error::Metadata`] when the key is absent or not an array of integers.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.get(key).ok_or_else(|| self.meta_err(key, "missing"))?;
        let a = v
            .as_array()
            .ok_or_else(|| self.meta_err(key, "expected an array"))?;
        a.iter()
            .map(|x| {
                x.as_i64()
                    .ok_or_else(|| self.meta_err(key, "expected an array of integers"))
            })
            .collect()
    }

    /// The raw stored bytes of tensor `name` (blocks exactly as in the file), borrowed from the map.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when absent; [`Error::Unsupported`] when its type's size is unknown.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&GgufTensorInfo, &[u8])> {
        let info = self.tensor_info(name).ok_or_else(|| Error::MissingTensor {
            name: name.to_string(),
            path: self.path.clone(),
        })?;
        let n = info.nbytes().ok_or_else(|| Error::Unsupported {
            what: "GGUF tensor type",
            value: format!(
                "{:?} (tensor `{name}`, dims {:?})",
                info.ggml_type, info.dims
            ),
            hint: "its block size is unknown to this reader".into(),
        })?;
        // Bounds were checked in `parse`.
        let start = (self.data_start + info.offset) as usize;
        Ok((info, &self.mmap[start..start + n as usize]))
    }

    /// Tensor `name` dequantised to `f32`, in row-major torch order (shape [`GgufTensorInfo::torch_shape`]).
    ///
    /// # Errors
    /// As [`GgufFile::tensor_bytes`], plus [`Error::Unsupported`] for types [`dequantize`] lacks.
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<i64>, Vec<f32>)> {
        let (info, raw) = self.tensor_bytes(name)?;
        let v = dequantize(info.ggml_type, raw, info.numel() as usize).map_err(|e| match e {
            Error::Unsupported { what, value, hint } => Error::Unsupported {
                what,
                value: format!("{value} (tensor `{name}`)"),
                hint,
            },
            e => e,
        })?;
        Ok((info.torch_shape(), v))
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Dequantises `n` weights stored as `ty` in `raw` to `f32`, in storage order.
///
/// Formulas from `ggml-quants.c`: `Q8_0`: `w = d·q` (q i8); `Q4_0`: `w[j] = d·((b[j] & 0xF) − 8)`,
/// `w[j+16] = d·((b[j] >> 4) − 8)`; `Q4_1`: `w[j] = d·(b[j] & 0xF) + m`, `w[j+16] = d·(b[j] >> 4) + m`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `raw` has the wrong length for `n`; [`Error::Unsupported`] for
/// other types (k-quants, Q5_*, …).
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Result<Vec<f32>> {
    let (block, bytes) = ty.block_layout().ok_or_else(|| Error::Unsupported {
        what: "GGUF tensor type",
        value: format!("{ty:?}"),
        hint: "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1".into(),
    })?;
    let (block, bytes) = (block as usize, bytes as usize);
    if n % block != 0 || raw.len() != n / block * bytes {
        return Err(Error::InvalidArgument(format!(
            "{ty:?}: {} bytes cannot hold {n} weights ({bytes} bytes per {block})",
            raw.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    match ty {
        GgmlType::F32 => out.extend(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        GgmlType::F16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        GgmlType::BF16 => out.extend(
            raw.chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        GgmlType::Q8_0 => {
            for b in raw.chunks_exact(34) {
                let d = f16_at(b, 0);
                out.extend(b[2..34].iter().map(|&q| d * f32::from(q as i8)));
            }
        }
        GgmlType::Q4_0 => {
            for b in raw.chunks_exact(18) {
                let d = f16_at(b, 0);
                let q = &b[2..18];
                out.extend(q.iter().map(|&x| d * (f32::from(x & 0x0F) - 8.0)));
                out.extend(q.iter().map(|&x| d * (f32::from(x >> 4) - 8.0)));
            }
        }
        GgmlType::Q4_1 => {
            for b in raw.chunks_exact(20) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let q = &b[4..20];
                out.extend(q.iter().map(|&x| d * f32::from(x & 0x0F) + m));
                out.extend(q.iter().map(|&x| d * f32::from(x >> 4) + m));
            }
        }
        other => {
            return Err(Error::Unsupported {
                what: "GGUF tensor type",
                value: format!("{other:?}"),
                hint: "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1; re-quantize the file with llama.cpp's \
                       llama-quantize to one of them"
                    .into(),
            });
        }
    }
    Ok(out)
}

/// Reorders the rows of a row-major stored matrix (`rows` rows of equal byte length), e.g. to
/// undo llama.cpp's Q/K permutation on still-quantised block data: output row `r` is input row
/// `src_row(r)`.
///
/// # Errors
/// [`Error::InvalidArgument`] when `raw` is not a whole number of rows or `src_row` leaves the range.
pub fn permute_rows(raw: &[u8], rows: usize, src_row: impl Fn(usize) -> usize) -> Result<Vec<u8>> {
    if rows == 0 || raw.len() % rows != 0 {
        return Err(Error::InvalidArgument(format!(
            "{} bytes are not {rows} equal rows",
            raw.len()
        )));
    }
    let row_bytes = raw.len() / rows;
    let mut out = Vec::with_capacity(raw.len());
    for r in 0..rows {
        let s = src_row(r);
        if s >= rows {
            return Err(Error::InvalidArgument(format!(
                "source row {s} out of range 0..{rows}"
            )));
        }
        out.extend_from_slice(&raw[s * row_bytes..(s + 1) * row_bytes]);
    }
    Ok(out)
}

/// The source row (in llama.cpp's stored order) of HF row `r` of a Q or K projection with
/// `n_head` heads of `head_dim` rows each.
///
/// llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel.permute`) stores
/// `w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2)`: HF row `h·hd + j·hd/2 + i` is stored at
/// `h·hd + 2i + j`. The inverse, applied here, is
/// `w.reshape(n_head, hd/2, 2, in).transpose(1, 2).reshape(out, in)`.
pub fn unpermute_qk_src_row(r: usize, head_dim: usize) -> usize {
    let half = head_dim / 2;
    let h = r / head_dim;
    let within = r % head_dim;
    let (j, i) = (within / half, within % half);
    h * head_dim + 2 * i + j
}

#[cfg(test)]
mod tests {
    use super::*;

    fn push_str(b: &mut Vec<u8>, s: &str) {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    }

    /// A tiny GGUF v3 file written by hand: two KVs (a string array and a u32), one F32 tensor.
    fn tiny_gguf(alignment: Option<u32>) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        let n_kv = if alignment.is_some() { 3u64 } else { 2 };
        b.extend_from_slice(&n_kv.to_le_bytes());
        push_str(&mut b, "tokenizer.ggml.tokens");
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        push_str(&mut b, "a");
        push_str(&mut b, "bc");
        push_str(&mut b, "llama.block_count");
        b.extend_from_slice(&4u32.to_le_bytes());
        b.extend_from_slice(&30u32.to_le_bytes());
        if let Some(a) = alignment {
            push_str(&mut b, "general.alignment");
            b.extend_from_slice(&4u32.to_le_bytes());
            b.extend_from_slice(&a.to_le_bytes());
        }
        push_str(&mut b, "w");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&3u64.to_le_bytes()); // inner
        b.extend_from_slice(&2u64.to_le_bytes()); // outer
        b.extend_from_slice(&0u32.to_le_bytes()); // F32
        b.extend_from_slice(&0u64.to_le_bytes());
        let align = alignment.unwrap_or(32) as usize;
        while b.len() % align != 0 {
            b.push(0);
        }
        for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b
    }

    fn write_tmp(bytes: &[u8]) -> tempfile::NamedTempFile {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn parses_hand_written_file() {
        for alignment in [None, Some(64)] {
            let f = write_tmp(&tiny_gguf(alignment));
            let g = GgufFile::open(f.path()).unwrap();
            assert_eq!(g.version(), 3);
            assert_eq!(
                g.get_str_array("tokenizer.ggml.tokens").unwrap(),
                vec!["a", "bc"]
            );
            assert_eq!(g.get_i64("llama.block_count").unwrap(), 30);
            assert_eq!(g.data_start() % alignment.unwrap_or(32) as u64, 0);
            let (shape, v) = g.tensor_f32("w").unwrap();
            assert_eq!(shape, vec![2, 3]);
            assert_eq!(v, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
            assert!(matches!(
                g.tensor_f32("nope"),
                Err(Error::MissingTensor { .. })
            ));
            assert!(matches!(
                g.get_str("llama.block_count"),
                Err(Error::Metadata { .. })
            ));
        }
    }

    #[test]
    fn rejects_bad_magic_and_truncation() {
        let mut b = tiny_gguf(None);
        let f = write_tmp(&b[..b.len() - 4]);
        let e = GgufFile::open(f.path()).unwrap_err().to_string();
        assert!(e.contains("outside the file"), "{e}");
        b[0] = b'X';
        let f = write_tmp(&b);
        assert!(
            GgufFile::open(f.path())
                .unwrap_err()
                .to_string()
                .contains("bad magic")
        );
        let f = write_tmp(&b"GGUF\x03\x00\x00\x00"[..]);
        assert!(
            GgufFile::open(f.path())
                .unwrap_err()
                .to_string()
                .contains("truncated")
        );
    }

    #[test]
    fn dequantizes_blocks_by_the_ggml_formulas() {
        // Q8_0: d = 0.5, q = -16..16
        let mut b = half::f16::from_f32(0.5).to_le_bytes().to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let v = dequantize(GgmlType::Q8_0, &b, 32).unwrap();
        assert_eq!(v[0], -8.0);
        assert_eq!(v[31], 7.5);
        // Q4_0: d = 2, low nibble j, high nibble 15 - j
        let mut b = half::f16::from_f32(2.0).to_le_bytes().to_vec();
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize(GgmlType::Q4_0, &b, 32).unwrap();
        assert_eq!(v[0], -16.0);
        assert_eq!(v[15], 14.0);
        assert_eq!(v[16], 14.0);
        assert_eq!(v[31], -16.0);
        // Q4_1: d = 0.25, m = -1
        let mut b = half::f16::from_f32(0.25).to_le_bytes().to_vec();
        b.extend(half::f16::from_f32(-1.0).to_le_bytes());
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let v = dequantize(GgmlType::Q4_1, &b, 32).unwrap();
        assert_eq!(v[3], -0.25);
        assert_eq!(v[16], 2.75);
        assert!(dequantize(GgmlType::Q4_1, &b[..19], 32).is_err());
        assert!(matches!(
            dequantize(GgmlType::Q4K, &[0; 144], 256),
            Err(Error::Unsupported { .. })
        ));
    }

    #[test]
    fn unpermute_inverts_the_converter_permutation() {
        // Converter: stored = w.reshape(n_head, 2, hd/2, in).swapaxes(1, 2) — i.e. stored row
        // (h, i, j) = HF row (h, j, i). Build it and check we get the HF order back.
        let (n_head, hd) = (3usize, 8usize);
        let hf: Vec<usize> = (0..n_head * hd).collect();
        let mut stored = vec![0usize; hf.len()];
        for h in 0..n_head {
            for j in 0..2 {
                for i in 0..hd / 2 {
                    stored[h * hd + i * 2 + j] = hf[h * hd + j * hd / 2 + i];
                }
            }
        }
        let raw: Vec<u8> = stored.iter().map(|&x| x as u8).collect();
        let back = permute_rows(&raw, hf.len(), |r| unpermute_qk_src_row(r, hd)).unwrap();
        assert_eq!(back, hf.iter().map(|&x| x as u8).collect::<Vec<_>>());
    }
}
