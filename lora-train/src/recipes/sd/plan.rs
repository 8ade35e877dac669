//! The memory plan of a Stable Diffusion LoRA run, from headers only (no libtorch, no weights).
//!
//! [`plan`] describes the model from a diffusers folder (`model_index.json`, `unet/config.json`
//! and the safetensors headers), a single-file SD checkpoint (`.safetensors` with the original
//! LDM keys) or a lora-memory preset name (`sd15`, `sdxl` — nothing to download), turns the
//! [`TrainConfig`] into lora-memory [`Settings`] the way the SD job runs
//! ([`crate::sd::run`]: latents cached in memory after the first encoding, the VAE and the text
//! encoder kept loaded for first-epoch encodings and sample images, text-encoder outputs cached
//! while the encoder is frozen), estimates the peak and checks it against the budget.
//! [`report`](crate::job::diffusion_report) prints it with the rows that matter for diffusion (image and latent size, batch,
//! what is cached, UNet / VAE / text-encoder weights, UNet and text-encoder activations).
//!
//! [`check_sd_config`] holds the checks `lora-train plan` and the SD job share, so both refuse
//! the same configs with the same message before anything loads: `data.resolution`,
//! `lora.target_modules` against the UNet's module names, `model.kind` against the model, and a
//! single-file checkpoint's tokenizer.

use crate::config::{BaseWeights, DataFormat, ModelKind, TargetModules, TrainConfig};
use crate::job::{JobError, Plan, Result, resolve_base_model, resolve_path};
use lora_memory::model::DiffusionFamily;
use lora_memory::{Budget, ModelDescriptor, Settings};
use std::path::{Path, PathBuf};

/// The UNet modules adapted when `lora.target_modules` is left at its default: the attention
/// projections, as diffusers' `train_text_to_image_lora.py` (`target_modules=["to_k", "to_q",
/// "to_v", "to_out.0"]`).
pub const DEFAULT_UNET_TARGETS: [&str; 4] = ["to_q", "to_k", "to_v", "to_out.0"];

/// Whether `path` looks like a Stable Diffusion model: a diffusers folder (`model_index.json` or
/// a `unet/config.json`) or an original single-file `.safetensors` checkpoint (UNet tensors
/// under `model.diffusion_model.`; only the header is read). What the CLI uses to send a run to
/// this job.
pub fn is_sd_model(path: &Path) -> bool {
    if path.is_file() {
        return path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"))
            && lora_core::formats::read_header(path).is_ok_and(|h| {
                h.tensors
                    .keys()
                    .any(|k| k.starts_with(lora_models::sd::load::LDM_UNET_PREFIX))
            });
    }
    path.is_dir()
        && (path.join("model_index.json").is_file() || path.join("unet/config.json").is_file())
}

/// Whether `cfg` is for this job: `model.kind` `sd15`/`sdxl`, or `auto` with a base model that
/// [`is_sd_model`] (resolved as [`resolve_base_model`] does: a path, or a Hub id from the local
/// Hugging Face cache).
pub fn wants_sd_job(cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
    match cfg.model.kind {
        ModelKind::Sd15 | ModelKind::Sdxl => true,
        ModelKind::Llm | ModelKind::Flux => false,
        ModelKind::Auto => cfg
            .base_model()
            .ok()
            .and_then(|b| resolve_base_model(b, config_dir).ok())
            .is_some_and(|p| is_sd_model(&p)),
    }
}

/// Whether `cfg` plans (and trains) as Stable Diffusion: `model.kind: sd15 | sdxl`, a diffusers
/// SD folder (see [`wants_sd_job`]), an SD single-file `.safetensors` checkpoint, or
/// a diffusion preset name (`sd15`, `SD1.5`, `sdxl`) that is not a path.
pub fn is_sd_config(cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
    if wants_sd_job(cfg, config_dir) {
        return true;
    }
    if cfg.model.kind != crate::config::ModelKind::Auto {
        return false;
    }
    let Ok(written) = cfg.base_model() else {
        return false;
    };
    match resolve_base_model(written, config_dir) {
        Ok(p) => {
            p.is_file()
                && p.extension().is_some_and(|e| e == "safetensors")
                && matches!(
                    ModelDescriptor::from_safetensors(&p),
                    Ok(ModelDescriptor::Diffusion(_))
                )
        }
        Err(_) => matches!(
            ModelDescriptor::preset(written),
            Ok(ModelDescriptor::Diffusion(_))
        ),
    }
}

/// Checks `data.resolution` for an SD run: both sides positive multiples of 8 (the VAE's
/// downscale factor; latents are `resolution / 8`). Multiples of 64 suit SD's UNet best (it
/// halves the latent three times); aspect buckets round to `bucket_reso_steps` themselves.
///
/// # Errors
/// [`JobError::Config`] naming `data.resolution`, the value and a multiple to use.
pub fn check_resolution(cfg: &TrainConfig) -> Result<()> {
    check_resolution_multiple(
        cfg,
        8,
        "(latents are 1/8 of it)",
        "; multiples of 64 suit SD best",
    )
}

pub use crate::recipes::images::{bucket_config, check_resolution_multiple};

// ---------------------------------------------------------------------------------------------
// Checks shared by `lora-train plan` and `lora-train train` (the SD job runs them before anything
// loads), so both commands accept and refuse the same configs with the same message.
// ---------------------------------------------------------------------------------------------

/// What kind of UNet module a name is, for the plan: modelled by lora-memory as a linear site,
/// a ResNet 3×3 conv (LoCon, planned with `conv_rank`), or a small module the plan leaves out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UnetModuleKind {
    /// Attention / feed-forward / `proj_in` / `proj_out` / `time_emb_proj` linears.
    Planned,
    /// `resnets.N.conv1` / `conv2` (3×3).
    ResnetConv,
    /// `conv_in`, `conv_out`, `conv_shortcut`, samplers, time / text-time embeddings.
    Unplanned,
}

/// The module names of diffusers' `UNet2DConditionModel` (SD 1.x/2.x and SDXL) that the SD job
/// can put LoRA on (lora-models' UNet sites), with `#` standing for a block index.
const UNET_MODULES: &[(&str, UnetModuleKind)] = {
    use UnetModuleKind::{Planned as P, ResnetConv as R, Unplanned as U};
    &[
        ("conv_in", U),
        ("time_embedding.linear_1", U),
        ("time_embedding.linear_2", U),
        ("add_embedding.linear_1", U),
        ("add_embedding.linear_2", U),
        ("BLOCK.resnets.#.conv1", R),
        ("BLOCK.resnets.#.conv2", R),
        ("BLOCK.resnets.#.time_emb_proj", P),
        ("BLOCK.resnets.#.conv_shortcut", U),
        ("BLOCK.attentions.#.proj_in", P),
        ("BLOCK.attentions.#.proj_out", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn1.to_q", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn1.to_k", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn1.to_v", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn1.to_out.0", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn2.to_q", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn2.to_k", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn2.to_v", P),
        ("BLOCK.attentions.#.transformer_blocks.#.attn2.to_out.0", P),
        ("BLOCK.attentions.#.transformer_blocks.#.ff.net.0.proj", P),
        ("BLOCK.attentions.#.transformer_blocks.#.ff.net.2", P),
        ("down_blocks.#.downsamplers.0.conv", U),
        ("up_blocks.#.upsamplers.0.conv", U),
        ("conv_out", U),
    ]
};

/// The UNet module names of [`check_target_modules`]'s error, briefly.
pub const UNET_TARGET_NAMES_HELP: &str = "to_q, to_k, to_v, to_out.0 (attn1 self-, attn2 cross-attention), proj_in, proj_out, ff.net.0.proj, ff.net.2, ResNet conv1, conv2 (LoCon), time_emb_proj, conv_shortcut, conv_in, conv_out, downsamplers.0.conv, upsamplers.0.conv, or a full path such as down_blocks.1.attentions.0.transformer_blocks.0.attn2.to_k";

/// Every template of [`UNET_MODULES`] with its block prefix spelled out (`BLOCK` = a down block,
/// the mid block or an up block), as token lists.
fn unet_module_templates() -> Vec<(Vec<&'static str>, UnetModuleKind)> {
    let mut out = Vec::new();
    for &(path, kind) in UNET_MODULES {
        match path.strip_prefix("BLOCK.") {
            Some(rest) => {
                for block in ["down_blocks.#", "mid_block", "up_blocks.#"] {
                    let mut t: Vec<&str> = block.split('.').collect();
                    t.extend(rest.split('.'));
                    out.push((t, kind));
                }
            }
            None => out.push((path.split('.').collect(), kind)),
        }
    }
    out
}

/// The generic name of a template's modules, as lora-memory names its sites: the parts after
/// the last index (`attn1.to_q`, `proj_in`, `conv1`, `downsamplers.0.conv`, `conv_in`).
fn template_site(template: &[&str]) -> String {
    let start = template
        .iter()
        .rposition(|p| *p == "#")
        .map_or(0, |i| i + 1);
    template[start..].join(".")
}

/// PEFT's list matching (the whole module name, or its last dot-separated parts) of `target`
/// against a template whose `#` parts match any index.
fn target_matches_template(target: &str, template: &[&str]) -> bool {
    let parts: Vec<&str> = target.split('.').collect();
    parts.len() <= template.len()
        && parts.iter().rev().zip(template.iter().rev()).all(|(p, t)| {
            if *t == "#" {
                !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
            } else {
                p == t
            }
        })
}

/// Concrete module names for a regex `target_modules` (indices 0–3 for blocks, resnets and
/// attentions, 0–9 for transformer blocks: SDXL's deepest level has 10), each with its generic
/// site name and kind.
fn unet_module_examples() -> Vec<(String, (String, UnetModuleKind))> {
    let mut out = Vec::new();
    for (t, kind) in unet_module_templates() {
        let site = template_site(&t);
        let mut names = vec![String::new()];
        for (i, part) in t.iter().enumerate() {
            let choices: Vec<String> = if *part == "#" {
                let n = if i > 0 && t[i - 1] == "transformer_blocks" {
                    10
                } else {
                    4
                };
                (0..n).map(|k| k.to_string()).collect()
            } else {
                vec![(*part).to_string()]
            };
            names = names
                .iter()
                .flat_map(|prefix| {
                    choices.iter().map(move |c| {
                        if prefix.is_empty() {
                            c.clone()
                        } else {
                            format!("{prefix}.{c}")
                        }
                    })
                })
                .collect();
        }
        out.extend(names.into_iter().map(|n| (n, (site.clone(), kind))));
    }
    out
}

/// The UNet's 3×3 convolutions LoCon adds (kohya `networks.lora` with `conv_dim`: the
/// convolutions of `ResnetBlock2D`, `Downsample2D` and `Upsample2D`).
pub const LOCON_TARGETS: [&str; 3] = ["conv1", "conv2", "conv"];

/// `lora.target_modules` as the SD job uses it: the config's value, or the UNet attention
/// projections ([`DEFAULT_UNET_TARGETS`]) when it is left at its (LLM) default; with
/// `lora.conv_rank` (LoCon) a list also gets [`LOCON_TARGETS`].
pub fn unet_target_modules(cfg: &TrainConfig) -> TargetModules {
    let mut t = if cfg.lora.target_modules == crate::config::default_target_modules() {
        TargetModules::List(DEFAULT_UNET_TARGETS.iter().map(|t| t.to_string()).collect())
    } else {
        cfg.lora.target_modules.clone()
    };
    if cfg.lora.conv_rank.is_some()
        && let TargetModules::List(l) = &mut t
    {
        for c in LOCON_TARGETS {
            if !l.iter().any(|x| x == c) {
                l.push(c.to_string());
            }
        }
    }
    t
}

/// The UNet's LoRA config: [`unet_target_modules`], and with `lora.conv_rank` (LoCon) the
/// 3×3 convolutions at that rank and at `lora.conv_alpha` (default: the conv rank, as kohya),
/// through per-module rank and alpha patterns.
pub fn unet_lora_config(cfg: &TrainConfig, base_model: &str) -> lora_core::config::LoraConfig {
    let mut c = cfg
        .lora
        .to_lora_config(unet_target_modules(cfg), base_model, None);
    if let Some(r) = cfg.lora.conv_rank {
        let alpha = cfg.lora.conv_alpha.unwrap_or(f64::from(r));
        for name in LOCON_TARGETS {
            c.rank_pattern
                .entry(name.to_string())
                .or_insert(i64::from(r));
            c.alpha_pattern.entry(name.to_string()).or_insert(alpha);
        }
    }
    c
}

/// The UNet name an LLM or text-encoder module name most likely meant.
fn unet_name_for(name: &str) -> Option<&'static str> {
    Some(match name {
        "q_proj" | "self_attn.q_proj" | "to_query" => "to_q",
        "k_proj" | "self_attn.k_proj" => "to_k",
        "v_proj" | "self_attn.v_proj" => "to_v",
        "o_proj" | "out_proj" | "self_attn.out_proj" | "to_out" | "attn.out_proj" => "to_out.0",
        "gate_proj" | "up_proj" | "fc1" | "mlp.fc1" | "ff.net.0" => "ff.net.0.proj",
        "down_proj" | "fc2" | "mlp.fc2" => "ff.net.2",
        _ => return None,
    })
}

/// The UNet modules `targets` reaches, with PEFT's matching as the SD job's injection does it:
/// their generic site names (see [`template_site`]) and kinds, one entry per module template
/// reached.
///
/// # Errors
/// [`JobError::Config`] naming `lora.target_modules`: list entries that name no UNet module, a
/// regex that matches none of the UNet's names or does not compile.
fn unet_target_sites(targets: &TargetModules) -> Result<Vec<(String, UnetModuleKind)>> {
    let invalid = |value: String, expected: String| {
        JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "lora.target_modules".into(),
            value,
            expected,
        })
    };
    let te_hint = "the text encoder's q/k/v/out_proj get LoRA with train.train_text_encoder: true";
    match targets {
        TargetModules::Regex(r) if r == "all-linear" => Ok(unet_module_templates()
            .into_iter()
            .filter(|(tpl, k)| {
                *k == UnetModuleKind::Planned && !tpl.iter().any(|p| p.starts_with("conv"))
            })
            .map(|(tpl, k)| (template_site(&tpl), k))
            .collect()),
        TargetModules::Regex(r) => {
            let mut c = lora_core::config::LoraConfig::new::<&str>(1, 1.0, &[]);
            c.target_modules = Some(lora_core::config::TargetModules::Regex(r.clone()));
            let m = lora_core::config::TargetMatcher::new(&c).map_err(|e| {
                invalid(
                    format!("{r:?}"),
                    format!("a valid regular expression ({e}), or a list of UNet module names"),
                )
            })?;
            let kinds: Vec<(String, UnetModuleKind)> = unet_module_examples()
                .into_iter()
                .filter(|(n, _)| m.matches(n, true))
                .map(|(_, site)| site)
                .collect();
            if kinds.is_empty() {
                return Err(invalid(
                    format!("{r:?}"),
                    format!(
                        "a regex that matches whole UNet module names (e.g. \"down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q\"), or a list of UNet module names: {UNET_TARGET_NAMES_HELP}; {te_hint}"
                    ),
                ));
            }
            Ok(kinds)
        }
        TargetModules::List(list) => {
            let templates = unet_module_templates();
            let mut kinds = Vec::new();
            let mut bad = Vec::new();
            for t in list {
                let before = kinds.len();
                kinds.extend(
                    templates
                        .iter()
                        .filter(|(tpl, _)| target_matches_template(t, tpl))
                        .map(|(tpl, k)| (template_site(tpl), *k)),
                );
                if kinds.len() == before {
                    bad.push(t.clone());
                }
            }
            if bad.is_empty() {
                return Ok(kinds);
            }
            let meant: Vec<String> = bad
                .iter()
                .filter_map(|b| unet_name_for(b).map(|u| format!("for {b} write {u}")))
                .collect();
            Err(invalid(
                if bad.len() == list.len() {
                    format!("{bad:?}")
                } else {
                    format!("{bad:?} (in {list:?})")
                },
                format!(
                    "UNet module names (the SD job puts LoRA on the UNet): {UNET_TARGET_NAMES_HELP}{}; {te_hint}",
                    if meant.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", meant.join(", "))
                    }
                ),
            ))
        }
    }
}

/// Checks that every `lora.target_modules` entry (the SD job's targets, see
/// [`unet_target_modules`]) names a module of the UNet, as the job's injection matches them.
/// `lora-train plan` and the SD job both call it, before anything loads.
///
/// # Errors
/// [`JobError::Config`] naming `lora.target_modules`, the entries that name no UNet module and
/// the names that do (e.g. `q_proj` is an LLM / text-encoder name; the UNet's is `to_q`).
pub fn check_target_modules(cfg: &TrainConfig) -> Result<()> {
    unet_target_sites(&unet_target_modules(cfg)).map(|_| ())
}

/// Checks `model.kind` against the model: `sdxl` on an SD 1.x/2.x model, or `sd15` on an SDXL
/// one. `sdxl` says what the model is; `base` is `model.base_model` as written and `preset`
/// whether it is a planning preset name (else a path). Used by `lora-train plan` and by the SD
/// job (before loading, from the header, and after loading, from the pipeline).
///
/// # Errors
/// [`JobError::Input`] naming both values and what to change.
pub fn check_model_kind(kind: ModelKind, sdxl: bool, base: &str, preset: bool) -> Result<()> {
    let (kind_name, is, other) = match (kind, sdxl) {
        (ModelKind::Sdxl, false) => ("sdxl", "an SD 1.x/2.x", "sd15"),
        (ModelKind::Sd15, true) => ("sd15", "an SDXL", "sdxl"),
        _ => return Ok(()),
    };
    let model = if sdxl { "SDXL" } else { "SD 1.5" };
    Err(JobError::Input(if preset {
        format!(
            "model.kind is {kind_name} but model.base_model {base:?} is the {model} planning preset; write base_model: {kind_name} to plan {}, or set model.kind: {other} (or remove it) to plan {model}",
            if sdxl { "SD 1.5" } else { "SDXL" },
        )
    } else {
        format!(
            "{base}: model.kind is {kind_name} but this is {is} pipeline ({}); set model.kind: {other} or auto",
            if sdxl {
                "text_encoder_2, text_time UNet"
            } else {
                "no text_encoder_2"
            }
        )
    }))
}

/// The folder a single-file checkpoint takes its tokenizer (and component configs) from
/// ([`lora_models::sd::single_file_companion`]): `tokenizer` (`model.tokenizer`, resolved) when
/// given, else the file's own folder when it has a `tokenizer/`.
///
/// # Errors
/// [`JobError::Input`] naming the file and `model.tokenizer` and what to set it to.
pub fn single_file_companion(path: &Path, tokenizer: Option<&Path>, sdxl: bool) -> Result<PathBuf> {
    lora_models::sd::single_file_companion(path, tokenizer, sdxl).map_err(|e| match e {
        lora_models::Error::Unusable { .. } => JobError::Input(e.to_string()),
        other => crate::recipes::sd::pipeline_err(other),
    })
}

/// The checks `lora-train plan` and `lora-train train` share on an SD config, before anything
/// loads: `data.resolution` ([`check_resolution`]), `lora.target_modules`
/// ([`check_target_modules`]), and with the model's descriptor `desc`: `model.kind` against it
/// ([`check_model_kind`]) and, for a single-file checkpoint `base`, its tokenizer
/// ([`single_file_companion`]; `model.tokenizer` resolved as [`resolve_path`] does). `base` is
/// the resolved `model.base_model` (`None` for a planning preset).
///
/// # Errors
/// As the checks; [`JobError::MissingFile`] for a `model.tokenizer` that does not exist.
pub fn check_sd_config(
    cfg: &TrainConfig,
    base: Option<&Path>,
    desc: Option<&ModelDescriptor>,
    config_dir: Option<&Path>,
) -> Result<()> {
    check_data_format(cfg.data.format)?;
    if cfg.model.weights == BaseWeights::Quantized {
        return Err(JobError::Input(
            "model.weights: quantized is not supported by the Stable Diffusion recipe (its UNet \
             and text encoders load dense); remove it, or set model.weights: dense and choose \
             model.dtype (f16 / bf16 halves the weights)"
                .into(),
        ));
    }
    check_resolution(cfg)?;
    check_target_modules(cfg)?;
    let Some(ModelDescriptor::Diffusion(d)) = desc else {
        return crate::recipes::images::check_buckets(cfg);
    };
    let sdxl = d.family == DiffusionFamily::Sdxl;
    match base {
        None => check_model_kind(cfg.model.kind, sdxl, cfg.base_model()?, true)?,
        Some(p) => check_model_kind(cfg.model.kind, sdxl, &p.display().to_string(), false)?,
    }
    if let Some(p) = base.filter(|p| p.is_file()) {
        let tok = match &cfg.model.tokenizer {
            Some(t) => Some(resolve_path("model.tokenizer", t, config_dir)?),
            None => None,
        };
        single_file_companion(p, tok.as_deref(), sdxl)?;
    }
    // last: what the model and its files say comes first
    crate::recipes::images::check_buckets(cfg)
}

/// `data.format` of an image run: `images` (or unset); a text layout is an error naming it.
///
/// # Errors
/// [`JobError::Input`] for `jsonl`, `alpaca` or `chat`.
fn check_data_format(format: DataFormat) -> Result<()> {
    match format {
        DataFormat::Images | DataFormat::Text => Ok(()),
        other => Err(JobError::Input(format!(
            "data.format = {:?} is a text layout, but this is a Stable Diffusion run, which reads \
             kohya image folders (images with caption sidecars); set data.format: images or \
             remove the key",
            format!("{other:?}").to_lowercase()
        ))),
    }
}

/// The diffusion descriptor of `model.base_model` and where it came from: a diffusers folder
/// (configs + safetensors headers), an SD single-file checkpoint (its header; SD 1.x / SDXL by
/// the cross-attention width) or a preset name.
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no diffusion preset; header
/// errors; [`JobError::Unsupported`] when the file describes a language model.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String)> {
    let written = cfg.base_model()?;
    let path = match resolve_base_model(written, config_dir) {
        Ok(p) => p,
        Err(e) => {
            return match ModelDescriptor::preset(written) {
                Ok(d @ ModelDescriptor::Diffusion(_)) => Ok((d, format!("preset {written}"))),
                _ => Err(e),
            };
        }
    };
    Ok((
        descriptor_of_path(&path, written)?,
        path.display().to_string(),
    ))
}

/// The diffusion descriptor of a resolved base-model path (`written` as in the config): a
/// diffusers folder (configs + safetensors headers) or a single-file checkpoint (its header).
/// Used by [`read_descriptor`] and by the SD job for what it loads.
///
/// # Errors
/// Header errors; [`JobError::Unsupported`] when the file describes a language model.
pub fn descriptor_of_path(path: &Path, written: &str) -> Result<ModelDescriptor> {
    let desc = if path.is_dir() {
        ModelDescriptor::Diffusion(lora_memory::sd_header::diffusion_from_diffusers_folder(
            path,
        )?)
    } else {
        ModelDescriptor::from_safetensors(path)?
    };
    if !matches!(desc, ModelDescriptor::Diffusion(_)) {
        return Err(JobError::Unsupported {
            what: format!("model.base_model = {written:?} ({})", path.display()),
            reason: "the file describes a language model, not Stable Diffusion; remove model.kind or point it at a diffusers folder, an SD .safetensors checkpoint or a preset (sd15, sdxl)".into(),
        });
    }
    Ok(desc)
}

/// lora-memory settings for an SD run of `cfg` on `desc`, and notes on what was assumed.
///
/// The image size is `data.resolution` (default 512 for SD 1.x/2.x, 1024 for SDXL); aspect
/// buckets keep their area within it, so the peak is planned at that area. Latents are cached
/// (the SD job keeps every encoded latent), the VAE and text encoder stay loaded, and the text
/// encoder's outputs are cached unless `train.train_text_encoder` is set.
pub fn settings_for(
    cfg: &TrainConfig,
    desc: &ModelDescriptor,
    cuda: bool,
) -> (Settings, Vec<String>) {
    let (mut s, mut notes) = crate::job::settings_for(cfg, None, cuda);
    // lora-memory names its UNet sites generically (`attn1.to_q`, `proj_in`, …, one per kind
    // of module). A target naming a module by its path (`down_blocks.1.attentions.0.proj_in`)
    // or a regex is planned as the generic sites it reaches, on every such module (an upper
    // bound). ResNet 3×3 convs (LoCon) are planned through lora-memory's conv rank (every conv1
    // and conv2); conv_in/conv_out, shortcuts, samplers and embeddings are not modelled (small),
    // and alone are planned as the ResNet convs (an upper bound).
    let targets = unet_target_modules(cfg);
    let sites = unet_target_sites(&targets).unwrap_or_default();
    let has = |k: UnetModuleKind| sites.iter().any(|(_, x)| *x == k);
    let planned: Vec<String> = sites
        .iter()
        .filter(|(_, k)| *k == UnetModuleKind::Planned)
        .fold(Vec::new(), |mut v, (n, _)| {
            if !v.contains(n) {
                v.push(n.clone());
            }
            v
        });
    match &targets {
        TargetModules::List(l) => {
            // as written when lora-memory matches each entry the same way
            let generic = |e: &String| {
                planned
                    .iter()
                    .any(|n| n == e || n.ends_with(&format!(".{e}")))
            };
            let by_path: Vec<&String> = l
                .iter()
                .filter(|e| {
                    !generic(e)
                        && unet_target_sites(&TargetModules::List(vec![(*e).clone()]))
                            .is_ok_and(|s| s.iter().any(|(_, k)| *k == UnetModuleKind::Planned))
                })
                .collect();
            if by_path.is_empty() {
                s.lora.target_modules = l.clone();
            } else {
                notes.push(format!(
                    "{by_path:?} name modules of one block: the plan counts LoRA on that kind of module in every block (an upper bound)"
                ));
                s.lora.target_modules = planned.clone();
            }
        }
        TargetModules::Regex(r) if r == "all-linear" => {}
        TargetModules::Regex(r) => {
            notes.retain(|n| !n.starts_with("lora.target_modules is a regex"));
            notes.push(format!(
                "lora.target_modules is a regex ({r:?}): planned on the UNet modules it matches ({}), in every block",
                planned.join(", ")
            ));
            s.lora.target_modules = planned.clone();
        }
    }
    let unplanned_only =
        has(UnetModuleKind::Unplanned) && planned.is_empty() && !has(UnetModuleKind::ResnetConv);
    if has(UnetModuleKind::ResnetConv) || unplanned_only {
        let conv_rank = cfg.lora.conv_rank.unwrap_or(cfg.lora.rank);
        s.lora.conv_rank = Some(conv_rank);
        notes.push(format!(
            "LoRA on ResNet 3×3 convs (LoCon) is planned at rank {} on every conv1 and conv2{}",
            conv_rank,
            if unplanned_only {
                " (an upper bound for the modules targeted, which the plan does not model)"
            } else {
                ""
            }
        ));
    }
    if has(UnetModuleKind::Unplanned) && !unplanned_only {
        notes.push("LoRA on conv_in, conv_out, conv_shortcut, the down/upsampler convs and the time embeddings is not counted in the plan (a few MB at most)".into());
    }
    let sdxl = matches!(desc, ModelDescriptor::Diffusion(d) if d.family == DiffusionFamily::Sdxl);
    let res = match cfg.data.resolution {
        Some([w, h]) => [w, h],
        None => {
            let r = if sdxl { 1024 } else { 512 };
            notes.push(format!(
                "data.resolution is not set: planned at {r}×{r} px (set it to what you train at)"
            ));
            [r, r]
        }
    };
    s.resolution = res[0].max(res[1]);
    // a non-square resolution is planned at its own shape (activations follow the area)
    s.largest_bucket = (res[0] != res[1]).then_some(res);
    if cfg.data.enable_bucket == Some(true) {
        notes.push(format!(
            "aspect buckets keep their area within {}×{} px, so the peak is planned at that area",
            res[0], res[1]
        ));
    }
    s.sample_images =
        crate::recipes::images::planned_sample_images(cfg, cfg.logging.sample_guidance_scale > 1.0);
    s.cache_latents = true;
    s.keep_models_loaded = true;
    // random crops and changing captions are encoded as they are drawn, not kept (the dataset
    // as its path reads from here; else the config's own `shuffle_caption`)
    let aug = crate::recipes::images::augmentations_of(cfg, None);
    s.random_crop = aug.random_crop;
    s.varying_captions = aug.varying_captions;
    let te = cfg.train.train_text_encoder;
    s.train_text_encoder = te;
    s.cache_text_encoder_outputs = !te;
    (s, notes)
}

/// Writes fitted SD settings back into the config: [`crate::job::apply_settings`] plus the
/// resolution and whether the text encoder is trained (what [`Plan::apply_to`] does for a
/// diffusion plan).
pub use crate::job::plan::apply_diffusion_settings as apply_settings;

/// Plans an SD run of `cfg`: descriptor (folder, single file or preset) → settings → estimate
/// → budget (`override_budget`, else `memory.gpu` / `memory.budget`) → with a budget that is
/// exceeded, the changes lora-memory's `fit()` suggests (carried by the plan as its settings with
/// `memory.auto_fit: true`; [`Plan::apply_to`] writes them into a config). `cuda` selects the
/// device model.
///
/// # Errors
/// As [`read_descriptor`] and [`check_sd_config`]; config, budget and estimate errors. Not
/// fitting is *not* an error (see [`Plan::fits`]).
pub fn plan(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    let (desc, source) = read_descriptor(cfg, config_dir)?;
    // what `train` refuses before loading, `plan` refuses too (the same checks)
    let base = resolve_base_model(cfg.base_model()?, config_dir).ok();
    check_sd_config(cfg, base.as_deref(), Some(&desc), config_dir)?;
    // the sample grid of a kohya prompt file is planned with its prompts (a missing file
    // stops here, as it would stop training)
    let cfg = crate::recipes::images::with_prompt_file_read(cfg, config_dir)?;
    plan_with(&cfg, &desc, source, override_budget, cuda)
}

/// [`plan`] for a descriptor already read; `source` says where it came from.
///
/// # Errors
/// Config, budget and estimate errors.
pub fn plan_with(
    cfg: &TrainConfig,
    desc: &ModelDescriptor,
    source: String,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    check_resolution(cfg)?;
    let (settings, mut notes) = settings_for(cfg, desc, cuda);
    notes.extend(cfg.notes());
    notes.push(if cfg.train.train_text_encoder {
        "the text encoder is trained (LoRA on q/k/v/out_proj) and runs every step".into()
    } else if settings.varying_captions {
        "the text encoder is frozen and runs every step: the captions change between epochs, so its outputs are not cached".into()
    } else {
        "the text encoder is frozen: its outputs are cached per caption".into()
    });
    let (budget, budget_note) = crate::job::budget_for(cfg, override_budget)?;
    notes.extend(budget_note);
    let estimate = lora_memory::estimate(desc, &settings)?;
    let mut plan = Plan::new(desc.clone(), source, settings, estimate, budget);
    plan.notes = notes;
    plan.fit_to_budget(
        cfg.memory.auto_fit,
        "micro-batch, precision, checkpointing, optimizer, rank, resolution",
    )?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quantized_base_is_refused_by_the_sd_recipe() {
        let cfg =
            TrainConfig::from_yaml_str("model: {base_model: sd15, weights: quantized}\n").unwrap();
        let e = plan(&cfg, None, None, true).unwrap_err().to_string();
        assert!(e.contains("model.weights: quantized"), "{e}");
    }

    #[test]
    fn a_text_layout_in_an_image_run_is_an_error_naming_it() {
        let cfg = TrainConfig::from_yaml_str("model: {base_model: sd15}\ndata: {format: chat}\n")
            .unwrap();
        let e = check_sd_config(&cfg, None, None, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("data.format") && e.contains("\"chat\""), "{e}");
        let ok = TrainConfig::from_yaml_str("data: {format: images}\n").unwrap();
        assert!(check_data_format(ok.data.format).is_ok());
    }
    use crate::job::diffusion_report as report;
    use lora_memory::Bytes;

    fn preset_config(yaml: &str) -> TrainConfig {
        TrainConfig::from_yaml_str(yaml).unwrap()
    }

    #[test]
    fn sample_prompts_are_planned_as_training_draws_them() {
        let dir = std::env::temp_dir().join(format!("lsdk-sample-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = "model: {base_model: sd15, dtype: f16}\ndata: {resolution: [512, 512], cache_latents: true}\ntrain: {mixed_precision: fp16, gradient_checkpointing: true, optimizer: adamw8bit}\n";
        let planned = |logging: &str| {
            let cfg = preset_config(&format!("{base}logging: {logging}\n"));
            plan(&cfg, Some(&dir), None, true).map(|p| {
                let row = report(&p)
                    .lines()
                    .find(|l| l.starts_with("sample images"))
                    .map(String::from);
                (p.settings.sample_images, row)
            })
        };
        // none, blank or comment-only prompts: training draws nothing, the plan counts nothing
        for none in [
            "{}",
            "{sample_prompts: []}",
            "{sample_prompts: [\"\", \"   \"]}",
            "{sample_prompt: \"\"}",
        ] {
            let (g, row) = planned(none).unwrap();
            assert_eq!((g, row), (None, None), "{none}");
        }
        // two prompts with guidance, at the training size; kohya's options are taken off
        let (g, row) = planned(
            "{sample_prompts: [\"a cat --w 1024\", \"a dog\"], sample_guidance_scale: 7.5}",
        )
        .unwrap();
        let g = g.unwrap();
        assert_eq!((g.size, g.prompts, g.guidance), (None, 2, true));
        let row = row.unwrap();
        assert!(row.contains("512×512 px"), "{row}");
        // a kohya prompt file, relative to the config's folder: its prompts are read
        std::fs::write(
            dir.join("prompts.txt"),
            "# samples\na cat --n blurry\n\na dog\na fox\n",
        )
        .unwrap();
        let (g, _) = planned("{sample_prompts_file: prompts.txt}").unwrap();
        assert_eq!(g.unwrap().prompts, 3);
        std::fs::write(dir.join("blank.txt"), "\n# nothing\n").unwrap();
        assert_eq!(planned("{sample_prompts_file: blank.txt}").unwrap().0, None);
        // a missing one stops the plan, naming it, as it would stop training
        let e = planned("{sample_prompts_file: nope.txt}")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("sample_prompts") && e.contains("nope.txt"),
            "{e}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_preset_plans_without_files_and_the_report_has_only_diffusion_rows() {
        let mut cfg = preset_config(
            "model: {base_model: sd15, dtype: f16}\ndata: {resolution: [1024, 1024]}\ntrain: {batch_size: 4, mixed_precision: fp16}\n",
        );
        assert!(is_sd_config(&cfg, None));
        let budget = Budget::parse("8GB").unwrap();
        let p = plan(&mut cfg, None, Some(budget), true).unwrap();
        let d = p.estimate.diffusion.as_ref().unwrap();
        assert_eq!(d.image_size, [1024, 1024]);
        assert_eq!(d.latent_size, [128, 128]);
        // SD1.5's UNet in fp16: 859,520,964 × 2 B; VAE and CLIP-L stay loaded (16-bit)
        assert_eq!(d.unet_weights, Bytes(1_719_041_928));
        assert_eq!(d.vae_weights, Bytes(2 * 83_653_863));
        assert!(d.text_encoder_weights.0 > 2 * 120_000_000);
        assert_eq!(
            p.fits,
            Some(false),
            "SD1.5 at 1024 px, batch 4 is far above 8 GB"
        );
        assert!(!p.suggestion.is_empty());
        let r = report(&p);
        for row in [
            "image 1024×1024 px → latents 128×128",
            "UNet weights",
            "VAE weights",
            "text-encoder weights",
            "UNet activations",
            "latents cached: yes",
            "text encoder: frozen, outputs cached",
            "DOES NOT FIT",
        ] {
            assert!(r.contains(row), "{row:?} missing from\n{r}");
        }
        for llm_row in ["seq_len", "logits", "ids/labels"] {
            assert!(!r.contains(llm_row), "{llm_row:?} in\n{r}");
        }
        // Plan::report prints the same for an SD plan
        assert_eq!(p.report(), r);
    }

    #[test]
    fn a_language_model_preset_is_not_an_sd_config() {
        let cfg = preset_config("model: {base_model: SmolLM2-135M}\n");
        assert!(!is_sd_config(&cfg, None));
        let mut cfg = preset_config("model: {base_model: SmolLM2-135M, kind: sd15}\n");
        let e = plan(&mut cfg, None, None, false).unwrap_err().to_string();
        assert!(e.contains("SmolLM2-135M") && e.contains("not found"), "{e}");
    }

    fn with_targets(targets: &str) -> TrainConfig {
        preset_config(&format!(
            "model: {{base_model: sd15}}\nlora: {{target_modules: {targets}}}\n"
        ))
    }

    #[test]
    fn unet_names_are_accepted_as_peft_matches_them_and_others_are_named() {
        for ok in [
            "[to_q, to_k, to_v, to_out.0]",
            "[attn2.to_k, ff.net.0.proj, ff.net.2, proj_in, proj_out]",
            "[conv1, resnets.0.conv2, time_emb_proj, conv_shortcut]",
            "[conv_in, conv_out, downsamplers.0.conv, upsamplers.0.conv]",
            "[time_embedding.linear_1, add_embedding.linear_2]",
            "[down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q]",
            "[mid_block.attentions.0.proj_in, up_blocks.3.resnets.2.conv_shortcut]",
            "[transformer_blocks.9.attn2.to_out.0]",
            "all-linear",
            "'.*attn[12]\\.to_[qkv]'",
            "'up_blocks\\.1\\..*conv1'",
        ] {
            let cfg = with_targets(ok);
            check_target_modules(&cfg).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        // left at the (LLM) default, the SD job's UNet attention projections are used
        let cfg = preset_config("model: {base_model: sd15}\n");
        assert_eq!(
            unet_target_modules(&cfg),
            TargetModules::List(DEFAULT_UNET_TARGETS.map(String::from).to_vec())
        );
        check_target_modules(&cfg).unwrap();
        for (bad, named, hint) in [
            ("[q_proj]", "[\"q_proj\"]", "for q_proj write to_q"),
            (
                "[to_q, to_out]",
                "[\"to_out\"] (in [\"to_q\", \"to_out\"])",
                "for to_out write to_out.0",
            ),
            ("[attn3.to_q]", "[\"attn3.to_q\"]", "to_out.0"),
            ("[down_blocks.x.resnets.0.conv1]", "down_blocks.x", "conv1"),
            ("[to_q.weight]", "to_q.weight", "proj_in"),
            ("'q_proj|k_proj'", "\"q_proj|k_proj\"", "regex"),
            ("'(to_q'", "\"(to_q\"", "valid regular expression"),
        ] {
            let e = check_target_modules(&with_targets(bad)).unwrap_err();
            assert!(matches!(e, JobError::Config(_)), "{bad}: {e:?}");
            let e = e.to_string();
            for part in ["lora.target_modules", named, hint] {
                assert!(e.contains(part), "{bad}: {part:?} missing from {e}");
            }
        }
    }

    #[test]
    fn kohya_conv_dim_is_locon_on_the_3x3_convolutions_at_its_own_rank() {
        let mut cfg = preset_config(
            "model: {base_model: sd15}\nlora: {rank: 8}\nnetwork_args: [conv_dim=4, conv_alpha=2]\n",
        );
        let lcfg = unet_lora_config(&cfg, "sd15");
        let Some(TargetModules::List(targets)) = &lcfg.target_modules else {
            panic!("{:?}", lcfg.target_modules)
        };
        for t in ["to_q", "to_v", "conv1", "conv2", "conv"] {
            assert!(targets.iter().any(|x| x == t), "{t} in {targets:?}");
        }
        assert_eq!(lcfg.rank_for("down_blocks.0.resnets.0.conv1"), 4);
        assert_eq!(lcfg.rank_for("down_blocks.0.downsamplers.0.conv"), 4);
        assert_eq!(
            lcfg.rank_for("mid_block.attentions.0.transformer_blocks.0.attn1.to_q"),
            8
        );
        assert_eq!(lcfg.alpha_for("up_blocks.1.resnets.2.conv2"), 2.0);
        let p = plan(&mut cfg, None, None, false).unwrap();
        assert_eq!(p.settings.lora.conv_rank, Some(4));
    }

    #[test]
    fn conv_targets_are_planned_with_the_conv_rank() {
        let plan_of = |targets: &str| {
            let mut cfg = preset_config(&format!(
                "model: {{base_model: sd15}}\nlora: {{rank: 4, target_modules: {targets}}}\n"
            ));
            plan(&mut cfg, None, None, false).unwrap()
        };
        let attn = plan_of("[to_q]");
        let locon = plan_of("[to_q, conv1]");
        assert_eq!(attn.settings.lora.conv_rank, None);
        assert_eq!(locon.settings.lora.conv_rank, Some(4));
        assert!(locon.estimate.trainable_params > attn.estimate.trainable_params);
        assert!(
            locon.notes.iter().any(|n| n.contains("LoCon")),
            "{:?}",
            locon.notes
        );
        // a module of one block is planned as that kind of module in every block
        let one = plan_of("[down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q]");
        assert_eq!(one.settings.lora.target_modules, ["attn1.to_q"]);
        assert!(one.estimate.trainable_params > 0);
        assert!(one.estimate.trainable_params < attn.estimate.trainable_params);
        assert!(
            one.notes.iter().any(|n| n.contains("upper bound")),
            "{:?}",
            one.notes
        );
        let re = plan_of("'.*attn[12]\\.to_q'");
        assert_eq!(
            re.settings.lora.target_modules,
            ["attn1.to_q", "attn2.to_q"]
        );
        assert_eq!(re.estimate.trainable_params, attn.estimate.trainable_params);
        // modules the plan does not model: alone, planned as the ResNet convs (an upper bound)
        let only = plan_of("[conv_in]");
        assert_eq!(only.settings.lora.conv_rank, Some(4));
        assert!(only.estimate.trainable_params > 0);
        let small = plan_of("[to_q, conv_in]");
        assert_eq!(
            small.estimate.trainable_params,
            attn.estimate.trainable_params
        );
        assert!(
            small.notes.iter().any(|n| n.contains("not counted")),
            "{:?}",
            small.notes
        );
    }

    #[test]
    fn model_kind_against_the_model_names_both() {
        check_model_kind(ModelKind::Sdxl, true, "sdxl", true).unwrap();
        check_model_kind(ModelKind::Auto, false, "sd15", true).unwrap();
        let e = check_model_kind(ModelKind::Sdxl, false, "sd15", true)
            .unwrap_err()
            .to_string();
        for part in [
            "model.kind is sdxl",
            "\"sd15\"",
            "SD 1.5 planning preset",
            "base_model: sdxl",
            "model.kind: sd15",
        ] {
            assert!(e.contains(part), "{part:?} missing from {e}");
        }
        let e = check_model_kind(ModelKind::Sd15, true, "/m/xl", false).unwrap_err();
        assert!(matches!(e, JobError::Input(_)));
        assert!(
            e.to_string()
                .contains("/m/xl: model.kind is sd15 but this is an SDXL pipeline"),
            "{e}"
        );
        // the plan of a preset refuses the contradiction instead of planning the preset
        let mut cfg = preset_config("model: {base_model: sd15, kind: sdxl}\n");
        assert!(
            plan(&mut cfg, None, None, false)
                .unwrap_err()
                .to_string()
                .contains("model.kind is sdxl")
        );
        let mut cfg = preset_config("model: {base_model: sdxl, kind: sdxl}\n");
        assert_eq!(plan(&mut cfg, None, None, false).unwrap().model, "SDXL");
    }

    #[test]
    fn a_single_file_needs_a_tokenizer_beside_it_or_in_model_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("model.safetensors");
        std::fs::write(&file, b"").unwrap();
        let e = single_file_companion(&file, None, true).unwrap_err();
        assert!(matches!(e, JobError::Input(_)));
        let e = e.to_string();
        assert!(
            e.contains("holds no tokenizer")
                && e.contains("model.tokenizer")
                && e.contains("tokenizer_2/"),
            "{e}"
        );
        // a folder without tokenizer files
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let e = single_file_companion(&file, Some(&empty), false)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no tokenizer.json or vocab.json + merges.txt")
                && e.contains("model.tokenizer"),
            "{e}"
        );
        // a CLIP tokenizer folder, a pipeline folder, and a tokenizer/ beside the file
        std::fs::write(empty.join("tokenizer.json"), b"{}").unwrap();
        assert_eq!(
            single_file_companion(&file, Some(&empty), false).unwrap(),
            empty
        );
        let tok = dir.path().join("tokenizer");
        std::fs::create_dir_all(&tok).unwrap();
        std::fs::write(tok.join("vocab.json"), b"{}").unwrap();
        let e = single_file_companion(&file, None, false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.tokenizer is not set"), "{e}");
        std::fs::write(tok.join("merges.txt"), b"").unwrap();
        assert_eq!(
            single_file_companion(&file, None, false).unwrap(),
            dir.path()
        );
    }

    #[test]
    fn auto_fit_writes_the_fitted_settings_back() {
        let mut cfg = preset_config(
            "model: {base_model: sdxl, dtype: bf16}\ndata: {resolution: [1024, 1024]}\ntrain: {batch_size: 4}\nmemory: {gpu: RTX 3060, auto_fit: true}\n",
        );
        let before = cfg.clone();
        let p = plan(&cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(true), "{}", report(&p));
        assert!(!p.changes.is_empty());
        assert_eq!(cfg, before, "planning leaves the config alone");
        p.apply_to(&mut cfg);
        assert_eq!(cfg.train.batch_size, p.settings.micro_batch);
        assert_eq!(
            cfg.train.gradient_checkpointing,
            p.settings.gradient_checkpointing
        );
    }
}
