//! The real SmolLM2-135M-Instruct Q4_1 GGUF (fetched into `assets/` by `cargo xtask setup`):
//! header facts from `shared/ASSETS.md`. Skips with a notice when the asset is absent; the parser
//! itself is also tested on files the unit tests write.

use lora_memory::gguf::{GgufValue, read_header};
use lora_memory::{BaseDtype, ModelDescriptor, Settings, estimate};
use std::path::PathBuf;

fn asset() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.is_file() {
        Some(p)
    } else {
        eprintln!(
            "skipping: {} not present (run `cargo xtask setup`)",
            p.display()
        );
        None
    }
}

#[test]
fn smollm2_gguf_header_matches_the_published_facts() {
    let Some(p) = asset() else { return };
    let h = read_header(&p).unwrap();
    assert_eq!(h.version, 3);
    let md = &h.metadata;
    assert_eq!(
        md["general.architecture"],
        GgufValue::String("llama".into())
    );
    assert_eq!(md["llama.block_count"].as_u64(), Some(30));
    assert_eq!(md["llama.embedding_length"].as_u64(), Some(576));
    assert_eq!(md["llama.feed_forward_length"].as_u64(), Some(1536));
    assert_eq!(md["llama.attention.head_count"].as_u64(), Some(9));
    assert_eq!(md["llama.attention.head_count_kv"].as_u64(), Some(3));
    assert_eq!(md["llama.rope.dimension_count"].as_u64(), Some(64));
    assert!(matches!(
        md["tokenizer.ggml.tokens"],
        GgufValue::Array {
            elem_type: 8,
            len: 49152
        }
    ));
    assert!(
        !h.tensors.iter().any(|t| t.name == "output.weight"),
        "embeddings are tied"
    );
    let q = h
        .tensors
        .iter()
        .find(|t| t.name == "blk.0.attn_q.weight")
        .unwrap();
    assert_eq!(q.dims, vec![576, 576]);
    assert_eq!(q.ggml_type, 3, "Q4_1");
    let emb = h
        .tensors
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .unwrap();
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!(emb.ggml_type, 8, "Q8_0");
    // 210 Q4_1 tensors (7 linears × 30 layers).
    assert_eq!(h.tensors.iter().filter(|t| t.ggml_type == 3).count(), 210);
    // The data section ends at the file's end: header + padding + Σ stored bytes.
    let data: u64 = h.tensors.iter().map(|t| t.stored_bytes().unwrap()).sum();
    let file_len = std::fs::metadata(&p).unwrap().len();
    assert!(
        data < file_len && file_len - data - h.header_bytes < 64 * 1024 * 210,
        "{data} {file_len}"
    );

    let m = ModelDescriptor::from_gguf(&p).unwrap();
    assert_eq!(m.params(), 134_515_008);
    let ModelDescriptor::Decoder(d) = &m else {
        panic!()
    };
    assert_eq!(
        (
            d.hidden,
            d.intermediate,
            d.layers,
            d.heads,
            d.kv_heads,
            d.head_dim,
            d.vocab
        ),
        (576, 1536, 30, 9, 3, 64, 49152)
    );
    assert!(d.tied_embeddings);
    assert_eq!(m, {
        let mut preset = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        if let ModelDescriptor::Decoder(pd) = &mut preset {
            pd.name.clone_from(&d.name);
            // the file states the count: the sum of its tensor sizes, equal to the preset's
            pd.exact_params = Some(pd.params());
        }
        preset
    });
    // Q4_1 base weights: linears at 20 B / 32 weights + the rest 16-bit, and this SDK's
    // 2 KiB decode table per quantized tensor (7 per layer).
    let e = estimate(&m, &Settings::default().with_base_dtype(BaseDtype::Q4_1)).unwrap();
    let want = d.layer_linear_params() as f64 * 0.625
        + (d.params() - d.layer_linear_params()) as f64 * 2.0
        + lora_memory::estimate::OURS_PAIR_TABLE_BYTES * 7.0 * d.layers as f64;
    assert!((e.breakdown.base_weights.as_f64() - want).abs() < 2.0);
}
