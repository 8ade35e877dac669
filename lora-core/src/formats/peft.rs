//! PEFT layout: a folder with `adapter_config.json` and `adapter_model.safetensors`.
//!
//! Keys (PEFT `peft/utils/save_and_load.py::get_peft_model_state_dict`, adapter name removed):
//! - `base_model.model.<module>.lora_A.weight` `[r, in]` (conv `[r, in, kh, kw]`)
//! - `base_model.model.<module>.lora_B.weight` `[out, r]` (conv `[out, r, 1, 1]`)
//! - `base_model.model.<module>.lora_embedding_A` `[r, num_embeddings]`, `.lora_embedding_B` `[dim, r]`
//! - DoRA: `base_model.model.<module>.lora_magnitude_vector` `[out]` (conv: PEFT's `[1, out, 1, 1]`)
//!
//! Per-module ranks / alphas that differ from the most common one are written as `rank_pattern` /
//! `alpha_pattern` entries keyed by the escaped full module path.

use super::{
    AdapterWeights, ModuleLora, check_pair, kind_from_a, load_safetensors, write_safetensors,
};
use crate::config::{LoraConfig, TargetModules};
use crate::error::{Error, Result, TchContext};
use crate::inject::{Adaptable, InjectionReport};
use crate::layer::SiteKind;
use std::collections::BTreeMap;
use std::path::Path;

/// File name of the config.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// File name of the weights.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// Key prefix PEFT puts before module paths.
pub const PREFIX: &str = "base_model.model.";

/// Builds the `adapter_config.json` for `weights`: starts from `template` (or PEFT defaults), sets
/// `r` / `lora_alpha` to the most common values, writes `rank_pattern` / `alpha_pattern` for the
/// other modules, `use_rslora` / `use_dora` from the weights, and `target_modules` (kept from the
/// template when given, otherwise the list of module paths).
pub fn config_for(weights: &AdapterWeights, template: Option<&LoraConfig>) -> LoraConfig {
    let mut cfg = template.cloned().unwrap_or_default();
    let (r, alpha) = weights.dominant_rank_alpha();
    cfg.r = r;
    cfg.lora_alpha = alpha;
    cfg.rank_pattern = BTreeMap::new();
    cfg.alpha_pattern = BTreeMap::new();
    for (path, m) in &weights.modules {
        if m.rank() != r {
            cfg.rank_pattern.insert(regex::escape(path), m.rank());
        }
        if m.alpha != alpha {
            cfg.alpha_pattern.insert(regex::escape(path), m.alpha);
        }
    }
    cfg.use_rslora = weights.use_rslora;
    cfg.use_dora = weights.use_dora();
    cfg.peft_type = "LORA".into();
    if cfg.target_modules.is_none() {
        cfg.target_modules = Some(TargetModules::List(
            weights.modules.keys().cloned().collect(),
        ));
    }
    cfg
}

fn json_err(path: &Path) -> impl FnOnce(serde_json::Error) -> Error + '_ {
    move |source| Error::Json {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `weights` as a PEFT adapter folder `dir` (created if needed); see [`config_for`].
/// Tensors keep their dtype (bit-identical round trip).
///
/// # Errors
/// [`Error::Io`] / [`Error::SafeTensors`] / [`Error::Json`] with the path.
pub fn save(
    weights: &AdapterWeights,
    template: Option<&LoraConfig>,
    dir: &Path,
) -> Result<LoraConfig> {
    let cfg = config_for(weights, template);
    let mut tensors = BTreeMap::new();
    for (path, m) in &weights.modules {
        let key = format!("{PREFIX}{path}");
        match m.kind {
            SiteKind::Embedding => {
                tensors.insert(format!("{key}.lora_embedding_A"), m.lora_a.shallow_clone());
                tensors.insert(format!("{key}.lora_embedding_B"), m.lora_b.shallow_clone());
            }
            _ => {
                tensors.insert(format!("{key}.lora_A.weight"), m.lora_a.shallow_clone());
                tensors.insert(format!("{key}.lora_B.weight"), m.lora_b.shallow_clone());
            }
        }
        if let Some(mag) = &m.magnitude {
            let mag = if m.kind == SiteKind::Conv2d {
                mag.f_reshape([1, -1, 1, 1])
                    .ctx(|| format!("reshaping magnitude of {path}"))?
            } else {
                mag.shallow_clone()
            };
            tensors.insert(format!("{key}.lora_magnitude_vector"), mag);
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let cfg_path = dir.join(CONFIG_FILE);
    let text = serde_json::to_string_pretty(&cfg).map_err(json_err(&cfg_path))?;
    std::fs::write(&cfg_path, text).map_err(|source| Error::Io {
        path: cfg_path.clone(),
        source,
    })?;
    let mut meta = weights.metadata.clone();
    meta.insert("format".into(), "pt".into());
    write_safetensors(&dir.join(WEIGHTS_FILE), &tensors, &meta)?;
    Ok(cfg)
}

/// Reads `dir/adapter_config.json` alone.
///
/// # Errors
/// [`Error::Io`] / [`Error::Json`] with the path; [`Error::Config`] when `peft_type` is not `LORA`.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
        path: cfg_path.clone(),
        source,
    })?;
    let cfg: LoraConfig = serde_json::from_str(&text).map_err(json_err(&cfg_path))?;
    if cfg.peft_type != "LORA" {
        return Err(Error::Config(format!(
            "{}: peft_type {:?} is not LORA",
            cfg_path.display(),
            cfg.peft_type
        )));
    }
    Ok(cfg)
}

/// Reads a PEFT adapter folder: config and weights (alpha per module from `lora_alpha` /
/// `alpha_pattern`; ranks are checked against `r` / `rank_pattern`).
///
/// # Errors
/// [`Error::MissingKey`] for a module with A but no B (or vice versa); [`Error::Format`] for keys that
/// are not LoRA keys of this layout; [`Error::Shape`] / [`Error::Dtype`] naming the key.
pub fn load(dir: &Path) -> Result<(LoraConfig, AdapterWeights)> {
    let cfg = read_config(dir)?;
    let mut file = load_safetensors(&dir.join(WEIGHTS_FILE))?;
    let mut paths: BTreeMap<String, SiteKind> = BTreeMap::new();
    let keys: Vec<String> = file.tensors.keys().cloned().collect();
    for key in &keys {
        let rest = key.strip_prefix(PREFIX).ok_or_else(|| Error::Format {
            file: file.path.clone(),
            reason: format!("key {key:?} does not start with {PREFIX:?}"),
        })?;
        let (path, kind) = if let Some(p) = rest.strip_suffix(".lora_A.weight") {
            (p, None)
        } else if let Some(p) = rest.strip_suffix(".lora_B.weight") {
            (p, None)
        } else if let Some(p) = rest.strip_suffix(".lora_embedding_A") {
            (p, Some(SiteKind::Embedding))
        } else if let Some(p) = rest.strip_suffix(".lora_embedding_B") {
            (p, Some(SiteKind::Embedding))
        } else if let Some(p) = rest.strip_suffix(".lora_magnitude_vector") {
            (p, None)
        } else {
            return Err(Error::Format {
                file: file.path.clone(),
                reason: format!(
                    "key {key:?} is not a LoRA key (expected .lora_A.weight, .lora_B.weight, .lora_embedding_A/B or .lora_magnitude_vector)"
                ),
            });
        };
        let e = paths.entry(path.to_string()).or_insert(SiteKind::Linear);
        if let Some(k) = kind {
            *e = k;
        }
    }
    let mut weights = AdapterWeights {
        use_rslora: cfg.use_rslora,
        metadata: file.metadata.clone(),
        ..Default::default()
    };
    weights.metadata.remove("format");
    for (path, kind) in paths {
        let key = format!("{PREFIX}{path}");
        let (ka, kb) = if kind == SiteKind::Embedding {
            (
                format!("{key}.lora_embedding_A"),
                format!("{key}.lora_embedding_B"),
            )
        } else {
            (
                format!("{key}.lora_A.weight"),
                format!("{key}.lora_B.weight"),
            )
        };
        let a = file.take_float(&ka)?;
        let b = file.take_float(&kb)?;
        let kind = if kind == SiteKind::Embedding {
            kind
        } else {
            kind_from_a(&ka, &a)?
        };
        check_pair(&kb, kind, &a, &b)?;
        let r = a.size()[0];
        let want = cfg.rank_for(&path);
        if r != want {
            return Err(Error::Shape {
                key: ka,
                expected: vec![want, -1],
                found: a.size(),
            });
        }
        let magnitude = match file.tensors.remove(&format!("{key}.lora_magnitude_vector")) {
            Some(m) => Some(
                m.f_reshape([-1])
                    .ctx(|| format!("reading {key}.lora_magnitude_vector"))?,
            ),
            None if cfg.use_dora => {
                return Err(Error::MissingKey {
                    key: format!("{key}.lora_magnitude_vector"),
                    file: file.path.clone(),
                });
            }
            None => None,
        };
        if let Some(m) = &magnitude {
            let out = b.size()[0];
            if m.size() != [out] {
                return Err(Error::Shape {
                    key: format!("{key}.lora_magnitude_vector"),
                    expected: vec![out],
                    found: m.size(),
                });
            }
        }
        weights.modules.insert(
            path.clone(),
            ModuleLora {
                kind,
                lora_a: a,
                lora_b: b,
                alpha: cfg.alpha_for(&path),
                magnitude,
            },
        );
    }
    Ok((cfg, weights))
}

/// Saves adapter `adapter_name` of `model` as a PEFT folder, starting from `template` for the
/// config's other fields (task type, target_modules, base model name, ...).
///
/// # Errors
/// See [`AdapterWeights::from_model`] and [`save`].
pub fn save_adapter(
    model: &mut dyn Adaptable,
    adapter_name: &str,
    template: Option<&LoraConfig>,
    dir: &Path,
) -> Result<LoraConfig> {
    let w = AdapterWeights::from_model(model, adapter_name)?;
    save(&w, template, dir)
}

/// Loads a PEFT folder into `model` as adapter `adapter_name` (tensors in `vs`, the config's
/// `lora_dropout` for training).
///
/// # Errors
/// See [`load`] and [`AdapterWeights::load_into`].
pub fn load_adapter(
    model: &mut dyn Adaptable,
    dir: &Path,
    adapter_name: &str,
    vs: &tch::nn::Path,
) -> Result<(LoraConfig, InjectionReport)> {
    let (cfg, w) = load(dir)?;
    let report = w.load_into(model, adapter_name, vs, cfg.lora_dropout)?;
    Ok((cfg, report))
}
