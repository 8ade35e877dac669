//! Bindings to the small C++ shim over libtorch (`lora-core/shim/shim.cpp`): bf16/fp16 autocast,
//! CUDA caching-allocator statistics, a counting CPU allocator with exact tensor bytes and an
//! optional limit, RNG generator state and the deterministic-algorithms switch, and linear
//! products over quantized weights computed tile by tile ([`qlinear`], [`qmatmul`]: decoded from
//! the blocks on the CPU; [`tiled_linear`], [`tiled_matmul`]: any device, rows decoded by a Rust
//! callback); libtorch's profiler ([`profiler_start`], [`profiler_stop`]; summed per operator by
//! [`crate::profile`]); plus glibc's mmap threshold ([`set_malloc_mmap_threshold`]) so CPU RSS tracks
//! live tensors.
//!
//! tch 0.26 exposes none of these (its `autocast` is fp16-only and a no-op on CPU). Every call
//! returns a [`ShimError`] instead of panicking: C++ exceptions are caught inside the shim and come
//! back as their message.
//!
//! Autocast state is **per thread** in libtorch: an [`AutocastGuard`] affects the thread that
//! created it only.

use std::ffi::{CStr, c_char};
use std::marker::PhantomData;

use tch::{Device, Kind, Tensor};

/// Bytes of a tensor's elements: `numel · element size` (libtorch's `element_size()`); views
/// count their own elements, not the storage they share.
pub fn tensor_bytes(t: &Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

mod ffi {
    use std::ffi::c_char;
    unsafe extern "C" {
        pub fn lsdk_free_error(msg: *mut c_char);
        pub fn lsdk_autocast_get(device: i32, enabled: *mut i32, dtype: *mut i32) -> *mut c_char;
        pub fn lsdk_autocast_set(device: i32, enabled: i32, dtype: i32) -> *mut c_char;
        pub fn lsdk_autocast_increment_nesting(depth: *mut i32) -> *mut c_char;
        pub fn lsdk_autocast_decrement_nesting(depth: *mut i32) -> *mut c_char;
        pub fn lsdk_autocast_clear_cache() -> *mut c_char;
        pub fn lsdk_cuda_device_count(count: *mut i32) -> *mut c_char;
        pub fn lsdk_cuda_mem_stats(device: i32, out: *mut i64) -> *mut c_char;
        pub fn lsdk_cuda_reset_peak(device: i32) -> *mut c_char;
        pub fn lsdk_cuda_empty_cache() -> *mut c_char;
        pub fn lsdk_cuda_mem_info(device: i32, free: *mut u64, total: *mut u64) -> *mut c_char;
        pub fn lsdk_cpu_counting_install() -> *mut c_char;
        pub fn lsdk_cpu_counting_installed(installed: *mut i32) -> *mut c_char;
        pub fn lsdk_cpu_mem_stats(out: *mut i64) -> *mut c_char;
        pub fn lsdk_cpu_reset_peak() -> *mut c_char;
        pub fn lsdk_cpu_set_limit(limit: i64) -> *mut c_char;
        pub fn lsdk_cpu_set_cache(enabled: i32) -> *mut c_char;
        pub fn lsdk_cpu_empty_cache() -> *mut c_char;
        pub fn lsdk_manual_seed(seed: u64) -> *mut c_char;
        pub fn lsdk_rng_get_state(
            device: i32,
            index: i32,
            buf: *mut u8,
            cap: i64,
            len: *mut i64,
        ) -> *mut c_char;
        pub fn lsdk_rng_set_state(device: i32, index: i32, buf: *const u8, len: i64)
        -> *mut c_char;
        pub fn lsdk_set_deterministic(enabled: i32, warn_only: i32) -> *mut c_char;
        pub fn lsdk_get_deterministic(enabled: *mut i32) -> *mut c_char;
        pub fn lsdk_dist_has_gloo(has: *mut i32) -> *mut c_char;
        pub fn lsdk_dist_gloo_new(
            host: *const c_char,
            port: i32,
            rank: i32,
            world_size: i32,
            timeout_ms: i64,
            prefix: *const c_char,
            out: *mut *mut std::ffi::c_void,
        ) -> *mut c_char;
        pub fn lsdk_dist_has_nccl(has: *mut i32) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn lsdk_dist_nccl_new(
            host: *const c_char,
            port: i32,
            rank: i32,
            world_size: i32,
            timeout_ms: i64,
            prefix: *const c_char,
            device_index: i32,
            out: *mut *mut std::ffi::c_void,
        ) -> *mut c_char;
        pub fn lsdk_dist_free(pg: *mut std::ffi::c_void) -> *mut c_char;
        pub fn lsdk_dist_all_reduce_sum(
            pg: *mut std::ffi::c_void,
            t: *const torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_dist_broadcast(
            pg: *mut std::ffi::c_void,
            t: *const torch_sys::C_tensor,
            root: i32,
        ) -> *mut c_char;
        pub fn lsdk_dist_barrier(pg: *mut std::ffi::c_void) -> *mut c_char;
        pub fn lsdk_dist_all_gather(
            pg: *mut std::ffi::c_void,
            t: *const torch_sys::C_tensor,
            out: *const torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_dist_store_add(
            pg: *mut std::ffi::c_void,
            key: *const c_char,
            delta: i64,
            value: *mut i64,
        ) -> *mut c_char;
        pub fn lsdk_dist_store_check(
            pg: *mut std::ffi::c_void,
            key: *const c_char,
            present: *mut i32,
        ) -> *mut c_char;
        pub fn lsdk_grad_set_undefined(t: *mut torch_sys::C_tensor) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn lsdk_adam_foreach_step(
            params: *const *const torch_sys::C_tensor,
            grads: *const *const torch_sys::C_tensor,
            exp_avgs: *const *const torch_sys::C_tensor,
            exp_avg_sqs: *const *const torch_sys::C_tensor,
            neg_step_size: *const f64,
            bias_correction2_sqrt: *const f64,
            n: i64,
            decay_factor: f64,
            one_minus_beta1: f64,
            beta2: f64,
            one_minus_beta2: f64,
            eps: f64,
        ) -> *mut c_char;
        pub fn lsdk_bf16_linear(
            x: *const torch_sys::C_tensor,
            w: *const torch_sys::C_tensor,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_cpu_has_fast_bf16_gemm(fast: *mut i32) -> *mut c_char;
        pub fn lsdk_f32_onednn_available(ok: *mut i32) -> *mut c_char;
        pub fn lsdk_f32_linear(
            x: *const torch_sys::C_tensor,
            w: *const torch_sys::C_tensor,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_silu_mul(
            g: *const torch_sys::C_tensor,
            u: *const torch_sys::C_tensor,
            h: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_swiglu(
            gu: *const torch_sys::C_tensor,
            h: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_rope(
            x: *const torch_sys::C_tensor,
            cos: *const torch_sys::C_tensor,
            sin: *const torch_sys::C_tensor,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_rms_norm(
            x: *const torch_sys::C_tensor,
            w: *const torch_sys::C_tensor,
            eps: f64,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_causal_attention_available(ok: *mut i32, parallel: *mut i32) -> *mut c_char;
        pub fn lsdk_causal_attention(
            q: *const torch_sys::C_tensor,
            k: *const torch_sys::C_tensor,
            v: *const torch_sys::C_tensor,
            scale: f64,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_lora_branch(
            x: *const torch_sys::C_tensor,
            base: *const torch_sys::C_tensor,
            a: *const *const torch_sys::C_tensor,
            b: *const *const torch_sys::C_tensor,
            scales: *const f64,
            n: i64,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn lsdk_profiler_start(cuda: i32, record_shapes: i32) -> *mut c_char;
        pub fn lsdk_profiler_stop(
            trace_path: *const c_char,
            on_event: Option<super::ProfileEventFn>,
            ctx: *mut std::ffi::c_void,
        ) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn lsdk_qlinear(
            x: *const torch_sys::C_tensor,
            mode: i32,
            kind: i32,
            out: i64,
            inn: i64,
            codes: *const torch_sys::C_tensor,
            scales: *const torch_sys::C_tensor,
            mins: *const torch_sys::C_tensor,
            sub_scales: *const torch_sys::C_tensor,
            hbits: *const torch_sys::C_tensor,
            dq_scales: *const torch_sys::C_tensor,
            table: *const torch_sys::C_tensor,
            dq_offset: f64,
            tile_elements: i64,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
        #[allow(clippy::too_many_arguments)]
        pub fn lsdk_tiled_linear(
            x: *const torch_sys::C_tensor,
            mode: i32,
            out: i64,
            inn: i64,
            tile_rows: i64,
            ctx: *mut std::ffi::c_void,
            rows: RowsFn,
            free_ctx: FreeFn,
            y: *mut *mut torch_sys::C_tensor,
        ) -> *mut c_char;
    }

    /// `lsdk_rows_fn`: rows `[r0, r1)` as a new heap tensor of the `c10::ScalarType` code given.
    pub type RowsFn = unsafe extern "C" fn(
        ctx: *mut std::ffi::c_void,
        r0: i64,
        r1: i64,
        dtype: i32,
        rows: *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char;
    /// `lsdk_free_fn`: frees the context handed to `lsdk_tiled_linear`.
    pub type FreeFn = unsafe extern "C" fn(ctx: *mut std::ffi::c_void);
}

/// The shim's per-event callback of [`profiler_stop`].
type ProfileEventFn = unsafe extern "C" fn(
    ctx: *mut std::ffi::c_void,
    name: *const c_char,
    shapes: *const c_char,
    thread: u64,
    start_ns: u64,
    end_ns: u64,
    device: i32,
);

/// An error reported by the libtorch shim: the operation and libtorch's message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("libtorch shim: {op} failed: {message}")]
pub struct ShimError {
    /// The shim operation that failed (e.g. `"cuda_mem_stats"`).
    pub op: &'static str,
    /// libtorch's error message (without backtrace), or why the call was rejected.
    pub message: String,
}

/// `Result` with a [`ShimError`].
pub type ShimResult<T> = std::result::Result<T, ShimError>;

/// Turns a shim return value (NULL or an owned message) into a `Result`.
impl From<ShimError> for tch::TchError {
    /// A shim failure as libtorch's own error kind, so it takes the crates' `Torch` error
    /// context like any other op.
    fn from(e: ShimError) -> Self {
        tch::TchError::Torch(e.to_string())
    }
}

fn check(op: &'static str, ret: *mut c_char) -> ShimResult<()> {
    if ret.is_null() {
        return Ok(());
    }
    // SAFETY: a non-null return is a NUL-terminated string malloc'd by the shim; we copy it and
    // hand it back to the shim's `free`.
    let message = unsafe { CStr::from_ptr(ret) }
        .to_string_lossy()
        .into_owned();
    unsafe { ffi::lsdk_free_error(ret) };
    Err(ShimError { op, message })
}

fn device_code(op: &'static str, device: Device) -> ShimResult<(i32, i32)> {
    match device {
        Device::Cpu => Ok((0, 0)),
        Device::Cuda(i) => Ok((1, i as i32)),
        other => Err(ShimError {
            op,
            message: format!("device {other:?} is not supported (use Device::Cpu or Device::Cuda)"),
        }),
    }
}

/// libtorch's `c10::ScalarType` code for the floating kinds autocast accepts.
fn scalar_type_code(op: &'static str, kind: Kind) -> ShimResult<i32> {
    match kind {
        Kind::Half => Ok(5),
        Kind::Float => Ok(6),
        Kind::BFloat16 => Ok(15),
        other => Err(ShimError {
            op,
            message: format!("autocast dtype must be BFloat16, Half or Float, got {other:?}"),
        }),
    }
}

fn kind_from_code(code: i32) -> Option<Kind> {
    match code {
        5 => Some(Kind::Half),
        6 => Some(Kind::Float),
        7 => Some(Kind::Double),
        15 => Some(Kind::BFloat16),
        _ => None,
    }
}

// ---------------------------------------------------------------------------------------------
// Autocast

/// The autocast state of one device type on the current thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutocastState {
    /// Whether autocast is on.
    pub enabled: bool,
    /// The lower-precision dtype ops are cast to (`None` when libtorch reports another dtype).
    pub dtype: Option<Kind>,
}

/// Reads the autocast state of `device`'s type on the current thread
/// (`at::autocast::is_autocast_enabled` / `get_autocast_dtype`).
///
/// # Errors
/// A device other than CPU/CUDA, or a libtorch error.
pub fn autocast_state(device: Device) -> ShimResult<AutocastState> {
    let (dev, _) = device_code("autocast_state", device)?;
    let (mut enabled, mut dtype) = (0i32, 0i32);
    // SAFETY: both out-pointers are valid for the call.
    check("autocast_state", unsafe {
        ffi::lsdk_autocast_get(dev, &mut enabled, &mut dtype)
    })?;
    Ok(AutocastState {
        enabled: enabled != 0,
        dtype: kind_from_code(dtype),
    })
}

/// RAII autocast scope, like `torch.autocast(device_type, dtype)`: while alive, eligible ops
/// (matmul, linear, conv, …) on `device`'s type run in `dtype` on the creating thread; dropping it
/// restores the previous state and, when the outermost scope closes, clears libtorch's autocast
/// weight-cast cache (what `torch.autocast.__exit__` does).
///
/// Unlike `tch::autocast`, this works for bf16 and on CPU. Not `Send`: autocast state is per thread.
///
/// ```no_run
/// # fn main() -> Result<(), lora_core::sys::ShimError> {
/// use tch::{Device, Kind, Tensor};
/// let a = Tensor::ones([4, 4], (Kind::Float, Device::Cpu));
/// let y = {
///     let _autocast = lora_core::sys::AutocastGuard::new(Device::Cpu, Kind::BFloat16)?;
///     a.matmul(&a)
/// };
/// assert_eq!(y.kind(), Kind::BFloat16);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct AutocastGuard {
    dev: i32,
    prev_enabled: i32,
    prev_dtype: i32,
    _not_send: PhantomData<*const ()>,
}

impl AutocastGuard {
    /// Enables autocast to `dtype` (`Kind::BFloat16` or `Kind::Half`) for `device`'s type
    /// (`Device::Cpu` or `Device::Cuda(_)`; the index does not matter).
    ///
    /// # Errors
    /// An unsupported device or dtype, or a libtorch error.
    pub fn new(device: Device, dtype: Kind) -> ShimResult<Self> {
        Self::with_enabled(device, dtype, true)
    }

    /// Like [`AutocastGuard::new`] but with an explicit on/off switch (`false` disables autocast
    /// inside the scope, e.g. for a loss that must run in fp32).
    ///
    /// # Errors
    /// An unsupported device or dtype, or a libtorch error.
    pub fn with_enabled(device: Device, dtype: Kind, enabled: bool) -> ShimResult<Self> {
        let op = "autocast_enter";
        let (dev, _) = device_code(op, device)?;
        let code = scalar_type_code(op, dtype)?;
        let (mut prev_enabled, mut prev_dtype) = (0i32, 0i32);
        // SAFETY: valid out-pointers.
        check(op, unsafe {
            ffi::lsdk_autocast_get(dev, &mut prev_enabled, &mut prev_dtype)
        })?;
        // SAFETY: plain values.
        check(op, unsafe {
            ffi::lsdk_autocast_set(dev, i32::from(enabled), code)
        })?;
        let mut depth = 0i32;
        // SAFETY: valid out-pointer.
        if let Err(e) = check(op, unsafe {
            ffi::lsdk_autocast_increment_nesting(&mut depth)
        }) {
            // SAFETY: plain values; restore what we changed.
            let _ = check(op, unsafe {
                ffi::lsdk_autocast_set(dev, prev_enabled, prev_dtype)
            });
            return Err(e);
        }
        Ok(Self {
            dev,
            prev_enabled,
            prev_dtype,
            _not_send: PhantomData,
        })
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        let mut depth = 0i32;
        // Errors cannot be returned from Drop; these calls only touch thread-local flags and
        // cannot fail in practice.
        // SAFETY: valid out-pointer / plain values.
        let dec = check("autocast_exit", unsafe {
            ffi::lsdk_autocast_decrement_nesting(&mut depth)
        });
        if dec.is_ok() && depth == 0 {
            // SAFETY: no arguments.
            let _ = check("autocast_exit", unsafe { ffi::lsdk_autocast_clear_cache() });
        }
        // SAFETY: plain values.
        let _ = check("autocast_exit", unsafe {
            ffi::lsdk_autocast_set(self.dev, self.prev_enabled, self.prev_dtype)
        });
    }
}

// ---------------------------------------------------------------------------------------------
// CUDA allocator

/// CUDA caching-allocator statistics of one device, in bytes
/// (`c10::CachingDeviceAllocator::DeviceStats`, aggregate pool — what
/// `torch.cuda.memory_stats()` reports as `*.all.*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CudaMemStats {
    /// Bytes held by live tensors (`allocated_bytes.all.current`, `torch.cuda.memory_allocated`).
    pub allocated_bytes: u64,
    /// Peak of `allocated_bytes` since the last reset (`torch.cuda.max_memory_allocated`).
    pub peak_allocated_bytes: u64,
    /// Bytes reserved from the driver by the caching allocator (`torch.cuda.memory_reserved`).
    pub reserved_bytes: u64,
    /// Peak of `reserved_bytes` since the last reset (`torch.cuda.max_memory_reserved`).
    pub peak_reserved_bytes: u64,
    /// Bytes of active blocks (allocated, including rounding).
    pub active_bytes: u64,
    /// Peak of `active_bytes`.
    pub peak_active_bytes: u64,
    /// Bytes requested by callers (before the allocator rounds up).
    pub requested_bytes: u64,
    /// Peak of `requested_bytes`.
    pub peak_requested_bytes: u64,
    /// Number of live allocations.
    pub n_allocations: u64,
}

/// Number of CUDA devices libtorch sees (0 on a CPU-only machine or when `libtorch_cuda` is not
/// loaded).
///
/// # Errors
/// A libtorch error.
pub fn cuda_device_count() -> ShimResult<usize> {
    let mut n = 0i32;
    // SAFETY: valid out-pointer.
    check("cuda_device_count", unsafe {
        ffi::lsdk_cuda_device_count(&mut n)
    })?;
    Ok(n.max(0) as usize)
}

/// A device as configs spell it: `cpu`, `cuda:0`, `mps`, `vulkan`.
pub fn device_name(device: tch::Device) -> String {
    match device {
        tch::Device::Cpu => "cpu".into(),
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        tch::Device::Mps => "mps".into(),
        tch::Device::Vulkan => "vulkan".into(),
    }
}

/// Why CUDA device `index` cannot be used here, in one sentence: what was asked, what libtorch
/// sees, and how to run on the CPU (`cuda:0 was asked for, but libtorch sees no CUDA device …`);
/// `None` when libtorch sees that device. One wording for every command that takes a device.
pub fn cuda_device_problem(index: usize) -> Option<String> {
    let n = cuda_device_count().unwrap_or(0);
    if index < n {
        return None;
    }
    Some(if n == 0 {
        format!(
            "cuda:{index} was asked for, but libtorch sees no CUDA device on this machine (no \
             NVIDIA GPU or driver, or a CPU-only libtorch); use \"cpu\" (or \"auto\") to run on \
             the CPU, and see `lora-train doctor`"
        )
    } else {
        format!(
            "cuda:{index} was asked for, but libtorch sees {n} CUDA device(s) (cuda:0…cuda:{}); use one of those, \"cpu\" or \"auto\"",
            n - 1
        )
    })
}

fn cuda_index(op: &'static str, index: usize) -> ShimResult<Option<i32>> {
    let n = cuda_device_count()?;
    if n == 0 {
        return Ok(None);
    }
    if index >= n {
        return Err(ShimError {
            op,
            message: format!("CUDA device {index} does not exist ({n} device(s) visible)"),
        });
    }
    Ok(Some(index as i32))
}

/// Caching-allocator statistics of CUDA device `index`; `Ok(None)` when there is no CUDA device.
///
/// # Errors
/// `index` beyond the device count, or a libtorch error.
pub fn cuda_mem_stats(index: usize) -> ShimResult<Option<CudaMemStats>> {
    let op = "cuda_mem_stats";
    let Some(i) = cuda_index(op, index)? else {
        return Ok(None);
    };
    let mut out = [0i64; 9];
    // SAFETY: `out` has the 9 slots the shim writes.
    check(op, unsafe { ffi::lsdk_cuda_mem_stats(i, out.as_mut_ptr()) })?;
    let u = |v: i64| v.max(0) as u64;
    Ok(Some(CudaMemStats {
        allocated_bytes: u(out[0]),
        peak_allocated_bytes: u(out[1]),
        reserved_bytes: u(out[2]),
        peak_reserved_bytes: u(out[3]),
        active_bytes: u(out[4]),
        peak_active_bytes: u(out[5]),
        requested_bytes: u(out[6]),
        peak_requested_bytes: u(out[7]),
        n_allocations: u(out[8]),
    }))
}

/// Resets the peak statistics of CUDA device `index` (`torch.cuda.reset_peak_memory_stats`).
/// Returns `false` (and does nothing) when there is no CUDA device.
///
/// # Errors
/// `index` beyond the device count, or a libtorch error.
pub fn cuda_reset_peak(index: usize) -> ShimResult<bool> {
    let op = "cuda_reset_peak";
    let Some(i) = cuda_index(op, index)? else {
        return Ok(false);
    };
    // SAFETY: plain value.
    check(op, unsafe { ffi::lsdk_cuda_reset_peak(i) })?;
    Ok(true)
}

/// Returns cached, unused CUDA blocks to the driver (`torch.cuda.empty_cache`). Returns `false`
/// when there is no CUDA device.
///
/// # Errors
/// A libtorch error.
pub fn cuda_empty_cache() -> ShimResult<bool> {
    if cuda_device_count()? == 0 {
        return Ok(false);
    }
    // SAFETY: no arguments.
    check("cuda_empty_cache", unsafe { ffi::lsdk_cuda_empty_cache() })?;
    Ok(true)
}

/// `(free, total)` bytes of CUDA device `index` as the driver reports them
/// (`cudaMemGetInfo`, `torch.cuda.mem_get_info`); `Ok(None)` when there is no CUDA device.
///
/// # Errors
/// `index` beyond the device count, or a libtorch error.
pub fn cuda_mem_info(index: usize) -> ShimResult<Option<(u64, u64)>> {
    let op = "cuda_mem_info";
    let Some(i) = cuda_index(op, index)? else {
        return Ok(None);
    };
    let (mut free, mut total) = (0u64, 0u64);
    // SAFETY: valid out-pointers.
    check(op, unsafe {
        ffi::lsdk_cuda_mem_info(i, &mut free, &mut total)
    })?;
    Ok(Some((free, total)))
}

// ---------------------------------------------------------------------------------------------
// Counting CPU allocator

/// Tensor memory on CPU as counted by the shim's allocator, in bytes.
///
/// Counts every CPU tensor allocation made through libtorch's CPU allocator after
/// [`install_counting_cpu_allocator`]; memory allocated before installation, mmap'd weights, and
/// the process heap outside tensors are not counted (blocks allocated before installation and freed
/// afterwards count 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CpuMemStats {
    /// Bytes of live tensor storage.
    pub current_bytes: u64,
    /// Peak of `current_bytes` since installation or the last [`cpu_reset_peak`].
    pub peak_bytes: u64,
    /// Bytes allocated in total (never decreases).
    pub total_allocated_bytes: u64,
    /// Number of allocations in total.
    pub n_allocations: u64,
    /// The allocation limit, if one is set ([`set_cpu_alloc_limit`]).
    pub limit_bytes: Option<u64>,
    /// Number of live blocks.
    pub live_blocks: u64,
    /// Bytes of freed blocks held for reuse ([`set_cpu_cache`]); not in `current_bytes`.
    #[serde(default)]
    pub cached_bytes: u64,
    /// Allocations served from the cache since installation.
    #[serde(default)]
    pub cache_hits: u64,
    /// Cached blocks freed to keep the cache within its bound, since installation.
    #[serde(default)]
    pub cache_evictions: u64,
}

/// Installs the counting CPU allocator (`c10::SetCPUAllocator` with priority 100). Idempotent.
/// Tensors allocated before this keep their original deleter and are not counted.
///
/// # Errors
/// A libtorch error.
pub fn install_counting_cpu_allocator() -> ShimResult<()> {
    // SAFETY: no arguments.
    check("install_counting_cpu_allocator", unsafe {
        ffi::lsdk_cpu_counting_install()
    })
}

/// Whether the counting allocator is the current CPU allocator.
///
/// # Errors
/// A libtorch error.
pub fn counting_cpu_allocator_installed() -> ShimResult<bool> {
    let mut v = 0i32;
    // SAFETY: valid out-pointer.
    check("counting_cpu_allocator_installed", unsafe {
        ffi::lsdk_cpu_counting_installed(&mut v)
    })?;
    Ok(v != 0)
}

/// Exact CPU tensor bytes (current, peak, …). Installs the counting allocator on first use, so
/// the first call reports only what is allocated from then on.
///
/// # Errors
/// A libtorch error.
pub fn cpu_mem_stats() -> ShimResult<CpuMemStats> {
    install_counting_cpu_allocator()?;
    let mut out = [0i64; 9];
    // SAFETY: `out` has the 9 slots the shim writes.
    check("cpu_mem_stats", unsafe {
        ffi::lsdk_cpu_mem_stats(out.as_mut_ptr())
    })?;
    let u = |v: i64| v.max(0) as u64;
    Ok(CpuMemStats {
        current_bytes: u(out[0]),
        peak_bytes: u(out[1]),
        total_allocated_bytes: u(out[2]),
        n_allocations: u(out[3]),
        limit_bytes: (out[4] > 0).then(|| u(out[4])),
        live_blocks: u(out[5]),
        cached_bytes: u(out[6]),
        cache_hits: u(out[7]),
        cache_evictions: u(out[8]),
    })
}

/// Turns on (or off, which also empties it) the counting allocator's cache of freed blocks, and
/// installs the allocator if needed.
///
/// With the cache on, a freed CPU tensor block of at least 128 KiB is kept and handed out again
/// to the next allocation of exactly its size, instead of going back to glibc. A training step
/// allocates the same sizes every step; without the cache each large block is mapped afresh
/// (glibc maps blocks above its mmap threshold, which [`set_malloc_mmap_threshold`] fixes at
/// 128 KiB for the trainer) and every page of it is faulted in and zeroed again: measured on the
/// SmolLM2-135M benchmark step (2 × 128 tokens, CPU, 2 threads), ≈ 540,000 page faults and
/// ≈ 1.1 s of system time per step, the step 40% slower than with glibc's default threshold.
///
/// Bound: live plus cached bytes never exceed the peak of live bytes since the cache was last
/// emptied ([`cpu_empty_cache`]); an allocation the cache cannot serve first frees cached blocks,
/// largest first, until it fits under that peak. So the tensor memory the process holds never
/// passes its live peak, which is what the memory plan predicts.
///
/// # Errors
/// A libtorch error.
pub fn set_cpu_cache(enabled: bool) -> ShimResult<()> {
    install_counting_cpu_allocator()?;
    // SAFETY: plain integer argument.
    check("set_cpu_cache", unsafe {
        ffi::lsdk_cpu_set_cache(enabled as i32)
    })
}

/// Frees every block the cache holds ([`set_cpu_cache`]) and restarts its bound from the live
/// bytes (call it after loading, so the bound is the training step's own peak).
///
/// # Errors
/// A libtorch error.
pub fn cpu_empty_cache() -> ShimResult<()> {
    // SAFETY: no arguments.
    check("cpu_empty_cache", unsafe { ffi::lsdk_cpu_empty_cache() })
}

/// Resets the CPU peak to the current byte count.
///
/// # Errors
/// A libtorch error.
pub fn cpu_reset_peak() -> ShimResult<()> {
    // SAFETY: no arguments.
    check("cpu_reset_peak", unsafe { ffi::lsdk_cpu_reset_peak() })
}

/// Sets (or with `None` clears) a limit on live CPU tensor bytes. An allocation that would exceed
/// it fails like a real out-of-memory: libtorch throws `c10::OutOfMemoryError` with
/// "DefaultCPUAllocator: can't allocate memory" in its message, which tch's `f_*` functions return
/// as `TchError::Torch`. Installs the counting allocator if needed. Meant for testing OOM recovery.
///
/// # Errors
/// A limit above `i64::MAX`, or a libtorch error.
pub fn set_cpu_alloc_limit(limit_bytes: Option<u64>) -> ShimResult<()> {
    install_counting_cpu_allocator()?;
    let v = match limit_bytes {
        None => 0,
        Some(b) => i64::try_from(b.max(1)).map_err(|_| ShimError {
            op: "set_cpu_alloc_limit",
            message: format!("limit {b} bytes is too large"),
        })?,
    };
    // SAFETY: plain value.
    check("set_cpu_alloc_limit", unsafe { ffi::lsdk_cpu_set_limit(v) })
}

/// RAII form of [`set_cpu_alloc_limit`]: sets a limit and restores the previous one on drop.
#[derive(Debug)]
pub struct CpuAllocLimitGuard {
    prev: Option<u64>,
}

impl CpuAllocLimitGuard {
    /// Limits live CPU tensor bytes to `limit_bytes` until the guard is dropped.
    ///
    /// # Errors
    /// See [`set_cpu_alloc_limit`].
    pub fn new(limit_bytes: u64) -> ShimResult<Self> {
        let prev = cpu_mem_stats()?.limit_bytes;
        set_cpu_alloc_limit(Some(limit_bytes))?;
        Ok(Self { prev })
    }
}

impl Drop for CpuAllocLimitGuard {
    fn drop(&mut self) {
        let _ = set_cpu_alloc_limit(self.prev);
    }
}

// ---------------------------------------------------------------------------------------------
// RNG and determinism

/// Seeds the CPU generator and every CUDA device's generator (`at::manual_seed`,
/// `torch.manual_seed`).
///
/// # Errors
/// A libtorch error.
pub fn manual_seed(seed: u64) -> ShimResult<()> {
    // SAFETY: plain value.
    check("manual_seed", unsafe { ffi::lsdk_manual_seed(seed) })
}

/// The default generator state of `device` as bytes (`torch.get_rng_state()` on CPU — 5056
/// bytes for the mt19937 CPU generator; `torch.cuda.get_rng_state(i)` on CUDA).
///
/// # Errors
/// An unsupported device, CUDA without a device, or a libtorch error.
pub fn rng_state(device: Device) -> ShimResult<Vec<u8>> {
    let op = "rng_state";
    let (dev, idx) = device_code(op, device)?;
    let mut len = 0i64;
    // SAFETY: a null buffer only asks for the length.
    check(op, unsafe {
        ffi::lsdk_rng_get_state(dev, idx, std::ptr::null_mut(), 0, &mut len)
    })?;
    let mut buf = vec![0u8; len.max(0) as usize];
    let mut len2 = 0i64;
    // SAFETY: `buf` has `len` bytes.
    check(op, unsafe {
        ffi::lsdk_rng_get_state(dev, idx, buf.as_mut_ptr(), buf.len() as i64, &mut len2)
    })?;
    if len2 != len {
        return Err(ShimError {
            op,
            message: format!("generator state changed size during the read ({len} → {len2} bytes)"),
        });
    }
    Ok(buf)
}

/// Restores a generator state read by [`rng_state`] on the same device type.
///
/// # Errors
/// An unsupported device, or libtorch rejecting the state (wrong size or content).
pub fn set_rng_state(device: Device, state: &[u8]) -> ShimResult<()> {
    let op = "set_rng_state";
    let (dev, idx) = device_code(op, device)?;
    // SAFETY: `state` is valid for `len` bytes.
    check(op, unsafe {
        ffi::lsdk_rng_set_state(dev, idx, state.as_ptr(), state.len() as i64)
    })
}

/// Switches libtorch's deterministic-algorithms mode
/// (`torch.use_deterministic_algorithms(enabled, warn_only=warn_only)`).
///
/// # Errors
/// A libtorch error.
pub fn set_deterministic(enabled: bool, warn_only: bool) -> ShimResult<()> {
    // SAFETY: plain values.
    check("set_deterministic", unsafe {
        ffi::lsdk_set_deterministic(i32::from(enabled), i32::from(warn_only))
    })
}

/// Whether deterministic-algorithms mode is on.
///
/// # Errors
/// A libtorch error.
pub fn deterministic() -> ShimResult<bool> {
    let mut v = 0i32;
    // SAFETY: valid out-pointer.
    check("deterministic", unsafe {
        ffi::lsdk_get_deterministic(&mut v)
    })?;
    Ok(v != 0)
}

/// Drops the gradient of `t` (its `.grad` becomes undefined), as
/// `optimizer.zero_grad(set_to_none=True)` does in PyTorch (the default since torch 2.0). The
/// next backward allocates a fresh gradient instead of adding into a zeroed one, so between steps
/// no gradient memory is held.
///
/// # Errors
/// A libtorch error.
pub fn set_grad_undefined(t: &mut Tensor) -> ShimResult<()> {
    // SAFETY: `as_mut_ptr` is a live `torch::Tensor*` owned by `t` for the whole call.
    check("grad_set_undefined", unsafe {
        ffi::lsdk_grad_set_undefined(t.as_mut_ptr() as *mut torch_sys::C_tensor)
    })
}

/// The scalars of one multi-tensor Adam update ([`adam_foreach_step`]); every field is an `f64`
/// computed by the caller, exactly as `torch.optim.adam._multi_tensor_adam` computes it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamForeachScalars {
    /// Decoupled weight decay factor `1 − lr·λ` (1.0: no decay, the multiply is skipped).
    pub decay_factor: f64,
    /// `1 − β₁`, the `lerp` weight of the first moment.
    pub one_minus_beta1: f64,
    /// `β₂`.
    pub beta2: f64,
    /// `1 − β₂`.
    pub one_minus_beta2: f64,
    /// ε, added to `√v / √(1 − β₂ᵗ)`.
    pub eps: f64,
}

/// One Adam/AdamW update of many fp32 tensors with libtorch's multi-tensor (`_foreach_*`) ops, in
/// the order of `torch.optim.adam._multi_tensor_adam` (torch 2.13, non-capturable, non-amsgrad):
///
/// ```text
/// p ← p·decay_factor
/// m ← lerp(m, g, 1 − β₁)            v ← β₂·v;  v ← v + (1 − β₂)·g·g
/// p ← p + neg_step_size[i] · m / (√v / bias_correction2_sqrt[i] + ε)
/// ```
///
/// On the CPU, when every operand is a contiguous f32 array of its parameter's size, the whole
/// update is one pass over each tensor (`shim/shim.cpp`, `adam_step_f32`; the tensors shared out
/// over libtorch's intra-op threads when more than one is set), with each operation libtorch's
/// element-wise kernels perform, in their order; libtorch's vectorized `lerp` fuses a
/// multiply-add, so a first moment can differ from it by one rounding. No temporary is
/// allocated, and the tensors' version counters are bumped as by in-place ops. It takes this path
/// only when no tensor it writes (a parameter or a moment) shares storage with another operand. Elsewhere (CUDA, other layouts)
/// each `_foreach_*` op is one libtorch call over the whole list instead of one per tensor,
/// bit-identical to the per-tensor loop (`torch.optim.AdamW(foreach=False)`), and the
/// denominators are one temporary list as large as `exp_avg_sqs`.
///
/// `params`, `grads`, `exp_avgs`, `exp_avg_sqs` are parallel lists of same-shaped fp32 tensors on
/// one device; `neg_step_size[i] = −lr / (1 − β₁ᵗ)` and `bias_correction2_sqrt[i] = √(1 − β₂ᵗ)` for
/// tensor `i`'s step count `t`. `params`, `exp_avgs` and `exp_avg_sqs` are updated in place.
///
/// # Errors
/// Lists of different lengths (the error names them), or a libtorch error (shape or dtype
/// mismatch, out of memory).
pub fn adam_foreach_step(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    neg_step_size: &[f64],
    bias_correction2_sqrt: &[f64],
    s: AdamForeachScalars,
) -> ShimResult<()> {
    let n = params.len();
    if [
        grads.len(),
        exp_avgs.len(),
        exp_avg_sqs.len(),
        neg_step_size.len(),
        bias_correction2_sqrt.len(),
    ]
    .iter()
    .any(|&l| l != n)
    {
        return Err(ShimError {
            op: "adam_foreach_step",
            message: format!(
                "list lengths differ: params {n}, grads {}, exp_avgs {}, exp_avg_sqs {}, step sizes {}, bias corrections {}",
                grads.len(),
                exp_avgs.len(),
                exp_avg_sqs.len(),
                neg_step_size.len(),
                bias_correction2_sqrt.len()
            ),
        });
    }
    let ptrs = |ts: &[Tensor]| -> Vec<*const torch_sys::C_tensor> {
        ts.iter()
            .map(|t| t.as_ptr() as *const torch_sys::C_tensor)
            .collect()
    };
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    // SAFETY: every pointer is a live `torch::Tensor*` borrowed from the slices for the whole
    // call, all arrays hold `n` entries (checked above), and the shim only reads the handles.
    check("adam_foreach_step", unsafe {
        ffi::lsdk_adam_foreach_step(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            neg_step_size.as_ptr(),
            bias_correction2_sqrt.as_ptr(),
            n as i64,
            s.decay_factor,
            s.one_minus_beta1,
            s.beta2,
            s.one_minus_beta2,
            s.eps,
        )
    })
}

/// Sets libtorch's intra-op thread count for the calling thread (`tch::set_num_threads`) and
/// returns the previous value.
pub fn set_num_threads(n: usize) -> usize {
    let prev = tch::get_num_threads().max(0) as usize;
    tch::set_num_threads(n.max(1) as i32);
    prev
}

/// Default threshold for [`set_malloc_mmap_threshold`]: 128 KiB (bytes), glibc's own initial
/// value, now fixed. (1 MiB kept freed 128 KiB–1 MiB blocks resident: step RSS delta −9% vs the
/// plan instead of +2%.)
pub const RETURN_FREED_MMAP_THRESHOLD: usize = 128 << 10;

/// Fixes glibc malloc's mmap threshold at `bytes`, so that every heap block of at least that size
/// is mapped on its own and returned to the OS when freed.
///
/// Why: libtorch's CPU allocator is plain `posix_memalign`. glibc starts with a 128 KiB mmap
/// threshold and, each time a mapped block is freed, raises it to that block's size (up to
/// 32 MiB on 64-bit: `DEFAULT_MMAP_THRESHOLD_MAX`, glibc `malloc/malloc.c`, and `mallopt(3)`).
/// After the first training step most activation tensors are therefore served from the heap, and
/// freed activations stay resident: measured on the README demo, the step RSS delta was 1.60 GB
/// for 1.10 GB of live tensors. Setting the threshold explicitly turns the dynamic adjustment off
/// (`mallopt(3)`: "setting M_MMAP_THRESHOLD … disables dynamic adjustment"); with 128 KiB the same
/// run's RSS delta was 1.14 GB, within 2% of lora-memory's prediction. The cost is one `mmap` +
/// page faults per large allocation.
///
/// Process-wide; call it before the large allocations (before loading the model). The
/// `MALLOC_MMAP_THRESHOLD_` environment variable does the same at process start.
///
/// Returns `false` (and does nothing) where the C library is not glibc, or when glibc refuses the
/// value (above `HEAP_MAX`, 32 MiB on 64-bit).
pub fn set_malloc_mmap_threshold(bytes: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let Ok(v) = libc::c_int::try_from(bytes) else {
            return false;
        };
        // SAFETY: mallopt only changes allocator parameters; any int value is accepted or refused
        // with 0.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, v) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = bytes;
        false
    }
}

/// Weights decoded at once by [`qlinear`] and by `QuantWeight::linear`'s tiles on the
/// device-generic path ([`tiled_linear`]): one tile of output rows holds at most this many values
/// (4 MiB as f32; plus its bf16 copy for a bf16 product on the CPU kernel, or the tensor-op
/// decode's temporaries elsewhere) — the memory planner's transient for this SDK's quantized
/// linears, whose value it is ([`lora_memory::estimate::OURS_QLINEAR_TILE_ELEMENTS`]).
pub const QLINEAR_TILE_ELEMENTS: u64 = lora_memory::estimate::OURS_QLINEAR_TILE_ELEMENTS;

/// The quantized tensors of one frozen `[out, in]` weight, as [`qlinear`] reads them (layouts:
/// `lora_core::quant::QuantWeight`'s docs; the shim checks every size).
#[derive(Debug, Clone, Copy)]
pub struct QuantParts<'a> {
    /// 0 `Q8_0`, 1 `Q4_0`, 2 `Q4_1`, 3 NF4, 4 NF4 with double quantization, 5 `Q5_0`, 6 `Q5_1`,
    /// 7 `Q4_K`, 8 `Q5_K`, 9 `Q6_K`, 10 fp8 e4m3fn.
    pub kind: i32,
    /// Output features (rows of the weight).
    pub out: i64,
    /// Input features.
    pub inn: i64,
    /// Codes: i8 `[out, in/32, 32]` (`Q8_0`), u8 `[out, in/32, 16]` (4- and 5-bit GGUF), u8
    /// `[out, in/256, 128]` (k-quants), u8 `[out·in/64, 32]` (NF4) or u8 `[out, in]` (fp8 bits).
    pub codes: &'a Tensor,
    /// f16 block scales `[out, nb]`, NF4 absmax (f32, or i8 with double quantization), or empty
    /// (fp8).
    pub scales: &'a Tensor,
    /// f16 block minimums (`Q4_1`, `Q5_1`) or `dmin` (`Q4_K`, `Q5_K`), `[out, nb]`.
    pub mins: Option<&'a Tensor>,
    /// k-quant sub-block scales `[out, in/256, 16]`: u8 8 scales + 8 minimums (`Q4_K`, `Q5_K`),
    /// i8 16 scales (`Q6_K`).
    pub sub_scales: Option<&'a Tensor>,
    /// High bits in weight order, least significant first: 1 per weight (`Q5_0`, `Q5_1`, `Q5_K`)
    /// or 2 (`Q6_K`).
    pub hbits: Option<&'a Tensor>,
    /// NF4 double quantization: f32 scale per 256 absmax values.
    pub dq_scales: Option<&'a Tensor>,
    /// f32 `[256, 2]`: a byte's two code values (4-bit kinds).
    pub table: Option<&'a Tensor>,
    /// NF4 double quantization: the offset added back to every absmax.
    pub dq_offset: f32,
}

/// `x · Wᵀ` for a quantized frozen weight `W` on the CPU, computed one tile of output rows at a
/// time from the quantized blocks (at most [`QLINEAR_TILE_ELEMENTS`] weights decoded at once),
/// as an autograd op: its backward gives `g · W` for `x` by decoding the tiles again, so no
/// dense copy of `W` outlives the call. The decoding loops are compiled for AVX-512, AVX2 and
/// baseline x86-64 (chosen at run time) and threaded with libtorch's intra-op pool; the products
/// are libtorch GEMMs. Autocast does not apply: the product is in `x`'s dtype.
///
/// `x`: `[n, in]` f32 or bf16 on the CPU. Returns `[n, out]` of `x`'s dtype. Each value equals
/// `x.matmul(dequantize(W)ᵀ)` up to the GEMM's summation order.
///
/// # Errors
/// A shape, dtype or device the kernel does not take, sizes that do not match `parts.kind`'s
/// layout, or a libtorch error (e.g. out of memory).
pub fn qlinear(x: &Tensor, parts: &QuantParts<'_>) -> ShimResult<Tensor> {
    quant_call("qlinear", x, parts, None)
}

/// The products of a quantized weight `W` `[out, in]` without autograd, tile by tile as
/// [`qlinear`]: `x · Wᵀ` (`x` `[n, in]` → `[n, out]`) or, with `transposed`, `x · W` (`x`
/// `[n, out]` → `[n, in]`, what an input gradient needs). In `x`'s dtype (f32 or bf16, CPU).
///
/// # Errors
/// As [`qlinear`].
pub fn qmatmul(x: &Tensor, parts: &QuantParts<'_>, transposed: bool) -> ShimResult<Tensor> {
    quant_call("qmatmul", x, parts, Some(transposed))
}

/// Calls `lsdk_qlinear`: the autograd op (`transposed` `None`) or a plain product.
fn quant_call(
    op: &'static str,
    x: &Tensor,
    parts: &QuantParts<'_>,
    transposed: Option<bool>,
) -> ShimResult<Tensor> {
    let opt = |t: Option<&Tensor>| {
        t.map_or(std::ptr::null(), |t| {
            t.as_ptr() as *const torch_sys::C_tensor
        })
    };
    let ptr = |t: &Tensor| t.as_ptr() as *const torch_sys::C_tensor;
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    let mode = match transposed {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    // SAFETY: every pointer is a live `torch::Tensor*` owned by a borrowed `Tensor` (or null
    // where the shim accepts null) for the whole call; on success the shim stores a new heap
    // `torch::Tensor*` in `y`, whose ownership `Tensor::from_ptr` takes.
    let ret = unsafe {
        ffi::lsdk_qlinear(
            ptr(x),
            mode,
            parts.kind,
            parts.out,
            parts.inn,
            ptr(parts.codes),
            ptr(parts.scales),
            opt(parts.mins),
            opt(parts.sub_scales),
            opt(parts.hbits),
            opt(parts.dq_scales),
            opt(parts.table),
            f64::from(parts.dq_offset),
            QLINEAR_TILE_ELEMENTS as i64,
            &mut y,
        )
    };
    check(op, ret)?;
    // SAFETY: see above.
    unsafe { take_output(op, y) }
}

/// The tensor a shim call stored in its out-pointer `y`, after [`check`] passed.
///
/// # Safety
/// `y` is null or a heap `torch::Tensor*` the shim created for the caller and nobody else owns.
unsafe fn take_output(op: &'static str, y: *mut torch_sys::C_tensor) -> ShimResult<Tensor> {
    if y.is_null() {
        return Err(ShimError {
            op,
            message: "the shim returned no tensor".into(),
        });
    }
    // SAFETY: non-null, and owned by the caller alone (this function's contract).
    Ok(unsafe { Tensor::from_ptr(y) })
}

/// `x · Wᵀ` as bf16 autocast computes a linear — both operands rounded to bf16, products summed
/// in f32, the result rounded to bf16 — but by f32 GEMMs over the widened bf16 operands, forward
/// and backward (`shim/bf16_linear.cpp`). On a CPU where libtorch has no fast bf16 GEMM (see
/// [`cpu_has_fast_bf16_gemm`]) this is the same function up to the summation order at a fraction
/// of the time. Autocast does not apply inside. An autograd op when `x` or `w` takes a gradient:
/// it saves the bf16 operands the gradients need, as autocast's graph does, and returns each
/// gradient rounded to bf16 in its input's dtype.
///
/// `x`: `[..., in]`, `w`: `[out, in]`, any floating dtypes on one device. Returns `[..., out]`
/// bf16.
///
/// # Errors
/// Shapes that do not fit, non-floating dtypes, two devices, or a libtorch error (e.g. out of
/// memory).
pub fn bf16_linear(x: &Tensor, w: &Tensor) -> ShimResult<Tensor> {
    linear_op("bf16_linear", ffi::lsdk_bf16_linear, x, w)
}

/// The shim's linear ops `(x, w) → y`: calls `f` and takes ownership of the new tensor.
fn linear_op(
    op: &'static str,
    f: unsafe extern "C" fn(
        *const torch_sys::C_tensor,
        *const torch_sys::C_tensor,
        *mut *mut torch_sys::C_tensor,
    ) -> *mut c_char,
    x: &Tensor,
    w: &Tensor,
) -> ShimResult<Tensor> {
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: `x` and `w` are live `torch::Tensor*` owned by borrowed `Tensor`s for the whole
    // call; on success the shim stores a new heap `torch::Tensor*` in `y`, whose ownership
    // `Tensor::from_ptr` takes.
    let ret = unsafe { f(x.as_ptr(), w.as_ptr(), &mut y) };
    check(op, ret)?;
    // SAFETY: see above.
    unsafe { take_output(op, y) }
}

/// Whether libtorch multiplies bf16 matrices on this CPU with oneDNN's vectorized kernels: the
/// condition of PyTorch's `mkldnn_bf16_device_check()` (`aten/src/ATen/native/mkldnn/Utils.h`),
/// AVX-512 BW, VL and DQ on x86-64 (other architectures answer true: libtorch's own choice is
/// kept there). Where it is false, libtorch's bf16 GEMM runs scalar loops, and [`bf16_linear`]
/// and the quantized kernels' bf16 products ([`qlinear`], [`qmatmul`]) compute the same numbers
/// by f32 GEMMs. One answer for the workspace: the shim's, which its kernels use.
pub fn cpu_has_fast_bf16_gemm() -> bool {
    let mut fast = 1i32;
    // SAFETY: valid out-pointer.
    let ok = check("cpu_has_fast_bf16_gemm", unsafe {
        ffi::lsdk_cpu_has_fast_bf16_gemm(&mut fast)
    })
    .is_ok();
    // (the call cannot fail; if it did, libtorch's own kernels are kept)
    !ok || fast != 0
}

/// `y = x · Wᵀ` in f32 on the CPU by oneDNN's matmul (libtorch's `mkldnn::_linear_pointwise`)
/// instead of MKL's sgemm (`shim/f32_linear.cpp`): the same function up to the summation order.
/// An autograd op when `x` or `w` takes a gradient (`∂x = g·W` by oneDNN; `∂W = gᵀ·x` by MKL,
/// or as `(xᵀ·g)ᵀ` by oneDNN for a weight more than 4× taller than wide, a LoRA B factor),
/// saving what `at::linear` saves. [`crate::linear::linear_product`] takes it where
/// [`cpu_f32_gemm_by_onednn`] says so.
///
/// `x`: `[..., in]` f32, `w`: `[out, in]` f32 (any strides), both on the CPU. Returns
/// `[..., out]` f32.
///
/// # Errors
/// Shapes that do not fit, other dtypes or devices, a libtorch without oneDNN, or a libtorch
/// error (e.g. out of memory).
pub fn f32_linear(x: &Tensor, w: &Tensor) -> ShimResult<Tensor> {
    linear_op("f32_linear", ffi::lsdk_f32_linear, x, w)
}

/// SwiGLU's product `h = silu(g) ⊙ u` (`silu(g) = g·sigmoid(g)`, the LLaMA MLP's gate; Shazeer,
/// "GLU Variants Improve Transformer", 2020) as one autograd op (`shim/decoder_ops.cpp`). Its
/// node saves `g` and `u` and recomputes the sigmoid in the backward pass, where libtorch's
/// `silu` then `mul` would also keep `silu(g)`: one activation less. f32 on the CPU runs one
/// vectorized loop each way (values within a few ulp of libtorch's); other dtypes and devices
/// (and 0-d or empty tensors) run libtorch's own `silu`, `mul` and `silu_backward`, giving the
/// composite's values exactly. Like [`rope`] and [`rms_norm`], its backward pass runs without a
/// graph: no second derivative.
///
/// `g`, `u`: the same shape `[..., ff]`, dtype (floating) and device. Returns `[..., ff]`.
///
/// # Errors
/// Shapes, dtypes or devices that differ, a non-floating dtype, or a libtorch error (e.g. out
/// of memory).
pub fn silu_mul(g: &Tensor, u: &Tensor) -> ShimResult<Tensor> {
    linear_op("silu_mul", ffi::lsdk_silu_mul, g, u)
}

/// [`silu_mul`] of the two halves of one tensor `gu` `[..., 2·ff]` (gate the first `ff` values of
/// the last dim, up the last `ff`: the output of a fused gate/up product) → `[..., ff]`. The
/// gradient flows back as one tensor shaped like `gu`, without the split's zero-filled halves.
///
/// # Errors
/// An odd last dim, a non-floating dtype, or a libtorch error.
pub fn swiglu(gu: &Tensor) -> ShimResult<Tensor> {
    let mut h: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: `gu` is a live `torch::Tensor*` for the call; on success `h` holds a new heap
    // tensor whose ownership `take_output` takes.
    let ret = unsafe { ffi::lsdk_swiglu(gu.as_ptr(), &mut h) };
    check("swiglu", ret)?;
    // SAFETY: see above.
    unsafe { take_output("swiglu", h) }
}

/// Rotary position embedding in HF's `rotate_half` layout (`modeling_llama.apply_rotary_pos_emb`;
/// Su et al., "RoFormer", 2021): `y = x·cos + rotate_half(x)·sin` with `rotate_half([x1, x2]) =
/// [−x2, x1]` over halves of the last dim, as one autograd op on the CPU (`shim/decoder_ops.cpp`;
/// the backward applies the transpose, `∂x = g·cos + [g2·sin2, −g1·sin1]`). Nothing is saved
/// but the tables.
///
/// `x`: `[batch, heads, seq, head_dim]` f32 on the CPU (any strides; the output takes x's layout);
/// `cos`, `sin`: f32 tables of one shape broadcasting to x (e.g. `[batch, 1, seq, head_dim]`),
/// without gradient. `head_dim` even.
///
/// # Errors
/// Other dtypes or devices, shapes that do not broadcast, an odd `head_dim`, tables that take a
/// gradient, or a libtorch error.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> ShimResult<Tensor> {
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: the three tensors are live for the call; on success `y` holds a new heap tensor
    // whose ownership `take_output` takes.
    let ret = unsafe { ffi::lsdk_rope(x.as_ptr(), cos.as_ptr(), sin.as_ptr(), &mut y) };
    check("rope", ret)?;
    // SAFETY: see above.
    unsafe { take_output("rope", y) }
}

/// RMSNorm `y = w ⊙ (x · rsqrt(mean(x²) + eps))` over the last dim (Zhang and Sennrich, "Root
/// Mean Square Layer Normalization", 2019; HF `LlamaRMSNorm` for an f32 input) as one autograd
/// op on the CPU (`shim/decoder_ops.cpp`): saves x and the per-row `rsqrt`, the backward is
/// `∂x = rstd·(g⊙w) − x·rstd³·Σ(g⊙w⊙x)/n` (and `∂w = Σ_rows g⊙x̂` when the weight trains).
///
/// `x`: `[..., n]` f32 on the CPU; `w`: `[n]` f32. Returns `[..., n]` f32.
///
/// # Errors
/// Other dtypes or devices, a weight that does not fit, or a libtorch error.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> ShimResult<Tensor> {
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: `x` and `w` are live for the call; on success `y` holds a new heap tensor whose
    // ownership `take_output` takes.
    let ret = unsafe { ffi::lsdk_rms_norm(x.as_ptr(), w.as_ptr(), eps, &mut y) };
    check("rms_norm", ret)?;
    // SAFETY: see above.
    unsafe { take_output("rms_norm", y) }
}

/// The longest sequence [`causal_attention`] takes (positions); longer ones go to libtorch's
/// kernel. Its workspace holds a `[s, s]` block of probabilities per worker thread while it
/// runs (`2·d·sₚ + 2·sₚ² + s` f32 in the backward pass, sₚ = s rounded up to 16: 2.3 MiB at this
/// length and d = 64).
pub const CAUSAL_ATTENTION_MAX_SEQ: i64 = 512;

/// Causal self-attention `softmax(q·kᵀ/√d + mask)·v` (mask: key j after query i is −∞) with
/// grouped keys/values (query head h reads kv head `h / (heads / kv_heads)`, HF's `repeat_kv`
/// without the copy) as one autograd op on the CPU (`shim/attention.cpp`): the values of SDPA's
/// `is_causal` for equal query and key lengths, up to f32 rounding (relative differences about
/// 1e-6 against the f64 composite). Forward and backward are register-blocked products over a
/// whole `[s, s]` block per head (Dao et al., "FlashAttention", 2022, algorithm 4's gradients
/// without its tiling); saved for the backward pass are q, k, v, the output and a logsumexp per
/// row, what libtorch's flash kernel keeps. The backward pass computes only the gradients that
/// are needed, refuses to run after a saved tensor (the output included) was changed in place,
/// and has no double backward. On a 2-core AVX2 EPYC, `[2, 9, 128, 64]` with 3 kv heads: 2.0 ms
/// forward and backward against libtorch's 3.5 ms.
///
/// `q`: `[batch, heads, seq, head_dim]`; `k`, `v`: `[batch, kv_heads, seq, head_dim]`; f32 on
/// the CPU, any strides. Returns `[batch, seq, heads, head_dim]` f32 (contiguous: a
/// `[batch, seq, heads·head_dim]` view is free). [`causal_attention_applies`] says whether the
/// workspace uses it.
///
/// # Errors
/// A CPU without AVX2/FMA, other dtypes or devices, `heads` not a multiple of `kv_heads`, a
/// sequence longer than [`CAUSAL_ATTENTION_MAX_SEQ`], a `head_dim` that is not a multiple of 16
/// up to 256, or a libtorch error (e.g. out of memory).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> ShimResult<Tensor> {
    let d = q.size().last().copied().unwrap_or(1).max(1);
    let scale = 1.0 / (d as f64).sqrt();
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: the three tensors are live for the call; on success `y` holds a new heap tensor
    // whose ownership `take_output` takes.
    let ret =
        unsafe { ffi::lsdk_causal_attention(q.as_ptr(), k.as_ptr(), v.as_ptr(), scale, &mut y) };
    check("causal_attention", ret)?;
    // SAFETY: see above.
    unsafe { take_output("causal_attention", y) }
}

/// Whether [`causal_attention`] takes these operands and is this workspace's choice for them:
/// f32 CPU tensors `q` `[b, h, s, d]`, `k`/`v` `[b, kv, s, d]` with `h` a multiple of `kv`,
/// `1 ≤ s ≤` [`CAUSAL_ATTENTION_MAX_SEQ`], `d` a multiple of 16 up to 256,
/// [`cpu_causal_attention_by_lsdk`], and — unless `LORA_CPU_ATTENTION=lsdk` asks for the kernel
/// — at least as many (sequence, kv head) tasks `b·kv` as libtorch has threads (the kernel's
/// backward pass runs in parallel over those; libtorch's kernel splits finer).
pub fn causal_attention_applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (qs, ks) = (q.size(), k.size());
    let f32_cpu = |t: &Tensor| t.kind() == tch::Kind::Float && t.device() == tch::Device::Cpu;
    let shapes = qs.len() == 4
        && ks.len() == 4
        && v.size() == ks
        && f32_cpu(q)
        && f32_cpu(k)
        && f32_cpu(v)
        && ks[0] == qs[0]
        && ks[2] == qs[2]
        && ks[3] == qs[3]
        && ks[1] > 0
        && qs[1] >= ks[1]
        && qs[1] % ks[1] == 0
        && (1..=CAUSAL_ATTENTION_MAX_SEQ).contains(&qs[2])
        && qs[3] % 16 == 0
        && (16..=256).contains(&qs[3]);
    shapes
        && cpu_causal_attention_by_lsdk()
        && (*attention_request_once() == CpuKernelRequest::Lsdk
            || qs[0] * ks[1] >= i64::from(tch::get_num_threads()))
}

/// [`cpu_attention_request`] read once per process (asked per attention call).
fn attention_request_once() -> &'static CpuKernelRequest {
    static REQUEST: std::sync::OnceLock<CpuKernelRequest> = std::sync::OnceLock::new();
    REQUEST.get_or_init(cpu_attention_request)
}

/// What an environment variable choosing between one of this crate's CPU kernels and libtorch's
/// own ops asks for: `LORA_CPU_ATTENTION` ([`cpu_attention_request`], for
/// [`cpu_causal_attention_by_lsdk`]) and `LORA_CPU_LORA` ([`cpu_lora_request`], for
/// [`cpu_lora_branch_by_lsdk`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CpuKernelRequest {
    /// Unset or empty: the CPU's default.
    Default,
    /// `lsdk` (any case, surrounding spaces ignored): this crate's kernel wherever it applies.
    Lsdk,
    /// `libtorch` (any case): libtorch's own ops.
    Libtorch,
    /// Any other value, as written; ignored (the CPU's default is used).
    Unknown(String),
}

impl CpuKernelRequest {
    /// The warning a run prints for this request of the environment variable `var`, or `None`:
    /// a value it ignores, or `lsdk` where the kernel is not `available` (no AVX2/FMA).
    pub fn warning(&self, var: &str, available: bool) -> Option<String> {
        match self {
            CpuKernelRequest::Unknown(other) => Some(format!(
                "warning: {var}={other:?} is not \"lsdk\" or \"libtorch\"; ignored (the CPU's default is used)"
            )),
            CpuKernelRequest::Lsdk if !available => Some(format!(
                "warning: {var}=lsdk, but this CPU has no AVX2/FMA for lora-core's kernel; libtorch's ops are used"
            )),
            _ => None,
        }
    }
}

/// The former name of [`CpuKernelRequest`].
#[deprecated(note = "renamed CpuKernelRequest (it serves LORA_CPU_LORA as well)")]
pub type CpuAttentionRequest = CpuKernelRequest;

/// Reads the environment variable `var` as a [`CpuKernelRequest`].
fn cpu_kernel_request(var: &str) -> CpuKernelRequest {
    let Some(v) = std::env::var_os(var) else {
        return CpuKernelRequest::Default;
    };
    let v = v.to_string_lossy();
    match v.trim().to_ascii_lowercase().as_str() {
        "" => CpuKernelRequest::Default,
        "lsdk" => CpuKernelRequest::Lsdk,
        "libtorch" => CpuKernelRequest::Libtorch,
        _ => CpuKernelRequest::Unknown(v.to_string()),
    }
}

/// Reads `LORA_CPU_ATTENTION` (see [`CpuKernelRequest`]): libtorch's flash kernel or
/// [`causal_attention`].
pub fn cpu_attention_request() -> CpuKernelRequest {
    cpu_kernel_request("LORA_CPU_ATTENTION")
}

/// Reads `LORA_CPU_LORA` (see [`CpuKernelRequest`]): libtorch's GEMMs or [`lora_branch`] for
/// the LoRA branches of f32 linears.
pub fn cpu_lora_request() -> CpuKernelRequest {
    cpu_kernel_request("LORA_CPU_LORA")
}

/// Whether this build and CPU have [`causal_attention`]: x86-64 with AVX2 and FMA (whatever
/// `LORA_CPU_ATTENTION` says).
pub fn causal_attention_available() -> bool {
    causal_attention_build().0
}

/// (kernel available, shim built with OpenMP), asked once.
fn causal_attention_build() -> (bool, bool) {
    static BUILD: std::sync::OnceLock<(bool, bool)> = std::sync::OnceLock::new();
    *BUILD.get_or_init(|| {
        let (mut ok, mut parallel) = (0i32, 0i32);
        // SAFETY: valid out-pointers.
        let checked = check("causal_attention_available", unsafe {
            ffi::lsdk_causal_attention_available(&mut ok, &mut parallel)
        })
        .is_ok();
        (checked && ok != 0, checked && parallel != 0)
    })
}

/// Whether causal self-attention on the CPU may run [`causal_attention`] rather than libtorch's
/// flash kernel (per call, [`causal_attention_applies`] also weighs the shapes), decided from
/// `LORA_CPU_ATTENTION` as the process first reads it:
/// - never where the kernel is not available ([`causal_attention_available`]);
/// - `LORA_CPU_ATTENTION=lsdk` or `libtorch` wins otherwise;
/// - by default, on x86-64 CPUs without AVX-512F and with a shim built with OpenMP (its tasks
///   run in parallel): where it was measured faster (a 2-core AVX2 EPYC). libtorch's kernel is
///   AVX-512-vectorized where AVX-512 is present and was not compared there.
pub fn cpu_causal_attention_by_lsdk() -> bool {
    let (available, parallel) = causal_attention_build();
    available
        && match attention_request_once() {
            CpuKernelRequest::Lsdk => true,
            CpuKernelRequest::Libtorch => false,
            CpuKernelRequest::Default | CpuKernelRequest::Unknown(_) => {
                parallel && !cpu_has_avx512f()
            }
        }
}

/// The LoRA branches of sibling linears that read the same input, added to their frozen
/// products, as one f32 CPU autograd op (`shim/lora_branch.cpp`):
/// `y[:, seg_i] = base_out[:, seg_i] + s_i·(x·A_iᵀ)·B_iᵀ`, PEFT's
/// `base(x) + lora_B(lora_A(x))·scaling` for each site i
/// (`peft/tuners/lora/layer.py::Linear.forward`), the sites' outputs side by side in site order.
/// Each product (forward, and `∂x`, `∂A`, `∂B` backward) is one pass of AVX2/FMA register tiles
/// (6 × 16, or 12 × 8 for results at most 8 wide) over the operands as they are, in parallel
/// over libtorch's intra-op threads;
/// the sites' B factors are multiplied one by one, not as one block-diagonal matrix. On a 2-core
/// AVX2 EPYC MKL ran some of these skinny products (one side the rank) at 12–16 GFLOP/s.
/// Saves `x`, `h = x·Aᵀ` (`[n, Σ r_i]` f32) and the factors; the backward pass refuses to run
/// after `x` or a factor was changed in place and has no double backward (`create_graph`;
/// `LORA_CPU_LORA=libtorch` for that). The output is a tensor of its own (no view), changeable
/// in place like any op's. Besides tensors it keeps a packed copy of the factors per calling
/// thread for the thread's life (its size that of the factors, not growing with the tokens).
///
/// `x`: `[..., in]`; `base_out`: `[..., Σ out_i]` with `x`'s leading dims; `a[i]`: `[r_i, in]`;
/// `b[i]`: `[out_i, r_i]`; `scales[i]`: the site's scaling; every tensor f32 on the CPU, any
/// strides. Returns `[..., Σ out_i]` f32. [`lora_branch_applies`] says whether this workspace
/// uses it.
///
/// # Errors
/// A CPU without AVX2/FMA, lists of different lengths or empty, shapes that do not fit, other
/// dtypes or devices, or a libtorch error (e.g. out of memory).
pub fn lora_branch(
    x: &Tensor,
    base_out: &Tensor,
    a: &[&Tensor],
    b: &[&Tensor],
    scales: &[f64],
) -> ShimResult<Tensor> {
    if a.len() != b.len() || a.len() != scales.len() {
        return Err(ShimError {
            op: "lora_branch",
            message: format!(
                "{} A factors, {} B factors and {} scalings: one of each per site",
                a.len(),
                b.len(),
                scales.len()
            ),
        });
    }
    let a_ptrs: Vec<*const torch_sys::C_tensor> = a.iter().map(|t| t.as_ptr()).collect();
    let b_ptrs: Vec<*const torch_sys::C_tensor> = b.iter().map(|t| t.as_ptr()).collect();
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: every tensor is live for the call and the three arrays hold `a.len()` entries; on
    // success `y` holds a new heap tensor whose ownership `take_output` takes.
    let ret = unsafe {
        ffi::lsdk_lora_branch(
            x.as_ptr(),
            base_out.as_ptr(),
            a_ptrs.as_ptr(),
            b_ptrs.as_ptr(),
            scales.as_ptr(),
            a.len() as i64,
            &mut y,
        )
    };
    check("lora_branch", ret)?;
    // SAFETY: see above.
    unsafe { take_output("lora_branch", y) }
}

/// Whether [`lora_branch`] takes these operands and is this workspace's choice for them: `x`
/// `[..., in]`, `base_out` `[..., Σ out_i]` with the same leading dims, `a[i]` `[r_i, in]` and
/// `b[i]` `[out_i, r_i]` (r_i ≥ 1, `in` ≥ 1, Σ out_i ≥ 1), all f32 on the CPU, CPU autocast off,
/// and [`cpu_lora_branch_by_lsdk`].
pub fn lora_branch_applies(x: &Tensor, base_out: &Tensor, a: &[&Tensor], b: &[&Tensor]) -> bool {
    let f32_cpu = |t: &Tensor| t.kind() == tch::Kind::Float && t.device() == tch::Device::Cpu;
    let (xs, ys) = (x.size(), base_out.size());
    let Some(&inf) = xs.last() else {
        return false;
    };
    let fits = !a.is_empty()
        && inf >= 1
        && a.len() == b.len()
        && f32_cpu(x)
        && f32_cpu(base_out)
        && xs.len() == ys.len()
        && xs[..xs.len() - 1] == ys[..ys.len() - 1]
        && a.iter().zip(b).all(|(a, b)| {
            let (sa, sb) = (a.size(), b.size());
            f32_cpu(a)
                && f32_cpu(b)
                && sa.len() == 2
                && sb.len() == 2
                && sa[0] >= 1
                && sa[1] == inf
                && sb[1] == sa[0]
        })
        && ys.last().copied() == Some(b.iter().map(|b| b.size()[0]).sum::<i64>())
        && ys.last().is_some_and(|&o| o >= 1);
    fits && cpu_lora_branch_by_lsdk()
        && autocast_state(tch::Device::Cpu).is_ok_and(|ac| !ac.enabled)
}

/// Whether the shim was built with OpenMP, so that its CPU kernels ([`causal_attention`],
/// [`lora_branch`]) run their tasks on libtorch's intra-op threads (without it
/// `at::parallel_for` runs them on one thread, and neither kernel is the default).
pub fn cpu_kernels_parallel() -> bool {
    causal_attention_build().1
}

/// Whether this build and CPU have [`lora_branch`]: x86-64 with AVX2 and FMA (the products of
/// [`causal_attention`]; whatever `LORA_CPU_LORA` says).
pub fn lora_branch_available() -> bool {
    causal_attention_build().0
}

/// Whether the LoRA branches of f32 linears on the CPU may run [`lora_branch`] rather than
/// libtorch's GEMMs (per call, [`lora_branch_applies`] also checks the operands), decided from
/// `LORA_CPU_LORA` as the process first reads it:
/// - never where the kernel is not available ([`lora_branch_available`]);
/// - `LORA_CPU_LORA=lsdk` or `libtorch` wins otherwise;
/// - by default, on x86-64 CPUs without AVX-512F and with a shim built with OpenMP: where it was
///   measured faster (a 2-core AVX2 EPYC, against MKL). Where AVX-512 is present MKL or oneDNN
///   ([`cpu_f32_gemm_by_onednn`]) have kernels for it, and the two were not compared.
pub fn cpu_lora_branch_by_lsdk() -> bool {
    static REQUEST: std::sync::OnceLock<CpuKernelRequest> = std::sync::OnceLock::new();
    let (available, parallel) = causal_attention_build();
    available
        && match REQUEST.get_or_init(cpu_lora_request) {
            CpuKernelRequest::Lsdk => true,
            CpuKernelRequest::Libtorch => false,
            CpuKernelRequest::Default | CpuKernelRequest::Unknown(_) => {
                parallel && !cpu_has_avx512f()
            }
        }
}

/// An x86-64 CPU with AVX-512F (false elsewhere).
fn cpu_has_avx512f() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether this workspace multiplies f32 matrices on the CPU with oneDNN ([`f32_linear`]) rather
/// than libtorch's MKL sgemm. Decided once per process:
/// - the `LORA_CPU_F32_GEMM` environment variable, `onednn` or `mkl`, wins;
/// - otherwise oneDNN on an x86-64 AMD CPU with AVX-512 (F, BW, VL, DQ), where MKL runs its
///   generic code path without AVX-512 (measured on a 2-core AVX-512 EPYC: 196 against 139
///   GFLOP/s for `[256, 576]·[576, 3072]`, 151 against 103 for `[256, 576]·[576, 49152]`), and
///   MKL everywhere else (on Intel CPUs MKL uses its own AVX-512 kernels; on AVX2-only CPUs the
///   two were not compared);
/// - and only when libtorch has the oneDNN linear and a probe product is right.
pub fn cpu_f32_gemm_by_onednn() -> bool {
    static ONEDNN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ONEDNN.get_or_init(|| {
        let wanted = match cpu_f32_gemm_request() {
            F32GemmRequest::OneDnn => true,
            F32GemmRequest::Mkl => false,
            F32GemmRequest::Default | F32GemmRequest::Unknown(_) => amd_with_avx512(),
        };
        let mut ok = 0i32;
        // SAFETY: valid out-pointer.
        let probed = check("f32_onednn_available", unsafe {
            ffi::lsdk_f32_onednn_available(&mut ok)
        })
        .is_ok();
        wanted && probed && ok != 0
    })
}

/// What the `LORA_CPU_F32_GEMM` environment variable asks of [`cpu_f32_gemm_by_onednn`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum F32GemmRequest {
    /// Unset or empty: the CPU's default.
    Default,
    /// `onednn` (any case, surrounding spaces ignored).
    OneDnn,
    /// `mkl` (any case).
    Mkl,
    /// Any other value, as written; ignored (the CPU's default is used).
    Unknown(String),
}

/// Reads `LORA_CPU_F32_GEMM` (see [`F32GemmRequest`]).
pub fn cpu_f32_gemm_request() -> F32GemmRequest {
    match std::env::var_os("LORA_CPU_F32_GEMM") {
        None => F32GemmRequest::Default,
        Some(v) => parse_f32_gemm_request(&v.to_string_lossy()),
    }
}

fn parse_f32_gemm_request(v: &str) -> F32GemmRequest {
    match v.trim().to_ascii_lowercase().as_str() {
        "" => F32GemmRequest::Default,
        "onednn" => F32GemmRequest::OneDnn,
        "mkl" => F32GemmRequest::Mkl,
        _ => F32GemmRequest::Unknown(v.to_string()),
    }
}

/// An x86-64 CPU whose vendor is AMD (`cpuid` leaf 0) with AVX-512 F, BW, VL and DQ.
fn amd_with_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // (`cpuid` leaf 0 exists on every x86-64 CPU)
        let r = std::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        vendor[..4].copy_from_slice(&r.ebx.to_le_bytes());
        vendor[4..8].copy_from_slice(&r.edx.to_le_bytes());
        vendor[8..].copy_from_slice(&r.ecx.to_le_bytes());
        &vendor == b"AuthenticAMD"
            && std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx512dq")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Decodes rows `r0 .. r1` of a frozen `[out, in]` weight into a new dense `[r1 − r0, in]`
/// tensor of the dtype asked for, on the weight's device (what [`tiled_linear`] multiplies by).
pub type RowDecoder = Box<dyn FnMut(i64, i64, Kind) -> crate::Result<Tensor> + Send>;

/// A frozen weight `W` `[out, in]` that [`tiled_linear`] and [`tiled_matmul`] read one tile of
/// `tile_rows` output rows at a time, through `rows`.
pub struct TiledWeight {
    /// Output features (rows of `W`).
    pub out: i64,
    /// Input features.
    pub inn: i64,
    /// Rows per tile (the last tile may be shorter); `tile_rows · in` bounds the dense values
    /// alive at once.
    pub tile_rows: i64,
    /// The decoder of a tile's rows; called from the thread that runs the product (for the
    /// backward pass, the autograd engine's thread for the device), never concurrently.
    pub rows: RowDecoder,
}

impl std::fmt::Debug for TiledWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiledWeight")
            .field("out", &self.out)
            .field("inn", &self.inn)
            .field("tile_rows", &self.tile_rows)
            .finish_non_exhaustive()
    }
}

/// `x · Wᵀ` for a frozen weight `W` whose rows `rows` decodes, one tile of output rows at a time
/// (the device-generic form of [`qlinear`], in `lora-core/shim/qlinear.cpp`), as an autograd op:
/// the forward multiplies `x` by each tile as it is decoded; the backward gives `g · W` for `x` by
/// decoding the tiles again, so no dense copy of `W` outlives a tile. No gradient for `W`. The
/// autograd node keeps `w.rows` (and what it captures) until the graph releases it: after a
/// backward pass without `retain_graph`, or when the graph is dropped, possibly on another thread.
/// Autocast does not apply: the product is in `x`'s dtype.
///
/// `x`: `[n, in]` f16, bf16, f32 or f64 on the weight's device. Returns `[n, out]` of `x`'s dtype;
/// each value equals `x.matmul(Wᵀ)` up to the GEMM's summation order.
///
/// # Errors
/// A shape or dtype the product does not take, an error of `w.rows` (its message, after the rows
/// it was decoding) or a panic in it, a tile of the wrong shape, dtype or device, or a libtorch
/// error (e.g. out of memory). An error in the backward pass comes back from the backward call.
pub fn tiled_linear(x: &Tensor, w: TiledWeight) -> ShimResult<Tensor> {
    tiled_call("tiled_linear", x, w, None)
}

/// The products of [`tiled_linear`] without autograd: `x · Wᵀ` (`x` `[n, in]` → `[n, out]`) or,
/// with `transposed`, `x · W` (`x` `[n, out]` → `[n, in]`), in `x`'s dtype, one tile at a time.
///
/// # Errors
/// As [`tiled_linear`].
pub fn tiled_matmul(x: &Tensor, w: TiledWeight, transposed: bool) -> ShimResult<Tensor> {
    tiled_call("tiled_matmul", x, w, Some(transposed))
}

/// What `lsdk_tiled_linear` hands back to [`decode_rows_callback`]: the decoder behind a lock,
/// so the node may call it from whichever thread runs the backward pass.
struct RowsContext(std::sync::Mutex<RowDecoder>);

/// A message for the shim: a `malloc`'ed NUL-terminated copy (the shim frees it), or null when
/// allocation fails (the shim then reports a missing tensor).
fn c_message(msg: &str) -> *mut c_char {
    let bytes = msg.replace('\0', " ");
    // SAFETY: a fresh block of len + 1 bytes, filled and terminated below.
    unsafe {
        let p = libc::malloc(bytes.len() + 1) as *mut u8;
        if !p.is_null() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
            *p.add(bytes.len()) = 0;
        }
        p as *mut c_char
    }
}

/// `lsdk_rows_fn` over a [`RowsContext`]: never unwinds into C++ (a panic becomes an error).
unsafe extern "C" fn decode_rows_callback(
    ctx: *mut std::ffi::c_void,
    r0: i64,
    r1: i64,
    dtype: i32,
    rows: *mut *mut torch_sys::C_tensor,
) -> *mut c_char {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `ctx` is the `RowsContext` leaked by `tiled_call`, alive until the shim calls
        // `free_rows_context`, which it does only after its last call of this function.
        let context = unsafe { &*(ctx as *const RowsContext) };
        let kind = kind_from_code(dtype)
            .ok_or_else(|| format!("the shim asked for rows of dtype code {dtype}"))?;
        let mut decode = context
            .0
            .lock()
            .map_err(|_| "an earlier call of the row decoder panicked".to_string())?;
        (decode)(r0, r1, kind).map_err(|e| e.to_string())
    }));
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(panic) => Err(format!(
            "the row decoder panicked: {}",
            panic
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("(no message)")
        )),
    };
    match outcome {
        Ok(t) => {
            // ownership of the heap `torch::Tensor` passes to the shim, which deletes it
            let mut t = std::mem::ManuallyDrop::new(t);
            // SAFETY: `rows` is the shim's out-pointer for this call.
            unsafe { *rows = t.as_mut_ptr() };
            std::ptr::null_mut()
        }
        Err(msg) => c_message(&msg),
    }
}

/// `lsdk_free_fn` over a [`RowsContext`].
unsafe extern "C" fn free_rows_context(ctx: *mut std::ffi::c_void) {
    // SAFETY: `ctx` came from `Box::into_raw` in `tiled_call`; the shim frees it exactly once.
    let context = unsafe { Box::from_raw(ctx as *mut RowsContext) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(context)));
}

/// Calls `lsdk_tiled_linear`: the autograd op (`transposed` `None`) or a plain product.
fn tiled_call(
    op: &'static str,
    x: &Tensor,
    w: TiledWeight,
    transposed: Option<bool>,
) -> ShimResult<Tensor> {
    let mode = match transposed {
        None => 0,
        Some(false) => 1,
        Some(true) => 2,
    };
    let TiledWeight {
        out,
        inn,
        tile_rows,
        rows,
    } = w;
    let ctx = Box::into_raw(Box::new(RowsContext(std::sync::Mutex::new(rows))));
    let mut y: *mut torch_sys::C_tensor = std::ptr::null_mut();
    // SAFETY: `x` is a live `torch::Tensor*` for the whole call; the shim takes ownership of
    // `ctx` in every case and frees it with `free_rows_context`; on success it stores a new heap
    // `torch::Tensor*` in `y`, whose ownership `Tensor::from_ptr` takes.
    let ret = unsafe {
        ffi::lsdk_tiled_linear(
            x.as_ptr(),
            mode,
            out,
            inn,
            tile_rows,
            ctx as *mut std::ffi::c_void,
            decode_rows_callback,
            free_rows_context,
            &mut y,
        )
    };
    check(op, ret)?;
    // SAFETY: see above.
    unsafe { take_output(op, y) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn f32_gemm_request_reads_any_case_and_spaces() {
        use F32GemmRequest as R;
        assert_eq!(parse_f32_gemm_request("onednn"), R::OneDnn);
        assert_eq!(parse_f32_gemm_request(" OneDNN "), R::OneDnn);
        assert_eq!(parse_f32_gemm_request("MKL"), R::Mkl);
        assert_eq!(parse_f32_gemm_request(""), R::Default);
        assert_eq!(parse_f32_gemm_request("  "), R::Default);
        assert_eq!(
            parse_f32_gemm_request("openblas"),
            R::Unknown("openblas".into())
        );
    }

    #[test]
    fn bf16_linear_gives_autocasts_linear_and_gradients() {
        tch::manual_seed(3);
        let x0 = Tensor::randn([3, 5, 40], (Kind::Float, Device::Cpu));
        let w0 = Tensor::randn([24, 40], (Kind::Float, Device::Cpu));
        let g = Tensor::randn([3, 5, 24], (Kind::Float, Device::Cpu));
        // (y, ∂x, ∂w) by libtorch's bf16 autocast and by `bf16_linear` (under autocast too: it
        // must not be recast)
        let run = |ours: bool| {
            let x = x0.copy().set_requires_grad(true);
            let w = w0.copy().set_requires_grad(true);
            let y = {
                let _g = AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
                if ours {
                    bf16_linear(&x, &w).unwrap()
                } else {
                    x.linear::<Tensor>(&w, None)
                }
            };
            (y.to_kind(Kind::Float) * &g).sum(Kind::Float).backward();
            (y.detach(), x.grad(), w.grad())
        };
        let (y_ref, gx_ref, gw_ref) = run(false);
        let (y, gx, gw) = run(true);
        assert_eq!(y.kind(), Kind::BFloat16);
        assert_eq!(y.size(), [3, 5, 24]);
        assert_eq!((gx.kind(), gw.kind()), (Kind::Float, Kind::Float));
        // the same bf16 roundings; only the f32 summation order differs: at most one bf16 step
        // (2⁻⁸ relative) apart, and most values equal
        for (a, b) in [(&y, &y_ref), (&gx, &gx_ref), (&gw, &gw_ref)] {
            let (a, b) = (a.to_kind(Kind::Float), b.to_kind(Kind::Float));
            let rel = (&a - &b).abs() / (b.abs() + 1e-3);
            assert!(rel.max().double_value(&[]) <= 1.0 / 128.0, "{}", rel.max());
            let same = a
                .eq_tensor(&b)
                .to_kind(Kind::Float)
                .mean(Kind::Float)
                .double_value(&[]);
            assert!(same > 0.9, "only {same} of the values equal");
            // every value is a bf16 value
            assert!(a.to_kind(Kind::BFloat16).to_kind(Kind::Float).equal(&a));
        }
        // frozen W: no gradient for it, x's still right
        let x = x0.copy().set_requires_grad(true);
        let y = bf16_linear(&x, &w0).unwrap();
        (y.to_kind(Kind::Float) * &g).sum(Kind::Float).backward();
        assert!(
            x.grad()
                .to_kind(Kind::Float)
                .allclose(&gx_ref, 1e-2, 1e-2, false)
        );
        assert!(!w0.grad().defined());
        // a weight that does not fit is an error, not a crash
        let err = bf16_linear(&x0, &Tensor::zeros([4, 7], (Kind::Float, Device::Cpu))).unwrap_err();
        assert!(err.message.contains("does not fit"), "{err}");
    }

    #[test]
    fn autocast_bf16_on_cpu_and_restore() {
        let before = autocast_state(Device::Cpu).unwrap();
        assert!(!before.enabled);
        let a = Tensor::ones([8, 8], (Kind::Float, Device::Cpu));
        {
            let _g = AutocastGuard::new(Device::Cpu, Kind::BFloat16).unwrap();
            let st = autocast_state(Device::Cpu).unwrap();
            assert!(st.enabled);
            assert_eq!(st.dtype, Some(Kind::BFloat16));
            let y = a.matmul(&a);
            assert_eq!(y.kind(), Kind::BFloat16);
            assert_eq!(y.double_value(&[0, 0]), 8.0);
            {
                let _off = AutocastGuard::with_enabled(Device::Cpu, Kind::BFloat16, false).unwrap();
                assert_eq!(a.matmul(&a).kind(), Kind::Float);
            }
            assert_eq!(a.matmul(&a).kind(), Kind::BFloat16);
        }
        assert_eq!(autocast_state(Device::Cpu).unwrap(), before);
        assert_eq!(a.matmul(&a).kind(), Kind::Float);
    }

    #[test]
    fn autocast_rejects_integer_dtype() {
        let err = AutocastGuard::new(Device::Cpu, Kind::Int64).unwrap_err();
        assert!(err.message.contains("Int64"), "{err}");
    }

    #[test]
    fn cuda_calls_are_none_without_a_gpu() {
        if cuda_device_count().unwrap() == 0 {
            assert_eq!(cuda_mem_stats(0).unwrap(), None);
            assert_eq!(cuda_mem_info(0).unwrap(), None);
            assert!(!cuda_reset_peak(0).unwrap());
            assert!(!cuda_empty_cache().unwrap());
        } else {
            let before = cuda_mem_stats(0).unwrap().unwrap();
            let t = Tensor::zeros([1 << 20], (Kind::Float, Device::Cuda(0)));
            let after = cuda_mem_stats(0).unwrap().unwrap();
            assert!(after.allocated_bytes >= before.allocated_bytes + 4 * (1 << 20));
            drop(t);
            let (free, total) = cuda_mem_info(0).unwrap().unwrap();
            assert!(free <= total && total > 0);
        }
    }

    // The counting allocator is process-global and other tests in this crate allocate in parallel,
    // so only monotone totals are checked here; exact current/peak bytes and the limit are tested
    // where no other test allocates meanwhile (lora-train/tests/train/engine_sys.rs, under that
    // executable's one lock).
    #[test]
    fn counting_cpu_allocator_counts_tensor_bytes() {
        install_counting_cpu_allocator().unwrap();
        assert!(counting_cpu_allocator_installed().unwrap());
        let s0 = cpu_mem_stats().unwrap();
        let n = 1_000_000i64;
        let t = Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let s1 = cpu_mem_stats().unwrap();
        assert!(s1.total_allocated_bytes >= s0.total_allocated_bytes + 4 * n as u64);
        assert!(s1.n_allocations > s0.n_allocations);
        assert!(s1.peak_bytes >= 4 * n as u64);
        drop(t);
    }
    #[test]
    fn grad_set_undefined_drops_the_gradient() {
        let p = Tensor::ones([3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        (&p * 2.0).sum(Kind::Float).backward();
        assert_eq!(p.grad().double_value(&[1]), 2.0);
        set_grad_undefined(&mut p.shallow_clone()).unwrap();
        assert!(!p.grad().defined());
        // The next backward starts from nothing instead of adding to the old gradient.
        (&p * 3.0).sum(Kind::Float).backward();
        assert_eq!(p.grad().double_value(&[0]), 3.0);
    }

    /// The update against the same formula written with per-tensor ops, two tensors with
    /// different step counts (so different per-tensor scalars). On the CPU it is the fused pass,
    /// whose first moment may differ from libtorch's `lerp` (a fused multiply-add) by a rounding.
    #[test]
    fn adam_foreach_step_matches_per_tensor_ops() {
        tch::manual_seed(7);
        let shapes: [&[i64]; 2] = [&[4, 3], &[5]];
        let mk = || shapes.map(|s| Tensor::randn(s, (Kind::Float, Device::Cpu)));
        let (p, g, m, v0) = (mk(), mk(), mk(), mk());
        let v = v0.each_ref().map(|t| t.abs());
        let (b1, b2, lr, wd, eps) = (0.9f64, 0.999f64, 1e-2f64, 0.1f64, 1e-8f64);
        let steps = [1i32, 5];
        let neg: Vec<f64> = steps.iter().map(|&t| -(lr / (1.0 - b1.powi(t)))).collect();
        let bc2: Vec<f64> = steps.iter().map(|&t| (1.0 - b2.powi(t)).sqrt()).collect();
        let copy = |ts: &[Tensor; 2]| ts.each_ref().map(|t| t.copy());
        let (p1, m1, v1) = (copy(&p), copy(&m), copy(&v));
        adam_foreach_step(
            &p1,
            &g,
            &m1,
            &v1,
            &neg,
            &bc2,
            AdamForeachScalars {
                decay_factor: 1.0 - lr * wd,
                one_minus_beta1: 1.0 - b1,
                beta2: b2,
                one_minus_beta2: 1.0 - b2,
                eps,
            },
        )
        .unwrap();
        for i in 0..2 {
            let m2 = m[i].lerp(&g[i], 1.0 - b1);
            let v2 = &v[i] * b2 + &g[i] * &g[i] * (1.0 - b2);
            let denom = v2.sqrt() / bc2[i] + eps;
            let p2 = &p[i] * (1.0 - lr * wd) + &m2 * neg[i] / &denom;
            let close = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
            assert!(close(&m1[i], &m2) < 1e-6, "exp_avg {i}");
            assert!(close(&v1[i], &v2) < 1e-6, "exp_avg_sq {i}");
            assert!(close(&p1[i], &p2) < 1e-6, "param {i}");
            // Something really moved.
            assert!(close(&p1[i], &p[i]) > 1e-4, "param {i} unchanged");
        }
        let err = adam_foreach_step(
            &p1,
            &g[..1],
            &m1,
            &v1,
            &neg,
            &bc2,
            AdamForeachScalars {
                decay_factor: 1.0,
                one_minus_beta1: 0.1,
                beta2: 0.999,
                one_minus_beta2: 0.001,
                eps,
            },
        )
        .unwrap_err();
        assert!(err.message.contains("grads 1"), "{err}");
    }
}

/// The c10d entry points of the shim (`shim/dist.cpp`), used by [`crate::dist`].
pub(crate) mod dist {
    use super::{ShimError, ShimResult, check, ffi};
    use std::ffi::{CString, c_void};
    use tch::Tensor;

    /// Whether the shim was compiled with c10d's Gloo process group.
    pub fn has_gloo() -> ShimResult<bool> {
        let mut has = 0i32;
        // SAFETY: writes one i32 through a valid pointer.
        check("dist_has_gloo", unsafe {
            ffi::lsdk_dist_has_gloo(&mut has)
        })?;
        Ok(has == 1)
    }

    /// Whether the shim was compiled with c10d's NCCL process group.
    pub fn has_nccl() -> ShimResult<bool> {
        let mut has = 0i32;
        // SAFETY: writes one i32 through a valid pointer.
        check("dist_has_nccl", unsafe {
            ffi::lsdk_dist_has_nccl(&mut has)
        })?;
        Ok(has == 1)
    }

    /// An owned c10d process group (store + Gloo or NCCL backend) behind the shim.
    pub struct RawGroup(*mut c_void);

    // SAFETY: c10d process groups are thread-safe objects (PyTorch calls them from any thread);
    // the handle is only freed in `Drop`.
    unsafe impl Send for RawGroup {}

    impl Drop for RawGroup {
        fn drop(&mut self) {
            // SAFETY: the pointer came from `lsdk_dist_gloo_new` or `lsdk_dist_nccl_new` and is
            // freed once; a failure
            // to free has nothing left to report to.
            let _ = check("dist_free", unsafe { ffi::lsdk_dist_free(self.0) });
        }
    }

    fn c_string(op: &'static str, what: &str, s: &str) -> ShimResult<CString> {
        CString::new(s).map_err(|_| ShimError {
            op,
            message: format!("{what} {s:?} contains a NUL byte"),
        })
    }

    /// Joins a group: over Gloo when `nccl_device` is `None` (see
    /// [`crate::dist::ProcessGroup::new_gloo`]), else over NCCL on that CUDA device (see
    /// [`crate::dist::ProcessGroup::new_nccl`]).
    pub fn group_new(
        host: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout_ms: u64,
        prefix: &str,
        nccl_device: Option<usize>,
    ) -> ShimResult<RawGroup> {
        let op = if nccl_device.is_some() {
            "dist_nccl_new"
        } else {
            "dist_gloo_new"
        };
        let host = c_string(op, "host", host)?;
        let prefix = c_string(op, "prefix", prefix)?;
        let int = |what: &str, v: usize| {
            i32::try_from(v).map_err(|_| ShimError {
                op,
                message: format!("{what} {v} is out of range"),
            })
        };
        let (port, rank, world_size) = (
            i32::from(port),
            int("rank", rank)?,
            int("world_size", world_size)?,
        );
        let timeout_ms = i64::try_from(timeout_ms).unwrap_or(i64::MAX);
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: the strings live for the call; `out` is written once on success.
        check(op, unsafe {
            match nccl_device {
                None => ffi::lsdk_dist_gloo_new(
                    host.as_ptr(),
                    port,
                    rank,
                    world_size,
                    timeout_ms,
                    prefix.as_ptr(),
                    &mut out,
                ),
                Some(device) => ffi::lsdk_dist_nccl_new(
                    host.as_ptr(),
                    port,
                    rank,
                    world_size,
                    timeout_ms,
                    prefix.as_ptr(),
                    int("device index", device)?,
                    &mut out,
                ),
            }
        })?;
        Ok(RawGroup(out))
    }

    /// In-place sum over the group.
    pub fn all_reduce_sum(g: &RawGroup, t: &Tensor) -> ShimResult<()> {
        // SAFETY: `as_ptr` is a live `torch::Tensor*` owned by `t` for the whole call.
        check("dist_all_reduce_sum", unsafe {
            ffi::lsdk_dist_all_reduce_sum(g.0, t.as_ptr() as *const torch_sys::C_tensor)
        })
    }

    /// In-place broadcast from `root`.
    pub fn broadcast(g: &RawGroup, t: &Tensor, root: usize) -> ShimResult<()> {
        let root = i32::try_from(root).map_err(|_| ShimError {
            op: "dist_broadcast",
            message: format!("root rank {root} is out of range"),
        })?;
        // SAFETY: as in `all_reduce_sum`.
        check("dist_broadcast", unsafe {
            ffi::lsdk_dist_broadcast(g.0, t.as_ptr() as *const torch_sys::C_tensor, root)
        })
    }

    /// Waits for every rank.
    pub fn barrier(g: &RawGroup) -> ShimResult<()> {
        // SAFETY: a live group handle.
        check("dist_barrier", unsafe { ffi::lsdk_dist_barrier(g.0) })
    }

    /// Every rank's `t` into the rows of `out` (`[world_size, *t.shape]`, allocated by the caller).
    pub fn all_gather(g: &RawGroup, t: &Tensor, out: &Tensor) -> ShimResult<()> {
        // SAFETY: both pointers are live `torch::Tensor*` owned by `t` and `out` for the call;
        // the shim writes `out`'s storage in place.
        check("dist_all_gather", unsafe {
            ffi::lsdk_dist_all_gather(
                g.0,
                t.as_ptr() as *const torch_sys::C_tensor,
                out.as_ptr() as *const torch_sys::C_tensor,
            )
        })
    }

    /// Adds `delta` to the store's integer under `key`; returns the new value.
    pub fn store_add(g: &RawGroup, key: &str, delta: i64) -> ShimResult<i64> {
        const OP: &str = "dist_store_add";
        let key = c_string(OP, "key", key)?;
        let mut value = 0i64;
        // SAFETY: the key lives for the call; one i64 is written through a valid pointer.
        check(OP, unsafe {
            ffi::lsdk_dist_store_add(g.0, key.as_ptr(), delta, &mut value)
        })?;
        Ok(value)
    }

    /// Whether the store holds `key`.
    pub fn store_check(g: &RawGroup, key: &str) -> ShimResult<bool> {
        const OP: &str = "dist_store_check";
        let key = c_string(OP, "key", key)?;
        let mut present = 0i32;
        // SAFETY: as in `store_add`.
        check(OP, unsafe {
            ffi::lsdk_dist_store_check(g.0, key.as_ptr(), &mut present)
        })?;
        Ok(present == 1)
    }
}

// ---------------------------------------------------------------------------------------------
// Profiler

/// One event of libtorch's profiler, as [`profiler_stop`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfilerEvent {
    /// The operator's name (`aten::mm`, `AddmmBackward0`, …) or a kernel's.
    pub name: String,
    /// Its inputs' shapes as text (`[256, 576], [576, 960]`; `[]` for a scalar or non-tensor
    /// input), empty unless [`profiler_start`] was asked to record shapes.
    pub shapes: String,
    /// The recording thread's id (the profiler's own numbering).
    pub thread: u64,
    /// Start, in nanoseconds on the profiler's clock.
    pub start_ns: u64,
    /// End, in nanoseconds on the same clock (≥ `start_ns`).
    pub end_ns: u64,
    /// `true` for work on a CUDA device (kernels, copies), `false` for CPU-side operators.
    pub cuda: bool,
}

/// Starts libtorch's profiler (Kineto, the engine of Python's `torch.profiler`) on the calling
/// thread and the threads libtorch hands its work to (autograd's engine, the intra-op pool).
/// `cuda` also records CUDA kernels; `record_shapes` stores each operator's input shapes in the
/// trace.
///
/// # Errors
/// The profiler already runs in this process, or libtorch refused to start it.
pub fn profiler_start(cuda: bool, record_shapes: bool) -> ShimResult<()> {
    // SAFETY: plain integer arguments.
    check("profiler_start", unsafe {
        ffi::lsdk_profiler_start(cuda as i32, record_shapes as i32)
    })
}

unsafe extern "C" fn push_profiler_event(
    ctx: *mut std::ffi::c_void,
    name: *const c_char,
    shapes: *const c_char,
    thread: u64,
    start_ns: u64,
    end_ns: u64,
    device: i32,
) {
    // SAFETY: `ctx` is the `Vec<ProfilerEvent>` that `profiler_stop` passed, alive and borrowed
    // only by this callback during the call; `name` and `shapes` are NUL-terminated strings the
    // shim owns for the duration of the call.
    let events = unsafe { &mut *(ctx as *mut Vec<ProfilerEvent>) };
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    events.push(ProfilerEvent {
        name: text(name),
        shapes: text(shapes),
        thread,
        start_ns,
        end_ns: end_ns.max(start_ns),
        cuda: device == 1,
    });
}

/// Stops the profiler that [`profiler_start`] started, writes its Chrome trace-event JSON to
/// `trace` when given (the file `torch.profiler`'s `export_chrome_trace` writes), and returns
/// every recorded event.
///
/// # Errors
/// The profiler was not running, the path is not valid UTF-8 or holds a NUL byte, or the trace
/// could not be written.
pub fn profiler_stop(trace: Option<&std::path::Path>) -> ShimResult<Vec<ProfilerEvent>> {
    let path = match trace {
        Some(p) => {
            let s = p.to_str().ok_or_else(|| ShimError {
                op: "profiler_stop",
                message: format!("trace path {} is not valid UTF-8", p.display()),
            })?;
            Some(std::ffi::CString::new(s).map_err(|_| ShimError {
                op: "profiler_stop",
                message: format!("trace path {s:?} holds a NUL byte"),
            })?)
        }
        None => None,
    };
    let mut events: Vec<ProfilerEvent> = Vec::new();
    // SAFETY: the callback only pushes into `events`, which outlives the call; `path` is a valid
    // C string or NULL.
    check("profiler_stop", unsafe {
        ffi::lsdk_profiler_stop(
            path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr()),
            Some(push_profiler_event),
            &mut events as *mut Vec<ProfilerEvent> as *mut std::ffi::c_void,
        )
    })?;
    Ok(events)
}
