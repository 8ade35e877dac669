"""Fixture of `tests/sd_job.rs`: a tiny Stable Diffusion 1.x pipeline with random weights, saved by
diffusers' `StableDiffusionPipeline.save_pretrained`, and a kohya-style image folder of real emoji.

No SD checkpoint is available offline, so the pipeline is built from small configs with a fixed seed:
- tokenizer: CLIP BPE `vocab.json` + `merges.txt` built as `lora-models/tests/interop/sd_clip.py`
  builds them (merges learned by `tokenizers` on a small corpus, OpenAI's vocabulary layout);
- text encoder: transformers `CLIPTextModel`, hidden 32, 2 layers, 4 heads, 77 positions;
- UNet: `UNet2DConditionModel` with two levels (`CrossAttnDownBlock2D`, `DownBlock2D`), 32/64
  channels, cross-attention dim 32 — SD 1.x's structure, scaled down;
- VAE: `AutoencoderKL` with two levels (spatial factor 2), 4 latent channels, SD's scaling factor;
- scheduler: `DDPMScheduler` with SD's schedule (scaled_linear 0.00085–0.012, ε-prediction).

Data: the first N emoji of openmoji's `smileys-emotion` group that have a PNG in
`assets/emoji/img/` (file name = lower-case hexcode), copied into `<out>/data/<repeats>_emoji/`
with a caption sidecar `emoji, <annotation>, <tags…>`.

Usage: make_pipeline.py --assets assets --out DIR [--n 16] [--repeats 2]
"""

import argparse
import csv
import json
import os
import shutil
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "lora-models", "tests", "interop"))
from sd_clip import bytes_to_unicode, train_merges  # noqa: E402

UNET = dict(
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

VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
    up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
    block_out_channels=(32, 64),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=32,
    sample_size=32,
    scaling_factor=0.18215,
)


def tokenizer(out):
    merges = train_merges(400)
    symbols = list(bytes_to_unicode().values())
    symbols += [s + "</w>" for s in symbols]
    symbols += ["".join(m) for m in merges]
    symbols += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {s: i for i, s in enumerate(symbols)}
    tdir = os.path.join(out, "tok_src")
    os.makedirs(tdir, exist_ok=True)
    with open(os.path.join(tdir, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(tdir, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(f"{m[0]} {m[1]}\n")
    from transformers import CLIPTokenizer

    tok = CLIPTokenizer.from_pretrained(tdir)
    shutil.rmtree(tdir)
    return tok


def pipeline(out):
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    tok = tokenizer(out)
    te = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=77,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            hidden_act="quick_gelu",
        )
    )
    unet = UNet2DConditionModel(**UNET)
    vae = AutoencoderKL(**VAE)
    with torch.no_grad():
        # default init leaves norms at 1 / 0; move every parameter a little
        for m in (unet, vae, te):
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    sched = DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        clip_sample=False,
        steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        vae=vae,
        text_encoder=te,
        tokenizer=tok,
        unet=unet,
        scheduler=sched,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(os.path.join(out, "pipeline"), safe_serialization=True)


def data(assets, out, n, repeats):
    img_dir = os.path.join(assets, "emoji", "img")
    rows = []
    with open(os.path.join(assets, "emoji", "openmoji.csv"), newline="", encoding="utf-8") as f:
        for r in csv.DictReader(f):
            if r["group"] != "smileys-emotion" or r["skintone"]:
                continue
            png = os.path.join(img_dir, r["hexcode"].lower() + ".png")
            if os.path.isfile(png):
                rows.append((png, r))
            if len(rows) == n:
                break
    assert len(rows) == n, f"only {len(rows)} emoji found in {img_dir}"
    d = os.path.join(out, "data", f"{repeats}_emoji")
    os.makedirs(d, exist_ok=True)
    captions = {}
    for png, r in rows:
        name = os.path.basename(png)
        shutil.copy(png, os.path.join(d, name))
        tags = [t.strip() for t in r["tags"].split(",") if t.strip()][:4]
        cap = ", ".join(["emoji", r["annotation"]] + tags)
        with open(os.path.join(d, name[:-4] + ".txt"), "w", encoding="utf-8") as f:
            f.write(cap + "\n")
        captions[name] = cap
    with open(os.path.join(out, "data", "captions.json"), "w") as f:
        json.dump(captions, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--assets", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    pipeline(a.out)
    data(a.assets, a.out, a.n, a.repeats)


if __name__ == "__main__":
    main()
