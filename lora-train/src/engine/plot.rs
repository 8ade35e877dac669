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

/// Draws a loss curve as a PNG: light grid, axes, the raw per-step loss in light blue and its
/// exponential moving average (α = 0.1) in dark blue, y from the minimum to the maximum loss;
/// labelled with the built-in bitmap font (this module's): a title, the loss at the top, middle
/// and bottom grid lines, and the first, middle and last step.
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
    let (w, h) = (width.max(160), height.max(100));
    let mut img = RgbImage::from_pixel(w, h, Rgb([255, 255, 255]));
    let ink = Rgb([40, 40, 40]);
    let margin = 24f64;
    // Room for the labels: loss values left of the plot, steps below it, a title above.
    let left = 8.0 + 7.0 * CHAR_W as f64;
    let bottom = 14.0 + CHAR_H as f64;
    let (x0, x1) = (pts[0].0, pts[pts.len() - 1].0.max(pts[0].0 + 1.0));
    let lo = pts.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let hi = pts.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if hi - lo < 1e-12 {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo, hi)
    };
    let (pw, ph) = (w as f64 - left - margin, h as f64 - bottom - margin);
    let px = |x: f64| left + (x - x0) / (x1 - x0) * pw;
    let py = |y: f64| margin + (1.0 - (y - lo) / (hi - lo)) * ph;
    let label = |v: f64| {
        if v.abs() >= 100.0 {
            format!("{v:.0}")
        } else if v.abs() >= 10.0 {
            format!("{v:.1}")
        } else {
            format!("{v:.3}")
        }
    };
    let cw = CHAR_W;
    draw_text(&mut img, left as u32, 6, "LOSS PER STEP, EMA DARK", 1, ink);
    for (v, y) in [
        (hi, margin),
        ((hi + lo) / 2.0, margin + ph / 2.0),
        (lo, margin + ph),
    ] {
        let t = label(v);
        let x = (left as u32).saturating_sub(4 + t.len() as u32 * cw);
        draw_text(&mut img, x, (y as u32).saturating_sub(3), &t, 1, ink);
    }
    for (step, x) in [
        (x0, left),
        ((x0 + x1) / 2.0, left + pw / 2.0),
        (x1, left + pw),
    ] {
        let t = format!("{step:.0}");
        let x = (x as u32).saturating_sub(t.len() as u32 * cw / 2);
        draw_text(&mut img, x, h - bottom as u32 + 6, &t, 1, ink);
    }
    let mut plot = |x: f64, y: f64, c: [u8; 3]| {
        if x >= 0.0 && y >= 0.0 && (x as u32) < w && (y as u32) < h {
            img.put_pixel(x as u32, y as u32, Rgb(c));
        }
    };
    // Grid: 5 horizontal and 5 vertical lines inside the plot area.
    for i in 0..=4 {
        let gy = margin + i as f64 * ph / 4.0;
        let gx = left + i as f64 * pw / 4.0;
        for t in (left as u32)..=((left + pw) as u32) {
            plot(t as f64, gy, [230, 230, 230]);
        }
        for t in (margin as u32)..=((margin + ph) as u32) {
            plot(gx, t as f64, [230, 230, 230]);
        }
    }
    // Axes.
    for t in (left as u32)..=((left + pw) as u32) {
        plot(t as f64, margin + ph, [0, 0, 0]);
    }
    for t in (margin as u32)..=((margin + ph) as u32) {
        plot(left, t as f64, [0, 0, 0]);
    }
    let mut line = |a: (f64, f64), b: (f64, f64), c: [u8; 3]| {
        let n = ((b.0 - a.0).abs().max((b.1 - a.1).abs()).ceil() as usize).max(1);
        for k in 0..=n {
            let t = k as f64 / n as f64;
            plot(a.0 + t * (b.0 - a.0), a.1 + t * (b.1 - a.1), c);
        }
    };
    for win in pts.windows(2) {
        line(
            (px(win[0].0), py(win[0].1)),
            (px(win[1].0), py(win[1].1)),
            [160, 190, 240],
        );
    }
    let mut ema = pts[0].1;
    let mut prev = (px(pts[0].0), py(ema));
    for p in &pts[1..] {
        ema = 0.9 * ema + 0.1 * p.1;
        let cur = (px(p.0), py(ema));
        line(prev, cur, [20, 50, 160]);
        line((prev.0, prev.1 + 1.0), (cur.0, cur.1 + 1.0), [20, 50, 160]);
        prev = cur;
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
        write_loss_png(&p, &pts, 200, 100).unwrap();
        let img = image::open(&p).unwrap().to_rgb8();
        assert_eq!(img.dimensions(), (200, 100));
        let dark = img.pixels().filter(|px| px.0 == [20, 50, 160]).count();
        assert!(dark > 100, "{dark} curve pixels");
        // Labels are drawn (text ink) left of the y axis and under the x axis.
        let ink = |x0: u32, x1: u32, y0: u32, y1: u32| {
            (x0..x1)
                .flat_map(|x| (y0..y1).map(move |y| (x, y)))
                .filter(|&(x, y)| img.get_pixel(x, y).0 == [40, 40, 40])
                .count()
        };
        assert!(ink(0, 40, 20, 85) > 20, "no y labels");
        assert!(ink(40, 200, 85, 100) > 10, "no x labels");
        assert!(write_loss_png(&p, &pts[..1], 200, 100).is_err());
    }
}
