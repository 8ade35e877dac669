//! Image preprocessing presets: WD14 and ImageNet.
//!
//! Both start from [`load_rgb`]: the file is decoded by the `image` crate (PNG, JPEG, WebP, TIFF,
//! BMP, GIF) and any alpha channel is composited over white, as the WD14 taggers do before
//! anything else (SmilingWolf's `wd-tagger` `app.py`, `prepare_image`; kohya-ss
//! `finetune/tag_images_by_wd14_tagger.py`, `preprocess_image`).
//!
//! - [`wd14`]: pad to a square on white (image centered), resize to `size`×`size` with a bicubic
//!   filter (Catmull-Rom; PIL's `BICUBIC` in `app.py`), channels in **BGR** order, values as float
//!   0–255 (no normalisation).
//! - [`imagenet`]: resize the shorter side to `round(size · 256 / 224)` (256 for 224) with a
//!   bilinear filter, center crop `size`×`size` (top/left `round((h − size) / 2)`), **RGB**,
//!   `/255`, then `(x − mean) / std` with mean `[0.485, 0.456, 0.406]` and std
//!   `[0.229, 0.224, 0.225]` — torchvision's `ImageClassification` transform of
//!   `MobileNet_V2_Weights.IMAGENET1K_V1`.
//!
//! Both return one image as `[size, size, 3]` f32, row-major (HWC); the tagger stacks them and
//! permutes to the layout its backbone needs ([`Layout`]).

use std::path::Path;

use image::imageops::FilterType;
use image::{Rgb, RgbImage};

use crate::error::{Error, Result};

/// ImageNet channel means (RGB), torchvision.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet channel standard deviations (RGB), torchvision.
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// Memory layout of a batch of images.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// `[n, 3, h, w]` (PyTorch convolutions).
    Nchw,
    /// `[n, h, w, 3]` (the WD14 ONNX/Keras exports).
    Nhwc,
}

/// A preprocessing preset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preprocess {
    /// WD14: pad on white, bicubic resize, BGR, 0–255.
    Wd14 {
        /// Square side, pixels.
        size: u32,
    },
    /// ImageNet: resize short side, center crop, RGB, mean/std normalised.
    Imagenet {
        /// Crop side, pixels.
        size: u32,
    },
}

impl Preprocess {
    /// The square side the preset produces.
    pub fn size(&self) -> u32 {
        match *self {
            Preprocess::Wd14 { size } | Preprocess::Imagenet { size } => size,
        }
    }

    /// Loads `path` and applies the preset: `[size, size, 3]` f32, HWC.
    ///
    /// # Errors
    /// As [`load_rgb`].
    pub fn load(&self, path: &Path) -> Result<Vec<f32>> {
        let img = load_rgb(path)?;
        Ok(match *self {
            Preprocess::Wd14 { size } => wd14(&img, size),
            Preprocess::Imagenet { size } => imagenet(&img, size),
        })
    }
}

/// Decodes an image file to RGB 8-bit, compositing any alpha over white.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Image`] naming the file when it cannot be
/// decoded (unknown format, truncated or corrupt data).
pub fn load_rgb(path: &Path) -> Result<RgbImage> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    use lora_data::image::decode::{DecodeFailure, check_complete, classify};
    let failed = |f: DecodeFailure| Error::Image {
        path: path.to_path_buf(),
        msg: f.to_string(),
    };
    if bytes.is_empty() {
        return Err(failed(DecodeFailure::ZeroByte));
    }
    let reader = image::ImageReader::new(std::io::Cursor::new(&bytes))
        .with_guessed_format()
        .map_err(|e| failed(DecodeFailure::Io(e.to_string())))?;
    // the training side's checks and wording: a cut file decodes with blank rows otherwise
    let Some(format) = reader.format() else {
        return Err(failed(DecodeFailure::Corrupt(
            "the bytes match no known image format".into(),
        )));
    };
    check_complete(&bytes, format).map_err(failed)?;
    let img = reader.decode().map_err(|e| failed(classify(e)))?;
    if !img.color().has_alpha() {
        return Ok(img.to_rgb8());
    }
    let rgba = img.to_rgba8();
    let mut out = RgbImage::new(rgba.width(), rgba.height());
    for (o, p) in out.pixels_mut().zip(rgba.pixels()) {
        let a = p[3] as f32 / 255.0;
        let mix = |c: u8| (c as f32 * a + 255.0 * (1.0 - a)).round().clamp(0.0, 255.0) as u8;
        *o = Rgb([mix(p[0]), mix(p[1]), mix(p[2])]);
    }
    Ok(out)
}

/// WD14 preprocessing of a decoded image (see the module docs): `[size, size, 3]` BGR f32 0–255.
pub fn wd14(img: &RgbImage, size: u32) -> Vec<f32> {
    let side = img.width().max(img.height());
    let mut square = RgbImage::from_pixel(side, side, Rgb([255, 255, 255]));
    let left = (side - img.width()) / 2;
    let top = (side - img.height()) / 2;
    image::imageops::replace(&mut square, img, left as i64, top as i64);
    let resized = if side == size {
        square
    } else {
        image::imageops::resize(&square, size, size, FilterType::CatmullRom)
    };
    let mut out = Vec::with_capacity((size * size * 3) as usize);
    for p in resized.pixels() {
        out.extend_from_slice(&[p[2] as f32, p[1] as f32, p[0] as f32]);
    }
    out
}

/// ImageNet preprocessing of a decoded image (see the module docs): `[size, size, 3]` RGB f32,
/// normalised.
pub fn imagenet(img: &RgbImage, size: u32) -> Vec<f32> {
    let short_target = ((size as f64) * 256.0 / 224.0).round() as u32;
    let (w, h) = (img.width().max(1), img.height().max(1));
    // torchvision: the short side becomes `short_target`, the long side int(target · long / short).
    let (nw, nh) = if w <= h {
        (
            short_target,
            ((short_target as u64 * h as u64) / w as u64) as u32,
        )
    } else {
        (
            ((short_target as u64 * w as u64) / h as u64) as u32,
            short_target,
        )
    };
    let resized = image::imageops::resize(img, nw.max(size), nh.max(size), FilterType::Triangle);
    let left = ((resized.width() - size) as f64 / 2.0).round() as u32;
    let top = ((resized.height() - size) as f64 / 2.0).round() as u32;
    let mut out = Vec::with_capacity((size * size * 3) as usize);
    for y in 0..size {
        for x in 0..size {
            let p = resized.get_pixel(left + x, top + y);
            for c in 0..3 {
                out.push((p[c] as f32 / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wd14_pads_on_white_and_swaps_to_bgr() {
        // A 4×2 pure red image: padded to 4×4 with white rows above and below.
        let img = RgbImage::from_pixel(4, 2, Rgb([255, 0, 0]));
        let x = wd14(&img, 4);
        assert_eq!(x.len(), 4 * 4 * 3);
        assert_eq!(&x[0..3], &[255.0, 255.0, 255.0], "top row is white padding");
        let row1 = 4 * 3;
        assert_eq!(&x[row1..row1 + 3], &[0.0, 0.0, 255.0], "red in BGR order");
        assert_eq!(&x[3 * 4 * 3..3 * 4 * 3 + 3], &[255.0, 255.0, 255.0]);
    }

    #[test]
    fn imagenet_normalises_and_crops_the_center() {
        // Left half black, right half white, 300×200 → short side 256 → 384×256 → crop 224.
        let mut img = RgbImage::new(300, 200);
        for (x, _, p) in img.enumerate_pixels_mut() {
            *p = if x < 150 {
                Rgb([0, 0, 0])
            } else {
                Rgb([255, 255, 255])
            };
        }
        let x = imagenet(&img, 224);
        assert_eq!(x.len(), 224 * 224 * 3);
        let black_r = (0.0 - IMAGENET_MEAN[0]) / IMAGENET_STD[0];
        let white_b = (1.0 - IMAGENET_MEAN[2]) / IMAGENET_STD[2];
        assert!((x[0] - black_r).abs() < 1e-6, "{}", x[0]);
        let last = (223 * 224 + 223) * 3;
        assert!((x[last + 2] - white_b).abs() < 1e-6, "{}", x[last + 2]);
    }

    #[test]
    fn alpha_is_composited_on_white_and_bad_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("half.png");
        let img = image::RgbaImage::from_pixel(2, 2, image::Rgba([0, 0, 0, 128]));
        img.save(&p).unwrap();
        let rgb = load_rgb(&p).unwrap();
        assert_eq!(rgb.get_pixel(0, 0)[0], 127);
        let bad = dir.path().join("broken.jpg");
        std::fs::write(&bad, b"\xff\xd8\xff\xe0 not really a jpeg").unwrap();
        let e = load_rgb(&bad).unwrap_err();
        assert!(
            matches!(e, Error::Image { .. }) && e.to_string().contains("broken.jpg"),
            "{e}"
        );
    }
}
