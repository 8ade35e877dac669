//! kohya sd-scripts' arguments that this SDK reads without acting on them, each with the reason
//! a user sees, and the warnings those reads leave on the config.
//!
//! Every argument of `train_network.py` / `sdxl_train_network.py` is either a spelling of a
//! section key (read and honored), one of the transformed spellings read in
//! [`TrainConfig::from_value`](super::TrainConfig::from_value) (`v_parameterization`,
//! `network_args`, …), or listed in [`NO_EFFECT`]: accepted, with one warning line when its value
//! asks for something (`xformers: true`), silent when it is off (`false`, `0`, `""`). A real kohya
//! key is never an unknown-key error and never dropped without a word.

use serde_json::Value;
use std::fmt;

/// A kohya key that was read but changes nothing here, with why.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigWarning {
    /// The key as written (`xformers`).
    pub key: String,
    /// Its value (JSON rendering).
    pub value: String,
    /// What happens instead, and why.
    pub reason: String,
}

impl fmt::Display for ConfigWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "`{}` = {}: {}", self.key, self.value, self.reason)
    }
}

/// The warnings of a config as read. They describe how the file was written, not the settings,
/// so they take no part in comparing two configs (`==` ignores them).
#[derive(Debug, Clone, Default)]
pub struct ConfigWarnings(pub Vec<ConfigWarning>);

impl PartialEq for ConfigWarnings {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl ConfigWarnings {
    /// Adds a warning for `key` written as `value`.
    pub(super) fn push(&mut self, key: &str, value: &Value, reason: impl Into<String>) {
        self.0.push(ConfigWarning {
            key: key.to_string(),
            value: super::keys::render(value),
            reason: reason.into(),
        });
    }
}

/// Whether a value leaves a kohya option off (`false`, `0`, `""`, `[]`, `"no"`, `"none"`): the
/// option then asks for nothing and is read silently.
pub(super) fn is_off(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Bool(true) => false,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => {
            let s = s.trim().to_ascii_lowercase();
            s.is_empty() || s == "no" || s == "none" || s == "false" || s == "0"
        }
        Value::Array(a) => a.is_empty(),
        Value::Object(m) => m.is_empty(),
    }
}

const ATTENTION: &str = "attention always runs through PyTorch's scaled_dot_product_attention (memory-efficient \
     kernels where the device has them)";
const LOGGING: &str = "lora-train prints its own progress and warnings to the terminal";
const HUB: &str = "nothing is uploaded or downloaded; the output stays in train.output_dir";
const DDP: &str = "training runs in one process; multi-process data-parallel settings do not apply";
const DEEPSPEED: &str = "DeepSpeed is not used; the memory plan covers optimizer state in-process";
const CACHE_TE: &str = "text-encoder outputs are cached automatically when `cache_latents` is on, \
                        the text encoders are frozen and captions do not change between epochs";
const TRACKERS: &str =
    "only TensorBoard logging is available (`logging_dir` / `log_with = \"tensorboard\"`)";
const NOT_YET: &str = "not implemented here yet: training runs without it";
const METADATA: &str = "not written into the adapter's metadata yet";
const LOADER: &str = "lora-data does not implement it: training runs without it";
const FLUX_TRAIN: &str = "SD3-style loss weighting is not implemented for FLUX here: σ is drawn by `timestep_sampling` and the loss is unweighted";

/// kohya arguments (and keys the kohya_ss GUI writes into the TOML it passes to sd-scripts)
/// that are accepted but change nothing here, with the reason shown when their value is not off.
pub(super) const NO_EFFECT: &[(&str, &str)] = &[
    // logging to the console
    ("console_log_level", LOGGING),
    ("console_log_file", LOGGING),
    ("console_log_simple", LOGGING),
    // the model
    (
        "v2",
        "the model version is read from the model's own files (SD 2.x: cross_attention_dim 1024)",
    ),
    (
        "tokenizer_cache_dir",
        "tokenizers are read from the model folder or `model.tokenizer`",
    ),
    (
        "vae",
        "the VAE of the base model is used; a separate VAE file is not loaded",
    ),
    (
        "no_half_vae",
        "the VAE keeps the base model's dtype; fp32 latents are used for training",
    ),
    (
        "disable_mmap_load_safetensors",
        "weights are always memory-mapped and copied once",
    ),
    (
        "lowram",
        "weights are memory-mapped; the memory plan sizes the run",
    ),
    (
        "highvram",
        "frozen models move off the device by the memory plan",
    ),
    // flux_train_network.py
    (
        "split_mode",
        "deprecated in sd-scripts, where it means blocks_to_swap 18: set blocks_to_swap",
    ),
    ("weighting_scheme", FLUX_TRAIN),
    ("mode_scale", FLUX_TRAIN),
    (
        "text_encoder_batch_size",
        "text-encoder outputs are computed caption by caption before training",
    ),
    // SAI model-spec metadata
    ("metadata_title", METADATA),
    ("metadata_author", METADATA),
    ("metadata_description", METADATA),
    ("metadata_license", METADATA),
    ("metadata_tags", METADATA),
    ("metadata_usage_hint", METADATA),
    ("metadata_thumbnail", METADATA),
    ("metadata_merged_from", METADATA),
    ("metadata_trigger_phrase", METADATA),
    ("metadata_preprocessor", METADATA),
    ("metadata_is_negative_embedding", METADATA),
    ("training_comment", METADATA),
    (
        "no_metadata",
        "the adapter's metadata (network dim/alpha, base model version) is always written",
    ),
    // the dataset
    (
        "cache_info",
        "image sizes are read from the files' headers each run",
    ),
    ("keep_tokens_separator", LOADER),
    ("secondary_separator", LOADER),
    ("enable_wildcard", LOADER),
    ("color_aug", LOADER),
    ("face_crop_aug_range", LOADER),
    ("bucket_no_upscale", LOADER),
    ("token_warmup_min", LOADER),
    ("token_warmup_step", LOADER),
    ("alpha_mask", LOADER),
    ("caption_dropout_every_n_epochs", LOADER),
    (
        "debug_dataset",
        "use `lora-train plan` to see the buckets and batches",
    ),
    (
        "resize_interpolation",
        "images are resized with a Lanczos filter",
    ),
    (
        "dataset_class",
        "custom Python dataset classes cannot be loaded",
    ),
    (
        "in_json",
        "kohya fine-tuning metadata files are not read: use image folders with caption files",
    ),
    (
        "dataset_repeats",
        "repeats come from the folder names (`10_name`) or `num_repeats` in a dataset TOML",
    ),
    (
        "conditioning_data_dir",
        "ControlNet conditioning images are not used by LoRA training",
    ),
    ("masked_loss", NOT_YET),
    (
        "vae_batch_size",
        "latents are encoded one image at a time, which the memory plan counts",
    ),
    (
        "skip_cache_check",
        "disk caches are always checked against the images",
    ),
    ("cache_text_encoder_outputs", CACHE_TE),
    ("cache_text_encoder_outputs_to_disk", CACHE_TE),
    (
        "weighted_captions",
        "caption weights `(word:1.2)` are read as plain text",
    ),
    // uploads
    ("huggingface_repo_id", HUB),
    ("huggingface_repo_type", HUB),
    ("huggingface_path_in_repo", HUB),
    ("huggingface_token", HUB),
    ("huggingface_repo_visibility", HUB),
    ("save_state_to_huggingface", HUB),
    ("resume_from_huggingface", HUB),
    ("async_upload", HUB),
    // saving
    (
        "save_n_epoch_ratio",
        "use `save_every_n_epochs` or `save_every_n_steps`",
    ),
    (
        "save_state",
        "a resume checkpoint is written at every save (`save_every_n_steps` / `save_every_n_epochs`)",
    ),
    (
        "save_state_on_train_end",
        "the final adapter is written at the end; resume checkpoints are written at every save",
    ),
    (
        "save_last_n_epochs_state",
        "resume checkpoints kept: `train.keep_last_checkpoints` (default 3)",
    ),
    (
        "resume",
        "resume with `lora-train train --resume [checkpoint]`",
    ),
    // speed switches of other stacks
    ("mem_eff_attn", ATTENTION),
    ("xformers", ATTENTION),
    (
        "sdpa",
        "attention always runs through PyTorch's scaled_dot_product_attention",
    ),
    (
        "torch_compile",
        "there is no TorchDynamo in a native trainer",
    ),
    (
        "dynamo_backend",
        "there is no TorchDynamo in a native trainer",
    ),
    (
        "cpu_offload_checkpointing",
        "activations are not offloaded; the memory plan counts them on the device",
    ),
    (
        "fused_backward_pass",
        "optimizer steps run after the backward pass; the plan counts the gradients",
    ),
    // processes
    ("ddp_timeout", DDP),
    ("ddp_gradient_as_bucket_view", DDP),
    ("ddp_static_graph", DDP),
    ("deepspeed", DEEPSPEED),
    ("zero_stage", DEEPSPEED),
    ("offload_optimizer_device", DEEPSPEED),
    ("offload_optimizer_nvme_path", DEEPSPEED),
    ("offload_param_device", DEEPSPEED),
    ("offload_param_nvme_path", DEEPSPEED),
    ("zero3_init_flag", DEEPSPEED),
    ("zero3_save_16bit_model", DEEPSPEED),
    ("fp16_master_weights_and_gradients", DEEPSPEED),
    // trackers
    ("log_tracker_name", TRACKERS),
    ("wandb_run_name", TRACKERS),
    ("log_tracker_config", TRACKERS),
    ("wandb_api_key", TRACKERS),
    (
        "log_config",
        "the resolved config is stored in every checkpoint (`run_config` in its state)",
    ),
    // noise and loss variants
    ("noise_offset_random_strength", NOT_YET),
    ("ip_noise_gamma", NOT_YET),
    ("ip_noise_gamma_random_strength", NOT_YET),
    ("adaptive_noise_scale", NOT_YET),
    ("zero_terminal_snr", NOT_YET),
    (
        "loss_type",
        "the loss is the mean squared error (kohya's l2); l1 / huber / smooth_l1 are not implemented",
    ),
    ("huber_schedule", "used only by loss_type huber / smooth_l1"),
    ("huber_c", "used only by loss_type huber / smooth_l1"),
    ("huber_scale", "used only by loss_type huber / smooth_l1"),
    ("scale_v_pred_loss_like_noise_pred", NOT_YET),
    ("v_pred_like_loss", NOT_YET),
    ("debiased_estimation_loss", NOT_YET),
    (
        "prior_loss_weight",
        "regularization images are weighted like training images (weight 1.0)",
    ),
    // sampling
    (
        "sample_at_first",
        "a sample grid is written before training starts whenever samples are on",
    ),
    ("sample_every_n_epochs", "use `sample_every_n_steps`"),
    // the config file itself
    ("config_file", "this file is the config"),
    (
        "output_config",
        "the resolved config is stored in every checkpoint (`run_config` in its state)",
    ),
    // optimizer and schedule extras
    (
        "use_lion_optimizer",
        "Lion is not available: `optimizer_type` chooses the optimizer (AdamW, AdamW8bit, Adafactor, SGD, SGDNesterov)",
    ),
    (
        "lr_scheduler_type",
        "custom scheduler classes cannot be loaded: `lr_scheduler` chooses the schedule",
    ),
    (
        "lr_decay_steps",
        "used only by kohya's warmup-stable-decay schedule, which is not implemented",
    ),
    (
        "lr_scheduler_timescale",
        "used only by kohya's inverse_sqrt schedule, which is not implemented",
    ),
    (
        "lr_scheduler_min_lr_ratio",
        "used only by kohya's warmup-stable-decay schedule, which is not implemented",
    ),
    // the adapter
    (
        "network_weights",
        "an existing LoRA file is not loaded as the starting point: training starts from a fresh adapter (resume a run of this SDK with `--resume`)",
    ),
    (
        "dim_from_weights",
        "used only with `network_weights`, which is not loaded",
    ),
    ("scale_weight_norms", NOT_YET),
    (
        "base_weights",
        "merge the LoRA into the base first (`lora-train merge`) and train on the merged model",
    ),
    (
        "base_weights_multiplier",
        "merge the LoRA into the base first (`lora-train merge`) and train on the merged model",
    ),
    // resuming at a step
    (
        "skip_until_initial_step",
        "resume with `lora-train train --resume`, which restores the step exactly",
    ),
    (
        "initial_epoch",
        "resume with `lora-train train --resume`, which restores the epoch exactly",
    ),
    (
        "initial_step",
        "resume with `lora-train train --resume`, which restores the step exactly",
    ),
    // validation
    (
        "validation_seed",
        "held-out evaluation runs before and after training (`data.eval_fraction`, `train.eval_every_n_steps`)",
    ),
    (
        "validation_split",
        "held-out evaluation runs before and after training (`data.eval_fraction`, `train.eval_every_n_steps`)",
    ),
    ("validate_every_n_steps", "use `train.eval_every_n_steps`"),
    ("validate_every_n_epochs", "use `train.eval_every_n_steps`"),
    (
        "max_validation_steps",
        "held-out evaluation uses the whole held-out set",
    ),
    // keys the kohya_ss GUI writes into the TOML it hands to sd-scripts
    (
        "noise_offset_type",
        "which noise is added follows the noise keys present (`noise_offset`, `multires_noise_iterations`)",
    ),
    ("train_inpainting", NOT_YET),
    ("show_timesteps", "used only by flow-matching models"),
    (
        "show_timesteps_resolution",
        "used only by flow-matching models",
    ),
];

/// kohya values that ask for what this SDK does anyway (read silently).
const OUR_DEFAULTS: &[(&str, &str)] = &[
    ("loss_type", "l2"),
    ("huber_schedule", "snr"),
    ("huber_c", "0.1"),
    ("huber_scale", "1"),
    ("dynamo_backend", "no"),
    ("prior_loss_weight", "1"),
    ("vae_batch_size", "1"),
    ("save_model_as", "safetensors"),
];

/// Whether `v` written at `key` is one of [`OUR_DEFAULTS`].
fn is_our_default(key: &str, v: &Value) -> bool {
    let text = match v {
        Value::String(s) => s.trim().to_ascii_lowercase(),
        Value::Number(n) => n
            .as_f64()
            .map(|f| f.to_string())
            .unwrap_or_else(|| n.to_string()),
        other => other.to_string(),
    };
    OUR_DEFAULTS.iter().any(|(k, d)| *k == key && *d == text)
}

/// The reason of a [`NO_EFFECT`] key.
pub(super) fn no_effect(key: &str) -> Option<&'static str> {
    NO_EFFECT.iter().find(|(k, _)| *k == key).map(|(_, r)| *r)
}

use super::keys::{Doc, invalid, kwargs, render, typed};
use super::{ConfigError, Result, TrainConfig};

/// kohya samplers this SDK does not have, with the one it samples with instead.
const SAMPLERS: &[(&str, &str)] = &[
    ("k_euler", "euler"),
    ("euler_a", "euler"),
    ("k_euler_a", "euler"),
    ("heun", "euler"),
    ("dpm_2", "euler"),
    ("dpm_2_a", "euler"),
    ("k_dpm_2", "euler"),
    ("k_dpm_2_a", "euler"),
    ("lms", "euler"),
    ("k_lms", "euler"),
    ("pndm", "ddim"),
    ("dpmsolver", "ddim"),
    ("dpmsolver++", "ddim"),
    ("dpmsingle", "ddim"),
];

/// The spellings read here before the sections (see [`rewrite`]) and after them (see
/// [`apply`]), for the "did you mean" search.
pub(super) const SPECIAL: &[&str] = &[
    "epoch",
    "lr_warmup_steps",
    "train.lr_warmup_steps",
    "dataset_config",
    "v_parameterization",
    "full_fp16",
    "network_train_unet_only",
    "network_train_text_encoder_only",
    "save_model_as",
    "cache_latents_to_disk",
    "network_args",
    "lora.network_args",
    "save_last_n_steps_state",
];

/// Moves the entry at `path` to `to` with value `value` (what a section then reads).
fn move_entry(doc: &mut Doc, path: &str, to: &str, value: Value) {
    if let Some(e) = doc.entries.iter_mut().find(|e| e.path == path) {
        e.path = to.to_string();
        e.value = value;
    }
}

/// The entries written at any of `paths`, with their values.
fn written(doc: &Doc, paths: &[&str]) -> Vec<(String, Value)> {
    doc.entries
        .iter()
        .filter(|e| paths.contains(&e.path.as_str()))
        .map(|e| (e.path.clone(), e.value.clone()))
        .collect()
}

/// Marks the entry at `path` read.
fn mark(doc: &mut Doc, path: &str) {
    for e in doc.entries.iter_mut().filter(|e| e.path == path) {
        e.used = true;
    }
}

/// Rewrites kohya spellings whose value means another key's value, before the sections read
/// the document: `epoch` (the kohya_ss GUI's epoch count), `lr_warmup_steps` below 1 (a
/// fraction, kohya's `int_or_float`), `dataset_config`, `v_parameterization`, `full_fp16`,
/// `network_train_unet_only`, `network_train_text_encoder_only`, `save_model_as`, and samplers
/// this SDK does not have.
///
/// # Errors
/// [`ConfigError::InvalidValue`] for a value of the wrong type.
pub(super) fn rewrite(doc: &mut Doc, warnings: &mut ConfigWarnings) -> Result<()> {
    // epoch: the GUI's epoch count; `max_train_epochs` wins, as in the GUI
    if let Some((_, v)) = written(doc, &["epoch"]).pop() {
        let epochs = written(doc, &["max_train_epochs", "train.epochs"]);
        if epochs.is_empty() {
            move_entry(doc, "epoch", "train.epochs", v);
        } else {
            mark(doc, "epoch");
            if let Some((k, e)) = epochs.first()
                && *e != v
            {
                warnings.push(
                    "epoch",
                    &v,
                    format!("`{k}` = {} sets the epochs, as in kohya_ss", render(e)),
                );
            }
        }
    }
    // lr_warmup_steps: steps, or a fraction of the steps below 1
    for path in ["lr_warmup_steps", "train.lr_warmup_steps"] {
        if let Some((_, v)) = written(doc, &[path]).pop() {
            let x: f64 = typed(path, &v, "a number of steps, or a fraction below 1")?;
            if !(x >= 0.0 && x.is_finite()) {
                return Err(invalid(
                    path,
                    &v,
                    "a number of steps >= 0, or a fraction below 1",
                ));
            }
            let (to, value) = if x > 0.0 && x < 1.0 {
                ("train.warmup_ratio", Value::from(x))
            } else if x.fract() != 0.0 {
                return Err(invalid(
                    path,
                    &v,
                    "a whole number of steps, or a fraction below 1",
                ));
            } else {
                ("train.warmup_steps", Value::from(x as u64))
            };
            // the same setting written under its own name too: name both spellings
            if let Some((k, old)) = written(doc, &[to]).pop()
                && old != value
            {
                return Err(ConfigError::Conflict {
                    canonical: to.into(),
                    first_key: k,
                    first_value: render(&old),
                    second_key: path.into(),
                    second_value: render(&v),
                });
            }
            move_entry(doc, path, to, value);
        }
    }
    // dataset_config: a kohya dataset TOML; it wins over train_data_dir, as in kohya
    if let Some((_, v)) = written(doc, &["dataset_config"]).pop() {
        if super::kohya::is_off(&v) {
            mark(doc, "dataset_config");
        } else {
            for (k, old) in written(
                doc,
                &[
                    "train_data_dir",
                    "data.train_data_dir",
                    "data.path",
                    "data.train_file",
                ],
            ) {
                mark(doc, &k);
                doc.entries.retain(|e| e.path != k);
                warnings.push(
                    &k,
                    &old,
                    "`dataset_config` is given and names the images, as in kohya",
                );
            }
            move_entry(doc, "dataset_config", "data.train_data_dir", v);
        }
    }
    // flags whose value is another key's value
    let flag = |doc: &Doc, path: &str| -> Result<Option<(bool, Value)>> {
        match written(doc, &[path]).pop() {
            Some((_, v)) => Ok(Some((typed(path, &v, super::keys::BOOLEAN)?, v))),
            None => Ok(None),
        }
    };
    if let Some((on, _)) = flag(doc, "v_parameterization")? {
        if on {
            move_entry(
                doc,
                "v_parameterization",
                "train.prediction_type",
                Value::from("v_prediction"),
            );
        } else {
            mark(doc, "v_parameterization");
        }
    }
    if let Some((on, v)) = flag(doc, "full_fp16")? {
        if on {
            // kohya: "full_fp16 requires mixed_precision='fp16'"
            if let Some((k, mp)) = written(doc, &["mixed_precision", "train.mixed_precision"])
                .into_iter()
                .find(|(_, mp)| mp.as_str() != Some("fp16"))
            {
                return Err(ConfigError::Conflict {
                    canonical: "train.mixed_precision".into(),
                    first_key: k,
                    first_value: render(&mp),
                    second_key: "full_fp16".into(),
                    second_value: "true (fp16 training)".into(),
                });
            }
            move_entry(
                doc,
                "full_fp16",
                "train.mixed_precision",
                Value::from("fp16"),
            );
            warnings.push(
                "full_fp16",
                &v,
                "trains with fp16 mixed precision: the adapter stays in fp32 under fp16 autocast \
                 (an all-fp16 adapter is not supported; `full_bf16` is)",
            );
        } else {
            mark(doc, "full_fp16");
        }
    }
    if let Some((on, _)) = flag(doc, "network_train_unet_only")? {
        if on {
            move_entry(
                doc,
                "network_train_unet_only",
                "train.train_text_encoder",
                Value::Bool(false),
            );
        } else {
            mark(doc, "network_train_unet_only");
        }
    }
    if let Some((on, v)) = flag(doc, "network_train_text_encoder_only")? {
        mark(doc, "network_train_text_encoder_only");
        if on {
            warnings.push(
                "network_train_text_encoder_only",
                &v,
                "the UNet's adapter is always trained; a text-encoder-only LoRA is not supported yet",
            );
        }
    }
    // cache_latents_to_disk: the latent cache here is on disk (`<output_dir>/latent_cache`)
    // whenever latents are cached; kohya's switch turns caching on
    if let Some((on, _)) = flag(doc, "cache_latents_to_disk")? {
        let cache_written = !written(doc, &["cache_latents", "data.cache_latents"]).is_empty();
        if on && !cache_written {
            move_entry(
                doc,
                "cache_latents_to_disk",
                "data.cache_latents",
                Value::Bool(true),
            );
        } else {
            mark(doc, "cache_latents_to_disk");
        }
    }
    // a kohya config (one naming its network module or file container) takes sd-scripts'
    // defaults for what it leaves out: rank 4 and alpha 1 (`networks/lora.py`
    // `create_network`: `network_dim` None → 4, `network_alpha` None → 1.0), not this SDK's
    // PEFT-like 8 and 8 — the scale alpha/rank would otherwise differ by 8× at rank 4
    let kohya = !written(doc, &["network_module", "save_model_as"]).is_empty();
    for (spellings, canonical, value) in [
        (
            &["network_dim", "lora.rank", "lora.r", "model.lora_rank"][..],
            "lora.rank",
            Value::from(4),
        ),
        (
            &[
                "network_alpha",
                "lora.alpha",
                "lora.lora_alpha",
                "model.lora_alpha",
            ][..],
            "lora.alpha",
            Value::from(1.0),
        ),
    ] {
        if kohya && written(doc, spellings).is_empty() {
            doc.entries.push(super::keys::Entry {
                path: canonical.into(),
                value,
                used: false,
            });
        }
    }
    // sd-scripts writes one kohya-format file, `<output_name>.safetensors`: a kohya config
    // gets that unless it names our formats
    if kohya && written(doc, &["train.export_formats"]).is_empty() {
        doc.entries.push(super::keys::Entry {
            path: "train.export_formats".into(),
            value: Value::Array(vec![Value::from("kohya")]),
            used: false,
        });
    }
    if let Some((_, v)) = written(doc, &["save_model_as"]).pop() {
        mark(doc, "save_model_as");
        match v.as_str().map(str::to_ascii_lowercase).as_deref() {
            None | Some("safetensors") | Some("") => {}
            Some("ckpt" | "pt") => warnings.push(
                "save_model_as",
                &v,
                "adapters are written as .safetensors (pickled .ckpt/.pt files are not written)",
            ),
            Some(_) => {
                return Err(invalid(
                    "save_model_as",
                    &v,
                    "\"safetensors\", \"ckpt\" or \"pt\"",
                ));
            }
        }
    }
    for path in ["sample_sampler", "logging.sample_sampler"] {
        if let Some((_, v)) = written(doc, &[path]).pop()
            && let Some(s) = v.as_str()
            && let Some((_, ours)) = SAMPLERS.iter().find(|(k, _)| k.eq_ignore_ascii_case(s))
        {
            warnings.push(
                path,
                &v,
                format!("samples are drawn with {ours} (the samplers here are ddim and euler)"),
            );
            move_entry(doc, path, path, Value::from(*ours));
        }
    }
    Ok(())
}

/// Applies, after the sections read the document, the kohya keys that set several settings:
/// `network_args` (`conv_dim`/`conv_alpha` → LoCon, `algo`, LoRA+ ratios), a `text_encoder_lr`
/// above 0 (the text encoders train too), `save_last_n_steps_state`, `logging_dir` /
/// `log_with` (TensorBoard on); then accepts the [`NO_EFFECT`] keys, warning for those whose
/// value is not off.
///
/// # Errors
/// [`ConfigError::InvalidValue`] for a network argument this SDK cannot train (`algo=lokr`, …)
/// or a malformed value.
pub(super) fn apply(
    doc: &mut Doc,
    c: &mut TrainConfig,
    warnings: &mut ConfigWarnings,
    written_keys: impl Fn(&Doc, &str) -> bool,
) -> Result<()> {
    let mut algo = false;
    for path in ["network_args", "lora.network_args"] {
        let Some((_, v)) = written(doc, &[path]).pop() else {
            continue;
        };
        mark(doc, path);
        algo |= network_args(path, &v, c, warnings)?;
    }
    if c.lora.network_module.as_deref() == Some("lycoris.kohya") && !algo {
        return Err(invalid(
            "network_module",
            &Value::from("lycoris.kohya"),
            "\"networks.lora\", or \"lycoris.kohya\" with `algo=locon` in network_args",
        ));
    }
    if c.train.text_encoder_lr.iter().any(|lr| *lr > 0.0)
        && !written_keys(doc, "train.train_text_encoder")
    {
        c.train.train_text_encoder = true;
    }
    if let Some((_, v)) = written(doc, &["save_last_n_steps_state"]).pop() {
        mark(doc, "save_last_n_steps_state");
        if !is_off(&v) {
            let n: u64 = typed("save_last_n_steps_state", &v, "a positive integer")?;
            match c.train.save_every_n_steps {
                Some(every) if every > 0 => {
                    c.train.keep_last_checkpoints = u32::try_from((n / every).max(1)).unwrap_or(u32::MAX);
                }
                _ => warnings.push(
                    "save_last_n_steps_state",
                    &v,
                    "used only with `save_every_n_steps`; resume checkpoints kept: `train.keep_last_checkpoints`",
                ),
            }
        }
    }
    // kohya passes num_cycles / power to the schedules that take them and ignores them for the
    // others: say so
    for (paths, takes) in [
        (
            &["lr_scheduler_num_cycles", "train.num_cycles"][..],
            "cosine_with_restarts",
        ),
        (&["lr_scheduler_power", "train.power"][..], "polynomial"),
    ] {
        if let Some((k, v)) = written(doc, paths).pop()
            && c.train.lr_scheduler.name() != takes
            && !is_off(&v)
        {
            warnings.push(
                &k,
                &v,
                format!(
                    "used only by the {takes} schedule (this config's is {})",
                    c.train.lr_scheduler.name()
                ),
            );
        }
    }
    if c.logging.logging_dir.is_some() || c.logging.log_with.is_some() {
        c.logging.tensorboard = true;
    }
    if let Some(w @ ("wandb" | "all")) = c.logging.log_with.as_deref() {
        let w = w.to_string();
        warnings.push(
            "log_with",
            &Value::from(w),
            "Weights & Biases is not available: TensorBoard event files are written to `logging_dir`",
        );
    }
    for e in doc.entries.iter_mut().filter(|e| !e.used) {
        if let Some(reason) = no_effect(&e.path) {
            e.used = true;
            if !is_off(&e.value) && !is_our_default(&e.path, &e.value) {
                warnings.push(&e.path, &e.value, reason);
            }
        }
    }
    Ok(())
}

/// LyCORIS algorithms that are not LoRA / LoCon.
const OTHER_ALGOS: &[&str] = &[
    "loha", "lokr", "ia3", "dylora", "glora", "full", "diag-oft", "boft", "oft",
];

/// network_args names that change nothing here, with why.
const NETWORK_ARGS_NO_EFFECT: &[(&str, &str)] = &[
    (
        "rank_dropout",
        "rank dropout is not implemented; `network_dropout` is",
    ),
    (
        "module_dropout",
        "module dropout is not implemented; `network_dropout` is",
    ),
    (
        "down_lr_weight",
        "block-wise learning rates are not implemented",
    ),
    (
        "mid_lr_weight",
        "block-wise learning rates are not implemented",
    ),
    (
        "up_lr_weight",
        "block-wise learning rates are not implemented",
    ),
    (
        "block_lr_zero_threshold",
        "block-wise learning rates are not implemented",
    ),
    (
        "block_dims",
        "block-wise ranks are not implemented: use `lora.rank_pattern`",
    ),
    (
        "block_alphas",
        "block-wise ranks are not implemented: use `lora.alpha_pattern`",
    ),
    (
        "conv_block_dims",
        "block-wise ranks are not implemented: use `lora.rank_pattern`",
    ),
    (
        "conv_block_alphas",
        "block-wise ranks are not implemented: use `lora.alpha_pattern`",
    ),
    (
        "preset",
        "LyCORIS presets are not read: targets are `lora.target_modules`",
    ),
    ("train_norm", "norm layers are not trained"),
    ("use_tucker", "used only by LyCORIS LoHa/LoKr"),
    ("use_scalar", "used only by LyCORIS LoHa/LoKr"),
    ("rank_dropout_scale", "rank dropout is not implemented"),
    ("factor", "used only by LyCORIS LoKr"),
    ("decompose_both", "used only by LyCORIS LoKr"),
    (
        "bypass_mode",
        "the adapter always runs beside the base weight",
    ),
    ("dora_wd", "use `lora.use_dora: true` for DoRA"),
    (
        "loraplus_unet_lr_ratio",
        "one LoRA+ ratio is used for all adapters: `loraplus_lr_ratio`",
    ),
    (
        "loraplus_text_encoder_lr_ratio",
        "one LoRA+ ratio is used for all adapters: `loraplus_lr_ratio`",
    ),
    ("exclude_patterns", "use `lora.exclude_modules`"),
    ("use_cp", "used only by LyCORIS LoHa/LoKr"),
    ("include_patterns", "use `lora.target_modules`"),
    (
        "split_qkv",
        "FLUX adapters are per projection here; the kohya file fuses them into BFL's modules, exactly",
    ),
    ("train_t5xxl", "T5-XXL is not trained here"),
];

/// Reads kohya's `network_args` into the config; whether they name an `algo` (LyCORIS).
fn network_args(
    path: &str,
    v: &Value,
    c: &mut TrainConfig,
    warnings: &mut ConfigWarnings,
) -> Result<bool> {
    let args = kwargs(path, v)?;
    let number = |name: &str, x: &Value| -> Result<f64> {
        let key = format!("{path}.{name}");
        let n: f64 = typed(&key, x, "a number")?;
        if n.is_finite() && n >= 0.0 {
            Ok(n)
        } else {
            Err(invalid(&key, x, "a number >= 0"))
        }
    };
    let algo = args.contains_key("algo");
    for (name, x) in &args {
        let key = format!("{path}.{name}");
        match name.as_str() {
            "algo" => {
                let algo = x.as_str().unwrap_or_default().to_ascii_lowercase();
                match algo.as_str() {
                    "lora" | "locon" => {}
                    a if OTHER_ALGOS.contains(&a) => {
                        return Err(ConfigError::InvalidValue {
                            key,
                            value: render(x),
                            expected: format!(
                                "\"locon\" or \"lora\": LyCORIS `{a}` is not supported yet (train a LoRA/LoCon, or use LyCORIS itself for {a})"
                            ),
                        });
                    }
                    _ => return Err(invalid(&key, x, "\"locon\" or \"lora\"")),
                }
            }
            "conv_dim" => {
                let n = number(name, x)?;
                if n >= 1.0 {
                    c.lora.conv_rank = Some(n as u32);
                }
            }
            "conv_alpha" => {
                let n = number(name, x)?;
                if n > 0.0 {
                    c.lora.conv_alpha = Some(n);
                }
            }
            "loraplus_lr_ratio" => {
                let n = number(name, x)?;
                match c.train.loraplus_lr_ratio {
                    Some(r) if r != n => {
                        return Err(ConfigError::Conflict {
                            canonical: "train.loraplus_lr_ratio".into(),
                            first_key: "loraplus_lr_ratio".into(),
                            first_value: r.to_string(),
                            second_key: key,
                            second_value: render(x),
                        });
                    }
                    _ => c.train.loraplus_lr_ratio = Some(n),
                }
            }
            "dropout" => {
                let p = number(name, x)?;
                if p > 0.0 {
                    if !(p < 1.0) {
                        return Err(invalid(&key, x, "a probability in [0, 1)"));
                    }
                    c.lora.dropout = p;
                }
            }
            // networks.lora_flux
            "train_blocks" => {
                let t = x.as_str().unwrap_or_default().trim().to_ascii_lowercase();
                c.flux.train_blocks = match t.as_str() {
                    "all" => crate::config::FluxTrainBlocks::All,
                    "single" => crate::config::FluxTrainBlocks::Single,
                    "double" => crate::config::FluxTrainBlocks::Double,
                    _ => return Err(invalid(&key, x, "\"all\", \"single\" or \"double\"")),
                };
            }
            "train_double_block_indices" | "train_single_block_indices" => {
                // `0,2-4` arrives split at its commas, as other list-valued arguments do
                let one = |v: &Value| match v {
                    Value::String(t) => t.trim().to_string(),
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                };
                let t = match x {
                    Value::Array(a) => a.iter().map(one).collect::<Vec<_>>().join(","),
                    other => one(other),
                };
                if let Err(m) = crate::config::parse_block_indices(&t, u32::MAX) {
                    return Err(ConfigError::InvalidValue {
                        key,
                        value: render(x),
                        expected: format!(
                            "\"all\", \"none\" or comma-separated indices and ranges such as \"0,1,8-12\" ({m})"
                        ),
                    });
                }
                if name == "train_double_block_indices" {
                    c.flux.train_double_block_indices = Some(t);
                } else {
                    c.flux.train_single_block_indices = Some(t);
                }
            }
            "train_t5xxl" if !is_off(x) => {
                return Err(ConfigError::InvalidValue {
                    key,
                    value: render(x),
                    expected: "false: T5-XXL is not trained here (it stays frozen and its outputs are cached); remove train_t5xxl".into(),
                });
            }
            other => {
                let reason = NETWORK_ARGS_NO_EFFECT
                    .iter()
                    .find(|(k, _)| *k == other)
                    .map(|(_, r)| (*r).to_string())
                    .unwrap_or_else(|| {
                        "not a network argument of kohya's networks.lora or LyCORIS LoCon that this SDK knows".to_string()
                    });
                if !is_off(x) {
                    warnings.push(&key, x, reason);
                }
            }
        }
    }
    Ok(algo)
}
