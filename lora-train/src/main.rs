//! `lora-train`: plan, train, evaluate and convert LoRA adapters from the command line.
//!
//! Exit codes: 0 ok, 1 runtime failure, 2 bad usage or config, 3 predicted not to fit.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
