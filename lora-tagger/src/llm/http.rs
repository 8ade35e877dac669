//! A tagger that asks an OpenAI-compatible chat server (`POST {base_url}/chat/completions`,
//! as served by vLLM, llama.cpp's server, llama-cpp-python's `llama_cpp.server` and Ollama).
//!
//! Request body (OpenAI "Create chat completion"): `{"model", "messages": [{"role", "content"}],
//! "max_tokens", "temperature", "seed", "stream": false}`; the reply's text is
//! `choices[0].message.content`.
//!
//! Failure policy:
//! - connect errors, timeouts, HTTP 5xx and 429 are retried with exponential backoff and jitter
//!   (`backoff_base · 2^attempt`, plus a uniform random part of the same size, capped at
//!   [`MAX_BACKOFF`]; a 429's `Retry-After` seconds are honoured up to that cap);
//! - other 4xx (bad key, unknown model, bad request) are not retried;
//! - a transport failure or an HTTP error status that survives its retries stops the whole call
//!   (outer error: every other item would fail the same way); a reply that is not chat-completion
//!   JSON, or has no tags, fails only its item.
//!
//! The API key is read from an environment variable at construction, sent only as
//! `Authorization: Bearer …`, and never appears in `Debug`, `Display`, errors or [`Tagger::model_id`].

use std::fmt;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::prompt::{TagPrompt, parse_scored};
use crate::error::{Error, Result};
use crate::{ItemResult, Tagger};

/// The environment variable read for the API key when the config names none.
pub const DEFAULT_API_KEY_ENV: &str = "OPENAI_API_KEY";
/// Longest wait between two attempts.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Longest excerpt of an error body carried in [`Error::Http`], characters.
const BODY_EXCERPT_CHARS: usize = 300;

/// An API key that never prints.
#[derive(Clone)]
struct ApiKey(String);

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Connection and sampling settings of a client of an OpenAI-compatible chat server, shared by
/// the description tagger ([`HttpLlmTagger`]) and the image captioner
/// ([`super::vlm::VlmTagger`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptions {
    /// The server's OpenAI API root, e.g. `http://127.0.0.1:8000/v1` (vLLM, llama.cpp) or
    /// `http://localhost:11434/v1` (Ollama); `/chat/completions` is appended.
    pub base_url: String,
    /// The `model` field of each request (the served model name).
    pub model: String,
    /// Environment variable holding the API key (`llm.api_key_env`, default
    /// [`DEFAULT_API_KEY_ENV`]); when it is unset or empty no `Authorization` header is sent.
    pub api_key_env: String,
    /// Requests in flight at once (`llm.concurrency`, default 4).
    pub concurrency: usize,
    /// Whole-request timeout per attempt (`generation_settings.timeout`, default 60 s).
    pub timeout: Duration,
    /// Retries after a failed first attempt (`generation_settings.retry_attempts`, default 3),
    /// so at most `1 + retries` attempts per request.
    pub retries: u32,
    /// First backoff step (default 0.5 s), doubled on each further retry.
    pub backoff_base: Duration,
    /// `max_tokens` of each request (default 64).
    pub max_tokens: usize,
    /// `temperature` of each request (default 0 = greedy).
    pub temperature: f64,
    /// `seed` of each request (default 0), for servers that honour it.
    pub seed: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8000/v1".into(),
            model: "default".into(),
            api_key_env: DEFAULT_API_KEY_ENV.into(),
            concurrency: 4,
            timeout: Duration::from_secs(60),
            retries: 3,
            backoff_base: Duration::from_millis(500),
            max_tokens: 64,
            temperature: 0.0,
            seed: 0,
        }
    }
}

/// Settings of [`HttpLlmTagger`]: the server and the prompt.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HttpLlmOptions {
    /// Where requests go and how they are sampled and retried.
    pub server: ServerOptions,
    /// The prompt.
    pub prompt: TagPrompt,
}

/// A client of an OpenAI-compatible `/chat/completions` endpoint that sends many requests,
/// `concurrency` at a time (scoped threads; no async runtime), with the retry policy of the
/// module docs.
pub struct ChatServer {
    /// The config section errors name (`llm` or `vlm`).
    section: &'static str,
    opts: ServerOptions,
    url: String,
    key: Option<ApiKey>,
    agent: ureq::Agent,
}

impl fmt::Debug for ChatServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatServer")
            .field("url", &self.url)
            .field("model", &self.opts.model)
            .field("api_key_env", &self.opts.api_key_env)
            .field("api_key", &self.key.as_ref().map(|_| "<redacted>"))
            .field("concurrency", &self.opts.concurrency)
            .field("timeout", &self.opts.timeout)
            .field("retries", &self.opts.retries)
            .finish()
    }
}

impl fmt::Display for ChatServer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (model {})", self.url, self.opts.model)
    }
}

/// An LLM tagger that turns descriptions into tags by asking an OpenAI-compatible server.
pub struct HttpLlmTagger {
    server: ChatServer,
    prompt: TagPrompt,
}

impl fmt::Debug for HttpLlmTagger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HttpLlmTagger")
            .field("server", &self.server)
            .field("custom_prompt", &(self.prompt != TagPrompt::default()))
            .finish()
    }
}

impl fmt::Display for HttpLlmTagger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.server.fmt(f)
    }
}

/// How one attempt failed.
enum AttemptError {
    /// Worth another attempt (connect error, 5xx, 429); the optional wait is `Retry-After`.
    Retryable(Error, Option<Duration>),
    /// Not worth retrying, and every other request would fail the same way (4xx).
    Fatal(Error),
    /// Only this item failed (garbage reply).
    Item(Error),
}

/// A small jitter source: SplitMix64 over the clock and a counter.
fn jitter_unit(counter: u64) -> f64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos ^ counter.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The wait before retry number `retry` (0-based): `base · 2^retry · (1 + u)`, `u` uniform in
/// [0, 1), capped at [`MAX_BACKOFF`] ("exponential backoff and jitter", AWS Architecture Blog,
/// 2015).
pub fn backoff_delay(base: Duration, retry: u32, u: f64) -> Duration {
    let exp = base.as_secs_f64() * 2f64.powi(retry.min(20) as i32);
    Duration::from_secs_f64((exp * (1.0 + u.clamp(0.0, 1.0))).min(MAX_BACKOFF.as_secs_f64()))
}

fn excerpt(s: &str) -> String {
    let t: String = s.chars().take(BODY_EXCERPT_CHARS).collect();
    if s.chars().count() > BODY_EXCERPT_CHARS {
        format!("{t}…")
    } else {
        t
    }
}

impl ChatServer {
    /// Builds the client and reads the API key from `opts.api_key_env`.
    ///
    /// # Errors
    /// [`Error::Config`] for an empty or non-http(s) `base_url`, an empty `model`, `concurrency`
    /// 0, or a zero `timeout`.
    pub fn new(opts: ServerOptions) -> Result<Self> {
        Self::new_in("llm", opts)
    }

    /// [`ChatServer::new`] for the config section `section` (`llm` or `vlm`), which errors and
    /// hints name (`vlm.base_url`, …).
    ///
    /// # Errors
    /// As [`ChatServer::new`].
    pub fn new_in(section: &'static str, opts: ServerOptions) -> Result<Self> {
        let base = opts.base_url.trim().trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::Config {
                key: format!("{section}.base_url"),
                value: format!("{:?}", opts.base_url),
                hint: "give the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1".into(),
            });
        }
        if opts.model.trim().is_empty() {
            return Err(Error::Config {
                key: format!("{section}.model"),
                value: "\"\"".into(),
                hint: "name the served model (vLLM: --served-model-name; Ollama: the tag)".into(),
            });
        }
        if opts.concurrency == 0 {
            return Err(Error::Config {
                key: format!("{section}.concurrency"),
                value: "0".into(),
                hint: "use 1 or more".into(),
            });
        }
        if opts.timeout.is_zero() {
            return Err(Error::Config {
                key: "generation_settings.timeout".into(),
                value: "0".into(),
                hint: "use a positive number of seconds".into(),
            });
        }
        let env = if opts.api_key_env.trim().is_empty() {
            DEFAULT_API_KEY_ENV
        } else {
            opts.api_key_env.trim()
        };
        let key = std::env::var(env)
            .ok()
            .filter(|k| !k.trim().is_empty())
            .map(|k| ApiKey(k.trim().to_string()));
        let url = format!("{base}/chat/completions");
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(opts.timeout))
            .http_status_as_error(false)
            .max_idle_connections_per_host(opts.concurrency.max(1))
            .build()
            .into();
        Ok(Self {
            section,
            opts,
            url,
            key,
            agent,
        })
    }

    /// The endpoint requests go to (`{base_url}/chat/completions`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether an API key was found in the environment.
    pub fn has_api_key(&self) -> bool {
        self.key.is_some()
    }

    /// Replaces any occurrence of the key in `msg` (a server may echo a header back).
    fn scrub(&self, msg: String) -> String {
        match &self.key {
            Some(k) if !k.0.is_empty() => msg.replace(&k.0, "<redacted>"),
            _ => msg,
        }
    }

    /// The settings this client was built with.
    pub fn options(&self) -> &ServerOptions {
        &self.opts
    }

    /// A chat-completion request body (OpenAI "Create chat completion"): `{"model", "messages",
    /// "max_tokens", "temperature", "seed", "stream": false}` with this client's settings.
    /// `messages` are OpenAI message objects (`{"role", "content"}`, where `content` is a string
    /// or a list of content parts).
    pub fn body(&self, messages: Vec<serde_json::Value>) -> String {
        serde_json::json!({
            "model": self.opts.model,
            "messages": messages,
            "max_tokens": self.opts.max_tokens,
            "temperature": self.opts.temperature,
            "seed": self.opts.seed,
            "stream": false,
        })
        .to_string()
    }

    fn http_err(&self, msg: String) -> Error {
        Error::Http {
            url: self.url.clone(),
            msg: self.scrub(msg),
        }
    }

    /// One attempt: the reply text, or how it failed.
    fn attempt(&self, body: &str) -> std::result::Result<String, AttemptError> {
        let mut req = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json");
        if let Some(k) = &self.key {
            req = req.header("Authorization", &format!("Bearer {}", k.0));
        }
        let resp = match req.send(body) {
            Ok(r) => r,
            Err(ureq::Error::Timeout(_)) => {
                return Err(AttemptError::Retryable(
                    Error::Timeout {
                        what: self.url.clone(),
                        seconds: self.opts.timeout.as_secs_f64(),
                        attempts: 1,
                    },
                    None,
                ));
            }
            Err(e) => {
                return Err(AttemptError::Retryable(
                    self.http_err(format!("cannot reach the server: {e}")),
                    None,
                ));
            }
        };
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(|s| Duration::from_secs_f64(s.min(MAX_BACKOFF.as_secs_f64())));
        let text = match resp.into_body().read_to_string() {
            Ok(t) => t,
            Err(ureq::Error::Timeout(_)) => {
                return Err(AttemptError::Retryable(
                    Error::Timeout {
                        what: self.url.clone(),
                        seconds: self.opts.timeout.as_secs_f64(),
                        attempts: 1,
                    },
                    None,
                ));
            }
            Err(e) => {
                return Err(AttemptError::Retryable(
                    self.http_err(format!("HTTP {status}, reading the reply failed: {e}")),
                    None,
                ));
            }
        };
        if status == 429 || (500..600).contains(&status) {
            return Err(AttemptError::Retryable(
                self.http_err(format!("HTTP {status}: {}", excerpt(&text))),
                retry_after,
            ));
        }
        if !(200..300).contains(&status) {
            let hint = match status {
                401 | 403 => {
                    format!(" (check the API key in ${})", self.opts.api_key_env)
                }
                404 => format!(
                    " (check {0}.base_url, usually ending in /v1, and {0}.model)",
                    self.section
                ),
                _ => String::new(),
            };
            return Err(AttemptError::Fatal(
                self.http_err(format!("HTTP {status}: {}{hint}", excerpt(&text))),
            ));
        }
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            AttemptError::Item(self.http_err(format!(
                "the reply is not chat-completion JSON ({e}): {}",
                excerpt(&text)
            )))
        })?;
        json.pointer("/choices/0/message/content")
            .and_then(|c| c.as_str())
            .map(str::to_string)
            .ok_or_else(|| {
                AttemptError::Item(self.http_err(format!(
                    "the reply has no choices[0].message.content: {}",
                    excerpt(&text)
                )))
            })
    }

    /// Sends one request body with retries. `Ok(Err(e))` = this item failed; `Err(e)` = stop
    /// the whole call.
    fn complete(&self, body: &str, abort: &AtomicBool) -> Result<Result<String>> {
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            match self.attempt(body) {
                Ok(text) => return Ok(Ok(text)),
                Err(AttemptError::Item(e)) => return Ok(Err(e)),
                Err(AttemptError::Fatal(e)) => return Err(e),
                Err(AttemptError::Retryable(e, retry_after)) => {
                    if attempts > self.opts.retries || abort.load(Ordering::Relaxed) {
                        return Err(match e {
                            Error::Timeout { what, seconds, .. } => Error::Timeout {
                                what,
                                seconds,
                                attempts,
                            },
                            Error::Http { url, msg } => Error::Http {
                                url,
                                msg: format!("{msg} (after {attempts} attempt(s))"),
                            },
                            other => other,
                        });
                    }
                    let wait = retry_after.unwrap_or_else(|| {
                        backoff_delay(
                            self.opts.backoff_base,
                            attempts - 1,
                            jitter_unit(attempts as u64),
                        )
                    });
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// The server's replies (`choices[0].message.content`) for `items`, `concurrency` requests
    /// at a time, in order. `body` builds each item's request body (usually with
    /// [`ChatServer::body`]) in the worker that sends it, so at most `concurrency` bodies exist
    /// at once; an item whose body cannot be built (an unreadable image) fails alone.
    ///
    /// # Errors
    /// Outer: [`Error::Http`] (unreachable server, HTTP error status) or [`Error::Timeout`]
    /// after all retries; the first such error stops the call. Inner: `body`'s error, or a reply
    /// that is not chat-completion JSON ([`Error::Http`]).
    pub fn complete_all<T: Sync>(
        &self,
        items: &[T],
        body: impl Fn(&T) -> Result<String> + Sync,
    ) -> Result<Vec<Result<String>>> {
        let next = AtomicUsize::new(0);
        let abort = AtomicBool::new(false);
        let fatal: Mutex<Option<Error>> = Mutex::new(None);
        let slots: Vec<Mutex<Option<Result<String>>>> =
            items.iter().map(|_| Mutex::new(None)).collect();
        let workers = self.opts.concurrency.min(items.len()).max(1);
        std::thread::scope(|s| {
            for _ in 0..workers {
                s.spawn(|| {
                    loop {
                        if abort.load(Ordering::Relaxed) {
                            break;
                        }
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(item) = items.get(i) else { break };
                        let outcome = match body(item) {
                            Ok(b) => self.complete(&b, &abort),
                            Err(e) => Ok(Err(e)),
                        };
                        match outcome {
                            Ok(r) => {
                                if let Ok(mut slot) = slots[i].lock() {
                                    *slot = Some(r);
                                }
                            }
                            Err(e) => {
                                abort.store(true, Ordering::Relaxed);
                                if let Ok(mut f) = fatal.lock() {
                                    f.get_or_insert(e);
                                }
                                break;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = fatal.into_inner().ok().flatten() {
            return Err(e);
        }
        Ok(slots
            .into_iter()
            .map(|m| {
                m.into_inner().ok().flatten().unwrap_or_else(|| {
                    Err(Error::Http {
                        url: self.url.clone(),
                        msg: "no reply was recorded for this item".into(),
                    })
                })
            })
            .collect())
    }
}

impl HttpLlmTagger {
    /// Builds the tagger and reads the API key from `opts.server.api_key_env`.
    ///
    /// # Errors
    /// As [`ChatServer::new`].
    pub fn new(opts: HttpLlmOptions) -> Result<Self> {
        Ok(Self {
            server: ChatServer::new(opts.server)?,
            prompt: opts.prompt,
        })
    }

    /// The endpoint requests go to (`{base_url}/chat/completions`).
    pub fn url(&self) -> &str {
        self.server.url()
    }

    /// Whether an API key was found in the environment.
    pub fn has_api_key(&self) -> bool {
        self.server.has_api_key()
    }

    /// The request body for one description: the prompt's messages as OpenAI messages.
    fn request_body(&self, description: &str) -> String {
        let messages = self
            .prompt
            .messages(description)
            .into_iter()
            .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
            .collect();
        self.server.body(messages)
    }

    /// The server's raw replies for `descriptions`, `concurrency` requests at a time, in order.
    ///
    /// # Errors
    /// As [`ChatServer::complete_all`].
    pub fn replies(&self, descriptions: &[String]) -> Result<Vec<Result<String>>> {
        self.server
            .complete_all(descriptions, |d| Ok(self.request_body(d)))
    }
}

impl Tagger for HttpLlmTagger {
    /// `http:<model>@<url>`, e.g. `http:Qwen3-32B@http://gpu-box:8000/v1/chat/completions`.
    fn model_id(&self) -> String {
        let custom = if self.prompt == TagPrompt::default() {
            ""
        } else {
            ":custom-prompt"
        };
        format!(
            "http:{}@{}{custom}",
            self.server.options().model,
            self.server.url()
        )
    }

    /// Always [`Error::Unsupported`]: this backend sends text only.
    fn tag_images(&mut self, _paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        Err(Error::Unsupported {
            tagger: self.model_id(),
            what: "images (an LLM tagger turns descriptions into tags)",
        })
    }

    /// [`HttpLlmTagger::replies`] parsed with [`parse_scored`].
    fn tag_descriptions(&mut self, descriptions: &[String]) -> Result<Vec<ItemResult>> {
        Ok(self
            .replies(descriptions)?
            .into_iter()
            .map(|r| r.and_then(|text| parse_scored(&text)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let b = Duration::from_millis(100);
        assert_eq!(backoff_delay(b, 0, 0.0), Duration::from_millis(100));
        assert_eq!(backoff_delay(b, 3, 0.0), Duration::from_millis(800));
        assert_eq!(backoff_delay(b, 1, 0.5), Duration::from_millis(300));
        assert_eq!(backoff_delay(b, 30, 0.9), MAX_BACKOFF);
    }

    #[test]
    fn bad_options_are_config_errors() {
        let bad = |o: ServerOptions| match ChatServer::new(o) {
            Err(Error::Config { key, .. }) => key,
            other => panic!("{other:?}"),
        };
        let base = ServerOptions::default();
        assert_eq!(
            bad(ServerOptions {
                base_url: "localhost:8000".into(),
                ..base.clone()
            }),
            "llm.base_url"
        );
        assert_eq!(
            bad(ServerOptions {
                model: " ".into(),
                ..base.clone()
            }),
            "llm.model"
        );
        assert_eq!(
            bad(ServerOptions {
                concurrency: 0,
                ..base.clone()
            }),
            "llm.concurrency"
        );
        let t = HttpLlmTagger::new(HttpLlmOptions {
            server: ServerOptions {
                base_url: "http://h:1/v1/".into(),
                ..base
            },
            ..Default::default()
        })
        .unwrap();
        assert_eq!(t.url(), "http://h:1/v1/chat/completions");
    }
}
