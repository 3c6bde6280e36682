// Expert parallelism internals shared by the CPU reference and the GPU group: the byte layout
// of a GPU rank's region and of a GPU handle, and the plan a Handle points to.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "switchyard/ep.h"
#include "switchyard/permute.h"

namespace switchyard::ep::detail {

// The GPU group's destination masks and peer tables hold at most this many ranks.
constexpr int kMaxRanks = 64;
// A header count that says "this source's arguments were bad; no rows follow".
constexpr std::uint32_t kBadArguments = 0xffffffffu;

constexpr std::int64_t align_up(std::int64_t v, std::int64_t a) { return (v + a - 1) / a * a; }

// A rank's region (the same offsets on every rank). Peers write it; its owner reads it.
//   dispatch_header[s]  u64 (epoch << 32) | rows source s sent here (or kBadArguments)
//   dispatch_ack[d]     u64 epoch of the last dispatch whose rows rank d has copied out of its
//                       slots for this rank (this rank may then overwrite them)
//   combine_flag[d]     u64 (epoch << 32) | dispatch epoch of rank d's handle (or kBadArguments)
//   combine_ack[s]      u64 epoch of the last combine whose partials source s has summed
//   slot_rows           [R sources][max_tokens] rows of row_stride bytes
//   slot_scales         [R][max_tokens][scale_cols] fp32
//   slot_meta           [R][max_tokens][meta_ints] int32: source token, j (the row's position
//                       among the token's destination ranks), K local ids, K weights (fp32 bits)
//   partials            [partial_slots = min(R, K)][max_tokens][H] partial dtype
//   partial_values      [partial_slots][max_tokens][K] fp32 (CombineInputs::pick_values)
struct RegionOffsets {
  std::int64_t dispatch_header = 0, dispatch_ack = 0, combine_flag = 0, combine_ack = 0;
  std::int64_t slot_rows = 0, slot_scales = 0, slot_meta = 0, partials = 0, partial_values = 0, total = 0;
  std::int64_t row_bytes = 0;   // H * element size
  std::int64_t row_stride = 0;  // row_bytes rounded up to 16
  int meta_ints = 0;            // 2 + 2K
  int partial_slots = 0;        // min(R, K)
};

inline RegionOffsets region_offsets(const GroupConfig& c) {
  RegionOffsets o;
  const std::int64_t R = c.num_ranks, T = c.max_tokens, K = c.top_k;
  o.row_bytes = c.hidden * static_cast<std::int64_t>(dtype_size(c.dtype));
  o.row_stride = align_up(o.row_bytes, 16);
  o.meta_ints = static_cast<int>(2 + 2 * K);
  o.partial_slots = static_cast<int>(R < K ? R : K);
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t here = at;
    at = align_up(at + bytes, 128);
    return here;
  };
  o.dispatch_header = take(8 * R);
  o.dispatch_ack = take(8 * R);
  o.combine_flag = take(8 * R);
  o.combine_ack = take(8 * R);
  o.slot_rows = take(R * T * o.row_stride);
  o.slot_scales = take(R * T * c.scale_cols * 4);
  o.slot_meta = take(R * T * o.meta_ints * 4);
  o.partials = take(o.partial_slots * T * c.hidden * static_cast<std::int64_t>(dtype_size(c.partial_dtype)));
  o.partial_values = take(o.partial_slots * T * K * 4);
  o.total = at;
  return o;
}

// A GPU handle's device memory (DispatchOutputs::handle_memory).
//   header       int64[8]: kTokens, kRecvRows, kSentRows, kDropped, kEpoch (see HandleHeader)
//   send_counts  [R] int32: rows this rank sent to each destination
//   n_dest       [max_tokens] int32: destination ranks of each source token
//   dest_slot    [max_tokens, R] int32: the token's slot at each destination, -1 if not sent
//   recv_offsets [R+1] int32: first received row of each source
//   row_src, row_token, row_j [N] int32: each received row's source, token and position j
//   row_weights  [N,K] fp32; row_e2p [N,K] int32 (expert-major: each pick's row, -1 elsewhere)
enum HandleHeader : int { kTokens = 0, kHdrRecvRows = 1, kHdrSentRows = 2, kHdrDropped = 3, kEpoch = 4 };

struct HandleOffsets {
  std::int64_t header = 0, send_counts = 0, n_dest = 0, dest_slot = 0, recv_offsets = 0;
  std::int64_t row_src = 0, row_token = 0, row_j = 0, row_weights = 0, row_e2p = 0, total = 0;
};

inline HandleOffsets handle_offsets(const GroupConfig& c) {
  HandleOffsets o;
  const std::int64_t R = c.num_ranks, T = c.max_tokens, K = c.top_k, N = R * T;
  std::int64_t at = 0;
  auto take = [&](std::int64_t bytes) {
    const std::int64_t here = at;
    at = align_up(at + bytes, 16);
    return here;
  };
  o.header = take(8 * 8);
  o.send_counts = take(4 * R);
  o.n_dest = take(4 * T);
  o.dest_slot = take(4 * T * R);
  o.recv_offsets = take(4 * (R + 1));
  o.row_src = take(4 * N);
  o.row_token = take(4 * N);
  o.row_j = take(4 * N);
  o.row_weights = take(4 * N * K);
  o.row_e2p = take(4 * N * K);
  o.total = at;
  return o;
}

}  // namespace switchyard::ep::detail

namespace switchyard::ep {

// What a Handle points to. CpuGroup fills `ranks` (one plan shared by the R ranks of one
// dispatch); a GpuGroup handle describes one rank and its device memory (`gpu`).
struct Handle::Plan {
  const void* group = nullptr;  // the group's state it belongs to
  struct Rank {
    bool expert_major = false;             // this rank's dispatch wrote the expert-major output
    std::int64_t tokens = 0;               // T of this rank as source
    std::vector<std::int64_t> ids;         // its [T,K] input ids (checked on reuse)
    std::vector<std::int32_t> dest_row;    // [T,R]: row of token t at rank d, or -1
    std::vector<std::int32_t> src_rank;    // received rows' sources, as destination
    std::vector<std::int32_t> src_token;
    std::vector<std::int32_t> local_ids;   // [rows,K] received local ids
    std::vector<float> weights;            // [rows,K] received weights
    std::vector<std::int32_t> expanded_to_permuted;  // [rows,K] of the expert-major layout
  };
  std::vector<Rank> ranks;
  struct Gpu {
    int rank = -1;
    void* memory = nullptr;  // DispatchOutputs::handle_memory of that dispatch
    std::int64_t tokens = 0;
    bool expert_major = false;
  } gpu;
};

}  // namespace switchyard::ep
