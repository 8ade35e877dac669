//! Byte counts and size strings.
//!
//! Conventions: GB = 10^9 bytes, GiB = 2^30 bytes (the same split as PyTorch's allocator logs
//! vs. `nvidia-smi`'s MiB; torchtune reports GiB, PEFT's benchmark GB).

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A number of bytes.
///
/// `Display` prints decimal GB (and MB below 1 GB) with the binary GiB in parentheses, e.g.
/// `12.35 GB (11.50 GiB)`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Bytes(pub u64);

impl Bytes {
    /// Zero bytes.
    pub const ZERO: Bytes = Bytes(0);

    /// From decimal gigabytes (1 GB = 10^9 bytes); negative values give zero.
    pub fn from_gb(gb: f64) -> Bytes {
        Bytes::from_f64(gb * 1e9)
    }

    /// From binary gibibytes (1 GiB = 2^30 bytes); negative values give zero.
    pub fn from_gib(gib: f64) -> Bytes {
        Bytes::from_f64(gib * GIB as f64)
    }

    /// From binary mebibytes (1 MiB = 2^20 bytes).
    pub fn from_mib(mib: f64) -> Bytes {
        Bytes::from_f64(mib * MIB as f64)
    }

    /// From a floating-point byte count, rounded up; NaN and negative values give zero.
    pub fn from_f64(bytes: f64) -> Bytes {
        if bytes.is_nan() || bytes <= 0.0 {
            Bytes(0)
        } else if bytes >= u64::MAX as f64 {
            Bytes(u64::MAX)
        } else {
            Bytes(bytes.ceil() as u64)
        }
    }

    /// The count as `f64`.
    pub fn as_f64(self) -> f64 {
        self.0 as f64
    }

    /// Decimal gigabytes (10^9).
    pub fn gb(self) -> f64 {
        self.0 as f64 / 1e9
    }

    /// Binary gibibytes (2^30).
    pub fn gib(self) -> f64 {
        self.0 as f64 / GIB as f64
    }

    /// Decimal megabytes (10^6).
    pub fn mb(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// `self - other`, or zero when `other` is larger.
    pub fn saturating_sub(self, other: Bytes) -> Bytes {
        Bytes(self.0.saturating_sub(other.0))
    }
}

/// 2^20 bytes.
pub const MIB: u64 = 1 << 20;
/// 2^30 bytes.
pub const GIB: u64 = 1 << 30;

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 >= 1_000_000_000 {
            write!(f, "{:.2} GB ({:.2} GiB)", self.gb(), self.gib())
        } else if self.0 >= 1_000_000 {
            write!(
                f,
                "{:.1} MB ({:.1} MiB)",
                self.mb(),
                self.0 as f64 / MIB as f64
            )
        } else {
            write!(f, "{} B", self.0)
        }
    }
}

impl Add for Bytes {
    type Output = Bytes;
    fn add(self, rhs: Bytes) -> Bytes {
        Bytes(self.0.saturating_add(rhs.0))
    }
}

impl AddAssign for Bytes {
    fn add_assign(&mut self, rhs: Bytes) {
        self.0 = self.0.saturating_add(rhs.0);
    }
}

impl Sub for Bytes {
    type Output = Bytes;
    /// Saturating subtraction (never below zero).
    fn sub(self, rhs: Bytes) -> Bytes {
        self.saturating_sub(rhs)
    }
}

impl std::iter::Sum for Bytes {
    fn sum<I: Iterator<Item = Bytes>>(iter: I) -> Bytes {
        iter.fold(Bytes::ZERO, |a, b| a + b)
    }
}

/// A parsed size: the bytes and, when the text was ambiguous, how it was read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParsedSize {
    /// The size in bytes.
    pub bytes: Bytes,
    /// `Some(explanation)` when a unit was assumed (bare number, single-letter suffix, lowercase
    /// `b`), `None` when the unit was explicit (`GB`, `GiB`, …).
    pub assumed: Option<String>,
}

/// Parses a size such as `"6GB"`, `"12GiB"`, `"512MB"`, `"6 gb"`, `"6G"`, `"1.5 TB"` or `"4096"`.
///
/// Rules (case-insensitive, spaces ignored):
/// - `KB`/`MB`/`GB`/`TB` are decimal (10^3…10^12), as in `accelerate`'s `max_memory` strings;
/// - `KiB`/`MiB`/`GiB`/`TiB` are binary (2^10…2^40);
/// - a single-letter suffix `K`/`M`/`G`/`T` is read as **binary** (the Slurm / Docker / `free -h`
///   convention) and reported in [`ParsedSize::assumed`];
/// - a lowercase `b` (`"6gb"`) is read as bytes, not bits, and reported as assumed;
/// - a bare number is bytes, reported as assumed;
/// - the number may use scientific notation (`"1.5e3MB"`).
///
/// # Errors
/// [`Error::InvalidSize`] for an empty string, a negative or non-finite number, an unknown unit,
/// or a size of 2^64 bytes or more (it does not fit the `u64` byte count).
///
/// ```
/// use lora_memory::{parse_size, Bytes};
/// assert_eq!(parse_size("6GB").unwrap().bytes, Bytes(6_000_000_000));
/// assert_eq!(parse_size("12GiB").unwrap().bytes, Bytes(12 << 30));
/// assert!(parse_size("6G").unwrap().assumed.is_some());
/// ```
pub fn parse_size(input: &str) -> Result<ParsedSize> {
    let err = |reason: &str| Error::InvalidSize {
        input: input.to_string(),
        reason: reason.to_string(),
    };
    let compact: String = input
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '_')
        .collect();
    if compact.is_empty() {
        return Err(err("empty"));
    }
    let mut split = compact
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == ','))
        .unwrap_or(compact.len());
    // scientific notation: `1e9`, `1.5E3MB` (an `e` followed by an optionally signed digit)
    let rest = &compact.as_bytes()[split..];
    if split > 0 && matches!(rest.first(), Some(b'e' | b'E')) {
        let sign = usize::from(matches!(rest.get(1), Some(b'+' | b'-')));
        let digits = rest[1 + sign..]
            .iter()
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits > 0 {
            split += 1 + sign + digits;
        }
    }
    let (num_text, unit_text) = compact.split_at(split);
    let num_text = num_text.replace(',', "");
    if num_text.is_empty() {
        return Err(err("no number before the unit"));
    }
    let value: f64 = num_text.parse().map_err(|_| err("not a number"))?;
    if !value.is_finite() || value < 0.0 {
        return Err(err("must be a finite, non-negative number"));
    }
    let lower = unit_text.to_ascii_lowercase();
    let (factor, mut assumed): (f64, Option<String>) = match lower.as_str() {
        "" => (1.0, Some("no unit: read as bytes".into())),
        "b" => (1.0, None),
        "kb" => (1e3, None),
        "mb" => (1e6, None),
        "gb" => (1e9, None),
        "tb" => (1e12, None),
        "kib" => (1024.0, None),
        "mib" => (MIB as f64, None),
        "gib" => (GIB as f64, None),
        "tib" => (GIB as f64 * 1024.0, None),
        "k" => (
            1024.0,
            Some("'K' read as KiB (2^10 bytes); write KB for 10^3".into()),
        ),
        "m" => (
            MIB as f64,
            Some("'M' read as MiB (2^20 bytes); write MB for 10^6".into()),
        ),
        "g" => (
            GIB as f64,
            Some("'G' read as GiB (2^30 bytes); write GB for 10^9".into()),
        ),
        "t" => (
            GIB as f64 * 1024.0,
            Some("'T' read as TiB (2^40 bytes); write TB for 10^12".into()),
        ),
        _ => return Err(err(&format!("unknown unit {unit_text:?}"))),
    };
    if assumed.is_none() && unit_text.ends_with('b') && unit_text.len() > 1 {
        assumed = Some(format!(
            "lowercase 'b' in {unit_text:?} read as bytes, not bits"
        ));
    }
    let bytes = value * factor;
    // u64::MAX as f64 rounds up to 2^64, so `>=` catches every value that does not fit
    if bytes >= u64::MAX as f64 {
        return Err(err(&format!(
            "{bytes:.3e} bytes is more than the largest size that can be represented ({} bytes, about 18.4 EB)",
            u64::MAX
        )));
    }
    Ok(ParsedSize {
        bytes: Bytes::from_f64(bytes),
        assumed,
    })
}

impl std::str::FromStr for Bytes {
    type Err = Error;
    /// Same rules as [`parse_size`]; the interpretation note is dropped.
    fn from_str(s: &str) -> Result<Bytes> {
        parse_size(s).map(|p| p.bytes)
    }
}

/// A memory size as a config file writes it (`"6GB"`, `"12GiB"`, or a bare number of bytes), with
/// its byte count; serialized back as the text, so a config round-trips unchanged. Used by the
/// training config's `memory.budget` and the tagger's `max_memory` caps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    /// As written.
    pub text: String,
    /// Bytes, as [`parse_size`] reads the text.
    pub bytes: u64,
    /// How an ambiguous unit was read (bare number, single-letter suffix, lowercase `b`), from
    /// [`ParsedSize::assumed`].
    pub assumed: Option<String>,
}

impl Size {
    /// Parses `text` with [`parse_size`].
    ///
    /// # Errors
    /// [`Error::InvalidSize`] as [`parse_size`].
    pub fn parse(text: &str) -> Result<Size> {
        let p = parse_size(text)?;
        Ok(Size {
            text: text.to_string(),
            bytes: p.bytes.0,
            assumed: p.assumed,
        })
    }
}

impl Serialize for Size {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.text)
    }
}

impl<'de> Deserialize<'de> for Size {
    /// A string, or a number (of bytes) as YAML and TOML write one unquoted.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let text = match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(s) => s,
            serde_json::Value::Number(n) => n.to_string(),
            other => {
                return Err(serde::de::Error::custom(format!(
                    "expected a size like \"6GB\", found {other}"
                )));
            }
        };
        Size::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_forms() {
        assert_eq!(
            parse_size("6GB").unwrap(),
            ParsedSize {
                bytes: Bytes(6_000_000_000),
                assumed: None
            }
        );
        assert_eq!(parse_size("12GiB").unwrap().bytes, Bytes(12 * GIB));
        assert_eq!(parse_size("512MB").unwrap().bytes, Bytes(512_000_000));
        let lower = parse_size("6 gb").unwrap();
        assert_eq!(lower.bytes, Bytes(6_000_000_000));
        assert!(lower.assumed.unwrap().contains("not bits"));
        let g = parse_size("6G").unwrap();
        assert_eq!(g.bytes, Bytes(6 * GIB));
        assert!(g.assumed.unwrap().contains("GiB"));
        let bare = parse_size("4096").unwrap();
        assert_eq!(bare.bytes, Bytes(4096));
        assert!(bare.assumed.is_some());
        assert_eq!(
            parse_size("1.5 TB").unwrap().bytes,
            Bytes(1_500_000_000_000)
        );
        assert_eq!(parse_size("1,024 MiB").unwrap().bytes, Bytes(GIB));
    }

    #[test]
    fn rejects_garbage_with_the_input_in_the_message() {
        for bad in ["", "GB", "6XB", "-3GB", "abc"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn scientific_notation_and_sizes_too_large_for_u64() {
        assert_eq!(parse_size("1.5e3MB").unwrap().bytes, Bytes(1_500_000_000));
        assert_eq!(parse_size("2E+1GB").unwrap().bytes, Bytes(20_000_000_000));
        assert_eq!(parse_size("1e9").unwrap().bytes, Bytes(1_000_000_000));
        for big in ["1e30GB", "99999999TB", "18446744073709551616"] {
            let e = parse_size(big).unwrap_err().to_string();
            assert!(e.contains(big) && e.contains("largest size"), "{e}");
        }
        // the largest exact byte count below 2^64 that f64 holds still parses
        assert_eq!(
            parse_size("18446744073709549568").unwrap().bytes,
            Bytes(18_446_744_073_709_549_568)
        );
        // `e` without digits is still a unit error
        assert!(
            parse_size("6eGB")
                .unwrap_err()
                .to_string()
                .contains("unknown unit")
        );
    }

    #[test]
    fn display_shows_both_units() {
        assert_eq!(Bytes(12_345_000_000).to_string(), "12.35 GB (11.50 GiB)");
        assert_eq!(Bytes(5_000_000).to_string(), "5.0 MB (4.8 MiB)");
        assert_eq!(Bytes(12).to_string(), "12 B");
        assert_eq!(Bytes(3) - Bytes(5), Bytes(0));
    }

    #[test]
    fn a_size_setting_keeps_its_text_and_reads_numbers_as_bytes() {
        let s: Size = serde_json::from_str("\"6GB\"").unwrap();
        assert_eq!(
            (s.text.as_str(), s.bytes, s.assumed.is_none()),
            ("6GB", 6_000_000_000, true)
        );
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"6GB\"");
        let n: Size = serde_json::from_str("4096").unwrap();
        assert_eq!((n.bytes, n.assumed.is_some()), (4096, true));
        let e = serde_json::from_str::<Size>("[1]").unwrap_err().to_string();
        assert!(e.contains("expected a size like \"6GB\""), "{e}");
        assert!(serde_json::from_str::<Size>("\"6 parsecs\"").is_err());
    }
}
