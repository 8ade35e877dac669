//! Multi-head attention of the UNet and VAE blocks, and how its scores are computed.

use tch::{Kind, Tensor};

use crate::error::Result;

/// How attention scores are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionBackend {
    /// libtorch's fused `scaled_dot_product_attention` (flash / memory-efficient kernels where
    /// available); what diffusers' default `AttnProcessor2_0` calls.
    #[default]
    Sdpa,
    /// `softmax(q·kᵀ/√d)·v` spelled out, with the scores in float32 (diffusers `AttnProcessor` with
    /// `upcast_attention`/`upcast_softmax`); materialises the `[B·heads, Lq, Lk]` score matrix.
    Math,
}

/// `softmax(q·kᵀ/√d)·v` over heads.
///
/// # Shapes
/// `q` `[B, Lq, heads·d]`, `k`/`v` `[B, Lk, heads·d]` → `[B, Lq, heads·d]`.
pub(crate) fn multi_head_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    heads: i64,
    backend: AttentionBackend,
) -> Result<Tensor> {
    let (b, lq, inner) = q.size3()?;
    let d = inner / heads;
    let split = |t: &Tensor| -> Result<Tensor> {
        let l = t.size()[1];
        Ok(t.f_view([b, l, heads, d])?.f_transpose(1, 2)?)
    };
    let (qh, kh, vh) = (split(q)?, split(k)?, split(v)?);
    let out = match backend {
        AttentionBackend::Sdpa => Tensor::f_scaled_dot_product_attention::<Tensor>(
            &qh, &kh, &vh, None, 0.0, false, None, false,
        )?,
        AttentionBackend::Math => {
            let scale = 1.0 / (d as f64).sqrt();
            let scores = qh
                .f_to_kind(Kind::Float)?
                .f_matmul(&kh.f_to_kind(Kind::Float)?.f_transpose(-1, -2)?)?
                .f_mul_scalar(scale)?;
            let p = scores.f_softmax(-1, Kind::Float)?.f_to_kind(vh.kind())?;
            p.f_matmul(&vh)?
        }
    };
    Ok(out.f_transpose(1, 2)?.f_reshape([b, lq, inner])?)
}
