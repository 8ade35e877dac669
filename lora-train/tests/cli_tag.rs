//! `lora-train tag` on a temporary copy of real photos (`assets/skimage`) with the real
//! MobileNetV2 ImageNet model (`assets/mobilenet_v2`): one hand-written caption must survive, one
//! corrupt image fails alone (exit 1, the others written), append keeps hand-written tags first,
//! a dry run writes nothing, an unknown config key exits 2.

#![cfg(feature = "tagger")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn assets() -> PathBuf {
    PathBuf::from(std::env::var_os("LORA_SDK_ASSETS").unwrap_or_else(|| "../assets".into()))
}

fn tag(dir: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .arg("tag")
        .arg("--images")
        .arg(dir)
        .arg("--model")
        .arg(assets().join("mobilenet_v2"))
        .args(extra)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn tags_a_folder_keeps_hand_written_captions_and_isolates_a_corrupt_image() {
    let model = assets().join("mobilenet_v2/model.safetensors");
    assert!(
        model.exists(),
        "{} is missing: run `cargo xtask setup`",
        model.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for n in ["chelsea.png", "coffee.png", "motorcycle_left.png"] {
        std::fs::copy(assets().join("skimage").join(n), d.join(n)).unwrap();
    }
    std::fs::write(d.join("coffee.txt"), "my morning coffee, latte art\n").unwrap();
    std::fs::write(d.join("broken.png"), b"\x89PNG\r\n\x1a\nnot a png").unwrap();

    let o = tag(
        d,
        &["--threshold", "0.05", "--trigger", "sks", "--max-tags", "2"],
    );
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "one image failed: {out}");
    assert!(
        out.contains("FAILED") && out.contains("broken.png"),
        "{out}"
    );
    assert!(out.contains("images/s"), "{out}");
    let read = |n: &str| std::fs::read_to_string(d.join(n)).unwrap();
    // Chelsea is a tabby cat; the trigger word comes first, then at most 2 model tags.
    let chelsea = read("chelsea.txt");
    let tags: Vec<&str> = chelsea.trim().split(", ").collect();
    assert_eq!(tags[0], "sks", "{chelsea}");
    assert_eq!(tags.len(), 3, "{chelsea}");
    assert!(
        tags[1..]
            .iter()
            .all(|t| ["Egyptian cat", "tiger cat", "tabby"].contains(t)),
        "{chelsea}"
    );
    assert!(
        read("motorcycle_left.txt").starts_with("sks, moped"),
        "{}",
        read("motorcycle_left.txt")
    );
    assert_eq!(
        read("coffee.txt"),
        "my morning coffee, latte art\n",
        "hand-written caption kept"
    );
    assert!(!d.join("broken.txt").exists());

    // A dry run of append reports and writes nothing.
    let o = tag(d, &["--threshold", "0.05", "--mode", "append", "--dry-run"]);
    let out = text(&o);
    assert!(
        out.contains("would append") && out.contains("coffee.txt"),
        "{out}"
    );
    assert_eq!(read("coffee.txt"), "my morning coffee, latte art\n");

    // Append: the hand-written tags stay first, the model's follow, into a .caption extension.
    std::fs::remove_file(d.join("broken.png")).unwrap();
    std::fs::copy(d.join("coffee.txt"), d.join("coffee.caption")).unwrap();
    let o = tag(
        d,
        &[
            "--threshold",
            "0.5",
            "--mode",
            "append",
            "--caption-extension",
            ".caption",
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(
        read("coffee.caption"),
        "my morning coffee, latte art, espresso\n"
    );
    assert_eq!(read("coffee.txt"), "my morning coffee, latte art\n");

    // An unknown config key is a usage error (exit 2) with a hint.
    let cfg = d.join("tagger.yaml");
    std::fs::write(&cfg, "image:\n  general_treshold: 0.2\n").unwrap();
    let o = tag(d, &["--config", cfg.to_str().unwrap()]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("did you mean `image.general_threshold`"),
        "{out}"
    );
}

#[test]
fn the_default_threshold_follows_the_models_head_and_is_printed() {
    // Four photos the ImageNet (softmax) MobileNetV2 gives no class at WD14's 0.35.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let photos = ["astronaut.png", "brick.png", "grass.png", "moon.png"];
    for n in photos {
        std::fs::copy(assets().join("skimage").join(n), d.join(n)).unwrap();
    }
    let o = tag(d, &["--dry-run"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(
        out.contains("general-tag threshold 0.05 (the default for single-label softmax"),
        "{out}"
    );
    assert!(
        out.contains("dry run: 4 new"),
        "every photo gets a tag: {out}"
    );
    let o = tag(d, &["--dry-run", "--threshold", "0.35"]);
    let out = text(&o);
    assert!(
        out.contains("general-tag threshold 0.35 (image.general_threshold / --threshold)"),
        "{out}"
    );
    assert!(out.contains("4 skipped"), "{out}");
}
