//! LoRA on an embedding table.

use crate::base::BaseWeight;
use crate::error::{Error, Result, TchContext};
use crate::layer::{Adapter, LoraLayer, SiteKind, add_branches};
use tch::{Kind, Tensor};

/// A frozen embedding table plus named LoRA adapters (PEFT `peft/tuners/lora/layer.py::Embedding`).
///
/// # Shapes
/// - base weight `[num_embeddings, dim]` (dense or quantized; a quantized table dequantizes only the
///   looked-up rows);
/// - adapter A (`lora_embedding_A`) `[r, num_embeddings]`, B (`lora_embedding_B`) `[dim, r]`;
/// - ids `[...]` (int64) → `[..., dim]`.
///
/// `y = W[ids] + (Aᵀ[ids] · Bᵀ) · scaling · weight`. Init as PEFT: A zeros, B normal(0, 1).
/// PEFT applies no dropout on embeddings; neither do we.
#[derive(Debug)]
pub struct LoraEmbedding {
    base: BaseWeight,
    adapters: Vec<Adapter>,
    disabled: bool,
    kind: Kind,
}

impl LoraEmbedding {
    /// Wraps a frozen table `[num_embeddings, dim]`; the output dtype is the dense table's dtype
    /// (f32 for a quantized table; see [`LoraEmbedding::with_output_kind`]).
    ///
    /// # Errors
    /// [`Error::Shape`] when the table is not 2-D.
    pub fn new(base: BaseWeight) -> Result<Self> {
        let s = base.shape();
        if s.len() != 2 {
            return Err(Error::Shape {
                key: "embedding weight".into(),
                expected: vec![-1, -1],
                found: s,
            });
        }
        let kind = base.kind();
        Ok(Self {
            base,
            adapters: Vec::new(),
            disabled: false,
            kind,
        })
    }

    /// Sets the dtype lookups are returned in (e.g. bf16 for a quantized table in a bf16 model).
    pub fn with_output_kind(mut self, kind: Kind) -> Self {
        self.kind = kind;
        self
    }

    /// Number of rows (vocabulary size).
    pub fn num_embeddings(&self) -> i64 {
        self.base.shape()[0]
    }

    /// Embedding width.
    pub fn embedding_dim(&self) -> i64 {
        self.base.shape()[1]
    }

    /// Looks up `ids` (any integer shape `[...]`) → `[..., dim]`.
    ///
    /// # Errors
    /// [`Error::Torch`] for out-of-range ids or op failures.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let ctx = || {
            format!(
                "embedding lookup into {:?} with ids {:?}",
                self.base.shape(),
                ids.size()
            )
        };
        let mut out_shape = ids.size();
        out_shape.push(self.embedding_dim());
        let base_out = self.base.with_resident(|base| match base {
            BaseWeight::Quant(q) => q
                .dequantize_rows(ids, self.kind)?
                .f_reshape(out_shape.as_slice())
                .ctx(ctx),
            b => {
                let w = b.weight(self.kind)?;
                Tensor::f_embedding(&w, ids, -1, false, false).ctx(ctx)
            }
        })?;
        add_branches(
            self,
            ids,
            &base_out,
            false,
            &|ad, _| {
                let at = ad.lora_a.f_tr()?;
                Tensor::f_embedding(&at, ids, -1, false, false)?.f_matmul(&ad.lora_b.f_tr()?)
            },
            &|_, _| {
                Err(tch::TchError::Torch(
                    "DoRA is not supported on embeddings".into(),
                ))
            },
        )
    }
}

impl LoraLayer for LoraEmbedding {
    fn site_kind(&self) -> SiteKind {
        SiteKind::Embedding
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
        (
            vec![r, self.num_embeddings()],
            vec![self.embedding_dim(), r],
        )
    }
    fn lora_product(&self, ad: &Adapter) -> Result<Tensor> {
        (|| {
            ad.lora_b
                .f_to_kind(Kind::Float)?
                .f_mm(&ad.lora_a.f_to_kind(Kind::Float)?)?
                .f_tr()
        })()
        .ctx(|| format!("computing (B·A)ᵀ of embedding adapter {:?}", ad.name))
    }
    fn adapters_disabled(&self) -> bool {
        self.disabled
    }
    fn set_disabled_flag(&mut self, disabled: bool) {
        self.disabled = disabled;
    }
}
