//! Batch sizes for inference (auto-labeling): how many items a tagger or captioner can run at
//! once in a memory budget, from the model's estimate rather than a fixed table.
//!
//! An inference run holds the model's weights, a fixed runtime part (the CUDA context and
//! library workspaces; nothing extra on the CPU) and, per item, the activations alive at the
//! model's peak (an image tagger: the largest layer's input and output; an LLM: the KV cache of
//! the whole sequence plus the prompt's logits). With `budget` bytes free before loading,
//!
//! ```text
//! batch = clamp(floor((budget · HEADROOM − weights − fixed) / per_item), 1, max_batch)
//! ```
//!
//! with [`HEADROOM`] = 0.8: a fifth of the budget is left to the allocator's rounding and
//! fragmentation and to the rest of the process. When even one item does not fit, the answer is
//! 1 with [`BatchLimit::DoesNotFit`] — the run may still go (it halves nothing further and fails
//! with an out-of-memory error naming the model), but the plan says so first.
//!
//! The fixed table this replaces ([`fixed_table_batch`]) is the one widely copied LLM-tagging
//! guides hard-code: a card of at least 12 GB gets 8, 8–12 GB gets 4, 6–8 GB gets 2, smaller
//! cards 1 — whatever the model and the input size.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::model::DecoderDescriptor;
use crate::units::Bytes;

/// Fraction of the budget a batch may plan for.
pub const HEADROOM: f64 = 0.8;

/// The CUDA context and the cuBLAS/cuDNN workspaces of a process that runs a model: the
/// defaults training estimates use ([`crate::Device::cuda`]: 500 MB context + 64 MiB
/// workspace).
pub fn cuda_fixed_bytes() -> Bytes {
    match crate::Device::cuda() {
        crate::Device::Cuda { context, workspace } => context + workspace,
        _ => Bytes(0),
    }
}

/// What an inference run holds, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct InferenceMemory {
    /// The model's weights as loaded (parameters × their element size).
    pub weights: Bytes,
    /// Memory that does not grow with the batch besides the weights: [`cuda_fixed_bytes`] on
    /// CUDA, 0 on the CPU.
    pub fixed: Bytes,
    /// Peak bytes one item adds (activations, KV cache, logits, its input).
    pub per_item: Bytes,
}

/// Why [`BatchPlan::batch`] is what it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BatchLimit {
    /// The memory budget: one more item would not fit.
    Memory,
    /// The configured largest batch (`generation_settings.max_batch_size`).
    MaxBatch,
    /// Not even one item fits in the budget; the batch is 1 and the run is expected to fail.
    DoesNotFit,
}

/// A batch size and how it was reached ([`batch_for`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchPlan {
    /// Items per batch, at least 1.
    pub batch: usize,
    /// Items the budget would hold, before the `max_batch` cap (0 when none fits).
    pub fits: usize,
    /// What limits [`BatchPlan::batch`].
    pub limit: BatchLimit,
    /// The budget planned against.
    pub budget: Bytes,
    /// The memory of the run.
    pub memory: InferenceMemory,
    /// Predicted peak at [`BatchPlan::batch`]: `weights + fixed + batch · per_item`.
    pub peak: Bytes,
}

/// The batch for `memory` in `budget` bytes, at most `max_batch` (see the module docs).
///
/// ```
/// use lora_memory::Bytes;
/// use lora_memory::inference::{BatchLimit, InferenceMemory, batch_for};
/// let m = InferenceMemory { weights: Bytes(14 << 20), fixed: Bytes(0), per_item: Bytes(12 << 20) };
/// // 64 MiB: floor((51.2 − 14) / 12) = 3 images
/// let p = batch_for(&m, Bytes(64 << 20), 8);
/// assert_eq!((p.batch, p.limit), (3, BatchLimit::Memory));
/// // 8 GiB holds hundreds; the configured maximum decides
/// assert_eq!(batch_for(&m, Bytes(8 << 30), 8).limit, BatchLimit::MaxBatch);
/// ```
pub fn batch_for(memory: &InferenceMemory, budget: Bytes, max_batch: usize) -> BatchPlan {
    let max = max_batch.max(1);
    let room = budget.0 as f64 * HEADROOM - memory.weights.0 as f64 - memory.fixed.0 as f64;
    let fits = if memory.per_item.0 == 0 {
        if room >= 0.0 { usize::MAX } else { 0 }
    } else if room <= 0.0 {
        0
    } else {
        (room / memory.per_item.0 as f64).floor() as usize
    };
    let (batch, limit) = if fits == 0 {
        (1, BatchLimit::DoesNotFit)
    } else if fits >= max {
        (max, BatchLimit::MaxBatch)
    } else {
        (fits, BatchLimit::Memory)
    };
    BatchPlan {
        batch,
        fits,
        limit,
        budget,
        memory: *memory,
        peak: Bytes(memory.weights.0 + memory.fixed.0 + batch as u64 * memory.per_item.0),
    }
}

/// The fixed table of the widely copied LLM-tagging guides: ≥ 12 GB → 8, 8–12 GB → 4,
/// 6–8 GB → 2, otherwise 1, on the card's total memory in GB (10⁹ bytes; a "12 GB" card's
/// 12 GiB counts as 12.9).
///
/// ```
/// use lora_memory::{Budget, inference::fixed_table_batch};
/// assert_eq!(fixed_table_batch(Budget::gpu("RTX 3060").unwrap().bytes), 8); // 12 GiB
/// assert_eq!(fixed_table_batch(Budget::gpu("RTX 3070").unwrap().bytes), 4); // 8 GiB
/// assert_eq!(fixed_table_batch(lora_memory::Bytes(6_000_000_000)), 2);
/// assert_eq!(fixed_table_batch(lora_memory::Bytes(4 << 30)), 1);
/// ```
pub fn fixed_table_batch(card: Bytes) -> usize {
    let gb = card.0 as f64 / 1e9;
    if gb >= 12.0 {
        8
    } else if gb >= 8.0 {
        4
    } else if gb >= 6.0 {
        2
    } else {
        1
    }
}

/// Peak bytes one sequence adds while a decoder LLM generates: the KV cache of the whole
/// sequence (`2 · layers · kv_heads · head_dim · (prompt + new) · elem`), the prompt's logits in
/// f32 twice (the logits and their softmax/argmax copy: `2 · prompt · vocab · 4`), and the
/// prompt's MLP activations (`prompt · intermediate · 4 · elem`: gate, up, their product and
/// the down projection's input, alive at once).
///
/// ```
/// use lora_memory::{ModelDescriptor, inference::generation_row_bytes};
/// let ModelDescriptor::Decoder(d) = ModelDescriptor::preset("SmolLM2-135M").unwrap() else {
///     unreachable!()
/// };
/// // 30 layers × 3 KV heads × 64 dims × 2 (K and V) × 148 tokens × 4 bytes
/// let kv = 2 * 30 * 3 * 64 * 148 * 4;
/// let logits = 2 * 100 * 49152 * 4;
/// let mlp = 100 * 1536 * 4 * 4;
/// assert_eq!(generation_row_bytes(&d, 100, 48, 4).0, kv + logits + mlp);
/// ```
pub fn generation_row_bytes(
    model: &DecoderDescriptor,
    prompt_len: usize,
    new_tokens: usize,
    elem_bytes: u64,
) -> Bytes {
    let seq = prompt_len as u64;
    let total = seq + new_tokens as u64;
    let kv = 2 * model.layers * model.kv_heads * model.head_dim * total * elem_bytes;
    let logits = 2 * seq * model.vocab * 4;
    let mlp = seq * model.intermediate * 4 * elem_bytes;
    Bytes(kv + logits + mlp)
}

impl fmt::Display for BatchPlan {
    /// One line: `batch 3 (budget 64.0 MiB × 0.8 − weights 14.0 MiB − fixed 0 B) / 12.0 MiB
    /// per item; limited by memory`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "batch {}: ({} × {HEADROOM} − weights {} − fixed {}) / {} per item",
            self.batch, self.budget, self.memory.weights, self.memory.fixed, self.memory.per_item
        )?;
        match self.limit {
            BatchLimit::Memory => write!(f, " = {} items fit", self.fits),
            BatchLimit::MaxBatch => write!(
                f,
                " = {} items fit; capped at the largest batch",
                if self.fits == usize::MAX {
                    "any number of".to_string()
                } else {
                    self.fits.to_string()
                }
            ),
            BatchLimit::DoesNotFit => f.write_str(": not even one item fits this budget"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_budgets_give_two_batches() {
        let m = InferenceMemory {
            weights: Bytes(1 << 30),
            fixed: Bytes(500 << 20),
            per_item: Bytes(150 << 20),
        };
        // 8 GiB: (6553.6 − 1024 − 500) / 150 = 33.5 → 33
        let small = batch_for(&m, Bytes(8 << 30), 64);
        assert_eq!((small.batch, small.limit), (33, BatchLimit::Memory));
        assert_eq!(small.peak.0, (1 << 30) + (500 << 20) + 33 * (150 << 20));
        // 24 GiB: (19660.8 − 1524) / 150 = 120.9 → capped at 64
        let big = batch_for(&m, Bytes(24 << 30), 64);
        assert_eq!(
            (big.batch, big.fits, big.limit),
            (64, 120, BatchLimit::MaxBatch)
        );
        // 1 GiB: the weights alone exceed 80 % of it
        let none = batch_for(&m, Bytes(1 << 30), 64);
        assert_eq!(
            (none.batch, none.fits, none.limit),
            (1, 0, BatchLimit::DoesNotFit)
        );
        assert!(none.to_string().contains("not even one item"), "{none}");
        assert!(small.to_string().contains("33 items fit"), "{small}");
        // the table would say 4 and 8 whatever the model
        assert_eq!(fixed_table_batch(Bytes(8 << 30)), 4);
        assert_eq!(fixed_table_batch(Bytes(24 << 30)), 8);
    }

    #[test]
    fn table_edges_are_in_decimal_gb() {
        assert_eq!(fixed_table_batch(Bytes(12_000_000_000)), 8);
        assert_eq!(fixed_table_batch(Bytes(11_999_999_999)), 4);
        assert_eq!(fixed_table_batch(Bytes(8_000_000_000)), 4);
        assert_eq!(fixed_table_batch(Bytes(5_999_999_999)), 1);
    }
}
