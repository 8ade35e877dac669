//! Auto-labeling of LoRA training data: LLM and WD14-style image taggers, tag post-processing, caption sidecars
#![deny(missing_docs)]
