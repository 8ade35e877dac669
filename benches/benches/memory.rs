// Criterion benches of the memory planner: one `estimate` (target < 50 µs) and one whole `fit`
// walking the ladder (target < 5 ms).
//
// Also built as `lora-memory`'s own bench (`cargo bench -p lora-memory --bench memory`), which
// needs no libtorch.

use criterion::{Criterion, criterion_group, criterion_main};
use lora_memory::{
    Bytes, ModelDescriptor, Settings, estimate, fit, frontier, frontier_cards, max_micro_batch,
};
use std::hint::black_box;

fn benches(c: &mut Criterion) {
    let llama = ModelDescriptor::preset("Llama-3.1-8B").expect("preset");
    let sdxl = ModelDescriptor::preset("SDXL").expect("preset");
    let s = Settings::default().with_micro_batch(8).with_seq_len(2048);
    let sd = Settings::default()
        .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
        .with_resolution(1024)
        .with_micro_batch(4);
    c.bench_function("estimate/llama-3.1-8b", |b| {
        b.iter(|| estimate(black_box(&llama), black_box(&s)))
    });
    c.bench_function("estimate/sdxl", |b| {
        b.iter(|| estimate(black_box(&sdxl), black_box(&sd)))
    });
    // 6 GiB forces most of the ladder (down to NF4 and shorter sequences).
    c.bench_function("fit/llama-3.1-8b-into-6GiB", |b| {
        b.iter(|| fit(black_box(&llama), black_box(&s), Bytes(6 << 30)))
    });
    c.bench_function("fit/sdxl-into-8GiB", |b| {
        b.iter(|| fit(black_box(&sdxl), black_box(&sd), Bytes(8 << 30)))
    });
    c.bench_function("max_micro_batch/llama-3.1-8b-80GiB", |b| {
        b.iter(|| max_micro_batch(black_box(&llama), black_box(&s), Bytes(80 << 30)))
    });
    // `plan --frontier`: longest sequence and largest batch on seven cards.
    let cards = frontier_cards();
    c.bench_function("frontier/llama-3.1-8b-7-cards", |b| {
        b.iter(|| frontier(black_box(&llama), black_box(&s), black_box(&cards)))
    });
}

criterion_group!(memory, benches);
criterion_main!(memory);
