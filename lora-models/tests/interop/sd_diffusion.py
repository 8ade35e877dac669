"""Reference data for `tests/sd/diffusion.rs` from diffusers' schedulers and training utilities.

On fixed inputs (seeded tensors written to the output), records:
- `alphas_cumprod` of `DDPMScheduler` for scaled_linear (SD), linear, squaredcos_cap_v2 and
  scaled_linear with zero-terminal-SNR rescaling;
- `DDPMScheduler.add_noise` and `get_velocity` (SD schedule);
- `diffusers.training_utils.compute_snr`, the min-SNR-γ weights of diffusers'
  `train_text_to_image_lora.py` (ε and v), and the weighted training loss of a fixed
  deterministic denoiser;
- full sampling runs of `DDIMScheduler` and `EulerDiscreteScheduler` (SD configuration:
  `steps_offset` 1, `leading` spacing, `set_alpha_to_one` False, `clip_sample` False; Euler also
  with Karras sigmas and `linspace` spacing; ε and v prediction) with classifier-free guidance
  over the fixed deterministic denoiser below, which `sd_diffusion.rs` defines identically:

      uncond(x, t) = 0.9·x + 0.1·sin(0.01·t)
      cond(x, t)   = 0.8·x + 0.2·cos(0.01·t)

Usage: sd_diffusion.py --out DIR
"""

import argparse
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from diffusers import DDIMScheduler, DDPMScheduler, EulerDiscreteScheduler  # noqa: E402
from diffusers.training_utils import compute_snr  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SD = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
GUIDANCE = 7.5
STEPS = 12


def uncond(x, t):
    return 0.9 * x + 0.1 * math.sin(0.01 * float(t))


def cond(x, t):
    return 0.8 * x + 0.2 * math.cos(0.01 * float(t))


def guided(x, t):
    u, c = uncond(x, t), cond(x, t)
    return u + GUIDANCE * (c - u)


def run(sched, noise, steps):
    sched.set_timesteps(steps)
    x = noise * sched.init_noise_sigma
    first = None
    for t in sched.timesteps:
        xin = sched.scale_model_input(x, t)
        out = guided(xin, t)
        res = sched.step(out, t, x)
        if first is None:
            first = res.prev_sample
        x = res.prev_sample
    return sched.timesteps.to(torch.float64), x, first


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 4, 8, 8, generator=gen)
    noise = torch.randn(3, 4, 8, 8, generator=gen)
    t = torch.tensor([0, 437, 999], dtype=torch.int64)
    ref = {"x0": x0, "noise": noise, "t": t}
    info = {}

    for name, kw in {
        "scaled_linear": SD,
        "linear": dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear"),
        "cosine": dict(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2"),
        "zsnr": dict(SD, rescale_betas_zero_snr=True),
    }.items():
        ref[f"ac.{name}"] = DDPMScheduler(**kw).alphas_cumprod

    ddpm = DDPMScheduler(**SD)
    # a real scheduler_config.json as diffusers writes it (SD 2.x-v style: v-prediction)
    DDIMScheduler(**SD, prediction_type="v_prediction", clip_sample=False, steps_offset=1).save_config(
        os.path.join(a.out, "scheduler")
    )
    ref["add_noise"] = ddpm.add_noise(x0, noise, t)
    ref["velocity"] = ddpm.get_velocity(x0, noise, t)
    snr = compute_snr(ddpm, t)
    ref["snr"] = snr
    gamma = 5.0
    base = torch.stack([snr, gamma * torch.ones_like(snr)], dim=1).min(dim=1)[0]
    ref["w.eps"] = base / snr
    ref["w.v"] = base / (snr + 1)
    # the training loss (diffusers train_text_to_image_lora.py) with the uncond denoiser
    for kind in ("eps", "v"):
        noisy = ddpm.add_noise(x0, noise, t)
        target = noise if kind == "eps" else ddpm.get_velocity(x0, noise, t)
        pred = torch.stack([uncond(noisy[i], t[i]) for i in range(3)])
        mse = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
        mse = mse.mean(dim=list(range(1, mse.dim())))
        ref[f"loss.{kind}.plain"] = mse.mean()
        ref[f"loss.{kind}.minsnr"] = (mse * ref[f"w.{kind}"]).mean()

    ddim_cfg = dict(SD, clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing="leading")
    euler_cfg = dict(SD, steps_offset=1, timestep_spacing="leading")
    runs = {
        "ddim.eps": DDIMScheduler(**ddim_cfg),
        "ddim.v": DDIMScheduler(**ddim_cfg, prediction_type="v_prediction"),
        "ddim.trailing": DDIMScheduler(**dict(ddim_cfg, timestep_spacing="trailing")),
        "euler.eps": EulerDiscreteScheduler(**euler_cfg),
        "euler.v": EulerDiscreteScheduler(**euler_cfg, prediction_type="v_prediction"),
        "euler.karras": EulerDiscreteScheduler(**euler_cfg, use_karras_sigmas=True),
        "euler.linspace": EulerDiscreteScheduler(**dict(euler_cfg, timestep_spacing="linspace")),
    }
    for name, sched in runs.items():
        ts, final, first = run(sched, noise, STEPS)
        ref[f"{name}.timesteps"] = ts
        ref[f"{name}.final"] = final
        ref[f"{name}.first"] = first
        if name.startswith("euler"):
            ref[f"{name}.sigmas"] = sched.sigmas.to(torch.float64)
            info[name] = float(sched.init_noise_sigma)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(a.out, "reference.safetensors"))
    with open(os.path.join(a.out, "info.json"), "w") as f:
        json.dump({"init_noise_sigma": info, "guidance": GUIDANCE, "steps": STEPS, "gamma": gamma}, f)


if __name__ == "__main__":
    main()
