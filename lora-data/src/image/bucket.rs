//! Aspect-ratio bucketing.
//!
//! Bucket resolutions follow kohya sd-scripts `library/model_util.py::make_bucket_resolutions`:
//! the square `floor(sqrt(max_area) / step) * step`, plus for every width `w` from `min_bucket_reso`
//! to `max_bucket_reso` in `bucket_reso_steps`: `h = min(max_bucket_reso, floor(max_area / w / step) *
//! step)`, kept when `h ≥ min_bucket_reso`, with `(w, h)` and `(h, w)` both added; `max_area =
//! width × height` of `resolution`.
//!
//! An image goes to the bucket whose aspect ratio is nearest in log space (`|ln(w/h) − ln(bw/bh)|`,
//! so 2:1 and 1:2 are equally far from 1:1; kohya compares `w/h` linearly), ties to the larger
//! bucket. It is resized to *cover* the bucket (scale `max(bw/w, bh/h)`) and cropped to it, centered
//! or at a random offset (`random_crop`).

use crate::rng::Rng;
use crate::{Error, Result};

/// Bucket settings (kohya names and defaults, except `enable_bucket` which defaults to `true`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketConfig {
    /// Training resolution `(width, height)` in pixels; max bucket area = width × height.
    /// Default 512 × 512.
    pub resolution: (u32, u32),
    /// Use aspect buckets; `false` = every image is resized and cropped to `resolution`.
    pub enable_bucket: bool,
    /// Smallest bucket side in pixels. Default 256.
    pub min_bucket_reso: u32,
    /// Largest bucket side in pixels. Default 1024.
    pub max_bucket_reso: u32,
    /// Bucket sides are multiples of this (64 for SD: VAE factor 8 × UNet factor 8). Default 64.
    pub bucket_reso_steps: u32,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            resolution: (512, 512),
            enable_bucket: true,
            min_bucket_reso: 256,
            max_bucket_reso: 1024,
            bucket_reso_steps: 64,
        }
    }
}

/// Where an image lands: its bucket and the cover-resize + crop that fills it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Placement {
    /// Bucket `(width, height)`.
    pub bucket: (u32, u32),
    /// Size after the cover resize `(width, height)`, each ≥ the bucket's.
    pub resized: (u32, u32),
    /// Top-left of the crop inside the resized image `(x, y)`.
    pub crop: (u32, u32),
    /// Resize factor (> 1 = upscaling).
    pub scale: f64,
}

impl BucketConfig {
    /// Checks the settings.
    ///
    /// # Errors
    /// [`Error::Config`] naming the key when a value is 0, `min > max`, or the resolution is
    /// outside `[min, max]` with bucketing on.
    pub fn check(&self) -> Result<()> {
        let (w, h) = self.resolution;
        if w == 0 || h == 0 {
            return Err(Error::config(
                "resolution",
                format!("{w}x{h}"),
                "width and height must be positive, e.g. 512 or [768, 512]",
            ));
        }
        if !self.enable_bucket {
            return Ok(());
        }
        if self.bucket_reso_steps == 0 {
            return Err(Error::config(
                "bucket_reso_steps",
                0,
                "must be positive (64 for SD)",
            ));
        }
        if self.min_bucket_reso == 0 || self.min_bucket_reso > self.max_bucket_reso {
            return Err(Error::config(
                "min_bucket_reso",
                self.min_bucket_reso,
                format!(
                    "must be positive and at most max_bucket_reso ({})",
                    self.max_bucket_reso
                ),
            ));
        }
        Ok(())
    }

    /// All bucket resolutions, sorted.
    ///
    /// # Errors
    /// As [`BucketConfig::check`].
    pub fn buckets(&self) -> Result<Vec<(u32, u32)>> {
        self.check()?;
        if !self.enable_bucket {
            return Ok(vec![self.resolution]);
        }
        let step = self.bucket_reso_steps as u64;
        let max_area = self.resolution.0 as u64 * self.resolution.1 as u64;
        let (lo, hi) = (self.min_bucket_reso as u64, self.max_bucket_reso as u64);
        let mut set = std::collections::BTreeSet::new();
        let side = ((max_area as f64).sqrt() as u64 / step) * step;
        if side > 0 {
            set.insert((side as u32, side as u32));
        }
        let mut w = lo;
        while w <= hi {
            let h = hi.min((max_area / w / step) * step);
            if h >= lo {
                set.insert((w as u32, h as u32));
                set.insert((h as u32, w as u32));
            }
            w += step;
        }
        if set.is_empty() {
            return Err(Error::config(
                "min_bucket_reso",
                self.min_bucket_reso,
                format!(
                    "no bucket fits: resolution {}×{} with bucket_reso_steps {}, min_bucket_reso {lo} and max_bucket_reso {hi}; set min_bucket_reso and bucket_reso_steps at or below the resolution's side, or enable_bucket: false",
                    self.resolution.0, self.resolution.1, self.bucket_reso_steps
                ),
            ));
        }
        Ok(set.into_iter().collect())
    }
}

/// The bucket of an image of `size` `(width, height)` among `buckets`, with the aspect error
/// `ln(w/h) − ln(bw/bh)`. `buckets` must not be empty (returns `None` then).
pub fn select_bucket(buckets: &[(u32, u32)], size: (u32, u32)) -> Option<((u32, u32), f64)> {
    let ar = (size.0.max(1) as f64 / size.1.max(1) as f64).ln();
    let mut best: Option<((u32, u32), f64)> = None;
    for &b in buckets {
        let err = ar - (b.0 as f64 / b.1 as f64).ln();
        best = match best {
            None => Some((b, err)),
            Some((bb, be)) => {
                let closer = err.abs() < be.abs() - 1e-12;
                let tie_bigger = (err.abs() - be.abs()).abs() <= 1e-12
                    && (b.0 as u64 * b.1 as u64) > (bb.0 as u64 * bb.1 as u64);
                if closer || tie_bigger {
                    Some((b, err))
                } else {
                    Some((bb, be))
                }
            }
        };
    }
    best
}

/// The cover resize and crop of an image of `size` into `bucket`; a random crop offset when `rng`
/// is given, else centered.
pub fn place(size: (u32, u32), bucket: (u32, u32), rng: Option<&mut Rng>) -> Placement {
    let (w, h) = (size.0.max(1) as f64, size.1.max(1) as f64);
    let scale = (bucket.0 as f64 / w).max(bucket.1 as f64 / h);
    let rw = ((w * scale).round() as u32).max(bucket.0);
    let rh = ((h * scale).round() as u32).max(bucket.1);
    let (sx, sy) = (rw - bucket.0, rh - bucket.1);
    let crop = match rng {
        Some(r) => (
            r.below(sx as usize + 1) as u32,
            r.below(sy as usize + 1) as u32,
        ),
        None => (sx / 2, sy / 2),
    };
    Placement {
        bucket,
        resized: (rw, rh),
        crop,
        scale,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sd_buckets_match_kohya_at_512() {
        let b = BucketConfig::default().buckets().unwrap();
        // kohya make_bucket_resolutions((512, 512), 256, 1024, 64)
        for want in [
            (512, 512),
            (256, 1024),
            (1024, 256),
            (320, 768),
            (384, 640),
            (448, 576),
        ] {
            assert!(b.contains(&want), "{want:?} missing from {b:?}");
        }
        assert!(b.iter().all(|&(w, h)| w * h <= 512 * 512));
        assert!(b.iter().all(|&(w, h)| w % 64 == 0 && h % 64 == 0));
        assert_eq!(b.len(), 17);
        assert!(b.contains(&(704, 320)) && b.contains(&(256, 960)));
    }

    #[test]
    fn nearest_aspect_in_log_space() {
        let b = BucketConfig::default().buckets().unwrap();
        assert_eq!(select_bucket(&b, (1000, 1000)).unwrap().0, (512, 512));
        assert_eq!(select_bucket(&b, (1920, 1080)).unwrap().0, (640, 384));
        assert_eq!(select_bucket(&b, (1080, 1920)).unwrap().0, (384, 640));
        assert_eq!(select_bucket(&b, (4000, 100)).unwrap().0, (1024, 256));
    }

    #[test]
    fn cover_then_crop() {
        let p = place((1920, 1080), (640, 384), None);
        assert!(p.resized.0 >= 640 && p.resized.1 >= 384);
        assert_eq!(p.resized, (683, 384));
        assert_eq!(p.crop, (21, 0));
        let mut rng = Rng::new(5);
        for _ in 0..50 {
            let p = place((1920, 1080), (640, 384), Some(&mut rng));
            assert!(p.crop.0 <= 43 && p.crop.1 == 0);
        }
        assert!(place((64, 64), (512, 512), None).scale > 7.9);
    }

    #[test]
    fn bad_settings_name_the_key() {
        let c = BucketConfig {
            min_bucket_reso: 2048,
            ..BucketConfig::default()
        };
        assert!(
            matches!(c.buckets(), Err(Error::Config { ref key, .. }) if key == "min_bucket_reso")
        );
        let c = BucketConfig {
            enable_bucket: false,
            resolution: (768, 512),
            ..BucketConfig::default()
        };
        assert_eq!(c.buckets().unwrap(), vec![(768, 512)]);
    }
}
