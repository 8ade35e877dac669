//! LoRA on a linear layer.

use crate::base::BaseWeight;
use crate::error::{Error, Result, TchContext};
use crate::layer::{Adapter, LoraLayer, SiteKind, add_branches};
use tch::{Kind, Tensor};

/// `x·wᵀ` (`F.linear` without a bias; `x` `[..., in]`, `w` `[out, in]` → `[..., out]`) under the
/// calling thread's autocast state, the product every linear of this crate and of lora-models'
/// models goes through. It is libtorch's `linear`, except under bf16 autocast on a CPU where
/// libtorch has no fast bf16 GEMM ([`crate::sys::cpu_has_fast_bf16_gemm`]): there it is
/// [`crate::sys::bf16_linear`], autocast's numbers (bf16 operands, f32 sums, a bf16 result) by f32
/// GEMMs, the same function up to the summation order at about a tenth of the time forward and
/// less backward (measured on an AVX2 CPU: 16 vs 111 GFLOP/s for `x·Wᵀ`, 1.7 vs 72 for `g·W`).
/// And an f32 product on a CPU where [`crate::sys::cpu_f32_gemm_by_onednn`] holds (AMD with
/// AVX-512) goes through oneDNN ([`crate::sys::f32_linear`]): the same function, summed in
/// another order.
///
/// # Errors
/// [`tch::TchError`] when the shapes do not fit or an op fails.
pub fn linear_product(x: &Tensor, w: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
    if x.kind() != Kind::Double && bf16_autocast_by_f32(x.device())? {
        return Ok(crate::sys::bf16_linear(x, w)?);
    }
    if f32_by_onednn(x, w)? {
        return Ok(crate::sys::f32_linear(x, w)?);
    }
    x.f_linear::<Tensor>(w, None)
}

/// True when `x·wᵀ` is an f32 product on the CPU outside autocast and this CPU multiplies f32
/// by oneDNN ([`crate::sys::cpu_f32_gemm_by_onednn`]), the LoRA factors' products included: on
/// such a CPU (AMD, where MKL takes its generic path) MKL's small GEMMs took 127 ms of a 2-core
/// fp32 step of SmolLM2-135M at rank 8; with the factors on oneDNN 17–18 ms of them are left,
/// the A factors' weight gradients (libtorch's profiler on the `bench-train` job).
fn f32_by_onednn(x: &Tensor, w: &Tensor) -> std::result::Result<bool, tch::TchError> {
    if x.device() != tch::Device::Cpu
        || x.kind() != Kind::Float
        || w.kind() != Kind::Float
        || w.dim() != 2
        || !crate::sys::cpu_f32_gemm_by_onednn()
    {
        return Ok(false);
    }
    Ok(!crate::sys::autocast_state(tch::Device::Cpu)?.enabled)
}

/// The frozen product `x·Wᵀ` of a base weight (`x` `[..., in]`, W `[out, in]` → `[..., out]`,
/// no bias), as every LoRA linear computes it: a quantized weight through
/// [`crate::quant::QuantWeight::linear`] (tile by tile, no dense copy kept for the backward
/// pass), a dense or offloaded one by [`linear_product`] on its weight in `x`'s dtype. Also the
/// product of a tied LM head, whose weight is the embedding's.
///
/// # Errors
/// [`Error::Shape`] / [`Error::Torch`] when `x` does not fit the weight or an op fails.
pub fn base_product(base: &BaseWeight, x: &Tensor) -> Result<Tensor> {
    base.with_resident(|base| match base {
        BaseWeight::Quant(q) => q.linear(x),
        b => {
            let w = b.weight(x.kind())?;
            linear_product(x, &w)
                .ctx(|| format!("linear forward {:?} on input {:?}", b.shape(), x.size()))
        }
    })
}

/// `y + h·bᵀ` (`y` `[n, out]`, `h` `[n, r]`, `b` `[out, r]`): one `addmm`, or where
/// [`linear_product`] would hand `h·bᵀ` to oneDNN, that product added to `y`.
fn add_product(y: &Tensor, h: &Tensor, b: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
    if f32_by_onednn(h, b)? {
        return y.f_add(&crate::sys::f32_linear(h, b)?);
    }
    y.f_addmm(h, &b.f_tr()?)
}

/// True when bf16 autocast is on for `device` on this thread, `device` is the CPU and libtorch
/// has no fast bf16 GEMM there ([`crate::sys::cpu_has_fast_bf16_gemm`], read once): then
/// [`linear_product`] and the other matrix products of this workspace compute autocast's bf16
/// numbers by f32 GEMMs over the widened bf16 operands, rounding each result to bf16.
///
/// # Errors
/// [`tch::TchError`] when the autocast state cannot be read.
pub fn bf16_autocast_by_f32(device: tch::Device) -> std::result::Result<bool, tch::TchError> {
    static FAST_BF16: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if device != tch::Device::Cpu || *FAST_BF16.get_or_init(crate::sys::cpu_has_fast_bf16_gemm) {
        return Ok(false);
    }
    let ac = crate::sys::autocast_state(device)?;
    Ok(ac.enabled && ac.dtype == Some(Kind::BFloat16))
}

/// A frozen linear layer (`y = x·Wᵀ + b`) plus zero or more named LoRA adapters.
///
/// # Shapes
/// - base weight `[out, in]` (dense or quantized), bias `[out]`;
/// - adapter A `[r, in]`, B `[out, r]`, DoRA magnitude `[out]`;
/// - input `[..., in]` → output `[..., out]`.
///
/// Forward (PEFT `peft/tuners/lora/layer.py::Linear.forward`):
/// `y = x·Wᵀ + b + Σ_adapters B(A(dropout(x))) · scaling · weight`, dropout only when training; the
/// base runs in `x`'s dtype, each branch in its adapter's dtype and is cast back.
#[derive(Debug)]
pub struct LoraLinear {
    base: BaseWeight,
    bias: Option<Tensor>,
    adapters: Vec<Adapter>,
    disabled: bool,
}

/// The outputs of sibling linears ([`LoraLinear::forward_siblings_grouped`]).
#[derive(Debug)]
pub enum SiblingOutputs {
    /// Side by side in one tensor `[..., Σ outᵢ]`, in site order.
    Joined(Tensor),
    /// One tensor per site, `[..., outᵢ]`.
    Split(Vec<Tensor>),
}

impl LoraLinear {
    /// Wraps a frozen base weight `[out, in]` and optional bias `[out]`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the weight is not 2-D or the bias is not `[out]`.
    pub fn new(base: BaseWeight, bias: Option<Tensor>) -> Result<Self> {
        let s = base.shape();
        if s.len() != 2 {
            return Err(Error::Shape {
                key: "linear weight".into(),
                expected: vec![-1, -1],
                found: s,
            });
        }
        if let Some(b) = &bias
            && b.size() != [s[0]]
        {
            return Err(Error::Shape {
                key: "linear bias".into(),
                expected: vec![s[0]],
                found: b.size(),
            });
        }
        Ok(Self {
            base,
            bias,
            adapters: Vec::new(),
            disabled: false,
        })
    }

    /// Input features.
    pub fn in_features(&self) -> i64 {
        self.base.shape()[1]
    }

    /// Output features.
    pub fn out_features(&self) -> i64 {
        self.base.shape()[0]
    }

    /// The frozen bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// Replaces the frozen base weight by `base` (the same logical shape: the same weight held
    /// another way — quantized, moved, offloaded) and returns the old one. Adapters are kept.
    ///
    /// # Errors
    /// [`Error::Shape`] when `base`'s shape differs from the current one (the layer is left
    /// unchanged).
    pub fn replace_base(&mut self, base: BaseWeight) -> Result<BaseWeight> {
        if base.shape() != self.base.shape() {
            return Err(Error::Shape {
                key: "replacement linear weight".into(),
                expected: self.base.shape(),
                found: base.shape(),
            });
        }
        Ok(std::mem::replace(&mut self.base, base))
    }

    /// Moves the frozen parts (base weight and bias) to `device`: a dense or quantized base is
    /// copied there as stored; an offloaded base keeps its host copy and computes on `device`
    /// from now on ([`BaseWeight::moved_to`]). Adapters are not moved (they live in their
    /// `VarStore`: inject them on the device after moving the model).
    ///
    /// # Errors
    /// [`Error::Torch`] when a copy fails (the layer is left unchanged).
    pub fn move_frozen(&mut self, device: tch::Device) -> Result<()> {
        let base = self.base.moved_to(device)?;
        let bias = match &self.bias {
            Some(b) => Some(
                b.f_to_device(device)
                    .ctx(|| format!("moving a bias {:?} to {device:?}", b.size()))?,
            ),
            None => None,
        };
        self.base = base;
        self.bias = bias;
        Ok(())
    }

    /// Forward pass; `x` `[..., in]` → `[..., out]` in `x`'s dtype. `train` turns dropout on.
    ///
    /// DoRA adapters follow `peft/tuners/lora/dora.py::DoraLinearLayer.forward`:
    /// `n = ‖W + s·B·A‖₂` per output row (detached), `g = m / n`,
    /// `y += (g − 1)·(x·Wᵀ) + g·B(A(x))·s`.
    ///
    /// # Errors
    /// [`Error::Torch`] when a shape does not fit or an op fails.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let base_out = base_product(&self.base, x)?;
        self.forward_from_base(x, base_out, train)
    }

    /// [`LoraLinear::forward_t`] given the frozen product `base_out` = `x·Wᵀ` (`[..., out]`,
    /// without the bias), computed by the caller — e.g. one GEMM for sibling projections that
    /// share their input, split into views: adds the adapters' branches and the bias.
    ///
    /// # Errors
    /// [`Error::Torch`] when a shape does not fit or an op fails.
    pub fn forward_from_base(&self, x: &Tensor, base_out: Tensor, train: bool) -> Result<Tensor> {
        let ctx = || {
            format!(
                "linear forward {:?} on input {:?}",
                self.base.shape(),
                x.size()
            )
        };
        let y = if self.plain_branches(x, &base_out) {
            self.add_plain_branches(x, base_out, train).ctx(ctx)?
        } else {
            add_branches(
                self,
                x,
                &base_out,
                train,
                &|ad, xd| linear_product(&linear_product(xd, &ad.lora_a)?, &ad.lora_b),
                &|xd, w| linear_product(xd, w),
            )?
        };
        self.add_bias(y).ctx(ctx)
    }

    /// [`LoraLinear::forward_from_base`] of sibling layers that read the same input `x`, given
    /// their frozen products side by side: `base_out` `[..., Σ outᵢ]` (e.g. one GEMM over the
    /// siblings' stacked weights, q/k/v or gate/up) → each site's output `[..., outᵢ]` in site
    /// order, as each site's own forward would give.
    ///
    /// When every site holds exactly one active plain LoRA adapter (no DoRA, dropout off or not
    /// training) in `x`'s dtype, the branches are computed together as well:
    /// `h = x·[A₁; …; Aₙ]ᵀ`, each rank row scaled by its site's scaling, and
    /// `y = base_out + h·blockdiag(B₁, …, Bₙ)ᵀ` in one `addmm` — two GEMMs forward and four
    /// backward for the group instead of two and four per site; for f32 on the CPU where
    /// [`crate::sys::lora_branch_applies`], one [`crate::sys::lora_branch`] op instead (each
    /// site's B on its own, no block-diagonal matrix). The function is PEFT's
    /// `base(x) + B(A(x))·scaling` for each site (`peft/tuners/lora/layer.py::Linear.forward`);
    /// the block-diagonal product adds exact zeros outside each site's block. Otherwise each site
    /// adds its own branches ([`LoraLinear::forward_from_base`] on its slice). The outputs are
    /// views of one `[..., Σ outᵢ]` tensor when fused (each contiguous along its last dimension).
    ///
    /// # Errors
    /// [`Error::Shape`] when `base_out`'s last dimension is not the sum of the sites' output
    /// features or the sites' input features differ; [`Error::Torch`] when an op fails.
    pub fn forward_siblings(
        sites: &[&LoraLinear],
        x: &Tensor,
        base_out: Tensor,
        train: bool,
    ) -> Result<Vec<Tensor>> {
        let outs: Vec<i64> = sites.iter().map(|s| s.out_features()).collect();
        let ctx = || format!("sibling linears {outs:?} forward on input {:?}", x.size());
        match Self::forward_siblings_grouped(sites, x, base_out, train)? {
            SiblingOutputs::Split(parts) => Ok(parts),
            SiblingOutputs::Joined(y) => Ok(y.f_split_with_sizes(outs.as_slice(), -1).ctx(ctx)?),
        }
    }

    /// [`LoraLinear::forward_siblings`] with the outputs side by side in one tensor
    /// `[..., Σ outᵢ]` (site order) where they were computed that way — the branches computed
    /// together, or no site adding a branch — and no site has a bias; else one tensor per site.
    /// For an op that reads the group as one tensor (SwiGLU over gate and up,
    /// [`crate::sys::swiglu`]), whose gradient then flows back as one tensor instead of through a
    /// split, with no copy made to join outputs that were apart.
    ///
    /// # Errors
    /// As [`LoraLinear::forward_siblings`].
    pub fn forward_siblings_grouped(
        sites: &[&LoraLinear],
        x: &Tensor,
        base_out: Tensor,
        train: bool,
    ) -> Result<SiblingOutputs> {
        Ok(match Self::siblings(sites, x, base_out, train)? {
            SiblingOutputs::Joined(y) if sites.iter().any(|s| s.bias.is_some()) => {
                let outs: Vec<i64> = sites.iter().map(|s| s.out_features()).collect();
                let ctx = || format!("sibling linears {outs:?} forward on input {:?}", x.size());
                let parts = y.f_split_with_sizes(outs.as_slice(), -1).ctx(ctx)?;
                SiblingOutputs::Split(
                    sites
                        .iter()
                        .zip(parts)
                        .map(|(s, p)| s.add_bias(p))
                        .collect::<std::result::Result<Vec<_>, _>>()
                        .ctx(ctx)?,
                )
            }
            other => other,
        })
    }

    /// The core of [`LoraLinear::forward_siblings`]: `Joined` — the group's outputs side by
    /// side, no bias added yet — when the branches were computed together or none adds a
    /// branch, else `Split`, each site's full forward.
    fn siblings(
        sites: &[&LoraLinear],
        x: &Tensor,
        base_out: Tensor,
        train: bool,
    ) -> Result<SiblingOutputs> {
        let outs: Vec<i64> = sites.iter().map(|s| s.out_features()).collect();
        let total: i64 = outs.iter().sum();
        let size = base_out.size();
        if size.last() != Some(&total)
            || sites
                .windows(2)
                .any(|w| w[0].in_features() != w[1].in_features())
        {
            return Err(Error::Shape {
                key: "sibling linears' frozen products".into(),
                expected: vec![-1, total],
                found: size,
            });
        }
        let ctx = || format!("sibling linears {outs:?} forward on input {:?}", x.size());
        // no site adds a branch (none adapted, or all disabled): the frozen products as they are
        if sites
            .iter()
            .all(|s| s.adapters_disabled() || !s.adapters.iter().any(|a| a.in_branch()))
        {
            return Ok(SiblingOutputs::Joined(base_out));
        }
        let single: Option<Vec<&Adapter>> = sites
            .iter()
            .map(|s| {
                let mut active = s.adapters.iter().filter(|a| a.in_branch());
                match (active.next(), active.next()) {
                    (Some(a), None) if s.plain_adapters(x) && !(train && a.spec.dropout > 0.0) => {
                        Some(a)
                    }
                    _ => None,
                }
            })
            .collect();
        let Some(adapters) = single.filter(|a| a.len() > 1) else {
            let parts = base_out.f_split_with_sizes(outs.as_slice(), -1).ctx(ctx)?;
            return sites
                .iter()
                .zip(parts)
                .map(|(s, b)| s.forward_from_base(x, b, train))
                .collect::<Result<Vec<_>>>()
                .map(SiblingOutputs::Split);
        };
        let y = (|| -> std::result::Result<Tensor, tch::TchError> {
            let a: Vec<&Tensor> = adapters.iter().map(|a| &a.lora_a).collect();
            let b: Vec<&Tensor> = adapters.iter().map(|a| &a.lora_b).collect();
            let scales: Vec<f64> = adapters.iter().map(|a| a.effective_scale()).collect();
            if crate::sys::lora_branch_applies(x, &base_out, &a, &b) {
                return Ok(crate::sys::lora_branch(x, &base_out, &a, &b, &scales)?);
            }
            let ranks: Vec<i64> = a.iter().map(|t| t.size()[0]).collect();
            let rank_total: i64 = ranks.iter().sum();
            let h = linear_product(x, &Tensor::f_cat(&a, 0)?)?;
            if base_out.kind() != x.kind() {
                // Under autocast (the frozen product in the autocast dtype, x and the adapters
                // not): the general path's order of operations — `B(A(x))` in the autocast
                // dtype, times the scaling, cast to the output's dtype, added — for the whole
                // group at once, so each site's values are the ones its own forward gives.
                let lora = linear_product(&h, &Tensor::f_block_diag(&b)?)?;
                let lora = scale_columns(&lora, &scales, &outs)?;
                let lora = if lora.kind() == base_out.kind() {
                    lora
                } else {
                    lora.f_to_kind(base_out.kind())?
                };
                return base_out.f_add(&lora);
            }
            let h = scale_columns(&h, &scales, &ranks)?;
            let b = Tensor::f_block_diag(&b)?;
            add_product(
                &base_out.f_reshape([-1, total])?,
                &h.f_reshape([-1, rank_total])?,
                &b,
            )?
            .f_reshape(size.as_slice())
        })()
        .ctx(ctx)?;
        Ok(SiblingOutputs::Joined(y))
    }
}

/// `t` `[..., Σ widthsᵢ]` with its last-dimension columns scaled group by group: the first
/// `widths[0]` by `scales[0]`, and so on (one scalar multiply when every scale agrees). The
/// siblings' per-site scalings over their side-by-side ranks or outputs.
fn scale_columns(
    t: &Tensor,
    scales: &[f64],
    widths: &[i64],
) -> std::result::Result<Tensor, tch::TchError> {
    if scales.windows(2).all(|w| w[0] == w[1]) {
        return t.f_mul_scalar(scales.first().copied().unwrap_or(1.0));
    }
    let per_col: Vec<f64> = scales
        .iter()
        .zip(widths)
        .flat_map(|(&s, &n)| std::iter::repeat_n(s, n.max(0) as usize))
        .collect();
    let per_col = Tensor::f_from_slice(&per_col)?
        .f_to_kind(t.kind())?
        .f_to_device(t.device())?;
    t.f_mul(&per_col)
}

impl LoraLinear {
    /// `y + b` with the frozen bias cast to `y`'s dtype; `y` unchanged without a bias.
    fn add_bias(&self, y: Tensor) -> std::result::Result<Tensor, tch::TchError> {
        match &self.bias {
            None => Ok(y),
            Some(b) if b.kind() == y.kind() => y.f_add(b),
            Some(b) => y.f_add(&b.f_to_kind(y.kind())?),
        }
    }

    /// True when every active adapter is plain LoRA (no DoRA magnitude) in the dtype of `x` and of
    /// the base output, so [`Self::add_plain_branches`] gives the same function as the general path.
    fn plain_branches(&self, x: &Tensor, base_out: &Tensor) -> bool {
        self.plain_adapters(x) && base_out.kind() == x.kind()
    }

    /// True when the layer is enabled and every active adapter is plain LoRA (no DoRA magnitude)
    /// in the dtype of `x`.
    fn plain_adapters(&self, x: &Tensor) -> bool {
        !self.disabled
            && self.adapters.iter().filter(|a| a.in_branch()).all(|a| {
                a.magnitude.is_none() && a.lora_a.kind() == x.kind() && a.lora_b.kind() == x.kind()
            })
    }

    /// `y = base_out + Σ (s·A(dropout(x)))·Bᵀ` with the scaling applied in rank space (`[..., r]`)
    /// and the sum fused into the B matmul (`addmm`, β = 1). Mathematically PEFT's
    /// `base + B(A(x))·s`, with two fewer passes over the `[..., out]` output per adapter (the
    /// scaling multiply and the add) forward, and one fewer backward. For f32 on the CPU where
    /// [`crate::sys::lora_branch_applies`], each adapter's branch is one
    /// [`crate::sys::lora_branch`] op over the (dropped) input instead.
    fn add_plain_branches(
        &self,
        x: &Tensor,
        base_out: Tensor,
        train: bool,
    ) -> std::result::Result<Tensor, tch::TchError> {
        let size = base_out.size();
        let out = self.out_features();
        let mut y = base_out.f_reshape([-1, out])?;
        for ad in self.adapters.iter().filter(|a| a.in_branch()) {
            let p = ad.spec.dropout;
            let xd = if train && p > 0.0 {
                x.f_dropout(p, true)?
            } else {
                x.shallow_clone()
            };
            let (a, b) = ([&ad.lora_a], [&ad.lora_b]);
            if xd.device() == tch::Device::Cpu
                && xd.kind() == Kind::Float
                && crate::sys::cpu_lora_branch_by_lsdk()
            {
                let x2 = xd.f_reshape([-1, self.in_features()])?;
                if crate::sys::lora_branch_applies(&x2, &y, &a, &b) {
                    y = crate::sys::lora_branch(&x2, &y, &a, &b, &[ad.effective_scale()])?;
                    continue;
                }
            }
            let r = ad.lora_a.size()[0];
            let h = linear_product(&xd, &ad.lora_a)?
                .f_mul_scalar(ad.effective_scale())?
                .f_reshape([-1, r])?;
            y = add_product(&y, &h, &ad.lora_b)?;
        }
        y.f_reshape(size.as_slice())
    }
}

impl LoraLayer for LoraLinear {
    fn site_kind(&self) -> SiteKind {
        SiteKind::Linear
    }
    fn base(&self) -> &BaseWeight {
        &self.base
    }
    fn adapters(&self) -> &[Adapter] {
        &self.adapters
    }
    fn adapters_mut(&mut self) -> &mut Vec<Adapter> {
        &mut self.adapters
    }
    fn adapter_shapes(&self, r: i64) -> (Vec<i64>, Vec<i64>) {
        (vec![r, self.in_features()], vec![self.out_features(), r])
    }
    fn lora_product(&self, ad: &Adapter) -> Result<Tensor> {
        (|| {
            ad.lora_b
                .f_to_kind(Kind::Float)?
                .f_mm(&ad.lora_a.f_to_kind(Kind::Float)?)
        })()
        .ctx(|| format!("computing B·A of adapter {:?}", ad.name))
    }
    fn adapters_disabled(&self) -> bool {
        self.disabled
    }
    fn set_disabled_flag(&mut self, disabled: bool) {
        self.disabled = disabled;
    }
}
