//! A tiny random-weight LLaMA (and Qwen2/Qwen3 variants): injection sites, activation
//! checkpointing, KV cache, and the safetensors loaders.

use std::collections::HashMap;

use lora_core::base::BaseWeight;
use lora_core::config::LoraConfig;
use lora_core::inject::{Adaptable, SiteMut, inject, site_names};
use lora_core::layer::LoraLayer;
use lora_core::quant::{QuantKind, QuantWeight};
use lora_models::llama::{KvCache, Llama, LlamaConfig, WeightMode};
use safetensors::tensor::TensorView;
use tch::{Device, Kind, Tensor, nn};

fn tiny_config(model_type: &str) -> LlamaConfig {
    LlamaConfig {
        model_type: model_type.into(),
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
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

fn random_weights(c: &LlamaConfig, seed: i64) -> HashMap<String, Tensor> {
    lora_models::llama::random_weights(c, seed).unwrap()
}

fn ids(b: i64, s: i64) -> Tensor {
    Tensor::arange(b * s, (Kind::Int64, Device::Cpu))
        .remainder(61)
        .view([b, s])
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

#[test]
fn sites_have_hf_names_and_peft_targets_map_one_to_one() {
    let _g = crate::rng_lock();
    let c = tiny_config("llama");
    let mut m =
        Llama::from_tensors(c.clone(), &random_weights(&c, 0), Kind::Float, Device::Cpu).unwrap();
    let names: Vec<String> = site_names(&mut m)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    let mut want = vec!["model.embed_tokens".to_string()];
    for i in 0..2 {
        for s in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ] {
            want.push(format!("model.layers.{i}.{s}"));
        }
    }
    want.push("lm_head".into());
    assert_eq!(names, want);

    // tied head: no lm_head site
    let mut ct = c.clone();
    ct.tie_word_embeddings = true;
    let mut mt = Llama::from_tensors(
        ct.clone(),
        &random_weights(&ct, 0),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap();
    assert!(
        !site_names(&mut mt)
            .unwrap()
            .iter()
            .any(|(n, _)| n == "lm_head")
    );

    // PEFT-style targets: q_proj and v_proj in both layers; B = 0 leaves the output unchanged
    let x = ids(2, 7);
    let before = m.forward_t(&x, None, None, false).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let report = inject(
        &mut m,
        &LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]),
        "default",
        &vs.root(),
    )
    .unwrap();
    assert_eq!(
        report.modules,
        vec![
            "model.layers.0.self_attn.q_proj",
            "model.layers.0.self_attn.v_proj",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.v_proj"
        ]
    );
    assert_eq!(vs.trainable_variables().len(), 8);
    let after = m.forward_t(&x, None, None, false).unwrap();
    assert_eq!(max_diff(&before, &after), 0.0);
    perturb(&vs, 0.1);
    let changed = m.forward_t(&x, None, None, false).unwrap();
    assert!(max_diff(&before, &changed) > 1e-3);
}

/// Adds `scale`·N(0, 1) noise to every trainable variable (LoRA B starts at zero).
fn perturb(vs: &nn::VarStore, scale: f64) {
    tch::no_grad(|| {
        for v in vs.trainable_variables() {
            let _ = v
                .shallow_clone()
                .f_add_(&(Tensor::randn_like(&v) * scale))
                .unwrap();
        }
    });
}

/// Zeroes the gradients of `vs`'s trainable variables.
fn zero_grads(vs: &nn::VarStore) {
    for v in vs.trainable_variables() {
        let mut g = v.grad();
        if g.defined() {
            let _ = g.zero_();
        }
    }
}

/// `[b, s]` ids from a stride through the vocabulary (0 … v − 1), and their labels with some
/// positions masked (−100): the first 5 of row 0 and the last quarter of the last row.
fn ids_and_masked_labels(b: i64, s: i64, v: i64) -> (Tensor, Tensor) {
    let x = (Tensor::arange(b * s, (Kind::Int64, Device::Cpu)) * 7919).remainder(v);
    let x = x.view([b, s]);
    let labels = x.copy();
    let _ = labels.get(0).narrow(0, 0, 5).fill_(-100);
    let _ = labels.get(b - 1).narrow(0, s - s / 4, s / 4).fill_(-100);
    (x, labels)
}

/// The plain causal-LM loss: mean cross-entropy of `logits` `[b, s, V]` at positions `0..s-1`
/// against `labels` shifted by one (−100 ignored).
fn shifted_cross_entropy(logits: &Tensor, labels: &Tensor) -> Tensor {
    let (s, v) = (logits.size()[1], logits.size()[2]);
    logits
        .narrow(1, 0, s - 1)
        .reshape([-1, v])
        .cross_entropy_loss::<Tensor>(
            &labels.narrow(1, 1, s - 1).reshape([-1]),
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )
}

fn grads(vs: &nn::VarStore) -> Vec<(String, Tensor)> {
    let mut v: Vec<(String, Tensor)> = vs
        .variables()
        .into_iter()
        .map(|(k, t)| (k, t.grad().copy()))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn checkpointed_gradients_equal_plain_gradients() {
    let _g = crate::rng_lock();
    let c = tiny_config("llama");
    let mut m =
        Llama::from_tensors(c.clone(), &random_weights(&c, 1), Kind::Float, Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let mut cfg = LoraConfig::new(
        4,
        8.0,
        &[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "lm_head",
            "embed_tokens",
        ],
    );
    cfg.lora_dropout = 0.2; // the recomputation must redraw the same dropout masks
    inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    perturb(&vs, 0.05);
    let x = ids(2, 9);
    let labels = x.copy();
    let _ = labels.narrow(1, 0, 3).fill_(-100);
    let mask = Tensor::ones([2, 9], (Kind::Int64, Device::Cpu));
    let _ = mask.get(0).narrow(0, 0, 2).fill_(0);

    let run = |m: &Llama| {
        for v in vs.trainable_variables() {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        tch::manual_seed(11);
        let loss = m
            .loss_backward(&x, &labels, Some(&mask), None, true, 0.5)
            .unwrap();
        (loss.double_value(&[]), grads(&vs))
    };
    let (l_plain, g_plain) = run(&m);
    m.set_gradient_checkpointing(true);
    let (l_ck, g_ck) = run(&m);
    assert!((l_plain - l_ck).abs() < 1e-6, "{l_plain} vs {l_ck}");
    assert_eq!(g_plain.len(), g_ck.len());
    let mut nonzero = 0;
    for ((name, a), (_, b)) in g_plain.iter().zip(&g_ck) {
        assert!(a.defined() && b.defined(), "{name} has no gradient");
        let scale = a.abs().max().double_value(&[]);
        let d = max_diff(a, b);
        assert!(
            d <= 1e-5 * scale.max(1e-3),
            "{name}: grads differ by {d} (scale {scale})"
        );
        if scale > 0.0 {
            nonzero += 1;
        }
    }
    // every adapter tensor (embedding included) received a gradient
    assert_eq!(nonzero, g_plain.len());
}

#[test]
fn kv_cache_and_variants() {
    let _g = crate::rng_lock();
    for ty in ["llama", "qwen2", "qwen3"] {
        let c = tiny_config(ty);
        let w = random_weights(&c, 2);
        let m = Llama::from_tensors(c.clone(), &w, Kind::Float, Device::Cpu).unwrap();
        let x = ids(1, 12);
        let full = m.forward_t(&x, None, None, false).unwrap();
        let mut cache = KvCache::new(m.num_layers());
        let a = m.forward_cached(&x.narrow(1, 0, 7), &mut cache).unwrap();
        let b = m.forward_cached(&x.narrow(1, 7, 5), &mut cache).unwrap();
        let d = max_diff(&Tensor::cat(&[a, b], 1), &full);
        assert!(d < 1e-4, "{ty}: cached vs full differ by {d}");
        // the variant's extra tensors are used: perturbing them changes the output
        let key = match ty {
            "qwen2" => Some("model.layers.0.self_attn.k_proj.bias"),
            "qwen3" => Some("model.layers.0.self_attn.q_norm.weight"),
            _ => None,
        };
        if let Some(key) = key {
            let mut w2: HashMap<String, Tensor> = w
                .iter()
                .map(|(k, t)| (k.clone(), t.shallow_clone()))
                .collect();
            w2.insert(key.into(), w[key].copy() * 3.0);
            let m2 = Llama::from_tensors(c.clone(), &w2, Kind::Float, Device::Cpu).unwrap();
            assert!(
                max_diff(&m2.forward_t(&x, None, None, false).unwrap(), &full) > 1e-4,
                "{key} unused"
            );
            w2.remove(key);
            let e = Llama::from_tensors(c.clone(), &w2, Kind::Float, Device::Cpu).unwrap_err();
            assert!(e.to_string().contains(key), "{e}");
        }
    }
}

fn write_safetensors(path: &std::path::Path, tensors: &[(&String, &Tensor)], kind: Kind) {
    let bufs: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(k, t)| {
            let t = t.to_kind(kind).contiguous();
            let mut bytes = vec![0u8; t.numel() * kind.elt_size_in_bytes()];
            t.copy_data_u8(&mut bytes, t.numel());
            (
                k.to_string(),
                bytes,
                t.size().iter().map(|&d| d as usize).collect(),
            )
        })
        .collect();
    let dtype = if kind == Kind::BFloat16 {
        safetensors::Dtype::BF16
    } else {
        safetensors::Dtype::F32
    };
    let views: Vec<(String, TensorView<'_>)> = bufs
        .iter()
        .map(|(k, b, s)| (k.clone(), TensorView::new(dtype, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

#[test]
fn loads_single_and_sharded_safetensors() {
    let _g = crate::rng_lock();
    let mut c = tiny_config("llama");
    c.rope_scaling = Some(lora_models::llama::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 64.0,
    });
    let w = random_weights(&c, 3);
    let reference = Llama::from_tensors(c.clone(), &w, Kind::Float, Device::Cpu).unwrap();
    let x = ids(1, 10);
    let want = reference.forward_t(&x, None, None, false).unwrap();

    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    // sharded, f32
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&c).unwrap(),
    )
    .unwrap();
    let (first, second) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        let ts: Vec<(&String, &Tensor)> = part.iter().map(|k| (*k, &w[*k])).collect();
        write_safetensors(&dir.path().join(file), &ts, Kind::Float);
        for k in part {
            map.insert(k.to_string(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let m =
        Llama::from_safetensors(dir.path(), WeightMode::Dense(Kind::Float), Device::Cpu).unwrap();
    assert_eq!(m.config().rope_scaling, c.rope_scaling);
    let d = max_diff(&m.forward_t(&x, None, None, false).unwrap(), &want);
    assert!(d < 1e-6, "sharded load differs by {d}");

    // single file stored in bf16, loaded as f32: equal to the bf16-rounded weights
    let dir2 = tempfile::tempdir().unwrap();
    std::fs::write(
        dir2.path().join("config.json"),
        serde_json::to_string(&c).unwrap(),
    )
    .unwrap();
    let ts: Vec<(&String, &Tensor)> = names.iter().map(|k| (*k, &w[*k])).collect();
    write_safetensors(&dir2.path().join("model.safetensors"), &ts, Kind::BFloat16);
    let m2 =
        Llama::from_safetensors(dir2.path(), WeightMode::Dense(Kind::Float), Device::Cpu).unwrap();
    let rounded: HashMap<String, Tensor> = w
        .iter()
        .map(|(k, t)| (k.clone(), t.to_kind(Kind::BFloat16).to_kind(Kind::Float)))
        .collect();
    let want2 = Llama::from_tensors(c.clone(), &rounded, Kind::Float, Device::Cpu)
        .unwrap()
        .forward_t(&x, None, None, false)
        .unwrap();
    let d2 = max_diff(&m2.forward_t(&x, None, None, false).unwrap(), &want2);
    assert!(d2 < 1e-6, "bf16 file differs by {d2}");

    // a missing tensor is named in the error
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = Llama::from_safetensors(dir.path(), WeightMode::Dense(Kind::Float), Device::Cpu)
        .unwrap_err();
    assert!(
        e.to_string().contains("model-00002-of-00002.safetensors"),
        "{e}"
    );
}

/// `WeightMode::KeepQuantized` on a dense safetensors folder is QLoRA's base (transformers +
/// bitsandbytes `load_in_4bit`, `nf4`, double quantization): the decoder layers' linears are NF4,
/// the embedding and the untied LM head stay dense f32, a linear whose `out·in` is no multiple of
/// 64 stays dense; and the forward is the dense model's on the NF4-rounded weights.
#[test]
fn keep_quantized_safetensors_folder_loads_an_nf4_base() {
    let _g = crate::rng_lock();
    let mut c = tiny_config("llama");
    // the MLP's [49, 32] / [32, 49] weights hold 1568 values, not a multiple of 64
    c.intermediate_size = 49;
    let w = random_weights(&c, 11);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("config.json"),
        serde_json::to_string(&c).unwrap(),
    )
    .unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let ts: Vec<(&String, &Tensor)> = names.iter().map(|k| (*k, &w[*k])).collect();
    write_safetensors(&dir.path().join("model.safetensors"), &ts, Kind::Float);
    let mut m =
        Llama::from_safetensors(dir.path(), WeightMode::KeepQuantized, Device::Cpu).unwrap();
    assert_eq!(m.kind(), Kind::Float);

    let nf4 = QuantKind::Nf4 { double_quant: true };
    let mut held: Vec<(String, Option<QuantKind>, Kind)> = Vec::new();
    m.visit_sites(&mut |name, s| {
        let b = match s {
            SiteMut::Linear(l) => l.base(),
            SiteMut::Embedding(e) => e.base(),
            _ => unreachable!("a decoder has linear and embedding sites only"),
        };
        let q = match b {
            BaseWeight::Quant(q) => Some(q.kind()),
            _ => None,
        };
        held.push((name.to_string(), q, b.kind()));
        Ok(())
    })
    .unwrap();
    assert_eq!(held.len(), 1 + 2 * 7 + 1, "{held:?}");
    for (name, q, kind) in &held {
        let attn = name.contains(".self_attn.");
        if attn {
            assert_eq!(*q, Some(nf4), "{name}");
        } else {
            // embedding, LM head (bitsandbytes' defaults), the MLP's misfits (the NF4 block)
            assert_eq!(*q, None, "{name}");
            assert_eq!(*kind, Kind::Float, "{name}");
        }
    }
    // NF4 double-quant: 4 bits a weight + 1 byte per 64 + 4 bytes per 256 blocks (+ the offset)
    let dense = Llama::from_tensors(c.clone(), &w, Kind::Float, Device::Cpu).unwrap();
    assert!(m.weights_resident_bytes() < dense.weights_resident_bytes());

    // the reference: dense f32, each quantized weight replaced by its NF4 rounding
    let rounded: HashMap<String, Tensor> = w
        .iter()
        .map(|(k, t)| {
            let t = if k.contains(".self_attn.") && k.ends_with("_proj.weight") {
                QuantWeight::quantize(t, nf4)
                    .unwrap()
                    .dequantize(Kind::Float)
                    .unwrap()
            } else {
                t.shallow_clone()
            };
            (k.clone(), t)
        })
        .collect();
    let reference = Llama::from_tensors(c.clone(), &rounded, Kind::Float, Device::Cpu).unwrap();
    let x = ids(2, 12);
    let out = m.forward_t(&x, None, None, false).unwrap();
    let want = reference.forward_t(&x, None, None, false).unwrap();
    let scale = want.abs().max().double_value(&[]);
    let rel = max_diff(&out, &want) / scale;
    let rel_unrounded = max_diff(&out, &dense.forward_t(&x, None, None, false).unwrap()) / scale;
    println!(
        "NF4 base vs dense on NF4-rounded weights: rel {rel:.3e}; vs unrounded {rel_unrounded:.3e}"
    );
    assert!(rel < 1e-5, "relative error {rel:.3e}");
    // the rounding is real: the unrounded model differs far more
    assert!(rel_unrounded > 1e-3, "{rel_unrounded:.3e}");
}

/// A quantized head that the CPU kernel does not multiply (here: f64 products; on CUDA every
/// quantized head) goes through the fused loss one vocabulary tile at a time, with an online
/// log-sum-exp: its loss and every adapter gradient equal the plain cross-entropy of a model
/// whose head is the same weight decoded whole. The Q8_0 head `[70,000, 32]` makes tiles of
/// 32,768 rows (the last one 4,464), whose f32 logits fit 256 rows in a 32 MiB chunk: the
/// 3 × 119 predicting positions run as two chunks, each over three tiles.
#[test]
fn vocab_tiled_quantized_head_loss_equals_cross_entropy_on_full_logits() {
    let _g = crate::rng_lock();
    let mut c = tiny_config("llama");
    c.vocab_size = 70_000;
    let w = random_weights(&c, 5);
    let head = QuantWeight::quantize(&w["lm_head.weight"], QuantKind::Q8_0).unwrap();
    assert_eq!(
        head.tile_rows(lora_core::sys::QLINEAR_TILE_ELEMENTS),
        32_768
    );
    let mut rounded: HashMap<String, Tensor> = w
        .iter()
        .map(|(k, t)| (k.clone(), t.shallow_clone()))
        .collect();
    rounded.insert(
        "lm_head.weight".into(),
        head.dequantize(Kind::Float).unwrap(),
    );
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig::new(4, 8.0, &["q_proj", "down_proj"]);
    let mut m = Llama::from_tensors(c.clone(), &rounded, Kind::Double, Device::Cpu).unwrap();
    inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    perturb(&vs, 0.05);
    let (x, labels) = ids_and_masked_labels(3, 120, 70_000);
    // the reference in f64 from the final norm on (the model's own logits are f32, as HF's):
    // the final RMSNorm as HF's (normalized in f32), the decoded head weight, plain
    // cross-entropy on full logits
    zero_grads(&vs);
    let h = m.hidden_states(&x, None, None, false).unwrap();
    let hf = h.to_kind(Kind::Float);
    let hn = (&hf
        * (hf.square().mean_dim([-1i64].as_slice(), true, Kind::Float) + c.rms_norm_eps).rsqrt())
    .to_kind(Kind::Double)
        * w["model.norm.weight"].to_kind(Kind::Double);
    let logits = hn.matmul(&rounded["lm_head.weight"].to_kind(Kind::Double).tr());
    let want = shifted_cross_entropy(&logits, &labels);
    want.backward();
    let (l_ref, g_ref) = (want.double_value(&[]), grads(&vs));
    // the same model and adapters, the head swapped for the quantized weight
    let mut head = Some(head);
    m.visit_sites(&mut |name, site| {
        if let (SiteMut::Linear(l), "lm_head") = (site, name) {
            let q = head.take().expect("one lm_head");
            l.replace_base(BaseWeight::Quant(q))?;
        }
        Ok(())
    })
    .unwrap();
    assert!(head.is_none(), "the head was swapped");
    zero_grads(&vs);
    let loss = m.loss(&x, &labels, None, None, false).unwrap();
    loss.backward();
    let (l_tiled, g_tiled) = (loss.double_value(&[]), grads(&vs));

    assert!(l_ref > 5.0, "a random model's loss is large: {l_ref}");
    assert!(
        (l_tiled - l_ref).abs() < 1e-12 * l_ref,
        "loss {l_tiled} vs {l_ref}"
    );
    assert_eq!(g_tiled.len(), g_ref.len());
    for ((name, a), (_, r)) in g_tiled.iter().zip(&g_ref) {
        let scale = r.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name} got no gradient");
        let d = max_diff(a, r);
        // both backward passes go through an f32 RMSNorm (built from different ops): an f32 ulp
        assert!(d <= 1e-6 * scale, "{name}: {d} (scale {scale})");
    }
    let l_eval = tch::no_grad(|| m.loss(&x, &labels, None, None, false).unwrap());
    assert!((l_eval.double_value(&[]) - l_tiled).abs() < 1e-12 * l_ref);

    // Under f16 autocast the tiles decode to f16 and the products run in f16, the sums over the
    // tiles in f32, each row's gradient rounded to f16 once: the loss and gradients to f16
    // precision.
    let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::Half).unwrap();
    zero_grads(&vs);
    let loss = m.loss(&x, &labels, None, None, false).unwrap();
    loss.backward();
    let (l_half, g_half) = (loss.double_value(&[]), grads(&vs));
    assert!(
        (l_half - l_ref).abs() < 1e-3 * l_ref,
        "f16 loss {l_half} vs {l_ref}"
    );
    assert!((l_half - l_ref).abs() > 0.0, "autocast changed nothing");
    for ((name, a), (_, r)) in g_half.iter().zip(&g_ref) {
        let scale = r.abs().max().double_value(&[]);
        let d = max_diff(a, r);
        assert!(d <= 1e-2 * scale, "f16 {name}: {d} (scale {scale})");
    }
}

/// `Llama::loss` runs the LM head and the cross-entropy chunk by chunk and hands the gradient to
/// autograd through a surrogate; value and every adapter gradient must equal the plain
/// `cross_entropy(logits)` path. The vocabulary is large enough (300,000) that the 32 MiB chunks
/// hold 27 rows, so the 2 × 40 tokens run as several chunks that straddle batch rows.
#[test]
fn chunked_head_loss_equals_cross_entropy_on_full_logits() {
    let _g = crate::rng_lock();
    for tied in [false, true] {
        let mut c = tiny_config("llama");
        c.vocab_size = 300_000;
        c.tie_word_embeddings = tied;
        let mut m =
            Llama::from_tensors(c.clone(), &random_weights(&c, 3), Kind::Float, Device::Cpu)
                .unwrap();
        let vs = nn::VarStore::new(Device::Cpu);
        let cfg = LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "down_proj", "embed_tokens"]);
        inject(&mut m, &cfg, "default", &vs.root()).unwrap();
        perturb(&vs, 0.05);
        let (x, labels) = ids_and_masked_labels(2, 40, 300_000);
        // loss and adapter gradients by the fused loss, then by the plain path on full logits
        let fused_and_plain = || {
            zero_grads(&vs);
            let loss = m.loss(&x, &labels, None, None, false).unwrap();
            loss.backward();
            let fused = (loss.double_value(&[]), grads(&vs));
            zero_grads(&vs);
            let logits = m.forward_t(&x, None, None, false).unwrap();
            let reference = shifted_cross_entropy(&logits, &labels);
            reference.backward();
            (fused, (reference.double_value(&[]), grads(&vs)))
        };
        let ((l_fused, g_fused), (l_ref, g_ref)) = fused_and_plain();

        assert!(
            (l_fused - l_ref).abs() < 1e-5 * l_ref.abs(),
            "tied {tied}: loss {l_fused} vs {l_ref}"
        );
        assert!(l_ref > 1.0, "a random model's loss is large: {l_ref}");
        for ((name, a), (_, r)) in g_fused.iter().zip(&g_ref) {
            let scale = r.abs().max().double_value(&[]);
            assert!(scale > 0.0, "{name} got no gradient");
            let d = max_diff(a, r);
            assert!(
                d <= 1e-4 * scale,
                "tied {tied}, {name}: {d} (scale {scale})"
            );
        }
        // Without a graph (evaluation) the value is the same.
        let l_eval = tch::no_grad(|| m.loss(&x, &labels, None, None, false).unwrap());
        assert!((l_eval.double_value(&[]) - l_fused).abs() < 1e-6);

        // Under bf16 autocast the head runs in bf16 on both paths: same loss to bf16 precision.
        let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        let l_bf16 = tch::no_grad(|| m.loss(&x, &labels, None, None, false).unwrap());
        let logits = tch::no_grad(|| m.forward_t(&x, None, None, false).unwrap());
        let r_bf16 = shifted_cross_entropy(&logits, &labels).double_value(&[]);
        let l_bf16 = l_bf16.double_value(&[]);
        assert!(
            (l_bf16 - r_bf16).abs() < 1e-3 * r_bf16,
            "tied {tied}: bf16 loss {l_bf16} vs {r_bf16}"
        );
        assert!((l_bf16 - l_fused).abs() > 0.0, "autocast changed nothing");

        // With gradients too: the chunks' 16-bit logits and rounded softmax gradients live in
        // the bytes of the two reused f32 buffers (three chunks here, the last one partial).
        let ((l16, g16), (r16, g16_ref)) = fused_and_plain();
        assert!(
            (l16 - l_bf16).abs() < 1e-6,
            "tied {tied}: {l16} vs {l_bf16}"
        );
        assert!(
            (l16 - r16).abs() < 1e-3 * r16,
            "tied {tied}: {l16} vs {r16}"
        );
        // the same operations as the plain path's (bf16 logits, f32 softmax, its gradient
        // rounded to bf16, bf16 products): the same bits, where libtorch multiplies bf16 itself;
        // on CPUs without a fast bf16 GEMM the head's products are f32 GEMMs over bf16 operands
        let exact = !lora_core::linear::bf16_autocast_by_f32(Device::Cpu).unwrap();
        for ((name, a), (_, r)) in g16.iter().zip(&g16_ref) {
            let scale = r.abs().max().double_value(&[]);
            let d = max_diff(a, r);
            let bound = if exact { 0.0 } else { 2e-2 * scale };
            assert!(
                scale > 0.0 && d <= bound,
                "tied {tied}, bf16 {name}: {d} (scale {scale})"
            );
        }
    }
}

/// bf16 on the CPU: a training forward computes attention in f32 (libtorch's CPU kernel runs
/// its bf16 backward at about half its f32 speed), an inference forward in bf16. Both stay
/// within bf16 precision of the f32 loss; they differ from each other (the two paths are both
/// taken); padded and packed rows (a mask, built in the attention's dtype) work on both; and
/// activation checkpointing, whose two passes are training forwards, gives the plain gradients.
#[test]
fn bf16_training_attention_runs_in_f32_on_the_cpu() {
    let _g = crate::rng_lock();
    let c = tiny_config("llama");
    let mut m =
        Llama::from_tensors(c.clone(), &random_weights(&c, 4), Kind::Float, Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig::new(4, 8.0, &["q_proj", "k_proj", "v_proj", "o_proj"]);
    inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    perturb(&vs, 0.05);
    let (x, labels) = ids_and_masked_labels(2, 12, 64);
    let padding = Tensor::ones([2, 12], (Kind::Int64, Device::Cpu));
    let _ = padding.get(1).narrow(0, 0, 3).fill_(0);
    // two documents per row: positions restart at 0 after 5 tokens
    let packed = Tensor::cat(
        &[
            Tensor::arange(5, (Kind::Int64, Device::Cpu)),
            Tensor::arange(7, (Kind::Int64, Device::Cpu)),
        ],
        0,
    )
    .view([1, 12])
    .expand([2, 12], false);
    for (what, am, pos) in [
        ("causal", None, None),
        ("padded", Some(&padding), None),
        ("packed", None, Some(&packed)),
    ] {
        let loss = |train: bool| {
            tch::no_grad(|| m.loss(&x, &labels, am, pos, train).unwrap()).double_value(&[])
        };
        let f32_loss = loss(true);
        assert!((f32_loss - loss(false)).abs() < 1e-6, "{what}");
        let (train, eval) = {
            let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
            (loss(true), loss(false))
        };
        for (name, l) in [("training", train), ("inference", eval)] {
            assert!(
                (l - f32_loss).abs() < 2e-2 * f32_loss,
                "{what}: bf16 {name} loss {l} vs f32 {f32_loss}"
            );
        }
        assert!(
            train != eval,
            "{what}: both forwards took the same path ({train})"
        );
    }

    let run = |checkpointing: bool, m: &mut Llama| {
        m.set_gradient_checkpointing(checkpointing);
        zero_grads(&vs);
        let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        let loss = m
            .loss_backward(&x, &labels, Some(&padding), None, true, 1.0)
            .unwrap();
        (loss.double_value(&[]), grads(&vs))
    };
    let (l_plain, g_plain) = run(false, &mut m);
    let (l_ck, g_ck) = run(true, &mut m);
    assert!((l_plain - l_ck).abs() < 1e-6, "{l_plain} vs {l_ck}");
    for ((name, a), (_, b)) in g_plain.iter().zip(&g_ck) {
        let scale = a.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name} got no gradient");
        let d = max_diff(a, b);
        assert!(d <= 1e-5 * scale, "{name}: {d} (scale {scale})");
    }
}

/// A merge writes the adapters into the base weights in place, which the kept casts' keys
/// (the weights' storage) cannot see: the model drops its kept casts whenever its sites are
/// visited mutably, so a forward after the merge reads the merged weights.
#[test]
fn a_merge_drops_the_kept_casts() {
    let _g = crate::rng_lock();
    let mut c = tiny_config("llama");
    c.tie_word_embeddings = true;
    let mut m =
        Llama::from_tensors(c.clone(), &random_weights(&c, 7), Kind::Float, Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig::new(4, 8.0, &["q_proj", "v_proj", "o_proj", "down_proj"]);
    inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    perturb(&vs, 0.05);
    let (x, _) = ids_and_masked_labels(2, 10, 64);
    let logits = |m: &Llama| {
        let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        tch::no_grad(|| m.forward_t(&x, None, None, false).unwrap())
    };
    m.set_frozen_cast_cache(true);
    let before = logits(&m);
    let merged = lora_core::inject::merge_adapters(&mut m, None, true).unwrap();
    assert!(merged > 0);
    let kept = logits(&m);
    m.set_frozen_cast_cache(false);
    let fresh = logits(&m);
    assert!(
        kept.equal(&fresh),
        "a forward after the merge read stale casts"
    );
    // and the merge did change the bases (the branches now live in them, rounded to bf16)
    assert!(!before.equal(&fresh));
}

/// Keeping autocast's casts of the frozen weights across steps changes no number: under bf16
/// autocast, two steps' losses and LoRA gradients with the kept casts equal those without.
#[test]
fn kept_frozen_casts_give_the_same_steps() {
    let _g = crate::rng_lock();
    let mut c = tiny_config("llama");
    c.tie_word_embeddings = true;
    let mut m =
        Llama::from_tensors(c.clone(), &random_weights(&c, 6), Kind::Float, Device::Cpu).unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let cfg = LoraConfig::new(
        4,
        8.0,
        &[
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
    );
    inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    perturb(&vs, 0.05);
    let (x, labels) = ids_and_masked_labels(2, 10, 64);
    let steps = |m: &mut Llama, keep: bool| {
        m.set_frozen_cast_cache(keep);
        let _ac = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
        (0..2)
            .map(|_| {
                zero_grads(&vs);
                let l = m.loss_backward(&x, &labels, None, None, true, 1.0).unwrap();
                (l.double_value(&[]), grads(&vs))
            })
            .collect::<Vec<_>>()
    };
    let plain = steps(&mut m, false);
    let kept = steps(&mut m, true);
    for ((lp, gp), (lk, gk)) in plain.iter().zip(&kept) {
        assert_eq!(lp, lk);
        for ((name, a), (_, b)) in gp.iter().zip(gk) {
            assert!(a.equal(b), "{name}");
        }
    }
}
