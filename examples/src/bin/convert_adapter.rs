//! Convert a LoRA adapter PEFT → kohya → PEFT and check that nothing changed on the way.
//!
//! ```sh
//! cargo run -p lora-examples --release --bin convert_adapter -- [PEFT_FOLDER] [OUTPUT_DIR]
//! # defaults: output/examples/finetune_smollm2/smollm2-macbeth (run finetune_smollm2 first)
//! #           output/examples/convert_adapter
//! ```
//!
//! A PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, `lora_A`/`lora_B`) is
//! what transformers/PEFT load; a kohya file (`lora_down`/`lora_up`/`alpha` in one
//! `.safetensors`) is what kohya-style tools and ComfyUI/A1111 load. The conversion keeps each
//! module's strength `scaling · B·A` and the PEFT config (it travels in the kohya file's
//! metadata), so the round trip gives the same adapter.

use anyhow::{Context, Result, bail};
use lora_train::config::ExportFormat;
use lora_train::core::formats::peft;
use lora_train::export::convert;
use std::path::PathBuf;

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let input = PathBuf::from(
        args.first()
            .map(String::as_str)
            .unwrap_or("output/examples/finetune_smollm2/smollm2-macbeth"),
    );
    let out = PathBuf::from(
        args.get(1)
            .map(String::as_str)
            .unwrap_or("output/examples/convert_adapter"),
    );
    if !input.exists() {
        bail!("{}: no such file or folder", input.display());
    }
    if !input.join("adapter_config.json").is_file() {
        bail!(
            "{}: not a PEFT adapter folder (no adapter_config.json); run the finetune_smollm2 example first or pass one",
            input.display()
        );
    }
    if out.exists() && !out.is_dir() {
        bail!(
            "{}: a file of that name exists; pass another OUTPUT_DIR (nothing was changed)",
            out.display()
        );
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;

    let kohya = out.join("adapter-kohya.safetensors");
    let back = out.join("adapter-peft");
    for p in [&kohya, &back] {
        if p.is_dir() {
            std::fs::remove_dir_all(p)?;
        } else if p.exists() {
            std::fs::remove_file(p)?;
        }
    }
    let n = convert(&input, ExportFormat::Kohya, &kohya)?;
    println!("{} → {} ({n} modules)", input.display(), kohya.display());
    let n = convert(&kohya, ExportFormat::Peft, &back)?;
    println!("{} → {} ({n} modules)", kohya.display(), back.display());

    // the round trip: same config, same modules, same tensors
    let (cfg_a, a) = peft::load(&input)?;
    let (cfg_b, b) = peft::load(&back)?;
    if (cfg_a.r, cfg_a.lora_alpha) != (cfg_b.r, cfg_b.lora_alpha) {
        bail!(
            "r / lora_alpha changed: {}/{} → {}/{}",
            cfg_a.r,
            cfg_a.lora_alpha,
            cfg_b.r,
            cfg_b.lora_alpha
        );
    }
    let mut worst = 0f64;
    for (name, m) in &a.modules {
        let m2 = b
            .modules
            .get(name)
            .with_context(|| format!("module {name} lost on the way"))?;
        for (x, y) in [(&m.lora_a, &m2.lora_a), (&m.lora_b, &m2.lora_b)] {
            let d = (x - y).f_abs()?.f_max()?.f_double_value(&[])?;
            worst = worst.max(d);
        }
    }
    println!(
        "round trip: r={} lora_alpha={}, {} modules, largest difference {worst:e}",
        cfg_b.r,
        cfg_b.lora_alpha,
        b.modules.len()
    );
    if a.modules.len() != b.modules.len() || worst > 0.0 {
        bail!("the round trip changed the adapter");
    }
    Ok(())
}
