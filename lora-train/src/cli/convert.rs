//! `lora-train convert` (alias `export`): PEFT folder ↔ kohya file.

use super::{CliError, EXIT_OK};
use lora_train::config::ExportFormat;
use std::path::Path;

/// Runs `convert`.
pub fn run(input: &Path, to: ExportFormat, output: &Path) -> Result<i32, CliError> {
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
