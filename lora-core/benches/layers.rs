//! Criterion benches for lora-core's hot paths (CPU; set `OMP_NUM_THREADS` to pin threads):
//! - `linear_fwd_bwd`: forward + backward of a frozen 1024×1024 linear alone vs the same linear with a
//!   rank-16 LoRA adapter (gradients for A and B only) — the LoRA overhead;
//! - `dequant`: dequantizing a 1024×1024 weight of each quantized kind vs one dense bf16 matmul of
//!   `[256, 1024] × [1024, 1024]ᵀ` (what the dequantized weight is then used for).
//!
//! Run: `cargo bench -p lora-core --bench layers`.

use criterion::{Criterion, criterion_group, criterion_main};
use lora_core::base::BaseWeight;
use lora_core::config::AdapterSpec;
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use lora_core::quant::{QuantKind, QuantWeight};
use std::hint::black_box;
use tch::{Device, Kind, Tensor, nn};

const N: i64 = 1024;
const TOKENS: i64 = 256;

fn linear_fwd_bwd(c: &mut Criterion) {
    tch::manual_seed(0);
    let w = Tensor::randn([N, N], (Kind::Float, Device::Cpu)) * 0.02;
    let x = Tensor::randn([TOKENS, N], (Kind::Float, Device::Cpu));
    let mut g = c.benchmark_group("linear_fwd_bwd");
    g.sample_size(20);

    // frozen linear alone; the input needs a gradient so that backward has work to do (as inside a
    // network whose earlier layers train)
    let plain = LoraLinear::new(BaseWeight::Dense(w.copy()), None).unwrap();
    g.bench_function("frozen_linear", |b| {
        b.iter(|| {
            let xi = x.detach().set_requires_grad(true);
            let y = plain.forward_t(&xi, true).unwrap();
            y.sum(Kind::Float).backward();
            let _ = black_box(xi.grad());
        })
    });

    let vs = nn::VarStore::new(Device::Cpu);
    let mut lora = LoraLinear::new(BaseWeight::Dense(w.copy()), None).unwrap();
    lora.add_adapter("bench", "default", &AdapterSpec::new(16, 32.0), &vs.root())
        .unwrap();
    g.bench_function("lora_linear_r16", |b| {
        b.iter(|| {
            let xi = x.detach().set_requires_grad(true);
            let y = lora.forward_t(&xi, true).unwrap();
            y.sum(Kind::Float).backward();
            let _ = black_box(xi.grad());
            for t in vs.trainable_variables() {
                let _ = t.grad().zero_();
            }
        })
    });
    g.finish();
}

fn dequant(c: &mut Criterion) {
    tch::manual_seed(1);
    let w = Tensor::randn([N, N], (Kind::Float, Device::Cpu)) * 0.02;
    let mut g = c.benchmark_group("dequant");
    g.sample_size(20);
    let wb = w.to_kind(Kind::BFloat16);
    let xb = Tensor::randn([TOKENS, N], (Kind::Float, Device::Cpu)).to_kind(Kind::BFloat16);
    g.bench_function("dense_bf16_matmul", |b| {
        b.iter(|| black_box(xb.linear::<Tensor>(&wb, None)))
    });
    for kind in [
        QuantKind::Q8_0,
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q4_K,
        QuantKind::Q5_K,
        QuantKind::Q6_K,
        QuantKind::Nf4 {
            double_quant: false,
        },
        QuantKind::Nf4 { double_quant: true },
        QuantKind::Fp8E4m3,
    ] {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        g.bench_function(format!("{kind:?}_to_bf16"), |b| {
            b.iter(|| black_box(q.dequantize(Kind::BFloat16).unwrap()))
        });
    }
    g.finish();
}

criterion_group!(benches, linear_fwd_bwd, dequant);
criterion_main!(benches);
