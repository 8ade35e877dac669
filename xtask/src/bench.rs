//! `cargo xtask bench-compare`: the same LoRA training job through our `Trainer` and through
//! Python PEFT + transformers, alternating, plus the image loader against Pillow; ratios to
//! `DIR/bench.json`, `DIR/bench.md` and `DIR/bench.png`.
//!
//! The job (see `benches/src/job.rs`): SmolLM2-135M-Instruct from
//! `assets/models/SmolLM2-135M-Instruct.Q4_1.gguf` dequantized to dense f32 on both sides, LoRA
//! r8 α16 dropout 0 on q,k,v,o,gate,up,down with the same initial A/B (a PEFT folder both load),
//! the same token batches (a safetensors file both read, from `assets/shakespeare/`), AdamW
//! (lr 2e-4, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, constant), the same thread count
//! (`OMP_NUM_THREADS`/`MKL_NUM_THREADS` plus `tch::set_num_threads` / `torch.set_num_threads`).
//! The first step of every run is a warm-up and is left out of the step-time statistics.
//! Memory is measured the same way on both sides: `VmRSS` before the first step and `VmHWM` after
//! the steps, reset by writing 5 to `/proc/self/clear_refs` in between.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Options of `bench-compare`.
#[derive(Debug, Clone)]
struct Options {
    steps: usize,
    repeats: usize,
    threads: usize,
    out: PathBuf,
    batch: usize,
    seq_len: usize,
    device: String,
    precision: String,
    release: bool,
    loader: bool,
    phases: bool,
    profile: bool,
}

pub const USAGE: &str = "\
usage: cargo xtask bench-compare [--steps N] [--repeats R] [--threads T] [--out DIR]
                                 [--batch B] [--seq-len S] [--device cpu|cuda]
                                 [--precision fp32|bf16] [--release] [--no-loader] [--phases]
                                 [--profile]

  --steps N       optimizer steps per run, the first a warm-up (default 5)
  --repeats R     runs per side, alternating ours/PEFT (default 2)
  --threads T     intra-op threads on both sides (default 2)
  --out DIR       where bench.json, bench.md and bench.png go (default target/bench-compare)
  --batch B       rows per batch (default 2);  --seq-len S  tokens per row (default 128)
  --device        cpu (default) or cuda;  --precision fp32 (default) or bf16 (autocast)
  --release       build our side with the release profile (default: the dev profile, whose
                  dependencies are optimised; the work runs in libtorch either way)
  --no-loader     skip the image loader comparison (lora-data loader_bench vs Pillow)
  --phases        also run one phase-timed run per side (forward, backward, optimizer)
  --profile       also run one profiled run per side (libtorch's profiler on ours,
                  torch.profiler on PEFT's, every step after the first): per-operator self
                  times side by side in bench.md, Chrome traces in DIR/profile/
";

fn parse(args: &[String]) -> Result<Options> {
    let mut o = Options {
        steps: 5,
        repeats: 2,
        threads: 2,
        out: PathBuf::from("target/bench-compare"),
        batch: 2,
        seq_len: 128,
        device: "cpu".into(),
        precision: "fp32".into(),
        release: false,
        loader: true,
        phases: false,
        profile: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .with_context(|| format!("{flag} needs a value\n\n{USAGE}"))
        };
        let num = |v: String| -> Result<usize> {
            v.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .with_context(|| format!("{flag} {v:?}: expected a positive integer"))
        };
        match flag.as_str() {
            "--steps" => o.steps = num(val()?)?,
            "--repeats" => o.repeats = num(val()?)?,
            "--threads" => o.threads = num(val()?)?,
            "--batch" => o.batch = num(val()?)?,
            "--seq-len" => o.seq_len = num(val()?)?,
            "--out" => o.out = PathBuf::from(val()?),
            "--device" => o.device = val()?,
            "--precision" => o.precision = val()?,
            "--release" => o.release = true,
            "--no-loader" => o.loader = false,
            "--phases" => o.phases = true,
            "--profile" => o.profile = true,
            other => bail!("unknown flag {other}\n\n{USAGE}"),
        }
    }
    if o.steps < 2 {
        bail!(
            "--steps {}: use 2 or more (the first step is a warm-up)",
            o.steps
        );
    }
    if !matches!(o.device.as_str(), "cpu" | "cuda") {
        bail!("--device {:?}: use cpu or cuda", o.device);
    }
    if !matches!(o.precision.as_str(), "fp32" | "bf16") {
        bail!("--precision {:?}: use fp32 or bf16", o.precision);
    }
    Ok(o)
}

/// The 1-minute load average (`/proc/loadavg`), for the record of each run.
fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        0.5 * (s[n / 2 - 1] + s[n / 2])
    }
}

fn threads_env(cmd: &mut Command, t: usize) {
    cmd.env("OMP_NUM_THREADS", t.to_string())
        .env("MKL_NUM_THREADS", t.to_string());
}

/// Runs `cmd`, failing with the cause: stderr without libtorch's C++ backtrace frames (lines
/// `frame #N: …` and the "Exception raised from" line), last 25 lines of it.
fn run_quiet(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("could not start {what} ({:?})", cmd.get_program()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let kept: Vec<&str> = err
            .lines()
            .filter(|l| {
                let t = l.trim_start();
                !(t.starts_with("frame #") || t.starts_with("Exception raised from"))
            })
            .collect();
        let tail = &kept[kept.len().saturating_sub(25)..];
        bail!("{what} failed ({}):\n{}", out.status, tail.join("\n"));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}

/// Statistics of one side over its runs.
fn side_stats(runs: &[Value]) -> Value {
    let times: Vec<f64> = runs
        .iter()
        .flat_map(|r| f64s(&r["step_times_s"]).into_iter().skip(1))
        .collect();
    let cpu: Vec<f64> = runs
        .iter()
        .flat_map(|r| f64s(&r["step_cpu_s"]).into_iter().skip(1))
        .collect();
    let tokens = runs
        .first()
        .and_then(|r| r["tokens_per_step"].as_f64())
        .unwrap_or(0.0);
    let med = median(&times);
    let col = |k: &str| -> Vec<f64> { runs.iter().filter_map(|r| r[k].as_f64()).collect() };
    json!({
        "step_s_median": med,
        "step_s_min": times.iter().copied().fold(f64::INFINITY, f64::min),
        "step_s_max": times.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        "steps_timed": times.len(),
        "step_cpu_s_median": median(&cpu),
        "tokens_per_s": tokens / med,
        "rss_delta_bytes_median": median(&col("rss_delta_bytes")),
        "rss_peak_bytes_median": median(&col("rss_peak_bytes")),
        "rss_baseline_bytes_median": median(&col("rss_baseline_bytes")),
        "tensor_peak_bytes_median": median(&col("tensor_peak_bytes")),
        "cuda_peak_bytes_median": median(&col("cuda_peak_bytes")),
        "load_s_median": median(&col("load_s")),
        "losses_run0": runs.first().map(|r| r["losses"].clone()).unwrap_or(Value::Null),
    })
}

/// Per repeat, the median step of ours over the median step of PEFT's run next to it (the
/// warm-up step left out): the pairs ran back to back, so a host that slows down or speeds up
/// between repeats moves both sides of a pair alike. Pairs where either side has no timed step
/// are skipped.
fn paired_step_ratios(ours: &[Value], peft: &[Value]) -> Vec<f64> {
    ours.iter()
        .zip(peft)
        .filter_map(|(a, b)| {
            let t =
                |r: &Value| -> Vec<f64> { f64s(&r["step_times_s"]).into_iter().skip(1).collect() };
            let (ta, tb) = (t(a), t(b));
            if ta.is_empty() || tb.is_empty() {
                return None;
            }
            Some(median(&ta) / median(&tb))
        })
        .collect()
}

fn mib(b: f64) -> String {
    if b.is_finite() {
        format!("{:.0} MiB", b / (1024.0 * 1024.0))
    } else {
        "–".into()
    }
}

/// Parses loader_bench's `NAME: lora-data X images/s vs Pillow+NumPy Y images/s → ratio Zx`.
fn loader_lines(text: &str) -> Vec<(String, f64, f64)> {
    text.lines()
        .filter_map(|l| {
            let (name, rest) = l.split_once(": lora-data ")?;
            let ours: f64 = rest.split_whitespace().next()?.parse().ok()?;
            let theirs: f64 = rest
                .split_once("Pillow+NumPy ")?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            Some((name.to_string(), ours, theirs))
        })
        .collect()
}

/// Runs the comparison (see the module docs).
pub fn bench_compare(root: &Path, env: &crate::Env, args: &[String]) -> Result<()> {
    let o = parse(args)?;
    let started = Instant::now();
    let out = if o.out.is_absolute() {
        o.out.clone()
    } else {
        root.join(&o.out)
    };
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let model = root.join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text_dir = root.join("assets/shakespeare");
    for p in [&model, &text_dir] {
        if !p.exists() {
            bail!(
                "{} is missing; `cargo xtask setup` provisions the assets",
                p.display()
            );
        }
    }
    let script = root.join("benches/python/peft_train.py");

    eprintln!(
        "== bench-compare: building bench-train ({} profile)",
        if o.release { "release" } else { "dev" }
    );
    let mut build = crate::cargo();
    build.current_dir(root).args([
        "build",
        "--quiet",
        "-p",
        "lora-benches",
        "--bin",
        "bench-train",
    ]);
    if o.release {
        build.arg("--release");
    }
    crate::configure(&mut build, env);
    crate::util::run(&mut build, "building bench-train")?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = target
        .join(if o.release { "release" } else { "debug" })
        .join("bench-train");

    let job = out.join("job");
    eprintln!(
        "== bench-compare: shared inputs ({} steps of {}×{} tokens, initial adapter) in {}",
        o.steps,
        o.batch,
        o.seq_len,
        job.display()
    );
    let mut prep = Command::new(&bin);
    prep.current_dir(root)
        .arg("prepare")
        .arg("--model")
        .arg(&model)
        .arg("--text-dir")
        .arg(&text_dir)
        .args(["--steps", &o.steps.to_string()])
        .args(["--batch", &o.batch.to_string()])
        .args(["--seq-len", &o.seq_len.to_string()])
        .arg("--out")
        .arg(&job);
    crate::configure(&mut prep, env);
    threads_env(&mut prep, o.threads);
    run_quiet(&mut prep, "bench-train prepare")?;

    let profile_dir = out.join("profile");
    let side_cmd = |side: &str, result: &Path, phases: bool, profile: bool| -> Command {
        let mut c = if side == "ours" {
            let mut c = Command::new(&bin);
            c.arg("train");
            if phases {
                c.args(["--phases", "true"]);
            }
            c
        } else {
            let mut c = Command::new(&env.python);
            c.arg(&script);
            if phases {
                c.arg("--phases");
            }
            c
        };
        if profile {
            c.arg("--profile").arg(&profile_dir);
        }
        c.current_dir(root)
            .arg("--model")
            .arg(&model)
            .arg("--job")
            .arg(&job)
            .args(["--steps", &o.steps.to_string()])
            .args(["--threads", &o.threads.to_string()])
            .args(["--device", &o.device])
            .args(["--precision", &o.precision])
            .arg("--out")
            .arg(result);
        crate::configure(&mut c, env);
        threads_env(&mut c, o.threads);
        c
    };

    let mut runs: Vec<Value> = Vec::new();
    let mut by_side: [(String, Vec<Value>); 2] =
        [("ours".into(), Vec::new()), ("peft".into(), Vec::new())];
    for r in 0..o.repeats {
        let order: [usize; 2] = if r % 2 == 0 { [0, 1] } else { [1, 0] };
        for i in order {
            let side = by_side[i].0.clone();
            let result = out.join(format!("run{r}_{side}.json"));
            let load_before = load_avg();
            let t = Instant::now();
            eprintln!(
                "== bench-compare: run {}/{} {side} (load average {load_before:.2})",
                r + 1,
                o.repeats
            );
            run_quiet(
                &mut side_cmd(&side, &result, false, false),
                &format!("the {side} run"),
            )?;
            let mut v = read_json(&result)?;
            let times = f64s(&v["step_times_s"]);
            eprintln!(
                "   {side}: steps {:?} s, first loss {:.4}, RSS Δ {} ({:.0} s)",
                times
                    .iter()
                    .map(|t| (t * 1000.0).round() / 1000.0)
                    .collect::<Vec<_>>(),
                f64s(&v["losses"]).first().copied().unwrap_or(f64::NAN),
                mib(v["rss_delta_bytes"].as_f64().unwrap_or(f64::NAN)),
                t.elapsed().as_secs_f64()
            );
            v["load_avg_before"] = json!(load_before);
            v["load_avg_after"] = json!(load_avg());
            v["repeat"] = json!(r);
            runs.push(v.clone());
            by_side[i].1.push(v);
        }
    }
    let mut phases = json!({});
    if o.phases {
        for side in ["ours", "peft"] {
            let result = out.join(format!("phases_{side}.json"));
            eprintln!("== bench-compare: phase-timed run, {side}");
            run_quiet(
                &mut side_cmd(side, &result, true, false),
                &format!("the {side} phase run"),
            )?;
            let v = read_json(&result)?;
            phases[side] = v["phases_s"].clone();
        }
    }
    let mut profile = json!({});
    if o.profile {
        for side in ["ours", "peft"] {
            let result = out.join(format!("profile_{side}.json"));
            eprintln!("== bench-compare: profiled run, {side}");
            run_quiet(
                &mut side_cmd(side, &result, true, true),
                &format!("the {side} profiled run"),
            )?;
            profile[side] = read_json(&profile_dir.join(format!("ops_{side}.json")))?;
        }
    }

    let ours = side_stats(&by_side[0].1);
    let peft = side_stats(&by_side[1].1);
    let l_ours = f64s(&ours["losses_run0"]);
    let l_peft = f64s(&peft["losses_run0"]);
    let max_loss_diff = l_ours
        .iter()
        .zip(&l_peft)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    let first_diff = match (l_ours.first(), l_peft.first()) {
        (Some(a), Some(b)) => (a - b).abs(),
        _ => f64::NAN,
    };
    let ratio = |k: &str| {
        let (a, b) = (ours[k].as_f64(), peft[k].as_f64());
        match (a, b) {
            (Some(a), Some(b)) if b > 0.0 => a / b,
            _ => f64::NAN,
        }
    };
    let paired = paired_step_ratios(&by_side[0].1, &by_side[1].1);
    let paired_json = json!({
        "median": median(&paired),
        "min": paired.iter().copied().fold(f64::INFINITY, f64::min),
        "max": paired.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        "per_repeat": paired,
    });
    let mut ratios = vec![
        json!({"label": "step time", "ratio": ratio("step_s_median"), "lower_is_better": true}),
        json!({"label": "tokens/s", "ratio": ratio("tokens_per_s"), "lower_is_better": false}),
        json!({"label": "CPU time per step", "ratio": ratio("step_cpu_s_median"), "lower_is_better": true}),
        json!({"label": "peak RSS above baseline", "ratio": ratio("rss_delta_bytes_median"), "lower_is_better": true}),
        json!({"label": "peak RSS (process)", "ratio": ratio("rss_peak_bytes_median"), "lower_is_better": true}),
        json!({"label": "load time", "ratio": ratio("load_s_median"), "lower_is_better": true}),
    ];
    if o.device == "cuda" {
        ratios.push(json!({"label": "CUDA allocated peak", "ratio": ratio("cuda_peak_bytes_median"), "lower_is_better": true}));
    }

    // The image loader: lora-data's loader_bench (it runs its Pillow pipeline itself).
    let mut loader = Vec::new();
    if o.loader {
        let mut rates: std::collections::BTreeMap<String, (Vec<f64>, Vec<f64>)> =
            Default::default();
        for r in 0..o.repeats {
            eprintln!(
                "== bench-compare: image loader vs Pillow, run {}/{} (load average {:.2})",
                r + 1,
                o.repeats,
                load_avg()
            );
            let mut c = crate::cargo();
            c.current_dir(root).args([
                "run",
                "--quiet",
                "-p",
                "lora-data",
                "--example",
                "loader_bench",
            ]);
            if o.release {
                c.arg("--release");
            }
            c.arg("--")
                .args(["--threads", &o.threads.to_string()])
                .arg("--python")
                .arg(&env.python)
                .arg("--out")
                .arg(out.join("loader"));
            crate::configure(&mut c, env);
            threads_env(&mut c, o.threads);
            let text = run_quiet(&mut c, "lora-data loader_bench")?;
            for (name, a, b) in loader_lines(&text) {
                let e = rates.entry(name).or_default();
                e.0.push(a);
                e.1.push(b);
            }
        }
        for (name, (a, b)) in rates {
            let (ma, mb) = (median(&a), median(&b));
            loader.push(
                json!({"set": name, "ours_images_per_s": ma, "pillow_images_per_s": mb,
                               "ratio": ma / mb, "runs": a.len()}),
            );
            ratios.push(json!({"label": format!("images/s {name}"), "ratio": ma / mb, "lower_is_better": false}));
        }
    }

    let report = json!({
        "title": format!("ours / PEFT+transformers, SmolLM2-135M LoRA r8, {} {}, {} threads",
                         o.device, o.precision, o.threads),
        "config": {
            "model": "assets/models/SmolLM2-135M-Instruct.Q4_1.gguf (dequantized to dense f32 on both sides)",
            "lora": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                     "target_modules": ["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]},
            "optimizer": {"name": "AdamW", "lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
            "steps": o.steps, "repeats": o.repeats, "threads": o.threads, "batch": o.batch,
            "seq_len": o.seq_len, "device": o.device, "precision": o.precision,
            "profile": if o.release { "release" } else { "dev" },
        },
        "ours": ours,
        "peft": peft,
        "step_time_paired": paired_json,
        "losses": {"first_step_ours": l_ours.first(), "first_step_peft": l_peft.first(),
                    "first_step_abs_diff": first_diff, "max_abs_diff_run0": max_loss_diff},
        "phases_s": phases,
        "profile": profile,
        "loader": loader,
        "ratios": ratios,
        "runs": runs,
        "total_s": started.elapsed().as_secs_f64(),
    });
    let json_path = out.join("bench.json");
    std::fs::write(&json_path, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    let md = markdown(&report);
    let md_path = out.join("bench.md");
    std::fs::write(&md_path, &md).with_context(|| format!("writing {}", md_path.display()))?;
    let png = out.join("bench.png");
    let mut chart = Command::new(&bin);
    chart
        .arg("chart")
        .arg("--in")
        .arg(&json_path)
        .arg("--out")
        .arg(&png);
    crate::configure(&mut chart, env);
    run_quiet(&mut chart, "drawing the chart")?;
    print!("{md}");
    eprintln!(
        "== bench-compare: wrote {}, {}, {}",
        json_path.display(),
        md_path.display(),
        png.display()
    );
    Ok(())
}

fn markdown(r: &Value) -> String {
    let (o, p) = (&r["ours"], &r["peft"]);
    let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let c = &r["config"];
    let mut s = String::new();
    s += &format!(
        "### {}\n\n{} steps per run ({} timed after a warm-up step), {} runs per side alternating, batch {} × {} tokens, {} profile.\n\n",
        r["title"].as_str().unwrap_or(""),
        c["steps"],
        num(c, "steps") as i64 - 1,
        c["repeats"],
        c["batch"],
        c["seq_len"],
        c["profile"].as_str().unwrap_or("")
    );
    s += "| metric | ours (lora-train) | PEFT + transformers | ours / PEFT |\n|---|---|---|---|\n";
    let row = |name: &str, a: String, b: String, ratio: f64| {
        format!("| {name} | {a} | {b} | {ratio:.2} |\n")
    };
    let (a, b) = (num(o, "step_s_median"), num(p, "step_s_median"));
    s += &row(
        "step time, median (min–max)",
        format!(
            "{a:.3} s ({:.3}–{:.3})",
            num(o, "step_s_min"),
            num(o, "step_s_max")
        ),
        format!(
            "{b:.3} s ({:.3}–{:.3})",
            num(p, "step_s_min"),
            num(p, "step_s_max")
        ),
        a / b,
    );
    let pr = &r["step_time_paired"];
    if pr["per_repeat"].as_array().is_some_and(|v| !v.is_empty()) {
        s += &format!(
            "| step time, paired: median of each repeat's ours/PEFT (min–max) | | | {:.2} ({:.2}–{:.2}) |\n",
            num(pr, "median"),
            num(pr, "min"),
            num(pr, "max")
        );
    }
    let (a, b) = (num(o, "tokens_per_s"), num(p, "tokens_per_s"));
    s += &row("tokens/s", format!("{a:.0}"), format!("{b:.0}"), a / b);
    let (a, b) = (num(o, "step_cpu_s_median"), num(p, "step_cpu_s_median"));
    s += &row(
        "CPU time per step (all threads), median",
        format!("{a:.3} s"),
        format!("{b:.3} s"),
        a / b,
    );
    for (name, k) in [
        ("peak RSS above baseline", "rss_delta_bytes_median"),
        ("peak RSS of the process", "rss_peak_bytes_median"),
        ("RSS before the first step", "rss_baseline_bytes_median"),
    ] {
        let (a, b) = (num(o, k), num(p, k));
        s += &row(name, mib(a), mib(b), a / b);
    }
    s += &format!(
        "| tensor peak (counting allocator) | {} | – | – |\n",
        mib(num(o, "tensor_peak_bytes_median"))
    );
    if c["device"] == "cuda" {
        let (a, b) = (
            num(o, "cuda_peak_bytes_median"),
            num(p, "cuda_peak_bytes_median"),
        );
        s += &row("CUDA allocated peak", mib(a), mib(b), a / b);
    }
    let (a, b) = (num(o, "load_s_median"), num(p, "load_s_median"));
    s += &row(
        "load (dequantize GGUF + adapter)",
        format!("{a:.1} s"),
        format!("{b:.1} s"),
        a / b,
    );
    let l = &r["losses"];
    s += &format!(
        "| first-step loss | {:.5} | {:.5} | Δ {:.2e} |\n",
        num(l, "first_step_ours"),
        num(l, "first_step_peft"),
        num(l, "first_step_abs_diff")
    );
    s += &format!(
        "| loss curve, max abs difference (run 1) | | | {:.2e} |\n",
        num(l, "max_abs_diff_run0")
    );
    if let Some(arr) = r["loader"].as_array() {
        for x in arr {
            s += &format!(
                "| images/s, {} (lora-data vs Pillow+NumPy) | {:.1} | {:.1} | {:.2} |\n",
                x["set"].as_str().unwrap_or(""),
                num(x, "ours_images_per_s"),
                num(x, "pillow_images_per_s"),
                num(x, "ratio")
            );
        }
    }
    if let Some(ph) = r["phases_s"].as_object().filter(|m| !m.is_empty()) {
        s += "\nPhases (mean s per step after the first, bare loop):\n\n| phase | ours | PEFT |\n|---|---|---|\n";
        for k in ["forward", "backward", "optimizer"] {
            s += &format!(
                "| {k} | {:.3} | {:.3} |\n",
                num(&ph["ours"], k),
                num(&ph["peft"], k)
            );
        }
    }
    if r["profile"]["ours"].is_object() && r["profile"]["peft"].is_object() {
        s += &profile_table(&r["profile"]["ours"], &r["profile"]["peft"], 25);
    }
    s += "\nLoad average (1 min) per run: ";
    if let Some(runs) = r["runs"].as_array() {
        let v: Vec<String> = runs
            .iter()
            .map(|x| {
                format!(
                    "{} {:.2}",
                    x["side"].as_str().unwrap_or(""),
                    x["load_avg_before"].as_f64().unwrap_or(f64::NAN)
                )
            })
            .collect();
        s += &v.join(", ");
    }
    s += "\n";
    s
}

/// The per-operator table of a profiled run: the `top` operators by the larger of the two self
/// times per step (ms), both sides and their difference; operator names are libtorch's on both
/// sides, so the rows line up. A last row sums every operator.
fn profile_table(ours: &Value, peft: &Value, top: usize) -> String {
    let per_op = |v: &Value| -> std::collections::HashMap<String, (f64, f64)> {
        v["ops"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|o| {
                        (
                            o["name"].as_str().unwrap_or("?").to_string(),
                            (
                                o["self_s"].as_f64().unwrap_or(0.0),
                                o["calls_per_step"].as_f64().unwrap_or(0.0),
                            ),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let (a, b) = (per_op(ours), per_op(peft));
    let mut names: Vec<&String> = a.keys().chain(b.keys()).collect();
    names.sort();
    names.dedup();
    let get = |m: &std::collections::HashMap<String, (f64, f64)>, n: &str| {
        m.get(n).copied().unwrap_or((0.0, 0.0))
    };
    names.sort_by(|x, y| {
        let kx = get(&a, x).0.max(get(&b, x).0);
        let ky = get(&a, y).0.max(get(&b, y).0);
        ky.total_cmp(&kx).then_with(|| x.cmp(y))
    });
    let mut s = String::from(
        "\nOperators (self time per step after the first, ms; libtorch's profiler on ours, torch.profiler on PEFT's; calls per step in brackets):\n\n| operator | ours | PEFT | ours − PEFT |\n|---|---|---|---|\n",
    );
    for n in names.iter().take(top) {
        let ((sa, ca), (sb, cb)) = (get(&a, n), get(&b, n));
        s += &format!(
            "| {n} | {:.1} ({ca:.0}) | {:.1} ({cb:.0}) | {:+.1} |\n",
            sa * 1e3,
            sb * 1e3,
            (sa - sb) * 1e3
        );
    }
    let sum = |m: &std::collections::HashMap<String, (f64, f64)>| -> f64 {
        m.values().map(|v| v.0).sum()
    };
    s += &format!(
        "| all operators | {:.1} | {:.1} | {:+.1} |\n",
        sum(&a) * 1e3,
        sum(&b) * 1e3,
        (sum(&a) - sum(&b)) * 1e3
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_loader_lines() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        let l = loader_lines(
            "emoji: 3786 images\nemoji: lora-data 812.5 images/s vs Pillow+NumPy 401.2 images/s → ratio 2.03x\n",
        );
        assert_eq!(l, vec![("emoji".to_string(), 812.5, 401.2)]);
    }

    #[test]
    fn paired_ratios_compare_each_repeat_with_its_neighbour() {
        let ours = vec![
            json!({"step_times_s": [9.0, 1.0, 1.2, 1.1]}),
            json!({"step_times_s": [9.0, 2.0, 2.0]}),
            json!({"step_times_s": [9.0]}),
        ];
        let peft = vec![
            json!({"step_times_s": [9.0, 2.0, 2.4, 2.2]}),
            json!({"step_times_s": [9.0, 2.5, 2.5]}),
            json!({"step_times_s": [9.0, 1.0]}),
        ];
        let r = paired_step_ratios(&ours, &peft);
        assert_eq!(
            r.len(),
            2,
            "the pair without a timed step of ours is skipped"
        );
        assert!((r[0] - 0.5).abs() < 1e-12, "{r:?}");
        assert!((r[1] - 0.8).abs() < 1e-12, "{r:?}");
    }

    #[test]
    fn side_stats_leave_out_the_warm_up_step() {
        let runs = vec![
            json!({"step_times_s": [9.0, 1.0, 3.0], "step_cpu_s": [9.0, 2.0, 6.0], "tokens_per_step": 100, "losses": [2.0]}),
            json!({"step_times_s": [9.0, 2.0], "step_cpu_s": [9.0, 4.0], "tokens_per_step": 100, "losses": [2.0]}),
        ];
        let s = side_stats(&runs);
        assert_eq!(s["step_s_median"], 2.0);
        assert_eq!(s["step_s_max"], 3.0);
        assert_eq!(s["tokens_per_s"], 50.0);
        assert_eq!(s["steps_timed"], 3);
        assert_eq!(s["step_cpu_s_median"], 4.0);
    }
}
