//! FLUX.1 descriptors: the rectified-flow transformer of Black Forest Labs (FLUX.1-dev and
//! FLUX.1-schnell), its T5-XXL and CLIP-L text encoders and its 16-channel autoencoder — the
//! shapes and parameter counts the estimator needs, read from a preset or a checkpoint's header.
//!
//! The transformer (diffusers `FluxTransformer2DModel`, BFL `flux/model.py`) is a stack of
//! `double` double-stream blocks (image and text tokens each with their own weights, one joint
//! attention) followed by `single` single-stream blocks (one weight set over the concatenated
//! sequence, attention and MLP in parallel). Width `h = heads · head_dim` (24 × 128 = 3072), MLP
//! ratio 4. Latents `[B, 16, H/8, W/8]` are packed in 2 × 2 patches into `(H/16)·(W/16)` image
//! tokens of 64 channels; the T5 prompt adds 512 text tokens (dev; 256 for schnell).
//!
//! Linear sites use diffusers' module names, per double-stream block: `attn.to_q`, `attn.to_k`,
//! `attn.to_v`, `attn.to_out.0`, `attn.add_q_proj`, `attn.add_k_proj`, `attn.add_v_proj`,
//! `attn.to_add_out` (`h → h`), `ff.net.0.proj`, `ff_context.net.0.proj` (`h → 4h`),
//! `ff.net.2`, `ff_context.net.2` (`4h → h`), `norm1.linear`, `norm1_context.linear`
//! (`h → 6h`); per single-stream block: `attn.to_q`, `attn.to_k`, `attn.to_v` (`h → h`),
//! `proj_mlp` (`h → 4h`), `proj_out` (`5h → h`), `norm.linear` (`h → 3h`); and the embedders
//! and output layers outside the blocks.
//!
//! Planning a FLUX.1-dev LoRA as kohya's sample command sets it up (LoRA on every block linear,
//! fp8 base, checkpointing, latents and text-encoder outputs cached, 1024 px), and what a 12 GiB
//! card needs:
//!
//! ```
//! use lora_memory::{
//!     BaseDtype, Bytes, FLUX_BLOCK_LINEARS, MixedPrecision, ModelDescriptor, Settings, estimate,
//!     fit,
//! };
//! let flux = ModelDescriptor::preset("FLUX.1-dev").unwrap();
//! let s = Settings::default()
//!     .with_target_modules(&FLUX_BLOCK_LINEARS) // the default q_proj/v_proj are an LLM's
//!     .with_base_dtype(BaseDtype::Fp8)
//!     .with_mixed_precision(MixedPrecision::Bf16)
//!     .with_gradient_checkpointing(true)
//!     .with_cache_latents(true)
//!     .with_cache_text_encoder_outputs(true)
//!     .with_resolution(1024);
//! let e = estimate(&flux, &s).unwrap();
//! let detail = e.flux.as_ref().unwrap();
//! assert_eq!((detail.image_tokens, detail.text_tokens), (4096, 512));
//! assert!(e.peak > Bytes::from_gib(12.0));
//! // fit() keeps the resolution and moves blocks to the host instead
//! let f = fit(&flux, &s, Bytes::from_gib(12.0)).unwrap();
//! assert!(f.settings.blocks_to_swap > 0 && f.settings.resolution == 1024);
//! ```

use crate::error::{Error, Result};
use crate::parts::{LinearSite, TextEncoderDescriptor};
use serde::{Deserialize, Serialize};

/// Which FLUX.1 model: dev (guidance-distilled, a guidance embedder, 512 T5 tokens) or schnell
/// (timestep-distilled, no guidance embedder, 256 T5 tokens).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FluxVariant {
    /// FLUX.1-dev (`guidance_embeds: true`).
    Dev,
    /// FLUX.1-schnell (`guidance_embeds: false`).
    Schnell,
}

/// A FLUX.1 model: transformer shapes, text encoders and autoencoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FluxDescriptor {
    /// Display name.
    pub name: String,
    /// dev or schnell.
    pub variant: FluxVariant,
    /// Width `h` (`num_attention_heads · attention_head_dim`, 3072).
    pub hidden: u64,
    /// Attention heads (24).
    pub heads: u64,
    /// Double-stream blocks (`num_layers`, 19).
    pub double_blocks: u64,
    /// Single-stream blocks (`num_single_layers`, 38).
    pub single_blocks: u64,
    /// Packed latent channels (`in_channels`, 64 = 16 latent channels × 2 × 2).
    pub in_channels: u64,
    /// T5 width the context embedder reads (`joint_attention_dim`, 4096).
    pub joint_attention_dim: u64,
    /// CLIP pooled width (`pooled_projection_dim`, 768).
    pub pooled_projection_dim: u64,
    /// Transformer parameter count (the checkpoint's when read from a header).
    pub transformer_params: u64,
    /// The transformer's bytes in memory when a quantized single file (GGUF) is kept as stored:
    /// its tensors keep their own types (a "Q4_K_S" file mixes Q4_K, Q5_K, F16 and F32
    /// tensors), each at [`crate::BaseDtype::bytes_per_param`] of its type, so this replaces
    /// `params × bytes/param` for such a base.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_bytes: Option<u64>,
    /// Text encoders: CLIP-L (`text_encoder`) and T5-XXL (`text_encoder_2`).
    pub text_encoders: Vec<TextEncoderDescriptor>,
    /// Autoencoder parameter count.
    pub vae_params: u64,
    /// Latent channels (16).
    pub latent_channels: u64,
    /// Autoencoder down-scaling factor (8).
    pub vae_scale: u64,
    /// The autoencoder's `block_out_channels` (FLUX.1's: `[128, 256, 512, 512]`, SD's). Empty:
    /// FLUX.1's.
    #[serde(default)]
    pub vae_block_out_channels: Vec<u64>,
    /// The autoencoder's `layers_per_block` (2). 0: FLUX.1's.
    #[serde(default)]
    pub vae_layers_per_block: u64,
}

/// Every linear inside the blocks (diffusers names) — what kohya's `networks.lora_flux` trains
/// by default (`train_blocks=all`): as `target_modules`, LoRA on all of them.
pub const FLUX_BLOCK_LINEARS: [&str; 17] = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
    "norm1.linear",
    "norm1_context.linear",
    "proj_mlp",
    "proj_out",
    "norm.linear",
];

/// The MLP ratio of every FLUX.1 block (`mlp_ratio = 4.0` in BFL's `FluxParams`).
pub const FLUX_MLP_RATIO: u64 = 4;

impl FluxDescriptor {
    /// FLUX.1-dev: 19 double + 38 single blocks at 3072 wide, guidance embedder; CLIP-L and
    /// T5-XXL (v1.1 encoder, 4096 wide, 24 layers); the 16-channel autoencoder (diffusers
    /// configs of `black-forest-labs/FLUX.1-dev`).
    pub fn dev() -> Self {
        let mut d = FluxDescriptor {
            name: "FLUX.1-dev".into(),
            variant: FluxVariant::Dev,
            hidden: 3072,
            heads: 24,
            double_blocks: 19,
            single_blocks: 38,
            in_channels: 64,
            joint_attention_dim: 4096,
            pooled_projection_dim: 768,
            transformer_params: 0,
            stored_bytes: None,
            text_encoders: vec![clip_l(), t5_xxl()],
            vae_params: 83_819_683,
            latent_channels: 16,
            vae_scale: 8,
            vae_block_out_channels: crate::parts::SD_VAE_CHANNELS.to_vec(),
            vae_layers_per_block: 2,
        };
        d.transformer_params = d.computed_transformer_params();
        d
    }

    /// FLUX.1-schnell: FLUX.1-dev's shapes without the guidance embedder.
    pub fn schnell() -> Self {
        let mut d = FluxDescriptor {
            name: "FLUX.1-schnell".into(),
            variant: FluxVariant::Schnell,
            ..FluxDescriptor::dev()
        };
        d.transformer_params = d.computed_transformer_params();
        d
    }

    /// T5 tokens per caption by default: 512 (dev) or 256 (schnell), kohya's
    /// `t5xxl_max_token_length` defaults (`flux_train_network.py`).
    pub fn default_text_tokens(&self) -> u64 {
        match self.variant {
            FluxVariant::Dev => 512,
            FluxVariant::Schnell => 256,
        }
    }

    /// Parameters of one double-stream block: per stream `q, k, v, out` (`4h² + 4h`), the MLP
    /// (`8h² + 5h`), the modulation (`6h² + 6h`), plus the two q/k RMSNorm scales per stream
    /// (`2·head_dim`): `36h² + 30h + 4·head_dim`.
    pub fn double_block_params(&self) -> u64 {
        let h = self.hidden;
        let hd = self.head_dim();
        let f = FLUX_MLP_RATIO * h;
        let stream = 4 * (h * h + h) + (h * f + f) + (f * h + h) + (6 * h * h + 6 * h) + 2 * hd;
        2 * stream
    }

    /// Parameters of one single-stream block: `q, k, v` and the MLP input as one `h → 7h`
    /// (`linear1`), the output `5h → h` (`linear2`), the modulation `h → 3h`, the q/k norm
    /// scales: `15h² + 11h + 2·head_dim`.
    pub fn single_block_params(&self) -> u64 {
        let h = self.hidden;
        let f = FLUX_MLP_RATIO * h;
        (h * (3 * h + f) + 3 * h + f)
            + ((h + f) * h + h)
            + (3 * h * h + 3 * h)
            + 2 * self.head_dim()
    }

    /// Per-head width `h / heads` (128).
    pub fn head_dim(&self) -> u64 {
        self.hidden / self.heads.max(1)
    }

    /// Transformer parameters from the shapes: blocks plus `x_embedder`, `context_embedder`,
    /// the timestep (and for dev the guidance) embedder `256 → h → h`, the pooled-text
    /// embedder `pooled → h → h`, `norm_out.linear` (`h → 2h`) and `proj_out` (`h → in`).
    /// FLUX.1-dev: 11,901,408,320.
    pub fn computed_transformer_params(&self) -> u64 {
        let h = self.hidden;
        let mlp_in = |i: u64| i * h + h + h * h + h;
        let mut p = self.double_blocks * self.double_block_params()
            + self.single_blocks * self.single_block_params();
        p += self.in_channels * h + h; // x_embedder
        p += self.joint_attention_dim * h + h; // context_embedder
        p += mlp_in(256); // timestep embedder
        if self.variant == FluxVariant::Dev {
            p += mlp_in(256); // guidance embedder
        }
        p += mlp_in(self.pooled_projection_dim); // text embedder
        p += h * 2 * h + 2 * h; // norm_out.linear
        p += h * self.in_channels + self.in_channels; // proj_out
        p
    }

    /// Text-encoder parameters (CLIP-L + T5-XXL).
    pub fn text_encoder_params(&self) -> u64 {
        self.text_encoders.iter().map(|t| t.params).sum()
    }

    /// Blocks kept on the host for kohya's `blocks_to_swap = n`: `(double, single)` =
    /// `(n / 2, 2·(n − n / 2))` (`library/flux_models.py`, `Flux.enable_block_swap`).
    ///
    /// # Errors
    /// [`Error::InvalidSetting`] (`blocks_to_swap`) when that leaves fewer than two blocks of
    /// either kind on the device (kohya's limit: 35 for FLUX.1).
    pub fn swapped_blocks(&self, blocks_to_swap: u32) -> Result<(u64, u64)> {
        let n = u64::from(blocks_to_swap);
        let double = n / 2;
        let single = 2 * (n - double);
        if n > 0 && (double + 2 > self.double_blocks || single + 2 > self.single_blocks) {
            return Err(Error::InvalidSetting {
                key: "blocks_to_swap",
                reason: format!(
                    "{n} would move {double} of {} double-stream and {single} of {} single-stream blocks to the host; at most {} can be swapped (two of each kind stay on the device)",
                    self.double_blocks,
                    self.single_blocks,
                    self.max_blocks_to_swap()
                ),
            });
        }
        Ok((double, single))
    }

    /// The largest `blocks_to_swap` [`Self::swapped_blocks`] accepts (35 for FLUX.1).
    pub fn max_blocks_to_swap(&self) -> u32 {
        let mut n = 0u32;
        loop {
            let m = u64::from(n + 1);
            let double = m / 2;
            let single = 2 * (m - double);
            if double + 2 > self.double_blocks || single + 2 > self.single_blocks {
                return n;
            }
            n += 1;
        }
    }

    /// The autoencoder decoder's shape: `block_out_channels` (deepest last) and ResNets per
    /// decoder level (`layers_per_block + 1`); FLUX.1's when the descriptor does not say.
    pub fn vae_decoder_shape(&self) -> (Vec<u64>, u64) {
        crate::parts::decoder_shape(&self.vae_block_out_channels, self.vae_layers_per_block)
    }

    /// All LoRA-targetable linear sites (diffusers names, component `"transformer"`, then the
    /// text encoders' `self_attn.{q,k,v,out}_proj`, `mlp.fc1/fc2` (CLIP-L) and
    /// `SelfAttention.{q,k,v,o}`, `DenseReluDense.{wi_0,wi_1,wo}` (T5)).
    pub fn sites(&self) -> Vec<LinearSite> {
        self.sites_with_blocks(self.double_blocks, self.single_blocks, true)
    }

    /// [`Self::sites`] with the block sites counted over `double` double-stream and `single`
    /// single-stream blocks instead of all of them (the blocks that carry LoRA when only some
    /// are trained), and the transformer's sites outside the blocks (embedders, output head)
    /// only with `outside_blocks`.
    pub fn sites_with_blocks(
        &self,
        double: u64,
        single: u64,
        outside_blocks: bool,
    ) -> Vec<LinearSite> {
        let h = self.hidden;
        let f = FLUX_MLP_RATIO * h;
        let site = |name: &str, comp: &str, i: u64, o: u64, n: u64| LinearSite {
            name: name.into(),
            component: comp.into(),
            in_features: i,
            out_features: o,
            kernel_area: 1,
            count: n,
            conv: false,
        };
        let t = "transformer";
        let nd = double;
        let ns = single;
        let mut out = Vec::new();
        for n in [
            "attn.to_q",
            "attn.to_k",
            "attn.to_v",
            "attn.to_out.0",
            "attn.add_q_proj",
            "attn.add_k_proj",
            "attn.add_v_proj",
            "attn.to_add_out",
        ] {
            out.push(site(n, t, h, h, nd));
        }
        out.push(site("ff.net.0.proj", t, h, f, nd));
        out.push(site("ff.net.2", t, f, h, nd));
        out.push(site("ff_context.net.0.proj", t, h, f, nd));
        out.push(site("ff_context.net.2", t, f, h, nd));
        out.push(site("norm1.linear", t, h, 6 * h, nd));
        out.push(site("norm1_context.linear", t, h, 6 * h, nd));
        for n in ["attn.to_q", "attn.to_k", "attn.to_v"] {
            // the single-stream q/k/v share the double-stream names and shapes: one entry
            if let Some(s) = out.iter_mut().find(|s| s.name == n) {
                s.count += ns;
            }
        }
        out.push(site("proj_mlp", t, h, f, ns));
        out.push(site("proj_out", t, h + f, h, ns));
        out.push(site("norm.linear", t, h, 3 * h, ns));
        if outside_blocks {
            out.push(site("x_embedder", t, self.in_channels, h, 1));
            out.push(site("context_embedder", t, self.joint_attention_dim, h, 1));
            let emb = if self.variant == FluxVariant::Dev {
                2
            } else {
                1
            };
            out.push(site("linear_1", t, 256, h, emb));
            out.push(site("linear_2", t, h, h, emb + 1));
            out.push(site("linear_1", t, self.pooled_projection_dim, h, 1));
            out.push(site("norm_out.linear", t, h, 2 * h, 1));
            out.push(site("proj_out", t, h, self.in_channels, 1));
        }
        for te in &self.text_encoders {
            let (th, ti, l) = (te.hidden, te.intermediate, te.layers);
            if te.name == "text_encoder_2" {
                // T5 v1.1: attention inner width = heads × 64 = hidden; gated-GELU MLP
                for n in [
                    "SelfAttention.q",
                    "SelfAttention.k",
                    "SelfAttention.v",
                    "SelfAttention.o",
                ] {
                    out.push(site(n, &te.name, th, th, l));
                }
                out.push(site("DenseReluDense.wi_0", &te.name, th, ti, l));
                out.push(site("DenseReluDense.wi_1", &te.name, th, ti, l));
                out.push(site("DenseReluDense.wo", &te.name, ti, th, l));
            } else {
                for n in [
                    "self_attn.q_proj",
                    "self_attn.k_proj",
                    "self_attn.v_proj",
                    "self_attn.out_proj",
                ] {
                    out.push(site(n, &te.name, th, th, l));
                }
                out.push(site("mlp.fc1", &te.name, th, ti, l));
                out.push(site("mlp.fc2", &te.name, ti, th, l));
            }
        }
        out
    }

    /// A descriptor from a checkpoint's tensor names and shapes: BFL's original layout
    /// (`double_blocks.N.img_attn.qkv.weight`, `single_blocks.N.linear1.weight`, `guidance_in.…`
    /// — `flux1-dev.safetensors`, ComfyUI's files, city96's GGUF files, optionally under
    /// `model.diffusion_model.`) or diffusers' (`transformer_blocks.N.attn.to_q.weight`,
    /// `single_transformer_blocks.N…`, `time_text_embed.guidance_embedder…`). `None` when the
    /// names are neither.
    ///
    /// `params` is the sum of the tensors' elements; `stored_bytes` their stored size when the
    /// file keeps quantized blocks (GGUF).
    ///
    /// # Errors
    /// [`Error::UnsupportedArchitecture`] when the block widths cannot be read.
    pub fn from_tensor_names<'a>(
        path: &std::path::Path,
        tensors: impl Iterator<Item = (&'a str, &'a [u64])> + Clone,
        params: u64,
        stored_bytes: Option<u64>,
    ) -> Result<Option<Self>> {
        let strip = |k: &'a str| k.strip_prefix("model.diffusion_model.").unwrap_or(k);
        let count = |prefix: &str| -> u64 {
            tensors
                .clone()
                .filter_map(|(k, _)| {
                    let rest = strip(k).strip_prefix(prefix)?;
                    rest.split('.').next()?.parse::<u64>().ok()
                })
                .max()
                .map_or(0, |m| m + 1)
        };
        let find = |suffix: &str| {
            tensors
                .clone()
                .find(|(k, _)| strip(k) == suffix)
                .map(|(_, s)| s.to_vec())
        };
        let bfl = count("double_blocks.") > 0;
        let diffusers = count("transformer_blocks.") > 0 && count("single_transformer_blocks.") > 0;
        if !bfl && !diffusers {
            return Ok(None);
        }
        let (double, single, guidance, x_in, ctx, pooled) = if bfl {
            (
                count("double_blocks."),
                count("single_blocks."),
                tensors
                    .clone()
                    .any(|(k, _)| strip(k).starts_with("guidance_in.")),
                find("img_in.weight"),
                find("txt_in.weight"),
                find("vector_in.in_layer.weight"),
            )
        } else {
            (
                count("transformer_blocks."),
                count("single_transformer_blocks."),
                tensors
                    .clone()
                    .any(|(k, _)| strip(k).starts_with("time_text_embed.guidance_embedder.")),
                find("x_embedder.weight"),
                find("context_embedder.weight"),
                find("time_text_embed.text_embedder.linear_1.weight"),
            )
        };
        // torch shapes are [out, in]; GGUF lists dims innermost first — accept either order by
        // taking the known width from the other axis
        let (Some(x_in), Some(ctx)) = (x_in, ctx) else {
            return Err(Error::UnsupportedArchitecture {
                path: path.into(),
                arch: "FLUX transformer without its image/text input projections".into(),
                hint: "expected img_in.weight and txt_in.weight (BFL) or x_embedder.weight and context_embedder.weight (diffusers)".into(),
            });
        };
        // the width is the dimension the image and text input projections share; when that is
        // ambiguous, the image input is the one projection narrower than the width
        let (hidden, in_channels) =
            match (x_in.as_slice(), ctx.as_slice()) {
                ([a, b], [c, d]) if (a == c || a == d) != (b == c || b == d) => {
                    if a == c || a == d { (*a, *b) } else { (*b, *a) }
                }
                _ => wide_narrow(&x_in),
            };
        let joint = other_dim(&ctx, hidden);
        let pooled = pooled.map_or(768, |p| other_dim(&p, hidden));
        // the head width: the q RMSNorm scale of the first block ([head_dim]); FLUX.1's 128
        // when the file has none
        let head_dim = if bfl {
            find("double_blocks.0.img_attn.norm.query_norm.scale")
        } else {
            find("transformer_blocks.0.attn.norm_q.weight")
        }
        .and_then(|s| s.first().copied())
        .filter(|&d| d > 0)
        .unwrap_or(128);
        if hidden == 0 || hidden % head_dim != 0 {
            return Err(Error::UnsupportedArchitecture {
                path: path.into(),
                arch: format!("FLUX transformer {hidden} wide"),
                hint: format!("the width must be a multiple of the {head_dim}-wide heads"),
            });
        }
        let base = if guidance {
            FluxDescriptor::dev()
        } else {
            FluxDescriptor::schnell()
        };
        let mut d = FluxDescriptor {
            name: path
                .file_name()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or(base.name.clone()),
            hidden,
            heads: hidden / head_dim,
            double_blocks: double,
            single_blocks: single,
            in_channels,
            joint_attention_dim: joint,
            pooled_projection_dim: pooled,
            stored_bytes,
            ..base
        };
        d.transformer_params = if params > 0 {
            params
        } else {
            d.computed_transformer_params()
        };
        Ok(Some(d))
    }
}

/// `(larger, smaller)` of a 2-D shape.
fn wide_narrow(shape: &[u64]) -> (u64, u64) {
    match shape {
        [a, b] => ((*a).max(*b), (*a).min(*b)),
        _ => (0, 0),
    }
}

/// The dimension of a 2-D shape that is not `hidden` (`hidden` when both are).
fn other_dim(shape: &[u64], hidden: u64) -> u64 {
    match shape {
        [a, b] if *a == hidden => *b,
        [a, _] => *a,
        _ => 0,
    }
}

/// CLIP ViT-L/14 text encoder (`openai/clip-vit-large-patch14`, 123,060,480 parameters).
fn clip_l() -> TextEncoderDescriptor {
    TextEncoderDescriptor {
        name: "text_encoder".into(),
        params: 123_060_480,
        hidden: 768,
        intermediate: 3072,
        layers: 12,
        heads: 12,
        max_tokens: 77,
    }
}

/// T5 v1.1 XXL encoder (`google/t5-v1_1-xxl`, transformers `T5EncoderModel`):
/// 4,762,310,656 parameters (32128 × 4096 shared embedding, 24 layers of 4 × 4096² attention
/// and a 4096 → 2 × 10240 → 4096 gated-GELU MLP).
fn t5_xxl() -> TextEncoderDescriptor {
    TextEncoderDescriptor {
        name: "text_encoder_2".into(),
        params: 4_762_310_656,
        hidden: 4096,
        intermediate: 10240,
        layers: 24,
        heads: 64,
        max_tokens: 512,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_presets_count_what_the_published_checkpoints_hold() {
        // diffusers FluxTransformer2DModel of FLUX.1-dev: 11,901,408,320 parameters
        // (sum(p.numel()) of the published weights); schnell lacks the 256 → h → h guidance MLP
        let dev = FluxDescriptor::dev();
        assert_eq!(dev.computed_transformer_params(), 11_901_408_320);
        let schnell = FluxDescriptor::schnell();
        assert_eq!(
            dev.transformer_params - schnell.transformer_params,
            256 * 3072 + 3072 + 3072 * 3072 + 3072
        );
        assert_eq!(dev.head_dim(), 128);
        assert_eq!(dev.default_text_tokens(), 512);
        assert_eq!(schnell.default_text_tokens(), 256);
    }

    #[test]
    fn blocks_to_swap_counts_as_kohya_does() {
        let d = FluxDescriptor::dev();
        assert_eq!(d.swapped_blocks(0).unwrap(), (0, 0));
        assert_eq!(d.swapped_blocks(16).unwrap(), (8, 16));
        assert_eq!(d.swapped_blocks(35).unwrap(), (17, 36));
        assert_eq!(d.max_blocks_to_swap(), 35);
        let e = d.swapped_blocks(36).unwrap_err().to_string();
        assert!(e.contains("blocks_to_swap") && e.contains("35"), "{e}");
    }

    #[test]
    fn sites_cover_every_transformer_linear() {
        let d = FluxDescriptor::dev();
        let linear: u64 = d
            .sites()
            .iter()
            .filter(|s| s.component == "transformer")
            .map(|s| s.weight_params() * s.count)
            .sum();
        // everything but biases and norm scales is a linear weight: per double block two
        // streams of biases (q, k, v, out, MLP in/out, modulation: 4h + 4h + h + 6h) and four
        // 128-wide q/k norms, per single block 3h + 4h + h + 3h biases and two norms, and the
        // biases of the embedders (h each linear), norm_out (2h) and proj_out (64)
        let h = 3072;
        let biases = 19 * (2 * 15 * h + 4 * 128) + 38 * (11 * h + 2 * 128) + 8 * h + 2 * h + 64;
        assert_eq!(d.transformer_params - linear, biases);
        let t5: u64 = d
            .sites()
            .iter()
            .filter(|s| s.component == "text_encoder_2")
            .map(|s| s.weight_params() * s.count)
            .sum();
        // T5-XXL without its 32128 × 4096 embedding, the relative position table and norms
        assert_eq!(t5, 4_762_310_656 - 32128 * 4096 - 32 * 64 - 49 * 4096);
    }

    #[test]
    fn bfl_and_diffusers_names_give_the_same_shapes() {
        let p = std::path::Path::new("flux1-dev.safetensors");
        let bfl: Vec<(String, Vec<u64>)> = vec![
            (
                "double_blocks.0.img_attn.qkv.weight".into(),
                vec![9216, 3072],
            ),
            (
                "double_blocks.18.img_attn.qkv.weight".into(),
                vec![9216, 3072],
            ),
            ("single_blocks.37.linear1.weight".into(), vec![21504, 3072]),
            ("img_in.weight".into(), vec![3072, 64]),
            ("txt_in.weight".into(), vec![3072, 4096]),
            ("vector_in.in_layer.weight".into(), vec![3072, 768]),
            ("guidance_in.in_layer.weight".into(), vec![3072, 256]),
        ];
        let it = bfl.iter().map(|(k, s)| (k.as_str(), s.as_slice()));
        let d = FluxDescriptor::from_tensor_names(p, it, 0, None)
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                d.variant,
                d.double_blocks,
                d.single_blocks,
                d.hidden,
                d.heads
            ),
            (FluxVariant::Dev, 19, 38, 3072, 24)
        );
        assert_eq!(
            d.transformer_params,
            FluxDescriptor::dev().transformer_params
        );
        // diffusers names, GGUF dimension order (innermost first), no guidance: schnell
        let diff: Vec<(String, Vec<u64>)> = vec![
            (
                "transformer_blocks.1.attn.to_q.weight".into(),
                vec![3072, 3072],
            ),
            (
                "single_transformer_blocks.3.proj_mlp.weight".into(),
                vec![3072, 12288],
            ),
            ("x_embedder.weight".into(), vec![64, 3072]),
            ("context_embedder.weight".into(), vec![4096, 3072]),
        ];
        let it = diff.iter().map(|(k, s)| (k.as_str(), s.as_slice()));
        let d = FluxDescriptor::from_tensor_names(p, it, 123, Some(45))
            .unwrap()
            .unwrap();
        assert_eq!(
            (
                d.variant,
                d.double_blocks,
                d.single_blocks,
                d.transformer_params
            ),
            (FluxVariant::Schnell, 2, 4, 123)
        );
        assert_eq!(d.stored_bytes, Some(45));
        // anything else is not FLUX
        let other = [("model.embed_tokens.weight", &[10u64, 4][..])];
        assert!(
            FluxDescriptor::from_tensor_names(p, other.iter().copied(), 0, None)
                .unwrap()
                .is_none()
        );
    }
}
