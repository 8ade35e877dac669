//! A built-in 5×7 bitmap font for labelling PNG charts without font files (loss curves,
//! benchmark charts). Letters are drawn as capitals; characters without a glyph draw as blanks.

use std::path::Path;

use image::{Rgb, RgbImage};

use crate::engine::error::{Result, TrainError};

/// Width of one character cell at scale 1, pixels (5 glyph columns + 1 spacing).
pub const CHAR_W: u32 = 6;
/// Height of one glyph at scale 1, pixels.
pub const CHAR_H: u32 = 7;

/// Rows of the 5×7 glyphs, top to bottom, bit 4 = leftmost pixel.
pub(crate) fn glyph(c: char) -> [u8; 7] {
    match c.to_ascii_uppercase() {
        '0' => [0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E],
        '1' => [0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E],
        '2' => [0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F],
        '3' => [0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E],
        '4' => [0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02],
        '5' => [0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E],
        '6' => [0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E],
        '7' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08],
        '8' => [0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E],
        '9' => [0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C],
        'A' => [0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'B' => [0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E],
        'C' => [0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E],
        'D' => [0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C],
        'E' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F],
        'F' => [0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10],
        'G' => [0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F],
        'H' => [0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11],
        'I' => [0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E],
        'J' => [0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C],
        'K' => [0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11],
        'L' => [0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F],
        'M' => [0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11],
        'N' => [0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11],
        'O' => [0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'P' => [0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10],
        'Q' => [0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D],
        'R' => [0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11],
        'S' => [0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E],
        'T' => [0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04],
        'U' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E],
        'V' => [0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04],
        'W' => [0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A],
        'X' => [0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11],
        'Y' => [0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04],
        'Z' => [0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F],
        '.' => [0, 0, 0, 0, 0, 0x0C, 0x0C],
        ',' => [0, 0, 0, 0, 0x0C, 0x04, 0x08],
        '/' => [0, 0x01, 0x02, 0x04, 0x08, 0x10, 0],
        '-' => [0, 0, 0, 0x1F, 0, 0, 0],
        '+' => [0, 0x04, 0x04, 0x1F, 0x04, 0x04, 0],
        '_' => [0, 0, 0, 0, 0, 0, 0x1F],
        ':' => [0, 0x0C, 0x0C, 0, 0x0C, 0x0C, 0],
        '(' => [0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02],
        ')' => [0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08],
        '%' => [0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03],
        '=' => [0, 0, 0x1F, 0, 0x1F, 0, 0],
        '<' => [0x02, 0x04, 0x08, 0x10, 0x08, 0x04, 0x02],
        '>' => [0x08, 0x04, 0x02, 0x01, 0x02, 0x04, 0x08],
        '×' | '*' => [0, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0],
        _ => [0; 7],
    }
}

/// Draws `s` with its top-left corner at `(x, y)`, each glyph pixel a `scale` × `scale` square in
/// `color`; pixels outside the image are skipped. A string takes `len · CHAR_W · scale` pixels.
pub fn draw_text(img: &mut RgbImage, x: u32, y: u32, s: &str, scale: u32, color: Rgb<u8>) {
    let scale = scale.max(1);
    for (i, c) in s.chars().enumerate() {
        let g = glyph(c);
        let x0 = x + i as u32 * CHAR_W * scale;
        for (row, bits) in g.iter().enumerate() {
            for col in 0..5u32 {
                if bits & (0x10 >> col) == 0 {
                    continue;
                }
                for dy in 0..scale {
                    for dx in 0..scale {
                        let (px, py) = (x0 + col * scale + dx, y + row as u32 * scale + dy);
                        if px < img.width() && py < img.height() {
                            img.put_pixel(px, py, color);
                        }
                    }
                }
            }
        }
    }
}

/// Tick values for an axis over `[lo, hi]`: about `n` round values (1, 2 or 5 × 10^k apart),
/// and the range widened to the ticks around it (so the grid lines are the ticks).
pub fn nice_ticks(lo: f64, hi: f64, n: usize) -> (Vec<f64>, f64, f64) {
    let span = (hi - lo).abs().max(f64::EPSILON * hi.abs().max(1.0));
    let raw = span / (n.max(2) - 1) as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).floor() * step;
    let last = (hi / step).ceil() * step;
    let count = ((last - first) / step).round() as usize;
    let ticks = (0..=count).map(|i| first + i as f64 * step).collect();
    (ticks, first, last)
}

/// The exponential moving average with bias correction that TensorBoard's smoothing draws
/// (as Adam corrects its moments, Kingma & Ba 2015, §3): `m_t = β·m_{t−1} + (1 − β)·x_t` from
/// `m_0 = 0`, shown as `m_t / (1 − β^t)`, so the first points are not pulled towards 0.
pub fn debiased_ema(values: &[f64], beta: f64) -> Vec<f64> {
    let mut m = 0.0;
    let mut corr = 1.0;
    values
        .iter()
        .map(|x| {
            m = beta * m + (1.0 - beta) * x;
            corr *= beta;
            m / (1.0 - corr)
        })
        .collect()
}

/// Draws a loss curve as a PNG: light grid at round tick values, axes with tick labels and
/// titles ("STEP", "LOSS"), the raw per-step loss in light blue and its debiased exponential
/// moving average ([`debiased_ema`], β = 0.9) in dark blue, with a legend; labelled with the
/// built-in bitmap font (this module's).
///
/// # Errors
/// Fewer than two finite points, or I/O / encoding errors.
pub fn write_loss_png(path: &Path, points: &[(u64, f64)], width: u32, height: u32) -> Result<()> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .filter(|p| p.1.is_finite())
        .map(|&(s, l)| (s as f64, l))
        .collect();
    if pts.len() < 2 {
        return Err(TrainError::Invalid {
            what: "loss curve".into(),
            value: format!("{} finite points", pts.len()),
            hint: "need at least two steps with a finite loss".into(),
        });
    }
    let (w, h) = (width.max(200), height.max(120));
    let mut img = RgbImage::from_pixel(w, h, Rgb([255, 255, 255]));
    let ink = Rgb([40, 40, 40]);
    let cw = CHAR_W;
    let ch = CHAR_H;
    let smooth = debiased_ema(&pts.iter().map(|p| p.1).collect::<Vec<_>>(), 0.9);
    let lo = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if hi - lo < 1e-12 {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo, hi)
    };
    let (y_ticks, y0, y1) = nice_ticks(lo, hi, 5);
    let (x_first, x_last) = (pts[0].0, pts[pts.len() - 1].0.max(pts[0].0 + 1.0));
    let (x_ticks, _, _) = nice_ticks(x_first, x_last, 5);
    let x_ticks: Vec<f64> = x_ticks
        .into_iter()
        .filter(|t| *t >= x_first && *t <= x_last && t.fract() == 0.0)
        .collect();
    let (x0, x1) = (x_first, x_last);
    // as many decimals as the tick step needs, the same on every tick
    let y_step = y_ticks.get(1).map_or(1.0, |t| t - y_ticks[0]);
    let decimals = (-y_step.log10().floor()).max(0.0) as usize;
    let label = |v: f64| format!("{v:.decimals$}");
    let widest = y_ticks.iter().map(|v| label(*v).len()).max().unwrap_or(4) as f64;
    // Room for the labels: the y title and tick labels left of the plot, x tick labels and
    // title below it, the legend above.
    let left = 10.0 + (widest + 1.0) * cw as f64;
    let top = 10.0 + 2.0 * ch as f64;
    let bottom = 12.0 + 2.0 * ch as f64;
    let right = 16.0;
    let (pw, ph) = (w as f64 - left - right, h as f64 - top - bottom);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| top + (1.0 - (y - y0) / (y1 - y0)) * ph;
    // titles and legend
    draw_text(&mut img, 4, 4, "LOSS", 1, ink);
    let title_x = (left + pw / 2.0) as u32;
    draw_text(
        &mut img,
        title_x.saturating_sub(2 * cw),
        h - ch - 3,
        "STEP",
        1,
        ink,
    );
    let legend_x = (left + pw) as u32;
    let raw_label = "RAW";
    let ema_label = "EMA 0.9";
    let lx_ema = legend_x.saturating_sub(ema_label.len() as u32 * cw + 2);
    let lx_raw = lx_ema.saturating_sub(raw_label.len() as u32 * cw + 22);
    draw_text(&mut img, lx_raw, 4, raw_label, 1, Rgb([110, 150, 220]));
    draw_text(&mut img, lx_ema, 4, ema_label, 1, Rgb([20, 50, 160]));
    for v in &y_ticks {
        let t = label(*v);
        let x = (left as u32).saturating_sub(4 + t.len() as u32 * cw);
        draw_text(&mut img, x, (py(*v) as u32).saturating_sub(3), &t, 1, ink);
    }
    for step in &x_ticks {
        let t = format!("{step:.0}");
        let x = (px(*step) as u32).saturating_sub(t.len() as u32 * cw / 2);
        draw_text(&mut img, x, (top + ph) as u32 + 5, &t, 1, ink);
    }
    let mut plot = |x: f64, y: f64, c: [u8; 3]| {
        if x >= 0.0 && y >= 0.0 && (x as u32) < w && (y as u32) < h {
            img.put_pixel(x as u32, y as u32, Rgb(c));
        }
    };
    // Grid at the ticks.
    for v in &y_ticks {
        for t in (left as u32)..=((left + pw) as u32) {
            plot(t as f64, py(*v), [230, 230, 230]);
        }
    }
    for s in &x_ticks {
        for t in (top as u32)..=((top + ph) as u32) {
            plot(px(*s), t as f64, [230, 230, 230]);
        }
    }
    // Axes.
    for t in (left as u32)..=((left + pw) as u32) {
        plot(t as f64, top + ph, [0, 0, 0]);
    }
    for t in (top as u32)..=((top + ph) as u32) {
        plot(left, t as f64, [0, 0, 0]);
    }
    let mut line = |a: (f64, f64), b: (f64, f64), c: [u8; 3]| {
        let n = ((b.0 - a.0).abs().max((b.1 - a.1).abs()).ceil() as usize).max(1);
        for k in 0..=n {
            let t = k as f64 / n as f64;
            plot(a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1), c);
        }
    };
    // legend swatches
    for (x, c) in [(lx_raw, [160, 190, 240]), (lx_ema, [20, 50, 160])] {
        let x = x.saturating_sub(16) as f64;
        line((x, 7.0), (x + 12.0, 7.0), c);
        line((x, 8.0), (x + 12.0, 8.0), c);
    }
    for win in pts.windows(2) {
        line(
            (px(win[0].0), py(win[0].1)),
            (px(win[1].0), py(win[1].1)),
            [160, 190, 240],
        );
    }
    for (k, win) in smooth.windows(2).enumerate() {
        let a = (px(pts[k].0), py(win[0]));
        let b = (px(pts[k + 1].0), py(win[1]));
        line(a, b, [20, 50, 160]);
        line((a.0, a.1 + 1.0), (b.0, b.1 + 1.0), [20, 50, 160]);
    }
    if let Some(parent) = path.parent()
        && !parent.as_os_str().is_empty()
    {
        std::fs::create_dir_all(parent).map_err(|source| TrainError::Io {
            op: "create folder",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    img.save_with_format(path, image::ImageFormat::Png)
        .map_err(|e| TrainError::State {
            what: "loss curve".into(),
            message: format!("writing `{}`: {e}", path.display()),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glyphs_are_distinct_and_text_lands_where_asked() {
        let alphabet = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ.,/-+_:()%=<>*";
        let glyphs: Vec<[u8; 7]> = alphabet.chars().map(glyph).collect();
        for (i, a) in glyphs.iter().enumerate() {
            assert_ne!(
                *a,
                [0; 7],
                "{} has no glyph",
                alphabet.chars().nth(i).unwrap_or(' ')
            );
            for b in glyphs.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
        let mut img = RgbImage::from_pixel(40, 20, Rgb([255, 255, 255]));
        draw_text(&mut img, 2, 3, "1", 2, Rgb([0, 0, 0]));
        // '1' row 0 is 0x04: column 2 only → pixels x = 2 + 2·2 .. +2, y = 3 .. 5.
        assert_eq!(img.get_pixel(6, 3), &Rgb([0, 0, 0]));
        assert_eq!(img.get_pixel(2, 3), &Rgb([255, 255, 255]));
        let inked = img.pixels().filter(|p| p.0 == [0, 0, 0]).count();
        // '1' has 4 + 2·1·5 … = 12 lit cells; each is 2×2 pixels.
        let cells: u32 = glyph('1').iter().map(|r| r.count_ones()).sum();
        assert_eq!(inked as u32, cells * 4);
    }

    #[test]
    fn loss_png_has_the_curve() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("loss.png");
        let pts: Vec<(u64, f64)> = (1..=50).map(|s| (s, 2.0 / s as f64)).collect();
        write_loss_png(&p, &pts, 320, 200).unwrap();
        let img = image::open(&p).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (320, 200));
        let dark = img.pixels().filter(|px| px.0 == [20, 50, 160]).count();
        assert!(dark > 100, "{dark} curve pixels");
        // Labels are drawn (text ink) left of the y axis and under the x axis.
        let ink = |x0: u32, x1: u32, y0: u32, y1: u32| {
            (x0..x1)
                .flat_map(|x| (y0..y1).map(move |y| (x, y)))
                .filter(|&(x, y)| img.get_pixel(x, y).0 == [40, 40, 40])
                .count()
        };
        assert!(ink(0, 40, 25, 170) > 40, "no y tick labels");
        assert!(ink(0, 40, 0, 12) > 10, "no y title");
        assert!(ink(45, 320, 165, 200) > 30, "no x tick labels or title");
        assert!(write_loss_png(&p, &pts[..1], 200, 100).is_err());
    }

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        let (t, lo, hi) = nice_ticks(0.37, 2.0, 5);
        assert_eq!((lo, hi), (0.0, 2.0));
        assert_eq!(t, vec![0.0, 0.5, 1.0, 1.5, 2.0]);
        let (t, lo, hi) = nice_ticks(1.0, 60.0, 5);
        assert_eq!((lo, hi), (0.0, 60.0));
        assert_eq!(t, vec![0.0, 20.0, 40.0, 60.0]);
        let (t, _, _) = nice_ticks(2.31, 2.34, 5);
        assert!(t.len() >= 3 && t.len() <= 6, "{t:?}");
    }

    #[test]
    fn the_moving_average_is_debiased() {
        // a constant series: the debiased average is that constant from the first step (the
        // plain one starts at 0.1 of it)
        let e = debiased_ema(&[2.0; 5], 0.9);
        for v in &e {
            assert!((v - 2.0).abs() < 1e-12, "{e:?}");
        }
        // step 2 of [1, 3]: m = 0.9·0.1 + 0.1·3 = 0.39, over 1 − 0.81 = 0.19
        let e = debiased_ema(&[1.0, 3.0], 0.9);
        assert!((e[1] - 0.39 / 0.19).abs() < 1e-12, "{e:?}");
    }
}
