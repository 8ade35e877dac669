//! The in-process LLM tagger on the embedded SmolLM2-135M-Instruct with real captions
//! (scikit-image sample-image docstrings, OpenMoji annotations).

use std::path::Path;

use lora_tagger::Tagger;
use lora_tagger::error::Error;
use lora_tagger::llm::local::{LocalLlmOptions, LocalLlmTagger};

fn tags_of(r: &lora_tagger::ItemResult) -> Vec<String> {
    r.as_ref()
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|t| t.tag.clone())
        .collect()
}

#[test]
fn smollm2_tags_real_captions_and_batches_match_single_runs() {
    let mut t = LocalLlmTagger::load(
        None,
        LocalLlmOptions {
            max_new_tokens: 32,
            max_batch_size: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        t.model_id(),
        "local:SmolLM2-135M-Instruct.Q4_1.gguf:98362432B:greedy:n32"
    );
    let d: Vec<String> = [
        "A golden eagle.",
        "Chelsea the cat.",
        "Black and white silhouette of a horse.",
        "grinning face",
    ]
    .map(String::from)
    .to_vec();
    let out = t.tag_descriptions(&d).unwrap();
    assert_eq!(out.len(), 4);
    let tags: Vec<Vec<String>> = out.iter().map(tags_of).collect();
    for (desc, t) in d.iter().zip(&tags) {
        eprintln!("{desc:?} -> {t:?}");
        assert!(!t.is_empty(), "{desc}");
        assert!(
            t.iter()
                .all(|x| x.split_whitespace().count() <= 5 && *x == x.to_lowercase()),
            "{t:?}"
        );
    }
    // clear cases (what SmolLM2-135M-Instruct answers greedily with the default prompt)
    assert!(tags[0].iter().any(|x| x.contains("eagle")), "{:?}", tags[0]);
    assert!(tags[1].iter().any(|x| x.contains("cat")), "{:?}", tags[1]);
    assert!(tags[2].iter().any(|x| x.contains("horse")), "{:?}", tags[2]);

    // two prompts of equal token length run as one [2, seq] micro-batch give the same tags as
    // each run alone
    let len = |s: &str| t.prompt_ids(s).unwrap().len();
    let (a, b) = ("A golden eagle.", "A grey horse.");
    assert_eq!(
        len(a),
        len(b),
        "the pair must tokenize to the same prompt length"
    );
    let pair = [a.to_string(), b.to_string()];
    let batched: Vec<Vec<String>> = t
        .tag_descriptions(&pair)
        .unwrap()
        .iter()
        .map(tags_of)
        .collect();
    assert_eq!(batched[0], tags[0], "batched row 0 = the single run");
    let single_b = t.tag_descriptions(&pair[1..]).unwrap();
    assert_eq!(batched[1], tags_of(&single_b[0]));

    assert!(matches!(
        t.tag_images(&["x.png".into()]),
        Err(Error::Unsupported { .. })
    ));

    // the batch plan shown before a run: lora-memory's formula over the resident weights and
    // one prompt's row (KV cache, logits, MLP activations), against two budgets
    let row = t.row_bytes(t.prompt_ids(a).unwrap().len());
    let weights = t.model().weights_resident_bytes();
    let plan = |budget: u64| t.batch_plan(a, Some(lora_memory::Bytes(budget))).unwrap();
    let small = plan(weights * 2);
    assert_eq!(small.memory.weights.0, weights);
    assert_eq!(small.memory.per_item.0, row);
    let expected = ((weights * 2) as f64 * 0.8 - weights as f64) / row as f64;
    assert_eq!(small.fits, expected as usize);
    let big = plan(8 << 30);
    assert_eq!(
        (big.batch, big.limit),
        (4, lora_memory::inference::BatchLimit::MaxBatch)
    );
    assert!(big.fits > small.fits);
}

#[test]
fn a_missing_model_path_is_an_io_error_naming_it() {
    match LocalLlmTagger::load(
        Some(Path::new("no/such/model.gguf")),
        LocalLlmOptions::default(),
    ) {
        Err(Error::Io { path, source }) => {
            assert_eq!(path, Path::new("no/such/model.gguf"));
            assert!(source.to_string().contains("cargo xtask setup"), "{source}");
        }
        other => panic!("{:?}", other.map(|t| t.model_id())),
    }
    match LocalLlmTagger::load(
        None,
        LocalLlmOptions {
            max_batch_size: 0,
            ..Default::default()
        },
    ) {
        Err(Error::Config { key, .. }) => assert_eq!(key, "generation_settings.max_batch_size"),
        other => panic!("{:?}", other.map(|t| t.model_id())),
    }
}
