//! `UNet2DConditionModel`: the denoiser of Stable Diffusion 1.x / 2.x and SDXL, as diffusers
//! builds it (`diffusers/models/unets/unet_2d_condition.py`, `unet_2d_blocks.py`, 0.42.1), from
//! Rombach et al., "High-Resolution Image Synthesis with Latent Diffusion Models" (CVPR 2022)
//! and Podell et al., "SDXL" (2023).
//!
//! # Layout
//! ```text
//! t ─ sinusoidal(block_out_channels[0]) ─ time_embedding ─┐ (+ add_embedding(text_embeds ‖ sinusoidal(time_ids)) for SDXL)
//! x ─ conv_in ─ down_blocks[i] ─ mid_block ─ up_blocks[i] (skip concatenations) ─ GroupNorm ─ SiLU ─ conv_out
//! ```
//! Down level `i` has `layers_per_block` ResNets (each followed by a `Transformer2DModel` in a
//! `CrossAttnDownBlock2D`) and a stride-2 down-sampler except on the last level; up level `i`
//! (channels reversed) has `layers_per_block + 1` ResNets whose inputs are concatenated with the
//! stored skip activations, and a ×2 up-sampler except on the last level.
//!
//! # The `attention_head_dim` naming
//! In `UNet2DConditionModel`'s config, `attention_head_dim` is, despite its name, the number of
//! attention **heads** per level (diffusers keeps the name for backward compatibility and sets
//! `num_attention_heads = num_attention_heads or attention_head_dim`); each head's width is
//! `block_out_channels[i] / heads`. SD 1.5: `attention_head_dim: 8` → 8 heads of width 40, 80,
//! 160, 160. SD 2.x: `[5, 10, 20, 20]` → heads of width 64. SDXL: `[5, 10, 20]` → width 64. A
//! config with a non-null `num_attention_heads` is refused, as diffusers refuses it.
//!
//! # Activation shapes (SD 1.5 at 512×512: latents 64×64)
//! `sample` `[B, 4, 64, 64]` → level outputs `[B, 320, 64, 64]`, `[B, 640, 32, 32]`,
//! `[B, 1280, 16, 16]`, `[B, 1280, 8, 8]`; transformer tokens `[B, H·W, C]` (4096 × 320 at the
//! first level); self-attention scores `[B, heads, H·W, H·W]` when the math path is used;
//! `encoder_hidden_states` `[B, 77, 768]` (SDXL `[B, 77, 2048]`).

use crate::weights::Site;
use std::path::Path;

use lora_core::conv::LoraConv2d;
use lora_core::inject::Adaptable;
use tch::{Kind, Tensor};

use super::blocks::{
    Downsample2D, GroupNorm, NormLayers, ResnetBlock2D, TimestepEmbedding, Transformer2DModel,
    Upsample2D, Vb, Visitor, timestep_embedding,
};
use super::load::{LoadOptions, UnetLayout, component_dir, diffusers_weight_files, ldm_unet_key};
use crate::error::{Error, Result};
use crate::weights::{SafetensorsFiles, TensorSource};

pub use super::config::{FlagPerLevel, PerLevel, UNetConfig, UNetPlan};

/// A down level: `CrossAttnDownBlock2D` (ResNets + transformers) or `DownBlock2D`.
#[derive(Debug)]
struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    downsampler: Option<Downsample2D>,
}

/// An up level: `CrossAttnUpBlock2D` or `UpBlock2D`.
#[derive(Debug)]
struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
    upsampler: Option<Upsample2D>,
}

/// `UNetMidBlock2DCrossAttn`: ResNet, transformer, ResNet.
#[derive(Debug)]
struct MidBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2DModel>,
}

/// SDXL's `text_time` added conditioning: `add_embedding(text_embeds ‖ sinusoidal(time_ids))`.
#[derive(Debug)]
struct TextTime {
    time_dim: i64,
    add_embedding: TimestepEmbedding,
}

/// The Stable Diffusion denoiser (see the module docs for the layout and shapes).
///
/// Weights are frozen plain tensors (no grad) in the load dtype; every linear and convolution is
/// a LoRA site named as diffusers names the module ([`Adaptable`]).
#[derive(Debug)]
pub struct UNet2DConditionModel {
    config: UNetConfig,
    plan: UNetPlan,
    kind: Kind,
    conv_in: Site<LoraConv2d>,
    time_embedding: TimestepEmbedding,
    text_time: Option<TextTime>,
    down_blocks: Vec<DownBlock>,
    mid_block: MidBlock,
    up_blocks: Vec<UpBlock>,
    conv_norm_out: GroupNorm,
    conv_out: Site<LoraConv2d>,
    param_count: i64,
    gradient_checkpointing: bool,
}

/// One recomputable step of the checkpointed forward pass.
#[derive(Debug, Clone, Copy)]
enum Unit {
    ConvIn,
    /// Down level `b`, ResNet (+ transformer) `j`.
    Down(usize, usize),
    Downsample(usize),
    Mid,
    /// Up level `b`, ResNet (+ transformer) `j`; consumes a skip.
    Up(usize, usize),
    Upsample(usize),
    Out,
}

impl Unit {
    fn uses_emb(self) -> bool {
        matches!(self, Unit::Down(..) | Unit::Mid | Unit::Up(..))
    }
}

impl UNet2DConditionModel {
    /// Builds the model from `config`, reading every weight (diffusers names) from `src` in
    /// `opts.kind`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] / [`Error::InvalidArgument`] for the config (see
    /// [`UNetConfig::plan`]); [`Error::MissingTensor`] / [`Error::Shape`] when the weights do not
    /// match it.
    pub fn new(config: UNetConfig, src: &dyn TensorSource, opts: &LoadOptions) -> Result<Self> {
        let plan = config.plan()?;
        let vb = Vb::new(src, "", opts.kind);
        let backend = opts.attention;
        let n = plan.channels.len();
        let ch = &plan.channels;
        let (g, eps, temb) = (plan.groups, config.norm_eps, Some(plan.time_embed_dim));
        let l = plan.layers[0];
        let transformer = |vb: &Vb, c: i64, level: usize| {
            Transformer2DModel::load(
                vb,
                c,
                plan.heads[level],
                c / plan.heads[level],
                plan.transformer_layers[level],
                plan.cross_attention_dim[level],
                g,
                config.use_linear_projection,
                backend,
            )
        };
        let conv_in = vb.pp("conv_in").conv(config.in_channels, ch[0], 3, 1, 1)?;
        let time_embedding =
            TimestepEmbedding::load(&vb.pp("time_embedding"), ch[0], plan.time_embed_dim)?;
        let text_time = match plan.text_time {
            Some((time_dim, proj_in)) => Some(TextTime {
                time_dim,
                add_embedding: TimestepEmbedding::load(
                    &vb.pp("add_embedding"),
                    proj_in,
                    plan.time_embed_dim,
                )?,
            }),
            None => None,
        };
        let mut down_blocks = Vec::with_capacity(n);
        let mut c_prev = ch[0];
        for (i, &c) in ch.iter().enumerate() {
            let b = vb.pp(format!("down_blocks.{i}"));
            let mut resnets = Vec::new();
            let mut attentions = Vec::new();
            for j in 0..l {
                let c_in = if j == 0 { c_prev } else { c };
                resnets.push(ResnetBlock2D::load(
                    &b.pp(format!("resnets.{j}")),
                    c_in,
                    c,
                    temb,
                    g,
                    eps,
                    1.0,
                )?);
                if plan.down_attn[i] {
                    attentions.push(transformer(&b.pp(format!("attentions.{j}")), c, i)?);
                }
            }
            let downsampler = if i + 1 < n {
                Some(Downsample2D::load_conv(
                    &b.pp("downsamplers.0"),
                    c,
                    c,
                    config.downsample_padding,
                )?)
            } else {
                None
            };
            down_blocks.push(DownBlock {
                resnets,
                attentions,
                downsampler,
            });
            c_prev = c;
        }
        let c_mid = ch[n - 1];
        let mb = vb.pp("mid_block");
        let msf = config.mid_block_scale_factor;
        let mid_block = MidBlock {
            resnets: vec![
                ResnetBlock2D::load(&mb.pp("resnets.0"), c_mid, c_mid, temb, g, eps, msf)?,
                ResnetBlock2D::load(&mb.pp("resnets.1"), c_mid, c_mid, temb, g, eps, msf)?,
            ],
            attentions: vec![transformer(&mb.pp("attentions.0"), c_mid, n - 1)?],
        };
        let mut up_blocks = Vec::with_capacity(n);
        let rev: Vec<i64> = ch.iter().rev().copied().collect();
        let mut c_out = rev[0];
        for i in 0..n {
            let level = n - 1 - i;
            let b = vb.pp(format!("up_blocks.{i}"));
            let prev = c_out;
            c_out = rev[i];
            let c_skip_in = rev[(i + 1).min(n - 1)];
            let mut resnets = Vec::new();
            let mut attentions = Vec::new();
            for j in 0..=l {
                let skip = if j == l { c_skip_in } else { c_out };
                let c_in = if j == 0 { prev } else { c_out };
                resnets.push(ResnetBlock2D::load(
                    &b.pp(format!("resnets.{j}")),
                    c_in + skip,
                    c_out,
                    temb,
                    g,
                    eps,
                    1.0,
                )?);
                if plan.up_attn[i] {
                    attentions.push(transformer(&b.pp(format!("attentions.{j}")), c_out, level)?);
                }
            }
            let upsampler = if i + 1 < n {
                Some(Upsample2D::load(&b.pp("upsamplers.0"), c_out)?)
            } else {
                None
            };
            up_blocks.push(UpBlock {
                resnets,
                attentions,
                upsampler,
            });
        }
        let mut m = Self {
            conv_norm_out: vb.pp("conv_norm_out").group_norm(g, ch[0], eps)?,
            conv_out: vb
                .pp("conv_out")
                .conv(ch[0], config.out_channels, 3, 1, 1)?,
            config,
            plan,
            kind: opts.kind,
            conv_in,
            time_embedding,
            text_time,
            down_blocks,
            mid_block,
            up_blocks,
            param_count: 0,
            gradient_checkpointing: false,
        };
        m.param_count = m.count_params();
        Ok(m)
    }

    /// Loads a diffusers folder: `dir` is a pipeline root (its `unet/` is used) or the `unet`
    /// folder itself, with `config.json` and `diffusion_pytorch_model[.fp16].safetensors` (or an
    /// index of shards), memory-mapped.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`] for missing or malformed files; see [`Self::new`].
    pub fn from_diffusers(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let dir = component_dir(dir, "unet")?;
        let config = UNetConfig::from_file(&dir.join("config.json"))?;
        let files = diffusers_weight_files(&dir, opts.variant.as_deref())?;
        let src = SafetensorsFiles::open(&files, &dir, opts.device)?;
        Self::new(config, &src, opts)
    }

    /// Loads the UNet of an original single-file checkpoint (`model.diffusion_model.*` keys,
    /// e.g. `v1-5-pruned-emaonly.safetensors`), with `config` describing it (single files carry
    /// no config: use [`UNetConfig::sd15`], [`UNetConfig::sdxl_base`] or the matching diffusers
    /// `unet/config.json`). Keys are translated with [`ldm_unet_key`].
    ///
    /// # Errors
    /// As [`Self::new`]; [`Error::MissingTensor`] names the diffusers key asked for.
    pub fn from_single_file(path: &Path, config: UNetConfig, opts: &LoadOptions) -> Result<Self> {
        let plan = config.plan()?;
        let layout = UnetLayout {
            layers_per_block: plan.layers[0] as usize,
            down_attn: plan.down_attn.clone(),
            up_attn: plan.up_attn.clone(),
        };
        let src = SafetensorsFiles::open(&[path.to_path_buf()], path, opts.device)?
            .with_key_map(move |name| ldm_unet_key(name, &layout));
        Self::new(config, &src, opts)
    }

    /// The configuration.
    pub fn config(&self) -> &UNetConfig {
        &self.config
    }

    /// The derived per-level plan.
    pub fn plan(&self) -> &UNetPlan {
        &self.plan
    }

    /// The dtype weights are held and computed in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Predicts the noise (or `v`, or whatever the checkpoint was trained for) for `sample` at
    /// `timesteps` conditioned on `encoder_hidden_states`; inference (no LoRA dropout).
    ///
    /// # Shapes
    /// - `sample` `[B, in_channels, H, W]` latents (cast to the model dtype);
    /// - `timesteps` `[B]` (or `[1]`/0-d, broadcast to `B`), integer or float;
    /// - `encoder_hidden_states` `[B, L, cross_attention_dim]` (SD 1.x `[B, 77, 768]`);
    /// - `added_cond` (SDXL `text_time` only): `text_embeds` `[B, P]` pooled text embedding
    ///   (SDXL 1280) and `time_ids` `[B, 6]` (original size, crop top-left, target size);
    /// - returns `[B, out_channels, H, W]` in the model dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for mis-shaped inputs or a missing / superfluous `added_cond`;
    /// [`Error::Torch`] from libtorch.
    pub fn forward(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        encoder_hidden_states: &Tensor,
        added_cond: Option<(&Tensor, &Tensor)>,
    ) -> Result<Tensor> {
        self.forward_t(sample, timesteps, encoder_hidden_states, added_cond, false)
    }

    /// [`Self::forward`] with `train` switching LoRA dropout on.
    ///
    /// # Errors
    /// As [`Self::forward`].
    pub fn forward_t(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        encoder_hidden_states: &Tensor,
        added_cond: Option<(&Tensor, &Tensor)>,
        train: bool,
    ) -> Result<Tensor> {
        let (x, ctx, emb) =
            self.prepare(sample, timesteps, encoder_hidden_states, added_cond, train)?;
        self.walk(&x, &emb, &ctx, train, |_, _, _, _| Ok(()))
    }

    /// Checks the inputs, casts them to the model dtype and computes the time (+ added)
    /// embedding `[B, time_embed_dim]`.
    fn prepare(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        encoder_hidden_states: &Tensor,
        added_cond: Option<(&Tensor, &Tensor)>,
        train: bool,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        if sample.dim() != 4 || sample.size()[1] != self.config.in_channels {
            return Err(Error::InvalidArgument(format!(
                "UNet sample must be [batch, {}, height, width], got {:?}",
                self.config.in_channels,
                sample.size()
            )));
        }
        let b = sample.size()[0];
        if encoder_hidden_states.dim() != 3 || encoder_hidden_states.size()[0] != b {
            return Err(Error::InvalidArgument(format!(
                "encoder_hidden_states must be [batch = {b}, seq, dim], got {:?}",
                encoder_hidden_states.size()
            )));
        }
        let x = sample.f_to_kind(self.kind)?;
        let ctx = encoder_hidden_states.f_to_kind(self.kind)?;
        let t = timesteps.f_reshape([-1])?;
        let t = if t.size()[0] == b {
            t
        } else if t.size()[0] == 1 {
            t.f_expand([b], false)?
        } else {
            return Err(Error::InvalidArgument(format!(
                "timesteps must be [batch = {b}] or a single value, got {:?}",
                timesteps.size()
            )));
        };
        // time embedding
        let t_emb = timestep_embedding(
            &t,
            self.plan.channels[0],
            self.config.flip_sin_to_cos,
            self.config.freq_shift,
        )?
        .f_to_kind(self.kind)?;
        let mut emb = self.time_embedding.forward(&t_emb, train)?;
        match (&self.text_time, added_cond) {
            (Some(tt), Some((text_embeds, time_ids))) => {
                if time_ids.dim() != 2
                    || time_ids.size()[0] != b
                    || text_embeds.dim() != 2
                    || text_embeds.size()[0] != b
                {
                    return Err(Error::InvalidArgument(format!(
                        "added_cond must be (text_embeds [batch = {b}, P], time_ids [batch, 6]), got {:?} and {:?}",
                        text_embeds.size(),
                        time_ids.size()
                    )));
                }
                let te = timestep_embedding(
                    &time_ids.f_flatten(0, -1)?,
                    tt.time_dim,
                    self.config.flip_sin_to_cos,
                    self.config.freq_shift,
                )?
                .f_reshape([b, -1])?;
                let add = Tensor::f_cat(&[text_embeds.f_to_kind(Kind::Float)?, te], -1)?
                    .f_to_kind(self.kind)?;
                emb = emb.f_add(&tt.add_embedding.forward(&add, train)?)?;
            }
            (None, None) => {}
            (Some(_), None) => {
                return Err(Error::InvalidArgument(
                    "this UNet has `addition_embed_type: text_time` (SDXL): pass added_cond = (text_embeds, time_ids)"
                        .into(),
                ));
            }
            (None, Some(_)) => {
                return Err(Error::InvalidArgument(
                    "added_cond was given but the UNet config has no `addition_embed_type`".into(),
                ));
            }
        }
        Ok((x, ctx, emb))
    }

    /// Turns per-block activation checkpointing on or off for [`Self::loss_backward`].
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.gradient_checkpointing = on;
    }

    /// Whether [`Self::loss_backward`] checkpoints activations.
    pub fn gradient_checkpointing(&self) -> bool {
        self.gradient_checkpointing
    }

    /// The recomputable steps of a forward pass, in order.
    fn units(&self) -> Vec<Unit> {
        let mut u = vec![Unit::ConvIn];
        for (b, blk) in self.down_blocks.iter().enumerate() {
            u.extend((0..blk.resnets.len()).map(|j| Unit::Down(b, j)));
            if blk.downsampler.is_some() {
                u.push(Unit::Downsample(b));
            }
        }
        u.push(Unit::Mid);
        for (b, blk) in self.up_blocks.iter().enumerate() {
            u.extend((0..blk.resnets.len()).map(|j| Unit::Up(b, j)));
            if blk.upsampler.is_some() {
                u.push(Unit::Upsample(b));
            }
        }
        u.push(Unit::Out);
        u
    }

    #[allow(clippy::too_many_arguments)]
    fn run_unit(
        &self,
        u: Unit,
        h: &Tensor,
        skip: Option<&Tensor>,
        size: Option<[i64; 2]>,
        emb: &Tensor,
        ctx: &Tensor,
        train: bool,
    ) -> Result<Tensor> {
        let pair =
            |r: &ResnetBlock2D, a: Option<&Transformer2DModel>, h: &Tensor| -> Result<Tensor> {
                let h = r.forward(h, Some(emb), train)?;
                match a {
                    Some(a) => a.forward(&h, ctx, train),
                    None => Ok(h),
                }
            };
        match u {
            Unit::ConvIn => Ok(self.conv_in.forward_t(h, train)?),
            Unit::Down(b, j) => {
                let blk = &self.down_blocks[b];
                pair(&blk.resnets[j], blk.attentions.get(j), h)
            }
            Unit::Downsample(b) => match &self.down_blocks[b].downsampler {
                Some(d) => d.forward(h, train),
                None => Ok(h.shallow_clone()),
            },
            Unit::Mid => {
                let m = &self.mid_block;
                let h = pair(&m.resnets[0], m.attentions.first(), h)?;
                m.resnets[1].forward(&h, Some(emb), train)
            }
            Unit::Up(b, j) => {
                let s =
                    skip.ok_or_else(|| Error::InvalidArgument("UNet skip stack exhausted".into()))?;
                let blk = &self.up_blocks[b];
                pair(
                    &blk.resnets[j],
                    blk.attentions.get(j),
                    &Tensor::f_cat(&[h, s], 1)?,
                )
            }
            Unit::Upsample(b) => match &self.up_blocks[b].upsampler {
                Some(up) => up.forward(h, size, train),
                None => Ok(h.shallow_clone()),
            },
            Unit::Out => {
                let h = self.conv_norm_out.forward(h)?.f_silu()?;
                Ok(self.conv_out.forward_t(&h, train)?)
            }
        }
    }

    /// Runs every unit from the `conv_in` input `x`; `record(k, input, skip_unit, size)` is
    /// called before unit `k` with its input, the index of the unit whose output it takes as
    /// skip (up units), and the up-sampling size (up-samplers: the size of the next skip, which
    /// is ×2 unless the latent size is not a multiple of the total down-sampling).
    fn walk(
        &self,
        x: &Tensor,
        emb: &Tensor,
        ctx: &Tensor,
        train: bool,
        mut record: impl FnMut(usize, &Tensor, Option<usize>, Option<[i64; 2]>) -> Result<()>,
    ) -> Result<Tensor> {
        let mut h = x.shallow_clone();
        let mut skips: Vec<(usize, Tensor)> = Vec::new();
        for (k, u) in self.units().into_iter().enumerate() {
            let (skip, size) = match u {
                Unit::Up(..) => {
                    let s = skips.pop().ok_or_else(|| {
                        Error::InvalidArgument("UNet skip stack exhausted".into())
                    })?;
                    (Some(s), None)
                }
                Unit::Upsample(_) => (
                    None,
                    skips.last().map(|(_, s)| {
                        let z = s.size();
                        [z[2], z[3]]
                    }),
                ),
                _ => (None, None),
            };
            record(k, &h, skip.as_ref().map(|(i, _)| *i), size)?;
            h = self.run_unit(u, &h, skip.as_ref().map(|(_, s)| s), size, emb, ctx, train)?;
            if matches!(u, Unit::ConvIn | Unit::Down(..) | Unit::Downsample(_)) {
                skips.push((k, h.shallow_clone()));
            }
        }
        Ok(h)
    }

    /// Runs the model, computes `loss = loss_fn(prediction)` and backpropagates
    /// `loss · loss_scale` into every tensor that requires grad (LoRA adapters, and
    /// `encoder_hidden_states` when it requires grad, e.g. a trained text encoder); returns the
    /// unscaled loss, detached. `loss_scale` is `1 / gradient_accumulation_steps` (times an fp16
    /// loss scale).
    ///
    /// With [`Self::set_gradient_checkpointing`] on, the forward pass keeps only each unit's
    /// input (a unit is `conv_in`, one ResNet + transformer pair, a down/up-sampler, the mid
    /// block, or the output head) and no graph; the backward pass recomputes the units from the
    /// last to the first with autograd on (the technique of `torch.utils.checkpoint` and of
    /// diffusers' `enable_gradient_checkpointing`, driven by hand as in
    /// [`crate::checkpoint::SegmentTape`]): each recomputed unit backpropagates `Σ(y ⊙ g)`,
    /// the gradient of its input goes to the previous unit, the gradient of a skip input to the
    /// down unit that produced it, and the gradients of the time embedding and of the context
    /// are summed and backpropagated once at the end. The generator state before each unit is
    /// restored for its recomputation, so LoRA dropout draws the same masks. Gradients equal
    /// those of the plain path (tested); the sample's own gradient is not computed.
    ///
    /// Peak activation memory drops from every unit's internals (attention scores, GEGLU
    /// hidden states, `[B, H·W, 8C]` per transformer block) to the unit inputs
    /// (`[B, C, H, W]` each) plus one unit's internals.
    ///
    /// # Errors
    /// As [`Self::forward_t`]; whatever `loss_fn` returns; [`Error::InvalidArgument`] when the
    /// loss does not depend on the prediction; [`Error::Shim`] when the generator state cannot
    /// be saved or restored.
    #[allow(clippy::too_many_arguments)]
    pub fn loss_backward(
        &self,
        sample: &Tensor,
        timesteps: &Tensor,
        encoder_hidden_states: &Tensor,
        added_cond: Option<(&Tensor, &Tensor)>,
        train: bool,
        loss_scale: f64,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        if !self.gradient_checkpointing {
            let pred =
                self.forward_t(sample, timesteps, encoder_hidden_states, added_cond, train)?;
            let loss = loss_fn(&pred)?;
            loss.f_mul_scalar(loss_scale)?.f_backward()?;
            return Ok(loss.f_detach()?);
        }
        let (x, ctx, emb) =
            self.prepare(sample, timesteps, encoder_hidden_states, added_cond, train)?;
        let (emb_d, ctx_d) = (emb.f_detach()?, ctx.f_detach()?);
        let devices = match x.device() {
            tch::Device::Cpu => vec![tch::Device::Cpu],
            d => vec![tch::Device::Cpu, d],
        };
        let save_rng = || -> Result<Vec<(tch::Device, Vec<u8>)>> {
            devices
                .iter()
                .map(|&d| Ok((d, lora_core::sys::rng_state(d)?)))
                .collect()
        };
        let restore_rng = |states: &[(tch::Device, Vec<u8>)]| -> Result<()> {
            for (d, s) in states {
                lora_core::sys::set_rng_state(*d, s)?;
            }
            Ok(())
        };
        let mut inputs: Vec<Tensor> = Vec::new();
        let mut meta: Vec<(Option<usize>, Option<[i64; 2]>)> = Vec::new();
        let mut rng = Vec::new();
        let out = {
            let _g = tch::no_grad_guard();
            self.walk(&x.f_detach()?, &emb_d, &ctx_d, train, |_, h, s, size| {
                inputs.push(h.shallow_clone());
                meta.push((s, size));
                rng.push(save_rng()?);
                Ok(())
            })?
        };
        let pred = out.f_detach()?.f_set_requires_grad(true)?;
        let loss = loss_fn(&pred)?;
        loss.f_mul_scalar(loss_scale)?.f_backward()?;
        let g_out = pred.f_grad()?;
        if !g_out.defined() {
            return Err(Error::InvalidArgument(
                "checkpointed UNet backward: the loss does not depend on the prediction".into(),
            ));
        }
        let units = self.units();
        let now = save_rng()?;
        let (emb_grad, ctx_grad) = (emb.requires_grad(), ctx.requires_grad());
        let add = |acc: &mut Option<Tensor>, g: Tensor| -> Result<()> {
            *acc = Some(match acc.take() {
                Some(a) => a.f_add(&g)?,
                None => g,
            });
            Ok(())
        };
        let res = tch::with_grad(|| -> Result<()> {
            let mut g = g_out.f_detach()?;
            let mut g_skip: Vec<Option<Tensor>> = (0..units.len()).map(|_| None).collect();
            let (mut g_emb, mut g_ctx): (Option<Tensor>, Option<Tensor>) = (None, None);
            for k in (0..units.len()).rev() {
                let u = units[k];
                if let Some(gs) = g_skip[k].take() {
                    g = g.f_add(&gs)?;
                }
                let xk = inputs[k].f_detach()?.f_set_requires_grad(true)?;
                let (s_idx, size) = meta[k];
                let sk = match s_idx {
                    Some(i) => Some(inputs[i + 1].f_detach()?.f_set_requires_grad(true)?),
                    None => None,
                };
                let leaf = |t: &Tensor, on: bool| -> Result<Tensor> {
                    if on && u.uses_emb() {
                        Ok(t.f_detach()?.f_set_requires_grad(true)?)
                    } else {
                        Ok(t.shallow_clone())
                    }
                };
                let (e, c) = (leaf(&emb_d, emb_grad)?, leaf(&ctx_d, ctx_grad)?);
                restore_rng(&rng[k])?;
                let y = self.run_unit(u, &xk, sk.as_ref(), size, &e, &c, train)?;
                if y.requires_grad() {
                    y.f_mul(&g.f_to_kind(y.kind())?)?
                        .f_sum(Kind::Float)?
                        .f_backward()?;
                }
                let gx = xk.f_grad()?;
                g = if gx.defined() {
                    gx.f_detach()?
                } else {
                    xk.f_zeros_like()?
                };
                if let (Some(i), Some(sk)) = (s_idx, &sk) {
                    let gs = sk.f_grad()?;
                    if gs.defined() {
                        add(&mut g_skip[i], gs.f_detach()?)?;
                    }
                }
                for (leaf, acc) in [(&e, &mut g_emb), (&c, &mut g_ctx)] {
                    if leaf.requires_grad() {
                        let gl = leaf.f_grad()?;
                        if gl.defined() {
                            add(acc, gl.f_detach()?)?;
                        }
                    }
                }
            }
            for (t, acc) in [(&emb, g_emb), (&ctx, g_ctx)] {
                if let Some(gt) = acc
                    && t.requires_grad()
                {
                    t.f_mul(&gt.f_to_kind(t.kind())?)?
                        .f_sum(Kind::Float)?
                        .f_backward()?;
                }
            }
            Ok(())
        });
        restore_rng(&now)?;
        res?;
        Ok(loss.f_detach()?)
    }

    /// Parameters of the model (sites and norms), adapters excluded.
    pub fn num_params(&self) -> i64 {
        self.param_count
    }

    fn count_params(&mut self) -> i64 {
        super::blocks::site_params(self) + self.norm_params()
    }

    fn norm_params(&self) -> i64 {
        let t =
            |v: &[Transformer2DModel]| v.iter().map(Transformer2DModel::norm_params).sum::<i64>();
        let r = |v: &[ResnetBlock2D]| v.iter().map(ResnetBlock2D::norm_params).sum::<i64>();
        let mut n = self.conv_norm_out.numel();
        for b in &self.down_blocks {
            n += t(&b.attentions) + r(&b.resnets);
        }
        for b in &self.up_blocks {
            n += t(&b.attentions) + r(&b.resnets);
        }
        n + t(&self.mid_block.attentions) + r(&self.mid_block.resnets)
    }
}

fn visit_level(
    resnets: &mut [ResnetBlock2D],
    attentions: &mut [Transformer2DModel],
    f: &mut Visitor<'_>,
) -> lora_core::Result<()> {
    for r in resnets {
        r.visit(f)?;
    }
    for a in attentions {
        a.visit(f)?;
    }
    Ok(())
}

impl Adaptable for UNet2DConditionModel {
    /// Sites in diffusers naming: `conv_in`, `time_embedding.linear_{1,2}`,
    /// `add_embedding.linear_{1,2}` (SDXL), `down_blocks.{i}.resnets.{j}.{conv1,time_emb_proj,conv2,conv_shortcut}`,
    /// `down_blocks.{i}.attentions.{j}.{proj_in,proj_out}`,
    /// `….transformer_blocks.{k}.{attn1,attn2}.{to_q,to_k,to_v,to_out.0}`, `….ff.net.0.proj`,
    /// `….ff.net.2`, `down_blocks.{i}.downsamplers.0.conv`, `mid_block.…`, `up_blocks.{i}.…`,
    /// `up_blocks.{i}.upsamplers.0.conv`, `conv_out`.
    fn visit_sites(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.conv_in.visit(f)?;
        self.time_embedding.visit(f)?;
        if let Some(tt) = &mut self.text_time {
            tt.add_embedding.visit(f)?;
        }
        for b in &mut self.down_blocks {
            visit_level(&mut b.resnets, &mut b.attentions, f)?;
            if let Some(d) = &mut b.downsampler {
                d.visit(f)?;
            }
        }
        visit_level(
            &mut self.mid_block.resnets,
            &mut self.mid_block.attentions,
            f,
        )?;
        for b in &mut self.up_blocks {
            visit_level(&mut b.resnets, &mut b.attentions, f)?;
            if let Some(u) = &mut b.upsampler {
                u.visit(f)?;
            }
        }
        self.conv_out.visit(f)
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.param_count)
    }
}
