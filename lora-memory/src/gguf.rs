//! The GGUF header reader of the workspace (versions 2 and 3): metadata, tensor table and the
//! offset of the data section — everything before the tensor data, which it never reads.
//!
//! Layout (ggml `docs/gguf.md`, little endian):
//! ```text
//! u32 magic "GGUF" | u32 version | u64 tensor_count | u64 metadata_kv_count
//! metadata_kv_count × { string key | u32 value_type | value }
//! tensor_count × { string name | u32 n_dims | u64 dims[n_dims] (innermost first) | u32 ggml_type | u64 offset }
//! padding to `general.alignment` (default 32)
//! tensor data; each tensor at data_start + offset
//! ```
//! A string is `len: u64` + UTF-8 bytes (not NUL-terminated); an array is
//! `elem_type: u32, len: u64, elems`.
//!
//! Two ways to read arrays ([`HeaderOptions::keep_arrays`]): the planner's [`read_header`] skips
//! their payloads (e.g. the 49,152-token vocabulary) and keeps only element type and length
//! ([`GgufValue::Array`]); a model loader that builds a tokenizer keeps them
//! ([`GgufValue::ArrayItems`]), e.g. through [`parse_header`] over a memory-mapped file.

use crate::error::{Error, Result};
use crate::model::{DecoderDescriptor, ModelDescriptor};
use crate::settings::BaseDtype;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::ops::Range;
use std::path::Path;

/// Longest string accepted (keys, names, scalar string values such as a chat template).
const MAX_STRING: u64 = 16 << 20;
/// Most tensors / metadata pairs accepted.
const MAX_ITEMS: u64 = 1 << 24;
/// Deepest nesting of arrays accepted (llama.cpp writes none).
const MAX_DEPTH: u32 = 4;
/// Most elements of a metadata array accepted (a tokenizer's vocabulary has a few 100k).
const MAX_ARRAY: u64 = 1 << 32;

/// The default tensor-data alignment when `general.alignment` is absent (`gguf.md`).
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value. Integers and floats of every width are widened to 64 bits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum GgufValue {
    /// Any unsigned integer type (u8 … u64).
    UInt(u64),
    /// Any signed integer type (i8 … i64).
    Int(i64),
    /// f32 or f64.
    Float(f64),
    /// bool.
    Bool(bool),
    /// string.
    String(String),
    /// An array whose payload was skipped (the default of [`read_header`]).
    Array {
        /// GGUF value-type code of the elements (8 = string, …).
        elem_type: u32,
        /// Number of elements.
        len: u64,
    },
    /// An array read in full ([`HeaderOptions::keep_arrays`]).
    ArrayItems {
        /// GGUF value-type code of the elements (8 = string, …).
        elem_type: u32,
        /// The elements, in file order.
        items: Vec<GgufValue>,
    },
}

impl GgufValue {
    /// The value as an unsigned integer, when it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            GgufValue::UInt(v) => Some(*v),
            GgufValue::Int(v) if *v >= 0 => Some(*v as u64),
            _ => None,
        }
    }

    /// The value as a signed integer, when it is an integer that fits or a bool (0 or 1).
    pub fn as_i64(&self) -> Option<i64> {
        match self {
            GgufValue::UInt(v) => i64::try_from(*v).ok(),
            GgufValue::Int(v) => Some(*v),
            GgufValue::Bool(v) => Some(i64::from(*v)),
            _ => None,
        }
    }

    /// The value as a float, when it is any number (or a bool, as [`GgufValue::as_i64`]).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            GgufValue::Float(v) => Some(*v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements of an array read in full; `None` for other values and skipped arrays.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::ArrayItems { items, .. } => Some(items),
            _ => None,
        }
    }

    /// The number of elements of an array, skipped or read.
    pub fn array_len(&self) -> Option<u64> {
        match self {
            GgufValue::Array { len, .. } => Some(*len),
            GgufValue::ArrayItems { items, .. } => Some(items.len() as u64),
            _ => None,
        }
    }
}

/// A tensor element / block type of ggml (`enum ggml_type` in `ggml.h`). Compares equal to its
/// numeric id (`GgmlType::Q4_1 == 3`) and serializes as that id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "u32", into = "u32")]
pub enum GgmlType {
    /// 0: f32
    F32,
    /// 1: IEEE f16
    F16,
    /// 2: blocks of 32: f16 scale `d` + 16 bytes of 4-bit codes; `w = d·(q − 8)`
    Q4_0,
    /// 3: blocks of 32: f16 `d`, f16 `m` + 16 bytes of 4-bit codes; `w = d·q + m`
    Q4_1,
    /// 6: blocks of 32 with a 5th bit plane
    Q5_0,
    /// 7: blocks of 32 with a 5th bit plane and a minimum
    Q5_1,
    /// 8: blocks of 32: f16 `d` + 32 × i8; `w = d·q`
    Q8_0,
    /// 9: blocks of 32: f16 `d`, f16 `s` + 32 × i8
    Q8_1,
    /// 10: k-quant super-blocks of 256
    Q2K,
    /// 11: k-quant super-blocks of 256
    Q3K,
    /// 12: k-quant super-blocks of 256
    Q4K,
    /// 13: k-quant super-blocks of 256
    Q5K,
    /// 14: k-quant super-blocks of 256
    Q6K,
    /// 15: k-quant super-blocks of 256 (intermediate format)
    Q8K,
    /// 24: i8
    I8,
    /// 25: i16
    I16,
    /// 26: i32
    I32,
    /// 27: i64
    I64,
    /// 28: f64
    F64,
    /// 30: bfloat16
    BF16,
    /// Any other id; its size is unknown to this reader.
    Other(u32),
}

// The mapping lives beside the GGUF types it reads, so that `settings` needs nothing of this
// module.
impl BaseDtype {
    /// The storage type of a GGUF tensor type, for the types the estimator describes (`None` for
    /// the others: Q2_K, Q3_K, Q8_1, Q8_K, integers).
    pub fn from_ggml(t: GgmlType) -> Option<BaseDtype> {
        match t {
            GgmlType::F32 => Some(BaseDtype::F32),
            GgmlType::F16 => Some(BaseDtype::F16),
            GgmlType::BF16 => Some(BaseDtype::Bf16),
            GgmlType::Q8_0 => Some(BaseDtype::Q8_0),
            GgmlType::Q4_0 => Some(BaseDtype::Q4_0),
            GgmlType::Q4_1 => Some(BaseDtype::Q4_1),
            GgmlType::Q5_0 => Some(BaseDtype::Q5_0),
            GgmlType::Q5_1 => Some(BaseDtype::Q5_1),
            GgmlType::Q4K => Some(BaseDtype::Q4K),
            GgmlType::Q5K => Some(BaseDtype::Q5K),
            GgmlType::Q6K => Some(BaseDtype::Q6K),
            _ => None,
        }
    }
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
            24 => GgmlType::I8,
            25 => GgmlType::I16,
            26 => GgmlType::I32,
            27 => GgmlType::I64,
            28 => GgmlType::F64,
            30 => GgmlType::BF16,
            other => GgmlType::Other(other),
        }
    }

    /// The numeric id stored in the file.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q8_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Q8K => 15,
            GgmlType::I8 => 24,
            GgmlType::I16 => 25,
            GgmlType::I32 => 26,
            GgmlType::I64 => 27,
            GgmlType::F64 => 28,
            GgmlType::BF16 => 30,
            GgmlType::Other(id) => id,
        }
    }

    /// `(elements per block, bytes per block)` from ggml's `type_traits` (`ggml.c`); `None` for
    /// an unknown id.
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
            GgmlType::I8 => (1, 1),
            GgmlType::I16 => (1, 2),
            GgmlType::I32 => (1, 4),
            GgmlType::I64 | GgmlType::F64 => (1, 8),
            GgmlType::Other(_) => return None,
        })
    }
}

impl From<u32> for GgmlType {
    fn from(id: u32) -> Self {
        GgmlType::from_id(id)
    }
}

impl From<GgmlType> for u32 {
    fn from(t: GgmlType) -> Self {
        t.id()
    }
}

impl PartialEq<u32> for GgmlType {
    fn eq(&self, id: &u32) -> bool {
        self.id() == *id
    }
}

/// One tensor info record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GgufTensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions as stored: innermost (contiguous) first, so a linear weight is `[in, out]`
    /// (the torch shape is the reverse, [`GgufTensorInfo::torch_shape`]).
    pub dims: Vec<u64>,
    /// Element / block type.
    pub ggml_type: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (product of dims).
    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in torch order (outermost first): a linear weight is `[out, in]`.
    pub fn torch_shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }

    /// Bytes of the stored data, from the block layout of its type; `None` for an unknown type
    /// or a row (innermost dim) that is not a whole number of blocks.
    pub fn stored_bytes(&self) -> Option<u64> {
        let (block, bytes) = self.ggml_type.block_layout()?;
        let inner = self.dims.first().copied().unwrap_or(1);
        if inner % block != 0 {
            return None;
        }
        self.numel().checked_div(block)?.checked_mul(bytes)
    }
}

/// How much of the header [`read_header_with`] / [`parse_header`] keep and check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HeaderOptions {
    /// Read array payloads into [`GgufValue::ArrayItems`] (the tokenizer's vocabulary and merges:
    /// ~100k strings for SmolLM2). Default `false`: [`GgufValue::Array`] with type and length.
    pub keep_arrays: bool,
    /// Check that the data of every tensor of a known type lies inside the file. Default `false`
    /// (a header-only copy of a file still plans).
    pub check_extents: bool,
}

impl HeaderOptions {
    /// Everything a model loader needs: arrays kept, tensor extents checked.
    pub fn full() -> Self {
        HeaderOptions {
            keep_arrays: true,
            check_extents: true,
        }
    }

    /// With [`HeaderOptions::keep_arrays`] set to `keep`.
    pub fn with_arrays(self, keep: bool) -> Self {
        HeaderOptions {
            keep_arrays: keep,
            ..self
        }
    }

    /// With [`HeaderOptions::check_extents`] set to `check`.
    pub fn with_extents(self, check: bool) -> Self {
        HeaderOptions {
            check_extents: check,
            ..self
        }
    }
}

/// The parsed header of a GGUF file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata pairs by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Bytes read (the header length before alignment padding).
    pub header_bytes: u64,
    /// Tensor-data alignment (`general.alignment`, default [`DEFAULT_ALIGNMENT`]).
    pub alignment: u64,
    /// Byte offset of the data section from the start of the file: `header_bytes` rounded up to
    /// `alignment`. A tensor's data starts at `data_start + offset`.
    pub data_start: u64,
}

impl GgufHeader {
    /// The absolute byte range of a tensor's data in the file; `None` when its size is unknown
    /// (see [`GgufTensorInfo::stored_bytes`]) or the range overflows.
    pub fn data_range(&self, t: &GgufTensorInfo) -> Option<Range<u64>> {
        let start = self.data_start.checked_add(t.offset)?;
        Some(start..start.checked_add(t.stored_bytes()?)?)
    }
}

struct Reader<'p, R> {
    inner: R,
    pos: u64,
    path: &'p Path,
    file_len: u64,
    keep_arrays: bool,
}

impl<R: Read> Reader<'_, R> {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.into(),
            offset: self.pos,
            reason: reason.into(),
        }
    }

    /// The error for `what` (with its size: "a string of 20 bytes") that starts inside the file
    /// and ends past its end.
    fn truncated(&self, what: &str) -> Error {
        if self.file_len == 0 {
            return self.err("the file is empty (0 bytes); fetch it again");
        }
        self.err(format!(
            "the file is truncated: {what} runs past its end at byte {} (an incomplete download \
             or copy?); fetch the file again",
            self.file_len
        ))
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if self.pos.saturating_add(N as u64) > self.file_len {
            return Err(self.truncated(&format!("a value of {N} bytes")));
        }
        self.inner
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("read failed ({e})")))?;
        self.pos += N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes::<4>()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes::<8>()?))
    }

    fn skip(&mut self, n: u64) -> Result<()> {
        if self.pos.saturating_add(n) > self.file_len {
            return Err(self.truncated(&format!("a value of {n} bytes")));
        }
        let skipped = std::io::copy(&mut (&mut self.inner).take(n), &mut std::io::sink())
            .map_err(|e| self.err(format!("read failed ({e})")))?;
        if skipped != n {
            return Err(self.err(format!("truncated file ({skipped} of {n} bytes)")));
        }
        self.pos += n;
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.err(format!("string length {len} is implausible")));
        }
        if self.pos.saturating_add(len) > self.file_len {
            return Err(self.truncated(&format!("a string of {len} bytes")));
        }
        let mut buf = vec![0u8; len as usize];
        self.inner
            .read_exact(&mut buf)
            .map_err(|e| self.err(format!("truncated string ({e})")))?;
        self.pos += len;
        String::from_utf8(buf).map_err(|_| self.err("string is not UTF-8"))
    }

    fn scalar_size(t: u32) -> Option<u64> {
        Some(match t {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            _ => return None,
        })
    }

    fn value(&mut self, t: u32, depth: u32) -> Result<GgufValue> {
        Ok(match t {
            0 => GgufValue::UInt(u64::from(self.bytes::<1>()?[0])),
            1 => GgufValue::Int(i64::from(i8::from_le_bytes(self.bytes::<1>()?))),
            2 => GgufValue::UInt(u64::from(u16::from_le_bytes(self.bytes::<2>()?))),
            3 => GgufValue::Int(i64::from(i16::from_le_bytes(self.bytes::<2>()?))),
            4 => GgufValue::UInt(u64::from(self.u32()?)),
            5 => GgufValue::Int(i64::from(i32::from_le_bytes(self.bytes::<4>()?))),
            6 => GgufValue::Float(f64::from(f32::from_le_bytes(self.bytes::<4>()?))),
            7 => GgufValue::Bool(self.bytes::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => self.array(depth)?,
            10 => GgufValue::UInt(self.u64()?),
            11 => GgufValue::Int(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.bytes::<8>()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }

    fn array(&mut self, depth: u32) -> Result<GgufValue> {
        if depth >= MAX_DEPTH {
            return Err(self.err(format!("arrays nested deeper than {MAX_DEPTH} levels")));
        }
        let elem_type = self.u32()?;
        let len = self.u64()?;
        // Every element takes at least one byte.
        if len > MAX_ARRAY {
            return Err(self.err(format!("array length {len} is implausible")));
        }
        if self.pos.saturating_add(len) > self.file_len {
            return Err(self.truncated(&format!("an array of {len} elements")));
        }
        if self.keep_arrays {
            let mut items = Vec::with_capacity(len.min(1 << 16) as usize);
            for _ in 0..len {
                items.push(self.value(elem_type, depth + 1)?);
            }
            return Ok(GgufValue::ArrayItems { elem_type, items });
        }
        if let Some(size) = Self::scalar_size(elem_type) {
            let total = len
                .checked_mul(size)
                .ok_or_else(|| self.err("array too large"))?;
            self.skip(total)?;
        } else if elem_type == 8 {
            for _ in 0..len {
                let l = self.u64()?;
                self.skip(l)?;
            }
        } else {
            // Nested arrays are legal but unused by llama.cpp; walk them.
            for _ in 0..len {
                self.value(elem_type, depth + 1)?;
            }
        }
        Ok(GgufValue::Array { elem_type, len })
    }

    fn header(mut self, options: HeaderOptions) -> Result<GgufHeader> {
        let magic = self.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(Error::Gguf {
                path: self.path.into(),
                offset: 0,
                reason: format!("bad magic {magic:?}, expected \"GGUF\""),
            });
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(self.err(format!(
                "version {version} is not supported (2 and 3 are); re-convert with a current llama.cpp"
            )));
        }
        let tensor_count = self.u64()?;
        let kv_count = self.u64()?;
        if tensor_count > MAX_ITEMS || kv_count > MAX_ITEMS {
            return Err(self.err(format!(
                "implausible counts: {tensor_count} tensors, {kv_count} metadata pairs"
            )));
        }
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = self.string()?;
            let t = self.u32()?;
            let v = self.value(t, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(tensor_count.min(1 << 16) as usize);
        for _ in 0..tensor_count {
            let name = self.string()?;
            let n_dims = self.u32()?;
            if n_dims > 8 {
                return Err(self.err(format!("tensor {name:?} has {n_dims} dims")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(self.u64()?);
            }
            let ggml_type = GgmlType::from_id(self.u32()?);
            let offset = self.u64()?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ggml_type,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 => a,
                _ => {
                    return Err(
                        self.err(format!("general.alignment {v:?} is not a positive integer"))
                    );
                }
            },
        };
        let header_bytes = self.pos;
        let h = GgufHeader {
            version,
            metadata,
            tensors,
            header_bytes,
            alignment,
            data_start: header_bytes.div_ceil(alignment) * alignment,
        };
        if options.check_extents {
            for t in &h.tensors {
                let Some(n) = t.stored_bytes() else { continue };
                match h.data_range(t) {
                    Some(r) if r.end <= self.file_len => {}
                    _ => {
                        return Err(Error::Gguf {
                            path: self.path.into(),
                            offset: h.data_start.saturating_add(t.offset),
                            reason: format!(
                                "the file is truncated: tensor `{}` ({n} bytes from byte {}) \
                                 lies outside the file, which ends at byte {} (an incomplete \
                                 download or copy?); fetch it again",
                                t.name,
                                h.data_start.saturating_add(t.offset),
                                self.file_len
                            ),
                        });
                    }
                }
            }
        }
        Ok(h)
    }
}

/// Reads the header of a GGUF file: metadata (array payloads skipped) and tensor infos, no
/// tensor data. The planner's entry point; see [`read_header_with`] to keep arrays.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Gguf`] (with the byte offset) for a bad
/// magic, version 1 (pre-2023 files: re-convert with a current llama.cpp), a truncated file or an
/// implausible length.
pub fn read_header(path: impl AsRef<Path>) -> Result<GgufHeader> {
    read_header_with(path, HeaderOptions::default())
}

/// Reads the header of a GGUF file (buffered reads, no tensor data) with `options`.
///
/// # Errors
/// As [`read_header`], plus [`Error::Gguf`] for a tensor outside the file with
/// [`HeaderOptions::check_extents`].
pub fn read_header_with(path: impl AsRef<Path>, options: HeaderOptions) -> Result<GgufHeader> {
    let path = path.as_ref();
    let io = |source| Error::Io {
        path: path.into(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    let file_len = file.metadata().map_err(io)?.len();
    Reader {
        inner: BufReader::with_capacity(1 << 16, file),
        pos: 0,
        path,
        file_len,
        keep_arrays: options.keep_arrays,
    }
    .header(options)
}

/// Parses the header at the start of `bytes`, the whole file (e.g. a memory map of it); `path`
/// only names the file in errors.
///
/// # Errors
/// As [`read_header_with`], without [`Error::Io`].
pub fn parse_header(bytes: &[u8], path: &Path, options: HeaderOptions) -> Result<GgufHeader> {
    Reader {
        inner: bytes,
        pos: 0,
        path,
        file_len: bytes.len() as u64,
        keep_arrays: options.keep_arrays,
    }
    .header(options)
}

impl ModelDescriptor {
    /// Reads only the header of a GGUF file and derives a decoder descriptor from its metadata
    /// (`<arch>.block_count`, `.embedding_length`, `.feed_forward_length`, `.attention.head_count`,
    /// `.attention.head_count_kv`, `.rope.dimension_count`, `.vocab_size` or the token-list
    /// length) and tensor infos (parameter count = sum of tensor elements; tied embeddings when no
    /// `output.weight`).
    ///
    /// # Errors
    /// See [`crate::gguf::read_header`]; [`Error::Config`] for a missing metadata key.
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<ModelDescriptor> {
        descriptor_from_gguf(path.as_ref())
    }
}

pub(crate) fn descriptor_from_gguf(path: &Path) -> Result<ModelDescriptor> {
    let h = read_header(path)?;
    let arch = h
        .metadata
        .get("general.architecture")
        .and_then(GgufValue::as_str)
        .unwrap_or("")
        .to_string();
    const SUPPORTED: &[&str] = &["llama", "mistral", "qwen2", "qwen3", "smollm3"];
    // FLUX transformers as ComfyUI users hold them (city96's GGUF files: architecture "flux",
    // BFL's tensor names, dims innermost first)
    if arch == "flux"
        || (arch.is_empty()
            && h.tensors
                .iter()
                .any(|t| t.name.starts_with("double_blocks.")))
    {
        let shapes: Vec<(&str, Vec<u64>)> = h
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dims.clone()))
            .collect();
        let params = h.tensors.iter().map(GgufTensorInfo::numel).sum();
        // the bytes each tensor holds once loaded as stored: lora-core keeps block types
        // quantized (k-quants with their sub-block scales unpacked), f16/bf16/f32 as they are
        let stored = h
            .tensors
            .iter()
            .map(|t| match BaseDtype::from_ggml(t.ggml_type) {
                Some(d) => Some((t.numel() as f64 * d.bytes_per_param()).ceil() as u64),
                None => t.stored_bytes(),
            })
            .sum::<Option<u64>>();
        let it = shapes.iter().map(|(k, s)| (*k, s.as_slice()));
        if let Some(d) = crate::flux::FluxDescriptor::from_tensor_names(path, it, params, stored)? {
            return Ok(ModelDescriptor::Flux(d));
        }
    }
    if !SUPPORTED.contains(&arch.as_str()) {
        return Err(Error::UnsupportedArchitecture {
            path: path.into(),
            arch,
            hint: format!("GGUF architectures {} are described", SUPPORTED.join(", ")),
        });
    }
    let get = |k: &str| -> Result<u64> {
        let key = format!("{arch}.{k}");
        h.metadata
            .get(&key)
            .and_then(GgufValue::as_u64)
            .ok_or_else(|| Error::Config {
                path: path.into(),
                key,
                reason: "missing or not an integer in the GGUF metadata".into(),
            })
    };
    let hidden = get("embedding_length")?;
    let heads = get("attention.head_count")?;
    if heads == 0 {
        return Err(Error::Config {
            path: path.into(),
            key: format!("{arch}.attention.head_count"),
            reason: "is zero".into(),
        });
    }
    let kv_heads = get("attention.head_count_kv").unwrap_or(heads);
    let head_dim = h
        .metadata
        .get(&format!("{arch}.attention.key_length"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(hidden / heads);
    let vocab = match get("vocab_size") {
        Ok(v) => v,
        Err(e) => match h
            .metadata
            .get("tokenizer.ggml.tokens")
            .and_then(GgufValue::array_len)
        {
            Some(len) => len,
            None => return Err(e),
        },
    };
    let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
    let name = h
        .metadata
        .get("general.name")
        .and_then(GgufValue::as_str)
        .unwrap_or(arch.as_str())
        .to_string();
    let d = DecoderDescriptor::builder(&name)
        .hidden(hidden)
        .intermediate(get("feed_forward_length")?)
        .layers(get("block_count")?)
        .heads(heads)
        .kv_heads(kv_heads)
        .head_dim(head_dim)
        .vocab(vocab)
        .tied_embeddings(tied)
        .attention_bias(h.tensors.iter().any(|t| t.name.ends_with("attn_q.bias")))
        .qk_norm(
            h.tensors
                .iter()
                .any(|t| t.name.ends_with("attn_q_norm.weight")),
        )
        .exact_params(h.tensors.iter().map(GgufTensorInfo::numel).sum())
        .build()
        .map_err(|e| Error::Config {
            path: path.into(),
            key: format!("{arch}.attention.head_count_kv"),
            reason: e.to_string(),
        })?;
    Ok(ModelDescriptor::Decoder(d))
}

/// The value type code [`write_test_file`] writes for `v`.
fn test_value_type(v: &GgufValue) -> u32 {
    match v {
        GgufValue::UInt(_) => 4,
        GgufValue::Int(_) => 11,
        GgufValue::Float(_) => 6,
        GgufValue::Bool(_) => 7,
        GgufValue::String(_) => 8,
        GgufValue::Array { .. } | GgufValue::ArrayItems { .. } => 9,
    }
}

/// Writes the payload of `v` as [`write_test_file`] does: `UInt` as u32, `Int` as i64, `Float` as
/// f32, a skipped `Array` as `len` i32s `0..len`, `ArrayItems` with the type code of its first item.
fn put_test_value(b: &mut Vec<u8>, v: &GgufValue) {
    match v {
        GgufValue::UInt(x) => b.extend_from_slice(&(*x as u32).to_le_bytes()),
        GgufValue::Int(x) => b.extend_from_slice(&x.to_le_bytes()),
        GgufValue::Float(x) => b.extend_from_slice(&(*x as f32).to_le_bytes()),
        GgufValue::Bool(x) => b.push(u8::from(*x)),
        GgufValue::String(x) => {
            b.extend_from_slice(&(x.len() as u64).to_le_bytes());
            b.extend_from_slice(x.as_bytes());
        }
        GgufValue::Array { len, .. } => {
            b.extend_from_slice(&5u32.to_le_bytes());
            b.extend_from_slice(&len.to_le_bytes());
            for i in 0..*len {
                b.extend_from_slice(&(i as i32).to_le_bytes());
            }
        }
        GgufValue::ArrayItems { elem_type, items } => {
            let t = items.first().map_or(*elem_type, test_value_type);
            b.extend_from_slice(&t.to_le_bytes());
            b.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                put_test_value(b, it);
            }
        }
    }
}

/// Test helper and format documentation in code: writes a GGUF v3 file with the given metadata
/// and tensor infos (data section zero-filled, 32-byte aligned).
#[doc(hidden)]
pub fn write_test_file(
    path: &Path,
    metadata: &[(&str, GgufValue)],
    tensors: &[GgufTensorInfo],
    string_array: Option<(&str, &[&str])>,
) -> std::io::Result<()> {
    let mut b: Vec<u8> = Vec::new();
    let s = |b: &mut Vec<u8>, x: &str| {
        b.extend_from_slice(&(x.len() as u64).to_le_bytes());
        b.extend_from_slice(x.as_bytes());
    };
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    let kv = metadata.len() + usize::from(string_array.is_some());
    b.extend_from_slice(&(kv as u64).to_le_bytes());
    for (k, v) in metadata {
        s(&mut b, k);
        b.extend_from_slice(&test_value_type(v).to_le_bytes());
        put_test_value(&mut b, v);
    }
    if let Some((k, items)) = string_array {
        s(&mut b, k);
        b.extend_from_slice(&9u32.to_le_bytes());
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&(items.len() as u64).to_le_bytes());
        for it in items {
            s(&mut b, it);
        }
    }
    for t in tensors {
        s(&mut b, &t.name);
        b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&t.ggml_type.id().to_le_bytes());
        b.extend_from_slice(&t.offset.to_le_bytes());
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    std::fs::write(path, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_types_in_memory_follow_the_block_sizes() {
        // the GGUF types' in-memory sizes follow the file's block sizes (ggml type traits), the
        // k-quants' 12 packed scale bytes held as 16
        for (t, extra) in [
            (GgmlType::Q5_0, 0.0),
            (GgmlType::Q5_1, 0.0),
            (GgmlType::Q4K, 4.0),
            (GgmlType::Q5K, 4.0),
            (GgmlType::Q6K, 0.0),
        ] {
            let (w, b) = t.block_layout().unwrap();
            let d = BaseDtype::from_ggml(t).unwrap();
            assert_eq!(d.bytes_per_param(), (b as f64 + extra) / w as f64, "{t:?}");
            assert!(d.is_quantized());
        }
    }

    fn tiny(path: &Path) {
        let tensors = vec![
            GgufTensorInfo {
                name: "token_embd.weight".into(),
                dims: vec![64, 100],
                ggml_type: GgmlType::Q8_0,
                offset: 0,
            },
            GgufTensorInfo {
                name: "blk.0.attn_q.weight".into(),
                dims: vec![64, 64],
                ggml_type: GgmlType::Q4_1,
                offset: 7000,
            },
            GgufTensorInfo {
                name: "blk.0.attn_norm.weight".into(),
                dims: vec![64],
                ggml_type: GgmlType::F32,
                offset: 9600,
            },
        ];
        write_test_file(
            path,
            &[
                ("general.architecture", GgufValue::String("llama".into())),
                ("llama.block_count", GgufValue::UInt(1)),
                ("llama.embedding_length", GgufValue::UInt(64)),
                ("llama.feed_forward_length", GgufValue::UInt(128)),
                ("llama.attention.head_count", GgufValue::UInt(4)),
                ("llama.attention.head_count_kv", GgufValue::UInt(2)),
                ("llama.rope.freq_base", GgufValue::Float(10000.0)),
                ("general.flag", GgufValue::Bool(true)),
                (
                    "general.ids",
                    GgufValue::Array {
                        elem_type: 5,
                        len: 10,
                    },
                ),
            ],
            &tensors,
            Some(("tokenizer.ggml.tokens", &["a"; 100])),
        )
        .unwrap();
    }

    #[test]
    fn reads_a_written_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        tiny(&p);
        let h = read_header(&p).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.tensors.len(), 3);
        assert_eq!(h.tensors[1].dims, vec![64, 64]);
        assert_eq!(h.tensors[1].stored_bytes(), Some(64 * 64 / 32 * 20));
        assert_eq!(
            h.metadata["tokenizer.ggml.tokens"],
            GgufValue::Array {
                elem_type: 8,
                len: 100
            }
        );
        assert_eq!(h.metadata["general.flag"], GgufValue::Bool(true));
        assert_eq!(
            h.metadata["llama.rope.freq_base"],
            GgufValue::Float(10000.0)
        );
        let ModelDescriptor::Decoder(d) = descriptor_from_gguf(&p).unwrap() else {
            panic!()
        };
        assert_eq!(
            (d.hidden, d.heads, d.kv_heads, d.head_dim, d.vocab),
            (64, 4, 2, 16, 100)
        );
        assert!(d.tied_embeddings);
        assert_eq!(d.params(), 6400 + 4096 + 64);
    }

    #[test]
    fn truncated_and_foreign_files_are_errors_with_offsets() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        tiny(&p);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..100]).unwrap();
        let e = read_header(&p).unwrap_err();
        assert!(matches!(e, Error::Gguf { .. }), "{e}");
        std::fs::write(&p, b"GGML\x03\0\0\0").unwrap();
        assert!(read_header(&p).unwrap_err().to_string().contains("magic"));
        let mut v1 = full.clone();
        v1[4] = 1;
        std::fs::write(&p, &v1).unwrap();
        assert!(
            read_header(&p)
                .unwrap_err()
                .to_string()
                .contains("version 1")
        );
        // Cut anywhere inside the header: the error says the file is truncated, where.
        std::fs::write(&p, &full).unwrap();
        let header = read_header(&p).unwrap().header_bytes as usize;
        for cut in (8..header).step_by(5) {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = read_header(&p).unwrap_err().to_string();
            assert!(
                e.contains("truncated") && e.contains(&format!("at byte {cut}")),
                "{cut}: {e}"
            );
        }
        // cut inside the tensor data: the loaders' check of the extents says so
        std::fs::write(&p, &full[..full.len() - 1]).unwrap();
        assert!(read_header(&p).is_ok(), "the planner reads headers only");
        let e = read_header_with(&p, HeaderOptions::full())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("outside the file") && e.contains("truncated"),
            "{e}"
        );
        // A huge string length must not allocate.
        let mut huge = full[..24].to_vec();
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&p, &huge).unwrap();
        assert!(
            read_header(&p)
                .unwrap_err()
                .to_string()
                .contains("implausible")
        );
    }

    #[test]
    fn arrays_are_kept_on_request_and_bytes_parse_like_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        tiny(&p);
        let bytes = std::fs::read(&p).unwrap();
        let h = parse_header(&bytes, &p, HeaderOptions::full().with_extents(false)).unwrap();
        assert_eq!(
            h,
            read_header_with(&p, HeaderOptions::full().with_extents(false)).unwrap()
        );
        let tokens = h.metadata["tokenizer.ggml.tokens"].as_array().unwrap();
        assert_eq!(tokens.len(), 100);
        assert_eq!(tokens[0], GgufValue::String("a".into()));
        assert_eq!(h.metadata["general.ids"].array_len(), Some(10));
        assert_eq!(
            h.metadata["general.ids"].as_array().unwrap()[9].as_i64(),
            Some(9)
        );
        // Only the arrays differ from the planner's read.
        let skipped = read_header(&p).unwrap();
        assert_eq!(skipped.tensors, h.tensors);
        assert_eq!(skipped.data_start, h.data_start);
        assert_eq!(
            skipped.metadata["tokenizer.ggml.tokens"].array_len(),
            Some(100)
        );
        assert_eq!(h.alignment, DEFAULT_ALIGNMENT);
        assert_eq!(h.data_start % 32, 0);
        assert!(h.data_start >= h.header_bytes);
        let r = h.data_range(&h.tensors[1]).unwrap();
        assert_eq!(r, h.data_start + 7000..h.data_start + 7000 + 2560);
        // The written file has no data section: an extents check refuses it.
        let e = parse_header(&bytes, &p, HeaderOptions::full()).unwrap_err();
        assert!(e.to_string().contains("outside the file"), "{e}");
    }

    #[test]
    fn ggml_types_round_trip_their_ids() {
        for id in 0..40 {
            assert_eq!(GgmlType::from_id(id).id(), id);
            assert_eq!(GgmlType::from_id(id), id);
        }
        assert_eq!(GgmlType::Q4_1.block_layout(), Some((32, 20)));
        assert_eq!(GgmlType::Other(99).block_layout(), None);
        let json = serde_json::to_string(&GgmlType::Q8_0).unwrap();
        assert_eq!(json, "8");
        assert_eq!(
            serde_json::from_str::<GgmlType>(&json).unwrap(),
            GgmlType::Q8_0
        );
    }
}
