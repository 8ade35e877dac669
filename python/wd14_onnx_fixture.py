"""WD14-layout ONNX tagger fixtures for lora-tagger's ONNX tests: random-weight models with the
input/output layout of SmilingWolf's WD14 taggers, a `selected_tags.csv` with the real column
layout, and Python onnxruntime's scores on real photos after the reference preprocessing.

    python wd14_onnx_fixture.py --out DIR --images a.png b.png ...

Writes two model folders, each `model.onnx` + `selected_tags.csv`, as the Hugging Face repos ship
them:

- `DIR/v3`: the v3 layout (`SmilingWolf/wd-*-tagger-v3`): input `input` `[batch, 448, 448, 3]`
  float32 with a dynamic batch, output `output` `[batch, n_tags]`, sigmoid inside the graph;
- `DIR/vit` (with `--vit`): the v3 layout around a ViT-B/16 at 448 (`wd-vit-tagger-v3`'s shape),
  for throughput measurements;
- `DIR/v2`: the v2 names (`SmilingWolf/wd-v1-4-*-tagger-v2`, tf2onnx exports): input
  `input_1:0`, output `predictions_sigmoid`; exported with a fixed batch of 1 (the re-batched
  exports kohya's `tag_images_by_wd14_tagger.py` accounts for), so callers must split batches.

The network is a small conv net (NHWC → NCHW, strided convolutions to 7×7, flatten, layer norm,
linear, sigmoid), random weights from a fixed seed: the tests check the runtime, the layout and
the preprocessing, which do not depend on trained values.

Also writes `DIR/reference.safetensors`: per image `pixels.<i>` `[448, 448, 3]` f32 (the reference
preprocessing of SmilingWolf's `wd-tagger` `app.py`, `prepare_image`: alpha over white, pad to a
square on white, PIL `Image.BICUBIC` resize to 448, RGB → BGR, float 0–255) and `scores.v3` /
`scores.v2` `[n_images, n_tags]` f32 from `onnxruntime.InferenceSession` (CPU) on those pixels,
and `DIR/selections.json`: per image, the tags the reference post-processing keeps from the v3
scores — `fixed`: general ≥ 0.35 and character ≥ 0.85 (kohya's comparisons), `mcut`: MCut on
general and on character tags (floor 0.15), kept when strictly above (the reference app's
`mcut_threshold`), each with the top rating.
"""

import argparse
import csv
import json
import os

import numpy as np
import onnx
import onnxruntime
import torch
from PIL import Image
from safetensors.numpy import save_file
from torch import nn

SIZE = 448

# (name, category) in the order of the real files: ratings (9) first, then general (0), then
# character (4). Names from the real `selected_tags.csv`, kaomoji and parentheses included.
RATINGS = ["general", "sensitive", "questionable", "explicit"]
GENERAL = [
    "1girl", "solo", "long_hair", "breasts", "looking_at_viewer", "blush", "smile", "open_mouth",
    "short_hair", "blue_eyes", "simple_background", "shirt", "skirt", "hair_ornament", "animal",
    "cat", "no_humans", "outdoors", "sky", "day", "cloud", "tree", "food", "cup", "motor_vehicle",
    "motorcycle", "ground_vehicle", "vehicle_focus", "white_background", "monochrome",
    "hood_(cloak)", "^_^", "o_o", ":d", "animal_focus", "whiskers", "coffee", "saucer",
    "table", "indoors",
]
CHARACTER = ["hatsune_miku", "hakurei_reimu", "kirisame_marisa", "chen_(touhou)", "saber_(fate)", "megumin"]


def labels():
    rows = [(n, 9) for n in RATINGS] + [(n, 0) for n in GENERAL] + [(n, 4) for n in CHARACTER]
    return rows


class TinyTagger(nn.Module):
    """NHWC float 0–255 in, sigmoid probabilities out, as the WD14 exports. Strided convolutions
    down to 7×7, flattened (so where things are matters, not only mean colours), a parameter-free
    layer norm, linear, sigmoid: different photos get clearly different scores."""

    def __init__(self, n_tags):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 8, stride=4, padding=2),
            nn.GELU(),
            nn.Conv2d(8, 16, 4, stride=4),
            nn.GELU(),
            nn.Conv2d(16, 16, 4, stride=4),
        )
        self.norm = nn.LayerNorm(16 * 7 * 7, elementwise_affine=False)
        self.head = nn.Linear(16 * 7 * 7, n_tags)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2) / 127.5 - 1.0
        x = self.norm(self.body(x).flatten(1))
        return torch.sigmoid(self.head(x) * 3.0)


class VitBlock(nn.Module):
    """A pre-norm transformer block (attention written out, so the ONNX export is plain ops)."""

    def __init__(self, dim, heads, mlp):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp)
        self.fc2 = nn.Linear(mlp, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        att = torch.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


class VitTagger(nn.Module):
    """A WD14-shaped ViT for throughput measurements: the shape of `wd-vit-tagger-v3` (ViT-B/16 at
    448: 16-pixel patches, 28×28 tokens + a class token, 12 blocks of width 768, 12 heads, MLP
    3072; ~86 M parameters), NHWC float 0–255 in, sigmoid out, random weights."""

    def __init__(self, n_tags, dim=768, depth=12, heads=12, mlp=3072, patch=16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (SIZE // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[VitBlock(dim, heads, mlp) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, n_tags)

    def forward(self, x):
        x = x.permute(0, 3, 1, 2) / 127.5 - 1.0
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.norm(self.blocks(x))
        return torch.sigmoid(self.head(x[:, 0]))


def export(model, folder, input_name, output_name, dynamic_batch):
    os.makedirs(folder, exist_ok=True)
    dummy = torch.zeros(1, SIZE, SIZE, 3)
    axes = {input_name: {0: "batch_size"}, output_name: {0: "batch_size"}} if dynamic_batch else None
    path = os.path.join(folder, "model.onnx")
    torch.onnx.export(
        model,
        (dummy,),
        path,
        input_names=[input_name],
        output_names=[output_name],
        dynamic_axes=axes,
        opset_version=17,
        dynamo=False,
    )
    onnx.checker.check_model(onnx.load(path))
    with open(os.path.join(folder, "selected_tags.csv"), "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["tag_id", "name", "category", "count"])
        for i, (name, cat) in enumerate(labels()):
            w.writerow([9999999 - i if cat == 9 else 100000 + i, name, cat, 1000000 - 1000 * i])
    return path


def prepare_image(path):
    """SmilingWolf's `wd-tagger` `app.py` `prepare_image`, size 448."""
    image = Image.open(path)
    if image.mode != "RGBA":
        image = image.convert("RGBA")
    canvas = Image.new("RGBA", image.size, (255, 255, 255))
    canvas.alpha_composite(image)
    image = canvas.convert("RGB")
    max_dim = max(image.size)
    pad_left = (max_dim - image.size[0]) // 2
    pad_top = (max_dim - image.size[1]) // 2
    padded = Image.new("RGB", (max_dim, max_dim), (255, 255, 255))
    padded.paste(image, (pad_left, pad_top))
    if max_dim != SIZE:
        padded = padded.resize((SIZE, SIZE), Image.BICUBIC)
    arr = np.asarray(padded, dtype=np.float32)
    return np.ascontiguousarray(arr[:, :, ::-1])


def mcut_threshold(probs):
    """Maximum Cut thresholding, as SmilingWolf's `wd-tagger` `app.py`."""
    sorted_probs = probs[probs.argsort()[::-1]]
    difs = sorted_probs[:-1] - sorted_probs[1:]
    t = difs.argmax()
    return (sorted_probs[t] + sorted_probs[t + 1]) / 2


def select(scores):
    """The reference post-processing of one image's scores (see the module docstring)."""
    rows = labels()
    named = list(zip([n for n, _ in rows], scores.astype(float)))
    idx = {c: [i for i, (_, cat) in enumerate(rows) if cat == c] for c in (0, 4, 9)}
    rating = max((named[i] for i in idx[9]), key=lambda x: x[1])[0]
    general = [named[i] for i in idx[0]]
    character = [named[i] for i in idx[4]]
    fixed = [n for n, p in general if p >= 0.35] + [n for n, p in character if p >= 0.85]
    g = mcut_threshold(np.array([p for _, p in general]))
    c = max(0.15, mcut_threshold(np.array([p for _, p in character])))
    mcut = [n for n, p in general if p > g] + [n for n, p in character if p > c]
    return {"rating": rating, "fixed": sorted(fixed), "mcut": sorted(mcut), "general_mcut": g, "character_mcut": c}


def run(path, pixels):
    sess = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    out = sess.get_outputs()[0].name
    fixed = inp.shape[0] if isinstance(inp.shape[0], int) else None
    if fixed:
        return np.concatenate([sess.run([out], {inp.name: pixels[i : i + 1]})[0] for i in range(len(pixels))])
    return sess.run([out], {inp.name: pixels})[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", nargs="+", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vit", action="store_true",
                    help="also write DIR/vit: a WD14-shaped ViT-B/16 (v3 layout) for throughput "
                         "measurements (~350 MB)")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.vit:
        export(VitTagger(len(labels())).eval(), os.path.join(args.out, "vit"), "input", "output",
               dynamic_batch=True)
    model = TinyTagger(len(labels())).eval()
    v3 = export(model, os.path.join(args.out, "v3"), "input", "output", dynamic_batch=True)
    v2 = export(model, os.path.join(args.out, "v2"), "input_1:0", "predictions_sigmoid", dynamic_batch=False)
    pixels = np.stack([prepare_image(p) for p in args.images])
    tensors = {f"pixels.{i}": pixels[i] for i in range(len(pixels))}
    tensors["scores.v3"] = np.ascontiguousarray(run(v3, pixels), dtype=np.float32)
    tensors["scores.v2"] = np.ascontiguousarray(run(v2, pixels), dtype=np.float32)
    save_file(tensors, os.path.join(args.out, "reference.safetensors"))
    with open(os.path.join(args.out, "selections.json"), "w", encoding="utf-8") as f:
        json.dump([select(s) for s in tensors["scores.v3"]], f, indent=1)
    print(f"onnxruntime {onnxruntime.__version__}; {len(labels())} tags; {len(pixels)} images")


if __name__ == "__main__":
    main()
