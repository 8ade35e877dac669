//! Our side of `cargo xtask bench-compare`, and its shared inputs.
//!
//! ```text
//! bench-train prepare --model M.gguf --text-dir assets/shakespeare --steps N --batch B --seq-len S \
//!                     [--rank 8 --alpha 16 --seed 0] --out JOB_DIR
//! bench-train train   --model M.gguf --job JOB_DIR --steps N [--threads T --lr 2e-4 \
//!                     --weight-decay 0.01 --device cpu|cuda --precision fp32|bf16 --phases true \
//!                     --profile DIR] --out RESULT.json
//! bench-train chart   --in BENCH.json --out BENCH.png
//! ```
//!
//! `chart` reads the `ratios` array of `bench.json` (`label`, `ratio`, `lower_is_better`) and the
//! `title` field, and draws [`lora_benches::chart::ratio_chart`].

use std::collections::HashMap;
use std::path::PathBuf;

use lora_benches::chart::{Bar, ratio_chart};
use lora_benches::job::{PrepareOptions, TrainOptions, prepare, train_ours};

const USAGE: &str =
    "usage: bench-train <prepare|train|chart> --flag value ... (see the file's docs)";

fn flags(args: &[String]) -> Result<HashMap<String, String>, String> {
    let mut m = HashMap::new();
    let mut it = args.iter();
    while let Some(f) = it.next() {
        let Some(name) = f.strip_prefix("--") else {
            return Err(format!("unexpected argument {f:?}; {USAGE}"));
        };
        let v = it.next().ok_or(format!("{f} needs a value"))?;
        m.insert(name.to_string(), v.clone());
    }
    Ok(m)
}

fn get<T: std::str::FromStr>(
    m: &HashMap<String, String>,
    k: &str,
    default: Option<T>,
) -> Result<T, String>
where
    T::Err: std::fmt::Display,
{
    match m.get(k) {
        Some(v) => v.parse().map_err(|e| format!("--{k} {v:?}: {e}")),
        None => default.ok_or(format!("--{k} is required; {USAGE}")),
    }
}

fn run(args: &[String]) -> Result<(), String> {
    let cmd = args.first().map(String::as_str).unwrap_or("");
    let m = flags(args.get(1..).unwrap_or(&[]))?;
    match cmd {
        "prepare" => {
            let opts = PrepareOptions {
                model: get::<PathBuf>(&m, "model", None)?,
                text_dir: get(&m, "text-dir", None)?,
                steps: get(&m, "steps", None)?,
                batch: get(&m, "batch", None)?,
                seq_len: get(&m, "seq-len", None)?,
                rank: get(&m, "rank", Some(8))?,
                alpha: get(&m, "alpha", Some(16.0))?,
                seed: get(&m, "seed", Some(0))?,
                out_dir: get(&m, "out", None)?,
            };
            let (b, a) = prepare(&opts).map_err(|e| e.to_string())?;
            println!("wrote {} and {}", b.display(), a.display());
            Ok(())
        }
        "train" => {
            let opts = TrainOptions {
                model: get(&m, "model", None)?,
                job_dir: get(&m, "job", None)?,
                steps: get(&m, "steps", None)?,
                threads: get(&m, "threads", Some(2))?,
                lr: get(&m, "lr", Some(2e-4))?,
                weight_decay: get(&m, "weight-decay", Some(0.01))?,
                device: get(&m, "device", Some("cpu".to_string()))?,
                precision: get(&m, "precision", Some("fp32".to_string()))?,
                phases: get(&m, "phases", Some(false))?,
                profile: m.get("profile").map(PathBuf::from),
            };
            let out: PathBuf = get(&m, "out", None)?;
            let r = train_ours(&opts).map_err(|e| e.to_string())?;
            let text = serde_json::to_string_pretty(&r).map_err(|e| e.to_string())?;
            std::fs::write(&out, text).map_err(|e| format!("{}: {e}", out.display()))?;
            println!("wrote {}", out.display());
            Ok(())
        }
        "chart" => {
            let input: PathBuf = get(&m, "in", None)?;
            let out: PathBuf = get(&m, "out", None)?;
            let text =
                std::fs::read_to_string(&input).map_err(|e| format!("{}: {e}", input.display()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| format!("{}: {e}", input.display()))?;
            let bars: Vec<Bar> = v["ratios"]
                .as_array()
                .ok_or(format!("{}: no `ratios` array", input.display()))?
                .iter()
                .map(|r| Bar {
                    label: r["label"].as_str().unwrap_or("?").to_string(),
                    ratio: r["ratio"].as_f64().unwrap_or(f64::NAN),
                    lower_is_better: r["lower_is_better"].as_bool().unwrap_or(true),
                })
                .collect();
            let title = v["title"].as_str().unwrap_or("ours / python (ratio)");
            ratio_chart(title, &bars, &out).map_err(|e| e.to_string())?;
            println!("wrote {}", out.display());
            Ok(())
        }
        _ => Err(USAGE.to_string()),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Err(e) = run(&args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
