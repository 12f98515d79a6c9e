"""Sums a CubeCL profile log (CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG=FILE) by kernel
class: each launch's line is `| <duration> | <kernel name>`.

usage: python kernel_profile_summary.py LONG_LOG LONG_ITERS [SHORT_LOG SHORT_ITERS]
With two logs of the same run at two lengths, the difference is the steady-state iterations
alone (start-up, initialisation and the first iteration cancel). In an autotuning build the
tuning launches are logged too: warm the autotune cache with an earlier run of the same shapes. Prints launches and GPU
milliseconds per class per iteration, and the ten costliest and ten most launched kernels.
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
    ("copies/casts", re.compile(r"into_contiguous|copy|cast|layout|slice|gather|scatter|select|cat", re.I)),
]
UNITS = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
LINE = re.compile(r"^\|\s*([0-9.]+)(ns|µs|us|ms|s)\s*\|\s*(.+?)\s*$")


def classify(name):
    for label, pattern in CLASSES:
        if pattern.search(name):
            return label
    return "element-wise/other"


def read(path, sign, by_class, by_name):
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.match(line.strip())
            if not m:
                continue
            ms = float(m.group(1)) * UNITS[m.group(2)]
            name = m.group(3)
            short = name.split("<")[0].split("(")[0][:90]
            for table, key in ((by_class, classify(name)), (by_name, short)):
                table[key][0] += sign
                table[key][1] += sign * ms


def main():
    missing = [p for p in sys.argv[1::2] if not os.path.exists(p)]
    if missing:
        sys.exit(f"no profile log at {', '.join(missing)} (was the run on a CubeCL device?)")
    by_class = defaultdict(lambda: [0, 0.0])
    by_name = defaultdict(lambda: [0, 0.0])
    path, iterations = sys.argv[1], int(sys.argv[2])
    read(path, 1, by_class, by_name)
    if len(sys.argv) > 4:
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


main()
