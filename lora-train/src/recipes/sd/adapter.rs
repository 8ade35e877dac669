//! SD adapter files: kohya and diffusers export, run metadata, and reading adapters back.

use super::*;

/// The Stable Diffusion generation a pipeline belongs to (kohya's `ss_base_model_version`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SdVersion {
    /// SD 1.x (cross-attention 768).
    V1,
    /// SD 2.x (cross-attention 1024, OpenCLIP-H).
    V2,
    /// SDXL (two text encoders, `text_time` added conditioning).
    Xl,
}

impl SdVersion {
    /// The version of `pipe`: SDXL with a second text encoder, else SD 2.x when the UNet's
    /// cross-attention width is 1024, else SD 1.x.
    pub fn of(pipe: &SdPipeline) -> Self {
        if pipe.is_sdxl() {
            SdVersion::Xl
        } else if pipe.unet.plan().cross_attention_dim.first() == Some(&1024) {
            SdVersion::V2
        } else {
            SdVersion::V1
        }
    }

    /// sd-scripts' `ss_base_model_version` (`sd_v1`, `sd_v2`, `sdxl_base_v1-0`).
    pub fn kohya_name(self) -> &'static str {
        match self {
            SdVersion::V1 => "sd_v1",
            SdVersion::V2 => "sd_v2",
            SdVersion::Xl => "sdxl_base_v1-0",
        }
    }
}

/// kohya metadata of an SD adapter on top of `base`: `ss_base_model_version` (as sd-scripts
/// writes it, see [`SdVersion::kohya_name`]), `ss_v2`, `ss_network_train_unet_only`.
pub fn sd_metadata(
    mut base: std::collections::BTreeMap<String, String>,
    version: SdVersion,
    unet_only: bool,
) -> std::collections::BTreeMap<String, String> {
    let py_bool = |b: bool| if b { "True" } else { "False" };
    base.insert("ss_base_model_version".into(), version.kohya_name().into());
    base.insert("ss_v2".into(), py_bool(version == SdVersion::V2).into());
    base.insert(
        "ss_network_train_unet_only".into(),
        py_bool(unet_only).into(),
    );
    base
}

/// The adapters of a pipeline by component (`unet`, and `text_encoder` / `text_encoder_2`
/// when they carry the adapter).
///
/// # Errors
/// [`lora_core::Error::Adapter`] when the UNet lacks the adapter.
fn pipeline_weights(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    kind: Option<tch::Kind>,
) -> lora_core::Result<Vec<(&'static str, AdapterWeights)>> {
    let parts = pipeline_weights_as_trained(pipe, adapter_name)?;
    match kind {
        None => Ok(parts),
        Some(k) => parts
            .into_iter()
            .map(|(c, w)| Ok((c, w.to_kind(k)?)))
            .collect(),
    }
}

/// The adapter `adapter_name` of each model of `pipe` that has it, as trained: `("unet", …)`,
/// then `("text_encoder", …)` / `("text_encoder_2", …)` when the text encoders were trained.
///
/// # Errors
/// lora-core errors.
pub fn pipeline_weights_as_trained(
    pipe: &mut SdPipeline,
    adapter_name: &str,
) -> lora_core::Result<Vec<(&'static str, AdapterWeights)>> {
    let optional = |r: lora_core::Result<AdapterWeights>| match r {
        Ok(w) => Ok(Some(w)),
        Err(lora_core::Error::Adapter { .. }) => Ok(None),
        Err(e) => Err(e),
    };
    let mut parts = vec![(
        "unet",
        AdapterWeights::from_model(&mut pipe.unet, adapter_name)?,
    )];
    if let Some(w) = optional(AdapterWeights::from_model(
        &mut pipe.text_encoder,
        adapter_name,
    ))? {
        parts.push(("text_encoder", w));
    }
    if let Some(te2) = pipe.text_encoder_2.as_mut()
        && let Some(w) = optional(AdapterWeights::from_model(te2, adapter_name))?
    {
        parts.push(("text_encoder_2", w));
    }
    Ok(parts)
}

/// Writes adapter `adapter_name` of `pipe` as one kohya file at `path`: UNet modules under
/// `lora_unet_` (diffusers module names, which diffusers, ComfyUI and A1111/Forge map), text
/// encoder modules (when trained) under `lora_te_` — SDXL: `lora_te1_` / `lora_te2_` — (see
/// [`kohya_prefix`]), f32 `.alpha`, `metadata` in the header.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_kohya(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    metadata: std::collections::BTreeMap<String, String>,
    path: &Path,
) -> lora_core::Result<()> {
    write_kohya_as(pipe, adapter_name, metadata, path, None)
}

/// [`write_kohya`] with the tensors in `kind` (kohya's `save_precision`; `None` = as trained).
///
/// # Errors
/// As [`write_kohya`].
pub fn write_kohya_as(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    metadata: std::collections::BTreeMap<String, String>,
    path: &Path,
    kind: Option<tch::Kind>,
) -> lora_core::Result<()> {
    let sdxl = pipe.is_sdxl();
    let mut parts = pipeline_weights(pipe, adapter_name, kind)?;
    if let Some((_, unet)) = parts.first_mut() {
        unet.metadata = metadata;
    }
    write_kohya_parts(&parts, sdxl, path)
}

/// Writes the models' adapters `parts` (`("unet", …)`, `("text_encoder", …)`, …; the first
/// part's metadata goes into the header) as one kohya file at `path`, with
/// [`kohya_prefix`]es for SD 1.x/2.x or (`sdxl`) SDXL.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_kohya_parts(
    parts: &[(&'static str, AdapterWeights)],
    sdxl: bool,
    path: &Path,
) -> lora_core::Result<()> {
    let refs: Vec<(&str, &AdapterWeights)> = parts
        .iter()
        .map(|(c, w)| (kohya_prefix(c, sdxl), w))
        .collect();
    lora_core::formats::kohya::write(path, &refs)
}

/// Writes adapter `adapter_name` of `pipe` as diffusers' `pytorch_lora_weights.safetensors`
/// into `dir` (`unet.…`, and `text_encoder.…` / `text_encoder_2.…` when the text encoders were
/// trained; the file `StableDiffusion[XL]Pipeline.load_lora_weights(dir)` reads). Returns the
/// file.
///
/// # Errors
/// lora-core format errors with the path.
pub fn write_diffusers(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    dir: &Path,
) -> lora_core::Result<PathBuf> {
    write_diffusers_as(pipe, adapter_name, dir, None)
}

/// [`write_diffusers`] with the tensors in `kind` (`None` = as trained).
///
/// # Errors
/// As [`write_diffusers`].
pub fn write_diffusers_as(
    pipe: &mut SdPipeline,
    adapter_name: &str,
    dir: &Path,
    kind: Option<tch::Kind>,
) -> lora_core::Result<PathBuf> {
    let parts = pipeline_weights(pipe, adapter_name, kind)?;
    write_diffusers_parts(&parts, dir)
}

/// Writes the models' adapters `parts` as diffusers' `pytorch_lora_weights.safetensors` in
/// `dir` (created); returns the file.
///
/// # Errors
/// lora-core format and I/O errors with the path.
pub fn write_diffusers_parts(
    parts: &[(&'static str, AdapterWeights)],
    dir: &Path,
) -> lora_core::Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(|e| lora_core::Error::Io {
        path: dir.to_path_buf(),
        source: e,
    })?;
    let path = dir.join(lora_core::formats::diffusers::WEIGHTS_FILE);
    let refs: Vec<(&str, &AdapterWeights)> = parts.iter().map(|(c, w)| (*c, w)).collect();
    lora_core::formats::diffusers::write(&path, &refs)?;
    Ok(path)
}

/// How many modules [`load_adapter`] put on each component.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LoadedAdapter {
    /// UNet modules.
    pub unet_modules: usize,
    /// Text-encoder modules (SDXL: the first encoder's).
    pub text_encoder_modules: usize,
    /// SDXL `text_encoder_2` modules.
    pub text_encoder_2_modules: usize,
}

fn site_list(model: &mut dyn lora_core::inject::Adaptable) -> lora_core::Result<Vec<String>> {
    let mut sites = Vec::new();
    model.visit_sites(&mut |p, _| {
        sites.push(p.to_string());
        Ok(())
    })?;
    Ok(sites)
}

/// The module path of UNet site `site` (diffusers name) in the original (CompVis / Stability
/// `sgm`) UNet, which sd-scripts' SDXL LoRA names its `lora_unet_` modules after
/// (`down_blocks.1.attentions.0.proj_in` → `input_blocks.4.1.proj_in`, `…resnets.0.conv1` →
/// `…in_layers.2`); lora-models' [`ldm_unet_key`] layout. `None` for sites without one.
///
/// [`ldm_unet_key`]: lora_models::sd::load::ldm_unet_key
pub fn original_unet_module(site: &str, unet: &UNet2DConditionModel) -> Option<String> {
    let plan = unet.plan();
    let layout = lora_models::sd::load::UnetLayout {
        layers_per_block: usize::try_from(*plan.layers.first()?).ok()?,
        down_attn: plan.down_attn.clone(),
        up_attn: plan.up_attn.clone(),
    };
    let key = lora_models::sd::load::ldm_unet_key(&format!("{site}.weight"), &layout)?;
    key.strip_prefix(lora_models::sd::load::LDM_UNET_PREFIX)?
        .strip_suffix(".weight")
        .map(String::from)
}

/// Loads an SD 1.x/2.x or SDXL LoRA file into `pipe` as adapter `adapter_name` (tensors in
/// `vs`), told apart by the keys:
/// - kohya: `lora_unet_…` with diffusers module names or, as sd-scripts writes SDXL adapters,
///   original ones (`lora_unet_input_blocks_4_1_…`, see [`original_unet_module`]); `lora_te_…`
///   (SD 1.x/2.x) or `lora_te1_…` / `lora_te2_…` (SDXL); alpha honoured, missing = rank;
/// - diffusers / PEFT for diffusers: `unet.<module>.lora_A.weight`, `text_encoder.<module>…`,
///   `text_encoder_2.<module>…` (transformers 5 text-encoder names without `text_model.` are
///   accepted).
///
/// # Errors
/// lora-core format errors naming the file and the modules that match no site; an error for
/// text-encoder prefixes or components the pipeline does not have (SDXL adapters on SD 1.x and
/// the reverse).
pub fn load_adapter(
    pipe: &mut SdPipeline,
    path: &Path,
    adapter_name: &str,
    vs: &tch::nn::Path,
) -> lora_core::Result<LoadedAdapter> {
    let sdxl = pipe.is_sdxl();
    let header = lora_core::formats::read_header(path)?;
    let kohya = header.tensors.keys().any(|k| {
        ["lora_unet_", "lora_te_", "lora_te1_", "lora_te2_"]
            .iter()
            .any(|p| k.starts_with(p))
    });
    let fmt_err = |reason: String| lora_core::Error::Format {
        file: path.to_path_buf(),
        reason,
    };
    let what = if sdxl {
        "an SDXL pipeline has lora_unet_, lora_te1_ and lora_te2_"
    } else {
        "an SD 1.x/2.x pipeline has lora_unet_ and lora_te_ (lora_te1_/lora_te2_ are SDXL's)"
    };
    let (unet, mut te, mut te2) = if kohya {
        let mut f = lora_core::formats::kohya::read(path)?;
        let unet_sites = site_list(&mut pipe.unet)?;
        // sd-scripts' SDXL names: original UNet module paths
        for site in &unet_sites {
            if let Some(orig) = original_unet_module(site, &pipe.unet) {
                let from = lora_core::formats::kohya::kohya_name(KOHYA_UNET_PREFIX, &orig);
                if let Some(m) = f.modules.remove(&from) {
                    f.modules.insert(
                        lora_core::formats::kohya::kohya_name(KOHYA_UNET_PREFIX, site),
                        m,
                    );
                }
            }
        }
        let unet = f.take_prefix(KOHYA_UNET_PREFIX, &unet_sites)?;
        let te = f.take_prefix(
            kohya_prefix("text_encoder", sdxl),
            &site_list(&mut pipe.text_encoder)?,
        )?;
        let te2 = match pipe.text_encoder_2.as_mut() {
            Some(m) => f.take_prefix(KOHYA_TE2_PREFIX, &site_list(m)?)?,
            None => AdapterWeights::default(),
        };
        if let Some(k) = f.modules.keys().next() {
            return Err(fmt_err(format!(
                "module {k:?} belongs to no component of this pipeline: {what}"
            )));
        }
        (unet, te, te2)
    } else {
        let mut parts = lora_core::formats::diffusers::read(path)?;
        let unet = parts.remove("unet").unwrap_or_default();
        let te = parts.remove("text_encoder").unwrap_or_default();
        let te2 = if sdxl {
            parts.remove("text_encoder_2").unwrap_or_default()
        } else {
            AdapterWeights::default()
        };
        if let Some(k) = parts.keys().next() {
            return Err(fmt_err(format!(
                "component {k:?}: {}",
                if sdxl {
                    "an SDXL pipeline has `unet`, `text_encoder` and `text_encoder_2`"
                } else {
                    "an SD 1.x/2.x pipeline has `unet` and `text_encoder`"
                }
            )));
        }
        (unet, te, te2)
    };
    lora_models::clip::canonicalize_adapter(&mut te);
    lora_models::clip::canonicalize_adapter(&mut te2);
    let mut n = LoadedAdapter {
        unet_modules: unet.modules.len(),
        text_encoder_modules: te.modules.len(),
        text_encoder_2_modules: te2.modules.len(),
    };
    if n.unet_modules + n.text_encoder_modules + n.text_encoder_2_modules == 0 {
        return Err(fmt_err("no LoRA module in the file".into()));
    }
    if n.unet_modules > 0 {
        n.unet_modules = unet
            .load_into(&mut pipe.unet, adapter_name, &(vs / "unet"), 0.0)?
            .modules
            .len();
    }
    if n.text_encoder_modules > 0 {
        n.text_encoder_modules = te
            .load_into(
                &mut pipe.text_encoder,
                adapter_name,
                &(vs / "text_encoder"),
                0.0,
            )?
            .modules
            .len();
    }
    if n.text_encoder_2_modules > 0
        && let Some(m) = pipe.text_encoder_2.as_mut()
    {
        n.text_encoder_2_modules = te2
            .load_into(m, adapter_name, &(vs / "text_encoder_2"), 0.0)?
            .modules
            .len();
    }
    Ok(n)
}
