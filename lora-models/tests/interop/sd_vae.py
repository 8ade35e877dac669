"""Reference outputs of diffusers' AutoencoderKL for `tests/sd/vae.rs`.

Builds a tiny VAE with random weights (fixed seed) and writes, under --out:

- `vae/` (save_pretrained), with `scaling_factor` 0.13025 and `shift_factor` 0.1 set so that
  both are read from the config;
- `single.safetensors`: the same weights in the original layout (`first_stage_model.encoder.down.0.block.0...`,
  mid-block attention projections as 1x1 convolutions), written with a diffusers -> original map
  made here and checked by converting back with diffusers' `convert_ldm_vae_checkpoint`;
- `vae_legacy/`: the same weights with the mid-block attention named `query`/`key`/`value`/`proj_attn`
  (folders saved by diffusers before 0.14);
- `reference.safetensors`: `image` [2, 3, 32, 32] in [-1, 1], `mean`, `logvar` (encode), `sample`
  (DiagonalGaussianDistribution.sample with a torch.Generator seeded 7), `latents` and `decoded`
  (decode of random latents), `num_params`.

Usage: sd_vae.py --out DIR
"""

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint  # noqa: E402

CFG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=0.13025,
    shift_factor=0.1,
)


def to_ldm(sd, n_up):
    out = {}
    attn = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
    for k, v in sd.items():
        if k.startswith(("quant_conv.", "post_quant_conv.")):
            out["first_stage_model." + k] = v
            continue
        coder, rest = k.split(".", 1)
        new = None
        for d, o in (("conv_in.", "conv_in."), ("conv_out.", "conv_out."), ("conv_norm_out.", "norm_out.")):
            if rest.startswith(d):
                new = o + rest[len(d):]
        if rest.startswith("mid_block.resnets."):
            j, leaf = rest[len("mid_block.resnets."):].split(".", 1)
            new = f"mid.block_{int(j) + 1}.{leaf}"
        elif rest.startswith("mid_block.attentions.0."):
            m, leaf = rest[len("mid_block.attentions.0."):].rsplit(".", 1)
            new = f"mid.attn_1.{attn[m]}.{leaf}"
            if v.ndim == 2:
                v = v[:, :, None, None]
        elif rest.startswith(("down_blocks.", "up_blocks.")):
            blocks, i, kind, r = rest.split(".", 3)
            i = int(i)
            level = f"down.{i}" if blocks == "down_blocks" else f"up.{n_up - 1 - i}"
            if kind == "resnets":
                j, leaf = r.split(".", 1)
                new = f"{level}.block.{j}.{leaf}"
            else:  # downsamplers.0.conv.X / upsamplers.0.conv.X
                new = f"{level}.{'downsample' if blocks == 'down_blocks' else 'upsample'}.{r.split('.', 1)[1]}"
        assert new is not None, k
        new = new.replace("conv_shortcut", "nin_shortcut")
        out[f"first_stage_model.{coder}.{new}"] = v.contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vae = AutoencoderKL(**CFG)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    vae.eval()
    vae.save_pretrained(os.path.join(a.out, "vae"), safe_serialization=True)
    sd = vae.state_dict()
    ldm = to_ldm(sd, len(CFG["block_out_channels"]))
    back = convert_ldm_vae_checkpoint(ldm, dict(vae.config))
    assert set(back) == set(sd), set(back) ^ set(sd)
    for k in sd:
        assert torch.equal(back[k].reshape(sd[k].shape), sd[k]), k
    # the attention names of VAE folders saved before diffusers 0.14
    legacy_dir = os.path.join(a.out, "vae_legacy")
    os.makedirs(legacy_dir, exist_ok=True)
    old = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    legacy = {}
    for k, v in sd.items():
        for new_name, old_name in old.items():
            k = k.replace(f"attentions.0.{new_name}.", f"attentions.0.{old_name}.")
        legacy[k] = v.contiguous()
    save_file(legacy, os.path.join(legacy_dir, "diffusion_pytorch_model.safetensors"))
    with open(os.path.join(a.out, "vae", "config.json")) as f:
        cfg_text = f.read()
    with open(os.path.join(legacy_dir, "config.json"), "w") as f:
        f.write(cfg_text)
    ldm["model.diffusion_model.out.2.bias"] = torch.zeros(4)  # another component, as in real files
    save_file(ldm, os.path.join(a.out, "single.safetensors"))
    with torch.no_grad():
        image = torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1
        dist = vae.encode(image).latent_dist
        sample = dist.sample(generator=torch.Generator().manual_seed(7))
        latents = torch.randn(2, 4, 16, 16, generator=gen)
        decoded = vae.decode(latents).sample
    ref = {
        "image": image,
        "mean": dist.mean,
        "logvar": dist.logvar,
        "sample": sample,
        "latents": latents,
        "decoded": decoded,
        "num_params": torch.tensor([sum(p.numel() for p in vae.parameters())], dtype=torch.int64),
    }
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(a.out, "reference.safetensors"))


if __name__ == "__main__":
    main()
