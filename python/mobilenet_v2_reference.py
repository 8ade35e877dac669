"""Reference forward pass of torchvision-layout MobileNetV2 (Sandler et al. 2018,
"MobileNetV2: Inverted Residuals and Linear Bottlenecks", arXiv:1801.04381) built from plain
`torch.nn` modules and loaded from `model.safetensors` by name, in eval mode (BatchNorm with running
statistics, eps 1e-5, as torchvision's `mobilenet_v2`).

Used by lora-tagger's parity test:

    python mobilenet_v2_reference.py --weights model.safetensors --input in.safetensors \
        --output out.safetensors

`in.safetensors` holds `pixel_values` `[n, 3, H, W]` f32 (already preprocessed); the output holds
`logits` `[n, 1000]` f32.
"""

import argparse

import torch
from safetensors.torch import load_file, save_file
from torch import nn

# (expand ratio t, output channels c, repeats n, first stride s), width multiplier 1.0.
SETTINGS = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def conv_bn_relu6(cin, cout, k, stride, groups=1):
    return nn.Sequential(
        nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU6(inplace=False),
    )


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, t):
        super().__init__()
        hidden = cin * t
        self.use_res = stride == 1 and cin == cout
        layers = []
        if t != 1:
            layers.append(conv_bn_relu6(cin, hidden, 1, 1))
        layers += [
            conv_bn_relu6(hidden, hidden, 3, stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        y = self.conv(x)
        return x + y if self.use_res else y


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000):
        super().__init__()
        feats = [conv_bn_relu6(3, 32, 3, 2)]
        cin = 32
        for t, c, n, s in SETTINGS:
            for i in range(n):
                feats.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        feats.append(conv_bn_relu6(cin, 1280, 1, 1))
        self.features = nn.Sequential(*feats)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, num_classes))

    def forward(self, x):
        x = self.features(x)
        x = nn.functional.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.classifier(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = MobileNetV2()
    missing, unexpected = model.load_state_dict(load_file(args.weights), strict=False)
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.eval()
    x = load_file(args.input)["pixel_values"]
    with torch.no_grad():
        logits = model(x)
    save_file({"logits": logits.contiguous()}, args.output)


if __name__ == "__main__":
    main()
