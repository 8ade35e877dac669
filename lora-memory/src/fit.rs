//! `fit()`: walk the ladder users know until a run fits a budget; the frontier
//! (`max_seq_len()`, `max_micro_batch()`, `frontier()`): the longest sequence and the largest
//! batch that fit a card. "Fits" is always the safe verdict of [`Check`], margin included.

use crate::error::Error;
use crate::estimate::{Estimate, estimate};
use crate::model::ModelDescriptor;
use crate::settings::{BaseDtype, MixedPrecision, Optimizer, Settings};
use crate::units::{Bytes, GIB};
use crate::verdict::Check;
use serde::{Deserialize, Serialize};

/// One change `fit` made, with why and what it bought.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// The setting changed (`micro_batch`, `gradient_checkpointing`, …).
    pub setting: String,
    /// Old value, as text.
    pub from: String,
    /// New value, as text.
    pub to: String,
    /// Why, in words.
    pub reason: String,
    /// Predicted peak after the change.
    pub peak_after: Bytes,
}

/// A config that fits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fit {
    /// The settings to use.
    pub settings: Settings,
    /// Changes made, in order.
    pub changes: Vec<Change>,
    /// The estimate of `settings`.
    pub estimate: Estimate,
    /// Budget − predicted peak.
    pub headroom: Bytes,
    /// The verdict of `estimate` against the budget (always [`crate::Verdict::Fits`]).
    pub check: Check,
}

/// Why `fit` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FitError {
    /// Estimating failed (invalid settings).
    #[error(transparent)]
    Estimate(#[from] Error),
    /// Even the most frugal config on the ladder does not fit.
    #[error("does not fit in {budget}: the smallest peak reached is {smallest_peak} after {} changes; a larger GPU or a smaller model is needed", changes.len())]
    DoesNotFit {
        /// The budget.
        budget: Bytes,
        /// The smallest predicted peak reached.
        smallest_peak: Bytes,
        /// The settings that reached it.
        settings: Box<Settings>,
        /// The changes tried and kept.
        changes: Vec<Change>,
    },
}

type Step = (
    &'static str,
    Applies,
    fn(&Settings) -> Option<(Settings, String, String, String)>,
);

fn halve_batch(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.micro_batch <= 1 {
        return None;
    }
    let eff = s.effective_batch();
    let mut n = s.clone();
    // the largest micro-batch ≤ half that divides the effective batch, so that micro-batch ×
    // accumulation is the effective batch exactly (a prime batch goes to 1 × batch)
    let half = u64::from(s.micro_batch / 2);
    let micro = (half.saturating_sub(1 << 16).max(1)..=half)
        .rev()
        .find(|d| eff % d == 0)
        .unwrap_or(1);
    let accumulation = u32::try_from(eff / micro).ok()?;
    n.micro_batch = u32::try_from(micro).ok()?;
    n.gradient_accumulation_steps = accumulation;
    Some((
        n.clone(),
        format!("{} × {}", s.micro_batch, s.gradient_accumulation_steps),
        format!("{} × {}", n.micro_batch, n.gradient_accumulation_steps),
        format!(
            "activations scale with micro_batch; gradient accumulation keeps the effective batch at {}",
            n.effective_batch()
        ),
    ))
}

fn mixed_precision(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.base_dtype.is_quantized()
        && s.quantized_compute_f32
        && s.quantized_compute_f32_only
        && s.mixed_precision == MixedPrecision::No
    {
        // the trainer keeps the base's other weights in fp32: autocast the matmuls only
        let mut n = s.clone();
        n.mixed_precision = MixedPrecision::Bf16;
        return Some((
            n,
            format!("{} base, no mixed precision", s.base_dtype.name()),
            format!("{} base, bf16 mixed precision", s.base_dtype.name()),
            "bf16 autocast halves most activations".into(),
        ));
    }
    if s.base_dtype.is_quantized() && s.quantized_compute_f32 && !s.quantized_compute_f32_only {
        // a quantized base dequantized to fp32: dequantize to bf16 and compute in bf16
        let mut n = s.clone();
        n.quantized_compute_f32 = false;
        if n.mixed_precision == MixedPrecision::No {
            n.mixed_precision = MixedPrecision::Bf16;
        }
        return Some((
            n,
            format!("{} base computing in fp32", s.base_dtype.name()),
            format!("{} base computing in bf16", s.base_dtype.name()),
            "dequantized weights and activations in 16 bit halve their bytes".into(),
        ));
    }
    if s.base_dtype != BaseDtype::F32 || s.mixed_precision != MixedPrecision::No {
        return None;
    }
    let mut n = s.clone();
    n.base_dtype = BaseDtype::Bf16;
    n.mixed_precision = MixedPrecision::Bf16;
    Some((
        n,
        "fp32 base, no mixed precision".into(),
        "bf16 base, bf16 mixed precision".into(),
        "a frozen bf16 base halves its weights; bf16 compute halves most activations".into(),
    ))
}

fn checkpointing(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.gradient_checkpointing {
        return None;
    }
    let mut n = s.clone();
    n.gradient_checkpointing = true;
    Some((
        n,
        "off".into(),
        "on".into(),
        "keeps only each block's input and recomputes the block in the backward pass (~30% slower)"
            .into(),
    ))
}

fn optimizer(s: &Settings) -> Option<(Settings, String, String, String)> {
    // DeepSpeed's engine brings its own (fused) AdamW
    if s.profile.deepspeed.is_some() {
        return None;
    }
    let (to, why) = match s.optimizer {
        Optimizer::AdamW => (
            Optimizer::AdamW8bit,
            "8-bit block-wise states: 2 B instead of 8 B per trainable parameter",
        ),
        Optimizer::AdamW8bit => (
            Optimizer::Adafactor,
            "factored second moment, no first moment",
        ),
        _ => return None,
    };
    let mut n = s.clone();
    n.optimizer = to;
    Some((
        n,
        format!("{:?}", s.optimizer),
        format!("{to:?}"),
        why.into(),
    ))
}

fn cache_inputs(s: &Settings) -> Option<(Settings, String, String, String)> {
    // What can be computed before training: latents unless crops are random, text-encoder
    // outputs unless the encoder is trained or the captions change between epochs.
    let mut n = s.clone();
    n.cache_latents |= !s.random_crop;
    n.cache_text_encoder_outputs |= !s.train_text_encoder && !s.varying_captions;
    if n.cache_latents == s.cache_latents
        && n.cache_text_encoder_outputs == s.cache_text_encoder_outputs
    {
        return None;
    }
    let what = |x: &Settings| match (x.cache_latents, x.cache_text_encoder_outputs) {
        (true, true) => "latents and text-encoder outputs cached",
        (true, false) => "latents cached",
        (false, true) => "text-encoder outputs cached",
        (false, false) => "nothing cached",
    };
    let reason = if s.keep_models_loaded {
        "precomputed latents and conditioning: the VAE and frozen text encoders no longer run per step"
    } else {
        "precomputed latents and conditioning let the VAE and frozen text encoders leave the device (back only for sample images)"
    };
    Some((n.clone(), what(s).into(), what(&n).into(), reason.into()))
}

fn lower_rank(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.method == crate::settings::Method::Full || s.lora.rank <= 4 {
        return None;
    }
    let mut n = s.clone();
    n.lora.rank = (s.lora.rank / 2).max(4);
    let ratio = s.lora.alpha / s.lora.rank as f32;
    n.lora.alpha = ratio * n.lora.rank as f32;
    if let Some(cr) = s.lora.conv_rank {
        n.lora.conv_rank = Some((cr / 2).max(1));
    }
    Some((
        n.clone(),
        format!("r{} α{}", s.lora.rank, s.lora.alpha),
        format!("r{} α{}", n.lora.rank, n.lora.alpha),
        "fewer adapter parameters, gradients and optimizer states (alpha scaled to keep alpha/rank)".into(),
    ))
}

fn quantize(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.base_dtype.is_quantized() || s.method == crate::settings::Method::Full {
        return None;
    }
    let mut n = s.clone();
    n.base_dtype = BaseDtype::Nf4 { double_quant: true };
    // QLoRA computes in 16 bit, unless the trainer holds the other weights in fp32
    n.quantized_compute_f32 = s.quantized_compute_f32_only;
    if n.mixed_precision == MixedPrecision::No {
        n.mixed_precision = MixedPrecision::Bf16;
    }
    Some((
        n,
        s.base_dtype.name(),
        "NF4 (double quant)".into(),
        "QLoRA: 4-bit NormalFloat base ≈ 0.52 B per linear parameter".into(),
    ))
}

fn fp8_base(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.base_dtype.is_quantized() || s.method == crate::settings::Method::Full {
        return None;
    }
    let mut n = s.clone();
    n.base_dtype = BaseDtype::Fp8;
    if n.mixed_precision == MixedPrecision::No {
        n.mixed_precision = MixedPrecision::Bf16;
    }
    Some((
        n,
        s.base_dtype.name(),
        BaseDtype::Fp8.name(),
        "kohya's fp8_base: the frozen transformer stored in float8, 1 B per parameter, upcast per layer".into(),
    ))
}

fn fp8_text_encoders(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.text_encoder_dtype.is_some() || s.train_text_encoder {
        return None;
    }
    let mut n = s.clone();
    n.text_encoder_dtype = Some(BaseDtype::Fp8);
    Some((
        n,
        "16-bit".into(),
        BaseDtype::Fp8.name(),
        "T5-XXL in float8, 4.8 GB instead of 9.5 GB while it encodes the captions: point flux.t5xxl (kohya t5xxl) at an fp8 file such as ComfyUI's t5xxl_fp8_e4m3fn.safetensors".into(),
    ))
}

fn swap_more_blocks(s: &Settings) -> Option<(Settings, String, String, String)> {
    // kohya's counting; FLUX.1 allows up to 35 (the estimate refuses more for smaller models)
    const MAX: u32 = 35;
    if s.blocks_to_swap >= MAX {
        return None;
    }
    let mut n = s.clone();
    n.blocks_to_swap = (s.blocks_to_swap + 4).min(MAX);
    Some((
        n.clone(),
        s.blocks_to_swap.to_string(),
        n.blocks_to_swap.to_string(),
        "transformer blocks wait in host memory and are copied in for their forward and backward passes (slower steps, same result)".into(),
    ))
}

fn shorter_seq(s: &Settings) -> Option<(Settings, String, String, String)> {
    if s.seq_len <= 128 {
        return None;
    }
    let mut n = s.clone();
    n.seq_len = (s.seq_len / 2).max(128);
    Some((
        n.clone(),
        s.seq_len.to_string(),
        n.seq_len.to_string(),
        "activations and logits scale with tokens; longer samples must be truncated or split"
            .into(),
    ))
}

fn smaller_resolution(s: &Settings) -> Option<(Settings, String, String, String)> {
    let mut n = s.clone();
    let shrink = |x: u32| ((x * 3 / 4) / 64 * 64).max(256);
    let (from, to) = match s.largest_bucket {
        Some([w, h]) => {
            if w.max(h) <= 256 {
                return None;
            }
            n.largest_bucket = Some([shrink(w), shrink(h)]);
            n.resolution = shrink(s.resolution);
            (
                format!("bucket {w}×{h}"),
                format!("bucket {}×{}", shrink(w), shrink(h)),
            )
        }
        None => {
            if s.resolution <= 256 {
                return None;
            }
            n.resolution = shrink(s.resolution);
            (s.resolution.to_string(), n.resolution.to_string())
        }
    };
    Some((
        n,
        from,
        to,
        "activations scale with pixels (attention maps with their square)".into(),
    ))
}

/// A rung is kept only when it lowers the peak by at least `1 / MIN_SAVING_DIVISOR` (1%) or
/// brings it within the budget.
const MIN_SAVING_DIVISOR: u64 = 100;

/// Which models a rung applies to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Applies {
    Both,
    Decoder,
    /// image models: Stable Diffusion and FLUX
    Diffusion,
    Flux,
}

/// The ladder, in order.
const LADDER: &[Step] = &[
    (
        "micro_batch × gradient_accumulation_steps",
        Applies::Both,
        halve_batch,
    ),
    ("mixed_precision", Applies::Both, mixed_precision),
    ("gradient_checkpointing", Applies::Both, checkpointing),
    ("optimizer", Applies::Both, optimizer),
    (
        "cache_latents / cache_text_encoder_outputs",
        Applies::Diffusion,
        cache_inputs,
    ),
    ("lora.rank", Applies::Both, lower_rank),
    ("base_dtype", Applies::Decoder, quantize),
    ("base_dtype", Applies::Flux, fp8_base),
    // swapping helps until the text encoders filling the caches are the peak; an fp8 T5 lowers
    // that, and swapping helps again
    ("blocks_to_swap", Applies::Flux, swap_more_blocks),
    ("text_encoder_dtype", Applies::Flux, fp8_text_encoders),
    ("blocks_to_swap", Applies::Flux, swap_more_blocks),
    ("seq_len", Applies::Decoder, shorter_seq),
    ("resolution", Applies::Diffusion, smaller_resolution),
];

/// Finds a config that *fits* `budget` — the safe verdict of [`Check`]: the whole-process peak
/// on the device ([`Estimate::peak`]) plus the safety margin —, walking the ladder: micro-batch down keeping the effective batch via gradient
/// accumulation → mixed precision → gradient checkpointing → 8-bit then factored optimizer →
/// cached latents / text-encoder outputs (diffusion) → lower rank (down to 4) → NF4 base
/// (decoders) → shorter sequences (decoders) / smaller resolution (diffusion). Each rung is
/// applied repeatedly while it helps; a change that lowers the peak by less than 1% is not kept
/// unless it is the one that makes the config fit.
///
/// # Errors
/// [`FitError::Estimate`] for invalid settings; [`FitError::DoesNotFit`] with the smallest peak
/// reached and its settings.
pub fn fit(model: &ModelDescriptor, settings: &Settings, budget: Bytes) -> Result<Fit, FitError> {
    let mut cur = settings.clone();
    let mut est = estimate(model, &cur)?;
    let mut changes = Vec::new();
    let fits = |e: &Estimate| Check::new(e, budget, Bytes::ZERO).fits();
    let done = |s: Settings, e: Estimate, changes: Vec<Change>| Fit {
        headroom: budget - e.peak,
        check: Check::new(&e, budget, Bytes::ZERO),
        settings: s,
        estimate: e,
        changes,
    };
    if fits(&est) {
        return Ok(done(cur, est, changes));
    }
    let is_decoder = matches!(model, ModelDescriptor::Decoder(_));
    let is_flux = matches!(model, ModelDescriptor::Flux(_));
    for (setting, applies, step) in LADDER {
        let applicable = match applies {
            Applies::Both => true,
            Applies::Decoder => is_decoder,
            Applies::Diffusion => !is_decoder,
            Applies::Flux => is_flux,
        };
        if !applicable {
            continue;
        }
        while let Some((next, from, to, reason)) = step(&cur) {
            // a step past what the model allows (more blocks swapped than it has) ends the rung
            let Ok(e) = estimate(model, &next) else {
                break;
            };
            // A change that saves under 1% of the peak costs speed or quality for nothing,
            // unless it is exactly what makes the config fit.
            let saving = est.peak.0.saturating_sub(e.peak.0);
            if e.peak >= est.peak || (saving < est.peak.0 / MIN_SAVING_DIVISOR && !fits(&e)) {
                break;
            }
            changes.push(Change {
                setting: (*setting).to_string(),
                from,
                to,
                reason,
                peak_after: e.peak,
            });
            cur = next;
            est = e;
            if fits(&est) {
                return Ok(done(cur, est, changes));
            }
        }
    }
    Err(FitError::DoesNotFit {
        budget,
        smallest_peak: est.peak,
        settings: Box::new(cur),
        changes,
    })
}

/// The largest value in `1..=hi` for which `fits(value)` holds, assuming it holds for every
/// smaller value (the peak grows with the batch and the sequence); 0 when it fails at 1.
fn largest_fitting(hi: u32, fits: impl Fn(u32) -> Result<bool, Error>) -> Result<u32, Error> {
    if !fits(1)? {
        return Ok(0);
    }
    if fits(hi)? {
        return Ok(hi);
    }
    let (mut lo, mut hi) = (1u32, hi);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// The largest micro-batch (≤ 4096) that *fits* `free` bytes (the safe verdict of [`Check`],
/// margin included), all else equal; 0 when even one sample does not.
///
/// # Errors
/// [`Error`] from [`estimate`] for invalid settings.
pub fn max_micro_batch(
    model: &ModelDescriptor,
    settings: &Settings,
    free: Bytes,
) -> Result<u32, Error> {
    largest_fitting(MAX_FRONTIER_MICRO_BATCH, |b| {
        let e = estimate(model, &settings.clone().with_micro_batch(b))?;
        Ok(Check::new(&e, free, Bytes::ZERO).fits())
    })
}

/// The longest sequence (tokens per sample, ≤ [`MAX_FRONTIER_SEQ_LEN`]) that *fits* `budget`
/// bytes at the settings' micro-batch (the safe verdict of [`Check`]); 0 when even one token
/// does not.
///
/// # Errors
/// [`Error::InvalidSetting`] for a diffusion model (no sequence length: see
/// [`max_micro_batch`]); [`Error`] from [`estimate`] for invalid settings.
///
/// ```
/// use lora_memory::{fit::max_seq_len, Bytes, ModelDescriptor, Settings};
/// let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
/// let s = Settings::default().with_gradient_checkpointing(true);
/// let on_24 = max_seq_len(&m, &s, Bytes::from_gib(24.0)).unwrap();
/// let on_80 = max_seq_len(&m, &s, Bytes::from_gib(80.0)).unwrap();
/// assert!(on_24 > 1024 && on_80 > 2 * on_24);
/// ```
pub fn max_seq_len(
    model: &ModelDescriptor,
    settings: &Settings,
    budget: Bytes,
) -> Result<u32, Error> {
    if !matches!(model, ModelDescriptor::Decoder(_)) {
        return Err(Error::InvalidSetting {
            key: "seq_len",
            reason: format!(
                "{} is a diffusion model: it has no sequence length (use max_micro_batch)",
                model.name()
            ),
        });
    }
    largest_fitting(MAX_FRONTIER_SEQ_LEN, |n| {
        let e = estimate(model, &settings.clone().with_seq_len(n))?;
        Ok(Check::new(&e, budget, Bytes::ZERO).fits())
    })
}

/// The largest micro-batch [`max_micro_batch`] searches: 4096.
pub const MAX_FRONTIER_MICRO_BATCH: u32 = 4096;

/// The longest sequence [`max_seq_len`] searches: 1 Mi tokens.
pub const MAX_FRONTIER_SEQ_LEN: u32 = 1 << 20;

/// The card sizes of `lora-train plan --frontier`, in GiB as printed on the boxes (NVIDIA's "GB"
/// are GiB): 8, 12, 16, 24, 40, 48 and 80.
pub const FRONTIER_CARDS_GIB: [u32; 7] = [8, 12, 16, 24, 40, 48, 80];

/// One card of the frontier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrontierRow {
    /// The card's memory.
    pub budget: Bytes,
    /// The longest sequence that fits at the settings' micro-batch ([`max_seq_len`]); `None` for
    /// diffusion models.
    pub max_seq_len: Option<u32>,
    /// The largest micro-batch that fits at the settings' sequence length or resolution
    /// ([`max_micro_batch`]).
    pub max_micro_batch: u32,
}

/// The frontier of `settings` on each card of `budgets` (e.g. [`FRONTIER_CARDS_GIB`]): what
/// Unsloth publishes as "maximum context length" per card, computed for this config.
///
/// # Errors
/// [`Error`] from [`estimate`] for invalid settings.
pub fn frontier(
    model: &ModelDescriptor,
    settings: &Settings,
    budgets: &[Bytes],
) -> Result<Vec<FrontierRow>, Error> {
    let decoder = matches!(model, ModelDescriptor::Decoder(_));
    budgets
        .iter()
        .map(|&budget| {
            Ok(FrontierRow {
                budget,
                max_seq_len: if decoder {
                    Some(max_seq_len(model, settings, budget)?)
                } else {
                    None
                },
                max_micro_batch: max_micro_batch(model, settings, budget)?,
            })
        })
        .collect()
}

/// [`FRONTIER_CARDS_GIB`] as byte budgets.
pub fn frontier_cards() -> Vec<Bytes> {
    FRONTIER_CARDS_GIB
        .iter()
        .map(|&g| Bytes(u64::from(g) * GIB))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::units::GIB;

    #[test]
    fn fit_walks_the_ladder_in_order_and_fits() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let s = Settings::default().with_micro_batch(8).with_seq_len(2048);
        let f = fit(&m, &s, Bytes(24 * GIB)).unwrap();
        assert!(f.estimate.peak <= Bytes(24 * GIB));
        assert_eq!(
            f.changes[0].setting,
            "micro_batch × gradient_accumulation_steps"
        );
        assert_eq!(f.settings.effective_batch(), 8);
        assert!(f.changes.iter().all(|c| !c.reason.is_empty()));
        for w in f.changes.windows(2) {
            assert!(w[1].peak_after < w[0].peak_after);
        }
        assert_eq!(f.headroom, Bytes(24 * GIB) - f.estimate.peak);
    }

    #[test]
    fn impossible_budgets_report_the_smallest_peak() {
        let m = ModelDescriptor::preset("Qwen3-32B").unwrap();
        match fit(&m, &Settings::default(), Bytes(4 * GIB)) {
            Err(FitError::DoesNotFit {
                smallest_peak,
                settings,
                ..
            }) => {
                assert!(smallest_peak > Bytes(4 * GIB));
                assert!(settings.base_dtype.is_quantized());
                // 32B params at ~0.52 B/param cannot fit 4 GiB.
                assert!(smallest_peak > Bytes(16 * GIB));
            }
            other => panic!("{other:?}"),
        }
    }

    /// SDXL LoRA as the low-VRAM guides set it up: bf16 base and compute, attention targets,
    /// r16 α8, 1024 px, one image per micro-batch.
    fn sdxl_1024() -> (ModelDescriptor, Settings) {
        let m = ModelDescriptor::preset("SDXL").unwrap();
        let s = Settings::default()
            .with_base_dtype(BaseDtype::Bf16)
            .with_mixed_precision(MixedPrecision::Bf16)
            .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
            .with_rank(16)
            .with_alpha(8.0)
            .with_resolution(1024)
            .with_micro_batch(1)
            .with_gradient_accumulation_steps(4);
        (m, s)
    }

    #[test]
    fn sdxl_caching_takes_the_vae_and_both_text_encoders_off_the_device() {
        let (m, s) = sdxl_1024();
        let s = s
            .with_gradient_checkpointing(true)
            .with_cache_latents(true)
            .with_cache_text_encoder_outputs(true);
        let kept = estimate(&m, &s.clone().with_keep_models_loaded(true)).unwrap();
        let moved = estimate(&m, &s).unwrap();
        // AutoencoderKL 83,653,863 + CLIP ViT-L 123,060,480 + OpenCLIP bigG 694,659,840
        // parameters, in bf16
        let frozen = 2 * (83_653_863 + 123_060_480 + 694_659_840);
        assert_eq!(kept.peak_allocated.0 - moved.peak_allocated.0, frozen);
        assert_eq!(kept.peak.0 - moved.peak.0, frozen);
        let (k, g) = (
            kept.diffusion.as_ref().unwrap(),
            moved.diffusion.as_ref().unwrap(),
        );
        assert_eq!(k.vae_weights.0, 2 * 83_653_863);
        assert_eq!(k.text_encoder_weights.0, 2 * (123_060_480 + 694_659_840));
        assert_eq!((g.vae_weights.0, g.text_encoder_weights.0), (0, 0));
        // what the data do not let be cached stays: random crops keep the VAE, captions that
        // change between epochs keep the text encoders
        let crop = estimate(&m, &s.clone().with_random_crop(true)).unwrap();
        let d = crop.diffusion.as_ref().unwrap();
        assert_eq!(
            (d.vae_weights, d.text_encoder_weights.0),
            (k.vae_weights, 0)
        );
        assert!(crop.notes.iter().any(|n| n.contains("random_crop")));
        let shuffled = estimate(&m, &s.clone().with_varying_captions(true)).unwrap();
        let d = shuffled.diffusion.as_ref().unwrap();
        assert_eq!(
            (d.vae_weights.0, d.text_encoder_weights),
            (0, k.text_encoder_weights)
        );
        assert_eq!(
            shuffled.peak_allocated.0 - moved.peak_allocated.0,
            k.text_encoder_weights.0
        );
        eprintln!(
            "SDXL 1024 px, checkpointing, AdamW: peak {} with the VAE and text encoders on the device, {} without",
            kept.peak, moved.peak
        );
    }

    #[test]
    fn sdxl_1024_fits_8_gib_by_caching_before_the_resolution_is_touched() {
        let (m, s) = sdxl_1024();
        let budget = Bytes(8 * GIB);
        let start = estimate(&m, &s).unwrap();
        assert!(start.peak > budget, "{}", start.peak);
        let f = fit(&m, &s, budget).unwrap();
        for c in &f.changes {
            eprintln!(
                "{}: {} → {} (peak {})",
                c.setting, c.from, c.to, c.peak_after
            );
        }
        assert!(f.estimate.peak <= budget, "{}", f.estimate.peak);
        assert_eq!(
            (f.settings.resolution, f.settings.largest_bucket),
            (1024, None)
        );
        assert_eq!(f.settings.lora.rank, 16);
        assert!(f.settings.cache_latents && f.settings.cache_text_encoder_outputs);
        let d = f.estimate.diffusion.as_ref().unwrap();
        assert_eq!((d.vae_weights.0, d.text_encoder_weights.0), (0, 0));
        let caching = f
            .changes
            .iter()
            .find(|c| c.setting == "cache_latents / cache_text_encoder_outputs")
            .expect("the caching rung");
        assert_eq!(caching.from, "nothing cached");
        assert_eq!(caching.to, "latents and text-encoder outputs cached");
        assert!(
            caching.reason.contains("leave the device"),
            "{}",
            caching.reason
        );

        // Models pinned to the device (a CPU run, or a trainer that keeps them): caching frees
        // nothing, and the ladder has to lower the rank and then the resolution.
        let pinned = fit(&m, &s.clone().with_keep_models_loaded(true), budget).unwrap();
        for c in &pinned.changes {
            eprintln!(
                "pinned: {}: {} → {} (peak {})",
                c.setting, c.from, c.to, c.peak_after
            );
        }
        assert!(pinned.settings.resolution < 1024, "{:?}", pinned.changes);
        assert!(
            pinned
                .changes
                .iter()
                .all(|c| c.setting != "cache_latents / cache_text_encoder_outputs"),
            "{:?}",
            pinned.changes
        );
    }

    #[test]
    fn a_sample_grid_at_the_training_size_shrinks_with_the_resolution() {
        // SD 1.5 at 1024² in fp16 on CUDA with everything already lean: its peak is drawing the
        // sample images, at the training size
        let m = ModelDescriptor::preset("SD1.5").unwrap();
        let s = Settings::default()
            .with_base_dtype(BaseDtype::F16)
            .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
            .with_rank(4)
            .with_resolution(1024)
            .with_gradient_checkpointing(true)
            .with_optimizer(Optimizer::AdamW8bit)
            .with_cache_latents(true)
            .with_cache_text_encoder_outputs(true)
            .with_sample_images(Some(crate::settings::SampleImages {
                size: None,
                prompts: 2,
                guidance: true,
            }));
        let start = estimate(&m, &s).unwrap();
        assert!(start.breakdown.sample_images.0 > 0, "{:?}", start.breakdown);
        let budget = start.peak - Bytes(200_000_000);
        let f = fit(&m, &s, budget).unwrap();
        assert!(f.estimate.peak <= budget);
        assert!(f.settings.resolution < 1024, "{:?}", f.changes);
        assert!(
            f.estimate.diffusion.as_ref().unwrap().sample_images
                < start.diffusion.as_ref().unwrap().sample_images
        );
    }

    #[test]
    fn the_caching_rung_caches_only_what_the_data_allow_and_the_resolution_comes_last() {
        let (m, s) = sdxl_1024();
        let (n, from, to, _) = cache_inputs(&s.clone().with_varying_captions(true)).unwrap();
        assert!(n.cache_latents && !n.cache_text_encoder_outputs);
        assert_eq!(
            (from.as_str(), to.as_str()),
            ("nothing cached", "latents cached")
        );
        let (n, _, to, _) = cache_inputs(&s.clone().with_random_crop(true)).unwrap();
        assert!(!n.cache_latents && n.cache_text_encoder_outputs);
        assert_eq!(to, "text-encoder outputs cached");
        let (n, _, _, _) = cache_inputs(&s.clone().with_train_text_encoder(true)).unwrap();
        assert!(n.cache_latents && !n.cache_text_encoder_outputs);
        assert!(
            cache_inputs(&s.clone().with_random_crop(true).with_varying_captions(true)).is_none()
        );
        // a budget only a smaller image fits: every other rung is tried first
        let f = match fit(&m, &s, Bytes(5 * GIB)) {
            Ok(f) => f,
            Err(FitError::DoesNotFit {
                changes, settings, ..
            }) => {
                let e = estimate(&m, &settings).unwrap();
                Fit {
                    check: Check::new(&e, Bytes(5 * GIB), Bytes::ZERO),
                    estimate: e,
                    settings: *settings,
                    changes,
                    headroom: Bytes(0),
                }
            }
            Err(e) => panic!("{e}"),
        };
        let names: Vec<&str> = f.changes.iter().map(|c| c.setting.as_str()).collect();
        eprintln!("5 GiB: {names:?}, peak {}", f.estimate.peak);
        let first = names
            .iter()
            .position(|n| *n == "resolution")
            .expect("resolution lowered");
        assert!(
            names[first..].iter().all(|n| *n == "resolution"),
            "{names:?}"
        );
        assert!(names[..first].contains(&"cache_latents / cache_text_encoder_outputs"));
    }

    #[test]
    fn halving_the_batch_keeps_the_effective_batch_exactly() {
        let s = Settings::default().with_micro_batch(7);
        let (n, from, to, _) = halve_batch(&s).unwrap();
        assert_eq!((n.micro_batch, n.gradient_accumulation_steps), (1, 7));
        assert_eq!((from.as_str(), to.as_str()), ("7 × 1", "1 × 7"));
        let s = Settings::default()
            .with_micro_batch(12)
            .with_gradient_accumulation_steps(2);
        let (n, _, _, _) = halve_batch(&s).unwrap();
        assert_eq!((n.micro_batch, n.gradient_accumulation_steps), (6, 4));
        let s = Settings::default().with_micro_batch(1_000_000_000);
        let (n, _, _, _) = halve_batch(&s).unwrap();
        assert_eq!(n.effective_batch(), 1_000_000_000);
    }

    #[test]
    fn a_trainer_holding_fp32_beside_a_quantized_base_is_offered_autocast_only() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let s = Settings::default()
            .with_quantized_compute_f32_only(true)
            .with_gradient_checkpointing(true);
        // from a dense fp32 base: the NF4 rung keeps fp32 compute
        let f = fit(&m, &s, Bytes(12 * GIB)).unwrap();
        assert!(f.settings.base_dtype.is_quantized(), "{:?}", f.changes);
        assert!(f.settings.quantized_compute_f32, "{:?}", f.changes);
        // an NF4 base computing in fp32 is offered bf16 autocast, not 16-bit weights
        let s = s
            .with_base_dtype(BaseDtype::Nf4 { double_quant: true })
            .with_quantized_compute_f32(true);
        // the smallest budget the autocast run fits (to 1 MiB), which this one does not
        let fits = |s: &Settings, b: u64| {
            Check::new(&estimate(&m, s).unwrap(), Bytes(b), Bytes::ZERO).fits()
        };
        let autocast = s.clone().with_mixed_precision(MixedPrecision::Bf16);
        let (mut lo, mut hi) = (0u64, 64 * GIB);
        while hi - lo > 1 << 20 {
            let mid = lo + (hi - lo) / 2;
            if fits(&autocast, mid) {
                hi = mid
            } else {
                lo = mid
            }
        }
        assert!(!fits(&s, hi));
        let f = fit(&m, &s, Bytes(hi)).unwrap();
        assert_eq!(f.changes[0].setting, "mixed_precision", "{:?}", f.changes);
        assert!(f.settings.quantized_compute_f32);
        assert_eq!(f.settings.mixed_precision, MixedPrecision::Bf16);
    }

    #[test]
    fn a_quantized_base_computing_in_fp32_is_offered_16_bit_compute() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let s = Settings::default()
            .with_base_dtype(BaseDtype::Nf4 { double_quant: true })
            .with_quantized_compute_f32(true)
            .with_gradient_checkpointing(true);
        let f = fit(&m, &s, Bytes(8 * GIB)).unwrap();
        assert_eq!(f.changes[0].setting, "mixed_precision");
        assert!(!f.settings.quantized_compute_f32);
    }

    #[test]
    fn max_micro_batch_is_the_boundary() {
        let m = ModelDescriptor::preset("SmolLM2-360M").unwrap();
        let s = Settings::default().with_seq_len(1024);
        let free = Bytes(8 * GIB);
        let b = max_micro_batch(&m, &s, free).unwrap();
        assert!(b >= 1);
        let check = |b: u32| {
            Check::new(
                &estimate(&m, &s.clone().with_micro_batch(b)).unwrap(),
                free,
                Bytes::ZERO,
            )
        };
        assert!(check(b).fits());
        // one more is tight or does not fit: the margin counts
        assert!(!check(b + 1).fits());
        assert!(check(b).need + check(b).margin <= free);
        assert_eq!(max_micro_batch(&m, &s, Bytes(1 << 20)).unwrap(), 0);
    }

    #[test]
    fn max_seq_len_is_the_boundary_and_grows_with_the_card() {
        let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
        let s = Settings::default()
            .with_gradient_checkpointing(true)
            .with_base_dtype(BaseDtype::Nf4 { double_quant: true })
            .with_mixed_precision(MixedPrecision::Bf16);
        let rows = frontier(&m, &s, &frontier_cards()).unwrap();
        assert_eq!(rows.len(), 7);
        for w in rows.windows(2) {
            assert!(w[1].max_seq_len >= w[0].max_seq_len, "{rows:?}");
            assert!(w[1].max_micro_batch >= w[0].max_micro_batch, "{rows:?}");
        }
        let card = Bytes(24 * GIB);
        let n = max_seq_len(&m, &s, card).unwrap();
        let check = |n: u32| {
            Check::new(
                &estimate(&m, &s.clone().with_seq_len(n)).unwrap(),
                card,
                Bytes::ZERO,
            )
        };
        assert!(n > 1024 && check(n).fits() && !check(n + 1).fits(), "{n}");
        assert_eq!(rows[3].max_seq_len, Some(n));
        // an 8B QLoRA base alone does not fit a 4 GiB card
        assert_eq!(max_seq_len(&m, &s, Bytes(4 * GIB)).unwrap(), 0);
        let sd = ModelDescriptor::preset("SD1.5").unwrap();
        assert!(
            max_seq_len(&sd, &s, card)
                .unwrap_err()
                .to_string()
                .contains("max_micro_batch")
        );
        assert_eq!(
            frontier(
                &sd,
                &Settings::default().with_target_modules(&["to_q", "to_v"]),
                &[card]
            )
            .unwrap()[0]
                .max_seq_len,
            None
        );
    }
}
