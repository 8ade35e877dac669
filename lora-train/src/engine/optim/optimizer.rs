//! The [`Optimizer`] trait, parameter groups, optimizer state and the helpers every optimizer
//! of this folder shares.

use std::collections::BTreeMap;

use tch::{Kind, Tensor};

use crate::engine::error::{Result, TrainError};

/// What the factory ([`super::OptimizerKind`], [`super::OptimizerName`]) needs of an optimizer,
/// written in the optimizer's own file: its hyper-parameters, the ones each of its names gives
/// with a config's arguments on top, the other spellings of its names, and the planner's state
/// term. Registering the optimizer is then one entry of the factory's table.
pub trait Registered: Optimizer + Sized + 'static {
    /// The hyper-parameters (serde: the fields of `{"type": <name>, ...}`).
    type Config: Clone
        + PartialEq
        + std::fmt::Debug
        + serde::Serialize
        + serde::de::DeserializeOwned;

    /// Other spellings of this optimizer's names, as `(spelling, canonical name)`: the names
    /// kohya, transformers (`optim`) and bitsandbytes configs use.
    const ALIASES: &'static [(&'static str, &'static str)] = &[];

    /// Builds the optimizer over `groups` with base learning rate `lr`.
    ///
    /// # Errors
    /// Invalid hyper-parameters or a libtorch error.
    fn build(groups: Vec<ParamGroup>, lr: f64, config: Self::Config) -> Result<Self>;

    /// The hyper-parameters that the canonical name `name` (one of this optimizer's entry in the
    /// factory) gives, with `args` applied.
    fn config(name: &str, args: &super::OptimizerArgs) -> Self::Config;

    /// The planner's optimizer-state term for `config` ([`lora_memory::Optimizer`]).
    fn memory_term(config: &Self::Config) -> lora_memory::Optimizer;
}

/// A set of parameters sharing hyper-parameters.
#[derive(Debug)]
pub struct ParamGroup {
    /// A name for logs and state keys (e.g. `"lora_A"`, `"lora_B"`).
    pub name: String,
    /// The trainable tensors (leaf tensors with `requires_grad`), any shape, fp32 by default.
    pub params: Vec<Tensor>,
    /// This group's learning rate is `base_lr · lr_scale` (1.0 normally; the LoRA+ ratio for `lora_B`).
    pub lr_scale: f64,
    /// Overrides the optimizer's weight decay for this group (`None` = the optimizer's).
    pub weight_decay: Option<f64>,
}

impl ParamGroup {
    /// A group with `lr_scale` 1 and the optimizer's weight decay.
    pub fn new(name: impl Into<String>, params: Vec<Tensor>) -> Self {
        Self {
            name: name.into(),
            params,
            lr_scale: 1.0,
            weight_decay: None,
        }
    }

    /// Sets the learning-rate multiplier (LoRA+ ratio).
    pub fn with_lr_scale(mut self, lr_scale: f64) -> Self {
        self.lr_scale = lr_scale;
        self
    }

    /// Sets this group's weight decay.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Self {
        self.weight_decay = Some(weight_decay);
        self
    }
}

/// The parameter groups of named adapter tensors: [`lora_plus_groups`] with a LoRA+ ratio,
/// else one group `"adapters"` at the base learning rate.
pub fn adapter_groups(
    named: Vec<(String, Tensor)>,
    loraplus_ratio: Option<f64>,
) -> Vec<ParamGroup> {
    match loraplus_ratio {
        Some(r) => lora_plus_groups(named, r),
        None => vec![ParamGroup::new(
            "adapters",
            named.into_iter().map(|(_, t)| t).collect(),
        )],
    }
}

/// Splits named adapter tensors into two groups for LoRA+ (Hayou et al., arXiv:2402.12354):
/// names containing `lora_B` or `lora_up` go to a group with `lr_scale = ratio`, all others to a
/// group with `lr_scale = 1`. Empty groups are dropped.
pub fn lora_plus_groups(named: Vec<(String, Tensor)>, ratio: f64) -> Vec<ParamGroup> {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for (name, t) in named {
        if name.contains("lora_B") || name.contains("lora_up") {
            b.push(t);
        } else {
            a.push(t);
        }
    }
    let mut groups = Vec::new();
    if !a.is_empty() {
        groups.push(ParamGroup::new("lora_A", a));
    }
    if !b.is_empty() {
        groups.push(ParamGroup::new("lora_B", b).with_lr_scale(ratio));
    }
    groups
}

/// The serializable state of an optimizer: named tensors (moments, quantized blocks, step
/// counters) and a JSON document (hyper-parameters, counters). Keys are stable across runs with
/// the same parameter groups (`g{group}.p{index}.{slot}`).
#[derive(Debug, Default)]
pub struct OptimizerState {
    /// State tensors by key, saved to safetensors.
    pub tensors: BTreeMap<String, Tensor>,
    /// Scalars and hyper-parameters, saved as JSON.
    pub meta: serde_json::Value,
}

impl OptimizerState {
    /// A tensor by key, or an error naming the key and the optimizer.
    pub fn tensor(&self, key: &str, optimizer: &str) -> Result<&Tensor> {
        self.tensors.get(key).ok_or_else(|| TrainError::State {
            what: format!("{optimizer} state"),
            message: format!(
                "missing tensor `{key}` (the checkpoint was written for other parameter groups or another optimizer)"
            ),
        })
    }

    /// Total bytes of the state tensors.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(tensor_bytes).sum()
    }
}

pub use lora_core::sys::tensor_bytes;

/// An optimizer over [`ParamGroup`]s.
pub trait Optimizer {
    /// Applies one update from the parameters' `.grad` (parameters without a gradient are skipped).
    ///
    /// # Errors
    /// A libtorch error (e.g. out of memory).
    fn step(&mut self) -> Result<()>;
    /// Drops every parameter's gradient (`.grad` becomes undefined, as PyTorch's
    /// `zero_grad(set_to_none=True)`).
    ///
    /// # Errors
    /// A libtorch error.
    fn zero_grad(&mut self) -> Result<()>;
    /// Sets the base learning rate; group `g` uses `lr · g.lr_scale`.
    fn set_lr(&mut self, lr: f64);
    /// The base learning rate.
    fn lr(&self) -> f64;
    /// The number of `step` calls applied so far.
    fn steps(&self) -> u64;
    /// Copies of the state (tensors deep-copied).
    ///
    /// # Errors
    /// A libtorch error.
    fn state_dict(&self) -> Result<OptimizerState>;
    /// Restores a state written by `state_dict` of the same optimizer over the same groups.
    ///
    /// # Errors
    /// Missing keys, wrong shapes or another optimizer's state.
    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()>;
    /// Bytes of optimizer state held now (moments, quantized blocks and their scales).
    fn state_bytes(&self) -> u64;
    /// The parameters, group by group (shallow clones sharing storage).
    fn params(&self) -> Vec<Tensor>;
    /// The optimizer's name as in configs (`"AdamW"`, `"AdamW8bit"`, `"Adafactor"`, `"SGD"`).
    fn name(&self) -> &'static str;
}

pub(crate) fn check_lr(lr: f64) -> Result<()> {
    if !(lr.is_finite() && lr >= 0.0) {
        return Err(TrainError::Invalid {
            what: "learning rate".into(),
            value: lr.to_string(),
            hint: "use a finite value >= 0 (typical LoRA: 1e-4 .. 1e-3)".into(),
        });
    }
    Ok(())
}

/// The gradient of `p` as fp32, or `None` when it has none.
pub(crate) fn grad_f32(p: &Tensor) -> Result<Option<Tensor>> {
    let g = p.f_grad()?;
    if !g.defined() {
        return Ok(None);
    }
    Ok(Some(if g.kind() == Kind::Float {
        g
    } else {
        g.f_to_kind(Kind::Float)?
    }))
}

/// Drops the gradient of every parameter (`.grad` becomes undefined), like PyTorch's
/// `zero_grad(set_to_none=True)`: the next backward writes fresh gradients instead of adding into
/// zeroed ones, and no gradient memory is held between steps.
pub(crate) fn zero_grads(params: &[Tensor]) -> Result<()> {
    for p in params {
        let mut p = p.shallow_clone();
        lora_core::sys::set_grad_undefined(&mut p)?;
    }
    Ok(())
}

/// While alive, libtorch runs on one intra-op thread, when the parameters are on the CPU (on a
/// GPU it does nothing); the previous count comes back on drop.
///
/// An optimizer step over adapter tensors is thousands of small element-wise ops. With two or
/// more threads, each op can wait for libtorch's OpenMP workers, which costs more than the work
/// whenever the machine is busy: measured with `torch.optim.AdamW` over the 420 LoRA tensors of
/// SmolLM2-135M (r8, 7 targets) on a 2-core machine under a parallel build, median step 74–118 ms
/// with 2 threads (worst 0.6–1.8 s) vs 18–36 ms (worst 40–45 ms) on one thread.
pub(crate) struct CpuStepThreads {
    previous: Option<usize>,
}

impl CpuStepThreads {
    /// Switches to one thread if the first parameter lives on the CPU.
    pub(crate) fn for_params(params: &[Tensor]) -> Self {
        let on_cpu = params
            .first()
            .is_some_and(|p| p.device() == tch::Device::Cpu);
        let previous =
            (on_cpu && tch::get_num_threads() > 1).then(|| lora_core::sys::set_num_threads(1));
        Self { previous }
    }
}

impl Drop for CpuStepThreads {
    fn drop(&mut self) {
        if let Some(n) = self.previous {
            lora_core::sys::set_num_threads(n);
        }
    }
}

/// Writes `new` (fp32) into parameter `p` in place, converting to `p`'s dtype.
pub(crate) fn write_param(p: &Tensor, new: &Tensor) -> Result<()> {
    let mut dst = p.shallow_clone();
    if p.kind() == new.kind() {
        dst.f_copy_(new)?;
    } else {
        dst.f_copy_(&new.f_to_kind(p.kind())?)?;
    }
    Ok(())
}

/// fp32 working copy of a parameter (a fresh tensor, never aliasing `p`).
pub(crate) fn param_f32(p: &Tensor) -> Result<Tensor> {
    Ok(p.f_detach()?.f_to_kind(Kind::Float)?.f_detach_copy()?)
}

/// Key of a per-parameter state slot.
pub(crate) fn slot_key(group: usize, index: usize, slot: &str) -> String {
    format!("g{group}.p{index}.{slot}")
}

/// Copies `src` into the state tensor `dst` after checking shapes.
pub(crate) fn load_slot(dst: &mut Tensor, src: &Tensor, key: &str) -> Result<()> {
    if dst.size() != src.size() {
        return Err(TrainError::State {
            what: "optimizer state".into(),
            message: format!(
                "tensor `{key}` has shape {:?} in the checkpoint but {:?} here",
                src.size(),
                dst.size()
            ),
        });
    }
    let src = src.f_to_device(dst.device())?.f_to_kind(dst.kind())?;
    dst.f_copy_(&src)?;
    Ok(())
}

/// Reads a `u64` counter from optimizer meta.
pub(crate) fn meta_u64(meta: &serde_json::Value, key: &str, optimizer: &str) -> Result<u64> {
    meta.get(key)
        .and_then(|v| v.as_u64())
        .ok_or_else(|| TrainError::State {
            what: format!("{optimizer} state"),
            message: format!("missing counter `{key}` in the optimizer meta"),
        })
}

/// Checks that the state was written by optimizer `name`.
pub(crate) fn check_meta_name(meta: &serde_json::Value, name: &str) -> Result<()> {
    let got = meta.get("optimizer").and_then(|v| v.as_str()).unwrap_or("");
    if got != name {
        return Err(TrainError::State {
            what: format!("{name} state"),
            message: format!(
                "the state was written by optimizer `{got}`; resume with the same optimizer_type"
            ),
        });
    }
    Ok(())
}
