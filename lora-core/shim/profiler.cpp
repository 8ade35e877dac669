// Op-level profiling with libtorch's own profiler (Kineto, the engine behind Python's
// `torch.profiler`): every ATen operator (forward and autograd's backward nodes) is recorded with
// its thread and start/end time; CUDA kernels too when CUDA activity is asked for. The trace is the
// Chrome trace-event JSON that `torch.profiler`'s `export_chrome_trace` writes (Perfetto,
// chrome://tracing and TensorBoard's profiler plugin read it).
//
// The profiler's state is thread-local with propagation: ops run by the starting thread and by the
// threads it hands work to through libtorch (autograd's engine, `at::parallel_for`'s pool) are
// recorded; ops of unrelated threads are not.
//
// Headers checked against libtorch 2.13: torch/csrc/autograd/profiler_kineto.h,
// torch/csrc/profiler/orchestration/observer.h.

#include <torch/csrc/autograd/profiler_kineto.h>

#include "guard.h"

#include <cstdint>
#include <set>
#include <string>
#include <vector>

using lsdk::guarded;

namespace {
namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;
}  // namespace

extern "C" {

// One recorded event, handed to Rust by `lsdk_profiler_stop`: `device` 0 = CPU (an operator
// or a user annotation), 1 = CUDA (a kernel, memcpy or memset on the GPU's clock mapped to the
// host's); `shapes` the input shapes as text (`[256, 576], [576, 960]`, an empty `[]` for a
// non-tensor input), empty when shapes were not recorded.
typedef void (*lsdk_profile_event_fn)(
    void* ctx,
    const char* name,
    const char* shapes,
    uint64_t thread,
    uint64_t start_ns,
    uint64_t end_ns,
    int32_t device);

// Starts recording. `cuda` != 0 also records CUDA kernels (needs a CUDA build with CUPTI);
// `record_shapes` != 0 stores every operator's input shapes in the trace.
char* lsdk_profiler_start(int32_t cuda, int32_t record_shapes) {
  return guarded([&] {
    TORCH_CHECK(
        !prof::isProfilerEnabledInMainThread(),
        "the profiler is already running in this process: stop it before starting it again");
    std::set<impl::ActivityType> activities{impl::ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(impl::ActivityType::CUDA);
    }
    impl::ProfilerConfig config(
        impl::ProfilerState::KINETO, /*report_input_shapes=*/record_shapes != 0,
        /*profile_memory=*/false, /*with_stack=*/false, /*with_flops=*/false,
        /*with_modules=*/false);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
  });
}

// Stops recording, writes the Chrome trace to `trace_path` unless it is NULL, and calls `on_event`
// once per recorded event (unless it is NULL).
char* lsdk_profiler_stop(const char* trace_path, lsdk_profile_event_fn on_event, void* ctx) {
  return guarded([&] {
    std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
    TORCH_CHECK(result != nullptr, "the profiler was not running");
    if (on_event != nullptr) {
      for (const prof::KinetoEvent& e : result->events()) {
        if (e.isHiddenEvent()) {
          continue;
        }
        std::string name = e.name();
        std::string shapes;
        if (e.hasShapes()) {
          for (const std::vector<int64_t>& shape : e.shapes()) {
            if (!shapes.empty()) {
              shapes += ", ";
            }
            shapes += '[';
            for (size_t i = 0; i < shape.size(); ++i) {
              if (i > 0) {
                shapes += ", ";
              }
              shapes += std::to_string(shape[i]);
            }
            shapes += ']';
          }
        }
        int32_t device = e.deviceType() == c10::DeviceType::CUDA ? 1 : 0;
        on_event(
            ctx, name.c_str(), shapes.c_str(), e.startThreadId(), e.startNs(), e.endNs(), device);
      }
    }
    if (trace_path != nullptr) {
      result->save(trace_path);
    }
  });
}

}  // extern "C"
