// Benchmark of the layout stage (issue 4), timed as docs/benchmarking.md fixes it: 20 calls
// captured in one CUDA graph, replayed 200 times, median per call.
//   layout from ids: E=256 K=8 and E=512 K=10, tile 128, uniform ids (and one Zipf set);
//   route + layout:  deepseek-v3 and qwen3-next-80b presets, tile 128.
// Prints a markdown table and writes JSON (argv[1], default bench_layout.json).
//   bench_layout [out.json] [--independent-blocks] [--path=NAME]
// --independent-blocks sets LayoutConfig::independent_blocks in every call (the forms whose blocks
// never wait for each other); --path forces LayoutOptions::path where it fits (same-process
// comparisons of the paths).
#include <cuda_runtime.h>
#include <switchyard/switchyard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/git_commit.h"
#include "common/gpu_timing.h"
#include "common/json.h"

using namespace switchyard;

namespace {

constexpr double kLaunchFloorUs = 1.17;  // tiny kernel in a graph, docs/benchmarking.md

struct DevBuf {
  void* p = nullptr;
  explicit DevBuf(std::size_t bytes) {
    if (bytes > 0 && cudaMalloc(&p, bytes) != cudaSuccess) p = nullptr;
  }
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
};

struct Point {
  std::string op, config, ids;
  std::int64_t T = 0;
  sy_bench::Timing timing;
  double target_us = 0;  // 0: no target
  double bytes = 0;
  double floor_us = 0;
};

// Targets of issue 4 for E=256 K=8 tile 128; E=512 K=10 gets 1.5x.
double layout_target(std::int64_t T, bool wide) {
  double t = 0;
  if (T <= 256) t = 3;
  if (T == 4096) t = 6;
  if (T == 65536) t = 20;
  return wide ? 1.5 * t : t;
}
double route_layout_target(std::int64_t T, bool wide) {
  double t = 0;
  if (T <= 256) t = 4;
  if (T == 8192) t = 12;
  return wide ? 1.5 * t : t;
}

// Distinct ids per row, uniform or Zipf(1.2).
std::vector<std::int32_t> make_ids(std::int64_t T, int K, int E, bool zipf, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<double> cdf(E);
  double sum = 0;
  for (int e = 0; e < E; ++e) {
    sum += zipf ? 1.0 / std::pow(e + 1.0, 1.2) : 1.0;
    cdf[e] = sum;
  }
  std::uniform_real_distribution<double> u(0.0, sum);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  std::vector<char> used(E, 0);
  for (std::int64_t t = 0; t < T; ++t) {
    for (int k = 0; k < K; ++k) {
      int e;
      do {
        e = std::min<int>(E - 1,
                          static_cast<int>(std::upper_bound(cdf.begin(), cdf.end(), u(g)) - cdf.begin()));
      } while (used[e]);
      used[e] = 1;
      ids[t * K + k] = e;
    }
    for (int k = 0; k < K; ++k) used[ids[t * K + k]] = 0;
  }
  return ids;
}

// Output arrays of one layout shape, on the device.
struct DeviceLayout {
  std::int64_t T, rows, tiles;
  int K, L;
  DevBuf counts, offsets, p2e, p2t, e2p, tile_expert, tile_row_end, totals;
  DeviceLayout(std::int64_t T_, int K_, int L_, int M)
      : T(T_),
        rows(max_permuted_rows(T_, K_, L_, M)),
        tiles(max_tiles(T_, K_, L_, M)),
        K(K_),
        L(L_),
        counts(4 * L_ + 16),
        offsets(4 * (L_ + 1) + 16),
        p2e(4 * rows + 16),
        p2t(4 * rows + 16),
        e2p(4 * T_ * K_ + 16),
        tile_expert(4 * tiles + 16),
        tile_row_end(4 * tiles + 16),
        totals(4 * kNumTotals + 16) {}
  Layout views() const {
    auto v = [](const DevBuf& b, std::int64_t n) {
      return TensorView::of(b.p, DType::kInt32, {n}, Device::cuda());
    };
    Layout out;
    out.counts = v(counts, L);
    out.offsets = v(offsets, L + 1);
    out.permuted_to_expanded = v(p2e, rows);
    out.permuted_to_token = v(p2t, rows);
    out.expanded_to_permuted = TensorView::of(e2p.p, DType::kInt32, {T, K}, Device::cuda());
    out.tile_expert = v(tile_expert, tiles);
    out.tile_row_end = v(tile_row_end, tiles);
    out.totals = v(totals, kNumTotals);
    return out;
  }
  // Bytes a layout must write.
  double write_bytes() const {
    return 4.0 * (static_cast<double>(T) * K + 2.0 * rows + 2.0 * tiles + 2.0 * L + 4);
  }
};

// Input sets to rotate through: several when they fit in L2 together, so that replays do not
// read the same bytes from L2 over and over.
int input_sets(double bytes_per_set) { return bytes_per_set * 4 <= 40e6 ? 4 : 1; }

bool g_independent_blocks = false;  // --independent-blocks
switchyard::LayoutOptions g_options;  // --path=...
std::string g_path_name = "auto";

// --path=NAME: LayoutOptions::Path by name, or false for an unknown name.
bool parse_path(const std::string& name, switchyard::LayoutOptions::Path* path) {
  using P = switchyard::LayoutOptions::Path;
  const std::pair<const char*, P> names[] = {{"auto", P::kAuto},         {"one-block", P::kOneBlock},
                                             {"cluster8", P::kCluster8}, {"cluster16", P::kCluster16},
                                             {"grid32", P::kGrid32},     {"grid64", P::kGrid64},
                                             {"grid128", P::kGrid128},   {"chunked", P::kChunked}};
  for (const auto& [n, p] : names) {
    if (name == n) {
      *path = p;
      return true;
    }
  }
  return false;
}

Point bench_layout_from_ids(int E, int K, int M, std::int64_t T, bool zipf, double bandwidth,
                            std::mt19937_64& g) {
  Point pt;
  pt.op = "layout";
  pt.config = "E=" + std::to_string(E) + " K=" + std::to_string(K) + " M=" + std::to_string(M);
  pt.ids = zipf ? "zipf" : "uniform";
  pt.T = T;
  pt.target_us = zipf ? 0 : layout_target(T, E == 512);
  LayoutConfig config;
  config.num_experts = E;
  config.tile_size = M;
  config.independent_blocks = g_independent_blocks;
  DeviceLayout out(T, K, E, M);
  std::size_t ws_bytes = 0;
  if (!layout_workspace_size(config, T, K, Device::cuda(), &ws_bytes).ok()) {
    pt.timing.error = "layout_workspace_size failed";
    return pt;
  }
  DevBuf ws(ws_bytes);
  const std::size_t ids_bytes = static_cast<std::size_t>(T * K) * 4;
  const int sets = input_sets(static_cast<double>(ids_bytes));
  std::vector<DevBuf*> ids;
  for (int s = 0; s < sets; ++s) {
    ids.push_back(new DevBuf(ids_bytes + 16));
    const std::vector<std::int32_t> host = make_ids(T, K, E, zipf, g());
    cudaMemcpy(ids.back()->p, host.data(), ids_bytes, cudaMemcpyHostToDevice);
  }
  const Layout views = out.views();
  pt.timing = sy_bench::time_in_graph([&](cudaStream_t stream, int i) {
    const TensorView v = TensorView::of(ids[i % sets]->p, DType::kInt32, {T, K}, Device::cuda());
    return layout(config, v, views, ws.p, ws_bytes, stream, g_options).ok();
  });
  for (DevBuf* b : ids) delete b;
  pt.bytes = static_cast<double>(ids_bytes) + out.write_bytes();
  pt.floor_us = bandwidth > 0 ? pt.bytes / bandwidth * 1e6 : 0;
  return pt;
}

Point bench_route_and_layout(const ModelPreset& preset, int M, std::int64_t T, double bandwidth,
                             std::mt19937_64& g) {
  Point pt;
  const int E = preset.routing.num_experts;
  const int K = preset.routing.top_k;
  pt.op = "route+layout";
  pt.config = preset.name + " E=" + std::to_string(E) + " K=" + std::to_string(K) + " M=" + std::to_string(M);
  pt.ids = "fp32 logits";
  pt.T = T;
  pt.target_us = route_layout_target(T, E == 512);
  LayoutConfig config;
  config.num_experts = E;
  config.tile_size = M;
  config.independent_blocks = g_independent_blocks;
  DeviceLayout out(T, K, E, M);
  std::size_t ws_bytes = 0;
  if (!layout_workspace_size(config, T, K, Device::cuda(), &ws_bytes).ok()) {
    pt.timing.error = "layout_workspace_size failed";
    return pt;
  }
  DevBuf ws(ws_bytes);
  const std::size_t logits_bytes = static_cast<std::size_t>(T * E) * 4;
  const int sets = input_sets(static_cast<double>(logits_bytes));
  std::vector<DevBuf*> logits;
  std::normal_distribution<float> normal(0.f, 1.f);
  for (int s = 0; s < sets; ++s) {
    logits.push_back(new DevBuf(logits_bytes + 16));
    std::vector<float> host(static_cast<std::size_t>(T * E));
    for (float& v : host) v = normal(g);
    cudaMemcpy(logits.back()->p, host.data(), logits_bytes, cudaMemcpyHostToDevice);
  }
  DevBuf bias(static_cast<std::size_t>(E) * 4 + 16);
  {
    std::vector<float> host(E);
    for (float& v : host) v = 0.1f * normal(g);
    cudaMemcpy(bias.p, host.data(), host.size() * 4, cudaMemcpyHostToDevice);
  }
  DevBuf ids(static_cast<std::size_t>(T * K) * 4 + 16);
  DevBuf weights(static_cast<std::size_t>(T * K) * 4 + 16);
  const Layout views = out.views();
  const TensorView bias_view =
      preset.has_bias ? TensorView::of(bias.p, DType::kFloat32, {E}, Device::cuda()) : TensorView{};
  pt.timing = sy_bench::time_in_graph([&](cudaStream_t stream, int i) {
    const TensorView lv = TensorView::of(logits[i % sets]->p, DType::kFloat32, {T, E}, Device::cuda());
    const TensorView iv = TensorView::of(ids.p, DType::kInt32, {T, K}, Device::cuda());
    const TensorView wv = TensorView::of(weights.p, DType::kFloat32, {T, K}, Device::cuda());
    return route_and_layout(preset.routing, lv, bias_view, iv, wv, config, views, ws.p, ws_bytes, stream,
                            switchyard::RouteOptions(), g_options)
        .ok();
  });
  for (DevBuf* b : logits) delete b;
  pt.bytes = static_cast<double>(logits_bytes) + 8.0 * T * K + out.write_bytes();
  pt.floor_us = bandwidth > 0 ? pt.bytes / bandwidth * 1e6 : 0;
  return pt;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out_path = "bench_layout.json";
  for (int a = 1; a < argc; ++a) {
    const std::string arg = argv[a];
    if (arg == "--independent-blocks") {
      g_independent_blocks = true;
    } else if (arg.rfind("--path=", 0) == 0 && parse_path(arg.substr(7), &g_options.path)) {
      g_path_name = arg.substr(7);
    } else if (!arg.empty() && arg[0] != '-') {
      out_path = arg;
    } else {
      std::fprintf(stderr,
                   "usage: bench_layout [out.json] [--independent-blocks] "
                   "[--path=auto|one-block|cluster8|cluster16|grid32|grid64|grid128|chunked]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_layout: no CUDA device\n");
    return 1;
  }
  const std::string device = sy_bench::device_name();
  const double bandwidth = sy_bench::measure_copy_bandwidth();
  std::mt19937_64 g(20240611);
  std::vector<Point> points;

  const std::int64_t layout_ts[] = {1, 16, 128, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 262144};
  for (const auto& [E, K] : {std::pair<int, int>{256, 8}, std::pair<int, int>{512, 10}}) {
    for (const std::int64_t T : layout_ts)
      if (sy_bench::token_selected(T))
        points.push_back(bench_layout_from_ids(E, K, 128, T, false, bandwidth, g));
  }
  for (const std::int64_t T : layout_ts)
    if (sy_bench::token_selected(T))
      points.push_back(bench_layout_from_ids(256, 8, 128, T, true, bandwidth, g));

  const std::int64_t route_ts[] = {1, 2, 4, 8, 16, 128, 256, 1024, 4096, 8192};
  for (const char* name : {"deepseek-v3", "qwen3-next-80b"}) {
    ModelPreset preset;
    if (!find_preset(name, &preset).ok()) {
      std::fprintf(stderr, "bench_layout: unknown preset %s\n", name);
      return 1;
    }
    for (const std::int64_t T : route_ts)
      if (sy_bench::token_selected(T)) points.push_back(bench_route_and_layout(preset, 128, T, bandwidth, g));
  }

  std::printf("# bench_layout on %s (commit %s), copy bandwidth %.2f TB/s%s\n\n", device.c_str(),
              SY_GIT_COMMIT, bandwidth * 1e-12,
              g_independent_blocks ? ", LayoutConfig::independent_blocks" : "");
  std::printf("| op | config | ids | T | median us | p10 us | p90 us | floor us | target us | met |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> items;
  int missed = 0;
  for (const Point& p : points) {
    const bool has_target = p.target_us > 0;
    const bool met = p.timing.ok && (!has_target || p.timing.median_us <= p.target_us);
    if (has_target && !met) ++missed;
    char target[32] = "-";
    if (has_target) std::snprintf(target, sizeof target, "%.1f", p.target_us);
    const double floor_us = std::max(p.floor_us, kLaunchFloorUs);
    if (p.timing.ok) {
      std::printf("| %s | %s | %s | %lld | %.2f | %.2f | %.2f | %.2f | %s | %s |\n", p.op.c_str(),
                  p.config.c_str(), p.ids.c_str(), static_cast<long long>(p.T), p.timing.median_us,
                  p.timing.p10_us, p.timing.p90_us, floor_us, target,
                  has_target ? (met ? "yes" : "NO") : "-");
    } else {
      std::printf("| %s | %s | %s | %lld | error: %s | | | | %s | %s |\n", p.op.c_str(), p.config.c_str(),
                  p.ids.c_str(), static_cast<long long>(p.T), p.timing.error.c_str(), target,
                  has_target ? "NO" : "-");
    }
    sy_bench::JsonObject o;
    o.str("op", p.op).str("config", p.config).str("ids", p.ids).num("T", static_cast<double>(p.T));
    o.boolean("ok", p.timing.ok);
    if (!p.timing.ok) o.str("error", p.timing.error);
    o.num("median_us", p.timing.median_us).num("p10_us", p.timing.p10_us).num("p90_us", p.timing.p90_us);
    o.num("bytes", p.bytes).num("floor_us", floor_us);
    if (has_target) o.num("target_us", p.target_us);
    o.boolean("met", met);
    items.push_back(o.dump());
  }
  sy_bench::JsonObject root;
  root.str("benchmark", "bench_layout").str("device", device).str("date", sy_bench::utc_now());
  root.str("commit", SY_GIT_COMMIT).num("copy_bandwidth_bytes_per_s", bandwidth);
  root.str("method", "20 calls per CUDA graph, 200 replays, median per call (docs/benchmarking.md)");
  root.boolean("independent_blocks", g_independent_blocks);
  root.str("path", g_path_name);
  root.str("repro", "bench_layout " + out_path + (g_independent_blocks ? " --independent-blocks" : "") +
                        (g_path_name == "auto" ? "" : " --path=" + g_path_name));
  root.raw("points", sy_bench::json_array(items));
  FILE* f = std::fopen(out_path.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "bench_layout: cannot write %s\n", out_path.c_str());
    return 1;
  }
  std::fprintf(f, "%s\n", root.dump().c_str());
  std::fclose(f);
  std::printf("\n%d target(s) missed; JSON written to %s\n", missed, out_path.c_str());
  return 0;
}
