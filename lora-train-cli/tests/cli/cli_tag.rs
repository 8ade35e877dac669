//! `lora-train tag` on a temporary copy of real photos (`assets/skimage`) with the real
//! MobileNetV2 ImageNet model (`assets/mobilenet_v2`): one hand-written caption must survive, one
//! corrupt image fails alone (exit 1, the others written), append keeps hand-written tags first,
//! a dry run writes nothing, an unknown config key exits 2. Without `--model` the default model
//! is found beside the executable from any folder (or exit 2 naming where it looked), failed
//! images are not counted as tagged, and `--max-tags 0` means no limit.

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
    // progress on stderr (not a terminal here: a plain line), counting the images that need
    // tags: the hand-captioned one is not among them
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("tagged 3/3 images ("), "{err}");
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

/// A copy of the binary at `<root>/bin/lora-train` (a hard link when the file system allows):
/// the executable's location is one of the places the default model is looked for.
fn binary_in(root: &Path) -> PathBuf {
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let exe = bin.join("lora-train");
    if std::fs::hard_link(env!("CARGO_BIN_EXE_lora-train"), &exe).is_err() {
        std::fs::copy(env!("CARGO_BIN_EXE_lora-train"), &exe).unwrap();
    }
    exe
}

/// `tag` without `--model`, run from `cwd` with no LORA_SDK_ASSETS.
fn tag_default_model(exe: &Path, cwd: &Path, images: &Path, extra: &[&str]) -> Output {
    Command::new(exe)
        .arg("tag")
        .arg("--images")
        .arg(images)
        .args(extra)
        .current_dir(cwd)
        .env_remove("LORA_SDK_ASSETS")
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap()
}

#[test]
fn the_default_model_is_found_from_any_folder_and_failures_are_not_counted_as_tagged() {
    let model = assets().join("mobilenet_v2");
    assert!(
        model.join("model.safetensors").is_file(),
        "{} is missing: run `cargo xtask setup`",
        model.display()
    );
    // An installed layout: <root>/bin/lora-train and <root>/assets/mobilenet_v2.
    let root = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let exe = binary_in(root.path());
    std::fs::create_dir(root.path().join("assets")).unwrap();
    std::os::unix::fs::symlink(
        model.canonicalize().unwrap(),
        root.path().join("assets/mobilenet_v2"),
    )
    .unwrap();
    // Run from an unrelated folder with relative paths.
    let work = tempfile::tempdir().unwrap();
    let imgs = work.path().join("imgs");
    std::fs::create_dir(&imgs).unwrap();
    for n in ["chelsea.png", "coffee.png"] {
        std::fs::copy(assets().join("skimage").join(n), imgs.join(n)).unwrap();
    }
    std::fs::write(imgs.join("broken.png"), b"\x89PNG\r\n\x1a\nnot a png").unwrap();

    let o = tag_default_model(&exe, work.path(), Path::new("imgs"), &[]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "one image failed: {out}");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    // Two captions written, the broken image counted apart and named with its reason.
    assert!(stdout.contains("tagged 2 images in "), "{out}");
    assert!(stdout.contains("; 1 failed"), "{out}");
    assert!(
        stderr.contains("1 of 3 images failed")
            && stderr.contains("imgs/broken.png: cannot decode image"),
        "{out}"
    );
    assert!(imgs.join("chelsea.txt").is_file() && imgs.join("coffee.txt").is_file());
    assert!(!imgs.join("broken.txt").exists());

    // Without the assets beside the executable (nor in the current folder): exit 2 before any
    // model loads, naming the places looked and how to give a model.
    let bare = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let exe = binary_in(bare.path());
    let o = tag_default_model(&exe, work.path(), Path::new("imgs"), &["--dry-run"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    for needle in [
        work.path()
            .join("assets/mobilenet_v2")
            .display()
            .to_string(),
        bare.path()
            .join("assets/mobilenet_v2")
            .display()
            .to_string(),
        "--model DIR".to_string(),
        "LORA_SDK_ASSETS".to_string(),
    ] {
        assert!(out.contains(&needle), "{needle:?} not in:\n{out}");
    }
    assert!(!out.contains("loaded in"), "{out}");
}

#[test]
fn max_tags_0_means_no_limit_as_wd14_taggers_write_every_tag_above_the_thresholds() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::copy(assets().join("skimage/chelsea.png"), d.join("chelsea.png")).unwrap();
    let caption = |extra: &[&str]| {
        let o = tag(d, &[&["--dry-run", "--threshold", "0.05"], extra].concat());
        let out = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}");
        // the line after "would write …chelsea.txt" holds the caption
        let lines: Vec<&str> = out.lines().collect();
        let i = lines
            .iter()
            .position(|l| l.starts_with("would write") && l.ends_with("chelsea.txt"))
            .unwrap_or_else(|| panic!("no caption for chelsea.png:\n{out}"));
        lines[i + 1].trim().to_string()
    };
    let all = caption(&[]);
    assert!(all.split(", ").count() >= 2, "{all}");
    assert_eq!(caption(&["--max-tags", "0"]), all);
    assert_eq!(
        caption(&["--max-tags", "1"]),
        all.split(", ").next().unwrap()
    );
    let help = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["tag", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("0 = no limit"), "{help}");
}

/// A config that asks for CUDA on a machine without one is exit 2 with one sentence (what was
/// asked, what libtorch sees, how to run on the CPU) before any model loads, and no libtorch
/// backtrace. Skipped where libtorch sees a CUDA device.
#[test]
fn tag_descriptions_on_a_missing_cuda_device_is_one_clear_sentence() {
    if lora_train::core::sys::cuda_device_count().unwrap_or(0) > 0 {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("tagger.yaml");
    std::fs::write(&cfg, "model_settings:\n  device: cuda\n").unwrap();
    let desc = dir.path().join("d.txt");
    std::fs::write(&desc, "Greek coins from Pompeii.\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .arg("tag")
        .arg("--descriptions")
        .arg(&desc)
        .arg("--config")
        .arg(&cfg)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    for needle in [
        "model_settings.device",
        "cuda:0 was asked for",
        "no CUDA device",
        "\"cpu\"",
    ] {
        assert!(t.contains(needle), "{needle:?} not in:\n{t}");
    }
    assert!(
        !t.contains("frame #"),
        "a libtorch backtrace reached the user:\n{t}"
    );
    assert!(!t.contains("LLM backend must be configured"), "{t}");
}

/// The dirty dataset of `lora-data/tests/fixtures/make_dirty_dataset.py`: the usable images are
/// tagged (EXIF-rotated, CMYK, 16-bit, upper-case extensions), the cut JPEG, the empty and the
/// corrupt file fail with the diagnosis training gives them (exit 1), and the `.jxl` is named
/// as left out — no file is skipped without a word.
#[test]
fn a_dirty_folder_names_every_image_it_cannot_tag_in_the_words_training_uses() {
    let dir = tempfile::tempdir().unwrap();
    let python = std::env::var_os("LORA_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../.venv/bin/python"));
    let res = Command::new(python)
        .arg(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../lora-data/tests/fixtures/make_dirty_dataset.py"),
        )
        .arg("--assets")
        .arg(assets())
        .arg("--out")
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        res.status.success(),
        "make_dirty_dataset.py failed:\n{}",
        String::from_utf8_lossy(&res.stderr)
    );
    let d = dir.path().join("2_dirty");
    let broken_caption = std::fs::read_to_string(d.join("broken.txt")).unwrap();
    let o = tag(&d, &["--mode", "overwrite"]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(1), "three images failed: {out}");
    let line = |name: &str| {
        out.lines()
            .find(|l| l.contains(name))
            .unwrap_or_else(|| panic!("{name} is not named:\n{out}"))
            .to_string()
    };
    assert!(
        line("broken.jpg").contains("the image data ends early"),
        "{out}"
    );
    assert!(line("empty.png").contains("the file is empty"), "{out}");
    assert!(
        line("noise.bmp").contains("not a valid image") || line("noise.bmp").contains("FAILED"),
        "{out}"
    );
    assert!(line("scan.jxl").contains("cannot be decoded here"), "{out}");
    assert_eq!(
        std::fs::read_to_string(d.join("broken.txt")).unwrap(),
        broken_caption,
        "a failed image's caption is left alone"
    );
    for name in [
        "chelsea",
        "coffee",
        "rocket_exif",
        "camera_16bit",
        "horse_cmyk",
        "coins",
        "MOON",
    ] {
        let c = std::fs::read_to_string(d.join(format!("{name}.txt"))).unwrap();
        assert!(!c.trim().is_empty(), "{name}: empty caption");
    }
    assert!(!out.contains("frame #"), "{out}");
    // the dataset's parent folder: the images are in its kohya subfolder, and the message says so
    let o = tag(dir.path(), &[]);
    let out = text(&o);
    assert_eq!(o.status.code(), Some(2), "{out}");
    assert!(
        out.contains("no images directly in it") && out.contains("2_dirty"),
        "{out}"
    );
}

/// A WD14 ONNX model folder (`python/wd14_onnx_fixture.py`: random weights, the v3 layout, run
/// by the venv's ONNX Runtime) with kohya's tagger options spelled as kohya spells them: each
/// caption holds the reference post-processing's picks (general ≥ 0.35, character ≥ 0.85), minus
/// the undesired tag, with the replacement, the found always-first tags in front (the last one
/// listed first) and kohya's caption extension.
#[test]
fn a_wd14_onnx_model_tags_with_kohyas_options() {
    let python = std::env::var_os("LORA_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("../.venv/bin/python"));
    let names = ["chelsea.png", "coffee.png", "motorcycle_left.png"];
    let photos: Vec<PathBuf> = names
        .iter()
        .map(|n| assets().join("skimage").join(n))
        .collect();
    let fx = tempfile::tempdir().unwrap();
    let res = Command::new(python)
        .arg(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../python/wd14_onnx_fixture.py"))
        .arg("--out")
        .arg(fx.path())
        .arg("--images")
        .args(&photos)
        .output()
        .unwrap();
    assert!(res.status.success(), "{}", text(&res));
    let picks: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx.path().join("selections.json")).unwrap())
            .unwrap();
    let fixed = |i: usize| -> Vec<String> {
        picks[i]["fixed"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    // kohya's --remove_underscore rule
    let norm = |t: &str| {
        if t.chars().count() > 3 {
            t.replace('_', " ")
        } else {
            t.to_string()
        }
    };
    let p0 = fixed(0);
    let (undesired, replaced, first_a, first_b) = (&p0[0], &p0[1], &p0[2], &p0[3]);

    let dir = tempfile::tempdir().unwrap();
    for (n, p) in names.iter().zip(&photos) {
        std::fs::copy(p, dir.path().join(n)).unwrap();
    }
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .arg("tag")
        .arg("--images")
        .arg(dir.path())
        .arg("--model")
        .arg(fx.path().join("v3"))
        .args(["--undesired_tags", &format!("{undesired}, not_a_tag")])
        .args(["--tag_replacement", &format!("{replaced},kitty")])
        .args(["--always_first_tags", &format!("{first_a},{first_b}")])
        .args(["--caption_extension", ".caption"])
        .args(["--remove_underscore", "--character_tags_first"])
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("ONNX Runtime CPUExecutionProvider"), "{out}");
    for (i, n) in names.iter().enumerate() {
        let stem = n.trim_end_matches(".png");
        assert!(!dir.path().join(format!("{stem}.txt")).exists());
        let caption = std::fs::read_to_string(dir.path().join(format!("{stem}.caption"))).unwrap();
        let tags: Vec<String> = caption.trim().split(", ").map(String::from).collect();
        let mut want: Vec<String> = fixed(i)
            .iter()
            .filter(|t| *t != undesired)
            .map(|t| {
                if t == replaced {
                    "kitty".into()
                } else {
                    norm(t)
                }
            })
            .collect();
        want.sort();
        let mut got = tags.clone();
        got.sort();
        assert_eq!(got, want, "{n}: {caption}");
        if i == 0 {
            assert_eq!(tags[..2], [norm(first_b), norm(first_a)], "{caption}");
        }
    }
}

#[test]
fn a_missing_or_file_images_path_is_a_usage_error_that_says_which() {
    let dir = tempfile::tempdir().unwrap();
    let o = tag(&dir.path().join("nope"), &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("no such folder"), "{}", text(&o));
    let file = dir.path().join("one.png");
    std::fs::write(&file, b"x").unwrap();
    let o = tag(&file, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("not a folder"), "{}", text(&o));
}

/// The batch line `tag` prints: `batch plan for <budget>: batch N: …`.
fn planned_batch(out: &str) -> usize {
    let line = out
        .lines()
        .find(|l| l.starts_with("batch plan for "))
        .unwrap_or_else(|| panic!("no batch plan line: {out}"));
    line.split(": batch ")
        .nth(1)
        .and_then(|r| r.split(':').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no batch in {line:?}"))
}

#[test]
fn the_batch_comes_from_the_models_memory_and_the_fixed_table_is_shown_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::copy(assets().join("skimage/chelsea.png"), d.join("chelsea.png")).unwrap();
    // a large configured maximum, so memory decides
    let cfg = d.join("tagger.yaml");
    std::fs::write(&cfg, "generation_settings:\n  max_batch_size: 4096\n").unwrap();
    let cfg = cfg.to_string_lossy().into_owned();
    let run = |budget: &[&str]| {
        let mut args = vec!["--dry-run", "--config", cfg.as_str()];
        args.extend_from_slice(budget);
        let o = tag(d, &args);
        let out = text(&o);
        assert_eq!(o.status.code(), Some(0), "{out}");
        out
    };
    // the same numbers from the library: MobileNetV2's weights and per-image peak
    let mut tcfg = lora_tagger::TaggerConfig::default();
    tcfg.image.model = Some(assets().join("mobilenet_v2"));
    tcfg.generation_settings.max_batch_size = 4096;
    let tagger = lora_tagger::ImageTagger::from_config(&tcfg).unwrap();
    let memory = tagger.memory();
    // f32 weights: torchvision's 3,504,872 parameters less one per BatchNorm channel (17,056
    // channels: γ and β fold into one convolution bias), ~12 MiB per 224² image
    assert_eq!(memory.weights.0, (3_504_872 - 17_056) * 4);

    let small = run(&["--budget", "64MB"]);
    let n_small = planned_batch(&small);
    let expected = ((64e6 * 0.8 - memory.weights.0 as f64) / memory.per_item.0 as f64) as usize;
    assert_eq!(n_small, expected, "{small}");
    assert!((2..=3).contains(&n_small), "{small}");
    assert!(
        small.contains("the fixed table (>= 12 GB: 8, 8-12 GB: 4, 6-8 GB: 2, else 1) would pick 1"),
        "{small}"
    );

    let card = run(&["--gpu", "RTX 3070"]);
    let n_card = planned_batch(&card);
    assert_eq!(
        n_card,
        tagger
            .plan_batch(
                lora_memory::Budget::gpu("RTX 3070").unwrap().bytes,
                tch::Device::Cuda(0)
            )
            .batch
    );
    assert!(n_card > 400, "8 GiB holds hundreds of 224² images: {card}");
    assert!(card.contains("would pick 4 for 8.6 GB"), "{card}");
    // a card's plan counts the CUDA context and workspaces
    assert!(card.contains("fixed 567.1 MB"), "{card}");
    // a dry run writes nothing
    assert!(!d.join("chelsea.txt").exists());

    // a budget the weights alone exceed is said before the run
    let none = run(&["--budget", "10MB"]);
    assert_eq!(planned_batch(&none), 1);
    assert!(none.contains("not even one item fits"), "{none}");
}

#[test]
fn vlm_captions_a_folder_with_a_preset_and_the_trigger_word() {
    let server = crate::vlm_server::VlmTestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for n in ["rocket.jpg", "chelsea.png"] {
        std::fs::copy(assets().join("skimage").join(n), d.join(n)).unwrap();
    }
    std::fs::write(d.join("chelsea.txt"), "my cat\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["tag", "--images"])
        .arg(d)
        .args(["--vlm", &server.base_url(), "--vlm-model", "qwen2.5-vl"])
        .args(["--preset", "detailed", "--trigger", "sks"])
        .output()
        .unwrap();
    let out = text(&o);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("preset detailed"), "{out}");
    let sha = {
        use sha2::Digest;
        let h = sha2::Sha256::digest(std::fs::read(d.join("rocket.jpg")).unwrap());
        h.iter().map(|b| format!("{b:02x}")).collect::<String>()[..12].to_string()
    };
    assert_eq!(
        std::fs::read_to_string(d.join("rocket.txt")).unwrap(),
        format!("sks, A 640x427 jpeg image, sha {sha}.\n")
    );
    // mode skip (the default): the hand-written caption is kept, and its image never sent
    assert_eq!(
        std::fs::read_to_string(d.join("chelsea.txt")).unwrap(),
        "my cat\n"
    );
    let reqs = server.requests();
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0]["body"]["max_tokens"], 300);
    assert_eq!(reqs[0]["body"]["model"], "qwen2.5-vl");

    // VLM options without a server, and an unknown preset, are usage errors naming the flag
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["tag", "--images"])
        .arg(d)
        .args(["--preset", "short"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("--preset sets up the VLM captioner"),
        "{}",
        text(&o)
    );
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["tag", "--images"])
        .arg(d)
        .args([
            "--vlm",
            &server.base_url(),
            "--vlm-model",
            "m",
            "--preset",
            "long",
        ])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("--preset") && text(&o).contains("\"long\""),
        "{}",
        text(&o)
    );
    // image-only options with --descriptions are refused, not ignored
    let notes = d.join("notes.txt");
    std::fs::write(&notes, "A red fox.\n").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lora-train"))
        .args(["tag", "--descriptions"])
        .arg(&notes)
        .args(["--vlm", &server.base_url()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(
        text(&o).contains("--vlm applies to --images"),
        "{}",
        text(&o)
    );
}
