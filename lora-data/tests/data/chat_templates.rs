//! Real models' chat templates (llama.cpp's `models/templates/*.jinja`, from the asset
//! `chat_templates`) rendered by [`JinjaChatTemplate`] against transformers' own rendering
//! (`python/chat_template_parity.py`), byte for byte; then the trained segments, the stop strings
//! and the errors on the same templates.

use crate::common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::{asset_dir, decode, tokenizer};
use lora_data::Error;
use lora_data::jinja::JinjaChatTemplate;
use lora_data::text::{IGNORE_INDEX, TextConfig, TextDataset, TextFormat};
use serde_json::Value;

const LLAMA3: &str = "meta-llama-Llama-3.1-8B-Instruct.jinja";
const MISTRAL: &str = "mistralai-Mistral-Nemo-Instruct-2407.jinja";
const QWEN25: &str = "Qwen-Qwen2.5-7B-Instruct.jinja";
const GEMMA: &str = "google-gemma-2-2b-it.jinja";

/// The four templates every check below covers, with the BOS/EOS strings of each model's
/// `tokenizer_config.json` and the end-of-turn text of its template.
const REQUIRED: [(&str, &str, &str, &str); 4] = [
    (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    (MISTRAL, "<s>", "</s>", "</s>"),
    (QWEN25, "", "<|im_end|>", "<|im_end|>"),
    (GEMMA, "<bos>", "<eos>", "<end_of_turn>"),
];

fn python() -> PathBuf {
    let py = std::env::var_os("LORA_SDK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python"));
    let py = if py.is_relative() {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(py)
    } else {
        py
    };
    assert!(
        py.exists(),
        "{} is missing: run `cargo xtask setup` (it creates the interop venv)",
        py.display()
    );
    py
}

fn template(dir: &Path, name: &str, bos: &str, eos: &str) -> JinjaChatTemplate {
    let src = std::fs::read_to_string(dir.join(name)).unwrap();
    JinjaChatTemplate::new(src, bos, eos)
        .unwrap()
        .with_name(name)
}

/// The cases `python/chat_template_parity.py` writes: transformers' renderings.
fn expected(dir: &Path) -> Vec<Value> {
    let out = tempfile::tempdir().unwrap();
    let json = out.path().join("expected.json");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python/chat_template_parity.py");
    let o = std::process::Command::new(python())
        .arg(&script)
        .arg("--templates")
        .arg(dir)
        .arg("--out")
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "chat_template_parity.py failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    v["cases"].as_array().unwrap().clone()
}

fn turns(case: &Value) -> Vec<(String, String)> {
    case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["role"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn as_refs(t: &[(String, String)]) -> Vec<(&str, &str)> {
    t.iter().map(|(r, c)| (r.as_str(), c.as_str())).collect()
}

#[test]
fn renderings_equal_transformers_apply_chat_template() {
    let Some(dir) = asset_dir("chat_templates") else {
        return;
    };
    let cases = expected(&dir);
    let (mut equal, mut differ) = (0usize, Vec::new());
    for case in &cases {
        let name = case["template"].as_str().unwrap();
        let t = template(
            &dir,
            name,
            case["bos_token"].as_str().unwrap(),
            case["eos_token"].as_str().unwrap(),
        );
        let msgs = turns(case);
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let ours = t.prompt(as_refs(&msgs), agp);
        let same = match (&ours, case["text"].as_str(), case["error"].as_str()) {
            (Ok(text), Some(want), _) => text == want,
            (Err(Error::TemplateRaised { message, .. }), None, Some(want)) => message == want,
            _ => false,
        };
        if same {
            equal += 1;
        } else {
            differ.push(format!(
                "{name} {msgs:?} add_generation_prompt={agp}:\n  ours:         {ours:?}\n  transformers: {:?} {:?}",
                case["text"], case["error"]
            ));
        }
    }
    eprintln!(
        "chat template parity: {equal}/{} renderings equal to transformers",
        cases.len()
    );
    for (name, ..) in REQUIRED {
        assert!(
            cases.iter().filter(|c| c["template"] == name).count() >= 10,
            "{name} not rendered by the script"
        );
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

#[test]
fn assistant_text_is_trained_and_the_prompt_is_not() {
    let Some(dir) = asset_dir("chat_templates") else {
        return;
    };
    let cases = expected(&dir);
    let mut checked = 0;
    for (name, bos, eos, eot) in REQUIRED {
        let t = template(&dir, name, bos, eos);
        assert_eq!(t.end_of_turn().as_deref(), Some(eot), "{name}");
        for case in cases.iter().filter(|c| c["template"] == name) {
            let msgs = turns(case);
            let agp = case["add_generation_prompt"].as_bool().unwrap();
            let has_system = msgs[0].0 == "system";
            let res = t.render_turns(as_refs(&msgs), agp);
            let Some(want) = case["text"].as_str() else {
                // Gemma refuses a system message, in both renderers
                assert!(
                    matches!(res, Err(Error::TemplateRaised { .. })),
                    "{name}: {res:?}"
                );
                continue;
            };
            let has_reply = msgs.iter().any(|(r, _)| r == "assistant");
            if name == MISTRAL && has_system && has_reply {
                // Mistral puts the system prompt into the last user turn only: the prompt of a
                // reply holds it where the conversation does not — refused, not mislabelled
                assert!(
                    matches!(res, Err(Error::TemplateNotPrefixStable { .. })),
                    "{name}: {res:?}"
                );
                continue;
            }
            let segs = res.unwrap_or_else(|e| panic!("{name} {msgs:?}: {e}"));
            let text: String = segs.iter().map(|s| s.text.as_str()).collect();
            assert_eq!(text, want, "{name}: segments must spell the rendering");
            let trained: Vec<&str> = segs
                .iter()
                .filter(|s| s.trainable)
                .map(|s| s.text.as_str())
                .collect();
            let replies: Vec<&str> = msgs
                .iter()
                .filter(|(r, _)| r == "assistant")
                .map(|(_, c)| c.trim())
                .collect();
            assert_eq!(trained.len(), replies.len(), "{name} {msgs:?}: {segs:?}");
            for (seg, reply) in trained.iter().zip(&replies) {
                // the reply (as the template writes it) and its end-of-turn marker, no header
                assert!(seg.contains(reply), "{name}: {seg:?} lacks {reply:?}");
                assert!(
                    seg.ends_with(eot),
                    "{name}: {seg:?} does not end with {eot}"
                );
                assert!(
                    !seg.contains("assistant") && !seg.contains("model\n"),
                    "{name}: header trained: {seg:?}"
                );
            }
            for s in segs.iter().filter(|s| !s.trainable) {
                assert!(
                    !replies.iter().any(|r| s.text.contains(r)),
                    "{name}: a reply in the prompt: {s:?}"
                );
            }
            for (_, user) in msgs.iter().filter(|(r, _)| r == "user") {
                assert!(
                    !trained.iter().any(|s| s.contains(user.trim())),
                    "{name}: user text trained"
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 25, "only {checked} conversations checked");
}

#[test]
fn a_chat_dataset_with_qwen_template_trains_on_the_replies_only() {
    let Some(dir) = asset_dir("chat_templates") else {
        return;
    };
    // Qwen2.5 writes ChatML, whose special tokens the test tokenizer has
    let t = template(&dir, QWEN25, "", "<|im_end|>");
    let data = r#"{"messages": [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}, {"role": "assistant", "content": "Rome."}]}"#;
    let config = TextConfig {
        format: TextFormat::Conversations,
        seq_len: 128,
        template: Arc::new(t),
        ..TextConfig::default()
    };
    let ds = TextDataset::from_texts(&[("chat.jsonl", data)], tokenizer(), config).unwrap();
    let doc = &ds.documents()[0];
    assert_eq!(
        decode(&doc.ids),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis.<|im_end|>\n\
         <|im_start|>user\nAnd of Italy?<|im_end|>\n<|im_start|>assistant\nRome.<|im_end|>\n"
    );
    // the labelled tokens, in runs: each reply with its <|im_end|>, nothing else
    let mut runs: Vec<Vec<i64>> = Vec::new();
    let mut prev_trained = false;
    for &l in &doc.labels {
        let trained = l != IGNORE_INDEX;
        if trained && !prev_trained {
            runs.push(Vec::new());
        }
        if trained && let Some(run) = runs.last_mut() {
            run.push(l);
        }
        prev_trained = trained;
    }
    let runs: Vec<String> = runs.iter().map(|r| decode(r)).collect();
    assert_eq!(runs, ["Paris.<|im_end|>", "Rome.<|im_end|>"]);
}

#[test]
fn template_errors_name_the_problem_and_the_record() {
    let Some(dir) = asset_dir("chat_templates") else {
        return;
    };
    // Gemma's own raise_exception, surfaced with the record that triggered it
    let gemma = template(&dir, GEMMA, "<bos>", "<eos>");
    let data = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}]}\n\
                {\"system\": \"Be brief.\", \"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, {\"role\": \"assistant\", \"content\": \"Hello\"}]}\n";
    let config = TextConfig {
        format: TextFormat::Conversations,
        template: Arc::new(gemma),
        ..TextConfig::default()
    };
    let err = TextDataset::from_texts(&[("chat.jsonl", data)], tokenizer(), config).unwrap_err();
    match &err {
        Error::Record { path, line, source } => {
            assert_eq!(path, Path::new("chat.jsonl"));
            assert_eq!(*line, 2);
            match source.as_ref() {
                Error::TemplateRaised { template, message } => {
                    assert_eq!(template, GEMMA);
                    assert_eq!(message, "System role not supported");
                }
                other => panic!("expected TemplateRaised, got {other:?}"),
            }
        }
        other => panic!("expected Record, got {other:?}"),
    }
    assert_eq!(
        err.to_string(),
        format!(
            "chat.jsonl:2: chat template {GEMMA} refused the conversation: System role not supported"
        )
    );
    // a template cut short (its last `{% endif %}` lost) does not compile; the error says why
    let src = std::fs::read_to_string(dir.join(LLAMA3)).unwrap();
    let cut = &src[..src.rfind("{%- endif %}").unwrap()];
    let err = JinjaChatTemplate::new(cut, "", "").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Template { .. }), "{err:?}");
    assert!(
        msg.contains("syntax error") && msg.contains("end of input") && msg.contains("line"),
        "{msg}"
    );
    // an unknown filter is found when rendering, and named
    let t = JinjaChatTemplate::new("{{ messages | no_such_filter }}", "", "").unwrap();
    let err = t.prompt([("user", "Hi")], false).unwrap_err();
    assert!(matches!(err, Error::Template { .. }), "{err:?}");
    assert!(err.to_string().contains("no_such_filter"), "{err}");
}
