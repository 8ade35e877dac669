//! `lora-train plan` on Stable Diffusion configs: routing (preset, diffusers folder,
//! `model.kind`), the SD report, `--budget` / `--gpu` exit codes, `--json` fields, and budget
//! values that are usage errors.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lora-train"))
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

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
                "model:\n  base_model: pipe\n{kind}  dtype: f32\ndata:\n  resolution: [32, 32]\ntrain:\n  batch_size: 4\nsystem:\n  device: cpu\n"
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
