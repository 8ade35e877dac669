//! Model descriptors: the shapes and parameter counts the estimator needs, nothing else.
//!
//! A descriptor is built from a named preset ([`ModelDescriptor::preset`]), an HF `config.json`
//! ([`ModelDescriptor::from_hf_config_json`]), a GGUF header ([`ModelDescriptor::from_gguf`]) or a
//! safetensors header ([`ModelDescriptor::from_safetensors`]) — never from tensor data.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub(crate) use crate::parts::decoder_shape;
pub use crate::parts::{LinearSite, SD_VAE_CHANNELS, TextEncoderDescriptor};

/// A model the estimator knows how to reason about.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum ModelDescriptor {
    /// A LLaMA-family decoder (LLaMA, Mistral, Qwen2/2.5/3, SmolLM2, …).
    Decoder(DecoderDescriptor),
    /// A latent-diffusion model (Stable Diffusion 1.x / SDXL).
    Diffusion(DiffusionDescriptor),
    /// A FLUX.1 rectified-flow transformer with its text encoders and autoencoder.
    Flux(crate::flux::FluxDescriptor),
}

/// Norm kind of a decoder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// RMSNorm (LLaMA). HF's implementation computes in fp32.
    RmsNorm,
    /// LayerNorm with bias (BERT-style encoders).
    LayerNorm,
}

/// A LLaMA-family decoder block stack.
///
/// Linear sites per layer use HF module names: `self_attn.{q,k,v,o}_proj`,
/// `mlp.{gate,up,down}_proj` (`mlp.{up,down}_proj` when `gated_mlp` is false; Phi-3's fused
/// `self_attn.qkv_proj` and `mlp.gate_up_proj` when `fused_qkv` / `fused_gate_up` are set).
///
/// Build one with [`DecoderDescriptor::builder`]; change one with
/// [`DecoderDescriptor::to_builder`]. The parameter count is derived from the shapes
/// ([`DecoderDescriptor::params`]) unless a file gave the exact number (`exact_params`), and a
/// builder that changes a shape drops that number, so the count never goes stale.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecoderDescriptor {
    /// Display name.
    pub name: String,
    /// Model width `h` (`hidden_size`).
    pub hidden: u64,
    /// MLP width `f` (`intermediate_size`).
    pub intermediate: u64,
    /// Number of transformer layers `L`.
    pub layers: u64,
    /// Attention heads `a`.
    pub heads: u64,
    /// Key/value heads (GQA); equal to `heads` for multi-head attention.
    pub kv_heads: u64,
    /// Per-head width `d` (`head_dim`, default `hidden / heads`).
    pub head_dim: u64,
    /// Vocabulary size `V`.
    pub vocab: u64,
    /// `lm_head` shares the embedding matrix (`tie_word_embeddings`).
    pub tied_embeddings: bool,
    /// Per-head RMSNorm on q and k (Qwen3).
    pub qk_norm: bool,
    /// Bias on q/k/v projections (Qwen2, Qwen1).
    pub attention_bias: bool,
    /// SwiGLU MLP (gate, up, down) vs. a plain two-matrix MLP.
    pub gated_mlp: bool,
    /// q, k and v are one `self_attn.qkv_proj` linear `[q + 2·kv, h]` (Phi-3).
    #[serde(default)]
    pub fused_qkv: bool,
    /// gate and up are one `mlp.gate_up_proj` linear `[2·f, h]` (Phi-3).
    #[serde(default)]
    pub fused_gate_up: bool,
    /// Norm kind.
    pub norm: NormKind,
    /// Learned absolute position embeddings (rows), 0 for RoPE models.
    pub position_embeddings: u64,
    /// The exact parameter count when a file stated it (the sum of a checkpoint's tensor
    /// sizes); `None` = derived from the shapes ([`DecoderDescriptor::computed_params`]).
    #[serde(default, alias = "params", skip_serializing_if = "Option::is_none")]
    pub exact_params: Option<u64>,
}

/// The largest value [`DecoderBuilder::build`] accepts for one shape field: 2^31.
pub const MAX_SHAPE: u64 = 1 << 31;

/// The most parameters [`DecoderBuilder::build`] accepts: 2^50 (about 10^15).
pub const MAX_PARAMS: u64 = 1 << 50;

/// Builds a [`DecoderDescriptor`], deriving what the shapes imply: `kv_heads` defaults to
/// `heads`, `head_dim` to `hidden / heads`, `intermediate` to `4·hidden` for a plain MLP.
///
/// ```
/// use lora_memory::DecoderDescriptor;
/// // SmolLM2-135M's config.json
/// let d = DecoderDescriptor::builder("SmolLM2-135M")
///     .hidden(576).intermediate(1536).layers(30).heads(9).kv_heads(3).vocab(49152)
///     .tied_embeddings(true)
///     .build()
///     .unwrap();
/// assert_eq!(d.params(), 134_515_008);
/// // Changing a shape recomputes the count.
/// let deeper = d.to_builder().layers(31).build().unwrap();
/// assert!(deeper.params() > d.params());
/// ```
#[derive(Debug, Clone)]
pub struct DecoderBuilder {
    d: DecoderDescriptor,
    kv_heads: Option<u64>,
    head_dim: Option<u64>,
    intermediate: Option<u64>,
}

macro_rules! builder_setter {
    ($(#[$m:meta])* $name:ident : $ty:ty => $($field:ident).+) => {
        $(#[$m])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.$($field).+ = v;
            self.d.exact_params = None;
            self
        }
    };
}

impl DecoderBuilder {
    builder_setter!(/// `hidden_size`.
        hidden: u64 => d.hidden);
    builder_setter!(/// `num_hidden_layers`.
        layers: u64 => d.layers);
    builder_setter!(/// `num_attention_heads`.
        heads: u64 => d.heads);
    builder_setter!(/// `vocab_size`.
        vocab: u64 => d.vocab);
    builder_setter!(/// `tie_word_embeddings`.
        tied_embeddings: bool => d.tied_embeddings);
    builder_setter!(/// q/k norms (Qwen3).
        qk_norm: bool => d.qk_norm);
    builder_setter!(/// q/k/v biases (Qwen2).
        attention_bias: bool => d.attention_bias);
    builder_setter!(/// SwiGLU (`true`, the default) or a plain two-matrix MLP.
        gated_mlp: bool => d.gated_mlp);
    builder_setter!(/// One fused `qkv_proj` (Phi-3).
        fused_qkv: bool => d.fused_qkv);
    builder_setter!(/// One fused `gate_up_proj` (Phi-3).
        fused_gate_up: bool => d.fused_gate_up);
    builder_setter!(/// Norm kind (default RMSNorm).
        norm: NormKind => d.norm);
    builder_setter!(/// Learned absolute position embeddings (rows; 0 for RoPE, the default).
        position_embeddings: u64 => d.position_embeddings);

    /// `num_key_value_heads` (default: `heads`).
    pub fn kv_heads(mut self, v: u64) -> Self {
        self.kv_heads = Some(v);
        self.d.exact_params = None;
        self
    }

    /// `head_dim` (default: `hidden / heads`).
    pub fn head_dim(mut self, v: u64) -> Self {
        self.head_dim = Some(v);
        self.d.exact_params = None;
        self
    }

    /// `intermediate_size` (default `4·hidden`).
    pub fn intermediate(mut self, v: u64) -> Self {
        self.intermediate = Some(v);
        self.d.exact_params = None;
        self
    }

    /// The display name (does not change the count).
    pub fn name(mut self, name: &str) -> Self {
        self.d.name = name.to_string();
        self
    }

    /// The exact parameter count a file stated (set it after the shapes: a later shape change
    /// drops it).
    pub fn exact_params(mut self, params: u64) -> Self {
        self.d.exact_params = Some(params);
        self
    }

    /// The descriptor.
    ///
    /// # Errors
    /// [`Error::InvalidDescriptor`] naming the field when `hidden`, `intermediate`, `layers`,
    /// `heads`, `vocab`, `kv_heads` or `head_dim` is 0, a field exceeds [`MAX_SHAPE`], the
    /// parameter count exceeds [`MAX_PARAMS`], or `heads` is not a multiple of `kv_heads`.
    pub fn build(self) -> Result<DecoderDescriptor> {
        let mut d = self.d;
        let bad = |field: &'static str, reason: String| {
            Err(Error::InvalidDescriptor {
                name: d.name.clone(),
                field,
                reason,
            })
        };
        for (field, v) in [
            ("hidden", d.hidden),
            ("layers", d.layers),
            ("heads", d.heads),
            ("vocab", d.vocab),
        ] {
            if v == 0 {
                return bad(field, "must be at least 1".into());
            }
        }
        d.kv_heads = self.kv_heads.unwrap_or(d.heads);
        d.head_dim = self.head_dim.unwrap_or(d.hidden / d.heads);
        d.intermediate = self.intermediate.unwrap_or(d.hidden.saturating_mul(4));
        for (field, v) in [
            ("hidden", d.hidden),
            ("intermediate", d.intermediate),
            ("layers", d.layers),
            ("heads", d.heads),
            ("kv_heads", d.kv_heads),
            ("head_dim", d.head_dim),
            ("vocab", d.vocab),
            ("position_embeddings", d.position_embeddings),
        ] {
            if v > MAX_SHAPE {
                return bad(
                    field,
                    format!("{v} is implausibly large (the limit is {MAX_SHAPE})"),
                );
            }
        }
        if d.intermediate == 0 {
            return bad("intermediate", "must be at least 1".into());
        }
        if d.kv_heads == 0 || d.heads % d.kv_heads != 0 {
            return bad(
                "kv_heads",
                format!(
                    "{} key/value heads do not divide {} attention heads",
                    d.kv_heads, d.heads
                ),
            );
        }
        if d.head_dim == 0 {
            return bad("head_dim", "must be at least 1".into());
        }
        if d.params() > MAX_PARAMS {
            return bad(
                "hidden",
                format!(
                    "the shapes give {} parameters, more than {MAX_PARAMS}",
                    d.params()
                ),
            );
        }
        Ok(d)
    }
}

impl DecoderDescriptor {
    /// A builder with the given display name; set the shapes, then [`DecoderBuilder::build`].
    pub fn builder(name: &str) -> DecoderBuilder {
        DecoderBuilder {
            d: DecoderDescriptor {
                name: name.to_string(),
                hidden: 0,
                intermediate: 0,
                layers: 0,
                heads: 0,
                kv_heads: 0,
                head_dim: 0,
                vocab: 0,
                tied_embeddings: false,
                qk_norm: false,
                attention_bias: false,
                gated_mlp: true,
                fused_qkv: false,
                fused_gate_up: false,
                norm: NormKind::RmsNorm,
                position_embeddings: 0,
                exact_params: None,
            },
            kv_heads: None,
            head_dim: None,
            intermediate: None,
        }
    }

    /// A builder holding this descriptor's values, to change some of them (a shape change drops
    /// `exact_params`). `kv_heads`, `head_dim` and `intermediate` are kept as they are, not
    /// derived again: set them too when changing `heads` or `hidden`.
    pub fn to_builder(&self) -> DecoderBuilder {
        DecoderBuilder {
            d: self.clone(),
            kv_heads: Some(self.kv_heads),
            head_dim: Some(self.head_dim),
            intermediate: Some(self.intermediate),
        }
    }

    /// Total parameters: `exact_params` when a file stated it, else
    /// [`DecoderDescriptor::computed_params`].
    pub fn params(&self) -> u64 {
        self.exact_params.unwrap_or_else(|| self.computed_params())
    }

    /// Parameter count from the shapes: embeddings `V·h` (+ `V·h` untied `lm_head`), per layer the
    /// linear sites, q/k/v biases, 2 norms (+ q/k norms), plus the final norm.
    pub fn computed_params(&self) -> u64 {
        // u128: absurd shapes saturate at u64::MAX instead of overflowing
        let w = |x: u64| u128::from(x);
        let h = w(self.hidden);
        let per_layer_linear: u128 = self
            .layer_sites()
            .iter()
            .map(|s| w(s.in_features) * w(s.out_features) * w(s.kernel_area))
            .sum();
        let q = w(self.heads) * w(self.head_dim);
        let kv = w(self.kv_heads) * w(self.head_dim);
        let bias = if self.attention_bias { q + 2 * kv } else { 0 };
        let norm_w = if self.norm == NormKind::LayerNorm {
            2
        } else {
            1
        };
        let norms = 2 * h * norm_w
            + if self.qk_norm {
                2 * w(self.head_dim)
            } else {
                0
            };
        let emb = w(self.vocab) * h * if self.tied_embeddings { 1 } else { 2 };
        let total = emb
            + w(self.position_embeddings) * h
            + w(self.layers) * (per_layer_linear + bias + norms)
            + h * norm_w;
        u64::try_from(total).unwrap_or(u64::MAX)
    }

    /// The linear sites of one transformer layer (each `count` = number of layers).
    pub fn layer_sites(&self) -> Vec<LinearSite> {
        let h = self.hidden;
        let q = self.heads.saturating_mul(self.head_dim);
        let kv = self.kv_heads.saturating_mul(self.head_dim);
        let f = self.intermediate;
        let mk = |name: &str, i: u64, o: u64| LinearSite {
            name: name.to_string(),
            component: "decoder".into(),
            in_features: i,
            out_features: o,
            kernel_area: 1,
            count: self.layers,
            conv: false,
        };
        let mut v = if self.fused_qkv {
            vec![mk("self_attn.qkv_proj", h, q + 2 * kv)]
        } else {
            vec![
                mk("self_attn.q_proj", h, q),
                mk("self_attn.k_proj", h, kv),
                mk("self_attn.v_proj", h, kv),
            ]
        };
        v.push(mk("self_attn.o_proj", q, h));
        if self.gated_mlp && self.fused_gate_up {
            v.push(mk("mlp.gate_up_proj", h, 2 * f));
        } else {
            if self.gated_mlp {
                v.push(mk("mlp.gate_proj", h, f));
            }
            v.push(mk("mlp.up_proj", h, f));
        }
        v.push(mk("mlp.down_proj", f, h));
        v
    }

    /// All linear sites: the layer sites plus `lm_head` (count 1).
    pub fn sites(&self) -> Vec<LinearSite> {
        let mut v = self.layer_sites();
        v.push(LinearSite {
            name: "lm_head".into(),
            component: "decoder".into(),
            in_features: self.hidden,
            out_features: self.vocab,
            kernel_area: 1,
            count: 1,
            conv: false,
        });
        v
    }

    /// Parameters held by the per-layer linear sites (what NF4 / GGUF quantization applies to).
    pub fn layer_linear_params(&self) -> u64 {
        self.layer_sites()
            .iter()
            .map(|s| s.weight_params() * s.count)
            .sum()
    }
}

/// Which latent-diffusion family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiffusionFamily {
    /// Stable Diffusion 1.x (CLIP ViT-L/14 text encoder, 768-d cross attention).
    Sd1,
    /// Stable Diffusion XL base (CLIP ViT-L + OpenCLIP bigG, 2048-d cross attention).
    Sdxl,
}

/// One resolution level of a UNet (diffusers `down_blocks[i]` / mirrored `up_blocks`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnetLevel {
    /// Channels `c` at this level (`block_out_channels[i]`).
    pub channels: u64,
    /// ResNet blocks in the down block (`layers_per_block`); the up block has one more.
    pub resnets: u64,
    /// Transformer blocks after each ResNet (0 = no attention at this level).
    pub transformer_depth: u64,
    /// Attention heads.
    pub heads: u64,
}

/// A Stable Diffusion model: UNet, text encoder(s), VAE.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiffusionDescriptor {
    /// Display name.
    pub name: String,
    /// Family.
    pub family: DiffusionFamily,
    /// UNet parameter count.
    pub unet_params: u64,
    /// UNet levels, highest resolution first.
    pub levels: Vec<UnetLevel>,
    /// Transformer depth of the mid block.
    pub mid_transformer_depth: u64,
    /// Cross-attention context width (768 SD1, 2048 SDXL).
    pub cross_attention_dim: u64,
    /// Text encoders.
    pub text_encoders: Vec<TextEncoderDescriptor>,
    /// VAE parameter count.
    pub vae_params: u64,
    /// Latent channels (4).
    pub latent_channels: u64,
    /// VAE down-scaling factor (8).
    pub vae_scale: u64,
    /// The VAE's `block_out_channels` (diffusers `AutoencoderKL` config; its decoder walks them
    /// in reverse). Empty (older descriptors): SD's `[128, 256, 512, 512]`.
    #[serde(default)]
    pub vae_block_out_channels: Vec<u64>,
    /// The VAE's `layers_per_block` (its decoder has one more ResNet per level). 0: SD's 2.
    #[serde(default)]
    pub vae_layers_per_block: u64,
}

impl DiffusionDescriptor {
    /// All LoRA-targetable sites of the UNet and text encoders (diffusers naming). UNet attention
    /// and feed-forward linears (`attn1.to_q`, …, `ff.net.0.proj`, `ff.net.2`, `proj_in`,
    /// `proj_out`), ResNet convs (`resnets.conv1`, `resnets.conv2`, conv sites), and text-encoder
    /// `self_attn.{q,k,v,out}_proj`, `mlp.fc1`, `mlp.fc2`.
    ///
    /// Up-block ResNets take the concatenated skip input; their `conv1` input is approximated as
    /// `2c` channels (exact values vary per block by at most a factor 1.5).
    pub fn sites(&self) -> Vec<LinearSite> {
        let mut out: Vec<LinearSite> = Vec::new();
        let mut push = |name: &str, comp: &str, i: u64, o: u64, k: u64, n: u64, conv: bool| {
            if n == 0 {
                return;
            }
            if let Some(s) = out.iter_mut().find(|s| {
                s.name == name
                    && s.component == comp
                    && s.in_features == i
                    && s.out_features == o
                    && s.kernel_area == k
            }) {
                s.count += n;
            } else {
                out.push(LinearSite {
                    name: name.into(),
                    component: comp.into(),
                    in_features: i,
                    out_features: o,
                    kernel_area: k,
                    count: n,
                    conv,
                });
            }
        };
        let ctx = self.cross_attention_dim;
        let nlev = self.levels.len();
        for (i, lv) in self.levels.iter().enumerate() {
            let c = lv.channels;
            let is_last = i + 1 == nlev;
            let mid = if is_last {
                self.mid_transformer_depth
            } else {
                0
            };
            let down_blocks = lv.resnets * lv.transformer_depth;
            let up_blocks = (lv.resnets + 1) * lv.transformer_depth;
            let blocks = down_blocks + up_blocks + mid;
            let t2d = if lv.transformer_depth > 0 {
                2 * lv.resnets + 1
            } else {
                0
            } + u64::from(mid > 0);
            for n in [
                "attn1.to_q",
                "attn1.to_k",
                "attn1.to_v",
                "attn1.to_out.0",
                "attn2.to_q",
                "attn2.to_out.0",
            ] {
                push(n, "unet", c, c, 1, blocks, false);
            }
            push("attn2.to_k", "unet", ctx, c, 1, blocks, false);
            push("attn2.to_v", "unet", ctx, c, 1, blocks, false);
            push("ff.net.0.proj", "unet", c, 8 * c, 1, blocks, false);
            push("ff.net.2", "unet", 4 * c, c, 1, blocks, false);
            push("proj_in", "unet", c, c, 1, t2d, false);
            push("proj_out", "unet", c, c, 1, t2d, false);
            let mid_res = if is_last { 2 } else { 0 };
            push("resnets.conv1", "unet", c, c, 9, lv.resnets + mid_res, true);
            push("resnets.conv1", "unet", 2 * c, c, 9, lv.resnets + 1, true);
            push(
                "resnets.conv2",
                "unet",
                c,
                c,
                9,
                2 * lv.resnets + 1 + mid_res,
                true,
            );
            push(
                "resnets.time_emb_proj",
                "unet",
                4 * self.levels[0].channels,
                c,
                1,
                2 * lv.resnets + 1 + mid_res,
                false,
            );
        }
        for te in &self.text_encoders {
            let h = te.hidden;
            for n in [
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.out_proj",
            ] {
                push(n, &te.name, h, h, 1, te.layers, false);
            }
            push("mlp.fc1", &te.name, h, te.intermediate, 1, te.layers, false);
            push("mlp.fc2", &te.name, te.intermediate, h, 1, te.layers, false);
        }
        out
    }

    /// Text-encoder parameters, all encoders.
    pub fn text_encoder_params(&self) -> u64 {
        self.text_encoders.iter().map(|t| t.params).sum()
    }
}

/// The preset names accepted by [`ModelDescriptor::preset`] (case-insensitive; `-`, `_`, `.` and
/// spaces are ignored when matching).
pub const PRESET_NAMES: &[&str] = &[
    "SmolLM2-135M",
    "SmolLM2-360M",
    "SmolLM2-1.7B",
    "Llama-2-7B",
    "Llama-2-13B",
    "Llama-2-70B",
    "Llama-3.1-8B",
    "Llama-3.1-70B",
    "Llama-3.2-1B",
    "Llama-3.2-3B",
    "Mistral-7B",
    "Qwen2.5-0.5B",
    "Qwen2.5-7B",
    "Qwen2.5-14B",
    "bloomz-7b1",
    "Qwen3-8B",
    "Qwen3-32B",
    "Qwen-14B",
    "bert-large-uncased",
    "SD1.5",
    "SDXL",
    "FLUX.1-dev",
    "FLUX.1-schnell",
];

fn normalize(name: &str) -> String {
    name.chars()
        .filter(|c| c.is_ascii_alphanumeric())
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

fn clip_l() -> TextEncoderDescriptor {
    // CLIP ViT-L/14 text model (openai/clip-vit-large-patch14): 12 layers, width 768, MLP 3072.
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

impl DiffusionDescriptor {
    /// The VAE decoder's shape: `block_out_channels` (deepest last) and ResNets per decoder
    /// level (`layers_per_block + 1`); SD's VAE when the descriptor does not say.
    pub fn vae_decoder_shape(&self) -> (Vec<u64>, u64) {
        decoder_shape(&self.vae_block_out_channels, self.vae_layers_per_block)
    }
}

fn sd15() -> DiffusionDescriptor {
    // diffusers UNet2DConditionModel config of runwayml/stable-diffusion-v1-5: block_out_channels
    // [320, 640, 1280, 1280], layers_per_block 2, attention_head_dim 8 (= 8 heads),
    // cross_attention_dim 768; 859,520,964 UNet params; AutoencoderKL 83,653,863 params.
    let lv = |c, t| UnetLevel {
        channels: c,
        resnets: 2,
        transformer_depth: t,
        heads: 8,
    };
    DiffusionDescriptor {
        name: "SD1.5".into(),
        family: DiffusionFamily::Sd1,
        unet_params: 859_520_964,
        levels: vec![lv(320, 1), lv(640, 1), lv(1280, 1), lv(1280, 0)],
        mid_transformer_depth: 1,
        cross_attention_dim: 768,
        text_encoders: vec![clip_l()],
        vae_params: 83_653_863,
        latent_channels: 4,
        vae_scale: 8,
        vae_block_out_channels: SD_VAE_CHANNELS.to_vec(),
        vae_layers_per_block: 2,
    }
}

fn sdxl() -> DiffusionDescriptor {
    // diffusers config of stabilityai/stable-diffusion-xl-base-1.0: block_out_channels
    // [320, 640, 1280], transformer_layers_per_block [1, 2, 10] (level 0 has no attention),
    // attention_head_dim [5, 10, 20] (head width 64), cross_attention_dim 2048;
    // 2,567,463,684 UNet params; text_encoder_2 = OpenCLIP ViT-bigG/14 text (694,659,840 params).
    DiffusionDescriptor {
        name: "SDXL".into(),
        family: DiffusionFamily::Sdxl,
        unet_params: 2_567_463_684,
        levels: vec![
            UnetLevel {
                channels: 320,
                resnets: 2,
                transformer_depth: 0,
                heads: 5,
            },
            UnetLevel {
                channels: 640,
                resnets: 2,
                transformer_depth: 2,
                heads: 10,
            },
            UnetLevel {
                channels: 1280,
                resnets: 2,
                transformer_depth: 10,
                heads: 20,
            },
        ],
        mid_transformer_depth: 10,
        cross_attention_dim: 2048,
        text_encoders: vec![
            clip_l(),
            TextEncoderDescriptor {
                name: "text_encoder_2".into(),
                params: 694_659_840,
                hidden: 1280,
                intermediate: 5120,
                layers: 32,
                heads: 20,
                max_tokens: 77,
            },
        ],
        vae_params: 83_653_863,
        latent_channels: 4,
        vae_scale: 8,
        vae_block_out_channels: SD_VAE_CHANNELS.to_vec(),
        vae_layers_per_block: 2,
    }
}

impl ModelDescriptor {
    /// A named preset (see [`PRESET_NAMES`]). Shapes are those of the models' published HF
    /// `config.json` files.
    ///
    /// # Errors
    /// [`Error::UnknownPreset`] listing the known names.
    ///
    /// ```
    /// let m = lora_memory::ModelDescriptor::preset("smollm2-135m").unwrap();
    /// assert_eq!(m.params(), 134_515_008);
    /// ```
    pub fn preset(name: &str) -> Result<ModelDescriptor> {
        #[allow(clippy::too_many_arguments)]
        fn d(
            name: &str,
            hidden: u64,
            intermediate: u64,
            layers: u64,
            heads: u64,
            kv_heads: u64,
            head_dim: u64,
            vocab: u64,
            tied: bool,
        ) -> Result<DecoderDescriptor> {
            DecoderDescriptor::builder(name)
                .hidden(hidden)
                .intermediate(intermediate)
                .layers(layers)
                .heads(heads)
                .kv_heads(kv_heads)
                .head_dim(head_dim)
                .vocab(vocab)
                .tied_embeddings(tied)
                .build()
        }
        let key = normalize(name);
        let m = match key.as_str() {
            "smollm2135m" | "smollm2135minstruct" => {
                d("SmolLM2-135M", 576, 1536, 30, 9, 3, 64, 49152, true)?
            }
            "smollm2360m" | "smollm2360minstruct" => {
                d("SmolLM2-360M", 960, 2560, 32, 15, 5, 64, 49152, true)?
            }
            "smollm217b" | "smollm217binstruct" => {
                d("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 64, 49152, true)?
            }
            "llama27b" | "llama27bhf" => {
                d("Llama-2-7B", 4096, 11008, 32, 32, 32, 128, 32000, false)?
            }
            "llama213b" | "llama213bhf" => {
                d("Llama-2-13B", 5120, 13824, 40, 40, 40, 128, 32000, false)?
            }
            "llama318b" | "metallama318b" | "llama318binstruct" => {
                d("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, false)?
            }
            "llama321b" | "metallama321b" => {
                d("Llama-3.2-1B", 2048, 8192, 16, 32, 8, 64, 128256, true)?
            }
            "llama323b" | "metallama323b" => {
                d("Llama-3.2-3B", 3072, 8192, 28, 24, 8, 128, 128256, true)?
            }
            "mistral7b" | "mistral7bv01" => {
                d("Mistral-7B", 4096, 14336, 32, 32, 8, 128, 32000, false)?
            }
            "qwen2505b" => with_bias(d("Qwen2.5-0.5B", 896, 4864, 24, 14, 2, 64, 151936, true)?),
            "qwen257b" => with_bias(d("Qwen2.5-7B", 3584, 18944, 28, 28, 4, 128, 152064, false)?),
            "qwen2514b" => with_bias(d(
                "Qwen2.5-14B",
                5120,
                13824,
                48,
                40,
                8,
                128,
                152064,
                false,
            )?),
            "qwen38b" => with_qk_norm(d("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, false)?),
            "qwen332b" => with_qk_norm(d("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, false)?),
            // Qwen (v1) 14B: hidden 5120, intermediate 27392/2 per SwiGLU half, 40 layers, c_attn bias.
            "qwen14b" => with_bias(d("Qwen-14B", 5120, 13696, 40, 40, 40, 128, 152064, false)?),
            "llama270b" | "llama270bhf" => {
                d("Llama-2-70B", 8192, 28672, 80, 64, 8, 128, 32000, false)?
            }
            // Llama 3.3 70B has the same shapes as 3.1.
            "llama3170b" | "metallama3170b" | "llama3370b" | "metallama3370b" => {
                d("Llama-3.1-70B", 8192, 28672, 80, 64, 8, 128, 128256, false)?
            }
            // BLOOM: one fused query_key_value with bias, LayerNorm, a 4h GELU MLP, ALiBi (no
            // position embeddings), tied embeddings.
            "bloomz7b1" | "bloom7b1" => DecoderDescriptor::builder("bloomz-7b1")
                .hidden(4096)
                .intermediate(16384)
                .layers(30)
                .heads(32)
                .vocab(250880)
                .tied_embeddings(true)
                .attention_bias(true)
                .gated_mlp(false)
                .fused_qkv(true)
                .norm(NormKind::LayerNorm)
                .build()?,
            "bertlargeuncased" | "bertlarge" => {
                let mut b = d(
                    "bert-large-uncased",
                    1024,
                    4096,
                    24,
                    16,
                    16,
                    64,
                    30522,
                    true,
                )?;
                b.gated_mlp = false;
                b.norm = NormKind::LayerNorm;
                b.attention_bias = true;
                b.position_embeddings = 512 + 2;
                b.exact_params = Some(335_141_888);
                b
            }
            "sd15" | "sdv15" | "stablediffusion15" | "stablediffusionv15" | "sd1" | "sdv14"
            | "sd14" => {
                return Ok(ModelDescriptor::Diffusion(sd15()));
            }
            "sdxl"
            | "sdxlbase"
            | "sdxlbase10"
            | "stablediffusionxl"
            | "stablediffusionxlbase10" => {
                return Ok(ModelDescriptor::Diffusion(sdxl()));
            }
            "flux1dev" | "fluxdev" | "flux" | "flux1" => {
                return Ok(ModelDescriptor::Flux(crate::flux::FluxDescriptor::dev()));
            }
            "flux1schnell" | "fluxschnell" => {
                return Ok(ModelDescriptor::Flux(crate::flux::FluxDescriptor::schnell()));
            }
            _ => {
                return Err(Error::UnknownPreset {
                    name: name.to_string(),
                    known: PRESET_NAMES.join(", "),
                });
            }
        };
        Ok(ModelDescriptor::Decoder(m))
    }

    /// Display name.
    pub fn name(&self) -> &str {
        match self {
            ModelDescriptor::Decoder(d) => &d.name,
            ModelDescriptor::Diffusion(d) => &d.name,
            ModelDescriptor::Flux(d) => &d.name,
        }
    }

    /// Total parameters: a decoder's; UNet + text encoders + VAE (Stable Diffusion); transformer
    /// + T5-XXL + CLIP-L + autoencoder (FLUX — the transformer alone is
    /// [`crate::FluxDescriptor::transformer_params`]).
    pub fn params(&self) -> u64 {
        match self {
            ModelDescriptor::Decoder(d) => d.params(),
            ModelDescriptor::Diffusion(d) => d.unet_params + d.text_encoder_params() + d.vae_params,
            ModelDescriptor::Flux(d) => {
                d.transformer_params + d.text_encoder_params() + d.vae_params
            }
        }
    }

    /// All LoRA-targetable sites.
    pub fn sites(&self) -> Vec<LinearSite> {
        match self {
            ModelDescriptor::Decoder(d) => d.sites(),
            ModelDescriptor::Diffusion(d) => d.sites(),
            ModelDescriptor::Flux(d) => d.sites(),
        }
    }

    /// Reads a LLaMA-family HF `config.json` (keys `model_type` — one of
    /// [`SUPPORTED_MODEL_TYPES`] —, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    /// `num_attention_heads`, optional `num_key_value_heads`, `head_dim`, `vocab_size`,
    /// `tie_word_embeddings`, `attention_bias`). A diffusers `UNet2DConditionModel` config maps
    /// to the SD1.5 or SDXL preset by its `cross_attention_dim`.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Json`], [`Error::Config`] naming the missing key (a missing
    /// `model_type` included: the error lists the supported types and the explicit generic
    /// choice), [`Error::UnsupportedArchitecture`] for other model types.
    pub fn from_hf_config_json(path: impl AsRef<Path>) -> Result<ModelDescriptor> {
        Self::read_hf_config(path.as_ref(), None)
    }

    /// [`ModelDescriptor::from_hf_config_json`] for a `config.json` without `model_type`, read as
    /// the type the caller chooses: one of [`SUPPORTED_MODEL_TYPES`], or [`GENERIC_DECODER`] for
    /// any LLaMA-shaped decoder. A file that states its type must state this one.
    ///
    /// # Errors
    /// As [`ModelDescriptor::from_hf_config_json`]; [`Error::Config`] when the file states another
    /// `model_type`.
    pub fn from_hf_config_json_as(
        path: impl AsRef<Path>,
        model_type: &str,
    ) -> Result<ModelDescriptor> {
        Self::read_hf_config(path.as_ref(), Some(model_type))
    }

    pub(crate) fn read_hf_config(path: &Path, as_type: Option<&str>) -> Result<ModelDescriptor> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|source| Error::Json {
            path: path.into(),
            source,
        })?;
        from_config_value(path, &v, as_type)
    }
}

fn with_bias(mut d: DecoderDescriptor) -> DecoderDescriptor {
    d.attention_bias = true;
    d
}

fn with_qk_norm(mut d: DecoderDescriptor) -> DecoderDescriptor {
    d.qk_norm = true;
    d
}

/// The HF `model_type` values read as LLaMA-family decoders.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama", "mistral", "qwen2", "qwen3", "smollm", "smollm3", "gemma", "phi3", "olmo",
];

/// The model type that reads any LLaMA-shaped `config.json` (RMSNorm, RoPE, SwiGLU, separate
/// q/k/v/o and gate/up/down linears) — only when chosen explicitly with
/// [`ModelDescriptor::from_hf_config_json_as`], never as a fallback.
pub const GENERIC_DECODER: &str = "generic";

pub(crate) fn from_config_value(
    path: &Path,
    v: &serde_json::Value,
    as_type: Option<&str>,
) -> Result<ModelDescriptor> {
    let get = |key: &str| -> Result<u64> {
        v.get(key)
            .and_then(|x| x.as_u64())
            .ok_or_else(|| Error::Config {
                path: path.into(),
                key: key.into(),
                reason:
                    "missing or not a non-negative integer; is this a LLaMA-family config.json?"
                        .into(),
            })
    };
    if v.get("_class_name").and_then(|x| x.as_str()) == Some("UNet2DConditionModel") {
        let ctx = v
            .get("cross_attention_dim")
            .and_then(|x| x.as_u64())
            .unwrap_or(0);
        return match ctx {
            768 => ModelDescriptor::preset("SD1.5"),
            2048 => ModelDescriptor::preset("SDXL"),
            other => Err(Error::UnsupportedArchitecture {
                path: path.into(),
                arch: format!("UNet2DConditionModel with cross_attention_dim {other}"),
                hint: "SD1.x (768) and SDXL (2048) UNets are described".into(),
            }),
        };
    }
    let found = match v.get("model_type") {
        None | Some(serde_json::Value::Null) => "",
        Some(serde_json::Value::String(t)) => t.as_str(),
        Some(other) => {
            return Err(Error::Config {
                path: path.into(),
                key: "model_type".into(),
                reason: format!("{other} is not a string (e.g. \"llama\")"),
            });
        }
    };
    // HF writes model types in lower case; a chosen type is read the same way
    let as_type = as_type.map(str::to_ascii_lowercase);
    let as_type = as_type.as_deref();
    let model_type = match (found, as_type) {
        (f, Some(t)) if !f.is_empty() && f != t => {
            return Err(Error::Config {
                path: path.into(),
                key: "model_type".into(),
                reason: format!(
                    "the file says {f:?} but {t:?} was asked for; a model type is chosen only \
                     for a config.json without one"
                ),
            });
        }
        (_, Some(t)) => t.to_string(),
        ("", None) => {
            return Err(Error::Config {
                path: path.into(),
                key: "model_type".into(),
                reason: format!(
                    "missing, so the architecture is unknown; supported: {}. If this is a \
                     LLaMA-shaped decoder (RMSNorm, RoPE, SwiGLU q/k/v/o + gate/up/down), choose \
                     the generic decoder explicitly (model type {GENERIC_DECODER:?})",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            });
        }
        (t, None) => t.to_string(),
    };
    if model_type != GENERIC_DECODER && !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
        return Err(Error::UnsupportedArchitecture {
            path: path.into(),
            arch: model_type,
            hint: format!(
                "LLaMA-family decoders ({}) are described, and any LLaMA-shaped decoder as the \
                 generic decoder ({GENERIC_DECODER:?}) when chosen explicitly",
                SUPPORTED_MODEL_TYPES.join(", ")
            ),
        });
    }
    let hidden = get("hidden_size")?;
    let heads = get("num_attention_heads")?;
    if heads == 0 || hidden == 0 {
        return Err(Error::Config {
            path: path.into(),
            key: "num_attention_heads".into(),
            reason: "must be positive".into(),
        });
    }
    let name = v
        .get("_name_or_path")
        .and_then(|x| x.as_str())
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .unwrap_or_else(|| path.display().to_string());
    let mut b = DecoderDescriptor::builder(&name)
        .hidden(hidden)
        .intermediate(get("intermediate_size")?)
        .layers(get("num_hidden_layers")?)
        .heads(heads)
        .vocab(get("vocab_size")?)
        .tied_embeddings(
            v.get("tie_word_embeddings")
                .and_then(|x| x.as_bool())
                // transformers' GemmaConfig ties by default, the others do not
                .unwrap_or(model_type == "gemma"),
        )
        .attention_bias(
            v.get("attention_bias")
                .and_then(|x| x.as_bool())
                .unwrap_or(model_type == "qwen2"),
        )
        .qk_norm(model_type == "qwen3")
        // Phi-3 keeps q/k/v in one `qkv_proj` and gate/up in one `gate_up_proj`
        // (transformers `modeling_phi3.py`).
        .fused_qkv(model_type == "phi3")
        .fused_gate_up(model_type == "phi3");
    // optional keys: absent (or null) = derived; anything but a non-negative integer is an error
    let opt = |key: &str| -> Result<Option<u64>> {
        match v.get(key) {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(Some).ok_or_else(|| Error::Config {
                path: path.into(),
                key: key.into(),
                reason: format!("{x} is not a non-negative integer"),
            }),
        }
    };
    if let Some(kv) = opt("num_key_value_heads")? {
        b = b.kv_heads(kv);
    }
    let head_dim = opt("head_dim")?;
    if let Some(hd) = head_dim {
        b = b.head_dim(hd);
    }
    b.build().map(ModelDescriptor::Decoder).map_err(|e| match e {
        Error::InvalidDescriptor { field, reason, .. } => {
            let key = match field {
                "hidden" => "hidden_size",
                "intermediate" => "intermediate_size",
                "layers" => "num_hidden_layers",
                "heads" => "num_attention_heads",
                "kv_heads" => "num_key_value_heads",
                "vocab" => "vocab_size",
                "head_dim" if head_dim.is_none() => {
                    return Error::Config {
                        path: path.into(),
                        key: "num_attention_heads".into(),
                        reason: format!(
                            "hidden_size {hidden} / num_attention_heads {heads} gives a head_dim of 0"
                        ),
                    };
                }
                other => other,
            };
            Error::Config {
                path: path.into(),
                key: key.into(),
                reason,
            }
        }
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dec(name: &str) -> DecoderDescriptor {
        match ModelDescriptor::preset(name).unwrap() {
            ModelDescriptor::Decoder(d) => d,
            _ => panic!("not a decoder"),
        }
    }

    #[test]
    fn preset_parameter_counts_match_the_published_models() {
        // Published totals (HF model cards / safetensors index metadata), within 0.5 %.
        let cases: &[(&str, u64)] = &[
            ("SmolLM2-135M", 134_515_008),
            ("SmolLM2-360M", 361_821_120),
            ("SmolLM2-1.7B", 1_711_376_384),
            ("Llama-2-7B", 6_738_415_616),
            ("Llama-2-13B", 13_015_864_320),
            ("Llama-3.1-8B", 8_030_261_248),
            ("Llama-3.2-1B", 1_235_814_400),
            ("Llama-3.2-3B", 3_212_749_824),
            ("Mistral-7B", 7_241_732_096),
            ("Qwen2.5-0.5B", 494_032_768),
            ("Qwen2.5-7B", 7_615_616_512),
            ("Qwen2.5-14B", 14_770_033_664),
            ("Qwen3-8B", 8_190_735_360),
            ("Qwen3-32B", 32_762_123_264),
            ("Qwen-14B", 14_167_290_880),
            ("Llama-2-70B", 68_976_648_192),
            ("Llama-3.1-70B", 70_553_706_496),
            ("Llama-3.3-70B", 70_553_706_496),
            ("bloomz-7b1", 7_069_016_064),
        ];
        for (name, want) in cases {
            let got = dec(name).params();
            let rel = (got as f64 - *want as f64).abs() / *want as f64;
            assert!(rel < 0.005, "{name}: {got} vs {want} ({rel})");
        }
        assert_eq!(dec("smollm2_135m").params(), 134_515_008);
    }

    #[test]
    fn unknown_preset_lists_known_names() {
        let e = ModelDescriptor::preset("gpt-5").unwrap_err().to_string();
        assert!(
            e.contains("gpt-5") && e.contains("Llama-3.1-8B") && e.contains("SDXL"),
            "{e}"
        );
    }

    #[test]
    fn lora_param_counts_follow_r_times_in_plus_out() {
        let d = dec("Llama-2-7B");
        let sites = d.sites();
        let q = sites.iter().find(|s| s.matches("q_proj")).unwrap();
        assert_eq!(q.lora_params(8), 8 * (4096 + 4096));
        assert_eq!(q.count, 32);
        assert!(
            !sites
                .iter()
                .any(|s| s.matches("all-linear") && s.name == "lm_head")
        );
        assert!(!q.matches("proj"));
    }

    #[test]
    fn diffusion_sites_cover_attention_and_convs() {
        let m = ModelDescriptor::preset("SD1.5").unwrap();
        let sites = m.sites();
        let to_k: u64 = sites
            .iter()
            .filter(|s| s.component == "unet" && s.name == "attn2.to_k")
            .map(|s| s.count)
            .sum();
        assert_eq!(to_k, 16, "SD1.5 has 16 transformer blocks");
        let sdxl = ModelDescriptor::preset("sdxl").unwrap();
        let blocks: u64 = sdxl
            .sites()
            .iter()
            .filter(|s| s.name == "attn1.to_q")
            .map(|s| s.count)
            .sum();
        assert_eq!(blocks, 70, "SDXL has 70 transformer blocks");
        // Attention + ff weight params of SD1.5's UNet transformer blocks: a real fraction of the UNet.
        let attn: u64 = sites
            .iter()
            .filter(|s| s.component == "unet" && !s.conv)
            .map(|s| s.weight_params() * s.count)
            .sum();
        assert!(attn > 150_000_000 && attn < 859_520_964, "{attn}");
    }

    #[test]
    fn hf_config_json_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"model_type":"llama","hidden_size":576,"intermediate_size":1536,"num_hidden_layers":30,
               "num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,"tie_word_embeddings":true}"#,
        )
        .unwrap();
        assert_eq!(
            ModelDescriptor::from_hf_config_json(&p).unwrap().params(),
            134_515_008
        );
        std::fs::write(&p, r#"{"model_type":"llama","hidden_size":576}"#).unwrap();
        let e = ModelDescriptor::from_hf_config_json(&p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("num_attention_heads") || e.contains("intermediate_size"),
            "{e}"
        );
        std::fs::write(&p, r#"{"model_type":"t5"}"#).unwrap();
        assert!(matches!(
            ModelDescriptor::from_hf_config_json(&p),
            Err(Error::UnsupportedArchitecture { .. })
        ));
    }

    #[test]
    fn a_config_without_model_type_is_refused_unless_the_generic_decoder_is_chosen() {
        // phi-1.5's shapes (1.42B params: LayerNorm, a two-matrix MLP): read as LLaMA they would
        // become 1.82B, so a missing model_type is an error naming what is supported.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":24,
               "num_attention_heads":32,"vocab_size":51200}"#,
        )
        .unwrap();
        let e = ModelDescriptor::from_hf_config_json(&p)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model_type") && e.contains("llama") && e.contains(GENERIC_DECODER),
            "{e}"
        );
        let g = ModelDescriptor::from_hf_config_json_as(&p, GENERIC_DECODER).unwrap();
        // a chosen type is read in lower case, as HF writes them
        assert_eq!(
            ModelDescriptor::from_hf_config_json_as(&p, "Generic").unwrap(),
            g
        );
        assert_eq!(
            g.params(),
            2 * 51200 * 2048 + 24 * (4 * 2048 * 2048 + 3 * 2048 * 8192 + 2 * 2048) + 2048
        );
        let e = ModelDescriptor::from_hf_config_json_as(&p, "phi")
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"phi\"") && e.contains("mistral"), "{e}");
        let text = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, text.replacen('{', r#"{"model_type":3,"#, 1)).unwrap();
        let e = ModelDescriptor::from_hf_config_json(&p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a string"), "{e}");
        // a file that states its type keeps it
        std::fs::write(
            &p,
            r#"{"model_type":"t5","hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
               "num_attention_heads":1,"vocab_size":8}"#,
        )
        .unwrap();
        let e = ModelDescriptor::from_hf_config_json_as(&p, GENERIC_DECODER)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"t5\"") && e.contains("without one"), "{e}");
    }

    #[test]
    fn bad_config_numbers_are_errors_naming_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        let base = r#""model_type":"llama","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,"vocab_size":100"#;
        for (extra, key) in [
            (r#","num_key_value_heads":-8"#, "num_key_value_heads"),
            (r#","num_key_value_heads":8.0"#, "num_key_value_heads"),
            (r#","head_dim":"64""#, "head_dim"),
            (r#","num_key_value_heads":3"#, "num_key_value_heads"),
            (r#","head_dim":0"#, "head_dim"),
        ] {
            std::fs::write(&p, format!("{{{base}{extra}}}")).unwrap();
            let e = ModelDescriptor::from_hf_config_json(&p)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("{key:?}")), "{extra}: {e}");
        }
        std::fs::write(
            &p,
            format!(
                "{{{}}}",
                base.replace(r#""num_hidden_layers":2"#, r#""num_hidden_layers":0"#)
            ),
        )
        .unwrap();
        let e = ModelDescriptor::from_hf_config_json(&p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("\"num_hidden_layers\""), "{e}");
        // shapes whose count overflows are refused, never a panic
        let huge = r#"{"model_type":"llama","hidden_size":4294967296,"intermediate_size":8,"num_hidden_layers":4294967296,"num_attention_heads":1,"vocab_size":4294967296}"#;
        std::fs::write(&p, huge).unwrap();
        let e = ModelDescriptor::from_hf_config_json(&p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("implausibly large"), "{e}");
        let e = DecoderDescriptor::builder("big")
            .hidden(1 << 30)
            .intermediate(8)
            .layers(1 << 20)
            .heads(1)
            .vocab(1 << 30)
            .build()
            .unwrap_err()
            .to_string();
        assert!(e.contains("parameters"), "{e}");
        let raw = DecoderDescriptor {
            layers: u64::MAX,
            ..dec("SmolLM2-135M")
        };
        assert_eq!(raw.computed_params(), u64::MAX);
    }

    #[test]
    fn phi3_configs_have_fused_projections() {
        // Phi-3-mini-4k-instruct config.json: 3.82B parameters.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("config.json");
        std::fs::write(
            &p,
            r#"{"model_type":"phi3","hidden_size":3072,"intermediate_size":8192,
               "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,
               "vocab_size":32064,"tie_word_embeddings":false}"#,
        )
        .unwrap();
        let ModelDescriptor::Decoder(d) = ModelDescriptor::from_hf_config_json(&p).unwrap() else {
            panic!("a decoder")
        };
        assert_eq!(d.params(), 3_821_079_552);
        let names: Vec<String> = d.layer_sites().into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "self_attn.qkv_proj",
                "self_attn.o_proj",
                "mlp.gate_up_proj",
                "mlp.down_proj"
            ]
        );
        let qkv = &d.layer_sites()[0];
        assert_eq!((qkv.in_features, qkv.out_features), (3072, 3 * 3072));
    }

    #[test]
    fn the_builder_derives_defaults_recomputes_and_validates() {
        let d = dec("Llama-2-7B");
        assert_eq!(d.params(), d.computed_params());
        let wider = d
            .to_builder()
            .intermediate(2 * d.intermediate)
            .build()
            .unwrap();
        let mlp = 3 * d.hidden * d.intermediate * d.layers;
        assert_eq!(wider.params(), d.params() + mlp);
        // A count a file stated survives a rename but not a shape change.
        let exact = d.to_builder().exact_params(7).name("x").build().unwrap();
        assert_eq!(exact.params(), 7);
        assert_eq!(
            exact.to_builder().layers(2).build().unwrap().exact_params,
            None
        );
        let m = DecoderDescriptor::builder("m")
            .hidden(64)
            .layers(2)
            .heads(4)
            .vocab(10);
        let built = m.clone().build().unwrap();
        assert_eq!(
            (built.kv_heads, built.head_dim, built.intermediate),
            (4, 16, 256)
        );
        let e = m.clone().kv_heads(3).build().unwrap_err().to_string();
        assert!(e.contains("kv_heads") && e.contains("\"m\""), "{e}");
        let e = DecoderDescriptor::builder("z")
            .hidden(8)
            .heads(2)
            .vocab(4)
            .build();
        assert!(e.unwrap_err().to_string().contains("layers"));
        // Old JSON (with `params`) still reads; the count is kept as the exact one.
        let mut j = serde_json::to_value(&d).unwrap();
        j.as_object_mut().unwrap().remove("fused_qkv");
        j["params"] = serde_json::json!(123);
        let back: DecoderDescriptor = serde_json::from_value(j).unwrap();
        assert_eq!(back.params(), 123);
    }
}
