//! The CLIP text transformer (Radford et al. 2021, "Learning Transferable Visual Models From
//! Natural Language Supervision", arXiv:2103.00020) as transformers implements it in
//! `models/clip/modeling_clip.py` (`CLIPTextModel`, `CLIPTextModelWithProjection`):
//! token + learned position embeddings, pre-LayerNorm encoder layers with causal multi-head
//! attention and a 2-layer MLP, a final LayerNorm, and pooling at the end-of-text token.

use crate::weights::{Site, Visitor};
use std::collections::HashMap;
use std::path::Path;

use lora_core::inject::{Adaptable, SiteMut};
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use tch::{Device, Kind, Tensor};

use super::config::{ClipActivation, ClipTextConfig};
use crate::error::{Error, Result};
use crate::weights::{SafetensorsFiles, TensorMap, TensorSource, WeightPath};

use lora_core::sys::tensor_bytes;

/// `nn.LayerNorm(D, eps)` with weight and bias.
#[derive(Debug)]
struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn load(p: &WeightPath<'_>, d: i64, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: p.get("weight", &[d])?,
            bias: p.get("bias", &[d])?,
            eps,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let d = self.weight.size()[0];
        Ok(x.f_layer_norm([d], Some(&self.weight), Some(&self.bias), self.eps, true)?)
    }

    fn bytes(&self) -> u64 {
        tensor_bytes(&self.weight) + tensor_bytes(&self.bias)
    }

    fn numel(&self) -> i64 {
        (self.weight.numel() + self.bias.numel()) as i64
    }
}

pub(crate) fn linear_bytes(l: &LoraLinear) -> u64 {
    l.base().storage_bytes() + l.bias().map_or(0, tensor_bytes)
}

pub(crate) fn linear_numel(l: &LoraLinear) -> i64 {
    l.base().numel() + l.bias().map_or(0, |b| b.numel() as i64)
}

/// `CLIPAttention`: q/k/v/out projections with bias, scale `head_dim^-0.5`, causal mask.
#[derive(Debug)]
struct Attention {
    q_proj: Site<LoraLinear>,
    k_proj: Site<LoraLinear>,
    v_proj: Site<LoraLinear>,
    out_proj: Site<LoraLinear>,
    n_head: i64,
    head_dim: i64,
}

impl Attention {
    /// `x` `[b, s, d]` → `[b, s, d]`.
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let (b, s) = (x.size()[0], x.size()[1]);
        let heads = |t: Tensor| -> Result<Tensor> {
            Ok(t.f_view([b, s, self.n_head, self.head_dim])?
                .f_transpose(1, 2)?)
        };
        let q = heads(self.q_proj.forward_t(x, train)?)?;
        let k = heads(self.k_proj.forward_t(x, train)?)?;
        let v = heads(self.v_proj.forward_t(x, train)?)?;
        // [b, h, s, hd]; softmax(q·kᵀ/√hd + causal) · v
        let y = Tensor::f_scaled_dot_product_attention(
            &q,
            &k,
            &v,
            None::<&Tensor>,
            0.0,
            true,
            None,
            false,
        )?;
        let y = y
            .f_transpose(1, 2)?
            .f_reshape([b, s, self.n_head * self.head_dim])?;
        Ok(self.out_proj.forward_t(&y, train)?)
    }
}

/// `CLIPMLP`: `fc2(act(fc1(x)))`.
#[derive(Debug)]
struct Mlp {
    fc1: Site<LoraLinear>,
    fc2: Site<LoraLinear>,
    act: ClipActivation,
}

impl Mlp {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = self.fc1.forward_t(x, train)?;
        let h = match self.act {
            // transformers `QuickGELUActivation`: x · sigmoid(1.702 x)
            ClipActivation::QuickGelu => h.f_mul(&h.f_mul_scalar(1.702)?.f_sigmoid()?)?,
            ClipActivation::Gelu => h.f_gelu("none")?,
            ClipActivation::GeluTanh => h.f_gelu("tanh")?,
        };
        Ok(self.fc2.forward_t(&h, train)?)
    }
}

/// `CLIPEncoderLayer`: `x + attn(ln1(x))`, then `h + mlp(ln2(h))`.
#[derive(Debug)]
struct EncoderLayer {
    self_attn: Attention,
    layer_norm1: LayerNorm,
    mlp: Mlp,
    layer_norm2: LayerNorm,
}

impl EncoderLayer {
    fn forward(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let h = x.f_add(
            &self
                .self_attn
                .forward(&self.layer_norm1.forward(x)?, train)?,
        )?;
        let m = self.mlp.forward(&self.layer_norm2.forward(&h)?, train)?;
        Ok(h.f_add(&m)?)
    }
}

/// What one forward pass of the text encoder returns.
#[derive(Debug)]
pub struct ClipTextOutput {
    /// `[batch, seq, D]` in the model dtype: the last layer's output after `final_layer_norm`
    /// (transformers `last_hidden_state`; SD1.x's `encoder_hidden_states` at clip skip 1).
    pub last_hidden_state: Tensor,
    /// `num_hidden_layers + 1` tensors `[batch, seq, D]`: the embeddings, then the output of
    /// every layer, *without* the final LayerNorm (transformers `hidden_states` with
    /// `output_hidden_states=True`; `hidden_states[len - 2]` is SDXL's "penultimate" state).
    pub hidden_states: Vec<Tensor>,
    /// `[batch, D]`: `last_hidden_state` at the end-of-text position (transformers
    /// `pooler_output`; see [`ClipTextModel::forward_t`] for the position rule).
    pub pooled: Tensor,
    /// `[batch, projection_dim]`: `text_projection(pooled)`, only from
    /// [`ClipTextModelWithProjection`] (transformers `text_embeds`; SDXL's pooled conditioning).
    pub text_embeds: Option<Tensor>,
}

/// A CLIP text encoder (transformers `CLIPTextModel`) whose every linear layer is a LoRA site.
///
/// Weight names (a `text_encoder/model.safetensors` as transformers 4.x — every published SD
/// checkpoint — writes it; transformers 5.x writes the same names without the leading
/// `text_model.`, and both are accepted):
/// `text_model.embeddings.{token_embedding,position_embedding}.weight`,
/// `text_model.encoder.layers.N.self_attn.{q,k,v,out}_proj.{weight,bias}`,
/// `text_model.encoder.layers.N.{layer_norm1,layer_norm2}.{weight,bias}`,
/// `text_model.encoder.layers.N.mlp.{fc1,fc2}.{weight,bias}`,
/// `text_model.final_layer_norm.{weight,bias}`.
///
/// LoRA sites (module paths as transformers names them, so PEFT keys
/// `base_model.model.<path>.lora_A.weight` and kohya names `lora_te_<path with _>` —
/// `lora_te1_`/`lora_te2_` for SDXL's two encoders — map 1:1):
/// `text_model.encoder.layers.N.self_attn.{q_proj,k_proj,v_proj,out_proj}` and
/// `text_model.encoder.layers.N.mlp.{fc1,fc2}` (kohya sd-scripts `networks/lora.py` targets
/// exactly these, `TEXT_ENCODER_TARGET_REPLACE_MODULE = ["CLIPAttention", "CLIPMLP"]`).
/// Embeddings and LayerNorms are frozen plain tensors without grad. A PEFT adapter saved from a
/// transformers 5.x `CLIPTextModel` names its modules without `text_model.`
/// (`base_model.model.encoder.layers.0.self_attn.q_proj`); [`canonicalize_adapter`](crate::clip::canonicalize_adapter) renames
/// them before loading.
///
/// # Shapes
/// ids `[batch, seq ≤ max_position_embeddings]` int64 → hidden `[batch, seq, D]`; activations
/// held per layer: `[batch, seq, D]` (residual) + `[batch, heads, seq, head_dim]` ×3 (q, k, v) +
/// `[batch, seq, intermediate]` (MLP), all in the model dtype.
#[derive(Debug)]
pub struct ClipTextModel {
    config: ClipTextConfig,
    token_embedding: Tensor,
    position_embedding: Tensor,
    layers: Vec<EncoderLayer>,
    final_layer_norm: LayerNorm,
    kind: Kind,
    device: Device,
}

impl ClipTextModel {
    /// Loads a transformers text-encoder folder (SD's `text_encoder/`): `config.json` plus
    /// `model.safetensors` (or the shards of `model.safetensors.index.json`), memory-mapped and
    /// copied once into tensors of dtype `kind` (f32, f16 or bf16) on `device`.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Config`] for the folder's files, [`Error::Safetensors`] for a bad
    /// header, [`Error::MissingTensor`]/[`Error::Shape`] when the weights do not fit the config.
    pub fn from_pretrained(dir: impl AsRef<Path>, kind: Kind, device: Device) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ClipTextConfig::from_file(dir.join("config.json"))?;
        let src = SafetensorsFiles::open_dir(dir, "model", device)?;
        Self::build(config, &src, "", kind, device)
    }

    /// Builds the model from tensors named `<prefix>text_model.…` (e.g. prefix
    /// `"cond_stage_model.transformer."` for the text encoder inside an SD1.x single-file
    /// checkpoint, `""` for a transformers state dict), converted to `kind` on `device`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`]/[`Error::Shape`] when the map does not fit `config`.
    pub fn from_tensors(
        config: ClipTextConfig,
        tensors: &HashMap<String, Tensor>,
        prefix: &str,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        Self::build(
            config,
            &TensorMap::new(tensors, device),
            prefix,
            kind,
            device,
        )
    }

    pub(crate) fn build(
        config: ClipTextConfig,
        src: &dyn TensorSource,
        prefix: &str,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let (d, ff, eps) = (
            config.hidden_size,
            config.intermediate_size,
            config.layer_norm_eps,
        );
        // transformers < 5 (and every SD checkpoint) writes `text_model.…`; transformers 5
        // writes a bare `CLIPTextModel` without that level (both load in transformers 5).
        let p = if src.contains(&format!(
            "{prefix}text_model.embeddings.token_embedding.weight"
        )) || !src.contains(&format!("{prefix}embeddings.token_embedding.weight"))
        {
            format!("{prefix}text_model")
        } else {
            prefix.trim_end_matches('.').to_string()
        };
        // sites are named as transformers' modules (`text_model.encoder.layers.0.…`), PEFT's and
        // kohya's names, whatever prefix the keys carry
        let root = WeightPath::new(src, &p, kind).with_module("text_model");
        let emb = root.pp("embeddings");
        let token_embedding = emb
            .pp("token_embedding")
            .get("weight", &[config.vocab_size, d])?;
        let position_embedding = emb
            .pp("position_embedding")
            .get("weight", &[config.max_position_embeddings, d])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers as usize);
        for i in 0..config.num_hidden_layers {
            let l = root.pp("encoder").pp("layers").pp(i);
            let (a, m) = (l.pp("self_attn"), l.pp("mlp"));
            layers.push(EncoderLayer {
                self_attn: Attention {
                    q_proj: a.pp("q_proj").linear(d, d, true)?,
                    k_proj: a.pp("k_proj").linear(d, d, true)?,
                    v_proj: a.pp("v_proj").linear(d, d, true)?,
                    out_proj: a.pp("out_proj").linear(d, d, true)?,
                    n_head: config.num_attention_heads,
                    head_dim: config.head_dim(),
                },
                layer_norm1: LayerNorm::load(&l.pp("layer_norm1"), d, eps)?,
                mlp: Mlp {
                    fc1: m.pp("fc1").linear(d, ff, true)?,
                    fc2: m.pp("fc2").linear(ff, d, true)?,
                    act: config.hidden_act,
                },
                layer_norm2: LayerNorm::load(&l.pp("layer_norm2"), d, eps)?,
            });
        }
        let final_layer_norm = LayerNorm::load(&root.pp("final_layer_norm"), d, eps)?;
        Ok(Self {
            config,
            token_embedding,
            position_embedding,
            layers,
            final_layer_norm,
            kind,
            device,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ClipTextConfig {
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

    /// Number of encoder layers.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes held by the frozen weights (adapters not counted).
    pub fn weights_resident_bytes(&self) -> u64 {
        let mut n = tensor_bytes(&self.token_embedding)
            + tensor_bytes(&self.position_embedding)
            + self.final_layer_norm.bytes();
        for l in &self.layers {
            let a = &l.self_attn;
            n += [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.out_proj,
                &l.mlp.fc1,
                &l.mlp.fc2,
            ]
            .into_iter()
            .map(|l| linear_bytes(l))
            .sum::<u64>();
            n += l.layer_norm1.bytes() + l.layer_norm2.bytes();
        }
        n
    }

    /// Number of frozen parameters.
    pub fn num_params(&self) -> i64 {
        let mut n = (self.token_embedding.numel() + self.position_embedding.numel()) as i64
            + self.final_layer_norm.numel();
        for l in &self.layers {
            let a = &l.self_attn;
            n += [
                &a.q_proj,
                &a.k_proj,
                &a.v_proj,
                &a.out_proj,
                &l.mlp.fc1,
                &l.mlp.fc2,
            ]
            .into_iter()
            .map(|l| linear_numel(l))
            .sum::<i64>();
            n += l.layer_norm1.numel() + l.layer_norm2.numel();
        }
        n
    }

    /// The end-of-text position of each row of `ids` `[batch, seq]` → `[batch]` int64, by
    /// transformers 5.24's rule (`CLIPTextTransformer.forward`): when the config's
    /// `eos_token_id == 2` (the stale value in SD1.x/SD2/SDXL configs, written before
    /// transformers PR #24773) the position of the **largest token id** (the first one on ties;
    /// `<|endoftext|>` = 49407 is the largest id of the CLIP vocabulary); otherwise the **first
    /// position equal to `eos_token_id`** (position 0 if a row has none).
    ///
    /// # Errors
    /// [`Error::Torch`] when an op fails.
    pub fn eos_positions(&self, ids: &Tensor) -> Result<Tensor> {
        let ids = ids.f_to_kind(Kind::Int)?;
        if self.config.eos_token_id == 2 {
            Ok(ids.f_argmax(-1, false)?)
        } else {
            Ok(ids
                .f_eq(self.config.eos_token_id)?
                .f_to_kind(Kind::Int)?
                .f_argmax(-1, false)?)
        }
    }

    fn check_ids(&self, ids: &Tensor) -> Result<(i64, i64)> {
        let sz = ids.size();
        if sz.len() != 2 || sz[1] == 0 || sz[1] > self.config.max_position_embeddings {
            return Err(Error::InvalidArgument(format!(
                "CLIP input ids must be [batch, seq] with 1 ≤ seq ≤ {}, got {sz:?}",
                self.config.max_position_embeddings
            )));
        }
        if !matches!(ids.kind(), Kind::Int64 | Kind::Int) {
            return Err(Error::InvalidArgument(format!(
                "CLIP input ids must be int64, got {:?}",
                ids.kind()
            )));
        }
        Ok((sz[0], sz[1]))
    }

    /// Encodes token ids `[batch, seq]` (int64, `seq ≤ 77`, normally the 77 ids of
    /// [`super::ClipTokenizer::encode_batch`]); `train` turns LoRA dropout on.
    ///
    /// No padding mask is applied (only the causal one), as in every SD pipeline: diffusers
    /// passes no `attention_mask` to the text encoder, and kohya sd-scripts neither.
    /// The pooled output is `last_hidden_state` at [`ClipTextModel::eos_positions`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for mis-shaped ids; [`Error::Torch`] (ids out of the
    /// vocabulary, out of memory, …).
    pub fn forward_t(&self, ids: &Tensor, train: bool) -> Result<ClipTextOutput> {
        let (b, s) = self.check_ids(ids)?;
        let ids = ids.f_to_device(self.device)?.f_to_kind(Kind::Int64)?;
        let tok = Tensor::f_embedding(&self.token_embedding, &ids, -1, false, false)?;
        let pos = self.position_embedding.f_narrow(0, 0, s)?.f_unsqueeze(0)?;
        let mut h = tok.f_add(&pos)?;
        let mut hidden_states = Vec::with_capacity(self.layers.len() + 1);
        for l in &self.layers {
            let next = l.forward(&h, train)?;
            hidden_states.push(h);
            h = next;
        }
        hidden_states.push(h.shallow_clone());
        let last = self.final_layer_norm.forward(&h)?;
        let rows = Tensor::f_arange(b, (Kind::Int64, self.device))?;
        let eos = self.eos_positions(&ids)?.f_to_kind(Kind::Int64)?;
        let pooled = last.f_index(&[Some(rows), Some(eos)])?;
        Ok(ClipTextOutput {
            last_hidden_state: last,
            hidden_states,
            pooled,
            text_embeds: None,
        })
    }

    /// The conditioning `[batch, seq, D]` for a kohya / A1111 `clip_skip` value.
    ///
    /// Convention (kohya sd-scripts `library/train_util.py::get_hidden_states`, A1111
    /// "Clip skip"): `clip_skip` 0 or 1 = the last layer (`last_hidden_state`, or that layer's
    /// output before the final LayerNorm when `final_norm` is false); `n ≥ 2` = the
    /// output of the `n`-th layer from the end, `hidden_states[len − n]` (2 = penultimate), passed
    /// through `final_layer_norm` when `final_norm` (as kohya does for SD1.x and SD2).
    /// diffusers' `clip_skip` argument counts differently: its 1 is this 2.
    /// SDXL uses the penultimate state of both encoders *without* the final norm:
    /// `skip_hidden(out, 2, false)`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `clip_skip` exceeds the number of layers.
    pub fn skip_hidden(
        &self,
        out: &ClipTextOutput,
        clip_skip: usize,
        final_norm: bool,
    ) -> Result<Tensor> {
        if clip_skip <= 1 {
            return Ok(if final_norm {
                out.last_hidden_state.shallow_clone()
            } else {
                out.hidden_states
                    .last()
                    .map(Tensor::shallow_clone)
                    .ok_or_else(|| Error::InvalidArgument("no hidden states".into()))?
            });
        }
        let n = out.hidden_states.len();
        if clip_skip > self.layers.len() {
            return Err(Error::InvalidArgument(format!(
                "clip_skip {clip_skip} exceeds the text encoder's {} layers",
                self.layers.len()
            )));
        }
        let h = &out.hidden_states[n - clip_skip];
        if final_norm {
            self.final_layer_norm.forward(h)
        } else {
            Ok(h.shallow_clone())
        }
    }

    fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        for l in &mut self.layers {
            let a = &mut l.self_attn;
            a.q_proj.visit(f)?;
            a.k_proj.visit(f)?;
            a.v_proj.visit(f)?;
            a.out_proj.visit(f)?;
            l.mlp.fc1.visit(f)?;
            l.mlp.fc2.visit(f)?;
        }
        Ok(())
    }
}

impl Adaptable for ClipTextModel {
    fn visit_sites(
        &mut self,
        f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()>,
    ) -> lora_core::Result<()> {
        self.visit(f)
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.num_params())
    }
}

/// transformers `CLIPTextModelWithProjection` (SDXL's `text_encoder_2`): [`ClipTextModel`] plus
/// `text_projection` (`[projection_dim, D]`, no bias) applied to the pooled output.
///
/// Weight names: those of [`ClipTextModel`] and `text_projection.weight`. LoRA sites: those of
/// [`ClipTextModel`] plus `text_projection` (not targeted by kohya; available to PEFT).
#[derive(Debug)]
pub struct ClipTextModelWithProjection {
    text_model: ClipTextModel,
    text_projection: Site<LoraLinear>,
}

impl ClipTextModelWithProjection {
    /// Loads a transformers folder (SDXL's `text_encoder_2/`): `config.json` +
    /// `model.safetensors` (or shards), in dtype `kind` on `device`.
    ///
    /// # Errors
    /// As [`ClipTextModel::from_pretrained`].
    pub fn from_pretrained(dir: impl AsRef<Path>, kind: Kind, device: Device) -> Result<Self> {
        let dir = dir.as_ref();
        let config = ClipTextConfig::from_file(dir.join("config.json"))?;
        let src = SafetensorsFiles::open_dir(dir, "model", device)?;
        Self::build(config, &src, "", kind, device)
    }

    /// Builds the model from tensors named `<prefix>text_model.…` and
    /// `<prefix>text_projection.weight`.
    ///
    /// # Errors
    /// As [`ClipTextModel::from_tensors`].
    pub fn from_tensors(
        config: ClipTextConfig,
        tensors: &HashMap<String, Tensor>,
        prefix: &str,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        Self::build(
            config,
            &TensorMap::new(tensors, device),
            prefix,
            kind,
            device,
        )
    }

    pub(crate) fn build(
        config: ClipTextConfig,
        src: &dyn TensorSource,
        prefix: &str,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let d = config.hidden_size;
        let pd = config.projection_dim.unwrap_or(d);
        let text_projection = WeightPath::new(src, &format!("{prefix}text_projection"), kind)
            .with_module("text_projection")
            .linear(d, pd, false)?;
        let text_model = ClipTextModel::build(config, src, prefix, kind, device)?;
        Ok(Self {
            text_model,
            text_projection,
        })
    }

    /// The text transformer.
    pub fn text_model(&self) -> &ClipTextModel {
        &self.text_model
    }

    /// The configuration.
    pub fn config(&self) -> &ClipTextConfig {
        self.text_model.config()
    }

    /// Number of frozen parameters (transformer + projection).
    pub fn num_params(&self) -> i64 {
        self.text_model.num_params() + linear_numel(&self.text_projection)
    }

    /// Bytes held by the frozen weights.
    pub fn weights_resident_bytes(&self) -> u64 {
        self.text_model.weights_resident_bytes() + linear_bytes(&self.text_projection)
    }

    /// As [`ClipTextModel::forward_t`], with `text_embeds` `[batch, projection_dim]` set.
    ///
    /// # Errors
    /// As [`ClipTextModel::forward_t`].
    pub fn forward_t(&self, ids: &Tensor, train: bool) -> Result<ClipTextOutput> {
        let mut out = self.text_model.forward_t(ids, train)?;
        out.text_embeds = Some(self.text_projection.forward_t(&out.pooled, train)?);
        Ok(out)
    }

    /// See [`ClipTextModel::skip_hidden`].
    ///
    /// # Errors
    /// As [`ClipTextModel::skip_hidden`].
    pub fn skip_hidden(
        &self,
        out: &ClipTextOutput,
        clip_skip: usize,
        final_norm: bool,
    ) -> Result<Tensor> {
        self.text_model.skip_hidden(out, clip_skip, final_norm)
    }
}

/// SDXL's text conditioning from its two encoders' outputs on the same prompt (diffusers
/// `StableDiffusionXLPipeline.encode_prompt` with `clip_skip=None`; kohya sd-scripts
/// `library/sdxl_train_util.py`): the penultimate hidden states of both, *without* the final
/// LayerNorm, concatenated on the feature axis, and encoder 2's projected pooled output.
///
/// Returns `(prompt_embeds [batch, seq, D1 + D2], pooled_prompt_embeds [batch, projection_dim])`
/// — `[b, 77, 2048]` and `[b, 1280]` for SDXL — in the models' dtype.
///
/// # Errors
/// [`Error::InvalidArgument`] when `out2` has no `text_embeds` (it did not come from
/// [`ClipTextModelWithProjection::forward_t`]) or the batch/sequence shapes differ.
pub fn sdxl_conditioning(
    te1: &ClipTextModel,
    out1: &ClipTextOutput,
    te2: &ClipTextModelWithProjection,
    out2: &ClipTextOutput,
) -> Result<(Tensor, Tensor)> {
    let pooled = out2.text_embeds.as_ref().ok_or_else(|| {
        Error::InvalidArgument(
            "the second output has no text_embeds (use ClipTextModelWithProjection)".into(),
        )
    })?;
    let h1 = te1.skip_hidden(out1, 2, false)?;
    let h2 = te2.skip_hidden(out2, 2, false)?;
    let (s1, s2) = (h1.size(), h2.size());
    if s1.len() != 3 || s2.len() != 3 || s1[..2] != s2[..2] {
        return Err(Error::InvalidArgument(format!(
            "SDXL encoders' states must share [batch, seq]: got {s1:?} and {s2:?}"
        )));
    }
    let h2 = if h2.kind() == h1.kind() {
        h2
    } else {
        h2.f_to_kind(h1.kind())?
    };
    Ok((Tensor::f_cat(&[h1, h2], -1)?, pooled.shallow_clone()))
}

impl Adaptable for ClipTextModelWithProjection {
    fn visit_sites(
        &mut self,
        f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()>,
    ) -> lora_core::Result<()> {
        self.text_model.visit(f)?;
        self.text_projection.visit(f)
    }

    fn frozen_param_count(&self) -> Option<i64> {
        Some(self.num_params())
    }
}
