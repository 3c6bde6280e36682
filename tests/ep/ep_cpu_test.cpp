// Expert parallelism on the CPU (ep.h, docs/design.md section 6): CpuGroup against a brute-force
// reference written here from the contract, not from src/cpu/ep.
//
//   dispatch, rank-major: for each destination rank, every (source rank, source token) that has
//     at least one pick in the destination's expert block, in (source rank, token) order, with
//     the ids rewritten to local ids and everything else copied byte for byte.
//   dispatch, expert-major: switchyard::layout() (E' = L, all local, tile M) of the received
//     rank-major ids and switchyard::gather() of the received rows, padding zero-filled; both
//     are verified by their own tests (test_layout_cpu, test_permute_cpu).
//   combine: from the source's point of view, partial of each destination rank (fp32 fmaf chain
//     over the picks in k order, or the rank-major row), summed in fp32 in rank order, cast.
//
// Every output buffer is poisoned before each call and carries kGuard extra rows past its
// stated size; outputs must match the expected image of the whole buffer, poison included.
// The 16-bit float conversions are written here, independently of src/common/numeric.h.
// Seeds: fresh each run, SY_TEST_SEED=<n> replays one.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

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
using switchyard::LayoutConfig;
using switchyard::LocalExperts;
using switchyard::Status;
using switchyard::StatusCode;
using switchyard::TensorView;
using sy_test::kPoisonByte;

// Rows (elements for 1-D arrays) past each output's stated size that must keep their poison.
constexpr std::int64_t kGuard = 3;

// ---- 16-bit floats (tests/common/float_formats.h, independent of the library) ----

using sy_test::f32_bits;
using sy_test::fp16_bits;
using sy_test::fp16_value;
using sy_test::load_as_float;

void store_from_float(DType dtype, void* base, std::int64_t i, float f) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(base)[i] = f;
      break;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(base)[i] = sy_test::bf16_bits(f);
      break;
    case DType::kFloat16:
      static_cast<std::uint16_t*>(base)[i] = fp16_bits(f);
      break;
    default:
      break;
  }
}

std::size_t esize(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kBFloat16:
    case DType::kFloat16:
      return 2;
    case DType::kFloat8E4M3:
      return 1;
    case DType::kInt64:
      return 8;
  }
  return 0;
}

const char* dname(DType d) { return switchyard::dtype_name(d); }

template <class T>
void poison(std::vector<T>* v) {
  if (!v->empty()) std::memset(v->data(), kPoisonByte, v->size() * sizeof(T));
}

template <class T>
std::vector<T> poisoned(std::size_t n) {
  std::vector<T> v(std::max<std::size_t>(n, 1));
  poison(&v);
  return v;
}

template <class T>
TensorView view_of(const std::vector<T>& v, DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView::of(v.data(), dtype, shape, Device::cpu());
}

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// True when the message names rank `rank` ("rank 2", "rank=2", "rank: 2", "Rank #2",
// "rank(s) 1, 2", "ranks 0 and 2").
bool names_rank(const std::string& message, int rank) {
  const std::string m = lower(message);
  for (std::size_t pos = m.find("rank"); pos != std::string::npos; pos = m.find("rank", pos + 1)) {
    std::size_t i = pos + 4;
    if (m.compare(i, 3, "(s)") == 0) i += 3;
    if (i < m.size() && m[i] == 's') ++i;
    // A list of numbers: "1", "1, 2", "0 and 2".
    while (i < m.size()) {
      while (i < m.size() && (m[i] == ' ' || m[i] == '=' || m[i] == ':' || m[i] == '#' || m[i] == ',')) ++i;
      if (m.compare(i, 4, "and ") == 0) i += 4;
      std::size_t j = i;
      while (j < m.size() && std::isdigit(static_cast<unsigned char>(m[j]))) ++j;
      if (j == i) break;
      if (std::stoi(m.substr(i, j - i)) == rank) return true;
      i = j;
    }
  }
  return false;
}

bool mentions_any(const std::string& message, const std::vector<std::string>& words) {
  for (const std::string& w : words)
    if (message.find(w) != std::string::npos) return true;
  return false;
}

// ---- cases and inputs ----

enum class Routing { kUniform, kOneExpert, kOneRank, kWithReplacement, kHeavyDrops };

const char* routing_name(Routing r) {
  switch (r) {
    case Routing::kUniform:
      return "uniform";
    case Routing::kOneExpert:
      return "one-expert";
    case Routing::kOneRank:
      return "one-rank";
    case Routing::kWithReplacement:
      return "with-replacement";
    case Routing::kHeavyDrops:
      return "heavy-drops";
  }
  return "?";
}

struct Case {
  int R = 1;
  int L = 1;
  int K = 1;
  std::int64_t max_tokens = 4;
  std::int64_t H = 8;
  DType dtype = DType::kBFloat16;
  std::int64_t scale_cols = 0;
  int M = 1;
  bool expert_major = false;
  bool ids64 = false;
  std::int64_t x_stride_extra = 0;
  Routing routing = Routing::kUniform;
  DType y_dtype = DType::kBFloat16;
  DType out_dtype = DType::kBFloat16;
  bool accumulate = false;
  std::int64_t y_stride_extra = 0;
  std::vector<std::int64_t> T;  // tokens per rank; empty: random, with 0 and max_tokens forced
  DType partial = DType::kFloat32;  // combine partial dtype
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "R=" << c.R << " L=" << c.L << " E=" << c.R * c.L << " K=" << c.K << " max_tokens=" << c.max_tokens
     << " H=" << c.H << " dtype=" << dname(c.dtype) << " scale_cols=" << c.scale_cols << " M=" << c.M
     << " expert_major=" << c.expert_major << " ids=" << (c.ids64 ? "int64" : "int32")
     << " x_stride=H+" << c.x_stride_extra << " routing=" << routing_name(c.routing)
     << " y=" << dname(c.y_dtype) << " out=" << dname(c.out_dtype) << " accumulate=" << c.accumulate
     << " y_stride=H+" << c.y_stride_extra;
  if (!c.T.empty()) {
    os << " T=[";
    for (std::size_t i = 0; i < c.T.size(); ++i) os << (i ? "," : "") << c.T[i];
    os << "]";
  }
  return os.str();
}

ep::GroupConfig make_config(const Case& c) {
  ep::GroupConfig cfg = sy_test::ep_group_config(c, 30.0);
  cfg.partial_dtype = c.partial;
  return cfg;
}

struct RankIn {
  std::int64_t T = 0;
  std::int64_t x_stride = 0;  // elements
  bool ids64 = false;
  std::vector<std::uint8_t> x;      // [T, x_stride] bytes of config.dtype
  std::vector<float> scales;        // [T, scale_cols]
  std::vector<std::int64_t> ids;    // [T, K] global ids, as int64 (the int32 copy below when !ids64)
  std::vector<std::int32_t> ids32;  // [T, K]
  std::vector<float> w;             // [T, K]

  ep::DispatchInputs view(const ep::GroupConfig& c) const {
    ep::DispatchInputs in;
    in.x = TensorView::of(x.data(), c.dtype, {T, c.hidden}, Device::cpu()).with_row_stride(x_stride);
    if (c.scale_cols > 0) in.scales = view_of(scales, DType::kFloat32, {T, c.scale_cols});
    in.topk_ids = ids64 ? view_of(ids, DType::kInt64, {T, c.top_k}) : view_of(ids32, DType::kInt32, {T, c.top_k});
    in.topk_weights = view_of(w, DType::kFloat32, {T, c.top_k});
    return in;
  }
  void sync_ids32() {
    ids32.assign(std::max<std::size_t>(ids.size(), 1), 0);
    for (std::size_t i = 0; i < ids.size(); ++i) ids32[i] = static_cast<std::int32_t>(ids[i]);
  }
};

// An id no rank owns (data to drop and count), never -1.
std::int64_t out_of_range_id(int E, bool ids64, std::mt19937_64& g) {
  switch (g() % (ids64 ? 6 : 4)) {
    case 0:
      return E;
    case 1:
      return E + 7;
    case 2:
      return -2;
    case 3:
      return std::numeric_limits<std::int32_t>::min();
    case 4:
      return (std::int64_t{1} << 32) + 1;  // truncated to int32 it would be expert 1
    default:
      return -(std::int64_t{1} << 40);
  }
}

void make_ids(const Case& c, int hot_expert, int hot_rank, std::mt19937_64& g, RankIn* in) {
  const int E = c.R * c.L, K = c.K;
  in->ids.assign(std::max<std::int64_t>(in->T * K, 1), -1);
  std::vector<int> pool;
  for (std::int64_t t = 0; t < in->T; ++t) {
    std::int64_t* row = in->ids.data() + t * K;
    std::set<int> used;
    auto draw_distinct = [&](int lo, int hi) {  // distinct id in [lo, hi) not used yet, or -1
      pool.clear();
      for (int e = lo; e < hi; ++e)
        if (!used.count(e)) pool.push_back(e);
      if (pool.empty()) return -1;
      const int e = pool[g() % pool.size()];
      used.insert(e);
      return e;
    };
    for (int k = 0; k < K; ++k) {
      switch (c.routing) {
        case Routing::kUniform:
        case Routing::kHeavyDrops:
          row[k] = draw_distinct(0, E);
          break;
        case Routing::kOneExpert:
          row[k] = k == 0 ? hot_expert : draw_distinct(0, E);
          if (k == 0) used.insert(hot_expert);
          break;
        case Routing::kOneRank: {
          int e = draw_distinct(hot_rank * c.L, (hot_rank + 1) * c.L);
          if (e < 0) e = draw_distinct(0, E);
          row[k] = e;
          break;
        }
        case Routing::kWithReplacement:
          row[k] = static_cast<std::int64_t>(g() % E);
          break;
      }
    }
    if (c.routing == Routing::kOneRank) std::shuffle(row, row + K, g);
    // Drops: a token sent nowhere now and then; single picks -1 or out of range.
    const int drop_den = c.routing == Routing::kHeavyDrops ? 2 : 10;
    const bool nowhere = t % 7 == 3;
    for (int k = 0; k < K; ++k) {
      if (nowhere || g() % drop_den == 0) row[k] = (g() % 3 == 0) ? out_of_range_id(E, c.ids64, g) : -1;
    }
  }
  in->sync_ids32();
}

std::vector<RankIn> make_inputs(const Case& c, const ep::GroupConfig& cfg, std::mt19937_64& g) {
  const std::size_t elem = esize(c.dtype);
  const int hot_expert = static_cast<int>(g() % (c.R * c.L));
  const int hot_rank = static_cast<int>(g() % c.R);
  std::vector<RankIn> in(c.R);
  for (int r = 0; r < c.R; ++r) {
    RankIn& ri = in[r];
    if (!c.T.empty()) {
      ri.T = c.T[r];
    } else if (r == c.R - 1) {
      ri.T = c.max_tokens;
    } else if (r == 0 && c.R > 1) {
      ri.T = 0;
    } else {
      ri.T = static_cast<std::int64_t>(g() % (c.max_tokens + 1));
    }
    ri.ids64 = c.ids64;
    ri.x_stride = c.H + c.x_stride_extra;
    // Random bytes (NaN and inf patterns included): rows travel as bytes, the stride gap never.
    ri.x.resize(std::max<std::int64_t>(ri.T * ri.x_stride, 1) * elem);
    for (std::uint8_t& b : ri.x) b = static_cast<std::uint8_t>(g());
    ri.scales.resize(std::max<std::int64_t>(ri.T * cfg.scale_cols, 1));
    std::uniform_real_distribution<float> u(0.001f, 10.0f);
    for (float& s : ri.scales) s = u(g);
    make_ids(c, hot_expert, hot_rank, g, &ri);
    ri.w = sy_test::random_normal(std::max<std::int64_t>(ri.T * c.K, 1), g());
  }
  return in;
}

// ---- outputs ----

struct RankOut {
  ep::GroupConfig cfg;
  bool expert_major = false;
  std::int64_t N = 0, P = 0, tiles = 0;
  std::vector<std::uint8_t> x;
  std::vector<float> scales;
  std::vector<std::int32_t> src_rank, src_token, ids;
  std::vector<float> w;
  std::vector<std::int64_t> stats;
  std::vector<std::int32_t> counts, offsets, p2e, p2t, e2p, tile_expert, tile_row_end, totals;
  std::vector<std::uint8_t> ex;
  std::vector<float> escales;

  RankOut() = default;
  RankOut(const ep::GroupConfig& c, bool em) : cfg(c), expert_major(em) {
    const int K = c.top_k, L = c.experts_per_rank(), M = c.tile_size;
    const std::int64_t H = c.hidden, cols = c.scale_cols;
    const std::size_t elem = esize(c.dtype);
    N = ep::max_recv_rows(c);
    x = poisoned<std::uint8_t>((N + kGuard) * H * elem);
    scales = poisoned<float>((N + kGuard) * cols);
    src_rank = poisoned<std::int32_t>(N + kGuard);
    src_token = poisoned<std::int32_t>(N + kGuard);
    ids = poisoned<std::int32_t>((N + kGuard) * K);
    w = poisoned<float>((N + kGuard) * K);
    stats = poisoned<std::int64_t>(ep::kNumStats + kGuard);
    if (em) {
      P = ep::max_expert_rows(c);
      tiles = switchyard::max_tiles(N, K, L, M);
      counts = poisoned<std::int32_t>(L + kGuard);
      offsets = poisoned<std::int32_t>(L + 1 + kGuard);
      p2e = poisoned<std::int32_t>(P + kGuard);
      p2t = poisoned<std::int32_t>(P + kGuard);
      e2p = poisoned<std::int32_t>((N + kGuard) * K);
      tile_expert = poisoned<std::int32_t>(tiles + kGuard);
      tile_row_end = poisoned<std::int32_t>(tiles + kGuard);
      totals = poisoned<std::int32_t>(switchyard::kNumTotals + kGuard);
      ex = poisoned<std::uint8_t>((P + kGuard) * H * elem);
      escales = poisoned<float>((P + kGuard) * cols);
    }
  }

  std::int64_t recv() const { return stats[ep::kRecvRows]; }

  // The layout arrays, expanded_to_permuted with `e2p_rows` rows.
  Layout layout_view(std::int64_t e2p_rows) const {
    const int L = cfg.experts_per_rank();
    Layout l;
    l.counts = view_of(counts, DType::kInt32, {L});
    l.offsets = view_of(offsets, DType::kInt32, {L + 1});
    l.permuted_to_expanded = view_of(p2e, DType::kInt32, {P});
    l.permuted_to_token = view_of(p2t, DType::kInt32, {P});
    l.expanded_to_permuted = view_of(e2p, DType::kInt32, {e2p_rows, cfg.top_k});
    l.tile_expert = view_of(tile_expert, DType::kInt32, {tiles});
    l.tile_row_end = view_of(tile_row_end, DType::kInt32, {tiles});
    l.totals = view_of(totals, DType::kInt32, {switchyard::kNumTotals});
    return l;
  }

  ep::DispatchOutputs view() const {
    const std::int64_t H = cfg.hidden, cols = cfg.scale_cols;
    const int K = cfg.top_k;
    ep::DispatchOutputs o;
    o.x = view_of(x, cfg.dtype, {N, H});
    if (cols > 0) o.scales = view_of(scales, DType::kFloat32, {N, cols});
    o.src_rank = view_of(src_rank, DType::kInt32, {N});
    o.src_token = view_of(src_token, DType::kInt32, {N});
    o.topk_ids = view_of(ids, DType::kInt32, {N, K});
    o.topk_weights = view_of(w, DType::kFloat32, {N, K});
    o.stats = view_of(stats, DType::kInt64, {ep::kNumStats});
    if (expert_major) {
      o.layout = layout_view(N);
      o.expert_x = view_of(ex, cfg.dtype, {P, H});
      if (cols > 0) o.expert_scales = view_of(escales, DType::kFloat32, {P, cols});
    }
    return o;
  }
};

template <class T>
std::string show(T v) {
  std::ostringstream os;
  if constexpr (std::is_same_v<T, float>) {
    os << v << " (bits 0x" << std::hex << f32_bits(v) << ")";
  } else if constexpr (std::is_same_v<T, std::uint8_t>) {
    os << "0x" << std::hex << static_cast<int>(v);
  } else {
    os << v;
  }
  return os.str();
}

// Compares whole buffers (guard rows included) and reports the first difference.
template <class T>
bool expect_same(const std::string& what, const std::vector<T>& got, const std::vector<T>& want,
                 std::int64_t row_elems) {
  if (got.size() != want.size()) {
    ADD_FAILURE() << what << ": test bug, sizes " << got.size() << " vs " << want.size();
    return false;
  }
  if (got.empty() || std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return true;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      const std::int64_t re = std::max<std::int64_t>(row_elems, 1);
      ADD_FAILURE() << what << ": first difference at element " << i << " (row " << static_cast<std::int64_t>(i) / re
                    << ", col " << static_cast<std::int64_t>(i) % re << "): got " << show(got[i]) << ", want "
                    << show(want[i]) << (std::memcmp(&want[i], &poisoned<T>(1)[0], sizeof(T)) == 0
                                             ? " (poison: must be untouched)"
                                             : "");
      return false;
    }
  }
  return false;
}

// ---- reference dispatch ----

struct RefDispatch {
  std::vector<std::vector<std::pair<int, std::int64_t>>> recv;  // per destination: (src rank, src token)
  std::vector<std::vector<std::vector<std::int64_t>>> row_of;    // [dest][src][token]: row, or -1
  std::vector<std::int64_t> sent, dropped;                       // per source rank
};

RefDispatch reference_dispatch(const ep::GroupConfig& cfg, const std::vector<RankIn>& in) {
  const int R = cfg.num_ranks, L = cfg.experts_per_rank(), K = cfg.top_k;
  const std::int64_t E = cfg.num_experts;
  RefDispatch ref;
  ref.recv.resize(R);
  ref.row_of.resize(R);
  ref.sent.assign(R, 0);
  ref.dropped.assign(R, 0);
  for (int r = 0; r < R; ++r) {
    ref.row_of[r].resize(R);
    for (int s = 0; s < R; ++s) {
      ref.row_of[r][s].assign(in[s].T, -1);
      for (std::int64_t t = 0; t < in[s].T; ++t) {
        bool here = false;
        for (int k = 0; k < K; ++k) {
          const std::int64_t id = in[s].ids[t * K + k];
          here = here || (id >= std::int64_t{r} * L && id < std::int64_t{r + 1} * L);
        }
        if (here) {
          ref.row_of[r][s][t] = static_cast<std::int64_t>(ref.recv[r].size());
          ref.recv[r].emplace_back(s, t);
        }
      }
    }
  }
  for (int s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < in[s].T; ++t) {
      std::set<std::int64_t> dests;
      for (int k = 0; k < K; ++k) {
        const std::int64_t id = in[s].ids[t * K + k];
        if (id >= 0 && id < E) dests.insert(id / L);
        if (id != -1 && (id < 0 || id >= E)) ++ref.dropped[s];
      }
      ref.sent[s] += static_cast<std::int64_t>(dests.size());
    }
  }
  return ref;
}

// The expected image of rank r's output buffers (poison wherever nothing may be written).
RankOut expected_outputs(const ep::GroupConfig& cfg, bool em, const std::vector<RankIn>& in,
                         const RefDispatch& ref, int r) {
  RankOut o(cfg, em);
  const int L = cfg.experts_per_rank(), K = cfg.top_k;
  const std::int64_t H = cfg.hidden, cols = cfg.scale_cols;
  const std::size_t elem = esize(cfg.dtype);
  const auto& rows = ref.recv[r];
  const std::int64_t Tp = static_cast<std::int64_t>(rows.size());
  for (std::int64_t i = 0; i < Tp; ++i) {
    const int s = rows[i].first;
    const std::int64_t t = rows[i].second;
    std::memcpy(o.x.data() + i * H * elem, in[s].x.data() + t * in[s].x_stride * elem, H * elem);
    if (cols > 0) std::memcpy(o.scales.data() + i * cols, in[s].scales.data() + t * cols, cols * sizeof(float));
    o.src_rank[i] = s;
    o.src_token[i] = static_cast<std::int32_t>(t);
    for (int k = 0; k < K; ++k) {
      const std::int64_t id = in[s].ids[t * K + k];
      const std::int64_t lo = std::int64_t{r} * L;
      o.ids[i * K + k] = (id >= lo && id < lo + L) ? static_cast<std::int32_t>(id - lo) : -1;
      o.w[i * K + k] = in[s].w[t * K + k];
    }
  }
  o.stats[ep::kRecvRows] = Tp;
  o.stats[ep::kSentRows] = ref.sent[r];
  o.stats[ep::kDropped] = ref.dropped[r];
  if (em) {
    LayoutConfig lc;
    lc.num_experts = L;
    lc.local = LocalExperts::all();
    lc.tile_size = cfg.tile_size;
    const Layout lay = o.layout_view(Tp);
    Status s = switchyard::layout(lc, view_of(o.ids, DType::kInt32, {Tp, K}), lay, nullptr, 0);
    EXPECT_TRUE(s.ok()) << "reference layout(): " << s.to_string();
    const TensorView xs = cols > 0 ? view_of(o.scales, DType::kFloat32, {Tp, cols}) : TensorView{};
    const TensorView exs = cols > 0 ? view_of(o.escales, DType::kFloat32, {o.P, cols}) : TensorView{};
    s = switchyard::gather(view_of(o.x, cfg.dtype, {Tp, H}), xs, lay, view_of(o.ex, cfg.dtype, {o.P, H}), exs,
                           /*zero_fill_padding=*/true);
    EXPECT_TRUE(s.ok()) << "reference gather(): " << s.to_string();
  }
  return o;
}

// Compares rank r's outputs with the expected image. `want.recv()` is the reference T'.
bool check_outputs(int r, const RankOut& got, const RankOut& want) {
  const std::string at = "rank " + std::to_string(r) + " ";
  const ep::GroupConfig& c = got.cfg;
  const std::int64_t H = c.hidden;
  const std::size_t elem = esize(c.dtype);
  bool ok = expect_same(at + "stats", got.stats, want.stats, 1);
  ok = expect_same(at + "src_rank", got.src_rank, want.src_rank, 1) && ok;
  ok = expect_same(at + "src_token", got.src_token, want.src_token, 1) && ok;
  ok = expect_same(at + "topk_ids", got.ids, want.ids, c.top_k) && ok;
  ok = expect_same(at + "topk_weights", got.w, want.w, c.top_k) && ok;
  ok = expect_same(at + "x (bytes)", got.x, want.x, H * static_cast<std::int64_t>(elem)) && ok;
  ok = expect_same(at + "scales", got.scales, want.scales, c.scale_cols) && ok;
  if (!got.expert_major) return ok;
  // The arrays equal layout() of the T' = stats[kRecvRows] received rows, entry for entry:
  // entries past that layout's capacity (max_permuted_rows(T', K, L, M) rows, max_tiles tiles,
  // T' rows of expanded_to_permuted) up to the capacity for T' = N stay untouched, as layout()
  // leaves them. (ep.h says "arrays sized for T' = N" and does not spell this out.)
  const int K = c.top_k;
  ok = expect_same(at + "layout.counts", got.counts, want.counts, 1) && ok;
  ok = expect_same(at + "layout.offsets", got.offsets, want.offsets, 1) && ok;
  ok = expect_same(at + "layout.totals", got.totals, want.totals, 1) && ok;
  ok = expect_same(at + "layout.permuted_to_expanded", got.p2e, want.p2e, 1) && ok;
  ok = expect_same(at + "layout.permuted_to_token", got.p2t, want.p2t, 1) && ok;
  ok = expect_same(at + "layout.expanded_to_permuted", got.e2p, want.e2p, K) && ok;
  ok = expect_same(at + "layout.tile_expert", got.tile_expert, want.tile_expert, 1) && ok;
  ok = expect_same(at + "layout.tile_row_end", got.tile_row_end, want.tile_row_end, 1) && ok;
  ok = expect_same(at + "expert_x (bytes)", got.ex, want.ex, H * static_cast<std::int64_t>(elem)) && ok;
  ok = expect_same(at + "expert_scales", got.escales, want.escales, c.scale_cols) && ok;
  return ok;
}

bool check_untouched(int r, const RankOut& got) {
  return check_outputs(r, got, RankOut(got.cfg, got.expert_major));
}

// ---- running the ranks ----

std::vector<Status> dispatch_views(ep::CpuGroup& group, const std::vector<ep::DispatchInputs>& in,
                                   const std::vector<ep::DispatchOutputs>& out, std::vector<ep::Handle>* handles,
                                   bool reuse = false) {
  const int R = static_cast<int>(in.size());
  std::vector<Status> st(R);
  ep::run_ranks(R, [&](int r) {
    st[r] = group.dispatch(r, in[r], out[r], &(*handles)[r], reuse);
    return st[r];
  });
  return st;
}

std::vector<Status> dispatch_all(ep::CpuGroup& group, const std::vector<RankIn>& in, std::vector<RankOut>* out,
                                 std::vector<ep::Handle>* handles, bool reuse = false) {
  std::vector<ep::DispatchInputs> iv;
  std::vector<ep::DispatchOutputs> ov;
  for (std::size_t r = 0; r < in.size(); ++r) {
    iv.push_back(in[r].view(group.config()));
    ov.push_back((*out)[r].view());
  }
  return dispatch_views(group, iv, ov, handles, reuse);
}

bool all_ok(const std::vector<Status>& st, const char* what) {
  bool ok = true;
  for (std::size_t r = 0; r < st.size(); ++r) {
    if (!st[r].ok()) {
      ADD_FAILURE() << what << " on rank " << r << ": " << st[r].to_string();
      ok = false;
    }
  }
  return ok;
}

// A dispatched group with its inputs, outputs and the reference outputs.
struct World {
  Case c;
  ep::GroupConfig cfg;
  std::unique_ptr<ep::CpuGroup> group;
  std::vector<RankIn> in;
  std::vector<RankOut> out, want;
  std::vector<ep::Handle> handles;
  RefDispatch ref;

  // Creates the group and the inputs; dispatches and checks when `dispatch`.
  bool setup(const Case& cs, std::uint64_t seed, bool dispatch = true) {
    c = cs;
    cfg = make_config(c);
    const Status s = ep::CpuGroup::create(cfg, &group);
    if (!s.ok() || !group) {
      ADD_FAILURE() << "create: " << s.to_string();
      return false;
    }
    std::mt19937_64 g(seed);
    in = make_inputs(c, cfg, g);
    ref = reference_dispatch(cfg, in);
    for (int r = 0; r < c.R; ++r) want.push_back(expected_outputs(cfg, c.expert_major, in, ref, r));
    fresh_outputs();
    handles.assign(c.R, ep::Handle());
    if (!dispatch) return true;
    if (!all_ok(dispatch_all(*group, in, &out, &handles), "dispatch")) return false;
    bool ok = true;
    for (int r = 0; r < c.R; ++r) {
      ok = check_outputs(r, out[r], want[r]) && ok;
      if (!handles[r].valid()) {
        ADD_FAILURE() << "rank " << r << ": handle not valid after dispatch";
        ok = false;
      }
    }
    return ok;
  }
  void fresh_outputs() {
    out.clear();
    for (int r = 0; r < c.R; ++r) out.emplace_back(cfg, c.expert_major);
  }
};

// ---- combine ----

struct RankY {
  DType dtype = DType::kBFloat16;
  std::int64_t rows = 0, stride = 0;
  std::vector<std::uint8_t> data;
  TensorView view(std::int64_t H) const {
    return TensorView::of(data.data(), dtype, {rows, H}, Device::cpu()).with_row_stride(stride);
  }
};

float random_value(DType dtype, std::mt19937_64& g) {
  std::normal_distribution<float> n(0.0f, 1.0f);
  float v = n(g);
  if (g() % 64 == 0) v *= 1e-6f;
  if (v == 0.0f) v = 0.5f;  // no signed zeros: "s = first partial" vs "0 + partial" would differ only there
  if (dtype == DType::kBFloat16) return sy_test::bf16_value(sy_test::bf16_bits(v));
  if (dtype == DType::kFloat16) return fp16_value(fp16_bits(v));
  return v;
}

// y of every rank: real rows random, everything combine must not read NaN (padding rows, rows
// past the layout or past the received rows, the stride gap).
std::vector<RankY> make_y(const World& w, bool expert_major, DType dtype, std::int64_t stride_extra,
                          std::mt19937_64& g) {
  const std::int64_t H = w.cfg.hidden;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<RankY> ys(w.c.R);
  for (int r = 0; r < w.c.R; ++r) {
    RankY& y = ys[r];
    y.dtype = dtype;
    y.rows = expert_major ? w.want[r].P : w.want[r].N;
    y.stride = H + stride_extra;
    y.data.assign(std::max<std::int64_t>(y.rows * y.stride, 1) * esize(dtype), 0);
    const std::int64_t Tp = w.want[r].recv();
    for (std::int64_t p = 0; p < y.rows; ++p) {
      bool real;
      if (expert_major) {
        const std::int32_t padded_total = w.want[r].totals[switchyard::kPaddedTotal];
        real = p < padded_total && w.want[r].p2t[p] >= 0 && w.want[r].p2t[p] < Tp;
      } else {
        real = p < Tp;
      }
      for (std::int64_t h = 0; h < y.stride; ++h)
        store_from_float(dtype, y.data.data(), p * y.stride + h, real && h < H ? random_value(dtype, g) : nan);
    }
  }
  return ys;
}

struct Outs {
  DType dtype = DType::kBFloat16;
  std::vector<std::vector<std::uint8_t>> data;  // per rank: (T + kGuard) * H elements
};

// Initial out buffers: random values (accumulate) or poison.
Outs make_outs(const World& w, DType dtype, bool accumulate, std::mt19937_64& g) {
  Outs o;
  o.dtype = dtype;
  const std::int64_t H = w.cfg.hidden;
  for (int r = 0; r < w.c.R; ++r) {
    const std::int64_t n = (w.in[r].T + kGuard) * H;
    std::vector<std::uint8_t> b(n * esize(dtype));
    poison(&b);
    if (accumulate)
      for (std::int64_t i = 0; i < w.in[r].T * H; ++i) store_from_float(dtype, b.data(), i, random_value(dtype, g));
    o.data.push_back(std::move(b));
  }
  return o;
}

// The training extras of a combine (docs/design.md section 7): unweighted sums, and per-pick
// values sent back (values[r] empty: rank r passes none; values_out[r] empty: it asks for none).
struct Extras {
  bool weighted = true;
  std::vector<std::vector<float>> values;      // [R] of [N,K]
  std::vector<std::vector<float>> values_out;  // [R] of [(T + kGuard), K], poisoned
};

// Random values for every rank but `silent` (which passes none), and poisoned outputs.
Extras make_extras(const World& w, bool weighted, int silent, std::mt19937_64& g) {
  Extras x;
  x.weighted = weighted;
  const int K = w.cfg.top_k;
  for (int r = 0; r < w.c.R; ++r) {
    std::vector<float> v;
    if (r != silent) {
      v.resize(static_cast<std::size_t>(w.want[r].N * K));
      for (float& f : v) f = random_value(DType::kFloat32, g);
    }
    x.values.push_back(std::move(v));
    x.values_out.push_back(poisoned<float>(static_cast<std::size_t>((w.in[r].T + kGuard) * K)));
  }
  return x;
}

std::vector<Status> combine_all(World& w, const std::vector<ep::Handle>& handles, const std::vector<RankY>& ys,
                                bool expert_major, Outs* outs, bool accumulate, Extras* extras = nullptr) {
  const std::int64_t H = w.cfg.hidden;
  const std::int64_t K = w.cfg.top_k;
  std::vector<Status> st(w.c.R);
  ep::run_ranks(w.c.R, [&](int r) {
    ep::CombineInputs ci;
    ci.expert_major = expert_major;
    ci.y = ys[r].view(H);
    if (extras != nullptr) {
      ci.weighted = extras->weighted;
      if (!extras->values[r].empty()) ci.pick_values = view_of(extras->values[r], DType::kFloat32, {w.want[r].N, K});
      ci.pick_values_out = view_of(extras->values_out[r], DType::kFloat32, {w.in[r].T, K});
    }
    const TensorView ov = TensorView::of(outs->data[r].data(), outs->dtype, {w.in[r].T, H}, Device::cpu());
    st[r] = w.group->combine(r, handles[r], ci, ov, accumulate);
    return st[r];
  });
  return st;
}

// The reference, from each source token's point of view.
Outs reference_combine(const World& w, const std::vector<RankY>& ys, bool expert_major, const Outs& initial,
                       bool accumulate, bool weighted = true) {
  const int R = w.c.R, K = w.cfg.top_k;
  const std::int64_t H = w.cfg.hidden;
  Outs o = initial;
  for (int s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < w.in[s].T; ++t) {
      for (std::int64_t h = 0; h < H; ++h) {
        bool have = false;
        float sum = 0.0f;
        for (int r = 0; r < R; ++r) {
          const std::int64_t row = w.ref.row_of[r][s][t];
          if (row < 0) continue;
          const RankOut& d = w.want[r];
          const RankY& y = ys[r];
          float partial;
          if (expert_major) {
            partial = 0.0f;
            for (int k = 0; k < K; ++k) {
              if (d.ids[row * K + k] < 0) continue;
              const std::int64_t p = d.e2p[row * K + k];
              const float wk = weighted ? d.w[row * K + k] : 1.0f;
              partial = std::fmaf(wk, load_as_float(y.dtype, y.data.data(), p * y.stride + h), partial);
            }
          } else {
            partial = load_as_float(y.dtype, y.data.data(), row * y.stride + h);
          }
          if (w.cfg.partial_dtype == DType::kBFloat16) {  // each rank's partial travels as bf16
            partial = sy_test::bf16_value(sy_test::bf16_bits(partial));
          }
          sum = have ? sum + partial : partial;
          have = true;
        }
        if (!have) sum = 0.0f;
        const float v = accumulate ? sum + load_as_float(o.dtype, initial.data[s].data(), t * H + h) : sum;
        store_from_float(o.dtype, o.data[s].data(), t * H + h, v);
      }
    }
  }
  return o;
}

bool check_combine(const World& w, const Outs& got, const Outs& want, const std::string& what) {
  bool ok = true;
  const std::int64_t H = w.cfg.hidden;
  const std::size_t elem = esize(got.dtype);
  for (int r = 0; r < w.c.R; ++r) {
    const auto& a = got.data[r];
    const auto& b = want.data[r];
    if (a == b) continue;
    ok = false;
    for (std::size_t i = 0; i < a.size() / elem; ++i) {
      if (std::memcmp(a.data() + i * elem, b.data() + i * elem, elem) != 0) {
        const std::int64_t t = static_cast<std::int64_t>(i) / H, h = static_cast<std::int64_t>(i) % H;
        std::ostringstream os;
        os << what << ": rank " << r << " out[" << t << "," << h << "]"
           << (t >= w.in[r].T ? " (guard row past T: must be untouched)" : "") << ": got "
           << load_as_float(got.dtype, a.data(), i) << ", want " << load_as_float(got.dtype, b.data(), i)
           << " (dtype " << dname(got.dtype) << "); token sent to ranks";
        for (int d = 0; d < w.c.R; ++d)
          if (t < w.in[r].T && w.ref.row_of[d][r][t] >= 0) os << " " << d << "(row " << w.ref.row_of[d][r][t] << ")";
        ADD_FAILURE() << os.str();
        break;
      }
    }
  }
  return ok;
}

// The pick values each source token gets back: per k, the sum over the ranks it went to in rank
// order (a rank without values adds 0), 0 when sent nowhere; guard rows untouched.
bool check_values(const World& w, const Extras& x, const std::string& what) {
  const int K = w.cfg.top_k;
  const std::vector<float> poison_row = poisoned<float>(static_cast<std::size_t>(K));
  for (int s = 0; s < w.c.R; ++s) {
    const std::vector<float>& got = x.values_out[s];
    for (std::int64_t t = 0; t < w.in[s].T + kGuard; ++t) {
      for (int k = 0; k < K; ++k) {
        float want = 0.0f;
        if (t >= w.in[s].T) {
          want = poison_row[static_cast<std::size_t>(k)];
        } else {
          bool have = false;
          for (int r = 0; r < w.c.R; ++r) {
            const std::int64_t row = w.ref.row_of[r][s][t];
            if (row < 0) continue;
            const float v = x.values[r].empty() ? 0.0f : x.values[r][static_cast<std::size_t>(row * K + k)];
            want = have ? want + v : v;
            have = true;
          }
        }
        const float g = got[static_cast<std::size_t>(t * K + k)];
        if (std::memcmp(&g, &want, sizeof g) != 0) {
          ADD_FAILURE() << what << ": rank " << s << " pick_values_out[" << t << "," << k << "]: got " << g
                        << ", want " << want << (t >= w.in[s].T ? " (guard row past T: must be untouched)" : "");
          return false;
        }
      }
    }
  }
  return true;
}

// Runs one combine of every rank and checks it against the reference; with extras_seed >= 0 the
// combine also sends pick values back (one rank passing none) and, expert-major, is unweighted.
bool run_and_check_combine(World& w, bool expert_major, DType y_dtype, DType out_dtype, bool accumulate,
                           std::int64_t y_stride_extra, std::mt19937_64& g, bool extras = false) {
  const std::string what = std::string("combine ") + (expert_major ? "expert-major" : "rank-major") +
                           " y=" + dname(y_dtype) + " out=" + dname(out_dtype) +
                           " accumulate=" + std::to_string(accumulate) + (extras ? " unweighted, pick values" : "");
  SCOPED_TRACE(what);
  const std::vector<RankY> ys = make_y(w, expert_major, y_dtype, y_stride_extra, g);
  const Outs initial = make_outs(w, out_dtype, accumulate, g);
  Outs got = initial;
  Extras x;
  if (extras) x = make_extras(w, /*weighted=*/false, static_cast<int>(g() % w.c.R), g);
  if (!all_ok(combine_all(w, w.handles, ys, expert_major, &got, accumulate, extras ? &x : nullptr), "combine")) {
    return false;
  }
  const bool rows_ok =
      check_combine(w, got, reference_combine(w, ys, expert_major, initial, accumulate, !extras), what);
  return (!extras || check_values(w, x, what)) && rows_ok;
}

// One full case: dispatch, checks, rank-major combine, and expert-major combine when the
// dispatch was expert-major.
void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " case_seed " + std::to_string(seed));
  World w;
  if (!w.setup(c, seed)) return;
  std::mt19937_64 g(seed ^ 0x9e3779b97f4a7c15ull);
  run_and_check_combine(w, false, c.y_dtype, c.out_dtype, c.accumulate, c.y_stride_extra, g);
  if (c.expert_major) run_and_check_combine(w, true, c.y_dtype, c.out_dtype, c.accumulate, c.y_stride_extra, g);
  // The backward pass's combine (docs/design.md section 7): unweighted, with pick values.
  run_and_check_combine(w, c.expert_major, c.y_dtype, c.out_dtype, c.accumulate, c.y_stride_extra, g,
                        /*extras=*/true);
}

constexpr DType kRowDtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3};
constexpr DType kFloatDtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
constexpr Routing kRoutings[] = {Routing::kUniform, Routing::kOneExpert, Routing::kOneRank, Routing::kWithReplacement,
                                 Routing::kHeavyDrops};

// Fills the per-index knobs of a sweep case.
void vary(Case* c, int i) {
  static const std::int64_t hiddens[] = {8, 13, 1, 40, 300};
  c->H = hiddens[i % 5];
  c->dtype = kRowDtypes[i % 4];
  if (c->dtype == DType::kFloat8E4M3) {
    const int mode = (i / 4) % 3;
    c->scale_cols = mode == 0 ? 0 : mode == 1 ? 1 : (c->H + 127) / 128;
  }
  c->routing = kRoutings[(i + i / 5) % 5];
  c->ids64 = i % 2 == 1;
  c->x_stride_extra = i % 3 == 1 ? 5 : 0;
  c->y_dtype = kFloatDtypes[i % 3];
  c->out_dtype = kFloatDtypes[(i / 3) % 3];
  c->accumulate = (i / 2) % 2 == 1;
  c->y_stride_extra = i % 4 == 2 ? 3 : 0;
}

// ================================ tests ================================

TEST(EpCpuConfig, SizesFollowTheHeader) {
  ep::GroupConfig c;
  c.num_ranks = 3;
  c.num_experts = 12;
  c.top_k = 5;
  c.max_tokens = 17;
  c.hidden = 8;
  c.tile_size = 7;
  ASSERT_TRUE(ep::validate(c).ok()) << ep::validate(c).to_string();
  EXPECT_EQ(c.experts_per_rank(), 4);
  EXPECT_EQ(ep::max_recv_rows(c), 3 * 17);
  EXPECT_EQ(ep::max_expert_rows(c), switchyard::max_permuted_rows(3 * 17, 5, 4, 7));
}

TEST(EpCpuConfig, InvalidFieldsAreNamed) {
  ep::GroupConfig base;
  base.num_ranks = 4;
  base.num_experts = 8;
  base.top_k = 2;
  base.max_tokens = 16;
  base.hidden = 300;
  base.dtype = DType::kFloat8E4M3;
  base.scale_cols = 3;
  base.tile_size = 4;
  base.timeout_seconds = 1.0;
  {
    std::unique_ptr<ep::CpuGroup> g;
    ASSERT_TRUE(ep::validate(base).ok()) << ep::validate(base).to_string();
    ASSERT_TRUE(ep::CpuGroup::create(base, &g).ok());
    ep::GroupConfig one = base;
    one.scale_cols = 1;
    EXPECT_TRUE(ep::validate(one).ok()) << ep::validate(one).to_string();
    one.scale_cols = 0;
    EXPECT_TRUE(ep::validate(one).ok()) << ep::validate(one).to_string();
  }
  struct Bad {
    const char* field;
    std::function<void(ep::GroupConfig*)> edit;
  };
  const std::vector<Bad> bads = {
      {"num_ranks", [](ep::GroupConfig* c) { c->num_ranks = 0; }},
      {"num_ranks", [](ep::GroupConfig* c) { c->num_ranks = -2; }},
      {"num_experts", [](ep::GroupConfig* c) { c->num_experts = 10; }},  // not a multiple of R = 4
      {"num_experts", [](ep::GroupConfig* c) { c->num_experts = 0; }},
      {"top_k", [](ep::GroupConfig* c) { c->top_k = 9; }},  // K > E
      {"top_k", [](ep::GroupConfig* c) { c->top_k = 0; }},
      {"max_tokens", [](ep::GroupConfig* c) { c->max_tokens = 0; }},
      {"hidden", [](ep::GroupConfig* c) { c->hidden = 0; }},
      {"hidden", [](ep::GroupConfig* c) { c->hidden = -1; }},
      {"dtype", [](ep::GroupConfig* c) { c->dtype = DType::kInt32; }},
      {"partial_dtype", [](ep::GroupConfig* c) { c->partial_dtype = DType::kFloat16; }},
      {"scale_cols", [](ep::GroupConfig* c) { c->scale_cols = 2; }},  // neither 1 nor ceil(300/128) = 3
      {"scale_cols", [](ep::GroupConfig* c) { c->scale_cols = -1; }},
      {"scale_cols",
       [](ep::GroupConfig* c) {
         c->dtype = DType::kBFloat16;
         c->scale_cols = 1;
       }},
      {"scale_cols",
       [](ep::GroupConfig* c) {
         c->dtype = DType::kFloat32;
         c->scale_cols = 3;
       }},
      {"tile_size", [](ep::GroupConfig* c) { c->tile_size = 0; }},
      {"timeout_seconds", [](ep::GroupConfig* c) { c->timeout_seconds = 0.0; }},
      {"timeout_seconds", [](ep::GroupConfig* c) { c->timeout_seconds = -1.0; }},
      {"timeout_seconds", [](ep::GroupConfig* c) { c->timeout_seconds = std::numeric_limits<double>::quiet_NaN(); }},
  };
  for (std::size_t i = 0; i < bads.size(); ++i) {
    ep::GroupConfig c = base;
    bads[i].edit(&c);
    SCOPED_TRACE("bad config #" + std::to_string(i) + " (" + bads[i].field + ")");
    const Status v = ep::validate(c);
    EXPECT_EQ(v.code(), StatusCode::kInvalidArgument) << v.to_string();
    EXPECT_NE(v.message().find(bads[i].field), std::string::npos) << v.to_string();
    std::unique_ptr<ep::CpuGroup> g;
    const Status s = ep::CpuGroup::create(c, &g);
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.to_string();
    EXPECT_NE(s.message().find(bads[i].field), std::string::npos) << s.to_string();
  }
}

// Test 1: rank-major dispatch over R, L, K, dtypes, scales, routings, drops; rank-major combine.
TEST(EpCpuDispatch, RankMajorSweep) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  int i = 0;
  for (const int R : {1, 2, 3, 4, 8}) {
    for (const int L : {1, 3, 4}) {
      for (const int K : {1, 2, 8}) {
        if (K > R * L) continue;
        Case c;
        c.R = R;
        c.L = L;
        c.K = K;
        c.max_tokens = (i % 3 == 0) ? 1 : (i % 3 == 1 ? 5 : 17);
        vary(&c, i);
        run_case(c, g());
        if (::testing::Test::HasFailure()) return;  // one failing case is enough to read
        ++i;
      }
    }
  }
}

// Hand-picked routings: everything to one expert of the last rank, every pick of every token on
// rank 1, a token whose K picks all land on one rank (sent once), and T = 0 everywhere.
TEST(EpCpuDispatch, SkewedAndEdgeRoutings) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const Routing routing : {Routing::kOneExpert, Routing::kOneRank, Routing::kHeavyDrops}) {
    Case c;
    c.R = 4;
    c.L = 8;
    c.K = 8;
    c.max_tokens = 33;
    c.H = 16;
    c.routing = routing;
    c.T = {33, 0, 7, 33};
    c.expert_major = routing != Routing::kHeavyDrops;
    c.M = 7;
    run_case(c, g());
  }
  Case empty;
  empty.R = 3;
  empty.L = 2;
  empty.K = 2;
  empty.max_tokens = 6;
  empty.T = {0, 0, 0};
  empty.expert_major = true;
  empty.M = 128;
  run_case(empty, g());

  // Deterministic hand-made ids, R = 3, L = 2 (rank 0: 0-1, rank 1: 2-3, rank 2: 4-5), K = 3.
  Case h;
  h.R = 3;
  h.L = 2;
  h.K = 3;
  h.max_tokens = 4;
  h.H = 4;
  h.dtype = DType::kFloat32;
  h.expert_major = true;
  h.M = 2;
  h.T = {4, 2, 0};
  World w;
  ASSERT_TRUE(w.setup(h, g(), /*dispatch=*/false));
  w.in[0].ids = {2, 3, 2,    // all on rank 1 (expert 2 twice): sent once
                 -1, 6, -7,  // sent nowhere; 2 dropped
                 5, 0, -1,   // ranks 0 and 2
                 1, 0, 4};   // ranks 0 and 2
  w.in[1].ids = {4, 5, 3, -1, -1, -1};
  for (RankIn& ri : w.in) ri.sync_ids32();
  w.ref = reference_dispatch(w.cfg, w.in);
  ASSERT_EQ(w.ref.sent[0], 1 + 0 + 2 + 2);
  ASSERT_EQ(w.ref.dropped[0], 2);
  ASSERT_EQ(w.ref.recv[1].size(), 2u);  // (0,0) and (1,0)
  w.want.clear();
  for (int r = 0; r < 3; ++r) w.want.push_back(expected_outputs(w.cfg, true, w.in, w.ref, r));
  EXPECT_EQ(w.want[1].ids[0 * 3 + 0], 0);
  EXPECT_EQ(w.want[1].ids[0 * 3 + 1], 1);
  EXPECT_EQ(w.want[1].ids[0 * 3 + 2], 0);
  ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles), "dispatch"));
  for (int r = 0; r < 3; ++r) check_outputs(r, w.out[r], w.want[r]);
  run_and_check_combine(w, true, DType::kFloat32, DType::kFloat32, false, 0, g);
  run_and_check_combine(w, false, DType::kFloat32, DType::kFloat32, true, 0, g);
}

// Test 2 and 3: expert-major dispatch for M in {1, 7, 128} and both combines.
TEST(EpCpuDispatch, ExpertMajorSweep) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  int i = 0;
  for (const int R : {1, 2, 3, 4, 8}) {
    for (const int M : {1, 7, 128}) {
      Case c;
      c.R = R;
      c.L = (i % 3 == 0) ? 1 : (i % 3 == 1 ? 2 : 5);
      c.K = std::min(R * c.L, (i % 3 == 2) ? 8 : (i % 2 == 0 ? 2 : 1));
      c.M = M;
      c.max_tokens = (i % 2 == 0) ? 9 : 16;
      c.expert_major = true;
      vary(&c, i + 1);
      run_case(c, g());
      if (::testing::Test::HasFailure()) return;
      ++i;
    }
  }
}

// Test 3: every y dtype x out dtype x accumulate on one expert-major dispatch, bit for bit.
TEST(EpCpuCombine, AllDtypesBitExact) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  const Case c = sy_test::ep_expert_major_case<Case>(3, 3, 4, 21, 24, 7);
  World w;
  ASSERT_TRUE(w.setup(c, g()));
  for (const DType y : kFloatDtypes) {
    for (const DType o : kFloatDtypes) {
      for (const bool acc : {false, true}) {
        run_and_check_combine(w, true, y, o, acc, acc ? 2 : 0, g);
        run_and_check_combine(w, false, y, o, acc, 0, g);
      }
    }
  }
}

// bf16 partials: each rank's fp32 partial is rounded to bf16 before the source sums them.
TEST(EpCpuCombine, Bf16PartialsRoundEachRank) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  Case c = sy_test::ep_expert_major_case<Case>(4, 2, 3, 17, 20, 3);
  c.partial = DType::kBFloat16;
  World w;
  ASSERT_TRUE(w.setup(c, g()));
  ASSERT_EQ(w.cfg.partial_dtype, DType::kBFloat16);
  for (const DType o : kFloatDtypes) {
    run_and_check_combine(w, true, DType::kFloat32, o, false, 0, g);
    run_and_check_combine(w, false, DType::kFloat32, o, true, 1, g);
  }
}

// With R = 1, expert-major combine is combine() of permute.h bit for bit, on the layout of the
// rank's own ids (E experts, all local) and its weights: received rows keep token order, so the
// permuted rows are the same even when some tokens are sent nowhere.
TEST(EpCpuCombine, OneRankEqualsPermuteCombine) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const int M : {1, 7, 128}) {
    for (const DType dt : kFloatDtypes) {
      SCOPED_TRACE("M=" + std::to_string(M) + " dtype=" + dname(dt));
      Case c;
      c.R = 1;
      c.L = 16;
      c.K = 4;
      c.M = M;
      c.max_tokens = 40;
      c.H = 12;
      c.expert_major = true;
      World w;
      ASSERT_TRUE(w.setup(c, g()));
      const std::int64_t T = w.in[0].T, H = c.H;
      // The permute.h layout of the original ids, same capacity as the dispatch's.
      RankOut lay(w.cfg, true);
      LayoutConfig lc;
      lc.num_experts = c.L;
      lc.tile_size = M;
      const TensorView ids = c.ids64 ? view_of(w.in[0].ids, DType::kInt64, {T, c.K})
                                     : view_of(w.in[0].ids32, DType::kInt32, {T, c.K});
      ASSERT_TRUE(switchyard::layout(lc, ids, lay.layout_view(T), nullptr, 0).ok());
      EXPECT_EQ(lay.totals[switchyard::kPaddedTotal], w.out[0].totals[switchyard::kPaddedTotal]);
      const std::vector<RankY> ys = make_y(w, true, dt, 0, g);
      for (const bool acc : {false, true}) {
        const Outs initial = make_outs(w, dt, acc, g);
        Outs got = initial, want = initial;
        ASSERT_TRUE(all_ok(combine_all(w, w.handles, ys, true, &got, acc), "combine"));
        const Status s = switchyard::combine(
            ys[0].view(H), lay.layout_view(T), view_of(w.in[0].w, DType::kFloat32, {T, c.K}),
            TensorView::of(want.data[0].data(), dt, {T, H}, Device::cpu()), acc);
        ASSERT_TRUE(s.ok()) << s.to_string();
        check_combine(w, got, want, "R=1 vs permute combine, accumulate=" + std::to_string(acc));
      }
    }
  }
}

// Test 5: reuse of the handle. ep.h: with `reuse` the handle must come from a dispatch of the
// same routing (same topk_ids on every rank, checked); the outputs are those of a plain
// dispatch and *handle then describes this dispatch (its weights).
TEST(EpCpuHandle, ReuseSameRoutingAndRejectChangedRouting) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const bool em : {false, true}) {
    SCOPED_TRACE(em ? "expert-major" : "rank-major");
    Case c;
    c.R = 3;
    c.L = 2;
    c.K = 3;
    c.M = 4;
    c.max_tokens = 10;
    c.H = 6;
    c.expert_major = em;
    c.T = {10, 3, 7};
    World w;
    ASSERT_TRUE(w.setup(c, g()));
    const std::vector<RankOut> first = w.out;

    // Same routing, same rows: identical outputs, a valid handle.
    w.fresh_outputs();
    ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles, /*reuse=*/true), "reuse dispatch"));
    for (int r = 0; r < c.R; ++r) {
      check_outputs(r, w.out[r], first[r]);
      EXPECT_TRUE(w.handles[r].valid()) << "rank " << r;
    }
    run_and_check_combine(w, em, DType::kFloat32, DType::kFloat32, false, 0, g);
    // Same routing, new rows and new weights (a backward pass): they travel, and combine uses
    // the new weights.
    for (RankIn& ri : w.in) {
      for (std::uint8_t& b : ri.x) b = static_cast<std::uint8_t>(g());
      ri.w = sy_test::random_normal(ri.w.size(), g());
    }
    w.want.clear();
    for (int r = 0; r < c.R; ++r) w.want.push_back(expected_outputs(w.cfg, em, w.in, w.ref, r));
    w.fresh_outputs();
    ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles, true), "reuse dispatch, new x and w"));
    for (int r = 0; r < c.R; ++r) check_outputs(r, w.out[r], w.want[r]);
    run_and_check_combine(w, em, DType::kBFloat16, DType::kFloat32, false, 0, g);

    std::vector<const ep::Handle::Plan*> plans;
    for (const ep::Handle& h : w.handles) plans.push_back(h.plan.get());
    // A changed id on one rank: every rank refuses, nothing written, handles unchanged.
    for (const int bad : {0, 2}) {
      SCOPED_TRACE("changed ids on rank " + std::to_string(bad));
      std::vector<RankIn> changed = w.in;
      changed[bad].ids[1] = (changed[bad].ids[1] + 1) % (c.R * c.L);
      changed[bad].sync_ids32();
      w.fresh_outputs();
      const std::vector<Status> st = dispatch_all(*w.group, changed, &w.out, &w.handles, true);
      for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r].to_string();
        EXPECT_TRUE(names_rank(st[r].message(), bad)) << st[r].to_string();
        check_untouched(r, w.out[r]);
        EXPECT_EQ(w.handles[r].plan.get(), plans[r]) << "rank " << r << ": refused dispatch replaced the handle";
      }
    }
    // A changed token count on rank 1 (same ids prefix): refused too.
    {
      std::vector<RankIn> changed = w.in;
      changed[1].T -= 1;
      w.fresh_outputs();
      const std::vector<Status> st = dispatch_all(*w.group, changed, &w.out, &w.handles, true);
      for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r].to_string();
        check_untouched(r, w.out[r]);
      }
    }
    // The group still works.
    EXPECT_EQ(w.group->broken_reason(), "");
    w.fresh_outputs();
    ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles, true), "reuse dispatch after refusal"));
    for (int r = 0; r < c.R; ++r) check_outputs(r, w.out[r], w.want[r]);
  }
}

// ep.h: ranks found in different collective calls break the group with InvalidArgument.
TEST(EpCpuFaults, RanksInDifferentCallsBreakTheGroup) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  Case c;
  c.R = 2;
  c.L = 2;
  c.K = 2;
  c.max_tokens = 5;
  c.H = 8;
  World w;
  ASSERT_TRUE(w.setup(c, g()));
  w.fresh_outputs();
  const std::vector<RankY> ys = make_y(w, false, DType::kFloat32, 0, g);
  Outs outs = make_outs(w, DType::kFloat32, false, g);
  std::vector<Status> st(c.R);
  ep::run_ranks(c.R, [&](int r) {
    if (r == 0) {
      st[r] = w.group->dispatch(r, w.in[r].view(w.cfg), w.out[r].view(), &w.handles[r]);
    } else {
      ep::CombineInputs ci;
      ci.expert_major = false;
      ci.y = ys[r].view(c.H);
      st[r] = w.group->combine(r, w.handles[r], ci,
                               TensorView::of(outs.data[r].data(), DType::kFloat32, {w.in[r].T, c.H}, Device::cpu()));
    }
    return st[r];
  });
  for (int r = 0; r < c.R; ++r)
    EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r].to_string();
  EXPECT_NE(w.group->broken_reason(), "");
  const std::vector<Status> again = dispatch_all(*w.group, w.in, &w.out, &w.handles);
  for (int r = 0; r < c.R; ++r) EXPECT_FALSE(again[r].ok()) << "rank " << r << " accepted a call on a broken group";
}

// Test 6: a bad argument on one rank fails every rank, names the rank, writes nothing.
TEST(EpCpuErrors, BadArgumentOnOneRank) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  Case c;
  c.R = 3;
  c.L = 2;
  c.K = 2;
  c.M = 3;
  c.max_tokens = 8;
  c.H = 130;
  c.dtype = DType::kFloat8E4M3;
  c.scale_cols = 2;  // ceil(130/128)
  c.expert_major = true;
  c.T = {8, 5, 8};
  World w;
  ASSERT_TRUE(w.setup(c, g(), /*dispatch=*/false));
  const ep::GroupConfig& cfg = w.cfg;
  // Oversized inputs for the T > max_tokens case.
  RankIn big = w.in[2];
  big.T = c.max_tokens + 1;
  big.x.assign((big.T * big.x_stride), 1);
  big.scales.assign(big.T * cfg.scale_cols, 1.0f);
  big.ids.assign(big.T * c.K, 0);
  big.sync_ids32();
  big.w.assign(big.T * c.K, 0.5f);
  std::vector<std::int32_t> bad_ids_out(w.out[0].N * c.K);
  struct Bad {
    const char* what;
    std::vector<std::string> names;  // the message must contain one of these
    std::function<void(ep::DispatchInputs*, ep::DispatchOutputs*)> edit;
  };
  const std::vector<Bad> bads = {
      {"x wrong hidden", {"x"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->x.shape[1] = c.H - 1; }},
      {"x wrong dtype", {"x"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->x.dtype = DType::kBFloat16; }},
      {"T > max_tokens", {"x", "max_tokens", "topk_ids"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { *in = big.view(cfg); }},
      {"missing scales", {"scales"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->scales = TensorView{}; }},
      {"scales wrong cols", {"scales"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->scales.shape[1] = 1; }},
      {"topk_ids rows != x rows", {"topk_ids"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->topk_ids.shape[0] -= 1; }},
      {"topk_ids float", {"topk_ids"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->topk_ids.dtype = DType::kFloat32; }},
      {"topk_weights wrong K", {"topk_weights"},
       [&](ep::DispatchInputs* in, ep::DispatchOutputs*) { in->topk_weights.shape[1] = c.K + 1; }},
      {"output x too small", {"x"},
       [&](ep::DispatchInputs*, ep::DispatchOutputs* o) { o->x.shape[0] -= 1; }},
      {"output topk_ids too small", {"topk_ids"},
       [&](ep::DispatchInputs*, ep::DispatchOutputs* o) { o->topk_ids.shape[0] -= 1; }},
      {"output stats missing", {"stats"},
       [&](ep::DispatchInputs*, ep::DispatchOutputs* o) { o->stats = TensorView{}; }},
      {"output expert_x too small", {"expert_x"},
       [&](ep::DispatchInputs*, ep::DispatchOutputs* o) { o->expert_x.shape[0] -= 1; }},
      {"output layout permuted_to_token too small", {"permuted_to_token", "layout"},
       [&](ep::DispatchInputs*, ep::DispatchOutputs* o) { o->layout.permuted_to_token.shape[0] -= 1; }},
  };
  for (const Bad& b : bads) {
    for (const int bad : {2, 0}) {
      SCOPED_TRACE(std::string(b.what) + " on rank " + std::to_string(bad));
      w.fresh_outputs();
      std::vector<ep::DispatchInputs> iv;
      std::vector<ep::DispatchOutputs> ov;
      for (int r = 0; r < c.R; ++r) {
        iv.push_back(w.in[r].view(cfg));
        ov.push_back(w.out[r].view());
      }
      b.edit(&iv[bad], &ov[bad]);
      const std::vector<Status> st = dispatch_views(*w.group, iv, ov, &w.handles);
      for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r].to_string();
        EXPECT_TRUE(names_rank(st[r].message(), bad)) << "rank " << r << ": " << st[r].to_string();
        EXPECT_TRUE(mentions_any(st[r].message(), b.names)) << "rank " << r << ": " << st[r].to_string();
        check_untouched(r, w.out[r]);
        EXPECT_FALSE(w.handles[r].valid()) << "rank " << r;
      }
    }
  }
  EXPECT_EQ(w.group->broken_reason(), "");
  // The group still works, and a bad combine argument on one rank is refused everywhere too.
  w.fresh_outputs();
  ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles), "dispatch after refusals"));
  for (int r = 0; r < c.R; ++r) check_outputs(r, w.out[r], w.want[r]);
  const std::vector<RankY> ys = make_y(w, true, DType::kBFloat16, 0, g);
  for (const int bad : {1, 2}) {
    for (const int kind : {0, 1, 2}) {
      SCOPED_TRACE("combine bad argument " + std::to_string(kind) + " on rank " + std::to_string(bad));
      Outs outs = make_outs(w, DType::kBFloat16, false, g);
      const Outs before = outs;
      std::vector<Status> st(c.R);
      ep::run_ranks(c.R, [&](int r) {
        ep::CombineInputs ci;
        ci.y = ys[r].view(c.H);
        TensorView ov = TensorView::of(outs.data[r].data(), DType::kBFloat16, {w.in[r].T, c.H}, Device::cpu());
        if (r == bad) {
          if (kind == 0) ci.y.shape[1] = c.H + 1;
          if (kind == 1) ov.shape[0] += 1;  // T differs from the dispatch's
          if (kind == 2) ci.y.dtype = DType::kFloat8E4M3;
        }
        st[r] = w.group->combine(r, w.handles[r], ci, ov, false);
        return st[r];
      });
      for (int r = 0; r < c.R; ++r) {
        EXPECT_EQ(st[r].code(), StatusCode::kInvalidArgument) << "rank " << r << ": " << st[r].to_string();
        EXPECT_TRUE(names_rank(st[r].message(), bad)) << "rank " << r << ": " << st[r].to_string();
      }
      check_combine(w, outs, before, "refused combine writes nothing");
    }
  }
  EXPECT_EQ(w.group->broken_reason(), "");
}

// Test 7: a rank that never arrives.
TEST(EpCpuFaults, MissingRankTimesOutAndBreaksTheGroup) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const int R : {2, 3}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Case c;
    c.R = R;
    c.L = 2;
    c.K = 2;
    c.max_tokens = 5;
    c.H = 8;
    World w;
    w.c = c;
    w.cfg = make_config(c);
    w.cfg.timeout_seconds = 0.2;
    ASSERT_TRUE(ep::CpuGroup::create(w.cfg, &w.group).ok());
    w.in = make_inputs(c, w.cfg, g);
    w.ref = reference_dispatch(w.cfg, w.in);
    for (int r = 0; r < R; ++r) w.want.push_back(expected_outputs(w.cfg, false, w.in, w.ref, r));
    w.fresh_outputs();
    w.handles.assign(R, ep::Handle());
    // A good round first, so that a valid handle exists for the later combine.
    ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles), "dispatch"));
    const std::vector<ep::Handle> good = w.handles;

    std::vector<Status> st(R);
    std::vector<double> seconds(R, 0.0);
    ep::run_ranks(R, [&](int r) {
      if (r == R - 1) return Status::Ok();  // never arrives
      const auto t0 = std::chrono::steady_clock::now();
      st[r] = w.group->dispatch(r, w.in[r].view(w.cfg), w.out[r].view(), &w.handles[r]);
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      return st[r];
    });
    for (int r = 0; r < R - 1; ++r) {
      EXPECT_EQ(st[r].code(), StatusCode::kTimeout) << "rank " << r << ": " << st[r].to_string();
      EXPECT_TRUE(names_rank(st[r].message(), R - 1)) << "rank " << r << ": " << st[r].to_string();
      EXPECT_LT(seconds[r], 5.0) << "rank " << r;
      EXPECT_GE(seconds[r], 0.1) << "rank " << r << " gave up before the timeout";
    }
    EXPECT_NE(w.group->broken_reason(), "");
    // Every further call fails with kTimeout, whoever makes it, without waiting for peers long.
    for (int r = 0; r < R; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const Status d = w.group->dispatch(r, w.in[r].view(w.cfg), w.out[r].view(), &w.handles[r]);
      EXPECT_EQ(d.code(), StatusCode::kTimeout) << "dispatch rank " << r << " after the fault: " << d.to_string();
      std::vector<std::uint8_t> o((w.in[r].T + 1) * c.H * 2);
      ep::CombineInputs ci;
      ci.expert_major = false;
      std::vector<std::uint8_t> y(w.out[r].N * c.H * 2);
      ci.y = TensorView::of(y.data(), DType::kBFloat16, {w.out[r].N, c.H}, Device::cpu());
      const Status cs = w.group->combine(r, good[r], ci,
                                         TensorView::of(o.data(), DType::kBFloat16, {w.in[r].T, c.H}, Device::cpu()));
      EXPECT_EQ(cs.code(), StatusCode::kTimeout) << "combine rank " << r << " after the fault: " << cs.to_string();
      EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 5.0);
    }
    // All ranks together: still refused.
    const std::vector<Status> again = dispatch_all(*w.group, w.in, &w.out, &w.handles);
    for (int r = 0; r < R; ++r) EXPECT_EQ(again[r].code(), StatusCode::kTimeout) << again[r].to_string();
  }
}

// Test 7b: a rank missing from combine.
TEST(EpCpuFaults, MissingRankInCombineTimesOut) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  Case c;
  c.R = 3;
  c.L = 2;
  c.K = 2;
  c.max_tokens = 5;
  c.H = 8;
  c.expert_major = true;
  World w;
  w.c = c;
  w.cfg = make_config(c);
  w.cfg.timeout_seconds = 0.2;
  ASSERT_TRUE(ep::CpuGroup::create(w.cfg, &w.group).ok());
  std::mt19937_64 g(seed);
  w.in = make_inputs(c, w.cfg, g);
  w.ref = reference_dispatch(w.cfg, w.in);
  for (int r = 0; r < c.R; ++r) w.want.push_back(expected_outputs(w.cfg, true, w.in, w.ref, r));
  w.fresh_outputs();
  w.handles.assign(c.R, ep::Handle());
  ASSERT_TRUE(all_ok(dispatch_all(*w.group, w.in, &w.out, &w.handles), "dispatch"));
  const std::vector<RankY> ys = make_y(w, true, DType::kFloat32, 0, g);
  Outs outs = make_outs(w, DType::kFloat32, false, g);
  std::vector<Status> st(c.R);
  ep::run_ranks(c.R, [&](int r) {
    if (r == 1) return Status::Ok();  // never arrives
    ep::CombineInputs ci;
    ci.y = ys[r].view(c.H);
    st[r] = w.group->combine(r, w.handles[r], ci,
                             TensorView::of(outs.data[r].data(), DType::kFloat32, {w.in[r].T, c.H}, Device::cpu()));
    return st[r];
  });
  for (const int r : {0, 2}) {
    EXPECT_EQ(st[r].code(), StatusCode::kTimeout) << "rank " << r << ": " << st[r].to_string();
    EXPECT_TRUE(names_rank(st[r].message(), 1)) << st[r].to_string();
  }
  EXPECT_NE(w.group->broken_reason(), "");
}

// Test 8: the same dispatch + combine twice, on the same group and on a new one: same bytes.
TEST(EpCpuDeterminism, SameInputsSameBytes) {
  const std::uint64_t seed = sy_test::test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  Case c;
  c.R = 4;
  c.L = 3;
  c.K = 5;
  c.M = 7;
  c.max_tokens = 40;
  c.H = 300;
  c.dtype = DType::kFloat8E4M3;
  c.scale_cols = 3;
  c.routing = Routing::kWithReplacement;
  c.expert_major = true;
  const std::uint64_t case_seed = g();
  World a, b;
  ASSERT_TRUE(a.setup(c, case_seed));
  ASSERT_TRUE(b.setup(c, case_seed));
  std::mt19937_64 gy(case_seed + 1);
  const std::vector<RankY> ys = make_y(a, true, DType::kBFloat16, 0, gy);
  std::vector<Outs> results;
  for (int round = 0; round < 2; ++round) {
    // Round 1 on group a again (fresh buffers), rounds on b.
    for (World* w : {&a, &b}) {
      if (round == 1 && w == &b) continue;
      if (round == 1) {
        w->fresh_outputs();
        ASSERT_TRUE(all_ok(dispatch_all(*w->group, w->in, &w->out, &w->handles), "dispatch again"));
      }
      Outs o = make_outs(*w, DType::kFloat32, false, gy);
      ASSERT_TRUE(all_ok(combine_all(*w, w->handles, ys, true, &o, false), "combine"));
      results.push_back(std::move(o));
    }
  }
  for (int r = 0; r < c.R; ++r) {
    check_outputs(r, a.out[r], b.out[r]);
  }
  for (std::size_t i = 1; i < results.size(); ++i)
    check_combine(a, results[i], results[0], "combine run " + std::to_string(i) + " vs run 0");
}

}  // namespace
