//! Caption sidecar files: `<image stem><caption_extension>` beside each image, the layout kohya-ss
//! sd-scripts and most LoRA trainers read (`--caption_extension .txt` / `.caption`).
//!
//! Modes ([`CaptionMode`]): `skip` leaves an existing caption alone (the default), `append` keeps
//! the existing tags first and adds the new ones it lacks (deduped by [`tag_key`]), `overwrite`
//! replaces it. A hand-written caption is therefore never replaced without an explicit
//! `overwrite`. Writes are atomic: a temporary file in the same folder, fsync, rename, then fsync
//! of the folder — a crash leaves the old caption or the new one, never half of one.
//!
//! A dry run ([`CaptionSettings::dry_run`]) computes the same [`CaptionReport`] without touching
//! any file.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tags::{join_tags, split_caption, tag_key};

/// What to do when a caption file already exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CaptionMode {
    /// Keep the existing caption (the default).
    #[default]
    Skip,
    /// Replace it.
    Overwrite,
    /// Keep its tags first and add the new tags it lacks.
    Append,
}

impl std::str::FromStr for CaptionMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "skip" | "skip-existing" | "skip_existing" => Ok(CaptionMode::Skip),
            "overwrite" => Ok(CaptionMode::Overwrite),
            "append" => Ok(CaptionMode::Append),
            other => Err(format!(
                "unknown caption mode {other:?}; use skip, overwrite or append"
            )),
        }
    }
}

/// Caption settings (config section `captions`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CaptionSettings {
    /// Extension of the caption file, with or without the dot (kohya's `caption_extension`).
    /// Default `.txt`.
    pub caption_extension: String,
    /// What to do with existing captions. Default `skip`.
    pub mode: CaptionMode,
    /// Compute the report, write nothing. Default false.
    pub dry_run: bool,
}

impl Default for CaptionSettings {
    fn default() -> Self {
        CaptionSettings {
            caption_extension: ".txt".into(),
            mode: CaptionMode::Skip,
            dry_run: false,
        }
    }
}

/// The caption file of `image`: its stem plus `extension` (a leading dot is added if missing),
/// in the image's folder. `photos/cat.png` + `.txt` → `photos/cat.txt`.
pub fn caption_path(image: &Path, extension: &str) -> PathBuf {
    let ext = if extension.starts_with('.') || extension.is_empty() {
        extension.to_string()
    } else {
        format!(".{extension}")
    };
    let stem = image
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    image.with_file_name(format!("{stem}{ext}"))
}

/// What happened (or, in a dry run, would happen) to one image's caption.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum CaptionAction {
    /// A new caption file.
    Write,
    /// An existing caption replaced (mode `overwrite`).
    Overwrite,
    /// Tags added after the existing ones (mode `append`).
    Append {
        /// Tags that were already there (kept first).
        kept: usize,
        /// New tags added.
        added: usize,
    },
    /// Nothing written.
    Skip {
        /// Why.
        reason: String,
    },
    /// The image could not be tagged or its caption could not be written.
    Fail {
        /// The error.
        error: String,
    },
}

/// One image's line in a [`CaptionReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CaptionEntry {
    /// The image.
    pub image: PathBuf,
    /// Its caption file.
    pub caption_path: PathBuf,
    /// What was (or would be) done.
    pub action: CaptionAction,
    /// The caption written (or that would be written); `None` when skipped or failed.
    pub text: Option<String>,
}

/// What a run wrote or would write.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CaptionReport {
    /// True when nothing was written.
    pub dry_run: bool,
    /// One entry per image, in input order.
    pub entries: Vec<CaptionEntry>,
}

impl CaptionReport {
    /// Entries whose action matches `f`.
    pub fn count(&self, f: impl Fn(&CaptionAction) -> bool) -> usize {
        self.entries.iter().filter(|e| f(&e.action)).count()
    }

    /// `(written new, overwritten, appended, skipped, failed)`.
    pub fn totals(&self) -> (usize, usize, usize, usize, usize) {
        (
            self.count(|a| matches!(a, CaptionAction::Write)),
            self.count(|a| matches!(a, CaptionAction::Overwrite)),
            self.count(|a| matches!(a, CaptionAction::Append { .. })),
            self.count(|a| matches!(a, CaptionAction::Skip { .. })),
            self.count(|a| matches!(a, CaptionAction::Fail { .. })),
        )
    }
}

impl fmt::Display for CaptionReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let would = if self.dry_run { "would " } else { "" };
        for e in &self.entries {
            let cap = e.caption_path.display();
            match &e.action {
                CaptionAction::Write => writeln!(f, "{would}write    {cap}")?,
                CaptionAction::Overwrite => writeln!(f, "{would}overwrite {cap}")?,
                CaptionAction::Append { kept, added } => {
                    writeln!(f, "{would}append   {cap} (+{added} tags after {kept})")?
                }
                CaptionAction::Skip { reason } => writeln!(f, "skip     {cap}: {reason}")?,
                CaptionAction::Fail { error } => {
                    writeln!(f, "FAILED   {}: {error}", e.image.display())?
                }
            }
            if let Some(t) = &e.text
                && !matches!(e.action, CaptionAction::Skip { .. })
            {
                writeln!(f, "           {t}")?;
            }
        }
        let (w, o, a, s, x) = self.totals();
        write!(
            f,
            "{}{w} new, {o} overwritten, {a} appended, {s} skipped, {x} failed",
            if self.dry_run { "dry run: " } else { "" }
        )
    }
}

/// Writes caption files according to [`CaptionSettings`].
#[derive(Debug, Clone, Default)]
pub struct CaptionWriter {
    /// The settings.
    pub settings: CaptionSettings,
}

impl CaptionWriter {
    /// A writer with these settings.
    pub fn new(settings: CaptionSettings) -> Self {
        CaptionWriter { settings }
    }

    /// The caption file of `image`.
    pub fn caption_path(&self, image: &Path) -> PathBuf {
        caption_path(image, &self.settings.caption_extension)
    }

    /// The existing caption of `image`, if it has a non-blank one.
    ///
    /// # Errors
    /// [`Error::Io`] naming the caption file when it exists but cannot be read.
    pub fn existing(&self, image: &Path) -> Result<Option<String>> {
        let p = self.caption_path(image);
        match std::fs::read_to_string(&p) {
            Ok(s) if s.trim().is_empty() => Ok(None),
            Ok(s) => Ok(Some(s)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Error::Io { path: p, source }),
        }
    }

    /// Whether `image` needs tagging at all: false in mode `skip` when a caption exists.
    ///
    /// # Errors
    /// As [`CaptionWriter::existing`].
    pub fn needs_tags(&self, image: &Path) -> Result<bool> {
        Ok(self.settings.mode != CaptionMode::Skip || self.existing(image)?.is_none())
    }

    /// Decides what to do for `image` given its new `tags` (already post-processed), without
    /// writing.
    ///
    /// # Errors
    /// As [`CaptionWriter::existing`].
    pub fn plan(&self, image: &Path, tags: &[String]) -> Result<CaptionEntry> {
        let caption_path = self.caption_path(image);
        let existing = self.existing(image)?;
        let entry = |action, text| CaptionEntry {
            image: image.to_path_buf(),
            caption_path: caption_path.clone(),
            action,
            text,
        };
        if tags.is_empty() && existing.is_none() {
            return Ok(entry(
                CaptionAction::Skip {
                    reason: "no tag above the thresholds (lower image.general_threshold)".into(),
                },
                None,
            ));
        }
        Ok(match (existing, self.settings.mode) {
            (None, _) => entry(CaptionAction::Write, Some(join_tags(tags))),
            (Some(_), CaptionMode::Skip) => entry(
                CaptionAction::Skip {
                    reason: "a caption already exists (use mode append or overwrite to change it)"
                        .into(),
                },
                None,
            ),
            (Some(_), CaptionMode::Overwrite) => {
                entry(CaptionAction::Overwrite, Some(join_tags(tags)))
            }
            (Some(old), CaptionMode::Append) => {
                let mut merged = split_caption(&old);
                let kept = merged.len();
                let mut keys: std::collections::HashSet<String> =
                    merged.iter().map(|t| tag_key(t)).collect();
                for t in tags {
                    if keys.insert(tag_key(t)) {
                        merged.push(t.clone());
                    }
                }
                let added = merged.len() - kept;
                if added == 0 {
                    entry(
                        CaptionAction::Skip {
                            reason: "the caption already has every new tag".into(),
                        },
                        None,
                    )
                } else {
                    entry(
                        CaptionAction::Append { kept, added },
                        Some(join_tags(&merged)),
                    )
                }
            }
        })
    }

    /// Plans and (unless a dry run) writes `image`'s caption.
    ///
    /// # Errors
    /// [`Error::NotWritable`] naming the folder when it cannot be written; [`Error::Io`] naming
    /// the file for other failures.
    pub fn write(&self, image: &Path, tags: &[String]) -> Result<CaptionEntry> {
        let e = self.plan(image, tags)?;
        if !self.settings.dry_run
            && let Some(text) = &e.text
        {
            write_atomic(&e.caption_path, format!("{text}\n").as_bytes())?;
        }
        Ok(e)
    }
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `path` atomically: a temporary file in the same folder
/// (`.<name>.tmp-<pid>-<n>`), `fsync`, rename over `path`, then `fsync` of the folder.
///
/// # Errors
/// [`Error::NotWritable`] naming the folder when it is read-only or not writable (permission
/// denied, read-only file system, immutable); [`Error::Io`] naming the file otherwise.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = folder.join(format!(
        ".{name}.tmp-{}-{}",
        std::process::id(),
        TMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let classify = |source: std::io::Error, file: &Path| {
        // EACCES, EPERM (e.g. `chattr +i`), EROFS.
        let read_only = matches!(source.raw_os_error(), Some(1) | Some(13) | Some(30))
            || source.kind() == std::io::ErrorKind::PermissionDenied;
        if read_only {
            Error::NotWritable {
                folder: folder.clone(),
                source,
            }
        } else {
            Error::Io {
                path: file.to_path_buf(),
                source,
            }
        }
    };
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| classify(e, &tmp))?;
        f.write_all(bytes).map_err(|e| classify(e, &tmp))?;
        f.sync_all().map_err(|e| classify(e, &tmp))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| classify(e, path))?;
        // Persist the rename; not every file system supports fsync on a folder.
        if let Ok(d) = std::fs::File::open(&folder) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(s: &[&str]) -> Vec<String> {
        s.iter().map(|t| t.to_string()).collect()
    }

    #[test]
    fn paths_modes_and_dry_run() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("chelsea.png");
        assert_eq!(
            caption_path(&img, "caption"),
            dir.path().join("chelsea.caption")
        );
        assert_eq!(caption_path(&img, ".txt"), dir.path().join("chelsea.txt"));

        let mk = |mode, dry_run| {
            CaptionWriter::new(CaptionSettings {
                caption_extension: ".txt".into(),
                mode,
                dry_run,
            })
        };
        let new_tags = tags(&["tabby", "tiger cat", "Egyptian cat"]);
        // Dry run: reports a write, writes nothing.
        let e = mk(CaptionMode::Skip, true).write(&img, &new_tags).unwrap();
        assert_eq!(e.action, CaptionAction::Write);
        assert_eq!(e.text.as_deref(), Some("tabby, tiger cat, Egyptian cat"));
        assert!(!dir.path().join("chelsea.txt").exists());

        // A hand-written caption survives skip and append; overwrite replaces it.
        let cap = dir.path().join("chelsea.txt");
        std::fs::write(&cap, "my cat Chelsea, Tabby\n").unwrap();
        let e = mk(CaptionMode::Skip, false).write(&img, &new_tags).unwrap();
        assert!(matches!(e.action, CaptionAction::Skip { .. }));
        assert_eq!(
            std::fs::read_to_string(&cap).unwrap(),
            "my cat Chelsea, Tabby\n"
        );
        assert!(!mk(CaptionMode::Skip, false).needs_tags(&img).unwrap());

        let e = mk(CaptionMode::Append, false)
            .write(&img, &new_tags)
            .unwrap();
        assert_eq!(e.action, CaptionAction::Append { kept: 2, added: 2 });
        assert_eq!(
            std::fs::read_to_string(&cap).unwrap(),
            "my cat Chelsea, Tabby, tiger cat, Egyptian cat\n"
        );
        // Appending again adds nothing.
        let e = mk(CaptionMode::Append, false)
            .write(&img, &new_tags)
            .unwrap();
        assert!(matches!(e.action, CaptionAction::Skip { .. }), "{e:?}");

        let e = mk(CaptionMode::Overwrite, false)
            .write(&img, &new_tags)
            .unwrap();
        assert_eq!(e.action, CaptionAction::Overwrite);
        assert_eq!(
            std::fs::read_to_string(&cap).unwrap(),
            "tabby, tiger cat, Egyptian cat\n"
        );
        // No temporary file is left behind.
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, ["chelsea.txt"]);

        let report = CaptionReport {
            dry_run: true,
            entries: vec![e],
        };
        let text = report.to_string();
        assert!(
            text.contains("would overwrite") && text.contains("1 overwritten"),
            "{text}"
        );
    }

    /// A read-only folder gives an error naming the folder and what to do. As root, permission
    /// bits do not stop writes, so the folder is made immutable (`chattr +i`) instead.
    #[test]
    fn read_only_folder_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let ro = dir.path().join("ro");
        std::fs::create_dir(&ro).unwrap();
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false);
        struct Undo(PathBuf, bool);
        impl Drop for Undo {
            fn drop(&mut self) {
                if self.1 {
                    let _ = std::process::Command::new("chattr")
                        .arg("-i")
                        .arg(&self.0)
                        .status();
                } else {
                    use std::os::unix::fs::PermissionsExt;
                    let _ =
                        std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o755));
                }
            }
        }
        let _undo = Undo(ro.clone(), root);
        if root {
            let ok = std::process::Command::new("chattr")
                .arg("+i")
                .arg(&ro)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                eprintln!(
                    "skipping the read-only assertion: running as root and `chattr +i` is not \
                     available on this file system"
                );
                return;
            }
        } else {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
        }
        let w = CaptionWriter::default();
        let err = w
            .write(&ro.join("rocket.jpg"), &tags(&["space shuttle"]))
            .unwrap_err();
        assert!(matches!(err, Error::NotWritable { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&ro.display().to_string()) && msg.contains("writable"),
            "{msg}"
        );
        // A folder that is a file: the error names the path.
        let file = dir.path().join("plain-file");
        std::fs::write(&file, "x").unwrap();
        let err = w.write(&file.join("a.png"), &tags(&["x"])).unwrap_err();
        assert!(err.to_string().contains("plain-file"), "{err}");
    }
}
