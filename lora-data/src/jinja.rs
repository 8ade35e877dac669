//! A model's own chat template — the Jinja source stored as `chat_template` in
//! `tokenizer_config.json` or as `tokenizer.chat_template` in GGUF metadata — rendered with
//! [`minijinja`] in the environment Hugging Face `transformers` gives it.
//!
//! The environment mirrors `transformers/utils/chat_template_utils.py`
//! (`_cached_compile_jinja_template` and `render_jinja_template`): `trim_blocks` and
//! `lstrip_blocks` on, `keep_trailing_newline` off (Jinja2's default: one trailing newline of the
//! source is dropped), no autoescaping, the `loopcontrols` extension (`break`, `continue`), the
//! globals `raise_exception(message)` and `strftime_now(format)`, a `tojson` filter that writes
//! what Python's `json.dumps(x, ensure_ascii=False)` writes, and Python's string/dict methods
//! (`.strip()`, `.startswith()`, `.items()`, …) through `minijinja-contrib`'s `pycompat`. The
//! render context holds `messages` (a list of `{role, content}` maps), `add_generation_prompt`,
//! `tools` and `documents` (`none`), `bos_token` and `eos_token`.
//!
//! # Which tokens are trained on
//! A template is a program over the whole conversation, so the text an assistant message adds
//! is found by rendering the conversation prefix by prefix: for assistant message `i`,
//! - `P` = the rendering of `messages[..i]` with `add_generation_prompt = true` (the prompt the
//!   model is given at inference, ending with the assistant header);
//! - `F` = the rendering of `messages[..=i]` with `add_generation_prompt = false`.
//!
//! The assistant's text is `F[P.len()..]` (its content and end-of-turn marker, e.g.
//! `Hello<|eot_id|>`), and it is trainable; the header inside `P` is not. Whitespace after the
//! end-of-turn marker (the `\n` of `<|im_end|>\n`) is not trainable, as in the built-in
//! [`ChatMl`](crate::text::ChatMl). This needs the template to be *prefix-stable*: `F` starts with
//! `P`, and the rendering of the whole conversation starts with every `F`. Llama 3, Qwen2.5,
//! Gemma, ChatML and Mistral templates without a system message are; a template that moves text
//! between turns is refused with [`Error::TemplateNotPrefixStable`] instead of being trained on
//! wrong labels (Mistral's templates write the system prompt only into a user turn that ends the
//! conversation, so the prompt of a reply holds it and the conversation with the reply does not).

use std::fmt;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, Value, syntax::SyntaxConfig};

use crate::text::{ChatTemplate, Message, Segment};
use crate::{Error, Result};

/// The name the template is registered under inside its environment.
const TEMPLATE: &str = "chat_template";

/// The error `raise_exception(message)` carries to [`JinjaChatTemplate::prompt`], which turns
/// it into [`Error::TemplateRaised`].
#[derive(Debug)]
struct Raised(String);

impl fmt::Display for Raised {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// A Jinja chat template with the special tokens it is rendered with.
///
/// ```
/// use lora_data::jinja::JinjaChatTemplate;
/// let src = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}{{ eos_token }}\
///            {% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
/// let t = JinjaChatTemplate::new(src, "<s>", "</s>")?;
/// let text = t.prompt([("user", " Hi ")], true)?;
/// assert_eq!(text, "<s>[user] Hi</s>[assistant] ");
/// assert_eq!(t.end_of_turn().as_deref(), Some("</s>"));
/// # Ok::<(), lora_data::Error>(())
/// ```
#[derive(Clone)]
pub struct JinjaChatTemplate {
    name: String,
    source: Arc<str>,
    bos_token: String,
    eos_token: String,
    env: Arc<Environment<'static>>,
}

impl fmt::Debug for JinjaChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JinjaChatTemplate")
            .field("name", &self.name)
            .field("source_bytes", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

impl PartialEq for JinjaChatTemplate {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
            && self.bos_token == other.bos_token
            && self.eos_token == other.eos_token
    }
}

impl Eq for JinjaChatTemplate {}

impl JinjaChatTemplate {
    /// Compiles `source` (the template text) for rendering with these special tokens: the
    /// strings of the model's BOS and EOS tokens (`tokenizer_config.json`'s `bos_token` /
    /// `eos_token`, or the GGUF vocabulary at `tokenizer.ggml.{bos,eos}_token_id`); pass `""`
    /// for a token the model does not have.
    ///
    /// # Errors
    /// [`Error::Template`] when the source is not valid Jinja, naming the problem and its line.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        Self::named("chat_template", source, bos_token, eos_token)
    }

    /// As [`JinjaChatTemplate::new`], naming the template in error messages, compile errors
    /// included (e.g. `tokenizer.chat_template of model.gguf`).
    ///
    /// # Errors
    /// As [`JinjaChatTemplate::new`].
    pub fn named(
        name: impl Into<String>,
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self> {
        let source: String = source.into();
        let name: String = name.into();
        let env = environment(&source).map_err(|e| template_error(&name, &e))?;
        Ok(JinjaChatTemplate {
            name,
            source: source.into(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            env: Arc::new(env),
        })
    }

    /// Names the template in error messages (e.g. `tokenizer.chat_template of model.gguf`).
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The name used in error messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The BOS token string passed as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS token string passed as `eos_token`.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// Renders turns given as `(role, content)` (any role name) to text: the text of
    /// `transformers`' `apply_chat_template(messages, tokenize=False, add_generation_prompt=…)`.
    ///
    /// # Errors
    /// [`Error::TemplateRaised`] when the template calls `raise_exception` (its message kept);
    /// [`Error::Template`] for any other rendering failure (e.g. an undefined value used).
    pub fn prompt<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let turns: Vec<(&str, &str)> = turns.into_iter().collect();
        self.render_text(&turns, add_generation_prompt)
    }

    /// Renders turns given as `(role, content)` to segments: the text of
    /// [`JinjaChatTemplate::prompt`] with the text each assistant message adds marked trainable
    /// (see the [module docs](self) for how it is found).
    ///
    /// # Errors
    /// As [`JinjaChatTemplate::prompt`], plus [`Error::TemplateNotPrefixStable`] when the template
    /// renders a conversation's beginning differently once more messages follow.
    pub fn render_turns<'a>(
        &self,
        turns: impl IntoIterator<Item = (&'a str, &'a str)>,
        add_generation_prompt: bool,
    ) -> Result<Vec<Segment>> {
        let turns: Vec<(&str, &str)> = turns.into_iter().collect();
        let full = self.render_text(&turns, add_generation_prompt)?;
        let mut out = Vec::new();
        let mut cursor = 0usize;
        let fixed = |text: &str| Segment {
            text: text.to_string(),
            trainable: false,
        };
        for (i, &(role, _)) in turns.iter().enumerate() {
            if role != "assistant" {
                continue;
            }
            let prompt = self.render_text(&turns[..i], true)?;
            let with_reply = if i + 1 == turns.len() && !add_generation_prompt {
                full.clone()
            } else {
                self.render_text(&turns[..=i], false)?
            };
            let unstable = |what: &str| Error::TemplateNotPrefixStable {
                template: self.name.clone(),
                index: i,
                message: what.to_string(),
            };
            if !with_reply.starts_with(&prompt) {
                return Err(unstable(
                    "the rendering up to this assistant message does not start with the rendering \
                     of the messages before it plus the generation prompt",
                ));
            }
            if !full.starts_with(&with_reply) {
                return Err(unstable(
                    "the rendering of the whole conversation does not start with the rendering up \
                     to this assistant message (the template moves text between turns, e.g. the \
                     system prompt into the last user turn)",
                ));
            }
            let start = prompt.len();
            if start < cursor {
                return Err(unstable(
                    "the prompt before this assistant message is shorter than the conversation \
                     rendered up to the previous assistant message",
                ));
            }
            let added = &with_reply[start..];
            let trimmed = added.trim_end();
            let end = if trimmed.is_empty() {
                with_reply.len()
            } else {
                start + trimmed.len()
            };
            if start > cursor {
                out.push(fixed(&full[cursor..start]));
            }
            if end > start {
                out.push(Segment {
                    text: full[start..end].to_string(),
                    trainable: true,
                });
            }
            cursor = end;
        }
        if cursor < full.len() {
            out.push(fixed(&full[cursor..]));
        }
        Ok(out)
    }

    /// The text that ends an assistant turn, for a stop token: the rendering of
    /// `[user "Hi", assistant "Hello"]` after `Hello`, whitespace trimmed (`<|eot_id|>` for
    /// Llama 3, `</s>` for Mistral, `<end_of_turn>` for Gemma, `<|im_end|>` for ChatML/Qwen);
    /// the EOS token when that rendering fails or adds nothing; `None` when both are empty.
    pub fn end_of_turn(&self) -> Option<String> {
        let reply = "Hello";
        let derived = self
            .render_turns([("user", "Hi"), ("assistant", reply)], false)
            .ok()
            .and_then(|segs| {
                let trained: String = segs
                    .into_iter()
                    .filter(|s| s.trainable)
                    .map(|s| s.text)
                    .collect();
                let after = trained.split_once(reply)?.1.trim();
                (!after.is_empty()).then(|| after.to_string())
            });
        derived.or_else(|| (!self.eos_token.is_empty()).then(|| self.eos_token.clone()))
    }

    fn render_text(&self, turns: &[(&str, &str)], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<Value> = turns
            .iter()
            .map(|&(role, content)| Value::from_pairs([("role", role), ("content", content)]))
            .collect();
        let ctx = Value::from_pairs([
            ("messages", Value::from(messages)),
            ("add_generation_prompt", Value::from(add_generation_prompt)),
            ("tools", Value::from(())),
            ("documents", Value::from(())),
            ("bos_token", Value::from(self.bos_token.as_str())),
            ("eos_token", Value::from(self.eos_token.as_str())),
        ]);
        let tpl = self
            .env
            .get_template(TEMPLATE)
            .map_err(|e| template_error(&self.name, &e))?;
        tpl.render(ctx).map_err(|e| {
            match std::error::Error::source(&e).and_then(|s| s.downcast_ref::<Raised>()) {
                Some(Raised(message)) => Error::TemplateRaised {
                    template: self.name.clone(),
                    message: message.clone(),
                },
                None => template_error(&self.name, &e),
            }
        })
    }
}

impl ChatTemplate for JinjaChatTemplate {
    fn render(&self, messages: &[Message]) -> Result<Vec<Segment>> {
        self.render_turns(
            messages
                .iter()
                .map(|m| (m.role.as_str(), m.content.as_str())),
            false,
        )
    }
}

/// The message of a minijinja error with its cause chain (minijinja's `Display` names the
/// template line).
fn template_error(name: &str, e: &minijinja::Error) -> Error {
    let mut message = match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.kind().to_string(),
    };
    if let Some(line) = e.line() {
        message.push_str(&format!(" (template line {line})"));
    }
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    Error::Template {
        template: name.to_string(),
        message,
    }
}

/// The environment of `transformers`' `_cached_compile_jinja_template`, with `source` compiled.
fn environment(source: &str) -> std::result::Result<Environment<'static>, minijinja::Error> {
    let mut env = Environment::new();
    env.set_syntax(
        SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()?,
    );
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |message: String| -> std::result::Result<Value, minijinja::Error> {
            Err(
                minijinja::Error::new(ErrorKind::InvalidOperation, message.clone())
                    .with_source(Raised(message)),
            )
        },
    );
    env.add_function("strftime_now", |format: String| {
        strftime(&format, now_utc())
    });
    env.add_filter("tojson", tojson);
    env.add_template_owned(TEMPLATE, source.to_string())?;
    Ok(env)
}

/// `json.dumps(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False)` with
/// those keyword arguments accepted, as the `tojson` filter `transformers` installs.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match (v.as_i64(), v.as_str()) {
            (Some(n), _) => Some(" ".repeat(usize::try_from(n).unwrap_or(0))),
            (None, Some(s)) => Some(s.to_string()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        },
    };
    let (item_sep, key_sep) = match separators.as_deref() {
        Some([a, b]) => (a.clone(), b.clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be two strings",
            ));
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let opts = JsonOpts {
        indent,
        item_sep,
        key_sep,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    let mut out = String::new();
    write_json(value, &opts, 0, &mut out)?;
    Ok(out)
}

struct JsonOpts {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    sort_keys: bool,
    ensure_ascii: bool,
}

/// Python's `json` encoder over a minijinja value.
fn write_json(
    v: &Value,
    o: &JsonOpts,
    level: usize,
    out: &mut String,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(ind) = &o.indent {
            out.push('\n');
            out.push_str(&ind.repeat(level));
        }
    };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                out.push_str(&python_float(f));
            }
        }
        ValueKind::String => write_json_str(v.as_str().unwrap_or_default(), o.ensure_ascii, out),
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if o.sort_keys {
                keys.sort();
            }
            out.push('{');
            for (n, k) in keys.iter().enumerate() {
                if n > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                let key = match k.as_str() {
                    Some(s) => s.to_string(),
                    None => k.to_string(),
                };
                write_json_str(&key, o.ensure_ascii, out);
                out.push_str(&o.key_sep);
                write_json(&v.get_item(k)?, o, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (n, item) in items.iter().enumerate() {
                if n > 0 {
                    out.push_str(&o.item_sep);
                }
                newline(out, level + 1);
                write_json(item, o, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        _ => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {} value is not JSON serializable", v.kind()),
            ));
        }
    }
    Ok(())
}

/// Python's `repr(float)` for the values JSON can hold (`1.0`, `0.5`, `1e+20`, `NaN`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        "NaN".into()
    } else if f.is_infinite() {
        if f > 0.0 { "Infinity" } else { "-Infinity" }.into()
    } else if f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        let s = format!("{f:?}");
        match s.split_once('e') {
            Some((m, e)) if !e.starts_with('-') => format!("{m}e+{e}"),
            _ => s,
        }
    }
}

/// A JSON string as Python's `json.dumps` escapes it.
fn write_json_str(s: &str, ensure_ascii: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (ensure_ascii && (c as u32) > 0x7e) => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Seconds since the Unix epoch, now.
fn now_utc() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// `datetime.now().strftime(format)` for the instant `secs` (Unix time, read as UTC): the
/// directives `%Y %y %m %B %b %h %d %e %j %A %a %u %w %H %I %M %S %p %F %T %D %%` of C's
/// `strftime`.
fn strftime(format: &str, secs: i64) -> std::result::Result<String, minijinja::Error> {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (h, m, s) = (sod / 3600, sod / 60 % 60, sod % 60);
    let mon = MONTHS[(month - 1) as usize];
    let wd = WEEKDAYS[weekday];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(d) = chars.next() else {
            out.push('%');
            break;
        };
        let piece = match d {
            'Y' => year.to_string(),
            'y' => format!("{:02}", year.rem_euclid(100)),
            'm' => format!("{month:02}"),
            'B' => mon.to_string(),
            'b' | 'h' => mon[..3].to_string(),
            'd' => format!("{day:02}"),
            'e' => format!("{day:>2}"),
            'j' => format!("{yday:03}"),
            'A' => wd.to_string(),
            'a' => wd[..3].to_string(),
            'u' => (weekday + 1).to_string(),
            'w' => ((weekday + 1) % 7).to_string(),
            'H' => format!("{h:02}"),
            'I' => format!("{:02}", if h % 12 == 0 { 12 } else { h % 12 }),
            'M' => format!("{m:02}"),
            'S' => format!("{s:02}"),
            'p' => if h < 12 { "AM" } else { "PM" }.to_string(),
            'F' => format!("{year}-{month:02}-{day:02}"),
            'T' => format!("{h:02}:{m:02}:{s:02}"),
            'D' => format!("{month:02}/{day:02}/{:02}", year.rem_euclid(100)),
            '%' => "%".to_string(),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!("strftime_now: unsupported directive %{other} in {format:?}"),
                ));
            }
        };
        out.push_str(&piece);
    }
    Ok(out)
}

/// (year, month 1–12, day 1–31) of a day count since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// Day count since 1970-01-01 of a civil date (Howard Hinnant's `days_from_civil`).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chatml_jinja() -> JinjaChatTemplate {
        // SmolLM2-Instruct's template (as stored in its GGUF), with its default system prompt
        let src = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
                   {{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}\
                   {{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}\
                   {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        JinjaChatTemplate::new(src, "<|im_start|>", "<|im_end|>").unwrap()
    }

    #[test]
    fn chatml_through_jinja_gives_the_builtin_segments() {
        let t = chatml_jinja();
        let turns = [
            ("user", "Hi"),
            ("assistant", "Hello"),
            ("user", "Bye"),
            ("assistant", "Ciao"),
        ];
        let builtin = crate::text::ChatMl {
            default_system: Some("You are helpful".into()),
        };
        let join = |segs: &[Segment], trainable: bool| -> Vec<String> {
            segs.iter()
                .filter(|s| s.trainable == trainable)
                .map(|s| s.text.clone())
                .collect()
        };
        let ours = t.render_turns(turns, false).unwrap();
        let theirs = builtin.render_turns(turns, false);
        let text = |segs: &[Segment]| segs.iter().map(|s| s.text.as_str()).collect::<String>();
        assert_eq!(text(&ours), text(&theirs));
        assert_eq!(join(&ours, true), ["Hello<|im_end|>", "Ciao<|im_end|>"]);
        assert_eq!(join(&ours, true), join(&theirs, true));
        assert_eq!(
            t.prompt([("user", "Hi")], true).unwrap(),
            builtin.prompt([("user", "Hi")], true)
        );
        assert_eq!(t.end_of_turn().as_deref(), Some("<|im_end|>"));
    }

    #[test]
    fn raise_exception_and_syntax_errors_are_typed() {
        let t = JinjaChatTemplate::new(
            "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}ok",
            "",
            "",
        )
        .unwrap()
        .with_name("gemma");
        match t.prompt([("system", "S")], false) {
            Err(Error::TemplateRaised { template, message }) => {
                assert_eq!(template, "gemma");
                assert_eq!(message, "System role not supported");
            }
            other => panic!("expected TemplateRaised, got {other:?}"),
        }
        assert_eq!(t.prompt([("user", "U")], false).unwrap(), "ok");
        let err =
            JinjaChatTemplate::new("{% for m in messages %}{{ m.content }}", "", "").unwrap_err();
        assert!(matches!(err, Error::Template { .. }), "{err:?}");
        let msg = err.to_string();
        assert_eq!(
            msg,
            "chat template chat_template: syntax error: unexpected end of input, expected end of \
             block (template line 1)"
        );
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = JinjaChatTemplate::new(
            "{{ {'a': 1, 'b': [true, none, 1.5, 2.0], 'c': 'é\"\n'} | tojson }}|\
             {{ {'a': [1, 2], 'e': {}} | tojson(indent=2) }}|{{ 'é' | tojson(ensure_ascii=true) }}",
            "",
            "",
        )
        .unwrap();
        // json.dumps({'a': 1, 'b': [True, None, 1.5, 2.0], 'c': 'é"\n'}, ensure_ascii=False) etc.
        assert_eq!(
            t.prompt([], false).unwrap(),
            "{\"a\": 1, \"b\": [true, null, 1.5, 2.0], \"c\": \"é\\\"\\n\"}|\
             {\n  \"a\": [\n    1,\n    2\n  ],\n  \"e\": {}\n}|\"\\u00e9\""
        );
    }

    #[test]
    fn strftime_matches_c_for_known_instants() {
        // 2024-07-26 13:25:09 UTC, a Friday, day 208 (`date -u -d @1722000309`)
        let t = 1_722_000_309;
        assert_eq!(strftime("%d %b %Y", t).unwrap(), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %j %H:%M:%S %p %I %y %%", t).unwrap(),
            "Friday July 26 208 13:25:09 PM 01 24 %"
        );
        assert_eq!(strftime("%F %T", 0).unwrap(), "1970-01-01 00:00:00");
        assert!(strftime("%Q", t).is_err());
        assert_eq!(days_from_civil(2024, 7, 26), t / 86_400);
    }

    #[test]
    fn a_template_moving_the_system_prompt_is_refused() {
        // Mistral's rule: the system prompt goes into the last user turn
        let src = "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}{% set msgs = messages[1:] %}\
                   {% else %}{% set msgs = messages %}{% endif %}{{ bos_token }}{% for m in msgs %}\
                   {% if m.role == 'user' %}{% if loop.last and sys is defined %}[INST]{{ sys }}\n\n{{ m.content }}[/INST]\
                   {% else %}[INST]{{ m.content }}[/INST]{% endif %}{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}";
        let t = JinjaChatTemplate::new(src, "<s>", "</s>").unwrap();
        let two = t
            .render_turns(
                [
                    ("user", "U"),
                    ("assistant", "A"),
                    ("user", "V"),
                    ("assistant", "B"),
                ],
                false,
            )
            .unwrap();
        let fixed = |t: &str| Segment {
            text: t.into(),
            trainable: false,
        };
        let trained = |t: &str| Segment {
            text: t.into(),
            trainable: true,
        };
        assert_eq!(
            two,
            [
                fixed("<s>[INST]U[/INST]"),
                trained("A</s>"),
                fixed("[INST]V[/INST]"),
                trained("B</s>")
            ]
        );
        // with a system prompt, the prompt of the first reply holds it and the conversation
        // does not (it moved to the last user turn): refused, not mislabelled
        let err = t
            .render_turns([("system", "S"), ("user", "U"), ("assistant", "A")], false)
            .unwrap_err();
        assert!(
            matches!(err, Error::TemplateNotPrefixStable { index: 2, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("not prefix-stable at message 2"),
            "{err}"
        );
        assert_eq!(t.end_of_turn().as_deref(), Some("</s>"));
    }
}
