//! Sibling linears that read one input (q/k/v, gate/up) computed together
//! (`LoraLinear::forward_siblings`): the outputs and every gradient equal each site's own forward,
//! with different ranks and scalings, a bias, and the cases that fall back to per-site branches.

use crate::common::{dense, max_abs_diff};
use lora_core::Error;
use lora_core::base::BaseWeight;
use lora_core::config::AdapterSpec;
use lora_core::layer::LoraLayer;
use lora_core::linear::{LoraLinear, SiblingOutputs};
use tch::{Kind, Tensor, nn};

const IN: i64 = 32;

/// Three sites `[8, 32]`, `[4, 32]`, `[4, 32]` (the last with a bias) carrying one adapter each
/// with the given specs in a store of their own, B filled with non-zero values so the branches
/// count.
fn sites(specs: [AdapterSpec; 3]) -> (nn::VarStore, Vec<LoraLinear>) {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let outs = [8i64, 4, 4];
    let sites = outs
        .iter()
        .zip(specs)
        .enumerate()
        .map(|(i, (&o, spec))| {
            let bias = (i == 2).then(|| dense(&[o], 40));
            let mut l =
                LoraLinear::new(BaseWeight::Dense(dense(&[o, IN], 10 + i as i64)), bias).unwrap();
            l.add_adapter(
                &format!("s{i}"),
                "default",
                &spec,
                &(vs.root() / format!("s{i}")),
            )
            .unwrap();
            let b = l.adapters()[0].lora_b();
            tch::no_grad(|| b.shallow_clone().copy_(&dense(&b.size(), 20 + i as i64)));
            l
        })
        .collect();
    (vs, sites)
}

/// True when the first two outputs are views of one `[..., Σ outᵢ]` tensor, side by side — the
/// fused path's result (each site's own branches give tensors of their own).
fn side_by_side(outs: &[Tensor]) -> bool {
    let width = outs[0].size().last().copied().unwrap_or(0) as usize;
    let elem = outs[0].kind().elt_size_in_bytes();
    outs[1].data_ptr() as usize == outs[0].data_ptr() as usize + width * elem
}

fn stacked_product(sites: &[LoraLinear], x: &Tensor) -> Tensor {
    let w: Vec<Tensor> = sites
        .iter()
        .map(|s| s.base().weight(Kind::Float).unwrap())
        .collect();
    x.linear::<Tensor>(&Tensor::cat(&w, 0), None)
}

/// Output values and the gradients of x and of every A and B under a fixed weighted sum.
fn run(sites: &[LoraLinear], vs: &nn::VarStore, fused: bool, train: bool) -> Vec<Tensor> {
    let x = dense(&[2, 5, IN], 7).set_requires_grad(true);
    let outs: Vec<Tensor> = if fused {
        let refs: Vec<&LoraLinear> = sites.iter().collect();
        LoraLinear::forward_siblings(&refs, &x, stacked_product(sites, &x), train).unwrap()
    } else {
        sites
            .iter()
            .map(|s| s.forward_t(&x, train).unwrap())
            .collect()
    };
    let loss = outs
        .iter()
        .enumerate()
        .map(|(i, o)| (o * dense(&o.size(), 30 + i as i64)).sum(Kind::Float))
        .fold(
            Tensor::zeros([], (Kind::Float, tch::Device::Cpu)),
            |a, b| a + b,
        );
    for mut v in vs.trainable_variables() {
        v.zero_grad();
    }
    loss.backward();
    let mut got: Vec<Tensor> = outs.iter().map(|o| o.detach().copy()).collect();
    got.push(x.grad().copy());
    for s in sites {
        got.push(s.adapters()[0].lora_a().grad().copy());
        got.push(s.adapters()[0].lora_b().grad().copy());
    }
    got
}

/// Different ranks and scalings (2, 1, 4), and the same scaling everywhere.
fn mixed_and_same_scalings() -> [[AdapterSpec; 3]; 2] {
    [
        [
            AdapterSpec::new(4, 8.0),
            AdapterSpec::new(3, 3.0),
            AdapterSpec::new(2, 8.0),
        ],
        [
            AdapterSpec::new(2, 4.0),
            AdapterSpec::new(2, 4.0),
            AdapterSpec::new(2, 4.0),
        ],
    ]
}

#[test]
fn siblings_together_equal_each_sites_own_forward_and_gradients() {
    for specs in mixed_and_same_scalings() {
        let (vs, s) = sites(specs);
        let x = dense(&[2, 5, IN], 7);
        let refs: Vec<&LoraLinear> = s.iter().collect();
        let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&s, &x), true).unwrap();
        assert!(side_by_side(&outs), "the group was not computed together");
        let fused = run(&s, &vs, true, true);
        let own = run(&s, &vs, false, true);
        assert_eq!(fused.len(), own.len());
        for (i, (f, o)) in fused.iter().zip(&own).enumerate() {
            assert_eq!(f.size(), o.size(), "tensor {i}");
            let d = max_abs_diff(f, o);
            assert!(d < 1e-5, "tensor {i} differs by {d}");
            assert!(f.abs().max().double_value(&[]) > 1e-3, "tensor {i} is zero");
        }
    }
}

#[test]
fn siblings_with_dropout_in_training_or_two_adapters_take_each_sites_branches() {
    let mut dropped = AdapterSpec::new(2, 4.0);
    dropped.dropout = 0.5;
    let (vs, s) = sites([AdapterSpec::new(2, 4.0), dropped, AdapterSpec::new(2, 4.0)]);
    // not training: dropout is off, so the group fuses and equals the per-site forward
    let f = run(&s, &vs, true, false);
    let o = run(&s, &vs, false, false);
    assert!(f.iter().zip(&o).all(|(a, b)| max_abs_diff(a, b) < 1e-5));
    // training: the dropped site draws its own mask (as PEFT's per-module dropout), the others
    // are unchanged from their own forward
    let x = dense(&[2, 5, IN], 7);
    let refs: Vec<&LoraLinear> = s.iter().collect();
    let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&s, &x), true).unwrap();
    assert!(!side_by_side(&outs));
    for i in [0usize, 2] {
        assert!(max_abs_diff(&outs[i], &s[i].forward_t(&x, true).unwrap()) < 1e-5);
    }
    // a second adapter on one site: per-site branches, the same function
    let (vs2, mut two) = sites([
        AdapterSpec::new(2, 4.0),
        AdapterSpec::new(3, 3.0),
        AdapterSpec::new(2, 8.0),
    ]);
    two[1]
        .add_adapter(
            "s1",
            "second",
            &AdapterSpec::new(2, 2.0),
            &(vs2.root() / "second"),
        )
        .unwrap();
    let b = two[1].adapters()[1].lora_b();
    tch::no_grad(|| b.shallow_clone().copy_(&dense(&b.size(), 50)));
    let refs: Vec<&LoraLinear> = two.iter().collect();
    let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&two, &x), false).unwrap();
    assert!(!side_by_side(&outs));
    for (o, site) in outs.iter().zip(&two) {
        assert!(max_abs_diff(o, &site.forward_t(&x, false).unwrap()) < 1e-5);
    }
}

#[test]
fn a_product_of_the_wrong_width_is_a_shape_error() {
    let (_vs, s) = sites([
        AdapterSpec::new(2, 4.0),
        AdapterSpec::new(2, 4.0),
        AdapterSpec::new(2, 4.0),
    ]);
    let refs: Vec<&LoraLinear> = s.iter().collect();
    let x = dense(&[2, 5, IN], 7);
    let err = LoraLinear::forward_siblings(
        &refs,
        &x,
        Tensor::zeros([2, 5, 15], (Kind::Float, tch::Device::Cpu)),
        false,
    )
    .unwrap_err();
    assert!(
        matches!(err, Error::Shape { ref expected, .. } if expected == &[-1, 16]),
        "{err}"
    );
}

#[test]
fn siblings_under_bf16_autocast_equal_each_sites_own_forward() {
    // The frozen product in bf16, x and the adapters in f32: the group takes the general path's
    // order of operations (B(A(x)) in bf16, scaled, added) for all sites at once.
    for specs in mixed_and_same_scalings() {
        let (vs, s) = sites(specs);
        let _ac = lora_core::sys::AutocastGuard::new(tch::Device::Cpu, Kind::BFloat16).unwrap();
        let x = dense(&[2, 5, IN], 7);
        let refs: Vec<&LoraLinear> = s.iter().collect();
        let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&s, &x), true).unwrap();
        assert_eq!(outs[0].kind(), Kind::BFloat16);
        assert!(side_by_side(&outs), "the group was not computed together");
        let fused = run(&s, &vs, true, true);
        let own = run(&s, &vs, false, true);
        for (i, (f, o)) in fused.iter().zip(&own).enumerate() {
            assert_eq!((f.size(), f.kind()), (o.size(), o.kind()), "tensor {i}");
            // the same ops on the same bf16 values, up to the GEMMs' summation order: within
            // a bf16 step of the largest value
            let top = o.abs().max().to_kind(Kind::Double).double_value(&[]);
            let d = max_abs_diff(f, o);
            assert!(
                d <= top * 2f64.powi(-7),
                "tensor {i} differs by {d} (max {top})"
            );
            assert!(top > 1e-3, "tensor {i} is zero");
        }
    }
}

#[test]
fn joined_siblings_are_the_outputs_side_by_side() {
    // with adapters (the last site has a bias): the sites' outputs concatenated
    let (_vs, s) = sites(mixed_and_same_scalings()[0].clone());
    let x = dense(&[2, 5, IN], 7);
    let refs: Vec<&LoraLinear> = s.iter().collect();
    let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&s, &x), false).unwrap();
    let SiblingOutputs::Split(parts) =
        LoraLinear::forward_siblings_grouped(&refs, &x, stacked_product(&s, &x), false).unwrap()
    else {
        panic!("a site with a bias: the outputs come apart");
    };
    assert_eq!(parts.len(), 3);
    for (p, o) in parts.iter().zip(&outs) {
        assert!(max_abs_diff(p, o) < 1e-6);
    }
    // without the biased site: one tensor, the sites' outputs side by side
    let refs2: Vec<&LoraLinear> = s.iter().take(2).collect();
    let base2 = stacked_product(&s[..2], &x);
    let SiblingOutputs::Joined(joined) =
        LoraLinear::forward_siblings_grouped(&refs2, &x, base2, false).unwrap()
    else {
        panic!("the branches were computed together");
    };
    assert_eq!(joined.size(), [2, 5, 12]);
    assert!(max_abs_diff(&joined, &Tensor::cat(&outs[..2], -1)) < 1e-6);

    // no adapter and no bias: the frozen products themselves, not a copy
    let bare: Vec<LoraLinear> = [8i64, 4]
        .iter()
        .enumerate()
        .map(|(i, &o)| {
            LoraLinear::new(BaseWeight::Dense(dense(&[o, IN], 50 + i as i64)), None).unwrap()
        })
        .collect();
    let refs: Vec<&LoraLinear> = bare.iter().collect();
    let base = stacked_product(&bare, &x);
    let ptr = base.data_ptr();
    let SiblingOutputs::Joined(joined) =
        LoraLinear::forward_siblings_grouped(&refs, &x, base, true).unwrap()
    else {
        panic!("no branch to add: the frozen products as they are");
    };
    assert_eq!(joined.data_ptr(), ptr);
    let outs = LoraLinear::forward_siblings(&refs, &x, stacked_product(&bare, &x), true).unwrap();
    assert!(side_by_side(&outs));
    assert!(max_abs_diff(&joined, &Tensor::cat(&outs, -1)) < 1e-6);
}
