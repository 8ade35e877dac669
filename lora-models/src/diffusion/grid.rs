//! Sample images to PNG: decoded images in [−1, 1] → 8-bit RGB, tiled in a grid.

use std::path::Path;

use image::{Rgb, RgbImage};
use tch::{Kind, Tensor};

use crate::error::{Error, Result};

/// `[N, 3, H, W]` images in [−1, 1] (any float dtype/device) → `N` RGB images, mapped as
/// diffusers' `VaeImageProcessor.postprocess` + `numpy_to_pil` do:
/// `round(clamp(x/2 + 0.5, 0, 1) · 255)`.
///
/// # Errors
/// [`Error::InvalidArgument`] for another shape; [`Error::Torch`].
pub fn to_rgb_images(images: &Tensor) -> Result<Vec<RgbImage>> {
    let s = images.size();
    if s.len() != 4 || s[1] != 3 || s[2] == 0 || s[3] == 0 {
        return Err(Error::InvalidArgument(format!(
            "images must be [N, 3, H, W] with H, W ≥ 1, got {s:?}"
        )));
    }
    let (n, h, w) = (s[0], s[2] as u32, s[3] as u32);
    let u8s = images
        .f_to_kind(Kind::Float)?
        .f_div_scalar(2.0)?
        .f_add_scalar(0.5)?
        .f_clamp(0.0, 1.0)?
        .f_mul_scalar(255.0)?
        .f_round()?
        .f_to_kind(Kind::Uint8)?
        .f_to_device(tch::Device::Cpu)?
        .f_permute([0, 2, 3, 1])?
        .f_contiguous()?;
    let mut out = Vec::with_capacity(n as usize);
    for i in 0..n {
        let data = Vec::<u8>::try_from(&u8s.f_get(i)?.f_reshape([-1])?)?;
        let img = RgbImage::from_raw(w, h, data).ok_or_else(|| {
            Error::InvalidArgument(format!("image {i}: buffer does not fit {w}×{h}"))
        })?;
        out.push(img);
    }
    Ok(out)
}

/// Tiles `[N, 3, H, W]` images in [−1, 1] row-major into a grid of `cols` columns
/// (`ceil(N / cols)` rows; unused cells black) and returns it.
///
/// # Errors
/// As [`to_rgb_images`]; [`Error::InvalidArgument`] for `cols == 0` or `N == 0`.
pub fn make_grid(images: &Tensor, cols: usize) -> Result<RgbImage> {
    let imgs = to_rgb_images(images)?;
    if cols == 0 || imgs.is_empty() {
        return Err(Error::InvalidArgument(format!(
            "a grid needs ≥ 1 image and ≥ 1 column, got {} images and {cols} columns",
            imgs.len()
        )));
    }
    let (w, h) = imgs[0].dimensions();
    let rows = imgs.len().div_ceil(cols) as u32;
    let mut grid = RgbImage::from_pixel(w * cols as u32, h * rows, Rgb([0, 0, 0]));
    for (k, img) in imgs.iter().enumerate() {
        let (cx, cy) = ((k % cols) as u32 * w, (k / cols) as u32 * h);
        for (x, y, p) in img.enumerate_pixels() {
            grid.put_pixel(cx + x, cy + y, *p);
        }
    }
    Ok(grid)
}

/// [`make_grid`] written as a PNG file.
///
/// # Errors
/// As [`make_grid`]; [`Error::Io`] when the file cannot be written.
pub fn save_grid(images: &Tensor, cols: usize, path: impl AsRef<Path>) -> Result<()> {
    let path = path.as_ref();
    let grid = make_grid(images, cols)?;
    grid.save_with_format(path, image::ImageFormat::Png)
        .map_err(|e| Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })
}
