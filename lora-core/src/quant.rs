//! Frozen weights kept quantized in memory and dequantized per forward with tensor ops.
//!
//! Supported layouts:
//! - GGUF block formats (llama.cpp `ggml-common.h` / `ggml-quants.c`), 32 weights per block along the
//!   input dimension, little endian:
//!   - `Q8_0`: f16 `d` + 32 × i8 `q`; `w = d·q` (34 bytes / 32 weights = 1.0625 bytes/param).
//!   - `Q4_0`: f16 `d` + 16 bytes; `w[j] = d·((q[j] & 0xF) − 8)`, `w[j+16] = d·((q[j] >> 4) − 8)`
//!     (18 bytes / 32 = 0.5625 bytes/param).
//!   - `Q4_1`: f16 `d` + f16 `m` + 16 bytes; `w[j] = d·(q[j] & 0xF) + m`, `w[j+16] = d·(q[j] >> 4) + m`
//!     (20 bytes / 32 = 0.625 bytes/param).
//! - NF4 (QLoRA, Dettmers et al. 2023, arXiv:2305.14314): blocks of 64 consecutive weights of the
//!   row-major flattened matrix, one absmax per block, 4-bit indices into the NormalFloat table
//!   [`NF4_TABLE`], two indices per byte (first one in the high nibble, as bitsandbytes packs them).
//!   With double quantization (paper §3 "Double Quantization") the f32 absmax constants are themselves
//!   quantized to 8 bits in blocks of 256 after subtracting their mean. The paper stores the second
//!   level as FP8; we use a symmetric linear int8 code with one f32 scale per 256 constants, which has
//!   the same footprint (0.5 + 8/64/8 + 4/(64·256) ≈ 0.5159 bytes/param, the paper's 4.127 bits).

use crate::error::{Error, Result, TchContext};
use half::f16;
use tch::{Device, Kind, Tensor};

/// Weights per GGUF block (`QK8_0 = QK4_0 = QK4_1 = 32` in llama.cpp's `ggml-common.h`).
pub const GGUF_BLOCK: usize = 32;
/// Weights per NF4 block (QLoRA's block size for the first quantization level).
pub const NF4_BLOCK: usize = 64;
/// Absmax constants per second-level block with double quantization (QLoRA §3).
pub const NF4_DQ_BLOCK: usize = 256;

/// The 16 NormalFloat-4 code values (QLoRA, arXiv:2305.14314, Appendix E; identical to bitsandbytes'
/// `NF4` table). Built from quantiles of N(0, 1), normalized to [-1, 1], with an exact zero.
pub const NF4_TABLE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// How a frozen weight is quantized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(non_camel_case_types)]
pub enum QuantKind {
    /// GGUF `Q8_0` (type id 8): f16 scale + 32 × i8 per block.
    Q8_0,
    /// GGUF `Q4_0` (type id 2): f16 scale + 32 × 4-bit (offset 8) per block.
    Q4_0,
    /// GGUF `Q4_1` (type id 3): f16 scale + f16 min + 32 × 4-bit per block.
    Q4_1,
    /// QLoRA NormalFloat-4, block 64, optional double quantization of the absmax constants.
    Nf4 {
        /// Quantize the per-block absmax constants to 8 bits (blocks of 256).
        double_quant: bool,
    },
}

impl QuantKind {
    /// Bytes of one GGUF block of 32 weights, or `None` for NF4 (not a GGUF type).
    pub fn gguf_block_bytes(self) -> Option<usize> {
        match self {
            QuantKind::Q8_0 => Some(2 + 32),
            QuantKind::Q4_0 => Some(2 + 16),
            QuantKind::Q4_1 => Some(2 + 2 + 16),
            QuantKind::Nf4 { .. } => None,
        }
    }

    /// The GGML type id (`ggml.h`: Q4_0 = 2, Q4_1 = 3, Q8_0 = 8), or `None` for NF4.
    pub fn ggml_type(self) -> Option<u32> {
        match self {
            QuantKind::Q4_0 => Some(2),
            QuantKind::Q4_1 => Some(3),
            QuantKind::Q8_0 => Some(8),
            QuantKind::Nf4 { .. } => None,
        }
    }

    /// The kind for a GGML type id, if it is one of ours.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        match id {
            2 => Some(QuantKind::Q4_0),
            3 => Some(QuantKind::Q4_1),
            8 => Some(QuantKind::Q8_0),
            _ => None,
        }
    }

    fn name(self) -> String {
        format!("{self:?}")
    }
}

fn qerr(kind: QuantKind, reason: impl Into<String>) -> Error {
    Error::Quant {
        kind: kind.name(),
        reason: reason.into(),
    }
}

fn f16_at(raw: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([raw[at], raw[at + 1]])).to_f32()
}

/// Plain-Rust reference dequantization of GGUF block data (no tensors involved).
///
/// `raw` is the tensor's bytes exactly as stored in a GGUF file (a whole number of blocks); the result
/// has `32 · blocks` values in file order (row-major, `in` fastest). Formulas: see the module docs
/// (llama.cpp `dequantize_row_q8_0` / `_q4_0` / `_q4_1`).
///
/// # Errors
/// [`Error::Quant`] when `raw` is not a whole number of blocks or `kind` is NF4 (not a GGUF type;
/// use [`nf4_reference_dequantize`]).
pub fn dequantize_gguf_reference(kind: QuantKind, raw: &[u8]) -> Result<Vec<f32>> {
    let bb = kind.gguf_block_bytes().ok_or_else(|| {
        qerr(
            kind,
            "NF4 is not a GGUF block type; use nf4_reference_dequantize",
        )
    })?;
    if raw.len() % bb != 0 {
        return Err(qerr(
            kind,
            format!(
                "{} bytes is not a whole number of {bb}-byte blocks",
                raw.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(raw.len() / bb * GGUF_BLOCK);
    for block in raw.chunks_exact(bb) {
        let d = f16_at(block, 0);
        match kind {
            QuantKind::Q8_0 => {
                out.extend(block[2..].iter().map(|&q| d * f32::from(q as i8)));
            }
            QuantKind::Q4_0 => {
                let qs = &block[2..];
                out.extend(qs.iter().map(|&q| d * (f32::from(q & 0xF) - 8.0)));
                out.extend(qs.iter().map(|&q| d * (f32::from(q >> 4) - 8.0)));
            }
            QuantKind::Q4_1 => {
                let m = f16_at(block, 2);
                let qs = &block[4..];
                out.extend(qs.iter().map(|&q| d * f32::from(q & 0xF) + m));
                out.extend(qs.iter().map(|&q| d * f32::from(q >> 4) + m));
            }
            QuantKind::Nf4 { .. } => unreachable_nf4()?,
        }
    }
    Ok(out)
}

fn unreachable_nf4<T>() -> Result<T> {
    Err(qerr(
        QuantKind::Nf4 {
            double_quant: false,
        },
        "not a GGUF block type",
    ))
}

/// Plain-Rust reference NF4 dequantization: `w[i] = NF4_TABLE[code_i] · absmax[i / 64]`, codes packed
/// two per byte, the first in the high nibble. `absmax` is the (already de-double-quantized) f32 block
/// constant list, one per 64 weights.
///
/// # Errors
/// [`Error::Quant`] when `codes.len() · 2 != absmax.len() · 64`.
pub fn nf4_reference_dequantize(codes: &[u8], absmax: &[f32]) -> Result<Vec<f32>> {
    if codes.len() * 2 != absmax.len() * NF4_BLOCK {
        return Err(qerr(
            QuantKind::Nf4 {
                double_quant: false,
            },
            format!(
                "{} code bytes do not match {} blocks of 64",
                codes.len(),
                absmax.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(codes.len() * 2);
    for (i, &c) in codes.iter().enumerate() {
        let s = absmax[i * 2 / NF4_BLOCK];
        out.push(NF4_TABLE[usize::from(c >> 4)] * s);
        out.push(NF4_TABLE[usize::from(c & 0xF)] * s);
    }
    Ok(out)
}

/// Quantizes `x` (a whole number of 32-blocks) to GGUF bytes with llama.cpp's reference algorithms
/// (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`, `quantize_row_q4_1_ref` in `ggml-quants.c`).
///
/// # Errors
/// [`Error::Quant`] for NF4 or a length that is not a multiple of 32.
pub fn quantize_gguf_reference(kind: QuantKind, x: &[f32]) -> Result<Vec<u8>> {
    let bb = kind
        .gguf_block_bytes()
        .ok_or_else(|| qerr(kind, "NF4 is not a GGUF block type"))?;
    if x.len() % GGUF_BLOCK != 0 {
        return Err(qerr(
            kind,
            format!("{} values is not a multiple of 32", x.len()),
        ));
    }
    let mut out = Vec::with_capacity(x.len() / GGUF_BLOCK * bb);
    for b in x.chunks_exact(GGUF_BLOCK) {
        match kind {
            QuantKind::Q8_0 => {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_bits().to_le_bytes());
                out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
            }
            QuantKind::Q4_0 => {
                let (mut amax, mut max) = (0f32, 0f32);
                for &v in b {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_bits().to_le_bytes());
                for j in 0..16 {
                    // (int8_t) casts truncate toward zero, as in C.
                    let x0 = ((b[j] * id + 8.5) as i8).min(15) as u8;
                    let x1 = ((b[j + 16] * id + 8.5) as i8).min(15) as u8;
                    out.push(x0 | (x1 << 4));
                }
            }
            QuantKind::Q4_1 => {
                let min = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16::from_f32(d).to_bits().to_le_bytes());
                out.extend(f16::from_f32(min).to_bits().to_le_bytes());
                for j in 0..16 {
                    let x0 = (((b[j] - min) * id + 0.5) as i8).min(15) as u8;
                    let x1 = (((b[j + 16] - min) * id + 0.5) as i8).min(15) as u8;
                    out.push(x0 | (x1 << 4));
                }
            }
            QuantKind::Nf4 { .. } => return unreachable_nf4(),
        }
    }
    Ok(out)
}

/// Nearest NF4 code for a value already normalized to [-1, 1].
fn nf4_code(v: f32) -> u8 {
    // Midpoints between consecutive table entries decide the nearest code.
    let mut code = 0u8;
    for i in 0..15 {
        if v > (NF4_TABLE[i] + NF4_TABLE[i + 1]) * 0.5 {
            code = i as u8 + 1;
        }
    }
    code
}

/// Quantizes `x` (a multiple of 64 values) to NF4: returns (packed codes, f32 absmax per block).
///
/// # Errors
/// [`Error::Quant`] when the length is not a multiple of 64.
pub fn nf4_quantize_reference(x: &[f32]) -> Result<(Vec<u8>, Vec<f32>)> {
    if x.len() % NF4_BLOCK != 0 {
        return Err(qerr(
            QuantKind::Nf4 {
                double_quant: false,
            },
            format!("{} values is not a multiple of 64", x.len()),
        ));
    }
    let mut codes = Vec::with_capacity(x.len() / 2);
    let mut absmax = Vec::with_capacity(x.len() / NF4_BLOCK);
    for b in x.chunks_exact(NF4_BLOCK) {
        let am = b.iter().fold(0f32, |a, v| a.max(v.abs()));
        let inv = if am > 0.0 { 1.0 / am } else { 0.0 };
        absmax.push(am);
        for pair in b.chunks_exact(2) {
            codes.push((nf4_code(pair[0] * inv) << 4) | nf4_code(pair[1] * inv));
        }
    }
    Ok((codes, absmax))
}

/// Second-level (double) quantization of NF4 absmax constants: subtract the mean, then symmetric
/// int8 per block of 256 with one f32 scale. Returns (codes padded to whole blocks, scales, offset).
fn double_quantize(absmax: &[f32]) -> (Vec<i8>, Vec<f32>, f32) {
    let n = absmax.len().max(1);
    let offset = (absmax.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64) as f32;
    let blocks = absmax.len().div_ceil(NF4_DQ_BLOCK);
    let mut q = vec![0i8; blocks * NF4_DQ_BLOCK];
    let mut scales = Vec::with_capacity(blocks);
    for (bi, chunk) in absmax.chunks(NF4_DQ_BLOCK).enumerate() {
        let amax = chunk.iter().fold(0f32, |a, &v| a.max((v - offset).abs()));
        let s = amax / 127.0;
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        scales.push(s);
        for (j, &v) in chunk.iter().enumerate() {
            q[bi * NF4_DQ_BLOCK + j] = ((v - offset) * inv).round().clamp(-127.0, 127.0) as i8;
        }
    }
    (q, scales, offset)
}

/// Inverse of the NF4 double quantization of absmax scales, in plain Rust (reference for tests).
pub fn nf4_double_dequantize_reference(
    q: &[i8],
    scales: &[f32],
    offset: f32,
    n: usize,
) -> Vec<f32> {
    (0..n)
        .map(|i| f32::from(q[i]) * scales[i / NF4_DQ_BLOCK] + offset)
        .collect()
}

/// A frozen 2-D weight `[out, in]` kept quantized in memory.
///
/// Dequantized per forward with a handful of tensor ops on the tensors' device (so it runs on the GPU
/// when the model does). Storage, by kind:
/// - GGUF kinds: `codes` `[out, in/32, 32]` i8 (Q8_0) or `[out, in/32, 16]` u8 (Q4_*), `scales`
///   `[out, in/32]` f16, `mins` `[out, in/32]` f16 (Q4_1 only).
/// - NF4: `codes` `[out·in/64, 32]` u8, `scales` `[out·in/64]` f32 absmax, or with double quantization
///   `[out·in/64]` i8 plus `dq_scales` f32 `[⌈out·in/64/256⌉]` and a scalar offset.
/// - 4-bit kinds: codes are packed as consecutive pairs (first weight in the high nibble; GGUF's
///   "j / j+16" nibble order is repacked at load) and `table` f32 `[256, 2]` (2 KiB) maps a byte to
///   its two values, so decoding is one lookup plus one multiply (or fused multiply-add).
#[derive(Debug)]
pub struct QuantWeight {
    kind: QuantKind,
    shape: [i64; 2],
    codes: Tensor,
    scales: Tensor,
    mins: Option<Tensor>,
    dq_scales: Option<Tensor>,
    dq_offset: f32,
    table: Option<Tensor>,
}

fn check_shape(kind: QuantKind, shape: [i64; 2]) -> Result<()> {
    if shape[0] <= 0 || shape[1] <= 0 {
        return Err(qerr(kind, format!("shape {shape:?} must be positive")));
    }
    match kind {
        QuantKind::Nf4 { .. } => {
            if (shape[0] * shape[1]) % NF4_BLOCK as i64 != 0 {
                return Err(qerr(
                    kind,
                    format!("shape {shape:?}: out·in must be a multiple of 64"),
                ));
            }
        }
        _ => {
            if shape[1] % GGUF_BLOCK as i64 != 0 {
                return Err(qerr(
                    kind,
                    format!(
                        "shape {shape:?}: in ({}) must be a multiple of 32",
                        shape[1]
                    ),
                ));
            }
        }
    }
    Ok(())
}

impl QuantWeight {
    /// Builds a quantized weight from a GGUF tensor's raw bytes.
    ///
    /// `raw`: the tensor data exactly as stored in the GGUF file (row-major blocks of 32 along `in`);
    /// `shape`: torch order `[out, in]` (GGUF lists dims innermost first, i.e. `[in, out]`).
    ///
    /// # Errors
    /// [`Error::Quant`] for NF4, an `in` not divisible by 32, or a byte count that does not match the
    /// shape; [`Error::Torch`] when the tensors cannot be created on `device`.
    pub fn from_gguf_blocks(
        kind: QuantKind,
        raw: &[u8],
        shape: [i64; 2],
        device: Device,
    ) -> Result<Self> {
        let bb = kind
            .gguf_block_bytes()
            .ok_or_else(|| qerr(kind, "NF4 has no GGUF block layout"))?;
        check_shape(kind, shape)?;
        let (out, inn) = (shape[0], shape[1]);
        let nb = inn / GGUF_BLOCK as i64;
        let blocks = (out * nb) as usize;
        if raw.len() != blocks * bb {
            return Err(qerr(
                kind,
                format!(
                    "shape {shape:?} needs {} bytes ({blocks} blocks of {bb}), got {}",
                    blocks * bb,
                    raw.len()
                ),
            ));
        }
        let ncode = match kind {
            QuantKind::Q8_0 => 32,
            _ => 16,
        };
        let head = bb - ncode;
        let mut d = Vec::with_capacity(blocks * 2);
        let mut m = Vec::with_capacity(if kind == QuantKind::Q4_1 {
            blocks * 2
        } else {
            0
        });
        let mut q = Vec::with_capacity(blocks * ncode);
        for block in raw.chunks_exact(bb) {
            d.extend_from_slice(&block[0..2]);
            if kind == QuantKind::Q4_1 {
                m.extend_from_slice(&block[2..4]);
            }
            let qs = &block[head..];
            if kind == QuantKind::Q8_0 {
                q.extend_from_slice(qs);
            } else {
                // GGUF keeps weight j in the low nibble of byte j and weight j+16 in its high nibble;
                // repack to consecutive pairs (weight 2k high, 2k+1 low) so one byte-indexed lookup
                // yields the weights in order.
                let nib = |j: usize| {
                    if j < 16 {
                        qs[j] & 0x0F
                    } else {
                        qs[j - 16] >> 4
                    }
                };
                q.extend((0..16).map(|k| (nib(2 * k) << 4) | nib(2 * k + 1)));
            }
        }
        let ctx = || format!("building {kind:?} tensors of shape {shape:?}");
        let code_kind = if kind == QuantKind::Q8_0 {
            Kind::Int8
        } else {
            Kind::Uint8
        };
        let codes = Tensor::f_from_data_size(&q, &[out, nb, ncode as i64], code_kind)
            .and_then(|t| t.f_to_device(device))
            .ctx(ctx)?;
        let scales = Tensor::f_from_data_size(&d, &[out, nb], Kind::Half)
            .and_then(|t| t.f_to_device(device))
            .ctx(ctx)?;
        let mins = if kind == QuantKind::Q4_1 {
            Some(
                Tensor::f_from_data_size(&m, &[out, nb], Kind::Half)
                    .and_then(|t| t.f_to_device(device))
                    .ctx(ctx)?,
            )
        } else {
            None
        };
        let table = match kind {
            QuantKind::Q8_0 => None,
            QuantKind::Q4_0 => Some(pair_lut(|c| f32::from(c) - 8.0, device).ctx(ctx)?),
            _ => Some(pair_lut(f32::from, device).ctx(ctx)?),
        };
        Ok(Self {
            kind,
            shape,
            codes,
            scales,
            mins,
            dq_scales: None,
            dq_offset: 0.0,
            table,
        })
    }

    /// Quantizes a dense 2-D weight `[out, in]` (any float dtype, any device; the result lives on the
    /// same device). GGUF kinds use llama.cpp's reference quantizers (`in` must be a multiple of 32);
    /// NF4 uses blocks of 64 over the flattened matrix (`out·in` must be a multiple of 64), nearest
    /// code, and optional double quantization (QLoRA, arXiv:2305.14314).
    ///
    /// # Errors
    /// [`Error::Shape`] when `w` is not 2-D; [`Error::Quant`] for block-size mismatches.
    pub fn quantize(w: &Tensor, kind: QuantKind) -> Result<Self> {
        let size = w.size();
        if size.len() != 2 {
            return Err(Error::Shape {
                key: "quantize input".into(),
                expected: vec![-1, -1],
                found: size,
            });
        }
        let shape = [size[0], size[1]];
        check_shape(kind, shape)?;
        let device = w.device();
        let x = to_vec_f32(w)?;
        match kind {
            QuantKind::Nf4 { double_quant } => {
                let (codes, absmax) = nf4_quantize_reference(&x)?;
                Self::from_nf4_parts(&codes, &absmax, shape, double_quant, device)
            }
            _ => {
                let raw = quantize_gguf_reference(kind, &x)?;
                Self::from_gguf_blocks(kind, &raw, shape, device)
            }
        }
    }

    /// Builds an NF4 weight from packed codes (two per byte, high nibble first) and f32 absmax per
    /// block of 64; with `double_quant` the absmax list is quantized to 8 bits here.
    ///
    /// # Errors
    /// [`Error::Quant`] when the lengths do not match `shape`.
    pub fn from_nf4_parts(
        codes: &[u8],
        absmax: &[f32],
        shape: [i64; 2],
        double_quant: bool,
        device: Device,
    ) -> Result<Self> {
        let kind = QuantKind::Nf4 { double_quant };
        check_shape(kind, shape)?;
        let numel = (shape[0] * shape[1]) as usize;
        if codes.len() * 2 != numel || absmax.len() * NF4_BLOCK != numel {
            return Err(qerr(
                kind,
                format!(
                    "shape {shape:?} needs {} code bytes and {} absmax values, got {} and {}",
                    numel / 2,
                    numel / NF4_BLOCK,
                    codes.len(),
                    absmax.len()
                ),
            ));
        }
        let ctx = || format!("building NF4 tensors of shape {shape:?}");
        let nb = (numel / NF4_BLOCK) as i64;
        let codes_t = Tensor::f_from_data_size(codes, &[nb, 32], Kind::Uint8)
            .and_then(|t| t.f_to_device(device))
            .ctx(ctx)?;
        let table = pair_lut(|c| NF4_TABLE[usize::from(c)], device).ctx(ctx)?;
        let (scales, dq_scales, dq_offset) = if double_quant {
            let (q, s, off) = double_quantize(absmax);
            // keep only the real constants (the last 256-block may be partial)
            let qb: Vec<u8> = q[..absmax.len()].iter().map(|&v| v as u8).collect();
            let qt = Tensor::f_from_data_size(&qb, &[qb.len() as i64], Kind::Int8)
                .and_then(|t| t.f_to_device(device))
                .ctx(ctx)?;
            let st = Tensor::f_from_slice(&s)
                .and_then(|t| t.f_to_device(device))
                .ctx(ctx)?;
            (qt, Some(st), off)
        } else {
            (
                Tensor::f_from_slice(absmax)
                    .and_then(|t| t.f_to_device(device))
                    .ctx(ctx)?,
                None,
                0.0,
            )
        };
        Ok(Self {
            kind,
            shape,
            codes: codes_t,
            scales,
            mins: None,
            dq_scales,
            dq_offset,
            table: Some(table),
        })
    }

    /// The quantization kind.
    pub fn kind(&self) -> QuantKind {
        self.kind
    }

    /// The logical shape `[out, in]`.
    pub fn shape(&self) -> [i64; 2] {
        self.shape
    }

    /// The device the quantized tensors live on.
    pub fn device(&self) -> Device {
        self.codes.device()
    }

    /// Bytes held in memory by the quantized representation (codes + scales + mins + second-level
    /// constants + NF4 table).
    pub fn storage_bytes(&self) -> u64 {
        let b = |t: &Tensor| (t.numel() * t.kind().elt_size_in_bytes()) as u64;
        b(&self.codes)
            + b(&self.scales)
            + self.mins.as_ref().map_or(0, b)
            + self.dq_scales.as_ref().map_or(0, b)
            + self.table.as_ref().map_or(0, b)
    }

    /// `storage_bytes() / (out·in)`: 1.0625 (Q8_0), 0.5625 (Q4_0), 0.625 (Q4_1), 0.5 + 4/64 (NF4),
    /// ≈0.5159 (NF4 + double quant), plus the 2 KiB code table of the 4-bit kinds amortized over the
    /// matrix.
    pub fn bytes_per_param(&self) -> f64 {
        self.storage_bytes() as f64 / (self.shape[0] * self.shape[1]) as f64
    }

    /// Moves the quantized tensors to `device`.
    ///
    /// # Errors
    /// [`Error::Torch`] when the copy fails (e.g. out of memory).
    pub fn to_device(&self, device: Device) -> Result<Self> {
        let mv = |t: &Tensor| {
            t.f_to_device(device)
                .ctx(|| format!("moving {:?} weight to {device:?}", self.kind))
        };
        Ok(Self {
            kind: self.kind,
            shape: self.shape,
            codes: mv(&self.codes)?,
            scales: mv(&self.scales)?,
            mins: self.mins.as_ref().map(mv).transpose()?,
            dq_scales: self.dq_scales.as_ref().map(mv).transpose()?,
            dq_offset: self.dq_offset,
            table: self.table.as_ref().map(mv).transpose()?,
        })
    }

    /// NF4 absmax per block as f32 `[blocks]` (undoing double quantization when present).
    fn nf4_absmax(&self) -> std::result::Result<Tensor, tch::TchError> {
        match &self.dq_scales {
            None => Ok(self.scales.shallow_clone()),
            Some(s2) => {
                let nb = self.shape[0] * self.shape[1] / NF4_BLOCK as i64;
                let blocks = s2.size()[0];
                let pad = blocks * NF4_DQ_BLOCK as i64 - nb;
                self.scales
                    .f_to_kind(Kind::Float)?
                    .f_constant_pad_nd([0, pad])?
                    .f_reshape([blocks, NF4_DQ_BLOCK as i64])?
                    .f_mul(&s2.f_unsqueeze(1)?)?
                    .f_reshape([-1])?
                    .f_narrow(0, 0, nb)?
                    .f_add_scalar(f64::from(self.dq_offset))
            }
        }
    }

    /// Looks every byte of `codes` `[..., n]` up in the pair table: `[..., 2n]` values of dtype `ck`.
    fn decode_pairs(&self, codes: &Tensor, ck: Kind) -> std::result::Result<Tensor, tch::TchError> {
        let lut = match &self.table {
            Some(t) => t.shallow_clone(),
            None => {
                return Err(tch::TchError::Torch(format!(
                    "{:?} weight has no code table",
                    self.kind
                )));
            }
        };
        let lut = if ck == Kind::Float {
            lut
        } else {
            lut.f_to_kind(ck)?
        };
        let mut shape = codes.size();
        if let Some(last) = shape.last_mut() {
            *last *= 2;
        }
        let idx = codes.f_reshape([-1])?.f_to_kind(Kind::Int)?;
        lut.f_index_select(0, &idx)?.f_reshape(shape.as_slice())
    }

    /// Decodes GGUF `codes`/`scales`/`mins` (leading dims `[rows, in/32]`) into `[rows, in]` of `ck`.
    fn decode_gguf(
        &self,
        codes: &Tensor,
        scales: &Tensor,
        mins: Option<&Tensor>,
        ck: Kind,
    ) -> std::result::Result<Tensor, tch::TchError> {
        let rows = codes.size()[0];
        let d = scales.f_to_kind(ck)?.f_unsqueeze(2)?;
        let w = match (self.kind, mins) {
            (QuantKind::Q8_0, _) => codes.f_to_kind(ck)?.f_mul(&d)?,
            // Q4_1: m + q·d in one fused op
            (_, Some(m)) => m
                .f_to_kind(ck)?
                .f_unsqueeze(2)?
                .f_addcmul(&self.decode_pairs(codes, ck)?, &d)?,
            // Q4_0: the table already holds q − 8
            (_, None) => self.decode_pairs(codes, ck)?.f_mul(&d)?,
        };
        w.f_reshape([rows, self.shape[1]])
    }

    /// Decodes NF4 `codes` `[blocks, 32]` with f32 `absmax` `[blocks]` into `[blocks·64]` of `ck`.
    fn decode_nf4(
        &self,
        codes: &Tensor,
        absmax: &Tensor,
        ck: Kind,
    ) -> std::result::Result<Tensor, tch::TchError> {
        let a = if ck == Kind::Float {
            absmax.shallow_clone()
        } else {
            absmax.f_to_kind(ck)?
        };
        self.decode_pairs(codes, ck)?
            .f_mul(&a.f_unsqueeze(1)?)?
            .f_reshape([-1])
    }

    /// Dequantizes to a dense `[out, in]` tensor of dtype `kind` on the weight's device.
    ///
    /// f32 (and f64) results are bit-identical to the plain-Rust references; f16 / bf16 results are
    /// computed directly in that dtype (a table lookup, then one multiply per weight), which saves a
    /// full-size f32 pass and stays within 2⁻⁶ (bf16) / 2⁻⁹ (f16) relative of the f32 result (a few roundings)
    /// (Q4_1 → bf16 is computed in f32 and rounded once).
    ///
    /// # Errors
    /// [`Error::Torch`] when an op fails (e.g. out of memory).
    pub fn dequantize(&self, kind: Kind) -> Result<Tensor> {
        let ctx = || format!("dequantizing {:?} weight {:?}", self.kind, self.shape);
        let ck = compute_kind(self.kind, kind);
        let w = match self.kind {
            QuantKind::Nf4 { .. } => self
                .nf4_absmax()
                .and_then(|a| self.decode_nf4(&self.codes, &a, ck))
                .and_then(|w| w.f_reshape([self.shape[0], self.shape[1]])),
            _ => self.decode_gguf(&self.codes, &self.scales, self.mins.as_ref(), ck),
        }
        .ctx(ctx)?;
        if kind == ck {
            Ok(w)
        } else {
            w.f_to_kind(kind).ctx(ctx)
        }
    }

    /// Dequantizes only the rows `rows` (an integer tensor of any shape, values in `[0, out)`), giving
    /// `[rows.numel(), in]` of dtype `kind` — what an embedding lookup needs, without materializing
    /// the whole matrix (falls back to a full dequantization for NF4 when `in` is not a multiple of 64).
    ///
    /// # Errors
    /// [`Error::Torch`] when an op fails (e.g. an index out of range).
    pub fn dequantize_rows(&self, rows: &Tensor, kind: Kind) -> Result<Tensor> {
        let ctx = || {
            format!(
                "dequantizing rows of {:?} weight {:?}",
                self.kind, self.shape
            )
        };
        let idx = rows
            .f_reshape([-1])
            .and_then(|t| t.f_to_kind(Kind::Int64))
            .ctx(ctx)?;
        let ck = compute_kind(self.kind, kind);
        let w = match self.kind {
            QuantKind::Nf4 { .. } => {
                if self.shape[1] % NF4_BLOCK as i64 != 0 {
                    return self.dequantize(kind)?.f_index_select(0, &idx).ctx(ctx);
                }
                let per_row = self.shape[1] / NF4_BLOCK as i64;
                (|| {
                    let absmax = self
                        .nf4_absmax()?
                        .f_reshape([self.shape[0], per_row])?
                        .f_index_select(0, &idx)?;
                    let codes = self
                        .codes
                        .f_reshape([self.shape[0], per_row, 32])?
                        .f_index_select(0, &idx)?
                        .f_reshape([-1, 32])?;
                    self.decode_nf4(&codes, &absmax.f_reshape([-1])?, ck)?
                        .f_reshape([-1, self.shape[1]])
                })()
            }
            _ => (|| {
                let codes = self.codes.f_index_select(0, &idx)?;
                let scales = self.scales.f_index_select(0, &idx)?;
                let mins = self
                    .mins
                    .as_ref()
                    .map(|m| m.f_index_select(0, &idx))
                    .transpose()?;
                self.decode_gguf(&codes, &scales, mins.as_ref(), ck)
            })(),
        }
        .ctx(ctx)?;
        if kind == ck {
            Ok(w)
        } else {
            w.f_to_kind(kind).ctx(ctx)
        }
    }

    /// `x · Wᵀ` (`x` `[..., in]` → `[..., out]`), the frozen product of a linear layer.
    ///
    /// On the CPU, for f32 and bf16 computation, this is the shim's tiled kernel
    /// ([`crate::sys::qlinear`]): no dense copy of `W` is kept, in the forward pass or for the
    /// backward one, and at most [`crate::sys::QLINEAR_TILE_ELEMENTS`] weights are decoded at a
    /// time. Elsewhere (CUDA, f16, f64) it multiplies by [`QuantWeight::dequantize`]'s dense
    /// matrix. Under autocast the product is computed in the autocast dtype, as a plain matmul
    /// would be.
    ///
    /// # Errors
    /// [`Error::Shape`] when `x`'s last dimension is not `in`; [`Error::Torch`] when an op fails.
    pub fn linear(&self, x: &Tensor) -> Result<Tensor> {
        let ctx = || {
            format!(
                "{:?} linear {:?} on input {:?}",
                self.kind,
                self.shape,
                x.size()
            )
        };
        let size = x.size();
        let [out, inn] = self.shape;
        if size.last() != Some(&inn) {
            return Err(Error::Shape {
                key: format!("input of a {:?} linear {:?}", self.kind, self.shape),
                expected: vec![-1, inn],
                found: size,
            });
        }
        let device = x.device();
        let autocast = crate::sys::autocast_state(device)
            .map_err(tch::TchError::from)
            .ctx(ctx)?;
        let kind = match (autocast.enabled, autocast.dtype) {
            (true, Some(k)) => k,
            _ => x.kind(),
        };
        if device != Device::Cpu || !self.has_kernel(kind) {
            let w = self.dequantize(x.kind())?;
            return x.f_linear::<Tensor>(&w, None).ctx(ctx);
        }
        let x2 = (|| {
            let x = if x.kind() == kind {
                x.shallow_clone()
            } else {
                x.f_to_kind(kind)?
            };
            x.f_reshape([-1, inn])
        })()
        .ctx(ctx)?;
        let parts = self.parts();
        let y = crate::sys::qlinear(&x2, &parts)
            .map_err(tch::TchError::from)
            .ctx(ctx)?;
        let mut shape = size;
        if let Some(last) = shape.last_mut() {
            *last = out;
        }
        y.f_reshape(shape.as_slice()).ctx(ctx)
    }

    /// The tensors the shim's kernels read.
    fn parts(&self) -> crate::sys::QuantParts<'_> {
        let [out, inn] = self.shape;
        crate::sys::QuantParts {
            kind: match self.kind {
                QuantKind::Q8_0 => 0,
                QuantKind::Q4_0 => 1,
                QuantKind::Q4_1 => 2,
                QuantKind::Nf4 {
                    double_quant: false,
                } => 3,
                QuantKind::Nf4 { double_quant: true } => 4,
            },
            out,
            inn,
            codes: &self.codes,
            scales: &self.scales,
            mins: self.mins.as_ref(),
            dq_scales: self.dq_scales.as_ref(),
            table: self.table.as_ref(),
            dq_offset: self.dq_offset,
        }
    }

    /// True when the tiled CPU kernels take a product in `kind` (f32 or bf16, on the CPU).
    pub fn has_kernel(&self, kind: Kind) -> bool {
        self.device() == Device::Cpu && matches!(kind, Kind::Float | Kind::BFloat16)
    }

    /// `x · Wᵀ` (`x` `[n, in]` → `[n, out]`) or, with `transposed`, `x · W` (`x` `[n, out]` →
    /// `[n, in]`), without autograd, in `x`'s dtype: the tiled CPU kernel
    /// ([`crate::sys::qmatmul`]) when [`QuantWeight::has_kernel`], else a product with the
    /// dense [`QuantWeight::dequantize`]. For a frozen head evaluated in chunks.
    ///
    /// # Errors
    /// [`Error::Shape`] for a mismatched `x`; [`Error::Torch`] when an op fails.
    pub fn matmul(&self, x: &Tensor, transposed: bool) -> Result<Tensor> {
        let [out, inn] = self.shape;
        let width = if transposed { out } else { inn };
        let ctx = || {
            format!(
                "{:?} product {:?} with {:?}",
                self.kind,
                self.shape,
                x.size()
            )
        };
        if x.dim() != 2 || x.size()[1] != width {
            return Err(Error::Shape {
                key: format!("input of a {:?} product {:?}", self.kind, self.shape),
                expected: vec![-1, width],
                found: x.size(),
            });
        }
        if !self.has_kernel(x.kind()) || x.device() != Device::Cpu {
            let _ng = tch::no_grad_guard();
            let w = self.dequantize(x.kind())?;
            return if transposed {
                x.f_mm(&w)
            } else {
                x.f_mm(&w.f_tr().ctx(ctx)?)
            }
            .ctx(ctx);
        }
        crate::sys::qmatmul(x, &self.parts(), transposed)
            .map_err(tch::TchError::from)
            .ctx(ctx)
    }
}

/// The dtype dequantization computes in for a requested output dtype. Q4_1 → bf16 goes through f32:
/// rounding the f16 min `m` to bf16 first would cost up to 2⁻⁸·|m| where `m + q·d` cancels.
fn compute_kind(quant: QuantKind, kind: Kind) -> Kind {
    match (quant, kind) {
        (QuantKind::Q4_1, Kind::BFloat16) => Kind::Float,
        (_, Kind::Half | Kind::BFloat16) => kind,
        _ => Kind::Float,
    }
}

/// A `[256, 2]` f32 table mapping a packed byte to its two values (high nibble first).
fn pair_lut(
    value: impl Fn(u8) -> f32,
    device: Device,
) -> std::result::Result<Tensor, tch::TchError> {
    let v: Vec<f32> = (0..=255u8)
        .flat_map(|b| [value(b >> 4), value(b & 0x0F)])
        .collect();
    Tensor::f_from_slice(&v)?
        .f_reshape([256, 2])?
        .f_to_device(device)
}

/// Copies any tensor to a host `Vec<f32>` (row-major).
pub(crate) fn to_vec_f32(t: &Tensor) -> Result<Vec<f32>> {
    let ctx = || "copying a tensor to host memory".to_string();
    let c = t
        .f_to_device(Device::Cpu)
        .and_then(|t| t.f_to_kind(Kind::Float))
        .and_then(|t| t.f_contiguous())
        .ctx(ctx)?;
    let n = c.numel();
    let mut v = vec![0f32; n];
    c.f_copy_data(&mut v, n).ctx(ctx)?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::excessive_precision)]
    /// Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9).
    fn norm_ppf(p: f64) -> f64 {
        let a = [
            -3.969683028665376e1,
            2.209460984245205e2,
            -2.759285104469687e2,
            1.383577518672690e2,
            -3.066479806614716e1,
            2.506628277459239,
        ];
        let b = [
            -5.447609879822406e1,
            1.615858368580409e2,
            -1.556989798598866e2,
            6.680131188771972e1,
            -1.328068155288572e1,
        ];
        let c = [
            -7.784894002430293e-3,
            -3.223964580411365e-1,
            -2.400758277161838,
            -2.549732539343734,
            4.374664141464968,
            2.938163982698783,
        ];
        let d = [
            7.784695709041462e-3,
            3.224671290700398e-1,
            2.445134137142996,
            3.754408661907416,
        ];
        let pl = 0.02425;
        if p < pl {
            let q = (-2.0 * p.ln()).sqrt();
            (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5])
                / ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1.0)
        } else if p <= 1.0 - pl {
            let q = p - 0.5;
            let r = q * q;
            (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q
                / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1.0)
        } else {
            -norm_ppf(1.0 - p)
        }
    }

    /// The NF4 table follows from QLoRA's construction (bitsandbytes `create_normal_map`, offset
    /// 0.9677083): 8 positive quantiles `ppf(linspace(offset, 0.5, 9)[:-1])`, 7 negative ones
    /// `-ppf(linspace(offset, 0.5, 8)[:-1])`, and 0, normalized by the largest.
    #[test]
    fn nf4_table_matches_qlora_construction() {
        let offset = 0.9677083f64;
        let lin =
            |n: usize| (0..n).map(move |i| offset + (0.5 - offset) * i as f64 / (n - 1) as f64);
        let mut v: Vec<f64> = lin(9).take(8).map(norm_ppf).collect();
        v.extend(lin(8).take(7).map(|p| -norm_ppf(p)));
        v.push(0.0);
        let max = v.iter().cloned().fold(0.0, f64::max);
        let mut v: Vec<f64> = v.iter().map(|x| x / max).collect();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        for (i, (&ours, theirs)) in NF4_TABLE.iter().zip(v).enumerate() {
            assert!(
                (f64::from(ours) - theirs).abs() < 2e-6,
                "code {i}: {ours} vs {theirs}"
            );
        }
    }

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) as f64 / (1u64 << 31) as f64 * 2.0 - 1.0) as f32
            })
            .collect()
    }

    #[test]
    fn gguf_tensor_dequant_matches_reference_for_each_kind() {
        let (out, inn) = (6i64, 64i64);
        let x = pseudo_random((out * inn) as usize, 7);
        for kind in [QuantKind::Q8_0, QuantKind::Q4_0, QuantKind::Q4_1] {
            let raw = quantize_gguf_reference(kind, &x).unwrap();
            let reference = dequantize_gguf_reference(kind, &raw).unwrap();
            let q = QuantWeight::from_gguf_blocks(kind, &raw, [out, inn], Device::Cpu).unwrap();
            let ours = to_vec_f32(&q.dequantize(Kind::Float).unwrap()).unwrap();
            assert_eq!(ours.len(), reference.len());
            for (a, b) in ours.iter().zip(&reference) {
                assert_eq!(a.to_bits(), b.to_bits(), "{kind:?}");
            }
            // quantization error is bounded by the block step
            let max_err = x
                .iter()
                .zip(&reference)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            let bound = match kind {
                QuantKind::Q8_0 => 1.0 / 127.0,
                _ => 2.0 / 15.0,
            };
            assert!(max_err <= bound, "{kind:?} max error {max_err}");
            assert!(max_err > 0.0);
        }
    }

    #[test]
    fn gguf_q8_0_hand_block() {
        // d = 0.5 (f16 0x3800), q = 0..31 with q[1] = -2
        let mut raw = vec![0x00, 0x38];
        raw.extend((0..32u8).map(|i| if i == 1 { (-2i8) as u8 } else { i }));
        let v = dequantize_gguf_reference(QuantKind::Q8_0, &raw).unwrap();
        assert_eq!(v[0], 0.0);
        assert_eq!(v[1], -1.0);
        assert_eq!(v[31], 15.5);
    }

    #[test]
    fn gguf_q4_1_hand_block() {
        // d = 1.0 (0x3C00), m = -2.0 (0xC000), byte j = (j+1) | ((15-j) << 4)
        let mut raw = vec![0x00, 0x3C, 0x00, 0xC0];
        raw.extend((0..16u8).map(|j| ((j + 1) & 0xF) | ((15 - j) << 4)));
        let v = dequantize_gguf_reference(QuantKind::Q4_1, &raw).unwrap();
        assert_eq!(v[0], 1.0 - 2.0);
        assert_eq!(v[15], 0.0 - 2.0); // (15+1)&0xF = 0
        assert_eq!(v[16], 15.0 - 2.0);
        assert_eq!(v[31], 0.0 - 2.0);
        let q = QuantWeight::from_gguf_blocks(QuantKind::Q4_1, &raw, [1, 32], Device::Cpu).unwrap();
        let t = to_vec_f32(&q.dequantize(Kind::Float).unwrap()).unwrap();
        assert_eq!(t, v);
    }

    #[test]
    fn nf4_dequant_matches_reference_with_and_without_double_quant() {
        let (out, inn) = (8i64, 96i64);
        let x = pseudo_random((out * inn) as usize, 11);
        let (codes, absmax) = nf4_quantize_reference(&x).unwrap();
        let reference = nf4_reference_dequantize(&codes, &absmax).unwrap();
        let q =
            QuantWeight::from_nf4_parts(&codes, &absmax, [out, inn], false, Device::Cpu).unwrap();
        let ours = to_vec_f32(&q.dequantize(Kind::Float).unwrap()).unwrap();
        assert_eq!(ours, reference);
        // every value is a table entry times its block absmax
        for (i, v) in reference.iter().enumerate() {
            let s = absmax[i / 64];
            assert!(
                NF4_TABLE
                    .iter()
                    .any(|t| (t * s - v).abs() <= 1e-7 * s.max(1.0))
            );
        }
        // double quant: absmax error bounded by the 8-bit step, and the tensor path matches Rust
        let qd =
            QuantWeight::from_nf4_parts(&codes, &absmax, [out, inn], true, Device::Cpu).unwrap();
        let (dq, ds, off) = double_quantize(&absmax);
        let absmax2 = nf4_double_dequantize_reference(&dq, &ds, off, absmax.len());
        let reference2 = nf4_reference_dequantize(&codes, &absmax2).unwrap();
        let ours2 = to_vec_f32(&qd.dequantize(Kind::Float).unwrap()).unwrap();
        for (a, b) in ours2.iter().zip(&reference2) {
            assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
        }
        for (a, b) in absmax.iter().zip(&absmax2) {
            assert!((a - b).abs() <= ds[0] * 0.5 + 1e-6);
        }
        assert!(qd.storage_bytes() < q.storage_bytes());
    }

    #[test]
    fn bytes_per_param_per_kind() {
        let w = Tensor::f_from_slice(&pseudo_random(256 * 512, 3))
            .unwrap()
            .reshape([256, 512]);
        let expect = [
            (QuantKind::Q8_0, 34.0 / 32.0),
            (QuantKind::Q4_0, 18.0 / 32.0),
            (QuantKind::Q4_1, 20.0 / 32.0),
            (
                QuantKind::Nf4 {
                    double_quant: false,
                },
                0.5 + 4.0 / 64.0,
            ),
            (
                QuantKind::Nf4 { double_quant: true },
                0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0),
            ),
        ];
        for (kind, bpp) in expect {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let extra = if kind != QuantKind::Q8_0 {
                2048.0 / (256.0 * 512.0)
            } else {
                0.0
            };
            assert!(
                (q.bytes_per_param() - bpp - extra).abs() < 1e-3,
                "{kind:?}: {}",
                q.bytes_per_param()
            );
            let dq = q.dequantize(Kind::Float).unwrap();
            let err = f64::try_from((dq - &w).abs().max()).unwrap();
            assert!(err < 0.2, "{kind:?}: {err}");
        }
    }

    #[test]
    fn half_precision_dequant_is_within_a_few_ulps_of_f32() {
        let w = Tensor::f_from_slice(&pseudo_random(64 * 128, 9))
            .unwrap()
            .reshape([64, 128]);
        for kind in [
            QuantKind::Q8_0,
            QuantKind::Q4_0,
            QuantKind::Q4_1,
            QuantKind::Nf4 { double_quant: true },
        ] {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let f = q.dequantize(Kind::Float).unwrap();
            for (k, ulp) in [(Kind::BFloat16, 2f64.powi(-6)), (Kind::Half, 2f64.powi(-9))] {
                let h = q.dequantize(k).unwrap();
                assert_eq!(h.kind(), k);
                let rel = (h.to_kind(Kind::Float) - &f).abs() / (f.abs() + 1e-6);
                let worst = f64::try_from(rel.max()).unwrap();
                assert!(worst <= ulp, "{kind:?} {k:?}: {worst}");
            }
            assert_eq!(q.dequantize(Kind::Double).unwrap().kind(), Kind::Double);
        }
    }

    #[test]
    fn dequantize_rows_matches_full() {
        let w = Tensor::f_from_slice(&pseudo_random(10 * 128, 5))
            .unwrap()
            .reshape([10, 128]);
        let ids = Tensor::f_from_slice(&[3i64, 0, 9, 3]).unwrap();
        for kind in [
            QuantKind::Q8_0,
            QuantKind::Q4_0,
            QuantKind::Q4_1,
            QuantKind::Nf4 { double_quant: true },
        ] {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let full = q.dequantize(Kind::Float).unwrap().index_select(0, &ids);
            let rows = q.dequantize_rows(&ids, Kind::Float).unwrap();
            assert!(full.equal(&rows), "{kind:?}");
        }
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q8_0, &[0u8; 33], [1, 32], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("34"), "{e}");
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q4_0, &[0u8; 18], [1, 30], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("multiple of 32"), "{e}");
        assert!(
            dequantize_gguf_reference(
                QuantKind::Nf4 {
                    double_quant: false
                },
                &[]
            )
            .is_err()
        );
    }
}
