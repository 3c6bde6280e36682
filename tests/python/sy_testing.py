"""Helpers shared by the torch tests: the import guard, the device list, and poisoning."""

import pytest

TORCH_REASON = ("PyTorch is not importable here, so the tests of the tensor operations skip; they run where "
                "PyTorch is installed (scripts/python_test on the GPU machine)")


def require_torch():
    """The torch module, or a visible module-level skip when it cannot be imported."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the machine
        pytest.skip(f"{TORCH_REASON} ({e})", allow_module_level=True)
    return torch


def cuda_skip_reason():
    """Why the CUDA backend cannot be tested here, or None when it can."""
    import torch

    import switchyard as sy

    if not torch.cuda.is_available():
        return "no CUDA device visible to PyTorch (CPU backend only here)"
    if not sy.built_with_cuda():
        return "the switchyard extension was built without the CUDA backend (nvcc not found at build time)"
    return None


def devices():
    """pytest params: "cpu", and "cuda" skipped with the reason when it cannot run."""
    reason = cuda_skip_reason()
    return ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(reason is not None, reason=reason or ""))]


def need_cuda():
    reason = cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)


def call_or_skip_unsupported(fn, *args, **kwargs):
    """Runs fn; a backend that does not implement the operation yet (UnsupportedError) turns
    into a skip naming it, so the gap stays visible in -rs."""
    import switchyard as sy

    try:
        return fn(*args, **kwargs)
    except sy.UnsupportedError as e:
        pytest.skip(f"backend does not implement this yet: {e}")


def poison_like(t, value=-123456789):
    """A tensor shaped like t filled with a value no operation writes."""
    import torch

    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan") if value is None else -1234.5)
    return torch.full_like(t, value)


def seeded(seed):
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return g
