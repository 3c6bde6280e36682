// Benchmark of the GPU expert-parallel group (issue 46): dispatch and combine of a loopback group,
// R ranks simulated on one GPU (ep::GpuGroup::create_loopback on device 0).
//
// Figure set (defaults): R = 8, H = 7168, K = 8, E = 256, tile 1; bf16 rows and fp8 e4m3 rows
// with per-128-column fp32 scales (scale_cols = ceil(H/128) = 56); 128 and 4096 tokens per rank;
// uniform and skewed routing (see routing_description below); fp32 combine partials.
//   expert-major: dispatch writes the rank-major and the expert-major outputs (out.expert_x);
//                 combine with in.expert_major, y = the expert_x rows themselves for bf16
//                 (identity experts), a separate bf16 [P,H] buffer shared by all ranks for fp8.
//   rank-major:   dispatch without expert_x; combine of the rank-major rows (y = out.x for bf16,
//                 the shared bf16 buffer for fp8).
//
// One call = every rank's dispatch (or combine), each rank on its own non-blocking stream: a start
// event on rank 0's stream, which every other rank's stream waits on, then each rank's call, then
// an end event on rank 0's stream after it has joined every other stream. A gate kernel
// (bench/ep/gate.cu) holds rank 0's stream before the start event until the host has enqueued
// every rank's call, so host enqueue time is not timed. Not captured in a CUDA graph (the method
// of docs/benchmarking.md for single-stream operations): the R ranks' spinning kernels must run
// on R hardware queues at once, which separate streams give. Median and p10/p90 over --iters
// calls after warm-up calls.
//
// Bytes, as docs/benchmarking.md fixes them for expert parallelism:
//   DeepEP bytes (the GB/s and "% copy" columns): a token counted once per destination rank,
//     dispatch: pairs x (row bytes + scale bytes), combine: pairs x H x 2 (bf16 rows),
//     pairs = sum over ranks and tokens of the token's destination ranks; the R ranks' bytes
//     together over the call's time, against the copy bandwidth measured in this run
//     (bytes read + written, bench/common/copy_bandwidth.cu).
//   Written bytes (what the transport stores; reads not counted):
//     dispatch: slots (pairs x (row stride + scales + metadata)) + rank-major outputs
//       (pairs x (row + scales + 8 + 8K)) + expert-major rows (picks x (row + scales));
//     combine: partials (pairs x H x partial bytes) + outputs (R x T x H x 2).
// Targets (issue 46): >= 75% of the copy bandwidth at 4096 tokens per rank, >= 50% at 128.
//
// After each point: cudaDeviceSynchronize, GpuGroup::check(rank) for every rank, the received and
// sent row counts of every rank against the host's count, and (bf16) rank 0's first combined
// rows against the identity-expert result.
//
//   bench_ep [--tokens 128,4096] [--dtype bf16,fp8] [--routing uniform,skewed] [--ranks 8]
//            [--iters 50] [--num-sms 0] [--partial fp32|bf16] [--max-gb 60] [--quick]
//            [--json bench_ep.json]
#include <cuda_runtime.h>
#include <switchyard/switchyard.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "common/git_commit.h"
#include "common/gpu_timing.h"
#include "common/json.h"
#include "ep/gate.h"

using namespace switchyard;

namespace {

constexpr std::int64_t kHidden = 7168;
constexpr int kTopK = 8;
constexpr int kExperts = 256;
constexpr int kTile = 1;
constexpr double kGroupTimeoutSeconds = 20.0;
constexpr double kGateTimeoutSeconds = 60.0;
constexpr int kCheckRows = 16;  // rank 0's combined rows checked against the host

const char* const kRoutingUniform = "uniform";
const char* const kRoutingSkewed = "skewed";

std::string routing_description(int R) {
  const int hot = std::max(1, R / 4);
  return "uniform: each token K distinct experts, uniform over E. skewed ('hot ranks'): each pick comes with "
         "probability 3/4 from the experts of the first max(1, R/4) ranks (" +
         std::to_string(hot) + " of " + std::to_string(R) +
         " here), else uniformly from the other experts, K distinct per token; every rank's tokens alike";
}

struct Options {
  std::vector<std::int64_t> tokens = {128, 4096};
  std::vector<std::string> dtypes = {"bf16", "fp8"};
  std::vector<std::string> routings = {kRoutingUniform, kRoutingSkewed};
  int ranks = 8;
  int iters = 50;
  int warmup = 5;
  int num_sms = 0;
  std::string partial = "fp32";
  double max_gb = 60.0;
  bool quick = false;
  std::string json_path = "bench_ep.json";
};

void usage() {
  std::fprintf(stderr,
               "usage: bench_ep [--tokens 128,4096] [--dtype bf16,fp8] [--routing uniform,skewed] [--ranks 8]\n"
               "                [--iters 50] [--num-sms 0] [--partial fp32|bf16] [--max-gb 60] [--quick]\n"
               "                [--json bench_ep.json]\n"
               "  --quick: 10 iterations, 2 warm-up calls, expert-major rows only\n");
}

bool parse_args(int argc, char** argv, Options* o) {
  bool iters_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](std::string* v) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_ep: %s needs a value\n", a.c_str());
        return false;
      }
      *v = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      usage();
      std::exit(0);
    } else if (a == "--quick") {
      o->quick = true;
    } else if (a == "--tokens") {
      if (!value(&v)) return false;
      o->tokens.clear();
      for (const std::string& p : sy_bench::comma_parts(v)) {
        const long long t = std::atoll(p.c_str());
        if (t <= 0) {
          std::fprintf(stderr, "bench_ep: bad token count '%s'\n", p.c_str());
          return false;
        }
        o->tokens.push_back(t);
      }
    } else if (a == "--dtype") {
      if (!value(&v)) return false;
      o->dtypes = sy_bench::comma_parts(v);
      for (const std::string& d : o->dtypes) {
        if (d != "bf16" && d != "fp8") {
          std::fprintf(stderr, "bench_ep: bad dtype '%s' (bf16 or fp8)\n", d.c_str());
          return false;
        }
      }
    } else if (a == "--routing") {
      if (!value(&v)) return false;
      o->routings = sy_bench::comma_parts(v);
      for (const std::string& r : o->routings) {
        if (r != kRoutingUniform && r != kRoutingSkewed) {
          std::fprintf(stderr, "bench_ep: bad routing '%s' (uniform or skewed)\n", r.c_str());
          return false;
        }
      }
    } else if (a == "--ranks") {
      if (!value(&v)) return false;
      o->ranks = std::atoi(v.c_str());
    } else if (a == "--iters") {
      if (!value(&v)) return false;
      o->iters = std::atoi(v.c_str());
      iters_given = true;
    } else if (a == "--num-sms") {
      if (!value(&v)) return false;
      o->num_sms = std::atoi(v.c_str());
    } else if (a == "--partial") {
      if (!value(&v)) return false;
      o->partial = v;
      if (v != "fp32" && v != "bf16") {
        std::fprintf(stderr, "bench_ep: bad partial dtype '%s' (fp32 or bf16)\n", v.c_str());
        return false;
      }
    } else if (a == "--max-gb") {
      if (!value(&v)) return false;
      o->max_gb = std::atof(v.c_str());
    } else if (a == "--json") {
      if (!value(&v)) return false;
      o->json_path = v;
    } else {
      std::fprintf(stderr, "bench_ep: unknown argument '%s'\n", a.c_str());
      usage();
      return false;
    }
  }
  if (o->quick) {
    o->warmup = 2;
    if (!iters_given) o->iters = 10;
  }
  if (o->ranks < 1 || kExperts % o->ranks != 0) {
    std::fprintf(stderr, "bench_ep: --ranks %d must divide E = %d\n", o->ranks, kExperts);
    return false;
  }
  if (o->iters < 1) {
    std::fprintf(stderr, "bench_ep: --iters must be >= 1\n");
    return false;
  }
  if (o->tokens.empty() || o->dtypes.empty() || o->routings.empty()) {
    std::fprintf(stderr, "bench_ep: nothing to measure\n");
    return false;
  }
  return true;
}

// ------------------------------------------------------------------------------------------------
// Device memory

struct DevBuf {
  void* p = nullptr;
  std::size_t bytes = 0;
  DevBuf() = default;
  ~DevBuf() {
    if (p) cudaFree(p);
  }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  // On failure leaves p null, clears the (non-sticky) allocation error and says why in *error.
  bool alloc(std::size_t n, const char* what, std::string* error) {
    bytes = n;
    const cudaError_t e = cudaMalloc(&p, std::max<std::size_t>(n, 16));
    if (e == cudaSuccess) return true;
    p = nullptr;
    cudaGetLastError();
    if (error->empty()) {
      *error = std::string("cudaMalloc of ") + std::to_string(n >> 20) + " MiB (" + what + ") failed: " +
               cudaGetErrorString(e);
    }
    return false;
  }
};

// Fills a device buffer with random values: bf16 in +-[0.0625, 2) (never zeros, no NaN), finite
// nonzero fp8 e4m3 bytes, or fp32 in [0.5, 2). A random block of up to 16 MiB is uploaded, then
// tiled with device-to-device copies.
enum class Fill { kBf16, kFp8, kF32 };

bool fill_random(const DevBuf& b, std::uint64_t seed, Fill kind) {
  if (!b.p) return false;
  const std::size_t block = std::min<std::size_t>(b.bytes, std::size_t(16) << 20);
  std::vector<std::uint32_t> host((block + 3) / 4);
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<float> u(0.0625f, 2.0f);
  std::uniform_real_distribution<float> s(0.5f, 2.0f);
  auto bf16 = [&]() {
    const float f = u(g) * ((g() & 1) ? 1.0f : -1.0f);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    return bits >> 16;
  };
  for (auto& v : host) {
    switch (kind) {
      case Fill::kBf16:
        v = bf16() | (bf16() << 16);
        break;
      case Fill::kFp8:
        v = 0x38383838u ^ static_cast<std::uint32_t>(g() & 0x07070707u);  // finite nonzero e4m3 bytes
        break;
      case Fill::kF32: {
        const float f = s(g);
        std::memcpy(&v, &f, 4);
        break;
      }
    }
  }
  if (cudaMemcpy(b.p, host.data(), block, cudaMemcpyHostToDevice) != cudaSuccess) return false;
  for (std::size_t off = block; off < b.bytes; off += block) {
    const std::size_t n = std::min(block, b.bytes - off);
    if (cudaMemcpy(static_cast<char*>(b.p) + off, b.p, n, cudaMemcpyDeviceToDevice) != cudaSuccess) return false;
  }
  return true;
}

bool upload(const DevBuf& b, const void* src, std::size_t n) {
  return b.p && n <= b.bytes && cudaMemcpy(b.p, src, n, cudaMemcpyHostToDevice) == cudaSuccess;
}

// ------------------------------------------------------------------------------------------------
// Routing

// [T,K] distinct global expert ids of one rank's tokens.
std::vector<std::int32_t> make_ids(const std::string& routing, std::int64_t T, int K, int E, int R,
                                   std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T * K));
  const int L = E / R;
  const int hot = std::min(E, std::max(1, R / 4) * L);  // experts of the hot ranks: [0, hot)
  const int cold = E - hot;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::int32_t* row = &ids[static_cast<std::size_t>(t * K)];
    if (routing == kRoutingUniform) {
      for (int e = 0; e < E; ++e) perm[static_cast<std::size_t>(e)] = e;
      for (int k = 0; k < K; ++k) {  // partial Fisher-Yates
        const int j = k + static_cast<int>(g() % static_cast<std::uint64_t>(E - k));
        std::swap(perm[static_cast<std::size_t>(k)], perm[static_cast<std::size_t>(j)]);
        row[k] = perm[static_cast<std::size_t>(k)];
      }
    } else {
      for (int k = 0; k < K;) {
        const bool pick_hot = cold == 0 || (g() % 4) != 0;
        const int e = pick_hot ? static_cast<int>(g() % static_cast<std::uint64_t>(hot))
                               : hot + static_cast<int>(g() % static_cast<std::uint64_t>(cold));
        if (std::find(row, row + k, e) != row + k) continue;
        row[k++] = e;
      }
    }
  }
  return ids;
}

// What the host expects of a dispatch with these ids.
struct Traffic {
  std::int64_t pairs = 0;  // (token, destination rank) pairs, over every source
  std::int64_t picks = 0;  // valid picks: expert-major rows, over every destination
  std::vector<std::int64_t> recv, sent;          // per rank
  std::vector<std::vector<int>> n_dest;          // [rank][token]: destination ranks of the token
};

Traffic count_traffic(const std::vector<std::vector<std::int32_t>>& ids, std::int64_t T, int K, int E, int R) {
  Traffic tr;
  const int L = E / R;
  tr.recv.assign(static_cast<std::size_t>(R), 0);
  tr.sent.assign(static_cast<std::size_t>(R), 0);
  tr.n_dest.assign(static_cast<std::size_t>(R), std::vector<int>(static_cast<std::size_t>(T), 0));
  std::vector<char> to(static_cast<std::size_t>(R));
  for (int s = 0; s < R; ++s) {
    for (std::int64_t t = 0; t < T; ++t) {
      std::fill(to.begin(), to.end(), 0);
      for (int k = 0; k < K; ++k) {
        const int e = ids[static_cast<std::size_t>(s)][static_cast<std::size_t>(t * K + k)];
        if (e < 0 || e >= E) continue;
        to[static_cast<std::size_t>(e / L)] = 1;
        ++tr.picks;
      }
      int n = 0;
      for (int d = 0; d < R; ++d) {
        if (!to[static_cast<std::size_t>(d)]) continue;
        ++n;
        ++tr.recv[static_cast<std::size_t>(d)];
      }
      tr.n_dest[static_cast<std::size_t>(s)][static_cast<std::size_t>(t)] = n;
      tr.sent[static_cast<std::size_t>(s)] += n;
      tr.pairs += n;
    }
  }
  return tr;
}

// ------------------------------------------------------------------------------------------------
// Timing of one call of every rank

struct Runner {
  int R = 0;
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> joins;
  cudaEvent_t start = nullptr, stop = nullptr;
  sy_bench::Gate gate;

  bool init(int ranks, std::string* error) {
    R = ranks;
    if (!gate.init(error)) return false;
    streams.assign(static_cast<std::size_t>(R), nullptr);
    joins.assign(static_cast<std::size_t>(R), nullptr);
    for (int r = 0; r < R; ++r) {
      if (!sy_bench::cuda_ok(cudaStreamCreateWithFlags(&streams[static_cast<std::size_t>(r)], cudaStreamNonBlocking),
                             error) ||
          !sy_bench::cuda_ok(cudaEventCreateWithFlags(&joins[static_cast<std::size_t>(r)], cudaEventDisableTiming),
                             error)) {
        return false;
      }
    }
    return sy_bench::cuda_ok(cudaEventCreate(&start), error) && sy_bench::cuda_ok(cudaEventCreate(&stop), error);
  }
  ~Runner() {
    for (cudaStream_t s : streams)
      if (s) cudaStreamDestroy(s);
    for (cudaEvent_t e : joins)
      if (e) cudaEventDestroy(e);
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
  }

  // Enqueues op(rank, stream) for every rank between the gated start and the end event and returns
  // the elapsed time. Every rank is called even after one fails (its peers wait for it otherwise).
  bool call(const std::function<Status(int, cudaStream_t)>& op, double* us, std::string* error) {
    unsigned value = 0;
    cudaStream_t s0 = streams[0];
    if (!gate.close(s0, kGateTimeoutSeconds, &value)) {
      *error = "launch of the gate kernel failed";
      return false;
    }
    bool ok = sy_bench::cuda_ok(cudaEventRecord(start, s0), error);
    for (int r = 1; r < R; ++r) ok = sy_bench::cuda_ok(cudaStreamWaitEvent(streams[static_cast<std::size_t>(r)], start, 0), error) && ok;
    for (int r = 0; r < R; ++r) {
      const Status st = op(r, streams[static_cast<std::size_t>(r)]);
      if (!st.ok()) {
        if (error->empty()) *error = "rank " + std::to_string(r) + ": " + st.to_string();
        ok = false;
      }
    }
    for (int r = 1; r < R; ++r) {
      ok = sy_bench::cuda_ok(cudaEventRecord(joins[static_cast<std::size_t>(r)], streams[static_cast<std::size_t>(r)]), error) && ok;
      ok = sy_bench::cuda_ok(cudaStreamWaitEvent(s0, joins[static_cast<std::size_t>(r)], 0), error) && ok;
    }
    ok = sy_bench::cuda_ok(cudaEventRecord(stop, s0), error) && ok;
    gate.open(value);
    ok = sy_bench::cuda_ok(cudaEventSynchronize(stop), error) && ok;
    float ms = 0;
    ok = ok && sy_bench::cuda_ok(cudaEventElapsedTime(&ms, start, stop), error);
    if (gate.timed_out()) {
      if (error->empty()) *error = "the start gate timed out (host enqueue took longer than the gate's timeout)";
      ok = false;
    }
    *us = 1000.0 * ms;
    return ok;
  }
};

sy_bench::Timing summarize(std::vector<double> us) {
  sy_bench::Timing t;
  if (us.empty()) {
    t.error = "no samples";
    return t;
  }
  std::sort(us.begin(), us.end());
  t.median_us = us[us.size() / 2];
  t.p10_us = us[us.size() / 10];
  t.p90_us = us[(us.size() * 9) / 10];
  t.ok = true;
  return t;
}

// ------------------------------------------------------------------------------------------------
// One point: (dtype, tokens per rank, routing, form) -> a dispatch row and a combine row

struct Row {
  std::string op;       // dispatch, combine
  std::string form;     // expert-major, rank-major
  std::string dtype;    // bf16, fp8+scales
  std::string routing;
  std::int64_t T = 0;
  sy_bench::Timing timing;
  bool skipped = false;  // not run (memory); timing.error says why
  double deepep_bytes = 0, written_bytes = 0;
  double gbps = 0, written_gbps = 0, pct_copy = 0;
  std::string target;
  bool met = false;
  double mean_dest = 0;
  std::int64_t recv_min = 0, recv_max = 0;
  double memory_gb = 0;
};

struct Shape {
  int R = 0, K = kTopK, E = kExperts, L = 0;
  std::int64_t H = kHidden, T = 0, N = 0, P = 0, tiles = 0, scale_cols = 0;
  DType dtype = DType::kBFloat16;
  DType partial = DType::kFloat32;
  std::size_t elem = 2;
  std::int64_t row_bytes() const { return H * static_cast<std::int64_t>(elem); }
  std::int64_t scale_bytes() const { return scale_cols * 4; }
};

// One rank's buffers, shared by the routings and forms of one (dtype, T).
struct RankBufs {
  DevBuf x, scales, ids, weights;
  DevBuf out_x, out_scales, src_rank, src_token, out_ids, out_weights, stats;
  DevBuf counts, offsets, p2x, p2t, e2p, tile_expert, tile_row_end, totals;
  DevBuf expert_x, expert_scales, handle;
  DevBuf combined;  // [T,H] bf16
  ep::Handle h;
};

// Device bytes a point needs: group regions and layout scratch, every rank's buffers, the shared y.
double estimate_bytes(const Shape& s) {
  const double rb = static_cast<double>(s.row_bytes()), sb = static_cast<double>(s.scale_bytes());
  const double T = static_cast<double>(s.T), N = static_cast<double>(s.N), P = static_cast<double>(s.P);
  const double K = s.K, H = static_cast<double>(s.H);
  const double layout = 4.0 * (2 * s.L + 1 + 2 * P + N * K + 2 * static_cast<double>(s.tiles) + 3);
  double rank = T * (rb + sb + 8 * K) + N * (rb + sb + 8 + 8 * K) + 24 + layout + P * (rb + sb) + T * H * 2;
  ep::GroupConfig c;
  c.num_ranks = s.R;
  c.num_experts = s.E;
  c.top_k = s.K;
  c.max_tokens = s.T;
  c.hidden = s.H;
  c.dtype = s.dtype;
  c.scale_cols = s.scale_cols;
  c.tile_size = kTile;
  c.partial_dtype = s.partial;
  rank += static_cast<double>(ep::handle_bytes(c));
  const double group = static_cast<double>(ep::GpuGroup::region_bytes(c)) + layout + 4.0 * N * K;
  const double shared_y = s.dtype == DType::kBFloat16 ? 0.0 : P * H * 2;
  return s.R * (rank + group) + shared_y;
}

struct Context {
  Options opt;
  double copy_bw = 0;
  int sms = 0;
  int hardware_queues = 8;
  Runner runner;
  std::vector<Row> rows;
  int errors = 0;
  bool fatal = false;  // a CUDA error that leaves the context unusable
};

std::string dtype_label(DType d) { return d == DType::kBFloat16 ? "bf16" : "fp8+scales"; }

void add_rows(Context& cx, const Shape& s, const std::string& routing, const std::string& form,
              const std::string& error, bool skipped, double memory_gb) {
  for (const char* op : {"dispatch", "combine"}) {
    Row r;
    r.op = op;
    r.form = form;
    r.dtype = dtype_label(s.dtype);
    r.routing = routing;
    r.T = s.T;
    r.timing.error = error;
    r.skipped = skipped;
    r.memory_gb = memory_gb;
    cx.rows.push_back(r);
  }
  if (!skipped) ++cx.errors;
}

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Synchronizes, checks every rank, the row counts and (bf16) rank 0's first combined rows.
std::string verify(Context& cx, ep::GpuGroup& group, const Shape& s, std::vector<RankBufs>& b, const Traffic& tr,
                   const std::vector<float>& w0, bool expert_major) {
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    cx.fatal = true;
    return std::string("cudaDeviceSynchronize: ") + cudaGetErrorString(e);
  }
  for (int r = 0; r < s.R; ++r) {
    const Status st = group.check(r);
    if (!st.ok()) return "check(rank " + std::to_string(r) + "): " + st.to_string();
  }
  for (int r = 0; r < s.R; ++r) {
    std::int64_t stats[ep::kNumStats] = {};
    if (cudaMemcpy(stats, b[static_cast<std::size_t>(r)].stats.p, sizeof stats, cudaMemcpyDeviceToHost) != cudaSuccess)
      return "reading rank " + std::to_string(r) + "'s stats failed";
    if (stats[ep::kRecvRows] != tr.recv[static_cast<std::size_t>(r)] ||
        stats[ep::kSentRows] != tr.sent[static_cast<std::size_t>(r)] || stats[ep::kDropped] != 0) {
      return "rank " + std::to_string(r) + " stats recv/sent/dropped " + std::to_string(stats[ep::kRecvRows]) + "/" +
             std::to_string(stats[ep::kSentRows]) + "/" + std::to_string(stats[ep::kDropped]) + ", expected " +
             std::to_string(tr.recv[static_cast<std::size_t>(r)]) + "/" +
             std::to_string(tr.sent[static_cast<std::size_t>(r)]) + "/0";
    }
  }
  if (s.dtype != DType::kBFloat16) return "";
  // Identity experts: expert-major out[t] = (sum of t's weights) * x[t]; rank-major (no weights,
  // each destination's partial is the row itself) out[t] = (destination ranks of t) * x[t].
  const std::int64_t rows = std::min<std::int64_t>(s.T, kCheckRows);
  const std::size_t n = static_cast<std::size_t>(rows * s.H);
  std::vector<std::uint16_t> x(n), out(n);
  if (cudaMemcpy(x.data(), b[0].x.p, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(out.data(), b[0].combined.p, n * 2, cudaMemcpyDeviceToHost) != cudaSuccess) {
    return "reading rank 0's combined rows failed";
  }
  for (std::int64_t t = 0; t < rows; ++t) {
    double scale = 0;
    if (expert_major) {
      for (int k = 0; k < s.K; ++k) scale += w0[static_cast<std::size_t>(t * s.K + k)];
    } else {
      scale = tr.n_dest[0][static_cast<std::size_t>(t)];
    }
    for (std::int64_t h = 0; h < s.H; ++h) {
      const std::size_t i = static_cast<std::size_t>(t * s.H + h);
      const double ref = scale * bf16_to_float(x[i]);
      const double got = bf16_to_float(out[i]);
      if (!(std::fabs(got - ref) <= 1e-2 * std::fabs(ref) + 1e-3)) {
        char msg[200];
        std::snprintf(msg, sizeof msg, "combined row check: rank 0 token %lld column %lld is %g, expected %g",
                      static_cast<long long>(t), static_cast<long long>(h), got, ref);
        return msg;
      }
    }
  }
  return "";
}

void finish_row(const Context& cx, Row* r) {
  if (!r->timing.ok) return;
  const double sec = r->timing.median_us * 1e-6;
  r->gbps = r->deepep_bytes / sec / 1e9;
  r->written_gbps = r->written_bytes / sec / 1e9;
  r->pct_copy = cx.copy_bw > 0 ? 100.0 * r->deepep_bytes / sec / cx.copy_bw : 0;
  if (r->T >= 4096) {
    r->target = ">=75% copy";
    r->met = r->pct_copy >= 75.0;
  } else if (r->T <= 128) {
    r->target = ">=50% copy";
    r->met = r->pct_copy >= 50.0;
  }
}

// Runs every routing and form of one (dtype, T).
void run_shape(Context& cx, DType dtype, std::int64_t T) {
  const Options& o = cx.opt;
  Shape s;
  s.R = o.ranks;
  s.L = s.E / s.R;
  s.T = T;
  s.dtype = dtype;
  s.partial = o.partial == "bf16" ? DType::kBFloat16 : DType::kFloat32;
  s.elem = dtype == DType::kBFloat16 ? 2 : 1;
  s.scale_cols = dtype == DType::kBFloat16 ? 0 : (s.H + 127) / 128;
  ep::GroupConfig c;
  c.num_ranks = s.R;
  c.num_experts = s.E;
  c.top_k = s.K;
  c.max_tokens = T;
  c.hidden = s.H;
  c.dtype = dtype;
  c.scale_cols = s.scale_cols;
  c.tile_size = kTile;
  c.timeout_seconds = kGroupTimeoutSeconds;
  c.partial_dtype = s.partial;
  std::vector<std::string> forms = {"expert-major"};
  if (!o.quick) forms.push_back("rank-major");

  const Status valid = ep::validate(c);
  if (!valid.ok()) {
    for (const std::string& routing : o.routings)
      for (const std::string& form : forms) add_rows(cx, s, routing, form, "config: " + valid.to_string(), false, 0);
    return;
  }
  s.N = ep::max_recv_rows(c);
  s.P = ep::max_expert_rows(c);
  s.tiles = max_tiles(s.N, s.K, s.L, kTile);
  const double need = estimate_bytes(s);
  const double need_gb = need / 1e9;
  std::printf("%s, %lld tokens per rank: about %.1f GB of device memory\n", dtype_label(dtype).c_str(),
              static_cast<long long>(T), need_gb);
  std::fflush(stdout);
  auto skip_all = [&](const std::string& why) {
    std::printf("  skipped: %s\n", why.c_str());
    for (const std::string& routing : o.routings)
      for (const std::string& form : forms) add_rows(cx, s, routing, form, why, true, need_gb);
  };
  if (need_gb > o.max_gb) {
    char why[160];
    std::snprintf(why, sizeof why, "needs about %.1f GB of device memory, above --max-gb %.0f", need_gb, o.max_gb);
    return skip_all(why);
  }

  // Buffers.
  const Device dev = Device::cuda(0);
  std::vector<RankBufs> b(static_cast<std::size_t>(s.R));
  std::string alloc_error;
  const std::size_t rb = static_cast<std::size_t>(s.row_bytes()), sb = static_cast<std::size_t>(s.scale_bytes());
  const std::size_t uT = static_cast<std::size_t>(T), uN = static_cast<std::size_t>(s.N),
                    uP = static_cast<std::size_t>(s.P), uK = static_cast<std::size_t>(s.K),
                    uH = static_cast<std::size_t>(s.H), uL = static_cast<std::size_t>(s.L),
                    utiles = static_cast<std::size_t>(s.tiles);
  bool ok = true;
  for (RankBufs& rb_ : b) {
    ok = ok && rb_.x.alloc(uT * rb, "x", &alloc_error);
    if (sb) ok = ok && rb_.scales.alloc(uT * sb, "scales", &alloc_error);
    ok = ok && rb_.ids.alloc(uT * uK * 4, "topk_ids", &alloc_error) &&
         rb_.weights.alloc(uT * uK * 4, "topk_weights", &alloc_error) &&
         rb_.out_x.alloc(uN * rb, "out.x", &alloc_error);
    if (sb) ok = ok && rb_.out_scales.alloc(uN * sb, "out.scales", &alloc_error);
    ok = ok && rb_.src_rank.alloc(uN * 4, "out.src_rank", &alloc_error) &&
         rb_.src_token.alloc(uN * 4, "out.src_token", &alloc_error) &&
         rb_.out_ids.alloc(uN * uK * 4, "out.topk_ids", &alloc_error) &&
         rb_.out_weights.alloc(uN * uK * 4, "out.topk_weights", &alloc_error) &&
         rb_.stats.alloc(8 * ep::kNumStats, "out.stats", &alloc_error) &&
         rb_.counts.alloc(uL * 4, "layout.counts", &alloc_error) &&
         rb_.offsets.alloc((uL + 1) * 4, "layout.offsets", &alloc_error) &&
         rb_.p2x.alloc(uP * 4, "layout.permuted_to_expanded", &alloc_error) &&
         rb_.p2t.alloc(uP * 4, "layout.permuted_to_token", &alloc_error) &&
         rb_.e2p.alloc(uN * uK * 4, "layout.expanded_to_permuted", &alloc_error) &&
         rb_.tile_expert.alloc(utiles * 4, "layout.tile_expert", &alloc_error) &&
         rb_.tile_row_end.alloc(utiles * 4, "layout.tile_row_end", &alloc_error) &&
         rb_.totals.alloc(kNumTotals * 4, "layout.totals", &alloc_error) &&
         rb_.expert_x.alloc(uP * rb, "out.expert_x", &alloc_error);
    if (sb) ok = ok && rb_.expert_scales.alloc(uP * sb, "out.expert_scales", &alloc_error);
    ok = ok && rb_.handle.alloc(static_cast<std::size_t>((ep::handle_bytes(c) + 3) / 4 * 4), "handle_memory", &alloc_error) &&
         rb_.combined.alloc(uT * uH * 2, "combine out", &alloc_error);
    if (!ok) break;
  }
  DevBuf shared_y;  // fp8: bf16 [P,H] expert outputs shared by every rank's combine (only read)
  if (ok && dtype != DType::kBFloat16) {
    ok = shared_y.alloc(uP * uH * 2, "shared bf16 y", &alloc_error);
    if (ok && !fill_random(shared_y, 99 + static_cast<std::uint64_t>(T), Fill::kBf16)) {
      for (const std::string& routing : o.routings)
        for (const std::string& form : forms) add_rows(cx, s, routing, form, "filling the shared y failed", false, need_gb);
      return;
    }
  }
  if (!ok) return skip_all(alloc_error);

  auto view = [&](const DevBuf& d, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::of(d.p, t, shape, dev);
  };
  std::vector<ep::DispatchInputs> ins(static_cast<std::size_t>(s.R));
  std::vector<ep::DispatchOutputs> outs_em(static_cast<std::size_t>(s.R)), outs_rm(static_cast<std::size_t>(s.R));
  std::vector<TensorView> y_em(static_cast<std::size_t>(s.R)), y_rm(static_cast<std::size_t>(s.R)),
      combined(static_cast<std::size_t>(s.R));
  for (int r = 0; r < s.R; ++r) {
    RankBufs& q = b[static_cast<std::size_t>(r)];
    ep::DispatchInputs& in = ins[static_cast<std::size_t>(r)];
    in.x = view(q.x, dtype, {T, s.H});
    if (sb) in.scales = view(q.scales, DType::kFloat32, {T, s.scale_cols});
    in.topk_ids = view(q.ids, DType::kInt32, {T, s.K});
    in.topk_weights = view(q.weights, DType::kFloat32, {T, s.K});
    ep::DispatchOutputs& rm = outs_rm[static_cast<std::size_t>(r)];
    rm.x = view(q.out_x, dtype, {s.N, s.H});
    if (sb) rm.scales = view(q.out_scales, DType::kFloat32, {s.N, s.scale_cols});
    rm.src_rank = view(q.src_rank, DType::kInt32, {s.N});
    rm.src_token = view(q.src_token, DType::kInt32, {s.N});
    rm.topk_ids = view(q.out_ids, DType::kInt32, {s.N, s.K});
    rm.topk_weights = view(q.out_weights, DType::kFloat32, {s.N, s.K});
    rm.stats = view(q.stats, DType::kInt64, {ep::kNumStats});
    // [handle_bytes] bytes, viewed as int32 words (handle_bytes is a multiple of 16).
    rm.handle_memory = view(q.handle, DType::kInt32, {(ep::handle_bytes(c) + 3) / 4});
    ep::DispatchOutputs& em = outs_em[static_cast<std::size_t>(r)];
    em = rm;
    em.layout.counts = view(q.counts, DType::kInt32, {s.L});
    em.layout.offsets = view(q.offsets, DType::kInt32, {s.L + 1});
    em.layout.permuted_to_expanded = view(q.p2x, DType::kInt32, {s.P});
    em.layout.permuted_to_token = view(q.p2t, DType::kInt32, {s.P});
    em.layout.expanded_to_permuted = view(q.e2p, DType::kInt32, {s.N, s.K});
    em.layout.tile_expert = view(q.tile_expert, DType::kInt32, {s.tiles});
    em.layout.tile_row_end = view(q.tile_row_end, DType::kInt32, {s.tiles});
    em.layout.totals = view(q.totals, DType::kInt32, {kNumTotals});
    em.expert_x = view(q.expert_x, dtype, {s.P, s.H});
    if (sb) em.expert_scales = view(q.expert_scales, DType::kFloat32, {s.P, s.scale_cols});
    if (dtype == DType::kBFloat16) {
      y_em[static_cast<std::size_t>(r)] = view(q.expert_x, DType::kBFloat16, {s.P, s.H});
      y_rm[static_cast<std::size_t>(r)] = view(q.out_x, DType::kBFloat16, {s.N, s.H});
    } else {
      y_em[static_cast<std::size_t>(r)] = view(shared_y, DType::kBFloat16, {s.P, s.H});
      y_rm[static_cast<std::size_t>(r)] = view(shared_y, DType::kBFloat16, {s.N, s.H});
    }
    combined[static_cast<std::size_t>(r)] = view(q.combined, DType::kBFloat16, {T, s.H});
  }

  ep::GpuOptions gopt;
  gopt.worst_case = true;
  gopt.num_sms = o.num_sms;
  gopt.hardware_queues = cx.hardware_queues;

  for (std::size_t ri = 0; ri < o.routings.size() && !cx.fatal; ++ri) {
    const std::string& routing = o.routings[ri];
    // Fresh inputs for every point.
    const std::uint64_t seed = 1000003ull * static_cast<std::uint64_t>(T) + 7919ull * ri +
                               (dtype == DType::kBFloat16 ? 0 : 17);
    std::vector<std::vector<std::int32_t>> ids(static_cast<std::size_t>(s.R));
    std::vector<float> w0;
    bool filled = true;
    for (int r = 0; r < s.R && filled; ++r) {
      RankBufs& q = b[static_cast<std::size_t>(r)];
      const std::uint64_t rs = seed * 131 + static_cast<std::uint64_t>(r);
      ids[static_cast<std::size_t>(r)] = make_ids(routing, T, s.K, s.E, s.R, rs);
      std::vector<float> w(uT * uK);
      std::mt19937_64 g(rs ^ 0x5bd1e995ull);
      std::uniform_real_distribution<float> u(0.01f, 1.0f);
      for (float& v : w) v = u(g);
      if (r == 0) w0 = w;
      filled = fill_random(q.x, rs + 1, dtype == DType::kBFloat16 ? Fill::kBf16 : Fill::kFp8) &&
               (!sb || fill_random(q.scales, rs + 2, Fill::kF32)) &&
               upload(q.ids, ids[static_cast<std::size_t>(r)].data(), uT * uK * 4) &&
               upload(q.weights, w.data(), uT * uK * 4);
    }
    if (!filled) {
      for (const std::string& form : forms) add_rows(cx, s, routing, form, "filling the inputs failed", false, need_gb);
      continue;
    }
    const Traffic tr = count_traffic(ids, T, s.K, s.E, s.R);

    for (const std::string& form : forms) {
      if (cx.fatal) break;
      const bool em = form == "expert-major";
      // A group per point: a failure breaks only its own group.
      std::unique_ptr<ep::GpuGroup> group;
      const Status created = ep::GpuGroup::create_loopback(c, gopt, 0, &group);
      if (!created.ok()) {
        cudaGetLastError();
        const bool oom = created.code() == StatusCode::kCudaError &&
                         created.message().find("out of memory") != std::string::npos;
        if (oom) std::printf("  skipped (%s, %s): %s\n", routing.c_str(), form.c_str(), created.to_string().c_str());
        add_rows(cx, s, routing, form, "create_loopback: " + created.to_string(), oom, need_gb);
        continue;
      }
      const std::vector<ep::DispatchOutputs>& outs = em ? outs_em : outs_rm;
      auto dispatch = [&](int r, cudaStream_t st) {
        return group->dispatch(r, ins[static_cast<std::size_t>(r)], outs[static_cast<std::size_t>(r)],
                               &b[static_cast<std::size_t>(r)].h, false, st);
      };
      auto combine = [&](int r, cudaStream_t st) {
        ep::CombineInputs ci;
        ci.expert_major = em;
        ci.y = em ? y_em[static_cast<std::size_t>(r)] : y_rm[static_cast<std::size_t>(r)];
        return group->combine(r, b[static_cast<std::size_t>(r)].h, ci, combined[static_cast<std::size_t>(r)], false,
                              st);
      };
      std::vector<double> d_us, c_us;
      std::string error;
      for (int i = 0; i < o.warmup + o.iters && error.empty(); ++i) {
        double us = 0;
        if (!cx.runner.call(dispatch, &us, &error)) break;
        if (i >= o.warmup) d_us.push_back(us);
        if (!cx.runner.call(combine, &us, &error)) break;
        if (i >= o.warmup) c_us.push_back(us);
      }
      if (error.empty()) {
        error = verify(cx, *group, s, b, tr, w0, em);
      } else {
        const cudaError_t e = cudaDeviceSynchronize();
        if (e != cudaSuccess) cx.fatal = true;
        for (int r = 0; r < s.R; ++r) {
          const Status st = group->check(r);
          if (!st.ok()) {
            error += "; check(rank " + std::to_string(r) + "): " + st.to_string();
            break;
          }
        }
      }
      if (!error.empty()) {
        std::fprintf(stderr, "bench_ep: %s, T=%lld, %s, %s: %s\n", dtype_label(dtype).c_str(),
                     static_cast<long long>(T), routing.c_str(), form.c_str(), error.c_str());
        add_rows(cx, s, routing, form, error, false, need_gb);
        continue;
      }
      const std::int64_t meta = 8 + 8 * s.K;  // src_rank, src_token, K ids, K weights
      const std::int64_t slot_meta = 4 * (2 + 2 * s.K);
      const std::int64_t row_stride = (s.row_bytes() + 15) / 16 * 16;
      const double pairs = static_cast<double>(tr.pairs);
      double mean_dest = pairs / static_cast<double>(s.R * T);
      const auto mm = std::minmax_element(tr.recv.begin(), tr.recv.end());
      for (int op = 0; op < 2; ++op) {
        Row r;
        r.op = op == 0 ? "dispatch" : "combine";
        r.form = form;
        r.dtype = dtype_label(dtype);
        r.routing = routing;
        r.T = T;
        r.timing = summarize(op == 0 ? d_us : c_us);
        r.mean_dest = mean_dest;
        r.recv_min = *mm.first;
        r.recv_max = *mm.second;
        r.memory_gb = need_gb;
        if (op == 0) {
          r.deepep_bytes = pairs * static_cast<double>(s.row_bytes() + s.scale_bytes());
          r.written_bytes = pairs * static_cast<double>(row_stride + s.scale_bytes() + slot_meta) +
                            pairs * static_cast<double>(s.row_bytes() + s.scale_bytes() + meta) +
                            (em ? static_cast<double>(tr.picks) * static_cast<double>(s.row_bytes() + s.scale_bytes())
                                : 0.0);
        } else {
          r.deepep_bytes = pairs * static_cast<double>(s.H) * 2;
          r.written_bytes = pairs * static_cast<double>(s.H) * static_cast<double>(dtype_size(s.partial)) +
                            static_cast<double>(s.R) * static_cast<double>(T) * static_cast<double>(s.H) * 2;
        }
        finish_row(cx, &r);
        cx.rows.push_back(r);
      }
      std::printf("  %s, %s: dispatch %.1f us, combine %.1f us\n", routing.c_str(), form.c_str(),
                  cx.rows[cx.rows.size() - 2].timing.median_us, cx.rows.back().timing.median_us);
      std::fflush(stdout);
    }
  }
}

std::string shell_quote_args(int argc, char** argv) {
  std::string s = "bench_ep";
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool plain = a.find_first_of(" \t'\"\\$`") == std::string::npos && !a.empty();
    s += " " + (plain ? a : "'" + a + "'");
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  Context cx;
  if (!parse_args(argc, argv, &cx.opt)) return 2;
  const Options& o = cx.opt;

  // Each loopback rank needs a hardware queue of its own: raise CUDA_DEVICE_MAX_CONNECTIONS
  // (default 8) before CUDA starts when R is larger and the caller has not set it.
  const char* conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if ((conn == nullptr || *conn == '\0') && o.ranks > 8) {
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(std::min(o.ranks, 32)).c_str(), 1);
    conn = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  }
  cx.hardware_queues = (conn != nullptr && *conn != '\0') ? std::atoi(conn) : 8;

  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "bench_ep: no CUDA device\n");
    return 1;
  }
  if (cudaSetDevice(0) != cudaSuccess ||
      cudaDeviceGetAttribute(&cx.sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess) {
    std::fprintf(stderr, "bench_ep: cannot use CUDA device 0\n");
    return 1;
  }
  int runtime_version = 0, driver_version = 0;
  cudaRuntimeGetVersion(&runtime_version);
  cudaDriverGetVersion(&driver_version);
  cx.copy_bw = sy_bench::measure_copy_bandwidth();
  if (cx.copy_bw <= 0) {
    std::fprintf(stderr, "bench_ep: measuring the copy bandwidth failed\n");
    return 1;
  }
  std::string error;
  if (!cx.runner.init(o.ranks, &error)) {
    std::fprintf(stderr, "bench_ep: creating streams and events: %s\n", error.c_str());
    return 1;
  }
  // Transport blocks per rank, as GpuGroup picks them for a loopback group (src/cuda/ep/gpu_group.cu).
  const int blocks = o.num_sms > 0 ? o.num_sms : std::min(24, std::max(1, (cx.sms - 1) / o.ranks));
  std::printf("device: %s (%d SMs), copy bandwidth %.2f TB/s, commit %s\n", sy_bench::device_name().c_str(), cx.sms,
              cx.copy_bw / 1e12, SY_GIT_COMMIT);
  std::printf("loopback R=%d, H=%lld, K=%d, E=%d, tile %d, %s partials, %d blocks per rank, %d iterations "
              "(+%d warm-up), hardware queues %d\n\n",
              o.ranks, static_cast<long long>(kHidden), kTopK, kExperts, kTile, o.partial.c_str(), blocks, o.iters,
              o.warmup, cx.hardware_queues);
  std::fflush(stdout);

  for (const std::string& d : o.dtypes) {
    for (std::int64_t T : o.tokens) {
      if (cx.fatal) break;
      run_shape(cx, d == "bf16" ? DType::kBFloat16 : DType::kFloat8E4M3, T);
    }
  }
  if (cx.fatal) std::fprintf(stderr, "bench_ep: a CUDA error left the device unusable; later points not run\n");

  std::printf(
      "\n| op | form | dtype | routing | T/rank | median us | p10 us | p90 us | DeepEP MB | GB/s | %% copy | "
      "written MB | written GB/s | target | met |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> json_points;
  int missed = 0, skipped = 0;
  for (const Row& p : cx.rows) {
    if (!p.timing.ok) {
      if (p.skipped) ++skipped;
      std::printf("| %s | %s | %s | %s | %lld | %s: %s |||||||||| |\n", p.op.c_str(), p.form.c_str(), p.dtype.c_str(),
                  p.routing.c_str(), static_cast<long long>(p.T), p.skipped ? "skipped" : "error",
                  p.timing.error.c_str());
    } else {
      if (!p.target.empty() && !p.met) ++missed;
      std::printf(
          "| %s | %s | %s | %s | %lld | %.1f | %.1f | %.1f | %.1f | %.0f | %.1f | %.1f | %.0f | %s | %s |\n",
          p.op.c_str(), p.form.c_str(), p.dtype.c_str(), p.routing.c_str(), static_cast<long long>(p.T),
          p.timing.median_us, p.timing.p10_us, p.timing.p90_us, p.deepep_bytes / 1e6, p.gbps, p.pct_copy,
          p.written_bytes / 1e6, p.written_gbps, p.target.empty() ? "-" : p.target.c_str(),
          p.target.empty() ? "-" : (p.met ? "yes" : "NO"));
    }
    sy_bench::JsonObject j;
    j.str("op", p.op)
        .str("form", p.form)
        .str("dtype", p.dtype)
        .str("routing", p.routing)
        .num("R", o.ranks)
        .num("H", static_cast<double>(kHidden))
        .num("K", kTopK)
        .num("E", kExperts)
        .num("T_per_rank", static_cast<double>(p.T))
        .num("memory_gb_estimate", p.memory_gb)
        .boolean("ok", p.timing.ok)
        .boolean("skipped", p.skipped);
    if (p.timing.ok) {
      j.num("median_us", p.timing.median_us)
          .num("p10_us", p.timing.p10_us)
          .num("p90_us", p.timing.p90_us)
          .num("deepep_bytes", p.deepep_bytes)
          .num("written_bytes", p.written_bytes)
          .num("gbps", p.gbps)
          .num("written_gbps", p.written_gbps)
          .num("pct_copy_bandwidth", p.pct_copy)
          .num("mean_destination_ranks", p.mean_dest)
          .num("recv_rows_min", static_cast<double>(p.recv_min))
          .num("recv_rows_max", static_cast<double>(p.recv_max))
          .str("target", p.target)
          .boolean("met", p.met);
    } else {
      j.str("error", p.timing.error);
    }
    json_points.push_back(j.dump());
  }

  sy_bench::JsonObject versions;
  versions.str("switchyard", version())
      .num("cuda_runtime", runtime_version)
      .num("cuda_driver", driver_version);
  sy_bench::JsonObject config;
  config.num("ranks", o.ranks)
      .num("hidden", static_cast<double>(kHidden))
      .num("top_k", kTopK)
      .num("experts", kExperts)
      .num("tile_size", kTile)
      .num("fp8_scale_cols", static_cast<double>((kHidden + 127) / 128))
      .str("partial_dtype", o.partial)
      .num("num_sms_option", o.num_sms)
      .num("blocks_per_rank", blocks)
      .num("hardware_queues", cx.hardware_queues)
      .boolean("worst_case", true)
      .num("iters", o.iters)
      .num("warmup", o.warmup)
      .boolean("quick", o.quick);
  sy_bench::JsonObject top;
  top.str("benchmark", "bench_ep")
      .str("device", sy_bench::device_name())
      .num("sms", cx.sms)
      .str("date", sy_bench::utc_now())
      .str("commit", SY_GIT_COMMIT)
      .raw("versions", versions.dump())
      .num("copy_bandwidth_Bps", cx.copy_bw)
      .raw("config", config.dump())
      .str("group", "ep::GpuGroup::create_loopback on device 0: R ranks on one GPU, all traffic through its HBM")
      .str("routing", routing_description(o.ranks))
      .str("forms",
           "expert-major: dispatch writes out.expert_x (tile 1), combine with expert_major and identity experts "
           "(y = expert_x for bf16; one shared random bf16 [P,H] buffer for fp8); rank-major: dispatch without "
           "expert_x, combine of rank-major rows (y = out.x for bf16, the shared buffer for fp8)")
      .str("timing",
           "one call = every rank's dispatch (or combine), each rank on its own non-blocking stream, between a start "
           "event on rank 0's stream (held by a gate kernel until every rank's call is enqueued) and an end event "
           "after joining every stream; median, p10, p90 over iters calls after warmup calls; inputs not rotated")
      .str("bytes_definition",
           "deepep_bytes: pairs = sum over ranks and tokens of the token's destination ranks; dispatch pairs x (row "
           "+ scale bytes), combine pairs x H x 2; gbps = R ranks' deepep_bytes / median; pct_copy_bandwidth = that "
           "over copy_bandwidth_Bps (read + written). written_bytes (stores only): dispatch slots pairs x (row "
           "stride + scales + (2+2K)x4) + rank-major pairs x (row + scales + 8 + 8K) + expert-major picks x (row + "
           "scales); combine partials pairs x H x partial bytes + outputs R x T x H x 2")
      .str("targets", "issue 46: >= 75% of copy bandwidth at 4096 tokens per rank, >= 50% at 128")
      .str("repro", shell_quote_args(argc, argv))
      .raw("points", sy_bench::json_array(json_points));
  bool wrote = false;
  if (FILE* f = std::fopen(o.json_path.c_str(), "w")) {
    wrote = std::fprintf(f, "%s\n", top.dump().c_str()) > 0;
    wrote = std::fclose(f) == 0 && wrote;
  }
  if (!wrote) {
    std::fprintf(stderr, "bench_ep: cannot write %s\n", o.json_path.c_str());
    return 1;
  }
  std::printf("\nwrote %s; points missing their target: %d; skipped: %d; failed: %d\n", o.json_path.c_str(), missed,
              skipped, cx.errors);
  if (cx.errors > 0 || cx.fatal) {
    std::fprintf(stderr, "bench_ep: %d point(s) failed (see the error rows)\n", cx.errors);
    return 1;
  }
  return 0;
}
