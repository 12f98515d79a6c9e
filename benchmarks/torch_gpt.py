"""PyTorch eager baseline for benchmarks/train_throughput.rs: the same GPT (Megatron layout,
padded vocabulary 50304, tied output layer, exact GELU, dropout 0.1), AdamW, fp32, CPU; or,
with a last argument `llama GROUPS FFN`, the same Llama-style model as ferrotron's row
(rotary embeddings θ = 10000 on split halves, RMSNorm, SwiGLU of width FFN, GROUPS key/value
heads, no biases, untied output layer, dropout 0.1).

Prints `tokens/s: X` and `gemm GFLOP/s: Y` (a 1024^3 matmul, for scale).
usage: python torch_gpt.py LAYERS HIDDEN HEADS SEQ BATCH STEPS [llama GROUPS FFN]
"""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

layers, hidden, heads, seq, batch, steps = map(int, sys.argv[1:7])
llama = len(sys.argv) > 7 and sys.argv[7] == "llama"
groups, ffn = (int(sys.argv[8]), int(sys.argv[9])) if llama else (heads, 4 * hidden)
vocab = 50304
torch.manual_seed(0)


def causal_attention(q, k, v, attn_drop):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = q.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
    probs = attn_drop(torch.softmax(scores.masked_fill(mask, -10000.0), dim=-1))
    return probs @ v


class RmsNorm(nn.Module):
    def __init__(self, width, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x, cos, sin):
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class LlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.hd = hidden // heads
        self.ln1 = RmsNorm(hidden)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.hd, bias=False)
        self.proj = nn.Linear(heads * self.hd, hidden, bias=False)
        self.ln2 = RmsNorm(hidden)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.drop = nn.Dropout(0.1)
        self.attn_drop = nn.Dropout(0.1)

    def forward(self, x, cos, sin):
        b, s, h = x.shape
        per = heads // groups
        qkv = self.qkv(self.ln1(x)).view(b, s, groups, per + 2, self.hd)
        q = qkv[:, :, :, :per].reshape(b, s, heads, self.hd).transpose(1, 2)
        k = qkv[:, :, :, per].transpose(1, 2)
        v = qkv[:, :, :, per + 1].transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k = k.repeat_interleave(per, dim=1)
        v = v.repeat_interleave(per, dim=1)
        context = causal_attention(q, k, v, self.attn_drop)
        x = x + self.drop(self.proj(context.transpose(1, 2).reshape(b, s, heads * self.hd)))
        y = self.ln2(x)
        return x + self.drop(self.down(F.silu(self.gate(y)) * self.up(y)))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(LlamaBlock() for _ in range(layers))
        self.ln_f = RmsNorm(hidden)
        self.out = nn.Linear(hidden, vocab, bias=False)
        self.drop = nn.Dropout(0.1)
        hd = hidden // heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos, self.sin = angles.cos(), angles.sin()

    def forward(self, tokens):
        x = self.drop(self.wte(tokens))
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.out(self.ln_f(x))


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


model = Llama() if llama else Gpt()
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
