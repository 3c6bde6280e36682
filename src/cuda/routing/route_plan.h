// The routing plan: which kernel route() launches for a call, and its launch shape. plan_route
// (routing.cu) takes the validated arguments and the device's properties and returns a RoutePlan;
// route() launches it. The plan makes no CUDA call, so it runs on any machine (tests enumerate it
// over presets, dtypes and token counts; tools/kernel_resources.py reach checks that every
// instantiated routing kernel is reachable).
//
// Everything the plan decides on is here, plain C++ (route_warp.cuh and the other kernel headers
// hold the device code): every threshold, each with its evidence (H200 figures unless a card is
// named; the records in docs/decisions hold the tables), the row shapes and their table, the
// kernels' parameters, and the predicates of each form. Only the choice among a shape's
// specialised kernels (Specs) stays beside them, in route_shape_launch.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "common/host_device.h"
#include "common/op_args.h"
#include "cuda/common/device_props.h"
#include "switchyard/routing.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard::cuda {

namespace routing {

// Group-limit paths of route_warp (make_route_params chooses one).
enum GroupPath : int {
  kGroupNone = 0,     // no group limit (or every group kept)
  kGroupChunks = 1,   // G % 4 == 0 and <= 2 scores per group
  kGroupGeneric = 2,  // anything else
};

// The routing kernels' parameters (built by make_route_params below, passed to the kernels by value).
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


// ---------------------------------------------------------------------------------------------
// The plan's pieces: row shapes and their table, parameters, the forms' predicates (plan_route in
// routing.cu puts them together).

// Division of x < 2^16 by d < 2^16 via a multiply: floor(x * ceil(2^32 / d) / 2^32) is exact in
// that range (the error term x * eps / 2^32 < 2^-16 < 1 / d). magic 0 means d == 1.
inline unsigned div_magic(unsigned d) {
  return d <= 1 ? 0u : static_cast<unsigned>(((std::uint64_t{1} << 32) + d - 1) / d);
}

// A shape: W lanes per row, S stripes of 4*W experts, candidate buffers of depth D.
template <int W_, int S_, int D_>
struct RouteShape {
  static constexpr int W = W_;
  static constexpr int S = S_;
  static constexpr int D = D_;
  static constexpr int kValues = 4 * S;  // experts per lane
  static constexpr int kRowsPerWarp = 32 / W;
  static constexpr int kMaxExperts = 4 * W * S;
  // Picks per lane: K <= min(32, 4*W*S) picks spread over W lanes.
  static constexpr int kSlots = (32 / W < 4 * S) ? 32 / W : 4 * S;
  // Softmax accumulators per lane: min(S, 32 / W), a power of two (see the file comment).
  static constexpr int kAccs = (S >= 32 / W) ? 32 / W
                                             : (S >= 16  ? 16
                                                : S >= 8 ? 8
                                                : S >= 4 ? 4
                                                : S >= 2 ? 2
                                                         : 1);
  // route_warp_wide only: stripes loaded a batch at a time (see wide_visit_stripes), and the blocks per
  // SM its kernels' __launch_bounds__ ask for (route_shape_launch.cuh's route_min_blocks).
  static constexpr int kStripeBatch = 4;
  static constexpr int kWideMinBlocks = 3;
  static_assert(W == 1 || W == 2 || W == 4 || W == 8 || W == 16 || W == 32, "W must be a power of two");
  static_assert(D >= 1 && D <= 4, "buffer depth");
};

// A shape of the streamed narrow segments (route_warp_wide with W < 32; kStreamLanes below), with its
// own stripe batch and launch bounds.
template <int W_, int S_, int D_, int kBatch, int kMinBlocks>
struct StreamShape : RouteShape<W_, S_, D_> {
  static constexpr int kStripeBatch = kBatch;
  static constexpr int kWideMinBlocks = kMinBlocks;
};


// Shapes. A shape entry serves E <= max_experts and T <= max_tokens; the first entry that fits is
// used.
// Up to E = 64 a row is small: past a few thousand rows (kSmallWarpMaxTokens16 / 64) narrow segments
// let one shuffle serve 32 / W rows, and route_rows one thread a row; past E = 64 a row gets the
// whole warp (W = 32; but 65-128 experts with 2 <= K <= 8 take narrow packed segments of 8 lanes from
// kNarrowMinTokens128 rows on): each lane then holds only E / 32 values (8 for E = 256), so
// the kernels need 40-64 registers and run at high occupancy, the segment reductions are single
// redux.sync instructions, and a lone row's serial work is short. Past E = 512 a lane's values no
// longer fit in registers at a useful occupancy: without a group limit those rows take
// route_warp_wide (docs/decisions/routing-row-forms.md).
// The token thresholds of the table (kSmallWarpMaxTokens16 ..., kDeepBufferMaxTokens ...,
// kSmallNarrowMaxTokens64, kNarrowMinTokens128) are route_plan.h's, with their evidence.
// Narrow segments take packed candidate buffers for kNarrowPackedMinK <= K <= W (pick k in lane k).
inline constexpr bool narrow_packed_k(int top_k, int w) { return top_k >= kNarrowPackedMinK && top_k <= w; }
// Lanes of the narrow segments of 33-64 experts below kSmallNarrowMaxTokens64 rows.
inline constexpr int kSmallNarrowLanes64 = 16;

struct ShapeEntry {
  int max_experts, w, s, d;
  std::int64_t max_tokens;          // rows served
  std::int64_t max_tokens_softmax;  // rows served when the pre function is softmax
  // Serves only rows that fit its packed narrow form (narrow_packed_k(K, w)).
  bool packed_only = false;
};
// D = 4 = all 4 values of a lane up to E = 64: several of a row's picks in one lane are common
// there, and a full buffer makes the top-K fast pass exact without the check.
// D = 3 past 512 experts (5 or more values per lane and buffer).
// clang-format off
inline constexpr ShapeEntry kShapeTable[] = {
    {16, 32, 1, 4, kSmallWarpMaxTokens16, kSmallWarpMaxTokens16},
    {4, 1, 1, 4, kAnyTokens, kAnyTokens},
    {8, 2, 1, 4, kAnyTokens, kAnyTokens},
    {16, 4, 1, 4, kAnyTokens, kAnyTokens},
    {32, 32, 1, 4, kSmallWarpMaxTokens32, kSmallWarpMaxTokens32},
    {32, 8, 1, 4, kAnyTokens, kAnyTokens},
    {64, 32, 1, 4, kSmallWarpMaxTokens64, kSmallWarpMaxTokens64},
    {64, kSmallNarrowLanes64, 1, 4, kSmallNarrowMaxTokens64, kSmallNarrowMaxTokens64},
    {64, 8, 2, 4, kAnyTokens, kAnyTokens},
    {128, 32, 1, 3, kDeepBufferMaxTokens128, kDeepBufferMaxTokens128},
    {128, 32, 1, 2, kNarrowMinTokens128 - 1, kNarrowMinTokens128 - 1},
    {128, 8, 4, 4, kAnyTokens, kAnyTokens, true},
    {128, 32, 1, 2, kAnyTokens, kAnyTokens},
    {256, 32, 2, 3, kDeepBufferMaxTokens, kDeepBufferMaxTokensSoftmax},
    {256, 32, 2, 2, kAnyTokens, kAnyTokens},
    {384, 32, 3, 3, kDeepBufferMaxTokens, kDeepBufferMaxTokensSoftmax},
    {384, 32, 3, 2, kAnyTokens, kAnyTokens},
    {512, 32, 4, 3, kDeepBufferMaxTokens, kDeepBufferMaxTokensSoftmax},
    {512, 32, 4, 2, kAnyTokens, kAnyTokens},
    {640, 32, 5, 3, kAnyTokens, kAnyTokens},
    {768, 32, 6, 3, kAnyTokens, kAnyTokens},
    {896, 32, 7, 3, kAnyTokens, kAnyTokens},
    {1024, 32, 8, 3, kAnyTokens, kAnyTokens},
    {1536, 32, 12, 4, kAnyTokens, kAnyTokens},
    {2048, 32, 16, 4, kAnyTokens, kAnyTokens},
    {4096, 32, 32, 4, kAnyTokens, kAnyTokens},
};
// clang-format on
inline constexpr int kNumShapes = sizeof(kShapeTable) / sizeof(kShapeTable[0]);

template <int I>
using ShapeAt = RouteShape<kShapeTable[I].w, kShapeTable[I].s, kShapeTable[I].d>;

// How rows of up to 128 experts are laid out: a whole warp per row (kShapeTable's W = 32), narrow
// segments (W < 32, several rows per warp) of one stripe or two or more (narrow2: S = 2; narrow:
// S = 1, or S = 4 at 65-128 experts), or one thread per row (route_rows.cuh, outside the table).
using SmallRowForm = RouteOptions::SmallRowForm;
inline SmallRowForm shape_form(const ShapeEntry& e) {
  return e.w == 32 ? SmallRowForm::kWarp : e.s == 2 ? SmallRowForm::kNarrow2 : SmallRowForm::kNarrow;
}
inline constexpr int kFormKnobMaxExperts = 128;

// RouteOptions::small_row_form forces a form for rows of up to kFormKnobMaxExperts experts at every
// T (rows: where route_rows fits, else the default); RouteOptions::narrow_packed = false keeps narrow
// segments on plain candidate buffers even where the packed ones fit.

// Streamed narrow segments (route_warp_wide with W = kStreamLanes < 32; routing.cu's
// plan_route_stream): rows of kStreamMinExperts + 1 .. kStreamMaxExperts experts without a group
// limit and narrow_packed_k(K, kStreamLanes), from kStreamMinTokens rows on, for the rule of
// routing.cu's stream Specs (sigmoid + bias -> normalize). A lane streams its E / 32 stripes of the row
// instead of the whole warp's 2 stripes of 128 experts, a quarter of them padding at E = 160
// (docs/decisions/routing-wide-rows.md).
// (Where route_staged.cuh's kernels fit, from their kStagedMinTokens rows on, plan_route
// takes those first.)
inline constexpr int kStreamLanes = 8;
inline constexpr int kStreamMinExperts = 128;
inline constexpr int kStreamMaxExperts = 192;
inline bool stream_fits(int num_experts, int top_k, int group_path) {
  return group_path == kGroupNone && num_experts > kStreamMinExperts && num_experts <= kStreamMaxExperts &&
         narrow_packed_k(top_k, kStreamLanes);
}
// RouteOptions::Choice: kNever never takes a form, kAlways wherever it fits, kAuto the launcher's
// default. RouteOptions::streamed: the streamed narrow segments (default: from kStreamMinTokens rows).
using KnobChoice = RouteOptions::Choice;
using StreamChoice = KnobChoice;

// The choices route() makes on the host, once per call, for the launchers.
struct RouteChoice {
  SmallRowForm form = SmallRowForm::kAuto;
  bool narrow_packed = true;
  StreamChoice stream = StreamChoice::kAuto;
  KnobChoice staged = KnobChoice::kAuto;  // route_staged.cuh
  bool staged_approx = true;
  bool wide_packed_always = false;  // wide_packed_buffers
};
inline RouteChoice route_choice(const RouteOptions& o) {
  RouteChoice c;
  c.form = o.small_row_form;
  c.narrow_packed = o.narrow_packed;
  c.stream = o.streamed;
  c.staged = o.staged;
  c.staged_approx = o.staged_approx;
  c.wide_packed_always = o.wide_packed_always;
  return c;
}
inline bool use_stream(const RouteParams& p, const RouteChoice& choice) {
  if (choice.stream == StreamChoice::kNever || !stream_fits(p.num_experts, p.top_k, p.group_path))
    return false;
  return choice.stream == StreamChoice::kAlways || p.num_tokens >= kStreamMinTokens;
}

// Index in kShapeTable for E, T, K and the pre function, or -1 when E is past the table. narrow_spec:
// the rule has specialised narrow kernels (route_shape_launch.cuh's narrow_spec_matches); rows of 9-32 experts
// then skip the whole-warp entries (kSmallWarpMaxTokens16 / 32), and so do rows of 33-64 experts whose
// K fits the narrow packed buffers of kSmallNarrowLanes64 lanes (kSmallWarpMaxTokens64; not with
// RouteOptions::narrow_packed = false; docs/decisions/routing-row-forms.md). A forced form
// (RouteOptions::small_row_form) takes the first entry of that form whose T bound holds, else the first of that
// form (among the entries of up to 64 experts when E <= 64); it ignores packed_only (a narrow shape
// then falls back to plain buffers where K does not fit).
inline int route_shape_index(int num_experts, std::int64_t num_tokens, PreFn pre, bool narrow_spec, int top_k,
                             const RouteChoice& choice) {
  const SmallRowForm forced = choice.form;
  // Rows whose whole-warp entries of up to this many experts a narrow Spec replaces.
  const bool packed64 = choice.narrow_packed && narrow_packed_k(top_k, kSmallNarrowLanes64);
  const int narrow_spec_max = !narrow_spec ? 0 : packed64 ? 64 : 32;
  const auto tokens_fit = [&](const ShapeEntry& e) {
    return num_tokens <= (pre == PreFn::kSoftmax ? e.max_tokens_softmax : e.max_tokens);
  };
  if (forced != SmallRowForm::kAuto && num_experts <= kFormKnobMaxExperts) {
    int first = -1;
    for (int i = 0; i < kNumShapes; ++i) {
      const ShapeEntry& e = kShapeTable[i];
      if (num_experts > e.max_experts || shape_form(e) != forced) continue;
      if (num_experts <= 64 && e.max_experts > 64) continue;
      if (tokens_fit(e)) return i;
      if (first < 0) first = i;
    }
    if (first >= 0) return first;
  }
  for (int i = 0; i < kNumShapes; ++i) {
    const ShapeEntry& e = kShapeTable[i];
    if (num_experts > 8 && e.w == 32 && e.max_experts <= narrow_spec_max) continue;
    if (e.packed_only && !narrow_packed_k(top_k, e.w)) continue;
    if (num_experts <= e.max_experts && tokens_fit(e)) return i;
  }
  return -1;
}

// Flattens validated arguments. E past the shape table is left to route() (route_shape_index -1)
// to reject.
inline RouteParams make_route_params(const detail::RouteArgs& a) {
  RouteParams p;
  const RoutingConfig& c = a.config;
  const std::size_t elem = dtype_size(a.logits_dtype);
  p.logits = a.logits;
  p.row_stride = a.logits_row_stride;
  p.num_tokens = a.num_tokens;
  p.logits_dtype = static_cast<int>(a.logits_dtype);
  p.logits_vec =
      (reinterpret_cast<std::uintptr_t>(a.logits) % (4 * elem) == 0) && (a.logits_row_stride % 4 == 0);
  p.bias = a.bias;
  p.bias_dtype = static_cast<int>(a.bias_dtype);
  p.bias_vec =
      a.bias != nullptr && reinterpret_cast<std::uintptr_t>(a.bias) % (4 * dtype_size(a.bias_dtype)) == 0;
  p.topk_ids = a.topk_ids;
  p.ids_int64 = a.ids_dtype == DType::kInt64;
  p.topk_weights = a.topk_weights;
  p.weights_bf16 = a.weights_dtype == DType::kBFloat16;
  p.num_experts = c.num_experts;
  p.top_k = c.top_k;
  p.pre = c.pre;
  p.post = c.post;
  p.scale = c.scale;
  p.group_path = kGroupNone;
  // Keeping every group is no group limit at all (the oracle then allows every expert).
  if (c.group_rule != GroupRule::kNone && c.topk_group < c.n_group) {
    const int G = c.num_experts / c.n_group;
    const int take = c.group_rule == GroupRule::kTop2Sum ? 2
                     : c.group_rule == GroupRule::kMax   ? 1
                                                         : c.top_k / c.topk_group;
    p.n_group = c.n_group;
    p.topk_group = c.topk_group;
    p.group_size = G;
    p.group_take = take < G ? take : G;
    if (G % 4 == 0 && p.group_take <= 2) {
      p.group_path = kGroupChunks;
      p.group_magic = div_magic(static_cast<unsigned>(G / 4));
      const int per_group = G / 4;
      if (per_group <= 32 && (per_group & (per_group - 1)) == 0 && c.n_group <= 32) {
        p.group_lanes = 1;
        while ((1 << p.group_shift) < per_group) ++p.group_shift;
      }
    } else {
      p.group_path = kGroupGeneric;
      p.group_magic = div_magic(static_cast<unsigned>(G));
    }
  }
  return p;
}

// Whether every packed-key bucket of p's rows holds one key (bf16 / fp16 logits without pre function
// or bias: the low 16 bits of their keys are 0), so that the packed top-K needs no collision check
// (select_top_k_packed's bucket_exact).
SY_HD bool bucket_exact_keys(const RouteParams& p) {
  return p.pre == PreFn::kNone && p.bias == nullptr && p.logits_dtype != static_cast<int>(DType::kFloat32);
}

// Whether route_warp_wide should run on packed candidate buffers for p (its kPackedTopK, chosen by
// the launcher so that each kernel holds one of the two forms: a kernel holding both was slower):
// bf16 / fp16 logits without pre function or bias at every T (one key per bucket: no checks), other
// keys from kWidePackedMinTokens rows on (their checks recompute keys, sort picks or redo rounds,
// which lengthens a row: that costs where the slowest row is the call's time).
// RouteOptions::wide_packed_always puts every T on them.
inline bool wide_packed_buffers(const RouteParams& p, const RouteChoice& choice) {
  return bucket_exact_keys(p) || choice.wide_packed_always || p.num_tokens >= kWidePackedMinTokens;
}

// Shared memory of one routed row on the group paths: chunk tops (8 bytes per 4-expert chunk)
// or keys (4 bytes per expert slot), then n_group score keys and n_group selection flags.
template <class Shape>
SY_HD std::size_t route_group_smem_bytes(const RouteParams& p) {
  if (p.group_path == kGroupNone || (Shape::W == 32 && p.group_lanes)) return 0;
  const std::size_t head = p.group_path == kGroupChunks ? std::size_t{8} * Shape::W * Shape::S
                                                        : std::size_t{16} * Shape::W * Shape::S;
  return (head + static_cast<std::size_t>(p.n_group) * 5 + 15) / 16 * 16;
}

// route_warp's packed candidate buffers (kPackedTopK; see packed_insert): whole-warp rows up to
// E = 1024 (past 512 only rows with a group limit reach route_warp: routing.cu).
template <class Shape>
inline constexpr bool kPackedBuffers = Shape::W == 32 && Shape::S <= 8;
// Narrow segments (2 <= W < 32) on packed candidate buffers: route_warp with kPackedTopK, for rows
// of kNarrowPackedMinK <= K <= W only (narrow_packed_fits; the launcher's choice).
template <class Shape>
inline constexpr bool kNarrowPacked = Shape::W >= 2 && Shape::W < 32;
template <class Shape>
inline bool narrow_packed_fits(int top_k) {
  return kNarrowPacked<Shape> && narrow_packed_k(top_k, Shape::W);
}
// route_warp keeps packed buffers (kPackedTopK) on these shapes.
template <class Shape>
inline constexpr bool kRowPackedBuffers = kPackedBuffers<Shape> || kNarrowPacked<Shape>;

// Shared memory of one routed row: the group paths', then, for the packed candidate buffers of
// whole-warp rows up to E = 1024 (see select_top_k_packed; kPackedTopK), the row's selection keys
// and, with a bias, its p.
template <class Shape, bool kPackedTopK = true>
SY_HD std::size_t route_smem_bytes_per_row(const RouteParams& p) {
  constexpr bool keys = kPackedTopK && kRowPackedBuffers<Shape>;
  const std::size_t per_expert = !keys ? 0 : p.bias != nullptr ? 8 : 4;  // key (and p with a bias)
  return route_group_smem_bytes<Shape>(p) + per_expert * Shape::kMaxExperts;
}

// Dynamic shared memory each warp of a Shape kernel must own for these parameters.
template <class Shape, bool kPackedTopK = true>
SY_HD std::size_t route_smem_bytes_per_warp(const RouteParams& p) {
  return route_smem_bytes_per_row<Shape, kPackedTopK>(p) * Shape::kRowsPerWarp;
}

// ---------------------------------------------------------------------------------------------
// One thread a row (route_rows.cuh).

inline constexpr int kRowsMaxExperts = 16;
inline constexpr int kRowsMaxTopK = 8;

// From kRowsMinTokens8 / 16 rows (route_plan.h) route_rows serves rows of up to 8 / 16 experts; at
// E = 32 / 64 it was slower at every T, so it stops at 16.

// Whether route_rows can serve p (E, K and the group limit).
inline bool rows_kernel_fits(const RouteParams& p) {
  return p.num_experts <= kRowsMaxExperts && p.top_k <= kRowsMaxTopK && p.group_path == kGroupNone;
}

// Whether the launcher takes route_rows for p: where it fits, from kRowsMinTokens8 / 16 rows on, or at
// every T with RouteOptions::small_row_form = kRows (and never with kWarp, kNarrow or kNarrow2).
inline bool use_rows_kernel(const RouteParams& p, SmallRowForm form) {
  if (!rows_kernel_fits(p)) return false;
  const std::int64_t min_tokens = p.num_experts <= 8 ? kRowsMinTokens8 : kRowsMinTokens16;
  return form == SmallRowForm::kRows || (form == SmallRowForm::kAuto && p.num_tokens >= min_tokens);
}

// ---------------------------------------------------------------------------------------------
// The staged kernels (route_staged.cuh).

inline constexpr int kStagedChunk = 32;  // experts a chunk (and a group with a group limit)
inline constexpr int kStagedMaxExperts = 512;
inline constexpr int kStagedTopK = 8;       // the lists' depth: K <= 8
inline constexpr int kStagedMaxGroups = 4;  // topk_group <= 4
inline constexpr int kStagedWarps = 4;      // warps a block
// The launcher takes the staged kernels for rows of up to kStagedAutoMaxExperts experts from
// kStagedMinTokens rows on (route_plan.h; staged_min_tokens): below 16384 rows a warp's serial
// chain (~12k instructions a lane) is the call's time.

// Shared memory of the staged kernels: the bias (E floats), then per warp kStages stages of 32 rows'
// chunks (a ring: chunks c + 1 .. c + kStages - 1 are in flight while chunk c is worked on; 48 KB of
// stages a block, 4 blocks an SM). A row's chunk is its 16-byte pieces, piece m at position
// piece_at(r, m): swizzled so that the 8 lanes of one 128-byte phase of a 16-byte read (8 rows, or 4
// pairs of bf16 rows) hit distinct banks.
template <DType kDtype>
struct StagedLayout {
  static constexpr int kElem = kDtype == DType::kFloat32 ? 4 : 2;
  static constexpr int kChunkBytes = kStagedChunk * kElem;
  static constexpr int kPieces = kChunkBytes / 16;  // 16-byte copies a lane issues per chunk
  static constexpr int kRowsPerCopy = 32 / kPieces;
  static constexpr int kStageBytes = 32 * kChunkBytes;
  static constexpr int kStages = kDtype == DType::kFloat32 ? 3 : 6;
  static constexpr std::size_t kBiasBytes = std::size_t{4} * kStagedMaxExperts;
  static constexpr std::size_t kWarpBytes = std::size_t{kStages} * kStageBytes;
  static constexpr std::size_t kBlockBytes = kBiasBytes + kStagedWarps * kWarpBytes;
  SY_HD static constexpr int piece_at(int r, int m) {
    return m ^ ((r / (8 / kPieces)) % kPieces);
  }
};

// The whole-warp shape that routes a row again where its packed selection may not be exact.
using StagedRedoShape = RouteShape<32, 4, 2>;
static_assert(StagedRedoShape::kMaxExperts >= 512, "the redo shape holds every staged row");

// The rules the staged kernels serve, by what a row's selection keys are made of.
enum class StagedRule {
  kSigmoidBias,   // sigmoid with an fp32 bias (aligned): keys of canonical(sigmoid(s) + bias)
  kLogits,        // no pre function, no bias, any post function: keys of the logits
  kSoftmaxPicks,  // softmax -> normalize, no bias: keys of the logits, weights from the picks (step 5)
};

// The staged rule for p's pre function, bias and post function, if one serves them (groups: only with
// kSigmoidBias).
inline bool staged_rule_of(const RouteParams& p, StagedRule* rule) {
  if (p.pre == PreFn::kSigmoid && p.bias != nullptr && p.bias_dtype == static_cast<int>(DType::kFloat32) &&
      p.bias_vec) {
    *rule = StagedRule::kSigmoidBias;
    return true;
  }
  if (p.bias != nullptr || p.group_path != kGroupNone) return false;
  if (p.pre == PreFn::kNone)
    *rule = StagedRule::kLogits;
  else if (p.pre == PreFn::kSoftmax && p.post == PostFn::kNormalize)
    *rule = StagedRule::kSoftmaxPicks;
  else
    return false;
  return true;
}

// Whether the staged kernels can serve p: a staged rule (staged_rule_of), fp32 or bf16 logits whose
// rows start on 16 bytes, E a multiple of 32 up to 512, K <= 8, no group limit or groups of 32
// experts (score of at most two, topk_group <= 4).
inline bool staged_fits(const RouteParams& p) {
  const bool f32 = p.logits_dtype == static_cast<int>(DType::kFloat32);
  if (!f32 && p.logits_dtype != static_cast<int>(DType::kBFloat16)) return false;
  const std::int64_t pitch = p.row_stride * (f32 ? 4 : 2);
  if (reinterpret_cast<std::uintptr_t>(p.logits) % 16 != 0 || pitch % 16 != 0) return false;
  StagedRule rule;
  if (!staged_rule_of(p, &rule)) return false;
  if (p.num_experts % kStagedChunk != 0 || p.num_experts > kStagedMaxExperts) return false;
  if (p.top_k < 1 || p.top_k > kStagedTopK) return false;
  // The redo's shared memory: in the warp's stages (StagedLayout<bf16>::kWarpBytes, the smaller).
  if (route_smem_bytes_per_warp<StagedRedoShape, true>(p) > StagedLayout<DType::kBFloat16>::kWarpBytes)
    return false;
  if (p.group_path == kGroupNone) return true;
  return p.group_path == kGroupChunks && p.group_size == kStagedChunk && p.topk_group <= kStagedMaxGroups &&
         p.group_take <= 2;
}

// RouteOptions::staged: the staged kernels never, or wherever they fit (any T and E); the default:
// as above. RouteOptions::staged_approx (the default): staged sigmoid + bias rows select on
// approximate sigmoids and certify (kApprox); otherwise on exact ones.
using StagedChoice = KnobChoice;
// The rows from which plan_route takes the staged kernels for p by default (p fits; see above), or -1.
// approx: sigmoid + bias rows on the approximate selection, which is cheaper per row and so pays
// from fewer rows (route_plan.h: kStagedMinTokensApprox, kStagedApproxMaxExperts).
inline std::int64_t staged_min_tokens(const RouteParams& p, bool approx) {
  StagedRule rule;
  if (!staged_rule_of(p, &rule)) return -1;
  if (rule == StagedRule::kSigmoidBias && approx) {
    if (p.num_experts > kStagedApproxMaxExperts) return -1;
    return p.group_path == kGroupNone && p.num_experts <= kStagedAutoMaxExperts ? kStagedMinTokensApprox
                                                                                : kStagedMinTokens;
  }
  if (p.num_experts > kStagedAutoMaxExperts) return -1;
  if (rule == StagedRule::kSigmoidBias) return kStagedMinTokens;
  if (p.logits_dtype == static_cast<int>(DType::kBFloat16)) return kStagedMinTokensBf16Logits;
  return rule == StagedRule::kSoftmaxPicks || p.top_k >= kStagedTopK ? kStagedMinTokens : -1;
}
// Whether route() takes the staged kernels for p on a device with `props`: before the streamed
// narrow segments (which they beat where both fit, see above), unless RouteOptions::streamed =
// kAlways forces those; only where the device grants their shared memory (past the 48 KB default:
// every sm_90 device does).
inline bool use_staged(const RouteParams& p, const RouteChoice& choice, const DeviceProps& props) {
  if (choice.stream == StreamChoice::kAlways) return false;
  if (choice.staged == StagedChoice::kNever || !staged_fits(p)) return false;
  const std::size_t smem = p.logits_dtype == static_cast<int>(DType::kFloat32)
                               ? StagedLayout<DType::kFloat32>::kBlockBytes
                               : StagedLayout<DType::kBFloat16>::kBlockBytes;
  if (props.smem_per_block_optin < smem) return false;
  if (choice.staged == StagedChoice::kAlways) return true;
  const std::int64_t min_tokens = staged_min_tokens(p, choice.staged_approx);
  return min_tokens >= 0 && p.num_tokens >= min_tokens;
}

}  // namespace routing
}  // namespace switchyard::cuda
