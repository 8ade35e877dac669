//! The taggers against real models and servers: the image tagger (MobileNetV2 from the assets,
//! checked against torchvision), the OpenAI-compatible HTTP tagger on loopback sockets, the
//! in-process LLM tagger and llama.cpp's server. One test executable (each links libtorch);
//! `batch_oom` and `llm_http_key` stay alone, as they change process-wide state (an allocator
//! limit, an environment variable).

mod llm_support;
mod vlm_server;

mod image_tagger;
mod llm_http;
mod llm_local;
mod llm_server;
mod vlm;
#[cfg(feature = "onnx")]
mod wd14_onnx;
