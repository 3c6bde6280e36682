#!/usr/bin/env python3
"""Registers, stack and shared memory of every CUDA kernel, against a committed list.

Small code changes moved the routing kernels' register counts and scheduling without anyone
asking (13-105 kernels at a time), and some of those builds were up to 12% slower
at large T. This check makes such a change visible in review: the build's per-kernel resources
(cuobjdump -res-usage of the CUDA objects) must equal tests/kernel_resources.txt.

  python3 tools/kernel_resources.py dump  BUILD_DIR > tests/kernel_resources.txt   # after a
                                                          # deliberate kernel change
  python3 tools/kernel_resources.py check BUILD_DIR tests/kernel_resources.txt      # CI

  python3 tools/kernel_resources.py reach BUILD_DIR                                 # CI

`reach` checks that every routing kernel compiled into the library can be launched: the plan's
kernels over tests/routing/route_plan_space.h's configurations (BUILD_DIR/tests/route_plan_reach)
must be exactly the routing objects' kernels. An instantiated kernel no configuration reaches is
dead code that costs compile time; delete it (route_shape_launch.cuh's SpecIf).

The list records the nvcc version it was dumped with (its first line); under another version the
check says it skipped and passes, since register counts are the compiler's choice.

cuobjdump comes with the CUDA toolkit; where it is missing (this repository's dev machine), the
PyPI wheel nvidia-cuda-cuobjdump provides it (pass --cuobjdump PATH, or put it on PATH). Exit
status of `check`: 0 equal, 1 different (the kernels are listed), 2 tool or objects missing.
"""
import argparse
import glob
import os
import re
import shutil
import subprocess
import sys

OBJECTS = "src/CMakeFiles/switchyard.dir/cuda/*/*.cu.o"
FIELDS = ("REG", "STACK", "SHARED", "LOCAL")


def find_cuobjdump(explicit):
    if explicit:
        return explicit
    found = shutil.which("cuobjdump")
    if found:
        return found
    if os.path.exists("/usr/local/cuda/bin/cuobjdump"):
        return "/usr/local/cuda/bin/cuobjdump"
    try:  # the PyPI wheel (nvidia-cuda-cuobjdump) installs under site-packages/nvidia/cu*/bin
        import nvidia  # type: ignore

        for base in nvidia.__path__:
            hits = glob.glob(os.path.join(base, "cu*", "bin", "cuobjdump"))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def stable_name(mangled):
    """The kernel's mangled name with each anonymous namespace reduced to its source file: nvcc
    names one _GLOBAL__N__<hash>_<n>_<file>_<hash>, plus _<counter> when a header opens it, and
    the hashes and counter depend on the machine's paths. The length prefix is recomputed."""
    out, pos = [], 0
    for m in re.finditer(r"(\d+)(_GLOBAL__N__)", mangled):
        if m.start() < pos:
            continue
        n = int(m.group(1))
        ident = mangled[m.start(2):m.start(2) + n]
        f = re.match(r"_GLOBAL__N__(?:[0-9a-f]+_\d+_)?(\w+?)(?:_[0-9a-f]{8})?(?:_\d+)?$", ident)
        short = "_GLOBAL__N__" + (f.group(1) if f else ident[len("_GLOBAL__N__"):])
        out.append(mangled[pos:m.start()] + f"{len(short)}{short}")
        pos = m.start(2) + n
    return "".join(out) + mangled[pos:]


def resources(cuobjdump, build_dir):
    objs = sorted(glob.glob(os.path.join(build_dir, OBJECTS)))
    if not objs:
        raise FileNotFoundError(f"no CUDA objects under {build_dir} ({OBJECTS})")
    rows = {}
    for obj in objs:
        text = subprocess.run([cuobjdump, "-res-usage", obj], check=True, capture_output=True, text=True).stdout
        name = None
        for line in text.splitlines():
            m = re.match(r"\s*Function (\S+):", line)
            if m:
                name = stable_name(m.group(1))
                continue
            if name and "REG:" in line:
                vals = dict(f.split(":", 1) for f in line.split())
                rows[f"{os.path.basename(obj)} {name}"] = " ".join(f"{k}:{vals.get(k, '?')}" for k in FIELDS)
                name = None
    return rows


def nvcc_version(build_dir):
    """The CUDA compiler version CMake recorded for the build, or None."""
    for path in sorted(glob.glob(os.path.join(build_dir, "CMakeFiles", "*", "CMakeCUDACompiler.cmake"))):
        m = re.search(r'set\(CMAKE_CUDA_COMPILER_VERSION "([^"]+)"\)', open(path).read())
        if m:
            return m.group(1)
    return None


ROUTING_OBJECT = re.compile(r"routing(_shapes_\d+)?\.cu\.o$")
ENUM_HEADERS = ("include/switchyard/*.h", "src/cuda/routing/*.h", "src/cuda/routing/*.cuh")


def enum_values(root):
    """{enum name: {enumerator: value}} of the enum classes the routing kernels take as template
    arguments, read from the headers (implicit values count up from the previous one)."""
    enums = {}
    for pattern in ENUM_HEADERS:
        for path in glob.glob(os.path.join(root, pattern)):
            for m in re.finditer(r"enum class (\w+)[^{]*\{([^}]*)\}", open(path).read()):
                values, nxt = {}, 0
                for item in re.sub(r"//[^\n]*", "", m.group(2)).split(","):
                    item = item.strip()
                    if not item:
                        continue
                    name, _, val = item.partition("=")
                    nxt = int(val.strip(), 0) if val.strip() else nxt
                    values[name.strip()] = nxt
                    nxt += 1
                enums[m.group(1)] = values
    return enums


def canonical_kernel(signature, enums):
    """A routing kernel's template signature with namespaces dropped and enum arguments as numbers,
    from a demangled name (cuobjdump) or RoutePlan::name (the host compiler's spelling)."""
    s = signature
    if "kKernel = " in s:
        s = s[s.index("kKernel = ") + len("kKernel = "):].rstrip("]").strip()
    s = re.sub(r"^void\s+", "", s)
    if s.endswith(")"):
        s = s[:s.rindex("(")]
    s = re.sub(r"\((?:\w+::)*(\w+)\)(-?\d+)", lambda m: m.group(2) if m.group(1) in enums else m.group(0), s)
    s = re.sub(r"(?:\w+::)*(\w+)::(k\w+)",
               lambda m: str(enums[m.group(1)][m.group(2)]) if m.group(2) in enums.get(m.group(1), {}) else m.group(0),
               s)
    s = re.sub(r"(?:\(anonymous namespace\)|\{anonymous\}|\w+)::", "", s)
    s = re.sub(r"\s+", "", s)
    # The host compiler may leave out Spec's defaulted arguments (kEarlyBias = false, kShift = 0).
    return re.sub(r"Spec<([^<>]*)>", lambda m: "Spec<" + ",".join(
        (m.group(1).split(",") + ["false", "0"])[:7] if m.group(1).count(",") == 4 else
        (m.group(1).split(",") + ["0"])[:7]) + ">", s)


def reach(tool, build_dir):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    enums = enum_values(root)
    lister = os.path.join(build_dir, "tests", "route_plan_reach")
    if not os.path.exists(lister):
        print(f"kernel_resources: no {lister} (build the tests with the CUDA backend)", file=sys.stderr)
        return 2
    planned = {canonical_kernel(line, enums)
               for line in subprocess.run([lister], check=True, capture_output=True, text=True).stdout.splitlines()
               if line.strip()}
    objs = [o for o in sorted(glob.glob(os.path.join(build_dir, OBJECTS))) if ROUTING_OBJECT.search(o)]
    mangled = []
    for obj in objs:
        text = subprocess.run([tool, "-res-usage", obj], check=True, capture_output=True, text=True).stdout
        mangled += re.findall(r"\s*Function (\S+):", text)
    demangler = shutil.which("c++filt")
    if demangler is None:
        print("kernel_resources: no c++filt (binutils)", file=sys.stderr)
        return 2
    names = subprocess.run([demangler], input="\n".join(mangled), check=True, capture_output=True,
                           text=True).stdout.splitlines()
    built = {canonical_kernel(n, enums) for n in names}
    dead, missing = sorted(built - planned), sorted(planned - built)
    if not dead and not missing:
        print(f"kernel_resources: all {len(built)} routing kernels are reached by the plan")
        return 0
    for k in dead:
        print(f"  unreachable {k}")
    for k in missing:
        print(f"  planned but not found in the objects {k}")
    print(f"kernel_resources: {len(dead)} routing kernels no configuration reaches, {len(missing)} planned"
          f" kernels not found (a spelling the canonical form misses?)")
    return 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("dump", "check", "reach"))
    ap.add_argument("build_dir")
    ap.add_argument("baseline", nargs="?")
    ap.add_argument("--cuobjdump")
    args = ap.parse_args()
    version = nvcc_version(args.build_dir)
    if args.mode == "check":
        if not args.baseline:
            ap.error("check needs the baseline file")
        # The resources are the compiler's: a baseline holds for the nvcc that dumped it.
        dumped = next((line.split()[2] for line in open(args.baseline) if line.startswith("# nvcc ")), None)
        if dumped is None or dumped != version:
            print(f"kernel_resources: skipped - {args.baseline} was dumped with nvcc {dumped or '(not recorded)'}, "
                  f"this build used nvcc {version or '(unknown)'}; dump it again under this compiler to compare")
            return 0
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        print("kernel_resources: no cuobjdump (CUDA toolkit, or pip install nvidia-cuda-cuobjdump)", file=sys.stderr)
        return 2
    if args.mode == "reach":
        return reach(tool, args.build_dir)
    try:
        rows = resources(tool, args.build_dir)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"kernel_resources: {e}", file=sys.stderr)
        return 2
    if args.mode == "dump":
        print(f"# nvcc {version or 'unknown'}")
        for k in sorted(rows):
            print(f"{k} {rows[k]}")
        return 0
    want = {}
    for line in open(args.baseline):
        parts = line.split()
        if len(parts) >= 2 + len(FIELDS):
            want[f"{parts[0]} {parts[1]}"] = " ".join(parts[2:])
    changed = [k for k in sorted(set(want) & set(rows)) if want[k] != rows[k]]
    added = sorted(set(rows) - set(want))
    removed = sorted(set(want) - set(rows))
    if not (changed or added or removed):
        print(f"kernel_resources: {len(rows)} kernels, resources as in {args.baseline}")
        return 0
    print(f"kernel_resources: the kernels' resources differ from {args.baseline}:")
    for k in changed:
        print(f"  changed {k}\n    was {want[k]}\n    now {rows[k]}")
    for k in added:
        print(f"  new     {k} {rows[k]}")
    for k in removed:
        print(f"  gone    {k} {want[k]}")
    print(f"  ({len(changed)} changed, {len(added)} new, {len(removed)} gone.) If the change is meant, measure it"
          f" and rewrite the list: python3 tools/kernel_resources.py dump {args.build_dir} > {args.baseline}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
