//! The one weights layer of this crate's models: where tensors come from ([`TensorSource`]) and
//! how a model names them ([`WeightPath`]).
//!
//! - [`SafetensorsFiles`]: memory-mapped safetensors files — one file, or the shards of an HF /
//!   diffusers folder listed by its `*.safetensors.index.json` ([`weight_files`]) — read through
//!   lora-core's reader ([`lora_core::safetensors::SafetensorsFile`]), optionally under a name
//!   translation (an original SD single-file checkpoint answering diffusers names).
//! - [`GgufSource`]: a GGUF file, its tensors dequantised or, for linear weights, kept in their
//!   block format ([`WeightMode`]), with a name translation (HF → llama.cpp names).
//! - [`TensorMap`]: tensors already in memory.
//! - [`QuantizeOnLoad`]: a wrapper over any of these that quantizes the frozen linear weights
//!   as they load (QLoRA's NF4 base from a dense checkpoint, kohya's fp8 base).
//!
//! A model never spells a full weight name: it steps into sub-paths as candle's `VarBuilder`
//! does, so a name is written once and equals the checkpoint key:
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use std::collections::HashMap;
//! use lora_models::weights::{TensorMap, WeightPath};
//! use tch::{Device, Kind, Tensor};
//!
//! let mut map = HashMap::new();
//! map.insert(
//!     "model.layers.0.self_attn.q_proj.weight".to_string(),
//!     Tensor::zeros([8, 8], (Kind::Float, Device::Cpu)),
//! );
//! let src = TensorMap::new(&map, Device::Cpu);
//! let root = WeightPath::new(&src, "", Kind::Float);
//! let q = root.pp("model").pp("layers").pp(0).pp("self_attn").pp("q_proj");
//! assert_eq!(q.path(), "model.layers.0.self_attn.q_proj");
//! let w = q.get("weight", &[8, 8])?; // `model.layers.0.self_attn.q_proj.weight`, [8, 8] f32
//! # let _ = w; Ok(()) }
//! ```

mod gguf;
mod quantize;
mod safetensors;

use std::collections::HashMap;
use std::path::PathBuf;

use lora_core::base::BaseWeight;
use lora_core::conv::{Conv2dParams, LoraConv2d};
use lora_core::embedding::LoraEmbedding;
use lora_core::inject::SiteMut;
use lora_core::linear::LoraLinear;
use tch::{Device, Kind, Tensor};

use crate::error::{Error, Result};

pub use gguf::{GgufSource, WeightMode};
pub use quantize::{QuantizeOnLoad, quantizable};
pub(crate) use safetensors::read_config_json;
pub use safetensors::{SafetensorsFiles, weight_files};

/// A provider of tensors by name (the name a model asks for; a source may translate it to the
/// name it stores).
pub trait TensorSource {
    /// The tensor called `name` converted to `kind` on the source's device, or `None` when
    /// absent. The result owns its memory (it does not borrow a file map).
    ///
    /// # Errors
    /// [`Error::Safetensors`] / [`Error::Gguf`] / [`Error::Unsupported`] for unreadable data or
    /// dtypes; [`Error::Torch`] when the conversion fails.
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>>;

    /// Whether a tensor called `name` exists (nothing is read).
    fn contains(&self, name: &str) -> bool;

    /// Where the tensors come from (for messages).
    fn origin(&self) -> PathBuf;

    /// A 2-D weight `[out, in]` (torch order) as a frozen base, checked against `shape`: dense in
    /// `kind` here; a [`GgufSource`] in [`WeightMode::KeepQuantized`] keeps its GGUF blocks
    /// (the types of `lora_core::quant::QuantKind::from_ggml_type`). `rope_head_dim` is set for the query/key projections of a rotary-attention model:
    /// sources whose converter permuted those rows (llama.cpp's `LlamaModel.permute`) undo it;
    /// the others ignore it.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when absent; [`Error::Shape`] for another shape; as
    /// [`TensorSource::tensor`].
    fn base(
        &self,
        name: &str,
        shape: [i64; 2],
        kind: Kind,
        rope_head_dim: Option<i64>,
    ) -> Result<BaseWeight> {
        let _ = rope_head_dim;
        let t = self
            .tensor(name, kind)?
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                path: self.origin(),
            })?;
        check_shape(name, &shape, &t.size())?;
        Ok(BaseWeight::Dense(t))
    }
}

/// Fails with [`Error::Shape`] naming `name` unless `found == expected`.
pub(crate) fn check_shape(name: &str, expected: &[i64], found: &[i64]) -> Result<()> {
    if expected != found {
        return Err(Error::Shape {
            name: name.to_string(),
            expected: expected.to_vec(),
            found: found.to_vec(),
        });
    }
    Ok(())
}

/// Tensors already in memory, by name (tests, converters, layouts rewritten at load). Each
/// request returns a detached copy-or-conversion on the map's device; the map is not changed.
#[derive(Debug)]
pub struct TensorMap<'a> {
    map: &'a HashMap<String, Tensor>,
    device: Device,
}

impl<'a> TensorMap<'a> {
    /// Serves `map`'s tensors on `device`.
    pub fn new(map: &'a HashMap<String, Tensor>, device: Device) -> Self {
        Self { map, device }
    }
}

impl TensorSource for TensorMap<'_> {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(t) => Ok(Some(
                t.f_detach()?.f_to_kind(kind)?.f_to_device(self.device)?,
            )),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.map.contains_key(name)
    }

    fn origin(&self) -> PathBuf {
        "<tensor map>".into()
    }
}

/// Joins a module path and a child name with a dot (`""` + `x` is `x`).
pub fn join(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// A module path inside a [`TensorSource`], stepped into with [`WeightPath::pp`] (candle's
/// `VarBuilder::pp`), so that a model writes each weight name once and it equals the checkpoint
/// key: `root.pp("model").pp("layers").pp(0).pp("mlp").pp("up_proj").get("weight", …)` reads
/// `model.layers.0.mlp.up_proj.weight`. Tensors are read in the path's dtype (`kind`) on the
/// source's device.
///
/// Beside the key path it keeps the module path, the name a layer built here is visited under
/// for injection ([`Site`]). The two are equal unless a layout stores a module under other
/// keys: [`WeightPath::with_module`] (a checkpoint whose keys carry a prefix of their own) and
/// [`WeightPath::pp_as`] (a legacy key for a module) set it apart.
#[derive(Clone)]
pub struct WeightPath<'a> {
    src: &'a dyn TensorSource,
    prefix: String,
    module: String,
    kind: Kind,
}

impl std::fmt::Debug for WeightPath<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WeightPath")
            .field("origin", &self.src.origin())
            .field("prefix", &self.prefix)
            .field("module", &self.module)
            .field("kind", &self.kind)
            .finish()
    }
}

impl<'a> WeightPath<'a> {
    /// The path `prefix` (`""` for the root) in `src`, reading tensors as `kind`.
    pub fn new(src: &'a dyn TensorSource, prefix: &str, kind: Kind) -> Self {
        Self {
            src,
            prefix: prefix.to_string(),
            module: prefix.to_string(),
            kind,
        }
    }

    /// This path with module path `module` (the keys stay where they are): for a model whose
    /// checkpoint keys carry a prefix its module names do not (CLIP's `text_model` read from a
    /// layout without that level, a single-file checkpoint's own prefix).
    pub fn with_module(mut self, module: &str) -> Self {
        self.module = module.to_string();
        self
    }

    /// The child path `<path>.<name>` (`name` may be an index), in keys and module path alike.
    pub fn pp(&self, name: impl std::fmt::Display) -> WeightPath<'a> {
        let name = name.to_string();
        self.pp_as(&name, &name)
    }

    /// The child module `module` stored under key name `key` (a legacy layout's name for it:
    /// the original SD VAE's `query` for diffusers' `to_q`).
    pub fn pp_as(&self, key: &str, module: &str) -> WeightPath<'a> {
        WeightPath {
            src: self.src,
            prefix: join(&self.prefix, key),
            module: join(&self.module, module),
            kind: self.kind,
        }
    }

    /// The key path (`model.layers.0.mlp.up_proj`): tensor names under it are `<path>.<leaf>`.
    pub fn path(&self) -> &str {
        &self.prefix
    }

    /// The module path: the site name of a layer built here (equal to [`WeightPath::path`]
    /// unless set apart, see the type's docs).
    pub fn module_path(&self) -> &str {
        &self.module
    }

    /// `layer`, built at this path, as a [`Site`] named by the module path.
    pub fn site<T>(&self, layer: T) -> Site<T> {
        Site::new(self.module.clone(), layer)
    }

    /// The dtype tensors are read in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The source.
    pub fn source(&self) -> &'a dyn TensorSource {
        self.src
    }

    /// The full name of tensor `leaf` under this path (`<path>.<leaf>`).
    pub fn name(&self, leaf: &str) -> String {
        join(&self.prefix, leaf)
    }

    /// Whether tensor `leaf` exists under this path.
    pub fn contains(&self, leaf: &str) -> bool {
        self.src.contains(&self.name(leaf))
    }

    /// Tensor `leaf` under this path, or `None` when absent, checked against `shape`. A stored
    /// `[o, i, 1, 1]` tensor is accepted for an expected `[o, i]` (the original SD VAE
    /// checkpoints keep the mid-block attention projections as 1×1 convolutions).
    ///
    /// # Errors
    /// [`Error::Shape`] naming the tensor for another shape; as [`TensorSource::tensor`].
    pub fn get_opt(&self, leaf: &str, shape: &[i64]) -> Result<Option<Tensor>> {
        let name = self.name(leaf);
        let Some(t) = self.src.tensor(&name, self.kind)? else {
            return Ok(None);
        };
        let found = t.size();
        if found == shape {
            return Ok(Some(t));
        }
        if found.len() == shape.len() + 2
            && found[..shape.len()] == *shape
            && found[shape.len()..] == [1, 1]
        {
            return Ok(Some(t.f_reshape(shape)?));
        }
        Err(Error::Shape {
            name,
            expected: shape.to_vec(),
            found,
        })
    }

    /// As [`WeightPath::get_opt`], a missing tensor being [`Error::MissingTensor`].
    ///
    /// # Errors
    /// As [`WeightPath::get_opt`]; [`Error::MissingTensor`] naming the tensor and the source.
    pub fn get(&self, leaf: &str, shape: &[i64]) -> Result<Tensor> {
        self.get_opt(leaf, shape)?
            .ok_or_else(|| Error::MissingTensor {
                name: self.name(leaf),
                path: self.src.origin(),
            })
    }

    /// Tensor `leaf` as a frozen base weight `[out, in]` ([`TensorSource::base`]: possibly kept
    /// quantised).
    ///
    /// # Errors
    /// As [`TensorSource::base`].
    pub fn base(
        &self,
        leaf: &str,
        shape: [i64; 2],
        rope_head_dim: Option<i64>,
    ) -> Result<BaseWeight> {
        self.src
            .base(&self.name(leaf), shape, self.kind, rope_head_dim)
    }

    /// `nn.Linear(i, o, bias)` at this path: `weight` `[o, i]`, `bias` `[o]`, dense; a LoRA site
    /// named by the module path.
    ///
    /// # Errors
    /// As [`WeightPath::get`].
    pub fn linear(&self, i: i64, o: i64, bias: bool) -> Result<Site<LoraLinear>> {
        let w = self.get("weight", &[o, i])?;
        let b = if bias {
            Some(self.get("bias", &[o])?)
        } else {
            None
        };
        Ok(self.site(LoraLinear::new(BaseWeight::Dense(w), b)?))
    }

    /// `nn.Conv2d(i, o, k, stride, padding)` with bias at this path: `weight` `[o, i, k, k]`,
    /// `bias` `[o]`; a LoRA site named by the module path.
    ///
    /// # Errors
    /// As [`WeightPath::get`].
    pub fn conv(
        &self,
        i: i64,
        o: i64,
        k: i64,
        stride: i64,
        padding: i64,
    ) -> Result<Site<LoraConv2d>> {
        let w = self.get("weight", &[o, i, k, k])?;
        let b = self.get("bias", &[o])?;
        let params = Conv2dParams {
            stride: [stride, stride],
            padding: [padding, padding],
            ..Conv2dParams::default()
        };
        Ok(self.site(LoraConv2d::new(BaseWeight::Dense(w), Some(b), params)?))
    }
}

/// A LoRA site: a layer and the module path it was built at, the name it is visited under for
/// injection ([`lora_core::inject::Adaptable::visit_sites`]), so that a model spells each module
/// name once, when it loads the layer. Dereferences to the layer.
#[derive(Debug)]
pub struct Site<T> {
    path: String,
    layer: T,
}

impl<T> Site<T> {
    /// `layer` named `path`.
    pub fn new(path: impl Into<String>, layer: T) -> Self {
        Self {
            path: path.into(),
            layer,
        }
    }

    /// The module path (`down_blocks.0.resnets.1.conv1`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The layer.
    pub fn into_inner(self) -> T {
        self.layer
    }
}

impl<T> std::ops::Deref for Site<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.layer
    }
}

impl<T> std::ops::DerefMut for Site<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.layer
    }
}

/// A layer kind that can be a LoRA site ([`SiteMut`]'s kinds).
pub trait SiteLayer {
    /// The layer as lora-core's mutable site.
    fn site_mut(&mut self) -> SiteMut<'_>;
}

impl SiteLayer for LoraLinear {
    fn site_mut(&mut self) -> SiteMut<'_> {
        SiteMut::Linear(self)
    }
}

impl SiteLayer for LoraConv2d {
    fn site_mut(&mut self) -> SiteMut<'_> {
        SiteMut::Conv2d(self)
    }
}

impl SiteLayer for LoraEmbedding {
    fn site_mut(&mut self) -> SiteMut<'_> {
        SiteMut::Embedding(self)
    }
}

/// The visitor of [`lora_core::inject::Adaptable::visit_sites`].
pub type Visitor<'a> = dyn FnMut(&str, SiteMut<'_>) -> lora_core::Result<()> + 'a;

impl<T: SiteLayer> Site<T> {
    /// Visits this site under its module path.
    ///
    /// # Errors
    /// What `f` returns.
    pub fn visit(&mut self, f: &mut Visitor<'_>) -> lora_core::Result<()> {
        f(&self.path, self.layer.site_mut())
    }
}
