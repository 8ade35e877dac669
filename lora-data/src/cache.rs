//! A latent cache on disk, keyed by the image's content and every preprocessing parameter.
//!
//! The key is `sha256` of the image *file bytes* (not its path or mtime, so a re-saved or edited
//! image misses the cache, and a moved one still hits) together with the bucket, the crop offset,
//! the flip flag and the id of the model that encoded it (e.g. `"sd15-vae@<sha256 of weights>"`).
//! Changing any of them gives another key: stale latents are never returned. With `random_crop` or
//! `flip_aug` every variant is its own entry (kohya instead refuses to cache latents with
//! `random_crop`).
//!
//! File format (`<dir>/<first 2 hex>/<sha256 key>.latent`): 8 bytes `LORALAT1`, a little-endian
//! `u32` header length, a JSON header (the key's fields, `shape`, `dtype: "f32"`), then the values
//! as little-endian `f32`. Writes go to a temporary file in the same folder that is renamed into
//! place, so a crash never leaves a half-written entry.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

const MAGIC: &[u8; 8] = b"LORALAT1";

/// Everything the cached latents depend on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheKey {
    /// sha256 of the image file bytes, hex.
    pub content_sha256: String,
    /// Bucket `(width, height)` in pixels.
    pub bucket: (u32, u32),
    /// Crop offset `(x, y)` in the resized image.
    pub crop: (u32, u32),
    /// Flipped horizontally.
    pub flip: bool,
    /// The encoder (model id and version/hash).
    pub model_id: String,
}

/// sha256 of a file's bytes, hex.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read.
pub fn content_sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).map_err(Error::io(path))?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

impl CacheKey {
    /// The key of `image` (hashing its bytes) with the given preprocessing.
    ///
    /// # Errors
    /// [`Error::Io`] when the image cannot be read.
    pub fn for_file(
        image: &Path,
        bucket: (u32, u32),
        crop: (u32, u32),
        flip: bool,
        model_id: &str,
    ) -> Result<Self> {
        Ok(CacheKey {
            content_sha256: content_sha256(image)?,
            bucket,
            crop,
            flip,
            model_id: model_id.to_string(),
        })
    }

    /// The key digest: sha256 over a canonical text of every field, hex.
    pub fn digest(&self) -> String {
        let canonical = format!(
            "lora-data latent cache v1\ncontent={}\nbucket={}x{}\ncrop={},{}\nflip={}\nmodel={}",
            self.content_sha256,
            self.bucket.0,
            self.bucket.1,
            self.crop.0,
            self.crop.1,
            self.flip,
            self.model_id
        );
        hex::encode(Sha256::digest(canonical.as_bytes()))
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    digest: String,
    key: CacheKey,
    shape: Vec<i64>,
    dtype: String,
}

/// Latents on disk. See the module docs.
#[derive(Debug, Clone)]
pub struct LatentCache {
    dir: PathBuf,
}

impl LatentCache {
    /// A cache in `dir` (created if missing).
    ///
    /// # Errors
    /// [`Error::Write`] when the folder cannot be created.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(|source| Error::Write {
            path: dir.clone(),
            source,
        })?;
        Ok(LatentCache { dir })
    }

    /// The file of `key`.
    pub fn path_for(&self, key: &CacheKey) -> PathBuf {
        let d = key.digest();
        self.dir.join(&d[..2]).join(format!("{d}.latent"))
    }

    /// The cached latents of `key` (`Kind::Float`, CPU), or `None` when absent, written for another
    /// key, or damaged (the caller encodes again and [`LatentCache::put`]s).
    ///
    /// # Errors
    /// [`Error::Io`] when the entry exists but cannot be read; [`Error::Tensor`].
    pub fn get(&self, key: &CacheKey) -> Result<Option<Tensor>> {
        let path = self.path_for(key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::Io { path, source: e }),
        };
        let Some((header, data)) = parse(&bytes) else {
            return Ok(None);
        };
        if header.digest != key.digest() || &header.key != key || header.dtype != "f32" {
            return Ok(None);
        }
        let n: i64 = header.shape.iter().product();
        if n < 0 || data.len() != n as usize * 4 {
            return Ok(None);
        }
        let values: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        let t = Tensor::f_from_slice(&values)
            .and_then(|t| t.f_view(header.shape.as_slice()))
            .map_err(Error::tensor("reading cached latents"))?;
        Ok(Some(t))
    }

    /// Stores `latents` (any float kind or device; stored as f32) under `key`, atomically.
    ///
    /// # Errors
    /// [`Error::Write`] on I/O failure, [`Error::Tensor`].
    pub fn put(&self, key: &CacheKey, latents: &Tensor) -> Result<()> {
        let path = self.path_for(key);
        let ctx = "storing latents";
        let t = latents
            .f_to_kind(Kind::Float)
            .and_then(|t| t.f_to_device(Device::Cpu))
            .and_then(|t| t.f_contiguous())
            .map_err(Error::tensor(ctx))?;
        let shape = t.size();
        let flat = t.f_flatten(0, -1).map_err(Error::tensor(ctx))?;
        let values = Vec::<f32>::try_from(&flat).map_err(Error::tensor(ctx))?;
        let header = Header {
            digest: key.digest(),
            key: key.clone(),
            shape,
            dtype: "f32".into(),
        };
        let json = serde_json::to_vec(&header).map_err(|e| Error::Write {
            path: path.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut buf = Vec::with_capacity(12 + json.len() + values.len() * 4);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&(json.len() as u32).to_le_bytes());
        buf.extend_from_slice(&json);
        for v in values {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        let werr = |p: &Path| {
            let p = p.to_path_buf();
            move |source| Error::Write { path: p, source }
        };
        let parent = path.parent().unwrap_or(&self.dir).to_path_buf();
        std::fs::create_dir_all(&parent).map_err(werr(&parent))?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp = parent.join(format!(
            ".{}.{}.{nanos}.tmp",
            header.digest,
            std::process::id()
        ));
        {
            let mut f = std::fs::File::create(&tmp).map_err(werr(&tmp))?;
            f.write_all(&buf).map_err(werr(&tmp))?;
            f.sync_all().map_err(werr(&tmp))?;
        }
        std::fs::rename(&tmp, &path).map_err(werr(&path))?;
        Ok(())
    }
}

fn parse(bytes: &[u8]) -> Option<(Header, &[u8])> {
    let rest = bytes.strip_prefix(MAGIC.as_slice())?;
    let len = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
    let json = rest.get(4..4 + len)?;
    let header: Header = serde_json::from_slice(json).ok()?;
    Some((header, rest.get(4 + len..)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn put_get_round_trip_and_invalidation() {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("a.png");
        std::fs::write(&img, b"pretend image bytes").unwrap();
        let cache = LatentCache::new(dir.path().join("cache")).unwrap();
        let key = CacheKey::for_file(&img, (64, 64), (0, 0), false, "vae-a").unwrap();
        assert!(cache.get(&key).unwrap().is_none());
        let lat = Tensor::arange(4 * 8 * 8, (Kind::Float, Device::Cpu)).view([4, 8, 8]) / 7.0;
        cache.put(&key, &lat).unwrap();
        let back = cache.get(&key).unwrap().unwrap();
        assert_eq!(back.size(), vec![4, 8, 8]);
        assert!(back.allclose(&lat, 0.0, 0.0, false));
        // every parameter is part of the key
        for other in [
            CacheKey {
                model_id: "vae-b".into(),
                ..key.clone()
            },
            CacheKey {
                flip: true,
                ..key.clone()
            },
            CacheKey {
                crop: (1, 0),
                ..key.clone()
            },
            CacheKey {
                bucket: (64, 128),
                ..key.clone()
            },
        ] {
            assert_ne!(other.digest(), key.digest());
            assert!(cache.get(&other).unwrap().is_none());
        }
        // new content → new key → miss
        std::fs::write(&img, b"edited image bytes").unwrap();
        let edited = CacheKey::for_file(&img, (64, 64), (0, 0), false, "vae-a").unwrap();
        assert!(cache.get(&edited).unwrap().is_none());
        // a damaged entry reads as a miss, never as wrong latents
        std::fs::write(cache.path_for(&key), b"LORALAT1garbage").unwrap();
        assert!(cache.get(&key).unwrap().is_none());
        // no temporary files left behind
        let leftovers = std::fs::read_dir(cache.path_for(&key).parent().unwrap())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .ends_with(".tmp")
            })
            .count();
        assert_eq!(leftovers, 0);
    }
}
