"""Fixture of `tests/train/sd_job.rs`: a tiny Stable Diffusion 1.x pipeline with random weights, saved by
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

With `--sdxl`, a tiny SDXL pipeline in `<out>/pipeline_xl` instead (diffusers
`StableDiffusionXLPipeline.save_pretrained`), scaled down as diffusers' own SDXL pipeline tests
scale it:
- text_encoder: `CLIPTextModel` as above (hidden 32, 2 layers); text_encoder_2:
  `CLIPTextModelWithProjection` (hidden 32, 2 layers, projection 32, gelu); tokenizer_2 = the same
  BPE, padded with `!` (id 0) as SDXL's `tokenizer_2/` is;
- UNet: `UNet2DConditionModel` with `addition_embed_type: text_time` (time-id embedding 8,
  `projection_class_embeddings_input_dim` = 6·8 + 32 = 80), cross-attention dim 64 (= 32 + 32, the
  concatenated penultimate states), two levels (`DownBlock2D`, `CrossAttnDownBlock2D`) with
  `transformer_layers_per_block` (1, 2) as SDXL's (1, 2, 10), linear projections;
- VAE and scheduler as above (SDXL's scaling factor 0.13025).

With `--single-file`, the pipeline's weights also go into one original-layout checkpoint,
`<out>/single/model.safetensors` (what `v1-5-pruned.safetensors` / `sd_xl_base_1.0.safetensors`
hold, with no tokenizer): UNet under `model.diffusion_model.` and VAE under `first_stage_model.`
(the diffusers → original maps of `lora-models/tests/interop/sd_unet.py` / `sd_vae.py`), the
CLIP text encoder under `cond_stage_model.transformer.text_model.` (SD 1.x) or
`conditioner.embedders.0.transformer.text_model.` (SDXL), and SDXL's second encoder in
OpenCLIP's layout under `conditioner.embedders.1.model.` (`token_embedding.weight`,
`positional_embedding`, `transformer.resblocks.N.{ln_1, attn.in_proj_weight/bias (q, k, v
stacked), attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_final`, `text_projection` = the
transposed projection weight, `logit_scale`). Every component is converted back with diffusers'
own `convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`, `convert_ldm_clip_checkpoint`
and `convert_open_clip_checkpoint` (`diffusers/loaders/single_file_utils.py`), which must
reproduce every tensor exactly.

Usage: make_pipeline.py --assets assets --out DIR [--n 16] [--repeats 2] [--sdxl] [--single-file]
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


def pipeline(out, unet=UNET, vae=VAE, text=None, folder="pipeline", jitter=0.05, dtype=None):
    """Writes `<out>/<folder>` (diffusers `StableDiffusionPipeline.save_pretrained`) from the UNet and
    VAE configs and the text-encoder config keys `text` (over `clip_config`'s tiny defaults); every
    parameter moved by N(0, jitter) (None: the default init as it is), saved in `dtype` (None: fp32).
    The defaults are this fixture's tiny pipeline; `benches/gpu/make_models.py` passes SD 1.5's shapes."""
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    tok = tokenizer(out)
    te = CLIPTextModel(clip_config(tok, hidden_act="quick_gelu", **(text or {})))
    unet = UNet2DConditionModel(**unet)
    vae = AutoencoderKL(**vae)
    if jitter:
        with torch.no_grad():
            # default init leaves norms at 1 / 0; move every parameter a little
            for m in (unet, vae, te):
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * jitter)
    if dtype is not None:
        for m in (unet, vae, te):
            m.to(dtype)
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
    pipe.save_pretrained(os.path.join(out, folder), safe_serialization=True)


UNET_XL = dict(
    sample_size=16,
    in_channels=4,
    out_channels=4,
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,
    cross_attention_dim=64,
    norm_num_groups=32,
)


def clip_config(tok, **kw):
    """A CLIP text config for `tok`: hidden 32, 2 layers, 4 heads, 77 positions; `kw` overrides."""
    from transformers import CLIPTextConfig

    keys = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    keys.update(kw)
    return CLIPTextConfig(**keys)


def pipeline_xl(out):
    from diffusers import AutoencoderKL, EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    gen = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    tok = tokenizer(out)
    tok.model_max_length = 77  # as SDXL's tokenizers (the pipeline pads prompts to it)
    tdir = os.path.join(out, "tok2_src")
    tok.save_pretrained(tdir)
    tok2 = CLIPTokenizer.from_pretrained(tdir, pad_token="!")
    shutil.rmtree(tdir)
    te = CLIPTextModel(clip_config(tok, hidden_act="quick_gelu"))
    te2 = CLIPTextModelWithProjection(clip_config(tok, hidden_act="gelu", projection_dim=32))
    unet = UNet2DConditionModel(**UNET_XL)
    vae = AutoencoderKL(**dict(VAE, scaling_factor=0.13025))
    with torch.no_grad():
        for m in (unet, vae, te, te2):
            for p in m.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    sched = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="epsilon",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=te,
        text_encoder_2=te2,
        tokenizer=tok,
        tokenizer_2=tok2,
        unet=unet,
        scheduler=sched,
        force_zeros_for_empty_prompt=True,
    )
    pipe.save_pretrained(os.path.join(out, "pipeline_xl"), safe_serialization=True)


def text_model_state(m):
    """A transformers CLIP text model's state dict with the `text_model.` level (transformers 5
    drops it for a bare `CLIPTextModel`)."""
    out = {}
    for k, v in m.state_dict().items():
        if k.endswith("position_ids"):
            continue
        if not (k.startswith("text_model.") or k.startswith("text_projection.")):
            k = "text_model." + k
        out[k] = v
    return out


def to_open_clip(sd, prefix):
    """transformers `CLIPTextModelWithProjection` state dict -> OpenCLIP text tower keys."""
    out = {
        prefix + "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
        prefix + "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
        prefix + "ln_final.weight": sd["text_model.final_layer_norm.weight"],
        prefix + "ln_final.bias": sd["text_model.final_layer_norm.bias"],
        prefix + "text_projection": sd["text_projection.weight"].T.contiguous(),
        prefix + "logit_scale": torch.tensor(4.6052),
    }
    n = 1 + max(int(k.split(".")[3]) for k in sd if k.startswith("text_model.encoder.layers."))
    for i in range(n):
        t, o = f"text_model.encoder.layers.{i}.", f"{prefix}transformer.resblocks.{i}."
        for a, b in (("layer_norm1", "ln_1"), ("layer_norm2", "ln_2"), ("self_attn.out_proj", "attn.out_proj"),
                     ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")):
            for leaf in ("weight", "bias"):
                out[f"{o}{b}.{leaf}"] = sd[f"{t}{a}.{leaf}"]
        for leaf in ("weight", "bias"):
            out[f"{o}attn.in_proj_{leaf}"] = torch.cat(
                [sd[f"{t}self_attn.{q}_proj.{leaf}"] for q in ("q", "k", "v")], 0
            ).contiguous()
    return out


def assert_same(back, want, what):
    assert set(back) == set(want), (what, sorted(set(back) ^ set(want))[:8])
    for k in want:
        assert torch.equal(back[k].contiguous(), want[k].contiguous()), (what, k)


def single_file(out, sdxl):
    """Writes `<out>/single/model.safetensors` in the original layout and checks it with diffusers'
    converters."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline
    from diffusers.loaders.single_file_utils import (
        convert_ldm_clip_checkpoint,
        convert_ldm_unet_checkpoint,
        convert_ldm_vae_checkpoint,
        convert_open_clip_checkpoint,
    )
    from safetensors.torch import save_file
    from sd_unet import to_ldm as unet_to_ldm
    from sd_vae import to_ldm as vae_to_ldm

    cls, folder = (StableDiffusionXLPipeline, "pipeline_xl") if sdxl else (StableDiffusionPipeline, "pipeline")
    pipe = cls.from_pretrained(os.path.join(out, folder))
    ckpt = {}
    unet_sd = pipe.unet.state_dict()
    ckpt.update(unet_to_ldm(unet_sd, dict(pipe.unet.config)))
    vae_sd = pipe.vae.state_dict()
    ckpt.update(vae_to_ldm(vae_sd, len(pipe.vae.config.block_out_channels)))
    te_prefix = "conditioner.embedders.0.transformer." if sdxl else "cond_stage_model.transformer."
    te_sd = text_model_state(pipe.text_encoder)
    ckpt.update({te_prefix + k: v.contiguous() for k, v in te_sd.items()})
    if sdxl:
        te2_sd = text_model_state(pipe.text_encoder_2)
        ckpt.update(to_open_clip(te2_sd, "conditioner.embedders.1.model."))
    # diffusers' converters reproduce every component
    assert_same(convert_ldm_unet_checkpoint(ckpt, dict(pipe.unet.config)), unet_sd, "unet")
    assert_same(convert_ldm_vae_checkpoint(ckpt, dict(pipe.vae.config)), vae_sd, "vae")
    assert_same(convert_ldm_clip_checkpoint(ckpt, remove_prefix=te_prefix), te_sd, "text_encoder")
    if sdxl:
        back = convert_open_clip_checkpoint(pipe.text_encoder_2, ckpt, prefix="conditioner.embedders.1.model.")
        assert_same(back, te2_sd, "text_encoder_2")
    os.makedirs(os.path.join(out, "single"), exist_ok=True)
    save_file(ckpt, os.path.join(out, "single", "model.safetensors"))


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
    ap.add_argument("--sdxl", action="store_true")
    ap.add_argument("--single-file", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(a.out, exist_ok=True)
    if a.sdxl:
        pipeline_xl(a.out)
    else:
        pipeline(a.out)
    if a.single_file:
        single_file(a.out, a.sdxl)
    data(a.assets, a.out, a.n, a.repeats)


if __name__ == "__main__":
    main()
