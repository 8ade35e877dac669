//! Image datasets in kohya's conventions: subsets of folders with caption sidecars, repeats,
//! regularization images, caption/tag processing and aspect-ratio buckets.
//!
//! ```no_run
//! use lora_data::image::{DatasetConfig, ImageDataset};
//! use lora_data::loader::LoaderConfig;
//! use lora_data::validate::Policy;
//! let config = DatasetConfig::from_toml_file("dataset.toml".as_ref())?;
//! let dataset = ImageDataset::new(config, Policy::Skip)?;
//! for p in dataset.problems() {
//!     eprintln!("warning: skipped {p}");
//! }
//! println!("{}", dataset.bucket_report());
//! let mut loader = dataset.into_loader(LoaderConfig { batch_size: 4, ..Default::default() })?;
//! for batch in loader.epoch() {
//!     let batch = batch?; // batch.pixels: [4, 3, h, w] f32 in [-1, 1]
//! #   let _ = batch;
//! }
//! # Ok::<(), lora_data::Error>(())
//! ```

pub mod bucket;
pub mod caption;
pub mod config;
pub mod decode;
pub mod resize;

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;

use ::image::imageops::{self, FilterType};
use tch::{Device, Kind, Tensor};

pub use bucket::{BucketConfig, Placement};
pub use config::{DatasetConfig, ImageSetConfig, SmallImages, SubsetConfig};

use crate::loader::{Collate, Dataset};
use crate::rng::Rng;
use crate::validate::{Policy, Problem, ProblemKind, ScannedImage, report, scan};
use crate::{Error, Result};

/// An image with its bucket.
#[derive(Debug, Clone)]
struct Entry {
    image: ScannedImage,
    bucket_id: usize,
    ar_error: f64,
}

/// A validated image dataset: images, their buckets, and the items of an epoch (repeats and
/// regularization balancing applied).
#[derive(Debug, Clone)]
pub struct ImageDataset {
    config: DatasetConfig,
    entries: Vec<Entry>,
    /// Entry index of every item (an image appears `num_repeats` times).
    items: Vec<usize>,
    /// `(dataset index, (width, height))` of each bucket id.
    buckets: Vec<(usize, (u32, u32))>,
    problems: Vec<Problem>,
    filter: FilterType,
}

/// One training sample.
#[derive(Debug)]
pub struct ImageSample {
    /// Pixels `[3, height, width]`, `Kind::Float`, in `[-1, 1]` (`x / 127.5 − 1`), RGB.
    pub pixels: Tensor,
    /// The processed caption.
    pub caption: String,
    /// Bucket `(width, height)`.
    pub bucket: (u32, u32),
    /// Size after EXIF orientation, before resizing `(width, height)`.
    pub original_size: (u32, u32),
    /// Size after the cover resize, before cropping `(width, height)`.
    pub resized: (u32, u32),
    /// Top-left of the crop in the resized image `(x, y)` (SDXL's `crop_coords_top_left`).
    pub crop: (u32, u32),
    /// Flipped horizontally.
    pub flipped: bool,
    /// From a regularization subset.
    pub is_reg: bool,
    /// The image file.
    pub path: PathBuf,
}

impl ImageSample {
    /// The latent-cache key of this sample for the encoder `model_id` (hashes the image file).
    ///
    /// # Errors
    /// [`Error::Io`] when the image cannot be read.
    pub fn cache_key(&self, model_id: &str) -> Result<crate::cache::CacheKey> {
        crate::cache::CacheKey::for_file(&self.path, self.bucket, self.crop, self.flipped, model_id)
    }
}

/// A batch of images from one bucket.
///
/// # Shapes
/// `pixels`: `[b, 3, h, w]` `Kind::Float` in `[-1, 1]`; the vectors have `b` entries.
#[derive(Debug)]
pub struct ImageBatch {
    /// Pixels.
    pub pixels: Tensor,
    /// Processed captions.
    pub captions: Vec<String>,
    /// Regularization flags (kohya's `prior_loss_weight` applies to these).
    pub is_reg: Vec<bool>,
    /// Image files.
    pub paths: Vec<PathBuf>,
    /// Sizes before resizing `(width, height)`.
    pub original_sizes: Vec<(u32, u32)>,
    /// Crop offsets `(x, y)`.
    pub crops: Vec<(u32, u32)>,
    /// Flip flags.
    pub flipped: Vec<bool>,
    /// The bucket `(width, height)`.
    pub bucket: (u32, u32),
}

/// Stacks [`ImageSample`]s of one bucket into an [`ImageBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct ImageCollate;

impl Collate<ImageSample> for ImageCollate {
    type Batch = ImageBatch;

    fn collate(&self, items: Vec<ImageSample>) -> Result<ImageBatch> {
        let bucket = items.first().map(|s| s.bucket).unwrap_or((0, 0));
        if let Some(other) = items.iter().find(|s| s.bucket != bucket) {
            return Err(Error::config(
                "bucket",
                format!("{:?} and {:?}", bucket, other.bucket),
                "a batch must hold one bucket; use ImageDataset's group() with the Loader",
            ));
        }
        let pixels = Tensor::f_stack(&items.iter().map(|s| &s.pixels).collect::<Vec<_>>(), 0)
            .map_err(Error::tensor("stacking an image batch"))?;
        let mut b = ImageBatch {
            pixels,
            captions: Vec::with_capacity(items.len()),
            is_reg: Vec::new(),
            paths: Vec::new(),
            original_sizes: Vec::new(),
            crops: Vec::new(),
            flipped: Vec::new(),
            bucket,
        };
        for s in items {
            b.captions.push(s.caption);
            b.is_reg.push(s.is_reg);
            b.paths.push(s.path);
            b.original_sizes.push(s.original_size);
            b.crops.push(s.crop);
            b.flipped.push(s.flipped);
        }
        Ok(b)
    }
}

/// One row of the [`BucketReport`].
#[derive(Debug, Clone, PartialEq)]
pub struct BucketRow {
    /// Index of the `[[datasets]]` entry.
    pub dataset: usize,
    /// Bucket `(width, height)`.
    pub resolution: (u32, u32),
    /// Distinct images.
    pub images: usize,
    /// Items per epoch (repeats and regularization balancing included).
    pub items: usize,
}

/// The bucket histogram of a dataset.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketReport {
    /// Non-empty buckets, sorted by dataset then resolution.
    pub rows: Vec<BucketRow>,
    /// Mean `|ln(w/h) − ln(bw/bh)|` over images (kohya reports the linear mean ar error).
    pub mean_ar_error: f64,
    /// Images left out (problems).
    pub skipped: usize,
}

impl fmt::Display for BucketReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let max = self.rows.iter().map(|r| r.items).max().unwrap_or(1).max(1);
        writeln!(f, "dataset  bucket       images   items")?;
        for r in &self.rows {
            let bar = "#".repeat((r.items * 40).div_ceil(max));
            writeln!(
                f,
                "{:>7}  {:>4}x{:<4}  {:>7} {:>7}  {bar}",
                r.dataset, r.resolution.0, r.resolution.1, r.images, r.items
            )?;
        }
        write!(
            f,
            "mean aspect error (log): {:.4}; images skipped: {}",
            self.mean_ar_error, self.skipped
        )
    }
}

impl ImageDataset {
    /// Scans, validates and buckets every image of `config`.
    ///
    /// Regularization images are repeated or cut so that each dataset has as many regularization
    /// items as training items (kohya's DreamBooth balancing in `train_util.py`).
    ///
    /// # Errors
    /// [`Error::Invalid`] listing every problem when `policy` is [`Policy::Fail`] and there is one;
    /// [`Error::Config`] for bucket settings; [`Error::Invalid`] when no image is usable.
    pub fn new(config: DatasetConfig, policy: Policy) -> Result<Self> {
        let (mut images, problems) = scan(&config);
        let blocking: Vec<&Problem> = problems
            .iter()
            .filter(|p| p.kind != ProblemKind::TooSmall)
            .collect();
        if policy == Policy::Fail && !blocking.is_empty() {
            let owned: Vec<Problem> = blocking.into_iter().cloned().collect();
            return Err(Error::Invalid {
                count: owned.len(),
                report: report(&owned),
            });
        }
        images.sort_by(|a, b| a.path.cmp(&b.path));
        let mut bucket_lists = Vec::with_capacity(config.datasets.len());
        for ds in &config.datasets {
            bucket_lists.push(ds.bucket.buckets()?);
        }
        let mut bucket_ids: BTreeMap<(usize, (u32, u32)), usize> = BTreeMap::new();
        let mut buckets = Vec::new();
        let mut entries = Vec::with_capacity(images.len());
        for image in images {
            let Some((b, err)) = bucket::select_bucket(&bucket_lists[image.dataset], image.size)
            else {
                continue;
            };
            let id = *bucket_ids.entry((image.dataset, b)).or_insert_with(|| {
                buckets.push((image.dataset, b));
                buckets.len() - 1
            });
            entries.push(Entry {
                image,
                bucket_id: id,
                ar_error: err,
            });
        }
        if entries.is_empty() {
            return Err(Error::Invalid {
                count: problems.len(),
                report: format!("no usable image in any subset\n{}", report(&problems)),
            });
        }
        let items = expand_items(&config, &entries);
        Ok(ImageDataset {
            config,
            entries,
            items,
            buckets,
            problems,
            filter: FilterType::Triangle,
        })
    }

    /// Resampling filter of the cover resize. Default `Triangle`: this crate's bilinear resize
    /// ([`resize::resize_bilinear`]), antialiased when shrinking and pixel-identical to Pillow's
    /// `BILINEAR`; other filters use the `image` crate's (slower) `imageops::resize`.
    pub fn with_filter(mut self, filter: FilterType) -> Self {
        self.filter = filter;
        self
    }

    /// The images left out and why.
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }

    /// The configuration.
    pub fn config(&self) -> &DatasetConfig {
        &self.config
    }

    /// Number of distinct images.
    pub fn num_images(&self) -> usize {
        self.entries.len()
    }

    /// Image files, sorted.
    pub fn image_paths(&self) -> Vec<&std::path::Path> {
        self.entries
            .iter()
            .map(|e| e.image.path.as_path())
            .collect()
    }

    /// The bucket `(width, height)` of item `index`.
    pub fn bucket_of(&self, index: usize) -> Option<(u32, u32)> {
        let e = &self.entries[*self.items.get(index)?];
        Some(self.buckets[e.bucket_id].1)
    }

    /// The bucket histogram.
    pub fn bucket_report(&self) -> BucketReport {
        let mut rows: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
        for e in &self.entries {
            rows.entry(e.bucket_id).or_default().0 += 1;
        }
        for &i in &self.items {
            rows.entry(self.entries[i].bucket_id).or_default().1 += 1;
        }
        let mut out: Vec<BucketRow> = rows
            .into_iter()
            .map(|(id, (images, items))| BucketRow {
                dataset: self.buckets[id].0,
                resolution: self.buckets[id].1,
                images,
                items,
            })
            .collect();
        out.sort_by_key(|r| (r.dataset, r.resolution));
        let n = self.entries.len().max(1) as f64;
        BucketReport {
            rows: out,
            mean_ar_error: self.entries.iter().map(|e| e.ar_error.abs()).sum::<f64>() / n,
            skipped: self
                .problems
                .iter()
                .filter(|p| {
                    !matches!(
                        p.kind,
                        ProblemKind::UnreadableFolder | ProblemKind::NoImages
                    )
                })
                .count(),
        }
    }

    /// A [`Loader`](crate::loader::Loader) over this dataset (batches never mix buckets).
    ///
    /// # Errors
    /// As [`crate::loader::Loader::new`].
    pub fn into_loader(
        self,
        config: crate::loader::LoaderConfig,
    ) -> Result<crate::loader::Loader<ImageDataset, ImageCollate>> {
        crate::loader::Loader::new(self, ImageCollate, config)
    }

    /// The collate function for this dataset.
    pub fn collate(&self) -> ImageCollate {
        ImageCollate
    }
}

/// Items of an epoch: `num_repeats` copies of each training image; regularization images cycled
/// until they match the training items of their dataset (kohya `DreamBoothDataset.__init__`).
fn expand_items(config: &DatasetConfig, entries: &[Entry]) -> Vec<usize> {
    let mut items = Vec::new();
    for (di, ds) in config.datasets.iter().enumerate() {
        let mut reg = Vec::new();
        let mut train_items = 0usize;
        for (i, e) in entries.iter().enumerate() {
            if e.image.dataset != di {
                continue;
            }
            let sub = &ds.subsets[e.image.subset];
            if sub.is_reg {
                reg.push((i, sub.num_repeats as usize));
            } else {
                for _ in 0..sub.num_repeats {
                    items.push(i);
                }
                train_items += sub.num_repeats as usize;
            }
        }
        if reg.is_empty() {
            continue;
        }
        if train_items == 0 {
            for (i, r) in reg {
                items.extend(std::iter::repeat_n(i, r));
            }
            continue;
        }
        let mut n = 0;
        let mut first = true;
        'outer: while n < train_items {
            for &(i, r) in &reg {
                let add = if first { r.max(1) } else { 1 };
                let add = add.min(train_items - n);
                items.extend(std::iter::repeat_n(i, add));
                n += add;
                if n >= train_items {
                    break 'outer;
                }
            }
            first = false;
        }
    }
    items
}

impl Dataset for ImageDataset {
    type Item = ImageSample;

    fn len(&self) -> usize {
        self.items.len()
    }

    fn get(&self, index: usize) -> Result<ImageSample> {
        self.get_seeded(index, 0)
    }

    /// Decodes, resizes to cover the bucket, crops, flips (`flip_aug`) and normalizes item `index`;
    /// random decisions in the order caption line → caption processing → crop → flip.
    fn get_seeded(&self, index: usize, seed: u64) -> Result<ImageSample> {
        let &entry_index = self.items.get(index).ok_or(Error::IndexOutOfRange {
            index,
            len: self.items.len(),
        })?;
        let entry = &self.entries[entry_index];
        let ds = &self.config.datasets[entry.image.dataset];
        let sub = &ds.subsets[entry.image.subset];
        let bucket_wh = self.buckets[entry.bucket_id].1;
        let mut rng = Rng::new(seed);
        let line = caption::choose_line(&entry.image.caption, sub.random_caption_line, &mut rng);
        let caption = caption::process_caption(&line, sub, &mut rng);
        let path = &entry.image.path;
        let decoded = decode::decode_file(path, ds.background_color).map_err(|f| Error::Image {
            path: path.clone(),
            message: format!("{f:?}; the file changed after validation?"),
        })?;
        let size = decoded.rgb.dimensions();
        let p = bucket::place(size, bucket_wh, sub.random_crop.then_some(&mut rng));
        let mut img = if p.resized == size && p.resized == bucket_wh {
            decoded.rgb
        } else if p.resized == size || self.filter == FilterType::Triangle {
            // Resize (when needed) and crop in one pass, computing only the kept pixels.
            resize::resize_bilinear_crop(&decoded.rgb, p.resized, p.crop, bucket_wh)
        } else {
            let resized = imageops::resize(&decoded.rgb, p.resized.0, p.resized.1, self.filter);
            if p.resized == bucket_wh {
                resized
            } else {
                imageops::crop_imm(&resized, p.crop.0, p.crop.1, bucket_wh.0, bucket_wh.1)
                    .to_image()
            }
        };
        let flipped = sub.flip_aug && rng.next_f64() < 0.5;
        if flipped {
            imageops::flip_horizontal_in_place(&mut img);
        }
        let pixels = rgb_to_tensor(&img)?;
        Ok(ImageSample {
            pixels,
            caption,
            bucket: bucket_wh,
            original_size: size,
            resized: p.resized,
            crop: p.crop,
            flipped,
            is_reg: sub.is_reg,
            path: path.clone(),
        })
    }

    fn group(&self, index: usize) -> u64 {
        self.items
            .get(index)
            .map(|&e| self.entries[e].bucket_id as u64)
            .unwrap_or(0)
    }
}

/// `v / 127.5 − 1` in f32 for every 8-bit value `v` (the pixel normalization of
/// [`rgb_to_tensor`]).
const PIXEL_VALUES: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut v = 0;
    while v < 256 {
        t[v] = v as f32 / 127.5 - 1.0;
        v += 1;
    }
    t
};

/// RGB8 `[h, w, 3]` → `[3, h, w]` f32 in `[-1, 1]` (`v / 127.5 − 1`), on the CPU.
///
/// The pixels are written straight into the tensor's memory: no libtorch op runs (a copy or fill
/// would start libtorch's intra-op thread team from the calling thread, which on a loader thread
/// competes with the other loader threads for the same cores).
pub fn rgb_to_tensor(img: &::image::RgbImage) -> Result<Tensor> {
    let (w, h) = img.dimensions();
    let plane = w as usize * h as usize;
    let t = Tensor::f_empty([3, h as i64, w as i64], (Kind::Float, Device::Cpu))
        .map_err(Error::tensor("converting pixels to a tensor"))?;
    if plane == 0 {
        return Ok(t);
    }
    // SAFETY: `t` was just allocated by libtorch as a contiguous CPU f32 tensor of 3·h·w elements
    // (non-null and aligned, as `plane > 0`); nothing else refers to its storage while `out`
    // lives, and every element is written below before the tensor is returned.
    let out = unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, 3 * plane) };
    let (r, gb) = out.split_at_mut(plane);
    let (g, b) = gb.split_at_mut(plane);
    for (((px, r), g), b) in img.as_raw().chunks_exact(3).zip(r).zip(g).zip(b) {
        *r = PIXEL_VALUES[px[0] as usize];
        *g = PIXEL_VALUES[px[1] as usize];
        *b = PIXEL_VALUES[px[2] as usize];
    }
    Ok(t)
}
