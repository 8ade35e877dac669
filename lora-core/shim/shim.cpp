// A small C ABI over the parts of libtorch 2.13 that tch 0.26 does not expose: bf16/fp16 autocast
// state, CUDA caching-allocator statistics, a counting CPU allocator (exact tensor bytes, optional
// limit), RNG generator state, the deterministic-algorithms switch, and the multi-tensor
// (`_foreach_*`) ops of the Adam update, which tch does not bind.
//
// Every function returns NULL on success or a heap-allocated error message (free it with
// `lsdk_free_error`); C++ exceptions never cross the C boundary.
//
// Headers checked against libtorch 2.13: ATen/autocast_mode.h, c10/core/CPUAllocator.h,
// c10/core/Allocator.h (CachingAllocator::Stat), ATen/DeviceAccelerator.h, ATen/Context.h.

#include <ATen/Context.h>
#include <ATen/DeviceAccelerator.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_addcdiv.h>
#include <ATen/ops/_foreach_addcmul.h>
#include <ATen/ops/_foreach_div.h>
#include <ATen/ops/_foreach_lerp.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_sqrt.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "guard.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

using lsdk::guarded;

c10::DeviceType device_type_of(int32_t device) {
  return device == 1 ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
}

// True when a CUDA accelerator is registered and has at least one device.
bool cuda_available() {
  auto acc = at::accelerator::getAccelerator(false);
  if (!acc.has_value() || acc.value() != c10::DeviceType::CUDA) {
    return false;
  }
  return at::accelerator::deviceCount() > 0;
}

// ---------------------------------------------------------------------------------------------
// Counting CPU allocator. Allocation goes through c10::alloc_cpu / c10::free_cpu (what the
// default CPU allocator uses), so a pointer allocated before installation can be freed by our
// deleter: such unknown pointers count 0 bytes.
//
// It also caches freed blocks of at least kCacheMinBytes by exact size and hands them out again
// (off by default; `lsdk_cpu_set_cache`). A training step allocates the same sizes every step:
// without the cache every large block is a fresh mmap (glibc maps blocks above its mmap
// threshold, which the trainer fixes at 128 KiB so that RSS follows the live tensors), and each
// page is faulted in and zeroed by the kernel again, step after step. The cache is bounded so that
// live + cached bytes never exceed `cache_high`, the peak of live bytes since the cache was last
// emptied: a miss that would pass it first frees cached blocks (largest first). So the memory the
// process holds for tensors is never more than its live peak, as without the cache.
struct CountingCpuAllocator final : public c10::Allocator {
  static constexpr size_t kCacheMinBytes = 128 << 10;

  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;
  int64_t current = 0;
  int64_t peak = 0;
  int64_t total_allocated = 0;
  int64_t n_allocations = 0;
  int64_t limit = 0;  // 0 = no limit
  bool cache_enabled = false;
  std::map<size_t, std::vector<void*>> cache;  // freed blocks by size
  int64_t cached = 0;                          // bytes in `cache`
  int64_t cache_high = 0;                      // peak of `current` since the cache was emptied
  int64_t cache_hits = 0;
  int64_t cache_evictions = 0;  // cached blocks freed to make room

  static void deleter(void* ptr);

  // Frees cached blocks, largest first, until live + cached + `incoming` fits under
  // `cache_high` (or nothing is cached). Called with `mu` held; the frees happen after the
  // lock is released (into `out`).
  void evict_for(int64_t incoming, std::vector<void*>& out) {
    while (cached > 0 && current + cached + incoming > cache_high) {
      auto it = std::prev(cache.end());
      out.push_back(it->second.back());
      it->second.pop_back();
      cached -= static_cast<int64_t>(it->first);
      cache_evictions += 1;
      if (it->second.empty()) {
        cache.erase(it);
      }
    }
  }

  // Frees every cached block and restarts the cache's bound from the live bytes.
  void empty_cache() {
    std::vector<void*> out;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (auto& [size, blocks] : cache) {
        out.insert(out.end(), blocks.begin(), blocks.end());
      }
      cache.clear();
      cached = 0;
      cache_high = current;
    }
    for (void* p : out) {
      c10::free_cpu(p);
    }
  }

  c10::DataPtr allocate(size_t n) override {
    void* data = nullptr;
    std::vector<void*> evicted;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (limit > 0 && current + static_cast<int64_t>(n) > limit) {
        TORCH_CHECK_WITH(
            OutOfMemoryError,
            false,
            "DefaultCPUAllocator: can't allocate memory: you tried to allocate ",
            n,
            " bytes with ",
            current,
            " bytes in use under a limit of ",
            limit,
            " bytes (set by lora_core::sys::set_cpu_alloc_limit; raise or clear the limit)");
      }
      auto it = n >= kCacheMinBytes ? cache.find(n) : cache.end();
      if (it != cache.end()) {
        data = it->second.back();
        it->second.pop_back();
        if (it->second.empty()) {
          cache.erase(it);
        }
        cached -= static_cast<int64_t>(n);
        cache_hits += 1;
      } else if (cached > 0) {
        cache_high = std::max(cache_high, current + static_cast<int64_t>(n));
        evict_for(static_cast<int64_t>(n), evicted);
      }
    }
    for (void* p : evicted) {
      c10::free_cpu(p);
    }
    if (data == nullptr) {
      data = c10::alloc_cpu(n);
    }
    {
      std::lock_guard<std::mutex> lock(mu);
      sizes[data] = n;
      current += static_cast<int64_t>(n);
      total_allocated += static_cast<int64_t>(n);
      n_allocations += 1;
      if (current > peak) {
        peak = current;
      }
      if (current > cache_high) {
        cache_high = current;
      }
    }
    return {data, data, &CountingCpuAllocator::deleter, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &CountingCpuAllocator::deleter;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator* counting_allocator() {
  // Never destroyed: libtorch keeps the pointer for the life of the process.
  static CountingCpuAllocator* alloc = new CountingCpuAllocator();
  return alloc;
}

void CountingCpuAllocator::deleter(void* ptr) {
  if (ptr == nullptr) {
    return;
  }
  CountingCpuAllocator* a = counting_allocator();
  {
    std::lock_guard<std::mutex> lock(a->mu);
    auto it = a->sizes.find(ptr);
    if (it != a->sizes.end()) {
      size_t n = it->second;
      a->current -= static_cast<int64_t>(n);
      a->sizes.erase(it);
      // live + cached stays what it was, so within the bound: keep the block for reuse
      if (a->cache_enabled && n >= kCacheMinBytes) {
        a->cache[n].push_back(ptr);
        a->cached += static_cast<int64_t>(n);
        return;
      }
    }
  }
  c10::free_cpu(ptr);
}

std::atomic<bool> counting_installed{false};

// Adam/AdamW over `n` fp32 values in one pass (see `lsdk_adam_foreach_step` for the formula):
// each value is read and written once, where the multi-tensor ops make eight passes over the
// moments and a temporary of the denominators. Each operation is the one libtorch's element-wise
// kernel performs, in its order (`addcmul`: `v + (s·g)·g`; `addcdiv`: `p + (s·m)/d`); libtorch's
// vectorized `lerp` fuses its multiply-add, so `m` can differ from it by one rounding.
LSDK_CLONES void adam_step_f32(
    float* p,
    const float* g,
    float* m,
    float* v,
    int64_t n,
    float decay_factor,
    float one_minus_beta1,
    float beta2,
    float one_minus_beta2,
    float bias_correction2_sqrt,
    float eps,
    float neg_step_size) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    const float mi = m[i] + one_minus_beta1 * (gi - m[i]);
    const float vi = v[i] * beta2 + (one_minus_beta2 * gi) * gi;
    const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay_factor + (neg_step_size * mi) / denom;
  }
}

// Whether `t` is a dense f32 CPU tensor of `numel` elements that the fused step can address as
// one array.
bool fused_adam_operand(const at::Tensor& t, int64_t numel) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
      t.numel() == numel;
}

}  // namespace

extern "C" {

void lsdk_free_error(char* msg) {
  std::free(msg);
}

// ---- autocast ---------------------------------------------------------------------------------

char* lsdk_autocast_get(int32_t device, int32_t* enabled, int32_t* dtype) {
  return guarded([&] {
    auto dt = device_type_of(device);
    *enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    *dtype = static_cast<int32_t>(at::autocast::get_autocast_dtype(dt));
  });
}

char* lsdk_autocast_set(int32_t device, int32_t enabled, int32_t dtype) {
  return guarded([&] {
    auto dt = device_type_of(device);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, enabled != 0);
  });
}

char* lsdk_autocast_increment_nesting(int32_t* depth) {
  return guarded([&] { *depth = at::autocast::increment_nesting(); });
}

char* lsdk_autocast_decrement_nesting(int32_t* depth) {
  return guarded([&] { *depth = at::autocast::decrement_nesting(); });
}

char* lsdk_autocast_clear_cache() {
  return guarded([&] { at::autocast::clear_cache(); });
}

// ---- CUDA allocator ---------------------------------------------------------------------------

char* lsdk_cuda_device_count(int32_t* count) {
  return guarded([&] { *count = cuda_available() ? static_cast<int32_t>(at::accelerator::deviceCount()) : 0; });
}

// out: allocated current, allocated peak, reserved current, reserved peak, active current,
// active peak, requested current, requested peak, n allocations (current) — 9 values.
char* lsdk_cuda_mem_stats(int32_t device, int64_t* out) {
  return guarded([&] {
    TORCH_CHECK(cuda_available(), "no CUDA device is available");
    auto s = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = s.allocated_bytes[agg].current;
    out[1] = s.allocated_bytes[agg].peak;
    out[2] = s.reserved_bytes[agg].current;
    out[3] = s.reserved_bytes[agg].peak;
    out[4] = s.active_bytes[agg].current;
    out[5] = s.active_bytes[agg].peak;
    out[6] = s.requested_bytes[agg].current;
    out[7] = s.requested_bytes[agg].peak;
    out[8] = s.allocation[agg].current;
  });
}

char* lsdk_cuda_reset_peak(int32_t device) {
  return guarded([&] {
    TORCH_CHECK(cuda_available(), "no CUDA device is available");
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  });
}

char* lsdk_cuda_empty_cache() {
  return guarded([&] {
    TORCH_CHECK(cuda_available(), "no CUDA device is available");
    at::accelerator::emptyCache();
  });
}

char* lsdk_cuda_mem_info(int32_t device, uint64_t* free_bytes, uint64_t* total_bytes) {
  return guarded([&] {
    TORCH_CHECK(cuda_available(), "no CUDA device is available");
    auto info = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = static_cast<uint64_t>(info.first);
    *total_bytes = static_cast<uint64_t>(info.second);
  });
}

// ---- counting CPU allocator -------------------------------------------------------------------

char* lsdk_cpu_counting_install() {
  return guarded([&] {
    bool expected = false;
    if (counting_installed.compare_exchange_strong(expected, true)) {
      // Priority above the default allocator's (0) so later default registrations do not win.
      c10::SetCPUAllocator(counting_allocator(), /*priority=*/100);
    }
  });
}

char* lsdk_cpu_counting_installed(int32_t* installed) {
  return guarded([&] {
    *installed = (counting_installed.load() && c10::GetCPUAllocator() == counting_allocator()) ? 1 : 0;
  });
}

// out: current, peak, total allocated, number of allocations, limit (0 = none), live blocks,
// cached bytes, cache hits, cache evictions.
char* lsdk_cpu_mem_stats(int64_t* out) {
  return guarded([&] {
    CountingCpuAllocator* a = counting_allocator();
    std::lock_guard<std::mutex> lock(a->mu);
    out[0] = a->current;
    out[1] = a->peak;
    out[2] = a->total_allocated;
    out[3] = a->n_allocations;
    out[4] = a->limit;
    out[5] = static_cast<int64_t>(a->sizes.size());
    out[6] = a->cached;
    out[7] = a->cache_hits;
    out[8] = a->cache_evictions;
  });
}

// Turns the cache of freed blocks on or off; off also empties it.
char* lsdk_cpu_set_cache(int32_t enabled) {
  return guarded([&] {
    CountingCpuAllocator* a = counting_allocator();
    {
      std::lock_guard<std::mutex> lock(a->mu);
      a->cache_enabled = enabled != 0;
    }
    if (enabled == 0) {
      a->empty_cache();
    }
  });
}

char* lsdk_cpu_empty_cache() {
  return guarded([&] { counting_allocator()->empty_cache(); });
}

char* lsdk_cpu_reset_peak() {
  return guarded([&] {
    CountingCpuAllocator* a = counting_allocator();
    std::lock_guard<std::mutex> lock(a->mu);
    a->peak = a->current;
  });
}

char* lsdk_cpu_set_limit(int64_t limit) {
  return guarded([&] {
    TORCH_CHECK(limit >= 0, "the CPU allocation limit must be >= 0 bytes, got ", limit);
    CountingCpuAllocator* a = counting_allocator();
    std::lock_guard<std::mutex> lock(a->mu);
    a->limit = limit;
  });
}

// ---- RNG and determinism ----------------------------------------------------------------------

char* lsdk_manual_seed(uint64_t seed) {
  return guarded([&] { at::manual_seed(seed); });
}

// Copies the generator state into buf when cap is large enough; *len receives the state size.
char* lsdk_rng_get_state(int32_t device, int32_t index, uint8_t* buf, int64_t cap, int64_t* len) {
  return guarded([&] {
    auto dt = device_type_of(device);
    if (dt == c10::DeviceType::CUDA) {
      TORCH_CHECK(cuda_available(), "no CUDA device is available");
    }
    auto gen = at::globalContext().defaultGenerator(c10::Device(dt, static_cast<c10::DeviceIndex>(index)));
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    auto n = static_cast<int64_t>(state.numel() * state.element_size());
    *len = n;
    if (buf != nullptr && cap >= n) {
      std::memcpy(buf, state.data_ptr(), static_cast<size_t>(n));
    }
  });
}

char* lsdk_rng_set_state(int32_t device, int32_t index, const uint8_t* buf, int64_t len) {
  return guarded([&] {
    auto dt = device_type_of(device);
    if (dt == c10::DeviceType::CUDA) {
      TORCH_CHECK(cuda_available(), "no CUDA device is available");
    }
    auto gen = at::globalContext().defaultGenerator(c10::Device(dt, static_cast<c10::DeviceIndex>(index)));
    auto state = at::empty({len}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr(), buf, static_cast<size_t>(len));
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
}

char* lsdk_set_deterministic(int32_t enabled, int32_t warn_only) {
  return guarded([&] { at::globalContext().setDeterministicAlgorithms(enabled != 0, warn_only != 0); });
}

char* lsdk_get_deterministic(int32_t* enabled) {
  return guarded([&] { *enabled = at::globalContext().deterministicAlgorithms() ? 1 : 0; });
}

// ---- gradients and multi-tensor optimizer ops ---------------------------------------------------

// Drops the gradient of `t` (what `optimizer.zero_grad(set_to_none=True)` does per parameter).
char* lsdk_grad_set_undefined(at::Tensor* t) {
  return guarded([&] {
    TORCH_CHECK(t != nullptr, "null tensor");
    t->mutable_grad().reset();
  });
}

// One Adam/AdamW update of `n` fp32 tensors in the order of torch.optim.adam's
// `_multi_tensor_adam` (torch 2.13, non-capturable, non-amsgrad):
//   params *= decay_factor                      (skipped when decay_factor == 1)
//   exp_avgs.lerp_(grads, one_minus_beta1)
//   exp_avg_sqs *= beta2; exp_avg_sqs.addcmul_(grads, grads, one_minus_beta2)
//   denom = sqrt(exp_avg_sqs) / bias_correction2_sqrt[i] + eps
//   params.addcdiv_(exp_avgs, denom, neg_step_size[i])
// The per-tensor scalars come from the caller so that every formula lives in one place.
char* lsdk_adam_foreach_step(
    const at::Tensor* const* params,
    const at::Tensor* const* grads,
    const at::Tensor* const* exp_avgs,
    const at::Tensor* const* exp_avg_sqs,
    const double* neg_step_size,
    const double* bias_correction2_sqrt,
    int64_t n,
    double decay_factor,
    double one_minus_beta1,
    double beta2,
    double one_minus_beta2,
    double eps) {
  return guarded([&] {
    TORCH_CHECK(n >= 0, "negative tensor count");
    std::vector<at::Tensor> p, g, m, v;
    std::vector<c10::Scalar> step, bc2;
    p.reserve(n);
    g.reserve(n);
    m.reserve(n);
    v.reserve(n);
    step.reserve(n);
    bc2.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(params[i] && grads[i] && exp_avgs[i] && exp_avg_sqs[i], "null tensor at ", i);
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
      step.emplace_back(neg_step_size[i]);
      bc2.emplace_back(bias_correction2_sqrt[i]);
    }
    if (n == 0) {
      return;
    }
    // On the CPU, with every operand a contiguous f32 array of its parameter's size and every
    // tensor written (params, moments) in a storage of its own that no gradient reads: one pass
    // per tensor, tensors shared out over libtorch's intra-op threads where the caller runs more
    // than one.
    bool fused = true;
    std::unordered_set<const void*> written;
    for (int64_t i = 0; i < n && fused; ++i) {
      const int64_t numel = p[i].numel();
      fused = fused_adam_operand(p[i], numel) && fused_adam_operand(g[i], numel) &&
          fused_adam_operand(m[i], numel) && fused_adam_operand(v[i], numel);
      for (const at::Tensor* t : {&p[i], &m[i], &v[i]}) {
        fused = fused && written.insert(t->storage().unsafeGetStorageImpl()).second;
      }
    }
    for (int64_t i = 0; i < n && fused; ++i) {
      fused = written.count(g[i].storage().unsafeGetStorageImpl()) == 0;
    }
    if (fused) {
      at::NoGradGuard no_grad;
      RECORD_FUNCTION("lsdk::adam_step", std::vector<c10::IValue>());
      at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          adam_step_f32(
              p[i].data_ptr<float>(),
              g[i].data_ptr<float>(),
              m[i].data_ptr<float>(),
              v[i].data_ptr<float>(),
              p[i].numel(),
              static_cast<float>(decay_factor),
              static_cast<float>(one_minus_beta1),
              static_cast<float>(beta2),
              static_cast<float>(one_minus_beta2),
              static_cast<float>(bias_correction2_sqrt[i]),
              static_cast<float>(eps),
              static_cast<float>(neg_step_size[i]));
        }
      });
      // written in place through their data: tell autograd, as the in-place ops above would (a
      // graph that saved one of them then refuses to backpropagate through the old values)
      for (int64_t i = 0; i < n; ++i) {
        torch::autograd::impl::bump_version(p[i]);
        torch::autograd::impl::bump_version(m[i]);
        torch::autograd::impl::bump_version(v[i]);
      }
      return;
    }
    if (decay_factor != 1.0) {
      at::_foreach_mul_(p, decay_factor);
    }
    at::_foreach_lerp_(m, g, one_minus_beta1);
    at::_foreach_mul_(v, beta2);
    at::_foreach_addcmul_(v, g, g, one_minus_beta2);
    auto denom = at::_foreach_sqrt(v);
    at::_foreach_div_(denom, bc2);
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(p, m, denom, step);
  });
}

}  // extern "C"
