//! llama.cpp's names for the LLaMA family's HF parameter names: the key map of the
//! [`crate::weights::GgufSource`] a GGUF model is read through (table in `llama-arch.cpp`,
//! `LLM_TENSOR_NAMES`); and random weights under HF's names.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use super::LlamaConfig;
use crate::Result;

/// Maps an HF parameter name to llama.cpp's GGUF tensor name.
pub(crate) fn hf_to_gguf_name(name: &str) -> Option<String> {
    match name {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let g = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" => "ffn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{g}.{suffix}"))
}

/// Random weights for a model of `config`, named as HF checkpoints name them (what
/// [`crate::llama::Llama::from_tensors`] reads): for tests and for benchmarks that cannot
/// download a model, whose speed and memory do not depend on the values. f32 on the CPU, drawn
/// from libtorch's global generator after seeding it with `seed` (`tch::manual_seed`): the
/// embedding N(0, 1), each projection N(0, 1/in), biases N(0, 0.01), norm scales 1 + N(0, 0.01),
/// an untied head N(0, 0.04). The same seed and config give the same tensors.
///
/// ```
/// use lora_models::llama::{Llama, LlamaConfig, random_weights};
/// use tch::{Device, Kind, Tensor};
///
/// // SmolLM2-135M's shapes, cut to 2 layers and a small vocabulary
/// let mut c = LlamaConfig::smollm2_135m();
/// c.num_hidden_layers = 2;
/// c.vocab_size = 512;
/// let w = random_weights(&c, 0)?;
/// assert_eq!(w["model.layers.1.self_attn.k_proj.weight"].size(), [192, 576]);
/// let model = Llama::from_tensors(c, &w, Kind::Float, Device::Cpu)?;
/// let ids = Tensor::from_slice(&[1i64, 2, 3]).view([1, 3]);
/// assert_eq!(model.forward_t(&ids, None, None, false)?.size(), [1, 3, 512]);
/// # Ok::<(), lora_models::Error>(())
/// ```
///
/// # Errors
/// [`crate::Error::Torch`] when a tensor cannot be made (out of memory).
pub fn random_weights(config: &LlamaConfig, seed: i64) -> Result<HashMap<String, Tensor>> {
    tch::manual_seed(seed);
    let o = (Kind::Float, Device::Cpu);
    let c = config;
    let (d, hd, ff) = (c.hidden_size, c.head_dim(), c.intermediate_size);
    let (nh, nkv) = (c.num_attention_heads, c.n_kv_heads());
    let norm = |n: i64| -> Result<Tensor> {
        Ok(Tensor::f_randn([n], o)?
            .f_mul_scalar(0.1)?
            .f_add_scalar(1.0)?)
    };
    let mut m = HashMap::new();
    m.insert(
        "model.embed_tokens.weight".to_string(),
        Tensor::f_randn([c.vocab_size, d], o)?,
    );
    m.insert("model.norm.weight".to_string(), norm(d)?);
    if !c.tie_word_embeddings {
        m.insert(
            "lm_head.weight".to_string(),
            Tensor::f_randn([c.vocab_size, d], o)?.f_mul_scalar(0.2)?,
        );
    }
    for i in 0..c.num_hidden_layers {
        let p = format!("model.layers.{i}");
        for (name, out, inp, bias) in [
            ("self_attn.q_proj", nh * hd, d, c.qkv_bias()),
            ("self_attn.k_proj", nkv * hd, d, c.qkv_bias()),
            ("self_attn.v_proj", nkv * hd, d, c.qkv_bias()),
            ("self_attn.o_proj", d, nh * hd, c.o_bias()),
            ("mlp.gate_proj", ff, d, c.mlp_bias),
            ("mlp.up_proj", ff, d, c.mlp_bias),
            ("mlp.down_proj", d, ff, c.mlp_bias),
        ] {
            m.insert(
                format!("{p}.{name}.weight"),
                Tensor::f_randn([out, inp], o)?.f_mul_scalar(1.0 / (inp as f64).sqrt())?,
            );
            if bias {
                m.insert(
                    format!("{p}.{name}.bias"),
                    Tensor::f_randn([out], o)?.f_mul_scalar(0.1)?,
                );
            }
        }
        m.insert(format!("{p}.input_layernorm.weight"), norm(d)?);
        m.insert(format!("{p}.post_attention_layernorm.weight"), norm(d)?);
        if c.qk_norm() {
            m.insert(format!("{p}.self_attn.q_norm.weight"), norm(hd)?);
            m.insert(format!("{p}.self_attn.k_norm.weight"), norm(hd)?);
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_hf_names_to_gguf() {
        assert_eq!(
            hf_to_gguf_name("model.layers.12.self_attn.q_proj.weight").unwrap(),
            "blk.12.attn_q.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.0.self_attn.k_proj.bias").unwrap(),
            "blk.0.attn_k.bias"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.post_attention_layernorm.weight").unwrap(),
            "blk.3.ffn_norm.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.mlp.down_proj.weight").unwrap(),
            "blk.3.ffn_down.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.embed_tokens.weight").unwrap(),
            "token_embd.weight"
        );
        assert_eq!(
            hf_to_gguf_name("model.layers.3.self_attn.rotary_emb.inv_freq"),
            None
        );
    }
}
