//! The `lora-train` binary: help, exit codes, plan, doctor, convert, and config errors.

use crate::{bin, gguf, repo, text};
use std::path::{Path, PathBuf};

fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn help_documents_every_command_and_the_exit_codes() {
    let o = bin().arg("--help").output().unwrap();
    assert_eq!(o.status.code(), Some(0));
    let t = text(&o);
    for w in [
        "train",
        "plan",
        "doctor",
        "convert",
        "merge",
        "eval",
        "generate",
        "Exit codes",
        "3  predicted not to fit",
    ] {
        assert!(t.contains(w), "--help lacks {w:?}:\n{t}");
    }
    let o = bin().args(["plan", "--help"]).output().unwrap();
    assert!(
        text(&o).contains("--budget") && text(&o).contains("--gpu") && text(&o).contains("--json")
    );
}

#[test]
fn bad_usage_and_bad_configs_exit_2_with_the_key_and_a_hint() {
    let o = bin().args(["plan"]).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(2),
        "missing --config is a usage error"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "typo.yaml",
        "model:\n  base_model: smollm2-135m\ntrain:\n  learnig_rate: 1e-4\n",
    );
    let o = bin().args(["plan", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("did you mean `train.learning_rate`"),
        "{}",
        text(&o)
    );
    let cfg = write(
        dir.path(),
        "conflict.yaml",
        "model:\n  base_model: smollm2-135m\ntrain:\n  batch_size: 4\ndata:\n  batch_size: 2\n",
    );
    let o = bin()
        .args(["train", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("conflicting values"), "{}", text(&o));
    let cfg = write(
        dir.path(),
        "nofile.yaml",
        "model:\n  base_model: /nonexistent/model.gguf\n",
    );
    let o = bin().args(["plan", "--config"]).arg(&cfg).output().unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("model.base_model") && text(&o).contains("not found"),
        "{}",
        text(&o)
    );
    // Latin-1 training text: refused before the model loads, naming the file and the byte.
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"MACBETH. Caf\xe9 au lait\n").unwrap();
    let cfg = write(
        dir.path(),
        "latin1.yaml",
        &format!(
            "model: {{base_model: {}}}\ndata: {{train_data_dir: {}}}\ntrain: {{output_dir: {}}}\n",
            gguf().display(),
            latin1.display(),
            dir.path().join("out").display()
        ),
    );
    let o = bin()
        .args(["train", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("latin1.txt")
            && text(&o).contains("byte 12")
            && !text(&o).contains("loading"),
        "{}",
        text(&o)
    );
}

#[test]
fn plan_exit_code_follows_the_budget_and_json_is_machine_readable() {
    let dir = tempfile::tempdir().unwrap();
    // a preset: no file needed; Llama-2-7B bf16 at batch 8 × 2048 cannot fit 12 GiB
    let big = write(
        dir.path(),
        "big.yaml",
        "model: {base_model: llama-2-7b, dtype: bf16}\ntrain: {batch_size: 8}\ndata: {seq_len: 2048}\n",
    );
    let o = bin()
        .args(["plan", "--gpu", "RTX 3060", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        text(&o).contains("DOES NOT FIT") && text(&o).contains("device cuda"),
        "{}",
        text(&o)
    );
    // without auto_fit, the plan still says what would fit
    assert!(
        text(&o).contains("would fit with") && text(&o).contains("gradient_checkpointing"),
        "{}",
        text(&o)
    );
    let o = bin()
        .args(["plan", "--gpu", "RTX 3060", "--json", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let suggested = v["suggestion"].as_array().unwrap();
    assert!(!suggested.is_empty(), "{v}");
    let last_peak = suggested.last().unwrap()["peak_after"].as_u64().unwrap();
    assert!(last_peak <= 12 << 30, "{last_peak}");
    let o = bin()
        .args(["plan", "--gpu", "H200", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // auto_fit turns the same run into one that fits, and says what changed
    let fit = write(
        dir.path(),
        "fit.yaml",
        "model: {base_model: llama-2-7b, dtype: bf16}\ntrain: {batch_size: 8}\ndata: {seq_len: 2048}\nmemory: {gpu: RTX 3060, auto_fit: true}\n",
    );
    let o = bin()
        .args(["plan", "--json", "--config"])
        .arg(&fit)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["fits"], true);
    assert!(!v["changes"].as_array().unwrap().is_empty());
    let peak = v["estimate"]["peak"].as_u64().unwrap();
    assert!(peak <= 12 << 30, "{peak}");
    assert_eq!(v["budget"]["bytes"].as_u64().unwrap(), 12 << 30);
    // a budget written for CUDA plans for CUDA; an unknown device prefix is a usage error
    let o = bin()
        .args(["plan", "--budget", "cuda: 200GB", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("device cuda"), "{}", text(&o));
    let o = bin()
        .args(["plan", "--budget", "tpu: 6GB", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("unknown device \"tpu\""), "{}", text(&o));
    // an unknown GPU is a usage error listing the known ones
    let o = bin()
        .args(["plan", "--gpu", "Voodoo 5", "--config"])
        .arg(&big)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("RTX 3060"), "{}", text(&o));
}

#[test]
fn train_refuses_a_run_that_does_not_fit_and_says_what_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let data = write(dir.path(), "data.txt", "To be, or not to be.\n");
    let config = |memory: &str| {
        write(
            dir.path(),
            "run.yaml",
            &format!(
                "model: {{base_model: llama-2-7b, dtype: bf16}}\ntrain: {{batch_size: 8}}\n\
                 data: {{seq_len: 2048, train_data_dir: {}, format: text}}\nmemory: {memory}\n",
                data.display()
            ),
        )
    };
    // the fitting ladder reaches 12 GiB: the error points at the suggestion
    let o = bin()
        .args(["train", "--config"])
        .arg(config("{gpu: RTX 3060}"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        text(&o).contains("would fit with")
            && text(&o).contains("set memory.auto_fit: true to take the settings that fit"),
        "{}",
        text(&o)
    );
    // nothing on the ladder reaches 2 GB: no advice to turn on auto_fit, with it on or off
    for memory in ["{budget: 2GB}", "{budget: 2GB, auto_fit: true}"] {
        let o = bin()
            .args(["train", "--config"])
            .arg(config(memory))
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(3), "{memory}: {}", text(&o));
        assert!(
            text(&o).contains("nothing on the fitting ladder fits it")
                && !text(&o).contains("set memory.auto_fit"),
            "{memory}: {}",
            text(&o)
        );
    }
}

#[test]
fn plan_of_the_demo_config_reads_the_gguf_header_and_fits() {
    gguf();
    let cfg = repo().join("examples/configs/smollm2-shakespeare.yaml");
    let o = bin()
        .current_dir(repo())
        .args(["plan", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("verdict: fits") && t.contains("trainable params: 921600"),
        "{t}"
    );
    // 30 layers × 4 sites × r8 × (in + out): q,o 576+576, k,v 576+192 → 30·8·(2·1152 + 2·768) = 921,600
    let o = bin()
        .current_dir(repo())
        .args(["plan", "--budget", "100MB", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    // train refuses a run predicted not to fit before loading anything (the data file does not
    // even exist: the refusal comes first)
    let dir = tempfile::tempdir().unwrap();
    let small = write(
        dir.path(),
        "small.yaml",
        &format!(
            "model: {{base_model: {}}}\ndata: {{train_data_dir: /nonexistent.txt}}\nmemory: {{budget: 100MB}}\n",
            gguf().display()
        ),
    );
    let o = bin()
        .args(["train", "--config"])
        .arg(&small)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        text(&o).contains("does not fit") && text(&o).contains("--force"),
        "{}",
        text(&o)
    );
}

#[test]
fn doctor_reports_libtorch_cpu_and_memory() {
    let o = bin().arg("doctor").output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t = text(&o);
    for w in [
        "libtorch",
        "version: 2.13.0",
        "CUDA available:",
        "logical cores:",
        "MemTotal:",
        "free of",
    ] {
        assert!(t.contains(w), "doctor lacks {w:?}:\n{t}");
    }
    let cuda = tch::Cuda::is_available();
    assert!(t.contains(&format!("CUDA available: {cuda}")), "{t}");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = meminfo
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let gb = format!("{:.2} GB", (kb * 1024) as f64 / 1e9);
    assert!(
        t.contains(&format!("MemTotal: {gb}")),
        "expected MemTotal {gb}:\n{t}"
    );
}

#[test]
fn doctor_json_is_one_object_with_the_same_facts_as_the_text() {
    let o = bin().args(["doctor", "--json"]).output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("doctor --json is not JSON ({e}):\n{}", text(&o)));
    // the wheel's version carries its CUDA build: 2.13.0+cu130; the loaded libtorch is the one
    // the binary was built against (its rpath), and no launcher chose it
    let version = v["libtorch"]["version"].as_str().unwrap();
    assert!(version.starts_with("2."), "{v:#}");
    assert_eq!(v["libtorch"]["built_for_pytorch"], version, "{v:#}");
    assert_eq!(v["libtorch"]["version_source"], "version.py", "{v:#}");
    assert!(v["libtorch"]["found_via"].is_null(), "{v:#}");
    assert_eq!(
        v["libtorch"]["cuda_available"],
        tch::Cuda::is_available(),
        "{v:#}"
    );
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb: u64 = meminfo
        .lines()
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(v["memory"]["total_bytes"], kb * 1024, "{v:#}");
    let logical = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    assert_eq!(v["cpu"]["logical_cores"], logical as u64, "{v:#}");
    // the f32 GEMM the library picks here, and what the variable forces
    let f32_gemm = if lora_core::sys::cpu_f32_gemm_by_onednn() {
        "onednn"
    } else {
        "mkl"
    };
    assert_eq!(v["cpu"]["f32_gemm"], f32_gemm, "{v:#}");
    let o = bin()
        .args(["doctor", "--json"])
        .env("LORA_CPU_F32_GEMM", "MKL")
        .output()
        .unwrap();
    let forced: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(forced["cpu"]["f32_gemm"], "mkl", "{forced:#}");
    assert_eq!(forced["cpu"]["f32_gemm_env"], "MKL", "{forced:#}");
    assert_eq!(forced["cpu"]["f32_gemm_env_ignored"], false, "{forced:#}");
    // the LoRA branch kernel: the library's choice, and libtorch's GEMMs when asked
    let lora = if lora_core::sys::cpu_lora_branch_by_lsdk() {
        "lsdk"
    } else {
        "libtorch"
    };
    assert_eq!(v["cpu"]["cpu_lora"]["choice"], lora, "{v:#}");
    assert_eq!(
        v["cpu"]["cpu_lora"]["available"],
        lora_core::sys::lora_branch_available(),
        "{v:#}"
    );
    let o = bin()
        .args(["doctor", "--json"])
        .env("LORA_CPU_LORA", " LIBTORCH ")
        .output()
        .unwrap();
    let forced: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let k = &forced["cpu"]["cpu_lora"];
    assert_eq!(k["choice"], "libtorch", "{forced:#}");
    assert_eq!(k["env"], " LIBTORCH ", "{forced:#}");
    assert_eq!(k["env_ignored"], false, "{forced:#}");
    assert_eq!(
        v["cpu"]["fast_bf16_gemm"],
        lora_core::sys::cpu_has_fast_bf16_gemm(),
        "{v:#}"
    );
    // an unknown value: the default, and said to be ignored
    let o = bin()
        .arg("doctor")
        .env("LORA_CPU_F32_GEMM", "openblas")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(
        t.contains("\"openblas\" is not \"onednn\" or \"mkl\": ignored"),
        "{t}"
    );
    assert!(v["disk"]["free_bytes"].as_u64().unwrap() > 0, "{v:#}");
    // the GPU section is always there: devices with their memory, or a note saying why not
    let gpu = &v["gpu"];
    let devices = gpu["devices"].as_array().unwrap();
    if gpu["nvml"] == true && !devices.is_empty() {
        for d in devices {
            let total = d["total_bytes"].as_u64().unwrap();
            assert!(d["free_bytes"].as_u64().unwrap() <= total, "{v:#}");
        }
        assert!(gpu["driver_version"].is_string(), "{v:#}");
    } else {
        let note = gpu["note"].as_str().unwrap();
        assert!(note.contains("NVML"), "{note}");
        // and the text report says the same
        let t = bin().arg("doctor").output().unwrap();
        assert!(text(&t).contains(note), "{}", text(&t));
    }
}

#[test]
fn convert_round_trips_peft_kohya_peft_and_keeps_the_strength() {
    use lora_core::formats::{AdapterWeights, ModuleLora, peft};
    use lora_core::layer::SiteKind;
    use tch::{Kind, Tensor};
    tch::manual_seed(3);
    let mut w = AdapterWeights::default();
    for (site, out) in [
        ("model.layers.0.self_attn.q_proj", 576),
        ("model.layers.1.mlp.down_proj", 576),
    ] {
        let inp = if site.contains("down") { 1536 } else { 576 };
        w.modules.insert(
            site.to_string(),
            ModuleLora {
                kind: SiteKind::Linear,
                lora_a: Tensor::randn([8, inp], (Kind::Float, tch::Device::Cpu)),
                lora_b: Tensor::randn([out, 8], (Kind::Float, tch::Device::Cpu)),
                alpha: 16.0,
                magnitude: None,
            },
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let peft_dir = dir.path().join("peft");
    let template = lora_core::config::LoraConfig {
        base_model_name_or_path: Some("HuggingFaceTB/SmolLM2-135M-Instruct".into()),
        lora_dropout: 0.1,
        target_modules: Some(lora_core::config::TargetModules::List(vec![
            "q_proj".into(),
            "down_proj".into(),
        ])),
        task_type: Some("CAUSAL_LM".into()),
        ..Default::default()
    };
    peft::save(&w, Some(&template), &peft_dir).unwrap();
    let kohya = dir.path().join("k.safetensors");
    let o = bin()
        .args(["convert", "--to", "kohya", "--input"])
        .arg(&peft_dir)
        .arg("--output")
        .arg(&kohya)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    // The same command again would replace the file: refused (exit 2, file untouched) unless --force.
    let before = std::fs::read(&kohya).unwrap();
    let again = |force: bool| {
        let mut c = bin();
        c.args(["convert", "--to", "kohya", "--input"])
            .arg(&peft_dir)
            .arg("--output")
            .arg(&kohya);
        if force {
            c.arg("--force");
        }
        c.output().unwrap()
    };
    let o = again(false);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("already exists") && text(&o).contains("--force"),
        "{}",
        text(&o)
    );
    assert_eq!(std::fs::read(&kohya).unwrap(), before);
    assert_eq!(again(true).status.code(), Some(0));
    let back = dir.path().join("back");
    let o = bin()
        .args(["export", "--to", "peft", "--input"])
        .arg(&kohya)
        .arg("--output")
        .arg(&back)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let (cfg, w2) = peft::load(&back).unwrap();
    assert_eq!(cfg.task_type.as_deref(), Some("CAUSAL_LM"));
    // The PEFT settings survive the trip through the kohya file's metadata.
    assert_eq!(
        cfg.base_model_name_or_path.as_deref(),
        Some("HuggingFaceTB/SmolLM2-135M-Instruct")
    );
    assert_eq!(cfg.lora_dropout, 0.1);
    assert_eq!(cfg.target_modules, template.target_modules);
    let kohya_meta = lora_core::formats::kohya::read(&kohya).unwrap().metadata;
    assert_eq!(kohya_meta["ss_network_dropout"], "0.1");
    assert_eq!(
        kohya_meta["ss_sd_model_name"],
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    );
    assert_eq!(w2.modules.len(), 2);
    for (site, m) in &w.modules {
        let m2 = &w2.modules[site];
        let d1 = m.lora_b.matmul(&m.lora_a) * (m.alpha / 8.0);
        let d2 = m2.lora_b.matmul(&m2.lora_a) * (m2.alpha / m2.rank() as f64);
        let err = (d1 - d2).abs().max().double_value(&[]);
        assert!(err < 1e-5, "{site}: strength changed by {err}");
    }
    // not an adapter → usage error
    let o = bin()
        .args([
            "convert",
            "--to",
            "kohya",
            "--input",
            "/nonexistent",
            "--output",
        ])
        .arg(dir.path().join("x"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    // a text file given as the adapter: names it and says what an adapter is
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, "a caption, not weights\n").unwrap();
    let o = bin()
        .args(["convert", "--to", "kohya", "--input"])
        .arg(&notes)
        .arg("--output")
        .arg(dir.path().join("y.safetensors"))
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(
        t.contains("notes.txt: not an adapter (not a safetensors file")
            && t.contains("PEFT folder"),
        "{t}"
    );
    assert!(!dir.path().join("y.safetensors").exists());
}
