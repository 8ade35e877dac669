//! The HTTP tagger against a real OpenAI-compatible server: llama-cpp-python's
//! `llama_cpp.server` (pinned in python/requirements.txt, installed by `cargo xtask setup`)
//! serving the embedded SmolLM2-135M-Instruct GGUF on a free loopback port.
//!
//! Fails (does not skip) when the server package is missing: the message says to run
//! `cargo xtask setup`.

use crate::llm_support;

use std::time::Duration;

use llm_support::LlamaServer;
use lora_tagger::Tagger;
use lora_tagger::error::Error;
use lora_tagger::llm::http::{HttpLlmOptions, HttpLlmTagger, ServerOptions};

#[test]
fn llama_cpp_server_tags_descriptions() {
    let server = LlamaServer::start();
    let opts = ServerOptions {
        base_url: server.base_url(),
        model: LlamaServer::MODEL.into(),
        api_key_env: "LORA_TAGGER_TEST_KEY_UNSET".into(),
        concurrency: 2,
        timeout: Duration::from_secs(120),
        retries: 1,
        backoff_base: Duration::from_millis(100),
        max_tokens: 40,
        ..Default::default()
    };
    let tagger = |server: ServerOptions| {
        HttpLlmTagger::new(HttpLlmOptions {
            server,
            ..Default::default()
        })
        .unwrap()
    };
    let mut t = tagger(opts.clone());
    // 3 requests with 2 in flight: all must come back, in order
    let d: Vec<String> = [
        "Chelsea the cat.",
        "Coffee cup.",
        "Black and white silhouette of a horse.",
    ]
    .map(String::from)
    .to_vec();
    let out = t.tag_descriptions(&d).unwrap();
    assert_eq!(out.len(), 3);
    let tags: Vec<Vec<String>> = out
        .into_iter()
        .map(|r| r.unwrap().into_iter().map(|t| t.tag).collect())
        .collect();
    for (desc, t) in d.iter().zip(&tags) {
        eprintln!("{desc:?} -> {t:?}");
        assert!(!t.is_empty());
        assert!(
            t.iter()
                .all(|x| x.split_whitespace().count() <= 5 && *x == x.to_lowercase())
        );
    }
    // clear cases: the content word comes back
    assert!(tags[0].iter().any(|x| x.contains("cat")), "{:?}", tags[0]);
    assert!(tags[2].iter().any(|x| x.contains("horse")), "{:?}", tags[2]);

    // a real server with a timeout far below its generation time: Error::Timeout
    let mut slow = tagger(ServerOptions {
        timeout: Duration::from_millis(1),
        retries: 1,
        ..opts
    });
    match slow.tag_descriptions(&d[..1]) {
        Err(Error::Timeout {
            attempts, seconds, ..
        }) => {
            assert_eq!(attempts, 2);
            assert_eq!(seconds, 0.001);
        }
        other => panic!("{other:?}"),
    }
}
