"""PyTorch reference for benchmarks/gpu_profile.sh: the same GPT as ferrotron (Megatron layout:
pre-LN, learned positions, exact GELU, tied output layer over the padded 50304 vocabulary,
dropout), AdamW, on a CUDA GPU.

usage: python torch_gpu_gpt.py LAYERS HIDDEN HEADS SEQ MICRO_BATCH STEPS MODE [DROPOUT]
  MODE: fp32           eager fp32, explicit softmax attention (ferrotron's fp32 math)
        bf16-sdpa      bf16 autocast, scaled_dot_product_attention (flash)
        bf16-compile   bf16-sdpa under torch.compile

Prints one line: `tokens/s: X | TFLOP/s: Y | MFU: Z | peak memory GiB: W`.
"""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

layers, hidden, heads, seq, batch, steps = map(int, sys.argv[1:7])
mode = sys.argv[7]
p_drop = float(sys.argv[8]) if len(sys.argv) > 8 else 0.1
vocab = 50304
peak_tflops = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
device = "cuda"
torch.manual_seed(0)
sdpa = mode != "fp32"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-5)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(p_drop)
        self.attn_drop = nn.Dropout(p_drop)

    def forward(self, x):
        b, s, h = x.shape
        hd = h // heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, heads, 3 * hd).transpose(1, 2).split(hd, dim=3)
        if sdpa:
            ctx = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p_drop if self.training else 0.0, is_causal=True
            )
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
            mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), 1)
            ctx = self.attn_drop(torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1)) @ v
        x = x + self.drop(self.proj(ctx.transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.drop = nn.Dropout(p_drop)

    def forward(self, tokens):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


model = Gpt().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
tokens = torch.randint(0, 50257, (batch, seq + 1), device=device)
forward = torch.compile(model) if mode == "bf16-compile" else model


def step():
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode != "fp32"):
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


for _ in range(3):
    step()
torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
start = time.perf_counter()
for _ in range(steps):
    step()
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
tps = steps * batch * seq / elapsed
# Megatron's accounting: 6 × (matmul parameters) + attention, per token.
h, f, v, l = hidden, 4 * hidden, vocab, layers
flops_per_token = 6 * (l * (4 * h * h + 2 * h * f) + v * h) + 12 * l * h * seq
tflops = tps * flops_per_token / 1e12
name = torch.cuda.get_device_name()
peak = next((t for k, t in peak_tflops.items() if k in name), None)
mfu = f"{100 * tflops / peak:.1f} %" if peak else "n/a"
memory = torch.cuda.max_memory_allocated() / 2**30
print(f"tokens/s: {tps:.0f} | TFLOP/s: {tflops:.1f} | MFU: {mfu} | peak memory GiB: {memory:.1f}")
