"""Logits of an HF causal LM with a PEFT adapter on top, written as one safetensors tensor:
what `PeftModel.from_pretrained` makes of an adapter this SDK exported.

    python peft_logits.py BASE_DIR ADAPTER_DIR IDS.json OUT.safetensors [--weights W.safetensors]

`--weights`: tensors that replace the base's before the adapter is loaded (strict names, each
must exist in the model): the NF4-rounded layer linears of a base trained with
`model.weights: quantized`, so the dense transformers model computes on the weights the run saw
(no bitsandbytes needed). Computed in f32 on the CPU, `model.eval()` (no dropout).
"""

import argparse
import json


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("adapter")
    p.add_argument("ids")
    p.add_argument("out")
    p.add_argument("--weights")
    a = p.parse_args()

    import torch
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.base, dtype=torch.float32)
    if a.weights:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, t in load_file(a.weights).items():
                if name not in params:
                    raise SystemExit(f"{a.weights}: {name} is no parameter of the model")
                if params[name].shape != t.shape:
                    raise SystemExit(f"{name}: shape {tuple(t.shape)}, the model's {tuple(params[name].shape)}")
                params[name].copy_(t)
    model = PeftModel.from_pretrained(model, a.adapter)
    model.eval()
    ids = torch.tensor(json.load(open(a.ids)), dtype=torch.long)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().contiguous()
    save_file({"logits": logits}, a.out)


if __name__ == "__main__":
    main()
