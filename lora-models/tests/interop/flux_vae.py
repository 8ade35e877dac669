"""Reference outputs of diffusers' AutoencoderKL in FLUX.1's configuration for `tests/models/vae.rs`.

Builds a tiny VAE with 16 latent channels and no quant convs (FLUX.1's autoencoder, small) with
random weights (fixed seed) and writes, under --out:

- `vae/` (save_pretrained), `scaling_factor` 0.3611 and `shift_factor` 0.1159 as FLUX.1's;
- `ae.safetensors`: the same weights in BFL's `ae.safetensors` layout: the original LDM names
  without the `first_stage_model.` prefix (`encoder.down.0.block.0.norm1.weight`,
  `decoder.up.1.upsample.conv.weight`, mid-block attention as 1x1 convolutions), written with
  `sd_vae.to_ldm` and checked by converting back with diffusers' `convert_ldm_vae_checkpoint`;
- `reference.safetensors`: `image` [2, 3, 32, 32] in [-1, 1], `mean`, `logvar` (encode),
  `latents` [2, 16, 16, 16] and `decoded`, `num_params`.

Usage: flux_vae.py --out DIR
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import AutoencoderKL  # noqa: E402
from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sd_vae import to_ldm  # noqa: E402

CFG = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
PREFIX = "first_stage_model."


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vae = AutoencoderKL(**CFG)
    gen = torch.Generator().manual_seed(4321)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    vae.eval()
    vae.save_pretrained(os.path.join(a.out, "vae"), safe_serialization=True)
    sd = vae.state_dict()
    assert not any(k.startswith(("quant_conv.", "post_quant_conv.")) for k in sd)
    ae = {k[len(PREFIX):]: v for k, v in to_ldm(sd, len(CFG["block_out_channels"])).items()}
    assert "encoder.down.0.block.0.norm1.weight" in ae and "decoder.up.1.upsample.conv.weight" in ae
    back = convert_ldm_vae_checkpoint(ae, dict(vae.config))
    assert set(back) == set(sd), set(back) ^ set(sd)
    for k in sd:
        assert torch.equal(back[k].reshape(sd[k].shape), sd[k]), k
    save_file(ae, os.path.join(a.out, "ae.safetensors"))
    with torch.no_grad():
        image = torch.rand(2, 3, 32, 32, generator=gen) * 2 - 1
        dist = vae.encode(image).latent_dist
        latents = torch.randn(2, 16, 16, 16, generator=gen)
        decoded = vae.decode(latents).sample
    ref = {
        "image": image,
        "mean": dist.mean,
        "logvar": dist.logvar,
        "latents": latents,
        "decoded": decoded,
        "num_params": torch.tensor([sum(p.numel() for p in vae.parameters())], dtype=torch.int64),
    }
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(a.out, "reference.safetensors"))


if __name__ == "__main__":
    main()
