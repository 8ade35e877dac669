//! Decoding any supported image file to 8-bit RGB, EXIF orientation applied first.

use std::io::Cursor;
use std::path::Path;

use ::image::{DynamicImage, ImageDecoder, ImageError, ImageReader, RgbImage};

/// Lower-case extensions decoded by this crate (the `image` crate features enabled in the
/// workspace: png, jpeg, webp, tiff, bmp, gif).
pub const IMAGE_EXTENSIONS: &[&str] = &["png", "jpg", "jpeg", "webp", "bmp", "gif", "tif", "tiff"];

/// Image formats people put in datasets that this crate cannot decode (reported, not skipped
/// silently).
pub const UNSUPPORTED_IMAGE_EXTENSIONS: &[&str] = &[
    "heic", "heif", "avif", "jxl", "psd", "svg", "raw", "cr2", "nef", "arw", "dng", "exr", "jp2",
    "ico", "tga",
];

/// Why an image file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeFailure {
    /// The file is empty.
    ZeroByte,
    /// The data ends early.
    Truncated(String),
    /// The data is not a valid image of its format, or the bytes match no known format.
    Corrupt(String),
    /// Recognized but not decodable here.
    Unsupported(String),
    /// Reading failed.
    Io(String),
}

/// A decoded image.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// RGB pixels, orientation applied, alpha composited on the background.
    pub rgb: RgbImage,
    /// The EXIF orientation that was applied (`NoTransforms` when none).
    pub orientation: ::image::metadata::Orientation,
}

fn classify(e: ImageError) -> DecodeFailure {
    let msg = e.to_string();
    let lower = msg.to_ascii_lowercase();
    match &e {
        ImageError::IoError(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            DecodeFailure::Truncated(msg)
        }
        ImageError::Unsupported(_) => DecodeFailure::Unsupported(msg),
        _ if lower.contains("eof")
            || lower.contains("end of")
            || lower.contains("truncat")
            || lower.contains("unexpected end") =>
        {
            DecodeFailure::Truncated(msg)
        }
        ImageError::IoError(_) => DecodeFailure::Io(msg),
        _ => DecodeFailure::Corrupt(msg),
    }
}

/// Decodes `bytes` (format from the content, not the extension), applies the EXIF orientation,
/// converts every color type (gray, gray+alpha, RGBA, 16-bit, palette, CMYK JPEG) to 8-bit RGB,
/// compositing transparent pixels over `background` (`out = a·c + (1 − a)·bg`, straight alpha).
///
/// # Errors
/// A [`DecodeFailure`] saying what is wrong with the data.
pub fn decode_bytes(bytes: &[u8], background: [u8; 3]) -> Result<Decoded, DecodeFailure> {
    if bytes.is_empty() {
        return Err(DecodeFailure::ZeroByte);
    }
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| DecodeFailure::Io(e.to_string()))?;
    if reader.format().is_none() {
        return Err(DecodeFailure::Corrupt(
            "the bytes match no known image format".into(),
        ));
    }
    let mut decoder = reader.into_decoder().map_err(classify)?;
    let orientation = decoder
        .orientation()
        .unwrap_or(::image::metadata::Orientation::NoTransforms);
    let mut img = DynamicImage::from_decoder(decoder).map_err(classify)?;
    img.apply_orientation(orientation);
    Ok(Decoded {
        rgb: to_rgb(img, background),
        orientation,
    })
}

/// Reads and decodes a file; see [`decode_bytes`].
///
/// # Errors
/// [`DecodeFailure::Io`] when the file cannot be read, else as [`decode_bytes`].
pub fn decode_file(path: &Path, background: [u8; 3]) -> Result<Decoded, DecodeFailure> {
    let bytes = std::fs::read(path).map_err(|e| DecodeFailure::Io(e.to_string()))?;
    decode_bytes(&bytes, background)
}

fn to_rgb(img: DynamicImage, bg: [u8; 3]) -> RgbImage {
    let (w, h) = (img.width(), img.height());
    match img {
        DynamicImage::ImageRgb8(rgb) => rgb,
        // Gray to RGB: the value in each channel (what `into_rgb8` does, in one pass).
        DynamicImage::ImageLuma8(gray) => {
            let mut out = vec![0u8; gray.as_raw().len() * 3];
            for (o, &l) in out.chunks_exact_mut(3).zip(gray.as_raw()) {
                o.fill(l);
            }
            RgbImage::from_raw(w, h, out).unwrap_or_else(|| RgbImage::new(w, h))
        }
        img if !img.color().has_alpha() => img.into_rgb8(),
        img => {
            let rgba = img.into_rgba8();
            let mut out = vec![0u8; rgba.as_raw().len() / 4 * 3];
            for (o, p) in out.chunks_exact_mut(3).zip(rgba.as_raw().chunks_exact(4)) {
                let a = p[3] as u32;
                for ((o, &c), &b) in o.iter_mut().zip(&p[..3]).zip(&bg) {
                    // round(c·a/255 + bg·(255−a)/255) in integers
                    *o = ((c as u32 * a + b as u32 * (255 - a) + 127) / 255) as u8;
                }
            }
            RgbImage::from_raw(w, h, out).unwrap_or_else(|| RgbImage::new(w, h))
        }
    }
}

/// `true` when `ext` (any case, without dot) is decodable.
pub fn is_image_extension(ext: &str) -> bool {
    let e = ext.to_ascii_lowercase();
    IMAGE_EXTENSIONS.contains(&e.as_str())
}

/// `true` when `ext` names an image format this crate cannot decode.
pub fn is_unsupported_image_extension(ext: &str) -> bool {
    let e = ext.to_ascii_lowercase();
    UNSUPPORTED_IMAGE_EXTENSIONS.contains(&e.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ::image::{ImageFormat, Rgba, RgbaImage};

    #[test]
    fn alpha_is_composited_on_the_background() {
        let mut img = RgbaImage::new(2, 1);
        img.put_pixel(0, 0, Rgba([255, 0, 0, 0]));
        img.put_pixel(1, 0, Rgba([255, 0, 0, 128]));
        let mut png = Vec::new();
        img.write_to(&mut Cursor::new(&mut png), ImageFormat::Png)
            .unwrap();
        let d = decode_bytes(&png, [0, 0, 255]).unwrap();
        assert_eq!(d.rgb.get_pixel(0, 0).0, [0, 0, 255]);
        assert_eq!(d.rgb.get_pixel(1, 0).0, [128, 0, 127]);
        let d = decode_bytes(&png, [255, 255, 255]).unwrap();
        assert_eq!(d.rgb.get_pixel(0, 0).0, [255, 255, 255]);
    }

    #[test]
    fn empty_and_garbage_bytes_are_classified() {
        assert_eq!(
            decode_bytes(&[], [0; 3]).unwrap_err(),
            DecodeFailure::ZeroByte
        );
        assert!(matches!(
            decode_bytes(b"hello, not an image", [0; 3]).unwrap_err(),
            DecodeFailure::Corrupt(_)
        ));
        assert!(is_image_extension("JPG") && is_image_extension("Png"));
        assert!(is_unsupported_image_extension("HEIC"));
    }
}
