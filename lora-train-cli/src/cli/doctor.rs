//! `lora-train doctor`: what this machine offers a training run.
//!
//! Sources: libtorch's location from the loaded `libtorch_cpu.so` in `/proc/self/maps` and its
//! version from the wheel's `torch/version.py` (or libtorch's `build-version`); CUDA from tch;
//! GPU name / memory / driver from NVML (feature `nvml`); CPU from `/proc/cpuinfo`; RAM from
//! `/proc/meminfo` and the cgroup v2 `memory.max`; free disk from `df -Pk`.

use super::{CliError, EXIT_OK};
use std::path::{Path, PathBuf};

/// Runs `doctor`. Always exit 0 unless printing fails: missing pieces are reported, not errors.
pub fn run() -> Result<i32, CliError> {
    super::out(&report())?;
    Ok(EXIT_OK)
}

fn report() -> String {
    let mut out = String::new();
    // libtorch
    let cuda = tch::Cuda::is_available();
    let devices = tch::Cuda::device_count();
    out += "libtorch\n";
    out += "  tch crate: 0.26.0 (built for PyTorch 2.13.0)\n";
    match loaded_libtorch_dir() {
        Some(lib) => {
            let root = lib
                .parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| lib.clone());
            out += &format!("  path: {}\n", root.display());
            out += &format!(
                "  version: {}\n",
                libtorch_version(&root)
                    .unwrap_or_else(|| "unknown (no version.py / build-version)".into())
            );
        }
        None => out += "  path: not found in /proc/self/maps\n",
    }
    out += &format!("  threads: {} intra-op\n", tch::get_num_threads());
    out += &format!("  CUDA available: {cuda}\n");
    out += &format!("  CUDA devices: {devices}\n");
    out += &format!("  cuDNN available: {}\n", tch::Cuda::cudnn_is_available());
    // GPU
    out += "gpu\n";
    out += &gpu_report();
    // CPU
    out += "cpu\n";
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| {
            l.strip_prefix("model name")
                .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let logical = cpuinfo
        .lines()
        .filter(|l| l.starts_with("processor"))
        .count();
    let usable = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    out += &format!("  model: {model}\n");
    out += &format!("  logical cores: {logical} (usable by this process: {usable})\n");
    let flags = cpuinfo
        .lines()
        .find(|l| l.starts_with("flags"))
        .unwrap_or_default();
    let bf16 = ["avx512_bf16", "amx_bf16"]
        .iter()
        .filter(|f| flags.split_whitespace().any(|x| x == **f))
        .copied()
        .collect::<Vec<_>>();
    out += &format!(
        "  bf16 matmul support: {}\n",
        if bf16.is_empty() {
            "no AVX-512 BF16 / AMX (bf16 may be slower than fp32)".to_string()
        } else {
            bf16.join(", ")
        }
    );
    // RAM
    out += "memory\n";
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    for key in ["MemTotal", "MemAvailable"] {
        if let Some(kb) = meminfo_kb(&meminfo, key) {
            out += &format!("  {key}: {}\n", lora_memory::Bytes(kb * 1024));
        }
    }
    if let Ok(max) = std::fs::read_to_string("/sys/fs/cgroup/memory.max") {
        let max = max.trim();
        out += &format!(
            "  cgroup memory.max: {}\n",
            max.parse::<u64>()
                .map(|b| lora_memory::Bytes(b).to_string())
                .unwrap_or_else(|_| max.to_string())
        );
    }
    // disk
    out += "disk\n";
    let here = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    match free_disk(&here) {
        Some((avail, total)) => {
            out += &format!(
                "  {}: {} free of {}\n",
                here.display(),
                lora_memory::Bytes(avail),
                lora_memory::Bytes(total)
            )
        }
        None => out += &format!("  {}: unknown (df failed)\n", here.display()),
    }
    out
}

/// The folder of the `libtorch_cpu.so` this process loaded.
fn loaded_libtorch_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
}

fn libtorch_version(root: &Path) -> Option<String> {
    if let Ok(v) = std::fs::read_to_string(root.join("version.py")) {
        for l in v.lines() {
            if let Some(rest) = l.strip_prefix("__version__") {
                return Some(
                    rest.trim_start_matches([' ', '=', ':'])
                        .trim()
                        .trim_matches(['\'', '"'])
                        .to_string()
                        + " (version.py)",
                );
            }
        }
    }
    std::fs::read_to_string(root.join("build-version"))
        .ok()
        .map(|s| s.trim().to_string() + " (build-version)")
}

fn meminfo_kb(meminfo: &str, key: &str) -> Option<u64> {
    meminfo
        .lines()
        .find(|l| l.starts_with(key) && l[key.len()..].starts_with(':'))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

fn free_disk(dir: &Path) -> Option<(u64, u64)> {
    let out = std::process::Command::new("df")
        .arg("-Pk")
        .arg(dir)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().nth(1)?;
    let cols: Vec<&str> = line.split_whitespace().collect();
    let total: u64 = cols.get(1)?.parse().ok()?;
    let avail: u64 = cols.get(3)?.parse().ok()?;
    Some((avail * 1024, total * 1024))
}

#[cfg(feature = "nvml")]
fn gpu_report() -> String {
    use nvml_wrapper::Nvml;
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => return format!("  no NVIDIA GPU (NVML: {e})\n"),
    };
    let mut out = String::new();
    if let Ok(v) = nvml.sys_driver_version() {
        out += &format!("  driver: {v}\n");
    }
    if let Ok(v) = nvml.sys_cuda_driver_version() {
        out += &format!("  CUDA driver API: {}.{}\n", v / 1000, (v % 1000) / 10);
    }
    let count = nvml.device_count().unwrap_or(0);
    for i in 0..count {
        match nvml.device_by_index(i) {
            Ok(d) => {
                let name = d.name().unwrap_or_else(|_| "unknown".into());
                match d.memory_info() {
                    Ok(m) => {
                        out += &format!(
                            "  cuda:{i} {name}: total {}, free {}, used {}\n",
                            lora_memory::Bytes(m.total),
                            lora_memory::Bytes(m.free),
                            lora_memory::Bytes(m.used)
                        )
                    }
                    Err(e) => out += &format!("  cuda:{i} {name}: memory unknown ({e})\n"),
                }
            }
            Err(e) => out += &format!("  cuda:{i}: {e}\n"),
        }
    }
    if count == 0 {
        out += "  NVML found no devices\n";
    }
    out
}

#[cfg(not(feature = "nvml"))]
fn gpu_report() -> String {
    "  NVML: not built in (rebuild with `--features nvml` for GPU name, total/free memory and driver)\n".into()
}
