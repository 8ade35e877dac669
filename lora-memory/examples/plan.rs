//! Prints the plan table of one public case (or all with no argument).
//!
//! Run: `cargo run -p lora-memory --example plan -- P1`

fn main() -> Result<(), lora_memory::Error> {
    let want = std::env::args().nth(1);
    for c in lora_memory::cases::public_cases() {
        if want.as_deref().is_some_and(|w| w != c.id) {
            continue;
        }
        let m = lora_memory::ModelDescriptor::preset(c.model)?;
        let e = lora_memory::estimate(&m, &c.settings)?;
        println!(
            "== {} ({:?} measured {:.3} GB)\n{}",
            c.id,
            c.metric,
            c.measured.gb(),
            e.to_table()
        );
    }
    Ok(())
}
