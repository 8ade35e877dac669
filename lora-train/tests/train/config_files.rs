//! `TrainConfig` on the example files in `examples/configs/` and on the error cases users hit.

use lora_train::config::{
    BaseWeights, ConfigError, DataFormat, ExportFormat, OptimizerName, Precision, SchedulerKind,
    TargetModules, TrainConfig,
};
use std::path::PathBuf;

fn example(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../examples/configs")
        .join(name)
}

#[test]
fn demo_yaml_reads_as_written() {
    let c = TrainConfig::from_file(example("smollm2-shakespeare.yaml")).unwrap();
    assert_eq!(
        c.model.base_model.as_deref(),
        Some("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    );
    assert_eq!(c.model.weights, BaseWeights::Dense);
    assert_eq!(c.lora.rank, 8);
    assert_eq!(c.lora.alpha, 16.0);
    assert_eq!(
        c.lora.target_modules,
        TargetModules::List(vec![
            "q_proj".into(),
            "k_proj".into(),
            "v_proj".into(),
            "o_proj".into()
        ])
    );
    assert_eq!(c.data.format, DataFormat::Text);
    assert_eq!(c.data.seq_len, 128);
    assert_eq!(c.data.max_bytes, Some(60_000));
    assert_eq!(c.train.max_steps, Some(16));
    assert_eq!(c.train.learning_rate, 1e-3);
    assert_eq!(
        c.train.lr_scheduler,
        SchedulerKind::Cosine { num_cycles: 0.5 }
    );
    assert_eq!(
        c.train.export_formats,
        vec![ExportFormat::Peft, ExportFormat::Kohya]
    );
    let b = c.memory.budget.as_ref().unwrap();
    assert_eq!(b.bytes, 8_000_000_000);
    assert_eq!(b.assumed, None, "GB is an explicit decimal unit");
    assert_eq!(c.system.device, "cpu");
}

#[test]
fn kohya_toml_maps_flat_names_onto_the_model() {
    let c = TrainConfig::from_file(example("kohya-style.toml")).unwrap();
    assert_eq!(
        c.model.base_model.as_deref(),
        Some("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    );
    assert_eq!(c.lora.rank, 8, "network_dim");
    assert_eq!(c.lora.alpha, 16.0, "network_alpha");
    assert_eq!(c.lora.network_module.as_deref(), Some("networks.lora"));
    assert_eq!(
        c.train.optimizer,
        OptimizerName::AdamW8bit,
        "optimizer_type"
    );
    assert_eq!(c.train.learning_rate, 5e-4);
    assert_eq!(
        c.train.lr_scheduler,
        SchedulerKind::CosineWithRestarts { num_cycles: 2.0 },
        "lr_scheduler with lr_scheduler_num_cycles"
    );
    assert_eq!(c.train.warmup_steps, 10);
    assert_eq!(c.train.batch_size, 2, "train_batch_size");
    assert_eq!(c.train.epochs, 1, "max_train_epochs");
    assert_eq!(c.train.max_steps, Some(40), "max_train_steps");
    assert_eq!(c.train.mixed_precision, Precision::Bf16);
    assert!(c.train.gradient_checkpointing);
    assert_eq!(c.train.gradient_accumulation_steps, 2);
    assert_eq!(c.train.save_every_n_steps, Some(20));
    assert_eq!(c.train.save_every_n_epochs, Some(1));
    assert_eq!(c.train.output_name, "hamlet_lora");
    assert_eq!(c.train.export_formats, vec![ExportFormat::Kohya]);
    assert_eq!(c.system.seed, 1234);
    assert_eq!(c.data.seq_len, 128, "max_token_length");
    assert_eq!(c.data.caption_extension.as_deref(), Some(".txt"));
    assert_eq!(c.data.keep_tokens, Some(1));
    assert_eq!(c.data.shuffle_caption, Some(true));
    assert_eq!(c.data.enable_bucket, Some(true));
    assert_eq!(
        (
            c.data.min_bucket_reso,
            c.data.max_bucket_reso,
            c.data.bucket_reso_steps
        ),
        (Some(256), Some(1024), Some(64))
    );
    assert_eq!(c.data_loader.num_workers, 1);
}

#[test]
fn low_vram_guide_yaml_maps_its_keys() {
    let c = TrainConfig::from_file(example("low-vram-guide.yaml")).unwrap();
    assert_eq!(c.lora.rank, 4, "model.lora_rank");
    assert_eq!(c.lora.alpha, 8.0, "model.lora_alpha");
    assert_eq!(
        c.data.train_data_dir.as_deref(),
        Some("assets/shakespeare/lear_gut.txt")
    );
    assert_eq!(c.data.resolution, Some([512, 512]));
    assert_eq!(c.train.batch_size, 1);
    assert_eq!(c.train.gradient_accumulation_steps, 8);
    assert_eq!(
        c.train.mixed_precision,
        Precision::Bf16,
        "use_fp16: false does not override bf16"
    );
    assert!(c.train.gradient_checkpointing);
    assert_eq!(
        c.train.optimizer,
        OptimizerName::AdamW8bit,
        "train.use_8bit_adam"
    );
    assert_eq!(
        c.train.save_every_n_steps,
        Some(500),
        "top-level save_steps"
    );
    assert_eq!(c.memory.gpu.as_deref(), Some("RTX 2060"));
    assert!(c.memory.auto_fit);
    assert_eq!(c.system.seed, 42);
    assert_eq!(c.data_loader.num_workers, 2);
    assert!(c.data_loader.persistent_workers);
    assert_eq!(c.data_loader.prefetch_factor, 2);
}

#[test]
fn every_example_round_trips_through_canonical_yaml() {
    for name in [
        "smollm2-shakespeare.yaml",
        "kohya-style.toml",
        "low-vram-guide.yaml",
    ] {
        let c = TrainConfig::from_file(example(name)).unwrap();
        let back = TrainConfig::from_yaml_str(&c.to_yaml().unwrap()).unwrap();
        assert_eq!(back, c, "{name}");
    }
}

#[test]
fn use_fp16_sets_fp16_and_conflicts_with_bf16() {
    let c = TrainConfig::from_yaml_str("use_fp16: true\n").unwrap();
    assert_eq!(c.train.mixed_precision, Precision::Fp16);
    let e = TrainConfig::from_yaml_str("use_fp16: true\ntrain:\n  mixed_precision: bf16\n")
        .unwrap_err();
    assert!(matches!(e, ConfigError::Conflict { .. }), "{e}");
    assert!(e.to_string().contains("use_fp16"), "{e}");
}

#[test]
fn conflicting_duplicates_name_both_keys() {
    let e = TrainConfig::from_yaml_str("train:\n  batch_size: 4\ndata:\n  batch_size: 2\n")
        .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("`train.batch_size` = 4") && msg.contains("`data.batch_size` = 2"),
        "{msg}"
    );
    let e = TrainConfig::from_toml_str("network_dim = 8\n[lora]\nrank = 16\n").unwrap_err();
    assert!(
        e.to_string().contains("network_dim") && e.to_string().contains("lora.rank"),
        "{e}"
    );
    let e = TrainConfig::from_yaml_str("optimizer_type: AdamW\ntrain:\n  use_8bit_adam: true\n")
        .unwrap_err();
    assert!(matches!(e, ConfigError::Conflict { .. }), "{e}");
}

#[test]
fn unknown_keys_name_path_value_and_closest_key() {
    let e = TrainConfig::from_yaml_str("model:\n  lora_rnak: 8\nnetwork_dimm: 4\n").unwrap_err();
    let ConfigError::UnknownKeys(keys) = &e else {
        panic!("{e}")
    };
    assert_eq!(keys.len(), 2, "{e}");
    let by = |k: &str| {
        keys.iter()
            .find(|u| u.key == k)
            .unwrap_or_else(|| panic!("{k} missing in {e}"))
    };
    assert_eq!(
        by("model.lora_rnak").suggestion.as_deref(),
        Some("model.lora_rank")
    );
    assert_eq!(by("model.lora_rnak").value, "8");
    assert_eq!(
        by("network_dimm").suggestion.as_deref(),
        Some("network_dim")
    );
    // a key under the wrong section points at the right one
    let e = TrainConfig::from_yaml_str("train:\n  seq_len: 128\n").unwrap_err();
    assert!(e.to_string().contains("did you mean `data.seq_len`"), "{e}");
    // far from everything: no suggestion, still named
    let e = TrainConfig::from_yaml_str("zzzzqqqq: 1\n").unwrap_err();
    assert!(
        e.to_string().contains("unknown key `zzzzqqqq`") && !e.to_string().contains("did you mean"),
        "{e}"
    );
}

#[test]
fn invalid_values_name_key_value_and_allowed() {
    let e = TrainConfig::from_yaml_str("train:\n  optimizer: Lion\n").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("train.optimizer")
            && msg.contains("\"Lion\"")
            && msg.contains("\"AdamW8bit\""),
        "{msg}"
    );
    let e = TrainConfig::from_yaml_str("lora:\n  rank: 0\n").unwrap_err();
    assert!(
        e.to_string().contains("lora.rank") && e.to_string().contains(">= 1"),
        "{e}"
    );
    let e = TrainConfig::from_yaml_str("lora:\n  r: eight\n").unwrap_err();
    assert!(
        e.to_string().contains("lora.r") && e.to_string().contains("\"eight\""),
        "{e}"
    );
    let e = TrainConfig::from_yaml_str("lr_scheduler: cosine_annealing\n").unwrap_err();
    assert!(e.to_string().contains("\"cosine_with_restarts\""), "{e}");
    let e = TrainConfig::from_yaml_str("memory:\n  budget: six gigs\n").unwrap_err();
    assert!(
        e.to_string().contains("memory.budget") && e.to_string().contains("\"six gigs\""),
        "{e}"
    );
    let e = TrainConfig::from_yaml_str("network_module: lycoris.kohya\n").unwrap_err();
    assert!(e.to_string().contains("networks.lora"), "{e}");
}

#[test]
fn sizes_parse_through_lora_memory_and_say_the_assumed_unit() {
    let c = TrainConfig::from_yaml_str("memory:\n  budget: 12GiB\n").unwrap();
    assert_eq!(c.memory.budget.as_ref().unwrap().bytes, 12 << 30);
    assert!(c.notes().is_empty());
    let c = TrainConfig::from_yaml_str("memory:\n  budget: 6G\n").unwrap();
    let b = c.memory.budget.as_ref().unwrap();
    assert_eq!(b.bytes, 6 << 30, "a single-letter suffix is read as binary");
    assert!(b.assumed.is_some());
    assert_eq!(c.notes().len(), 1);
    let c = TrainConfig::from_yaml_str("memory:\n  max_memory: 512MB\n").unwrap();
    assert_eq!(c.memory.budget.unwrap().bytes, 512_000_000);
    let e = TrainConfig::from_yaml_str("memory:\n  budget: 6GB\n  gpu: RTX 3060\n").unwrap_err();
    assert!(matches!(e, ConfigError::Conflict { .. }), "{e}");
}

#[test]
fn tagger_keys_are_recognised_under_tagger_and_pointed_there_otherwise() {
    let y = "tagger:\n  model_settings:\n    precision: fp16\n    device: cuda\n    device_map: auto\n    low_cpu_mem_usage: true\n    max_memory:\n      cuda: 6GB\n      cpu: 16GB\n  generation_settings:\n    max_batch_size: 4\n    timeout: 30\n    retry_attempts: 3\n  memory_management:\n    auto_clear_interval: 10\n    cache_size: 100\n";
    let c = TrainConfig::from_yaml_str(y).unwrap();
    let t = c.tagger.unwrap();
    assert_eq!(
        t.model_settings.max_memory.cuda.unwrap().bytes,
        6_000_000_000
    );
    assert_eq!(
        t.model_settings.max_memory.cpu.unwrap().bytes,
        16_000_000_000
    );
    assert_eq!(t.generation_settings.max_batch_size, Some(4));
    assert_eq!(t.generation_settings.timeout, Some(30.0));
    assert_eq!(t.memory_management.cache_size, Some(100));
    let e = TrainConfig::from_yaml_str("model_settings:\n  precision: fp16\n").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("tagger:") && msg.contains("tagger.model_settings.precision"),
        "{msg}"
    );
}

#[test]
fn syntax_and_extension_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, "train:\n  batch_size: [1,\n").unwrap();
    let e = TrainConfig::from_file(&bad).unwrap_err();
    assert!(
        matches!(e, ConfigError::Syntax { format: "YAML", .. })
            && e.to_string().contains("bad.yaml"),
        "{e}"
    );
    let ini = dir.path().join("run.ini");
    std::fs::write(&ini, "x=1").unwrap();
    assert!(matches!(
        TrainConfig::from_file(&ini).unwrap_err(),
        ConfigError::Extension { .. }
    ));
    let e = TrainConfig::from_yaml_str("- a\n- b\n").unwrap_err();
    assert!(matches!(e, ConfigError::NotAMapping { .. }), "{e}");
}

#[test]
fn defaults_match_the_documented_ones() {
    let c = TrainConfig::from_yaml_str("").unwrap();
    assert_eq!((c.lora.rank, c.lora.alpha, c.lora.dropout), (8, 8.0, 0.0));
    assert_eq!(
        c.lora.target_modules,
        TargetModules::List(vec!["q_proj".into(), "v_proj".into()])
    );
    assert_eq!(
        (
            c.train.batch_size,
            c.train.gradient_accumulation_steps,
            c.train.epochs
        ),
        (1, 1, 1)
    );
    assert_eq!(c.train.max_grad_norm, 1.0);
    assert_eq!(c.data.seq_len, 256);
    assert!(c.base_model().is_err());
}
