// Expert parallelism, CPU reference (include/switchyard/ep.h; docs/design.md section 6).
//
// R ranks are R threads of one process sharing a State. A collective call is a sequence of
// steps separated by barriers (each wait bounded by the group's timeout):
//   dispatch: post arguments + send counts -> [barrier] -> every rank checks every rank's
//             arguments -> [barrier] -> each rank, as destination, reads its peers' posted
//             inputs and writes its outputs; as source, records where its tokens went
//             -> [barrier] -> handles point at the finished plan.
//   combine:  post arguments -> [barrier] -> check -> [barrier] -> each rank reduces its
//             received rows into its partial rows -> [barrier] -> each rank, as source, sums
//             its tokens' partials over the destination ranks in rank order -> [barrier].
// The barrier after the argument check is what makes "nothing written on error" hold for every
// rank; the last barrier of each call keeps a fast rank's next call from overwriting what a
// slow rank still reads.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "api/ep_checks.h"
#include "common/ep_memory.h"
#include "common/numeric.h"
#include "common/validate.h"
#include "cpu/elements.h"
#include "switchyard/ep.h"
#include "switchyard/permute.h"

namespace switchyard::ep {

using switchyard::detail::ArgChecker;
using switchyard::detail::Contiguity;
using switchyard::detail::kAnySize;

// ---------------------------------------------------------------------------------------------
// Configuration.

// ---------------------------------------------------------------------------------------------
// Handle and shared state.

Handle::Handle() = default;
Handle::~Handle() = default;
Handle::Handle(const Handle&) = default;
Handle& Handle::operator=(const Handle&) = default;
bool Handle::valid() const { return plan != nullptr; }

struct CpuGroup::State {
  GroupConfig config;
  std::chrono::duration<double> timeout;

  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t generation = 0;
  int arrived_count = 0;
  std::vector<char> arrived;
  std::vector<std::string> at_step;  // the barrier each rank waits at
  std::string broken;
  StatusCode broken_code = StatusCode::kTimeout;

  // Posted per rank for the current collective.
  std::vector<const DispatchInputs*> in;
  std::vector<const DispatchOutputs*> out;
  std::vector<const CombineInputs*> combine_in;
  std::vector<std::string> error;           // argument error of each rank ("" = fine)
  std::vector<std::vector<std::int64_t>> send_count;  // [R][R] tokens s sends to d
  std::vector<const std::vector<char>*> goes;         // [R] each source's [T,R] destinations
  std::vector<std::shared_ptr<const Handle::Plan>> posted_plan;  // reuse: each rank's handle
  std::vector<char> reuse;
  std::shared_ptr<Handle::Plan> plan;       // being built by this dispatch
  std::vector<std::vector<float>> partial;  // [R] each rank's partial rows (combine)
  std::vector<std::vector<float>> partial_values;  // [R] each rank's pick values [rows,K] (combine)

  // Waits until every rank has arrived at this barrier (`step` names it), for at most the
  // group's timeout. `on_last` runs under the lock in the last rank to arrive.
  template <typename F>
  Status barrier(int rank, const std::string& step, F on_last) {
    std::unique_lock<std::mutex> lock(mu);
    if (!broken.empty()) return Status(broken_code, broken);
    const std::uint64_t gen = generation;
    arrived[rank] = 1;
    at_step[rank] = step;
    if (++arrived_count == config.num_ranks) {
      for (int r = 0; r < config.num_ranks; ++r) {
        if (at_step[r] != step) {
          // Ranks in different collectives cannot be brought back in step: break the group.
          broken = "ep: the ranks are in different calls (rank " + std::to_string(r) + " at '" + at_step[r] +
                   "', rank " + std::to_string(rank) + " at '" + step +
                   "'); every rank must make the same collective calls in the same order; rebuild the group";
          broken_code = StatusCode::kInvalidArgument;
          cv.notify_all();
          return Status(broken_code, broken);
        }
      }
      on_last();
      arrived_count = 0;
      std::fill(arrived.begin(), arrived.end(), 0);
      ++generation;
      cv.notify_all();
      return Status::Ok();
    }
    cv.wait_for(lock, timeout, [&] { return generation != gen || !broken.empty(); });
    if (generation != gen) return Status::Ok();
    if (!broken.empty()) return Status(broken_code, broken);
    if (broken.empty()) {
      std::string missing;
      for (int r = 0; r < config.num_ranks; ++r) {
        if (!arrived[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      broken = "ep " + step + ": rank(s) " + missing + " did not arrive within " +
               std::to_string(config.timeout_seconds) + " s (seen by rank " + std::to_string(rank) +
               "); the group is broken, rebuild it";
      broken_code = StatusCode::kTimeout;
      cv.notify_all();
    }
    return Status(broken_code, broken);
  }
  Status barrier(int rank, const std::string& step) {
    return barrier(rank, step, [] {});
  }

  // The first rank's argument error, or Ok (read between the post and the check barriers).
  Status first_error(const char* op) const {
    for (int r = 0; r < config.num_ranks; ++r) {
      if (!error[r].empty()) {
        return Status::InvalidArgument(std::string(op) + ": rank " + std::to_string(r) + " - " + error[r]);
      }
    }
    return Status::Ok();
  }
};

CpuGroup::CpuGroup(std::unique_ptr<State> state) : state_(std::move(state)) {}
CpuGroup::~CpuGroup() = default;

Status CpuGroup::create(const GroupConfig& config, std::unique_ptr<CpuGroup>* group) {
  if (group == nullptr) return Status::InvalidArgument("ep group: argument 'group' is null");
  SY_RETURN_IF_ERROR(validate(config));
  auto s = std::make_unique<State>();
  const int R = config.num_ranks;
  s->config = config;
  s->timeout = std::chrono::duration<double>(config.timeout_seconds);
  s->arrived.assign(R, 0);
  s->at_step.assign(R, std::string());
  s->in.assign(R, nullptr);
  s->out.assign(R, nullptr);
  s->combine_in.assign(R, nullptr);
  s->error.assign(R, std::string());
  s->send_count.assign(R, std::vector<std::int64_t>(R, 0));
  s->goes.assign(R, nullptr);
  s->posted_plan.assign(R, nullptr);
  s->reuse.assign(R, 0);
  s->partial.assign(R, std::vector<float>());
  s->partial_values.assign(R, std::vector<float>());
  group->reset(new CpuGroup(std::move(s)));
  return Status::Ok();
}

const GroupConfig& CpuGroup::config() const { return state_->config; }

std::string CpuGroup::broken_reason() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->broken;
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

namespace {

// The rank owning global expert e (contiguous blocks of L experts), or -1 for ids outside [0, E).
std::int64_t load_id(const TensorView& ids, std::int64_t i) {
  return ids.dtype == DType::kInt64 ? static_cast<const std::int64_t*>(ids.data)[i]
                                    : static_cast<const std::int32_t*>(ids.data)[i];
}

int owner_of(std::int64_t e, std::int64_t E, int L) { return (e >= 0 && e < E) ? static_cast<int>(e / L) : -1; }

// A view of the first `rows` rows of a contiguous 2-D (or 1-D) view.
TensorView first_rows(const TensorView& t, std::int64_t rows) {
  TensorView v = t;
  v.shape[0] = rows;
  return v;
}

}  // namespace

Status CpuGroup::dispatch(int rank, const DispatchInputs& in, const DispatchOutputs& out, Handle* handle,
                          bool reuse) {
  State& s = *state_;
  const GroupConfig& c = s.config;
  SY_RETURN_IF_ERROR(detail::check_rank("ep dispatch", rank, c.num_ranks));
  if (handle == nullptr) return Status::InvalidArgument("ep dispatch: argument 'handle' is null");
  const int R = c.num_ranks;
  const int K = c.top_k;
  const int L = c.experts_per_rank();
  const std::int64_t E = c.num_experts;

  // 1. Check the own arguments, count what goes where, post.
  const std::string op = "ep dispatch (rank " + std::to_string(rank) + ")";
  const ArgChecker check(op.c_str());
  Status own = detail::check_dispatch(c, check, in, out, Device::cpu());
  std::vector<std::int64_t> send(R, 0);
  std::vector<std::int64_t> ids;
  std::vector<char> goes;  // [T,R]: token t goes to rank d (read by the peers, as destinations)
  if (own.ok()) {
    const std::int64_t T = in.x.shape[0];
    ids.resize(static_cast<std::size_t>(T * K));
    goes.assign(static_cast<std::size_t>(T * R), 0);
    for (std::int64_t i = 0; i < T * K; ++i) {
      ids[static_cast<std::size_t>(i)] = load_id(in.topk_ids, i);
      const int d = owner_of(ids[static_cast<std::size_t>(i)], E, L);
      if (d >= 0) goes[static_cast<std::size_t>((i / K) * R + d)] = 1;
    }
    for (std::int64_t t = 0; t < T; ++t)
      for (int d = 0; d < R; ++d) send[d] += goes[static_cast<std::size_t>(t * R + d)];
    if (reuse) {
      if (!handle->valid() || handle->plan->group != &s) {
        own = check.fail_arg("handle", "reuse asked for, but the handle is not from a dispatch of this group");
      } else if (handle->plan->ranks[rank].ids != ids) {
        own = check.fail_arg("in.topk_ids", "differ from those of the handle's dispatch (reuse needs the same "
                                            "routing)");
      }
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.in[rank] = &in;
    s.out[rank] = &out;
    s.error[rank] = own.ok() ? std::string() : own.message();
    s.send_count[rank] = send;
    s.goes[rank] = &goes;
    s.reuse[rank] = reuse ? 1 : 0;
    s.posted_plan[rank] = reuse ? handle->plan : nullptr;
  }
  SY_RETURN_IF_ERROR(s.barrier(rank, "dispatch: arguments posted", [&] {
    // Every rank must agree on reuse, and reuse the same dispatch.
    for (int r = 1; r < R; ++r) {
      if (s.error[0].empty() && s.error[r].empty() && (s.reuse[r] != s.reuse[0] || s.posted_plan[r] != s.posted_plan[0])) {
        s.error[r] = "argument 'reuse' / 'handle': the ranks disagree on reusing one dispatch's handle";
      }
    }
    s.plan = std::make_shared<Handle::Plan>();
    s.plan->group = &s;
    s.plan->ranks.resize(R);
  }));
  const Status all = s.first_error("ep dispatch");
  std::shared_ptr<Handle::Plan> plan = s.plan;
  // Offsets of each source's rows at this rank, and of this rank's rows at each destination.
  std::vector<std::int64_t> recv_from(R + 1, 0);
  std::vector<std::int64_t> my_offset(R, 0);
  for (int src = 0; src < R; ++src) recv_from[src + 1] = recv_from[src] + s.send_count[src][rank];
  for (int d = 0; d < R; ++d)
    for (int src = 0; src < rank; ++src) my_offset[d] += s.send_count[src][d];
  SY_RETURN_IF_ERROR(s.barrier(rank, "dispatch: arguments checked"));
  if (!all.ok()) return all;

  // 2. As destination: read the peers' rows (ordered by source rank, then token).
  const std::int64_t H = c.hidden;
  const std::size_t elem = dtype_size(c.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * elem;
  const std::int64_t rows = recv_from[R];
  Handle::Plan::Rank& mine = plan->ranks[rank];
  mine.src_rank.resize(static_cast<std::size_t>(rows));
  mine.src_token.resize(static_cast<std::size_t>(rows));
  mine.local_ids.resize(static_cast<std::size_t>(rows * K));
  mine.weights.resize(static_cast<std::size_t>(rows * K));
  auto* ox = static_cast<unsigned char*>(out.x.data);
  std::int64_t row = 0;
  for (int src = 0; src < R; ++src) {
    const DispatchInputs& pin = *s.in[src];
    const std::int64_t T = pin.x.shape[0];
    const auto* px = static_cast<const unsigned char*>(pin.x.data);
    const auto* pw = static_cast<const float*>(pin.topk_weights.data);
    const std::vector<char>& pgoes = *s.goes[src];
    for (std::int64_t t = 0; t < T; ++t) {
      if (!pgoes[static_cast<std::size_t>(t * R + rank)]) continue;
      std::memcpy(ox + static_cast<std::size_t>(row) * row_bytes,
                  px + static_cast<std::size_t>(t * pin.x.strides[0]) * elem, row_bytes);
      if (c.scale_cols > 0) {
        std::memcpy(static_cast<float*>(out.scales.data) + row * c.scale_cols,
                    static_cast<const float*>(pin.scales.data) + t * c.scale_cols,
                    static_cast<std::size_t>(c.scale_cols) * sizeof(float));
      }
      for (int k = 0; k < K; ++k) {
        const std::int64_t e = load_id(pin.topk_ids, t * K + k);
        const std::int32_t local = owner_of(e, E, L) == rank ? static_cast<std::int32_t>(e - rank * L) : -1;
        mine.local_ids[static_cast<std::size_t>(row * K + k)] = local;
        mine.weights[static_cast<std::size_t>(row * K + k)] = pw[t * K + k];
      }
      mine.src_rank[static_cast<std::size_t>(row)] = src;
      mine.src_token[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(t);
      ++row;
    }
  }
  std::copy(mine.src_rank.begin(), mine.src_rank.end(), static_cast<std::int32_t*>(out.src_rank.data));
  std::copy(mine.src_token.begin(), mine.src_token.end(), static_cast<std::int32_t*>(out.src_token.data));
  std::copy(mine.local_ids.begin(), mine.local_ids.end(), static_cast<std::int32_t*>(out.topk_ids.data));
  std::copy(mine.weights.begin(), mine.weights.end(), static_cast<float*>(out.topk_weights.data));

  // As source: where each token went, and the counts.
  const std::int64_t T = in.x.shape[0];
  mine.tokens = T;
  mine.ids = ids;
  mine.dest_row.assign(static_cast<std::size_t>(T * R), -1);
  std::vector<std::int64_t> next = my_offset;
  std::int64_t sent = 0, dropped = 0;
  for (std::int64_t t = 0; t < T; ++t) {
    for (int d = 0; d < R; ++d) {
      if (goes[static_cast<std::size_t>(t * R + d)]) {
        mine.dest_row[static_cast<std::size_t>(t * R + d)] = static_cast<std::int32_t>(next[d]++);
        ++sent;
      }
    }
    for (int k = 0; k < K; ++k) {
      const std::int64_t e = ids[static_cast<std::size_t>(t * K + k)];
      dropped += (e != -1 && owner_of(e, E, L) < 0) ? 1 : 0;
    }
  }
  auto* stats = static_cast<std::int64_t*>(out.stats.data);
  stats[kRecvRows] = rows;
  stats[kSentRows] = sent;
  stats[kDropped] = dropped;

  // Expert-major: the section 3 layout of the received rows, and the rows gathered into it.
  Status local = Status::Ok();
  if (!out.expert_x.absent()) {
    mine.expert_major = true;
    LayoutConfig lc;
    lc.num_experts = L;
    lc.local = LocalExperts::all();
    lc.tile_size = c.tile_size;
    // The received rows are the layout's tokens: T' = rows (the arrays hold T' = N).
    Layout lay = out.layout;
    lay.expanded_to_permuted = first_rows(out.layout.expanded_to_permuted, rows);
    local = switchyard::layout(lc, first_rows(out.topk_ids, rows), lay, nullptr, 0);
    if (local.ok()) {
      local = switchyard::gather(first_rows(out.x, rows), c.scale_cols > 0 ? first_rows(out.scales, rows) : TensorView{},
                                 lay, out.expert_x, out.expert_scales, /*zero_fill_padding=*/true);
    }
    if (local.ok()) {
      const auto* e2p = static_cast<const std::int32_t*>(out.layout.expanded_to_permuted.data);
      mine.expanded_to_permuted.assign(e2p, e2p + rows * K);
    }
  }
  // 3. Every rank's plan part is written before any handle is used.
  SY_RETURN_IF_ERROR(s.barrier(rank, "dispatch: rows written"));
  if (!local.ok()) return Status::Internal("ep dispatch (rank " + std::to_string(rank) + "): " + local.message());
  // Also on reuse: the routing is the same, but combine must see this dispatch's weights.
  handle->plan = plan;
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------
// Combine.

using cpu::load_float;
using cpu::store_float;

Status CpuGroup::combine(int rank, const Handle& handle, const CombineInputs& in, const TensorView& out,
                         bool accumulate) {
  State& s = *state_;
  const GroupConfig& c = s.config;
  SY_RETURN_IF_ERROR(detail::check_rank("ep combine", rank, c.num_ranks));
  const int R = c.num_ranks;
  const int K = c.top_k;
  const std::int64_t H = c.hidden;
  const std::string op = "ep combine (rank " + std::to_string(rank) + ")";
  const ArgChecker check(op.c_str());
  const Device cpu = Device::cpu();
  const std::initializer_list<DType> float_types = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};

  // 1. Check, post.
  Status own = Status::Ok();
  if (!handle.valid() || handle.plan->group != &s) {
    own = check.fail_arg("handle", "is not from a dispatch of this group");
  } else if (in.expert_major && !handle.plan->ranks[rank].expert_major) {
    own = check.fail_arg("in.expert_major", "set, but the handle's dispatch wrote no expert-major output");
  } else {
    const std::int64_t rows = in.expert_major ? max_expert_rows(c) : max_recv_rows(c);
    own = check.tensor(in.y, "in.y", float_types, {rows, H}, cpu, Contiguity::kRowStrided);
    if (own.ok()) own = check.tensor(out, "out", float_types, {handle.plan->ranks[rank].tokens, H}, cpu);
    if (own.ok() && in.pick_values.data != nullptr) {
      own = check.tensor(in.pick_values, "in.pick_values", {DType::kFloat32}, {max_recv_rows(c), K}, cpu);
    }
    if (own.ok() && in.pick_values_out.data != nullptr) {
      own = check.tensor(in.pick_values_out, "in.pick_values_out", {DType::kFloat32},
                         {handle.plan->ranks[rank].tokens, K}, cpu);
    }
  }
  {
    std::lock_guard<std::mutex> lock(s.mu);
    s.combine_in[rank] = &in;
    s.error[rank] = own.ok() ? std::string() : own.message();
    s.posted_plan[rank] = handle.plan;
  }
  SY_RETURN_IF_ERROR(s.barrier(rank, "combine: arguments posted", [&] {
    for (int r = 1; r < R; ++r) {
      if (s.error[0].empty() && s.error[r].empty() && s.posted_plan[r] != s.posted_plan[0]) {
        s.error[r] = "argument 'handle': the ranks pass handles of different dispatches";
      }
    }
  }));
  const Status all = s.first_error("ep combine");
  SY_RETURN_IF_ERROR(s.barrier(rank, "combine: arguments checked"));
  if (!all.ok()) return all;

  // 2. As destination: this rank's partial of each received row, fp32.
  const Handle::Plan& plan = *handle.plan;
  const Handle::Plan::Rank& mine = plan.ranks[rank];
  const std::int64_t rows = static_cast<std::int64_t>(mine.src_rank.size());
  std::vector<float>& partial = s.partial[rank];
  partial.assign(static_cast<std::size_t>(rows * H), 0.0f);
  std::vector<float>& values = s.partial_values[rank];
  values.assign(static_cast<std::size_t>(rows * K), 0.0f);
  if (in.pick_values.data != nullptr) {
    const auto* v = static_cast<const float*>(in.pick_values.data);
    std::copy(v, v + rows * K, values.begin());
  }
  const std::int64_t y_stride = in.y.strides[0];
  for (std::int64_t i = 0; i < rows; ++i) {
    float* acc = partial.data() + i * H;
    if (in.expert_major) {
      for (int k = 0; k < K; ++k) {
        const std::int32_t p = mine.expanded_to_permuted[static_cast<std::size_t>(i * K + k)];
        if (p < 0) continue;  // a pick on another rank (or none)
        const float w = in.weighted ? mine.weights[static_cast<std::size_t>(i * K + k)] : 1.0f;
        for (std::int64_t h = 0; h < H; ++h) {
          acc[h] = switchyard::detail::cuda_nan_if_nan(
              std::fmaf(w, load_float(in.y.data, in.y.dtype, p * y_stride + h), acc[h]));
        }
      }
    } else {
      for (std::int64_t h = 0; h < H; ++h) acc[h] = load_float(in.y.data, in.y.dtype, i * y_stride + h);
    }
    if (c.partial_dtype == DType::kBFloat16) {
      for (std::int64_t h = 0; h < H; ++h) acc[h] = switchyard::detail::bf16_to_float(switchyard::detail::float_to_bf16(acc[h]));
    }
  }
  SY_RETURN_IF_ERROR(s.barrier(rank, "combine: partials written"));

  // 3. As source: sum the partials of the ranks each token went to, in rank order.
  const std::int64_t T = mine.tokens;
  std::vector<float> sum(static_cast<std::size_t>(H));
  for (std::int64_t t = 0; t < T; ++t) {
    bool any = false;
    for (int d = 0; d < R; ++d) {
      const std::int32_t r = mine.dest_row[static_cast<std::size_t>(t * R + d)];
      if (r < 0) continue;
      const float* p = s.partial[d].data() + static_cast<std::int64_t>(r) * H;
      if (!any) {
        std::copy(p, p + H, sum.begin());
        any = true;
      } else {
        for (std::int64_t h = 0; h < H; ++h) sum[h] = switchyard::detail::cuda_nan_if_nan(sum[h] + p[h]);
      }
    }
    if (!any) std::fill(sum.begin(), sum.end(), 0.0f);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t o = t * H + h;
      store_float(out.data, out.dtype, o,
                  accumulate ? switchyard::detail::cuda_nan_if_nan(sum[h] + load_float(out.data, out.dtype, o))
                             : sum[h]);
    }
    if (in.pick_values_out.data != nullptr) {
      float* vo = static_cast<float*>(in.pick_values_out.data) + t * K;
      for (int k = 0; k < K; ++k) {
        float v = 0.0f;
        bool first = true;
        for (int d = 0; d < R; ++d) {
          const std::int32_t r = mine.dest_row[static_cast<std::size_t>(t * R + d)];
          if (r < 0) continue;
          const float pv = s.partial_values[d][static_cast<std::size_t>(static_cast<std::int64_t>(r) * K + k)];
          v = first ? pv : switchyard::detail::cuda_nan_if_nan(v + pv);
          first = false;
        }
        vo[k] = v;
      }
    }
  }
  // 4. Nobody may overwrite the partials while a peer still reads them.
  return s.barrier(rank, "combine: done");
}

// ---------------------------------------------------------------------------------------------

Status run_ranks(int num_ranks, const std::function<Status(int rank)>& fn) {
  if (num_ranks < 1) return Status::InvalidArgument("ep run_ranks: argument 'num_ranks' must be >= 1");
  std::vector<Status> result(static_cast<std::size_t>(num_ranks));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(num_ranks));
  for (int r = 0; r < num_ranks; ++r) threads.emplace_back([&, r] { result[static_cast<std::size_t>(r)] = fn(r); });
  for (std::thread& t : threads) t.join();
  for (const Status& st : result)
    if (!st.ok()) return st;
  return Status::Ok();
}

}  // namespace switchyard::ep
