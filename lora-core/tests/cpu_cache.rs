//! The counting allocator's cache of freed blocks (`lora_core::sys::set_cpu_cache`): a freed
//! block of 128 KiB or more is handed out again for its size, the cache stays within the live
//! peak, and a repeated allocation pattern stops faulting pages in. One test in this file: the
//! allocator is process-wide, so no other test may allocate meanwhile.

use lora_core::sys;
use tch::{Device, Kind, Tensor};

/// Minor page faults of this process so far (`getrusage`).
fn minor_faults() -> i64 {
    // SAFETY: `getrusage` fills the zeroed struct we own.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    u.ru_minflt
}

fn floats(n: i64) -> Tensor {
    Tensor::ones([n], (Kind::Float, Device::Cpu))
}

/// Allocates and frees what one "step" does: four 8 MiB blocks alive at once, filled.
fn step() {
    let t: Vec<Tensor> = (0..4).map(|_| floats(2 << 20)).collect();
    assert_eq!(t.len(), 4);
}

#[test]
fn freed_blocks_are_reused_within_the_live_peak() {
    const MIB: u64 = 1 << 20;
    sys::install_counting_cpu_allocator().unwrap();
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        // as `lora-train train` sets it: every block of 128 KiB or more is mapped on its own
        assert!(sys::set_malloc_mmap_threshold(
            sys::RETURN_FREED_MMAP_THRESHOLD
        ));
    }

    // Off (the default): every step maps its blocks afresh and faults each page in.
    let f0 = minor_faults();
    for _ in 0..4 {
        step();
    }
    let faults_off = minor_faults() - f0;
    assert!(
        faults_off >= 3 * 4 * 2048,
        "{faults_off} faults for 4 steps of 32 MiB without the cache"
    );

    sys::set_cpu_cache(true).unwrap();
    sys::cpu_empty_cache().unwrap();
    let s0 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s0.cached_bytes, 0);

    // A freed 4 MiB block is cached, outside the live bytes, and the next 4 MiB tensor gets it.
    let t = floats(1 << 20);
    let ptr = t.data_ptr();
    drop(t);
    let s1 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s1.current_bytes, s0.current_bytes);
    assert_eq!(s1.cached_bytes, 4 * MIB);
    let u = floats(1 << 20);
    assert_eq!(u.data_ptr(), ptr);
    let s2 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s2.cache_hits, s1.cache_hits + 1);
    assert_eq!(s2.cached_bytes, 0);
    assert_eq!(s2.current_bytes, s0.current_bytes + 4 * MIB);
    drop(u);

    // The bound: the live peak since emptying is live + 4 MiB. A 2 MiB tensor the cache cannot
    // serve would hold 6 MiB with the cached block, so the cached block is freed first.
    let v = floats(1 << 19);
    let s3 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s3.cached_bytes, 0);
    assert_eq!(s3.cache_evictions, s2.cache_evictions + 1);
    drop(v);
    assert_eq!(sys::cpu_mem_stats().unwrap().cached_bytes, 2 * MIB);

    // Small blocks go back to glibc.
    drop(floats(1000));
    assert_eq!(sys::cpu_mem_stats().unwrap().cached_bytes, 2 * MIB);

    // On: after the first step fills the cache, steps reuse its blocks and fault nothing in.
    step();
    let hits = sys::cpu_mem_stats().unwrap().cache_hits;
    let f1 = minor_faults();
    for _ in 0..4 {
        step();
    }
    let faults_on = minor_faults() - f1;
    let s4 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s4.cache_hits, hits + 16);
    assert!(
        faults_on * 20 < faults_off,
        "{faults_on} faults for 4 steps with the cache, {faults_off} without"
    );
    // live + cached never above the live peak: the four blocks of one step
    assert_eq!(s4.cached_bytes, 32 * MIB);

    // Off again: the cache is emptied.
    sys::set_cpu_cache(false).unwrap();
    assert_eq!(sys::cpu_mem_stats().unwrap().cached_bytes, 0);
}
