//! lora-core's integration tests in one test executable (one link against libtorch): the adapter
//! file formats ([`formats`]), PEFT interoperability through the real `peft` package
//! ([`interop_peft`]), the LoRA layers' invariants over every site kind and option
//! ([`invariants`]), the tiled quantized linear ([`qlinear`]) and the quantized kinds against the
//! `gguf` package, llama.cpp's quantizer and PyTorch's fp8 cast ([`quant_interop`]), and sibling
//! linears computed together ([`siblings`]), libtorch's profiler through the shim
//! ([`profile`]), the oneDNN f32 linear ([`f32_linear`]), the decoder block's fused
//! element-wise ops ([`decoder_ops`]) and the CPU causal attention ([`causal_attention`]).

mod causal_attention;
mod common;
mod decoder_ops;
mod f32_linear;
mod formats;
mod interop_peft;
mod invariants;
mod lora_branch;
mod profile;
mod qlinear;
mod quant_interop;
mod siblings;
