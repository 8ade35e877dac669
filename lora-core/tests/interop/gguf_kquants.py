"""Reference data for lora-core's GGUF block and fp8 tests, from the real Python tools.

    python gguf_kquants.py blocks OUT_DIR
        For each GGUF type (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): random block bytes whose
        f16 fields hold finite random values (raw random bytes could be NaN/Inf), written as
        `<TYPE>.bin`, and the `gguf` package's `gguf.quants.dequantize` of them as `<TYPE>.f32`
        (little-endian float32). `manifest.json` lists type, shape [rows, in] and files.

    python gguf_kquants.py fp8 OUT_DIR
        `fp8_in.f32`: float32 values (normal, subnormal, beyond the e4m3fn range, ±inf, NaN, ±0),
        `fp8_out.u8`: their bytes after PyTorch's `.to(torch.float8_e4m3fn)`, and `fp8_table.f32`:
        PyTorch's float32 value of each of the 256 e4m3fn bytes.

    python gguf_kquants.py requant SRC_GGUF OUT_DIR FTYPE...
        Re-quantizes SRC_GGUF with llama.cpp's quantizer (llama-cpp-python's
        `llama_model_quantize`, `allow_requantize=True`) to each llama.cpp ftype name given
        (e.g. Q4_K_M, Q5_K_M) as `OUT_DIR/<FTYPE>.gguf`, then writes, for the first two tensors of each
        block type in each file (of at most 4 Mi values), `gguf.quants.dequantize` of its data as `<FTYPE>.<tensor>.f32`.
        `manifest.json` lists file, tensor, type name and data file.
"""

import ctypes
import json
import os
import sys

import numpy as np


def f16_bytes(rng, n, lo=-3.0, hi=3.0, positive=False):
    """`n` finite f16 values as raw bytes: random sign and magnitude 2^[lo, hi]."""
    mag = np.exp2(rng.uniform(lo, hi, size=n))
    sign = 1.0 if positive else rng.choice([-1.0, 1.0], size=n)
    return (mag * sign).astype(np.float16).view(np.uint8).reshape(n, 2)


def blocks(out_dir):
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(1234)
    # offsets of the f16 fields in each block layout (ggml-common.h)
    f16_fields = {
        "Q8_0": [0],
        "Q4_0": [0],
        "Q4_1": [0, 2],
        "Q5_0": [0],
        "Q5_1": [0, 2],
        "Q4_K": [0, 2],
        "Q5_K": [0, 2],
        "Q6_K": [208],
    }
    manifest = []
    for name, fields in f16_fields.items():
        qtype = getattr(T, name)
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows, inn = 3, 2 * block_size if block_size == 256 else 4 * block_size
        n = rows * inn // block_size
        raw = rng.integers(0, 256, size=(n, type_size), dtype=np.uint8)
        for at in fields:
            raw[:, at : at + 2] = f16_bytes(rng, n)
        raw = raw.reshape(rows, -1)
        values = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        assert values.shape == (rows, inn), values.shape
        raw.tofile(os.path.join(out_dir, f"{name}.bin"))
        values.astype("<f4").tofile(os.path.join(out_dir, f"{name}.f32"))
        manifest.append({"type": name, "shape": [rows, inn], "raw": f"{name}.bin", "values": f"{name}.f32"})
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def fp8(out_dir):
    import torch

    rng = np.random.default_rng(99)
    normal = rng.standard_normal(4000).astype(np.float32) * np.exp2(rng.uniform(-12, 9, 4000)).astype(np.float32)
    special = np.array(
        [0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 480.0, 1e6, -1e6, np.inf, -np.inf, np.nan,
         2.0**-9, 2.0**-10, 3 * 2.0**-11, 2.0**-6, 1.0625, 1.1875, 240.0, 232.0],
        dtype=np.float32,
    )
    x = np.concatenate([normal, special]).astype(np.float32)
    q = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    table = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    x.astype("<f4").tofile(os.path.join(out_dir, "fp8_in.f32"))
    q.tofile(os.path.join(out_dir, "fp8_out.u8"))
    table.astype("<f4").tofile(os.path.join(out_dir, "fp8_table.f32"))


def requant(src, out_dir, ftypes):
    import gguf
    import llama_cpp

    manifest = []
    for ftype in ftypes:
        dst = os.path.join(out_dir, f"{ftype}.gguf")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
        if rc != 0:
            sys.exit(f"llama_model_quantize to {ftype} failed with {rc}")
        reader = gguf.GGUFReader(dst)
        seen = {}
        for t in reader.tensors:
            kind = t.tensor_type.name
            # small tensors only (the 28 Mi-value token embedding would be 113 MB of f32)
            if kind in ("F32", "F16", "BF16") or seen.get(kind, 0) >= 2 or t.n_elements > 1 << 22:
                continue
            seen[kind] = seen.get(kind, 0) + 1
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype("<f4")
            data = f"{ftype}.{t.name}.f32"
            values.tofile(os.path.join(out_dir, data))
            manifest.append({"file": f"{ftype}.gguf", "tensor": t.name, "type": kind, "values": data})
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "blocks":
        blocks(sys.argv[2])
    elif mode == "fp8":
        fp8(sys.argv[2])
    elif mode == "requant":
        requant(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(f"unknown mode {mode!r}: blocks, fp8 or requant")
