//! Runs the examples as a user would (from the repository root) and checks what they print and
//! write. `own_model` is checked by the library's own test.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("examples/ sits in the repository")
        .to_path_buf()
}

/// Runs an example binary from the repository root; panics with its output when it fails.
fn run(bin: &str, args: &[&str]) -> String {
    let out = Command::new(bin)
        .args(args)
        .current_dir(repo_root())
        .env("OMP_NUM_THREADS", "2")
        .output()
        .expect("the example starts");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{bin} {args:?} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout
}

#[test]
fn plan_fit_fits_a_batch_that_does_not_fit() {
    let out = run(env!("CARGO_BIN_EXE_plan_fit"), &[]);
    assert!(
        out.contains("on GTX 1060 6GB: batch 64 × 2048 tokens"),
        "{out}"
    );
    assert!(out.contains("does not fit"), "{out}");
    // the ladder halves the micro-batch and doubles accumulation: the effective batch stays 64
    assert!(out.contains("64 × 1 → 32 × 2"), "{out}");
    let last = out.lines().last().unwrap_or("");
    assert!(
        last.starts_with("fitted:") && last.contains("(fits)"),
        "{out}"
    );
    assert!(last.contains("batch 1 with 64 accumulation steps"), "{out}");
}

#[test]
fn finetune_then_convert_round_trips_the_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("ft");
    let out = run(
        env!("CARGO_BIN_EXE_finetune_smollm2"),
        &["3", run_dir.to_str().unwrap()],
    );
    // the app's own callback saw every step
    for step in 1..=3 {
        assert!(out.contains(&format!("step {step:>3}: loss ")), "{out}");
    }
    assert!(out.contains("held-out perplexity"), "{out}");
    assert!(out.contains("3 steps in"), "{out}");
    let peft = run_dir.join("smollm2-macbeth");
    assert!(peft.join("adapter_model.safetensors").is_file());
    assert!(run_dir.join("smollm2-macbeth.safetensors").is_file());

    let conv = dir.path().join("conv");
    let out = run(
        env!("CARGO_BIN_EXE_convert_adapter"),
        &[peft.to_str().unwrap(), conv.to_str().unwrap()],
    );
    // q/k/v/o of SmolLM2-135M's 30 layers
    assert!(out.contains("(120 modules)"), "{out}");
    assert!(
        out.contains("round trip: r=8 lora_alpha=16, 120 modules, largest difference 0e0"),
        "{out}"
    );
}

#[test]
fn tag_folder_writes_a_caption_per_image() {
    let dir = tempfile::tempdir().unwrap();
    let assets = PathBuf::from(std::env::var("LORA_SDK_ASSETS").unwrap_or("assets".into()));
    let assets = if assets.is_absolute() {
        assets
    } else {
        repo_root().join(assets)
    };
    for name in ["coffee.png", "chelsea.png"] {
        std::fs::copy(assets.join("skimage").join(name), dir.path().join(name)).unwrap();
    }
    let out = run(
        env!("CARGO_BIN_EXE_tag_folder"),
        &[dir.path().to_str().unwrap()],
    );
    assert!(out.contains("2 of 2 images tagged"), "{out}");
    let coffee = std::fs::read_to_string(dir.path().join("coffee.txt")).unwrap();
    assert!(coffee.starts_with("espresso"), "coffee.txt: {coffee:?}");
    let cat = std::fs::read_to_string(dir.path().join("chelsea.txt")).unwrap();
    assert!(
        cat.contains("cat") || cat.contains("tabby"),
        "chelsea.txt: {cat:?}"
    );
}

#[test]
fn sd_lora_trains_the_tiny_pipeline() {
    let dir = tempfile::tempdir().unwrap();
    let python = std::env::var("LORA_SDK_PYTHON").unwrap_or("python3".into());
    let assets = std::env::var("LORA_SDK_ASSETS").unwrap_or("assets".into());
    let made = Command::new(&python)
        .arg("lora-train/tests/sd_interop/make_pipeline.py")
        .args(["--assets", &assets, "--out"])
        .arg(dir.path().join("sd-tiny"))
        .current_dir(repo_root())
        .output()
        .expect("python starts");
    assert!(
        made.status.success(),
        "make_pipeline.py: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let sd = dir.path().join("sd-tiny");
    let out_dir = dir.path().join("run");
    let out = run(
        env!("CARGO_BIN_EXE_sd_lora"),
        &[
            sd.join("pipeline").to_str().unwrap(),
            sd.join("data").to_str().unwrap(),
            "4",
            out_dir.to_str().unwrap(),
        ],
    );
    // 16 emoji with 2 repeats, one 32×32 bucket, 4 steps
    assert!(
        out.contains("16 images (32 items) in buckets [((32, 32), 4)]; 4 steps"),
        "{out}"
    );
    assert!(out.contains("16 VAE encodings"), "{out}");
    assert!(out_dir.join("emoji-tiny.safetensors").is_file());
    assert!(
        out_dir
            .join("emoji-tiny/pytorch_lora_weights.safetensors")
            .is_file()
    );
    assert!(out_dir.join("samples/step-4.png").is_file());
}
