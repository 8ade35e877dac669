//! The T5 encoder (Raffel et al. 2020, "Exploring the Limits of Transfer Learning with a Unified
//! Text-to-Text Transformer", arXiv:1910.10683; v1.1's gated-GELU feed-forward) as transformers
//! implements it in `models/t5/modeling_t5.py` (`T5EncoderModel`, 5.24):
//! token embedding (`shared`), pre-norm blocks of bidirectional self-attention with a learned
//! relative position bias and a (gated) feed-forward layer, RMS norms without bias or mean
//! (`T5LayerNorm`), and a final norm. No absolute positions, no scaling of attention scores.

use std::collections::HashMap;
use std::path::Path;

use lora_core::inject::{Adaptable, SiteMut};
use lora_core::linear::LoraLinear;
use lora_core::sys::tensor_bytes;
use tch::{Device, Kind, Tensor};

use super::config::{T5Activation, T5Config};
use crate::clip::{linear_bytes, linear_numel};
use crate::error::{Error, Result};
use crate::llama::RmsNorm;
use crate::weights::{SafetensorsFiles, Site, TensorMap, TensorSource, Visitor, WeightPath};

/// The most negative finite value of `kind` (torch `finfo(dtype).min`), what transformers adds
/// to the scores of padded keys.
fn finfo_min(kind: Kind) -> f64 {
    match kind {
        Kind::Half => -65504.0,
        Kind::BFloat16 => -3.389_531_389_251_535_5e38,
        Kind::Double => f64::MIN,
        _ => f64::from(f32::MIN),
    }
}

/// transformers `T5Attention._relative_position_bucket` for the bidirectional encoder: the
/// bucket `[q, k]` int64 of every relative position `k − q`. Half of the buckets are for
/// positive offsets; within a half, offsets below `num_buckets / 4` get a bucket each and larger
/// ones share logarithmically wider buckets up to `max_distance`, beyond which all fall into the
/// last. The logarithm is taken in f32 with libtorch's ops, as transformers does, so that
/// offsets on a bucket boundary (16, 32, 64 for T5's 32 buckets and distance 128) round alike.
///
/// # Errors
/// [`Error::Torch`] when an op fails.
pub fn relative_position_buckets(
    q_len: i64,
    k_len: i64,
    num_buckets: i64,
    max_distance: i64,
    device: Device,
) -> Result<Tensor> {
    let ctx = Tensor::f_arange(q_len, (Kind::Int64, device))?.f_unsqueeze(1)?;
    let mem = Tensor::f_arange(k_len, (Kind::Int64, device))?.f_unsqueeze(0)?;
    let rel = mem.f_sub(&ctx)?; // [q, k]
    let half = num_buckets / 2;
    let base = rel.f_gt(0)?.f_to_kind(Kind::Int64)?.f_mul_scalar(half)?;
    let rel = rel.f_abs()?;
    let max_exact = half / 2;
    let is_small = rel.f_lt(max_exact)?;
    let large = rel
        .f_to_kind(Kind::Float)?
        .f_div_scalar(max_exact as f64)?
        .f_log()?
        .f_div_scalar((max_distance as f64 / max_exact as f64).ln())?
        .f_mul_scalar((half - max_exact) as f64)?
        .f_to_kind(Kind::Int64)?
        .f_add_scalar(max_exact)?
        .f_clamp_max(half - 1)?;
    Ok(base.f_add(&rel.f_where_self(&is_small, &large)?)?)
}

/// `T5Attention` of the encoder: q/k/v/o without bias, scores `q·kᵀ` unscaled plus the position
/// bias (and the padding mask).
#[derive(Debug)]
struct SelfAttention {
    q: Site<LoraLinear>,
    k: Site<LoraLinear>,
    v: Site<LoraLinear>,
    o: Site<LoraLinear>,
    n_heads: i64,
    d_kv: i64,
}

impl SelfAttention {
    /// `x` `[b, s, D]`, `bias` `[b or 1, heads, s, s]` → `[b, s, D]`.
    fn forward(&self, x: &Tensor, bias: &Tensor, train: bool) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let heads = |t: Tensor| -> Result<Tensor> {
            Ok(t.f_view([b, s, self.n_heads, self.d_kv])?
                .f_transpose(1, 2)?)
        };
        let q = heads(self.q.forward_t(x, train)?)?;
        let k = heads(self.k.forward_t(x, train)?)?;
        let v = heads(self.v.forward_t(x, train)?)?;
        // softmax(q·kᵀ + bias) · v: T5 folds the 1/√d_kv into its initialisation (scale 1)
        let y =
            Tensor::f_scaled_dot_product_attention(&q, &k, &v, Some(bias), 0.0, false, 1.0, false)?;
        let y = y
            .f_transpose(1, 2)?
            .f_reshape([b, s, self.n_heads * self.d_kv])?;
        Ok(self.o.forward_t(&y, train)?)
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        self.q.visit(f)?;
        self.k.visit(f)?;
        self.v.visit(f)?;
        self.o.visit(f)
    }

    fn linears(&self) -> [&LoraLinear; 4] {
        [&self.q, &self.k, &self.v, &self.o]
    }
}

/// `T5DenseGatedActDense` (`wo(act(wi_0(x)) · wi_1(x))`) or `T5DenseActDense`
/// (`wo(act(wi(x)))`), no biases.
#[derive(Debug)]
enum FeedForward {
    Gated {
        wi_0: Site<LoraLinear>,
        wi_1: Site<LoraLinear>,
        wo: Site<LoraLinear>,
        act: T5Activation,
    },
    Plain {
        wi: Site<LoraLinear>,
        wo: Site<LoraLinear>,
        act: T5Activation,
    },
}

fn activate(h: &Tensor, act: T5Activation) -> Result<Tensor> {
    Ok(match act {
        T5Activation::Relu => h.f_relu()?,
        T5Activation::Gelu => h.f_gelu("none")?,
        T5Activation::GeluTanh => h.f_gelu("tanh")?,
        T5Activation::Silu => h.f_silu()?,
    })
}

impl FeedForward {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        match self {
            Self::Gated {
                wi_0,
                wi_1,
                wo,
                act,
            } => {
                let g = activate(&wi_0.forward_t(x, train)?, *act)?;
                let h = g.f_mul(&wi_1.forward_t(x, train)?)?;
                Ok(wo.forward_t(&h, train)?)
            }
            Self::Plain { wi, wo, act } => {
                let h = activate(&wi.forward_t(x, train)?, *act)?;
                Ok(wo.forward_t(&h, train)?)
            }
        }
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        match self {
            Self::Gated { wi_0, wi_1, wo, .. } => {
                wi_0.visit(f)?;
                wi_1.visit(f)?;
                wo.visit(f)
            }
            Self::Plain { wi, wo, .. } => {
                wi.visit(f)?;
                wo.visit(f)
            }
        }
    }

    fn linears(&self) -> Vec<&LoraLinear> {
        match self {
            Self::Gated { wi_0, wi_1, wo, .. } => vec![wi_0, wi_1, wo],
            Self::Plain { wi, wo, .. } => vec![wi, wo],
        }
    }
}

/// `T5Block` of the encoder: `h = x + attn(norm0(x))`, then `h + ff(norm1(h))`; in f16 each
/// residual sum is clamped as transformers does ("clamp inf values to enable fp16 training").
#[derive(Debug)]
struct Block {
    attn: SelfAttention,
    attn_norm: RmsNorm,
    ff: FeedForward,
    ff_norm: RmsNorm,
}

/// transformers `T5Block`'s f16 guard: clamp to `±(65504 − 1000)` when a value overflowed to
/// ±inf, else to `±65504`.
fn clamp_f16(h: Tensor) -> Result<Tensor> {
    if h.kind() != Kind::Half {
        return Ok(h);
    }
    let any_inf = h.f_isinf()?.f_any()?.f_int64_value(&[])? != 0;
    let v = if any_inf { 65504.0 - 1000.0 } else { 65504.0 };
    Ok(h.f_clamp(-v, v)?)
}

impl Block {
    fn forward(&self, x: &Tensor, bias: &Tensor, train: bool) -> Result<Tensor> {
        let a = self
            .attn
            .forward(&self.attn_norm.forward(x)?, bias, train)?;
        let h = clamp_f16(x.f_add(&a)?)?;
        let m = self.ff.forward(&self.ff_norm.forward(&h)?, train)?;
        clamp_f16(h.f_add(&m)?)
    }
}

/// transformers `T5EncoderModel`: the text encoder of FLUX.1 (T5 v1.1 XXL, `text_encoder_2`),
/// of SD3 and of PixArt, whose every linear layer is a LoRA site.
///
/// Weight names (transformers' `model.safetensors` of a `T5EncoderModel`; ComfyUI's and kohya's
/// single file `t5xxl_fp16.safetensors` has the same names):
/// `shared.weight` `[vocab, D]` (a file may hold it as `encoder.embed_tokens.weight` instead,
/// the tied copy, or both),
/// `encoder.block.N.layer.0.SelfAttention.{q,k,v,o}.weight`,
/// `encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight`
/// `[relative_attention_num_buckets, num_heads]` (block 0 only: every block shares its bias),
/// `encoder.block.N.layer.0.layer_norm.weight`,
/// `encoder.block.N.layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight` (gated; `wi` and `wo` for a
/// plain feed-forward), `encoder.block.N.layer.1.layer_norm.weight`,
/// `encoder.final_layer_norm.weight`.
///
/// LoRA sites are named as those modules (`encoder.block.0.layer.0.SelfAttention.q`,
/// `encoder.block.0.layer.1.DenseReluDense.wi_0`, …), so PEFT keys and kohya's
/// `lora_te3_encoder_block_0_layer_0_SelfAttention_q` map 1:1 (kohya sd-scripts
/// `networks/lora_flux.py` targets the linear layers of `T5Attention` and
/// `T5DenseGatedActDense`, exactly these sites). FLUX LoRA training normally
/// keeps T5 frozen; the sites are there for the runs that do not.
///
/// # Shapes
/// ids `[batch, seq]` int64 (any length: positions are relative), mask `[batch, seq]` (1 = token,
/// 0 = padding) → `[batch, seq, D]` in the model dtype. Held per block: `[batch, seq, D]`
/// (residual), `[batch, heads, seq, d_kv]` ×3 (q, k, v), the bias `[batch, heads, seq, seq]`
/// (shared by all blocks) and `[batch, seq, d_ff]` ×2 (gated feed-forward).
#[derive(Debug)]
pub struct T5EncoderModel {
    config: T5Config,
    shared: Tensor,
    relative_attention_bias: Tensor,
    blocks: Vec<Block>,
    final_layer_norm: RmsNorm,
    kind: Kind,
    device: Device,
}

impl T5EncoderModel {
    /// Loads a transformers folder (FLUX's `text_encoder_2/`): `config.json` plus
    /// `model.safetensors` or the shards of `model.safetensors.index.json`, memory-mapped and
    /// converted once to `kind` (f32, f16 or bf16) on `device`.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Config`] for the folder's files, [`Error::Safetensors`] for a
    /// bad header, [`Error::MissingTensor`] / [`Error::Shape`] when the weights do not fit.
    pub fn from_pretrained(dir: impl AsRef<Path>, kind: Kind, device: Device) -> Result<Self> {
        let dir = dir.as_ref();
        let config = T5Config::from_file(dir.join("config.json"))?;
        let src = SafetensorsFiles::open_dir(dir, "model", device)?;
        Self::build(config, &src, kind, device)
    }

    /// Loads a single safetensors file with transformers' key names and no config (ComfyUI's
    /// `t5xxl_fp16.safetensors`, kohya's `t5xxl_fp16.safetensors`): `config` is normally
    /// [`T5Config::t5_xxl`].
    ///
    /// # Errors
    /// As [`Self::from_pretrained`].
    pub fn from_single_file(
        path: impl AsRef<Path>,
        config: T5Config,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let path = path.as_ref();
        let src = SafetensorsFiles::open(&[path.to_path_buf()], path, device)?;
        Self::build(config, &src, kind, device)
    }

    /// Builds the model from tensors in memory named as transformers names them.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] / [`Error::Shape`] when the map does not fit `config`.
    pub fn from_tensors(
        config: T5Config,
        tensors: &HashMap<String, Tensor>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        Self::build(config, &TensorMap::new(tensors, device), kind, device)
    }

    /// Builds the model from `src` (transformers names) in dtype `kind` on `device`.
    ///
    /// # Errors
    /// [`Error::Config`]-like [`Error::Unsupported`] for an unknown activation;
    /// [`Error::MissingTensor`] / [`Error::Shape`] when the weights do not fit `config`.
    pub fn build(
        config: T5Config,
        src: &dyn TensorSource,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let act = config.activation()?;
        let (d, inner, ff) = (config.d_model, config.inner_dim(), config.d_ff);
        let eps = config.layer_norm_epsilon;
        let root = WeightPath::new(src, "", kind);
        // the embedding is tied: transformers writes one of the two names (or both)
        let shared = if root.pp("shared").contains("weight")
            || !root.pp("encoder").pp("embed_tokens").contains("weight")
        {
            root.pp("shared").get("weight", &[config.vocab_size, d])?
        } else {
            root.pp("encoder")
                .pp("embed_tokens")
                .get("weight", &[config.vocab_size, d])?
        };
        let enc = root.pp("encoder");
        let norm = |p: &WeightPath<'_>| -> Result<RmsNorm> {
            Ok(RmsNorm {
                weight: p.get("weight", &[d])?,
                eps,
            })
        };
        let relative_attention_bias = enc
            .pp("block.0.layer.0.SelfAttention.relative_attention_bias")
            .get(
                "weight",
                &[config.relative_attention_num_buckets, config.num_heads],
            )?;
        let mut blocks = Vec::with_capacity(config.num_layers as usize);
        for i in 0..config.num_layers {
            let b = enc.pp("block").pp(i);
            let (l0, l1) = (b.pp("layer").pp(0), b.pp("layer").pp(1));
            let a = l0.pp("SelfAttention");
            let m = l1.pp("DenseReluDense");
            let ff_layer = if config.is_gated() {
                FeedForward::Gated {
                    wi_0: m.pp("wi_0").linear(d, ff, false)?,
                    wi_1: m.pp("wi_1").linear(d, ff, false)?,
                    wo: m.pp("wo").linear(ff, d, false)?,
                    act,
                }
            } else {
                FeedForward::Plain {
                    wi: m.pp("wi").linear(d, ff, false)?,
                    wo: m.pp("wo").linear(ff, d, false)?,
                    act,
                }
            };
            blocks.push(Block {
                attn: SelfAttention {
                    q: a.pp("q").linear(d, inner, false)?,
                    k: a.pp("k").linear(d, inner, false)?,
                    v: a.pp("v").linear(d, inner, false)?,
                    o: a.pp("o").linear(inner, d, false)?,
                    n_heads: config.num_heads,
                    d_kv: config.d_kv,
                },
                attn_norm: norm(&l0.pp("layer_norm"))?,
                ff: ff_layer,
                ff_norm: norm(&l1.pp("layer_norm"))?,
            });
        }
        let final_layer_norm = norm(&enc.pp("final_layer_norm"))?;
        Ok(Self {
            config,
            shared,
            relative_attention_bias,
            blocks,
            final_layer_norm,
            kind,
            device,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &T5Config {
        &self.config
    }

    /// The dtype weights and activations are in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Number of frozen parameters (equal to [`T5Config::encoder_param_count`]).
    pub fn num_params(&self) -> i64 {
        let mut n = (self.shared.numel()
            + self.relative_attention_bias.numel()
            + self.final_layer_norm.weight.numel()) as i64;
        for b in &self.blocks {
            n += b
                .attn
                .linears()
                .into_iter()
                .chain(b.ff.linears())
                .map(linear_numel)
                .sum::<i64>();
            n += (b.attn_norm.weight.numel() + b.ff_norm.weight.numel()) as i64;
        }
        n
    }

    /// Bytes held by the frozen weights (adapters not counted).
    pub fn weights_resident_bytes(&self) -> u64 {
        let mut n = tensor_bytes(&self.shared)
            + tensor_bytes(&self.relative_attention_bias)
            + self.final_layer_norm.bytes();
        for b in &self.blocks {
            n += b
                .attn
                .linears()
                .into_iter()
                .chain(b.ff.linears())
                .map(linear_bytes)
                .sum::<u64>();
            n += b.attn_norm.bytes() + b.ff_norm.bytes();
        }
        n
    }

    /// The position bias of every block, `[1, heads, q_len, k_len]` in the model dtype
    /// (transformers `T5Attention.compute_bias`).
    ///
    /// # Errors
    /// [`Error::Torch`] when an op fails.
    pub fn position_bias(&self, q_len: i64, k_len: i64) -> Result<Tensor> {
        let buckets = relative_position_buckets(
            q_len,
            k_len,
            self.config.relative_attention_num_buckets,
            self.config.relative_attention_max_distance,
            self.device,
        )?;
        let v = Tensor::f_embedding(&self.relative_attention_bias, &buckets, -1, false, false)?;
        Ok(v.f_permute([2, 0, 1])?.f_unsqueeze(0)?)
    }

    /// Encodes token ids `[batch, seq]` (int64) into `last_hidden_state` `[batch, seq, D]`
    /// (after `final_layer_norm`, in the model dtype); `attention_mask` `[batch, seq]` (1 or
    /// `true` = token, 0 = padding; any numeric or bool dtype) keeps padded keys out of every
    /// attention, as transformers adds `finfo(dtype).min` to their scores. Padded positions still
    /// get an output (transformers computes them too); FLUX pipelines pass no mask and use all
    /// 512 (dev) or 256 (schnell) positions. `train` turns LoRA dropout on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for mis-shaped ids or mask; [`Error::Torch`] (ids outside the
    /// vocabulary, out of memory, …).
    pub fn forward_t(
        &self,
        ids: &Tensor,
        attention_mask: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let sz = ids.size();
        if sz.len() != 2 || sz[1] == 0 || !matches!(ids.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::InvalidArgument(format!(
                "T5 input ids must be int64 [batch, seq] with seq ≥ 1, got {:?} {sz:?}",
                ids.kind()
            )));
        }
        let (b, s) = (sz[0], sz[1]);
        let ids = ids.f_to_device(self.device)?.f_to_kind(Kind::Int64)?;
        let mut bias = self.position_bias(s, s)?;
        if let Some(mask) = attention_mask {
            if mask.size() != [b, s] {
                return Err(Error::InvalidArgument(format!(
                    "T5 attention_mask must be [batch, seq] = [{b}, {s}] like the ids, got {:?}",
                    mask.size()
                )));
            }
            // (1 − mask) · finfo.min on the key axis: [b, 1, 1, s]
            let pad = mask
                .f_to_device(self.device)?
                .f_to_kind(Kind::Float)?
                .f_eq(0.0)?
                .f_view([b, 1, 1, s])?;
            let add = Tensor::f_zeros([b, 1, 1, s], (self.kind, self.device))?
                .f_masked_fill(&pad, finfo_min(self.kind))?;
            bias = bias.f_add(&add)?;
        }
        let mut h = Tensor::f_embedding(&self.shared, &ids, -1, false, false)?;
        for blk in &self.blocks {
            h = blk.forward(&h, &bias, train)?;
        }
        self.final_layer_norm.forward(&h)
    }
}

impl Adaptable for T5EncoderModel {
    fn visit_sites(
        &mut self,
        f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()>,
    ) -> lora_core::Result<()> {
        for b in &mut self.blocks {
            b.attn.visit(f)?;
            b.ff.visit(f)?;
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
    fn buckets_match_the_mesh_tensorflow_rule() {
        // T5's 32 buckets, distance 128: offsets 0..7 exact, then log-spaced up to 15 per side
        let b = relative_position_buckets(1, 200, 32, 128, Device::Cpu).unwrap();
        let v = Vec::<i64>::try_from(b.f_view([-1]).unwrap()).unwrap();
        // expected values from transformers 5.24
        // `T5Attention._relative_position_bucket(torch.arange(200)[None], True, 32, 128)`
        let at = [0, 1, 7, 8, 15, 16, 31, 32, 63, 64, 65, 100, 127, 128, 199];
        let expected = [0, 17, 23, 24, 25, 26, 27, 28, 29, 30, 30, 31, 31, 31, 31];
        for (i, e) in at.into_iter().zip(expected) {
            assert_eq!(v[i], e, "offset {i}");
        }
        // negative offsets use the lower half
        let b = relative_position_buckets(200, 1, 32, 128, Device::Cpu).unwrap();
        let v = Vec::<i64>::try_from(b.f_view([-1]).unwrap()).unwrap();
        assert_eq!(&v[..3], &[0, 1, 2]);
        assert_eq!(v[16], 10);
        assert_eq!(v[199], 15);
    }
}
