//! Black Forest Labs' original FLUX key layout ↔ diffusers' `FluxTransformer2DModel` names.
//!
//! BFL's `flux/model.py` (the layout of `flux1-dev.safetensors`, of ComfyUI and kohya
//! checkpoints and LoRAs, and of city96's FLUX GGUF files) fuses some linears that diffusers
//! keeps apart: a double block's `img_attn.qkv` is diffusers' `attn.to_q | to_k | to_v`
//! stacked along the output rows, a single block's `linear1` is `attn.to_q | to_k | to_v |
//! proj_mlp`; and `final_layer.adaLN_modulation.1` holds `shift | scale` where diffusers'
//! `norm_out.linear` holds `scale | shift`. Everything else is a rename.
//!
//! [`bfl_modules`] is that correspondence written once, as a table of BFL modules, each the
//! concatenation along dim 0 (output rows) of row ranges of diffusers modules ([`RowSlice`]).
//! [`BflKeyMap`] turns it into per-tensor recipes both ways (diffusers tensor from BFL rows, for
//! loading; BFL tensor from diffusers rows, for export), and [`BflSource`] serves diffusers
//! names from a BFL checkpoint. It is the inverse of diffusers'
//! `convert_flux_transformer_checkpoint_to_diffusers` (`loaders/single_file_utils.py`, 0.42.1),
//! which the interop test checks it against in both directions.
//!
//! The LoRA files in kohya/ComfyUI keys ([`super::lora`]) use the same table: the adapter of a
//! fused BFL module is built from the adapters of its parts in [`BflModule::parts`] order (for
//! `img_attn.qkv`: `to_q`, `to_k`, `to_v`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;

use lora_core::base::BaseWeight;
use lora_core::quant::QuantWeight;
use tch::{Kind, Tensor};

use super::config::FluxConfig;
use crate::error::{Error, Result};
use crate::weights::TensorSource;

/// Rows `start .. start + rows` of the output dimension of a diffusers module (its weight's
/// dim 0, and its bias).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowSlice {
    /// The diffusers module path (`transformer_blocks.0.attn.to_q`).
    pub module: String,
    /// First row.
    pub start: i64,
    /// Number of rows.
    pub rows: i64,
}

/// What a module holds: a linear (`weight` `[out, in]`, `bias` `[out]` under the same leaf
/// names) or an RMSNorm scale (BFL `scale` = diffusers `weight`, `[head_dim]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BflModuleKind {
    /// `nn.Linear` with bias.
    Linear,
    /// `RMSNorm` scale.
    RmsNorm,
}

impl BflModuleKind {
    /// The tensor leaves as `(BFL leaf, diffusers leaf)`.
    pub fn leaves(self) -> &'static [(&'static str, &'static str)] {
        match self {
            BflModuleKind::Linear => &[("weight", "weight"), ("bias", "bias")],
            BflModuleKind::RmsNorm => &[("scale", "weight")],
        }
    }
}

/// One module of the BFL layout and where its rows come from in diffusers' layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BflModule {
    /// The BFL module path (`double_blocks.0.img_attn.qkv`), without a file prefix.
    pub bfl: String,
    /// What it holds.
    pub kind: BflModuleKind,
    /// Its output rows, in order: the concatenation of these diffusers row ranges. A rename is
    /// one slice covering the whole diffusers module; `img_attn.qkv` is `to_q`, `to_k`, `to_v`
    /// whole; `final_layer.adaLN_modulation.1` is the second half of `norm_out.linear` then the
    /// first.
    pub parts: Vec<RowSlice>,
}

impl BflModule {
    /// Output rows of the BFL module (the sum of its parts).
    pub fn rows(&self) -> i64 {
        self.parts.iter().map(|p| p.rows).sum()
    }

    /// Whether the module is several diffusers modules fused (or a module's rows reordered).
    pub fn is_fused(&self) -> bool {
        self.parts.len() > 1
    }
}

fn whole(module: String, rows: i64) -> Vec<RowSlice> {
    vec![RowSlice {
        module,
        start: 0,
        rows,
    }]
}

fn stacked(modules: &[(String, i64)]) -> Vec<RowSlice> {
    modules
        .iter()
        .map(|(m, rows)| RowSlice {
            module: m.clone(),
            start: 0,
            rows: *rows,
        })
        .collect()
}

/// The BFL ↔ diffusers module table of a FLUX transformer with `config`'s shape (block counts,
/// widths, guidance embedding), BFL modules in the order of BFL's `Flux.__init__`.
///
/// | BFL module | diffusers rows |
/// |---|---|
/// | `img_in` / `txt_in` | `x_embedder` / `context_embedder` |
/// | `time_in.{in,out}_layer` | `time_text_embed.timestep_embedder.linear_{1,2}` |
/// | `vector_in.{in,out}_layer` | `time_text_embed.text_embedder.linear_{1,2}` |
/// | `guidance_in.{in,out}_layer` (dev) | `time_text_embed.guidance_embedder.linear_{1,2}` |
/// | `double_blocks.N.img_mod.lin` / `txt_mod.lin` | `transformer_blocks.N.norm1.linear` / `norm1_context.linear` |
/// | `double_blocks.N.img_attn.qkv` | `attn.to_q` ‖ `attn.to_k` ‖ `attn.to_v` |
/// | `double_blocks.N.txt_attn.qkv` | `attn.add_q_proj` ‖ `add_k_proj` ‖ `add_v_proj` |
/// | `double_blocks.N.{img,txt}_attn.norm.{query,key}_norm` | `attn.norm_{q,k}` / `attn.norm_added_{q,k}` |
/// | `double_blocks.N.img_attn.proj` / `txt_attn.proj` | `attn.to_out.0` / `attn.to_add_out` |
/// | `double_blocks.N.img_mlp.{0,2}` / `txt_mlp.{0,2}` | `ff.net.0.proj`, `ff.net.2` / `ff_context.…` |
/// | `single_blocks.N.modulation.lin` | `single_transformer_blocks.N.norm.linear` |
/// | `single_blocks.N.linear1` | `attn.to_q` ‖ `attn.to_k` ‖ `attn.to_v` ‖ `proj_mlp` |
/// | `single_blocks.N.norm.{query,key}_norm` | `attn.norm_{q,k}` |
/// | `single_blocks.N.linear2` | `proj_out` |
/// | `final_layer.linear` | `proj_out` |
/// | `final_layer.adaLN_modulation.1` | `norm_out.linear` rows `[D, 2D)` ‖ rows `[0, D)` (shift, scale) |
pub fn bfl_modules(config: &FluxConfig) -> Vec<BflModule> {
    let d = config.inner_dim();
    let m = config.mlp_hidden_dim();
    let h = config.attention_head_dim;
    let mut out = Vec::new();
    let mut push = |bfl: String, kind: BflModuleKind, parts: Vec<RowSlice>| {
        out.push(BflModule { bfl, kind, parts })
    };
    use BflModuleKind::{Linear, RmsNorm};
    push("img_in".into(), Linear, whole("x_embedder".into(), d));
    let tte = "time_text_embed";
    push(
        "time_in.in_layer".into(),
        Linear,
        whole(format!("{tte}.timestep_embedder.linear_1"), d),
    );
    push(
        "time_in.out_layer".into(),
        Linear,
        whole(format!("{tte}.timestep_embedder.linear_2"), d),
    );
    push(
        "vector_in.in_layer".into(),
        Linear,
        whole(format!("{tte}.text_embedder.linear_1"), d),
    );
    push(
        "vector_in.out_layer".into(),
        Linear,
        whole(format!("{tte}.text_embedder.linear_2"), d),
    );
    if config.guidance_embeds {
        push(
            "guidance_in.in_layer".into(),
            Linear,
            whole(format!("{tte}.guidance_embedder.linear_1"), d),
        );
        push(
            "guidance_in.out_layer".into(),
            Linear,
            whole(format!("{tte}.guidance_embedder.linear_2"), d),
        );
    }
    push("txt_in".into(), Linear, whole("context_embedder".into(), d));
    for i in 0..config.num_layers {
        let (b, t) = (
            format!("double_blocks.{i}"),
            format!("transformer_blocks.{i}"),
        );
        push(
            format!("{b}.img_mod.lin"),
            Linear,
            whole(format!("{t}.norm1.linear"), 6 * d),
        );
        push(
            format!("{b}.img_attn.qkv"),
            Linear,
            stacked(&[
                (format!("{t}.attn.to_q"), d),
                (format!("{t}.attn.to_k"), d),
                (format!("{t}.attn.to_v"), d),
            ]),
        );
        push(
            format!("{b}.img_attn.norm.query_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_q"), h),
        );
        push(
            format!("{b}.img_attn.norm.key_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_k"), h),
        );
        push(
            format!("{b}.img_attn.proj"),
            Linear,
            whole(format!("{t}.attn.to_out.0"), d),
        );
        push(
            format!("{b}.img_mlp.0"),
            Linear,
            whole(format!("{t}.ff.net.0.proj"), m),
        );
        push(
            format!("{b}.img_mlp.2"),
            Linear,
            whole(format!("{t}.ff.net.2"), d),
        );
        push(
            format!("{b}.txt_mod.lin"),
            Linear,
            whole(format!("{t}.norm1_context.linear"), 6 * d),
        );
        push(
            format!("{b}.txt_attn.qkv"),
            Linear,
            stacked(&[
                (format!("{t}.attn.add_q_proj"), d),
                (format!("{t}.attn.add_k_proj"), d),
                (format!("{t}.attn.add_v_proj"), d),
            ]),
        );
        push(
            format!("{b}.txt_attn.norm.query_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_added_q"), h),
        );
        push(
            format!("{b}.txt_attn.norm.key_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_added_k"), h),
        );
        push(
            format!("{b}.txt_attn.proj"),
            Linear,
            whole(format!("{t}.attn.to_add_out"), d),
        );
        push(
            format!("{b}.txt_mlp.0"),
            Linear,
            whole(format!("{t}.ff_context.net.0.proj"), m),
        );
        push(
            format!("{b}.txt_mlp.2"),
            Linear,
            whole(format!("{t}.ff_context.net.2"), d),
        );
    }
    for i in 0..config.num_single_layers {
        let (b, t) = (
            format!("single_blocks.{i}"),
            format!("single_transformer_blocks.{i}"),
        );
        push(
            format!("{b}.linear1"),
            Linear,
            stacked(&[
                (format!("{t}.attn.to_q"), d),
                (format!("{t}.attn.to_k"), d),
                (format!("{t}.attn.to_v"), d),
                (format!("{t}.proj_mlp"), m),
            ]),
        );
        push(
            format!("{b}.linear2"),
            Linear,
            whole(format!("{t}.proj_out"), d),
        );
        push(
            format!("{b}.norm.query_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_q"), h),
        );
        push(
            format!("{b}.norm.key_norm"),
            RmsNorm,
            whole(format!("{t}.attn.norm_k"), h),
        );
        push(
            format!("{b}.modulation.lin"),
            Linear,
            whole(format!("{t}.norm.linear"), 3 * d),
        );
    }
    push(
        "final_layer.linear".into(),
        Linear,
        whole("proj_out".into(), config.proj_out_dim()),
    );
    push(
        "final_layer.adaLN_modulation.1".into(),
        Linear,
        vec![
            RowSlice {
                module: "norm_out.linear".into(),
                start: d,
                rows: d,
            },
            RowSlice {
                module: "norm_out.linear".into(),
                start: 0,
                rows: d,
            },
        ],
    );
    out
}

/// Rows `start .. start + rows` (dim 0) of the tensor `name`, one piece of an assembled tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Piece {
    /// The tensor's full name (`double_blocks.0.img_attn.qkv.weight`).
    pub name: String,
    /// First row.
    pub start: i64,
    /// Number of rows.
    pub rows: i64,
}

/// Per-tensor recipes of the BFL ↔ diffusers conversion for one model shape, both ways: a
/// tensor of one layout is the concatenation along dim 0 of [`Piece`]s of the other layout's
/// tensors. Built from [`bfl_modules`].
#[derive(Debug, Clone)]
pub struct BflKeyMap {
    modules: Vec<BflModule>,
    to_diffusers: HashMap<String, Vec<Piece>>,
    to_bfl: HashMap<String, Vec<Piece>>,
}

impl BflKeyMap {
    /// The recipes for a model of `config`'s shape.
    pub fn new(config: &FluxConfig) -> Self {
        let modules = bfl_modules(config);
        let mut to_bfl = HashMap::new();
        // (diffusers tensor) → [(diffusers start, BFL piece)]
        let mut parts: HashMap<String, Vec<(i64, Piece)>> = HashMap::new();
        for m in &modules {
            for &(bl, dl) in m.kind.leaves() {
                let bname = format!("{}.{bl}", m.bfl);
                let mut offset = 0;
                let mut pieces = Vec::with_capacity(m.parts.len());
                for p in &m.parts {
                    let dname = format!("{}.{dl}", p.module);
                    pieces.push(Piece {
                        name: dname.clone(),
                        start: p.start,
                        rows: p.rows,
                    });
                    parts.entry(dname).or_default().push((
                        p.start,
                        Piece {
                            name: bname.clone(),
                            start: offset,
                            rows: p.rows,
                        },
                    ));
                    offset += p.rows;
                }
                to_bfl.insert(bname, pieces);
            }
        }
        let to_diffusers = parts
            .into_iter()
            .map(|(k, mut v)| {
                v.sort_by_key(|(s, _)| *s);
                (k, v.into_iter().map(|(_, p)| p).collect())
            })
            .collect();
        Self {
            modules,
            to_diffusers,
            to_bfl,
        }
    }

    /// The module table ([`bfl_modules`]).
    pub fn modules(&self) -> &[BflModule] {
        &self.modules
    }

    /// How the diffusers tensor `name` (`transformer_blocks.0.attn.to_k.weight`) is read from
    /// a BFL checkpoint: `[double_blocks.0.img_attn.qkv.weight rows D..2D]`. `None` for a name
    /// that is not a parameter of this model shape.
    pub fn diffusers_from_bfl(&self, name: &str) -> Option<&[Piece]> {
        self.to_diffusers.get(name).map(Vec::as_slice)
    }

    /// How the BFL tensor `name` (`single_blocks.0.linear1.bias`) is assembled from diffusers
    /// tensors: `[…attn.to_q.bias, …to_k.bias, …to_v.bias, …proj_mlp.bias]`, whole. `None` for
    /// a name that is not a parameter of this model shape.
    pub fn bfl_from_diffusers(&self, name: &str) -> Option<&[Piece]> {
        self.to_bfl.get(name).map(Vec::as_slice)
    }

    /// Every diffusers parameter name of the model (unordered).
    pub fn diffusers_names(&self) -> impl Iterator<Item = &str> {
        self.to_diffusers.keys().map(String::as_str)
    }

    /// Every BFL parameter name of the model (unordered).
    pub fn bfl_names(&self) -> impl Iterator<Item = &str> {
        self.to_bfl.keys().map(String::as_str)
    }
}

/// A BFL-layout checkpoint (the tensors of `inner`, under `prefix`) answering diffusers names:
/// a requested tensor is cut out of (and, for `norm_out.linear`, reassembled from) the rows of
/// the BFL tensor(s) [`BflKeyMap::diffusers_from_bfl`] names. The last BFL tensor read is kept,
/// so `to_q`, `to_k`, `to_v` (and `proj_mlp`) read their fused tensor once; results are copies
/// that do not keep the fused tensor alive.
///
/// [`TensorSource::base`] hands a weight that is a whole BFL tensor (`img_mlp.0`, `linear2`,
/// `img_mod.lin`, …) to the inner source's `base`, so a source that keeps block-quantised
/// weights keeps them; the row cuts of fused tensors (`qkv`, `linear1`) are cut out of the inner
/// source's base of the fused tensor without leaving its format: a GGUF block-quantized tensor
/// is quantized row by row, so its rows are narrowed as they are stored
/// ([`QuantWeight::narrow_rows`]; `to_q`, `to_k`, `to_v` are views of one read), and the
/// reordered halves of `norm_out.linear` are stacked as stored ([`QuantWeight::cat_rows`]).
pub struct BflSource<'a> {
    inner: &'a dyn TensorSource,
    prefix: String,
    map: BflKeyMap,
    last: Mutex<Option<(String, Kind, Tensor)>>,
    last_base: Mutex<Option<(String, Kind, BaseWeight)>>,
}

impl std::fmt::Debug for BflSource<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BflSource")
            .field("origin", &self.inner.origin())
            .field("prefix", &self.prefix)
            .finish()
    }
}

impl<'a> BflSource<'a> {
    /// Serves `inner`'s BFL tensors (stored as `<prefix><bfl name>`) under diffusers names, for
    /// a model of `config`'s shape.
    pub fn new(inner: &'a dyn TensorSource, prefix: &str, config: &FluxConfig) -> Self {
        Self {
            inner,
            prefix: prefix.to_string(),
            map: BflKeyMap::new(config),
            last: Mutex::new(None),
            last_base: Mutex::new(None),
        }
    }

    /// The recipes in use.
    pub fn key_map(&self) -> &BflKeyMap {
        &self.map
    }

    fn stored(&self, name: &str, kind: Kind) -> Result<Tensor> {
        let full = format!("{}{name}", self.prefix);
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((n, k, t)) = last.as_ref()
            && *n == full
            && *k == kind
        {
            return Ok(t.shallow_clone());
        }
        let t = self
            .inner
            .tensor(&full, kind)?
            .ok_or_else(|| Error::MissingTensor {
                name: full.clone(),
                path: self.inner.origin(),
            })?;
        *last = Some((full, kind, t.shallow_clone()));
        Ok(t)
    }
}

impl BflSource<'_> {
    /// Rows `p.start .. p.start + p.rows` of the BFL tensor `p.name` (of full shape `full`) as a
    /// frozen base: the inner source's base of the whole tensor (read once for consecutive
    /// pieces of one tensor), cut without leaving its format — a kept-quantized tensor is
    /// narrowed block row by block row ([`QuantWeight::narrow_rows`]), a dense one copied.
    fn stored_base_rows(&self, p: &Piece, full: [i64; 2], kind: Kind) -> Result<BaseWeight> {
        let name = format!("{}{}", self.prefix, p.name);
        let mut last = self.last_base.lock().unwrap_or_else(|e| e.into_inner());
        let hit = matches!(last.as_ref(), Some((n, k, _)) if *n == name && *k == kind);
        if !hit {
            *last = None; // free the previous fused tensor before reading the next one
            let b = self.inner.base(&name, full, kind, None)?;
            *last = Some((name.clone(), kind, b));
        }
        let Some((_, _, base)) = last.as_ref() else {
            return Err(Error::MissingTensor {
                name,
                path: self.inner.origin(),
            });
        };
        if p.start + p.rows > full[0] {
            return Err(Error::Shape {
                name,
                expected: vec![p.start + p.rows, full[1]],
                found: full.to_vec(),
            });
        }
        match base {
            BaseWeight::Quant(q) => Ok(BaseWeight::Quant(q.narrow_rows(p.start, p.rows)?)),
            b => {
                let t = b.weight(kind)?;
                Ok(BaseWeight::Dense(Tensor::f_cat(
                    &[t.f_narrow(0, p.start, p.rows)?],
                    0,
                )?))
            }
        }
    }
}

impl TensorSource for BflSource<'_> {
    fn tensor(&self, name: &str, kind: Kind) -> Result<Option<Tensor>> {
        let Some(pieces) = self.map.diffusers_from_bfl(name) else {
            return Ok(None);
        };
        let mut cuts = Vec::with_capacity(pieces.len());
        for p in pieces {
            let t = self.stored(&p.name, kind)?;
            let n = t.size().first().copied().unwrap_or(0);
            if p.start + p.rows > n {
                return Err(Error::Shape {
                    name: format!("{}{}", self.prefix, p.name),
                    expected: vec![p.start + p.rows],
                    found: t.size(),
                });
            }
            if pieces.len() == 1 && p.start == 0 && p.rows == n {
                return Ok(Some(t));
            }
            cuts.push(t.f_narrow(0, p.start, p.rows)?);
        }
        // a fresh tensor (also for one piece), so the fused tensor is not kept alive
        Ok(Some(Tensor::f_cat(&cuts, 0)?))
    }

    fn base(
        &self,
        name: &str,
        shape: [i64; 2],
        kind: Kind,
        rope_head_dim: Option<i64>,
    ) -> Result<BaseWeight> {
        let _ = rope_head_dim; // BFL checkpoints store q/k rows unpermuted
        let pieces = self
            .map
            .diffusers_from_bfl(name)
            .ok_or_else(|| Error::MissingTensor {
                name: name.into(),
                path: self.inner.origin(),
            })?;
        let total = |p: &Piece| -> i64 {
            self.map
                .bfl_from_diffusers(&p.name)
                .map_or(0, |parts| parts.iter().map(|x| x.rows).sum())
        };
        if let [p] = pieces
            && p.start == 0
            && p.rows == total(p)
        {
            let full = format!("{}{}", self.prefix, p.name);
            return self.inner.base(&full, shape, kind, None);
        }
        let rows: i64 = pieces.iter().map(|p| p.rows).sum();
        crate::weights::check_shape(name, &shape, &[rows, shape[1]])?;
        let mut cuts = Vec::with_capacity(pieces.len());
        for p in pieces {
            cuts.push(self.stored_base_rows(p, [total(p), shape[1]], kind)?);
        }
        if cuts.len() == 1 {
            return Ok(cuts.remove(0));
        }
        let quant: Vec<&QuantWeight> = cuts
            .iter()
            .filter_map(|c| match c {
                BaseWeight::Quant(q) => Some(q),
                _ => None,
            })
            .collect();
        if quant.len() == cuts.len()
            && let Ok(q) = QuantWeight::cat_rows(&quant)
        {
            return Ok(BaseWeight::Quant(q));
        }
        let dense = cuts
            .iter()
            .map(|c| c.weight(kind))
            .collect::<lora_core::Result<Vec<_>>>()?;
        Ok(BaseWeight::Dense(Tensor::f_cat(&dense, 0)?))
    }

    fn contains(&self, name: &str) -> bool {
        self.map.diffusers_from_bfl(name).is_some_and(|ps| {
            ps.iter()
                .all(|p| self.inner.contains(&format!("{}{}", self.prefix, p.name)))
        })
    }

    fn origin(&self) -> PathBuf {
        self.inner.origin()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> FluxConfig {
        FluxConfig {
            in_channels: 4,
            num_layers: 1,
            num_single_layers: 1,
            attention_head_dim: 4,
            num_attention_heads: 2,
            joint_attention_dim: 6,
            pooled_projection_dim: 5,
            guidance_embeds: true,
            axes_dims_rope: vec![2, 2],
            ..FluxConfig::default()
        }
    }

    #[test]
    fn fused_rows_round_trip_through_a_bfl_source() {
        let cfg = tiny();
        let map = BflKeyMap::new(&cfg);
        // random diffusers-layout tensors → BFL tensors with the reverse recipes → read back
        let mut diff = HashMap::new();
        let mut bfl = HashMap::new();
        let shape_of = |rows: i64| vec![rows, 3];
        for m in map.modules() {
            for &(bl, dl) in m.kind.leaves() {
                for p in &m.parts {
                    let dname = format!("{}.{dl}", p.module);
                    let full = map
                        .diffusers_from_bfl(&dname)
                        .unwrap()
                        .iter()
                        .map(|x| x.rows)
                        .sum();
                    diff.entry(dname).or_insert_with(|| {
                        Tensor::randn(shape_of(full), (Kind::Float, tch::Device::Cpu))
                    });
                }
                let bname = format!("{}.{bl}", m.bfl);
                let pieces = map.bfl_from_diffusers(&bname).unwrap();
                let cuts: Vec<Tensor> = pieces
                    .iter()
                    .map(|p| diff[&p.name].narrow(0, p.start, p.rows))
                    .collect();
                bfl.insert(
                    format!("model.diffusion_model.{bname}"),
                    Tensor::cat(&cuts, 0),
                );
            }
        }
        let inner = crate::weights::TensorMap::new(&bfl, tch::Device::Cpu);
        let src = BflSource::new(&inner, "model.diffusion_model.", &cfg);
        assert_eq!(diff.len(), map.diffusers_names().count());
        for (name, t) in &diff {
            assert!(src.contains(name), "{name}");
            let back = src.tensor(name, Kind::Float).unwrap().unwrap();
            assert!(back.equal(t), "{name}");
        }
        // the modulation halves are swapped, not copied in order
        let nw = &diff["norm_out.linear.weight"];
        let fw = &bfl["model.diffusion_model.final_layer.adaLN_modulation.1.weight"];
        let d = cfg.inner_dim();
        assert!(fw.narrow(0, 0, d).equal(&nw.narrow(0, d, d)));
        assert!(src.tensor("not.a.tensor", Kind::Float).unwrap().is_none());
        // frozen bases: whole tensors through the inner source, fused cuts dense; same values
        for name in [
            "transformer_blocks.0.ff.net.2.weight",
            "single_transformer_blocks.0.attn.to_k.weight",
            "norm_out.linear.weight",
        ] {
            let t = &diff[name];
            let (o, i) = (t.size()[0], t.size()[1]);
            let b = src.base(name, [o, i], Kind::Float, None).unwrap();
            assert!(b.weight(Kind::Float).unwrap().equal(t), "{name}");
        }
        assert!(
            src.base("norm_out.linear.weight", [1, 3], Kind::Float, None)
                .is_err()
        );
    }

    #[test]
    fn single_block_linear1_is_q_k_v_then_mlp() {
        let cfg = tiny();
        let map = BflKeyMap::new(&cfg);
        let p = map
            .bfl_from_diffusers("single_blocks.0.linear1.weight")
            .unwrap();
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "single_transformer_blocks.0.attn.to_q.weight",
                "single_transformer_blocks.0.attn.to_k.weight",
                "single_transformer_blocks.0.attn.to_v.weight",
                "single_transformer_blocks.0.proj_mlp.weight",
            ]
        );
        let rows: Vec<i64> = p.iter().map(|p| p.rows).collect();
        assert_eq!(rows, [8, 8, 8, 32]);
        let mlp = map
            .diffusers_from_bfl("single_transformer_blocks.0.proj_mlp.bias")
            .unwrap();
        assert_eq!(
            mlp,
            [Piece {
                name: "single_blocks.0.linear1.bias".into(),
                start: 24,
                rows: 32
            }]
        );
    }
}
