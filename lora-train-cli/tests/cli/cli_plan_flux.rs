//! `lora-train plan` and `train` on FLUX.1 configs written with kohya sd-scripts' names: the
//! FLUX report, the verdict on the cards of kohya's VRAM table, `--json` fields, and `train`'s
//! refusal of a preset name (training needs the weights).

use crate::{bin, text};
use std::path::{Path, PathBuf};
use std::process::Output;

fn write(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

fn run(cmd: &str, cfg: &Path, args: &[&str]) -> Output {
    bin()
        .args([cmd, "--config"])
        .arg(cfg)
        .args(args)
        .output()
        .unwrap()
}

/// kohya's FLUX.1 LoRA sample command at batch 1, as a config of sd-scripts' own names.
const KOHYA_FLUX: &str = "pretrained_model_name_or_path: flux1-dev\nnetwork_module: networks.lora_flux\n\
network_dim: 4\nnetwork_alpha: 1\nfp8_base: true\ngradient_checkpointing: true\n\
mixed_precision: bf16\noptimizer_type: AdamW8bit\nresolution: 1024\ntrain_batch_size: 1\n\
timestep_sampling: shift\ndiscrete_flow_shift: 3.1582\nguidance_scale: 1.0\n\
model_prediction_type: raw\noutput_dir: out\n";

#[test]
fn a_kohya_flux_config_plans_for_the_cards_of_kohyas_table() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "flux.yaml", KOHYA_FLUX);
    // 16 GiB: fits as written (kohya: "16GB VRAM GPUs with the batch size of 1")
    let o = run("plan", &cfg, &["--gpu", "RTX 4060 Ti 16GB"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let t = text(&o);
    for row in [
        "FLUX.1 LoRA",
        "transformer fp8",
        "4096 image tokens + 512 T5 tokens",
        "blocks_to_swap 0",
        "transformer weights",
        "transformer activations",
        "caching phase",
        "verdict: fits",
    ] {
        assert!(t.contains(row), "{row:?} missing:\n{t}");
    }
    for llm_row in ["seq_len", "logits", "Korthikanti"] {
        assert!(!t.contains(llm_row), "LLM row {llm_row:?}:\n{t}");
    }
    // 12 GiB: does not fit as written (exit 3); the suggestion swaps blocks
    let o = run("plan", &cfg, &["--gpu", "RTX 3060 12GB"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("blocks_to_swap 0 → 4"), "{}", text(&o));
    // ... and with kohya's setting for that card it fits
    let swapped = write(
        dir.path(),
        "flux12.yaml",
        &format!("{KOHYA_FLUX}blocks_to_swap: 16\n"),
    );
    let o = run("plan", &swapped, &["--gpu", "RTX 3060 12GB", "--json"]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let f = &j["estimate"]["flux"];
    assert_eq!(f["swapped_blocks"], serde_json::json!([8, 16]));
    assert_eq!(f["image_tokens"], 4096);
    assert_eq!(f["text_tokens"], 512);
    assert!(f["host_bytes"].as_u64().unwrap() > 4_900_000_000);
    assert_eq!(f["text_encoder_weights"], 0);
    assert_eq!(j["settings"]["base_dtype"], "fp8");
    assert_eq!(j["settings"]["blocks_to_swap"], 16);
}

#[test]
fn the_example_flux_config_plans() {
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/configs/flux-dev-kohya.toml");
    // its own card (24 GB): fits
    let o = run("plan", &cfg, &[]);
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    assert!(
        text(&o).contains("FLUX.1 LoRA") && text(&o).contains("LoRA r16"),
        "{}",
        text(&o)
    );
    // a 12 GB card: does not fit as written, and the suggestion swaps blocks
    let o = run("plan", &cfg, &["--gpu", "RTX 3060 12GB"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(text(&o).contains("blocks_to_swap"), "{}", text(&o));
}

#[test]
fn training_on_a_flux_preset_name_is_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = write(dir.path(), "flux.yaml", KOHYA_FLUX);
    let o = run("train", &cfg, &["--force"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("memory-planning preset") && text(&o).contains("flux.t5xxl"),
        "{}",
        text(&o)
    );
    // nothing was written
    assert!(!dir.path().join("out").exists());
    // a wrong value of a FLUX key names the key and the choices
    let bad = write(
        dir.path(),
        "bad.yaml",
        &KOHYA_FLUX.replace("timestep_sampling: shift", "timestep_sampling: sideways"),
    );
    let o = run("plan", &bad, &[]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("timestep_sampling") && text(&o).contains("flux_shift"),
        "{}",
        text(&o)
    );
}
