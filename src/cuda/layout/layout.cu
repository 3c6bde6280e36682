// CUDA layout (docs/design.md section 3): launchers, workspace sizing and path selection. The kernels
// and the algorithm are described in layout_kernels.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "cuda/backend.h"
#include "cuda/common/launch.cuh"
#include "cuda/layout/layout_kernels.cuh"
#include "cuda/layout/layout_plan.h"
#include "cuda/layout/one_launch_layout_kernel.cuh"

namespace switchyard::cuda {

namespace {

using layout_detail::LayoutParams;
using layout_detail::kFineChunk;
using layout_detail::kFineItems;
using layout_detail::kFineMaxHistEntries;
using layout_detail::kGridMaxExchange;
using layout_detail::kLargeChunk;
using layout_detail::kLargeItems;
using layout_detail::kLargeThreads;
using layout_detail::kMaxSmallBlocks;
using layout_detail::kMediumChunk;
using layout_detail::kMediumItems;
using layout_detail::kMediumMaxPicks;
using layout_detail::kMediumThreads;
using layout_detail::kOneBlockMaxPicks;
using layout_detail::kRowsPerOneBlock;
using layout_detail::kRowsPerSmallBlock;
using layout_detail::kSmallMaxPicks;

// Path selection and its thresholds: layout_plan.h.
constexpr std::size_t kWorkspaceAlign = 256;

long long ceil_div(long long a, long long b) { return (a + b - 1) / b; }
std::size_t align_up(std::size_t v) { return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Whether N > kMediumMaxPicks picks over L experts take the chunks of kFineChunk picks.
bool fine_chunks(long long picks, int num_local) {
  return ceil_div(picks, kFineChunk) * std::max(num_local, 1) <= kFineMaxHistEntries;
}

// Chunks (rows of L counts) the workspace must hold for any N' <= N: a workspace sized for a shape
// bound must serve every smaller call, and the chunk count drops where the chunk grows (N = 131072
// -> 131073, and where the chunks of 2048 give way to those of 4096). At least
// kMaxClusterBlocks at every N: the cluster form's blocks exchange their counts there, and it can
// run at any N it fits (where the one-block form's shared memory does not fit, or
// when a path is forced). The grid form's CB blocks use it where it holds CB rows (grid_fits).
constexpr long long kMinChunkRows = layout_detail::kMaxClusterBlocks;
long long workspace_chunks(long long picks, int num_local) {
  if (picks <= kSmallMaxPicks) return kMinChunkRows;
  long long chunks = std::max(kMinChunkRows, ceil_div(std::min(picks, kMediumMaxPicks), kMediumChunk));
  if (picks > kMediumMaxPicks) {
    chunks = std::max(chunks, ceil_div(picks, kLargeChunk));
    // The most fine chunks any N' <= N takes: ceil(N' / 2048) * L <= kFineMaxHistEntries.
    const long long fine =
        std::min(ceil_div(picks, kFineChunk), kFineMaxHistEntries / std::max(num_local, 1));
    chunks = std::max(chunks, fine);
  }
  return chunks;
}

struct WorkspaceLayout {
  std::size_t hist_offset = 0;     // int32 [chunks][L]
  std::size_t dropped_offset = 0;  // int32 [chunks]
  std::size_t bytes = 0;
};

WorkspaceLayout workspace_layout(long long picks, int num_local) {
  WorkspaceLayout w;
  const long long chunks = workspace_chunks(picks, num_local);
  w.hist_offset = 0;
  w.dropped_offset =
      align_up(static_cast<std::size_t>(chunks) * std::max(num_local, 0) * sizeof(std::int32_t));
  w.bytes = w.dropped_offset + align_up(static_cast<std::size_t>(chunks) * sizeof(std::int32_t));
  return w;
}

int bit_width(unsigned v) {
  int bits = 0;
  while (v != 0) {
    ++bits;
    v >>= 1;
  }
  return bits;
}

LayoutParams make_params(const detail::LayoutArgs& a) {
  LayoutParams p;
  p.num_tokens = static_cast<int>(a.num_tokens);
  p.top_k = a.top_k;
  p.num_picks = static_cast<int>(a.num_tokens * a.top_k);
  p.num_experts = a.num_experts;
  p.num_local = a.num_local;
  p.tile_size = a.tile_size;
  p.tile_magic = 0xffffffffu / static_cast<std::uint32_t>(a.tile_size);
  p.token_magic = a.top_k == 1 ? 0u : 0xffffffffu / static_cast<std::uint32_t>(a.top_k) + 1u;
  p.key_bits = std::max(1, bit_width(static_cast<unsigned>(a.num_local)));  // keys 0..L
  p.local_start = a.local_start;
  p.local_stride = a.local_stride;
  p.expert_map = a.expert_map;
  p.capacity_rows = static_cast<int>(a.capacity_rows);
  p.capacity_tiles = static_cast<int>(a.capacity_tiles);
  p.topk_ids = a.topk_ids;
  p.counts = a.counts;
  p.offsets = a.offsets;
  p.permuted_to_expanded = a.permuted_to_expanded;
  p.permuted_to_token = a.permuted_to_token;
  p.expanded_to_permuted = a.expanded_to_permuted;
  p.tile_expert = a.tile_expert;
  p.tile_row_end = a.tile_row_end;
  p.totals = a.totals;
  // The workspace's chunk rows (the chunked pipeline's histograms; the cluster form's counts).
  const WorkspaceLayout w = workspace_layout(static_cast<long long>(p.num_picks), p.num_local);
  char* base = static_cast<char*>(a.workspace);
  p.chunk_hist = reinterpret_cast<std::int32_t*>(base + w.hist_offset);
  p.chunk_dropped = reinterpret_cast<std::int32_t*>(base + w.dropped_offset);
  p.rank_by_ballots = a.options.rank_by_ballots ? 1 : 0;
  return p;
}

// Kernels whose static + dynamic shared memory may pass the 48 KB default need an opt-in per
// device; below this many dynamic bytes every layout kernel stays under it (static <= 36 KB).
constexpr std::size_t kDynamicSmemWithoutOptIn = 8 * 1024;
template <auto kKernel>
cudaError_t allow_dynamic_smem(std::size_t bytes) {
  if (bytes <= kDynamicSmemWithoutOptIn) return cudaSuccess;
  return set_attribute_at_least<kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize>(
      static_cast<int>(bytes));
}

// Clusters past the portable 8 blocks (16 on H100 / H200).
template <auto kKernel>
cudaError_t allow_nonportable_clusters() {
  return set_attribute_at_least<kKernel, cudaFuncAttributeNonPortableClusterSizeAllowed>(1);
}

template <auto kKernel, typename... Args>
Status launch(const char* name, dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream,
              const Args&... args) {
  const cudaError_t err = allow_dynamic_smem<kKernel>(smem);
  if (err != cudaSuccess) return cuda_status(name, err);
  return launch_kernel(name, kKernel, grid, block, smem, stream, /*pdl=*/true, args...);
}

template <int THREADS, int ITEMS, typename Id>
Status launch_small_config(const LayoutParams& p, cudaStream_t stream) {
  const long long rows = std::max<long long>(p.capacity_rows, p.num_picks);
  const long long blocks = std::clamp<long long>(ceil_div(rows, kRowsPerSmallBlock), 1, kMaxSmallBlocks);
  return launch<layout_detail::small_layout_kernel<THREADS, ITEMS, Id>>(
      "layout: small_layout_kernel", dim3(static_cast<unsigned>(blocks)), dim3(THREADS),
      layout_detail::expert_arrays_bytes(p.num_local), stream, p);
}

// LayoutParams::rank_words for a one-launch kernel whose blocks rank `picks` consecutive picks (N,
// or the cluster chunk): one bitmap word per 32 tokens those picks can span (to whole
// kRankWordsBatch), or 0 (ballots) at 512 picks or fewer (ITEMS = 1, where bitmaps were no faster)
// and where the bitmaps do not fit beside the rest of the shared memory.
int rank_words(const LayoutParams& p, bool cluster, int picks) {
  if (p.rank_by_ballots || picks <= layout_detail::kOneThreads) return 0;
  // A run of `picks` picks spans at most (picks - 1) / K + 2 tokens (its ends may cut two).
  const long long tokens = std::min<long long>(p.num_tokens, (picks - 1) / p.top_k + 2);
  constexpr int kBatch = layout_detail::kRankWordsBatch;
  const int words = static_cast<int>(ceil_div(ceil_div(tokens, 32), kBatch) * kBatch);
  const int chunk = cluster ? picks : 0;
  return layout_detail::one_launch_smem_bytes(p.num_local, cluster, chunk, words) <=
                 layout_detail::kOneMaxSmem
             ? words
             : 0;
}

// The cluster form's shared memory, with the bitmaps where it uses them.
std::size_t cluster_smem_bytes(const LayoutParams& p, int blocks) {
  const int chunk = layout_detail::cluster_chunk(p.num_picks, blocks);
  return layout_detail::one_launch_smem_bytes(p.num_local, true, chunk, rank_words(p, true, chunk));
}

// Calls f(std::bool_constant<B>{}) with B = (rank_words > 0): the kernels that rank by bitmaps, or
// the ones without that code (its mere presence cost ~0.15 us per call;
// docs/decisions/layout-one-launch-kernel.md).
template <typename F>
Status with_bitmaps(const LayoutParams& p, F&& f) {
  if (p.rank_words > 0) return f(std::true_type{});
  return f(std::false_type{});
}

bool one_block_fits(const LayoutParams& p) {
  return p.num_picks <= kOneBlockMaxPicks &&
         layout_detail::one_launch_smem_bytes(p.num_local, false) <= layout_detail::kOneMaxSmem;
}

// The cluster (or grid) form of `blocks` blocks fits: at most 8 groups of 32 picks per warp
// (16-block cluster: N <= 65536; grid of 128 blocks: N <= 524288) and its shared memory.
bool cluster_fits(const LayoutParams& p, int blocks) {
  return p.num_picks <= 8LL * layout_detail::kOneThreads * blocks &&
         cluster_smem_bytes(p, blocks) <= layout_detail::kOneMaxSmem;
}

// Calls f(std::integral_constant<int, KB>{}) with the compile-time key-bit bound for p.
template <typename F>
Status with_key_bits(const LayoutParams& p, F&& f) {
  if (layout_detail::key_bits_bound(p.key_bits) == layout_detail::kKeyBitsSmall)
    return f(std::integral_constant<int, layout_detail::kKeyBitsSmall>{});
  return f(std::integral_constant<int, layout_detail::kKeyBitsLarge>{});
}

// The one-launch kernels' slices for a grid of `blocks` (LayoutParams::rows_per_block etc.).
LayoutParams with_block_slices(const LayoutParams& p, long long blocks) {
  LayoutParams q = p;
  q.rows_per_block = static_cast<int>(ceil_div(p.capacity_rows, blocks));
  q.tiles_per_block = static_cast<int>(ceil_div(p.capacity_tiles, blocks));
  q.picks_per_block = static_cast<int>(ceil_div(p.num_picks, blocks));
  q.locals_per_block = static_cast<int>(ceil_div(p.num_local, blocks));
  return q;
}

template <int ITEMS, typename Id>
Status launch_one_block_config(const LayoutParams& params, cudaStream_t stream) {
  DeviceProps props;
  SY_RETURN_IF_ERROR(current_device_props("layout", &props));
  const long long rows = std::max<long long>(params.capacity_rows, params.num_picks);
  const long long blocks =
      std::clamp<long long>(ceil_div(rows, kRowsPerOneBlock), 1, std::max(props.sm_count, 1));
  LayoutParams p = with_block_slices(params, blocks);
  p.rank_words = rank_words(p, false, p.num_picks);
  const std::size_t smem = layout_detail::one_launch_smem_bytes(p.num_local, false, 0, p.rank_words);
  return with_key_bits(p, [&](auto kb) {
    return with_bitmaps(p, [&](auto bits) {
      constexpr bool kBits = ITEMS > 1 && decltype(bits)::value;  // (ITEMS = 1: one kernel)
      constexpr int KB = decltype(kb)::value;
      const dim3 grid(static_cast<unsigned>(blocks));
      const dim3 block(layout_detail::kOneThreads);
      // Up to kSplitMaxLocal local experts (key bits < 10), the kernel that scans beside the
      // per-expert prefixes (one_block_offsets; its shared memory, one_launch_smem_bytes).
      if constexpr (KB == layout_detail::kKeyBitsSmall) {
        if (p.num_local <= layout_detail::kSplitMaxLocal) {
          return launch<layout_detail::one_block_layout_kernel<ITEMS, KB, Id, kBits, true>>(
              "layout: one_block_layout_kernel", grid, block, smem, stream, p);
        }
      }
      return launch<layout_detail::one_block_layout_kernel<ITEMS, KB, Id, kBits, false>>(
          "layout: one_block_layout_kernel", grid, block, smem, stream, p);
    });
  });
}

// ITEMS = groups of 32 picks per warp: a block ranks N (one block) or N / CB (cluster) picks. An
// exact ITEMS matters: the kernel's loops unroll ITEMS times behind warp-uniform guards (ITEMS = 2
// instead of 4 for 513..1024 picks took E=256 K=8 T = 128 from 3.11 to 2.97 us;
// docs/decisions/layout-one-launch-kernel.md).
template <typename Id>
Status launch_one_block(const LayoutParams& p, cudaStream_t stream) {
  constexpr int kThreads = layout_detail::kOneThreads;
  if (p.num_picks <= kThreads * 1) return launch_one_block_config<1, Id>(p, stream);
  if (p.num_picks <= kThreads * 2) return launch_one_block_config<2, Id>(p, stream);
  if (p.num_picks <= kThreads * 4) return launch_one_block_config<4, Id>(p, stream);
  if (p.num_picks <= kThreads * 6) return launch_one_block_config<6, Id>(p, stream);
  return launch_one_block_config<8, Id>(p, stream);
}

// One cluster of CB <= 16 blocks (the cluster dimension is a launch attribute; CB = 16 needs the
// non-portable opt-in), or the grid form: a cooperative launch of CB blocks. Both with PDL.
template <auto kKernel, int CB>
Status launch_cluster_kernel(const LayoutParams& p, std::size_t smem, cudaStream_t stream) {
  const char* name = "layout: cluster_layout_kernel";
  constexpr bool kGrid = CB > layout_detail::kMaxClusterBlocks;
  cudaError_t err = allow_dynamic_smem<kKernel>(smem);
  if (err == cudaSuccess && !kGrid && CB > layout_detail::kClusterBlocksPortable)
    err = allow_nonportable_clusters<kKernel>();
  if (err != cudaSuccess) return cuda_status(name, err);
  return launch_kernel_with(name, kKernel, dim3(CB), dim3(layout_detail::kOneThreads), smem, stream,
                            /*pdl=*/true, kGrid ? 0u : static_cast<unsigned>(CB), /*cooperative=*/kGrid, p);
}

template <int CB, typename Id>
Status launch_cluster(const LayoutParams& params, cudaStream_t stream) {
  LayoutParams p = with_block_slices(params, CB);
  const int chunk = layout_detail::cluster_chunk(p.num_picks, CB);
  p.rank_words = rank_words(p, true, chunk);
  const std::size_t smem = layout_detail::one_launch_smem_bytes(p.num_local, true, chunk, p.rank_words);
  return with_key_bits(p, [&](auto kb) {
    return with_bitmaps(p, [&](auto bits) {
      constexpr int KB = decltype(kb)::value;
      constexpr bool kBits = decltype(bits)::value;
      using layout_detail::cluster_layout_kernel;
      constexpr int kThreads = layout_detail::kOneThreads;
      if (chunk <= kThreads * 1)
        return launch_cluster_kernel<cluster_layout_kernel<1, CB, KB, Id, false>, CB>(p, smem, stream);
      if (chunk <= kThreads * 2)
        return launch_cluster_kernel<cluster_layout_kernel<2, CB, KB, Id, kBits>, CB>(p, smem, stream);
      if (chunk <= kThreads * 4)
        return launch_cluster_kernel<cluster_layout_kernel<4, CB, KB, Id, kBits>, CB>(p, smem, stream);
      return launch_cluster_kernel<cluster_layout_kernel<8, CB, KB, Id, kBits>, CB>(p, smem, stream);
    });
  });
}

// Whether the one-launch kernel kKernel can be scheduled with `smem` bytes of shared memory on
// the current device: probe(device, bytes) answers for the largest size of smem's class (up to
// 64 KB, or up to kOneMaxSmem), once per device and class (a host-side cache; each kernel has its
// own). Any error reads as "no", and leaves no error behind.
template <auto kKernel, typename Probe>
bool schedulable(std::size_t smem, Probe&& probe) {
  static std::atomic<int> cache[kMaxDevicesCached][2];  // 0 unknown, 1 yes, 2 no; [small, large smem]
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevicesCached) return false;
  const int cls = smem > 64 * 1024 ? 1 : 0;
  const int known = cache[device][cls].load(std::memory_order_relaxed);
  if (known != 0) return known == 1;
  const std::size_t bytes = cls ? layout_detail::kOneMaxSmem : 64 * 1024;
  cudaError_t err = allow_dynamic_smem<kKernel>(bytes);
  bool ok = false;
  if (err == cudaSuccess) err = probe(device, bytes, ok);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // a refused probe leaves no error behind
    ok = false;
  }
  cache[device][cls].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

// Whether this device can run one 16-block cluster of the layout kernel with this much shared
// memory (a cluster needs 16 free SMs of one GPC).
template <typename Id>
bool cluster16_schedulable(std::size_t smem) {
  constexpr auto kKernel =
      layout_detail::cluster_layout_kernel<1, 16, layout_detail::kKeyBitsSmall, Id, false>;
  return schedulable<kKernel>(smem, [](int, std::size_t bytes, bool& ok) {
    cudaError_t err = allow_nonportable_clusters<kKernel>();
    if (err != cudaSuccess) return err;
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(16);
    config.blockDim = dim3(layout_detail::kOneThreads);
    config.dynamicSmemBytes = bytes;
    cudaLaunchAttribute attribute[kMaxLaunchAttributes];
    config.attrs = attribute;
    config.numAttrs = launch_attributes(/*pdl=*/false, 16, /*cooperative=*/false, attribute);
    int clusters = 0;
    err = cudaOccupancyMaxActiveClusters(&clusters, kKernel, &config);
    ok = clusters > 0;
    return err;
  });
}

template <typename Id>
Status launch_small(const LayoutParams& p, cudaStream_t stream) {
  if (p.num_picks <= 128) return launch_small_config<128, 1, Id>(p, stream);
  if (p.num_picks <= 1024) return launch_small_config<256, 4, Id>(p, stream);
  if (p.num_picks <= 2048) return launch_small_config<256, 8, Id>(p, stream);
  return launch_small_config<512, 8, Id>(p, stream);
}

template <int THREADS, int ITEMS, typename Id>
Status launch_chunked(LayoutParams p, cudaStream_t stream) {
  p.chunk_picks = THREADS * ITEMS;
  p.num_chunks = static_cast<int>(ceil_div(p.num_picks, p.chunk_picks));
  const dim3 chunks(static_cast<unsigned>(p.num_chunks));
  const std::size_t hist_bytes = static_cast<std::size_t>(p.num_local) * sizeof(std::int32_t);
  constexpr auto histogram = layout_detail::chunk_histogram_kernel<THREADS, ITEMS, Id>;
  constexpr auto scatter = layout_detail::chunk_scatter_kernel<THREADS, ITEMS, Id>;
  SY_RETURN_IF_ERROR(
      launch<histogram>("layout: chunk_histogram_kernel", chunks, dim3(THREADS), hist_bytes, stream, p));
  const unsigned scan_blocks = static_cast<unsigned>(std::max<long long>(1, ceil_div(p.num_local, 32)));
  SY_RETURN_IF_ERROR(launch<layout_detail::chunk_scan_kernel>(
      "layout: chunk_scan_kernel", dim3(scan_blocks), dim3(32, layout_detail::kScanRowsY), 0, stream, p));
  return launch<scatter>("layout: chunk_scatter_kernel", chunks, dim3(THREADS),
                         layout_detail::expert_arrays_bytes(p.num_local), stream, p);
}

// The paths of several kernels: one sorting kernel (N <= kSmallMaxPicks), else histogram, scan
// and scatter kernels over chunks.
template <typename Id>
Status launch_multi_kernel(const LayoutParams& p, cudaStream_t stream) {
  if (p.num_picks <= kSmallMaxPicks) return launch_small<Id>(p, stream);
  if (p.num_picks <= kMediumMaxPicks) return launch_chunked<kMediumThreads, kMediumItems, Id>(p, stream);
  if (fine_chunks(p.num_picks, p.num_local)) return launch_chunked<kLargeThreads, kFineItems, Id>(p, stream);
  return launch_chunked<kLargeThreads, kLargeItems, Id>(p, stream);
}

// Whether this device can hold all CB blocks of the grid form at once with this much shared
// memory, in a cooperative launch.
template <int CB, typename Id>
bool grid_schedulable(std::size_t smem) {
  constexpr auto kKernel =
      layout_detail::cluster_layout_kernel<1, CB, layout_detail::kKeyBitsSmall, Id, false>;
  return schedulable<kKernel>(smem, [](int device, std::size_t bytes, bool& ok) {
    int per_sm = 0, sms = 0, cooperative = 0;
    cudaError_t err =
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, layout_detail::kOneThreads, bytes);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device);
    ok = cooperative != 0 && per_sm * sms >= CB;
    return err;
  });
}

// What plan_layout_path asks of this call on this device (layout_plan.h's Fits).
template <typename Id>
struct DeviceFits {
  const LayoutParams& p;
  bool one_block() const { return one_block_fits(p); }
  bool cluster8() const { return cluster_fits(p, 8); }
  bool cluster16() const { return cluster_fits(p, 16) && cluster16_schedulable<Id>(cluster_smem_bytes(p, 16)); }
  // The grid form of CB blocks: where the workspace holds CB rows of counts (it does from N =
  // CB * kMediumChunk on, where the chunked pipeline needs as many), every block's loads of the
  // counts stay within kGridMaxExchange, the form fits, and all CB blocks fit on the device at once.
  bool grid(int cb) const {
    if (workspace_chunks(p.num_picks, p.num_local) < cb || static_cast<long long>(cb) * p.num_local > kGridMaxExchange ||
        !cluster_fits(p, cb))
      return false;
    const std::size_t smem = cluster_smem_bytes(p, cb);
    return cb == 32 ? grid_schedulable<32, Id>(smem) : cb == 64 ? grid_schedulable<64, Id>(smem)
                                                                : grid_schedulable<128, Id>(smem);
  }
};

template <typename Id>
Status layout_typed(const detail::LayoutArgs& a, cudaStream_t stream) {
  using layout_detail::LayoutPath;
  const LayoutParams p = make_params(a);
  switch (layout_detail::plan_layout_path(p.num_picks, p.num_local, a.options.path, a.independent_blocks,
                                          DeviceFits<Id>{p})) {
    case LayoutPath::kOneBlock:
      return launch_one_block<Id>(p, stream);
    case LayoutPath::kCluster8:
      return launch_cluster<8, Id>(p, stream);
    case LayoutPath::kCluster16:
      return launch_cluster<16, Id>(p, stream);
    case LayoutPath::kGrid32:
      return launch_cluster<32, Id>(p, stream);
    case LayoutPath::kGrid64:
      return launch_cluster<64, Id>(p, stream);
    case LayoutPath::kGrid128:
      return launch_cluster<128, Id>(p, stream);
    case LayoutPath::kChunked:
    case LayoutPath::kAuto:
      break;
  }
  return launch_multi_kernel<Id>(p, stream);
}

}  // namespace

std::size_t layout_workspace_bytes(const detail::LayoutArgs& shape) {
  return workspace_layout(shape.num_tokens * shape.top_k, shape.num_local).bytes;
}

Status layout(const detail::LayoutArgs& args, Stream stream) {
  if (args.num_local > layout_detail::kMaxLocalExperts) {
    return Status::Unsupported("layout: " + std::to_string(args.num_local) +
                               " local experts; the CUDA backend supports at most " +
                               std::to_string(layout_detail::kMaxLocalExperts));
  }
  if (args.workspace_bytes < layout_workspace_bytes(args)) {
    return Status::Internal("layout: the CUDA backend was handed a workspace smaller than it asked for");
  }
  switch (args.ids_dtype) {
    case DType::kInt32:
      return layout_typed<std::int32_t>(args, stream);
    case DType::kInt64:
      return layout_typed<std::int64_t>(args, stream);
    default:
      return Status::Internal(std::string("layout: CUDA backend reached with ids dtype ") +
                              dtype_name(args.ids_dtype));
  }
}

Status route_and_layout(const detail::RouteArgs& route_args, const detail::LayoutArgs& layout_args,
                        Stream stream) {
  // A layout the backend cannot do fails before routing writes anything.
  if (layout_args.num_local > layout_detail::kMaxLocalExperts) return layout(layout_args, stream);
  // The routing kernel, then the layout kernels, chained by programmatic dependent launch. Five
  // fused one-launch forms measured slower or no faster: routing's and the layout's own latencies
  // stay on the critical path either way, and the second launch is mostly hidden by PDL
  // (docs/decisions/route-layout-two-launches.md).
  SY_RETURN_IF_ERROR(route(route_args, stream));
  return layout(layout_args, stream);
}

}  // namespace switchyard::cuda
