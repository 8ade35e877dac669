//! The WD14 label file `selected_tags.csv`: header `tag_id,name,category,count`, one tag per
//! row in the order of the model's outputs; category 0 general, 4 character, 9 rating
//! (SmilingWolf's WD14 tagger repositories; read by `app.py` `load_labels`).

use std::path::Path;

use crate::TagCategory;
use crate::error::{Error, Result};

/// The labels of a tagger's outputs, index-aligned with its logits.
#[derive(Debug, Clone, PartialEq)]
pub struct Labels {
    /// Tag names.
    pub names: Vec<String>,
    /// Their categories.
    pub categories: Vec<TagCategory>,
}

impl Labels {
    /// Number of labels.
    pub fn len(&self) -> usize {
        self.names.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// True when some label is a rating (category 9).
    pub fn has_ratings(&self) -> bool {
        self.categories.contains(&TagCategory::Rating)
    }
}

/// Splits one CSV record (RFC 4180 quoting: `"a, b"`, `""` for a quote).
fn split_record(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cur.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => out.push(std::mem::take(&mut cur)),
            _ => cur.push(c),
        }
    }
    out.push(cur);
    out
}

/// Reads `selected_tags.csv`.
///
/// # Errors
/// [`Error::Io`] when unreadable; [`Error::Format`] naming the file and line for a missing
/// `name`/`category` column, a category other than 0, 4 or 9, or an empty file.
pub fn read_selected_tags(path: &Path) -> Result<Labels> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let fmt = |msg: String| Error::Format {
        path: path.to_path_buf(),
        msg,
    };
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or_else(|| {
        fmt("empty label file; expected the header tag_id,name,category,count".into())
    })?;
    let cols: Vec<String> = split_record(header.trim_start_matches('\u{feff}'))
        .into_iter()
        .map(|c| c.trim().to_string())
        .collect();
    let col = |name: &str| {
        cols.iter().position(|c| c == name).ok_or_else(|| {
            fmt(format!(
                "header {header:?} has no `{name}` column; expected tag_id,name,category,count"
            ))
        })
    };
    let (ni, ci) = (col("name")?, col("category")?);
    let mut labels = Labels {
        names: Vec::new(),
        categories: Vec::new(),
    };
    for (i, line) in lines {
        let rec = split_record(line);
        let get = |j: usize| {
            rec.get(j)
                .map(|s| s.trim())
                .ok_or_else(|| fmt(format!("line {}: too few columns: {line:?}", i + 1)))
        };
        let name = get(ni)?;
        let cat = match get(ci)? {
            "0" => TagCategory::General,
            "4" => TagCategory::Character,
            "9" => TagCategory::Rating,
            other => {
                return Err(fmt(format!(
                    "line {}: category {other:?} of {name:?}; expected 0 (general), 4 (character) or 9 (rating)",
                    i + 1
                )));
            }
        };
        labels.names.push(name.to_string());
        labels.categories.push(cat);
    }
    if labels.is_empty() {
        return Err(fmt("no labels after the header".into()));
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_wd14_format() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("selected_tags.csv");
        // Rows as in SmilingWolf's wd-v1-4 taggers' selected_tags.csv.
        std::fs::write(
            &p,
            "tag_id,name,category,count\n9999999,general,9,807366\n9999998,sensitive,9,3447996\n\
             470575,1girl,0,4278472\n212816,solo,0,3426446\n1707736,\"hood_(cloak)\",0,1234\n\
             1265,\"a, b\"\"c\",0,1\n15099,hatsune_miku,4,86236\n",
        )
        .unwrap();
        let l = read_selected_tags(&p).unwrap();
        assert_eq!(l.len(), 7);
        assert_eq!(l.names[4], "hood_(cloak)");
        assert_eq!(l.names[5], "a, b\"c");
        assert_eq!(l.categories[0], TagCategory::Rating);
        assert_eq!(l.categories[6], TagCategory::Character);
        assert!(l.has_ratings());
        std::fs::write(&p, "tag_id,name,category,count\n1,x,7,0\n").unwrap();
        let e = read_selected_tags(&p).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("\"7\""), "{e}");
        std::fs::write(&p, "id,label\n").unwrap();
        let e = read_selected_tags(&p).unwrap_err().to_string();
        assert!(e.contains("no `name` column"), "{e}");
    }
}
