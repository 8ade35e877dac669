//! A tiny model with every site type, for the integration tests.
#![allow(dead_code)]

use lora_core::Result;
use lora_core::base::BaseWeight;
use lora_core::conv::{Conv2dParams, LoraConv2d};
use lora_core::embedding::LoraEmbedding;
use lora_core::inject::{Adaptable, SiteMut};
use lora_core::linear::LoraLinear;
use lora_core::quant::{QuantKind, QuantWeight};
use tch::Tensor;

pub const VOCAB: i64 = 16;
pub const DIM: i64 = 32;
pub const HIDDEN: i64 = 64;

/// Site names as HF would name them.
pub const SITES: [&str; 6] = [
    "model.embed_tokens",
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
    "conv_in",
];

pub struct Tiny {
    pub embed: LoraEmbedding,
    pub q: LoraLinear,
    pub v: LoraLinear,
    pub up: LoraLinear,
    pub down: LoraLinear,
    pub conv: LoraConv2d,
}

/// Deterministic pseudo-random values in [-0.35, 0.35) without torch's global RNG (tests run in
/// parallel threads and would race on it).
pub fn dense(shape: &[i64], seed: i64) -> Tensor {
    let n: i64 = shape.iter().product();
    let mut s = (seed as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(0xD1B5_4A32_D192_ED03);
    let v: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.7
        })
        .collect();
    Tensor::from_slice(&v).reshape(shape)
}

/// Base for linears: dense f32, or quantized with `quant`.
pub fn linear_base(out: i64, inn: i64, seed: i64, quant: Option<QuantKind>) -> BaseWeight {
    let w = dense(&[out, inn], seed);
    match quant {
        None => BaseWeight::Dense(w),
        Some(k) => BaseWeight::Quant(QuantWeight::quantize(&w, k).unwrap()),
    }
}

impl Tiny {
    pub fn new(quant: Option<QuantKind>) -> Self {
        Tiny {
            embed: LoraEmbedding::new(BaseWeight::Dense(dense(&[VOCAB, DIM], 1))).unwrap(),
            q: LoraLinear::new(linear_base(DIM, DIM, 2, quant), Some(dense(&[DIM], 3))).unwrap(),
            v: LoraLinear::new(linear_base(DIM, DIM, 4, quant), None).unwrap(),
            up: LoraLinear::new(
                linear_base(HIDDEN, DIM, 5, quant),
                Some(dense(&[HIDDEN], 6)),
            )
            .unwrap(),
            down: LoraLinear::new(linear_base(DIM, HIDDEN, 7, quant), None).unwrap(),
            conv: LoraConv2d::new(
                BaseWeight::Dense(dense(&[4, 3, 3, 3], 8)),
                Some(dense(&[4], 9)),
                Conv2dParams {
                    padding: [1, 1],
                    ..Default::default()
                },
            )
            .unwrap(),
        }
    }

    /// ids `[b, t]` → `[b, t, DIM]`.
    pub fn forward_t(&self, ids: &Tensor, train: bool) -> Tensor {
        let h = self.embed.forward(ids).unwrap();
        let a = self.q.forward_t(&h, train).unwrap() + self.v.forward_t(&h, train).unwrap();
        let u = self.up.forward_t(&a, train).unwrap().gelu("none");
        self.down.forward_t(&u, train).unwrap() + h
    }

    pub fn conv_forward(&self, x: &Tensor, train: bool) -> Tensor {
        self.conv.forward_t(x, train).unwrap()
    }
}

impl Adaptable for Tiny {
    fn visit_sites(&mut self, f: &mut dyn FnMut(&str, SiteMut<'_>) -> Result<()>) -> Result<()> {
        f(SITES[0], SiteMut::Embedding(&mut self.embed))?;
        f(SITES[1], SiteMut::Linear(&mut self.q))?;
        f(SITES[2], SiteMut::Linear(&mut self.v))?;
        f(SITES[3], SiteMut::Linear(&mut self.up))?;
        f(SITES[4], SiteMut::Linear(&mut self.down))?;
        f(SITES[5], SiteMut::Conv2d(&mut self.conv))
    }
}

pub fn ids() -> Tensor {
    Tensor::from_slice(&[1i64, 5, 7, 15, 0, 3]).reshape([2, 3])
}

pub fn image() -> Tensor {
    dense(&[2, 3, 6, 6], 42)
}

pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    f64::try_from((a - b).abs().max()).unwrap()
}

/// Whether this CPU runs the shim's AVX2/FMA kernels (causal attention, the LoRA branch op).
pub fn avx2_kernels_here() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// max |a − b| / max(max |b|, 1): relative for O(1) values, absolute where the reference
/// vanishes.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (
        a.detach().to_kind(tch::Kind::Double),
        b.detach().to_kind(tch::Kind::Double),
    );
    let num = (&a - &b).abs().max().double_value(&[]);
    let den = b.abs().max().double_value(&[]).max(1.0);
    num / den
}

/// f32 values of `shape` from a fixed formula, not from libtorch's generator (which tests
/// running beside this one draw from): `scale · sin(0.7·i + phase)·cos(0.13·i)` over the flat
/// index.
pub fn formula_values(shape: &[i64], phase: f64, scale: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    let i = Tensor::arange(n, (tch::Kind::Double, tch::Device::Cpu));
    let v = ((&i * 0.7 + phase).sin() * (&i * 0.13).cos() * scale).to_kind(tch::Kind::Float);
    v.reshape(shape)
}

/// `t`'s values as a fresh leaf that takes a gradient.
pub fn leaf(t: &Tensor) -> Tensor {
    t.detach().set_requires_grad(true)
}
