"""Reference outputs of transformers' T5EncoderModel for `tests/models/t5.rs`.

Builds tiny T5 encoders with random weights (fixed seed) and writes, under --out:

- `t5/` (save_pretrained): T5 v1.1 style, `feed_forward_proj` "gated-gelu", 32 buckets with
  `relative_attention_max_distance` 20 so that a 24-token sequence reaches the logarithmic
  buckets and the last one;
- `t5_relu/`: the original T5 feed-forward (`relu`, `wi`/`wo`) with an attention inner width
  (`num_heads * d_kv` = 24) other than `d_model` (32);
- `t5xxl_layout.safetensors`: the gated model's weights in f16 under transformers' names with
  `shared.weight` and without `encoder.embed_tokens.weight`, as ComfyUI's `t5xxl_fp16.safetensors`;
- `tok/tokenizer.json`: a T5 tokenizer (unigram) built from a small vocabulary, and
  `tokens.json`: its ids for a few texts with `padding="max_length", truncation=True`;
- `reference.safetensors`: `ids` [2, 24] (row 1 padded after 15 tokens), `mask`, `hidden`
  (last_hidden_state with the mask), `hidden_nomask`, `hidden_relu` (the relu model, masked),
  `hidden_f16w` (the gated model with its weights rounded to f16, computed in f32, masked),
  `hidden_bf16` / `hidden_f16` (the same model run by transformers in bf16 / f16, as f32),
  `num_params`, `num_params_relu`.

Usage: t5_encoder.py --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import T5Config, T5EncoderModel, T5Tokenizer  # noqa: E402

GATED = dict(
    vocab_size=100,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=20,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
)
RELU = dict(GATED, feed_forward_proj="relu", d_kv=6, num_layers=3)


def build(cfg, seed):
    torch.manual_seed(seed)
    m = T5EncoderModel(T5Config(**cfg))
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        # norms near 1, as trained models have them
        for n, p in m.named_parameters():
            if "layer_norm" in n:
                p.add_(1.0)
    return m.eval()


def tokenizer(out):
    words = ["a", "photo", "of", "cat", "dog", "the", "red", "car", "on", "street", "s", "ing"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0 - i * 0.1) for i, w in enumerate(words)]
    vocab += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    tok = T5Tokenizer(vocab=vocab, extra_ids=0)
    tok.save_pretrained(os.path.join(out, "tok"))
    texts = ["a photo of a cat", "the red car on the street", "dogs"]
    cases = []
    for max_length in (12, 5):
        enc = tok(texts, padding="max_length", max_length=max_length, truncation=True)
        cases.append(
            {"max_length": max_length, "input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        )
    unpadded = [tok(t)["input_ids"] for t in texts]
    with open(os.path.join(out, "tokens.json"), "w") as f:
        json.dump({"texts": texts, "cases": cases, "unpadded": unpadded}, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gated = build(GATED, 0)
    relu = build(RELU, 1)
    gated.save_pretrained(os.path.join(a.out, "t5"), safe_serialization=True)
    relu.save_pretrained(os.path.join(a.out, "t5_relu"), safe_serialization=True)
    sd = {k: v.to(torch.float16).contiguous() for k, v in gated.state_dict().items()}
    sd.pop("encoder.embed_tokens.weight", None)
    assert "shared.weight" in sd
    save_file(sd, os.path.join(a.out, "t5xxl_layout.safetensors"))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(3, GATED["vocab_size"], (2, 24), generator=gen)
    mask = torch.ones(2, 24, dtype=torch.int64)
    mask[1, 15:] = 0
    ids[1, 15:] = 0  # <pad>
    ids[:, -1] = 1
    ids[1, 14] = 1  # </s> of the padded row
    with torch.no_grad():
        hidden = gated(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden_nomask = gated(input_ids=ids).last_hidden_state
        hidden_relu = relu(input_ids=ids, attention_mask=mask).last_hidden_state
        for p in gated.parameters():
            p.copy_(p.to(torch.float16).to(torch.float32))
        hidden_f16w = gated(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden_bf16 = gated.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        gated.to(torch.float32)
        hidden_f16 = gated.to(torch.float16)(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    ref = {
        "ids": ids,
        "mask": mask,
        "hidden": hidden,
        "hidden_nomask": hidden_nomask,
        "hidden_relu": hidden_relu,
        "hidden_f16w": hidden_f16w,
        "hidden_bf16": hidden_bf16,
        "hidden_f16": hidden_f16,
        "num_params": torch.tensor([sum(p.numel() for p in gated.parameters())], dtype=torch.int64),
        "num_params_relu": torch.tensor([sum(p.numel() for p in relu.parameters())], dtype=torch.int64),
    }
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(a.out, "reference.safetensors"))
    tokenizer(a.out)


if __name__ == "__main__":
    main()
