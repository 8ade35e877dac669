//! LLM taggers: an instruct model turns free-text descriptions into booru-style tags.
//!
//! - [`local::LocalLlmTagger`]: the model runs in this process over `lora_models::llama`
//!   (SmolLM2-135M-Instruct by default, any LLaMA-family GGUF/safetensors by path);
//! - [`http::HttpLlmTagger`]: an OpenAI-compatible server (vLLM, llama.cpp's server, Ollama);
//! - [`prompt`]: the prompt both send and the parser of their replies.
//!
//! [`from_config`] picks one from a [`crate::TaggerConfig`]; [`from_settings`] from the plain
//! [`LlmSettings`].

pub mod http;
pub mod local;
pub mod prompt;
pub mod vlm;

use std::path::PathBuf;
use std::time::Duration;

use crate::Tagger;
use crate::error::{Error, Result};

/// The `llm` section of the tagger config plus the `generation_settings` it uses. Every field is
/// optional; `None` takes the default named on the field.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LlmSettings {
    /// `llm.backend`: `"local"` (default) or `"http"`.
    pub backend: Option<String>,
    /// `llm.model_path`: a GGUF file or HF safetensors folder for the local backend (default:
    /// the embedded SmolLM2-135M-Instruct, [`local::default_model_path`]).
    pub model_path: Option<PathBuf>,
    /// `llm.base_url`: the server's OpenAI API root for the http backend (required there),
    /// e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: Option<String>,
    /// `llm.model`: the served model name for the http backend (required there).
    pub model: Option<String>,
    /// `llm.api_key_env`: environment variable with the API key (default `OPENAI_API_KEY`).
    pub api_key_env: Option<String>,
    /// `llm.concurrency`: requests in flight for the http backend (default 4).
    pub concurrency: Option<usize>,
    /// `llm.prompt`: with `{description}` in it, the user turn's template; otherwise it replaces
    /// the system prompt ([`prompt::DEFAULT_SYSTEM_PROMPT`]). See [`prompt::TagPrompt::from_setting`].
    pub prompt: Option<String>,
    /// `generation_settings.max_batch_size`: the local backend's largest micro-batch (default 8).
    pub max_batch_size: Option<usize>,
    /// `generation_settings.timeout`: per-request timeout of the http backend, seconds
    /// (default 60).
    pub timeout_s: Option<f64>,
    /// `generation_settings.retry_attempts`: retries after a failed first request (default 3).
    pub retry_attempts: Option<u32>,
    /// Most tokens generated per description (default 48 local, 64 http).
    pub max_new_tokens: Option<usize>,
    /// Sampling temperature (default 0 = greedy).
    pub temperature: Option<f64>,
    /// Sampling seed (default 0).
    pub seed: Option<u64>,
    /// `model_settings.device` for the local backend: `"cpu"` (default), `"cuda"`, `"cuda:N"`.
    pub device: Option<String>,
}

/// `device` (parsed from `name`) when this machine has it, checked before any model loads.
///
/// # Errors
/// [`Error::Config`] naming `model_settings.device`, what was asked and what libtorch sees.
fn usable_device(name: &str, device: tch::Device) -> Result<tch::Device> {
    let tch::Device::Cuda(index) = device else {
        return Ok(device);
    };
    match lora_core::sys::cuda_device_problem(index) {
        None => Ok(device),
        Some(problem) => Err(Error::Config {
            key: "model_settings.device".into(),
            value: format!("{name:?}"),
            hint: problem,
        }),
    }
}

/// Parses a device name: `cpu`, `cuda` (= `cuda:0`), `cuda:N`, `auto` (CUDA when available).
///
/// # Errors
/// [`Error::Config`] naming `model_settings.device` for anything else.
pub fn parse_device(name: &str) -> Result<tch::Device> {
    let n = name.trim().to_ascii_lowercase();
    let bad = || Error::Config {
        key: "model_settings.device".into(),
        value: format!("{name:?}"),
        hint: "use \"cpu\", \"cuda\", \"cuda:N\" or \"auto\"".into(),
    };
    match n.as_str() {
        "cpu" => Ok(tch::Device::Cpu),
        "cuda" | "gpu" => Ok(tch::Device::Cuda(0)),
        "auto" => Ok(tch::Device::cuda_if_available()),
        _ => n
            .strip_prefix("cuda:")
            .and_then(|i| i.parse::<usize>().ok())
            .map(tch::Device::Cuda)
            .ok_or_else(bad),
    }
}

/// Builds the LLM tagger the settings ask for.
///
/// - `backend` `"local"` (or unset): [`local::LocalLlmTagger::load`] of `model_path` (default
///   SmolLM2-135M-Instruct) on `device`, micro-batches up to `max_batch_size`;
/// - `backend` `"http"`: [`http::HttpLlmTagger::new`] with `base_url`, `model`, `api_key_env`,
///   `concurrency`, `timeout_s`, `retry_attempts`.
///
/// # Errors
/// [`Error::Config`] for an unknown backend, a missing `base_url`/`model` for http, a bad
/// device or out-of-range numbers; loading errors of the local model ([`Error::Io`],
/// [`Error::Model`]).
pub fn from_settings(s: &LlmSettings) -> Result<Box<dyn Tagger>> {
    let prompt = s
        .prompt
        .as_ref()
        .map_or_else(prompt::TagPrompt::default, |p| {
            prompt::TagPrompt::from_setting(p)
        });
    match s.backend.as_deref().map(str::trim).unwrap_or("local") {
        "local" => {
            let d = local::LocalLlmOptions::default();
            let opts = local::LocalLlmOptions {
                max_new_tokens: s.max_new_tokens.unwrap_or(d.max_new_tokens),
                temperature: s.temperature.unwrap_or(d.temperature),
                seed: s.seed.unwrap_or(d.seed),
                max_batch_size: s.max_batch_size.unwrap_or(d.max_batch_size),
                device: match &s.device {
                    Some(name) => usable_device(name, parse_device(name)?)?,
                    None => d.device,
                },
                prompt,
                ..d
            };
            Ok(Box::new(local::LocalLlmTagger::load(
                s.model_path.as_deref(),
                opts,
            )?))
        }
        "http" => {
            let need = |v: &Option<String>, key: &str, example: &str| {
                v.clone().ok_or_else(|| Error::Config {
                    key: format!("llm.{key}"),
                    value: "(missing)".into(),
                    hint: format!("the http backend needs it, e.g. {example}"),
                })
            };
            let server = server_options(
                need(&s.base_url, "base_url", "http://127.0.0.1:8000/v1")?,
                need(&s.model, "model", "Qwen3-32B")?,
                s,
            )?;
            Ok(Box::new(http::HttpLlmTagger::new(http::HttpLlmOptions {
                server,
                prompt,
            })?))
        }
        other => Err(Error::Config {
            key: "llm.backend".into(),
            value: format!("{other:?}"),
            hint: "use \"local\" or \"http\"".into(),
        }),
    }
}

/// The [`http::ServerOptions`] of `settings` for the server at `base_url` serving `model`:
/// `api_key_env`, `concurrency`, `timeout_s`, `retry_attempts`, `max_new_tokens`, `temperature`
/// and `seed`, each defaulting as [`http::ServerOptions::default`].
///
/// # Errors
/// [`Error::Config`] naming `generation_settings.timeout` for a timeout that is not a positive
/// number of seconds.
fn server_options(base_url: String, model: String, s: &LlmSettings) -> Result<http::ServerOptions> {
    let d = http::ServerOptions::default();
    let timeout = match s.timeout_s {
        None => d.timeout,
        Some(t) if t.is_finite() && t > 0.0 => Duration::from_secs_f64(t),
        Some(t) => {
            return Err(Error::Config {
                key: "generation_settings.timeout".into(),
                value: t.to_string(),
                hint: "use a positive number of seconds".into(),
            });
        }
    };
    Ok(http::ServerOptions {
        base_url,
        model,
        api_key_env: s.api_key_env.clone().unwrap_or(d.api_key_env.clone()),
        concurrency: s.concurrency.unwrap_or(d.concurrency),
        timeout,
        retries: s.retry_attempts.unwrap_or(d.retries),
        max_tokens: s.max_new_tokens.unwrap_or(d.max_tokens),
        temperature: s.temperature.unwrap_or(d.temperature),
        seed: s.seed.unwrap_or(d.seed),
        ..d
    })
}

/// Builds the LLM tagger a whole tagger config asks for: [`from_settings`] of its `llm` section
/// with `generation_settings.{max_batch_size,timeout,retry_attempts}`; the local backend runs on
/// the device of `model_settings.device` ([`crate::config::ModelSettings::resolve_device`]).
///
/// ```no_run
/// # fn main() -> lora_tagger::Result<()> {
/// let cfg = lora_tagger::TaggerConfig::default(); // llm.backend unset: local SmolLM2
/// let mut tagger = lora_tagger::llm::from_config(&cfg)?;
/// let tags = tagger.tag_descriptions(&["Greek coins from Pompeii.".to_string()])?;
/// # Ok(()) }
/// ```
///
/// # Errors
/// As [`from_settings`], plus [`Error::Config`] for an unknown or absent device.
pub fn from_config(cfg: &crate::config::TaggerConfig) -> Result<Box<dyn Tagger>> {
    use crate::config::LlmBackend;
    let l = &cfg.llm;
    let mut settings = LlmSettings {
        backend: l.backend.map(|b| match b {
            LlmBackend::Local => "local".to_string(),
            LlmBackend::Http => "http".to_string(),
        }),
        model_path: l.model_path.clone(),
        base_url: l.base_url.clone(),
        model: l.model.clone(),
        api_key_env: l.api_key_env.clone(),
        concurrency: l.concurrency,
        prompt: l.prompt.clone(),
        max_batch_size: Some(cfg.generation_settings.max_batch_size),
        timeout_s: Some(cfg.generation_settings.timeout),
        retry_attempts: Some(cfg.generation_settings.retry_attempts),
        ..Default::default()
    };
    if !matches!(l.backend, Some(LlmBackend::Http)) {
        settings.device = Some(lora_core::sys::device_name(
            cfg.model_settings.resolve_device()?,
        ));
    }
    from_settings(&settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices() {
        assert_eq!(parse_device("CPU").unwrap(), tch::Device::Cpu);
        assert_eq!(parse_device("cuda:1").unwrap(), tch::Device::Cuda(1));
        assert!(matches!(parse_device("tpu"), Err(Error::Config { .. })));
    }

    #[test]
    fn settings_errors_name_the_key() {
        let key = |s: LlmSettings| match from_settings(&s) {
            Err(Error::Config { key, .. }) => key,
            Err(e) => panic!("{e}"),
            Ok(t) => panic!("built {}", t.model_id()),
        };
        let http = LlmSettings {
            backend: Some("http".into()),
            ..Default::default()
        };
        assert_eq!(key(http.clone()), "llm.base_url");
        assert_eq!(
            key(LlmSettings {
                base_url: Some("http://127.0.0.1:1/v1".into()),
                ..http.clone()
            }),
            "llm.model"
        );
        assert_eq!(
            key(LlmSettings {
                backend: Some("cloud".into()),
                ..Default::default()
            }),
            "llm.backend"
        );
        let t = from_settings(&LlmSettings {
            base_url: Some("http://127.0.0.1:1/v1".into()),
            model: Some("m".into()),
            ..http
        })
        .unwrap();
        assert_eq!(
            t.model_id(),
            "http:m@http://127.0.0.1:1/v1/chat/completions"
        );
        let mut cfg = crate::TaggerConfig::default();
        cfg.llm.backend = Some(crate::config::LlmBackend::Http);
        cfg.llm.base_url = Some("http://127.0.0.1:2/v1".into());
        match from_config(&cfg) {
            Err(Error::Config { key, .. }) => assert_eq!(key, "llm.model"),
            Err(e) => panic!("{e}"),
            Ok(t) => panic!("built {}", t.model_id()),
        }
        cfg.llm.model = Some("q".into());
        assert_eq!(
            from_config(&cfg).unwrap().model_id(),
            "http:q@http://127.0.0.1:2/v1/chat/completions"
        );
    }
}
