//! Memory-mapped GGUF files (llama.cpp's model container): zero-copy tensor bytes and their
//! dequantisation to `f32`.
//!
//! The header (metadata, tensor table, data offset) is parsed by [`lora_memory::gguf`], the one
//! GGUF header reader of the workspace, with arrays kept (the tokenizer's vocabulary and merges);
//! its types are re-exported here. The layout is documented there.
//!
//! Dequantisation to `f32`: `F32`, `F16`, `BF16` here; the block formats (`Q8_0`, `Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`, `Q6_K`) through lora-core's reference decoder
//! ([`lora_core::quant::dequantize_gguf_reference`], after `ggml/src/ggml-quants.c`).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{Error, Result};

pub use lora_memory::gguf::{
    DEFAULT_ALIGNMENT, GgmlType, GgufHeader, GgufTensorInfo, GgufValue, HeaderOptions,
};

/// Whether [`dequantize`] handles `ty`.
pub fn is_dequantizable(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        || lora_core::quant::QuantKind::from_ggml_type(ty.id()).is_some()
}

/// An open, memory-mapped GGUF file: metadata, tensor infos and zero-copy access to tensor bytes.
pub struct GgufFile {
    path: PathBuf,
    mmap: Mmap,
    header: GgufHeader,
    index: BTreeMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.header.version)
            .field("metadata_keys", &self.header.metadata.len())
            .field("tensors", &self.header.tensors.len())
            .field("data_start", &self.header.data_start)
            .finish()
    }
}

/// This crate's error for an error of the header reader.
fn header_error(e: lora_memory::Error, path: &Path) -> Error {
    match e {
        lora_memory::Error::Gguf {
            path,
            offset,
            reason,
        } => Error::Gguf {
            path,
            msg: format!("{reason} (at byte {offset})"),
        },
        lora_memory::Error::Io { path, source } => Error::Io { path, source },
        other => Error::Gguf {
            path: path.into(),
            msg: other.to_string(),
        },
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, parsing the header, the metadata (arrays kept) and the
    /// tensor infos with [`lora_memory::gguf::parse_header`].
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
        let header = lora_memory::gguf::parse_header(&mmap, &path, HeaderOptions::full())
            .map_err(|e| header_error(e, &path))?;
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            mmap,
            header,
            index,
        })
    }

    /// The parsed header.
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.header.version
    }

    /// All metadata, by key.
    pub fn metadata(&self) -> &BTreeMap<String, GgufValue> {
        &self.header.metadata
    }

    /// The tensor infos in file order.
    pub fn tensors(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    /// Byte offset of the data section from the start of the file.
    pub fn data_start(&self) -> u64 {
        self.header.data_start
    }

    /// The info of the tensor called `name`, if present.
    pub fn tensor_info(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.index
            .get(name)
            .and_then(|&i| self.header.tensors.get(i))
    }

    /// One metadata value, if present.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.header.metadata.get(key)
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
        let n = info.stored_bytes().ok_or_else(|| Error::Unsupported {
            what: "GGUF tensor type",
            value: format!(
                "{:?} (tensor `{name}`, dims {:?})",
                info.ggml_type, info.dims
            ),
            hint: "its block size is unknown to this reader".into(),
        })?;
        // Extents were checked when the header was parsed.
        let start = self.header.data_start + info.offset;
        let bytes = usize::try_from(start)
            .ok()
            .and_then(|s| self.mmap.get(s..s.checked_add(n as usize)?))
            .ok_or_else(|| Error::Gguf {
                path: self.path.clone(),
                msg: format!("tensor `{name}` ({n} bytes at byte {start}) lies outside the file"),
            })?;
        Ok((info, bytes))
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

const SUPPORTED: &str = "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K";

/// Dequantises `n` weights stored as `ty` in `raw` to `f32`, in storage order.
///
/// Block formats: [`lora_core::quant::dequantize_gguf_reference`] (formulas of `ggml-quants.c`,
/// listed in `lora_core::quant`).
///
/// # Errors
/// [`Error::InvalidArgument`] when `raw` has the wrong length for `n`; [`Error::Unsupported`] for
/// other types (Q2_K, Q3_K, IQ*, …).
pub fn dequantize(ty: GgmlType, raw: &[u8], n: usize) -> Result<Vec<f32>> {
    let unsupported = || Error::Unsupported {
        what: "GGUF tensor type",
        value: format!("{ty:?}"),
        hint: format!(
            "supported: {SUPPORTED}; re-quantize the file with llama.cpp's llama-quantize to one of them"
        ),
    };
    let (block, bytes) = ty.block_layout().ok_or_else(unsupported)?;
    let (block, bytes) = (block as usize, bytes as usize);
    if !n.is_multiple_of(block) || raw.len() != n / block * bytes {
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
        other => {
            let kind =
                lora_core::quant::QuantKind::from_ggml_type(other.id()).ok_or_else(unsupported)?;
            out = lora_core::quant::dequantize_gguf_reference(kind, raw)?;
        }
    }
    Ok(out)
}

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
        // k-quants decode (lora-core's reference); Q3_K does not
        assert_eq!(
            dequantize(GgmlType::Q4K, &[0; 144], 256).unwrap(),
            vec![0.0; 256]
        );
        assert!(matches!(
            dequantize(GgmlType::Q3K, &[0; 110], 256),
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
