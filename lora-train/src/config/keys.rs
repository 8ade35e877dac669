//! How a config document is read: the flattened document, the readers that turn one key's value
//! into a field, the [`section!`] declaration that writes each key once (field, default,
//! spellings, reader and range check), and the "did you mean" search over every spelling.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};
use std::fmt;

use super::{ConfigError, Result};

/// One key's spellings: the canonical dotted path first, then its aliases.
pub(super) type Spellings = &'static [&'static str];

/// One documented key, as the sections declare it.
#[derive(Debug, Clone, Copy)]
pub(super) struct KeySpec {
    /// The canonical path first, then the aliases.
    pub spellings: Spellings,
    /// The value is a mapping of its own (kept whole, not flattened into sub-keys).
    pub mapping: bool,
    /// The key is a field of its section; `false` for a key that sets a part of another field
    /// (a scheduler argument). Read by the key tests.
    #[cfg_attr(not(test), allow(dead_code))]
    pub field: bool,
}

impl KeySpec {
    /// The canonical path.
    pub fn canonical(&self) -> &'static str {
        self.spellings[0]
    }
}

/// A section of the config: its keys, read from a document into `self`.
pub(super) trait Section {
    /// Reads every key of the section present in `doc` into `self`.
    fn read(&mut self, doc: &mut Doc) -> Result<()>;
    /// The section's keys, in declaration order.
    fn keys(out: &mut Vec<KeySpec>);
}

/// Declares a config section once: per field its doc comment, type, default, reader (how a
/// value is read), accepted aliases and range check. Generates the struct (serde names are the
/// canonical keys), its `Default`, and its [`Section`] impl (reading and the key list).
macro_rules! section {
    (
        $(#[$sattr:meta])*
        pub struct $name:ident at $prefix:literal {
            $(
                $(#[$fattr:meta])*
                $field:ident : $ty:ty = $default:expr, $reader:expr
                    $(, aka [$($alias:literal),+ $(,)?])?
                    $(, check $check:expr => $expect:literal)?
                ;
            )*
        }
    ) => {
        $(#[$sattr])*
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $( $(#[$fattr])* pub $field: $ty, )*
        }

        impl Default for $name {
            fn default() -> Self {
                $name { $( $field: $default, )* }
            }
        }

        impl $crate::config::keys::Section for $name {
            fn read(&mut self, doc: &mut $crate::config::keys::Doc) -> Result<()> {
                $(
                    {
                        const KEY: $crate::config::keys::Spellings =
                            &[concat!($prefix, ".", stringify!($field)) $($(, $alias)+)?];
                        <_ as $crate::config::keys::Reader<$ty>>::fill(
                            &$reader, doc, KEY, &mut self.$field,
                        )?;
                        $(
                            let ok: fn(&$ty) -> bool = $check;
                            if !ok(&self.$field) {
                                return Err($crate::config::keys::out_of_range(
                                    KEY[0], &self.$field, $expect,
                                ));
                            }
                        )?
                    }
                )*
                Ok(())
            }

            fn keys(out: &mut Vec<$crate::config::keys::KeySpec>) {
                $(
                    {
                        const KEY: $crate::config::keys::Spellings =
                            &[concat!($prefix, ".", stringify!($field)) $($(, $alias)+)?];
                        <_ as $crate::config::keys::Reader<$ty>>::keys(&$reader, KEY, out);
                    }
                )*
            }
        }
    };
}
pub(super) use section;

/// How one key's value becomes a field of type `T`.
pub(super) trait Reader<T> {
    /// Reads the key spelled `key` (any spelling; all written spellings must agree) into `slot`;
    /// leaves `slot` alone when the document does not have the key.
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut T) -> Result<()>;

    /// The keys this reader reads.
    fn keys(&self, key: Spellings, out: &mut Vec<KeySpec>) {
        out.push(KeySpec {
            spellings: key,
            mapping: false,
            field: true,
        });
    }
}

/// What a boolean key accepts, for its error message: [`typed`] reads the YAML 1.1 words too.
pub(super) const BOOLEAN: &str = "true or false (yes/no and on/off are read the same)";

/// A value of the field's own serde type; `.0` says what is expected, for errors.
pub(super) struct Typed(pub &'static str);

impl<T: DeserializeOwned + PartialEq + fmt::Debug> Reader<T> for Typed {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut T) -> Result<()> {
        if let Some(v) = doc.get_with(key, |k, v| typed(k, v, self.0))? {
            *slot = v;
        }
        Ok(())
    }
}

/// A [`Typed`] value that is a mapping of its own (`rank_pattern: {q_proj: 4}`).
pub(super) struct Mapping(pub &'static str);

impl<T: DeserializeOwned + PartialEq + fmt::Debug> Reader<T> for Mapping {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut T) -> Result<()> {
        Typed(self.0).fill(doc, key, slot)
    }

    fn keys(&self, key: Spellings, out: &mut Vec<KeySpec>) {
        out.push(KeySpec {
            spellings: key,
            mapping: true,
            field: true,
        });
    }
}

/// One of a table of names (compared without case, `_`, `-`, `.` or spaces).
pub(super) struct Choice<U: 'static>(pub &'static [(&'static str, U)]);

impl<U: Clone + PartialEq + fmt::Debug> Reader<U> for Choice<U> {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut U) -> Result<()> {
        if let Some(v) = doc.get_with(key, |k, v| choose(k, v, self.0))? {
            *slot = v;
        }
        Ok(())
    }
}

/// A value read by a function of the key as written and its value.
pub(super) struct Parse<F>(F);

/// [`Parse`] with the function's signature fixed (so closures need no annotations).
pub(super) fn parse<T, F: Fn(&str, &Value) -> Result<T>>(f: F) -> Parse<F> {
    Parse(f)
}

impl<T: PartialEq + fmt::Debug, F: Fn(&str, &Value) -> Result<T>> Reader<T> for Parse<F> {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut T) -> Result<()> {
        if let Some(v) = doc.get_with(key, &self.0)? {
            *slot = v;
        }
        Ok(())
    }
}

/// [`Parse`] into an optional field: a written key gives `Some`.
pub(super) struct ParseSome<F>(F);

/// [`ParseSome`] with the function's signature fixed.
pub(super) fn some<T, F: Fn(&str, &Value) -> Result<T>>(f: F) -> ParseSome<F> {
    ParseSome(f)
}

impl<T: PartialEq + fmt::Debug, F: Fn(&str, &Value) -> Result<T>> Reader<Option<T>>
    for ParseSome<F>
{
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut Option<T>) -> Result<()> {
        if let Some(v) = doc.get_with(key, &self.0)? {
            *slot = Some(v);
        }
        Ok(())
    }
}

/// A nested section (`tagger.model_settings.max_memory`): its own keys, under its own prefix.
pub(super) struct Sub;

impl<T: Section> Reader<T> for Sub {
    fn fill(&self, doc: &mut Doc, _key: Spellings, slot: &mut T) -> Result<()> {
        slot.read(doc)
    }

    fn keys(&self, _key: Spellings, out: &mut Vec<KeySpec>) {
        T::keys(out);
    }
}

/// An engine setting written by name (`cosine`, `lower_lr`) or, with arguments, as the engine's
/// own tagged mapping (`{type: cosine, num_cycles: 1.0}`).
pub(super) trait Named:
    Sized + Serialize + DeserializeOwned + PartialEq + fmt::Debug
{
    /// The setting's name.
    fn name(&self) -> &'static str;
    /// The setting a name gives (its arguments at their defaults), or what is expected.
    fn from_name(name: &str) -> std::result::Result<Self, String>;
    /// Checks the setting's arguments (a mapping can give any), or says what is expected.
    fn check(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// The setting, as written, is its name alone (its arguments are the name's defaults).
    fn is_plain(&self) -> bool {
        Self::from_name(self.name()).as_ref() == Ok(self)
    }
}

/// Reads a [`Named`] engine setting: a name or the engine's mapping.
pub(super) fn named<T: Named>(key: &str, v: &Value) -> Result<T> {
    let t: T = match v {
        Value::String(s) => T::from_name(s).map_err(|e| invalid(key, v, e))?,
        Value::Object(_) => serde_json::from_value(v.clone())
            .map_err(|e| invalid(key, v, format!("a name or the engine's settings ({e})")))?,
        _ => return Err(invalid(key, v, "a name")),
    };
    t.check().map_err(|e| invalid(key, v, e))?;
    // an argument the setting does not take (serde lets a tagged unit variant ignore it)
    if let (Value::Object(written), Ok(Value::Object(read))) = (v, serde_json::to_value(&t)) {
        if let Some(extra) = written.keys().find(|k| !read.contains_key(*k)) {
            return Err(invalid(
                key,
                v,
                format!(
                    "the arguments of {}: `{extra}` is not one of them ({})",
                    t.name(),
                    read.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
    }
    Ok(t)
}

/// Serde for a [`Named`] field: its name when [`Named::is_plain`], else the engine's mapping;
/// reads either.
pub(super) mod by_name {
    use super::*;

    /// Writes the name, or the mapping when the arguments are not the name's defaults.
    pub fn serialize<T: Named, S: Serializer>(v: &T, s: S) -> std::result::Result<S::Ok, S::Error> {
        if v.is_plain() {
            s.serialize_str(v.name())
        } else {
            v.serialize(s)
        }
    }

    /// Reads a name or a mapping.
    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(
        d: D,
    ) -> std::result::Result<T, D::Error> {
        let v = Value::deserialize(d)?;
        named("the setting", &v).map_err(serde::de::Error::custom)
    }
}

/// The flattened document: each leaf key path with its value and whether a key read it.
#[derive(Debug)]
pub(super) struct Entry {
    /// Dotted path as written (kohya sections removed).
    pub path: String,
    /// The value.
    pub value: Value,
    /// A key read it.
    pub used: bool,
}

/// A parsed document being read key by key.
pub(super) struct Doc {
    /// Every leaf of the document.
    pub entries: Vec<Entry>,
}

/// kohya TOML section names; their contents are read as top-level keys, as kohya does.
const KOHYA_SECTIONS: &[&str] = &[
    "general",
    "model_arguments",
    "additional_network_arguments",
    "optimizer_arguments",
    "dataset_arguments",
    "training_arguments",
    "saving_arguments",
    "sample_prompt_arguments",
    "logging_arguments",
    "dreambooth_arguments",
];

impl Doc {
    /// Flattens `root`, keeping the values of `keys` that are mappings whole.
    pub fn new(root: &Map<String, Value>, keys: &[KeySpec]) -> Doc {
        let mapping: Vec<&str> = keys
            .iter()
            .filter(|k| k.mapping)
            .flat_map(|k| k.spellings.iter().copied())
            .collect();
        let mut entries = Vec::new();
        flatten("", root, &mapping, &mut entries);
        Doc { entries }
    }

    /// Whether any spelling of `key` is written.
    pub fn has(&self, key: Spellings) -> bool {
        self.entries.iter().any(|e| key.contains(&e.path.as_str()))
    }

    /// Reads a key through `conv`, checking that all its written spellings agree; marks them
    /// used.
    pub fn get_with<T: PartialEq + fmt::Debug>(
        &mut self,
        key: Spellings,
        conv: impl Fn(&str, &Value) -> Result<T>,
    ) -> Result<Option<T>> {
        Ok(self.get_written(key, conv)?.map(|(t, _)| t))
    }

    /// [`Doc::get_with`], with the spelling the value was first written under.
    pub fn get_written<T: PartialEq + fmt::Debug>(
        &mut self,
        key: Spellings,
        conv: impl Fn(&str, &Value) -> Result<T>,
    ) -> Result<Option<(T, String)>> {
        let mut found: Option<(T, String, Value)> = None;
        for e in self.entries.iter_mut() {
            if !key.contains(&e.path.as_str()) {
                continue;
            }
            e.used = true;
            let t = conv(&e.path, &e.value)?;
            match &found {
                None => found = Some((t, e.path.clone(), e.value.clone())),
                Some((prev, prev_path, prev_v)) => {
                    if *prev != t {
                        return Err(ConfigError::Conflict {
                            canonical: key[0].to_string(),
                            first_key: prev_path.clone(),
                            first_value: render(prev_v),
                            second_key: e.path.clone(),
                            second_value: render(&e.value),
                        });
                    }
                }
            }
        }
        Ok(found.map(|(t, path, _)| (t, path)))
    }
}

fn flatten(prefix: &str, map: &Map<String, Value>, mapping: &[&str], out: &mut Vec<Entry>) {
    for (k, v) in map {
        let path = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            Value::Object(inner) if prefix.is_empty() && KOHYA_SECTIONS.contains(&k.as_str()) => {
                flatten("", inner, mapping, out);
            }
            Value::Object(inner) if !mapping.contains(&path.as_str()) => {
                flatten(&path, inner, mapping, out);
            }
            Value::Null => {} // `key:` with nothing after it means "default"
            _ => out.push(Entry {
                path,
                value: v.clone(),
                used: false,
            }),
        }
    }
}

/// A value as the error messages show it (strings quoted).
pub(super) fn render(v: &Value) -> String {
    match v {
        Value::String(s) => format!("{s:?}"),
        other => other.to_string(),
    }
}

/// A field's value as the range errors show it (`0.5`, `0`, not `0.0`).
fn shown(v: &impl Serialize) -> String {
    match serde_json::to_value(v) {
        Ok(Value::Number(n)) if n.is_f64() => n.as_f64().map(|f| f.to_string()).unwrap_or_default(),
        Ok(v) => render(&v),
        Err(_) => String::new(),
    }
}

/// [`ConfigError::InvalidValue`] for a value written at `key`.
pub(super) fn invalid(key: &str, value: &Value, expected: impl Into<String>) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        value: render(value),
        expected: expected.into(),
    }
}

/// [`ConfigError::InvalidValue`] for a value outside its range.
pub(super) fn out_of_range(key: &str, value: &impl Serialize, expected: &str) -> ConfigError {
    ConfigError::InvalidValue {
        key: key.to_string(),
        value: shown(value),
        expected: expected.to_string(),
    }
}

/// A value of serde type `T`; numbers and booleans written as strings are accepted.
pub(super) fn typed<T: DeserializeOwned>(key: &str, v: &Value, expected: &str) -> Result<T> {
    // YAML/TOML users write numbers as strings now and then ("1e-4" in YAML 1.1 is a string).
    match serde_json::from_value::<T>(v.clone()) {
        Ok(t) => Ok(t),
        Err(first) => {
            if let Value::String(s) = v {
                if let Ok(n) = s.trim().parse::<f64>() {
                    let num = if n.fract() == 0.0 && n.abs() < 9.0e15 {
                        Value::from(n as i64)
                    } else {
                        Value::from(n)
                    };
                    if let Ok(t) = serde_json::from_value::<T>(num) {
                        return Ok(t);
                    }
                }
                match s.trim().to_ascii_lowercase().as_str() {
                    "true" | "yes" | "on" => {
                        if let Ok(t) = serde_json::from_value::<T>(Value::Bool(true)) {
                            return Ok(t);
                        }
                    }
                    "false" | "no" | "off" => {
                        if let Ok(t) = serde_json::from_value::<T>(Value::Bool(false)) {
                            return Ok(t);
                        }
                    }
                    _ => {}
                }
            }
            Err(invalid(key, v, format!("{expected} ({first})")))
        }
    }
}

fn normalise_choice(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, '_' | '-' | ' ' | '.'))
        .flat_map(|c| c.to_lowercase())
        .collect()
}

/// The entry of `table` a written name matches, or an error listing the names.
pub(super) fn choose<T: Clone>(key: &str, v: &Value, table: &[(&str, T)]) -> Result<T> {
    let allowed = || {
        let mut names: Vec<&str> = Vec::new();
        for (n, _) in table {
            if !names.contains(n) {
                names.push(n);
            }
        }
        format!(
            "one of {}",
            names
                .iter()
                .map(|n| format!("\"{n}\""))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    let s = match v {
        Value::String(s) => s.as_str(),
        _ => return Err(invalid(key, v, allowed())),
    };
    let norm = normalise_choice(s);
    table
        .iter()
        .find(|(n, _)| normalise_choice(n) == norm)
        .map(|(_, t)| t.clone())
        .ok_or_else(|| invalid(key, v, allowed()))
}

// Levenshtein distance over chars (the `strsim` crate).
pub(super) use strsim::levenshtein as edit_distance;

/// The closest spelling among `keys` (and `extra` spellings) to an unknown key path.
pub(super) fn suggest(path: &str, keys: &[KeySpec], extra: &[&str]) -> Option<String> {
    let all: Vec<&str> = keys
        .iter()
        .flat_map(|k| k.spellings.iter().copied())
        .chain(extra.iter().copied())
        .collect();
    let last = path.rsplit('.').next().unwrap_or(path);
    // The same leaf name under another section names the setting's own key, the first of its
    // spellings (`train.seq_len` → `data.seq_len`, `lora.network_dim` → `lora.rank`, not the
    // top-level kohya alias `network_dim`).
    if let Some(k) = all
        .iter()
        .find(|k| k.rsplit('.').next() == Some(last) && **k != path)
    {
        let canonical = keys
            .iter()
            .find(|spec| spec.spellings.contains(k))
            .map(KeySpec::canonical)
            .unwrap_or(k);
        return Some(canonical.to_string());
    }
    let mut best: Option<(usize, &str)> = None;
    for k in &all {
        let d_full = edit_distance(path, k);
        let d_leaf = edit_distance(last, k.rsplit('.').next().unwrap_or(k))
            + usize::from(!same_section(path, k));
        let d = d_full.min(d_leaf);
        if best.map(|(bd, _)| d < bd).unwrap_or(true) {
            best = Some((d, k));
        }
    }
    let (d, k) = best?;
    let limit = (last.len() / 3).max(2);
    (d <= limit).then(|| k.to_string())
}

fn same_section(a: &str, b: &str) -> bool {
    let sec = |s: &str| {
        s.rsplit_once('.')
            .map(|(p, _)| p.to_string())
            .unwrap_or_default()
    };
    sec(a) == sec(b)
}

/// Parses YAML text into a JSON value tree.
pub(super) fn parse_yaml(text: &str) -> std::result::Result<Value, String> {
    let y: serde_yaml_ng::Value = serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    Ok(yaml_to_json(&y))
}

/// YAML → JSON values. JSON has no NaN/Infinity (serde_json turns them into `null`, which would
/// read as "key absent" and silently keep the default): they become strings that no numeric key
/// accepts, so `learning_rate: .nan` is an error naming the key.
fn yaml_to_json(y: &serde_yaml_ng::Value) -> Value {
    use serde_yaml_ng::Value as Y;
    match y {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(*b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .unwrap_or_else(|| Value::String(format!("{f} (not a finite number)")))
            }
        }
        Y::String(s) => Value::String(s.clone()),
        Y::Sequence(v) => Value::Array(v.iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s.clone(),
                        other => serde_yaml_ng::to_string(other)
                            .map(|t| t.trim().to_string())
                            .unwrap_or_default(),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => yaml_to_json(&t.value),
    }
}

/// Parses TOML text into a JSON value tree.
pub(super) fn parse_toml(text: &str) -> std::result::Result<Value, String> {
    let t: toml::Table = toml::from_str(text).map_err(|e| e.to_string())?;
    Ok(toml_to_json(&toml::Value::Table(t)))
}

/// TOML → JSON values, with non-finite floats kept visible as for YAML.
fn toml_to_json(t: &toml::Value) -> Value {
    match t {
        toml::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Value::Number)
            .unwrap_or_else(|| Value::String(format!("{f} (not a finite number)"))),
        toml::Value::Array(a) => Value::Array(a.iter().map(toml_to_json).collect()),
        toml::Value::Table(m) => Value::Object(
            m.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
        other => serde_json::to_value(other).unwrap_or(Value::Null),
    }
}

/// A [`Named`] engine setting: a name, or the engine's mapping with its arguments.
pub(super) struct ByName;

impl<T: Named> Reader<T> for ByName {
    fn fill(&self, doc: &mut Doc, key: Spellings, slot: &mut T) -> Result<()> {
        if let Some(v) = doc.get_with(key, named::<T>)? {
            *slot = v;
        }
        Ok(())
    }

    fn keys(&self, key: Spellings, out: &mut Vec<KeySpec>) {
        out.push(KeySpec {
            spellings: key,
            mapping: true,
            field: true,
        });
    }
}

/// kohya's `name=value` argument lists (`optimizer_args`, `lr_scheduler_args`, `network_args`):
/// a list of `name=value` strings, one string of them separated by spaces (what the kohya_ss
/// GUI stores), or a mapping. Values are read as Python literals, as kohya's `ast.literal_eval`
/// does ([`python_literal`]).
pub(super) struct Listed;

impl Reader<std::collections::BTreeMap<String, Value>> for Listed {
    fn fill(
        &self,
        doc: &mut Doc,
        key: Spellings,
        slot: &mut std::collections::BTreeMap<String, Value>,
    ) -> Result<()> {
        if let Some(v) = doc.get_with(key, kwargs)? {
            *slot = v;
        }
        Ok(())
    }

    fn keys(&self, key: Spellings, out: &mut Vec<KeySpec>) {
        out.push(KeySpec {
            spellings: key,
            mapping: true,
            field: true,
        });
    }
}

/// Reads a `name=value` list (see [`Listed`]) written at `key`.
///
/// # Errors
/// [`ConfigError::InvalidValue`] for an item without `=` or an empty name.
pub(super) fn kwargs(key: &str, v: &Value) -> Result<std::collections::BTreeMap<String, Value>> {
    let expected = "a list of name=value strings (e.g. [\"weight_decay=0.01\", \"betas=0.9,0.99\"]) or a mapping";
    let mut out = std::collections::BTreeMap::new();
    let items: Vec<String> = match v {
        Value::Object(m) => {
            for (k, x) in m {
                out.insert(k.clone(), x.clone());
            }
            return Ok(out);
        }
        Value::Array(a) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| invalid(key, v, expected))?,
        Value::String(s) => s.split_whitespace().map(str::to_string).collect(),
        _ => return Err(invalid(key, v, expected)),
    };
    for item in items {
        let (name, value) = item
            .split_once('=')
            .ok_or_else(|| invalid(key, v, format!("{expected}; `{item}` has no `=`")))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(invalid(key, v, format!("{expected}; `{item}` has no name")));
        }
        out.insert(name.to_string(), python_literal(value.trim()));
    }
    Ok(out)
}

/// A Python literal as kohya reads `name=value` arguments: `True`/`False`/`None`, numbers,
/// tuples or lists (`(0.9,0.99)`, `0.9,0.99`), quoted strings; anything else stays a string.
pub(super) fn python_literal(s: &str) -> Value {
    let s = s.trim();
    match s {
        "True" | "true" => return Value::Bool(true),
        "False" | "false" => return Value::Bool(false),
        "None" => return Value::Null,
        _ => {}
    }
    let inner = s
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .or_else(|| s.strip_prefix('[').and_then(|r| r.strip_suffix(']')));
    if let Some(inner) = inner {
        return Value::Array(
            inner
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(python_literal)
                .collect(),
        );
    }
    if s.contains(',') {
        return Value::Array(s.split(',').map(python_literal).collect());
    }
    for q in ['"', '\''] {
        if let Some(inner) = s.strip_prefix(q).and_then(|r| r.strip_suffix(q)) {
            return Value::String(inner.to_string());
        }
    }
    if let Ok(i) = s.parse::<i64>() {
        return Value::from(i);
    }
    if let Ok(f) = s.parse::<f64>()
        && let Some(n) = serde_json::Number::from_f64(f)
    {
        return Value::Number(n);
    }
    Value::String(s.to_string())
}
