//! The decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU, and the causal-LM head.
//!
//! Follows transformers' `models/llama/modeling_llama.py` (and `qwen2`, `qwen3`) so that logits
//! match it: RMSNorm (Zhang & Sennrich, arXiv:1910.07467) computed in f32; RoPE (Su et al.,
//! arXiv:2104.09864) in HF's "rotate half" layout; GQA (Ainslie et al., arXiv:2305.13245) with
//! kv heads repeated `n_head / n_kv` times; SwiGLU (Shazeer, arXiv:2002.05202)
//! `down(silu(gate(x)) ⊙ up(x))`; pre-norm residual blocks.

use std::collections::HashMap;
use std::path::Path;

use lora_core::base::BaseWeight;
use lora_core::embedding::LoraEmbedding;
use lora_core::inject::{Adaptable, SiteMut};
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use lora_core::quant::QuantKind;
use tch::{Device, Kind, Tensor};

use super::config::LlamaConfig;
use super::weights::hf_to_gguf_name;
use crate::checkpoint::SegmentTape;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::weights::{
    GgufSource, QuantizeOnLoad, SafetensorsFiles, TensorMap, TensorSource, WeightMode, WeightPath,
};

/// The label value that [`Llama::loss`] ignores (PyTorch's `ignore_index` default, HF's
/// convention for prompt and padding positions).
pub const IGNORE_INDEX: i64 = -100;

/// Bytes of fp32 logits per chunk of [`Llama::loss`]'s fused head + cross-entropy (32 MiB:
/// 170 rows at SmolLM2's 49,152-token vocabulary, 65 at Llama 3's 128,256; never fewer than 16);
/// the memory planner charges the same ([`lora_memory::estimate::OURS_CE_CHUNK_BYTES`]).
pub const FUSED_CE_CHUNK_BYTES: i64 = lora_memory::estimate::OURS_CE_CHUNK_BYTES as i64;

/// RMSNorm: `y = w ⊙ x / sqrt(mean(x²) + ε)`, the normalisation in f32, the result cast back to
/// the input dtype before the weight is applied (HF `LlamaRMSNorm`).
#[derive(Debug)]
pub(crate) struct RmsNorm {
    pub(crate) weight: Tensor,
    pub(crate) eps: f64,
}

impl RmsNorm {
    /// On the CPU an f32 input with an f32 weight takes the fused op ([`lora_core::sys::rms_norm`]:
    /// one loop each way, the same values up to rounding); anything else libtorch's ops.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let kind = x.kind();
        if kind == Kind::Float
            && x.device() == Device::Cpu
            && self.weight.kind() == Kind::Float
            && self.weight.device() == Device::Cpu
        {
            return Ok(lora_core::sys::rms_norm(x, &self.weight, self.eps)?);
        }
        let xf = x.f_to_kind(Kind::Float)?;
        let var = xf.f_square()?.f_mean_dim(-1, true, Kind::Float)?;
        let y = xf
            .f_mul(&var.f_add_scalar(self.eps)?.f_rsqrt()?)?
            .f_to_kind(kind)?;
        Ok(y.f_mul(&self.weight)?)
    }

    pub(crate) fn bytes(&self) -> u64 {
        tensor_bytes(&self.weight)
    }
}

use lora_core::linear::SiblingOutputs;
use lora_core::sys::tensor_bytes;

/// The frozen head of [`Llama::head_loss`]: dense `w` `[V, d]` with its transpose; a quantized
/// weight that the CPU kernel multiplies chunk by chunk (`QuantWeight::matmul`); or a quantized
/// weight without that kernel (CUDA, f16, f64), decoded one vocabulary tile at a time
/// ([`vocab_tiled_head`]).
enum HeadWeight<'a> {
    Dense { w: Tensor, wt: Tensor },
    Quant(&'a lora_core::quant::QuantWeight),
    QuantTiles(&'a lora_core::quant::QuantWeight),
}

use crate::weights::Site;

/// `[x1, x2] → [−x2, x1]` on the last dim (HF `rotate_half`).
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.size().last().copied().unwrap_or(0) / 2;
    let x1 = x.f_narrow(-1, 0, half)?;
    let x2 = x.f_narrow(-1, half, half)?;
    Ok(Tensor::f_cat(&[x2.f_neg()?, x1], -1)?)
}

/// `silu(g)·u` by [`lora_core::sys::silu_mul`] (saving g and u only), or libtorch's ops where g and
/// u differ in dtype or device.
fn silu_mul(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    if g.kind() == u.kind() && g.device() == u.device() {
        Ok(lora_core::sys::silu_mul(g, u)?)
    } else {
        Ok(g.f_silu()?.f_mul(u)?)
    }
}

/// `x·cos + rotate_half(x)·sin` (HF `apply_rotary_pos_emb`) for `x` `[b, heads, s, hd]`; an f32
/// `x` on the CPU with constant f32 tables takes the fused op ([`lora_core::sys::rope`]).
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let f32_cpu = |t: &Tensor| t.kind() == Kind::Float && t.device() == Device::Cpu;
    if f32_cpu(x)
        && f32_cpu(cos)
        && f32_cpu(sin)
        && x.dim() == 4
        && cos.dim() == 4
        && cos.size() == sin.size()
        && (0..3).all(|i| cos.size()[i] == 1 || cos.size()[i] == x.size()[i])
        && cos.size()[3] == x.size()[3]
        && !cos.requires_grad()
        && !sin.requires_grad()
    {
        return Ok(lora_core::sys::rope(x, cos, sin)?);
    }
    Ok(x.f_mul(cos)?.f_add(&rotate_half(x)?.f_mul(sin)?)?)
}

/// One layer's cached keys and values `[batch, n_kv_heads, past, head_dim]`.
#[derive(Debug, Default)]
struct LayerCache {
    kv: Option<(Tensor, Tensor)>,
}

/// Keys and values of the tokens seen so far, for incremental decoding.
#[derive(Debug)]
pub struct KvCache {
    layers: Vec<LayerCache>,
    len: i64,
}

impl KvCache {
    /// An empty cache for a model with `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self {
            layers: (0..n_layers).map(|_| LayerCache::default()).collect(),
            len: 0,
        }
    }

    /// Number of cached positions.
    pub fn seq_len(&self) -> i64 {
        self.len
    }

    /// Bytes held by the cached tensors.
    pub fn bytes(&self) -> u64 {
        self.layers
            .iter()
            .filter_map(|l| l.kv.as_ref())
            .map(|(k, v)| tensor_bytes(k) + tensor_bytes(v))
            .sum()
    }
}

#[derive(Debug)]
struct Attention {
    q_proj: Site<LoraLinear>,
    k_proj: Site<LoraLinear>,
    v_proj: Site<LoraLinear>,
    /// q, k and v's dense weights in one `[q + 2·kv, d]` tensor, the three bases being views of
    /// it: their frozen products are one GEMM ([`fused_products`]).
    qkv: Option<Tensor>,
    /// `qkv`'s cast to the autocast dtype, kept across forwards when enabled.
    qkv_cast: CastCache,
    o_proj: Site<LoraLinear>,
    /// o_proj's dense weight cast to the autocast dtype, kept across forwards when enabled.
    o_cast: CastCache,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    n_head: i64,
    n_kv: i64,
    head_dim: i64,
}

impl Attention {
    /// `x` `[b, s, d]`; `cos`/`sin` `[b, 1, s, hd]`; `mask` additive `[b, 1, s, past + s]` (0 =
    /// attend, −∞ = masked; see [`Llama::mask`]), or `None` for plain causal attention without a
    /// cache (SDPA's `is_causal`).
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        train: bool,
    ) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let heads = |t: Tensor, n: i64, norm: &Option<RmsNorm>| -> Result<Tensor> {
            let t = t.f_view([b, s, n, self.head_dim])?;
            let t = match norm {
                Some(nm) => nm.forward(&t)?,
                None => t,
            };
            Ok(t.f_transpose(1, 2)?)
        };
        let sites = [&self.q_proj, &self.k_proj, &self.v_proj];
        let [q, k, v] = sibling_forward(self.qkv.as_ref(), &self.qkv_cast, &sites, x, train)?;
        let q = heads(q, self.n_head, &self.q_norm)?;
        let k = heads(k, self.n_kv, &self.k_norm)?;
        // v in a storage of its own (a no-op for the per-site path's v): as a view of the fused
        // q/k/v output, the attention's saved v would keep the whole output (q + 2·kv wide)
        // alive until the backward pass; q and k come out of RoPE as new tensors anyway
        let v = heads(v.f_contiguous()?, self.n_kv, &None)?;
        let q = apply_rope(&q, cos, sin)?;
        let mut k = apply_rope(&k, cos, sin)?;
        let mut v = v;
        if let Some(c) = cache {
            if let Some((pk, pv)) = &c.kv {
                k = Tensor::f_cat(&[pk, &k], 2)?;
                v = Tensor::f_cat(&[pv, &v], 2)?;
            }
            c.kv = Some((k.shallow_clone(), v.shallow_clone()));
        }
        let dev = q.device();
        let rep = self.n_head / self.n_kv;
        // On the CPU the kernel reads grouped keys/values as they are (`enable_gqa`): no
        // expanded copy, none saved for the backward, no sum of the expanded gradients.
        let native_gqa = rep > 1 && dev == Device::Cpu;
        let repeat = |t: &Tensor| -> Result<Tensor> {
            if rep == 1 || native_gqa {
                return Ok(t.shallow_clone());
            }
            let sz = t.size();
            // HF `repeat_kv`: query head h reads kv head h / rep.
            Ok(t.f_unsqueeze(2)?
                .f_expand([sz[0], sz[1], rep, sz[2], sz[3]], false)?
                .f_reshape([sz[0], sz[1] * rep, sz[2], sz[3]])?)
        };
        let (k, v) = (repeat(&k)?, repeat(&v)?);
        // what SDPA would return: the autocast dtype under autocast, else the query's
        let autocast = lora_core::sys::autocast_state(dev)?;
        let out_kind = match (autocast.enabled, autocast.dtype) {
            (true, Some(k)) => k,
            _ => q.kind(),
        };
        // bf16 on the CPU (autocast or a bf16 model): attention runs in f32 outside autocast
        // (see [`attention_kind`]), its output rounded to bf16 as the bf16 kernel's would be.
        let widen = attention_kind(dev, q.kind(), train)? == Kind::Float && out_kind != Kind::Float;
        let _f32_attention = if widen {
            Some(lora_core::sys::AutocastGuard::with_enabled(
                dev,
                Kind::BFloat16,
                false,
            )?)
        } else {
            None
        };
        let (q, k, v) = if widen {
            (
                q.f_to_kind(Kind::Float)?,
                k.f_to_kind(Kind::Float)?,
                v.f_to_kind(Kind::Float)?,
            )
        } else {
            (q, k, v)
        };
        // SDPA wants a float mask in the dtype it computes in: under autocast (which lists SDPA)
        // the autocast dtype, the mask's already, so autocast leaves it as it is; otherwise the
        // query's. The model builds it in that dtype ([`attention_kind`]), so this cast (a copy
        // per layer, kept for the backward) only happens if they differ.
        let cast;
        let mask = match mask {
            Some(m) if m.kind() != q.kind() && !lora_core::sys::autocast_state(dev)?.enabled => {
                cast = m.f_to_kind(q.kind())?;
                Some(&cast)
            }
            m => m,
        };
        // Plain causal f32 attention on the CPU: lora-core's kernel where it applies (short
        // sequences, AVX2 CPUs), libtorch's SDPA otherwise; both leave the output
        // `[b, s, heads, head_dim]` in memory, so the reshape below is a view.
        let y = if mask.is_none()
            && !lora_core::sys::autocast_state(dev)?.enabled
            && lora_core::sys::causal_attention_applies(&q, &k, &v)
        {
            lora_core::sys::causal_attention(&q, &k, &v)?
        } else {
            Tensor::f_scaled_dot_product_attention(
                &q,
                &k,
                &v,
                mask,
                0.0,
                mask.is_none(),
                None,
                native_gqa,
            )?
            .f_transpose(1, 2)?
        };
        let y = y.f_reshape([b, s, self.n_head * self.head_dim])?;
        let y = if widen { y.f_to_kind(out_kind)? } else { y };
        drop(_f32_attention);
        single_forward(&self.o_proj, &self.o_cast, &y, train)
    }
}

/// The dtype attention computes in for activations of `kind` on `device`: the autocast dtype
/// when autocast is on, else `kind` — except a training forward (`train`) in bf16 on the CPU,
/// which runs in f32: libtorch's CPU flash attention took 1.9× as long for its bf16 backward
/// as for its f32 one (`[2, 9, 128, 64]` causal, 2 threads, AVX-512 EPYC: 5.8 against 3.1 ms),
/// while the bf16 forward alone is as fast (1.2 against 1.3 ms), so inference stays in bf16.
/// The f32 result is at least as exact; what follows reads it rounded to bf16, as the bf16
/// kernel would have returned it. Both passes of activation checkpointing are training
/// forwards, so they compute the same values.
///
/// # Errors
/// [`crate::Error`] when the autocast state cannot be read.
fn attention_kind(device: Device, kind: Kind, train: bool) -> Result<Kind> {
    let autocast = lora_core::sys::autocast_state(device)?;
    let kind = match (autocast.enabled, autocast.dtype) {
        (true, Some(k)) => k,
        _ => kind,
    };
    Ok(
        if train && device == Device::Cpu && kind == Kind::BFloat16 {
            Kind::Float
        } else {
            kind
        },
    )
}

#[derive(Debug)]
struct Mlp {
    gate_proj: Site<LoraLinear>,
    up_proj: Site<LoraLinear>,
    /// gate and up's dense weights in one `[2·ff, d]` tensor (see [`Attention::qkv`]).
    gate_up: Option<Tensor>,
    /// `gate_up`'s cast to the autocast dtype, kept across forwards when enabled.
    gate_up_cast: CastCache,
    down_proj: Site<LoraLinear>,
    /// down_proj's dense weight cast to the autocast dtype, kept across forwards when enabled.
    down_cast: CastCache,
}

impl Mlp {
    /// `down(silu(gate(x)) ⊙ up(x))`, the product by [`lora_core::sys::swiglu`] (its node keeps
    /// gate and up, not `silu(gate)`); over the fused gate/up product it reads both as one tensor.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let sites = [&self.gate_proj, &self.up_proj];
        let h = match fused_products(self.gate_up.as_ref(), &self.gate_up_cast, &sites, x)? {
            Some(base_out) => {
                let layers: Vec<&LoraLinear> = sites.iter().map(|s| &***s).collect();
                match LoraLinear::forward_siblings_grouped(&layers, x, base_out, train)? {
                    SiblingOutputs::Joined(gu) => lora_core::sys::swiglu(&gu)?,
                    SiblingOutputs::Split(parts) => match parts.as_slice() {
                        [g, u] => silu_mul(g, u)?,
                        _ => {
                            return Err(crate::Error::InvalidArgument(format!(
                                "{} outputs for the gate and up projections",
                                parts.len()
                            )));
                        }
                    },
                }
            }
            None => silu_mul(
                &self.gate_proj.forward_t(x, train)?,
                &self.up_proj.forward_t(x, train)?,
            )?,
        };
        single_forward(&self.down_proj, &self.down_cast, &h, train)
    }
}

/// Dense weights of sibling projections that read the same input, concatenated along their
/// outputs, and each sibling's base as a view of the result (same values, one storage): `None`
/// when a base is not dense (quantized bases keep their own kernel) or the shapes differ.
fn fuse_bases(bases: Vec<BaseWeight>) -> Result<(Vec<BaseWeight>, Option<Tensor>)> {
    let dense: Vec<&Tensor> = bases
        .iter()
        .filter_map(|b| match b {
            BaseWeight::Dense(t) => Some(t),
            BaseWeight::Quant(_) | BaseWeight::Offloaded(_) => None,
        })
        .collect();
    let same = dense.len() == bases.len()
        && dense.windows(2).all(|w| {
            w[0].kind() == w[1].kind()
                && w[0].device() == w[1].device()
                && w[0].size().get(1) == w[1].size().get(1)
        });
    if !same || dense.len() < 2 {
        return Ok((bases, None));
    }
    let fused = Tensor::f_cat(&dense, 0)?;
    drop(dense);
    let mut views = Vec::with_capacity(bases.len());
    let mut at = 0;
    for b in &bases {
        let rows = b.shape()[0];
        views.push(BaseWeight::Dense(fused.f_narrow(0, at, rows)?));
        at += rows;
    }
    Ok((views, Some(fused)))
}

/// The first `r·v` elements of an f32 buffer's bytes as a `[r, v]` tensor of the 16-bit `kind`
/// (a view: writing it overwrites the buffer).
fn as_16bit(buf: &Tensor, r: i64, v: i64, kind: Kind) -> Result<Tensor> {
    Ok(buf
        .f_view([-1])?
        .f_view_dtype(kind)?
        .f_narrow(0, 0, r * v)?
        .f_view([r, v])?)
}

/// Vocabulary rows of the head widened to f32 at a time by [`bf16_logits_by_f32`] and
/// [`bf16_input_grad_by_f32`]: 8 Ki rows (18 MiB at a width of 576).
const HEAD_F32_SLICE_ROWS: i64 = 8192;

/// `x·Wᵀ` as a bf16 GEMM gives it (bf16 operands, f32 sums, each logit rounded to bf16), as f32
/// `[r, V]`, computed by f32 GEMMs over slices of [`HEAD_F32_SLICE_ROWS`] rows of `W` widened
/// from bf16 — libtorch's bf16 GEMM on a CPU without AVX-512 runs scalar loops
/// ([`lora_core::linear::linear_product`]). `x` `[r, d]` and `w` `[V, d]` bf16; no autograd.
fn bf16_logits_by_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let _f32 = lora_core::sys::AutocastGuard::with_enabled(x.device(), Kind::BFloat16, false)?;
    let v = w.size()[0];
    let xf = x.f_to_kind(Kind::Float)?;
    let mut out = Tensor::f_empty([x.size()[0], v], (Kind::Float, x.device()))?;
    let mut s = 0;
    while s < v {
        let n = HEAD_F32_SLICE_ROWS.min(v - s);
        let ws = w.f_narrow(0, s, n)?.f_to_kind(Kind::Float)?;
        out.f_narrow(1, s, n)?.f_copy_(&xf.f_mm(&ws.f_tr()?)?)?;
        s += n;
    }
    // round every logit to bf16, as the bf16 GEMM's result
    out.f_copy_(&out.f_to_kind(Kind::BFloat16)?)?;
    Ok(out)
}

/// `round(g)·W` as a bf16 GEMM gives it (the f32 `g` `[r, V]` rounded to bf16, f32 sums over
/// the vocabulary, the result `[r, d]` rounded to bf16), by f32 GEMMs over slices of `w` `[V, d]`
/// (bf16) as [`bf16_logits_by_f32`]. No autograd.
fn bf16_input_grad_by_f32(g: &Tensor, w: &Tensor) -> Result<Tensor> {
    let _f32 = lora_core::sys::AutocastGuard::with_enabled(g.device(), Kind::BFloat16, false)?;
    let v = w.size()[0];
    let gf = g.f_to_kind(Kind::BFloat16)?.f_to_kind(Kind::Float)?;
    let mut acc = Tensor::f_zeros([g.size()[0], w.size()[1]], (Kind::Float, g.device()))?;
    let mut s = 0;
    while s < v {
        let n = HEAD_F32_SLICE_ROWS.min(v - s);
        let ws = w.f_narrow(0, s, n)?.f_to_kind(Kind::Float)?;
        let _ = acc.f_addmm_(&gf.f_narrow(1, s, n)?, &ws)?;
        s += n;
    }
    Ok(acc.f_to_kind(Kind::BFloat16)?)
}

/// The fused head + cross-entropy over a quantized head that the CPU kernel does not multiply
/// (a weight on CUDA; f16 or f64 products): rows `[n, d]` (the normed hidden states of the
/// predicting positions, no graph), their labels `idx` `[n, 1]` int64 (clamped to ≥ 0) and
/// `valid` `[n, 1]` f32 (1 where the label counts). Returns the sum over valid rows of
/// `logsumexp − logit[label]` (0-d f32; f64 for f64 products) and, with `want_grad`, the rows'
/// gradient `(softmax − onehot)·W · valid · inv` `[n, d]` in `mm_kind`, summed over the tiles in
/// f32 (f64) and rounded once.
///
/// The weight is decoded one tile of [`QuantWeight::tile_rows`] vocabulary rows at a time
/// (at most [`lora_core::sys::QLINEAR_TILE_ELEMENTS`] weights dense at once, in `mm_kind`), and
/// the rows go in chunks whose `[rows, tile]` f32 logits stay within [`FUSED_CE_CHUNK_BYTES`]
/// (at least 16 rows). Per chunk, a first pass over the tiles keeps a running maximum and sum
/// of exponentials per row (the online log-sum-exp of Milakov & Gimelshein, arXiv:1805.02867)
/// and each row's target logit; a second pass decodes each tile again, recomputes its logits
/// and adds `(softmax − onehot)·W_tile` to an f32 accumulator. So each chunk decodes the head
/// twice, whatever the number of chunks the CPU path would use, and computes the head's logits
/// twice (one GEMM more than the dense path); nothing `[V, d]`-sized is ever dense.
///
/// [`QuantWeight::tile_rows`]: lora_core::quant::QuantWeight::tile_rows
fn vocab_tiled_head(
    q: &lora_core::quant::QuantWeight,
    rows: &Tensor,
    idx: &Tensor,
    valid: &Tensor,
    mm_kind: Kind,
    want_grad: bool,
    inv: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let [v, d] = q.shape();
    let dev = rows.device();
    let n = rows.size()[0];
    // logits, statistics and the gradient's sums in f32, or f64 for f64 products
    let acc = if mm_kind == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    };
    let tile = q.tile_rows(lora_core::sys::QLINEAR_TILE_ELEMENTS).max(1);
    let chunk = (FUSED_CE_CHUNK_BYTES / (4 * tile))
        .clamp(16, n.max(16))
        .min(n);
    let decode = |v0: i64| -> Result<(i64, Tensor)> {
        let len = tile.min(v - v0);
        Ok((len, q.narrow_rows(v0, len)?.dequantize(mm_kind)?))
    };
    // f32 logits of `x` against the tile `w` starting at vocabulary row `v0`, with each row's
    // label as an index into the tile and whether it falls inside it (f32 0/1).
    let tile_logits = |x: &Tensor, w: &Tensor, ix: &Tensor, v0: i64, len: i64| {
        let lg = x.f_mm(&w.f_tr()?)?.f_to_kind(acc)?;
        let inside = ix.f_ge(v0)?.f_logical_and(&ix.f_lt(v0 + len)?)?;
        let local = ix.f_sub_scalar(v0)?.f_clamp(0, len - 1)?;
        Ok::<_, Error>((lg, local, inside.f_to_kind(acc)?))
    };
    let mut total = Tensor::f_zeros([], (acc, dev))?;
    let grad = if want_grad {
        Some(Tensor::f_zeros([n, d], (mm_kind, dev))?)
    } else {
        None
    };
    let mut start = 0;
    while start < n {
        let r = chunk.min(n - start);
        let x = rows.f_narrow(0, start, r)?.f_to_kind(mm_kind)?;
        let ix = idx.f_narrow(0, start, r)?;
        let vf = valid.f_narrow(0, start, r)?;
        let mut max = Tensor::f_full([r, 1], f64::NEG_INFINITY, (acc, dev))?;
        let mut sum = Tensor::f_zeros([r, 1], (acc, dev))?;
        let mut target = Tensor::f_zeros([r, 1], (acc, dev))?;
        let mut v0 = 0;
        while v0 < v {
            let (len, w) = decode(v0)?;
            let (lg, local, inside) = tile_logits(&x, &w, &ix, v0, len)?;
            let new_max = max.f_maximum(&lg.f_amax([-1i64].as_slice(), true)?)?;
            let kept = max.f_sub(&new_max)?.f_exp()?;
            let tile_sum =
                lg.f_sub(&new_max)?
                    .f_exp()?
                    .f_sum_dim_intlist([-1i64].as_slice(), true, acc)?;
            sum = sum.f_mul(&kept)?.f_add(&tile_sum)?;
            max = new_max;
            target = target.f_add(&lg.f_gather(1, &local, false)?.f_mul(&inside)?)?;
            v0 += len;
        }
        let lse = max.f_add(&sum.f_log()?)?;
        total = total.f_add(&lse.f_sub(&target)?.f_mul(&vf)?.f_sum(acc)?)?;
        if let Some(g) = &grad {
            // the chunk's sums: in the gradient rows themselves when they are f32 / f64, else
            // in an f32 buffer rounded into them once
            let rows_out = g.f_narrow(0, start, r)?;
            let mut sums = if mm_kind == acc {
                rows_out.shallow_clone()
            } else {
                Tensor::f_zeros([r, d], (acc, dev))?
            };
            let scale = vf.f_mul_scalar(inv)?;
            let mut v0 = 0;
            while v0 < v {
                let (len, w) = decode(v0)?;
                let (mut p, local, inside) = tile_logits(&x, &w, &ix, v0, len)?;
                // softmax − onehot(label), times valid / n_valid per row
                let _ = p.f_sub_(&lse)?.f_exp_()?;
                let _ = p.f_scatter_add_(1, &local, &inside.f_neg()?)?;
                let _ = p.f_mul_(&scale)?;
                let part = p.f_to_kind(mm_kind)?.f_mm(&w)?;
                let _ = sums.f_add_(&part)?;
                v0 += len;
            }
            if mm_kind != acc {
                rows_out.shallow_clone().f_copy_(&sums)?;
            }
        }
        start += r;
    }
    Ok((total, grad))
}

/// A frozen f32 weight's cast to a 16-bit dtype, kept across forwards while enabled
/// ([`Llama::set_frozen_cast_cache`]): under autocast the weight is cast on every use — the
/// same values each step, as the weight is frozen. Keyed by the source's storage and the dtype,
/// so a replaced weight is cast afresh; a weight written in place (a merge) is not seen by the
/// key, so every mutable visit of the model's sites empties the caches first
/// ([`Llama::visit_sites`](lora_core::inject::Adaptable::visit_sites)). Disabled (the
/// default), it casts on every call.
#[derive(Debug, Default)]
struct CastCache(Option<std::sync::Mutex<Option<(usize, Kind, Tensor)>>>);

impl CastCache {
    fn enabled(on: bool) -> Self {
        Self(on.then(Default::default))
    }

    /// `w` in `kind`: `w` itself when it has that dtype, else its (cached) cast.
    fn cast(&self, w: &Tensor, kind: Kind) -> Result<Tensor> {
        if w.kind() == kind {
            return Ok(w.shallow_clone());
        }
        let Some(slot) = &self.0 else {
            return Ok(w.f_to_kind(kind)?);
        };
        let mut slot = slot
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let key = w.data_ptr() as usize;
        if let Some((k, d, t)) = slot.as_ref()
            && *k == key
            && *d == kind
            && t.size() == w.size()
        {
            return Ok(t.shallow_clone());
        }
        let t = w.f_to_kind(kind)?;
        *slot = Some((key, kind, t.shallow_clone()));
        Ok(t)
    }

    /// Drops the kept cast (the cache stays enabled or disabled as it was).
    fn clear(&self) {
        if let Some(slot) = &self.0 {
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
    }
}

/// The frozen products `x·Wᵢᵀ` of sibling sites in one GEMM with their `fused` weight,
/// side by side `[..., Σ outᵢ]`; `None` (each site then multiplies on its own) unless every
/// site's base is still the view of `fused` that [`fuse_bases`] made — a base replaced since
/// (merged into a new tensor, moved, quantized) takes the plain path. Under autocast an f32
/// `fused` is multiplied as its cast to the autocast dtype from `cast` (what autocast would
/// make of it; kept across forwards when `cast` is enabled).
fn fused_products<const N: usize>(
    fused: Option<&Tensor>,
    cast: &CastCache,
    sites: &[&Site<LoraLinear>; N],
    x: &Tensor,
) -> Result<Option<Tensor>> {
    let Some(f) = fused else {
        return Ok(None);
    };
    let row_bytes = f.size()[1] as usize * f.kind().elt_size_in_bytes();
    let base = f.data_ptr() as usize;
    let mut at = 0usize;
    for s in sites {
        let BaseWeight::Dense(w) = s.base() else {
            return Ok(None);
        };
        let rows = w.size()[0];
        if w.kind() != f.kind()
            || w.device() != f.device()
            || w.data_ptr() as usize != base + at * row_bytes
        {
            return Ok(None);
        }
        at += rows as usize;
    }
    if at as i64 != f.size()[0] {
        return Ok(None);
    }
    let autocast = lora_core::sys::autocast_state(x.device())?;
    let w = match (autocast.enabled, autocast.dtype) {
        (true, Some(d))
            if f.kind() == Kind::Float && !lora_core::linear::bf16_autocast_by_f32(x.device())? =>
        {
            cast.cast(f, d)?
        }
        _ if f.kind() == x.kind() => f.shallow_clone(),
        _ => f.f_to_kind(x.kind())?,
    };
    Ok(Some(lora_core::linear::linear_product(x, &w)?))
}

/// The outputs `[..., outᵢ]` of sibling sites that read the same input `x`: with their frozen
/// products in one GEMM ([`fused_products`]) and their plain LoRA branches together
/// ([`LoraLinear::forward_siblings`]) where they allow it, else each site's own forward.
fn sibling_forward<const N: usize>(
    fused: Option<&Tensor>,
    cast: &CastCache,
    sites: &[&Site<LoraLinear>; N],
    x: &Tensor,
    train: bool,
) -> Result<[Tensor; N]> {
    let outs: Vec<Tensor> = match fused_products(fused, cast, sites, x)? {
        Some(base_out) => {
            let layers: Vec<&LoraLinear> = sites.iter().map(|s| &***s).collect();
            LoraLinear::forward_siblings(&layers, x, base_out, train)?
        }
        None => sites
            .iter()
            .map(|s| s.forward_t(x, train))
            .collect::<lora_core::Result<_>>()?,
    };
    outs.try_into().map_err(|v: Vec<Tensor>| {
        crate::Error::InvalidArgument(format!("{} sibling outputs for {N} sites", v.len()))
    })
}

/// One site's forward, its frozen product under autocast by `cast`'s (kept) cast of its dense
/// f32 weight ([`fused_products`] over the site alone); any other base takes the site's own
/// forward. The same numbers as [`LoraLinear::forward_t`].
fn single_forward(
    site: &Site<LoraLinear>,
    cast: &CastCache,
    x: &Tensor,
    train: bool,
) -> Result<Tensor> {
    let base_out = match site.base() {
        BaseWeight::Dense(w) => fused_products(Some(w), cast, &[site], x)?,
        _ => None,
    };
    Ok(match base_out {
        Some(base_out) => site.forward_from_base(x, base_out, train)?,
        None => site.forward_t(x, train)?,
    })
}

#[derive(Debug)]
struct DecoderLayer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    /// The linear sites in visiting order: q, k, v, o, gate, up, down.
    fn linears(&self) -> [&Site<LoraLinear>; 7] {
        let (a, m) = (&self.self_attn, &self.mlp);
        [
            &a.q_proj,
            &a.k_proj,
            &a.v_proj,
            &a.o_proj,
            &m.gate_proj,
            &m.up_proj,
            &m.down_proj,
        ]
    }

    /// As [`DecoderLayer::linears`], mutably.
    fn linears_mut(&mut self) -> [&mut Site<LoraLinear>; 7] {
        let (a, m) = (&mut self.self_attn, &mut self.mlp);
        [
            &mut a.q_proj,
            &mut a.k_proj,
            &mut a.v_proj,
            &mut a.o_proj,
            &mut m.gate_proj,
            &mut m.up_proj,
            &mut m.down_proj,
        ]
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut LayerCache>,
        train: bool,
    ) -> Result<Tensor> {
        let h = self.self_attn.forward(
            &self.input_layernorm.forward(x)?,
            cos,
            sin,
            mask,
            cache,
            train,
        )?;
        let h = x.f_add(&h)?;
        let m = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&h)?, train)?;
        Ok(h.f_add(&m)?)
    }
}

/// Everything the decoder layers share for one forward pass.
struct Prepared {
    x0: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// `None`: plain causal attention (see [`Llama::mask`]).
    mask: Option<Tensor>,
}

/// A LLaMA-family causal LM whose every linear (and the embedding) is a LoRA site.
///
/// Sites, named as in HF transformers so that a PEFT adapter maps 1:1: `model.embed_tokens`,
/// `model.layers.N.self_attn.{q,k,v,o}_proj`, `model.layers.N.mlp.{gate,up,down}_proj`, and
/// `lm_head` when the head is not tied to the embedding.
///
/// ```no_run
/// # fn main() -> lora_models::Result<()> {
/// use lora_models::llama::{GenerateOptions, Llama, WeightMode};
/// use lora_models::tokenizer::load_tokenizer_from_gguf;
/// use tch::{Device, Tensor};
///
/// let path = "assets/models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// let model = Llama::from_gguf(path, WeightMode::KeepQuantized, Device::Cpu)?;
/// let tok = load_tokenizer_from_gguf(path)?;
/// let ids = tok.encode("Once upon a time", true)?;
/// let x = Tensor::from_slice(&ids).view([1, -1]);
/// let logits = model.forward_t(&x, None, None, false)?; // [1, 4, 49152] f32
/// let nll = model.loss(&x, &x, None, None, false)?; // mean next-token NLL
/// let out = model.generate(&ids, &GenerateOptions { max_new_tokens: 16, ..Default::default() })?;
/// println!("{:?} {} {}", logits.size(), nll.double_value(&[]), tok.decode(&out.tokens, true)?);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Llama {
    config: LlamaConfig,
    embed_tokens: Site<LoraEmbedding>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    lm_head: Option<Site<LoraLinear>>,
    inv_freq: Tensor,
    kind: Kind,
    device: Device,
    gradient_checkpointing: bool,
    /// The head weight's cast for the loss under autocast, kept across steps when enabled.
    head_cast: CastCache,
}

impl Llama {
    /// Loads a GGUF file (`llama`, `qwen2` or `qwen3` architecture).
    ///
    /// With [`WeightMode::KeepQuantized`], block-quantized weights (`Q8_0`, `Q4_0`, `Q4_1`,
    /// `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`, `Q6_K`) stay in block format on
    /// `device`; with [`WeightMode::Dense`] they are dequantised once. llama.cpp's Q/K row
    /// permutation (architecture `llama`) is undone on the stored rows, so the HF layout and
    /// HF's rotate-half RoPE apply, and a PEFT adapter trained on the HF model fits.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Gguf`] for an unreadable file, [`Error::Metadata`] for missing
    /// keys, [`Error::MissingTensor`]/[`Error::Shape`] when tensors do not match the metadata,
    /// [`Error::Unsupported`] for other tensor types (Q2_K, Q3_K, the IQ types).
    pub fn from_gguf(path: impl AsRef<Path>, mode: WeightMode, device: Device) -> Result<Self> {
        let file = GgufFile::open(path)?;
        Self::from_gguf_file(&file, mode, device)
    }

    /// As [`Llama::from_gguf`], from an opened file.
    ///
    /// # Errors
    /// As [`Llama::from_gguf`].
    pub fn from_gguf_file(file: &GgufFile, mode: WeightMode, device: Device) -> Result<Self> {
        let config = LlamaConfig::from_gguf(file)?;
        let src = GgufSource::new(file, mode, device)
            .with_key_map(hf_to_gguf_name)
            .with_permuted_qk(config.model_type == "llama");
        Self::build(config, &src, mode.compute_kind(), device)
    }

    /// Loads an HF checkpoint folder: `config.json` plus `model.safetensors` or the shards of
    /// `model.safetensors.index.json`, memory-mapped and copied into tensors of the mode's dtype.
    ///
    /// With [`WeightMode::KeepQuantized`] the base is QLoRA's (Dettmers et al. 2023,
    /// arXiv:2305.14314), as transformers loads it with `BitsAndBytesConfig(load_in_4bit=True,
    /// bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`: every linear of the decoder
    /// layers (`model.layers.N.{self_attn,mlp}.*_proj`) is quantized to NF4 with double
    /// quantization at load ([`QuantizeOnLoad`], [`QuantKind::Nf4`]), from the file's values read
    /// as f32; the embedding, the norms, the biases and the LM head stay dense in f32, the
    /// compute dtype. bitsandbytes converts only `nn.Linear` modules, so the embedding stays, and
    /// transformers skips the output embedding `lm_head` (`quantizers/base.py`
    /// `get_keys_to_not_convert`, the default of `llm_int8_skip_modules`). A linear whose
    /// `out·in` is not a multiple of 64 (the NF4 block) stays dense too.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Config`] for the folder's files, [`Error::Safetensors`] for bad
    /// headers, [`Error::MissingTensor`]/[`Error::Shape`] for mismatching weights.
    pub fn from_safetensors(
        dir: impl AsRef<Path>,
        mode: WeightMode,
        device: Device,
    ) -> Result<Self> {
        let dir = dir.as_ref();
        let config = LlamaConfig::from_hf_json(dir.join("config.json"))?;
        let src = SafetensorsFiles::open_dir(dir, "model", device)?;
        match mode {
            WeightMode::Dense(kind) => Self::build(config, &src, kind, device),
            WeightMode::KeepQuantized => {
                let nf4 = QuantizeOnLoad::new(&src, QuantKind::Nf4 { double_quant: true })
                    .keeping_dense(|name| !name.starts_with("model.layers."));
                Self::build(config, &nf4, mode.compute_kind(), device)
            }
        }
    }

    /// Builds the model from tensors keyed by HF parameter name (`model.layers.0.mlp.up_proj.weight`,
    /// …), converted to `kind` on `device`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`]/[`Error::Shape`] when the map does not fit `config`.
    pub fn from_tensors(
        config: LlamaConfig,
        tensors: &HashMap<String, Tensor>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        config.validate()?;
        Self::build(config, &TensorMap::new(tensors, device), kind, device)
    }

    /// Reads every weight through one [`WeightPath`] per module, so each name is written once
    /// and a site's name is the path its weight was read under.
    fn build(
        config: LlamaConfig,
        src: &dyn TensorSource,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        config.validate()?;
        let (d, hd) = (config.hidden_size, config.head_dim());
        let (nh, nkv, ff) = (
            config.num_attention_heads,
            config.n_kv_heads(),
            config.intermediate_size,
        );
        let norm = |p: &WeightPath<'_>| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: p.get("weight", &[d])?,
                eps: config.rms_norm_eps,
            })
        };
        let head_norm = |p: &WeightPath<'_>| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: p.get("weight", &[hd])?,
                eps: config.rms_norm_eps,
            })
        };
        // `rope`: a query/key projection (rows possibly permuted by llama.cpp's converter).
        let base = |p: &WeightPath<'_>, out: i64, inp: i64, rope: bool| -> Result<BaseWeight> {
            p.base("weight", [out, inp], rope.then_some(hd))
        };
        let site = |p: &WeightPath<'_>, base: BaseWeight, bias: bool| -> Result<Site<LoraLinear>> {
            let out = base.shape()[0];
            let b = if bias {
                Some(p.get("bias", &[out])?)
            } else {
                None
            };
            Ok(p.site(LoraLinear::new(base, b)?))
        };
        let linear =
            |p: &WeightPath<'_>,
             out: i64,
             inp: i64,
             bias: bool,
             rope: bool|
             -> Result<Site<LoraLinear>> { site(p, base(p, out, inp, rope)?, bias) };
        let root = WeightPath::new(src, "", kind);
        let model = root.pp("model");
        let mut layers = Vec::with_capacity(config.num_hidden_layers as usize);
        for i in 0..config.num_hidden_layers {
            let p = model.pp("layers").pp(i);
            let (qkv_b, o_b, mlp_b) = (config.qkv_bias(), config.o_bias(), config.mlp_bias);
            let a = p.pp("self_attn");
            let (qp, kp, vp) = (a.pp("q_proj"), a.pp("k_proj"), a.pp("v_proj"));
            let (bases, qkv) = fuse_bases(vec![
                base(&qp, nh * hd, d, true)?,
                base(&kp, nkv * hd, d, true)?,
                base(&vp, nkv * hd, d, false)?,
            ])?;
            let [qb, kb, vb]: [BaseWeight; 3] = bases
                .try_into()
                .map_err(|_| Error::InvalidArgument("q/k/v bases".into()))?;
            let self_attn = Attention {
                q_proj: site(&qp, qb, qkv_b)?,
                k_proj: site(&kp, kb, qkv_b)?,
                v_proj: site(&vp, vb, qkv_b)?,
                qkv,
                qkv_cast: CastCache::default(),
                o_cast: CastCache::default(),
                o_proj: linear(&a.pp("o_proj"), d, nh * hd, o_b, false)?,
                q_norm: if config.qk_norm() {
                    Some(head_norm(&a.pp("q_norm"))?)
                } else {
                    None
                },
                k_norm: if config.qk_norm() {
                    Some(head_norm(&a.pp("k_norm"))?)
                } else {
                    None
                },
                n_head: nh,
                n_kv: nkv,
                head_dim: hd,
            };
            let m = p.pp("mlp");
            let (gp, up) = (m.pp("gate_proj"), m.pp("up_proj"));
            let (bases, gate_up) =
                fuse_bases(vec![base(&gp, ff, d, false)?, base(&up, ff, d, false)?])?;
            let [gb, ub]: [BaseWeight; 2] = bases
                .try_into()
                .map_err(|_| Error::InvalidArgument("gate/up bases".into()))?;
            let mlp = Mlp {
                gate_proj: site(&gp, gb, mlp_b)?,
                up_proj: site(&up, ub, mlp_b)?,
                gate_up,
                gate_up_cast: CastCache::default(),
                down_cast: CastCache::default(),
                down_proj: linear(&m.pp("down_proj"), d, ff, mlp_b, false)?,
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(&p.pp("input_layernorm"))?,
                self_attn,
                post_attention_layernorm: norm(&p.pp("post_attention_layernorm"))?,
                mlp,
            });
        }
        let embed = model.pp("embed_tokens");
        let embed_tokens = embed.site(
            LoraEmbedding::new(embed.base("weight", [config.vocab_size, d], None)?)?
                .with_output_kind(kind),
        );
        let head = root.pp("lm_head");
        let tied = config.tie_word_embeddings || !head.contains("weight");
        let lm_head = if tied {
            None
        } else {
            Some(linear(&head, config.vocab_size, d, false, false)?)
        };
        let final_norm = norm(&model.pp("norm"))?;
        let mut config = config;
        config.tie_word_embeddings = tied;
        // llama.cpp's Llama 3 RoPE frequency factors (GGUF only)
        let factors: Option<Vec<f32>> = match src.tensor("rope_freqs.weight", Kind::Float)? {
            Some(t) => Some(Vec::<f32>::try_from(
                &t.f_to_device(Device::Cpu)?.f_flatten(0, -1)?,
            )?),
            None => None,
        };
        let inv: Vec<f32> = config
            .inv_freq(factors.as_deref())
            .into_iter()
            .map(|f| f as f32)
            .collect();
        let inv_freq = Tensor::f_from_slice(&inv)?.f_to_device(device)?;
        Ok(Self {
            norm: final_norm,
            config,
            embed_tokens,
            layers,
            lm_head,
            inv_freq,
            kind,
            device,
            gradient_checkpointing: false,
            head_cast: CastCache::default(),
        })
    }

    /// The configuration (with `tie_word_embeddings` as loaded).
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The dtype activations are computed in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of decoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Turns per-decoder-layer activation checkpointing on or off for [`Llama::loss_backward`].
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Keeps the casts of the frozen f32 weights that autocast would make on every forward —
    /// the fused q/k/v and gate/up weights, o_proj's, down_proj's and the LM head's — from one
    /// step to the next (`on`), or drops them (`false`, the default). Same numbers either way;
    /// what it saves is the casts (a bf16 step of SmolLM2-135M on a 2-core CPU: 5% faster,
    /// paired; o_proj's and down_proj's 1% more). The casts
    /// then stay allocated between steps: 2 bytes per parameter of those weights, which a step
    /// without activation checkpointing holds at its peak anyway (autocast keeps each cast for
    /// the backward), and which a checkpointed step would otherwise hold one layer at a time —
    /// so turn it on only without checkpointing, as lora-train's causal-LM job does.
    pub fn set_frozen_cast_cache(&mut self, on: bool) {
        for l in &mut self.layers {
            l.self_attn.qkv_cast = CastCache::enabled(on);
            l.self_attn.o_cast = CastCache::enabled(on);
            l.mlp.gate_up_cast = CastCache::enabled(on);
            l.mlp.down_cast = CastCache::enabled(on);
        }
        self.head_cast = CastCache::enabled(on);
    }

    /// Whether activation checkpointing is on.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// Bytes held by the frozen weights (linear/embedding storage as held — quantised blocks or
    /// dense —, norms, biases). Adapters are not counted.
    pub fn weights_resident_bytes(&self) -> u64 {
        let lin = |l: &LoraLinear| l.base().storage_bytes() + l.bias().map_or(0, tensor_bytes);
        let mut total = self.embed_tokens.base().storage_bytes()
            + self.norm.bytes()
            + tensor_bytes(&self.inv_freq);
        if let Some(h) = &self.lm_head {
            total += lin(h);
        }
        for l in &self.layers {
            let a = &l.self_attn;
            total += l.linears().into_iter().map(|s| lin(s)).sum::<u64>();
            total += l.input_layernorm.bytes() + l.post_attention_layernorm.bytes();
            total += a.q_norm.as_ref().map_or(0, RmsNorm::bytes)
                + a.k_norm.as_ref().map_or(0, RmsNorm::bytes);
        }
        total
    }

    /// Number of frozen parameters (all weights, norms and biases).
    pub fn num_params(&self) -> i64 {
        let lin = |l: &LoraLinear| l.base().numel() + l.bias().map_or(0, |b| b.numel() as i64);
        let mut n = self.embed_tokens.base().numel() + self.norm.weight.numel() as i64;
        if let Some(h) = &self.lm_head {
            n += lin(h);
        }
        for l in &self.layers {
            let a = &l.self_attn;
            n += l.linears().into_iter().map(|s| lin(s)).sum::<i64>();
            n += (l.input_layernorm.weight.numel() + l.post_attention_layernorm.weight.numel())
                as i64;
            n += a.q_norm.as_ref().map_or(0, |x| x.weight.numel() as i64);
            n += a.k_norm.as_ref().map_or(0, |x| x.weight.numel() as i64);
        }
        n
    }

    fn check_ids(&self, ids: &Tensor) -> Result<(i64, i64)> {
        let sz = ids.size();
        if sz.len() != 2 || sz[1] == 0 {
            return Err(Error::InvalidArgument(format!(
                "input ids must be [batch, seq] with seq ≥ 1, got {sz:?}"
            )));
        }
        if !matches!(ids.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::InvalidArgument(format!(
                "input ids must be int64, got {:?}",
                ids.kind()
            )));
        }
        Ok((sz[0], sz[1]))
    }

    /// cos/sin `[b, 1, s, hd]` in the compute dtype for positions `[b, s]`.
    fn rope(&self, pos: &Tensor) -> Result<(Tensor, Tensor)> {
        let freqs = pos
            .f_to_kind(Kind::Float)?
            .f_unsqueeze(-1)?
            .f_mul(&self.inv_freq)?;
        let emb = Tensor::f_cat(&[&freqs, &freqs], -1)?;
        let cos = emb.f_cos()?.f_to_kind(self.kind)?.f_unsqueeze(1)?;
        let sin = emb.f_sin()?.f_to_kind(self.kind)?.f_unsqueeze(1)?;
        Ok((cos, sin))
    }

    /// Additive attention mask `[b, 1, s, past + s]` (0 = attend, −∞ = masked) in the dtype
    /// attention computes in ([`attention_kind`]; `train` as the layers get it): causal, padding (keys
    /// whose `attn_mask` is 0), documents (keys of another document, for packed rows), and always
    /// the diagonal so that no row is empty (a padded query attends to itself only; its output
    /// is never used, and this keeps it finite). `None` when that mask would be the plain causal
    /// triangle (no cache, no padding, one document per row): attention then runs with
    /// `is_causal`, as transformers' SDPA path does when it can drop the mask.
    ///
    /// Built once per forward and shared by every layer: SDPA would turn a boolean mask into
    /// this float form on each call, and its backward keeps each layer's copy (`b·s·(past + s)`
    /// elements per layer); one shared mask is what `lora_memory` plans for.
    fn mask(
        &self,
        b: i64,
        s: i64,
        past: i64,
        attn_mask: Option<&Tensor>,
        doc: Option<&Tensor>,
        train: bool,
    ) -> Result<Option<Tensor>> {
        let dev = self.device;
        let t = past + s;
        if let Some(am) = attn_mask
            && am.size() != [b, t]
        {
            return Err(Error::InvalidArgument(format!(
                "attention mask must be [batch, past + seq] = [{b}, {t}], got {:?}",
                am.size()
            )));
        }
        // No cache, no padding, one document per row: the mask is exactly the causal triangle, and
        // SDPA's `is_causal` skips the blocks above the diagonal instead of reading a mask.
        let no_padding = match attn_mask {
            None => true,
            Some(am) => am.f_ne(0)?.f_all()?.f_int64_value(&[])? != 0,
        };
        let one_document = match doc {
            None => true,
            Some(d) => d.f_eq(0)?.f_all()?.f_int64_value(&[])? != 0,
        };
        if past == 0 && no_padding && one_document {
            return Ok(None);
        }
        let q = Tensor::f_arange(s, (Kind::Int64, dev))?
            .f_add_scalar(past)?
            .f_view([s, 1])?;
        let k = Tensor::f_arange(t, (Kind::Int64, dev))?.f_view([1, t])?;
        let mut m = k
            .f_le_tensor(&q)?
            .f_view([1, 1, s, t])?
            .f_expand([b, 1, s, t], false)?;
        if let Some(am) = attn_mask {
            let am = am.f_to_device(dev)?.f_ne(0)?.f_view([b, 1, 1, t])?;
            m = m.f_logical_and(&am)?;
        }
        if let Some(doc) = doc {
            let same = doc
                .f_view([b, 1, s, 1])?
                .f_eq_tensor(&doc.f_view([b, 1, 1, s])?)?;
            m = m.f_logical_and(&same)?;
        }
        let diag = k.f_eq_tensor(&q)?.f_view([1, 1, s, t])?;
        let blocked = m.f_logical_or(&diag)?.f_logical_not()?;
        drop(m);
        let kind = attention_kind(dev, self.kind, train)?;
        Ok(Some(
            Tensor::f_zeros(blocked.size(), (kind, dev))?
                .f_masked_fill(&blocked, f64::NEG_INFINITY)?,
        ))
    }

    /// Document ids `[b, s]` from position ids: a new document starts wherever a position is not
    /// the previous one plus 1 (the convention of packed-sequence collators, e.g. transformers'
    /// `DataCollatorWithFlattening`, whose positions restart at 0 per document).
    fn documents(pos: &Tensor) -> Result<Tensor> {
        let s = pos.size()[1];
        let prev = pos.f_narrow(1, 0, s - 1)?.f_add_scalar(1)?;
        let cont = pos.f_narrow(1, 1, s - 1)?.f_eq_tensor(&prev)?;
        let first = Tensor::f_zeros([pos.size()[0], 1], (Kind::Int64, pos.device()))?;
        let starts = Tensor::f_cat(&[first, cont.f_logical_not()?.f_to_kind(Kind::Int64)?], 1)?;
        Ok(starts.f_cumsum(1, Kind::Int64)?)
    }

    fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let x = self.embed_tokens.forward(&ids.f_to_device(self.device)?)?;
        if x.kind() == self.kind {
            Ok(x)
        } else {
            Ok(x.f_to_kind(self.kind)?)
        }
    }

    fn prepare(
        &self,
        ids: &Tensor,
        attn_mask: Option<&Tensor>,
        pos_ids: Option<&Tensor>,
        train: bool,
    ) -> Result<Prepared> {
        let (b, s) = self.check_ids(ids)?;
        let (pos, doc) = match pos_ids {
            Some(p) => {
                if p.size() != [b, s] {
                    return Err(Error::InvalidArgument(format!(
                        "position ids must be [batch, seq] = [{b}, {s}], got {:?}",
                        p.size()
                    )));
                }
                let p = p.f_to_device(self.device)?.f_to_kind(Kind::Int64)?;
                let doc = Self::documents(&p)?;
                (p, Some(doc))
            }
            None => {
                let pos = match attn_mask {
                    // left padding: positions count real tokens (HF `generate`'s convention)
                    Some(am) => am
                        .f_to_device(self.device)?
                        .f_ne(0)?
                        .f_to_kind(Kind::Int64)?
                        .f_cumsum(1, Kind::Int64)?
                        .f_sub_scalar(1)?
                        .f_clamp_min(0)?,
                    None => Tensor::f_arange(s, (Kind::Int64, self.device))?
                        .f_view([1, s])?
                        .f_expand([b, s], false)?,
                };
                (pos, None)
            }
        };
        let (cos, sin) = self.rope(&pos)?;
        let mask = self.mask(b, s, 0, attn_mask, doc.as_ref(), train)?;
        Ok(Prepared {
            x0: self.embed(ids)?,
            cos,
            sin,
            mask,
        })
    }

    /// Final norm + LM head → f32 logits.
    fn head(&self, h: &Tensor) -> Result<Tensor> {
        let h = self.norm.forward(h)?;
        let logits = match &self.lm_head {
            Some(l) => l.forward_t(&h, false)?,
            // tied to the embedding: a quantized one multiplies tile by tile (no dense copy of
            // the `[V, d]` matrix), a dense one through the same product as every linear
            None => lora_core::linear::base_product(self.embed_tokens.base(), &h)?,
        };
        Ok(logits.f_to_kind(Kind::Float)?)
    }

    /// Hidden states after the last decoder layer (before the final norm) `[b, s, d]`.
    ///
    /// # Errors
    /// As [`Llama::forward_t`].
    pub fn hidden_states(
        &self,
        ids: &Tensor,
        attn_mask: Option<&Tensor>,
        pos_ids: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let p = self.prepare(ids, attn_mask, pos_ids, train)?;
        let mut x = p.x0;
        for l in &self.layers {
            x = l.forward(&x, &p.cos, &p.sin, p.mask.as_ref(), None, train)?;
        }
        Ok(x)
    }

    /// The causal-LM forward pass.
    ///
    /// # Shapes
    /// - `ids`: `[batch, seq]` int64;
    /// - `attn_mask`: `[batch, seq]`, nonzero = real token, 0 = padding (keys masked out);
    ///   without `pos_ids`, positions are then `cumsum(mask) − 1` so left padding works;
    /// - `pos_ids`: `[batch, seq]` int64 RoPE positions; a row whose positions restart (any
    ///   position ≠ previous + 1) holds several packed documents, which do not attend to each other;
    /// - returns logits `[batch, seq, vocab]` float32.
    ///
    /// `train` enables LoRA dropout. This pass always keeps the full autograd graph; activation
    /// checkpointing applies to [`Llama::loss_backward`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for badly shaped inputs; [`Error::Torch`] for op failures (out
    /// of memory, ids out of range).
    pub fn forward_t(
        &self,
        ids: &Tensor,
        attn_mask: Option<&Tensor>,
        pos_ids: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let h = self.hidden_states(ids, attn_mask, pos_ids, train)?;
        self.head(&h)
    }

    /// One incremental step with a [`KvCache`]: `ids` `[batch, new]` are the tokens after the
    /// `cache.seq_len()` cached ones (all rows the same length, no padding); returns logits
    /// `[batch, new, vocab]` float32 and appends the new keys/values to the cache. No autograd
    /// graph is recorded.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the cache belongs to another model or the context
    /// exceeds `max_position_embeddings`; [`Error::Torch`] for op failures.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let _guard = tch::no_grad_guard();
        let (b, s) = self.check_ids(ids)?;
        if cache.layers.len() != self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "the cache has {} layers, the model {}",
                cache.layers.len(),
                self.layers.len()
            )));
        }
        let past = cache.len;
        let pos = Tensor::f_arange(s, (Kind::Int64, self.device))?
            .f_add_scalar(past)?
            .f_view([1, s])?
            .f_expand([b, s], false)?;
        let (cos, sin) = self.rope(&pos)?;
        let mask = self.mask(b, s, past, None, None, false)?;
        let mut x = self.embed(ids)?;
        for (l, c) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = l.forward(&x, &cos, &sin, mask.as_ref(), Some(c), false)?;
        }
        cache.len += s;
        self.head(&x)
    }

    /// Mean next-token cross-entropy (nats) of `logits` `[b, s, V]` against `labels` `[b, s]`:
    /// position `t` predicts `labels[t + 1]`; labels equal to [`IGNORE_INDEX`] are skipped (HF
    /// `ForCausalLMLoss`).
    fn shifted_ce(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let (b, s, v) = (logits.size()[0], logits.size()[1], logits.size()[2]);
        if labels.size() != [b, s] {
            return Err(Error::InvalidArgument(format!(
                "labels must be [{b}, {s}], got {:?}",
                labels.size()
            )));
        }
        let lg = logits.f_narrow(1, 0, s - 1)?.f_reshape([-1, v])?;
        let lb = labels
            .f_to_device(logits.device())?
            .f_to_kind(Kind::Int64)?
            .f_narrow(1, 1, s - 1)?
            .f_reshape([-1])?;
        Ok(lg.f_cross_entropy_loss::<Tensor>(&lb, None, tch::Reduction::Mean, IGNORE_INDEX, 0.0)?)
    }

    /// The frozen LM-head weight `[V, d]` when the head adds nothing to a plain `h·Wᵀ` (tied to
    /// the embedding, or an untied head with no active LoRA adapter and no bias): a quantized
    /// one as it is (never decoded whole), a dense one in `mm_kind`; `None` otherwise.
    fn plain_head_weight(&self, mm_kind: Kind) -> Result<Option<HeadWeight<'_>>> {
        let base = match &self.lm_head {
            None => self.embed_tokens.base(),
            Some(l) => {
                let active = !l.adapters_disabled()
                    && l.adapters()
                        .iter()
                        .any(|a| a.is_enabled() && !a.is_merged());
                if active || l.bias().is_some() {
                    return Ok(None);
                }
                l.base()
            }
        };
        Ok(Some(match base {
            BaseWeight::Quant(q) if q.has_kernel(mm_kind) => HeadWeight::Quant(q),
            BaseWeight::Quant(q) => HeadWeight::QuantTiles(q),
            b => {
                let w = self.head_cast.cast(&b.weight(self.kind)?, mm_kind)?;
                HeadWeight::Dense { wt: w.f_tr()?, w }
            }
        }))
    }

    /// Final norm, LM head and shifted cross-entropy of hidden states `h` `[b, s, d]` against
    /// `labels` `[b, s]`: the value of [`Llama::loss`].
    ///
    /// When the head is a plain frozen matmul ([`Self::plain_head_weight`]), the `[b·s, V]` logits
    /// never exist at once: rows go through the head in chunks of [`FUSED_CE_CHUNK_BYTES`] of fp32
    /// logits, each chunk gives its loss (`logsumexp − logit[label]`) and, when a gradient is
    /// needed, the gradient of the normed hidden states right away
    /// (`∂loss/∂h = (softmax − onehot(label))·W / n_valid`, rows with label −100 zero). The
    /// returned tensor carries that gradient to the rest of the graph through
    /// `loss + Σ(hn·g) − sg(Σ(hn·g))` (`sg` = detached), whose value is the loss and whose
    /// gradient with respect to the normed hidden states `hn` is `g`. The same idea as the fused
    /// linear + cross-entropy kernels of Liger-Kernel (arXiv:2410.10989) and torchtune's chunked
    /// loss, here built from libtorch ops. Same FLOPs as the plain path; instead of
    /// `b·s·V·(e + 12)` bytes of logits, log-probabilities and their gradients it holds one
    /// chunk's f32 logits and their log-softmax (libtorch's row-wise kernel), and in fp32 (off
    /// oneDNN) those are two buffers reused for every chunk (no page faults for fresh logits every
    /// step). A quantized head is never decoded whole: the CPU kernel multiplies it chunk by
    /// chunk, and elsewhere ([`vocab_tiled_head`]: CUDA, f16, f64) one tile of vocabulary rows
    /// is decoded at a time.
    pub(crate) fn head_loss(&self, h: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let (b, s, d) = (h.size()[0], h.size()[1], h.size()[2]);
        if labels.size() != [b, s] {
            return Err(Error::InvalidArgument(format!(
                "labels must be [{b}, {s}], got {:?}",
                labels.size()
            )));
        }
        // The head's matmuls run in the dtype the plain path would use: the autocast dtype when
        // autocast is on (one cast of W for all chunks, as autocast itself would keep for the
        // backward), else the model dtype.
        let autocast = lora_core::sys::autocast_state(h.device())?;
        let mm_kind = match (autocast.enabled, autocast.dtype) {
            (true, Some(k)) => k,
            _ => self.kind,
        };
        let Some(w) = self.plain_head_weight(mm_kind)? else {
            return Self::shifted_ce(&self.head(h)?, labels);
        };
        let lb = labels
            .f_to_device(h.device())?
            .f_to_kind(Kind::Int64)?
            .f_narrow(1, 1, s - 1)?
            .f_reshape([-1])?;
        let valid = lb.f_ne(IGNORE_INDEX)?;
        let n_valid = valid.f_sum(Kind::Int64)?.f_int64_value(&[])?;
        if n_valid == 0 || s < 2 {
            // Nothing to predict: the plain path's mean over no tokens (NaN, as HF).
            return Self::shifted_ce(&self.head(h)?, labels);
        }
        let hn = self.norm.forward(h)?;
        let want_grad = hn.requires_grad();
        let v = match &w {
            HeadWeight::Dense { w, .. } => w.size()[0],
            HeadWeight::Quant(q) | HeadWeight::QuantTiles(q) => q.shape()[0],
        };
        let rows = hn.f_narrow(1, 0, s - 1)?.f_reshape([-1, d])?.f_detach()?;
        let n = rows.size()[0];
        let idx = lb.f_clamp_min(0)?.f_unsqueeze(1)?;
        let validf = valid.f_to_kind(Kind::Float)?.f_unsqueeze(1)?;
        let inv = 1.0 / n_valid as f64;
        if let HeadWeight::QuantTiles(q) = &w {
            let (total, grad) = {
                let _ng = tch::no_grad_guard();
                vocab_tiled_head(q, &rows, &idx, &validf, mm_kind, want_grad, inv)?
            };
            drop(rows);
            return Self::fused_loss_output(&hn, total.f_mul_scalar(inv)?, grad, b, s, d);
        }
        // A dense fp32 head writes each chunk into one reused buffer, unless its products go
        // through oneDNN (`lora_core::sys::cpu_f32_gemm_by_onednn`), whose results are new
        // tensors of the same size.
        let dense_f32 = mm_kind == Kind::Float && matches!(w, HeadWeight::Dense { .. });
        let onednn =
            dense_f32 && h.device() == tch::Device::Cpu && lora_core::sys::cpu_f32_gemm_by_onednn();
        let reuse = dense_f32 && !onednn;
        // bf16 autocast on a CPU without a fast bf16 GEMM: the same bf16 numbers by f32 GEMMs
        let by_f32 =
            mm_kind == Kind::BFloat16 && lora_core::linear::bf16_autocast_by_f32(h.device())?;
        // A dense 16-bit head reuses the two f32 buffers too: its 16-bit logits are written into
        // the log-softmax buffer's bytes and widened into the logits buffer, and the rounded
        // softmax gradient into the logits buffer's bytes once the log-softmax is taken — no
        // allocation (and, on the CPU, no fresh pages to fault in) per chunk, the same 8 bytes
        // per logit at the peak.
        let reuse16 = matches!(w, HeadWeight::Dense { .. })
            && matches!(mm_kind, Kind::BFloat16 | Kind::Half)
            && !by_f32;
        let chunk = (FUSED_CE_CHUNK_BYTES / (4 * v.max(1)))
            .clamp(16, n.max(16))
            .min(n);
        // the logits and their log-softmax, each chunk written into the same two buffers
        let buf = if reuse || reuse16 {
            Some((
                Tensor::f_empty([chunk, v], (Kind::Float, h.device()))?,
                Tensor::f_empty([chunk, v], (Kind::Float, h.device()))?,
            ))
        } else {
            None
        };
        // Gradient rows of the n = b·(s − 1) predicting positions, in the matmul dtype.
        let grad = if want_grad {
            Some(Tensor::f_empty([n, d], (mm_kind, h.device()))?)
        } else {
            None
        };
        let mut total = Tensor::f_zeros([], (Kind::Float, h.device()))?;
        let _ng = tch::no_grad_guard();
        let mut start = 0;
        while start < n {
            let r = chunk.min(n - start);
            let x = rows.f_narrow(0, start, r)?.f_to_kind(mm_kind)?;
            let lg = match (&w, &buf) {
                (HeadWeight::Dense { wt, .. }, Some((bf, lb))) if reuse16 => {
                    let lg16 = x.f_mm_out(&as_16bit(lb, r, v, mm_kind)?, wt)?;
                    let out = bf.f_narrow(0, 0, r)?;
                    out.shallow_clone().f_copy_(&lg16)?;
                    out
                }
                (HeadWeight::Dense { w, .. }, _) if onednn => {
                    lora_core::sys::f32_linear(&x, w).map_err(tch::TchError::from)?
                }
                (HeadWeight::Dense { wt, .. }, Some((bf, _))) => {
                    let out = bf.f_narrow(0, 0, r)?;
                    x.f_mm_out(&out, wt)?
                }
                (HeadWeight::Dense { w, .. }, None) if by_f32 => bf16_logits_by_f32(&x, w)?,
                // 16-bit logits widened to f32, the 16-bit ones dropped at once (libtorch's CPU
                // log-softmax would widen them into a copy of its own while they live)
                (HeadWeight::Dense { wt, .. }, None) => x.f_mm(wt)?.f_to_kind(Kind::Float)?,
                (HeadWeight::Quant(q) | HeadWeight::QuantTiles(q), _) => {
                    q.matmul(&x, false)?.f_to_kind(Kind::Float)?
                }
            };
            // log p = logits − logsumexp(logits) per row, in f32: libtorch's row-wise
            // log-softmax kernel, one call instead of a max, a shifted copy, its exponential and
            // its sum, then the shift and exponential again for the gradient
            let mut lp = match &buf {
                Some((_, lb)) => {
                    lg.f_internal_log_softmax_out(&lb.f_narrow(0, 0, r)?, -1, false)?
                }
                None => lg.f_log_softmax(-1, None::<Kind>)?,
            };
            drop(lg);
            let ix = idx.f_narrow(0, start, r)?;
            let vf = validf.f_narrow(0, start, r)?;
            let tgt = lp.f_gather(1, &ix, false)?;
            total = total.f_sub(&tgt.f_mul(&vf)?.f_sum(Kind::Float)?)?;
            if let Some(g) = &grad {
                // softmax − onehot(label), times valid / n_valid per row.
                let _ = lp.f_exp_()?;
                let _ = lp.f_scatter_add_(1, &ix, &vf.f_neg()?)?;
                // scaled in place (a multiplication into a 16-bit output would compute into an
                // f32 temporary of its own), then rounded to the matmul dtype
                let _ = lp.f_mul_(&vf.f_mul_scalar(inv)?)?;
                let p = if mm_kind == Kind::Float {
                    lp
                } else if let (true, Some((bf, _))) = (reuse16, &buf) {
                    let p = as_16bit(bf, r, v, mm_kind)?;
                    p.shallow_clone().f_copy_(&lp)?;
                    drop(lp);
                    p
                } else {
                    let p = lp.f_to_kind(mm_kind)?;
                    drop(lp);
                    p
                };
                let mut gx = g.f_narrow(0, start, r)?;
                match &w {
                    HeadWeight::Dense { wt, .. } if onednn => {
                        let _ = gx.f_copy_(
                            &lora_core::sys::f32_linear(&p, wt).map_err(tch::TchError::from)?,
                        )?;
                    }
                    // straight into the gradient rows: no `[r, d]` temporary beside the buffers
                    HeadWeight::Dense { w, .. } if reuse || reuse16 => {
                        let _ = p.f_mm_out(&gx, w)?;
                    }
                    HeadWeight::Dense { w, .. } if by_f32 => {
                        gx.f_copy_(&bf16_input_grad_by_f32(&p, w)?)?;
                    }
                    HeadWeight::Dense { w, .. } => {
                        let _ = gx.f_copy_(&p.f_mm(w)?)?;
                    }
                    HeadWeight::Quant(q) | HeadWeight::QuantTiles(q) => {
                        let _ = gx.f_copy_(&q.matmul(&p, true)?)?;
                    }
                }
            }
            start += r;
        }
        let loss = total.f_mul_scalar(inv)?;
        drop(_ng);
        // the chunk buffers and the row copy are not needed beside the surrogate's tensors
        drop(buf);
        drop(rows);
        Self::fused_loss_output(&hn, loss, grad, b, s, d)
    }

    /// The fused loss's result: `loss` (0-d, no graph) alone, or with the gradient rows `g`
    /// `[b·(s − 1), d]` of the normed hidden states `hn` `[b, s, d]` attached as
    /// `loss + Σ(hn·g') − sg(Σ(hn·g'))`, `g'` being `g` with a zero row for each sequence's last
    /// position (it predicts nothing).
    fn fused_loss_output(
        hn: &Tensor,
        loss: Tensor,
        grad: Option<Tensor>,
        b: i64,
        s: i64,
        d: i64,
    ) -> Result<Tensor> {
        match grad {
            Some(g) => {
                // g' in one buffer (the rows written in place, the gradient rows dropped at
                // once); in f32 Σ(hn·g') as a dot product, with no `[b, s, d]` product
                // temporary; other dtypes sum in f32 as the loss is (a 16-bit dot's value could
                // round to ±inf, and inf − inf is NaN)
                let gp = Tensor::f_zeros([b, s, d], (hn.kind(), hn.device()))?;
                gp.f_narrow(1, 0, s - 1)?
                    .f_copy_(&g.f_view([b, s - 1, d])?)?;
                drop(g);
                let dot = if hn.kind() == Kind::Float {
                    hn.f_reshape([-1])?.f_dot(&gp.f_view([-1])?)?
                } else {
                    hn.f_mul(&gp)?.f_sum(Kind::Float)?
                };
                Ok(dot.f_sub(&dot.f_detach()?)?.f_add(&loss)?)
            }
            None => Ok(loss),
        }
    }

    /// Mean next-token negative log-likelihood: the causal-LM training loss.
    ///
    /// `labels` `[batch, seq]` int64 are usually the input ids with prompt/padding positions set
    /// to [`IGNORE_INDEX`] (−100); they are shifted inside (position `t` predicts `labels[t+1]`),
    /// as HF does. Returns a 0-d float32 tensor with a graph (when anything requires grad).
    ///
    /// # Errors
    /// As [`Llama::forward_t`], plus [`Error::InvalidArgument`] for mis-shaped labels.
    pub fn loss(
        &self,
        ids: &Tensor,
        labels: &Tensor,
        attn_mask: Option<&Tensor>,
        pos_ids: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let h = self.hidden_states(ids, attn_mask, pos_ids, train)?;
        self.head_loss(&h, labels)
    }

    /// Computes [`Llama::loss`] and backpropagates `loss · loss_scale` into every tensor that
    /// requires grad (the adapters), with per-decoder-layer activation checkpointing when
    /// [`Llama::set_gradient_checkpointing`] is on. Returns the unscaled loss, detached.
    ///
    /// With checkpointing, the layers run without a graph and only their inputs `[b, s, d]` are
    /// kept; at backward time each layer is recomputed and backpropagated in turn
    /// ([`SegmentTape`]). Gradients equal those of the plain path (tested); LoRA dropout draws the
    /// same masks in the recomputation (per-layer reseeding, see [`crate::checkpoint`]).
    ///
    /// `loss_scale` is `1 / gradient_accumulation_steps` (times a loss-scaling factor for fp16).
    ///
    /// # Errors
    /// As [`Llama::loss`]; [`Error::Torch`] when nothing requires grad.
    pub fn loss_backward(
        &self,
        ids: &Tensor,
        labels: &Tensor,
        attn_mask: Option<&Tensor>,
        pos_ids: Option<&Tensor>,
        train: bool,
        loss_scale: f64,
    ) -> Result<Tensor> {
        if !self.gradient_checkpointing {
            let loss = self.loss(ids, labels, attn_mask, pos_ids, train)?;
            loss.f_mul_scalar(loss_scale)?.f_backward()?;
            return Ok(loss.f_detach()?);
        }
        let p = self.prepare(ids, attn_mask, pos_ids, train)?;
        let seg = |i: usize, x: &Tensor| {
            self.layers[i].forward(x, &p.cos, &p.sin, p.mask.as_ref(), None, train)
        };
        let (h, tape) = SegmentTape::forward(&p.x0, self.layers.len(), seg)?;
        let loss = self.head_loss(&h, labels)?;
        loss.f_mul_scalar(loss_scale)?.f_backward()?;
        let g = h.f_grad()?;
        let g0 = tape.backward(&g, seg)?;
        if p.x0.requires_grad() {
            p.x0.f_mul(&g0.f_to_kind(p.x0.kind())?)?
                .f_sum(Kind::Float)?
                .f_backward()?;
        }
        Ok(loss.f_detach()?)
    }
}

impl Adaptable for Llama {
    fn visit_sites(
        &mut self,
        f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()>,
    ) -> lora_core::Result<()> {
        // `f` may write a base weight in place (a merge), which the casts' keys cannot see
        for l in &self.layers {
            for c in [
                &l.self_attn.qkv_cast,
                &l.self_attn.o_cast,
                &l.mlp.gate_up_cast,
                &l.mlp.down_cast,
            ] {
                c.clear();
            }
        }
        self.head_cast.clear();
        self.embed_tokens.visit(f)?;
        for l in &mut self.layers {
            for s in l.linears_mut() {
                s.visit(f)?;
            }
        }
        if let Some(h) = &mut self.lm_head {
            h.visit(f)?;
        }
        Ok(())
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.num_params())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_cast_is_reused_until_its_source_changes() {
        let w = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let off = CastCache::default();
        let a = off.cast(&w, Kind::BFloat16).unwrap();
        let b = off.cast(&w, Kind::BFloat16).unwrap();
        assert_ne!(a.data_ptr(), b.data_ptr(), "disabled: a new cast each call");
        let on = CastCache::enabled(true);
        let a = on.cast(&w, Kind::BFloat16).unwrap();
        let b = on.cast(&w, Kind::BFloat16).unwrap();
        assert_eq!(a.data_ptr(), b.data_ptr(), "enabled: the kept cast");
        assert!(a.equal(&w.to_kind(Kind::BFloat16)));
        // the same dtype needs no cast; another source or dtype is cast afresh
        assert_eq!(on.cast(&w, Kind::Float).unwrap().data_ptr(), w.data_ptr());
        let w2 = w.copy() * 2.0;
        let c = on.cast(&w2, Kind::BFloat16).unwrap();
        assert!(c.equal(&w2.to_kind(Kind::BFloat16)));
        let h = on.cast(&w2, Kind::Half).unwrap();
        assert_eq!(h.kind(), Kind::Half);
    }

    #[test]
    fn head_products_by_f32_equal_libtorchs_bf16_gemm() {
        tch::manual_seed(5);
        // a vocabulary of two slices and a bit, to cover the last short slice
        let v = 2 * HEAD_F32_SLICE_ROWS + 100;
        let x = Tensor::randn([6, 48], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let w = Tensor::randn([v, 48], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
        let g = Tensor::randn([6, v], (Kind::Float, Device::Cpu)) * 1e-3;
        let pairs = [
            (
                bf16_logits_by_f32(&x, &w).unwrap(),
                x.mm(&w.tr()).to_kind(Kind::Float),
            ),
            (
                bf16_input_grad_by_f32(&g, &w).unwrap().to_kind(Kind::Float),
                g.to_kind(Kind::BFloat16).mm(&w).to_kind(Kind::Float),
            ),
        ];
        for (i, (ours, theirs)) in pairs.iter().enumerate() {
            assert_eq!(ours.size(), theirs.size(), "product {i}");
            // the same roundings, another summation order: at most one bf16 step apart
            let floor = theirs.abs().max() * 1e-2;
            let rel: Tensor = (ours - theirs).abs() / (theirs.abs() + floor);
            assert!(
                rel.max().double_value(&[]) <= 1.0 / 128.0,
                "product {i}: {}",
                rel.max()
            );
            assert!(
                ours.to_kind(Kind::BFloat16)
                    .to_kind(Kind::Float)
                    .equal(ours)
            );
            let same = ours
                .eq_tensor(theirs)
                .to_kind(Kind::Float)
                .mean(Kind::Float);
            assert!(same.double_value(&[]) > 0.8, "product {i}: {same}");
        }
    }

    #[test]
    fn sibling_products_in_one_gemm_equal_each_sites_own() {
        tch::manual_seed(3);
        let ws: Vec<Tensor> = [8i64, 4, 4]
            .iter()
            .map(|&o| Tensor::randn([o, 32], (Kind::Float, Device::Cpu)))
            .collect();
        let dense = |w: &Tensor| BaseWeight::Dense(w.copy());
        let (bases, fused) = fuse_bases(ws.iter().map(dense).collect()).unwrap();
        let fused = fused.expect("dense siblings fuse");
        assert_eq!(fused.size(), [16, 32]);
        let sites: Vec<Site<LoraLinear>> = bases
            .into_iter()
            .map(|b| Site::new("p", LoraLinear::new(b, None).unwrap()))
            .collect();
        let x = Tensor::randn([2, 3, 32], (Kind::Float, Device::Cpu));
        let refs = [&sites[0], &sites[1], &sites[2]];
        let both = fused_products(Some(&fused), &CastCache::default(), &refs, &x)
            .unwrap()
            .expect("views of the fused weight");
        let parts = both.split_with_sizes([8, 4, 4], -1);
        for (p, (site, w)) in parts.iter().zip(sites.iter().zip(&ws)) {
            let own = site.forward_t(&x, false).unwrap();
            assert_eq!(p.size(), own.size());
            let plain = x.linear::<Tensor>(w, None);
            assert!(f64::try_from((p - &plain).abs().max()).unwrap() < 1e-5);
        }
        // a base that is no longer the fused weight's view: each site multiplies on its own
        let other = Site::new("p", LoraLinear::new(dense(&ws[1]), None).unwrap());
        assert!(
            fused_products(
                Some(&fused),
                &CastCache::default(),
                &[&sites[0], &other, &sites[2]],
                &x
            )
            .unwrap()
            .is_none()
        );
        // a quantized sibling keeps every base as it was
        let q = lora_core::quant::QuantWeight::quantize(&ws[0], lora_core::quant::QuantKind::Q8_0)
            .unwrap();
        let (kept, none) = fuse_bases(vec![BaseWeight::Quant(q), dense(&ws[1])]).unwrap();
        assert!(none.is_none() && matches!(kept[0], BaseWeight::Quant(_)));
    }

    #[test]
    fn rotate_half_and_documents() {
        let x = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]);
        let r = rotate_half(&x).unwrap();
        assert_eq!(
            Vec::<f32>::try_from(&r).unwrap(),
            vec![-3.0, -4.0, 1.0, 2.0]
        );
        let pos = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 0, 5, 6]).view([1, 8]);
        let doc = Llama::documents(&pos).unwrap();
        assert_eq!(
            Vec::<i64>::try_from(&doc.view([-1])).unwrap(),
            vec![0, 0, 0, 1, 1, 2, 3, 3]
        );
    }
}
