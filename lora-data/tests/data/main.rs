//! lora-data's integration tests in one test executable (one link against libtorch): image
//! datasets ([`images`]), text datasets ([`text`]) and real chat templates ([`chat_templates`]).

mod chat_templates;
mod common;
mod images;
mod text;
