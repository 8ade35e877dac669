//! Text datasets on real Shakespeare text and on generated JSONL/chat fixtures.

use crate::common;

use common::{asset_dir, decode, tokenizer};
use lora_data::Error;
use lora_data::loader::{Collate, Dataset, Loader, LoaderConfig};
use lora_data::text::{IGNORE_INDEX, TextConfig, TextDataset, TextFormat};
use tch::{Kind, Tensor};

fn cfg(format: TextFormat, seq_len: usize) -> TextConfig {
    TextConfig {
        format,
        seq_len,
        ..TextConfig::default()
    }
}

fn write(dir: &std::path::Path, name: &str, content: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

#[test]
fn tokenizer_fixture_has_chatml_specials() {
    let t = tokenizer();
    assert_eq!(t.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(t.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(t.token_to_id("<|im_end|>"), Some(2));
    let e = t.encode("<|im_start|>user", false).unwrap();
    assert_eq!(e.get_ids()[0], 1);
}

#[test]
fn shakespeare_plain_text_packs_into_full_rows_and_round_trips() {
    let Some(dir) = asset_dir("shakespeare") else {
        return;
    };
    let files = [dir.join("hamlet_gut.txt"), dir.join("macbeth_gut.txt")];
    let config = TextConfig {
        eos_token_id: Some(0),
        ..cfg(TextFormat::Plain, 256)
    };
    let ds = TextDataset::from_files(&files, tokenizer(), config).unwrap();
    let st = ds.stats();
    // Each file is one token stream cut into 256-token chunks: every chunk but the last of each
    // file fills a row alone.
    assert!(st.rows >= st.tokens / 256 && st.rows > 400, "{st:?}");
    assert_eq!(st.rows * 256, st.tokens + st.padding);
    assert!(st.padding < 2 * 256, "{st:?}");
    // The chunks of Hamlet, in order, decode back to the file (BOM-free, LF) plus <|endoftext|>.
    let docs = ds.documents();
    let hamlet_src = files[0].display().to_string();
    let mut chunks: Vec<_> = docs
        .iter()
        .filter(|d| d.source.starts_with(&hamlet_src))
        .collect();
    chunks.sort_by_key(|d| {
        d.source
            .rsplit('#')
            .next()
            .unwrap()
            .parse::<usize>()
            .unwrap()
    });
    let ids: Vec<i64> = chunks.iter().flat_map(|d| d.ids.clone()).collect();
    let text = std::fs::read_to_string(&files[0])
        .unwrap()
        .replace("\r\n", "\n");
    assert_eq!(decode(&ids), format!("{text}<|endoftext|>"));
    // Rows: position ids restart per document, doc ids count documents, first label masked.
    let s = ds.get(0).unwrap();
    assert_eq!(s.input_ids.len(), 256);
    assert_eq!(s.position_ids[0], 0);
    assert_eq!(s.labels[0], IGNORE_INDEX);
    assert_eq!(&s.labels[1..], &s.input_ids[1..]);
}

#[test]
fn packing_never_lets_documents_attend_to_each_other() {
    let dir = tempfile::tempdir().unwrap();
    let lines: Vec<String> = (0..40)
        .map(|i| {
            let words = "the king is dead long live the king ".repeat(1 + i % 7);
            serde_json::json!({ "text": format!("{i} {words}") }).to_string()
        })
        .collect();
    let f = write(dir.path(), "d.jsonl", &lines.join("\n"));
    let config = TextConfig {
        eos_token_id: Some(0),
        ..cfg(
            TextFormat::Jsonl {
                text_field: "text".into(),
            },
            128,
        )
    };
    let ds = TextDataset::from_files(&[f], tokenizer(), config).unwrap();
    let st = ds.stats();
    assert_eq!(st.documents, 40);
    assert!(st.rows < 40, "documents should share rows: {st:?}");
    // Every document is in exactly one row.
    let mut seen: Vec<usize> = ds.rows().iter().flatten().copied().collect();
    seen.sort();
    assert_eq!(seen, (0..40).collect::<Vec<_>>());
    let collate = ds.collate();
    let items: Vec<_> = (0..3).map(|i| ds.get(i).unwrap()).collect();
    let batch = collate.collate(items.clone()).unwrap();
    assert_eq!(batch.input_ids.size(), vec![3, 128]);
    let mask = batch.attention_mask_4d().unwrap();
    assert_eq!(mask.size(), vec![3, 1, 128, 128]);
    assert_eq!(mask.kind(), Kind::Bool);
    let m: Vec<i64> = Vec::try_from(mask.to_kind(Kind::Int64).flatten(0, -1)).unwrap();
    for (b, item) in items.iter().enumerate() {
        let n = item.input_ids.len();
        for i in 0..128 {
            for j in 0..128 {
                let di = if i < n { item.doc_ids[i] } else { 0 };
                let dj = if j < n { item.doc_ids[j] } else { 0 };
                let want = i == j || (j <= i && j < n && di == dj);
                assert_eq!(
                    m[b * 128 * 128 + i * 128 + j] == 1,
                    want,
                    "row {b} ({i},{j})"
                );
            }
        }
        // positions restart at each document boundary
        for k in 1..n {
            if item.doc_ids[k] != item.doc_ids[k - 1] {
                assert_eq!(item.position_ids[k], 0);
                assert_eq!(item.labels[k], IGNORE_INDEX);
            } else {
                assert_eq!(item.position_ids[k], item.position_ids[k - 1] + 1);
            }
        }
    }
    let pad_labels = batch.labels.masked_select(&batch.attention_mask.eq(0));
    assert!(
        Vec::<i64>::try_from(pad_labels)
            .unwrap()
            .iter()
            .all(|&l| l == IGNORE_INDEX)
    );
}

#[test]
fn chat_formats_train_only_on_assistant_turns() {
    let dir = tempfile::tempdir().unwrap();
    let sharegpt = write(
        dir.path(),
        "s.jsonl",
        r#"{"conversations":[{"from":"human","value":"Who is the Dane?"},{"from":"gpt","value":"Hamlet, the prince."},{"from":"human","value":"And his mother?"},{"from":"gpt","value":"Gertrude."}]}"#,
    );
    let messages = write(
        dir.path(),
        "m.json",
        "\u{feff}[{\"messages\":[{\"role\":\"system\",\"content\":\"Speak plainly.\"},{\"role\":\"user\",\"content\":\"Name a king.\"},{\"role\":\"assistant\",\"content\":\"Claudius.\"}]}]",
    );
    let alpaca = write(
        dir.path(),
        "a.jsonl",
        "{\"instruction\":\"Finish the line\",\"input\":\"To be, or not\",\"output\":\"to be.\"}\r\n",
    );
    let mut config = cfg(TextFormat::Conversations, 512);
    config.packing = false;
    let ds = TextDataset::from_files(&[&sharegpt, &messages], tokenizer(), config.clone()).unwrap();
    let trained = |ds: &TextDataset, source_part: &str| -> String {
        let d = ds
            .documents()
            .iter()
            .find(|d| d.source.contains(source_part))
            .unwrap();
        let ids: Vec<i64> = d
            .labels
            .iter()
            .copied()
            .filter(|&l| l != IGNORE_INDEX)
            .collect();
        decode(&ids)
    };
    assert_eq!(
        trained(&ds, "s.jsonl:1"),
        "Hamlet, the prince.<|im_end|>Gertrude.<|im_end|>"
    );
    assert_eq!(trained(&ds, "m.json:1"), "Claudius.<|im_end|>");
    let full = decode(
        &ds.documents()
            .iter()
            .find(|d| d.source.contains("m.json"))
            .unwrap()
            .ids,
    );
    assert_eq!(
        full,
        "<|im_start|>system\nSpeak plainly.<|im_end|>\n<|im_start|>user\nName a king.<|im_end|>\n\
         <|im_start|>assistant\nClaudius.<|im_end|>\n"
    );
    let mut alpaca_cfg = cfg(TextFormat::Alpaca, 512);
    let ds = TextDataset::from_files(&[&alpaca], tokenizer(), alpaca_cfg.clone()).unwrap();
    assert_eq!(trained(&ds, "a.jsonl:1"), "to be.<|im_end|>");
    alpaca_cfg.mask_prompt = false;
    let ds = TextDataset::from_files(&[&alpaca], tokenizer(), alpaca_cfg).unwrap();
    let d = &ds.documents()[0];
    assert_eq!(d.ids, d.labels);
    assert!(decode(&d.ids).contains("Finish the line\n\nTo be, or not"));
}

#[test]
fn padding_mode_buckets_by_length_and_pads_to_multiple_of_8() {
    let texts: Vec<String> = (0..30)
        .map(|i| "O Romeo, Romeo! ".repeat(1 + (i * 7) % 23))
        .collect();
    let jsonl: String = texts
        .iter()
        .map(|t| serde_json::json!({ "text": t }).to_string() + "\n")
        .collect();
    let config = TextConfig {
        packing: false,
        bucket_width: 32,
        ..cfg(
            TextFormat::Jsonl {
                text_field: "text".into(),
            },
            512,
        )
    };
    let ds = TextDataset::from_texts(&[("mem.jsonl", &jsonl)], tokenizer(), config).unwrap();
    assert_eq!(ds.len(), 30);
    let collate = ds.collate();
    let loader_cfg = LoaderConfig {
        batch_size: 4,
        num_workers: 2,
        ..LoaderConfig::default()
    };
    let mut loader = Loader::new(ds.clone(), collate, loader_cfg).unwrap();
    let plan = loader.plan(0);
    let mut n = 0;
    for (batch, idx) in loader.epoch().zip(plan) {
        let batch = batch.unwrap();
        n += 1;
        assert!(batch.doc_ids.is_none());
        let lens: Vec<usize> = idx
            .iter()
            .map(|&i| ds.get(i).unwrap().input_ids.len())
            .collect();
        let groups: Vec<u64> = idx.iter().map(|&i| ds.group(i)).collect();
        assert!(groups.iter().all(|&g| g == groups[0]), "{groups:?}");
        let s = batch.input_ids.size()[1] as usize;
        assert_eq!(s, lens.iter().max().unwrap().div_ceil(8) * 8);
        let real: i64 = batch.attention_mask.sum(Kind::Int64).int64_value(&[]);
        assert_eq!(real as usize, lens.iter().sum::<usize>());
    }
    assert_eq!(loader.state().epoch, 1);
    assert!(n >= 8);
}

#[test]
fn split_is_seeded_disjoint_and_complete() {
    let texts: String = (0..100)
        .map(|i| {
            serde_json::json!({ "text": format!("line number {i} of the play") }).to_string() + "\n"
        })
        .collect();
    let config = cfg(
        TextFormat::Jsonl {
            text_field: "text".into(),
        },
        64,
    );
    let ds = TextDataset::from_texts(&[("t.jsonl", &texts)], tokenizer(), config).unwrap();
    let (train, val) = ds.split(0.1, 7).unwrap();
    let (train2, val2) = ds.split(0.1, 7).unwrap();
    let (_, val3) = ds.split(0.1, 8).unwrap();
    assert_eq!(val.documents().len(), 10);
    assert_eq!(train.documents().len(), 90);
    assert_eq!(val.documents(), val2.documents());
    assert_eq!(train.documents(), train2.documents());
    assert_ne!(val.documents(), val3.documents());
    let mut all: Vec<String> = train
        .documents()
        .iter()
        .chain(val.documents())
        .map(|d| d.source.clone())
        .collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 100);
    assert!(matches!(ds.split(1.0, 0), Err(Error::Config { .. })));
}

#[test]
fn bad_text_inputs_name_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let bad_json = write(
        dir.path(),
        "bad.jsonl",
        "{\"text\":\"ok\"}\n{\"text\": oops}\n",
    );
    let e = TextDataset::from_files(
        &[&bad_json],
        tokenizer(),
        cfg(
            TextFormat::Jsonl {
                text_field: "text".into(),
            },
            64,
        ),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Format { line: 2, .. }), "{e}");
    let missing = write(dir.path(), "m.jsonl", "{\"content\":\"x\"}\n");
    let e = TextDataset::from_files(
        &[&missing],
        tokenizer(),
        cfg(
            TextFormat::Jsonl {
                text_field: "text".into(),
            },
            64,
        ),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("m.jsonl:1") && msg.contains("content"),
        "{msg}"
    );
    let latin1 = dir.path().join("l.txt");
    std::fs::write(&latin1, b"line one\nna\xefve\n").unwrap();
    let e =
        TextDataset::from_files(&[&latin1], tokenizer(), cfg(TextFormat::Plain, 64)).unwrap_err();
    assert!(matches!(e, Error::Format { line: 2, .. }), "{e}");
    let no_reply = write(
        dir.path(),
        "c.jsonl",
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    );
    let e = TextDataset::from_files(
        &[&no_reply],
        tokenizer(),
        cfg(TextFormat::Conversations, 64),
    )
    .unwrap_err();
    assert!(e.to_string().contains("assistant"), "{e}");
    let e =
        TextDataset::from_files(&[&no_reply], tokenizer(), cfg(TextFormat::Plain, 1)).unwrap_err();
    assert!(matches!(e, Error::Config { .. }));
    let e = TextDataset::from_files(
        &[dir.path().join("absent.txt")],
        tokenizer(),
        cfg(TextFormat::Plain, 64),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Io { .. }));
}

#[test]
fn loader_over_packed_text_is_identical_with_and_without_workers() {
    let texts: String = (0..60)
        .map(|i| {
            serde_json::json!({ "text": "Friends, Romans, countrymen ".repeat(1 + i % 5) })
                .to_string()
                + "\n"
        })
        .collect();
    let config = cfg(
        TextFormat::Jsonl {
            text_field: "text".into(),
        },
        48,
    );
    let ds = TextDataset::from_texts(&[("x.jsonl", &texts)], tokenizer(), config).unwrap();
    let run = |workers: usize| -> Vec<Vec<i64>> {
        let lc = LoaderConfig {
            batch_size: 2,
            num_workers: workers,
            ..LoaderConfig::default()
        };
        let mut l = Loader::new(ds.clone(), ds.collate(), lc).unwrap();
        l.epoch()
            .map(|b| Vec::<i64>::try_from(b.unwrap().input_ids.flatten(0, -1)).unwrap())
            .collect()
    };
    let a = run(0);
    assert_eq!(a, run(3));
    assert!(a.iter().all(|b| b.len() % 48 == 0));
    let _ = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
}

#[test]
fn padded_batch_mask_is_causal_and_hides_padding() {
    use lora_data::text::{TextCollate, TextSample};
    let collate = TextCollate {
        pad_token_id: 0,
        pad_to_multiple_of: 4,
        seq_len: None,
    };
    let sample = |n: usize| TextSample {
        input_ids: (1..=n as i64).collect(),
        labels: (1..=n as i64).collect(),
        position_ids: (0..n as i64).collect(),
        doc_ids: vec![1; n],
    };
    let b = collate.collate(vec![sample(5), sample(2)]).unwrap();
    assert_eq!(b.input_ids.size(), vec![2, 8]);
    assert!(b.doc_ids.is_none());
    let m: Vec<i64> = Vec::try_from(
        b.attention_mask_4d()
            .unwrap()
            .to_kind(Kind::Int64)
            .flatten(0, -1),
    )
    .unwrap();
    let lens = [5usize, 2];
    for (r, &n) in lens.iter().enumerate() {
        for i in 0..8 {
            for j in 0..8 {
                let want = i == j || (j <= i && j < n);
                assert_eq!(m[r * 64 + i * 8 + j] == 1, want, "row {r} ({i},{j})");
            }
        }
    }
    let labels: Vec<i64> = Vec::try_from(b.labels.get(1)).unwrap();
    assert_eq!(labels, vec![1, 2, -100, -100, -100, -100, -100, -100]);
}
