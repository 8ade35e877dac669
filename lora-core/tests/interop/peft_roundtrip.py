"""Interop check between lora-core and Python PEFT (run by lora-core/tests/core/interop_peft.rs).

Usage: peft_roundtrip.py WORKDIR

WORKDIR holds, written by the Rust test:
  base.safetensors   base weights of the model below (emb, fc1, fc2, conv) and inputs ids / img
  ours/, ours_dora/  PEFT adapter folders saved by lora-core

This script
  (a) loads each of our adapters with PeftModel.from_pretrained on the same base and writes the
      outputs to out_<name>.safetensors;
  (b) builds adapters with PEFT itself (non-zero B, rank/alpha patterns, rsLoRA, DoRA), saves them with
      save_pretrained to theirs/ and theirs_dora/, and writes their outputs to out_theirs*.safetensors,
      which the Rust test loads and compares.
"""

import sys
from pathlib import Path

import torch
from torch import nn
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file


class Net(nn.Module):
    def __init__(self, vocab, dim, hidden, cin, cout):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, ids, img):
        h = self.emb(ids)
        h = self.fc2(torch.relu(self.fc1(h)))
        return h, self.conv(img)


def base_model(tensors):
    vocab, dim = tensors["emb.weight"].shape
    hidden = tensors["fc1.weight"].shape[0]
    cout, cin = tensors["conv.weight"].shape[:2]
    m = Net(vocab, dim, hidden, cin, cout)
    m.load_state_dict({k: v for k, v in tensors.items() if k not in ("ids", "img")})
    return m.eval()


def run(model, tensors):
    with torch.no_grad():
        h, c = model(tensors["ids"], tensors["img"])
    return {"h": h.contiguous(), "c": c.contiguous()}


def main():
    work = Path(sys.argv[1])
    tensors = load_file(str(work / "base.safetensors"))
    torch.manual_seed(0)

    # (a) our adapters in PEFT
    for name in ("ours", "ours_dora"):
        model = PeftModel.from_pretrained(base_model(tensors), str(work / name)).eval()
        save_file(run(model, tensors), str(work / f"out_{name}.safetensors"))

    # (b) PEFT's adapters for us
    plain = LoraConfig(
        r=4,
        lora_alpha=12,
        target_modules=["emb", "fc1", "fc2", "conv"],
        rank_pattern={"fc2": 2},
        alpha_pattern={"conv": 3},
        use_rslora=True,
        init_lora_weights=False,  # random B so the adapter is not the identity
    )
    dora = LoraConfig(r=3, lora_alpha=5, target_modules=["fc1", "fc2", "conv"], use_dora=True, init_lora_weights=False)
    for name, cfg in (("theirs", plain), ("theirs_dora", dora)):
        model = get_peft_model(base_model(tensors), cfg)
        if cfg.use_dora:
            # move the magnitudes away from the weight norms so DoRA's rescaling matters
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_magnitude_vector" in n:
                        p.mul_(1.0 + 0.3 * torch.rand_like(p))
        model.eval()
        model.save_pretrained(str(work / name))
        save_file(run(model, tensors), str(work / f"out_{name}.safetensors"))
    print("ok")


if __name__ == "__main__":
    main()
