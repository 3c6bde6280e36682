// Benchmark of gather and combine (issue 5), timed as docs/benchmarking.md fixes it: 20
// calls captured in one CUDA graph, replayed up to 200 times, median per call.
//   gather (the API's row-order kernel) and the token-major gather: bf16 rows;
//   weighted combine: bf16 y_perm, fp32 weights, bf16 out;
//   H = 2048, 4096, 7168; K = 2 (E = 8) and K = 8 (E = 256); T = 1 ... 16384; tile 128;
//   uniform ids, every expert local; plus fp8 gather with per-128-column scales at H=7168 K=8.
// Bytes moved, the floor the targets are stated against:
//   gather:  each token row read once + every placed row written (+ indices, scales);
//   combine: every placed row of y_perm read + indices + weights + out written.
// The row-order gather reads a token row once per placed row; when x does not fit in L2 its
// real traffic is up to (K + 1) / 2 times this floor, which is why the token-major kernel is
// here too.
// Prints a markdown table and writes JSON (argv[1], default bench_permute.json).
//   bench_permute [out.json]
#include <cuda_runtime.h>
#include <switchyard/switchyard.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/gpu_timing.h"
#include "common/git_commit.h"
#include "common/json.h"
#include "common/op_args.h"
#include "cuda/permute/permute_internal.h"

using namespace switchyard;

namespace {

constexpr int kTile = 128;
constexpr int kCallsPerGraph = 20;
// Input sets rotated per call when one set is small enough to stay in L2 (60 MB) otherwise.
constexpr std::size_t kRotateBelowBytes = std::size_t(64) << 20;
constexpr int kRotatedSets = 4;

struct DevBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  explicit DevBuf(std::size_t n) : bytes(n) {
    if (n > 0 && cudaMalloc(&p, n) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Fills a device buffer with random bf16 values in [-2, 2) (never zeros, no NaN): a 16 MiB
// random block uploaded once and tiled with device-to-device copies.
bool fill_random(const DevBuf& b, std::uint64_t seed, bool fp8 = false) {
  if (!b.p) return false;
  const std::size_t block = std::min<std::size_t>(b.bytes, std::size_t(16) << 20);
  std::vector<std::uint16_t> host((block + 1) / 2);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(0.0625f, 2.0f);
  for (auto& v : host) {
    float f = u(g) * ((g() & 1) ? 1.0f : -1.0f);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<std::uint16_t>(bits >> 16);
    if (fp8) v = static_cast<std::uint16_t>(0x3838 ^ (g() & 0x0707));  // finite nonzero e4m3 bytes
  }
  if (cudaMemcpy(b.p, host.data(), block, cudaMemcpyHostToDevice) != cudaSuccess) return false;
  for (std::size_t off = block; off < b.bytes; off += block) {
    const std::size_t n = std::min(block, b.bytes - off);
    if (cudaMemcpy(static_cast<char*>(b.p) + off, b.p, n, cudaMemcpyDeviceToDevice) != cudaSuccess)
      return false;
  }
  return true;
}

// Uniform distinct ids per row.
std::vector<std::int32_t> uniform_ids(std::int64_t T, int K, int E, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  std::vector<std::int32_t> perm(E);
  for (std::int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    for (int k = 0; k < K; ++k) {  // partial Fisher-Yates
      const int j = k + static_cast<int>(g() % static_cast<std::uint64_t>(E - k));
      std::swap(perm[k], perm[j]);
      ids[t * K + k] = perm[k];
    }
  }
  return ids;
}

// A layout computed on the CPU and copied to the device.
struct BenchLayout {
  std::int64_t T = 0, R = 0, N = 0;
  int K = 0, E = 0;
  std::int64_t placed = 0;       // rows holding a token (sum of counts)
  std::int64_t tokens_read = 0;  // tokens with at least one placed pick
  std::int64_t padded_total = 0;
  std::vector<DevBuf*> owned;
  Layout device;
  ~BenchLayout() {
    for (DevBuf* b : owned) delete b;
  }

  bool build(std::int64_t T_, int K_, int E_, std::uint64_t seed, std::string* error) {
    T = T_;
    K = K_;
    E = E_;
    LayoutConfig config;
    config.num_experts = E;
    config.tile_size = kTile;
    R = max_permuted_rows(T, K, E, kTile);
    N = max_tiles(T, K, E, kTile);
    std::vector<std::int32_t> ids = uniform_ids(T, K, E, seed);
    std::vector<std::int32_t> counts(E), offsets(E + 1), p2e(R), p2t(R), e2p(T * K), te(N), tre(N),
        totals(kNumTotals);
    Layout host;
    host.counts = TensorView::of(counts.data(), DType::kInt32, {E});
    host.offsets = TensorView::of(offsets.data(), DType::kInt32, {E + 1});
    host.permuted_to_expanded = TensorView::of(p2e.data(), DType::kInt32, {R});
    host.permuted_to_token = TensorView::of(p2t.data(), DType::kInt32, {R});
    host.expanded_to_permuted = TensorView::of(e2p.data(), DType::kInt32, {T, K});
    host.tile_expert = TensorView::of(te.data(), DType::kInt32, {N});
    host.tile_row_end = TensorView::of(tre.data(), DType::kInt32, {N});
    host.totals = TensorView::of(totals.data(), DType::kInt32, {kNumTotals});
    const Status st = layout(config, TensorView::of(ids.data(), DType::kInt32, {T, K}), host, nullptr, 0);
    if (!st.ok()) {
      *error = "CPU layout: " + st.to_string();
      return false;
    }
    placed = 0;
    for (std::int32_t c : counts) placed += c;
    tokens_read = 0;
    for (std::int64_t t = 0; t < T; ++t) {
      bool any = false;
      for (int k = 0; k < K; ++k) any |= e2p[t * K + k] >= 0;
      tokens_read += any;
    }
    padded_total = totals[kPaddedTotal];
    auto upload = [&](const std::vector<std::int32_t>& v, std::initializer_list<std::int64_t> shape) {
      DevBuf* b = new DevBuf(v.size() * 4 + 16);
      owned.push_back(b);
      if (b->p) cudaMemcpy(b->p, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
      return TensorView::of(b->p, DType::kInt32, shape, Device::cuda());
    };
    device.counts = upload(counts, {E});
    device.offsets = upload(offsets, {E + 1});
    device.permuted_to_expanded = upload(p2e, {R});
    device.permuted_to_token = upload(p2t, {R});
    device.expanded_to_permuted = upload(e2p, {T, K});
    device.tile_expert = upload(te, {N});
    device.tile_row_end = upload(tre, {N});
    device.totals = upload(totals, {kNumTotals});
    for (DevBuf* b : owned) {
      if (!b->p) {
        *error = "cudaMalloc failed for the layout";
        return false;
      }
    }
    return true;
  }
};

struct Point {
  std::string op;
  std::string dtype;
  std::int64_t H = 0, T = 0;
  int K = 0, E = 0;
  sy_bench::Timing timing;
  double bytes = 0;
  double gbps = 0;
  double pct_copy = 0;
  std::string target;  // "" when none
  bool met = false;
};

// Times `enqueue` (replays scaled so that a point takes about a second at most).
sy_bench::Timing time_point(const std::function<bool(cudaStream_t, int)>& enqueue) {
  sy_bench::Timing probe = sy_bench::time_in_graph(enqueue, kCallsPerGraph, 5);
  if (!probe.ok) return probe;
  const double graph_us = probe.median_us * kCallsPerGraph;
  const int replays = static_cast<int>(std::clamp(1.0e6 / std::max(graph_us, 1.0), 20.0, 200.0));
  return sy_bench::time_in_graph(enqueue, kCallsPerGraph, replays);
}

void finish_point(Point* p, double copy_bw) {
  if (!p->timing.ok) return;
  p->gbps = p->bytes / (p->timing.median_us * 1e-6) / 1e9;
  p->pct_copy = copy_bw > 0 ? 100.0 * p->gbps * 1e9 / copy_bw : 0;
  if (p->T >= 4096) {
    p->target = ">=85% copy";
    p->met = p->pct_copy >= 85.0;
  } else if (p->T <= 16) {
    p->target = "<=3 us";
    p->met = p->timing.median_us <= 3.0;
  }
}

// All points of one (H, K, T): gathers and combine on shared buffers.
void run_shape(std::int64_t H, int K, std::int64_t T, double copy_bw, std::vector<Point>* points) {
  const int E = K == 2 ? 8 : 256;
  BenchLayout lay;
  std::string error;
  auto fail_all = [&](const std::string& why) {
    for (const char* op : {"gather", "gather_token_major", "combine"}) {
      Point p;
      p.op = op;
      p.dtype = "bf16";
      p.H = H;
      p.T = T;
      p.K = K;
      p.E = E;
      p.timing.error = why;
      points->push_back(p);
    }
  };
  if (!lay.build(T, K, E, 1234 + T * 31 + K, &error)) return fail_all(error);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * 2;
  const std::size_t x_bytes = static_cast<std::size_t>(T) * row_bytes;
  const std::size_t y_bytes = static_cast<std::size_t>(lay.R) * row_bytes;
  const int x_sets = x_bytes <= kRotateBelowBytes ? kRotatedSets : 1;
  const int y_sets = y_bytes <= kRotateBelowBytes ? kRotatedSets : 1;
  std::vector<DevBuf*> xs, ys, ws;
  for (int i = 0; i < x_sets; ++i) xs.push_back(new DevBuf(x_bytes));
  for (int i = 0; i < y_sets; ++i) {
    ys.push_back(new DevBuf(y_bytes));
    ws.push_back(new DevBuf(static_cast<std::size_t>(T * K) * 4));
  }
  DevBuf x_perm(y_bytes);
  DevBuf out(x_bytes);
  bool ok = x_perm.p && out.p;
  for (int i = 0; i < x_sets; ++i) ok = ok && fill_random(*xs[i], 10 + i);
  for (int i = 0; i < y_sets; ++i) {
    ok = ok && fill_random(*ys[i], 20 + i);
    std::vector<float> w(static_cast<std::size_t>(T * K));
    std::mt19937_64 g(30 + i);
    std::uniform_real_distribution<float> u(0.01f, 1.0f);
    for (float& v : w) v = u(g);
    ok =
        ok && ws[i]->p && cudaMemcpy(ws[i]->p, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess;
  }
  auto cleanup = [&]() {
    for (auto* v : {&xs, &ys, &ws})
      for (DevBuf* b : *v) delete b;
  };
  if (!ok) {
    cleanup();
    return fail_all("allocation or upload failed");
  }
  const Device dev = Device::cuda();
  const double index_bytes = 4.0 * static_cast<double>(lay.padded_total);
  const double gather_bytes = static_cast<double>(lay.tokens_read + lay.placed) * row_bytes + index_bytes;
  const double combine_bytes = static_cast<double>(lay.placed) * row_bytes +
                               8.0 * static_cast<double>(T * K) + static_cast<double>(x_bytes);

  auto gather_args = [&](int i) {
    detail::GatherArgs a;
    a.num_tokens = T;
    a.hidden = H;
    a.dtype = DType::kBFloat16;
    a.x = xs[i % x_sets]->p;
    a.x_row_stride = H;
    a.permuted_to_token = static_cast<const std::int32_t*>(lay.device.permuted_to_token.data);
    a.totals = static_cast<const std::int32_t*>(lay.device.totals.data);
    a.capacity_rows = lay.R;
    a.x_perm = x_perm.p;
    return a;
  };

  Point g;
  g.op = "gather";
  g.dtype = "bf16";
  g.H = H;
  g.T = T;
  g.K = K;
  g.E = E;
  g.bytes = gather_bytes;
  g.timing = time_point([&](cudaStream_t s, int i) {
    return gather(TensorView::of(xs[i % x_sets]->p, DType::kBFloat16, {T, H}, dev), TensorView{}, lay.device,
                  TensorView::of(x_perm.p, DType::kBFloat16, {lay.R, H}, dev), TensorView{}, false, s)
        .ok();
  });
  finish_point(&g, copy_bw);
  points->push_back(g);

  Point tm = g;
  tm.op = "gather_token_major";
  tm.timing = time_point([&](cudaStream_t s, int i) {
    return cuda::gather_token_major(
               gather_args(i), static_cast<const std::int32_t*>(lay.device.expanded_to_permuted.data), K, s)
        .ok();
  });
  finish_point(&tm, copy_bw);
  points->push_back(tm);

  Point c = g;
  c.op = "combine";
  c.bytes = combine_bytes;
  c.timing = time_point([&](cudaStream_t s, int i) {
    return combine(TensorView::of(ys[i % y_sets]->p, DType::kBFloat16, {lay.R, H}, dev), lay.device,
                   TensorView::of(ws[i % y_sets]->p, DType::kFloat32, {T, K}, dev),
                   TensorView::of(out.p, DType::kBFloat16, {T, H}, dev), false, s)
        .ok();
  });
  finish_point(&c, copy_bw);
  points->push_back(c);
  cleanup();
}

// fp8 e4m3 gather with per-128-column scales, both gather kernels.
void run_fp8(std::int64_t H, int K, std::int64_t T, double copy_bw, std::vector<Point>* points) {
  const int E = 256;
  const std::int64_t G = (H + kScaleGroupSize - 1) / kScaleGroupSize;
  BenchLayout lay;
  std::string error;
  Point base;
  base.dtype = "fp8+scales";
  base.H = H;
  base.T = T;
  base.K = K;
  base.E = E;
  if (!lay.build(T, K, E, 777 + T, &error)) {
    base.op = "gather";
    base.timing.error = error;
    points->push_back(base);
    return;
  }
  const std::size_t row_bytes = static_cast<std::size_t>(H) + static_cast<std::size_t>(G) * 4;
  const int sets = static_cast<std::size_t>(T) * row_bytes <= kRotateBelowBytes ? kRotatedSets : 1;
  std::vector<DevBuf*> xs, ss;
  bool ok = true;
  for (int i = 0; i < sets; ++i) {
    xs.push_back(new DevBuf(static_cast<std::size_t>(T * H)));
    ss.push_back(new DevBuf(static_cast<std::size_t>(T * G) * 4));
    ok = ok && fill_random(*xs[i], 40 + i, /*fp8=*/true) && fill_random(*ss[i], 50 + i);
  }
  DevBuf x_perm(static_cast<std::size_t>(lay.R * H));
  DevBuf x_perm_scales(static_cast<std::size_t>(lay.R * G) * 4);
  ok = ok && x_perm.p && x_perm_scales.p;
  const Device dev = Device::cuda();
  base.bytes = static_cast<double>(lay.tokens_read + lay.placed) * row_bytes + 4.0 * lay.padded_total;
  if (ok) {
    Point g = base;
    g.op = "gather";
    g.timing = time_point([&](cudaStream_t s, int i) {
      return gather(TensorView::of(xs[i % sets]->p, DType::kFloat8E4M3, {T, H}, dev),
                    TensorView::of(ss[i % sets]->p, DType::kFloat32, {T, G}, dev), lay.device,
                    TensorView::of(x_perm.p, DType::kFloat8E4M3, {lay.R, H}, dev),
                    TensorView::of(x_perm_scales.p, DType::kFloat32, {lay.R, G}, dev), false, s)
          .ok();
    });
    finish_point(&g, copy_bw);
    points->push_back(g);
    Point tm = base;
    tm.op = "gather_token_major";
    tm.timing = time_point([&](cudaStream_t s, int i) {
      detail::GatherArgs a;
      a.num_tokens = T;
      a.hidden = H;
      a.dtype = DType::kFloat8E4M3;
      a.x = xs[i % sets]->p;
      a.x_row_stride = H;
      a.x_scales = ss[i % sets]->as<const float>();
      a.scale_cols = G;
      a.permuted_to_token = static_cast<const std::int32_t*>(lay.device.permuted_to_token.data);
      a.totals = static_cast<const std::int32_t*>(lay.device.totals.data);
      a.capacity_rows = lay.R;
      a.x_perm = x_perm.p;
      a.x_perm_scales = x_perm_scales.as<float>();
      return cuda::gather_token_major(
                 a, static_cast<const std::int32_t*>(lay.device.expanded_to_permuted.data), K, s)
          .ok();
    });
    finish_point(&tm, copy_bw);
    points->push_back(tm);
  } else {
    base.op = "gather";
    base.timing.error = "allocation or upload failed";
    points->push_back(base);
  }
  for (DevBuf* b : xs) delete b;
  for (DevBuf* b : ss) delete b;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json_path = argc > 1 ? argv[1] : "bench_permute.json";
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_permute: no CUDA device\n");
    return 1;
  }
  const double copy_bw = sy_bench::measure_copy_bandwidth();
  std::printf("device: %s, copy bandwidth %.2f TB/s, commit %s\n\n", sy_bench::device_name().c_str(),
              copy_bw / 1e12, SY_GIT_COMMIT);

  std::vector<Point> points;
  const std::int64_t kHidden[] = {2048, 4096, 7168};
  const int kTopK[] = {2, 8};
  const std::int64_t kTokens[] = {1, 16, 128, 1024, 4096, 16384};
  for (std::int64_t H : kHidden)
    for (int K : kTopK)
      for (std::int64_t T : kTokens)
        if (sy_bench::token_selected(T)) run_shape(H, K, T, copy_bw, &points);
  for (std::int64_t T : kTokens)
    if (sy_bench::token_selected(T)) run_fp8(7168, 8, T, copy_bw, &points);

  std::printf(
      "| op | dtype | H | K | E | T | median us | p10 us | p90 us | MB moved | GB/s | %% copy | target | met "
      "|\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> json_points;
  int missed = 0;
  for (const Point& p : points) {
    if (!p.timing.ok) {
      std::printf("| %s | %s | %lld | %d | %d | %lld | error: %s |||||||| |\n", p.op.c_str(), p.dtype.c_str(),
                  static_cast<long long>(p.H), p.K, p.E, static_cast<long long>(p.T), p.timing.error.c_str());
    } else {
      // The token-major gather is not what the API calls yet: shown for comparison, not scored.
      const bool scored = !p.target.empty() && p.op != "gather_token_major";
      if (scored && !p.met) ++missed;
      std::printf("| %s | %s | %lld | %d | %d | %lld | %.2f | %.2f | %.2f | %.1f | %.0f | %.1f | %s | %s |\n",
                  p.op.c_str(), p.dtype.c_str(), static_cast<long long>(p.H), p.K, p.E,
                  static_cast<long long>(p.T), p.timing.median_us, p.timing.p10_us, p.timing.p90_us,
                  p.bytes / 1e6, p.gbps, p.pct_copy, p.target.empty() ? "-" : p.target.c_str(),
                  p.target.empty() ? "-" : (p.met ? "yes" : "NO"));
    }
    sy_bench::JsonObject o;
    o.str("op", p.op)
        .str("dtype", p.dtype)
        .num("H", static_cast<double>(p.H))
        .num("K", p.K)
        .num("E", p.E)
        .num("T", static_cast<double>(p.T))
        .num("tile", kTile)
        .boolean("ok", p.timing.ok);
    if (p.timing.ok) {
      o.num("median_us", p.timing.median_us)
          .num("p10_us", p.timing.p10_us)
          .num("p90_us", p.timing.p90_us)
          .num("bytes", p.bytes)
          .num("gbps", p.gbps)
          .num("pct_copy_bandwidth", p.pct_copy)
          .str("target", p.target)
          .boolean("met", p.met);
    } else {
      o.str("error", p.timing.error);
    }
    json_points.push_back(o.dump());
  }
  sy_bench::JsonObject top;
  top.str("benchmark", "bench_permute")
      .str("device", sy_bench::device_name())
      .str("date", sy_bench::utc_now())
      .str("commit", SY_GIT_COMMIT)
      .num("copy_bandwidth_Bps", copy_bw)
      .num("calls_per_graph", kCallsPerGraph)
      .str("ids", "uniform, distinct per token, every expert local")
      .str("bytes_definition",
           "gather: tokens read once + placed rows written + 4 B per padded row; combine: placed rows read + "
           "8 B per pick + out written")
      .str("repro", "bench_permute " + json_path)
      .raw("points", sy_bench::json_array(json_points));
  if (FILE* f = std::fopen(json_path.c_str(), "w")) {
    std::fprintf(f, "%s\n", top.dump().c_str());
    std::fclose(f);
    std::printf("\nwrote %s; scored points missing their target: %d\n", json_path.c_str(), missed);
  } else {
    std::fprintf(stderr, "bench_permute: cannot write %s\n", json_path.c_str());
    return 1;
  }
  return 0;
}
