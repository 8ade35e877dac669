//! kohya configs as users have them: every argument of sd-scripts' `train_network.py` /
//! `sdxl_train_network.py` (the argparse list in `tests/fixtures/kohya/train_network_args.tsv`)
//! is honored (it changes a setting) or accepted with one warning naming it; the kohya_ss GUI's
//! saved JSON loads, mapped as the GUI maps it.

use lora_train::config::{
    ConfigError, ExportFormat, ModelKind, Precision, SavePrecision, TrainConfig,
};
use lora_train::engine::optim::OptimizerName;
use std::path::Path;

fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kohya")
        .join(name)
}

/// One argparse argument: name and kind (`flag`, `int`, `float`, `str`, `list`, `int_or_float`,
/// `path`).
fn kohya_args() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(fixture("train_network_args.tsv")).unwrap();
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let cols: Vec<&str> = l.split('\t').collect();
            (cols[0].to_string(), cols[2].to_string())
        })
        .collect()
}

/// A value that asks for something, as a user would write it in a kohya TOML: a valid value
/// for the arguments this SDK reads, a plain one of the argument's kind for the rest.
fn set_value(name: &str, kind: &str) -> String {
    let special = match name {
        "resolution" => "\"512,768\"",
        "optimizer_type" => "\"AdamW8bit\"",
        "lr_scheduler" => "\"cosine\"",
        "mixed_precision" => "\"fp16\"",
        "sample_sampler" => "\"euler_a\"",
        "save_precision" => "\"fp16\"",
        "save_model_as" => "\"ckpt\"",
        "log_with" => "\"tensorboard\"",
        "network_module" => "\"networks.lora\"",
        "network_args" => "[\"conv_dim=4\", \"conv_alpha=2\"]",
        "optimizer_args" => "[\"weight_decay=0.1\", \"betas=0.9,0.99\"]",
        "lr_scheduler_args" => "[\"num_cycles=2\"]",
        "text_encoder_lr" => "[0.0001, 0.00005]",
        "dynamo_backend" => "\"inductor\"",
        "console_log_level" => "\"INFO\"",
        "lr_warmup_steps" => "0.1",
        "max_token_length" => "150",
        "huber_schedule" => "\"exponential\"",
        "loss_type" => "\"huber\"",
        "zero_stage" => "3",
        "offload_optimizer_device" => "\"cpu\"",
        "offload_param_device" => "\"cpu\"",
        "resize_interpolation" => "\"bicubic\"",
        _ => "",
    };
    if !special.is_empty() {
        return special.to_string();
    }
    match kind {
        "flag" => "true".into(),
        "int" => "3".into(),
        "float" => "0.25".into(),
        "int_or_float" => "3".into(),
        "list" => "[\"x\"]".into(),
        _ => "\"some/value\"".into(),
    }
}

#[test]
fn the_argparse_list_is_sd_scripts_whole_list() {
    let args = kohya_args();
    assert_eq!(
        args.len(),
        196,
        "train_network.py + sdxl_train_network.py arguments"
    );
    for must in [
        "save_model_as",
        "save_precision",
        "xformers",
        "sdpa",
        "unet_lr",
        "text_encoder_lr",
        "network_train_unet_only",
        "network_args",
        "optimizer_args",
        "cache_latents_to_disk",
        "log_with",
        "v2",
        "v_parameterization",
        "full_fp16",
        "flip_aug",
        "random_crop",
        "no_half_vae",
    ] {
        assert!(args.iter().any(|(n, _)| n == must), "{must}");
    }
}

#[test]
fn every_kohya_argument_is_honored_or_warned_never_an_error() {
    let default = TrainConfig::default();
    let mut honored = Vec::new();
    let mut warned = Vec::new();
    for (name, kind) in kohya_args() {
        let mut text = format!("{name} = {}\n", set_value(&name, &kind));
        if name == "lr_scheduler_args" {
            // kohya hands them to the schedule: one that takes num_cycles
            text.push_str("lr_scheduler = \"cosine_with_restarts\"\n");
        }
        let cfg = TrainConfig::from_toml_str(&text)
            .unwrap_or_else(|e| panic!("`{}` is a real kohya key but failed: {e}", text.trim()));
        let warning = cfg.warnings.0.iter().find(|w| w.key.starts_with(&name));
        let changed = serde_json::to_value(&cfg).unwrap()
            != serde_json::to_value(&default).unwrap()
            || cfg.logging.tensorboard != default.logging.tensorboard;
        // asks for what this SDK does by default (tested with text_encoder_lr below)
        let our_default = name == "network_train_unet_only";
        assert!(
            changed || warning.is_some() || our_default,
            "`{}` was dropped: no setting changed and no warning",
            text.trim()
        );
        if let Some(w) = warning {
            assert!(!w.reason.is_empty(), "{w}");
            warned.push(name);
        } else {
            honored.push(name);
        }
    }
    // what an SD LoRA user relies on is honored, not merely accepted
    for must in [
        "unet_lr",
        "text_encoder_lr",
        "network_args",
        "optimizer_args",
        "lr_scheduler_args",
        "save_precision",
        "save_every_n_epochs",
        "save_every_n_steps",
        "save_last_n_epochs",
        "save_last_n_steps",
        "v_parameterization",
        "clip_skip",
        "min_snr_gamma",
        "multires_noise_iterations",
        "caption_dropout_rate",
        "caption_tag_dropout_rate",
        "flip_aug",
        "random_crop",
        "reg_data_dir",
        "logging_dir",
        "log_with",
        "log_prefix",
        "sample_prompts",
        "cache_latents_to_disk",
    ] {
        assert!(honored.iter().any(|n| n == must), "{must} is only warned");
    }
    for must in ["xformers", "sdpa", "v2", "full_fp16"] {
        assert!(warned.iter().any(|n| n == must), "{must} gives no warning");
    }
    eprintln!(
        "kohya arguments: {} honored, {} accepted with a warning",
        honored.len(),
        warned.len()
    );
}

#[test]
fn off_values_of_kohya_switches_are_silent() {
    let cfg = TrainConfig::from_toml_str(
        "xformers = false\nsdpa = false\nv2 = false\nmetadata_title = \"\"\nhighvram = false\n\
         loss_type = \"l2\"\nip_noise_gamma = 0\n",
    )
    .unwrap();
    assert!(cfg.warnings.0.is_empty(), "{:?}", cfg.warnings);
    assert_eq!(cfg, TrainConfig::default());
    // sd-scripts' own container is silent too, and asks for what sd-scripts writes: one kohya
    // file (unless the config names its formats)
    let cfg = TrainConfig::from_toml_str("save_model_as = \"safetensors\"\n").unwrap();
    assert!(cfg.warnings.0.is_empty(), "{:?}", cfg.warnings);
    assert_eq!(cfg.train.export_formats, vec![ExportFormat::Kohya]);
    let cfg = TrainConfig::from_toml_str(
        "network_module = \"networks.lora\"\n[train]\nexport_formats = [\"peft\", \"kohya\"]\n",
    )
    .unwrap();
    assert_eq!(
        cfg.train.export_formats,
        vec![ExportFormat::Peft, ExportFormat::Kohya]
    );
}

#[test]
fn a_kohya_toml_with_every_argument_at_once_loads_in_kohya_sections() {
    // as kohya_ss writes it: the arguments spread over kohya's sections
    let mut text = String::new();
    for (i, (name, kind)) in kohya_args().into_iter().enumerate() {
        // one value per setting: these would disagree with their siblings as written
        let value = match name.as_str() {
            "full_bf16" | "use_8bit_adam" | "use_lion_optimizer" => "false".into(),
            "dataset_config" => "\"dataset.toml\"".into(),
            "lr_scheduler" => "\"cosine_with_restarts\"".into(),
            _ => set_value(&name, &kind),
        };
        let section = [
            "model_arguments",
            "training_arguments",
            "optimizer_arguments",
        ][i % 3];
        text.push_str(&format!("[{section}]\n{name} = {value}\n"));
    }
    // TOML forbids a table twice: merge by re-parsing as kohya's flattening would
    let mut merged = toml::Table::new();
    for chunk in text.split("\n[").filter(|c| !c.is_empty()) {
        let chunk = if chunk.starts_with('[') {
            chunk.to_string()
        } else {
            format!("[{chunk}")
        };
        let t: toml::Table = toml::from_str(&chunk).unwrap();
        for (section, inner) in t {
            let entry = merged
                .entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()));
            if let (toml::Value::Table(dst), toml::Value::Table(src)) = (entry, inner) {
                dst.extend(src);
            }
        }
    }
    let cfg = TrainConfig::from_toml_str(&toml::to_string(&merged).unwrap()).unwrap();
    assert_eq!(cfg.lora.conv_rank, Some(4));
    assert_eq!(cfg.lora.conv_alpha, Some(2.0));
    assert_eq!(cfg.train.optimizer, OptimizerName::AdamW8bit);
    assert_eq!(cfg.train.mixed_precision, Precision::Fp16);
    assert_eq!(cfg.train.save_precision, Some(SavePrecision::F16));
    assert_eq!(cfg.train.prediction_type.as_deref(), Some("v_prediction"));
    assert_eq!(cfg.train.text_encoder_lr, vec![0.0001, 0.00005]);
    assert_eq!(cfg.train.warmup_ratio, Some(0.1));
    assert_eq!(cfg.data.train_data_dir.as_deref(), Some("dataset.toml"));
    assert!(cfg.logging.tensorboard);
    assert_eq!(cfg.logging.sample_sampler, "euler");
    assert!(
        cfg.warnings.0.iter().any(|w| w.key == "train_data_dir"),
        "dataset_config wins over train_data_dir, with a warning"
    );
}

#[test]
fn network_args_read_locon_lora_plus_and_refuse_other_algorithms() {
    let cfg = TrainConfig::from_toml_str(
        "network_module = \"networks.lora\"\nnetwork_args = [\"conv_dim=8\", \"conv_alpha=4\", \"loraplus_lr_ratio=16\", \"rank_dropout=0.1\"]\n",
    )
    .unwrap();
    assert_eq!(cfg.lora.conv_rank, Some(8));
    assert_eq!(cfg.lora.conv_alpha, Some(4.0));
    assert_eq!(cfg.train.loraplus_lr_ratio, Some(16.0));
    assert!(
        cfg.warnings
            .0
            .iter()
            .any(|w| w.key == "network_args.rank_dropout"),
        "{:?}",
        cfg.warnings
    );
    // LyCORIS LoCon is LoCon
    let cfg = TrainConfig::from_toml_str(
        "network_module = \"lycoris.kohya\"\nnetwork_args = [\"algo=locon\", \"conv_dim=4\"]\n",
    )
    .unwrap();
    assert_eq!(cfg.lora.conv_rank, Some(4));
    for algo in ["lokr", "loha", "ia3"] {
        let e = TrainConfig::from_toml_str(&format!(
            "network_module = \"lycoris.kohya\"\nnetwork_args = [\"algo={algo}\"]\n"
        ))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("network_args.algo") && e.contains(algo) && e.contains("not supported yet"),
            "{e}"
        );
    }
    let e = TrainConfig::from_toml_str("network_args = [\"conv_dim\"]\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("network_args") && e.contains("no `=`"), "{e}");
}

#[test]
fn schedule_arguments_reach_the_schedule_that_takes_them_and_are_warned_otherwise() {
    use lora_train::config::SchedulerKind;
    let cfg = TrainConfig::from_toml_str(
        "lr_scheduler = \"cosine_with_restarts\"\nlr_scheduler_num_cycles = 3\n",
    )
    .unwrap();
    assert!(
        matches!(cfg.train.lr_scheduler, SchedulerKind::CosineWithRestarts { num_cycles } if num_cycles == 3.0)
    );
    assert!(cfg.warnings.0.is_empty(), "{:?}", cfg.warnings);
    let cfg = TrainConfig::from_toml_str("lr_scheduler = \"polynomial\"\nlr_scheduler_power = 2\n")
        .unwrap();
    assert!(
        matches!(cfg.train.lr_scheduler, SchedulerKind::Polynomial { power, .. } if power == 2.0)
    );
    let cfg = TrainConfig::from_toml_str("lr_scheduler_num_cycles = 3\n").unwrap();
    let w = &cfg.warnings.0;
    assert!(
        w.len() == 1
            && w[0].key == "lr_scheduler_num_cycles"
            && w[0].reason.contains("cosine_with_restarts"),
        "{w:?}"
    );
}

#[test]
fn warmup_below_one_is_a_fraction_of_the_steps() {
    let cfg = TrainConfig::from_toml_str("lr_warmup_steps = 0.05\n").unwrap();
    assert_eq!(cfg.train.warmup_ratio, Some(0.05));
    assert_eq!(cfg.train.warmup_steps, 0);
    let cfg = TrainConfig::from_toml_str("lr_warmup_steps = 100\n").unwrap();
    assert_eq!(cfg.train.warmup_steps, 100);
    assert_eq!(cfg.train.warmup_ratio, None);
    let e = TrainConfig::from_toml_str("lr_warmup_steps = 2.5\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("lr_warmup_steps") && e.contains("2.5"), "{e}");
}

#[test]
fn text_encoder_lr_above_zero_trains_the_text_encoders_unless_unet_only() {
    let cfg = TrainConfig::from_toml_str("text_encoder_lr = 0.00005\n").unwrap();
    assert!(cfg.train.train_text_encoder);
    let cfg =
        TrainConfig::from_toml_str("text_encoder_lr = 0.00005\nnetwork_train_unet_only = true\n")
            .unwrap();
    assert!(!cfg.train.train_text_encoder);
    let cfg = TrainConfig::from_toml_str("text_encoder_lr = 0\n").unwrap();
    assert!(!cfg.train.train_text_encoder);
}

#[test]
fn the_kohya_ss_gui_json_loads_mapped_as_the_gui_maps_it() {
    let path = fixture("kohya_ss_gui_locon.json");
    let cfg = TrainConfig::from_file(&path).unwrap();
    // LoRA_type "Kohya LoCon" with the GUI's conv fields
    assert_eq!(cfg.lora.network_module.as_deref(), Some("networks.lora"));
    assert_eq!(cfg.lora.conv_rank, Some(8));
    assert_eq!(cfg.lora.conv_alpha, Some(4.0));
    assert_eq!(cfg.lora.rank, 16);
    assert_eq!(cfg.lora.alpha, 8.0);
    // numbers as strings, `epoch`, `max_resolution`, `optimizer`
    assert_eq!(cfg.train.epochs, 3);
    assert_eq!(cfg.data.resolution, Some([512, 640]));
    assert_eq!(cfg.train.optimizer, OptimizerName::AdamW8bit);
    assert_eq!(cfg.train.learning_rate, 0.0002);
    assert_eq!(cfg.train.batch_size, 2);
    assert_eq!(cfg.system.seed, 1234);
    assert_eq!(cfg.train.clip_skip, Some(2));
    // "0" and "" are unset, as in the GUI
    assert_eq!(cfg.train.max_steps, None);
    assert_eq!(cfg.train.save_every_n_steps, None);
    assert_eq!(cfg.train.save_every_n_epochs, Some(1));
    // lr_warmup is a percentage of the steps
    assert_eq!(cfg.train.warmup_ratio, Some(0.1));
    // Multires noise chosen: the plain noise offset is not sent
    assert_eq!(cfg.train.multires_noise_iterations, Some(6));
    assert_eq!(cfg.train.noise_offset, 0.0);
    // optimizer_args as the GUI's text box holds them
    assert_eq!(
        cfg.train.optimizer_args.get("weight_decay"),
        Some(&serde_json::json!(0.05))
    );
    assert_eq!(
        cfg.train.optimizer_args.get("betas"),
        Some(&serde_json::json!([0.9, 0.99]))
    );
    // a text-encoder rate trains the text encoders, as kohya does
    assert_eq!(cfg.train.text_encoder_lr, vec![0.00005]);
    assert!(cfg.train.train_text_encoder);
    assert_eq!(cfg.train.unet_lr, Some(0.0002));
    // the prompt box: one prompt per line, comments left out
    assert_eq!(cfg.logging.sample_prompts.len(), 2);
    // additional parameters are read as command-line arguments
    assert_eq!(cfg.train.max_grad_norm, 0.5);
    assert_eq!(cfg.system.num_threads, Some(2));
    assert!(cfg.logging.tensorboard, "logging_dir turns TensorBoard on");
    // sdpa and euler_a are accepted with a word each
    for key in ["sdpa", "sample_sampler"] {
        assert!(
            cfg.warnings.0.iter().any(|w| w.key == key),
            "{key}: {:?}",
            cfg.warnings
        );
    }
    // the GUI's other-model fields at their defaults say nothing
    assert!(
        !cfg.warnings.0.iter().any(|w| w.key.starts_with("t5xxl")),
        "{:?}",
        cfg.warnings
    );
}

#[test]
fn gui_lora_types_this_sdk_does_not_train_are_an_error_naming_the_value() {
    let text = std::fs::read_to_string(fixture("kohya_ss_gui_locon.json")).unwrap();
    for kind in ["LyCORIS/LoKr", "Kohya LoHa", "LyCORIS/iA3"] {
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["LoRA_type"] = serde_json::Value::from(kind);
        let e = TrainConfig::from_json_str(&v.to_string()).unwrap_err();
        assert!(matches!(e, ConfigError::InvalidValue { .. }), "{e}");
        let msg = e.to_string();
        assert!(msg.contains("LoRA_type") && msg.contains(kind), "{msg}");
    }
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["sd3_checkbox"] = serde_json::Value::Bool(true);
    let msg = TrainConfig::from_json_str(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(msg.contains("sd3_checkbox"), "{msg}");
}

#[test]
fn a_kohya_config_takes_sd_scripts_rank_and_alpha_defaults() {
    // sd-scripts' networks/lora.py: network_dim None → 4, network_alpha None → 1.0
    let c = TrainConfig::from_toml_str("network_module = \"networks.lora\"\n").unwrap();
    assert_eq!((c.lora.rank, c.lora.alpha), (4, 1.0));
    let c = TrainConfig::from_toml_str("network_module = \"networks.lora\"\nnetwork_dim = 16\n")
        .unwrap();
    assert_eq!((c.lora.rank, c.lora.alpha), (16, 1.0));
    let c =
        TrainConfig::from_toml_str("save_model_as = \"safetensors\"\nnetwork_alpha = 8\n").unwrap();
    assert_eq!((c.lora.rank, c.lora.alpha), (4, 8.0));
    // a config of this SDK's own names keeps its defaults (PEFT's r8 α8)
    let c = TrainConfig::from_yaml_str("lora: {dropout: 0.1}\n").unwrap();
    assert_eq!((c.lora.rank, c.lora.alpha), (8, 8.0));
}

#[test]
fn a_gui_flux_config_reads_its_flux_tab() {
    // the kohya_ss GUI's FLUX.1 LoRA: LoRA_type Flux1 with the FLUX tab's fields
    let text = std::fs::read_to_string(fixture("kohya_ss_gui_locon.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["LoRA_type"] = serde_json::Value::from("Flux1");
    v["flux1_checkbox"] = serde_json::Value::Bool(true);
    v["fp8_base"] = serde_json::Value::Bool(true);
    v["blocks_to_swap"] = serde_json::Value::from(16);
    v["timestep_sampling"] = serde_json::Value::from("flux_shift");
    v["discrete_flow_shift"] = serde_json::Value::from(3.1582);
    v["guidance_scale"] = serde_json::Value::from(1.0);
    v["model_prediction_type"] = serde_json::Value::from("raw");
    v["t5xxl"] = serde_json::Value::from("models/t5xxl_fp16.safetensors");
    v["clip_l"] = serde_json::Value::from("models/clip_l.safetensors");
    v["ae"] = serde_json::Value::from("models/ae.safetensors");
    let c = TrainConfig::from_json_str(&v.to_string()).unwrap();
    assert_eq!(c.model.kind, ModelKind::Flux);
    assert_eq!(c.lora.network_module.as_deref(), Some("networks.lora_flux"));
    assert!(c.flux.fp8_base);
    assert_eq!(c.flux.blocks_to_swap, 16);
    assert_eq!(
        c.flux.timestep_sampling,
        lora_train::config::TimestepSampling::FluxShift
    );
    assert_eq!(c.flux.discrete_flow_shift, 3.1582);
    assert_eq!(
        c.flux.model_prediction_type,
        lora_train::config::ModelPredictionType::Raw
    );
    assert_eq!(
        c.flux.t5xxl.as_deref(),
        Some("models/t5xxl_fp16.safetensors")
    );
    assert_eq!(c.flux.clip_l.as_deref(), Some("models/clip_l.safetensors"));
    assert_eq!(c.flux.ae.as_deref(), Some("models/ae.safetensors"));
    // a wrong value names its key
    v["timestep_sampling"] = serde_json::Value::from("sideways");
    let msg = TrainConfig::from_json_str(&v.to_string())
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("timestep_sampling") && msg.contains("flux_shift"),
        "{msg}"
    );
}

#[test]
fn every_gui_field_set_is_honored_or_warned() {
    let text = std::fs::read_to_string(fixture("kohya_ss_gui_locon.json")).unwrap();
    let base: serde_json::Value = serde_json::from_str(&text).unwrap();
    let base_cfg = TrainConfig::from_json_str(&text).unwrap();
    let fields: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    let mut checked = 0;
    for field in fields {
        let value = &base[&field];
        // a value that asks for something, of the field's own type
        let set = match value {
            serde_json::Value::Bool(false) => serde_json::Value::Bool(true),
            serde_json::Value::Number(n) if n.as_f64() == Some(0.0) => serde_json::json!(3),
            _ => continue, // already set in the fixture: covered by the load above
        };
        if field.ends_with("_checkbox") || field == "sdxl" {
            continue; // model families: an error or a model kind, tested above
        }
        let mut v = base.clone();
        v[&field] = set.clone();
        let mut read = TrainConfig::from_json_str(&v.to_string());
        if let Err(ConfigError::InvalidValue { expected, .. }) = &read
            && expected.contains("[0,")
        {
            // a probability: ask with one
            v[&field] = serde_json::json!(0.25);
            read = TrainConfig::from_json_str(&v.to_string());
        }
        let set = v[&field].clone();
        let cfg = match read {
            Ok(c) => c,
            // kohya refuses full fp16 under bf16 mixed precision too
            Err(e) if field == "full_fp16" => {
                let msg = e.to_string();
                assert!(msg.contains("full_fp16") && msg.contains("bf16"), "{msg}");
                continue;
            }
            Err(e) => panic!("GUI field `{field}` = {set}: {e}"),
        };
        let warned = cfg.warnings.0.len() > base_cfg.warnings.0.len();
        let changed =
            serde_json::to_value(&cfg).unwrap() != serde_json::to_value(&base_cfg).unwrap();
        let other_family = [
            "flux",
            "sd3",
            "t5",
            "clip_",
            "blocks_to_swap",
            "ae",
            "guidance",
            "discrete_flow",
            "model_prediction",
            "timestep_sampling",
            "weighting",
            "logit_",
            "mode_scale",
            "apply_t5",
            "save_t5",
            "save_clip",
            "fused_optimizer",
            "blockwise",
            "mem_eff_save",
            "split_mode",
            "train_blocks",
            "double_blocks",
            "single_blocks",
        ]
        .iter()
        .any(|p| field.starts_with(p));
        // asks for what the run does already: latents cached (on disk here) by `cache_latents`
        let already = field == "cache_latents_to_disk" && base_cfg.data.cache_latents == Some(true);
        assert!(
            changed || warned || other_family || already,
            "GUI field `{field}` = {set} was dropped: no setting changed and no warning"
        );
        checked += 1;
    }
    assert!(checked > 60, "{checked}");
}

#[test]
fn optimizer_and_schedule_arguments_reach_the_engine_and_unknown_names_are_errors() {
    use lora_train::config::SchedulerKind;
    use lora_train::engine::optim::{AdafactorConfig, AdamWConfig, OptimizerKind};
    let cfg = TrainConfig::from_toml_str(
        "optimizer_type = \"AdamW\"\noptimizer_args = [\"weight_decay=0.05\", \"betas=(0.9,0.99)\", \"eps=1e-6\"]\n",
    )
    .unwrap();
    let (opt, _) = cfg.optimizer_and_schedule().unwrap();
    assert_eq!(
        opt,
        OptimizerKind::AdamW(AdamWConfig {
            betas: (0.9, 0.99),
            eps: 1e-6,
            weight_decay: 0.05,
        })
    );
    // kohya's usual Adafactor line, as the GUI's text box holds it
    let cfg = TrainConfig::from_json_str(
        r#"{"LoRA_type": "Standard", "optimizer": "Adafactor",
            "optimizer_args": "scale_parameter=False relative_step=False warmup_init=False"}"#,
    )
    .unwrap();
    let (opt, _) = cfg.optimizer_and_schedule().unwrap();
    assert_eq!(
        opt,
        OptimizerKind::Adafactor(AdafactorConfig {
            scale_parameter: false,
            relative_step: false,
            warmup_init: false,
            ..AdafactorConfig::default()
        })
    );
    let e = TrainConfig::from_toml_str("optimizer_args = [\"amsgrad=True\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.optimizer_args") && e.contains("amsgrad") && e.contains("betas"),
        "{e}"
    );
    let cfg = TrainConfig::from_toml_str(
        "lr_scheduler = \"cosine_with_restarts\"\nlr_scheduler_args = [\"num_cycles=4\"]\n",
    )
    .unwrap();
    let (_, sched) = cfg.optimizer_and_schedule().unwrap();
    assert_eq!(sched, SchedulerKind::CosineWithRestarts { num_cycles: 4.0 });
    let e = TrainConfig::from_toml_str("lr_scheduler_args = [\"num_cycles=4\"]\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("lr_scheduler_args") && e.contains("constant"),
        "{e}"
    );
}

#[test]
fn image_only_keys_in_a_language_model_run_are_named_in_its_plan() {
    let gguf = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        gguf.exists(),
        "{} missing: run `cargo xtask setup`",
        gguf.display()
    );
    let toml = format!(
        "pretrained_model_name_or_path = {:?}\nnetwork_dim = 8\nunet_lr = 1e-4\ntext_encoder_lr = 5e-5\nnetwork_args = [\"conv_dim=4\", \"conv_alpha=1\"]\nflip_aug = true\nmin_snr_gamma = 5.0\n",
        gguf.display().to_string()
    );
    let c = TrainConfig::from_toml_str(&toml).unwrap();
    let keys: Vec<&str> = c.image_only_settings().iter().map(|k| k.0).collect();
    for k in [
        "lora.conv_rank",
        "lora.conv_alpha",
        "data.flip_aug",
        "train.unet_lr",
        "train.text_encoder_lr",
        "train.min_snr_gamma",
        // a text-encoder rate > 0 trains the text encoders, as in kohya
        "train.train_text_encoder",
    ] {
        assert!(keys.contains(&k), "{k} not listed: {keys:?}");
    }
    let plan = lora_train::llm::plan(&c, None, None, false).unwrap();
    let noted = |key: &str, value: &str| {
        plan.notes
            .iter()
            .any(|n| n.starts_with(&format!("`{key}` = {value}:")) && n.contains("image models"))
    };
    assert!(noted("train.unet_lr", "0.0001"), "{:#?}", plan.notes);
    assert!(noted("lora.conv_rank", "4"), "{:#?}", plan.notes);
    assert!(
        noted("train.text_encoder_lr", "[0.00005]"),
        "{:#?}",
        plan.notes
    );
    // an LLM config of ours sets none of them
    let ours = TrainConfig::from_file(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/smollm2-shakespeare.yaml"),
    )
    .unwrap();
    assert_eq!(ours.image_only_settings(), vec![]);
}
