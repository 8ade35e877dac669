//! The comparison job's shared inputs and our side of it, on a tiny size (2 steps of 1 × 32
//! tokens). Needs the assets of `cargo xtask setup`; skipped (with a message) without them.

use std::path::{Path, PathBuf};

use lora_benches::job::{
    ADAPTER_DIR, PrepareOptions, TARGET_MODULES, TrainOptions, prepare, read_batches, train_ours,
};

fn assets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../assets")
}

#[test]
fn prepared_inputs_train_through_our_trainer_with_the_base_models_first_loss() {
    let model = assets().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text_dir = assets().join("shakespeare");
    if !model.is_file() || !text_dir.is_dir() {
        eprintln!("assets missing (cargo xtask setup); skipped");
        return;
    }
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job");
    let (batches, adapter) = prepare(&PrepareOptions {
        model: model.clone(),
        text_dir: text_dir.clone(),
        steps: 2,
        batch: 1,
        seq_len: 32,
        rank: 4,
        alpha: 8.0,
        seed: 3,
        out_dir: job.clone(),
    })
    .unwrap();
    assert_eq!(adapter, job.join(ADAPTER_DIR));

    // The batches are [steps, batch, seq_len] windows of real text: they decode to a piece of
    // one of the plays.
    let ids = read_batches(&job).unwrap();
    assert!(batches.is_file());
    assert_eq!(ids.size(), [2, 1, 32]);
    let tok = lora_models::tokenizer::load_tokenizer_from_gguf(&model).unwrap();
    let row: Vec<i64> = Vec::try_from(ids.get(0).get(0)).unwrap();
    let text = tok.decode(&row, true).unwrap();
    let all: String = std::fs::read_dir(&text_dir)
        .unwrap()
        .flatten()
        .map(|e| std::fs::read_to_string(e.path()).unwrap_or_default())
        .collect();
    let probe: String = text.chars().skip(2).take(40).collect();
    assert!(
        all.replace("\r\n", "\n").contains(probe.trim()),
        "row 0 decodes to {text:?}, not found in the plays"
    );

    // The adapter: every block linear of 30 layers, rank 4, B zeros, A not.
    let (cfg, w) = lora_core::formats::peft::load(&adapter).unwrap();
    assert_eq!((cfg.r, cfg.lora_alpha), (4, 8.0));
    assert_eq!(w.modules.len(), 30 * TARGET_MODULES.len());
    let q = &w.modules["model.layers.0.self_attn.q_proj"];
    assert_eq!(q.lora_a.size(), [4, 576]);
    assert_eq!(q.lora_b.size(), [576, 4]);
    assert_eq!(q.lora_b.abs().sum(tch::Kind::Float).double_value(&[]), 0.0);
    assert!(q.lora_a.abs().sum(tch::Kind::Float).double_value(&[]) > 1.0);

    // Our side: with B = 0 the first step's loss is the base model's loss on batch 0.
    let opts = TrainOptions {
        model: model.clone(),
        job_dir: job.clone(),
        steps: 2,
        threads: 1,
        lr: 1e-3,
        weight_decay: 0.01,
        device: "cpu".into(),
        precision: "fp32".into(),
        phases: false,
        profile: None,
    };
    let r = train_ours(&opts).unwrap();
    let (base, _) = lora_train::llm::load_base(
        &model,
        lora_train::config::BaseWeights::Dense,
        lora_train::config::Dtype::F32,
        tch::Device::Cpu,
    )
    .unwrap();
    let b0 = ids.get(0);
    let expected = base
        .loss(&b0, &b0, None, None, false)
        .unwrap()
        .double_value(&[]);
    assert_eq!(r.step_times_s.len(), 2);
    assert_eq!(r.losses.len(), 2);
    assert!(
        (r.losses[0] - expected).abs() < 1e-4,
        "first-step loss {} vs the base model's {expected}",
        r.losses[0]
    );
    assert_eq!(r.tokens_per_step, 32);
    assert!(
        r.tensor_peak_bytes.unwrap() > 500 << 20,
        "f32 weights are ~540 MB"
    );
    assert!(r.rss_peak_bytes >= r.rss_baseline_bytes);

    // A profiled bare loop: the same losses, and per-operator sums of the step after the first.
    let prof_dir = dir.path().join("profile");
    let p = train_ours(&TrainOptions {
        profile: Some(prof_dir.clone()),
        ..opts
    })
    .unwrap();
    assert!((p.losses[0] - r.losses[0]).abs() < 1e-6);
    assert_eq!(p.phases_s.len(), 3, "{:?}", p.phases_s);
    let ops: lora_benches::job::OpsFile =
        serde_json::from_str(&std::fs::read_to_string(prof_dir.join("ops_ours.json")).unwrap())
            .unwrap();
    assert_eq!((ops.side.as_str(), ops.steps), ("ours", 1));
    // the step's frozen products: MKL's mm or oneDNN's linear, whichever this CPU takes
    let gemm = |o: &lora_benches::job::OpEntry| {
        o.name == "aten::mm" || o.name == "mkldnn::_linear_pointwise"
    };
    assert!(
        ops.ops
            .iter()
            .any(|o| gemm(o) && o.calls_per_step >= 30.0 && o.self_s > 0.0)
    );
    assert!(
        ops.by_shapes
            .iter()
            .any(|o| gemm(o) && o.shapes.contains("576"))
    );
    assert!(prof_dir.join("trace_ours.json").is_file());
}
