//! The SD batch source: images through the VAE (cached in memory and on disk), captions
//! through the text encoders, and the caching done before training.

use super::*;

/// The trainer's batch source over an [`ImageDataset`]: the loader's seeded per-epoch plan
/// (batches never mix buckets), its images decoded, augmented and stacked by the loader's
/// workers ahead of use (`data_loader.num_workers`, `prefetch_factor`, `persistent_workers`;
/// 0 workers decode in the training thread); each image encoded by the VAE once per (file
/// content, bucket, crop, flip, VAE) and kept in memory (and on disk with a [`LatentCache`]),
/// each caption tokenized and, when the text encoders are frozen, encoded once; SDXL time ids
/// from each sample's original size, crop and bucket. The position (epoch, batch index) is
/// checkpointed.
pub struct ImageSource {
    pipe: Rc<SdPipeline>,
    loader: Loader<ImageDataset, ImageCollate>,
    batches: Option<Batches<ImageBatch>>,
    epoch: u64,
    model_id: String,
    disk: Option<LatentCache>,
    latents: HashMap<String, Tensor>,
    text: HashMap<String, TextCond>,
    cache_text: bool,
    bucket_batches: std::collections::BTreeMap<(u32, u32), u64>,
    /// VAE encodings done (cache misses).
    pub encoded: Rc<RefCell<u64>>,
}

impl ImageSource {
    /// Wraps a loader (its seed draws the order and each item's crop, flip and caption
    /// shuffle); `model_id` names the VAE (and its dtype) in cache keys; `disk` adds an
    /// on-disk cache; `cache_text` caches text-encoder outputs per caption (only valid while
    /// the text encoders are frozen).
    pub fn new(
        pipe: Rc<SdPipeline>,
        loader: Loader<ImageDataset, ImageCollate>,
        model_id: String,
        disk: Option<LatentCache>,
        cache_text: bool,
    ) -> Self {
        ImageSource {
            pipe,
            loader,
            batches: None,
            epoch: 0,
            model_id,
            disk,
            latents: HashMap::new(),
            text: HashMap::new(),
            cache_text,
            bucket_batches: Default::default(),
            encoded: Rc::new(RefCell::new(0)),
        }
    }

    /// The training batch of a loader's image batch: latents (cached), token ids, cached
    /// text conditioning, SDXL time ids; `noise_seed` see [`SdBatch::noise_seed`].
    fn encode(
        &mut self,
        batch: ImageBatch,
        noise_seed: Option<u64>,
    ) -> crate::engine::Result<SdBatch> {
        let data = |e: lora_data::Error| TrainError::App(format!("data: {e}"));
        let n = batch.captions.len();
        let mut lats = Vec::with_capacity(n);
        let mut conds = Vec::with_capacity(n);
        let mut time_ids = Vec::with_capacity(6 * n);
        for k in 0..n {
            let key = CacheKey::for_file(
                &batch.paths[k],
                batch.bucket,
                batch.crops[k],
                batch.flipped[k],
                &self.model_id,
            )
            .map_err(data)?;
            let (lat, _) = cached_latents(
                &self.pipe,
                &batch.pixels.f_get(k as i64)?,
                &key,
                &mut self.latents,
                self.disk.as_ref(),
                &mut self.encoded.borrow_mut(),
            )?;
            if self.cache_text {
                conds.push(cached_text(&self.pipe, &batch.captions[k], &mut self.text)?);
            }
            time_ids.extend(sdxl_time_ids(
                batch.original_sizes[k],
                batch.crops[k],
                batch.bucket,
            ));
            lats.push(lat);
        }
        let (ids, ids_2) = self.pipe.tokenize(&batch.captions).map_err(model_err)?;
        let time_ids = if self.pipe.is_sdxl() {
            Some(Tensor::f_from_slice(&time_ids)?.f_view([n as i64, 6])?)
        } else {
            None
        };
        Ok(SdBatch {
            latents: Tensor::f_stack(&lats, 0)?,
            ids,
            ids_2,
            cond: if self.cache_text {
                Some(TextCond::stack(&conds)?)
            } else {
                None
            },
            time_ids,
            captions: batch.captions,
            noise_seed,
        })
    }

    /// Adds what [`precache`] computed to the in-memory caches (its VAE encodings to
    /// [`Self::encoded`]).
    pub fn preload(&mut self, p: Precached) {
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
    pub fn fixed_batches(&mut self, n: usize) -> crate::engine::Result<Vec<SdBatch>> {
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
/// cache, else encoded by the VAE (then written to the disk cache, atomically); kept in `mem`.
/// Also says where they came from (`encoded` counts the VAE runs).
fn cached_latents(
    pipe: &SdPipeline,
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
                .encode_images(&pixels.f_unsqueeze(0)?)
                .map_err(model_err)?
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

/// The text-encoder conditioning of one caption (`hidden` `[77, D]`, SDXL `pooled` `[P]`) from
/// `mem`, else computed and kept there; held on the CPU (a step moves its batch to the device).
fn cached_text(
    pipe: &SdPipeline,
    caption: &str,
    mem: &mut HashMap<String, TextCond>,
) -> crate::engine::Result<TextCond> {
    if let Some(t) = mem.get(caption) {
        return Ok(t.shallow_clone());
    }
    let t = pipe
        .encode_prompts(&[caption])
        .map_err(model_err)?
        .row(0)?
        .to_device(Device::Cpu)?;
    mem.insert(caption.to_string(), t.shallow_clone());
    Ok(t)
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

/// What the SD job computes before training and then moves off the device, as
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

/// Sets the lora-memory settings that say which frozen models the SD job keeps on the device
/// during the training steps: `cache_latents` / `cache_text_encoder_outputs` as
/// [`precomputed`] says, `random_crop` / `varying_captions` from the dataset's subsets
/// (`aug`), and `keep_models_loaded` on a CPU run (`cuda` false), where moving them to the CPU
/// keeps them in the same memory.
pub fn frozen_model_settings(
    s: &mut lora_memory::Settings,
    cfg: &TrainConfig,
    aug: Augmentations,
    cuda: bool,
) {
    let cache = cfg.data.cache_latents == Some(true);
    s.cache_latents = cache;
    s.cache_text_encoder_outputs = cache && !cfg.train.train_text_encoder;
    s.random_crop = aug.random_crop;
    s.varying_captions = aug.varying_captions;
    s.keep_models_loaded = !cuda;
}

/// The augmentations of the dataset `cfg` names (`data.train_data_dir`, relative paths against
/// `config_dir`); the config's own `data.shuffle_caption` when the dataset cannot be read.
pub fn augmentations_of(cfg: &TrainConfig, config_dir: Option<&Path>) -> Augmentations {
    let read = || -> Option<Augmentations> {
        let written = cfg.data.train_data_dir.as_deref()?;
        let path = resolve_path("data.train_data_dir", written, config_dir).ok()?;
        Some(Augmentations::of(&dataset_config(cfg, &path).ok()?))
    };
    read().unwrap_or(Augmentations {
        varying_captions: cfg.data.shuffle_caption == Some(true),
        ..Augmentations::default()
    })
}

/// Latents and text-encoder outputs computed before training by [`precache`].
#[derive(Debug, Default)]
pub struct Precached {
    /// Latents by [`CacheKey::digest`] (f32, CPU).
    pub latents: HashMap<String, Tensor>,
    /// Conditioning by caption (CPU).
    pub text: HashMap<String, TextCond>,
    /// VAE encodings done (the rest came from the disk cache).
    pub encoded: u64,
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
pub fn precache(
    pipe: &SdPipeline,
    ds: &ImageDataset,
    model_id: &str,
    disk: Option<&LatentCache>,
    (latents, text): (bool, bool),
    progress: &dyn Fn(&str),
) -> crate::engine::Result<Option<Precached>> {
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

impl BatchSource<SdBatch> for ImageSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::engine::Result<()> {
        self.batches = Some(self.loader.batches(epoch, 0));
        self.epoch = epoch;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::engine::Result<Option<SdBatch>> {
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
