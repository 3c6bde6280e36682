// Mirror (fuzz_cuda.h): device copies through the CUDA runtime; a stub where the CUDA backend is
// not built.
#include "fuzz/fuzz_cuda.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(SWITCHYARD_WITH_CUDA)
#include <cuda_runtime.h>

#include "common/cuda_unavailable.h"
#endif

namespace sy_fuzz {

bool& cuda_enabled() {
  static bool enabled = false;
  return enabled;
}


#if defined(SWITCHYARD_WITH_CUDA)

namespace {

// Bytes a view spans from its data pointer (0 for an absent or empty view).
std::size_t extent_bytes(const switchyard::TensorView& v) {
  if (v.absent() || v.ndim == 0) return 0;
  std::int64_t last = 0;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.shape[d] == 0) return 0;
    last += (v.shape[d] - 1) * v.strides[d];
  }
  return static_cast<std::size_t>(last + 1) * switchyard::dtype_size(v.dtype);
}

}  // namespace

struct Mirror::State {
  struct Output {
    const char* name;
    const void* host;
    void* device;
    std::size_t bytes;
  };
  std::vector<void*> allocations;
  std::vector<Output> outputs;
  std::string error;

  void* alloc(std::size_t bytes) {
    void* p = nullptr;
    if (cudaMalloc(&p, bytes + 64) != cudaSuccess) {
      error = "cudaMalloc failed";
      return nullptr;
    }
    allocations.push_back(p);
    return p;
  }
};

std::string cuda_unavailable() { return sy_test::cuda_unavailable_reason(); }

Mirror::Mirror() : state_(new State) {}
Mirror::~Mirror() {
  for (void* p : state_->allocations) cudaFree(p);
}

switchyard::TensorView Mirror::in(const switchyard::TensorView& host) {
  if (host.absent()) return host;
  switchyard::TensorView v = host;
  const std::size_t bytes = extent_bytes(host);
  v.data = state_->alloc(bytes);
  v.device = switchyard::Device::cuda(0);
  if (v.data != nullptr && bytes > 0 && cudaMemcpy(v.data, host.data, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
    state_->error = "cudaMemcpy of an input failed";
  return v;
}

switchyard::Layout Mirror::in(const switchyard::Layout& host) {
  switchyard::Layout l;
  l.counts = in(host.counts);
  l.offsets = in(host.offsets);
  l.permuted_to_expanded = in(host.permuted_to_expanded);
  l.permuted_to_token = in(host.permuted_to_token);
  l.expanded_to_permuted = in(host.expanded_to_permuted);
  l.tile_expert = in(host.tile_expert);
  l.tile_row_end = in(host.tile_row_end);
  l.totals = in(host.totals);
  return l;
}

switchyard::TensorView Mirror::out(const switchyard::TensorView& host, const char* name, const void* initial) {
  if (host.absent()) return host;
  switchyard::TensorView v = host;
  const std::size_t bytes = extent_bytes(host);
  v.data = state_->alloc(bytes);
  v.device = switchyard::Device::cuda(0);
  if (v.data != nullptr) {
    cudaMemset(v.data, 0xA5, bytes + 64);
    if (initial != nullptr && bytes > 0 && cudaMemcpy(v.data, initial, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      state_->error = "cudaMemcpy of an initial output failed";
    state_->outputs.push_back({name, host.data, v.data, bytes});
  }
  return v;
}

switchyard::Layout Mirror::out(const switchyard::Layout& host) {
  switchyard::Layout l;
  l.counts = out(host.counts, "counts");
  l.offsets = out(host.offsets, "offsets");
  l.permuted_to_expanded = out(host.permuted_to_expanded, "permuted_to_expanded");
  l.permuted_to_token = out(host.permuted_to_token, "permuted_to_token");
  l.expanded_to_permuted = out(host.expanded_to_permuted, "expanded_to_permuted");
  l.tile_expert = out(host.tile_expert, "tile_expert");
  l.tile_row_end = out(host.tile_row_end, "tile_row_end");
  l.totals = out(host.totals, "totals");
  return l;
}

void* Mirror::scratch(std::size_t bytes) { return bytes ? state_->alloc(bytes) : nullptr; }

std::string Mirror::check() {
  if (!state_->error.empty()) return state_->error;
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) return std::string("CUDA: ") + cudaGetErrorString(err);
  std::vector<unsigned char> got;
  for (const State::Output& o : state_->outputs) {
    got.resize(o.bytes + 64);
    if (cudaMemcpy(got.data(), o.device, o.bytes + 64, cudaMemcpyDeviceToHost) != cudaSuccess)
      return "cudaMemcpy of an output failed";
    if (std::memcmp(got.data(), o.host, o.bytes) != 0) {
      std::size_t i = 0;
      while (got[i] == static_cast<const unsigned char*>(o.host)[i]) ++i;
      return std::string("GPU differs from CPU: ") + o.name + ", byte " + std::to_string(i);
    }
    for (std::size_t i = o.bytes; i < o.bytes + 64; ++i) {
      if (got[i] != 0xA5) return std::string("GPU wrote past ") + o.name;
    }
  }
  return "";
}

std::string ep_loopback_differs(const switchyard::ep::GroupConfig& config, const std::vector<EpRankViews>& ranks) {
  namespace ep = switchyard::ep;
  std::unique_ptr<ep::GpuGroup> group;
  const switchyard::Status created = ep::GpuGroup::create_loopback(config, ep::GpuOptions(), 0, &group);
  // The target's groups (R <= 3, tiny rows) fit any GPU that runs the CUDA backend: a refusal is
  // a failure, not a skip, so that the differential cannot pass without running.
  if (!created.ok()) return "ep loopback: " + created.to_string();
  const int R = config.num_ranks;
  std::vector<std::unique_ptr<Mirror>> mirrors;
  std::vector<cudaStream_t> streams(static_cast<std::size_t>(R), nullptr);
  std::vector<ep::Handle> handles(static_cast<std::size_t>(R));
  std::vector<switchyard::TensorView> expert_x(static_cast<std::size_t>(R));
  std::string error;
  auto out = [](Mirror& m, const switchyard::TensorView& host, const switchyard::TensorView& initial,
                const char* name) { return m.out(host, name, initial.data); };
  for (int r = 0; r < R && error.empty(); ++r) {
    const EpRankViews& v = ranks[static_cast<std::size_t>(r)];
    mirrors.push_back(std::make_unique<Mirror>());
    Mirror& m = *mirrors.back();
    cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(r)], cudaStreamNonBlocking);
    ep::DispatchInputs in;
    in.x = m.in(v.in.x);
    in.topk_ids = m.in(v.in.topk_ids);
    in.topk_weights = m.in(v.in.topk_weights);
    ep::DispatchOutputs o;
    o.x = out(m, v.out.x, v.initial.x, "x");
    o.src_rank = out(m, v.out.src_rank, v.initial.src_rank, "src_rank");
    o.src_token = out(m, v.out.src_token, v.initial.src_token, "src_token");
    o.topk_ids = out(m, v.out.topk_ids, v.initial.topk_ids, "topk_ids");
    o.topk_weights = out(m, v.out.topk_weights, v.initial.topk_weights, "topk_weights");
    o.stats = out(m, v.out.stats, v.initial.stats, "stats");
    const switchyard::Layout& l = v.out.layout;
    const switchyard::Layout& li = v.initial.layout;
    o.layout.counts = out(m, l.counts, li.counts, "layout.counts");
    o.layout.offsets = out(m, l.offsets, li.offsets, "layout.offsets");
    o.layout.permuted_to_expanded = out(m, l.permuted_to_expanded, li.permuted_to_expanded, "layout.permuted_to_expanded");
    o.layout.permuted_to_token = out(m, l.permuted_to_token, li.permuted_to_token, "layout.permuted_to_token");
    o.layout.expanded_to_permuted = out(m, l.expanded_to_permuted, li.expanded_to_permuted, "layout.expanded_to_permuted");
    o.layout.tile_expert = out(m, l.tile_expert, li.tile_expert, "layout.tile_expert");
    o.layout.tile_row_end = out(m, l.tile_row_end, li.tile_row_end, "layout.tile_row_end");
    o.layout.totals = out(m, l.totals, li.totals, "layout.totals");
    o.expert_x = out(m, v.out.expert_x, v.initial.expert_x, "expert_x");
    const std::int64_t handle_bytes = ep::handle_bytes(config);
    o.handle_memory = switchyard::TensorView::of(m.scratch(static_cast<std::size_t>(handle_bytes)),
                                                 switchyard::DType::kInt32, {handle_bytes / 4},
                                                 switchyard::Device::cuda(0));
    expert_x[static_cast<std::size_t>(r)] = o.expert_x;
    const switchyard::Status s = group->dispatch(r, in, o, &handles[static_cast<std::size_t>(r)], false,
                                                 streams[static_cast<std::size_t>(r)]);
    if (!s.ok()) error = "ep loopback dispatch (rank " + std::to_string(r) + "): " + s.to_string();
  }
  for (int r = 0; r < R && error.empty(); ++r) {
    const EpRankViews& v = ranks[static_cast<std::size_t>(r)];
    ep::CombineInputs ci;
    ci.y = expert_x[static_cast<std::size_t>(r)];
    const switchyard::Status s =
        group->combine(r, handles[static_cast<std::size_t>(r)], ci,
                       out(*mirrors[static_cast<std::size_t>(r)], v.combined, v.combined_initial, "combine out"),
                       false, streams[static_cast<std::size_t>(r)]);
    if (!s.ok()) error = "ep loopback combine (rank " + std::to_string(r) + "): " + s.to_string();
  }
  for (int r = 0; r < R; ++r) {
    cudaStream_t& stream = streams[static_cast<std::size_t>(r)];
    if (stream == nullptr) continue;
    cudaStreamSynchronize(stream);
    const switchyard::Status s = group->check(r);
    if (error.empty() && !s.ok()) error = "ep loopback (rank " + std::to_string(r) + "): " + s.to_string();
    if (error.empty()) {
      const std::string diff = mirrors[static_cast<std::size_t>(r)]->check();
      if (!diff.empty()) error = "ep loopback, rank " + std::to_string(r) + ": " + diff;
    }
    cudaStreamDestroy(stream);
  }
  return error;
}

#else

struct Mirror::State {};
std::string cuda_unavailable() { return "this build has no CUDA backend"; }
Mirror::Mirror() : state_(new State) {}
Mirror::~Mirror() = default;
switchyard::TensorView Mirror::in(const switchyard::TensorView& host) { return host; }
switchyard::Layout Mirror::in(const switchyard::Layout& host) { return host; }
switchyard::TensorView Mirror::out(const switchyard::TensorView& host, const char*, const void*) { return host; }
switchyard::Layout Mirror::out(const switchyard::Layout& host) { return host; }
void* Mirror::scratch(std::size_t) { return nullptr; }
std::string Mirror::check() { return cuda_unavailable(); }
std::string ep_loopback_differs(const switchyard::ep::GroupConfig&, const std::vector<EpRankViews>&) {
  return cuda_unavailable();
}

#endif

}  // namespace sy_fuzz
