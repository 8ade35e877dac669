//! `estimate()`: the peak memory of a training step, term by term.
//!
//! Peak model (one optimizer step after the first, when optimizer states exist):
//! - **backward peak** = weights + adapters + optimizer states (+ gradients when they persist
//!   across micro-batches) + autocast weight copies + saved activations + the larger of
//!   (loss backward: logits/loss peak) and (last layer backward: kept logits + recomputed layer +
//!   that layer's gradient working set) + batch data;
//! - **optimizer-step peak** = weights + adapters + gradients + optimizer states + step temporaries;
//! - allocated peak = the larger of the two; reserved = allocated + allocator margin;
//!   process = reserved + CUDA context/workspace (CPU: + runtime baseline).
//!
//! Anchors (see `memory-cases/PUBLIC.md`): model states 2 + 2 + 12 = 16 B/param for
//! mixed-precision Adam (ZeRO, arXiv:1910.02054); transformer activations `s·b·h·(34 + 5·a·s/h)`
//! bytes per layer at 16 bit without recompute (Korthikanti et al., arXiv:2205.05198), which we
//! split per saved tensor so each framework's differences are explicit; full recompute keeps the
//! layer input `2·s·b·h` per layer plus one layer live during recompute (same paper, §4); NF4
//! bytes from QLoRA (arXiv:2305.14314); loss over a large vocabulary ≈ `b·s·V·(2+4+4)` bytes and
//! more with the fp32 grad.

use crate::error::{Error, Result};
use crate::model::{
    DecoderDescriptor, DiffusionDescriptor, DiffusionFamily, LinearSite, ModelDescriptor, NormKind,
};
use crate::settings::{
    Attention, BaseDtype, Device, Framework, Method, MixedPrecision, Optimizer, SampleImages,
    Settings,
};
use crate::units::Bytes;
use serde::{Deserialize, Serialize};

mod flux;
pub use flux::{FLUX_SWAP_STAGING_BLOCKS, FluxDetail};

/// Which measured quantity a number predicts. They differ by up to 2× — compare like with like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Metric {
    /// `torch.cuda.max_memory_allocated`: live tensors only.
    Allocated,
    /// `torch.cuda.max_memory_reserved`: tensors + the caching allocator's cache.
    Reserved,
    /// Whole process on the device: `nvidia-smi` (reserved + CUDA context + workspaces) on CUDA,
    /// resident set size on CPU.
    Process,
    /// CPU: peak RSS during training steps minus RSS before them (after load and LoRA injection).
    CpuRssDelta,
    /// Weights + adapters + gradients + optimizer states: allocated right after the optimizer
    /// step, before `zero_grad`.
    Persistent,
}

/// Every term of the peak, in bytes. Each field documents its formula and source.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Breakdown {
    /// Frozen base weights: per-layer linears × [`BaseDtype::bytes_per_param`] + the rest
    /// (embeddings, norms, `lm_head`; VAE and text encoders when resident) in 16 bit, or 32 bit
    /// for an fp32 base (QLoRA keeps non-linear weights 16-bit, arXiv:2305.14314).
    pub base_weights: Bytes,
    /// Autocast over a 32-bit base casts each frozen weight to 16 bit per op and the cast is kept
    /// for the backward of that matmul: 2 B per linear parameter (torch.autocast semantics; seen
    /// on CPU in PUBLIC.md's SmolLM2 table at small batch).
    pub autocast_weight_copies: Bytes,
    /// Adapter parameters: Σ over targeted sites `r·(in·k² + out)` (+ `out` for DoRA's
    /// magnitude) × adapter bytes (fp32 for PEFT/ours, the model dtype for torchtune). Full
    /// fine-tuning: 0 (the weights are the base).
    pub adapter_params: Bytes,
    /// Gradients of the trainable parameters, in their dtype.
    pub gradients: Bytes,
    /// Optimizer states: AdamW 2 × state bytes per trainable param (8 B in fp32; the param dtype
    /// for a full bf16 fine-tune), AdamW8bit 2 B + block absmax, Adafactor `4·(n+m)` per matrix,
    /// SGD-momentum 4 B (ZeRO arXiv:1910.02054 §3; bitsandbytes arXiv:2110.02861; Adafactor
    /// arXiv:1804.04235).
    pub optimizer_states: Bytes,
    /// Temporaries of the optimizer step: `foreach` AdamW builds one state-sized list
    /// (`_foreach_sqrt(exp_avg_sq)`) for all parameters at once (torch.optim.adam
    /// `_multi_tensor_adam`); lora-train's AdamW does the same per chunk of
    /// [`OURS_FOREACH_CHUNK_ELEMENTS`] on CUDA; fused or per-tensor loops (ours on the CPU
    /// included) only the largest tensor.
    pub optimizer_step_temporaries: Bytes,
    /// Saved activations at the backward peak (all layers, or the checkpointed layer inputs plus
    /// the recomputed layer and its gradient working set).
    pub activations: Bytes,
    /// Logits and loss at their peak: HF keeps the 16-bit logits, the fp32 `log_softmax` output
    /// and, in the backward, two fp32 gradients: `b·s·V·(e + 12)` bytes; a loss on 16-bit logits
    /// without autocast ([`crate::settings::Profile::model_dtype_loss`]) `3·e·b·s·V`. lora-train's
    /// fused head + cross-entropy holds one chunk's logits (at most [`OURS_CE_CHUNK_BYTES`] of
    /// fp32) and their fp32 log-softmax, plus `(8 + e)·d` per token.
    pub logits_loss: Bytes,
    /// Token ids, labels, masks (int64) or latents + noise + conditioning for diffusion.
    pub batch_data: Bytes,
    /// Buffers a framework or kernel sets aside: a GPTQ base's ExLlama scratch
    /// ([`crate::settings::GptqKernel`]), and during the backward pass DeepSpeed's gradient
    /// buckets ([`crate::settings::DeepSpeedZero`]).
    #[serde(default)]
    pub framework_buffers: Bytes,
    /// Data-parallel runs ([`Settings::world_size`] > 1): the flattened gradient buffer of the
    /// all-reduce, alive between the backward pass and the optimizer step — every trainable
    /// gradient cast to fp32 into one contiguous buffer plus a 4-byte skip vote, `4·(trainable
    /// + 1)` bytes (lora-core's `ProcessGroup::average_gradients`; Gloo reduces it in place).
    /// Counted here when that moment is the peak. NCCL's own buffers (its communicator's
    /// channels, allocated outside PyTorch's caching allocator) are not counted.
    #[serde(default)]
    pub communication_buffers: Bytes,
    /// Diffusion with [`crate::settings::Settings::sample_images`], when drawing them is the
    /// peak: the frozen text encoders and VAE loaded back onto the device (when the run moved
    /// them off), the UNet's activations without gradients for one prompt (batch 2 with
    /// guidance: every skip connection of the down path held for the up path, plus the largest
    /// block's working tensors), or one image's VAE decode (the larger of the two: they run one
    /// after the other), and the finished images. Counted only at that moment; the training
    /// step's activations are gone by then.
    #[serde(default)]
    pub sample_images: Bytes,
    /// Image jobs on the CPU ([`crate::settings::Settings::kept_data`]): the latents,
    /// text-encoder outputs and fixed evaluation samples the data source keeps for the whole
    /// run, alive at every moment (lora-train's `ImageSource` and the before/after loss's
    /// batches). 0 on CUDA (host memory) and for language models.
    #[serde(default)]
    pub kept_data: Bytes,
    /// CUDA context and cuBLAS/cuDNN workspaces (CPU: runtime baseline).
    pub context_workspace: Bytes,
    /// Caching-allocator cache above the live tensors (reserved − allocated).
    pub allocator_margin: Bytes,
}

/// One printable row of a [`Breakdown`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Term {
    /// Term name.
    pub name: &'static str,
    /// Bytes.
    pub bytes: Bytes,
    /// Formula in words.
    pub formula: &'static str,
}

impl Breakdown {
    /// The terms in a fixed order, with their formulas.
    pub fn terms(&self) -> Vec<Term> {
        vec![
            Term {
                name: "base weights",
                bytes: self.base_weights,
                formula: "linears × B/param(dtype) + embeddings, head, norms in their own dtypes",
            },
            Term {
                name: "autocast weight copies",
                bytes: self.autocast_weight_copies,
                formula: "2 B × linear params (32-bit base under autocast)",
            },
            Term {
                name: "adapter params",
                bytes: self.adapter_params,
                formula: "Σ r·(in·k²+out) × adapter bytes",
            },
            Term {
                name: "gradients",
                bytes: self.gradients,
                formula: "trainable × grad bytes",
            },
            Term {
                name: "optimizer states",
                bytes: self.optimizer_states,
                formula: "AdamW 8 B / 8-bit 2 B / Adafactor 4(n+m) / SGD 4 B",
            },
            Term {
                name: "optimizer step temporaries",
                bytes: self.optimizer_step_temporaries,
                formula: "foreach: one state-sized list (ours: ≤ 4 Mi elements)",
            },
            Term {
                name: "activations",
                bytes: self.activations,
                formula: "Σ saved tensors per layer × b·s (Korthikanti split)",
            },
            Term {
                name: "logits / loss",
                bytes: self.logits_loss,
                formula: "b·s·V·(kept logits + fp32 log-softmax + 2 fp32 grads)",
            },
            Term {
                name: "batch data",
                bytes: self.batch_data,
                formula: "ids/labels/mask int64",
            },
            Term {
                name: "framework buffers",
                bytes: self.framework_buffers,
                formula: "GPTQ ExLlama scratch; DeepSpeed gradient buckets",
            },
            Term {
                name: "communication buffers",
                bytes: self.communication_buffers,
                formula: "data-parallel: 4 B × (trainable + 1), flat fp32 all-reduce buffer",
            },
            Term {
                name: "sample images",
                bytes: self.sample_images,
                formula: "frozen models back + max(UNet / transformer no-grad, one prompt; one image's decode)",
            },
            Term {
                name: "kept data",
                bytes: self.kept_data,
                formula: "CPU image jobs: cached latents + text-encoder outputs + evaluation samples",
            },
            Term {
                name: "context / workspace",
                bytes: self.context_workspace,
                formula: "CUDA context + cuBLAS workspace",
            },
            Term {
                name: "allocator margin",
                bytes: self.allocator_margin,
                formula: "caching allocator: block rounding + cache of transients",
            },
        ]
    }
}

/// RSS that a CPU run's training steps add outside tensors, part of [`Estimate::step_delta`]:
/// the BLAS libraries' packing and scratch buffers (MKL's, oneDNN's) and heap blocks below
/// glibc's mmap threshold. Measured on the README demo (SmolLM2-135M, fp32, batch 4 × 256):
/// the step RSS delta 10–18 MB above the tensors' growth, with MKL's or oneDNN's f32 GEMM;
/// planned at 32 MiB.
pub const CPU_STEP_RUNTIME: Bytes = Bytes(32 << 20);

/// The result of [`estimate`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// Model name.
    pub model: String,
    /// The terms.
    pub breakdown: Breakdown,
    /// Trainable parameters.
    pub trainable_params: u64,
    /// Predicted `max_memory_allocated` (CUDA) / peak live tensor bytes (CPU).
    pub peak_allocated: Bytes,
    /// Predicted `max_memory_reserved` (allocated + allocator margin).
    pub peak_reserved: Bytes,
    /// Predicted whole-process peak on the device (`nvidia-smi` / CPU RSS).
    pub peak_process: Bytes,
    /// CPU: predicted peak RSS over the training steps minus RSS before them: the allocated
    /// peak less the weights and adapters loaded before, plus [`CPU_STEP_RUNTIME`].
    pub step_delta: Bytes,
    /// Weights + adapters + gradients + optimizer states (+ an image job's kept data on the
    /// CPU): what is allocated right after `optimizer.step()`, before `zero_grad`.
    pub persistent: Bytes,
    /// The number to compare with a budget: `peak_process`.
    pub peak: Bytes,
    /// What `peak` predicts ([`Metric::Process`]).
    pub metric: Metric,
    /// Assumptions worth telling the user.
    pub notes: Vec<String>,
    /// The device the estimate is for (its context/runtime baseline included).
    pub device: Device,
    /// Stable Diffusion models: the per-component split and the shapes (absent for decoders).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diffusion: Option<DiffusionDetail>,
    /// FLUX models: weights on the device and on the host, token counts, the caching phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flux: Option<FluxDetail>,
}

impl Estimate {
    /// The prediction for a metric.
    pub fn value(&self, metric: Metric) -> Bytes {
        match metric {
            Metric::Allocated => self.peak_allocated,
            Metric::Reserved => self.peak_reserved,
            Metric::Process => self.peak_process,
            Metric::CpuRssDelta => self.step_delta,
            Metric::Persistent => self.persistent,
        }
    }

    /// An aligned text table: one row per term (the `sample images` row only when it is the
    /// peak: a run without sample images never has it; the `kept data` row only when there is
    /// some), then allocated / reserved / process totals.
    pub fn to_table(&self) -> String {
        let mut rows: Vec<(String, String, String, String)> = self
            .breakdown
            .terms()
            .into_iter()
            .filter(|t| !matches!(t.name, "sample images" | "kept data") || t.bytes.0 > 0)
            .map(|t| {
                (
                    t.name.to_string(),
                    format!("{:.3}", t.bytes.gb()),
                    format!("{:.3}", t.bytes.gib()),
                    match (self.device.is_cuda(), t.name) {
                        (false, "context / workspace") => {
                            "CPU runtime: libtorch, heap, threads".to_string()
                        }
                        (false, "allocator margin") => {
                            "none on CPU (no cache beyond the live peak)".to_string()
                        }
                        _ => t.formula.to_string(),
                    },
                )
            })
            .collect();
        rows.push(("─".repeat(3), String::new(), String::new(), String::new()));
        let cuda = self.device.is_cuda();
        for (name, b, what) in [
            (
                "peak allocated",
                self.peak_allocated,
                if cuda {
                    "max_memory_allocated"
                } else {
                    "peak live tensor bytes"
                },
            ),
            (
                "peak reserved",
                self.peak_reserved,
                if cuda {
                    "max_memory_reserved"
                } else {
                    "= allocated on CPU"
                },
            ),
            (
                "total (process peak)",
                self.peak_process,
                if cuda {
                    "nvidia-smi"
                } else {
                    "process peak RSS"
                },
            ),
        ] {
            rows.push((
                name.to_string(),
                format!("{:.3}", b.gb()),
                format!("{:.3}", b.gib()),
                what.to_string(),
            ));
        }
        let w0 = rows
            .iter()
            .map(|r| r.0.chars().count())
            .max()
            .unwrap_or(0)
            .max(4);
        let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0).max(2);
        let w2 = rows.iter().map(|r| r.2.len()).max().unwrap_or(0).max(3);
        let mut out = format!(
            "{}  (trainable params: {})\n",
            self.model, self.trainable_params
        );
        out += &format!(
            "{:<w0$}  {:>w1$}  {:>w2$}  {}\n",
            "term", "GB", "GiB", "formula"
        );
        for r in rows {
            out += &format!("{:<w0$}  {:>w1$}  {:>w2$}  {}\n", r.0, r.1, r.2, r.3);
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        out
    }

    /// The estimate as pretty JSON (what `plan --json` prints).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

/// Reserved − allocated as a fraction of the step's transient bytes (activations, logits) with
/// fixed-shape batches. PyTorch's caching allocator rounds requests (512 B small, 2 MiB segments
/// for large) and keeps freed blocks; with a fixed shape every step reuses the same blocks.
pub const ALLOCATOR_FRAGMENTATION_FIXED: f64 = 0.05;
/// The same with batches padded to varying lengths: freed blocks sized for one length are split
/// for another and stay cached (PyTorch CUDA semantics notes, "Memory management";
/// `expandable_segments` unset).
pub const ALLOCATOR_FRAGMENTATION_VARIABLE: f64 = 0.10;

struct Ctx {
    /// bytes of matmul outputs / saved activations
    e: f64,
    /// bytes of the residual stream and norm inputs
    r: f64,
    /// adapter / trainable dtype bytes
    ad: f64,
    autocast: bool,
}

fn ctx(s: &Settings) -> Ctx {
    let base32 = s.computes_in_f32();
    let (e, r, autocast) = match s.mixed_precision {
        MixedPrecision::No => {
            if base32 {
                (4.0, 4.0, false)
            } else {
                (2.0, 2.0, false)
            }
        }
        MixedPrecision::Fp16 | MixedPrecision::Bf16 => (2.0, if base32 { 4.0 } else { 2.0 }, true),
        MixedPrecision::FullBf16 | MixedPrecision::FullFp16 => (2.0, 2.0, false),
    };
    let ad = match (s.profile.framework, s.mixed_precision) {
        (_, MixedPrecision::FullBf16 | MixedPrecision::FullFp16) => 2.0,
        (Framework::Torchtune, _) => r,
        _ => 4.0,
    };
    Ctx { e, r, ad, autocast }
}

fn validate(s: &Settings) -> Result<()> {
    let bad = |key: &'static str, reason: &str| {
        Err(Error::InvalidSetting {
            key,
            reason: reason.into(),
        })
    };
    if s.micro_batch == 0 {
        return bad("micro_batch", "must be at least 1");
    }
    if s.gradient_accumulation_steps == 0 {
        return bad("gradient_accumulation_steps", "must be at least 1");
    }
    if s.world_size == 0 {
        return bad("world_size", "must be at least 1 (one process)");
    }
    if s.seq_len == 0 {
        return bad("seq_len", "must be at least 1 token");
    }
    if s.resolution < 8 || s.largest_bucket.is_some_and(|[w, h]| w < 8 || h < 8) {
        return bad(
            "resolution",
            "must be at least 8 pixels (one latent pixel) on each side",
        );
    }
    if s.method != Method::Full && s.lora.rank == 0 {
        return bad("lora.rank", "must be at least 1");
    }
    if !(0.0..1.0).contains(&s.lora.dropout) {
        return bad("lora.dropout", "must be in [0, 1)");
    }
    if let Optimizer::Sgd { momentum } = s.optimizer
        && !(momentum >= 0.0 && momentum.is_finite())
    {
        return bad("optimizer.momentum", "must be a finite non-negative number");
    }
    if let BaseDtype::Gptq4 { group_size: 0 } = s.base_dtype {
        return bad(
            "base_dtype",
            "GPTQ group_size must be at least 1 (128 is the usual one)",
        );
    }
    if s.mixed_precision == MixedPrecision::FullFp16 && !s.device.is_cuda() {
        return bad(
            "mixed_precision",
            "full_fp16 runs on CUDA only; on the CPU use full_bf16 or bf16",
        );
    }
    if let Some(z) = s.profile.deepspeed {
        if s.profile.framework != Framework::PeftTransformers {
            return bad(
                "profile.deepspeed",
                "DeepSpeed is modelled under the HF Trainer (Profile::peft_transformers()); this SDK's trainer and torchtune do not use it",
            );
        }
        if z.reduce_bucket_size == 0 {
            return bad(
                "profile.deepspeed.reduce_bucket_size",
                "must be at least 1 element (DeepSpeed's default is 500000000)",
            );
        }
        if !s.mixed_precision.is_full_16bit() {
            return bad(
                "profile.deepspeed",
                "DeepSpeed's engine runs the model in fp16 or bf16 without autocast: set mixed_precision to full_fp16 or full_bf16",
            );
        }
        if !s.device.is_cuda() {
            return bad(
                "profile.deepspeed",
                "DeepSpeed ZeRO is modelled on CUDA only",
            );
        }
        if s.optimizer != Optimizer::AdamW {
            return bad(
                "profile.deepspeed",
                "only DeepSpeed's fused AdamW is modelled; use optimizer adamw",
            );
        }
    }
    Ok(())
}

/// Trainable tensor shapes (as (rows, cols) matrices) for optimizer-state formulas.
struct Trainable {
    params: u64,
    /// Σ (n + m) over matrices, for Adafactor.
    factored: u64,
    /// params of tensors with fewer than 4096 elements (kept 32-bit by 8-bit Adam).
    small: u64,
    /// largest single tensor
    largest: u64,
}

fn lora_trainable(sites: &[&LinearSite], s: &Settings) -> Trainable {
    let mut t = Trainable {
        params: 0,
        factored: 0,
        small: 0,
        largest: 0,
    };
    for site in sites {
        let rank = u64::from(if site.conv {
            s.lora.conv_rank.unwrap_or(0)
        } else {
            s.lora.rank
        });
        let a = rank * site.in_features * site.kernel_area;
        let b = rank * site.out_features;
        for (n, rows, cols) in [
            (a, rank, site.in_features * site.kernel_area),
            (b, site.out_features, rank),
        ] {
            t.params += n * site.count;
            t.factored += (rows + cols) * site.count;
            if n < 4096 {
                t.small += n * site.count;
            }
            t.largest = t.largest.max(n);
        }
        if s.method == Method::Dora {
            t.params += site.out_features * site.count;
            t.factored += site.out_features * site.count;
            t.small += if site.out_features < 4096 {
                site.out_features * site.count
            } else {
                0
            };
        }
    }
    t
}

/// A full fine-tune of an image model: `params` trainable in the base's 16-bit dtype (32 bit for
/// an fp32 base), Adafactor's factored sizes from the `usable` sites, `largest` the biggest
/// tensor. Returns `(trainable, adapter bytes = 0, gradient bytes, state bytes)` per parameter.
fn full_trainable(
    s: &Settings,
    usable: &[LinearSite],
    params: u64,
    largest: u64,
) -> (Trainable, f64, f64, f64) {
    let t = Trainable {
        params,
        factored: usable
            .iter()
            .map(|x| (x.in_features * x.kernel_area + x.out_features) * x.count)
            .sum(),
        small: 0,
        largest,
    };
    let pb = if s.base_dtype == BaseDtype::F32 {
        4.0
    } else {
        2.0
    };
    (t, 0.0, pb, pb)
}

/// LoRA on `sites`: `(trainable, adapter bytes, gradient bytes, state bytes)` (adapters, their
/// gradients in the adapter dtype, optimizer states at least 32-bit).
fn lora_state(c: &Ctx, s: &Settings, sites: &[&LinearSite]) -> (Trainable, f64, f64, f64) {
    let t = lora_trainable(sites, s);
    let ab = t.params as f64 * c.ad;
    (t, ab, c.ad, c.ad.max(4.0))
}

/// `(elements, count)` of each trainable LoRA tensor (A, B, DoRA magnitude) of the sites.
fn trainable_tensors(sites: &[&LinearSite], s: &Settings) -> Vec<(u64, u64)> {
    let mut v = Vec::new();
    for site in sites {
        let rank = u64::from(if site.conv {
            s.lora.conv_rank.unwrap_or(0)
        } else {
            s.lora.rank
        });
        v.push((rank * site.in_features * site.kernel_area, site.count));
        v.push((rank * site.out_features, site.count));
        if s.method == Method::Dora {
            v.push((site.out_features, site.count));
        }
    }
    v
}

fn targeted<'a>(sites: &'a [LinearSite], s: &Settings) -> Vec<&'a LinearSite> {
    sites
        .iter()
        .filter(|site| {
            if site.conv {
                s.lora.conv_rank.is_some()
            } else {
                s.lora.target_modules.iter().any(|t| site.matches(t))
            }
        })
        .collect()
}

/// Most elements per multi-tensor AdamW call in lora-train's optimizer: each call's temporary
/// denominators (`_foreach_sqrt(exp_avg_sq)`) then stay under `(4 Mi + largest tensor)` fp32
/// elements, about 16 MiB, whatever the adapter's size.
pub const OURS_FOREACH_CHUNK_ELEMENTS: u64 = 4 << 20;

/// Largest peak [`estimate`] answers with a number: 2^60 bytes (1 EiB); above it, an error.
pub const MAX_ESTIMATE_BYTES: u64 = 1 << 60;

/// Weights of a quantized linear decoded at once by lora-core's tiled linears
/// (`lora_core::sys::QLINEAR_TILE_ELEMENTS`; the CPU kernel and the tensor-op path of CUDA,
/// f16 and f64 alike): all of a weight this SDK's quantized linears hold dense at once — they
/// keep no dense weight for the backward pass. On the CPU kernel the tile's buffers are the
/// calling thread's, kept from call to call; elsewhere each tile is a transient.
pub const OURS_QLINEAR_TILE_ELEMENTS: u64 = 1 << 20;

/// Bytes per weight that lora-core's tensor-op decode of a `base`-quantized weight
/// (`QuantWeight::dequantize`, what its tiled linears use off the CPU kernel: CUDA, f16, f64)
/// holds at its peak, the result of `e` bytes per value included; 0 for a dense base.
///
/// Measured with the shim's counting CPU allocator (exact tensor bytes): peak − live bytes
/// around `dequantize` of a `[1536, 1024]` weight, divided by its 1,572,864 weights
/// (`lora-core/tests/qlinear_memory.rs`, which checks these values against the measurement for
/// every kind and f16, bf16, f32 and f64 results). Measured (f16 / bf16 / f32): Q8_0, Q4_0
/// 4.06 / 4.06 / 8.13; Q4_1 4.00 / 8.25 / 8.25 (bf16 goes through f32); NF4 4.03 / 4.03 / 8.00,
/// with double quantization 4.09 / 4.09 / 8.06; fp8 2 / 2 / 4; the 5- and 6-bit kinds compute in
/// f32 whatever the result (their products need up to 25 bits): Q5_0 20.13, Q5_1 16.25, Q4_K
/// 12.52, Q5_K 14.02, Q6_K 16.02. The ops run the same on CUDA (same dtypes, same
/// temporaries), so the factors carry over; `e` = 2 stands for bf16 (Q4_1's larger case).
pub fn ours_dequant_bytes_per_weight(base: BaseDtype, e: f64) -> f64 {
    match base {
        BaseDtype::F32 | BaseDtype::F16 | BaseDtype::Bf16 => 0.0,
        // f32 codes, high bits and block scales beside the scaled values
        BaseDtype::Q5_0 => 20.25,
        BaseDtype::Q5_1 | BaseDtype::Q6K => 16.5,
        BaseDtype::Q5K => 14.25,
        BaseDtype::Q4K => 12.75,
        // bf16 through f32: the f32 values and the bf16 result
        BaseDtype::Q4_1 => (2.0 * e + 0.25).max(8.25),
        // a single cast
        BaseDtype::Fp8 => e,
        // the looked-up (or cast) values and the scaled result, plus the scales in `e`
        BaseDtype::Q8_0 | BaseDtype::Q4_0 | BaseDtype::Nf4 { .. } | BaseDtype::Gptq4 { .. } => {
            2.0 * e + 0.25
        }
    }
}

/// Bytes of the pair table lora-core keeps per quantized weight tensor whose codes are packed
/// two to a byte or decoded through one (`QuantWeight`'s `[256, 2]` f32 lookup table: every byte
/// to its high and low values).
pub const OURS_PAIR_TABLE_BYTES: f64 = 2048.0;

/// Whether lora-core keeps an [`OURS_PAIR_TABLE_BYTES`] table per tensor of `base`: NF4 and the
/// GGUF formats other than Q8_0 (whose codes are whole bytes).
fn has_pair_table(base: BaseDtype) -> bool {
    matches!(base, BaseDtype::Nf4 { .. }) || (base.is_gguf() && base != BaseDtype::Q8_0)
}

/// Bytes of fp32 logits per chunk of lora-train's fused LM head + cross-entropy
/// (`lora_models::llama::Llama::loss`): 32 MiB, at least 16 rows.
pub const OURS_CE_CHUNK_BYTES: u64 = 32 << 20;

/// Temporaries of the optimizer step. PEFT's `torch.optim.AdamW` on CUDA (foreach) builds one
/// state-sized list; our AdamW runs the same ops in chunks of [`OURS_FOREACH_CHUNK_ELEMENTS`] on
/// CUDA, and one fused pass per tensor on the CPU (no temporary); fused or per-tensor steps
/// (other optimizers, CPU PyTorch) hold one tensor's worth, counted for ours on the CPU too.
fn step_temporaries(t: &Trainable, s: &Settings, foreach_tmp: f64, state_bytes: f64) -> f64 {
    let per_tensor = t.largest as f64 * state_bytes;
    if s.optimizer != Optimizer::AdamW || s.profile.fused_adamw {
        return per_tensor;
    }
    if s.profile.framework == Framework::Ours {
        if !s.device.is_cuda() {
            return per_tensor;
        }
        let chunk = t.params.min(OURS_FOREACH_CHUNK_ELEMENTS + t.largest);
        return (chunk as f64 * state_bytes).max(per_tensor);
    }
    if s.device.is_cuda() {
        foreach_tmp
    } else {
        per_tensor
    }
}

fn optimizer_bytes(t: &Trainable, opt: Optimizer, state_bytes: f64) -> (f64, f64) {
    // (states, foreach temporaries per state-sized list)
    let p = t.params as f64;
    match opt {
        Optimizer::AdamW => (2.0 * state_bytes * p, state_bytes * p),
        Optimizer::AdamW8bit => {
            let big = (t.params - t.small) as f64;
            (
                2.0 * (big * (1.0 + 4.0 / 2048.0)) + 8.0 * t.small as f64,
                4.0 * t.largest as f64,
            )
        }
        Optimizer::Adafactor => (4.0 * t.factored as f64, 4.0 * t.largest as f64),
        Optimizer::Sgd { momentum } => (if momentum > 0.0 { 4.0 * p } else { 0.0 }, 0.0),
    }
}

/// Estimates the peak memory of one training step of `model` under `settings`.
///
/// # Errors
/// [`Error::InvalidSetting`] for a zero batch / rank, a dropout outside `[0, 1)`, no target
/// module matching the model (listing the site names that exist), or text-encoder training with
/// cached text-encoder outputs.
///
/// ```
/// use lora_memory::{estimate, ModelDescriptor, Settings};
/// let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
/// let e = estimate(&m, &Settings::default().with_seq_len(1024)).unwrap();
/// assert!(e.peak_allocated > e.breakdown.base_weights);
/// println!("{}", e.to_table());
/// ```
pub fn estimate(model: &ModelDescriptor, settings: &Settings) -> Result<Estimate> {
    validate(settings)?;
    // Full 16-bit modes cast a 32-bit base to their dtype before training.
    let cast;
    let settings =
        if settings.mixed_precision.is_full_16bit() && settings.base_dtype == BaseDtype::F32 {
            cast = Settings {
                base_dtype: if settings.mixed_precision == MixedPrecision::FullFp16 {
                    BaseDtype::F16
                } else {
                    BaseDtype::Bf16
                },
                ..settings.clone()
            };
            &cast
        } else {
            settings
        };
    let e = match model {
        ModelDescriptor::Decoder(d) => estimate_decoder(d, settings),
        ModelDescriptor::Diffusion(d) => estimate_diffusion(d, settings),
        ModelDescriptor::Flux(d) => flux::estimate_flux(d, settings),
    }?;
    // Beyond any machine (and beyond what the byte counts hold exactly): an error, never a
    // saturated number a huge budget could call "fits".
    if e.peak_process.0 >= MAX_ESTIMATE_BYTES {
        return Err(Error::InvalidSetting {
            key: "settings",
            reason: format!(
                "the run would need more than {} bytes (seq_len {}, micro_batch {}): lower them",
                MAX_ESTIMATE_BYTES, settings.seq_len, settings.micro_batch
            ),
        });
    }
    Ok(e)
}

fn no_target_error(sites: &[LinearSite], s: &Settings) -> Error {
    let mut names: Vec<&str> = Vec::new();
    for x in sites {
        if !names.contains(&x.name.as_str()) {
            names.push(x.name.as_str());
        }
    }
    Error::InvalidSetting {
        key: "lora.target_modules",
        reason: format!(
            "{:?} matches no layer; layers are: {}",
            s.lora.target_modules,
            names.join(", ")
        ),
    }
}

/// Bytes per value of what attention computes in and keeps (q, k, v, out, the additive mask):
/// the compute dtype, except ours on the CPU, whose training forward computes bf16 attention
/// in f32 (lora-models' llama `attention_kind`: libtorch's CPU kernel runs its bf16 backward at
/// about half its f32 speed).
fn attention_bytes(s: &Settings, c: &Ctx) -> f64 {
    let f16 = matches!(
        s.mixed_precision,
        MixedPrecision::Fp16 | MixedPrecision::FullFp16
    ) || (s.mixed_precision == MixedPrecision::No && s.base_dtype == BaseDtype::F16);
    if s.profile.framework == Framework::Ours && !s.device.is_cuda() && !f16 {
        4.0
    } else {
        c.e
    }
}

/// Per-token saved bytes of one decoder layer, and its backward working set.
struct LayerCost {
    saved: f64,
    working: f64,
}

fn decoder_layer(
    d: &DecoderDescriptor,
    s: &Settings,
    c: &Ctx,
    sites: &[&LinearSite],
    seq: f64,
) -> LayerCost {
    let h = d.hidden as f64;
    let f = d.intermediate as f64;
    let q = (d.heads * d.head_dim) as f64;
    let kv = (d.kv_heads * d.head_dim) as f64;
    let a = d.heads as f64;
    let p = &s.profile;
    let full = s.method == Method::Full;
    let is = |name: &str| sites.iter().any(|x| x.name == name);
    // Norms: HF RMSNorm upcasts to fp32 and keeps that copy (`hidden.to(float32)`, saved by pow
    // and mul); LayerNorm keeps its input; torch.compile keeps only the input.
    let norm = match (d.norm, p.torch_compile) {
        (NormKind::RmsNorm, false) => 4.0 * h,
        _ => c.r * h,
    };
    let mut saved = 2.0 * norm;
    if d.qk_norm {
        saved += 4.0 * (q + kv);
    }
    // Attention (SDPA flash/efficient, or lora-core's CPU causal attention): q, k, v, out and
    // logsumexp; HF `repeat_kv` expands
    // GQA keys/values to all heads before the kernel. Ours on the CPU hands the kernel grouped
    // keys/values as they are, and runs bf16 attention in f32 (lora-models' llama attention).
    let ours_cpu = p.framework == Framework::Ours && !s.device.is_cuda();
    let kv_saved = if p.repeat_kv && !ours_cpu { q } else { kv };
    saved += attention_bytes(s, c) * (2.0 * q + 2.0 * kv_saved) + 4.0 * a;
    let working_attn = if s.attention == Attention::Math {
        // eager: fp32 softmax output + its 16-bit cast (saved by the PV matmul); the backward
        // holds the fp32 gradients of the probabilities and of the scores.
        saved += (4.0 + c.e) * a * seq;
        2.0 * 4.0 * a * seq
    } else {
        0.0
    };
    // Gated MLP: SiLU keeps gate, the product keeps SiLU(gate) and up; compile keeps gate, up,
    // and so does ours (lora-core's SwiGLU op recomputes the sigmoid in its backward pass).
    saved += if d.gated_mlp {
        if p.torch_compile || p.framework == Framework::Ours {
            2.0 * c.e * f
        } else {
            3.0 * c.e * f
        }
    } else {
        2.0 * c.e * f
    };
    // Inputs of the linears that need them for a weight gradient (adapted or fully trained) or
    // that an old bitsandbytes saved anyway. Distinct input tensors: norm1 out (q,k,v), attention
    // out (o), norm2 out (gate, up), MLP product (down).
    let groups: [(&[&str], f64); 4] = [
        (
            &[
                "self_attn.q_proj",
                "self_attn.k_proj",
                "self_attn.v_proj",
                "self_attn.qkv_proj",
            ],
            h,
        ),
        (&["self_attn.o_proj"], q),
        (&["mlp.gate_proj", "mlp.up_proj", "mlp.gate_up_proj"], h),
        (&["mlp.down_proj"], f),
    ];
    let bnb = p.bnb_saves_4bit_inputs && matches!(s.base_dtype, BaseDtype::Nf4 { .. });
    let layer_sites = d.layer_sites();
    for (names, width) in groups {
        let adapted: Vec<&&str> = names.iter().filter(|n| is(n)).collect();
        if full {
            saved += c.e * width;
            continue;
        }
        if !adapted.is_empty() {
            // PEFT / ours cast the input to the adapter dtype per adapted layer (a copy each) when
            // dtypes differ; under autocast the per-op cast is 16-bit; torchtune shares it.
            let per_module = match p.framework {
                Framework::Torchtune => 0.0,
                _ if c.autocast => c.e,
                _ if c.ad != c.e => c.ad,
                _ => 0.0,
            };
            if s.lora.dropout > 0.0 {
                // Each adapted module drops its own copy of the input (cast to the adapter dtype
                // first): lora_A keeps the dropped copy (its autocast cast under autocast), and
                // dropout keeps its mask — a bool on CUDA (`native_dropout`), a noise tensor of the
                // input's dtype on the CPU (ATen's `_dropout`: `input * bernoulli(1 − p)/(1 − p)`).
                // The undropped input is no branch's to keep.
                let kept = if c.autocast { c.e } else { c.ad };
                let mask = if s.device.is_cuda() { 1.0 } else { c.ad };
                saved += (kept + mask) * width * adapted.len() as f64;
                if bnb {
                    saved += c.e * width;
                }
            } else if per_module > 0.0 {
                // This SDK computes the LoRA A products of dense siblings that all carry a plain
                // adapter in one GEMM (lora_core `LoraLinear::forward_siblings`, lora_models'
                // q/k/v and gate/up over one fused base): one cast of the shared input for the
                // group, not one per module.
                let present = names
                    .iter()
                    .filter(|n| layer_sites.iter().any(|x| x.name == **n))
                    .count();
                let fused_group = p.framework == Framework::Ours
                    && !s.base_dtype.is_quantized()
                    && s.method == Method::Lora
                    && adapted.len() > 1
                    && adapted.len() == present;
                let casts = if fused_group {
                    1.0
                } else {
                    adapted.len() as f64
                };
                saved += per_module * width * casts;
                if bnb {
                    saved += c.e * width;
                }
            } else if names.contains(&"self_attn.o_proj")
                && ours_cpu
                && s.attention != Attention::Math
                && attention_bytes(s, c) == c.e
            {
                // o_proj's input is the attention output itself, which the attention already
                // keeps: libtorch's CPU flash kernel and lora-core's CPU causal attention
                // write it `[b, s, heads, head_dim]`, so the `[b, s, heads·head_dim]` view
                // o_proj reads is no copy.
            } else {
                saved += c.e * width;
            }
            for n in &adapted {
                let out = sites
                    .iter()
                    .find(|x| x.name == **n)
                    .map(|x| x.out_features as f64)
                    .unwrap_or(0.0);
                // lora_A output (input of lora_B).
                saved += c.ad * f64::from(s.lora.rank);
                if s.method == Method::Dora {
                    // PEFT DoRA keeps the base output and the LoRA output for the magnitude grad.
                    saved += (c.e + c.ad) * out;
                }
            }
        } else if bnb {
            saved += c.e * width;
        }
    }
    // This SDK's CPU causal attention for f32 sequences of at most 512 positions
    // (`lora_core::sys::causal_attention`, used on AVX2 CPUs; counted on any CPU, the safe
    // side): its backward pass holds a workspace per worker thread, `2·d·sₚ + 2·sₚ² + s` f32
    // with sₚ = s rounded up to 16, at most one per (sequence, kv head) task.
    let hd = d.head_dim as f64;
    let kernel_attn = ours_cpu
        && s.attention != Attention::Math
        && attention_bytes(s, c) == 4.0
        && (1.0..=512.0).contains(&seq)
        && d.head_dim % 16 == 0
        && (16..=256).contains(&d.head_dim);
    let working_attn = if kernel_attn {
        let sp = (seq / 16.0).ceil() * 16.0;
        // per token of the micro-batch: kv_heads tasks per sequence of `seq` tokens
        working_attn + d.kv_heads as f64 * 4.0 * (2.0 * hd * sp + 2.0 * sp * sp + seq) / seq
    } else {
        working_attn
    };
    // One layer's backward: grads of the MLP intermediates and of the residual stream.
    let working = 3.0 * c.e * f + 2.0 * c.r * h + working_attn;
    LayerCost { saved, working }
}

/// The modules PEFT's `modules_to_save` can name on a decoder.
pub const DECODER_MODULES_TO_SAVE: &[&str] = &["embed_tokens", "lm_head"];

/// Bytes the CUDA caching allocator sets aside for one request of `size` bytes, minus `size`
/// (PyTorch `c10/cuda/CUDACachingAllocator.cpp`: requests are rounded up to 512 B; up to 1 MiB
/// they share 2 MiB small-pool segments; up to 10 MiB they are split out of 20 MiB segments,
/// whose tail is counted pro rata; larger requests get their own segment rounded up to 2 MiB).
pub fn cuda_block_overhead(size: f64) -> f64 {
    const MIB: f64 = 1_048_576.0;
    if size <= 0.0 {
        return 0.0;
    }
    let rounded = (size / 512.0).ceil() * 512.0;
    if rounded <= MIB {
        rounded - size
    } else if rounded < 10.0 * MIB {
        let per_segment = (20.0 * MIB / rounded).floor().max(1.0);
        20.0 * MIB / per_segment - size
    } else {
        (rounded / (2.0 * MIB)).ceil() * 2.0 * MIB - size
    }
}

fn estimate_decoder(d: &DecoderDescriptor, s: &Settings) -> Result<Estimate> {
    // PEFT's prepare_model_for_kbit_training: non-quantized weights fp32, and so the residual
    // stream (the embedding output) too.
    let kbit = s.profile.kbit_fp32_cast && matches!(s.base_dtype, BaseDtype::Nf4 { .. });
    let c = {
        let c = ctx(s);
        Ctx {
            r: if kbit { 4.0 } else { c.r },
            ..c
        }
    };
    let all_sites = d.sites();
    let sites = targeted(&all_sites, s);
    if s.method != Method::Full && sites.is_empty() {
        return Err(no_target_error(&all_sites, s));
    }
    // PEFT matches `modules_to_save` entries as names or `.`-suffixes of module paths
    let mut saved_modules: Vec<&str> = Vec::new();
    for m in &s.modules_to_save {
        let name = m.rsplit('.').next().unwrap_or(m);
        if !DECODER_MODULES_TO_SAVE.contains(&name) {
            return Err(Error::InvalidSetting {
                key: "modules_to_save",
                reason: format!(
                    "{m:?} is not a module of a decoder that can be trained in full; use {}",
                    DECODER_MODULES_TO_SAVE.join(" or ")
                ),
            });
        }
        if !saved_modules.contains(&name) {
            saved_modules.push(name);
        }
    }
    if s.quantize_lm_head && !s.base_dtype.is_quantized() {
        return Err(Error::InvalidSetting {
            key: "quantize_lm_head",
            reason: format!(
                "the base is {:?}, not quantized: there is no quantized format for lm_head",
                s.base_dtype
            ),
        });
    }
    let mut notes = Vec::new();
    let tokens = f64::from(s.micro_batch) * f64::from(s.seq_len);
    let seq = f64::from(s.seq_len);
    let h = d.hidden as f64;
    let v = d.vocab as f64;

    // Base weights.
    let linear = d.layer_linear_params() as f64;
    let rest = (d.params() as f64 - linear).max(0.0);
    let rest_bytes = if s.computes_in_f32() || kbit {
        4.0
    } else {
        2.0
    };
    // The head matrix (the embedding itself when tied) in the quantized format when asked.
    let head = v * h;
    let head_quantized = if s.quantize_lm_head {
        head.min(rest)
    } else {
        0.0
    };
    let head_dtype = s.lm_head_dtype.unwrap_or(s.base_dtype);
    // This SDK decodes NF4 and the GGUF formats other than Q8_0 through a `[256, 2]` f32 table
    // per weight tensor (lora-core's `QuantWeight`: a byte to two values), 2 KiB each.
    let pair_tables = if s.profile.framework == Framework::Ours {
        let layer_tensors: u64 = d.layer_sites().iter().map(|x| x.count).sum();
        OURS_PAIR_TABLE_BYTES
            * (if has_pair_table(s.base_dtype) {
                layer_tensors as f64
            } else {
                0.0
            } + if head_quantized > 0.0 && has_pair_table(head_dtype) {
                1.0
            } else {
                0.0
            })
    } else {
        0.0
    };
    let base_weights = linear * s.base_dtype.bytes_per_param()
        + (rest - head_quantized) * rest_bytes
        + head_quantized * head_dtype.bytes_per_param()
        + pair_tables;
    // Persistent tensors as the caching allocator lays them out (see `cuda_block_overhead`).
    let mut rounding: f64 = d
        .layer_sites()
        .iter()
        .map(|x| {
            x.count as f64
                * cuda_block_overhead(x.weight_params() as f64 * s.base_dtype.bytes_per_param())
        })
        .sum::<f64>()
        + cuda_block_overhead(head * rest_bytes) * if d.tied_embeddings { 1.0 } else { 2.0 };
    let autocast_copies = if c.autocast && s.base_dtype == BaseDtype::F32 {
        // Autocast caches casts only of leaf tensors that require grad: a frozen base's 16-bit
        // copies are made per call and live as long as the matmul that saved them — every
        // layer's without checkpointing, the recomputed layer's with it. Trained weights (a full
        // fine-tune) stay in the cache for the whole step.
        let kept = if s.gradient_checkpointing && s.method != Method::Full {
            linear / (d.layers as f64).max(1.0)
        } else {
            linear
        };
        2.0 * (kept + d.vocab as f64 * h.max(0.0))
    } else if c.autocast && kbit && !s.quantize_lm_head {
        // the fp32 head's 16-bit cast, saved for the backward of the logits matmul
        2.0 * head
    } else {
        0.0
    };

    // Trainable parameters.
    let (trainable, adapter_bytes, grad_bytes, state_bytes) = if s.method == Method::Full {
        let p = d.params();
        let largest = d.vocab * d.hidden;
        let t = Trainable {
            params: p,
            factored: 0,
            small: 0,
            largest,
        };
        if s.base_dtype.is_quantized() {
            return Err(Error::InvalidSetting {
                key: "method",
                reason: format!(
                    "full fine-tuning cannot train a {:?} base; use LoRA on it or a 16/32-bit base",
                    s.base_dtype
                ),
            });
        }
        let pb = rest_bytes.max(c.r);
        let t = Trainable {
            factored: all_sites
                .iter()
                .map(|x| (x.in_features + x.out_features) * x.count)
                .sum::<u64>()
                + d.vocab
                + d.hidden,
            ..t
        };
        (t, 0.0, pb, pb)
    } else {
        let t = lora_trainable(&sites, s);
        let ab = t.params as f64 * c.ad;
        (
            t,
            ab,
            c.ad,
            // torch.optim keeps states in the parameter dtype (PEFT, torchtune); this SDK's
            // optimizers keep fp32 states for 16-bit adapters.
            match s.profile.framework {
                Framework::Ours => 4.0,
                _ => c.ad,
            },
        )
    };
    // DeepSpeed ZeRO-1/2: fp32 optimizer states and an fp32 master copy of the 16-bit
    // trainable parameters; its fused Adam has no foreach temporaries, but the step makes an
    // fp32 copy of the 16-bit gradients for the master weights.
    let deepspeed = s.profile.deepspeed;
    let state_bytes = if deepspeed.is_some() {
        4.0
    } else {
        state_bytes
    };
    let mut gradients = trainable.params as f64 * grad_bytes;
    let (mut states, foreach_tmp) = optimizer_bytes(&trainable, s.optimizer, state_bytes);
    let mut step_tmp = step_temporaries(&trainable, s, foreach_tmp, state_bytes);
    if deepspeed.is_some() {
        states += 4.0 * trainable.params as f64;
        step_tmp = 4.0 * trainable.params as f64;
    }
    let mut trainable_params = trainable.params;
    let mut adapter_bytes = adapter_bytes;
    let mut largest_trainable = trainable.largest;
    if s.method != Method::Full {
        // adapter, gradient and optimizer-state tensors of each LoRA matrix
        for (elements, count) in trainable_tensors(&sites, s) {
            let n = elements as f64;
            rounding += count as f64
                * (cuda_block_overhead(n * c.ad)
                    + cuda_block_overhead(n * grad_bytes)
                    + 2.0 * cuda_block_overhead(n * state_bytes));
        }
    }
    // PEFT `modules_to_save`: a trainable copy of each listed `[V, h]` module beside the
    // original, in the module's dtype (this SDK's trainer would keep it fp32, as its adapters).
    let mts = saved_modules.len() as f64;
    if mts > 0.0 && s.method != Method::Full {
        let pb = match s.profile.framework {
            Framework::Ours => 4.0,
            _ => rest_bytes,
        };
        let n = d.vocab * d.hidden;
        let k = saved_modules.len() as u64;
        let t = Trainable {
            params: n * k,
            factored: (d.vocab + d.hidden) * k,
            small: 0,
            largest: n,
        };
        let (st, tmp) = optimizer_bytes(&t, s.optimizer, pb);
        adapter_bytes += mts * head * pb;
        gradients += mts * head * pb;
        states += st;
        step_tmp = step_tmp.max(step_temporaries(&t, s, tmp, pb));
        trainable_params += t.params;
        largest_trainable = largest_trainable.max(n);
        rounding += mts * 4.0 * cuda_block_overhead(head * pb);
    }
    let head_trained = saved_modules.contains(&"lm_head");

    // Activations.
    let layer = decoder_layer(d, s, &c, &sites, seq);
    let layers = d.layers as f64;
    let lm_lora = sites.iter().any(|x| x.name == "lm_head");
    let e_logits = c.e;
    // lora-train's fused head + cross-entropy (lora_models `Llama::loss`): no `[tokens, V]`
    // logits; per token the final norm's saved input (residual dtype) and its f32 reciprocal
    // RMS, the normed hidden states (saved by the surrogate) and their shifted row copy — in
    // the backward their gradient instead — fp32 at most, plus the gradient rows in the matmul
    // dtype; one chunk of logits at a time.
    let fused_ce = s.profile.framework == Framework::Ours
        && !lm_lora
        && !head_trained
        && !s.profile.compiled_loss
        && !s.profile.chunked_cross_entropy;
    let ce_chunk = if fused_ce {
        let rows_total = f64::from(s.micro_batch) * f64::from(s.seq_len.saturating_sub(1));
        let rows = (OURS_CE_CHUNK_BYTES as f64 / (4.0 * v.max(1.0)))
            .floor()
            .max(16.0)
            .min(rows_total);
        // Per row of the chunk, 8 bytes per vocabulary entry: in fp32 the logits and their
        // fp32 log-softmax (two reused buffers off oneDNN); in 16 bits the logits widened to
        // fp32 (the 16-bit ones dropped) and their log-softmax, then that and the scaled
        // softmax rounded for the gradient matmul (`e + 4` ≤ 8 bytes at once), then the
        // rounded softmax alone (or, with bf16 by f32 GEMMs, beside its f32 widening: 6). In 16
        // bits the chunk's hidden rows are a cast of their own beside them.
        let cast_rows = if c.e < 4.0 { rows * c.e * h } else { 0.0 };
        rows * 8.0 * v + cast_rows
    } else {
        0.0
    };
    // This SDK over a quantized base, and whether the shim's CPU kernel takes its products.
    let ours_quantized = s.profile.framework == Framework::Ours && s.base_dtype.is_quantized();
    let ours_kernel = ours_quantized
        && !s.device.is_cuda()
        && !matches!(
            s.mixed_precision,
            MixedPrecision::Fp16 | MixedPrecision::FullFp16
        );
    // Over a quantized head without the CPU kernel the gradient rows are summed over the
    // vocabulary tiles in an f32 buffer beside the 16-bit rows (`vocab_tiled_head`).
    let tiled_head_sums = if ours_quantized && !ours_kernel && head_quantized > 0.0 && c.e < 4.0 {
        4.0 * h
    } else {
        0.0
    };
    let (logits_peak, logits_kept) = if fused_ce {
        ((8.0 + c.e + c.r) * h + 4.0 + tiled_head_sums, 8.0 * h)
    } else if s.profile.compiled_loss {
        // fused cross-entropy: 16-bit logits + their gradient (one chunk at a time when chunked)
        let grad = if s.profile.chunked_cross_entropy {
            e_logits * v / 8.0
        } else {
            e_logits * v
        };
        (e_logits * v + grad, e_logits * v)
    } else if s.profile.chunked_cross_entropy {
        (e_logits * v + 4.0 * v + 8.0 * v / 8.0, e_logits * v)
    } else if s.profile.model_dtype_loss && !c.autocast && c.e < 4.0 {
        // 16-bit logits, their shifted contiguous copy and `log_softmax`'s 16-bit output in the
        // forward; in the backward the output, its gradient and the logits' gradient.
        (3.0 * e_logits * v, e_logits * v)
    } else {
        match s.profile.framework {
            _ if s.profile.legacy_fp32_logits => (20.0 * v, 4.0 * v),
            Framework::Torchtune => (16.0 * v, 4.0 * v),
            _ => (e_logits * v + 12.0 * v, e_logits * v),
        }
    };
    let logits_extra = if lm_lora { c.ad * v } else { 0.0 };
    let (stored, recompute) = if s.gradient_checkpointing {
        let kept = if s.profile.activation_offloading {
            2.0
        } else {
            layers
        };
        (kept * c.r * h, layer.saved)
    } else {
        (layers * layer.saved, 0.0)
    };
    // A quantized linear computes with a dense copy of its weight in the compute dtype, made
    // per call in the forward and again in the backward (bitsandbytes `MatMul4Bit`:
    // `dequantize_4bit(W).to(A.dtype)`; this SDK's `QuantWeight::dequantize`, whose decode keeps
    // the codes' float values beside the scaled output): one such matrix is alive at the peak.
    // AutoGPTQ's training path (`QuantLinear` of `qlinear_cuda` / `qlinear_cuda_old` for inputs
    // of ≥ 128 rows) unpacks the codes to int16, gathers the per-group scales and zeros to the
    // full `[in, out]` shape and multiplies: 8 B per weight alive at once before the fp16 result.
    let gptq_dequantize = matches!(s.base_dtype, BaseDtype::Gptq4 { .. })
        && s.profile.gptq_kernel == crate::settings::GptqKernel::Dequantize;
    let dq_bytes = match s.profile.framework {
        _ if gptq_dequantize => 8.0,
        Framework::Ours => ours_dequant_bytes_per_weight(s.base_dtype, c.e),
        _ => c.e,
    };
    let dequant = |params: f64| {
        if s.base_dtype.is_quantized() {
            params * dq_bytes
        } else {
            0.0
        }
    };
    let largest_linear = d
        .layer_sites()
        .iter()
        .map(|x| x.weight_params() as f64)
        .fold(0.0, f64::max);
    // This SDK's quantized linears compute one tile of output rows at a time and keep no dense
    // weight for the backward pass, which decodes the tiles again (`QuantWeight::linear`): at
    // most `OURS_QLINEAR_TILE_ELEMENTS` weights dense at once. On the CPU for f32 / bf16 the
    // shim's kernel decodes each tile (`lora_core::sys::qlinear`: f32, plus its bf16 copy for a
    // bf16 product); elsewhere (CUDA; f16 on the CPU) `QuantWeight::dequantize` of the tile's
    // rows does (`lora_core::sys::tiled_linear`), holding `ours_dequant_bytes_per_weight`.
    let tile = |params: f64| {
        params.min(OURS_QLINEAR_TILE_ELEMENTS as f64)
            * if !ours_kernel {
                ours_dequant_bytes_per_weight(s.base_dtype, c.e)
            } else if c.e < 4.0 {
                4.0 + c.e
            } else {
                4.0
            }
    };
    // This SDK's fused loss never decodes a quantized head whole: the CPU kernel multiplies it
    // chunk by chunk, and elsewhere (CUDA; f16) one tile of vocabulary rows is decoded at a time
    // (`lora_models::llama::Llama::loss`).
    let head_dq = if ours_quantized {
        tile(head_quantized)
    } else {
        dequant(head_quantized)
    };
    let layer_dq = if ours_quantized {
        tile(largest_linear)
    } else {
        dequant(largest_linear)
    };
    // The CPU kernel decodes into buffers of the calling thread that it keeps from call to call
    // (`tile_buffer` in lora-core's shim), grown to the largest tile: from the first product on,
    // the head's and the layers' decodes hold the same bytes, at every point of the step.
    let (head_dq, layer_dq) = if ours_kernel {
        let kept = head_dq.max(layer_dq);
        (kept, kept)
    } else {
        (head_dq, layer_dq)
    };
    // AutoGPTQ's dequantize path multiplies with `torch.matmul(x, weights)`, so autograd keeps
    // its fp16 `weights` (compute dtype) for the input gradient: every layer linear the forward
    // ran with grad — all of them without checkpointing, the recomputed layer's with it
    // (bitsandbytes' `MatMul4Bit` and this SDK's tiled linears decode again instead).
    let kept_dense = if gptq_dequantize {
        c.e * if s.gradient_checkpointing {
            linear / layers.max(1.0)
        } else {
            linear
        }
    } else {
        0.0
    };
    if kept_dense > 0.0 {
        notes.push(format!(
            "activations include {:.2} GB of dequantized weights AutoGPTQ's training path keeps \
             for the backward pass ({}); {}",
            kept_dense / 1e9,
            if s.gradient_checkpointing {
                "one layer's, with gradient checkpointing"
            } else {
                "every layer's"
            },
            if s.gradient_checkpointing {
                "a 16-bit compute dtype halves them"
            } else {
                "gradient checkpointing keeps only one layer's"
            }
        ));
    }
    // The additive attention mask `[b, 1, s, s]` in attention's dtype, built once per forward
    // and shared by every layer (kept through the backward as an input of each layer): this
    // SDK's model always builds it for packed rows (document boundaries; `Llama::mask`);
    // transformers builds it for eager attention, and for SDPA when a batch has padding
    // (`_prepare_4d_causal_attention_mask_for_sdpa` drops it only for plain causal batches).
    let mask = if s.profile.framework == Framework::Ours
        || s.attention == Attention::Math
        || s.profile.variable_length
    {
        attention_bytes(s, &c) * f64::from(s.micro_batch) * seq * seq
    } else {
        0.0
    };
    // This SDK's rotary tables cos/sin `[b, 1, s, head_dim]` in the model dtype, built once per
    // forward for every row's positions and read by every layer (`Llama::rope`).
    let mask = mask
        + if s.profile.framework == Framework::Ours {
            2.0 * c.r * d.head_dim as f64 * tokens
        } else {
            0.0
        };
    let loss_branch = (logits_peak + logits_extra) * tokens + ce_chunk + head_dq + kept_dense;
    let layer_branch = (logits_kept + recompute + layer.working) * tokens + layer_dq + kept_dense;
    let (activations, logits_loss) = if loss_branch >= layer_branch {
        (
            stored * tokens + head_dq + kept_dense + mask,
            loss_branch - head_dq - kept_dense,
        )
    } else {
        (
            (stored + recompute + layer.working) * tokens + layer_dq + kept_dense + mask,
            logits_kept * tokens,
        )
    };
    // A GPTQ base's kernel scratch (per device, for the model's largest linear).
    let buffers_persistent =
        if matches!(s.base_dtype, BaseDtype::Gptq4 { .. }) && s.device.is_cuda() {
            s.profile.gptq_kernel.scratch_bytes(
                d.layer_sites()
                    .iter()
                    .map(|x| (x.in_features, x.out_features)),
            )
        } else {
            0.0
        };
    let buffers_backward = deepspeed.map_or(0.0, |z| z.bucket_bytes());

    let batch = 32.0 * tokens;

    finish(FinishArgs {
        model: d.name.clone(),
        s,
        trainable: trainable_params,
        base_weights,
        autocast_copies,
        adapter_bytes,
        gradients,
        states,
        step_tmp,
        step_tmp_small_pool: largest_trainable as f64 * state_bytes <= 1_048_576.0,
        activations,
        logits_loss,
        batch,
        rounding,
        notes,
        diffusion: None,
        buffers_persistent,
        buffers_backward,
        sample_images: 0.0,
        kept_data: 0.0,
    })
}

/// Bytes of [`Settings::kept_data`] on a CPU run: `latent` bytes per kept latent, `text` per
/// kept caption's text-encoder outputs, and their sum plus `eval_extra` per evaluation sample
/// (lora-train's `ImageSource` caches and fixed evaluation batches). 0 on CUDA, where they are
/// host memory, and without kept data.
pub(crate) fn kept_data_bytes(s: &Settings, latent: f64, text: f64, eval_extra: f64) -> f64 {
    match (s.device, s.kept_data) {
        (Device::Cpu { .. }, Some(k)) => {
            k.latents as f64 * latent
                + k.captions as f64 * text
                + k.eval_samples as f64 * (latent + text + eval_extra)
        }
        _ => 0.0,
    }
}

struct FinishArgs<'a> {
    model: String,
    s: &'a Settings,
    trainable: u64,
    base_weights: f64,
    autocast_copies: f64,
    adapter_bytes: f64,
    gradients: f64,
    states: f64,
    step_tmp: f64,
    /// every trainable tensor's state is ≤ 1 MiB: step temporaries come from the small pool
    step_tmp_small_pool: bool,
    activations: f64,
    logits_loss: f64,
    batch: f64,
    /// caching-allocator rounding of the persistent tensors (CUDA only)
    rounding: f64,
    notes: Vec<String>,
    diffusion: Option<DiffusionDetail>,
    /// buffers alive for the whole run (GPTQ kernel scratch)
    buffers_persistent: f64,
    /// buffers alive during the backward pass only (DeepSpeed gradient buckets)
    buffers_backward: f64,
    /// diffusion: what drawing a sample grid adds next to the persistent tensors and the
    /// gradients (frozen models loaded back, inference activations, one image's decode)
    sample_images: f64,
    /// image jobs on the CPU: what the data source keeps for the whole run
    kept_data: f64,
}

fn finish(a: FinishArgs<'_>) -> Result<Estimate> {
    let s = a.s;
    let persistent =
        a.base_weights + a.adapter_bytes + a.states + a.buffers_persistent + a.kept_data;
    // Gradients exist during the backward peak when they persist across micro-batches, when
    // zero_grad keeps the buffers, or when they are small (LoRA: counted, conservative). A full
    // fine-tune with set_to_none produces them layer by layer while that layer's activations are
    // freed, so its backward peak is taken without them.
    let grads_at_backward = if s.method != Method::Full
        || s.gradient_accumulation_steps > 1
        || s.profile.zero_grad_keeps_buffers
    {
        a.gradients
    } else {
        0.0
    };
    let backward = persistent
        + grads_at_backward
        + a.autocast_copies
        + a.activations
        + a.logits_loss
        + a.batch
        + a.buffers_backward;
    let step = persistent + a.gradients + a.step_tmp;
    // data-parallel: after the last backward pass the gradients are flattened into one fp32
    // buffer for the all-reduce, freed before the optimizer step
    let communication = if s.world_size > 1 {
        4.0 * (a.trainable as f64 + 1.0)
    } else {
        0.0
    };
    let sync = persistent + a.gradients + communication;
    // a sample grid is drawn between optimizer steps: the gradients may still be there (LoRA:
    // small, counted), the step's activations are gone
    let sample = persistent + a.gradients + a.sample_images;
    let at_sample = sample > backward && sample > step && sample > sync;
    let at_sync = sync > backward && sync > step && !at_sample;
    let allocated = backward.max(step).max(sync).max(sample);
    let transient = if at_sample {
        a.sample_images
    } else {
        a.activations + a.logits_loss + a.autocast_copies
    };
    let (margin, context) = match s.device {
        Device::Cuda { context, workspace } => {
            let frac = if s.profile.variable_length {
                ALLOCATOR_FRAGMENTATION_VARIABLE
            } else {
                ALLOCATOR_FRAGMENTATION_FIXED
            };
            (frac * transient, (context + workspace).as_f64())
        }
        Device::Cpu { runtime } => (0.0, runtime.as_f64()),
    };
    // PyTorch's caching allocator serves requests ≤ 1 MiB from a separate small pool that never
    // reuses large-pool blocks: small optimizer temporaries (LoRA tensors) add to the reserved
    // peak even though they come after the activations are freed.
    let small_tmp = if a.step_tmp_small_pool && s.device.is_cuda() {
        a.step_tmp
    } else {
        0.0
    };
    let rounding = if s.device.is_cuda() { a.rounding } else { 0.0 };
    let reserved = (backward + small_tmp).max(allocated) + margin + rounding;
    let margin = reserved - allocated;
    let process = reserved + context;
    // CPU RSS delta: everything the steps add on top of weights + adapters (optimizer states are
    // created lazily in the first step), and the libraries' own buffers.
    let step_runtime = if s.device.is_cuda() {
        0.0
    } else {
        CPU_STEP_RUNTIME.as_f64()
    };
    // an image job's kept data stays in: its caches fill before the first step when precached,
    // during the steps otherwise (lazily encoded latents, random crops)
    let step_delta = allocated - a.base_weights - a.adapter_bytes + step_runtime;
    let mut notes = a.notes;
    if s.world_size > 1 {
        notes.push(format!(
            "per rank of {} data-parallel ranks (each holds the whole model and its own \
             micro-batches); the gradient all-reduce adds a {} fp32 buffer after the backward pass{}",
            s.world_size,
            Bytes::from_f64(communication),
            if at_sync { ", the peak" } else { "" }
        ));
    }
    if at_sample {
        notes.push(format!(
            "drawing sample images is the peak ({} on top of the weights, adapters, optimizer states and gradients: the model without gradients for one prompt, then one image's decode, with the frozen models the run moved off loaded back); without sample images the peak is the training step's {}",
            Bytes::from_f64(a.sample_images),
            Bytes::from_f64(backward.max(step).max(sync))
        ));
    }
    if a.step_tmp > a.activations + a.logits_loss && s.optimizer == Optimizer::AdamW {
        notes.push(
            "the optimizer step is the peak: fused AdamW or a per-tensor loop would lower it"
                .into(),
        );
    }
    // the training step's transient terms, when a training moment is the peak
    let in_step = backward >= step && !at_sync && !at_sample;
    let breakdown = Breakdown {
        base_weights: Bytes::from_f64(a.base_weights),
        autocast_weight_copies: Bytes::from_f64(if in_step { a.autocast_copies } else { 0.0 }),
        adapter_params: Bytes::from_f64(a.adapter_bytes),
        gradients: Bytes::from_f64(if in_step {
            grads_at_backward
        } else {
            a.gradients
        }),
        optimizer_states: Bytes::from_f64(a.states),
        optimizer_step_temporaries: Bytes::from_f64(if backward >= step || at_sync || at_sample {
            0.0
        } else {
            a.step_tmp
        }),
        activations: Bytes::from_f64(if in_step { a.activations } else { 0.0 }),
        logits_loss: Bytes::from_f64(if in_step { a.logits_loss } else { 0.0 }),
        batch_data: Bytes::from_f64(if in_step { a.batch } else { 0.0 }),
        framework_buffers: Bytes::from_f64(
            a.buffers_persistent + if in_step { a.buffers_backward } else { 0.0 },
        ),
        communication_buffers: Bytes::from_f64(if at_sync { communication } else { 0.0 }),
        sample_images: Bytes::from_f64(if at_sample { a.sample_images } else { 0.0 }),
        kept_data: Bytes::from_f64(a.kept_data),
        context_workspace: Bytes::from_f64(context),
        allocator_margin: Bytes::from_f64(margin),
    };
    Ok(Estimate {
        model: a.model,
        breakdown,
        trainable_params: a.trainable,
        peak_allocated: Bytes::from_f64(allocated),
        peak_reserved: Bytes::from_f64(reserved),
        peak_process: Bytes::from_f64(process),
        step_delta: Bytes::from_f64(step_delta),
        persistent: Bytes::from_f64(persistent + a.gradients),
        peak: Bytes::from_f64(process),
        metric: Metric::Process,
        notes,
        device: s.device,
        diffusion: a.diffusion,
        flux: None,
    })
}

/// Diffusion-specific detail of an [`Estimate`]: the per-component split of the weights and
/// activations and the shapes they were computed for (what `lora-train plan` shows for a Stable
/// Diffusion config). All byte counts are already included in the [`Breakdown`] terms.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DiffusionDetail {
    /// Image size `[width, height]` in pixels the activations are computed for (the largest
    /// bucket when bucketing, else the square resolution).
    pub image_size: [u32; 2],
    /// Latent size `[width, height]` (image size / VAE factor).
    pub latent_size: [u32; 2],
    /// Images per micro-batch as the UNet sees them (doubled by prior preservation).
    pub images_per_micro_batch: u32,
    /// UNet weights on the device.
    pub unet_weights: Bytes,
    /// VAE weights on the device (0 when latents are cached and the VAE is moved off).
    pub vae_weights: Bytes,
    /// Text-encoder weights on the device (0 when their outputs are cached and they are moved
    /// off).
    pub text_encoder_weights: Bytes,
    /// Saved UNet activations at the backward peak (part of `activations`).
    pub unet_activations: Bytes,
    /// Saved text-encoder activations while it is trained (part of `activations`).
    pub text_encoder_activations: Bytes,
    /// What drawing the sample grid of [`Settings::sample_images`] adds next to the weights,
    /// adapters, optimizer states and gradients, whether or not it is the peak (see
    /// [`Breakdown::sample_images`]); 0 without sample images.
    #[serde(default)]
    pub sample_images: Bytes,
}

/// Whether the VAE and the text encoder(s) are on the device during the training steps, as
/// `(vae, text_encoders)`: a model leaves once everything it computes is cached before training
/// (`cache_latents` without `random_crop`; `cache_text_encoder_outputs` without
/// `varying_captions`), unless `keep_models_loaded` keeps it (kohya sd-scripts move the VAE and
/// the text encoders to the CPU after caching; a trained text encoder is never cached).
fn frozen_models_on_device(s: &Settings) -> (bool, bool) {
    let vae = !s.cache_latents || s.random_crop || s.keep_models_loaded;
    let te = !s.cache_text_encoder_outputs || s.varying_captions || s.keep_models_loaded;
    (vae, te)
}

/// Saved bytes per position for a group of `adapted` linears that read one input of `width`
/// elements: the input (or one copy per adapted module when the adapter dtype differs: autocast
/// casts it per module, an fp32 adapter over a 16-bit input casts it up), and per adapted module
/// the LoRA A output (`r` per position, read by lora_B's weight gradient) and, with dropout, the
/// mask and the dropped input. 0 when none of the group is adapted.
fn lora_input_bytes(c: &Ctx, s: &Settings, full: bool, adapted: usize, width: f64) -> f64 {
    if adapted == 0 {
        return 0.0;
    }
    let per_module = if full {
        0.0
    } else {
        match s.profile.framework {
            Framework::Torchtune => 0.0,
            _ if c.autocast => c.e * adapted as f64,
            _ if c.ad != c.e => c.ad * adapted as f64,
            _ => 0.0,
        }
    };
    let mut b = if per_module > 0.0 {
        per_module * width
    } else {
        c.e * width
    };
    if !full {
        let k = adapted as f64;
        b += k * c.ad * f64::from(s.lora.rank);
        if s.lora.dropout > 0.0 {
            b += k * (c.ad + 1.0) * width;
        }
    }
    b
}

fn estimate_diffusion(d: &DiffusionDescriptor, s: &Settings) -> Result<Estimate> {
    if !s.modules_to_save.is_empty() || s.quantize_lm_head {
        return Err(Error::InvalidSetting {
            key: if s.quantize_lm_head {
                "quantize_lm_head"
            } else {
                "modules_to_save"
            },
            reason: format!(
                "{} is a diffusion model: modules_to_save and quantize_lm_head apply to decoders",
                d.name
            ),
        });
    }
    let c = ctx(s);
    if s.train_text_encoder && s.cache_text_encoder_outputs {
        return Err(Error::InvalidSetting {
            key: "cache_text_encoder_outputs",
            reason: "text-encoder outputs cannot be cached while the text encoder is trained; turn one off".into(),
        });
    }
    if d.levels.is_empty() {
        return Err(Error::InvalidSetting {
            key: "model",
            reason: format!("{}: the UNet descriptor has no levels", d.name),
        });
    }
    let all_sites = d.sites();
    let usable: Vec<LinearSite> = all_sites
        .iter()
        .filter(|x| x.component == "unet" || s.train_text_encoder)
        .cloned()
        .collect();
    let sites = targeted(&usable, s);
    if s.method != Method::Full && sites.is_empty() {
        return Err(no_target_error(&usable, s));
    }
    let mut notes = Vec::new();
    // UNet weights in the base dtype (block-quantized types apply to the UNet as a whole); the
    // VAE and text encoders in 16 bit (32 bit for an fp32 base) while they are on the device.
    let wb = s.base_dtype.bytes_per_param();
    let unet_weights = d.unet_params as f64 * wb;
    let te_bytes = if s.base_dtype == BaseDtype::F32 {
        4.0
    } else {
        2.0
    };
    let (vae_stays, te_stays) = frozen_models_on_device(s);
    if s.cache_latents && s.random_crop && !s.keep_models_loaded {
        notes.push(
            "random_crop: latents are encoded as the crops are drawn, so the VAE stays on the device"
                .to_string(),
        );
    }
    if s.cache_text_encoder_outputs && s.varying_captions && !s.keep_models_loaded {
        notes.push(
            "captions change between epochs (shuffled or dropped tags): text-encoder outputs are computed as they come, so the text encoders stay on the device"
                .to_string(),
        );
    }
    let te_weights = if te_stays {
        d.text_encoder_params() as f64 * te_bytes
    } else {
        0.0
    };
    let vae_weights = if vae_stays {
        d.vae_params as f64 * te_bytes
    } else {
        0.0
    };
    let base = unet_weights + te_weights + vae_weights;
    let unet_linear: f64 = all_sites
        .iter()
        .filter(|x| x.component == "unet")
        .map(|x| (x.weight_params() * x.count) as f64)
        .sum();
    let autocast_copies = if c.autocast && s.base_dtype == BaseDtype::F32 {
        2.0 * unet_linear.min(d.unet_params as f64)
    } else {
        0.0
    };

    let (trainable, adapter_bytes, grad_bytes, state_bytes) = if s.method == Method::Full {
        let mut p = d.unet_params;
        if s.train_text_encoder {
            p += d.text_encoder_params();
        }
        full_trainable(s, &usable, p, 1280 * 1280 * 9)
    } else {
        lora_state(&c, s, &sites)
    };
    let gradients = trainable.params as f64 * grad_bytes;
    let (states, foreach_tmp) = optimizer_bytes(&trainable, s.optimizer, state_bytes);
    let step_tmp = step_temporaries(&trainable, s, foreach_tmp, state_bytes);

    // Activations per sample.
    let [wpx, hpx] = s.largest_bucket.unwrap_or([s.resolution, s.resolution]);
    let scale = d.vae_scale.max(1) as f64;
    let (lw, lh) = (
        (f64::from(wpx) / scale).floor(),
        (f64::from(hpx) / scale).floor(),
    );
    let n0 = lw * lh;
    let samples = f64::from(s.micro_batch) * if s.prior_preservation { 2.0 } else { 1.0 };
    let ctx_len = 77.0;
    let full = s.method == Method::Full;
    let rank = f64::from(s.lora.rank);
    let is = |name: &str| {
        full || sites
            .iter()
            .any(|x| x.component == "unet" && x.name == name)
    };
    let lora_in = |names: &[&str], width: f64| -> f64 {
        let k = names.iter().filter(|n| is(n)).count();
        lora_input_bytes(&c, s, full, k, width)
    };
    // Bytes per element of what the norms save. Autocast runs GroupNorm and LayerNorm in fp32
    // (both are on PyTorch's autocast fp32 op list): the 16-bit input is cast to fp32 and that
    // copy is saved, and SiLU saves the fp32 GroupNorm output. Counted at 2 bytes, diffusers +
    // PEFT fp16/bf16 runs on an H200 were underpredicted by 11–25% while fp32 runs were within
    // 5% (benches/gpu/results/h200-diffusers-sd-2026-11-30.json, example `sd_gpu_check`).
    let nb = if c.autocast { 4.0 } else { c.r };
    let mut stored = 0.0; // bytes per sample, no checkpointing
    let mut ckpt_stored = 0.0; // checkpointed unit inputs per sample
    let mut biggest_block = 0.0f64; // saved bytes of the largest unit (recompute)
    let mut working = 0.0f64; // backward working set of the largest unit
    let conv_lora = s.lora.conv_rank.is_some() || full;
    // One ResNet block with `cin` input and `cout` output channels over `n` positions: the
    // GroupNorm input and the SiLU input (the norm output) of each of the two norm/act pairs;
    // the conv inputs (and LoCon A outputs) when the convs are trained. Frozen convs need no
    // saved input for the input gradient.
    let resnet = |cin: f64, cout: f64, n: f64| -> (f64, f64) {
        let mut b = nb * 2.0 * (cin + cout) * n;
        if conv_lora {
            b += c.e * (cin + cout) * n;
            if !full {
                b += 2.0 * c.ad * f64::from(s.lora.conv_rank.unwrap_or(0)) * n;
            }
        }
        (b, c.e * 3.0 * cout * n)
    };
    // One Transformer2D (`depth` BasicTransformerBlocks) over `n` positions with `ch` channels.
    // Wrapper: GroupNorm input, the inputs of proj_in (norm output) and proj_out (a contiguous
    // copy of the token-major output) when adapted. Each block: LayerNorm ×3 inputs, SDPA's
    // q, k, v, out of self-attention and q, out of cross-attention (+ the logsumexp of each),
    // GEGLU (hidden, gate, gelu(gate): 12c), and the inputs of the adapted projections.
    let transformer = |ch: f64, heads: f64, n: f64, depth: f64| -> (f64, f64, f64) {
        let elems = 6.0 + 12.0; // + the three LayerNorm inputs at `nb` bytes
        let mut maps = 0.0;
        // backward working set: the GEGLU backward holds the incoming gradient (4c), the
        // gradients of hidden and gate (8c) and their concatenation (8c), next to the gradient
        // of the residual stream and of the block output (2c)
        let mut wk = c.e * 22.0 * ch * n;
        match s.attention {
            Attention::Sdpa => maps += 2.0 * 4.0 * heads * n,
            Attention::Math => {
                // the q·kᵀ scores and their softmax; q, k, v kept by the matmuls instead of
                // the kernel (same count)
                maps = c.e * heads * n * (n + ctx_len);
                wk += 2.0 * c.e * heads * n * n;
            }
        }
        let mut blk = c.e * elems * ch * n + nb * 3.0 * ch * n + maps;
        blk += lora_in(&["attn1.to_q", "attn1.to_k", "attn1.to_v"], ch * n);
        blk += lora_in(&["attn1.to_out.0"], ch * n);
        blk += lora_in(&["attn2.to_q"], ch * n);
        blk += lora_in(&["attn2.to_out.0"], ch * n);
        blk += lora_in(&["ff.net.0.proj"], ch * n);
        blk += lora_in(&["ff.net.2"], 4.0 * ch * n);
        let wrapper = nb * ch * n + lora_in(&["proj_in"], ch * n) + lora_in(&["proj_out"], ch * n);
        (wrapper + depth * blk, wk, wrapper + blk)
    };
    let nlev = d.levels.len();
    let chan: Vec<f64> = d.levels.iter().map(|l| l.channels as f64).collect();
    let npos = |i: usize| n0 / 4f64.powi(i as i32);
    // Every unit (ResNet, ResNet + transformer, mid block) adds its saved bytes; checkpointing
    // keeps the unit inputs (and, in this SDK's UNet, the gradients of the skip connections
    // while the up path is walked back) plus one unit recomputed with its working set.
    // This SDK's UNet checkpoints a ResNet and its transformer as one unit and concatenates the
    // skip inside it; diffusers checkpoints each module on its own, after the concatenation.
    let ours = s.profile.framework == Framework::Ours;
    let mut unit = |saved: f64, input: f64, wk: f64, recomputed: f64| {
        stored += saved;
        ckpt_stored += input;
        biggest_block = biggest_block.max(recomputed);
        working = working.max(wk);
    };
    // `t` = (saved, working set, saved by one BasicTransformerBlock + the wrapper); diffusers
    // checkpoints each BasicTransformerBlock, so `t_input` is one block input per block.
    let mut pair = |r: (f64, f64), t: Option<(f64, f64, f64)>, input: f64, t_input: f64| match t {
        Some(t) if ours => unit(r.0 + t.0, input, r.1.max(t.1), r.0 + t.0),
        Some(t) => {
            unit(r.0, input, r.1, r.0);
            unit(t.0, t_input, t.1, t.2);
        }
        None => unit(r.0, input, r.1, r.0),
    };
    // diffusers checkpoints the BasicTransformerBlocks, not the Transformer2D's GroupNorm in
    // front of proj_in: its saved fp32 input stays with checkpointing on.
    let gn_kept = |ch: f64, n: f64| if ours { 0.0 } else { nb * ch * n };
    let mut skips = c.r * chan[0] * n0; // conv_in output
    // down path
    for (i, lv) in d.levels.iter().enumerate() {
        let n = npos(i);
        let ch = chan[i];
        let depth = lv.transformer_depth as f64;
        for j in 0..lv.resnets {
            let cin = if j == 0 && i > 0 { chan[i - 1] } else { ch };
            let t = (depth > 0.0).then(|| transformer(ch, lv.heads as f64, n, depth));
            pair(
                resnet(cin, ch, n),
                t,
                c.r * cin * n,
                depth * c.r * ch * n + gn_kept(ch, n),
            );
            skips += c.r * ch * n;
        }
        if i + 1 < nlev {
            // the downsampler output (a skip) at the next level's size
            skips += c.r * ch * npos(i + 1);
        }
    }
    // mid block: ResNet, transformer, ResNet at the deepest level
    {
        let i = nlev - 1;
        let (ch, n) = (chan[i], npos(i));
        let r = resnet(ch, ch, n);
        let md = d.mid_transformer_depth as f64;
        let t = (md > 0.0).then(|| transformer(ch, d.levels[i].heads as f64, n, md));
        if ours {
            pair((2.0 * r.0, r.1), t, c.r * ch * n, 0.0);
        } else {
            pair(r, t, c.r * ch * n, md * c.r * ch * n + gn_kept(ch, n));
            pair(r, None, c.r * ch * n, 0.0);
        }
    }
    // up path: ResNet j of level i reads the previous output concatenated with a skip
    for i in (0..nlev).rev() {
        let lv = &d.levels[i];
        let (ch, n) = (chan[i], npos(i));
        let depth = lv.transformer_depth as f64;
        for j in 0..=lv.resnets {
            let prev = if j > 0 {
                ch
            } else if i + 1 < nlev {
                chan[i + 1]
            } else {
                ch
            };
            let skip = if j < lv.resnets {
                ch
            } else if i > 0 {
                chan[i - 1]
            } else {
                chan[0]
            };
            let t = (depth > 0.0).then(|| transformer(ch, lv.heads as f64, n, depth));
            let input = if ours { prev } else { prev + skip };
            pair(
                resnet(prev + skip, ch, n),
                t,
                c.r * input * n,
                depth * c.r * ch * n + gn_kept(ch, n),
            );
        }
    }
    // conv_out head: GroupNorm + SiLU inputs at full latent resolution.
    let c0 = chan[0];
    stored += nb * 2.0 * c0 * n0;
    ckpt_stored += c.r * c0 * n0;
    if ours {
        // gradients of the skip connections wait for their down unit
        ckpt_stored += skips;
    }
    // Text encoder(s) in training: per layer per token ≈ LayerNorm ×2 + q, k, v, out + MLP
    // (+ the probabilities with eager attention; SDPA keeps a logsumexp per head).
    let mut te_act = 0.0;
    if s.train_text_encoder {
        for te in &d.text_encoders {
            let th = te.hidden as f64;
            let heads = te.heads as f64;
            let attn = match s.attention {
                Attention::Sdpa => 4.0 * heads,
                Attention::Math => c.e * heads * ctx_len,
            };
            let lora_a = if full {
                0.0
            } else {
                sites
                    .iter()
                    .filter(|x| x.component == te.name)
                    .map(|x| x.count as f64 * c.ad * rank)
                    .sum::<f64>()
                    / te.layers.max(1) as f64
            };
            let per_token = c.e * (12.0 * th + 2.0 * te.intermediate as f64) + attn + lora_a;
            te_act += te.layers as f64 * ctx_len * per_token;
        }
    }
    let act_per_sample = if s.gradient_checkpointing {
        ckpt_stored + biggest_block + working
    } else {
        stored + working
    };
    let activations = samples * (act_per_sample + te_act);
    // Latents, noise, noisy latents, prediction (fp32) + text conditioning.
    let ctx_dim = d.cross_attention_dim as f64;
    let batch = samples * (4.0 * 4.0 * d.latent_channels as f64 * n0 + 4.0 * ctx_len * ctx_dim);
    let sample_images = s.sample_images.as_ref().map_or(0.0, |g| {
        // the frozen models the run moved off come back for the grid
        let reload = if te_stays {
            0.0
        } else {
            d.text_encoder_params() as f64 * te_bytes
        } + if vae_stays {
            0.0
        } else {
            d.vae_params as f64 * te_bytes
        };
        reload + sample_grid_bytes(d, s, &c, g, te_bytes)
    });
    // what the data source keeps (CPU): fp32 latents at the training size; the prompt
    // embeddings `[77, D]` (and SDXL's pooled projection) in the text encoders' dtype; an
    // evaluation sample adds its token ids (int64, per text encoder) and SDXL's six time ids
    let pooled = match d.family {
        DiffusionFamily::Sdxl => d.text_encoders.last().map_or(0.0, |t| t.hidden as f64),
        DiffusionFamily::Sd1 => 0.0,
    };
    let kept_data = kept_data_bytes(
        s,
        4.0 * d.latent_channels as f64 * n0,
        te_bytes * (ctx_len * ctx_dim + pooled),
        8.0 * ctx_len * d.text_encoders.len() as f64 + 8.0 * 6.0,
    );
    let detail = DiffusionDetail {
        image_size: [wpx, hpx],
        latent_size: [lw as u32, lh as u32],
        images_per_micro_batch: samples as u32,
        unet_weights: Bytes::from_f64(unet_weights),
        vae_weights: Bytes::from_f64(vae_weights),
        text_encoder_weights: Bytes::from_f64(te_weights),
        unet_activations: Bytes::from_f64(samples * act_per_sample),
        text_encoder_activations: Bytes::from_f64(samples * te_act),
        sample_images: Bytes::from_f64(sample_images),
    };

    finish(FinishArgs {
        model: d.name.clone(),
        s,
        trainable: trainable.params,
        base_weights: base,
        autocast_copies,
        adapter_bytes,
        gradients,
        states,
        step_tmp,
        step_tmp_small_pool: trainable.largest as f64 * state_bytes <= 1_048_576.0,
        activations,
        logits_loss: 0.0,
        batch,
        rounding: 0.0,
        notes,
        diffusion: Some(detail),
        buffers_persistent: 0.0,
        buffers_backward: 0.0,
        sample_images,
        kept_data,
    })
}

/// Live elements of a ResNet block without gradients, `c_in → c_out` channels over `n`
/// positions: it releases each intermediate once the next exists (lora-models
/// `ResnetBlock2D::forward`) and peaks in a convolution, whose input the CPU kernels (oneDNN)
/// hold reordered too: `max(3·c_in + c_out, c_in + 3·c_out)` maps, plus one reordered `3×3`
/// weight.
pub(crate) fn resnet_inference_elements(c_in: f64, c_out: f64, n: f64) -> f64 {
    (3.0 * c_in + c_out).max(c_in + 3.0 * c_out) * n + 9.0 * c_in * c_out
}

/// Live elements of an upsampler without gradients (`c` channels, `n` positions before it):
/// its input, then the nearest-neighbour output, its reordered copy and the conv output,
/// `c·n + 3·4c·n`.
pub(crate) fn upsample_inference_elements(c: f64, n: f64) -> f64 {
    c * n + 3.0 * 4.0 * c * n
}

/// Live elements of one image's `AutoencoderKL` decode (diffusers `Decoder`: `conv_in`, the mid
/// block's ResNet + single-head attention + ResNet at the latent size, `resnets_per_level`
/// ResNets per level with an upsampler between levels, then GroupNorm, SiLU, `conv_out`):
/// `channels` is the config's `block_out_channels` (the decoder walks them in reverse),
/// `latent_channels` the input's, `n0` latent positions, `pixels` output pixels; eager
/// attention (`math`) adds its `n0²` scores and probabilities. The sampled latent and its
/// unscaled copy (`z / scaling_factor + shift`, the decoder's input) stay alive throughout.
pub(crate) fn vae_decode_elements(
    channels: &[u64],
    resnets_per_level: u64,
    latent_channels: f64,
    n0: f64,
    pixels: f64,
    math: bool,
) -> f64 {
    let rev: Vec<f64> = channels.iter().rev().map(|&x| x as f64).collect();
    let Some(&deepest) = rev.first() else {
        return 0.0;
    };
    let top = rev.len();
    let mut dec = resnet_inference_elements(deepest, deepest, n0);
    dec = dec.max(6.0 * deepest * n0 + if math { 2.0 * n0 * n0 } else { 0.0 });
    for j in 0..top {
        let n = n0 * 4f64.powi(j as i32);
        let cin = if j == 0 { deepest } else { rev[j - 1] };
        dec = dec.max(resnet_inference_elements(cin, rev[j], n));
        if resnets_per_level > 1 {
            dec = dec.max(resnet_inference_elements(rev[j], rev[j], n));
        }
        if j + 1 < top {
            dec = dec.max(upsample_inference_elements(rev[j], n));
        }
    }
    dec = dec.max(3.0 * rev[top - 1] * pixels);
    2.0 * latent_channels * n0 + dec
}

/// Live maps of `c` channels per position while one of this SDK's `Transformer2DModel`s runs
/// without gradients (its input, the block's input and residual sum, a LayerNorm output, the
/// GEGLU projection `8c`, `gelu(gate)` and the product `4c` each, and what the attention and
/// the projections add): 25, from the counting allocator's peak over the tiny pipeline's UNet
/// at batch 2 and latent sizes 16², 32² and 64² — 27.0 maps of its 32 level-0 channels per
/// position at each size, 2.75 of them skip connections (`tests/train/sd_sample_memory.rs`
/// of lora-train).
const TRANSFORMER_INFERENCE_MAPS: f64 = 25.0;

/// The tensors of drawing a sample grid, as this SDK's SD pipeline draws it
/// (lora-models `SdPipeline::sample_images`), frozen weights not included: the text
/// conditioning of every prompt, then the larger of the UNet's no-grad forward for one prompt and
/// one image's VAE decode, plus the grid's noise and the finished images (fp32, moved to the CPU
/// one by one: counted on a CPU run only). `vae_bytes` is the VAE's element size.
///
/// The UNet at batch `b` (2 with guidance): every skip connection of the down path (held until
/// the up path reads it) plus the largest block's live tensors: a ResNet
/// ([`resnet_inference_elements`]; an up-path ResNet reads the concatenation of the previous
/// output and a skip, both kept meanwhile), an upsampler ([`upsample_inference_elements`]) or a
/// transformer block, [`TRANSFORMER_INFERENCE_MAPS`]` · c` per position plus eager attention's
/// scores and probabilities `2·heads·n·(n + 77)`. Activations are counted in fp32 under
/// autocast (GroupNorm and LayerNorm run in fp32 there), in the compute dtype otherwise. The
/// VAE decode: [`vae_decode_elements`] at one image's size. Checked against the counting
/// allocator on the tiny pipeline (lora-train `tests/train/sd_sample_memory.rs`).
fn sample_grid_bytes(
    d: &DiffusionDescriptor,
    s: &Settings,
    c: &Ctx,
    g: &SampleImages,
    vae_bytes: f64,
) -> f64 {
    let ei = if c.autocast { 4.0 } else { c.e };
    let scale = d.vae_scale.max(1) as f64;
    let [w, h] = g
        .size
        .unwrap_or(s.largest_bucket.unwrap_or([s.resolution, s.resolution]));
    let n0 = (f64::from(w) / scale).floor() * (f64::from(h) / scale).floor();
    let b = if g.guidance { 2.0 } else { 1.0 };
    let prompts = f64::from(g.prompts.max(1));
    let ctx_len = 77.0;
    let lc = d.latent_channels as f64;
    let math = s.attention == Attention::Math;
    let (resnet, upsample) = (resnet_inference_elements, upsample_inference_elements);
    let transformer = |ch: f64, heads: f64, n: f64| {
        TRANSFORMER_INFERENCE_MAPS * ch * n
            + if math {
                2.0 * heads * n * (n + ctx_len)
            } else {
                0.0
            }
    };
    // UNet, in elements for one row of the batch
    let chan: Vec<f64> = d.levels.iter().map(|l| l.channels as f64).collect();
    let nlev = chan.len();
    let npos = |i: usize| n0 / 4f64.powi(i as i32);
    let mut skips = chan[0] * n0;
    let mut unit = 0.0f64;
    for (i, lv) in d.levels.iter().enumerate() {
        let (ch, n) = (chan[i], npos(i));
        for j in 0..lv.resnets {
            let cin = if j == 0 && i > 0 { chan[i - 1] } else { ch };
            unit = unit.max(resnet(cin, ch, n));
            if lv.transformer_depth > 0 {
                unit = unit.max(transformer(ch, lv.heads as f64, n));
            }
            skips += ch * n;
        }
        if i + 1 < nlev {
            skips += ch * npos(i + 1);
        }
    }
    {
        let i = nlev - 1;
        let (ch, n) = (chan[i], npos(i));
        unit = unit.max(resnet(ch, ch, n));
        if d.mid_transformer_depth > 0 {
            unit = unit.max(transformer(ch, d.levels[i].heads as f64, n));
        }
    }
    for i in (0..nlev).rev() {
        let lv = &d.levels[i];
        let (ch, n) = (chan[i], npos(i));
        for j in 0..=lv.resnets {
            let prev = if j > 0 || i + 1 == nlev {
                ch
            } else {
                chan[i + 1]
            };
            let skip = if j < lv.resnets {
                ch
            } else if i > 0 {
                chan[i - 1]
            } else {
                chan[0]
            };
            unit = unit.max(prev * n + resnet(prev + skip, ch, n));
            if lv.transformer_depth > 0 {
                unit = unit.max(transformer(ch, lv.heads as f64, n));
            }
        }
        if i > 0 {
            // the upsampler into level i − 1
            unit = unit.max(upsample(ch, n));
        }
    }
    unit = unit.max(3.0 * chan[0] * n0);
    // the sampler's latents (x, its scaled and doubled copies, the prediction and its halves)
    let sampler = 4.0 * lc * n0 * (3.0 * b + 3.0);
    let unet = ei * b * (skips + unit) + sampler;
    // the text encoders over every prompt and the empty prompt, at once
    let text = d
        .text_encoders
        .iter()
        .map(|t| {
            let th = t.hidden as f64;
            let attn = if math { t.heads as f64 * ctx_len } else { 0.0 };
            ei * 2.0 * prompts * ctx_len * (4.0 * th + t.intermediate as f64 + attn)
        })
        .fold(0.0, f64::max);
    let cond = 4.0 * 2.0 * prompts * ctx_len * d.cross_attention_dim as f64;
    // VAE decoder, one image
    let (vch, per_level) = d.vae_decoder_shape();
    let pixels = f64::from(w) * f64::from(h);
    let decode = vae_bytes * vae_decode_elements(&vch, per_level, lc, n0, pixels, math);
    // the grid's noise (fp32, every prompt's row drawn at once); each finished image goes to
    // the CPU before the next prompt: on a CPU run all of them stay in the same memory
    let images = 4.0 * lc * n0 * prompts
        + if s.device.is_cuda() {
            0.0
        } else {
            4.0 * 3.0 * pixels * prompts
        };
    cond + images + unet.max(decode).max(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::{DeepSpeedZero, GptqKernel, Profile};

    /// The terms that make up the allocated peak (all but the CUDA context and the allocator
    /// margin), summed.
    fn allocated_terms(b: &Breakdown) -> u64 {
        b.terms()
            .iter()
            .filter(|t| !matches!(t.name, "context / workspace" | "allocator margin"))
            .map(|t| t.bytes.0)
            .sum()
    }

    #[test]
    fn data_parallel_ranks_add_the_flat_gradient_buffer_of_the_all_reduce() {
        let m = ModelDescriptor::preset("Llama-3.2-1B").unwrap();
        // LoRA: a few MB of buffer next to the activations; the backward pass stays the peak
        let lora = Settings::default().with_seq_len(512);
        let one = estimate(&m, &lora).unwrap();
        let two = estimate(&m, &lora.clone().with_world_size(2)).unwrap();
        assert_eq!(two.peak, one.peak);
        assert_eq!(two.breakdown.communication_buffers.0, 0);
        assert!(
            two.notes
                .iter()
                .any(|n| n.contains("2 data-parallel ranks")),
            "{:?}",
            two.notes
        );
        assert!(!one.notes.iter().any(|n| n.contains("data-parallel")));
        // a full fine-tune on short sequences: every weight's gradient goes through the fp32
        // buffer, and the all-reduce is the peak: weights + gradients + 4·(trainable + 1)
        let full = Settings::default()
            .with_method(Method::Full)
            .with_seq_len(8);
        let one = estimate(&m, &full).unwrap();
        let two = estimate(&m, &full.clone().with_world_size(2)).unwrap();
        let buffer = 4 * (two.trainable_params + 1);
        assert_eq!(two.breakdown.communication_buffers.0, buffer);
        assert!(two.peak_allocated.0.abs_diff(one.persistent.0 + buffer) <= 1);
        assert!(two.peak > one.peak);
        // the terms still add up to the allocated peak
        let sum = allocated_terms(&two.breakdown);
        assert!(
            sum.abs_diff(two.peak_allocated.0) <= 16,
            "{sum} vs {}",
            two.peak_allocated.0
        );
        // a world of 0 processes is refused
        assert!(estimate(&m, &full.with_world_size(0)).is_err());
    }

    #[test]
    fn a_sample_grid_above_the_training_step_is_the_peak() {
        let m = ModelDescriptor::preset("SD1.5").unwrap();
        let ModelDescriptor::Diffusion(d) = &m else {
            panic!()
        };
        // a lean step: fp16 weights, cached latents and text-encoder outputs (both models off
        // the device), checkpointing, AdamW8bit, 512²
        let lean = Settings::default()
            .with_base_dtype(BaseDtype::F16)
            .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
            .with_resolution(512)
            .with_gradient_checkpointing(true)
            .with_optimizer(Optimizer::AdamW8bit)
            .with_cache_latents(true)
            .with_cache_text_encoder_outputs(true);
        let step = estimate(&m, &lean).unwrap();
        assert_eq!(step.breakdown.sample_images.0, 0);
        let grid = |size: u32, guidance: bool| {
            lean.clone().with_sample_images(Some(SampleImages {
                size: Some([size, size]),
                prompts: 4,
                guidance,
            }))
        };
        // samples at 1024²: the text encoder and the VAE come back (both in fp16) and the VAE
        // decodes 1024² pixels through 128–512 channels
        let big = estimate(&m, &grid(1024, true)).unwrap();
        let b = &big.breakdown;
        let detail = big.diffusion.as_ref().unwrap();
        assert!(b.sample_images.0 > 0, "{b:?}");
        assert_eq!(b.sample_images, detail.sample_images);
        let reload = 2.0 * (d.text_encoder_params() + d.vae_params) as f64;
        // the decoder's first full-resolution ResNet (512 → 128 channels after the last
        // upsampler, 256 in SD's reversed list: 3 maps of 256 channels) bounds it from below
        let decode_floor = 2.0 * 3.0 * 256.0 * 1024.0 * 1024.0;
        assert!(b.sample_images.as_f64() >= reload + decode_floor, "{b:?}");
        assert!(big.peak_allocated > step.peak_allocated);
        assert_eq!(b.activations.0, 0);
        assert_eq!(b.batch_data.0, 0);
        assert!(
            big.notes
                .iter()
                .any(|n| n.starts_with("drawing sample images is the peak")),
            "{:?}",
            big.notes
        );
        // the terms still add up to the allocated peak
        let sum = allocated_terms(b);
        assert!(sum.abs_diff(big.peak_allocated.0) <= 16, "{sum} vs {big:?}");
        // four times the pixels: the decode grows with them; guidance doubles the UNet's batch
        let small = estimate(&m, &grid(512, true)).unwrap();
        let small_grid = small.diffusion.as_ref().unwrap().sample_images;
        assert!(detail.sample_images.as_f64() > 2.0 * (small_grid.as_f64() - reload));
        let no_cfg = estimate(&m, &grid(512, false)).unwrap();
        assert!(no_cfg.diffusion.unwrap().sample_images <= small_grid);
        // a full step at 512² (no checkpointing, fp32 AdamW) stays above a 512² grid
        let heavy = lean
            .clone()
            .with_gradient_checkpointing(false)
            .with_optimizer(Optimizer::AdamW);
        let e = estimate(
            &m,
            &heavy
                .clone()
                .with_sample_images(grid(512, true).sample_images),
        )
        .unwrap();
        assert_eq!(e.breakdown.sample_images.0, 0);
        assert_eq!(e.peak, estimate(&m, &heavy).unwrap().peak);
    }

    #[test]
    fn qlora_weights_follow_the_nf4_formula() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let s = Settings::default().with_base_dtype(BaseDtype::Nf4 {
            double_quant: false,
        });
        let e = estimate(&m, &s).unwrap();
        // and this SDK's 2 KiB pair table per quantized tensor (7 per layer)
        let tables = OURS_PAIR_TABLE_BYTES * 7.0 * d.layers as f64;
        let want = d.layer_linear_params() as f64 * 0.5625
            + (d.params() - d.layer_linear_params()) as f64 * 2.0
            + tables;
        assert!((e.breakdown.base_weights.as_f64() - want).abs() < 2.0);
    }

    #[test]
    fn adapter_params_are_r_times_in_plus_out() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let e = estimate(&m, &Settings::default()).unwrap();
        assert_eq!(e.trainable_params, 32 * 2 * 8 * (4096 + 4096));
        assert_eq!(e.breakdown.adapter_params, Bytes(e.trainable_params * 4));
        assert_eq!(e.breakdown.optimizer_states, Bytes(e.trainable_params * 8));
    }

    #[test]
    fn full_finetune_mixed_precision_model_states_are_16_bytes_per_param() {
        // ZeRO: fp32 weights + fp32 grads + 2 fp32 Adam states = 16 B/param with an fp32 master copy
        // kept as the base (our autocast layout).
        let m = ModelDescriptor::preset("Llama-3.2-1B").unwrap();
        let s = Settings::default()
            .with_method(Method::Full)
            .with_base_dtype(BaseDtype::F32)
            .with_mixed_precision(MixedPrecision::Bf16)
            .with_micro_batch(1)
            .with_seq_len(16);
        let e = estimate(&m, &s).unwrap();
        let p = m.params() as f64;
        let states =
            e.breakdown.base_weights.as_f64() + e.breakdown.optimizer_states.as_f64() + 4.0 * p;
        assert!((states / p - 16.0).abs() < 0.01, "{}", states / p);
    }

    #[test]
    fn errors_name_the_setting() {
        let m = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        let e = estimate(&m, &Settings::default().with_target_modules(&["to_q"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("to_q") && e.contains("self_attn.q_proj"), "{e}");
        let e = estimate(&m, &Settings::default().with_micro_batch(0))
            .unwrap_err()
            .to_string();
        assert!(e.contains("micro_batch"), "{e}");
        let sd = ModelDescriptor::preset("SD1.5").unwrap();
        let s = Settings::default()
            .with_target_modules(&["to_q"])
            .with_train_text_encoder(true)
            .with_cache_text_encoder_outputs(true);
        assert!(estimate(&sd, &s).is_err());
    }

    #[test]
    fn an_image_job_on_the_cpu_counts_the_latents_and_embeddings_it_keeps() {
        let kept = crate::settings::KeptData {
            latents: 32,
            captions: 16,
            eval_samples: 8,
        };
        for (name, ctx_dim, pooled, encoders) in
            [("SD1.5", 768.0, 0.0, 1.0), ("SDXL", 2048.0, 1280.0, 2.0)]
        {
            let m = ModelDescriptor::preset(name).unwrap();
            let cpu = Settings::default()
                .with_target_modules(&["to_q", "to_v"])
                .with_base_dtype(BaseDtype::F32)
                .with_resolution(512)
                .with_device(Device::cpu());
            let base = estimate(&m, &cpu).unwrap();
            let with = estimate(&m, &cpu.clone().with_kept_data(Some(kept))).unwrap();
            // latents [4, 64, 64] fp32; prompt embeddings [77, D] (+ SDXL's pooled projection)
            // in the fp32 text encoders; an evaluation sample's token ids and time ids
            let latent = 4.0 * 4.0 * 64.0 * 64.0;
            let text = 4.0 * (77.0 * ctx_dim + pooled);
            let ids = 8.0 * 77.0 * encoders + 48.0;
            let want = 32.0 * latent + 16.0 * text + 8.0 * (latent + text + ids);
            assert_eq!(with.breakdown.kept_data.0, want as u64, "{name}");
            assert_eq!(
                with.peak_allocated.0 - base.peak_allocated.0,
                want as u64,
                "{name}"
            );
            // caches that fill during the steps grow the steps' RSS: counted there too
            assert_eq!(with.step_delta.0 - base.step_delta.0, want as u64, "{name}");
            // host memory on a CUDA run
            let gpu = |k| {
                estimate(
                    &m,
                    &cpu.clone().with_device(Device::cuda()).with_kept_data(k),
                )
            };
            assert_eq!(gpu(Some(kept)).unwrap(), gpu(None).unwrap(), "{name}");
        }
    }

    #[test]
    fn a_loss_on_16bit_logits_holds_three_16bit_copies_per_token() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let base = Settings::default()
            .with_seq_len(4096)
            .with_gradient_checkpointing(true)
            .with_mixed_precision(MixedPrecision::FullBf16);
        let hf = |p: Profile| estimate(&m, &base.clone().with_profile(p)).unwrap();
        let upcast = hf(Profile::peft_transformers());
        let own = hf(Profile {
            model_dtype_loss: true,
            ..Profile::peft_transformers()
        });
        // (2 + 12)·V per token with the fp32 upcast, 3·2·V on 16-bit logits
        let tokens = 4096.0;
        let diff = upcast.breakdown.logits_loss.as_f64() - own.breakdown.logits_loss.as_f64();
        assert!((diff - 8.0 * d.vocab as f64 * tokens).abs() < 1e3, "{diff}");
        // under autocast log_softmax runs in fp32 whatever the model's code does
        let auto = |p: Profile| {
            estimate(
                &m,
                &base
                    .clone()
                    .with_mixed_precision(MixedPrecision::Bf16)
                    .with_profile(p),
            )
            .unwrap()
            .peak_allocated
        };
        assert_eq!(
            auto(Profile::peft_transformers()),
            auto(Profile {
                model_dtype_loss: true,
                ..Profile::peft_transformers()
            })
        );
    }

    #[test]
    fn deepspeed_zero2_holds_master_weights_and_gradient_buckets() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let z = DeepSpeedZero {
            reduce_bucket_size: 200_000_000,
            overlap_comm: true,
        };
        let s = Settings::default()
            .with_mixed_precision(MixedPrecision::FullFp16)
            .with_profile(Profile {
                deepspeed: Some(z),
                ..Profile::peft_transformers()
            });
        let e = estimate(&m, &s).unwrap();
        let p = e.trainable_params;
        // fp16 adapters and gradients; fp32 master + two fp32 Adam states
        assert_eq!(e.breakdown.adapter_params.0, 2 * p);
        assert_eq!(e.breakdown.optimizer_states.0, 12 * p);
        // two 2e8-element fp16 buckets during the backward pass
        assert_eq!(z.bucket_bytes(), 800_000_000.0);
        assert_eq!(e.breakdown.framework_buffers.0, 800_000_000);
        // without overlap_comm one bucket
        let one = DeepSpeedZero {
            overlap_comm: false,
            ..z
        };
        assert_eq!(one.bucket_bytes(), 400_000_000.0);
        // DeepSpeed's engine needs the model in 16 bit without autocast
        let err = estimate(&m, &s.clone().with_mixed_precision(MixedPrecision::Fp16))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("profile.deepspeed") && err.contains("full_fp16"),
            "{err}"
        );
    }

    #[test]
    fn autocast_keeps_a_frozen_layers_cast_only_while_its_matmul_needs_it() {
        let m = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let s = Settings::default()
            .with_base_dtype(BaseDtype::F32)
            .with_mixed_precision(MixedPrecision::Bf16)
            .with_device(Device::cpu());
        let copies = |s: &Settings| {
            estimate(&m, s)
                .unwrap()
                .breakdown
                .autocast_weight_copies
                .as_f64()
        };
        let linear = d.layer_linear_params() as f64;
        let head = (d.vocab * d.hidden) as f64;
        assert_eq!(copies(&s), 2.0 * (linear + head));
        // with checkpointing only the recomputed layer's casts are alive
        let ckpt = s.clone().with_gradient_checkpointing(true);
        assert_eq!(copies(&ckpt), 2.0 * (linear / d.layers as f64 + head));
    }

    #[test]
    fn settings_that_cannot_run_are_errors_naming_them() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let err = |s: Settings| estimate(&m, &s).unwrap_err().to_string();
        let ds = |z: DeepSpeedZero, p: Profile| {
            Settings::default()
                .with_mixed_precision(MixedPrecision::FullFp16)
                .with_profile(Profile {
                    deepspeed: Some(z),
                    ..p
                })
        };
        let e = err(ds(
            DeepSpeedZero {
                reduce_bucket_size: 0,
                overlap_comm: false,
            },
            Profile::peft_transformers(),
        ));
        assert!(e.contains("reduce_bucket_size"), "{e}");
        let e = err(ds(DeepSpeedZero::default(), Profile::ours()));
        assert!(
            e.contains("profile.deepspeed") && e.contains("HF Trainer"),
            "{e}"
        );
        let e = err(Settings::default().with_base_dtype(BaseDtype::Gptq4 { group_size: 0 }));
        assert!(e.contains("group_size"), "{e}");
        let e = err(Settings::default()
            .with_mixed_precision(MixedPrecision::FullFp16)
            .with_device(Device::cpu()));
        assert!(e.contains("full_fp16") && e.contains("CUDA"), "{e}");
        // beyond any machine: an error, never a saturated number a huge budget calls "fits"
        let e = err(Settings::default()
            .with_seq_len(u32::MAX)
            .with_micro_batch(u32::MAX));
        assert!(e.contains("seq_len") && e.contains("lower"), "{e}");
        // the fit ladder leaves DeepSpeed's optimizer alone instead of failing on it
        let s = ds(DeepSpeedZero::default(), Profile::peft_transformers()).with_seq_len(8192);
        let f = crate::fit::fit(&m, &s, Bytes::from_gib(24.0)).unwrap();
        assert_eq!(f.settings.optimizer, Optimizer::AdamW);
        // a 32-bit base under a full 16-bit mode is cast: counted at 2 B per weight
        let f32_full = estimate(
            &m,
            &Settings::default()
                .with_base_dtype(BaseDtype::F32)
                .with_mixed_precision(MixedPrecision::FullFp16),
        )
        .unwrap();
        let bf16_full = estimate(
            &m,
            &Settings::default()
                .with_base_dtype(BaseDtype::F16)
                .with_mixed_precision(MixedPrecision::FullFp16),
        )
        .unwrap();
        assert_eq!(f32_full.peak_allocated, bf16_full.peak_allocated);
    }

    #[test]
    fn gptq_kernels_cost_their_scratch_or_the_dequantized_weights() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let gptq = |k: GptqKernel| {
            estimate(
                &m,
                &Settings::default()
                    .with_base_dtype(BaseDtype::Gptq4 { group_size: 128 })
                    .with_gradient_checkpointing(true)
                    .with_profile(Profile {
                        gptq_kernel: k,
                        ..Profile::peft_transformers()
                    }),
            )
            .unwrap()
        };
        // Llama-2-7B: the largest linear is 4096 × 11008 (gate/up in, down out is 11008 → 4096)
        let v2 = gptq(GptqKernel::ExllamaV2 {
            max_input_len: 2048,
            max_batch_size: 8,
        });
        let expect = 2.0 * 4096.0 * 11008.0 + 4.0 * 11008.0 * 2048.0 * 8.0;
        assert_eq!(v2.breakdown.framework_buffers.0, expect as u64);
        let v1 = gptq(GptqKernel::ExllamaV1 {
            max_input_len: 2048,
        });
        let expect = 2.0 * (2048.0 * 11008.0 + 4096.0 * 11008.0);
        assert_eq!(v1.breakdown.framework_buffers.0, expect as u64);
        // the training path: no scratch, but one layer's fp16 weights kept for the backward
        let dq = gptq(GptqKernel::Dequantize);
        assert_eq!(dq.breakdown.framework_buffers.0, 0);
        let layer = d.layer_linear_params() as f64 / d.layers as f64;
        assert!(dq.breakdown.activations.as_f64() > 2.0 * layer);
        // the default is the training path; the ExLlama scratch is a CUDA buffer
        assert_eq!(Profile::default().gptq_kernel, GptqKernel::Dequantize);
        let on_cpu = estimate(
            &m,
            &Settings::default()
                .with_base_dtype(BaseDtype::Gptq4 { group_size: 128 })
                .with_device(Device::cpu())
                .with_profile(Profile {
                    gptq_kernel: GptqKernel::ExllamaV2 {
                        max_input_len: 2048,
                        max_batch_size: 8,
                    },
                    ..Profile::peft_transformers()
                }),
        )
        .unwrap();
        assert_eq!(on_cpu.breakdown.framework_buffers.0, 0);
        // the scratch is for GPTQ bases only
        let nf4 = estimate(
            &m,
            &Settings::default().with_base_dtype(BaseDtype::Nf4 { double_quant: true }),
        )
        .unwrap();
        assert_eq!(nf4.breakdown.framework_buffers.0, 0);
    }

    #[test]
    fn ours_on_the_cpu_counts_the_attention_kernels_workspace() {
        let m = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        assert_eq!((d.kv_heads, d.head_dim), (3, 64));
        // one layer's backward working bytes per token, at `seq` positions
        let working = |s: &Settings, seq: u32| {
            let s = s.clone().with_seq_len(seq);
            decoder_layer(d, &s, &ctx(&s), &[], f64::from(seq)).working
        };
        let f32s = Settings::default()
            .with_base_dtype(BaseDtype::F32)
            .with_mixed_precision(MixedPrecision::No);
        let cpu = f32s.clone().with_device(Device::cpu());
        // 3 kv heads' workspaces per sequence: 2·64·sₚ + 2·sₚ² + s floats each
        let per_token =
            |seq: f64, sp: f64| 3.0 * 4.0 * (2.0 * 64.0 * sp + 2.0 * sp * sp + seq) / seq;
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs();
        assert!(close(
            working(&cpu, 128) - working(&f32s, 128),
            per_token(128.0, 128.0)
        ));
        assert!(close(
            working(&cpu, 100) - working(&f32s, 100),
            per_token(100.0, 112.0)
        ));
        // longer sequences run libtorch's kernel
        assert_eq!(working(&cpu, 513) - working(&f32s, 513), 0.0);
        // PEFT on the CPU: libtorch's kernel
        let peft = cpu.clone().with_profile(Profile::peft_transformers());
        let peft_cuda = f32s.clone().with_profile(Profile::peft_transformers());
        assert_eq!(working(&peft, 128) - working(&peft_cuda, 128), 0.0);
    }

    #[test]
    fn ours_on_the_cpu_keeps_grouped_keys_and_f32_attention() {
        let m = ModelDescriptor::preset("Llama-3.2-1B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let (q, kv) = (
            (d.heads * d.head_dim) as f64,
            (d.kv_heads * d.head_dim) as f64,
        );
        assert!(kv < q, "a GQA model");
        // saved bytes per token of one layer with nothing adapted
        let saved = |s: &Settings| decoder_layer(d, s, &ctx(s), &[], 1.0).saved;
        let on_cpu = |s: &Settings| s.clone().with_device(Device::cpu());
        for profile in [Profile::ours(), Profile::peft_transformers()] {
            let ours = profile.framework == Framework::Ours;
            // bf16 autocast over an fp32 base: CUDA keeps bf16 q, k, v (expanded to all heads)
            // and out; ours on the CPU keeps them in f32 and k, v grouped
            let bf16 = Settings::default()
                .with_base_dtype(BaseDtype::F32)
                .with_mixed_precision(MixedPrecision::Bf16)
                .with_profile(profile.clone());
            let want = if ours {
                4.0 * (2.0 * q + 2.0 * kv) - 2.0 * 4.0 * q
            } else {
                0.0
            };
            assert_eq!(saved(&on_cpu(&bf16)) - saved(&bf16), want);
            // fp32: only the grouping differs
            let f32s = bf16.clone().with_mixed_precision(MixedPrecision::No);
            let want = if ours { 8.0 * (kv - q) } else { 0.0 };
            assert_eq!(saved(&on_cpu(&f32s)) - saved(&f32s), want);
            // fp16 on the CPU stays 16-bit
            let f16 = f32s.clone().with_base_dtype(BaseDtype::F16);
            let want = if ours { 2.0 * 2.0 * (kv - q) } else { 0.0 };
            assert_eq!(saved(&on_cpu(&f16)) - saved(&f16), want);
        }
    }

    #[test]
    fn the_attention_mask_is_one_shared_tensor_when_it_exists() {
        let m = ModelDescriptor::preset("Llama-3.2-1B").unwrap();
        let s = Settings::default()
            .with_micro_batch(2)
            .with_seq_len(2048)
            .with_gradient_checkpointing(true);
        let acts = |s: &Settings| estimate(&m, s).unwrap().breakdown.activations.as_f64();
        let mask = 2.0 * 2.0 * 2048.0 * 2048.0;
        // transformers with SDPA drops the mask for unpadded batches, keeps one with padding
        let packed = s.clone().with_profile(Profile::peft_transformers());
        let padded = s.clone().with_profile(Profile {
            variable_length: true,
            ..Profile::peft_transformers()
        });
        assert!((acts(&padded) - acts(&packed) - mask).abs() < 1.0);
        // this SDK always builds one for packed rows (document boundaries): the only term of
        // its activations that is not linear in the tokens
        let ours = |seq: u32| acts(&s.clone().with_seq_len(seq).with_profile(Profile::ours()));
        let quadratic = ours(2048) - 2.0 * ours(1024);
        let expect = mask - 2.0 * (2.0 * 2.0 * 1024.0 * 1024.0);
        assert!((quadratic - expect).abs() < 1.0, "{quadratic} vs {expect}");
    }

    #[test]
    fn modules_to_save_train_the_embedding_and_head_in_full() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let peft = Settings::default().with_profile(Profile::peft_transformers());
        let plain = estimate(&m, &peft).unwrap();
        let both = estimate(
            &m,
            &peft
                .clone()
                .with_modules_to_save(&["embed_tokens", "lm_head"]),
        )
        .unwrap();
        let vh = d.vocab * d.hidden;
        assert_eq!(both.trainable_params, plain.trainable_params + 2 * vh);
        // bf16 copies + bf16 gradients + two bf16 AdamW states (torch.optim: the param dtype)
        assert_eq!(
            both.breakdown.adapter_params.0 - plain.breakdown.adapter_params.0,
            2 * vh * 2
        );
        assert_eq!(
            both.breakdown.optimizer_states.0 - plain.breakdown.optimizer_states.0,
            2 * vh * 4
        );
        // PEFT's suffix matching; a repeat counts once
        let same = estimate(
            &m,
            &peft
                .clone()
                .with_modules_to_save(&["model.embed_tokens", "lm_head", "lm_head"]),
        )
        .unwrap();
        assert_eq!(same.trainable_params, both.trainable_params);
        let e = estimate(&m, &peft.clone().with_modules_to_save(&["norm"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("embed_tokens") && e.contains("\"norm\""), "{e}");
        let sd = ModelDescriptor::preset("SD1.5").unwrap();
        let s = Settings::default()
            .with_target_modules(&["to_q"])
            .with_modules_to_save(&["lm_head"]);
        assert!(
            estimate(&sd, &s)
                .unwrap_err()
                .to_string()
                .contains("decoders")
        );
        // a quantized head: stored in the base format
        let q = Settings::default().with_base_dtype(BaseDtype::Q4_0);
        let dense_head = estimate(&m, &q).unwrap();
        let q_head = estimate(&m, &q.clone().with_quantize_lm_head(true)).unwrap();
        // (the quantized head keeps its own 2 KiB pair table)
        let saved = (2.0 - 18.0 / 32.0) * vh as f64 - OURS_PAIR_TABLE_BYTES;
        let got =
            dense_head.breakdown.base_weights.as_f64() - q_head.breakdown.base_weights.as_f64();
        assert!((got - saved).abs() < 2.0, "{got} vs {saved}");
        // on CUDA this SDK's fused loss decodes that head one tile of vocabulary rows at a time
        // (`lora-models/tests/head_memory.rs` counts it): a tile's decode more than the dense
        // head's loss, not the 2·V·d bytes of the head decoded whole
        let transient =
            |e: &Estimate| e.breakdown.activations.as_f64() + e.breakdown.logits_loss.as_f64();
        let extra = transient(&q_head) - transient(&dense_head);
        let tile =
            OURS_QLINEAR_TILE_ELEMENTS as f64 * ours_dequant_bytes_per_weight(BaseDtype::Q4_0, 4.0);
        let sums = 4.0 * d.hidden as f64 * 512.0;
        assert!(
            extra > 0.0 && extra <= tile + sums,
            "{extra} vs {tile} + {sums}"
        );
        assert!(extra < 0.05 * 2.0 * vh as f64, "{extra}");
        assert!(estimate(&m, &Settings::default().with_quantize_lm_head(true)).is_err());
        assert!(estimate(&m, &Settings::default().with_seq_len(0)).is_err());
    }

    #[test]
    fn prepare_model_for_kbit_training_costs_fp32_embeddings_and_head() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let ModelDescriptor::Decoder(d) = &m else {
            panic!()
        };
        let nf4 = Settings::default()
            .with_base_dtype(BaseDtype::Nf4 { double_quant: true })
            .with_mixed_precision(MixedPrecision::Bf16);
        let cast = estimate(&m, &nf4.clone().with_profile(Profile::peft_transformers())).unwrap();
        let kept = estimate(
            &m,
            &nf4.clone().with_profile(Profile {
                kbit_fp32_cast: false,
                ..Profile::peft_transformers()
            }),
        )
        .unwrap();
        let rest = (d.params() - d.layer_linear_params()) as f64;
        let diff = cast.breakdown.base_weights.as_f64() - kept.breakdown.base_weights.as_f64();
        assert!((diff - 2.0 * rest).abs() < 2.0, "{diff} vs {}", 2.0 * rest);
        // and the head's bf16 cast is kept for the backward
        assert_eq!(
            cast.breakdown.autocast_weight_copies.0,
            2 * d.vocab * d.hidden
        );
        // not for a GPTQ base (PEFT skips the cast there)
        let gptq = Settings::default()
            .with_base_dtype(BaseDtype::Gptq4 { group_size: 128 })
            .with_profile(Profile::peft_transformers());
        let a = estimate(&m, &gptq).unwrap();
        let b = estimate(
            &m,
            &gptq.clone().with_profile(Profile {
                kbit_fp32_cast: false,
                ..Profile::peft_transformers()
            }),
        )
        .unwrap();
        assert_eq!(a.peak_allocated, b.peak_allocated);
    }

    #[test]
    fn block_rounding_adds_to_reserved_on_cuda_only() {
        assert_eq!(cuda_block_overhead(512.0), 0.0);
        assert_eq!(cuda_block_overhead(100.0), 412.0);
        // 8 MiB: two per 20 MiB segment
        let mib = 1_048_576.0;
        assert_eq!(cuda_block_overhead(8.0 * mib), 2.0 * mib);
        assert_eq!(cuda_block_overhead(11.0 * mib), mib);
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let s = Settings::default()
            .with_base_dtype(BaseDtype::Nf4 {
                double_quant: false,
            })
            .with_profile(Profile::peft_transformers());
        let cuda = estimate(&m, &s).unwrap();
        let cpu = estimate(&m, &s.clone().with_device(Device::cpu())).unwrap();
        assert_eq!(cuda.peak_allocated, cpu.peak_allocated);
        assert!(cuda.peak_reserved.0 > cuda.peak_allocated.0 + (100 << 20));
        assert_eq!(cpu.peak_reserved, cpu.peak_allocated);
    }

    #[test]
    fn this_sdks_quantized_linears_keep_no_dense_weight() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let q4 = Settings::default().with_base_dtype(BaseDtype::Q4_0);
        let bf16 = Settings::default().with_base_dtype(BaseDtype::Bf16);
        assert!(q4.device.is_cuda());
        // On CUDA (tensor-op decode, 4.25 B per weight for a bf16 Q4_0 tile) and on the CPU (the
        // kernel: an f32 tile and its bf16 copy, 6 B per weight), the activations of a Q4_0 base
        // exceed a bf16 base's by one tile's decode at most — not by the 2 B per weight of every
        // layer linear (13 GB for Llama-2-7B) that a dense copy kept for the backward would cost.
        let tile = OURS_QLINEAR_TILE_ELEMENTS as f64;
        for (device, per_weight) in [
            (
                q4.device,
                ours_dequant_bytes_per_weight(BaseDtype::Q4_0, 2.0),
            ),
            (Device::cpu(), 6.0),
        ] {
            let q = estimate(&m, &q4.clone().with_device(device)).unwrap();
            let d = estimate(&m, &bf16.clone().with_device(device)).unwrap();
            let diff = q.breakdown.activations.as_f64() - d.breakdown.activations.as_f64();
            assert!(
                (0.0..=tile * per_weight).contains(&diff),
                "{device:?}: {diff} vs ≤ {}",
                tile * per_weight
            );
            assert!(
                !q.notes.iter().any(|n| n.contains("dequantized weights")),
                "{:?}",
                q.notes
            );
        }
        assert_eq!(ours_dequant_bytes_per_weight(BaseDtype::Q4_0, 2.0), 4.25);
    }

    #[test]
    fn table_lists_every_term_and_totals() {
        let m = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        let e = estimate(
            &m,
            &Settings::default().with_profile(Profile::peft_transformers()),
        )
        .unwrap();
        let t = e.to_table();
        for term in e.breakdown.terms() {
            // a language model draws no sample images and keeps no image data: no such rows
            assert_eq!(
                t.contains(term.name),
                !matches!(term.name, "sample images" | "kept data"),
                "{}: {t}",
                term.name
            );
        }
        assert!(t.contains("peak reserved") && t.contains("total (process peak)"));
        let j: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(j["peak_allocated"].as_u64(), Some(e.peak_allocated.0));
        // The printed terms add up to the process peak.
        let sum: Bytes = e.breakdown.terms().iter().map(|t| t.bytes).sum();
        let diff = sum.as_f64() - e.peak_process.as_f64();
        assert!(diff.abs() < 16.0, "{diff}");
    }
}
