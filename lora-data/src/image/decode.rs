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

impl DecodeFailure {
    /// A file whose extension names a format this crate cannot decode
    /// ([`UNSUPPORTED_IMAGE_EXTENSIONS`]; `ext` without the dot).
    pub fn unsupported_extension(ext: &str) -> Self {
        DecodeFailure::Unsupported(format!("`.{ext}` images cannot be decoded here"))
    }

    /// What is wrong, in the words every command uses for the file (training, caching,
    /// tagging).
    pub fn what(&self) -> String {
        match self {
            DecodeFailure::ZeroByte => "the file is empty (0 bytes)".into(),
            DecodeFailure::Truncated(m) => format!("the image data ends early ({m})"),
            DecodeFailure::Corrupt(m) => format!("not a valid image ({m})"),
            DecodeFailure::Unsupported(m) => format!("unsupported image encoding ({m})"),
            DecodeFailure::Io(m) => format!("cannot read the file ({m})"),
        }
    }

    /// What to do about it.
    pub fn fix(&self) -> &'static str {
        match self {
            DecodeFailure::ZeroByte => "copy the image again or delete it",
            DecodeFailure::Truncated(_) => "copy or download the image again",
            DecodeFailure::Corrupt(_) => "replace the file; check it opens in an image viewer",
            DecodeFailure::Unsupported(_) => {
                "convert it to PNG or JPEG (the original is left untouched)"
            }
            DecodeFailure::Io(_) => "check the file's permissions",
        }
    }
}

/// `what; fix: fix`, as a dataset [`crate::validate::Problem`] reads after its path (see [`DecodeFailure::what`], [`DecodeFailure::fix`]).
impl std::fmt::Display for DecodeFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}; fix: {}", self.what(), self.fix())
    }
}

/// A decoded image.
#[derive(Debug, Clone)]
pub struct Decoded {
    /// RGB pixels, orientation applied, alpha composited on the background.
    pub rgb: RgbImage,
    /// The EXIF orientation that was applied (`NoTransforms` when none).
    pub orientation: ::image::metadata::Orientation,
}

/// What an `image` crate error says about a file: cut short, corrupt, unsupported or unreadable.
pub fn classify(e: ImageError) -> DecodeFailure {
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

/// Decodes `bytes` (format from the content, not the extension) after [`check_complete`],
/// applies the EXIF orientation,
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
    let Some(format) = reader.format() else {
        return Err(DecodeFailure::Corrupt(
            "the bytes match no known image format".into(),
        ));
    };
    // decoders pad a cut file (a truncated JPEG decodes with blank rows): check first
    check_complete(bytes, format)?;
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

/// Checks that `bytes` hold a whole image file of `format`, where decoders would otherwise fill
/// what is missing: a JPEG must have its end-of-image marker (`FF D9`) after its last
/// start-of-scan (`FF DA`; entropy-coded data never holds `FF D9`, so a cut file lacks it), a PNG
/// its `IEND` chunk, a GIF its trailer byte (`3B`), a WebP the bytes its RIFF header counts.
/// Other formats pass (their decoders report a short file themselves).
///
/// # Errors
/// [`DecodeFailure::Truncated`] saying what is missing.
pub fn check_complete(bytes: &[u8], format: ::image::ImageFormat) -> Result<(), DecodeFailure> {
    use ::image::ImageFormat as F;
    let cut = |what: &str| {
        Err(DecodeFailure::Truncated(format!(
            "{what}: the file is cut short"
        )))
    };
    match format {
        F::Jpeg => {
            let last_sos = bytes.windows(2).rposition(|w| w == [0xFF, 0xDA]);
            let eoi_after = |from: usize| bytes[from..].windows(2).any(|w| w == [0xFF, 0xD9]);
            match last_sos {
                Some(i) if eoi_after(i) => Ok(()),
                Some(_) => cut("the JPEG data ends before its end-of-image marker (FF D9)"),
                None => cut("the JPEG has no image data (no start-of-scan marker)"),
            }
        }
        F::Png => {
            // the IEND chunk: length 0, type "IEND"
            if bytes
                .windows(8)
                .any(|w| w == [0, 0, 0, 0, b'I', b'E', b'N', b'D'])
            {
                Ok(())
            } else {
                cut("the PNG ends before its IEND chunk")
            }
        }
        F::Gif => match bytes.iter().rposition(|&b| b != 0) {
            Some(i) if bytes[i] == 0x3B => Ok(()),
            _ => cut("the GIF ends before its trailer (3B)"),
        },
        F::WebP if bytes.len() >= 12 && &bytes[..4] == b"RIFF" => {
            let size = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) as usize;
            if bytes.len() >= size.saturating_add(8) {
                Ok(())
            } else {
                cut(&format!(
                    "the WebP holds {} of the {} bytes its header counts",
                    bytes.len(),
                    size.saturating_add(8)
                ))
            }
        }
        _ => Ok(()),
    }
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

    /// A 64×48 gradient encoded by the `image` crate's own encoders.
    fn encoded(format: ImageFormat) -> Vec<u8> {
        let img = RgbImage::from_fn(64, 48, |x, y| {
            ::image::Rgb([(x * 4) as u8, (y * 5) as u8, ((x + y) * 2) as u8])
        });
        let mut out = Vec::new();
        img.write_to(&mut Cursor::new(&mut out), format).unwrap();
        out
    }

    #[test]
    fn cut_files_are_truncated_not_padded() {
        for format in [
            ImageFormat::Jpeg,
            ImageFormat::Png,
            ImageFormat::Gif,
            ImageFormat::WebP,
        ] {
            let whole = encoded(format);
            let d = decode_bytes(&whole, [0; 3]).unwrap();
            assert_eq!(d.rgb.dimensions(), (64, 48), "{format:?}");
            let cut = &whole[..whole.len() * 3 / 4];
            match decode_bytes(cut, [0; 3]) {
                Err(DecodeFailure::Truncated(m)) => assert!(m.contains("cut short"), "{m}"),
                other => panic!("{format:?} cut to 3/4: {other:?}"),
            }
        }
        // the decoder alone accepts a cut JPEG (it fills the missing rows): the check is needed
        let jpeg = encoded(ImageFormat::Jpeg);
        let cut = &jpeg[..jpeg.len() * 3 / 4];
        assert!(::image::load_from_memory(cut).is_ok());
        // trailing bytes after the end of a JPEG are fine
        let mut padded = jpeg.clone();
        padded.extend_from_slice(&[0u8; 64]);
        assert!(decode_bytes(&padded, [0; 3]).is_ok());
    }

    #[test]
    fn a_png_with_a_bad_crc_is_corrupt() {
        let mut png = encoded(ImageFormat::Png);
        let idat = png.windows(4).position(|w| w == b"IDAT").unwrap();
        png[idat + 8] ^= 0x55;
        assert!(matches!(
            decode_bytes(&png, [0; 3]).unwrap_err(),
            DecodeFailure::Corrupt(_)
        ));
    }
}
