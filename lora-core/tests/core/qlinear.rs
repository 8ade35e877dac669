//! The tiled quantized linear (`QuantWeight::linear` → the shim's `lsdk_qlinear`): forward and
//! input gradient equal the dequantize-then-matmul reference for every kind, over random shapes,
//! several tiles, bf16 and autocast; and its backward keeps no dense weight.

use lora_core::quant::{QuantKind, QuantWeight};
use lora_core::sys;
use proptest::prelude::*;
use tch::{Device, Kind, Tensor};

const KINDS: [QuantKind; 11] = [
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
];

fn randn(shape: &[i64], seed: i64) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (Kind::Float, Device::Cpu))
}

/// Largest |a − b| relative to the largest |b|.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let d = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double))
        .abs()
        .max()
        .double_value(&[]);
    d / b
        .to_kind(Kind::Double)
        .abs()
        .max()
        .double_value(&[])
        .max(1e-30)
}

/// (fused y, fused ∂x, reference y, reference ∂x) for `x` `[n, in]` and upstream gradient `g`.
fn both(q: &QuantWeight, x: &Tensor, g: &Tensor) -> (Tensor, Tensor, Tensor, Tensor) {
    let xf = x.detach().set_requires_grad(true);
    let y = q.linear(&xf).unwrap();
    (&y * g).sum(Kind::Double).backward();
    let w = q.dequantize(x.kind()).unwrap();
    let xr = x.detach().set_requires_grad(true);
    let yr = xr.linear::<Tensor>(&w, None);
    (&yr * g).sum(Kind::Double).backward();
    (y.detach(), xf.grad(), yr.detach(), xr.grad())
}

#[test]
fn every_kind_matches_dequantize_then_matmul_across_tiles() {
    // 640 × 2048 = 1.25 Mi weights: two tiles of 512 and 128 rows
    let (out, inn, n) = (640i64, 2048i64, 24i64);
    let w = randn(&[out, inn], 1) * 0.05;
    let x = randn(&[n, inn], 2);
    let g = randn(&[n, out], 3);
    for kind in KINDS {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        let (y, gx, yr, gxr) = both(&q, &x, &g);
        assert_eq!(y.size(), [n, out]);
        assert!(rel(&y, &yr) < 1e-5, "{kind:?} forward {}", rel(&y, &yr));
        assert!(
            rel(&gx, &gxr) < 1e-5,
            "{kind:?} backward {}",
            rel(&gx, &gxr)
        );
    }
}

#[test]
fn bf16_inputs_and_autocast_compute_in_bf16() {
    let (out, inn, n) = (96i64, 256i64, 16i64);
    let w = randn(&[out, inn], 4) * 0.05;
    let x = randn(&[2, n / 2, inn], 5);
    for kind in KINDS {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        let reference = x.linear::<Tensor>(&q.dequantize(Kind::Float).unwrap(), None);
        // a bf16 input: the product in bf16, leading dims kept
        let y = q.linear(&x.to_kind(Kind::BFloat16)).unwrap();
        assert_eq!((y.kind(), y.size()), (Kind::BFloat16, vec![2, n / 2, out]));
        assert!(
            rel(&y, &reference) < 2e-2,
            "{kind:?} bf16 {}",
            rel(&y, &reference)
        );
        // autocast: an f32 input is computed in the autocast dtype, as a matmul would be
        let y = {
            let _a = sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
            q.linear(&x).unwrap()
        };
        assert_eq!(y.kind(), Kind::BFloat16);
        assert!(
            rel(&y, &reference) < 2e-2,
            "{kind:?} autocast {}",
            rel(&y, &reference)
        );
    }
}

#[test]
fn the_backward_pass_keeps_no_dense_weight() {
    // A graph through the dequantize-then-matmul path keeps the dense weight (4 B per weight);
    // through the tiled kernel it keeps only the quantized tensors. Other tests of this
    // executable allocate concurrently, so each side is measured three times (least for the
    // kernel, most for the reference).
    sys::install_counting_cpu_allocator().unwrap();
    let (out, inn) = (2048i64, 2048i64);
    let w = randn(&[out, inn], 6) * 0.05;
    let q = QuantWeight::quantize(&w, QuantKind::Q4_0).unwrap();
    drop(w);
    let x = randn(&[8, inn], 7).set_requires_grad(true);
    let live = || sys::cpu_mem_stats().unwrap().current_bytes as i64;
    let (mut fused, mut reference) = (i64::MAX, i64::MIN);
    for _ in 0..3 {
        let before = live();
        let y = q.linear(&x).unwrap();
        fused = fused.min(live() - before);
        drop(y);
        let before = live();
        let yr = x.linear::<Tensor>(&q.dequantize(Kind::Float).unwrap(), None);
        reference = reference.max(live() - before);
        drop(yr);
    }
    let dense = out * inn * 4;
    assert!(fused < dense / 8, "the kernel's graph holds {fused} B");
    assert!(
        reference >= dense,
        "the reference graph holds {reference} B"
    );
}

#[test]
fn bad_inputs_are_errors_not_aborts() {
    let q = QuantWeight::quantize(&(randn(&[8, 64], 8) * 0.1), QuantKind::Q8_0).unwrap();
    let e = q.linear(&randn(&[4, 32], 9)).unwrap_err().to_string();
    assert!(e.contains("64"), "{e}");
    // f64 is not a kernel dtype: the dense path answers it
    let x = randn(&[4, 64], 10).to_kind(Kind::Double);
    let y = q.linear(&x).unwrap();
    assert_eq!(y.kind(), Kind::Double);
    // the raw entry point checks every tensor it is handed
    let codes = Tensor::zeros([8, 2, 16], (Kind::Uint8, Device::Cpu));
    let scales = Tensor::ones([8, 2], (Kind::Half, Device::Cpu));
    let table = Tensor::zeros([256, 2], (Kind::Float, Device::Cpu));
    let x = randn(&[3, 64], 11);
    let parts = |codes: &Tensor, scales: &Tensor, table: Option<&Tensor>| {
        let p = sys::QuantParts {
            kind: 1,
            out: 8,
            inn: 64,
            codes,
            scales,
            mins: None,
            sub_scales: None,
            hbits: None,
            dq_scales: None,
            table,
            dq_offset: 0.0,
        };
        sys::qlinear(&x, &p).map(|y| y.size())
    };
    assert_eq!(parts(&codes, &scales, Some(&table)).unwrap(), [3, 8]);
    let e = parts(&codes.to_kind(Kind::Float), &scales, Some(&table)).unwrap_err();
    assert!(e.to_string().contains("codes"), "{e}");
    let e = parts(&codes, &scales.to_kind(Kind::Float), Some(&table)).unwrap_err();
    assert!(e.to_string().contains("f16"), "{e}");
    let e = parts(&codes.narrow(0, 0, 4), &scales, Some(&table)).unwrap_err();
    assert!(e.to_string().contains("byte count"), "{e}");
    let e = parts(&codes, &scales, Some(&table.to_kind(Kind::Double))).unwrap_err();
    assert!(e.to_string().contains("table"), "{e}");
    let e = sys::qlinear(
        &randn(&[3, 32], 12),
        &sys::QuantParts {
            kind: 99,
            out: 8,
            inn: 32,
            codes: &codes,
            scales: &scales,
            mins: None,
            sub_scales: None,
            hbits: None,
            dq_scales: None,
            table: None,
            dq_offset: 0.0,
        },
    )
    .unwrap_err();
    assert!(
        e.to_string().contains("unknown quantization kind 99"),
        "{e}"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    /// Any shape, any kind: forward and input gradient equal the reference within 1e-5 (f32).
    #[test]
    fn any_shape_matches_the_reference(out in 1i64..48, in_blocks in 1i64..6, n in 1i64..7,
                                       kind in 0usize..11, seed in 0i64..1000) {
        let kind = KINDS[kind];
        let block = if matches!(kind, QuantKind::Nf4 { .. }) { 64 } else { 32 };
        // NF4 needs out·in divisible by 64; GGUF needs in divisible by 32 (256 for the k-quants)
        let inn = in_blocks * if kind.is_k_quant() { 256 } else { 32 };
        let out = if block == 64 && (out * inn) % 64 != 0 { out * 2 } else { out };
        let w = randn(&[out, inn], seed) * 0.05;
        let q = QuantWeight::quantize(&w, kind).unwrap();
        let x = randn(&[n, inn], seed + 1);
        let g = randn(&[n, out], seed + 2);
        let (y, gx, yr, gxr) = both(&q, &x, &g);
        prop_assert!(rel(&y, &yr) < 1e-5, "{:?} forward {}", kind, rel(&y, &yr));
        prop_assert!(rel(&gx, &gxr) < 1e-5, "{:?} backward {}", kind, rel(&gx, &gxr));
    }
}
