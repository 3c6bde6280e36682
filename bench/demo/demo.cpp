// The demo (README's main command until the benchmark CLI lands): routes a DeepSeek-V3-sized
// batch through route+layout, gather, (identity experts) and combine on the best available
// backend, checks the result against the CPU oracle and prints a short summary.
//   switchyard_demo [--preset NAME] [--tokens T] [--cpu]
#include <switchyard/switchyard.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(SWITCHYARD_WITH_CUDA)
#include <cuda_runtime.h>
#endif

using namespace switchyard;

namespace {

std::uint16_t to_bf16(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
float from_bf16(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Host arrays of one run, and (on a GPU) their device twins.
struct Run {
  Device device;
  std::vector<void*> device_allocs;
  ~Run() {
#if defined(SWITCHYARD_WITH_CUDA)
    for (void* p : device_allocs) cudaFree(p);
#endif
  }
  // A view of `bytes` host bytes, copied to the device on a GPU run.
  TensorView view(void* host, DType dtype, std::initializer_list<std::int64_t> shape) {
    TensorView t = TensorView::of(host, dtype, shape, device);
#if defined(SWITCHYARD_WITH_CUDA)
    if (device.is_cuda()) {
      void* d = nullptr;
      const std::size_t bytes = std::max<std::size_t>(t.nbytes(), 16);
      if (cudaMalloc(&d, bytes) != cudaSuccess) return TensorView{};
      device_allocs.push_back(d);
      cudaMemcpy(d, host, t.nbytes(), cudaMemcpyHostToDevice);
      t.data = d;
    }
#endif
    return t;
  }
  void fetch(void* host, const TensorView& t) {
#if defined(SWITCHYARD_WITH_CUDA)
    if (device.is_cuda()) {
      cudaMemcpy(host, t.data, t.nbytes(), cudaMemcpyDeviceToHost);
      return;
    }
#endif
    if (host != t.data) std::memcpy(host, t.data, t.nbytes());
  }
  void sync() {
#if defined(SWITCHYARD_WITH_CUDA)
    if (device.is_cuda()) cudaDeviceSynchronize();
#endif
  }
};

bool gpu_available(std::string* name) {
#if defined(SWITCHYARD_WITH_CUDA)
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) return false;
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  if (p.major < 9) return false;
  *name = p.name;
  return true;
#else
  (void)name;
  return false;
#endif
}

double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int fail(const char* what, const Status& s) {
  std::fprintf(stderr, "demo: %s failed: %s\n", what, s.to_string().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::string preset_name = "deepseek-v3";
  long tokens = -1;
  bool force_cpu = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--preset" && i + 1 < argc) preset_name = argv[++i];
    else if (a == "--tokens" && i + 1 < argc) tokens = std::atol(argv[++i]);
    else if (a == "--cpu") force_cpu = true;
    else {
      std::fprintf(stderr, "usage: switchyard_demo [--preset NAME] [--tokens T] [--cpu]\n");
      return 2;
    }
  }
  ModelPreset preset;
  Status s = find_preset(preset_name, &preset);
  if (!s.ok()) return fail("find_preset", s);

  std::string gpu_name;
  const bool gpu = !force_cpu && gpu_available(&gpu_name);
  Run run;
  run.device = gpu ? Device::cuda(0) : Device::cpu();
  const std::int64_t T = tokens > 0 ? tokens : (gpu ? 4096 : 1024);
  const RoutingConfig& rc = preset.routing;
  const int E = rc.num_experts, K = rc.top_k, H = preset.hidden_size;
  std::printf("switchyard %s demo: %s backend%s%s\n", version(), gpu ? "CUDA" : "CPU", gpu ? " on " : "",
              gpu ? gpu_name.c_str() : (built_with_cuda() ? " (no usable GPU found)" : " (built without CUDA)"));
  std::printf("preset %s: T=%lld tokens, E=%d experts, K=%d, hidden %d, bf16 activations, tile 128\n",
              preset.name.c_str(), static_cast<long long>(T), E, K, H);

  std::mt19937_64 gen(2026);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> logits(T * E), bias(E);
  for (float& v : logits) v = normal(gen);
  for (float& v : bias) v = 0.01f * normal(gen);  // load-balancing bias: small next to the scores
  std::vector<std::uint16_t> x(T * H);
  for (auto& v : x) v = to_bf16(normal(gen));

  LayoutConfig lc;
  lc.num_experts = E;
  lc.tile_size = 128;
  const int L = lc.num_local();
  const std::int64_t R = max_permuted_rows(T, K, L, lc.tile_size);
  const std::int64_t N = max_tiles(T, K, L, lc.tile_size);
  std::vector<std::int32_t> ids(T * K), counts(L), offsets(L + 1), p2x(R), p2t(R), x2p(T * K), tile_expert(N),
      tile_end(N), totals(kNumTotals);
  std::vector<float> weights(T * K);
  std::vector<std::uint16_t> x_perm(R * H), out(T * H);

  const TensorView logits_v = run.view(logits.data(), DType::kFloat32, {T, E});
  const TensorView bias_v = preset.has_bias ? run.view(bias.data(), DType::kFloat32, {E}) : TensorView{};
  const TensorView ids_v = run.view(ids.data(), DType::kInt32, {T, K});
  const TensorView weights_v = run.view(weights.data(), DType::kFloat32, {T, K});
  const Layout layout{run.view(counts.data(), DType::kInt32, {L}),
                      run.view(offsets.data(), DType::kInt32, {L + 1}),
                      run.view(p2x.data(), DType::kInt32, {R}),
                      run.view(p2t.data(), DType::kInt32, {R}),
                      run.view(x2p.data(), DType::kInt32, {T, K}),
                      run.view(tile_expert.data(), DType::kInt32, {N}),
                      run.view(tile_end.data(), DType::kInt32, {N}),
                      run.view(totals.data(), DType::kInt32, {kNumTotals})};
  const TensorView x_v = run.view(x.data(), DType::kBFloat16, {T, H});
  const TensorView x_perm_v = run.view(x_perm.data(), DType::kBFloat16, {R, H});
  const TensorView out_v = run.view(out.data(), DType::kBFloat16, {T, H});
  std::size_t ws_bytes = 0;
  s = layout_workspace_size(lc, T, K, run.device, &ws_bytes);
  if (!s.ok()) return fail("layout_workspace_size", s);
  std::vector<unsigned char> ws_host(ws_bytes + 16);
  const TensorView ws_v = run.view(ws_host.data(), DType::kFloat8E4M3, {static_cast<std::int64_t>(ws_bytes + 16)});
  void* ws = ws_bytes ? ws_v.data : nullptr;

  // Each stage once to warm up, then once timed (wall clock around an eager call plus a sync:
  // a rough figure; the benchmarks time calls inside CUDA graphs).
  double t_route = 0, t_gather = 0, t_combine = 0;
  for (int pass = 0; pass < 2; ++pass) {
    double t0 = now_us();
    s = route_and_layout(rc, logits_v, bias_v, ids_v, weights_v, lc, layout, ws, ws_bytes);
    if (!s.ok()) return fail("route_and_layout", s);
    run.sync();
    double t1 = now_us();
    s = gather(x_v, TensorView{}, layout, x_perm_v, TensorView{}, /*zero_fill_padding=*/true);
    if (!s.ok()) return fail("gather", s);
    run.sync();
    double t2 = now_us();
    // Identity experts: y_perm = x_perm, so out[t] = x[t] * sum_k w[t,k].
    s = combine(x_perm_v, layout, weights_v, out_v);
    if (!s.ok()) return fail("combine", s);
    run.sync();
    double t3 = now_us();
    t_route = t1 - t0, t_gather = t2 - t1, t_combine = t3 - t2;
  }
  run.fetch(ids.data(), ids_v);
  run.fetch(weights.data(), weights_v);
  run.fetch(counts.data(), layout.counts);
  run.fetch(totals.data(), layout.totals);
  run.fetch(out.data(), out_v);

  const auto [min_it, max_it] = std::minmax_element(counts.begin(), counts.end());
  std::printf("route+layout %9.1f us | gather %9.1f us | combine %9.1f us  (one eager call each, wall clock)\n",
              t_route, t_gather, t_combine);
  std::printf("tokens per expert: min %d, mean %.1f, max %d; padded rows %d of capacity %lld; tiles %d; dropped %d\n",
              *min_it, static_cast<double>(T) * K / L, *max_it, totals[kPaddedTotal], static_cast<long long>(R),
              totals[kNumTiles], totals[kDropped]);

  // Check 1: out == x * sum_k w (identity experts), within bf16 rounding.
  double worst = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    float wsum = 0;
    for (int k = 0; k < K; ++k) wsum += weights[t * K + k];
    for (int h = 0; h < H; ++h) {
      const double want = static_cast<double>(from_bf16(x[t * H + h])) * wsum;
      const double got = from_bf16(out[t * H + h]);
      worst = std::max(worst, std::fabs(got - want) / (std::fabs(want) + 1e-3));
    }
  }
  // Check 2 (GPU runs): ids and weights equal the CPU oracle's.
  long id_mismatch = 0, w_mismatch = 0;
  if (gpu) {
    std::vector<std::int32_t> ref_ids(T * K);
    std::vector<float> ref_w(T * K);
    s = route(rc, TensorView::of(logits.data(), DType::kFloat32, {T, E}),
              preset.has_bias ? TensorView::of(bias.data(), DType::kFloat32, {E}) : TensorView{},
              TensorView::of(ref_ids.data(), DType::kInt32, {T, K}),
              TensorView::of(ref_w.data(), DType::kFloat32, {T, K}));
    if (!s.ok()) return fail("route (CPU oracle)", s);
    for (std::int64_t i = 0; i < T * K; ++i) {
      id_mismatch += ref_ids[i] != ids[i];
      w_mismatch += ref_w[i] != weights[i];
    }
  }
  const bool ok = worst < 1e-2 && id_mismatch == 0 && w_mismatch == 0;
  std::printf("check: combine(gather(x)) vs x*sum(w): worst relative error %.2e; %s\n", worst,
              gpu ? (id_mismatch == 0 && w_mismatch == 0 ? "GPU ids and weights equal the CPU oracle's"
                                                         : "GPU ids or weights DIFFER from the CPU oracle's")
                  : "CPU run, no oracle comparison");
  std::printf("%s\n", ok ? "demo: OK" : "demo: FAILED");
  return ok ? 0 : 1;
}
