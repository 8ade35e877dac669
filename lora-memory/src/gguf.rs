//! A header-only GGUF reader (versions 2 and 3).
//!
//! Layout (ggml `docs/gguf.md`, little endian): magic `"GGUF"`, `version: u32`,
//! `tensor_count: u64`, `metadata_kv_count: u64`, then `metadata_kv_count` pairs
//! `(key: string, value_type: u32, value)`, then `tensor_count` infos
//! `(name: string, n_dims: u32, dims: [u64; n_dims], ggml_type: u32, offset: u64)`.
//! A string is `len: u64` + UTF-8 bytes; an array is `elem_type: u32, len: u64, elems`.
//! Array payloads (e.g. the 49,152-token vocabulary) are skipped by seeking, never allocated.

use crate::error::{Error, Result};
use crate::model::{DecoderDescriptor, ModelDescriptor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// Longest string accepted (keys, names, scalar string values such as a chat template).
const MAX_STRING: u64 = 16 << 20;
/// Most tensors / metadata pairs accepted.
const MAX_ITEMS: u64 = 1 << 24;

/// A metadata value. Arrays keep only their element type and length.
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
    /// An array whose payload was skipped.
    Array {
        /// GGUF value-type code of the elements (8 = string, …).
        elem_type: u32,
        /// Number of elements.
        len: u64,
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

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
}

/// One tensor info record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GgufTensorInfo {
    /// Tensor name (`blk.0.attn_q.weight`).
    pub name: String,
    /// Dimensions, innermost first (`[in, out]` for a weight; the torch shape is the reverse).
    pub dims: Vec<u64>,
    /// ggml type code (0 F32, 1 F16, 2 Q4_0, 3 Q4_1, 8 Q8_0, 30 BF16, …).
    pub ggml_type: u32,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (product of dims).
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of the stored data, from the ggml block size of its type; `None` for an unknown type.
    pub fn stored_bytes(&self) -> Option<u64> {
        let (block, bytes) = ggml_block(self.ggml_type)?;
        Some(self.elements().div_ceil(block) * bytes)
    }
}

/// (elements per block, bytes per block) of a ggml type (ggml `ggml.c` type traits).
pub fn ggml_block(t: u32) -> Option<(u64, u64)> {
    Some(match t {
        0 => (1, 4),      // F32
        1 => (1, 2),      // F16
        2 => (32, 18),    // Q4_0: f16 d + 16 bytes
        3 => (32, 20),    // Q4_1: f16 d + f16 m + 16 bytes
        6 => (32, 22),    // Q5_0
        7 => (32, 24),    // Q5_1
        8 => (32, 34),    // Q8_0: f16 d + 32 × i8
        9 => (32, 36),    // Q8_1
        10 => (256, 84),  // Q2_K
        11 => (256, 110), // Q3_K
        12 => (256, 144), // Q4_K
        13 => (256, 176), // Q5_K
        14 => (256, 210), // Q6_K
        15 => (256, 292), // Q8_K
        24 => (1, 1),     // I8
        25 => (1, 2),     // I16
        26 => (1, 4),     // I32
        27 => (1, 8),     // I64
        28 => (1, 8),     // F64
        30 => (1, 2),     // BF16
        _ => return None,
    })
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
}

struct Reader {
    inner: BufReader<File>,
    pos: u64,
    path: PathBuf,
    file_len: u64,
}

impl Reader {
    fn err(&self, reason: impl Into<String>) -> Error {
        Error::Gguf {
            path: self.path.clone(),
            offset: self.pos,
            reason: reason.into(),
        }
    }

    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.inner
            .read_exact(&mut b)
            .map_err(|e| self.err(format!("truncated file ({e})")))?;
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
            return Err(self.err(format!(
                "a length of {n} bytes runs past the end of the file"
            )));
        }
        let step = i64::try_from(n).map_err(|_| self.err("length too large"))?;
        self.inner
            .seek_relative(step)
            .map_err(|e| self.err(format!("seek failed ({e})")))?;
        self.pos += n;
        Ok(())
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u64()?;
        if len > MAX_STRING || self.pos.saturating_add(len) > self.file_len {
            return Err(self.err(format!("string length {len} is implausible")));
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

    fn value(&mut self, t: u32) -> Result<GgufValue> {
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
            9 => {
                let elem_type = self.u32()?;
                let len = self.u64()?;
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
                        self.value(elem_type)?;
                    }
                }
                GgufValue::Array { elem_type, len }
            }
            10 => GgufValue::UInt(self.u64()?),
            11 => GgufValue::Int(i64::from_le_bytes(self.bytes::<8>()?)),
            12 => GgufValue::Float(f64::from_le_bytes(self.bytes::<8>()?)),
            other => return Err(self.err(format!("unknown metadata value type {other}"))),
        })
    }
}

/// Reads the header of a GGUF file: metadata and tensor infos, no tensor data.
///
/// # Errors
/// [`Error::Io`] when the file cannot be opened; [`Error::Gguf`] (with the byte offset) for a bad
/// magic, version 1 (pre-2023 files: re-convert with a current llama.cpp), a truncated file or an
/// implausible length.
pub fn read_header(path: impl AsRef<Path>) -> Result<GgufHeader> {
    let path = path.as_ref();
    let file = File::open(path).map_err(|source| Error::Io {
        path: path.into(),
        source,
    })?;
    let file_len = file
        .metadata()
        .map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?
        .len();
    let mut r = Reader {
        inner: BufReader::with_capacity(1 << 16, file),
        pos: 0,
        path: path.into(),
        file_len,
    };
    let magic = r.bytes::<4>()?;
    if &magic != b"GGUF" {
        return Err(Error::Gguf {
            path: path.into(),
            offset: 0,
            reason: format!("magic {magic:?} is not \"GGUF\""),
        });
    }
    let version = r.u32()?;
    if !(2..=3).contains(&version) {
        return Err(r.err(format!(
            "version {version} is not supported (2 and 3 are); re-convert with a current llama.cpp"
        )));
    }
    let tensor_count = r.u64()?;
    let kv_count = r.u64()?;
    if tensor_count > MAX_ITEMS || kv_count > MAX_ITEMS {
        return Err(r.err(format!(
            "implausible counts: {tensor_count} tensors, {kv_count} metadata pairs"
        )));
    }
    let mut metadata = BTreeMap::new();
    for _ in 0..kv_count {
        let key = r.string()?;
        let t = r.u32()?;
        let v = r.value(t)?;
        metadata.insert(key, v);
    }
    let mut tensors = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        let name = r.string()?;
        let n_dims = r.u32()?;
        if n_dims > 8 {
            return Err(r.err(format!("tensor {name:?} has {n_dims} dims")));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(r.u64()?);
        }
        let ggml_type = r.u32()?;
        let offset = r.u64()?;
        tensors.push(GgufTensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        header_bytes: r.pos,
    })
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
        Err(e) => match h.metadata.get("tokenizer.ggml.tokens") {
            Some(GgufValue::Array { len, .. }) => *len,
            _ => return Err(e),
        },
    };
    let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
    let name = h
        .metadata
        .get("general.name")
        .and_then(GgufValue::as_str)
        .unwrap_or(arch.as_str())
        .to_string();
    let mut d = DecoderDescriptor::new(
        &name,
        hidden,
        get("feed_forward_length")?,
        get("block_count")?,
        heads,
        kv_heads,
        head_dim,
        vocab,
        tied,
    );
    d.attention_bias = h.tensors.iter().any(|t| t.name.ends_with("attn_q.bias"));
    d.qk_norm = h
        .tensors
        .iter()
        .any(|t| t.name.ends_with("attn_q_norm.weight"));
    d.params = h.tensors.iter().map(GgufTensorInfo::elements).sum();
    Ok(ModelDescriptor::Decoder(d))
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
        match v {
            GgufValue::UInt(x) => {
                b.extend_from_slice(&4u32.to_le_bytes());
                b.extend_from_slice(&(*x as u32).to_le_bytes());
            }
            GgufValue::Int(x) => {
                b.extend_from_slice(&11u32.to_le_bytes());
                b.extend_from_slice(&x.to_le_bytes());
            }
            GgufValue::Float(x) => {
                b.extend_from_slice(&6u32.to_le_bytes());
                b.extend_from_slice(&(*x as f32).to_le_bytes());
            }
            GgufValue::Bool(x) => {
                b.extend_from_slice(&7u32.to_le_bytes());
                b.push(u8::from(*x));
            }
            GgufValue::String(x) => {
                b.extend_from_slice(&8u32.to_le_bytes());
                s(&mut b, x);
            }
            GgufValue::Array { len, .. } => {
                b.extend_from_slice(&9u32.to_le_bytes());
                b.extend_from_slice(&5u32.to_le_bytes());
                b.extend_from_slice(&len.to_le_bytes());
                for i in 0..*len {
                    b.extend_from_slice(&(i as i32).to_le_bytes());
                }
            }
        }
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
        b.extend_from_slice(&t.ggml_type.to_le_bytes());
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

    fn tiny(path: &Path) {
        let tensors = vec![
            GgufTensorInfo {
                name: "token_embd.weight".into(),
                dims: vec![64, 100],
                ggml_type: 8,
                offset: 0,
            },
            GgufTensorInfo {
                name: "blk.0.attn_q.weight".into(),
                dims: vec![64, 64],
                ggml_type: 3,
                offset: 7000,
            },
            GgufTensorInfo {
                name: "blk.0.attn_norm.weight".into(),
                dims: vec![64],
                ggml_type: 0,
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
        assert_eq!(d.params, 6400 + 4096 + 64);
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
}
