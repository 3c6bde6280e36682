"""A minimal stand-in for pytest, for offline machines without it (scripts/python_test uses it
only when pytest cannot be imported or installed). It covers exactly what tests/python uses:
pytest.mark.parametrize (stacked, ids=, pytest.param(..., marks=skipif)), pytest.mark.skipif,
pytest.skip (also at module level), pytest.raises(match=). No fixtures.

    python tests/python/minirunner.py tests/python [-k SUBSTRING]
Exit status: 0 all passed or skipped, 1 failures, 5 nothing ran (as pytest).
"""

import importlib
import itertools
import pathlib
import re
import sys
import traceback
import types


class Skipped(Exception):
    pass


class _Mark:
    def __init__(self, name, args, kwargs):
        self.name, self.args, self.kwargs = name, args, kwargs

    def __call__(self, fn):
        fn.__dict__.setdefault("_marks", []).append(self)
        return fn


class _MarkFactory:
    def __getattr__(self, name):
        return lambda *args, **kwargs: _Mark(name, args, kwargs)


class _Param:
    def __init__(self, values, marks=(), id=None):
        self.values, self.id = values, id
        self.marks = list(marks) if isinstance(marks, (list, tuple)) else [marks]


class _Raises:
    def __init__(self, exc, match=None):
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(exc_type, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(exc)):
            raise AssertionError(f"{exc_type.__name__}({exc}) does not match {self.match!r}")
        return True


def _skip(reason="", allow_module_level=False):
    raise Skipped(reason)


def _make_pytest_module():
    m = types.ModuleType("pytest")
    m.mark = _MarkFactory()
    m.param = lambda *values, marks=(), id=None: _Param(values, marks, id)
    m.skip = _skip
    m.raises = _Raises
    m.Skipped = Skipped
    return m


def _expand(fn):
    """[(test id suffix, kwargs, skip reason or None)] for a test function's parametrizations."""
    axes = []
    skip_reason = None
    for mark in reversed(fn.__dict__.get("_marks", [])):
        if mark.name == "parametrize":
            names = mark.args[0]
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
            ids = mark.kwargs.get("ids")
            axis = []
            for i, value in enumerate(mark.args[1]):
                marks = []
                if isinstance(value, _Param):
                    marks, value = value.marks, value.values if len(names) > 1 else value.values[0]
                values = value if len(names) > 1 else (value,)
                label = ids[i] if ids else "-".join(str(v) for v in values)
                axis.append((label, dict(zip(names, values)), marks))
            axes.append(axis)
        elif mark.name == "skipif" and mark.args and mark.args[0]:
            skip_reason = mark.kwargs.get("reason", "skipif")
    cases = []
    for combo in itertools.product(*axes) if axes else [()]:
        kwargs, labels, reason = {}, [], skip_reason
        for label, kw, marks in combo:
            kwargs.update(kw)
            labels.append(str(label))
            for mk in marks:
                if mk.name == "skipif" and mk.args and mk.args[0]:
                    reason = mk.kwargs.get("reason", "skipif")
        cases.append(("[" + "-".join(labels) + "]" if labels else "", kwargs, reason))
    return cases


def main(argv):
    test_dir = pathlib.Path(argv[1] if len(argv) > 1 and not argv[1].startswith("-") else
                            pathlib.Path(__file__).parent).resolve()
    keyword = argv[argv.index("-k") + 1] if "-k" in argv else None
    sys.modules["pytest"] = _make_pytest_module()
    sys.path.insert(0, str(test_dir))
    passed, failed, skipped = 0, [], []
    for path in sorted(test_dir.glob("test_*.py")):
        try:
            module = importlib.import_module(path.stem)
        except Skipped as e:
            skipped.append((path.name, str(e)))
            continue
        for name, fn in list(vars(module).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            for suffix, kwargs, reason in _expand(fn):
                test_id = f"{path.name}::{name}{suffix}"
                if keyword and keyword not in test_id:
                    continue
                if reason is not None:
                    skipped.append((test_id, reason))
                    continue
                try:
                    fn(**kwargs)
                    passed += 1
                    print(".", end="", flush=True)
                except Skipped as e:
                    skipped.append((test_id, str(e)))
                    print("s", end="", flush=True)
                except Exception:  # a failing test, reported below
                    failed.append((test_id, traceback.format_exc()))
                    print("F", end="", flush=True)
    print()
    for test_id, tb in failed:
        print(f"FAILED {test_id}\n{tb}")
    reasons = {}
    for _, reason in skipped:
        reasons[reason] = reasons.get(reason, 0) + 1
    for reason, count in reasons.items():
        print(f"SKIPPED [{count}] {reason}")
    print(f"{passed} passed, {len(failed)} failed, {len(skipped)} skipped (minirunner; pytest unavailable)")
    if failed:
        return 1
    return 0 if passed else 5


if __name__ == "__main__":
    sys.exit(main(sys.argv))
