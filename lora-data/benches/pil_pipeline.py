"""The image pipeline of `loader_bench` in Pillow + NumPy, on the same files, sizes and threads.

Usage: python pil_pipeline.py PLAN.json THREADS [REPEATS]
PLAN.json is written by `cargo run -p lora-data --example loader_bench`: one entry per image with
the bucket, the cover-resize size and the crop offset that lora-data used, so both sides do the
same work: open → EXIF transpose → RGB (alpha composited on white) → bilinear resize → crop →
float32 CHW in [-1, 1]. After a warm pass over the plan, times one pass over the plan REPEATS
times (default 1). Prints `images_per_s=<rate>`.
"""
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from PIL import Image, ImageOps


def load(item):
    with Image.open(item["path"]) as im:
        im = ImageOps.exif_transpose(im)
        if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
            im = im.convert("RGBA")
            bg = Image.new("RGBA", im.size, (255, 255, 255, 255))
            im = Image.alpha_composite(bg, im).convert("RGB")
        else:
            im = im.convert("RGB")
        rw, rh = item["resized"]
        if im.size != (rw, rh):
            im = im.resize((rw, rh), Image.BILINEAR)
        x, y = item["crop"]
        bw, bh = item["bucket"]
        if (rw, rh) != (bw, bh):
            im = im.crop((x, y, x + bw, y + bh))
        a = np.asarray(im, dtype=np.float32) / 127.5 - 1.0
        return np.ascontiguousarray(a.transpose(2, 0, 1))


def main():
    plan = json.load(open(sys.argv[1]))
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(load, plan))  # warm the page cache
        t = time.perf_counter()
        out = list(ex.map(load, plan * repeats))
        secs = time.perf_counter() - t
    assert all(o.shape[0] == 3 for o in out)
    print(f"pil: {len(out)} images in {secs:.2f}s ({threads} threads)")
    print(f"images_per_s={len(out) / secs:.1f}")


if __name__ == "__main__":
    main()
