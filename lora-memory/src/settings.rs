//! Training settings that change the memory of a run.

use crate::units::Bytes;
use serde::{Deserialize, Serialize};

/// Storage type of the frozen base weights.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BaseDtype {
    /// 4 bytes/param.
    F32,
    /// 2 bytes/param.
    F16,
    /// 2 bytes/param.
    Bf16,
    /// QLoRA 4-bit NormalFloat, block 64: 0.5 B/param + one fp32 absmax per 64 (= 0.5625 B/param);
    /// with double quantization the absmax is 8-bit with an fp32 constant per 256 blocks
    /// (= 0.5 + 1/64 + 4/(64·256) ≈ 0.516 B/param). Only the decoder-layer linears are quantized;
    /// embeddings, `lm_head` and norms stay 16-bit (QLoRA, arXiv:2305.14314, §2 and App. B).
    Nf4 {
        /// Double quantization of the block constants.
        double_quant: bool,
    },
    /// GGUF Q8_0: 34 bytes per 32 weights (ggml type traits).
    Q8_0,
    /// GGUF Q4_0: 18 bytes per 32 weights.
    Q4_0,
    /// GGUF Q4_1: 20 bytes per 32 weights.
    Q4_1,
    /// GGUF Q5_0: 22 bytes per 32 weights.
    Q5_0,
    /// GGUF Q5_1: 24 bytes per 32 weights.
    Q5_1,
    /// GGUF Q4_K: 144 bytes per super-block of 256 in the file, held in memory as 148 (lora-core's
    /// `QuantWeight` unpacks the 12 bytes of 6-bit sub-block scales and minimums to 16).
    Q4K,
    /// GGUF Q5_K: 176 bytes per 256 in the file, 180 in memory (as `Q4K`).
    Q5K,
    /// GGUF Q6_K: 210 bytes per 256 weights.
    Q6K,
    /// fp8 e4m3fn (kohya's `fp8_base`): 1 byte/param, no scale; upcast per layer for the product.
    Fp8,
    /// GPTQ int4 (AutoGPTQ layout): 0.5 B/param + per group of `group_size` one fp16 scale and one
    /// packed 4-bit zero (`(2 + 0.5) / group_size` B/param). Qwen's "Q-LoRA" uses this base.
    Gptq4 {
        /// Quantization group size (128 in Qwen's Int4 checkpoints).
        group_size: u32,
    },
}

impl BaseDtype {
    /// Bytes per quantized parameter (see each variant).
    pub fn bytes_per_param(self) -> f64 {
        match self {
            BaseDtype::F32 => 4.0,
            BaseDtype::F16 | BaseDtype::Bf16 => 2.0,
            BaseDtype::Nf4 {
                double_quant: false,
            } => 0.5 + 4.0 / 64.0,
            BaseDtype::Nf4 { double_quant: true } => 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0),
            BaseDtype::Q8_0 => 34.0 / 32.0,
            BaseDtype::Q4_0 => 18.0 / 32.0,
            BaseDtype::Q4_1 => 20.0 / 32.0,
            BaseDtype::Q5_0 => 22.0 / 32.0,
            BaseDtype::Q5_1 => 24.0 / 32.0,
            BaseDtype::Q4K => 148.0 / 256.0,
            BaseDtype::Q5K => 180.0 / 256.0,
            BaseDtype::Q6K => 210.0 / 256.0,
            BaseDtype::Fp8 => 1.0,
            BaseDtype::Gptq4 { group_size } => 0.5 + 2.5 / f64::from(group_size.max(1)),
        }
    }

    /// The name users write: `fp32`, `fp16`, `bf16`, `nf4`, `nf4 + double quant`, `Q8_0`,
    /// `Q4_0`, `Q4_1`, `Q5_0`, `Q5_1`, `Q4_K`, `Q5_K`, `Q6_K`, `fp8 e4m3fn`,
    /// `GPTQ int4 (group 128)`.
    pub fn name(self) -> String {
        match self {
            BaseDtype::F32 => "fp32".into(),
            BaseDtype::F16 => "fp16".into(),
            BaseDtype::Bf16 => "bf16".into(),
            BaseDtype::Nf4 {
                double_quant: false,
            } => "nf4".into(),
            BaseDtype::Nf4 { double_quant: true } => "nf4 + double quant".into(),
            BaseDtype::Q8_0 => "Q8_0".into(),
            BaseDtype::Q4_0 => "Q4_0".into(),
            BaseDtype::Q4_1 => "Q4_1".into(),
            BaseDtype::Q5_0 => "Q5_0".into(),
            BaseDtype::Q5_1 => "Q5_1".into(),
            BaseDtype::Q4K => "Q4_K".into(),
            BaseDtype::Q5K => "Q5_K".into(),
            BaseDtype::Q6K => "Q6_K".into(),
            BaseDtype::Fp8 => "fp8 e4m3fn".into(),
            BaseDtype::Gptq4 { group_size } => format!("GPTQ int4 (group {group_size})"),
        }
    }

    /// True for the quantized storage types (the block formats and fp8).
    pub fn is_quantized(self) -> bool {
        !matches!(self, BaseDtype::F32 | BaseDtype::F16 | BaseDtype::Bf16)
    }

    /// Whether this is one of GGUF's block types (Q8_0 … Q6_K).
    pub fn is_gguf(self) -> bool {
        matches!(
            self,
            BaseDtype::Q8_0
                | BaseDtype::Q4_0
                | BaseDtype::Q4_1
                | BaseDtype::Q5_0
                | BaseDtype::Q5_1
                | BaseDtype::Q4K
                | BaseDtype::Q5K
                | BaseDtype::Q6K
        )
    }
}

/// Mixed-precision mode (the `mixed_precision` key of accelerate / kohya configs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MixedPrecision {
    /// Compute in the base dtype (quantized bases compute in bf16).
    No,
    /// fp16 autocast: matmuls in fp16; a 32-bit base is cast per op.
    Fp16,
    /// bf16 autocast.
    Bf16,
    /// Everything bf16, no autocast (torchtune's `dtype: bf16`, kohya `--full_bf16`).
    FullBf16,
    /// Everything fp16, no autocast: kohya `--full_fp16`, and DeepSpeed's fp16 engine, which
    /// casts the whole model (adapters included) to fp16 and keeps the fp32 master weights in its
    /// optimizer ([`Profile::deepspeed`]). CUDA only. A 32-bit base is counted as cast to
    /// 16 bit, as with `FullBf16`.
    FullFp16,
}

impl MixedPrecision {
    /// The mode as configs spell it: `no`, `fp16`, `bf16`, `full_bf16`, `full_fp16`.
    pub fn name(self) -> &'static str {
        match self {
            MixedPrecision::No => "no",
            MixedPrecision::Fp16 => "fp16",
            MixedPrecision::Bf16 => "bf16",
            MixedPrecision::FullBf16 => "full_bf16",
            MixedPrecision::FullFp16 => "full_fp16",
        }
    }

    /// True for the modes that run the whole model in 16 bit without autocast.
    pub fn is_full_16bit(self) -> bool {
        matches!(self, MixedPrecision::FullBf16 | MixedPrecision::FullFp16)
    }
}

/// What is trained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// LoRA adapters on the target sites.
    Lora,
    /// DoRA (arXiv:2402.09353): LoRA plus a per-output magnitude vector; PEFT's implementation
    /// keeps the base output and the LoRA output of each adapted layer for the backward pass.
    Dora,
    /// Full fine-tuning: every parameter is trainable.
    Full,
}

/// LoRA hyper-parameters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoraSettings {
    /// Rank `r` (default 8).
    pub rank: u32,
    /// `alpha` (default 16); `scaling = alpha / rank`. No effect on memory.
    pub alpha: f32,
    /// `target_modules` with PEFT matching (exact name or `.`-suffix; `"all-linear"`), default
    /// `["q_proj", "v_proj"]`; for diffusion models e.g. `["to_q","to_k","to_v","to_out.0"]`.
    pub target_modules: Vec<String>,
    /// Rank of conv LoRA (LoCon) on ResNet convs; `None` = no conv adapters.
    pub conv_rank: Option<u32>,
    /// `lora_dropout` (default 0): with p > 0 each adapted layer keeps a dropped-out copy of its
    /// input and a 1-byte mask.
    pub dropout: f32,
}

impl Default for LoraSettings {
    fn default() -> Self {
        LoraSettings {
            rank: 8,
            alpha: 16.0,
            target_modules: vec!["q_proj".into(), "v_proj".into()],
            conv_rank: None,
            dropout: 0.0,
        }
    }
}

/// Optimizer.
///
/// bitsandbytes' paged variants (`paged_adamw_32bit`, `paged_adamw_8bit`, the QLoRA default) are
/// planned as their unpaged twins: their states live in CUDA unified memory, on the card until
/// it runs short, when pages move to host memory instead of failing. Counting them as resident
/// is the upper bound, so a plan never leans on paging (which stalls each step it happens in).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    /// AdamW with two fp32 states: 8 B per trainable parameter.
    AdamW,
    /// Block-wise 8-bit AdamW (bitsandbytes, arXiv:2110.02861): 2 B/param + one fp32 absmax per
    /// 2048-element block and state; tensors under 4096 elements stay 32-bit.
    AdamW8bit,
    /// Adafactor (arXiv:1804.04235), factored, no momentum: `4·(n + m)` bytes per `n×m` matrix,
    /// `4·n` for vectors.
    Adafactor,
    /// SGD: 4 B/param of momentum buffer when `momentum > 0`, nothing otherwise.
    Sgd {
        /// Momentum coefficient.
        momentum: f32,
    },
}

/// Diffusion: a sample grid drawn during or after training, as this SDK's SD job draws it
/// (lora-models `SdPipeline::sample_images`): the text encoders and the VAE on the device, one
/// prompt at a time through the UNet without gradients (batch 2 with classifier-free guidance:
/// unconditional + conditional), then each image decoded by the VAE on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleImages {
    /// Image size `[width, height]` in pixels; `None`: the training size (the largest bucket,
    /// else the resolution), what this SDK's jobs sample at — [`crate::fit()`]'s smaller
    /// resolutions then shrink the samples too.
    pub size: Option<[u32; 2]>,
    /// Prompts in the grid: the finished images stay on the device until the grid is written.
    pub prompts: u32,
    /// Classifier-free guidance (scale > 1): the UNet runs at batch 2.
    pub guidance: bool,
}

/// Image jobs: what the data source keeps in memory for the whole run, as this SDK's image
/// jobs keep it (lora-train's `ImageSource`): every image's latents, encoded once per image
/// (and per orientation with `flip_aug`), every caption's text-encoder outputs when the text
/// encoders are frozen and their outputs cached, and the fixed batches of the before/after
/// loss. The planner prices each entry at the training size (the largest bucket,
/// else the resolution): latents `4·C·(W/f)·(H/f)` bytes (fp32), text-encoder outputs in the
/// text encoders' dtype. Counted on a CPU run only, where that memory is the device's; on CUDA
/// it is host memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct KeptData {
    /// Latents kept: one per image, two with `flip_aug` (both orientations get encoded).
    pub latents: u64,
    /// Captions whose text-encoder outputs are kept (0 when they are encoded in each step).
    pub captions: u64,
    /// Samples in the fixed evaluation batches (latents and conditioning, stacked).
    pub eval_samples: u64,
}

/// Attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    /// `scaled_dot_product_attention` with a flash / memory-efficient kernel: O(s) memory.
    Sdpa,
    /// Eager attention: materializes the `heads × s × s` probabilities (and keeps them).
    Math,
}

/// Where the run executes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Device {
    /// A CUDA GPU.
    Cuda {
        /// CUDA context + kernels resident on the card (0.3–1.4 GB depending on GPU, driver and
        /// lazy module loading; libtorch enables lazy loading). Default 0.5 GB.
        context: Bytes,
        /// cuBLAS / cuDNN workspaces (default 64 MiB).
        workspace: Bytes,
    },
    /// The CPU (process resident memory).
    Cpu {
        /// Resident memory of the runtime besides tensors (libtorch's code and data pages, the
        /// tokenizer, heap arenas, thread pools). Default 0.51 GB, the largest of
        /// `peak RSS − tensor peak` measured with `lora-train train` on SmolLM2-135M (the README
        /// demo config, 2 steps of 4 × 128 tokens, AMD EPYC, AVX2): 455–480 MB at the steps'
        /// peak over the four runs dense / Q4_1 base × with / without gradient checkpointing,
        /// and 505 MB at the load peak of the GGUF decoded to a dense f32 base, which holds the
        /// file's mapped pages beside the decoded weights. (An AVX-512 Xeon measured 0.44 GB
        /// before the steps.)
        runtime: Bytes,
    },
}

impl Device {
    /// CUDA with the default context and workspace.
    pub fn cuda() -> Device {
        Device::Cuda {
            context: Bytes(500_000_000),
            workspace: Bytes(64 << 20),
        }
    }

    /// CPU with the default runtime baseline.
    pub fn cpu() -> Device {
        Device::Cpu {
            runtime: Bytes(510_000_000),
        }
    }

    /// True for CUDA.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Device::Cuda { .. })
    }
}

/// The training stack whose memory behaviour is modelled. Each one is a set of documented,
/// explicit differences, not a correction factor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Framework {
    /// This SDK's trainer (lora-train): fp32 adapters; the LoRA input is cast to the adapter dtype
    /// (one copy per adapted layer, like PEFT); HF-equivalent layer math.
    Ours,
    /// PEFT + transformers: fp32 adapters (`autocast_adapter_dtype`), the LoRA input cast to fp32
    /// per adapted layer, logits upcast to fp32 and kept next to the 16-bit ones, `repeat_kv`
    /// materializing GQA keys/values, `torch.optim.AdamW` with `foreach` temporaries on CUDA.
    PeftTransformers,
    /// torchtune: adapters in the model dtype (`dtype: bf16`, so 2-byte adapters, grads and
    /// optimizer states), the LoRA branch reads the same input as the base (no copy), output
    /// projection upcast to fp32 (`.float()`) before the loss.
    Torchtune,
}

/// DeepSpeed ZeRO stage 1 or 2 on one GPU (HF Trainer `--deepspeed ds_config.json`), with its
/// fp16/bf16 engine ([`MixedPrecision::FullFp16`] / [`MixedPrecision::FullBf16`]).
///
/// What it holds, from `deepspeed/runtime/zero/stage_1_and_2.py` (`DeepSpeedZeroOptimizer`):
/// - the trainable parameters in the 16-bit model dtype, their fp32 master copy
///   (`single_partition_of_fp32_groups`) and fp32 optimizer states (its fused Adam: no
///   `foreach` temporaries);
/// - the 16-bit gradients in one flat buffer (`contiguous_gradients`), and at the step an fp32
///   copy of them for the master weights;
/// - during the backward pass, the gradient bucket buffers (`ipg_buffer`):
///   `reduce_bucket_size` elements of the 16-bit dtype each, two of them with `overlap_comm`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct DeepSpeedZero {
    /// `zero_optimization.reduce_bucket_size`, in elements (DeepSpeed's default 5e8; the HF
    /// Trainer's `"auto"` sets `hidden_size²`).
    pub reduce_bucket_size: u64,
    /// `zero_optimization.overlap_comm`: a second bucket buffer.
    pub overlap_comm: bool,
}

impl Default for DeepSpeedZero {
    fn default() -> Self {
        DeepSpeedZero {
            reduce_bucket_size: 500_000_000,
            overlap_comm: false,
        }
    }
}

impl DeepSpeedZero {
    /// Bytes of the gradient bucket buffers during the backward pass (16-bit elements).
    pub fn bucket_bytes(&self) -> f64 {
        let buffers = if self.overlap_comm { 2.0 } else { 1.0 };
        buffers * 2.0 * self.reduce_bucket_size as f64
    }
}

/// The kernel a GPTQ base multiplies with (AutoGPTQ / optimum `QuantLinear` backends).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GptqKernel {
    /// The `cuda_old` / Triton path training uses (`GPTQConfig(disable_exllama=True)` /
    /// `use_exllama=False`; the exllama kernels have no backward pass): the weight is
    /// dequantized to fp16 per call (8 B per weight while decoding) and autograd keeps the fp16
    /// weight for the input gradient; no scratch buffer. The default.
    Dequantize,
    /// ExLlama v1: one scratch of `max_input_len × max(in, out)` fp16 (`temp_state`) plus the
    /// largest `in × out` fp16 (`temp_dq`) per device (`exllama_set_max_input_length`,
    /// default 2048 tokens).
    ExllamaV1 {
        /// `max_input_length` the buffers are sized for.
        max_input_len: u32,
    },
    /// ExLlama v2: one scratch per device of the largest layer's
    /// `in·out·2 + out·max_input_len·max_batch_size·4` bytes (`QuantLinear.scratch_space_fixed`,
    /// defaults 2048 tokens × 8 sequences).
    ExllamaV2 {
        /// Tokens per sequence the scratch is sized for.
        max_input_len: u32,
        /// Sequences the scratch is sized for.
        max_batch_size: u32,
    },
}

impl GptqKernel {
    /// Scratch bytes for a model whose linears are `(in, out)` pairs.
    pub fn scratch_bytes(&self, linears: impl Iterator<Item = (u64, u64)>) -> f64 {
        let mut largest_area = 0.0f64;
        let mut widest = 0.0f64;
        let mut widest_out = 0.0f64;
        for (i, o) in linears {
            let (i, o) = (i as f64, o as f64);
            largest_area = largest_area.max(i * o);
            widest = widest.max(i.max(o));
            widest_out = widest_out.max(o);
        }
        match *self {
            GptqKernel::Dequantize => 0.0,
            GptqKernel::ExllamaV1 { max_input_len } => {
                2.0 * (f64::from(max_input_len) * widest + largest_area)
            }
            GptqKernel::ExllamaV2 {
                max_input_len,
                max_batch_size,
            } => {
                2.0 * largest_area
                    + 4.0 * widest_out * f64::from(max_input_len) * f64::from(max_batch_size)
            }
        }
    }
}

/// Reference-framework profile: the framework plus optional behaviours that change memory.
///
/// The profiles, the releases they describe and the public measurements each was checked on
/// ([`crate::cases`]):
///
/// | profile | describes | checked on |
/// |---|---|---|
/// | [`Profile::ours`] | this SDK's trainer (fused chunked LM head + loss, fp32 adapters and optimizer states, chunked AdamW; quantized linears computed one tile of ≤ 1 Mi weights at a time, none kept dense for the backward: the shim's kernel on the CPU, tensor-op decodes on CUDA) | lora-train's measured-plan tests (counting allocator: dense and quantized SmolLM2, the SD runs) |
/// | [`Profile::peft_transformers`] | PEFT ≥ 0.12 with transformers ≥ 4.45 (fp32 logits upcast inside the loss, `repeat_kv`, foreach AdamW on CUDA); a bitsandbytes base prepared by `prepare_model_for_kbit_training` (TRL's `SFTTrainer`) | P1–P5 (PEFT MetaMathQA), `cpu-*` (PUBLIC.md CPU table), Q4/Q4q (Qwen), S1 (PEFT DreamBooth, with `zero_grad_keeps_buffers` for torch < 2.0), the Unsloth HF+FA2 boundary cases |
/// | `legacy_fp32_logits` | transformers < 4.45 (`.float()` logits and the shifted copy) | T1–T4, F1 |
/// | [`Profile::bitsandbytes_old`] | bitsandbytes < 0.43.2 (`MatMul4Bit` saves the input of every 4-bit linear) | F1 (bitsandbytes 0.43.0) |
/// | [`Profile::torchtune`] | torchtune single-device recipes (model-dtype adapters, chunked loss, activation offloading, `torch.compile` as options) | T1–T12 |
/// | `model_dtype_loss` + `deepspeed` + `gptq_kernel: dequantize` | a model whose own code computes the loss on 16-bit logits (Qwen's `modeling_qwen.py`) trained by the HF Trainer under DeepSpeed ZeRO-2 fp16 on an AutoGPTQ base with ExLlama off (QwenLM/Qwen `finetune_qlora_single_gpu.sh`) | Q4q-256 … Q4q-8192 |
///
/// The sequence-length terms, per token unless said (`e` = compute-dtype bytes, `V` = vocab):
/// - loss: `(e + 12)·V` with the fp32 upcast (transformers ≥ 4.45, or any autocast run),
///   `20·V` for `legacy_fp32_logits`, `3·e·V` for `model_dtype_loss` without autocast, one
///   chunk for `chunked_cross_entropy` and for this SDK's fused head + loss;
/// - attention: SDPA (flash / memory-efficient) keeps q, k, v, out and a logsumexp per head;
///   [`Attention::Math`] adds the `heads × s` probabilities (fp32 softmax + its cast);
/// - the `[b, 1, s, s]` additive mask, `e·b·s²` once (shared by the layers): always for this
///   SDK (packed rows carry document boundaries), for transformers with eager attention or
///   padded batches (`variable_length`); none for transformers' SDPA on unpadded batches;
/// - checkpointing keeps the layer inputs and recomputes one layer; without it every layer's
///   saved tensors stay.
///
/// litgpt and Unsloth have no profile: no public measurement with a full configuration was
/// found to check one against (Unsloth's published context limits are used for the HF+FA2
/// side of its comparison only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Profile {
    /// The framework.
    pub framework: Framework,
    /// bitsandbytes before 0.43.2: `MatMul4Bit` saved the input of every 4-bit linear for the
    /// backward pass, even frozen ones.
    pub bnb_saves_4bit_inputs: bool,
    /// Fused AdamW (`fused=True`): no `foreach` temporaries in the optimizer step.
    pub fused_adamw: bool,
    /// `torch.compile` of the model: Inductor fuses pointwise chains, so norms keep only their 16-bit input
    /// and SiLU·up keeps only gate and up (AOTAutograd's min-cut partitioner recomputes cheap
    /// pointwise ops). The loss is only fused with `compiled_loss`.
    pub torch_compile: bool,
    /// The loss is compiled too (torchtune `compile: true` compiles the loss separately): the
    /// fused cross-entropy keeps the 16-bit logits and their logsumexp, no fp32 copy.
    pub compiled_loss: bool,
    /// `optimizer.zero_grad(set_to_none=False)` (the PyTorch default before 2.0): gradient
    /// buffers live through the whole backward pass.
    pub zero_grad_keeps_buffers: bool,
    /// Chunked cross-entropy (torchtune `CEWithChunkedOutputLoss`, 8 chunks): only one chunk of
    /// fp32 logits exists at a time.
    pub chunked_cross_entropy: bool,
    /// Batches are padded per batch to varying lengths (unpacked datasets): the caching allocator
    /// cannot reuse blocks across shapes, see [`crate::estimate::ALLOCATOR_FRAGMENTATION_VARIABLE`].
    pub variable_length: bool,
    /// GQA keys/values are expanded to all heads before attention (HF `repeat_kv`). Our
    /// trainer ([`Framework::Ours`]) does so on CUDA only: on the CPU its attention reads them
    /// grouped, and computes bf16 attention in f32.
    pub repeat_kv: bool,
    /// transformers before 4.45 and torchtune's 2024 recipes: the model returns fp32 logits
    /// (`.float()`) and the loss makes a shifted contiguous copy
    /// (`logits[..., :-1, :].contiguous()`) before `cross_entropy`: `20·V` bytes per token at
    /// the loss backward instead of `(e + 12)·V`.
    pub legacy_fp32_logits: bool,
    /// torchtune `enable_activation_offloading`: checkpointed layer inputs live in host memory;
    /// the device keeps only the layers in flight.
    pub activation_offloading: bool,
    /// PEFT's `prepare_model_for_kbit_training` (called by TRL's `SFTTrainer` and the PEFT
    /// QLoRA guides for a 4/8-bit base; `peft/utils/other.py`): every parameter that is not
    /// quantized — embeddings, norms, `lm_head` — is cast to fp32. Only with a bitsandbytes
    /// (NF4) base: PEFT skips the cast for GPTQ bases.
    /// The fp32 embedding makes the residual stream fp32 (4 B per element instead of 2), and
    /// under autocast the head's 16-bit cast of its weight (`2·V·h` bytes) is saved for the
    /// backward of the logits matmul.
    pub kbit_fp32_cast: bool,
    /// The model's own code computes the loss on its 16-bit logits (no `.float()`; Qwen's
    /// remote `modeling_qwen.py`, GPT-2-era heads) and, without autocast
    /// ([`MixedPrecision::is_full_16bit`], or a 16-bit base with no mixed precision), nothing
    /// lifts `log_softmax` to fp32: the loss holds the logits, their shifted copy and
    /// `log_softmax`'s output, all 16-bit (`3·e·V` bytes per token; `(e + 12)·V` otherwise).
    /// Under autocast `log_softmax` / `cross_entropy` run in fp32 whatever the code does.
    pub model_dtype_loss: bool,
    /// DeepSpeed ZeRO-1/2 on one GPU, see [`DeepSpeedZero`].
    pub deepspeed: Option<DeepSpeedZero>,
    /// The kernel of a GPTQ base on CUDA (ignored for other bases, and on the CPU, where the
    /// ExLlama kernels do not run). Default [`GptqKernel::Dequantize`], the one training uses.
    pub gptq_kernel: GptqKernel,
}

impl Default for Profile {
    fn default() -> Self {
        Profile::ours()
    }
}

impl Profile {
    /// This SDK's trainer.
    pub fn ours() -> Profile {
        Profile {
            framework: Framework::Ours,
            bnb_saves_4bit_inputs: false,
            fused_adamw: false,
            torch_compile: false,
            chunked_cross_entropy: false,
            variable_length: false,
            repeat_kv: true,
            legacy_fp32_logits: false,
            activation_offloading: false,
            compiled_loss: false,
            zero_grad_keeps_buffers: false,
            kbit_fp32_cast: false,
            model_dtype_loss: false,
            deepspeed: None,
            gptq_kernel: GptqKernel::Dequantize,
        }
    }

    /// PEFT + transformers (current releases). A quantized base is prepared the way PEFT's
    /// QLoRA guides and TRL do it ([`Profile::kbit_fp32_cast`]).
    pub fn peft_transformers() -> Profile {
        Profile {
            framework: Framework::PeftTransformers,
            kbit_fp32_cast: true,
            ..Profile::ours()
        }
    }

    /// PEFT + transformers with bitsandbytes before 0.43.2 (extra saved input per 4-bit linear).
    pub fn bitsandbytes_old() -> Profile {
        Profile {
            bnb_saves_4bit_inputs: true,
            ..Profile::peft_transformers()
        }
    }

    /// torchtune single-device recipes.
    pub fn torchtune() -> Profile {
        Profile {
            framework: Framework::Torchtune,
            ..Profile::ours()
        }
    }
}

/// Everything about a run that changes its peak memory.
///
/// Defaults: bf16 base, no autocast, LoRA r8 α16 on q_proj/v_proj, micro_batch 1,
/// gradient_accumulation_steps 1, seq_len 512, resolution 512, no checkpointing, AdamW, SDPA,
/// CUDA, this SDK's profile.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Frozen base storage.
    pub base_dtype: BaseDtype,
    /// Mixed precision.
    pub mixed_precision: MixedPrecision,
    /// LoRA, DoRA or full fine-tuning.
    pub method: Method,
    /// LoRA hyper-parameters (ignored for `Method::Full`).
    pub lora: LoraSettings,
    /// Sequences (or images) per forward pass.
    pub micro_batch: u32,
    /// Micro-batches accumulated per optimizer step (effective batch = micro_batch × this).
    pub gradient_accumulation_steps: u32,
    /// Tokens per sequence (decoders): the padded length of the longest batch.
    pub seq_len: u32,
    /// Square training resolution in pixels (diffusion).
    pub resolution: u32,
    /// Largest aspect bucket `[width, height]` in pixels, when bucketing (overrides `resolution`
    /// for the peak).
    pub largest_bucket: Option<[u32; 2]>,
    /// Recompute each block in the backward pass.
    pub gradient_checkpointing: bool,
    /// Optimizer.
    pub optimizer: Optimizer,
    /// Latents precomputed: the VAE is not on the device.
    pub cache_latents: bool,
    /// Text-encoder outputs precomputed: the text encoders are not on the device.
    pub cache_text_encoder_outputs: bool,
    /// Train LoRA on the text encoder(s) too.
    pub train_text_encoder: bool,
    /// DreamBooth prior preservation: a class image per instance image (doubles the batch).
    pub prior_preservation: bool,
    /// Diffusion: the VAE and the text encoder(s) stay on the device even when latents or
    /// text-encoder outputs are cached (a CPU run: moving them "off the device" keeps them in
    /// the same memory). With `false` (the default) they leave the device once the caches are
    /// built and come back only to draw sample images, as in kohya's scripts and this SDK's SD
    /// job with `cache_latents`.
    pub keep_models_loaded: bool,
    /// Diffusion: crops are drawn at random each epoch (kohya `random_crop`), so latents cannot
    /// all be encoded before training and the VAE stays on the device even with
    /// `cache_latents` (kohya refuses to cache latents with random crops).
    pub random_crop: bool,
    /// Diffusion: captions change between epochs (kohya `shuffle_caption`,
    /// `caption_dropout_rate`, `caption_tag_dropout_rate`, a random caption line), so
    /// text-encoder outputs cannot all be computed before training and the frozen text encoders
    /// stay on the device even with `cache_text_encoder_outputs`.
    pub varying_captions: bool,
    /// Attention kernel.
    pub attention: Attention,
    /// PEFT `modules_to_save`: whole modules trained in full next to the adapters — for
    /// decoders `embed_tokens` and/or `lm_head` (e.g. when new tokens are added). PEFT keeps
    /// the original module and a trainable copy in the module's dtype; each adds `V·h`
    /// parameters with their gradients and optimizer states (a dense `[V, h]` gradient for the
    /// embedding too).
    pub modules_to_save: Vec<String>,
    /// The output head `lm_head` is stored in the quantized base format too (llama.cpp's GGUF
    /// files quantize `output.weight`; bitsandbytes when `lm_head` is not in
    /// `llm_int8_skip_modules`). Default: the head stays 16-bit, as QLoRA does.
    pub quantize_lm_head: bool,
    /// With [`Settings::quantize_lm_head`]: the head's own stored format when it differs from
    /// [`Settings::base_dtype`]. llama.cpp's quantization mixes keep `output.weight` (or the tied
    /// `token_embd.weight`) at a wider type than the layers: the SmolLM2 Q4_1 file holds a Q8_0
    /// head (1.0625 B per weight against Q4_1's 0.625: 12 MB more for its 28 M weights).
    /// `None` (default): the head is stored as the layers are.
    pub lm_head_dtype: Option<BaseDtype>,
    /// A quantized base computes in fp32: its blocks are dequantized to fp32 and the
    /// non-quantized weights (norms, embeddings) are fp32 (this SDK with `model.dtype: f32`, its
    /// CPU default). `false`: 16-bit compute (bitsandbytes' `bnb_4bit_compute_dtype`). No
    /// effect on a dense base.
    pub quantized_compute_f32: bool,
    /// The trainer cannot hold a quantized base's other weights in 16 bit: they stay fp32
    /// whatever is asked (this SDK's LLaMA-family loader keeping blocks quantized,
    /// lora-models `WeightMode::KeepQuantized`), so [`crate::fit()`] keeps
    /// [`Settings::quantized_compute_f32`] on instead of proposing 16-bit compute. Default
    /// `false`.
    pub quantized_compute_f32_only: bool,
    /// Device.
    pub device: Device,
    /// Reference framework.
    pub profile: Profile,
    /// Data-parallel ranks (processes, one per GPU), each holding the whole model and training
    /// its own micro-batches (effective batch = micro_batch × gradient_accumulation_steps ×
    /// this): the estimate is per rank, plus the communication buffer of the gradient
    /// all-reduce when above 1. Default 1.
    pub world_size: u32,
    /// FLUX: transformer blocks kept on the host and moved onto the device for their forward
    /// and backward, counted as kohya sd-scripts' `blocks_to_swap` does
    /// (`library/flux_models.py`, `enable_block_swap`): `N / 2` double-stream blocks and
    /// `2·(N − N / 2)` single-stream blocks. 0 (the default) keeps every block on the device.
    pub blocks_to_swap: u32,
    /// FLUX: LoRA only inside the blocks, on `(double, single)` of the double- and
    /// single-stream blocks (kohya's `networks.lora_flux`, with its `train_blocks` /
    /// `train_double_block_indices` / `train_single_block_indices` network arguments); the
    /// embedders and the output head carry none. `None` (the default): `target_modules` is
    /// matched against every transformer linear.
    pub flux_trained_blocks: Option<(u64, u64)>,
    /// Storage of the frozen text encoders while they are on the device (T5-XXL is 9.5 GB in
    /// 16 bit; kohya recommends an fp8 T5 below 10 GB cards). `None`: 16 bit (32 bit for an
    /// fp32 base).
    pub text_encoder_dtype: Option<BaseDtype>,
    /// FLUX: T5 tokens per caption (kohya `t5xxl_max_token_length`). `None`: the model's
    /// default, 512 for FLUX.1-dev and 256 for schnell.
    pub text_tokens: Option<u32>,
    /// Diffusion (SD 1.x / SDXL): sample images are drawn during or after the run; their
    /// moment (frozen models back on the device, the UNet's inference activations, one image's
    /// VAE decode) is planned next to the training step and the larger of the two is the peak.
    /// `None` (default): no sample images.
    pub sample_images: Option<SampleImages>,
    /// Image jobs: the latents, text-encoder outputs and evaluation samples the run keeps in
    /// memory ([`KeptData`]). `None` (default): none counted (the data is not known yet).
    pub kept_data: Option<KeptData>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            base_dtype: BaseDtype::Bf16,
            mixed_precision: MixedPrecision::No,
            method: Method::Lora,
            lora: LoraSettings::default(),
            micro_batch: 1,
            gradient_accumulation_steps: 1,
            seq_len: 512,
            resolution: 512,
            largest_bucket: None,
            gradient_checkpointing: false,
            optimizer: Optimizer::AdamW,
            cache_latents: false,
            cache_text_encoder_outputs: false,
            train_text_encoder: false,
            prior_preservation: false,
            keep_models_loaded: false,
            random_crop: false,
            varying_captions: false,
            attention: Attention::Sdpa,
            modules_to_save: Vec::new(),
            quantize_lm_head: false,
            lm_head_dtype: None,
            quantized_compute_f32: false,
            quantized_compute_f32_only: false,
            device: Device::cuda(),
            profile: Profile::ours(),
            world_size: 1,
            blocks_to_swap: 0,
            flux_trained_blocks: None,
            text_encoder_dtype: None,
            text_tokens: None,
            sample_images: None,
            kept_data: None,
        }
    }
}

macro_rules! setter {
    ($(#[$m:meta])* $name:ident, $field:ident : $ty:ty) => {
        $(#[$m])*
        pub fn $name(mut self, v: $ty) -> Self {
            self.$field = v;
            self
        }
    };
}

impl Settings {
    setter!(/// Sets `base_dtype`.
        with_base_dtype, base_dtype: BaseDtype);
    setter!(/// Sets `mixed_precision`.
        with_mixed_precision, mixed_precision: MixedPrecision);
    setter!(/// Sets `method`.
        with_method, method: Method);
    setter!(/// Sets `micro_batch`.
        with_micro_batch, micro_batch: u32);
    setter!(/// Sets `gradient_accumulation_steps`.
        with_gradient_accumulation_steps, gradient_accumulation_steps: u32);
    setter!(/// Sets `world_size` (data-parallel ranks).
        with_world_size, world_size: u32);
    setter!(/// Sets `blocks_to_swap` (FLUX).
        with_blocks_to_swap, blocks_to_swap: u32);
    setter!(/// Sets `flux_trained_blocks` (FLUX: `(double, single)` blocks with LoRA).
        with_flux_trained_blocks, flux_trained_blocks: Option<(u64, u64)>);
    setter!(/// Sets `text_encoder_dtype`.
        with_text_encoder_dtype, text_encoder_dtype: Option<BaseDtype>);
    setter!(/// Sets `text_tokens` (FLUX T5 tokens per caption).
        with_text_tokens, text_tokens: Option<u32>);
    setter!(/// Sets `seq_len`.
        with_seq_len, seq_len: u32);
    setter!(/// Sets `resolution`.
        with_resolution, resolution: u32);
    setter!(/// Sets `largest_bucket`.
        with_largest_bucket, largest_bucket: Option<[u32; 2]>);
    setter!(/// Sets `gradient_checkpointing`.
        with_gradient_checkpointing, gradient_checkpointing: bool);
    setter!(/// Sets `optimizer`.
        with_optimizer, optimizer: Optimizer);
    setter!(/// Sets `cache_latents`.
        with_cache_latents, cache_latents: bool);
    setter!(/// Sets `cache_text_encoder_outputs`.
        with_cache_text_encoder_outputs, cache_text_encoder_outputs: bool);
    setter!(/// Sets `train_text_encoder`.
        with_train_text_encoder, train_text_encoder: bool);
    setter!(/// Sets `prior_preservation`.
        with_prior_preservation, prior_preservation: bool);
    setter!(/// Sets `keep_models_loaded`.
        with_keep_models_loaded, keep_models_loaded: bool);
    setter!(/// Sets `random_crop`.
        with_random_crop, random_crop: bool);
    setter!(/// Sets `varying_captions`.
        with_varying_captions, varying_captions: bool);
    setter!(/// Sets `attention`.
        with_attention, attention: Attention);
    setter!(/// Sets `quantize_lm_head`.
        with_quantize_lm_head, quantize_lm_head: bool);
    setter!(/// Sets `lm_head_dtype`.
        with_lm_head_dtype, lm_head_dtype: Option<BaseDtype>);
    setter!(/// Sets `quantized_compute_f32`.
        with_quantized_compute_f32, quantized_compute_f32: bool);
    setter!(/// Sets `quantized_compute_f32_only`.
        with_quantized_compute_f32_only, quantized_compute_f32_only: bool);
    setter!(/// Sets `sample_images`.
        with_sample_images, sample_images: Option<SampleImages>);
    setter!(/// Sets `kept_data`.
        with_kept_data, kept_data: Option<KeptData>);
    setter!(/// Sets `device`.
        with_device, device: Device);
    setter!(/// Sets `profile`.
        with_profile, profile: Profile);

    /// Sets the LoRA rank.
    pub fn with_rank(mut self, rank: u32) -> Self {
        self.lora.rank = rank;
        self
    }

    /// Sets the LoRA alpha.
    pub fn with_alpha(mut self, alpha: f32) -> Self {
        self.lora.alpha = alpha;
        self
    }

    /// Sets `target_modules`.
    pub fn with_target_modules<S: AsRef<str>>(mut self, targets: &[S]) -> Self {
        self.lora.target_modules = targets.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    /// Sets the conv LoRA rank.
    pub fn with_conv_rank(mut self, rank: Option<u32>) -> Self {
        self.lora.conv_rank = rank;
        self
    }

    /// Sets `modules_to_save` (`embed_tokens`, `lm_head`).
    pub fn with_modules_to_save<S: AsRef<str>>(mut self, modules: &[S]) -> Self {
        self.modules_to_save = modules.iter().map(|s| s.as_ref().to_string()).collect();
        self
    }

    /// Sets `lora_dropout`.
    pub fn with_lora_dropout(mut self, p: f32) -> Self {
        self.lora.dropout = p;
        self
    }

    /// True for an fp32 base, or a quantized one computing in fp32
    /// ([`Settings::quantized_compute_f32`]).
    pub fn computes_in_f32(&self) -> bool {
        self.base_dtype == BaseDtype::F32
            || (self.base_dtype.is_quantized() && self.quantized_compute_f32)
    }

    /// `micro_batch × gradient_accumulation_steps`.
    pub fn effective_batch(&self) -> u64 {
        u64::from(self.micro_batch) * u64::from(self.gradient_accumulation_steps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_precision_names_are_the_config_spellings() {
        for m in [
            MixedPrecision::No,
            MixedPrecision::Fp16,
            MixedPrecision::Bf16,
            MixedPrecision::FullBf16,
            MixedPrecision::FullFp16,
        ] {
            assert_eq!(
                serde_json::to_string(&m).unwrap(),
                format!("\"{}\"", m.name())
            );
        }
    }

    #[test]
    fn bytes_per_param_match_the_formats() {
        assert!(
            (BaseDtype::Nf4 {
                double_quant: false
            }
            .bytes_per_param()
                - 0.5625)
                .abs()
                < 1e-9
        );
        assert!((BaseDtype::Nf4 { double_quant: true }.bytes_per_param() - 0.516).abs() < 1e-3);
        assert_eq!(BaseDtype::Q4_1.bytes_per_param(), 0.625);
        assert_eq!(BaseDtype::Q8_0.bytes_per_param(), 1.0625);
        assert_eq!(BaseDtype::Fp8.bytes_per_param(), 1.0);
        assert_eq!(BaseDtype::Q4K.name(), "Q4_K");
    }

    #[test]
    fn settings_round_trip_through_json_and_fill_defaults() {
        let s = Settings::default()
            .with_rank(16)
            .with_optimizer(Optimizer::Sgd { momentum: 0.9 });
        let j = serde_json::to_string(&s).unwrap();
        let back: Settings = serde_json::from_str(&j).unwrap();
        assert_eq!(back, s);
        let partial: Settings = serde_json::from_str(
            r#"{"micro_batch": 4, "base_dtype": {"nf4": {"double_quant": true}}}"#,
        )
        .unwrap();
        assert_eq!(partial.micro_batch, 4);
        assert_eq!(partial.lora.rank, 8);
        assert_eq!(partial.base_dtype, BaseDtype::Nf4 { double_quant: true });
    }
}
