//! `LoraConfig`: PEFT's `LoraConfig` field names and defaults (`peft/tuners/lora/config.py`), as
//! written in `adapter_config.json`.

use crate::error::{Error, Result};
use regex::Regex;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// `target_modules` / `exclude_modules`: a list of names or one regex (PEFT semantics).
///
/// - list: a module matches when its full path equals an entry or ends with `"." + entry`;
/// - string: the module path must match the regex in full (`re.fullmatch`); the special string
///   `"all-linear"` selects every Linear site except an output head named `lm_head`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Exact names or `.`-suffixes.
    List(Vec<String>),
    /// A regex matched against the whole module path.
    Regex(String),
}

impl TargetModules {
    /// Builds a list from names.
    pub fn list<S: AsRef<str>>(names: &[S]) -> Self {
        TargetModules::List(names.iter().map(|s| s.as_ref().to_string()).collect())
    }
}

impl std::fmt::Display for TargetModules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetModules::List(v) => write!(f, "{v:?}"),
            TargetModules::Regex(s) => write!(f, "{s:?} (regex)"),
        }
    }
}

/// `init_lora_weights`: `true` (A Kaiming-uniform as PEFT, B zeros), `"gaussian"` (A normal with
/// std 1/r, B zeros) or `false` (A and B both random like a fresh `nn.Linear`: the adapter is *not*
/// the identity; for tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InitLoraWeights {
    /// `true`: PEFT's default.
    #[default]
    Kaiming,
    /// `"gaussian"`.
    Gaussian,
    /// `false`.
    Random,
}

impl Serialize for InitLoraWeights {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            InitLoraWeights::Kaiming => s.serialize_bool(true),
            InitLoraWeights::Random => s.serialize_bool(false),
            InitLoraWeights::Gaussian => s.serialize_str("gaussian"),
        }
    }
}

impl<'de> Deserialize<'de> for InitLoraWeights {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            B(bool),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::B(true) => Ok(InitLoraWeights::Kaiming),
            Raw::B(false) => Ok(InitLoraWeights::Random),
            Raw::S(s) if s == "gaussian" => Ok(InitLoraWeights::Gaussian),
            Raw::S(s) => Err(serde::de::Error::custom(format!(
                "init_lora_weights {s:?} is not supported (use true, false or \"gaussian\")"
            ))),
        }
    }
}

fn default_r() -> i64 {
    8
}
fn default_alpha() -> f64 {
    8.0
}
fn default_bias() -> String {
    "none".into()
}
fn default_peft_type() -> String {
    "LORA".into()
}

/// Serializes whole-valued floats as integers (PEFT writes `"lora_alpha": 16`).
fn ser_num<S: serde::Serializer>(v: &f64, s: S) -> std::result::Result<S::Ok, S::Error> {
    if v.fract() == 0.0 && v.abs() < 9.0e15 {
        s.serialize_i64(*v as i64)
    } else {
        s.serialize_f64(*v)
    }
}

fn ser_num_map<S: serde::Serializer>(
    m: &BTreeMap<String, f64>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    use serde::ser::SerializeMap;
    let mut map = s.serialize_map(Some(m.len()))?;
    for (k, v) in m {
        if v.fract() == 0.0 && v.abs() < 9.0e15 {
            map.serialize_entry(k, &(*v as i64))?;
        } else {
            map.serialize_entry(k, v)?;
        }
    }
    map.end()
}

/// A LoRA configuration with PEFT's field names and defaults.
///
/// Scaling (PEFT `LoraLayer.update_layer`): `lora_alpha / r`, or `lora_alpha / sqrt(r)` with
/// `use_rslora` (Kalajdzievski 2023, arXiv:2312.03732). `rank_pattern` / `alpha_pattern` override
/// `r` / `lora_alpha` per module; a pattern key `k` applies to module `m` when `m` matches the regex
/// `(^|.*\.)k$` (PEFT `get_pattern_key`); the first key in sorted order wins.
///
/// Unknown fields of `adapter_config.json` are kept in `extra` and written back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` (default 8).
    #[serde(default = "default_r")]
    pub r: i64,
    /// `lora_alpha` (default 8).
    #[serde(default = "default_alpha", serialize_with = "ser_num")]
    pub lora_alpha: f64,
    /// Modules to adapt (required for injection).
    #[serde(default)]
    pub target_modules: Option<TargetModules>,
    /// Modules never adapted (checked first).
    #[serde(default)]
    pub exclude_modules: Option<TargetModules>,
    /// Dropout probability on the LoRA branch input (training only; default 0).
    #[serde(default)]
    pub lora_dropout: f64,
    /// rsLoRA scaling `alpha / sqrt(r)`.
    #[serde(default)]
    pub use_rslora: bool,
    /// DoRA (Liu et al. 2024, arXiv:2402.09353): a trainable magnitude vector per output.
    #[serde(default)]
    pub use_dora: bool,
    /// Initialization of A and B.
    #[serde(default)]
    pub init_lora_weights: InitLoraWeights,
    /// Per-module rank overrides.
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, i64>,
    /// Per-module alpha overrides.
    #[serde(default, serialize_with = "ser_num_map")]
    pub alpha_pattern: BTreeMap<String, f64>,
    /// Bias training: only `"none"` is supported.
    #[serde(default = "default_bias")]
    pub bias: String,
    /// Always `false` here (weights are `[out, in]`).
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// `"LORA"`.
    #[serde(default = "default_peft_type")]
    pub peft_type: String,
    /// PEFT's `task_type` (e.g. `"CAUSAL_LM"`), if any.
    #[serde(default)]
    pub task_type: Option<String>,
    /// The base model's name or path, if known.
    #[serde(default)]
    pub base_model_name_or_path: Option<String>,
    /// PEFT's `inference_mode`.
    #[serde(default)]
    pub inference_mode: bool,
    /// Other fields, kept as they were.
    #[serde(flatten)]
    pub extra: BTreeMap<String, serde_json::Value>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: default_r(),
            lora_alpha: default_alpha(),
            target_modules: None,
            exclude_modules: None,
            lora_dropout: 0.0,
            use_rslora: false,
            use_dora: false,
            init_lora_weights: InitLoraWeights::Kaiming,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            bias: default_bias(),
            fan_in_fan_out: false,
            peft_type: default_peft_type(),
            task_type: None,
            base_model_name_or_path: None,
            inference_mode: false,
            extra: BTreeMap::new(),
        }
    }
}

/// Compiles a PEFT pattern key into the regex `(^|.*\.)key$` anchored at the start.
fn pattern_regex(field: &str, key: &str) -> Result<Regex> {
    Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|source| Error::Regex {
        field: field.into(),
        pattern: key.into(),
        source,
    })
}

fn pattern_lookup<'a, V>(
    field: &str,
    map: &'a BTreeMap<String, V>,
    module: &str,
) -> Result<Option<&'a V>> {
    for (k, v) in map {
        if k == module || pattern_regex(field, k)?.is_match(module) {
            return Ok(Some(v));
        }
    }
    Ok(None)
}

impl LoraConfig {
    /// A config with rank `r`, `lora_alpha` and a list of target names; everything else default.
    pub fn new<S: AsRef<str>>(r: i64, lora_alpha: f64, target_modules: &[S]) -> Self {
        Self {
            r,
            lora_alpha,
            target_modules: Some(TargetModules::list(target_modules)),
            ..Self::default()
        }
    }

    /// Checks values: `r > 0`, finite `lora_alpha`, `0 <= lora_dropout < 1`, `bias == "none"`,
    /// no `fan_in_fan_out`, all regexes compile, all pattern ranks positive.
    ///
    /// # Errors
    /// [`Error::Config`] / [`Error::Regex`] naming the field and value.
    pub fn validate(&self) -> Result<()> {
        if self.r <= 0 {
            return Err(Error::Config(format!("r must be positive, got {}", self.r)));
        }
        if !self.lora_alpha.is_finite() {
            return Err(Error::Config(format!(
                "lora_alpha must be finite, got {}",
                self.lora_alpha
            )));
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return Err(Error::Config(format!(
                "lora_dropout must be in [0, 1), got {}",
                self.lora_dropout
            )));
        }
        if self.bias != "none" {
            return Err(Error::Config(format!(
                "bias {:?} is not supported; use \"none\"",
                self.bias
            )));
        }
        if self.fan_in_fan_out {
            return Err(Error::Config(
                "fan_in_fan_out = true is not supported (weights are [out, in])".into(),
            ));
        }
        for (k, &r) in &self.rank_pattern {
            pattern_regex("rank_pattern", k)?;
            if r <= 0 {
                return Err(Error::Config(format!(
                    "rank_pattern[{k:?}] must be positive, got {r}"
                )));
            }
        }
        for k in self.alpha_pattern.keys() {
            pattern_regex("alpha_pattern", k)?;
        }
        TargetMatcher::new(self)?;
        Ok(())
    }

    /// The rank for `module` (after `rank_pattern`).
    pub fn rank_for(&self, module: &str) -> i64 {
        pattern_lookup("rank_pattern", &self.rank_pattern, module)
            .ok()
            .flatten()
            .copied()
            .unwrap_or(self.r)
    }

    /// `lora_alpha` for `module` (after `alpha_pattern`).
    pub fn alpha_for(&self, module: &str) -> f64 {
        pattern_lookup("alpha_pattern", &self.alpha_pattern, module)
            .ok()
            .flatten()
            .copied()
            .unwrap_or(self.lora_alpha)
    }

    /// The scaling of `module`'s adapter: `alpha / r`, or `alpha / sqrt(r)` with `use_rslora`
    /// (PEFT `LoraLayer.update_layer`).
    pub fn scaling_for(&self, module: &str) -> f64 {
        scaling(
            self.alpha_for(module),
            self.rank_for(module),
            self.use_rslora,
        )
    }

    /// The resolved per-module adapter settings.
    pub fn spec_for(&self, module: &str) -> AdapterSpec {
        AdapterSpec {
            rank: self.rank_for(module),
            alpha: self.alpha_for(module),
            use_rslora: self.use_rslora,
            use_dora: self.use_dora,
            dropout: self.lora_dropout,
            init: self.init_lora_weights,
        }
    }
}

/// `alpha / r`, or `alpha / sqrt(r)` when `use_rslora`.
pub fn scaling(alpha: f64, rank: i64, use_rslora: bool) -> f64 {
    if use_rslora {
        alpha / (rank as f64).sqrt()
    } else {
        alpha / rank as f64
    }
}

/// One site's adapter settings, resolved from a [`LoraConfig`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdapterSpec {
    /// Rank.
    pub rank: i64,
    /// Alpha.
    pub alpha: f64,
    /// rsLoRA scaling.
    pub use_rslora: bool,
    /// DoRA magnitude vector.
    pub use_dora: bool,
    /// Dropout probability on the branch input (training only).
    pub dropout: f64,
    /// Initialization.
    pub init: InitLoraWeights,
}

impl AdapterSpec {
    /// Plain LoRA with `rank` and `alpha`, Kaiming init, no dropout.
    pub fn new(rank: i64, alpha: f64) -> Self {
        Self {
            rank,
            alpha,
            use_rslora: false,
            use_dora: false,
            dropout: 0.0,
            init: InitLoraWeights::Kaiming,
        }
    }

    /// The scaling factor.
    pub fn scaling(&self) -> f64 {
        scaling(self.alpha, self.rank, self.use_rslora)
    }
}

/// Compiled `target_modules` / `exclude_modules` with PEFT's semantics
/// (`peft/tuners/tuners_utils.py::check_target_module_exists`).
#[derive(Debug)]
pub struct TargetMatcher {
    target: Compiled,
    exclude: Option<Compiled>,
    all_linear: bool,
}

#[derive(Debug)]
enum Compiled {
    List(Vec<String>),
    Regex(Regex),
}

impl Compiled {
    fn new(field: &str, t: &TargetModules) -> Result<Self> {
        Ok(match t {
            TargetModules::List(v) => Compiled::List(v.clone()),
            TargetModules::Regex(s) => {
                Compiled::Regex(Regex::new(&format!("^(?:{s})$")).map_err(|source| {
                    Error::Regex {
                        field: field.into(),
                        pattern: s.clone(),
                        source,
                    }
                })?)
            }
        })
    }

    fn is_match(&self, module: &str) -> bool {
        match self {
            Compiled::List(v) => v
                .iter()
                .any(|t| module == t || module.ends_with(&format!(".{t}"))),
            Compiled::Regex(r) => r.is_match(module),
        }
    }
}

impl TargetMatcher {
    /// Compiles the config's target and exclusion specifications.
    ///
    /// # Errors
    /// [`Error::Config`] when `target_modules` is missing; [`Error::Regex`] for a bad regex.
    pub fn new(cfg: &LoraConfig) -> Result<Self> {
        let t = cfg.target_modules.as_ref().ok_or_else(|| {
            Error::Config("target_modules must be set (a list of names or a regex)".into())
        })?;
        let all_linear = matches!(t, TargetModules::Regex(s) if s == "all-linear");
        Ok(Self {
            target: Compiled::new("target_modules", t)?,
            exclude: cfg
                .exclude_modules
                .as_ref()
                .map(|e| Compiled::new("exclude_modules", e))
                .transpose()?,
            all_linear,
        })
    }

    /// Whether `module` (a full path) is adapted; `is_linear` is used by `"all-linear"`.
    /// Exclusions are checked first.
    pub fn matches(&self, module: &str, is_linear: bool) -> bool {
        if self.exclude.as_ref().is_some_and(|e| e.is_match(module)) {
            return false;
        }
        if self.all_linear {
            return is_linear && module != "lm_head" && !module.ends_with(".lm_head");
        }
        self.target.is_match(module)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_targets_match_exact_or_dot_suffix() {
        let cfg = LoraConfig::new(4, 8.0, &["q_proj", "mlp.up_proj"]);
        let m = TargetMatcher::new(&cfg).unwrap();
        assert!(m.matches("model.layers.0.self_attn.q_proj", true));
        assert!(m.matches("q_proj", true));
        assert!(m.matches("model.layers.3.mlp.up_proj", true));
        assert!(!m.matches("model.layers.0.self_attn.xq_proj", true));
        assert!(!m.matches("model.layers.0.self_attn.q_proj.x", true));
        assert!(!m.matches("model.layers.0.up_proj", true));
    }

    #[test]
    fn regex_targets_full_match_and_exclusions_first() {
        let mut cfg = LoraConfig {
            target_modules: Some(TargetModules::Regex(r".*\.(q|v)_proj".into())),
            ..LoraConfig::default()
        };
        cfg.exclude_modules = Some(TargetModules::list(&["layers.1.self_attn.v_proj"]));
        let m = TargetMatcher::new(&cfg).unwrap();
        assert!(m.matches("model.layers.0.self_attn.q_proj", true));
        assert!(!m.matches("model.layers.0.self_attn.q_proj_extra", true));
        assert!(!m.matches("q_proj", true)); // needs a dot before: full match
        assert!(m.matches("model.layers.0.self_attn.v_proj", true));
        assert!(!m.matches("model.layers.1.self_attn.v_proj", true));
    }

    #[test]
    fn all_linear_skips_lm_head_and_non_linear() {
        let cfg = LoraConfig {
            target_modules: Some(TargetModules::Regex("all-linear".into())),
            ..Default::default()
        };
        let m = TargetMatcher::new(&cfg).unwrap();
        assert!(m.matches("model.layers.0.mlp.down_proj", true));
        assert!(!m.matches("lm_head", true));
        assert!(!m.matches("model.embed_tokens", false));
    }

    #[test]
    fn patterns_scaling_and_rslora() {
        let mut cfg = LoraConfig::new(8, 16.0, &["q_proj", "v_proj"]);
        cfg.rank_pattern.insert("v_proj".into(), 4);
        cfg.alpha_pattern
            .insert(r"layers\.1\.self_attn\.q_proj".into(), 2.0);
        assert_eq!(cfg.rank_for("model.layers.0.self_attn.v_proj"), 4);
        assert_eq!(cfg.rank_for("model.layers.0.self_attn.q_proj"), 8);
        assert_eq!(cfg.scaling_for("model.layers.0.self_attn.v_proj"), 4.0);
        assert_eq!(cfg.scaling_for("model.layers.0.self_attn.q_proj"), 2.0);
        assert_eq!(cfg.scaling_for("model.layers.1.self_attn.q_proj"), 0.25);
        // a pattern key must match at a dot boundary
        assert_eq!(cfg.rank_for("model.layers.0.self_attn.xv_proj"), 8);
        cfg.use_rslora = true;
        assert!(
            (cfg.scaling_for("model.layers.0.self_attn.q_proj") - 16.0 / 8f64.sqrt()).abs() < 1e-12
        );
    }

    #[test]
    fn serde_uses_peft_names_and_keeps_unknown_fields() {
        let json = r#"{"r": 4, "lora_alpha": 32, "target_modules": ["q_proj"], "init_lora_weights": "gaussian",
            "peft_type": "LORA", "megatron_core": "megatron.core", "lora_dropout": 0.05}"#;
        let cfg: LoraConfig = serde_json::from_str(json).unwrap();
        assert_eq!(cfg.r, 4);
        assert_eq!(cfg.lora_alpha, 32.0);
        assert_eq!(cfg.init_lora_weights, InitLoraWeights::Gaussian);
        assert_eq!(cfg.extra["megatron_core"], "megatron.core");
        let out = serde_json::to_value(&cfg).unwrap();
        assert_eq!(out["lora_alpha"], serde_json::json!(32));
        assert_eq!(out["init_lora_weights"], serde_json::json!("gaussian"));
        assert_eq!(out["megatron_core"], "megatron.core");
        let cfg2: LoraConfig = serde_json::from_value(out).unwrap();
        assert_eq!(cfg, cfg2);
        let bad: std::result::Result<LoraConfig, _> =
            serde_json::from_str(r#"{"init_lora_weights": "pissa"}"#);
        assert!(bad.unwrap_err().to_string().contains("pissa"));
    }

    #[test]
    fn validate_rejects_bad_values() {
        let mut cfg = LoraConfig::new(0, 8.0, &["a"]);
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("r must be positive")
        );
        cfg.r = 4;
        cfg.target_modules = Some(TargetModules::Regex("(".into()));
        assert!(matches!(cfg.validate(), Err(Error::Regex { .. })));
        cfg.target_modules = None;
        assert!(
            cfg.validate()
                .unwrap_err()
                .to_string()
                .contains("target_modules")
        );
    }
}
