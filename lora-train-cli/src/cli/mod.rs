//! Command-line interface (clap derive). Each subcommand lives in its own file and returns a
//! [`CliError`] carrying the process exit code.

use clap::{Parser, Subcommand};
use std::path::PathBuf;

mod convert;
mod doctor;
mod eval;
mod generate;
mod merge;
mod model;
mod plan;
mod tag;
mod train;

/// Success.
pub const EXIT_OK: i32 = 0;
/// A runtime failure (I/O, libtorch, training).
pub const EXIT_RUNTIME: i32 = 1;
/// Bad usage or an invalid config (clap also exits 2 on usage errors).
pub const EXIT_USAGE: i32 = 2;
/// The run is predicted not to fit its memory budget (`plan`, or `train` without `--force`).
pub const EXIT_DOES_NOT_FIT: i32 = 3;
/// `train` stopped by Ctrl-C (SIGINT) after saving a checkpoint: 128 + 2, as shells report it.
pub const EXIT_INTERRUPTED: i32 = 130;
/// `train` stopped by SIGTERM after saving a checkpoint: 128 + 15.
pub const EXIT_TERMINATED: i32 = 143;

const AFTER_HELP: &str = "\
Exit codes:
  0  ok
  1  runtime failure (I/O, libtorch, training; tag: some images failed, the others were written)
  2  bad usage or invalid config (unknown keys, bad values, conflicts, missing files,
     damaged or foreign model and adapter files)
  3  predicted not to fit the memory budget (plan; train without --force)
  130  train stopped by Ctrl-C (a checkpoint is saved first; the command to resume is printed)
  143  train stopped by SIGTERM (kill, timeout, a scheduler), the same way

Environment:
  LORA_CPU_F32_GEMM=onednn|mkl  which library multiplies f32 matrices on the CPU (default:
     oneDNN on AMD CPUs with AVX-512, MKL elsewhere; `doctor` says which)
  LORA_CPU_ATTENTION=lsdk|libtorch  which kernel computes causal f32 attention of up to 512
     positions on the CPU (default: lora-core's on AVX2 CPUs without AVX-512, libtorch's
     elsewhere; `doctor` says which)
  LORA_CPU_LORA=lsdk|libtorch  which kernel computes the LoRA branches of f32 linears on the
     CPU outside autocast, DoRA aside (default: lora-core's, \"lsdk\", on AVX2 CPUs without
     AVX-512, libtorch's GEMMs elsewhere; `doctor` says which)

Examples:
  lora-train plan --config examples/configs/smollm2-shakespeare.yaml --gpu \"RTX 3060\"
  lora-train train --config examples/configs/smollm2-shakespeare.yaml
  lora-train doctor";

/// LoRA fine-tuning that knows its memory: plan, train, survive, export.
#[derive(Debug, Parser)]
#[command(name = "lora-train", version, about, long_about = None, after_help = AFTER_HELP)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan, train and export a LoRA adapter from a YAML/TOML config.
    Train {
        /// Config file (.yaml, .yml or .toml).
        #[arg(long, short)]
        config: PathBuf,
        /// Resume from the latest checkpoint in the run's output folder, or from DIR (a step-*
        /// folder); an error when there is none. Ctrl-C during training saves one and prints the
        /// command.
        #[arg(long, num_args = 0..=1, value_name = "DIR")]
        resume: Option<Option<PathBuf>>,
        /// Start even when the plan predicts the run does not fit its budget.
        #[arg(long)]
        force: bool,
        /// Train data-parallel with N local processes (Gloo over c10d on the CPU), as
        /// `torchrun --nproc-per-node N` would start them: each takes its share of every
        /// epoch's batches, gradients are averaged before each step, rank 0 writes the files.
        /// One process failing stops the others; its exit code is the command's.
        #[arg(long, value_name = "N")]
        nproc_per_node: Option<u32>,
    },
    /// Predict the peak memory of a config and check it against a budget (reads headers only).
    Plan {
        /// Config file (.yaml, .yml or .toml).
        #[arg(long, short)]
        config: PathBuf,
        /// Budget: a GPU by name (e.g. "RTX 3060", "A100 80GB"), or "local" / "local:N" for
        /// this machine's card as it is now (free memory from the driver; what other processes
        /// hold is left out); plans for CUDA. Wins over memory.gpu / memory.budget and
        /// system.device in the config.
        #[arg(long, conflicts_with = "budget")]
        gpu: Option<String>,
        /// Budget: a size ("12GB" = 12·10^9 bytes, "8GiB" = 8·2^30, as cards sold as "8 GB" have;
        /// "cuda: 6GB", "cpu: 16GB" also set the device). Wins over memory.gpu / memory.budget
        /// and, with a device, over system.device in the config.
        #[arg(long)]
        budget: Option<String>,
        /// Print the plan as JSON.
        #[arg(long)]
        json: bool,
        /// Plan a data-parallel run of N processes, one per GPU (as `train --nproc-per-node N`
        /// or torchrun starts it): the peak per rank, and whether it fits N of the budget's
        /// GPUs ("fits on 2 × RTX 3090").
        #[arg(long, value_name = "N")]
        nproc_per_node: Option<u32>,
        /// Also print the frontier: the longest sequence and the largest micro-batch that fit
        /// 8, 12, 16, 24, 40, 48 and 80 GB cards, for this trainer and for HF + PEFT.
        #[arg(long)]
        frontier: bool,
    },
    /// Report libtorch, CUDA/GPU (name, VRAM total/free, driver and CUDA versions), CPU (its
    /// bf16 matrix products; which library multiplies f32 matrices, LORA_CPU_F32_GEMM; which
    /// kernels compute causal attention and the LoRA branches, LORA_CPU_ATTENTION and
    /// LORA_CPU_LORA), RAM and disk.
    Doctor {
        /// Print the report as one JSON object (sizes in bytes).
        #[arg(long)]
        json: bool,
    },
    /// Convert an adapter between PEFT (folder) and kohya (single .safetensors file).
    #[command(alias = "export")]
    Convert {
        /// A PEFT folder (adapter_config.json + adapter_model.safetensors) or a kohya file.
        #[arg(long, short)]
        input: PathBuf,
        /// Output format.
        #[arg(long, value_enum)]
        to: Format,
        /// Output folder (PEFT) or .safetensors file (kohya).
        #[arg(long, short)]
        output: PathBuf,
        /// Replace the output if it exists (by default an existing output is an error).
        #[arg(long)]
        force: bool,
    },
    /// Merge an adapter into its base and write the merged weights (safetensors, HF names).
    Merge {
        /// Base model (GGUF file).
        #[arg(long, short)]
        model: PathBuf,
        /// Adapter (PEFT folder or kohya file).
        #[arg(long, short)]
        adapter: PathBuf,
        /// Output .safetensors file.
        #[arg(long, short)]
        output: PathBuf,
        /// Replace the output if it exists (by default an existing output is an error).
        #[arg(long)]
        force: bool,
    },
    /// Perplexity of a text file under the base model, with or without an adapter.
    Eval {
        /// Base model (GGUF file or HF folder).
        #[arg(long, short)]
        model: PathBuf,
        /// Adapter (PEFT folder or kohya file).
        #[arg(long, short)]
        adapter: Option<PathBuf>,
        /// UTF-8 text file.
        #[arg(long, short)]
        text: PathBuf,
        /// Window length in tokens.
        #[arg(long, default_value_t = 256)]
        max_length: usize,
        /// Stride between windows, 1..=max-length (default: the window length, i.e. disjoint windows).
        #[arg(long)]
        stride: Option<usize>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a prompt (optionally as a chat user turn), with or without an adapter.
    Generate {
        /// Base model (GGUF file or HF folder).
        #[arg(long, short)]
        model: PathBuf,
        /// Adapter (PEFT folder or kohya file).
        #[arg(long, short)]
        adapter: Option<PathBuf>,
        /// The prompt.
        #[arg(long, short)]
        prompt: String,
        /// Wrap the prompt in the model's chat template (ChatML when it has none).
        #[arg(long)]
        chat: bool,
        /// System message for --chat.
        #[arg(long)]
        system: Option<String>,
        /// Tokens to generate.
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// Temperature, ≥ 0 (0 = greedy).
        #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
        temperature: f64,
        /// Nucleus sampling threshold, in (0, 1] (1 = off).
        #[arg(long, default_value_t = 1.0, allow_negative_numbers = true)]
        top_p: f64,
        /// Sample only from the K most likely tokens (0 = off).
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        /// Sampler seed.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Caption a folder of images (image tagger) or tag text descriptions (LLM tagger).
    Tag(tag::TagArgs),
}

/// An existing output is only replaced with `--force` (exit 2 otherwise), so a typo in `--output`
/// never destroys a file the user had.
/// The hidden path beside `output` that a command writes first and renames into place at the end
/// (`.NAME.partial-PID` in `output`'s folder, which is created). `kind` says what `--output` must
/// name ("a .safetensors file path", "a file or folder name") in the error for a path without one.
///
/// # Errors
/// Exit 2 naming `--output` when it has no file name, its parent is a file, or the folder cannot
/// be created.
fn staging_path(output: &std::path::Path, kind: &str) -> Result<std::path::PathBuf, CliError> {
    let Some(name) = output.file_name() else {
        return Err(CliError::usage(format!(
            "--output {}: not a file name; give {kind}",
            output.display()
        )));
    };
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    if parent.exists() && !parent.is_dir() {
        return Err(CliError::usage(format!(
            "--output {}: {} is a file, not a folder",
            output.display(),
            parent.display()
        )));
    }
    std::fs::create_dir_all(parent).map_err(|e| {
        CliError::usage(format!(
            "--output {}: cannot create the folder {}: {e}",
            output.display(),
            parent.display()
        ))
    })?;
    Ok(parent.join(format!(
        ".{}.partial-{}",
        name.to_string_lossy(),
        std::process::id()
    )))
}

fn refuse_existing(output: &std::path::Path, force: bool) -> Result<(), CliError> {
    if output.exists() && !force {
        return Err(CliError::usage(format!(
            "--output {} already exists; choose another path, or pass --force to replace it",
            output.display()
        )));
    }
    Ok(())
}

/// Writes `text` to stdout (locked) and flushes it. `println!` panics when stdout cannot be
/// written (a full disk: `lora-train doctor > /dev/full`); this returns a runtime error instead.
///
/// # Errors
/// Exit 1 with "writing to stdout failed: …" and the OS error.
pub fn out(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    let mut so = std::io::stdout().lock();
    so.write_all(text.as_bytes())
        .and_then(|()| so.flush())
        .map_err(stdout_failed)
}

/// [`out`] with a newline.
///
/// # Errors
/// As [`out`].
pub fn outln(text: impl std::fmt::Display) -> Result<(), CliError> {
    out(&format!("{text}\n"))
}

/// The error for a failed write to stdout (exit 1).
pub fn stdout_failed(e: std::io::Error) -> CliError {
    CliError::runtime(format!("writing to stdout failed: {e}"))
}

/// Adapter file formats.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Format {
    /// PEFT folder.
    Peft,
    /// kohya single file.
    Kohya,
}

/// An error with its exit code.
#[derive(Debug)]
pub struct CliError {
    /// Process exit code.
    pub code: i32,
    /// Message printed to stderr.
    pub message: String,
}

impl CliError {
    /// Runtime failure (exit 1).
    pub fn runtime(msg: impl std::fmt::Display) -> Self {
        CliError {
            code: EXIT_RUNTIME,
            message: msg.to_string(),
        }
    }

    /// Bad usage / config (exit 2).
    pub fn usage(msg: impl std::fmt::Display) -> Self {
        CliError {
            code: EXIT_USAGE,
            message: msg.to_string(),
        }
    }
}

impl From<lora_train::config::ConfigError> for CliError {
    fn from(e: lora_train::config::ConfigError) -> Self {
        CliError::usage(e)
    }
}

impl From<lora_train::job::JobError> for CliError {
    fn from(e: lora_train::job::JobError) -> Self {
        use lora_train::job::JobError as J;
        let code = match &e {
            J::Config(_) | J::MissingFile { .. } | J::Input(_) => EXIT_USAGE,
            J::Interrupted { .. } => EXIT_INTERRUPTED,
            J::Memory(m) if !matches!(m, lora_memory::Error::Io { .. }) => EXIT_USAGE,
            J::DoesNotFit { .. } => EXIT_DOES_NOT_FIT,
            _ => EXIT_RUNTIME,
        };
        CliError {
            code,
            message: e.to_string(),
        }
    }
}

/// The one classification of an adapter or model file given on the command line that cannot be
/// used (damaged, truncated, foreign, or not matching the model): bad input, exit 2, as a
/// missing file is. The message names the file (prefixed when `e` does not already name it).
pub fn bad_input(path: &std::path::Path, e: impl std::fmt::Display) -> CliError {
    let shown = path.display().to_string();
    let message = e.to_string();
    if message.contains(&shown) {
        CliError::usage(message)
    } else {
        CliError::usage(format!("{shown}: {message}"))
    }
}

/// Reads the adapter at `path` (a PEFT folder or kohya file) for `eval`, `generate`, `merge` and
/// `convert`.
///
/// # Errors
/// Every failure is [`bad_input`] (exit 2) naming the file.
pub fn read_adapter(
    path: &std::path::Path,
) -> Result<
    (
        Option<lora_core::config::LoraConfig>,
        lora_core::formats::AdapterWeights,
    ),
    CliError,
> {
    lora_train::export::read_adapter(path).map_err(|e| bad_input(path, e))
}

/// Parses the arguments, runs the command and returns the exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train {
            config,
            resume,
            force,
            nproc_per_node: Some(n),
        } => train::launch(n, &config, resume, force),
        Command::Train {
            config,
            resume,
            force,
            nproc_per_node: None,
        } => train::run(&config, resume, force),
        Command::Plan {
            config,
            gpu,
            budget,
            json,
            nproc_per_node,
            frontier,
        } => plan::run(
            &config,
            gpu.as_deref(),
            budget.as_deref(),
            json,
            frontier,
            nproc_per_node,
        ),
        Command::Doctor { json } => doctor::run(json),
        Command::Convert {
            input,
            to,
            output,
            force,
        } => refuse_existing(&output, force).and_then(|()| {
            convert::run(
                &input,
                match to {
                    Format::Peft => lora_train::config::ExportFormat::Peft,
                    Format::Kohya => lora_train::config::ExportFormat::Kohya,
                },
                &output,
            )
        }),
        Command::Merge {
            model,
            adapter,
            output,
            force,
        } => refuse_existing(&output, force).and_then(|()| merge::run(&model, &adapter, &output)),
        Command::Eval {
            model,
            adapter,
            text,
            max_length,
            stride,
            json,
        } => eval::run(&model, adapter.as_deref(), &text, max_length, stride, json),
        Command::Generate {
            model,
            adapter,
            prompt,
            chat,
            system,
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            seed,
        } => generate::run(&generate::GenerateArgs {
            model: &model,
            adapter: adapter.as_deref(),
            prompt: &prompt,
            chat,
            system: system.as_deref(),
            max_new_tokens,
            temperature,
            top_p,
            top_k,
            seed,
        }),
        Command::Tag(args) => tag::run(&args),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            if !e.message.is_empty() {
                eprintln!("error: {}", without_backtrace(&e.message));
            }
            e.code
        }
    }
}

/// `msg` without the C++ stack trace libtorch appends to its errors (the `Exception raised
/// from …` line and the `frame #N: …` lines): what failed stays, the frames are of no use to a
/// user and bury it.
pub fn without_backtrace(msg: &str) -> String {
    let kept: Vec<&str> = msg
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("frame #") || t.starts_with("Exception raised from"))
        })
        .collect();
    kept.join("\n").trim_end().to_string()
}

#[cfg(test)]
mod tests {
    #[test]
    fn libtorch_frames_are_cut_from_messages() {
        let msg = "training: libtorch error: shape '[2, 3]' is invalid for input of size 5\n\
                   Exception raised from view_impl at /pytorch/aten/src/ATen/native/TensorShape.cpp:3540\n\
                   frame #0: c10::Error::Error(...) + 0x95 (0x7f in libc10.so)\n\
                   frame #1: <unknown function> + 0x1234 (0x7f in libtorch_cpu.so)\n";
        assert_eq!(
            super::without_backtrace(msg),
            "training: libtorch error: shape '[2, 3]' is invalid for input of size 5"
        );
    }
}
