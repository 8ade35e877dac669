// c10d's NCCL process group for data-parallel training on CUDA (one device per local rank), as
// `torch.distributed.init_process_group("nccl")` builds it: the rendezvous store of dist.h and
// ProcessGroupNCCL from libtorch_cuda.so. Compiled only with USE_C10D_NCCL (the build found
// libtorch_cuda, nccl.h and the CUDA runtime headers); dist.cpp answers for builds without it.
//
// Errors stay errors: unless the user set them, TORCH_NCCL_BLOCKING_WAIT=1 makes a collective's
// wait() throw on timeout (caught by `guarded`) and TORCH_NCCL_ASYNC_ERROR_HANDLING=0 keeps
// NCCL's watchdog from tearing the process down, so a lost peer is a typed error, not an abort
// (the variables are read when the group is made: c10d ProcessGroupNCCL.cpp).
//
// Headers checked against libtorch 2.13: torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp.

#include "dist.h"

#ifdef USE_C10D_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>

extern "C" {

// Joins the group at `host:port` (see lsdk_dist_gloo_new) with collectives over NCCL on
// cuda:`device_index`, which becomes this thread's current device; `timeout_ms` bounds the
// rendezvous and each collective.
char* lsdk_dist_nccl_new(const char* host, int32_t port, int32_t rank, int32_t world_size,
                         int64_t timeout_ms, const char* prefix, int32_t device_index,
                         void** out) {
  return lsdk::guarded([&] {
    TORCH_CHECK(out != nullptr, "null argument");
    const auto devices = c10::cuda::device_count();
    TORCH_CHECK(devices > 0, "NCCL needs a CUDA device and this process sees none");
    TORCH_CHECK(device_index >= 0 && device_index < devices, "cuda:", device_index,
                " does not exist (this process sees ", static_cast<int>(devices),
                " CUDA devices; NCCL takes one device per local rank)");
    setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
    setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", /*overwrite=*/0);
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device_index));
    auto timeout = std::chrono::milliseconds(timeout_ms);
    auto store = lsdk::join_store(host, port, rank, world_size, timeout, prefix);
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = timeout;
    auto nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size, opts);
    nccl->setBoundDeviceId(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
    *out = new lsdk::ProcessGroup{store, nccl};
  });
}

}  // extern "C"
#endif
