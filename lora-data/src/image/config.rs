//! Image dataset configuration: kohya's dataset TOML (`[general]`, `[[datasets]]`,
//! `[[datasets.subsets]]`) and kohya's `N_concept` folder convention.
//!
//! A value set in a subset wins over its dataset's, which wins over `[general]`, which wins over the
//! default (as in kohya sd-scripts `library/config_util.py`). Relative `image_dir`s are resolved
//! against the folder of the TOML file. Unknown keys are errors with a did-you-mean hint; kohya
//! keys this crate does not implement are errors that say so.

use std::path::{Path, PathBuf};

use toml::{Table, Value};

use super::bucket::BucketConfig;
use crate::{Error, Result};

/// What to do with an image smaller than its bucket (it would need upscaling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SmallImages {
    /// Upscale it (kohya's default).
    #[default]
    Upscale,
    /// Leave it out, listed as a [`crate::validate::Problem`].
    Skip,
}

/// One folder of images with shared caption settings (`[[datasets.subsets]]`).
#[derive(Debug, Clone, PartialEq)]
pub struct SubsetConfig {
    /// Folder holding the images (not searched recursively).
    pub image_dir: PathBuf,
    /// Caption sidecar extension, with the dot (`".txt"`, `".caption"`). Default `".txt"`.
    pub caption_extension: String,
    /// Times each image is seen per epoch. Default 1.
    pub num_repeats: u32,
    /// Leading tags never shuffled or dropped. Default 0.
    pub keep_tokens: usize,
    /// Shuffle tags after the first `keep_tokens`. Default `false`.
    pub shuffle_caption: bool,
    /// Tag separator. Default `","`.
    pub caption_separator: String,
    /// Probability of training with an empty caption. Default 0.
    pub caption_dropout_rate: f64,
    /// Probability of dropping each non-kept tag. Default 0.
    pub caption_tag_dropout_rate: f64,
    /// Text put before every caption (joined with a space).
    pub caption_prefix: Option<String>,
    /// Text put after every caption (joined with a space).
    pub caption_suffix: Option<String>,
    /// Horizontal flip with probability ½. Default `false`.
    pub flip_aug: bool,
    /// Random instead of centered crop. Default `false`.
    pub random_crop: bool,
    /// Regularization images (prior preservation). Default `false`.
    pub is_reg: bool,
    /// Caption of images without a sidecar (kohya DreamBooth: the folder's `concept`).
    pub class_tokens: Option<String>,
    /// Use a random non-empty line of multi-line captions instead of the first. Default `false`.
    pub random_caption_line: bool,
}

impl SubsetConfig {
    /// A subset of `image_dir` with every other setting at its default.
    pub fn new(image_dir: impl Into<PathBuf>) -> Self {
        SubsetConfig {
            image_dir: image_dir.into(),
            caption_extension: ".txt".into(),
            num_repeats: 1,
            keep_tokens: 0,
            shuffle_caption: false,
            caption_separator: ",".into(),
            caption_dropout_rate: 0.0,
            caption_tag_dropout_rate: 0.0,
            caption_prefix: None,
            caption_suffix: None,
            flip_aug: false,
            random_crop: false,
            is_reg: false,
            class_tokens: None,
            random_caption_line: false,
        }
    }
}

/// One `[[datasets]]` entry: a resolution and bucket settings shared by its subsets.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageSetConfig {
    /// Bucket settings (resolution included).
    pub bucket: BucketConfig,
    /// Batch size asked for by the file (the trainer's `micro_batch`). Default 1.
    pub batch_size: usize,
    /// Images smaller than their bucket. Default [`SmallImages::Upscale`].
    pub small_images: SmallImages,
    /// Color transparent pixels are composited on, RGB. Default white `[255, 255, 255]`.
    pub background_color: [u8; 3],
    /// The folders.
    pub subsets: Vec<SubsetConfig>,
}

impl Default for ImageSetConfig {
    fn default() -> Self {
        ImageSetConfig {
            bucket: BucketConfig::default(),
            batch_size: 1,
            small_images: SmallImages::Upscale,
            background_color: [255, 255, 255],
            subsets: Vec::new(),
        }
    }
}

/// A whole dataset description (kohya's dataset TOML).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DatasetConfig {
    /// The `[[datasets]]`.
    pub datasets: Vec<ImageSetConfig>,
}

const SUBSET_KEYS: &[&str] = &[
    "image_dir",
    "caption_extension",
    "num_repeats",
    "keep_tokens",
    "shuffle_caption",
    "caption_separator",
    "caption_dropout_rate",
    "caption_tag_dropout_rate",
    "caption_prefix",
    "caption_suffix",
    "flip_aug",
    "random_crop",
    "is_reg",
    "class_tokens",
    "random_caption_line",
];

const DATASET_KEYS: &[&str] = &[
    "resolution",
    "batch_size",
    "enable_bucket",
    "min_bucket_reso",
    "max_bucket_reso",
    "bucket_reso_steps",
    "small_images",
    "background_color",
];

/// kohya keys that are valid there but not implemented here.
const KOHYA_UNSUPPORTED: &[&str] = &[
    "color_aug",
    "face_crop_aug_range",
    "token_warmup_min",
    "token_warmup_step",
    "caption_dropout_every_n_epochs",
    "keep_tokens_separator",
    "secondary_separator",
    "enable_wildcard",
    "alpha_mask",
    "metadata_file",
    "bucket_no_upscale",
    "cache_info",
    "conditioning_data_dir",
    "custom_attributes",
    "validation_seed",
    "validation_split",
];

// Levenshtein distance over chars (the `strsim` crate).
pub(crate) use strsim::levenshtein as edit_distance;

/// `"; did you mean `x`?"` for the closest of `known` within a third of the key's length, else "".
pub(crate) fn did_you_mean(key: &str, known: &[&str]) -> String {
    known
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, _)| *d <= (key.len() / 3).max(2))
        .min()
        .map(|(_, k)| format!("; did you mean `{k}`?"))
        .unwrap_or_default()
}

struct Ctx<'a> {
    path: &'a Path,
}

impl Ctx<'_> {
    fn check_keys(&self, table: &Table, name: &str, allowed: &[&[&str]]) -> Result<()> {
        for key in table.keys() {
            if allowed.iter().any(|set| set.contains(&key.as_str())) {
                continue;
            }
            let hint = if KOHYA_UNSUPPORTED.contains(&key.as_str()) {
                "; this kohya key is not supported by lora-data: remove it".to_string()
            } else {
                let all: Vec<&str> = allowed.iter().flat_map(|s| s.iter().copied()).collect();
                did_you_mean(key, &all)
            };
            return Err(Error::UnknownKey {
                path: self.path.to_path_buf(),
                table: name.to_string(),
                key: key.clone(),
                hint,
            });
        }
        Ok(())
    }

    fn bad(&self, key: &str, v: &Value, want: &str) -> Error {
        Error::config(
            key,
            v,
            format!("expected {want} (in {})", self.path.display()),
        )
    }
}

/// A value looked up in subset → dataset → general order.
fn lookup<'a>(layers: &[&'a Table], key: &str) -> Option<&'a Value> {
    layers.iter().find_map(|t| t.get(key))
}

impl DatasetConfig {
    /// Reads a kohya dataset TOML file.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Format`] for TOML syntax, [`Error::UnknownKey`] with a hint,
    /// [`Error::Config`] for wrongly typed or out-of-range values.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(Error::io(path))?;
        let base = path.parent().unwrap_or(Path::new("."));
        Self::from_toml_str(&text, base, path)
    }

    /// Parses TOML text; relative `image_dir`s are joined to `base_dir`; `name` stands for the file
    /// in messages.
    ///
    /// # Errors
    /// As [`DatasetConfig::from_toml_file`].
    pub fn from_toml_str(text: &str, base_dir: &Path, name: &Path) -> Result<Self> {
        let ctx = Ctx { path: name };
        let root: Table = text.parse::<Table>().map_err(|e| Error::Format {
            path: name.to_path_buf(),
            line: e
                .span()
                .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1)
                .unwrap_or(0),
            message: format!("invalid TOML: {}", e.message()),
        })?;
        ctx.check_keys(&root, "top level", &[&["general", "datasets"]])?;
        let empty = Table::new();
        let general = match root.get("general") {
            Some(Value::Table(t)) => t,
            Some(v) => return Err(ctx.bad("general", v, "a table [general]")),
            None => &empty,
        };
        ctx.check_keys(general, "general", &[SUBSET_KEYS, DATASET_KEYS])?;
        let datasets = match root.get("datasets") {
            Some(Value::Array(a)) => a.as_slice(),
            Some(v) => return Err(ctx.bad("datasets", v, "an array of tables [[datasets]]")),
            None => &[],
        };
        let mut out = DatasetConfig::default();
        for ds in datasets {
            let ds = match ds {
                Value::Table(t) => t,
                v => return Err(ctx.bad("datasets", v, "tables [[datasets]]")),
            };
            ctx.check_keys(ds, "datasets", &[SUBSET_KEYS, DATASET_KEYS, &["subsets"]])?;
            let layers = [ds, general];
            let mut set = ImageSetConfig::default();
            let mut b = BucketConfig::default();
            if let Some(v) = lookup(&layers, "resolution") {
                b.resolution = match v {
                    Value::Integer(n) if *n > 0 => (*n as u32, *n as u32),
                    Value::Array(a) if a.len() == 2 => match (&a[0], &a[1]) {
                        (Value::Integer(w), Value::Integer(h)) if *w > 0 && *h > 0 => {
                            (*w as u32, *h as u32)
                        }
                        _ => return Err(ctx.bad("resolution", v, "512 or [width, height]")),
                    },
                    _ => return Err(ctx.bad("resolution", v, "512 or [width, height]")),
                };
            }
            if let Some(x) = get_bool(&ctx, &layers, "enable_bucket")? {
                b.enable_bucket = x;
            }
            if let Some(x) = get_uint(&ctx, &layers, "min_bucket_reso")? {
                b.min_bucket_reso = x as u32;
            }
            if let Some(x) = get_uint(&ctx, &layers, "max_bucket_reso")? {
                b.max_bucket_reso = x as u32;
            }
            if let Some(x) = get_uint(&ctx, &layers, "bucket_reso_steps")? {
                b.bucket_reso_steps = x as u32;
            }
            b.check()?;
            set.bucket = b;
            if let Some(x) = get_uint(&ctx, &layers, "batch_size")? {
                set.batch_size = (x as usize).max(1);
            }
            if let Some(v) = lookup(&layers, "small_images") {
                set.small_images = match v.as_str() {
                    Some("upscale") => SmallImages::Upscale,
                    Some("skip") => SmallImages::Skip,
                    _ => return Err(ctx.bad("small_images", v, "\"upscale\" or \"skip\"")),
                };
            }
            if let Some(v) = lookup(&layers, "background_color") {
                set.background_color = parse_color(v).ok_or_else(|| {
                    ctx.bad("background_color", v, "[r, g, b] (0–255) or \"#rrggbb\"")
                })?;
            }
            let subsets = match ds.get("subsets") {
                Some(Value::Array(a)) => a.as_slice(),
                Some(v) => return Err(ctx.bad("subsets", v, "an array [[datasets.subsets]]")),
                None => &[],
            };
            for sub in subsets {
                let sub = match sub {
                    Value::Table(t) => t,
                    v => return Err(ctx.bad("subsets", v, "tables [[datasets.subsets]]")),
                };
                ctx.check_keys(sub, "datasets.subsets", &[SUBSET_KEYS])?;
                set.subsets
                    .push(parse_subset(&ctx, &[sub, ds, general], base_dir)?);
            }
            out.datasets.push(set);
        }
        Ok(out)
    }

    /// kohya's folder convention: every subfolder of `train_data_dir` named `N_concept` is a subset
    /// with `num_repeats = N` and `class_tokens = concept`; the same for `reg_data_dir` with
    /// `is_reg = true`. Other subfolders are ignored (kohya warns and skips them; here
    /// [`crate::validate::validate`] lists them). Every other setting comes from `template`
    /// (its `subsets` are replaced; `template.subsets[0]`, when present, gives the caption settings).
    ///
    /// # Errors
    /// [`Error::Io`] when a folder cannot be listed.
    pub fn from_kohya_folders(
        train_data_dir: &Path,
        reg_data_dir: Option<&Path>,
        template: &ImageSetConfig,
    ) -> Result<Self> {
        let base = template
            .subsets
            .first()
            .cloned()
            .unwrap_or_else(|| SubsetConfig::new(""));
        let mut set = template.clone();
        set.subsets.clear();
        for (dir, is_reg) in [(Some(train_data_dir), false), (reg_data_dir, true)] {
            let Some(dir) = dir else { continue };
            let mut names: Vec<(PathBuf, String)> = Vec::new();
            for entry in std::fs::read_dir(dir).map_err(Error::io(dir))? {
                let entry = entry.map_err(Error::io(dir))?;
                if entry.path().is_dir() {
                    names.push((
                        entry.path(),
                        entry.file_name().to_string_lossy().into_owned(),
                    ));
                }
            }
            names.sort();
            for (path, name) in names {
                if let Some((repeats, concept)) = parse_concept_folder(&name) {
                    let mut s = base.clone();
                    s.image_dir = path;
                    s.num_repeats = repeats;
                    s.class_tokens = (!concept.is_empty()).then(|| concept.to_string());
                    s.is_reg = is_reg;
                    set.subsets.push(s);
                }
            }
        }
        Ok(DatasetConfig {
            datasets: vec![set],
        })
    }
}

/// Splits a kohya folder name `N_concept` into `(N, concept)`; `None` when it does not start with
/// digits and an underscore.
pub fn parse_concept_folder(name: &str) -> Option<(u32, &str)> {
    let (n, concept) = name.split_once('_')?;
    let repeats: u32 = n.parse().ok()?;
    Some((repeats, concept.trim()))
}

fn parse_color(v: &Value) -> Option<[u8; 3]> {
    match v {
        Value::Array(a) if a.len() == 3 => {
            let mut c = [0u8; 3];
            for (o, x) in c.iter_mut().zip(a) {
                *o = u8::try_from(x.as_integer()?).ok()?;
            }
            Some(c)
        }
        Value::String(s) => {
            let h = s.strip_prefix('#')?;
            if h.len() != 6 {
                return None;
            }
            let p = |i: usize| u8::from_str_radix(h.get(i..i + 2)?, 16).ok();
            Some([p(0)?, p(2)?, p(4)?])
        }
        _ => None,
    }
}

fn get_bool(ctx: &Ctx, layers: &[&Table], key: &str) -> Result<Option<bool>> {
    match lookup(layers, key) {
        None => Ok(None),
        Some(Value::Boolean(b)) => Ok(Some(*b)),
        Some(v) => Err(ctx.bad(key, v, "true or false")),
    }
}

fn get_uint(ctx: &Ctx, layers: &[&Table], key: &str) -> Result<Option<u64>> {
    match lookup(layers, key) {
        None => Ok(None),
        Some(Value::Integer(n)) if *n >= 0 => Ok(Some(*n as u64)),
        Some(v) => Err(ctx.bad(key, v, "a non-negative integer")),
    }
}

fn get_rate(ctx: &Ctx, layers: &[&Table], key: &str) -> Result<Option<f64>> {
    match lookup(layers, key) {
        None => Ok(None),
        Some(Value::Float(x)) if (0.0..=1.0).contains(x) => Ok(Some(*x)),
        Some(Value::Integer(n)) if (0..=1).contains(n) => Ok(Some(*n as f64)),
        Some(v) => Err(ctx.bad(key, v, "a probability between 0 and 1")),
    }
}

fn get_str(ctx: &Ctx, layers: &[&Table], key: &str) -> Result<Option<String>> {
    match lookup(layers, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ctx.bad(key, v, "a string")),
    }
}

fn parse_subset(ctx: &Ctx, layers: &[&Table], base_dir: &Path) -> Result<SubsetConfig> {
    let dir = get_str(ctx, &layers[..1], "image_dir")?.ok_or_else(|| {
        Error::config(
            "image_dir",
            "(missing)",
            format!(
                "every [[datasets.subsets]] needs image_dir (in {})",
                ctx.path.display()
            ),
        )
    })?;
    let dir = PathBuf::from(dir);
    let mut s = SubsetConfig::new(if dir.is_absolute() {
        dir
    } else {
        base_dir.join(dir)
    });
    if let Some(mut e) = get_str(ctx, layers, "caption_extension")? {
        if !e.starts_with('.') {
            e.insert(0, '.');
        }
        s.caption_extension = e;
    }
    if let Some(n) = get_uint(ctx, layers, "num_repeats")? {
        s.num_repeats = n as u32;
    }
    if let Some(n) = get_uint(ctx, layers, "keep_tokens")? {
        s.keep_tokens = n as usize;
    }
    if let Some(b) = get_bool(ctx, layers, "shuffle_caption")? {
        s.shuffle_caption = b;
    }
    if let Some(x) = get_str(ctx, layers, "caption_separator")? {
        s.caption_separator = x;
    }
    if let Some(x) = get_rate(ctx, layers, "caption_dropout_rate")? {
        s.caption_dropout_rate = x;
    }
    if let Some(x) = get_rate(ctx, layers, "caption_tag_dropout_rate")? {
        s.caption_tag_dropout_rate = x;
    }
    s.caption_prefix = get_str(ctx, layers, "caption_prefix")?;
    s.caption_suffix = get_str(ctx, layers, "caption_suffix")?;
    if let Some(b) = get_bool(ctx, layers, "flip_aug")? {
        s.flip_aug = b;
    }
    if let Some(b) = get_bool(ctx, layers, "random_crop")? {
        s.random_crop = b;
    }
    if let Some(b) = get_bool(ctx, layers, "is_reg")? {
        s.is_reg = b;
    }
    s.class_tokens = get_str(ctx, layers, "class_tokens")?;
    if let Some(b) = get_bool(ctx, layers, "random_caption_line")? {
        s.random_caption_line = b;
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOML: &str = r##"
[general]
shuffle_caption = true
caption_extension = "caption"
keep_tokens = 1

[[datasets]]
resolution = [768, 512]
batch_size = 4
enable_bucket = true
min_bucket_reso = 320
background_color = "#000000"

  [[datasets.subsets]]
  image_dir = "imgs"
  num_repeats = 10
  class_tokens = "sks dog"

  [[datasets.subsets]]
  image_dir = "/abs/reg"
  is_reg = true
  keep_tokens = 0
  shuffle_caption = false
"##;

    #[test]
    fn layers_resolve_subset_over_dataset_over_general() {
        let c =
            DatasetConfig::from_toml_str(TOML, Path::new("/data"), Path::new("d.toml")).unwrap();
        assert_eq!(c.datasets.len(), 1);
        let d = &c.datasets[0];
        assert_eq!(d.bucket.resolution, (768, 512));
        assert_eq!(d.bucket.min_bucket_reso, 320);
        assert_eq!(d.batch_size, 4);
        assert_eq!(d.background_color, [0, 0, 0]);
        let a = &d.subsets[0];
        assert_eq!(a.image_dir, PathBuf::from("/data/imgs"));
        assert_eq!(a.caption_extension, ".caption");
        assert_eq!(
            (a.num_repeats, a.keep_tokens, a.shuffle_caption),
            (10, 1, true)
        );
        assert_eq!(a.class_tokens.as_deref(), Some("sks dog"));
        let r = &d.subsets[1];
        assert_eq!(r.image_dir, PathBuf::from("/abs/reg"));
        assert!(r.is_reg && !r.shuffle_caption && r.keep_tokens == 0);
    }

    #[test]
    fn unknown_keys_get_a_hint() {
        let bad = "[general]\nshufle_caption = true\n";
        let e = DatasetConfig::from_toml_str(bad, Path::new("."), Path::new("x.toml")).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("shufle_caption") && msg.contains("did you mean `shuffle_caption`"),
            "{msg}"
        );
        let bad = "[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"a\"\ncolor_aug = true\n";
        let msg = DatasetConfig::from_toml_str(bad, Path::new("."), Path::new("x.toml"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("not supported"), "{msg}");
        let bad = "[[datasets]]\nresolution = \"big\"\n";
        assert!(matches!(
            DatasetConfig::from_toml_str(bad, Path::new("."), Path::new("x.toml")),
            Err(Error::Config { ref key, .. }) if key == "resolution"
        ));
        let bad =
            "[[datasets]]\ncaption_dropout_rate = 1.5\n[[datasets.subsets]]\nimage_dir = \"a\"\n";
        assert!(DatasetConfig::from_toml_str(bad, Path::new("."), Path::new("x.toml")).is_err());
    }

    #[test]
    fn concept_folders() {
        assert_eq!(parse_concept_folder("10_sks dog"), Some((10, "sks dog")));
        assert_eq!(parse_concept_folder("1_"), Some((1, "")));
        assert_eq!(parse_concept_folder("dogs"), None);
        assert_eq!(parse_concept_folder("x_dogs"), None);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }
}
