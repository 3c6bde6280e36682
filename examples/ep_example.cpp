// Expert parallelism with the CPU reference group: 4 ranks (threads), 16 experts (4 per rank),
// top-2. Each rank dispatches its tokens straight into the expert-major layout of the ranks that
// own their experts, "runs" identity experts and combines; every token must come back as
// x * (sum of its weights).
#include <switchyard/switchyard.h>

#include <cmath>
#include <cstdio>
#include <vector>

using namespace switchyard;

int main() {
  ep::GroupConfig c;
  c.num_ranks = 4;
  c.num_experts = 16;
  c.top_k = 2;
  c.max_tokens = 3;
  c.hidden = 8;
  c.dtype = DType::kFloat32;
  c.tile_size = 4;
  std::unique_ptr<ep::CpuGroup> group;
  Status st = ep::CpuGroup::create(c, &group);
  if (!st.ok()) return std::printf("%s\n", st.to_string().c_str()), 1;

  const int R = c.num_ranks, K = c.top_k, L = c.experts_per_rank(), T = 3, H = 8;
  // Buffers of one rank, sized from the configuration alone (the same on every rank).
  const std::int64_t N = ep::max_recv_rows(c), P = ep::max_expert_rows(c);
  const std::int64_t tiles = max_tiles(N, K, L, c.tile_size);
  struct Rank {
    std::vector<float> x, w, out, recv_x, recv_w, expert_x;
    std::vector<int> ids, src_rank, src_token, recv_ids, counts, offsets, p2x, p2t, x2p, tile_expert, tile_end, totals;
    std::vector<std::int64_t> stats;
    ep::Handle handle;
  };
  std::vector<Rank> ranks(R);
  for (int r = 0; r < R; ++r) {
    Rank& b = ranks[r];
    b.x.resize(T * H);
    for (int i = 0; i < T * H; ++i) b.x[i] = static_cast<float>(r * 100 + i);
    b.ids = {(r * 5) % 16, (r * 5 + 7) % 16, 3, 4, 15, -1};  // token 2 has a single expert
    b.w = {0.75f, 0.25f, 0.5f, 0.5f, 1.0f, 0.0f};
    b.out.resize(T * H);
    b.recv_x.resize(N * H);
    b.recv_w.resize(N * K);
    b.expert_x.resize(P * H);
    b.src_rank.resize(N);
    b.src_token.resize(N);
    b.recv_ids.resize(N * K);
    b.counts.resize(L);
    b.offsets.resize(L + 1);
    b.p2x.resize(P);
    b.p2t.resize(P);
    b.x2p.resize(N * K);
    b.tile_expert.resize(tiles);
    b.tile_end.resize(tiles);
    b.totals.resize(kNumTotals);
    b.stats.resize(ep::kNumStats);
  }

  st = ep::run_ranks(R, [&](int r) {
    Rank& b = ranks[r];
    ep::DispatchInputs in;
    in.x = TensorView::of(b.x.data(), DType::kFloat32, {T, H});
    in.topk_ids = TensorView::of(b.ids.data(), DType::kInt32, {T, K});
    in.topk_weights = TensorView::of(b.w.data(), DType::kFloat32, {T, K});
    ep::DispatchOutputs out;
    out.x = TensorView::of(b.recv_x.data(), DType::kFloat32, {N, H});
    out.src_rank = TensorView::of(b.src_rank.data(), DType::kInt32, {N});
    out.src_token = TensorView::of(b.src_token.data(), DType::kInt32, {N});
    out.topk_ids = TensorView::of(b.recv_ids.data(), DType::kInt32, {N, K});
    out.topk_weights = TensorView::of(b.recv_w.data(), DType::kFloat32, {N, K});
    out.stats = TensorView::of(b.stats.data(), DType::kInt64, {ep::kNumStats});
    out.layout = Layout{TensorView::of(b.counts.data(), DType::kInt32, {L}),
                        TensorView::of(b.offsets.data(), DType::kInt32, {L + 1}),
                        TensorView::of(b.p2x.data(), DType::kInt32, {P}),
                        TensorView::of(b.p2t.data(), DType::kInt32, {P}),
                        TensorView::of(b.x2p.data(), DType::kInt32, {N, K}),
                        TensorView::of(b.tile_expert.data(), DType::kInt32, {tiles}),
                        TensorView::of(b.tile_end.data(), DType::kInt32, {tiles}),
                        TensorView::of(b.totals.data(), DType::kInt32, {kNumTotals})};
    out.expert_x = TensorView::of(b.expert_x.data(), DType::kFloat32, {P, H});
    SY_RETURN_IF_ERROR(group->dispatch(r, in, out, &b.handle));
    // Identity experts: y_perm = x_perm. A grouped GEMM would run over tiles here.
    ep::CombineInputs y;
    y.expert_major = true;
    y.y = out.expert_x;
    return group->combine(r, b.handle, y, TensorView::of(b.out.data(), DType::kFloat32, {T, H}));
  });
  if (!st.ok()) return std::printf("%s\n", st.to_string().c_str()), 1;

  int wrong = 0;
  for (int r = 0; r < R; ++r) {
    const Rank& b = ranks[r];
    std::printf("rank %d: received %lld rows, sent %lld, padded rows %d\n", r,
                static_cast<long long>(b.stats[ep::kRecvRows]), static_cast<long long>(b.stats[ep::kSentRows]),
                b.totals[kPaddedTotal]);
    for (int t = 0; t < T; ++t) {
      float wsum = 0.0f;
      for (int k = 0; k < K; ++k) wsum += b.ids[t * K + k] >= 0 ? b.w[t * K + k] : 0.0f;
      for (int h = 0; h < H; ++h) wrong += std::fabs(b.out[t * H + h] - b.x[t * H + h] * wsum) > 1e-4f;
    }
  }
  std::printf("%s\n", wrong == 0 ? "every token came back as x * sum(w)" : "MISMATCH");
  return wrong == 0 ? 0 : 1;
}
