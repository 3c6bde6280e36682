"""Bad input raises ValueError or TypeError naming the argument, and writes nothing."""

import pytest

from sy_testing import devices, need_cuda, poison_like, require_torch

torch = require_torch()

import switchyard as sy  # noqa: E402


def snapshot(*tensors):
    return [t.clone() for t in tensors if t is not None]


def unchanged(before, *tensors):
    after = [t for t in tensors if t is not None]
    return all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                           if b.element_size() == 1 else b) for a, b in zip(before, after))


def route_bufs(T, K, device="cpu"):
    return (torch.full((T, K), -5, dtype=torch.int32, device=device),
            torch.full((T, K), -5.0, dtype=torch.float32, device=device))


@pytest.mark.parametrize("device", devices())
def test_route_errors(device):
    cfg = sy.presets["deepseek-v3"]
    T, E, K = 7, cfg.num_experts, cfg.top_k
    logits = torch.randn(T, E, device=device)
    ids, w = route_bufs(T, K, device)
    before = snapshot(ids, w)
    cases = [
        (TypeError, "'logits'", dict(logits=logits.double())),
        (TypeError, "'logits'", dict(logits=logits.to(torch.int32))),
        (ValueError, "'logits'", dict(logits=logits[:, :-1])),
        (ValueError, "'logits'", dict(logits=logits.t().contiguous().t())),  # column-major: last dim strided
        (ValueError, "'logits'", dict(logits=logits[0])),  # 1-D
        (TypeError, "'logits'", dict(logits=[[0.0] * E])),
        (ValueError, "'bias'", dict(bias=torch.zeros(E + 1, device=device))),
        (TypeError, "'bias'", dict(bias=torch.zeros(E, dtype=torch.float16, device=device))),
        (ValueError, "'topk_ids'", dict(out=(ids[:, :-1], w))),
        (TypeError, "'topk_ids'", dict(out=(ids.to(torch.int16), w))),
        (ValueError, "'topk_weights'", dict(out=(ids, w[:-1]))),
        (TypeError, "'topk_weights'", dict(out=(ids, w.to(torch.float16)))),
        (ValueError, "'topk_weights'", dict(out=(ids, torch.empty(K, T, device=device).t()))),  # not contiguous
        (TypeError, "'ids_dtype'", dict(ids_dtype=torch.float32)),
        (TypeError, "'weights_dtype'", dict(weights_dtype=torch.int32)),
        (ValueError, "'config'", dict(config="deepseek-v4")),
        (TypeError, "'config'", dict(config=42)),
    ]
    for exc, name, kw in cases:
        args = dict(logits=logits, config=cfg)
        args.update(kw)
        with pytest.raises(exc, match=name):
            sy.route(args.pop("logits"), args.pop("config"), **args)
        assert unchanged(before, ids, w), f"{kw} wrote into the outputs"


def test_unsupported_device_type_is_named():
    # Meta tensors never reach the library (the ops' fake implementations serve them); any other
    # device type that does is refused by the translation layer, naming the argument.
    from switchyard.ops import _view

    with pytest.raises(ValueError, match="'logits'.*meta"):
        _view("route", "logits", torch.empty(2, 2, device="meta"))
    with pytest.raises(ValueError, match="'x'"):
        _view("gather", "x", torch.empty(1, 1, 1, 1, 1))


def test_k_greater_than_e():
    with pytest.raises(ValueError, match="config.top_k"):
        sy.RoutingConfig(num_experts=8, top_k=9)
    # The raw op with K > E (bypassing RoutingConfig) is refused by the library too.
    logits = torch.randn(3, 8)
    ids, w = route_bufs(3, 9)
    before = snapshot(ids, w)
    with pytest.raises(ValueError, match="config.top_k"):
        torch.ops.switchyard.route_out(logits, None, ids, w, 8, 9, 0, 1, 0, 1, 1, 1.0)
    assert unchanged(before, ids, w)


@pytest.mark.parametrize("device", devices())
def test_layout_errors(device):
    T, K, E, M = 9, 4, 16, 4
    ids = torch.randint(0, E, (T, K), dtype=torch.int32, device=device)
    out = sy.Layout(*[poison_like(t) for t in sy.empty_layout(T, K, E, M, device=device)])
    before = snapshot(*out)
    short = out._replace(tile_expert=out.tile_expert[:-1])
    cases = [
        (ValueError, "'topk_ids'", dict(topk_ids=ids.t())),  # non-contiguous
        (TypeError, "'topk_ids'", dict(topk_ids=ids.float())),
        (ValueError, "'topk_ids'", dict(topk_ids=ids.view(-1))),
        (ValueError, "config.tile_size", dict(tile_size=0)),
        (ValueError, "config.num_experts", dict(num_experts=0)),
        (ValueError, "config.num_experts", dict(num_experts=-3, out=None)),
        (ValueError, "config.local", dict(local=(14, 4))),
        (TypeError, "'local'", dict(local="half")),
        (ValueError, "out.tile_expert", dict(out=short)),
        (TypeError, "out.counts", dict(out=out._replace(counts=out.counts.long()))),
        (ValueError, "out.expanded_to_permuted", dict(out=out._replace(expanded_to_permuted=out.expanded_to_permuted.t()))),
        (ValueError, "local.expert_map", dict(local=sy.LocalExperts.map(torch.zeros(E - 1, dtype=torch.int32,
                                                                                        device=device), 2))),
    ]
    for exc, name, kw in cases:
        args = dict(topk_ids=ids, num_experts=E, tile_size=M, out=out)
        args.update(kw)
        with pytest.raises(exc, match=name):
            sy.layout(args.pop("topk_ids"), args.pop("num_experts"), args.pop("tile_size"), **args)
        assert unchanged(before, *out), f"{kw} wrote into the layout"


@pytest.mark.parametrize("device", devices())
def test_gather_and_combine_errors(device):
    T, K, E, M, H = 9, 2, 8, 4, 32
    ids = torch.randint(0, E, (T, K), dtype=torch.int32, device=device)
    lay = sy.layout(ids, E, M)
    R = lay.permuted_to_token.shape[0]
    x = torch.randn(T, H, device=device)
    x_perm = torch.full((R, H), 3.0, device=device)
    scales = torch.ones(T, device=device)
    x_perm_scales = torch.full((R,), 3.0, device=device)
    before = snapshot(x_perm, x_perm_scales)
    gather_cases = [
        (TypeError, "'x'", dict(x=x.double())),
        (ValueError, "'x'", dict(x=x.t())),
        (ValueError, "'out'", dict(out=x_perm[:-1])),
        (TypeError, "'out'", dict(out=x_perm.half())),
        (ValueError, "'out'", dict(out=x_perm[:, :-1])),
        (ValueError, "'out_scales'", dict(scales=scales, out_scales=None)),
        (ValueError, "'scales'", dict(scales=scales[:-1], out_scales=x_perm_scales)),
        (ValueError, "'scales'", dict(scales=torch.ones(T, 5, device=device), out_scales=x_perm_scales)),
        (TypeError, "'scales'", dict(scales=scales.double(), out_scales=x_perm_scales)),
        (ValueError, "layout.permuted_to_token", dict(layout=lay._replace(permuted_to_token=lay.permuted_to_token[None]))),
    ]
    for exc, name, kw in gather_cases:
        args = dict(x=x, layout=lay, out=x_perm, out_scales=None, scales=None)
        args.update(kw)
        with pytest.raises(exc, match=name):
            sy.gather(args.pop("x"), args.pop("layout"), args.pop("scales"), out=args.pop("out"), **args)
        assert unchanged(before, x_perm, x_perm_scales), f"{kw} wrote into the gather outputs"

    y = torch.randn(R, H, device=device)
    w = torch.rand(T, K, device=device)
    out = torch.full((T, H), 3.0, device=device)
    before = snapshot(out)
    combine_cases = [
        (TypeError, "'y_perm'", dict(y_perm=y.double())),
        (ValueError, "'y_perm'", dict(y_perm=y[:-1])),
        (ValueError, "'y_perm'", dict(y_perm=y.t().contiguous().t())),
        (ValueError, "'weights'", dict(weights=w.t())),
        (TypeError, "'weights'", dict(weights=w.half())),
        (ValueError, "'out'", dict(out=out[:-1])),
        (ValueError, "'out'", dict(out=torch.empty(H, T, device=device).t())),
        (TypeError, "'out'", dict(out=out.to(torch.float8_e4m3fn))),
        (ValueError, "'accumulate'", dict(out=None, accumulate=True)),
    ]
    for exc, name, kw in combine_cases:
        args = dict(y_perm=y, layout=lay, weights=w, out=out, accumulate=False)
        args.update(kw)
        with pytest.raises(exc, match=name):
            sy.combine(**args)
        assert unchanged(before, out), f"{kw} wrote into out"


def test_mixed_devices_are_refused():
    need_cuda()
    cfg = sy.presets["mixtral-8x7b"]
    logits = torch.randn(4, 8, device="cuda")
    ids, w = route_bufs(4, 2, "cpu")
    before = snapshot(ids, w)
    with pytest.raises(ValueError, match="'topk_ids'"):
        sy.route(logits, cfg, out=(ids, w))
    assert unchanged(before, ids, w)
    with pytest.raises(ValueError, match="'bias'"):
        sy.route(logits, cfg, bias=torch.zeros(8))
    lay = sy.layout(torch.zeros(4, 2, dtype=torch.int32, device="cuda"), 8)
    with pytest.raises(ValueError, match="'x'|layout"):
        sy.gather(torch.randn(4, 16), lay)
    ids_cuda = torch.zeros(4, 2, dtype=torch.int32, device="cuda")
    out = sy.empty_layout(4, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="'workspace'"):
        sy.layout(ids_cuda, 8, out=out, workspace=torch.empty(1 << 20, dtype=torch.uint8))


def test_cuda_build_missing_is_reported():
    import torch as _torch

    if not _torch.cuda.is_available() or sy.built_with_cuda():
        pytest.skip("only meaningful with a GPU and a CPU-only build of the extension")
    with pytest.raises(sy.UnsupportedError, match="CUDA"):
        sy.route(_torch.randn(2, 8, device="cuda"), "mixtral-8x7b")


def test_layout_argument_is_a_layout():
    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="gather: argument 'layout'"):
        sy.gather(x, None)
    with pytest.raises(TypeError, match="combine: argument 'layout'"):
        sy.combine(x, (x, x))


def test_sizes_are_ints_in_range():
    cases = [
        (ValueError, "'num_tokens'", lambda: sy.empty_layout(-1, 8, 256, 4)),
        (ValueError, "'top_k'", lambda: sy.empty_layout(4, -1, 256, 4)),
        (ValueError, "'num_experts'", lambda: sy.empty_layout(4, 8, 0, 4)),
        (ValueError, "'tile_size'", lambda: sy.empty_layout(4, 8, 256, 0)),
        (TypeError, "'tile_size'", lambda: sy.empty_layout(4, 8, 256, 2.5)),
        (TypeError, "'num_tokens'", lambda: sy.empty_layout("4", 8, 256, 4)),
        (TypeError, "'tile_size'", lambda: sy.empty_layout(4, 8, 256, True)),
        (ValueError, "'tile_size'", lambda: sy.empty_workspace(4, 8, 256, 0)),
        (TypeError, "'tile_size'", lambda: sy.layout(torch.zeros(4, 2, dtype=torch.int32), 8, tile_size=2.5)),
        (TypeError, "'num_experts'", lambda: sy.layout(torch.zeros(4, 2, dtype=torch.int32), 8.0)),
        (ValueError, "'config.tile_size'", lambda: sy.layout(torch.zeros(4, 2, dtype=torch.int32), 8, tile_size=0)),
        (TypeError, "'tile_size'", lambda: sy.route_and_layout(torch.randn(4, 256), "deepseek-v3", tile_size=2.5)),
    ]
    for exc, name, call in cases:
        with pytest.raises(exc, match=name):
            call()
    assert sy.empty_layout(4, 8, 256, 4).counts.shape == (256,)
    assert sy.empty_layout(0, 8, 256, 1).expanded_to_permuted.shape == (0, 8)
