//! Image preprocessing presets: WD14 and ImageNet.
//!
//! Both start from [`load_rgb`]: the file is decoded by the `image` crate (PNG, JPEG, WebP, TIFF,
//! BMP, GIF) and any alpha channel is composited over white, as the WD14 taggers do before
//! anything else (SmilingWolf's `wd-tagger` `app.py`, `prepare_image`; kohya-ss
//! `finetune/tag_images_by_wd14_tagger.py`, `preprocess_image`).
//!
//! - [`wd14`]: pad to a square on white (image centered, left/top offset `(side − w) / 2`
//!   rounded down), resize to `size`×`size` with PIL's `Image.BICUBIC` reproduced bit for bit
//!   ([`resize_bicubic_pil`]; `app.py` resizes with it, skipping the resize when the square is
//!   already `size`), channels in **BGR** order, values as float 0–255 (no normalisation). kohya's
//!   script resizes with OpenCV's area filter (Lanczos when enlarging) instead: its pixels differ
//!   by a few levels, its tags rarely.
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

impl std::fmt::Display for Preprocess {
    /// `WD14 preprocessing at 448²` / `ImageNet preprocessing at 224²`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Preprocess::Wd14 { size } => write!(f, "WD14 preprocessing at {size}²"),
            Preprocess::Imagenet { size } => write!(f, "ImageNet preprocessing at {size}²"),
        }
    }
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
        resize_bicubic_pil(&square, size, size)
    };
    let mut out = Vec::with_capacity((size * size * 3) as usize);
    for p in resized.pixels() {
        out.extend_from_slice(&[p[2] as f32, p[1] as f32, p[0] as f32]);
    }
    out
}

/// Fixed-point bits of PIL's 8-bit resampling coefficients (`PRECISION_BITS` in Pillow's
/// `libImaging/Resample.c`: 32 − 8 − 2).
const PIL_PRECISION_BITS: u32 = 22;

/// PIL's bicubic kernel (`bicubic_filter`, a = −0.5), support 2.
fn pil_bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// One axis of PIL's resampling: for each output index its first input index, the number of
/// inputs, and fixed-point weights (`precompute_coeffs` then `normalize_coeffs_8bpc`).
fn pil_coeffs(in_size: u32, out_size: u32) -> Vec<(usize, Vec<i32>)> {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ss = 1.0 / filterscale;
    (0..out_size)
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            // C's `(int)` truncates toward zero; negative starts are clamped to 0 anyway.
            let xmin = ((center - support + 0.5) as i64).max(0);
            let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
            let w: Vec<f64> = (xmin..xmax)
                .map(|x| pil_bicubic((x as f64 - center + 0.5) * ss))
                .collect();
            let total: f64 = w.iter().sum();
            let k = w
                .iter()
                .map(|&v| {
                    let v = if total != 0.0 { v / total } else { v };
                    let f = v * (1u32 << PIL_PRECISION_BITS) as f64;
                    if v < 0.0 {
                        (f - 0.5) as i32
                    } else {
                        (f + 0.5) as i32
                    }
                })
                .collect();
            (xmin as usize, k)
        })
        .collect()
}

/// PIL's 8-bit rounding and clipping of a fixed-point sum (`clip8`).
fn pil_clip8(acc: i32) -> u8 {
    (acc >> PIL_PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes like Pillow's `Image.resize((width, height), Image.BICUBIC)` on an RGB image, bit for
/// bit: Pillow's two-pass separable resampling (`libImaging/Resample.c`,
/// `ImagingResampleInner`): kernel support scaled by the downscale factor, weights normalised
/// then rounded to 22-bit fixed point, a horizontal pass over the rows the vertical pass needs
/// (rounded and clipped to 8 bits), then the vertical pass. The WD14 taggers' reference
/// preprocessing resizes with it.
pub fn resize_bicubic_pil(img: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (w, h) = (img.width(), img.height());
    if w == 0 || h == 0 || width == 0 || height == 0 {
        return RgbImage::new(width, height);
    }
    let horiz = pil_coeffs(w, width);
    let vert = pil_coeffs(h, height);
    let need_h = width != w;
    let need_v = height != h;
    // Rows of the source the vertical pass reads.
    let (y_first, y_last) = if need_v {
        let first = vert[0].0;
        let last = vert.last().map(|(s, k)| s + k.len()).unwrap_or(h as usize);
        (first, last)
    } else {
        (0, h as usize)
    };
    let half = 1i32 << (PIL_PRECISION_BITS - 1);
    let src = img.as_raw();
    let (tmp, tmp_w, tmp_row0) = if need_h {
        let rows = y_last - y_first;
        let mut out = vec![0u8; rows * width as usize * 3];
        for yy in 0..rows {
            let row = &src[(yy + y_first) * w as usize * 3..(yy + y_first + 1) * w as usize * 3];
            for (xx, (xmin, k)) in horiz.iter().enumerate() {
                let mut acc = [half; 3];
                for (i, &kv) in k.iter().enumerate() {
                    let p = &row[(xmin + i) * 3..(xmin + i) * 3 + 3];
                    for c in 0..3 {
                        acc[c] += p[c] as i32 * kv;
                    }
                }
                let o = (yy * width as usize + xx) * 3;
                for c in 0..3 {
                    out[o + c] = pil_clip8(acc[c]);
                }
            }
        }
        (out, width as usize, y_first)
    } else {
        (src.to_vec(), w as usize, 0)
    };
    if !need_v {
        return RgbImage::from_raw(width, height, tmp)
            .unwrap_or_else(|| RgbImage::new(width, height));
    }
    let mut out = vec![0u8; height as usize * tmp_w * 3];
    for (yy, (ymin, k)) in vert.iter().enumerate() {
        for xx in 0..tmp_w {
            let mut acc = [half; 3];
            for (i, &kv) in k.iter().enumerate() {
                let o = ((ymin - tmp_row0 + i) * tmp_w + xx) * 3;
                for c in 0..3 {
                    acc[c] += tmp[o + c] as i32 * kv;
                }
            }
            let o = (yy * tmp_w + xx) * 3;
            for c in 0..3 {
                out[o + c] = pil_clip8(acc[c]);
            }
        }
    }
    RgbImage::from_raw(width, height, out).unwrap_or_else(|| RgbImage::new(width, height))
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
