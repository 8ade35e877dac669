//! What the image-diffusion recipes (SD, FLUX) share: the kohya image folder or dataset TOML as
//! an [`ImageDataset`], its loader, the batch source that turns loader batches into latents and
//! text conditioning (cached in memory and on disk, and computed before training with
//! [`precache`]), and the sample-grid callback.
//!
//! A recipe plugs its own pipeline in through [`LatentPipeline`]: how an image becomes latents,
//! how a caption becomes conditioning, and how both become the recipe's training batch.

use crate::config::TrainConfig;
use crate::engine::{BatchSource, TrainError};
use crate::job::error::During;
use crate::job::sequence::RunContext;
use crate::job::{JobError, Result, resolve_path};
use lora_data::cache::{CacheKey, LatentCache};
use lora_data::image::{ImageBatch, ImageCollate, ImageDataset, config::DatasetConfig};
use lora_data::loader::{Batches, Collate, Dataset, Loader, LoaderConfig};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use tch::Tensor;

// ---------------------------------------------------------------------------------------------
// Data set, loader, resolution
// ---------------------------------------------------------------------------------------------

/// Checks that `cfg`'s bucket settings ([`bucket_config`]) give at least one bucket, as
/// training will need: a plan refuses what the run would refuse.
///
/// # Errors
/// [`JobError::Input`] naming the key and values (`min_bucket_reso`, `max_bucket_reso`,
/// `bucket_reso_steps`) and what to change.
pub fn check_buckets(cfg: &TrainConfig) -> Result<()> {
    bucket_config(cfg)
        .buckets()
        .map(|_| ())
        .map_err(|e| JobError::Input(format!("the data section's bucket settings: {e}")))
}

/// The aspect-bucket settings of `cfg`'s data section (`data.resolution`, `enable_bucket`,
/// `min_bucket_reso`, `max_bucket_reso`, `bucket_reso_steps`) over lora-data's defaults.
pub fn bucket_config(cfg: &TrainConfig) -> lora_data::image::BucketConfig {
    let d = &cfg.data;
    let mut b = lora_data::image::BucketConfig::default();
    if let Some([w, h]) = d.resolution {
        b.resolution = (w, h);
    }
    if let Some(v) = d.enable_bucket {
        b.enable_bucket = v;
    }
    if let Some(v) = d.min_bucket_reso {
        b.min_bucket_reso = v;
    }
    if let Some(v) = d.max_bucket_reso {
        b.max_bucket_reso = v;
    }
    if let Some(v) = d.bucket_reso_steps {
        b.bucket_reso_steps = v;
    }
    b
}

/// Checks that both sides of `data.resolution` are positive multiples of `multiple` pixels;
/// `why` follows "a multiple of N pixels on each side" in the error, `tail` its example.
///
/// # Errors
/// [`JobError::Config`] naming `data.resolution`, the value and the nearest multiple.
pub fn check_resolution_multiple(
    cfg: &TrainConfig,
    multiple: u32,
    why: &str,
    tail: &str,
) -> Result<()> {
    if let Some([w, h]) = cfg.data.resolution
        && (w == 0 || h == 0 || w % multiple != 0 || h % multiple != 0)
    {
        let near = |v: u32| (v.max(multiple) + multiple / 2) / multiple * multiple;
        return Err(JobError::Config(crate::config::ConfigError::InvalidValue {
            key: "data.resolution".into(),
            value: if w == h {
                w.to_string()
            } else {
                format!("[{w}, {h}]")
            },
            expected: format!(
                "a multiple of {multiple} pixels on each side {why}, e.g. {}{tail}",
                if w == h {
                    near(w).to_string()
                } else {
                    format!("[{}, {}]", near(w), near(h))
                }
            ),
        }));
    }
    Ok(())
}

/// The dataset config of `cfg` over the images at `data_path`: a kohya dataset TOML (a path
/// ending in `.toml`), a kohya folder of `<repeats>_<concept>` subfolders (with
/// `data.reg_data_dir`'s regularization images), or a plain folder of images (one subset, one
/// repeat); captions, buckets and augmentations from the config's `data.*` keys.
///
/// # Errors
/// Data errors naming the file or folder.
pub fn dataset_config(cfg: &TrainConfig, data_path: &Path) -> Result<DatasetConfig> {
    let lower = data_path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".toml") {
        return DatasetConfig::from_toml_file(data_path)
            .during(format!("reading {}", data_path.display()));
    }
    if !data_path.is_dir() {
        return Err(crate::config::ConfigError::InvalidValue {
            key: "data.train_data_dir".into(),
            value: data_path.display().to_string(),
            expected: "a folder of images (kohya `<repeats>_<concept>` subfolders, or the images themselves) or a dataset .toml file".into(),
        }
        .into());
    }
    let d = &cfg.data;
    let mut set = lora_data::image::config::ImageSetConfig {
        bucket: bucket_config(cfg),
        ..Default::default()
    };
    set.batch_size = cfg.train.batch_size.max(1) as usize;
    let mut sub = lora_data::image::config::SubsetConfig::new(data_path);
    if let Some(e) = &d.caption_extension {
        sub.caption_extension = if e.starts_with('.') {
            e.clone()
        } else {
            format!(".{e}")
        };
    }
    if let Some(k) = d.keep_tokens {
        sub.keep_tokens = k as usize;
    }
    if let Some(s) = d.shuffle_caption {
        sub.shuffle_caption = s;
    }
    if let Some(s) = &d.caption_separator {
        sub.caption_separator = s.clone();
    }
    sub.caption_dropout_rate = d.caption_dropout_rate.unwrap_or(sub.caption_dropout_rate);
    sub.caption_tag_dropout_rate = d
        .caption_tag_dropout_rate
        .unwrap_or(sub.caption_tag_dropout_rate);
    sub.caption_prefix = d.caption_prefix.clone().or(sub.caption_prefix);
    sub.caption_suffix = d.caption_suffix.clone().or(sub.caption_suffix);
    sub.flip_aug = d.flip_aug.unwrap_or(sub.flip_aug);
    sub.random_crop = d.random_crop.unwrap_or(sub.random_crop);
    set.subsets.push(sub);
    // kohya `reg_data_dir`: regularization images in the same folder layout, relative paths
    // against the training folder's parent (where kohya users keep `img/` and `reg/`)
    let reg = d.reg_data_dir.as_deref().map(|r| {
        let p = Path::new(r);
        if p.is_relative() && !p.exists() {
            data_path
                .parent()
                .map(|b| b.join(p))
                .unwrap_or_else(|| p.to_path_buf())
        } else {
            p.to_path_buf()
        }
    });
    let dc = DatasetConfig::from_kohya_folders(data_path, reg.as_deref(), &set)
        .during(format!("listing {}", data_path.display()))?;
    if dc.datasets.iter().all(|s| s.subsets.is_empty()) {
        // a plain folder of images: one subset, one repeat
        return Ok(DatasetConfig {
            datasets: vec![set],
        });
    }
    Ok(dc)
}

/// Scans `data.train_data_dir` (relative paths against the config's folder) into an
/// [`ImageDataset`], says how many images and items it holds and their buckets, and warns about
/// every file left out or without a caption; `data.bad_images` decides whether an unusable
/// image stops the run.
///
/// # Errors
/// [`crate::config::ConfigError::Missing`] without `data.train_data_dir`; [`JobError::Input`]
/// for unusable images (exit 2); data errors.
pub fn read_dataset(cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<(PathBuf, ImageDataset)> {
    let data_written = cfg.data.train_data_dir.clone().ok_or_else(|| {
        crate::config::ConfigError::Missing {
            key: "data.train_data_dir".into(),
            hint: "set it to a kohya image folder (`<repeats>_<concept>` subfolders) or a dataset TOML".into(),
        }
    })?;
    let data_path = resolve_path("data.train_data_dir", &data_written, ctx.config_dir())?;
    let dcfg = dataset_config(cfg, &data_path)?;
    let policy = match cfg.data.bad_images {
        crate::config::BadImages::Skip => lora_data::validate::Policy::Skip,
        crate::config::BadImages::Stop => lora_data::validate::Policy::Fail,
    };
    let ds = ImageDataset::new(dcfg, policy).map_err(|e| match e {
        // unusable images (with `stop`) or none usable at all: the user's data, exit 2
        lora_data::Error::Invalid { .. } => JobError::Input(format!(
            "data.train_data_dir {}: {e}\nfix or remove those files{}",
            data_path.display(),
            if cfg.data.bad_images == crate::config::BadImages::Stop {
                ", or set data.bad_images: skip to train without them"
            } else {
                ""
            }
        )),
        other => JobError::Data {
            during: format!("scanning {}", data_path.display()),
            source: other,
        },
    })?;
    ctx.say(&format!(
        "data: {} images, {} items per epoch\n{}",
        ds.num_images(),
        ds.len(),
        ds.bucket_report()
    ));
    // name every file left out or without a caption (the Display of a problem gives the path,
    // what is wrong and what to do)
    for p in ds.problems() {
        eprintln!("warning: {p}");
    }
    Ok((data_path, ds))
}

/// The loader of `ds` with the config's batch size, shuffling, seed and `data_loader.*`
/// workers, dealing this process's share of each epoch when training is data-parallel.
///
/// # Errors
/// Data errors.
pub fn image_loader(
    ds: ImageDataset,
    cfg: &TrainConfig,
    ctx: &RunContext<'_>,
) -> Result<Loader<ImageDataset, ImageCollate>> {
    ds.into_loader(LoaderConfig {
        batch_size: cfg.train.batch_size.max(1) as usize,
        shuffle: cfg.data_loader.shuffle,
        drop_last: false,
        seed: cfg.system.seed,
        num_workers: cfg.data_loader.num_workers as usize,
        prefetch_factor: cfg.data_loader.prefetch_factor.max(1) as usize,
        persistent_workers: cfg.data_loader.persistent_workers,
        // data-parallel: this rank's share of each epoch, as DistributedSampler deals
        num_replicas: ctx.loader_shard().0,
        rank: ctx.loader_shard().1,
    })
    .during("building the image loader")
}

/// The on-disk latent cache `<out_dir>/latent_cache` when `data.cache_latents` is true.
///
/// # Errors
/// I/O errors naming the folder.
pub fn disk_cache(cfg: &TrainConfig, out_dir: &Path) -> Result<Option<LatentCache>> {
    std::fs::create_dir_all(out_dir).during(format!("creating {}", out_dir.display()))?;
    if cfg.data.cache_latents == Some(true) {
        Ok(Some(
            LatentCache::new(out_dir.join("latent_cache")).during("opening the latent cache")?,
        ))
    } else {
        Ok(None)
    }
}

/// The name of a VAE in latent cache keys: its file or folder (canonical path) and the dtype it
/// encodes in, so that another VAE or dtype never reads these latents.
pub fn vae_model_id(path: &Path, kind: tch::Kind) -> String {
    format!(
        "vae:{}:{kind:?}",
        std::fs::canonicalize(path)
            .unwrap_or_else(|_| path.to_path_buf())
            .display()
    )
}

// ---------------------------------------------------------------------------------------------
// The pipeline side
// ---------------------------------------------------------------------------------------------

/// What a recipe's pipeline does for the shared [`ImageSource`] and [`precache`].
pub trait LatentPipeline {
    /// The text conditioning of one caption, as cached (on the CPU).
    type Cond;
    /// The recipe's training batch.
    type Batch;

    /// Encodes images `[B, 3, H, W]` (f32 in `[-1, 1]`) into the latents the model trains on
    /// (`[B, C, H/8, W/8]`, scaled as the model expects).
    ///
    /// # Errors
    /// Model errors.
    fn encode_latents(&self, pixels: &Tensor) -> lora_models::Result<Tensor>;

    /// The conditioning of one caption, on the CPU.
    ///
    /// # Errors
    /// Model errors.
    fn encode_caption(&self, caption: &str) -> lora_models::Result<Self::Cond>;

    /// A second handle on a cached conditioning (no copy).
    fn share(cond: &Self::Cond) -> Self::Cond;

    /// The training batch of a loader batch: `latents` `[B, C, h, w]` (CPU, in the batch's
    /// order), each item's cached conditioning (`None` when captions are not cached because
    /// they are encoded in the step), the loader batch itself (captions, sizes, crops) and the
    /// batch's noise seed.
    ///
    /// # Errors
    /// Model and libtorch errors.
    fn make_batch(
        &self,
        latents: Tensor,
        conds: Option<Vec<Self::Cond>>,
        batch: ImageBatch,
        noise_seed: Option<u64>,
    ) -> crate::engine::Result<Self::Batch>;
}

/// The trainer's batch source over an [`ImageDataset`]: the loader's seeded per-epoch plan
/// (batches never mix buckets), its images decoded, augmented and stacked by the loader's
/// workers ahead of use (`data_loader.num_workers`, `prefetch_factor`, `persistent_workers`;
/// 0 workers decode in the training thread); each image encoded once per (file content,
/// bucket, crop, flip, VAE) and kept in memory (and on disk with a [`LatentCache`]) unless a
/// subset crops at random (`random_crop`: every epoch draws new crops, so they are encoded as
/// drawn and not kept — kept, they would grow by an entry per image per epoch), each caption's
/// conditioning encoded once when the text encoders are frozen and the captions do not change
/// between epochs (otherwise per batch, not kept, for the same reason). The position (epoch,
/// batch index) is checkpointed.
pub struct ImageSource<P: LatentPipeline> {
    pipe: Rc<P>,
    loader: Loader<ImageDataset, ImageCollate>,
    batches: Option<Batches<ImageBatch>>,
    epoch: u64,
    model_id: String,
    disk: Option<LatentCache>,
    latents: HashMap<String, Tensor>,
    /// Latents are kept in `latents` (and on disk): no subset crops at random.
    keep_latents: bool,
    text: HashMap<String, P::Cond>,
    cache_text: bool,
    bucket_batches: std::collections::BTreeMap<(u32, u32), u64>,
    /// VAE encodings done (cache misses).
    pub encoded: Rc<RefCell<u64>>,
}

impl<P: LatentPipeline> ImageSource<P> {
    /// Wraps a loader (its seed draws the order and each item's crop, flip and caption
    /// shuffle); `model_id` names the VAE (and its dtype) in cache keys ([`vae_model_id`]);
    /// `disk` adds an on-disk cache; `cache_text` caches text-encoder outputs per caption
    /// (only valid while the text encoders are frozen; ignored when the dataset's captions
    /// change between epochs). Latents are kept unless a subset crops at random.
    pub fn new(
        pipe: Rc<P>,
        loader: Loader<ImageDataset, ImageCollate>,
        model_id: String,
        disk: Option<LatentCache>,
        cache_text: bool,
    ) -> Self {
        let aug = Augmentations::of(loader.dataset().config());
        ImageSource {
            pipe,
            loader,
            batches: None,
            epoch: 0,
            model_id,
            disk,
            latents: HashMap::new(),
            keep_latents: !aug.random_crop,
            text: HashMap::new(),
            cache_text: cache_text && !aug.varying_captions,
            bucket_batches: Default::default(),
            encoded: Rc::new(RefCell::new(0)),
        }
    }

    /// The dataset.
    pub fn dataset(&self) -> &ImageDataset {
        self.loader.dataset()
    }

    /// The training batch of a loader's image batch (latents and conditioning through the
    /// caches); `noise_seed` is the batch's seed for its noise and timesteps.
    fn encode(
        &mut self,
        batch: ImageBatch,
        noise_seed: Option<u64>,
    ) -> crate::engine::Result<P::Batch> {
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        let n = batch.captions.len();
        let mut lats = Vec::with_capacity(n);
        let mut conds = Vec::with_capacity(n);
        for k in 0..n {
            let key = CacheKey::for_file(
                &batch.paths[k],
                batch.bucket,
                batch.crops[k],
                batch.flipped[k],
                &self.model_id,
            )
            .map_err(data)?;
            // random crops: encoded through a map of this call only, nothing kept
            let mut once = HashMap::new();
            let (mem, disk) = if self.keep_latents {
                (&mut self.latents, self.disk.as_ref())
            } else {
                (&mut once, None)
            };
            let (lat, _) = cached_latents(
                &*self.pipe,
                &batch.pixels.f_get(k as i64)?,
                &key,
                mem,
                disk,
                &mut self.encoded.borrow_mut(),
            )?;
            if self.cache_text {
                conds.push(cached_text(
                    &*self.pipe,
                    &batch.captions[k],
                    &mut self.text,
                )?);
            }
            lats.push(lat);
        }
        let latents = Tensor::f_stack(&lats, 0)?;
        let conds = self.cache_text.then_some(conds);
        self.pipe.make_batch(latents, conds, batch, noise_seed)
    }

    /// Adds what [`precache`] computed to the in-memory caches (its VAE encodings to
    /// [`Self::encoded`]).
    pub fn preload(&mut self, p: Precached<P::Cond>) {
        self.latents.extend(p.latents);
        self.text.extend(p.text);
        *self.encoded.borrow_mut() += p.encoded;
    }

    /// The fixed evaluation set: `n` items spread evenly over the epoch's item list (so
    /// repeats of one image are not picked twice when `n` ≤ the number of images), built with
    /// seed 0 (centred crops, no flips, captions as seed 0 shuffles them), as one batch per
    /// aspect bucket (latents of different buckets differ in shape and cannot be stacked),
    /// buckets in the order their first item appears.
    ///
    /// # Errors
    /// Data / model errors.
    pub fn fixed_batches(&mut self, n: usize) -> crate::engine::Result<Vec<P::Batch>> {
        let ds = self.loader.dataset();
        let len = ds.len();
        let k = n.min(len).max(1);
        let mut groups: Vec<(Option<(u32, u32)>, Vec<usize>)> = Vec::new();
        for i in (0..k).map(|j| j * len / k) {
            let bucket = ds.bucket_of(i);
            match groups.iter_mut().find(|(b, _)| *b == bucket) {
                Some((_, idx)) => idx.push(i),
                None => groups.push((bucket, vec![i])),
            }
        }
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        let mut out = Vec::with_capacity(groups.len());
        for (_, idx) in groups {
            let ds = self.loader.dataset();
            let samples = idx
                .iter()
                .map(|&i| ds.get_seeded(i, 0))
                .collect::<lora_data::Result<Vec<_>>>()
                .map_err(data)?;
            let batch = ImageCollate.collate(samples).map_err(data)?;
            out.push(self.encode(batch, None)?);
        }
        Ok(out)
    }

    /// Training batches drawn so far in this process, per bucket `(width, height)`, in bucket
    /// order.
    pub fn bucket_batches(&self) -> Vec<((u32, u32), u64)> {
        self.bucket_batches.iter().map(|(b, n)| (*b, *n)).collect()
    }
}

/// The latents of the image `pixels` `[3, H, W]` under `key`: from `mem`, else from the disk
/// cache, else encoded (then written to the disk cache, atomically); kept in `mem`. Also says
/// where they came from (`encoded` counts the VAE runs).
fn cached_latents<P: LatentPipeline + ?Sized>(
    pipe: &P,
    pixels: &Tensor,
    key: &CacheKey,
    mem: &mut HashMap<String, Tensor>,
    disk: Option<&LatentCache>,
    encoded: &mut u64,
) -> crate::engine::Result<(Tensor, LatentsFrom)> {
    let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
    let digest = key.digest();
    if let Some(t) = mem.get(&digest) {
        return Ok((t.shallow_clone(), LatentsFrom::Memory));
    }
    let from_disk = match disk {
        Some(c) => c.get(key).map_err(data)?,
        None => None,
    };
    let (t, from) = match from_disk {
        Some(t) => (t, LatentsFrom::Disk),
        None => {
            let t = pipe
                .encode_latents(&pixels.f_unsqueeze(0)?)
                .map_err(crate::job::error::model_step_err)?
                .f_squeeze_dim(0)?;
            *encoded += 1;
            if let Some(c) = disk {
                c.put(key, &t).map_err(data)?;
            }
            (t, LatentsFrom::Vae)
        }
    };
    mem.insert(digest, t.shallow_clone());
    Ok((t, from))
}

/// Where [`cached_latents`] found an image's latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LatentsFrom {
    /// Already in memory.
    Memory,
    /// Read from the disk cache.
    Disk,
    /// Encoded by the VAE.
    Vae,
}

/// The conditioning of one caption from `mem`, else computed and kept there (on the CPU: a
/// step moves its batch to the device).
fn cached_text<P: LatentPipeline + ?Sized>(
    pipe: &P,
    caption: &str,
    mem: &mut HashMap<String, P::Cond>,
) -> crate::engine::Result<P::Cond> {
    if let Some(t) = mem.get(caption) {
        return Ok(P::share(t));
    }
    let t = pipe
        .encode_caption(caption)
        .map_err(crate::job::error::model_step_err)?;
    let shared = P::share(&t);
    mem.insert(caption.to_string(), t);
    Ok(shared)
}

/// The random augmentations of a dataset's subsets, which decide what can be computed before
/// training.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Augmentations {
    /// Some subset crops at random (`random_crop`): latents differ per epoch.
    pub random_crop: bool,
    /// Some subset flips (`flip_aug`): both orientations of an image are cached.
    pub flip: bool,
    /// Some subset changes its captions between epochs (`shuffle_caption`,
    /// `caption_dropout_rate`, `caption_tag_dropout_rate`, `random_caption_line`).
    pub varying_captions: bool,
}

impl Augmentations {
    /// The augmentations of every subset of `dc`.
    pub fn of(dc: &DatasetConfig) -> Self {
        let mut a = Augmentations::default();
        for sub in dc.datasets.iter().flat_map(|d| &d.subsets) {
            a.random_crop |= sub.random_crop;
            a.flip |= sub.flip_aug;
            a.varying_captions |= sub.shuffle_caption
                || sub.caption_dropout_rate > 0.0
                || sub.caption_tag_dropout_rate > 0.0
                || sub.random_caption_line;
        }
        a
    }
}

/// Samples in the fixed evaluation batches of an image job's before/after loss
/// ([`ImageSource::fixed_batches`]).
pub const EVAL_SAMPLES: usize = 8;

/// What an image job's data source keeps in memory for the whole run, for the plan
/// ([`lora_memory::KeptData`]): the latents of every image (both orientations with `flip_aug`),
/// the text-encoder outputs of every image's caption when `cache_text` (one caption per image:
/// identical captions share an entry, so this is an upper bound), and the evaluation samples.
/// With random crops no latents are kept, with captions that change between epochs no
/// text-encoder outputs (each would be a new entry per epoch; [`ImageSource`] encodes them as
/// they come instead).
pub fn kept_data(ds: &ImageDataset, cache_text: bool) -> lora_memory::KeptData {
    let images = ds.num_images() as u64;
    let aug = Augmentations::of(ds.config());
    let orientations = if aug.flip { 2 } else { 1 };
    lora_memory::KeptData {
        // random crops and varying captions are not kept ([`ImageSource`])
        latents: if aug.random_crop {
            0
        } else {
            images * orientations
        },
        captions: if cache_text && !aug.varying_captions {
            images
        } else {
            0
        },
        eval_samples: EVAL_SAMPLES.min(ds.len()).max(1) as u64,
    }
}

/// What an image job computes before training and then moves off the device, as
/// `(latents, text_encoder_outputs)`: with `data.cache_latents: true`, every latent unless
/// crops are random, and the text-encoder outputs of every caption unless the text encoders are
/// trained or the captions change between epochs. The VAE leaves the device when the first is
/// true, the text encoders when the second is (kohya sd-scripts' `cache_latents` /
/// `cache_text_encoder_outputs`).
pub fn precomputed(cfg: &TrainConfig, aug: Augmentations) -> (bool, bool) {
    let cache = cfg.data.cache_latents == Some(true);
    (
        cache && !aug.random_crop,
        cache && !cfg.train.train_text_encoder && !aug.varying_captions,
    )
}

/// The augmentations of the dataset `cfg` names (`data.train_data_dir`, relative paths against
/// `config_dir`); the config's own `data.random_crop`, `data.flip_aug`, `data.shuffle_caption`
/// and caption dropout rates when the dataset cannot be read.
pub fn augmentations_of(cfg: &TrainConfig, config_dir: Option<&Path>) -> Augmentations {
    let read = || -> Option<Augmentations> {
        let written = cfg.data.train_data_dir.as_deref()?;
        let path = resolve_path("data.train_data_dir", written, config_dir).ok()?;
        Some(Augmentations::of(&dataset_config(cfg, &path).ok()?))
    };
    let d = &cfg.data;
    read().unwrap_or(Augmentations {
        random_crop: d.random_crop == Some(true),
        flip: d.flip_aug == Some(true),
        varying_captions: d.shuffle_caption == Some(true)
            || d.caption_dropout_rate.is_some_and(|r| r > 0.0)
            || d.caption_tag_dropout_rate.is_some_and(|r| r > 0.0),
    })
}

/// Latents and text-encoder outputs computed before training by [`precache`].
#[derive(Debug)]
pub struct Precached<C> {
    /// Latents by [`CacheKey::digest`] (f32, CPU).
    pub latents: HashMap<String, Tensor>,
    /// Conditioning by caption (CPU).
    pub text: HashMap<String, C>,
    /// VAE encodings done (the rest came from the disk cache).
    pub encoded: u64,
}

impl<C> Default for Precached<C> {
    fn default() -> Self {
        Precached {
            latents: HashMap::new(),
            text: HashMap::new(),
            encoded: 0,
        }
    }
}

/// Encodes, before training, the latents of every item of `ds` (`latents`; both orientations
/// when a subset flips, which needs crops that are not random) and the text-encoder outputs of
/// every caption (`text`; captions that do not change between epochs), reading and writing the
/// disk cache `disk` as training would. Between images it checks
/// [`crate::engine::stop_requested`] and returns `None` when a stop was asked for: what was
/// encoded so far stays on disk as complete entries (each written atomically), nothing is
/// marked as done, and a rerun encodes the rest. `progress` gets a line now and then (count /
/// total).
///
/// # Errors
/// Data, model and cache errors.
pub fn precache<P: LatentPipeline + ?Sized>(
    pipe: &P,
    ds: &ImageDataset,
    model_id: &str,
    disk: Option<&LatentCache>,
    (latents, text): (bool, bool),
    progress: &dyn Fn(&str),
) -> crate::engine::Result<Option<Precached<P::Cond>>> {
    let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
    let mut out = Precached::default();
    if !latents && !text {
        return Ok(Some(out));
    }
    let flip = latents && Augmentations::of(ds.config()).flip;
    let total = ds.len();
    let what = match (latents, text) {
        (true, true) => "latents and text-encoder outputs",
        (true, false) => "latents",
        _ => "text-encoder outputs",
    };
    let started = std::time::Instant::now();
    let mut last = started;
    let mut from_disk = 0u64;
    for i in 0..total {
        if crate::engine::stop_requested() {
            progress(&format!(
                "caching {what}: stopped at {i}/{total} items ({} encoded, {from_disk} from disk); the cache holds only complete entries, a rerun encodes the rest",
                out.encoded
            ));
            return Ok(None);
        }
        if i == 0 || last.elapsed().as_secs_f64() >= 2.0 {
            last = std::time::Instant::now();
            progress(&format!(
                "caching {what}: {i}/{total} items ({} encoded, {from_disk} from disk, {} captions)",
                out.encoded,
                out.text.len()
            ));
        }
        // seed 0: centred crop (no random crop here), the caption as every epoch has it
        let sample = ds.get_seeded(i, 0).map_err(data)?;
        if latents {
            let key = sample.cache_key(model_id).map_err(data)?;
            let (_, from) = cached_latents(
                pipe,
                &sample.pixels,
                &key,
                &mut out.latents,
                disk,
                &mut out.encoded,
            )?;
            from_disk += u64::from(from == LatentsFrom::Disk);
            if flip {
                // the other orientation: lora-data flips the cropped image, a pure permutation
                let key = CacheKey {
                    flip: !key.flip,
                    ..key
                };
                let mirrored = sample.pixels.f_flip([2])?;
                let (_, from) = cached_latents(
                    pipe,
                    &mirrored,
                    &key,
                    &mut out.latents,
                    disk,
                    &mut out.encoded,
                )?;
                from_disk += u64::from(from == LatentsFrom::Disk);
            }
        }
        if text {
            cached_text(pipe, &sample.caption, &mut out.text)?;
        }
    }
    progress(&format!(
        "caching {what}: {total}/{total} items in {:.1} s ({} latents, {} encoded; {} captions)",
        started.elapsed().as_secs_f64(),
        out.latents.len(),
        out.encoded,
        out.text.len()
    ));
    Ok(Some(out))
}

impl<P: LatentPipeline> BatchSource<P::Batch> for ImageSource<P> {
    fn start_epoch(&mut self, epoch: u64) -> crate::engine::Result<()> {
        self.batches = Some(self.loader.batches(epoch, 0));
        self.epoch = epoch;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::engine::Result<Option<P::Batch>> {
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        // this batch's index in the epoch's whole plan: a data-parallel rank's share is batches
        // rank, rank + num_replicas, … of it (see `LoaderConfig::num_replicas`)
        let lc = self.loader.config();
        let local = self.batches.as_ref().map_or(0, Batches::position);
        let global = local * lc.num_replicas.max(1) + lc.rank;
        let noise_seed = lora_data::rng::mix(&[lc.seed, self.epoch, global as u64, 0x6e6f_6973_65]);
        let Some(batch) = self.batches.as_mut().and_then(Iterator::next) else {
            return Ok(None);
        };
        let batch = batch.map_err(data)?;
        *self.bucket_batches.entry(batch.bucket).or_default() += 1;
        self.encode(batch, Some(noise_seed)).map(Some)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        let next = self.batches.as_ref().map_or(0, Batches::position);
        serde_json::json!({
            "epoch": self.epoch,
            "next": next,
            "items": self.loader.dataset().len(),
            "num_replicas": self.loader.config().num_replicas,
        })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::engine::Result<()> {
        let bad = |m: &str| TrainError::State {
            what: "image loader position".into(),
            message: m.into(),
        };
        let items = state["items"]
            .as_u64()
            .ok_or_else(|| bad("no item count"))?;
        if items != self.loader.dataset().len() as u64 {
            return Err(bad(&format!(
                "the checkpoint was taken over {items} items, this dataset has {}; resume with the same images and repeats",
                self.loader.dataset().len()
            )));
        }
        let epoch = state["epoch"].as_u64().ok_or_else(|| bad("no epoch"))?;
        let next = state["next"].as_u64().ok_or_else(|| bad("no position"))? as usize;
        // written by another number of data-parallel ranks: the same place in the epoch's plan
        let saved_replicas = state["num_replicas"].as_u64().unwrap_or(1) as usize;
        let next = lora_data::loader::replica_position(
            next,
            saved_replicas,
            self.loader.config().num_replicas,
        );
        self.batches = Some(self.loader.batches(epoch, next));
        self.epoch = epoch;
        Ok(())
    }
}

/// Caches before training what `pre` (`(latents, text_encoder_outputs)`, see [`precomputed`])
/// says can be (kohya's `cache_latents` / `cache_text_encoder_outputs`), with progress through
/// `ctx`; then, when something was cached, lets `move_frozen` move the models no longer needed
/// off the device (it gets the pipeline while nothing else holds it, and returns what it
/// moved, said through `ctx`); and wraps the loader in an [`ImageSource`] holding those caches.
/// `Ok(None)` when a stop was asked for while caching.
///
/// # Errors
/// Data, model and cache errors; [`JobError::Internal`] when the pipeline is shared;
/// whatever `move_frozen` returns.
#[allow(clippy::too_many_arguments)]
pub fn cached_source<P: LatentPipeline>(
    pipe: &mut Rc<P>,
    loader: Loader<ImageDataset, ImageCollate>,
    model_id: String,
    disk: Option<LatentCache>,
    pre: (bool, bool),
    cache_text: bool,
    ctx: &RunContext<'_>,
    move_frozen: impl FnOnce(&mut P, (bool, bool)) -> Result<Vec<&'static str>>,
) -> Result<Option<ImageSource<P>>> {
    let say = |s: &str| ctx.say(s);
    let precached = precache(
        &**pipe,
        loader.dataset(),
        &model_id,
        disk.as_ref(),
        pre,
        &say,
    )
    .during("caching before training")?;
    let Some(precached) = precached else {
        return Ok(None);
    };
    if pre.0 || pre.1 {
        let p = Rc::get_mut(pipe)
            .ok_or(JobError::Internal("the pipeline is shared before training"))?;
        let moved = move_frozen(p, pre)?;
        say_moved(ctx, &moved, pre);
    }
    let mut source = ImageSource::new(pipe.clone(), loader, model_id, disk, cache_text);
    source.preload(precached);
    Ok(Some(source))
}

// ---------------------------------------------------------------------------------------------
// Sample grids
// ---------------------------------------------------------------------------------------------

/// Draws one image per prompt for a sample grid.
pub trait GridSampler {
    /// Images `[n, 3, H, W]` f32 in `[0, 1]`, one per prompt, in order.
    ///
    /// # Errors
    /// A message saying what failed.
    fn sample(&self, prompts: &[String]) -> std::result::Result<Tensor, String>;
}

/// Writes a sample grid every `every` optimizer steps (one column per prompt).
pub struct SampleCallback<S: GridSampler> {
    sampler: S,
    prompts: Vec<String>,
    every: u64,
    dir: PathBuf,
    /// Files written.
    pub written: Rc<RefCell<Vec<PathBuf>>>,
}

impl<S: GridSampler> SampleCallback<S> {
    /// Writes `<dir>/step-N.png` for `prompts` every `every` steps (0 = never during training;
    /// [`Self::write`] can still be called).
    pub fn new(sampler: S, prompts: Vec<String>, every: u64, dir: PathBuf) -> Self {
        SampleCallback {
            sampler,
            prompts,
            every,
            dir,
            written: Rc::new(RefCell::new(Vec::new())),
        }
    }

    /// Samples now and writes `<dir>/step-{step}.png` (one column per prompt).
    ///
    /// # Errors
    /// Model errors; I/O errors naming the file.
    pub fn write(&self, step: u64) -> std::result::Result<PathBuf, String> {
        std::fs::create_dir_all(&self.dir).map_err(|e| format!("{}: {e}", self.dir.display()))?;
        let imgs = self
            .sampler
            .sample(&self.prompts)
            .map_err(|e| format!("sampling: {e}"))?;
        let path = self.dir.join(format!("step-{step}.png"));
        lora_models::diffusion::save_grid(&imgs, self.prompts.len().max(1), &path)
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        self.written.borrow_mut().push(path.clone());
        Ok(path)
    }
}

impl<S: GridSampler> crate::engine::callbacks::Callback for SampleCallback<S> {
    fn on_step(
        &mut self,
        info: &crate::engine::callbacks::StepInfo,
    ) -> crate::engine::Result<crate::engine::callbacks::Control> {
        if self.every > 0 && !self.prompts.is_empty() && info.step % self.every == 0 {
            self.write(info.step).map_err(TrainError::App)?;
        }
        Ok(crate::engine::callbacks::Control::Continue)
    }
}

/// Writes the grid of the last step `step` with `sampler` when there are prompts and none was
/// written for that step during training (`written` lists the grids so far; the new one is
/// added).
///
/// # Errors
/// [`JobError`] naming the final sample grid, with the sampler's or the file's error.
pub fn final_grid<S: GridSampler>(
    sampler: S,
    prompts: &[String],
    written: &Rc<RefCell<Vec<PathBuf>>>,
    dir: PathBuf,
    step: u64,
) -> Result<()> {
    let done = written
        .borrow()
        .iter()
        .any(|p| p.ends_with(format!("step-{step}.png")));
    if prompts.is_empty() || done {
        return Ok(());
    }
    let cb = SampleCallback::new(sampler, prompts.to_vec(), 0, dir);
    let p = cb
        .write(step)
        .map_err(TrainError::App)
        .during("writing the final sample grid")?;
    written.borrow_mut().push(p);
    Ok(())
}

/// The closing report of an image job: steps, time, the fixed-noise loss before → after, on a
/// CPU run the measured memory against the plan, and every file written.
#[allow(clippy::too_many_arguments)]
pub fn run_report(
    steps: u64,
    train_seconds: f64,
    (before, after): (f64, f64),
    plan: Option<&crate::job::Plan>,
    memory: &crate::job::MeasuredMemory,
    files: &[PathBuf],
    ctx: &RunContext<'_>,
) -> String {
    let mut out = format!(
        "summary: {steps} optimizer steps in {train_seconds:.1} s; fixed-noise loss {before:.5} → {after:.5} ({:+.1}%)\n",
        100.0 * (after / before - 1.0)
    );
    if let Some(p) = plan
        && !ctx.cuda
    {
        out += &format!(
            "memory (CPU): tensor peak (counting allocator) {} vs predicted allocated peak {} ({}); process peak RSS {} vs predicted {} ({})\n",
            lora_memory::Bytes(memory.tensor_peak),
            p.estimate.peak_allocated,
            crate::job::run::vs_plan(p.estimate.peak_allocated.0, memory.tensor_peak),
            lora_memory::Bytes(memory.rss_peak_process),
            p.estimate.peak_process,
            crate::job::run::vs_plan(p.estimate.peak_process.0, memory.rss_peak_process)
        );
    }
    for o in files {
        out += &format!("wrote {}\n", o.display());
    }
    out
}

/// The prompts of kohya prompt-file lines (`a cat --n blurry --w 512 --d 1`): each line's text
/// before its first ` --` option, without empty and `#` comment lines; and the options seen
/// (`--n`, `--w`, …), which the samplers here do not apply per prompt.
pub fn kohya_prompts(lines: &[String]) -> (Vec<String>, Vec<String>) {
    let mut prompts = Vec::new();
    let mut options: Vec<String> = Vec::new();
    for line in lines {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split(" --");
        let prompt = parts.next().unwrap_or_default().trim();
        for opt in parts {
            let name = format!("--{}", opt.split_whitespace().next().unwrap_or_default());
            if !options.contains(&name) {
                options.push(name);
            }
        }
        if !prompt.is_empty() {
            prompts.push(prompt.to_string());
        }
    }
    (prompts, options)
}

/// The sample grid a diffusion job will draw, for the planner: at the training size (what the
/// jobs sample at), with classifier-free `guidance` or not, and as many prompts as the config
/// lists with text (`logging.sample_prompts`, else the lines of `logging.sample_prompt`, blank
/// lines, `#` comments and kohya's per-line options left out as training leaves them out). A
/// kohya prompt file is not read here and counts as one prompt; [`with_prompt_file_read`] puts
/// its prompts into the config first. The prompts are drawn one at a time, so their number
/// changes only the noise and, on a CPU run, the finished images (3 MB each at 512²). `None`
/// without prompts.
pub fn planned_sample_images(
    cfg: &TrainConfig,
    guidance: bool,
) -> Option<lora_memory::SampleImages> {
    let (listed, _) = kohya_prompts(&cfg.logging.sample_prompts);
    // training reads the file only when no prompt is listed, blank ones included
    let prompts = if !listed.is_empty() {
        listed.len()
    } else if cfg.logging.sample_prompts.is_empty() && cfg.logging.sample_prompts_file.is_some() {
        1
    } else {
        prompt_lines(cfg).len()
    };
    (prompts > 0).then(|| lora_memory::SampleImages {
        size: None,
        prompts: u32::try_from(prompts).unwrap_or(u32::MAX),
        guidance,
    })
}

/// `cfg` with its kohya prompt file (`logging.sample_prompts_file`, relative to `config_dir`)
/// read into `logging.sample_prompts`, so that a plan counts the prompts training will draw;
/// `cfg` itself when it names no file or lists prompts already (they take precedence).
///
/// # Errors
/// [`JobError::Input`] naming the key and the places looked at when the file is not found, or
/// the file when it cannot be read — as `train` would stop on it.
pub fn with_prompt_file_read<'a>(
    cfg: &'a TrainConfig,
    config_dir: Option<&std::path::Path>,
) -> Result<std::borrow::Cow<'a, TrainConfig>> {
    match (
        &cfg.logging.sample_prompts_file,
        cfg.logging.sample_prompts.is_empty(),
    ) {
        (Some(file), true) => {
            let mut out = cfg.clone();
            let (prompts, _) = kohya_prompts(&read_prompt_file(file, config_dir)?);
            out.logging.sample_prompts_file = None;
            out.logging.sample_prompts = prompts;
            Ok(std::borrow::Cow::Owned(out))
        }
        _ => Ok(std::borrow::Cow::Borrowed(cfg)),
    }
}

/// The lines of kohya's prompt file `written` (relative to `config_dir`).
fn read_prompt_file(written: &str, config_dir: Option<&std::path::Path>) -> Result<Vec<String>> {
    let path = resolve_path("sample_prompts", written, config_dir)?;
    let text = std::fs::read_to_string(&path)
        .during(format!("reading the sample prompts {}", path.display()))?;
    Ok(text.lines().map(String::from).collect())
}

/// The non-blank lines of `logging.sample_prompt`, trimmed.
fn prompt_lines(cfg: &TrainConfig) -> Vec<String> {
    cfg.logging
        .sample_prompt
        .as_deref()
        .unwrap_or("")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect()
}

/// The sample prompts of a config: `logging.sample_prompts`, else kohya's prompt file
/// (`sample_prompts`, relative to the config's folder), else the lines of
/// `logging.sample_prompt`; kohya's per-line options are taken off each prompt (said once).
///
/// # Errors
/// I/O errors naming the prompt file.
pub fn sample_prompts(cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Vec<String>> {
    let mut prompts: Vec<String> = cfg.logging.sample_prompts.clone();
    if prompts.is_empty()
        && let Some(file) = &cfg.logging.sample_prompts_file
    {
        prompts = read_prompt_file(file, ctx.config_dir())?;
    }
    let (prompts, ignored) = kohya_prompts(&prompts);
    if !ignored.is_empty() {
        ctx.say(&format!(
            "sample prompts: kohya's per-prompt options {} are not applied; the samples use logging.sample_steps, sample_guidance_scale, the training size and system.seed",
            ignored.join(", ")
        ));
    }
    if !prompts.is_empty() {
        return Ok(prompts);
    }
    Ok(prompt_lines(cfg))
}

/// Says which frozen models left the device after caching (`moved`), or that they stay in
/// memory on a CPU run (`moved` empty).
fn say_moved(ctx: &RunContext<'_>, moved: &[&str], (latents, text): (bool, bool)) {
    let (which, verb) = match (latents, text) {
        (true, true) => ("the VAE and the text encoders", "stay"),
        (true, false) => ("the VAE", "stays"),
        _ => ("the text encoders", "stay"),
    };
    if moved.is_empty() {
        ctx.say(&format!(
            "{which} {verb} in memory (a CPU run: the device is the CPU)"
        ));
    } else {
        ctx.say(&format!(
            "moved {} to the CPU until sample images are drawn",
            moved.join(", ")
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_settings_that_give_no_bucket_are_refused_before_training() {
        // a 32 × 32 run with buckets on and the defaults (steps of 64, smallest side 256): no
        // bucket fits, which training would find only when it builds the data set
        let mut cfg = TrainConfig::default();
        cfg.data.resolution = Some([32, 32]);
        cfg.data.enable_bucket = Some(true);
        let e = check_buckets(&cfg).unwrap_err().to_string();
        assert!(
            e.contains("min_bucket_reso") && e.contains("no bucket fits") && e.contains("32×32"),
            "{e}"
        );
        cfg.data.bucket_reso_steps = Some(8);
        cfg.data.min_bucket_reso = Some(16);
        check_buckets(&cfg).unwrap();
        cfg.data.enable_bucket = Some(false);
        cfg.data.min_bucket_reso = None;
        cfg.data.bucket_reso_steps = None;
        check_buckets(&cfg).unwrap();
    }

    #[test]
    fn kohya_folders_give_subsets_with_repeats_and_a_plain_folder_is_one_subset() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("3_cat")).unwrap();
        std::fs::create_dir_all(d.path().join("notes")).unwrap();
        let mut cfg = TrainConfig::default();
        cfg.data.resolution = Some([64, 96]);
        cfg.data.caption_extension = Some("caption".into());
        cfg.data.keep_tokens = Some(2);
        cfg.data.shuffle_caption = Some(true);
        cfg.train.batch_size = 3;
        let dc = dataset_config(&cfg, d.path()).unwrap();
        let set = &dc.datasets[0];
        assert_eq!(set.bucket.resolution, (64, 96));
        assert_eq!(set.batch_size, 3);
        assert_eq!(set.subsets.len(), 1);
        let s = &set.subsets[0];
        assert_eq!(s.image_dir, d.path().join("3_cat"));
        assert_eq!(s.num_repeats, 3);
        assert_eq!(s.class_tokens.as_deref(), Some("cat"));
        assert_eq!(s.caption_extension, ".caption");
        assert_eq!((s.keep_tokens, s.shuffle_caption), (2, true));
        // no `<repeats>_<name>` folder: the folder itself, one repeat
        let plain = tempfile::tempdir().unwrap();
        let dc = dataset_config(&cfg, plain.path()).unwrap();
        let s = &dc.datasets[0].subsets[0];
        assert_eq!(s.image_dir, plain.path());
        assert_eq!(s.num_repeats, 1);
    }

    #[test]
    fn kohya_prompt_lines_lose_their_options_and_comments() {
        let (p, o) = kohya_prompts(&[
            "a cat --n blurry --w 512 --h 768".into(),
            "# a comment".into(),
            "".into(),
            "a dog --d 7".into(),
            "plain".into(),
        ]);
        assert_eq!(p, vec!["a cat", "a dog", "plain"]);
        assert_eq!(o, vec!["--n", "--w", "--h", "--d"]);
    }
}
