//! Compares lora-memory's CUDA predictions with allocator peaks measured on a GPU by
//! `benches/gpu/mem_check.py` (PEFT + transformers, the runs of `benches/gpu/mem_configs.json`).
//!
//! Run: `cargo run -p lora-memory --example gpu_check -- measured.json`

use lora_memory::{BaseDtype, Bytes, ModelDescriptor, Profile, Settings, estimate};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .ok_or("usage: gpu_check MEASURED.json (written by benches/gpu/mem_check.py)")?;
    let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let results = v["results"]
        .as_array()
        .ok_or("no `results` array: did mem_check.py run on a GPU?")?;
    println!(
        "{:<4} {:<13} {:>5} {:>3}×{:<5} {:>5} | {:>9} {:>9} {:>7} | {:>9} {:>9} {:>7}",
        "id",
        "model",
        "dtype",
        "b",
        "seq",
        "ckpt",
        "alloc GB",
        "pred",
        "err",
        "resv GB",
        "pred",
        "err"
    );
    let (mut abs_err, mut worst, mut n) = (0.0f64, 0.0f64, 0usize);
    for r in results {
        if let Some(e) = r.get("error") {
            println!(
                "{}: failed: {}",
                r["id"],
                e.as_str().unwrap_or("").lines().last().unwrap_or("")
            );
            continue;
        }
        let model = ModelDescriptor::preset(r["model"].as_str().ok_or("model")?)?;
        let dtype = match r["dtype"].as_str() {
            Some("fp32") => BaseDtype::F32,
            _ => BaseDtype::Bf16,
        };
        let s = Settings::default()
            .with_target_modules(&["q_proj", "k_proj", "v_proj", "o_proj"])
            .with_rank(8)
            .with_alpha(16.0)
            .with_lora_dropout(0.0)
            .with_base_dtype(dtype)
            .with_micro_batch(r["batch"].as_u64().ok_or("batch")? as u32)
            .with_seq_len(r["seq"].as_u64().ok_or("seq")? as u32)
            .with_gradient_checkpointing(r["checkpointing"].as_bool().unwrap_or(false))
            .with_profile(Profile::peft_transformers());
        let e = estimate(&model, &s)?;
        let ma = r["max_allocated"].as_f64().ok_or("max_allocated")?;
        let mr = r["max_reserved"].as_f64().ok_or("max_reserved")?;
        let ea = (e.peak_allocated.0 as f64 - ma) / ma;
        let er = (e.peak_reserved.0 as f64 - mr) / mr;
        for x in [ea, er] {
            abs_err += x.abs();
            worst = worst.min(x);
            n += 1;
        }
        println!(
            "{:<4} {:<13} {:>5} {:>3}×{:<5} {:>5} | {:>9.3} {:>9.3} {:>+6.1}% | {:>9.3} {:>9.3} {:>+6.1}%",
            r["id"].as_str().unwrap_or("?"),
            r["model"].as_str().unwrap_or("?"),
            r["dtype"].as_str().unwrap_or("?"),
            r["batch"],
            r["seq"],
            r["checkpointing"],
            Bytes(ma as u64).gb(),
            e.peak_allocated.gb(),
            ea * 100.0,
            Bytes(mr as u64).gb(),
            e.peak_reserved.gb(),
            er * 100.0
        );
    }
    if n > 0 {
        println!(
            "MAPE {:.1}% over {n} values; worst underprediction {:+.1}%",
            abs_err / n as f64 * 100.0,
            worst * 100.0
        );
    }
    Ok(())
}
