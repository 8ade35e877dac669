//! WD14 ONNX taggers through ONNX Runtime, on WD14-layout models that
//! `python/wd14_onnx_fixture.py` builds (random weights, exported with `torch.onnx.export`; a v3
//! folder with a dynamic batch and a v2 folder with v2's names and a fixed batch of 1) and on real
//! photos (`assets/skimage`):
//!
//! - preprocessing: our WD14 pixels equal the reference `prepare_image` (PIL bicubic) exactly;
//! - parity: our scores equal Python onnxruntime's within 1e-5, through the whole tagger;
//! - selection: fixed thresholds and MCut keep the tags the reference post-processing keeps;
//! - errors: a wrong runtime path says how to get one.
//!
//! The runtime is the venv's `onnxruntime` wheel (`python/requirements.txt`), found as users' is.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use lora_tagger::config::TaggerConfig;
use lora_tagger::image::onnx::find_onnxruntime;
use lora_tagger::{Error, ImageTagger, TagCategory, Tagger};
use tch::Tensor;

const PHOTOS: [&str; 3] = ["chelsea.png", "coffee.png", "motorcycle_left.png"];

fn assets() -> PathBuf {
    PathBuf::from(std::env::var_os("LORA_SDK_ASSETS").unwrap_or_else(|| "../assets".into()))
}

fn photos() -> Vec<PathBuf> {
    PHOTOS
        .iter()
        .map(|n| {
            let p = assets().join("skimage").join(n);
            assert!(
                p.exists(),
                "{} is missing: run `cargo xtask setup`",
                p.display()
            );
            p
        })
        .collect()
}

fn python() -> PathBuf {
    let p = PathBuf::from(
        std::env::var_os("LORA_SDK_PYTHON").unwrap_or_else(|| "../.venv/bin/python".into()),
    );
    assert!(
        p.exists(),
        "{} is missing: run `cargo xtask setup`",
        p.display()
    );
    p
}

/// The fixture folder, built once per test run.
fn fixture() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("wd14_onnx_fixture");
        let _ = std::fs::remove_dir_all(&dir);
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/wd14_onnx_fixture.py");
        let out = Command::new(python())
            .arg(&script)
            .arg("--out")
            .arg(&dir)
            .arg("--images")
            .args(photos())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        dir
    })
}

fn reference() -> BTreeMap<String, Tensor> {
    Tensor::read_safetensors(fixture().join("reference.safetensors"))
        .unwrap()
        .into_iter()
        .collect()
}

fn tagger(layout: &str, edit: impl FnOnce(&mut TaggerConfig)) -> ImageTagger {
    let mut cfg = TaggerConfig::default();
    cfg.image.model = Some(fixture().join(layout));
    cfg.model_settings.device = "cpu".into();
    cfg.generation_settings.max_batch_size = 4;
    edit(&mut cfg);
    ImageTagger::from_config(&cfg).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn wd14_pixels_equal_the_reference_preprocessing() {
    let t = tagger("v3", |_| {});
    let refs = reference();
    for (i, p) in photos().iter().enumerate() {
        let ours = t.preprocess().load(p).unwrap();
        let ours = Tensor::from_slice(&ours).view([448, 448, 3]);
        let theirs = &refs[&format!("pixels.{i}")];
        let d = max_abs_diff(&ours, theirs);
        eprintln!("{}: max |Δpixel| = {d}", p.display());
        assert_eq!(d, 0.0, "{}", p.display());
    }
}

#[test]
fn wd14_onnx_scores_match_onnxruntime_on_real_photos() {
    let refs = reference();
    for layout in ["v3", "v2"] {
        let mut t = tagger(layout, |c| {
            // every general and character tag, with its score
            c.image.general_threshold = Some(0.0);
            c.image.character_threshold = 0.0;
        });
        assert!(t.multi_label());
        assert!(t.model_id().starts_with("wd14_onnx@"), "{}", t.model_id());
        let theirs = &refs[&format!("scores.{layout}")];
        // the model's outputs, batched
        let pixels: Vec<Vec<f32>> = photos()
            .iter()
            .map(|p| t.preprocess().load(p).unwrap())
            .collect();
        let batch = t.stack(&pixels).unwrap();
        assert_eq!(batch.size(), [3, 448, 448, 3]);
        let ours = t.logits(&batch).unwrap();
        let d = max_abs_diff(&ours, theirs);
        eprintln!("{layout}: max |Δscore| (batch) = {d:.3e}");
        assert!(d <= 1e-5, "{layout}: max |Δscore| = {d}");
        // and through the whole tagger: files in, scored tags out
        let results = t.tag_images(&photos()).unwrap();
        let labels = t.labels().clone();
        let mut worst = 0f64;
        for (i, r) in results.iter().enumerate() {
            let tags = r.as_ref().unwrap();
            assert_eq!(
                tags.iter()
                    .filter(|s| s.category == TagCategory::Rating)
                    .count(),
                1
            );
            for s in tags {
                let j = labels.names.iter().position(|n| *n == s.tag).unwrap();
                let want = theirs.double_value(&[i as i64, j as i64]);
                worst = worst.max((s.score as f64 - want).abs());
            }
            let non_rating = labels
                .categories
                .iter()
                .filter(|c| **c != TagCategory::Rating)
                .count();
            assert_eq!(tags.len(), non_rating + 1);
        }
        eprintln!("{layout}: max |Δscore| (tag_images) = {worst:.3e}");
        assert!(worst <= 1e-5, "{layout}: {worst}");
    }
}

/// The reference post-processing's picks (`selections.json`).
fn selections() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture().join("selections.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn picked(tags: &[lora_tagger::ScoredTag]) -> (String, Vec<String>) {
    let rating = tags
        .iter()
        .find(|s| s.category == TagCategory::Rating)
        .map(|s| s.tag.clone())
        .unwrap_or_default();
    let mut rest: Vec<String> = tags
        .iter()
        .filter(|s| s.category != TagCategory::Rating)
        .map(|s| s.tag.clone())
        .collect();
    rest.sort();
    (rating, rest)
}

fn strings(v: &serde_json::Value) -> Vec<String> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect()
}

#[test]
fn thresholds_and_mcut_keep_what_the_reference_keeps() {
    let want = selections();
    let mut fixed = tagger("v3", |_| {});
    // the WD14 defaults: general 0.35 (by the sigmoid head), character 0.85
    assert_eq!(fixed.general_threshold(), 0.35);
    let mut mcut = tagger("v3", |c| {
        c.image.general_mcut = true;
        c.image.character_mcut = true;
    });
    let a = fixed.tag_images(&photos()).unwrap();
    let b = mcut.tag_images(&photos()).unwrap();
    for (i, w) in want.iter().enumerate() {
        let (rating, tags) = picked(a[i].as_ref().unwrap());
        assert_eq!(rating, w["rating"].as_str().unwrap());
        assert_eq!(tags, strings(&w["fixed"]), "fixed thresholds, image {i}");
        let (_, tags) = picked(b[i].as_ref().unwrap());
        assert_eq!(tags, strings(&w["mcut"]), "MCut, image {i}");
    }
    // MCut picks differ from the fixed ones on these photos (the test would be blind otherwise)
    assert!(
        want.iter().any(|w| w["fixed"] != w["mcut"]),
        "the fixture's scores do not tell MCut from fixed thresholds"
    );
}

#[test]
fn a_wrong_runtime_path_says_how_to_get_one() {
    let e = find_onnxruntime(Some(Path::new("/nonexistent/libonnxruntime.so"))).unwrap_err();
    let m = e.to_string();
    assert!(
        matches!(e, Error::OnnxRuntime { .. }) && m.contains("image.onnxruntime"),
        "{m}"
    );
    // the venv's wheel is found when nothing is configured
    let lib = find_onnxruntime(None).unwrap();
    assert!(
        lib.to_string_lossy().contains("libonnxruntime"),
        "{}",
        lib.display()
    );
}
