//! Captions and tags from a vision-language model behind an OpenAI-compatible chat server
//! (Qwen2.5-VL, Gemma 3, Florence-2-style or JoyCaption models served by vLLM, llama.cpp's
//! `llama-server --mmproj`, llama-cpp-python or Ollama).
//!
//! Each image is one request to `POST {base_url}/chat/completions` whose single user message
//! holds the instruction and the image, as the OpenAI API's "image input" content parts:
//!
//! ```json
//! {"model": "Qwen2.5-VL-7B-Instruct",
//!  "messages": [{"role": "user", "content": [
//!      {"type": "text", "text": "<the preset's instruction>"},
//!      {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ…"}}]}],
//!  "max_tokens": 160, "temperature": 0.0, "seed": 0, "stream": false}
//! ```
//!
//! This is the request shape vLLM's and llama.cpp's servers document for images (vLLM:
//! "Multimodal Inputs", `image_url` with a base64 data URL; llama.cpp `tools/server/README.md`,
//! OpenAI-compatible `/chat/completions` with `image_url` parts). No system message is sent: some
//! chat templates refuse one (Gemma's), and the instruction works as well in the user turn.
//!
//! **The image** is decoded here first (so a broken file fails its item without a request),
//! with its EXIF orientation applied (servers decode with PIL or stb_image, which ignore it).
//! When its longer side is at most `max_image_side` (0 = no limit) and no rotation was needed,
//! the file's own bytes are sent (PNG, JPEG, WebP, GIF); otherwise the upright image, scaled so
//! its longer side is `max_image_side` (Lanczos-3), is sent as JPEG at quality 95, or as PNG when
//! the source was PNG.
//!
//! **The reply**: with [`VlmPreset::Tags`] it is parsed as tags
//! ([`super::prompt::parse_scored`]) and goes through the same post-processing as every tagger;
//! with the caption presets it is cleaned ([`clean_caption`]) and written as it is, after the
//! trigger words. Retries, timeouts, concurrency and the API key follow [`super::http`].

use std::fmt;
use std::path::{Path, PathBuf};

use ::image::ImageEncoder as _;
use base64::Engine as _;

use super::http::{ChatServer, ServerOptions};
use super::prompt::{REPLY_EXCERPT_CHARS, parse_scored, strip_reasoning};
use crate::error::{Error, Result};
use crate::{ItemResult, Tagger};

/// Longer side images are scaled down to before sending, pixels, unless configured
/// (`vlm.max_image_side`). 1024 keeps a photo's request under ~0.5 MB and within what
/// Qwen2.5-VL-class models resolve, without the thousands of image tokens a 4000-pixel photo
/// costs.
pub const DEFAULT_MAX_IMAGE_SIDE: u32 = 1024;

/// What to ask the model for (`vlm.preset`), declared with the config that names it.
pub use crate::config::VlmPreset;

impl std::str::FromStr for VlmPreset {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::parse(s)
    }
}

/// Settings of [`VlmTagger`].
#[derive(Debug, Clone, PartialEq)]
pub struct VlmOptions {
    /// The server; `max_tokens` there is what each request asks for (see
    /// [`VlmPreset::default_max_tokens`]).
    pub server: ServerOptions,
    /// What to ask for.
    pub preset: VlmPreset,
    /// Replaces the preset's instruction (`vlm.prompt`); the preset still decides whether the
    /// reply is parsed as tags.
    pub instruction: Option<String>,
    /// Longer side images are scaled down to, pixels; 0 sends every file as it is.
    pub max_image_side: u32,
}

impl Default for VlmOptions {
    fn default() -> Self {
        let preset = VlmPreset::default();
        Self {
            server: ServerOptions {
                max_tokens: preset.default_max_tokens(),
                ..ServerOptions::default()
            },
            preset,
            instruction: None,
            max_image_side: DEFAULT_MAX_IMAGE_SIDE,
        }
    }
}

/// An image as sent: its data URL and what was done to it.
#[derive(Debug, Clone, PartialEq)]
pub struct EncodedImage {
    /// `data:<mime>;base64,<bytes>`.
    pub data_url: String,
    /// The MIME type (`image/png`, `image/jpeg`, `image/webp`, `image/gif`).
    pub mime: &'static str,
    /// Width and height of the image sent, pixels (after orientation and scaling).
    pub size: (u32, u32),
    /// Whether the file's own bytes were sent (no rotation, no scaling, a format servers read).
    pub original_bytes: bool,
}

/// Reads, checks and encodes one image as the module docs describe.
///
/// # Errors
/// [`Error::Io`] when the file cannot be read; [`Error::Image`] naming it when it cannot be
/// decoded (truncated, corrupt, unknown format) or re-encoded.
pub fn encode_image(path: &Path, max_image_side: u32) -> Result<EncodedImage> {
    use ::image::ImageFormat as F;
    use ::image::metadata::Orientation;
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let failed = |msg: String| Error::Image {
        path: path.to_path_buf(),
        msg,
    };
    let format = ::image::guess_format(&bytes).ok();
    let decoded = lora_data::image::decode::decode_bytes(&bytes, [255, 255, 255])
        .map_err(|f| failed(f.to_string()))?;
    let (w, h) = decoded.rgb.dimensions();
    let passthrough_mime = match format {
        Some(F::Png) => Some("image/png"),
        Some(F::Jpeg) => Some("image/jpeg"),
        Some(F::WebP) => Some("image/webp"),
        Some(F::Gif) => Some("image/gif"),
        _ => None,
    };
    let fits = max_image_side == 0 || w.max(h) <= max_image_side;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    if fits
        && decoded.orientation == Orientation::NoTransforms
        && let Some(mime) = passthrough_mime
    {
        return Ok(EncodedImage {
            data_url: format!("data:{mime};base64,{}", b64(&bytes)),
            mime,
            size: (w, h),
            original_bytes: true,
        });
    }
    let rgb = if fits {
        decoded.rgb
    } else {
        let scale = max_image_side as f64 / w.max(h) as f64;
        let nw = ((w as f64 * scale).round() as u32).clamp(1, max_image_side);
        let nh = ((h as f64 * scale).round() as u32).clamp(1, max_image_side);
        ::image::imageops::resize(
            &decoded.rgb,
            nw,
            nh,
            ::image::imageops::FilterType::Lanczos3,
        )
    };
    let size = rgb.dimensions();
    let mut out = Vec::new();
    let mime = if format == Some(F::Png) {
        ::image::codecs::png::PngEncoder::new(&mut out)
            .write_image(
                rgb.as_raw(),
                size.0,
                size.1,
                ::image::ExtendedColorType::Rgb8,
            )
            .map_err(|e| failed(format!("cannot encode it as PNG: {e}")))?;
        "image/png"
    } else {
        ::image::codecs::jpeg::JpegEncoder::new_with_quality(&mut out, 95)
            .write_image(
                rgb.as_raw(),
                size.0,
                size.1,
                ::image::ExtendedColorType::Rgb8,
            )
            .map_err(|e| failed(format!("cannot encode it as JPEG: {e}")))?;
        "image/jpeg"
    };
    Ok(EncodedImage {
        data_url: format!("data:{mime};base64,{}", b64(&out)),
        mime,
        size,
        original_bytes: false,
    })
}

/// Labels models put before a caption ("Caption:", "Description:") that are not part of it.
const CAPTION_LABELS: &[&str] = &["caption:", "description:", "image caption:", "answer:"];

/// A caption reply as a caption file line: reasoning (`<think>…</think>`) and special tokens
/// dropped, a leading "Caption:"-style label and wrapping quotes removed, every run of
/// whitespace (newlines included) made one space — kohya's trainers read a caption file as one
/// line.
///
/// ```
/// use lora_tagger::llm::vlm::clean_caption;
/// assert_eq!(
///     clean_caption("<think>a cat?</think>\nCaption: \"A tabby cat\n  asleep on a sofa.\"").unwrap(),
///     "A tabby cat asleep on a sofa."
/// );
/// assert!(clean_caption("  <|im_end|> ").is_err());
/// ```
///
/// # Errors
/// [`Error::Unparseable`] (with an excerpt of the reply) when nothing is left.
pub fn clean_caption(reply: &str) -> Result<String> {
    let text = strip_reasoning(reply);
    let mut s: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    loop {
        let lower = s.to_ascii_lowercase();
        match CAPTION_LABELS.iter().find(|l| lower.starts_with(*l)) {
            Some(l) => s = s[l.len()..].trim_start().to_string(),
            None => break,
        }
    }
    for (open, close) in [('"', '"'), ('\u{201c}', '\u{201d}'), ('\'', '\'')] {
        if s.len() >= 2 && s.starts_with(open) && s.ends_with(close) {
            s = s[open.len_utf8()..s.len() - close.len_utf8()]
                .trim()
                .to_string();
        }
    }
    if s.is_empty() {
        return Err(Error::Unparseable {
            reply: reply.chars().take(REPLY_EXCERPT_CHARS).collect(),
        });
    }
    Ok(s)
}

/// A captioner/tagger that sends images to a vision-language model (see the module docs).
pub struct VlmTagger {
    server: ChatServer,
    preset: VlmPreset,
    instruction: String,
    custom_instruction: bool,
    max_image_side: u32,
}

impl fmt::Debug for VlmTagger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VlmTagger")
            .field("server", &self.server)
            .field("preset", &self.preset)
            .field("custom_instruction", &self.custom_instruction)
            .field("max_image_side", &self.max_image_side)
            .finish()
    }
}

impl fmt::Display for VlmTagger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}, preset {}", self.server, self.preset)
    }
}

impl VlmTagger {
    /// Builds the client and reads the API key from `opts.server.api_key_env`.
    ///
    /// # Errors
    /// As [`ChatServer::new`]; [`Error::Config`] naming `vlm.prompt` for an empty instruction.
    pub fn new(opts: VlmOptions) -> Result<Self> {
        let custom_instruction = opts.instruction.is_some();
        let instruction = match opts.instruction {
            Some(i) if i.trim().is_empty() => {
                return Err(Error::Config {
                    key: "vlm.prompt".into(),
                    value: format!("{i:?}"),
                    hint: "give an instruction, or leave it out to use the preset's".into(),
                });
            }
            Some(i) => i.trim().to_string(),
            None => opts.preset.instruction().to_string(),
        };
        Ok(Self {
            server: ChatServer::new_in("vlm", opts.server)?,
            preset: opts.preset,
            instruction,
            custom_instruction,
            max_image_side: opts.max_image_side,
        })
    }

    /// The preset this tagger was built with.
    pub fn preset(&self) -> VlmPreset {
        self.preset
    }

    /// The endpoint requests go to (`{base_url}/chat/completions`).
    pub fn url(&self) -> &str {
        self.server.url()
    }

    /// The request body for one image (see the module docs).
    ///
    /// # Errors
    /// As [`encode_image`].
    pub fn request_body(&self, path: &Path) -> Result<String> {
        let image = encode_image(path, self.max_image_side)?;
        Ok(self.server.body(vec![serde_json::json!({
            "role": "user",
            "content": [
                {"type": "text", "text": self.instruction},
                {"type": "image_url", "image_url": {"url": image.data_url}},
            ],
        })]))
    }

    /// The server's raw replies for `paths`, `concurrency` requests at a time, in order; each
    /// image is read and encoded by the worker that sends it.
    ///
    /// # Errors
    /// As [`ChatServer::complete_all`]; an image that cannot be read or decoded fails its item.
    pub fn replies(&self, paths: &[PathBuf]) -> Result<Vec<Result<String>>> {
        self.server.complete_all(paths, |p| self.request_body(p))
    }

    /// One caption per image ([`clean_caption`] of each reply), in order. With the `tags`
    /// preset the caption is the parsed tags joined by `", "`.
    ///
    /// # Errors
    /// As [`VlmTagger::replies`]; an unusable reply fails its item ([`Error::Unparseable`]).
    pub fn caption_images(&self, paths: &[PathBuf]) -> Result<Vec<Result<String>>> {
        let preset = self.preset;
        Ok(self
            .replies(paths)?
            .into_iter()
            .map(|r| {
                r.and_then(|text| {
                    if preset.is_tags() {
                        parse_scored(&text).map(|tags| {
                            tags.into_iter()
                                .map(|t| t.tag)
                                .collect::<Vec<_>>()
                                .join(", ")
                        })
                    } else {
                        clean_caption(&text)
                    }
                })
            })
            .collect())
    }
}

impl crate::Captioner for VlmTagger {
    fn model_id(&self) -> String {
        Tagger::model_id(self)
    }

    fn caption_images(&mut self, paths: &[PathBuf]) -> Result<Vec<Result<String>>> {
        VlmTagger::caption_images(self, paths)
    }
}

impl Tagger for VlmTagger {
    /// `vlm:<model>@<url>:<preset>` (plus `:custom-prompt`), e.g.
    /// `vlm:Qwen2.5-VL-7B-Instruct@http://gpu-box:8000/v1/chat/completions:tags`.
    fn model_id(&self) -> String {
        format!(
            "vlm:{}@{}:{}{}",
            self.server.options().model,
            self.server.url(),
            self.preset,
            if self.custom_instruction {
                ":custom-prompt"
            } else {
                ""
            }
        )
    }

    /// The replies parsed as tags ([`parse_scored`]), whatever the preset: a caption preset's
    /// sentence becomes comma-separated phrases. Use [`VlmTagger::caption_images`] for captions.
    fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        Ok(self
            .replies(paths)?
            .into_iter()
            .map(|r| r.and_then(|text| parse_scored(&text)))
            .collect())
    }

    /// Always [`Error::Unsupported`]: this backend captions images.
    fn tag_descriptions(&mut self, _descriptions: &[String]) -> Result<Vec<ItemResult>> {
        Err(Error::Unsupported {
            tagger: self.model_id(),
            what: "text descriptions (a VLM captions images; use the `llm` section for text)",
        })
    }
}

/// Builds the captioner a tagger config's `vlm` section asks for, with
/// `generation_settings.{timeout,retry_attempts}`.
///
/// # Errors
/// [`Error::Config`] naming `vlm.base_url` or `vlm.model` when missing, and as
/// [`VlmTagger::new`].
pub fn from_config(cfg: &crate::config::TaggerConfig) -> Result<VlmTagger> {
    let v = &cfg.vlm;
    let need = |value: &Option<String>, key: &str, example: &str| {
        value.clone().ok_or_else(|| Error::Config {
            key: format!("vlm.{key}"),
            value: "(missing)".into(),
            hint: format!("a VLM captioner needs it, e.g. {example}"),
        })
    };
    let preset = v.preset.unwrap_or_default();
    let settings = super::LlmSettings {
        api_key_env: v.api_key_env.clone(),
        concurrency: v.concurrency,
        timeout_s: Some(cfg.generation_settings.timeout),
        retry_attempts: Some(cfg.generation_settings.retry_attempts),
        max_new_tokens: Some(v.max_tokens.unwrap_or(preset.default_max_tokens())),
        ..Default::default()
    };
    let server = super::server_options(
        need(&v.base_url, "base_url", "http://127.0.0.1:8000/v1")?,
        need(&v.model, "model", "Qwen2.5-VL-7B-Instruct")?,
        &settings,
    )?;
    VlmTagger::new(VlmOptions {
        server,
        preset,
        instruction: v.prompt.clone(),
        max_image_side: v.max_image_side.unwrap_or(DEFAULT_MAX_IMAGE_SIDE),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_name() {
        for (p, n) in VlmPreset::ALL {
            assert_eq!(VlmPreset::parse(n).unwrap(), p);
            assert_eq!(p.to_string(), n);
        }
        assert_eq!(VlmPreset::parse(" Detailed ").unwrap(), VlmPreset::Detailed);
        match VlmPreset::parse("long") {
            Err(Error::Config { key, hint, .. }) => {
                assert_eq!(key, "vlm.preset");
                assert!(hint.contains("detailed"), "{hint}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn captions_are_cleaned_to_one_line() {
        assert_eq!(
            clean_caption("Description: A red bicycle\nleaning on a wall. <|im_end|>").unwrap(),
            "A red bicycle leaning on a wall."
        );
        assert_eq!(
            clean_caption("\u{201c}A rocket on its pad.\u{201d}").unwrap(),
            "A rocket on its pad."
        );
        assert_eq!(
            clean_caption("It's a cat's toy.").unwrap(),
            "It's a cat's toy."
        );
        assert!(matches!(
            clean_caption("<think>hmm"),
            Err(Error::Unparseable { .. })
        ));
    }

    #[test]
    fn empty_instruction_is_refused() {
        let e = VlmTagger::new(VlmOptions {
            instruction: Some("  ".into()),
            ..Default::default()
        })
        .unwrap_err();
        assert!(matches!(e, Error::Config { ref key, .. } if key == "vlm.prompt"));
    }
}
