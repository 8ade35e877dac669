//! libtorch's profiler through the shim (`lora_core::profile`): a LoRA layer's forward and
//! backward are recorded operator by operator, the Chrome trace is written, and a second
//! profiler cannot start while one runs.

use crate::common::dense;
use lora_core::base::BaseWeight;
use lora_core::config::AdapterSpec;
use lora_core::layer::LoraLayer;
use lora_core::linear::LoraLinear;
use lora_core::profile::{Profiler, ProfilerOptions};
use tch::nn;

#[test]
fn a_lora_step_is_recorded_operator_by_operator() {
    let vs = nn::VarStore::new(tch::Device::Cpu);
    let mut l = LoraLinear::new(BaseWeight::Dense(dense(&[48, 32], 1)), None).unwrap();
    l.add_adapter(
        "q",
        "default",
        &AdapterSpec::new(4, 8.0),
        &(vs.root() / "q"),
    )
    .unwrap();
    let x = dense(&[16, 32], 2);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");

    let shapes = ProfilerOptions {
        record_shapes: true,
        ..Default::default()
    };
    let profiler = Profiler::start(shapes).unwrap();
    let again = Profiler::start(shapes).unwrap_err().to_string();
    assert!(again.contains("already running"), "{again}");
    let y = l.forward_t(&x, true).unwrap();
    y.sum(tch::Kind::Float).backward();
    let profile = profiler.stop(Some(&trace)).unwrap();

    let ops = profile.ops();
    let get = |n: &str| ops.iter().find(|o| o.name == n);
    // f32 products go to oneDNN on CPUs where `linear_product` takes it, else to `aten::mm`
    let onednn = lora_core::sys::cpu_f32_gemm_by_onednn();
    let (gemm, node) = if onednn {
        ("mkldnn::_linear_pointwise", "OneDnnF32LinearBackward")
    } else {
        ("aten::mm", "MmBackward0")
    };
    // the base product and A, B: three GEMMs forward; the backward's nodes and their GEMMs
    // (the frozen base needs only the input gradient, x's is not asked for) — or, where the
    // shim's LoRA branch op runs, the base product's GEMM and the op's own node
    let lsdk = lora_core::sys::cpu_lora_branch_by_lsdk();
    let (node, least) = if lsdk {
        ("LoraBranchBackward", 1)
    } else {
        (node, 3)
    };
    let gemm_calls = get(gemm).map_or(0, |o| o.calls);
    assert!(
        gemm_calls >= least,
        "{gemm} ran {gemm_calls} times: {ops:?}"
    );
    assert!(get(node).is_some(), "no {node} node: {ops:?}");
    if lsdk {
        for op in ["lsdk::lora_branch", "lsdk::lora_branch_backward"] {
            assert_eq!(get(op).map(|o| o.calls), Some(1), "{op}: {ops:?}");
        }
    }
    for o in &ops {
        assert!(o.self_s >= 0.0 && o.self_s <= o.total_s + 1e-12, "{o:?}");
    }
    // the frozen product x·Wᵀ: [16, 32] by the [48, 32] weight (transposed for `mm`)
    let by_shapes = profile.ops_by_shapes();
    let frozen = if onednn {
        "[16, 32], [48, 32]"
    } else {
        "[16, 32], [32, 48]"
    };
    assert!(
        by_shapes
            .iter()
            .any(|o| o.name == gemm && o.shapes.starts_with(frozen)),
        "{by_shapes:?}"
    );
    let text = std::fs::read_to_string(&trace).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let names: Vec<&str> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert!(names.contains(&gemm), "{names:?}");
    assert!(names.contains(&node), "{names:?}");

    // stopped: a new one starts (and dropping it without stop discards its events)
    let p = Profiler::start(ProfilerOptions::default()).unwrap();
    drop(p);
    let p = Profiler::start(ProfilerOptions::default()).unwrap();
    let _ = x.relu();
    let events = p.stop(None).unwrap().events;
    assert!(
        events
            .iter()
            .any(|e| e.name == "aten::relu" && e.shapes.is_empty() && !e.cuda)
    );
}
