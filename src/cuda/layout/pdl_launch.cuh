// Kernel launch with programmatic dependent launch (PDL), and the two device-side PDL controls.
//
// The layout's own small launcher: src/cuda/common/launch.cuh, meant to be shared by the CUDA
// backend, did not exist when the layout kernels were written; switch to it once it does.
//
// PDL contract of every layout kernel (DESIGN.md section 5: graph-safe, no host sync):
//   * launch_dependents() first: the next kernel in the stream may be scheduled as soon as all
//     of our blocks are resident, so its launch latency overlaps our work;
//   * wait_for_prerequisites() before the first global-memory access: it returns only after
//     every prerequisite grid has completed and its writes are visible (PTX ISA,
//     griddepcontrol.wait). Nothing before it touches global memory, so a PDL launch is safe
//     after any predecessor, ours or the caller's.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace switchyard::cuda::layout_detail {

__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...) through cudaLaunchKernelEx with
// programmatic stream serialization allowed, so that it may start before its predecessor in the
// stream has finished (it then waits in wait_for_prerequisites()).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_pdl(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes,
                       cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace switchyard::cuda::layout_detail
