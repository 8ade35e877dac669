"""Writes random-init checkpoints in the Hugging Face layouts, from the published configs, so both
sides of a comparison (lora-train and PEFT + transformers / diffusers) load the same weights on a
machine without hub access.

    python benches/gpu/make_models.py OUT_DIR llama-3.2-1b [qwen2.5-7b sd15-unet sd15 images-512 ...]
    python benches/gpu/make_models.py OUT_DIR --all
    python benches/gpu/make_models.py OUT_DIR --tiny          # small shapes (seconds, ~1 MB): tests, --cpu runs
    python benches/gpu/make_models.py --list

Each LLM goes to OUT_DIR/<name>/ as transformers' save_pretrained writes it (config.json,
generation_config.json, model.safetensors or shards + model.safetensors.index.json), with a
byte-level tokenizer.json; a UNet goes to OUT_DIR/<name>/unet/ as diffusers writes it
(config.json, diffusion_pytorch_model.safetensors). A Stable Diffusion pipeline (`sd15`,
`tiny-sd`) goes to OUT_DIR/<name>/ as diffusers' StableDiffusionPipeline.save_pretrained writes
it (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/): what `lora-train
train` with `model.kind: sd15` and diffusers both load. It is built by the function that builds
lora-train's own SD test pipeline (`lora-train/tests/sd_interop/make_pipeline.py`, with the CLIP
BPE of `lora-models/tests/interop/sd_clip.py`; a bundle carries both beside this file): a CLIP
tokenizer whose ~900-entry vocabulary is learned locally (the real one has 49,408 entries; the
text encoder keeps 49,408 embedding rows, so its size is the real one), the scheduler SD's DDPM
schedule. An image set (`images-512`, `images-1024`, `tiny-images`) goes to
OUT_DIR/<name>/1_shapes/ (kohya layout: `<repeats>_<concept>/`): PNGs of random coloured shapes
on gradients, drawn with numpy + Pillow at exactly that size, each with a `.txt` caption naming
them. A folder written before from the same config and dtype (its make_models.json) is left as
it is (delete it to rebuild). Weights are bf16 for the LLMs and fp16 for the UNets and pipelines,
the dtypes the published checkpoints ship in; `--dtype` overrides.

Shapes come from the published config.json files (fetched once by hand; the numbers are copied
below, nothing is downloaded):
  - Llama-3.2-1B   https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
  - Llama-3.2-3B   https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
  - Llama-3.1-8B   https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
  - Qwen2.5-7B     https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
  - SD 1.5 UNet    https://huggingface.co/stable-diffusion-v1-5/stable-diffusion-v1-5/blob/main/unet/config.json
  - SDXL UNet      https://huggingface.co/stabilityai/stable-diffusion-xl-base-1.0/blob/main/unet/config.json
  - SD 1.5 VAE     https://huggingface.co/stable-diffusion-v1-5/stable-diffusion-v1-5/blob/main/vae/config.json
  - SD 1.5 CLIP    https://huggingface.co/stable-diffusion-v1-5/stable-diffusion-v1-5/blob/main/text_encoder/config.json

What random weights do not change: every matmul, attention and optimizer step costs the same
time and memory whatever the values, so step time, tokens/s and allocator peaks are those of the
real model. Where they do matter: the loss starts near ln(vocab_size) and does not fall the way a
pretrained model's does, so loss curves, NaN/Inf checks under fp16 (random bf16 weights cast to
fp16 can overflow where real ones do not), early stopping and anything data-dependent
(sequence-length bucketing of real text, the sparsity of real activations, which only matters to
sparse kernels we do not use) say nothing about the real model. The tokenizer maps bytes to ids
0..255 (plus special tokens), so text becomes ~1 token per byte: count tokens, not bytes.
"""

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# Llama 3 family: rope_scaling "llama3" as published.
_LLAMA3_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "use_cache": True,
    "vocab_size": 128256,
}

LLMS = {
    "llama-3.2-1b": dict(
        _LLAMA3_COMMON,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    "llama-3.2-3b": dict(
        _LLAMA3_COMMON,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    "llama-3.1-8b": dict(
        _LLAMA3_COMMON,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_scaling={
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "hidden_act": "silu",
        "hidden_size": 3584,
        "initializer_range": 0.02,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    # --tiny: the Llama 3 layout (GQA, llama3 RoPE scaling, tied embeddings) at toy size.
    "tiny-llama": dict(
        _LLAMA3_COMMON,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        vocab_size=512,
        bos_token_id=256,
        eos_token_id=257,
        rope_scaling={
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 512,
            "rope_type": "llama3",
        },
    ),
}

# Only the keys that differ from diffusers' UNet2DConditionModel defaults matter for the shape;
# the published configs' other keys are the defaults.
UNETS = {
    "sd15-unet": {
        "sample_size": 64,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 2,
        "block_out_channels": [320, 640, 1280, 1280],
        "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 768,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    },
    "sdxl-unet": {
        "sample_size": 128,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 2,
        "block_out_channels": [320, 640, 1280],
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
        "transformer_layers_per_block": [1, 2, 10],
        "attention_head_dim": [5, 10, 20],
        "cross_attention_dim": 2048,
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
        "norm_num_groups": 32,
    },
    # --tiny: the SD 1.5 block layout at toy width.
    "tiny-unet": {
        "sample_size": 8,
        "in_channels": 4,
        "out_channels": 4,
        "layers_per_block": 1,
        "block_out_channels": [32, 64],
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "cross_attention_dim": 32,
        "attention_head_dim": 8,
        "norm_num_groups": 32,
    },
}

# Whole SD pipelines: the UNet above, the VAE and the CLIP text encoder's keys (over
# make_pipeline.clip_config's tiny defaults). "fixture": make_pipeline.py's own tiny configs.
PIPELINES = {
    "sd15": {
        "unet": "sd15-unet",
        "vae": {
            "in_channels": 3,
            "out_channels": 3,
            "down_block_types": ["DownEncoderBlock2D"] * 4,
            "up_block_types": ["UpDecoderBlock2D"] * 4,
            "block_out_channels": [128, 256, 512, 512],
            "layers_per_block": 2,
            "latent_channels": 4,
            "norm_num_groups": 32,
            "sample_size": 512,
            "scaling_factor": 0.18215,
        },
        "text": {
            "vocab_size": 49408,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "max_position_embeddings": 77,
            "projection_dim": 768,
        },
    },
    # --tiny: lora-train's SD test pipeline (hidden 32, VAE factor 2) as its tests build it.
    "tiny-sd": "fixture",
}

# Image sets: (images, side in px).
IMAGES = {"images-512": (16, 512), "images-1024": (16, 1024), "tiny-images": (8, 64)}

TINY = ["tiny-llama", "tiny-unet", "tiny-sd", "tiny-images"]


def byte_tokenizer(bos_id, eos_id):
    """A byte-level BPE tokenizer.json with no merges: the 256 bytes as ids 0..255 (GPT-2's byte
    alphabet), then <|begin_of_text|> and <|end_of_text|> at the config's bos/eos ids. Valid for any
    vocab_size > max(bos, eos); the model's other rows are simply never looked up."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers import AddedToken

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel.alphabet() is unordered: order it by the byte each character stands for
    # (GPT-2's bytes_to_unicode), so id == byte value.
    def byte_char(b):
        printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
        if b in printable:
            return chr(b)
        return chr(256 + sorted(set(range(256)) - set(printable)).index(b))

    vocab = {byte_char(b): b for b in range(256)}
    assert set(vocab) == set(alphabet), "byte alphabet mismatch"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|begin_of_text|>", special=True), AddedToken("<|end_of_text|>", special=True)])
    # add_special_tokens appends at 256, 257; move them to the config's ids through the JSON.
    spec = json.loads(tok.to_str())
    for t in spec["added_tokens"]:
        t["id"] = bos_id if t["content"] == "<|begin_of_text|>" else eos_id
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
            {"Sequence": {"id": "B", "type_id": 1}},
        ],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos_id], "tokens": ["<|begin_of_text|>"]}},
    }
    return spec


STAMP = "make_models.json"


def same_config(folder, config, dtype):
    """Whether `folder` was written by this script from the same config dict and dtype (its
    stamp file; transformers rewrites config.json in its own normalised form)."""
    path = os.path.join(folder, STAMP)
    if not os.path.isfile(path):
        return False
    return json.load(open(path)) == {"config": config, "dtype": str(dtype)}


def write_stamp(folder, config, dtype):
    with open(os.path.join(folder, STAMP), "w") as f:
        json.dump({"config": config, "dtype": str(dtype)}, f, indent=1)


def make_llm(name, out, dtype, seed):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = LLMS[name]
    folder = os.path.join(out, name)
    if same_config(folder, spec, dtype):
        print(f"{name}: {folder} already holds this config; kept")
        return folder
    os.makedirs(folder, exist_ok=True)
    # a deep copy: transformers adds keys to the nested rope_scaling dict it is given
    config = AutoConfig.for_model(**json.loads(json.dumps(spec)))
    torch.manual_seed(seed)
    # Built on the meta device would leave no values to save; built in the target dtype, the
    # 8B model needs 16 GB of RAM instead of 32.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(prev)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="5GB")
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(byte_tokenizer(spec["bos_token_id"], spec["eos_token_id"]), f)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|begin_of_text|>",
                "eos_token": "<|end_of_text|>",
                "model_max_length": spec["max_position_embeddings"],
            },
            f,
            indent=1,
        )
    write_stamp(folder, spec, dtype)
    params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {params / 1e9:.3f} B parameters, {dtype} -> {folder}")
    return folder


def make_unet(name, out, dtype, seed):
    import torch
    from diffusers import UNet2DConditionModel

    spec = UNETS[name]
    folder = os.path.join(out, name, "unet")
    if same_config(folder, spec, dtype):
        print(f"{name}: {folder} already holds this config; kept")
        return folder
    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(**spec).to(dtype)
    unet.save_pretrained(folder, safe_serialization=True)
    write_stamp(folder, spec, dtype)
    params = sum(p.numel() for p in unet.parameters())
    print(f"{name}: {params / 1e9:.3f} B parameters, {dtype} -> {folder}")
    return folder


def sd_fixture_module():
    """lora-train's SD test-pipeline builder: beside this file in a bundle, else in the repository."""
    for d in (HERE, os.path.join(HERE, "..", "..", "lora-train", "tests", "sd_interop")):
        if os.path.isfile(os.path.join(d, "make_pipeline.py")):
            for extra in (d, os.path.join(HERE, "..", "..", "lora-models", "tests", "interop")):
                if extra not in sys.path:
                    sys.path.insert(0, extra)
            import make_pipeline

            return make_pipeline
    raise SystemExit("make_models.py: make_pipeline.py (lora-train/tests/sd_interop) is neither beside this file nor in the repository")


def make_sd(name, out, dtype):
    mp = sd_fixture_module()
    spec = PIPELINES[name]
    if spec == "fixture":
        stamp = {"unet": mp.UNET, "vae": mp.VAE, "text": {}, "jitter": 0.05}
    else:
        stamp = {"unet": UNETS[spec["unet"]], "vae": spec["vae"], "text": spec["text"], "jitter": None}
    stamp = json.loads(json.dumps(stamp))
    folder = os.path.join(out, name)
    if same_config(folder, stamp, dtype):
        print(f"{name}: {folder} already holds this config; kept")
        return folder
    os.makedirs(out, exist_ok=True)
    # make_pipeline.pipeline seeds torch itself (0): --seed does not move a pipeline
    mp.pipeline(out, unet=stamp["unet"], vae=stamp["vae"], text=stamp["text"], folder=name,
                jitter=stamp["jitter"], dtype=dtype)
    write_stamp(folder, stamp, dtype)
    from safetensors import safe_open

    params = 0
    for part in ("unet", "vae", "text_encoder"):
        d = os.path.join(folder, part)
        for f in os.listdir(d):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(d, f), "pt") as h:
                    for k in h.keys():
                        n = 1
                        for x in h.get_slice(k).get_shape():
                            n *= x
                        params += n
    print(f"{name}: {params / 1e9:.3f} B parameters (UNet + VAE + text encoder), {dtype} -> {folder}")
    return folder


SHAPES = ["circle", "square", "triangle", "ring"]
COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "purple": (150, 60, 190), "white": (245, 245, 245), "black": (15, 15, 15)}


def make_images(name, out, seed):
    """OUT/<name>/1_shapes/NNN.png + NNN.txt: random shapes on a gradient, captions naming them."""
    import numpy as np
    from PIL import Image, ImageDraw

    n, side = IMAGES[name]
    stamp = {"images": n, "side": side, "seed": seed}
    folder = os.path.join(out, name)
    if same_config(folder, stamp, "png"):
        print(f"{name}: {folder} already holds these images; kept")
        return folder
    d = os.path.join(folder, "1_shapes")
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    for i in range(n):
        a, b = (np.array(COLOURS[names[j]], dtype=np.float32) for j in rng.choice(len(names), 2, replace=False))
        t = np.linspace(0.0, 1.0, side, dtype=np.float32)[:, None, None]
        grad = a * (1 - t) + b * t  # [side, 1, 3]
        px = np.broadcast_to(grad, (side, side, 3)).copy()
        px += rng.normal(0.0, 6.0, px.shape).astype(np.float32)  # a little texture
        img = Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        words = []
        for _ in range(int(rng.integers(1, 4))):
            shape, colour = SHAPES[int(rng.integers(len(SHAPES)))], names[int(rng.integers(len(names)))]
            r = int(rng.integers(side // 10, side // 4))
            cx, cy = (int(v) for v in rng.integers(r, side - r, 2))
            box = [cx - r, cy - r, cx + r, cy + r]
            fill = COLOURS[colour]
            if shape == "circle":
                draw.ellipse(box, fill=fill)
            elif shape == "square":
                draw.rectangle(box, fill=fill)
            elif shape == "triangle":
                draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
            else:
                draw.ellipse(box, outline=fill, width=max(1, r // 4))
            words.append(f"{colour} {shape}")
        img.save(os.path.join(d, f"{i:03d}.png"))
        with open(os.path.join(d, f"{i:03d}.txt"), "w") as f:
            f.write("shapes, " + ", ".join(words) + "\n")
    write_stamp(folder, stamp, "png")
    print(f"{name}: {n} images of {side} x {side} px -> {d}")
    return folder


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for the checkpoints")
    p.add_argument("names", nargs="*", help="models to write (see --list)")
    p.add_argument("--all", action="store_true", help="every full-size model")
    p.add_argument("--tiny", action="store_true", help="the toy shapes only (tiny-llama, tiny-unet, tiny-sd, tiny-images)")
    p.add_argument("--list", action="store_true", help="print the model names and exit")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="weight dtype (default: bf16 LLMs, fp16 UNets and SD pipelines)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.list:
        for n in list(LLMS) + list(UNETS) + list(PIPELINES) + list(IMAGES):
            print(n)
        return 0
    if not a.out:
        p.error("OUT_DIR is required")
    names = list(a.names)
    if a.tiny:
        names += TINY
    if a.all:
        names += [n for n in list(LLMS) + list(UNETS) + list(PIPELINES) + list(IMAGES) if n not in TINY]
    if not names:
        p.error("name at least one model, or --tiny / --all (see --list)")
    known = list(LLMS) + list(UNETS) + list(PIPELINES) + list(IMAGES)
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {', '.join(known)}")
    # no hub: everything is built from the dicts above
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    written = {}
    for n in dict.fromkeys(names):
        if n in LLMS:
            written[n] = make_llm(n, a.out, dtypes[a.dtype or "bf16"], a.seed)
        elif n in UNETS:
            written[n] = make_unet(n, a.out, dtypes[a.dtype or "fp16"], a.seed)
        elif n in PIPELINES:
            written[n] = make_sd(n, a.out, dtypes[a.dtype or "fp16"])
        else:
            written[n] = make_images(n, a.out, a.seed)
    with open(os.path.join(a.out, "models.json"), "w") as f:
        json.dump(written, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
