// SY_HD marks small functions shared by the CPU backend and CUDA kernels, so that both run
// the same arithmetic (the CPU backend is the oracle of the GPU tests).
#pragma once

#if defined(__CUDACC__)
#define SY_HD __host__ __device__ __forceinline__
#else
#define SY_HD inline
#endif
