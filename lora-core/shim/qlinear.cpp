// Linear layers over a frozen quantized weight on the CPU, computed from the quantized blocks one
// tile of output rows at a time: `y = x · Wᵀ` forward and `∂x = g · W` backward, W never held
// dense beyond one tile (at most `tile_elements` values, the caller's bound).
//
// Each tile is decoded into a float buffer by the loops below (compiled for AVX-512, AVX2 and
// baseline x86-64 and picked at run time by the loader, GCC `target_clones`; threaded over rows
// with libtorch's intra-op pool) and multiplied with libtorch's GEMM. The autograd function saves
// only the quantized tensors, so a backward pass decodes the tiles again instead of keeping each
// layer's dense weight alive from the forward pass.
//
// Layouts (lora-core `quant.rs`, `QuantWeight`):
// - GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1: `codes` `[out, in/32, 32]` i8 (Q8_0) or
//   `[out, in/32, 16]` u8, two 4-bit codes per byte in weight order (high nibble first); `scales`
//   (and Q4_1/Q5_1 `mins`) f16 `[out, in/32]`; Q5_0/Q5_1 `hbits` `[out, in/32, 4]` u8, bit j of
//   the block's 4 bytes (little endian) the 5th bit of weight j. Q8_0: w = d·q; Q4_0:
//   w = d·(q − 8); Q4_1: w = m + d·q; Q5_0: w = d·(q − 16); Q5_1: w = m + d·q (llama.cpp
//   `dequantize_row_q8_0/q4_0/q4_1/q5_0/q5_1`).
// - GGUF k-quants, super-blocks of 256: `codes` `[out, in/256, 128]` u8 nibble pairs in weight
//   order; `scales` f16 `d` `[out, in/256]`; Q4_K/Q5_K: `mins` f16 `dmin`, `sub_scales` u8
//   `[out, in/256, 16]` (8 six-bit scales then 8 six-bit minimums, one per 32 weights),
//   w = (d·sc)·q − dmin·m, Q5_K adding 16 × the bit of `hbits` `[out, in/256, 32]` to q; Q6_K:
//   `sub_scales` i8 `[out, in/256, 16]` (one per 16 weights), `hbits` `[out, in/256, 64]` two
//   bits per weight, w = (d·sc)·(q − 32) (llama.cpp `dequantize_row_q4_K/q5_K/q6_K`). The
//   products d·sc (and (d·sc)·q for Q4_K/Q5_K) are exact in f32.
// - fp8 e4m3fn: `codes` `[out, in]` u8 holding the bits; decoded through a 256-entry table built
//   from c10's conversion.
// - NF4 (QLoRA): `codes` `[out·in/64, 32]` u8 over the row-major flattened matrix (high nibble
//   first), `table` f32 `[256, 2]` the two NF4 values of each byte; absmax per 64 weights is
//   `scales` f32, or with double quantization `scales` i8 · `dq_scales[block / 256]` +
//   `dq_offset`.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/custom_function.h>

#include "guard.h"

#include <algorithm>
#include <cstdint>

namespace {

enum QKind : int32_t {
  kQ8_0 = 0,
  kQ4_0 = 1,
  kQ4_1 = 2,
  kNf4 = 3,
  kNf4Dq = 4,
  kQ5_0 = 5,
  kQ5_1 = 6,
  kQ4K = 7,
  kQ5K = 8,
  kQ6K = 9,
  kFp8 = 10,
};

bool is_k_quant(int32_t kind) {
  return kind == kQ4K || kind == kQ5K || kind == kQ6K;
}

struct QWeight {
  int32_t kind;
  int64_t out;
  int64_t in;
  int64_t tile_elements;  // most weights decoded at once
  double dq_offset;
  at::Tensor codes, scales, mins, sub_scales, hbits, dq_scales, table;
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define LSDK_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LSDK_CLONES
#endif

// Rows [r0, r1) of a GGUF weight into `dst` (row-major, `in` per row). Each block's codes are
// first unpacked to 32 small integers, then scaled in one straight loop of 32 (vectorized).
LSDK_CLONES void decode_gguf_rows(
    int32_t kind,
    int64_t in,
    int64_t r0,
    int64_t r1,
    const uint8_t* codes,
    const c10::Half* scales,
    const c10::Half* mins,
    const uint8_t* hbits,
    float* dst) {
  const int64_t nb = in / 32;
  float q[32];
  for (int64_t r = r0; r < r1; ++r) {
    float* out = dst + (r - r0) * in;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = r * nb + b;
      const float d = static_cast<float>(scales[blk]);
      float* o = out + b * 32;
      float m = 0.0f;
      if (kind == kQ8_0) {
        const int8_t* c = reinterpret_cast<const int8_t*>(codes) + blk * 32;
        for (int j = 0; j < 32; ++j) {
          q[j] = static_cast<float>(c[j]);
        }
      } else {
        // two codes per byte in weight order, high nibble first; Q4_0 stores q + 8, Q5_0 q + 16
        const uint8_t* c = codes + blk * 16;
        const float offset = kind == kQ4_0 ? 8.0f : (kind == kQ5_0 ? 16.0f : 0.0f);
        for (int k = 0; k < 16; ++k) {
          q[2 * k] = static_cast<float>(c[k] >> 4) - offset;
          q[2 * k + 1] = static_cast<float>(c[k] & 0x0F) - offset;
        }
        if (kind == kQ5_0 || kind == kQ5_1) {
          const uint8_t* h = hbits + blk * 4;
          for (int j = 0; j < 32; ++j) {
            q[j] += static_cast<float>(((h[j >> 3] >> (j & 7)) & 1) << 4);
          }
        }
        if (kind == kQ4_1 || kind == kQ5_1) {
          m = static_cast<float>(mins[blk]);
        }
      }
      for (int j = 0; j < 32; ++j) {
        o[j] = m + d * q[j];
      }
    }
  }
}

// Rows [r0, r1) of a k-quant weight into `dst`. Each super-block's codes are first unpacked to
// 256 small integers, then each sub-block is scaled in one straight loop (vectorized).
LSDK_CLONES void decode_kquant_rows(
    int32_t kind,
    int64_t in,
    int64_t r0,
    int64_t r1,
    const uint8_t* codes,
    const c10::Half* scales,
    const c10::Half* mins,
    const uint8_t* sub_scales,
    const uint8_t* hbits,
    float* dst) {
  const int64_t nb = in / 256;
  float q[256];
  for (int64_t r = r0; r < r1; ++r) {
    float* out = dst + (r - r0) * in;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t blk = r * nb + b;
      const float d = static_cast<float>(scales[blk]);
      float* o = out + b * 256;
      const uint8_t* c = codes + blk * 128;
      for (int k = 0; k < 128; ++k) {
        q[2 * k] = static_cast<float>(c[k] >> 4);
        q[2 * k + 1] = static_cast<float>(c[k] & 0x0F);
      }
      const uint8_t* sub = sub_scales + blk * 16;
      if (kind == kQ6K) {
        const uint8_t* h = hbits + blk * 64;
        for (int j = 0; j < 256; ++j) {
          q[j] += static_cast<float>(((h[j >> 2] >> (2 * (j & 3))) & 3) << 4) - 32.0f;
        }
        for (int s = 0; s < 16; ++s) {
          const float ds = d * static_cast<float>(static_cast<int8_t>(sub[s]));
          for (int j = 0; j < 16; ++j) {
            o[16 * s + j] = ds * q[16 * s + j];
          }
        }
        continue;
      }
      if (kind == kQ5K) {
        const uint8_t* h = hbits + blk * 32;
        for (int j = 0; j < 256; ++j) {
          q[j] += static_cast<float>(((h[j >> 3] >> (j & 7)) & 1) << 4);
        }
      }
      const float dmin = static_cast<float>(mins[blk]);
      for (int s = 0; s < 8; ++s) {
        const float ds = d * static_cast<float>(sub[s]);
        const float dm = dmin * static_cast<float>(sub[8 + s]);
        for (int j = 0; j < 32; ++j) {
          o[32 * s + j] = ds * q[32 * s + j] - dm;
        }
      }
    }
  }
}

// Rows [r0, r1) of an fp8 weight into `dst` through the 256-value table `lut`.
LSDK_CLONES void decode_fp8_rows(
    int64_t in,
    int64_t r0,
    int64_t r1,
    const uint8_t* codes,
    const float* lut,
    float* dst) {
  const uint8_t* c = codes + r0 * in;
  const int64_t n = (r1 - r0) * in;
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = lut[c[i]];
  }
}

// Rows [r0, r1) of an NF4 weight into `dst`; blocks of 64 run over the flattened matrix, so a
// block may span two rows when `in` is not a multiple of 64. `lut` holds the 16 NF4 values.
LSDK_CLONES void decode_nf4_rows(
    bool double_quant,
    int64_t in,
    int64_t r0,
    int64_t r1,
    const uint8_t* codes,
    const void* scales,
    const float* dq_scales,
    float dq_offset,
    const float* lut,
    float* dst) {
  const int64_t first = r0 * in;
  const int64_t last = r1 * in;
  auto absmax_of = [&](int64_t blk) {
    return double_quant
        ? static_cast<float>(static_cast<const int8_t*>(scales)[blk]) * dq_scales[blk / 256] + dq_offset
        : static_cast<const float*>(scales)[blk];
  };
  if (first % 64 == 0 && last % 64 == 0) {
    // whole blocks: unpack 64 indices, then one straight loop of 64
    int32_t idx[64];
    for (int64_t blk = first / 64; blk < last / 64; ++blk) {
      const uint8_t* c = codes + blk * 32;
      for (int k = 0; k < 32; ++k) {
        idx[2 * k] = c[k] >> 4;
        idx[2 * k + 1] = c[k] & 0x0F;
      }
      const float a = absmax_of(blk);
      float* o = dst + (blk * 64 - first);
      for (int j = 0; j < 64; ++j) {
        o[j] = a * lut[idx[j]];
      }
    }
    return;
  }
  for (int64_t f = first; f < last; ++f) {
    const uint8_t byte = codes[f / 2];
    const int v = (f & 1) != 0 ? (byte & 0x0F) : (byte >> 4);
    dst[f - first] = absmax_of(f / 64) * lut[v];
  }
}

// Decodes output rows [r0, r1) into the float tile `dst` `[r1 − r0, in]`, threaded over rows.
void decode_rows(const QWeight& w, int64_t r0, int64_t r1, float* dst) {
  const int64_t in = w.in;
  const uint8_t* codes = static_cast<const uint8_t*>(w.codes.data_ptr());
  // NF4 code values: the table maps byte b to (value(b >> 4), value(b & 15))
  float lut[16] = {};
  if (w.table.defined()) {
    const float* table = w.table.data_ptr<float>();
    for (int v = 0; v < 16; ++v) {
      lut[v] = table[2 * (v << 4)];
    }
  }
  // about 16 Ki weights per task
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(in, 1));
  if (w.kind == kFp8) {
    float fp8[256];
    for (int v = 0; v < 256; ++v) {
      fp8[v] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(v), c10::Float8_e4m3fn::from_bits()));
    }
    at::parallel_for(r0, r1, grain, [&](int64_t b, int64_t e) {
      decode_fp8_rows(in, b, e, codes, fp8, dst + (b - r0) * in);
    });
  } else if (is_k_quant(w.kind)) {
    const c10::Half* scales = w.scales.data_ptr<c10::Half>();
    const c10::Half* mins = w.kind != kQ6K ? w.mins.data_ptr<c10::Half>() : nullptr;
    const uint8_t* sub = static_cast<const uint8_t*>(w.sub_scales.data_ptr());
    const uint8_t* hb = w.kind != kQ4K ? static_cast<const uint8_t*>(w.hbits.data_ptr()) : nullptr;
    at::parallel_for(r0, r1, grain, [&](int64_t b, int64_t e) {
      decode_kquant_rows(w.kind, in, b, e, codes, scales, mins, sub, hb, dst + (b - r0) * in);
    });
  } else if (w.kind == kNf4 || w.kind == kNf4Dq) {
    const bool dq = w.kind == kNf4Dq;
    const void* scales = w.scales.data_ptr();
    const float* dqs = dq ? w.dq_scales.data_ptr<float>() : nullptr;
    const float off = static_cast<float>(w.dq_offset);
    at::parallel_for(r0, r1, grain, [&](int64_t b, int64_t e) {
      decode_nf4_rows(dq, in, b, e, codes, scales, dqs, off, lut, dst + (b - r0) * in);
    });
  } else {
    const c10::Half* scales = w.scales.data_ptr<c10::Half>();
    const c10::Half* mins = w.kind == kQ4_1 || w.kind == kQ5_1 ? w.mins.data_ptr<c10::Half>() : nullptr;
    const uint8_t* hb =
        w.kind == kQ5_0 || w.kind == kQ5_1 ? static_cast<const uint8_t*>(w.hbits.data_ptr()) : nullptr;
    at::parallel_for(r0, r1, grain, [&](int64_t b, int64_t e) {
      decode_gguf_rows(w.kind, in, b, e, codes, scales, mins, hb, dst + (b - r0) * in);
    });
  }
}

// Output rows per tile.
int64_t tile_rows(const QWeight& w) {
  return std::max<int64_t>(1, std::min(w.out, w.tile_elements / std::max<int64_t>(w.in, 1)));
}

// A `[rows, cols]` buffer of `kind` for this thread, reused from call to call: a fresh tile per
// call would be a fresh mapping (large allocations are mmap'ed) whose pages fault in on every
// decode. It grows to the largest tile asked for (at most `tile_elements` values).
at::Tensor tile_buffer(int slot, at::ScalarType kind, int64_t rows, int64_t cols) {
  thread_local at::Tensor buffers[2];
  at::Tensor& b = buffers[slot];
  if (!b.defined() || b.scalar_type() != kind || b.numel() < rows * cols) {
    b = at::empty({rows * cols}, at::TensorOptions().dtype(kind));
  }
  return b.narrow(0, 0, rows * cols).view({rows, cols});
}

// Calls `f(r0, rows, tile)` for each tile of output rows, `tile` `[rows, in]` in `kind`.
template <typename F>
void for_each_tile(const QWeight& w, at::ScalarType kind, F&& f) {
  const int64_t t = tile_rows(w);
  auto fbuf = tile_buffer(0, at::kFloat, t, w.in);
  at::Tensor kbuf;
  if (kind != at::kFloat) {
    kbuf = tile_buffer(1, kind, t, w.in);
  }
  for (int64_t r0 = 0; r0 < w.out; r0 += t) {
    const int64_t rows = std::min(t, w.out - r0);
    decode_rows(w, r0, r0 + rows, fbuf.data_ptr<float>());
    at::Tensor tile = fbuf.narrow(0, 0, rows);
    if (kind != at::kFloat) {
      at::Tensor k = kbuf.narrow(0, 0, rows);
      k.copy_(tile);
      tile = k;
    }
    f(r0, rows, tile);
  }
}

// y `[n, out]` = x `[n, in]` · Wᵀ in x's dtype.
at::Tensor qlinear_forward(const QWeight& w, const at::Tensor& x) {
  const int64_t n = x.size(0);
  if (tile_rows(w) >= w.out) {
    at::Tensor y;
    for_each_tile(w, x.scalar_type(), [&](int64_t, int64_t, const at::Tensor& tile) {
      y = at::mm(x, tile.t());
    });
    return y;
  }
  auto y = at::empty({n, w.out}, x.options());
  for_each_tile(w, x.scalar_type(), [&](int64_t r0, int64_t rows, const at::Tensor& tile) {
    y.narrow(1, r0, rows).copy_(at::mm(x, tile.t()));
  });
  return y;
}

// ∂x `[n, in]` = g `[n, out]` · W in g's dtype.
at::Tensor qlinear_input_grad(const QWeight& w, const at::Tensor& g) {
  at::Tensor gx;
  for_each_tile(w, g.scalar_type(), [&](int64_t r0, int64_t rows, const at::Tensor& tile) {
    auto gs = g.narrow(1, r0, rows);
    if (gx.defined()) {
      gx.addmm_(gs, tile);
    } else {
      gx = at::mm(gs, tile);
    }
  });
  return gx;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

QWeight saved_weight(AutogradContext* ctx) {
  const auto& d = ctx->saved_data;
  QWeight w;
  w.kind = static_cast<int32_t>(d.at("kind").toInt());
  w.out = d.at("out").toInt();
  w.in = d.at("in").toInt();
  w.tile_elements = d.at("tile_elements").toInt();
  w.dq_offset = d.at("dq_offset").toDouble();
  w.codes = d.at("codes").toTensor();
  w.scales = d.at("scales").toTensor();
  w.mins = d.at("mins").toTensor();
  w.sub_scales = d.at("sub_scales").toTensor();
  w.hbits = d.at("hbits").toTensor();
  w.dq_scales = d.at("dq_scales").toTensor();
  w.table = d.at("table").toTensor();
  return w;
}

// The autograd function: only `x` takes a gradient; the quantized tensors are saved as they are.
struct QLinearFunction : public torch::autograd::Function<QLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const QWeight& w) {
    ctx->saved_data["kind"] = static_cast<int64_t>(w.kind);
    ctx->saved_data["out"] = w.out;
    ctx->saved_data["in"] = w.in;
    ctx->saved_data["tile_elements"] = w.tile_elements;
    ctx->saved_data["dq_offset"] = w.dq_offset;
    ctx->saved_data["codes"] = w.codes;
    ctx->saved_data["scales"] = w.scales;
    ctx->saved_data["mins"] = w.mins;
    ctx->saved_data["sub_scales"] = w.sub_scales;
    ctx->saved_data["hbits"] = w.hbits;
    ctx->saved_data["dq_scales"] = w.dq_scales;
    ctx->saved_data["table"] = w.table;
    return qlinear_forward(w, x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const QWeight w = saved_weight(ctx);
    auto g = grads[0].contiguous();
    return {qlinear_input_grad(w, g), at::Tensor()};
  }
};

// The weight's tensors, checked against `kind`'s layout for an `[out, in]` matrix.
QWeight make_weight(
    int32_t kind,
    int64_t out,
    int64_t in,
    const at::Tensor* codes,
    const at::Tensor* scales,
    const at::Tensor* mins,
    const at::Tensor* sub_scales,
    const at::Tensor* hbits,
    const at::Tensor* dq_scales,
    const at::Tensor* table,
    double dq_offset,
    int64_t tile_elements) {
  TORCH_CHECK(codes != nullptr && scales != nullptr, "null weight tensor");
  TORCH_CHECK(tile_elements > 0, "the tile bound must be positive");
  TORCH_CHECK(kind >= kQ8_0 && kind <= kFp8, "unknown quantization kind ", kind);
  TORCH_CHECK(out > 0 && in > 0, "shape [", out, ", ", in, "] must be positive");
  QWeight w;
  w.kind = kind;
  w.out = out;
  w.in = in;
  w.tile_elements = tile_elements;
  w.dq_offset = dq_offset;
  w.codes = codes->contiguous();
  w.scales = scales->contiguous();
  w.mins = mins != nullptr ? mins->contiguous() : at::Tensor();
  w.sub_scales = sub_scales != nullptr ? sub_scales->contiguous() : at::Tensor();
  w.hbits = hbits != nullptr ? hbits->contiguous() : at::Tensor();
  w.dq_scales = dq_scales != nullptr ? dq_scales->contiguous() : at::Tensor();
  w.table = table != nullptr ? table->contiguous() : at::Tensor();
  const int64_t numel = out * in;
  if (kind == kNf4 || kind == kNf4Dq) {
    TORCH_CHECK(numel % 64 == 0, "NF4 needs out·in divisible by 64");
    TORCH_CHECK(w.codes.numel() == numel / 2, "NF4 codes: expected ", numel / 2, " bytes");
    TORCH_CHECK(w.table.defined() && w.table.numel() == 512, "NF4 needs its [256, 2] table");
    TORCH_CHECK(w.scales.numel() == numel / 64, "NF4 absmax: expected ", numel / 64, " values");
    if (kind == kNf4Dq) {
      TORCH_CHECK(w.scales.scalar_type() == at::kChar, "double-quantized absmax must be int8");
      TORCH_CHECK(
          w.dq_scales.defined() && w.dq_scales.scalar_type() == at::kFloat &&
              w.dq_scales.numel() * 256 >= numel / 64,
          "double quantization needs one f32 scale per 256 blocks");
    } else {
      TORCH_CHECK(w.scales.scalar_type() == at::kFloat, "NF4 absmax must be float32");
    }
  } else if (kind == kFp8) {
    TORCH_CHECK(w.codes.numel() == numel, "fp8 codes: expected ", numel, " bytes");
    TORCH_CHECK(w.codes.scalar_type() == at::kByte, "fp8 codes must be the uint8 bits");
  } else {
    const bool kq = is_k_quant(kind);
    const int64_t bw = kq ? 256 : 32;
    TORCH_CHECK(in % bw == 0, "GGUF blocks need in divisible by ", bw);
    const int64_t blocks = numel / bw;
    const int64_t per_block = kind == kQ8_0 ? 32 : bw / 2;
    TORCH_CHECK(w.codes.numel() == blocks * per_block, "GGUF codes: wrong byte count");
    TORCH_CHECK(
        w.scales.scalar_type() == at::kHalf && w.scales.numel() == blocks,
        "GGUF scales must be f16, one per block");
    if (kind == kQ4_1 || kind == kQ5_1 || kind == kQ4K || kind == kQ5K) {
      TORCH_CHECK(
          w.mins.defined() && w.mins.scalar_type() == at::kHalf && w.mins.numel() == blocks,
          "this kind needs f16 mins, one per block");
    }
    if (kq) {
      TORCH_CHECK(
          w.sub_scales.defined() && w.sub_scales.numel() == blocks * 16 &&
              w.sub_scales.scalar_type() == (kind == kQ6K ? at::kChar : at::kByte),
          "k-quants need 16 sub-block scale bytes per super-block (i8 for Q6_K, u8 otherwise)");
    }
    const int64_t hbytes = kind == kQ5_0 || kind == kQ5_1 ? 4 : (kind == kQ5K ? 32 : (kind == kQ6K ? 64 : 0));
    if (hbytes > 0) {
      TORCH_CHECK(
          w.hbits.defined() && w.hbits.scalar_type() == at::kByte && w.hbits.numel() == blocks * hbytes,
          "this kind needs ",
          hbytes,
          " u8 high-bit bytes per block");
    }
  }
  for (const at::Tensor* t : {&w.codes, &w.scales, &w.mins, &w.sub_scales, &w.hbits, &w.dq_scales, &w.table}) {
    TORCH_CHECK(!t->defined() || t->device().is_cpu(), "every tensor of the quantized weight must be on the CPU");
  }
  TORCH_CHECK(
      w.codes.scalar_type() == at::kByte || w.codes.scalar_type() == at::kChar,
      "codes must be uint8 or int8, got ",
      w.codes.scalar_type());
  TORCH_CHECK(!w.table.defined() || w.table.scalar_type() == at::kFloat, "the code table must be float32");
  return w;
}

// Checks an input `[n, width]` of the kernel's dtypes on the CPU.
void check_input(const at::Tensor* x, int64_t width, const char* what) {
  TORCH_CHECK(x != nullptr, "null ", what);
  TORCH_CHECK(x->dim() == 2 && x->size(1) == width, what, " must be [n, ", width, "], got ", x->sizes());
  TORCH_CHECK(x->device().is_cpu(), "the quantized kernels run on the CPU; ", what, " is on ", x->device());
  TORCH_CHECK(
      x->scalar_type() == at::kFloat || x->scalar_type() == at::kBFloat16,
      what,
      " must be float32 or bfloat16, got ",
      x->scalar_type());
}

}  // namespace

extern "C" {

// A product of x (f32 or bf16 on the CPU) with a quantized weight W `[out, in]`, in x's dtype:
// - `mode` 0: `x · dequant(W)ᵀ` for x `[n, in]` as an autograd op, whose backward gives
//   `g · dequant(W)` for x;
// - `mode` 1: the same product without autograd;
// - `mode` 2: `x · dequant(W)` for x `[n, out]` (an input gradient), without autograd.
// `kind`: 0 Q8_0, 1 Q4_0, 2 Q4_1, 3 NF4, 4 NF4 with double quantization, 5 Q5_0, 6 Q5_1, 7 Q4_K,
// 8 Q5_K, 9 Q6_K, 10 fp8 e4m3fn; absent tensors (mins, sub_scales, hbits, dq_scales, table) may
// be null; at most `tile_elements` weights are decoded at once.
char* lsdk_qlinear(
    const at::Tensor* x,
    int32_t mode,
    int32_t kind,
    int64_t out,
    int64_t in,
    const at::Tensor* codes,
    const at::Tensor* scales,
    const at::Tensor* mins,
    const at::Tensor* sub_scales,
    const at::Tensor* hbits,
    const at::Tensor* dq_scales,
    const at::Tensor* table,
    double dq_offset,
    int64_t tile_elements,
    at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(y != nullptr, "null output");
    TORCH_CHECK(mode >= 0 && mode <= 2, "unknown mode ", mode);
    check_input(x, mode == 2 ? out : in, "input");
    QWeight w = make_weight(kind, out, in, codes, scales, mins, sub_scales, hbits, dq_scales, table, dq_offset, tile_elements);
    // The kernel picks its own dtypes: autocast must not recast the tiles or the GEMM.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    auto xc = x->contiguous();
    if (mode == 0) {
      *y = new at::Tensor(QLinearFunction::apply(xc, w));
      return;
    }
    at::NoGradGuard no_grad;
    *y = new at::Tensor(mode == 2 ? qlinear_input_grad(w, xc) : qlinear_forward(w, xc));
  });
}

}  // extern "C"
