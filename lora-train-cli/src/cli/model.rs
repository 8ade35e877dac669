//! Loading a base model (and optionally an adapter onto it) for `eval`, `generate` and `merge`.

use super::CliError;
use lora_models::llama::Llama;
use lora_models::tokenizer::Tokenizer;
use lora_train::config::{BaseWeights, Dtype};
use std::path::Path;

/// The adapter VarStore must outlive the model's use of the adapter tensors.
pub struct Loaded {
    /// The model (adapter injected when one was given).
    pub model: Llama,
    /// Its tokenizer.
    pub tokenizer: Tokenizer,
    /// Adapter tensors' store.
    pub _vs: tch::nn::VarStore,
    /// Adapter modules loaded.
    pub adapter_modules: usize,
}

/// Loads `base` (GGUF file or HF folder) densely in f32 on the CPU and, when given, an adapter
/// (PEFT folder or kohya file) as adapter `default`.
pub fn load(base: &Path, adapter: Option<&Path>) -> Result<Loaded, CliError> {
    if !base.exists() {
        return Err(CliError::usage(format!(
            "--model {}: no such file or folder",
            base.display()
        )));
    }
    let (mut model, tokenizer) =
        lora_train::llm::load_base(base, BaseWeights::Dense, Dtype::F32, tch::Device::Cpu)
            .map_err(|e| {
                let e = CliError::from(e);
                CliError {
                    message: format!("--model: {}", e.message),
                    ..e
                }
            })?;
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let mut adapter_modules = 0;
    if let Some(a) = adapter {
        let (_, w) = super::read_adapter(a)?;
        adapter_modules = w.modules.len();
        w.load_into(&mut model, "default", &vs.root(), 0.0)
            .map_err(|e| super::bad_input(a, e))?;
    }
    Ok(Loaded {
        model,
        tokenizer,
        _vs: vs,
        adapter_modules,
    })
}
