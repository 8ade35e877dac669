//! lora-core's integration tests in one test executable (one link against libtorch): the adapter
//! file formats ([`formats`]), PEFT interoperability through the real `peft` package
//! ([`interop_peft`]), and the LoRA layers' invariants over every site kind and option
//! ([`invariants`]).

mod common;
mod formats;
mod interop_peft;
mod invariants;
mod qlinear;
