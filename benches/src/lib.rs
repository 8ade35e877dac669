//! Benchmarks of the lora-sdk.
