//! `lora-train plan` on Stable Diffusion configs: routing (preset, diffusers folder,
//! `model.kind`), the SD report, `--budget` / `--gpu` exit codes, `--json` fields, and budget
//! values that are usage errors.

use crate::{bin, text};
use std::path::{Path, PathBuf};
use std::process::Output;

fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    if let Some(parent) = p.parent() {
        std::fs::create_dir_all(parent).unwrap();
    }
    std::fs::write(&p, body).unwrap();
    p
}

fn plan(cfg: &Path, args: &[&str]) -> Output {
    bin()
        .args(["plan", "--config"])
        .arg(cfg)
        .args(args)
        .output()
        .unwrap()
}

/// A safetensors file of zeros with the given f32 tensors (header format: u64 LE header length,
/// JSON header with `data_offsets`, raw data).
fn safetensors(path: &Path, tensors: &[(&str, &[u64])]) {
    let mut header = serde_json::Map::new();
    let mut off = 0u64;
    for (name, shape) in tensors {
        let n: u64 = shape.iter().product::<u64>() * 4;
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}),
        );
        off += n;
    }
    let h = serde_json::Value::Object(header).to_string();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.resize(bytes.len() + off as usize, 0);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// A diffusers SD 1.x folder with configs and weight headers only (the tiny pipeline's shapes).
fn diffusers_folder(root: &Path) {
    write(
        root,
        "model_index.json",
        r#"{"_class_name": "StableDiffusionPipeline"}"#,
    );
    write(
        root,
        "unet/config.json",
        r#"{"_class_name": "UNet2DConditionModel", "block_out_channels": [32, 64],
            "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"], "layers_per_block": 1,
            "attention_head_dim": 4, "cross_attention_dim": 32, "in_channels": 4}"#,
    );
    safetensors(
        &root.join("unet/diffusion_pytorch_model.safetensors"),
        &[("conv_in.weight", &[32, 4, 3, 3]), ("w", &[1000, 700])],
    );
    write(
        root,
        "vae/config.json",
        r#"{"block_out_channels": [32, 64], "latent_channels": 4}"#,
    );
    safetensors(
        &root.join("vae/diffusion_pytorch_model.safetensors"),
        &[("w", &[1000, 600])],
    );
    write(
        root,
        "text_encoder/config.json",
        r#"{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "max_position_embeddings": 77}"#,
    );
    safetensors(
        &root.join("text_encoder/model.safetensors"),
        &[("w", &[100, 400])],
    );
}

const SD15_1024_B4: &str = "model:\n  base_model: sd15\n  dtype: f16\ndata:\n  resolution: [1024, 1024]\ntrain:\n  batch_size: 4\n  mixed_precision: fp16\n";

#[test]
fn a_preset_sd_config_prints_the_sd_report_and_exits_3_when_it_does_not_fit() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "sd15.yaml", SD15_1024_B4);
    // "does SD 1.5 at 1024 px, batch 4 fit my 8 GB card?" — no download, no files
    let o = plan(&cfg, &["--budget", "cuda: 8GB"]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(3), "{t}");
    for row in [
        "Stable Diffusion LoRA",
        "image 1024×1024 px → latents 128×128",
        "micro_batch 4",
        "latents cached: yes",
        "text encoder: frozen, outputs cached",
        "UNet weights",
        "VAE weights",
        "text-encoder weights",
        "UNet activations",
        "text-encoder activations",
        "verdict: DOES NOT FIT",
        "would fit with",
    ] {
        assert!(t.contains(row), "{row:?} missing:\n{t}");
    }
    for llm_row in ["seq_len", "logits", "ids/labels", "Korthikanti"] {
        assert!(
            !t.contains(llm_row),
            "LLM row {llm_row:?} in the SD report:\n{t}"
        );
    }
    // a GPU preset and a large budget: fits, exit 0
    let o = plan(&cfg, &["--budget", "200GB"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("verdict: fits"), "{}", text(&o));
    let o = plan(&cfg, &["--gpu", "H100 80GB"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("device cuda"), "{}", text(&o));
    let o = plan(&cfg, &["--gpu", "RTX 3060"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
}

#[test]
fn plan_json_of_an_sd_config_has_the_diffusion_fields() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "sd15.yaml",
        &format!("{SD15_1024_B4}  train_text_encoder: true\n"),
    );
    let o = plan(&cfg, &["--json", "--budget", "cuda: 80GB"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let d = &j["estimate"]["diffusion"];
    assert_eq!(d["image_size"], serde_json::json!([1024, 1024]));
    assert_eq!(d["latent_size"], serde_json::json!([128, 128]));
    assert_eq!(d["images_per_micro_batch"], 4);
    // SD1.5: 859,520,964 UNet params in fp16; 83,653,863 VAE params kept loaded in 16 bit
    assert_eq!(d["unet_weights"], 1_719_041_928u64);
    assert_eq!(d["vae_weights"], 2 * 83_653_863u64);
    assert!(d["text_encoder_weights"].as_u64().unwrap() > 200_000_000);
    assert!(d["text_encoder_activations"].as_u64().unwrap() > 0);
    assert!(d["unet_activations"].as_u64().unwrap() > 1_000_000_000);
    let s = &j["settings"];
    assert_eq!(s["cache_latents"], true);
    assert_eq!(s["keep_models_loaded"], true);
    assert_eq!(s["train_text_encoder"], true);
    assert_eq!(s["cache_text_encoder_outputs"], false);
    assert_eq!(s["resolution"], 1024);
    assert_eq!(j["fits"], true);
    assert_eq!(j["estimate"]["breakdown"]["logits_loss"], 0);
}

#[test]
fn a_diffusers_folder_routes_to_the_sd_plan_with_or_without_model_kind() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("pipe");
    diffusers_folder(&root);
    for kind in ["", "  kind: sd15\n"] {
        let cfg = write(
            dir.path(),
            "tiny.yaml",
            &format!(
                "model:\n  base_model: pipe\n{kind}  dtype: f32\ndata:\n  resolution: [32, 32]\n  enable_bucket: false\ntrain:\n  batch_size: 4\nsystem:\n  device: cpu\n"
            ),
        );
        let o = plan(&cfg, &["--json"]);
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let d = &j["estimate"]["diffusion"];
        assert_eq!(
            d["latent_size"],
            serde_json::json!([16, 16]),
            "VAE factor 2"
        );
        assert_eq!(d["unet_weights"], (32 * 4 * 9 + 700_000) * 4);
        assert_eq!(d["vae_weights"], 600_000 * 4);
        assert_eq!(d["text_encoder_weights"], 40_000 * 4);
        assert_eq!(j["model"], "pipe");
        let o = plan(&cfg, &[]);
        let t = text(&o);
        assert!(
            t.contains("Stable Diffusion LoRA") && t.contains("latents 16×16"),
            "{t}"
        );
    }
}

#[test]
fn zero_and_unrepresentable_budgets_are_usage_errors_naming_the_value() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "sd15.yaml", SD15_1024_B4);
    for bad in ["0GB", "cuda: 0GB", "99999999TB", "1e30GB"] {
        let o = plan(&cfg, &["--budget", bad]);
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "--budget {bad}: {t}");
        let value = bad.rsplit(':').next().unwrap().trim();
        assert!(
            t.contains(value),
            "--budget {bad}: the message does not name it:\n{t}"
        );
    }
    // scientific notation is read as a size
    let o = plan(&cfg, &["--budget", "2e11"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
}

#[test]
fn train_on_an_sd_preset_is_a_usage_error_that_asks_for_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "preset.yaml",
        "model: {base_model: sd15}\ntrain: {output_dir: out}\n",
    );
    let o = bin()
        .args(["train", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("memory-planning preset"), "{t}");
    assert!(t.contains("diffusers folder"), "{t}");
    assert!(!dir.path().join("out").exists(), "nothing written: {t}");
}

#[test]
fn convert_names_stable_diffusion_adapters_instead_of_misreading_them() {
    let dir = tempfile::tempdir().unwrap();
    let kohya = dir.path().join("kohya.safetensors");
    safetensors(
        &kohya,
        &[
            (
                "lora_unet_mid_block_attentions_0_proj_in.lora_down.weight",
                &[4, 8],
            ),
            (
                "lora_unet_mid_block_attentions_0_proj_in.lora_up.weight",
                &[8, 4],
            ),
        ],
    );
    let diffusers = dir.path().join("pytorch_lora_weights.safetensors");
    safetensors(
        &diffusers,
        &[(
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight",
            &[4, 8],
        )],
    );
    for (input, layout) in [(&kohya, "kohya"), (&diffusers, "diffusers")] {
        let out = dir.path().join(format!("{layout}-out"));
        let o = bin()
            .args(["convert", "-i"])
            .arg(input)
            .args(["--to", "peft", "-o"])
            .arg(&out)
            .output()
            .unwrap();
        let t = text(&o);
        assert_eq!(o.status.code(), Some(2), "{t}");
        assert!(t.contains("a Stable Diffusion adapter"), "{t}");
        assert!(t.contains(layout), "{t}");
        assert!(!out.exists(), "{t}");
    }
}

#[test]
fn a_resolution_that_is_not_a_multiple_of_8_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "res.yaml",
        "model: {base_model: sd15}\ndata: {resolution: 500}\n",
    );
    let o = plan(&cfg, &[]);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(2), "{t}");
    assert!(t.contains("data.resolution"), "{t}");
    assert!(
        t.contains("504"),
        "the nearest multiple of 8 is suggested: {t}"
    );
}

fn train(cfg: &Path) -> Output {
    bin().args(["train", "--config"]).arg(cfg).output().unwrap()
}

/// The `error: …` line of a failed command.
fn error_line(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .find(|l| l.starts_with("error:"))
        .unwrap_or_default()
        .to_string()
}

/// A single-file SD 1.x checkpoint header (original LDM keys) with no tokenizer beside it.
fn sd15_single_file(path: &Path) {
    safetensors(
        path,
        &[
            (
                "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
                &[320, 768],
            ),
            (
                "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
                &[10, 8],
            ),
            ("first_stage_model.decoder.conv_in.weight", &[8, 4, 3, 3]),
        ],
    );
}

#[test]
fn a_target_module_that_is_no_unet_name_is_refused_by_plan_and_train_alike() {
    let dir = tempfile::tempdir().unwrap();
    diffusers_folder(&dir.path().join("pipe"));
    let config = |targets: &str| {
        write(
            dir.path(),
            "targets.yaml",
            &format!(
                "model:\n  base_model: pipe\nlora:\n  target_modules: {targets}\ndata:\n  train_data_dir: data\n  resolution: 32\n  enable_bucket: false\ntrain:\n  output_dir: {}\nsystem:\n  device: cpu\n",
                dir.path().join("out").display()
            ),
        )
    };
    let cfg = config("[q_proj]");
    let (p, t) = (plan(&cfg, &[]), train(&cfg));
    assert_eq!(p.status.code(), Some(2), "{}", text(&p));
    assert_eq!(t.status.code(), Some(2), "{}", text(&t));
    let e = error_line(&p);
    assert_eq!(e, error_line(&t), "plan and train say the same");
    for part in [
        "lora.target_modules",
        "\"q_proj\"",
        "to_q, to_k, to_v, to_out.0",
        "proj_in",
        "ff.net.0.proj",
        "ff.net.2",
        "conv1",
        "for q_proj write to_q",
        "train.train_text_encoder",
    ] {
        assert!(e.contains(part), "{part:?} missing: {e}");
    }
    // one short message, not the UNet's module list
    assert!(
        e.len() < 900 && !e.contains("down_blocks.0.resnets.0"),
        "{e}"
    );
    assert!(
        !dir.path().join("out").exists(),
        "nothing written: {}",
        text(&t)
    );
    // UNet names plan (LoCon convs and full paths included); a typo among them is named alone
    for ok in [
        "[to_q, to_out.0, conv1]",
        "[down_blocks.0.attentions.0.proj_in]",
    ] {
        let o = plan(&config(ok), &[]);
        assert_eq!(o.status.code(), Some(0), "{ok}: {}", text(&o));
    }
    let cfg = config("[to_q, to_out]");
    let (p, t) = (plan(&cfg, &[]), train(&cfg));
    assert_eq!((p.status.code(), t.status.code()), (Some(2), Some(2)));
    let e = error_line(&p);
    assert_eq!(e, error_line(&t));
    assert!(
        e.contains("[\"to_out\"] (in [\"to_q\", \"to_out\"])") && e.contains("write to_out.0"),
        "{e}"
    );
}

#[test]
fn a_single_file_without_a_tokenizer_is_refused_by_plan_and_train_alike() {
    let dir = tempfile::tempdir().unwrap();
    sd15_single_file(&dir.path().join("models/v1-5.safetensors"));
    let yaml = format!(
        "model:\n  base_model: models/v1-5.safetensors\ndata:\n  train_data_dir: data\n  resolution: 64\ntrain:\n  output_dir: {}\nsystem:\n  device: cpu\n",
        dir.path().join("out").display()
    );
    let cfg = write(dir.path(), "single.yaml", &yaml);
    let (p, t) = (plan(&cfg, &[]), train(&cfg));
    assert_eq!(p.status.code(), Some(2), "{}", text(&p));
    assert_eq!(t.status.code(), Some(2), "{}", text(&t));
    let e = error_line(&p);
    assert_eq!(e, error_line(&t), "plan and train say the same");
    for part in [
        "v1-5.safetensors",
        "holds no tokenizer",
        "set model.tokenizer",
        "vocab.json + merges.txt",
        "diffusers SD 1.5 folder",
    ] {
        assert!(e.contains(part), "{part:?} missing: {e}");
    }
    assert!(
        !dir.path().join("out").exists(),
        "nothing written: {}",
        text(&t)
    );
    // model.tokenizer that does not exist: named, exit 2
    let cfg = write(
        dir.path(),
        "missing.yaml",
        &yaml.replace("\ndata:", "\n  tokenizer: no-such-folder\ndata:"),
    );
    let o = plan(&cfg, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        error_line(&o).contains("model.tokenizer") && error_line(&o).contains("no-such-folder"),
        "{}",
        text(&o)
    );
    // a CLIP tokenizer beside the file: the plan goes on
    write(dir.path(), "models/tokenizer/vocab.json", "{}");
    write(dir.path(), "models/tokenizer/merges.txt", "");
    let o = plan(&write(dir.path(), "single.yaml", &yaml), &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("Stable Diffusion LoRA"), "{}", text(&o));
}

#[test]
fn model_kind_that_contradicts_the_base_is_refused_naming_both() {
    let dir = tempfile::tempdir().unwrap();
    // a planning preset: SD 1.5 is not planned silently for an SDXL run
    let cfg = write(
        dir.path(),
        "preset.yaml",
        "model: {base_model: sd15, kind: sdxl}\n",
    );
    let o = plan(&cfg, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let e = error_line(&o);
    for part in [
        "model.kind is sdxl",
        "\"sd15\"",
        "SD 1.5 planning preset",
        "base_model: sdxl",
        "model.kind: sd15",
    ] {
        assert!(e.contains(part), "{part:?} missing: {e}");
    }
    let cfg = write(
        dir.path(),
        "xl.yaml",
        "model: {base_model: sdxl, kind: sdxl}\n",
    );
    let o = plan(&cfg, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(text(&o).contains("plan: SDXL"), "{}", text(&o));
    // a diffusers SD 1.x folder with kind sdxl: plan and train refuse it the same way
    diffusers_folder(&dir.path().join("pipe"));
    let cfg = write(
        dir.path(),
        "folder.yaml",
        &format!(
            "model:\n  base_model: pipe\n  kind: sdxl\ndata:\n  train_data_dir: data\n  resolution: 32\ntrain:\n  output_dir: {}\nsystem:\n  device: cpu\n",
            dir.path().join("out").display()
        ),
    );
    let (p, t) = (plan(&cfg, &[]), train(&cfg));
    assert_eq!(p.status.code(), Some(2), "{}", text(&p));
    assert_eq!(t.status.code(), Some(2), "{}", text(&t));
    let e = error_line(&p);
    assert_eq!(e, error_line(&t));
    assert!(
        e.contains("model.kind is sdxl but this is an SD 1.x/2.x pipeline")
            && e.contains("model.kind: sd15 or auto"),
        "{e}"
    );
}

#[test]
fn the_budget_on_the_command_line_wins_over_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(
        dir.path(),
        "gpu.yaml",
        "model: {base_model: sd15}\ndata: {resolution: 512}\nmemory: {gpu: RTX 3060}\n",
    );
    let json = |args: &[&str]| {
        let o = plan(&cfg, &[&["--json"], args].concat());
        assert_eq!(o.status.code(), Some(0), "{}", text(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()
    };
    // the config alone: its GPU, on CUDA
    let j = json(&[]);
    assert!(
        j["settings"]["device"].get("cuda").is_some(),
        "{}",
        j["settings"]
    );
    assert_eq!(j["budget"]["bytes"], 12u64 << 30);
    // --budget with a device: that device and that budget
    let j = json(&["--budget", "cpu: 16GB"]);
    assert!(
        j["settings"]["device"].get("cpu").is_some(),
        "{}",
        j["settings"]
    );
    assert_eq!(j["budget"]["bytes"], 16_000_000_000u64);
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("replaces memory.gpu: RTX 3060") && notes.contains("planned for the CPU"),
        "{notes}"
    );
    let o = plan(&cfg, &["--budget", "cpu: 16GB"]);
    assert!(text(&o).contains("device cpu"), "{}", text(&o));
    // a size alone replaces the budget; the device stays the config's
    let j = json(&["--budget", "10GB"]);
    assert!(
        j["settings"]["device"].get("cuda").is_some(),
        "{}",
        j["settings"]
    );
    assert_eq!(j["budget"]["bytes"], 10_000_000_000u64);
    // the other way round: a CPU config (the same file, rewritten), a CUDA flag
    write(
        dir.path(),
        "gpu.yaml",
        "model: {base_model: sd15}\ndata: {resolution: 512}\nmemory: {budget: 64GB}\nsystem: {device: cpu}\n",
    );
    for flag in [["--budget", "cuda: 24GB"], ["--gpu", "RTX 4090"]] {
        let j = json(&flag);
        assert!(
            j["settings"]["device"].get("cuda").is_some(),
            "{flag:?}: {}",
            j["settings"]
        );
        assert_eq!(
            j["budget"]["bytes"],
            24u64
                * if flag[0] == "--gpu" {
                    1 << 30
                } else {
                    1_000_000_000
                }
        );
        assert!(
            j["notes"]
                .to_string()
                .contains("replaces memory.budget: 64GB"),
            "{}",
            j["notes"]
        );
    }
    // --help says so
    let o = bin().args(["plan", "--help"]).output().unwrap();
    let h = text(&o);
    assert!(h.contains("Wins over memory.gpu / memory.budget"), "{h}");
}

#[test]
fn a_decimal_budget_is_shown_in_both_units_with_a_hint_near_a_card_size() {
    let dir = tempfile::tempdir().unwrap();
    let sd = write(
        dir.path(),
        "sd15.yaml",
        "model: {base_model: sd15}\ndata: {resolution: 512}\n",
    );
    let llm = write(
        dir.path(),
        "llm.yaml",
        "model: {base_model: SmolLM2-135M}\n",
    );
    for cfg in [&sd, &llm] {
        let o = plan(cfg, &["--budget", "cuda: 8GB"]);
        let t = text(&o);
        let verdict = t
            .lines()
            .find(|l| l.starts_with("verdict:"))
            .unwrap_or_default();
        assert!(
            verdict.contains("budget 8.00 GB (7.45 GiB) (\"cuda: 8GB\")"),
            "{t}"
        );
        let hint = t
            .lines()
            .find(|l| l.starts_with("hint:"))
            .unwrap_or_default();
        for part in ["\"8 GB\" has 8 GiB = 8.59 GB", "--budget 8GiB", "--gpu"] {
            assert!(hint.contains(part), "{part:?} missing: {t}");
        }
        // written in GiB or as a card: binary first, no hint
        for args in [["--budget", "cuda: 8GiB"], ["--gpu", "RTX 4060"]] {
            let t = text(&plan(cfg, &args));
            assert!(t.contains("budget 8.00 GiB (8.59 GB)"), "{args:?}: {t}");
            assert!(!t.contains("hint:"), "{args:?}: {t}");
        }
        // far from any card size, or a CPU budget: no hint
        for b in ["cuda: 14.5GB", "cpu: 8GB"] {
            let t = text(&plan(cfg, &["--budget", b]));
            assert!(t.contains("verdict:") && !t.contains("hint:"), "{b}: {t}");
        }
    }
}

/// Bucket settings that cannot work are bad input (exit 2) naming the key; `plan` and the SD
/// job share the check (`sd_plan::check_sd_config`, run before any model loads).
#[test]
fn impossible_bucket_settings_are_usage_errors_before_anything_loads() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, key) in [
        (
            "min_bucket_reso: 128, max_bucket_reso: 64",
            "min_bucket_reso",
        ),
        ("bucket_reso_steps: 0", "bucket_reso_steps"),
    ] {
        let cfg = write(
            dir.path(),
            "b.yaml",
            &format!(
                "model: {{base_model: sd15}}\ndata: {{resolution: 64, enable_bucket: true, {extra}}}\ntrain: {{output_dir: out}}\n"
            ),
        );
        for cmd in ["plan"] {
            let o = bin().args([cmd, "--config"]).arg(&cfg).output().unwrap();
            let t = text(&o);
            assert_eq!(o.status.code(), Some(2), "{cmd} {extra}: {t}");
            assert!(
                t.contains(key) && t.contains("bucket settings"),
                "{cmd} {extra}: {t}"
            );
            assert!(!t.contains("loading "), "{t}");
        }
    }
}
