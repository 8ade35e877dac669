//! Throughput of the data pipeline on the real assets.
//!
//! - images/s for decode → EXIF orientation → RGB (alpha composited) → cover resize (bilinear) →
//!   crop → `[3, h, w]` f32 in `[-1, 1]`, on the emoji PNGs (resolution 128, one bucket) and the
//!   scikit-image photos (resolution 512, aspect buckets 256–1024 step 64), with `--threads` threads;
//! - the same work in Python (Pillow + NumPy, `lora-data/benches/pil_pipeline.py`) on the same
//!   files, sizes and thread count, when `--python` is given, and the ratio. The two sides
//!   alternate, one timed pass over the whole set each, `--passes` times (default 3); the rates and
//!   the ratio printed are the medians over the passes, so a busy machine hits both sides alike;
//! - tokens/s for reading, tokenizing (byte-level BPE, 8,192 tokens, trained here on Hamlet) and
//!   packing every Shakespeare text into 2,048-token rows.
//!
//! ```text
//! cargo run -p lora-data --example loader_bench -- --threads 2 --python .venv/bin/python
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use lora_data::image::{BucketConfig, DatasetConfig, ImageDataset, ImageSetConfig, SubsetConfig};
use lora_data::loader::{Dataset, Loader, LoaderConfig};
use lora_data::text::{TextConfig, TextDataset, TextFormat};
use lora_data::validate::Policy;
use rayon::prelude::*;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

struct Args {
    threads: usize,
    assets: PathBuf,
    python: Option<PathBuf>,
    out: PathBuf,
    passes: usize,
}

fn parse_args() -> Result<Args, String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut a = Args {
        threads: 2,
        assets: root.join("assets"),
        python: None,
        out: root.join("target/lora-data-bench"),
        passes: 3,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--threads" => a.threads = val()?.parse().map_err(|e| format!("--threads: {e}"))?,
            "--assets" => a.assets = val()?.into(),
            "--python" => a.python = Some(val()?.into()),
            "--out" => a.out = val()?.into(),
            "--passes" => {
                a.passes = val()?.parse().map_err(|e| format!("--passes: {e}"))?;
                if a.passes == 0 {
                    return Err("--passes must be at least 1".into());
                }
            }
            other => {
                return Err(format!(
                    "unknown flag {other}; use --threads --assets --python --out --passes"
                ));
            }
        }
    }
    Ok(a)
}

fn image_set(dir: &Path, bucket: BucketConfig) -> DatasetConfig {
    let mut sub = SubsetConfig::new(dir);
    sub.class_tokens = Some("x".into());
    DatasetConfig {
        datasets: vec![ImageSetConfig {
            bucket,
            subsets: vec![sub],
            ..ImageSetConfig::default()
        }],
    }
}

fn bench_images(
    name: &str,
    config: DatasetConfig,
    args: &Args,
    pool: &rayon::ThreadPool,
) -> Result<f64, Box<dyn std::error::Error>> {
    let t = Instant::now();
    let ds = ImageDataset::new(config, Policy::Skip)?;
    let validate_s = t.elapsed().as_secs_f64();
    let n = ds.len();
    // Warm the page cache, then time.
    pool.install(|| {
        (0..n)
            .into_par_iter()
            .try_for_each(|i| ds.get(i).map(|_| ()))
    })?;
    // A pass covers the set `reps` times (at least 200 images), so small sets are timed over
    // more than a few hundred milliseconds.
    let reps = 200usize.div_ceil(n.max(1));
    let pass = || -> Result<(Vec<_>, f64), lora_data::Error> {
        let t = Instant::now();
        let samples: Vec<_> = pool.install(|| {
            (0..n * reps)
                .into_par_iter()
                .map(|i| ds.get(i % n))
                .collect::<Result<Vec<_>, _>>()
        })?;
        Ok((samples, t.elapsed().as_secs_f64()))
    };
    let (mut samples, secs) = pass()?;
    samples.truncate(n);
    // The exact work list for the Python comparison.
    std::fs::create_dir_all(&args.out)?;
    let plan: Vec<serde_json::Value> = samples
        .iter()
        .map(|s| {
            serde_json::json!({
                "path": s.path, "bucket": [s.bucket.0, s.bucket.1],
                "resized": [s.resized.0, s.resized.1], "crop": [s.crop.0, s.crop.1],
            })
        })
        .collect();
    drop(samples);
    let plan_path = args.out.join(format!("plan_{name}.json"));
    std::fs::write(&plan_path, serde_json::to_vec(&plan)?)?;
    // Alternating passes: ours, then Pillow's (its own process: warm pass, then one timed pass).
    let mut ours = vec![(n * reps) as f64 / secs];
    let mut theirs = Vec::new();
    for p in 0..args.passes {
        if p > 0 {
            ours.push((n * reps) as f64 / pass()?.1);
        }
        if let Some(py) = &args.python {
            theirs.push(python_pass(py, &plan_path, args.threads, reps)?);
        }
    }
    let rate = median(&ours);
    println!(
        "{name}: {n} images, validate (full decode) {validate_s:.2}s; decode+resize+bucket \
         {rate:.1} images/s, median of {} passes of {} images ({} threads)",
        ours.len(),
        n * reps,
        args.threads
    );
    if !theirs.is_empty() {
        let ratios: Vec<f64> = ours.iter().zip(&theirs).map(|(a, b)| a / b).collect();
        println!(
            "{name}: passes ours {} / Pillow {} images/s",
            list(&ours),
            list(&theirs)
        );
        println!(
            "{name}: lora-data {rate:.1} images/s vs Pillow+NumPy {:.1} images/s → ratio {:.2}x",
            median(&theirs),
            median(&ratios)
        );
    }
    // Through the Loader (batches of one bucket, collated to NCHW).
    let collate = ds.collate();
    let mut loader = Loader::new(
        ds,
        collate,
        LoaderConfig {
            batch_size: 8,
            num_workers: args.threads,
            prefetch_factor: 2,
            ..LoaderConfig::default()
        },
    )?;
    let t = Instant::now();
    let mut m = 0;
    for b in loader.epoch() {
        m += b?.pixels.size()[0];
    }
    let ls = t.elapsed().as_secs_f64();
    println!(
        "{name}: Loader (batch 8, {} workers): {m} images in {ls:.2}s = {:.1} images/s",
        args.threads,
        m as f64 / ls
    );
    println!("{}", loader.dataset().bucket_report());
    Ok(rate)
}

/// One timed pass of `pil_pipeline.py` over the plan `reps` times: images/s.
fn python_pass(
    py: &Path,
    plan: &Path,
    threads: usize,
    reps: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/pil_pipeline.py");
    let out = std::process::Command::new(py)
        .arg(&script)
        .arg(plan)
        .arg(threads.to_string())
        .arg(reps.to_string())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    text.lines()
        .find_map(|l| l.strip_prefix("images_per_s="))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or_else(|| format!("no images_per_s= line from {}: {text}", script.display()).into())
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

fn list(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn bpe_tokenizer(train_file: &Path) -> Result<Tokenizer, Box<dyn std::error::Error>> {
    let specials: Vec<AddedToken> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|s| AddedToken::from(*s, true))
        .collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(8192)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build()
        .into();
    let mut tok = Tokenizer::new(BPE::default());
    tok.with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)));
    tok.with_decoder(Some(ByteLevel::default()));
    tok.train_from_files(
        &mut trainer,
        vec![train_file.to_string_lossy().into_owned()],
    )
    .map_err(|e| e.to_string())?;
    tok.add_special_tokens(&specials);
    Ok(tok)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(args.threads)
        .build()?;
    let emoji = args.assets.join("emoji/img");
    if emoji.is_dir() {
        let b = BucketConfig {
            resolution: (128, 128),
            enable_bucket: false,
            ..BucketConfig::default()
        };
        bench_images("emoji", image_set(&emoji, b), &args, &pool)?;
    }
    let photos = args.assets.join("skimage");
    if photos.is_dir() {
        bench_images(
            "photos",
            image_set(&photos, BucketConfig::default()),
            &args,
            &pool,
        )?;
    }
    let shakespeare = args.assets.join("shakespeare");
    if shakespeare.is_dir() {
        let t = Instant::now();
        let tok = bpe_tokenizer(&shakespeare.join("hamlet_gut.txt"))?;
        println!(
            "text: BPE tokenizer (8192 tokens) trained in {:.2}s",
            t.elapsed().as_secs_f64()
        );
        let mut files: Vec<PathBuf> = std::fs::read_dir(&shakespeare)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "txt"))
            .collect();
        files.sort();
        let bytes: u64 = files
            .iter()
            .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
            .sum();
        let config = TextConfig {
            format: TextFormat::Plain,
            seq_len: 2048,
            eos_token_id: Some(0),
            ..TextConfig::default()
        };
        let t = Instant::now();
        let ds = pool.install(|| TextDataset::from_files(&files, &tok, config))?;
        let secs = t.elapsed().as_secs_f64();
        let st = ds.stats();
        println!(
            "text: {} files, {:.1} MB → {} tokens, {} rows of 2048 ({} padding) in {secs:.2}s = \
             {:.0} tokens/s ({} threads)",
            files.len(),
            bytes as f64 / 1e6,
            st.tokens,
            st.rows,
            st.padding,
            st.tokens as f64 / secs,
            args.threads
        );
        let collate = ds.collate();
        let mut loader = Loader::new(
            ds,
            collate,
            LoaderConfig {
                batch_size: 8,
                num_workers: args.threads,
                ..LoaderConfig::default()
            },
        )?;
        let t = Instant::now();
        let mut toks = 0i64;
        for b in loader.epoch() {
            toks += b?.input_ids.numel() as i64;
        }
        println!(
            "text: Loader collate (batch 8): {toks} token positions in {:.3}s",
            t.elapsed().as_secs_f64()
        );
        let _ = loader.dataset().len();
    }
    Ok(())
}
