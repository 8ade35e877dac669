"""Compact FLUX bases for `tests/models/flux_bases.rs`: a GGUF file as city96's ComfyUI-GGUF
writes FLUX (BFL names, block-quantized linears) and fp8 single files, with diffusers' outputs on
the weights they hold.

The model: a tiny random-weight diffusers `FluxTransformer2DModel` of FLUX.1's head width
(2 heads x 128 = 256, RoPE axes (16, 56, 56), so every block linear's input width is a multiple
of 256 as the k-quants need), 1 double + 1 single block, 16 input channels, T5 width 32,
pooled 24, guidance embedding (dev-like), RMSNorm scales randomised.

Writes, under --out:

- `flux.gguf` (`gguf.GGUFWriter`, `general.architecture = flux`): the model in Black Forest
  Labs' names (no prefix, as city96's files). Block linears and some embedders are block
  quantized, one type per tensor so that every type occurs and the fused tensors are k-quants
  and Q8_0 (`TYPES` below; `double_blocks.0.img_attn.qkv` Q4_K, `txt_attn.qkv` Q8_0,
  `single_blocks.0.linear1` Q5_K, `final_layer.adaLN_modulation.1` Q8_0); the small embedders
  are F16 / BF16 / F32 and every 1-D tensor F32. Q8_0 and Q4_0/Q4_1/Q5_0/Q5_1 are quantized
  with `gguf.quants.quantize`; the gguf package has no k-quant quantizer, so the Q4_K / Q5_K /
  Q6_K tensors are valid super-blocks drawn at random (random code and scale bytes, f16 `d`
  and `dmin` chosen so that weights stay within about ±0.1);
- `dense_bfl.safetensors`: the original f32 weights in BFL names;
- `fp8_bfl.safetensors`: the same with every 2-D weight cast to `torch.float8_e4m3fn` (F8_E4M3,
  as `flux1-dev-fp8.safetensors`), 1-D tensors f32;
- `reference.safetensors`: the inputs (`hs`, `ehs`, `pooled`, `t`, `img_ids`, `txt_ids`,
  `guidance`) and diffusers' f32 outputs: `dense.out` (original weights), `gguf.out` (every
  tensor replaced by `gguf.quants.dequantize` of what the GGUF file stores, mapped back to
  diffusers names), `fp8.out` (every tensor rounded through `torch.float8_e4m3fn`, as kohya's
  `fp8_base` casts the whole model with `model.to(torch.float8_e4m3fn)`);
- `bytes.json`: the bytes of the GGUF file's tensor data.

Usage: flux_bases.py --out DIR
"""

import argparse
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from diffusers import FluxPipeline, FluxTransformer2DModel  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flux_transformer import to_bfl  # noqa: E402

CFG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=128,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=24,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)

TYPES = {
    "img_in.weight": T.F16,
    "txt_in.weight": T.Q8_0,
    "time_in.in_layer.weight": T.BF16,
    "time_in.out_layer.weight": T.Q8_0,
    "vector_in.in_layer.weight": T.F32,
    "vector_in.out_layer.weight": T.Q4_0,
    "guidance_in.in_layer.weight": T.F16,
    "guidance_in.out_layer.weight": T.Q5_0,
    "double_blocks.0.img_mod.lin.weight": T.Q4_0,
    "double_blocks.0.img_attn.qkv.weight": T.Q4_K,
    "double_blocks.0.img_attn.proj.weight": T.Q5_0,
    "double_blocks.0.img_mlp.0.weight": T.Q6_K,
    "double_blocks.0.img_mlp.2.weight": T.Q8_0,
    "double_blocks.0.txt_mod.lin.weight": T.Q4_1,
    "double_blocks.0.txt_attn.qkv.weight": T.Q8_0,
    "double_blocks.0.txt_attn.proj.weight": T.Q5_1,
    "double_blocks.0.txt_mlp.0.weight": T.Q4_K,
    "double_blocks.0.txt_mlp.2.weight": T.Q5_K,
    "single_blocks.0.modulation.lin.weight": T.Q8_0,
    "single_blocks.0.linear1.weight": T.Q5_K,
    "single_blocks.0.linear2.weight": T.Q6_K,
    "final_layer.adaLN_modulation.1.weight": T.Q8_0,
    "final_layer.linear.weight": T.F16,
}


def f16_bytes(v, rng, n):
    return np.asarray(v * (0.5 + rng.random(n)), dtype=np.float16).view(np.uint8).reshape(n, 2)


def random_k_blocks(rows, cols, qtype, rng):
    """Random valid k-quant super-blocks for a [rows, cols] tensor, as uint8 [rows, bytes]."""
    n = rows * cols // 256
    rand = lambda k: rng.integers(0, 256, size=(n, k), dtype=np.uint8)  # noqa: E731
    if qtype == T.Q4_K:  # d, dmin, 12 scale bytes, 128 nibble bytes
        parts = [f16_bytes(1e-4, rng, n), f16_bytes(8e-4, rng, n), rand(12), rand(128)]
    elif qtype == T.Q5_K:  # d, dmin, 12 scale bytes, 32 high-bit bytes, 128 nibble bytes
        parts = [f16_bytes(5e-5, rng, n), f16_bytes(8e-4, rng, n), rand(12), rand(32), rand(128)]
    elif qtype == T.Q6_K:  # 128 ql, 64 qh, 16 i8 scales (never -128), d
        scales = rng.integers(-127, 128, size=(n, 16)).astype(np.int8).view(np.uint8)
        parts = [rand(128), rand(64), scales, f16_bytes(2.5e-5, rng, n)]
    else:
        raise ValueError(qtype)
    blocks = np.concatenate(parts, axis=1)
    assert blocks.shape[1] == gguf.GGML_QUANT_SIZES[qtype][1]
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def write_gguf(bfl, path):
    """Writes `bfl` (name -> f32 tensor) with TYPES; returns name -> dequantized f32 tensor."""
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(path, "flux")
    stored = {}
    data_bytes = 0
    for name, t in bfl.items():
        a = t.numpy().astype(np.float32)
        qtype = TYPES.get(name, T.F32)
        if qtype == T.F32:
            data, raw = a, None
        elif qtype == T.F16:
            data, raw = a.astype(np.float16), None
        elif qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
            data, raw = random_k_blocks(a.shape[0], a.shape[1], qtype, rng), qtype
        else:
            data, raw = quantize(a, qtype), qtype
        if raw is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=raw)
        data_bytes += data.nbytes
        back = dequantize(data, qtype) if raw is not None else data.astype(np.float32)
        stored[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(t.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored, data_bytes


def from_bfl(bfl_values, sd):
    """The inverse of `to_bfl`: each diffusers row found through a provenance id per row."""
    keys = list(sd)
    ids = {k: torch.arange(sd[k].shape[0], dtype=torch.float64) + i * 1e6 for i, k in enumerate(keys)}
    bfl_ids = to_bfl(ids, CFG["num_layers"], CFG["num_single_layers"], 256)
    out = {k: torch.full_like(v, float("nan")) for k, v in sd.items()}
    for name, rows in bfl_ids.items():
        for r, pid in enumerate(rows.tolist()):
            key, row = keys[int(pid // 1e6)], int(round(pid % 1e6))
            out[key][row] = bfl_values[name][r]
    assert all(not torch.isnan(v).any() for v in out.values())
    return out


def run(m, inp):
    with torch.no_grad():
        return m(**inp, return_dict=False)[0].contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    out = ap.parse_args().out
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    m = FluxTransformer2DModel(**CFG).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm_" in n and n.endswith(".weight") and p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    bfl = to_bfl(sd, CFG["num_layers"], CFG["num_single_layers"], 256)
    assert set(TYPES) <= set(bfl), set(TYPES) - set(bfl)
    save_file({k: v.contiguous() for k, v in bfl.items()}, os.path.join(out, "dense_bfl.safetensors"))
    fp8 = {k: (v.to(torch.float8_e4m3fn) if v.dim() == 2 else v).contiguous() for k, v in bfl.items()}
    save_file(fp8, os.path.join(out, "fp8_bfl.safetensors"))
    stored, data_bytes = write_gguf(bfl, os.path.join(out, "flux.gguf"))

    torch.manual_seed(100)
    b, h2, w2, lt = 2, 3, 4, 5
    inp = dict(
        hidden_states=torch.randn(b, h2 * w2, CFG["in_channels"]),
        encoder_hidden_states=torch.randn(b, lt, CFG["joint_attention_dim"]),
        pooled_projections=torch.randn(b, CFG["pooled_projection_dim"]),
        timestep=torch.tensor([0.25, 0.9]),
        img_ids=FluxPipeline._prepare_latent_image_ids(b, h2, w2, "cpu", torch.float32),
        txt_ids=torch.zeros(lt, 3),
        guidance=torch.tensor([3.5, 1.0]),
    )
    ref = {
        "hs": inp["hidden_states"],
        "ehs": inp["encoder_hidden_states"],
        "pooled": inp["pooled_projections"],
        "t": inp["timestep"],
        "img_ids": inp["img_ids"],
        "txt_ids": inp["txt_ids"],
        "guidance": inp["guidance"],
        "dense.out": run(m, inp),
    }
    m.load_state_dict({k: v.to(torch.float8_e4m3fn).float() for k, v in sd.items()})
    ref["fp8.out"] = run(m, inp)
    m.load_state_dict(from_bfl(stored, sd))
    ref["gguf.out"] = run(m, inp)
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    with open(os.path.join(out, "bytes.json"), "w") as f:
        json.dump({"gguf_data": data_bytes, "dense_f32": sum(v.numel() * 4 for v in sd.values())}, f)


if __name__ == "__main__":
    main()
