// The GPU expert-parallel group: regions, peer maps (loopback and CUDA IPC providers), argument
// checks and kernel launches (kernels in ep_kernels.cuh).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "api/ep_checks.h"
#include "common/ep_memory.h"
#include "common/validate.h"
#include "cuda/common/launch.cuh"
#include "cuda/ep/ep_kernels.cuh"
#include "switchyard/ep.h"
#include "switchyard/layout.h"

namespace switchyard::ep {

namespace {

using gpu::Ctx;
using gpu::ErrorWord;
using gpu::LocalState;
using gpu::Shape;
using switchyard::detail::ArgChecker;
using switchyard::detail::Contiguity;

Status cuda_status(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return Status::Ok();
  return Status::CudaError(std::string("ep gpu group: ") + what + ": " + cudaGetErrorString(err));
}
#define SY_EP_CUDA(expr, what) SY_RETURN_IF_ERROR(cuda_status((expr), (what)))

// Blocks of the transport kernels when options.num_sms is 0.
constexpr int kDefaultBlocks = 24;

// Scratch of a rank's expert-major layout: the layout of N = R * max_tokens received rows (rows
// past the received count unplaced), copied out for the received rows by dispatch_copy.
struct LayoutScratch {
  int* ids = nullptr;  // [N,K]
  int* counts = nullptr;
  int* offsets = nullptr;
  int* p2x = nullptr;
  int* p2t = nullptr;
  int* e2p = nullptr;
  int* tile_expert = nullptr;
  int* tile_row_end = nullptr;
  int* totals = nullptr;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  Layout view;  // device views of the arrays above
};

}  // namespace

struct GpuGroup::State {
  GroupConfig config;
  GpuOptions options;
  bool loopback = false;
  int device = 0;
  int blocks = kDefaultBlocks;
  Shape shape;
  std::vector<void*> allocations;  // freed at destruction (cudaFree)
  std::vector<void*> opened;       // peers' regions opened through CUDA IPC

  struct Rank {
    bool local = false;
    Ctx ctx;
    ErrorWord* error_host = nullptr;  // mapped pinned
    LayoutScratch layout;
    Stream last_stream = nullptr;
    bool used = false;
    unsigned long long dispatches = 0;  // dispatch calls so far (exact mode's epoch)
  };
  std::vector<Rank> ranks;

  ~State() {
    cudaSetDevice(device);
    cudaDeviceSynchronize();
    for (void* p : opened) cudaIpcCloseMemHandle(p);
    for (Rank& r : ranks)
      if (r.error_host) cudaFreeHost(r.error_host);
    for (auto it = allocations.rbegin(); it != allocations.rend(); ++it) cudaFree(*it);
  }

  Status alloc(std::size_t bytes, void** p) {
    SY_EP_CUDA(cudaMalloc(p, std::max<std::size_t>(bytes, 16)), "cudaMalloc");
    allocations.push_back(*p);
    return Status::Ok();
  }
};

namespace {

// Dispatch-rows vector type: the widest of 16, 8, 4, 2, 1 bytes dividing every address and
// stride the row copies use.
int row_vector_bytes(std::initializer_list<std::uint64_t> values) {
  for (int v : {16, 8, 4, 2}) {
    bool ok = true;
    for (std::uint64_t x : values) ok = ok && x % static_cast<std::uint64_t>(v) == 0;
    if (ok) return v;
  }
  return 1;
}

// fn(Format{}) for a float dtype (checked before), returning its Status.
template <typename F>
Status with_format(DType dtype, F f) {
  Status st = Status::Internal(std::string("ep gpu group: no float format for ") + dtype_name(dtype));
  cuda::with_float_format(dtype, [&](auto format) { st = f(format); });
  return st;
}

// fn(Format{}) for the combine partial dtype: fp32 or bf16 (validate() admits no other).
template <typename F>
Status with_partial_format(DType partial_dtype, F f) {
  return partial_dtype == DType::kBFloat16 ? f(cuda::Bf16Format{}) : f(cuda::Fp32Format{});
}

// The row vector width (bytes) as a template constant.
template <typename F>
Status with_row_vector(int bytes, F f) {
  return cuda::dispatch_value<1, 2, 4, 8, 16>("ep row vector bytes", bytes, f);
}

// The layout of a rank's received rows: its L local experts, tile M, blocks that never wait for
// each other (peers' transport kernels may hold SMs meanwhile).
LayoutConfig received_rows_layout(const GroupConfig& c) {
  LayoutConfig lc;
  lc.num_experts = c.experts_per_rank();
  lc.local = LocalExperts::all();
  lc.tile_size = c.tile_size;
  lc.independent_blocks = true;
  return lc;
}

template <typename Kernel, typename Params>
Status launch(Kernel kernel, int blocks, int threads, const Params& p, Stream stream, const char* name) {
  kernel<<<blocks, threads, 0, stream>>>(p);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return Status::CudaError(std::string("ep gpu group: launch of ") + name + ": " + cudaGetErrorString(err));
  return Status::Ok();
}

// Loads every transport kernel now: with lazy loading, a first launch while peers' kernels spin
// could wait for them.
Status preload_kernels() {
  cudaFuncAttributes a;
  auto load = [&](const void* f) { return cuda_status(cudaFuncGetAttributes(&a, f), "loading a kernel"); };
  SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::dispatch_plan_kernel)));
  SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::dispatch_receive_kernel)));
  for (int b : {16, 8, 4, 2, 1}) {
    SY_RETURN_IF_ERROR(with_row_vector(b, [&](auto v) {
      SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::dispatch_send_kernel<decltype(v)::value>)));
      return load(reinterpret_cast<const void*>(gpu::dispatch_copy_kernel<decltype(v)::value>));
    }));
  }
  for (DType y : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) {
    for (DType partial : {DType::kFloat32, DType::kBFloat16}) {
      SY_RETURN_IF_ERROR(with_format(y, [&](auto yf) {
        return with_partial_format(partial, [&](auto pf) {
          using YF = decltype(yf);
          using PF = decltype(pf);
          SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::combine_send_kernel<YF, PF, 8>)));
          SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::combine_send_kernel<YF, PF, 1>)));
          SY_RETURN_IF_ERROR(load(reinterpret_cast<const void*>(gpu::combine_receive_kernel<PF, YF, 8>)));
          return load(reinterpret_cast<const void*>(gpu::combine_receive_kernel<PF, YF, 1>));
        });
      }));
    }
  }
  return Status::Ok();
}

Status check_options(const GroupConfig& c, const GpuOptions& o, int sms) {
  auto bad = [](const char* field, const std::string& what) {
    return Status::InvalidArgument(std::string("ep gpu group: ") + field + " " + what);
  };
  if (c.num_ranks > detail::kMaxRanks) {
    return bad("config.num_ranks", "= " + std::to_string(c.num_ranks) + ", the GPU group supports at most " +
                                       std::to_string(detail::kMaxRanks));
  }
  if (o.num_sms < 0 || o.num_sms > sms) {
    return bad("options.num_sms", "= " + std::to_string(o.num_sms) + ", must be in [0, " + std::to_string(sms) +
                                      "] (0: default; the device has " + std::to_string(sms) + " SMs)");
  }
  return Status::Ok();
}

}  // namespace

GpuGroup::GpuGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
GpuGroup::~GpuGroup() = default;

const GroupConfig& GpuGroup::config() const { return state_->config; }
const GpuOptions& GpuGroup::options() const { return state_->options; }
bool GpuGroup::is_local(int rank) const {
  return rank >= 0 && rank < state_->config.num_ranks && state_->ranks[static_cast<std::size_t>(rank)].local;
}

std::int64_t GpuGroup::region_bytes(const GroupConfig& config) { return detail::region_offsets(config).total; }

namespace {

// The parts of creation both providers share: shape, per-rank local state, error word and
// layout scratch for the ranks this process drives. Regions and peer tables come after.
Status init_state(GpuGroup::State& s, const GroupConfig& config, const GpuOptions& options, int device,
                  bool loopback, int local_rank) {
  SY_RETURN_IF_ERROR(validate(config));
  s.config = config;
  s.options = options;
  s.loopback = loopback;
  s.device = device;
  SY_EP_CUDA(cudaSetDevice(device), "cudaSetDevice");
  int sms = 0;
  SY_EP_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "reading the SM count");
  SY_RETURN_IF_ERROR(check_options(config, options, sms));
  const int R = config.num_ranks;
  if (loopback) {
    if (R > options.hardware_queues) {
      return Status::InvalidArgument(
          "ep loopback group: config.num_ranks = " + std::to_string(R) + " ranks need as many hardware queues, " +
          "options.hardware_queues = " + std::to_string(options.hardware_queues) +
          " (raise CUDA_DEVICE_MAX_CONNECTIONS before CUDA starts and say so in options.hardware_queues)");
    }
    // Every rank's spinning kernel must be resident at once with an SM to spare for the rest.
    const int fit = std::max(1, (sms - 1) / R);
    s.blocks = options.num_sms > 0 ? options.num_sms : std::min(kDefaultBlocks, fit);
    if (s.blocks * R > sms - 1) {
      return Status::InvalidArgument("ep loopback group: options.num_sms = " + std::to_string(s.blocks) + " blocks x " +
                                     std::to_string(R) + " ranks do not fit the device's " + std::to_string(sms) +
                                     " SMs with one to spare; the ranks' kernels could not all be resident "
                                     "(use num_sms <= " + std::to_string(fit) + ")");
    }
  } else {
    s.blocks = options.num_sms > 0 ? options.num_sms : std::min(kDefaultBlocks, sms);
  }
  Shape& sh = s.shape;
  sh.R = R;
  sh.K = config.top_k;
  sh.L = config.experts_per_rank();
  sh.E = config.num_experts;
  sh.max_tokens = static_cast<int>(config.max_tokens);
  sh.tile_size = config.tile_size;
  sh.H = config.hidden;
  sh.scale_cols = static_cast<int>(config.scale_cols);
  sh.region = detail::region_offsets(config);
  sh.handle = detail::handle_offsets(config);
  SY_RETURN_IF_ERROR(preload_kernels());

  s.ranks.resize(static_cast<std::size_t>(R));
  const std::int64_t N = max_recv_rows(config);
  const int K = config.top_k, L = config.experts_per_rank();
  const std::int64_t P = max_expert_rows(config), tiles = max_tiles(N, K, L, config.tile_size);
  for (int r = 0; r < R; ++r) {
    if (!loopback && r != local_rank) continue;
    GpuGroup::State::Rank& rk = s.ranks[static_cast<std::size_t>(r)];
    rk.local = true;
    rk.ctx.rank = r;
    rk.ctx.timeout_ns = static_cast<unsigned long long>(config.timeout_seconds * 1e9);
    void* p = nullptr;
    SY_RETURN_IF_ERROR(s.alloc(sizeof(LocalState), &p));
    SY_EP_CUDA(cudaMemset(p, 0, sizeof(LocalState)), "cudaMemset");
    rk.ctx.local = static_cast<LocalState*>(p);
    SY_EP_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&rk.error_host), sizeof(ErrorWord), cudaHostAllocMapped),
               "cudaHostAlloc (mapped error word)");
    std::memset(rk.error_host, 0, sizeof(ErrorWord));
    SY_EP_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&rk.ctx.error), rk.error_host, 0),
               "cudaHostGetDevicePointer");

    // Expert-major scratch: one allocation carved into the layout's arrays.
    LayoutScratch& ls = rk.layout;
    const LayoutConfig lc = received_rows_layout(config);
    SY_RETURN_IF_ERROR(layout_workspace_size(lc, N, K, Device::cuda(device), &ls.workspace_bytes));
    const std::int64_t ints[] = {N * K, L, L + 1, P, P, N * K, tiles, tiles, kNumTotals};
    std::int64_t total_ints = 0;
    for (std::int64_t n : ints) total_ints += detail::align_up(n, 4);
    const std::size_t ws_at = static_cast<std::size_t>(total_ints) * 4;
    SY_RETURN_IF_ERROR(s.alloc(ws_at + ls.workspace_bytes, &p));
    int* at = static_cast<int*>(p);
    int** fields[] = {&ls.ids, &ls.counts, &ls.offsets, &ls.p2x, &ls.p2t, &ls.e2p, &ls.tile_expert, &ls.tile_row_end,
                      &ls.totals};
    for (int f = 0; f < 9; ++f) {
      *fields[f] = at;
      at += detail::align_up(ints[f], 4);
    }
    ls.workspace = ls.workspace_bytes ? static_cast<char*>(p) + ws_at : nullptr;
    const Device dev = Device::cuda(device);
    ls.view.counts = TensorView::of(ls.counts, DType::kInt32, {L}, dev);
    ls.view.offsets = TensorView::of(ls.offsets, DType::kInt32, {L + 1}, dev);
    ls.view.permuted_to_expanded = TensorView::of(ls.p2x, DType::kInt32, {P}, dev);
    ls.view.permuted_to_token = TensorView::of(ls.p2t, DType::kInt32, {P}, dev);
    ls.view.expanded_to_permuted = TensorView::of(ls.e2p, DType::kInt32, {N, K}, dev);
    ls.view.tile_expert = TensorView::of(ls.tile_expert, DType::kInt32, {tiles}, dev);
    ls.view.tile_row_end = TensorView::of(ls.tile_row_end, DType::kInt32, {tiles}, dev);
    ls.view.totals = TensorView::of(ls.totals, DType::kInt32, {kNumTotals}, dev);
    // A first layout now loads its kernels (see preload_kernels).
    SY_EP_CUDA(cudaMemset(ls.ids, 0xff, static_cast<std::size_t>(N * K) * 4), "cudaMemset");
    SY_RETURN_IF_ERROR(layout(lc, TensorView::of(ls.ids, DType::kInt32, {N, K}, dev), ls.view, ls.workspace,
                              ls.workspace_bytes, nullptr));
  }
  SY_EP_CUDA(cudaDeviceSynchronize(), "creating the group");
  return Status::Ok();
}

}  // namespace

Status GpuGroup::create_loopback(const GroupConfig& config, const GpuOptions& options, int device,
                                 std::unique_ptr<GpuGroup>* group) {
  if (group == nullptr) return Status::InvalidArgument("ep loopback group: argument 'group' is null");
  auto s = std::make_unique<State>();
  SY_RETURN_IF_ERROR(init_state(*s, config, options, device, /*loopback=*/true, 0));
  const int R = config.num_ranks;
  std::vector<char*> regions(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    void* p = nullptr;
    SY_RETURN_IF_ERROR(s->alloc(static_cast<std::size_t>(s->shape.region.total), &p));
    SY_EP_CUDA(cudaMemset(p, 0, static_cast<std::size_t>(s->shape.region.total)), "cudaMemset (region)");
    regions[static_cast<std::size_t>(r)] = static_cast<char*>(p);
  }
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < R; ++q) s->ranks[static_cast<std::size_t>(r)].ctx.peers[q] = regions[static_cast<std::size_t>(q)];
  SY_EP_CUDA(cudaDeviceSynchronize(), "creating the group");
  group->reset(new GpuGroup(std::move(s)));
  return Status::Ok();
}

namespace {

// What each rank tells the others at creation.
struct PeerInfo {
  std::uint64_t magic;
  int rank, num_ranks, num_experts, top_k;
  std::int64_t max_tokens, hidden, scale_cols;
  int dtype, tile_size, partial_dtype, pad;
  cudaIpcMemHandle_t region;
};
constexpr std::uint64_t kPeerInfoMagic = 0x5357594445503031ull;  // "SWYDEP01"

}  // namespace

Status GpuGroup::create_ipc(const GroupConfig& config, const GpuOptions& options, int rank,
                            const AllGather& all_gather, std::unique_ptr<GpuGroup>* group) {
  if (group == nullptr) return Status::InvalidArgument("ep ipc group: argument 'group' is null");
  if (!all_gather) return Status::InvalidArgument("ep ipc group: argument 'all_gather' is empty");
  SY_RETURN_IF_ERROR(validate(config));
  SY_RETURN_IF_ERROR(detail::check_rank("ep ipc group", rank, config.num_ranks));
  int device = 0;
  SY_EP_CUDA(cudaGetDevice(&device), "cudaGetDevice");
  auto s = std::make_unique<State>();
  SY_RETURN_IF_ERROR(init_state(*s, config, options, device, /*loopback=*/false, rank));
  const int R = config.num_ranks;
  void* region = nullptr;
  SY_RETURN_IF_ERROR(s->alloc(static_cast<std::size_t>(s->shape.region.total), &region));
  SY_EP_CUDA(cudaMemset(region, 0, static_cast<std::size_t>(s->shape.region.total)), "cudaMemset (region)");
  SY_EP_CUDA(cudaDeviceSynchronize(), "zeroing the region");
  PeerInfo mine{};
  mine.magic = kPeerInfoMagic;
  mine.rank = rank;
  mine.num_ranks = R;
  mine.num_experts = config.num_experts;
  mine.top_k = config.top_k;
  mine.max_tokens = config.max_tokens;
  mine.hidden = config.hidden;
  mine.scale_cols = config.scale_cols;
  mine.dtype = static_cast<int>(config.dtype);
  mine.tile_size = config.tile_size;
  mine.partial_dtype = static_cast<int>(config.partial_dtype);
  SY_EP_CUDA(cudaIpcGetMemHandle(&mine.region, region), "cudaIpcGetMemHandle");
  std::vector<PeerInfo> all(static_cast<std::size_t>(R));
  SY_RETURN_IF_ERROR(all_gather(&mine, sizeof(PeerInfo), all.data()));
  // Every rank checks every rank's configuration against rank 0's, so all fail alike.
  for (int r = 0; r < R; ++r) {
    const PeerInfo& a = all[static_cast<std::size_t>(r)];
    const PeerInfo& z = all[0];
    auto mismatch = [&](const char* field) {
      return Status::InvalidArgument("ep ipc group (rank " + std::to_string(rank) + "): config." + field + " of rank " +
                                     std::to_string(r) + " differs from rank 0's; every rank must pass the same "
                                     "configuration");
    };
    if (a.magic != kPeerInfoMagic || a.rank != r) {
      return Status::InvalidArgument("ep ipc group (rank " + std::to_string(rank) + "): entry " + std::to_string(r) +
                                     " of the all-gather is not rank " + std::to_string(r) +
                                     "'s (all_gather must return the ranks' bytes in rank order)");
    }
    if (a.num_ranks != z.num_ranks) return mismatch("num_ranks");
    if (a.num_experts != z.num_experts) return mismatch("num_experts");
    if (a.top_k != z.top_k) return mismatch("top_k");
    if (a.max_tokens != z.max_tokens) return mismatch("max_tokens");
    if (a.hidden != z.hidden) return mismatch("hidden");
    if (a.scale_cols != z.scale_cols) return mismatch("scale_cols");
    if (a.dtype != z.dtype) return mismatch("dtype");
    if (a.tile_size != z.tile_size) return mismatch("tile_size");
    if (a.partial_dtype != z.partial_dtype) return mismatch("partial_dtype");
  }
  State::Rank& rk = s->ranks[static_cast<std::size_t>(rank)];
  for (int q = 0; q < R; ++q) {
    if (q == rank) {
      rk.ctx.peers[q] = static_cast<char*>(region);
      continue;
    }
    void* p = nullptr;
    SY_EP_CUDA(cudaIpcOpenMemHandle(&p, all[static_cast<std::size_t>(q)].region, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle (a peer's region)");
    s->opened.push_back(p);
    rk.ctx.peers[q] = static_cast<char*>(p);
  }
  group->reset(new GpuGroup(std::move(s)));
  return Status::Ok();
}

// ------------------------------------------------------------------------------------------------

Status GpuGroup::check(int rank) const {
  const State& s = *state_;
  SY_RETURN_IF_ERROR(detail::check_rank("ep check", rank, s.config.num_ranks));
  const State::Rank& rk = s.ranks[static_cast<std::size_t>(rank)];
  if (!rk.local) {
    return Status::InvalidArgument("ep check: rank " + std::to_string(rank) + " is not driven by this process");
  }
  const volatile ErrorWord* w = rk.error_host;
  const unsigned code = w->code;
  if (code == 0) return Status::Ok();
  std::atomic_thread_fence(std::memory_order_acquire);
  const unsigned step = w->step;
  const int peer = w->peer;
  const std::string who = "rank " + std::to_string(peer);
  const std::string secs = std::to_string(s.config.timeout_seconds);
  std::string what;
  switch (step) {
    case gpu::kStepDispatchSlots:
      what = "dispatch: waiting for " + who + " to release its receive slots: no answer within " + secs + " s";
      break;
    case gpu::kStepDispatchRows:
      what = "dispatch: waiting for " + who + "'s rows: none within " + secs + " s (did it call dispatch?)";
      break;
    case gpu::kStepDispatchArgs:
      what = "dispatch: " + who + " has bad arguments (its own call returned InvalidArgument naming them)";
      break;
    case gpu::kStepCombineSlots:
      what = "combine: waiting for " + who + " to release its partial slots: no answer within " + secs + " s";
      break;
    case gpu::kStepCombinePartials:
      what = "combine: waiting for " + who + "'s partials: none within " + secs + " s (did it call combine?)";
      break;
    case gpu::kStepCombineArgs:
      what = "combine: " + who + " has bad arguments (its own call returned InvalidArgument naming them)";
      break;
    case gpu::kStepCombineHandles:
      what = "combine: " + who + " passed the handle of another dispatch than this rank's";
      break;
    default:
      what = "unknown step " + std::to_string(step) + ", " + who;
  }
  return Status(static_cast<StatusCode>(code), "ep (rank " + std::to_string(rank) + ") " + what +
                                                   "; the group is broken, rebuild it");
}

namespace {

// Loopback ranks must not share a stream: a rank's kernel spinning on a peer would block the
// peer's kernels queued behind it.
Status check_stream(GpuGroup::State& s, int rank, Stream stream, const ArgChecker& check) {
  if (!s.loopback || s.config.num_ranks == 1) return Status::Ok();
  if (stream == nullptr) {
    return check.fail_arg("stream", "is the legacy default stream; each rank of a loopback group needs a stream of "
                                    "its own");
  }
  for (int r = 0; r < s.config.num_ranks; ++r) {
    const GpuGroup::State::Rank& o = s.ranks[static_cast<std::size_t>(r)];
    if (r != rank && o.used && o.last_stream == stream) {
      return check.fail_arg("stream", "is rank " + std::to_string(r) + "'s stream; each rank of a loopback group "
                                      "needs a stream of its own");
    }
  }
  return Status::Ok();
}

Status check_handle_memory(const GroupConfig& c, const ArgChecker& check, const TensorView& m, Device dev,
                           const char* name = "out.handle_memory") {
  const std::int64_t need = handle_bytes(c);
  if (m.absent()) return check.fail_arg(name, "is absent; a GPU dispatch needs handle_bytes(config) = " + std::to_string(need) + " bytes");
  if (m.device != dev) return check.fail_arg(name, "is not on the group's device");
  if (!m.is_contiguous() || static_cast<std::int64_t>(m.nbytes()) < need) {
    return check.fail_arg(name, "must be contiguous with at least handle_bytes(config) = " +
                                    std::to_string(need) + " bytes, has " + std::to_string(m.nbytes()));
  }
  if (m.data == nullptr || reinterpret_cast<std::uintptr_t>(m.data) % 16 != 0) {
    return check.fail_arg(name, "must be non-null and 16-byte aligned");
  }
  return Status::Ok();
}

}  // namespace

Status GpuGroup::dispatch(int rank, const DispatchInputs& in, const DispatchOutputs& out, Handle* handle, bool reuse,
                          Stream stream) {
  State& s = *state_;
  const GroupConfig& c = s.config;
  SY_RETURN_IF_ERROR(detail::check_rank("ep dispatch", rank, c.num_ranks));
  State::Rank& rk = s.ranks[static_cast<std::size_t>(rank)];
  if (!rk.local) return Status::InvalidArgument("ep dispatch: rank " + std::to_string(rank) + " is not driven by this process");
  SY_RETURN_IF_ERROR(check(rank));
  if (handle == nullptr) return Status::InvalidArgument("ep dispatch: argument 'handle' is null");
  const std::string op = "ep dispatch (rank " + std::to_string(rank) + ")";
  const ArgChecker checker(op.c_str());
  SY_RETURN_IF_ERROR(check_stream(s, rank, stream, checker));
  SY_EP_CUDA(cudaSetDevice(s.device), "cudaSetDevice");
  const Device dev = Device::cuda(s.device);
  Status own = detail::check_dispatch(c, checker, in, out, dev);
  if (own.ok()) own = check_handle_memory(c, checker, out.handle_memory, dev);
  const std::int64_t T = own.ok() ? in.x.shape[0] : 0;
  if (own.ok() && reuse) {
    if (!handle->valid() || handle->plan->group != &s || handle->plan->gpu.rank != rank) {
      own = checker.fail_arg("handle", "reuse asked for, but the handle is not from a dispatch of this rank of this group");
    } else if (handle->plan->gpu.memory != out.handle_memory.data) {
      own = checker.fail_arg("out.handle_memory", "must be the reused handle's memory");
    } else if (handle->plan->gpu.tokens != T) {
      own = checker.fail_arg("in.x", "has " + std::to_string(T) + " rows; the reused handle's dispatch had " +
                                         std::to_string(handle->plan->gpu.tokens));
    }
  }
  const bool bad = !own.ok();
  const bool expert_major = !bad && !out.expert_x.absent();
  rk.last_stream = stream;
  rk.used = true;
  ++rk.dispatches;
  const Shape& sh = s.shape;
  char* hmem = bad ? nullptr : static_cast<char*>(out.handle_memory.data);

  if (!bad && !reuse) {
    gpu::PlanParams p;
    p.s = sh;
    p.c = rk.ctx;
    p.topk_ids = in.topk_ids.data;
    p.ids64 = in.topk_ids.dtype == DType::kInt64;
    p.tokens = static_cast<int>(T);
    p.handle = hmem;
    SY_RETURN_IF_ERROR(launch(gpu::dispatch_plan_kernel, 1, 1024, p, stream, "dispatch_plan"));
  }
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(c.dtype));
  const int vec = bad ? 16
                      : row_vector_bytes({static_cast<std::uint64_t>(sh.region.row_bytes),
                                          reinterpret_cast<std::uint64_t>(in.x.data),
                                          static_cast<std::uint64_t>(in.x.strides[0] * elem),
                                          reinterpret_cast<std::uint64_t>(out.x.data),
                                          reinterpret_cast<std::uint64_t>(out.expert_x.data)});
  gpu::SendParams sp;
  sp.s = sh;
  sp.c = rk.ctx;
  sp.bad = bad;
  if (!bad) {
    sp.x = static_cast<const unsigned char*>(in.x.data);
    sp.x_row_bytes_stride = in.x.strides[0] * elem;
    sp.scales = c.scale_cols > 0 ? static_cast<const float*>(in.scales.data) : nullptr;
    sp.topk_ids = in.topk_ids.data;
    sp.ids64 = in.topk_ids.dtype == DType::kInt64;
    sp.topk_weights = static_cast<const float*>(in.topk_weights.data);
    sp.tokens = static_cast<int>(T);
    sp.handle = hmem;
  }
  SY_RETURN_IF_ERROR(with_row_vector(vec, [&](auto v) {
    return launch(gpu::dispatch_send_kernel<decltype(v)::value>, s.blocks, gpu::kThreads, sp, stream, "dispatch_send");
  }));

  gpu::ReceiveParams rp;
  rp.s = sh;
  rp.c = rk.ctx;
  rp.bad = bad;
  rp.expert_major = expert_major;
  rp.exact = !s.options.worst_case;
  if (!bad) {
    rp.src_rank = static_cast<int*>(out.src_rank.data);
    rp.src_token = static_cast<int*>(out.src_token.data);
    rp.topk_ids = static_cast<int*>(out.topk_ids.data);
    rp.topk_weights = static_cast<float*>(out.topk_weights.data);
    rp.stats = static_cast<long long*>(out.stats.data);
    rp.handle = hmem;
    rp.layout_ids = rk.layout.ids;
  }
  SY_RETURN_IF_ERROR(launch(gpu::dispatch_receive_kernel, s.blocks, gpu::kThreads, rp, stream, "dispatch_receive"));

  LayoutScratch& ls = rk.layout;
  if (expert_major) {
    const std::int64_t N = max_recv_rows(c);
    SY_RETURN_IF_ERROR(layout(received_rows_layout(c), TensorView::of(ls.ids, DType::kInt32, {N, c.top_k}, dev), ls.view, ls.workspace,
                              ls.workspace_bytes, stream));
  }

  gpu::CopyParams cp;
  cp.s = sh;
  cp.c = rk.ctx;
  cp.bad = bad;
  cp.expert_major = expert_major;
  if (!bad) {
    cp.out_x = static_cast<unsigned char*>(out.x.data);
    cp.out_scales = c.scale_cols > 0 ? static_cast<float*>(out.scales.data) : nullptr;
    cp.handle = hmem;
    cp.handle_w = hmem;
  }
  if (expert_major) {
    cp.scratch_counts = ls.counts;
    cp.scratch_offsets = ls.offsets;
    cp.scratch_p2x = ls.p2x;
    cp.scratch_p2t = ls.p2t;
    cp.scratch_e2p = ls.e2p;
    cp.scratch_tile_expert = ls.tile_expert;
    cp.scratch_tile_row_end = ls.tile_row_end;
    cp.scratch_totals = ls.totals;
    const Layout& l = out.layout;
    cp.counts = static_cast<int*>(l.counts.data);
    cp.offsets = static_cast<int*>(l.offsets.data);
    cp.p2x = static_cast<int*>(l.permuted_to_expanded.data);
    cp.p2t = static_cast<int*>(l.permuted_to_token.data);
    cp.e2p = static_cast<int*>(l.expanded_to_permuted.data);
    cp.tile_expert = static_cast<int*>(l.tile_expert.data);
    cp.tile_row_end = static_cast<int*>(l.tile_row_end.data);
    cp.totals = static_cast<int*>(l.totals.data);
    cp.expert_x = static_cast<unsigned char*>(out.expert_x.data);
    cp.expert_scales = c.scale_cols > 0 ? static_cast<float*>(out.expert_scales.data) : nullptr;
  }
  SY_RETURN_IF_ERROR(with_row_vector(vec, [&](auto v) {
    return launch(gpu::dispatch_copy_kernel<decltype(v)::value>, s.blocks, gpu::kThreads, cp, stream, "dispatch_copy");
  }));
  if (bad) return own;
  auto plan = std::make_shared<Handle::Plan>();
  plan->group = &s;
  plan->gpu.rank = rank;
  plan->gpu.memory = out.handle_memory.data;
  plan->gpu.tokens = T;
  plan->gpu.expert_major = expert_major;
  handle->plan = plan;
  return Status::Ok();
}

Status GpuGroup::adopt_handle(int rank, const TensorView& handle_memory, std::int64_t tokens, bool expert_major,
                              Handle* handle) const {
  const State& s = *state_;
  const GroupConfig& c = s.config;
  SY_RETURN_IF_ERROR(detail::check_rank("ep adopt_handle", rank, c.num_ranks));
  if (!s.ranks[static_cast<std::size_t>(rank)].local) {
    return Status::InvalidArgument("ep adopt_handle: rank " + std::to_string(rank) + " is not driven by this process");
  }
  if (handle == nullptr) return Status::InvalidArgument("ep adopt_handle: argument 'handle' is null");
  const ArgChecker checker("ep adopt_handle");
  SY_RETURN_IF_ERROR(check_handle_memory(c, checker, handle_memory, Device::cuda(s.device), "handle_memory"));
  if (tokens < 0 || tokens > c.max_tokens) {
    return checker.fail_arg("tokens", std::to_string(tokens) + " is outside [0, max_tokens = " +
                                          std::to_string(c.max_tokens) + "]");
  }
  auto plan = std::make_shared<Handle::Plan>();
  plan->group = &s;
  plan->gpu.rank = rank;
  plan->gpu.memory = handle_memory.data;
  plan->gpu.tokens = tokens;
  plan->gpu.expert_major = expert_major;
  handle->plan = plan;
  return Status::Ok();
}

Status GpuGroup::received_rows(int rank, std::int64_t* rows) {
  State& s = *state_;
  SY_RETURN_IF_ERROR(detail::check_rank("ep received_rows", rank, s.config.num_ranks));
  State::Rank& rk = s.ranks[static_cast<std::size_t>(rank)];
  if (!rk.local) return Status::InvalidArgument("ep received_rows: rank " + std::to_string(rank) + " is not driven by this process");
  if (rows == nullptr) return Status::InvalidArgument("ep received_rows: argument 'rows' is null");
  if (s.options.worst_case) {
    return Status::InvalidArgument("ep received_rows: the group is in worst-case mode (options.worst_case); the count "
                                   "is stats[kRecvRows] on the device");
  }
  if (rk.dispatches == 0) return Status::InvalidArgument("ep received_rows: rank " + std::to_string(rank) + " has not dispatched");
  const auto start = std::chrono::steady_clock::now();
  const volatile unsigned long long* w = &rk.error_host->recv_rows;
  for (;;) {
    const unsigned long long v = *w;
    if ((v >> 32) == (rk.dispatches & 0xffffffffull)) {
      *rows = static_cast<std::int64_t>(v & 0xffffffffull);
      return Status::Ok();
    }
    SY_RETURN_IF_ERROR(check(rank));
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > s.config.timeout_seconds) {
      return Status::Timeout("ep received_rows (rank " + std::to_string(rank) + "): the count was not published within " +
                             std::to_string(s.config.timeout_seconds) + " s");
    }
    std::this_thread::yield();
  }
}

Status GpuGroup::combine(int rank, const Handle& handle, const CombineInputs& in, const TensorView& out, bool accumulate,
                         Stream stream) {
  State& s = *state_;
  const GroupConfig& c = s.config;
  SY_RETURN_IF_ERROR(detail::check_rank("ep combine", rank, c.num_ranks));
  State::Rank& rk = s.ranks[static_cast<std::size_t>(rank)];
  if (!rk.local) return Status::InvalidArgument("ep combine: rank " + std::to_string(rank) + " is not driven by this process");
  SY_RETURN_IF_ERROR(check(rank));
  const std::string op = "ep combine (rank " + std::to_string(rank) + ")";
  const ArgChecker checker(op.c_str());
  SY_RETURN_IF_ERROR(check_stream(s, rank, stream, checker));
  SY_EP_CUDA(cudaSetDevice(s.device), "cudaSetDevice");
  const Device dev = Device::cuda(s.device);
  const std::int64_t H = c.hidden;
  Status own = Status::Ok();
  if (!handle.valid() || handle.plan->group != &s || handle.plan->gpu.rank != rank) {
    own = checker.fail_arg("handle", "is not from a dispatch of this rank of this group");
  } else if (in.expert_major && !handle.plan->gpu.expert_major) {
    own = checker.fail_arg("in.expert_major", "set, but the handle's dispatch wrote no expert-major output");
  } else {
    const std::int64_t rows = in.expert_major ? max_expert_rows(c) : max_recv_rows(c);
    own = checker.tensor(in.y, "in.y", {DType::kBFloat16, DType::kFloat16, DType::kFloat32}, {rows, H}, dev,
                         Contiguity::kRowStrided);
    if (own.ok()) {
      own = checker.tensor(out, "out", {DType::kBFloat16, DType::kFloat16, DType::kFloat32},
                           {handle.plan->gpu.tokens, H}, dev);
    }
    if (own.ok() && in.pick_values.data != nullptr) {
      own = checker.tensor(in.pick_values, "in.pick_values", {DType::kFloat32}, {max_recv_rows(c), c.top_k}, dev);
    }
    if (own.ok() && in.pick_values_out.data != nullptr) {
      own = checker.tensor(in.pick_values_out, "in.pick_values_out", {DType::kFloat32},
                           {handle.plan->gpu.tokens, c.top_k}, dev);
    }
  }
  const bool bad = !own.ok();
  rk.last_stream = stream;
  rk.used = true;
  const Shape& sh = s.shape;
  const char* hmem = bad ? nullptr : static_cast<const char*>(handle.plan->gpu.memory);
  // 8 columns a lane when every row start is aligned to 8 elements of its dtype.
  const bool vec8 = !bad && H % 8 == 0 &&
                    reinterpret_cast<std::uintptr_t>(in.y.data) % (8 * dtype_size(in.y.dtype)) == 0 &&
                    in.y.strides[0] % 8 == 0 &&
                    reinterpret_cast<std::uintptr_t>(out.data) % (8 * dtype_size(out.dtype)) == 0;

  gpu::CombineSendParams sp;
  sp.s = sh;
  sp.c = rk.ctx;
  sp.bad = bad;
  sp.expert_major = in.expert_major;
  sp.weighted = in.weighted;
  if (!bad) {
    sp.y = in.y.data;
    sp.y_row_stride = in.y.strides[0];
    sp.pick_values = static_cast<const float*>(in.pick_values.data);
    sp.handle = hmem;
  }
  const DType y_dtype = bad ? DType::kFloat32 : in.y.dtype;
  const DType out_dtype = bad ? DType::kFloat32 : out.dtype;
  // The partial format and the vector width as template arguments of `kernel_for`'s kernel.
  auto launch_typed = [&](auto kernel_for, const auto& params, const char* name) {
    return with_partial_format(c.partial_dtype, [&](auto pf) {
      return vec8 ? launch(kernel_for(pf, std::integral_constant<int, 8>{}), s.blocks, gpu::kThreads, params, stream, name)
                  : launch(kernel_for(pf, std::integral_constant<int, 1>{}), s.blocks, gpu::kThreads, params, stream, name);
    });
  };
  SY_RETURN_IF_ERROR(with_format(y_dtype, [&](auto yf) {
    using YF = decltype(yf);
    return launch_typed([](auto pf, auto vec) { return gpu::combine_send_kernel<YF, decltype(pf), decltype(vec)::value>; },
                        sp, "combine_send");
  }));

  gpu::CombineReceiveParams rp;
  rp.s = sh;
  rp.c = rk.ctx;
  rp.bad = bad;
  rp.accumulate = accumulate;
  if (!bad) {
    rp.tokens = static_cast<int>(handle.plan->gpu.tokens);
    rp.handle = hmem;
    rp.out = out.data;
    rp.pick_values_out = static_cast<float*>(in.pick_values_out.data);
  }
  SY_RETURN_IF_ERROR(with_format(out_dtype, [&](auto of) {
    using OF = decltype(of);
    return launch_typed([](auto pf, auto vec) { return gpu::combine_receive_kernel<decltype(pf), OF, decltype(vec)::value>; },
                        rp, "combine_receive");
  }));
  return own;
}

}  // namespace switchyard::ep
