//! Injection: models expose their named sites through [`Adaptable`]; [`inject`] adds a LoRA adapter to
//! every site `target_modules` selects, with PEFT's matching semantics.

use crate::config::{LoraConfig, TargetMatcher};
use crate::conv::LoraConv2d;
use crate::embedding::LoraEmbedding;
use crate::error::{Error, Result};
use crate::layer::{LoraLayer, SiteKind};
use crate::linear::LoraLinear;
use tch::{Tensor, nn};

/// A mutable reference to one injectable site.
pub enum SiteMut<'a> {
    /// A linear layer.
    Linear(&'a mut LoraLinear),
    /// A 2-D convolution.
    Conv2d(&'a mut LoraConv2d),
    /// An embedding table.
    Embedding(&'a mut LoraEmbedding),
}

impl SiteMut<'_> {
    /// The site as a [`LoraLayer`].
    pub fn layer(&mut self) -> &mut dyn LoraLayer {
        match self {
            SiteMut::Linear(l) => *l,
            SiteMut::Conv2d(l) => *l,
            SiteMut::Embedding(l) => *l,
        }
    }

    /// The site as a shared [`LoraLayer`].
    pub fn layer_ref(&self) -> &dyn LoraLayer {
        match self {
            SiteMut::Linear(l) => *l,
            SiteMut::Conv2d(l) => *l,
            SiteMut::Embedding(l) => *l,
        }
    }

    /// The wrapped layer type.
    pub fn kind(&self) -> SiteKind {
        self.layer_ref().site_kind()
    }

    /// Frozen parameters of the site (weight + bias).
    fn frozen_params(&self) -> i64 {
        let bias = match self {
            SiteMut::Linear(l) => l.bias().map_or(0, |b| b.numel() as i64),
            SiteMut::Conv2d(l) => l.bias().map_or(0, |b| b.numel() as i64),
            SiteMut::Embedding(_) => 0,
        };
        self.layer_ref().base().numel() + bias
    }
}

/// A model whose LoRA sites can be visited.
pub trait Adaptable {
    /// Calls `f` once per injectable site with its full module path as the reference implementation
    /// names it (HF/diffusers: `"model.layers.0.self_attn.q_proj"`). Stops at the first error `f`
    /// returns and passes it on.
    ///
    /// # Errors
    /// Whatever `f` returns.
    fn visit_sites(&mut self, f: &mut dyn FnMut(&str, SiteMut<'_>) -> Result<()>) -> Result<()>;

    /// All frozen parameters of the model (sites *and* everything else, e.g. norms), when the model
    /// knows them; used for the `all params` figure of [`InjectionReport`]. The default (`None`)
    /// counts only the sites' weights and biases.
    fn frozen_param_count(&self) -> Option<i64> {
        None
    }
}

/// What [`inject`] did.
#[derive(Debug, Clone, PartialEq)]
pub struct InjectionReport {
    /// The adapter name.
    pub adapter_name: String,
    /// Module paths that received the adapter, in visit order.
    pub modules: Vec<String>,
    /// Parameters this injection added.
    pub params_added: i64,
    /// Trainable parameters of the model after injection (all adapters).
    pub trainable_params: i64,
    /// All parameters (frozen + trainable).
    pub all_params: i64,
}

impl InjectionReport {
    /// `100 · trainable / all`.
    pub fn trainable_percent(&self) -> f64 {
        if self.all_params == 0 {
            0.0
        } else {
            100.0 * self.trainable_params as f64 / self.all_params as f64
        }
    }
}

fn thousands(n: i64) -> String {
    let s = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 { format!("-{out}") } else { out }
}

impl std::fmt::Display for InjectionReport {
    /// PEFT's `print_trainable_parameters` line:
    /// `trainable params: 1,234 || all params: 5,678 || trainable%: 21.7330`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trainable params: {} || all params: {} || trainable%: {:.4}",
            thousands(self.trainable_params),
            thousands(self.all_params),
            self.trainable_percent()
        )
    }
}

/// Counts `(trainable, all)` parameters: adapter tensors are trainable; site weights/biases (or the
/// model's [`Adaptable::frozen_param_count`]) are frozen.
///
/// # Errors
/// Errors of the model's visitor.
pub fn count_params(model: &mut dyn Adaptable) -> Result<(i64, i64)> {
    let (mut trainable, mut frozen) = (0i64, 0i64);
    model.visit_sites(&mut |_, site| {
        trainable += site.layer_ref().num_adapter_params();
        frozen += site.frozen_params();
        Ok(())
    })?;
    let frozen = model.frozen_param_count().unwrap_or(frozen);
    Ok((trainable, frozen + trainable))
}

/// Module paths of all sites, in visit order, with their kinds.
///
/// # Errors
/// Errors of the model's visitor.
pub fn site_names(model: &mut dyn Adaptable) -> Result<Vec<(String, SiteKind)>> {
    let mut v = Vec::new();
    model.visit_sites(&mut |name, site| {
        v.push((name.to_string(), site.kind()));
        Ok(())
    })?;
    Ok(v)
}

/// Adds adapter `adapter_name` to every site selected by `cfg.target_modules` and not by
/// `cfg.exclude_modules` (PEFT semantics: list = exact name or `.`-suffix; string = full regex;
/// exclusions first), with per-module rank/alpha from `rank_pattern` / `alpha_pattern`.
/// Adapter tensors are created in `vs` (the adapter VarStore), named
/// `<module>.lora_A.<adapter>.weight` etc.; the base weights are not touched.
///
/// # Errors
/// [`Error::Config`] / [`Error::Regex`] for an invalid config; [`Error::NoTargetMatched`] (listing the
/// existing module names) when nothing matched; errors of [`LoraLayer::add_adapter`] (the sites
/// visited before the failing one keep their adapter).
pub fn inject(
    model: &mut dyn Adaptable,
    cfg: &LoraConfig,
    adapter_name: &str,
    vs: &nn::Path,
) -> Result<InjectionReport> {
    cfg.validate()?;
    let matcher = TargetMatcher::new(cfg)?;
    let mut modules = Vec::new();
    let mut available = Vec::new();
    let mut added = 0i64;
    model.visit_sites(&mut |name, mut site| {
        available.push(name.to_string());
        if !matcher.matches(name, site.kind() == SiteKind::Linear) {
            return Ok(());
        }
        let spec = cfg.spec_for(name);
        added += site.layer().add_adapter(name, adapter_name, &spec, vs)?;
        modules.push(name.to_string());
        Ok(())
    })?;
    if modules.is_empty() {
        let targets = cfg
            .target_modules
            .as_ref()
            .map(ToString::to_string)
            .unwrap_or_default();
        return Err(Error::NoTargetMatched {
            targets,
            available: available.join(", "),
        });
    }
    let (trainable, all) = count_params(model)?;
    Ok(InjectionReport {
        adapter_name: adapter_name.to_string(),
        modules,
        params_added: added,
        trainable_params: trainable,
        all_params: all,
    })
}

/// Merges enabled adapters (all, or only `names`) into every dense base weight. Returns the number of
/// sites touched. See [`LoraLayer::merge`].
///
/// # Errors
/// Errors of [`LoraLayer::merge`], with the module path.
pub fn merge_adapters(
    model: &mut dyn Adaptable,
    names: Option<&[&str]>,
    safe: bool,
) -> Result<usize> {
    let mut n = 0;
    model.visit_sites(&mut |path, mut site| {
        let layer = site.layer();
        let has = match names {
            Some(ns) => ns.iter().any(|name| layer.adapter(name).is_some()),
            None => !layer.adapters().is_empty(),
        };
        if !has {
            return Ok(());
        }
        let present: Option<Vec<&str>> = names.map(|ns| {
            ns.iter()
                .copied()
                .filter(|name| layer.adapter(name).is_some())
                .collect()
        });
        layer.merge(present.as_deref(), safe).map_err(|e| match e {
            Error::NonFinite { adapter, .. } => Error::NonFinite {
                module: path.to_string(),
                adapter,
            },
            other => other,
        })?;
        n += 1;
        Ok(())
    })?;
    Ok(n)
}

/// Unmerges every merged adapter of every site.
///
/// # Errors
/// Errors of [`LoraLayer::unmerge`].
pub fn unmerge_adapters(model: &mut dyn Adaptable) -> Result<()> {
    model.visit_sites(&mut |_, mut site| site.layer().unmerge())
}

/// Switches all adapters of every site on or off (off unmerges first).
///
/// # Errors
/// Errors of [`LoraLayer::set_adapters_enabled`].
pub fn set_adapters_enabled(model: &mut dyn Adaptable, enabled: bool) -> Result<()> {
    model.visit_sites(&mut |_, mut site| site.layer().set_adapters_enabled(enabled))
}

/// Sets the mixing weight of adapter `name` on every site that has it. Returns the site count.
///
/// # Errors
/// [`Error::Adapter`] when no site has the adapter, or it is merged somewhere.
pub fn set_adapter_weight(model: &mut dyn Adaptable, name: &str, weight: f64) -> Result<usize> {
    let mut n = 0;
    model.visit_sites(&mut |_, mut site| {
        let layer = site.layer();
        if layer.adapter(name).is_some() {
            layer.set_adapter_weight(name, weight)?;
            n += 1;
        }
        Ok(())
    })?;
    if n == 0 {
        return Err(Error::Adapter {
            name: name.into(),
            reason: "no site of the model has it".into(),
        });
    }
    Ok(n)
}

/// Enables or disables adapter `name` on every site that has it. Returns the site count.
///
/// # Errors
/// [`Error::Adapter`] when no site has it, or it is merged.
pub fn set_adapter_enabled(model: &mut dyn Adaptable, name: &str, enabled: bool) -> Result<usize> {
    let mut n = 0;
    model.visit_sites(&mut |_, mut site| {
        let layer = site.layer();
        if layer.adapter(name).is_some() {
            layer.set_adapter_enabled(name, enabled)?;
            n += 1;
        }
        Ok(())
    })?;
    if n == 0 {
        return Err(Error::Adapter {
            name: name.into(),
            reason: "no site of the model has it".into(),
        });
    }
    Ok(n)
}

/// Optimizer parameter groups for LoRA+ (Hayou et al. 2024, arXiv:2402.12354; grouping as PEFT's
/// `peft/optimizers/loraplus.py::create_loraplus_optimizer`): B matrices and 1-D parameters (DoRA
/// magnitudes) train at `lr · lr_ratio_b`, A matrices at `lr`, embedding adapters at their own rate.
#[derive(Debug)]
pub struct ParamGroups {
    /// `lora_A` of Linear / Conv2d sites (learning rate `lr`).
    pub a: Vec<Tensor>,
    /// `lora_B` and DoRA magnitudes (learning rate `lr · lr_ratio_b`).
    pub b: Vec<Tensor>,
    /// `lora_embedding_A/B` (PEFT's `loraplus_lr_embedding`, default 1e-6).
    pub embedding: Vec<Tensor>,
    /// The B-side learning-rate ratio (LoRA+ paper recommends 16 for many tasks; 1 = plain LoRA).
    pub lr_ratio_b: f64,
}

impl ParamGroups {
    /// All tensors of all groups.
    pub fn all(&self) -> Vec<Tensor> {
        self.a
            .iter()
            .chain(&self.b)
            .chain(&self.embedding)
            .map(Tensor::shallow_clone)
            .collect()
    }

    /// The learning rate of the B group for a base rate `lr`.
    pub fn lr_b(&self, lr: f64) -> f64 {
        lr * self.lr_ratio_b
    }
}

/// Collects the trainable tensors of adapter `adapter_name` (all adapters when `None`) into LoRA+
/// groups with the B-side ratio `lr_ratio_b`.
///
/// # Errors
/// [`Error::Config`] when `lr_ratio_b` is not positive and finite; [`Error::Adapter`] when no site
/// has the named adapter.
pub fn param_groups(
    model: &mut dyn Adaptable,
    adapter_name: Option<&str>,
    lr_ratio_b: f64,
) -> Result<ParamGroups> {
    if !(lr_ratio_b.is_finite() && lr_ratio_b > 0.0) {
        return Err(Error::Config(format!(
            "loraplus_lr_ratio must be positive, got {lr_ratio_b}"
        )));
    }
    let mut g = ParamGroups {
        a: Vec::new(),
        b: Vec::new(),
        embedding: Vec::new(),
        lr_ratio_b,
    };
    model.visit_sites(&mut |_, site| {
        let layer = site.layer_ref();
        for ad in layer
            .adapters()
            .iter()
            .filter(|a| adapter_name.is_none_or(|n| a.name() == n))
        {
            if layer.site_kind() == SiteKind::Embedding {
                g.embedding
                    .extend([ad.lora_a().shallow_clone(), ad.lora_b().shallow_clone()]);
            } else {
                g.a.push(ad.lora_a().shallow_clone());
                g.b.push(ad.lora_b().shallow_clone());
                if let Some(m) = ad.magnitude() {
                    g.b.push(m.shallow_clone());
                }
            }
        }
        Ok(())
    })?;
    if let Some(n) = adapter_name
        && g.a.is_empty()
        && g.embedding.is_empty()
    {
        return Err(Error::Adapter {
            name: n.into(),
            reason: "no site of the model has it".into(),
        });
    }
    Ok(g)
}
