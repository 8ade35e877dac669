"""Writes an HF-layout folder (config.json, model.safetensors in f32, tokenizer.json) from a GGUF
LLaMA-family file, with transformers' own GGUF reader (`from_pretrained(..., gguf_file=...)`,
which dequantizes every tensor): a dense safetensors base with real weights for the tests of
`model.weights: quantized` on HF folders.

    python gguf_to_hf.py MODEL.gguf OUT_DIR

transformers refuses `save_pretrained` on a model it read from GGUF, so the state dict is written
with safetensors itself (the tied `lm_head.weight` left out, as save_pretrained leaves it out),
and config.json without the `quantization_config` that names the GGUF file.
"""

import os
import sys


def main(gguf, out):
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    os.makedirs(out, exist_ok=True)
    tied = model.config.tie_word_embeddings
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (tied and k == "lm_head.weight")
    }
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    # the folder is a plain dense checkpoint: no record of the GGUF it came from
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
