"""cuBLAS beside benchmarks/matmul_shapes.rs: `torch.matmul` on the GPT's forward and backward
shapes and layouts (bf16, transposed views where autodiff passes them), timed with CUDA events.

usage: python torch_matmul_shapes.py [TOKENS] [HIDDEN] [VOCAB]   (default 4096 1024 50304)
Prints one line per shape, then the sum, in the format of matmul_shapes.
"""
import sys

import torch

tokens, hidden, vocab = (list(map(int, sys.argv[1:4])) + [4096, 1024, 50304][len(sys.argv[1:4]):])
REPS = 20


def cases():
    t, h = tokens, hidden
    for layer, d_in, d_out in [("qkv", h, 3 * h), ("attn-proj", h, h), ("fc1", h, 4 * h), ("fc2", 4 * h, h)]:
        yield f"{layer} fwd", t, d_in, d_out, False, False
        yield f"{layer} dgrad", t, d_out, d_in, False, True
        yield f"{layer} wgrad", d_in, t, d_out, True, False
    yield "logits fwd", t, h, vocab, False, True
    yield "logits dgrad", t, vocab, h, False, False
    yield "logits wgrad", vocab, t, h, True, False


def operand(rows, cols, transposed):
    shape = (cols, rows) if transposed else (rows, cols)
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return x.t() if transposed else x


print(f"torch_matmul_shapes: bf16, {REPS} repetitions after a warm-up; tokens {tokens}, hidden {hidden}, vocab {vocab}; {torch.cuda.get_device_name()}")
total = 0.0
for name, m, k, n, at, bt in cases():
    a, b = operand(m, k, at), operand(k, n, bt)
    torch.matmul(a, b)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        torch.matmul(a, b)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / REPS
    total += ms
    print(f"{name:<16} m {m:>6} k {k:>6} n {n:>6} | torch ms: {ms:.3f} TFLOP/s: {2 * m * k * n / ms / 1e9:.1f}")
print(f"one layer's and the output layer's matmuls, summed | torch ms: {total:.3f}")
