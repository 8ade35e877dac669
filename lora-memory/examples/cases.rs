//! Prints predicted vs measured peak memory for every public case (values in GB = 1e9 bytes),
//! with MAPE and the worst underprediction per group, then the verdicts on the published
//! fits / out-of-memory outcomes.
//!
//! Run: `cargo run -p lora-memory --example cases`; with case ids as arguments
//! (`… --example cases -- Q4q-256 Q4q-8192`) it prints those cases' term tables instead.

fn main() -> Result<(), lora_memory::Error> {
    let ids: Vec<String> = std::env::args().skip(1).collect();
    if !ids.is_empty() {
        for c in lora_memory::cases::public_cases() {
            if ids.iter().any(|i| *i == c.id) {
                let model = lora_memory::ModelDescriptor::preset(c.model)?;
                let e = lora_memory::estimate(&model, &c.settings)?;
                println!(
                    "{} ({}, measured {} as {:?}):",
                    c.id, c.model, c.measured, c.metric
                );
                println!("{}", e.to_table());
            }
        }
        return Ok(());
    }
    let results = lora_memory::cases::evaluate(&lora_memory::cases::public_cases())?;
    print!("{}", lora_memory::cases::report(&results));
    let boundaries =
        lora_memory::cases::evaluate_boundaries(&lora_memory::cases::boundary_cases())?;
    println!();
    print!("{}", lora_memory::cases::boundary_report(&boundaries));
    Ok(())
}
