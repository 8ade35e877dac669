//! LoRA on an app's own tch model through the training engine alone:
//! `cargo run -p lora-examples --bin own_model [steps]`.

fn main() -> anyhow::Result<()> {
    let steps = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|_| anyhow::anyhow!("steps: expected a whole number, got {s:?}"))?,
        None => 200,
    };
    let (before, after, report) = lora_examples::own_model::run(steps)?;
    println!(
        "{} AdamW steps in {:.2} s: mean squared error {before:.5} → {after:.5}",
        report.steps, report.elapsed_s
    );
    Ok(())
}
