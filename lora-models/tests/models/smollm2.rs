//! The real SmolLM2-135M-Instruct GGUF against the golden values of `ASSETS.md`
//! (an f32 reference forward on the dequantised weights).

use crate::common;

use common::{FOX, ONCE, dense_f32, quantized, tokenizer};
use lora_models::gguf::GgufFile;
use lora_models::llama::{GenerateOptions, Llama, PerplexityOptions, StopReason, WeightMode};
use lora_models::tokenizer::{ChatMessage, ChatTemplate};
use tch::{Device, Kind, Tensor};

fn ids_tensor(ids: &[i64]) -> Tensor {
    Tensor::from_slice(ids).view([1, -1])
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn tokenizer_matches_golden_ids() {
    let t = tokenizer();
    assert_eq!(t.encode(ONCE, true).unwrap(), vec![6403, 1980, 253, 655]);
    assert_eq!(t.encode(FOX, true).unwrap().len(), 24);
    // special tokens are single ids; digits are split one by one; no BOS is added
    let chat = t
        .encode("<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n", true)
        .unwrap();
    assert_eq!(chat[0], 1);
    assert_eq!(&chat[5..8], &[216, 33, 34]);
    assert!(chat.contains(&2));
    assert_eq!((t.bos_id, t.eos_id, t.pad_id), (Some(1), Some(2), Some(2)));
    assert_eq!(t.decode(&[6403, 1980, 253, 655], false).unwrap(), ONCE);
    assert_eq!(t.decode(&chat, true).unwrap(), "user\nWhat is 12 + 30?\n");
}

#[test]
fn config_from_gguf_metadata() {
    let g = GgufFile::open(common::gguf_path()).unwrap();
    let c = lora_models::llama::LlamaConfig::from_gguf(&g).unwrap();
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.intermediate_size),
        (30, 576, 1536)
    );
    assert_eq!(
        (c.num_attention_heads, c.n_kv_heads(), c.head_dim()),
        (9, 3, 64)
    );
    assert_eq!((c.rope_theta, c.vocab_size), (100000.0, 49152));
    // stored as f32 in the file
    assert!((c.rms_norm_eps - 1e-5).abs() < 1e-12);
    assert!(c.tie_word_embeddings);
    assert_eq!(g.tensors().len(), 272);
    let m = dense_f32();
    assert_eq!(m.num_params(), 134_515_008);
}

#[test]
fn next_token_logits_match_golden() {
    let m = dense_f32();
    let logits = m
        .forward_t(&ids_tensor(&[6403, 1980, 253, 655]), None, None, false)
        .unwrap();
    assert_eq!(logits.size(), vec![1, 4, 49152]);
    assert_eq!(logits.kind(), Kind::Float);
    let last = logits.select(1, 3).select(0, 0);
    let (vals, idx) = last.topk(3, -1, true, true);
    let idx = Vec::<i64>::try_from(&idx).unwrap();
    let vals = Vec::<f32>::try_from(&vals).unwrap();
    let t = tokenizer();
    assert_eq!(idx[0], 28);
    assert_eq!(t.decode(&idx, false).unwrap(), ", in there");
    // golden values are given to 2 decimals: tolerance 0.02
    for (v, g) in vals.iter().zip([18.14f32, 14.08, 13.37]) {
        assert!((v - g).abs() < 0.02, "logit {v} vs golden {g}");
    }
    println!("top-3 next tokens after {ONCE:?}: {idx:?} logits {vals:?}");
}

#[test]
fn mean_nll_matches_golden() {
    let m = dense_f32();
    let ids = tokenizer().encode(FOX, true).unwrap();
    let x = ids_tensor(&ids);
    let nll = m.loss(&x, &x, None, None, false).unwrap().double_value(&[]);
    println!("mean NLL of the 24-token sentence: {nll:.5} (golden 2.7718)");
    // golden to 4 decimals; our f32 path differs from the reference only by summation order
    assert!((nll - 2.7718).abs() < 1e-3, "mean NLL {nll}");
    // labels at -100 are ignored: masking the first half changes the mean to that of the rest
    let mut lab = ids.clone();
    lab[..12].iter_mut().for_each(|l| *l = -100);
    let half = m
        .loss(&x, &ids_tensor(&lab), None, None, false)
        .unwrap()
        .double_value(&[]);
    assert!((half - nll).abs() > 1e-3);
    // perplexity over a file with one window equals exp(mean NLL)
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("fox.txt");
    std::fs::write(&f, FOX).unwrap();
    let r = m
        .perplexity(
            tokenizer(),
            &f,
            &PerplexityOptions {
                max_length: 64,
                stride: 32,
            },
        )
        .unwrap();
    assert_eq!((r.tokens_scored, r.windows), (23, 1));
    assert!(
        (r.mean_nll - nll).abs() < 1e-4 && (r.perplexity - 16.0).abs() < 0.1,
        "{r:?}"
    );
    // strided windows: still every token once, but with less context the NLL is higher
    let r8 = m
        .perplexity(
            tokenizer(),
            &f,
            &PerplexityOptions {
                max_length: 8,
                stride: 4,
            },
        )
        .unwrap();
    assert_eq!(r8.tokens_scored, 23);
    assert!(r8.windows > 1 && r8.mean_nll > r.mean_nll, "{r8:?}");
}

#[test]
fn chatml_capital_of_france_is_paris() {
    let m = dense_f32();
    let g = GgufFile::open(common::gguf_path()).unwrap();
    let template = ChatTemplate::from_gguf(&g)
        .unwrap()
        .expect("SmolLM2's GGUF stores its chat template");
    assert!(matches!(template, ChatTemplate::Jinja(_)), "{template:?}");
    assert_eq!(template.end_of_turn().as_deref(), Some("<|im_end|>"));
    // its own template, with the default system prompt it inserts — transformers' rendering:
    // render_jinja_template(conversations=[[{"role": "user", "content": "What is the capital of
    // France?"}]], chat_template=<tokenizer.chat_template>, add_generation_prompt=True)
    let question = [ChatMessage::user("What is the capital of France?")];
    assert_eq!(
        template.apply(&question, true).unwrap(),
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let opts = GenerateOptions {
        max_new_tokens: 24,
        ..Default::default()
    };
    let answer = m.chat(tokenizer(), &template, &question, &opts).unwrap();
    println!("template {template:?}\nanswer: {answer:?}");
    assert_eq!(answer.trim(), "The capital of France is Paris.");
}

#[test]
fn kv_cache_matches_full_forward_and_sampling_is_seeded() {
    let m = dense_f32();
    let ids = tokenizer().encode(FOX, true).unwrap();
    let full = m
        .forward_t(&ids_tensor(&ids[..10]), None, None, false)
        .unwrap();
    let mut cache = lora_models::llama::KvCache::new(m.num_layers());
    let a = m
        .forward_cached(&ids_tensor(&ids[..6]), &mut cache)
        .unwrap();
    let b = m
        .forward_cached(&ids_tensor(&ids[6..9]), &mut cache)
        .unwrap();
    let c = m
        .forward_cached(&ids_tensor(&ids[9..10]), &mut cache)
        .unwrap();
    assert_eq!(cache.seq_len(), 10);
    let inc = Tensor::cat(&[a, b, c], 1);
    let d = max_abs_diff(&inc, &full);
    assert!(d < 1e-3, "cached vs full logits differ by {d}");
    // seeded sampling: same seed same tokens, stop by max tokens
    let opts = GenerateOptions {
        max_new_tokens: 6,
        temperature: 0.9,
        top_p: 0.9,
        seed: 3,
        ..Default::default()
    };
    let g1 = m.generate(&ids[..5], &opts).unwrap();
    let g2 = m.generate(&ids[..5], &opts).unwrap();
    assert_eq!(g1, g2);
    assert_eq!(g1.stop_reason, StopReason::MaxTokens);
    assert_eq!(g1.tokens.len(), 6);
}

#[test]
fn padding_and_packed_documents_match_separate_runs() {
    let m = dense_f32();
    let t = tokenizer();
    let a = t.encode(ONCE, true).unwrap();
    let b = t.encode("The quick brown fox jumps", true).unwrap();
    let la = m.forward_t(&ids_tensor(&a), None, None, false).unwrap();
    let lb = m.forward_t(&ids_tensor(&b), None, None, false).unwrap();
    let (na, nb) = (a.len() as i64, b.len() as i64);
    // batch with `a` left-padded to the length of `b`
    let pad = nb - na;
    let mut row_a = vec![2i64; pad as usize];
    row_a.extend(&a);
    let ids = Tensor::from_slice(&[row_a, b.clone()].concat()).view([2, nb]);
    let mut mask_a = vec![0i64; pad as usize];
    mask_a.extend(vec![1; na as usize]);
    let mask = Tensor::from_slice(&[mask_a, vec![1; nb as usize]].concat()).view([2, nb]);
    let out = m.forward_t(&ids, Some(&mask), None, false).unwrap();
    let d1 = max_abs_diff(&out.get(0).narrow(0, pad, na), &la.get(0));
    let d2 = max_abs_diff(&out.get(1), &lb.get(0));
    assert!(d1 < 1e-3 && d2 < 1e-3, "padded batch differs: {d1} {d2}");
    assert!(bool::try_from(out.isfinite().all()).unwrap());
    // the two packed into one row, positions restarting at 0
    let packed = ids_tensor(&[a.clone(), b.clone()].concat());
    let pos: Vec<i64> = (0..na).chain(0..nb).collect();
    let out = m
        .forward_t(&packed, None, Some(&ids_tensor(&pos)), false)
        .unwrap();
    let d3 = max_abs_diff(&out.get(0).narrow(0, 0, na), &la.get(0));
    let d4 = max_abs_diff(&out.get(0).narrow(0, na, nb), &lb.get(0));
    assert!(d3 < 1e-3 && d4 < 1e-3, "packed documents differ: {d3} {d4}");
}

#[test]
fn kept_quantized_matches_dense_and_memory() {
    let x = ids_tensor(&[6403, 1980, 253, 655]);
    let dense_logits = dense_f32().forward_t(&x, None, None, false).unwrap();
    let dense_bytes = dense_f32().weights_resident_bytes();
    let q = quantized();
    let q_logits = q.forward_t(&x, None, None, false).unwrap();
    let d = max_abs_diff(&q_logits, &dense_logits);
    assert!(
        d < 1e-3,
        "kept-quantized logits differ from dense f32 by {d}"
    );
    let q_bytes = q.weights_resident_bytes();
    drop(q);
    common::init_threads();
    let bf16 = Llama::from_gguf(
        common::gguf_path(),
        WeightMode::Dense(Kind::BFloat16),
        Device::Cpu,
    )
    .unwrap();
    let bf16_bytes = bf16.weights_resident_bytes();
    let ids = tokenizer().encode(FOX, true).unwrap();
    let xf = ids_tensor(&ids);
    let nll_bf16 = bf16
        .loss(&xf, &xf, None, None, false)
        .unwrap()
        .double_value(&[]);
    println!(
        "weights resident: KeepQuantized {q_bytes} B ({:.1} MiB), Dense(BFloat16) {bf16_bytes} B ({:.1} MiB), \
         Dense(Float) {dense_bytes} B ({:.1} MiB); bf16 mean NLL {nll_bf16:.4}",
        q_bytes as f64 / 1048576.0,
        bf16_bytes as f64 / 1048576.0,
        dense_bytes as f64 / 1048576.0
    );
    // 134.5 M params: f32 = 4 B each, bf16 = 2 B (+ the f32 RoPE table, 32 floats);
    // Q4_1 = 20 B / 32 weights, Q8_0 = 34 B / 32
    assert_eq!(dense_bytes, 134_515_008 * 4 + 32 * 4);
    assert_eq!(bf16_bytes, 134_515_008 * 2 + 32 * 4);
    assert!(q_bytes < bf16_bytes / 2, "{q_bytes} vs {bf16_bytes}");
    assert!((nll_bf16 - 2.7718).abs() < 0.05, "bf16 NLL {nll_bf16}");
}

/// SmolLM2 re-quantized by llama.cpp's own quantizer to `Q4_K_M` (llama-cpp-python,
/// `lora-core/tests/interop/gguf_kquants.py`): Q4_K and Q6_K tensors where rows are 1536 wide,
/// Q5_0 / Q8_0 fallbacks for the 576-wide ones. Kept quantized (the tiled kernel), the model gives
/// the logits of its dense f32 dequantization and still continues "Once upon a time" with ",".
#[test]
fn q4_k_m_requantized_file_runs_kept_quantized() {
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = std::process::Command::new(root.join(".venv/bin/python"))
        .arg(root.join("lora-core/tests/interop/gguf_kquants.py"))
        .arg("requant")
        .arg(common::gguf_path())
        .arg(dir.path())
        .arg("Q4_K_M")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "re-quantizing with llama-cpp-python failed (run `cargo xtask setup`):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = dir.path().join("Q4_K_M.gguf");
    let file = GgufFile::open(&path).unwrap();
    let types: std::collections::BTreeSet<String> = file
        .tensors()
        .iter()
        .map(|t| format!("{:?}", t.ggml_type))
        .collect();
    assert!(
        types.contains("Q4K") && types.contains("Q6K") && types.contains("Q5_0"),
        "{types:?}"
    );
    common::init_threads();
    let x = ids_tensor(&[6403, 1980, 253, 655]);
    let q = Llama::from_gguf_file(&file, WeightMode::KeepQuantized, Device::Cpu).unwrap();
    let q_logits = q.forward_t(&x, None, None, false).unwrap();
    let q_bytes = q.weights_resident_bytes();
    drop(q);
    let dense = Llama::from_gguf_file(&file, WeightMode::Dense(Kind::Float), Device::Cpu).unwrap();
    let dense_logits = dense.forward_t(&x, None, None, false).unwrap();
    let d = max_abs_diff(&q_logits, &dense_logits);
    assert!(
        d < 1e-3,
        "kept-quantized logits differ from dense f32 by {d}"
    );
    let last = q_logits.select(1, 3).select(0, 0);
    let (vals, idx) = last.topk(3, -1, true, true);
    let idx = Vec::<i64>::try_from(&idx).unwrap();
    println!(
        "Q4_K_M: top-3 after {ONCE:?}: {idx:?} ({:?}) logits {vals:?}; kept quantized {q_bytes} B \
         ({:.1} MiB), dense f32 {} B; max |kept − dense| logit {d:.2e}",
        tokenizer().decode(&idx, false).unwrap(),
        q_bytes as f64 / 1048576.0,
        dense.weights_resident_bytes()
    );
    assert_eq!(idx[0], 28, "top-1 after {ONCE:?} is not ','");
    assert!(q_bytes < dense.weights_resident_bytes() / 4);
}

/// `perplexity_ids` scores through the chunked head loss (no `[window, vocab]` logits, a tied
/// quantized head multiplied tile by tile): each window's NLL equals the plain path's, the full
/// logits of `forward_t` and their log-softmax, for the dense and the kept-quantized model.
#[test]
fn perplexity_equals_the_full_logits_reference() {
    let ids = tokenizer().encode(FOX, true).unwrap();
    let opts = PerplexityOptions {
        max_length: 8,
        stride: 4,
    };
    for name in ["dense", "quantized"] {
        // one model locked at a time
        let m = if name == "dense" {
            dense_f32()
        } else {
            quantized()
        };
        let r = m.perplexity_ids(&ids, &opts).unwrap();
        // the same windows by hand: tokens [prev_end, end) scored, each given its window's context
        let (mut sum, mut scored, mut prev_end, mut begin) = (0.0f64, 0usize, 0usize, 0usize);
        loop {
            let end = (begin + opts.max_length).min(ids.len());
            let logp = m
                .forward_t(&ids_tensor(&ids[begin..end]), None, None, false)
                .unwrap()
                .log_softmax(-1, Kind::Double)
                .select(0, 0);
            for t in prev_end.max(begin + 1)..end {
                sum -= logp.double_value(&[(t - 1 - begin) as i64, ids[t]]);
                scored += 1;
            }
            prev_end = end;
            if end == ids.len() {
                break;
            }
            begin += opts.stride;
        }
        assert_eq!(r.tokens_scored, scored, "{name}");
        let want = sum / scored as f64;
        assert!(
            (r.mean_nll - want).abs() < 2e-5,
            "{name}: {} vs {want}",
            r.mean_nll
        );
    }
}
