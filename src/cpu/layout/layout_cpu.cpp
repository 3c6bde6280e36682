// CPU layout (docs/design.md section 3): a counting sort of the expanded picks x = t*K + k by local
// expert, stable in x, so that the result is the sequential definition bit for bit however the
// work is split over threads.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "cpu/backend.h"
#include "cpu/parallel.h"

namespace switchyard::cpu {

namespace {

// Picks per chunk below which another thread does not pay for its start-up.
constexpr std::int64_t kPicksPerChunk = 32768;

// Global expert -> local index, or -1 when the expert is not local. One table lookup per pick
// instead of a division (range form) or a bounds check (map form) in the hot loop.
std::vector<std::int32_t> local_index_table(const detail::LayoutArgs& a) {
  std::vector<std::int32_t> table(static_cast<std::size_t>(a.num_experts), -1);
  if (a.expert_map != nullptr) {
    for (int e = 0; e < a.num_experts; ++e) {
      const std::int32_t l = a.expert_map[e];
      // An entry outside [-1, L) is data, not an error: it counts as -1.
      if (l >= 0 && l < a.num_local) table[e] = l;
    }
  } else {
    for (int l = 0; l < a.num_local; ++l) {
      const std::int64_t e = a.local_start + static_cast<std::int64_t>(l) * a.local_stride;
      if (e >= 0 && e < a.num_experts) table[static_cast<std::size_t>(e)] = l;
    }
  }
  return table;
}

// Phase 1 over picks [begin, end): each pick's local expert (or -1), the chunk's histogram,
// and the chunk's count of ids outside [0, E) other than -1.
template <typename Id>
void classify(const Id* ids, std::int64_t begin, std::int64_t end, const std::vector<std::int32_t>& table,
              std::int32_t* pick_local, std::int32_t* hist, std::int64_t* dropped) {
  const std::int64_t num_experts = static_cast<std::int64_t>(table.size());
  std::int64_t drop = 0;
  for (std::int64_t x = begin; x < end; ++x) {
    const std::int64_t e = static_cast<std::int64_t>(ids[x]);
    std::int32_t l = -1;
    if (e >= 0 && e < num_experts) {
      l = table[static_cast<std::size_t>(e)];
    } else if (e != -1) {
      ++drop;
    }
    pick_local[x] = l;
    if (l >= 0) ++hist[l];
  }
  *dropped = drop;
}

template <typename Id>
Status layout_impl(const detail::LayoutArgs& a) {
  const Id* ids = static_cast<const Id*>(a.topk_ids);
  const std::int64_t K = a.top_k;
  const std::int64_t T = a.num_tokens;
  const std::int64_t picks = T * K;
  const std::int64_t L = a.num_local;
  const std::int64_t M = a.tile_size;
  const std::vector<std::int32_t> table = local_index_table(a);

  // Chunks of contiguous picks, each with its own histogram. Chunk c's rows for expert l start
  // after every row of chunks c' < c for l, which keeps ascending x inside each expert.
  const std::int64_t hw = std::max<std::int64_t>(1, std::thread::hardware_concurrency());
  std::int64_t num_chunks = std::min<std::int64_t>(hw, picks / kPicksPerChunk);
  // Histograms cost num_chunks * L; never let them outweigh the picks themselves.
  if (L > 0) num_chunks = std::min<std::int64_t>(num_chunks, std::max<std::int64_t>(1, picks / L));
  num_chunks = std::max<std::int64_t>(num_chunks, 1);
  const std::int64_t chunk_len = (picks + num_chunks - 1) / num_chunks;

  std::vector<std::int32_t> pick_local(static_cast<std::size_t>(picks));
  // Per chunk and expert: the histogram, turned by the scan into the chunk's next row.
  std::vector<std::int32_t> cursor(static_cast<std::size_t>(num_chunks * L), 0);
  std::vector<std::int64_t> dropped(static_cast<std::size_t>(num_chunks), 0);

  parallel_for(num_chunks, 1, [&](std::int64_t c0, std::int64_t c1) {
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::int64_t b = std::min(picks, c * chunk_len);
      const std::int64_t e = std::min(picks, b + chunk_len);
      classify(ids, b, e, table, pick_local.data(), cursor.data() + c * L, &dropped[c]);
    }
  });

  // Deterministic scan: counts, padded offsets, and each chunk's first row per expert.
  std::int64_t row = 0;
  for (std::int64_t l = 0; l < L; ++l) {
    a.offsets[l] = static_cast<std::int32_t>(row);
    std::int64_t count = 0;
    for (std::int64_t c = 0; c < num_chunks; ++c) {
      std::int32_t& slot = cursor[c * L + l];
      const std::int32_t n = slot;
      slot = static_cast<std::int32_t>(row + count);
      count += n;
    }
    a.counts[l] = static_cast<std::int32_t>(count);
    row += (count + M - 1) / M * M;
  }
  const std::int64_t padded_total = row;
  a.offsets[L] = static_cast<std::int32_t>(padded_total);
  std::int64_t total_dropped = 0;
  for (const std::int64_t d : dropped) total_dropped += d;

  // Scatter: every pick to its row, in ascending x within a chunk.
  const std::int32_t pad_expanded = static_cast<std::int32_t>(picks);
  const std::int32_t pad_token = static_cast<std::int32_t>(T);
  parallel_for(num_chunks, 1, [&](std::int64_t c0, std::int64_t c1) {
    for (std::int64_t c = c0; c < c1; ++c) {
      const std::int64_t b = std::min(picks, c * chunk_len);
      const std::int64_t e = std::min(picks, b + chunk_len);
      std::int32_t* next = cursor.data() + c * L;
      for (std::int64_t x = b; x < e; ++x) {
        const std::int32_t l = pick_local[x];
        if (l < 0) {
          a.expanded_to_permuted[x] = -1;
          continue;
        }
        const std::int32_t p = next[l]++;
        a.permuted_to_expanded[p] = static_cast<std::int32_t>(x);
        a.permuted_to_token[p] = static_cast<std::int32_t>(x / K);
        a.expanded_to_permuted[x] = p;
      }
    }
  });

  // Padding rows inside each expert's segment, then every row past padded_total up to the
  // capacity, hold the sentinels.
  for (std::int64_t l = 0; l < L; ++l) {
    const std::int64_t end_real = static_cast<std::int64_t>(a.offsets[l]) + a.counts[l];
    const std::int64_t end_seg = a.offsets[l + 1];
    std::fill(a.permuted_to_expanded + end_real, a.permuted_to_expanded + end_seg, pad_expanded);
    std::fill(a.permuted_to_token + end_real, a.permuted_to_token + end_seg, pad_token);
  }
  std::fill(a.permuted_to_expanded + padded_total, a.permuted_to_expanded + a.capacity_rows, pad_expanded);
  std::fill(a.permuted_to_token + padded_total, a.permuted_to_token + a.capacity_rows, pad_token);

  // Tiles: every segment is a whole number of tiles, so tile i belongs to exactly one expert.
  const std::int64_t num_tiles = padded_total / M;
  for (std::int64_t l = 0; l < L; ++l) {
    const std::int64_t end_real = static_cast<std::int64_t>(a.offsets[l]) + a.counts[l];
    for (std::int64_t i = a.offsets[l] / M; i < a.offsets[l + 1] / M; ++i) {
      a.tile_expert[i] = static_cast<std::int32_t>(l);
      a.tile_row_end[i] = static_cast<std::int32_t>(std::min((i + 1) * M, end_real));
    }
  }
  for (std::int64_t i = num_tiles; i < a.capacity_tiles; ++i) {
    a.tile_expert[i] = -1;
    a.tile_row_end[i] = static_cast<std::int32_t>(i * M);
  }

  a.totals[kPaddedTotal] = static_cast<std::int32_t>(padded_total);
  a.totals[kNumTiles] = static_cast<std::int32_t>(num_tiles);
  // The count saturates rather than wraps; it cannot exceed T*K < 2^31 anyway.
  a.totals[kDropped] = static_cast<std::int32_t>(
      std::min<std::int64_t>(total_dropped, std::numeric_limits<std::int32_t>::max()));
  return Status::Ok();
}

}  // namespace

Status layout(const detail::LayoutArgs& args) {
  switch (args.ids_dtype) {
    case DType::kInt32:
      return layout_impl<std::int32_t>(args);
    case DType::kInt64:
      return layout_impl<std::int64_t>(args);
    default:
      return Status::Internal("layout: CPU backend reached with ids dtype " +
                              std::string(dtype_name(args.ids_dtype)));
  }
}

}  // namespace switchyard::cpu
