// Linear layers over a frozen quantized weight, computed one tile of output rows at a time:
// `y = x · Wᵀ` forward and `∂x = g · W` backward, W never held dense beyond one tile. One
// autograd node (`TiledLinearBackward`) serves two sources of tiles:
//
// - On the CPU, for f32 and bf16 products (`lsdk_qlinear`), each tile (at most `tile_elements`
//   values, the caller's bound) is decoded into a reused float buffer by the loops below
//   (compiled for AVX-512, AVX2 and baseline x86-64 and picked at run time by the loader, GCC
//   `target_clones`; threaded over rows with libtorch's intra-op pool).
// - Everywhere else (CUDA; f16 and f64 on the CPU; `lsdk_tiled_linear`), the caller decodes each
//   tile through a callback: lora-core's `QuantWeight::dequantize` of the rows, with tensor ops
//   on the weight's device, so the decoding is written once for every device.
//
// Either way the product is libtorch's GEMM per tile, and the node saves only the source (the
// quantized tensors), so a backward pass decodes the tiles again instead of keeping each layer's
// dense weight alive from the forward pass (what a plain `x · dequantize(W)ᵀ` would do).
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
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "guard.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

extern "C" {
// The callbacks of `lsdk_tiled_linear` (see there).
typedef char* (*lsdk_rows_fn)(void* ctx, int64_t r0, int64_t r1, int32_t dtype, at::Tensor** rows);
typedef void (*lsdk_free_fn)(void* ctx);
}

namespace {

void free_nothing(void*) {}

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

// ---------------------------------------------------------------------------------------------
// Tile sources: a frozen weight W `[out, in]` handed out one tile of output rows at a time.

// Called with (first row, rows, tile `[rows, in]`); the tile is valid until the call returns.
using TileFn = std::function<void(int64_t, int64_t, const at::Tensor&)>;

struct TileSource {
  virtual ~TileSource() = default;
  virtual int64_t out() const = 0;
  virtual int64_t in() const = 0;
  // Output rows per tile (the last tile may be shorter).
  virtual int64_t tile_rows() const = 0;
  // Calls `f` for each tile, in row order, as `kind` on the weight's device.
  virtual void for_each_tile(at::ScalarType kind, const TileFn& f) const = 0;
  // Calls `f` for each tile as f32 holding the bf16 tile's values (each weight rounded to bf16,
  // then widened exactly): the operand of a bf16 product computed by an f32 GEMM.
  virtual void for_each_tile_bf16_widened(const TileFn& f) const {
    for_each_tile(at::kBFloat16, [&](int64_t r0, int64_t rows, const at::Tensor& tile) {
      f(r0, rows, tile.to(at::kFloat));
    });
  }
};

// A bf16 product on a CPU whose libtorch has no fast bf16 GEMM (`lsdk::cpu_has_fast_bf16_gemm`):
// computed by f32 GEMMs over the widened bf16 operands and rounded to bf16 once, the numbers of a
// bf16 GEMM (bf16 operands, f32 sums) up to the summation order, at f32 GEMM speed.
bool bf16_by_f32(const at::Tensor& x) {
  return x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && !lsdk::cpu_has_fast_bf16_gemm();
}

// The quantized tensors decoded by the loops above into reused buffers (CPU; f32 or bf16).
struct KernelTiles final : TileSource {
  QWeight w;

  explicit KernelTiles(QWeight weight) : w(std::move(weight)) {}

  int64_t out() const override {
    return w.out;
  }
  int64_t in() const override {
    return w.in;
  }
  int64_t tile_rows() const override {
    return std::max<int64_t>(1, std::min(w.out, w.tile_elements / std::max<int64_t>(w.in, 1)));
  }
  void for_each_tile(at::ScalarType kind, const TileFn& f) const override {
    const int64_t t = tile_rows();
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
  // Both buffers reused: decode to f32, round through the bf16 buffer, widen back in place.
  void for_each_tile_bf16_widened(const TileFn& f) const override {
    const int64_t t = tile_rows();
    auto fbuf = tile_buffer(0, at::kFloat, t, w.in);
    auto kbuf = tile_buffer(1, at::kBFloat16, t, w.in);
    for (int64_t r0 = 0; r0 < w.out; r0 += t) {
      const int64_t rows = std::min(t, w.out - r0);
      decode_rows(w, r0, r0 + rows, fbuf.data_ptr<float>());
      at::Tensor tile = fbuf.narrow(0, 0, rows);
      at::Tensor k = kbuf.narrow(0, 0, rows);
      k.copy_(tile);
      tile.copy_(k);
      f(r0, rows, tile);
    }
  }
};

// The caller's decoder of rows (see `lsdk_tiled_linear`): each tile is a new tensor it returns.
struct CallbackTiles final : TileSource {
  int64_t out_rows;
  int64_t in_cols;
  int64_t per_tile;
  lsdk_rows_fn rows_fn;
  void* ctx = nullptr;
  lsdk_free_fn free_ctx = nullptr;

  CallbackTiles(int64_t out, int64_t in, int64_t tile_rows, lsdk_rows_fn rows)
      : out_rows(out), in_cols(in), per_tile(tile_rows), rows_fn(rows) {}
  CallbackTiles(const CallbackTiles&) = delete;
  CallbackTiles& operator=(const CallbackTiles&) = delete;
  ~CallbackTiles() override {
    if (ctx != nullptr && free_ctx != nullptr) {
      free_ctx(ctx);
    }
  }

  int64_t out() const override {
    return out_rows;
  }
  int64_t in() const override {
    return in_cols;
  }
  int64_t tile_rows() const override {
    return std::min(per_tile, out_rows);
  }

  // Rows [r0, r1) as `kind`, checked.
  at::Tensor fetch(int64_t r0, int64_t r1, at::ScalarType kind) const {
    at::Tensor* raw = nullptr;
    char* err = rows_fn(ctx, r0, r1, static_cast<int32_t>(kind), &raw);
    std::unique_ptr<at::Tensor> owned(raw);
    if (err != nullptr) {
      std::string message(err);
      std::free(err);
      TORCH_CHECK(false, "decoding rows ", r0, "..", r1, " of the weight: ", message);
    }
    TORCH_CHECK(owned != nullptr && owned->defined(), "the row decoder gave no tensor for rows ", r0, "..", r1);
    at::Tensor t = std::move(*owned);
    TORCH_CHECK(
        t.dim() == 2 && t.size(0) == r1 - r0 && t.size(1) == in_cols,
        "the row decoder gave ",
        t.sizes(),
        " for rows ",
        r0,
        "..",
        r1,
        ", expected [",
        r1 - r0,
        ", ",
        in_cols,
        "]");
    TORCH_CHECK(t.scalar_type() == kind, "the row decoder gave ", t.scalar_type(), " rows, expected ", kind);
    return t;
  }

  void for_each_tile(at::ScalarType kind, const TileFn& f) const override {
    const int64_t t = tile_rows();
    for (int64_t r0 = 0; r0 < out_rows; r0 += t) {
      const int64_t rows = std::min(t, out_rows - r0);
      // the previous tile is freed before the next one is decoded
      const at::Tensor tile = fetch(r0, r0 + rows, kind);
      f(r0, rows, tile);
    }
  }
};

void check_same_device(const at::Tensor& tile, const at::Tensor& x) {
  TORCH_CHECK(
      tile.device() == x.device(), "the weight's rows are on ", tile.device(), " but the input is on ", x.device());
}

// y `[n, out]` = x `[n, in]` · Wᵀ in x's dtype.
at::Tensor tiled_forward(const TileSource& s, const at::Tensor& x) {
  const int64_t n = x.size(0);
  if (bf16_by_f32(x)) {
    const auto xf = x.to(at::kFloat);
    auto y = at::empty({n, s.out()}, x.options());
    s.for_each_tile_bf16_widened([&](int64_t r0, int64_t rows, const at::Tensor& tile) {
      y.narrow(1, r0, rows).copy_(at::mm(xf, tile.t()));
    });
    return y;
  }
  if (s.tile_rows() >= s.out()) {
    at::Tensor y;
    s.for_each_tile(x.scalar_type(), [&](int64_t, int64_t, const at::Tensor& tile) {
      check_same_device(tile, x);
      y = at::mm(x, tile.t());
    });
    return y;
  }
  auto y = at::empty({n, s.out()}, x.options());
  s.for_each_tile(x.scalar_type(), [&](int64_t r0, int64_t rows, const at::Tensor& tile) {
    check_same_device(tile, x);
    y.narrow(1, r0, rows).copy_(at::mm(x, tile.t()));
  });
  return y;
}

// ∂x `[n, in]` = g `[n, out]` · W in g's dtype.
//
// The sums run over W's rows, which the tiles split: a bf16 product per tile would round each
// tile's partial sum (libtorch's bf16 GEMM, `addmm_` included, rounds its output once per
// call), so with more than one tile a bf16 gradient on the CPU is summed in f32 over every tile
// and rounded once, by f32 GEMMs over the widened bf16 operands, even where libtorch has a fast
// bf16 GEMM (bf16 GEMM numbers at f32 GEMM speed for this product; the forward pass's tiles
// are output columns and keep the fast GEMM).
at::Tensor tiled_input_grad(const TileSource& s, const at::Tensor& g) {
  const bool split_sums = g.scalar_type() == at::kBFloat16 && g.device().is_cpu() && s.tile_rows() < s.out();
  if (bf16_by_f32(g) || split_sums) {
    // f32 sums over every tile, one rounding at the end
    const auto gf = g.to(at::kFloat);
    at::Tensor acc;
    s.for_each_tile_bf16_widened([&](int64_t r0, int64_t rows, const at::Tensor& tile) {
      auto gs = gf.narrow(1, r0, rows);
      if (acc.defined()) {
        acc.addmm_(gs, tile);
      } else {
        acc = at::mm(gs, tile);
      }
    });
    return acc.to(at::kBFloat16);
  }
  at::Tensor gx;
  s.for_each_tile(g.scalar_type(), [&](int64_t r0, int64_t rows, const at::Tensor& tile) {
    check_same_device(tile, g);
    auto gs = g.narrow(1, r0, rows);
    if (gx.defined()) {
      gx.addmm_(gs, tile);
    } else {
      gx = at::mm(gs, tile);
    }
  });
  return gx;
}

// The backward of `y = x · Wᵀ`: `∂x = g · W`, tile by tile from the source (no gradient for the
// frozen W). The node holds the source — the quantized tensors, never a dense W — until the
// graph lets it go (after a backward without `retain_graph`, or when the graph is dropped).
struct TiledLinearBackward final : torch::autograd::Node {
  std::mutex mu;
  std::shared_ptr<const TileSource> src;

  TiledLinearBackward(std::shared_ptr<const TileSource> s, torch::autograd::edge_list&& next)
      : Node(std::move(next)), src(std::move(s)) {}

  std::string name() const override {
    return "QuantTiledLinearBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    std::shared_ptr<const TileSource> s;
    {
      std::lock_guard<std::mutex> lock(mu);
      s = src;
    }
    TORCH_CHECK(
        s != nullptr,
        "the quantized linear's backward already ran and released its weight (pass retain_graph "
        "to backpropagate through the same graph twice)");
    if (grads.empty() || !grads[0].defined() || !task_should_compute_output(0)) {
      return {at::Tensor()};
    }
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    return {tiled_input_grad(*s, grads[0].contiguous())};
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    src.reset();
  }
};

// `x · Wᵀ` with a `TiledLinearBackward` node when x takes a gradient.
at::Tensor tiled_apply(const at::Tensor& x, std::shared_ptr<const TileSource> src) {
  at::Tensor y;
  {
    at::NoGradGuard no_grad;
    y = tiled_forward(*src, x);
  }
  if (torch::autograd::compute_requires_grad(x)) {
    c10::intrusive_ptr<torch::autograd::Node> node =
        c10::make_intrusive<TiledLinearBackward>(std::move(src), torch::autograd::collect_next_edges(x));
    torch::autograd::set_history(y, node);
  }
  return y;
}

// Mode 0: the autograd product `x · Wᵀ`; 1: the same without autograd; 2: `x · W` without
// autograd. The products are in x's dtype: autocast must not recast the tiles or the GEMM.
at::Tensor run_mode(int32_t mode, const at::Tensor& x, std::shared_ptr<const TileSource> src) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  auto xc = x.contiguous();
  if (mode == 0) {
    return tiled_apply(xc, std::move(src));
  }
  at::NoGradGuard no_grad;
  return mode == 2 ? tiled_input_grad(*src, xc) : tiled_forward(*src, xc);
}

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

// Checks an input `[n, width]` of the decoding loops' dtypes on the CPU.
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
    auto src = std::make_shared<KernelTiles>(
        make_weight(kind, out, in, codes, scales, mins, sub_scales, hbits, dq_scales, table, dq_offset, tile_elements));
    *y = new at::Tensor(run_mode(mode, *x, std::move(src)));
  });
}

// The products of `lsdk_qlinear` (same `mode`s) for a weight W `[out, in]` whose rows the caller
// decodes: `rows(ctx, r0, r1, dtype, &t)` stores in `t` a new heap `at::Tensor*` (ownership
// passes to the shim) holding rows [r0, r1) of W, `[r1 − r0, in]` of `dtype` (a
// `c10::ScalarType` code: the input's, or the incoming gradient's) on the input's device, and
// returns nullptr, or a `malloc`'ed message the shim frees and raises. Tiles of `tile_rows` rows
// are asked for in order, each released before the next. x: `[n, in]` (`[n, out]` for mode 2) of
// f16, bf16, f32 or f64 on any device.
//
// The shim owns `ctx` from the call on, in every case (errors included): it calls
// `free_ctx(ctx)` exactly once, when no product can ask for rows any more — before returning
// for modes 1 and 2 or an input that takes no gradient, else when the autograd node dies (after
// a backward pass without `retain_graph`, or with its graph), possibly on another thread.
char* lsdk_tiled_linear(
    const at::Tensor* x,
    int32_t mode,
    int64_t out,
    int64_t in,
    int64_t tile_rows,
    void* ctx,
    lsdk_rows_fn rows,
    lsdk_free_fn free_ctx,
    at::Tensor** y) {
  // owns ctx until the source takes it (the deleter runs only for a non-null ctx)
  std::unique_ptr<void, lsdk_free_fn> owner(ctx, free_ctx != nullptr ? free_ctx : &free_nothing);
  return lsdk::guarded([&] {
    TORCH_CHECK(y != nullptr && rows != nullptr && free_ctx != nullptr, "null output or callback");
    TORCH_CHECK(mode >= 0 && mode <= 2, "unknown mode ", mode);
    TORCH_CHECK(out > 0 && in > 0 && tile_rows > 0, "shape [", out, ", ", in, "] and tile rows ", tile_rows, " must be positive");
    const int64_t width = mode == 2 ? out : in;
    TORCH_CHECK(x != nullptr, "null input");
    TORCH_CHECK(x->dim() == 2 && x->size(1) == width, "input must be [n, ", width, "], got ", x->sizes());
    const auto k = x->scalar_type();
    TORCH_CHECK(
        k == at::kHalf || k == at::kBFloat16 || k == at::kFloat || k == at::kDouble,
        "input must be float16, bfloat16, float32 or float64, got ",
        k);
    auto src = std::make_shared<CallbackTiles>(out, in, tile_rows, rows);
    src->ctx = owner.release();
    src->free_ctx = free_ctx;
    *y = new at::Tensor(run_mode(mode, *x, std::move(src)));
  });
}

}  // extern "C"
