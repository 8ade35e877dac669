//! The CPU LoRA branch op (`lora_core::sys::lora_branch`, `shim/lora_branch.cpp`): output and
//! the gradients of x, the frozen products and every factor against PEFT's composite
//! `base + (x·Aᵀ)·Bᵀ·scaling` per site computed in f64 autograd, over one and several sites,
//! ranks and widths that are no multiple of the kernel's 6 × 16 tiles, strided operands, and
//! what it refuses.

use crate::common::{avx2_kernels_here, formula_values, leaf, rel_err};
use lora_core::sys;
use tch::{Device, Kind, Tensor};

/// PEFT's composite for each site, side by side: `base[.., seg_i] + (x·A_iᵀ)·B_iᵀ·s_i`.
fn composite(x: &Tensor, base: &Tensor, a: &[Tensor], b: &[Tensor], scales: &[f64]) -> Tensor {
    let outs: Vec<i64> = b.iter().map(|b| b.size()[0]).collect();
    let parts = base.split_with_sizes(outs.as_slice(), -1);
    let ys: Vec<Tensor> = parts
        .iter()
        .zip(a.iter().zip(b).zip(scales))
        .map(|(p, ((a, b), s))| p + x.matmul(&a.tr()).matmul(&b.tr()) * *s)
        .collect();
    Tensor::cat(&ys, -1)
}

/// The output and gradients of one run: (y, ∂x, ∂base, ∂A_i…, ∂B_i…).
fn run(
    op: impl Fn(&Tensor, &Tensor, &[Tensor], &[Tensor]) -> Tensor,
    kind: Kind,
    x: &Tensor,
    base: &Tensor,
    a: &[Tensor],
    b: &[Tensor],
) -> Vec<Tensor> {
    let d = |t: &Tensor| leaf(&t.to_kind(kind));
    let (xl, bl) = (d(x), d(base));
    let (al, bbl): (Vec<Tensor>, Vec<Tensor>) =
        (a.iter().map(d).collect(), b.iter().map(d).collect());
    let y = op(&xl, &bl, &al, &bbl);
    assert_eq!(y.size(), base.size());
    assert_eq!(y.kind(), kind);
    let gy = formula_values(&y.size(), 0.3, 1.0).to_kind(kind);
    (&y * &gy).sum(kind).backward();
    let mut out = vec![y, xl.grad(), bl.grad()];
    out.extend(al.iter().chain(&bbl).map(Tensor::grad));
    out
}

/// Runs the op, libtorch's f32 composite and the f64 composite on the same values and output
/// gradient; returns the relative errors against the f64 values of (y, ∂x, ∂base, ∂A_i…,
/// ∂B_i…), the op's and libtorch's f32 ones.
fn compare(
    x: &Tensor,
    base: &Tensor,
    a: &[Tensor],
    b: &[Tensor],
    scales: &[f64],
) -> (Vec<f64>, Vec<f64>) {
    let ours = run(
        |x, base, a, b| {
            let (ar, br): (Vec<&Tensor>, Vec<&Tensor>) = (a.iter().collect(), b.iter().collect());
            sys::lora_branch(x, base, &ar, &br, scales).unwrap()
        },
        Kind::Float,
        x,
        base,
        a,
        b,
    );
    let reference =
        |x: &Tensor, base: &Tensor, a: &[Tensor], b: &[Tensor]| composite(x, base, a, b, scales);
    let libtorch = run(reference, Kind::Float, x, base, a, b);
    let exact = run(reference, Kind::Double, x, base, a, b);
    let errs = |r: &[Tensor]| r.iter().zip(&exact).map(|(o, e)| rel_err(o, e)).collect();
    (errs(&ours), errs(&libtorch))
}

/// `sites` as (rank, out) pairs over an input `[lead…, in]`.
fn operands(
    lead: &[i64],
    inf: i64,
    sites: &[(i64, i64)],
) -> (Tensor, Tensor, Vec<Tensor>, Vec<Tensor>) {
    let outs: i64 = sites.iter().map(|s| s.1).sum();
    let shape = |last: i64| [lead, &[last]].concat();
    let x = formula_values(&shape(inf), 0.0, 1.0);
    let base = formula_values(&shape(outs), 1.0, 2.0);
    let a = sites
        .iter()
        .enumerate()
        .map(|(i, &(r, _))| formula_values(&[r, inf], 2.0 + i as f64, 0.2))
        .collect();
    let b = sites
        .iter()
        .enumerate()
        .map(|(i, &(r, o))| formula_values(&[o, r], 3.0 + i as f64, 0.5))
        .collect();
    (x, base, a, b)
}

#[test]
fn lora_branch_equals_the_composite_in_f64() {
    if !avx2_kernels_here() {
        let (x, base, a, b) = operands(&[4], 16, &[(2, 8)]);
        let err = sys::lora_branch(&x, &base, &[&a[0]], &[&b[0]], &[1.0])
            .unwrap_err()
            .to_string();
        assert!(err.contains("AVX2"), "{err}");
        return;
    }
    // (leading dims, in, sites as (rank, out), scalings): SmolLM2's q/k/v, gate/up, o and down
    // at 2 × 128 tokens; ranks and widths that end inside a tile; one row; one rank
    let cases: [(&[i64], i64, &[(i64, i64)], &[f64]); 6] = [
        (
            &[2, 128],
            576,
            &[(8, 576), (8, 192), (8, 192)],
            &[2.0, 2.0, 2.0],
        ),
        (&[256], 576, &[(8, 1536), (8, 1536)], &[2.0, 0.5]),
        (&[2, 128], 1536, &[(8, 576)], &[2.0]),
        (&[7], 37, &[(3, 5), (17, 33), (1, 1)], &[1.0, 0.25, -3.0]),
        (&[1], 16, &[(16, 16)], &[1.0]),
        (&[3, 5, 2], 40, &[(24, 20), (5, 50)], &[0.7, 1.3]),
    ];
    for (lead, inf, sites, scales) in cases {
        let (x, base, a, b) = operands(lead, inf, sites);
        let (errs, libtorch) = compare(&x, &base, &a, &b, scales);
        let n = sites.len();
        for (i, (e, lt)) in errs.iter().zip(&libtorch).enumerate() {
            let name = match i {
                0 => "y".to_string(),
                1 => "∂x".to_string(),
                2 => "∂base".to_string(),
                i if i < 3 + n => format!("∂A_{}", i - 3),
                i => format!("∂B_{}", i - 3 - n),
            };
            // f32 sums of a few hundred to 1,536 terms that cancel (‖terms‖₁ ≈ 100 × the
            // result for ∂A here): libtorch's own f32 products miss the f64 values by up to
            // 1.2e-5 on these inputs, so the bound is 1e-5 or 1.5 × libtorch's error
            assert!(
                *e < 1e-5_f64.max(1.5 * lt),
                "{name} of {lead:?}, in {inf}, sites {sites:?}: relative error {e:.2e} (libtorch's f32: {lt:.2e})"
            );
        }
    }
}

#[test]
fn lora_branch_reads_strided_operands() {
    if !avx2_kernels_here() {
        return;
    }
    // x and the frozen products as columns of wider tensors, B stored transposed
    let wide_x = formula_values(&[50, 3 * 40], 0.0, 1.0);
    let x = wide_x.narrow(1, 40, 40);
    let wide_base = formula_values(&[50, 70], 1.0, 2.0);
    let base = wide_base.narrow(1, 3, 64);
    assert!(!x.is_contiguous() && !base.is_contiguous());
    let a = vec![
        formula_values(&[8, 40], 2.0, 0.2),
        formula_values(&[4, 40], 3.0, 0.2),
    ];
    let b = vec![
        formula_values(&[8, 24], 4.0, 0.5).tr(),
        formula_values(&[40, 4], 5.0, 0.5),
    ];
    assert!(!b[0].is_contiguous());
    let (errs, libtorch) = compare(&x, &base, &a, &b, &[2.0, 0.5]);
    for (i, (e, lt)) in errs.iter().zip(&libtorch).enumerate() {
        assert!(
            *e < 1e-5_f64.max(1.5 * lt),
            "output/gradient {i}: relative error {e:.2e} (libtorch's f32: {lt:.2e})"
        );
    }
    // without a gradient: no graph, the same values twice
    let (ar, br): (Vec<&Tensor>, Vec<&Tensor>) = (a.iter().collect(), b.iter().collect());
    let y = sys::lora_branch(&x, &base, &ar, &br, &[2.0, 0.5]).unwrap();
    assert!(!y.requires_grad());
    let again = sys::lora_branch(&x, &base, &ar, &br, &[2.0, 0.5]).unwrap();
    assert!(y.equal(&again), "two runs differ");
}

#[test]
fn lora_branch_refuses_what_it_does_not_take() {
    let (x, base, a, b) = operands(&[4], 16, &[(2, 8), (3, 6)]);
    let (a0, a1, b0, b1) = (&a[0], &a[1], &b[0], &b[1]);
    let f64x = x.to_kind(Kind::Double);
    let wide_a = formula_values(&[2, 17], 0.0, 1.0);
    let short_base = base.narrow(1, 0, 13);
    let base_rows = formula_values(&[5, 14], 0.0, 1.0);
    // (x, base, A list, B list, scalings, what the error names)
    let cases: Vec<(&Tensor, &Tensor, Vec<&Tensor>, Vec<&Tensor>, Vec<f64>, &str)> = vec![
        (
            &x,
            &base,
            vec![a0, a1],
            vec![b0],
            vec![1.0, 1.0],
            "one of each per site",
        ),
        (
            &x,
            &base,
            vec![a0, a1],
            vec![b0, b1],
            vec![1.0],
            "one of each per site",
        ),
        (&x, &base, vec![], vec![], vec![], "at least one"),
        (
            &f64x,
            &base,
            vec![a0, a1],
            vec![b0, b1],
            vec![1.0, 1.0],
            "f32 CPU input",
        ),
        (
            &x,
            &base,
            vec![&wide_a, a1],
            vec![b0, b1],
            vec![1.0, 1.0],
            "LoRA site 0",
        ),
        (
            &x,
            &base,
            vec![a0, a1],
            vec![b1, b0],
            vec![1.0, 1.0],
            "LoRA site 0",
        ),
        (
            &x,
            &short_base,
            vec![a0, a1],
            vec![b0, b1],
            vec![1.0, 1.0],
            "13 columns",
        ),
        (
            &x,
            &base_rows,
            vec![a0, a1],
            vec![b0, b1],
            vec![1.0, 1.0],
            "leading dims",
        ),
    ];
    // nothing to multiply: no input features, or no outputs
    let (x0, a0w) = (
        Tensor::zeros([4, 0], (Kind::Float, Device::Cpu)),
        Tensor::zeros([2, 0], (Kind::Float, Device::Cpu)),
    );
    let b_empty = Tensor::zeros([0, 2], (Kind::Float, Device::Cpu));
    let base_empty = Tensor::zeros([4, 0], (Kind::Float, Device::Cpu));
    assert!(!sys::lora_branch_applies(
        &x0,
        &base.narrow(1, 0, 8),
        &[&a0w],
        &[b0]
    ));
    assert!(!sys::lora_branch_applies(
        &x,
        &base_empty,
        &[a0],
        &[&b_empty]
    ));
    for (x, base, a, b, s, want) in cases {
        // (the scalings are the op's to check: `applies` does not take them)
        assert!(
            s.len() != a.len() || !sys::lora_branch_applies(x, base, &a, &b),
            "applies to a case that names {want:?}"
        );
        if !avx2_kernels_here() {
            continue;
        }
        let err = sys::lora_branch(x, base, &a, &b, &s)
            .unwrap_err()
            .to_string();
        assert!(err.contains(want), "expected {want:?} in {err}");
    }
    if !avx2_kernels_here() {
        return;
    }
    // what it takes: used unless asked not to, or on a CPU with AVX-512; never under autocast
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    let wanted = match sys::cpu_lora_request() {
        sys::CpuKernelRequest::Lsdk => true,
        sys::CpuKernelRequest::Libtorch => false,
        _ => !avx512 && sys::cpu_kernels_parallel(),
    };
    assert_eq!(
        sys::lora_branch_applies(&x, &base, &[a0, a1], &[b0, b1]),
        wanted
    );
    let under_autocast = {
        let _autocast = sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        sys::lora_branch_applies(&x, &base, &[a0, a1], &[b0, b1])
    };
    assert!(!under_autocast, "applies under autocast");
}

#[test]
fn lora_branch_computes_the_gradients_asked_for_and_refuses_stale_ones() {
    if !avx2_kernels_here() {
        return;
    }
    let (x, base, a, b) = operands(&[3, 10], 24, &[(4, 16), (2, 9)]);
    let gy = formula_values(&[3, 10, 25], 0.3, 1.0);
    let run = |grad_x: bool, grad_a: bool, grad_b: bool| {
        let x = x.detach().set_requires_grad(grad_x);
        let a: Vec<Tensor> = a
            .iter()
            .map(|t| t.detach().set_requires_grad(grad_a))
            .collect();
        let b: Vec<Tensor> = b
            .iter()
            .map(|t| t.detach().set_requires_grad(grad_b))
            .collect();
        let (ar, br): (Vec<&Tensor>, Vec<&Tensor>) = (a.iter().collect(), b.iter().collect());
        let y = sys::lora_branch(&x, &base, &ar, &br, &[1.5, 0.5]).unwrap();
        (&y * &gy).sum(Kind::Float).backward();
        let grad = |t: &Tensor| t.requires_grad().then(|| t.grad());
        (
            grad(&x),
            a.iter().map(grad).collect::<Vec<_>>(),
            b.iter().map(grad).collect::<Vec<_>>(),
        )
    };
    let (gx, ga, gb) = run(true, true, true);
    // each gradient alone equals the full run's, bit for bit, and the others are not asked for
    let (gx1, ga1, gb1) = run(true, false, false);
    assert!(gx1.unwrap().equal(gx.as_ref().unwrap()));
    assert!(ga1.iter().chain(&gb1).all(Option::is_none));
    let (_, ga2, _) = run(false, true, false);
    for (g, full) in ga2.iter().zip(&ga) {
        assert!(g.as_ref().unwrap().equal(full.as_ref().unwrap()));
    }
    let (_, _, gb3) = run(false, false, true);
    for (g, full) in gb3.iter().zip(&gb) {
        assert!(g.as_ref().unwrap().equal(full.as_ref().unwrap()));
    }
    // the output is no view: changed in place, its gradient flows on as for any op
    let xi = leaf(&x);
    let mut y =
        sys::lora_branch(&xi, &base, &[&a[0], &a[1]], &[&b[0], &b[1]], &[1.5, 0.5]).unwrap();
    let _ = y.f_mul_(&Tensor::from(2.0f32)).unwrap();
    (&y * &gy).sum(Kind::Float).backward();
    let doubled = gx.as_ref().unwrap() * 2.0;
    assert!(xi.grad().allclose(&doubled, 1e-6, 1e-6, false));
    // a factor or the input changed in place between the passes: an error, not wrong gradients
    for which in ["input", "A factor 1", "B factor 0"] {
        let x = leaf(&x);
        let a: Vec<Tensor> = a.iter().map(leaf).collect();
        let b: Vec<Tensor> = b.iter().map(leaf).collect();
        let (ar, br): (Vec<&Tensor>, Vec<&Tensor>) = (a.iter().collect(), b.iter().collect());
        let y = sys::lora_branch(&x, &base, &ar, &br, &[1.5, 0.5]).unwrap();
        let target = match which {
            "input" => &x,
            "A factor 1" => &a[1],
            _ => &b[0],
        };
        tch::no_grad(|| {
            let _ = target
                .shallow_clone()
                .f_mul_(&Tensor::from(2.0f32))
                .unwrap();
        });
        let err = (&y * &gy)
            .sum(Kind::Float)
            .f_backward()
            .expect_err("a stale backward ran")
            .to_string();
        assert!(
            err.contains(which) && err.contains("changed in place"),
            "{which}: {err}"
        );
    }
}
