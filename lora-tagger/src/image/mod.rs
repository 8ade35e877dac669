//! The image tagger: WD14-style tagging over a real model.
//!
//! A model folder holds `model.safetensors` (or a WD14 `model.onnx`) and a WD14 label file
//! `selected_tags.csv` ([`labels`]). The pipeline per image is the WD14 one: decode → preprocess
//! ([`preprocess`]) → backbone logits → sigmoid (multi-label heads, as WD14's) or softmax
//! (single-label classifiers), or nothing for graphs that output probabilities (WD14 ONNX) →
//! per-category thresholds: general tags at `image.general_threshold`, character tags at
//! `image.character_threshold` (or either by MCut, [`mcut_threshold`]), and the single most
//! likely rating tag.
//!
//! # Backbones
//! The network is a [`Backbone`]. Implemented: torchvision [`MobileNetV2`] (the ImageNet
//! classifier `cargo xtask setup` converts into `assets/mobilenet_v2`, with the 1000 ImageNet
//! class names written as a `selected_tags.csv` of category 0, so the WD14 code path is what
//! runs), and, with the crate feature `onnx` (default), SmilingWolf's WD14 taggers as the Hugging
//! Face repos ship them (`model.onnx` + `selected_tags.csv`, v2 and v3 layouts) through ONNX
//! Runtime ([`onnx`]). Their timm safetensors checkpoints are not implemented: adding one means a
//! type implementing [`Backbone`] (names as in the timm checkpoint, [`Preprocess::Wd14`] at 448,
//! `multi_label() == true`), a variant of [`crate::config::Architecture`], and a branch in
//! [`load_backbone`] that recognises its tensor names.

pub mod labels;
pub mod mobilenet_v2;
#[cfg(feature = "onnx")]
pub mod onnx;
pub mod preprocess;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use tch::{Device, Kind, Tensor};

use crate::batch::{AdaptiveBatcher, BatchCallback, ResourceSnapshot, start_micro_batch};
use crate::config::{Architecture, Head, ImageSettings, PreprocessKind, TaggerConfig};
use crate::error::{Error, Result};
use crate::{ItemResult, ScoredTag, TagCategory, Tagger};

pub use labels::{Labels, read_selected_tags};
pub use mobilenet_v2::MobileNetV2;
pub use preprocess::{Layout, Preprocess};

/// An image network: preprocessed pixels in, one logit per label out.
pub trait Backbone: Send {
    /// Architecture name used in the model id (`"mobilenet_v2"`).
    fn name(&self) -> &str;
    /// The preprocessing the weights were trained with.
    fn default_preprocess(&self) -> Preprocess;
    /// The input layout [`Backbone::forward`] takes.
    fn layout(&self) -> Layout;
    /// True for multi-label heads (sigmoid, WD14), false for single-label classifiers (softmax).
    fn multi_label(&self) -> bool;
    /// Where the network runs when not on libtorch (`"ONNX Runtime CPUExecutionProvider"`);
    /// `None` (the default) for libtorch backbones, which run on the tagger's device.
    fn runs_on(&self) -> Option<String> {
        None
    }
    /// True when [`Backbone::forward`] already returns probabilities (the WD14 ONNX exports end
    /// in a sigmoid): `image.head: auto` then applies no activation. Default false (logits).
    fn outputs_probabilities(&self) -> bool {
        false
    }
    /// Number of outputs.
    fn num_labels(&self) -> usize;
    /// Logits.
    ///
    /// # Shapes
    /// `x`: `[n, 3, h, w]` or `[n, h, w, 3]` per [`Backbone::layout`], f32 → `[n, labels]` f32.
    ///
    /// # Errors
    /// A libtorch error (out-of-memory included).
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    /// Estimated peak activation bytes for one image at `size`×`size`, elements of
    /// `elem_bytes` bytes (used for the first micro-batch, [`crate::batch::start_micro_batch`]).
    fn activation_bytes_per_item(&self, size: u32, elem_bytes: u64) -> u64;
    /// Bytes of the model's weights as loaded (for the batch plan's weights term).
    fn weight_bytes(&self) -> u64;
}

/// Loads the backbone in `dir/model.safetensors`.
///
/// # Errors
/// [`Error::Io`] when the file is missing (with a hint to run `cargo xtask setup` for the default
/// model); [`Error::Format`] when its tensor names match no implemented architecture.
pub fn load_backbone(
    dir: &Path,
    arch: Architecture,
    device: Device,
    kind: Kind,
) -> Result<Box<dyn Backbone>> {
    let file = dir.join("model.safetensors");
    if !file.exists() {
        let onnx = dir.join("model.onnx");
        let msg = if onnx.exists() {
            if cfg!(feature = "onnx") {
                format!(
                    "{} holds an ONNX model: load it with ImageTagger::from_config or \
                     image::onnx::OnnxBackbone::load",
                    dir.display()
                )
            } else {
                format!(
                    "{} holds an ONNX model; build lora-tagger with its `onnx` feature to run it",
                    dir.display()
                )
            }
        } else {
            "no model.safetensors here; for the default MobileNetV2 run `cargo xtask setup`, \
             or set image.model / --model to a folder with model.safetensors + selected_tags.csv"
                .to_string()
        };
        return Err(Error::Io {
            path: file,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, msg),
        });
    }
    let arch = match arch {
        Architecture::Auto => {
            let names = MobileNetV2::tensor_names(&file)?;
            if mobilenet_v2::looks_like_mobilenet_v2(&names) {
                Architecture::MobilenetV2
            } else {
                let sample: Vec<&str> = names.iter().take(5).map(|s| s.as_str()).collect();
                return Err(Error::Format {
                    path: file,
                    msg: format!(
                        "unrecognised architecture (tensors {sample:?}…); implemented: \
                         torchvision MobileNetV2 (features.N…, classifier.1). WD14 ConvNeXt/ViT/SwinV2 \
                         backbones are not implemented yet"
                    ),
                });
            }
        }
        a => a,
    };
    match arch {
        Architecture::MobilenetV2 | Architecture::Auto => {
            Ok(Box::new(MobileNetV2::load(&file, device, kind)?))
        }
        Architecture::Onnx => Err(Error::Config {
            key: "image.architecture".into(),
            value: "onnx".into(),
            hint: format!(
                "{} has model.safetensors; `onnx` needs a model.onnx (or use `auto`)",
                dir.display()
            ),
        }),
    }
}

/// True when `dir` is to be run as an ONNX model: `architecture: onnx`, or `auto` with a
/// `model.onnx` and no `model.safetensors`.
fn is_onnx_model(dir: &Path, arch: Architecture) -> bool {
    match arch {
        Architecture::Onnx => true,
        Architecture::Auto => {
            !dir.join("model.safetensors").exists() && dir.join("model.onnx").exists()
        }
        Architecture::MobilenetV2 => false,
    }
}

/// Opens an ONNX model with the config's runtime, device and threads.
#[cfg(feature = "onnx")]
fn load_onnx(file: &Path, config: &TaggerConfig) -> Result<Box<dyn Backbone>> {
    let auto = config
        .model_settings
        .device
        .trim()
        .eq_ignore_ascii_case("auto");
    let device = if auto {
        None
    } else {
        Some(config.model_settings.resolve_device()?)
    };
    let options = onnx::OnnxOptions {
        runtime: config.image.onnxruntime.clone(),
        device,
        threads: None,
    };
    Ok(Box::new(onnx::OnnxBackbone::load(file, &options)?))
}

/// Without the `onnx` feature: an error that says how to get it.
#[cfg(not(feature = "onnx"))]
fn load_onnx(file: &Path, _config: &TaggerConfig) -> Result<Box<dyn Backbone>> {
    Err(Error::Config {
        key: "image.model".into(),
        value: file.display().to_string(),
        hint: "an ONNX model needs lora-tagger's `onnx` feature (on by default); rebuild with it"
            .into(),
    })
}

/// MCut (maximum cut) thresholding: the midpoint of the largest gap between consecutive
/// probabilities sorted high to low (Largeron, Moulin & Géry 2012, "MCut: A Thresholding
/// Strategy for Multi-label Classification"; `mcut_threshold` of SmilingWolf's `wd-tagger`
/// `app.py`, which computes it in float64 as here). The first largest gap wins ties. `None` for
/// fewer than two probabilities. Tags are then kept when strictly above it.
///
/// ```
/// use lora_tagger::image::mcut_threshold;
/// // sorted: 0.9, 0.8, 0.3, 0.2: the largest gap is 0.8 → 0.3, cut at 0.55
/// let t = mcut_threshold(&[0.2, 0.9, 0.3, 0.8]).unwrap();
/// assert!((t - 0.55).abs() < 1e-7);
/// assert_eq!(mcut_threshold(&[0.5]), None);
/// ```
pub fn mcut_threshold(probs: &[f32]) -> Option<f64> {
    if probs.len() < 2 {
        return None;
    }
    let mut p: Vec<f64> = probs.iter().map(|&x| x as f64).collect();
    p.sort_by(|a, b| b.partial_cmp(a).unwrap_or(std::cmp::Ordering::Equal));
    let mut best = 0;
    let mut best_gap = f64::NEG_INFINITY;
    for i in 0..p.len() - 1 {
        let gap = p[i] - p[i + 1];
        if gap > best_gap {
            best_gap = gap;
            best = i;
        }
    }
    Some((p[best] + p[best + 1]) / 2.0)
}

/// A category's threshold for one image.
#[derive(Debug, Clone, Copy)]
enum Cut {
    /// A fixed threshold: kept at or above it (kohya).
    AtLeast(f32),
    /// An MCut threshold: kept strictly above it, compared in float64 (the reference app).
    Above(f64),
}

impl Cut {
    fn keeps(self, p: f32) -> bool {
        match self {
            Cut::AtLeast(t) => p >= t,
            Cut::Above(t) => p as f64 > t,
        }
    }
}

/// What turns a backbone's outputs into probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Activation {
    Sigmoid,
    Softmax,
    /// Outputs are probabilities already.
    Identity,
}

/// Image tagger over a [`Backbone`] and a WD14 label file.
pub struct ImageTagger {
    backbone: Box<dyn Backbone>,
    labels: Labels,
    preprocess: Preprocess,
    activation: Activation,
    settings: ImageSettings,
    device: Device,
    kind: Kind,
    max_batch_size: usize,
    cap: Option<u64>,
    plan_for_free_memory: bool,
    clear_interval: usize,
    model_id: String,
    callback: Option<BatchCallback>,
    last_micro_batch: Option<(usize, usize, u32)>,
}

impl std::fmt::Debug for ImageTagger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageTagger")
            .field("model_id", &self.model_id)
            .field("preprocess", &self.preprocess)
            .field("device", &self.device)
            .finish()
    }
}

impl ImageTagger {
    /// Loads the model folder `config.image.model_dir()` on the configured device and precision.
    ///
    /// A folder with a `model.onnx` and no `model.safetensors` (or `image.architecture: onnx`)
    /// runs through ONNX Runtime ([`onnx`], crate feature `onnx`), in float32, on the CUDA
    /// provider when the device is CUDA (or `auto` with a GPU and `onnxruntime-gpu`); its batches
    /// are staged on the CPU.
    ///
    /// # Errors
    /// [`Error::Config`] for a bad device, an fp16 CPU run, or a precision other than fp32 for an
    /// ONNX model; load errors as [`load_backbone`], [`onnx::OnnxBackbone::load`] and
    /// [`read_selected_tags`]; [`Error::Format`] when the label count differs from the model's
    /// outputs.
    pub fn from_config(config: &TaggerConfig) -> Result<Self> {
        let dir = config.image.model_dir();
        let precision = config.model_settings.precision;
        let onnx = is_onnx_model(&dir, config.image.architecture);
        let (backbone, device, kind, model_file) = if onnx {
            if precision != crate::config::Precision::Fp32 {
                return Err(Error::Config {
                    key: "model_settings.precision".into(),
                    value: format!("{precision:?}").to_lowercase(),
                    hint: "ONNX models run in the precision they were exported in; use fp32".into(),
                });
            }
            let file = dir.join("model.onnx");
            let backbone = load_onnx(&file, config)?;
            (backbone, Device::Cpu, Kind::Float, file)
        } else {
            let device = config.model_settings.resolve_device()?;
            if device == Device::Cpu && precision == crate::config::Precision::Fp16 {
                return Err(Error::Config {
                    key: "model_settings.precision".into(),
                    value: "fp16".into(),
                    hint: "fp16 convolutions are CUDA-only here; use fp32 or bf16 on the CPU"
                        .into(),
                });
            }
            let kind = precision.kind();
            let backbone = load_backbone(&dir, config.image.architecture, device, kind)?;
            (backbone, device, kind, dir.join("model.safetensors"))
        };
        let labels = read_selected_tags(&dir.join("selected_tags.csv"))?;
        if labels.len() != backbone.num_labels() {
            return Err(Error::Format {
                path: dir.join("selected_tags.csv"),
                msg: format!(
                    "{} labels but the model has {} outputs",
                    labels.len(),
                    backbone.num_labels()
                ),
            });
        }
        let default = backbone.default_preprocess();
        let size = config.image.input_size.unwrap_or(default.size());
        let preprocess = match config.image.preprocess {
            PreprocessKind::Auto => match default {
                Preprocess::Wd14 { .. } => Preprocess::Wd14 { size },
                Preprocess::Imagenet { .. } => Preprocess::Imagenet { size },
            },
            PreprocessKind::Wd14 => Preprocess::Wd14 { size },
            PreprocessKind::Imagenet => Preprocess::Imagenet { size },
        };
        let activation = match config.image.head {
            Head::Auto if backbone.outputs_probabilities() => Activation::Identity,
            Head::Auto if backbone.multi_label() => Activation::Sigmoid,
            Head::Auto => Activation::Softmax,
            Head::Sigmoid => Activation::Sigmoid,
            Head::Softmax => Activation::Softmax,
            Head::Probabilities => Activation::Identity,
        };
        let sigmoid = activation != Activation::Softmax;
        let digest = {
            let bytes = std::fs::read(&model_file).map_err(|source| Error::Io {
                path: model_file.clone(),
                source,
            })?;
            hex::encode(Sha256::digest(&bytes))
        };
        let model_id = format!("{}@{}", backbone.name(), &digest[..12]);
        let cap = match device {
            Device::Cuda(_) => config.model_settings.max_memory.cuda.as_ref(),
            _ => config.model_settings.max_memory.cpu.as_ref(),
        }
        .map(|s| s.bytes);
        Ok(ImageTagger {
            backbone,
            labels,
            preprocess,
            activation,
            settings: ImageSettings {
                // Resolved here, so the cache key and the report carry the value in effect.
                general_threshold: Some(config.image.general_threshold_for(sigmoid)),
                ..config.image.clone()
            },
            device,
            kind,
            max_batch_size: config.generation_settings.max_batch_size,
            cap,
            plan_for_free_memory: true,
            clear_interval: config.memory_management.auto_clear_interval,
            model_id,
            callback: None,
            last_micro_batch: None,
        })
    }

    /// The settings that change the tags besides the model (for cache keys).
    pub fn settings(&self) -> &ImageSettings {
        &self.settings
    }

    /// The minimum probability of a general tag in effect: `image.general_threshold`, or the
    /// default for the model's head (0.35 sigmoid / 0.05 softmax).
    pub fn general_threshold(&self) -> f32 {
        self.settings.general_threshold_for(self.multi_label())
    }

    /// True for a multi-label head (sigmoid, or probabilities as they come), false for a
    /// single-label (softmax) classifier.
    pub fn multi_label(&self) -> bool {
        self.activation != Activation::Softmax
    }

    /// The preprocessing in use.
    pub fn preprocess(&self) -> Preprocess {
        self.preprocess
    }

    /// The labels.
    pub fn labels(&self) -> &Labels {
        &self.labels
    }

    /// The device the model's input batches are staged on (the CPU for ONNX models, which
    /// ONNX Runtime places itself: [`ImageTagger::runs_on`]).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Where the model runs, for reports: `libtorch on the CPU`, `libtorch on cuda:0`, or
    /// `ONNX Runtime CUDAExecutionProvider` (with the library's path) for ONNX models.
    pub fn runs_on(&self) -> String {
        self.backbone
            .runs_on()
            .unwrap_or_else(|| match self.device {
                Device::Cuda(i) => format!("libtorch on cuda:{i}"),
                _ => "libtorch on the CPU".to_string(),
            })
    }

    /// When false, the first micro-batch is `generation_settings.max_batch_size` regardless of
    /// free memory (out-of-memory back-off still applies). Default true.
    pub fn set_plan_for_free_memory(&mut self, on: bool) {
        self.plan_for_free_memory = on;
    }

    /// Receives a [`crate::batch::BatchEvent`] per batch (resource snapshot) and per back-off.
    pub fn set_callback(&mut self, cb: Option<BatchCallback>) {
        self.callback = cb;
    }

    /// `(first micro-batch, last micro-batch, halvings)` of the latest [`Tagger::tag_images`] call.
    pub fn last_micro_batch(&self) -> Option<(usize, usize, u32)> {
        self.last_micro_batch
    }

    /// Estimated peak bytes per image: the backbone's activations at the input size
    /// ([`Backbone::activation_bytes_per_item`]) plus the f32 input batch held beside them, plus
    /// 10% for libtorch's convolution workspaces (oneDNN reorders), which the count leaves out.
    /// Measured with the counting allocator (`tests/batch_oom.rs`) for MobileNetV2 at 224², f32:
    /// 11.68 MiB per image; this gives 12.21 MiB.
    pub fn bytes_per_item(&self) -> u64 {
        let elem = match self.kind {
            Kind::Half | Kind::BFloat16 => 2,
            _ => 4,
        };
        let size = self.preprocess.size() as u64;
        let counted = self
            .backbone
            .activation_bytes_per_item(self.preprocess.size(), elem)
            + 3 * size * size * 4;
        counted + counted / 10
    }

    /// The memory of a run of this tagger on `device`, for lora-memory's batch planning: the
    /// backbone's weights as loaded here, the CUDA context and workspaces on a GPU
    /// ([`lora_memory::inference::cuda_fixed_bytes`]; nothing on the CPU), and
    /// [`ImageTagger::bytes_per_item`] per image.
    pub fn memory_on(&self, device: Device) -> lora_memory::inference::InferenceMemory {
        use lora_memory::Bytes;
        lora_memory::inference::InferenceMemory {
            weights: Bytes(self.backbone.weight_bytes()),
            fixed: match device {
                Device::Cuda(_) => lora_memory::inference::cuda_fixed_bytes(),
                _ => Bytes(0),
            },
            per_item: Bytes(self.bytes_per_item()),
        }
    }

    /// [`ImageTagger::memory_on`] the device the tagger runs on.
    pub fn memory(&self) -> lora_memory::inference::InferenceMemory {
        self.memory_on(self.device)
    }

    /// The batch this tagger would run on `device` with `budget` bytes free before loading, at
    /// most `generation_settings.max_batch_size`
    /// ([`lora_memory::inference::batch_for`] of [`ImageTagger::memory_on`]); plan for a card
    /// this machine lacks with `Device::Cuda(0)`.
    pub fn plan_batch(
        &self,
        budget: lora_memory::Bytes,
        device: Device,
    ) -> lora_memory::inference::BatchPlan {
        lora_memory::inference::batch_for(&self.memory_on(device), budget, self.max_batch_size)
    }

    /// Stacks preprocessed images (`[size, size, 3]` HWC each) into the backbone's layout.
    ///
    /// # Shapes
    /// → `[n, 3, size, size]` (NCHW) or `[n, size, size, 3]` (NHWC), f32, on the model's device.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn stack(&self, images: &[Vec<f32>]) -> Result<Tensor> {
        let s = self.preprocess.size() as i64;
        let n = images.len() as i64;
        let flat: Vec<f32> = images.iter().flat_map(|v| v.iter().copied()).collect();
        let t = Tensor::f_from_slice(&flat)?.f_view([n, s, s, 3])?;
        let t = match self.backbone.layout() {
            Layout::Nchw => t.f_permute([0, 3, 1, 2])?.f_contiguous()?,
            Layout::Nhwc => t,
        };
        Ok(t.f_to_device(self.device)?)
    }

    /// Logits of a stacked batch ([`ImageTagger::stack`]): `[n, labels]` f32.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn logits(&self, batch: &Tensor) -> Result<Tensor> {
        self.backbone.forward(batch)
    }

    /// The probabilities of one category, in label order.
    fn category_probs(&self, probs: &[f32], category: TagCategory) -> Vec<f32> {
        probs
            .iter()
            .zip(&self.labels.categories)
            .filter(|(_, c)| **c == category)
            .map(|(&p, _)| p)
            .collect()
    }

    /// Probabilities → tags for one image, by the thresholds (see the module docs), highest first.
    ///
    /// Fixed thresholds keep tags at or above them (kohya); MCut thresholds keep tags strictly
    /// above them, with character tags' cut never below 0.15 (SmilingWolf's `app.py`).
    fn select(&self, probs: &[f32]) -> Vec<ScoredTag> {
        let cut = |mcut: bool, cat: TagCategory, fixed: f32, floor: f64| match mcut
            .then(|| mcut_threshold(&self.category_probs(probs, cat)))
            .flatten()
        {
            Some(t) => Cut::Above(t.max(floor)),
            None => Cut::AtLeast(fixed),
        };
        let general = cut(
            self.settings.general_mcut,
            TagCategory::General,
            self.general_threshold(),
            f64::NEG_INFINITY,
        );
        let character = cut(
            self.settings.character_mcut,
            TagCategory::Character,
            self.settings.character_threshold,
            0.15,
        );
        let mut out = Vec::new();
        let mut best_rating: Option<(usize, f32)> = None;
        for (i, (&p, &cat)) in probs.iter().zip(&self.labels.categories).enumerate() {
            match cat {
                TagCategory::Rating if best_rating.is_none_or(|(_, b)| p > b) => {
                    best_rating = Some((i, p));
                }
                TagCategory::General if general.keeps(p) => out.push((i, p, cat)),
                TagCategory::Character if character.keeps(p) => out.push((i, p, cat)),
                _ => {}
            }
        }
        if let Some((i, p)) = best_rating {
            out.push((i, p, TagCategory::Rating));
        }
        out.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal));
        out.into_iter()
            .map(|(i, p, category)| ScoredTag {
                tag: self.labels.names[i].clone(),
                score: p,
                category,
            })
            .collect()
    }

    /// Tags one chunk: decode each image (a failure fails that item), run the rest as one batch.
    fn run_chunk(&self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        // decode and preprocess on rayon's pool, one image per task (in order)
        use rayon::prelude::*;
        let preprocess = self.preprocess;
        let loaded: Vec<Result<Vec<f32>>> = paths.par_iter().map(|p| preprocess.load(p)).collect();
        let mut results: Vec<Option<ItemResult>> = Vec::with_capacity(paths.len());
        let mut ok_idx = Vec::new();
        let mut pixels = Vec::new();
        for (i, r) in loaded.into_iter().enumerate() {
            match r {
                Ok(px) => {
                    ok_idx.push(i);
                    pixels.push(px);
                    results.push(None);
                }
                Err(e) => results.push(Some(Err(e))),
            }
        }
        if !pixels.is_empty() {
            let probs = {
                let batch = self.stack(&pixels)?;
                drop(pixels);
                let logits = self.logits(&batch)?;
                drop(batch);
                let p = match self.activation {
                    Activation::Sigmoid => logits.f_sigmoid()?,
                    Activation::Softmax => logits.f_softmax(-1, Kind::Float)?,
                    Activation::Identity => logits,
                };
                let p = p
                    .f_to_device(Device::Cpu)?
                    .f_to_kind(Kind::Float)?
                    .f_contiguous()?;
                Vec::<f32>::try_from(&p.f_view([-1])?)?
            };
            if self.activation == Activation::Identity
                && let Some(bad) = probs.iter().find(|p| !(-1e-6..=1.0 + 1e-6).contains(*p))
            {
                return Err(Error::Format {
                    path: PathBuf::from(&self.model_id),
                    msg: format!(
                        "the model output {bad}, not a probability; if it ends in logits, set \
                         image.head: sigmoid"
                    ),
                });
            }
            let l = self.labels.len();
            for (j, &i) in ok_idx.iter().enumerate() {
                results[i] = Some(Ok(self.select(&probs[j * l..(j + 1) * l])));
            }
        }
        Ok(results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Ok(Vec::new())))
            .collect())
    }
}

impl Tagger for ImageTagger {
    /// [`ImageTagger::plan_batch`] on the tagger's device; with no budget, the free memory now
    /// plus the loaded weights.
    fn batch_plan(
        &self,
        _sample: &str,
        budget: Option<lora_memory::Bytes>,
    ) -> Option<lora_memory::inference::BatchPlan> {
        let budget = budget.or_else(|| {
            ResourceSnapshot::take(self.device)
                .free_for(self.device, self.cap)
                .map(|f| lora_memory::Bytes(f + self.memory().weights.0))
        })?;
        Some(self.plan_batch(budget, self.device))
    }

    fn model_id(&self) -> String {
        self.model_id.clone()
    }

    fn tag_images(&mut self, paths: &[PathBuf]) -> Result<Vec<ItemResult>> {
        let free = if self.plan_for_free_memory {
            ResourceSnapshot::take(self.device).free_for(self.device, self.cap)
        } else {
            None
        };
        let start = start_micro_batch(self.max_batch_size, free, Some(self.bytes_per_item()));
        let mut batcher =
            AdaptiveBatcher::new(start, self.device).with_clear_interval(self.clear_interval);
        batcher.set_callback(self.callback.take());
        let model = self.model_id.clone();
        let this = &*self;
        let out = batcher.run(paths, &model, |chunk| this.run_chunk(chunk));
        self.last_micro_batch = Some((start, batcher.micro_batch(), batcher.halvings()));
        self.callback = batcher.take_callback();
        out
    }

    fn tag_descriptions(&mut self, _descriptions: &[String]) -> Result<Vec<ItemResult>> {
        Err(Error::Unsupported {
            tagger: self.model_id.clone(),
            what: "text descriptions (configure an `llm` backend)",
        })
    }
}
