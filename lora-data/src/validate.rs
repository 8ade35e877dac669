//! Checking an image dataset before training: every problem, with the file, what is wrong and how to
//! fix it. Nothing on disk is ever modified.
//!
//! [`validate`] decodes every image fully (in parallel), so corrupt and truncated files are found
//! here rather than hours into a run. [`Policy`] says what [`crate::image::ImageDataset::new`] does
//! with them.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::image::bucket::{place, select_bucket};
use crate::image::caption::{CaptionError, decode_caption};
use crate::image::config::{DatasetConfig, SmallImages, SubsetConfig};
use crate::image::decode::{
    DecodeFailure, decode_file, is_image_extension, is_unsupported_image_extension,
};

/// What is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ProblemKind {
    /// A subset's folder is missing or cannot be listed.
    UnreadableFolder,
    /// A subset's folder holds no usable image.
    NoImages,
    /// An image file is empty.
    ZeroByte,
    /// An image file ends early.
    Truncated,
    /// An image file's data is not a valid image.
    Corrupt,
    /// An image format this crate cannot decode (HEIC, AVIF, PSD, …).
    UnknownFormat,
    /// No caption sidecar and no class tokens.
    MissingCaption,
    /// The caption sidecar holds only whitespace.
    EmptyCaption,
    /// The caption sidecar is not UTF-8.
    NonUtf8Caption,
    /// Two images share a file stem (and so a caption file) in one folder.
    DuplicateStem,
    /// The image is smaller than its bucket and `small_images = "skip"`.
    TooSmall,
}

/// One problem found by [`validate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file or folder.
    pub path: PathBuf,
    /// Category.
    pub kind: ProblemKind,
    /// What is wrong.
    pub what: String,
    /// What to do about it.
    pub fix: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {}; fix: {}",
            self.path.display(),
            self.what,
            self.fix
        )
    }
}

/// What to do with problems when building a dataset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// Leave the affected images out; the problems stay available
    /// ([`crate::image::ImageDataset::problems`]) for the caller to print as warnings.
    #[default]
    Skip,
    /// Refuse to build ([`crate::Error::Invalid`] listing every problem). Images left out on
    /// purpose (`small_images = "skip"`) do not count.
    Fail,
}

/// An image that passed every check.
#[derive(Debug, Clone)]
pub(crate) struct ScannedImage {
    pub path: PathBuf,
    pub dataset: usize,
    pub subset: usize,
    /// Caption text (all lines, normalized) or the class tokens.
    pub caption: String,
    /// Size after EXIF orientation `(width, height)`.
    pub size: (u32, u32),
}

/// Lists every problem of `config`'s images and captions. See the module docs.
pub fn validate(config: &DatasetConfig) -> Vec<Problem> {
    scan(config).1
}

struct Candidate {
    path: PathBuf,
    dataset: usize,
    subset: usize,
    caption_path: Option<PathBuf>,
}

pub(crate) fn scan(config: &DatasetConfig) -> (Vec<ScannedImage>, Vec<Problem>) {
    let mut problems = Vec::new();
    let mut candidates = Vec::new();
    let mut per_subset: BTreeMap<(usize, usize), PathBuf> = BTreeMap::new();
    for (di, ds) in config.datasets.iter().enumerate() {
        for (si, sub) in ds.subsets.iter().enumerate() {
            per_subset.insert((di, si), sub.image_dir.clone());
            list_subset(di, si, sub, &mut candidates, &mut problems);
        }
    }
    let checked: Vec<Result<ScannedImage, Problem>> = candidates
        .into_par_iter()
        .map(|c| check_one(config, c))
        .collect();
    let mut images = Vec::new();
    let mut used: HashSet<(usize, usize)> = HashSet::new();
    for r in checked {
        match r {
            Ok(img) => {
                used.insert((img.dataset, img.subset));
                images.push(img);
            }
            Err(p) => problems.push(p),
        }
    }
    for (key, dir) in per_subset {
        let unreadable = problems
            .iter()
            .any(|p| p.kind == ProblemKind::UnreadableFolder && p.path == dir);
        if !used.contains(&key) && !unreadable {
            // subfolders are only read as kohya `<repeats>_<concept>` folders: say so when the
            // images are probably in ones named otherwise
            let mut subdirs: Vec<String> = std::fs::read_dir(&dir)
                .map(|it| {
                    it.filter_map(|e| e.ok())
                        .filter(|e| e.path().is_dir())
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            subdirs.sort();
            let fix = match subdirs.first() {
                Some(first) => format!(
                    "its subfolders ({}) are not read: only kohya `<repeats>_<concept>` folders are (e.g. 10_{first}); rename them, or point the data folder at the one holding the images",
                    subdirs.join(", ")
                ),
                None => "add images (png, jpg, webp, bmp, gif, tiff) or remove the subset".into(),
            };
            problems.push(Problem {
                path: dir,
                kind: ProblemKind::NoImages,
                what: "no usable image in this folder".into(),
                fix,
            });
        }
    }
    problems.sort_by(|a, b| (&a.path, a.kind).cmp(&(&b.path, b.kind)));
    (images, problems)
}

fn list_subset(
    di: usize,
    si: usize,
    sub: &SubsetConfig,
    out: &mut Vec<Candidate>,
    problems: &mut Vec<Problem>,
) {
    let dir = &sub.image_dir;
    let unreadable = |e: std::io::Error| Problem {
        path: dir.clone(),
        kind: ProblemKind::UnreadableFolder,
        what: format!("cannot list the folder ({e})"),
        fix: "check image_dir and the folder's permissions".into(),
    };
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) => {
            problems.push(unreadable(e));
            return;
        }
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for entry in rd {
        match entry {
            Ok(e) => {
                let p = e.path();
                if p.is_file() {
                    files.push(p);
                }
            }
            Err(e) => {
                problems.push(unreadable(e));
                return;
            }
        }
    }
    files.sort();
    let lower_names: BTreeMap<String, PathBuf> = files
        .iter()
        .filter_map(|p| Some((p.file_name()?.to_string_lossy().to_lowercase(), p.clone())))
        .collect();
    let mut stems: BTreeMap<String, PathBuf> = BTreeMap::new();
    let cap_ext = sub.caption_extension.to_lowercase();
    for p in files {
        let ext = p
            .extension()
            .map(|e| e.to_string_lossy().into_owned())
            .unwrap_or_default();
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with('.') {
            continue;
        }
        if is_unsupported_image_extension(&ext) {
            let f = DecodeFailure::unsupported_extension(&ext);
            problems.push(Problem {
                path: p.clone(),
                kind: ProblemKind::UnknownFormat,
                what: f.what(),
                fix: f.fix().into(),
            });
            continue;
        }
        if !is_image_extension(&ext) {
            continue;
        }
        let stem = p
            .file_stem()
            .map(|s| s.to_string_lossy().to_lowercase())
            .unwrap_or_default();
        if let Some(first) = stems.get(&stem) {
            problems.push(Problem {
                path: p.clone(),
                kind: ProblemKind::DuplicateStem,
                what: format!(
                    "shares its name stem with {} and would share its caption",
                    first.display()
                ),
                fix: "rename one of them (and its caption file)".into(),
            });
            continue;
        }
        stems.insert(stem.clone(), p.clone());
        let caption_path = lower_names.get(&format!("{stem}{cap_ext}")).cloned();
        out.push(Candidate {
            path: p,
            dataset: di,
            subset: si,
            caption_path,
        });
    }
}

fn check_one(config: &DatasetConfig, c: Candidate) -> Result<ScannedImage, Problem> {
    let ds = &config.datasets[c.dataset];
    let sub = &ds.subsets[c.subset];
    let problem = |path: &Path, kind, what: String, fix: &str| Problem {
        path: path.to_path_buf(),
        kind,
        what,
        fix: fix.to_string(),
    };
    let decoded = decode_file(&c.path, ds.background_color).map_err(|f| {
        let kind = match f {
            DecodeFailure::ZeroByte => ProblemKind::ZeroByte,
            DecodeFailure::Truncated(_) => ProblemKind::Truncated,
            DecodeFailure::Corrupt(_) => ProblemKind::Corrupt,
            DecodeFailure::Unsupported(_) => ProblemKind::UnknownFormat,
            DecodeFailure::Io(_) => ProblemKind::UnreadableFolder,
        };
        problem(&c.path, kind, f.what(), f.fix())
    })?;
    let size = decoded.rgb.dimensions();
    let caption = match &c.caption_path {
        Some(cp) => {
            let bytes = std::fs::read(cp).map_err(|e| {
                problem(
                    cp,
                    ProblemKind::MissingCaption,
                    format!("cannot read the caption ({e})"),
                    "check the caption file's permissions",
                )
            })?;
            decode_caption(&bytes).map_err(|e| match e {
                CaptionError::NonUtf8 { at } => problem(
                    cp,
                    ProblemKind::NonUtf8Caption,
                    format!("caption is not UTF-8 (invalid byte at offset {at})"),
                    "re-save it as UTF-8 (e.g. `iconv -f cp1252 -t utf-8`)",
                ),
                CaptionError::Empty => problem(
                    cp,
                    ProblemKind::EmptyCaption,
                    "caption file is empty".into(),
                    "write the caption, or delete the file to use the class tokens",
                ),
            })?
        }
        None => match sub.class_tokens.as_deref().filter(|t| !t.trim().is_empty()) {
            Some(t) => t.trim().to_string(),
            None => {
                return Err(problem(
                    &c.path,
                    ProblemKind::MissingCaption,
                    format!(
                        "no caption file `{}`",
                        caption_name(&c.path, &sub.caption_extension)
                    ),
                    "write the caption sidecar, or set class_tokens (or name the folder N_concept)",
                ));
            }
        },
    };
    if ds.small_images == SmallImages::Skip
        && let Ok(buckets) = ds.bucket.buckets()
        && let Some((bucket, _)) = select_bucket(&buckets, size)
        && place(size, bucket, None).scale > 1.0
    {
        return Err(problem(
            &c.path,
            ProblemKind::TooSmall,
            format!(
                "{}x{} is smaller than its bucket {}x{}",
                size.0, size.1, bucket.0, bucket.1
            ),
            "use a larger image or set small_images = \"upscale\"",
        ));
    }
    Ok(ScannedImage {
        path: c.path,
        dataset: c.dataset,
        subset: c.subset,
        caption,
        size,
    })
}

fn caption_name(image: &Path, ext: &str) -> String {
    let stem = image
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!("{stem}{ext}")
}

/// Formats problems one per line (for [`crate::Error::Invalid`] and logs).
pub fn report(problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| format!("  {p}"))
        .collect::<Vec<_>>()
        .join("\n")
}
