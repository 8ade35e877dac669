"""Loads the FLUX adapters the job wrote into diffusers and records the transformer's outputs, for
`tests/train/flux_job.rs`.

`FluxPipeline.from_pretrained(--pipeline)` (the tiny random-weight pipeline of `make_fixture.py`)
runs its transformer on fixed inputs (seed 0) without an adapter and with each adapter file given:

- `--diffusers`: our `pytorch_lora_weights.safetensors`, loaded by diffusers' own
  `FluxPipeline.load_lora_weights` into a fresh pipeline;
- `--kohya`: our kohya / ComfyUI file in BFL's fused keys, applied as ComfyUI applies a LoRA to a
  BFL-layout model (`comfy_lora` of `lora-models/tests/interop/flux_lora_export.py`: every module,
  `W += alpha / rank * up @ down` on the BFL weights). diffusers' kohya converter is not used
  here: it assumes FLUX.1's widths for `single_blocks.N.linear1` (tested at those widths in
  lora-models).

The inputs:
packed latents `hidden_states` [2, L, in_channels] for a 32 × 32 px image, T5 states
`encoder_hidden_states` [2, 16, joint_attention_dim], `pooled_projections`, `timestep` [2]
(σ 0.3, 0.8), `guidance` [2] (dev), `img_ids`, `txt_ids`.

Writes `--out/inputs.safetensors` (those inputs) and `--out/outputs.safetensors`: `base` (no
adapter), `kohya` / `diffusers` (with each adapter), and `<name>_modules`, the number of
transformer modules diffusers put a LoRA layer on (diffusers only).

Usage: check_adapters.py --pipeline DIR [--kohya FILE] [--diffusers FILE] --out DIR
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import sys  # noqa: E402

import torch  # noqa: E402
from diffusers import FluxPipeline  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "lora-models", "tests", "interop"))
from flux_lora_export import comfy_lora  # noqa: E402


def inputs(cfg, vae_scale_factor):
    g = torch.Generator().manual_seed(0)
    h = w = 32 // vae_scale_factor // 2  # a 32 px image, the autoencoder's factor, 2x2 packing
    x = torch.randn(2, h * w, cfg.in_channels, generator=g)
    ctx = torch.randn(2, 16, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(2, cfg.pooled_projection_dim, generator=g)
    img_ids = FluxPipeline._prepare_latent_image_ids(2, h, w, "cpu", torch.float32)
    txt_ids = torch.zeros(16, 3)
    out = dict(
        hidden_states=x,
        encoder_hidden_states=ctx,
        pooled_projections=pooled,
        timestep=torch.tensor([0.3, 0.8]),
        img_ids=img_ids,
        txt_ids=txt_ids,
    )
    if cfg.guidance_embeds:
        out["guidance"] = torch.tensor([1.0, 3.5])
    return out


def run(pipe, inp):
    with torch.no_grad():
        return pipe.transformer(**inp, return_dict=False)[0].contiguous()


def lora_modules(model):
    return sum(1 for _, m in model.named_modules() if hasattr(m, "lora_A") and len(m.lora_A) > 0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", required=True)
    ap.add_argument("--kohya")
    ap.add_argument("--diffusers")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    pipe = FluxPipeline.from_pretrained(a.pipeline, torch_dtype=torch.float32)
    inp = inputs(pipe.transformer.config, pipe.vae_scale_factor)
    outs = {"base": run(pipe, inp)}
    if a.diffusers:
        p = FluxPipeline.from_pretrained(a.pipeline, torch_dtype=torch.float32)
        p.load_lora_weights(a.diffusers)
        outs["diffusers"] = run(p, inp)
        outs["diffusers_modules"] = torch.tensor([lora_modules(p.transformer)])
    if a.kohya:
        # comfy_lora's inputs under flux_transformer.py's reference names
        ref = {
            "dev.hs": inp["hidden_states"],
            "dev.ehs": inp["encoder_hidden_states"],
            "dev.pooled": inp["pooled_projections"],
            "dev.t": inp["timestep"],
            "dev.img_ids": inp["img_ids"],
            "dev.txt_ids": inp["txt_ids"],
            "dev.guidance": inp.get("guidance"),
        }
        outs["kohya"] = comfy_lora(os.path.join(a.pipeline, "transformer"), a.kohya, ref)
    save_file({k: v.contiguous() for k, v in inp.items()}, os.path.join(a.out, "inputs.safetensors"))
    save_file(outs, os.path.join(a.out, "outputs.safetensors"))


if __name__ == "__main__":
    main()
