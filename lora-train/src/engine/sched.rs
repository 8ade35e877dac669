//! Learning-rate schedules with the semantics of `transformers.get_scheduler`
//! (`transformers/optimization.py`: `get_constant_schedule`, `get_constant_schedule_with_warmup`,
//! `get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup`,
//! `get_cosine_with_hard_restarts_schedule_with_warmup`,
//! `get_polynomial_decay_schedule_with_warmup`).
//!
//! A schedule is a pure function of the optimizer step (the number of updates already applied),
//! so a resumed run sets exactly the learning rate the uninterrupted run would have: there is no
//! hidden state to save beyond the step.

use std::f64::consts::PI;

use serde::{Deserialize, Serialize};

use crate::engine::error::{Result, TrainError};

/// Which schedule (kohya / transformers `lr_scheduler` names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case", tag = "type", deny_unknown_fields)]
pub enum SchedulerKind {
    /// `lr` throughout (the default, as kohya's `lr_scheduler` and the config's).
    #[default]
    Constant,
    /// Linear warm-up from 0, then `lr`.
    ConstantWithWarmup,
    /// Warm-up, then linear decay to 0 at `total_steps`.
    Linear,
    /// Warm-up, then cosine decay over `num_cycles` half-waves (0.5 = to 0 once).
    Cosine {
        /// Number of cosine waves (transformers default 0.5).
        #[serde(default = "half")]
        num_cycles: f64,
    },
    /// Warm-up, then `num_cycles` cosine decays to 0, each restarting at `lr` (hard restarts).
    CosineWithRestarts {
        /// Number of restarts (transformers default 1).
        #[serde(default = "one")]
        num_cycles: f64,
    },
    /// Warm-up, then `(lr − lr_end)·(1 − progress)^power + lr_end`; `lr_end` after `total_steps`.
    Polynomial {
        /// Final learning rate (transformers default 1e-7).
        #[serde(default = "lr_end_default")]
        lr_end: f64,
        /// Power (transformers default 1.0).
        #[serde(default = "one")]
        power: f64,
    },
}

fn half() -> f64 {
    0.5
}
fn one() -> f64 {
    1.0
}
fn lr_end_default() -> f64 {
    1e-7
}

impl SchedulerKind {
    /// Parses `lr_scheduler` names: `constant`, `constant_with_warmup`, `linear`, `cosine`,
    /// `cosine_with_restarts`, `polynomial` (transformers defaults for their extra arguments).
    ///
    /// # Errors
    /// An unknown name, listing the accepted ones.
    pub fn from_name(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().replace('-', "_").as_str() {
            "constant" => Self::Constant,
            "constant_with_warmup" => Self::ConstantWithWarmup,
            "linear" => Self::Linear,
            "cosine" => Self::Cosine { num_cycles: 0.5 },
            "cosine_with_restarts" => Self::CosineWithRestarts { num_cycles: 1.0 },
            "polynomial" => Self::Polynomial {
                lr_end: 1e-7,
                power: 1.0,
            },
            _ => {
                return Err(TrainError::Invalid {
                    what: "lr_scheduler".into(),
                    value: name.into(),
                    hint: "use one of \"constant\", \"constant_with_warmup\", \"linear\", \"cosine\", \"cosine_with_restarts\", \"polynomial\"".into(),
                });
            }
        })
    }
}

impl SchedulerKind {
    /// Checks the schedule's arguments: `num_cycles` > 0 (`cosine`) or a whole number >= 1
    /// (`cosine_with_restarts`), `power` > 0 and `lr_end` >= 0 (`polynomial`), all finite.
    ///
    /// # Errors
    /// [`TrainError::Invalid`] naming the argument.
    pub fn validate(&self) -> Result<()> {
        let bad = |what: &str, value: f64, hint: &str| {
            Err(TrainError::Invalid {
                what: format!("{} {what}", self.name()),
                value: value.to_string(),
                hint: hint.into(),
            })
        };
        match *self {
            Self::Cosine { num_cycles } if !(num_cycles > 0.0 && num_cycles.is_finite()) => bad(
                "num_cycles",
                num_cycles,
                "use a number > 0 (0.5 decays to 0 once)",
            ),
            Self::CosineWithRestarts { num_cycles }
                if !(num_cycles >= 1.0 && num_cycles.fract() == 0.0 && num_cycles.is_finite()) =>
            {
                bad("num_cycles", num_cycles, "use a whole number >= 1")
            }
            Self::Polynomial { power, .. } if !(power > 0.0 && power.is_finite()) => {
                bad("power", power, "use a number > 0 (1 is linear decay)")
            }
            Self::Polynomial { lr_end, .. } if !(lr_end >= 0.0 && lr_end.is_finite()) => bad(
                "lr_end",
                lr_end,
                "use a number >= 0 below the learning rate",
            ),
            _ => Ok(()),
        }
    }

    /// The schedule's `lr_scheduler` name (kohya's `ss_lr_scheduler` metadata, transformers'
    /// `SchedulerType`), without its arguments.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::ConstantWithWarmup => "constant_with_warmup",
            Self::Linear => "linear",
            Self::Cosine { .. } => "cosine",
            Self::CosineWithRestarts { .. } => "cosine_with_restarts",
            Self::Polynomial { .. } => "polynomial",
        }
    }
}

/// A schedule bound to a base learning rate, warm-up and length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Scheduler {
    /// The schedule.
    pub kind: SchedulerKind,
    /// The peak learning rate (`lr` of the optimizer).
    pub base_lr: f64,
    /// Warm-up steps (kohya `lr_warmup_steps`).
    pub warmup_steps: u64,
    /// Total optimizer steps of the run.
    pub total_steps: u64,
}

impl Scheduler {
    /// A schedule; `warmup_steps` may exceed `total_steps` (then it never leaves warm-up).
    ///
    /// # Errors
    /// A negative or non-finite `base_lr`, or a polynomial `lr_end` above `base_lr`.
    pub fn new(
        kind: SchedulerKind,
        base_lr: f64,
        warmup_steps: u64,
        total_steps: u64,
    ) -> Result<Self> {
        if !(base_lr.is_finite() && base_lr >= 0.0) {
            return Err(TrainError::Invalid {
                what: "learning rate".into(),
                value: base_lr.to_string(),
                hint: "use a finite value >= 0".into(),
            });
        }
        kind.validate()?;
        if let SchedulerKind::Polynomial { lr_end, .. } = kind
            && lr_end > base_lr
        {
            return Err(TrainError::Invalid {
                what: "polynomial lr_end".into(),
                value: lr_end.to_string(),
                hint: format!("lr_end must not exceed the learning rate {base_lr}"),
            });
        }
        Ok(Self {
            kind,
            base_lr,
            warmup_steps,
            total_steps,
        })
    }

    /// The multiplier of `base_lr` for the update applied after `step` earlier updates
    /// (transformers' `LambdaLR` lambda at `current_step = step`).
    pub fn factor(&self, step: u64) -> f64 {
        let s = step as f64;
        let w = self.warmup_steps as f64;
        let t = self.total_steps as f64;
        let warm = |s: f64| s / w.max(1.0);
        match self.kind {
            SchedulerKind::Constant => 1.0,
            SchedulerKind::ConstantWithWarmup => {
                if s < w {
                    warm(s)
                } else {
                    1.0
                }
            }
            SchedulerKind::Linear => {
                if s < w {
                    warm(s)
                } else {
                    (0f64).max((t - s) / (t - w).max(1.0))
                }
            }
            SchedulerKind::Cosine { num_cycles } => {
                if s < w {
                    return warm(s);
                }
                let progress = (s - w) / (t - w).max(1.0);
                (0f64).max(0.5 * (1.0 + (PI * num_cycles * 2.0 * progress).cos()))
            }
            SchedulerKind::CosineWithRestarts { num_cycles } => {
                if s < w {
                    return warm(s);
                }
                let progress = (s - w) / (t - w).max(1.0);
                if progress >= 1.0 {
                    return 0.0;
                }
                (0f64).max(0.5 * (1.0 + (PI * ((num_cycles * progress) % 1.0)).cos()))
            }
            SchedulerKind::Polynomial { lr_end, power } => {
                if s < w {
                    return warm(s);
                }
                if s > t {
                    return lr_end / self.base_lr;
                }
                let lr_range = self.base_lr - lr_end;
                let decay_steps = t - w;
                let pct_remaining = 1.0 - (s - w) / decay_steps;
                (lr_range * pct_remaining.powf(power) + lr_end) / self.base_lr
            }
        }
    }

    /// The learning rate for the update applied after `step` earlier updates.
    pub fn lr_at(&self, step: u64) -> f64 {
        self.base_lr * self.factor(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_is_linear_from_zero() {
        let s = Scheduler::new(SchedulerKind::Linear, 1e-3, 10, 100).unwrap();
        assert_eq!(s.lr_at(0), 0.0);
        assert!((s.lr_at(5) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr_at(10), 1e-3);
        assert!((s.lr_at(55) - 5e-4).abs() < 1e-15);
        assert_eq!(s.lr_at(100), 0.0);
        assert_eq!(s.lr_at(150), 0.0);
    }

    #[test]
    fn names_parse_and_unknown_is_an_error() {
        assert_eq!(
            SchedulerKind::from_name("cosine").unwrap(),
            SchedulerKind::Cosine { num_cycles: 0.5 }
        );
        let e = SchedulerKind::from_name("onecycle")
            .unwrap_err()
            .to_string();
        assert!(e.contains("onecycle") && e.contains("polynomial"), "{e}");
        for name in [
            "constant",
            "constant_with_warmup",
            "linear",
            "cosine",
            "cosine_with_restarts",
            "polynomial",
        ] {
            assert_eq!(SchedulerKind::from_name(name).unwrap().name(), name);
        }
        assert!(
            Scheduler::new(
                SchedulerKind::Polynomial {
                    lr_end: 1.0,
                    power: 1.0
                },
                1e-3,
                0,
                10
            )
            .is_err()
        );
    }
}
