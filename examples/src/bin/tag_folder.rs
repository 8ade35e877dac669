//! Auto-label a folder of images: one caption file per image, as kohya-style trainers read them.
//!
//! ```sh
//! cargo run -p lora-examples --release --bin tag_folder -- [FOLDER]
//! # default: output/examples/tag_folder, filled with four photos from assets/skimage first
//! ```
//!
//! The image tagger is the MobileNetV2 ImageNet classifier that `cargo xtask setup` puts in
//! `assets/mobilenet_v2` (a WD14 tagger folder with `model.safetensors` and
//! `selected_tags.csv` works the same way through `config.image.model`). Tags above the
//! threshold are post-processed (underscores to spaces, blacklist, order) and written to
//! `<image>.txt`; existing captions are kept (mode `skip`).

use anyhow::{Context, Result, bail};
use lora_tagger::caption::CaptionAction;
use lora_tagger::run::{list_images, tag_to_captions};
use lora_tagger::{CaptionWriter, ImageTagger, TaggerConfig};
use std::path::{Path, PathBuf};

fn main() -> Result<()> {
    let folder = std::env::args().nth(1).map(PathBuf::from);
    let assets =
        PathBuf::from(std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "assets".into()));
    let folder = match folder {
        Some(f) => f,
        None => fill_default_folder(&assets)?,
    };

    let mut config = TaggerConfig::default();
    config.image.model = Some(assets.join("mobilenet_v2"));
    config.captions.caption_extension = ".txt".into();
    let mut tagger = ImageTagger::from_config(&config)?;
    if !folder.is_dir() {
        bail!("{}: not a folder of images", folder.display());
    }
    let images = list_images(&folder)?;
    if images.is_empty() {
        bail!(
            "{}: no images directly in it (PNG, JPEG, WebP, …; subfolders are not searched)",
            folder.display()
        );
    }
    let writer = CaptionWriter::new(config.captions.clone());
    let run = tag_to_captions(&mut tagger, &images, &config.tags, &writer)?;

    for (image, tags) in &run.tags {
        let best: Vec<String> = tags
            .iter()
            .take(3)
            .map(|t| format!("{} {:.2}", t.tag, t.score))
            .collect();
        println!("{}: {}", image.display(), best.join(", "));
    }
    let mut failed = 0;
    for e in &run.report.entries {
        let what = match (&e.action, &e.text) {
            (CaptionAction::Fail { error }, _) => {
                failed += 1;
                format!("FAILED: {error}")
            }
            (CaptionAction::Skip { reason }, _) => format!("kept ({reason})"),
            (_, Some(text)) => format!("{text:?}"),
            (_, None) => "(nothing written)".into(),
        };
        println!(
            "{} → {}: {what}",
            e.image.display(),
            e.caption_path.display()
        );
    }
    println!(
        "{} of {} images tagged in {:.2} s",
        run.tagged - failed.min(run.tagged),
        images.len(),
        run.tagging_s
    );
    if failed > 0 {
        bail!(
            "{failed} of {} images could not be tagged (see above)",
            images.len()
        );
    }
    Ok(())
}

/// Copies four photos from `assets/skimage` into the default folder (once).
fn fill_default_folder(assets: &Path) -> Result<PathBuf> {
    let dir = PathBuf::from("output/examples/tag_folder");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for name in ["chelsea.png", "coffee.png", "astronaut.png", "rocket.jpg"] {
        let to = dir.join(name);
        if !to.exists() {
            let from = assets.join("skimage").join(name);
            std::fs::copy(&from, &to)
                .with_context(|| format!("copying {} (run `cargo xtask setup`)", from.display()))?;
        }
    }
    Ok(dir)
}
