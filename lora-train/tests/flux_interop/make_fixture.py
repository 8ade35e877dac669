"""Fixture of `tests/train/flux_job.rs`: a tiny FLUX.1-dev-shaped pipeline with random weights, saved
by diffusers' `FluxPipeline.save_pretrained`, and a kohya-style image folder of real emoji.

No FLUX checkpoint is available offline. The pipeline is the one
`lora-models/tests/interop/flux_pipeline.py` builds for the model parity tests (its `build`):
a `FluxTransformer2DModel` with the guidance embedder (dev), CLIP and T5 encoders with their
tokenizers, an `AutoencoderKL` with FLUX's scaling and shift factors and a
`FlowMatchEulerDiscreteScheduler` with FLUX's dynamic shift, all at small widths. The data are
the emoji folder of the SD fixture (`tests/sd_interop/make_pipeline.py`'s `data`): the first N
emoji of openmoji's `smileys-emotion` group, captioned `emoji, <annotation>, <tags…>`.

Writes `<out>/pipeline/` and `<out>/data/<repeats>_emoji/`.

Usage: make_fixture.py --assets assets --out DIR [--n 16] [--repeats 2]
"""

import argparse
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "lora-models", "tests", "interop"))
sys.path.insert(0, os.path.join(HERE, "..", "sd_interop"))

import torch  # noqa: E402
from flux_pipeline import build  # noqa: E402
from make_pipeline import data  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    build(a.out)
    # `build` saves into <out>/pipe; the job's config names <out>/pipeline
    dst = os.path.join(a.out, "pipeline")
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(os.path.join(a.out, "pipe"), dst)
    data(a.assets, a.out, a.n, a.repeats)


if __name__ == "__main__":
    main()
