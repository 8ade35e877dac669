//! A fast separable bilinear ("triangle") resize of 8-bit RGB images, antialiased when shrinking.
//!
//! The algorithm is the standard convolution-based resampling used by Pillow
//! (`libImaging/Resample.c`, `ImagingResample` with `BILINEAR`): for each output coordinate `x`,
//! `center = (x + 0.5) · in/out`, filter support `1 · max(in/out, 1)`, taps
//! `[⌊center − support + 0.5⌋, ⌊center + support + 0.5⌋)` clamped to the image, weights
//! `tri((i − center + 0.5) / max(in/out, 1))` with `tri(t) = max(0, 1 − |t|)`, normalized, then
//! stored as fixed point with 22 fractional bits; the horizontal pass runs first and each pass rounds
//! and clamps to 8 bits. Following the same steps gives the same pixels as Pillow's bilinear resize,
//! so images match what Python pipelines produce.

use ::image::RgbImage;

const PRECISION_BITS: u32 = 32 - 8 - 2;

struct Taps {
    start: Vec<usize>,
    len: Vec<usize>,
    /// `out × kmax` fixed-point weights.
    weights: Vec<i32>,
    kmax: usize,
}

fn taps(in_size: u32, out_size: u32) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // triangle support 1
    let kmax = (support.ceil() as usize) * 2 + 1;
    let mut t = Taps {
        start: Vec::with_capacity(out_size as usize),
        len: Vec::with_capacity(out_size as usize),
        weights: vec![0; out_size as usize * kmax],
        kmax,
    };
    let ss = 1.0 / filterscale;
    let mut k = vec![0f64; kmax];
    for x in 0..out_size as usize {
        let center = (x as f64 + 0.5) * scale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize;
        let n = xmax.saturating_sub(xmin).min(kmax);
        let mut ww = 0.0;
        for (i, kv) in k.iter_mut().enumerate().take(n) {
            let arg = (i as f64 + xmin as f64 - center + 0.5) * ss;
            let w = (1.0 - arg.abs()).max(0.0);
            *kv = w;
            ww += w;
        }
        let row = &mut t.weights[x * kmax..x * kmax + kmax];
        for i in 0..n {
            let w = if ww != 0.0 { k[i] / ww } else { 0.0 };
            let f = w * (1u32 << PRECISION_BITS) as f64;
            row[i] = if f < 0.0 {
                (f - 0.5) as i32
            } else {
                (f + 0.5) as i32
            };
        }
        t.start.push(xmin);
        t.len.push(n);
    }
    t
}

#[inline]
fn clip8(v: i64) -> u8 {
    let v = v >> PRECISION_BITS;
    v.clamp(0, 255) as u8
}

/// Resizes `src` to `width × height` with Pillow-compatible bilinear filtering.
pub fn resize_bilinear(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    let (iw, ih) = src.dimensions();
    if (iw, ih) == (width, height) || width == 0 || height == 0 || iw == 0 || ih == 0 {
        return if (iw, ih) == (width, height) {
            src.clone()
        } else {
            RgbImage::new(width, height)
        };
    }
    let half = 1i64 << (PRECISION_BITS - 1);
    // Horizontal pass: iw × ih → width × ih.
    let horiz: Vec<u8> = if iw == width {
        src.as_raw().clone()
    } else {
        let t = taps(iw, width);
        let input = src.as_raw();
        let mut out = vec![0u8; width as usize * ih as usize * 3];
        for y in 0..ih as usize {
            let row = &input[y * iw as usize * 3..(y + 1) * iw as usize * 3];
            let orow = &mut out[y * width as usize * 3..(y + 1) * width as usize * 3];
            for x in 0..width as usize {
                let (s, n) = (t.start[x], t.len[x]);
                let w = &t.weights[x * t.kmax..x * t.kmax + n];
                let (mut r, mut g, mut b) = (half, half, half);
                for (i, &wi) in w.iter().enumerate() {
                    let p = (s + i) * 3;
                    let wi = wi as i64;
                    r += row[p] as i64 * wi;
                    g += row[p + 1] as i64 * wi;
                    b += row[p + 2] as i64 * wi;
                }
                orow[x * 3] = clip8(r);
                orow[x * 3 + 1] = clip8(g);
                orow[x * 3 + 2] = clip8(b);
            }
        }
        out
    };
    if ih == height {
        return RgbImage::from_raw(width, height, horiz)
            .unwrap_or_else(|| RgbImage::new(width, height));
    }
    // Vertical pass: width × ih → width × height.
    let t = taps(ih, height);
    let stride = width as usize * 3;
    let mut out = vec![0u8; stride * height as usize];
    let mut acc = vec![0i64; stride];
    for y in 0..height as usize {
        let (s, n) = (t.start[y], t.len[y]);
        let w = &t.weights[y * t.kmax..y * t.kmax + n];
        acc.fill(half);
        for (i, &wi) in w.iter().enumerate() {
            let row = &horiz[(s + i) * stride..(s + i + 1) * stride];
            let wi = wi as i64;
            for (a, &p) in acc.iter_mut().zip(row) {
                *a += p as i64 * wi;
            }
        }
        for (o, &a) in out[y * stride..(y + 1) * stride].iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    RgbImage::from_raw(width, height, out).unwrap_or_else(|| RgbImage::new(width, height))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::image::Rgb;

    #[test]
    fn constant_images_stay_constant_and_sizes_are_exact() {
        let img = RgbImage::from_pixel(37, 23, Rgb([10, 200, 77]));
        for (w, h) in [(16, 10), (80, 50), (37, 7), (5, 23)] {
            let out = resize_bilinear(&img, w, h);
            assert_eq!(out.dimensions(), (w, h));
            assert!(out.pixels().all(|p| p.0 == [10, 200, 77]));
        }
    }

    #[test]
    fn downscale_by_two_averages_neighbours() {
        // a 4x1 row 0, 100, 200, 250 → 2 pixels; triangle over support 2 centered at 1.0 and 3.0:
        // taps (0..3) weights (0.25, 0.5, 0.25)·… normalized over the clamped window
        let img = RgbImage::from_fn(4, 1, |x, _| {
            let v = [0u8, 100, 200, 250][x as usize];
            Rgb([v, v, v])
        });
        let out = resize_bilinear(&img, 2, 1);
        // x=0: center 1.0, taps 0..3 (xmin = 0, xmax = 3), weights tri((i−0.5)/2): 0.75, 0.75, 0.25
        // → (0·.75 + 100·.75 + 200·.25)/1.75 = 71.43 → 71
        assert_eq!(out.get_pixel(0, 0).0[0], 71);
        // x=1: center 3.0, taps 1..4, weights 0.25, 0.75, 0.75 → (25 + 150 + 187.5)/1.75 = 207.1
        assert_eq!(out.get_pixel(1, 0).0[0], 207);
    }
}
