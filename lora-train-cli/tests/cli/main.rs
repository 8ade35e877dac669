//! The `lora-train` command line end to end, as a user runs it: each module starts the built
//! binary on real configs, models and data and checks its output, files and exit codes. One test
//! executable for all of them (each links libtorch).

mod cli_basic;
mod cli_errors;
mod cli_interop;
mod cli_plan_sd;
mod cli_tag;
