//! Benchmarks of the lora-sdk: criterion benches of the hot kernels (`benches/`), and the
//! side-by-side comparison with Python PEFT + transformers that `cargo xtask bench-compare` runs.
//!
//! The comparison trains the *same* job on both sides — SmolLM2-135M-Instruct dequantized from
//! `assets/models/SmolLM2-135M-Instruct.Q4_1.gguf` to dense f32, LoRA on
//! q,k,v,o,gate,up,down with the same initial A/B (a PEFT adapter folder both sides load), the same
//! token batches (a safetensors file both sides read), the same AdamW hyper-parameters and thread
//! count — and records per-step time, losses and peak memory ([`job::TrainResult`]):
//! - [`job::prepare`] writes the shared inputs (batches and the initial adapter);
//! - [`job::train_ours`] runs them through [`lora_train::engine::Trainer`];
//! - `benches/python/peft_train.py` runs them through PEFT + transformers in a plain PyTorch loop;
//! - [`chart::ratio_chart`] draws the ratios ours/theirs as a bar chart PNG.

#![deny(missing_docs)]

pub mod chart;
pub mod job;

/// Errors of the comparison job.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A libtorch error, with what was being done.
    #[error("{context}: {source}")]
    Torch {
        /// What was being done.
        context: String,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Bad input (arguments, files of the wrong shape), with what to do.
    #[error("{0}")]
    Invalid(String),
    /// An error of a lower crate (model loading, adapters, training), with context.
    #[error("{context}: {message}")]
    Lower {
        /// What was being done.
        context: String,
        /// The lower crate's message.
        message: String,
    },
}

/// `Result` with a [`BenchError`].
pub type Result<T> = std::result::Result<T, BenchError>;

pub(crate) fn lower<E: std::fmt::Display>(context: &str) -> impl FnOnce(E) -> BenchError + '_ {
    move |e| BenchError::Lower {
        context: context.to_string(),
        message: e.to_string(),
    }
}

pub(crate) fn torch(context: &str) -> impl FnOnce(tch::TchError) -> BenchError + '_ {
    move |source| BenchError::Torch {
        context: context.to_string(),
        source,
    }
}
