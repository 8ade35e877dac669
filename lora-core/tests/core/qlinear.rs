//! The tiled quantized linear (`QuantWeight::linear` → the shim's `lsdk_qlinear` on the CPU for
//! f32 / bf16, `lsdk_tiled_linear` with `QuantWeight::dequantize` of each tile elsewhere): forward
//! and input gradient equal the dequantize-then-matmul reference for every kind, over random
//! shapes, several tiles, f64, f16, bf16 and autocast; its backward keeps no dense weight; errors
//! of the row decoder come back as errors. (Exact byte counts: `tests/qlinear_memory.rs`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

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

/// (tiled y, tiled ∂x, reference y, reference ∂x) in `dtype` through
/// [`QuantWeight::linear_tiled`] with tiles of `tile` weights.
fn both_tiled(
    q: &QuantWeight,
    x: &Tensor,
    g: &Tensor,
    dtype: Kind,
    tile: u64,
) -> (Tensor, Tensor, Tensor, Tensor) {
    let x = x.to_kind(dtype);
    let g = g.to_kind(dtype);
    let xf = x.detach().set_requires_grad(true);
    let y = q.linear_tiled(&xf, tile).unwrap();
    assert_eq!(y.kind(), dtype);
    (&y * &g).sum(Kind::Double).backward();
    let w = q.dequantize(dtype).unwrap();
    let xr = x.detach().set_requires_grad(true);
    let yr = xr.linear::<Tensor>(&w, None);
    (&yr * &g).sum(Kind::Double).backward();
    (y.detach(), xf.grad(), yr.detach(), xr.grad())
}

#[test]
fn the_tensor_op_path_matches_dequantize_then_matmul_over_uneven_tiles() {
    // 77 rows of 512 in tiles of 10 rows (8 tiles, the last of 7); NF4 with double quantization
    // starts most tiles inside a group of 256 blocks. f64: the tiles hold the same values as the
    // dense weight and only the GEMM's summation order differs (1e-12 relative to the largest
    // value); f16: the same values, f16 GEMMs of another blocking (2e-3).
    let (out, inn, n) = (77i64, 512i64, 9i64);
    let w = randn(&[out, inn], 21) * 0.05;
    let x = randn(&[n, inn], 22);
    let g = randn(&[n, out], 23);
    let kinds = [
        QuantKind::Q8_0,
        QuantKind::Q4_1,
        QuantKind::Nf4 { double_quant: true },
        QuantKind::Q4_K,
        QuantKind::Q6_K,
        QuantKind::Fp8E4m3,
    ];
    for kind in kinds {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        for (dtype, tol) in [(Kind::Double, 1e-12), (Kind::Half, 2e-3)] {
            let (y, gx, yr, gxr) = both_tiled(&q, &x, &g, dtype, 10 * inn as u64);
            assert_eq!((y.size(), gx.size()), (vec![n, out], vec![n, inn]));
            assert_eq!(gx.kind(), dtype);
            assert!(
                rel(&y, &yr) < tol,
                "{kind:?} {dtype:?} forward {}",
                rel(&y, &yr)
            );
            assert!(
                rel(&gx, &gxr) < tol,
                "{kind:?} {dtype:?} backward {}",
                rel(&gx, &gxr)
            );
        }
        // f32 forced onto this path (the CPU kernel's dtype) agrees with the kernel
        let (y, gx, _, _) = both_tiled(&q, &x, &g, Kind::Float, 10 * inn as u64);
        let (yk, gxk, _, _) = both(&q, &x, &g);
        assert!(rel(&y, &yk) < 1e-5, "{kind:?} f32 forward {}", rel(&y, &yk));
        assert!(
            rel(&gx, &gxk) < 1e-5,
            "{kind:?} f32 backward {}",
            rel(&gx, &gxk)
        );
    }
    // NF4 whose rows are not whole blocks: 50 rows of 96 (out·in a multiple of 64), tiles of an
    // even number of rows (6 of 7 asked for), with and without double quantization
    let w = randn(&[50, 96], 24) * 0.05;
    let x = randn(&[5, 96], 25);
    let g = randn(&[5, 50], 26);
    for double_quant in [false, true] {
        let q = QuantWeight::quantize(&w, QuantKind::Nf4 { double_quant }).unwrap();
        let (y, gx, yr, gxr) = both_tiled(&q, &x, &g, Kind::Double, 7 * 96);
        assert!(
            rel(&y, &yr) < 1e-12,
            "NF4 {double_quant} forward {}",
            rel(&y, &yr)
        );
        assert!(
            rel(&gx, &gxr) < 1e-12,
            "NF4 {double_quant} backward {}",
            rel(&gx, &gxr)
        );
    }
}

#[test]
fn f64_and_f16_take_the_tiled_path_through_linear() {
    // `linear` itself for the dtypes the CPU kernel does not take: 1,280 × 1,024 weights, two
    // tiles of the default bound (1,024 and 256 rows); leading dims kept
    let (out, inn) = (1280i64, 1024i64);
    let w = randn(&[out, inn], 27) * 0.05;
    let x = randn(&[2, 3, inn], 28);
    let g = randn(&[2, 3, out], 29);
    for kind in [QuantKind::Q5_1, QuantKind::Nf4 { double_quant: true }] {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        for (dtype, tol) in [(Kind::Double, 1e-12), (Kind::Half, 2e-3)] {
            let (x, g) = (x.to_kind(dtype), g.to_kind(dtype));
            let xf = x.detach().set_requires_grad(true);
            let y = q.linear(&xf).unwrap();
            assert_eq!((y.kind(), y.size()), (dtype, vec![2, 3, out]));
            (&y * &g).sum(Kind::Double).backward();
            let xr = x.detach().set_requires_grad(true);
            let yr = xr.linear::<Tensor>(&q.dequantize(dtype).unwrap(), None);
            (&yr * &g).sum(Kind::Double).backward();
            assert!(
                rel(&y, &yr) < tol,
                "{kind:?} {dtype:?} forward {}",
                rel(&y, &yr)
            );
            let (gx, gxr) = (xf.grad(), xr.grad());
            assert!(
                rel(&gx, &gxr) < tol,
                "{kind:?} {dtype:?} backward {}",
                rel(&gx, &gxr)
            );
        }
        // the no-grad products (a frozen head's chunks): x·Wᵀ and g·W, tile by tile
        let xd = x.to_kind(Kind::Double).reshape([-1, inn]);
        let gd = g.to_kind(Kind::Double).reshape([-1, out]);
        let wd = q.dequantize(Kind::Double).unwrap();
        let y = q.matmul(&xd, false).unwrap();
        assert!(rel(&y, &xd.mm(&wd.tr())) < 1e-12, "{kind:?} matmul");
        let gx = q.matmul(&gd, true).unwrap();
        assert!(rel(&gx, &gd.mm(&wd)) < 1e-12, "{kind:?} matmul transposed");
    }
}

#[test]
fn the_tensor_op_path_follows_autocast() {
    let (out, inn) = (40i64, 256i64);
    let w = randn(&[out, inn], 30) * 0.05;
    let q = QuantWeight::quantize(&w, QuantKind::Q4_K).unwrap();
    let x = randn(&[3, inn], 31);
    let reference = x.linear::<Tensor>(&q.dequantize(Kind::Float).unwrap(), None);
    let y = {
        let _a = sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        q.linear_tiled(&x, 16 * inn as u64).unwrap()
    };
    assert_eq!(y.kind(), Kind::BFloat16);
    assert!(
        rel(&y, &reference) < 2e-2,
        "autocast {}",
        rel(&y, &reference)
    );
    // a float64 input stays float64 under autocast, as a plain matmul's would
    let y = {
        let _a = sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        q.linear_tiled(&x.to_kind(Kind::Double), 16 * inn as u64)
            .unwrap()
    };
    assert_eq!(y.kind(), Kind::Double);
}

/// A [`sys::TiledWeight`] over a dense `w` whose decoder counts its calls, fails from call
/// `fail_at` on (with an error, or a panic) and holds `alive` until the shim frees it.
fn counting_weight(
    w: &Tensor,
    calls: Arc<AtomicUsize>,
    fail_at: usize,
    panic: bool,
    alive: Arc<()>,
) -> sys::TiledWeight {
    let w = w.shallow_clone();
    let [out, inn] = w.size()[..] else {
        unreachable!()
    };
    sys::TiledWeight {
        out,
        inn,
        tile_rows: 3,
        rows: Box::new(move |r0, r1, kind| {
            let _keep = &alive;
            let call = calls.fetch_add(1, Ordering::SeqCst);
            if call >= fail_at {
                if panic {
                    panic!("decoder panic at rows {r0}..{r1}");
                }
                return Err(lora_core::Error::Quant {
                    kind: "test".into(),
                    reason: format!("no rows {r0}..{r1} today"),
                });
            }
            Ok(w.narrow(0, r0, r1 - r0).to_kind(kind))
        }),
    }
}

#[test]
fn row_decoder_errors_and_panics_come_back_as_errors_and_its_context_is_freed() {
    let w = randn(&[8, 16], 32);
    let x = randn(&[2, 16], 33).set_requires_grad(true);
    let alive = Arc::new(());
    // 3 tiles of 3, 3 and 2 rows: forward then backward, each decoding every tile
    let calls = Arc::new(AtomicUsize::new(0));
    let y = sys::tiled_linear(
        &x,
        counting_weight(&w, calls.clone(), 99, false, alive.clone()),
    )
    .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    assert!(y.equal(&x.detach().mm(&w.tr())) || rel(&y, &x.detach().mm(&w.tr())) < 1e-6);
    // the autograd node holds the decoder until its backward has run
    assert_eq!(Arc::strong_count(&alive), 2);
    y.sum(Kind::Float).backward();
    assert_eq!(calls.load(Ordering::SeqCst), 6);
    assert_eq!(
        Arc::strong_count(&alive),
        1,
        "released after the backward pass"
    );
    let gx = x.grad();
    assert!(
        rel(
            &gx,
            &w.sum_dim_intlist([0i64].as_slice(), true, Kind::Float)
                .expand([2, 16], false)
        ) < 1e-6
    );
    // an input that takes no gradient: freed at once
    let _ = sys::tiled_linear(
        &x.detach(),
        counting_weight(&w, calls.clone(), 99, false, alive.clone()),
    )
    .unwrap();
    assert_eq!(Arc::strong_count(&alive), 1);
    // a dropped graph frees it too
    let y = sys::tiled_linear(
        &x,
        counting_weight(&w, calls.clone(), 99, false, alive.clone()),
    )
    .unwrap();
    assert_eq!(Arc::strong_count(&alive), 2);
    drop(y);
    assert_eq!(Arc::strong_count(&alive), 1);
    // an error on the second tile of the forward pass
    let e = sys::tiled_linear(
        &x,
        counting_weight(&w, Arc::new(AtomicUsize::new(0)), 1, false, alive.clone()),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("rows 3..6") && e.contains("no rows 3..6 today"),
        "{e}"
    );
    assert_eq!(Arc::strong_count(&alive), 1);
    // a panic in the decoder: an error, not an abort
    let e = sys::tiled_matmul(
        &x.detach(),
        counting_weight(&w, Arc::new(AtomicUsize::new(0)), 0, true, alive.clone()),
        false,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("panicked") && e.contains("decoder panic at rows 0..3"),
        "{e}"
    );
    // an error in the backward pass comes back from the backward call
    let y = sys::tiled_linear(
        &x,
        counting_weight(&w, Arc::new(AtomicUsize::new(0)), 3, false, alive.clone()),
    )
    .unwrap();
    let e = y.sum(Kind::Float).f_backward().unwrap_err().to_string();
    assert!(e.contains("no rows 0..3 today"), "{e}");
    drop(y);
    assert_eq!(Arc::strong_count(&alive), 1);
    // the shim checks what the decoder hands back
    let bad = sys::TiledWeight {
        out: 8,
        inn: 16,
        tile_rows: 4,
        rows: Box::new(|r0, r1, _| Ok(Tensor::zeros([r1 - r0, 16], (Kind::Double, Device::Cpu)))),
    };
    let e = sys::tiled_matmul(&x.detach(), bad, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("Double") && e.contains("Float"), "{e}");
    let bad = sys::TiledWeight {
        out: 8,
        inn: 16,
        tile_rows: 4,
        rows: Box::new(|r0, r1, k| Ok(Tensor::zeros([r1 - r0 + 1, 16], (k, Device::Cpu)))),
    };
    let e = sys::tiled_matmul(&x.detach(), bad, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("expected [4, 16]"), "{e}");
    // integer inputs are refused before any decoding
    let e = sys::tiled_linear(
        &Tensor::zeros([2, 16], (Kind::Int64, Device::Cpu)),
        counting_weight(&w, calls, 0, true, alive.clone()),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("float16, bfloat16, float32 or float64"), "{e}");
    assert_eq!(Arc::strong_count(&alive), 1);
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
    // f64 is not a kernel dtype: the tensor-op tiled path answers it
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

/// The CPU kernel's bf16 products have a bf16 GEMM's numbers — bf16 operands, f32 sums, one
/// rounding — whichever way this CPU computes them (the forward pass by libtorch's bf16 GEMM
/// with AVX-512, by f32 GEMMs over the widened operands without it,
/// `sys::cpu_has_fast_bf16_gemm`; the input gradient of a weight of several tiles by f32 GEMMs
/// everywhere): forward and input gradient against libtorch's bf16 `mm` with the weight decoded
/// in f32 and rounded to bf16, over a weight of two tiles, so the input gradient's sums run
/// across tiles before their one rounding (with a bf16 product per tile, 554 of its 9,216
/// values were off by more than a bf16 step on an AVX-512 BF16 CPU).
#[test]
fn bf16_products_equal_a_bf16_gemm_of_the_dequantized_weight() {
    let (out, inn, n) = (2048i64, 768i64, 12i64);
    assert!(
        out * inn > sys::QLINEAR_TILE_ELEMENTS as i64,
        "two tiles at least"
    );
    let w = randn(&[out, inn], 41) * 0.05;
    let x = randn(&[n, inn], 42).to_kind(Kind::BFloat16);
    let g = randn(&[n, out], 43).to_kind(Kind::BFloat16);
    // |a − b| within one bf16 step of b (2⁻⁷ relative), and most values identical
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        assert_eq!((a.kind(), a.size()), (Kind::BFloat16, b.size()), "{what}");
        let (a, b) = (a.to_kind(Kind::Double), b.to_kind(Kind::Double));
        let d = (&a - &b).abs();
        let bound = b.abs() * 2f64.powi(-7) + 1e-30;
        let over = d.gt_tensor(&bound).sum(Kind::Int64).int64_value(&[]);
        let same = d
            .eq(0.0)
            .to_kind(Kind::Double)
            .mean(Kind::Double)
            .double_value(&[]);
        assert!(
            over == 0 && same > 0.7,
            "{what}: {over} values off by more than a bf16 step, {same:.3} identical"
        );
    };
    for kind in [
        QuantKind::Q4_1,
        QuantKind::Q8_0,
        QuantKind::Nf4 { double_quant: true },
    ] {
        let q = QuantWeight::quantize(&w, kind).unwrap();
        // the kernel decodes in f32 and rounds each weight to bf16 once
        let wb = q.dequantize(Kind::Float).unwrap().to_kind(Kind::BFloat16);
        let xr = x.detach().set_requires_grad(true);
        let y = q.linear(&xr).unwrap();
        close(&y, &x.mm(&wb.tr()), &format!("{kind:?} forward"));
        (&y * &g).sum(Kind::Float).backward();
        close(&xr.grad(), &g.mm(&wb), &format!("{kind:?} input gradient"));
        close(
            &q.matmul(&g, true).unwrap(),
            &g.mm(&wb),
            &format!("{kind:?} x · W"),
        );
    }
}
