//! The OpenAI-compatible HTTP tagger against real loopback sockets: a listener that answers as
//! each test scripts it (errors, garbage, hangs, slow replies) and a port nothing listens on.

use crate::llm_support;

use std::time::Duration;

use llm_support::{Listener, Reply, closed_port};
use lora_tagger::Tagger;
use lora_tagger::error::Error;
use lora_tagger::llm::http::{HttpLlmOptions, HttpLlmTagger, ServerOptions};

fn opts(base_url: String) -> ServerOptions {
    ServerOptions {
        base_url,
        model: "m".into(),
        api_key_env: "LORA_TAGGER_TEST_KEY_UNSET".into(),
        concurrency: 2,
        timeout: Duration::from_secs(10),
        retries: 2,
        backoff_base: Duration::from_millis(20),
        ..Default::default()
    }
}

fn tagger(server: ServerOptions) -> HttpLlmTagger {
    HttpLlmTagger::new(HttpLlmOptions {
        server,
        ..Default::default()
    })
    .unwrap()
}

fn descriptions(items: &[&str]) -> Vec<String> {
    items.iter().map(|s| s.to_string()).collect()
}

#[test]
fn tags_come_back_in_order_and_the_request_is_openai_shaped() {
    let server = Listener::start(Duration::ZERO, |_, req| {
        let d = req.description();
        Reply::chat(&format!(
            "Sure! Here are the tags: {}, photo.",
            d.to_lowercase()
        ))
    });
    let mut t = tagger(opts(server.base_url()));
    let out = t
        .tag_descriptions(&descriptions(&["Cat", "Red car", "Moon"]))
        .unwrap();
    let tags: Vec<Vec<String>> = out
        .into_iter()
        .map(|r| r.unwrap().into_iter().map(|t| t.tag).collect())
        .collect();
    assert_eq!(
        tags,
        [["cat", "photo"], ["red car", "photo"], ["moon", "photo"]]
    );
    let reqs = server.requests.lock().unwrap().clone();
    assert_eq!(reqs.len(), 3);
    let r = &reqs[0];
    assert_eq!(r.line, "POST /v1/chat/completions HTTP/1.1");
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("authorization"), None, "no key set, no header");
    let body: serde_json::Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["model"], "m");
    assert_eq!(body["stream"], false);
    assert_eq!(body["messages"][0]["role"], "system");
    assert_eq!(body["max_tokens"], 64);
}

#[test]
fn concurrency_limit_is_respected() {
    // each reply takes 150 ms, so unlimited requests would overlap 5-fold
    let server = Listener::start(Duration::from_millis(150), |_, _| Reply::chat("a, b"));
    let mut t = tagger(opts(server.base_url()));
    let out = t
        .tag_descriptions(&descriptions(&["1", "2", "3", "4", "5"]))
        .unwrap();
    assert!(out.iter().all(|r| r.is_ok()));
    assert_eq!(server.request_count(), 5);
    assert_eq!(
        server
            .max_in_flight
            .load(std::sync::atomic::Ordering::SeqCst),
        2
    );
}

#[test]
fn server_down_is_an_http_error_naming_the_url_after_all_retries() {
    let port = closed_port();
    let mut t = tagger(opts(format!("http://127.0.0.1:{port}/v1")));
    match t.tag_descriptions(&descriptions(&["a cat", "a dog"])) {
        Err(Error::Http { url, msg }) => {
            assert_eq!(url, format!("http://127.0.0.1:{port}/v1/chat/completions"));
            assert!(msg.contains("after 3 attempt(s)"), "{msg}");
            assert!(msg.contains("cannot reach"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn dropped_connections_are_retried_exactly_n_times() {
    let server = Listener::start(Duration::ZERO, |_, _| Reply::Close);
    let mut t = tagger(ServerOptions {
        concurrency: 1,
        ..opts(server.base_url())
    });
    let err = t.tag_descriptions(&descriptions(&["x"])).unwrap_err();
    assert!(matches!(err, Error::Http { .. }), "{err:?}");
    assert_eq!(server.request_count(), 3, "1 attempt + 2 retries");
}

#[test]
fn a_server_that_never_answers_times_out() {
    let server = Listener::start(Duration::ZERO, |_, _| Reply::Hang);
    let mut t = tagger(ServerOptions {
        timeout: Duration::from_millis(300),
        retries: 1,
        concurrency: 1,
        ..opts(server.base_url())
    });
    match t.tag_descriptions(&descriptions(&["x"])) {
        Err(Error::Timeout {
            what,
            seconds,
            attempts,
        }) => {
            assert!(what.ends_with("/v1/chat/completions"), "{what}");
            assert_eq!(seconds, 0.3);
            assert_eq!(attempts, 2);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(server.request_count(), 2);
}

#[test]
fn garbage_replies_fail_only_their_item() {
    let server = Listener::start(Duration::ZERO, |_, req| match req.description().as_str() {
        "non-json" => Reply::Status(200, vec![], "<html>hello</html>".into()),
        "no-content" => Reply::json(200, r#"{"choices": []}"#.into()),
        "chatter" => Reply::chat("Sure! I hope this helps!"),
        _ => Reply::chat("<think>hmm, a horse</think>horse, silhouette"),
    });
    let mut t = tagger(opts(server.base_url()));
    let out = t
        .tag_descriptions(&descriptions(&[
            "non-json",
            "no-content",
            "chatter",
            "good",
        ]))
        .unwrap();
    match &out[0] {
        Err(Error::Http { msg, .. }) => {
            assert!(msg.contains("not chat-completion JSON"), "{msg}");
            assert!(msg.contains("<html>hello</html>"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    match &out[1] {
        Err(Error::Http { msg, .. }) => {
            assert!(msg.contains("choices[0].message.content"), "{msg}")
        }
        other => panic!("{other:?}"),
    }
    match &out[2] {
        Err(Error::Unparseable { reply }) => assert_eq!(reply, "Sure! I hope this helps!"),
        other => panic!("{other:?}"),
    }
    let good: Vec<String> = out[3]
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t.tag.clone())
        .collect();
    assert_eq!(good, ["horse", "silhouette"]);
    // garbage is not retried
    assert_eq!(server.request_count(), 4);
}

#[test]
fn a_500_then_200_succeeds_on_retry() {
    let server = Listener::start(Duration::ZERO, |n, _| {
        if n == 0 {
            Reply::Status(500, vec![], "overloaded".into())
        } else {
            Reply::chat("coffee, cup")
        }
    });
    let mut t = tagger(opts(server.base_url()));
    let out = t.tag_descriptions(&descriptions(&["Coffee cup."])).unwrap();
    let tags: Vec<String> = out[0]
        .as_ref()
        .unwrap()
        .iter()
        .map(|t| t.tag.clone())
        .collect();
    assert_eq!(tags, ["coffee", "cup"]);
    assert_eq!(server.request_count(), 2);
}

#[test]
fn a_429_honours_retry_after_then_succeeds() {
    let server = Listener::start(Duration::ZERO, |n, _| {
        if n == 0 {
            Reply::Status(
                429,
                vec![("Retry-After".into(), "0".into())],
                "slow down".into(),
            )
        } else {
            Reply::chat("moon")
        }
    });
    let mut t = tagger(opts(server.base_url()));
    let out = t
        .tag_descriptions(&descriptions(&["Surface of the moon."]))
        .unwrap();
    assert_eq!(out[0].as_ref().unwrap()[0].tag, "moon");
    assert_eq!(server.request_count(), 2);
}

#[test]
fn client_errors_are_not_retried_and_stop_the_call() {
    let server = Listener::start(Duration::ZERO, |_, _| {
        Reply::json(404, r#"{"error": "model 'm' not found"}"#.into())
    });
    let mut t = tagger(ServerOptions {
        concurrency: 1,
        ..opts(server.base_url())
    });
    match t.tag_descriptions(&descriptions(&["a", "b", "c"])) {
        Err(Error::Http { msg, .. }) => {
            assert!(msg.starts_with("HTTP 404"), "{msg}");
            assert!(msg.contains("model 'm' not found"), "{msg}");
            assert!(msg.contains("llm.model"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        server.request_count(),
        1,
        "no retry, and the other items are not sent"
    );
}

#[test]
fn images_are_unsupported() {
    let mut t = tagger(opts("http://127.0.0.1:1/v1".into()));
    assert!(matches!(
        t.tag_images(&["a.png".into()]),
        Err(Error::Unsupported { .. })
    ));
}
