//! Stochastic gradient descent with optional momentum, dampening, Nesterov momentum and L2 weight
//! decay — the update of `torch.optim.SGD` (`torch/optim/sgd.py`, `_single_tensor_sgd`):
//!
//! ```text
//! d = g + λθ
//! momentum μ > 0: b ← d (first step) or μb + (1 − τ)d;  d = d + μb (Nesterov) or b
//! θ ← θ − lr·d
//! ```

use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use super::optimizer::Optimizer;
use super::optimizer::{
    OptimizerState, ParamGroup, check_lr, check_meta_name, grad_f32, load_slot, meta_u64,
    param_f32, slot_key, tensor_bytes, write_param, zero_grads,
};
use crate::engine::error::{Result, TrainError};

/// SGD hyper-parameters (defaults of `torch.optim.SGD`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct SgdConfig {
    /// Momentum μ, default `0`.
    pub momentum: f64,
    /// Dampening τ, default `0`.
    pub dampening: f64,
    /// Nesterov momentum (requires μ > 0 and τ = 0), default `false`.
    pub nesterov: bool,
    /// L2 weight decay λ (added to the gradient), default `0`.
    pub weight_decay: f64,
}

/// SGD over parameter groups; state is one momentum buffer per parameter when μ > 0.
pub struct Sgd {
    groups: Vec<ParamGroup>,
    buffers: Vec<Vec<Option<Tensor>>>,
    lr: f64,
    cfg: SgdConfig,
    steps: u64,
}

impl std::fmt::Debug for Sgd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sgd")
            .field("lr", &self.lr)
            .field("cfg", &self.cfg)
            .field("steps", &self.steps)
            .finish()
    }
}

impl Sgd {
    /// Builds the optimizer.
    ///
    /// # Errors
    /// Nesterov without momentum or with dampening, or a negative hyper-parameter.
    pub fn new(groups: Vec<ParamGroup>, lr: f64, cfg: SgdConfig) -> Result<Self> {
        check_lr(lr)?;
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            return Err(TrainError::Invalid {
                what: "SGD nesterov".into(),
                value: format!("momentum {} dampening {}", cfg.momentum, cfg.dampening),
                hint: "Nesterov momentum requires momentum > 0 and dampening = 0".into(),
            });
        }
        if cfg.momentum < 0.0 || cfg.weight_decay < 0.0 {
            return Err(TrainError::Invalid {
                what: "SGD momentum / weight_decay".into(),
                value: format!("{} / {}", cfg.momentum, cfg.weight_decay),
                hint: "both must be >= 0".into(),
            });
        }
        let buffers = groups
            .iter()
            .map(|g| g.params.iter().map(|_| None).collect())
            .collect();
        Ok(Self {
            groups,
            buffers,
            lr,
            cfg,
            steps: 0,
        })
    }
}

impl Optimizer for Sgd {
    fn step(&mut self) -> Result<()> {
        let _ng = tch::no_grad_guard();
        let _threads = super::optimizer::CpuStepThreads::for_params(&self.params());
        for (gi, group) in self.groups.iter().enumerate() {
            let lr = self.lr * group.lr_scale;
            let wd = group.weight_decay.unwrap_or(self.cfg.weight_decay);
            for (pi, p) in group.params.iter().enumerate() {
                let Some(g) = grad_f32(p)? else { continue };
                let mut w = if p.kind() == Kind::Float {
                    p.shallow_clone()
                } else {
                    param_f32(p)?
                };
                let mut d = if wd != 0.0 {
                    g.f_add(&w.f_mul_scalar(wd)?)?
                } else {
                    g
                };
                if self.cfg.momentum != 0.0 {
                    let mu = self.cfg.momentum;
                    let buf = match self.buffers[gi][pi].take() {
                        None => d.f_detach()?.f_detach_copy()?,
                        Some(mut b) => {
                            let _ = b.f_mul_scalar_(mu)?;
                            let _ = b.f_add_(&d.f_mul_scalar(1.0 - self.cfg.dampening)?)?;
                            b
                        }
                    };
                    d = if self.cfg.nesterov {
                        d.f_add(&buf.f_mul_scalar(mu)?)?
                    } else {
                        buf.shallow_clone()
                    };
                    self.buffers[gi][pi] = Some(buf);
                }
                let _ = w.f_add_(&d.f_mul_scalar(-lr)?)?;
                if p.kind() != Kind::Float {
                    write_param(p, &w)?;
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
        for (gi, bufs) in self.buffers.iter().enumerate() {
            for (pi, b) in bufs.iter().enumerate() {
                if let Some(b) = b {
                    st.tensors
                        .insert(slot_key(gi, pi, "momentum_buffer"), b.f_detach_copy()?);
                }
            }
        }
        st.meta = serde_json::json!({
            "optimizer": self.name(),
            "steps": self.steps,
            "lr": self.lr,
            "config": self.cfg,
        });
        Ok(st)
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        check_meta_name(&state.meta, self.name())?;
        let _ng = tch::no_grad_guard();
        let steps = meta_u64(&state.meta, "steps", self.name())?;
        for (gi, group) in self.groups.iter().enumerate() {
            for (pi, p) in group.params.iter().enumerate() {
                let key = slot_key(gi, pi, "momentum_buffer");
                self.buffers[gi][pi] = match state.tensors.get(&key) {
                    Some(src) => {
                        let mut dst = Tensor::f_zeros(p.size(), (Kind::Float, p.device()))?;
                        load_slot(&mut dst, src, &key)?;
                        Some(dst)
                    }
                    None => None,
                };
            }
        }
        self.steps = steps;
        Ok(())
    }

    fn state_bytes(&self) -> u64 {
        self.buffers
            .iter()
            .flatten()
            .flatten()
            .map(tensor_bytes)
            .sum()
    }

    fn params(&self) -> Vec<Tensor> {
        self.groups
            .iter()
            .flat_map(|g| g.params.iter().map(|p| p.shallow_clone()))
            .collect()
    }

    fn name(&self) -> &'static str {
        "SGD"
    }
}

/// The momentum of `SGDNesterov` when none is given: 0.9, kohya sd-scripts' default for it
/// (`torch.optim.SGD` itself defaults to 0, which Nesterov momentum does not allow).
pub const NESTEROV_MOMENTUM: f64 = 0.9;

impl super::Registered for Sgd {
    type Config = SgdConfig;

    fn build(groups: Vec<ParamGroup>, lr: f64, config: SgdConfig) -> Result<Self> {
        Self::new(groups, lr, config)
    }

    /// `SGD`: momentum as set (0 unless set, as `torch.optim.SGD`); `SGDNesterov`: Nesterov
    /// momentum, [`NESTEROV_MOMENTUM`] unless set. Weight decay as set (L2).
    fn config(name: &str, args: &super::OptimizerArgs) -> SgdConfig {
        let nesterov = name == "SGDNesterov";
        let default_momentum = if nesterov {
            NESTEROV_MOMENTUM
        } else {
            SgdConfig::default().momentum
        };
        SgdConfig {
            momentum: args.momentum.unwrap_or(default_momentum),
            weight_decay: args.weight_decay,
            nesterov,
            ..SgdConfig::default()
        }
    }

    fn memory_term(config: &SgdConfig) -> lora_memory::Optimizer {
        lora_memory::Optimizer::Sgd {
            momentum: config.momentum as f32,
        }
    }
}
