//! A tiny llama-architecture GGUF written here, with Q/K stored the way llama.cpp's converter
//! stores them (row-permuted) and Q8_0 blocks: both weight modes must give the HF model's logits.

use std::collections::HashMap;

use lora_models::llama::{Llama, LlamaConfig, WeightMode};
use tch::{Device, Kind, Tensor};

const HD: usize = 8;

fn config() -> LlamaConfig {
    LlamaConfig {
        model_type: "llama".into(),
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: None,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: None,
        max_position_embeddings: 128,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        hidden_act: "silu".into(),
        bos_token_id: None,
        eos_token_id: vec![],
    }
}

/// Q8_0 (ggml-quants.c `quantize_row_q8_0_ref`): per 32 weights, d = max|x| / 127, q = round(x / d).
fn q8_0(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    for b in x.chunks(32) {
        let amax = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(b.iter().map(|v| (v * id).round() as i8 as u8));
    }
    out
}

/// The converter's permutation (`LlamaModel.permute`): stored row h·hd + 2i + j = HF row h·hd + j·hd/2 + i.
fn permute_rows(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for r in 0..rows {
        let (h, within) = (r / HD, r % HD);
        let (j, i) = (within / (HD / 2), within % (HD / 2));
        let dst = h * HD + 2 * i + j;
        out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[r * cols..(r + 1) * cols]);
    }
    out
}

fn push_str(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

enum Kv {
    U32(u32),
    F32(f32),
    Str(&'static str),
}

/// Writes a GGUF v3 file: `tensors` are (name, torch shape, ggml type id, bytes).
fn write_gguf(
    path: &std::path::Path,
    kvs: &[(&str, Kv)],
    tensors: &[(String, Vec<i64>, u32, Vec<u8>)],
) {
    let mut b = Vec::new();
    b.extend(b"GGUF");
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (k, v) in kvs {
        push_str(&mut b, k);
        match v {
            Kv::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::F32(x) => {
                b.extend(6u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Kv::Str(s) => {
                b.extend(8u32.to_le_bytes());
                push_str(&mut b, s);
            }
        }
    }
    let mut offset = 0u64;
    let mut offsets = Vec::new();
    for (name, shape, ty, data) in tensors {
        push_str(&mut b, name);
        b.extend((shape.len() as u32).to_le_bytes());
        for d in shape.iter().rev() {
            b.extend((*d as u64).to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offsets.push(offset);
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while b.len() % 32 != 0 {
        b.push(0);
    }
    let start = b.len();
    for ((_, _, _, data), off) in tensors.iter().zip(offsets) {
        b.resize(start + off as usize, 0);
        b.extend(data);
    }
    std::fs::write(path, b).unwrap();
}

fn f32s(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.contiguous().view([-1])).unwrap()
}

fn dequant_q8_0(raw: &[u8]) -> Vec<f32> {
    lora_models::gguf::dequantize(lora_models::gguf::GgmlType::Q8_0, raw, raw.len() / 34 * 32)
        .unwrap()
}

#[test]
fn permuted_quantized_qk_rows_load_as_the_hf_model() {
    let _g = crate::rng_lock();
    tch::manual_seed(5);
    let c = config();
    let o = (Kind::Float, Device::Cpu);
    let (d, ff, v) = (32i64, 64i64, 64i64);
    // HF-layout weights; linear ones go through Q8_0, so the reference uses their dequantised values
    let mut hf: HashMap<String, Tensor> = HashMap::new();
    let mut tensors = Vec::new();
    let mut tensors_unpermuted = Vec::new();
    let mut add_q8 = |hf_name: &str, gguf_name: &str, out: i64, inp: i64, permute: bool| {
        let w = Tensor::randn([out, inp], o) * (1.0 / (inp as f64).sqrt());
        let x = f32s(&w);
        let deq = dequant_q8_0(&q8_0(&x));
        hf.insert(hf_name.into(), Tensor::from_slice(&deq).view([out, inp]));
        let stored = if permute {
            permute_rows(&x, out as usize, inp as usize)
        } else {
            x.clone()
        };
        tensors.push((gguf_name.to_string(), vec![out, inp], 8u32, q8_0(&stored)));
        tensors_unpermuted.push((gguf_name.to_string(), vec![out, inp], 8u32, q8_0(&x)));
    };
    add_q8(
        "model.layers.0.self_attn.q_proj.weight",
        "blk.0.attn_q.weight",
        32,
        d,
        true,
    );
    add_q8(
        "model.layers.0.self_attn.k_proj.weight",
        "blk.0.attn_k.weight",
        16,
        d,
        true,
    );
    add_q8(
        "model.layers.0.self_attn.v_proj.weight",
        "blk.0.attn_v.weight",
        16,
        d,
        false,
    );
    add_q8(
        "model.layers.0.self_attn.o_proj.weight",
        "blk.0.attn_output.weight",
        d,
        32,
        false,
    );
    add_q8(
        "model.layers.0.mlp.gate_proj.weight",
        "blk.0.ffn_gate.weight",
        ff,
        d,
        false,
    );
    add_q8(
        "model.layers.0.mlp.up_proj.weight",
        "blk.0.ffn_up.weight",
        ff,
        d,
        false,
    );
    add_q8(
        "model.layers.0.mlp.down_proj.weight",
        "blk.0.ffn_down.weight",
        d,
        ff,
        false,
    );
    add_q8("lm_head.weight", "output.weight", v, d, false);
    // f16 embedding, f32 norms
    let emb = Tensor::randn([v, d], o).to_kind(Kind::Half);
    hf.insert("model.embed_tokens.weight".into(), emb.to_kind(Kind::Float));
    let emb_bytes: Vec<u8> = f32s(&emb.to_kind(Kind::Float))
        .iter()
        .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
        .collect();
    let mut dense = vec![("token_embd.weight".to_string(), vec![v, d], 1u32, emb_bytes)];
    for (hf_name, g) in [
        (
            "model.layers.0.input_layernorm.weight",
            "blk.0.attn_norm.weight",
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            "blk.0.ffn_norm.weight",
        ),
        ("model.norm.weight", "output_norm.weight"),
    ] {
        let w = Tensor::randn([d], o) * 0.1 + 1.0;
        dense.push((
            g.to_string(),
            vec![d],
            0u32,
            f32s(&w).iter().flat_map(|x| x.to_le_bytes()).collect(),
        ));
        hf.insert(hf_name.into(), w);
    }
    tensors.extend(dense.iter().cloned());
    tensors_unpermuted.extend(dense);
    let kvs = [
        ("general.architecture", Kv::Str("llama")),
        ("llama.block_count", Kv::U32(1)),
        ("llama.context_length", Kv::U32(128)),
        ("llama.embedding_length", Kv::U32(32)),
        ("llama.feed_forward_length", Kv::U32(64)),
        ("llama.attention.head_count", Kv::U32(4)),
        ("llama.attention.head_count_kv", Kv::U32(2)),
        ("llama.attention.layer_norm_rms_epsilon", Kv::F32(1e-5)),
        ("llama.rope.freq_base", Kv::F32(10000.0)),
        ("llama.vocab_size", Kv::U32(64)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_gguf(&path, &kvs, &tensors);

    let x = (Tensor::arange(10, (Kind::Int64, Device::Cpu)) * 5)
        .remainder(64)
        .view([1, 10]);
    let want = Llama::from_tensors(c.clone(), &hf, Kind::Float, Device::Cpu)
        .unwrap()
        .forward_t(&x, None, None, false)
        .unwrap();
    for mode in [WeightMode::KeepQuantized, WeightMode::Dense(Kind::Float)] {
        let m = Llama::from_gguf(&path, mode, Device::Cpu).unwrap();
        assert!(!m.config().tie_word_embeddings);
        assert_eq!(m.config().n_kv_heads(), 2);
        let got = m.forward_t(&x, None, None, false).unwrap();
        let diff = (&got - &want).abs().max().double_value(&[]);
        assert!(
            diff < 1e-4,
            "{mode:?}: logits differ from the HF model by {diff}"
        );
    }
    // control: the same file without the converter's permutation gives other logits, so the
    // test would catch a loader that forgot to undo it
    let path2 = dir.path().join("unpermuted.gguf");
    write_gguf(&path2, &kvs, &tensors_unpermuted);
    let m = Llama::from_gguf(&path2, WeightMode::KeepQuantized, Device::Cpu).unwrap();
    let diff = (&m.forward_t(&x, None, None, false).unwrap() - &want)
        .abs()
        .max()
        .double_value(&[]);
    assert!(diff > 1e-3, "un-permuting made no difference ({diff})");
}
