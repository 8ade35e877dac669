//! A tiny LoRA task for the engine tests: a frozen 2-layer MLP with trainable low-rank
//! adapters (lora_A, lora_B) on both layers and input dropout, regressing a fixed target; and a
//! shuffling, resumable in-memory loader.
#![allow(dead_code)]

use std::cell::Cell;

pub use crate::serial;

use lora_train::engine::{BatchSource, Result, TrainStep};
use tch::{Device, Kind, Tensor};

pub const IN: i64 = 8;
pub const HIDDEN: i64 = 32;
pub const OUT: i64 = 4;
pub const RANK: i64 = 4;

pub struct ToyLora {
    w1: Tensor,
    w2: Tensor,
    pub a1: Tensor,
    pub b1: Tensor,
    pub a2: Tensor,
    pub b2: Tensor,
    pub dropout: f64,
    /// Bytes of scratch memory to allocate per sample in `loss` (simulated activations).
    pub scratch_bytes_per_sample: i64,
    /// Allocate the scratch with `f_full` (an op taking a `Scalar`, whose failures tch reports
    /// as panics) instead of `f_zeros`.
    pub scratch_with_scalar_op: bool,
    /// Make the loss NaN on this call of `loss` (1-based).
    pub nan_on_call: Option<u64>,
    pub calls: Cell<u64>,
}

fn det(shape: &[i64], salt: f64, scale: f64) -> Tensor {
    // Deterministic values without touching the global RNG.
    let n: i64 = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f64 * 0.618 + salt).sin() * scale) as f32)
        .collect();
    Tensor::from_slice(&v).reshape(shape)
}

impl ToyLora {
    pub fn new() -> Self {
        Self {
            w1: det(&[HIDDEN, IN], 0.1, 0.5),
            w2: det(&[OUT, HIDDEN], 0.7, 0.3),
            a1: det(&[RANK, IN], 1.3, 0.2).set_requires_grad(true),
            b1: Tensor::zeros([HIDDEN, RANK], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            a2: det(&[RANK, HIDDEN], 2.9, 0.2).set_requires_grad(true),
            b2: Tensor::zeros([OUT, RANK], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            dropout: 0.1,
            scratch_bytes_per_sample: 0,
            scratch_with_scalar_op: false,
            nan_on_call: None,
            calls: Cell::new(0),
        }
    }

    pub fn trainable_bits(&self) -> Vec<Vec<f32>> {
        self.named_trainable()
            .into_iter()
            .map(|(_, t)| Vec::<f32>::try_from(t.detach().flatten(0, -1)).unwrap())
            .collect()
    }
}

pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
}

impl TrainStep for ToyLora {
    type Batch = Batch;

    fn loss(&mut self, batch: &Batch, train: bool) -> Result<Tensor> {
        self.calls.set(self.calls.get() + 1);
        let n = batch.x.size()[0];
        let _scratch = if self.scratch_bytes_per_sample > 0 {
            let shape = [n * self.scratch_bytes_per_sample];
            Some(if self.scratch_with_scalar_op {
                Tensor::f_full(shape, 1, (Kind::Uint8, Device::Cpu))?
            } else {
                Tensor::f_zeros(shape, (Kind::Uint8, Device::Cpu))?
            })
        } else {
            None
        };
        let x = batch.x.f_dropout(self.dropout, train)?;
        let h = x.f_matmul(&self.w1.f_tr()?)?.f_add(
            &x.f_matmul(&self.a1.f_tr()?)?
                .f_matmul(&self.b1.f_tr()?)?
                .f_mul_scalar(2.0)?,
        )?;
        let h = h.f_relu()?;
        let y = h.f_matmul(&self.w2.f_tr()?)?.f_add(
            &h.f_matmul(&self.a2.f_tr()?)?
                .f_matmul(&self.b2.f_tr()?)?
                .f_mul_scalar(2.0)?,
        )?;
        let mut loss = y.f_sub(&batch.y)?.f_square()?.f_mean(Kind::Float)?;
        if self.nan_on_call == Some(self.calls.get()) {
            loss = loss.f_mul_scalar(f64::NAN)?;
        }
        Ok(loss)
    }

    fn named_trainable(&self) -> Vec<(String, Tensor)> {
        vec![
            ("fc1.lora_A.weight".into(), self.a1.shallow_clone()),
            ("fc1.lora_B.weight".into(), self.b1.shallow_clone()),
            ("fc2.lora_A.weight".into(), self.a2.shallow_clone()),
            ("fc2.lora_B.weight".into(), self.b2.shallow_clone()),
        ]
    }

    fn micro_batch_len(&self, batch: &Batch) -> usize {
        batch.x.size()[0] as usize
    }

    fn split_batch(&self, batch: &Batch, parts: usize) -> Result<Vec<Batch>> {
        let n = batch.x.size()[0];
        let parts = parts as i64;
        let mut out = Vec::new();
        let mut start = 0;
        for i in 0..parts {
            let len = (n - start) / (parts - i);
            out.push(Batch {
                x: batch.x.f_narrow(0, start, len)?,
                y: batch.y.f_narrow(0, start, len)?,
            });
            start += len;
        }
        Ok(out)
    }

    fn batch_tokens(&self, batch: &Batch) -> u64 {
        batch.x.size()[0] as u64 * IN as u64
    }
}

/// `n` samples, shuffled per epoch with a seed-derived permutation; position = (epoch, cursor).
pub struct ToyData {
    x: Tensor,
    y: Tensor,
    pub batch_size: i64,
    seed: u64,
    epoch: u64,
    order: Vec<i64>,
    cursor: usize,
}

fn permutation(n: usize, seed: u64) -> Vec<i64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut v: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

impl ToyData {
    pub fn new(n: i64, batch_size: i64, seed: u64) -> Self {
        // Targets from a teacher: the frozen MLP with fixed weight deltas, so the adapters can
        // learn (part of) them.
        let x = det(&[n, IN], 5.0, 1.0);
        let w1 = det(&[HIDDEN, IN], 0.1, 0.5) + det(&[HIDDEN, IN], 4.4, 0.3);
        let w2 = det(&[OUT, HIDDEN], 0.7, 0.3) + det(&[OUT, HIDDEN], 6.6, 0.3);
        let y = x.matmul(&w1.tr()).relu().matmul(&w2.tr());
        Self {
            x,
            y,
            batch_size,
            seed,
            epoch: 0,
            order: permutation(n as usize, seed),
            cursor: 0,
        }
    }
}

impl BatchSource<Batch> for ToyData {
    fn start_epoch(&mut self, epoch: u64) -> Result<()> {
        self.epoch = epoch;
        self.order = permutation(self.order.len(), self.seed + epoch);
        self.cursor = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> Result<Option<Batch>> {
        if self.cursor >= self.order.len() {
            return Ok(None);
        }
        let end = (self.cursor + self.batch_size as usize).min(self.order.len());
        let idx = Tensor::from_slice(&self.order[self.cursor..end]);
        self.cursor = end;
        Ok(Some(Batch {
            x: self.x.f_index_select(0, &idx)?,
            y: self.y.f_index_select(0, &idx)?,
        }))
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some((self.order.len() as u64).div_ceil(self.batch_size as u64))
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "cursor": self.cursor})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        let epoch = state["epoch"].as_u64().unwrap_or(0);
        self.start_epoch(epoch)?;
        self.cursor = state["cursor"].as_u64().unwrap_or(0) as usize;
        Ok(())
    }
}
