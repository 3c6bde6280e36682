// Layout: topk_ids -> an expert-contiguous permutation with per-expert offsets and per-tile
// metadata for grouped GEMMs. docs/design.md section 3.
#pragma once

#include <cstddef>
#include <cstdint>

#include "switchyard/routing.h"
#include "switchyard/status.h"
#include "switchyard/tensor.h"

namespace switchyard {

// Which global experts this rank owns, and their local index l in [0, L).
//   range form: local l <-> global start + l * stride, for l in [0, count);
//   map form:   expert_map[E] (int32, on the ids' device) gives each global expert its local
//               index or -1; an entry outside [-1, L) counts as -1 (data, not an error).
struct LocalExperts {
  int start = 0;
  int count = -1;  // -1: all E experts (start must be 0 and stride 1)
  int stride = 1;
  TensorView expert_map;  // map form when present; then `count` is L

  static LocalExperts all() { return LocalExperts{}; }
  static LocalExperts range(int start, int count, int stride = 1) {
    LocalExperts l;
    l.start = start;
    l.count = count;
    l.stride = stride;
    return l;
  }
  static LocalExperts map(const TensorView& expert_map, int num_local) {
    LocalExperts l;
    l.count = num_local;
    l.expert_map = expert_map;
    return l;
  }
  bool is_map() const { return !expert_map.absent(); }
};

struct LayoutConfig {
  int num_experts = 0;  // E, global expert count, >= 1
  LocalExperts local;   // L = local.count (or E for LocalExperts::all())
  int tile_size = 1;    // M >= 1, any value
  // CUDA backend: true asks for a layout in which no block waits for another block (see
  // layout() below): the call then makes progress on however few SMs are free, beside kernels
  // on other streams that hold SMs until later work on this stream has run (expert-parallel
  // communication kernels, persistent kernels). Same output; slower from 4097 picks to a few
  // hundred thousand (docs/decisions/layout-independent-blocks.md). The CPU backend ignores it.
  bool independent_blocks = false;

  int num_local() const { return local.count < 0 ? num_experts : local.count; }
};

// Checks a layout configuration alone; the message names the bad field.
Status validate(const LayoutConfig& config);

// Capacity of every permuted-row array for T tokens, K picks, L local experts and tile M:
// T*K + min(L, T*K) * (M - 1) (0 when L = 0: nothing can be placed), a bound on padded_total
// from shapes alone.
std::int64_t max_permuted_rows(std::int64_t num_tokens, int top_k, int num_local, int tile_size);
// Capacity of the tile arrays: ceil(max_permuted_rows / M).
std::int64_t max_tiles(std::int64_t num_tokens, int top_k, int num_local, int tile_size);

// Index of the entries of Layout::totals.
enum LayoutTotal : int {
  kPaddedTotal = 0,  // offsets[L]
  kNumTiles = 1,     // padded_total / M
  kDropped = 2,      // ids outside [0, E) other than -1
  kNumTotals = 3,
};

// The caller-owned output arrays of a layout, all int32 and contiguous, on one device.
// R = max_permuted_rows(T, K, L, M), N = max_tiles(T, K, L, M); x = t*K + k.
struct Layout {
  TensorView counts;                // [L]   number of x routed to local expert l
  TensorView offsets;               // [L+1] offsets[l] = sum_{j<l} pad(counts[j]); [L] = padded_total
  TensorView permuted_to_expanded;  // [R]   x at each row; T*K on padding rows and rows >= padded_total
  TensorView permuted_to_token;     // [R]   x / K at each row; T on padding rows and rows >= padded_total
  TensorView expanded_to_permuted;  // [T,K] row of x, -1 when x is not placed
  TensorView tile_expert;           // [N]   local expert of tile i; -1 for i >= num_tiles
  TensorView tile_row_end;          // [N]   min((i+1)*M, offsets[l] + counts[l]); i*M for i >= num_tiles
  TensorView totals;                // [kNumTotals] padded_total, num_tiles, dropped
};
// Inside an expert, rows are in ascending x (token order): the layout is deterministic.
// pad(c) = ceil(c / M) * M.
// With M = block_size, (permuted_to_expanded, tile_expert, totals[kPaddedTotal]) are the
// (sorted_token_ids, expert_ids, num_tokens_post_padded) of vLLM's moe_align_block_size, with
// the same padding value T*K; experts that are not local get no tiles (vLLM: tiles marked -1).

// Bytes of scratch memory a layout (or route_and_layout) call on `device` needs for T tokens
// and K picks; 0 for the CPU backend. Allocate once per shape bound and reuse.
Status layout_workspace_size(const LayoutConfig& config, std::int64_t num_tokens, int top_k,
                             Device device, std::size_t* bytes);

// layout: fills every array of `out` from topk_ids.
//   topk_ids  [T,K] int32 or int64, contiguous. Ids outside [0,E) other than -1 are counted
//             in totals[kDropped] and not placed; -1 and non-local experts are not placed.
//   out       arrays as above, each at least its stated size.
//   workspace at least layout_workspace_size bytes on the ids' device (nullptr when 0).
// T*K must be below 2^31. On any error nothing is written.
// CUDA: from 4097 picks to a few hundred thousand the call is one launch whose blocks wait for
// each other (a cluster of 16 blocks, or a cooperative grid of 32 to 128 blocks, one per SM), so
// it completes only once that many SMs are free at once. A kernel on another stream that holds
// SMs until some later work on this stream has run can therefore keep it waiting for ever;
// config.independent_blocks = true selects forms whose blocks never wait for each other (the
// one-block kernel up to 4096 picks, else the multi-launch pipeline). Make a first call of each
// shape before such kernels run: CUDA loads kernels lazily at their first launch, and that load
// can wait for running kernels.
//
// `options` forces a form the CUDA backend otherwise picks from the call's size and the device
// (tests reach every form with it; measurements compare forms in one process). Every choice gives
// the same arrays; where a forced form cannot serve the call (it does not fit, or
// config.independent_blocks excludes it), the default is taken. The CPU backend ignores it.
struct LayoutOptions {
  enum class Path { kAuto, kOneBlock, kCluster8, kCluster16, kGrid32, kGrid64, kGrid128, kChunked };
  Path path = Path::kAuto;
  // The one-launch forms rank picks by warp ballots where they would use per-token bitmaps.
  bool rank_by_ballots = false;
};

Status layout(const LayoutConfig& config, const TensorView& topk_ids, const Layout& out,
              void* workspace, std::size_t workspace_bytes, Stream stream = nullptr,
              const LayoutOptions& options = LayoutOptions());

// route_and_layout: route (routing.h) then layout of the resulting ids, one call (the CUDA
// backend chains the two kernels with programmatic dependent launch). Same arguments and rules
// as the two calls; layout.num_experts must equal routing.num_experts.
Status route_and_layout(const RoutingConfig& routing, const TensorView& logits,
                        const TensorView& bias, const TensorView& topk_ids,
                        const TensorView& topk_weights, const LayoutConfig& layout_config,
                        const Layout& out, void* workspace, std::size_t workspace_bytes,
                        Stream stream = nullptr, const RouteOptions& route_options = RouteOptions(),
                        const LayoutOptions& layout_options = LayoutOptions());

}  // namespace switchyard
