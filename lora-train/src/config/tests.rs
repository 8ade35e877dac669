use super::*;
use keys::edit_distance;

#[test]
fn non_finite_numbers_are_errors_not_defaults() {
    for text in [
        "train:\n  learning_rate: .nan\n",
        "train:\n  learning_rate: .inf\n",
    ] {
        let e = TrainConfig::from_yaml_str(text).unwrap_err().to_string();
        assert!(e.contains("train.learning_rate"), "{e}");
    }
    let e = TrainConfig::from_toml_str("[train]\nlearning_rate = nan\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.learning_rate"), "{e}");
}

#[test]
fn zero_threads_is_an_error_naming_the_key() {
    // libtorch refuses 0 intra-op threads (it used to panic inside `set_num_threads`)
    let e = TrainConfig::from_yaml_str("system:\n  num_threads: 0\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("system.num_threads") && e.contains(">= 1"),
        "{e}"
    );
    let c = TrainConfig::from_yaml_str("system:\n  num_threads: 3\n").unwrap();
    assert_eq!(c.system.num_threads, Some(3));
}

#[test]
fn edit_distance_counts_single_edits() {
    assert_eq!(edit_distance("learnig_rate", "learning_rate"), 1);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(edit_distance("kitten", "sitting"), 3);
}

#[test]
fn aliases_agreeing_are_accepted_and_disagreeing_conflict() {
    let c =
        TrainConfig::from_yaml_str("train:\n  batch_size: 4\ndata:\n  batch_size: 4\n").unwrap();
    assert_eq!(c.train.batch_size, 4);
    let e = TrainConfig::from_yaml_str("train:\n  batch_size: 4\ndata:\n  batch_size: 2\n")
        .unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, ConfigError::Conflict { .. }), "{msg}");
    assert!(
        msg.contains("train.batch_size") && msg.contains("data.batch_size"),
        "{msg}"
    );
}

#[test]
fn a_known_spelling_under_the_wrong_section_points_at_the_settings_own_key() {
    let e = TrainConfig::from_yaml_str("lora:\n  network_dim: 16\n").unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("did you mean `lora.rank`"), "{msg}");
}

#[test]
fn unknown_key_gets_a_hint() {
    let e = TrainConfig::from_yaml_str("train:\n  learnig_rate: 0.001\n").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("train.learnig_rate") && msg.contains("did you mean `train.learning_rate`"),
        "{msg}"
    );
    assert!(msg.contains("0.001"), "{msg}");
}

#[test]
fn booleans_read_the_yaml_words_and_the_error_names_them() {
    for (word, want) in [
        ("yes", true),
        ("Off", false),
        ("\"on\"", true),
        ("no", false),
    ] {
        let c = TrainConfig::from_yaml_str(&format!("memory:\n  cpu_cache: {word}\n"))
            .unwrap_or_else(|e| panic!("{word}: {e}"));
        assert_eq!(c.memory.cpu_cache, want, "{word}");
    }
    let e = TrainConfig::from_yaml_str("memory:\n  cpu_cache: 1\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("memory.cpu_cache") && e.contains("true or false") && e.contains("yes/no"),
        "{e}"
    );
    // the guides' special spellings say the same
    let e = TrainConfig::from_yaml_str("train:\n  use_8bit_adam: maybe\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("use_8bit_adam") && e.contains("yes/no"), "{e}");
}

#[test]
fn choices_report_allowed_values() {
    let e = TrainConfig::from_yaml_str("train:\n  mixed_precision: fp8\n").unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("\"fp8\"")
            && msg.contains("\"bf16\"")
            && msg.contains("train.mixed_precision"),
        "{msg}"
    );
}

#[test]
fn canonical_yaml_round_trips() {
    let mut c = TrainConfig::default();
    c.lora.rank = 16;
    c.lora.target_modules = TargetModules::Regex(".*proj".into());
    c.memory.budget = Some(parse_size_key("memory.budget", "6GB").unwrap());
    c.train.export_formats = vec![ExportFormat::Peft, ExportFormat::Kohya];
    let y = c.to_yaml().unwrap();
    let back = TrainConfig::from_yaml_str(&y).unwrap();
    assert_eq!(back, c, "{y}");
}

/// A config with every documented key set to a value other than its default, built in code
/// (the Rust builder of the round-trip test below).
fn every_key_set() -> TrainConfig {
    let mut c = TrainConfig::default();
    let size = |t: &str| parse_size_key("size", t).unwrap();
    c.model.base_model = Some("models/base.gguf".into());
    c.model.weights = BaseWeights::Quantized;
    c.model.dtype = Dtype::Bf16;
    c.model.kind = ModelKind::Llm;
    c.model.tokenizer = Some("tok".into());
    c.model.model_type = Some("generic".into());
    c.lora.rank = 16;
    c.lora.alpha = 32.0;
    c.lora.dropout = 0.1;
    c.lora.target_modules = TargetModules::list(&["q_proj", "k_proj", "v_proj", "o_proj"]);
    c.lora.exclude_modules = Some(TargetModules::list(&["lm_head"]));
    c.lora.use_rslora = true;
    c.lora.use_dora = true;
    c.lora.init_lora_weights = InitLoraWeights::Gaussian;
    c.lora.rank_pattern = [("q_proj".to_string(), 4)].into();
    c.lora.alpha_pattern = [("q_proj".to_string(), 8.0)].into();
    c.lora.network_module = Some("networks.lora".into());
    c.lora.conv_rank = Some(4);
    c.lora.conv_alpha = Some(2.0);
    c.data.train_data_dir = Some("data/train.txt".into());
    c.data.format = DataFormat::Jsonl;
    c.data.eval_file = Some("data/eval.txt".into());
    c.data.eval_fraction = 0.2;
    c.data.max_bytes = Some(1000);
    c.data.seq_len = 512;
    c.data.resolution = Some([768, 512]);
    c.data.caption_extension = Some(".txt".into());
    c.data.keep_tokens = Some(1);
    c.data.shuffle_caption = Some(true);
    c.data.enable_bucket = Some(true);
    c.data.min_bucket_reso = Some(256);
    c.data.max_bucket_reso = Some(1024);
    c.data.bucket_reso_steps = Some(64);
    c.data.cache_latents = Some(true);
    c.data.bad_images = BadImages::Stop;
    c.data.reg_data_dir = Some("reg".into());
    c.data.flip_aug = Some(true);
    c.data.random_crop = Some(true);
    c.data.caption_dropout_rate = Some(0.1);
    c.data.caption_tag_dropout_rate = Some(0.2);
    c.data.caption_prefix = Some("photo of".into());
    c.data.caption_suffix = Some(", best".into());
    c.data.caption_separator = Some(";".into());
    c.train.batch_size = 4;
    c.train.gradient_accumulation_steps = 2;
    c.train.epochs = 3;
    c.train.max_steps = Some(100);
    c.train.learning_rate = 2e-4;
    c.train.optimizer = OptimizerName::SgdNesterov;
    c.train.weight_decay = 0.01;
    c.train.momentum = Some(0.8);
    c.train.loraplus_lr_ratio = Some(16.0);
    c.train.lr_scheduler = SchedulerKind::CosineWithRestarts { num_cycles: 2.0 };
    c.train.warmup_steps = 10;
    c.train.warmup_ratio = Some(0.05);
    c.train.unet_lr = Some(3e-4);
    c.train.text_encoder_lr = vec![5e-5, 4e-5];
    c.train.optimizer_args = [("weight_decay".to_string(), Value::from(0.01))].into();
    c.train.lr_scheduler_args = [("num_cycles".to_string(), Value::from(2.0))].into();
    c.train.save_precision = Some(SavePrecision::Bf16);
    c.train.multires_noise_iterations = Some(6);
    c.train.save_last_n_steps = Some(200);
    c.train.save_last_n_epochs = Some(2);
    c.train.min_timestep = Some(100);
    c.train.max_timestep = Some(900);
    c.train.multires_noise_discount = 0.25;
    c.train.mixed_precision = Precision::Bf16;
    c.train.gradient_checkpointing = true;
    c.train.max_grad_norm = 0.5;
    c.train.nan_policy = NonFinitePolicy::LowerLr {
        factor: NonFinitePolicy::LOWER_LR_FACTOR,
    };
    c.train.save_every_n_steps = Some(50);
    c.train.save_every_n_epochs = Some(1);
    c.train.keep_last_checkpoints = 5;
    c.train.eval_every_n_steps = 25;
    c.train.output_dir = "out/run".into();
    c.train.output_name = "run".into();
    c.train.export_formats = vec![ExportFormat::Kohya];
    c.train.noise_offset = 0.05;
    c.train.min_snr_gamma = Some(5.0);
    c.train.prediction_type = Some("v_prediction".into());
    c.train.clip_skip = Some(2);
    c.train.train_text_encoder = true;
    c.memory.budget = Some(size("12GiB")); // `memory.gpu` is the alternative: see below
    c.memory.auto_fit = true;
    c.memory.force = true;
    c.memory.cpu_return_freed = !MemorySection::default().cpu_return_freed;
    c.memory.cpu_cache = !MemorySection::default().cpu_cache;
    c.logging.log_every_n_steps = 7;
    c.logging.logging_dir = Some("logs".into());
    c.logging.progress = !LoggingSection::default().progress;
    c.logging.tensorboard = !LoggingSection::default().tensorboard;
    c.logging.log_with = Some("tensorboard".into());
    c.logging.log_prefix = Some("exp-".into());
    c.logging.sample_prompts_file = Some("prompts.txt".into());
    c.logging.sample_prompt = Some("Once".into());
    c.logging.sample_max_new_tokens = 12;
    c.logging.sample_every_n_steps = 30;
    c.logging.sample_prompts = vec!["a cat".into(), "a dog".into()];
    c.logging.sample_sampler = "euler".into();
    c.logging.sample_steps = 12;
    c.logging.sample_guidance_scale = 3.5;
    c.system.seed = 7;
    c.system.device = "cuda:1".into();
    c.system.num_threads = Some(3);
    c.data_loader.num_workers = 3;
    c.data_loader.persistent_workers = !DataLoaderSection::default().persistent_workers;
    c.data_loader.prefetch_factor = 4;
    c.data_loader.shuffle = !DataLoaderSection::default().shuffle;
    c.flux.t5xxl = Some("t5xxl_fp16.safetensors".into());
    c.flux.clip_l = Some("clip_l.safetensors".into());
    c.flux.ae = Some("ae.safetensors".into());
    c.flux.fp8_base = true;
    c.flux.blocks_to_swap = 16;
    c.flux.t5xxl_max_token_length = Some(256);
    c.flux.apply_t5_attn_mask = true;
    c.flux.timestep_sampling = super::TimestepSampling::Shift;
    c.flux.sigmoid_scale = 1.5;
    c.flux.discrete_flow_shift = 3.1582;
    c.flux.logit_mean = 0.5;
    c.flux.logit_std = 1.5;
    c.flux.guidance_scale = 3.5;
    c.flux.model_prediction_type = super::ModelPredictionType::SigmaScaled;
    c.flux.train_blocks = super::FluxTrainBlocks::Single;
    c.flux.train_double_block_indices = Some("0-3".into());
    c.flux.train_single_block_indices = Some("1,4-6".into());
    let mut t = TaggerSection::default();
    t.model_settings.precision = Some("bf16".into());
    t.model_settings.device = Some("cpu".into());
    t.model_settings.device_map = Some("auto".into());
    t.model_settings.low_cpu_mem_usage = Some(true);
    t.model_settings.max_memory.cuda = Some(size("6GB"));
    t.model_settings.max_memory.cpu = Some(size("16GB"));
    t.generation_settings.max_batch_size = Some(8);
    t.generation_settings.timeout = Some(30.0);
    t.generation_settings.retry_attempts = Some(2);
    t.memory_management.auto_clear_interval = Some(10);
    t.memory_management.cache_size = Some(100);
    c.tagger = Some(t);
    c
}

/// The value at a dotted key path of a serialized config.
fn at<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    key.split('.').try_fold(v, |v, k| v.get(k))
}

#[test]
fn every_documented_key_reaches_the_engine_alike_from_yaml_toml_and_code() {
    // two settings that exclude each other (a budget, or a GPU to take it from) are set in
    // a second variant
    // (and the engine's settings with arguments other than their names' defaults)
    let mut with_gpu = every_key_set();
    with_gpu.memory.budget = None;
    with_gpu.memory.gpu = Some("RTX 3060 12GB".into());
    with_gpu.train.lr_scheduler = SchedulerKind::Polynomial {
        lr_end: 1e-6,
        power: 2.0,
    };
    with_gpu.train.lr_scheduler_args = [("power".to_string(), Value::from(2.0))].into();
    with_gpu.train.nan_policy = NonFinitePolicy::LowerLr { factor: 0.25 };
    let variants = [every_key_set(), with_gpu];
    let specs = TrainConfig::key_specs();
    let field_keys: Vec<&KeySpec> = specs.iter().filter(|k| k.field).collect();
    let as_json: Vec<Value> = variants
        .iter()
        .map(|c| serde_json::to_value(c).unwrap())
        .collect();
    let defaults = serde_json::to_value(TrainConfig::default()).unwrap();
    // every documented key is a field of the config, and the test gives it a value of its own
    for spec in &field_keys {
        let key = spec.canonical();
        let values: Vec<&Value> = as_json.iter().filter_map(|v| at(v, key)).collect();
        assert!(!values.is_empty(), "{key}: not a config field");
        assert!(
            values.iter().any(|v| Some(*v) != at(&defaults, key)),
            "{key} is left at its default by the test"
        );
    }
    // ... and every field of the config is documented
    fn leaves(v: &Value, prefix: &str, out: &mut std::collections::BTreeSet<String>) {
        match v {
            Value::Object(m)
                if !TrainConfig::key_specs()
                    .iter()
                    .any(|k| k.mapping && k.canonical() == prefix) =>
            {
                for (k, v) in m {
                    let p = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    leaves(v, &p, out);
                }
            }
            _ => {
                out.insert(prefix.to_string());
            }
        }
    }
    let mut fields = std::collections::BTreeSet::new();
    for v in &as_json {
        leaves(v, "", &mut fields);
    }
    for f in &fields {
        assert!(
            field_keys.iter().any(|k| k.canonical() == f),
            "{f}: a config field without a declared key"
        );
    }
    assert_eq!(fields.len(), field_keys.len());
    // every alias spelling sets its key's field to the same value
    for spec in &field_keys {
        let (key, names) = (spec.canonical(), spec.spellings);
        let Some(value) = as_json
            .iter()
            .filter_map(|v| at(v, key))
            .find(|v| Some(*v) != at(&defaults, key))
        else {
            continue;
        };
        for alias in &names[1..] {
            let mut doc = serde_json::Map::new();
            let parts: Vec<&str> = alias.split('.').collect();
            let mut leaf = value.clone();
            for p in parts.iter().skip(1).rev() {
                leaf = serde_json::json!({ *p: leaf });
            }
            doc.insert(parts[0].to_string(), leaf);
            if key == "train.lr_scheduler_args" {
                // schedule arguments need a schedule that takes them
                doc.insert("lr_scheduler".into(), Value::from("cosine_with_restarts"));
            }
            let yaml = serde_yaml_ng::to_string(&Value::Object(doc)).unwrap();
            let cfg = TrainConfig::from_yaml_str(&yaml)
                .unwrap_or_else(|e| panic!("{alias} (for {key}): {e}\n{yaml}"));
            let got = serde_json::to_value(&cfg).unwrap();
            assert_eq!(
                at(&got, key),
                Some(value),
                "{alias} does not set {key}:\n{yaml}"
            );
        }
    }
    // the keys that set an argument of another field (kohya's flat scheduler arguments) set
    // it from every spelling
    for spec in specs.iter().filter(|k| !k.field) {
        let (schedule, expected) = match spec.canonical() {
            "train.num_cycles" => (
                "cosine_with_restarts",
                SchedulerKind::CosineWithRestarts { num_cycles: 3.0 },
            ),
            "train.power" => (
                "polynomial",
                SchedulerKind::Polynomial {
                    lr_end: 1e-7,
                    power: 3.0,
                },
            ),
            other => panic!("{other}: a key that sets no field of its own, unknown to this test"),
        };
        for spelling in spec.spellings {
            let (section, leaf) = spelling.rsplit_once('.').unwrap_or(("", spelling));
            let yaml = if section.is_empty() {
                format!("lr_scheduler: {schedule}\n{leaf}: 3\n")
            } else {
                format!("lr_scheduler: {schedule}\n{section}:\n  {leaf}: 3\n")
            };
            let cfg = TrainConfig::from_yaml_str(&yaml)
                .unwrap_or_else(|e| panic!("{spelling}: {e}\n{yaml}"));
            assert_eq!(cfg.train.lr_scheduler, expected, "{yaml}");
            // ... and nothing for another schedule, as in kohya
            let other = TrainConfig::from_yaml_str(&yaml.replace(schedule, "linear")).unwrap();
            assert_eq!(other.train.lr_scheduler, SchedulerKind::Linear);
        }
    }
    for built in &variants {
        round_trip_and_lower(built);
    }
    // the values the engine gets are the ones set
    let t =
        crate::job::trainer_config(&variants[0], tch::Device::Cpu, Path::new("out"), 100).unwrap();
    assert_eq!(
        t.optimizer,
        crate::engine::optim::OptimizerKind::Sgd(crate::engine::optim::SgdConfig {
            momentum: 0.8,
            weight_decay: 0.01,
            nesterov: true,
            ..Default::default()
        })
    );
    // warmup_ratio 0.05 of the 100 steps wins over warmup_steps 10
    assert_eq!(
        (t.lr, t.warmup_steps, t.gradient_accumulation_steps),
        (2e-4, 5, 2)
    );
    assert_eq!(
        t.scheduler,
        SchedulerKind::CosineWithRestarts { num_cycles: 2.0 }
    );
    assert_eq!(t.precision, Precision::Bf16);
    assert_eq!(t.non_finite, NonFinitePolicy::LowerLr { factor: 0.5 });
}

/// `built` read back from YAML (canonical keys) and TOML is equal, and lowers to the same
/// engine, lora-core and lora-memory settings.
fn round_trip_and_lower(built: &TrainConfig) {
    // the same config from YAML (canonical keys), TOML and code
    let yaml = built.to_yaml().unwrap();
    let from_yaml = TrainConfig::from_yaml_str(&yaml).unwrap();
    assert_eq!(&from_yaml, built, "YAML:\n{yaml}");
    let toml_text = toml::to_string(built).unwrap();
    let from_toml = TrainConfig::from_toml_str(&toml_text).unwrap();
    assert_eq!(&from_toml, built, "TOML:\n{toml_text}");

    // ... lowered to the engine, lora-core and lora-memory alike
    for cfg in [&from_yaml, &from_toml] {
        let lower = |c: &TrainConfig| {
            let t = crate::job::trainer_config(c, tch::Device::Cpu, Path::new("out"), 100).unwrap();
            let l = crate::job::lora_config(c, "base").unwrap();
            let (s, _) = crate::job::settings_for(c, None, true);
            format!("{t:?}\n{l:?}\n{s:?}")
        };
        assert_eq!(lower(cfg), lower(built));
    }
}

#[test]
fn engine_settings_written_as_mappings_are_checked_like_names() {
    let err = |y: &str| TrainConfig::from_yaml_str(y).unwrap_err().to_string();
    // arguments outside their range name the key and the argument
    let e = err("train:\n  lr_scheduler: {type: polynomial, power: -2.0}\n");
    assert!(
        e.contains("train.lr_scheduler") && e.contains("power"),
        "{e}"
    );
    let e = err("train:\n  lr_scheduler: {type: cosine_with_restarts, num_cycles: 0}\n");
    assert!(
        e.contains("train.lr_scheduler") && e.contains("num_cycles"),
        "{e}"
    );
    let e =
        err("train:\n  learning_rate: 1.0e-4\n  lr_scheduler: {type: polynomial, lr_end: 1.0}\n");
    assert!(
        e.contains("lr_end") && e.contains("train.learning_rate"),
        "{e}"
    );
    let e = err("train:\n  nan_policy: {policy: lower_lr, factor: 2}\n");
    assert!(
        e.contains("train.nan_policy") && e.contains("(0, 1)"),
        "{e}"
    );
    // unknown arguments are errors; a missing factor is the name's default
    let e = err("train:\n  nan_policy: {policy: skip, factor: 0.3}\n");
    assert!(e.contains("train.nan_policy"), "{e}");
    let c = TrainConfig::from_yaml_str("train:\n  nan_policy: {policy: lower_lr}\n").unwrap();
    assert_eq!(
        c.train.nan_policy,
        NonFinitePolicy::LowerLr {
            factor: NonFinitePolicy::LOWER_LR_FACTOR
        }
    );
    // a mapping's argument and its flat kohya spelling must agree
    let e = err("train:\n  lr_scheduler: {type: polynomial, power: 2.0}\nlr_scheduler_power: 3\n");
    assert!(
        e.contains("train.lr_scheduler.power") && e.contains("lr_scheduler_power"),
        "{e}"
    );
    let agree = TrainConfig::from_yaml_str(
        "train:\n  lr_scheduler: {type: polynomial, power: 3.0}\nlr_scheduler_power: 3\n",
    )
    .unwrap();
    assert_eq!(
        agree.train.lr_scheduler,
        SchedulerKind::Polynomial {
            lr_end: 1e-7,
            power: 3.0
        }
    );
    // a negative clipping norm is no longer read as "off"
    let e = err("train:\n  max_grad_norm: -1\n");
    assert!(e.contains("train.max_grad_norm"), "{e}");
}

#[test]
fn kohya_flux_network_args_select_blocks_and_bad_indices_name_the_key() {
    let c = TrainConfig::from_toml_str(
        "network_module = \"networks.lora_flux\"\nnetwork_args = [\"train_blocks=single\", \"train_single_block_indices=0,2-4\", \"split_qkv=True\"]\n",
    )
    .unwrap();
    assert_eq!(c.flux.train_blocks, super::FluxTrainBlocks::Single);
    assert_eq!(c.flux.train_single_block_indices.as_deref(), Some("0,2-4"));
    assert_eq!(
        super::parse_block_indices("0,2-4,3", 38).unwrap(),
        Some(vec![0, 2, 3, 4])
    );
    assert_eq!(super::parse_block_indices("all", 38).unwrap(), None);
    assert_eq!(
        super::parse_block_indices("none", 38).unwrap(),
        Some(vec![])
    );
    assert!(super::parse_block_indices("4-2", 38).is_err());
    assert!(super::parse_block_indices("38", 38).is_err());
    let e = TrainConfig::from_toml_str("network_args = [\"train_double_block_indices=0,x\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train_double_block_indices") && e.contains("0,1,8-12"),
        "{e}"
    );
    let e = TrainConfig::from_toml_str("network_args = [\"train_blocks=triple\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("train_blocks") && e.contains("single"), "{e}");
    let e = TrainConfig::from_toml_str("network_args = [\"train_t5xxl=True\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("train_t5xxl"), "{e}");
    // the kohya_ss GUI's FLUX tab
    let c = TrainConfig::from_json_str(
        "{\"LoRA_type\": \"Flux1\", \"flux1_checkbox\": true, \"train_blocks\": \"double\", \"train_double_block_indices\": \"0, 5-7\", \"train_single_block_indices\": \"all\", \"network_dim\": 8, \"network_alpha\": 8}",
    )
    .unwrap();
    assert_eq!(c.flux.train_blocks, super::FluxTrainBlocks::Double);
    assert_eq!(c.flux.train_double_block_indices.as_deref(), Some("0,5-7"));
    assert_eq!(c.flux.train_single_block_indices, None);
}

#[test]
fn weights_and_dtype_names_read_back_as_themselves() {
    for (w, d) in [
        (BaseWeights::Dense, Dtype::F32),
        (BaseWeights::Quantized, Dtype::Bf16),
        (BaseWeights::Dense, Dtype::F16),
    ] {
        let text = format!("model:\n  weights: {}\n  dtype: {}\n", w.name(), d.name());
        let c = TrainConfig::from_yaml_str(&text).unwrap();
        assert_eq!((c.model.weights, c.model.dtype), (w, d), "{text}");
    }
    assert_eq!(Dtype::Bf16.name(), "bf16");
    assert_eq!(BaseWeights::Quantized.name(), "quantized");
}

#[test]
fn kohyas_warmup_spelling_in_conflict_is_named_as_written() {
    let e = TrainConfig::from_yaml_str("train:\n  warmup_steps: 2\n  lr_warmup_steps: 3\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`train.warmup_steps` = 2") && e.contains("`train.lr_warmup_steps` = 3"),
        "{e}"
    );
    // the same value twice is no conflict
    let c =
        TrainConfig::from_yaml_str("train:\n  warmup_steps: 3\n  lr_warmup_steps: 3\n").unwrap();
    assert_eq!(c.train.warmup_steps, 3);
}

#[test]
fn dora_adapters_cannot_be_exported_as_kohya_files() {
    let mut c = TrainConfig::default();
    assert!(c.unwritable_export().is_none());
    c.lora.use_dora = true;
    assert!(c.unwritable_export().is_none(), "PEFT alone is fine");
    c.train.export_formats = vec![ExportFormat::Peft, ExportFormat::Kohya];
    let e = c.unwritable_export().expect("DoRA + kohya").to_string();
    assert!(
        e.contains("train.export_formats") && e.contains("kohya") && e.contains("use_dora"),
        "{e}"
    );
    c.lora.use_dora = false;
    assert!(c.unwritable_export().is_none());
}
