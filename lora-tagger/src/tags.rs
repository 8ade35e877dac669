//! Tag post-processing: from a model's scored tags to the caption line a trainer reads.
//!
//! [`PostProcess::apply`] runs, in order:
//! 1. drop rating tags unless [`PostProcess::include_rating`];
//! 2. order: rating tags (when kept), then character tags (when [`PostProcess::character_first`]),
//!    then by score, highest first (stable: equal scores keep the model's order);
//! 3. normalize each tag ([`normalize_tag`]: underscores → spaces for tags longer than 3
//!    characters, as kohya-ss `finetune/tag_images_by_wd14_tagger.py` does, which keeps kaomoji
//!    such as `^_^` intact; optional lowercase);
//! 4. replacements (`from=to`; an empty `to` removes the tag), then undesired tags, compared
//!    after normalization and case-insensitively;
//! 5. dedupe (after normalization, case-insensitive, first occurrence wins);
//! 6. move each [`PostProcess::first_if_found`] tag the model found to the front, in turn (kohya's
//!    `--always_first_tags`: the last one listed ends up first, as there);
//! 7. keep at most [`PostProcess::max_tags`] (the always-first tags do not count);
//! 8. put [`PostProcess::always_first`] in front, as written (the trigger word — kohya's
//!    `keep_tokens` keeps that many leading tags fixed when it shuffles captions), removing their
//!    duplicates from the rest;
//! 9. escape parentheses (`(` → `\(`) when asked, for A1111 prompt syntax where bare
//!    parentheses mean emphasis.
//!
//! [`join_tags`] writes them joined with `", "`.
//!
//! kohya-ss `finetune/tag_images_by_wd14_tagger.py` options and their settings here:
//! `--undesired_tags` → [`PostProcess::undesired_tags`], `--remove_underscore` →
//! [`PostProcess::replace_underscores`] (on by default here), `--character_tags_first` →
//! [`PostProcess::character_first`] (on by default here), `--always_first_tags` →
//! [`PostProcess::first_if_found`], `--tag_replacement` → [`PostProcess::replacements`] through
//! [`parse_kohya_tag_replacement`], `--use_rating_tags` → [`PostProcess::include_rating`].
//! Tags are ordered by score, where kohya keeps the label file's order.

use serde::{Deserialize, Serialize};

use crate::{ScoredTag, TagCategory};

/// Post-processing settings (config section `tags`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PostProcess {
    /// Underscores → spaces for tags longer than 3 characters. Default true.
    pub replace_underscores: bool,
    /// Lowercase every model tag. Default false.
    pub lowercase: bool,
    /// `(` → `\(` and `)` → `\)`. Default false.
    pub escape_parentheses: bool,
    /// Tags never written (compared after normalization, case-insensitively).
    pub undesired_tags: Vec<String>,
    /// `from=to` rewrites (after normalization); an empty `to` removes the tag.
    pub replacements: Vec<String>,
    /// Tags written first, as written (trigger word, class word).
    pub always_first: Vec<String>,
    /// Tags moved to the front when the model found them (kohya's `--always_first_tags`; config
    /// `tags.first_if_found` or `tags.always_first_tags`): each found one is moved to the front in
    /// turn, so the last one listed comes first. Unlike [`PostProcess::always_first`], a tag the
    /// model did not find is not written.
    pub first_if_found: Vec<String>,
    /// At most this many model tags (after the always-first ones); `None` = all above threshold.
    pub max_tags: Option<usize>,
    /// Keep rating tags (category 9). Default false.
    pub include_rating: bool,
    /// Character tags before general tags. Default true.
    pub character_first: bool,
}

impl Default for PostProcess {
    fn default() -> Self {
        PostProcess {
            replace_underscores: true,
            lowercase: false,
            escape_parentheses: false,
            undesired_tags: Vec::new(),
            replacements: Vec::new(),
            always_first: Vec::new(),
            first_if_found: Vec::new(),
            max_tags: None,
            include_rating: false,
            character_first: true,
        }
    }
}

/// Normalizes one tag: trims it, replaces `_` with a space when the tag is longer than 3
/// characters (so `^_^`, `o_o` and `>_<` stay; rule of kohya-ss
/// `finetune/tag_images_by_wd14_tagger.py`, `--remove_underscore`), and lowercases it when asked.
///
/// ```
/// use lora_tagger::tags::normalize_tag;
/// assert_eq!(normalize_tag("long_hair", true, false), "long hair");
/// assert_eq!(normalize_tag("^_^", true, false), "^_^");
/// assert_eq!(normalize_tag("Hatsune_Miku", true, true), "hatsune miku");
/// ```
pub fn normalize_tag(tag: &str, replace_underscores: bool, lowercase: bool) -> String {
    let t = tag.trim();
    let t = if replace_underscores && t.chars().count() > 3 {
        t.replace('_', " ")
    } else {
        t.to_string()
    };
    if lowercase { t.to_lowercase() } else { t }
}

/// Escapes `(` and `)` with a backslash (A1111 prompt syntax); already escaped ones stay as they are.
///
/// ```
/// assert_eq!(lora_tagger::tags::escape_parentheses("hood (cloak)"), r"hood \(cloak\)");
/// assert_eq!(lora_tagger::tags::escape_parentheses(r"hood \(cloak\)"), r"hood \(cloak\)");
/// ```
pub fn escape_parentheses(tag: &str) -> String {
    let mut out = String::with_capacity(tag.len() + 4);
    let mut prev = '\0';
    for c in tag.chars() {
        if (c == '(' || c == ')') && prev != '\\' {
            out.push('\\');
        }
        out.push(c);
        prev = c;
    }
    out
}

/// The comparison key of a tag: unescaped, underscores as spaces, lowercase, inner whitespace
/// collapsed. Two tags with the same key are the same tag.
pub fn tag_key(tag: &str) -> String {
    tag.replace("\\(", "(")
        .replace("\\)", ")")
        .replace('_', " ")
        .to_lowercase()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}

/// Parses kohya's `--tag_replacement` (`source1,target1;source2,target2`, with `\,` and `\;`
/// for literal commas and semicolons) into `from=to` replacements
/// ([`PostProcess::replacements`]).
///
/// ```
/// use lora_tagger::tags::parse_kohya_tag_replacement;
/// let r = parse_kohya_tag_replacement(r"1girl,one girl;a\,b,c\;d").unwrap();
/// assert_eq!(r, ["1girl=one girl", "a,b=c;d"]);
/// assert!(parse_kohya_tag_replacement("no target").is_err());
/// ```
///
/// # Errors
/// A message naming the pair that is not `source,target` (kohya refuses it too).
pub fn parse_kohya_tag_replacement(spec: &str) -> Result<Vec<String>, String> {
    const COMMA: &str = "\u{1}";
    const SEMI: &str = "\u{2}";
    let escaped = spec.replace("\\,", COMMA).replace("\\;", SEMI);
    escaped
        .split(';')
        .filter(|pair| !pair.trim().is_empty())
        .map(|pair| {
            let parts: Vec<&str> = pair.split(',').collect();
            let [from, to] = parts[..] else {
                return Err(format!(
                    "{:?} is not `source,target` (escape commas in tags as `\\,`, semicolons as `\\;`)",
                    pair.replace(COMMA, ",").replace(SEMI, ";")
                ));
            };
            let un = |t: &str| t.replace(COMMA, ",").replace(SEMI, ";");
            Ok(format!("{}={}", un(from), un(to)))
        })
        .collect()
}

/// Joins tags into a caption line with `", "`.
pub fn join_tags(tags: &[String]) -> String {
    tags.join(", ")
}

/// Splits a caption line into its tags (comma-separated, trimmed, empty ones dropped).
pub fn split_caption(text: &str) -> Vec<String> {
    text.split([',', '\n'])
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect()
}

impl PostProcess {
    fn replacement_pairs(&self) -> Vec<(String, String)> {
        self.replacements
            .iter()
            .filter_map(|r| r.split_once('='))
            .map(|(f, t)| {
                (
                    tag_key(f),
                    normalize_tag(t, self.replace_underscores, self.lowercase),
                )
            })
            .collect()
    }

    /// Turns a model's scored tags into the ordered caption tags (see the module docs for the
    /// steps).
    ///
    /// ```
    /// use lora_tagger::{ScoredTag, TagCategory, tags::PostProcess};
    /// let t = |tag: &str, score: f32| ScoredTag { tag: tag.into(), score, category: TagCategory::General };
    /// let pp = PostProcess { always_first: vec!["sks".into()], ..Default::default() };
    /// let out = pp.apply(&[t("long_hair", 0.6), t("1girl", 0.9), t("long hair", 0.5)]);
    /// assert_eq!(out, ["sks", "1girl", "long hair"]);
    /// ```
    pub fn apply(&self, tags: &[ScoredTag]) -> Vec<String> {
        let rank = |c: TagCategory| match c {
            TagCategory::Rating => 0,
            TagCategory::Character if self.character_first => 1,
            _ => 2,
        };
        let mut items: Vec<&ScoredTag> = tags
            .iter()
            .filter(|t| self.include_rating || t.category != TagCategory::Rating)
            .collect();
        items.sort_by(|a, b| {
            rank(a.category).cmp(&rank(b.category)).then(
                b.score
                    .partial_cmp(&a.score)
                    .unwrap_or(std::cmp::Ordering::Equal),
            )
        });
        let replacements = self.replacement_pairs();
        let undesired: Vec<String> = self.undesired_tags.iter().map(|t| tag_key(t)).collect();
        let first: Vec<String> = self
            .always_first
            .iter()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect();
        let mut seen: std::collections::HashSet<String> =
            first.iter().map(|t| tag_key(t)).collect();
        let mut out: Vec<String> = Vec::new();
        for t in items {
            let mut tag = normalize_tag(&t.tag, self.replace_underscores, self.lowercase);
            if let Some((_, to)) = replacements.iter().find(|(from, _)| *from == tag_key(&tag)) {
                tag = to.clone();
            }
            if tag.is_empty() {
                continue;
            }
            let key = tag_key(&tag);
            if undesired.contains(&key) || !seen.insert(key) {
                continue;
            }
            out.push(tag);
        }
        for f in &self.first_if_found {
            let k = tag_key(f);
            if let Some(pos) = out.iter().position(|t| tag_key(t) == k) {
                let t = out.remove(pos);
                out.insert(0, t);
            }
        }
        if let Some(m) = self.max_tags {
            out.truncate(m);
        }
        let mut all = Vec::with_capacity(first.len() + out.len());
        let mut first_seen = std::collections::HashSet::new();
        for f in first {
            if first_seen.insert(tag_key(&f)) {
                all.push(f);
            }
        }
        all.extend(out);
        if self.escape_parentheses {
            all = all.iter().map(|t| escape_parentheses(t)).collect();
        }
        all
    }

    /// [`PostProcess::apply`] joined into one caption line.
    pub fn caption(&self, tags: &[ScoredTag]) -> String {
        join_tags(&self.apply(tags))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(tag: &str, score: f32, category: TagCategory) -> ScoredTag {
        ScoredTag {
            tag: tag.into(),
            score,
            category,
        }
    }

    /// WD14 output for a typical anime portrait (tag names from the WD14 `selected_tags.csv`).
    fn wd14_like() -> Vec<ScoredTag> {
        use TagCategory::*;
        vec![
            // The image tagger keeps only the top-1 rating.
            st("general", 0.91, Rating),
            st("1girl", 0.99, General),
            st("solo", 0.97, General),
            st("long_hair", 0.93, General),
            st("hatsune_miku", 0.96, Character),
            st("twintails", 0.88, General),
            st("hood_(cloak)", 0.40, General),
            st("^_^", 0.55, General),
            st("Long_Hair", 0.30, General),
            st("aqua_hair", 0.86, General),
            st("monochrome", 0.36, General),
        ]
    }

    #[test]
    fn defaults_order_normalize_and_drop_ratings() {
        let out = PostProcess::default().apply(&wd14_like());
        assert_eq!(
            out,
            [
                "hatsune miku",
                "1girl",
                "solo",
                "long hair",
                "twintails",
                "aqua hair",
                "^_^",
                "hood (cloak)",
                "monochrome"
            ]
        );
        assert_eq!(join_tags(&out[..3]), "hatsune miku, 1girl, solo");
    }

    #[test]
    fn every_option_does_its_part() {
        let pp = PostProcess {
            replace_underscores: true,
            lowercase: true,
            escape_parentheses: true,
            undesired_tags: vec!["monochrome".into(), "Solo".into()],
            replacements: vec!["1girl=one girl".into(), "twintails=".into()],
            always_first: vec!["sks".into(), "Aqua_Hair".into()],
            first_if_found: Vec::new(),
            max_tags: Some(4),
            include_rating: true,
            character_first: false,
        };
        let out = pp.apply(&wd14_like());
        // rating first (kept), then by score; "aqua hair" moved to the front as written.
        assert_eq!(
            out,
            [
                "sks",
                "Aqua_Hair",
                "general",
                "one girl",
                "hatsune miku",
                "long hair"
            ]
        );
        let out = PostProcess {
            escape_parentheses: true,
            ..Default::default()
        }
        .apply(&wd14_like());
        assert!(out.contains(&r"hood \(cloak\)".to_string()), "{out:?}");
    }

    #[test]
    fn short_tags_keep_underscores_and_dedupe_is_after_normalization() {
        let g = TagCategory::General;
        let out = PostProcess::default().apply(&[
            st("o_o", 0.9, g),
            st("blue_eyes", 0.8, g),
            st("blue eyes", 0.7, g),
            st("BLUE_EYES", 0.6, g),
        ]);
        assert_eq!(out, ["o_o", "blue eyes"]);
        assert_eq!(
            split_caption(" a photo ,tabby cat,, sks\n"),
            ["a photo", "tabby cat", "sks"]
        );
        assert_eq!(tag_key(r"Hood_\(Cloak\)"), "hood (cloak)");
    }

    #[test]
    fn kohya_always_first_tags_move_found_tags_only() {
        let pp = PostProcess {
            // kohya's loop moves each found tag to the front in turn: the last listed ends first
            first_if_found: vec!["solo".into(), "twintails".into(), "1boy".into()],
            always_first: vec!["sks".into()],
            max_tags: Some(3),
            ..Default::default()
        };
        let out = pp.apply(&wd14_like());
        assert_eq!(out, ["sks", "twintails", "solo", "hatsune miku"]);
    }

    #[test]
    fn kohya_tag_replacement_feeds_the_replacements() {
        let r =
            parse_kohya_tag_replacement(r"long hair,long_hair_(style);hood (cloak),hood\, cloak")
                .unwrap();
        let pp = PostProcess {
            replacements: r,
            replace_underscores: false,
            ..Default::default()
        };
        let out = pp.apply(&wd14_like());
        assert!(out.contains(&"long_hair_(style)".to_string()), "{out:?}");
        assert!(out.contains(&"hood, cloak".to_string()), "{out:?}");
        let e = parse_kohya_tag_replacement("a,b;c").unwrap_err();
        assert!(e.contains("\"c\""), "{e}");
    }
}
