"""The torch-free part of the package: import, presets, configurations, size queries, and the
raw binding on plain host memory. Runs wherever the extension builds, PyTorch or not."""

import array
import math

import pytest

import switchyard as sy
from switchyard import _ext

# docs/design.md section 2, routing part, and the hidden sizes listed under it.
DESIGN_PRESETS = [
    # name, E, K, pre, has_bias, n_group, topk_group, rule, post, scale, hidden
    ("mixtral-8x7b", 8, 2, "none", False, 1, 1, "none", "softmax", 1.0, 4096),
    ("qwen3-235b-a22b", 128, 8, "none", False, 1, 1, "none", "softmax", 1.0, 4096),
    ("qwen3-next-80b", 512, 10, "none", False, 1, 1, "none", "softmax", 1.0, 2048),
    ("deepseek-v3", 256, 8, "sigmoid", True, 8, 4, "top2_sum", "normalize", 2.5, 7168),
    ("deepseek-v2", 160, 6, "softmax", False, 8, 3, "max", "none", 16.0, None),
    ("kimi-k2", 384, 8, "sigmoid", True, 1, 1, "none", "normalize", 2.827, 7168),
    ("glm-4.5", 160, 8, "sigmoid", True, 1, 1, "none", "normalize", 2.5, 5120),
    ("llama4-maverick", 128, 1, "none", False, 1, 1, "none", "sigmoid", 1.0, 5120),
    ("gpt-oss-120b", 128, 4, "none", False, 1, 1, "none", "softmax", 1.0, 2880),
    ("dbrx", 16, 4, "softmax", False, 1, 1, "none", "normalize", 1.0, 6144),
    ("wide-2048", 2048, 32, "none", False, 1, 1, "none", "softmax", 1.0, None),
]


def test_import_and_version():
    assert sy.version() == sy.__version__
    assert sy.__version__.count(".") == 2
    assert isinstance(sy.built_with_cuda(), bool)
    assert isinstance(sy.has_torch(), bool)


def test_presets_match_design_table():
    assert list(sy.presets) == [row[0] for row in DESIGN_PRESETS]
    for name, E, K, pre, has_bias, n_group, topk_group, rule, post, scale, hidden in DESIGN_PRESETS:
        p = sy.presets[name]
        assert isinstance(p, sy.RoutingConfig)
        assert (p.name, p.num_experts, p.top_k, p.pre, p.has_bias, p.post, p.group_rule) == (
            name, E, K, pre, has_bias, post, rule)
        if rule != "none":
            assert (p.n_group, p.topk_group) == (n_group, topk_group)
        assert math.isclose(p.scale, scale, rel_tol=1e-6)
        if hidden is not None:
            assert p.hidden_size == hidden
        assert p.routing == sy.RoutingConfig(E, K, pre, post, rule, p.n_group, p.topk_group, p.scale)


def test_routing_config_validation_names_the_field():
    sy.RoutingConfig(num_experts=8, top_k=8)
    with pytest.raises(ValueError, match="config.top_k"):
        sy.RoutingConfig(num_experts=4, top_k=8)  # K > E
    with pytest.raises(ValueError, match="config.top_k"):
        sy.RoutingConfig(num_experts=4, top_k=0)
    with pytest.raises(ValueError, match="config.n_group"):
        sy.RoutingConfig(num_experts=10, top_k=2, group_rule="max", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="config.topk_group"):
        sy.RoutingConfig(num_experts=16, top_k=8, group_rule="max", n_group=8, topk_group=2)
    with pytest.raises(ValueError, match="config.scale"):
        sy.RoutingConfig(num_experts=8, top_k=2, scale=math.inf)
    with pytest.raises(ValueError, match="'pre'"):
        sy.RoutingConfig(num_experts=8, top_k=2, pre="relu")
    with pytest.raises(ValueError, match="'post'"):
        sy.RoutingConfig(num_experts=8, top_k=2, post="tanh")


@pytest.mark.parametrize("T,K,L,M", [(0, 8, 256, 128), (1, 1, 1, 1), (19, 8, 256, 128), (111, 2, 8, 3),
                                     (989, 32, 2048, 64), (5, 4, 0, 7)])
def test_size_queries(T, K, L, M):
    expected_rows = 0 if T == 0 or L == 0 else T * K + min(L, T * K) * (M - 1)
    assert sy.max_permuted_rows(T, K, L, M) == expected_rows
    assert sy.max_tiles(T, K, L, M) == (expected_rows + M - 1) // M


def test_workspace_size():
    assert sy.layout_workspace_size(1024, 8, 256, tile_size=128, device="cpu") == 0
    assert sy.layout_workspace_size(1024, 8, 256, tile_size=128, local=(0, 32), device="cpu") == 0
    assert sy.layout_workspace_size(1024, 8, 256, local=sy.LocalExperts.range(1, 64, 4)) == 0
    with pytest.raises(ValueError, match="config.tile_size"):
        sy.layout_workspace_size(16, 8, 256, tile_size=0)
    with pytest.raises(ValueError, match="config.local"):
        sy.layout_workspace_size(16, 8, 256, local=(250, 8))
    with pytest.raises(ValueError, match="device"):
        sy.layout_workspace_size(16, 8, 256, device="tpu")
    if sy.built_with_cuda():
        assert sy.layout_workspace_size(1024, 8, 256, tile_size=128, device="cuda:0") >= 0


def test_local_experts_forms():
    assert sy.LocalExperts.all().num_local(256) == 256
    assert sy.LocalExperts.range(32, 32).num_local(256) == 32
    from switchyard._core import resolve_local

    assert resolve_local(range(8, 24, 2)) == sy.LocalExperts.range(8, 8, 2)
    assert resolve_local((4, 8)) == sy.LocalExperts.range(4, 8, 1)
    with pytest.raises(TypeError, match="'local'"):
        resolve_local("all")


def _buffer_address(buf):
    address, _ = buf.buffer_info()
    return address


def test_raw_binding_routes_host_memory():
    """The binding alone (no torch): route two Mixtral tokens from array buffers."""
    E, K, T = 8, 2, 2
    logits = array.array("f", [0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0])
    ids = array.array("i", [-7] * (T * K))
    weights = array.array("f", [-7.0] * (T * K))
    cpu = _ext.DeviceType.cpu
    view = lambda buf, dt: _ext.TensorView(_buffer_address(buf), dt, [T, len(buf) // T], [len(buf) // T, 1], cpu, 0)
    cfg = _ext.RoutingConfig()
    cfg.num_experts, cfg.top_k, cfg.post = E, K, _ext.PostFn.softmax
    status = _ext.route(cfg, view(logits, _ext.DType.float32), _ext.TensorView(), view(ids, _ext.DType.int32),
                        view(weights, _ext.DType.float32), 0)
    assert status.ok, status
    assert list(ids) == [7, 6, 0, 1]
    w = 1 / (1 + math.exp(-1))
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(weights, [w, 1 - w, w, 1 - w]))

    # A bad argument: nothing is written, and the status names it.
    bad_ids = array.array("i", [-7] * (T * K))
    status = _ext.route(cfg, view(logits, _ext.DType.float32), _ext.TensorView(), view(bad_ids, _ext.DType.int32),
                        _ext.TensorView(_buffer_address(weights), _ext.DType.float32, [T, K + 1], [K + 1, 1], cpu, 0),
                        0)
    assert not status.ok and "topk_weights" in status.message
    assert list(bad_ids) == [-7] * (T * K)
    with pytest.raises(ValueError, match="topk_weights"):
        sy._core.check_status(status)


def test_status_mapping():
    from switchyard._core import check_status

    class FakeStatus:
        ok = False

        def __init__(self, code, message):
            self.code, self.message = code, message

    with pytest.raises(TypeError, match="'x'"):
        check_status(FakeStatus(_ext.StatusCode.InvalidArgument, "gather: argument 'x': dtype int32 is not supported"))
    with pytest.raises(ValueError, match="'x'"):
        check_status(FakeStatus(_ext.StatusCode.InvalidArgument, "gather: argument 'x': shape [2], expected [*, *]"))
    with pytest.raises(sy.UnsupportedError):
        check_status(FakeStatus(_ext.StatusCode.Unsupported, "route: no CUDA backend"))
    with pytest.raises(RuntimeError, match="CudaError"):
        check_status(FakeStatus(_ext.StatusCode.CudaError, "route: launch failed"))


def test_tensor_functions_need_torch_when_it_is_absent():
    if sy.has_torch():
        pytest.skip("PyTorch is importable here; this checks the message given without it")
    with pytest.raises(ImportError, match="PyTorch"):
        sy.route(None, "mixtral-8x7b")
