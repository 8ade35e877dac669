//! AdamW with 8-bit optimizer state: both moments are kept as block-wise dynamic-quantized bytes
//! (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861; the
//! `bitsandbytes` `AdamW8bit` optimizer). Each step dequantizes a parameter's moments to fp32,
//! applies exactly the [`super::AdamW`] update, and quantizes them back.
//!
//! - Blocks of [`AdamW8bit::BLOCK`] = 2048 consecutive elements share one fp32 absmax scale.
//! - Codes: the dynamic (tree) data type of the paper, signed for `exp_avg` and unsigned for
//!   `exp_avg_sq` (bitsandbytes `create_dynamic_map(signed=…)`, 7 exponent bits): for each decade
//!   `10^(i−6)`, `i = 0..7`, the midpoints of `linspace(0.1, 1, k+1)` with `k = 2^i` (signed, both
//!   signs) or `k = 2^(i+1)` (unsigned), plus 0 and 1 — 256 values.
//! - Tensors with fewer than [`AdamW8bit::MIN_8BIT_SIZE`] = 4096 elements keep fp32 state
//!   (bitsandbytes' `min_8bit_size`).
//!
//! State memory: about 2 bytes + 8/2048 bytes per parameter instead of 8.

use tch::{Device, Kind, Tensor};

use super::adamw::adamw_update;
use super::{
    AdamWConfig, OptimizerState, ParamGroup, check_lr, check_meta_name, grad_f32, load_slot,
    meta_u64, slot_key, tensor_bytes, zero_grads,
};
use crate::optim::Optimizer;
use crate::trainer::{Result, TrainError};

/// A 256-entry quantization code (sorted ascending) and its 255 decision midpoints.
#[derive(Debug)]
pub struct DynamicMap {
    /// Code values, `[256]` fp32, sorted ascending, in `[-1, 1]` (signed) or `[0, 1]` (unsigned).
    pub code: Tensor,
    /// Midpoints between consecutive code values, `[255]` fp32 (nearest-value rounding).
    pub mids: Tensor,
}

impl DynamicMap {
    /// The code values as plain numbers (see the module docs for the construction).
    pub fn values(signed: bool) -> Vec<f32> {
        let max_exponent_bits = 7i32;
        let mut data: Vec<f64> = Vec::with_capacity(256);
        for i in 0..max_exponent_bits {
            let k = if signed {
                1usize << i
            } else {
                1usize << (i + 1)
            };
            let scale = 10f64.powi(i - (max_exponent_bits - 1));
            // linspace(0.1, 1, k + 1) midpoints.
            let b = |j: usize| 0.1 + 0.9 * j as f64 / k as f64;
            for j in 0..k {
                let mean = (b(j) + b(j + 1)) / 2.0;
                data.push(scale * mean);
                if signed {
                    data.push(-scale * mean);
                }
            }
        }
        data.push(0.0);
        data.push(1.0);
        let mut v: Vec<f32> = data.into_iter().map(|x| x as f32).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v
    }

    /// The map on `device`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn new(signed: bool, device: Device) -> Result<Self> {
        let v = Self::values(signed);
        let mids: Vec<f32> = v.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect();
        Ok(Self {
            code: Tensor::from_slice(&v).f_to_device(device)?,
            mids: Tensor::from_slice(&mids).f_to_device(device)?,
        })
    }
}

/// A tensor stored block-wise quantized: `codes` `[n_blocks · BLOCK]` u8 indexes into a
/// [`DynamicMap`], `absmax` `[n_blocks]` fp32 per-block scales.
#[derive(Debug)]
pub struct QuantizedState {
    /// Code indexes, u8, padded to whole blocks.
    pub codes: Tensor,
    /// Per-block absolute maximum, fp32.
    pub absmax: Tensor,
    shape: Vec<i64>,
}

impl QuantizedState {
    /// Zeros of `shape` on `device`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn zeros(shape: &[i64], device: Device, map: &DynamicMap) -> Result<Self> {
        let z = Tensor::f_zeros(shape, (Kind::Float, device))?;
        Self::quantize(&z, map)
    }

    /// Quantizes fp32 `x` block-wise with `map` (nearest code after dividing by the block absmax).
    ///
    /// # Errors
    /// A libtorch error.
    pub fn quantize(x: &Tensor, map: &DynamicMap) -> Result<Self> {
        let b = AdamW8bit::BLOCK;
        let n = x.numel() as i64;
        let n_blocks = (n + b - 1) / b;
        let flat = x.f_reshape([-1])?.f_to_kind(Kind::Float)?;
        let padded = if n_blocks * b == n {
            flat
        } else {
            Tensor::f_cat(
                &[
                    flat,
                    Tensor::f_zeros([n_blocks * b - n], (Kind::Float, x.device()))?,
                ],
                0,
            )?
        };
        let blocks = padded.f_view([n_blocks, b])?;
        let absmax = blocks.f_abs()?.f_amax([1i64].as_slice(), false)?;
        let safe = absmax.f_clamp_min(f32::MIN_POSITIVE as f64)?;
        let normed = blocks.f_div(&safe.f_unsqueeze(1)?)?;
        let idx = normed.f_bucketize(&map.mids, false, false)?;
        let codes = idx.f_to_kind(Kind::Uint8)?.f_reshape([-1])?;
        Ok(Self {
            codes,
            absmax,
            shape: x.size(),
        })
    }

    /// fp32 values `[shape]`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn dequantize(&self, map: &DynamicMap) -> Result<Tensor> {
        let n_blocks = self.absmax.size()[0];
        let vals = map
            .code
            .f_index_select(0, &self.codes.f_to_kind(Kind::Int64)?)?;
        let vals = vals
            .f_view([n_blocks, AdamW8bit::BLOCK])?
            .f_mul(&self.absmax.f_unsqueeze(1)?)?;
        let n: i64 = self.shape.iter().product();
        Ok(vals
            .f_reshape([-1])?
            .f_narrow(0, 0, n)?
            .f_reshape(self.shape.as_slice())?)
    }

    /// Bytes held (codes + scales).
    pub fn bytes(&self) -> u64 {
        tensor_bytes(&self.codes) + tensor_bytes(&self.absmax)
    }
}

enum Moments {
    Full {
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
    },
    Quant {
        exp_avg: QuantizedState,
        exp_avg_sq: QuantizedState,
    },
}

struct Slot {
    moments: Moments,
    step: u64,
}

/// AdamW with block-wise 8-bit moments (see the module docs).
pub struct AdamW8bit {
    groups: Vec<ParamGroup>,
    slots: Vec<Vec<Slot>>,
    lr: f64,
    cfg: AdamWConfig,
    steps: u64,
    signed: DynamicMap,
    unsigned: DynamicMap,
}

impl std::fmt::Debug for AdamW8bit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW8bit")
            .field("lr", &self.lr)
            .field("cfg", &self.cfg)
            .field("steps", &self.steps)
            .finish()
    }
}

impl AdamW8bit {
    /// Elements per quantization block.
    pub const BLOCK: i64 = 2048;
    /// Tensors with fewer elements keep fp32 state.
    pub const MIN_8BIT_SIZE: i64 = 4096;

    /// Builds the optimizer; state is allocated now.
    ///
    /// # Errors
    /// Invalid hyper-parameters or a libtorch error.
    pub fn new(groups: Vec<ParamGroup>, lr: f64, cfg: AdamWConfig) -> Result<Self> {
        check_lr(lr)?;
        cfg.validate()?;
        let device = groups
            .iter()
            .flat_map(|g| g.params.first())
            .map(|p| p.device())
            .next()
            .unwrap_or(Device::Cpu);
        let signed = DynamicMap::new(true, device)?;
        let unsigned = DynamicMap::new(false, device)?;
        let mut slots = Vec::with_capacity(groups.len());
        for g in &groups {
            let mut s = Vec::with_capacity(g.params.len());
            for p in &g.params {
                let moments = if p.numel() as i64 >= Self::MIN_8BIT_SIZE {
                    Moments::Quant {
                        exp_avg: QuantizedState::zeros(&p.size(), p.device(), &signed)?,
                        exp_avg_sq: QuantizedState::zeros(&p.size(), p.device(), &unsigned)?,
                    }
                } else {
                    let z = Tensor::f_zeros(p.size(), (Kind::Float, p.device()))?;
                    Moments::Full {
                        exp_avg: z.f_detach_copy()?,
                        exp_avg_sq: z,
                    }
                };
                s.push(Slot { moments, step: 0 });
            }
            slots.push(s);
        }
        Ok(Self {
            groups,
            slots,
            lr,
            cfg,
            steps: 0,
            signed,
            unsigned,
        })
    }
}

impl Optimizer for AdamW8bit {
    fn step(&mut self) -> Result<()> {
        let _ng = tch::no_grad_guard();
        for (gi, group) in self.groups.iter().enumerate() {
            let lr = self.lr * group.lr_scale;
            let wd = group.weight_decay.unwrap_or(self.cfg.weight_decay);
            for (pi, p) in group.params.iter().enumerate() {
                let Some(g) = grad_f32(p)? else { continue };
                let slot = &mut self.slots[gi][pi];
                slot.step += 1;
                match &mut slot.moments {
                    Moments::Full {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        adamw_update(p, &g, exp_avg, exp_avg_sq, slot.step, lr, wd, &self.cfg)?;
                    }
                    Moments::Quant {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        let mut m = exp_avg.dequantize(&self.signed)?;
                        let mut v = exp_avg_sq.dequantize(&self.unsigned)?;
                        adamw_update(p, &g, &mut m, &mut v, slot.step, lr, wd, &self.cfg)?;
                        *exp_avg = QuantizedState::quantize(&m, &self.signed)?;
                        *exp_avg_sq = QuantizedState::quantize(&v, &self.unsigned)?;
                    }
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
                match &s.moments {
                    Moments::Full {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        st.tensors
                            .insert(slot_key(gi, pi, "exp_avg"), exp_avg.f_detach_copy()?);
                        st.tensors
                            .insert(slot_key(gi, pi, "exp_avg_sq"), exp_avg_sq.f_detach_copy()?);
                    }
                    Moments::Quant {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        st.tensors.insert(
                            slot_key(gi, pi, "exp_avg.codes"),
                            exp_avg.codes.f_detach_copy()?,
                        );
                        st.tensors.insert(
                            slot_key(gi, pi, "exp_avg.absmax"),
                            exp_avg.absmax.f_detach_copy()?,
                        );
                        st.tensors.insert(
                            slot_key(gi, pi, "exp_avg_sq.codes"),
                            exp_avg_sq.codes.f_detach_copy()?,
                        );
                        st.tensors.insert(
                            slot_key(gi, pi, "exp_avg_sq.absmax"),
                            exp_avg_sq.absmax.f_detach_copy()?,
                        );
                    }
                }
                per_param_steps.push(s.step);
            }
        }
        st.meta = serde_json::json!({
            "optimizer": self.name(),
            "steps": self.steps,
            "lr": self.lr,
            "param_steps": per_param_steps,
            "block": Self::BLOCK,
            "config": self.cfg,
        });
        Ok(st)
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        check_meta_name(&state.meta, self.name())?;
        let block = state
            .meta
            .get("block")
            .and_then(|v| v.as_i64())
            .unwrap_or(0);
        if block != Self::BLOCK {
            return Err(TrainError::State {
                what: "AdamW8bit state".into(),
                message: format!("block size {block} in the checkpoint, {} here", Self::BLOCK),
            });
        }
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
                match &mut s.moments {
                    Moments::Full {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        for (slot, t) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
                            let key = slot_key(gi, pi, slot);
                            load_slot(t, state.tensor(&key, "AdamW8bit")?, &key)?;
                        }
                    }
                    Moments::Quant {
                        exp_avg,
                        exp_avg_sq,
                    } => {
                        for (slot, q) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
                            let key = slot_key(gi, pi, &format!("{slot}.codes"));
                            load_slot(&mut q.codes, state.tensor(&key, "AdamW8bit")?, &key)?;
                            let key = slot_key(gi, pi, &format!("{slot}.absmax"));
                            load_slot(&mut q.absmax, state.tensor(&key, "AdamW8bit")?, &key)?;
                        }
                    }
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
            .map(|s| match &s.moments {
                Moments::Full {
                    exp_avg,
                    exp_avg_sq,
                } => tensor_bytes(exp_avg) + tensor_bytes(exp_avg_sq),
                Moments::Quant {
                    exp_avg,
                    exp_avg_sq,
                } => exp_avg.bytes() + exp_avg_sq.bytes(),
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
        "AdamW8bit"
    }
}
