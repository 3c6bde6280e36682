// Expert parallelism on the GPU (ep.h, docs/design.md section 6): the loopback GpuGroup (R ranks
// on one GPU, each on its own stream) against CpuGroup, whose own tests check it against a
// brute-force reference. Every output buffer, on both sides, starts filled with the same poison
// byte and carries guard rows past its stated size; after each call the whole device buffer must
// equal the CPU's byte for byte: rows, order, ids, weights, layout arrays, stats, combined sums,
// and the poison wherever nothing may be written. Seeds: fresh each run, SY_TEST_SEED=<n>
// replays one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "common/cuda_test_util.h"
#include "common/ep_test_config.h"
#include "common/float_formats.h"
#include "common/test_data.h"
#include "switchyard/ep.h"
#include "switchyard/layout.h"
#include "switchyard/permute.h"

namespace {

namespace ep = switchyard::ep;
using switchyard::Device;
using switchyard::DType;
using switchyard::Layout;
using switchyard::Status;
using switchyard::StatusCode;
using switchyard::TensorView;
using sy_test::DeviceBuffer;
using sy_test::kPoisonByte;

constexpr std::int64_t kGuard = 3;  // rows past each output's stated size that must keep their poison

std::size_t esize(DType d) { return switchyard::dtype_size(d); }

enum class Routing { kUniform, kOneRank, kDrops, kWithReplacement };

struct Case {
  int R = 2, L = 2, K = 2;
  std::int64_t max_tokens = 8, H = 16;
  DType dtype = DType::kBFloat16;
  std::int64_t scale_cols = 0;
  int M = 1;
  bool expert_major = false;
  bool ids64 = false;
  std::int64_t x_stride_extra = 0;
  Routing routing = Routing::kUniform;
  DType y_dtype = DType::kBFloat16, out_dtype = DType::kBFloat16;
  bool accumulate = false;
  std::int64_t y_stride_extra = 0;
  DType partial = DType::kFloat32;
  std::vector<std::int64_t> T;  // tokens per rank; empty: random with 0 and max_tokens forced
  bool finite_x = false;        // x holds finite values (else random bytes, NaN patterns included)
  bool training = false;        // combine unweighted, with pick values (rank 0 passes none)
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "R=" << c.R << " L=" << c.L << " K=" << c.K << " max_tokens=" << c.max_tokens << " H=" << c.H
     << " dtype=" << switchyard::dtype_name(c.dtype) << " scale_cols=" << c.scale_cols << " M=" << c.M
     << " expert_major=" << c.expert_major << " ids64=" << c.ids64 << " routing=" << static_cast<int>(c.routing)
     << " y=" << switchyard::dtype_name(c.y_dtype) << " out=" << switchyard::dtype_name(c.out_dtype)
     << " accumulate=" << c.accumulate << " partial=" << switchyard::dtype_name(c.partial) << " training=" << c.training;
  return os.str();
}

ep::GroupConfig make_config(const Case& c, double timeout = 20.0) {
  ep::GroupConfig cfg = sy_test::ep_group_config(c, timeout);
  cfg.partial_dtype = c.partial;
  return cfg;
}

// A host buffer and its device twin of the same bytes.
struct Twin {
  std::vector<std::uint8_t> host;
  DeviceBuffer dev;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::int64_t row_stride = 0;  // elements; 0: contiguous

  Twin() = default;
  Twin(DType d, std::vector<std::int64_t> s, std::int64_t guard_rows = 0, std::int64_t stride = 0)
      : dtype(d), shape(std::move(s)), row_stride(stride) {
    std::int64_t rows = shape[0] + guard_rows, cols = shape.size() > 1 ? shape[1] : 1;
    if (stride > 0) cols = stride;
    host.assign(static_cast<std::size_t>(std::max<std::int64_t>(rows * cols, 1)) * esize(d), kPoisonByte);
    dev = DeviceBuffer(host.size());
  }
  void upload() { cudaMemcpy(dev.get(), host.data(), host.size(), cudaMemcpyHostToDevice); }
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> v(host.size());
    cudaMemcpy(v.data(), dev.get(), v.size(), cudaMemcpyDeviceToHost);
    return v;
  }
  void poison() {
    std::fill(host.begin(), host.end(), kPoisonByte);
    cudaMemset(dev.get(), kPoisonByte, host.size());
  }
  TensorView view(bool device) const {
    void* p = device ? dev.get() : const_cast<std::uint8_t*>(host.data());
    const Device where = device ? Device::cuda(0) : Device::cpu();
    TensorView v = shape.size() == 1 ? TensorView::of(p, dtype, {shape[0]}, where)
                                     : TensorView::of(p, dtype, {shape[0], shape[1]}, where);
    return row_stride > 0 ? v.with_row_stride(row_stride) : v;
  }
  template <typename T>
  T* as() {
    return reinterpret_cast<T*>(host.data());
  }
};

// Compares the device buffer with the host one byte for byte; names the first difference.
bool same(const std::string& what, const Twin& t) {
  const std::vector<std::uint8_t> got = t.download();
  if (got == t.host) return true;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != t.host[i]) {
      ADD_FAILURE() << what << ": first byte difference at " << i << " of " << got.size() << " (element "
                    << i / esize(t.dtype) << "): gpu 0x" << std::hex << int(got[i]) << ", cpu 0x" << int(t.host[i])
                    << (t.host[i] == kPoisonByte ? " (cpu left it untouched)" : "");
      return false;
    }
  }
  return false;
}

struct RankData {
  std::int64_t T = 0;
  Twin x, scales, ids, w;                      // inputs
  Twin ox, oscales, src_rank, src_token, oids, ow, stats;  // rank-major outputs
  Twin counts, offsets, p2x, p2t, e2p, tile_expert, tile_row_end, totals, ex, escales;  // expert-major
  DeviceBuffer handle_memory;
  ep::Handle cpu_handle, gpu_handle;
  Twin y, out;  // combine
  Twin values, values_out;  // combine's pick values [N,K] and what comes back [T,K]

  ep::DispatchInputs in(const ep::GroupConfig& c, bool dev) const {
    ep::DispatchInputs v;
    v.x = x.view(dev);
    v.x.shape[0] = T;
    if (c.scale_cols > 0) {
      v.scales = scales.view(dev);
      v.scales.shape[0] = T;
    }
    v.topk_ids = ids.view(dev);
    v.topk_ids.shape[0] = T;
    v.topk_weights = w.view(dev);
    v.topk_weights.shape[0] = T;
    return v;
  }
  ep::DispatchOutputs out_views(const ep::GroupConfig& c, bool em, bool dev) const {
    ep::DispatchOutputs o;
    o.x = ox.view(dev);
    if (c.scale_cols > 0) o.scales = oscales.view(dev);
    o.src_rank = src_rank.view(dev);
    o.src_token = src_token.view(dev);
    o.topk_ids = oids.view(dev);
    o.topk_weights = ow.view(dev);
    o.stats = stats.view(dev);
    if (em) {
      o.layout.counts = counts.view(dev);
      o.layout.offsets = offsets.view(dev);
      o.layout.permuted_to_expanded = p2x.view(dev);
      o.layout.permuted_to_token = p2t.view(dev);
      o.layout.expanded_to_permuted = e2p.view(dev);
      o.layout.tile_expert = tile_expert.view(dev);
      o.layout.tile_row_end = tile_row_end.view(dev);
      o.layout.totals = totals.view(dev);
      o.expert_x = ex.view(dev);
      if (c.scale_cols > 0) o.expert_scales = escales.view(dev);
    }
    if (dev) {
      o.handle_memory = TensorView::of(handle_memory.get(), DType::kInt32, {ep::handle_bytes(c) / 4}, Device::cuda(0));
    }
    return o;
  }
  std::vector<Twin*> outputs(bool em) {
    std::vector<Twin*> v = {&ox, &oscales, &src_rank, &src_token, &oids, &ow, &stats};
    if (em) v.insert(v.end(), {&counts, &offsets, &p2x, &p2t, &e2p, &tile_expert, &tile_row_end, &totals, &ex, &escales});
    return v;
  }
};

const char* kOutputNames[] = {"x", "scales", "src_rank", "src_token", "topk_ids", "topk_weights", "stats",
                              "layout.counts", "layout.offsets", "layout.permuted_to_expanded",
                              "layout.permuted_to_token", "layout.expanded_to_permuted", "layout.tile_expert",
                              "layout.tile_row_end", "layout.totals", "expert_x", "expert_scales"};

// R ranks' inputs, outputs and combine buffers for one case, with a CpuGroup and a loopback GpuGroup.
struct World {
  Case c;
  ep::GroupConfig cfg;
  std::unique_ptr<ep::CpuGroup> cpu;
  std::unique_ptr<ep::GpuGroup> gpu;
  std::vector<RankData> ranks;
  std::vector<cudaStream_t> streams;
  std::mt19937_64 g;

  World(const Case& cs, std::uint64_t seed, double timeout = 20.0, ep::GpuOptions opt = {}) : c(cs), g(seed) {
    cfg = make_config(c, timeout);
    Status st = ep::CpuGroup::create(cfg, &cpu);
    EXPECT_TRUE(st.ok()) << st.to_string();
    st = ep::GpuGroup::create_loopback(cfg, opt, 0, &gpu);
    EXPECT_TRUE(st.ok()) << st.to_string();
    const int R = c.R, K = c.K, L = c.L, M = c.M;
    const std::int64_t N = ep::max_recv_rows(cfg), P = ep::max_expert_rows(cfg);
    const std::int64_t tiles = switchyard::max_tiles(N, K, L, M), H = c.H, cols = c.scale_cols;
    ranks.resize(R);
    streams.resize(R);
    for (int r = 0; r < R; ++r) {
      cudaStreamCreateWithFlags(&streams[r], cudaStreamNonBlocking);
      RankData& d = ranks[r];
      const std::int64_t mt = c.max_tokens;
      d.x = Twin(c.dtype, {mt, H}, 0, H + c.x_stride_extra);
      d.scales = Twin(DType::kFloat32, {mt, std::max<std::int64_t>(cols, 1)});
      d.ids = Twin(c.ids64 ? DType::kInt64 : DType::kInt32, {mt, K});
      d.w = Twin(DType::kFloat32, {mt, K});
      d.ox = Twin(c.dtype, {N, H}, kGuard);
      d.oscales = Twin(DType::kFloat32, {N, std::max<std::int64_t>(cols, 1)}, kGuard);
      d.src_rank = Twin(DType::kInt32, {N}, kGuard);
      d.src_token = Twin(DType::kInt32, {N}, kGuard);
      d.oids = Twin(DType::kInt32, {N, K}, kGuard);
      d.ow = Twin(DType::kFloat32, {N, K}, kGuard);
      d.stats = Twin(DType::kInt64, {ep::kNumStats}, kGuard);
      d.counts = Twin(DType::kInt32, {L}, kGuard);
      d.offsets = Twin(DType::kInt32, {L + 1}, kGuard);
      d.p2x = Twin(DType::kInt32, {P}, kGuard);
      d.p2t = Twin(DType::kInt32, {P}, kGuard);
      d.e2p = Twin(DType::kInt32, {N, K}, kGuard);
      d.tile_expert = Twin(DType::kInt32, {tiles}, kGuard);
      d.tile_row_end = Twin(DType::kInt32, {tiles}, kGuard);
      d.totals = Twin(DType::kInt32, {switchyard::kNumTotals}, kGuard);
      d.ex = Twin(c.dtype, {P, H}, kGuard);
      d.escales = Twin(DType::kFloat32, {P, std::max<std::int64_t>(cols, 1)}, kGuard);
      d.handle_memory = DeviceBuffer(static_cast<std::size_t>(ep::handle_bytes(cfg)));
      const std::int64_t yrows = c.expert_major ? P : N;
      d.y = Twin(c.y_dtype, {yrows, H}, 0, H + c.y_stride_extra);
      d.out = Twin(c.out_dtype, {mt, H}, kGuard);
      d.values = Twin(DType::kFloat32, {N, K});
      d.values_out = Twin(DType::kFloat32, {mt, K}, kGuard);
    }
  }
  ~World() {
    for (cudaStream_t s : streams) cudaStreamDestroy(s);
  }

  // Fresh inputs on every rank (host and device).
  void fill_inputs() {
    const int R = c.R, K = c.K, L = c.L, E = R * L;
    const int hot = static_cast<int>(g() % R);
    for (int r = 0; r < R; ++r) {
      RankData& d = ranks[r];
      if (!c.T.empty()) {
        d.T = c.T[r];
      } else {
        d.T = r == R - 1 ? c.max_tokens : (r == 0 && R > 1) ? 0 : static_cast<std::int64_t>(g() % (c.max_tokens + 1));
      }
      if (c.finite_x && c.dtype == DType::kBFloat16) {
        // Finite values in [-8, 8): NaN payloads would differ between the CPU's and the GPU's
        // fma when x rows come back as expert outputs.
        auto* v = reinterpret_cast<std::uint16_t*>(d.x.host.data());
        for (std::size_t i = 0; i < d.x.host.size() / 2; ++i) v[i] = sy_test::bf16_bits(static_cast<float>(static_cast<std::int64_t>(g() % 4096) - 2048) / 256.0f);
      } else {
        for (std::uint8_t& b : d.x.host) b = static_cast<std::uint8_t>(g());
      }
      std::uniform_real_distribution<float> u(0.01f, 4.0f);
      for (std::size_t i = 0; i < d.scales.host.size() / 4; ++i) d.scales.as<float>()[i] = u(g);
      std::normal_distribution<float> n(0.0f, 1.0f);
      for (std::size_t i = 0; i < d.w.host.size() / 4; ++i) d.w.as<float>()[i] = n(g);
      for (std::int64_t t = 0; t < c.max_tokens; ++t) {
        std::set<int> used;
        for (int k = 0; k < K; ++k) {
          std::int64_t e;
          switch (c.routing) {
            case Routing::kOneRank:
              e = hot * L + static_cast<int>(g() % L);
              if (used.count(static_cast<int>(e))) e = static_cast<std::int64_t>(g() % E);
              break;
            case Routing::kWithReplacement:
              e = static_cast<std::int64_t>(g() % E);
              break;
            default:
              do e = static_cast<std::int64_t>(g() % E);
              while (used.count(static_cast<int>(e)) && static_cast<int>(used.size()) < E);
          }
          used.insert(static_cast<int>(e));
          const int drop_den = c.routing == Routing::kDrops ? 2 : 12;
          if (t % 7 == 3 || g() % drop_den == 0) e = g() % 3 == 0 ? (g() % 2 ? E + 5 : -7) : -1;
          if (c.ids64) {
            d.ids.as<std::int64_t>()[t * K + k] = e;
          } else {
            d.ids.as<std::int32_t>()[t * K + k] = static_cast<std::int32_t>(e);
          }
        }
      }
      d.x.upload();
      d.scales.upload();
      d.ids.upload();
      d.w.upload();
    }
  }

  void poison_outputs(bool em) {
    for (RankData& d : ranks)
      for (Twin* t : d.outputs(em)) t->poison();
  }

  // Dispatch on both groups; returns false on a failed call.
  bool dispatch(bool em, bool reuse = false) {
    Status st = ep::run_ranks(c.R, [&](int r) {
      return cpu->dispatch(r, ranks[r].in(cfg, false), ranks[r].out_views(cfg, em, false), &ranks[r].cpu_handle, reuse);
    });
    EXPECT_TRUE(st.ok()) << "cpu dispatch: " << st.to_string();
    for (int r = 0; r < c.R; ++r) {
      st = gpu->dispatch(r, ranks[r].in(cfg, true), ranks[r].out_views(cfg, em, true), &ranks[r].gpu_handle, reuse,
                         streams[r]);
      EXPECT_TRUE(st.ok()) << "gpu dispatch rank " << r << ": " << st.to_string();
      if (!st.ok()) return false;
    }
    return true;
  }

  bool sync_and_check() {
    bool ok = true;
    for (int r = 0; r < c.R; ++r) {
      const cudaError_t err = cudaStreamSynchronize(streams[r]);
      EXPECT_EQ(err, cudaSuccess) << cudaGetErrorString(err);
      const Status st = gpu->check(r);
      EXPECT_TRUE(st.ok()) << st.to_string();
      ok = ok && err == cudaSuccess && st.ok();
    }
    return ok;
  }

  void compare_dispatch(bool em) {
    std::int64_t recv = 0, sent = 0;
    for (int r = 0; r < c.R; ++r) {
      std::vector<Twin*> outs = ranks[r].outputs(em);
      for (std::size_t i = 0; i < outs.size(); ++i) {
        if (!same("rank " + std::to_string(r) + " " + kOutputNames[i], *outs[i])) break;
      }
      const auto* stats = reinterpret_cast<const std::int64_t*>(ranks[r].stats.host.data());
      recv += stats[ep::kRecvRows];
      sent += stats[ep::kSentRows];
    }
    EXPECT_EQ(recv, sent) << "rows received and sent over all ranks (no token lost or duplicated)";
  }

  void fill_combine_inputs() {
    for (RankData& d : ranks) {
      std::normal_distribution<float> n(0.0f, 2.0f);
      const std::int64_t elems = static_cast<std::int64_t>(d.y.host.size() / esize(c.y_dtype));
      for (std::int64_t i = 0; i < elems; ++i) store(c.y_dtype, d.y.host.data(), i, n(g));
      d.y.upload();
      const std::int64_t oelems = static_cast<std::int64_t>(d.out.host.size() / esize(c.out_dtype));
      if (c.accumulate) {
        for (std::int64_t i = 0; i < oelems; ++i) store(c.out_dtype, d.out.host.data(), i, n(g));
        d.out.upload();
      } else {
        d.out.poison();
      }
      for (std::size_t i = 0; i < d.values.host.size() / 4; ++i) d.values.as<float>()[i] = n(g);
      d.values.upload();
      d.values_out.poison();
    }
  }

  static void store(DType t, std::uint8_t* base, std::int64_t i, float v) {
    if (t == DType::kFloat32) {
      reinterpret_cast<float*>(base)[i] = v;
    } else if (t == DType::kBFloat16) {
      reinterpret_cast<std::uint16_t*>(base)[i] = sy_test::bf16_bits(v);
    } else {
      reinterpret_cast<std::uint16_t*>(base)[i] = sy_test::fp16_bits(v);
    }
  }

  ep::CombineInputs combine_in(int r, bool dev) const {
    ep::CombineInputs in;
    in.expert_major = c.expert_major;
    in.y = ranks[r].y.view(dev);
    if (c.training) {
      in.weighted = false;
      if (r != 0) in.pick_values = ranks[r].values.view(dev);
      in.pick_values_out = ranks[r].values_out.view(dev);
      in.pick_values_out.shape[0] = ranks[r].T;
    }
    return in;
  }
  TensorView out_view(int r, bool dev) const {
    TensorView v = ranks[r].out.view(dev);
    v.shape[0] = ranks[r].T;
    return v;
  }

  bool combine() {
    Status st = ep::run_ranks(c.R, [&](int r) {
      return cpu->combine(r, ranks[r].cpu_handle, combine_in(r, false), out_view(r, false), c.accumulate);
    });
    EXPECT_TRUE(st.ok()) << "cpu combine: " << st.to_string();
    for (int r = 0; r < c.R; ++r) {
      st = gpu->combine(r, ranks[r].gpu_handle, combine_in(r, true), out_view(r, true), c.accumulate, streams[r]);
      EXPECT_TRUE(st.ok()) << "gpu combine rank " << r << ": " << st.to_string();
      if (!st.ok()) return false;
    }
    return true;
  }

  void compare_combine() {
    for (int r = 0; r < c.R; ++r) {
      same("rank " + std::to_string(r) + " combine out", ranks[r].out);
      if (c.training) same("rank " + std::to_string(r) + " combine pick_values_out", ranks[r].values_out);
    }
  }

  // One full dispatch + combine round checked against the CPU group.
  void round() {
    fill_inputs();
    poison_outputs(c.expert_major);
    if (!dispatch(c.expert_major)) return;
    if (!sync_and_check()) return;
    compare_dispatch(c.expert_major);
    fill_combine_inputs();
    if (!combine()) return;
    if (!sync_and_check()) return;
    compare_combine();
  }
};

class EpCuda : public ::testing::Test {
 protected:
  void SetUp() override { SY_SKIP_WITHOUT_GPU(); }
};

std::vector<Case> sweep_cases() {
  std::vector<Case> v;
  for (int R : {1, 2, 3, 5, 8}) {
    Case a;  // bf16 rank-major, uneven token counts
    a.R = R;
    a.L = 3;
    a.K = std::min(4, R * 3);
    a.max_tokens = 37;
    a.H = 72;
    v.push_back(a);
    Case b = a;  // expert-major, tiles, fp32 combine input, int64 ids, strided rows
    b.expert_major = true;
    b.M = 4;
    b.ids64 = true;
    b.x_stride_extra = 8;
    b.y_dtype = DType::kFloat32;
    b.y_stride_extra = 3;
    b.out_dtype = DType::kFloat32;
    v.push_back(b);
    Case f = a;  // fp8 rows with per-group scales, expert-major, odd H, accumulate into fp16
    f.dtype = DType::kFloat8E4M3;
    f.H = 200;
    f.scale_cols = 2;
    f.expert_major = true;
    f.M = 3;
    f.out_dtype = DType::kFloat16;
    f.accumulate = true;
    f.routing = Routing::kDrops;
    v.push_back(f);
    Case o = a;  // all tokens to one rank, bf16 partials
    o.routing = Routing::kOneRank;
    o.expert_major = true;
    o.partial = DType::kBFloat16;
    o.K = std::min(8, R * 3);
    v.push_back(o);
    Case t = b;  // a training backward's combine: unweighted, pick values sent back
    t.training = true;
    t.y_dtype = DType::kBFloat16;
    v.push_back(t);
    Case tr = a;  // the same after a rank-major dispatch
    tr.training = true;
    v.push_back(tr);
  }
  Case z;  // zero tokens everywhere
  z.R = 3;
  z.T = {0, 0, 0};
  z.expert_major = true;
  v.push_back(z);
  Case w;  // ids drawn with replacement, single-token ranks, fp32 rows of odd width
  w.R = 5;
  w.L = 2;
  w.K = 6;
  w.dtype = DType::kFloat32;
  w.H = 13;
  w.T = {1, 0, 3, 1, 8};
  w.routing = Routing::kWithReplacement;
  w.expert_major = true;
  w.M = 5;
  w.y_dtype = DType::kFloat16;
  v.push_back(w);
  return v;
}

TEST_F(EpCuda, SweepMatchesCpuGroup) {
  for (const Case& c : sweep_cases()) {
    const std::uint64_t seed = sy_test::test_seed();
    SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
    World w(c, seed);
    if (!w.gpu) return;
    for (int round = 0; round < 2; ++round) w.round();
    if (HasFailure()) return;
  }
}

// One rank (R = 1: a group of one, whose waits are on its own earlier kernels), every form: also
// the subset compute-sanitizer runs, which serializes kernels and so cannot run two ranks.
TEST_F(EpCuda, OneRankMatchesCpuGroup) {
  for (const Case& c : sweep_cases()) {
    if (c.R != 1) continue;
    const std::uint64_t seed = sy_test::test_seed();
    SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
    World w(c, seed);
    if (!w.gpu) return;
    w.round();
    if (HasFailure()) return;
  }
}

TEST_F(EpCuda, LargeRowsMatchCpuGroup) {
  Case c;  // a DeepSeek-like row at small scale: H = 7168 bf16, E = 64, K = 8
  c.R = 8;
  c.L = 8;
  c.K = 8;
  c.max_tokens = 64;
  c.H = 7168;
  c.expert_major = true;
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  World w(c, seed);
  if (!w.gpu) return;
  w.round();
}

TEST_F(EpCuda, ReuseGivesTheSameOutputs) {
  const Case c = sy_test::ep_expert_major_case<Case>(3, 4, 3, 21, 40, 2);
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  World w(c, seed);
  if (!w.gpu) return;
  w.round();
  // Same routing, new rows and weights: dispatch with reuse of the handles.
  std::mt19937_64 g(seed + 1);
  for (RankData& d : w.ranks) {
    for (std::uint8_t& b : d.x.host) b = static_cast<std::uint8_t>(g());
    for (std::size_t i = 0; i < d.w.host.size() / 4; ++i) d.w.as<float>()[i] = static_cast<float>(g() % 1000) / 250.0f;
    d.x.upload();
    d.w.upload();
  }
  w.poison_outputs(true);
  ASSERT_TRUE(w.dispatch(true, /*reuse=*/true));
  ASSERT_TRUE(w.sync_and_check());
  w.compare_dispatch(true);
  w.fill_combine_inputs();
  ASSERT_TRUE(w.combine());
  ASSERT_TRUE(w.sync_and_check());
  w.compare_combine();
}

// A handle rebuilt from its dispatch's memory (adopt_handle: how the PyTorch ops carry it)
// combines as the dispatch's own; bad memory or token counts are refused, naming the argument.
TEST_F(EpCuda, AdoptedHandleCombinesTheSame) {
  const Case c = sy_test::ep_expert_major_case<Case>(3, 2, 4, 19, 24, 3);
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  World w(c, seed);
  if (!w.gpu) return;
  w.fill_inputs();
  w.poison_outputs(true);
  ASSERT_TRUE(w.dispatch(true));
  ASSERT_TRUE(w.sync_and_check());
  w.compare_dispatch(true);
  for (int r = 0; r < c.R; ++r) {
    RankData& d = w.ranks[r];
    const TensorView mem = TensorView::of(d.handle_memory.get(), DType::kInt32, {ep::handle_bytes(w.cfg) / 4}, Device::cuda(0));
    ep::Handle adopted;
    const Status st = w.gpu->adopt_handle(r, mem, d.T, true, &adopted);
    ASSERT_TRUE(st.ok()) << st.to_string();
    d.gpu_handle = adopted;
    ep::Handle bad;
    const Status big = w.gpu->adopt_handle(r, mem, c.max_tokens + 1, true, &bad);
    EXPECT_EQ(big.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(big.message().find("tokens"), std::string::npos) << big.message();
    TensorView small = mem;
    small.shape[0] = 16;
    EXPECT_NE(w.gpu->adopt_handle(r, small, d.T, true, &bad).message().find("handle_memory"), std::string::npos);
    EXPECT_FALSE(bad.valid());
  }
  w.fill_combine_inputs();
  ASSERT_TRUE(w.combine());
  ASSERT_TRUE(w.sync_and_check());
  w.compare_combine();
}

// 50 dispatch/combine pairs with no host synchronization between them: two input sets in turn,
// each pair's combine output in its own buffer, all checked at the end.
TEST_F(EpCuda, BackToBackWithoutHostSync) {
  Case c;
  c.R = 4;
  c.L = 2;
  c.K = 3;
  c.max_tokens = 33;
  c.H = 64;
  c.expert_major = true;
  c.T = {33, 17, 0, 33};
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  constexpr int kPairs = 50;
  World w(c, seed);
  if (!w.gpu) return;
  const int R = c.R;
  // Two input sets on the device; their CPU results.
  std::vector<std::vector<DeviceBuffer>> xs(2), ids(2), ws(2);
  std::vector<std::vector<std::vector<std::uint8_t>>> want(2);
  for (int set = 0; set < 2; ++set) {
    w.fill_inputs();
    w.poison_outputs(true);
    ASSERT_TRUE(w.dispatch(true));
    ASSERT_TRUE(w.sync_and_check());
    w.compare_dispatch(true);
    w.fill_combine_inputs();  // the same y for both sets: set 1 overwrites set 0's y below
    for (int r = 0; r < R; ++r) {
      xs[set].push_back(DeviceBuffer(w.ranks[r].x.host.size()));
      ids[set].push_back(DeviceBuffer(w.ranks[r].ids.host.size()));
      ws[set].push_back(DeviceBuffer(w.ranks[r].w.host.size()));
      cudaMemcpy(xs[set][r].get(), w.ranks[r].x.dev.get(), w.ranks[r].x.host.size(), cudaMemcpyDeviceToDevice);
      cudaMemcpy(ids[set][r].get(), w.ranks[r].ids.dev.get(), w.ranks[r].ids.host.size(), cudaMemcpyDeviceToDevice);
      cudaMemcpy(ws[set][r].get(), w.ranks[r].w.dev.get(), w.ranks[r].w.host.size(), cudaMemcpyDeviceToDevice);
    }
  }
  // y is the last set's; recompute both sets' CPU combine outputs with it.
  for (int set = 0; set < 2; ++set) {
    for (int r = 0; r < R; ++r) {
      cudaMemcpy(w.ranks[r].x.host.data(), xs[set][r].get(), w.ranks[r].x.host.size(), cudaMemcpyDeviceToHost);
      cudaMemcpy(w.ranks[r].ids.host.data(), ids[set][r].get(), w.ranks[r].ids.host.size(), cudaMemcpyDeviceToHost);
      cudaMemcpy(w.ranks[r].w.host.data(), ws[set][r].get(), w.ranks[r].w.host.size(), cudaMemcpyDeviceToHost);
    }
    Status st = ep::run_ranks(R, [&](int r) {
      return w.cpu->dispatch(r, w.ranks[r].in(w.cfg, false), w.ranks[r].out_views(w.cfg, true, false),
                             &w.ranks[r].cpu_handle);
    });
    ASSERT_TRUE(st.ok()) << st.to_string();
    st = ep::run_ranks(R, [&](int r) {
      return w.cpu->combine(r, w.ranks[r].cpu_handle, w.combine_in(r, false), w.out_view(r, false));
    });
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int r = 0; r < R; ++r) want[set].push_back(w.ranks[r].out.host);
  }
  // The 50 pairs: rank r's inputs of pair i point at set i % 2; outputs per pair.
  std::vector<std::vector<DeviceBuffer>> outs(kPairs);
  for (int i = 0; i < kPairs; ++i) {
    for (int r = 0; r < R; ++r) {
      RankData& d = w.ranks[r];
      outs[i].push_back(DeviceBuffer(d.out.host.size()));
      cudaMemset(outs[i][r].get(), kPoisonByte, d.out.host.size());
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int i = 0; i < kPairs; ++i) {
    const int set = i % 2;
    for (int r = 0; r < R; ++r) {
      RankData& d = w.ranks[r];
      ep::DispatchInputs in = d.in(w.cfg, true);
      in.x.data = xs[set][r].get();
      in.topk_ids.data = ids[set][r].get();
      in.topk_weights.data = ws[set][r].get();
      Status st = w.gpu->dispatch(r, in, d.out_views(w.cfg, true, true), &d.gpu_handle, false, w.streams[r]);
      ASSERT_TRUE(st.ok()) << "pair " << i << " rank " << r << ": " << st.to_string();
    }
    for (int r = 0; r < R; ++r) {
      RankData& d = w.ranks[r];
      TensorView out = w.out_view(r, true);
      out.data = outs[i][r].get();
      Status st = w.gpu->combine(r, d.gpu_handle, w.combine_in(r, true), out, false, w.streams[r]);
      ASSERT_TRUE(st.ok()) << "pair " << i << " rank " << r << ": " << st.to_string();
    }
  }
  ASSERT_TRUE(w.sync_and_check());
  for (int i = 0; i < kPairs; ++i) {
    for (int r = 0; r < R; ++r) {
      std::vector<std::uint8_t> got(w.ranks[r].out.host.size());
      cudaMemcpy(got.data(), outs[i][r].get(), got.size(), cudaMemcpyDeviceToHost);
      ASSERT_TRUE(got == want[i % 2][r]) << "pair " << i << " rank " << r << ": combine output differs from the CPU's";
    }
  }
}

// A whole step (dispatch -> expert-major rows -> combine) captured per rank in a CUDA graph, then
// replayed with new inputs written into the captured buffers.
TEST_F(EpCuda, GraphCaptureAndReplay) {
  Case c;
  c.R = 3;
  c.L = 2;
  c.K = 2;
  c.max_tokens = 24;
  c.H = 32;
  c.expert_major = true;
  c.y_dtype = DType::kBFloat16;  // the experts are the identity: y = expert_x (bf16 rows)
  c.T = {24, 24, 24};
  c.finite_x = true;
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  World w(c, seed);
  if (!w.gpu) return;
  const int R = c.R;
  std::vector<std::unique_ptr<sy_test::CapturedGraph>> graphs;
  w.fill_inputs();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int r = 0; r < R; ++r) {
    graphs.push_back(std::make_unique<sy_test::CapturedGraph>());
    sy_test::CapturedGraph& gr = *graphs.back();
    RankData& d = w.ranks[r];
    SY_CUDA_OK(gr.begin());
    Status st = w.gpu->dispatch(r, d.in(w.cfg, true), d.out_views(w.cfg, true, true), &d.gpu_handle, false, gr.stream());
    ASSERT_TRUE(st.ok()) << st.to_string();
    ep::CombineInputs in;
    in.expert_major = true;
    in.y = d.ex.view(true);
    in.y.shape[0] = ep::max_expert_rows(w.cfg);
    st = w.gpu->combine(r, d.gpu_handle, in, w.out_view(r, true), false, gr.stream());
    ASSERT_TRUE(st.ok()) << st.to_string();
    SY_CUDA_OK(gr.end());
  }
  for (int replay = 0; replay < 3; ++replay) {
    w.fill_inputs();
    w.poison_outputs(true);
    for (RankData& d : w.ranks) d.out.poison();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int r = 0; r < R; ++r) SY_CUDA_OK(graphs[r]->launch());
    for (int r = 0; r < R; ++r) SY_CUDA_OK(cudaStreamSynchronize(graphs[r]->stream()));
    for (int r = 0; r < R; ++r) ASSERT_TRUE(w.gpu->check(r).ok()) << w.gpu->check(r).to_string();
    // CPU: the same step.
    Status st = ep::run_ranks(R, [&](int r) {
      return w.cpu->dispatch(r, w.ranks[r].in(w.cfg, false), w.ranks[r].out_views(w.cfg, true, false),
                             &w.ranks[r].cpu_handle);
    });
    ASSERT_TRUE(st.ok()) << st.to_string();
    st = ep::run_ranks(R, [&](int r) {
      ep::CombineInputs in;
      in.expert_major = true;
      in.y = w.ranks[r].ex.view(false);
      in.y.shape[0] = ep::max_expert_rows(w.cfg);
      return w.cpu->combine(r, w.ranks[r].cpu_handle, in, w.out_view(r, false));
    });
    ASSERT_TRUE(st.ok()) << st.to_string();
    SCOPED_TRACE("replay " + std::to_string(replay));
    w.compare_dispatch(true);
    w.compare_combine();
  }
}

// A rank that never calls: the others' calls stop within the timeout and report it.
TEST_F(EpCuda, MissingRankTimesOut) {
  Case c;
  c.R = 3;
  c.T = {5, 5, 5};
  for (int missing_step = 0; missing_step < 2; ++missing_step) {  // 0: dispatch, 1: combine
    SCOPED_TRACE(missing_step == 0 ? "rank 2 skips dispatch" : "rank 2 skips combine");
    World w(c, sy_test::test_seed(), /*timeout=*/1.0);
    if (!w.gpu) return;
    w.fill_inputs();
    w.poison_outputs(false);
    const auto start = std::chrono::steady_clock::now();
    for (int r = 0; r < 3; ++r) {
      if (missing_step == 0 && r == 2) continue;
      RankData& d = w.ranks[r];
      ASSERT_TRUE(w.gpu->dispatch(r, d.in(w.cfg, true), d.out_views(w.cfg, false, true), &d.gpu_handle, false,
                                  w.streams[r]).ok());
    }
    if (missing_step == 1) {
      w.fill_combine_inputs();
      for (int r = 0; r < 2; ++r) {
        ASSERT_TRUE(w.gpu->combine(r, w.ranks[r].gpu_handle, w.combine_in(r, true), w.out_view(r, true), false,
                                   w.streams[r]).ok());
      }
    }
    for (int r = 0; r < 3; ++r) SY_CUDA_OK(cudaStreamSynchronize(w.streams[r]));
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(secs, 1.0 + 4.0) << "the waits must end within the timeout plus a margin";
    for (int r = 0; r < 2; ++r) {
      const Status st = w.gpu->check(r);
      EXPECT_EQ(st.code(), StatusCode::kTimeout) << st.to_string();
      EXPECT_NE(st.message().find("rank 2"), std::string::npos) << st.message();
      EXPECT_NE(st.message().find(missing_step == 0 ? "dispatch" : "combine"), std::string::npos) << st.message();
      // The group then refuses calls on that rank.
      RankData& d = w.ranks[r];
      const Status again = w.gpu->dispatch(r, d.in(w.cfg, true), d.out_views(w.cfg, false, true), &d.gpu_handle, false,
                                           w.streams[r]);
      EXPECT_EQ(again.code(), StatusCode::kTimeout) << again.to_string();
    }
    if (missing_step == 0) {
      // Nothing was written by the waiting ranks.
      for (int r = 0; r < 2; ++r)
        for (Twin* t : w.ranks[r].outputs(false)) same("rank " + std::to_string(r) + " output after a timeout", *t);
    }
  }
}

// A rank with bad arguments: its call fails naming the argument, the others learn it on the
// device, and nobody writes outputs.
TEST_F(EpCuda, BadArgumentsReachEveryRank) {
  Case c;
  c.R = 3;
  c.T = {6, 6, 6};
  World w(c, sy_test::test_seed());
  if (!w.gpu) return;
  w.fill_inputs();
  w.poison_outputs(true);
  for (int r = 0; r < 3; ++r) {
    RankData& d = w.ranks[r];
    ep::DispatchInputs in = d.in(w.cfg, true);
    if (r == 1) in.topk_weights.shape[1] = c.K + 1;  // wrong shape
    const Status st = w.gpu->dispatch(r, in, d.out_views(w.cfg, true, true), &d.gpu_handle, false, w.streams[r]);
    if (r == 1) {
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
      EXPECT_NE(st.message().find("topk_weights"), std::string::npos) << st.message();
    } else {
      EXPECT_TRUE(st.ok()) << st.to_string();
    }
  }
  for (int r = 0; r < 3; ++r) SY_CUDA_OK(cudaStreamSynchronize(w.streams[r]));
  for (int r = 0; r < 3; ++r) {
    const Status st = w.gpu->check(r);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
    EXPECT_NE(st.message().find("rank 1"), std::string::npos) << st.message();
    for (Twin* t : w.ranks[r].outputs(true)) same("rank " + std::to_string(r) + " output after bad arguments", *t);
  }
}

TEST_F(EpCuda, LoopbackRefusesWhatCannotBeResident) {
  Case c;
  c.R = 8;
  const ep::GroupConfig cfg = make_config(c);
  std::unique_ptr<ep::GpuGroup> g;
  ep::GpuOptions opt;
  opt.num_sms = 100;  // 8 x 100 blocks cannot all be resident
  Status st = ep::GpuGroup::create_loopback(cfg, opt, 0, &g);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("num_sms"), std::string::npos) << st.message();
  opt = ep::GpuOptions{};
  opt.hardware_queues = 4;
  st = ep::GpuGroup::create_loopback(cfg, opt, 0, &g);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("hardware_queues"), std::string::npos) << st.message();
  // Two ranks on one stream are refused.
  Case d;
  d.R = 2;
  d.T = {2, 2};
  World w(d, sy_test::test_seed());
  if (!w.gpu) return;
  w.fill_inputs();
  RankData& r0 = w.ranks[0];
  RankData& r1 = w.ranks[1];
  ASSERT_TRUE(w.gpu->dispatch(0, r0.in(w.cfg, true), r0.out_views(w.cfg, false, true), &r0.gpu_handle, false,
                              w.streams[0]).ok());
  st = w.gpu->dispatch(1, r1.in(w.cfg, true), r1.out_views(w.cfg, false, true), &r1.gpu_handle, false, w.streams[0]);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("stream"), std::string::npos) << st.message();
  // Rank 1 now dispatches on its own stream, so that rank 0's call completes.
  ASSERT_TRUE(w.gpu->dispatch(1, r1.in(w.cfg, true), r1.out_views(w.cfg, false, true), &r1.gpu_handle, false,
                              w.streams[1]).ok());
  ASSERT_TRUE(w.sync_and_check());
}

TEST_F(EpCuda, ExactModePublishesTheCount) {
  Case c;
  c.R = 3;
  c.max_tokens = 9;
  c.T = {7, 0, 9};
  ep::GpuOptions opt;
  opt.worst_case = false;
  World w(c, sy_test::test_seed(), 20.0, opt);
  if (!w.gpu) return;
  for (int round = 0; round < 2; ++round) {
    w.fill_inputs();
    w.poison_outputs(false);
    ASSERT_TRUE(w.dispatch(false));
    for (int r = 0; r < 3; ++r) {
      std::int64_t rows = -1;
      const Status st = w.gpu->received_rows(r, &rows);
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_TRUE(w.sync_and_check());
      EXPECT_EQ(rows, reinterpret_cast<const std::int64_t*>(w.ranks[r].stats.host.data())[ep::kRecvRows]);
    }
    w.compare_dispatch(false);
  }
}

}  // namespace
