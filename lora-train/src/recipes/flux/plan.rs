//! The memory plan of a FLUX.1 LoRA run, from headers only (no libtorch, no weights).
//!
//! [`plan`] describes the transformer from BFL's single file (`flux1-dev.safetensors`, also in
//! fp8), a ComfyUI GGUF file (city96's `flux1-dev-Q4_K_S.gguf`, kept in its own block types), a
//! diffusers folder (`transformer/`) or a preset name (`flux1-dev`, `flux1-schnell`), turns the
//! [`TrainConfig`] into lora-memory [`Settings`] the way a FLUX run trains — latents and the
//! T5/CLIP outputs cached before training with the encoders then off the device, LoRA on every
//! block linear unless `lora.target_modules` says otherwise, `flux.fp8_base`,
//! `flux.blocks_to_swap`, an fp8 T5 file read as such — estimates the peak (the caching phase
//! included) and checks it against the budget.

use crate::config::{ModelKind, TargetModules, TrainConfig};
use crate::job::{JobError, Plan, Result, resolve_base_model, resolve_path};
use lora_memory::{BaseDtype, Budget, FLUX_BLOCK_LINEARS, ModelDescriptor, Settings};
use std::path::{Path, PathBuf};

/// The transformer files of a FLUX base: the path itself (a `.safetensors` or `.gguf` file, or
/// a folder of safetensors shards), or a diffusers pipeline folder's `transformer/`.
pub(crate) fn transformer_path(path: &Path) -> PathBuf {
    if path.is_dir() && path.join("transformer").is_dir() {
        path.join("transformer")
    } else {
        path.to_path_buf()
    }
}

/// The descriptor of a FLUX transformer at `path` (header only), or `None` when it is
/// something else.
fn flux_descriptor(path: &Path) -> Option<ModelDescriptor> {
    let t = transformer_path(path);
    let gguf = t
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let d = if gguf {
        ModelDescriptor::from_gguf(&t).ok()?
    } else {
        ModelDescriptor::from_safetensors(&t).ok()?
    };
    match d {
        // a diffusers folder: its own text encoders and autoencoder
        ModelDescriptor::Flux(f) if path.is_dir() && path.join("transformer").is_dir() => Some(
            ModelDescriptor::Flux(f.clone().with_diffusers_components(path).unwrap_or(f)),
        ),
        ModelDescriptor::Flux(_) => Some(d),
        _ => None,
    }
}

/// Whether `cfg` is a FLUX run: `model.kind: flux`, a base whose header is a FLUX transformer
/// (single file, GGUF, diffusers folder), or a FLUX preset name that is not a path.
pub fn is_flux_config(cfg: &TrainConfig, config_dir: Option<&Path>) -> bool {
    match cfg.model.kind {
        ModelKind::Flux => return true,
        ModelKind::Auto => {}
        _ => return false,
    }
    let Ok(written) = cfg.base_model() else {
        return false;
    };
    match resolve_base_model(written, config_dir) {
        Ok(p) => flux_descriptor(&p).is_some(),
        Err(_) => matches!(
            ModelDescriptor::preset(written),
            Ok(ModelDescriptor::Flux(_))
        ),
    }
}

/// The descriptor of `cfg`'s base and where it came from.
///
/// # Errors
/// [`JobError::Input`] when the base is a file or folder that is not a FLUX transformer, or a
/// name that is neither a path nor a FLUX preset.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String)> {
    let written = cfg.base_model()?;
    match resolve_base_model(written, config_dir) {
        Ok(p) => flux_descriptor(&p)
            .map(|d| (d, p.display().to_string()))
            .ok_or_else(|| {
                JobError::Input(format!(
                    "model.base_model {written:?} ({}) is not a FLUX.1 transformer: expected BFL's flux1-dev/schnell .safetensors (double_blocks.N…), a FLUX GGUF file or a diffusers folder with transformer/",
                    p.display()
                ))
            }),
        Err(_) => match ModelDescriptor::preset(written) {
            Ok(d @ ModelDescriptor::Flux(_)) => Ok((d, format!("preset {written}"))),
            _ => Err(JobError::Input(format!(
                "model.base_model {written:?} is neither a file nor folder found here nor a FLUX preset (flux1-dev, flux1-schnell)"
            ))),
        },
    }
}

/// The block type most of a GGUF transformer's weights are stored in (by element count), as a
/// lora-memory base dtype.
fn gguf_storage(path: &Path) -> Option<BaseDtype> {
    let h = lora_memory::gguf::read_header(path).ok()?;
    let mut by_type: Vec<(lora_memory::gguf::GgmlType, u64)> = Vec::new();
    for t in &h.tensors {
        match by_type.iter_mut().find(|(k, _)| *k == t.ggml_type) {
            Some((_, n)) => *n += t.numel(),
            None => by_type.push((t.ggml_type, t.numel())),
        }
    }
    by_type.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    by_type.first().and_then(|(t, _)| BaseDtype::from_ggml(*t))
}

/// Whether the first tensor of a safetensors file (or of the first shard of a folder) is
/// float8: ComfyUI's `t5xxl_fp8_e4m3fn.safetensors`, an fp8 FLUX file.
pub(crate) fn stored_in_fp8(path: &Path) -> bool {
    lora_memory::safetensors_header::read_header(path).is_ok_and(|h| {
        h.values()
            .filter(|t| t.shape.len() == 2)
            .any(|t| t.dtype.starts_with("F8"))
    })
}

/// Checks `data.resolution` for a FLUX run: both sides positive multiples of 16 (the
/// autoencoder divides by 8, then latents are packed in 2 × 2 patches).
///
/// # Errors
/// [`JobError::Config`] naming `data.resolution`, the value and a multiple to use.
pub fn check_resolution(cfg: &TrainConfig) -> Result<()> {
    crate::recipes::images::check_resolution_multiple(
        cfg,
        16,
        "for FLUX (latents are 1/8 of it, packed in 2×2 patches)",
        "",
    )
}

/// The double- and single-stream block indices that get LoRA (`None` = every block of that
/// kind), as [`trained_blocks`] returns them.
pub type BlockSelection = (Option<Vec<u32>>, Option<Vec<u32>>);

/// The blocks that get LoRA in a model of `double` double-stream and `single` single-stream
/// blocks: `(double, single)` index lists (`None` = every block of that kind), from
/// `flux.train_blocks` and `flux.train_double_block_indices` / `train_single_block_indices`
/// (kohya `networks.lora_flux`'s network arguments: `train_blocks=single` leaves the
/// double-stream blocks out whatever their indices say).
///
/// # Errors
/// [`JobError::Config`] naming the key whose indices do not exist in this model, or when no
/// block is left to train.
pub fn trained_blocks(cfg: &TrainConfig, double: u32, single: u32) -> Result<BlockSelection> {
    use crate::config::{ConfigError, FluxTrainBlocks, parse_block_indices};
    let f = &cfg.flux;
    let pick = |key: &str, v: &Option<String>, n: u32| -> Result<Option<Vec<u32>>> {
        match v {
            None => Ok(None),
            Some(t) => parse_block_indices(t, n).map_err(|m| {
                JobError::Config(ConfigError::InvalidValue {
                    key: key.into(),
                    value: t.clone(),
                    expected: format!("indices of this model's blocks ({m})"),
                })
            }),
        }
    };
    let d = match f.train_blocks {
        FluxTrainBlocks::Single => Some(Vec::new()),
        _ => pick(
            "flux.train_double_block_indices",
            &f.train_double_block_indices,
            double,
        )?,
    };
    let s = match f.train_blocks {
        FluxTrainBlocks::Double => Some(Vec::new()),
        _ => pick(
            "flux.train_single_block_indices",
            &f.train_single_block_indices,
            single,
        )?,
    };
    if d.as_ref().is_some_and(Vec::is_empty) && s.as_ref().is_some_and(Vec::is_empty) {
        return Err(JobError::Config(ConfigError::InvalidValue {
            key: "flux.train_blocks".into(),
            value: format!(
                "{:?} with double-stream indices {:?} and single-stream indices {:?}",
                f.train_blocks, f.train_double_block_indices, f.train_single_block_indices
            ),
            expected: "settings that leave at least one block to train".into(),
        }));
    }
    Ok((d, s))
}

/// lora-memory settings for a FLUX run of `cfg` on `desc`, and notes on what was assumed.
///
/// # Errors
/// [`JobError::MissingFile`] for a `flux.t5xxl` that does not exist.
pub fn settings_for(
    cfg: &TrainConfig,
    desc: &ModelDescriptor,
    base: Option<&Path>,
    config_dir: Option<&Path>,
    cuda: bool,
) -> Result<(Settings, Vec<String>)> {
    let (mut s, mut notes) = crate::job::settings_for(cfg, None, cuda);
    notes.retain(|n| !n.starts_with("lora.target_modules is a regex"));
    match &cfg.lora.target_modules {
        t @ TargetModules::List(l) if *t != crate::config::default_target_modules() => {
            s.lora.target_modules = l.clone();
        }
        TargetModules::Regex(r) if r != "all-linear" => {
            notes.push(format!(
                "lora.target_modules is a regex ({r:?}): planned as LoRA on every block linear (an upper bound)"
            ));
            s.lora.target_modules = FLUX_BLOCK_LINEARS.iter().map(|t| t.to_string()).collect();
        }
        _ => {
            s.lora.target_modules = FLUX_BLOCK_LINEARS.iter().map(|t| t.to_string()).collect();
        }
    }
    // the stored form of the transformer: a GGUF file as it is, an fp8 file or fp8_base in fp8
    let transformer = base.map(transformer_path);
    let gguf = transformer.as_deref().is_some_and(|p| {
        p.extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    });
    if gguf {
        if let Some(q) = transformer.as_deref().and_then(gguf_storage) {
            s.base_dtype = q;
            notes.push(format!(
                "the GGUF transformer is kept in its own block types (mostly {}), as stored",
                q.name()
            ));
        }
    } else if cfg.flux.fp8_base || transformer.as_deref().is_some_and(stored_in_fp8) {
        s.base_dtype = BaseDtype::Fp8;
    } else if cuda && s.base_dtype == BaseDtype::F32 {
        // kohya loads the frozen transformer in the training dtype; 47.6 GB of fp32 weights is
        // never what a FLUX run means
        s.base_dtype = match s.mixed_precision {
            lora_memory::MixedPrecision::Fp16 | lora_memory::MixedPrecision::FullFp16 => {
                BaseDtype::F16
            }
            _ => BaseDtype::Bf16,
        };
        notes.push(format!(
            "the frozen transformer is held in {} on the GPU (the training dtype, as kohya loads it); flux.fp8_base halves it",
            s.base_dtype.name()
        ));
    }
    // the FLUX loader holds the non-quantized weights in `model.dtype`
    s.quantized_compute_f32_only = false;
    if s.base_dtype.is_quantized() {
        // FLUX computes in 16 bit over a float8 / block-quantized base (one layer decoded at a
        // time); fp32 compute only when asked for on the CPU
        s.quantized_compute_f32 = !cuda && cfg.model.dtype == crate::config::Dtype::F32;
        if s.mixed_precision == lora_memory::MixedPrecision::No && cuda {
            s.mixed_precision = lora_memory::MixedPrecision::Bf16;
            notes.push("a float8 or quantized base computes in bf16 (autocast)".into());
        }
    }
    if let Some(t5) = &cfg.flux.t5xxl {
        let p = resolve_path("flux.t5xxl", t5, config_dir)?;
        if stored_in_fp8(&p) {
            s.text_encoder_dtype = Some(BaseDtype::Fp8);
            notes.push(
                "the T5-XXL file is float8: it encodes the captions in 1 B per parameter".into(),
            );
        }
    }
    s.blocks_to_swap = cfg.flux.blocks_to_swap;
    s.text_tokens = cfg.flux.t5xxl_max_token_length;
    let res = match cfg.data.resolution {
        Some(r) => r,
        None => {
            notes.push(
                "data.resolution is not set: planned at 1024×1024 px (set it to what you train at)"
                    .into(),
            );
            [1024, 1024]
        }
    };
    s.resolution = res[0].max(res[1]);
    s.largest_bucket = (res[0] != res[1]).then_some(res);
    // sample grids at the training size, without classifier-free guidance (dev's guidance is
    // an embedding)
    s.sample_images = crate::recipes::images::planned_sample_images(cfg, false);
    // latents and the text encoders' outputs are computed once, before training; the encoders
    // then leave the device
    s.cache_latents = cfg.data.cache_latents != Some(false);
    if !s.cache_latents {
        notes.push(
            "cache_latents: false — the autoencoder stays on the device and encodes every step"
                .into(),
        );
    }
    // on the CPU the encoders "leave the device" into the same memory
    s.keep_models_loaded = !cuda;
    s.train_text_encoder = cfg.train.train_text_encoder;
    s.cache_text_encoder_outputs = !cfg.train.train_text_encoder;
    // the dataset's subsets (their own random_crop, shuffle_caption, dropout, random caption
    // lines), else the config's keys: random crops and changing captions are encoded as they
    // are drawn, so the autoencoder or the text encoders stay on the device
    let aug = crate::recipes::images::augmentations_of(cfg, config_dir);
    s.random_crop = aug.random_crop;
    s.varying_captions = aug.varying_captions;
    if s.cache_latents && s.random_crop {
        notes.push("random_crop: latents are encoded as the crops are drawn; the autoencoder stays on the device".into());
    }
    if s.varying_captions && !s.train_text_encoder {
        notes.push("captions change between epochs (shuffle_caption / caption dropout): T5 and CLIP stay on the device to encode them as they come".into());
    }
    if let ModelDescriptor::Flux(d) = desc {
        d.swapped_blocks(s.blocks_to_swap).map_err(|e| {
            JobError::Config(crate::config::ConfigError::InvalidValue {
                key: "flux.blocks_to_swap".into(),
                value: s.blocks_to_swap.to_string(),
                expected: format!(
                    "a number of blocks this transformer can swap ({} double- and {} single-stream blocks; kohya keeps at least two of each on the device): {e}",
                    d.double_blocks, d.single_blocks
                ),
            })
        })?;
        // the job puts LoRA inside the blocks only (kohya's lora_flux), unless the targets are
        // a regex of the user's own
        if !matches!(&cfg.lora.target_modules, TargetModules::Regex(r) if r != "all-linear") {
            let (td, ts) = trained_blocks(cfg, d.double_blocks as u32, d.single_blocks as u32)?;
            let count = |v: &Option<Vec<u32>>, n: u64| v.as_ref().map_or(n, |v| v.len() as u64);
            let (cd, cs) = (count(&td, d.double_blocks), count(&ts, d.single_blocks));
            s.flux_trained_blocks = Some((cd, cs));
            if td.is_some() || ts.is_some() {
                notes.push(format!(
                    "LoRA on {cd} of {} double-stream and {cs} of {} single-stream blocks (flux.train_blocks / block indices)",
                    d.double_blocks, d.single_blocks
                ));
            }
        }
        let full = lora_memory::FluxDescriptor::dev();
        if (d.double_blocks, d.single_blocks, d.hidden)
            != (full.double_blocks, full.single_blocks, full.hidden)
        {
            notes.push(format!(
                "this transformer has {} double- and {} single-stream blocks {} wide, not FLUX.1's 19 and 38 at 3072: a partial or damaged file? (planned as read)",
                d.double_blocks, d.single_blocks, d.hidden
            ));
        }
    }
    Ok((s, notes))
}

/// Plans a FLUX run of `cfg`: descriptor (file, folder or preset) → settings → estimate →
/// budget (`override_budget`, else `memory.gpu` / `memory.budget`) → with a budget that is
/// exceeded, the changes lora-memory's `fit()` suggests (`memory.auto_fit: true` applies them).
///
/// # Errors
/// As [`read_descriptor`] and [`settings_for`]; config, budget and estimate errors. Not fitting
/// is *not* an error (see [`Plan::fits`]).
pub fn plan(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    let (desc, source) = read_descriptor(cfg, config_dir)?;
    let base = resolve_base_model(cfg.base_model()?, config_dir).ok();
    check_resolution(cfg)?;
    crate::recipes::images::check_buckets(cfg)?;
    // the sample grid of a kohya prompt file is planned with its prompts (a missing file
    // stops here, as it would stop training)
    let cfg = &*crate::recipes::images::with_prompt_file_read(cfg, config_dir)?;
    let (settings, mut notes) = settings_for(cfg, &desc, base.as_deref(), config_dir, cuda)?;
    notes.extend(cfg.notes());
    let (budget, budget_note) = crate::job::budget_for(cfg, override_budget)?;
    notes.extend(budget_note);
    let estimate = lora_memory::estimate(&desc, &settings)?;
    let mut plan = Plan::new(desc, source, settings, estimate, budget);
    plan.notes = notes;
    plan.fit_to_budget(
        cfg.memory.auto_fit,
        "micro-batch, precision, checkpointing, optimizer, rank, fp8 base, blocks_to_swap, fp8 T5, resolution",
    )?;
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lora_memory::Bytes;

    fn cfg(yaml: &str) -> TrainConfig {
        TrainConfig::from_yaml_str(yaml).unwrap()
    }

    #[test]
    fn a_kohya_flux_config_plans_for_four_card_sizes() {
        // kohya's sample command, as a config of its own names
        let c = cfg(
            "pretrained_model_name_or_path: flux1-dev\nnetwork_dim: 4\nnetwork_alpha: 1\n\
             fp8_base: true\ngradient_checkpointing: true\nmixed_precision: bf16\n\
             optimizer_type: AdamW8bit\nresolution: 1024\ntrain_batch_size: 1\n\
             timestep_sampling: shift\ndiscrete_flow_shift: 3.1582\nguidance_scale: 1.0\n\
             model_prediction_type: raw\nt5xxl_max_token_length: 512\n",
        );
        assert!(is_flux_config(&c, None));
        assert_eq!(c.flux.discrete_flow_shift, 3.1582);
        let mut peaks = Vec::new();
        for gb in ["8GiB", "12GiB", "16GiB", "24GiB"] {
            let p = plan(&c, None, Some(Budget::parse(gb).unwrap()), true).unwrap();
            assert_eq!(p.settings.base_dtype, BaseDtype::Fp8);
            assert_eq!(
                p.settings.lora.target_modules.len(),
                FLUX_BLOCK_LINEARS.len()
            );
            peaks.push((gb, p.fits, p.estimate.peak, p.suggestion.clone()));
        }
        // 16 and 24 GiB fit as written (kohya: "16GB at batch size 1"); 8 and 12 do not, and the
        // suggestion swaps blocks (kohya: 12 GB with blocks_to_swap 16)
        assert_eq!(peaks[2].1, Some(true), "{peaks:?}");
        assert_eq!(peaks[3].1, Some(true), "{peaks:?}");
        for i in [0, 1] {
            assert_eq!(peaks[i].1, Some(false), "{peaks:?}");
            assert!(
                peaks[i].3.iter().any(|c| c.setting == "blocks_to_swap"),
                "{:?}",
                peaks[i].3
            );
        }
        assert!(peaks[0].2 > Bytes::from_gib(8.0));
    }

    #[test]
    fn auto_fit_writes_blocks_to_swap_back() {
        let c = cfg(
            "model: {base_model: flux1-dev}\nflux: {fp8_base: true}\ntrain: {gradient_checkpointing: true, optimizer: adamw8bit, mixed_precision: bf16}\nlora: {rank: 4, alpha: 1}\nmemory: {auto_fit: true}\n",
        );
        let p = plan(&c, None, Some(Budget::parse("12GiB").unwrap()), true).unwrap();
        assert_eq!(p.fits, Some(true));
        assert!(
            p.settings.blocks_to_swap >= 16,
            "{}",
            p.settings.blocks_to_swap
        );
        let mut fixed = c.clone();
        p.apply_to(&mut fixed);
        assert_eq!(fixed.flux.blocks_to_swap, p.settings.blocks_to_swap);
        assert!(fixed.flux.fp8_base);
        assert_eq!(fixed.model.weights, crate::config::BaseWeights::Dense);
    }

    #[test]
    fn a_dense_base_is_16_bit_on_the_gpu_and_resolutions_are_multiples_of_16() {
        let c = cfg("model: {base_model: flux1-dev}\ntrain: {mixed_precision: bf16}\n");
        let p = plan(&c, None, None, true).unwrap();
        assert_eq!(p.settings.base_dtype, BaseDtype::Bf16);
        assert!(
            p.notes.iter().any(|n| n.contains("held in bf16")),
            "{:?}",
            p.notes
        );
        let c = cfg("model: {base_model: flux1-dev}\ndata: {resolution: 1000}\n");
        let e = plan(&c, None, None, true).unwrap_err().to_string();
        assert!(e.contains("data.resolution") && e.contains("1008"), "{e}");
        let c = cfg("model: {base_model: flux1-dev}\ndata: {cache_latents: false}\n");
        let p = plan(&c, None, None, true).unwrap();
        assert!(!p.settings.cache_latents);
        assert!(p.estimate.flux.as_ref().unwrap().vae_weights.0 > 0);
    }

    #[test]
    fn random_crops_keep_the_autoencoder_and_changing_captions_the_text_encoders_on_the_gpu() {
        let plain = plan(&cfg("model: {base_model: flux1-dev}\n"), None, None, true).unwrap();
        let f = plain.estimate.flux.as_ref().unwrap();
        assert_eq!((f.vae_weights.0, f.text_encoder_weights.0), (0, 0));
        let c = cfg("model: {base_model: flux1-dev}\ndata: {random_crop: true}\n");
        let p = plan(&c, None, None, true).unwrap();
        assert!(p.settings.random_crop && !p.settings.varying_captions);
        let f = p.estimate.flux.as_ref().unwrap();
        assert!(f.vae_weights.0 > 0 && f.text_encoder_weights.0 == 0);
        assert!(p.estimate.peak_allocated > plain.estimate.peak_allocated);
        assert!(
            p.report().contains("cached: text-encoder outputs only"),
            "{}",
            p.report()
        );
        let c = cfg("model: {base_model: flux1-dev}\ndata: {shuffle_caption: true}\n");
        let p = plan(&c, None, None, true).unwrap();
        let f = p.estimate.flux.as_ref().unwrap();
        assert!(f.vae_weights.0 == 0 && f.text_encoder_weights.0 > 0);
        assert!(
            p.report().contains("cached: latents only"),
            "{}",
            p.report()
        );
    }

    #[test]
    fn too_many_swapped_blocks_are_refused_by_name() {
        let c = cfg("model: {base_model: flux1-schnell}\nflux: {blocks_to_swap: 40}\n");
        let e = plan(&c, None, None, true).unwrap_err().to_string();
        assert!(e.contains("blocks_to_swap") && e.contains("35"), "{e}");
    }

    #[test]
    fn a_flux_gguf_header_plans_as_stored() {
        // a FLUX GGUF as city96 writes them: BFL names, Q4_K blocks for the block linears
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("flux1-dev-Q4_K_S.gguf");
        use lora_memory::gguf::{GgmlType, GgufTensorInfo, GgufValue, write_test_file};
        let t = |name: &str, dims: &[u64], ggml_type| GgufTensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset: 0,
        };
        let mut tensors = vec![
            t("img_in.weight", &[64, 3072], GgmlType::F16),
            t("txt_in.weight", &[4096, 3072], GgmlType::F16),
            t("guidance_in.in_layer.weight", &[256, 3072], GgmlType::F16),
        ];
        for i in 0..19 {
            tensors.push(t(
                &format!("double_blocks.{i}.img_attn.qkv.weight"),
                &[3072, 9216],
                GgmlType::Q4K,
            ));
        }
        for i in 0..38 {
            tensors.push(t(
                &format!("single_blocks.{i}.linear1.weight"),
                &[3072, 21504],
                GgmlType::Q4K,
            ));
        }
        write_test_file(
            &path,
            &[("general.architecture", GgufValue::String("flux".into()))],
            &tensors,
            None,
        )
        .unwrap();
        let c = cfg(&format!(
            "model: {{base_model: {:?}}}\n",
            path.display().to_string()
        ));
        assert!(is_flux_config(&c, None));
        let p = plan(&c, None, None, true).unwrap();
        assert_eq!(p.settings.base_dtype, BaseDtype::Q4K);
        let ModelDescriptor::Flux(d) = &p.descriptor else {
            panic!("{:?}", p.descriptor)
        };
        assert_eq!((d.double_blocks, d.single_blocks), (19, 38));
        // the tensors as held: Q4_K at 148 B per 256 weights (144 in the file, the packed
        // sub-block scales unpacked) plus the f16 inputs
        let stored = d.stored_bytes.unwrap();
        let q4k = (19 * 3072 * 9216 + 38 * 3072 * 21504) / 256 * 148;
        let f16 = (64 + 4096 + 256) * 3072 * 2;
        assert_eq!(stored, q4k + f16);
        assert_eq!(
            p.estimate.flux.as_ref().unwrap().transformer_weights,
            Bytes(stored)
        );
    }
}
