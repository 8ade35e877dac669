//! Optimizers against the reference implementations (torch.optim.AdamW / SGD and transformers'
//! Adafactor), with fixtures from `tests/fixtures/gen_optim_ref.py`; state save/load; AdamW8bit
//! against fp32 AdamW.

use lora_train::engine::optim::{
    AdamW, AdamW8bit, AdamWConfig, DynamicMap, Optimizer, OptimizerKind, OptimizerState,
    ParamGroup, QuantizedState,
};
use serde_json::Value;
use tch::{Device, Kind, Tensor};

fn fixture() -> Value {
    let text = include_str!("../fixtures/optim_ref.json");
    serde_json::from_str(text).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

fn shape(v: &Value) -> Vec<i64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

struct Case {
    params: Vec<Tensor>,
    opt: Box<dyn Optimizer>,
}

fn build(case: &Value) -> Case {
    let shapes: Vec<Vec<i64>> = case["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(shape)
        .collect();
    let group_of: Vec<usize> = case["group_of"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let lr_scale: Vec<f64> = case["lr_scale"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let params: Vec<Tensor> = case["init"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&shapes)
        .map(|(v, s)| {
            Tensor::from_slice(&floats(v))
                .reshape(s.as_slice())
                .set_requires_grad(true)
        })
        .collect();
    let mut groups = Vec::new();
    for g in 0..lr_scale.len() {
        let ps: Vec<Tensor> = params
            .iter()
            .zip(&group_of)
            .filter(|(_, gi)| **gi == g)
            .map(|(p, _)| p.shallow_clone())
            .collect();
        let mut group = ParamGroup::new(format!("g{g}"), ps).with_lr_scale(lr_scale[g]);
        if let Some(wd) = case["group_weight_decay"][g].as_f64() {
            group = group.with_weight_decay(wd);
        }
        groups.push(group);
    }
    let kind: OptimizerKind = serde_json::from_value(case["optimizer"].clone()).unwrap();
    let lr0 = case["lrs"][0].as_f64().unwrap();
    let opt = kind.build(groups, lr0).unwrap();
    Case { params, opt }
}

fn set_grads(params: &[Tensor], grads: &Value, shapes: &[Vec<i64>]) {
    for ((p, g), s) in params.iter().zip(grads.as_array().unwrap()).zip(shapes) {
        let g = Tensor::from_slice(&floats(g)).reshape(s.as_slice());
        let mut grad = p.grad();
        if grad.defined() {
            grad.copy_(&g);
        } else {
            // Populate .grad through autograd: d(sum(p * g))/dp = g.
            (p * &g).sum(Kind::Float).backward();
        }
    }
}

/// Max |ours − reference| / (1 + |reference|) over all elements after all steps.
fn run_case(case: &Value, steps: Option<(usize, bool)>) -> (f64, Vec<Tensor>) {
    let shapes: Vec<Vec<i64>> = case["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(shape)
        .collect();
    let lrs: Vec<f64> = case["lrs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    let grads = case["grads"].as_array().unwrap();
    let mut c = build(case);
    let n = lrs.len();
    // Optional: save after `k` steps, rebuild, load, continue (resume check).
    let (stop, reload) = steps.unwrap_or((n, false));
    for t in 0..n {
        if t == stop && reload {
            let st = c.opt.state_dict().unwrap();
            let saved_params: Vec<Tensor> = c.params.iter().map(|p| p.detach().copy()).collect();
            let mut c2 = build(case);
            tch::no_grad(|| {
                for (p, s) in c2.params.iter_mut().zip(&saved_params) {
                    p.copy_(s);
                }
            });
            c2.opt.load_state_dict(&roundtrip(&st)).unwrap();
            c = c2;
        }
        c.opt.set_lr(lrs[t]);
        set_grads(&c.params, &grads[t], &shapes);
        c.opt.step().unwrap();
        c.opt.zero_grad().unwrap();
    }
    assert_eq!(c.opt.steps(), n as u64);
    let mut worst = 0f64;
    for (p, want) in c.params.iter().zip(case["final"].as_array().unwrap()) {
        let got = Vec::<f32>::try_from(p.detach().flatten(0, -1)).unwrap();
        for (a, b) in got.iter().zip(floats(want)) {
            worst = worst.max(((a - b).abs() / (1.0 + b.abs())) as f64);
        }
    }
    (worst, c.params)
}

/// Serializes state through JSON + raw bytes the way checkpoints do, to catch lossy paths.
fn roundtrip(st: &OptimizerState) -> OptimizerState {
    let meta: Value = serde_json::from_str(&serde_json::to_string(&st.meta).unwrap()).unwrap();
    let tensors = st
        .tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.copy()))
        .collect();
    OptimizerState { tensors, meta }
}

#[test]
fn optimizers_match_reference_implementations() {
    let _serial = crate::serial();
    let f = fixture();
    let mut report = Vec::new();
    for case in f["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (err, _) = run_case(case, None);
        report.push(format!("{name}: max rel err {err:.2e}"));
        assert!(
            err < 2e-6,
            "{name}: max relative error {err:e} vs reference"
        );
    }
    println!("{}", report.join("\n"));
}

#[test]
fn optimizer_state_roundtrip_resumes_bit_identically() {
    let _serial = crate::serial();
    let f = fixture();
    for case in f["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (_, straight) = run_case(case, None);
        let (_, resumed) = run_case(case, Some((5, true)));
        for (a, b) in straight.iter().zip(&resumed) {
            assert!(
                a.equal(b),
                "{name}: resumed optimizer diverged from the uninterrupted run"
            );
        }
    }
}

#[test]
fn state_from_another_optimizer_is_rejected() {
    let _serial = crate::serial();
    let p = Tensor::zeros([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let adam = AdamW::new(
        vec![ParamGroup::new("a", vec![p.shallow_clone()])],
        1e-3,
        AdamWConfig::default(),
    )
    .unwrap();
    let st = adam.state_dict().unwrap();
    let mut sgd = OptimizerKind::from_name("sgd")
        .unwrap()
        .build(vec![ParamGroup::new("a", vec![p])], 1e-3)
        .unwrap();
    let err = sgd.load_state_dict(&st).unwrap_err().to_string();
    assert!(err.contains("AdamW"), "{err}");
}

#[test]
fn a_step_is_an_in_place_change_autograd_sees() {
    // A graph that saved a parameter refuses to backpropagate once a step changed it (libtorch's
    // version counter), whichever path the update takes (the fused CPU pass writes through the
    // data and bumps the counters itself), for AdamW and AdamW8bit alike.
    let _serial = crate::serial();
    for eight_bit in [false, true] {
        let p = Tensor::ones([64, 80], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let groups = vec![ParamGroup::new("a", vec![p.shallow_clone()])];
        let mut opt: Box<dyn Optimizer> = if eight_bit {
            Box::new(AdamW8bit::new(groups, 1e-3, AdamWConfig::default()).unwrap())
        } else {
            Box::new(AdamW::new(groups, 1e-3, AdamWConfig::default()).unwrap())
        };
        (&p * &p).sum(Kind::Float).backward();
        let saved = (&p * &p).sum(Kind::Float);
        opt.step().unwrap();
        assert!(
            (p.double_value(&[0, 0]) - 1.0).abs() > 1e-4,
            "the step moved nothing"
        );
        let err = saved.f_backward().map(|_| ()).unwrap_err().to_string();
        assert!(
            err.contains("modified by an inplace operation"),
            "8-bit {eight_bit}: {err}"
        );
    }
}

#[test]
fn dynamic_maps_have_256_sorted_codes() {
    let _serial = crate::serial();
    for signed in [true, false] {
        let v = DynamicMap::values(signed);
        assert_eq!(v.len(), 256);
        assert!(v.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*v.last().unwrap(), 1.0);
        assert!(v.contains(&0.0));
        if signed {
            assert!(v[0] < -0.9);
        } else {
            assert!(v[0] >= 0.0);
        }
        // The smallest non-zero magnitude lies in the lowest decade, 10^-6 · (0.1, 1).
        let min_pos = v
            .iter()
            .copied()
            .filter(|x| *x > 0.0)
            .fold(f32::MAX, f32::min);
        assert!(min_pos > 1e-7 && min_pos < 1e-6, "{min_pos}");
    }
}

#[test]
fn blockwise_quantization_error_is_small_relative_to_block_absmax() {
    let _serial = crate::serial();
    tch::manual_seed(3);
    let x = Tensor::randn([5000], (Kind::Float, Device::Cpu));
    let map = DynamicMap::new(true, Device::Cpu).unwrap();
    let q = QuantizedState::quantize(&x, &map).unwrap();
    assert_eq!(q.codes.size(), [3 * 2048]);
    assert_eq!(q.absmax.size(), [3]);
    let y = q.dequantize(&map).unwrap();
    assert_eq!(y.size(), [5000]);
    let err = (&y - &x).abs().max().double_value(&[]);
    let absmax = x.abs().max().double_value(&[]);
    // Largest gap of the dynamic code near 1 is 0.9/64 / 2 ≈ 0.007 of the block absmax.
    assert!(err <= 0.0075 * absmax, "err {err} absmax {absmax}");
    // The block absmax maps to code ±1 (or the most negative code, −0.993): within 1%.
    assert!((y.abs().max().double_value(&[]) - absmax).abs() <= 0.01 * absmax);
}

#[test]
fn adamw8bit_tracks_fp32_adamw_and_uses_quarter_memory() {
    let _serial = crate::serial();
    tch::manual_seed(11);
    let w0 = Tensor::randn([64, 128], (Kind::Float, Device::Cpu)) * 0.1;
    let small0 = Tensor::randn([100], (Kind::Float, Device::Cpu)) * 0.1;
    let mk = || {
        (
            w0.copy().set_requires_grad(true),
            small0.copy().set_requires_grad(true),
        )
    };
    let (wa, sa) = mk();
    let (wb, sb) = mk();
    let cfg = AdamWConfig::default();
    let mut fp32 = AdamW::new(
        vec![ParamGroup::new(
            "a",
            vec![wa.shallow_clone(), sa.shallow_clone()],
        )],
        1e-3,
        cfg.clone(),
    )
    .unwrap();
    let mut q8 = AdamW8bit::new(
        vec![ParamGroup::new(
            "a",
            vec![wb.shallow_clone(), sb.shallow_clone()],
        )],
        1e-3,
        cfg,
    )
    .unwrap();
    let target = Tensor::randn([64, 128], (Kind::Float, Device::Cpu));
    for _ in 0..20 {
        for (w, s, opt) in [
            (&wa, &sa, &mut fp32 as &mut dyn Optimizer),
            (&wb, &sb, &mut q8 as &mut dyn Optimizer),
        ] {
            opt.zero_grad().unwrap();
            let loss = (w - &target).square().mean(Kind::Float) + s.square().sum(Kind::Float);
            loss.backward();
            opt.step().unwrap();
        }
    }
    let moved = (&wa - &w0).abs().mean(Kind::Float).double_value(&[]);
    let diff = (&wa - &wb).abs().mean(Kind::Float).double_value(&[]);
    println!(
        "AdamW8bit vs AdamW after 20 steps: mean |Δθ| {moved:.3e}, mean |θ8 − θ32| {diff:.3e}"
    );
    assert!(moved > 1e-2, "the weights moved {moved}");
    assert!(
        diff < 0.05 * moved,
        "8-bit diverges: {diff} vs movement {moved}"
    );
    // The small tensor keeps fp32 state, so it matches exactly.
    assert!(sa.equal(&sb));
    // State: fp32 = 8 B/param; 8-bit = 2 B/param + 4 B per 2048-block for the big tensor.
    let big = 64 * 128u64;
    assert_eq!(fp32.state_bytes(), 8 * (big + 100));
    assert_eq!(q8.state_bytes(), 2 * big + 2 * 4 * 4 + 8 * 100);
    // Save/load round trip continues identically.
    let st = q8.state_dict().unwrap();
    let mut q8b = AdamW8bit::new(
        vec![ParamGroup::new(
            "a",
            vec![
                wb.copy().set_requires_grad(true),
                sb.copy().set_requires_grad(true),
            ],
        )],
        1e-3,
        AdamWConfig::default(),
    )
    .unwrap();
    q8b.load_state_dict(&st).unwrap();
    assert_eq!(q8b.steps(), 20);
    assert_eq!(q8b.state_bytes(), q8.state_bytes());
}

#[test]
fn invalid_hyper_parameters_are_errors() {
    let _serial = crate::serial();
    let p = || {
        vec![ParamGroup::new(
            "a",
            vec![Tensor::zeros([2], (Kind::Float, Device::Cpu))],
        )]
    };
    assert!(AdamW::new(p(), -1.0, AdamWConfig::default()).is_err());
    assert!(
        AdamW::new(
            p(),
            1e-3,
            AdamWConfig {
                betas: (1.0, 0.9),
                ..Default::default()
            }
        )
        .is_err()
    );
    let e = OptimizerKind::from_name("lion").unwrap_err().to_string();
    assert!(e.contains("AdamW8bit"), "{e}");
    let sgd: OptimizerKind = serde_json::from_str(r#"{"type":"SGD","nesterov":true}"#).unwrap();
    assert!(sgd.build(p(), 0.1).is_err());
}
