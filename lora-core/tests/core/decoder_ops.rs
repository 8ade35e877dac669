//! The decoder block's fused element-wise ops (`lora_core::sys::{silu_mul, swiglu, rope,
//! rms_norm}`, `shim/decoder_ops.cpp`): forward values and gradients against the composite of
//! libtorch ops computed in f64 (HF's formulas), their layouts, what autograd keeps, and what
//! they refuse.

use lora_core::sys;
use tch::{Device, Kind, Tensor};

fn f64_of(t: &Tensor) -> Tensor {
    t.detach().to_kind(Kind::Double)
}

/// max |a − b| / max |b|.
fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    let (a, b) = (f64_of(a), f64_of(b));
    let num = (&a - &b).abs().max().double_value(&[]);
    let den = b.abs().max().double_value(&[]).max(1e-30);
    num / den
}

/// Backpropagates `dy` from `y` (as the gradient of `Σ y·dy`).
fn backward(y: &Tensor, dy: &Tensor) {
    (y * dy).sum(y.kind()).backward();
}

fn leaf(t: Tensor) -> Tensor {
    t.detach().set_requires_grad(true)
}

/// HF `rotate_half`, in whatever dtype `x` has.
fn rotate_half(x: &Tensor) -> Tensor {
    let half = x.size()[3] / 2;
    Tensor::cat(&[x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)], -1)
}

#[test]
fn silu_mul_equals_the_composite_in_f64() {
    tch::manual_seed(21);
    // rows wider and narrower than a vector, odd widths, large |g| where the sigmoid saturates
    for (shape, scale) in [
        (vec![2, 7, 96], 3.0),
        (vec![5, 33], 30.0),
        (vec![3, 1], 1.0),
    ] {
        let g = leaf(Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)) * scale);
        let u = leaf(Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu)));
        let dh = Tensor::randn(shape.as_slice(), (Kind::Float, Device::Cpu));
        let h = sys::silu_mul(&g, &u).unwrap();
        assert_eq!(h.size(), shape);
        backward(&h, &dh);

        let (gd, ud) = (leaf(f64_of(&g)), leaf(f64_of(&u)));
        let hd = gd.silu() * &ud;
        backward(&hd, &f64_of(&dh));
        assert!(rel_err(&h, &hd) < 1e-6, "h {shape:?}: {}", rel_err(&h, &hd));
        assert!(
            rel_err(&g.grad(), &gd.grad()) < 1e-6,
            "dg {}",
            rel_err(&g.grad(), &gd.grad())
        );
        assert!(
            rel_err(&u.grad(), &ud.grad()) < 1e-6,
            "du {}",
            rel_err(&u.grad(), &ud.grad())
        );
    }
}

#[test]
fn swiglu_of_a_joined_tensor_gives_one_gradient() {
    tch::manual_seed(22);
    let gu = leaf(Tensor::randn([2, 5, 2 * 40], (Kind::Float, Device::Cpu)) * 4.0);
    let dh = Tensor::randn([2, 5, 40], (Kind::Float, Device::Cpu));
    let h = sys::swiglu(&gu).unwrap();
    assert_eq!(h.size(), [2, 5, 40]);
    backward(&h, &dh);

    let gud = leaf(f64_of(&gu));
    let hd = gud.narrow(-1, 0, 40).silu() * gud.narrow(-1, 40, 40);
    backward(&hd, &f64_of(&dh));
    assert!(rel_err(&h, &hd) < 1e-6);
    assert_eq!(gu.grad().size(), [2, 5, 80]);
    assert!(
        rel_err(&gu.grad(), &gud.grad()) < 1e-6,
        "{}",
        rel_err(&gu.grad(), &gud.grad())
    );

    // a strided view in (a row of another tensor's columns), and no graph under no_grad
    let wide = Tensor::randn([6, 100], (Kind::Float, Device::Cpu));
    let view = wide.narrow(1, 10, 80);
    let h = tch::no_grad(|| sys::swiglu(&view).unwrap());
    assert!(!h.requires_grad());
    let hd = f64_of(&view).narrow(-1, 0, 40).silu() * f64_of(&view).narrow(-1, 40, 40);
    assert!(rel_err(&h, &hd) < 1e-6);

    let err = sys::swiglu(&Tensor::zeros([3, 7], (Kind::Float, Device::Cpu)))
        .unwrap_err()
        .to_string();
    assert!(err.contains("even last dim"), "{err}");
}

#[test]
fn silu_mul_in_bf16_and_f16_is_the_composite_bit_for_bit() {
    // not f32 on the CPU: libtorch's own ops inside the node, so autograd's numbers exactly
    tch::manual_seed(23);
    for kind in [Kind::BFloat16, Kind::Half] {
        let g = leaf((Tensor::randn([64, 96], (Kind::Float, Device::Cpu)) * 3.0).to_kind(kind));
        let u = leaf(Tensor::randn([64, 96], (Kind::Float, Device::Cpu)).to_kind(kind));
        let dh = Tensor::randn([64, 96], (Kind::Float, Device::Cpu)).to_kind(kind);
        let h = sys::silu_mul(&g, &u).unwrap();
        assert_eq!(h.kind(), kind);
        backward(&h, &dh);
        let (g2, u2) = (leaf(g.detach()), leaf(u.detach()));
        let h2 = g2.silu() * &u2;
        backward(&h2, &dh);
        assert!(h.equal(&h2), "{kind:?}");
        assert!(g.grad().equal(&g2.grad()), "{kind:?}");
        assert!(u.grad().equal(&u2.grad()), "{kind:?}");
    }

    let g = Tensor::zeros([4, 8], (Kind::BFloat16, Device::Cpu));
    let err = sys::silu_mul(&g, &g.to_kind(Kind::Float))
        .unwrap_err()
        .to_string();
    assert!(err.contains("differ in dtype"), "{err}");
}

#[test]
fn swiglu_keeps_one_activation_less_than_the_composite() {
    // What the graph holds after the forward, by the counting allocator: gate/up (one tensor)
    // and the output, against the same plus silu(gate) for libtorch's ops. Other tests of this
    // executable allocate concurrently, so each side is measured three times (least for the
    // fused op, most for the composite).
    sys::install_counting_cpu_allocator().unwrap();
    let live = || sys::cpu_mem_stats().unwrap().current_bytes as i64;
    let held = |fused: bool| -> i64 {
        let gu = leaf(Tensor::randn([64, 2 * 256], (Kind::Float, Device::Cpu)));
        let x = leaf(Tensor::randn([64, 2 * 256], (Kind::Float, Device::Cpu)));
        let before = live();
        // a product first, so that gate/up are an intermediate the graph must keep
        let y = &gu * &x;
        let h = if fused {
            sys::swiglu(&y).unwrap()
        } else {
            y.narrow(-1, 0, 256).silu() * y.narrow(-1, 256, 256)
        };
        let after = live();
        drop(h);
        after - before
    };
    let fused = (0..3).map(|_| held(true)).min().unwrap_or(0);
    let composite = (0..3).map(|_| held(false)).max().unwrap_or(0);
    let act = 64 * 256 * 4;
    // gate/up (two activations) and the output; the composite also keeps silu(gate)
    assert!(fused <= 3 * act, "fused {fused}");
    assert!(composite >= 4 * act, "composite {composite}");
}

#[test]
fn rope_equals_rotate_half_in_f64() {
    tch::manual_seed(24);
    let (b, s, h, d) = (2, 9, 3, 16);
    // x as attention sees it: `[b, s, h, d]` memory transposed to `[b, h, s, d]`
    let xl = leaf(Tensor::randn([b, s, h, d], (Kind::Float, Device::Cpu)));
    let x = xl.transpose(1, 2);
    let cos = Tensor::randn([b, 1, s, d], (Kind::Float, Device::Cpu));
    let sin = Tensor::randn([b, 1, s, d], (Kind::Float, Device::Cpu));
    let dy = Tensor::randn([b, h, s, d], (Kind::Float, Device::Cpu));
    let y = sys::rope(&x, &cos, &sin).unwrap();
    assert_eq!(y.size(), [b, h, s, d]);
    assert_eq!(y.stride(), x.stride(), "the output keeps x's layout");
    backward(&y, &dy);
    let x_leaf_grad = xl.grad().transpose(1, 2);

    let xd = leaf(f64_of(&x));
    let (cd, sd) = (f64_of(&cos), f64_of(&sin));
    let yd = &xd * &cd + rotate_half(&xd) * &sd;
    backward(&yd, &f64_of(&dy));
    assert!(rel_err(&y, &yd) < 1e-6, "{}", rel_err(&y, &yd));
    assert!(
        rel_err(&x_leaf_grad, &xd.grad()) < 1e-6,
        "{}",
        rel_err(&x_leaf_grad, &xd.grad())
    );

    // tables shared by the batch `[1, 1, s, d]`
    let y1 = tch::no_grad(|| sys::rope(&x, &cos.narrow(0, 0, 1), &sin.narrow(0, 0, 1)).unwrap());
    let y1d = &xd * cd.narrow(0, 0, 1) + rotate_half(&xd) * sd.narrow(0, 0, 1);
    assert!(rel_err(&y1, &y1d) < 1e-6);

    let err = sys::rope(
        &x.narrow(3, 0, 15),
        &cos.narrow(3, 0, 15),
        &sin.narrow(3, 0, 15),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("even head_dim"), "{err}");
    let err = sys::rope(&x, &cos.narrow(2, 0, 4), &sin.narrow(2, 0, 4))
        .unwrap_err()
        .to_string();
    assert!(err.contains("do not broadcast"), "{err}");
    let err = sys::rope(&x.to_kind(Kind::BFloat16), &cos, &sin)
        .unwrap_err()
        .to_string();
    assert!(err.contains("f32 CPU"), "{err}");
}

#[test]
fn rms_norm_equals_hf_in_f64() {
    tch::manual_seed(25);
    for n in [576, 40, 7] {
        let x = leaf(Tensor::randn([2, 6, n], (Kind::Float, Device::Cpu)) * 3.0);
        let w = leaf(Tensor::randn([n], (Kind::Float, Device::Cpu)));
        let dy = Tensor::randn([2, 6, n], (Kind::Float, Device::Cpu));
        let y = sys::rms_norm(&x, &w, 1e-5).unwrap();
        backward(&y, &dy);

        let (xd, wd) = (leaf(f64_of(&x)), leaf(f64_of(&w)));
        let var = xd.square().mean_dim(-1, true, Kind::Double);
        let yd = &wd * (&xd * (var + 1e-5).rsqrt());
        backward(&yd, &f64_of(&dy));
        assert!(rel_err(&y, &yd) < 1e-6, "y n={n}: {}", rel_err(&y, &yd));
        assert!(
            rel_err(&x.grad(), &xd.grad()) < 1e-5,
            "dx n={n}: {}",
            rel_err(&x.grad(), &xd.grad())
        );
        assert!(
            rel_err(&w.grad(), &wd.grad()) < 1e-5,
            "dw n={n}: {}",
            rel_err(&w.grad(), &wd.grad())
        );
    }
    // a frozen weight takes no gradient
    let x = leaf(Tensor::randn([3, 32], (Kind::Float, Device::Cpu)));
    let w = Tensor::ones([32], (Kind::Float, Device::Cpu));
    sys::rms_norm(&x, &w, 1e-6)
        .unwrap()
        .sum(Kind::Float)
        .backward();
    assert!(x.grad().defined() && !w.grad().defined());

    let err = sys::rms_norm(&x, &Tensor::ones([31], (Kind::Float, Device::Cpu)), 1e-6)
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not fit"), "{err}");
}

#[test]
fn silu_mul_saturates_and_propagates_like_libtorch() {
    // beyond the polynomial's range: e^−x overflows to +∞ (silu → −0), underflows to 0
    // (silu → x); ±∞ and NaN as libtorch's `silu`
    let vals = [
        -3e38f32,
        -1e38,
        -1e5,
        -100.0,
        -88.5,
        -87.0,
        0.0,
        87.0,
        88.5,
        100.0,
        1e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let g = Tensor::from_slice(&vals);
    let u = Tensor::ones([vals.len() as i64], (Kind::Float, Device::Cpu));
    let h = sys::silu_mul(&g, &u).unwrap();
    let r = g.silu();
    for i in 0..vals.len() as i64 {
        let (a, b) = (h.double_value(&[i]), r.double_value(&[i]));
        let same = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= 1e-6 * b.abs();
        assert!(same, "silu({}) = {a}, libtorch {b}", vals[i as usize]);
    }
}

#[test]
fn empty_and_0_d_inputs_take_libtorch_s_ops() {
    let z =
        |shape: &[i64]| Tensor::zeros(shape, (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let g = z(&[4, 0]);
    let h = sys::silu_mul(&g, &z(&[4, 0])).unwrap();
    assert_eq!(h.size(), [4, 0]);
    h.sum(Kind::Float).backward();
    assert_eq!(g.grad().size(), [4, 0]);
    assert_eq!(sys::swiglu(&z(&[3, 0])).unwrap().size(), [3, 0]);
    let s = Tensor::from(-2.0f32).set_requires_grad(true);
    let h = sys::silu_mul(&s, &Tensor::from(3.0f32)).unwrap();
    assert!((h.double_value(&[]) - 3.0 * (-2.0f64) / (1.0 + 2.0f64.exp())).abs() < 1e-6);
    h.backward();
    assert!(s.grad().defined());
    let y = sys::rms_norm(
        &z(&[4, 0]),
        &Tensor::ones([0], (Kind::Float, Device::Cpu)),
        1e-6,
    );
    assert_eq!(y.unwrap().size(), [4, 0]);
    let y = sys::rms_norm(
        &z(&[0, 8]),
        &Tensor::ones([8], (Kind::Float, Device::Cpu)),
        1e-6,
    );
    assert_eq!(y.unwrap().size(), [0, 8]);
}
