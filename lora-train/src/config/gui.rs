//! The kohya_ss GUI's saved configs: the JSON its "Save config" button writes (every field of
//! the LoRA tab, numbers often as strings, `""` and `0` for "not set"), mapped onto kohya
//! sd-scripts' argument names the way the GUI itself maps them when it writes the TOML it hands
//! to `train_network.py` (`kohya_gui/lora_gui.py`, `train_model`). The result is read like any
//! kohya config.

use serde_json::{Map, Value};

use super::kohya::{ConfigWarnings, is_off};
use super::{ConfigError, Result};

/// Whether a JSON document is a kohya_ss GUI config rather than one of ours in JSON form.
pub(super) fn is_gui_config(map: &Map<String, Value>) -> bool {
    [
        "LoRA_type",
        "max_resolution",
        "model_list",
        "additional_parameters",
    ]
    .iter()
    .any(|k| map.contains_key(*k))
}

/// GUI fields whose `0` means "not set" (the GUI writes `None` for them).
const ZERO_IS_UNSET: &[&str] = &[
    "discrete_flow_shift",
    "logit_std",
    "guidance_scale",
    "t5xxl_max_token_length",
    "max_train_epochs",
    "max_train_steps",
    "seed",
    "min_snr_gamma",
    "save_every_n_epochs",
    "save_every_n_steps",
    "save_last_n_steps",
    "save_last_n_steps_state",
    "save_last_n_epochs",
    "save_last_n_epochs_state",
    "sample_every_n_steps",
    "sample_every_n_epochs",
    "max_timestep",
    "min_timestep",
    "noise_offset",
    "multires_noise_iterations",
    "adaptive_noise_scale",
    "ip_noise_gamma",
    "v_pred_like_loss",
    "vae_batch_size",
    "clip_skip",
    "unet_lr",
    "text_encoder_lr",
    "stop_text_encoder_training",
    "scale_weight_norms",
    "caption_dropout_every_n_epochs",
    "lr_warmup_steps",
    "lr_scheduler_num_cycles",
    "lr_scheduler_power",
    "max_token_length",
];

/// GUI fields that feed kohya's `network_args` (the GUI builds that list from them).
const TO_NETWORK_ARGS: &[&str] = &[
    "down_lr_weight",
    "mid_lr_weight",
    "up_lr_weight",
    "block_lr_zero_threshold",
    "block_dims",
    "block_alphas",
    "conv_block_dims",
    "conv_block_alphas",
    "rank_dropout",
    "module_dropout",
    "loraplus_lr_ratio",
    "loraplus_unet_lr_ratio",
    "loraplus_text_encoder_lr_ratio",
    "train_norm",
    "use_tucker",
    "use_scalar",
    "rank_dropout_scale",
    "factor",
    "decompose_both",
    "bypass_mode",
    "dora_wd",
    "use_cp",
    "LyCORIS_preset",
];

const LAUNCHER: &str = "an `accelerate launch` setting; lora-train runs in this process";
/// Fields of other model families' tabs: read silently (their tab's checkbox, when on, is an
/// error).
const OTHER_MODEL: &str = "a setting of another model family's tab (FLUX.1, SD3, Lumina, …)";
const OTHER_TAB: &str = "a setting of the GUI's DreamBooth / fine-tuning tabs";

/// GUI fields that are not sd-scripts arguments and change nothing here, with why.
const GUI_NO_EFFECT: &[(&str, &str)] = &[
    (
        "model_list",
        "the GUI's model drop-down; `pretrained_model_name_or_path` names the model",
    ),
    ("num_processes", LAUNCHER),
    ("num_machines", LAUNCHER),
    ("multi_gpu", LAUNCHER),
    ("gpu_ids", LAUNCHER),
    ("main_process_port", LAUNCHER),
    ("extra_accelerate_launch_args", LAUNCHER),
    ("dynamo_mode", LAUNCHER),
    ("dynamo_use_fullgraph", LAUNCHER),
    ("dynamo_use_dynamic", LAUNCHER),
    ("learning_rate_te", OTHER_TAB),
    ("learning_rate_te1", OTHER_TAB),
    ("learning_rate_te2", OTHER_TAB),
    ("no_token_padding", OTHER_TAB),
    ("save_as_bool", OTHER_TAB),
    (
        "stop_text_encoder_training",
        "stopping the text encoders' training part-way is not implemented",
    ),
    ("mem_eff_save", OTHER_MODEL),
    ("train_blocks", OTHER_MODEL),
    ("split_mode", OTHER_MODEL),
    ("blocks_to_swap", OTHER_MODEL),
    ("single_blocks_to_swap", OTHER_MODEL),
    ("double_blocks_to_swap", OTHER_MODEL),
    ("guidance_scale", OTHER_MODEL),
    ("discrete_flow_shift", OTHER_MODEL),
    ("model_prediction_type", OTHER_MODEL),
    ("timestep_sampling", OTHER_MODEL),
    ("weighting_scheme", OTHER_MODEL),
    ("logit_mean", OTHER_MODEL),
    ("logit_std", OTHER_MODEL),
    ("mode_scale", OTHER_MODEL),
    ("apply_t5_attn_mask", OTHER_MODEL),
    ("t5xxl", OTHER_MODEL),
    ("t5xxl_device", OTHER_MODEL),
    ("t5xxl_dtype", OTHER_MODEL),
    ("t5xxl_max_token_length", OTHER_MODEL),
    ("save_t5xxl", OTHER_MODEL),
    ("save_clip", OTHER_MODEL),
    ("clip_l", OTHER_MODEL),
    ("clip_g", OTHER_MODEL),
    ("ae", OTHER_MODEL),
    ("fused_optimizer_groups", OTHER_MODEL),
    ("blockwise_fused_optimizers", OTHER_MODEL),
    ("unit", "used only by DyLoRA"),
    ("constrain", "used only by LyCORIS OFT"),
    ("rescaled", "used only by LyCORIS OFT"),
    ("train_on_input", "used only by LyCORIS IA3"),
];

/// The FLUX.1 tab's fields a FLUX config (`flux1_checkbox`, `LoRA_type: Flux1`) passes on
/// under their sd-scripts names (the `flux.*` keys).
const FLUX_FIELDS: &[&str] = &[
    "blocks_to_swap",
    "guidance_scale",
    "discrete_flow_shift",
    "model_prediction_type",
    "timestep_sampling",
    "logit_mean",
    "logit_std",
    "apply_t5_attn_mask",
    "t5xxl",
    "t5xxl_max_token_length",
    "clip_l",
    "ae",
];

/// FLUX tab fields that become `networks.lora_flux` network arguments (`all` is the default
/// and is not passed).
const FLUX_NETWORK_ARGS: &[&str] = &[
    "train_blocks",
    "train_double_block_indices",
    "train_single_block_indices",
];

/// GUI field-name prefixes of other model families' tabs.
const OTHER_MODEL_PREFIXES: &[&str] = &[
    "flux1_", "flux_", "sd3_", "lumina_", "anima_", "hunyuan_", "chroma_",
];

/// `LoRA_type` values and what they are in sd-scripts' terms: the network module and the
/// `algo` network argument (LyCORIS), or `None` for types this SDK cannot train.
fn lora_type(kind: &str) -> Option<(&'static str, Option<&'static str>, bool)> {
    // (network_module, algo, uses conv_dim/conv_alpha)
    match kind {
        "Standard" => Some(("networks.lora", None, false)),
        "Kohya LoCon" => Some(("networks.lora", None, true)),
        "LyCORIS/LoCon" => Some(("lycoris.kohya", Some("locon"), true)),
        "Flux1" => Some(("networks.lora_flux", None, false)),
        _ => None,
    }
}

/// Maps a kohya_ss GUI config onto sd-scripts' argument names.
///
/// # Errors
/// [`ConfigError::InvalidValue`] for a `LoRA_type` this SDK does not train, naming the value.
pub(super) fn to_kohya(
    gui: &Map<String, Value>,
    warnings: &mut ConfigWarnings,
) -> Result<Map<String, Value>> {
    let mut out = Map::new();
    let mut network_args: Vec<String> = Vec::new();
    let get = |k: &str| gui.get(k).filter(|v| !is_blank(v));
    let num = |k: &str| get(k).and_then(as_f64);

    for family in [
        "sd3_checkbox",
        "lumina_checkbox",
        "anima_checkbox",
        "hunyuan_image_checkbox",
    ] {
        if let Some(v) = gui.get(family)
            && v.as_bool() == Some(true)
        {
            return Err(ConfigError::InvalidValue {
                key: family.into(),
                value: "true".into(),
                expected: "false: this SDK trains LoRA for Stable Diffusion 1.x/2.x/XL, FLUX.1 \
                           and LLMs; SD3 and the GUI's other model families are not supported yet"
                    .into(),
            });
        }
    }
    let flux = gui.get("flux1_checkbox").and_then(Value::as_bool) == Some(true)
        || gui.get("LoRA_type").and_then(Value::as_str) == Some("Flux1");
    if flux {
        out.insert("model.kind".into(), Value::from("flux"));
    }
    if let Some(kind_v) = gui.get("LoRA_type") {
        let kind = kind_v.as_str().unwrap_or_default();
        let Some((module, algo, conv)) = lora_type(kind) else {
            return Err(ConfigError::InvalidValue {
                key: "LoRA_type".into(),
                value: format!("{kind:?}"),
                expected:
                    "\"Standard\", \"Kohya LoCon\", \"LyCORIS/LoCon\" or \"Flux1\": this SDK \
                           trains LoRA and LoCon; LoHa, LoKr, IA3, DyLoRA, GLoRA, OFT, LoRA-FA and \
                           other model families' LoRA types are not supported yet"
                        .into(),
            });
        };
        out.insert("network_module".into(), Value::from(module));
        if let Some(a) = algo {
            network_args.push(format!("algo={a}"));
        }
        if conv {
            for (k, arg) in [("conv_dim", "conv_dim"), ("conv_alpha", "conv_alpha")] {
                if let Some(x) = num(k).filter(|x| *x > 0.0) {
                    network_args.push(format!("{arg}={x}"));
                }
            }
        }
    }
    // the FLUX tab's block selection goes into network_args, as the GUI passes it to
    // sd-scripts' networks.lora_flux
    if flux {
        for k in FLUX_NETWORK_ARGS {
            if let Some(Value::String(t)) = get(k) {
                let t = t.trim();
                if !t.is_empty() && !t.eq_ignore_ascii_case("all") {
                    network_args.push(format!("{k}={}", t.replace(' ', "")));
                }
            }
        }
    }
    for k in TO_NETWORK_ARGS {
        if let Some(v) = get(k).filter(|v| !is_off(v)) {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            let arg = if *k == "LyCORIS_preset" { "preset" } else { k };
            network_args.push(format!("{arg}={}", text.replace(' ', "")));
        }
    }

    // noise: the GUI keeps the fields of both kinds and sends those of the chosen one
    let noise = gui
        .get("noise_offset_type")
        .and_then(Value::as_str)
        .unwrap_or("Original");
    // warmup: steps when given, else the percentage of the steps
    let warmup_steps = num("lr_warmup_steps").unwrap_or(0.0);
    if warmup_steps > 0.0 {
        out.insert("lr_warmup_steps".into(), Value::from(warmup_steps));
    } else if let Some(p) = num("lr_warmup").filter(|p| *p > 0.0 && *p < 100.0) {
        out.insert("lr_warmup_steps".into(), Value::from(p / 100.0));
    }

    for (k, v) in gui {
        if is_blank(v) {
            continue;
        }
        let k = k.as_str();
        match k {
            "LoRA_type" | "conv_dim" | "conv_alpha" | "lr_warmup" | "lr_warmup_steps"
            | "noise_offset_type" => continue,
            _ if TO_NETWORK_ARGS.contains(&k) => continue,
            "noise_offset" | "adaptive_noise_scale" | "noise_offset_random_strength"
                if noise != "Original" =>
            {
                if !is_off(v) && k != "multires_noise_discount" {
                    warnings.push(k, v, format!("sent only with noise_offset_type \"Original\" (this config chooses {noise:?}), as the GUI does"));
                }
                continue;
            }
            "multires_noise_iterations" | "multires_noise_discount" if noise != "Multires" => {
                if !is_off(v) && k != "multires_noise_discount" {
                    warnings.push(k, v, format!("sent only with noise_offset_type \"Multires\" (this config chooses {noise:?}), as the GUI does"));
                }
                continue;
            }
            _ => {}
        }
        if ZERO_IS_UNSET.contains(&k) && as_f64(v) == Some(0.0) {
            continue;
        }
        match k {
            "epoch" => {
                out.insert("epoch".into(), v.clone());
            }
            "max_resolution" => {
                out.insert("resolution".into(), v.clone());
            }
            "optimizer" => {
                out.insert("optimizer_type".into(), v.clone());
            }
            "lora_network_weights" => {
                out.insert("network_weights".into(), v.clone());
            }
            "sdxl" => {
                if v.as_bool() == Some(true) {
                    out.insert("model.kind".into(), Value::from("sdxl"));
                }
            }
            "sdxl_no_half_vae" => {
                out.insert("no_half_vae".into(), v.clone());
            }
            "sdxl_cache_text_encoder_outputs" => {
                out.insert("cache_text_encoder_outputs".into(), v.clone());
            }
            "xformers" => match v.as_str().map(str::to_ascii_lowercase).as_deref() {
                Some("xformers") => {
                    out.insert("xformers".into(), Value::Bool(true));
                }
                Some("sdpa") => {
                    out.insert("sdpa".into(), Value::Bool(true));
                }
                Some("none") => {}
                _ => {
                    out.insert("xformers".into(), v.clone());
                }
            },
            "use_wandb" => {
                if v.as_bool() == Some(true) {
                    out.insert("log_with".into(), Value::from("wandb"));
                }
            }
            "num_cpu_threads_per_process" => {
                out.insert("system.num_threads".into(), v.clone());
            }
            "sample_prompts" => {
                // the GUI's text box: one prompt per line, kohya's per-line options allowed
                let lines: Vec<Value> = v
                    .as_str()
                    .unwrap_or_default()
                    .lines()
                    .map(str::trim)
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(Value::from)
                    .collect();
                if !lines.is_empty() {
                    out.insert("logging.sample_prompts".into(), Value::Array(lines));
                }
            }
            "additional_parameters" => {} // after the fields: the command line wins
            _ if flux && FLUX_NETWORK_ARGS.contains(&k) => {}
            _ if flux && FLUX_FIELDS.contains(&k) => {
                out.insert(k.to_string(), v.clone());
            }
            _ => {
                if let Some(reason) = GUI_NO_EFFECT
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, r)| *r)
                    .or_else(|| {
                        OTHER_MODEL_PREFIXES
                            .iter()
                            .any(|p| k.starts_with(p))
                            .then_some(OTHER_MODEL)
                    })
                {
                    if !is_off(v) && reason != OTHER_MODEL {
                        warnings.push(k, v, reason);
                    }
                } else {
                    out.insert(k.to_string(), v.clone());
                }
            }
        }
    }
    // the GUI puts these after `--config_file`: sd-scripts reads them over the file's values
    if let Some(v) = get("additional_parameters") {
        for (name, value) in command_line(v.as_str().unwrap_or_default()) {
            out.insert(name, value);
        }
    }
    if !network_args.is_empty() {
        out.insert(
            "network_args".into(),
            Value::Array(network_args.into_iter().map(Value::from).collect()),
        );
    }
    // keys written as dotted paths above are nested the way the sections read them
    Ok(nest(out))
}

/// `""` and `null`: a GUI field left empty.
fn is_blank(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.trim().is_empty(),
        _ => false,
    }
}

/// A number, or a string holding one (the GUI writes both).
fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// `--name value` / `--flag` pairs of the GUI's "additional parameters" box.
fn command_line(text: &str) -> Vec<(String, Value)> {
    let words: Vec<&str> = text.split_whitespace().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < words.len() {
        if let Some(name) = words[i].strip_prefix("--") {
            if let Some((n, v)) = name.split_once('=') {
                out.push((n.to_string(), super::keys::python_literal(v)));
                i += 1;
                continue;
            }
            let mut values = Vec::new();
            let mut j = i + 1;
            while j < words.len() && !words[j].starts_with("--") {
                values.push(super::keys::python_literal(words[j]));
                j += 1;
            }
            let value = match values.len() {
                0 => Value::Bool(true),
                1 => values.remove(0),
                _ => Value::Array(values),
            };
            out.push((name.to_string(), value));
            i = j;
        } else {
            i += 1;
        }
    }
    out
}

/// Turns `a.b` keys into nested mappings.
fn nest(flat: Map<String, Value>) -> Map<String, Value> {
    let mut out = Map::new();
    for (k, v) in flat {
        match k.split_once('.') {
            Some((section, rest)) => {
                let entry = out
                    .entry(section.to_string())
                    .or_insert_with(|| Value::Object(Map::new()));
                if let Value::Object(m) = entry {
                    m.insert(rest.to_string(), v);
                }
            }
            None => {
                out.insert(k, v);
            }
        }
    }
    out
}
