//! Prints predicted vs measured peak memory for every public case (values in GB = 1e9 bytes),
//! with MAPE and the worst underprediction per group, then the verdicts on the published
//! fits / out-of-memory outcomes.
//!
//! Run: `cargo run -p lora-memory --example cases`

fn main() -> Result<(), lora_memory::Error> {
    let results = lora_memory::cases::evaluate(&lora_memory::cases::public_cases())?;
    print!("{}", lora_memory::cases::report(&results));
    let boundaries =
        lora_memory::cases::evaluate_boundaries(&lora_memory::cases::boundary_cases())?;
    println!();
    print!("{}", lora_memory::cases::boundary_report(&boundaries));
    Ok(())
}
