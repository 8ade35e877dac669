//! llama.cpp's names for the LLaMA family's HF parameter names: the key map of the
//! [`crate::weights::GgufSource`] a GGUF model is read through (table in `llama-arch.cpp`,
//! `LLM_TENSOR_NAMES`).

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
