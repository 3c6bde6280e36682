// Validated, flattened arguments handed from the C++ API layer to a backend. Backends trust
// them: the API layer has checked every shape, dtype, device and pointer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "switchyard/layout.h"
#include "switchyard/routing.h"
#include "switchyard/tensor.h"

namespace switchyard::detail {

struct RouteArgs {
  RoutingConfig config;
  std::int64_t num_tokens = 0;
  const void* logits = nullptr;
  DType logits_dtype = DType::kFloat32;
  std::int64_t logits_row_stride = 0;  // elements
  const void* bias = nullptr;          // optional [E]
  DType bias_dtype = DType::kFloat32;
  void* topk_ids = nullptr;  // [T,K]
  DType ids_dtype = DType::kInt32;
  void* topk_weights = nullptr;  // [T,K]
  DType weights_dtype = DType::kFloat32;
  RouteOptions options;
};

struct RouteBackwardArgs {
  RouteArgs route;  // topk_weights holds grad_weights
  void* grad_logits = nullptr;  // [T,E] contiguous, the logits' dtype
};

struct LayoutArgs {
  int num_experts = 0;
  int num_local = 0;
  int tile_size = 1;
  bool independent_blocks = false;        // LayoutConfig::independent_blocks
  int local_start = 0;                    // range form
  int local_stride = 1;                   // range form
  const std::int32_t* expert_map = nullptr;  // map form when non-null, [E]
  std::int64_t num_tokens = 0;
  int top_k = 0;
  const void* topk_ids = nullptr;  // [T,K]
  DType ids_dtype = DType::kInt32;
  std::int64_t capacity_rows = 0;   // max_permuted_rows(T, K, L, M)
  std::int64_t capacity_tiles = 0;  // max_tiles(T, K, L, M)
  std::int32_t* counts = nullptr;
  std::int32_t* offsets = nullptr;
  std::int32_t* permuted_to_expanded = nullptr;
  std::int32_t* permuted_to_token = nullptr;
  std::int32_t* expanded_to_permuted = nullptr;
  std::int32_t* tile_expert = nullptr;
  std::int32_t* tile_row_end = nullptr;
  std::int32_t* totals = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  LayoutOptions options;
};

struct GatherArgs {
  std::int64_t num_tokens = 0;
  std::int64_t hidden = 0;
  DType dtype = DType::kBFloat16;
  const void* x = nullptr;
  std::int64_t x_row_stride = 0;  // elements
  const float* x_scales = nullptr;  // optional [T, scale_cols]
  std::int64_t scale_cols = 0;      // 0 when no scales, else 1 or ceil(H/128)
  const std::int32_t* permuted_to_token = nullptr;  // entries outside [0, T) are padding
  // Optional [T, top_k]: lets a backend read each token row once and write it to all its rows
  // (token-major); the bytes written are those of the row-order definition either way.
  const std::int32_t* expanded_to_permuted = nullptr;
  int top_k = 0;
  const std::int32_t* totals = nullptr;
  std::int64_t capacity_rows = 0;
  void* x_perm = nullptr;          // [R,H] contiguous
  float* x_perm_scales = nullptr;  // [R, scale_cols]
  bool zero_fill_padding = false;
};

struct CombineArgs {
  std::int64_t num_tokens = 0;
  int top_k = 0;
  std::int64_t hidden = 0;
  const void* y_perm = nullptr;
  DType y_dtype = DType::kBFloat16;
  std::int64_t y_row_stride = 0;  // elements
  const std::int32_t* expanded_to_permuted = nullptr;  // [T,K]; entries outside [0, R) are not placed
  std::int64_t capacity_rows = 0;                      // R, rows of the layout
  const void* topk_weights = nullptr;                  // optional [T,K]
  DType weights_dtype = DType::kFloat32;
  void* out = nullptr;  // [T,H] contiguous
  DType out_dtype = DType::kBFloat16;
  bool accumulate = false;
};

struct CombineBackwardArgs {
  std::int64_t num_tokens = 0;
  int top_k = 0;
  std::int64_t hidden = 0;
  const void* grad_out = nullptr;  // [T,H]
  DType grad_out_dtype = DType::kBFloat16;
  std::int64_t grad_out_row_stride = 0;  // elements
  const void* y_perm = nullptr;  // [>= R, H]; with grad_weights
  DType y_dtype = DType::kBFloat16;
  std::int64_t y_row_stride = 0;  // elements
  const std::int32_t* expanded_to_permuted = nullptr;  // [T,K]; entries outside [0, R) are not placed
  const std::int32_t* permuted_to_token = nullptr;     // [R]; entries outside [0, T) hold no pick
  std::int64_t capacity_rows = 0;                      // R
  const void* topk_weights = nullptr;                  // optional [T,K]
  DType weights_dtype = DType::kFloat32;
  void* grad_y_perm = nullptr;  // optional [>= R, H] contiguous
  DType grad_y_dtype = DType::kBFloat16;
  float* grad_weights = nullptr;  // optional [T,K]
};

}  // namespace switchyard::detail
