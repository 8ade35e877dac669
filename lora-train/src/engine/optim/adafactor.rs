//! Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost",
//! arXiv:1804.04235), following `transformers.optimization.Adafactor` step for step, with
//! `relative_step = false` and `scale_parameter = false` by default (an external learning rate and
//! scheduler drive it, as kohya's recommended Adafactor settings do):
//!
//! ```text
//! β₂ₜ = 1 − t^decay_rate
//! u  = g² + ε₁
//! matrices (≥ 2-D): R ← β₂ₜR + (1−β₂ₜ)·mean_col(u)   C ← β₂ₜC + (1−β₂ₜ)·mean_row(u)
//!                   v̂ = (R / mean(R)) ⊗ C            (factored second moment)
//! vectors:          v̂ ← β₂ₜv̂ + (1−β₂ₜ)·u
//! U = g / √v̂;  U ← U / max(1, RMS(U)/d);  U ← ρₜ·U   (ρₜ = lr, or the relative step)
//! with β₁: m ← β₁m + (1−β₁)U, U = m
//! θ ← θ − λρₜθ − U
//! ```

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::optimizer::Optimizer;
use super::optimizer::{
    OptimizerState, ParamGroup, check_lr, check_meta_name, grad_f32, load_slot, meta_u64,
    param_f32, slot_key, tensor_bytes, write_param, zero_grads,
};
use crate::engine::error::{Result, TrainError};

/// Adafactor hyper-parameters (`transformers.optimization.Adafactor` names; defaults as there
/// except `scale_parameter` and `relative_step`, which are off).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdafactorConfig {
    /// `(ε₁, ε₂)`: regularizer added to g², and the floor of the parameter RMS; default `(1e-30, 1e-3)`.
    pub eps: (f64, f64),
    /// Threshold `d` of the update RMS clipping, default `1.0`.
    pub clip_threshold: f64,
    /// Exponent of the second-moment decay `β₂ₜ = 1 − t^decay_rate`, default `-0.8`.
    pub decay_rate: f64,
    /// First-moment coefficient; `None` (default) keeps no first moment.
    pub beta1: Option<f64>,
    /// Weight decay λ (applied as `θ ← θ − λ·ρₜ·θ`), default `0`.
    pub weight_decay: f64,
    /// Multiply the step by `max(ε₂, RMS(θ))`, default `false`.
    pub scale_parameter: bool,
    /// Use the time-dependent step `min(1e-2, 1/√t)` instead of `lr`, default `false`.
    pub relative_step: bool,
    /// With `relative_step`: warm up as `1e-6·t`, default `false`.
    pub warmup_init: bool,
}

impl Default for AdafactorConfig {
    fn default() -> Self {
        Self {
            eps: (1e-30, 1e-3),
            clip_threshold: 1.0,
            decay_rate: -0.8,
            beta1: None,
            weight_decay: 0.0,
            scale_parameter: false,
            relative_step: false,
            warmup_init: false,
        }
    }
}

enum Second {
    Factored { row: Tensor, col: Tensor },
    Full(Tensor),
}

struct Slot {
    second: Second,
    exp_avg: Option<Tensor>,
    step: u64,
}

/// Adafactor over parameter groups (see the module docs). State for a `[out, in]` matrix is
/// `out + in` fp32 values (plus `out·in` with `beta1`).
pub struct Adafactor {
    groups: Vec<ParamGroup>,
    slots: Vec<Vec<Slot>>,
    lr: f64,
    cfg: AdafactorConfig,
    steps: u64,
}

impl std::fmt::Debug for Adafactor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adafactor")
            .field("lr", &self.lr)
            .field("cfg", &self.cfg)
            .field("steps", &self.steps)
            .finish()
    }
}

fn rms(t: &Tensor) -> Result<f64> {
    // transformers: tensor.norm(2) / (tensor.numel() ** 0.5)
    Ok(t.f_norm()?.f_double_value(&[])? / (t.numel() as f64).sqrt())
}

impl Adafactor {
    /// Builds the optimizer.
    ///
    /// # Errors
    /// Invalid hyper-parameters (e.g. `warmup_init` without `relative_step`) or a libtorch error.
    pub fn new(groups: Vec<ParamGroup>, lr: f64, cfg: AdafactorConfig) -> Result<Self> {
        check_lr(lr)?;
        if cfg.warmup_init && !cfg.relative_step {
            return Err(TrainError::Invalid {
                what: "Adafactor warmup_init".into(),
                value: "true".into(),
                hint: "warmup_init requires relative_step = true".into(),
            });
        }
        if let Some(b1) = cfg.beta1
            && !(0.0..1.0).contains(&b1)
        {
            return Err(TrainError::Invalid {
                what: "Adafactor beta1".into(),
                value: b1.to_string(),
                hint: "beta1 must be in [0, 1) or absent".into(),
            });
        }
        let mut slots = Vec::with_capacity(groups.len());
        for g in &groups {
            let mut s = Vec::with_capacity(g.params.len());
            for p in &g.params {
                let shape = p.size();
                let opts = (Kind::Float, p.device());
                let second = if shape.len() >= 2 {
                    let row_shape = &shape[..shape.len() - 1];
                    let mut col_shape = shape[..shape.len() - 2].to_vec();
                    col_shape.push(shape[shape.len() - 1]);
                    Second::Factored {
                        row: Tensor::f_zeros(row_shape, opts)?,
                        col: Tensor::f_zeros(col_shape.as_slice(), opts)?,
                    }
                } else {
                    Second::Full(Tensor::f_zeros(shape.as_slice(), opts)?)
                };
                let exp_avg = match cfg.beta1 {
                    Some(_) => Some(Tensor::f_zeros(shape.as_slice(), opts)?),
                    None => None,
                };
                s.push(Slot {
                    second,
                    exp_avg,
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

    fn step_size(&self, lr: f64, step: u64, param_rms: f64) -> f64 {
        let mut rel = lr;
        if self.cfg.relative_step {
            let min_step = if self.cfg.warmup_init {
                1e-6 * step as f64
            } else {
                1e-2
            };
            rel = min_step.min(1.0 / (step as f64).sqrt());
        }
        let scale = if self.cfg.scale_parameter {
            self.cfg.eps.1.max(param_rms)
        } else {
            1.0
        };
        scale * rel
    }
}

impl Optimizer for Adafactor {
    fn step(&mut self) -> Result<()> {
        let _ng = tch::no_grad_guard();
        let _threads = super::optimizer::CpuStepThreads::for_params(&self.params());
        let cfg = self.cfg.clone();
        for gi in 0..self.groups.len() {
            let lr_group = self.lr * self.groups[gi].lr_scale;
            let wd = self.groups[gi].weight_decay.unwrap_or(cfg.weight_decay);
            for pi in 0..self.groups[gi].params.len() {
                let p = self.groups[gi].params[pi].shallow_clone();
                let Some(g) = grad_f32(&p)? else { continue };
                let mut w = if p.kind() == Kind::Float {
                    p.shallow_clone()
                } else {
                    param_f32(&p)?
                };
                let step = {
                    let slot = &mut self.slots[gi][pi];
                    slot.step += 1;
                    slot.step
                };
                let param_rms = if cfg.scale_parameter { rms(&w)? } else { 0.0 };
                let lr = self.step_size(lr_group, step, param_rms);
                let slot = &mut self.slots[gi][pi];
                let beta2t = 1.0 - (step as f64).powf(cfg.decay_rate);
                let upd_sq = g.f_square()?.f_add_scalar(cfg.eps.0)?;
                let mut update = match &mut slot.second {
                    Second::Factored { row, col } => {
                        let _ = row.f_mul_scalar_(beta2t)?;
                        let _ = row.f_add_(
                            &upd_sq
                                .f_mean_dim(-1, false, Kind::Float)?
                                .f_mul_scalar(1.0 - beta2t)?,
                        )?;
                        let _ = col.f_mul_scalar_(beta2t)?;
                        let _ = col.f_add_(
                            &upd_sq
                                .f_mean_dim(-2, false, Kind::Float)?
                                .f_mul_scalar(1.0 - beta2t)?,
                        )?;
                        // _approx_sq_grad: rsqrt(R / mean(R)) ⊗ rsqrt(C)
                        let r_factor = row
                            .f_div(&row.f_mean_dim(-1, true, Kind::Float)?)?
                            .f_rsqrt()?
                            .f_unsqueeze(-1)?;
                        let c_factor = col.f_unsqueeze(-2)?.f_rsqrt()?;
                        r_factor.f_mul(&c_factor)?.f_mul(&g)?
                    }
                    Second::Full(v) => {
                        let _ = v.f_mul_scalar_(beta2t)?;
                        let _ = v.f_add_(&upd_sq.f_mul_scalar(1.0 - beta2t)?)?;
                        v.f_rsqrt()?.f_mul(&g)?
                    }
                };
                let denom = (rms(&update)? / cfg.clip_threshold).max(1.0);
                let _ = update.f_div_scalar_(denom)?;
                let _ = update.f_mul_scalar_(lr)?;
                if let (Some(b1), Some(m)) = (cfg.beta1, slot.exp_avg.as_mut()) {
                    let _ = m.f_mul_scalar_(b1)?;
                    let _ = m.f_add_(&update.f_mul_scalar(1.0 - b1)?)?;
                    update = m.shallow_clone();
                }
                if wd != 0.0 {
                    let _ = w.f_add_(&w.f_mul_scalar(-wd * lr)?)?;
                }
                let _ = w.f_sub_(&update)?;
                if p.kind() != Kind::Float {
                    write_param(&p, &w)?;
                }
            }
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
                match &s.second {
                    Second::Factored { row, col } => {
                        st.tensors
                            .insert(slot_key(gi, pi, "exp_avg_sq_row"), row.f_detach_copy()?);
                        st.tensors
                            .insert(slot_key(gi, pi, "exp_avg_sq_col"), col.f_detach_copy()?);
                    }
                    Second::Full(v) => {
                        st.tensors
                            .insert(slot_key(gi, pi, "exp_avg_sq"), v.f_detach_copy()?);
                    }
                }
                if let Some(m) = &s.exp_avg {
                    st.tensors
                        .insert(slot_key(gi, pi, "exp_avg"), m.f_detach_copy()?);
                }
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
                match &mut s.second {
                    Second::Factored { row, col } => {
                        let key = slot_key(gi, pi, "exp_avg_sq_row");
                        load_slot(row, state.tensor(&key, "Adafactor")?, &key)?;
                        let key = slot_key(gi, pi, "exp_avg_sq_col");
                        load_slot(col, state.tensor(&key, "Adafactor")?, &key)?;
                    }
                    Second::Full(v) => {
                        let key = slot_key(gi, pi, "exp_avg_sq");
                        load_slot(v, state.tensor(&key, "Adafactor")?, &key)?;
                    }
                }
                if let Some(m) = s.exp_avg.as_mut() {
                    let key = slot_key(gi, pi, "exp_avg");
                    load_slot(m, state.tensor(&key, "Adafactor")?, &key)?;
                }
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
            .map(|s| {
                let second = match &s.second {
                    Second::Factored { row, col } => tensor_bytes(row) + tensor_bytes(col),
                    Second::Full(v) => tensor_bytes(v),
                };
                second + s.exp_avg.as_ref().map(tensor_bytes).unwrap_or(0)
            })
            .sum()
    }

    fn params(&self) -> Vec<Tensor> {
        self.groups
            .iter()
            .flat_map(|g| g.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    fn name(&self) -> &'static str {
        "Adafactor"
    }
}

impl super::Registered for Adafactor {
    type Config = AdafactorConfig;

    fn build(groups: Vec<ParamGroup>, lr: f64, config: AdafactorConfig) -> Result<Self> {
        Self::new(groups, lr, config)
    }

    /// Adafactor's defaults; a config's weight decay and momentum do not apply to it.
    fn config(_name: &str, _args: &super::OptimizerArgs) -> AdafactorConfig {
        AdafactorConfig::default()
    }

    fn memory_term(_config: &AdafactorConfig) -> lora_memory::Optimizer {
        lora_memory::Optimizer::Adafactor
    }
}
