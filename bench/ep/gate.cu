// A start gate for timing multi-stream work with events: a one-block kernel that holds its stream
// until the host writes a value into mapped pinned memory. bench_ep enqueues the gate, the start
// event and every rank's call, then opens the gate, so the host's enqueue time stays outside the
// timed interval (as inside a CUDA graph) without capturing the ranks' streams in a graph.
#include <cuda_runtime.h>

#include "ep/gate.h"

namespace sy_bench {

namespace {

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Waits until *flag >= value, at most timeout_ns; reports a timeout in *timed_out.
__global__ void gate_kernel(const volatile unsigned* flag, unsigned value, unsigned long long timeout_ns,
                            unsigned* timed_out) {
  if (threadIdx.x != 0) return;
  const unsigned long long start = global_ns();
  while (*flag < value) {
    if (global_ns() - start > timeout_ns) {
      *timed_out = 1;
      return;
    }
    __nanosleep(200);
  }
}

}  // namespace

bool Gate::init(std::string* error) {
  if (cudaHostAlloc(reinterpret_cast<void**>(&host_), 2 * sizeof(unsigned), cudaHostAllocMapped) != cudaSuccess) {
    *error = "cudaHostAlloc (mapped gate flag) failed";
    host_ = nullptr;
    return false;
  }
  host_[0] = 0;
  host_[1] = 0;
  if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0) != cudaSuccess) {
    *error = "cudaHostGetDevicePointer (gate flag) failed";
    return false;
  }
  return true;
}

Gate::~Gate() {
  if (host_) cudaFreeHost(host_);
}

bool Gate::close(cudaStream_t stream, double timeout_seconds, unsigned* value) {
  *value = ++count_;
  gate_kernel<<<1, 32, 0, stream>>>(device_, *value, static_cast<unsigned long long>(timeout_seconds * 1e9),
                                    device_ + 1);
  return cudaGetLastError() == cudaSuccess;
}

void Gate::open(unsigned value) {
  __atomic_store_n(&host_[0], value, __ATOMIC_SEQ_CST);
}

bool Gate::timed_out() const { return __atomic_load_n(&host_[1], __ATOMIC_SEQ_CST) != 0; }

}  // namespace sy_bench
