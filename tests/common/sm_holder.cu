#include <cstddef>

#include "common/sm_holder.h"

namespace sy_test {
namespace {

__device__ long long now_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void sm_holder_kernel(SmHolderWords* w, long long timeout_ns) {
  extern __shared__ int smem[];
  volatile int* release = &w->release;
  if (threadIdx.x == 0) {
    smem[0] = 0;
    atomicAdd(&w->started, 1);
    const long long end = now_ns() + timeout_ns;
    while (*release == 0) {
      if (now_ns() > end) {
        atomicAdd(&w->timed_out, 1);
        break;
      }
      __nanosleep(1000);
    }
  }
}

__global__ void wait_started_kernel(SmHolderWords* w, int count, long long timeout_ns) {
  volatile int* started = &w->started;
  const long long end = now_ns() + timeout_ns;
  while (*started < count && now_ns() <= end) __nanosleep(1000);
}

__global__ void release_kernel(SmHolderWords* w) { atomicExch(&w->release, 1); }

}  // namespace

cudaError_t launch_sm_holder(int blocks, SmHolderWords* words, long long timeout_ns, cudaStream_t stream) {
  // All the shared memory a block may have: no other block that uses shared memory (every layout
  // kernel does) fits on a holder's SM.
  int device = 0, smem = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err == cudaSuccess) {
    err = cudaFuncSetAttribute(sm_holder_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  }
  // CUDA loads kernels lazily, at their first launch, and such a load can wait for running
  // kernels: load the two helpers now, before the holders run.
  cudaFuncAttributes attributes{};
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, wait_started_kernel);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attributes, release_kernel);
  if (err != cudaSuccess) return err;
  sm_holder_kernel<<<blocks, 32, static_cast<std::size_t>(smem), stream>>>(words, timeout_ns);
  return cudaGetLastError();
}

cudaError_t launch_wait_holders_started(SmHolderWords* words, int count, long long timeout_ns,
                                        cudaStream_t stream) {
  wait_started_kernel<<<1, 1, 0, stream>>>(words, count, timeout_ns);
  return cudaGetLastError();
}

cudaError_t launch_sm_release(SmHolderWords* words, cudaStream_t stream) {
  release_kernel<<<1, 1, 0, stream>>>(words);
  return cudaGetLastError();
}

}  // namespace sy_test
