// route_backward on the GPU against the CPU oracle, bit for bit (both run the arithmetic of
// common/route_backward_math.h in one order): every pre x post pair, the presets' shapes (E up to
// 2048, K up to 32), bias, scale, 16-bit logits and gradients, int64 ids, non-finite values, and
// a row stride past E. The CPU oracle itself is checked against fp64 in route_backward_test.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/cuda_test_util.h"
#include "common/float_formats.h"
#include "common/routing_names.h"
#include "common/test_data.h"
#include "switchyard/routing.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::PostFn;
using switchyard::PreFn;
using switchyard::RoutingConfig;
using switchyard::Status;
using switchyard::TensorView;
using sy_test::DeviceBuffer;
using sy_test::to_device;
using sy_test::to_host;

struct Case {
  int E = 16, K = 4;
  std::int64_t T = 9, stride_pad = 0;
  PreFn pre = PreFn::kSoftmax;
  PostFn post = PostFn::kNormalize;
  float scale = 1.0f;
  bool bias = false, ids64 = false, bf16_grad = false, non_finite = false;
  DType dtype = DType::kFloat32;
};

std::string describe(const Case& c) {
  std::ostringstream os;
  os << "E=" << c.E << " K=" << c.K << " T=" << c.T << " pre=" << static_cast<int>(c.pre)
     << " post=" << static_cast<int>(c.post) << " scale=" << c.scale << " bias=" << c.bias << " ids64=" << c.ids64
     << " bf16_grad=" << c.bf16_grad << " dtype=" << switchyard::dtype_name(c.dtype) << " non_finite=" << c.non_finite
     << " stride=E+" << c.stride_pad;
  return os.str();
}

void run_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " seed=" + std::to_string(seed));
  std::mt19937_64 g(seed);
  std::normal_distribution<float> n(0.0f, 1.5f);
  const int E = c.E, K = c.K;
  const std::int64_t T = c.T, stride = E + c.stride_pad;
  const std::size_t elem = switchyard::dtype_size(c.dtype);
  std::vector<std::uint8_t> logits(static_cast<std::size_t>(T * stride) * elem);
  for (std::int64_t i = 0; i < T * stride; ++i) {
    float v = n(g);
    if (c.non_finite && g() % 11 == 0) v = g() % 3 == 0 ? NAN : (g() % 2 ? INFINITY : -INFINITY);
    if (c.dtype == DType::kFloat32) {
      std::memcpy(logits.data() + 4 * i, &v, 4);
    } else {
      const std::uint16_t h = c.dtype == DType::kBFloat16 ? sy_test::bf16_bits(v) : sy_test::fp16_bits(v);
      std::memcpy(logits.data() + 2 * i, &h, 2);
    }
  }
  std::vector<float> bias;
  if (c.bias) {
    for (int e = 0; e < E; ++e) bias.push_back(c.non_finite && e % 7 == 3 ? NAN : 0.1f * n(g));
  }
  const RoutingConfig cfg = sy_test::make_config(E, K, c.pre, c.post, c.scale);
  const Device cpu = Device::cpu(), gpu = Device::cuda();
  auto lview = [&](void* p, Device d) { return TensorView::of(p, c.dtype, {T, E}, d).with_row_stride(stride); };
  auto bview = [&](void* p, Device d) { return c.bias ? TensorView::of(p, DType::kFloat32, {E}, d) : TensorView{}; };
  const DType id_dtype = c.ids64 ? DType::kInt64 : DType::kInt32;
  std::vector<std::uint8_t> ids(static_cast<std::size_t>(T * K) * (c.ids64 ? 8 : 4));
  std::vector<float> w(static_cast<std::size_t>(T * K));
  Status st = switchyard::route(cfg, lview(logits.data(), cpu), bview(bias.data(), cpu),
                                TensorView::of(ids.data(), id_dtype, {T, K}, cpu),
                                TensorView::of(w.data(), DType::kFloat32, {T, K}, cpu));
  ASSERT_TRUE(st.ok()) << st.to_string();
  const DType gw_dtype = c.bf16_grad ? DType::kBFloat16 : DType::kFloat32;
  std::vector<std::uint8_t> dw(static_cast<std::size_t>(T * K) * (c.bf16_grad ? 2 : 4));
  for (std::int64_t i = 0; i < T * K; ++i) {
    float v = n(g);
    if (c.non_finite && g() % 13 == 0) v = NAN;
    if (c.bf16_grad) {
      const std::uint16_t h = sy_test::bf16_bits(v);
      std::memcpy(dw.data() + 2 * i, &h, 2);
    } else {
      std::memcpy(dw.data() + 4 * i, &v, 4);
    }
  }
  const std::size_t out_bytes = static_cast<std::size_t>(T * E) * elem;
  std::vector<std::uint8_t> want(out_bytes + 64, sy_test::kPoisonByte);
  st = switchyard::route_backward(cfg, lview(logits.data(), cpu), bview(bias.data(), cpu),
                                  TensorView::of(ids.data(), id_dtype, {T, K}, cpu),
                                  TensorView::of(dw.data(), gw_dtype, {T, K}, cpu),
                                  TensorView::of(want.data(), c.dtype, {T, E}, cpu));
  ASSERT_TRUE(st.ok()) << "CPU: " << st.to_string();

  const DeviceBuffer dl = to_device(logits), db = to_device(bias), di = to_device(ids), dd = to_device(dw);
  const DeviceBuffer dout = to_device(std::vector<std::uint8_t>(out_bytes + 64, sy_test::kPoisonByte));
  st = switchyard::route_backward(cfg, lview(dl.get(), gpu), bview(db.get(), gpu),
                                  TensorView::of(di.get(), id_dtype, {T, K}, gpu),
                                  TensorView::of(dd.get(), gw_dtype, {T, K}, gpu),
                                  TensorView::of(dout.get(), c.dtype, {T, E}, gpu));
  ASSERT_TRUE(st.ok()) << "GPU: " << st.to_string();
  SY_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<std::uint8_t> got = to_host<std::uint8_t>(dout, out_bytes + 64);
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i]) {
      const std::int64_t el = static_cast<std::int64_t>(i / elem);
      ADD_FAILURE() << "grad_logits[" << el / E << "," << el % E << "]: gpu "
                    << sy_test::load_as_float(c.dtype, got.data(), el) << ", cpu "
                    << sy_test::load_as_float(c.dtype, want.data(), el) << (i >= out_bytes ? " (past [T, E])" : "");
      return;
    }
  }
}

TEST(RouteBackwardCuda, MatchesTheCpuBitForBit) {
  SY_SKIP_WITHOUT_GPU();
  std::mt19937_64 g(sy_test::fresh_seed());
  const PreFn pres[] = {PreFn::kNone, PreFn::kSoftmax, PreFn::kSigmoid, PreFn::kSqrtSoftplus};
  const PostFn posts[] = {PostFn::kNone, PostFn::kSoftmax, PostFn::kSigmoid, PostFn::kNormalize};
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  const int shapes[][2] = {{256, 8}, {128, 8}, {160, 6}, {2048, 4}, {13, 3}, {64, 32}, {384, 8}, {1, 1}};
  int i = 0;
  for (PreFn pre : pres) {
    for (PostFn post : posts) {
      for (int rep = 0; rep < 2; ++rep) {
        Case c;
        c.pre = pre;
        c.post = post;
        c.E = shapes[i % 8][0];
        c.K = shapes[i % 8][1];
        c.T = rep == 0 ? 1 + i % 5 : 1000 + 37 * i;
        c.scale = i % 2 ? 2.5f : 1.0f;
        c.bias = i % 4 >= 2;
        c.ids64 = i % 3 == 1;
        c.bf16_grad = i % 5 == 2;
        c.dtype = dtypes[i % 3];
        c.non_finite = i % 4 == 1;
        c.stride_pad = i % 6 == 5 ? 7 : 0;
        run_case(c, g());
        if (::testing::Test::HasFailure()) return;
        ++i;
      }
    }
  }
}

}  // namespace
