// f32 `y = x · Wᵀ` on the CPU through oneDNN's matmul (libtorch's `mkldnn::_linear_pointwise`
// operator, the one its compiled graphs call for a linear) instead of `at::linear`'s MKL sgemm.
// On AMD CPUs MKL takes its generic code path, which does not use AVX-512: measured on a 2-core
// AVX-512 EPYC, oneDNN ran `[256, 576] · [576, 3072]` at 196 against 139 GFLOP/s and the LM
// head's `[256, 576] · [576, 49152]` at 151 against 103. Same function in f32; the summation
// order differs (relative differences of about 1e-6).
//
// An autograd op where x or W takes a gradient: `∂x = g · W` (oneDNN again, W read through its
// transpose without a copy), `∂W = gᵀ · x` (MKL; for a weight more than 4× taller than wide, a
// LoRA B factor, `(xᵀ · g)ᵀ` by oneDNN). The node saves W when x takes a gradient and x when W
// does, as `at::linear`'s graph does, so the memory held for the backward pass is the same.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include "guard.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>

namespace {

using LinearPointwise = at::Tensor(
    const at::Tensor&,
    const at::Tensor&,
    const std::optional<at::Tensor>&,
    c10::string_view,
    c10::List<std::optional<at::Scalar>>,
    std::optional<c10::string_view>);

// libtorch's oneDNN linear, or nullopt when this build has none (no MKLDNN).
const std::optional<c10::TypedOperatorHandle<LinearPointwise>>& onednn_linear_op() {
  static const std::optional<c10::TypedOperatorHandle<LinearPointwise>> op =
      []() -> std::optional<c10::TypedOperatorHandle<LinearPointwise>> {
    auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle.has_value() || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) {
      return std::nullopt;
    }
    return handle->typed<LinearPointwise>();
  }();
  return op;
}

// `x · wᵀ` for a 2-d f32 `x` `[n, in]` and `w` `[out, in]` (any strides), no autograd.
at::Tensor onednn_nt(const at::Tensor& x, const at::Tensor& w) {
  const auto& op = onednn_linear_op();
  TORCH_CHECK(op.has_value(), "this libtorch has no oneDNN linear (mkldnn::_linear_pointwise)");
  return op->call(
      x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

struct F32LinearBackward final : torch::autograd::Node {
  std::mutex mu;
  at::Tensor x2d;  // [n, in], defined when W takes a gradient
  at::Tensor w;    // [out, in], defined when x takes a gradient
  std::vector<int64_t> x_sizes;

  F32LinearBackward(torch::autograd::edge_list&& next) : Node(std::move(next)) {}

  std::string name() const override {
    return "OneDnnF32LinearBackward";
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    at::Tensor x_saved, w_saved;
    {
      std::lock_guard<std::mutex> lock(mu);
      x_saved = x2d;
      w_saved = w;
    }
    torch::autograd::variable_list out(2);
    if (grads.empty() || !grads[0].defined()) {
      return out;
    }
    at::NoGradGuard no_grad;
    const int64_t n_out = grads[0].size(-1);
    at::Tensor g = grads[0].reshape({-1, n_out});
    if (g.scalar_type() != at::kFloat) {
      g = g.to(at::kFloat);
    }
    if (task_should_compute_output(0)) {
      TORCH_CHECK(w_saved.defined(), "the f32 linear's backward already ran (retain_graph)");
      out[0] = onednn_nt(g, w_saved.t()).reshape(x_sizes);
    }
    if (task_should_compute_output(1)) {
      TORCH_CHECK(x_saved.defined(), "the f32 linear's backward already ran (retain_graph)");
      // A tall weight (a LoRA B factor, `[out, r]`): `(xᵀ·g)ᵀ` by oneDNN, which multiplies
      // this shape in half the time of MKL's `gᵀ·x` on the CPUs this op is used on (AMD with
      // AVX-512; `[3072, 16]` over 256 rows: 0.20 against 0.44 ms). Else MKL.
      if (g.size(1) > 4 * x_saved.size(1)) {
        out[1] = onednn_nt(x_saved.t(), g.t()).t();
      } else {
        out[1] = g.t().mm(x_saved);
      }
    }
    return out;
  }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu);
    x2d.reset();
    w.reset();
  }
};

at::Tensor f32_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [out, in], got ", w.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == w.size(1), "input ", x.sizes(), " does not fit weight ", w.sizes());
  TORCH_CHECK(
      x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
      "the oneDNN f32 linear takes f32 tensors, got ", x.scalar_type(), " and ", w.scalar_type());
  TORCH_CHECK(
      x.device().is_cpu() && w.device().is_cpu(), "the oneDNN f32 linear runs on the CPU, got ",
      x.device(), " and ", w.device());
  const bool x_grad = torch::autograd::compute_requires_grad(x);
  const bool w_grad = torch::autograd::compute_requires_grad(w);
  at::Tensor x2d, y;
  {
    at::NoGradGuard no_grad;
    x2d = x.reshape({-1, x.size(-1)});
    y = onednn_nt(x2d, w);
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = w.size(0);
    y = y.view(shape);
  }
  if (x_grad || w_grad) {
    auto node = c10::make_intrusive<F32LinearBackward>(torch::autograd::collect_next_edges(x, w));
    node->x_sizes = x.sizes().vec();
    if (w_grad) {
      node->x2d = x2d;
    }
    if (x_grad) {
      node->w = w;
    }
    torch::autograd::set_history(y, c10::intrusive_ptr<torch::autograd::Node>(std::move(node)));
  }
  return y;
}

}  // namespace

extern "C" {

// 1 in `ok` when this libtorch has the oneDNN linear and it computes a small product correctly.
char* lsdk_f32_onednn_available(int32_t* ok) {
  return lsdk::guarded([&] {
    TORCH_CHECK(ok != nullptr, "null output");
    *ok = 0;
    if (!onednn_linear_op().has_value()) {
      return;
    }
    at::NoGradGuard no_grad;
    at::Tensor x = at::arange(6, at::TensorOptions().dtype(at::kFloat)).view({2, 3});
    at::Tensor w = at::ones({4, 3}, at::TensorOptions().dtype(at::kFloat));
    at::Tensor y = onednn_nt(x, w);
    *ok = (y.sizes() == at::IntArrayRef({2, 4}) && y.equal(at::mm(x, w.t()))) ? 1 : 0;
  });
}

// `x · Wᵀ` (x `[..., in]`, W `[out, in]`, f32, CPU) through oneDNN → `[..., out]` f32; an
// autograd op when x or W takes a gradient (see the top of this file).
char* lsdk_f32_linear(const at::Tensor* x, const at::Tensor* w, at::Tensor** y) {
  return lsdk::guarded([&] {
    TORCH_CHECK(x != nullptr && w != nullptr && y != nullptr, "null tensor");
    *y = new at::Tensor(f32_linear(*x, *w));
  });
}

}  // extern "C"
