//! Images per second of the image tagger on the real photos of the project's assets
//! (`assets/skimage`, 25 photos from 64×64 to 3000×3000 pixels, PNG and JPEG).
//!
//! ```text
//! cargo run --release -p lora-tagger --example image_throughput -- MODEL_DIR [REPEATS] [MAX_BATCH]
//! ```
//! `MODEL_DIR` is a tagger folder: `assets/mobilenet_v2` (MobileNetV2, 224², libtorch) or a WD14
//! folder with `model.onnx` (e.g. the WD14-shaped ViT-B/16 at 448 that
//! `python python/wd14_onnx_fixture.py --out DIR --images assets/skimage/chelsea.png --vit`
//! writes to `DIR/vit`, run by ONNX Runtime). Prints, for the whole folder: decode +
//! preprocessing alone (one thread, then rayon's pool), and whole tagging runs (decode on rayon's
//! pool, then the batched forward), as the median of `REPEATS` (default 3) after one warm-up, with
//! the micro-batch the tagger chose (at most `MAX_BATCH`, default 8). Thread counts come from
//! `OMP_NUM_THREADS` / `RAYON_NUM_THREADS`.

use std::path::PathBuf;
use std::time::Instant;

use lora_tagger::{ImageTagger, Tagger, TaggerConfig};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = PathBuf::from(
        args.first()
            .ok_or("usage: image_throughput MODEL_DIR [REPEATS] [MAX_BATCH]")?,
    );
    let repeats: usize = args.get(1).map_or(Ok(3), |s| s.parse())?;
    let max_batch: usize = args.get(2).map_or(Ok(8), |s| s.parse())?;
    let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "assets".into());
    let images = lora_tagger::run::list_images(&PathBuf::from(assets).join("skimage"))?;
    let mut cfg = TaggerConfig::default();
    cfg.image.model = Some(model.clone());
    cfg.generation_settings.max_batch_size = max_batch;
    let mut tagger = ImageTagger::from_config(&cfg)?;
    let pre = tagger.preprocess();
    println!(
        "{} on {}: {} photos, {}, libtorch threads {}, rayon threads {}",
        model.display(),
        tagger.runs_on(),
        images.len(),
        pre,
        tch::get_num_threads(),
        rayon::current_num_threads()
    );

    let t = Instant::now();
    for p in &images {
        pre.load(p)?;
    }
    let serial = t.elapsed().as_secs_f64();
    let t = Instant::now();
    {
        use rayon::prelude::*;
        images
            .par_iter()
            .map(|p| pre.load(p).map(|_| ()))
            .collect::<Result<Vec<()>, _>>()?;
    }
    let parallel = t.elapsed().as_secs_f64();
    println!(
        "decode + preprocess: {:.1} images/s on one thread, {:.1} images/s on rayon's pool",
        images.len() as f64 / serial,
        images.len() as f64 / parallel
    );

    tagger.tag_images(&images[..max_batch.min(images.len())])?; // warm-up
    let mut times = Vec::new();
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        let out = tagger.tag_images(&images)?;
        times.push(t.elapsed().as_secs_f64());
        if let Some(Err(e)) = out.iter().find(|r| r.is_err()) {
            return Err(format!("an image failed: {e}").into());
        }
    }
    let s = median(times);
    let (start, last, halvings) = tagger.last_micro_batch().unwrap_or((0, 0, 0));
    println!(
        "tagging: {:.2} images/s ({:.3} s for {} photos, median of {}), micro-batch {start} → {last} ({halvings} halvings)",
        images.len() as f64 / s,
        s,
        images.len(),
        repeats.max(1)
    );
    Ok(())
}
