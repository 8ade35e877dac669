//! kohya (sd-scripts `networks/lora.py`) layout, read by ComfyUI / A1111 / Forge.
//!
//! One safetensors file; per module `<prefix>_<path with '.' → '_'>`:
//! - `.lora_down.weight` `[r, in]` (conv `[r, in, kh, kw]`) = A,
//! - `.lora_up.weight` `[out, r]` (conv `[out, r, 1, 1]`) = B,
//! - `.alpha` — a 0-d tensor, always written as f32 (bf16 alpha crashes some readers).
//!
//! Prefixes: `lora_unet` (UNet), `lora_te` (SD1.x text encoder), `lora_te1` / `lora_te2` (SDXL).
//! Scaling is `alpha / r`; alpha missing or 0 means alpha = r (sd-scripts `LoRAModule.__init__`).
//! rsLoRA adapters are written with `alpha' = alpha · sqrt(r)` so that `alpha' / r = alpha / sqrt(r)`.
//! Header metadata: `ss_network_module`, `ss_network_dim`, `ss_network_alpha`, `ss_network_args`
//! (plus whatever the adapter's metadata holds, e.g. `ss_base_model_version`, `ss_v2`, training stats).

use super::{
    AdapterWeights, ModuleLora, check_pair, kind_from_a, load_safetensors, write_safetensors,
};
use crate::error::{Error, Result, TchContext};
use crate::layer::SiteKind;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::Tensor;

/// kohya module-name prefix of UNet adapters (sd-scripts `networks/lora.py`
/// `LORA_PREFIX_UNET`).
pub const KOHYA_UNET_PREFIX: &str = "lora_unet";
/// kohya prefix of the SD 1.x/2.x text encoder (`LORA_PREFIX_TEXT_ENCODER`).
pub const KOHYA_TE_PREFIX: &str = "lora_te";
/// kohya prefix of SDXL's first text encoder, CLIP ViT-L (`LORA_PREFIX_TEXT_ENCODER1`).
pub const KOHYA_TE1_PREFIX: &str = "lora_te1";
/// kohya prefix of SDXL's second text encoder, OpenCLIP bigG (`LORA_PREFIX_TEXT_ENCODER2`).
pub const KOHYA_TE2_PREFIX: &str = "lora_te2";

/// The kohya prefix of a diffusion pipeline's component: `"unet"` → `lora_unet`;
/// `"text_encoder"` → `lora_te` (SD 1.x/2.x) or `lora_te1` (SDXL); anything else (SDXL's
/// `"text_encoder_2"`) → `lora_te2` — sd-scripts `networks/lora.py` `LORA_PREFIX_UNET`,
/// `LORA_PREFIX_TEXT_ENCODER{,1,2}`.
pub fn kohya_prefix(component: &str, sdxl: bool) -> &'static str {
    match (component, sdxl) {
        ("unet", _) => KOHYA_UNET_PREFIX,
        ("text_encoder", false) => KOHYA_TE_PREFIX,
        ("text_encoder", true) => KOHYA_TE1_PREFIX,
        _ => KOHYA_TE2_PREFIX,
    }
}

/// The kohya module name of module `path` under `prefix` (`"lora_unet"`, `"lora_te"`, ...).
pub fn kohya_name(prefix: &str, path: &str) -> String {
    format!("{prefix}_{}", path.replace('.', "_"))
}

/// A kohya file's modules, keyed by kohya module name, before they are matched to a model.
#[derive(Debug)]
pub struct KohyaFile {
    /// kohya module name (e.g. `lora_unet_down_blocks_0_attentions_0_proj_in`) → weights
    /// (alpha already resolved: missing / 0 → rank).
    pub modules: BTreeMap<String, ModuleLora>,
    /// The `__metadata__` of the file (`ss_*`).
    pub metadata: BTreeMap<String, String>,
    /// Where it was read from.
    pub path: PathBuf,
}

impl KohyaFile {
    /// Takes the modules under `prefix` and maps them back to module paths using the model's site
    /// names (`kohya_name(prefix, site)`); the result has plain `alpha / r` scaling.
    ///
    /// # Errors
    /// [`Error::Format`] listing kohya names under `prefix` that match no site.
    pub fn take_prefix<S: AsRef<str>>(
        &mut self,
        prefix: &str,
        site_names: &[S],
    ) -> Result<AdapterWeights> {
        let mut w = AdapterWeights {
            metadata: self.metadata.clone(),
            ..Default::default()
        };
        for site in site_names {
            let k = kohya_name(prefix, site.as_ref());
            if let Some(m) = self.modules.remove(&k) {
                w.modules.insert(site.as_ref().to_string(), m);
            }
        }
        let head = format!("{prefix}_");
        let left: Vec<&str> = self
            .modules
            .keys()
            .filter(|k| k.starts_with(&head))
            .map(String::as_str)
            .collect();
        if !left.is_empty() {
            return Err(Error::Format {
                file: self.path.clone(),
                reason: format!(
                    "modules [{}] match no site of the model under prefix {prefix:?}",
                    left.join(", ")
                ),
            });
        }
        Ok(w)
    }
}

/// Reads a kohya LoRA file. Alpha may be any float or integer dtype (0-d or `[1]`); missing or 0
/// means alpha = rank.
///
/// # Errors
/// [`Error::Format`] for keys that are not `lora_down` / `lora_up` / `alpha` (LoHa, LoKr, DoRA
/// `dora_scale`, ...); [`Error::MissingKey`] for a half pair; [`Error::Shape`] / [`Error::Dtype`].
pub fn read(path: &Path) -> Result<KohyaFile> {
    let mut file = load_safetensors(path)?;
    let mut names = std::collections::BTreeSet::new();
    for key in file.tensors.keys() {
        let name = key
            .strip_suffix(".lora_down.weight")
            .or_else(|| key.strip_suffix(".lora_up.weight"))
            .or_else(|| key.strip_suffix(".alpha"))
            .ok_or_else(|| Error::Format {
                file: path.to_path_buf(),
                reason: format!("key {key:?} is not a kohya LoRA key (.lora_down.weight, .lora_up.weight, .alpha)"),
            })?;
        names.insert(name.to_string());
    }
    let mut modules = BTreeMap::new();
    for name in names {
        let (kd, ku) = (
            format!("{name}.lora_down.weight"),
            format!("{name}.lora_up.weight"),
        );
        let a = file.take_float(&kd)?;
        let b = file.take_float(&ku)?;
        let kind = kind_from_a(&kd, &a)?;
        check_pair(&ku, kind, &a, &b)?;
        let r = a.size()[0];
        let alpha = match file.take_alpha(&format!("{name}.alpha"))? {
            Some(v) if v != 0.0 => v,
            _ => r as f64,
        };
        modules.insert(
            name,
            ModuleLora {
                kind,
                lora_a: a,
                lora_b: b,
                alpha,
                magnitude: None,
            },
        );
    }
    Ok(KohyaFile {
        modules,
        metadata: file.metadata,
        path: path.to_path_buf(),
    })
}

/// Writes `parts` (kohya prefix, adapter) into one kohya file at `path`.
///
/// `ss_network_module = "networks.lora"`, `ss_network_dim` / `ss_network_alpha` (most common rank /
/// alpha of the first part), `ss_network_args` (`conv_dim` / `conv_alpha` when there are conv
/// modules) are set unless the adapters' metadata already holds them.
///
/// # Errors
/// [`Error::Unsupported`] for DoRA or Embedding modules (no kohya `networks.lora` equivalent);
/// I/O errors with the path.
pub fn write(path: &Path, parts: &[(&str, &AdapterWeights)]) -> Result<()> {
    let mut tensors = BTreeMap::new();
    let mut meta = BTreeMap::new();
    let mut conv: Option<(i64, f64)> = None;
    for (prefix, w) in parts {
        for (k, v) in &w.metadata {
            meta.insert(k.clone(), v.clone());
        }
        for (mpath, m) in &w.modules {
            if m.magnitude.is_some() {
                return Err(Error::Unsupported(format!(
                    "DoRA module {mpath} in the kohya format; save as PEFT"
                )));
            }
            if m.kind == SiteKind::Embedding {
                return Err(Error::Unsupported(format!(
                    "Embedding module {mpath} in the kohya format; save as PEFT"
                )));
            }
            let r = m.rank();
            let alpha = if w.use_rslora {
                m.alpha * (r as f64).sqrt()
            } else {
                m.alpha
            };
            if m.kind == SiteKind::Conv2d && conv.is_none() {
                conv = Some((r, alpha));
            }
            let name = kohya_name(prefix, mpath);
            tensors.insert(format!("{name}.lora_down.weight"), m.lora_a.shallow_clone());
            tensors.insert(format!("{name}.lora_up.weight"), m.lora_b.shallow_clone());
            let a = Tensor::f_from_slice(&[alpha as f32])
                .and_then(|t| t.f_reshape([0i64; 0]))
                .ctx(|| format!("building alpha of {name}"))?;
            tensors.insert(format!("{name}.alpha"), a);
        }
    }
    if let Some((_, first)) = parts.first() {
        let (r, a) = first.dominant_rank_alpha();
        let a = if first.use_rslora {
            a * (r as f64).sqrt()
        } else {
            a
        };
        meta.entry("ss_network_module".into())
            .or_insert_with(|| "networks.lora".into());
        meta.entry("ss_network_dim".into())
            .or_insert_with(|| r.to_string());
        meta.entry("ss_network_alpha".into())
            .or_insert_with(|| fmt_num(a));
        if let Some((cr, ca)) = conv {
            meta.entry("ss_network_args".into()).or_insert_with(|| {
                serde_json::json!({"conv_dim": cr.to_string(), "conv_alpha": fmt_num(ca)})
                    .to_string()
            });
        }
    }
    write_safetensors(path, &tensors, &meta)
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.1}")
    } else {
        v.to_string()
    }
}
