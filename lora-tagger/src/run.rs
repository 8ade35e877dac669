//! From a folder of images to caption files: list, tag (only what needs tags), post-process,
//! write (or plan, in a dry run), report.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crate::caption::{CaptionAction, CaptionEntry, CaptionReport, CaptionWriter};
use crate::error::{Error, Result};
use crate::tags::PostProcess;
use crate::{Captioner, ScoredTag, Tagger};

pub use lora_data::image::decode::IMAGE_EXTENSIONS;

/// The images directly inside `dir` (not recursive), sorted by name.
///
/// # Errors
/// [`Error::Io`] naming the folder when it cannot be listed.
pub fn list_images(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| IMAGE_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
        })
        .collect();
    out.sort();
    Ok(out)
}

/// The files directly inside `dir` whose extension names an image format that cannot be decoded
/// here (HEIC, AVIF, JPEG XL, …; [`lora_data::image::decode::UNSUPPORTED_IMAGE_EXTENSIONS`]),
/// sorted by name, each with the diagnosis training gives it — so a command can name every image
/// it leaves out.
///
/// # Errors
/// [`Error::Io`] naming the folder when it cannot be listed.
pub fn list_unsupported_images(
    dir: &Path,
) -> Result<Vec<(PathBuf, lora_data::image::decode::DecodeFailure)>> {
    use lora_data::image::decode::{DecodeFailure, is_unsupported_image_extension};
    let rd = std::fs::read_dir(dir).map_err(|source| Error::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut out: Vec<(PathBuf, DecodeFailure)> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .filter_map(|p| {
            let ext = p.extension()?.to_str()?.to_string();
            is_unsupported_image_extension(&ext)
                .then(|| (p, DecodeFailure::unsupported_extension(&ext)))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The outcome of [`tag_to_captions`].
#[derive(Debug, Clone)]
pub struct FolderRun {
    /// What was written or skipped, per image.
    pub report: CaptionReport,
    /// The model's tags (before post-processing) of every image that was tagged.
    pub tags: Vec<(PathBuf, Vec<ScoredTag>)>,
    /// Images sent to the model (those whose caption is kept in mode `skip` are not).
    pub tagged: usize,
    /// Seconds spent in the tagger.
    pub tagging_s: f64,
}

impl FolderRun {
    /// Images tagged per second of tagging (0 when none).
    pub fn images_per_s(&self) -> f64 {
        if self.tagging_s > 0.0 {
            self.tagged as f64 / self.tagging_s
        } else {
            0.0
        }
    }
}

/// Tags `images` with `tagger`, post-processes with `post`, and writes captions with `writer`
/// (or, in a dry run, reports what it would write). One image failing (unreadable, undecodable,
/// caption not writable) fails its entry only; a folder that cannot be written at all stops the
/// run with [`Error::NotWritable`] before more files are tried.
///
/// # Errors
/// The tagger's batch-level errors (model cannot run, out of memory at a batch of 1) and
/// [`Error::NotWritable`].
pub fn tag_to_captions(
    tagger: &mut dyn Tagger,
    images: &[PathBuf],
    post: &PostProcess,
    writer: &CaptionWriter,
) -> Result<FolderRun> {
    tag_to_captions_with_progress(tagger, images, post, writer, usize::MAX, &mut |_| {})
}

/// How far a folder run is, for a progress bar: images tagged so far of those that need tags
/// (images whose caption is kept are not counted), and the seconds since tagging started.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Images tagged so far.
    pub done: usize,
    /// Images that need tags.
    pub total: usize,
    /// Seconds since tagging started.
    pub elapsed_s: f64,
}

impl Progress {
    /// Seconds left at the rate so far (`None` before the first image is done).
    pub fn eta_s(&self) -> Option<f64> {
        (self.done > 0).then(|| {
            self.elapsed_s / self.done as f64 * self.total.saturating_sub(self.done) as f64
        })
    }
}

/// [`tag_to_captions`] that hands the tagger at most `chunk` images at a time (its own
/// micro-batching and out-of-memory halving still apply inside a chunk) and calls `on_progress`
/// after each chunk: the hook of a progress bar with an ETA. A `chunk` of 0 counts as 1.
///
/// # Errors
/// As [`tag_to_captions`].
pub fn tag_to_captions_with_progress(
    tagger: &mut dyn Tagger,
    images: &[PathBuf],
    post: &PostProcess,
    writer: &CaptionWriter,
    chunk: usize,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<FolderRun> {
    run_folder(images, writer, chunk, on_progress, &mut |part| {
        Ok(tagger
            .tag_images(part)?
            .into_iter()
            .map(|r| r.map(|tags| (post.apply(&tags), tags)))
            .collect())
    })
}

/// [`tag_to_captions_with_progress`] for a [`Captioner`]: each image's caption is written after
/// the trigger words (`post.always_first`), as one line: `"sks, A tabby cat asleep on a sofa."`.
/// The rest of `post` applies to tags, not to sentences, and is not used; in mode `append` the
/// caption is added to the existing tags as one more entry. [`FolderRun::tags`] stays empty.
///
/// # Errors
/// As [`tag_to_captions`], with the captioner's batch-level errors.
pub fn caption_to_files_with_progress(
    captioner: &mut dyn Captioner,
    images: &[PathBuf],
    post: &PostProcess,
    writer: &CaptionWriter,
    chunk: usize,
    on_progress: &mut dyn FnMut(Progress),
) -> Result<FolderRun> {
    let first: Vec<String> = post
        .always_first
        .iter()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    run_folder(images, writer, chunk, on_progress, &mut |part| {
        Ok(captioner
            .caption_images(part)?
            .into_iter()
            .map(|r| {
                r.map(|caption| {
                    let mut line = first.clone();
                    line.push(caption);
                    (line, Vec::new())
                })
            })
            .collect())
    })
}

/// One image's caption entries (what is written, joined by `", "`) and the model's tags.
type Produced = Result<(Vec<String>, Vec<ScoredTag>)>;

/// The folder loop both entry points share: plan, produce in chunks, write, report.
fn run_folder(
    images: &[PathBuf],
    writer: &CaptionWriter,
    chunk: usize,
    on_progress: &mut dyn FnMut(Progress),
    produce: &mut dyn FnMut(&[PathBuf]) -> Result<Vec<Produced>>,
) -> Result<FolderRun> {
    let mut entries: Vec<Option<CaptionEntry>> = vec![None; images.len()];
    let mut todo = Vec::new();
    for (i, img) in images.iter().enumerate() {
        match writer.needs_tags(img) {
            Ok(true) => todo.push(i),
            Ok(false) => {
                entries[i] = Some(writer.plan(img, &[])?);
            }
            Err(e) => entries[i] = Some(fail(img, writer, &e)),
        }
    }
    let paths: Vec<PathBuf> = todo.iter().map(|&i| images[i].clone()).collect();
    let t = Instant::now();
    let mut results = Vec::with_capacity(paths.len());
    for part in paths.chunks(chunk.max(1)) {
        let out = produce(part)?;
        if out.len() != part.len() {
            return Err(Error::Format {
                path: PathBuf::from("<tagger>"),
                msg: format!("{} images gave {} results", part.len(), out.len()),
            });
        }
        results.extend(out);
        on_progress(Progress {
            done: results.len(),
            total: paths.len(),
            elapsed_s: t.elapsed().as_secs_f64(),
        });
    }
    let tagging_s = t.elapsed().as_secs_f64();
    let mut all_tags = Vec::new();
    for (&i, r) in todo.iter().zip(results) {
        let img = &images[i];
        entries[i] = Some(match r {
            Ok((line, tags)) => {
                if !tags.is_empty() {
                    all_tags.push((img.clone(), tags));
                }
                match writer.write(img, &line) {
                    Ok(e) => e,
                    Err(e @ Error::NotWritable { .. }) => return Err(e),
                    Err(e) => fail(img, writer, &e),
                }
            }
            Err(e) => fail(img, writer, &e),
        });
    }
    Ok(FolderRun {
        report: CaptionReport {
            dry_run: writer.settings.dry_run,
            entries: entries.into_iter().flatten().collect(),
        },
        tags: all_tags,
        tagged: paths.len(),
        tagging_s,
    })
}

fn fail(img: &Path, writer: &CaptionWriter, e: &Error) -> CaptionEntry {
    CaptionEntry {
        image: img.to_path_buf(),
        caption_path: writer.caption_path(img),
        action: CaptionAction::Fail {
            error: e.to_string(),
        },
        text: None,
    }
}
