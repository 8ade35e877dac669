//! Frozen weights kept quantized in memory and decoded per forward one tile of rows at a time
//! (by the shim's kernel on the CPU, with tensor ops elsewhere), never kept dense.
//!
//! Supported layouts:
//! - GGUF block formats (llama.cpp `ggml-common.h` / `ggml-quants.c`; the `gguf` Python package's
//!   `quants.py`), blocks along the input dimension, little endian. Blocks of 32 weights:
//!   - `Q8_0`: f16 `d` + 32 × i8 `q`; `w = d·q` (34 bytes / 32 weights = 1.0625 bytes/param).
//!   - `Q4_0`: f16 `d` + 16 bytes; `w[j] = d·((q[j] & 0xF) − 8)`, `w[j+16] = d·((q[j] >> 4) − 8)`
//!     (18 bytes / 32 = 0.5625 bytes/param).
//!   - `Q4_1`: f16 `d` + f16 `m` + 16 bytes; `w[j] = d·(q[j] & 0xF) + m`, `w[j+16] = d·(q[j] >> 4) + m`
//!     (20 bytes / 32 = 0.625 bytes/param).
//!   - `Q5_0`: f16 `d` + 4 bytes `qh` (a little-endian u32, bit `j` the 5th bit of weight `j`) +
//!     16 bytes of low nibbles as `Q4_0`; `w = d·(q − 16)` (22 bytes / 32 = 0.6875 bytes/param).
//!   - `Q5_1`: f16 `d` + f16 `m` + `qh` + 16 bytes; `w = d·q + m` (24 bytes / 32 = 0.75 bytes/param).
//!
//!   k-quant super-blocks of 256 weights (`QK_K`):
//!   - `Q4_K`: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales `sc[8]` and minimums `m[8]` (one per
//!     sub-block of 32; `get_scale_min_k4`: bytes 0–3 hold `sc[0..4]` in their low 6 bits and the
//!     top 2 bits of `sc[4..8]`, bytes 4–7 the same for `m`, bytes 8–11 the low nibbles of
//!     `sc[4..8]` (low) and `m[4..8]` (high)), then 128 bytes of nibbles: in each chunk `c` of 64
//!     weights, `w[64c + l]` is the low nibble of byte `32c + l` and `w[64c + 32 + l]` its high
//!     nibble. `w = (d·sc[s])·q − dmin·m[s]` for sub-block `s` (144 bytes / 256 = 0.5625).
//!   - `Q5_K`: as `Q4_K` with 32 bytes `qh` between the scales and the nibbles: the 5th bit of weight
//!     `j` is bit `j / 32` of `qh[j % 32]` (176 bytes / 256 = 0.6875).
//!   - `Q6_K`: 128 bytes `ql`, 64 bytes `qh`, 16 × i8 scales, f16 `d` (last). In each half `c` of
//!     128 weights, `w[128c + j]` (`j < 64`) has the low nibble of `ql[64c + j]`, `w[128c + 64 + j]`
//!     its high nibble; bits `2t..2t+2` of `qh[32c + l]` are the top two bits of `w[128c + 32t + l]`.
//!     `w = (d·sc[j / 16])·(q − 32)` (210 bytes / 256 = 0.8203).
//!
//!   In every k-quant formula `d·sc` (an f16 times a ≤ 8-bit integer) and, for `Q4_K`/`Q5_K`,
//!   `(d·sc)·q` are exact in f32, so each weight is rounded once, whatever the evaluation order.
//! - NF4 (QLoRA, Dettmers et al. 2023, arXiv:2305.14314): blocks of 64 consecutive weights of the
//!   row-major flattened matrix, one absmax per block, 4-bit indices into the NormalFloat table
//!   [`NF4_TABLE`], two indices per byte (first one in the high nibble, as bitsandbytes packs them).
//!   With double quantization (paper §3 "Double Quantization") the f32 absmax constants are themselves
//!   quantized to 8 bits in blocks of 256 after subtracting their mean. The paper stores the second
//!   level as FP8; we use a symmetric linear int8 code with one f32 scale per 256 constants, which has
//!   the same footprint (0.5 + 8/64/8 + 4/(64·256) ≈ 0.5159 bytes/param, the paper's 4.127 bits).
//! - fp8 e4m3fn (kohya sd-scripts' `fp8_base`: the frozen base stored as `torch.float8_e4m3fn`,
//!   upcast per layer for the product): one byte per weight, 1 sign, 4 exponent (bias 7) and
//!   3 mantissa bits, no infinities, `0x7F`/`0xFF` NaN, largest finite value 448 (Micikevicius et
//!   al. 2022, arXiv:2209.05433). No scale, as kohya's. Quantization is libtorch's cast (round to
//!   nearest even).

use crate::error::{Error, Result, TchContext};
use half::f16;
use tch::{Device, Kind, Tensor};

/// Weights per GGUF block of the 32-weight kinds (`QK8_0 = QK4_0 = QK4_1 = QK5_0 = QK5_1 = 32` in
/// llama.cpp's `ggml-common.h`).
pub const GGUF_BLOCK: usize = 32;
/// Weights per k-quant super-block (`QK_K = 256` in `ggml-common.h`).
pub const GGUF_SUPER_BLOCK: usize = 256;
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
    /// GGUF `Q5_0` (type id 6): f16 scale + 32 × 5-bit (offset 16) per block.
    Q5_0,
    /// GGUF `Q5_1` (type id 7): f16 scale + f16 min + 32 × 5-bit per block.
    Q5_1,
    /// GGUF `Q4_K` (type id 12): super-blocks of 256, 4-bit codes, 6-bit sub-block scales and mins.
    Q4_K,
    /// GGUF `Q5_K` (type id 13): super-blocks of 256, 5-bit codes, 6-bit sub-block scales and mins.
    Q5_K,
    /// GGUF `Q6_K` (type id 14): super-blocks of 256, 6-bit codes (offset 32), i8 scales per 16.
    Q6_K,
    /// QLoRA NormalFloat-4, block 64, optional double quantization of the absmax constants.
    Nf4 {
        /// Quantize the per-block absmax constants to 8 bits (blocks of 256).
        double_quant: bool,
    },
    /// fp8 e4m3fn, one byte per weight, no scale (kohya's `fp8_base`).
    Fp8E4m3,
}

impl QuantKind {
    /// Bytes of one GGUF block (of [`QuantKind::gguf_block_weights`] weights), or `None` for the
    /// kinds that are not GGUF types (NF4, fp8).
    pub fn gguf_block_bytes(self) -> Option<usize> {
        match self {
            QuantKind::Q8_0 => Some(2 + 32),
            QuantKind::Q4_0 => Some(2 + 16),
            QuantKind::Q4_1 => Some(2 + 2 + 16),
            QuantKind::Q5_0 => Some(2 + 4 + 16),
            QuantKind::Q5_1 => Some(2 + 2 + 4 + 16),
            QuantKind::Q4_K => Some(2 + 2 + 12 + 128),
            QuantKind::Q5_K => Some(2 + 2 + 12 + 32 + 128),
            QuantKind::Q6_K => Some(128 + 64 + 16 + 2),
            QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => None,
        }
    }

    /// Weights per GGUF block: [`GGUF_BLOCK`] (32) or, for the k-quants, [`GGUF_SUPER_BLOCK`]
    /// (256); `None` for NF4 and fp8.
    pub fn gguf_block_weights(self) -> Option<usize> {
        match self {
            QuantKind::Q4_K | QuantKind::Q5_K | QuantKind::Q6_K => Some(GGUF_SUPER_BLOCK),
            QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => None,
            _ => Some(GGUF_BLOCK),
        }
    }

    /// The GGML type id (`ggml.h`: Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12,
    /// Q5_K = 13, Q6_K = 14), or `None` for NF4 and fp8.
    pub fn ggml_type(self) -> Option<u32> {
        match self {
            QuantKind::Q4_0 => Some(2),
            QuantKind::Q4_1 => Some(3),
            QuantKind::Q5_0 => Some(6),
            QuantKind::Q5_1 => Some(7),
            QuantKind::Q8_0 => Some(8),
            QuantKind::Q4_K => Some(12),
            QuantKind::Q5_K => Some(13),
            QuantKind::Q6_K => Some(14),
            QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => None,
        }
    }

    /// The kind for a GGML type id, if it is one of ours.
    pub fn from_ggml_type(id: u32) -> Option<Self> {
        match id {
            2 => Some(QuantKind::Q4_0),
            3 => Some(QuantKind::Q4_1),
            6 => Some(QuantKind::Q5_0),
            7 => Some(QuantKind::Q5_1),
            8 => Some(QuantKind::Q8_0),
            12 => Some(QuantKind::Q4_K),
            13 => Some(QuantKind::Q5_K),
            14 => Some(QuantKind::Q6_K),
            _ => None,
        }
    }

    /// True for the k-quants (`Q4_K`, `Q5_K`, `Q6_K`).
    pub fn is_k_quant(self) -> bool {
        matches!(self, QuantKind::Q4_K | QuantKind::Q5_K | QuantKind::Q6_K)
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

/// One GGUF block taken apart, every field in weight order (see the module docs for the layouts).
#[derive(Debug, Default)]
struct Unpacked {
    /// f16 bits of `d`.
    d: u16,
    /// f16 bits of `m` (`Q4_1`, `Q5_1`) or `dmin` (`Q4_K`, `Q5_K`).
    m: Option<u16>,
    /// `Q4_K`/`Q5_K`: the 8 six-bit scales then the 8 six-bit minimums; `Q6_K`: 16 × i8 scales.
    sub: [u8; 16],
    /// Low bits of each weight: the 4-bit nibble, or `Q8_0`'s i8 bits.
    low: Vec<u8>,
    /// High bits of each weight (the 5th bit of the 5-bit kinds, the top two of `Q6_K`); empty for
    /// the kinds without.
    high: Vec<u8>,
}

/// The `j`-th 6-bit scale (`j < 4`) and its minimum of a `Q4_K`/`Q5_K` block from the 12 packed
/// bytes (llama.cpp `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Takes one block of `kind` apart into `u` (buffers reused from block to block).
fn unpack_block(kind: QuantKind, block: &[u8], u: &mut Unpacked) {
    let h16 = |at: usize| u16::from_le_bytes([block[at], block[at + 1]]);
    u.low.clear();
    u.high.clear();
    u.m = None;
    // GGUF's 32-weight layout: weight j in the low nibble of byte j, weight j+16 in its high one
    let nibbles32 = |qs: &[u8], low: &mut Vec<u8>| {
        low.extend(qs.iter().map(|&q| q & 0x0F));
        low.extend(qs.iter().map(|&q| q >> 4));
    };
    // k-quant layout: chunks of 32 bytes hold 64 weights, low nibbles first
    let nibbles_k = |qs: &[u8], chunk: usize, low: &mut Vec<u8>| {
        for c in qs.chunks_exact(chunk) {
            low.extend(c.iter().map(|&q| q & 0x0F));
            low.extend(c.iter().map(|&q| q >> 4));
        }
    };
    match kind {
        QuantKind::Q8_0 => {
            u.d = h16(0);
            u.low.extend_from_slice(&block[2..34]);
        }
        QuantKind::Q4_0 | QuantKind::Q4_1 => {
            u.d = h16(0);
            let head = if kind == QuantKind::Q4_1 {
                u.m = Some(h16(2));
                4
            } else {
                2
            };
            nibbles32(&block[head..head + 16], &mut u.low);
        }
        QuantKind::Q5_0 | QuantKind::Q5_1 => {
            u.d = h16(0);
            let head = if kind == QuantKind::Q5_1 {
                u.m = Some(h16(2));
                4
            } else {
                2
            };
            let qh = u32::from_le_bytes([
                block[head],
                block[head + 1],
                block[head + 2],
                block[head + 3],
            ]);
            nibbles32(&block[head + 4..head + 20], &mut u.low);
            u.high.extend((0..32).map(|j| ((qh >> j) & 1) as u8));
        }
        QuantKind::Q4_K | QuantKind::Q5_K => {
            u.d = h16(0);
            u.m = Some(h16(2));
            let packed = &block[4..16];
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, packed);
                u.sub[j] = sc;
                u.sub[8 + j] = m;
            }
            let qs_at = if kind == QuantKind::Q5_K {
                let qh = &block[16..48];
                u.high
                    .extend((0..256).map(|j| (qh[j % 32] >> (j / 32)) & 1));
                48
            } else {
                16
            };
            nibbles_k(&block[qs_at..qs_at + 128], 32, &mut u.low);
        }
        QuantKind::Q6_K => {
            let (ql, qh) = (&block[0..128], &block[128..192]);
            u.sub.copy_from_slice(&block[192..208]);
            u.d = h16(208);
            nibbles_k(ql, 64, &mut u.low);
            u.high.extend((0..256).map(|j| {
                let (c, t, l) = (j / 128, (j % 128) / 32, j % 32);
                (qh[32 * c + l] >> (2 * t)) & 3
            }));
        }
        QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => {}
    }
}

/// Plain-Rust reference dequantization of GGUF block data (no tensors involved).
///
/// `raw` is the tensor's bytes exactly as stored in a GGUF file (a whole number of blocks); the result
/// has `blocks · gguf_block_weights()` values in file order (row-major, `in` fastest). Formulas: see
/// the module docs (llama.cpp `dequantize_row_q8_0` / `_q4_0` / `_q4_1` / `_q5_0` / `_q5_1` /
/// `_q4_K` / `_q5_K` / `_q6_K`), evaluated in f32 as there.
///
/// # Errors
/// [`Error::Quant`] when `raw` is not a whole number of blocks or `kind` is not a GGUF type (NF4:
/// use [`nf4_reference_dequantize`]; fp8: [`fp8_e4m3_to_f32`]).
pub fn dequantize_gguf_reference(kind: QuantKind, raw: &[u8]) -> Result<Vec<f32>> {
    let (bb, bw) = gguf_layout(kind)?;
    if !raw.len().is_multiple_of(bb) {
        return Err(qerr(
            kind,
            format!(
                "{} bytes is not a whole number of {bb}-byte blocks",
                raw.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(raw.len() / bb * bw);
    let mut u = Unpacked::default();
    for block in raw.chunks_exact(bb) {
        unpack_block(kind, block, &mut u);
        let d = f16::from_bits(u.d).to_f32();
        let m = u.m.map_or(0.0, |m| f16::from_bits(m).to_f32());
        let low = |j: usize| f32::from(u.low[j]);
        let high = |j: usize| f32::from(u.high[j]);
        match kind {
            QuantKind::Q8_0 => out.extend(u.low.iter().map(|&q| d * f32::from(q as i8))),
            QuantKind::Q4_0 => out.extend((0..32).map(|j| d * (low(j) - 8.0))),
            QuantKind::Q4_1 => out.extend((0..32).map(|j| d * low(j) + m)),
            QuantKind::Q5_0 => out.extend((0..32).map(|j| d * (low(j) + 16.0 * high(j) - 16.0))),
            QuantKind::Q5_1 => out.extend((0..32).map(|j| d * (low(j) + 16.0 * high(j)) + m)),
            QuantKind::Q4_K | QuantKind::Q5_K => {
                let five = kind == QuantKind::Q5_K;
                out.extend((0..256).map(|j| {
                    let s = j / 32;
                    let q = if five {
                        low(j) + 16.0 * high(j)
                    } else {
                        low(j)
                    };
                    d * f32::from(u.sub[s]) * q - m * f32::from(u.sub[8 + s])
                }));
            }
            QuantKind::Q6_K => out
                .extend((0..256).map(|j| {
                    d * f32::from(u.sub[j / 16] as i8) * (low(j) + 16.0 * high(j) - 32.0)
                })),
            QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => return Err(not_gguf(kind)),
        }
    }
    Ok(out)
}

fn not_gguf(kind: QuantKind) -> Error {
    qerr(
        kind,
        "not a GGUF block type (NF4: nf4_reference_dequantize; fp8: fp8_e4m3_to_f32)",
    )
}

/// `(bytes, weights)` of one GGUF block of `kind`.
fn gguf_layout(kind: QuantKind) -> Result<(usize, usize)> {
    match (kind.gguf_block_bytes(), kind.gguf_block_weights()) {
        (Some(b), Some(w)) => Ok((b, w)),
        _ => Err(not_gguf(kind)),
    }
}

/// The value of one fp8 e4m3fn byte (1 sign, 4 exponent bits with bias 7, 3 mantissa bits;
/// exponent 0 is subnormal, `S.1111.111` is NaN, there are no infinities; OCP 8-bit floating point
/// specification / arXiv:2209.05433), exactly as `torch.float8_e4m3fn` decodes it.
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = i32::from((byte >> 3) & 0x0F);
    let m = f32::from(byte & 0x07);
    if e == 15 && byte & 0x07 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m * 2f32.powi(-9)
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
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

/// Quantizes `x` (a whole number of blocks) to GGUF bytes.
///
/// `Q8_0`, `Q4_0`, `Q4_1` follow llama.cpp's reference quantizers (`quantize_row_q8_0_ref`,
/// `quantize_row_q4_0_ref`, `quantize_row_q4_1_ref` in `ggml-quants.c`), `Q5_0`/`Q5_1` the same
/// recipes with 32 levels (`quantize_row_q5_0_ref`, `_q5_1_ref`). The k-quants use a plain
/// min/max quantizer with the same block layout — per sub-block scale (and minimum), the
/// super-block scales chosen to fit the largest of them in 6 (`Q6_K`: 8) bits, then nearest
/// codes — not llama.cpp's iterative search (`make_qkx2_quants`), so their error is somewhat
/// larger than `llama-quantize`'s; files quantized by llama.cpp decode exactly.
///
/// # Errors
/// [`Error::Quant`] for NF4 / fp8 or a length that is not a multiple of the block size.
pub fn quantize_gguf_reference(kind: QuantKind, x: &[f32]) -> Result<Vec<u8>> {
    let (bb, bw) = gguf_layout(kind)?;
    if !x.len().is_multiple_of(bw) {
        return Err(qerr(
            kind,
            format!("{} values is not a multiple of {bw}", x.len()),
        ));
    }
    let f16b = |v: f32| f16::from_f32(v).to_bits().to_le_bytes();
    let mut out = Vec::with_capacity(x.len() / bw * bb);
    for b in x.chunks_exact(bw) {
        match kind {
            QuantKind::Q8_0 => {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16b(d));
                out.extend(b.iter().map(|v| ((v * id).round() as i8) as u8));
            }
            QuantKind::Q4_0 | QuantKind::Q5_0 => {
                let (mut amax, mut max) = (0f32, 0f32);
                for &v in b {
                    if amax < v.abs() {
                        amax = v.abs();
                        max = v;
                    }
                }
                let (half, top) = if kind == QuantKind::Q4_0 {
                    (8.0, 15)
                } else {
                    (16.0, 31)
                };
                let d = max / -half;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16b(d));
                // (int8_t) casts truncate toward zero, as in C.
                let q: Vec<u8> = b
                    .iter()
                    .map(|v| ((v * id + half + 0.5) as i8).min(top) as u8)
                    .collect();
                push_32(kind, &q, &mut out);
            }
            QuantKind::Q4_1 | QuantKind::Q5_1 => {
                let min = b.iter().fold(f32::INFINITY, |a, &v| a.min(v));
                let max = b.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
                let top = if kind == QuantKind::Q4_1 { 15u8 } else { 31 };
                let d = (max - min) / f32::from(top);
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f16b(d));
                out.extend(f16b(min));
                let q: Vec<u8> = b
                    .iter()
                    .map(|v| (((v - min) * id + 0.5) as i8).min(top as i8) as u8)
                    .collect();
                push_32(kind, &q, &mut out);
            }
            QuantKind::Q4_K | QuantKind::Q5_K => quantize_q45_k(kind, b, &mut out),
            QuantKind::Q6_K => quantize_q6_k(b, &mut out),
            QuantKind::Nf4 { .. } | QuantKind::Fp8E4m3 => return Err(not_gguf(kind)),
        }
    }
    Ok(out)
}

/// Appends the code bytes of a 32-weight block (`q` the codes 0..15 or 0..31): the `qh` bit plane
/// for the 5-bit kinds, then the nibbles (weight `j` low, `j + 16` high).
fn push_32(kind: QuantKind, q: &[u8], out: &mut Vec<u8>) {
    if matches!(kind, QuantKind::Q5_0 | QuantKind::Q5_1) {
        let qh = (0..32).fold(0u32, |a, j| a | (u32::from(q[j] >> 4) << j));
        out.extend(qh.to_le_bytes());
    }
    out.extend((0..16).map(|j| (q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4)));
}

/// Rounds `v / step` to the nearest integer in `[lo, hi]` (0 for a zero step).
fn nearest(v: f32, step: f32, lo: i32, hi: i32) -> i32 {
    if step == 0.0 {
        0
    } else {
        ((v / step).round() as i32).clamp(lo, hi)
    }
}

/// One `Q4_K` / `Q5_K` super-block of 256 values (see [`quantize_gguf_reference`]).
fn quantize_q45_k(kind: QuantKind, b: &[f32], out: &mut Vec<u8>) {
    let top = if kind == QuantKind::Q4_K { 15 } else { 31 };
    // per sub-block of 32: step and (non-negative) offset with w ≈ step·q − offset
    let mut steps = [0f32; 8];
    let mut offs = [0f32; 8];
    for (s, sb) in b.chunks_exact(32).enumerate() {
        let min = sb.iter().fold(0f32, |a, &v| a.min(v));
        let max = sb.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        steps[s] = (max - min) / top as f32;
        offs[s] = -min;
    }
    let d = f16::from_f32(steps.iter().fold(0f32, |a, &v| a.max(v)) / 63.0).to_f32();
    let dmin = f16::from_f32(offs.iter().fold(0f32, |a, &v| a.max(v)) / 63.0).to_f32();
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for s in 0..8 {
        // round the step up so the largest code still reaches the block's maximum
        sc[s] = if d == 0.0 {
            0
        } else {
            ((steps[s] / d).ceil() as i32).clamp(0, 63) as u8
        };
        mn[s] = nearest(offs[s], dmin, 0, 63) as u8;
    }
    let mut q = [0u8; 256];
    for (j, &v) in b.iter().enumerate() {
        let s = j / 32;
        let step = d * f32::from(sc[s]);
        q[j] = nearest(v + dmin * f32::from(mn[s]), step, 0, top) as u8;
    }
    out.extend(f16::from_f32(d).to_bits().to_le_bytes());
    out.extend(f16::from_f32(dmin).to_bits().to_le_bytes());
    // the 12-byte packing that `scale_min_k4` reads
    let mut packed = [0u8; 12];
    for j in 0..4 {
        packed[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    out.extend(packed);
    if kind == QuantKind::Q5_K {
        out.extend((0..32).map(|l| (0..8).fold(0u8, |a, s| a | ((q[32 * s + l] >> 4) << s))));
    }
    for c in 0..4 {
        out.extend((0..32).map(|l| (q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4)));
    }
}

/// One `Q6_K` super-block of 256 values (see [`quantize_gguf_reference`]).
fn quantize_q6_k(b: &[f32], out: &mut Vec<u8>) {
    // per sub-block of 16: a signed step mapping the largest magnitude to −32 (as Q4_0 does to −8)
    let mut steps = [0f32; 16];
    for (s, sb) in b.chunks_exact(16).enumerate() {
        let max = sb
            .iter()
            .fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
        steps[s] = max / -32.0;
    }
    let d = f16::from_f32(steps.iter().fold(0f32, |a, &v| a.max(v.abs())) / 127.0).to_f32();
    let sc: Vec<i8> = steps
        .iter()
        .map(|&st| nearest(st, d, -127, 127) as i8)
        .collect();
    let mut q = [0u8; 256];
    for (j, &v) in b.iter().enumerate() {
        let step = d * f32::from(sc[j / 16]);
        q[j] = (nearest(v, step, -32, 31) + 32) as u8;
    }
    for c in 0..2 {
        out.extend((0..64).map(|j| (q[128 * c + j] & 0x0F) | ((q[128 * c + 64 + j] & 0x0F) << 4)));
    }
    for c in 0..2 {
        out.extend(
            (0..32)
                .map(|l| (0..4).fold(0u8, |a, t| a | ((q[128 * c + 32 * t + l] >> 4) << (2 * t)))),
        );
    }
    out.extend(sc.iter().map(|&v| v as u8));
    out.extend(f16::from_f32(d).to_bits().to_le_bytes());
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
/// Dequantized with a handful of tensor ops on the tensors' device (so it runs on the GPU when the
/// model does; [`QuantWeight::linear`] decodes one tile of rows at a time). Storage, by kind
/// (`nb` blocks per row: `in/32`, or `in/256` for the k-quants):
/// - GGUF kinds: `codes` `[out, nb, 32]` i8 (Q8_0), `[out, nb, 16]` u8 (Q4_*, Q5_0, Q5_1) or
///   `[out, nb, 128]` u8 (k-quants); `scales` `[out, nb]` f16 (the block's `d`); `mins`
///   `[out, nb]` f16 (`m` of Q4_1/Q5_1, `dmin` of Q4_K/Q5_K).
/// - `hbits` u8, the high bits of each weight packed in weight order, least significant first:
///   one bit per weight for Q5_0/Q5_1 (`[out, nb, 4]`, the file's `qh` as is) and Q5_K
///   (`[out, nb, 32]`), two bits per weight for Q6_K (`[out, nb, 64]`).
/// - `sub_scales`: Q4_K/Q5_K u8 `[out, nb, 16]` (the 8 six-bit scales, then the 8 six-bit
///   minimums, unpacked from the file's 12 bytes: 148 / 180 bytes per 256 weights instead of
///   144 / 176); Q6_K i8 `[out, nb, 16]`.
/// - NF4: `codes` `[out·in/64, 32]` u8, `scales` `[out·in/64]` f32 absmax, or with double quantization
///   `[out·in/64]` i8 plus `dq_scales` f32 `[⌈out·in/64/256⌉]` and a scalar offset.
/// - fp8: `codes` `[out, in]` u8 holding the e4m3fn bits; `scales` empty (no scale).
/// - 4-bit codes (and the low nibbles of the 5- and 6-bit kinds) are packed as consecutive pairs
///   (first weight in the high nibble; GGUF's nibble orders are repacked at load) and `table` f32
///   `[256, 2]` (2 KiB) maps a byte to its two values, so decoding is one lookup plus one multiply
///   (or fused multiply-add).
#[derive(Debug)]
pub struct QuantWeight {
    kind: QuantKind,
    shape: [i64; 2],
    codes: Tensor,
    scales: Tensor,
    mins: Option<Tensor>,
    sub_scales: Option<Tensor>,
    hbits: Option<Tensor>,
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
        QuantKind::Fp8E4m3 => {}
        _ => {
            let bw = kind.gguf_block_weights().unwrap_or(GGUF_BLOCK) as i64;
            if shape[1] % bw != 0 {
                return Err(qerr(
                    kind,
                    format!(
                        "shape {shape:?}: in ({}) must be a multiple of {bw}",
                        shape[1]
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Packs values (each below `2^bits`) in weight order, least significant first, `8 / bits` per byte.
fn pack_bits(v: &[u8], bits: usize, out: &mut Vec<u8>) {
    let per = 8 / bits;
    out.extend(v.chunks(per).map(|c| {
        c.iter()
            .enumerate()
            .fold(0u8, |a, (i, &x)| a | (x << (bits * i)))
    }));
}

/// Bytes per block of each tensor a GGUF block is taken apart into: f16 `d`, f16 `m` (kinds with
/// a minimum), the k-quants' 16 sub-block bytes, the packed high bits and the codes (Q8_0's i8,
/// else nibble pairs in weight order); 0 for the fields a kind lacks.
#[derive(Clone, Copy)]
struct BlockStrides {
    d: usize,
    m: usize,
    sub: usize,
    h: usize,
    q: usize,
}

impl BlockStrides {
    fn of(kind: QuantKind, bw: usize) -> Self {
        BlockStrides {
            d: 2,
            m: if has_min(kind) { 2 } else { 0 },
            sub: if kind.is_k_quant() { 16 } else { 0 },
            h: bw * high_bits(kind) / 8,
            q: if kind == QuantKind::Q8_0 { bw } else { bw / 2 },
        }
    }
}

/// The tensors' bytes of a run of blocks (see [`BlockStrides`]), each in block order.
struct BlockParts<T> {
    d: T,
    m: T,
    sub: T,
    h: T,
    q: T,
}

/// True for the GGUF kinds whose blocks carry a minimum (`m` / `dmin`).
fn has_min(kind: QuantKind) -> bool {
    matches!(
        kind,
        QuantKind::Q4_1 | QuantKind::Q5_1 | QuantKind::Q4_K | QuantKind::Q5_K
    )
}

/// High bits per weight beyond the 4-bit (or Q8_0's 8-bit) codes: 1 for the 5-bit kinds, 2 for
/// `Q6_K`, else 0.
fn high_bits(kind: QuantKind) -> usize {
    match kind {
        QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q5_K => 1,
        QuantKind::Q6_K => 2,
        _ => 0,
    }
}

/// Takes the whole blocks of `kind` (`bb` bytes each) in `raw` apart into `out`, whose slices
/// hold exactly these blocks' bytes at `st`'s strides.
fn unpack_blocks(
    kind: QuantKind,
    raw: &[u8],
    bb: usize,
    st: BlockStrides,
    out: BlockParts<&mut [u8]>,
) {
    let hb = high_bits(kind);
    let mut u = Unpacked::default();
    let mut packed = Vec::with_capacity(st.h);
    for (i, block) in raw.chunks_exact(bb).enumerate() {
        unpack_block(kind, block, &mut u);
        out.d[i * 2..i * 2 + 2].copy_from_slice(&u.d.to_le_bytes());
        if let Some(mv) = u.m {
            out.m[i * 2..i * 2 + 2].copy_from_slice(&mv.to_le_bytes());
        }
        if st.sub > 0 {
            out.sub[i * 16..i * 16 + 16].copy_from_slice(&u.sub);
        }
        if hb > 0 {
            packed.clear();
            pack_bits(&u.high, hb, &mut packed);
            out.h[i * st.h..(i + 1) * st.h].copy_from_slice(&packed);
        }
        let q = &mut out.q[i * st.q..(i + 1) * st.q];
        if kind == QuantKind::Q8_0 {
            q.copy_from_slice(&u.low);
        } else {
            // consecutive pairs, first weight in the high nibble: one byte-indexed lookup
            // yields the weights in order
            for (o, x) in q.iter_mut().zip(u.low.chunks_exact(2)) {
                *o = (x[0] << 4) | x[1];
            }
        }
    }
}

/// All of `raw`'s blocks taken apart ([`unpack_blocks`]) on `threads` scoped threads, each writing
/// a contiguous run of whole blocks straight into its share of the buffers (no copies joined
/// afterwards); the bytes equal one thread's.
fn unpack_blocks_on(
    kind: QuantKind,
    raw: &[u8],
    bb: usize,
    bw: usize,
    threads: usize,
) -> Result<BlockParts<Vec<u8>>> {
    let blocks = raw.len() / bb;
    let st = BlockStrides::of(kind, bw);
    let mut p = BlockParts {
        d: vec![0u8; blocks * st.d],
        m: vec![0u8; blocks * st.m],
        sub: vec![0u8; blocks * st.sub],
        h: vec![0u8; blocks * st.h],
        q: vec![0u8; blocks * st.q],
    };
    let per = blocks.div_ceil(threads.max(1)).max(1);
    // `per` blocks' worth of `v` at a time (an empty slice per run for an absent field)
    fn runs(v: &mut [u8], stride: usize, per: usize, n: usize) -> Vec<&mut [u8]> {
        if stride == 0 {
            return (0..n).map(|_| <&mut [u8]>::default()).collect();
        }
        v.chunks_mut(per * stride).collect()
    }
    let n = blocks.div_ceil(per);
    let mut d = runs(&mut p.d, st.d, per, n).into_iter();
    let mut m = runs(&mut p.m, st.m, per, n).into_iter();
    let mut sub = runs(&mut p.sub, st.sub, per, n).into_iter();
    let mut h = runs(&mut p.h, st.h, per, n).into_iter();
    let mut q = runs(&mut p.q, st.q, per, n).into_iter();
    let mut jobs = Vec::with_capacity(n);
    for run in raw.chunks(per * bb) {
        match (d.next(), m.next(), sub.next(), h.next(), q.next()) {
            (Some(d), Some(m), Some(sub), Some(h), Some(q)) => {
                jobs.push((run, BlockParts { d, m, sub, h, q }))
            }
            _ => return Err(qerr(kind, "internal: block runs and buffers disagree")),
        }
    }
    if jobs.len() <= 1 {
        for (run, out) in jobs {
            unpack_blocks(kind, run, bb, st, out);
        }
        return Ok(p);
    }
    std::thread::scope(|sc| {
        let handles: Vec<_> = jobs
            .into_iter()
            .map(|(run, out)| sc.spawn(move || unpack_blocks(kind, run, bb, st, out)))
            .collect();
        handles.into_iter().try_for_each(|h| h.join())
    })
    .map_err(|_| qerr(kind, "a thread taking the blocks apart panicked"))?;
    Ok(p)
}

impl QuantWeight {
    /// Builds a quantized weight from a GGUF tensor's raw bytes.
    ///
    /// `raw`: the tensor data exactly as stored in the GGUF file (row-major blocks along `in`);
    /// `shape`: torch order `[out, in]` (GGUF lists dims innermost first, i.e. `[in, out]`).
    ///
    /// # Errors
    /// [`Error::Quant`] for NF4 / fp8, an `in` not divisible by the block size (32, or 256 for the
    /// k-quants), or a byte count that does not match the shape; [`Error::Torch`] when the tensors
    /// cannot be created on `device`.
    pub fn from_gguf_blocks(
        kind: QuantKind,
        raw: &[u8],
        shape: [i64; 2],
        device: Device,
    ) -> Result<Self> {
        let (bb, bw) = gguf_layout(kind)?;
        check_shape(kind, shape)?;
        let (out, inn) = (shape[0], shape[1]);
        let nb = inn / bw as i64;
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
        let st = BlockStrides::of(kind, bw);
        // on up to libtorch's intra-op thread count, at least 4096 blocks each
        let threads = usize::try_from(tch::get_num_threads())
            .unwrap_or(1)
            .clamp(1, blocks.div_ceil(4096).max(1));
        let BlockParts { d, m, sub, h, q } = unpack_blocks_on(kind, raw, bb, bw, threads)?;
        let ctx = || format!("building {kind:?} tensors of shape {shape:?}");
        let make = |data: &[u8], size: &[i64], k: Kind| {
            Tensor::f_from_data_size(data, size, k)
                .and_then(|t| t.f_to_device(device))
                .ctx(ctx)
        };
        let code_kind = if kind == QuantKind::Q8_0 {
            Kind::Int8
        } else {
            Kind::Uint8
        };
        let codes = make(&q, &[out, nb, st.q as i64], code_kind)?;
        let scales = make(&d, &[out, nb], Kind::Half)?;
        let mins = if st.m > 0 {
            Some(make(&m, &[out, nb], Kind::Half)?)
        } else {
            None
        };
        let sub_scales = if st.sub > 0 {
            let k = if kind == QuantKind::Q6_K {
                Kind::Int8
            } else {
                Kind::Uint8
            };
            Some(make(&sub, &[out, nb, 16], k)?)
        } else {
            None
        };
        let hbits = if st.h > 0 {
            Some(make(&h, &[out, nb, st.h as i64], Kind::Uint8)?)
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
            sub_scales,
            hbits,
            dq_scales: None,
            dq_offset: 0.0,
            table,
        })
    }

    /// Quantizes a dense 2-D weight `[out, in]` (any float dtype, any device; the result lives on the
    /// same device). GGUF kinds use [`quantize_gguf_reference`] (`in` must be a multiple of 32, or
    /// 256 for the k-quants); NF4 uses blocks of 64 over the flattened matrix (`out·in` must be a
    /// multiple of 64), nearest code, and optional double quantization (QLoRA, arXiv:2305.14314);
    /// fp8 is libtorch's cast to `float8_e4m3fn` (round to nearest even; magnitudes beyond 448,
    /// infinities included, saturate to ±448 and NaN stays NaN, as `w.to(torch.float8_e4m3fn)` in
    /// PyTorch 2.13, which kohya's `fp8_base` calls), computed on `w`'s device.
    ///
    /// # Errors
    /// [`Error::Shape`] when `w` is not 2-D; [`Error::Quant`] for block-size mismatches;
    /// [`Error::Torch`] when an op fails.
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
        if kind == QuantKind::Fp8E4m3 {
            let ctx = || format!("casting a {shape:?} weight to fp8 e4m3fn");
            let codes = w
                .f_to_kind(Kind::Float8e4m3fn)
                .and_then(|t| t.f_view_dtype(Kind::Uint8))
                .and_then(|t| t.f_contiguous())
                .ctx(ctx)?;
            let scales = Tensor::f_empty([0], (Kind::Float, device)).ctx(ctx)?;
            return Ok(Self {
                kind,
                shape,
                codes,
                scales,
                mins: None,
                sub_scales: None,
                hbits: None,
                dq_scales: None,
                dq_offset: 0.0,
                table: None,
            });
        }
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

    /// The fp8 e4m3fn bits of the weight, `[out, in]` u8 on the weight's device (`None` for the
    /// other kinds): what a checkpoint stores, and what tests compare with PyTorch's cast.
    pub fn fp8_bits(&self) -> Option<&Tensor> {
        (self.kind == QuantKind::Fp8E4m3).then_some(&self.codes)
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
            sub_scales: None,
            hbits: None,
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
            + self.sub_scales.as_ref().map_or(0, b)
            + self.hbits.as_ref().map_or(0, b)
            + self.dq_scales.as_ref().map_or(0, b)
            + self.table.as_ref().map_or(0, b)
    }

    /// `storage_bytes() / (out·in)`: 1.0625 (Q8_0), 0.5625 (Q4_0), 0.625 (Q4_1), 0.6875 (Q5_0),
    /// 0.75 (Q5_1), 148/256 (Q4_K), 180/256 (Q5_K), 210/256 (Q6_K), 0.5 + 4/64 (NF4), ≈0.5159
    /// (NF4 + double quant), 1 (fp8), plus the 2 KiB pair table of every kind but Q8_0 and fp8
    /// amortized over the matrix.
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
            sub_scales: self.sub_scales.as_ref().map(mv).transpose()?,
            hbits: self.hbits.as_ref().map(mv).transpose()?,
            dq_scales: self.dq_scales.as_ref().map(mv).transpose()?,
            dq_offset: self.dq_offset,
            table: self.table.as_ref().map(mv).transpose()?,
        })
    }

    /// Output rows `start .. start + len` of the weight, still quantized: `[len, in]` of the same
    /// kind, equal to `dequantize()` then `narrow(0, start, len)` bit for bit.
    ///
    /// Every GGUF kind and fp8 are quantized row by row (GGUF blocks run along `in`, whole
    /// blocks per row), so the rows' codes, scales, minimums and high bits are themselves a
    /// valid quantized tensor: the result is made of views of this weight's tensors (no copy,
    /// no dequantization; it shares their storage, so keeping a slice keeps the whole weight's
    /// memory alive unless every slice is kept, as in a fused `qkv` cut into `q`, `k`, `v`).
    /// This is how a checkpoint's fused projections (BFL FLUX's `img_attn.qkv`, `linear1`) are
    /// cut into separately adapted modules without leaving their block format.
    ///
    /// NF4 blocks of 64 run over the flattened matrix, so `start·in` and `len·in` must be
    /// multiples of 64; with double quantization, a slice whose first block is not the first of a
    /// second-level group of 256 cannot keep the 8-bit constants and comes back as single-level
    /// NF4 (`double_quant: false`) with the same f32 absmax values (0.0625 instead of 0.0159
    /// bytes/param of constants).
    ///
    /// # Errors
    /// [`Error::Quant`] for an empty or out-of-range row range or an NF4 range that cuts a block;
    /// [`Error::Torch`] when an op fails.
    pub fn narrow_rows(&self, start: i64, len: i64) -> Result<Self> {
        let [out, inn] = self.shape;
        if start < 0 || len <= 0 || start + len > out {
            return Err(qerr(
                self.kind,
                format!(
                    "rows {start}..{} are not inside the {out} rows of the weight",
                    start + len
                ),
            ));
        }
        let ctx = || {
            format!(
                "narrowing {:?} weight {:?} to rows {start}..{}",
                self.kind,
                self.shape,
                start + len
            )
        };
        let rows = |t: &Tensor| t.f_narrow(0, start, len).ctx(ctx);
        let rows_opt = |t: &Option<Tensor>| t.as_ref().map(rows).transpose();
        let mut kind = self.kind;
        let (codes, scales, dq_scales) = match self.kind {
            QuantKind::Nf4 { double_quant } => {
                let b = NF4_BLOCK as i64;
                if (start * inn) % b != 0 || (len * inn) % b != 0 {
                    return Err(qerr(
                        self.kind,
                        format!(
                            "rows {start}..{} of a [{out}, {inn}] weight cut an NF4 block of 64 \
                             (start·in and len·in must be multiples of 64)",
                            start + len
                        ),
                    ));
                }
                let (b0, nb) = (start * inn / b, len * inn / b);
                let codes = self.codes.f_narrow(0, b0, nb).ctx(ctx)?;
                let g = NF4_DQ_BLOCK as i64;
                match (&self.dq_scales, double_quant) {
                    (Some(s2), true) if b0 % g == 0 => {
                        let groups = (nb + g - 1) / g;
                        (
                            codes,
                            self.scales.f_narrow(0, b0, nb).ctx(ctx)?,
                            Some(s2.f_narrow(0, b0 / g, groups).ctx(ctx)?),
                        )
                    }
                    (Some(_), _) => {
                        kind = QuantKind::Nf4 {
                            double_quant: false,
                        };
                        (codes, self.nf4_absmax_blocks(b0, nb).ctx(ctx)?, None)
                    }
                    (None, _) => (codes, self.scales.f_narrow(0, b0, nb).ctx(ctx)?, None),
                }
            }
            QuantKind::Fp8E4m3 => (rows(&self.codes)?, self.scales.shallow_clone(), None),
            _ => (rows(&self.codes)?, rows(&self.scales)?, None),
        };
        let dq_offset = if dq_scales.is_some() {
            self.dq_offset
        } else {
            0.0
        };
        Ok(Self {
            kind,
            shape: [len, inn],
            codes,
            scales,
            mins: rows_opt(&self.mins)?,
            sub_scales: rows_opt(&self.sub_scales)?,
            hbits: rows_opt(&self.hbits)?,
            dq_scales,
            dq_offset,
            table: self.table.as_ref().map(Tensor::shallow_clone),
        })
    }

    /// The weights of `parts` stacked along the output rows: `[Σ outᵢ, in]`, still quantized
    /// (the inverse of [`QuantWeight::narrow_rows`]; how a module made of row ranges of a fused
    /// checkpoint tensor in another order is assembled, e.g. diffusers' FLUX `norm_out.linear`
    /// from BFL's `final_layer.adaLN_modulation.1` halves). New tensors, on the first part's
    /// device.
    ///
    /// # Errors
    /// [`Error::Quant`] when `parts` is empty, mixes kinds or input widths, or is NF4 (its
    /// blocks run over the flattened matrix: dequantize instead); [`Error::Torch`] when an op
    /// fails.
    pub fn cat_rows(parts: &[&QuantWeight]) -> Result<Self> {
        let Some(first) = parts.first() else {
            return Err(qerr(QuantKind::Q8_0, "no weights to stack"));
        };
        let kind = first.kind;
        if matches!(kind, QuantKind::Nf4 { .. }) {
            return Err(qerr(
                kind,
                "NF4 blocks run over the flattened matrix: stack the dequantized rows instead",
            ));
        }
        let inn = first.shape[1];
        if let Some(p) = parts.iter().find(|p| p.kind != kind || p.shape[1] != inn) {
            return Err(qerr(
                kind,
                format!(
                    "cannot stack a {:?} {:?} weight under a {kind:?} [_, {inn}] one",
                    p.kind, p.shape
                ),
            ));
        }
        let ctx = || format!("stacking {} {kind:?} weights of width {inn}", parts.len());
        let cat = |pick: &dyn Fn(&QuantWeight) -> Option<&Tensor>| -> Result<Option<Tensor>> {
            let ts: Vec<&Tensor> = parts.iter().filter_map(|p| pick(p)).collect();
            if ts.is_empty() {
                return Ok(None);
            }
            Tensor::f_cat(&ts, 0).ctx(ctx).map(Some)
        };
        let codes = cat(&|p| Some(&p.codes))?.ok_or_else(|| qerr(kind, "no codes"))?;
        let scales = if kind == QuantKind::Fp8E4m3 {
            first.scales.shallow_clone()
        } else {
            cat(&|p| Some(&p.scales))?.ok_or_else(|| qerr(kind, "no scales"))?
        };
        Ok(Self {
            kind,
            shape: [parts.iter().map(|p| p.shape[0]).sum(), inn],
            codes,
            scales,
            mins: cat(&|p| p.mins.as_ref())?,
            sub_scales: cat(&|p| p.sub_scales.as_ref())?,
            hbits: cat(&|p| p.hbits.as_ref())?,
            dq_scales: None,
            dq_offset: 0.0,
            table: first.table.as_ref().map(Tensor::shallow_clone),
        })
    }

    /// NF4 absmax per block as f32 `[blocks]` (undoing double quantization when present).
    fn nf4_absmax(&self) -> std::result::Result<Tensor, tch::TchError> {
        self.nf4_absmax_blocks(0, self.shape[0] * self.shape[1] / NF4_BLOCK as i64)
    }

    /// NF4 absmax of blocks `b0 .. b0 + nb` as f32 `[nb]`: with double quantization, only the
    /// second-level groups of 256 that hold them are expanded (the same per-value ops as the
    /// whole matrix's, so the same values bit for bit).
    fn nf4_absmax_blocks(&self, b0: i64, nb: i64) -> std::result::Result<Tensor, tch::TchError> {
        match &self.dq_scales {
            None => self.scales.f_narrow(0, b0, nb),
            Some(s2) => {
                let g = NF4_DQ_BLOCK as i64;
                let total = self.shape[0] * self.shape[1] / NF4_BLOCK as i64;
                let (g0, g1) = (b0 / g, (b0 + nb + g - 1) / g);
                let len = (g1 * g).min(total) - g0 * g;
                self.scales
                    .f_narrow(0, g0 * g, len)?
                    .f_to_kind(Kind::Float)?
                    .f_constant_pad_nd([0, (g1 - g0) * g - len])?
                    .f_reshape([g1 - g0, g])?
                    .f_mul(&s2.f_narrow(0, g0, g1 - g0)?.f_unsqueeze(1)?)?
                    .f_reshape([-1])?
                    .f_narrow(0, b0 - g0 * g, nb)?
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

    /// Decodes the GGUF tensors of some rows (`codes`, `scales`, `mins`, `sub_scales`, `hbits`, all
    /// with leading dims `[rows, nb]`) into `[rows, in]` of `ck` (f32 for every kind but the
    /// 32-weight 4- and 8-bit ones, see [`compute_kind`]).
    fn decode_gguf(
        &self,
        codes: &Tensor,
        scales: &Tensor,
        mins: Option<&Tensor>,
        sub_scales: Option<&Tensor>,
        hbits: Option<&Tensor>,
        ck: Kind,
    ) -> std::result::Result<Tensor, tch::TchError> {
        let rows = codes.size()[0];
        let missing = |what: &str| {
            tch::TchError::Torch(format!("{:?} weight has no {what} tensor", self.kind))
        };
        let d = scales.f_to_kind(ck)?.f_unsqueeze(2)?;
        // the 5th (and 6th) bits, `[rows, nb, weights per block]` as `ck`, times 16
        let high = |bits: i64| -> std::result::Result<Tensor, tch::TchError> {
            let h = hbits.ok_or_else(|| missing("high-bit"))?;
            let per = 8 / bits;
            let shifts: Vec<u8> = (0..per).map(|i| (i * bits) as u8).collect();
            let shifts = Tensor::f_from_slice(&shifts)?.f_to_device(h.device())?;
            let size = h.size();
            h.f_unsqueeze(-1)?
                .f_bitwise_right_shift(&shifts)?
                .f_bitwise_and((1i64 << bits) - 1)?
                .f_reshape([size[0], size[1], size[2] * per])?
                .f_to_kind(ck)?
                .f_mul_scalar(16.0)
        };
        let w = match (self.kind, mins) {
            (QuantKind::Q8_0, _) => codes.f_to_kind(ck)?.f_mul(&d)?,
            (QuantKind::Q5_0, _) => self
                .decode_pairs(codes, ck)?
                .f_add(&high(1)?)?
                .f_sub_scalar(16.0)?
                .f_mul(&d)?,
            // m + q·d in one fused op (q·d is exact)
            (QuantKind::Q5_1, Some(m)) => m
                .f_to_kind(ck)?
                .f_unsqueeze(2)?
                .f_addcmul(&self.decode_pairs(codes, ck)?.f_add(&high(1)?)?, &d)?,
            (QuantKind::Q4_K | QuantKind::Q5_K, Some(dmin)) => {
                let sub = sub_scales.ok_or_else(|| missing("sub-block scale"))?;
                let mut q = self.decode_pairs(codes, ck)?;
                if self.kind == QuantKind::Q5_K {
                    q = q.f_add(&high(1)?)?;
                }
                let nb = codes.size()[1];
                let sub = sub.f_to_kind(ck)?.f_reshape([rows, nb, 2, 8])?;
                // d·sc and dmin·m are exact in f32; then (d·sc)·q − dmin·m rounds once
                let ds = sub.f_select(2, 0)?.f_mul(&d)?.f_unsqueeze(3)?;
                let dm = sub
                    .f_select(2, 1)?
                    .f_mul(&dmin.f_to_kind(ck)?.f_unsqueeze(2)?)?
                    .f_unsqueeze(3)?;
                q.f_reshape([rows, nb, 8, 32])?.f_mul(&ds)?.f_sub(&dm)?
            }
            (QuantKind::Q6_K, _) => {
                let sub = sub_scales.ok_or_else(|| missing("sub-block scale"))?;
                let nb = codes.size()[1];
                let q = self
                    .decode_pairs(codes, ck)?
                    .f_add(&high(2)?)?
                    .f_sub_scalar(32.0)?;
                let ds = sub.f_to_kind(ck)?.f_mul(&d)?.f_unsqueeze(3)?;
                q.f_reshape([rows, nb, 16, 16])?.f_mul(&ds)?
            }
            // Q4_1: m + q·d in one fused op
            (QuantKind::Q4_1, Some(m)) => m
                .f_to_kind(ck)?
                .f_unsqueeze(2)?
                .f_addcmul(&self.decode_pairs(codes, ck)?, &d)?,
            // Q4_0: the table already holds q − 8
            (QuantKind::Q4_0, _) => self.decode_pairs(codes, ck)?.f_mul(&d)?,
            _ => return Err(missing("minimum")),
        };
        w.f_reshape([rows, self.shape[1]])
    }

    /// Decodes fp8 e4m3fn bits (u8, any shape) to `ck` with libtorch's cast.
    fn decode_fp8(codes: &Tensor, ck: Kind) -> std::result::Result<Tensor, tch::TchError> {
        codes.f_view_dtype(Kind::Float8e4m3fn)?.f_to_kind(ck)
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
    /// f32 (and f64) results are bit-identical to the plain-Rust references
    /// ([`dequantize_gguf_reference`], [`nf4_reference_dequantize`], [`fp8_e4m3_to_f32`]); f16 /
    /// bf16 results of the 4- and 8-bit kinds are computed directly in that dtype (a table lookup,
    /// then one multiply per weight), which saves a full-size f32 pass and stays within 2⁻⁶ (bf16)
    /// / 2⁻⁹ (f16) relative of the f32 result (a few roundings); Q4_1 → bf16 and the 5- and 6-bit
    /// kinds are computed in f32 and rounded once; fp8 values are exact in every float dtype.
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
            QuantKind::Fp8E4m3 => Self::decode_fp8(&self.codes, ck),
            _ => self.decode_gguf(
                &self.codes,
                &self.scales,
                self.mins.as_ref(),
                self.sub_scales.as_ref(),
                self.hbits.as_ref(),
                ck,
            ),
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
            QuantKind::Fp8E4m3 => self
                .codes
                .f_index_select(0, &idx)
                .and_then(|c| Self::decode_fp8(&c, ck)),
            _ => (|| {
                let pick = |t: Option<&Tensor>| t.map(|t| t.f_index_select(0, &idx)).transpose();
                let codes = self.codes.f_index_select(0, &idx)?;
                let scales = self.scales.f_index_select(0, &idx)?;
                let mins = pick(self.mins.as_ref())?;
                let sub = pick(self.sub_scales.as_ref())?;
                let hbits = pick(self.hbits.as_ref())?;
                self.decode_gguf(
                    &codes,
                    &scales,
                    mins.as_ref(),
                    sub.as_ref(),
                    hbits.as_ref(),
                    ck,
                )
            })(),
        }
        .ctx(ctx)?;
        if kind == ck {
            Ok(w)
        } else {
            w.f_to_kind(kind).ctx(ctx)
        }
    }

    /// `x · Wᵀ` (`x` `[..., in]` → `[..., out]`), the frozen product of a linear layer, computed
    /// one tile of output rows at a time: no dense copy of `W` is kept, in the forward pass or
    /// for the backward one, and about [`crate::sys::QLINEAR_TILE_ELEMENTS`] weights are dense at
    /// a time (QLoRA's saving: bitsandbytes' `MatMul4Bit`, `bitsandbytes/autograd/_functions.py`,
    /// also dequantizes again in the backward instead of keeping the weight).
    ///
    /// On the CPU, for f32 and bf16 computation ([`QuantWeight::has_kernel`]), the tiles are
    /// decoded by the shim's kernel ([`crate::sys::qlinear`]); everywhere else (CUDA, f16, f64)
    /// by [`QuantWeight::linear_tiled`]'s tensor ops on the weight's device. The backward pass
    /// gives the input gradient `g · W` (the weight is frozen: no gradient for it) by decoding
    /// the tiles again. Under autocast the product is computed in the autocast dtype, as a plain
    /// matmul would be (a float64 input stays float64). Each value equals
    /// `x.linear(dequantize(W))` up to the GEMM's summation order.
    ///
    /// # Shapes
    /// `x` `[..., in]` → `[..., out]`, of `x`'s dtype (or the autocast dtype).
    ///
    /// # Errors
    /// [`Error::Shape`] when `x`'s last dimension is not `in`; [`Error::Torch`] when an op fails
    /// (e.g. `x` on another device than the weight, out of memory).
    pub fn linear(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_by(x, |x2, kind| {
            if x2.device() == Device::Cpu && self.has_kernel(kind) {
                crate::sys::qlinear(x2, &self.parts())
            } else {
                crate::sys::tiled_linear(x2, self.tiled_weight(crate::sys::QLINEAR_TILE_ELEMENTS))
            }
        })
    }

    /// [`QuantWeight::linear`] through the device-generic tiled path whatever the device and
    /// dtype (the path `linear` takes where the CPU kernel does not apply), with at most
    /// `tile_elements` weights dense at once (at least one row; an NF4 tile is a whole number of
    /// 64-weight blocks, and with double quantization, where it fits, of 256-block groups). Each
    /// tile is [`QuantWeight::narrow_rows`] then [`QuantWeight::dequantize`] in the product's
    /// dtype, multiplied with libtorch's GEMM ([`crate::sys::tiled_linear`]); the backward pass
    /// decodes the tiles again. For tests and benchmarks of that path on the CPU, and to pick
    /// another tile size.
    ///
    /// # Shapes
    /// As [`QuantWeight::linear`].
    ///
    /// # Errors
    /// As [`QuantWeight::linear`].
    pub fn linear_tiled(&self, x: &Tensor, tile_elements: u64) -> Result<Tensor> {
        self.linear_by(x, |x2, _| {
            crate::sys::tiled_linear(x2, self.tiled_weight(tile_elements))
        })
    }

    /// The common part of the linear products: checks `x` `[..., in]`, casts it to the product's
    /// dtype (autocast's for an f16 / bf16 / f32 input when autocast is on for its device, else
    /// its own) as `[n, in]`, runs `product(x2, dtype)` and gives the result `x`'s leading dims.
    fn linear_by(
        &self,
        x: &Tensor,
        product: impl FnOnce(&Tensor, Kind) -> crate::sys::ShimResult<Tensor>,
    ) -> Result<Tensor> {
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
        let autocast = crate::sys::autocast_state(x.device())
            .map_err(tch::TchError::from)
            .ctx(ctx)?;
        let kind = match (autocast.enabled, autocast.dtype, x.kind()) {
            (true, Some(k), Kind::Half | Kind::BFloat16 | Kind::Float) => k,
            _ => x.kind(),
        };
        let x2 = (|| {
            let x = if x.kind() == kind {
                x.shallow_clone()
            } else {
                x.f_to_kind(kind)?
            };
            x.f_reshape([-1, inn])
        })()
        .ctx(ctx)?;
        let y = product(&x2, kind).map_err(tch::TchError::from).ctx(ctx)?;
        let mut shape = size;
        if let Some(last) = shape.last_mut() {
            *last = out;
        }
        y.f_reshape(shape.as_slice()).ctx(ctx)
    }

    /// The tensors as a [`crate::sys::TiledWeight`]: tiles of whole rows, at most
    /// `tile_elements` weights (at least one row; NF4 tiles aligned as
    /// [`QuantWeight::linear_tiled`] says), each [`QuantWeight::narrow_rows`] (views of this
    /// weight's tensors) then [`QuantWeight::dequantize`].
    fn tiled_weight(&self, tile_elements: u64) -> crate::sys::TiledWeight {
        let [out, inn] = self.shape;
        let tile_rows = self.tile_rows(tile_elements);
        let w = self.shallow_clone();
        crate::sys::TiledWeight {
            out,
            inn,
            tile_rows,
            rows: Box::new(move |r0, r1, kind| {
                if r0 == 0 && r1 == out {
                    w.dequantize(kind)
                } else {
                    w.narrow_rows(r0, r1 - r0)?.dequantize(kind)
                }
            }),
        }
    }

    /// Output rows per tile of the tiled products ([`QuantWeight::linear`] off the CPU kernel,
    /// [`QuantWeight::matmul`]): `tile_elements / in` rows (at least one), at most `out`; for
    /// NF4 a multiple of the rows that make whole 64-weight blocks, and with double quantization
    /// of those that make whole groups of 256 blocks when such a tile fits (a tile starting
    /// inside a group would expand that group's constants). Every tile `r0 .. r0 + rows` (the
    /// last one shorter) is a valid [`QuantWeight::narrow_rows`] range.
    pub fn tile_rows(&self, tile_elements: u64) -> i64 {
        let [out, inn] = self.shape;
        let fit = (i64::try_from(tile_elements).unwrap_or(i64::MAX) / inn).max(1);
        fn gcd(a: i64, b: i64) -> i64 {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        let align = match self.kind {
            QuantKind::Nf4 { .. } => {
                let block = NF4_BLOCK as i64;
                let group = block * NF4_DQ_BLOCK as i64;
                let group_rows = group / gcd(inn, group);
                if self.dq_scales.is_some() && group_rows <= fit {
                    group_rows
                } else {
                    block / gcd(inn, block)
                }
            }
            _ => 1,
        };
        ((fit / align).max(1) * align).min(out)
    }

    /// A second handle on the same tensors (no copy).
    fn shallow_clone(&self) -> Self {
        let opt = |t: &Option<Tensor>| t.as_ref().map(Tensor::shallow_clone);
        Self {
            kind: self.kind,
            shape: self.shape,
            codes: self.codes.shallow_clone(),
            scales: self.scales.shallow_clone(),
            mins: opt(&self.mins),
            sub_scales: opt(&self.sub_scales),
            hbits: opt(&self.hbits),
            dq_scales: opt(&self.dq_scales),
            dq_offset: self.dq_offset,
            table: opt(&self.table),
        }
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
                QuantKind::Q5_0 => 5,
                QuantKind::Q5_1 => 6,
                QuantKind::Q4_K => 7,
                QuantKind::Q5_K => 8,
                QuantKind::Q6_K => 9,
                QuantKind::Fp8E4m3 => 10,
            },
            out,
            inn,
            codes: &self.codes,
            scales: &self.scales,
            mins: self.mins.as_ref(),
            sub_scales: self.sub_scales.as_ref(),
            hbits: self.hbits.as_ref(),
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
    /// `[n, in]`), without autograd, in `x`'s dtype, one tile of output rows at a time (at most
    /// about [`crate::sys::QLINEAR_TILE_ELEMENTS`] weights dense at once): the tiled CPU kernel
    /// ([`crate::sys::qmatmul`]) when [`QuantWeight::has_kernel`], else
    /// [`QuantWeight::dequantize`] of each tile's rows on the weight's device
    /// ([`crate::sys::tiled_matmul`]). For a frozen head evaluated in chunks.
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
            let tiles = self.tiled_weight(crate::sys::QLINEAR_TILE_ELEMENTS);
            return crate::sys::tiled_matmul(x, tiles, transposed)
                .map_err(tch::TchError::from)
                .ctx(ctx);
        }
        crate::sys::qmatmul(x, &self.parts(), transposed)
            .map_err(tch::TchError::from)
            .ctx(ctx)
    }
}

/// The dtype dequantization computes in for a requested output dtype. Q4_1 → bf16 goes through f32:
/// rounding the f16 min `m` to bf16 first would cost up to 2⁻⁸·|m| where `m + q·d` cancels. The
/// 5- and 6-bit kinds always compute in f32 (their products `d·sc·q` need up to 25 bits), then
/// round once; fp8 values are exact in f16, bf16 and f64. Other f64 requests compute in f32, so
/// they equal the f32 references exactly.
fn compute_kind(quant: QuantKind, kind: Kind) -> Kind {
    match (quant, kind) {
        (QuantKind::Q4_1, Kind::BFloat16) => Kind::Float,
        (
            QuantKind::Q5_0 | QuantKind::Q5_1 | QuantKind::Q4_K | QuantKind::Q5_K | QuantKind::Q6_K,
            _,
        ) => Kind::Float,
        (QuantKind::Fp8E4m3, Kind::Half | Kind::BFloat16 | Kind::Double) => kind,
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

    const GGUF_KINDS: [QuantKind; 8] = [
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q4_K,
        QuantKind::Q5_K,
        QuantKind::Q6_K,
    ];

    const ALL_KINDS: [QuantKind; 11] = [
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q4_K,
        QuantKind::Q5_K,
        QuantKind::Q6_K,
        QuantKind::Nf4 {
            double_quant: false,
        },
        QuantKind::Nf4 { double_quant: true },
        QuantKind::Fp8E4m3,
    ];

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
        let (out, inn) = (6i64, 512i64);
        let x = pseudo_random((out * inn) as usize, 7);
        for kind in GGUF_KINDS {
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
            // half a step of the block's range (plus the 6-bit scale rounding of the k-quants)
            let bound = match kind {
                QuantKind::Q8_0 => 1.0 / 127.0,
                QuantKind::Q5_0 | QuantKind::Q5_1 => 2.0 / 31.0,
                QuantKind::Q6_K => 2.0 / 31.0,
                _ => 2.0 / 15.0,
            };
            assert!(max_err <= bound, "{kind:?} max error {max_err}");
            assert!(max_err > 0.0);
        }
    }

    #[test]
    fn blocks_taken_apart_on_several_threads_equal_one_threads() {
        // 8192 blocks of 32 (or 1024 of 256): runs of uneven length on 3 threads
        let (out, inn) = (32i64, 8192i64);
        let x = pseudo_random((out * inn) as usize, 11);
        for kind in GGUF_KINDS {
            let (bb, bw) = gguf_layout(kind).unwrap();
            let raw = quantize_gguf_reference(kind, &x).unwrap();
            let one = unpack_blocks_on(kind, &raw, bb, bw, 1).unwrap();
            let three = unpack_blocks_on(kind, &raw, bb, bw, 3).unwrap();
            assert!(
                !one.q.is_empty() && one.d.iter().any(|&b| b != 0),
                "{kind:?}"
            );
            assert!(
                one.d == three.d
                    && one.m == three.m
                    && one.sub == three.sub
                    && one.h == three.h
                    && one.q == three.q,
                "{kind:?}"
            );
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
            (QuantKind::Q5_0, 22.0 / 32.0),
            (QuantKind::Q5_1, 24.0 / 32.0),
            (QuantKind::Q4_K, 148.0 / 256.0),
            (QuantKind::Q5_K, 180.0 / 256.0),
            (QuantKind::Q6_K, 210.0 / 256.0),
            (QuantKind::Fp8E4m3, 1.0),
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
            let extra = if !matches!(kind, QuantKind::Q8_0 | QuantKind::Fp8E4m3) {
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
        let w = Tensor::f_from_slice(&pseudo_random(64 * 256, 9))
            .unwrap()
            .reshape([64, 256]);
        for kind in ALL_KINDS {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let f = q.dequantize(Kind::Float).unwrap();
            for (k, ulp) in [(Kind::BFloat16, 2f64.powi(-6)), (Kind::Half, 2f64.powi(-9))] {
                let h = q.dequantize(k).unwrap();
                assert_eq!(h.kind(), k);
                let rel = (h.to_kind(Kind::Float) - &f).abs() / (f.abs() + 1e-6);
                let worst = f64::try_from(rel.max()).unwrap();
                assert!(worst <= ulp, "{kind:?} {k:?}: {worst}");
            }
            let d = q.dequantize(Kind::Double).unwrap();
            assert_eq!(d.kind(), Kind::Double);
            assert!(d.equal(&f.to_kind(Kind::Double)), "{kind:?} f64");
        }
    }

    #[test]
    fn dequantize_rows_matches_full() {
        let w = Tensor::f_from_slice(&pseudo_random(10 * 256, 5))
            .unwrap()
            .reshape([10, 256]);
        let ids = Tensor::f_from_slice(&[3i64, 0, 9, 3]).unwrap();
        for kind in ALL_KINDS {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let full = q.dequantize(Kind::Float).unwrap().index_select(0, &ids);
            let rows = q.dequantize_rows(&ids, Kind::Float).unwrap();
            assert!(full.equal(&rows), "{kind:?}");
        }
    }

    /// Row slices stay quantized and equal the dequantized matrix's rows, bit for bit, for every
    /// kind; stacking them back gives the whole weight; they run through the CPU kernel.
    #[test]
    fn narrow_rows_equals_dequantize_then_narrow() {
        // 12 rows of 512: NF4 blocks of 64 never straddle rows; 12·512/64 = 96 blocks, so a
        // double-quant slice starting at row 4 (block 32) is not aligned to a group of 256
        let (out, inn) = (12i64, 512i64);
        let w = Tensor::f_from_slice(&pseudo_random((out * inn) as usize, 21))
            .unwrap()
            .reshape([out, inn]);
        let x = Tensor::f_from_slice(&pseudo_random(3 * inn as usize, 22))
            .unwrap()
            .reshape([3, inn]);
        for kind in ALL_KINDS {
            let q = QuantWeight::quantize(&w, kind).unwrap();
            let full = q.dequantize(Kind::Float).unwrap();
            for (start, len) in [(0, 4), (4, 5), (9, 3), (0, 12)] {
                let s = q.narrow_rows(start, len).unwrap();
                assert_eq!(s.shape(), [len, inn]);
                let want = full.narrow(0, start, len);
                assert!(
                    s.dequantize(Kind::Float).unwrap().equal(&want),
                    "{kind:?} rows {start}+{len}"
                );
                // the tiled kernel reads the views
                let y = s.linear(&x).unwrap();
                let y_ref = x.matmul(&want.tr());
                let err = f64::try_from((y - &y_ref).abs().max()).unwrap();
                assert!(
                    err < 1e-4,
                    "{kind:?} rows {start}+{len}: kernel error {err}"
                );
                if matches!(kind, QuantKind::Nf4 { double_quant: true }) {
                    // only a slice starting a group of 256 blocks keeps the 8-bit constants
                    assert_eq!(
                        s.kind(),
                        QuantKind::Nf4 {
                            double_quant: start == 0
                        }
                    );
                } else {
                    assert_eq!(s.kind(), kind);
                }
            }
            if !matches!(kind, QuantKind::Nf4 { .. }) {
                let (a, b, c) = (
                    q.narrow_rows(0, 4).unwrap(),
                    q.narrow_rows(4, 5).unwrap(),
                    q.narrow_rows(9, 3).unwrap(),
                );
                // reordered halves, as BFL's final modulation is stored
                let back = QuantWeight::cat_rows(&[&c, &a, &b]).unwrap();
                assert_eq!(back.shape(), [12, inn]);
                assert_eq!(back.storage_bytes(), q.storage_bytes(), "{kind:?}");
                let want = Tensor::cat(
                    &[
                        full.narrow(0, 9, 3),
                        full.narrow(0, 0, 4),
                        full.narrow(0, 4, 5),
                    ],
                    0,
                );
                assert!(
                    back.dequantize(Kind::Float).unwrap().equal(&want),
                    "{kind:?}"
                );
            } else {
                assert!(QuantWeight::cat_rows(&[&q]).is_err());
            }
            assert!(q.narrow_rows(10, 3).is_err());
            assert!(q.narrow_rows(0, 0).is_err());
        }
        // NF4 slices must not cut a block of 64
        let narrow = Tensor::ones([8, 32], (Kind::Float, Device::Cpu));
        let q = QuantWeight::quantize(
            &narrow,
            QuantKind::Nf4 {
                double_quant: false,
            },
        )
        .unwrap();
        let e = q.narrow_rows(1, 2).unwrap_err().to_string();
        assert!(e.contains("multiples of 64"), "{e}");
        assert!(q.narrow_rows(2, 4).is_ok());
        // mixed kinds are refused
        let a = QuantWeight::quantize(&w, QuantKind::Q8_0).unwrap();
        let b = QuantWeight::quantize(&w, QuantKind::Q4_0).unwrap();
        assert!(QuantWeight::cat_rows(&[&a, &b]).is_err());
        assert!(QuantWeight::cat_rows(&[]).is_err());
    }

    #[test]
    fn wrong_sizes_are_refused() {
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q8_0, &[0u8; 33], [1, 32], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("34"), "{e}");
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q4_0, &[0u8; 18], [1, 30], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("multiple of 32"), "{e}");
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q4_K, &[0u8; 144], [1, 128], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("multiple of 256"), "{e}");
        let e = QuantWeight::from_gguf_blocks(QuantKind::Q6_K, &[0u8; 209], [1, 256], Device::Cpu)
            .unwrap_err();
        assert!(e.to_string().contains("210"), "{e}");
        assert!(dequantize_gguf_reference(QuantKind::Fp8E4m3, &[]).is_err());
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
