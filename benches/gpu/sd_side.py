"""The diffusers + PEFT side of benches/gpu/run.sh part "5 unet": Stable Diffusion UNet LoRA training
steps on a diffusers pipeline folder (make_models.py writes them) and a kohya image folder, timed
and measured the way lora-train's metrics.jsonl reports its steps.

The loop is the one of diffusers' examples/text_to_image/train_text_to_image_lora.py, with the
steps of sd_mem_check.py (`lora_unet`, `train_step`): frozen UNet in the weight dtype, PEFT LoRA
(gaussian init, alpha = rank) on to_q/to_k/to_v/to_out.0 with fp32 trainable parameters, autocast
in the weight dtype (none for fp32), DDPM noising, epsilon MSE in fp32, clipping at 1.0, AdamW,
zero_grad(set_to_none). One difference from the script, the same one lora-train makes with
`data.cache_latents: true`: every image's latents (VAE mean + std * noise, times the scaling
factor) and its caption's text-encoder states are computed once before the timed steps, and the
VAE and the text encoder then leave the device; the script runs both in every step.

    python benches/gpu/sd_side.py --pipeline DIR --images DIR --resolution 512 --batch 4 --steps 12 \
        --precision bf16 --device cuda --out OUT.json

Images are read in sorted order, resized (shorter side) and centre-cropped to the resolution.
Step times exclude the caching; the peaks (CUDA) are reset after it, so they hold the UNet
weights, the adapter, its optimizer state and the step's activations. On the CPU: VmHWM.
"""

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def vm_hwm():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def images_and_captions(folder):
    out = []
    for root, _, files in sorted(os.walk(folder)):
        for f in sorted(files):
            if f.lower().endswith((".png", ".jpg", ".jpeg", ".webp")):
                cap = os.path.join(root, os.path.splitext(f)[0] + ".txt")
                text = open(cap).read().strip() if os.path.isfile(cap) else ""
                out.append((os.path.join(root, f), text))
    if not out:
        raise SystemExit(f"sd_side.py: no images under {folder}")
    return out


def pixels(path, res):
    import numpy as np
    import torch
    from PIL import Image

    img = Image.open(path).convert("RGB")
    s = res / min(img.size)
    img = img.resize((max(res, round(img.size[0] * s)), max(res, round(img.size[1] * s))), Image.BICUBIC)
    x0, y0 = (img.size[0] - res) // 2, (img.size[1] - res) // 2
    img = img.crop((x0, y0, x0 + res, y0 + res))
    a = torch.from_numpy(np.asarray(img, dtype=np.float32) / 127.5 - 1.0)
    return a.permute(2, 0, 1)  # [3, res, res] in [-1, 1]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pipeline", required=True)
    p.add_argument("--images", required=True)
    p.add_argument("--resolution", type=int, required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--checkpointing", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    from sd_mem_check import ddpm, lora_unet, train_step

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.precision]
    torch.manual_seed(0)
    tok = CLIPTokenizer.from_pretrained(a.pipeline, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(a.pipeline, subfolder="text_encoder", dtype=dtype).to(dev).eval()
    vae = AutoencoderKL.from_pretrained(a.pipeline, subfolder="vae", torch_dtype=dtype).to(dev).eval()
    # cache: latents and text states of every image, once
    items = images_and_captions(a.images)
    lat, ehs = [], []
    n_pos = te.config.max_position_embeddings  # 77: SD's prompt length
    with torch.no_grad():
        for path, text in items:
            x = pixels(path, a.resolution)[None].to(dev, dtype)
            lat.append(vae.encode(x).latent_dist.sample() * vae.config.scaling_factor)
            ids = tok([text], padding="max_length", max_length=n_pos, truncation=True,
                      return_tensors="pt").input_ids.to(dev)
            ehs.append(te(ids)[0])
    lat, ehs = torch.cat(lat), torch.cat(ehs)
    del vae, te
    unet = UNet2DConditionModel.from_pretrained(a.pipeline, subfolder="unet", torch_dtype=dtype).to(dev)
    params = lora_unet(unet, a.rank, a.checkpointing)
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)
    sched = ddpm()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(a.steps):
        idx = torch.randperm(lat.shape[0], generator=g)[: a.batch].to(dev)
        t = time.perf_counter()
        loss = train_step(unet, sched, opt, lat[idx], ehs[idx], dtype, params=params, max_grad_norm=1.0)
        losses.append(loss.item())  # synchronises
        times.append(time.perf_counter() - t)
    timed = times[1:] or times
    med = statistics.median(timed)
    import diffusers
    import peft

    out = {
        "side": "diffusers+peft",
        "median_step_s": med,
        "images_per_s": a.batch / med,
        "steps": len(times),
        "step_times_s": times,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "trainable_params": sum(prm.numel() for prm in params),
        "cached_images": len(items),
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "peft": peft.__version__,
    }
    if cuda:
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    else:
        out["peak_rss_bytes"] = vm_hwm()
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
