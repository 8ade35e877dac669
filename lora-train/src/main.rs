//! `lora-train`: plan, train, evaluate and convert LoRA adapters from the command line.
//!
//! Exit codes: 0 ok, 1 runtime failure, 2 bad usage or config, 3 predicted not to fit.

mod cli;

fn main() {
    // Like other Unix command-line tools, end quietly when the reader of our output goes away
    // (`lora-train plan --json | head`): Rust ignores SIGPIPE, which turns every later print into
    // a panic on EPIPE.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    std::process::exit(cli::main());
}
