"""Sums a CubeCL profile log (CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG=FILE) by kernel
class: each launch's line is `| <duration> | <kernel name>`.

usage: python kernel_profile_summary.py LONG_LOG LONG_ITERS [SHORT_LOG SHORT_ITERS] [--watch TSV]
       python kernel_profile_summary.py LOG --after MARKER SKIP [--watch TSV]
With two logs of the same run at two lengths, the difference is the steady-state iterations
alone (start-up, initialisation and the first iteration cancel). An autotuning build logs its
tuning launches and CubeCL's device probes too, in amounts that differ from run to run, so
the difference can be negative: then use one log and `--after`, which counts the launches
between the end of the SKIP-th and the end of the last iteration, an iteration ending at a run
of launches whose name matches the regular expression MARKER (the optimizer's last kernel,
e.g. `AdamStep`). Prints launches and GPU milliseconds per class per iteration, and the ten
costliest and ten most launched kernels; with `--watch TSV` (benchmarks/watched_kernels.tsv)
also the kernels it names beside an earlier profile's figures, so that a GPU run answers the
predictions made without one at a glance.
"""
import os
import re
import sys
from collections import defaultdict

CLASSES = [
    # CubeCL's own device characterisation (throughput and launch-overhead probes), not the
    # model's work: shown apart so that it cannot be mistaken for it.
    ("CubeCL device probes", re.compile(r"Throughput|LaunchOverhead")),
    ("matmul", re.compile(r"matmul|gemm|cmma|mma", re.I)),
    ("attention", re.compile(r"attention|flash", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    ("row kernels", re.compile(r"softmax|layer_?norm|rms_?norm|cross_?entropy|log_?sum", re.I)),
    ("reductions", re.compile(r"reduce|sum|norm|max|mean|argmax", re.I)),
    ("dropout", re.compile(r"dropout", re.I)),
    # (With ours in place of burn's: the core's heads moved to rows and back, the embedding's
    # gradient in place of `select_assign`.)
    ("copies/casts", re.compile(r"into_contiguous|copy|cast|layout|slice|gather|scatter|select|cat"
                                r"|swap_?heads|embedding_?gradient", re.I)),
]
UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
LINE = re.compile(r"^\|\s*([0-9.]+)(ns|µs|us|ms|s)\s*\|\s*(.+?)\s*$")


def classify(name):
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "element-wise/other"


def launches(path):
    """(milliseconds, kernel name) of every launch in the log, in order."""
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line.strip())
            if m:
                yield float(m.group(1)) * UNITS[m.group(2)], m.group(3)


def add(ms, name, sign, by_class, by_name):
    short = name.split("<")[0].split("(")[0][:90]
    for table, key in ((by_class, classify(name)), (by_name, short)):
        table[key][0] += sign
        table[key][1] += sign * ms


def read(path, sign, by_class, by_name):
    for ms, name in launches(path):
        add(ms, name, sign, by_class, by_name)


def read_after(path, marker, skip, by_class, by_name):
    """The launches after the SKIP-th iteration's end up to the last one's; returns the
    number of iterations counted."""
    runs = list(launches(path))
    pattern = re.compile(marker)
    ends = [i for i, (_, name) in enumerate(runs) if pattern.search(name)
            and (i + 1 == len(runs) or not pattern.search(runs[i + 1][1]))]
    if len(ends) <= skip:
        sys.exit(f"{path}: {len(ends)} iteration ends matching {marker!r}, need more than {skip}")
    for ms, name in runs[ends[skip - 1] + 1 if skip else 0:ends[-1] + 1]:
        add(ms, name, 1, by_class, by_name)
    return len(ends) - skip


def watched(path, by_name, iterations):
    """The kernels `path` names (pattern, launches and ms per iteration then, what changed),
    each with this profile's launches and ms per iteration."""
    print(f"kernels named in {path} (then: its earlier profile; now: this one):")
    print("| kernel | launches/it then | now | GPU ms/it then | now | what changed |")
    print("|---|---|---|---|---|---|")
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            pattern, then_n, then_ms, change = line.rstrip("\n").split("\t")
            found = [v for name, v in by_name.items() if re.search(pattern, name)]
            n = sum(c for c, _ in found) / iterations
            ms = sum(m for _, m in found) / iterations
            print(f"| `{pattern}` | {then_n} | {n:.0f} | {then_ms} | {ms:.2f} | {change} |")


def main():
    watch = None
    if "--watch" in sys.argv:
        at = sys.argv.index("--watch")
        watch = sys.argv[at + 1]
        del sys.argv[at:at + 2]
    after = len(sys.argv) > 2 and sys.argv[2] == "--after"
    missing = [p for p in (sys.argv[1:2] if after else sys.argv[1::2]) if not os.path.exists(p)]
    if missing:
        sys.exit(f"no profile log at {', '.join(missing)} (was the run on a CubeCL device?)")
    by_class = defaultdict(lambda: [0, 0.0])
    by_name = defaultdict(lambda: [0, 0.0])
    path = sys.argv[1]
    if after:
        iterations = read_after(path, sys.argv[3], int(sys.argv[4]), by_class, by_name)
        path = f"{path} after iteration {sys.argv[4]}"
    else:
        iterations = int(sys.argv[2])
        read(path, 1, by_class, by_name)
    if not after and len(sys.argv) > 4:
        read(sys.argv[3], -1, by_class, by_name)
        iterations -= int(sys.argv[4])
        path = f"{path} minus {sys.argv[3]}"
    total = sum(ms for _, ms in by_class.values())
    launches = sum(n for n, _ in by_class.values())
    print(f"kernel profile of {path}: {launches} launches, {total:.1f} GPU ms over {iterations} iteration(s)")
    print("| class | launches/iteration | GPU ms/iteration | share |")
    print("|---|---|---|---|")
    for label, (n, ms) in sorted(by_class.items(), key=lambda kv: -kv[1][1]):
        print(f"| {label} | {n / iterations:.1f} | {ms / iterations:.2f} | {100 * ms / max(total, 1e-9):.1f} % |")
    for title, key in (("costliest", 1), ("most launched", 0)):
        print(f"ten {title} kernels:")
        for name, (n, ms) in sorted(by_name.items(), key=lambda kv: -kv[1][key])[:10]:
            print(f"  {ms / iterations:9.2f} ms/it  {n / iterations:6.0f} launches/it  {name}")
    if watch:
        watched(watch, by_name, iterations)


main()
