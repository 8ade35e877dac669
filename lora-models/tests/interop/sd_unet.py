"""Reference outputs of diffusers' UNet2DConditionModel for `tests/sd/unet.rs`.

Builds two tiny UNets with random weights (fixed seed) and writes, under --out:

- `sd1/unet/` (save_pretrained): an SD 1.x-style UNet (CrossAttnDownBlock2D + DownBlock2D, conv
  proj_in/proj_out, `attention_head_dim` as the head count, cross_attention_dim 32);
- `sdxl/unet/`: an SDXL-style UNet (DownBlock2D + CrossAttnDownBlock2D, linear projections,
  transformer_layers_per_block [1, 2], addition_embed_type "text_time");
- `sd1_single.safetensors`, `sdxl_single.safetensors`: the same weights in the original
  single-file layout (`model.diffusion_model.input_blocks.N...`). The diffusers -> original key map
  is written here independently of the Rust code and checked by converting back with diffusers' own
  `convert_ldm_unet_checkpoint` (it must reproduce every tensor exactly);
- `lora/`: a PEFT adapter (r=4, alpha=8, to_q/to_k/to_v/to_out.0 and the ResNet conv1 convolutions,
  random non-zero A and B) added with `unet.add_adapter(LoraConfig(...))` on the SD 1.x UNet,
  saved as adapter_config.json + adapter_model.safetensors (keys `base_model.model.<module>.lora_A.weight`);
- `reference.safetensors`: inputs and outputs (`sd1.*`, `sd1_odd.*`, `sdxl.*`, `lora.*`).

Usage: sd_unet.py --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import UNet2DConditionModel  # noqa: E402
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

SD1 = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=4,
    norm_num_groups=32,
)

SDXL = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=2,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=(2, 4),
    transformer_layers_per_block=(1, 2),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=16 + 6 * 8,
    norm_num_groups=32,
)


def perturb(model, gen):
    # default init leaves norms at weight 1 / bias 0; move every parameter a little so that a
    # swapped or missing tensor changes the output
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def resnet_ldm(rest):
    m, leaf = rest.split(".", 1)
    table = {
        "norm1": "in_layers.0",
        "conv1": "in_layers.2",
        "time_emb_proj": "emb_layers.1",
        "norm2": "out_layers.0",
        "conv2": "out_layers.3",
        "conv_shortcut": "skip_connection",
    }
    return f"{table[m]}.{leaf}"


def to_ldm(sd, cfg):
    """diffusers UNet state dict -> original `model.diffusion_model.` layout (openaimodel.py)."""
    lpb = cfg["layers_per_block"]
    up_attn = ["CrossAttn" in t for t in cfg["up_block_types"]]
    out = {}
    simple = {
        "conv_in.": "input_blocks.0.0.",
        "time_embedding.linear_1.": "time_embed.0.",
        "time_embedding.linear_2.": "time_embed.2.",
        "add_embedding.linear_1.": "label_emb.0.0.",
        "add_embedding.linear_2.": "label_emb.0.2.",
        "conv_norm_out.": "out.0.",
        "conv_out.": "out.2.",
    }
    for k, v in sd.items():
        new = None
        for d, o in simple.items():
            if k.startswith(d):
                new = o + k[len(d):]
        parts = k.split(".")
        if parts[0] == "down_blocks":
            i, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
            if kind == "resnets":
                new = f"input_blocks.{1 + i * (lpb + 1) + j}.0.{resnet_ldm(rest)}"
            elif kind == "attentions":
                new = f"input_blocks.{1 + i * (lpb + 1) + j}.1.{rest}"
            else:  # downsamplers.0.conv.X
                new = f"input_blocks.{(i + 1) * (lpb + 1)}.0.op.{parts[-1]}"
        elif parts[0] == "mid_block":
            kind, j, rest = parts[1], int(parts[2]), ".".join(parts[3:])
            if kind == "resnets":
                new = f"middle_block.{2 * j}.{resnet_ldm(rest)}"
            else:
                new = f"middle_block.1.{rest}"
        elif parts[0] == "up_blocks":
            i, kind, j, rest = int(parts[1]), parts[2], int(parts[3]), ".".join(parts[4:])
            per = lpb + 1
            if kind == "resnets":
                new = f"output_blocks.{i * per + j}.0.{resnet_ldm(rest)}"
            elif kind == "attentions":
                new = f"output_blocks.{i * per + j}.1.{rest}"
            else:
                idx = 2 if up_attn[i] else 1
                new = f"output_blocks.{i * per + per - 1}.{idx}.conv.{parts[-1]}"
        assert new is not None, k
        out["model.diffusion_model." + new] = v.contiguous()
    return out


def build(cfg, name, out, gen):
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**cfg)
    perturb(unet, gen)
    unet.eval()
    unet.save_pretrained(os.path.join(out, name, "unet"), safe_serialization=True)
    sd = unet.state_dict()
    ldm = to_ldm(sd, dict(unet.config))
    back = convert_ldm_unet_checkpoint(ldm, dict(unet.config))
    assert set(back) == set(sd), (set(back) ^ set(sd))
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
    # a decoy entry of another component, as real single files have
    ldm["first_stage_model.decoder.conv_in.bias"] = torch.zeros(3)
    save_file(ldm, os.path.join(out, f"{name}_single.safetensors"))
    return unet


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    ref = {}
    with torch.no_grad():
        unet = build(SD1, "sd1", a.out, gen)
        x = torch.randn(2, 4, 16, 16, generator=gen)
        t = torch.tensor([10, 900], dtype=torch.int64)
        ctx = torch.randn(2, 7, 32, generator=gen)
        ref.update({"sd1.sample": x, "sd1.t": t, "sd1.ctx": ctx, "sd1.out": unet(x, t, ctx).sample})
        ref["sd1.num_params"] = torch.tensor([sum(p.numel() for p in unet.parameters())], dtype=torch.int64)
        # a size that is not a multiple of the down-sampling: diffusers passes explicit up-sample sizes
        xo = torch.randn(1, 4, 15, 13, generator=gen)
        to = torch.tensor([321], dtype=torch.int64)
        co = torch.randn(1, 5, 32, generator=gen)
        ref.update({"sd1_odd.sample": xo, "sd1_odd.t": to, "sd1_odd.ctx": co, "sd1_odd.out": unet(xo, to, co).sample})

        xl = build(SDXL, "sdxl", a.out, gen)
        x = torch.randn(2, 4, 16, 16, generator=gen)
        t = torch.tensor([1, 500], dtype=torch.int64)
        ctx = torch.randn(2, 6, 32, generator=gen)
        text = torch.randn(2, 16, generator=gen)
        ids = torch.tensor([[1024.0, 1024.0, 0.0, 0.0, 1024.0, 1024.0], [768.0, 512.0, 16.0, 8.0, 512.0, 512.0]])
        out = xl(x, t, ctx, added_cond_kwargs={"text_embeds": text, "time_ids": ids}).sample
        ref["sdxl.num_params"] = torch.tensor([sum(p.numel() for p in xl.parameters())], dtype=torch.int64)
        ref.update({"sdxl.sample": x, "sdxl.t": t, "sdxl.ctx": ctx, "sdxl.text_embeds": text, "sdxl.time_ids": ids, "sdxl.out": out})

        # LoRA through PEFT on the SD 1.x UNet
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0", "conv1"], init_lora_weights=True)
        unet.add_adapter(cfg)
        for n, p in unet.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        x = ref["sd1.sample"]
        ref["lora.out"] = unet(x, ref["sd1.t"], ref["sd1.ctx"]).sample
        state = get_peft_model_state_dict(unet)
        lora_dir = os.path.join(a.out, "lora")
        os.makedirs(lora_dir, exist_ok=True)
        save_file({"base_model.model." + k: v.contiguous() for k, v in state.items()}, os.path.join(lora_dir, "adapter_model.safetensors"))
        cfg.save_pretrained(lora_dir)
        with open(os.path.join(lora_dir, "modules.json"), "w") as f:
            json.dump(sorted({k.rsplit(".lora_", 1)[0] for k in state}), f)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(a.out, "reference.safetensors"))


if __name__ == "__main__":
    main()
