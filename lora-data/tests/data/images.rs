//! Image datasets: generated fixtures for every bad-input case, and the real emoji and photo sets.

use crate::common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::{Path, PathBuf};

use common::asset_dir;
use image::{ImageBuffer, ImageFormat, LumaA, Rgb, RgbImage};
use lora_data::Error;
use lora_data::image::decode::decode_file;
use lora_data::image::{
    BucketConfig, DatasetConfig, ImageDataset, ImageSetConfig, SmallImages, SubsetConfig,
};
use lora_data::loader::{Dataset, Loader, LoaderConfig};
use lora_data::validate::{Policy, ProblemKind, validate};
use tch::{Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// An EXIF APP1 segment holding only IFD0 with one Orientation (0x0112) SHORT entry.
/// Layout per the Exif 2.32 spec §4.5/§4.6: "Exif\0\0", TIFF header "II*\0" + IFD0 offset 8,
/// entry count, 12-byte entry (tag, type 3, count 1, value left-aligned), next-IFD offset 0.
fn exif_app1(orientation: u16) -> Vec<u8> {
    let mut tiff = Vec::new();
    tiff.extend_from_slice(b"II*\0");
    tiff.extend_from_slice(&8u32.to_le_bytes());
    tiff.extend_from_slice(&1u16.to_le_bytes());
    tiff.extend_from_slice(&0x0112u16.to_le_bytes());
    tiff.extend_from_slice(&3u16.to_le_bytes());
    tiff.extend_from_slice(&1u32.to_le_bytes());
    tiff.extend_from_slice(&orientation.to_le_bytes());
    tiff.extend_from_slice(&[0, 0]);
    tiff.extend_from_slice(&0u32.to_le_bytes());
    let mut seg = vec![0xFF, 0xE1];
    seg.extend_from_slice(&((2 + 6 + tiff.len()) as u16).to_be_bytes());
    seg.extend_from_slice(b"Exif\0\0");
    seg.extend(tiff);
    seg
}

/// 40x20 JPEG, left half red, right half blue, stored unrotated with EXIF orientation 6
/// ("rotate 90° clockwise to display"): displayed 20x40 with red on top.
fn exif_rotated_jpeg() -> Vec<u8> {
    let img = RgbImage::from_fn(40, 20, |x, _| {
        if x < 20 {
            Rgb([255, 0, 0])
        } else {
            Rgb([0, 0, 255])
        }
    });
    let mut jpg = Vec::new();
    img.write_to(&mut Cursor::new(&mut jpg), ImageFormat::Jpeg)
        .unwrap();
    let mut out = jpg[..2].to_vec(); // SOI
    out.extend(exif_app1(6));
    out.extend_from_slice(&jpg[2..]);
    out
}

fn png_bytes(img: impl Into<image::DynamicImage>) -> Vec<u8> {
    let mut v = Vec::new();
    img.into()
        .write_to(&mut Cursor::new(&mut v), ImageFormat::Png)
        .unwrap();
    v
}

fn px(t: &Tensor, c: i64, y: i64, x: i64) -> f64 {
    t.double_value(&[c, y, x])
}

#[test]
fn exif_cmyk_palette_16bit_and_gray_alpha_decode_correctly() {
    let dir = tempfile::tempdir().unwrap();
    let rot = dir.path().join("rot.jpg");
    std::fs::write(&rot, exif_rotated_jpeg()).unwrap();
    let d = decode_file(&rot, [255; 3]).unwrap();
    assert_eq!(d.rgb.dimensions(), (20, 40), "orientation applied");
    let top = d.rgb.get_pixel(10, 5).0;
    let bottom = d.rgb.get_pixel(10, 35).0;
    assert!(top[0] > 200 && top[2] < 60, "top should be red: {top:?}");
    assert!(
        bottom[2] > 200 && bottom[0] < 60,
        "bottom should be blue: {bottom:?}"
    );

    let d = decode_file(&fixture("cmyk.jpg"), [255; 3]).unwrap();
    assert_eq!(d.rgb.dimensions(), (32, 16));
    let (l, r) = (d.rgb.get_pixel(4, 8).0, d.rgb.get_pixel(28, 8).0);
    assert!(
        l[0] > 230 && l[1] < 30 && l[2] < 30,
        "CMYK left = red: {l:?}"
    );
    assert!(
        r[2] > 230 && r[0] < 30 && r[1] < 30,
        "CMYK right = blue: {r:?}"
    );

    let d = decode_file(&fixture("palette.png"), [0, 0, 255]).unwrap();
    assert_eq!(d.rgb.get_pixel(0, 0).0, [255, 0, 0]);
    assert_eq!(d.rgb.get_pixel(4, 1).0, [0, 255, 0]);
    assert_eq!(
        d.rgb.get_pixel(7, 3).0,
        [0, 0, 255],
        "transparent index → background"
    );

    let deep: ImageBuffer<Rgb<u16>, Vec<u16>> =
        ImageBuffer::from_pixel(6, 6, Rgb([65535, 32896, 0]));
    let p16 = dir.path().join("deep.png");
    std::fs::write(&p16, png_bytes(deep)).unwrap();
    assert_eq!(
        decode_file(&p16, [0; 3]).unwrap().rgb.get_pixel(2, 2).0,
        [255, 128, 0]
    );

    let ga: ImageBuffer<LumaA<u8>, Vec<u8>> =
        ImageBuffer::from_fn(4, 1, |x, _| LumaA([200, if x < 2 { 255 } else { 0 }]));
    let pga = dir.path().join("ga.png");
    std::fs::write(&pga, png_bytes(ga)).unwrap();
    let d = decode_file(&pga, [10, 20, 30]).unwrap();
    assert_eq!(d.rgb.get_pixel(0, 0).0, [200, 200, 200]);
    assert_eq!(d.rgb.get_pixel(3, 0).0, [10, 20, 30]);
}

struct Tree {
    _dir: tempfile::TempDir,
    root: PathBuf,
    concept: PathBuf,
    plain: PathBuf,
}

/// A kohya folder `10_sks dog` with good and bad files, a subset without class tokens, and a
/// missing folder.
fn bad_input_tree() -> Tree {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    let concept = root.join("train/10_sks dog");
    let plain = root.join("plain");
    std::fs::create_dir_all(&concept).unwrap();
    std::fs::create_dir_all(&plain).unwrap();
    let w = |name: &str, bytes: &[u8]| std::fs::write(concept.join(name), bytes).unwrap();
    let small = png_bytes(RgbImage::from_pixel(48, 48, Rgb([0, 128, 0])));
    w("rot.jpg", &exif_rotated_jpeg());
    w(
        "rot.txt",
        "\u{feff}sks, dog, grass\r\nsecond line\r\n".as_bytes(),
    );
    w("upper.JPG", &std::fs::read(fixture("cmyk.jpg")).unwrap());
    w("cmyk.jpg", &std::fs::read(fixture("cmyk.jpg")).unwrap());
    w("cmyk.txt", b"cmyk, red, blue");
    w("pal.png", &std::fs::read(fixture("palette.png")).unwrap());
    w("pal.txt", b"palette");
    w("trunc.png", &small[..small.len() / 2]);
    w("trunc.txt", b"truncated");
    w("empty.png", b"");
    w("junk.png", b"this is not a png at all");
    w("photo.heic", b"\0\0\0\x18ftypheic");
    w("dup.jpg", &std::fs::read(fixture("cmyk.jpg")).unwrap());
    w("dup.png", &small);
    w("badcap.png", &small);
    w("badcap.txt", b"caf\xe9, cr\xe8me");
    w("emptycap.png", &small);
    w("emptycap.txt", b"  \r\n");
    w("notes.md", b"ignored: not an image");
    std::fs::write(plain.join("nocap.png"), &small).unwrap();
    Tree {
        _dir: dir,
        root,
        concept,
        plain,
    }
}

fn tree_config(t: &Tree) -> DatasetConfig {
    let set = ImageSetConfig {
        bucket: BucketConfig {
            resolution: (64, 64),
            enable_bucket: true,
            min_bucket_reso: 32,
            max_bucket_reso: 128,
            bucket_reso_steps: 32,
        },
        ..ImageSetConfig::default()
    };
    let mut c = DatasetConfig::from_kohya_folders(&t.root.join("train"), None, &set).unwrap();
    c.datasets[0].subsets.push(SubsetConfig::new(&t.plain));
    c.datasets[0]
        .subsets
        .push(SubsetConfig::new(t.root.join("does-not-exist")));
    c
}

fn snapshot(root: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

#[test]
fn a_folder_whose_images_sit_in_unprefixed_subfolders_says_how_to_name_them() {
    // kohya reads only `<repeats>_<concept>` subfolders: a `cats/` beside no images of its own
    // is an empty subset whose fix names the subfolder and the layout
    let d = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(d.path().join("cats")).unwrap();
    let img = image::RgbImage::from_pixel(8, 8, image::Rgb([200, 10, 10]));
    std::fs::write(d.path().join("cats/a.png"), png_bytes(img)).unwrap();
    let mut c =
        DatasetConfig::from_kohya_folders(d.path(), None, &ImageSetConfig::default()).unwrap();
    assert!(c.datasets[0].subsets.is_empty());
    c.datasets[0].subsets.push(SubsetConfig::new(d.path()));
    let problems = validate(&c);
    assert_eq!(problems.len(), 1, "{problems:#?}");
    let p = &problems[0];
    assert_eq!(p.kind, ProblemKind::NoImages);
    assert!(
        p.fix.contains("(cats)") && p.fix.contains("10_cats"),
        "{}",
        p.fix
    );
}

#[test]
fn validate_lists_every_bad_input_with_file_and_fix() {
    let t = bad_input_tree();
    let config = tree_config(&t);
    let before = snapshot(&t.root);
    let problems = validate(&config);
    let got: BTreeSet<(String, ProblemKind)> = problems
        .iter()
        .map(|p| {
            (
                p.path.file_name().unwrap().to_string_lossy().into_owned(),
                p.kind,
            )
        })
        .collect();
    let want: BTreeSet<(String, ProblemKind)> = [
        ("trunc.png", ProblemKind::Truncated),
        ("empty.png", ProblemKind::ZeroByte),
        ("junk.png", ProblemKind::Corrupt),
        ("photo.heic", ProblemKind::UnknownFormat),
        ("dup.png", ProblemKind::DuplicateStem),
        ("badcap.txt", ProblemKind::NonUtf8Caption),
        ("emptycap.txt", ProblemKind::EmptyCaption),
        ("nocap.png", ProblemKind::MissingCaption),
        ("plain", ProblemKind::NoImages),
        ("does-not-exist", ProblemKind::UnreadableFolder),
    ]
    .into_iter()
    .map(|(n, k)| (n.to_string(), k))
    .collect();
    assert_eq!(got, want, "{problems:#?}");
    for p in &problems {
        assert!(!p.fix.is_empty() && !p.what.is_empty());
        let line = p.to_string();
        assert!(line.contains("fix:"), "{line}");
    }
    // Fail: one error listing every problem.
    match ImageDataset::new(config.clone(), Policy::Fail) {
        Err(Error::Invalid { count, report }) => {
            assert_eq!(count, 10);
            assert!(
                report.contains("trunc.png") && report.contains("badcap.txt"),
                "{report}"
            );
        }
        other => panic!("expected Error::Invalid, got {other:?}"),
    }
    // Skip: the good images remain, `.JPG` included.
    let ds = ImageDataset::new(config, Policy::Skip).unwrap();
    let names: BTreeSet<String> = ds
        .image_paths()
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let want: BTreeSet<String> = ["cmyk.jpg", "dup.jpg", "pal.png", "rot.jpg", "upper.JPG"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(names, want);
    assert_eq!(ds.len(), 5 * 10, "10 repeats from the folder name");
    assert_eq!(ds.problems().len(), 10);
    // Load everything once, then check nothing on disk changed.
    let collate = ds.collate();
    let mut loader = Loader::new(
        ds,
        collate,
        LoaderConfig {
            batch_size: 4,
            num_workers: 2,
            ..LoaderConfig::default()
        },
    )
    .unwrap();
    let mut seen = 0;
    for b in loader.epoch() {
        let b = b.unwrap();
        let s = b.pixels.size();
        assert_eq!(s[1..], [3, b.bucket.1 as i64, b.bucket.0 as i64]);
        seen += s[0];
    }
    assert_eq!(seen, 50);
    assert_eq!(
        snapshot(&t.root),
        before,
        "no file was modified, added or removed"
    );
    let _ = &t.concept;
}

#[test]
fn samples_carry_oriented_pixels_and_cleaned_captions() {
    let t = bad_input_tree();
    let ds = ImageDataset::new(tree_config(&t), Policy::Skip).unwrap();
    let by_name = |name: &str| {
        (0..ds.len())
            .find(|&i| ds.get(i).unwrap().path.file_name().unwrap() == name)
            .unwrap()
    };
    let s = ds.get(by_name("rot.jpg")).unwrap();
    assert_eq!(
        s.caption, "sks, dog, grass",
        "BOM stripped, first line, CRLF gone"
    );
    assert_eq!(s.original_size, (20, 40));
    let (w, h) = s.bucket;
    assert!(
        h > w,
        "portrait bucket for the rotated image: {:?}",
        s.bucket
    );
    assert!(px(&s.pixels, 0, 2, (w / 2) as i64) > 0.6, "red on top");
    assert!(
        px(&s.pixels, 2, h as i64 - 3, (w / 2) as i64) > 0.6,
        "blue at the bottom"
    );
    let s = ds.get(by_name("upper.JPG")).unwrap();
    assert_eq!(
        s.caption, "sks dog",
        "class tokens when there is no caption file"
    );
    let s = ds.get(by_name("pal.png")).unwrap();
    assert_eq!(s.caption, "palette");
    let (w, _) = s.bucket;
    // right quarter was transparent → white background (1.0) in every channel
    for c in 0..3 {
        assert!((px(&s.pixels, c, 2, w as i64 - 1) - 1.0).abs() < 1e-6);
    }
    let mn = s.pixels.min().double_value(&[]);
    let mx = s.pixels.max().double_value(&[]);
    assert!(mn >= -1.0 && mx <= 1.0);
    assert_eq!(s.pixels.kind(), Kind::Float);
}

#[test]
fn dataset_toml_with_reg_images_balances_and_small_images_can_be_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let (a, reg) = (dir.path().join("a"), dir.path().join("reg"));
    std::fs::create_dir_all(&a).unwrap();
    std::fs::create_dir_all(&reg).unwrap();
    for i in 0..3 {
        let img = RgbImage::from_pixel(128, 64, Rgb([i * 50, 0, 0]));
        img.save(a.join(format!("a{i}.png"))).unwrap();
        std::fs::write(a.join(format!("a{i}.caption")), "one, two, three, four").unwrap();
    }
    for i in 0..2 {
        RgbImage::from_pixel(64, 64, Rgb([0, 0, 9]))
            .save(reg.join(format!("r{i}.png")))
            .unwrap();
    }
    // a tiny image that is below its bucket
    RgbImage::from_pixel(16, 16, Rgb([1, 1, 1]))
        .save(a.join("tiny.png"))
        .unwrap();
    std::fs::write(a.join("tiny.caption"), "tiny").unwrap();
    let toml = r#"
[general]
caption_extension = ".caption"
shuffle_caption = true
keep_tokens = 1
caption_separator = ","

[[datasets]]
resolution = 64
min_bucket_reso = 32
max_bucket_reso = 128
bucket_reso_steps = 32
small_images = "skip"

  [[datasets.subsets]]
  image_dir = "a"
  num_repeats = 4

  [[datasets.subsets]]
  image_dir = "reg"
  is_reg = true
  class_tokens = "a photo"
"#;
    let path = dir.path().join("dataset.toml");
    std::fs::write(&path, toml).unwrap();
    let config = DatasetConfig::from_toml_file(&path).unwrap();
    assert_eq!(config.datasets[0].small_images, SmallImages::Skip);
    let ds = ImageDataset::new(config.clone(), Policy::Fail).unwrap();
    assert_eq!(ds.problems().len(), 1);
    assert_eq!(ds.problems()[0].kind, ProblemKind::TooSmall);
    // 3 images × 4 repeats = 12 training items; 12 regularization items from 2 images
    let regs = (0..ds.len()).filter(|&i| ds.get(i).unwrap().is_reg).count();
    assert_eq!(ds.len(), 24);
    assert_eq!(regs, 12);
    let report = ds.bucket_report();
    let total: usize = report.rows.iter().map(|r| r.items).sum();
    assert_eq!(total, 24);
    let text = report.to_string();
    assert!(text.contains("mean aspect error"), "{text}");
    // the 2:1 images share a landscape bucket
    let wide = report
        .rows
        .iter()
        .find(|r| r.images == 3)
        .expect("the three 2:1 images share a bucket");
    assert!(wide.resolution.0 > wide.resolution.1);
    // captions: first tag kept, the rest shuffled, joined with ", "
    for i in 0..ds.len() {
        let s = ds.get_seeded(i, i as u64).unwrap();
        if !s.is_reg {
            assert!(s.caption.starts_with("one, "), "{}", s.caption);
            let mut tags: Vec<&str> = s.caption.split(", ").collect();
            tags.sort();
            assert_eq!(tags, vec!["four", "one", "three", "two"]);
        } else {
            assert_eq!(s.caption, "a photo");
        }
    }
    // upscale instead of skip keeps the tiny image
    let mut up = config;
    up.datasets[0].small_images = SmallImages::Upscale;
    let ds = ImageDataset::new(up, Policy::Fail).unwrap();
    assert_eq!(ds.num_images(), 3 + 1 + 2);
}

fn emoji_tree(n: usize) -> Option<(tempfile::TempDir, PathBuf, BTreeMap<String, String>)> {
    let root = asset_dir("emoji")?;
    let csv = std::fs::read_to_string(root.join("openmoji.csv")).unwrap();
    let mut tags: BTreeMap<String, String> = BTreeMap::new();
    for line in csv.lines().skip(1) {
        // emoji,hexcode,group,subgroups,annotation,"tags",...
        let fields = split_csv(line);
        if fields.len() > 5 && !fields[5].is_empty() {
            tags.insert(
                fields[1].to_lowercase(),
                format!("{}, {}", fields[4], fields[5]),
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("2_emoji");
    std::fs::create_dir_all(&folder).unwrap();
    let mut captions = BTreeMap::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("img"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    for f in files {
        let stem = f.file_stem().unwrap().to_string_lossy().into_owned();
        if let Some(t) = tags.get(&stem) {
            std::fs::copy(&f, folder.join(f.file_name().unwrap())).unwrap();
            std::fs::write(folder.join(format!("{stem}.txt")), t).unwrap();
            captions.insert(stem, t.clone());
            if captions.len() == n {
                break;
            }
        }
    }
    Some((dir, folder, captions))
}

fn split_csv(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => out.push(String::new()),
            _ => out.last_mut().unwrap().push(c),
        }
    }
    out
}

#[test]
fn real_emoji_with_openmoji_tags_load_deterministically() {
    let Some((dir, folder, captions)) = emoji_tree(200) else {
        return;
    };
    assert_eq!(captions.len(), 200);
    let mut sub = SubsetConfig::new(&folder);
    sub.num_repeats = 2;
    sub.shuffle_caption = true;
    sub.keep_tokens = 1;
    sub.flip_aug = true;
    let config = DatasetConfig {
        datasets: vec![ImageSetConfig {
            bucket: BucketConfig {
                resolution: (64, 64),
                enable_bucket: false,
                ..BucketConfig::default()
            },
            subsets: vec![sub],
            ..ImageSetConfig::default()
        }],
    };
    assert!(validate(&config).is_empty(), "{:#?}", validate(&config));
    let ds = ImageDataset::new(config, Policy::Fail).unwrap();
    assert_eq!(ds.len(), 400);
    let run = |epoch: u64| -> (Vec<String>, Vec<f64>, usize) {
        let mut l = Loader::new(
            ds.clone(),
            ds.collate(),
            LoaderConfig {
                batch_size: 16,
                num_workers: 2,
                seed: 5,
                ..LoaderConfig::default()
            },
        )
        .unwrap();
        l.restore(lora_data::loader::LoaderState {
            epoch,
            step: 0,
            seed: 5,
        })
        .unwrap();
        let mut caps = Vec::new();
        let mut sums = Vec::new();
        let mut white_corners = 0;
        for b in l.epoch() {
            let b = b.unwrap();
            assert_eq!(b.pixels.size(), vec![16, 3, 64, 64]);
            assert!(b.pixels.min().double_value(&[]) >= -1.0);
            assert!(b.pixels.max().double_value(&[]) <= 1.0);
            for (i, (c, p)) in b.captions.iter().zip(&b.paths).enumerate() {
                let stem = p.file_stem().unwrap().to_string_lossy().into_owned();
                let orig = &captions[&stem];
                let first = orig.split(", ").next().unwrap();
                assert!(c.starts_with(first), "keep_tokens=1: {c} vs {orig}");
                let mut a: Vec<&str> = c.split(", ").collect();
                let mut o: Vec<&str> = orig
                    .split(", ")
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .collect();
                a.sort();
                o.sort();
                assert_eq!(a, o);
                let corner = b.pixels.get(i as i64).slice(1, 0, 1, 1).slice(2, 0, 1, 1);
                if corner.min().double_value(&[]) == 1.0 {
                    white_corners += 1;
                }
            }
            caps.extend(b.captions);
            sums.push(b.pixels.sum(Kind::Double).double_value(&[]));
        }
        (caps, sums, white_corners)
    };
    let (c0, s0, white) = run(0);
    assert_eq!(c0.len(), 400);
    assert!(
        white > 300,
        "transparent emoji corners composite to white: {white}/400"
    );
    let (c0b, s0b, _) = run(0);
    assert_eq!(
        (c0.clone(), s0.clone()),
        (c0b, s0b),
        "same (seed, epoch) → same batches"
    );
    let (c1, _, _) = run(1);
    assert_ne!(c0, c1, "another epoch reshuffles");
    drop(dir);
}

#[test]
fn real_photos_bucket_by_aspect_ratio() {
    let Some(root) = asset_dir("skimage") else {
        return;
    };
    let mut sub = SubsetConfig::new(&root);
    sub.class_tokens = Some("a photo".into());
    let config = DatasetConfig {
        datasets: vec![ImageSetConfig {
            bucket: BucketConfig {
                resolution: (256, 256),
                enable_bucket: true,
                min_bucket_reso: 128,
                max_bucket_reso: 512,
                bucket_reso_steps: 64,
            },
            subsets: vec![sub],
            ..ImageSetConfig::default()
        }],
    };
    let problems = validate(&config);
    assert!(problems.is_empty(), "{problems:#?}");
    let ds = ImageDataset::new(config, Policy::Fail).unwrap();
    assert!(ds.num_images() >= 25, "{}", ds.num_images());
    let bucket_of = |name: &str| {
        (0..ds.len())
            .find(|&i| ds.image_paths()[i].file_name().unwrap() == name)
            .and_then(|i| ds.bucket_of(i))
            .unwrap()
    };
    assert_eq!(bucket_of("astronaut.png"), (256, 256));
    assert_eq!(bucket_of("chelsea.png"), (320, 192)); // 451x300, 1.50:1
    assert_eq!(bucket_of("text.png"), (384, 128)); // 448x172, 2.60:1
    assert_eq!(bucket_of("cell.png"), (256, 256)); // 550x660
    let report = ds.bucket_report();
    assert!(report.rows.len() >= 3, "{report}");
    assert_eq!(
        report.rows.iter().map(|r| r.images).sum::<usize>(),
        ds.num_images()
    );
    // grayscale photos give three equal channels
    let cam = (0..ds.len())
        .find(|&i| ds.image_paths()[i].file_name().unwrap() == "camera.png")
        .unwrap();
    let s = ds.get(cam).unwrap();
    assert!(s.pixels.get(0).equal(&s.pixels.get(2)));
    println!("{report}");
}

#[test]
fn bilinear_resize_matches_pillow() {
    use lora_data::image::resize::resize_bilinear;
    let src = image::open(fixture("gradient.png")).unwrap().to_rgb8();
    for (w, h) in [(16, 10), (80, 50), (37, 9)] {
        let want = image::open(fixture(&format!("gradient_bilinear_{w}x{h}.png")))
            .unwrap()
            .to_rgb8();
        let got = resize_bilinear(&src, w, h);
        let max_diff = got
            .as_raw()
            .iter()
            .zip(want.as_raw())
            .map(|(a, b)| (*a as i32 - *b as i32).abs())
            .max()
            .unwrap();
        assert_eq!(
            max_diff, 0,
            "{w}x{h}: differs from Pillow by up to {max_diff}"
        );
    }
}

/// Writes the dirty dataset of `tests/fixtures/make_dirty_dataset.py` (real photos with the
/// damage real folders have) under `dir`; returns the kohya folder's parent.
fn dirty_dataset(dir: &Path) -> Option<PathBuf> {
    let assets = asset_dir("skimage")?;
    let python = std::env::var_os("LORA_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"));
    let o = std::process::Command::new(python)
        .arg(fixture("make_dirty_dataset.py"))
        .arg("--assets")
        .arg(assets.parent().unwrap())
        .arg("--out")
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "make_dirty_dataset.py failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    Some(dir.to_path_buf())
}

#[test]
fn a_dirty_dataset_keeps_every_usable_image_and_names_every_bad_file() {
    let tmp = tempfile::tempdir().unwrap();
    let Some(root) = dirty_dataset(tmp.path()) else {
        return;
    };
    let template = ImageSetConfig {
        bucket: BucketConfig {
            resolution: (64, 64),
            enable_bucket: true,
            min_bucket_reso: 32,
            max_bucket_reso: 128,
            bucket_reso_steps: 16,
        },
        ..ImageSetConfig::default()
    };
    let config = DatasetConfig::from_kohya_folders(&root, None, &template).unwrap();
    // stop: every bad file listed, nothing trained
    let err = ImageDataset::new(config.clone(), Policy::Fail).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Invalid { count: 4, .. }), "{msg}");
    // skip: the usable images, each bad file named with what is wrong and what to do
    let ds = ImageDataset::new(config, Policy::Skip).unwrap();
    let mut kinds: Vec<(String, ProblemKind)> = ds
        .problems()
        .iter()
        .map(|p| {
            (
                p.path.file_name().unwrap().to_string_lossy().into_owned(),
                p.kind,
            )
        })
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            ("broken.jpg".to_string(), ProblemKind::Truncated),
            ("empty.png".to_string(), ProblemKind::ZeroByte),
            ("noise.bmp".to_string(), ProblemKind::Corrupt),
            ("scan.jxl".to_string(), ProblemKind::UnknownFormat),
        ]
    );
    for p in ds.problems() {
        let line = p.to_string();
        assert!(
            line.contains(&p.path.display().to_string()) && line.contains("fix: "),
            "{line}"
        );
        assert!(msg.contains(&p.path.display().to_string()), "{msg}");
    }
    let broken = ds
        .problems()
        .iter()
        .find(|p| p.kind == ProblemKind::Truncated)
        .unwrap();
    assert!(
        broken.what.contains("ends early") && broken.what.contains("FF D9"),
        "{}",
        broken.what
    );
    assert_eq!(ds.num_images(), 7);
    assert_eq!(ds.len(), 14, "2 repeats");
    let samples: Vec<_> = (0..ds.len()).map(|i| ds.get(i).unwrap()).collect();
    let by_name = |name: &str| {
        samples
            .iter()
            .find(|s| s.path.file_name().unwrap() == name)
            .unwrap_or_else(|| panic!("{name} is not in the dataset"))
    };
    // EXIF orientation 6: 640×427 pixels stored, 427×640 shown and trained
    let rocket = by_name("rocket_exif.jpg");
    assert_eq!(rocket.original_size, (427, 640));
    assert!(rocket.bucket.0 < rocket.bucket.1, "{:?}", rocket.bucket);
    // a BOM and CRLF line ends do not reach the caption
    assert_eq!(by_name("chelsea.png").caption, "photo, a cat");
    // no caption file: the folder's class tokens
    assert_eq!(by_name("coins.png").caption, "dirty");
    // upper-case extensions, 16-bit and CMYK files decode
    assert_eq!(by_name("MOON.PNG").caption, "photo, the moon");
    assert_eq!(by_name("coffee.JPG").original_size, (600, 400));
    let cam = by_name("camera_16bit.png");
    assert_eq!(cam.original_size, (512, 512));
    assert!(
        cam.pixels.get(0).equal(&cam.pixels.get(2)),
        "gray gives equal channels"
    );
    let horse = by_name("horse_cmyk.jpg");
    assert_eq!(horse.original_size, (400, 328));
    let (lo, hi) = (
        horse.pixels.min().double_value(&[]),
        horse.pixels.max().double_value(&[]),
    );
    assert!(
        hi - lo > 1.0,
        "the CMYK image decodes to a real picture: {lo}..{hi}"
    );
}
