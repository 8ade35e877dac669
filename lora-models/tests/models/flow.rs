//! Flow matching for FLUX.1: the Euler sampler's schedules and steps against diffusers 0.42.1's
//! `FlowMatchEulerDiscreteScheduler` (values written by `tests/interop/flux_flow.py`), the
//! timestep samplings' quantiles against their closed forms, and the objective on fixed
//! tensors.

use std::path::Path;
use std::sync::OnceLock;

use lora_models::diffusion::{
    FlowMatchConfig, FlowMatchEulerSampler, FlowMatchingLoss, LossWeighting, TimestepSampling,
    calculate_shift, sample_flow, shift_sigma, time_shift,
};
use tch::{Device, Kind, Tensor};

fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("flux_flow.py"))
        .path()
}

fn reference() -> &'static serde_json::Value {
    static V: OnceLock<serde_json::Value> = OnceLock::new();
    V.get_or_init(|| {
        serde_json::from_slice(&std::fs::read(fixtures().join("flow.json")).unwrap()).unwrap()
    })
}

fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

fn close(label: &str, ours: &[f64], theirs: &[f64], tol: f64) {
    assert_eq!(ours.len(), theirs.len(), "{label}: lengths");
    let worst = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!(
        "{label}: max abs diff {worst:.2e} over {} values",
        ours.len()
    );
    assert!(
        worst < tol,
        "{label}: {worst:.3e} ≥ {tol:.0e}\n{ours:?}\n{theirs:?}"
    );
}

#[test]
fn flow_schedules_match_diffusers() {
    let cases = &reference()["cases"];
    let static3 = FlowMatchConfig {
        shift: 3.0,
        ..FlowMatchConfig::flux_schnell()
    };
    let samplers = [
        (
            "flux_dev_28_4096",
            FlowMatchEulerSampler::flux(FlowMatchConfig::flux_dev(), 28, 4096).unwrap(),
        ),
        (
            "flux_dev_4_1024",
            FlowMatchEulerSampler::flux(FlowMatchConfig::flux_dev(), 4, 1024).unwrap(),
        ),
        (
            "flux_schnell_4",
            FlowMatchEulerSampler::flux(FlowMatchConfig::flux_schnell(), 4, 4096).unwrap(),
        ),
        (
            "static_shift3_10",
            FlowMatchEulerSampler::new(static3, 10, None).unwrap(),
        ),
        (
            "dynamic_10_mu08",
            FlowMatchEulerSampler::new(FlowMatchConfig::flux_dev(), 10, Some(0.8)).unwrap(),
        ),
    ];
    for (name, s) in &samplers {
        let c = &cases[*name];
        // diffusers computes in f32: equal up to f32 rounding
        close(
            &format!("{name} sigmas"),
            s.sigmas(),
            &floats(&c["sigmas"]),
            1e-6,
        );
        close(
            &format!("{name} timesteps"),
            s.timesteps(),
            &floats(&c["timesteps"]),
            1e-3,
        );
    }
    // dynamic shifting without μ is refused
    let e = FlowMatchEulerSampler::new(FlowMatchConfig::flux_dev(), 4, None).unwrap_err();
    assert!(e.to_string().contains("mu"), "{e}");
    assert!(FlowMatchEulerSampler::flux(FlowMatchConfig::flux_dev(), 0, 4096).is_err());
}

#[test]
fn flow_euler_sampling_matches_diffusers_and_passes_guidance() {
    let e = &reference()["euler"];
    let rows = |v: &serde_json::Value| -> Vec<f32> {
        v.as_array()
            .unwrap()
            .iter()
            .flat_map(|r| floats(r).into_iter().map(|x| x as f32))
            .collect()
    };
    let x0 = Tensor::from_slice(&rows(&e["x0"])).view([2, 3]);
    let want = Tensor::from_slice(&rows(&e["final"])).view([2, 3]);
    let s = FlowMatchEulerSampler::flux(FlowMatchConfig::flux_dev(), 4, 1024).unwrap();
    let mut calls = 0;
    let out = sample_flow(&s, &x0, Some(3.5), |x, t, g| {
        calls += 1;
        assert_eq!(t.size(), [2]);
        let g = g.expect("guidance is passed through");
        assert_eq!(Vec::<f32>::try_from(g).unwrap(), vec![3.5, 3.5]);
        Ok(x * 0.3 + t.view([2, 1]))
    })
    .unwrap();
    assert_eq!(calls, 4);
    let d = f64::try_from((&out - &want).abs().max()).unwrap();
    println!("Euler flow sampling, 4 steps: max abs diff {d:.2e} against diffusers");
    assert!(d < 1e-5, "{d}");
    // schnell: no guidance tensor
    let s = FlowMatchEulerSampler::flux(FlowMatchConfig::flux_schnell(), 2, 4096).unwrap();
    let _ = sample_flow(&s, &x0, None, |x, _t, g| {
        assert!(g.is_none());
        Ok(x.zeros_like())
    })
    .unwrap();
}

/// Standard normal quantiles Φ⁻¹(q) for q = 0.1, 0.25, 0.5, 0.75, 0.9.
const QS: [f64; 5] = [0.1, 0.25, 0.5, 0.75, 0.9];
const PROBIT: [f64; 5] = [
    -1.281_551_565_544_600_5,
    -0.674_489_750_196_081_7,
    0.0,
    0.674_489_750_196_081_7,
    1.281_551_565_544_600_5,
];

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn quantiles(s: &TimestepSampling, hw: (i64, i64)) -> (Vec<f64>, f64) {
    let n = 40_000;
    let t = s.sample_sigmas(n, hw, Device::Cpu).unwrap();
    assert_eq!((t.size(), t.kind()), (vec![n], Kind::Float));
    let mut v = Vec::<f32>::try_from(&t).unwrap();
    assert!(
        v.iter().all(|x| (0.0..=1.0).contains(x)),
        "σ outside [0, 1]"
    );
    v.sort_by(f32::total_cmp);
    let q = QS
        .iter()
        .map(|q| f64::from(v[(q * (n - 1) as f64).round() as usize]))
        .collect();
    let mean = v.iter().map(|x| f64::from(*x)).sum::<f64>() / n as f64;
    (q, mean)
}

#[test]
fn timestep_samplings_follow_their_distributions() {
    let _lock = crate::rng_lock();
    tch::manual_seed(11);
    // quantile standard errors at n = 40000 are ≤ 0.003 here
    let tol = 0.012;
    let mode =
        |v: f64, s: f64| 1.0 - v - s * ((std::f64::consts::PI * v / 2.0).cos().powi(2) - 1.0 + v);
    let mu_64 = calculate_shift(32.0 * 32.0, 256.0, 4096.0, 0.5, 1.15);
    type Expect = Box<dyn Fn(usize) -> f64>;
    let cases: Vec<(&str, TimestepSampling, Expect, Option<f64>)> = vec![
        (
            "uniform",
            TimestepSampling::Uniform,
            Box::new(|i| QS[i]),
            Some(0.5),
        ),
        (
            "sigmoid 1.5",
            TimestepSampling::Sigmoid { sigmoid_scale: 1.5 },
            Box::new(|i| sigmoid(1.5 * PROBIT[i])),
            Some(0.5),
        ),
        (
            "shift 3",
            TimestepSampling::Shift {
                sigmoid_scale: 1.0,
                discrete_flow_shift: 3.0,
            },
            Box::new(|i| shift_sigma(3.0, sigmoid(PROBIT[i]))),
            None,
        ),
        (
            "flux_shift 64x64",
            TimestepSampling::FluxShift { sigmoid_scale: 1.0 },
            Box::new(move |i| time_shift(mu_64, 1.0, sigmoid(PROBIT[i]))),
            None,
        ),
        (
            "sigma, shift 3",
            TimestepSampling::Sigma {
                discrete_flow_shift: 3.0,
            },
            // σ = shift(1 − ⌊1000u⌋/1000) decreases in u: its q-quantile is shift(q) (± 0.001)
            Box::new(|i| shift_sigma(3.0, QS[i])),
            None,
        ),
        (
            "logit_normal (0.5, 0.8), shift 2",
            TimestepSampling::LogitNormal {
                logit_mean: 0.5,
                logit_std: 0.8,
                discrete_flow_shift: 2.0,
            },
            // σ decreases in u: σ's q-quantile is at u's (1 − q)-quantile
            Box::new(|i| shift_sigma(2.0, 1.0 - sigmoid(0.5 - 0.8 * PROBIT[i]))),
            None,
        ),
        (
            "mode 1.29",
            TimestepSampling::Mode {
                mode_scale: 1.29,
                discrete_flow_shift: 1.0,
            },
            Box::new(move |i| 1.0 - mode(QS[i], 1.29)),
            None,
        ),
    ];
    for (label, s, expect, mean) in cases {
        let (q, m) = quantiles(&s, (64, 64));
        for i in 0..QS.len() {
            let e = expect(i);
            println!("{label}: q{} = {:.4}, formula {e:.4}", QS[i], q[i]);
            assert!(
                (q[i] - e).abs() < tol,
                "{label} q{}: {} vs {e}",
                QS[i],
                q[i]
            );
        }
        if let Some(em) = mean {
            assert!((m - em).abs() < 0.005, "{label} mean {m}");
        }
    }
    // flux_shift depends on the resolution: larger latents, larger σ
    let (small, _) = quantiles(
        &TimestepSampling::FluxShift { sigmoid_scale: 1.0 },
        (32, 32),
    );
    let (large, _) = quantiles(
        &TimestepSampling::FluxShift { sigmoid_scale: 1.0 },
        (128, 128),
    );
    assert!(large[2] > small[2] + 0.1, "{small:?} {large:?}");
    assert!((small[2] - time_shift(0.5, 1.0, 0.5)).abs() < tol);
    // invalid parameters are refused
    let bad = TimestepSampling::Sigmoid { sigmoid_scale: 0.0 };
    assert!(FlowMatchingLoss::new(bad, LossWeighting::None).is_err());
}

#[test]
fn flow_objective_on_fixed_tensors() {
    // x0, ε, σ and a prediction chosen by hand; expectations computed element by element here
    let x0: Vec<f32> = vec![0.5, -1.0, 2.0, 0.0, 1.0, 1.5, -0.5, 0.25];
    let eps: Vec<f32> = vec![1.0, 0.5, -1.0, 2.0, -0.5, 0.0, 1.5, -2.0];
    let pred: Vec<f32> = vec![0.0, 1.0, -3.0, 2.0, -1.0, -1.0, 2.5, -2.0];
    let sig = [0.25f64, 0.8];
    let t = |v: &[f32]| Tensor::from_slice(v).view([2, 1, 2, 2]);
    let sigmas = Tensor::from_slice(&[0.25f32, 0.8]);
    for (weighting, w) in [
        (LossWeighting::None, [1.0, 1.0]),
        (
            LossWeighting::SigmaSqrt,
            [1.0 / (0.25f64 * 0.25), 1.0 / (0.8f64 * 0.8)],
        ),
        (
            LossWeighting::CosMap,
            sig.map(|s| 2.0 / (std::f64::consts::PI * (1.0 - 2.0 * s + 2.0 * s * s))),
        ),
    ] {
        let obj = FlowMatchingLoss::new(TimestepSampling::Uniform, weighting).unwrap();
        let b = obj.noised_with(&t(&x0), &t(&eps), &sigmas).unwrap();
        let noisy = Vec::<f32>::try_from(b.noisy_latents.view([-1])).unwrap();
        let target = Vec::<f32>::try_from(b.target.view([-1])).unwrap();
        let mut loss = 0.0;
        for (i, (n, tg)) in noisy.iter().zip(&target).enumerate() {
            let s = sig[i / 4];
            let want = (1.0 - s) * f64::from(x0[i]) + s * f64::from(eps[i]);
            assert!((f64::from(*n) - want).abs() < 1e-6, "noisy[{i}]");
            assert_eq!(*tg, eps[i] - x0[i], "target[{i}]");
            loss += w[i / 4] * f64::from(pred[i] - tg).powi(2) / 4.0 / 2.0;
        }
        let ours = f64::try_from(obj.loss_from_prediction(&t(&pred), &b).unwrap()).unwrap();
        println!("{weighting:?}: loss {ours:.6}, by hand {loss:.6}");
        assert!(
            (ours - loss).abs() < 1e-5 * loss.max(1.0),
            "{weighting:?}: {ours} vs {loss}"
        );
    }
    // at σ = 0 the input is the data, at σ = 1 the noise
    let obj = FlowMatchingLoss::new(TimestepSampling::Uniform, LossWeighting::None).unwrap();
    let b = obj
        .noised_with(&t(&x0), &t(&eps), &Tensor::from_slice(&[0.0f32, 1.0]))
        .unwrap();
    let n = Vec::<f32>::try_from(b.noisy_latents.view([-1])).unwrap();
    assert_eq!(&n[..4], &x0[..4]);
    assert_eq!(&n[4..], &eps[4..]);
    // a mis-shaped prediction is refused
    assert!(
        obj.loss_from_prediction(&t(&pred).view([2, 4]), &b)
            .is_err()
    );
    // the full step: sampled σ in (0, 1), a finite loss with gradient to the model's output
    let _lock = crate::rng_lock();
    tch::manual_seed(3);
    let w = Tensor::ones([1], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let loss = obj
        .loss(&t(&x0), |x, s| {
            assert_eq!(s.size(), [2]);
            Ok(x * &w)
        })
        .unwrap();
    loss.backward();
    assert!(f64::try_from(&loss).unwrap().is_finite());
    assert!(f64::try_from(w.grad().abs().sum(Kind::Float)).unwrap() > 0.0);
}
