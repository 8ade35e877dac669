//! `FluxTransformer2DModel`: the rectified-flow transformer of FLUX.1-dev / FLUX.1-schnell
//! (Black Forest Labs, <https://blackforestlabs.ai/announcing-black-forest-labs/>, reference code
//! `github.com/black-forest-labs/flux`, `src/flux/model.py`), as diffusers builds and computes it
//! (`diffusers/models/transformers/transformer_flux.py`, `normalization.py`, `embeddings.py`,
//! 0.42.1). The block design is the MM-DiT of Esser et al., "Scaling Rectified Flow Transformers
//! for High-Resolution Image Synthesis" (SD3, arXiv:2403.03206), followed by single-stream
//! parallel blocks (Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters").
//!
//! # Layout
//! ```text
//! t·1000 ─ sin/cos(256) ─ timestep_embedder ─┐
//! g·1000 ─ sin/cos(256) ─ guidance_embedder ─┼─ temb [B, D]            (guidance: dev only)
//! pooled ─ text_embedder ────────────────────┘
//! txt ─ context_embedder ─┐
//! img ─ x_embedder ───────┴─ [txt ‖ img] ─ transformer_blocks[0..N] (double stream)
//!                                         ─ single_transformer_blocks[0..S] (single stream)
//!                                         ─ img part ─ norm_out(temb) ─ proj_out
//! ```
//! A double-stream block modulates image and text tokens with their own `AdaLayerNormZero`
//! (shift, scale, gate for attention and for the MLP, from `linear(silu(temb))`), projects each
//! stream with its own q/k/v (RMSNorm on q and k per head), attends jointly over `[txt ‖ img]`
//! with rotary positions, and runs a separate GELU-tanh MLP per stream. A single-stream block
//! runs one `AdaLayerNormZeroSingle`, q/k/v and a parallel MLP from the same normalised tokens,
//! and one `proj_out` over `[attention ‖ mlp]`.
//!
//! Rotary embedding: each token has an id `(index, row, column)` (`[seq, 3]`, text ids zero,
//! image ids from [`super::latent_image_ids`]); axis `i` rotates `axes_dims_rope[i]` channels of
//! each head with frequencies `θ^(−2j/dᵢ)`, θ = 10000, adjacent channel pairs rotated together.
//!
//! # Shapes (FLUX.1 at 1024×1024: latents 16×128×128, packed 4096 tokens of 64)
//! `hidden_states` `[B, 4096, 64]`, `encoder_hidden_states` `[B, 512, 4096]` (T5-XXL),
//! `pooled_projections` `[B, 768]` (CLIP-L), `timestep` `[B]` in `[0, 1]`, `img_ids`
//! `[4096, 3]`, `txt_ids` `[512, 3]`, `guidance` `[B]`; tokens in the blocks `[B, 4608, 3072]`,
//! attention scores `[B, 24, 4608, 4608]` when the math path is used; output `[B, 4096, 64]`.
//!
//! # Running blocks one at a time
//! [`FluxTransformer2DModel::prepare`] computes the embedded tokens `[B, L_txt + L_img, D]` and
//! the [`BlockInputs`] (time embedding, rotary tables); each [`FluxBlock`] maps tokens to
//! tokens ([`FluxBlock::forward`]); [`FluxTransformer2DModel::head`] turns the last tokens into
//! the prediction. [`FluxTransformer2DModel::forward`] is exactly that sequence, so a caller can
//! run it itself, e.g. moving a block's weights to the device around its forward and backward.

use std::path::Path;

use lora_core::inject::{Adaptable, SiteMut};
use lora_core::linear::LoraLinear;
use tch::{Device, Kind, Tensor};

use super::base::{FluxBaseFormat, FluxBaseSource};
use super::config::{FluxCheckpointInfo, FluxConfig, FluxLayout, ROPE_THETA, TIME_PROJ_DIM};
use super::convert::BflSource;
use crate::checkpoint::SegmentTape;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::sd::AttentionBackend;
use crate::sd::blocks::{TimestepEmbedding, timestep_embedding};
use crate::sd::load::{LoadOptions, component_dir, diffusers_weight_files};
use crate::weights::{
    GgufSource, SafetensorsFiles, Site, TensorSource, Visitor, WeightMode, WeightPath,
};

/// Epsilon of every LayerNorm and RMSNorm of the model (diffusers: `eps=1e-6`).
const NORM_EPS: f64 = 1e-6;

/// `torch.nn.RMSNorm(head_dim, eps=1e-6)` over the last dimension, with a learned scale.
#[derive(Debug)]
struct RmsNorm {
    weight: Tensor,
}

impl RmsNorm {
    fn load(vb: &WeightPath, dim: i64) -> Result<Self> {
        Ok(Self {
            weight: vb.get("weight", &[dim])?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = self.weight.size()[0];
        Ok(x.f_rms_norm([d], Some(&self.weight), NORM_EPS)?)
    }
}

/// `LayerNorm(dim, elementwise_affine=False, eps=1e-6)` over the last dimension.
fn layer_norm(x: &Tensor) -> Result<Tensor> {
    let d = x.size().last().copied().unwrap_or(0);
    Ok(x.f_layer_norm([d], None::<&Tensor>, None::<&Tensor>, NORM_EPS, true)?)
}

/// `x · (1 + scale[:, None]) + shift[:, None]`: `x` `[B, L, D]`, `shift`/`scale` `[B, D]`.
fn modulate(x: &Tensor, shift: &Tensor, scale: &Tensor) -> Result<Tensor> {
    Ok(x.f_mul(&scale.f_unsqueeze(1)?.f_add_scalar(1.0)?)?
        .f_add(&shift.f_unsqueeze(1)?)?)
}

/// `x + gate[:, None] · y`.
fn gated(x: &Tensor, gate: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok(x.f_add(&gate.f_unsqueeze(1)?.f_mul(y)?)?)
}

/// `linear(silu(temb))` split into `n` chunks `[B, D]` each.
fn modulation(
    linear: &Site<LoraLinear>,
    temb: &Tensor,
    n: i64,
    train: bool,
) -> Result<Vec<Tensor>> {
    Ok(linear.forward_t(&temb.f_silu()?, train)?.f_chunk(n, 1)?)
}

/// fp16 activations are clipped to ±65504 after each block, as diffusers does.
fn clip_fp16(x: Tensor) -> Result<Tensor> {
    if x.kind() == Kind::Half {
        Ok(x.f_clamp(-65504.0, 65504.0)?)
    } else {
        Ok(x)
    }
}

/// The per-forward inputs every block takes besides the tokens.
#[derive(Debug)]
pub struct BlockInputs {
    /// The conditioning embedding `temb` `[B, D]` in the model dtype.
    pub temb: Tensor,
    /// Rotary cosines `[L_txt + L_img, head_dim]`, float32.
    pub cos: Tensor,
    /// Rotary sines `[L_txt + L_img, head_dim]`, float32.
    pub sin: Tensor,
    /// Number of text tokens at the front of the token sequence.
    pub txt_len: i64,
}

impl BlockInputs {
    /// These inputs on `device` (the rotary tables and the time embedding; a time embedding
    /// that requires grad keeps its graph).
    ///
    /// # Errors
    /// [`Error::Torch`] when a copy fails.
    pub fn to_device(&self, device: tch::Device) -> Result<Self> {
        Ok(Self {
            temb: self.temb.f_to_device(device)?,
            cos: self.cos.f_to_device(device)?,
            sin: self.sin.f_to_device(device)?,
            txt_len: self.txt_len,
        })
    }
}

/// Rotates adjacent channel pairs of `x` `[B, H, L, d]` by the angles of `cos`/`sin` `[L, d]`
/// (diffusers `apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`), in float32.
fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let sz = x.size();
    let d = sz[3];
    let pairs = x.f_reshape([sz[0], sz[1], sz[2], d / 2, 2])?;
    let (re, im) = (pairs.f_select(-1, 0)?, pairs.f_select(-1, 1)?);
    let rot = Tensor::f_stack(&[im.f_neg()?, re], -1)?.f_reshape(&sz)?;
    let out = x
        .f_to_kind(Kind::Float)?
        .f_mul(cos)?
        .f_add(&rot.f_to_kind(Kind::Float)?.f_mul(sin)?)?;
    Ok(out.f_to_kind(x.kind())?)
}

/// Rotary tables `(cos, sin)` `[L, Σ axes_dims]` float32 for position ids `[L, n_axes]`
/// (diffusers `FluxPosEmbed`: frequencies in float64, each repeated for a channel pair).
///
/// # Errors
/// [`Error::InvalidArgument`] when `ids` is not `[L, axes_dims.len()]`.
pub fn rope_tables(ids: &Tensor, axes_dims: &[i64]) -> Result<(Tensor, Tensor)> {
    let sz = ids.size();
    if sz.len() != 2 || sz[1] != axes_dims.len() as i64 {
        return Err(Error::InvalidArgument(format!(
            "position ids must be [seq, {}] (one column per RoPE axis), got {sz:?}",
            axes_dims.len()
        )));
    }
    let dev = ids.device();
    let pos = ids.f_to_kind(Kind::Float)?.f_to_kind(Kind::Double)?;
    let (mut coss, mut sins) = (Vec::new(), Vec::new());
    for (i, &a) in axes_dims.iter().enumerate() {
        let exps =
            Tensor::f_arange_start_step(0, a, 2, (Kind::Double, dev))?.f_div_scalar(a as f64)?;
        let freqs = Tensor::f_pow_scalar(ROPE_THETA, &exps)?.f_reciprocal()?;
        let angles = pos.f_select(1, i as i64)?.f_outer(&freqs)?; // [L, a/2]
        let twice = |t: Tensor| -> Result<Tensor> {
            let l = t.size()[0];
            Ok(t.f_unsqueeze(-1)?
                .f_expand([l, a / 2, 2], false)?
                .f_reshape([l, a])?
                .f_to_kind(Kind::Float)?)
        };
        coss.push(twice(angles.f_cos()?)?);
        sins.push(twice(angles.f_sin()?)?);
    }
    Ok((Tensor::f_cat(&coss, -1)?, Tensor::f_cat(&sins, -1)?))
}

/// Attention over heads: `q`/`k`/`v` `[B, H, L, d]` → `[B, L, H·d]`.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, backend: AttentionBackend) -> Result<Tensor> {
    let sz = q.size();
    let out = match backend {
        AttentionBackend::Sdpa => Tensor::f_scaled_dot_product_attention::<Tensor>(
            q, k, v, None, 0.0, false, None, false,
        )?,
        AttentionBackend::Math => {
            let scale = 1.0 / (sz[3] as f64).sqrt();
            let scores = q
                .f_to_kind(Kind::Float)?
                .f_matmul(&k.f_to_kind(Kind::Float)?.f_transpose(-1, -2)?)?
                .f_mul_scalar(scale)?;
            scores
                .f_softmax(-1, Kind::Float)?
                .f_to_kind(v.kind())?
                .f_matmul(v)?
        }
    };
    Ok(out
        .f_transpose(1, 2)?
        .f_reshape([sz[0], sz[2], sz[1] * sz[3]])?)
}

/// `[B, L, H·d]` → `[B, H, L, d]`, with `norm` applied per head when given.
fn split_heads(x: &Tensor, head_dim: i64, norm: Option<&RmsNorm>) -> Result<Tensor> {
    let sz = x.size();
    let h = x.f_view([sz[0], sz[1], sz[2] / head_dim, head_dim])?;
    let h = match norm {
        Some(n) => n.forward(&h)?,
        None => h,
    };
    Ok(h.f_transpose(1, 2)?)
}

/// `nn.Linear(i, o)` with bias at `vb`, its weight taken as the source's frozen base
/// ([`WeightPath::base`]: dense here, kept block-quantised by a source that keeps it so).
fn base_linear(vb: &WeightPath, i: i64, o: i64) -> Result<Site<LoraLinear>> {
    let w = vb.base("weight", [o, i], None)?;
    let b = vb.get("bias", &[o])?;
    Ok(vb.site(LoraLinear::new(w, Some(b))?))
}

/// One stream's q/k/v projections and q/k norms.
#[derive(Debug)]
struct Qkv {
    q: Site<LoraLinear>,
    k: Site<LoraLinear>,
    v: Site<LoraLinear>,
    norm_q: RmsNorm,
    norm_k: RmsNorm,
}

impl Qkv {
    #[allow(clippy::too_many_arguments)]
    fn load(
        vb: &WeightPath,
        d: i64,
        hd: i64,
        q: &str,
        k: &str,
        v: &str,
        nq: &str,
        nk: &str,
    ) -> Result<Self> {
        Ok(Self {
            q: base_linear(&vb.pp(q), d, d)?,
            k: base_linear(&vb.pp(k), d, d)?,
            v: base_linear(&vb.pp(v), d, d)?,
            norm_q: RmsNorm::load(&vb.pp(nq), hd)?,
            norm_k: RmsNorm::load(&vb.pp(nk), hd)?,
        })
    }

    /// `(q, k, v)` `[B, H, L, d]` of `x` `[B, L, D]`, q and k normalised (no rotation yet).
    fn project(&self, x: &Tensor, hd: i64, train: bool) -> Result<(Tensor, Tensor, Tensor)> {
        Ok((
            split_heads(&self.q.forward_t(x, train)?, hd, Some(&self.norm_q))?,
            split_heads(&self.k.forward_t(x, train)?, hd, Some(&self.norm_k))?,
            split_heads(&self.v.forward_t(x, train)?, hd, None)?,
        ))
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.q.visit(f)?;
        self.k.visit(f)?;
        self.v.visit(f)
    }

    fn linears(&self) -> [&Site<LoraLinear>; 3] {
        [&self.q, &self.k, &self.v]
    }

    fn norms(&self) -> [&Tensor; 2] {
        [&self.norm_q.weight, &self.norm_k.weight]
    }

    fn norms_mut(&mut self) -> [&mut Tensor; 2] {
        [&mut self.norm_q.weight, &mut self.norm_k.weight]
    }
}

/// diffusers `FeedForward(dim, activation_fn="gelu-approximate")`: `net.2(gelu_tanh(net.0.proj(x)))`.
#[derive(Debug)]
struct FeedForward {
    proj: Site<LoraLinear>,
    out: Site<LoraLinear>,
}

impl FeedForward {
    fn load(vb: &WeightPath, d: i64, m: i64) -> Result<Self> {
        Ok(Self {
            proj: base_linear(&vb.pp("net.0.proj"), d, m)?,
            out: base_linear(&vb.pp("net.2"), m, d)?,
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.proj.forward_t(x, train)?.f_gelu("tanh")?;
        Ok(self.out.forward_t(&h, train)?)
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.proj.visit(f)?;
        self.out.visit(f)
    }

    fn linears(&self) -> [&Site<LoraLinear>; 2] {
        [&self.proj, &self.out]
    }
}

/// A double-stream block (`FluxTransformerBlock`, BFL `DoubleStreamBlock`).
#[derive(Debug)]
pub struct DoubleBlock {
    norm1: Site<LoraLinear>,
    norm1_context: Site<LoraLinear>,
    img: Qkv,
    txt: Qkv,
    to_out: Site<LoraLinear>,
    to_add_out: Site<LoraLinear>,
    ff: FeedForward,
    ff_context: FeedForward,
    head_dim: i64,
    backend: AttentionBackend,
}

impl DoubleBlock {
    fn load(vb: &WeightPath, c: &FluxConfig, backend: AttentionBackend) -> Result<Self> {
        let (d, hd, m) = (c.inner_dim(), c.attention_head_dim, c.mlp_hidden_dim());
        let attn = vb.pp("attn");
        Ok(Self {
            norm1: base_linear(&vb.pp("norm1.linear"), d, 6 * d)?,
            norm1_context: base_linear(&vb.pp("norm1_context.linear"), d, 6 * d)?,
            img: Qkv::load(&attn, d, hd, "to_q", "to_k", "to_v", "norm_q", "norm_k")?,
            txt: Qkv::load(
                &attn,
                d,
                hd,
                "add_q_proj",
                "add_k_proj",
                "add_v_proj",
                "norm_added_q",
                "norm_added_k",
            )?,
            to_out: base_linear(&attn.pp("to_out.0"), d, d)?,
            to_add_out: base_linear(&attn.pp("to_add_out"), d, d)?,
            ff: FeedForward::load(&vb.pp("ff"), d, m)?,
            ff_context: FeedForward::load(&vb.pp("ff_context"), d, m)?,
            head_dim: hd,
            backend,
        })
    }

    fn forward(&self, x: &Tensor, ctx: &BlockInputs, train: bool) -> Result<Tensor> {
        let (lt, l) = (ctx.txt_len, x.size()[1]);
        let txt = x.f_narrow(1, 0, lt)?;
        let img = x.f_narrow(1, lt, l - lt)?;
        // shift, scale, gate (attention); shift, scale, gate (MLP)
        let e = modulation(&self.norm1, &ctx.temb, 6, train)?;
        let c = modulation(&self.norm1_context, &ctx.temb, 6, train)?;
        let ni = modulate(&layer_norm(&img)?, &e[0], &e[1])?;
        let nt = modulate(&layer_norm(&txt)?, &c[0], &c[1])?;
        let (qi, ki, vi) = self.img.project(&ni, self.head_dim, train)?;
        let (qt, kt, vt) = self.txt.project(&nt, self.head_dim, train)?;
        let q = apply_rope(&Tensor::f_cat(&[qt, qi], 2)?, &ctx.cos, &ctx.sin)?;
        let k = apply_rope(&Tensor::f_cat(&[kt, ki], 2)?, &ctx.cos, &ctx.sin)?;
        let v = Tensor::f_cat(&[vt, vi], 2)?;
        let a = attend(&q, &k, &v, self.backend)?;
        let at = self.to_add_out.forward_t(&a.f_narrow(1, 0, lt)?, train)?;
        let ai = self.to_out.forward_t(&a.f_narrow(1, lt, l - lt)?, train)?;
        let img = gated(&img, &e[2], &ai)?;
        let h = self
            .ff
            .forward(&modulate(&layer_norm(&img)?, &e[3], &e[4])?, train)?;
        let img = gated(&img, &e[5], &h)?;
        let txt = gated(&txt, &c[2], &at)?;
        let h = self
            .ff_context
            .forward(&modulate(&layer_norm(&txt)?, &c[3], &c[4])?, train)?;
        let txt = clip_fp16(gated(&txt, &c[5], &h)?)?;
        Ok(Tensor::f_cat(&[txt, img], 1)?)
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.norm1.visit(f)?;
        self.norm1_context.visit(f)?;
        self.img.visit(f)?;
        self.to_out.visit(f)?;
        self.txt.visit(f)?;
        self.to_add_out.visit(f)?;
        self.ff.visit(f)?;
        self.ff_context.visit(f)
    }

    fn linears(&self) -> Vec<&Site<LoraLinear>> {
        let mut v = vec![&self.norm1, &self.norm1_context];
        v.extend(self.img.linears());
        v.push(&self.to_out);
        v.extend(self.txt.linears());
        v.push(&self.to_add_out);
        v.extend(self.ff.linears());
        v.extend(self.ff_context.linears());
        v
    }
}

/// A single-stream block (`FluxSingleTransformerBlock`, BFL `SingleStreamBlock`).
#[derive(Debug)]
pub struct SingleBlock {
    norm: Site<LoraLinear>,
    qkv: Qkv,
    proj_mlp: Site<LoraLinear>,
    proj_out: Site<LoraLinear>,
    head_dim: i64,
    backend: AttentionBackend,
}

impl SingleBlock {
    fn load(vb: &WeightPath, c: &FluxConfig, backend: AttentionBackend) -> Result<Self> {
        let (d, hd, m) = (c.inner_dim(), c.attention_head_dim, c.mlp_hidden_dim());
        Ok(Self {
            norm: base_linear(&vb.pp("norm.linear"), d, 3 * d)?,
            qkv: Qkv::load(
                &vb.pp("attn"),
                d,
                hd,
                "to_q",
                "to_k",
                "to_v",
                "norm_q",
                "norm_k",
            )?,
            proj_mlp: base_linear(&vb.pp("proj_mlp"), d, m)?,
            proj_out: base_linear(&vb.pp("proj_out"), d + m, d)?,
            head_dim: hd,
            backend,
        })
    }

    fn forward(&self, x: &Tensor, ctx: &BlockInputs, train: bool) -> Result<Tensor> {
        let e = modulation(&self.norm, &ctx.temb, 3, train)?; // shift, scale, gate
        let n = modulate(&layer_norm(x)?, &e[0], &e[1])?;
        let mlp = self.proj_mlp.forward_t(&n, train)?.f_gelu("tanh")?;
        let (q, k, v) = self.qkv.project(&n, self.head_dim, train)?;
        let q = apply_rope(&q, &ctx.cos, &ctx.sin)?;
        let k = apply_rope(&k, &ctx.cos, &ctx.sin)?;
        let a = attend(&q, &k, &v, self.backend)?;
        let out = self
            .proj_out
            .forward_t(&Tensor::f_cat(&[a, mlp], 2)?, train)?;
        clip_fp16(gated(x, &e[2], &out)?)
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.norm.visit(f)?;
        self.qkv.visit(f)?;
        self.proj_mlp.visit(f)?;
        self.proj_out.visit(f)
    }

    fn linears(&self) -> Vec<&Site<LoraLinear>> {
        let mut v = vec![&self.norm];
        v.extend(self.qkv.linears());
        v.push(&self.proj_mlp);
        v.push(&self.proj_out);
        v
    }
}

/// One block of the transformer, in forward order: the `num_layers` double-stream blocks,
/// then the `num_single_layers` single-stream ones.
#[derive(Debug)]
pub enum FluxBlock {
    /// `transformer_blocks.{i}`.
    Double(Box<DoubleBlock>),
    /// `single_transformer_blocks.{i}`.
    Single(Box<SingleBlock>),
}

impl FluxBlock {
    /// Runs the block on the tokens `x` `[B, L_txt + L_img, D]` (text first) and returns the
    /// new tokens, same shape; `train` switches LoRA dropout on.
    ///
    /// # Errors
    /// [`Error::Torch`] / [`Error::Core`] on shape or device mismatches (the block's weights
    /// and `x`, `ctx` must be on one device).
    pub fn forward(&self, x: &Tensor, ctx: &BlockInputs, train: bool) -> Result<Tensor> {
        match self {
            FluxBlock::Double(b) => b.forward(x, ctx, train),
            FluxBlock::Single(b) => b.forward(x, ctx, train),
        }
    }

    /// The block's tensors that are not LoRA sites (the q/k RMSNorm scales, `[head_dim]`
    /// each), for a caller that moves the block between devices (its sites are reached through
    /// [`Adaptable::visit_sites`]).
    pub fn norm_tensors_mut(&mut self) -> Vec<&mut Tensor> {
        match self {
            FluxBlock::Double(b) => {
                let mut v: Vec<&mut Tensor> = b.img.norms_mut().into_iter().collect();
                v.extend(b.txt.norms_mut());
                v
            }
            FluxBlock::Single(b) => b.qkv.norms_mut().into_iter().collect(),
        }
    }

    /// The block's linear sites (module path and layer), in visit order.
    pub fn linears(&self) -> Vec<&Site<LoraLinear>> {
        match self {
            FluxBlock::Double(b) => b.linears(),
            FluxBlock::Single(b) => b.linears(),
        }
    }

    /// The q/k RMSNorm scales (`[head_dim]` each).
    fn norms(&self) -> Vec<&Tensor> {
        match self {
            FluxBlock::Double(b) => {
                let mut v: Vec<&Tensor> = b.img.norms().into_iter().collect();
                v.extend(b.txt.norms());
                v
            }
            FluxBlock::Single(b) => b.qkv.norms().into_iter().collect(),
        }
    }

    /// Whether the block's frozen base weights are held on a host device and copied in per use
    /// ([`FluxTransformer2DModel::set_blocks_to_swap`]).
    pub fn is_swapped(&self) -> bool {
        self.linears()
            .iter()
            .any(|l| lora_core::layer::LoraLayer::base(&***l).is_offloaded())
    }

    /// Bytes of the block's frozen tensors by where they live ([`FluxWeightBytes`]).
    pub fn weight_bytes(&self) -> FluxWeightBytes {
        let mut b = FluxWeightBytes::default();
        for l in self.linears() {
            b.add_linear(l);
        }
        for n in self.norms() {
            b.compute += tensor_bytes(n);
        }
        b
    }
}

/// Bytes of a tensor's elements.
fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

/// Bytes of a model's (or a block's) frozen tensors by where they live: base weights as stored
/// (dense, fp8, NF4 or GGUF blocks), biases and norm scales. Adapters are not counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FluxWeightBytes {
    /// Bytes on the compute device (everything but the swapped blocks' base weights).
    pub compute: u64,
    /// Bytes of the swapped blocks' base weights, held on the host device
    /// ([`FluxTransformer2DModel::set_blocks_to_swap`]); lora-memory's FLUX estimate calls them
    /// the swapped blocks' host memory.
    pub host: u64,
}

impl FluxWeightBytes {
    fn add_linear(&mut self, l: &LoraLinear) {
        let base = lora_core::layer::LoraLayer::base(l);
        if base.is_offloaded() {
            self.host += base.storage_bytes();
        } else {
            self.compute += base.storage_bytes();
        }
        if let Some(b) = l.bias() {
            self.compute += tensor_bytes(b);
        }
    }

    /// `compute + host`.
    pub fn total(&self) -> u64 {
        self.compute + self.host
    }
}

impl Adaptable for FluxBlock {
    /// The block's sites under their full module paths (`transformer_blocks.3.attn.to_q`).
    fn visit_sites(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        match self {
            FluxBlock::Double(b) => b.visit(f),
            FluxBlock::Single(b) => b.visit(f),
        }
    }
}

/// The inputs of one forward pass, named as diffusers' `FluxTransformer2DModel.forward` names
/// them.
#[derive(Debug, Clone, Copy)]
pub struct FluxInputs<'a> {
    /// Packed latents `[B, L_img, in_channels]` ([`super::pack_latents`]).
    pub hidden_states: &'a Tensor,
    /// Text-encoder states `[B, L_txt, joint_attention_dim]` (T5).
    pub encoder_hidden_states: &'a Tensor,
    /// Pooled text embedding `[B, pooled_projection_dim]` (CLIP).
    pub pooled_projections: &'a Tensor,
    /// Flow-matching time `[B]` (or one value for all) in `[0, 1]`; multiplied by 1000
    /// inside, as diffusers does.
    pub timestep: &'a Tensor,
    /// Image token ids `[L_img, 3]` ([`super::latent_image_ids`]); a `[B, L_img, 3]` tensor
    /// is accepted and its first row used (diffusers' deprecated form).
    pub img_ids: &'a Tensor,
    /// Text token ids `[L_txt, 3]` (zeros); `[B, L_txt, 3]` accepted as for `img_ids`.
    pub txt_ids: &'a Tensor,
    /// Guidance scale `[B]` (or one value) for a model with `guidance_embeds` (FLUX.1-dev,
    /// usually 3.5 at inference and 1.0 while training); `None` for schnell.
    pub guidance: Option<&'a Tensor>,
}

/// The FLUX.1 transformer (see the module docs). Weights are frozen tensors in the load dtype;
/// every linear is a LoRA site named as diffusers names the module ([`Adaptable`]).
#[derive(Debug)]
pub struct FluxTransformer2DModel {
    config: FluxConfig,
    kind: Kind,
    timestep_embedder: TimestepEmbedding,
    guidance_embedder: Option<TimestepEmbedding>,
    text_embedder: TimestepEmbedding,
    context_embedder: Site<LoraLinear>,
    x_embedder: Site<LoraLinear>,
    blocks: Vec<FluxBlock>,
    norm_out: Site<LoraLinear>,
    proj_out: Site<LoraLinear>,
    param_count: i64,
    gradient_checkpointing: bool,
    /// `(blocks_to_swap, host device)` while blocks are swapped.
    swap: Option<(u32, Device)>,
}

/// The first bytes of a GGUF file.
const GGUF_MAGIC: &[u8; 4] = b"GGUF";

impl FluxTransformer2DModel {
    /// Builds the model from `config`, reading every weight (diffusers names) from `src` in
    /// `opts.kind` (`opts.variant` is not used here).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an invalid config ([`FluxConfig::validate`]);
    /// [`Error::MissingTensor`] / [`Error::Shape`] when the weights do not match it.
    pub fn new(config: FluxConfig, src: &dyn TensorSource, opts: &LoadOptions) -> Result<Self> {
        Self::new_with_base(config, src, opts, FluxBaseFormat::Dense)
    }

    /// [`Self::new`] with the frozen weights held as `base` says ([`FluxBaseFormat`]: fp8 as
    /// kohya's `fp8_base`, NF4 as QLoRA), computing in `opts.kind`. Every linear weight is read
    /// through [`TensorSource::base`], so a source that keeps quantized blocks (a GGUF file) keeps
    /// them whatever `base` is.
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::Core`] when a weight cannot be quantized.
    pub fn new_with_base(
        config: FluxConfig,
        src: &dyn TensorSource,
        opts: &LoadOptions,
        base: FluxBaseFormat,
    ) -> Result<Self> {
        let wrapped = FluxBaseSource::new(src, base);
        let src: &dyn TensorSource = if base == FluxBaseFormat::Dense {
            src
        } else {
            &wrapped
        };
        config.validate()?;
        let vb = WeightPath::new(src, "", opts.kind);
        let d = config.inner_dim();
        let tte = vb.pp("time_text_embed");
        let timestep_embedder =
            TimestepEmbedding::load_base(&tte.pp("timestep_embedder"), TIME_PROJ_DIM, d)?;
        let guidance_embedder = if config.guidance_embeds {
            Some(TimestepEmbedding::load_base(
                &tte.pp("guidance_embedder"),
                TIME_PROJ_DIM,
                d,
            )?)
        } else {
            None
        };
        let text_embedder = TimestepEmbedding::load_base(
            &tte.pp("text_embedder"),
            config.pooled_projection_dim,
            d,
        )?;
        let context_embedder =
            base_linear(&vb.pp("context_embedder"), config.joint_attention_dim, d)?;
        let x_embedder = base_linear(&vb.pp("x_embedder"), config.in_channels, d)?;
        let mut blocks = Vec::new();
        for i in 0..config.num_layers {
            blocks.push(FluxBlock::Double(Box::new(DoubleBlock::load(
                &vb.pp("transformer_blocks").pp(i),
                &config,
                opts.attention,
            )?)));
        }
        for i in 0..config.num_single_layers {
            blocks.push(FluxBlock::Single(Box::new(SingleBlock::load(
                &vb.pp("single_transformer_blocks").pp(i),
                &config,
                opts.attention,
            )?)));
        }
        let norm_out = base_linear(&vb.pp("norm_out.linear"), d, 2 * d)?;
        let proj_out = base_linear(&vb.pp("proj_out"), d, config.proj_out_dim())?;
        let mut m = Self {
            config,
            kind: opts.kind,
            timestep_embedder,
            guidance_embedder,
            text_embedder,
            context_embedder,
            x_embedder,
            blocks,
            norm_out,
            proj_out,
            param_count: 0,
            gradient_checkpointing: false,
            swap: None,
        };
        let norms: i64 = m
            .blocks
            .iter_mut()
            .flat_map(|b| {
                b.norm_tensors_mut()
                    .into_iter()
                    .map(|t| t.numel() as i64)
                    .collect::<Vec<_>>()
            })
            .sum();
        m.param_count = crate::sd::blocks::site_params(&mut m) + norms;
        Ok(m)
    }

    /// Loads a diffusers folder: `dir` is a pipeline root (its `transformer/` is used) or the
    /// `transformer` folder itself, with `config.json` and
    /// `diffusion_pytorch_model[.variant].safetensors` or the shards of its `.index.json`
    /// (FLUX.1-dev ships three shards), memory-mapped.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`] for missing or malformed files; see [`Self::new`].
    pub fn from_diffusers(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        Self::from_diffusers_with_base(dir, opts, FluxBaseFormat::Dense)
    }

    /// [`Self::from_diffusers`] with the frozen weights held as `base` says
    /// ([`Self::new_with_base`]).
    ///
    /// # Errors
    /// As [`Self::from_diffusers`] and [`Self::new_with_base`].
    pub fn from_diffusers_with_base(
        dir: &Path,
        opts: &LoadOptions,
        base: FluxBaseFormat,
    ) -> Result<Self> {
        let dir = component_dir(dir, "transformer")?;
        let config = FluxConfig::from_file(&dir.join("config.json"))?;
        let files = diffusers_weight_files(&dir, opts.variant.as_deref())?;
        let src = SafetensorsFiles::open(&files, &dir, opts.device)?;
        Self::new_with_base(config, &src, opts, base)
    }

    /// Loads one safetensors file without a config: BFL's original layout
    /// (`flux1-dev.safetensors`, `flux1-schnell.safetensors`, ComfyUI checkpoints under
    /// `model.diffusion_model.`, `flux1-dev-fp8.safetensors` whose `F8_E4M3` tensors are read
    /// exactly) or diffusers names (optionally under `transformer.`). The layout, dev vs schnell
    /// and the shape are read off the keys ([`FluxCheckpointInfo::detect`]); `axes_dims_rope`
    /// is needed only for a head width other than FLUX.1's 128. A GGUF file (recognised by its
    /// magic bytes) is loaded by [`Self::from_gguf`] in [`WeightMode::KeepQuantized`].
    ///
    /// # Errors
    /// As [`FluxCheckpointInfo::detect`] and [`Self::new`].
    pub fn from_single_file(
        path: &Path,
        opts: &LoadOptions,
        axes_dims_rope: Option<Vec<i64>>,
    ) -> Result<Self> {
        Self::from_single_file_with_base(path, opts, axes_dims_rope, FluxBaseFormat::Dense)
    }

    /// [`Self::from_single_file`] with the frozen weights held as `base` says
    /// ([`Self::new_with_base`]): `FluxBaseFormat::Fp8` on `flux1-dev.safetensors` converts
    /// at load, on `flux1-dev-fp8.safetensors` keeps the stored bits.
    ///
    /// # Errors
    /// As [`Self::from_single_file`]; [`Error::InvalidArgument`] for a GGUF file with a `base`
    /// other than `Dense` (a GGUF file keeps the types it was written with).
    pub fn from_single_file_with_base(
        path: &Path,
        opts: &LoadOptions,
        axes_dims_rope: Option<Vec<i64>>,
        base: FluxBaseFormat,
    ) -> Result<Self> {
        if is_gguf(path) {
            if base != FluxBaseFormat::Dense {
                return Err(Error::InvalidArgument(format!(
                    "{} is a GGUF file: it keeps the types it was written with, so the base \
                     format {base:?} does not apply; load it with FluxBaseFormat::Dense \
                     (or from_gguf)",
                    path.display()
                )));
            }
            return Self::from_gguf(path, WeightMode::KeepQuantized, opts, axes_dims_rope);
        }
        let files = SafetensorsFiles::open(&[path.to_path_buf()], path, opts.device)?;
        let info =
            FluxCheckpointInfo::detect(path, files.names(), |n| files.shape(n), axes_dims_rope)?;
        match info.layout {
            FluxLayout::Bfl => {
                let src = BflSource::new(&files, &info.prefix, &info.config);
                Self::new_with_base(info.config, &src, opts, base)
            }
            FluxLayout::Diffusers => {
                let prefix = info.prefix.clone();
                let src = files.with_key_map(move |n| Some(format!("{prefix}{n}")));
                Self::new_with_base(info.config, &src, opts, base)
            }
        }
    }

    /// Loads a FLUX GGUF file as city96's ComfyUI-GGUF converter writes them
    /// (`general.architecture = flux`, BFL tensor names such as
    /// `double_blocks.0.img_attn.qkv.weight`, optionally under `model.diffusion_model.`; or
    /// diffusers names), the layout and shape read off the names and shapes as in
    /// [`Self::from_single_file`].
    ///
    /// With [`WeightMode::KeepQuantized`] every linear weight stored as `Q8_0`, `Q4_0`, `Q4_1`,
    /// `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K` or `Q6_K` stays in its blocks
    /// ([`lora_core::quant::QuantWeight`], dequantized per layer on the compute device); the
    /// fused BFL tensors (`img_attn.qkv`, `txt_attn.qkv`, `linear1`) are cut into diffusers'
    /// `to_q`/`to_k`/`to_v`/`proj_mlp` as block rows, never dequantized (a block-quantized
    /// tensor is quantized row by row); F32/F16/BF16 tensors (biases, norm scales, the small
    /// embedders) are read in `opts.kind`, and the model computes in `opts.kind`. With
    /// [`WeightMode::Dense`]`(k)` everything is dequantized to `k` at load and the model
    /// computes in `k` (`opts.kind` is not used).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Gguf`] for an unreadable file; [`Error::Unusable`] when
    /// `general.architecture` is present and not `flux`, or as [`FluxCheckpointInfo::detect`];
    /// [`Error::Unsupported`] for tensor types this reader lacks (Q2_K, Q3_K, IQ*); as
    /// [`Self::new`].
    pub fn from_gguf(
        path: &Path,
        mode: WeightMode,
        opts: &LoadOptions,
        axes_dims_rope: Option<Vec<i64>>,
    ) -> Result<Self> {
        let file = GgufFile::open(path)?;
        if let Ok(arch) = file.get_str("general.architecture")
            && arch != "flux"
        {
            return Err(Error::Unusable {
                what: path.display().to_string(),
                reason: format!(
                    "general.architecture is `{arch}`, not `flux`: not a FLUX transformer GGUF"
                ),
            });
        }
        let info = FluxCheckpointInfo::detect(
            path,
            file.tensors().iter().map(|t| t.name.as_str()),
            |n| file.tensor_info(n).map(|t| t.torch_shape()),
            axes_dims_rope,
        )?;
        let opts = LoadOptions {
            kind: match mode {
                WeightMode::KeepQuantized => opts.kind,
                WeightMode::Dense(k) => k,
            },
            ..opts.clone()
        };
        let gsrc = GgufSource::new(&file, mode, opts.device);
        match info.layout {
            FluxLayout::Bfl => {
                let src = BflSource::new(&gsrc, &info.prefix, &info.config);
                Self::new(info.config, &src, &opts)
            }
            FluxLayout::Diffusers => {
                let prefix = info.prefix.clone();
                let src = gsrc.with_key_map(move |n| Some(format!("{prefix}{n}")));
                Self::new(info.config, &src, &opts)
            }
        }
    }

    /// The configuration.
    pub fn config(&self) -> &FluxConfig {
        &self.config
    }

    /// The dtype weights are held and computed in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Parameters of the model (sites and norm scales), adapters excluded; equals
    /// [`FluxConfig::num_params`].
    pub fn num_params(&self) -> i64 {
        self.param_count
    }

    /// The blocks in forward order (double-stream, then single-stream).
    pub fn blocks(&self) -> &[FluxBlock] {
        &self.blocks
    }

    /// The blocks, mutably (to move a block's weights between devices, or to inject into one
    /// block).
    pub fn blocks_mut(&mut self) -> &mut [FluxBlock] {
        &mut self.blocks
    }

    /// Turns per-block activation checkpointing on or off for [`Self::loss_backward`] (which
    /// refuses to run without it while blocks are swapped, see [`Self::set_blocks_to_swap`]).
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// The device the model computes on (where its inputs, and the adapters, must be).
    pub fn device(&self) -> Device {
        lora_core::layer::LoraLayer::base(&*self.x_embedder).device()
    }

    /// The model's linear sites outside the blocks.
    fn outer_linears(&self) -> Vec<&Site<LoraLinear>> {
        let mut v = vec![
            &self.timestep_embedder.linear_1,
            &self.timestep_embedder.linear_2,
        ];
        if let Some(g) = &self.guidance_embedder {
            v.extend([&g.linear_1, &g.linear_2]);
        }
        v.extend([
            &self.text_embedder.linear_1,
            &self.text_embedder.linear_2,
            &self.context_embedder,
            &self.x_embedder,
            &self.norm_out,
            &self.proj_out,
        ]);
        v
    }

    /// Bytes of the frozen tensors (base weights as stored, biases, norm scales) by where they
    /// live: `host` is what [`Self::set_blocks_to_swap`] keeps on the host device (compare with
    /// lora-memory's FLUX estimate, `swapped_blocks` × block bytes), `compute` the rest.
    pub fn weight_bytes(&self) -> FluxWeightBytes {
        let mut b = FluxWeightBytes::default();
        for l in self.outer_linears() {
            b.add_linear(l);
        }
        for block in &self.blocks {
            let x = block.weight_bytes();
            b.compute += x.compute;
            b.host += x.host;
        }
        b
    }

    /// Moves the frozen tensors to `device` (base weights as stored, biases, norm scales); the
    /// base weights of swapped blocks stay on their host device and are copied to `device` per
    /// use from now on. With [`Self::set_blocks_to_swap`] called first on a model loaded on the
    /// CPU, the swapped blocks never occupy `device` (kohya's
    /// `move_to_device_except_swap_blocks`). Adapters are not moved: inject after moving.
    ///
    /// # Errors
    /// [`Error::Core`] / [`Error::Torch`] when a copy fails (out of memory included); the
    /// model may then be split across devices.
    pub fn to_device(&mut self, device: Device) -> Result<()> {
        self.visit_sites(&mut |_, site| match site {
            SiteMut::Linear(l) => l.move_frozen(device),
            _ => Ok(()),
        })?;
        for b in &mut self.blocks {
            for t in b.norm_tensors_mut() {
                *t = t.f_to_device(device)?;
            }
        }
        Ok(())
    }

    /// kohya's block swapping (`--blocks_to_swap n`, `library/flux_models.py`
    /// `Flux.enable_block_swap` and `custom_offloading_utils.py`): the base weights of the last
    /// `n / 2` double-stream blocks and the last `2·(n − n / 2)` single-stream blocks (the
    /// count is [`lora_memory::FluxDescriptor::swapped_blocks`]) are stored on `host` and
    /// copied to the compute device ([`Self::device`]) for each use, layer by layer
    /// ([`lora_core::base::OffloadedWeight`]: a quantized weight moves its blocks, never
    /// dequantized on the host); their biases and norm scales stay on the compute device, as in
    /// kohya, which moves only the `weight` tensors. Blocks no longer swapped come back to the
    /// compute device; `n = 0` brings all back. [`Self::weight_bytes`] says how many bytes stay
    /// on the host.
    ///
    /// Under autograd the device copy a layer's product saves for its backward lives until the
    /// backward pass, so swapping saves device memory only with activation checkpointing, whose
    /// forward runs without a graph and whose backward recomputes one block at a time (kohya
    /// pairs the two as well): a non-zero `n` turns [`Self::set_gradient_checkpointing`] on, and
    /// [`Self::loss_backward`] refuses to run with swapped blocks and checkpointing off.
    /// Inference ([`Self::forward`] under `no_grad`) needs nothing more. There is no prefetch:
    /// each copy is made when its layer runs (kohya overlaps the next block's copy with the
    /// current block's compute on a side stream).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `n` leaves fewer than two blocks of either kind on the
    /// device (kohya's limit, 35 for FLUX.1); [`Error::Core`] when a copy fails (the blocks
    /// already handled stay as they were moved).
    pub fn set_blocks_to_swap(&mut self, n: u32, host: Device) -> Result<()> {
        let c = &self.config;
        let desc = lora_memory::FluxDescriptor {
            double_blocks: c.num_layers.max(0) as u64,
            single_blocks: c.num_single_layers.max(0) as u64,
            ..lora_memory::FluxDescriptor::dev()
        };
        let (nd, ns) = desc
            .swapped_blocks(n)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let (double, single) = (c.num_layers as usize, c.num_single_layers as usize);
        let swapped = |i: usize| {
            if i < double {
                i + nd as usize >= double
            } else {
                i - double + ns as usize >= single
            }
        };
        // offload first, then bring blocks back, so the device never holds both
        for pass_offload in [true, false] {
            for (i, block) in self.blocks.iter_mut().enumerate() {
                if swapped(i) != pass_offload {
                    continue;
                }
                block.visit_sites(&mut |_, site| {
                    let SiteMut::Linear(l) = site else {
                        return Ok(());
                    };
                    let base = lora_core::layer::LoraLayer::base(&*l);
                    let next = if pass_offload {
                        base.offloaded(host)?
                    } else if base.is_offloaded() {
                        base.onloaded()?
                    } else {
                        return Ok(());
                    };
                    l.replace_base(next).map(|_| ())
                })?;
            }
        }
        self.swap = (n > 0).then_some((n, host));
        if n > 0 {
            self.gradient_checkpointing = true;
        }
        Ok(())
    }

    /// The `blocks_to_swap` in effect (0 when none are swapped).
    pub fn blocks_to_swap(&self) -> u32 {
        self.swap.map_or(0, |(n, _)| n)
    }

    /// Whether [`Self::loss_backward`] checkpoints activations.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// Checks the inputs, casts them to the model dtype, and computes the tokens entering the
    /// first block, `[B, L_txt + L_img, D]` (`context_embedder(txt) ‖ x_embedder(img)`), and
    /// the [`BlockInputs`]: `temb = timestep_embedder(sincos(1000·t)) (+
    /// guidance_embedder(sincos(1000·g))) + text_embedder(pooled)` and the rotary tables of
    /// `[txt_ids ‖ img_ids]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for mis-shaped inputs, a missing `guidance` on a model with
    /// `guidance_embeds` or one given to a model without; [`Error::Torch`] from libtorch.
    pub fn prepare(&self, inp: &FluxInputs<'_>, train: bool) -> Result<(Tensor, BlockInputs)> {
        let c = &self.config;
        let hs = inp.hidden_states;
        if hs.dim() != 3 || hs.size()[2] != c.in_channels {
            return Err(Error::InvalidArgument(format!(
                "FLUX hidden_states must be packed latents [batch, seq, {}], got {:?}",
                c.in_channels,
                hs.size()
            )));
        }
        let (b, li) = (hs.size()[0], hs.size()[1]);
        let ehs = inp.encoder_hidden_states;
        if ehs.dim() != 3 || ehs.size()[0] != b || ehs.size()[2] != c.joint_attention_dim {
            return Err(Error::InvalidArgument(format!(
                "FLUX encoder_hidden_states must be [batch = {b}, seq, {}], got {:?}",
                c.joint_attention_dim,
                ehs.size()
            )));
        }
        let lt = ehs.size()[1];
        let pooled = inp.pooled_projections;
        if pooled.size() != [b, c.pooled_projection_dim] {
            return Err(Error::InvalidArgument(format!(
                "FLUX pooled_projections must be [batch = {b}, {}], got {:?}",
                c.pooled_projection_dim,
                pooled.size()
            )));
        }
        let per_batch = |t: &Tensor, what: &str| -> Result<Tensor> {
            let t = t.f_reshape([-1])?;
            match t.size()[0] {
                n if n == b => Ok(t),
                1 => Ok(t.f_expand([b], false)?),
                n => Err(Error::InvalidArgument(format!(
                    "FLUX {what} must have batch = {b} values (or one), got {n}"
                ))),
            }
        };
        let ids = |t: &Tensor, len: i64, what: &str| -> Result<Tensor> {
            let t = if t.dim() == 3 {
                t.f_select(0, 0)?
            } else {
                t.shallow_clone()
            };
            let n_axes = c.axes_dims_rope.len() as i64;
            if t.size() != [len, n_axes] {
                return Err(Error::InvalidArgument(format!(
                    "FLUX {what} must be [{len}, {n_axes}] (one id per token and RoPE axis), got {:?}",
                    t.size()
                )));
            }
            Ok(t)
        };
        let kind = self.kind;
        let t = per_batch(inp.timestep, "timestep")?
            .f_to_kind(kind)?
            .f_mul_scalar(1000.0)?;
        let embed = |e: &TimestepEmbedding, t: &Tensor| -> Result<Tensor> {
            let p = timestep_embedding(t, TIME_PROJ_DIM, true, 0.0)?.f_to_kind(kind)?;
            e.forward(&p, train)
        };
        let mut temb = embed(&self.timestep_embedder, &t)?;
        match (&self.guidance_embedder, inp.guidance) {
            (Some(g_emb), Some(g)) => {
                let g = per_batch(g, "guidance")?
                    .f_to_kind(kind)?
                    .f_mul_scalar(1000.0)?;
                temb = temb.f_add(&embed(g_emb, &g)?)?;
            }
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "this FLUX model embeds guidance (`guidance_embeds`, FLUX.1-dev): pass a \
                     guidance scale [batch] (e.g. 3.5 to sample, 1.0 to train)"
                        .into(),
                ));
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "guidance was given but this FLUX model has no guidance embedder \
                     (schnell-like, `guidance_embeds: false`)"
                        .into(),
                ));
            }
            (None, None) => {}
        }
        let temb = temb.f_add(
            &self
                .text_embedder
                .forward(&pooled.f_to_kind(kind)?, train)?,
        )?;
        let txt = self
            .context_embedder
            .forward_t(&ehs.f_to_kind(kind)?, train)?;
        let img = self.x_embedder.forward_t(&hs.f_to_kind(kind)?, train)?;
        let all_ids = Tensor::f_cat(
            &[
                ids(inp.txt_ids, lt, "txt_ids")?,
                ids(inp.img_ids, li, "img_ids")?,
            ],
            0,
        )?
        .f_to_device(hs.device())?;
        let (cos, sin) = rope_tables(&all_ids, &c.axes_dims_rope)?;
        Ok((
            Tensor::f_cat(&[txt, img], 1)?,
            BlockInputs {
                temb,
                cos,
                sin,
                txt_len: lt,
            },
        ))
    }

    /// The output head on the last block's tokens `x` `[B, L_txt + L_img, D]`: the image tokens
    /// through `norm_out` (`AdaLayerNormContinuous`: `LN(x)·(1 + scale) + shift` with
    /// `scale, shift = linear(silu(temb))`) and `proj_out` → `[B, L_img, patch² · out_channels]`.
    ///
    /// # Errors
    /// [`Error::Torch`] / [`Error::Core`] on shape mismatches.
    pub fn head(&self, x: &Tensor, ctx: &BlockInputs, train: bool) -> Result<Tensor> {
        let (lt, l) = (ctx.txt_len, x.size()[1]);
        let img = x.f_narrow(1, lt, l - lt)?;
        let e = modulation(&self.norm_out, &ctx.temb, 2, train)?; // scale, shift
        let h = modulate(&layer_norm(&img)?, &e[1], &e[0])?;
        Ok(self.proj_out.forward_t(&h, train)?)
    }

    /// The velocity prediction for the packed latents (inference: no LoRA dropout).
    ///
    /// # Shapes
    /// See [`FluxInputs`]; returns `[B, L_img, patch² · out_channels]` in the model dtype.
    ///
    /// # Errors
    /// As [`Self::prepare`]; [`Error::Torch`] from libtorch.
    pub fn forward(&self, inp: &FluxInputs<'_>) -> Result<Tensor> {
        self.forward_t(inp, false)
    }

    /// [`Self::forward`] with `train` switching LoRA dropout on.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_t(&self, inp: &FluxInputs<'_>, train: bool) -> Result<Tensor> {
        let (mut x, ctx) = self.prepare(inp, train)?;
        for b in &self.blocks {
            x = b.forward(&x, &ctx, train)?;
        }
        self.head(&x, &ctx, train)
    }

    /// Runs the model, computes `loss = loss_fn(prediction)` and backpropagates
    /// `loss · loss_scale` into every tensor that requires grad (the adapters; the inputs
    /// when they require grad); returns the unscaled loss, detached. `loss_scale` is
    /// `1 / gradient_accumulation_steps` (times an fp16 loss scale).
    ///
    /// With [`Self::set_gradient_checkpointing`] on, the blocks run without a graph keeping
    /// only each block's input tokens `[B, L_txt + L_img, D]`, and are recomputed one by one
    /// during the backward pass ([`SegmentTape`], as diffusers' `enable_gradient_checkpointing`
    /// checkpoints each block); the time embedding enters the blocks as a leaf whose gradient
    /// accumulates over the blocks and is backpropagated once at the end, with the input
    /// tokens' gradient. Gradients equal those of the plain path (tested).
    ///
    /// # Errors
    /// As [`Self::forward_t`]; whatever `loss_fn` returns; [`Error::InvalidArgument`] when the
    /// loss does not reach the prediction; [`Error::Shim`] when the generator state cannot be
    /// saved or restored.
    pub fn loss_backward(
        &self,
        inp: &FluxInputs<'_>,
        train: bool,
        loss_scale: f64,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if let Some((n, host)) = self.swap
            && !self.gradient_checkpointing
        {
            return Err(Error::InvalidArgument(format!(
                "blocks_to_swap {n} keeps block weights on {host:?} and copies them in per use: \
                 without gradient checkpointing every copy would stay on the device until the \
                 backward pass; call set_gradient_checkpointing(true) (or set_blocks_to_swap(0))"
            )));
        }
        if !self.gradient_checkpointing {
            let pred = self.forward_t(inp, train)?;
            let loss = loss_fn(&pred)?;
            loss.f_mul_scalar(loss_scale)?.f_backward()?;
            return Ok(loss.f_detach()?);
        }
        let (x0, ctx) = self.prepare(inp, train)?;
        let temb_grad = ctx.temb.requires_grad();
        let leaf = ctx.temb.f_detach()?.f_set_requires_grad(temb_grad)?;
        let lctx = BlockInputs {
            temb: leaf.shallow_clone(),
            cos: ctx.cos.shallow_clone(),
            sin: ctx.sin.shallow_clone(),
            txt_len: ctx.txt_len,
        };
        let seg = |i: usize, x: &Tensor| self.blocks[i].forward(x, &lctx, train);
        let (h, tape) = SegmentTape::forward(&x0, self.blocks.len(), seg)?;
        let pred = self.head(&h, &lctx, train)?;
        let loss = loss_fn(&pred)?;
        loss.f_mul_scalar(loss_scale)?.f_backward()?;
        let g = h.f_grad()?;
        if !g.defined() {
            return Err(Error::InvalidArgument(
                "checkpointed FLUX backward: the loss does not depend on the prediction".into(),
            ));
        }
        let g0 = tape.backward(&g, seg)?;
        // one backward through the embeddings for the tokens' and the time embedding's grads
        let mut tail: Option<Tensor> = None;
        if x0.requires_grad() {
            tail = Some(x0.f_mul(&g0.f_to_kind(x0.kind())?)?.f_sum(Kind::Float)?);
        }
        if temb_grad {
            let gt = leaf.f_grad()?;
            if gt.defined() {
                let s = ctx.temb.f_mul(&gt)?.f_sum(Kind::Float)?;
                tail = Some(match tail {
                    Some(t) => t.f_add(&s)?,
                    None => s,
                });
            }
        }
        if let Some(t) = tail {
            t.f_backward()?;
        }
        Ok(loss.f_detach()?)
    }
}

/// Whether `path` starts with the GGUF magic bytes.
fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == GGUF_MAGIC
}

impl Adaptable for FluxTransformer2DModel {
    /// Sites in diffusers naming: `time_text_embed.{timestep,guidance,text}_embedder.linear_{1,2}`,
    /// `context_embedder`, `x_embedder`, `transformer_blocks.{i}.{norm1,norm1_context}.linear`,
    /// `….attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}`,
    /// `….{ff,ff_context}.net.{0.proj,2}`, `single_transformer_blocks.{i}.norm.linear`,
    /// `….attn.{to_q,to_k,to_v}`, `….proj_mlp`, `….proj_out`, `norm_out.linear`, `proj_out`.
    fn visit_sites(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.timestep_embedder.visit(f)?;
        if let Some(g) = &mut self.guidance_embedder {
            g.visit(f)?;
        }
        self.text_embedder.visit(f)?;
        self.context_embedder.visit(f)?;
        self.x_embedder.visit(f)?;
        for b in &mut self.blocks {
            b.visit_sites(f)?;
        }
        self.norm_out.visit(f)?;
        self.proj_out.visit(f)
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.param_count)
    }
}
