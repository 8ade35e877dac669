//! `lora-train merge`: fold an adapter into its base and write the merged weights as one
//! safetensors file with HF parameter names (`model.layers.0.self_attn.q_proj.weight`, …).
//!
//! Linear and embedding weights come from the model after `merge_adapters`; norm weights are
//! read from the GGUF file (`blk.N.attn_norm` → `model.layers.N.input_layernorm`, `ffn_norm` →
//! `post_attention_layernorm`, `output_norm` → `model.norm`, the llama.cpp ↔ HF table).

use super::{CliError, EXIT_OK};
use lora_core::inject::{Adaptable, merge_adapters};
use lora_models::gguf::{GgufFile, dequantize};
use std::path::Path;
use tch::{Kind, Tensor};

/// Runs `merge`.
pub fn run(model: &Path, adapter: &Path, output: &Path) -> Result<i32, CliError> {
    if !model
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        return Err(CliError::usage(
            "merge: --model must be a GGUF file (HF folders already hold safetensors: merge with PEFT's merge_and_unload)",
        ));
    }
    let mut m = super::model::load(model, Some(adapter))?;
    let n = merge_adapters(&mut m.model, None, true).map_err(CliError::runtime)?;
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    let mut err = None;
    m.model
        .visit_sites(&mut |path, site| {
            match site.layer_ref().base().weight(Kind::Float) {
                Ok(w) => tensors.push((format!("{path}.weight"), w)),
                Err(e) => err = Some(format!("{path}: {e}")),
            }
            Ok(())
        })
        .map_err(CliError::runtime)?;
    if let Some(e) = err {
        return Err(CliError::runtime(e));
    }
    let g = GgufFile::open(model).map_err(CliError::runtime)?;
    for info in g.tensors().to_vec() {
        let hf = if info.name == "output_norm.weight" {
            Some("model.norm.weight".to_string())
        } else if let Some(rest) = info.name.strip_prefix("blk.") {
            let (i, tail) = rest.split_once('.').unwrap_or(("", ""));
            match tail {
                "attn_norm.weight" => Some(format!("model.layers.{i}.input_layernorm.weight")),
                "ffn_norm.weight" => {
                    Some(format!("model.layers.{i}.post_attention_layernorm.weight"))
                }
                _ => None,
            }
        } else {
            None
        };
        if let Some(hf) = hf {
            let (ti, raw) = g.tensor_bytes(&info.name).map_err(CliError::runtime)?;
            let v =
                dequantize(ti.ggml_type, raw, ti.numel() as usize).map_err(CliError::runtime)?;
            let t = Tensor::f_from_slice(&v)
                .and_then(|t| t.f_reshape(ti.torch_shape()))
                .map_err(CliError::runtime)?;
            tensors.push((hf, t));
        }
    }
    Tensor::write_safetensors(&tensors, output)
        .map_err(|e| CliError::runtime(format!("writing {}: {e}", output.display())))?;
    super::outln(format_args!(
        "merged {n} adapted modules; wrote {} tensors to {}",
        tensors.len(),
        output.display()
    ))?;
    Ok(EXIT_OK)
}
