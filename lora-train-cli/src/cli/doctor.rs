//! `lora-train doctor`: what this machine offers a training run, as text or JSON.
//!
//! Sources: libtorch's location from the loaded `libtorch_cpu.so` in `/proc/self/maps` and its
//! version from the wheel's `torch/version.py` (or libtorch's `build-version`); CUDA from tch;
//! GPU name / memory / driver from NVML, loaded from the driver at run time (feature `nvml`, on
//! by default; a machine without the driver says so); CPU from `/proc/cpuinfo`; RAM from
//! `/proc/meminfo` and the cgroup v2 `memory.max`; free disk from `df -Pk`.

use super::{CliError, EXIT_OK};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// The PyTorch version of the libtorch this binary was linked against (set by `build.rs`).
const BUILT_FOR_PYTORCH: &str = env!("LORA_BUILT_FOR_PYTORCH");

/// Set by the bundle's `lora-train` launcher to say where it found libtorch.
const FOUND_VIA_VAR: &str = "LORA_LIBTORCH_FOUND_VIA";

/// Runs `doctor`; `json` prints the report as one JSON object instead of text. Always exit 0
/// unless printing fails: missing pieces are reported, not errors.
pub fn run(json: bool) -> Result<i32, CliError> {
    let r = Report::gather();
    if json {
        let text = serde_json::to_string_pretty(&r)
            .map_err(|e| CliError::runtime(format!("encoding the report as JSON: {e}")))?;
        super::outln(text)?;
    } else {
        super::out(&r.text())?;
    }
    Ok(EXIT_OK)
}

/// Everything `doctor` reports. Sizes are bytes; `None` is "could not be read".
#[derive(Debug, Serialize)]
struct Report {
    libtorch: Libtorch,
    gpu: Gpu,
    cpu: Cpu,
    memory: Memory,
    disk: Disk,
}

#[derive(Debug, Serialize)]
struct Libtorch {
    tch_version: &'static str,
    /// The PyTorch version of the libtorch this binary was built against (its `version.py` or
    /// `build-version` at build time).
    built_for_pytorch: &'static str,
    /// How the bundle's launcher found libtorch (`LIBTORCH`, `python3`, `beside the bundle`);
    /// `None` when the binary was started directly (its rpath or `LD_LIBRARY_PATH` decided).
    found_via: Option<String>,
    path: Option<PathBuf>,
    /// Version and where it was read (`version.py` or `build-version`).
    version: Option<String>,
    version_source: Option<&'static str>,
    intra_op_threads: i32,
    cuda_available: bool,
    cuda_devices: i64,
    cudnn_available: bool,
}

#[derive(Debug, Serialize)]
struct Gpu {
    /// NVML could be loaded and initialised.
    nvml: bool,
    /// Why there is no GPU information (no driver, NVML not built in, …).
    note: Option<String>,
    driver_version: Option<String>,
    /// The CUDA version the driver supports, `major.minor`.
    cuda_driver_version: Option<String>,
    devices: Vec<GpuDevice>,
}

#[derive(Debug, Serialize)]
struct GpuDevice {
    index: u32,
    name: Option<String>,
    total_bytes: Option<u64>,
    free_bytes: Option<u64>,
    used_bytes: Option<u64>,
    /// Set when the device or its memory could not be queried.
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct Cpu {
    model: String,
    logical_cores: usize,
    usable_cores: usize,
    /// `avx512_bf16` / `amx_bf16` when present (native bf16 dot products).
    bf16_flags: Vec<String>,
    /// libtorch multiplies bf16 matrices with oneDNN's vectorized kernels here
    /// (`lora_core::sys::cpu_has_fast_bf16_gemm`, the test training uses); where false, bf16
    /// products are computed by f32 GEMMs.
    fast_bf16_gemm: bool,
    /// What multiplies f32 matrices on the CPU: `onednn` or `mkl`
    /// (`lora_core::sys::cpu_f32_gemm_by_onednn`).
    f32_gemm: &'static str,
    /// `LORA_CPU_F32_GEMM` as set, when set and not empty.
    f32_gemm_env: Option<String>,
    /// `LORA_CPU_F32_GEMM` is set to something other than `onednn` / `mkl` (any case): ignored.
    f32_gemm_env_ignored: bool,
    /// What computes causal f32 attention of up to 512 positions on the CPU: lora-core's kernel
    /// (`lora_core::sys::cpu_causal_attention_by_lsdk`) or libtorch's flash kernel;
    /// `LORA_CPU_ATTENTION`.
    cpu_attention: CpuKernel,
    /// What computes the LoRA branches of f32 linears on the CPU: lora-core's op
    /// (`lora_core::sys::cpu_lora_branch_by_lsdk`) or libtorch's GEMMs; `LORA_CPU_LORA`.
    cpu_lora: CpuKernel,
}

/// One of lora-core's CPU kernels against libtorch's own ops, and the environment variable that
/// chooses between them.
#[derive(Debug, Serialize)]
struct CpuKernel {
    /// `lsdk` (lora-core's kernel) or `libtorch`.
    choice: &'static str,
    /// The variable as set, when set and not empty.
    env: Option<String>,
    /// The variable is set to something other than `lsdk` / `libtorch`, or asks for `lsdk`
    /// where the kernel is not available (no AVX2/FMA): ignored.
    env_ignored: bool,
    /// The kernel exists for this build and CPU (AVX2 and FMA).
    available: bool,
}

impl CpuKernel {
    fn gather(
        var: &str,
        request: lora_core::sys::CpuKernelRequest,
        chosen: bool,
        available: bool,
    ) -> CpuKernel {
        CpuKernel {
            choice: if chosen { "lsdk" } else { "libtorch" },
            // as the request reads it (lossily for a value that is no UTF-8)
            env: std::env::var_os(var)
                .map(|v| v.to_string_lossy().into_owned())
                .filter(|v| !v.trim().is_empty()),
            env_ignored: request.warning(var, available).is_some(),
            available,
        }
    }

    /// `  {what}: {lora-core's or libtorch's} ({why})` and a newline.
    fn line(&self, what: &str, var: &str, lsdk: &str, libtorch: &str) -> String {
        let why = match &self.env {
            Some(v) if self.env_ignored && self.available => {
                format!("{var}={v:?} is not \"lsdk\" or \"libtorch\": ignored, the CPU's default")
            }
            Some(v) if self.env_ignored => {
                format!("{var}={v:?} ignored: this CPU has no AVX2/FMA for lora-core's kernel")
            }
            Some(v) => format!("{var}={v:?}"),
            None if self.choice == "lsdk" => {
                format!("AVX2 CPU without AVX-512; {var}=libtorch for libtorch's")
            }
            None => format!("{var}=lsdk for lora-core's, on AVX2 CPUs"),
        };
        let who = if self.choice == "lsdk" {
            lsdk
        } else {
            libtorch
        };
        format!("  {what}: {who} ({why})\n")
    }
}

#[derive(Debug, Serialize)]
struct Memory {
    total_bytes: Option<u64>,
    available_bytes: Option<u64>,
    /// cgroup v2 `memory.max` in bytes; `None` when absent or `max` (see `cgroup_max_text`).
    cgroup_max_bytes: Option<u64>,
    cgroup_max_text: Option<String>,
}

#[derive(Debug, Serialize)]
struct Disk {
    path: PathBuf,
    free_bytes: Option<u64>,
    total_bytes: Option<u64>,
}

impl Report {
    fn gather() -> Report {
        Report {
            libtorch: Libtorch::gather(),
            gpu: gpu(),
            cpu: Cpu::gather(),
            memory: Memory::gather(),
            disk: Disk::gather(),
        }
    }

    fn text(&self) -> String {
        let b = |v: u64| lora_memory::Bytes(v).to_string();
        let l = &self.libtorch;
        let mut out = String::new();
        out += "libtorch\n";
        out += &format!(
            "  tch crate: {} (built for PyTorch {})\n",
            l.tch_version, l.built_for_pytorch
        );
        match &l.path {
            Some(p) => {
                out += &format!("  path: {}\n", p.display());
                if let Some(via) = &l.found_via {
                    out += &format!("  found via: {via}\n");
                }
                out += &match (&l.version, l.version_source) {
                    (Some(v), Some(s)) => format!("  version: {v} ({s})\n"),
                    _ => "  version: unknown (no version.py / build-version)\n".into(),
                };
            }
            None => out += "  path: not found in /proc/self/maps\n",
        }
        out += &format!("  threads: {} intra-op\n", l.intra_op_threads);
        out += &format!("  CUDA available: {}\n", l.cuda_available);
        out += &format!("  CUDA devices: {}\n", l.cuda_devices);
        out += &format!("  cuDNN available: {}\n", l.cudnn_available);
        let g = &self.gpu;
        out += "gpu\n";
        if let Some(n) = &g.note {
            out += &format!("  {n}\n");
        }
        if let Some(v) = &g.driver_version {
            out += &format!("  driver: {v}\n");
        }
        if let Some(v) = &g.cuda_driver_version {
            out += &format!("  CUDA driver API: {v}\n");
        }
        for d in &g.devices {
            let name = d.name.as_deref().unwrap_or("unknown");
            match (d.total_bytes, d.free_bytes, d.used_bytes, &d.error) {
                (Some(t), Some(f), Some(u), _) => {
                    out += &format!(
                        "  cuda:{} {name}: total {}, free {}, used {}\n",
                        d.index,
                        b(t),
                        b(f),
                        b(u)
                    )
                }
                (_, _, _, e) => {
                    out += &format!(
                        "  cuda:{} {name}: memory unknown ({})\n",
                        d.index,
                        e.as_deref().unwrap_or("not reported")
                    )
                }
            }
        }
        let c = &self.cpu;
        out += "cpu\n";
        out += &format!("  model: {}\n", c.model);
        out += &format!(
            "  logical cores: {} (usable by this process: {})\n",
            c.logical_cores, c.usable_cores
        );
        let flags = if c.bf16_flags.is_empty() {
            "no AVX-512 BF16 / AMX".to_string()
        } else {
            c.bf16_flags.join(", ")
        };
        out += &if c.fast_bf16_gemm {
            format!("  bf16 matrix products: fast, oneDNN ({flags})\n")
        } else {
            format!(
                "  bf16 matrix products: by f32 GEMMs, libtorch's bf16 GEMM is slow here (no AVX-512 BW/VL/DQ; {flags})\n"
            )
        };
        out += &format!(
            "  f32 matrix products: {}{}\n",
            if c.f32_gemm == "onednn" {
                "oneDNN"
            } else {
                "MKL's sgemm"
            },
            match &c.f32_gemm_env {
                Some(v) if c.f32_gemm_env_ignored => format!(
                    " (LORA_CPU_F32_GEMM={v:?} is not \"onednn\" or \"mkl\": ignored, the CPU's default)"
                ),
                Some(v) => format!(" (LORA_CPU_F32_GEMM={v:?})"),
                None if c.f32_gemm == "onednn" => {
                    " (AMD CPU with AVX-512; LORA_CPU_F32_GEMM=mkl for MKL)".to_string()
                }
                None => " (LORA_CPU_F32_GEMM=onednn for oneDNN)".to_string(),
            }
        );
        out += &c.cpu_attention.line(
            "causal attention (f32, up to 512 positions)",
            "LORA_CPU_ATTENTION",
            "lora-core's AVX2 kernel",
            "libtorch's flash kernel",
        );
        out += &c.cpu_lora.line(
            "LoRA branches of f32 linears",
            "LORA_CPU_LORA",
            "lora-core's AVX2 kernel",
            "libtorch's GEMMs",
        );
        let m = &self.memory;
        out += "memory\n";
        if let Some(v) = m.total_bytes {
            out += &format!("  MemTotal: {}\n", b(v));
        }
        if let Some(v) = m.available_bytes {
            out += &format!("  MemAvailable: {}\n", b(v));
        }
        match (m.cgroup_max_bytes, &m.cgroup_max_text) {
            (Some(v), _) => out += &format!("  cgroup memory.max: {}\n", b(v)),
            (None, Some(t)) => out += &format!("  cgroup memory.max: {t}\n"),
            (None, None) => {}
        }
        let d = &self.disk;
        out += "disk\n";
        match (d.free_bytes, d.total_bytes) {
            (Some(f), Some(t)) => {
                out += &format!("  {}: {} free of {}\n", d.path.display(), b(f), b(t))
            }
            _ => out += &format!("  {}: unknown (df failed)\n", d.path.display()),
        }
        out
    }
}

impl Libtorch {
    fn gather() -> Libtorch {
        let path = loaded_libtorch_dir().map(|lib| {
            lib.parent()
                .map(Path::to_path_buf)
                .unwrap_or_else(|| lib.clone())
        });
        let version = path.as_deref().and_then(libtorch_version);
        Libtorch {
            tch_version: "0.26.0",
            built_for_pytorch: BUILT_FOR_PYTORCH,
            found_via: std::env::var(FOUND_VIA_VAR).ok().filter(|v| !v.is_empty()),
            path,
            version_source: version.as_ref().map(|v| v.1),
            version: version.map(|v| v.0),
            intra_op_threads: tch::get_num_threads(),
            cuda_available: tch::Cuda::is_available(),
            cuda_devices: tch::Cuda::device_count(),
            cudnn_available: tch::Cuda::cudnn_is_available(),
        }
    }
}

impl Cpu {
    fn gather() -> Cpu {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let model = cpuinfo
            .lines()
            .find_map(|l| {
                l.strip_prefix("model name")
                    .map(|r| r.trim_start_matches([' ', '\t', ':']).to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap_or_default();
        Cpu {
            model,
            logical_cores: cpuinfo
                .lines()
                .filter(|l| l.starts_with("processor"))
                .count(),
            usable_cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(0),
            bf16_flags: ["avx512_bf16", "amx_bf16"]
                .iter()
                .filter(|f| flags.split_whitespace().any(|x| x == **f))
                .map(|f| f.to_string())
                .collect(),
            f32_gemm: if lora_core::sys::cpu_f32_gemm_by_onednn() {
                "onednn"
            } else {
                "mkl"
            },
            f32_gemm_env: std::env::var("LORA_CPU_F32_GEMM")
                .ok()
                .filter(|v| !v.trim().is_empty()),
            f32_gemm_env_ignored: matches!(
                lora_core::sys::cpu_f32_gemm_request(),
                lora_core::sys::F32GemmRequest::Unknown(_)
            ),
            fast_bf16_gemm: lora_core::sys::cpu_has_fast_bf16_gemm(),
            cpu_attention: CpuKernel::gather(
                "LORA_CPU_ATTENTION",
                lora_core::sys::cpu_attention_request(),
                lora_core::sys::cpu_causal_attention_by_lsdk(),
                lora_core::sys::causal_attention_available(),
            ),
            cpu_lora: CpuKernel::gather(
                "LORA_CPU_LORA",
                lora_core::sys::cpu_lora_request(),
                lora_core::sys::cpu_lora_branch_by_lsdk(),
                lora_core::sys::lora_branch_available(),
            ),
        }
    }
}

impl Memory {
    fn gather() -> Memory {
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let max = std::fs::read_to_string("/sys/fs/cgroup/memory.max")
            .ok()
            .map(|s| s.trim().to_string());
        Memory {
            total_bytes: meminfo_kb(&meminfo, "MemTotal").map(|kb| kb * 1024),
            available_bytes: meminfo_kb(&meminfo, "MemAvailable").map(|kb| kb * 1024),
            cgroup_max_bytes: max.as_deref().and_then(|m| m.parse().ok()),
            cgroup_max_text: max,
        }
    }
}

impl Disk {
    fn gather() -> Disk {
        let path = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        let space = free_disk(&path);
        Disk {
            free_bytes: space.map(|s| s.0),
            total_bytes: space.map(|s| s.1),
            path,
        }
    }
}

/// The folder of the `libtorch_cpu.so` this process loaded.
fn loaded_libtorch_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| Path::new(p).parent().map(Path::to_path_buf))
}

/// libtorch's version and the file it was read from.
fn libtorch_version(root: &Path) -> Option<(String, &'static str)> {
    if let Ok(v) = std::fs::read_to_string(root.join("version.py")) {
        for l in v.lines() {
            if let Some(rest) = l.strip_prefix("__version__") {
                let v = rest
                    .trim_start_matches([' ', '=', ':'])
                    .trim()
                    .trim_matches(['\'', '"']);
                return Some((v.to_string(), "version.py"));
            }
        }
    }
    std::fs::read_to_string(root.join("build-version"))
        .ok()
        .map(|s| (s.trim().to_string(), "build-version"))
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
fn gpu() -> Gpu {
    use nvml_wrapper::Nvml;
    let mut g = Gpu {
        nvml: false,
        note: None,
        driver_version: None,
        cuda_driver_version: None,
        devices: Vec::new(),
    };
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(e) => {
            g.note = Some(format!("no NVIDIA GPU (NVML: {e})"));
            return g;
        }
    };
    g.nvml = true;
    g.driver_version = nvml.sys_driver_version().ok();
    g.cuda_driver_version = nvml
        .sys_cuda_driver_version()
        .ok()
        .map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10));
    let count = nvml.device_count().unwrap_or(0);
    for index in 0..count {
        let mut d = GpuDevice {
            index,
            name: None,
            total_bytes: None,
            free_bytes: None,
            used_bytes: None,
            error: None,
        };
        match nvml.device_by_index(index) {
            Ok(dev) => {
                d.name = dev.name().ok();
                match dev.memory_info() {
                    Ok(m) => {
                        d.total_bytes = Some(m.total);
                        d.free_bytes = Some(m.free);
                        d.used_bytes = Some(m.used);
                    }
                    Err(e) => d.error = Some(e.to_string()),
                }
            }
            Err(e) => d.error = Some(e.to_string()),
        }
        g.devices.push(d);
    }
    if count == 0 {
        g.note = Some("NVML found no devices".into());
    }
    g
}

#[cfg(not(feature = "nvml"))]
fn gpu() -> Gpu {
    Gpu {
        nvml: false,
        note: Some(
            "NVML: not built in (rebuild with `--features nvml` for GPU name, total/free memory and driver)"
                .into(),
        ),
        driver_version: None,
        cuda_driver_version: None,
        devices: Vec::new(),
    }
}
