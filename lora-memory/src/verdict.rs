//! The verdict: *fits*, *tight* or *does not fit*, decided on the memory that runs out.
//!
//! A CUDA run dies when the caching allocator cannot reserve another segment, so the number to
//! hold against the card is not the allocated peak but the whole-process need:
//! reserved peak (live tensors + block rounding of the persistent tensors + the cache of
//! transients, [`crate::Estimate::peak_reserved`]) + CUDA context and cuBLAS/cuDNN workspaces
//! ([`crate::Device::Cuda`]) — [`crate::Estimate::peak_process`] — plus whatever other
//! processes hold on the card (NVML, when the card is local). On the CPU the need is the
//! process's resident memory.
//!
//! Above that need the verdict keeps a stated safety margin ([`SAFETY_MARGIN`] of the need, at
//! least [`MIN_SAFETY_MARGIN`]): a run inside the margin is *tight* (it may run; it is not
//! promised), above the card it *does not fit*. The margin is what makes the verdict safe on the
//! public boundary outcomes of [`crate::cases::boundary_cases`] — never "fits" for a run that
//! ran out of memory — while giving up at most that fraction of the card on runs that fit.

use crate::budget::Budget;
use crate::estimate::Estimate;
use crate::units::Bytes;
use serde::{Deserialize, Serialize};

/// Fraction of the predicted need kept free before a run is called *fits*: the estimate's own
/// spread on plain LoRA is −4 %…+1 % of the allocated peak, the allocator's split blocks and the
/// CUDA context vary by a few percent more between driver versions and cards.
pub const SAFETY_MARGIN: f64 = 0.06;

/// The least safety margin: 256 MiB (a small run still needs room for the CUDA context's
/// variation, 0.3–1.4 GB between GPUs and drivers, of which the estimate assumes 0.5 GB).
pub const MIN_SAFETY_MARGIN: Bytes = Bytes(256 << 20);

/// Fits, tight or does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The need plus the safety margin is within the memory available.
    Fits,
    /// The need is within the memory available, the safety margin is not: the run may go out
    /// of memory.
    Tight,
    /// The need exceeds the memory available.
    DoesNotFit,
}

impl Verdict {
    /// `"fits"`, `"tight"`, `"does not fit"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Fits => "fits",
            Verdict::Tight => "tight",
            Verdict::DoesNotFit => "does not fit",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A verdict with the numbers behind it. All values in bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    /// The verdict.
    pub verdict: Verdict,
    /// The card's memory (or the budget given).
    pub budget: Bytes,
    /// Memory other processes hold on the card (NVML, when known; 0 otherwise).
    pub held_by_others: Bytes,
    /// `budget − held_by_others`.
    pub available: Bytes,
    /// What the run needs: [`Estimate::peak_process`] (reserved + context + workspaces; CPU:
    /// resident memory).
    pub need: Bytes,
    /// The safety margin kept above `need`: `max(SAFETY_MARGIN · need, MIN_SAFETY_MARGIN)`.
    pub margin: Bytes,
    /// `available − need − margin` in bytes (clamped to the `i64` range): negative when the run
    /// is tight or does not fit.
    pub headroom: i64,
}

impl Check {
    /// The verdict of `estimate` against `budget` bytes of which `held_by_others` are taken.
    ///
    /// ```
    /// use lora_memory::{estimate, Bytes, Check, ModelDescriptor, Settings, Verdict};
    /// let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
    /// let e = estimate(&m, &Settings::default()).unwrap();
    /// let c = Check::new(&e, Bytes::from_gib(24.0), Bytes(0));
    /// assert_eq!(c.verdict, Verdict::Fits);
    /// assert_eq!(Check::new(&e, Bytes::from_gib(16.0), Bytes(0)).verdict, Verdict::DoesNotFit);
    /// ```
    pub fn new(estimate: &Estimate, budget: Bytes, held_by_others: Bytes) -> Check {
        let need = estimate.peak_process;
        let margin = Bytes::from_f64(SAFETY_MARGIN * need.as_f64()).max(MIN_SAFETY_MARGIN);
        let available = budget.saturating_sub(held_by_others);
        let verdict = if need > available {
            Verdict::DoesNotFit
        } else if need.0.saturating_add(margin.0) > available.0 {
            Verdict::Tight
        } else {
            Verdict::Fits
        };
        let headroom = (i128::from(available.0) - i128::from(need.0) - i128::from(margin.0))
            .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
        Check {
            verdict,
            budget,
            held_by_others,
            available,
            need,
            margin,
            headroom,
        }
    }

    /// The verdict of `estimate` against a [`Budget`]: a card's total with what other
    /// processes hold on it for a local card ([`Budget::card_bytes`],
    /// [`Budget::held_by_others`]), else the budget itself with nothing held. Use this rather
    /// than `Check::new(e, b.bytes, …)`: a local budget's `bytes` is already its free memory.
    ///
    /// ```
    /// use lora_memory::{estimate, Budget, Check, ModelDescriptor, Settings, Verdict};
    /// let m = ModelDescriptor::preset("Llama-3.1-8B").unwrap();
    /// let e = estimate(&m, &Settings::default()).unwrap();
    /// let card = Budget::gpu("RTX 4090").unwrap();
    /// assert_eq!(Check::for_budget(&e, &card).verdict, Verdict::Fits);
    /// // this machine's card, when it has one (`Budget::gpu("local")`, feature `nvml`)
    /// if let Ok(local) = Budget::gpu("local") {
    ///     println!("{}", Check::for_budget(&e, &local).held_by_others);
    /// }
    /// ```
    pub fn for_budget(estimate: &Estimate, budget: &Budget) -> Check {
        Check::new(estimate, budget.card_bytes(), budget.held_by_others())
    }

    /// True only for [`Verdict::Fits`].
    pub fn fits(&self) -> bool {
        self.verdict == Verdict::Fits
    }

    /// One line: the verdict, need, margin and memory available.
    pub fn summary(&self) -> String {
        let others = if self.held_by_others.0 > 0 {
            format!(" ({} held by other processes)", self.held_by_others)
        } else {
            String::new()
        };
        format!(
            "{} — needs {} (reserved + context) + {} safety margin, {} available of {}{}",
            self.verdict, self.need, self.margin, self.available, self.budget, others
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ModelDescriptor, Settings, estimate};

    #[test]
    fn the_verdict_moves_from_fits_to_tight_to_does_not_fit() {
        let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
        let e = estimate(&m, &Settings::default()).unwrap();
        let need = e.peak_process;
        let margin = Bytes::from_f64(SAFETY_MARGIN * need.as_f64()).max(MIN_SAFETY_MARGIN);
        let at = |budget: Bytes, others: Bytes| Check::new(&e, budget, others);
        assert_eq!(at(need + margin, Bytes::ZERO).verdict, Verdict::Fits);
        assert_eq!(at(need + margin, Bytes::ZERO).headroom, 0);
        assert_eq!(
            at(need + margin - Bytes(1), Bytes::ZERO).verdict,
            Verdict::Tight
        );
        assert_eq!(at(need, Bytes::ZERO).verdict, Verdict::Tight);
        let short = at(need - Bytes(1), Bytes::ZERO);
        assert_eq!(short.verdict, Verdict::DoesNotFit);
        assert_eq!(short.headroom, -1 - margin.0 as i64);
        // memory other processes hold counts against the card
        let big = need + margin + Bytes(1 << 30);
        assert_eq!(at(big, Bytes(1 << 30)).verdict, Verdict::Fits);
        let half_margin_more = Bytes((1 << 30) + margin.0 / 2);
        assert_eq!(at(big, half_margin_more).verdict, Verdict::Tight);
        let line = at(big, half_margin_more).summary();
        assert!(
            line.starts_with("tight") && line.contains("held by other processes"),
            "{line}"
        );
        // a tiny run keeps the minimum margin
        let small = ModelDescriptor::preset("SmolLM2-135M").unwrap();
        let e = estimate(&small, &Settings::default()).unwrap();
        assert_eq!(
            Check::new(&e, Bytes::from_gib(80.0), Bytes::ZERO).margin,
            MIN_SAFETY_MARGIN.max(Bytes::from_f64(SAFETY_MARGIN * e.peak_process.as_f64()))
        );
    }
}
