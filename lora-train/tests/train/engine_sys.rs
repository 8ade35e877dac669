//! The libtorch shim's process-global parts, in their own process: exact CPU tensor bytes and
//! the allocation limit, RNG state round trip, deterministic switch.

use lora_core::sys;
use tch::{Device, Kind, Tensor};

#[test]
fn shim_global_state() {
    let _serial = crate::serial();
    // Counting allocator: exact bytes for a fresh tensor, back to the same count after drop.
    sys::install_counting_cpu_allocator().unwrap();
    let s0 = sys::cpu_mem_stats().unwrap();
    let t = Tensor::zeros([1_000_000], (Kind::Float, Device::Cpu));
    let s1 = sys::cpu_mem_stats().unwrap();
    assert_eq!(s1.current_bytes - s0.current_bytes, 4_000_000);
    assert!(s1.peak_bytes >= s0.current_bytes + 4_000_000);
    drop(t);
    assert_eq!(
        sys::cpu_mem_stats().unwrap().current_bytes,
        s0.current_bytes
    );
    sys::cpu_reset_peak().unwrap();
    assert_eq!(sys::cpu_mem_stats().unwrap().peak_bytes, s0.current_bytes);

    // Limit: an allocation over it fails like an OOM, smaller ones work, clearing restores.
    {
        let _limit = sys::CpuAllocLimitGuard::new(s0.current_bytes + (8 << 20)).unwrap();
        let err = Tensor::f_zeros([4 << 20], (Kind::Float, Device::Cpu)).unwrap_err();
        assert!(
            err.to_string()
                .contains("DefaultCPUAllocator: can't allocate memory"),
            "{err}"
        );
        assert!(Tensor::f_zeros([1 << 20], (Kind::Float, Device::Cpu)).is_ok());
    }
    assert_eq!(sys::cpu_mem_stats().unwrap().limit_bytes, None);
    assert!(Tensor::f_zeros([4 << 20], (Kind::Float, Device::Cpu)).is_ok());

    // RNG state.
    sys::manual_seed(1234).unwrap();
    let state = sys::rng_state(Device::Cpu).unwrap();
    assert_eq!(state.len(), 5056, "mt19937 CPU generator state size");
    let a = Tensor::randn([16], (Kind::Float, Device::Cpu));
    let _ = Tensor::randn([7], (Kind::Float, Device::Cpu));
    sys::set_rng_state(Device::Cpu, &state).unwrap();
    let b = Tensor::randn([16], (Kind::Float, Device::Cpu));
    assert!(a.equal(&b));
    assert!(sys::set_rng_state(Device::Cpu, &[1, 2, 3]).is_err());

    // Deterministic algorithms switch.
    sys::set_deterministic(true, false).unwrap();
    assert!(sys::deterministic().unwrap());
    sys::set_deterministic(false, false).unwrap();
    assert!(!sys::deterministic().unwrap());

    // glibc's mmap threshold, fixed at 128 KiB: freed large blocks leave the process even when
    // small live blocks sit between them (glibc's default dynamic threshold, raised to 16 MiB
    // by the frees above, would serve the 8 MiB blocks from the heap and keep the holes).
    if cfg!(all(target_os = "linux", target_env = "gnu")) {
        assert!(sys::set_malloc_mmap_threshold(
            sys::RETURN_FREED_MMAP_THRESHOLD
        ));
        let mut big = Vec::new();
        let mut small = Vec::new();
        for _ in 0..24 {
            big.push(Tensor::ones([2 << 20], (Kind::Float, Device::Cpu))); // 8 MiB
            small.push(Tensor::ones([16 << 10], (Kind::Float, Device::Cpu))); // 64 KiB
        }
        let with_big = vm_rss();
        drop(big);
        let after = vm_rss();
        let released = with_big.saturating_sub(after);
        assert!(
            released >= 160 << 20,
            "only {released} of 192 MiB freed went back to the OS (RSS {with_big} → {after})"
        );
        drop(small);
    }
}

/// `VmRSS` of this process, bytes.
fn vm_rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kb: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kb * 1024
}
