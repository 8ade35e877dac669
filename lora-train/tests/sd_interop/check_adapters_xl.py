"""Interop half of `tests/train/sd_xl_job.rs`: diffusers 0.42.1 + PEFT on the tiny SDXL pipeline of
`make_pipeline.py --sdxl`.

1. Fixed UNet inputs (seeded): `sample` [2, 4, 16, 16], `timesteps` [2] int64 (10, 500),
   `encoder_hidden_states` [2, 77, 64], `text_embeds` [2, 32], `time_ids` [2, 6]
   → `inputs.safetensors`.
2. For the base pipeline and after each `StableDiffusionXLPipeline.load_lora_weights(file)` of the
   files given with `--adapter NAME=FILE` (a fresh pipeline each): the UNet output (`NAME`), the
   text conditioning of the prompt "emoji, grinning face" as `encode_prompt` builds it — the
   penultimate hidden states of both encoders concatenated (`NAME_te`, [1, 77, 64]) and
   text_encoder_2's `text_embeds` (`NAME_pooled`, [1, 32]) — and the numbers of modules diffusers
   put the adapter on (`NAME_modules` = [unet, text_encoder, text_encoder_2]). The base is `base`.
   The token ids of both tokenizers are saved too (`ids`, `ids_2`).
3. A fresh pipeline with a PEFT adapter made by diffusers itself on the UNet and both text
   encoders (`LoraConfig(r=4, lora_alpha=4, init_lora_weights=False)`, UNet
   to_q/to_k/to_v/to_out.0, text encoders q/k/v/out_proj), its outputs (`peft`, `peft_te`,
   `peft_pooled`), and the file `StableDiffusionXLPipeline.save_lora_weights` writes
   (`<out>/peft/pytorch_lora_weights.safetensors`).

Outputs go to `<out>/outputs.safetensors` (f32, counts int64). Usage:
check_adapters_xl.py --pipeline DIR --out DIR [--adapter NAME=FILE ...]
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

PROMPT = "emoji, grinning face"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapter", action="append", default=[])
    a = ap.parse_args()
    torch.set_num_threads(1)
    from diffusers import StableDiffusionXLPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    inputs = {
        "sample": torch.randn(2, 4, 16, 16, generator=g),
        "timesteps": torch.tensor([10, 500], dtype=torch.int64),
        "encoder_hidden_states": torch.randn(2, 77, 64, generator=g),
        "text_embeds": torch.randn(2, 32, generator=g),
        "time_ids": torch.tensor([[40.0, 36.0, 2.0, 0.0, 32.0, 32.0], [32.0, 32.0, 0.0, 0.0, 32.0, 32.0]]),
    }
    save_file(inputs, os.path.join(a.out, "inputs.safetensors"))
    out = {}

    def load():
        return StableDiffusionXLPipeline.from_pretrained(a.pipeline)

    def record(pipe, name):
        with torch.no_grad():
            out[name] = pipe.unet(
                inputs["sample"],
                inputs["timesteps"],
                inputs["encoder_hidden_states"],
                added_cond_kwargs={"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]},
            ).sample.float().contiguous()
            te, _, pooled, _ = pipe.encode_prompt(PROMPT, do_classifier_free_guidance=False)
        out[name + "_te"] = te.float().contiguous()
        out[name + "_pooled"] = pooled.float().contiguous()

    def count(m):
        return sum(1 for n, _ in m.named_modules() if n.endswith("lora_A.ours"))

    pipe = load()
    tok = dict(padding="max_length", max_length=77, truncation=True, return_tensors="pt")
    out["ids"] = pipe.tokenizer([PROMPT], **tok).input_ids.to(torch.int64).contiguous()
    out["ids_2"] = pipe.tokenizer_2([PROMPT], **tok).input_ids.to(torch.int64).contiguous()
    record(pipe, "base")
    for spec in a.adapter:
        name, path = spec.split("=", 1)
        pipe = load()
        pipe.load_lora_weights(path, adapter_name="ours")
        out[name + "_modules"] = torch.tensor(
            [count(pipe.unet), count(pipe.text_encoder), count(pipe.text_encoder_2)], dtype=torch.int64
        )
        record(pipe, name)

    pipe = load()
    torch.manual_seed(11)
    unet_cfg = LoraConfig(
        r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
    )
    te_cfg = LoraConfig(
        r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"], init_lora_weights=False
    )
    pipe.unet.add_adapter(unet_cfg)
    # transformers' `add_adapter` wants PEFT ≥ 0.22; PEFT's own injection does the same
    inject_adapter_in_model(te_cfg, pipe.text_encoder)
    inject_adapter_in_model(te_cfg, pipe.text_encoder_2)
    record(pipe, "peft")
    StableDiffusionXLPipeline.save_lora_weights(
        os.path.join(a.out, "peft"),
        unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        text_encoder_lora_layers=get_peft_model_state_dict(pipe.text_encoder),
        text_encoder_2_lora_layers=get_peft_model_state_dict(pipe.text_encoder_2),
        safe_serialization=True,
    )
    save_file(out, os.path.join(a.out, "outputs.safetensors"))


if __name__ == "__main__":
    main()
