// Route 4 tokens of a Mixtral-style layer, lay them out expert by expert, gather, "run"
// identity experts and combine. CPU backend; the same calls take CUDA tensors and a stream.
#include <switchyard/switchyard.h>

#include <cstdio>
#include <vector>

using namespace switchyard;

int main() {
  ModelPreset mixtral;
  if (!find_preset("mixtral-8x7b", &mixtral).ok()) return 1;
  const RoutingConfig& rc = mixtral.routing;  // E = 8, K = 2, softmax over the top 2
  const int T = 4, E = rc.num_experts, K = rc.top_k, H = 4;

  std::vector<float> logits(T * E), x(T * H);
  for (int i = 0; i < T * E; ++i) logits[i] = static_cast<float>((i * 7) % 11) - 5.0f;
  for (int i = 0; i < T * H; ++i) x[i] = 0.25f * static_cast<float>(i);
  std::vector<int> ids(T * K);
  std::vector<float> weights(T * K);

  // Layout buffers are sized from shapes alone, once, and reused.
  LayoutConfig lc;
  lc.num_experts = E;
  lc.tile_size = 2;
  const int L = lc.num_local();
  const int R = static_cast<int>(max_permuted_rows(T, K, L, lc.tile_size));
  const int N = static_cast<int>(max_tiles(T, K, L, lc.tile_size));
  std::vector<int> counts(L), offsets(L + 1), p2x(R), p2t(R), x2p(T * K), tile_expert(N), tile_end(N),
      totals(kNumTotals);
  Layout layout{TensorView::of(counts.data(), DType::kInt32, {L}),
                TensorView::of(offsets.data(), DType::kInt32, {L + 1}),
                TensorView::of(p2x.data(), DType::kInt32, {R}),
                TensorView::of(p2t.data(), DType::kInt32, {R}),
                TensorView::of(x2p.data(), DType::kInt32, {T, K}),
                TensorView::of(tile_expert.data(), DType::kInt32, {N}),
                TensorView::of(tile_end.data(), DType::kInt32, {N}),
                TensorView::of(totals.data(), DType::kInt32, {kNumTotals})};

  const TensorView ids_view = TensorView::of(ids.data(), DType::kInt32, {T, K});
  const TensorView weights_view = TensorView::of(weights.data(), DType::kFloat32, {T, K});
  Status s = route_and_layout(rc, TensorView::of(logits.data(), DType::kFloat32, {T, E}), TensorView{},
                              ids_view, weights_view, lc, layout, nullptr, 0);
  std::vector<float> x_perm(R * H), out(T * H);
  const TensorView x_perm_view = TensorView::of(x_perm.data(), DType::kFloat32, {R, H});
  if (s.ok()) {
    s = gather(TensorView::of(x.data(), DType::kFloat32, {T, H}), TensorView{}, layout, x_perm_view,
               TensorView{}, /*zero_fill_padding=*/true);
  }
  // ... a grouped GEMM would run here over x_perm, tile by tile (tile_expert, tile_row_end) ...
  if (s.ok()) s = combine(x_perm_view, layout, weights_view, TensorView::of(out.data(), DType::kFloat32, {T, H}));
  if (!s.ok()) {
    std::printf("error: %s\n", s.to_string().c_str());
    return 1;
  }
  std::printf("padded rows %d, tiles %d\n", totals[kPaddedTotal], totals[kNumTiles]);
  for (int t = 0; t < T; ++t) {
    std::printf("token %d -> experts %d (%.3f), %d (%.3f); out[0] %.3f == x[0] %.3f\n", t, ids[t * K],
                weights[t * K], ids[t * K + 1], weights[t * K + 1], out[t * H], x[t * H]);
  }
  return 0;
}
