//! What every LoRA layer shares: the [`Adapter`] (A, B, optional DoRA magnitude, scaling, weight),
//! the [`LoraLayer`] trait, and merge / unmerge on a dense base.

use crate::base::BaseWeight;
use crate::config::{AdapterSpec, InitLoraWeights};
use crate::error::{Error, Result, TchContext};
use tch::{Kind, Tensor, nn};

/// The kind of layer a LoRA site wraps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SiteKind {
    /// `nn.Linear`: A `[r, in]`, B `[out, r]`.
    Linear,
    /// `nn.Conv2d` (LoCon): A `[r, in, kh, kw]` (the base's stride / padding / dilation), B `[out, r, 1, 1]`.
    Conv2d,
    /// `nn.Embedding`: A `[r, num_embeddings]`, B `[dim, r]` (PEFT `lora_embedding_A/B`).
    Embedding,
}

/// One named LoRA adapter on one layer.
///
/// Tensors are variables of the adapter VarStore (trainable). The branch adds
/// `B(A(dropout(x))) · scaling · weight` to the base output; with DoRA the PEFT formula of
/// `peft/tuners/lora/dora.py` applies (see [`crate::linear::LoraLinear::forward_t`]).
#[derive(Debug)]
pub struct Adapter {
    pub(crate) name: String,
    pub(crate) lora_a: Tensor,
    pub(crate) lora_b: Tensor,
    pub(crate) magnitude: Option<Tensor>,
    pub(crate) spec: AdapterSpec,
    pub(crate) weight: f64,
    pub(crate) enabled: bool,
    pub(crate) merged: bool,
    /// DoRA weight norm cached at merge time (PEFT caches it the same way for unmerge).
    pub(crate) merged_norm: Option<Tensor>,
}

impl Adapter {
    /// The adapter name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// A (`lora_A` / `lora_down`): `[r, in]`, `[r, in, kh, kw]` (conv) or `[r, num_embeddings]`.
    pub fn lora_a(&self) -> &Tensor {
        &self.lora_a
    }
    /// B (`lora_B` / `lora_up`): `[out, r]`, `[out, r, 1, 1]` (conv) or `[dim, r]`.
    pub fn lora_b(&self) -> &Tensor {
        &self.lora_b
    }
    /// DoRA magnitude `[out]`, when DoRA is on.
    pub fn magnitude(&self) -> Option<&Tensor> {
        self.magnitude.as_ref()
    }
    /// The resolved settings (rank, alpha, rsLoRA, DoRA, dropout, init).
    pub fn spec(&self) -> &AdapterSpec {
        &self.spec
    }
    /// Rank.
    pub fn rank(&self) -> i64 {
        self.spec.rank
    }
    /// Alpha.
    pub fn alpha(&self) -> f64 {
        self.spec.alpha
    }
    /// `alpha / r` (or `alpha / sqrt(r)`).
    pub fn scaling(&self) -> f64 {
        self.spec.scaling()
    }
    /// The mixing weight (1.0 by default); the branch is multiplied by `scaling · weight`.
    pub fn weight(&self) -> f64 {
        self.weight
    }
    /// Whether the adapter takes part in forward.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }
    /// Whether the adapter is merged into the base weight.
    pub fn is_merged(&self) -> bool {
        self.merged
    }
    /// The trainable tensors: A, B (and the DoRA magnitude).
    pub fn parameters(&self) -> Vec<Tensor> {
        let mut v = vec![self.lora_a.shallow_clone(), self.lora_b.shallow_clone()];
        if let Some(m) = &self.magnitude {
            v.push(m.shallow_clone());
        }
        v
    }
    /// Number of trainable parameters.
    pub fn num_params(&self) -> i64 {
        self.parameters().iter().map(|t| t.numel() as i64).sum()
    }
    /// Effective branch multiplier `scaling · weight`.
    pub(crate) fn effective_scale(&self) -> f64 {
        self.spec.scaling() * self.weight
    }
    /// Active in forward through the branch (enabled and not merged).
    pub(crate) fn in_branch(&self) -> bool {
        self.enabled && !self.merged
    }
}

/// Operations every LoRA layer supports.
pub trait LoraLayer {
    /// The wrapped layer type.
    fn site_kind(&self) -> SiteKind;
    /// The frozen base weight.
    fn base(&self) -> &BaseWeight;
    /// The adapters, in insertion order.
    fn adapters(&self) -> &[Adapter];
    /// Mutable access to the adapters (internal bookkeeping; tensors are VarStore variables).
    fn adapters_mut(&mut self) -> &mut Vec<Adapter>;
    /// Shapes `(A, B)` an adapter of rank `r` has on this layer.
    fn adapter_shapes(&self, r: i64) -> (Vec<i64>, Vec<i64>);
    /// The (unscaled) product `B·A` laid out like the base weight, f32:
    /// Linear `[out, in]`, Conv2d `[out, in, kh, kw]`, Embedding `[num_embeddings, dim]`.
    fn lora_product(&self, adapter: &Adapter) -> Result<Tensor>;
    /// Whether all adapters are switched off (PEFT `disable_adapter`).
    fn adapters_disabled(&self) -> bool;
    /// Sets the global disabled flag (after unmerging, see [`LoraLayer::set_adapters_enabled`]).
    fn set_disabled_flag(&mut self, disabled: bool);

    /// Adds adapter `name` with `spec`, creating its tensors in `vs` under
    /// `<path>.lora_A.<name>.weight`, `<path>.lora_B.<name>.weight` (Embedding:
    /// `<path>.lora_embedding_A.<name>`, `<path>.lora_embedding_B.<name>`) and DoRA
    /// `<path>.lora_magnitude_vector.<name>.weight`, where `path` is the site's module path.
    /// Returns the number of parameters added.
    ///
    /// # Errors
    /// [`Error::Adapter`] when the name exists or contains a `.`; [`Error::Config`] for a bad rank;
    /// [`Error::Unsupported`] for DoRA on Embedding; [`Error::Torch`] on allocation failure.
    fn add_adapter(
        &mut self,
        path: &str,
        name: &str,
        spec: &AdapterSpec,
        vs: &nn::Path,
    ) -> Result<i64> {
        let ad = create_adapter(self, path, name, spec, vs)?;
        let n = ad.num_params();
        self.adapters_mut().push(ad);
        Ok(n)
    }

    /// The adapter called `name`.
    fn adapter(&self, name: &str) -> Option<&Adapter> {
        self.adapters().iter().find(|a| a.name == name)
    }

    /// Sets the mixing weight of adapter `name` (its branch becomes `B·A·x · scaling · weight`).
    ///
    /// # Errors
    /// [`Error::Adapter`] when the adapter is missing or merged (unmerge first).
    fn set_adapter_weight(&mut self, name: &str, weight: f64) -> Result<()> {
        let ad = find_mut(self.adapters_mut(), name)?;
        if ad.merged {
            return Err(Error::Adapter {
                name: name.into(),
                reason: "is merged; unmerge before changing its weight".into(),
            });
        }
        ad.weight = weight;
        Ok(())
    }

    /// Enables or disables one adapter (a disabled adapter is skipped in forward and in merges).
    ///
    /// # Errors
    /// [`Error::Adapter`] when missing or merged.
    fn set_adapter_enabled(&mut self, name: &str, enabled: bool) -> Result<()> {
        let ad = find_mut(self.adapters_mut(), name)?;
        if ad.merged && !enabled {
            return Err(Error::Adapter {
                name: name.into(),
                reason: "is merged; unmerge before disabling it".into(),
            });
        }
        ad.enabled = enabled;
        Ok(())
    }

    /// Switches all adapters on or off (PEFT `enable_adapters` / `disable_adapter`); switching off
    /// first unmerges merged adapters, so the output is the base layer's.
    ///
    /// # Errors
    /// Errors of [`LoraLayer::unmerge`].
    fn set_adapters_enabled(&mut self, enabled: bool) -> Result<()> {
        if !enabled {
            self.unmerge()?;
        }
        self.set_disabled_flag(!enabled);
        Ok(())
    }

    /// The weight delta adapter `name` adds, laid out like the base weight (f32):
    /// `B·A · scaling · weight` (PEFT `get_delta_weight`).
    ///
    /// # Errors
    /// [`Error::Adapter`] when missing; [`Error::Torch`] on op failure.
    fn delta_weight(&self, name: &str) -> Result<Tensor> {
        let ad = self.adapter(name).ok_or_else(|| missing(name))?;
        self.lora_product(ad)?
            .f_mul_scalar(ad.effective_scale())
            .ctx(|| "scaling delta weight")
    }

    /// Merges the enabled, unmerged adapters (or only `names`) into the dense base weight in place
    /// (PEFT `merge`; DoRA: `W' = m / ‖W + ΔW‖ · (W + ΔW)` row-wise). With `safe`, the merged weight
    /// is computed first and refused if it holds NaN/Inf, leaving the base untouched.
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a quantized base; [`Error::NonFinite`] (safe merge);
    /// [`Error::Adapter`] for an unknown name.
    fn merge(&mut self, names: Option<&[&str]>, safe: bool) -> Result<()> {
        let w = self.base().dense("merge")?;
        let selected: Vec<String> = match names {
            Some(n) => {
                for name in n {
                    self.adapter(name).ok_or_else(|| missing(name))?;
                }
                n.iter().map(|s| s.to_string()).collect()
            }
            None => self.adapters().iter().map(|a| a.name.clone()).collect(),
        };
        let norm_dims = norm_dims(self.site_kind(), &w);
        for name in selected {
            let Some(ad) = self.adapter(&name) else {
                continue;
            };
            if ad.merged || !ad.enabled {
                continue;
            }
            let _g = tch::no_grad_guard();
            let delta = self.delta_weight(&name)?;
            let ctx = || format!("merging adapter {name:?}");
            let wf = w.f_to_kind(Kind::Float).ctx(ctx)?;
            let summed = wf.f_add(&delta).ctx(ctx)?;
            let (merged, norm) = match (&ad.magnitude, &norm_dims) {
                (Some(m), Some(dims)) => {
                    let norm = summed
                        .f_norm_scalaropt_dim(2, dims.as_slice(), false)
                        .ctx(ctx)?;
                    let factor = dora_factor(m, &norm, w.dim()).ctx(ctx)?;
                    (summed.f_mul(&factor).ctx(ctx)?, Some(norm))
                }
                _ => (summed, None),
            };
            if safe && !bool_all_finite(&merged)? {
                return Err(Error::NonFinite {
                    module: format!("{:?}", self.site_kind()),
                    adapter: name,
                });
            }
            let mut dst = w.shallow_clone();
            dst.f_copy_(&merged.f_to_kind(w.kind()).ctx(ctx)?)
                .ctx(ctx)?;
            let ad = find_mut(self.adapters_mut(), &name)?;
            ad.merged = true;
            ad.merged_norm = norm;
        }
        Ok(())
    }

    /// Unmerges every merged adapter, in reverse merge order (PEFT `unmerge`).
    ///
    /// # Errors
    /// [`Error::Unsupported`] on a quantized base; [`Error::Torch`] on op failure.
    fn unmerge(&mut self) -> Result<()> {
        if !self.adapters().iter().any(|a| a.merged) {
            return Ok(());
        }
        let w = self.base().dense("unmerge")?;
        let names: Vec<String> = self
            .adapters()
            .iter()
            .rev()
            .filter(|a| a.merged)
            .map(|a| a.name.clone())
            .collect();
        for name in names {
            let _g = tch::no_grad_guard();
            let delta = self.delta_weight(&name)?;
            let ctx = || format!("unmerging adapter {name:?}");
            let ad = self.adapter(&name).ok_or_else(|| missing(&name))?;
            let mut wf = w.f_to_kind(Kind::Float).ctx(ctx)?;
            if let (Some(m), Some(norm)) = (&ad.magnitude, &ad.merged_norm) {
                let factor = dora_factor(m, norm, w.dim()).ctx(ctx)?;
                wf = wf.f_div(&factor).ctx(ctx)?;
            }
            let restored = wf.f_sub(&delta).ctx(ctx)?;
            let mut dst = w.shallow_clone();
            dst.f_copy_(&restored.f_to_kind(w.kind()).ctx(ctx)?)
                .ctx(ctx)?;
            let ad = find_mut(self.adapters_mut(), &name)?;
            ad.merged = false;
            ad.merged_norm = None;
        }
        Ok(())
    }

    /// Trainable parameters of all adapters on this layer.
    fn num_adapter_params(&self) -> i64 {
        self.adapters().iter().map(Adapter::num_params).sum()
    }
}

pub(crate) fn missing(name: &str) -> Error {
    Error::Adapter {
        name: name.into(),
        reason: "no such adapter on this layer".into(),
    }
}

pub(crate) fn find_mut<'a>(ads: &'a mut [Adapter], name: &str) -> Result<&'a mut Adapter> {
    ads.iter_mut()
        .find(|a| a.name == name)
        .ok_or_else(|| missing(name))
}

/// Dimensions over which DoRA takes the weight norm (all but the output dim), `None` for Embedding.
pub(crate) fn norm_dims(kind: SiteKind, w: &Tensor) -> Option<Vec<i64>> {
    match kind {
        SiteKind::Embedding => None,
        _ => Some((1..w.dim() as i64).collect()),
    }
}

/// `magnitude / norm` reshaped to broadcast over a weight of `dim` dimensions (`[out, 1, ...]`).
pub(crate) fn dora_factor(
    m: &Tensor,
    norm: &Tensor,
    dim: usize,
) -> std::result::Result<Tensor, tch::TchError> {
    let mut shape = vec![-1i64];
    shape.extend(std::iter::repeat_n(1, dim.saturating_sub(1)));
    m.f_to_kind(Kind::Float)?
        .f_div(norm)?
        .f_reshape(shape.as_slice())
}

fn bool_all_finite(t: &Tensor) -> Result<bool> {
    let ctx = || "checking merged weight for NaN/Inf";
    let all = t.f_isfinite().and_then(|f| f.f_all()).ctx(ctx)?;
    Ok(all.f_int64_value(&[]).ctx(ctx)? != 0)
}

/// Splits a module path into VarStore path components.
pub(crate) fn sub_path<'a>(vs: &nn::Path<'a>, module: &str) -> Result<nn::Path<'a>> {
    let mut p = vs.clone();
    if module.is_empty() {
        return Err(Error::Config("empty module path".into()));
    }
    for c in module.split('.') {
        if c.is_empty() {
            return Err(Error::Config(format!(
                "module path {module:?} has an empty component"
            )));
        }
        p = p.sub(c);
    }
    Ok(p)
}

/// PEFT's `kaiming_uniform_(a=sqrt(5))` bound for a weight of `shape`: gain `sqrt(2/(1+5))`,
/// `bound = gain · sqrt(3 / fan_in) = 1 / sqrt(fan_in)` with `fan_in = shape[1] · prod(shape[2..])`
/// (`torch/nn/init.py`).
pub(crate) fn kaiming_a_sqrt5_bound(shape: &[i64]) -> f64 {
    let fan_in: i64 = shape.iter().skip(1).product();
    1.0 / (fan_in.max(1) as f64).sqrt()
}

fn create_adapter<L: LoraLayer + ?Sized>(
    layer: &L,
    path: &str,
    name: &str,
    spec: &AdapterSpec,
    vs: &nn::Path,
) -> Result<Adapter> {
    if name.is_empty() || name.contains('.') {
        return Err(Error::Adapter {
            name: name.into(),
            reason: "adapter names must be non-empty and contain no '.'".into(),
        });
    }
    if layer.adapter(name).is_some() {
        return Err(Error::Adapter {
            name: name.into(),
            reason: format!("already exists on {path}"),
        });
    }
    if spec.rank <= 0 {
        return Err(Error::Config(format!(
            "rank for {path} must be positive, got {}",
            spec.rank
        )));
    }
    let kind = layer.site_kind();
    if spec.use_dora && kind == SiteKind::Embedding {
        return Err(Error::Unsupported(format!(
            "DoRA on the Embedding site {path}"
        )));
    }
    if vs.device() != layer.base().device() {
        return Err(Error::Config(format!(
            "adapter VarStore is on {:?} but the base weight of {path} is on {:?}",
            vs.device(),
            layer.base().device()
        )));
    }
    let (a_shape, b_shape) = layer.adapter_shapes(spec.rank);
    let site = sub_path(vs, path)?;
    let (a_path, b_path, a_var, b_var) = match kind {
        SiteKind::Embedding => (
            site.sub("lora_embedding_A"),
            site.sub("lora_embedding_B"),
            name,
            name,
        ),
        _ => (
            site.sub("lora_A").sub(name),
            site.sub("lora_B").sub(name),
            "weight",
            "weight",
        ),
    };
    for (p, v) in [(&a_path, a_var), (&b_path, b_var)] {
        if p.get(v).is_some() {
            return Err(Error::Adapter {
                name: name.into(),
                reason: format!("variable {} already exists in the VarStore", p.path(v)),
            });
        }
    }
    let ctx = || format!("creating adapter {name:?} on {path}");
    let r = spec.rank as f64;
    let (a_init, b_init) = match (kind, spec.init) {
        // PEFT `reset_lora_parameters` for embeddings: A zeros, B normal(0, 1).
        (SiteKind::Embedding, InitLoraWeights::Random) => (
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        ),
        (SiteKind::Embedding, _) => (
            nn::Init::Const(0.0),
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0,
            },
        ),
        (_, InitLoraWeights::Kaiming) => {
            let b = kaiming_a_sqrt5_bound(&a_shape);
            (nn::Init::Uniform { lo: -b, up: b }, nn::Init::Const(0.0))
        }
        (_, InitLoraWeights::Gaussian) => (
            nn::Init::Randn {
                mean: 0.0,
                stdev: 1.0 / r,
            },
            nn::Init::Const(0.0),
        ),
        (_, InitLoraWeights::Random) => {
            let ba = kaiming_a_sqrt5_bound(&a_shape);
            let bb = kaiming_a_sqrt5_bound(&b_shape);
            (
                nn::Init::Uniform { lo: -ba, up: ba },
                nn::Init::Uniform { lo: -bb, up: bb },
            )
        }
    };
    let lora_a = a_path.f_var(a_var, &a_shape, a_init).ctx(ctx)?;
    let lora_b = b_path.f_var(b_var, &b_shape, b_init).ctx(ctx)?;
    let mut ad = Adapter {
        name: name.into(),
        lora_a,
        lora_b,
        magnitude: None,
        spec: *spec,
        weight: 1.0,
        enabled: true,
        merged: false,
        merged_norm: None,
    };
    if spec.use_dora {
        // PEFT `DoraLinearLayer.update_layer`: magnitude = ‖W + scaling·B·A‖ per output row.
        let w = layer.base().weight(Kind::Float)?;
        let dims = norm_dims(kind, &w).unwrap_or_default();
        let norm = {
            let _g = tch::no_grad_guard();
            let delta = layer
                .lora_product(&ad)?
                .f_mul_scalar(spec.scaling())
                .ctx(ctx)?;
            w.f_add(&delta)
                .and_then(|s| s.f_norm_scalaropt_dim(2, dims.as_slice(), false))
                .ctx(ctx)?
        };
        let mp = site.sub("lora_magnitude_vector").sub(name);
        let m = mp.f_zeros("weight", &[norm.size()[0]]).ctx(ctx)?;
        {
            let _g = tch::no_grad_guard();
            let mut dst = m.shallow_clone();
            dst.f_copy_(&norm).ctx(ctx)?;
        }
        ad.magnitude = Some(m);
    }
    Ok(ad)
}

/// Adds the adapter branches of `layer` to the base output `base_out` (no bias) and returns the
/// sum. `branch(ad, x_dropped)` computes `B(A(x))` for one adapter; `base_on(x_dropped)` recomputes
/// the base output on the dropped-out input (DoRA in training, as PEFT does).
pub(crate) fn add_branches<L: LoraLayer + ?Sized>(
    layer: &L,
    x: &Tensor,
    base_out: &Tensor,
    train: bool,
    branch: &dyn Fn(&Adapter, &Tensor) -> std::result::Result<Tensor, tch::TchError>,
    base_on: &dyn Fn(&Tensor, &Tensor) -> std::result::Result<Tensor, tch::TchError>,
) -> Result<Tensor> {
    let mut y = base_out.shallow_clone();
    if layer.adapters_disabled() {
        return Ok(y);
    }
    let out_kind = base_out.kind();
    // output-channel axis: last for Linear/Embedding, 1 for Conv2d ([N, C, H, W])
    let channel_axis = if layer.site_kind() == SiteKind::Conv2d {
        1
    } else {
        -1
    };
    for ad in layer.adapters().iter().filter(|a| a.in_branch()) {
        let ctx = || format!("adapter {:?} forward", ad.name);
        let ak = ad.lora_a.kind();
        let xa = if x.kind() == ak || layer.site_kind() == SiteKind::Embedding {
            x.shallow_clone()
        } else {
            x.f_to_kind(ak).ctx(ctx)?
        };
        let p = ad.spec.dropout;
        let dropped = train && p > 0.0 && layer.site_kind() != SiteKind::Embedding;
        let xd = if dropped {
            xa.f_dropout(p, true).ctx(ctx)?
        } else {
            xa
        };
        let s = ad.effective_scale();
        let lora = branch(ad, &xd).ctx(ctx)?;
        let delta = match &ad.magnitude {
            None => lora.f_mul_scalar(s).ctx(ctx)?,
            Some(m) => {
                // peft/tuners/lora/dora.py (DoraLinearLayer / _DoraConvNdLayer .forward):
                // ‖W + s·B·A‖ detached; scale = m / norm;
                // result = (scale − 1)·base(x) + scale·B(A(x))·s
                let w = layer.base().weight(ak)?;
                let dims = norm_dims(layer.site_kind(), &w).unwrap_or_default();
                let (norm, base_x) = (|| {
                    let lw = layer_product_detached(layer, ad)?;
                    let norm = w
                        .f_add(&lw.f_mul_scalar(s)?)?
                        .f_norm_scalaropt_dim(2, dims.as_slice(), false)?
                        .f_detach()?;
                    let base_x = if dropped {
                        base_on(&xd, &w)?
                    } else {
                        base_out.f_to_kind(ak)?
                    };
                    Ok::<_, tch::TchError>((norm, base_x))
                })()
                .ctx(ctx)?;
                let scale = m.f_div(&norm).ctx(ctx)?;
                let mut shape = vec![1i64; base_x.dim()];
                let axis = if channel_axis < 0 {
                    base_x.dim() - 1
                } else {
                    channel_axis as usize
                };
                shape[axis] = -1;
                let scale = scale.f_reshape(shape.as_slice()).ctx(ctx)?;
                (|| {
                    scale
                        .f_sub_scalar(1.0)?
                        .f_mul(&base_x)?
                        .f_add(&scale.f_mul(&lora)?.f_mul_scalar(s)?)
                })()
                .ctx(ctx)?
            }
        };
        let delta = if delta.kind() == out_kind {
            delta
        } else {
            delta.f_to_kind(out_kind).ctx(ctx)?
        };
        y = y.f_add(&delta).ctx(ctx)?;
    }
    Ok(y)
}

fn layer_product_detached<L: LoraLayer + ?Sized>(
    layer: &L,
    ad: &Adapter,
) -> std::result::Result<Tensor, tch::TchError> {
    let _g = tch::no_grad_guard();
    layer
        .lora_product(ad)
        .map_err(|e| tch::TchError::Torch(e.to_string()))
}
