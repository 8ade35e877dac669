//! `lora-train merge`: fold an adapter into its base and write the merged weights as one
//! safetensors file with HF parameter names (`model.layers.0.self_attn.q_proj.weight`, …).
//!
//! Linear and embedding weights come from the model after `merge_adapters`; norm weights are
//! read from the GGUF file (`blk.N.attn_norm` → `model.layers.N.input_layernorm`, `ffn_norm` →
//! `post_attention_layernorm`, `output_norm` → `model.norm`, the llama.cpp ↔ HF table).

use super::{CliError, EXIT_OK};
use lora_core::inject::{Adaptable, merge_adapters};
use lora_models::gguf::{GgufFile, dequantize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Kind, Tensor};

/// Checks `--output` before any work and reserves a temporary file beside it (which proves the
/// folder is writable): the merged weights are written there and renamed over `output` at the
/// end, so a failed or interrupted merge never leaves a partial file under the output's name.
///
/// # Errors
/// Exit 2 when `output` is a folder, its parent is a file or cannot be created, or nothing can
/// be written there.
fn reserve_output(output: &Path) -> Result<PathBuf, CliError> {
    if output.is_dir() {
        return Err(CliError::usage(format!(
            "--output {}: is a folder; merge writes one .safetensors file, so give a file path \
             (e.g. {})",
            output.display(),
            output.join("merged.safetensors").display()
        )));
    }
    let tmp = super::staging_path(output, "a .safetensors file path")?;
    std::fs::File::create(&tmp).map_err(|e| {
        CliError::usage(format!(
            "--output {}: cannot write in {}: {e}; choose another path",
            output.display(),
            tmp.parent().unwrap_or(std::path::Path::new(".")).display()
        ))
    })?;
    Ok(tmp)
}

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
    let tmp = reserve_output(output)?;
    let merged = merge_into(model, adapter, &tmp).and_then(|(n, count)| {
        std::fs::rename(&tmp, output)
            .map(|()| (n, count))
            .map_err(|e| {
                CliError::runtime(format!(
                    "moving the merged weights from {} to {}: {e}",
                    tmp.display(),
                    output.display()
                ))
            })
    });
    let (n, count) = match merged {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    super::outln(format_args!(
        "merged {n} adapted modules; wrote {count} tensors to {}",
        output.display()
    ))?;
    Ok(EXIT_OK)
}

/// Merges `adapter` into `model` and writes the merged weights to `file`; returns the number of
/// adapted modules and of tensors written.
fn merge_into(model: &Path, adapter: &Path, file: &Path) -> Result<(usize, usize), CliError> {
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
    let tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
    lora_core::formats::write_safetensors(file, &tensors, &BTreeMap::new())
        .map_err(|e| CliError::runtime(format!("writing {}: {e}", file.display())))?;
    Ok((n, tensors.len()))
}
