// The shim's error convention, shared by its source files: every `extern "C"` entry point runs
// its body through `guarded`, which returns nullptr on success or a malloc'ed message (freed by
// `lsdk_free_error`) for any C++ exception — nothing unwinds into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

// A hot loop compiled for AVX-512, AVX2 and baseline x86-64, the loader picking one at run time
// (GCC `target_clones`); elsewhere one plain build.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LSDK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LSDK_CLONES
#endif

namespace lsdk {

inline char* dup_message(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out == nullptr) {
    return nullptr;
  }
  std::memcpy(out, s.data(), s.size());
  out[s.size()] = '\0';
  return out;
}

template <typename F>
char* guarded(F&& f) {
  try {
    f();
    return nullptr;
  } catch (const c10::Error& e) {
    return dup_message(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return dup_message(e.what());
  } catch (...) {
    return dup_message("unknown C++ exception in the libtorch shim");
  }
}

// Whether libtorch multiplies bf16 matrices on this CPU with oneDNN's vectorized kernels: the
// condition of PyTorch's `mkldnn_bf16_device_check()` (aten/src/ATen/native/mkldnn/Utils.h),
// AVX-512 BW, VL and DQ on x86-64; other architectures answer true (libtorch's own choice is kept
// there). Where it is false, libtorch's bf16 GEMM runs scalar loops and the shim computes bf16
// products by f32 GEMMs over the widened bf16 operands instead (bf16_linear.cpp, qlinear.cpp).
inline bool cpu_has_fast_bf16_gemm() {
#if defined(__x86_64__)
  static const bool fast = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq");
  return fast;
#else
  return true;
#endif
}

}  // namespace lsdk
