"""Scores a HuggingFace causal-LM directory (a ferrotron `export-hf` directory, or any model
AutoModelForCausalLM loads: GPT-2, Llama, Qwen2, Qwen3, Mistral, ...) with transformers on CPU.

Computes the mean next-token loss of the model, in float32, over the first N contiguous windows of
L+1 tokens of a dataset (window i = tokens[i*L : i*L+L+1]), exactly the samples `evaluate`
scores, and prints `mean lm loss: X`.

    python3 -m venv venv && venv/bin/pip install torch transformers safetensors numpy
    venv/bin/python tests/hf_check.py EXPORT_DIR DATA_PREFIX SEQ_LENGTH NUM_SAMPLES
"""
import struct
import sys

import numpy
import torch
from transformers import AutoModelForCausalLM

export_dir, prefix, seq_length, num_samples = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
idx = open(prefix + ".idx", "rb").read()
dtype = {8: numpy.uint16, 4: numpy.int32}[idx[17]]
tokens = numpy.fromfile(prefix + ".bin", dtype=dtype).astype(numpy.int64)
model = AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
losses = []
with torch.no_grad():
    for i in range(num_samples):
        window = torch.tensor(tokens[i * seq_length : i * seq_length + seq_length + 1]).unsqueeze(0)
        logits = model(window[:, :-1]).logits.double()
        loss = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="none")
        losses.extend(loss.tolist())
print(f"mean lm loss: {sum(losses) / len(losses):.6f}")
