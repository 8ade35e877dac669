//! The memory plan of a Stable Diffusion LoRA run, from headers only (no libtorch, no weights).
//!
//! [`plan`] describes the model from a diffusers folder (`model_index.json`, `unet/config.json`
//! and the safetensors headers), a single-file SD checkpoint (`.safetensors` with the original
//! LDM keys) or a lora-memory preset name (`sd15`, `sdxl` — nothing to download), turns the
//! [`TrainConfig`] into lora-memory [`Settings`] the way the SD job runs
//! ([`crate::sd::run`]: latents cached in memory after the first encoding, the VAE and the text
//! encoder kept loaded for first-epoch encodings and sample images, text-encoder outputs cached
//! while the encoder is frozen), estimates the peak and checks it against the budget.
//! [`report`] prints it with the rows that matter for diffusion (image and latent size, batch,
//! what is cached, UNet / VAE / text-encoder weights, UNet and text-encoder activations).

use crate::config::TrainConfig;
use crate::llm::{JobError, Plan, Result, budget_source, resolve_path};
use lora_memory::model::DiffusionFamily;
use lora_memory::{Budget, Bytes, FitError, ModelDescriptor, Settings};
use std::path::Path;

/// Whether `cfg` plans (and trains) as Stable Diffusion: `model.kind: sd15 | sdxl`, a diffusers
/// SD folder (see [`crate::sd::wants_sd_job`]), an SD single-file `.safetensors` checkpoint, or
/// a diffusion preset name (`sd15`, `SD1.5`, `sdxl`) that is not a path.
pub fn is_sd_config(cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
    if crate::sd::wants_sd_job(cfg, config_dir) {
        return true;
    }
    if cfg.model.kind != crate::config::ModelKind::Auto {
        return false;
    }
    let Ok(written) = cfg.base_model() else {
        return false;
    };
    match resolve_path("model.base_model", written, config_dir) {
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
    if let Some([w, h]) = cfg.data.resolution
        && (w == 0 || h == 0 || w % 8 != 0 || h % 8 != 0)
    {
        let near = |v: u32| (v.max(8) + 4) / 8 * 8;
        return Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "data.resolution".into(),
            value: if w == h {
                w.to_string()
            } else {
                format!("[{w}, {h}]")
            },
            expected: format!(
                "a multiple of 8 pixels on each side (latents are 1/8 of it), e.g. {}; multiples of 64 suit SD best",
                if w == h {
                    near(w).to_string()
                } else {
                    format!("[{}, {}]", near(w), near(h))
                }
            ),
        }));
    }
    Ok(())
}

/// The diffusion descriptor of `model.base_model` and where it came from: a diffusers folder
/// (configs + safetensors headers), an SD single-file checkpoint (its header; SD 1.x / SDXL by
/// the cross-attention width) or a preset name.
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no diffusion preset; header
/// errors; [`JobError::Runtime`] when the file describes a language model.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String)> {
    let written = cfg.base_model()?;
    let path = match resolve_path("model.base_model", written, config_dir) {
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
/// Header errors; [`JobError::Runtime`] when the file describes a language model.
pub fn descriptor_of_path(path: &Path, written: &str) -> Result<ModelDescriptor> {
    let desc = if path.is_dir() {
        ModelDescriptor::Diffusion(lora_memory::sd_header::diffusion_from_diffusers_folder(
            path,
        )?)
    } else {
        ModelDescriptor::from_safetensors(path)?
    };
    if !matches!(desc, ModelDescriptor::Diffusion(_)) {
        return Err(JobError::Runtime(format!(
            "model.base_model = {written:?} ({}): the file describes a language model, not Stable Diffusion; remove model.kind or point it at a diffusers folder, an SD .safetensors checkpoint or a preset (sd15, sdxl)",
            path.display()
        )));
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
    let (mut s, mut notes) = crate::llm::settings_for(cfg, None, cuda);
    if cfg.lora.target_modules == crate::config::TargetModules::default() {
        // the SD job's default: the UNet attention projections
        s.lora.target_modules = crate::sd::DEFAULT_UNET_TARGETS
            .iter()
            .map(|t| t.to_string())
            .collect();
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
    s.cache_latents = true;
    s.keep_models_loaded = true;
    let te = cfg.train.train_text_encoder;
    s.train_text_encoder = te;
    s.cache_text_encoder_outputs = !te;
    (s, notes)
}

/// Writes fitted SD settings back into the config: [`crate::llm::apply_settings`] plus the
/// resolution and whether the text encoder is trained.
pub fn apply_settings(cfg: &mut TrainConfig, s: &Settings) {
    crate::llm::apply_settings(cfg, s);
    let [w, h] = s.largest_bucket.unwrap_or([s.resolution, s.resolution]);
    if cfg.data.resolution.map(|[a, b]| a.max(b)) != Some(s.resolution) {
        cfg.data.resolution = Some(if s.largest_bucket.is_some() {
            [w, h]
        } else {
            [s.resolution, s.resolution]
        });
    }
    cfg.train.train_text_encoder = s.train_text_encoder;
}

/// Plans an SD run of `cfg`: descriptor (folder, single file or preset) → settings → estimate
/// → budget (`override_budget`, else `memory.gpu` / `memory.budget`) → with a budget that is
/// exceeded, the changes lora-memory's `fit()` suggests (applied to `cfg` with
/// `memory.auto_fit: true`). `cuda` selects the device model.
///
/// # Errors
/// As [`read_descriptor`]; config, budget and estimate errors. Not fitting is *not* an error
/// (see [`Plan::fits`]).
pub fn plan(
    cfg: &mut TrainConfig,
    config_dir: Option<&Path>,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    let (desc, source) = read_descriptor(cfg, config_dir)?;
    plan_with(cfg, &desc, source, override_budget, cuda)
}

/// [`plan`] for a descriptor already read; `source` says where it came from.
///
/// # Errors
/// Config, budget and estimate errors.
pub fn plan_with(
    cfg: &mut TrainConfig,
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
    } else {
        "the text encoder is frozen: its outputs are cached per caption".into()
    });
    if let ModelDescriptor::Diffusion(d) = desc
        && cfg.model.kind == crate::config::ModelKind::Sd15
        && d.family == DiffusionFamily::Sdxl
    {
        notes.push("model.kind is sd15 but the model is an SDXL UNet; planned as SDXL".into());
    }
    let budget = crate::llm::budget_for(cfg, override_budget)?;
    let estimate = lora_memory::estimate(desc, &settings)?;
    let mut plan = Plan {
        model: desc.name().to_string(),
        model_source: source,
        settings,
        fits: budget.as_ref().map(|b| estimate.peak <= b.bytes),
        estimate,
        budget,
        changes: Vec::new(),
        notes,
        suggestion: Vec::new(),
    };
    if let Some(b) = plan.budget.clone()
        && plan.fits == Some(false)
    {
        match lora_memory::fit(desc, &plan.settings, b.bytes) {
            Ok(f) if cfg.memory.auto_fit => {
                apply_settings(cfg, &f.settings);
                plan.fits = Some(f.estimate.peak <= b.bytes);
                plan.settings = f.settings;
                plan.estimate = f.estimate;
                plan.changes = f.changes;
            }
            Ok(f) => plan.suggestion = f.changes,
            Err(FitError::DoesNotFit { smallest_peak, .. }) => plan.notes.push(format!(
                "nothing on the fitting ladder (micro-batch, precision, checkpointing, optimizer, rank, resolution) fits this budget; the smallest peak reachable is {smallest_peak}"
            )),
            Err(FitError::Estimate(e)) => return Err(e.into()),
            Err(other) => return Err(JobError::Runtime(other.to_string())),
        }
    }
    Ok(plan)
}

fn yes_no(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// The SD plan as text: the run's shape (image and latent size, batch, what is cached and what
/// is trained), one row per memory term that applies to diffusion (no sequence length, tokens
/// or logits), the totals, notes, suggested changes and the verdict.
///
/// A plan without diffusion detail (a language-model plan) is printed by [`Plan::report`].
pub fn report(p: &Plan) -> String {
    let Some(d) = &p.estimate.diffusion else {
        return p.report();
    };
    let s = &p.settings;
    let e = &p.estimate;
    let b = &e.breakdown;
    let cuda = s.device.is_cuda();
    let mut out = format!(
        "plan: {} ({}) — Stable Diffusion LoRA\n",
        p.model, p.model_source
    );
    out += &format!(
        "  device {}  UNet {:?}  mixed precision {:?}  LoRA r{} α{} on {:?}{}\n",
        if cuda { "cuda" } else { "cpu" },
        s.base_dtype,
        s.mixed_precision,
        s.lora.rank,
        s.lora.alpha,
        s.lora.target_modules,
        if s.train_text_encoder {
            " + text encoder q/k/v/out_proj"
        } else {
            ""
        }
    );
    out += &format!(
        "  image {}×{} px → latents {}×{}  micro_batch {}{} × gradient_accumulation_steps {}  gradient checkpointing {}  optimizer {:?}\n",
        d.image_size[0],
        d.image_size[1],
        d.latent_size[0],
        d.latent_size[1],
        s.micro_batch,
        if d.images_per_micro_batch != s.micro_batch {
            format!(
                " ({} images with prior preservation)",
                d.images_per_micro_batch
            )
        } else {
            String::new()
        },
        s.gradient_accumulation_steps,
        yes_no(s.gradient_checkpointing),
        s.optimizer
    );
    out += &format!(
        "  latents cached: {}{}  text encoder: {}\n",
        if s.cache_latents { "yes" } else { "no" },
        if s.keep_models_loaded {
            " (VAE kept loaded for first-epoch encoding and samples)"
        } else {
            ""
        },
        if s.train_text_encoder {
            "trained (LoRA), runs every step"
        } else if s.cache_text_encoder_outputs {
            "frozen, outputs cached"
        } else {
            "frozen, runs every step"
        }
    );
    let rows: Vec<(&str, Bytes, String)> = vec![
        (
            "UNet weights",
            d.unet_weights,
            format!("UNet params × {} B", s.base_dtype.bytes_per_param()),
        ),
        (
            "VAE weights",
            d.vae_weights,
            if d.vae_weights.0 == 0 {
                "not on the device (latents cached)".into()
            } else {
                "VAE params, 16-bit (32-bit for an fp32 base)".into()
            },
        ),
        (
            "text-encoder weights",
            d.text_encoder_weights,
            if d.text_encoder_weights.0 == 0 {
                "not on the device (outputs cached)".into()
            } else {
                "text-encoder params, 16-bit (32-bit for an fp32 base)".into()
            },
        ),
        (
            "autocast weight copies",
            b.autocast_weight_copies,
            "2 B × UNet linear params (32-bit base under autocast)".into(),
        ),
        (
            "adapter params",
            b.adapter_params,
            format!("{} trainable × adapter bytes", e.trainable_params),
        ),
        ("gradients", b.gradients, "trainable × grad bytes".into()),
        (
            "optimizer states",
            b.optimizer_states,
            "AdamW 8 B / 8-bit 2 B / Adafactor 4(n+m) / SGD 4 B".into(),
        ),
        (
            "optimizer step temporaries",
            b.optimizer_step_temporaries,
            "largest tensor's state (or one foreach list)".into(),
        ),
        (
            "UNet activations",
            d.unet_activations,
            if s.gradient_checkpointing {
                "unit inputs + one recomputed unit, × images".into()
            } else {
                "saved ResNet/transformer tensors at the latent size, × images".into()
            },
        ),
        (
            "text-encoder activations",
            d.text_encoder_activations,
            if s.train_text_encoder {
                "77 tokens × layers, × images".into()
            } else {
                "none (not trained)".into()
            },
        ),
        (
            "batch data",
            b.batch_data,
            "latents, noise, noisy latents, prediction + conditioning (fp32)".into(),
        ),
        (
            "context / workspace",
            b.context_workspace,
            if cuda {
                "CUDA context + cuBLAS workspace".into()
            } else {
                "CPU runtime: libtorch, heap, threads".into()
            },
        ),
        (
            "allocator margin",
            b.allocator_margin,
            if cuda {
                "caching allocator: reserved − allocated".into()
            } else {
                "none on CPU (no caching allocator)".into()
            },
        ),
    ];
    let mut table: Vec<(String, String, String, String)> = rows
        .into_iter()
        .map(|(n, v, f)| {
            (
                n.to_string(),
                format!("{:.3}", v.gb()),
                format!("{:.3}", v.gib()),
                f,
            )
        })
        .collect();
    table.push(("─".repeat(3), String::new(), String::new(), String::new()));
    for (n, v, f) in [
        (
            "peak allocated",
            e.peak_allocated,
            if cuda {
                "max_memory_allocated"
            } else {
                "peak live tensor bytes"
            },
        ),
        (
            "peak reserved",
            e.peak_reserved,
            if cuda {
                "max_memory_reserved"
            } else {
                "= allocated on CPU"
            },
        ),
        (
            "total (process peak)",
            e.peak_process,
            if cuda {
                "nvidia-smi"
            } else {
                "process peak RSS"
            },
        ),
    ] {
        table.push((
            n.to_string(),
            format!("{:.3}", v.gb()),
            format!("{:.3}", v.gib()),
            f.to_string(),
        ));
    }
    let w0 = table.iter().map(|r| r.0.chars().count()).max().unwrap_or(4);
    let w1 = table.iter().map(|r| r.1.len()).max().unwrap_or(2).max(2);
    let w2 = table.iter().map(|r| r.2.len()).max().unwrap_or(3).max(3);
    out += &format!(
        "{:<w0$}  {:>w1$}  {:>w2$}  {}\n",
        "term", "GB", "GiB", "formula"
    );
    for r in table {
        out += &format!("{:<w0$}  {:>w1$}  {:>w2$}  {}\n", r.0, r.1, r.2, r.3);
    }
    for n in e.notes.iter().chain(&p.notes) {
        out += &format!("note: {n}\n");
    }
    for c in &p.changes {
        out += &format!(
            "auto_fit: {} {} → {} ({}); peak after {}\n",
            c.setting, c.from, c.to, c.reason, c.peak_after
        );
    }
    if !p.suggestion.is_empty() {
        out += "would fit with (set memory.auto_fit: true to apply, or change the config):\n";
        for c in &p.suggestion {
            out += &format!(
                "  {} {} → {} ({}); peak after {}\n",
                c.setting, c.from, c.to, c.reason, c.peak_after
            );
        }
    }
    out += &match (&p.budget, p.fits) {
        (Some(b), Some(true)) => format!(
            "verdict: fits — predicted peak {} of budget {} ({}), headroom {}\n",
            e.peak,
            b.bytes,
            budget_source(b),
            b.bytes.saturating_sub(e.peak)
        ),
        (Some(b), _) => format!(
            "verdict: DOES NOT FIT — predicted peak {} exceeds budget {} ({}) by {}\n",
            e.peak,
            b.bytes,
            budget_source(b),
            e.peak.saturating_sub(b.bytes)
        ),
        (None, _) => format!("verdict: predicted peak {} (no budget given)\n", e.peak),
    };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn preset_config(yaml: &str) -> TrainConfig {
        TrainConfig::from_yaml_str(yaml).unwrap()
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

    #[test]
    fn auto_fit_writes_the_fitted_settings_back() {
        let mut cfg = preset_config(
            "model: {base_model: sdxl, dtype: bf16}\ndata: {resolution: [1024, 1024]}\ntrain: {batch_size: 4}\nmemory: {gpu: RTX 3060, auto_fit: true}\n",
        );
        let p = plan(&mut cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(true), "{}", report(&p));
        assert!(!p.changes.is_empty());
        assert_eq!(cfg.train.batch_size, p.settings.micro_batch);
        assert_eq!(
            cfg.train.gradient_checkpointing,
            p.settings.gradient_checkpointing
        );
    }
}
