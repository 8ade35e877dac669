"""Reference outputs of diffusers' FluxPipeline for `tests/models/flux_pipeline.rs`.

Builds a tiny random-weight FLUX.1-dev-like pipeline (fixed seeds) and writes, under --out:

- `pipe/` (FluxPipeline.save_pretrained): `transformer/` (2 double + 2 single blocks, 2 heads x
  16, RoPE axes (4, 6, 6), 64 input channels = 4 x 16 latent channels, T5 width 32, pooled 128,
  guidance embedder as FLUX.1-dev), `text_encoder/` (CLIPTextModel: hidden 128, 2 heads of 64,
  2 layers, 77 positions, quick_gelu, `eos_token_id` 2 as CLIP ViT-L's legacy config ->
  argmax pooling), `tokenizer/` (a CLIP BPE vocabulary built as `sd_clip.py` builds it,
  `model_max_length` 77), `text_encoder_2/` (T5EncoderModel v1.1 style: gated-gelu, d_model 32,
  4 heads x 8, 2 layers, 32 buckets, max distance 128), `tokenizer_2/` (a unigram T5 tokenizer
  built as `t5_encoder.py` builds it), `vae/` (AutoencoderKL: blocks (32, 64), 16 latent
  channels, no quant convs, scaling_factor 0.3611, shift_factor 0.1159 as FLUX.1's; spatial
  factor 2) and `scheduler/` (FlowMatchEulerDiscreteScheduler as FLUX.1-dev's: shift 3,
  dynamic shifting, base/max shift 0.5/1.15, base/max image seq len 256/4096);
- `single/`: the same weights as ComfyUI's single files: `flux1.safetensors` (transformer in
  BFL's layout, written with `flux_transformer.to_bfl`), `clip_l.safetensors` (CLIPTextModel keys
  under `text_model.`), `t5xxl.safetensors` (T5EncoderModel keys with `shared.weight` and no
  `encoder.embed_tokens.weight`, as `t5xxl_fp16.safetensors`, kept in f32 here) and
  `ae.safetensors` (BFL's autoencoder layout, written with `sd_vae.to_ldm` without the
  `first_stage_model.` prefix);
- `reference.safetensors`:
  - `prompt_embeds` [2, 16, 32], `pooled_prompt_embeds` [2, 128], `text_ids` [16, 3]: from
    `pipe.encode_prompt(PROMPTS, max_sequence_length=16)`; `t5_ids`, `t5_mask` [2, 16] (the T5
    tokenizer's ids and attention mask) and `prompt_embeds_masked`: T5 run with that mask (kohya
    `--apply_t5_attn_mask`);
  - `image` [2, 3, 32, 48] in [-1, 1] and `latents` [2, 16, 16, 24]:
    `(vae.encode(image).latent_dist.mean - shift_factor) * scaling_factor`;
  - `noise` [2, 16, 16, 24] (unpacked) and `sampled` [2, 96, 64] (packed):
    `pipe(prompt_embeds=..., pooled_prompt_embeds=..., latents=pack(noise), num_inference_steps=4,
    guidance_scale=3.5, height=32, width=48, output_type="latent")`; `sampled_unpacked`
    [2, 16, 16, 24]; `decoded` [2, 3, 32, 48] in [0, 1]: the VAE decode of the sample as the
    pipeline's `output_type="pt"` postprocesses it (`(x / 2 + 0.5).clamp(0, 1)`), and
    `decoded_pt` the pipeline's own `output_type="pt"` image;
  - `sigmas`: the scheduler's sigmas of that call;
  - `schnell.sampled_unpacked`: the same noise and embeddings through the schnell-like pipeline
    (2 steps, guidance_scale 0), unpacked;
- `schnell/`: a schnell-like pipeline (save_pretrained): the same text encoders, tokenizers and
  VAE, a transformer without guidance embedder (seed 2) and FLUX.1-schnell's scheduler (static
  shift 1.0, no dynamic shifting).

Usage: flux_pipeline.py --out DIR
"""

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import (  # noqa: E402
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
)
from transformers import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flux_transformer import to_bfl  # noqa: E402
from sd_clip import bytes_to_unicode, train_merges  # noqa: E402
from sd_vae import to_ldm  # noqa: E402

PROMPTS = ["a photo of a cat", "the red car on the street, a photo of a dog"]
MAX_SEQ = 16
HEIGHT, WIDTH = 32, 48

TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=128,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
CLIP = dict(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    eos_token_id=2,
    pad_token_id=1,
)
T5 = dict(
    vocab_size=100,
    d_model=32,
    d_kv=8,
    d_ff=48,
    num_layers=2,
    num_heads=4,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dropout_rate=0.0,
    layer_norm_epsilon=1e-6,
)
VAE = dict(
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
SCHNELL_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
SCHEDULER = dict(
    num_train_timesteps=1000,
    shift=3.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=1.15,
    base_image_seq_len=256,
    max_image_seq_len=4096,
)


def clip_tokenizer(tmp):
    """The CLIP BPE vocabulary of `sd_clip.py` (vocab.json + merges.txt), 77 tokens per row."""
    merges = train_merges(400)
    symbols = list(bytes_to_unicode().values())
    symbols += [s + "</w>" for s in symbols]
    symbols += ["".join(m) for m in merges]
    symbols += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {s: i for i, s in enumerate(symbols)}
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, "vocab.json"), "w") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(tmp, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n")
        for m in merges:
            f.write(f"{m[0]} {m[1]}\n")
    return CLIPTokenizer.from_pretrained(tmp, model_max_length=77)


def t5_tokenizer():
    """The unigram vocabulary of `t5_encoder.py`."""
    words = ["a", "photo", "of", "cat", "dog", "the", "red", "car", "on", "street", "s", "ing"]
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + w, -3.0 - i * 0.1) for i, w in enumerate(words)]
    vocab += [(c, -8.0) for c in "abcdefghijklmnopqrstuvwxyz,"]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def randomize(model, gen, norm_key, scale=0.15):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if norm_key(n):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def build(out):
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(**TRANSFORMER).eval()
    with torch.no_grad():
        for n, p in transformer.named_parameters():
            if "norm_" in n and n.endswith(".weight") and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
    tokenizer = clip_tokenizer(os.path.join(out, "clip_vocab"))
    text_encoder = randomize(
        CLIPTextModel(CLIPTextConfig(bos_token_id=tokenizer.bos_token_id, **CLIP)),
        gen,
        lambda n: "layer_norm" in n and n.endswith("weight"),
    )
    text_encoder_2 = randomize(T5EncoderModel(T5Config(**T5)), gen, lambda n: "layer_norm" in n)
    torch.manual_seed(1)
    vae = AutoencoderKL(**VAE)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    vae.eval()
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=t5_tokenizer(),
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(os.path.join(out, "pipe"))
    # schnell-like: the same text encoders and VAE, a transformer without guidance embedder and
    # FLUX.1-schnell's scheduler (static shift 1)
    torch.manual_seed(2)
    schnell = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHNELL_SCHEDULER),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=pipe.tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=pipe.tokenizer_2,
        transformer=FluxTransformer2DModel(**dict(TRANSFORMER, guidance_embeds=False)).eval(),
    )
    schnell.set_progress_bar_config(disable=True)
    schnell.save_pretrained(os.path.join(out, "schnell"))
    return pipe, schnell


def single_files(pipe, out):
    d = os.path.join(out, "single")
    os.makedirs(d, exist_ok=True)
    sd = {k: v.contiguous() for k, v in pipe.transformer.state_dict().items()}
    inner = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
    bfl = to_bfl(sd, TRANSFORMER["num_layers"], TRANSFORMER["num_single_layers"], inner)
    save_file({k: v.contiguous() for k, v in bfl.items()}, os.path.join(d, "flux1.safetensors"))
    clip = {k if k.startswith("text_model.") else "text_model." + k: v.contiguous() for k, v in pipe.text_encoder.state_dict().items()}
    assert "text_model.embeddings.token_embedding.weight" in clip
    save_file(clip, os.path.join(d, "clip_l.safetensors"))
    t5 = {k: v.contiguous() for k, v in pipe.text_encoder_2.state_dict().items()}
    t5.pop("encoder.embed_tokens.weight", None)
    assert "shared.weight" in t5
    save_file(t5, os.path.join(d, "t5xxl.safetensors"))
    vsd = pipe.vae.state_dict()
    ae = {k[len("first_stage_model."):]: v.contiguous() for k, v in to_ldm(vsd, len(VAE["block_out_channels"])).items()}
    assert "encoder.down.0.block.0.norm1.weight" in ae
    save_file(ae, os.path.join(d, "ae.safetensors"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    torch.set_num_threads(1)
    pipe, schnell = build(out)
    single_files(pipe, out)
    ref = {}
    gen = torch.Generator().manual_seed(21)
    with torch.no_grad():
        prompt_embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS, max_sequence_length=MAX_SEQ)
        tok = pipe.tokenizer_2(PROMPTS, padding="max_length", max_length=MAX_SEQ, truncation=True, return_tensors="pt")
        masked = pipe.text_encoder_2(tok.input_ids, attention_mask=tok.attention_mask)[0]
        ref.update(
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled,
            text_ids=text_ids,
            t5_ids=tok.input_ids,
            t5_mask=tok.attention_mask,
            prompt_embeds_masked=masked,
        )

        image = torch.rand(2, 3, HEIGHT, WIDTH, generator=gen) * 2 - 1
        vc = pipe.vae.config
        latents = (pipe.vae.encode(image).latent_dist.mean - vc.shift_factor) * vc.scaling_factor
        ref.update(image=image, latents=latents)

        f = pipe.vae_scale_factor
        h, w = 2 * (HEIGHT // (f * 2)), 2 * (WIDTH // (f * 2))
        noise = torch.randn(2, VAE["latent_channels"], h, w, generator=gen)
        packed = FluxPipeline._pack_latents(noise, 2, VAE["latent_channels"], h, w)
        common = dict(
            prompt_embeds=prompt_embeds,
            pooled_prompt_embeds=pooled,
            num_inference_steps=4,
            guidance_scale=3.5,
            height=HEIGHT,
            width=WIDTH,
        )
        sampled = pipe(latents=packed.clone(), output_type="latent", **common).images
        sigmas = pipe.scheduler.sigmas.clone()
        unpacked = FluxPipeline._unpack_latents(sampled, HEIGHT, WIDTH, f)
        decoded = pipe.vae.decode(unpacked / vc.scaling_factor + vc.shift_factor).sample
        decoded = (decoded / 2 + 0.5).clamp(0, 1)
        decoded_pt = pipe(latents=packed.clone(), output_type="pt", **common).images
        assert torch.allclose(decoded, decoded_pt, atol=1e-5), (decoded - decoded_pt).abs().max()
        s_latent = schnell(latents=packed.clone(), output_type="latent", **dict(common, num_inference_steps=2, guidance_scale=0.0)).images
        ref["schnell.sampled_unpacked"] = FluxPipeline._unpack_latents(s_latent, HEIGHT, WIDTH, f)
        ref.update(
            noise=noise,
            sampled=sampled,
            sampled_unpacked=unpacked,
            decoded=decoded,
            decoded_pt=decoded_pt,
            sigmas=sigmas.float(),
        )
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
