//! The `lora-train` command line end to end, as a user runs it: each module starts the built
//! binary on real configs, models and data and checks its output, files and exit codes. One test
//! executable for all of them (each links libtorch).

mod cli_basic;
mod cli_dist;
mod cli_errors;
mod cli_interop;
mod cli_plan_flux;
mod cli_plan_sd;
mod cli_tag;
#[path = "../../../lora-tagger/tests/tagger/vlm_server.rs"]
mod vlm_server;

use std::path::PathBuf;
use std::process::{Command, Output};

/// The `lora-train` binary built for these tests.
fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lora-train"))
}

/// The repository root.
fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A finished command's stdout and stderr, in that order.
fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The SmolLM2 GGUF of the assets.
fn gguf() -> PathBuf {
    let p = repo().join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo xtask setup` to provision the assets",
        p.display()
    );
    p
}
