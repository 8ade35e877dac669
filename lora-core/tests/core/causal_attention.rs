//! The CPU causal attention kernel (`lora_core::sys::causal_attention`, `shim/attention.cpp`):
//! output and the gradients of q, k and v against the textbook composite (scores, causal mask,
//! softmax, grouped keys/values repeated as HF's `repeat_kv` does) computed in f64 autograd,
//! over grouped and ungrouped heads, lengths that are no multiple of the kernel's 6 × 16 tiles,
//! strided inputs, and what it refuses.

use crate::common::{avx2_kernels_here, formula_values, leaf, rel_err};
use lora_core::sys;
use tch::{Device, Kind, Tensor};

/// `softmax(q·kᵀ/√d + causal)·v` in q's dtype, kv heads repeated to q's, `[b, s, h, d]`.
fn composite(q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
    let (b, h, s, d) = {
        let z = q.size();
        (z[0], z[1], z[2], z[3])
    };
    let rep = h / k.size()[1];
    let expand = |t: &Tensor| {
        let z = t.size();
        t.unsqueeze(2)
            .expand([z[0], z[1], rep, z[2], z[3]], false)
            .reshape([b, h, s, d])
    };
    let (k, v) = (expand(k), expand(v));
    let scores = q.matmul(&k.transpose(-1, -2)) / (d as f64).sqrt();
    let future = Tensor::ones([s, s], (Kind::Bool, Device::Cpu)).triu(1);
    let scores = scores.masked_fill(&future, f64::NEG_INFINITY);
    scores
        .softmax(-1, q.kind())
        .matmul(&v)
        .transpose(1, 2)
        .contiguous()
}

/// Runs the kernel and the f64 composite on the same values, backpropagates the same output
/// gradient through both, and returns the relative errors of (out, dq, dk, dv).
fn compare(q: &Tensor, k: &Tensor, v: &Tensor) -> [f64; 4] {
    let (q32, k32, v32) = (leaf(q), leaf(k), leaf(v));
    let out = sys::causal_attention(&q32, &k32, &v32).unwrap();
    let z = q.size();
    assert_eq!(out.size(), vec![z[0], z[2], z[1], z[3]]);
    assert_eq!(out.kind(), Kind::Float);
    assert!(out.is_contiguous());
    let dout = formula_values(&out.size(), 0.3, 1.0);
    (&out * &dout).sum(Kind::Float).backward();

    let (q64, k64, v64) = (
        leaf(&q.to_kind(Kind::Double)),
        leaf(&k.to_kind(Kind::Double)),
        leaf(&v.to_kind(Kind::Double)),
    );
    let reference = composite(&q64, &k64, &v64);
    (&reference * dout.to_kind(Kind::Double))
        .sum(Kind::Double)
        .backward();
    [
        rel_err(&out, &reference),
        rel_err(&q32.grad(), &q64.grad()),
        rel_err(&k32.grad(), &k64.grad()),
        rel_err(&v32.grad(), &v64.grad()),
    ]
}

#[test]
fn causal_attention_equals_the_composite_in_f64() {
    if !avx2_kernels_here() {
        let q = formula_values(&[1, 1, 4, 16], 0.0, 1.0);
        let err = sys::causal_attention(&q, &q, &q).unwrap_err().to_string();
        assert!(err.contains("AVX2"), "{err}");
        return;
    }
    // (batch, heads, kv heads, seq, head_dim): SmolLM2's shape at 128 tokens, no grouping,
    // lengths that end inside a 6-row block and a 16-key chunk, one position, the longest
    for (b, h, kv, s, d) in [
        (2, 9, 3, 128, 64),
        (1, 4, 4, 37, 32),
        (3, 6, 2, 5, 16),
        (1, 2, 1, 1, 16),
        (1, 2, 2, 100, 128),
        (1, 2, 1, sys::CAUSAL_ATTENTION_MAX_SEQ, 16),
    ] {
        let q = formula_values(&[b, h, s, d], 0.0, 1.5);
        let k = formula_values(&[b, kv, s, d], 1.0, 1.5);
        let v = formula_values(&[b, kv, s, d], 2.0, 1.0);
        let errs = compare(&q, &k, &v);
        for (name, e) in ["out", "dq", "dk", "dv"].iter().zip(errs) {
            assert!(
                e < 5e-6,
                "{name} of ({b}, {h}, {kv}, {s}, {d}): relative error {e:.2e}"
            );
        }
    }
}

#[test]
fn causal_attention_reads_strided_heads_and_large_scores() {
    if !avx2_kernels_here() {
        return;
    }
    // q, k, v as the model hands them: `[b, s, h, d]` storage seen as `[b, h, s, d]`; scores
    // up to ±200 (the softmax's shift by the row maximum keeps e^x finite)
    let (b, h, kv, s, d) = (2, 4, 2, 70, 32);
    let q = formula_values(&[b, s, h, d], 0.5, 6.0).transpose(1, 2);
    let k = formula_values(&[b, s, kv, d], 1.5, 6.0).transpose(1, 2);
    let v = formula_values(&[b, s, kv, d], 2.5, 1.0).transpose(1, 2);
    assert!(!q.is_contiguous());
    // scores of size |S| carry an f32 rounding of about |S|·6e-8 into e^S: ≈ 1.2e-5 at 200
    let errs = compare(&q, &k, &v);
    for (name, e) in ["out", "dq", "dk", "dv"].iter().zip(errs) {
        assert!(e < 5e-5, "{name}: relative error {e:.2e}");
    }
    // without a gradient: no graph, the same values
    let out = tch::no_grad(|| sys::causal_attention(&q, &k, &v).unwrap());
    assert!(!out.requires_grad());
    let again = sys::causal_attention(&q, &k, &v).unwrap();
    assert!(out.equal(&again), "two runs differ");
}

#[test]
fn causal_attention_refuses_what_it_does_not_take() {
    let f = |shape: &[i64], kind: Kind| Tensor::zeros(shape, (kind, Device::Cpu));
    let q = f(&[1, 4, 8, 16], Kind::Float);
    let kv = f(&[1, 2, 8, 16], Kind::Float);
    assert!(!sys::causal_attention_applies(
        &q,
        &f(&[1, 3, 8, 16], Kind::Float),
        &f(&[1, 3, 8, 16], Kind::Float)
    ));
    assert!(!sys::causal_attention_applies(
        &f(&[1, 4, 8, 16], Kind::Double),
        &kv,
        &kv
    ));
    assert!(!sys::causal_attention_applies(
        &f(&[1, 4, 8, 24], Kind::Float),
        &f(&[1, 2, 8, 24], Kind::Float),
        &f(&[1, 2, 8, 24], Kind::Float)
    ));
    let long = sys::CAUSAL_ATTENTION_MAX_SEQ + 1;
    assert!(!sys::causal_attention_applies(
        &f(&[1, 4, long, 16], Kind::Float),
        &f(&[1, 2, long, 16], Kind::Float),
        &f(&[1, 2, long, 16], Kind::Float)
    ));
    assert!(!sys::causal_attention_applies(
        &q,
        &f(&[1, 2, 9, 16], Kind::Float),
        &f(&[1, 2, 9, 16], Kind::Float)
    ));
    assert!(!sys::causal_attention_applies(
        &f(&[1, 1, 8, 16], Kind::Float),
        &kv,
        &kv
    ));
    if !avx2_kernels_here() {
        return;
    }
    // what it takes, with a (sequence, kv head) task per thread: used unless asked not to or
    // on a CPU with AVX-512
    let batch = i64::from(tch::get_num_threads());
    let (q, kv) = (
        f(&[batch, 4, 8, 16], Kind::Float),
        f(&[batch, 1, 8, 16], Kind::Float),
    );
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    let wanted = match sys::cpu_attention_request() {
        sys::CpuKernelRequest::Lsdk => true,
        sys::CpuKernelRequest::Libtorch => false,
        _ => !avx512 && sys::cpu_kernels_parallel(),
    };
    assert_eq!(sys::causal_attention_applies(&q, &kv, &kv), wanted);
    for (q, k, want) in [
        (
            f(&[1, 4, 8, 16], Kind::Float),
            f(&[1, 3, 8, 16], Kind::Float),
            "not a multiple of kv heads",
        ),
        (
            f(&[1, 4, 8, 16], Kind::Double),
            f(&[1, 2, 8, 16], Kind::Double),
            "f32 CPU tensors",
        ),
        (
            f(&[1, 4, 8, 24], Kind::Float),
            f(&[1, 2, 8, 24], Kind::Float),
            "multiple of 16",
        ),
        (
            f(&[1, 4, long, 16], Kind::Float),
            f(&[1, 2, long, 16], Kind::Float),
            "positions, got 513",
        ),
        (
            f(&[1, 4, 8, 16], Kind::Float),
            f(&[1, 2, 9, 16], Kind::Float),
            "matching q",
        ),
        (
            f(&[1, 1, 8, 16], Kind::Float),
            f(&[1, 2, 8, 16], Kind::Float),
            "not a multiple of kv heads",
        ),
    ] {
        let err = sys::causal_attention(&q, &k, &k).unwrap_err().to_string();
        assert!(err.contains(want), "expected {want:?} in {err}");
    }
}

#[test]
fn causal_attention_computes_the_gradients_asked_for_and_refuses_stale_ones() {
    if !avx2_kernels_here() {
        return;
    }
    let (q, k, v) = (
        formula_values(&[2, 4, 20, 32], 0.0, 1.0),
        formula_values(&[2, 2, 20, 32], 1.0, 1.0),
        formula_values(&[2, 2, 20, 32], 2.0, 1.0),
    );
    let dout = formula_values(&[2, 20, 4, 32], 0.3, 1.0);
    // every gradient, then each alone: the same values
    let (q1, k1, v1) = (leaf(&q), leaf(&k), leaf(&v));
    let out = sys::causal_attention(&q1, &k1, &v1).unwrap();
    (&out * &dout).sum(Kind::Float).backward();
    for which in 0..3 {
        let t = [&q, &k, &v].map(|t| {
            if std::ptr::eq(t, [&q, &k, &v][which]) {
                leaf(t)
            } else {
                t.shallow_clone()
            }
        });
        let out = sys::causal_attention(&t[0], &t[1], &t[2]).unwrap();
        (&out * &dout).sum(Kind::Float).backward();
        let full = [&q1, &k1, &v1][which].grad();
        assert!(
            t[which].grad().equal(&full),
            "gradient {which} alone differs"
        );
        for (i, other) in t.iter().enumerate() {
            if i != which {
                assert!(
                    !other.grad().defined(),
                    "gradient {i} computed without being asked for"
                );
            }
        }
    }
    // an input or the output changed in place before the backward pass: an error, not wrong
    // gradients
    let q2 = leaf(&q);
    let mut q3 = &q2 * 1.0;
    let out = sys::causal_attention(&q3, &k, &v).unwrap();
    let _ = q3.f_mul_(&Tensor::from(2.0f32)).unwrap();
    let err = (&out * &dout)
        .sum(Kind::Float)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("q was changed in place"), "{err}");
    let mut out = sys::causal_attention(&q2, &k, &v).unwrap();
    let _ = out.f_add_(&Tensor::from(1.0f32)).unwrap();
    let err = (&out * &dout)
        .sum(Kind::Float)
        .f_backward()
        .unwrap_err()
        .to_string();
    assert!(err.contains("the output was changed in place"), "{err}");
}
