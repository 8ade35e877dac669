//! The building blocks shared by the UNet and the VAE, named and computed as diffusers names and
//! computes them (`diffusers/models/{resnet,attention,attention_processor,embeddings,normalization}.py`,
//! `transformers/transformer_2d.py`, diffusers 0.42.1).
//!
//! Every linear layer is a [`LoraLinear`] and every convolution a [`LoraConv2d`], so LoRA (and
//! LoCon on 3×3 convolutions) can be injected into any of them by module path.
//!
//! Activation shapes use `B` batch, `C` channels, `H×W` spatial size, `L` sequence length
//! (`L = H·W` for image tokens), `D` the cross-attention context width.

use crate::weights::Site;
use lora_core::conv::LoraConv2d;
use lora_core::inject::SiteMut;
use lora_core::linear::LoraLinear;
use tch::{Kind, Tensor};

use super::attention::{AttentionBackend, multi_head_attention};
use crate::error::{Error, Result};
use crate::weights::WeightPath;

pub(crate) use crate::weights::Visitor;

/// Weights and biases of all sites of `model` (adapters excluded).
pub(crate) fn site_params(model: &mut dyn lora_core::inject::Adaptable) -> i64 {
    let mut n = 0i64;
    let _ = model.visit_sites(&mut |_, s| {
        n += s.layer_ref().base().numel();
        n += match &s {
            SiteMut::Linear(x) => x.bias().map_or(0, |b| b.numel() as i64),
            SiteMut::Conv2d(x) => x.bias().map_or(0, |b| b.numel() as i64),
            SiteMut::Embedding(_) => 0,
        };
        Ok(())
    });
    n
}

/// Reads weights under a module prefix (diffusers names), checking shapes.
pub(crate) type Vb<'a> = WeightPath<'a>;

/// The normalisation layers of SD's blocks, built at a [`WeightPath`].
pub(crate) trait NormLayers {
    /// `nn.GroupNorm(groups, c, eps, affine=True)` at this path.
    fn group_norm(&self, groups: i64, c: i64, eps: f64) -> Result<GroupNorm>;
    /// `nn.LayerNorm(c, eps, elementwise_affine=True)` at this path.
    fn layer_norm(&self, c: i64, eps: f64) -> Result<LayerNorm>;
}

impl NormLayers for WeightPath<'_> {
    fn group_norm(&self, groups: i64, c: i64, eps: f64) -> Result<GroupNorm> {
        if groups <= 0 || c % groups != 0 {
            return Err(Error::InvalidArgument(format!(
                "{}: GroupNorm over {c} channels needs a group count that divides it, got {groups} \
                 (check `norm_num_groups` against `block_out_channels`)",
                self.path()
            )));
        }
        Ok(GroupNorm {
            weight: self.get("weight", &[c])?,
            bias: self.get("bias", &[c])?,
            groups,
            eps,
        })
    }

    fn layer_norm(&self, c: i64, eps: f64) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.get("weight", &[c])?,
            bias: self.get("bias", &[c])?,
            eps,
        })
    }
}

/// Group normalisation (`torch.nn.GroupNorm`, Wu & He 2018): statistics over each group of
/// `C / groups` channels and all spatial positions; affine per channel.
///
/// # Shapes
/// `[B, C, *]` → `[B, C, *]`.
#[derive(Debug)]
pub struct GroupNorm {
    weight: Tensor,
    bias: Tensor,
    groups: i64,
    eps: f64,
}

impl GroupNorm {
    /// Normalises `x` `[B, C, ...]`.
    ///
    /// # Errors
    /// [`Error::Torch`] when `C` does not match.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_group_norm(
            self.groups,
            Some(&self.weight),
            Some(&self.bias),
            self.eps,
            true,
        )?)
    }

    /// Parameter count.
    pub(crate) fn numel(&self) -> i64 {
        self.weight.numel() as i64 + self.bias.numel() as i64
    }
}

/// Layer normalisation over the last dimension (`torch.nn.LayerNorm`).
#[derive(Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    /// Normalises `x` `[..., C]`.
    ///
    /// # Errors
    /// [`Error::Torch`] when `C` does not match.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let c = self.weight.size()[0];
        Ok(x.f_layer_norm([c], Some(&self.weight), Some(&self.bias), self.eps, true)?)
    }

    pub(crate) fn numel(&self) -> i64 {
        self.weight.numel() as i64 + self.bias.numel() as i64
    }
}

/// Sinusoidal timestep embedding (diffusers `embeddings.get_timestep_embedding`, after
/// "Denoising Diffusion Probabilistic Models" / the Transformer's positional encoding):
/// with `half = dim / 2`, `fᵢ = exp(−ln(10000)·i / (half − freq_shift))`, the embedding is
/// `[sin(t·f), cos(t·f)]`, or `[cos(t·f), sin(t·f)]` when `flip_sin_to_cos`; an odd `dim` is
/// zero-padded by one column.
///
/// # Shapes
/// `timesteps` `[B]` (any numeric dtype; fractional values allowed) → `[B, dim]` float32.
///
/// # Errors
/// [`Error::InvalidArgument`] when `timesteps` is not 1-D.
pub fn timestep_embedding(
    timesteps: &Tensor,
    dim: i64,
    flip_sin_to_cos: bool,
    freq_shift: f64,
) -> Result<Tensor> {
    if timesteps.dim() != 1 {
        return Err(Error::InvalidArgument(format!(
            "timesteps must be 1-D [batch], got shape {:?}",
            timesteps.size()
        )));
    }
    let half = dim / 2;
    let dev = timesteps.device();
    let exponent = Tensor::f_arange(half, (Kind::Float, dev))?
        .f_mul_scalar(-(10000f64.ln()))?
        .f_div_scalar(half as f64 - freq_shift)?;
    let freqs = exponent.f_exp()?;
    let args = timesteps
        .f_to_kind(Kind::Float)?
        .f_unsqueeze(1)?
        .f_mul(&freqs.f_unsqueeze(0)?)?;
    let (s, c) = (args.f_sin()?, args.f_cos()?);
    let emb = if flip_sin_to_cos {
        Tensor::f_cat(&[c, s], -1)?
    } else {
        Tensor::f_cat(&[s, c], -1)?
    };
    if dim % 2 == 1 {
        Ok(emb.f_constant_pad_nd([0, 1])?)
    } else {
        Ok(emb)
    }
}

/// diffusers `TimestepEmbedding`: `linear_2(silu(linear_1(x)))`.
///
/// # Shapes
/// `[B, in]` → `[B, time_embed_dim]`.
#[derive(Debug)]
pub struct TimestepEmbedding {
    pub(crate) linear_1: Site<LoraLinear>,
    pub(crate) linear_2: Site<LoraLinear>,
}

impl TimestepEmbedding {
    pub(crate) fn load(vb: &Vb, i: i64, o: i64) -> Result<Self> {
        Ok(Self {
            linear_1: vb.pp("linear_1").linear(i, o, true)?,
            linear_2: vb.pp("linear_2").linear(o, o, true)?,
        })
    }

    /// As `load`, the weights taken as the source's frozen bases ([`crate::weights::WeightPath::base`]:
    /// kept quantized by a source that keeps them so).
    pub(crate) fn load_base(vb: &Vb, i: i64, o: i64) -> Result<Self> {
        let lin = |vb: &Vb, i: i64, o: i64| -> Result<Site<LoraLinear>> {
            let w = vb.base("weight", [o, i], None)?;
            let b = vb.get("bias", &[o])?;
            Ok(vb.site(LoraLinear::new(w, Some(b))?))
        };
        Ok(Self {
            linear_1: lin(&vb.pp("linear_1"), i, o)?,
            linear_2: lin(&vb.pp("linear_2"), o, o)?,
        })
    }

    /// Forward pass; `train` enables LoRA dropout.
    ///
    /// # Errors
    /// [`Error::Torch`] / [`Error::Core`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.linear_1.forward_t(x, train)?.f_silu()?;
        Ok(self.linear_2.forward_t(&h, train)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.linear_1.visit(f)?;
        self.linear_2.visit(f)
    }
}

/// diffusers `ResnetBlock2D` with `time_embedding_norm="default"`, SiLU, no up/down sampling:
///
/// ```text
/// h = conv1(silu(norm1(x)));  h += time_emb_proj(silu(temb))[:, :, None, None]
/// h = conv2(silu(norm2(h)));  out = (shortcut(x) + h) / output_scale_factor
/// ```
/// `shortcut` is the 1×1 `conv_shortcut` when the channel count changes, else the identity.
/// Dropout is inactive (inference semantics; diffusers' default dropout is 0).
///
/// # Shapes
/// `x` `[B, C_in, H, W]`, `temb` `[B, T]` → `[B, C_out, H, W]`.
#[derive(Debug)]
pub struct ResnetBlock2D {
    norm1: GroupNorm,
    conv1: Site<LoraConv2d>,
    time_emb_proj: Option<Site<LoraLinear>>,
    norm2: GroupNorm,
    conv2: Site<LoraConv2d>,
    conv_shortcut: Option<Site<LoraConv2d>>,
    output_scale_factor: f64,
}

impl ResnetBlock2D {
    /// `temb_channels` is `None` for the VAE (no time embedding).
    pub(crate) fn load(
        vb: &Vb,
        c_in: i64,
        c_out: i64,
        temb_channels: Option<i64>,
        groups: i64,
        eps: f64,
        output_scale_factor: f64,
    ) -> Result<Self> {
        Ok(Self {
            norm1: vb.pp("norm1").group_norm(groups, c_in, eps)?,
            conv1: vb.pp("conv1").conv(c_in, c_out, 3, 1, 1)?,
            time_emb_proj: match temb_channels {
                Some(t) => Some(vb.pp("time_emb_proj").linear(t, c_out, true)?),
                None => None,
            },
            norm2: vb.pp("norm2").group_norm(groups, c_out, eps)?,
            conv2: vb.pp("conv2").conv(c_out, c_out, 3, 1, 1)?,
            conv_shortcut: if c_in != c_out {
                Some(vb.pp("conv_shortcut").conv(c_in, c_out, 1, 1, 0)?)
            } else {
                None
            },
            output_scale_factor,
        })
    }

    /// Forward pass; `temb` must be given iff the block has `time_emb_proj`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `temb` is missing; [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, temb: Option<&Tensor>, train: bool) -> Result<Tensor> {
        // Each intermediate is released as soon as the next one exists (assignment drops the
        // old value; shadowing would keep every one alive to the end): without grad — sample
        // images, the VAE — the block then holds its input and at most three other maps
        // (lora-memory's `resnet_inference_elements` adds the convolution's reordered input)
        // instead of `c_in + 5·c_out` more. With grad, autograd keeps what the backward needs
        // either way.
        let mut h = self.norm1.forward(x)?.f_silu()?;
        h = self.conv1.forward_t(&h, train)?;
        if let Some(proj) = &self.time_emb_proj {
            let t = temb.ok_or_else(|| {
                Error::InvalidArgument(
                    "a ResnetBlock2D with time_emb_proj needs a time embedding".into(),
                )
            })?;
            let t = proj
                .forward_t(&t.f_silu()?, train)?
                .f_unsqueeze(-1)?
                .f_unsqueeze(-1)?;
            h = h.f_add(&t)?;
        }
        h = self.norm2.forward(&h)?.f_silu()?;
        h = self.conv2.forward_t(&h, train)?;
        let skip = match &self.conv_shortcut {
            Some(c) => c.forward_t(x, train)?,
            None => x.shallow_clone(),
        };
        let out = skip.f_add(&h)?;
        if self.output_scale_factor == 1.0 {
            Ok(out)
        } else {
            Ok(out.f_div_scalar(self.output_scale_factor)?)
        }
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.conv1.visit(f)?;
        if let Some(t) = &mut self.time_emb_proj {
            t.visit(f)?;
        }
        self.conv2.visit(f)?;
        if let Some(c) = &mut self.conv_shortcut {
            c.visit(f)?;
        }
        Ok(())
    }

    pub(crate) fn norm_params(&self) -> i64 {
        self.norm1.numel() + self.norm2.numel()
    }
}

/// diffusers `Downsample2D`: a 3×3 convolution with stride 2 (`conv`), or a 2×2 average pool
/// when the block has no convolution. The VAE encoder uses `padding=0` with an explicit
/// asymmetric zero pad `(0, 1, 0, 1)` (right and bottom) before the convolution; the UNet uses
/// `padding=1` (`downsample_padding`).
///
/// # Shapes
/// `[B, C, H, W]` → `[B, C_out, ⌈H/2⌉, ⌈W/2⌉]` (conv, padding 1) / `[B, C, ⌊H/2⌋, ⌊W/2⌋]`.
#[derive(Debug)]
pub enum Downsample2D {
    /// Stride-2 convolution; `pad_right_bottom` is the VAE's `padding=0` variant.
    Conv {
        /// The convolution (`downsamplers.0.conv`).
        conv: Site<LoraConv2d>,
        /// Pads one zero column/row on the right/bottom first.
        pad_right_bottom: bool,
    },
    /// `avg_pool2d(kernel 2, stride 2)`.
    AvgPool,
}

impl Downsample2D {
    pub(crate) fn load_conv(vb: &Vb, c_in: i64, c_out: i64, padding: i64) -> Result<Self> {
        Ok(Downsample2D::Conv {
            conv: vb.pp("conv").conv(c_in, c_out, 3, 2, padding)?,
            pad_right_bottom: padding == 0,
        })
    }

    /// Forward pass.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Downsample2D::Conv {
                conv,
                pad_right_bottom,
            } => {
                if *pad_right_bottom {
                    let x = x.f_constant_pad_nd([0, 1, 0, 1])?;
                    Ok(conv.forward_t(&x, train)?)
                } else {
                    Ok(conv.forward_t(x, train)?)
                }
            }
            Downsample2D::AvgPool => {
                Ok(x.f_avg_pool2d([2, 2], [2, 2], [0, 0], false, true, None)?)
            }
        }
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        match self {
            Downsample2D::Conv { conv, .. } => conv.visit(f),
            Downsample2D::AvgPool => Ok(()),
        }
    }
}

/// diffusers `Upsample2D` with `use_conv=True`: nearest-neighbour ×2 (or to an explicit size, as
/// diffusers does when the latent size is not a multiple of the UNet's total down-sampling), then
/// a 3×3 convolution (`conv`).
///
/// # Shapes
/// `[B, C, H, W]` → `[B, C, 2H, 2W]` (or `[B, C, size…]`).
#[derive(Debug)]
pub struct Upsample2D {
    conv: Site<LoraConv2d>,
}

impl Upsample2D {
    pub(crate) fn load(vb: &Vb, c: i64) -> Result<Self> {
        Ok(Self {
            conv: vb.pp("conv").conv(c, c, 3, 1, 1)?,
        })
    }

    /// Forward pass; `size` overrides the ×2 output size.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, size: Option<[i64; 2]>, train: bool) -> Result<Tensor> {
        let s = x.size();
        let size = size.unwrap_or([s[2] * 2, s[3] * 2]);
        let up = x.f_upsample_nearest2d(size, None, None)?;
        Ok(self.conv.forward_t(&up, train)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.conv.visit(f)
    }
}

/// diffusers `Attention` as used by the UNet's transformer blocks: `to_q`, `to_k`, `to_v`
/// (no bias) and `to_out.0` (bias); self-attention when no context is given, cross-attention on
/// `encoder_hidden_states` otherwise. The VAE's mid-block variant ([`SpatialAttention`]) adds a
/// group norm, biases and a residual.
///
/// # Shapes
/// `x` `[B, L, C]`, context `[B, Lk, D]` → `[B, L, C]`; inner width `heads · head_dim`.
#[derive(Debug)]
pub struct Attention {
    to_q: Site<LoraLinear>,
    to_k: Site<LoraLinear>,
    to_v: Site<LoraLinear>,
    to_out: Site<LoraLinear>,
    heads: i64,
    backend: AttentionBackend,
}

impl Attention {
    pub(crate) fn load(
        vb: &Vb,
        query_dim: i64,
        context_dim: i64,
        heads: i64,
        head_dim: i64,
        bias: bool,
        backend: AttentionBackend,
    ) -> Result<Self> {
        Self::load_named(
            vb,
            ["to_q", "to_k", "to_v", "to_out.0"],
            query_dim,
            context_dim,
            heads,
            head_dim,
            bias,
            backend,
        )
    }

    /// [`Self::load`] reading the four projections from the given module names.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load_named(
        vb: &Vb,
        names: [&str; 4],
        query_dim: i64,
        context_dim: i64,
        heads: i64,
        head_dim: i64,
        bias: bool,
        backend: AttentionBackend,
    ) -> Result<Self> {
        let inner = heads * head_dim;
        Ok(Self {
            to_q: vb.pp_as(names[0], "to_q").linear(query_dim, inner, bias)?,
            to_k: vb
                .pp_as(names[1], "to_k")
                .linear(context_dim, inner, bias)?,
            to_v: vb
                .pp_as(names[2], "to_v")
                .linear(context_dim, inner, bias)?,
            to_out: vb
                .pp_as(names[3], "to_out.0")
                .linear(inner, query_dim, true)?,
            heads,
            backend,
        })
    }

    /// Attention of `x` on itself (`context = None`) or on `context`.
    ///
    /// # Errors
    /// [`Error::Torch`] / [`Error::Core`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>, train: bool) -> Result<Tensor> {
        let ctx = context.unwrap_or(x);
        let q = self.to_q.forward_t(x, train)?;
        let k = self.to_k.forward_t(ctx, train)?;
        let v = self.to_v.forward_t(ctx, train)?;
        let o = multi_head_attention(&q, &k, &v, self.heads, self.backend)?;
        Ok(self.to_out.forward_t(&o, train)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.to_q.visit(f)?;
        self.to_k.visit(f)?;
        self.to_v.visit(f)?;
        self.to_out.visit(f)
    }
}

/// The VAE mid-block attention (diffusers `Attention` built by `UNetMidBlock2D` with
/// `residual_connection=True`, `bias=True`, one head of width `C`, `group_norm`):
/// `x + to_out(attn(group_norm(x)))` over the `H·W` positions.
///
/// # Shapes
/// `[B, C, H, W]` → `[B, C, H, W]`.
#[derive(Debug)]
pub struct SpatialAttention {
    group_norm: GroupNorm,
    attn: Attention,
}

impl SpatialAttention {
    pub(crate) fn load(
        vb: &Vb,
        c: i64,
        groups: i64,
        eps: f64,
        backend: AttentionBackend,
    ) -> Result<Self> {
        // VAE folders saved by diffusers before 0.14 name the projections `query`, `key`,
        // `value`, `proj_attn` (diffusers converts them on load:
        // `modeling_utils._convert_deprecated_attention_blocks`); the module paths stay the
        // current ones.
        let names = if vb.pp("to_q").get_opt("weight", &[c, c])?.is_none()
            && vb.pp("query").get_opt("weight", &[c, c])?.is_some()
        {
            ["query", "key", "value", "proj_attn"]
        } else {
            ["to_q", "to_k", "to_v", "to_out.0"]
        };
        Ok(Self {
            group_norm: vb.pp("group_norm").group_norm(groups, c, eps)?,
            attn: Attention::load_named(vb, names, c, c, 1, c, true, backend)?,
        })
    }

    /// Forward pass.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (b, c, h, w) = x.size4()?;
        let n = self.group_norm.forward(x)?;
        let seq = n.f_view([b, c, h * w])?.f_transpose(1, 2)?;
        let o = self.attn.forward(&seq, None, train)?;
        let o = o.f_transpose(1, 2)?.f_reshape([b, c, h, w])?;
        Ok(o.f_add(x)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.attn.visit(f)
    }

    pub(crate) fn norm_params(&self) -> i64 {
        self.group_norm.numel()
    }
}

/// diffusers `FeedForward` with `activation_fn="geglu"` (Shazeer, "GLU Variants Improve
/// Transformer", 2020): `net.0.proj` maps `C → 2·4C`, split into `h, gate`;
/// `net.2(h · gelu(gate))` maps back to `C` (exact erf GELU).
///
/// # Shapes
/// `[B, L, C]` → `[B, L, C]`.
#[derive(Debug)]
pub struct FeedForward {
    proj: Site<LoraLinear>,
    out: Site<LoraLinear>,
}

impl FeedForward {
    pub(crate) fn load(vb: &Vb, dim: i64) -> Result<Self> {
        let inner = 4 * dim;
        Ok(Self {
            proj: vb.pp("net.0.proj").linear(dim, 2 * inner, true)?,
            out: vb.pp("net.2").linear(inner, dim, true)?,
        })
    }

    /// Forward pass.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let hg = self.proj.forward_t(x, train)?;
        let parts = hg.f_chunk(2, -1)?;
        let h = parts[0].f_mul(&parts[1].f_gelu("none")?)?;
        Ok(self.out.forward_t(&h, train)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.proj.visit(f)?;
        self.out.visit(f)
    }
}

/// diffusers `BasicTransformerBlock` (layer norms, `norm_type="layer_norm"`):
/// `x += attn1(norm1(x))`; `x += attn2(norm2(x), context)`; `x += ff(norm3(x))`.
///
/// # Shapes
/// `x` `[B, L, C]`, context `[B, Lk, D]` → `[B, L, C]`.
#[derive(Debug)]
pub struct BasicTransformerBlock {
    norm1: LayerNorm,
    attn1: Attention,
    norm2: LayerNorm,
    attn2: Attention,
    norm3: LayerNorm,
    ff: FeedForward,
}

impl BasicTransformerBlock {
    pub(crate) fn load(
        vb: &Vb,
        dim: i64,
        heads: i64,
        head_dim: i64,
        context_dim: i64,
        backend: AttentionBackend,
    ) -> Result<Self> {
        Ok(Self {
            norm1: vb.pp("norm1").layer_norm(dim, 1e-5)?,
            attn1: Attention::load(&vb.pp("attn1"), dim, dim, heads, head_dim, false, backend)?,
            norm2: vb.pp("norm2").layer_norm(dim, 1e-5)?,
            attn2: Attention::load(
                &vb.pp("attn2"),
                dim,
                context_dim,
                heads,
                head_dim,
                false,
                backend,
            )?,
            norm3: vb.pp("norm3").layer_norm(dim, 1e-5)?,
            ff: FeedForward::load(&vb.pp("ff"), dim)?,
        })
    }

    /// Forward pass.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, context: &Tensor, train: bool) -> Result<Tensor> {
        // assignment releases each residual sum once the next exists (without grad: sample
        // images); with grad, the layer norms keep their inputs either way
        let mut h = x.f_add(&self.attn1.forward(&self.norm1.forward(x)?, None, train)?)?;
        h = h.f_add(
            &self
                .attn2
                .forward(&self.norm2.forward(&h)?, Some(context), train)?,
        )?;
        Ok(h.f_add(&self.ff.forward(&self.norm3.forward(&h)?, train)?)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.attn1.visit(f)?;
        self.attn2.visit(f)?;
        self.ff.visit(f)
    }

    pub(crate) fn norm_params(&self) -> i64 {
        self.norm1.numel() + self.norm2.numel() + self.norm3.numel()
    }
}

/// `proj_in` / `proj_out` of a [`Transformer2DModel`]: a 1×1 convolution (SD 1.x) or a linear
/// layer (`use_linear_projection`, SD 2.x / SDXL).
#[derive(Debug)]
enum Proj {
    Conv(Site<LoraConv2d>),
    Linear(Site<LoraLinear>),
}

impl Proj {
    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        match self {
            Proj::Conv(c) => c.visit(f),
            Proj::Linear(l) => l.visit(f),
        }
    }
}

/// diffusers `Transformer2DModel` (continuous input; the "SpatialTransformer" of the original
/// latent-diffusion code):
///
/// ```text
/// h = norm(x)                                   GroupNorm(groups, C, eps = 1e-6)
/// h = proj_in(h) → [B, H·W, inner]              (conv 1×1 before, or linear after, the reshape)
/// h = transformer_blocks[0..n](h, context)
/// out = proj_out(h) → [B, C, H, W] + x
/// ```
///
/// # Shapes
/// `x` `[B, C, H, W]`, context `[B, Lk, D]` → `[B, C, H, W]`; `inner = heads · head_dim`.
#[derive(Debug)]
pub struct Transformer2DModel {
    norm: GroupNorm,
    proj_in: Proj,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Proj,
}

impl Transformer2DModel {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn load(
        vb: &Vb,
        c: i64,
        heads: i64,
        head_dim: i64,
        layers: i64,
        context_dim: i64,
        groups: i64,
        linear_projection: bool,
        backend: AttentionBackend,
    ) -> Result<Self> {
        let inner = heads * head_dim;
        let (proj_in, proj_out) = if linear_projection {
            (
                Proj::Linear(vb.pp("proj_in").linear(c, inner, true)?),
                Proj::Linear(vb.pp("proj_out").linear(inner, c, true)?),
            )
        } else {
            (
                Proj::Conv(vb.pp("proj_in").conv(c, inner, 1, 1, 0)?),
                Proj::Conv(vb.pp("proj_out").conv(inner, c, 1, 1, 0)?),
            )
        };
        let blocks = (0..layers)
            .map(|i| {
                BasicTransformerBlock::load(
                    &vb.pp(format!("transformer_blocks.{i}")),
                    inner,
                    heads,
                    head_dim,
                    context_dim,
                    backend,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            norm: vb.pp("norm").group_norm(groups, c, 1e-6)?,
            proj_in,
            blocks,
            proj_out,
        })
    }

    /// Forward pass.
    ///
    /// # Errors
    /// [`Error::Torch`] on a shape mismatch.
    pub fn forward(&self, x: &Tensor, context: &Tensor, train: bool) -> Result<Tensor> {
        let (b, c, h, w) = x.size4()?;
        // the norm's output is released before the blocks run
        let mut t = {
            let n = self.norm.forward(x)?;
            match &self.proj_in {
                Proj::Conv(conv) => {
                    let p = conv.forward_t(&n, train)?;
                    let inner = p.size()[1];
                    p.f_permute([0, 2, 3, 1])?.f_reshape([b, h * w, inner])?
                }
                Proj::Linear(lin) => {
                    let s = n.f_permute([0, 2, 3, 1])?.f_reshape([b, h * w, c])?;
                    lin.forward_t(&s, train)?
                }
            }
        };
        for blk in &self.blocks {
            t = blk.forward(&t, context, train)?;
        }
        let inner = t.size()[2];
        let out = match &self.proj_out {
            Proj::Conv(conv) => {
                let s = t
                    .f_reshape([b, h, w, inner])?
                    .f_permute([0, 3, 1, 2])?
                    .f_contiguous()?;
                conv.forward_t(&s, train)?
            }
            Proj::Linear(lin) => {
                let p = lin.forward_t(&t, train)?;
                p.f_reshape([b, h, w, c])?
                    .f_permute([0, 3, 1, 2])?
                    .f_contiguous()?
            }
        };
        Ok(out.f_add(x)?)
    }

    pub(crate) fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.proj_in.visit(f)?;
        for b in &mut self.blocks {
            b.visit(f)?;
        }
        self.proj_out.visit(f)
    }

    pub(crate) fn norm_params(&self) -> i64 {
        self.norm.numel()
            + self
                .blocks
                .iter()
                .map(BasicTransformerBlock::norm_params)
                .sum::<i64>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestep_embedding_matches_the_formula() {
        // dim 4, half 2, shift 0: freqs [1, exp(-ln(1e4)/2) = 0.01]
        let t = Tensor::from_slice(&[0.0f32, 10.0]);
        let e = timestep_embedding(&t, 4, false, 0.0).unwrap();
        let v = Vec::<f32>::try_from(e.view([-1])).unwrap();
        let want = [
            0.0,
            0.0,
            1.0,
            1.0,
            10f32.sin(),
            0.1f32.sin(),
            10f32.cos(),
            0.1f32.cos(),
        ];
        for (a, b) in v.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{v:?}");
        }
        let f = timestep_embedding(&t, 4, true, 0.0).unwrap();
        let v = Vec::<f32>::try_from(f.view([-1])).unwrap();
        assert!((v[4] - 10f32.cos()).abs() < 1e-6 && (v[6] - 10f32.sin()).abs() < 1e-6);
        assert_eq!(timestep_embedding(&t, 5, true, 1.0).unwrap().size(), [2, 5]);
    }

    #[test]
    fn sdpa_and_math_attention_agree() {
        let _lock = crate::test_rng_lock();
        tch::manual_seed(0);
        let q = Tensor::randn([2, 5, 8], (Kind::Float, tch::Device::Cpu));
        let k = Tensor::randn([2, 3, 8], (Kind::Float, tch::Device::Cpu));
        let v = Tensor::randn([2, 3, 8], (Kind::Float, tch::Device::Cpu));
        let a = multi_head_attention(&q, &k, &v, 2, AttentionBackend::Sdpa).unwrap();
        let b = multi_head_attention(&q, &k, &v, 2, AttentionBackend::Math).unwrap();
        assert_eq!(a.size(), [2, 5, 8]);
        let d = f64::try_from((a - b).abs().max()).unwrap();
        assert!(d < 1e-5, "{d}");
    }
}
