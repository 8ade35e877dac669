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
    /// `count × kmax` fixed-point weights.
    weights: Vec<i32>,
    kmax: usize,
}

impl Taps {
    /// Input index of the first tap and the weights of output position `i` (from `first`).
    #[inline]
    fn get(&self, i: usize) -> (usize, &[i32]) {
        let w = &self.weights[i * self.kmax..i * self.kmax + self.len[i]];
        (self.start[i], w)
    }
}

/// Taps of output positions `first..first + count` of an `in_size → out_size` resample.
fn taps(in_size: u32, out_size: u32, first: u32, count: u32) -> Taps {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = filterscale; // triangle support 1
    let kmax = (support.ceil() as usize) * 2 + 1;
    let mut t = Taps {
        start: Vec::with_capacity(count as usize),
        len: Vec::with_capacity(count as usize),
        weights: vec![0; count as usize * kmax],
        kmax,
    };
    let ss = 1.0 / filterscale;
    let mut k = vec![0f64; kmax];
    for (j, x) in (first as usize..(first + count) as usize).enumerate() {
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
        let row = &mut t.weights[j * kmax..j * kmax + kmax];
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

/// Rounds a fixed-point sum to 8 bits. Sums fit in i32: weights are ≥ 0 and add up to about
/// `2^22`, times 255 plus the rounding half stays below `2^31` (Pillow also sums 8-bit
/// channels in 32-bit integers). The passes add with `wrapping_*` ops, exact since nothing
/// overflows, so that builds with overflow checks (the dev profile) still vectorize them.
#[inline]
fn clip8(v: i32) -> u8 {
    (v >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Resizes `src` to `width × height` with Pillow-compatible bilinear filtering.
pub fn resize_bilinear(src: &RgbImage, width: u32, height: u32) -> RgbImage {
    resize_bilinear_crop(src, (width, height), (0, 0), (width, height))
}

/// The `size` window at `crop` (top-left `(x, y)`) of `src` resized to `resized` with
/// [`resize_bilinear`]: the same pixels as resizing and then cropping (each output pixel depends
/// only on its own taps), computing only the pixels that are kept. Like `imageops::crop_imm`,
/// a window reaching past the resized image is cut to it.
pub fn resize_bilinear_crop(
    src: &RgbImage,
    resized: (u32, u32),
    crop: (u32, u32),
    size: (u32, u32),
) -> RgbImage {
    let (iw, ih) = src.dimensions();
    let (rw, rh) = resized;
    let cx = crop.0.min(rw);
    let cy = crop.1.min(rh);
    let (bw, bh) = (size.0.min(rw - cx), size.1.min(rh - cy));
    if bw == 0 || bh == 0 || iw == 0 || ih == 0 {
        return RgbImage::new(bw, bh);
    }
    let half = 1i32 << (PRECISION_BITS - 1);
    let input = src.as_raw();
    let in_stride = iw as usize * 3;
    let stride = bw as usize * 3;
    // Rows of the input the vertical pass reads.
    let vert = (ih != rh).then(|| taps(ih, rh, cy, bh));
    let (row0, rows) = match &vert {
        Some(t) => {
            let first = t.start.iter().copied().min().unwrap_or(0);
            let end = (0..bh as usize)
                .map(|i| t.start[i] + t.len[i])
                .max()
                .unwrap_or(first);
            (first, end.max(first) - first)
        }
        None => (cy as usize, bh as usize),
    };
    // Horizontal pass over those rows: iw → the bw columns from cx of rw.
    let mut horiz = vec![0u8; rows * stride];
    if iw == rw {
        let from = cx as usize * 3;
        for (r, out) in horiz.chunks_exact_mut(stride).enumerate() {
            let y = row0 + r;
            out.copy_from_slice(&input[y * in_stride + from..y * in_stride + from + stride]);
        }
    } else {
        let t = taps(iw, rw, cx, bw);
        for (r, out) in horiz.chunks_exact_mut(stride).enumerate() {
            let row = &input[(row0 + r) * in_stride..(row0 + r + 1) * in_stride];
            for (x, o) in out.chunks_exact_mut(3).enumerate() {
                let (s, w) = t.get(x);
                let px = &row[s * 3..(s + w.len()) * 3];
                let (mut cr, mut cg, mut cb) = (half, half, half);
                for (p, &wi) in px.chunks_exact(3).zip(w) {
                    cr = cr.wrapping_add((p[0] as i32).wrapping_mul(wi));
                    cg = cg.wrapping_add((p[1] as i32).wrapping_mul(wi));
                    cb = cb.wrapping_add((p[2] as i32).wrapping_mul(wi));
                }
                o[0] = clip8(cr);
                o[1] = clip8(cg);
                o[2] = clip8(cb);
            }
        }
    }
    let Some(t) = vert else {
        return RgbImage::from_raw(bw, bh, horiz).unwrap_or_else(|| RgbImage::new(bw, bh));
    };
    // Vertical pass: the rows from cy of rh, the bw columns already cut.
    let mut out = vec![0u8; stride * bh as usize];
    let mut acc = vec![0i32; stride];
    for (y, orow) in out.chunks_exact_mut(stride).enumerate() {
        let (s, w) = t.get(y);
        acc.fill(half);
        for (i, &wi) in w.iter().enumerate() {
            let r = s + i - row0;
            let row = &horiz[r * stride..(r + 1) * stride];
            for (a, &p) in acc.iter_mut().zip(row) {
                *a = a.wrapping_add((p as i32).wrapping_mul(wi));
            }
        }
        for (o, &a) in orow.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    RgbImage::from_raw(bw, bh, out).unwrap_or_else(|| RgbImage::new(bw, bh))
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

    #[test]
    fn cropped_resize_equals_resize_then_crop() {
        // A noisy image (xorshift), shrunk, enlarged, and resized along one axis only.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let img = RgbImage::from_fn(53, 41, |_, _| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            Rgb([state as u8, (state >> 8) as u8, (state >> 16) as u8])
        });
        for (rw, rh) in [(20, 15), (53, 90), (120, 41), (53, 41), (31, 64), (7, 3)] {
            let full = resize_bilinear(&img, rw, rh);
            for (cx, cy, bw, bh) in [
                (0, 0, rw, rh),
                (rw / 3, rh / 4, rw / 2, rh / 2),
                (rw - 1, rh - 1, 1, 1),
                (2, 1, rw, rh), // past the edge: cut like crop_imm
            ] {
                let want = ::image::imageops::crop_imm(&full, cx, cy, bw, bh).to_image();
                let got = resize_bilinear_crop(&img, (rw, rh), (cx, cy), (bw, bh));
                assert_eq!(
                    got.dimensions(),
                    want.dimensions(),
                    "{rw}x{rh} at {cx},{cy}"
                );
                assert!(got == want, "{rw}x{rh} window {cx},{cy} {bw}x{bh} differs");
            }
        }
    }
}
