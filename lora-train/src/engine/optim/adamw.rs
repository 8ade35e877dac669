//! AdamW: Adam with decoupled weight decay (Loshchilov & Hutter, arXiv:1711.05101), exactly the
//! update of `torch.optim.AdamW` (non-amsgrad, `torch/optim/adamw.py` / `_single_tensor_adam`):
//!
//! ```text
//! θ ← θ·(1 − lr·λ)
//! m ← β₁·m + (1 − β₁)·g            v ← β₂·v + (1 − β₂)·g²
//! θ ← θ − lr/(1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)
//! ```

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::optimizer::Optimizer;
use super::optimizer::{
    OptimizerState, ParamGroup, check_lr, check_meta_name, grad_f32, load_slot, meta_u64,
    param_f32, slot_key, tensor_bytes, write_param, zero_grads,
};
use crate::engine::error::{Result, TrainError};

/// AdamW hyper-parameters: `torch.optim.AdamW`'s betas and ε; weight decay 0 as in
/// transformers' `TrainingArguments.weight_decay` (the config's `train.weight_decay` default,
/// so a config and the engine train the same). kohya's and diffusers' training scripts pass
/// torch's `0.01`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdamWConfig {
    /// `(β₁, β₂)`, default `(0.9, 0.999)`.
    pub betas: (f64, f64),
    /// ε added to the denominator, default `1e-8`.
    pub eps: f64,
    /// Decoupled weight decay λ, default `0.0`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

impl AdamWConfig {
    pub(crate) fn validate(&self) -> Result<()> {
        let (b1, b2) = self.betas;
        if !((0.0..1.0).contains(&b1) && (0.0..1.0).contains(&b2)) {
            return Err(TrainError::Invalid {
                what: "betas".into(),
                value: format!("({b1}, {b2})"),
                hint: "both betas must be in [0, 1), e.g. (0.9, 0.999)".into(),
            });
        }
        if !(self.eps >= 0.0 && self.weight_decay >= 0.0) {
            return Err(TrainError::Invalid {
                what: "eps / weight_decay".into(),
                value: format!("{} / {}", self.eps, self.weight_decay),
                hint: "both must be >= 0".into(),
            });
        }
        Ok(())
    }
}

struct Slot {
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: u64,
}

/// AdamW over parameter groups, state in fp32 (`exp_avg`, `exp_avg_sq`: 8 bytes per parameter).
pub struct AdamW {
    groups: Vec<ParamGroup>,
    slots: Vec<Vec<Slot>>,
    lr: f64,
    cfg: AdamWConfig,
    steps: u64,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("lr", &self.lr)
            .field("cfg", &self.cfg)
            .field("steps", &self.steps)
            .finish()
    }
}

impl AdamW {
    /// Builds the optimizer; state is allocated now (zeros, fp32, on each parameter's device).
    ///
    /// # Errors
    /// Invalid hyper-parameters or a libtorch error.
    pub fn new(groups: Vec<ParamGroup>, lr: f64, cfg: AdamWConfig) -> Result<Self> {
        check_lr(lr)?;
        cfg.validate()?;
        let mut slots = Vec::with_capacity(groups.len());
        for g in &groups {
            let mut s = Vec::with_capacity(g.params.len());
            for p in &g.params {
                let z = Tensor::f_zeros(p.size(), (Kind::Float, p.device()))?;
                s.push(Slot {
                    exp_avg: z.f_detach_copy()?,
                    exp_avg_sq: z,
                    step: 0,
                });
            }
            slots.push(s);
        }
        Ok(Self {
            groups,
            slots,
            lr,
            cfg,
            steps: 0,
        })
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }
}

/// One AdamW update of parameter `p` with fp32 gradient `g`; shared with [`super::AdamW8bit`].
/// The same computation as [`AdamW`]'s step ([`lora_core::sys::adam_foreach_step`] over this one
/// tensor), on an fp32 working copy for a bf16/fp16 parameter.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw_update(
    p: &Tensor,
    g: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    step: u64,
    lr: f64,
    weight_decay: f64,
    cfg: &AdamWConfig,
) -> Result<()> {
    let w = if p.kind() == Kind::Float {
        p.shallow_clone()
    } else {
        param_f32(p)?
    };
    let (neg_step_size, bias_correction2_sqrt) = step_corrections(cfg, lr, step);
    lora_core::sys::adam_foreach_step(
        std::slice::from_ref(&w),
        std::slice::from_ref(g),
        std::slice::from_ref(exp_avg),
        std::slice::from_ref(exp_avg_sq),
        &[neg_step_size],
        &[bias_correction2_sqrt],
        update_scalars(cfg, lr, weight_decay),
    )?;
    if p.kind() != Kind::Float {
        write_param(p, &w)?;
    }
    Ok(())
}

/// The scalars of an AdamW update shared by every tensor of a group: `decay_factor = 1 − lr·wd`
/// (1 without weight decay), `1 − β₁`, `β₂`, `1 − β₂`, ε (`torch/optim/adamw.py`).
fn update_scalars(
    cfg: &AdamWConfig,
    lr: f64,
    weight_decay: f64,
) -> lora_core::sys::AdamForeachScalars {
    let (b1, b2) = cfg.betas;
    lora_core::sys::AdamForeachScalars {
        decay_factor: if weight_decay != 0.0 {
            1.0 - lr * weight_decay
        } else {
            1.0
        },
        one_minus_beta1: 1.0 - b1,
        beta2: b2,
        one_minus_beta2: 1.0 - b2,
        eps: cfg.eps,
    }
}

/// A tensor's bias corrections at its `step` (1-based): `(−lr / (1 − β₁ᵗ), √(1 − β₂ᵗ))`.
fn step_corrections(cfg: &AdamWConfig, lr: f64, step: u64) -> (f64, f64) {
    let (b1, b2) = cfg.betas;
    let t = step as i32;
    (-(lr / (1.0 - b1.powi(t))), (1.0 - b2.powi(t)).sqrt())
}

/// Most elements per multi-tensor call: off the CPU the denominators of one call are a temporary
/// as large as the chunk's state (4 Mi fp32 elements = 16 MiB), whatever the adapter's size; the
/// memory planner charges the same ([`lora_memory::estimate::OURS_FOREACH_CHUNK_ELEMENTS`]). The
/// CPU's fused pass allocates nothing.
const FOREACH_CHUNK_ELEMENTS: i64 = lora_memory::estimate::OURS_FOREACH_CHUNK_ELEMENTS as i64;

/// Parallel lists for one [`lora_core::sys::adam_foreach_step`] call.
#[derive(Default)]
struct ForeachBatch {
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
    neg_step_size: Vec<f64>,
    bias_correction2_sqrt: Vec<f64>,
    elements: i64,
}

impl ForeachBatch {
    fn flush(&mut self, s: lora_core::sys::AdamForeachScalars) -> Result<()> {
        if self.params.is_empty() {
            return Ok(());
        }
        lora_core::sys::adam_foreach_step(
            &self.params,
            &self.grads,
            &self.exp_avgs,
            &self.exp_avg_sqs,
            &self.neg_step_size,
            &self.bias_correction2_sqrt,
            s,
        )?;
        *self = Self::default();
        Ok(())
    }
}

impl Optimizer for AdamW {
    /// fp32 parameters on one device go through [`lora_core::sys::adam_foreach_step`] (on the
    /// CPU one fused pass per tensor, within a rounding of `torch.optim.AdamW`; elsewhere
    /// libtorch's multi-tensor ops, its bits); others (bf16/fp16 parameters with fp32 state)
    /// through a per-tensor update. On CPU the step runs on one libtorch thread (libtorch's
    /// intra-op threads are set to 1 for the step and restored after).
    fn step(&mut self) -> Result<()> {
        let _ng = tch::no_grad_guard();
        let _threads = super::optimizer::CpuStepThreads::for_params(&self.params());
        for (gi, group) in self.groups.iter().enumerate() {
            let lr = self.lr * group.lr_scale;
            let wd = group.weight_decay.unwrap_or(self.cfg.weight_decay);
            let scalars = update_scalars(&self.cfg, lr, wd);
            let mut batch = ForeachBatch::default();
            for (pi, p) in group.params.iter().enumerate() {
                let Some(g) = grad_f32(p)? else { continue };
                let slot = &mut self.slots[gi][pi];
                slot.step += 1;
                if p.kind() != Kind::Float
                    || batch
                        .params
                        .first()
                        .is_some_and(|q| q.device() != p.device())
                {
                    if p.kind() != Kind::Float {
                        adamw_update(
                            p,
                            &g,
                            &mut slot.exp_avg,
                            &mut slot.exp_avg_sq,
                            slot.step,
                            lr,
                            wd,
                            &self.cfg,
                        )?;
                        continue;
                    }
                    batch.flush(scalars)?;
                }
                let (neg_step_size, bias_correction2_sqrt) =
                    step_corrections(&self.cfg, lr, slot.step);
                batch.neg_step_size.push(neg_step_size);
                batch.bias_correction2_sqrt.push(bias_correction2_sqrt);
                batch.elements += p.numel() as i64;
                batch.params.push(p.shallow_clone());
                batch.grads.push(g);
                batch.exp_avgs.push(slot.exp_avg.shallow_clone());
                batch.exp_avg_sqs.push(slot.exp_avg_sq.shallow_clone());
                if batch.elements >= FOREACH_CHUNK_ELEMENTS {
                    batch.flush(scalars)?;
                }
            }
            batch.flush(scalars)?;
        }
        self.steps += 1;
        Ok(())
    }

    fn zero_grad(&mut self) -> Result<()> {
        zero_grads(&self.params())
    }

    fn set_lr(&mut self, lr: f64) {
        self.lr = lr;
    }

    fn lr(&self) -> f64 {
        self.lr
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut st = OptimizerState::default();
        let mut per_param_steps = Vec::new();
        for (gi, slots) in self.slots.iter().enumerate() {
            for (pi, s) in slots.iter().enumerate() {
                st.tensors
                    .insert(slot_key(gi, pi, "exp_avg"), s.exp_avg.f_detach_copy()?);
                st.tensors.insert(
                    slot_key(gi, pi, "exp_avg_sq"),
                    s.exp_avg_sq.f_detach_copy()?,
                );
                per_param_steps.push(s.step);
            }
        }
        st.meta = serde_json::json!({
            "optimizer": self.name(),
            "steps": self.steps,
            "lr": self.lr,
            "param_steps": per_param_steps,
            "config": self.cfg,
        });
        Ok(st)
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        check_meta_name(&state.meta, self.name())?;
        let _ng = tch::no_grad_guard();
        let steps = meta_u64(&state.meta, "steps", self.name())?;
        let param_steps: Vec<u64> = state
            .meta
            .get("param_steps")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        let mut k = 0;
        for (gi, slots) in self.slots.iter_mut().enumerate() {
            for (pi, s) in slots.iter_mut().enumerate() {
                let key = slot_key(gi, pi, "exp_avg");
                load_slot(&mut s.exp_avg, state.tensor(&key, "AdamW")?, &key)?;
                let key = slot_key(gi, pi, "exp_avg_sq");
                load_slot(&mut s.exp_avg_sq, state.tensor(&key, "AdamW")?, &key)?;
                s.step = param_steps.get(k).copied().unwrap_or(steps);
                k += 1;
            }
        }
        self.steps = steps;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|s| tensor_bytes(&s.exp_avg) + tensor_bytes(&s.exp_avg_sq))
            .sum()
    }

    fn params(&self) -> Vec<Tensor> {
        self.groups
            .iter()
            .flat_map(|g| g.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    fn name(&self) -> &'static str {
        "AdamW"
    }
}

impl super::Registered for AdamW {
    type Config = AdamWConfig;
    const ALIASES: &'static [(&'static str, &'static str)] =
        &[("adam", "AdamW"), ("adamw_torch", "AdamW")];

    fn build(groups: Vec<ParamGroup>, lr: f64, config: AdamWConfig) -> Result<Self> {
        Self::new(groups, lr, config)
    }

    fn config(_name: &str, args: &super::OptimizerArgs) -> AdamWConfig {
        AdamWConfig {
            weight_decay: args.weight_decay,
            ..AdamWConfig::default()
        }
    }

    fn memory_term(_config: &AdamWConfig) -> lora_memory::Optimizer {
        lora_memory::Optimizer::AdamW
    }
}
