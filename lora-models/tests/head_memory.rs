//! Exact tensor bytes of the fused loss over a quantized head off the CPU kernel (the path every
//! quantized head takes on CUDA), counted by the shim's CPU allocator
//! (`lora_core::sys::cpu_mem_stats`): the head is decoded one vocabulary tile at a time, never
//! whole. One test in this file: the counter is process-wide, so no other test may allocate
//! meanwhile.

use std::collections::HashMap;

use lora_core::base::BaseWeight;
use lora_core::config::LoraConfig;
use lora_core::inject::{Adaptable, SiteMut, inject};
use lora_core::quant::{QuantKind, QuantWeight};
use lora_core::sys;
use lora_memory::estimate::{OURS_QLINEAR_TILE_ELEMENTS, ours_dequant_bytes_per_weight};
use lora_memory::settings::BaseDtype;
use lora_models::llama::{Llama, LlamaConfig};
use tch::{Device, Kind, Tensor, nn};

#[test]
fn a_quantized_head_off_the_kernel_is_decoded_one_tile_at_a_time() {
    sys::install_counting_cpu_allocator().unwrap();
    tch::set_num_threads(1);
    tch::manual_seed(0);
    let (v, d, ff) = (20_000i64, 1024i64, 256i64);
    // a one-layer LLaMA as an HF config.json gives it
    let c = LlamaConfig::from_json_str(
        &format!(
            r#"{{"model_type": "llama", "vocab_size": {v}, "hidden_size": {d},
                "intermediate_size": {ff}, "num_hidden_layers": 1, "num_attention_heads": 8,
                "rms_norm_eps": 1e-5, "max_position_embeddings": 128}}"#
        ),
        std::path::Path::new("config.json"),
    )
    .unwrap();
    let o = (Kind::Float, Device::Cpu);
    let mut w: HashMap<String, Tensor> = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), Tensor::randn([v, d], o));
    w.insert("model.norm.weight".into(), Tensor::ones([d], o));
    let head = Tensor::randn([v, d], o) * 0.05;
    w.insert("lm_head.weight".into(), head.shallow_clone());
    for (name, out, inp) in [
        ("self_attn.q_proj", d, d),
        ("self_attn.k_proj", d, d),
        ("self_attn.v_proj", d, d),
        ("self_attn.o_proj", d, d),
        ("mlp.gate_proj", ff, d),
        ("mlp.up_proj", ff, d),
        ("mlp.down_proj", d, ff),
    ] {
        let t = Tensor::randn([out, inp], o) / (inp as f64).sqrt();
        w.insert(format!("model.layers.0.{name}.weight"), t);
    }
    for n in ["input_layernorm", "post_attention_layernorm"] {
        w.insert(format!("model.layers.0.{n}.weight"), Tensor::ones([d], o));
    }
    // float64: a dtype the CPU kernel does not take, so the head goes the way CUDA's does
    let mut m = Llama::from_tensors(c, &w, Kind::Double, Device::Cpu).unwrap();
    drop(w);
    let vs = nn::VarStore::new(Device::Cpu);
    inject(
        &mut m,
        &LoraConfig::new(4, 8.0, &["q_proj", "v_proj"]),
        "default",
        &vs.root(),
    )
    .unwrap();
    let mut q = Some(QuantWeight::quantize(&head, QuantKind::Q8_0).unwrap());
    drop(head);
    m.visit_sites(&mut |name, site| {
        if let (SiteMut::Linear(l), "lm_head") = (site, name) {
            let q = q.take().expect("one lm_head");
            l.replace_base(BaseWeight::Quant(q))?;
        }
        Ok(())
    })
    .unwrap();
    assert!(q.is_none(), "the head was swapped");

    let ids = (Tensor::arange(2 * 64, (Kind::Int64, Device::Cpu)) * 7919).remainder(v);
    let ids = ids.view([2, 64]);
    let run = || {
        let loss = m.loss(&ids, &ids, None, None, false).unwrap();
        loss.backward();
        loss.double_value(&[])
    };
    let first = run();
    assert!(first.is_finite() && first > 5.0, "{first}");
    let before = sys::cpu_mem_stats().unwrap().current_bytes as i64;
    sys::cpu_reset_peak().unwrap();
    let again = run();
    let stats = sys::cpu_mem_stats().unwrap();
    let transient = stats.peak_bytes as i64 - before;
    assert!((again - first).abs() < 1e-12 * first, "{again} vs {first}");

    let dense_head = v * d * 8;
    // one decoded tile: 1,024 rows of 1,024 weights in f64 (the planner's bytes per weight)
    let tile = (OURS_QLINEAR_TILE_ELEMENTS as f64
        * ours_dequant_bytes_per_weight(BaseDtype::Q8_0, 8.0)) as i64;
    println!(
        "loss + backward over a Q8_0 head [{v}, {d}] in f64: transient {:.1} MB; one decoded \
         tile {:.1} MB; the head decoded whole would be {:.1} MB",
        transient as f64 / 1e6,
        tile as f64 / 1e6,
        dense_head as f64 / 1e6
    );
    // the layer's activations, the rows' gradient and a [126, 1024] f64 block of logits are a
    // few MB; the whole head, decoded, would be 164 MB
    assert!(transient > tile, "a decoded tile is counted: {transient} B");
    assert!(
        transient < tile + 16_000_000,
        "transient {transient} B: more than one tile is dense at a time"
    );
}
