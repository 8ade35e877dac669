//! diffusers layout: `pytorch_lora_weights.safetensors` with component prefixes.
//!
//! Keys: `<component>.<module>.lora_A.weight` / `.lora_B.weight` (component `unet`, `text_encoder`,
//! `text_encoder_2`, `transformer`), DoRA `.lora_magnitude_vector`. The file has no place for alpha
//! that every loader honours, so the scaling is folded into B when writing (`B' = B · scaling`,
//! alpha = rank implied), which keeps the adapter's strength for any reader. When reading, the older
//! `.lora.down.weight` / `.lora.up.weight` and `.lora_linear_layer.down/up.weight` names are accepted,
//! and an optional `.alpha` tensor is honoured (missing alpha = rank).

use super::{
    AdapterWeights, ModuleLora, check_pair, kind_from_a, load_safetensors, write_safetensors,
};
use crate::error::{Error, Result, TchContext};
use crate::layer::SiteKind;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The conventional file name.
pub const WEIGHTS_FILE: &str = "pytorch_lora_weights.safetensors";

const A_SUFFIXES: [&str; 3] = [
    ".lora_A.weight",
    ".lora.down.weight",
    ".lora_linear_layer.down.weight",
];
const B_SUFFIXES: [&str; 3] = [
    ".lora_B.weight",
    ".lora.up.weight",
    ".lora_linear_layer.up.weight",
];

/// Writes `parts` (component prefix, adapter) to `path`, folding each module's scaling into B.
///
/// # Errors
/// [`Error::Unsupported`] for Embedding modules; I/O errors with the path.
pub fn write(path: &Path, parts: &[(&str, &AdapterWeights)]) -> Result<()> {
    let mut tensors = BTreeMap::new();
    let mut meta = BTreeMap::new();
    for (component, w) in parts {
        for (k, v) in &w.metadata {
            meta.insert(k.clone(), v.clone());
        }
        for (mpath, m) in &w.modules {
            if m.kind == SiteKind::Embedding {
                return Err(Error::Unsupported(format!(
                    "Embedding module {mpath} in the diffusers format; save as PEFT"
                )));
            }
            let s = w.scaling(mpath).unwrap_or(1.0);
            let key = format!("{component}.{mpath}");
            let b = m
                .lora_b
                .f_mul_scalar(s)
                .and_then(|b| b.f_to_kind(m.lora_b.kind()))
                .ctx(|| format!("scaling {key}.lora_B"))?;
            tensors.insert(format!("{key}.lora_A.weight"), m.lora_a.shallow_clone());
            tensors.insert(format!("{key}.lora_B.weight"), b);
            if let Some(mag) = &m.magnitude {
                tensors.insert(format!("{key}.lora_magnitude_vector"), mag.shallow_clone());
            }
        }
    }
    meta.insert("format".into(), "pt".into());
    write_safetensors(path, &tensors, &meta)
}

/// Reads a diffusers LoRA file into one [`AdapterWeights`] per component (`unet`, `text_encoder`, ...).
///
/// # Errors
/// [`Error::Format`] for keys that are not LoRA keys; [`Error::MissingKey`] for half pairs;
/// [`Error::Shape`] / [`Error::Dtype`] naming the key.
pub fn read(path: &Path) -> Result<BTreeMap<String, AdapterWeights>> {
    let mut file = load_safetensors(path)?;
    let mut modules: BTreeSet<String> = BTreeSet::new();
    for key in file.tensors.keys() {
        let base = A_SUFFIXES
            .iter()
            .chain(&B_SUFFIXES)
            .chain(&[".alpha", ".lora_magnitude_vector"])
            .find_map(|s| key.strip_suffix(s))
            .ok_or_else(|| Error::Format {
                file: path.to_path_buf(),
                reason: format!("key {key:?} is not a diffusers LoRA key"),
            })?;
        modules.insert(base.to_string());
    }
    let mut out: BTreeMap<String, AdapterWeights> = BTreeMap::new();
    for full in modules {
        let (component, mpath) = full.split_once('.').ok_or_else(|| Error::Format {
            file: path.to_path_buf(),
            reason: format!("module {full:?} has no component prefix (unet., text_encoder., ...)"),
        })?;
        let find = |suffixes: &[&str]| {
            suffixes
                .iter()
                .map(|s| format!("{full}{s}"))
                .find(|k| file.tensors.contains_key(k))
        };
        let ka = find(&A_SUFFIXES).ok_or_else(|| Error::MissingKey {
            key: format!("{full}.lora_A.weight"),
            file: path.to_path_buf(),
        })?;
        let kb = find(&B_SUFFIXES).ok_or_else(|| Error::MissingKey {
            key: format!("{full}.lora_B.weight"),
            file: path.to_path_buf(),
        })?;
        let a = file.take_float(&ka)?;
        let b = file.take_float(&kb)?;
        let kind = kind_from_a(&ka, &a)?;
        check_pair(&kb, kind, &a, &b)?;
        let r = a.size()[0];
        let alpha = match file.take_alpha(&format!("{full}.alpha"))? {
            Some(v) if v != 0.0 => v,
            _ => r as f64,
        };
        let magnitude = file
            .tensors
            .remove(&format!("{full}.lora_magnitude_vector"));
        let w = out
            .entry(component.to_string())
            .or_insert_with(|| AdapterWeights {
                metadata: file.metadata.clone(),
                ..Default::default()
            });
        w.metadata.remove("format");
        w.modules.insert(
            mpath.to_string(),
            ModuleLora {
                kind,
                lora_a: a,
                lora_b: b,
                alpha,
                magnitude,
            },
        );
    }
    Ok(out)
}
