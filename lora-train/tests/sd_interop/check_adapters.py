"""Interop half of `tests/train/sd_job.rs`: diffusers 0.42.1 + PEFT on the tiny pipeline of
`make_pipeline.py`.

1. Fixed UNet inputs (seeded): `sample` [2, 4, 16, 16], `timesteps` [2] int64 (10, 500),
   `encoder_hidden_states` [2, 77, 32] → `inputs.safetensors`.
2. The base UNet's output (`base`), then the output after `pipe.load_lora_weights(<kohya file>)`
   — the adapter our SD job trained, read by diffusers' kohya converter (`kohya`); the same for
   the text encoder's `last_hidden_state` of the prompt "emoji, grinning face" (`te_ids`,
   `te_base`, `te_kohya`) and the numbers of modules diffusers put the adapter on
   (`kohya_modules`, `kohya_te_modules`).
3. A fresh pipeline with a PEFT adapter made by diffusers itself:
   `unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=[to_q, to_k, to_v, to_out.0],
   init_lora_weights=False))` (random A and B), its output (`peft`), and the adapter written by
   `get_peft_model_state_dict` + `StableDiffusionPipeline.save_lora_weights` to
   `<out>/peft/pytorch_lora_weights.safetensors` (alpha = r, so scaling 1 needs no metadata).

Outputs go to `<out>/outputs.safetensors` (f32). Usage:
check_adapters.py --pipeline DIR --kohya FILE --out DIR
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--kohya", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    inputs = {
        "sample": torch.randn(2, 4, 16, 16, generator=g),
        "timesteps": torch.tensor([10, 500], dtype=torch.int64),
        "encoder_hidden_states": torch.randn(2, 77, 32, generator=g),
    }
    save_file(inputs, os.path.join(a.out, "inputs.safetensors"))

    def run(unet):
        with torch.no_grad():
            return unet(
                inputs["sample"], inputs["timesteps"], inputs["encoder_hidden_states"]
            ).sample.float().contiguous()

    out = {}
    pipe = StableDiffusionPipeline.from_pretrained(a.pipeline, safety_checker=None)
    ids = pipe.tokenizer(
        ["emoji, grinning face"], padding="max_length", max_length=77, truncation=True, return_tensors="pt"
    ).input_ids
    out["te_ids"] = ids.to(torch.int64).contiguous()

    def run_te():
        with torch.no_grad():
            return pipe.text_encoder(ids).last_hidden_state.float().contiguous()

    out["base"] = run(pipe.unet)
    out["te_base"] = run_te()
    pipe.load_lora_weights(a.kohya, adapter_name="ours")
    count = lambda m: sum(1 for n, _ in m.named_modules() if n.endswith("lora_A.ours"))  # noqa: E731
    out["kohya_modules"] = torch.tensor([count(pipe.unet)], dtype=torch.int64)
    out["kohya_te_modules"] = torch.tensor([count(pipe.text_encoder)], dtype=torch.int64)
    out["kohya"] = run(pipe.unet)
    out["te_kohya"] = run_te()

    pipe = StableDiffusionPipeline.from_pretrained(a.pipeline, safety_checker=None)
    torch.manual_seed(11)
    cfg = LoraConfig(
        r=4,
        lora_alpha=4,
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
        init_lora_weights=False,
    )
    pipe.unet.add_adapter(cfg)
    out["peft"] = run(pipe.unet)
    state = get_peft_model_state_dict(pipe.unet)
    pdir = os.path.join(a.out, "peft")
    StableDiffusionPipeline.save_lora_weights(pdir, unet_lora_layers=state, safe_serialization=True)
    save_file(out, os.path.join(a.out, "outputs.safetensors"))


if __name__ == "__main__":
    main()
