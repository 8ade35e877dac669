//! `lora-train`: plan, train, evaluate and convert LoRA adapters from the command line.
//!
//! Exit codes: 0 ok, 1 runtime failure, 2 bad usage or config, 3 predicted not to fit, 130
//! `train` stopped by Ctrl-C (after saving a checkpoint).

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
    // `println!` panics when stdout cannot be written (`lora-train plan … > /dev/full`). The
    // commands write through `cli::out`, which returns that as an error; this catches any print
    // left elsewhere and turns it into the same clean message and exit code instead of a panic.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("");
        if let Some(reason) = payload.strip_prefix("failed printing to stdout: ") {
            eprintln!("error: writing to stdout failed: {reason}");
            std::process::exit(cli::EXIT_RUNTIME);
        }
        default_hook(info);
    }));
    std::process::exit(cli::main());
}
