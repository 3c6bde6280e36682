"""switchyard-bench: Switchyard's operations timed next to their PyTorch-native equivalents.

    switchyard-bench                          # the headline table (GPU), or a small CPU default
    switchyard-bench --presets deepseek-v3 --tokens 1,128,4096 --ops route,pipeline
    switchyard-bench --skews uniform,zipf,hot --logit-dtypes fp32,bf16 --hidden-dtypes bf16,fp8
    switchyard-bench --smoke                  # smallest setting (CI)
    python -m switchyard.bench ...            # the same

Timing (docs/benchmarking.md): on a GPU, `--calls` (20) back-to-back calls are captured in
one CUDA graph (torch.cuda.CUDAGraph), the graph is replayed up to `--replays` (200) times with
CUDA events around each replay, and a point reports the median, p10 and p90 of replay time /
calls. Inputs are fresh random data, rotated over several sets when they fit in L2. Each
figure stands next to its floor: bytes moved / the copy bandwidth measured in the same run, and
never below the in-graph launch floor measured in the same run. The PyTorch-native equivalent
of each operation is timed the same way, and its result is checked against ours once per point.
On a machine without a GPU (or with a CPU-only build) the CPU backend runs on a smaller default,
timed with time.perf_counter, and the first line of the output says so.

Outputs: a markdown table on stdout, JSON (--json, default switchyard_bench.json), and
optionally a plot (--plot FILE.png; needs matplotlib). A progress line goes to stderr.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import bench_ep

ALL_OPS = ("route", "layout", "route_layout", "gather", "combine", "pipeline")
ALL_SKEWS = ("uniform", "zipf", "hot")
LOGIT_DTYPES = ("fp32", "bf16", "fp16")
HIDDEN_DTYPES = ("bf16", "fp16", "fp32", "fp8")
ZIPF_EXPONENT = 1.2
HOT_OFFSET = 20.0  # added to the hot expert's logit: it is picked by every token

HEADLINE_PRESETS = ["deepseek-v3", "qwen3-next-80b", "qwen3-235b-a22b"]
HEADLINE_OPS = ["route", "route_layout", "gather", "combine", "pipeline"]
GPU_DEFAULT = dict(presets=HEADLINE_PRESETS, tokens=[1, 128, 4096, 16384], ops=HEADLINE_OPS, hidden=None)
CPU_DEFAULT = dict(presets=HEADLINE_PRESETS, tokens=[1, 64, 512], ops=HEADLINE_OPS, hidden=1024)
SMOKE = dict(presets=["deepseek-v3"], tokens=[1, 8], ops=list(ALL_OPS), hidden=128)

DEFAULT_L2_BYTES = 60 << 20
# A point whose p10-p90 spread exceeds this fraction of its median is flagged unstable (the
# machine was busy or the clock noisy): its figures are shown marked, not as facts.
MAX_SPREAD = 0.5
OP_NOTES = {
    "route": "torch: pre (softmax/sigmoid/...) [+ bias, group mask from topk of group scores] -> topk -> "
             "weights (renormalize/softmax/...) x scale, on fp32 scores",
    "layout": "torch: sort(stable=True) of the flattened ids + counts (scatter_add_, as bincount syncs with the "
              "host on CUDA) + cumsum of tile-padded counts; ours also writes the tile metadata and inverse map",
    "route_layout": "torch: the route baseline followed by the layout baseline",
    "gather": "torch: index_select(x, 0, order // K) (unpadded rows; fp8 rows moved as uint8, scales alongside)",
    "combine": "torch: (y[expanded_to_permuted] * w[..., None]).float().sum(1).to(dtype)",
    "pipeline": "route+layout, gather, combine (identity experts, no GEMMs); torch: the baselines above chained, "
                "with the inverse permutation by scatter_",
}


# ----------------------------------------------------------------------------- small helpers


def _parse_list(text: str, cast: Callable[[str], Any] = str) -> List[Any]:
    return [cast(v.strip()) for v in text.split(",") if v.strip()]


def _token_counts(text: str) -> List[int]:
    """argparse type of --tokens: comma-separated integers >= 1 (argparse names the argument)."""
    counts = []
    for v in (v.strip() for v in text.split(",")):
        if not v:
            continue
        try:
            t = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{v!r} is not an integer (expected e.g. 1,16,128,4096)") from None
        if t < 1:
            raise argparse.ArgumentTypeError(f"{t}: every token count must be >= 1")
        counts.append(t)
    if not counts:
        raise argparse.ArgumentTypeError("no token counts given")
    return counts


def _spread(p10: float, median: float, p90: float) -> float:
    """(p90 - p10) / median: the relative spread of a point's samples."""
    return (p90 - p10) / median if median > 0 else math.inf


def timing_fields(r: Dict[str, Any], max_spread: float, prefix: str = "") -> Dict[str, Any]:
    """A timer's result as a point's fields (prefix "torch_" for the baseline's), the spread
    flagged unstable past max_spread."""
    spread = _spread(r["p10_us"], r["median_us"], r["p90_us"])
    return {prefix + "median_us": r["median_us"], prefix + "p10_us": r["p10_us"], prefix + "p90_us": r["p90_us"],
            prefix + "method": r["method"], prefix + "spread": spread, prefix + "unstable": spread > max_spread}


def _matplotlib_missing() -> Optional[str]:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return str(e)
    return None


def _percentiles(samples: List[float]) -> Dict[str, float]:
    s = sorted(samples)
    n = len(s)
    return {"median_us": s[n // 2], "p10_us": s[n // 10], "p90_us": s[min(n - 1, (n * 9) // 10)],
            "samples": n}


def _git_commit() -> str:
    # A run from an exported tree (no .git) can be told its commit.
    if os.environ.get("SWITCHYARD_GIT_COMMIT"):
        return os.environ["SWITCHYARD_GIT_COMMIT"]
    for cwd in (os.getcwd(), os.path.dirname(os.path.abspath(__file__))):
        try:
            r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0 and r.stdout.strip():
            commit = r.stdout.strip()
            try:
                d = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                                   capture_output=True, text=True, timeout=10)
                if d.returncode == 0 and d.stdout.strip():
                    commit += " (tree has uncommitted changes)"
            except (OSError, subprocess.SubprocessError):
                pass
            return commit
    return "unknown"


def _driver_version() -> str:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip().splitlines()[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


class Progress:
    """One progress line on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        line = f"[{self.done}/{self.total}, {time.perf_counter() - self.start:.0f} s] {what}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line)
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


# ----------------------------------------------------------------------------- timers


class GpuTimer:
    """Per-call time in a CUDA graph: `calls` calls captured once, replayed with events."""

    kind = "cuda"

    def __init__(self, torch: Any, calls: int, replays: int, budget_s: float) -> None:
        self.torch, self.calls, self.replays, self.budget_s = torch, calls, replays, budget_s
        self.method = (f"CUDA graph of {calls} calls, replayed up to {replays} times with events; "
                       f"median / p10 / p90 of replay time / {calls}")

    def _warm(self, fn: Callable[[int], Any]) -> None:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def _replays(self, run: Callable[[], None], per_replay_calls: int) -> List[float]:
        torch = self.torch
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def once() -> float:
            start.record()
            run()
            stop.record()
            stop.synchronize()
            return 1000.0 * start.elapsed_time(stop) / per_replay_calls

        for _ in range(2):
            once()
        probe = sorted(once() for _ in range(5))[2]
        # About budget_s per measurement: all `replays` for short graphs, at least 10 for long
        # ones (a replay of a long graph already averages `calls` calls).
        n = int(max(10, min(self.replays, self.budget_s * 1e6 / max(probe * per_replay_calls, 1e-3))))
        return [once() for _ in range(n)]

    def _eager(self, fn: Callable[[int], Any], note: str = "") -> Dict[str, Any]:
        def eager() -> None:
            for i in range(self.calls):
                fn(i)

        r = _percentiles(self._replays(eager, self.calls))
        r["method"] = f"eager, {self.calls} calls between events{note}"
        return r

    def time_eager(self, fn: Callable[[int], Any]) -> Dict[str, Any]:
        """Per-call time of `calls` eager calls between events (for what cannot be captured)."""
        self._warm(fn)
        return self._eager(fn)

    def time(self, fn: Callable[[int], Any]) -> Dict[str, Any]:
        torch = self.torch
        self._warm(fn)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for i in range(self.calls):
                    fn(i)
        except Exception as e:  # an op that cannot be captured (e.g. one that syncs with the host)
            del graph
            torch.cuda.synchronize()
            reason = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            return self._eager(fn, f" (graph capture failed: {reason})")
        try:
            r = _percentiles(self._replays(graph.replay, self.calls))
        finally:
            torch.cuda.synchronize()
            del graph
        r["method"] = "cuda_graph"
        return r

    def sync(self) -> None:
        self.torch.cuda.synchronize()


class CpuTimer:
    """Wall time of single calls with time.perf_counter: median / p10 / p90 of repeats."""

    kind = "cpu"

    def __init__(self, repeats: int, budget_s: float) -> None:
        self.repeats, self.budget_s = repeats, budget_s
        self.method = f"time.perf_counter around single calls; median / p10 / p90 of up to {repeats} repeats"

    def time(self, fn: Callable[[int], Any]) -> Dict[str, Any]:
        for i in range(2):
            fn(i)
        samples: List[float] = []
        deadline = time.perf_counter() + self.budget_s
        i = 0
        while len(samples) < self.repeats and (len(samples) < 5 or time.perf_counter() < deadline):
            t0 = time.perf_counter()
            fn(i)
            samples.append(1e6 * (time.perf_counter() - t0))
            i += 1
        r = _percentiles(samples)
        r["method"] = "perf_counter"
        return r

    def sync(self) -> None:
        pass


# ----------------------------------------------------------------------------- ceilings


def measure_copy_bandwidth(torch: Any, device: str, nbytes: int) -> Dict[str, Any]:
    """Best bytes/s (read + written) of a large copy: torch copy_ (a memcpy) and an elementwise
    copy kernel (torch.neg into a preallocated output), best of a few after a warm-up."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    results = {}
    for name, fn in (("copy_", lambda: dst.copy_(src)), ("elementwise", lambda: torch.neg(src, out=dst))):
        best = math.inf
        for rep in range(8):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                t = a.elapsed_time(b) / 1000.0
            else:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
            if rep >= 2:  # the first two are the warm-up
                best = min(best, t)
        results[name] = 2.0 * n * 4 / best
    del src, dst
    best_name = max(results, key=lambda k: results[k])
    return {"bytes_per_s": results[best_name], "copy_bytes": n * 4, "best_of": best_name,
            "by_method_bytes_per_s": results}


def measure_launch_floor(torch: Any, timer: Any, device: str) -> float:
    """Per-call time of a tiny op timed like the operations (a one-element add_)."""
    tiny = torch.zeros(1, device=device)
    return timer.time(lambda i: tiny.add_(1))["median_us"]


# ----------------------------------------------------------------------------- inputs


def _dtype(torch: Any, name: str) -> Any:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
            "fp8": getattr(torch, "float8_e4m3fn", None)}[name]


PRIOR_SEED = 20260101  # one expert popularity order for every input set of a run


def hot_expert(E: int) -> int:
    return (2 * E) // 3


def make_logits(torch: Any, T: int, E: int, skew: str, dtype: Any, seed: int, device: str) -> Any:
    """Gumbel noise plus a per-expert log-prior: the top-K of such logits is a draw of K distinct
    experts without replacement from the prior (uniform; Zipf(1.2) over a fixed random order of
    the experts; or one hot expert, hot_expert(E), picked by every token, and a uniform rest)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    u = torch.rand(T, E, generator=g, device=device).clamp_(1e-12, 1.0 - 1e-7)
    logits = -torch.log(-torch.log(u))
    if skew == "zipf":
        gp = torch.Generator(device=device)
        gp.manual_seed(PRIOR_SEED)
        rank = torch.randperm(E, generator=gp, device=device).float()
        logits += -ZIPF_EXPONENT * torch.log(rank + 1.0)
    elif skew == "hot":
        logits[:, hot_expert(E)] += HOT_OFFSET
    return logits.to(dtype)


def make_bias(torch: Any, E: int, skew: str, seed: int, device: str) -> Any:
    """A selection bias (std 0.05). For the hot skew the hot expert also gets +1: a sigmoid
    score saturates near 1, so without it a small bias could outrank the hot expert."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    bias = torch.randn(E, generator=g, device=device) * 0.05
    if skew == "hot":
        bias[hot_expert(E)] += 1.0
    return bias


def make_ids(torch: Any, T: int, E: int, K: int, skew: str, seed: int, device: str) -> Any:
    logits = make_logits(torch, T, E, skew, torch.float32, seed, device)
    return logits.topk(K, dim=-1).indices.to(torch.int32)


def make_hidden(torch: Any, rows: int, H: int, dtype_name: str, seed: int, device: str) -> Any:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    x = torch.randn(rows, H, generator=g, device=device)
    return x.to(_dtype(torch, dtype_name))


def input_sets(bytes_per_set: float, l2_bytes: int, on_gpu: bool) -> int:
    """Input sets to rotate through: several when they fit in L2 together (replays must not
    read the same bytes from L2 over and over), one otherwise."""
    if not on_gpu:
        return 2
    if bytes_per_set >= l2_bytes:
        return 1
    return int(max(2, min(16, (2 * l2_bytes) // max(int(bytes_per_set), 1) + 1)))


# ----------------------------------------------------------------------------- PyTorch equivalents


def torch_route(torch: Any, logits: Any, bias: Optional[Any], cfg: Any, want_scores: bool = False) -> Any:
    """The routing rule of `cfg` written the way PyTorch model code does it, on fp32 scores.
    Returns (ids int64 [T,K], weights fp32 [T,K]) (+ (selection scores, group scores) when
    want_scores)."""
    s = logits.float()
    T, E = s.shape
    K = cfg.top_k
    renorm_softmax = cfg.pre == "none" and cfg.post == "softmax"
    if cfg.pre == "softmax" or renorm_softmax:
        p = torch.softmax(s, dim=-1)
    elif cfg.pre == "sigmoid":
        p = torch.sigmoid(s)
    elif cfg.pre == "sqrtsoftplus":
        p = torch.nn.functional.softplus(s).sqrt()
    else:
        p = s
    q = p + bias.float() if bias is not None else p
    gscores = None
    if cfg.group_rule != "none":
        G = cfg.n_group
        qg = q.view(T, G, E // G)
        if cfg.group_rule == "top2_sum":
            gscores = qg.topk(2, dim=-1).values.sum(-1)
        elif cfg.group_rule == "max":
            gscores = qg.amax(dim=-1)
        else:  # topk_sum
            gscores = qg.topk(K // cfg.topk_group, dim=-1).values.sum(-1)
        keep = gscores.topk(cfg.topk_group, dim=-1, sorted=False).indices
        gmask = torch.zeros_like(gscores, dtype=torch.bool).scatter_(1, keep, True)
        q = q.masked_fill(~gmask.unsqueeze(-1).expand(T, G, E // G).reshape(T, E), float("-inf"))
    ids = q.topk(K, dim=-1).indices
    w = p.gather(1, ids)
    if renorm_softmax:  # softmax over all E, top-K, renormalize: softmax over the K picks
        w = w / w.sum(-1, keepdim=True)
    elif cfg.post == "softmax":
        w = torch.softmax(w, dim=-1)
    elif cfg.post == "sigmoid":
        w = torch.sigmoid(w)
    elif cfg.post == "normalize":
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    if cfg.scale != 1.0:
        w = w * cfg.scale
    if want_scores:
        return ids, w, q, gscores
    return ids, w


def torch_layout(torch: Any, ids: Any, E: int, M: int) -> Tuple[Any, Any, Any]:
    """(order int64 [T*K], counts [E], padded offsets [E]): stable sort of the flattened ids,
    per-expert counts, cumulative tile-padded counts."""
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(E, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offsets = torch.cumsum((counts + (M - 1)) // M * M, 0)
    return order, counts, offsets


def torch_combine(torch: Any, y: Any, expanded_to_permuted: Any, w: Any, dtype: Any) -> Any:
    return (y[expanded_to_permuted] * w[..., None]).float().sum(1).to(dtype)


# ----------------------------------------------------------------------------- checks


def _tied(torch: Any, values: Any, k: int, rel: float = 1e-5) -> Any:
    """Rows whose k-th and (k+1)-th largest values are within rel of each other."""
    n = values.shape[-1]
    if k >= n:
        return torch.zeros(values.shape[0], dtype=torch.bool, device=values.device)
    top = values.float().topk(k + 1, dim=-1).values
    a, b = top[:, k - 1], top[:, k]
    finite = torch.isfinite(a) & torch.isfinite(b)
    scale = torch.maximum(a.abs(), b.abs()).clamp_min(1.0)
    return finite & ((a - b).abs() <= rel * scale)


def check_route(torch: Any, ours: Tuple[Any, Any], logits: Any, bias: Optional[Any], cfg: Any,
                theirs: Optional[Tuple[Any, Any]] = None) -> Tuple[str, Any]:
    """Our ids/weights against the torch baseline: ids equal as sets on rows without a near tie
    at the top-K (or group) boundary, weights close there. Returns (verdict, untied-row mask)."""
    ids_t, w_t, q, gscores = torch_route(torch, logits, bias, cfg, want_scores=True)
    tied = _tied(torch, q, cfg.top_k)
    if gscores is not None:
        tied |= _tied(torch, gscores, cfg.topk_group)
    a = ids_t.sort(-1)
    b = ours[0].long().sort(-1)
    same = (a.values == b.values).all(-1)
    bad = ~same & ~tied
    n_bad, n_tied = int(bad.sum()), int(tied.sum())
    if n_bad:
        return f"DIFFERS: ids differ on {n_bad} of {logits.shape[0]} untied rows", ~tied
    wa = w_t.float().gather(1, a.indices)
    wb = ours[1].float().gather(1, b.indices)
    ok_rows = same
    err = float((wa - wb).abs()[ok_rows].max()) if bool(ok_rows.any()) else 0.0
    if err > 1e-4 * max(1.0, abs(cfg.scale)):
        return f"DIFFERS: weights differ by {err:.2e}", ~tied
    verdict = "match"
    if n_tied:
        verdict += f" ({n_tied} tied rows not compared)"
    return verdict, same


def check_layout(torch: Any, lay: Any, ids: Any, E: int, M: int) -> str:
    order, counts, offsets = torch_layout(torch, ids, E, M)
    TK = ids.numel()
    if not torch.equal(lay.counts.long(), counts):
        return "DIFFERS: counts"
    if int(lay.offsets[-1]) != int(offsets[-1]):
        return "DIFFERS: padded total"
    p2x = lay.permuted_to_expanded.long()
    placed = p2x[p2x < TK]
    if not torch.equal(placed, order):
        return "DIFFERS: order"
    return "match"


def _close(torch: Any, a: Any, b: Any, rows: Optional[Any] = None) -> Tuple[bool, float]:
    a, b = a.float(), b.float()
    if rows is not None:
        a, b = a[rows], b[rows]
    if a.numel() == 0:
        return True, 0.0
    err = (a - b).abs()
    tol = 1e-2 * b.abs() + 1e-2 * float(b.abs().mean()) + 1e-6
    return bool((err <= tol).all()), float(err.max())


def _bitwise(torch: Any, t: Any) -> Any:
    return t.view(torch.uint8) if t.element_size() == 1 else t


# ----------------------------------------------------------------------------- one point


class Skip(Exception):
    """A point that does not apply (e.g. fp8 for combine); not an error."""


def layout_write_bytes(sy: Any, T: int, K: int, L: int, M: int) -> float:
    rows = sy.max_permuted_rows(T, K, L, M)
    tiles = sy.max_tiles(T, K, L, M)
    return 4.0 * (T * K + 2.0 * rows + 2.0 * tiles + 2.0 * L + 4)


def run_point(ctx: "Context", preset_name: str, op: str, T: int, skew: str, ldt: str, hdt: str) -> Dict[str, Any]:
    torch, sy, dev, M = ctx.torch, ctx.sy, ctx.device, ctx.tile_size
    cfg = sy.presets[preset_name]
    E, K = cfg.num_experts, cfg.top_k
    H = ctx.hidden if ctx.hidden else (cfg.hidden_size or 4096)
    on_gpu = dev == "cuda"
    seed = (zlib.crc32(f"{preset_name} {op} {T} {skew} {ldt} {hdt}".encode()) & 0xFFFF) + 1
    point: Dict[str, Any] = {"preset": preset_name, "op": op, "tokens": T, "skew": skew, "num_experts": E,
                             "top_k": K, "tile_size": M, "logit_dtype": ldt if op in ("route", "route_layout",
                                                                                          "pipeline") else None,
                             "hidden_dtype": hdt if op in ("gather", "combine", "pipeline") else None,
                             "hidden": H if op in ("gather", "combine", "pipeline") else None}
    if hdt == "fp8" and op in ("combine", "pipeline"):
        raise Skip("combine takes bf16/fp16/fp32 expert outputs")
    if hdt == "fp8" and _dtype(torch, "fp8") is None:
        raise Skip("this torch has no float8_e4m3fn")
    hdtype = _dtype(torch, hdt)
    ldtype = _dtype(torch, ldt)
    bias = None
    if cfg.has_bias:
        bias = make_bias(torch, E, skew, seed + 7, dev)
    L = E
    R = sy.max_permuted_rows(T, K, L, M)
    lay_bytes = layout_write_bytes(sy, T, K, L, M)
    logit_elem = torch.empty(0, dtype=ldtype).element_size()
    route_bytes = T * E * logit_elem + (4 * E if bias is not None else 0) + 8.0 * T * K
    row_bytes = H * torch.empty(0, dtype=hdtype).element_size()
    scale_cols = H // sy.SCALE_GROUP_SIZE if hdt == "fp8" else 0
    row_bytes_scaled = row_bytes + 4 * scale_cols

    def new_layout() -> Tuple[Any, Any]:
        return (sy.empty_layout(T, K, E, M, device=dev), sy.empty_workspace(T, K, E, M, device=dev))

    ours_fn: Callable[[int], Any]
    torch_fn: Optional[Callable[[int], Any]]
    check: Callable[[], str]

    if op in ("route", "route_layout", "pipeline"):
        nsets = input_sets(T * E * logit_elem + (T * row_bytes if op == "pipeline" else 0), ctx.l2_bytes,
                           on_gpu)
        logits = [make_logits(torch, T, E, skew, ldtype, seed + i, dev) for i in range(nsets)]
        ids = torch.empty(T, K, dtype=torch.int32, device=dev)
        w = torch.empty(T, K, dtype=torch.float32, device=dev)

    if op == "route":
        def ours_fn(i: int) -> None:
            sy.route(logits[i % nsets], cfg, bias=bias, out=(ids, w))

        def torch_fn(i: int) -> None:
            torch_route(torch, logits[i % nsets], bias, cfg)

        def check() -> str:
            sy.route(logits[0], cfg, bias=bias, out=(ids, w))
            return check_route(torch, (ids, w), logits[0], bias, cfg)[0]

        bytes_moved = route_bytes

    elif op == "layout":
        nsets = input_sets(4.0 * T * K, ctx.l2_bytes, on_gpu)
        idsets = [make_ids(torch, T, E, K, skew, seed + i, dev) for i in range(nsets)]
        lay, ws = new_layout()

        def ours_fn(i: int) -> None:
            sy.layout(idsets[i % nsets], E, M, out=lay, workspace=ws)

        def torch_fn(i: int) -> None:
            torch_layout(torch, idsets[i % nsets], E, M)

        def check() -> str:
            sy.layout(idsets[0], E, M, out=lay, workspace=ws)
            return check_layout(torch, lay, idsets[0], E, M)

        bytes_moved = 4.0 * T * K + lay_bytes

    elif op == "route_layout":
        lay, ws = new_layout()

        def ours_fn(i: int) -> None:
            sy.route_and_layout(logits[i % nsets], cfg, bias, tile_size=M, out=(ids, w, lay), workspace=ws)

        def torch_fn(i: int) -> None:
            ids_t, _ = torch_route(torch, logits[i % nsets], bias, cfg)
            torch_layout(torch, ids_t, E, M)

        def check() -> str:
            sy.route_and_layout(logits[0], cfg, bias, tile_size=M, out=(ids, w, lay), workspace=ws)
            verdict = check_route(torch, (ids, w), logits[0], bias, cfg)[0]
            lv = check_layout(torch, lay, ids, E, M)  # our layout of our ids vs torch's of the same ids
            return verdict if lv == "match" else f"{verdict}; layout {lv}"

        bytes_moved = route_bytes + lay_bytes

    elif op == "gather":
        ids0 = make_ids(torch, T, E, K, skew, seed, dev)
        lay, ws = new_layout()
        sy.layout(ids0, E, M, out=lay, workspace=ws)
        padded_total = lay.padded_total
        nsets = input_sets(T * row_bytes_scaled, ctx.l2_bytes, on_gpu)
        xs = [make_hidden(torch, T, H, hdt, seed + i, dev) for i in range(nsets)]
        scales = ([torch.rand(T, scale_cols, device=dev) + 0.5 for _ in range(nsets)] if scale_cols else None)
        x_perm = torch.empty(R, H, dtype=hdtype, device=dev)
        x_perm_scales = torch.empty(R, scale_cols, device=dev) if scale_cols else None
        order, _, _ = torch_layout(torch, ids0, E, M)
        tok = order // K

        def ours_fn(i: int) -> None:
            sy.gather(xs[i % nsets], lay, scales[i % nsets] if scales else None, out=x_perm,
                      out_scales=x_perm_scales)

        def torch_fn(i: int) -> None:
            x = xs[i % nsets]
            _bitwise(torch, x).index_select(0, tok)
            if scales:
                scales[i % nsets].index_select(0, tok)

        def check() -> str:
            ours_fn(0)
            valid = lay.permuted_to_expanded.long() < T * K
            ref = _bitwise(torch, xs[0]).index_select(0, tok)
            if not torch.equal(_bitwise(torch, x_perm)[valid], ref):
                return "DIFFERS: rows"
            if scales and not torch.equal(x_perm_scales[valid], scales[0].index_select(0, tok)):
                return "DIFFERS: scales"
            return "match"

        placed, tokens_read = T * K, T  # every pick is a distinct local expert
        bytes_moved = (tokens_read + placed) * row_bytes_scaled + 4.0 * padded_total
        point["padded_total"] = padded_total

    elif op == "combine":
        ids0 = make_ids(torch, T, E, K, skew, seed, dev)
        lay, ws = new_layout()
        sy.layout(ids0, E, M, out=lay, workspace=ws)
        nsets = input_sets(R * row_bytes + 4.0 * T * K, ctx.l2_bytes, on_gpu)
        ys = [make_hidden(torch, R, H, hdt, seed + i, dev) for i in range(nsets)]
        ws_ = [torch.rand(T, K, device=dev) + 0.01 for _ in range(nsets)]
        out = torch.empty(T, H, dtype=hdtype, device=dev)
        e2p = lay.expanded_to_permuted.long()

        def ours_fn(i: int) -> None:
            sy.combine(ys[i % nsets], lay, ws_[i % nsets], out=out)

        def torch_fn(i: int) -> None:
            torch_combine(torch, ys[i % nsets], e2p, ws_[i % nsets], hdtype)

        def check() -> str:
            ours_fn(0)
            ok, err = _close(torch, out, torch_combine(torch, ys[0], e2p, ws_[0], hdtype))
            return "match" if ok else f"DIFFERS: max abs error {err:.3g}"

        bytes_moved = T * K * row_bytes + 8.0 * T * K + T * row_bytes

    elif op == "pipeline":
        xs = [make_hidden(torch, T, H, hdt, seed + 100 + i, dev) for i in range(nsets)]
        lay, ws = new_layout()
        x_perm = torch.empty(R, H, dtype=hdtype, device=dev)
        out = torch.empty(T, H, dtype=hdtype, device=dev)

        def ours_fn(i: int) -> None:
            sy.route_and_layout(logits[i % nsets], cfg, bias, tile_size=M, out=(ids, w, lay), workspace=ws)
            sy.gather(xs[i % nsets], lay, out=x_perm)
            sy.combine(x_perm, lay, w, out=out)

        def torch_pipeline(i: int) -> Any:
            x = xs[i % nsets]
            ids_t, w_t = torch_route(torch, logits[i % nsets], bias, cfg)
            order, _, _ = torch_layout(torch, ids_t, E, M)
            xp = x.index_select(0, order // K)
            inv = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
            return torch_combine(torch, xp, inv.view(T, K), w_t, hdtype)

        torch_fn = torch_pipeline

        def check() -> str:
            ours_fn(0)
            verdict, rows = check_route(torch, (ids, w), logits[0], bias, cfg)
            if verdict.startswith("DIFFERS"):
                return verdict
            ok, err = _close(torch, out, torch_pipeline(0), rows)
            return verdict if ok else f"DIFFERS: output, max abs error {err:.3g}"

        tokens_read, placed = T, T * K
        bytes_moved = (route_bytes + lay_bytes + (tokens_read + placed) * row_bytes + 4.0 * R
                       + placed * row_bytes + 8.0 * T * K + T * row_bytes)
    else:
        raise ValueError(op)

    point["input_sets"] = nsets
    point["bytes"] = float(bytes_moved)
    hbm_floor = 1e6 * bytes_moved / ctx.copy_bw
    point["bandwidth_floor_us"] = hbm_floor
    point["floor_us"] = max(hbm_floor, ctx.launch_floor_us)

    try:
        ours = ctx.timer.time(ours_fn)
    except sy.UnsupportedError as e:
        point["error"] = f"unsupported: {e}"
        return point
    ctx.timer.sync()
    point.update(timing_fields(ours, ctx.max_spread), samples=ours["samples"])
    point["gbps"] = bytes_moved / (ours["median_us"] * 1e-6) / 1e9
    point["pct_copy"] = 100.0 * point["gbps"] * 1e9 / ctx.copy_bw
    if ctx.baseline:
        try:
            point["check"] = check()
        except Exception as e:  # the check must never take the run down
            point["check"] = f"check failed: {type(e).__name__}: {e}"
        try:
            theirs = ctx.timer.time(torch_fn)
            ctx.timer.sync()
            point.update(timing_fields(theirs, ctx.max_spread, "torch_"))
            point["speedup"] = theirs["median_us"] / ours["median_us"]
        except Exception as e:
            point["torch_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if dev == "cuda":
                torch.cuda.synchronize()
    return point


# ----------------------------------------------------------------------------- output


def _fmt_us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def markdown_table(points: List[Dict[str, Any]]) -> str:
    """The table; an unstable figure is marked UNSTABLE (ours) or ? (torch, speedup), and a
    % copy above 100 is shown as >100%* (see the notes printed under the table)."""
    head = ("| preset | op | skew | logits | hidden | T | ours us (p10-p90) | torch us | speedup | MB | GB/s | "
            "% copy | floor us | check |")
    lines = [head, "|" + "---|" * 14]
    for p in points:
        hidden = f"{p['hidden_dtype']} {p['hidden']}" if p.get("hidden_dtype") else "-"
        if "median_us" in p:
            ours = f"{_fmt_us(p['median_us'])} ({_fmt_us(p['p10_us'])}-{_fmt_us(p['p90_us'])})"
            if p.get("unstable"):
                ours += f" UNSTABLE ({100 * p['spread']:.0f}% spread)"
            gbps = f"{p['gbps']:.0f}"
            pct = ">100%*" if p["pct_copy"] > 100 else f"{p['pct_copy']:.0f}%"
        else:
            ours, gbps, pct = p.get("error", "error")[:60], "-", "-"
        torch_us = _fmt_us(p.get("torch_median_us")) if "torch_median_us" in p else (
            "error" if "torch_error" in p else "-")
        if p.get("torch_unstable"):
            torch_us += "?"
        speed = f"{p['speedup']:.1f}x" if "speedup" in p else "-"
        if "speedup" in p and (p.get("unstable") or p.get("torch_unstable")):
            speed += "?"
        lines.append(f"| {p['preset']} | {p['op']} | {p['skew']} | {p.get('logit_dtype') or '-'} | {hidden} | "
                     f"{p['tokens']} | {ours} | {torch_us} | {speed} | {p.get('bytes', 0) / 1e6:.2f} | {gbps} | "
                     f"{pct} | {_fmt_us(p.get('floor_us'))} | {p.get('check', '-')} |")
    return "\n".join(lines)


def write_plot(path: str, points: List[Dict[str, Any]], title: str = "",
               all_ops: Sequence[str] = ALL_OPS) -> Tuple[bool, str]:
    """(written, message). title: the figure's heading (backend, device, commit); unstable
    points are drawn hollow."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return False, f"plot not written: matplotlib is not importable ({e}); {_PIP_MATPLOTLIB}"
    ops = [op for op in all_ops if any(p.get("op") == op and "median_us" in p for p in points)]
    if not ops:
        return False, "plot not written: no timed points"
    cols = min(3, len(ops))
    rows = (len(ops) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes.flat, ops):
        series: Dict[Tuple[Any, ...], List[Dict[str, Any]]] = {}
        for p in points:
            if p.get("op") == op and "median_us" in p:
                key = (p["preset"], p["skew"], p.get("logit_dtype"), p.get("hidden_dtype"))
                series.setdefault(key, []).append(p)
        for n, (key, pts) in enumerate(sorted(series.items(), key=lambda kv: str(kv[0]))):
            pts.sort(key=lambda p: p["tokens"])
            c = colors[n % len(colors)]
            label = " ".join(str(k) for k in key if k)
            t = [p["tokens"] for p in pts]
            ax.plot(t, [p["median_us"] for p in pts], "o-", color=c, label=label)
            shaky = [p for p in pts if p.get("unstable")]
            if shaky:
                ax.plot([p["tokens"] for p in shaky], [p["median_us"] for p in shaky], "o", color="white",
                        markeredgecolor=c, markersize=7, label=None)
            tp = [p for p in pts if "torch_median_us" in p]
            if tp:
                ax.plot([p["tokens"] for p in tp], [p["torch_median_us"] for p in tp], "s--", color=c)
            ax.plot(t, [p["floor_us"] for p in pts], ":", color=c)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call")
        ax.set_title(f"{op}: ours (solid), torch (dashed), floor (dotted)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(ops):]:
        ax.axis("off")
    if any(p.get("unstable") for p in points):
        title += f"\nhollow markers: unstable (p10-p90 spread > {100 * MAX_SPREAD:.0f}% of the median)"
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True, f"plot written to {path}"


_PIP_MATPLOTLIB = f"install it with: {shlex.quote(sys.executable)} -m pip install matplotlib"


# ----------------------------------------------------------------------------- driver


class Context:
    pass


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="switchyard-bench",
        description="Times Switchyard's route / layout / gather / combine (and the whole MoE data path without "
                    "GEMMs) next to their PyTorch-native equivalents. Without arguments: the headline table "
                    "(GPU) or a smaller CPU default.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--presets", help="comma-separated preset names (docs/design.md), or 'all'")
    ap.add_argument("--tokens", type=_token_counts, help="comma-separated token counts, e.g. 1,16,128,4096")
    ap.add_argument("--ops", help="comma-separated: " + ",".join(ALL_OPS) + " (or 'all')")
    ap.add_argument("--skews", default="uniform", help="comma-separated: " + ",".join(ALL_SKEWS))
    ap.add_argument("--logit-dtypes", default="fp32", help="comma-separated: " + ",".join(LOGIT_DTYPES))
    ap.add_argument("--hidden-dtypes", default="bf16", help="comma-separated: " + ",".join(HIDDEN_DTYPES))
    ap.add_argument("--hidden", type=int, help="hidden size (default: the preset's on GPU, 1024 on CPU)")
    ap.add_argument("--tile-size", type=int, default=128, help="layout tile size M")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph")
    ap.add_argument("--replays", type=int, default=200, help="graph replays (GPU) / repeats (CPU), at most")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds per measurement, about (caps replays)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch-native baselines")
    ap.add_argument("--smoke", action="store_true", help="smallest setting: one preset, two token counts, few "
                                                          "repeats (CI)")
    ap.add_argument("--json", default="switchyard_bench.json", help="JSON output file ('' for none)")
    ap.add_argument("--plot", help="PNG: time against tokens per operation (needs matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    ap.add_argument("--max-spread", type=float, default=MAX_SPREAD,
                    help="flag a point as unstable when (p90 - p10) / median exceeds this")
    bench_ep.add_arguments(ap)
    return ap


def _validate(ap: argparse.ArgumentParser, values: Sequence[str], allowed: Sequence[str], what: str) -> None:
    for v in values:
        if v not in allowed:
            ap.error(f"unknown {what} {v!r}; expected one of {', '.join(allowed)}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.plot and _matplotlib_missing() is not None:
        # Before any measuring: a requested plot that cannot be drawn fails the run up front.
        print(f"switchyard-bench: --plot needs matplotlib, which is not importable ({_matplotlib_missing()}); "
              f"{_PIP_MATPLOTLIB}", file=sys.stderr)
        return 2
    if not args.max_spread > 0:
        ap.error("argument --max-spread: must be > 0")

    try:
        import switchyard as sy
    except ImportError as e:
        print(f"switchyard-bench: cannot import switchyard ({e})", file=sys.stderr)
        return 2
    if not sy.has_torch():
        print("switchyard-bench: PyTorch is not importable, and Switchyard's tensor operations need it; "
              "install torch (pip install torch) and run again", file=sys.stderr)
        print("switchyard-bench: PyTorch is not importable; nothing was measured (exit 2)")
        return 2
    import torch

    # Backend.
    gpu_reason = None
    if not torch.cuda.is_available():
        gpu_reason = "no CUDA device visible to PyTorch"
    elif not sy.built_with_cuda():
        gpu_reason = "the switchyard extension was built without the CUDA backend"
    if args.device == "cuda" and gpu_reason:
        print(f"switchyard-bench: --device cuda, but {gpu_reason}", file=sys.stderr)
        return 2
    on_gpu = args.device != "cpu" and gpu_reason is None
    if args.device == "cpu" and gpu_reason is None:
        gpu_reason = "--device cpu"

    if args.ep:
        if not on_gpu:
            print(f"switchyard-bench: --ep times the GPU loopback group and needs a GPU with the CUDA backend "
                  f"({gpu_reason}); switchyard.ep.CpuGroup runs anywhere but is a reference, not timed here",
                  file=sys.stderr)
            return 2
        return _main_ep(args, argv, ap, torch, sy)

    defaults = SMOKE if args.smoke else (GPU_DEFAULT if on_gpu else CPU_DEFAULT)
    presets = list(sy.presets) if args.presets == "all" else (
        _parse_list(args.presets) if args.presets else list(defaults["presets"]))
    _validate(ap, presets, list(sy.presets), "preset")
    tokens = list(args.tokens) if args.tokens else list(defaults["tokens"])
    ops = list(ALL_OPS) if args.ops == "all" else (_parse_list(args.ops) if args.ops else list(defaults["ops"]))
    _validate(ap, ops, ALL_OPS, "op")
    skews = _parse_list(args.skews)
    _validate(ap, skews, ALL_SKEWS, "skew")
    ldts = _parse_list(args.logit_dtypes)
    _validate(ap, ldts, LOGIT_DTYPES, "logit dtype")
    hdts = _parse_list(args.hidden_dtypes)
    _validate(ap, hdts, HIDDEN_DTYPES, "hidden dtype")
    hidden = args.hidden if args.hidden else defaults["hidden"]
    replays = min(args.replays, 5) if args.smoke else args.replays
    calls = min(args.calls, 4) if args.smoke else args.calls
    budget = min(args.budget, 0.05) if args.smoke else args.budget

    ctx = Context()
    ctx.torch, ctx.sy, ctx.tile_size, ctx.hidden, ctx.baseline = torch, sy, args.tile_size, hidden, not args.no_torch
    ctx.max_spread = args.max_spread
    repro = "python -m switchyard.bench" + ("" if not argv else " " + shlex.join(argv))
    if on_gpu:
        ctx.device = "cuda"
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        device_desc = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
        ctx.l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
        ctx.timer = GpuTimer(torch, calls, replays, budget)
        print(f"switchyard-bench: {props.name}, CUDA backend - per-call GPU time in CUDA graphs ({calls} calls per "
              f"graph, median of up to {replays} replays), PyTorch-native equivalents side by side")
        copy_bytes = 1 << 30
    else:
        ctx.device = "cpu"
        device_desc = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores"
        ctx.l2_bytes = DEFAULT_L2_BYTES
        ctx.timer = CpuTimer(replays if args.smoke else min(replays, 50), budget)
        what = "the --smoke setting" if args.smoke else ("the smaller CPU default" if not (
            args.presets or args.tokens) else "the requested points")
        print(f"switchyard-bench: CPU backend ({gpu_reason}) - {what}, timed with time.perf_counter (median of "
              f"repeats); these are not GPU figures")
        copy_bytes = (16 << 20) if args.smoke else (256 << 20)
    sys.stdout.flush()

    bw = measure_copy_bandwidth(torch, ctx.device, copy_bytes)
    ctx.copy_bw = bw["bytes_per_s"]
    ctx.launch_floor_us = measure_launch_floor(torch, ctx.timer, ctx.device)

    # The points: each op takes the axes it depends on.
    plan: List[Tuple[str, str, int, str, str, str]] = []
    for preset in presets:
        for op in ops:
            op_ldts = ldts if op in ("route", "route_layout", "pipeline") else ldts[:1]
            op_hdts = hdts if op in ("gather", "combine", "pipeline") else hdts[:1]
            for skew in skews:
                for ldt in op_ldts:
                    for hdt in op_hdts:
                        for T in tokens:
                            plan.append((preset, op, T, skew, ldt, hdt))

    progress = Progress(len(plan), not args.quiet)
    points: List[Dict[str, Any]] = []
    skipped: List[str] = []
    started = time.perf_counter()
    for preset, op, T, skew, ldt, hdt in plan:
        progress.step(f"{preset} {op} T={T} {skew} logits {ldt} hidden {hdt}")
        try:
            points.append(run_point(ctx, preset, op, T, skew, ldt, hdt))
        except Skip as e:
            skipped.append(f"{preset} {op} {hdt}: {e}")
        except Exception as e:
            points.append({"preset": preset, "op": op, "tokens": T, "skew": skew, "logit_dtype": ldt,
                           "hidden_dtype": hdt, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            if on_gpu:
                try:
                    torch.cuda.synchronize()
                except Exception:
                    pass
        if on_gpu:
            torch.cuda.empty_cache()
    progress.finish()
    elapsed = time.perf_counter() - started

    # Output.
    print(f"device: {device_desc}; switchyard {sy.__version__}, torch {torch.__version__}"
          + (f", CUDA {torch.version.cuda}" if on_gpu else ""))
    print(f"copy bandwidth (read + written, best of torch copy_ and an elementwise copy of "
          f"{bw['copy_bytes'] / 2**20:.0f} MiB): {ctx.copy_bw / 1e9:.0f} GB/s; "
          f"{'in-graph launch' if on_gpu else 'call'} floor {ctx.launch_floor_us:.2f} us; "
          f"tile size {ctx.tile_size}")
    print()
    print(markdown_table(points))
    print()
    print("floor = max(bytes / copy bandwidth, launch floor); speedup = torch / ours (median).")
    for op in ops:
        print(f"- {op}: {OP_NOTES[op]}")
    for s in dict.fromkeys(skipped):
        print(f"- skipped: {s}")
    unstable = [p for p in points if p.get("unstable") or p.get("torch_unstable")]
    if unstable:
        print(f"- UNSTABLE: {len(unstable)} of {len(points)} points have a p10-p90 spread above "
              f"{100 * ctx.max_spread:.0f}% of their median (ours: 'UNSTABLE', torch and speedup: '?'): the machine "
              "was busy or its clock noisy; treat those figures as rough and rerun on a quiet machine")
    if any(p.get("pct_copy", 0) > 100 for p in points):
        print(f"- >100%*: faster than the copy bandwidth measured on {bw['copy_bytes'] / 2**20:.0f} MiB: the "
              "point's data is small enough to stay in cache, where the copy figure is no bound (the JSON keeps "
              "the uncapped pct_copy)")
    bad = [p for p in points if str(p.get("check", "")).startswith("DIFFERS") or "error" in p]
    if bad:
        print(f"- WARNING: {len(bad)} points have a mismatch against torch or an error (see the check column)")

    result = {
        "tool": "switchyard-bench",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repro": repro,
        "argv": argv,
        "commit": _git_commit(),
        "backend": ctx.device,
        "cpu_fallback_reason": None if on_gpu else gpu_reason,
        "device": device_desc,
        "host": platform.node(),
        "versions": {"switchyard": sy.__version__, "torch": torch.__version__,
                     "cuda": torch.version.cuda if on_gpu else None,
                     "driver": _driver_version() if on_gpu else None,
                     "python": platform.python_version()},
        "torch_cpu_threads": torch.get_num_threads(),
        "timing_method": ctx.timer.method,
        "copy_bandwidth_bytes_per_s": ctx.copy_bw,
        "copy_bandwidth": bw,
        "launch_floor_us": ctx.launch_floor_us,
        "tile_size": ctx.tile_size,
        "settings": {"presets": presets, "tokens": tokens, "ops": ops, "skews": skews, "logit_dtypes": ldts,
                     "hidden_dtypes": hdts, "hidden": hidden, "calls": calls, "replays": replays,
                     "smoke": args.smoke, "torch_baselines": ctx.baseline},
        "notes": {"bytes": "route: logits + bias + ids/weights written; layout: ids + every layout array written "
                           "(buffers sized by max_permuted_rows); gather: each token row read once + placed rows "
                           "written + indices; combine: placed rows of y_perm read + indices + weights + out "
                           "written; pipeline: the sum of its stages",
                  **OP_NOTES},
        "max_spread": ctx.max_spread,
        "skipped": list(dict.fromkeys(skipped)),
        "elapsed_s": elapsed,
        "points": points,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON written to {args.json}")
    if args.plot:
        commit = result["commit"]
        commit = commit[:12] + (" + uncommitted changes" if "uncommitted" in commit else "")
        title = (f"switchyard-bench: {ctx.device.upper()} backend on {device_desc}; commit {commit}; "
                 f"switchyard {sy.__version__}, torch {torch.__version__}")
        written, message = write_plot(args.plot, points, title)
        print(message)
        if not written:
            return 1
    return 0


def _main_ep(args: Any, argv: List[str], ap: argparse.ArgumentParser, torch: Any, sy: Any) -> int:
    """switchyard-bench --ep (see switchyard/bench_ep.py)."""
    shapes = _parse_list(args.ep_shapes)
    _validate(ap, shapes, list(bench_ep.EP_SHAPES), "--ep shape")
    hdts = _parse_list(args.hidden_dtypes)
    _validate(ap, hdts, ["bf16", "fp16", "fp32"], "--ep hidden dtype")
    if args.ep_ranks < 1:
        ap.error("argument --ep-ranks: must be >= 1")
    tokens = list(args.tokens) if args.tokens else ([8] if args.smoke else list(bench_ep.EP_TOKENS))
    replays = min(args.replays, 5) if args.smoke else args.replays
    budget = min(args.budget, 0.05) if args.smoke else args.budget
    ctx = Context()
    ctx.torch, ctx.tile_size, ctx.baseline, ctx.max_spread = torch, args.tile_size, not args.no_torch, args.max_spread
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    device_desc = f"{props.name} ({props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB)"
    print(f"switchyard-bench --ep: {props.name}, LoopbackGroup of {args.ep_ranks} ranks on one GPU - one call is "
          "a round (every rank's dispatch or combine), timed in CUDA graphs; the PyTorch equivalent eagerly")
    sys.stdout.flush()
    bw = measure_copy_bandwidth(torch, "cuda", 1 << 30)
    ctx.copy_bw = bw["bytes_per_s"]
    plan = [(shape, T, hdt) for shape in shapes for hdt in hdts for T in tokens]
    progress = Progress(len(plan), not args.quiet)
    points: List[Dict[str, Any]] = []
    started = time.perf_counter()
    for shape, T, hdt in plan:
        progress.step(f"{shape} T={T} per rank, {hdt}")
        # Several rounds per graph where the outputs are small; one where a round's full-capacity
        # outputs take GBs.
        ctx.timer = GpuTimer(torch, min(args.calls, 4) if T <= 512 else 1, replays, budget)
        try:
            pts = bench_ep.run_point(ctx, shape, T, args.ep_ranks, hdt)
        except Exception as e:
            pts = [{"shape": shape, "op": "ep", "R": args.ep_ranks, "tokens": T, "dtype": hdt,
                    "error": f"{type(e).__name__}: {str(e)[:300]}"}]
            torch.cuda.synchronize()
        gc.collect()  # the point's groups and their regions (cudaMalloc'd, outside torch's cache)
        for p in pts:  # the keys the plot groups by
            p.update(preset=p["shape"], skew="uniform", logit_dtype=None, hidden_dtype=hdt,
                     floor_us=1e6 * p.get("bytes", 0.0) / ctx.copy_bw)
        points += pts
        torch.cuda.empty_cache()
    progress.finish()
    print(f"device: {device_desc}; switchyard {sy.__version__}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"copy bandwidth (read + written): {ctx.copy_bw / 1e9:.0f} GB/s")
    print()
    print(bench_ep.markdown_table(points))
    print()
    print(f"- {bench_ep.EP_NOTE}")
    print("- DeepEP MB: a token once per destination rank (dispatch: its row; combine: H x 2 bytes); GB/s: the "
          "R ranks' bytes over the round's time; % copy: that over the copy bandwidth (one GPU's memory carries "
          "every rank's traffic)")
    result = {
        "tool": "switchyard-bench --ep",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "repro": "python -m switchyard.bench " + shlex.join(argv),
        "argv": argv,
        "commit": _git_commit(),
        "device": device_desc,
        "versions": {"switchyard": sy.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
                     "driver": _driver_version(), "python": platform.python_version()},
        "copy_bandwidth_bytes_per_s": ctx.copy_bw,
        "settings": {"shapes": shapes, "tokens_per_rank": tokens, "ranks": args.ep_ranks, "dtypes": hdts,
                     "tile_size": args.tile_size, "replays": replays, "torch_baselines": ctx.baseline},
        "notes": {"method": bench_ep.__doc__.strip(), "ops": bench_ep.EP_NOTE},
        "elapsed_s": time.perf_counter() - started,
        "points": points,
    }
    path = args.json
    if path == "switchyard_bench.json":  # the default: a file of its own
        path = "switchyard_bench_ep.json"
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"JSON written to {path}")
    if args.plot:
        title = (f"switchyard-bench --ep: LoopbackGroup R={args.ep_ranks} on {device_desc}; commit "
                 f"{result['commit'][:12]}; x: tokens per rank")
        written, message = write_plot(args.plot, points, title, all_ops=("ep_dispatch", "ep_combine"))
        print(message)
        if not written:
            return 1
    bad = [p for p in points if "error" in p or str(p.get("check", "")).startswith("DIFFERS")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
