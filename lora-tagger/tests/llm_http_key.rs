//! The API key is sent as `Authorization: Bearer …` and never shows in Debug, Display, errors or
//! the model id. (One test in this binary: it sets an environment variable.)

#[path = "tagger/llm_support/mod.rs"]
mod llm_support;

use std::time::Duration;

use llm_support::{Listener, Reply};
use lora_tagger::Tagger;
use lora_tagger::llm::http::{HttpLlmOptions, HttpLlmTagger, ServerOptions};
use lora_tagger::llm::{LlmSettings, from_settings};

const VAR: &str = "LORA_TAGGER_TEST_API_KEY";
const KEY: &str = "sk-test-7f3a9c1e5b2d4f6a8c0e";

#[test]
fn api_key_is_sent_but_never_shown() {
    // SAFETY: the only test of this binary; no other thread reads the environment meanwhile.
    unsafe { std::env::set_var(VAR, KEY) };
    // the server echoes the Authorization header in a 401, as some proxies do
    let server = Listener::start(Duration::ZERO, |n, req| {
        let auth = req.header("authorization").unwrap_or("").to_string();
        if n == 0 {
            Reply::chat("cat, sofa")
        } else {
            Reply::json(
                401,
                format!(r#"{{"error": "invalid key in header {auth}"}}"#),
            )
        }
    });
    let opts = HttpLlmOptions {
        server: ServerOptions {
            base_url: server.base_url(),
            model: "m".into(),
            api_key_env: VAR.into(),
            concurrency: 1,
            retries: 1,
            backoff_base: Duration::from_millis(10),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut t = HttpLlmTagger::new(opts).unwrap();
    assert!(t.has_api_key());
    let ok = t
        .tag_descriptions(&["A cat on a sofa.".to_string()])
        .unwrap();
    assert_eq!(ok[0].as_ref().unwrap()[1].tag, "sofa");
    assert_eq!(
        server.requests.lock().unwrap()[0].header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    let err = t.tag_descriptions(&["again".to_string()]).unwrap_err();
    let shown = [
        format!("{t:?}"),
        format!("{t:#?}"),
        t.to_string(),
        t.model_id(),
        format!("{err:?}"),
        err.to_string(),
    ];
    for s in &shown {
        assert!(!s.contains(KEY), "the key leaked into {s:?}");
        assert!(!s.contains("7f3a9c1e"), "part of the key leaked into {s:?}");
    }
    assert!(err.to_string().contains("HTTP 401"), "{err}");
    assert!(err.to_string().contains("<redacted>"), "{err}");
    assert!(
        err.to_string().contains(VAR),
        "the hint names the variable: {err}"
    );
    assert!(format!("{t:?}").contains("<redacted>"));
    // the boxed tagger from settings hides it too
    let boxed = from_settings(&LlmSettings {
        backend: Some("http".into()),
        base_url: Some(server.base_url()),
        model: Some("m".into()),
        api_key_env: Some(VAR.into()),
        ..Default::default()
    })
    .unwrap();
    assert!(!boxed.model_id().contains(KEY));
}
