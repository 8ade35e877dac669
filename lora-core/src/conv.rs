//! LoRA on a 2-D convolution (LoCon: a k×k down convolution, a 1×1 up convolution).

use crate::base::BaseWeight;
use crate::error::{Error, Result, TchContext};
use crate::layer::{Adapter, LoraLayer, SiteKind, add_branches};
use tch::{Kind, Tensor};

/// Convolution hyper-parameters of the frozen base (`nn.Conv2d`'s stride / padding / dilation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv2dParams {
    /// Stride `[sh, sw]`.
    pub stride: [i64; 2],
    /// Zero padding `[ph, pw]`.
    pub padding: [i64; 2],
    /// Dilation `[dh, dw]`.
    pub dilation: [i64; 2],
    /// Groups (LoRA requires 1).
    pub groups: i64,
}

impl Default for Conv2dParams {
    fn default() -> Self {
        Self {
            stride: [1, 1],
            padding: [0, 0],
            dilation: [1, 1],
            groups: 1,
        }
    }
}

/// A frozen `Conv2d` plus named LoCon adapters.
///
/// # Shapes
/// - base weight `[out, in, kh, kw]` (dense), bias `[out]`;
/// - adapter A (`lora_down`) `[r, in, kh, kw]` applied with the base's stride/padding/dilation,
///   B (`lora_up`) `[out, r, 1, 1]`, DoRA magnitude `[out]`;
/// - input `[N, in, H, W]` → `[N, out, H', W']`.
///
/// `ΔW = (B[:, :, 0, 0] · A.reshape(r, −1)).reshape(out, in, kh, kw) · scaling`
/// (PEFT `peft/tuners/lora/layer.py::Conv2d.get_delta_weight`).
#[derive(Debug)]
pub struct LoraConv2d {
    base: BaseWeight,
    bias: Option<Tensor>,
    params: Conv2dParams,
    adapters: Vec<Adapter>,
    disabled: bool,
}

impl LoraConv2d {
    /// Wraps a frozen dense conv weight `[out, in, kh, kw]` and optional bias `[out]`.
    ///
    /// # Errors
    /// [`Error::Shape`] when the weight is not 4-D or the bias not `[out]`; [`Error::Unsupported`]
    /// for `groups != 1` or a quantized base.
    pub fn new(base: BaseWeight, bias: Option<Tensor>, params: Conv2dParams) -> Result<Self> {
        let s = base.shape();
        if base.is_quantized() {
            return Err(Error::Unsupported("quantized Conv2d base weights".into()));
        }
        if s.len() != 4 {
            return Err(Error::Shape {
                key: "conv2d weight".into(),
                expected: vec![-1, -1, -1, -1],
                found: s,
            });
        }
        if params.groups != 1 {
            return Err(Error::Unsupported(format!(
                "LoRA on a grouped Conv2d (groups = {})",
                params.groups
            )));
        }
        if let Some(b) = &bias
            && b.size() != [s[0]]
        {
            return Err(Error::Shape {
                key: "conv2d bias".into(),
                expected: vec![s[0]],
                found: b.size(),
            });
        }
        Ok(Self {
            base,
            bias,
            params,
            adapters: Vec::new(),
            disabled: false,
        })
    }

    /// The convolution hyper-parameters.
    pub fn params(&self) -> Conv2dParams {
        self.params
    }

    /// Input channels.
    pub fn in_channels(&self) -> i64 {
        self.base.shape()[1]
    }

    /// Output channels.
    pub fn out_channels(&self) -> i64 {
        self.base.shape()[0]
    }

    /// The frozen bias, if any.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    fn conv(&self, x: &Tensor, w: &Tensor) -> std::result::Result<Tensor, tch::TchError> {
        let p = &self.params;
        x.f_conv2d::<Tensor>(w, None, p.stride, p.padding, p.dilation, 1)
    }

    /// Forward pass; `x` `[N, in, H, W]` → `[N, out, H', W']` in `x`'s dtype; `train` turns dropout on.
    /// DoRA follows `peft/tuners/lora/dora.py::_DoraConvNdLayer.forward`.
    ///
    /// # Errors
    /// [`Error::Torch`] when a shape does not fit or an op fails.
    pub fn forward_t(&self, x: &Tensor, train: bool) -> Result<Tensor> {
        let ctx = || {
            format!(
                "conv2d forward {:?} on input {:?}",
                self.base.shape(),
                x.size()
            )
        };
        let w = self.base.weight(x.kind())?;
        let base_out = self.conv(x, &w).ctx(ctx)?;
        let p = self.params;
        let y = add_branches(
            self,
            x,
            &base_out,
            train,
            &|ad, xd| {
                xd.f_conv2d::<Tensor>(&ad.lora_a, None, p.stride, p.padding, p.dilation, 1)?
                    .f_conv2d::<Tensor>(&ad.lora_b, None, [1, 1], [0, 0], [1, 1], 1)
            },
            &|xd, w| self.conv(xd, w),
        )?;
        match &self.bias {
            None => Ok(y),
            Some(b) => (|| {
                let b = b.f_to_kind(y.kind())?.f_reshape([1, -1, 1, 1])?;
                y.f_add(&b)
            })()
            .ctx(ctx),
        }
    }
}

impl LoraLayer for LoraConv2d {
    fn site_kind(&self) -> SiteKind {
        SiteKind::Conv2d
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
        let s = self.base.shape();
        (vec![r, s[1], s[2], s[3]], vec![s[0], r, 1, 1])
    }
    fn lora_product(&self, ad: &Adapter) -> Result<Tensor> {
        let s = self.base.shape();
        let r = ad.spec.rank;
        (|| {
            ad.lora_b
                .f_to_kind(Kind::Float)?
                .f_reshape([s[0], r])?
                .f_mm(&ad.lora_a.f_to_kind(Kind::Float)?.f_reshape([r, -1])?)?
                .f_reshape(s.as_slice())
        })()
        .ctx(|| format!("computing B·A of conv adapter {:?}", ad.name))
    }
    fn adapters_disabled(&self) -> bool {
        self.disabled
    }
    fn set_disabled_flag(&mut self, disabled: bool) {
        self.disabled = disabled;
    }
}
