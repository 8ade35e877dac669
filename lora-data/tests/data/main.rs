//! lora-data's integration tests in one test executable (one link against libtorch): image
//! datasets ([`images`]) and text datasets ([`text`]).

mod common;
mod images;
mod text;
