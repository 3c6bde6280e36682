// Python binding of the Switchyard C++ API (module switchyard._ext).
//
// This layer only translates: tensors arrive as TensorView (raw data pointer, dtype, shape,
// strides, device) built by the Python side from torch tensors, CUDA streams as the integer
// handle of torch.cuda.current_stream().cuda_stream, and every call returns the library's
// Status, which python/switchyard/_core.py turns into ValueError / TypeError. The extension
// links no libtorch, so one build serves every PyTorch version (and imports without torch).
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/switchyard.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace switchyard {
namespace {

Stream as_stream(std::uintptr_t handle) { return reinterpret_cast<Stream>(handle); }
void* as_pointer(std::uintptr_t address) { return reinterpret_cast<void*>(address); }

// A view from the pieces Python hands over. The Python side rejects more than kMaxDims
// dimensions with the argument's name before it gets here; this check only keeps the
// fixed-size arrays safe.
void init_view(TensorView* view, std::uintptr_t data, DType dtype, const std::vector<std::int64_t>& shape,
               const std::vector<std::int64_t>& strides, DeviceType device_type, int device_index) {
  if (shape.size() != strides.size() || shape.size() > static_cast<std::size_t>(kMaxDims)) {
    throw nb::value_error("TensorView: shape and strides must have the same length, at most 4");
  }
  new (view) TensorView();
  view->data = as_pointer(data);
  view->dtype = dtype;
  view->ndim = static_cast<int>(shape.size());
  for (std::size_t d = 0; d < shape.size(); ++d) {
    view->shape[d] = shape[d];
    view->strides[d] = strides[d];
  }
  view->device = Device{device_type, device_index};
}

std::vector<std::int64_t> view_shape(const TensorView& t) { return {t.shape, t.shape + t.ndim}; }
std::vector<std::int64_t> view_strides(const TensorView& t) { return {t.strides, t.strides + t.ndim}; }

}  // namespace
}  // namespace switchyard

NB_MODULE(_ext, m) {
  using namespace switchyard;
  m.doc() = "Switchyard C++ API on raw pointers (internal; use the switchyard package)";
  // Module-level objects (the absent TensorView, enum values) stay referenced from torch's
  // op registry until interpreter teardown, which nanobind would report as leaks.
  nb::set_leak_warnings(false);

  nb::enum_<StatusCode>(m, "StatusCode")
      .value("Ok", StatusCode::kOk)
      .value("InvalidArgument", StatusCode::kInvalidArgument)
      .value("Unsupported", StatusCode::kUnsupported)
      .value("CudaError", StatusCode::kCudaError)
      .value("Internal", StatusCode::kInternal)
      .value("Timeout", StatusCode::kTimeout);

  nb::class_<Status>(m, "Status")
      .def_prop_ro("ok", &Status::ok)
      .def_prop_ro("code", &Status::code)
      .def_prop_ro("message", [](const Status& s) { return s.message(); })
      .def("__repr__", &Status::to_string);

  nb::enum_<DType>(m, "DType")
      .value("float32", DType::kFloat32)
      .value("bfloat16", DType::kBFloat16)
      .value("float16", DType::kFloat16)
      .value("float8_e4m3", DType::kFloat8E4M3)
      .value("int32", DType::kInt32)
      .value("int64", DType::kInt64);
  m.def("dtype_size", &dtype_size, "dtype"_a);
  m.def("dtype_name", &dtype_name, "dtype"_a);

  nb::enum_<DeviceType>(m, "DeviceType").value("cpu", DeviceType::kCPU).value("cuda", DeviceType::kCUDA);

  nb::class_<TensorView>(m, "TensorView")
      .def(nb::init<>(), "An absent (optional) tensor")
      .def("__init__", &init_view, "data"_a, "dtype"_a, "shape"_a, "strides"_a, "device_type"_a,
           "device_index"_a)
      .def_prop_ro("data", [](const TensorView& t) { return reinterpret_cast<std::uintptr_t>(t.data); })
      .def_prop_ro("dtype", [](const TensorView& t) { return t.dtype; })
      .def_prop_ro("shape", &view_shape)
      .def_prop_ro("strides", &view_strides)
      .def_prop_ro("absent", &TensorView::absent);

  nb::enum_<PreFn>(m, "PreFn")
      .value("none", PreFn::kNone)
      .value("softmax", PreFn::kSoftmax)
      .value("sigmoid", PreFn::kSigmoid)
      .value("sqrtsoftplus", PreFn::kSqrtSoftplus);
  nb::enum_<PostFn>(m, "PostFn")
      .value("none", PostFn::kNone)
      .value("softmax", PostFn::kSoftmax)
      .value("sigmoid", PostFn::kSigmoid)
      .value("normalize", PostFn::kNormalize);
  nb::enum_<GroupRule>(m, "GroupRule")
      .value("none", GroupRule::kNone)
      .value("top2_sum", GroupRule::kTop2Sum)
      .value("max", GroupRule::kMax)
      .value("topk_sum", GroupRule::kTopKSum);

  nb::class_<RoutingConfig>(m, "RoutingConfig")
      .def(nb::init<>())
      .def_rw("num_experts", &RoutingConfig::num_experts)
      .def_rw("top_k", &RoutingConfig::top_k)
      .def_rw("pre", &RoutingConfig::pre)
      .def_rw("post", &RoutingConfig::post)
      .def_rw("group_rule", &RoutingConfig::group_rule)
      .def_rw("n_group", &RoutingConfig::n_group)
      .def_rw("topk_group", &RoutingConfig::topk_group)
      .def_rw("scale", &RoutingConfig::scale);

  nb::class_<ModelPreset>(m, "ModelPreset")
      .def_ro("name", &ModelPreset::name)
      .def_ro("routing", &ModelPreset::routing)
      .def_ro("has_bias", &ModelPreset::has_bias)
      .def_ro("hidden_size", &ModelPreset::hidden_size);
  m.def("model_presets", &model_presets, nb::rv_policy::copy);

  // Layout configuration, flattened: the range form (start, count, stride) or, when
  // expert_map is present, the map form with count = L.
  nb::class_<LayoutConfig>(m, "LayoutConfig")
      .def(
          "__init__",
          [](LayoutConfig* c, int num_experts, int tile_size, int local_start, int local_count,
             int local_stride, const TensorView& expert_map, bool independent_blocks) {
            new (c) LayoutConfig();
            c->independent_blocks = independent_blocks;
            c->num_experts = num_experts;
            c->tile_size = tile_size;
            c->local.start = local_start;
            c->local.count = local_count;
            c->local.stride = local_stride;
            c->local.expert_map = expert_map;
          },
          "num_experts"_a, "tile_size"_a, "local_start"_a, "local_count"_a, "local_stride"_a, "expert_map"_a,
          "independent_blocks"_a = false)
      .def_prop_ro("num_local", &LayoutConfig::num_local)
      .def_ro("independent_blocks", &LayoutConfig::independent_blocks);

  nb::class_<Layout>(m, "Layout")
      .def(nb::init<>())
      .def_rw("counts", &Layout::counts)
      .def_rw("offsets", &Layout::offsets)
      .def_rw("permuted_to_expanded", &Layout::permuted_to_expanded)
      .def_rw("permuted_to_token", &Layout::permuted_to_token)
      .def_rw("expanded_to_permuted", &Layout::expanded_to_permuted)
      .def_rw("tile_expert", &Layout::tile_expert)
      .def_rw("tile_row_end", &Layout::tile_row_end)
      .def_rw("totals", &Layout::totals);
  m.attr("PADDED_TOTAL") = static_cast<int>(kPaddedTotal);
  m.attr("NUM_TILES") = static_cast<int>(kNumTiles);
  m.attr("DROPPED") = static_cast<int>(kDropped);
  m.attr("NUM_TOTALS") = static_cast<int>(kNumTotals);
  m.attr("MAX_GPU_TOP_K") = kMaxGpuTopK;
  m.attr("MAX_GPU_EXPERTS") = kMaxGpuExperts;
  m.attr("SCALE_GROUP_SIZE") = kScaleGroupSize;

  m.def("version", &version);
  m.def("built_with_cuda", &built_with_cuda);
  m.def(
      "validate_routing", [](const RoutingConfig& c) { return validate(c); }, "config"_a);
  m.def(
      "validate_layout", [](const LayoutConfig& c) { return validate(c); }, "config"_a);
  m.def("max_permuted_rows", &max_permuted_rows, "num_tokens"_a, "top_k"_a, "num_local"_a, "tile_size"_a);
  m.def("max_tiles", &max_tiles, "num_tokens"_a, "top_k"_a, "num_local"_a, "tile_size"_a);
  m.def(
      "layout_workspace_size",
      [](const LayoutConfig& c, std::int64_t num_tokens, int top_k, DeviceType device_type,
         int device_index) {
        std::size_t bytes = 0;
        Status s = layout_workspace_size(c, num_tokens, top_k, Device{device_type, device_index}, &bytes);
        return std::make_pair(s, bytes);
      },
      "config"_a, "num_tokens"_a, "top_k"_a, "device_type"_a, "device_index"_a);

  // The operations. None touches a Python object, so the GIL is released: a CPU call may run
  // for a while on the library's threads, a CUDA call only enqueues.
  using release = nb::call_guard<nb::gil_scoped_release>;
  m.def(
      "route",
      [](const RoutingConfig& c, const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
         const TensorView& topk_weights,
         std::uintptr_t stream) { return route(c, logits, bias, topk_ids, topk_weights, as_stream(stream)); },
      "config"_a, "logits"_a, "bias"_a, "topk_ids"_a, "topk_weights"_a, "stream"_a, release());
  m.def(
      "route_backward",
      [](const RoutingConfig& c, const TensorView& logits, const TensorView& bias, const TensorView& topk_ids,
         const TensorView& grad_weights, const TensorView& grad_logits, std::uintptr_t stream) {
        return route_backward(c, logits, bias, topk_ids, grad_weights, grad_logits, as_stream(stream));
      },
      "config"_a, "logits"_a, "bias"_a, "topk_ids"_a, "grad_weights"_a, "grad_logits"_a, "stream"_a, release());
  m.def(
      "layout",
      [](const LayoutConfig& c, const TensorView& topk_ids, const Layout& out, std::uintptr_t workspace,
         std::size_t workspace_bytes, std::uintptr_t stream) {
        return layout(c, topk_ids, out, as_pointer(workspace), workspace_bytes, as_stream(stream));
      },
      "config"_a, "topk_ids"_a, "out"_a, "workspace"_a, "workspace_bytes"_a, "stream"_a, release());
  m.def(
      "route_and_layout",
      [](const RoutingConfig& rc, const TensorView& logits, const TensorView& bias,
         const TensorView& topk_ids, const TensorView& topk_weights, const LayoutConfig& lc,
         const Layout& out, std::uintptr_t workspace, std::size_t workspace_bytes, std::uintptr_t stream) {
        return route_and_layout(rc, logits, bias, topk_ids, topk_weights, lc, out, as_pointer(workspace),
                                workspace_bytes, as_stream(stream));
      },
      "routing"_a, "logits"_a, "bias"_a, "topk_ids"_a, "topk_weights"_a, "layout_config"_a, "out"_a,
      "workspace"_a, "workspace_bytes"_a, "stream"_a, release());
  m.def(
      "gather",
      [](const TensorView& x, const TensorView& x_scales, const Layout& layout, const TensorView& x_perm,
         const TensorView& x_perm_scales, bool zero_fill_padding, std::uintptr_t stream) {
        return gather(x, x_scales, layout, x_perm, x_perm_scales, zero_fill_padding, as_stream(stream));
      },
      "x"_a, "x_scales"_a, "layout"_a, "x_perm"_a, "x_perm_scales"_a, "zero_fill_padding"_a, "stream"_a,
      release());
  m.def(
      "combine",
      [](const TensorView& y_perm, const Layout& layout, const TensorView& topk_weights,
         const TensorView& out, bool accumulate, std::uintptr_t stream) {
        return combine(y_perm, layout, topk_weights, out, accumulate, as_stream(stream));
      },
      "y_perm"_a, "layout"_a, "topk_weights"_a, "out"_a, "accumulate"_a, "stream"_a, release());
  m.def(
      "combine_backward",
      [](const TensorView& grad_out, const TensorView& y_perm, const Layout& layout, const TensorView& topk_weights,
         const TensorView& grad_y_perm, const TensorView& grad_weights, std::uintptr_t stream) {
        return combine_backward(grad_out, y_perm, layout, topk_weights, grad_y_perm, grad_weights, as_stream(stream));
      },
      "grad_out"_a, "y_perm"_a, "layout"_a, "topk_weights"_a, "grad_y_perm"_a, "grad_weights"_a, "stream"_a,
      release());

  // Expert parallelism (ep.h): the CPU reference group. Its collective calls block until every
  // rank has arrived, so they release the GIL: each rank is a Python thread.
  nb::class_<ep::GroupConfig>(m, "EpGroupConfig")
      .def(nb::init<>())
      .def_rw("num_ranks", &ep::GroupConfig::num_ranks)
      .def_rw("num_experts", &ep::GroupConfig::num_experts)
      .def_rw("top_k", &ep::GroupConfig::top_k)
      .def_rw("max_tokens", &ep::GroupConfig::max_tokens)
      .def_rw("hidden", &ep::GroupConfig::hidden)
      .def_rw("dtype", &ep::GroupConfig::dtype)
      .def_rw("scale_cols", &ep::GroupConfig::scale_cols)
      .def_rw("tile_size", &ep::GroupConfig::tile_size)
      .def_rw("timeout_seconds", &ep::GroupConfig::timeout_seconds)
      .def_rw("partial_dtype", &ep::GroupConfig::partial_dtype)
      .def_prop_ro("experts_per_rank", &ep::GroupConfig::experts_per_rank);
  m.def(
      "ep_validate", [](const ep::GroupConfig& c) { return ep::validate(c); }, "config"_a);
  m.def("ep_max_recv_rows", &ep::max_recv_rows, "config"_a);
  m.def("ep_max_expert_rows", &ep::max_expert_rows, "config"_a);
  m.attr("EP_RECV_ROWS") = static_cast<int>(ep::kRecvRows);
  m.attr("EP_SENT_ROWS") = static_cast<int>(ep::kSentRows);
  m.attr("EP_DROPPED") = static_cast<int>(ep::kDropped);
  m.attr("EP_NUM_STATS") = static_cast<int>(ep::kNumStats);

  nb::class_<ep::DispatchInputs>(m, "EpDispatchInputs")
      .def(nb::init<>())
      .def_rw("x", &ep::DispatchInputs::x)
      .def_rw("scales", &ep::DispatchInputs::scales)
      .def_rw("topk_ids", &ep::DispatchInputs::topk_ids)
      .def_rw("topk_weights", &ep::DispatchInputs::topk_weights);
  nb::class_<ep::DispatchOutputs>(m, "EpDispatchOutputs")
      .def(nb::init<>())
      .def_rw("x", &ep::DispatchOutputs::x)
      .def_rw("scales", &ep::DispatchOutputs::scales)
      .def_rw("src_rank", &ep::DispatchOutputs::src_rank)
      .def_rw("src_token", &ep::DispatchOutputs::src_token)
      .def_rw("topk_ids", &ep::DispatchOutputs::topk_ids)
      .def_rw("topk_weights", &ep::DispatchOutputs::topk_weights)
      .def_rw("stats", &ep::DispatchOutputs::stats)
      .def_rw("layout", &ep::DispatchOutputs::layout)
      .def_rw("expert_x", &ep::DispatchOutputs::expert_x)
      .def_rw("expert_scales", &ep::DispatchOutputs::expert_scales)
      .def_rw("handle_memory", &ep::DispatchOutputs::handle_memory);
  nb::class_<ep::CombineInputs>(m, "EpCombineInputs")
      .def(nb::init<>())
      .def_rw("expert_major", &ep::CombineInputs::expert_major)
      .def_rw("y", &ep::CombineInputs::y)
      .def_rw("weighted", &ep::CombineInputs::weighted)
      .def_rw("pick_values", &ep::CombineInputs::pick_values)
      .def_rw("pick_values_out", &ep::CombineInputs::pick_values_out);
  nb::class_<ep::Handle>(m, "EpHandle").def(nb::init<>()).def_prop_ro("valid", &ep::Handle::valid);

  nb::class_<ep::CpuGroup>(m, "EpCpuGroup")
      .def_static(
          "create",
          [](const ep::GroupConfig& c) {
            std::unique_ptr<ep::CpuGroup> group;
            const Status s = ep::CpuGroup::create(c, &group);
            if (!s.ok()) throw nb::value_error(s.message().c_str());  // Python validates first
            return group;
          },
          "config"_a)
      .def("dispatch", &ep::CpuGroup::dispatch, "rank"_a, "inputs"_a, "outputs"_a, "handle"_a, "reuse"_a,
           release())
      .def("combine", &ep::CpuGroup::combine, "rank"_a, "handle"_a, "inputs"_a, "out"_a, "accumulate"_a,
           release())
      .def("broken_reason", &ep::CpuGroup::broken_reason);

  // The GPU transport (ep.h GpuGroup). Its calls only enqueue on the stream they are given
  // (the integer handle of a torch CUDA stream), so they release the GIL like the other CUDA
  // calls; received_rows may wait for the host-visible count, also without the GIL. In builds
  // without the CUDA backend the C++ stubs return Unsupported, which the Python side raises.
  m.def("ep_handle_bytes", &ep::handle_bytes, "config"_a);
  m.def("ep_region_bytes", &ep::GpuGroup::region_bytes, "config"_a);
  nb::class_<ep::GpuOptions>(m, "EpGpuOptions")
      .def(nb::init<>())
      .def_rw("worst_case", &ep::GpuOptions::worst_case)
      .def_rw("num_sms", &ep::GpuOptions::num_sms)
      .def_rw("hardware_queues", &ep::GpuOptions::hardware_queues);
  nb::class_<ep::GpuGroup>(m, "EpGpuGroup")
      // Returns (Status, group or None): creation failing is an ordinary Status here, as a
      // CPU-only build's Unsupported must reach Python as UnsupportedError.
      .def_static(
          "create_loopback",
          [](const ep::GroupConfig& c, const ep::GpuOptions& o, int device) {
            std::unique_ptr<ep::GpuGroup> group;
            Status s;
            {
              nb::gil_scoped_release unlocked;
              s = ep::GpuGroup::create_loopback(c, o, device, &group);
            }
            return std::make_pair(s, std::move(group));
          },
          "config"_a, "options"_a, "device"_a)
      // all_gather: a Python callable taking this rank's bytes and returning every rank's,
      // concatenated by rank (R times as many). It runs on this thread with the GIL held (the
      // C++ call keeps the GIL: the callable is Python). An exception it raises is re-raised
      // here after create_ipc returns.
      .def_static(
          "create_ipc",
          [](const ep::GroupConfig& c, const ep::GpuOptions& o, int rank, nb::callable all_gather) {
            std::unique_ptr<nb::python_error> raised;
            const int R = c.num_ranks;
            ep::AllGather gather = [&](const void* send, std::size_t bytes, void* recv) -> Status {
              try {
                nb::bytes mine(static_cast<const char*>(send), bytes);
                nb::object got = all_gather(mine);
                if (!nb::isinstance<nb::bytes>(got)) {
                  return Status::InvalidArgument("ep ipc group: the all_gather callable must return bytes, got " +
                                                 std::string(nb::type_name(got.type()).c_str()));
                }
                nb::bytes all = nb::borrow<nb::bytes>(got);
                const std::size_t want = bytes * static_cast<std::size_t>(R);
                if (all.size() != want) {
                  return Status::InvalidArgument("ep ipc group: the all_gather callable returned " +
                                                 std::to_string(all.size()) + " bytes, expected " +
                                                 std::to_string(want) + " (num_ranks x " + std::to_string(bytes) +
                                                 "); is num_ranks the process group's size?");
                }
                std::memcpy(recv, all.c_str(), want);
                return Status::Ok();
              } catch (nb::python_error& e) {
                raised = std::make_unique<nb::python_error>(std::move(e));
                return Status::Internal("ep ipc group: the all_gather callable raised");
              }
            };
            std::unique_ptr<ep::GpuGroup> group;
            Status s = ep::GpuGroup::create_ipc(c, o, rank, gather, &group);
            if (raised) throw std::move(*raised);
            return std::make_pair(s, std::move(group));
          },
          "config"_a, "options"_a, "rank"_a, "all_gather"_a)
      .def("is_local", &ep::GpuGroup::is_local, "rank"_a)
      .def(
          "dispatch",
          [](ep::GpuGroup& g, int rank, const ep::DispatchInputs& in, const ep::DispatchOutputs& out,
             ep::Handle* handle, bool reuse, std::uintptr_t stream) {
            return g.dispatch(rank, in, out, handle, reuse, as_stream(stream));
          },
          "rank"_a, "inputs"_a, "outputs"_a, "handle"_a, "reuse"_a, "stream"_a, release())
      .def(
          "combine",
          [](ep::GpuGroup& g, int rank, const ep::Handle& handle, const ep::CombineInputs& in,
             const TensorView& out, bool accumulate, std::uintptr_t stream) {
            return g.combine(rank, handle, in, out, accumulate, as_stream(stream));
          },
          "rank"_a, "handle"_a, "inputs"_a, "out"_a, "accumulate"_a, "stream"_a, release())
      .def("adopt_handle", &ep::GpuGroup::adopt_handle, "rank"_a, "handle_memory"_a, "tokens"_a, "expert_major"_a,
           "handle"_a)
      .def(
          "received_rows",
          [](ep::GpuGroup& g, int rank) {
            std::int64_t rows = 0;
            Status s = g.received_rows(rank, &rows);
            return std::make_pair(s, rows);
          },
          "rank"_a, release())
      .def("check", &ep::GpuGroup::check, "rank"_a);
}
