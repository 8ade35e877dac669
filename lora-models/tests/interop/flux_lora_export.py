"""diffusers' (and ComfyUI's) view of FLUX LoRA files written by `tests/models/flux_lora.rs`.

The tiny dev-like FluxTransformer2DModel and its inputs are the ones `flux_transformer.py` writes
(`--model` is its `dev/transformer` folder, `--inputs` its `reference.safetensors`, `dev.*`).
For each LoRA file given, the script runs the transformer with the adapter on those inputs and
writes the output under `--out` (a safetensors file):

- `diffusers.out`: `--diffusers FILE` (`transformer.<module>.lora_A.weight` keys) loaded with
  `FluxPipeline.load_lora_weights` into a FluxPipeline holding only the transformer;
- `kohya.out`: `--kohya FILE` (`lora_unet_<BFL module>` keys) loaded the same way: diffusers'
  `_convert_kohya_flux_lora_to_diffusers` splits the fused modules. That converter assumes
  FLUX.1's widths for `single_blocks.N.linear1`, and names the modules outside the blocks
  (`time_in`, `final_layer`, ...) without the `transformer.` prefix so that `load_lora_weights`
  ignores them: this file holds double- and single-block modules other than linear1;
- `diffusers.modules`, `kohya.modules`: how many LoRA modules the transformer got.

`--convert FILE --converted OUT`: a kohya file of FLUX.1-dev's widths (one double and one single
block) converted by `FluxPipeline.lora_state_dict` (the conversion `load_lora_weights` runs) and
saved as it comes out (`transformer.<module>.lora_A.weight` / `.lora_B.weight`, scaling folded).
This is the path of `single_blocks.N.linear1`, which the converter splits only at these widths.
- `comfy.out`: `--comfy FILE` (the same layout, all modules) applied as ComfyUI applies a LoRA to
  a BFL-layout model: `W += alpha / rank * (lora_up @ lora_down)` on each BFL weight (ComfyUI
  `comfy/lora.py`), the BFL weights being the model's own converted with `flux_transformer.py`'s
  `to_bfl`, then mapped back to diffusers' names row by row (the inverse of `to_bfl`, read off
  `to_bfl` applied to row-index tensors) and loaded into the model.

Usage: flux_lora_export.py --model DIR --inputs FILE --out FILE [--diffusers F] [--kohya F] [--comfy F]
                           [--convert F --converted F]
"""

import argparse
import copy
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flux_transformer import to_bfl  # noqa: E402


def forward(m, ref):
    with torch.no_grad():
        return m(
            hidden_states=ref["dev.hs"],
            encoder_hidden_states=ref["dev.ehs"],
            pooled_projections=ref["dev.pooled"],
            timestep=ref["dev.t"],
            img_ids=ref["dev.img_ids"],
            txt_ids=ref["dev.txt_ids"],
            guidance=ref["dev.guidance"],
            return_dict=False,
        )[0].contiguous()


def with_pipeline_lora(model_dir, path, ref):
    transformer = FluxTransformer2DModel.from_pretrained(model_dir).eval()
    pipe = FluxPipeline(
        scheduler=None,
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        transformer=transformer,
    )
    pipe.load_lora_weights(path, adapter_name="exported")
    n = sum(1 for k, _ in transformer.named_parameters() if "lora_A" in k)
    print(f"{os.path.basename(path)}: {n} LoRA modules loaded by FluxPipeline.load_lora_weights")
    return forward(transformer, ref), torch.tensor(float(n))


def comfy_lora(model_dir, path, ref):
    m = FluxTransformer2DModel.from_pretrained(model_dir).eval()
    cfg = m.config
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    bfl = to_bfl(sd, cfg.num_layers, cfg.num_single_layers, None)
    # where each BFL row comes from: to_bfl of tensors holding (key number, row)
    names = sorted(sd)
    ids = {k: torch.arange(sd[k].shape[0], dtype=torch.int64) + i * 1_000_000 for i, k in enumerate(names)}
    bfl_ids = to_bfl(ids, cfg.num_layers, cfg.num_single_layers, None)
    lora = load_file(path)
    modules = {k.rsplit(".", 2)[0] for k in lora if k.endswith(".lora_down.weight")}
    applied = 0
    for key in list(bfl):
        if not key.endswith(".weight"):
            continue
        name = "lora_unet_" + key[: -len(".weight")].replace(".", "_")
        if name not in modules:
            continue
        down = lora[f"{name}.lora_down.weight"].double()
        up = lora[f"{name}.lora_up.weight"].double()
        alpha = lora[f"{name}.alpha"].item()
        bfl[key] = (bfl[key].double() + alpha / down.shape[0] * (up @ down)).float()
        modules.remove(name)
        applied += 1
    assert not modules, f"modules of no BFL weight: {sorted(modules)}"
    out = {k: v.clone() for k, v in sd.items()}
    for key, t in bfl.items():
        src = bfl_ids[key]
        for i, k in enumerate(names):
            rows = (src // 1_000_000) == i
            if rows.any():
                out[k][src[rows] % 1_000_000] = t[rows]
    m.load_state_dict(out)
    print(f"{os.path.basename(path)}: {applied} BFL weights patched as ComfyUI does")
    return forward(m, ref)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--inputs", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--diffusers")
    ap.add_argument("--kohya")
    ap.add_argument("--comfy")
    ap.add_argument("--convert")
    ap.add_argument("--converted")
    a = ap.parse_args()
    torch.set_num_threads(1)
    ref = load_file(a.inputs)
    out = {}
    if a.diffusers:
        out["diffusers.out"], out["diffusers.modules"] = with_pipeline_lora(a.model, a.diffusers, ref)
    if a.kohya:
        out["kohya.out"], out["kohya.modules"] = with_pipeline_lora(a.model, a.kohya, ref)
    if a.comfy:
        out["comfy.out"] = comfy_lora(a.model, a.comfy, ref)
    save_file(out, a.out)
    if a.convert:
        sd = FluxPipeline.lora_state_dict(a.convert)
        save_file({k: v.contiguous() for k, v in sd.items()}, a.converted)
        print(f"{os.path.basename(a.convert)}: converted to {len(sd)} diffusers tensors")


if __name__ == "__main__":
    main()
