//! The VLM captioner against `python/vlm_test_server.py`: each request must pass
//! llama-cpp-python's own request model and the image shape vLLM documents, and the server's
//! reply names the image it received (size, format, sha256 of the bytes), so each caption file
//! proves which image reached which request, and whether it was sent as is or scaled.

use crate::vlm_server::VlmTestServer;

use std::path::{Path, PathBuf};

use lora_tagger::config::VlmSettings;
use lora_tagger::llm::vlm::{self, VlmPreset};
use lora_tagger::run::{caption_to_files_with_progress, tag_to_captions_with_progress};
use lora_tagger::{CaptionWriter, TaggerConfig};
use sha2::Digest;

fn photo(name: &str) -> PathBuf {
    let assets = std::env::var_os("LORA_SDK_ASSETS").unwrap_or_else(|| "../assets".into());
    let p = PathBuf::from(assets).join("skimage").join(name);
    assert!(p.exists(), "{}: run `cargo xtask setup`", p.display());
    p
}

fn sha12(path: &Path) -> String {
    hex::encode(sha2::Sha256::digest(std::fs::read(path).unwrap()))[..12].to_string()
}

fn config(server: &VlmTestServer, preset: VlmPreset) -> TaggerConfig {
    let mut cfg = TaggerConfig::default();
    cfg.vlm = VlmSettings {
        base_url: Some(server.base_url()),
        model: Some("Qwen2.5-VL-7B-Instruct".into()),
        api_key_env: Some("LORA_TAGGER_TEST_KEY_UNSET".into()),
        concurrency: Some(2),
        preset: Some(preset),
        ..Default::default()
    };
    cfg.tags.always_first = vec!["sks".into()];
    cfg
}

/// Real photos, one too large (scaled to 1024 on its longer side), one BMP (re-encoded), one
/// truncated JPEG (fails alone, never sent).
fn dataset(dir: &Path) -> Vec<PathBuf> {
    for name in ["rocket.jpg", "chelsea.png", "astronaut.png"] {
        std::fs::copy(photo(name), dir.join(name)).unwrap();
    }
    let coffee = image::open(photo("coffee.png")).unwrap().to_rgb8();
    image::imageops::resize(&coffee, 2000, 1500, image::imageops::FilterType::Triangle)
        .save(dir.join("big.png"))
        .unwrap();
    coffee.save(dir.join("coffee.bmp")).unwrap();
    let jpg = std::fs::read(photo("rocket.jpg")).unwrap();
    std::fs::write(dir.join("cut.jpg"), &jpg[..jpg.len() / 2]).unwrap();
    lora_tagger::run::list_images(dir).unwrap()
}

fn caption(dir: &Path, stem: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{stem}.txt")))
        .unwrap_or_else(|e| panic!("{stem}.txt: {e}"))
        .trim_end()
        .to_string()
}

#[test]
fn captions_name_the_image_each_request_carried() {
    let server = VlmTestServer::start();
    let dir = tempfile::tempdir().unwrap();
    let images = dataset(dir.path());
    assert_eq!(images.len(), 6);
    let cfg = config(&server, VlmPreset::Short);
    let mut vlm = vlm::from_config(&cfg).unwrap();
    let writer = CaptionWriter::new(cfg.captions.clone());
    let mut seen = Vec::new();
    let run = caption_to_files_with_progress(&mut vlm, &images, &cfg.tags, &writer, 4, &mut |p| {
        seen.push((p.done, p.total))
    })
    .unwrap();
    assert_eq!(seen, [(4, 6), (6, 6)]);
    assert_eq!(run.tagged, 6);
    let d = dir.path();
    // sent unchanged: the server hashed the very bytes of the file
    assert_eq!(
        caption(d, "rocket"),
        format!(
            "sks, A 640x427 jpeg image, sha {}.",
            sha12(&photo("rocket.jpg"))
        )
    );
    assert_eq!(
        caption(d, "chelsea"),
        format!(
            "sks, A 451x300 png image, sha {}.",
            sha12(&photo("chelsea.png"))
        )
    );
    assert_eq!(
        caption(d, "astronaut"),
        format!(
            "sks, A 512x512 png image, sha {}.",
            sha12(&photo("astronaut.png"))
        )
    );
    // scaled to 1024 on the longer side, kept PNG
    assert!(
        caption(d, "big").starts_with("sks, A 1024x768 png image, sha "),
        "{}",
        caption(d, "big")
    );
    // BMP is not an image_url format: re-encoded as JPEG, same size
    assert!(
        caption(d, "coffee").starts_with("sks, A 600x400 jpeg image, sha "),
        "{}",
        caption(d, "coffee")
    );
    // the cut file fails alone, before any request
    assert!(!d.join("cut.txt").exists());
    let failed: Vec<String> = run
        .report
        .entries
        .iter()
        .filter_map(|e| match &e.action {
            lora_tagger::caption::CaptionAction::Fail { error } => {
                Some(format!("{}: {error}", e.image.display()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(
        failed[0].contains("cut.jpg") && failed[0].contains("cut short"),
        "{failed:?}"
    );
    let reqs = server.requests();
    assert_eq!(reqs.len(), 5, "one request per readable image");
    for r in &reqs {
        assert_eq!(r["verdict"], "accepted", "{r}");
        assert_eq!(r["path"], "/v1/chat/completions");
        assert_eq!(r["authorization"], serde_json::Value::Null);
        let body = &r["body"];
        assert_eq!(body["model"], "Qwen2.5-VL-7B-Instruct");
        assert_eq!(body["max_tokens"], 64);
        assert_eq!(body["stream"], false);
        let messages = body["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1, "no system message: {body}");
        assert_eq!(
            messages[0]["content"][0]["text"],
            VlmPreset::Short.instruction()
        );
    }
}

#[test]
fn the_tags_preset_is_post_processed_and_a_custom_prompt_is_sent() {
    let server = VlmTestServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(photo("rocket.jpg"), dir.path().join("rocket.jpg")).unwrap();
    let images = lora_tagger::run::list_images(dir.path()).unwrap();
    let mut cfg = config(&server, VlmPreset::Tags);
    cfg.tags.undesired_tags = vec!["jpeg".into()];
    let mut vlm = vlm::from_config(&cfg).unwrap();
    let writer = CaptionWriter::new(cfg.captions.clone());
    let run = tag_to_captions_with_progress(&mut vlm, &images, &cfg.tags, &writer, 8, &mut |_| {})
        .unwrap();
    let sha = sha12(&photo("rocket.jpg"));
    // the reply "jpeg, 640x427, sha …" parsed as tags; `jpeg` is an undesired tag
    assert_eq!(
        caption(dir.path(), "rocket"),
        format!("sks, 640x427, sha {sha}")
    );
    assert_eq!(run.tags[0].1.len(), 3);
    assert_eq!(server.requests()[0]["body"]["max_tokens"], 96);

    // a custom instruction replaces the preset's; the preset still decides the parsing
    cfg.vlm.prompt = Some("List tags for this picture, please.".into());
    cfg.vlm.max_tokens = Some(20);
    cfg.captions.mode = lora_tagger::CaptionMode::Overwrite;
    let mut custom = vlm::from_config(&cfg).unwrap();
    assert!(
        lora_tagger::Tagger::model_id(&custom).ends_with(":tags:custom-prompt"),
        "{}",
        lora_tagger::Tagger::model_id(&custom)
    );
    let writer = CaptionWriter::new(cfg.captions.clone());
    tag_to_captions_with_progress(&mut custom, &images, &cfg.tags, &writer, 8, &mut |_| {})
        .unwrap();
    let last = server.requests().pop().unwrap();
    assert_eq!(
        last["body"]["messages"][0]["content"][0]["text"],
        "List tags for this picture, please."
    );
    assert_eq!(last["body"]["max_tokens"], 20);
}

#[test]
fn a_rejected_request_stops_the_run_with_the_servers_reason() {
    let server = VlmTestServer::start();
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(photo("rocket.jpg"), dir.path().join("rocket.jpg")).unwrap();
    let images = lora_tagger::run::list_images(dir.path()).unwrap();
    let mut cfg = config(&server, VlmPreset::Short);
    // a wrong API root: the server's 404 is not retried and names the key to fix
    cfg.vlm.base_url = Some(format!("http://127.0.0.1:{}/v2", server.port));
    let mut vlm = vlm::from_config(&cfg).unwrap();
    let writer = CaptionWriter::new(cfg.captions.clone());
    let err = caption_to_files_with_progress(&mut vlm, &images, &cfg.tags, &writer, 8, &mut |_| {})
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("HTTP 404") && msg.contains("vlm.base_url"),
        "{msg}"
    );
    assert!(!dir.path().join("rocket.txt").exists());
}
