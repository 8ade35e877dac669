//! `AutoencoderKL`: the Stable Diffusion VAE (Rombach et al. 2022, the KL-regularised
//! autoencoder of `ldm/models/autoencoder.py`), as diffusers builds it
//! (`diffusers/models/autoencoders/autoencoder_kl.py`, `vae.py` `Encoder`/`Decoder`, 0.42.1).
//!
//! ```text
//! encode: image [-1, 1] → conv_in → down_blocks (ResNets, stride-2 conv with right/bottom pad)
//!         → mid (ResNet, attention, ResNet) → GroupNorm → SiLU → conv_out (2·latent) → quant_conv
//!         → mean, logvar (clamped to [−30, 20])
//! decode: latents → post_quant_conv → conv_in → mid → up_blocks (ResNets, nearest ×2 + conv)
//!         → GroupNorm → SiLU → conv_out → image
//! ```
//! Latents for the UNet are `(z − shift_factor) · scaling_factor` (SD 1.x 0.18215 with no shift,
//! SDXL 0.13025); [`AutoencoderKL::scale_latents`] / [`AutoencoderKL::unscale_latents`] apply it.
//!
//! # Activation shapes (SD VAE at 512×512)
//! `[B, 3, 512, 512]` → `[B, 128, 512, 512]` → … → `[B, 512, 64, 64]`; the mid-block attention is
//! one head over `64·64 = 4096` positions of width 512 (score matrix `[B, 1, 4096, 4096]` on the
//! math path); latents `[B, 4, 64, 64]`.

use crate::weights::Site;
use std::path::Path;

use lora_core::conv::LoraConv2d;
use lora_core::inject::Adaptable;
use tch::{Kind, Tensor};

use super::blocks::{
    Downsample2D, GroupNorm, NormLayers, ResnetBlock2D, SpatialAttention, Upsample2D, Vb, Visitor,
    site_params,
};
use super::load::{
    LDM_VAE_PREFIX, LoadOptions, component_dir, diffusers_weight_files, ldm_vae_key,
};
use crate::error::{Error, Result};
use crate::weights::{SafetensorsFiles, TensorSource};

pub use super::config::VaeConfig;

/// A diagonal Gaussian over latents (`DiagonalGaussianDistribution` of diffusers / ldm).
///
/// # Shapes
/// `mean`, `logvar`: `[B, latent_channels, H/f, W/f]` (`f = 2^(levels−1)`, 8 for SD).
#[derive(Debug)]
pub struct DiagonalGaussian {
    /// The mean.
    pub mean: Tensor,
    /// The log-variance, clamped to `[−30, 20]` as diffusers does.
    pub logvar: Tensor,
}

impl DiagonalGaussian {
    /// `mean + exp(logvar / 2) · ε` with `ε ~ N(0, 1)` from libtorch's default generator. With
    /// `seed`, `ε` is what `torch.manual_seed(seed); torch.randn(shape)` draws on the CPU (the
    /// draws of diffusers' `latent_dist.sample(generator=torch.Generator().manual_seed(seed))`),
    /// and the generator state is saved before and restored after, so the caller's random stream
    /// does not move; the generator is process-wide, so other threads drawing at the same time
    /// interleave with it — use [`Self::sample_with_noise`] for thread-independent results.
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch; [`Error::Shim`] when the generator state cannot be saved.
    pub fn sample(&self, seed: Option<i64>) -> Result<Tensor> {
        let shape = self.mean.size();
        let opts = (self.mean.kind(), self.mean.device());
        let eps = match seed {
            None => Tensor::f_randn(shape, opts)?,
            Some(s) => {
                let dev = self.mean.device();
                // `manual_seed` reseeds every device's generator: keep them all
                let devices = if dev == tch::Device::Cpu {
                    vec![dev]
                } else {
                    vec![tch::Device::Cpu, dev]
                };
                let saved = devices
                    .iter()
                    .map(|&d| lora_core::sys::rng_state(d).map(|st| (d, st)))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                tch::manual_seed(s);
                let eps = Tensor::f_randn(shape, (Kind::Float, tch::Device::Cpu))
                    .and_then(|e| e.f_to_kind(opts.0))
                    .and_then(|e| e.f_to_device(dev));
                for (d, st) in &saved {
                    lora_core::sys::set_rng_state(*d, st)?;
                }
                eps?
            }
        };
        self.sample_with_noise(&eps)
    }

    /// `mean + exp(logvar / 2) · noise` for a given standard-normal `noise` of the mean's shape.
    ///
    /// # Errors
    /// [`Error::Torch`] when the shapes differ.
    pub fn sample_with_noise(&self, noise: &Tensor) -> Result<Tensor> {
        let std = self.logvar.f_mul_scalar(0.5)?.f_exp()?;
        Ok(self
            .mean
            .f_add(&std.f_mul(&noise.f_to_kind(self.mean.kind())?)?)?)
    }

    /// The mode (the mean).
    pub fn mode(&self) -> Tensor {
        self.mean.shallow_clone()
    }
}

/// `UNetMidBlock2D` without time embedding: ResNet, attention (optional), ResNet.
#[derive(Debug)]
struct Mid {
    resnets: Vec<ResnetBlock2D>,
    attention: Option<SpatialAttention>,
}

impl Mid {
    fn load(vb: &Vb, c: i64, groups: i64, attn: bool, opts: &LoadOptions) -> Result<Self> {
        Ok(Self {
            resnets: vec![
                ResnetBlock2D::load(&vb.pp("resnets.0"), c, c, None, groups, 1e-6, 1.0)?,
                ResnetBlock2D::load(&vb.pp("resnets.1"), c, c, None, groups, 1e-6, 1.0)?,
            ],
            attention: if attn {
                Some(SpatialAttention::load(
                    &vb.pp("attentions.0"),
                    c,
                    groups,
                    1e-6,
                    opts.attention,
                )?)
            } else {
                None
            },
        })
    }

    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let mut h = self.resnets[0].forward(x, None, train)?;
        if let Some(a) = &self.attention {
            h = a.forward(&h, train)?;
        }
        self.resnets[1].forward(&h, None, train)
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        for r in &mut self.resnets {
            r.visit(f)?;
        }
        if let Some(a) = &mut self.attention {
            a.visit(f)?;
        }
        Ok(())
    }

    fn norm_params(&self) -> i64 {
        self.resnets
            .iter()
            .map(ResnetBlock2D::norm_params)
            .sum::<i64>()
            + self
                .attention
                .as_ref()
                .map_or(0, SpatialAttention::norm_params)
    }
}

#[derive(Debug)]
struct Level {
    resnets: Vec<ResnetBlock2D>,
    down: Option<Downsample2D>,
    up: Option<Upsample2D>,
}

#[derive(Debug)]
struct Coder {
    conv_in: Site<LoraConv2d>,
    levels: Vec<Level>,
    mid: Mid,
    conv_norm_out: GroupNorm,
    conv_out: Site<LoraConv2d>,
}

impl Coder {
    fn encoder(vb: &Vb, cfg: &VaeConfig, opts: &LoadOptions) -> Result<Self> {
        let ch = &cfg.block_out_channels;
        let (g, n) = (cfg.norm_num_groups, ch.len());
        let mut levels = Vec::new();
        let mut c_prev = ch[0];
        for (i, &c) in ch.iter().enumerate() {
            let b = vb.pp(format!("down_blocks.{i}"));
            let resnets = (0..cfg.layers_per_block)
                .map(|j| {
                    ResnetBlock2D::load(
                        &b.pp(format!("resnets.{j}")),
                        if j == 0 { c_prev } else { c },
                        c,
                        None,
                        g,
                        1e-6,
                        1.0,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let down = if i + 1 < n {
                Some(Downsample2D::load_conv(&b.pp("downsamplers.0"), c, c, 0)?)
            } else {
                None
            };
            levels.push(Level {
                resnets,
                down,
                up: None,
            });
            c_prev = c;
        }
        let c = ch[n - 1];
        Ok(Self {
            conv_in: vb.pp("conv_in").conv(cfg.in_channels, ch[0], 3, 1, 1)?,
            levels,
            mid: Mid::load(&vb.pp("mid_block"), c, g, cfg.mid_block_add_attention, opts)?,
            conv_norm_out: vb.pp("conv_norm_out").group_norm(g, c, 1e-6)?,
            conv_out: vb
                .pp("conv_out")
                .conv(c, 2 * cfg.latent_channels, 3, 1, 1)?,
        })
    }

    fn decoder(vb: &Vb, cfg: &VaeConfig, opts: &LoadOptions) -> Result<Self> {
        let rev: Vec<i64> = cfg.block_out_channels.iter().rev().copied().collect();
        let (g, n) = (cfg.norm_num_groups, rev.len());
        let mut levels = Vec::new();
        let mut c_out = rev[0];
        for (i, &c) in rev.iter().enumerate() {
            let b = vb.pp(format!("up_blocks.{i}"));
            let prev = c_out;
            c_out = c;
            let resnets = (0..=cfg.layers_per_block)
                .map(|j| {
                    ResnetBlock2D::load(
                        &b.pp(format!("resnets.{j}")),
                        if j == 0 { prev } else { c_out },
                        c_out,
                        None,
                        g,
                        1e-6,
                        1.0,
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            let up = if i + 1 < n {
                Some(Upsample2D::load(&b.pp("upsamplers.0"), c_out)?)
            } else {
                None
            };
            levels.push(Level {
                resnets,
                down: None,
                up,
            });
        }
        Ok(Self {
            conv_in: vb
                .pp("conv_in")
                .conv(cfg.latent_channels, rev[0], 3, 1, 1)?,
            levels,
            mid: Mid::load(
                &vb.pp("mid_block"),
                rev[0],
                g,
                cfg.mid_block_add_attention,
                opts,
            )?,
            conv_norm_out: vb.pp("conv_norm_out").group_norm(g, rev[n - 1], 1e-6)?,
            conv_out: vb
                .pp("conv_out")
                .conv(rev[n - 1], cfg.out_channels, 3, 1, 1)?,
        })
    }

    fn forward(&self, x: &Tensor, encoder: bool, train: bool) -> Result<Tensor> {
        let mut h = self.conv_in.forward_t(x, train)?;
        if !encoder {
            h = self.mid.forward(&h, train)?;
        }
        for lv in &self.levels {
            for r in &lv.resnets {
                h = r.forward(&h, None, train)?;
            }
            if let Some(d) = &lv.down {
                h = d.forward(&h, train)?;
            }
            if let Some(u) = &lv.up {
                h = u.forward(&h, None, train)?;
            }
        }
        if encoder {
            h = self.mid.forward(&h, train)?;
        }
        let h = self.conv_norm_out.forward(&h)?.f_silu()?;
        Ok(self.conv_out.forward_t(&h, train)?)
    }

    /// Visits the sites in diffusers' module order (the encoder's mid-block after its levels,
    /// the decoder's before).
    fn visit(&mut self, encoder: bool, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.conv_in.visit(f)?;
        if !encoder {
            self.mid.visit(f)?;
        }
        for lv in &mut self.levels {
            for r in &mut lv.resnets {
                r.visit(f)?;
            }
            if let Some(d) = &mut lv.down {
                d.visit(f)?;
            }
            if let Some(u) = &mut lv.up {
                u.visit(f)?;
            }
        }
        if encoder {
            self.mid.visit(f)?;
        }
        self.conv_out.visit(f)
    }

    fn norm_params(&self) -> i64 {
        self.conv_norm_out.numel()
            + self.mid.norm_params()
            + self
                .levels
                .iter()
                .flat_map(|l| &l.resnets)
                .map(ResnetBlock2D::norm_params)
                .sum::<i64>()
    }
}

/// The Stable Diffusion VAE. Every convolution (and the mid-block attention projections) is a
/// LoRA site in diffusers naming (`encoder.down_blocks.0.resnets.0.conv1`,
/// `decoder.mid_block.attentions.0.to_q`, `quant_conv`, …).
#[derive(Debug)]
pub struct AutoencoderKL {
    config: VaeConfig,
    kind: Kind,
    encoder: Coder,
    decoder: Coder,
    quant_conv: Option<Site<LoraConv2d>>,
    post_quant_conv: Option<Site<LoraConv2d>>,
    param_count: i64,
}

impl AutoencoderKL {
    /// Builds the VAE from `config`, reading weights (diffusers names) from `src`.
    ///
    /// # Errors
    /// [`Error::Unsupported`] for config values not implemented; [`Error::MissingTensor`] /
    /// [`Error::Shape`] when the weights do not match.
    pub fn new(config: VaeConfig, src: &dyn TensorSource, opts: &LoadOptions) -> Result<Self> {
        config.validate()?;
        let vb = Vb::new(src, "", opts.kind);
        let l2 = 2 * config.latent_channels;
        let l = config.latent_channels;
        let mut m = Self {
            encoder: Coder::encoder(&vb.pp("encoder"), &config, opts)?,
            decoder: Coder::decoder(&vb.pp("decoder"), &config, opts)?,
            quant_conv: if config.use_quant_conv {
                Some(vb.pp("quant_conv").conv(l2, l2, 1, 1, 0)?)
            } else {
                None
            },
            post_quant_conv: if config.use_post_quant_conv {
                Some(vb.pp("post_quant_conv").conv(l, l, 1, 1, 0)?)
            } else {
                None
            },
            kind: opts.kind,
            config,
            param_count: 0,
        };
        m.param_count = site_params(&mut m) + m.encoder.norm_params() + m.decoder.norm_params();
        Ok(m)
    }

    /// Loads a diffusers folder (a pipeline root with `vae/`, or the `vae` folder itself).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`] for missing or malformed files; see [`Self::new`].
    pub fn from_diffusers(dir: &Path, opts: &LoadOptions) -> Result<Self> {
        let dir = component_dir(dir, "vae")?;
        let config = VaeConfig::from_file(&dir.join("config.json"))?;
        let files = diffusers_weight_files(&dir, opts.variant.as_deref())?;
        let src = SafetensorsFiles::open(&files, &dir, opts.device)?;
        Self::new(config, &src, opts)
    }

    /// Loads the VAE of an original single-file checkpoint, keys translated with
    /// [`ldm_vae_key`]: the VAE inside an SD checkpoint (`first_stage_model.encoder.down.0…`),
    /// or a file holding only the VAE under the same names without that prefix
    /// (`encoder.down.0.block.0.norm1.weight`, `decoder.up.3…`: BFL's FLUX.1 `ae.safetensors`,
    /// the standalone SD VAE files). The prefix is used when any stored key carries it. `config`
    /// is e.g. [`VaeConfig::sd15`] or [`VaeConfig::flux`] (no `quant_conv`).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn from_single_file(path: &Path, config: VaeConfig, opts: &LoadOptions) -> Result<Self> {
        let n_up = config.block_out_channels.len();
        let files = SafetensorsFiles::open(&[path.to_path_buf()], path, opts.device)?;
        let prefixed = files.names().any(|n| n.starts_with(LDM_VAE_PREFIX));
        let src = files.with_key_map(move |name| {
            let key = ldm_vae_key(name, n_up)?;
            if prefixed {
                Some(key)
            } else {
                key.strip_prefix(LDM_VAE_PREFIX).map(str::to_string)
            }
        });
        Self::new(config, &src, opts)
    }

    /// Loads BFL's FLUX.1 autoencoder file `ae.safetensors` ([`VaeConfig::flux`]: 16 latent
    /// channels, no quant convs, `scaling_factor` 0.3611, `shift_factor` 0.1159): as
    /// [`Self::from_single_file`].
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn from_flux_ae(path: &Path, opts: &LoadOptions) -> Result<Self> {
        Self::from_single_file(path, VaeConfig::flux(), opts)
    }

    /// The configuration.
    pub fn config(&self) -> &VaeConfig {
        &self.config
    }

    /// Parameters (weights, biases, norms).
    pub fn num_params(&self) -> i64 {
        self.param_count
    }

    /// The latent distribution of `images`.
    ///
    /// # Shapes
    /// `images` `[B, in_channels, H, W]` in `[-1, 1]` → mean/logvar `[B, latent, H/f, W/f]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong channel count; [`Error::Torch`] from libtorch.
    pub fn encode(&self, images: &Tensor) -> Result<DiagonalGaussian> {
        if images.dim() != 4 || images.size()[1] != self.config.in_channels {
            return Err(Error::InvalidArgument(format!(
                "VAE encode expects [batch, {}, height, width] images, got {:?}",
                self.config.in_channels,
                images.size()
            )));
        }
        let x = images.f_to_kind(self.kind)?;
        let mut h = self.encoder.forward(&x, true, false)?;
        if let Some(q) = &self.quant_conv {
            h = q.forward_t(&h, false)?;
        }
        let parts = h.f_chunk(2, 1)?;
        Ok(DiagonalGaussian {
            mean: parts[0].shallow_clone(),
            logvar: parts[1].f_clamp(-30.0, 20.0)?,
        })
    }

    /// Decodes `latents` (unscaled: divide UNet latents by the scaling factor first, see
    /// [`Self::unscale_latents`]) into images (≈ `[-1, 1]`, not clamped).
    ///
    /// # Shapes
    /// `[B, latent, h, w]` → `[B, out_channels, h·f, w·f]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong channel count; [`Error::Torch`] from libtorch.
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        if latents.dim() != 4 || latents.size()[1] != self.config.latent_channels {
            return Err(Error::InvalidArgument(format!(
                "VAE decode expects [batch, {}, h, w] latents, got {:?}",
                self.config.latent_channels,
                latents.size()
            )));
        }
        let mut z = latents.f_to_kind(self.kind)?;
        if let Some(q) = &self.post_quant_conv {
            z = q.forward_t(&z, false)?;
        }
        self.decoder.forward(&z, false, false)
    }

    /// [`Self::decode`] one image at a time (what diffusers' `enable_vae_slicing` does): the
    /// same images, with the decoder's activations held for one image instead of the whole
    /// batch. The decoder's last blocks work at full resolution (128 channels over every pixel
    /// of an SD VAE: 0.5 GB per f32 tensor for one 1024² image), so a sample grid of several
    /// prompts decoded at once peaks at several times a single image's bytes.
    ///
    /// # Shapes
    /// As [`Self::decode`].
    ///
    /// # Errors
    /// As [`Self::decode`].
    pub fn decode_each(&self, latents: &Tensor) -> Result<Tensor> {
        let n = latents.size().first().copied().unwrap_or(0);
        if latents.dim() != 4 || n <= 1 {
            return self.decode(latents);
        }
        let images = (0..n)
            .map(|i| self.decode(&latents.f_narrow(0, i, 1)?))
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::f_cat(&images, 0)?)
    }

    /// `(z − shift_factor) · scaling_factor`: VAE latents → the UNet's latent space.
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch.
    pub fn scale_latents(&self, z: &Tensor) -> Result<Tensor> {
        let z = match self.config.shift_factor {
            Some(s) => z.f_sub_scalar(s)?,
            None => z.shallow_clone(),
        };
        Ok(z.f_mul_scalar(self.config.scaling_factor)?)
    }

    /// `z / scaling_factor + shift_factor`: the inverse of [`Self::scale_latents`].
    ///
    /// # Errors
    /// [`Error::Torch`] from libtorch.
    pub fn unscale_latents(&self, z: &Tensor) -> Result<Tensor> {
        let z = z.f_div_scalar(self.config.scaling_factor)?;
        match self.config.shift_factor {
            Some(s) => Ok(z.f_add_scalar(s)?),
            None => Ok(z),
        }
    }
}

impl Adaptable for AutoencoderKL {
    fn visit_sites(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.encoder.visit(true, f)?;
        if let Some(q) = &mut self.quant_conv {
            q.visit(f)?;
        }
        if let Some(q) = &mut self.post_quant_conv {
            q.visit(f)?;
        }
        self.decoder.visit(false, f)
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.param_count)
    }
}
