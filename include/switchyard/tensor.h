// Dtypes, devices, streams and the non-owning tensor view every Switchyard call takes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

// The CUDA runtime's stream handle is `cudaStream_t == CUstream_st*`; declaring the struct here
// keeps the public headers free of CUDA includes while a cudaStream_t converts implicitly.
struct CUstream_st;

namespace switchyard {

using Stream = CUstream_st*;  // == cudaStream_t; nullptr is the legacy default stream

enum class DType : int {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
  kFloat8E4M3 = 3,  // OCP e4m3fn (finite-only, max 448), as torch.float8_e4m3fn
  kInt32 = 4,
  kInt64 = 5,
};

// Bytes per element; 0 for a value outside the enum.
std::size_t dtype_size(DType dtype);
// "fp32", "bf16", "fp16", "fp8_e4m3", "int32", "int64"; "invalid" otherwise.
const char* dtype_name(DType dtype);

enum class DeviceType : int { kCPU = 0, kCUDA = 1 };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;  // CUDA device ordinal; 0 for the CPU

  static Device cpu() { return Device{DeviceType::kCPU, 0}; }
  static Device cuda(int index = 0) { return Device{DeviceType::kCUDA, index}; }
  bool is_cuda() const { return type == DeviceType::kCUDA; }
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

constexpr int kMaxDims = 4;

// A non-owning view: pointer, dtype, shape, strides (in elements) and device. A
// default-constructed view (`TensorView{}`) means "absent" for optional arguments.
// Unless a function says otherwise, 2-D inputs may have any row stride >= their row length
// but their last dimension must be contiguous (stride 1); outputs must be contiguous.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {0, 0, 0, 0};
  std::int64_t strides[kMaxDims] = {0, 0, 0, 0};
  Device device = Device::cpu();

  // A contiguous (row-major) view.
  static TensorView of(const void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                       Device device = Device::cpu());
  // The same view with row stride `row_stride` (elements) for a 2-D view.
  TensorView with_row_stride(std::int64_t row_stride) const;

  bool absent() const { return ndim == 0 && data == nullptr; }
  std::int64_t numel() const;
  std::int64_t size(int dim) const { return shape[dim]; }
  std::int64_t stride(int dim) const { return strides[dim]; }
  bool is_contiguous() const;
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype); }
};

}  // namespace switchyard
