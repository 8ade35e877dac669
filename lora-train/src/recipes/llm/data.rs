//! The causal-LM recipe's training text: files read, cut and split into train and held-out.

use super::*;

/// Reads the training text: one file, or every `.txt` file of a folder (sorted), cut to
/// `max_bytes` at a character boundary.
pub(crate) fn read_text(path: &Path, max_bytes: Option<u64>) -> Result<(String, Vec<PathBuf>)> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .during(format!("reading folder {}", path.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    let mut text = String::new();
    for f in &files {
        let bytes = std::fs::read(f).during(format!("reading {}", f.display()))?;
        let t = String::from_utf8(bytes).map_err(|e| {
            JobError::Config(crate::config::ConfigError::InvalidValue {
                key: "data.train_data_dir".into(),
                value: format!("{:?}", f.display().to_string()),
                expected: format!(
                    "UTF-8 text, but byte {} of {} is not valid UTF-8; convert the file \
                     (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or remove it from the folder",
                    e.utf8_error().valid_up_to(),
                    f.display()
                ),
            })
        })?;
        text.push_str(&t);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        if max_bytes.is_some_and(|m| text.len() as u64 >= m) {
            break;
        }
    }
    if let Some(m) = max_bytes {
        let mut cut = (m as usize).min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    Ok((text, files))
}

/// Splits `text` into (train, held-out): the last `fraction` of it, starting at a line boundary.
pub fn split_tail(text: &str, fraction: f64) -> (&str, &str) {
    if fraction <= 0.0 {
        return (text, "");
    }
    let mut at = ((1.0 - fraction) * text.len() as f64) as usize;
    while at < text.len() && !text.is_char_boundary(at) {
        at += 1;
    }
    let at = text[at..]
        .find('\n')
        .map(|i| at + i + 1)
        .unwrap_or(at)
        .min(text.len());
    (&text[..at], &text[at..])
}
