"""Converts torchvision's MobileNetV2 ImageNet checkpoint (a legacy torch pickle that libtorch's
C++ loader cannot read) into `model.safetensors`, and torchvision's ImageNet class names into a
WD14-style `selected_tags.csv` (columns `tag_id,name,category,count`; every class category 0).

Run by `cargo xtask setup` with the project's venv python (torch + safetensors):

    python convert_mobilenet_v2.py --pth mobilenet_v2-b0353104.pth \
        --meta imagenet_meta.py --out assets/mobilenet_v2

`--meta` is torchvision's `torchvision/models/_meta.py`; the list `_IMAGENET_CATEGORIES` is read
with `ast` (torchvision itself is not imported or installed). Both outputs are written to a
temporary name in the output folder and renamed into place.
"""

import argparse
import ast
import csv
import os

import torch
from safetensors.torch import save_file


def imagenet_categories(meta_path):
    with open(meta_path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), meta_path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_IMAGENET_CATEGORIES" for t in node.targets
        ):
            names = ast.literal_eval(node.value)
            if len(names) != 1000:
                raise SystemExit(f"{meta_path}: expected 1000 ImageNet classes, found {len(names)}")
            return names
    raise SystemExit(f"{meta_path}: no _IMAGENET_CATEGORIES list")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pth", required=True)
    ap.add_argument("--meta", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    state = torch.load(args.pth, map_location="cpu", weights_only=True)
    # BatchNorm's `num_batches_tracked` counters are training state, not weights.
    tensors = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in state.items()
        if not k.endswith("num_batches_tracked")
    }
    if tensors["classifier.1.weight"].shape != (1000, 1280):
        raise SystemExit(f"{args.pth}: classifier.1.weight has shape {tuple(tensors['classifier.1.weight'].shape)}")
    os.makedirs(args.out, exist_ok=True)

    st = os.path.join(args.out, "model.safetensors")
    save_file(tensors, st + ".tmp", metadata={"format": "pt", "source": os.path.basename(args.pth)})
    os.chmod(st + ".tmp", 0o644)
    os.replace(st + ".tmp", st)

    names = imagenet_categories(args.meta)
    csv_path = os.path.join(args.out, "selected_tags.csv")
    with open(csv_path + ".tmp", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["tag_id", "name", "category", "count"])
        for i, name in enumerate(names):
            w.writerow([i, name, 0, 0])
    os.replace(csv_path + ".tmp", csv_path)
    print(f"wrote {st} ({len(tensors)} tensors) and {csv_path} ({len(names)} classes)")


if __name__ == "__main__":
    main()
