//! The planner benches without libtorch: the same source as `benches/benches/memory.rs`.
include!("../../benches/benches/memory.rs");
