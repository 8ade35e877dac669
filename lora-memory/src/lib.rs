//! Peak-memory planning for LoRA training runs (pure Rust, no libtorch).
#![deny(missing_docs)]
