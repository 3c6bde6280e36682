// Public routing API: validation, presets and backend dispatch.
#include <string>
#include <vector>

#include "api/backend_dispatch.h"
#include "api/routing_checks.h"
#include "common/op_args.h"
#include "common/validate.h"
#include "cpu/backend.h"
#include "switchyard/routing.h"
#if defined(SWITCHYARD_WITH_CUDA)
#include "cuda/backend.h"
#endif

namespace switchyard {

namespace {

ModelPreset make_preset(const char* name, int experts, int k, PreFn pre, bool bias, int n_group,
                        int topk_group, GroupRule rule, PostFn post, float scale, int hidden) {
  ModelPreset p;
  p.name = name;
  p.routing.num_experts = experts;
  p.routing.top_k = k;
  p.routing.pre = pre;
  p.routing.post = post;
  p.routing.group_rule = rule;
  p.routing.n_group = n_group;
  p.routing.topk_group = topk_group;
  p.routing.scale = scale;
  p.has_bias = bias;
  p.hidden_size = hidden;
  return p;
}

}  // namespace

const std::vector<ModelPreset>& model_presets() {
  // docs/design.md section 2, table order. Hidden sizes from the same file; wide-2048 is synthetic.
  static const std::vector<ModelPreset> presets = {
      make_preset("mixtral-8x7b", 8, 2, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 4096),
      make_preset("qwen3-235b-a22b", 128, 8, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 4096),
      make_preset("qwen3-next-80b", 512, 10, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 2048),
      make_preset("deepseek-v3", 256, 8, PreFn::kSigmoid, true, 8, 4, GroupRule::kTop2Sum, PostFn::kNormalize, 2.5f, 7168),
      make_preset("deepseek-v2", 160, 6, PreFn::kSoftmax, false, 8, 3, GroupRule::kMax, PostFn::kNone, 16.0f, 5120),
      make_preset("kimi-k2", 384, 8, PreFn::kSigmoid, true, 1, 1, GroupRule::kNone, PostFn::kNormalize, 2.827f, 7168),
      make_preset("glm-4.5", 160, 8, PreFn::kSigmoid, true, 1, 1, GroupRule::kNone, PostFn::kNormalize, 2.5f, 5120),
      make_preset("llama4-maverick", 128, 1, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSigmoid, 1.0f, 5120),
      make_preset("gpt-oss-120b", 128, 4, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 2880),
      make_preset("dbrx", 16, 4, PreFn::kSoftmax, false, 1, 1, GroupRule::kNone, PostFn::kNormalize, 1.0f, 6144),
      make_preset("wide-2048", 2048, 32, PreFn::kNone, false, 1, 1, GroupRule::kNone, PostFn::kSoftmax, 1.0f, 4096),
  };
  return presets;
}

Status find_preset(const std::string& name, ModelPreset* preset) {
  std::string known;
  for (const ModelPreset& p : model_presets()) {
    if (p.name == name) {
      if (preset != nullptr) *preset = p;
      return Status::Ok();
    }
    known += (known.empty() ? "" : ", ") + p.name;
  }
  return Status::InvalidArgument("find_preset: argument 'name': unknown preset '" + name +
                                 "'; known presets: " + known);
}

Status validate(const RoutingConfig& config) {
  return detail::check_routing_config(detail::ArgChecker("validate"), config);
}

Status route(const RoutingConfig& config, const TensorView& logits, const TensorView& bias,
             const TensorView& topk_ids, const TensorView& topk_weights, Stream stream,
             const RouteOptions& options) {
  detail::RouteArgs args;
  SY_RETURN_IF_ERROR(detail::check_route_args(detail::ArgChecker("route"), config, logits, bias,
                                              topk_ids, topk_weights, &args));
  args.options = options;
  SY_RETURN_IF_ERROR(detail::backend_available("route", logits.device));
  if (args.num_tokens == 0) return Status::Ok();
#if defined(SWITCHYARD_WITH_CUDA)
  if (logits.device.is_cuda()) return cuda::route(args, stream);
#endif
  (void)stream;
  return cpu::route(args);
}

Status route_backward(const RoutingConfig& config, const TensorView& logits, const TensorView& bias,
                      const TensorView& topk_ids, const TensorView& grad_weights, const TensorView& grad_logits,
                      Stream stream) {
  const detail::ArgChecker check("route_backward");
  detail::RouteBackwardArgs args;
  SY_RETURN_IF_ERROR(
      detail::check_route_args(check, config, logits, bias, topk_ids, grad_weights, &args.route, "grad_weights"));
  SY_RETURN_IF_ERROR(check.tensor(grad_logits, "grad_logits", {logits.dtype},
                                  {args.route.num_tokens, config.num_experts}, logits.device));
  args.grad_logits = grad_logits.data;
  SY_RETURN_IF_ERROR(detail::backend_available("route_backward", logits.device));
  if (args.route.num_tokens == 0) return Status::Ok();
#if defined(SWITCHYARD_WITH_CUDA)
  if (logits.device.is_cuda()) return cuda::route_backward(args, stream);
#endif
  (void)stream;
  return cpu::route_backward(args);
}

}  // namespace switchyard
