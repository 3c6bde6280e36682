// Why no CUDA device is usable for the tests (empty when one is), without GoogleTest: shared by
// the gtest suites (cuda_test_util.h) and the stand-alone ep_ipc_test.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <sys/stat.h>

namespace sy_test {

inline std::string cuda_unavailable_reason() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && n == 0)) return "no NVIDIA driver / no CUDA device";
  if (err == cudaErrorInsufficientDriver) {
    // The runtime reports the same code for a missing driver and an old one.
    struct stat st {};
    if (stat("/proc/driver/nvidia/version", &st) != 0) return "no NVIDIA driver / no CUDA device";
    return "the NVIDIA driver is older than this CUDA runtime needs (cudaErrorInsufficientDriver)";
  }
  if (err != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(err);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read CUDA device properties";
  if (prop.major < 9) return "the CUDA backend is built for sm_90a; device 0 is sm_" + std::to_string(prop.major * 10 + prop.minor);
  return "";
}

}  // namespace sy_test
