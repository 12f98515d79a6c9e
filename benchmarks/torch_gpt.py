"""PyTorch eager baseline for benchmarks/train_throughput.rs: the same GPT (Megatron layout,
padded vocabulary 50304, tied output layer, exact GELU, dropout 0.1), AdamW, fp32, CPU.

Prints `tokens/s: X` and `gemm GFLOP/s: Y` (a 1024^3 matmul, for scale).
usage: python torch_gpt.py LAYERS HIDDEN HEADS SEQ BATCH STEPS
"""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

layers, hidden, heads, seq, batch, steps = map(int, sys.argv[1:7])
vocab = 50304
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-5)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.out = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(0.1)
        self.attn_drop = nn.Dropout(0.1)

    def forward(self, x):
        b, s, h = x.shape
        hd = h // heads
        q, k, v = self.qkv(self.ln1(x)).view(b, s, heads, 3 * hd).transpose(1, 2).split(hd, dim=3)
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        probs = self.attn_drop(torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1))
        x = x + self.drop(self.proj((probs @ v).transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class Gpt(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block() for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, eps=1e-5)
        self.drop = nn.Dropout(0.1)

    def forward(self, tokens):
        x = self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1])))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


model = Gpt()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
tokens = torch.randint(0, 50257, (batch, seq + 1))


def step():
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()


for _ in range(2):
    step()
start = time.perf_counter()
for _ in range(steps):
    step()
elapsed = time.perf_counter() - start
print(f"tokens/s: {steps * batch * seq / elapsed:.1f}")
a = torch.randn(1024, 1024)
b = torch.randn(1024, 1024)
a @ b
start = time.perf_counter()
for _ in range(10):
    a @ b
print(f"gemm GFLOP/s: {10 * 2 * 1024**3 / (time.perf_counter() - start) / 1e9:.1f}")
print(f"threads: {torch.get_num_threads()}")
