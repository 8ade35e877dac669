//! `lora-train convert` (alias `export`): PEFT folder ↔ kohya file.

use super::{CliError, EXIT_OK};
use lora_train::config::ExportFormat;
use std::path::Path;

/// Runs `convert`.
pub fn run(input: &Path, to: ExportFormat, output: &Path) -> Result<i32, CliError> {
    if let Some(layout) = sd_layout(input) {
        return Err(CliError::usage(format!(
            "{}: a Stable Diffusion adapter ({layout}); convert handles LLaMA-family adapters. The SD job writes both layouts itself: set train.export_formats: [kohya, peft] (peft = diffusers' pytorch_lora_weights.safetensors) in the training config",
            input.display()
        )));
    }
    let n = lora_train::export::convert(input, to, output).map_err(|e| match e {
        lora_train::export::ExportError::NotAnAdapter { .. }
        | lora_train::export::ExportError::UnknownKohyaModule { .. } => CliError::usage(e),
        other => CliError::runtime(other),
    })?;
    super::outln(format_args!(
        "wrote {} ({n} modules, {})",
        output.display(),
        if to == ExportFormat::Peft {
            "PEFT"
        } else {
            "kohya"
        }
    ))?;
    Ok(EXIT_OK)
}

/// The Stable Diffusion layout of an adapter file, if it is one: kohya keys under
/// `lora_unet_` / `lora_te_text_model_` / `lora_te1_` / `lora_te2_`, or diffusers keys under `unet.` /
/// `text_encoder.` / `text_encoder_2.`. `None` for folders, unreadable files and other keys.
fn sd_layout(input: &Path) -> Option<&'static str> {
    let file = if input.is_dir() {
        let f = input.join("pytorch_lora_weights.safetensors");
        if !f.is_file() {
            return None;
        }
        f
    } else {
        input.to_path_buf()
    };
    // the header only (no tensor data is read)
    let table = lora_memory::safetensors_header::read_header(&file).ok()?;
    // LLaMA-family kohya files use `lora_te_model_…`; SD's CLIP encoders are
    // `lora_te_text_model_…`, `lora_te1_…`, `lora_te2_…`
    let sd_kohya = [
        "lora_unet_",
        "lora_te_text_model_",
        "lora_te1_",
        "lora_te2_",
    ];
    if table
        .keys()
        .any(|k| sd_kohya.iter().any(|p| k.starts_with(p)))
    {
        Some("kohya lora_unet_/lora_te keys")
    } else if table
        .keys()
        .any(|k| k.starts_with("unet.") || k.starts_with("text_encoder"))
    {
        Some("diffusers unet./text_encoder. keys")
    } else {
        None
    }
}
