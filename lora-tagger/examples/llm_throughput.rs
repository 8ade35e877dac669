//! Descriptions per second of the LLM taggers, on real captions (scikit-image's sample-image
//! docstrings and OpenMoji annotations from the project's assets).
//!
//! ```text
//! OMP_NUM_THREADS=2 cargo run --release -p lora-tagger --example llm_throughput -- local [N] [BATCH] [dense|quantized]
//! OMP_NUM_THREADS=2 cargo run --release -p lora-tagger --example llm_throughput -- http BASE_URL MODEL [N] [CONCURRENCY]
//! ```
//! `local` runs SmolLM2-135M-Instruct in process (greedy, 40 new tokens, micro-batches up to
//! BATCH, default 8; weights dequantized to f32 once, or kept in Q4_1 with `quantized`); `http` sends the same descriptions to an OpenAI-compatible server, e.g.
//! `python -m llama_cpp.server --model assets/models/SmolLM2-135M-Instruct.Q4_1.gguf
//! --model_alias smollm2 --port 8000` with `http http://127.0.0.1:8000/v1 smollm2`.
//! Prints every reply's tags and the throughput.

use std::time::{Duration, Instant};

use lora_models::llama::WeightMode;
use lora_tagger::Tagger;
use lora_tagger::llm::http::{HttpLlmOptions, HttpLlmTagger, ServerOptions};
use lora_tagger::llm::local::{LocalLlmOptions, LocalLlmTagger};
use tch::Kind;

/// Captions: the first docstring line of each `def name():` in scikit-image's `_fetchers.py`,
/// then OpenMoji annotations (column 5 of `openmoji.csv`), `n` in all.
fn descriptions(n: usize) -> Vec<String> {
    let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or_else(|_| "assets".into());
    let mut out = Vec::new();
    let py = std::fs::read_to_string(format!("{assets}/skimage/_fetchers.py")).unwrap_or_default();
    let mut lines = py.lines().peekable();
    while let Some(l) = lines.next() {
        if l.starts_with("def ") && !l.starts_with("def _") && l.ends_with("():") {
            if let Some(doc) = lines.peek().and_then(|d| d.trim().strip_prefix("\"\"\"")) {
                if !doc.starts_with("Return") && !doc.is_empty() {
                    out.push(doc.to_string());
                }
            }
        }
    }
    let csv = std::fs::read_to_string(format!("{assets}/emoji/openmoji.csv")).unwrap_or_default();
    for l in csv.lines().skip(1).step_by(97) {
        if let Some(a) = l.split(',').nth(4) {
            if !a.is_empty() {
                out.push(a.to_string());
            }
        }
    }
    out.truncate(n);
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (mut tagger, n): (Box<dyn Tagger>, usize) = match args.first().map(String::as_str) {
        Some("http") => {
            let t = HttpLlmTagger::new(HttpLlmOptions {
                server: ServerOptions {
                    base_url: args.get(1).cloned().ok_or("http needs BASE_URL MODEL")?,
                    model: args.get(2).cloned().ok_or("http needs BASE_URL MODEL")?,
                    concurrency: arg(4, 2),
                    max_tokens: 40,
                    timeout: Duration::from_secs(120),
                    ..Default::default()
                },
                ..Default::default()
            })?;
            (Box::new(t), arg(3, 16))
        }
        _ => {
            let t = LocalLlmTagger::load(
                None,
                LocalLlmOptions {
                    max_new_tokens: 40,
                    max_batch_size: arg(2, 8),
                    weight_mode: match args.get(3).map(String::as_str) {
                        Some("quantized") => WeightMode::KeepQuantized,
                        _ => WeightMode::Dense(Kind::Float),
                    },
                    ..Default::default()
                },
            )?;
            (Box::new(t), arg(1, 16))
        }
    };
    let d = descriptions(n);
    println!("{} on {} descriptions", tagger.model_id(), d.len());
    let t0 = Instant::now();
    let out = tagger.tag_descriptions(&d)?;
    let s = t0.elapsed().as_secs_f64();
    let mut ok = 0;
    for (desc, r) in d.iter().zip(&out) {
        match r {
            Ok(tags) => {
                ok += 1;
                let t: Vec<&str> = tags.iter().map(|t| t.tag.as_str()).collect();
                println!("{desc:?} -> {}", t.join(", "));
            }
            Err(e) => println!("{desc:?} -> error: {e}"),
        }
    }
    println!(
        "{} descriptions ({ok} with tags) in {s:.2} s = {:.2} descriptions/s",
        d.len(),
        d.len() as f64 / s
    );
    Ok(())
}
