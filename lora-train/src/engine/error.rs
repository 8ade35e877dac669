//! The engine's error type.

use std::path::PathBuf;

use lora_core::sys::ShimError;

/// Errors of the training engine.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A libtorch call failed (out of memory, shape mismatch, …).
    #[error("libtorch error: {0}")]
    Torch(#[from] tch::TchError),
    /// The libtorch shim failed (autocast, allocator statistics, RNG state).
    #[error(transparent)]
    Shim(#[from] ShimError),
    /// A file could not be read or written.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// What was being done ("write checkpoint", "read", …).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A hyper-parameter or setting is invalid.
    #[error("invalid {what} `{value}`: {hint}")]
    Invalid {
        /// The setting.
        what: String,
        /// The offending value.
        value: String,
        /// What to use instead.
        hint: String,
    },
    /// Saved state (checkpoint, optimizer state) is missing or does not match this run.
    #[error("bad {what}: {message}")]
    State {
        /// Which state.
        what: String,
        /// What is wrong and what to do.
        message: String,
    },
    /// Loss or gradient norm became NaN/Inf and the policy is to stop.
    #[error(
        "non-finite {what} at step {step}: {value} (policy: stop; lower the learning rate or use bf16/fp32)"
    )]
    NonFinite {
        /// "loss" or "grad norm".
        what: &'static str,
        /// The optimizer step.
        step: u64,
        /// The value seen.
        value: f64,
    },
    /// Out of memory even with a micro-batch of one sample.
    #[error(
        "out of memory at step {step} with micro-batch {micro_batch}: {message} (lower seq length / rank, enable gradient checkpointing or a quantized base)"
    )]
    OutOfMemory {
        /// The optimizer step.
        step: u64,
        /// Samples per micro-batch when it failed.
        micro_batch: usize,
        /// libtorch's message.
        message: String,
    },
    /// An error raised by the application's [`crate::engine::TrainStep`] or a callback.
    #[error("{0}")]
    App(String),
    /// A LoRA layer failed inside a step (`?` on lora-core's results in a
    /// [`crate::engine::TrainStep`]); an out-of-memory inside it is recognised as one
    /// ([`TrainError::is_oom`]), so the trainer backs off.
    #[error(transparent)]
    Lora(#[from] lora_core::Error),
}

/// `Result` with a [`TrainError`].
pub type Result<T> = std::result::Result<T, TrainError>;

impl TrainError {
    /// True for libtorch out-of-memory errors: CUDA ("CUDA out of memory", "out of memory") and CPU
    /// ("DefaultCPUAllocator: can't allocate memory").
    pub fn is_oom(&self) -> bool {
        match self {
            TrainError::Torch(e) => is_oom_message(&e.to_string()),
            TrainError::Shim(e) => is_oom_message(&e.message),
            TrainError::OutOfMemory { .. } => true,
            TrainError::Lora(lora_core::Error::Torch { source, .. }) => {
                is_oom_message(&source.to_string())
            }
            _ => false,
        }
    }
}

/// True when a libtorch error message reports an allocation failure.
pub fn is_oom_message(msg: &str) -> bool {
    lora_core::oom::is_oom_message(msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_out_of_memory_inside_a_lora_layer_is_one() {
        let oom = lora_core::Error::Torch {
            context: "lora forward".into(),
            source: tch::TchError::Torch(
                "DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes".into(),
            ),
        };
        let e: TrainError = oom.into();
        assert!(e.is_oom(), "{e}");
        let shape = lora_core::Error::Torch {
            context: "lora forward".into(),
            source: tch::TchError::Torch("mat1 and mat2 shapes cannot be multiplied".into()),
        };
        assert!(!TrainError::from(shape).is_oom());
    }
}

/// Sets named arguments of a serde-tagged engine setting (`{"type": …, name: value, …}`): the
/// optimizer's hyper-parameters from kohya's `optimizer_args`, a schedule's from
/// `lr_scheduler_args`. `what` names the setting in errors.
///
/// # Errors
/// [`TrainError::Invalid`] for a name the setting does not have (listing those it has) or a
/// value of the wrong type.
pub fn with_named_args<T: serde::Serialize + serde::de::DeserializeOwned>(
    setting: &T,
    what: &str,
    args: &std::collections::BTreeMap<String, serde_json::Value>,
) -> Result<T> {
    let invalid = |value: String, hint: String| TrainError::Invalid {
        what: what.to_string(),
        value,
        hint,
    };
    let mut doc = match serde_json::to_value(setting) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => return Err(invalid(String::new(), "a setting with arguments".into())),
    };
    let kind = doc
        .get("type")
        .and_then(serde_json::Value::as_str)
        .unwrap_or("this setting")
        .to_string();
    let names: Vec<String> = doc.keys().filter(|k| *k != "type").cloned().collect();
    for (name, value) in args {
        if name == "type" || !doc.contains_key(name) {
            return Err(invalid(
                format!("{name}={value}"),
                if names.is_empty() {
                    format!("no argument ({kind} takes none)")
                } else {
                    format!("an argument {kind} takes: {}", names.join(", "))
                },
            ));
        }
        doc.insert(name.clone(), value.clone());
    }
    serde_json::from_value(serde_json::Value::Object(doc.clone())).map_err(|e| {
        invalid(
            args.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(" "),
            format!("values of the right type for {kind} ({e})"),
        )
    })
}
