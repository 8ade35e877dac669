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

/// What a rank (`r`, a `rank_pattern` value) must be.
const RANK_EXPECTED: &str = "a positive integer (the LoRA rank, e.g. 8)";
/// What an alpha (`lora_alpha`, an `alpha_pattern` value) must be.
const ALPHA_EXPECTED: &str = "a number (the LoRA alpha, e.g. 16)";

/// The error for `key` = `value` of the config file `file`, which should be `expected`.
fn bad_value(file: &Path, key: &str, value: &serde_json::Value, expected: &str) -> Error {
    Error::Format {
        file: file.to_path_buf(),
        reason: format!("{key} is {}; expected {expected}", short(value)),
    }
}

fn check_rank(file: &Path, key: &str, v: &serde_json::Value) -> Result<()> {
    match v.as_i64() {
        Some(r) if r > 0 => Ok(()),
        _ => Err(bad_value(file, key, v, RANK_EXPECTED)),
    }
}

fn check_alpha(file: &Path, key: &str, v: &serde_json::Value) -> Result<()> {
    match v.as_f64() {
        Some(a) if a.is_finite() => Ok(()),
        _ => Err(bad_value(file, key, v, ALPHA_EXPECTED)),
    }
}

/// Checks the values that size and scale the adapter — `r`, `lora_alpha`, `rank_pattern.<module>`
/// and `alpha_pattern.<module>` — before they are used, so that a bad one is named with its file,
/// key and value (instead of surfacing later as a shape mismatch against a rank of -1).
fn check_sizes(file: &Path, json: &serde_json::Value) -> Result<()> {
    let Some(obj) = json.as_object() else {
        return Err(Error::Format {
            file: file.to_path_buf(),
            reason: format!(
                "expected a JSON object (PEFT's LoraConfig), found {}",
                short(json)
            ),
        });
    };
    if let Some(v) = obj.get("r") {
        check_rank(file, "r", v)?;
    }
    if let Some(v) = obj.get("lora_alpha") {
        check_alpha(file, "lora_alpha", v)?;
    }
    type Check = fn(&Path, &str, &serde_json::Value) -> Result<()>;
    let patterns: [(&str, Check, &str); 2] = [
        ("rank_pattern", check_rank, RANK_EXPECTED),
        ("alpha_pattern", check_alpha, ALPHA_EXPECTED),
    ];
    for (field, check, each) in patterns {
        match obj.get(field) {
            None => {}
            Some(serde_json::Value::Object(m)) => {
                for (module, v) in m {
                    check(file, &format!("{field}.{module}"), v)?;
                }
            }
            Some(v) => {
                return Err(bad_value(
                    file,
                    field,
                    v,
                    &format!("an object mapping module names to {each}"),
                ));
            }
        }
    }
    Ok(())
}

/// `v` as JSON, cut to 60 characters.
fn short(v: &serde_json::Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

/// Reads `dir/adapter_config.json` alone.
///
/// # Errors
/// [`Error::Io`] / [`Error::Json`] with the path; [`Error::Format`] naming the file, key, value
/// and what was expected when `r` or a `rank_pattern` value is not a positive integer, or
/// `lora_alpha` or an `alpha_pattern` value is not a number; [`Error::Config`] when `peft_type` is
/// not `LORA`.
pub fn read_config(dir: &Path) -> Result<LoraConfig> {
    let cfg_path = dir.join(CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg_path).map_err(|source| Error::Io {
        path: cfg_path.clone(),
        source,
    })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(json_err(&cfg_path))?;
    check_sizes(&cfg_path, &json)?;
    // parsed again from the text, so that other errors keep serde's line and column
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

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    /// A PEFT folder with one rank-2 Linear module `layers.0.q_proj` (in 3, out 4) and `config`
    /// as its `adapter_config.json`.
    fn folder(config: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let mut t = BTreeMap::new();
        t.insert(
            format!("{PREFIX}layers.0.q_proj.lora_A.weight"),
            Tensor::from_slice(&[0.5f32; 6]).reshape([2, 3]),
        );
        t.insert(
            format!("{PREFIX}layers.0.q_proj.lora_B.weight"),
            Tensor::from_slice(&[0.25f32; 8]).reshape([4, 2]),
        );
        write_safetensors(&dir.path().join(WEIGHTS_FILE), &t, &BTreeMap::new()).unwrap();
        std::fs::write(dir.path().join(CONFIG_FILE), config).unwrap();
        dir
    }

    fn load_err(config: &str) -> (String, String) {
        let dir = folder(config);
        let file = dir.path().join(CONFIG_FILE).display().to_string();
        let e = load(dir.path()).unwrap_err();
        assert!(matches!(e, Error::Format { .. }), "{e:?}");
        (e.to_string(), file)
    }

    #[test]
    fn bad_ranks_and_alphas_name_the_file_key_value_and_what_is_expected() {
        let cases = [
            (
                r#"{"r": -1, "lora_alpha": 4}"#,
                "r is -1; expected a positive integer",
            ),
            (
                r#"{"r": 0, "lora_alpha": 4}"#,
                "r is 0; expected a positive integer",
            ),
            (
                r#"{"r": 2.5, "lora_alpha": 4}"#,
                "r is 2.5; expected a positive integer",
            ),
            (
                r#"{"r": "2", "lora_alpha": 4}"#,
                r#"r is "2"; expected a positive integer"#,
            ),
            (r#"{"r": null}"#, "r is null; expected a positive integer"),
            (
                r#"{"r": 2, "lora_alpha": "big"}"#,
                r#"lora_alpha is "big"; expected a number"#,
            ),
            (
                r#"{"r": 2, "lora_alpha": [4]}"#,
                "lora_alpha is [4]; expected a number",
            ),
            (
                r#"{"r": 2, "rank_pattern": {"q_proj": -3}}"#,
                "rank_pattern.q_proj is -3; expected a positive integer",
            ),
            (
                r#"{"r": 2, "alpha_pattern": {"q_proj": true}}"#,
                "alpha_pattern.q_proj is true; expected a number",
            ),
            (
                r#"{"r": 2, "rank_pattern": [4]}"#,
                "rank_pattern is [4]; expected an object mapping module names to a positive integer",
            ),
            (r#"[2]"#, "expected a JSON object"),
        ];
        for (config, needle) in cases {
            let (msg, file) = load_err(config);
            assert!(msg.contains(&file), "{config}: {msg}");
            assert!(msg.contains(needle), "{config}: {msg}");
        }
    }

    #[test]
    fn good_values_still_load_with_their_scaling() {
        let dir = folder(r#"{"r": 2, "lora_alpha": 3.0, "alpha_pattern": {"q_proj": 8}}"#);
        let (cfg, w) = load(dir.path()).unwrap();
        assert_eq!(cfg.r, 2);
        assert_eq!(cfg.lora_alpha, 3.0);
        let m = &w.modules["layers.0.q_proj"];
        assert_eq!(m.rank(), 2);
        assert_eq!(m.alpha, 8.0);
        assert_eq!(w.scaling("layers.0.q_proj"), Some(4.0));
        // A rank that is valid but not the file's is still the shape error it was.
        let dir = folder(r#"{"r": 4}"#);
        let e = load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("expected [4, -1], found [2, 3]"), "{e}");
    }
}
