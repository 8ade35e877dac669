//! Exact tensor bytes of the quantized linears' tiled path (`QuantWeight::linear` off the CPU
//! kernel, `QuantWeight::linear_tiled`), counted by the shim's CPU allocator
//! (`lora_core::sys::cpu_mem_stats`): what a graph of several layers holds after the forward
//! pass, the transient of one forward, and the bytes a tensor-op decode holds per weight (the
//! planner's `lora_memory::estimate::OURS_DEQUANT_BYTES_PER_WEIGHT`). One test in this file: the
//! counter is process-wide, so no other test may allocate meanwhile.

use lora_core::quant::{QuantKind, QuantWeight};
use lora_core::sys;
use lora_memory::estimate::ours_dequant_bytes_per_weight;
use lora_memory::settings::BaseDtype;
use tch::{Device, Kind, Tensor};

fn live() -> i64 {
    sys::cpu_mem_stats().unwrap().current_bytes as i64
}

fn peak() -> i64 {
    sys::cpu_mem_stats().unwrap().peak_bytes as i64
}

/// Every kind, with the planner's name for it.
const KINDS: [(QuantKind, BaseDtype); 11] = [
    (QuantKind::Q8_0, BaseDtype::Q8_0),
    (QuantKind::Q4_0, BaseDtype::Q4_0),
    (QuantKind::Q4_1, BaseDtype::Q4_1),
    (QuantKind::Q5_0, BaseDtype::Q5_0),
    (QuantKind::Q5_1, BaseDtype::Q5_1),
    (QuantKind::Q4_K, BaseDtype::Q4K),
    (QuantKind::Q5_K, BaseDtype::Q5K),
    (QuantKind::Q6_K, BaseDtype::Q6K),
    (
        QuantKind::Nf4 {
            double_quant: false,
        },
        BaseDtype::Nf4 {
            double_quant: false,
        },
    ),
    (
        QuantKind::Nf4 { double_quant: true },
        BaseDtype::Nf4 { double_quant: true },
    ),
    (QuantKind::Fp8E4m3, BaseDtype::Fp8),
];

#[test]
fn tiled_linears_keep_no_dense_weight_and_bound_the_decode() {
    sys::install_counting_cpu_allocator().unwrap();
    tch::set_num_threads(1);
    tch::manual_seed(0);
    // SmolLM2's gate/up_proj (576 → 1536), 512 tokens, float64 (not a CPU-kernel dtype)
    let (out, inn, n, layers) = (1536i64, 576i64, 512i64, 4i64);
    let qs: Vec<QuantWeight> = (0..layers)
        .map(|_| {
            let w = Tensor::randn([out, inn], (Kind::Float, Device::Cpu)) * 0.02;
            QuantWeight::quantize(&w, QuantKind::Nf4 { double_quant: true }).unwrap()
        })
        .collect();
    let x = Tensor::randn([n, inn], (Kind::Double, Device::Cpu)).set_requires_grad(true);
    let y_bytes = n * out * 8;
    let dense = out * inn * 8;

    // 1. The bytes a tensor-op decode (`QuantWeight::dequantize`) holds at its peak, per weight,
    // result included, for every kind and output dtype: within the planner's factor, which some
    // kind reaches (within 2 %) for each dtype.
    let big = Tensor::randn([out, 1024], (Kind::Float, Device::Cpu)) * 0.02;
    let numel = (out * 1024) as f64;
    let mut failures = Vec::new();
    for dtype in [Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double] {
        let e = dtype.elt_size_in_bytes() as f64;
        let mut tightest = 0.0f64;
        for (kind, base) in KINDS {
            let q = QuantWeight::quantize(&big, kind).unwrap();
            sys::cpu_reset_peak().unwrap();
            let before = live();
            let w = q.dequantize(dtype).unwrap();
            let per_weight = (peak() - before) as f64 / numel;
            drop(w);
            let planned = ours_dequant_bytes_per_weight(base, e);
            println!(
                "decode {kind:?} → {dtype:?}: {per_weight:.3} B per weight at the peak (planned {planned})"
            );
            if per_weight > planned {
                failures.push(format!("{kind:?} → {dtype:?}: {per_weight} > {planned}"));
            }
            tightest = tightest.max(per_weight / planned);
        }
        if tightest < 0.98 {
            failures.push(format!(
                "{dtype:?}: no kind reaches the planned factor ({tightest})"
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
    drop(big);

    // 2. After the forward pass of 4 layers with grad: dequantize-then-matmul keeps every dense
    // weight for the backward pass; the tiled path keeps the outputs only.
    let before = live();
    let ys: Vec<Tensor> = qs
        .iter()
        .map(|q| x.linear::<Tensor>(&q.dequantize(Kind::Double).unwrap(), None))
        .collect();
    let held_dense = live() - before;
    drop(ys);
    let before = live();
    let ys: Vec<Tensor> = qs.iter().map(|q| q.linear(&x).unwrap()).collect();
    let held_tiled = live() - before;
    println!(
        "held after the forward of {layers} layers: {held_dense} B dequantize-then-matmul, {held_tiled} B tiled ({} B of outputs, {dense} B per dense weight)",
        layers * y_bytes
    );
    assert!(held_dense >= layers * (y_bytes + dense), "{held_dense}");
    assert_eq!(
        held_tiled,
        layers * y_bytes,
        "the tiled graphs hold their outputs only"
    );
    // the backward pass runs, and leaves only x's gradient
    let loss = ys
        .iter()
        .map(|y| y.sum(Kind::Double))
        .reduce(|a, b| a + b)
        .unwrap();
    drop(ys);
    loss.backward();
    drop(loss);
    assert_eq!(live() - before, n * inn * 8, "x's gradient only");

    // 3. The transient of one forward in tiles of 64 Ki weights (113 rows of 576): the output,
    // one tile's decode and one tile's product, never the dense weight.
    let tile = 1u64 << 16;
    let rows = (tile as i64 / inn).min(out);
    let nf4 = BaseDtype::Nf4 { double_quant: true };
    let decode = ours_dequant_bytes_per_weight(nf4, 8.0) * (rows * inn) as f64;
    let bound = y_bytes + decode as i64 + n * rows * 8;
    let xd = x.detach();
    sys::cpu_reset_peak().unwrap();
    let before = live();
    let y = qs[0].linear_tiled(&xd, tile).unwrap();
    let transient = peak() - before;
    println!(
        "forward transient in tiles of {tile}: {transient} B (bound {bound} B, output {y_bytes} B)"
    );
    assert!(transient <= bound, "{transient} > {bound}");
    assert!(transient < y_bytes + dense / 4, "{transient}");
    // and the backward of the same tiles: ∂x, one decode, the incoming gradient
    // and the backward of the same tiles: the incoming gradient made contiguous, ∂x, one decode
    // and one tile's product
    let loss = qs[0].linear_tiled(&x, tile).unwrap().sum(Kind::Double);
    sys::cpu_reset_peak().unwrap();
    let before = live();
    loss.backward();
    let transient = peak() - before;
    let bound = y_bytes + 2 * n * inn * 8 + decode as i64;
    println!("backward transient in tiles of {tile}: {transient} B (bound {bound} B)");
    assert!(transient <= bound, "{transient} > {bound}");
    drop(y);
}
