"""Loads the Llama-family models that `tests/llama.rs` exported with ferrotron's `export-hf`
code into HuggingFace transformers, and checks them against the fixtures they were imported
from: the mean loss over the fixture's windows (to 1e-4) and the greedy continuations (token
for token).

    cargo test --test integration llama::exported_llama_family_models_import_back_unchanged
    /work/venv/bin/python tests/hf_check_exports.py target/tmp/llama_exports

(`target/tmp` is cargo's CARGO_TARGET_TMPDIR; with CARGO_TARGET_DIR set, it is under that.)
Prints one line per model and exits non-zero on any difference.
"""
import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

root = sys.argv[1]
fixtures = os.path.join(os.path.dirname(__file__), "fixtures")
failed = False
for name in sorted(os.listdir(root)):
    reference = json.load(open(os.path.join(fixtures, name + ".json")))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(root, name), dtype=torch.float32).eval()
    with torch.no_grad():
        windows = torch.tensor(reference["windows"])
        logits = model(windows[:, :-1]).logits.double()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()
        same_tokens = True
        for case in reference["greedy"]:
            ids = torch.tensor([case["prompt"]])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=20, pad_token_id=249)
            same_tokens &= out[0, ids.shape[1]:].tolist() == case["tokens"]
    ok = abs(loss - reference["mean_loss"]) < 1e-4 and same_tokens
    failed |= not ok
    print(f"{name}: {type(model).__name__}, loss {loss:.6f} (fixture {reference['mean_loss']:.6f}), "
          f"greedy tokens {'equal' if same_tokens else 'DIFFER'}: {'ok' if ok else 'FAILED'}")
sys.exit(1 if failed else 0)
