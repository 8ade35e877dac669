//! A least-recently-used cache of tagger results, optionally persisted to a JSON file.
//!
//! Keys are the SHA-256 (hex) of `kind ∅ input ∅ model_id ∅ settings_hash`, where the input is
//! the SHA-256 of an image file's *content* (a renamed or copied image hits; an edited one misses)
//! or a description's whitespace-normalized text (`"a  cat\n"` = `"a cat"`), and `settings_hash`
//! is the SHA-256 of the settings that change the output (thresholds, prompt), serialized as JSON.
//! The bound is a number of entries (`memory_management.cache_size`; 0 disables caching).
//!
//! [`CachedTagger`] wraps any [`Tagger`]: hits are answered from the cache, misses go to the inner
//! tagger in one call, successes are stored; failed items are never cached.

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use lru::LruCache;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::{ItemResult, ScoredTag, Tagger};

/// Hit and miss counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct CacheStats {
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Lookups that were not.
    pub misses: u64,
}

impl CacheStats {
    /// `hits / (hits + misses)`, 0 when nothing was looked up.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

#[derive(Serialize, Deserialize)]
struct CacheFile {
    version: u32,
    /// Least recently used first.
    entries: Vec<CacheEntry>,
}

#[derive(Serialize, Deserialize)]
struct CacheEntry {
    key: String,
    tags: Vec<ScoredTag>,
}

/// The SHA-256 (hex) of `value` serialized as JSON; the `settings_hash` part of a key.
pub fn settings_hash(value: &impl Serialize) -> String {
    let json = serde_json::to_string(value).unwrap_or_default();
    hex::encode(Sha256::digest(json.as_bytes()))
}

fn key_of(kind: &str, input: &str, model_id: &str, settings_hash: &str) -> String {
    let mut h = Sha256::new();
    for part in [kind, input, model_id, settings_hash] {
        h.update(part.as_bytes());
        h.update([0u8]);
    }
    hex::encode(h.finalize())
}

/// Whitespace-normalized text: runs of whitespace become one space, ends trimmed.
pub fn normalize_text(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An LRU map from keys to tag lists, with hit/miss counts.
pub struct TagCache {
    lru: Option<LruCache<String, Vec<ScoredTag>>>,
    stats: CacheStats,
}

impl std::fmt::Debug for TagCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagCache")
            .field("len", &self.len())
            .field("capacity", &self.capacity())
            .field("stats", &self.stats)
            .finish()
    }
}

impl TagCache {
    /// An empty cache of at most `capacity` entries (0: caches nothing).
    pub fn new(capacity: usize) -> Self {
        TagCache {
            lru: NonZeroUsize::new(capacity).map(LruCache::new),
            stats: CacheStats::default(),
        }
    }

    /// The key of an image: hashes the file's content.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file when it cannot be read.
    pub fn image_key(path: &Path, model_id: &str, settings_hash: &str) -> Result<String> {
        let bytes = std::fs::read(path).map_err(|source| Error::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let content = hex::encode(Sha256::digest(&bytes));
        Ok(key_of("image", &content, model_id, settings_hash))
    }

    /// The key of a description (whitespace-normalized).
    pub fn text_key(text: &str, model_id: &str, settings_hash: &str) -> String {
        key_of("text", &normalize_text(text), model_id, settings_hash)
    }

    /// Looks `key` up (counting a hit or a miss) and marks it most recently used.
    pub fn get(&mut self, key: &str) -> Option<Vec<ScoredTag>> {
        let hit = self.lru.as_mut().and_then(|l| l.get(key).cloned());
        if hit.is_some() {
            self.stats.hits += 1;
        } else {
            self.stats.misses += 1;
        }
        hit
    }

    /// Stores `tags` under `key`, evicting the least recently used entry when full.
    pub fn put(&mut self, key: String, tags: Vec<ScoredTag>) {
        if let Some(l) = self.lru.as_mut() {
            l.put(key, tags);
        }
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lru.as_ref().map_or(0, |l| l.len())
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bound (0 when disabled).
    pub fn capacity(&self) -> usize {
        self.lru.as_ref().map_or(0, |l| l.cap().get())
    }

    /// Hit/miss counts since creation or loading.
    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// Loads a cache saved by [`TagCache::save`], keeping the `capacity` most recently used
    /// entries; a missing file gives an empty cache.
    ///
    /// # Errors
    /// [`Error::Io`] when the file exists but cannot be read; [`Error::Format`] naming it when it
    /// is not a cache file (delete it to start afresh).
    pub fn load(path: &Path, capacity: usize) -> Result<Self> {
        let mut c = TagCache::new(capacity);
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(c),
            Err(source) => {
                return Err(Error::Io {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let file: CacheFile = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: path.to_path_buf(),
            msg: format!("not a tag cache file ({e}); delete it to start a new cache"),
        })?;
        if file.version != 1 {
            return Err(Error::Format {
                path: path.to_path_buf(),
                msg: format!(
                    "cache file version {} is not supported (expected 1); delete it",
                    file.version
                ),
            });
        }
        for e in file.entries {
            c.put(e.key, e.tags);
        }
        Ok(c)
    }

    /// Writes the entries (least recently used first) to `path` atomically.
    ///
    /// # Errors
    /// As [`crate::caption::write_atomic`].
    pub fn save(&self, path: &Path) -> Result<()> {
        let entries = self
            .lru
            .as_ref()
            .map(|l| {
                l.iter()
                    .rev()
                    .map(|(k, v)| CacheEntry {
                        key: k.clone(),
                        tags: v.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        let json = serde_json::to_vec(&CacheFile {
            version: 1,
            entries,
        })
        .map_err(|e| Error::Format {
            path: path.to_path_buf(),
            msg: e.to_string(),
        })?;
        crate::caption::write_atomic(path, &json)
    }
}

/// A [`Tagger`] answered from a [`TagCache`] where it can.
#[derive(Debug)]
pub struct CachedTagger<T: Tagger> {
    inner: T,
    cache: TagCache,
    settings_hash: String,
    path: Option<PathBuf>,
}

impl<T: Tagger> CachedTagger<T> {
    /// Wraps `inner`; `settings` are what changes its output besides the model (thresholds,
    /// prompt), hashed into every key.
    pub fn new(inner: T, cache: TagCache, settings: &impl Serialize) -> Self {
        CachedTagger {
            inner,
            cache,
            settings_hash: settings_hash(settings),
            path: None,
        }
    }

    /// Loads the cache from `path` (if it exists) and saves it back there on [`CachedTagger::save`].
    ///
    /// # Errors
    /// As [`TagCache::load`].
    pub fn persisted(
        inner: T,
        path: PathBuf,
        capacity: usize,
        settings: &impl Serialize,
    ) -> Result<Self> {
        let cache = TagCache::load(&path, capacity)?;
        let mut c = CachedTagger::new(inner, cache, settings);
        c.path = Some(path);
        Ok(c)
    }

    /// Saves the cache to its file, if it has one.
    ///
    /// # Errors
    /// As [`TagCache::save`].
    pub fn save(&self) -> Result<()> {
        match &self.path {
            Some(p) => self.cache.save(p),
            None => Ok(()),
        }
    }

    /// The cache.
    pub fn cache(&self) -> &TagCache {
        &self.cache
    }

    /// The wrapped tagger.
    pub fn inner_mut(&mut self) -> &mut T {
        &mut self.inner
    }

    fn run<I: Clone>(
        &mut self,
        items: &[I],
        keys: Vec<Option<String>>,
        call: impl FnOnce(&mut T, &[I]) -> Result<Vec<ItemResult>>,
    ) -> Result<Vec<ItemResult>> {
        let mut out: Vec<Option<ItemResult>> = Vec::with_capacity(items.len());
        let mut miss_idx = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match k.as_deref().and_then(|k| self.cache.get(k)) {
                Some(tags) => out.push(Some(Ok(tags))),
                None => {
                    out.push(None);
                    miss_idx.push(i);
                }
            }
        }
        if !miss_idx.is_empty() {
            let misses: Vec<I> = miss_idx.iter().map(|&i| items[i].clone()).collect();
            let results = call(&mut self.inner, &misses)?;
            for (&i, r) in miss_idx.iter().zip(results) {
                if let (Ok(tags), Some(k)) = (&r, &keys[i]) {
                    self.cache.put(k.clone(), tags.clone());
                }
                out[i] = Some(r);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::Format {
                        path: PathBuf::from("<cache>"),
                        msg: "the inner tagger returned fewer results than items".into(),
                    })
                })
            })
            .collect())
    }
}

impl<T: Tagger> Tagger for CachedTagger<T> {
    fn model_id(&self) -> String {
        self.inner.model_id()
    }

    fn batch_plan(
        &self,
        sample: &str,
        budget: Option<lora_memory::Bytes>,
    ) -> Option<lora_memory::inference::BatchPlan> {
        self.inner.batch_plan(sample, budget)
    }

    fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        let model = self.inner.model_id();
        // An unreadable file gets no key: the inner tagger reports its error.
        let keys = paths
            .iter()
            .map(|p| TagCache::image_key(p, &model, &self.settings_hash).ok())
            .collect();
        self.run(paths, keys, |t, miss| t.tag_images(miss))
    }

    fn tag_descriptions(&mut self, descriptions: &[String]) -> Result<Vec<ItemResult>> {
        let model = self.inner.model_id();
        let keys = descriptions
            .iter()
            .map(|d| Some(TagCache::text_key(d, &model, &self.settings_hash)))
            .collect();
        self.run(descriptions, keys, |t, miss| t.tag_descriptions(miss))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TagCategory;

    /// A real (if simple) tagger: tags are the description's words, so results can be checked.
    struct WordTagger {
        calls: Vec<usize>,
    }

    impl Tagger for WordTagger {
        fn model_id(&self) -> String {
            "words".into()
        }
        fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
            self.calls.push(paths.len());
            Ok(paths
                .iter()
                .map(|p| {
                    let bytes = std::fs::read(p).map_err(|source| Error::Io {
                        path: p.clone(),
                        source,
                    })?;
                    Ok(vec![ScoredTag {
                        tag: format!("{} bytes", bytes.len()),
                        score: 1.0,
                        category: TagCategory::General,
                    }])
                })
                .collect())
        }
        fn tag_descriptions(&mut self, d: &[String]) -> Result<Vec<ItemResult>> {
            self.calls.push(d.len());
            Ok(d.iter()
                .map(|s| {
                    Ok(s.split_whitespace()
                        .map(|w| ScoredTag {
                            tag: w.into(),
                            score: 1.0,
                            category: TagCategory::General,
                        })
                        .collect())
                })
                .collect())
        }
    }

    #[test]
    fn lru_evicts_and_counts() {
        let mut c = TagCache::new(2);
        let t = |s: &str| {
            vec![ScoredTag {
                tag: s.into(),
                score: 0.5,
                category: TagCategory::General,
            }]
        };
        c.put("a".into(), t("a"));
        c.put("b".into(), t("b"));
        assert!(c.get("a").is_some()); // a is now most recent
        c.put("c".into(), t("c")); // evicts b
        assert!(c.get("b").is_none());
        assert_eq!(c.get("c").unwrap()[0].tag, "c");
        assert_eq!(c.stats(), CacheStats { hits: 2, misses: 1 });
        assert!((c.stats().hit_rate() - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(c.len(), 2);
        assert_eq!(TagCache::new(0).capacity(), 0);
    }

    #[test]
    fn cached_tagger_hits_on_same_content_and_persists() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a.png");
        let b = dir.path().join("copy-of-a.png");
        std::fs::copy("../assets/skimage/coffee.png", &a)
            .or_else(|_| std::fs::write(&a, b"not an image but bytes").map(|_| 0))
            .unwrap();
        std::fs::copy(&a, &b).unwrap();
        let file = dir.path().join("cache.json");
        let settings = ("thresholds", 0.35f32);
        let mut t =
            CachedTagger::persisted(WordTagger { calls: vec![] }, file.clone(), 10, &settings)
                .unwrap();
        let r = t.tag_images(&[a.clone(), b.clone()]).unwrap();
        // The first is a miss; its copy has the same content but the lookup of the second
        // happens before the first is stored, so both go to the model in one call.
        assert_eq!(t.inner_mut().calls, [2]);
        assert_eq!(r[0].as_ref().unwrap(), r[1].as_ref().unwrap());
        let r2 = t.tag_images(std::slice::from_ref(&b)).unwrap();
        assert_eq!(t.inner_mut().calls, [2], "served from the cache");
        assert_eq!(r2[0].as_ref().unwrap(), r[0].as_ref().unwrap());
        // Whitespace-normalized descriptions share a key.
        t.tag_descriptions(&["a  tabby\ncat".into()]).unwrap();
        let d = t.tag_descriptions(&[" a tabby cat ".into()]).unwrap();
        assert_eq!(t.inner_mut().calls, [2, 1]);
        assert_eq!(d[0].as_ref().unwrap().len(), 3);
        assert_eq!(t.cache().stats(), CacheStats { hits: 2, misses: 3 });
        // A missing file fails only its item and is not cached.
        let r = t
            .tag_images(&[dir.path().join("missing.png"), a.clone()])
            .unwrap();
        assert!(r[0].is_err() && r[1].is_ok());
        t.save().unwrap();

        // Reloaded: hits without calling the model; other settings miss.
        let mut t2 =
            CachedTagger::persisted(WordTagger { calls: vec![] }, file.clone(), 10, &settings)
                .unwrap();
        assert_eq!(t2.cache().len(), 2);
        t2.tag_images(std::slice::from_ref(&a)).unwrap();
        assert!(t2.inner_mut().calls.is_empty());
        let mut t3 = CachedTagger::persisted(
            WordTagger { calls: vec![] },
            file,
            10,
            &("thresholds", 0.5f32),
        )
        .unwrap();
        t3.tag_images(&[a]).unwrap();
        assert_eq!(t3.inner_mut().calls, [1]);
        // A corrupt cache file is named.
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{").unwrap();
        let e = TagCache::load(&bad, 4).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("delete it"), "{e}");
    }
}
