// CUDA layout and route_and_layout against the CPU backend (the oracle): every output array must
// be byte-identical over its full capacity, every device output is poisoned before each run, and
// a poisoned guard zone after each array's capacity must stay untouched.
//
// Replay a failure with SY_TEST_SEED=<seed printed in the trace>.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/cuda_test_util.h"
#include "common/float_formats.h"
#include "common/layout_inputs.h"
#include "common/scoped_value.h"
#include "common/sm_holder.h"
#include "common/test_data.h"
#include "switchyard/layout.h"
#include "switchyard/routing.h"

namespace {

using switchyard::Device;
using switchyard::DType;
using switchyard::Layout;
using switchyard::LayoutConfig;
using switchyard::Status;
using switchyard::TensorView;

// The kernel options every GPU layout call of this file passes; a test forces a path by setting a
// field for its scope (sy_test::ScopedValue).
switchyard::LayoutOptions g_options;
using sy_test::DeviceBuffer;
using sy_test::Duplicates;
using sy_test::kSkews;
using sy_test::LocalKind;
using sy_test::Skew;
using Case = sy_test::LayoutCase;
using Inputs = sy_test::LayoutInputs;

constexpr std::int64_t kTs[] = {0, 1, 3, 19, 111, 989, 4096, 65536, 262144};
constexpr int kEs[] = {8, 160, 256, 384, 512, 2048, 4096};
constexpr int kKs[] = {1, 2, 8, 10, 22, 32};
constexpr int kMs[] = {1, 7, 64, 128, 192};
// int32 elements after each array's capacity that must keep their poison.
constexpr std::int64_t kGuard = 67;
constexpr std::int32_t kPoison = static_cast<std::int32_t>(0xA5A5A5A5u);  // cudaMemset byte 0xA5

using sy_test::make_config;
using sy_test::num_local;
using sy_test::pick_local;
using sy_test::test_seed;

// This test's draw of the inputs (tests/common/layout_inputs.h).
Inputs make_inputs(const Case& c, std::uint64_t seed) {
  sy_test::LayoutInputsDraw draw;
  draw.salt = 0x5bd1e995ull;
  draw.map_negative[0] = -1;
  draw.map_negative[1] = -7;
  draw.map_past_l = 3;
  draw.random_hot = true;
  draw.fast_ids_above = 2e6;
  // Low 32 bits name a valid expert: a kernel that truncates to int32 would place them.
  draw.invalid_ids64 = {(std::int64_t{1} << 32) + 1, static_cast<std::int64_t>(0xffffffff00000000ull),
                        std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max()};
  draw.invalid_every = 0;  // 1 in 4-32, drawn per case
  return sy_test::make_layout_inputs(c, seed, draw);
}

// Array names in Layout order.
constexpr const char* kArrayNames[] = {"counts",
                                       "offsets",
                                       "permuted_to_expanded",
                                       "permuted_to_token",
                                       "expanded_to_permuted",
                                       "tile_expert",
                                       "tile_row_end",
                                       "totals"};
constexpr int kNumArrays = 8;

// Element counts of the eight arrays for a shape.
struct Sizes {
  std::int64_t n[kNumArrays] = {};
  std::int64_t T = 0;
  int K = 1;
  Sizes(std::int64_t T_, int K_, int L, int M) : T(T_), K(K_) {
    const std::int64_t rows = switchyard::max_permuted_rows(T, K, L, M);
    const std::int64_t tiles = switchyard::max_tiles(T, K, L, M);
    const std::int64_t v[kNumArrays] = {L, L + 1, rows, rows, T * K, tiles, tiles, switchyard::kNumTotals};
    std::copy(v, v + kNumArrays, n);
  }
};

Layout layout_views(const Sizes& s, std::int32_t* const (&ptr)[kNumArrays], Device device) {
  auto v1 = [&](int i) { return TensorView::of(ptr[i], DType::kInt32, {s.n[i]}, device); };
  Layout out;
  out.counts = v1(0);
  out.offsets = v1(1);
  out.permuted_to_expanded = v1(2);
  out.permuted_to_token = v1(3);
  out.expanded_to_permuted = TensorView::of(ptr[4], DType::kInt32, {s.T, s.K}, device);
  out.tile_expert = v1(5);
  out.tile_row_end = v1(6);
  out.totals = v1(7);
  return out;
}

// Host outputs of the CPU backend.
struct HostLayout {
  Sizes sizes;
  std::vector<std::int32_t> a[kNumArrays];
  explicit HostLayout(const Sizes& s) : sizes(s) {
    for (int i = 0; i < kNumArrays; ++i) a[i].assign(static_cast<std::size_t>(s.n[i]), sy_test::kPoisonI32);
  }
  Layout views() {
    std::int32_t* const p[kNumArrays] = {a[0].data(), a[1].data(), a[2].data(), a[3].data(),
                                         a[4].data(), a[5].data(), a[6].data(), a[7].data()};
    return layout_views(sizes, p, Device::cpu());
  }
};

// Device outputs, each with a guard zone after its capacity.
struct DeviceLayout {
  Sizes sizes;
  DeviceBuffer b[kNumArrays];
  explicit DeviceLayout(const Sizes& s) : sizes(s) {
    for (int i = 0; i < kNumArrays; ++i) b[i] = DeviceBuffer(static_cast<std::size_t>(s.n[i] + kGuard) * 4);
  }
  void poison() {
    for (auto& buf : b) sy_test::poison(buf);
  }
  Layout views() const {
    std::int32_t* const p[kNumArrays] = {
        b[0].as<std::int32_t>(), b[1].as<std::int32_t>(), b[2].as<std::int32_t>(), b[3].as<std::int32_t>(),
        b[4].as<std::int32_t>(), b[5].as<std::int32_t>(), b[6].as<std::int32_t>(), b[7].as<std::int32_t>()};
    return layout_views(sizes, p, Device::cuda());
  }
  std::vector<std::int32_t> fetch(int i) const {
    return sy_test::to_host<std::int32_t>(b[i], static_cast<std::size_t>(sizes.n[i] + kGuard));
  }
};

// The device array (with its guard) equals the CPU array, and the guard kept its poison.
void expect_same(const char* name, const std::vector<std::int32_t>& cpu,
                 const std::vector<std::int32_t>& gpu) {
  const std::size_t n = cpu.size();
  ASSERT_EQ(gpu.size(), n + kGuard) << name;
  if (std::memcmp(cpu.data(), gpu.data(), n * 4) != 0) {
    std::size_t bad = 0;
    std::size_t first = n;
    for (std::size_t i = 0; i < n; ++i) {
      if (cpu[i] != gpu[i]) {
        ++bad;
        if (first == n) first = i;
      }
    }
    ADD_FAILURE() << name << ": " << bad << " of " << n << " elements differ; first at [" << first
                  << "]: gpu " << gpu[first] << (gpu[first] == kPoison ? " (poison: never written)" : "")
                  << ", cpu " << cpu[first];
    return;
  }
  for (std::size_t i = n; i < n + kGuard; ++i) {
    if (gpu[i] != kPoison) {
      ADD_FAILURE() << name << "[" << i << "] = " << gpu[i] << " written past its capacity " << n;
      return;
    }
  }
}

void expect_same_layout(const HostLayout& cpu, const DeviceLayout& gpu) {
  for (int i = 0; i < kNumArrays; ++i) expect_same(kArrayNames[i], cpu.a[i], gpu.fetch(i));
}

// Everything one layout call on the GPU needs, allocated once per shape.
struct GpuLayoutRun {
  Case c;
  Sizes sizes;
  DeviceBuffer ids;
  DeviceBuffer expert_map;
  DeviceBuffer workspace;
  std::size_t workspace_bytes = 0;
  DeviceLayout out;

  explicit GpuLayoutRun(const Case& c_, std::size_t min_workspace = 0)
      : c(c_), sizes(c_.T, c_.K, num_local(c_), c_.M), out(sizes) {
    ids = DeviceBuffer(static_cast<std::size_t>(c.T * c.K) * (c.ids64 ? 8 : 4) + 16);
    expert_map = DeviceBuffer(static_cast<std::size_t>(c.E) * 4 + 16);
    const LayoutConfig config = make_config(c, expert_map.get(), Device::cuda());
    const Status s = switchyard::layout_workspace_size(config, c.T, c.K, Device::cuda(), &workspace_bytes);
    EXPECT_TRUE(s.ok()) << s.to_string();
    workspace_bytes = std::max(workspace_bytes, min_workspace);
    workspace = DeviceBuffer(workspace_bytes);
  }

  void upload(const Inputs& in) {
    if (c.T * c.K > 0) {
      const void* src =
          c.ids64 ? static_cast<const void*>(in.ids.data()) : static_cast<const void*>(in.ids32.data());
      cudaMemcpy(ids.get(), src, static_cast<std::size_t>(c.T * c.K) * (c.ids64 ? 8 : 4),
                 cudaMemcpyHostToDevice);
    }
    if (c.local == LocalKind::kMap) {
      cudaMemcpy(expert_map.get(), in.expert_map.data(), in.expert_map.size() * 4, cudaMemcpyHostToDevice);
    }
  }

  TensorView ids_view() const {
    return TensorView::of(ids.get(), c.ids64 ? DType::kInt64 : DType::kInt32, {c.T, c.K}, Device::cuda());
  }

  Status run(cudaStream_t stream = nullptr) {
    return switchyard::layout(make_config(c, expert_map.get(), Device::cuda()), ids_view(), out.views(),
                              workspace.get(), workspace_bytes, stream, g_options);
  }
};

HostLayout cpu_layout(const Case& c, const Inputs& in) {
  HostLayout h(Sizes(c.T, c.K, num_local(c), c.M));
  const TensorView ids = c.ids64 ? TensorView::of(in.ids.data(), DType::kInt64, {c.T, c.K}, Device::cpu())
                                 : TensorView::of(in.ids32.data(), DType::kInt32, {c.T, c.K}, Device::cpu());
  const Status s =
      switchyard::layout(make_config(c, in.expert_map.data(), Device::cpu()), ids, h.views(), nullptr, 0);
  EXPECT_TRUE(s.ok()) << "CPU layout: " << s.to_string();
  return h;
}

// One case end to end: fresh inputs, CPU oracle, poisoned GPU run, byte comparison.
void check_case(const Case& c, std::uint64_t seed) {
  SCOPED_TRACE(describe(c) + " input seed " + std::to_string(seed));
  const Inputs in = make_inputs(c, seed);
  const HostLayout want = cpu_layout(c, in);
  GpuLayoutRun gpu(c);
  gpu.upload(in);
  gpu.out.poison();
  // The workspace is never initialised by the caller: garbage must not matter.
  if (gpu.workspace.get())
    cudaMemset(gpu.workspace.get(), static_cast<int>(seed & 0xff), gpu.workspace_bytes);
  const Status s = gpu.run();
  ASSERT_TRUE(s.ok()) << s.to_string();
  SY_CUDA_OK(cudaDeviceSynchronize());
  expect_same_layout(want, gpu.out);
}

// A random case over the secondary axes for (T, E, K).
Case random_case(std::int64_t T, int E, int K, std::mt19937_64& g) {
  Case c;
  c.T = T;
  c.E = E;
  c.K = K;
  c.M = kMs[g() % 5];
  c.skew = kSkews[g() % 3];
  c.ids64 = g() % 2 == 1;
  c.local = static_cast<LocalKind>(g() % 3);
  c.invalid = g() % 2 == 1;
  pick_local(c, g, g() % 2 == 0 ? 1 : 3);
  return c;
}

// ---------------------------------------------------------------------------------------------

// Every T with every (E, K <= E) pair up to 4096 tokens; at the two big T, the (E, K) pairs that
// serving uses plus the extremes. Tile size, skew, id dtype, local form and invalid ids are drawn
// per case (the next test covers their full cross product).
TEST(LayoutCuda, SweepMatchesCpu) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t T : kTs) {
    std::vector<std::pair<int, int>> ek;
    if (T <= 4096) {
      for (const int E : kEs)
        for (const int K : kKs)
          if (K <= E) ek.emplace_back(E, K);
    } else if (T == 65536) {
      ek = {{8, 2}, {160, 22}, {256, 8}, {384, 8}, {512, 10}, {2048, 1}, {4096, 32}};
    } else {
      ek = {{256, 8}, {512, 10}, {4096, 2}};
    }
    for (const auto& [E, K] : ek) {
      check_case(random_case(T, E, K, g), g());
      if (HasFatalFailure()) return;
    }
  }
}

// The full cross product of tile size x skew x id dtype x local form x invalid ids, on the small
// one-kernel path (T=111, K=8) and on the chunked path (T=989, K=8).
TEST(LayoutCuda, SecondaryAxesCrossProduct) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t T : {111, 989}) {
    for (const int M : kMs)
      for (const Skew skew : kSkews)
        for (const bool ids64 : {false, true})
          for (int form = 0; form < 4; ++form)
            for (const bool invalid : {false, true}) {
              Case c;
              c.T = T;
              c.E = 256;
              c.K = 8;
              c.M = M;
              c.skew = skew;
              c.ids64 = ids64;
              c.invalid = invalid;
              c.local = form == 0 ? LocalKind::kAll : form == 3 ? LocalKind::kMap : LocalKind::kRange;
              pick_local(c, g, form == 1 ? 1 : 3);
              check_case(c, g());
              if (HasFatalFailure()) return;
            }
  }
}

// Pick counts at and around every path boundary (the one-block path up to 4096 picks in steps of
// 512 and 2048; the 8-block cluster path up to 12288 picks; the
// sorting one-kernel path up to 4096 picks when L is too large for those; chunks of 512 up to
// 131072, chunks of 2048 above while chunks x L <= 65536 (N = 524288 at L = 256), else of 4096),
// chunk boundaries, and L around the shared-memory limits.
TEST(LayoutCuda, PathBoundaries) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  const std::pair<std::int64_t, int> shapes[] = {
      {128, 1},   {129, 1},   {1024, 1},  {1025, 1},  {2048, 1},   {2049, 1},  {4096, 1},  {4097, 1},
      {512, 8},   {513, 8},   {5120, 1},  {16384, 8}, {131073, 1}, {16385, 8}, {65535, 2}, {1, 32},
      {128, 32},  {129, 32},  {4095, 32}, {512, 1},   {513, 1},    {8192, 1},  {8193, 1},  {16384, 1},
      {16385, 1}, {1024, 8},  {1025, 8},  {2048, 8},  {2049, 8},   {33, 16},   {4096, 8},  {4097, 8},
      {32768, 1}, {32769, 1}, {33281, 1}, {8192, 8},  {8193, 8},   {65536, 1}, {65537, 1}, {4103, 1},
      {6000, 3},  {65536, 8}, {65537, 8}, {40960, 8}, {40961, 8},  {20480, 8}, {20481, 8}};
  for (const auto& [T, K] : shapes) {
    check_case(random_case(T, 256, K, g), g());
    if (HasFatalFailure()) return;
  }
  // The one-block path holds 19 * L + 1 int32 of shared memory, at most 160 KB: L <= 2155. The
  // 16-block cluster path holds 22 * L + 2 + 2 * chunk (chunk = ceil(N / 16) to whole 32s): for
  // N = 4800 (chunk 320) L <= 1832, for N = 16384 (chunk 1024) L <= 1768, for N = 32000 (chunk
  // 2016) L <= 1678. The grid form of CB blocks loads CB * L <= 65536 counts per block: L = 512
  // and 513 at N = 200000 (128 blocks, or the chunked pipeline), 1024 and 1025 at N = 100000
  // (64 blocks). Both sides of each boundary, where the next path takes over.
  const std::pair<std::int64_t, int> boundaries[] = {
      {3, 2155},    {3, 2156},    {600, 1832},  {600, 1833},  {2048, 1768},  {2048, 1769},
      {4000, 1678}, {4000, 1679}, {25000, 512}, {25000, 513}, {12500, 1024}, {12500, 1025}};
  for (const auto& [T, E] : boundaries) {
    Case c = random_case(T, E, 8, g);
    c.local = LocalKind::kAll;
    c.start = 0;
    c.count = -1;
    c.stride = 1;
    check_case(c, g());
    if (HasFatalFailure()) return;
  }
}

using sy_test::ScopedValue;
using Path = switchyard::LayoutOptions::Path;

// Every path on the same shapes (LayoutOptions::path forces one where it fits): the one-launch
// kernels far past the sizes the default selection gives them, so each is checked on its own, with
// both of their ranking methods (LayoutOptions::rank_by_ballots; otherwise the bitmaps where they
// fit).
TEST(LayoutCuda, ForcedPathsMatchCpu) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  const std::pair<std::int64_t, int> shapes[] = {
      {1, 8},    {31, 3},    {512, 8},   {1000, 4},  {4096, 1},  {1537, 8},  {4096, 8},   {3001, 10},
      {8192, 8}, {6553, 10}, {65536, 1}, {40000, 1}, {2047, 16}, {16384, 8}, {24001, 10}, {65536, 8}};
  const std::pair<Path, const char*> paths[] = {{Path::kOneBlock, "one_block"}, {Path::kCluster8, "cluster8"},
                                                {Path::kCluster16, "cluster16"}, {Path::kGrid32, "grid32"},
                                                {Path::kGrid64, "grid64"},       {Path::kGrid128, "grid128"},
                                                {Path::kChunked, "chunked"}};
  for (const auto& [path, name] : paths) {
    for (const bool ballots : {false, true}) {
      if (path == Path::kChunked && ballots) continue;  // it does not rank that way
      SCOPED_TRACE(std::string("path ") + name + (ballots ? ", ranking by ballots" : ""));
      const ScopedValue<Path> forced_path(g_options.path, path);
      const ScopedValue<bool> forced_rank(g_options.rank_by_ballots, ballots);
      for (const auto& [T, K] : shapes) {
        // (61 and 63 experts: the cluster form's rows of counts in the workspace are not whole
        // 128-byte lines)
        for (const int E : {256, 61, 63}) {
          check_case(random_case(T, E, K, g), g());
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// LayoutConfig::independent_blocks: the call completes while kernels on another stream hold all
// SMs but a few until work queued after the layout on the layout's stream releases them (what
// expert-parallel communication kernels do). Same output as the CPU backend. Control: with the
// default forms, the 16-block cluster at N = 8192 cannot be resident on the free SMs, so the
// holders time out before the layout ends (the setup does catch a layout whose blocks wait).
// Each shape is run once before the SMs are held: CUDA loads a kernel lazily at its first launch,
// and that load can wait for the running holders (an engine warms up likewise).
void layout_beside_held_sms(const Case& c, std::uint64_t seed, long long timeout_ns, bool expect_timeout) {
  SCOPED_TRACE(describe(c) + " input seed " + std::to_string(seed));
  int sms = 0;
  SY_CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  constexpr int kFreeSms = 6;  // fewer than any waiting form's blocks (8, 16, 32...)
  ASSERT_GT(sms, kFreeSms);
  const int holders = sms - kFreeSms;
  const Inputs in = make_inputs(c, seed);
  const HostLayout want = cpu_layout(c, in);
  GpuLayoutRun gpu(c);
  gpu.upload(in);
  const Status warm = gpu.run();
  ASSERT_TRUE(warm.ok()) << warm.to_string();
  SY_CUDA_OK(cudaDeviceSynchronize());
  gpu.out.poison();
  DeviceBuffer words(sizeof(sy_test::SmHolderWords));
  auto* w = words.as<sy_test::SmHolderWords>();
  SY_CUDA_OK(cudaMemset(w, 0, sizeof(sy_test::SmHolderWords)));
  cudaStream_t hold = nullptr, work = nullptr;
  SY_CUDA_OK(cudaStreamCreateWithFlags(&hold, cudaStreamNonBlocking));
  SY_CUDA_OK(cudaStreamCreateWithFlags(&work, cudaStreamNonBlocking));
  SY_CUDA_OK(cudaDeviceSynchronize());
  SY_CUDA_OK(sy_test::launch_sm_holder(holders, w, timeout_ns, hold));
  SY_CUDA_OK(sy_test::launch_wait_holders_started(w, holders, timeout_ns, work));
  const Status s = gpu.run(work);
  SY_CUDA_OK(sy_test::launch_sm_release(w, work));
  SY_CUDA_OK(cudaDeviceSynchronize());
  cudaStreamDestroy(hold);
  cudaStreamDestroy(work);
  ASSERT_TRUE(s.ok()) << s.to_string();
  sy_test::SmHolderWords host{};
  SY_CUDA_OK(cudaMemcpy(&host, w, sizeof(host), cudaMemcpyDeviceToHost));
  ASSERT_EQ(host.started, holders) << "the holder blocks did not all become resident";
  if (expect_timeout) {
    EXPECT_GT(host.timed_out, 0) << "control: a waiting layout form completed beside held SMs; the test's "
                                    "setup no longer shows anything";
  } else {
    EXPECT_EQ(host.timed_out, 0) << "the layout did not complete while the holders held their SMs";
  }
  expect_same_layout(want, gpu.out);
}

TEST(LayoutCuda, IndependentBlocksProgressBesideHeldSms) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  // One-block form; where the default is a 16-block cluster, a grid of 32 / 64 / 128 blocks; the
  // chunked pipeline.
  const std::tuple<std::int64_t, int, int> shapes[] = {{1, 256, 8},     {500, 256, 8},  {1024, 256, 8},
                                                       {4096, 256, 8},  {8192, 256, 8}, {20000, 256, 8},
                                                       {4097, 512, 10}, {65536, 256, 8}};
  for (const auto& [T, E, K] : shapes) {
    Case c = random_case(T, E, K, g);
    c.independent_blocks = true;
    layout_beside_held_sms(c, g(), 10'000'000'000LL, false);
    if (HasFatalFailure()) return;
  }
  Case control = random_case(1024, 256, 8, g);
  control.independent_blocks = false;
  layout_beside_held_sms(control, g(), 500'000'000LL, true);
}

// Tokens with two picks of one expert, on every path: the one-launch kernels' bitmaps see the
// duplicate and those blocks rank by ballots instead (in a cluster, only the blocks that meet one:
// Duplicates::kLastToken puts it in the last block's chunk).
TEST(LayoutCuda, DuplicatePicksInAToken) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  const std::pair<std::int64_t, int> shapes[] = {{1, 8},     {5, 2},    {64, 8},    {511, 8},
                                                 {3001, 10}, {4096, 8}, {8191, 8},  {6553, 10},
                                                 {2047, 16}, {333, 32}, {20000, 4}, {65536, 8}};
  for (const auto& [T, K] : shapes) {
    for (const Duplicates d : {Duplicates::kMany, Duplicates::kLastToken}) {
      for (const int E : {256, 61}) {
        Case c = random_case(T, E, K, g);
        c.duplicates = d;
        check_case(c, g());
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Edge cases: one expert, no local experts, every pick invalid or -1, every token on one expert,
// tiles larger than everything, the largest supported L.
TEST(LayoutCuda, EdgeCases) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  std::vector<Case> cases;
  for (const std::int64_t T : {0, 1, 5, 777, 9000}) {
    Case c;
    c.T = T;
    c.E = 1;
    c.K = 1;
    cases.push_back(c);  // E = 1
    c.E = 64;
    c.K = 4;
    c.local = LocalKind::kRange;
    c.start = 3;
    c.count = 0;
    cases.push_back(c);  // L = 0, range form
    c.local = LocalKind::kMap;
    cases.push_back(c);  // L = 0, map form
    c.local = LocalKind::kRange;
    c.start = 63;
    c.count = 1;
    c.M = 1000;
    cases.push_back(c);  // L = 1 at the last expert, one huge tile
    c.local = LocalKind::kAll;
    c.M = 3;
    c.K = 1;
    c.skew = Skew::kOneHot;
    cases.push_back(c);  // every token on one expert
    c.E = 8192;
    c.K = 8;
    c.M = 64;
    c.skew = Skew::kZipf;
    c.ids64 = true;
    c.invalid = true;
    cases.push_back(c);  // the largest L the CUDA backend supports
  }
  for (const Case& c : cases) {
    check_case(c, g());
    if (HasFatalFailure()) return;
  }
  // All picks -1, or all outside [0, E).
  for (const std::int64_t fill : {std::int64_t{-1}, std::int64_t{300}}) {
    for (const std::int64_t T : {7, 3000}) {
      Case c;
      c.T = T;
      c.E = 256;
      c.K = 8;
      c.M = 16;
      SCOPED_TRACE(describe(c) + " every id = " + std::to_string(fill));
      Inputs in;
      in.ids.assign(static_cast<std::size_t>(T * c.K), fill);
      in.ids32.assign(in.ids.begin(), in.ids.end());
      const HostLayout want = cpu_layout(c, in);
      GpuLayoutRun gpu(c);
      gpu.upload(in);
      gpu.out.poison();
      ASSERT_TRUE(gpu.run().ok());
      SY_CUDA_OK(cudaDeviceSynchronize());
      expect_same_layout(want, gpu.out);
    }
  }
}

TEST(LayoutCuda, TooManyLocalExpertsIsUnsupported) {
  SY_SKIP_WITHOUT_GPU();
  Case c;
  c.T = 4;
  c.E = 8193;
  c.K = 2;
  GpuLayoutRun gpu(c);
  const Status s = gpu.run();
  EXPECT_EQ(s.code(), switchyard::StatusCode::kUnsupported) << s.to_string();
}

// A workspace sized for a larger shape serves every smaller call (the size is monotone in T).
TEST(LayoutCuda, WorkspaceForLargerShapeServesSmallerCalls) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  LayoutConfig config;
  config.num_experts = 512;
  config.tile_size = 128;
  std::size_t previous = 0;
  for (std::int64_t T = 0; T <= 40000; T += 97) {
    std::size_t bytes = 0;
    ASSERT_TRUE(switchyard::layout_workspace_size(config, T, 10, Device::cuda(), &bytes).ok());
    ASSERT_GE(bytes, previous) << "workspace size shrinks at T = " << T;
    previous = bytes;
  }
  std::size_t big = 0;
  ASSERT_TRUE(switchyard::layout_workspace_size(config, 20000, 8, Device::cuda(), &big).ok());
  for (const std::int64_t T : {16384, 13000, 600}) {
    Case c = random_case(T, 512, 8, g);
    c.M = 128;
    c.local = LocalKind::kAll;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, g());
    const HostLayout want = cpu_layout(c, in);
    GpuLayoutRun gpu(c, big);
    gpu.upload(in);
    gpu.out.poison();
    ASSERT_TRUE(gpu.run().ok());
    SY_CUDA_OK(cudaDeviceSynchronize());
    expect_same_layout(want, gpu.out);
  }
}

// The same input 100 times gives the same bytes (no dependence on atomics' order), on each path.
TEST(LayoutCuda, DeterministicOver100Runs) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const std::int64_t T : {256, 4096, 65536}) {
    Case c;
    c.T = T;
    c.E = 256;
    c.K = 8;
    c.M = 128;
    c.skew = Skew::kZipf;
    c.invalid = true;
    SCOPED_TRACE(describe(c));
    const Inputs in = make_inputs(c, g());
    const HostLayout want = cpu_layout(c, in);
    GpuLayoutRun gpu(c);
    gpu.upload(in);
    std::vector<std::int32_t> first[kNumArrays];
    for (int run = 0; run < 100; ++run) {
      gpu.out.poison();
      ASSERT_TRUE(gpu.run().ok());
      SY_CUDA_OK(cudaDeviceSynchronize());
      for (int i = 0; i < kNumArrays; ++i) {
        std::vector<std::int32_t> got = gpu.out.fetch(i);
        if (run == 0) {
          expect_same(kArrayNames[i], want.a[i], got);
          first[i] = std::move(got);
        } else if (got != first[i]) {
          FAIL() << kArrayNames[i] << " differs between run 0 and run " << run;
        }
      }
      if (HasFailure()) return;
    }
  }
}

// Capture one layout call in a CUDA graph on a non-default stream, then replay it with new ids
// copied into the same buffer; each replay must match the CPU on those ids.
TEST(LayoutCuda, GraphCaptureAndReplayWithNewIds) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  // (T, E): the one-kernel path, both chunked paths, and an L that needs the shared-memory opt-in
  // (cudaFuncSetAttribute while capturing).
  for (const auto& [T, E] :
       {std::pair<std::int64_t, int>{19, 256}, {4096, 256}, {65536, 256}, {4096, 4096}}) {
    Case c;
    c.T = T;
    c.E = E;
    c.K = 8;
    c.M = 64;
    c.local = LocalKind::kRange;
    c.start = E / 4;
    c.count = E / 2;
    c.invalid = true;
    SCOPED_TRACE(describe(c));
    GpuLayoutRun gpu(c);
    sy_test::CapturedGraph graph;
    SY_CUDA_OK(graph.begin());
    const Status s = gpu.run(graph.stream());
    SY_CUDA_OK(graph.end());
    ASSERT_TRUE(s.ok()) << s.to_string();
    for (int replay = 0; replay < 4; ++replay) {
      SCOPED_TRACE("replay " + std::to_string(replay));
      c.skew = kSkews[replay % 3];
      gpu.c.skew = c.skew;
      const Inputs in = make_inputs(c, g());
      const HostLayout want = cpu_layout(c, in);
      gpu.upload(in);
      gpu.out.poison();
      SY_CUDA_OK(cudaDeviceSynchronize());
      SY_CUDA_OK(graph.replay());
      expect_same_layout(want, gpu.out);
    }
    if (HasFailure()) return;
  }
}

// One route_and_layout call: the CPU result for some logits, and the GPU buffers (outputs with
// guard zones) of the same call, which can be run (or captured) on any stream.
struct RouteLayoutCall {
  switchyard::ModelPreset preset;
  Case c;
  std::size_t n = 0;  // T * K
  std::size_t id_bytes = 4, w_bytes = 4;
  DType id_type = DType::kInt32, w_type = DType::kFloat32;
  DType logits_type = DType::kFloat32;  // or bf16: the top halves of the fp32 values
  std::vector<std::uint16_t> logits_bf16;
  // CPU results for the last logits given to set_logits.
  std::vector<std::int64_t> cpu_ids;  // raw storage for either id type
  std::vector<float> cpu_weights;     // raw storage for either weight type
  HostLayout want;
  // GPU.
  DeviceBuffer d_logits, d_bias, d_ids, d_weights, ws;
  std::size_t ws_bytes = 0;
  DeviceLayout got;

  RouteLayoutCall(const switchyard::ModelPreset& preset_, const Case& c_, bool weights_bf16_,
                  DType logits_type_ = DType::kFloat32)
      : preset(preset_),
        c(c_),
        n(static_cast<std::size_t>(c_.T * preset_.routing.top_k)),
        id_bytes(c_.ids64 ? 8 : 4),
        w_bytes(weights_bf16_ ? 2 : 4),
        id_type(c_.ids64 ? DType::kInt64 : DType::kInt32),
        w_type(weights_bf16_ ? DType::kBFloat16 : DType::kFloat32),
        logits_type(logits_type_),
        cpu_ids(n, 0),
        cpu_weights(n, 0.f),
        want(Sizes(c_.T, preset_.routing.top_k, num_local(c_), c_.M)),
        d_logits(static_cast<std::size_t>(std::max<std::int64_t>(c_.T, 1) * preset_.routing.num_experts) * 4),
        d_bias(static_cast<std::size_t>(preset_.routing.num_experts) * 4),
        d_ids(n * id_bytes + kGuard * 8),
        d_weights(n * w_bytes + kGuard * 8),
        got(Sizes(c_.T, preset_.routing.top_k, num_local(c_), c_.M)) {
    const LayoutConfig config = make_config(c, nullptr, Device::cuda());
    EXPECT_TRUE(
        switchyard::layout_workspace_size(config, c.T, preset.routing.top_k, Device::cuda(), &ws_bytes).ok());
    ws = DeviceBuffer(ws_bytes);
  }

  // New logits (and bias) for both backends: runs the CPU call, uploads to the GPU buffers and
  // poisons the GPU outputs.
  void set_logits(const std::vector<float>& logits, const std::vector<float>& bias) {
    const std::int64_t T = c.T;
    const int E = preset.routing.num_experts;
    const int K = preset.routing.top_k;
    const TensorView cpu_bias =
        preset.has_bias ? TensorView::of(bias.data(), DType::kFloat32, {E}, Device::cpu()) : TensorView{};
    const void* host_logits = logits.data();
    std::size_t logits_bytes = logits.size() * 4;
    if (logits_type == DType::kBFloat16) {
      logits_bf16.resize(logits.size());
      for (std::size_t i = 0; i < logits.size(); ++i)
        logits_bf16[i] = static_cast<std::uint16_t>(sy_test::f32_bits(logits[i]) >> 16);
      host_logits = logits_bf16.data();
      logits_bytes = logits_bf16.size() * 2;
    }
    const Status s = switchyard::route_and_layout(
        preset.routing, TensorView::of(host_logits, logits_type, {T, E}, Device::cpu()), cpu_bias,
        TensorView::of(cpu_ids.data(), id_type, {T, K}, Device::cpu()),
        TensorView::of(cpu_weights.data(), w_type, {T, K}, Device::cpu()),
        make_config(c, nullptr, Device::cpu()), want.views(), nullptr, 0);
    ASSERT_TRUE(s.ok()) << "CPU: " << s.to_string();
    if (logits_bytes > 0)
      SY_CUDA_OK(cudaMemcpy(d_logits.get(), host_logits, logits_bytes, cudaMemcpyHostToDevice));
    SY_CUDA_OK(cudaMemcpy(d_bias.get(), bias.data(), bias.size() * 4, cudaMemcpyHostToDevice));
    sy_test::poison(d_ids);
    sy_test::poison(d_weights);
    got.poison();
  }

  Status run(cudaStream_t stream) const {
    const std::int64_t T = c.T;
    const int E = preset.routing.num_experts;
    const int K = preset.routing.top_k;
    const TensorView gpu_bias =
        preset.has_bias ? TensorView::of(d_bias.get(), DType::kFloat32, {E}, Device::cuda()) : TensorView{};
    return switchyard::route_and_layout(
        preset.routing, TensorView::of(d_logits.get(), logits_type, {T, E}, Device::cuda()), gpu_bias,
        TensorView::of(d_ids.get(), id_type, {T, K}, Device::cuda()),
        TensorView::of(d_weights.get(), w_type, {T, K}, Device::cuda()),
        make_config(c, nullptr, Device::cuda()), got.views(), ws.get(), ws_bytes, stream);
  }

  // The GPU outputs equal the CPU's (ids and weights bit for bit: both backends run the same
  // exact arithmetic, routing.h), and the guards kept their poison.
  void expect_match() const {
    std::vector<unsigned char> ids_got(n * id_bytes + kGuard * 8);
    std::vector<unsigned char> weights_got(n * w_bytes + kGuard * 8);
    SY_CUDA_OK(cudaMemcpy(ids_got.data(), d_ids.get(), ids_got.size(), cudaMemcpyDeviceToHost));
    SY_CUDA_OK(cudaMemcpy(weights_got.data(), d_weights.get(), weights_got.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(std::memcmp(ids_got.data(), cpu_ids.data(), n * id_bytes), 0) << "topk_ids differ";
    EXPECT_EQ(std::memcmp(weights_got.data(), cpu_weights.data(), n * w_bytes), 0) << "topk_weights differ";
    EXPECT_TRUE(std::all_of(ids_got.begin() + n * id_bytes, ids_got.end(), [](unsigned char b) {
      return b == 0xA5;
    })) << "topk_ids written past [T,K]";
    EXPECT_TRUE(std::all_of(weights_got.begin() + n * w_bytes, weights_got.end(), [](unsigned char b) {
      return b == 0xA5;
    })) << "topk_weights written past [T,K]";
    expect_same_layout(want, got);
  }
};

// Fresh random logits and bias for a call.
void random_logits(const RouteLayoutCall& call, std::mt19937_64& g, std::vector<float>* logits,
                   std::vector<float>* bias) {
  const int E = call.preset.routing.num_experts;
  *logits = sy_test::random_normal(static_cast<std::size_t>(call.c.T * E), g());
  *bias = sy_test::random_normal(static_cast<std::size_t>(E), g(), 0.1f);
}

// One route_and_layout call on both backends with the same logits; compares ids and weights bit
// for bit and every layout array.
void check_route_and_layout(const switchyard::ModelPreset& preset, const Case& c, bool weights_bf16,
                            std::mt19937_64& g, DType logits_type = DType::kFloat32) {
  SCOPED_TRACE(preset.name + " " + describe(c) + (weights_bf16 ? " weights=bf16" : " weights=fp32") +
               (logits_type == DType::kBFloat16 ? " logits=bf16" : " logits=fp32"));
  RouteLayoutCall call(preset, c, weights_bf16, logits_type);
  std::vector<float> logits, bias;
  random_logits(call, g, &logits, &bias);
  call.set_logits(logits, bias);
  if (testing::Test::HasFatalFailure()) return;
  const Status s = call.run(nullptr);
  ASSERT_TRUE(s.ok()) << "GPU: " << s.to_string();
  SY_CUDA_OK(cudaDeviceSynchronize());
  call.expect_match();
}

// The Case of a route_and_layout call: T tokens routed by `preset`, tiles of M rows, all experts
// local, int32 ids (callers adjust the rest).
Case preset_case(const switchyard::ModelPreset& preset, std::int64_t T, int M) {
  Case c;
  c.T = T;
  c.E = preset.routing.num_experts;
  c.K = preset.routing.top_k;
  c.M = M;
  return c;
}

// route_and_layout for the presets of the issue at T = 1, 16, 19, 64, 65, 256 and 8192 (the layout
// side crosses its one-block, cluster and chunked paths), all experts local and a quarter of them
// (int64 ids).
TEST(LayoutCuda, RouteAndLayoutMatchesCpu) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const char* name : {"deepseek-v3", "qwen3-next-80b"}) {
    switchyard::ModelPreset preset;
    ASSERT_TRUE(switchyard::find_preset(name, &preset).ok()) << name;
    const int E = preset.routing.num_experts;
    for (const std::int64_t T : {1, 16, 19, 64, 65, 256, 8192}) {
      for (const bool ids64 : {false, true}) {
        Case c = preset_case(preset, T, 128);
        c.ids64 = ids64;
        if (ids64) {  // expert parallelism: a quarter of the experts are local
          c.local = LocalKind::kRange;
          c.start = E / 4;
          c.count = E / 4;
          c.M = 64;
        }
        check_route_and_layout(preset, c, false, g);
        if (HasFailure()) return;
      }
    }
  }
}

// Every preset (so every routing shape, specialisation and group rule) at small T, fp32 and bf16
// logits, with odd tile sizes, int64 ids, bf16 weights and a strided local range mixed in.
TEST(LayoutCuda, RouteAndLayoutAllPresets) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  struct SmallCase {
    std::int64_t T;
    int M;
    bool ids64, strided, weights_bf16;
    DType logits;
  };
  constexpr SmallCase kCases[] = {
      {0, 192, false, false, false, DType::kFloat32},  {1, 192, true, false, false, DType::kFloat32},
      {7, 7, false, false, true, DType::kFloat32},     {64, 192, false, true, false, DType::kFloat32},
      {1, 128, false, false, false, DType::kBFloat16}, {5, 7, true, false, false, DType::kBFloat16},
      {16, 128, false, false, true, DType::kBFloat16}, {33, 128, false, true, false, DType::kBFloat16},
  };
  for (const switchyard::ModelPreset& preset : switchyard::model_presets()) {
    const int E = preset.routing.num_experts;
    for (const SmallCase& sc : kCases) {
      Case c = preset_case(preset, sc.T, sc.M);
      c.ids64 = sc.ids64;
      if (sc.strided) {  // expert parallelism: a strided local range
        c.local = LocalKind::kRange;
        c.start = 1;
        c.count = (E - 2) / 3 + 1;
        c.stride = 3;
      }
      check_route_and_layout(preset, c, sc.weights_bf16, g, sc.logits);
      if (HasFailure()) return;
    }
  }
}

// Capture one route_and_layout call in a CUDA graph on a non-default stream, then replay it with
// new logits copied into the same buffer (the routing kernel, then the layout's one-block path at
// T = 1 and 16 and its cluster path at T = 1000).
TEST(LayoutCuda, RouteAndLayoutGraphReplayWithNewLogits) {
  SY_SKIP_WITHOUT_GPU();
  const std::uint64_t seed = test_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 g(seed);
  for (const char* name : {"deepseek-v3", "kimi-k2"}) {
    switchyard::ModelPreset preset;
    ASSERT_TRUE(switchyard::find_preset(name, &preset).ok()) << name;
    for (const std::int64_t T : {1, 16, 1000}) {
      const Case c = preset_case(preset, T, 128);
      SCOPED_TRACE(preset.name + " " + describe(c));
      RouteLayoutCall call(preset, c, false);
      std::vector<float> logits, bias;
      random_logits(call, g, &logits, &bias);
      call.set_logits(logits, bias);
      sy_test::CapturedGraph graph;
      SY_CUDA_OK(graph.begin());
      const Status s = call.run(graph.stream());
      SY_CUDA_OK(graph.end());
      ASSERT_TRUE(s.ok()) << s.to_string();
      for (int replay = 0; replay < 3; ++replay) {
        SCOPED_TRACE("replay " + std::to_string(replay));
        random_logits(call, g, &logits, &bias);
        call.set_logits(logits, bias);
        SY_CUDA_OK(cudaDeviceSynchronize());
        SY_CUDA_OK(graph.replay());
        call.expect_match();
      }
      if (HasFailure()) return;
    }
  }
}

}  // namespace
