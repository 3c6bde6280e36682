// The routing plan: which kernel route() launches for a call, and its launch shape. plan_route
// (routing.cu) takes the validated arguments and the device's properties and returns a RoutePlan;
// route() launches it. The plan makes no CUDA call, so it runs on any machine (tests enumerate it
// over presets, dtypes and token counts; tools/kernel_resources.py reach checks that every
// instantiated routing kernel is reachable).
//
// Every threshold of the plan is here, each with its evidence (H200 figures unless a card is
// named; the records in docs/decisions hold the tables). The shape table that the token
// thresholds feed is route_warp.cuh's kShapeTable; the predicates that read them sit next to the
// kernels they choose (route_warp.cuh, route_rows.cuh, route_staged.cuh, route_shape_launch.cuh).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/op_args.h"
#include "cuda/common/device_props.h"
#include "switchyard/routing.h"
#include "switchyard/status.h"

namespace switchyard::cuda {

namespace routing {

// Group-limit paths of route_warp (make_route_params chooses one).
enum GroupPath : int {
  kGroupNone = 0,     // no group limit (or every group kept)
  kGroupChunks = 1,   // G % 4 == 0 and <= 2 scores per group
  kGroupGeneric = 2,  // anything else
};

// The routing kernels' parameters (host-built by route_warp.cuh's make_route_params, passed by value).
struct RouteParams {
  const void* logits = nullptr;
  std::int64_t row_stride = 0;  // elements
  std::int64_t num_tokens = 0;
  int logits_dtype = 0;  // DType
  int logits_vec = 0;    // 1: 4-element vector loads are aligned for every row
  const void* bias = nullptr;
  int bias_dtype = 0;  // DType
  int bias_vec = 0;
  void* topk_ids = nullptr;
  int ids_int64 = 0;
  void* topk_weights = nullptr;
  int weights_bf16 = 0;
  int num_experts = 0;
  int top_k = 0;
  PreFn pre = PreFn::kNone;
  PostFn post = PostFn::kSoftmax;
  float scale = 1.0f;
  int group_path = kGroupNone;
  int n_group = 1;
  int topk_group = 1;
  int group_size = 1;        // G = E / n_group
  int group_take = 1;        // scores summed per group: min(take, G)
  unsigned group_magic = 0;  // fast division by G (or by G / 4 on the chunk path); 0: divisor 1
  // Chunk path with G / 4 a power of two <= 32 and n_group <= 32: with 32 lanes per row the
  // chunks of a group sit in G / 4 consecutive lanes of one stripe (group_limit_lanes).
  int group_lanes = 0;
  int group_shift = 0;  // log2(G / 4)
};

// A kernel and its launch shape. `kernel` is the routing kernel's host stub (every routing kernel
// takes RouteParams by value); `name` its signature for tests and tools (the compiler's
// __PRETTY_FUNCTION__ of kernel_name<kernel>). `prepare`, when set, grants the kernel the shared
// memory above the 48 KB default (cudaFuncSetAttribute, remembered per device) before the launch.
struct RoutePlan {
  void (*kernel)(RouteParams) = nullptr;
  RouteParams params;  // the kernel's argument
  const char* name = nullptr;
  unsigned grid = 0;
  unsigned block = 0;
  std::size_t smem = 0;
  Status (*prepare)() = nullptr;
};

// The plan for validated arguments (num_tokens > 0) on a device with `props`. Errors: K or E past
// the CUDA backend's range, a group limit needing more shared memory than a block has, a grid past
// 2^31 - 1 blocks.
Status plan_route(const detail::RouteArgs& args, const DeviceProps& props, RoutePlan* plan);

// ---------------------------------------------------------------------------------------------
// Token thresholds (rows of the call, T).

inline constexpr std::int64_t kAnyTokens = std::numeric_limits<std::int64_t>::max();

// Whole-warp rows of 65-128 / 129-512 experts keep 3 candidates a lane instead of 2 up to these T
// (softmax rules: kDeepBufferMaxTokensSoftmax): at small T the slowest row, the one whose lane
// holds 3 picks, is the call's time (docs/decisions/routing-candidate-buffers.md).
inline constexpr std::int64_t kDeepBufferMaxTokens = 128;
inline constexpr std::int64_t kDeepBufferMaxTokensSoftmax = 4096;
inline constexpr std::int64_t kDeepBufferMaxTokens128 = 4096;

// Rows of up to 16 / 32 / 64 experts take a whole warp up to these T, then narrow segments
// (mixtral-8x7b T = 1: whole warp 1.31 us, narrow 1.95; E = 64 K = 8 T = 1024: narrow 2.00,
// whole warp 2.40; docs/decisions/routing-row-forms.md).
inline constexpr std::int64_t kSmallWarpMaxTokens16 = 128;
inline constexpr std::int64_t kSmallWarpMaxTokens32 = 256;
inline constexpr std::int64_t kSmallWarpMaxTokens64 = 1024;

// Rows of 33-64 experts: one stripe (W = 16) up to this T, then two (W = 8; E = 64 K = 8
// T = 65536: 22.9 us against 30.8; docs/decisions/routing-row-forms.md).
inline constexpr std::int64_t kSmallNarrowMaxTokens64 = 32767;

// Rows of 65-128 experts with 2 <= K <= 8: narrow segments of 8 lanes from this T on (qwen3-235b
// T = 65536: 20.1 us against 25.0 whole-warp; T = 8192: whole warp 4.89 against 5.72;
// docs/decisions/routing-row-forms.md).
inline constexpr std::int64_t kNarrowMinTokens128 = 32768;

// One thread a row (route_rows.cuh) from these T for up to 8 / 16 experts (mixtral-8x7b
// T = 65536: 2.65 us against 3.86; dbrx T = 16384: narrow 2.88 against 3.74; H100, dbrx
// T = 32768: 3.50 / 3.42 us fp32 / bf16 against narrow 3.98 / 4.06; docs/decisions/routing-row-forms.md).
inline constexpr std::int64_t kRowsMinTokens8 = 128;
inline constexpr std::int64_t kRowsMinTokens16 = 32768;

// Streamed narrow segments for 129-192 experts (GLM-4.5's rule) from this T where the staged
// kernels do not serve the row (docs/decisions/routing-wide-rows.md).
inline constexpr std::int64_t kStreamMinTokens = 32768;

// The staged kernels from these T (bf16 logits keyed as they are: kStagedMinTokensBf16Logits) for
// rows of up to kStagedAutoMaxExperts experts (deepseek-v3 fp32 T = 32768: 28.7 us staged against
// 30.5, T = 16384: 21.7 against 16.9; qwen3-235b bf16 T = 16384: 5.5 against 7.5; kimi-k2, E = 384:
// no gain; docs/decisions/routing-staged-kernels.md).
inline constexpr std::int64_t kStagedMinTokens = 32768;
inline constexpr std::int64_t kStagedMinTokensBf16Logits = 16384;
inline constexpr int kStagedAutoMaxExperts = 256;
// With the approximate selection (RouteOptions::staged_approx, the default) sigmoid + bias rows
// without a group limit take the staged kernels from 16384 rows (H100: glm-4.5 fp32 T = 16384
// 13.6 us staged against 14.6; deepseek-v3, with groups, stays at 32768: 20.1 against 17.4), and rows
// of up to 384 experts from 32768 (H100: kimi-k2 fp32 T = 32768 / 65536: 32.6 / 54.9 against
// 33.6 / 60.3; docs/decisions/routing-staged-kernels.md).
inline constexpr std::int64_t kStagedMinTokensApprox = 16384;
inline constexpr int kStagedApproxMaxExperts = 384;

// Wide rows (E > 512, no group limit) put keys other than bf16 / fp16 logits' on packed buffers
// from this T (wide-2048 fp32 T = 1024: 19.3 us packed against 14.8 plain;
// docs/decisions/routing-wide-rows.md).
inline constexpr std::int64_t kWidePackedMinTokens = 16384;

// Rows of 513-1024 experts without a group limit (bf16 sigmoid + bias -> normalize, none ->
// softmax): the whole row in registers (route_warp) instead of route_warp_wide from this T
// (docs/decisions/routing-wide-rows.md).
inline constexpr std::int64_t kWarpForWideMinTokens = 1024;

// Specialised sigmoid + bias kernels load the bias before the logits up to this T: there the bias's
// L2 latency is on the critical path; past it the registers cost rows in flight
// (docs/decisions/routing-specialised-kernels.md).
inline constexpr std::int64_t kEarlyBiasMaxTokens = 256;

// ---------------------------------------------------------------------------------------------
// K thresholds.

// Packed candidate buffers from K = 2: one round saves less than the packed pass's checks cost
// (llama4-maverick fp32 T = 65536: 26.75 us packed against 22.03 plain;
// docs/decisions/routing-packed-keys.md). Narrow segments take them for 2 <= K <= W.
inline constexpr int kPackedMinK = 2;
inline constexpr int kNarrowPackedMinK = 2;

// ---------------------------------------------------------------------------------------------
// Launch shapes (the SM count comes from DeviceProps).

// Whole-warp and narrow kernels: blocks of up to 8 warps (256 threads, many rows in flight an SM),
// ceil(warps / SMs) where the rows do not give every SM a full block, so fewer rows share an SM's
// issue slots (at small T a row's latency is the call's; docs/decisions/routing-specialised-kernels.md).
inline constexpr int kWarpsPerBlock = 8;
// Their shared memory: the 48 KB a block has without the opt-in attribute.
inline constexpr std::size_t kMaxSmemPerBlock = 48 * 1024;
// route_rows: blocks of up to 8 warps, spread the same way.
inline constexpr int kRowsMaxWarpsPerBlock = 8;

}  // namespace routing
}  // namespace switchyard::cuda
