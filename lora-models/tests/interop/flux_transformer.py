"""Reference outputs of diffusers' FluxTransformer2DModel for `tests/models/flux.rs`.

Writes, under --out:

- `dev/transformer/`, `schnell/transformer/` (save_pretrained): two tiny random-weight FLUX
  transformers (2 double + 2 single blocks, 2 heads x 16, RoPE axes (4, 6, 6), T5 width 32,
  pooled 24, 16 input channels), one with the guidance embedder (dev-like), one without
  (schnell-like, saved in shards with a `.safetensors.index.json`); the RMSNorm scales are
  randomised too;
- `dev_bfl.safetensors` (no prefix) and `schnell_bfl.safetensors` (ComfyUI's
  `model.diffusion_model.` prefix): the same weights in Black Forest Labs' original layout. The
  diffusers -> BFL map used here is written in this script, independently of the Rust code;
- `keymap.json`: the provenance of every tensor of diffusers' own converter
  `convert_flux_transformer_checkpoint_to_diffusers` on a FULL-shaped FLUX.1-dev checkpoint of 1
  double + 1 single block (the converter hardcodes inner_dim 3072 and mlp_ratio 4). The BFL input
  tensors are stride-0 `expand` views whose value at row r of BFL key number k is k * 100000 + r,
  so each converted tensor's first column says which BFL key and rows it was cut from. Recorded:
  `bfl` (BFL name -> shape) and `diffusers` (name -> {shape, runs: [[bfl name, start, rows]]});
- `params.json`: parameter counts of diffusers' model for the FLUX.1-dev and schnell configs
  (built on the meta device) and of the two tiny models, and the tiny models' `nn.Linear`
  module names (`tiny_dev_linears`, `tiny_schnell_linears`);
- `lora/`: a PEFT adapter (r=4, alpha=8, random non-zero A and B) on the dev model's attention,
  MLP, modulation and time-embedding linears, added with `transformer.add_adapter(LoraConfig(...))`
  and saved as adapter_config.json + adapter_model.safetensors (keys
  `base_model.model.<module>.lora_A.weight`), with `modules.json` listing the adapted modules;
- `reference.safetensors`: inputs and outputs of both tiny models (`dev.*`, `schnell.*`; `out_bf16`
  is the model and inputs cast to bfloat16; `lora.out` the dev model with the adapter), and
  latent packing by `FluxPipeline._pack_latents` / `_unpack_latents` /
  `_prepare_latent_image_ids` (`pack.*`).

Usage: flux_transformer.py --out DIR
"""

import argparse
import copy
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402
from diffusers.loaders.single_file_utils import (  # noqa: E402
    convert_flux_transformer_checkpoint_to_diffusers,
)
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

TINY = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    axes_dims_rope=(4, 6, 6),
)


def to_bfl(sd, num_layers, num_single_layers, inner):
    """diffusers state dict -> BFL names (BFL's flux/model.py module names)."""
    out = {}

    def mv(bfl, dif):
        out[bfl] = sd[dif].clone()

    for leaf in ("weight", "bias"):
        mv(f"img_in.{leaf}", f"x_embedder.{leaf}")
        mv(f"txt_in.{leaf}", f"context_embedder.{leaf}")
        for bfl, dif in (("time_in", "timestep_embedder"), ("vector_in", "text_embedder"), ("guidance_in", "guidance_embedder")):
            if f"time_text_embed.{dif}.linear_1.{leaf}" in sd:
                mv(f"{bfl}.in_layer.{leaf}", f"time_text_embed.{dif}.linear_1.{leaf}")
                mv(f"{bfl}.out_layer.{leaf}", f"time_text_embed.{dif}.linear_2.{leaf}")
        for i in range(num_layers):
            b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
            mv(f"{b}.img_mod.lin.{leaf}", f"{t}.norm1.linear.{leaf}")
            mv(f"{b}.txt_mod.lin.{leaf}", f"{t}.norm1_context.linear.{leaf}")
            out[f"{b}.img_attn.qkv.{leaf}"] = torch.cat([sd[f"{t}.attn.to_{x}.{leaf}"] for x in "qkv"])
            out[f"{b}.txt_attn.qkv.{leaf}"] = torch.cat([sd[f"{t}.attn.add_{x}_proj.{leaf}"] for x in "qkv"])
            mv(f"{b}.img_attn.proj.{leaf}", f"{t}.attn.to_out.0.{leaf}")
            mv(f"{b}.txt_attn.proj.{leaf}", f"{t}.attn.to_add_out.{leaf}")
            mv(f"{b}.img_mlp.0.{leaf}", f"{t}.ff.net.0.proj.{leaf}")
            mv(f"{b}.img_mlp.2.{leaf}", f"{t}.ff.net.2.{leaf}")
            mv(f"{b}.txt_mlp.0.{leaf}", f"{t}.ff_context.net.0.proj.{leaf}")
            mv(f"{b}.txt_mlp.2.{leaf}", f"{t}.ff_context.net.2.{leaf}")
        for i in range(num_single_layers):
            b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
            mv(f"{b}.modulation.lin.{leaf}", f"{t}.norm.linear.{leaf}")
            out[f"{b}.linear1.{leaf}"] = torch.cat(
                [sd[f"{t}.attn.to_{x}.{leaf}"] for x in "qkv"] + [sd[f"{t}.proj_mlp.{leaf}"]]
            )
            mv(f"{b}.linear2.{leaf}", f"{t}.proj_out.{leaf}")
        mv(f"final_layer.linear.{leaf}", f"proj_out.{leaf}")
        scale, shift = sd[f"norm_out.linear.{leaf}"].chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale])
    for i in range(num_layers):
        b, t = f"double_blocks.{i}", f"transformer_blocks.{i}"
        mv(f"{b}.img_attn.norm.query_norm.scale", f"{t}.attn.norm_q.weight")
        mv(f"{b}.img_attn.norm.key_norm.scale", f"{t}.attn.norm_k.weight")
        mv(f"{b}.txt_attn.norm.query_norm.scale", f"{t}.attn.norm_added_q.weight")
        mv(f"{b}.txt_attn.norm.key_norm.scale", f"{t}.attn.norm_added_k.weight")
    for i in range(num_single_layers):
        b, t = f"single_blocks.{i}", f"single_transformer_blocks.{i}"
        mv(f"{b}.norm.query_norm.scale", f"{t}.attn.norm_q.weight")
        mv(f"{b}.norm.key_norm.scale", f"{t}.attn.norm_k.weight")
    assert sum(v.numel() for v in out.values()) == sum(v.numel() for v in sd.values())
    return out


def tiny_model(guidance, seed):
    torch.manual_seed(seed)
    m = FluxTransformer2DModel(guidance_embeds=guidance, **TINY).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm_" in n and n.endswith(".weight") and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return m


def reference_run(m, prefix, ref, guidance):
    torch.manual_seed(100)
    b, h2, w2, lt = 2, 3, 4, 5
    hs = torch.randn(b, h2 * w2, TINY["in_channels"])
    ehs = torch.randn(b, lt, TINY["joint_attention_dim"])
    pooled = torch.randn(b, TINY["pooled_projection_dim"])
    t = torch.tensor([0.25, 0.9])
    img_ids = FluxPipeline._prepare_latent_image_ids(b, h2, w2, "cpu", torch.float32)
    # text ids: zeros as the pipeline uses, plus a non-zero index axis on one token so that all
    # three RoPE axes are exercised on the text side too
    txt_ids = torch.zeros(lt, 3)
    txt_ids[1, 0] = 2.0
    g = torch.tensor([3.5, 1.0]) if guidance else None
    with torch.no_grad():
        out = m(
            hidden_states=hs,
            encoder_hidden_states=ehs,
            pooled_projections=pooled,
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=g,
            return_dict=False,
        )[0]
        # the same in bfloat16 (weights and inputs), returned in float32
        mb = copy.deepcopy(m).to(torch.bfloat16)
        out_bf16 = mb(
            hidden_states=hs.bfloat16(),
            encoder_hidden_states=ehs.bfloat16(),
            pooled_projections=pooled.bfloat16(),
            timestep=t,
            img_ids=img_ids,
            txt_ids=txt_ids,
            guidance=g,
            return_dict=False,
        )[0].float()
    for k, v in dict(
        hs=hs, ehs=ehs, pooled=pooled, t=t, img_ids=img_ids, txt_ids=txt_ids, out=out, out_bf16=out_bf16
    ).items():
        ref[f"{prefix}.{k}"] = v.contiguous()
    if g is not None:
        ref[f"{prefix}.guidance"] = g


LORA_TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "to_add_out", "proj_mlp", "proj_out",
    "norm1.linear", "norm1_context.linear", "norm.linear", "ff.net.2", "timestep_embedder.linear_1",
]


def lora_run(m, out, ref):
    """A PEFT adapter on the dev model (random non-zero A and B) and its output."""
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=True)
    m.add_adapter(cfg)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        ref["lora.out"] = m(
            hidden_states=ref["dev.hs"],
            encoder_hidden_states=ref["dev.ehs"],
            pooled_projections=ref["dev.pooled"],
            timestep=ref["dev.t"],
            img_ids=ref["dev.img_ids"],
            txt_ids=ref["dev.txt_ids"],
            guidance=ref["dev.guidance"],
            return_dict=False,
        )[0]
    state = get_peft_model_state_dict(m)
    lora_dir = os.path.join(out, "lora")
    os.makedirs(lora_dir, exist_ok=True)
    save_file({"base_model.model." + k: v.contiguous() for k, v in state.items()}, os.path.join(lora_dir, "adapter_model.safetensors"))
    cfg.save_pretrained(lora_dir)
    with open(os.path.join(lora_dir, "modules.json"), "w") as f:
        json.dump(sorted({k.rsplit(".lora_", 1)[0] for k in state}), f)


def keymap(path):
    """Provenance of diffusers' converter on a full-shaped 1+1-block FLUX.1-dev checkpoint."""
    d, m, h = 3072, 12288, 128
    shapes = {
        "img_in": [d, 64], "txt_in": [d, 4096],
        "time_in.in_layer": [d, 256], "time_in.out_layer": [d, d],
        "vector_in.in_layer": [d, 768], "vector_in.out_layer": [d, d],
        "guidance_in.in_layer": [d, 256], "guidance_in.out_layer": [d, d],
        "final_layer.linear": [64, d], "final_layer.adaLN_modulation.1": [2 * d, d],
    }
    b = "double_blocks.0"
    for s in ("img", "txt"):
        shapes.update({
            f"{b}.{s}_mod.lin": [6 * d, d], f"{b}.{s}_attn.qkv": [3 * d, d],
            f"{b}.{s}_attn.proj": [d, d], f"{b}.{s}_mlp.0": [m, d], f"{b}.{s}_mlp.2": [d, m],
        })
    b = "single_blocks.0"
    shapes.update({f"{b}.linear1": [3 * d + m, d], f"{b}.linear2": [d, d + m], f"{b}.modulation.lin": [3 * d, d]})
    full = {}
    for mod, (rows, cols) in shapes.items():
        full[f"{mod}.weight"] = (rows, cols)
        full[f"{mod}.bias"] = (rows,)
    for b in ("double_blocks.0.img_attn", "double_blocks.0.txt_attn", "single_blocks.0"):
        full[f"{b}.norm.query_norm.scale"] = (h,)
        full[f"{b}.norm.key_norm.scale"] = (h,)
    names = sorted(full)
    ckpt = {}
    for k, name in enumerate(names):
        shape = full[name]
        col = torch.arange(shape[0], dtype=torch.int32) + k * 100000
        ckpt[name] = col[:, None].expand(*shape) if len(shape) == 2 else col
    bfl_shapes = {n: list(full[n]) for n in names}
    conv = convert_flux_transformer_checkpoint_to_diffusers(ckpt)
    assert not ckpt, f"converter left BFL keys: {sorted(ckpt)}"
    out = {}
    for name, t in conv.items():
        col = t[:, 0] if t.dim() == 2 else t
        key, row = (col // 100000).tolist(), (col % 100000).tolist()
        runs = []
        for kk, r in zip(key, row):
            if runs and runs[-1][0] == names[kk] and runs[-1][1] + runs[-1][2] == r:
                runs[-1][2] += 1
            else:
                runs.append([names[kk], r, 1])
        out[name] = dict(shape=list(t.shape), runs=runs)
        del t
    with open(path, "w") as f:
        json.dump(dict(bfl=bfl_shapes, diffusers=out), f, indent=1, sort_keys=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    torch.set_num_threads(1)
    ref = {}
    counts = {}
    for name, guidance, seed, prefix in (("dev", True, 1, ""), ("schnell", False, 2, "model.diffusion_model.")):
        m = tiny_model(guidance, seed)
        # schnell is written as shards with an index, as the published FLUX.1 folders are
        shard = "200KB" if name == "schnell" else "10GB"
        m.save_pretrained(os.path.join(out, name, "transformer"), max_shard_size=shard)
        sd = {k: v.contiguous() for k, v in m.state_dict().items()}
        bfl = to_bfl(sd, TINY["num_layers"], TINY["num_single_layers"], 32)
        save_file({prefix + k: v.contiguous() for k, v in bfl.items()}, os.path.join(out, f"{name}_bfl.safetensors"))
        reference_run(m, name, ref, guidance)
        counts[f"tiny_{name}"] = sum(p.numel() for p in m.parameters())
        counts[f"tiny_{name}_linears"] = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
        if guidance:
            lora_run(m, out, ref)
    for name, guidance in (("dev", True), ("schnell", False)):
        with torch.device("meta"):
            m = FluxTransformer2DModel(guidance_embeds=guidance)
        counts[name] = sum(p.numel() for p in m.parameters())
    with open(os.path.join(out, "params.json"), "w") as f:
        json.dump(counts, f)

    torch.manual_seed(7)
    lat = torch.randn(2, 16, 6, 10)
    packed = FluxPipeline._pack_latents(lat, 2, 16, 6, 10)
    unpacked = FluxPipeline._unpack_latents(packed, 6 * 8, 10 * 8, 8)
    ids = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)
    ref.update({"pack.latents": lat, "pack.packed": packed.contiguous(), "pack.unpacked": unpacked.contiguous(), "pack.ids": ids})

    save_file(ref, os.path.join(out, "reference.safetensors"))
    keymap(os.path.join(out, "keymap.json"))


if __name__ == "__main__":
    main()
