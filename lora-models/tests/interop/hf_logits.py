"""Reference logits and token ids from Python transformers for the interop test.

transformers loads the same GGUF file (dequantising it to float32 and undoing llama.cpp's Q/K
permutation itself, `transformers/integrations/ggml.py` + `modeling_gguf_pytorch_utils.py`), and its
GGUF tokenizer converter builds the tokenizer from the file's vocabulary and merges.

Usage: hf_logits.py --gguf PATH --out DIR
Writes DIR/reference.safetensors with, for each case N, `ids.N` (int64 [1, s]) and `logits.N`
(float32 [1, s, vocab]), DIR/tokens.json {"cases": [...texts], "extra": {text: ids}}, and the
tokenizer saved by transformers under DIR/tokenizer/ (tokenizer.json).
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

CASES = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog. It was a sunny day and the children were playing in the park.",
    "<|im_start|>user\nWhat is 12 + 30?<|im_end|>\n<|im_start|>assistant\n",
]
EXTRA = [
    "In 2024, 12345 apples cost $3.99 each!",
    "  leading spaces and\ttabs\nnew lines",
    "naïve café, 東京, emoji 🙂",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    folder, name = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    model.eval()
    tensors = {}
    with torch.no_grad():
        for i, text in enumerate(CASES):
            ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
            tensors[f"ids.{i}"] = ids.to(torch.int64).contiguous()
            tensors[f"logits.{i}"] = model(ids).logits.float().contiguous()
    os.makedirs(a.out, exist_ok=True)
    save_file(tensors, os.path.join(a.out, "reference.safetensors"))
    extra = {t: tok(t, add_special_tokens=False).input_ids for t in EXTRA + CASES}
    # the same tokenizer as an HF tokenizer.json, for `load_tokenizer`
    tok.save_pretrained(os.path.join(a.out, "tokenizer"))
    with open(os.path.join(a.out, "tokens.json"), "w") as f:
        json.dump({"cases": CASES, "extra": extra}, f, ensure_ascii=False)


if __name__ == "__main__":
    main()
