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

use super::adamw::AdamWConfig;
use super::adamw::adamw_update;
use super::optimizer::Optimizer;
use super::optimizer::{
    OptimizerState, ParamGroup, check_lr, check_meta_name, grad_f32, load_slot, meta_u64, slot_key,
    tensor_bytes, zero_grads,
};
use crate::engine::error::{Result, TrainError};

/// A 256-entry quantization code (sorted ascending), its 255 decision midpoints, and a table that
/// finds the nearest code of a value without a search.
///
/// [`DynamicMap::index`] gives the same codes as a binary search over `mids` (`torch.bucketize`
/// with `right=False`, which [`DynamicMap::index_by_search`] runs): the number of midpoints strictly
/// below the value, so a value exactly on a midpoint takes the lower code, and NaN takes code 255.
/// It reads the value's top 16 bits (sign, exponent and 7 mantissa bits) as an index into a
/// 65,536-entry table holding the number of midpoints below every float with those bits; no two
/// midpoints of either dynamic code share those bits (the densest codes are 0.007 apart near 1,
/// the bits 0.004), so one comparison with the next midpoint finishes the count. A handful of
/// elementwise ops instead of an 8-step search per element, on any device.
#[derive(Debug)]
pub struct DynamicMap {
    /// Code values, `[256]` fp32, sorted ascending, in `[-1, 1]` (signed) or `[0, 1]` (unsigned).
    pub code: Tensor,
    /// Midpoints between consecutive code values, `[255]` fp32 (nearest-value rounding).
    pub mids: Tensor,
    /// `[65536]` int32: for each value of an f32's top 16 bits, the number of midpoints below the
    /// smallest float with those bits.
    below: Tensor,
    /// `[256]` fp32: `mids` followed by `+inf` (the next midpoint after `below[·]` of them).
    next_mid: Tensor,
}

/// Low bits of an f32 dropped to index [`DynamicMap`]'s table (16 kept: 65,536 entries).
const TABLE_SHIFT: u32 = 16;

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

    /// The decision midpoints of `values(signed)`: `(v[i] + v[i + 1]) / 2` in f32, `[255]`.
    pub fn midpoints(signed: bool) -> Vec<f32> {
        Self::values(signed)
            .windows(2)
            .map(|w| (w[0] + w[1]) / 2.0)
            .collect()
    }

    /// The index table of [`DynamicMap`]: for each top-16-bit pattern `t`, the number of `mids`
    /// strictly below the smallest float whose bits start with `t` (255 where that float is NaN;
    /// [`DynamicMap::index`] never looks those up).
    pub fn below_table(mids: &[f32]) -> Vec<i32> {
        (0u32..1 << (32 - TABLE_SHIFT))
            .map(|t| {
                let low = (1u32 << TABLE_SHIFT) - 1;
                // Positive patterns grow with the low bits, negative ones shrink.
                let bits = if t >> (31 - TABLE_SHIFT) == 0 {
                    t << TABLE_SHIFT
                } else {
                    (t << TABLE_SHIFT) | low
                };
                let smallest = f32::from_bits(bits);
                if smallest.is_nan() {
                    mids.len() as i32
                } else {
                    mids.partition_point(|m| *m < smallest) as i32
                }
            })
            .collect()
    }

    /// The map on `device`.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn new(signed: bool, device: Device) -> Result<Self> {
        let v = Self::values(signed);
        let mids = Self::midpoints(signed);
        let below = Self::below_table(&mids);
        let mut next_mid = mids.clone();
        next_mid.push(f32::INFINITY);
        Ok(Self {
            code: Tensor::from_slice(&v).f_to_device(device)?,
            mids: Tensor::from_slice(&mids).f_to_device(device)?,
            below: Tensor::from_slice(&below).f_to_device(device)?,
            next_mid: Tensor::from_slice(&next_mid).f_to_device(device)?,
        })
    }

    /// The index of the nearest code of each element of `x` (any shape, fp32), as u8 of `x`'s
    /// shape: the number of midpoints strictly below the value (a value exactly on a midpoint takes
    /// the lower code; NaN takes 255, `+inf` 255, `-inf` 0) — the same as
    /// [`DynamicMap::index_by_search`], by table lookup (see the type's docs).
    ///
    /// # Errors
    /// A libtorch error.
    pub fn index(&self, x: &Tensor) -> Result<Tensor> {
        let finite = x
            .f_to_kind(Kind::Float)?
            .f_nan_to_num(Some(2.0), None, None)?;
        self.lookup(finite)
    }

    /// [`DynamicMap::index`] on an fp32 tensor it may overwrite.
    fn index_owned(&self, mut x: Tensor) -> Result<Tensor> {
        let _ = x.f_nan_to_num_(Some(2.0), None, None)?;
        self.lookup(x)
    }

    /// The table lookup over fp32 `x` without NaN. NaN was replaced by 2 (above every midpoint:
    /// code 255, where the binary search puts NaN) and ±inf by ±f32::MAX (same codes), so every
    /// pattern looked up is a finite float's.
    fn lookup(&self, x: Tensor) -> Result<Tensor> {
        let shape = x.size();
        let x = x.f_reshape([-1])?.f_contiguous()?;
        let top = x
            .f_view_dtype(Kind::Int)?
            .f_bitwise_right_shift_tensor_scalar(TABLE_SHIFT as i64)?
            .f_bitwise_and_((1i64 << (32 - TABLE_SHIFT)) - 1)?;
        let mut below = self.below.f_index_select(0, &top)?;
        let next = self.next_mid.f_index_select(0, &below)?;
        let _ = below.f_add_(&x.f_gt_tensor(&next)?)?;
        Ok(below.f_to_kind(Kind::Uint8)?.f_reshape(shape.as_slice())?)
    }

    /// The index of the nearest code by binary search over `mids` (`bucketize`, `right=false`):
    /// the reference [`DynamicMap::index`] equals, u8 of `x`'s shape.
    ///
    /// # Errors
    /// A libtorch error.
    pub fn index_by_search(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.f_to_kind(Kind::Float)?
            .f_bucketize(&self.mids, false, false)?
            .f_to_kind(Kind::Uint8)?)
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
        let codes = map.index_owned(normed)?.f_reshape([-1])?;
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
            .f_index_select(0, &self.codes.f_to_kind(Kind::Int)?)?;
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
        let _threads = super::optimizer::CpuStepThreads::for_params(&self.params());
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

impl super::Registered for AdamW8bit {
    type Config = AdamWConfig;
    const ALIASES: &'static [(&'static str, &'static str)] = &[
        ("adamw_8bit", "AdamW8bit"),
        ("adam8bit", "AdamW8bit"),
        ("adamw_bnb_8bit", "AdamW8bit"),
        ("PagedAdamW8bit", "AdamW8bit"),
        ("bitsandbytes.optim.AdamW8bit", "AdamW8bit"),
    ];

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
        lora_memory::Optimizer::AdamW8bit
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn both_maps() -> [(bool, DynamicMap); 2] {
        [true, false].map(|s| (s, DynamicMap::new(s, Device::Cpu).unwrap()))
    }

    /// `x` through the table and through the binary search, as u8 vectors.
    fn both_ways(map: &DynamicMap, x: &[f32]) -> (Vec<u8>, Vec<u8>) {
        let t = Tensor::from_slice(x);
        let fast = Vec::<u8>::try_from(map.index(&t).unwrap()).unwrap();
        let reference = Vec::<u8>::try_from(map.index_by_search(&t).unwrap()).unwrap();
        (fast, reference)
    }

    fn assert_same_codes(map: &DynamicMap, x: &[f32], what: &str) {
        let (fast, reference) = both_ways(map, x);
        for (i, (a, b)) in fast.iter().zip(&reference).enumerate() {
            assert_eq!(
                a,
                b,
                "{what}: x = {:e} (bits {:#010x}): table {a}, search {b}",
                x[i],
                x[i].to_bits()
            );
        }
        assert_eq!(fast.len(), x.len());
    }

    #[test]
    fn no_two_midpoints_share_a_table_entry() {
        for signed in [true, false] {
            let mids = DynamicMap::midpoints(signed);
            assert_eq!(mids.len(), 255);
            let tops: Vec<u32> = mids.iter().map(|m| m.to_bits() >> TABLE_SHIFT).collect();
            let mut dedup = tops.clone();
            dedup.sort_unstable();
            dedup.dedup();
            assert_eq!(dedup.len(), 255, "signed {signed}");
            // The table counts midpoints: 0 at the most negative floats, 255 at the largest.
            let below = DynamicMap::below_table(&mids);
            assert_eq!(below[0x7f7f], 255);
            assert_eq!(below[0xff7f], 0);
            // ±0 and the tiny floats next to them: 127 midpoints below (signed), none (unsigned).
            assert_eq!(below[0], if signed { 127 } else { 0 });
            assert_eq!(below[0x8000], if signed { 127 } else { 0 });
        }
    }

    #[test]
    fn table_index_equals_binary_search_on_midpoints_codes_and_edges() {
        for (signed, map) in both_maps() {
            let mids = DynamicMap::midpoints(signed);
            let mut x = Vec::new();
            for m in mids.iter().chain(&DynamicMap::values(signed)) {
                // Exactly on a midpoint (ties go to the lower code), and one ulp either side.
                x.push(*m);
                x.push(m.next_up());
                x.push(m.next_down());
                x.push(-*m);
            }
            x.extend([
                0.0,
                -0.0,
                1.0,
                -1.0,
                f32::MAX,
                -f32::MAX,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MIN_POSITIVE,
                -f32::MIN_POSITIVE,
                f32::from_bits(1),
                f32::from_bits(0x8000_0001),
                f32::from_bits(0x0000_ffff),
                f32::from_bits(0x8000_ffff),
                1e-40,
                -1e-40,
                1e-7,
                -1e-7,
                f32::NAN,
                -f32::NAN,
                // Signalling NaNs with payloads next to the infinities' table entries.
                f32::from_bits(0x7f80_0001),
                f32::from_bits(0xff80_0001),
                f32::from_bits(0xff80_ffff),
                f32::from_bits(0xffff_ffff),
            ]);
            assert_same_codes(&map, &x, &format!("signed {signed}"));
            let (fast, _) = both_ways(&map, &[f32::NAN, -f32::NAN, f32::NEG_INFINITY, 1.0]);
            assert_eq!(fast, [255, 255, 0, 255]);
            // A midpoint itself takes the lower code, one ulp above it the upper one.
            let (fast, _) = both_ways(&map, &[mids[200], mids[200].next_up()]);
            assert_eq!(fast, [200, 201]);
        }
    }

    #[test]
    fn table_index_equals_binary_search_over_bit_patterns() {
        // Every 4099th f32 bit pattern (all signs, exponents, NaNs) plus 1M random ones.
        let mut x: Vec<f32> = (0..=u32::MAX / 4099)
            .map(|i| f32::from_bits(i * 4099))
            .collect();
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..1_000_000 {
            // splitmix64
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            x.push(f32::from_bits((z ^ (z >> 31)) as u32));
        }
        for (signed, map) in both_maps() {
            assert_same_codes(&map, &x, &format!("signed {signed}"));
        }
    }

    #[test]
    fn table_index_equals_binary_search_on_normalized_moments() {
        tch::manual_seed(5);
        for (signed, map) in both_maps() {
            // Adam-like moments: values across many decades, normalized by the block absmax.
            let m = Tensor::randn([64, 2048], (Kind::Float, Device::Cpu))
                * Tensor::randn([64, 1], (Kind::Float, Device::Cpu)).exp_()
                * 1e-3;
            let m = if signed { m } else { m.square() };
            let normed = &m / m.abs().amax([1i64].as_slice(), true);
            let x = Vec::<f32>::try_from(normed.reshape([-1])).unwrap();
            assert_same_codes(&map, &x, &format!("signed {signed}"));
        }
    }

    #[test]
    fn quantize_keeps_the_codes_of_the_search_with_inf_and_nan_blocks() {
        let map = DynamicMap::new(true, Device::Cpu).unwrap();
        tch::manual_seed(6);
        let x = Tensor::randn([3 * 2048 + 5], (Kind::Float, Device::Cpu));
        let _ = x.narrow(0, 10, 1).fill_(f64::INFINITY);
        let _ = x.narrow(0, 2048 + 7, 1).fill_(f64::NAN);
        let q = QuantizedState::quantize(&x, &map).unwrap();
        let codes = Vec::<u8>::try_from(&q.codes).unwrap();
        // Block 0: the inf element is NaN after dividing by its absmax (255), the others 0/±0 → 127.
        assert_eq!(codes[10], 255);
        assert!(
            codes[..2048]
                .iter()
                .enumerate()
                .all(|(i, c)| i == 10 || *c == 127)
        );
        // Block 1: NaN absmax: every element NaN → 255.
        assert!(codes[2048..4096].iter().all(|c| *c == 255));
        // Blocks 2 and 3 (5 values, then zero padding): the search's codes, block by block.
        let tail = Tensor::cat(
            &[
                x.narrow(0, 4096, 2053),
                Tensor::zeros([2043], (Kind::Float, Device::Cpu)),
            ],
            0,
        )
        .view([2, 2048]);
        let normed = &tail / tail.abs().amax([1i64].as_slice(), true);
        let reference =
            Vec::<u8>::try_from(map.index_by_search(&normed).unwrap().reshape([-1])).unwrap();
        assert!(
            codes[4096..] == reference[..],
            "blocks 2-3 differ from the search"
        );
    }
}
