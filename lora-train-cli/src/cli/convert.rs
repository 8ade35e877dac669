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
    check_output(input, to, output)?;
    // A damaged or foreign input is bad input (exit 2), as for eval and merge; only what fails
    // after it was read (writing the output) is a runtime failure.
    let (cfg, w) = super::read_adapter(input)?;
    // Written beside the output first and moved into place at the end: an output that is the
    // input (`--force`) is read completely before anything under its name changes, and a failed
    // conversion leaves the old output (or the input) as it was.
    let tmp = super::staging_path(output, "a file or folder name")?;
    let result = lora_train::export::write_converted(input, cfg, w, to, &tmp)
        .map_err(|e| match e {
            // the kohya input's metadata holds no valid PEFT config: still the input's content
            lora_train::export::ExportError::NotAnAdapter { .. } => super::bad_input(input, e),
            other => CliError::runtime(other),
        })
        .and_then(|n| install(&tmp, output).map(|()| n));
    let n = match result {
        Ok(n) => n,
        Err(e) => {
            let _ = if tmp.is_dir() {
                std::fs::remove_dir_all(&tmp)
            } else {
                std::fs::remove_file(&tmp)
            };
            return Err(e);
        }
    };
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

/// Refuses, before anything is read, an output whose kind does not match the format: a folder
/// for kohya (one file) or a file for PEFT (a folder). Replacing one by the other would delete
/// the folder's other files or turn the input into a folder of the same name, so the message
/// names both paths and suggests one that works.
fn check_output(input: &Path, to: ExportFormat, output: &Path) -> Result<(), CliError> {
    let is_input = match (input.canonicalize(), output.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    let which = if is_input { " (the input)" } else { "" };
    if to == ExportFormat::Kohya && output.is_dir() {
        let example = if is_input {
            output.with_extension("safetensors")
        } else {
            output.join("adapter.safetensors")
        };
        return Err(CliError::usage(format!(
            "--output {}{which} is a folder; the kohya format is one .safetensors file, so give \
             a file path (e.g. {}). A folder is never replaced by a file",
            output.display(),
            example.display()
        )));
    }
    if to == ExportFormat::Peft && output.exists() && !output.is_dir() {
        let example = output.with_extension("");
        let example = if example == output {
            output.with_extension("peft")
        } else {
            example
        };
        return Err(CliError::usage(format!(
            "--output {}{which} is a file; the PEFT format is a folder (adapter_config.json + \
             adapter_model.safetensors), so give a folder path (e.g. {}). A file is never \
             replaced by a folder",
            output.display(),
            example.display()
        )));
    }
    Ok(())
}

/// Moves the converted `tmp` into place: a kohya file is renamed over `output` (atomic); a PEFT
/// folder is renamed to `output` when there is none, else each of its files is renamed into
/// the existing folder (other files there are kept).
fn install(tmp: &Path, output: &Path) -> Result<(), CliError> {
    if !(tmp.is_dir() && output.is_dir()) {
        return std::fs::rename(tmp, output).map_err(moving(tmp, output));
    }
    let entries = std::fs::read_dir(tmp)
        .and_then(|d| d.collect::<std::io::Result<Vec<_>>>())
        .map_err(|e| CliError::runtime(format!("reading {}: {e}", tmp.display())))?;
    for e in entries {
        let to = output.join(e.file_name());
        let from = e.path();
        std::fs::rename(&from, &to).map_err(moving(&from, &to))?;
    }
    std::fs::remove_dir(tmp)
        .map_err(|e| CliError::runtime(format!("removing {}: {e}", tmp.display())))
}

/// The error of a failed rename of `from` to `to` (exit 1).
fn moving<'a>(from: &'a Path, to: &'a Path) -> impl FnOnce(std::io::Error) -> CliError + 'a {
    move |e| {
        CliError::runtime(format!(
            "moving {} to {}: {e}",
            from.display(),
            to.display()
        ))
    }
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
