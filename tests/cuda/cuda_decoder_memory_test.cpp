// The GPU decoder's device memory is held by owning handles (model/cuda/device_memory.h): a
// decoder whose KV pool or workspace cannot be sized throws after the weights, the workspace
// and the stream were taken, and everything it took must be free again afterwards; so must a
// decoder that was built and destroyed.
#if defined(MOE_HAVE_CUDA) && MOE_HAVE_CUDA

#include <gtest/gtest.h>
#include <cuda_runtime_api.h>

#include <string>

#include "../support/random_model.h"
#include "core/error.h"
#include "cuda_test_util.h"
#include "model/gpu_decoder.h"

namespace moeinfer {
namespace {

int64_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  EXPECT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  return static_cast<int64_t>(free_bytes);
}

void failed_and_destroyed_decoders_leave_memory_free() {
  const testing::RandomModel m = testing::make_random_model(ModelFamily::kQwen3Moe, 1234);
  const GpuOptions fits{.max_batch_tokens = 64, .max_num_seqs = 4, .max_model_len = 64,
                        .quiet = true};
  // A first decoder brings up the context and cuBLAS's own lasting state.
  GpuDecoder::create(m.config, m.weights, fits).reset();
  const int64_t before = free_device_bytes();

  GpuOptions too_many_blocks = fits;
  too_many_blocks.num_kv_blocks = int64_t{1} << 40;
  GpuOptions too_large_a_step = fits;
  too_large_a_step.max_batch_tokens = int64_t{1} << 30;
  for (const auto& [options, what] :
       {std::pair{too_many_blocks, "a KV pool that does not fit"},
        std::pair{too_large_a_step, "a workspace that does not fit"}}) {
    try {
      GpuDecoder::create(m.config, m.weights, options);
      ADD_FAILURE() << what << " was accepted";
    } catch (const Error&) {
    }
    EXPECT_EQ(free_device_bytes(), before) << "device memory left taken after " << what;
  }
  {
    auto decoder = GpuDecoder::create(m.config, m.weights, fits);
    EXPECT_LT(free_device_bytes(), before);
  }
  EXPECT_EQ(free_device_bytes(), before) << "device memory left taken by a destroyed decoder";
}

[[maybe_unused]] const bool kRegistered = [] {
  if (!cuda::testing_util::cuda_device_present("decoder memory")) return false;
  cuda::testing_util::register_kernel_test("CudaDecoderMemory",
                                           "FailedAndDestroyedDecodersLeaveMemoryFree",
                                           failed_and_destroyed_decoders_leave_memory_free,
                                           __FILE__, __LINE__);
  return true;
}();

}  // namespace
}  // namespace moeinfer

#endif  // MOE_HAVE_CUDA
