//! A bar chart of ratios ours/theirs as a PNG, drawn with the `image` crate and a built-in 5×7
//! bitmap font (no font files needed; labels are drawn in capitals).

use std::path::Path;

use image::{Rgb, RgbImage};

use crate::{BenchError, Result};

/// One bar: a ratio ours/theirs and which direction is better.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The label left of the bar (ASCII; drawn in capitals).
    pub label: String,
    /// The ratio ours/theirs (drawn when finite and > 0).
    pub ratio: f64,
    /// True when a ratio below 1 means we are better (time, memory); false when above 1 does
    /// (throughput).
    pub lower_is_better: bool,
}

const SCALE: u32 = 2;
const CHAR_W: u32 = lora_train::engine::plot::CHAR_W * SCALE;

fn text(img: &mut RgbImage, x: u32, y: u32, s: &str, color: Rgb<u8>) {
    lora_train::engine::plot::draw_text(img, x, y, s, SCALE, color);
}

fn rect(img: &mut RgbImage, x0: u32, y0: u32, w: u32, h: u32, color: Rgb<u8>) {
    for y in y0..(y0 + h).min(img.height()) {
        for x in x0..(x0 + w).min(img.width()) {
            img.put_pixel(x, y, color);
        }
    }
}

/// Draws `bars` as horizontal bars on a linear axis from 0 to `max(2, largest ratio)`, with a
/// vertical line at 1 (parity), each bar green when it is on the better side of 1 and red
/// otherwise, its value written at its end (`0.85X`), and `title` on top. Writes a PNG to `path`.
///
/// # Errors
/// [`BenchError::Io`] when the PNG cannot be written.
pub fn ratio_chart(title: &str, bars: &[Bar], path: &Path) -> Result<()> {
    let label_w = bars
        .iter()
        .map(|b| b.label.chars().count() as u32)
        .max()
        .unwrap_or(10)
        .max(10)
        * CHAR_W
        + 16;
    let plot_w = 520u32;
    let row_h = 34u32;
    let top = 44u32;
    let width = label_w + plot_w + 110;
    let height = top + row_h * bars.len().max(1) as u32 + 40;
    let mut img = RgbImage::from_pixel(width, height, Rgb([255, 255, 255]));
    let ink = Rgb([20, 20, 20]);
    text(&mut img, 12, 12, title, ink);
    let max = bars
        .iter()
        .map(|b| b.ratio)
        .filter(|r| r.is_finite())
        .fold(2.0f64, f64::max);
    let px = |r: f64| label_w + ((r / max) * f64::from(plot_w)).round().max(0.0) as u32;
    // Axis ticks at 0, 0.5, 1, ... up to max.
    let axis_y = top + row_h * bars.len() as u32 + 4;
    rect(&mut img, label_w, axis_y, plot_w + 1, 1, ink);
    let mut t = 0.0;
    while t <= max + 1e-9 {
        let x = px(t);
        rect(&mut img, x, axis_y, 1, 5, ink);
        let s = format!("{t:.1}");
        text(
            &mut img,
            x.saturating_sub(CHAR_W * s.len() as u32 / 2),
            axis_y + 9,
            &s,
            ink,
        );
        t += if max > 4.0 { 1.0 } else { 0.5 };
    }
    for (i, b) in bars.iter().enumerate() {
        let y = top + row_h * i as u32;
        text(&mut img, 8, y + 10, &b.label, ink);
        if b.ratio.is_finite() && b.ratio > 0.0 {
            let better = if b.lower_is_better {
                b.ratio <= 1.0
            } else {
                b.ratio >= 1.0
            };
            let color = if better {
                Rgb([60, 160, 80])
            } else {
                Rgb([210, 70, 60])
            };
            let x1 = px(b.ratio);
            rect(
                &mut img,
                label_w,
                y + 6,
                x1.saturating_sub(label_w).max(1),
                row_h - 12,
                color,
            );
            text(&mut img, x1 + 6, y + 10, &format!("{:.2}x", b.ratio), ink);
        } else {
            text(&mut img, label_w + 6, y + 10, "N/A", ink);
        }
    }
    // Parity line at 1.
    let x1 = px(1.0);
    rect(
        &mut img,
        x1,
        top - 4,
        2,
        row_h * bars.len() as u32 + 8,
        Rgb([90, 90, 200]),
    );
    img.save(path).map_err(|e| BenchError::Io {
        path: path.to_path_buf(),
        source: std::io::Error::other(e.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chart_bars_are_as_long_as_their_ratio_and_coloured_by_side() {
        let dir = std::env::temp_dir().join(format!("lora-bench-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("c.png");
        let bars = vec![
            Bar {
                label: "step time".into(),
                ratio: 0.5,
                lower_is_better: true,
            },
            Bar {
                label: "images/s".into(),
                ratio: 1.5,
                lower_is_better: false,
            },
            Bar {
                label: "memory".into(),
                ratio: 1.25,
                lower_is_better: true,
            },
        ];
        ratio_chart("ratios", &bars, &path).unwrap();
        let img = image::open(&path).unwrap().to_rgb8();
        // Walk the middle of each bar row and measure the coloured run.
        let label_w = 10 * CHAR_W + 16;
        let run = |row: u32| -> (u32, Rgb<u8>) {
            let y = 44 + 34 * row + 17;
            let c = *img.get_pixel(label_w, y);
            let mut n = 0;
            while *img.get_pixel(label_w + n, y) == c {
                n += 1;
            }
            (n, c)
        };
        let (n0, c0) = run(0);
        let (n1, c1) = run(1);
        let (n2, c2) = run(2);
        // axis 0..2 over 520 px: 0.5 → 130 px, 1.5 → 390 px (the parity line at 260 px interrupts
        // bars longer than 1: their first run ends there)
        assert_eq!(n0, 130);
        assert_eq!(n1, 260);
        assert_eq!(n2, 260);
        assert_eq!(c0, Rgb([60, 160, 80]), "0.5 of a time is better");
        assert_eq!(c1, Rgb([60, 160, 80]), "1.5 of a throughput is better");
        assert_eq!(c2, Rgb([210, 70, 60]), "1.25 of a memory is worse");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
