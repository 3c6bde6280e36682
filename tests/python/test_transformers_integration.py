"""switchyard.integrations.transformers on tiny random-weight models built from configs (no
downloads): the "switchyard" experts implementation and patched routers against transformers'
"eager" experts and routers, for Qwen3-MoE (with and without renormalized top-K weights),
Qwen3-Next, DeepSeek-V2 (grouped and greedy), DeepSeek-V3, Mixtral, gpt-oss and GLM-4.5, and
Llama 4's router (its experts do not go through the registry).

Tolerances on the CPU: in fp32, logits of a full forward within rtol 1e-4, atol 1e-5 of "eager"
(measured differences are ~1e-7: "eager" sums a token's expert outputs expert by expert with
index_add_, switchyard.combine in k order in fp32; the GEMMs are the same torch calls on
differently ordered rows), one MoE block's output within rtol 1e-5, atol 1e-6; in bf16, rtol
1.6e-2, atol 1e-2 (where "grouped_mm" is up to 4e-3 from "eager"). Greedy generation of 8
tokens (fp32) gives the same tokens. Gradients (fp32, loss.backward() of the language-model
loss): every parameter's gradient within 1e-4 of "eager"'s, relative to its max abs
(GRAD_TOL below)."""

import inspect
import types

import pytest

from sy_testing import cuda_skip_reason, require_torch

torch = require_torch()

TRANSFORMERS_REASON = ("transformers (>= 5.14, with the experts registry transformers.integrations.moe) is not "
                       "importable here, so the tests of switchyard.integrations.transformers skip; "
                       "pip install 'switchyard[transformers]' (scripts/test --all installs it)")
try:
    import transformers
    from transformers.integrations.moe import ExpertsInterface, use_experts_implementation
except ImportError as e:  # pragma: no cover - depends on the machine
    pytest.skip(f"{TRANSFORMERS_REASON} ({e})", allow_module_level=True)

import switchyard.integrations.transformers as sy_hf  # noqa: E402

_version = sy_hf._major_minor(transformers.__version__)
if _version is None or not sy_hf._SUPPORTED_RANGE[0] <= _version < sy_hf._SUPPORTED_RANGE[1]:
    pytest.skip(f"transformers {transformers.__version__} is outside the supported range "
                f"{sy_hf.SUPPORTED_TRANSFORMERS} (pip install 'switchyard[transformers]')", allow_module_level=True)

import switchyard as sy  # noqa: E402

sy_hf.register()

VOCAB = 128
ATTN = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def qwen3_moe_config():
    return transformers.Qwen3MoeConfig(**ATTN, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                       num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)


def qwen3_moe_unnormalized_config():  # Qwen3MoeConfig's default: top-K softmax weights without renormalization
    config = qwen3_moe_config()
    config.norm_topk_prob = False
    return config


def deepseek_v3_config():
    attn = dict(ATTN, num_key_value_heads=4)
    return transformers.DeepseekV3Config(**attn, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16,
                                         num_experts_per_tok=4, n_group=4, topk_group=2, n_shared_experts=1,
                                         first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                                         kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                         v_head_dim=8)


def qwen3_next_config():
    return transformers.Qwen3NextConfig(**ATTN, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, num_experts=16, num_experts_per_tok=4,
                                        norm_topk_prob=True, layer_types=["linear_attention", "full_attention"],
                                        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                        linear_num_value_heads=4)


def deepseek_v2_config():
    attn = dict(ATTN, num_key_value_heads=4)
    return transformers.DeepseekV2Config(**attn, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16,
                                         num_experts_per_tok=4, topk_method="group_limited_greedy", n_group=4,
                                         topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
                                         routed_scaling_factor=16.0, kv_lora_rank=16, q_lora_rank=24,
                                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)


def deepseek_v2_greedy_config():  # DeepSeek-V2-Lite's routing: no groups
    config = deepseek_v2_config()
    config.topk_method = "greedy"
    return config


def llama4_config():  # Llama 4 runs its experts densely (no experts registry): its router alone
    return transformers.Llama4TextConfig(**ATTN, head_dim=8, intermediate_size=16, intermediate_size_mlp=64,
                                         num_local_experts=8, num_experts_per_tok=1)


def mixtral_config():
    return transformers.MixtralConfig(**ATTN, head_dim=8, intermediate_size=32, num_local_experts=8,
                                      num_experts_per_tok=2)


def gpt_oss_config():
    attn = dict(ATTN, max_position_embeddings=131072)  # its YaRN RoPE's context (no memory is sized by it)
    return transformers.GptOssConfig(**attn, head_dim=8, intermediate_size=16, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=4)


def glm4_moe_config():
    return transformers.Glm4MoeConfig(**ATTN, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=16,
                                      num_experts_per_tok=4, n_group=1, topk_group=1, n_shared_experts=1,
                                      first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True)


MODELS = {
    "qwen3_moe": qwen3_moe_config,
    "qwen3_moe_unnormalized": qwen3_moe_unnormalized_config,
    "qwen3_next": qwen3_next_config,
    "deepseek_v2": deepseek_v2_config,
    "deepseek_v2_greedy": deepseek_v2_greedy_config,
    "deepseek_v3": deepseek_v3_config,
    "llama4": llama4_config,
    "mixtral": mixtral_config,
    "gpt_oss": gpt_oss_config,
    "glm4_moe": glm4_moe_config,
}


def tiny_model(name):
    """The tiny model, in eval mode, with its MoE weights redrawn large enough (std 0.2) that
    routing is decisive and the experts' outputs matter to the logits, and a random selection
    bias where the model has one."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[name](), attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if ".mlp." in pname or ".feed_forward." in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


def moe_blocks(model):
    return [m for m in model.modules() if hasattr(m, "experts") and any(
        isinstance(getattr(m, a, None), torch.nn.Module) for a in ("gate", "router"))]


def input_ids(batch=2, length=9):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(2))


def logits_with(model, experts, patched=False, device="cpu"):
    model.set_experts_implementation(experts)
    sy_hf.unpatch_routers(model)
    if patched:
        assert sy_hf.patch_routers(model) == len(moe_blocks(model))
    try:
        with torch.no_grad():
            return model(input_ids().to(device)).logits
    finally:
        sy_hf.unpatch_routers(model)


_built = {}


def shared_model(name):
    """tiny_model(name), built once per session for the tests that leave it as they found it."""
    if name not in _built:
        _built[name] = tiny_model(name)
    return _built[name]


each_model = pytest.mark.parametrize("name", sorted(MODELS))


def test_registered():
    assert sy_hf.NAME in ExpertsInterface._global_mapping
    assert ExpertsInterface._global_mapping[sy_hf.NAME] is sy_hf.experts_forward


@each_model
def test_logits_match_eager(name):
    model = shared_model(name)
    eager = logits_with(model, "eager")
    assert len(moe_blocks(model)) >= 1
    switchyard = logits_with(model, "switchyard")
    torch.testing.assert_close(switchyard, eager, rtol=1e-4, atol=1e-5)
    patched = logits_with(model, "switchyard", patched=True)
    torch.testing.assert_close(patched, eager, rtol=1e-4, atol=1e-5)
    # Patched routers under the "eager" experts: the routing alone.
    torch.testing.assert_close(logits_with(model, "eager", patched=True), eager, rtol=1e-4, atol=1e-5)


@each_model
def test_bf16_logits_match_eager(name):
    """In bf16 (CPU), within bf16's own tolerance (rtol 1.6e-2) plus atol 1e-2 for logits of
    magnitude ~0.5: "grouped_mm" itself is up to 4e-3 from "eager" here."""
    model = tiny_model(name).to(torch.bfloat16)
    eager = logits_with(model, "eager").float()
    torch.testing.assert_close(logits_with(model, "switchyard").float(), eager, rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(logits_with(model, "switchyard", patched=True).float(), eager, rtol=1.6e-2,
                               atol=1e-2)


@each_model
def test_experts_matter(name):
    """The comparison above would be empty if the MoE blocks hardly changed the logits."""
    model = shared_model(name)
    eager = logits_with(model, "eager")
    for b in moe_blocks(model):
        b.experts.forward = lambda h, *args: torch.zeros_like(h)
    try:
        without = logits_with(model, "eager")
    finally:
        for b in moe_blocks(model):
            del b.experts.forward  # back to the class's forward
    assert (without - eager).abs().max() > 1e-2


@each_model
def test_greedy_generation_matches_eager(name):
    model = shared_model(name)

    def generate(experts, patched):
        model.set_experts_implementation(experts)
        if patched:
            sy_hf.patch_routers(model)
        try:
            with torch.no_grad():
                out = model.generate(input_ids(length=5), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                     pad_token_id=0)
        finally:
            sy_hf.unpatch_routers(model)
        return out[:, 5:]

    eager = generate("eager", False)
    assert eager.shape == (2, 8)
    assert torch.equal(generate("switchyard", False), eager)
    assert torch.equal(generate("switchyard", True), eager)


@each_model
def test_moe_block_outputs_match_eager(name):
    """Each MoE block alone, at several token counts (1 = a decode step), tighter than logits."""
    model = shared_model(name)
    g = torch.Generator().manual_seed(3)
    for block in moe_blocks(model):
        for tokens in (1, 3, 19):
            x = torch.randn(1, tokens, 32, generator=g)
            outs = []
            for experts, patched in (("eager", False), ("switchyard", False), ("switchyard", True)):
                model.set_experts_implementation(experts)
                if patched:
                    sy_hf.patch_routers(block)
                with torch.no_grad():
                    out = block(x)
                sy_hf.unpatch_routers(block)
                outs.append(out[0] if isinstance(out, tuple) else out)
            assert outs[0].abs().max() > 0.1
            torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-6)


@each_model
def test_patched_router_outputs(name):
    """Same (logits, weights, ids) as the original router, as sets of (id, weight) per token,
    with the weights' dtype and the ids' int64."""
    model = shared_model(name)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(23, 32, generator=g)
    for block in moe_blocks(model):
        router = getattr(block, "gate", None) or block.router
        with torch.no_grad():
            want = router(x)
            assert sy_hf.patch_routers(block) == 1
            got = router(x)
            sy_hf.unpatch_routers(block)
        if name == "llama4":  # (dense scores, logits)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
            continue
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        assert got[1].dtype == want[1].dtype and got[2].dtype == torch.int64
        order_w, order_g = want[2].argsort(dim=1), got[2].argsort(dim=1)
        assert torch.equal(got[2].gather(1, order_g), want[2].gather(1, order_w))
        torch.testing.assert_close(got[1].gather(1, order_g), want[1].gather(1, order_w), rtol=1e-5, atol=1e-6)


# Gradients (fp32): each parameter's gradient within GRAD_TOL of "eager"'s, relative to that
# gradient's max abs (atol = GRAD_TOL * max|eager grad|, rtol 0). Measured on the CPU (loss of
# input_ids()): up to ~1e-6 for every parameter of these models, ~1e-5 for Qwen3-Next's A_log
# (as far with patched routers under "eager" experts alone): the same sums in another order.
# A 1e-3 relative change in combine's weight gradient or route's backward fails the test.
GRAD_TOL = 1e-4


def loss_grads(model, experts, patched=False):
    """{parameter name: gradient} of the language-model loss of input_ids() under `experts`
    (and patched routers), the model left without gradients and unpatched."""
    model.set_experts_implementation(experts)
    sy_hf.unpatch_routers(model)
    model.zero_grad(set_to_none=True)
    if patched:
        assert sy_hf.patch_routers(model) == len(moe_blocks(model))
    try:
        ids = input_ids()
        model(ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    finally:
        sy_hf.unpatch_routers(model)
        model.zero_grad(set_to_none=True)


def assert_grads_close(got, want):
    assert set(got) == set(want)
    for n, w in want.items():
        bound = GRAD_TOL * w.abs().max().item()
        torch.testing.assert_close(got[n], w, rtol=0, atol=bound, msg=lambda m: f"{n}: {m}")


@each_model
def test_gradients_match_eager(name):
    """loss.backward() through the "switchyard" experts (and patched routers) gives every
    parameter the gradient "eager" gives it: the experts' weights (and biases), the routers'
    weights, attention and embeddings."""
    model = shared_model(name)
    eager = loss_grads(model, "eager")
    moe = [n for n in eager if ".experts." in n or ".gate.weight" in n or ".router.weight" in n]
    assert any(".experts." in n for n in moe) and any(not (".experts." in n) for n in moe)
    for n in moe:  # the comparison would be empty with zero gradients
        assert eager[n].abs().max() > 0, n
    runs = [("eager", True)]  # Llama 4: its router alone (its experts do not go through the registry)
    if type(model)._can_set_experts_implementation():
        runs += [("switchyard", False), ("switchyard", True)]
    for experts, patched in runs:
        assert_grads_close(loss_grads(model, experts, patched), eager)


# ----------------------------------------------------------------------------- routers and rules

REAL_CONFIGS = {  # the routing part of each model's published config, and the preset with its rule
    "qwen3-235b-a22b": lambda: transformers.Qwen3MoeConfig(num_experts=128, num_experts_per_tok=8,
                                                           norm_topk_prob=True),
    "qwen3-next-80b": lambda: transformers.Qwen3NextConfig(),
    "deepseek-v2": lambda: transformers.DeepseekV2Config(n_routed_experts=160, num_experts_per_tok=6,
                                                         topk_method="group_limited_greedy", n_group=8,
                                                         topk_group=3, routed_scaling_factor=16.0),
    "deepseek-v3": lambda: transformers.DeepseekV3Config(),
    "llama4-maverick": lambda: transformers.Llama4TextConfig(num_local_experts=128, num_experts_per_tok=1),
    "mixtral-8x7b": lambda: transformers.MixtralConfig(),
    "gpt-oss-120b": lambda: transformers.GptOssConfig(num_local_experts=128, num_experts_per_tok=4),
    "glm-4.5": lambda: transformers.Glm4MoeConfig(n_routed_experts=160, num_experts_per_tok=8,
                                                  routed_scaling_factor=2.5),
}


@pytest.mark.parametrize("preset", sorted(REAL_CONFIGS))
def test_router_rule_is_the_preset(preset):
    """A router built from the model's real routing configuration (hidden size shrunk) gets
    exactly the rule of Switchyard's preset for that model."""
    config = REAL_CONFIGS[preset]()
    config.hidden_size = 8
    kind = [k for k, v in sy_hf.PATCHABLE_ROUTERS.items() if v == preset]
    assert len(kind) == 1
    model_type, class_name = kind[0]
    module = __import__(f"transformers.models.{model_type}.modeling_{model_type}", fromlist=[class_name])
    router = getattr(module, class_name)(config)
    assert sy_hf.router_routing(router) == sy.presets[preset].routing


def test_older_router_form_is_unsupported():
    """A known router class without what the rule reads (its form before transformers 5.14)
    is refused, naming what is missing, and nothing is patched."""
    model = tiny_model("glm4_moe")
    router = moe_blocks(model)[0].gate
    del router.num_group
    with pytest.raises(sy.UnsupportedError, match="patch_routers: Glm4MoeTopkRouter .* no num_group"):
        sy_hf.patch_routers(model)
    assert sy_hf.unpatch_routers(model) == 0


def test_deepseek_v2_unknown_topk_method_is_unsupported():
    model = tiny_model("deepseek_v2")
    routers = [b.gate for b in moe_blocks(model)]
    routers[-1].topk_method = "noaux_tc"
    with pytest.raises(sy.UnsupportedError, match="topk_method 'noaux_tc' has no Switchyard rule"):
        sy_hf.patch_routers(model)
    assert sy_hf.unpatch_routers(model) == 0  # none patched, not even the good ones before it


def test_router_routing_rejects_unknown_module():
    with pytest.raises(ValueError, match="router_routing: argument 'module'"):
        sy_hf.router_routing(torch.nn.Linear(2, 2))


def test_patch_routers_is_idempotent_and_reversible():
    model = tiny_model("deepseek_v3")
    n = len(moe_blocks(model))
    keys = set(model.state_dict())
    assert sy_hf.patch_routers(model) == n
    assert sy_hf.patch_routers(model) == n
    assert set(model.state_dict()) == keys
    assert sy_hf.unpatch_routers(model) == n
    assert sy_hf.unpatch_routers(model) == 0
    assert sy_hf.patch_routers(torch.nn.Linear(2, 2)) == 0


# ----------------------------------------------------------------------------- the registry's flags


FLAG_DEFAULTS = dict(has_gate=True, has_bias=False, is_transposed=False, has_post_expert_norm=False)


def synthetic_experts(has_gate, has_bias, is_transposed, has_post_expert_norm, E=6, H=16, I=12):
    """An experts module with the given flags of use_experts_implementation (the combinations
    no tiny model above covers: non-gated, post-expert norm)."""

    class Experts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.num_experts = E
            g = torch.Generator().manual_seed(5)
            up_out = 2 * I if has_gate else I

            def param(*shape):
                return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.3)

            shape = (lambda o, i: (E, i, o)) if is_transposed else (lambda o, i: (E, o, i))
            if has_gate:
                self.gate_up_proj = param(*shape(up_out, H))
                self.gate_up_proj_bias = param(E, up_out)
            else:
                self.up_proj = param(*shape(up_out, H))
                self.up_proj_bias = param(E, up_out)
            self.down_proj = param(*shape(H, I))
            self.down_proj_bias = param(E, H)
            self.act_fn = torch.nn.functional.gelu
            self.post_expert_norm = torch.nn.LayerNorm(H)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            raise AssertionError("the eager forward is not used here")

    flags = dict(has_gate=has_gate, has_bias=has_bias, is_transposed=is_transposed,
                 has_post_expert_norm=has_post_expert_norm)
    known = inspect.signature(use_experts_implementation).parameters
    for flag, value in flags.items():
        if flag not in known and value != FLAG_DEFAULTS[flag]:
            pytest.skip(f"transformers {transformers.__version__} has no {flag} flag in use_experts_implementation")
    decorated = use_experts_implementation(Experts, **{k: v for k, v in flags.items() if k in known})
    return decorated(types.SimpleNamespace(_experts_implementation="batched_mm"))


@pytest.mark.parametrize("has_gate", [True, False])
@pytest.mark.parametrize("has_bias", [True, False])
@pytest.mark.parametrize("is_transposed", [True, False])
@pytest.mark.parametrize("has_post_expert_norm", [False, True])
def test_registry_flags_match_batched_mm(has_gate, has_bias, is_transposed, has_post_expert_norm):
    """Every flag combination against transformers' "batched_mm" (one bmm per pair, no sort),
    with ids that repeat, skip experts and include EP sentinels (ids >= num_experts, weight 0)."""
    experts = synthetic_experts(has_gate, has_bias, is_transposed, has_post_expert_norm)
    g = torch.Generator().manual_seed(6)
    T, K, E = 17, 3, experts.num_experts
    x = torch.randn(T, 16, generator=g)
    ids = torch.randint(0, E - 1, (T, K), generator=g)  # expert E-1 gets no token
    weights = torch.rand(T, K, generator=g)
    ids[0, 1] = E  # a sentinel of transformers' expert parallelism
    weights[0, 1] = 0.0
    experts._is_expert_parallel = True
    with torch.no_grad():
        want = ExpertsInterface._global_mapping["batched_mm"](experts, x, ids, weights)
        got = sy_hf.experts_forward(experts, x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    # Gradients of x, the routing weights and the expert parameters (fp32, GRAD_TOL relative to
    # each gradient's max abs). The sentinel's routing weight is left out: "batched_mm" runs
    # the sentinel pair on expert num_experts-1 and so gives its weight a gradient; the
    # layout does not place it (gradient 0). Its weight 0 keeps it out of every other gradient.
    grads, sentinel = [], []
    for forward in (ExpertsInterface._global_mapping["batched_mm"], sy_hf.experts_forward):
        experts.zero_grad(set_to_none=True)
        xg, wg = x.clone().requires_grad_(), weights.clone().requires_grad_()
        out = forward(experts, xg, ids, wg)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(7)))
        sentinel.append(wg.grad[0, 1].item())
        wg.grad[0, 1] = 0.0
        grads.append(dict(x=xg.grad, weights=wg.grad, **{n: p.grad for n, p in experts.named_parameters()
                                                         if p.grad is not None}))
    assert_grads_close(grads[1], grads[0])
    assert sentinel[1] == 0.0


def test_per_expert_loop_matches_transformers_grouped_linear():
    """The fallback for a transformers without _grouped_linear gives the same results."""
    model = shared_model("gpt_oss")  # transposed weights with biases
    want = logits_with(model, "switchyard")
    saved = sy_hf._grouped_linear
    sy_hf._grouped_linear = sy_hf._grouped_linear_loop
    try:
        got = logits_with(model, "switchyard")
    finally:
        sy_hf._grouped_linear = saved
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_outputs_are_run_to_run_identical():
    model = shared_model("qwen3_moe")
    first = logits_with(model, "switchyard", patched=True)
    for _ in range(3):
        assert torch.equal(logits_with(model, "switchyard", patched=True), first)


# ----------------------------------------------------------------------------- GPU

needs_gpu = pytest.mark.skipif(cuda_skip_reason() is not None, reason=f"GPU checks: {cuda_skip_reason()}")


@needs_gpu
@each_model
def test_cuda_bf16_logits_match_eager(name):
    """bf16 on the GPU: "switchyard" (and with patched routers) is as close to "eager" as
    transformers' own "grouped_mm" is, or within atol 2e-2 (logits of magnitude ~0.5)."""
    model = tiny_model(name).to("cuda", torch.bfloat16)
    eager = logits_with(model, "eager", device="cuda").float()
    bound = 2e-2
    try:
        grouped = logits_with(model, "grouped_mm", device="cuda").float()
        bound = max(bound, 2 * float((grouped - eager).abs().max()))
    except ValueError:  # Llama 4's experts are not in the registry: its router alone is switched
        pass
    for patched in (False, True):
        got = logits_with(model, "switchyard", patched=patched, device="cuda").float()
        err = float((got - eager).abs().max())
        assert err <= bound, f"patched={patched}: max abs error {err:.3g} against eager, bound {bound:.3g}"


@needs_gpu
@each_model
def test_cuda_twenty_forwards_are_identical(name):
    """The determinism claim: 20 forwards with "switchyard" (patched routers) give identical
    bytes on the GPU."""
    model = tiny_model(name).to("cuda", torch.bfloat16)
    first = logits_with(model, "switchyard", patched=True, device="cuda")
    for i in range(19):
        assert torch.equal(logits_with(model, "switchyard", patched=True, device="cuda"), first), f"forward {i + 2}"
