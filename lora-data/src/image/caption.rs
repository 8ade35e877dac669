//! Caption sidecars and kohya's caption/tag processing.
//!
//! Order of operations, as in kohya sd-scripts `library/train_util.py`
//! (`BaseDataset.process_caption`): prefix/suffix → caption dropout (whole caption → `""`) →
//! split on `caption_separator` (tags stripped) → the first `keep_tokens` tags fixed → shuffle the
//! rest (`shuffle_caption`) → tag dropout on the rest (`caption_tag_dropout_rate`) → join. kohya
//! only splits when shuffling or tag dropout is on; otherwise the caption is kept as written, and so
//! here.
//!
//! Differences from kohya, on purpose:
//! - files are read as UTF-8 with a BOM stripped (kohya reads `utf-8`, so a BOM glues itself to the
//!   first tag) and CRLF normalized;
//! - the line is chosen before the prefix is added (kohya adds the prefix to the whole multi-line
//!   text, so with random lines only the first line got it); the first *non-empty* line is used;
//! - tags are joined with the configured separator followed by one space unless it already ends in
//!   whitespace (kohya always joins with `", "`, even for other separators); empty tags are dropped.

use super::config::SubsetConfig;
use crate::rng::Rng;

/// Why a caption file cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CaptionError {
    /// Not valid UTF-8; `at` is the byte offset of the first invalid byte.
    NonUtf8 {
        /// Byte offset.
        at: usize,
    },
    /// Only whitespace (after BOM removal).
    Empty,
}

/// Decodes caption file bytes: UTF-8, BOM stripped, CRLF/CR → LF, surrounding whitespace trimmed.
///
/// # Errors
/// [`CaptionError::NonUtf8`] or [`CaptionError::Empty`].
pub fn decode_caption(bytes: &[u8]) -> Result<String, CaptionError> {
    let text = std::str::from_utf8(bytes).map_err(|e| CaptionError::NonUtf8 {
        at: e.valid_up_to(),
    })?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let text = text.replace("\r\n", "\n").replace('\r', "\n");
    let text = text.trim();
    if text.is_empty() {
        return Err(CaptionError::Empty);
    }
    Ok(text.to_string())
}

/// The caption line to use: the first non-empty line, or a random non-empty one.
pub fn choose_line(text: &str, random: bool, rng: &mut Rng) -> String {
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    match lines.len() {
        0 => String::new(),
        1 => lines[0].to_string(),
        n if random => lines[rng.below(n)].to_string(),
        _ => lines[0].to_string(),
    }
}

/// The string placed between tags when joining: the separator plus a space unless it ends in
/// whitespace (`","` → `", "`, kohya's output for the default separator).
pub fn join_separator(separator: &str) -> String {
    if separator.ends_with(char::is_whitespace) || separator.is_empty() {
        separator.to_string()
    } else {
        format!("{separator} ")
    }
}

/// Applies kohya's caption processing (see the module docs) to one caption line, drawing every
/// random decision from `rng` in a fixed order (dropout, shuffle, tag dropout).
pub fn process_caption(line: &str, subset: &SubsetConfig, rng: &mut Rng) -> String {
    let mut caption = line.to_string();
    if let Some(p) = subset.caption_prefix.as_deref().filter(|p| !p.is_empty()) {
        caption = format!("{p} {caption}");
    }
    if let Some(s) = subset.caption_suffix.as_deref().filter(|s| !s.is_empty()) {
        caption = format!("{caption} {s}");
    }
    if subset.caption_dropout_rate > 0.0 && rng.next_f64() < subset.caption_dropout_rate {
        return String::new();
    }
    if !(subset.shuffle_caption || subset.caption_tag_dropout_rate > 0.0) {
        return caption;
    }
    let sep = if subset.caption_separator.is_empty() {
        ","
    } else {
        subset.caption_separator.as_str()
    };
    let tags: Vec<&str> = caption
        .split(sep)
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .collect();
    let keep = subset.keep_tokens.min(tags.len());
    let (fixed, flex) = tags.split_at(keep);
    let mut flex = flex.to_vec();
    if subset.shuffle_caption {
        rng.shuffle(&mut flex);
    }
    if subset.caption_tag_dropout_rate > 0.0 {
        flex.retain(|_| rng.next_f64() >= subset.caption_tag_dropout_rate);
    }
    let mut out: Vec<&str> = fixed.to_vec();
    out.extend(flex);
    out.join(&join_separator(sep))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn subset() -> SubsetConfig {
        SubsetConfig::new("unused")
    }

    #[test]
    fn decode_strips_bom_and_crlf_and_rejects_bad_input() {
        assert_eq!(
            decode_caption(b"\xef\xbb\xbfcat, dog\r\nsecond\r\n").unwrap(),
            "cat, dog\nsecond"
        );
        assert_eq!(decode_caption(b" \r\n\t"), Err(CaptionError::Empty));
        assert_eq!(
            decode_caption(b"caf\xe9"),
            Err(CaptionError::NonUtf8 { at: 3 })
        );
    }

    #[test]
    fn unprocessed_caption_is_kept_as_written_with_prefix_and_suffix() {
        let mut s = subset();
        s.caption_prefix = Some("sks".into());
        s.caption_suffix = Some("masterpiece".into());
        let out = process_caption("a dog,  on grass", &s, &mut Rng::new(1));
        assert_eq!(out, "sks a dog,  on grass masterpiece");
    }

    #[test]
    fn keep_tokens_stay_first_and_the_rest_is_a_permutation() {
        let mut s = subset();
        s.shuffle_caption = true;
        s.keep_tokens = 2;
        let tags = "sks, dog, grass, sky, ball, tree, red, blue";
        let mut orders = std::collections::HashSet::new();
        for seed in 0..20 {
            let out = process_caption(tags, &s, &mut Rng::new(seed));
            let parts: Vec<&str> = out.split(", ").collect();
            assert_eq!(&parts[..2], &["sks", "dog"]);
            let mut rest = parts[2..].to_vec();
            rest.sort();
            assert_eq!(rest, vec!["ball", "blue", "grass", "red", "sky", "tree"]);
            orders.insert(out);
        }
        assert!(orders.len() > 10, "shuffle should vary with the seed");
    }

    #[test]
    fn configured_separator_is_used_to_split_and_join() {
        let mut s = subset();
        s.shuffle_caption = true;
        s.caption_separator = "|".into();
        s.keep_tokens = 1;
        let out = process_caption("a|b c|d", &s, &mut Rng::new(3));
        assert!(out.starts_with("a| "), "{out}");
        assert_eq!(out.split("| ").count(), 3);
    }

    #[test]
    fn dropout_rates_are_respected_statistically() {
        let mut s = subset();
        s.caption_dropout_rate = 0.25;
        let mut rng = Rng::new(9);
        let empty = (0..4000)
            .filter(|_| process_caption("a, b", &s, &mut rng).is_empty())
            .count();
        assert!((850..1150).contains(&empty), "{empty}");
        let mut s = subset();
        s.caption_tag_dropout_rate = 0.5;
        s.keep_tokens = 1;
        let mut kept = 0;
        for _ in 0..1000 {
            let out = process_caption("k, a, b, c, d", &s, &mut rng);
            assert!(out.starts_with('k'));
            kept += out.split(", ").count() - 1;
        }
        assert!((1800..2200).contains(&kept), "{kept}");
    }

    #[test]
    fn line_choice() {
        let mut rng = Rng::new(0);
        assert_eq!(choose_line("\n  first \nsecond", false, &mut rng), "first");
        let picks: std::collections::HashSet<String> = (0..50)
            .map(|_| choose_line("a\nb\nc", true, &mut rng))
            .collect();
        assert_eq!(picks.len(), 3);
        assert_eq!(join_separator(","), ", ");
        assert_eq!(join_separator(" | "), " | ");
    }
}
