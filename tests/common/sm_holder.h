// Kernels for GPU tests that occupy SMs the way a persistent or expert-parallel communication
// kernel does: resident blocks that spin until a later kernel on another stream releases them.
#pragma once

#include <cuda_runtime.h>

namespace sy_test {

// Device words of one holder experiment, zeroed by the caller before the launch.
struct SmHolderWords {
  int release;    // set to 1 by launch_sm_release
  int started;    // holder blocks that are resident and spinning
  int timed_out;  // holder blocks that gave up waiting (timeout_ns passed without a release)
};

// `blocks` blocks, one per SM (each takes all the shared memory a block may have, so that no
// block using shared memory fits beside it), that spin until words->release is set or
// timeout_ns pass. The helpers below run on the SMs left free.
cudaError_t launch_sm_holder(int blocks, SmHolderWords* words, long long timeout_ns, cudaStream_t stream);
// One thread that spins until `count` holder blocks have started (or timeout_ns pass), so that
// work queued behind it on `stream` finds the holders' SMs taken.
cudaError_t launch_wait_holders_started(SmHolderWords* words, int count, long long timeout_ns,
                                        cudaStream_t stream);
// Sets words->release.
cudaError_t launch_sm_release(SmHolderWords* words, cudaStream_t stream);

}  // namespace sy_test
