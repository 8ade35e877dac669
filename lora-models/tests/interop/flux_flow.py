"""Reference schedules of diffusers' FlowMatchEulerDiscreteScheduler for `tests/models/flow.rs`.

Writes `flow.json` under --out: for each case the scheduler's `timesteps` and `sigmas` after
`set_timesteps`, set up as

- `flux_dev_28_4096` / `flux_dev_4_1024`: FLUX.1-dev's scheduler config (shift 3, dynamic
  shifting) driven as `FluxPipeline.__call__` drives it: `sigmas = linspace(1, 1/n, n)` and
  `mu = calculate_shift(image_seq_len)`;
- `flux_schnell_4`: FLUX.1-schnell's config (static shift 1) the same way;
- `static_shift3_10`: shift 3 without given sigmas (`set_timesteps(10)`);
- `dynamic_10_mu08`: dynamic shifting without given sigmas, `mu` 0.8;

and `euler`: the final sample of 4 steps of `flux_dev_4_1024` from `x0` [2, 3] with the model
`v = 0.3 * x + t / 1000` (t the scheduler's timestep), `step` as the pipeline calls it.

Usage: flux_flow.py --out DIR
"""

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402
from diffusers.pipelines.flux.pipeline_flux import calculate_shift  # noqa: E402

DEV = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=4096,
    max_shift=1.15,
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
)
SCHNELL = dict(DEV, shift=1.0, use_dynamic_shifting=False)


def pipeline_schedule(cfg, n, seq_len):
    s = FlowMatchEulerDiscreteScheduler(**cfg)
    sigmas = np.linspace(1.0, 1 / n, n)
    mu = calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    s.set_timesteps(sigmas=sigmas, mu=mu)
    return s


def dump(s):
    return {"timesteps": s.timesteps.tolist(), "sigmas": s.sigmas.tolist()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cases = {
        "flux_dev_28_4096": dump(pipeline_schedule(DEV, 28, 4096)),
        "flux_dev_4_1024": dump(pipeline_schedule(DEV, 4, 1024)),
        "flux_schnell_4": dump(pipeline_schedule(SCHNELL, 4, 4096)),
    }
    s = FlowMatchEulerDiscreteScheduler(**dict(SCHNELL, shift=3.0))
    s.set_timesteps(10)
    cases["static_shift3_10"] = dump(s)
    s = FlowMatchEulerDiscreteScheduler(**DEV)
    s.set_timesteps(10, mu=0.8)
    cases["dynamic_10_mu08"] = dump(s)

    s = pipeline_schedule(DEV, 4, 1024)
    x0 = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.25, -0.75]])
    x = x0.clone()
    for t in s.timesteps:
        v = 0.3 * x + t / 1000
        x = s.step(v, t, x, return_dict=False)[0]
    out = {"cases": cases, "euler": {"x0": x0.tolist(), "final": x.tolist()}}
    with open(os.path.join(a.out, "flow.json"), "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
