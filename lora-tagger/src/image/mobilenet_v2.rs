//! MobileNetV2 (Sandler et al. 2018, "MobileNetV2: Inverted Residuals and Linear Bottlenecks",
//! arXiv:1801.04381) in torchvision's layout (`torchvision/models/mobilenetv2.py`, width 1.0),
//! inference only, loaded from safetensors by name.
//!
//! Names: `features.0.{0,1}` stem conv 3×3/2 + BatchNorm (+ReLU6); `features.1` … `features.17`
//! inverted residual blocks, whose `conv` is `[0: 1×1 expand conv+BN+ReLU6,] dw 3×3 conv+BN+ReLU6,
//! 1×1 project conv, BN` (block 1 has no expansion: `conv.0.{0,1}`, `conv.1`, `conv.2`; the others
//! `conv.0.{0,1}`, `conv.1.{0,1}`, `conv.2`, `conv.3`); `features.18.{0,1}` 1×1 conv to 1280 +
//! BN + ReLU6; global average pool; `classifier.1` linear 1280 → classes (`classifier.0` is
//! dropout, inactive at inference).
//!
//! BatchNorm is folded into the preceding convolution at load (eval-mode BatchNorm is affine):
//! `w' = w · γ/√(σ² + ε)`, `b' = β − μ · γ/√(σ² + ε)`, ε = 1e-5 (`nn.BatchNorm2d`'s default).

use std::path::Path;

use lora_core::safetensors::SafetensorsFile;
use tch::{Device, Kind, Tensor};

use super::Backbone;
use super::preprocess::{Layout, Preprocess};
use crate::error::{Error, Result};

/// BatchNorm epsilon of torchvision's MobileNetV2.
pub const BN_EPS: f64 = 1e-5;

/// `(expand ratio t, output channels c, repeats n, first stride s)` of each stage
/// (Table 2 of the paper; `inverted_residual_setting` in torchvision).
pub const SETTINGS: [(i64, i64, usize, i64); 7] = [
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
];

/// A convolution with its BatchNorm folded in, and whether ReLU6 follows.
#[derive(Debug)]
struct ConvBn {
    weight: Tensor,
    bias: Tensor,
    stride: i64,
    padding: i64,
    groups: i64,
    relu6: bool,
}

impl ConvBn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = x.f_conv2d(
            &self.weight,
            Some(&self.bias),
            [self.stride, self.stride],
            [self.padding, self.padding],
            [1, 1],
            self.groups,
        )?;
        if self.relu6 {
            // In place: no second buffer. Also, tch's `f_*` ops that take `Scalar` arguments
            // panic instead of returning a libtorch error (the scalars are freed before the error
            // is read), so an allocating `f_clamp` under memory pressure would abort the run
            // rather than report out-of-memory; the in-place form allocates nothing.
            let mut y = y;
            let _ = y.f_clamp_(0.0, 6.0)?;
            Ok(y)
        } else {
            Ok(y)
        }
    }
}

#[derive(Debug)]
struct Block {
    layers: Vec<ConvBn>,
    residual: bool,
}

/// Reads tensors by name from a safetensors file (memory-mapped; each tensor copied once).
struct Weights(SafetensorsFile);

impl Weights {
    fn open(path: &Path) -> Result<Self> {
        SafetensorsFile::open(path)
            .map(Weights)
            .map_err(|e| match e {
                lora_core::Error::Io { path, source } => Error::Io { path, source },
                e => Error::Format {
                    path: path.to_path_buf(),
                    msg: format!("not a safetensors file: {e}"),
                },
            })
    }

    fn names(&self) -> Vec<String> {
        self.0.names().map(str::to_string).collect()
    }

    /// The tensor `name` as f32 on the CPU, checked against `shape`.
    fn get(&self, name: &str, shape: &[i64]) -> Result<Tensor> {
        let fmt = |msg: String| Error::Format {
            path: self.0.path().to_path_buf(),
            msg,
        };
        let Some(got) = self.0.shape(name) else {
            return Err(fmt(format!(
                "missing tensor `{name}` (expected shape {shape:?})"
            )));
        };
        if got != shape {
            return Err(fmt(format!(
                "tensor `{name}` has shape {got:?}, expected {shape:?} (MobileNetV2 width 1.0)"
            )));
        }
        match self.0.info(name).map(|(dtype, _)| dtype) {
            Some(safetensors::Dtype::F32 | safetensors::Dtype::F16 | safetensors::Dtype::BF16) => {}
            other => {
                return Err(fmt(format!(
                    "tensor `{name}` has dtype {other:?}; expected F32, F16 or BF16"
                )));
            }
        }
        self.0
            .tensor_as(name, Kind::Float, Device::Cpu)
            .map_err(|e| match e {
                // out of memory and other libtorch failures stay what they are
                lora_core::Error::Torch { source, .. } => Error::Torch(source),
                e => fmt(e.to_string()),
            })?
            .ok_or_else(|| {
                fmt(format!(
                    "missing tensor `{name}` (expected shape {shape:?})"
                ))
            })
    }
}

/// True when the file's tensor names are torchvision MobileNetV2's.
pub fn looks_like_mobilenet_v2(names: &[String]) -> bool {
    let has = |n: &str| names.iter().any(|x| x == n);
    has("features.0.0.weight") && has("features.18.0.weight") && has("classifier.1.weight")
}

/// torchvision MobileNetV2 with BatchNorm folded (see the module docs).
#[derive(Debug)]
pub struct MobileNetV2 {
    stem: ConvBn,
    blocks: Vec<Block>,
    head: ConvBn,
    fc_weight: Tensor,
    fc_bias: Tensor,
    num_classes: usize,
    kind: Kind,
}

fn conv_bn(
    w: &Weights,
    conv: &str,
    bn: &str,
    shape: [i64; 4],
    stride: i64,
    groups: i64,
    relu6: bool,
) -> Result<ConvBn> {
    let cout = shape[0];
    let weight = w.get(&format!("{conv}.weight"), &shape)?;
    let gamma = w.get(&format!("{bn}.weight"), &[cout])?;
    let beta = w.get(&format!("{bn}.bias"), &[cout])?;
    let mean = w.get(&format!("{bn}.running_mean"), &[cout])?;
    let var = w.get(&format!("{bn}.running_var"), &[cout])?;
    let scale = gamma.f_div(&var.f_add_scalar(BN_EPS)?.f_sqrt()?)?;
    let weight = weight.f_mul(&scale.f_view([cout, 1, 1, 1])?)?;
    let bias = beta.f_sub(&mean.f_mul(&scale)?)?;
    Ok(ConvBn {
        weight,
        bias,
        stride,
        padding: (shape[2] - 1) / 2,
        groups,
        relu6,
    })
}

impl MobileNetV2 {
    /// Loads `model.safetensors` (torchvision names, f32/f16/bf16) onto `device` in `kind`
    /// (`Float`, `Half` or `BFloat16`). The number of classes is read from `classifier.1.weight`.
    ///
    /// # Errors
    /// [`Error::Io`]/[`Error::Format`] naming the file and the missing or misshapen tensor;
    /// [`Error::Torch`] when a copy to the device fails.
    pub fn load(path: &Path, device: Device, kind: Kind) -> Result<Self> {
        let w = Weights::open(path)?;
        let fc = w
            .0
            .shape("classifier.1.weight")
            .ok_or_else(|| Error::Format {
                path: path.to_path_buf(),
                msg: "missing tensor `classifier.1.weight`; not a torchvision MobileNetV2".into(),
            })?;
        let num_classes = fc.first().copied().unwrap_or(0);
        let stem = conv_bn(
            &w,
            "features.0.0",
            "features.0.1",
            [32, 3, 3, 3],
            2,
            1,
            true,
        )?;
        let mut blocks = Vec::new();
        let mut cin = 32i64;
        let mut idx = 1usize;
        for (t, c, n, s) in SETTINGS {
            for i in 0..n {
                let stride = if i == 0 { s } else { 1 };
                let hidden = cin * t;
                let p = format!("features.{idx}.conv");
                let mut layers = Vec::new();
                let mut j = 0;
                if t != 1 {
                    layers.push(conv_bn(
                        &w,
                        &format!("{p}.0.0"),
                        &format!("{p}.0.1"),
                        [hidden, cin, 1, 1],
                        1,
                        1,
                        true,
                    )?);
                    j = 1;
                }
                layers.push(conv_bn(
                    &w,
                    &format!("{p}.{j}.0"),
                    &format!("{p}.{j}.1"),
                    [hidden, 1, 3, 3],
                    stride,
                    hidden,
                    true,
                )?);
                layers.push(conv_bn(
                    &w,
                    &format!("{p}.{}", j + 1),
                    &format!("{p}.{}", j + 2),
                    [c, hidden, 1, 1],
                    1,
                    1,
                    false,
                )?);
                blocks.push(Block {
                    layers,
                    residual: stride == 1 && cin == c,
                });
                cin = c;
                idx += 1;
            }
        }
        let head = conv_bn(
            &w,
            "features.18.0",
            "features.18.1",
            [1280, cin, 1, 1],
            1,
            1,
            true,
        )?;
        let fc_weight = w.get("classifier.1.weight", &[num_classes, 1280])?;
        let fc_bias = w.get("classifier.1.bias", &[num_classes])?;
        let mv = |t: Tensor| -> Result<Tensor> { Ok(t.f_to_device(device)?.f_to_kind(kind)?) };
        let mv_conv = |c: ConvBn| -> Result<ConvBn> {
            Ok(ConvBn {
                weight: mv(c.weight)?,
                bias: mv(c.bias)?,
                ..c
            })
        };
        let blocks = blocks
            .into_iter()
            .map(|b| {
                Ok(Block {
                    layers: b.layers.into_iter().map(mv_conv).collect::<Result<_>>()?,
                    residual: b.residual,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MobileNetV2 {
            stem: mv_conv(stem)?,
            blocks,
            head: mv_conv(head)?,
            fc_weight: mv(fc_weight)?,
            fc_bias: mv(fc_bias)?,
            num_classes: num_classes as usize,
            kind,
        })
    }

    /// The tensor names of a safetensors file (to pick the architecture).
    ///
    /// # Errors
    /// As [`MobileNetV2::load`].
    pub fn tensor_names(path: &Path) -> Result<Vec<String>> {
        Ok(Weights::open(path)?.names())
    }
}

impl Backbone for MobileNetV2 {
    /// Every convolution (BatchNorm folded in), the classifier weight and bias.
    fn weight_bytes(&self) -> u64 {
        let bytes = |t: &Tensor| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        let conv = |c: &ConvBn| bytes(&c.weight) + bytes(&c.bias);
        conv(&self.stem)
            + self
                .blocks
                .iter()
                .flat_map(|b| b.layers.iter())
                .map(conv)
                .sum::<u64>()
            + conv(&self.head)
            + bytes(&self.fc_weight)
            + bytes(&self.fc_bias)
    }

    fn name(&self) -> &str {
        "mobilenet_v2"
    }

    fn default_preprocess(&self) -> Preprocess {
        Preprocess::Imagenet { size: 224 }
    }

    fn layout(&self) -> Layout {
        Layout::Nchw
    }

    fn multi_label(&self) -> bool {
        false
    }

    fn num_labels(&self) -> usize {
        self.num_classes
    }

    /// # Shapes
    /// `x`: `[n, 3, h, w]` (any kind; cast to the model's) → logits `[n, classes]` f32.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _no_grad = tch::no_grad_guard();
        let mut h = self.stem.forward(&x.f_to_kind(self.kind)?)?;
        for b in &self.blocks {
            let mut y = b.layers[0].forward(&h)?;
            for l in &b.layers[1..] {
                y = l.forward(&y)?;
            }
            h = if b.residual { h.f_add(&y)? } else { y };
        }
        h = self.head.forward(&h)?;
        h = h.f_adaptive_avg_pool2d([1, 1])?.f_flatten(1, -1)?;
        Ok(h.f_linear(&self.fc_weight, Some(&self.fc_bias))?
            .f_to_kind(Kind::Float)?)
    }

    /// Peak bytes of activations per image at an `size`×`size` input: the largest, over layers,
    /// of what is alive at once in [`Backbone::forward`] — the block input (kept for the residual),
    /// a convolution's input and its output *twice* (libtorch's oneDNN convolutions compute in a
    /// blocked layout and reorder the result to NCHW, so two copies of the output coexist; ReLU6
    /// runs in place), and the residual sum — plus the input image itself, times the element size.
    /// Checked against the counting allocator in `tests/batch_oom.rs`.
    fn activation_bytes_per_item(&self, size: u32, elem_bytes: u64) -> u64 {
        let conv_out = |s: u64, stride: u64| s.div_ceil(stride);
        let mut s = conv_out(size as u64, 2);
        let input = 3 * (size as u64) * (size as u64);
        // Stem: input + conv output (twice).
        let mut peak = input + 2 * 32 * s * s;
        let mut cin = 32u64;
        for (t, c, n, st) in SETTINGS {
            for i in 0..n {
                let stride = if i == 0 { st as u64 } else { 1 };
                let hidden = cin * t as u64;
                let x = cin * s * s;
                let so = conv_out(s, stride);
                // Expansion: x + conv out (twice).
                let expand = if t != 1 { x + 2 * hidden * s * s } else { 0 };
                // Depthwise: x + its input (hidden at s) + its output (twice, hidden at so).
                let dw = x + hidden * s * s + 2 * hidden * so * so;
                // Project and residual add: x + hidden + out + sum.
                let proj = x + hidden * so * so + 2 * (c as u64) * so * so;
                peak = peak.max(input + expand.max(dw).max(proj));
                cin = c as u64;
                s = so;
            }
        }
        peak = peak.max(input + cin * s * s + 2 * 1280 * s * s);
        peak * elem_bytes
    }
}
