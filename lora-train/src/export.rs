//! Writing and converting adapters: PEFT folders and kohya single files, with metadata.
//!
//! Formats are lora-core's ([`lora_core::formats`]); this module adds what a training run knows:
//! the config summary, the base model's SHA-256 and the dataset statistics, written into the
//! safetensors `__metadata__` (`lora_train.*` keys, and kohya's `ss_*` keys for kohya files).
//!
//! A kohya file carries the PEFT `adapter_config.json` it came from (or was trained with) as JSON
//! under the metadata key [`PEFT_CONFIG_KEY`], plus kohya's own `ss_sd_model_name` (the base
//! model) and `ss_network_dropout` (`lora_dropout`), so PEFT → kohya → PEFT keeps
//! `base_model_name_or_path`, `lora_dropout`, `target_modules` and `task_type` as they were.
//!
//! kohya has no convention for decoder-only LLMs; their modules are written under the prefix
//! [`KOHYA_LLM_PREFIX`] (`lora_te`, kohya's text-encoder prefix: `model.layers.0.self_attn.q_proj`
//! → `lora_te_model_layers_0_self_attn_q_proj`), and [`llama_site_from_kohya`] maps them back.

use crate::config::{ExportFormat, TrainConfig};
use lora_core::config::LoraConfig;
use lora_core::formats::{AdapterWeights, kohya, peft};
use lora_core::inject::Adaptable;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// kohya module prefix used for LLaMA-family sites.
pub const KOHYA_LLM_PREFIX: &str = "lora_te";

/// Metadata key of a kohya file holding the PEFT `adapter_config.json` (as JSON text) that a
/// conversion back to PEFT restores.
pub const PEFT_CONFIG_KEY: &str = "lora_train.peft_config";

/// Records `cfg` in a kohya file's metadata: the whole config under [`PEFT_CONFIG_KEY`], and
/// kohya's `ss_network_dropout` (`lora_dropout`) and `ss_sd_model_name`
/// (`base_model_name_or_path`) unless already set.
pub fn record_peft_config(cfg: &LoraConfig, meta: &mut BTreeMap<String, String>) {
    if let Ok(json) = serde_json::to_string(cfg) {
        meta.insert(PEFT_CONFIG_KEY.into(), json);
    }
    meta.entry("ss_network_dropout".into())
        .or_insert_with(|| cfg.lora_dropout.to_string());
    if let Some(b) = &cfg.base_model_name_or_path {
        meta.entry("ss_sd_model_name".into())
            .or_insert_with(|| b.clone());
    }
}

/// The PEFT config template a kohya file's metadata describes: the config under
/// [`PEFT_CONFIG_KEY`] when present (written by [`record_peft_config`]); otherwise PEFT's
/// defaults with `base_model_name_or_path` from `ss_sd_model_name` (or `lora_train.base_model`)
/// and `lora_dropout` from `ss_network_dropout`, as other kohya writers set them. `r`,
/// `lora_alpha` and their patterns always come from the tensors ([`peft::config_for`]).
///
/// # Errors
/// [`ExportError::NotAnAdapter`] when [`PEFT_CONFIG_KEY`] holds no valid config.
pub fn peft_template_from_kohya(
    path: &Path,
    meta: &BTreeMap<String, String>,
) -> Result<LoraConfig> {
    if let Some(json) = meta.get(PEFT_CONFIG_KEY) {
        return serde_json::from_str(json).map_err(|e| ExportError::NotAnAdapter {
            path: path.into(),
            reason: format!("metadata {PEFT_CONFIG_KEY} is not a PEFT LoraConfig: {e}"),
        });
    }
    let mut cfg = LoraConfig {
        base_model_name_or_path: meta
            .get("ss_sd_model_name")
            .or_else(|| meta.get("lora_train.base_model"))
            .cloned(),
        ..LoraConfig::default()
    };
    if let Some(d) = meta
        .get("ss_network_dropout")
        .and_then(|d| d.parse::<f64>().ok())
    {
        cfg.lora_dropout = d;
    }
    Ok(cfg)
}

/// Errors writing or converting adapters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// A lora-core format error (with its file and key).
    #[error(transparent)]
    Core(#[from] lora_core::Error),
    /// Reading a file (for hashing) failed.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An input is neither a PEFT folder nor a kohya file.
    #[error(
        "{path}: not an adapter ({reason}); give a PEFT folder (adapter_config.json + adapter_model.safetensors) or a kohya .safetensors file"
    )]
    NotAnAdapter {
        /// The path.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A kohya module name that is not a LLaMA-family site.
    #[error(
        "kohya module {name:?} is not a LLaMA-family site (expected {KOHYA_LLM_PREFIX}_model_layers_<i>_self_attn_<q|k|v|o>_proj, …_mlp_<gate|up|down>_proj, lm_head or model_embed_tokens)"
    )]
    UnknownKohyaModule {
        /// The kohya name.
        name: String,
    },
}

/// `Result` with an [`ExportError`].
pub type Result<T> = std::result::Result<T, ExportError>;

/// SHA-256 of a file, lowercase hex (streamed, 1 MiB at a time).
///
/// # Errors
/// [`ExportError::Io`].
pub fn sha256_file(path: &Path) -> Result<String> {
    let io = |source| ExportError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// What a run writes next to the weights.
#[derive(Debug, Clone, Default)]
pub struct RunMetadata {
    /// Base model file name as given.
    pub base_model: String,
    /// SHA-256 of the base model file (hex), when it is a single file.
    pub base_model_sha256: Option<String>,
    /// Dataset statistics (JSON object: files, bytes, tokens, rows, held-out tokens).
    pub dataset: serde_json::Value,
    /// Optimizer steps done.
    pub steps: u64,
    /// Epochs started.
    pub epochs: u64,
}

/// The metadata map for a run (`lora_train.*` keys plus kohya's `ss_*` keys).
pub fn metadata_for(cfg: &TrainConfig, run: &RunMetadata) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    m.insert(
        "lora_train.version".into(),
        env!("CARGO_PKG_VERSION").into(),
    );
    m.insert(
        "lora_train.config".into(),
        serde_json::to_string(cfg).unwrap_or_default(),
    );
    m.insert("lora_train.base_model".into(), run.base_model.clone());
    if let Some(h) = &run.base_model_sha256 {
        m.insert("lora_train.base_model_sha256".into(), h.clone());
        m.insert("ss_new_sd_model_hash".into(), h.clone());
    }
    m.insert("lora_train.dataset".into(), run.dataset.to_string());
    m.insert("lora_train.steps".into(), run.steps.to_string());
    // kohya's training metadata names (sd-scripts `train_network.py`, `metadata` dict)
    m.insert("ss_network_module".into(), "networks.lora".into());
    m.insert("ss_network_dim".into(), cfg.lora.rank.to_string());
    m.insert("ss_network_alpha".into(), cfg.lora.alpha.to_string());
    m.insert("ss_output_name".into(), cfg.train.output_name.clone());
    m.insert(
        "ss_learning_rate".into(),
        cfg.train.learning_rate.to_string(),
    );
    m.insert("ss_max_train_steps".into(), run.steps.to_string());
    m.insert("ss_epoch".into(), run.epochs.to_string());
    m.insert("ss_seed".into(), cfg.system.seed.to_string());
    m.insert("ss_optimizer".into(), format!("{:?}", cfg.train.optimizer));
    m.insert(
        "ss_lr_scheduler".into(),
        cfg.train.lr_scheduler.name().to_string(),
    );
    m.insert(
        "ss_mixed_precision".into(),
        cfg.train.mixed_precision.name().to_string(),
    );
    m.insert(
        "ss_gradient_checkpointing".into(),
        cfg.train.gradient_checkpointing.to_string(),
    );
    m.insert(
        "ss_gradient_accumulation_steps".into(),
        cfg.train.gradient_accumulation_steps.to_string(),
    );
    m.insert(
        "ss_batch_size_per_device".into(),
        cfg.train.batch_size.to_string(),
    );
    m.insert(
        "ss_sd_model_name".into(),
        Path::new(&run.base_model)
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    m
}

/// Writes adapter `adapter_name` of `model` in every format of `cfg.train.export_formats`:
/// PEFT → `<output_dir>/<output_name>/`, kohya → `<output_dir>/<output_name>.safetensors`.
/// Returns the written paths.
///
/// # Errors
/// lora-core format errors with their paths.
pub fn export_run(
    model: &mut dyn Adaptable,
    adapter_name: &str,
    template: &LoraConfig,
    cfg: &TrainConfig,
    metadata: BTreeMap<String, String>,
    output_dir: &Path,
) -> Result<Vec<PathBuf>> {
    let mut w = AdapterWeights::from_model(model, adapter_name)?;
    w.metadata = metadata;
    if let Some(kind) = cfg
        .train
        .save_precision
        .map(crate::config::SavePrecision::kind)
    {
        w = w.to_kind(kind)?;
    }
    write_formats(&w, template, cfg, output_dir, &cfg.train.output_name)
}

/// Writes `w` in every format of `train.export_formats` under `output_dir` as `stem` (a PEFT
/// folder `stem/`, a kohya file `stem.safetensors`); returns what was written. The export at
/// the end and the snapshots at each save ([`crate::job::snapshots`]) both write through here.
///
/// # Errors
/// As [`export_run`].
pub fn write_formats(
    w: &AdapterWeights,
    template: &LoraConfig,
    cfg: &TrainConfig,
    output_dir: &Path,
    stem: &str,
) -> Result<Vec<PathBuf>> {
    let mut w = w.clone_shallow();
    let mut out = Vec::new();
    for f in &cfg.train.export_formats {
        match f {
            ExportFormat::Peft => {
                let dir = output_dir.join(stem);
                peft::save(&w, Some(template), &dir)?;
                out.push(dir);
            }
            ExportFormat::Kohya => {
                let path = output_dir.join(format!("{stem}.safetensors"));
                // The kohya file also carries the PEFT config, for a later `convert --to peft`.
                let run_metadata = w.metadata.clone();
                let peft_cfg = peft::config_for(&w, Some(template));
                record_peft_config(&peft_cfg, &mut w.metadata);
                let written = kohya::write(&path, &[(KOHYA_LLM_PREFIX, &w)]);
                w.metadata = run_metadata;
                written?;
                out.push(path);
            }
        }
    }
    Ok(out)
}

/// Maps a kohya module name under [`KOHYA_LLM_PREFIX`] back to its LLaMA-family module path
/// (`lora_te_model_layers_3_mlp_gate_proj` → `model.layers.3.mlp.gate_proj`).
///
/// # Errors
/// [`ExportError::UnknownKohyaModule`].
pub fn llama_site_from_kohya(name: &str) -> Result<String> {
    let bad = || ExportError::UnknownKohyaModule {
        name: name.to_string(),
    };
    let rest = name
        .strip_prefix(KOHYA_LLM_PREFIX)
        .and_then(|r| r.strip_prefix('_'))
        .ok_or_else(bad)?;
    match rest {
        "lm_head" => return Ok("lm_head".into()),
        "model_embed_tokens" => return Ok("model.embed_tokens".into()),
        _ => {}
    }
    let rest = rest.strip_prefix("model_layers_").ok_or_else(bad)?;
    let (idx, tail) = rest.split_once('_').ok_or_else(bad)?;
    let i: usize = idx.parse().map_err(|_| bad())?;
    let (block, proj) = if let Some(p) = tail.strip_prefix("self_attn_") {
        ("self_attn", p)
    } else if let Some(p) = tail.strip_prefix("mlp_") {
        ("mlp", p)
    } else {
        return Err(bad());
    };
    let ok = match block {
        "self_attn" => matches!(proj, "q_proj" | "k_proj" | "v_proj" | "o_proj"),
        _ => matches!(proj, "gate_proj" | "up_proj" | "down_proj"),
    };
    if !ok {
        return Err(bad());
    }
    Ok(format!("model.layers.{i}.{block}.{proj}"))
}

/// Reads an adapter from a PEFT folder or a kohya file (LLaMA-family naming).
///
/// # Errors
/// [`ExportError::NotAnAdapter`] and format errors.
pub fn read_adapter(path: &Path) -> Result<(Option<LoraConfig>, AdapterWeights)> {
    if path.is_dir() {
        if !path.join(peft::CONFIG_FILE).is_file() {
            return Err(ExportError::NotAnAdapter {
                path: path.into(),
                reason: format!("the folder has no {}", peft::CONFIG_FILE),
            });
        }
        let (c, w) = peft::load(path)?;
        return Ok((Some(c), w));
    }
    if path.is_file() && path.file_name().is_some_and(|f| f == peft::WEIGHTS_FILE) {
        if let Some(dir) = path.parent() {
            return read_adapter(dir);
        }
    }
    if !path.is_file() {
        return Err(ExportError::NotAnAdapter {
            path: path.into(),
            reason: "no such file or folder".into(),
        });
    }
    let mut file = kohya::read(path).map_err(|e| match e {
        // not safetensors at all (a caption, a config, an image): say what an adapter is
        lora_core::Error::SafeTensors { source, .. } => ExportError::NotAnAdapter {
            path: path.into(),
            reason: format!("not a safetensors file: {source}"),
        },
        e => e.into(),
    })?;
    let sites = file
        .modules
        .keys()
        .map(|k| llama_site_from_kohya(k))
        .collect::<Result<Vec<_>>>()?;
    let w = file.take_prefix(KOHYA_LLM_PREFIX, &sites)?;
    Ok((None, w))
}

/// Converts an adapter between formats: a PEFT folder or kohya file in, `to` out at `output`
/// (a folder for PEFT, a `.safetensors` file for kohya). Strength (`scaling · B·A`) is preserved;
/// metadata is carried over, and the PEFT config travels through a kohya file
/// ([`record_peft_config`], [`peft_template_from_kohya`]).
///
/// # Errors
/// As [`read_adapter`] and the writers.
pub fn convert(input: &Path, to: ExportFormat, output: &Path) -> Result<usize> {
    let (cfg, w) = read_adapter(input)?;
    write_converted(input, cfg, w, to, output)
}

/// The writing half of [`convert`]: writes `w` and `cfg`, as [`read_adapter`] read them from
/// `input`, in format `to` at `output`. Returns the number of modules written. Callers that read
/// the input themselves (to tell a damaged input from a failed write) use this.
///
/// # Errors
/// [`ExportError::NotAnAdapter`] when `input` is a kohya file whose [`PEFT_CONFIG_KEY`] metadata
/// is not a PEFT config (converting to PEFT); the writers' errors with the output path.
pub fn write_converted(
    input: &Path,
    cfg: Option<LoraConfig>,
    mut w: AdapterWeights,
    to: ExportFormat,
    output: &Path,
) -> Result<usize> {
    match to {
        ExportFormat::Peft => {
            let mut template = match cfg {
                Some(c) => c,
                None => peft_template_from_kohya(input, &w.metadata)?,
            };
            // The config now lives in adapter_config.json.
            w.metadata.remove(PEFT_CONFIG_KEY);
            if template.task_type.is_none() {
                template.task_type = Some("CAUSAL_LM".into());
            }
            peft::save(&w, Some(&template), output)?;
        }
        ExportFormat::Kohya => {
            if let Some(c) = &cfg {
                record_peft_config(&peft::config_for(&w, Some(c)), &mut w.metadata);
            }
            kohya::write(output, &[(KOHYA_LLM_PREFIX, &w)])?
        }
    }
    Ok(w.modules.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kohya_names_map_back_to_llama_sites() {
        for site in [
            "model.layers.0.self_attn.q_proj",
            "model.layers.29.mlp.down_proj",
            "model.layers.7.mlp.gate_proj",
            "lm_head",
            "model.embed_tokens",
        ] {
            let k = kohya::kohya_name(KOHYA_LLM_PREFIX, site);
            assert_eq!(llama_site_from_kohya(&k).unwrap(), site, "{k}");
        }
        assert!(llama_site_from_kohya("lora_unet_down_blocks_0_proj_in").is_err());
        assert!(llama_site_from_kohya("lora_te_model_layers_x_mlp_up_proj").is_err());
        assert!(llama_site_from_kohya("lora_te_model_layers_1_mlp_q_proj").is_err());
    }

    #[test]
    fn sha256_matches_a_known_vector() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        // FIPS 180-2 appendix B.1 test vector
        assert_eq!(
            sha256_file(&p).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
