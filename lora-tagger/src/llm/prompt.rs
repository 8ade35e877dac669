//! The tagging prompt (ChatML system + few-shot + user turns) and a parser that pulls
//! comma-separated booru-style tags out of an instruct model's reply, however chatty.
//!
//! Booru-style tags are short lowercase noun phrases (`tabby cat`, `outdoors`, `red scarf`),
//! most important first, as on Danbooru-style image boards and in kohya caption files.

use lora_models::tokenizer::ChatMessage;

use crate::error::{Error, Result};
use crate::{ScoredTag, TagCategory};

/// The default system prompt: asks for tags only, lowercase, comma-separated, most important
/// first.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You label images for a training dataset. \
Turn the user's description into booru-style tags: short lowercase tags of one to three words, \
separated by commas, most important first. Name the subject, then details, colors, setting and style. \
Reply with the tags only, no sentences.";

/// One worked example shown to the model before the real description (few-shot): small instruct
/// models follow the format far more reliably with it.
pub const FEW_SHOT: (&str, &str) = (
    "A red fox sleeping curled up in the snow under a pine tree.",
    "fox, red fox, animal, sleeping, curled up, snow, pine tree, outdoors, winter",
);

/// Longest tag kept, in words; longer candidates are sentences, not tags.
pub const MAX_TAG_WORDS: usize = 5;
/// Longest tag kept, in characters.
pub const MAX_TAG_CHARS: usize = 48;
/// Longest reply excerpt carried in [`Error::Unparseable`], in characters.
pub const REPLY_EXCERPT_CHARS: usize = 200;

/// The messages sent to the model for one description.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TagPrompt {
    /// The system message; [`DEFAULT_SYSTEM_PROMPT`] unless the config's `llm.prompt` replaces it.
    pub system: String,
    /// Whether to include the [`FEW_SHOT`] example turn (default true).
    pub few_shot: bool,
    /// The user turn with `{description}` standing for the item's text; `None` (default) sends
    /// the description as is.
    pub user_template: Option<String>,
}

impl Default for TagPrompt {
    fn default() -> Self {
        Self {
            system: DEFAULT_SYSTEM_PROMPT.to_string(),
            few_shot: true,
            user_template: None,
        }
    }
}

impl TagPrompt {
    /// A prompt with a custom system message (few-shot example kept).
    pub fn with_system(system: impl Into<String>) -> Self {
        Self {
            system: system.into(),
            ..Self::default()
        }
    }

    /// The prompt for the config's `llm.prompt`: a text containing `{description}` is the user
    /// turn's template (the default system prompt and example stay); any other text replaces the
    /// system prompt.
    pub fn from_setting(prompt: &str) -> Self {
        if prompt.contains("{description}") {
            Self {
                user_template: Some(prompt.to_string()),
                ..Self::default()
            }
        } else {
            Self::with_system(prompt)
        }
    }

    /// The conversation for `description`: system, optional example user/assistant pair, then
    /// the description as the user turn. Render it with the model's chat template or send it as
    /// OpenAI `messages`.
    pub fn messages(&self, description: &str) -> Vec<ChatMessage> {
        let mut m = vec![ChatMessage::new("system", self.system.clone())];
        if self.few_shot {
            m.push(ChatMessage::user(FEW_SHOT.0));
            m.push(ChatMessage::new("assistant", FEW_SHOT.1));
        }
        let d = description.trim();
        m.push(ChatMessage::user(match &self.user_template {
            Some(t) => t.replace("{description}", d),
            None => d.to_string(),
        }));
        m
    }
}

impl TagPrompt {
    /// [`TagPrompt::messages`] without a system turn: the system prompt opens the first user
    /// turn (separated by a blank line), for chat templates that refuse a system role (Gemma's
    /// raise "System role not supported"; Gemma's own template folds it the same way when it
    /// accepts one).
    pub fn messages_without_system(&self, description: &str) -> Vec<ChatMessage> {
        let mut m = self.messages(description);
        if m.first().is_some_and(|t| t.role == "system") {
            let system = m.remove(0).content;
            if let Some(first_user) = m.iter_mut().find(|t| t.role == "user") {
                first_user.content = format!("{system}\n\n{}", first_user.content);
            }
        }
        m
    }
}

/// Words that open chatter lines ("Sure! Here are…", "I hope this helps") rather than tags.
const CHATTER_OPENERS: &[&str] = &[
    "sure",
    "here are",
    "here is",
    "here's",
    "certainly",
    "of course",
    "okay",
    "ok,",
    "i hope",
    "i have",
    "i've",
    "i can",
    "let me",
    "feel free",
    "note:",
    "these tags",
    "this description",
    "the tags",
    "tags:",
    "output:",
    "answer:",
];

/// Words that mark the text before a `:` as a preamble ("Here are the tags: a, b").
const PREAMBLE_CUES: &[&str] = &[
    "tag", "here", "sure", "keyword", "output", "answer", "label", "result",
];

/// Cuts the reply down to its answer: drops `<think>…</think>` reasoning (Qwen3-style; an
/// unclosed `<think>` drops everything after it, a lone `</think>` everything before it) and
/// ChatML special tokens (`<|im_end|>` etc.).
pub(crate) fn strip_reasoning(reply: &str) -> String {
    let mut s = reply.to_string();
    while let Some(open) = s.find("<think>") {
        match s[open..].find("</think>") {
            Some(rel) => s.replace_range(open..open + rel + "</think>".len(), " "),
            None => s.truncate(open),
        }
    }
    if let Some(close) = s.rfind("</think>") {
        s = s[close + "</think>".len()..].to_string();
    }
    // special tokens such as <|im_end|>, <|endoftext|>
    while let Some(a) = s.find("<|") {
        match s[a..].find("|>") {
            Some(b) => s.replace_range(a..a + b + 2, "\n"),
            None => s.truncate(a),
        }
    }
    s
}

/// Removes a list marker (`- `, `* `, `• `, `1. `, `2) `) from the start of a line.
fn strip_list_marker(line: &str) -> &str {
    let t = line.trim_start();
    for m in ["- ", "* ", "• ", "+ ", "– ", "— "] {
        if let Some(rest) = t.strip_prefix(m) {
            return rest;
        }
    }
    let digits = t.chars().take_while(|c| c.is_ascii_digit()).count();
    if digits > 0 && digits <= 3 {
        let rest = &t[digits..];
        for m in [". ", ") ", ".", ")"] {
            if let Some(r) = rest.strip_prefix(m) {
                return r;
            }
        }
    }
    t
}

fn starts_with_chatter(line: &str) -> bool {
    let l = line.trim_start().to_lowercase();
    CHATTER_OPENERS.iter().any(|o| l.starts_with(o))
}

/// Cleans one candidate tag; `None` when it is not tag-like.
fn clean_candidate(raw: &str) -> Option<String> {
    let quotes: &[char] = &[
        '"', '\'', '`', '“', '”', '‘', '’', '«', '»', '[', ']', '(', ')', '{', '}', '*', '_', '#',
    ];
    let mut t = raw.trim();
    // trailing sentence punctuation, then surrounding quotes/brackets/markdown, repeatedly
    loop {
        let before = t.len();
        t = t.trim_end_matches(['.', '!', '?', ';', ':']).trim();
        t = t.trim_matches(quotes).trim();
        if t.len() == before {
            break;
        }
    }
    // double quotes, backticks and emphasis marks never belong inside a tag (`gray-level "image`)
    let t: String = t
        .chars()
        .filter(|c| !matches!(c, '"' | '`' | '“' | '”' | '*'))
        .collect();
    let words: Vec<&str> = t.split_whitespace().collect();
    if words.is_empty() || words.len() > MAX_TAG_WORDS {
        return None;
    }
    let tag = words.join(" ").to_lowercase();
    if tag.chars().count() > MAX_TAG_CHARS || !tag.chars().any(char::is_alphanumeric) {
        return None;
    }
    Some(tag)
}

/// The part of a line after a preamble ending in `:` ("Here are the tags: a, b" → "a, b").
fn after_preamble(line: &str) -> &str {
    let Some(colon) = line.rfind(':') else {
        return line;
    };
    let (head, tail) = (&line[..colon], &line[colon + 1..]);
    let head_l = head.to_lowercase();
    if !head.contains(',') || PREAMBLE_CUES.iter().any(|c| head_l.contains(c)) {
        tail
    } else {
        line
    }
}

/// Parses an instruct model's reply into tags, in the model's order, without duplicates.
///
/// Robust to: `<think>…</think>` blocks, ChatML special tokens, preambles ("Sure! Here are the
/// tags:"), closing chatter ("I hope this helps!"), numbered or bulleted lists (one tag per line),
/// markdown (`**bold**`, code fences, headings), quotes, hashtags, trailing periods, duplicates
/// (case-insensitive), and over-long candidates (more than [`MAX_TAG_WORDS`] words or
/// [`MAX_TAG_CHARS`] characters: sentences, dropped). Tags are lowercased. Separators are `,`,
/// `;`, `|` and line breaks.
///
/// # Errors
/// [`Error::Unparseable`] (with the reply cut to [`REPLY_EXCERPT_CHARS`]) when nothing tag-like
/// remains.
pub fn parse_tags(reply: &str) -> Result<Vec<String>> {
    let body = strip_reasoning(reply);
    let mut tags: Vec<String> = Vec::new();
    for raw_line in body.lines() {
        let line = raw_line.trim();
        if line.is_empty() || line.starts_with("```") {
            continue;
        }
        let line = line.trim_start_matches('#').trim();
        let line = strip_list_marker(line);
        let line = after_preamble(line);
        let has_separator = line.contains([',', ';', '|']);
        if starts_with_chatter(line) && !has_separator {
            continue;
        }
        for part in line.split([',', ';', '|']) {
            let part = strip_list_marker(part);
            if starts_with_chatter(part) {
                continue;
            }
            if let Some(t) = clean_candidate(part) {
                if !tags.iter().any(|x| x == &t) {
                    tags.push(t);
                }
            }
        }
    }
    if tags.is_empty() {
        return Err(Error::Unparseable {
            reply: reply.chars().take(REPLY_EXCERPT_CHARS).collect(),
        });
    }
    Ok(tags)
}

/// Turns parsed tags into [`ScoredTag`]s ([`TagCategory::General`]): score `1.0` for the first,
/// decreasing by `0.001` per position (floor `0.5`), so sorting by score keeps the model's order.
pub fn score_tags(tags: Vec<String>) -> Vec<ScoredTag> {
    tags.into_iter()
        .enumerate()
        .map(|(i, tag)| ScoredTag {
            tag,
            score: (1.0 - 0.001 * i as f32).max(0.5),
            category: TagCategory::General,
        })
        .collect()
}

/// [`parse_tags`] then [`score_tags`].
///
/// # Errors
/// As [`parse_tags`].
pub fn parse_scored(reply: &str) -> Result<Vec<ScoredTag>> {
    parse_tags(reply).map(score_tags)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(reply: &str) -> Vec<String> {
        parse_tags(reply).unwrap()
    }

    #[test]
    fn plain_comma_list() {
        assert_eq!(
            tags("cat, tabby cat, sitting, window sill, sunlight"),
            ["cat", "tabby cat", "sitting", "window sill", "sunlight"]
        );
    }

    #[test]
    fn preamble_and_closing_chatter() {
        let r = "Sure! Here are the tags:\n\nastronaut, space suit, american flag, portrait.\n\nI hope this helps!";
        assert_eq!(
            tags(r),
            ["astronaut", "space suit", "american flag", "portrait"]
        );
        let r = "Tags: Rocket, Launch Pad, Smoke.";
        assert_eq!(tags(r), ["rocket", "launch pad", "smoke"]);
        let r = "Sure, here are some tags for this image: coffee, cup, saucer";
        assert_eq!(tags(r), ["coffee", "cup", "saucer"]);
    }

    #[test]
    fn numbered_and_bulleted_lists_with_markdown() {
        let r = "Here are the tags:\n1. **Horse**\n2. \"silhouette\"\n3) black and white\n- `white background`\n* Horse\n";
        assert_eq!(
            tags(r),
            ["horse", "silhouette", "black and white", "white background"]
        );
    }

    #[test]
    fn think_blocks_are_dropped() {
        let r = "<think>\nThe user wants tags. The image shows a cat, so cat, feline.\n</think>\n\ncat, orange cat, indoors";
        assert_eq!(tags(r), ["cat", "orange cat", "indoors"]);
        // unclosed reasoning (cut off by max_tokens): nothing usable
        let r = "<think>Let me think about the tags: cat, dog";
        assert!(matches!(parse_tags(r), Err(Error::Unparseable { .. })));
        // a server that strips <think> but leaves </think>
        assert_eq!(
            tags("reasoning, here</think>moon, craters"),
            ["moon", "craters"]
        );
    }

    #[test]
    fn special_tokens_duplicates_and_long_sentences() {
        assert_eq!(
            tags("camera, gray-level \"image."),
            ["camera", "gray-level image"]
        );
        let r = "Moon, moon, MOON, craters, This is a picture of the moon taken from the earth at night, night sky<|im_end|>";
        assert_eq!(tags(r), ["moon", "craters", "night sky"]);
    }

    #[test]
    fn code_fence_and_hashtags() {
        let r = "```\n#coins, #money, old coins\n```";
        assert_eq!(tags(r), ["coins", "money", "old coins"]);
    }

    #[test]
    fn garbage_is_unparseable_with_truncated_excerpt() {
        for r in [
            "",
            "   \n\n",
            "Sure!",
            "I hope this helps!",
            "...!!!???",
            "This description talks about a long and winding road through the mountains at dusk.",
        ] {
            match parse_tags(r) {
                Err(Error::Unparseable { reply }) => assert_eq!(reply, r),
                other => panic!("{r:?} gave {other:?}"),
            }
        }
        let long = "x".repeat(1000);
        match parse_tags(&long) {
            Err(Error::Unparseable { reply }) => assert_eq!(reply.len(), REPLY_EXCERPT_CHARS),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn scores_follow_order() {
        let s = parse_scored("a, b, c").unwrap();
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].score, 1.0);
        assert!(s[0].score > s[1].score && s[1].score > s[2].score);
        assert!(s.iter().all(|t| t.category == TagCategory::General));
    }

    #[test]
    fn prompt_messages() {
        let p = TagPrompt::default();
        let m = p.messages("  A cat.  ");
        assert_eq!(m.len(), 4);
        assert_eq!(m[0].role, "system");
        assert_eq!(m[3].content, "A cat.");
        let m = TagPrompt {
            few_shot: false,
            ..TagPrompt::with_system("sys")
        }
        .messages("x");
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].content, "sys");
        let p = TagPrompt::from_setting("Tags for: {description}");
        let m = p.messages("a dog ");
        assert_eq!(m[0].content, DEFAULT_SYSTEM_PROMPT);
        assert_eq!(m[3].content, "Tags for: a dog");
        assert_eq!(
            TagPrompt::from_setting("Be brief.").messages("x")[0].content,
            "Be brief."
        );
    }
}
