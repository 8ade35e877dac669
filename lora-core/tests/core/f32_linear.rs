//! The oneDNN f32 linear (`lora_core::sys::f32_linear`): forward and both gradients equal
//! libtorch's `linear` computed in f64, for contiguous and transposed weights (LoRA factors'
//! shapes too), and it refuses what it does not compute.

use lora_core::sys;
use tch::{Device, Kind, Tensor};

fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_kind(Kind::Double);
    let b = b.to_kind(Kind::Double);
    let num = (&a - &b).abs().max().double_value(&[]);
    let den = b.abs().max().double_value(&[]).max(1e-30);
    num / den
}

#[test]
fn f32_linear_equals_linear_in_f64_forward_and_backward() {
    tch::manual_seed(11);
    // `[out, in]`: a square-ish weight, a LoRA A factor `[r, in]` and a B factor `[out, r]`
    // (taller than 4× its width: its gradient takes the `(xᵀ·g)ᵀ` product)
    for (out, inp) in [(256, 192), (8, 192), (256, 8)] {
        for transposed in [false, true] {
            check_f32_linear(out, inp, transposed);
        }
    }

    // a frozen weight: only x's gradient, and no graph at all under no_grad
    let x = Tensor::randn([4, 128], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = Tensor::randn([130, 128], (Kind::Float, Device::Cpu));
    let y = sys::f32_linear(&x, &w).unwrap();
    assert!(y.requires_grad());
    y.sum(Kind::Float).backward();
    assert!(
        rel_err(
            &x.grad(),
            &w.sum_dim_intlist([0i64].as_slice(), false, Kind::Float)
                .expand([4, 128], false)
        ) < 1e-5
    );
    let y = tch::no_grad(|| sys::f32_linear(&x, &w).unwrap());
    assert!(!y.requires_grad());

    // what it refuses
    let xb = x.detach().to_kind(Kind::BFloat16);
    let err = sys::f32_linear(&xb, &w).unwrap_err().to_string();
    assert!(err.contains("f32 tensors"), "{err}");
    let err = sys::f32_linear(&x.detach(), &w.tr())
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not fit weight"), "{err}");
}

#[test]
fn linear_product_equals_linear_in_f64_on_either_gemm() {
    // whichever GEMM this CPU takes (`sys::cpu_f32_gemm_by_onednn`), the same function
    tch::manual_seed(12);
    let x = Tensor::randn([2, 7, 256], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([384, 256], (Kind::Float, Device::Cpu));
    let y = lora_core::linear::linear_product(&x, &w).unwrap();
    let yd = x
        .to_kind(Kind::Double)
        .linear::<Tensor>(&w.to_kind(Kind::Double), None);
    assert!(rel_err(&y, &yd) < 1e-5, "{}", rel_err(&y, &yd));
}

/// `f32_linear` of `x` `[3, 5, inp]` by a weight `[out, inp]` (contiguous, or a transposed view
/// of `[inp, out]`) against libtorch's `linear` in f64: the output and both gradients.
fn check_f32_linear(out: i64, inp: i64, transposed: bool) {
    let x = Tensor::randn([3, 5, inp], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let w = if transposed {
        Tensor::randn([inp, out], (Kind::Float, Device::Cpu)).tr()
    } else {
        Tensor::randn([out, inp], (Kind::Float, Device::Cpu))
    }
    .detach()
    .set_requires_grad(true);
    let g = Tensor::randn([3, 5, out], (Kind::Float, Device::Cpu));

    let y = sys::f32_linear(&x, &w).unwrap();
    assert_eq!(y.size(), [3, 5, out]);
    assert_eq!(y.kind(), Kind::Float);
    (&y * &g).sum(Kind::Float).backward();
    let (gx, gw) = (x.grad(), w.grad());
    assert_eq!(gw.size(), [out, inp]);

    let xd = x.detach().to_kind(Kind::Double).set_requires_grad(true);
    let wd = w.detach().to_kind(Kind::Double).set_requires_grad(true);
    let yd = xd.linear::<Tensor>(&wd, None);
    (&yd * g.to_kind(Kind::Double)).sum(Kind::Double).backward();

    assert!(rel_err(&y, &yd) < 1e-5, "forward {}", rel_err(&y, &yd));
    assert!(
        rel_err(&gx, &xd.grad()) < 1e-5,
        "x grad {}",
        rel_err(&gx, &xd.grad())
    );
    assert!(
        rel_err(&gw, &wd.grad()) < 1e-5,
        "w grad {}",
        rel_err(&gw, &wd.grad())
    );
}
