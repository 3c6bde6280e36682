// The CUDA IPC provider of GpuGroup across processes (docs/design.md section 6, tier 2): two
// processes on one GPU form a group through GpuGroup::create_ipc, the region handles exchanged
// by an all-gather relayed through the parent over sockets, and run an expert-major dispatch and
// a combine twice; each compares its outputs with CpuGroup's for the same inputs (every rank's
// inputs are drawn from one seed, so each process can run the whole CPU group). Processes
// time-slice on one GPU, so this checks the bootstrap and the cross-process mapping, not speed.
// The parent makes no CUDA call (children forked after CUDA starts could not use it).
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../common/cuda_unavailable.h"
#include "switchyard/ep.h"
#include "switchyard/layout.h"

namespace {

namespace ep = switchyard::ep;
using switchyard::Device;
using switchyard::DType;
using switchyard::Status;
using switchyard::TensorView;

constexpr int kRanks = 2;
constexpr int kSkip = 77;  // a child's exit code: no usable GPU

bool write_all(int fd, const void* p, std::size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

ep::GroupConfig config() {
  ep::GroupConfig c;
  c.num_ranks = kRanks;
  c.num_experts = 8;
  c.top_k = 3;
  c.max_tokens = 19;
  c.hidden = 48;
  c.dtype = DType::kBFloat16;
  c.tile_size = 4;
  c.timeout_seconds = 20.0;
  return c;
}

// One rank's buffers of one backend (host vectors; the GPU side copies them to the device).
struct Buffers {
  std::vector<std::uint16_t> x, ox, ex, y, out;
  std::vector<std::int32_t> ids, src_rank, src_token, oids, counts, offsets, p2x, p2t, e2p, tiles_e, tiles_end, totals;
  std::vector<float> w, ow;
  std::vector<std::int64_t> stats;
};

Buffers make_buffers(const ep::GroupConfig& c, int rank, std::uint64_t seed, int round) {
  std::mt19937_64 g(seed * 7919 + rank * 131 + round);
  const std::int64_t T = c.max_tokens - rank * 5, H = c.hidden, N = ep::max_recv_rows(c), P = ep::max_expert_rows(c);
  const int K = c.top_k, L = c.experts_per_rank();
  const std::int64_t tiles = switchyard::max_tiles(N, K, L, c.tile_size);
  Buffers b;
  b.x.resize(T * H);
  for (auto& v : b.x) v = static_cast<std::uint16_t>(g());
  b.ids.resize(T * K);
  b.w.resize(T * K);
  for (std::int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      b.ids[t * K + k] = (t % 5 == 2) ? -1 : static_cast<std::int32_t>((t * 3 + k * 2 + round + rank) % c.num_experts);
      b.w[t * K + k] = static_cast<float>(g() % 1000) / 500.0f;
    }
  b.ox.assign(N * H, 0xA5A5);
  b.src_rank.assign(N, -9);
  b.src_token.assign(N, -9);
  b.oids.assign(N * K, -9);
  b.ow.assign(N * K, -9.0f);
  b.stats.assign(ep::kNumStats, -9);
  b.counts.assign(L, -9);
  b.offsets.assign(L + 1, -9);
  b.p2x.assign(P, -9);
  b.p2t.assign(P, -9);
  b.e2p.assign(N * K, -9);
  b.tiles_e.assign(tiles, -9);
  b.tiles_end.assign(tiles, -9);
  b.totals.assign(switchyard::kNumTotals, -9);
  b.ex.assign(P * H, 0xA5A5);
  b.y.resize(P * H);
  for (auto& v : b.y) v = static_cast<std::uint16_t>(0x3c00 + g() % 0x300);  // bf16 in [1, 8)
  b.out.assign(T * H, 0xA5A5);
  return b;
}

// Views of a rank's buffers at `data(i)` (host pointers, or the device copies).
struct Views {
  ep::DispatchInputs in;
  ep::DispatchOutputs out;
  ep::CombineInputs cin;
  TensorView cout;
};

template <typename Ptr>
Views views(const ep::GroupConfig& c, const Buffers& b, Ptr ptr, Device dev) {
  const std::int64_t H = c.hidden, N = ep::max_recv_rows(c), P = ep::max_expert_rows(c);
  const int K = c.top_k, L = c.experts_per_rank();
  const std::int64_t T = static_cast<std::int64_t>(b.x.size()) / H;
  const std::int64_t tiles = switchyard::max_tiles(N, K, L, c.tile_size);
  Views v;
  v.in.x = TensorView::of(ptr(b.x), DType::kBFloat16, {T, H}, dev);
  v.in.topk_ids = TensorView::of(ptr(b.ids), DType::kInt32, {T, K}, dev);
  v.in.topk_weights = TensorView::of(ptr(b.w), DType::kFloat32, {T, K}, dev);
  v.out.x = TensorView::of(ptr(b.ox), DType::kBFloat16, {N, H}, dev);
  v.out.src_rank = TensorView::of(ptr(b.src_rank), DType::kInt32, {N}, dev);
  v.out.src_token = TensorView::of(ptr(b.src_token), DType::kInt32, {N}, dev);
  v.out.topk_ids = TensorView::of(ptr(b.oids), DType::kInt32, {N, K}, dev);
  v.out.topk_weights = TensorView::of(ptr(b.ow), DType::kFloat32, {N, K}, dev);
  v.out.stats = TensorView::of(ptr(b.stats), DType::kInt64, {ep::kNumStats}, dev);
  v.out.layout.counts = TensorView::of(ptr(b.counts), DType::kInt32, {L}, dev);
  v.out.layout.offsets = TensorView::of(ptr(b.offsets), DType::kInt32, {L + 1}, dev);
  v.out.layout.permuted_to_expanded = TensorView::of(ptr(b.p2x), DType::kInt32, {P}, dev);
  v.out.layout.permuted_to_token = TensorView::of(ptr(b.p2t), DType::kInt32, {P}, dev);
  v.out.layout.expanded_to_permuted = TensorView::of(ptr(b.e2p), DType::kInt32, {N, K}, dev);
  v.out.layout.tile_expert = TensorView::of(ptr(b.tiles_e), DType::kInt32, {tiles}, dev);
  v.out.layout.tile_row_end = TensorView::of(ptr(b.tiles_end), DType::kInt32, {tiles}, dev);
  v.out.layout.totals = TensorView::of(ptr(b.totals), DType::kInt32, {switchyard::kNumTotals}, dev);
  v.out.expert_x = TensorView::of(ptr(b.ex), DType::kBFloat16, {P, H}, dev);
  v.cin.expert_major = true;
  v.cin.y = TensorView::of(ptr(b.y), DType::kBFloat16, {P, H}, dev);
  v.cout = TensorView::of(ptr(b.out), DType::kBFloat16, {T, H}, dev);
  return v;
}

// Device copies of every buffer of a Buffers, in the same order as the fields.
struct DeviceCopy {
  std::vector<void*> ptrs;
  std::vector<const void*> hosts;
  std::vector<std::size_t> sizes;
  ~DeviceCopy() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <typename T>
  void* put(const std::vector<T>& v) {
    for (std::size_t i = 0; i < hosts.size(); ++i)
      if (hosts[i] == v.data()) return ptrs[i];
    void* d = nullptr;
    cudaMalloc(&d, v.size() * sizeof(T) + 16);
    cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
    ptrs.push_back(d);
    hosts.push_back(v.data());
    sizes.push_back(v.size() * sizeof(T));
    return d;
  }
  template <typename T>
  bool same_as(const std::vector<T>& want, const void* dev_ptr) const {
    std::vector<T> got(want.size());
    cudaMemcpy(got.data(), dev_ptr, want.size() * sizeof(T), cudaMemcpyDeviceToHost);
    return std::memcmp(got.data(), want.data(), want.size() * sizeof(T)) == 0;
  }
};

int run_child(int rank, int sock, std::uint64_t seed) {
  const std::string reason = sy_test::cuda_unavailable_reason();
  if (!reason.empty()) {
    // The same line as the gtest suites' skips (CTest's SKIP_REGULAR_EXPRESSION), once.
    if (rank == 0) std::printf("GPU test skipped: %s\n", reason.c_str());
    std::fflush(stdout);  // the child ends with _exit, which does not flush
    return kSkip;
  }
  cudaSetDevice(0);
  const ep::GroupConfig c = config();
  ep::AllGather all_gather = [&](const void* send, std::size_t bytes, void* recv) {
    const std::uint64_t len = bytes;
    if (!write_all(sock, &len, 8) || !write_all(sock, send, bytes) || !read_all(sock, recv, bytes * kRanks)) {
      return Status::Internal("test all-gather: the parent's socket closed");
    }
    return Status::Ok();
  };
  std::unique_ptr<ep::GpuGroup> gpu;
  Status st = ep::GpuGroup::create_ipc(c, ep::GpuOptions{}, rank, all_gather, &gpu);
  if (!st.ok()) {
    std::fprintf(stderr, "rank %d: create_ipc: %s\n", rank, st.to_string().c_str());
    return 1;
  }
  std::unique_ptr<ep::CpuGroup> cpu;
  ep::CpuGroup::create(c, &cpu);
  void* handle_memory = nullptr;
  cudaMalloc(&handle_memory, static_cast<std::size_t>(ep::handle_bytes(c)));
  int failures = 0;
  for (int round = 0; round < 2; ++round) {
    // The CPU group over every rank's inputs: this rank's expected outputs.
    std::vector<Buffers> want(kRanks);
    for (int r = 0; r < kRanks; ++r) want[r] = make_buffers(c, r, seed, round);
    std::vector<ep::Handle> handles(kRanks);
    st = ep::run_ranks(kRanks, [&](int r) {
      Views v = views(c, want[r], [](auto& vec) { return const_cast<void*>(static_cast<const void*>(vec.data())); },
                      Device::cpu());
      SY_RETURN_IF_ERROR(cpu->dispatch(r, v.in, v.out, &handles[r]));
      return cpu->combine(r, handles[r], v.cin, v.cout);
    });
    if (!st.ok()) {
      std::fprintf(stderr, "rank %d: cpu group: %s\n", rank, st.to_string().c_str());
      return 1;
    }
    // The GPU group, this rank only.
    Buffers mine = make_buffers(c, rank, seed, round);
    DeviceCopy d;
    Views v = views(c, mine, [&](auto& vec) { return d.put(vec); }, Device::cuda(0));
    v.out.handle_memory = TensorView::of(handle_memory, DType::kInt32, {ep::handle_bytes(c) / 4}, Device::cuda(0));
    ep::Handle h;
    st = gpu->dispatch(rank, v.in, v.out, &h);
    if (st.ok()) st = gpu->combine(rank, h, v.cin, v.cout);
    if (st.ok() && cudaDeviceSynchronize() != cudaSuccess) st = Status::Internal("cudaDeviceSynchronize failed");
    if (st.ok()) st = gpu->check(rank);
    if (!st.ok()) {
      std::fprintf(stderr, "rank %d round %d: gpu group: %s\n", rank, round, st.to_string().c_str());
      return 1;
    }
    const Buffers& w = want[rank];
    const struct {
      const char* name;
      bool ok;
    } checks[] = {
        {"x", d.same_as(w.ox, d.put(mine.ox))},
        {"src_rank", d.same_as(w.src_rank, d.put(mine.src_rank))},
        {"src_token", d.same_as(w.src_token, d.put(mine.src_token))},
        {"topk_ids", d.same_as(w.oids, d.put(mine.oids))},
        {"topk_weights", d.same_as(w.ow, d.put(mine.ow))},
        {"stats", d.same_as(w.stats, d.put(mine.stats))},
        {"layout.permuted_to_expanded", d.same_as(w.p2x, d.put(mine.p2x))},
        {"layout.expanded_to_permuted", d.same_as(w.e2p, d.put(mine.e2p))},
        {"expert_x", d.same_as(w.ex, d.put(mine.ex))},
        {"combine out", d.same_as(w.out, d.put(mine.out))},
    };
    for (const auto& ch : checks) {
      if (!ch.ok) {
        std::fprintf(stderr, "rank %d round %d: %s differs from CpuGroup's\n", rank, round, ch.name);
        ++failures;
      }
    }
  }
  cudaFree(handle_memory);
  gpu.reset();
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  const std::uint64_t seed = std::random_device{}();
  std::printf("ep ipc test: 2 processes, seed %llu\n", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  int socks[kRanks][2];
  pid_t pids[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, socks[r]) != 0) return 1;
    pids[r] = fork();
    if (pids[r] < 0) return 1;
    if (pids[r] == 0) {
      close(socks[r][0]);
      _exit(run_child(r, socks[r][1], seed));
    }
    close(socks[r][1]);
  }
  // Relay all-gathers until the children close their sockets.
  for (;;) {
    std::vector<char> gathered;
    std::uint64_t len = 0;
    bool open = true;
    for (int r = 0; r < kRanks && open; ++r) {
      std::uint64_t l = 0;
      open = read_all(socks[r][0], &l, 8);
      if (!open) break;
      std::vector<char> part(l);
      open = read_all(socks[r][0], part.data(), l);
      len = l;
      gathered.insert(gathered.end(), part.begin(), part.end());
    }
    if (!open || gathered.size() != len * kRanks) break;
    for (int r = 0; r < kRanks; ++r) write_all(socks[r][0], gathered.data(), gathered.size());
  }
  int failed = 0, skipped = 0;
  for (int r = 0; r < kRanks; ++r) {
    close(socks[r][0]);
    int status = 0;
    waitpid(pids[r], &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (code == kSkip) ++skipped;
    else if (code != 0) ++failed;
  }
  if (skipped > 0) return 0;  // rank 0 printed "GPU test skipped: <reason>"
  std::printf(failed ? "ep ipc test FAILED\n" : "ep ipc test passed: both ranks equal CpuGroup\n");
  return failed ? 1 : 0;
}
