//! Checkpoints that survive a crash at any instant, and exact resume.
//!
//! A checkpoint is a folder `step-XXXXXXXX/` under the run's checkpoint folder holding
//! - `adapter.safetensors` — the trainable adapter tensors by name, bit-exact;
//! - `optimizer.safetensors` — the optimizer's state tensors;
//! - `state.json` — step, epoch, optimizer meta, scheduler, RNG state (hex), loader position
//!   and run config (both opaque JSON), loss scaler and trainer counters.
//!
//! Writing is atomic: everything goes to a hidden temporary folder, each file is fsync'ed, the
//! folder is fsync'ed, renamed to its final name, and the parent folder is fsync'ed. A crash leaves
//! either the complete checkpoint or a temporary folder that is ignored (and removed by the next
//! save). Only the last `keep_last` checkpoints are kept. A checkpoint whose adapter or optimizer
//! state holds NaN/Inf is never written.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

use crate::engine::error::{Result, TrainError};
use crate::engine::optim::OptimizerState;
use crate::engine::precision::ScalerState;
use crate::engine::sched::Scheduler;

const ADAPTER_FILE: &str = "adapter.safetensors";
const OPTIMIZER_FILE: &str = "optimizer.safetensors";
const STATE_FILE: &str = "state.json";
const FORMAT_VERSION: u32 = 1;

/// Counters of the training loop that a resume must restore.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainerCounters {
    /// Optimizer steps applied (including skipped ones, which still advance the schedule).
    pub step: u64,
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Loader batches consumed in the current epoch.
    pub batches_in_epoch: u64,
    /// Samples seen in total.
    pub samples: u64,
    /// Tokens seen in total (as reported by the [`crate::engine::trainer::TrainStep`]).
    pub tokens: u64,
    /// Each loader batch is split into this many micro-batches (OOM back-off; 1 normally).
    pub micro_batch_split: usize,
    /// Multiplier applied to the scheduled learning rate (lowered by the NaN policy).
    pub lr_factor: f64,
    /// Steps skipped because of non-finite loss / gradients.
    pub skipped_steps: u64,
    /// Times the micro-batch was halved after an out-of-memory error.
    pub oom_backoffs: u64,
    /// Data-parallel ranks of the run that wrote the checkpoint (0 in checkpoints written
    /// before this was recorded: one process). `batches_in_epoch` counts one rank's batches;
    /// a resume on another world size maps it through this (see [`TrainerCounters::remap_world_size`]).
    #[serde(default)]
    pub world_size: u64,
    /// Loader batches per optimizer step over all ranks, `gradient_accumulation_steps ×
    /// world_size` (0 when not recorded): the global batch, in micro-batches, that a resume
    /// on another world size must keep.
    #[serde(default)]
    pub global_batches_per_step: u64,
}

impl TrainerCounters {
    /// Maps counters written by `self.world_size` ranks onto `world_size` ranks taking
    /// `gradient_accumulation_steps` batches each per step: the epoch's position, counted in
    /// one rank's batches, becomes the same position of the epoch's whole plan in the new
    /// ranks' batches (a data-parallel rank `r` of `n` takes batches `r, r + n, …` of the
    /// plan, `LoaderConfig::num_replicas`). Counters of the same world size are unchanged.
    ///
    /// # Errors
    /// [`TrainError::State`] when the global batch changes (the step would mean another
    /// batch: the error says which `gradient_accumulation_steps` keeps it) or the position
    /// does not split evenly over the new ranks.
    pub fn remap_world_size(
        &mut self,
        world_size: usize,
        gradient_accumulation_steps: usize,
    ) -> Result<()> {
        let old = self.world_size.max(1);
        let new = world_size.max(1) as u64;
        let per_step = gradient_accumulation_steps.max(1) as u64 * new;
        let bad = |message: String| TrainError::State {
            what: "checkpoint (data-parallel world size)".into(),
            message,
        };
        if old != new {
            // not recorded (a checkpoint from before this was): taken to be kept
            let saved = match self.global_batches_per_step {
                0 => per_step,
                n => n,
            };
            if saved != per_step {
                let hint = if saved % new == 0 {
                    format!(
                        "set gradient_accumulation_steps: {} so {new} ranks take the same {saved} \
                         micro-batches per step",
                        saved / new
                    )
                } else {
                    format!(
                        "{saved} micro-batches do not split over {new} ranks: use a world size that divides {saved}"
                    )
                };
                return Err(bad(format!(
                    "the checkpoint's steps took {saved} micro-batches over {old} rank(s); {new} \
                     rank(s) × gradient_accumulation_steps {gradient_accumulation_steps} take \
                     {per_step}: {hint}"
                )));
            }
            let global = self.batches_in_epoch * old;
            if global % new != 0 {
                return Err(bad(format!(
                    "the checkpoint stands after {global} batches of epoch {}, which do not split \
                     over {new} ranks: resume on {old} rank(s), or from a checkpoint at an epoch's start",
                    self.epoch
                )));
            }
            self.batches_in_epoch = global / new;
        }
        self.world_size = new;
        self.global_batches_per_step = per_step;
        Ok(())
    }
}

/// Everything needed to continue a run exactly.
#[derive(Debug)]
pub struct Checkpoint {
    /// Trainable tensors by name (any dtype; CPU or device tensors).
    pub adapter: Vec<(String, Tensor)>,
    /// The optimizer's state.
    pub optimizer: OptimizerState,
    /// The learning-rate schedule (a pure function of the step).
    pub scheduler: Option<Scheduler>,
    /// Loop counters.
    pub counters: TrainerCounters,
    /// CPU generator state (`torch.get_rng_state()`).
    pub rng_cpu: Vec<u8>,
    /// CUDA generator state of the training device, if training on CUDA.
    pub rng_cuda: Option<Vec<u8>>,
    /// Data-parallel runs: every rank's CPU generator state, in rank order (`rng_cpu` is rank
    /// 0's); empty for a single process. A resume on the same world size gives each rank its own
    /// state back, so ranks that drew differently (LoRA dropout over micro-batches of other
    /// shapes) continue exactly.
    pub rng_cpu_ranks: Vec<Vec<u8>>,
    /// Data-parallel runs on CUDA: every rank's generator state of its device, in rank order;
    /// empty otherwise.
    pub rng_cuda_ranks: Vec<Vec<u8>>,
    /// The data loader's position (opaque; from [`crate::engine::trainer::BatchSource::state`]).
    pub loader: serde_json::Value,
    /// The run's configuration (opaque JSON), for the record and for resume checks.
    pub config: serde_json::Value,
    /// fp16 loss-scaler state.
    pub scaler: Option<ScalerState>,
}

#[derive(Serialize, Deserialize)]
struct StateFile {
    format_version: u32,
    counters: TrainerCounters,
    optimizer_meta: serde_json::Value,
    scheduler: Option<Scheduler>,
    rng_cpu: String,
    rng_cuda: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    rng_cpu_ranks: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    rng_cuda_ranks: Vec<String>,
    loader: serde_json::Value,
    config: serde_json::Value,
    scaler: Option<ScalerState>,
    adapter_names: Vec<String>,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

fn hex_encode(bytes: &[u8]) -> String {
    hex::encode(bytes)
}

fn hex_decode(s: &str) -> Result<Vec<u8>> {
    hex::decode(s).map_err(|e| TrainError::State {
        what: "checkpoint state.json".into(),
        message: format!("RNG state is not valid hex: {e}"),
    })
}

fn kind_of(dtype: Dtype, key: &str) -> Result<Kind> {
    Ok(match dtype {
        Dtype::F32 => Kind::Float,
        Dtype::F64 => Kind::Double,
        Dtype::F16 => Kind::Half,
        Dtype::BF16 => Kind::BFloat16,
        Dtype::U8 => Kind::Uint8,
        Dtype::I8 => Kind::Int8,
        Dtype::I16 => Kind::Int16,
        Dtype::I32 => Kind::Int,
        Dtype::I64 => Kind::Int64,
        Dtype::BOOL => Kind::Bool,
        other => {
            return Err(TrainError::State {
                what: "checkpoint".into(),
                message: format!("tensor `{key}` has unsupported dtype {other:?}"),
            });
        }
    })
}

fn check_finite(key: &str, t: &Tensor) -> Result<()> {
    if !t.is_floating_point() || t.numel() == 0 {
        return Ok(());
    }
    let ok = t.f_isfinite()?.f_all()?.f_int64_value(&[])? != 0;
    if !ok {
        return Err(TrainError::State {
            what: "checkpoint".into(),
            message: format!(
                "refusing to write a checkpoint: `{key}` holds NaN/Inf (the last good checkpoint is kept)"
            ),
        });
    }
    Ok(())
}

fn write_file_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = fs::File::create(path).map_err(io_err("create", path))?;
    f.write_all(bytes).map_err(io_err("write", path))?;
    f.sync_all().map_err(io_err("fsync", path))?;
    Ok(())
}

fn sync_dir(path: &Path) -> Result<()> {
    fs::File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io_err("fsync folder", path))
}

/// Writes `tensors` through lora-core's one safetensors writer (sorted header, fsync'ed, with
/// `format: pt` metadata as PyTorch's writers set it), so the same state gives the same bytes.
fn write_safetensors(path: &Path, tensors: &[(String, Tensor)]) -> Result<()> {
    let map: BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.shallow_clone()))
        .collect();
    if map.len() != tensors.len() {
        let mut seen = std::collections::BTreeSet::new();
        let dup = tensors
            .iter()
            .find(|(k, _)| !seen.insert(k.as_str()))
            .map(|(k, _)| k.clone())
            .unwrap_or_default();
        return Err(TrainError::State {
            what: "checkpoint".into(),
            message: format!("two tensors named `{dup}` for `{}`", path.display()),
        });
    }
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    lora_core::formats::write_safetensors(path, &map, &meta)?;
    Ok(())
}

fn read_safetensors(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| TrainError::State {
        what: "checkpoint".into(),
        message: format!("`{}` is not a valid safetensors file: {e}", path.display()),
    })?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let kind = kind_of(view.dtype(), &name)?;
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        out.push((name, Tensor::f_from_data_size(view.data(), &shape, kind)?));
    }
    Ok(out)
}

impl Checkpoint {
    /// Writes the checkpoint into the (new) folder `dir` non-atomically; use
    /// [`CheckpointManager::save`] for the atomic, pruned version.
    ///
    /// # Errors
    /// Non-finite values (nothing is written), I/O or libtorch errors.
    pub fn write_to(&self, dir: &Path) -> Result<()> {
        for (k, t) in &self.adapter {
            check_finite(k, t)?;
        }
        for (k, t) in &self.optimizer.tensors {
            check_finite(k, t)?;
        }
        fs::create_dir_all(dir).map_err(io_err("create folder", dir))?;
        write_safetensors(&dir.join(ADAPTER_FILE), &self.adapter)?;
        let opt: Vec<(String, Tensor)> = self
            .optimizer
            .tensors
            .iter()
            .map(|(k, t)| (k.clone(), t.shallow_clone()))
            .collect();
        write_safetensors(&dir.join(OPTIMIZER_FILE), &opt)?;
        let state = StateFile {
            format_version: FORMAT_VERSION,
            counters: self.counters.clone(),
            optimizer_meta: self.optimizer.meta.clone(),
            scheduler: self.scheduler.clone(),
            rng_cpu: hex_encode(&self.rng_cpu),
            rng_cuda: self.rng_cuda.as_deref().map(hex_encode),
            rng_cpu_ranks: self.rng_cpu_ranks.iter().map(|s| hex_encode(s)).collect(),
            rng_cuda_ranks: self.rng_cuda_ranks.iter().map(|s| hex_encode(s)).collect(),
            loader: self.loader.clone(),
            config: self.config.clone(),
            scaler: self.scaler,
            adapter_names: self.adapter.iter().map(|(k, _)| k.clone()).collect(),
        };
        let json = serde_json::to_vec_pretty(&state).map_err(|e| TrainError::State {
            what: "checkpoint".into(),
            message: format!("serializing state.json: {e}"),
        })?;
        let path = dir.join(STATE_FILE);
        write_file_synced(&path, &json)?;
        sync_dir(dir)
    }

    /// Reads only the loop counters of a checkpoint folder (its `state.json`, no tensors): the
    /// step a resume continues from, known before anything is loaded.
    ///
    /// # Errors
    /// A missing or corrupt `state.json`, or a newer format.
    pub fn read_counters(dir: &Path) -> Result<TrainerCounters> {
        Ok(read_state(dir)?.counters)
    }

    /// Reads only the run configuration a checkpoint was written with (its `state.json`, no
    /// tensors); `Null` when the writer recorded none.
    ///
    /// # Errors
    /// A missing or corrupt `state.json`, or a newer format.
    pub fn read_config(dir: &Path) -> Result<serde_json::Value> {
        Ok(read_state(dir)?.config)
    }

    /// Reads a checkpoint folder (tensors on CPU, in the order they were saved).
    ///
    /// # Errors
    /// Missing or corrupt files, or a newer format.
    pub fn read_from(dir: &Path) -> Result<Self> {
        let st = read_state(dir)?;
        let mut by_name: BTreeMap<String, Tensor> = read_safetensors(&dir.join(ADAPTER_FILE))?
            .into_iter()
            .collect();
        let mut adapter = Vec::with_capacity(st.adapter_names.len());
        for name in &st.adapter_names {
            let t = by_name.remove(name).ok_or_else(|| TrainError::State {
                what: "checkpoint".into(),
                message: format!(
                    "adapter tensor `{name}` listed in state.json is missing from {ADAPTER_FILE}"
                ),
            })?;
            adapter.push((name.clone(), t));
        }
        let tensors: BTreeMap<String, Tensor> = read_safetensors(&dir.join(OPTIMIZER_FILE))?
            .into_iter()
            .collect();
        Ok(Self {
            adapter,
            optimizer: OptimizerState {
                tensors,
                meta: st.optimizer_meta,
            },
            scheduler: st.scheduler,
            counters: st.counters,
            rng_cpu: hex_decode(&st.rng_cpu)?,
            rng_cuda: st.rng_cuda.as_deref().map(hex_decode).transpose()?,
            rng_cpu_ranks: st
                .rng_cpu_ranks
                .iter()
                .map(|s| hex_decode(s))
                .collect::<Result<_>>()?,
            rng_cuda_ranks: st
                .rng_cuda_ranks
                .iter()
                .map(|s| hex_decode(s))
                .collect::<Result<_>>()?,
            loader: st.loader,
            config: st.config,
            scaler: st.scaler,
        })
    }
}

/// Saves, lists, prunes and finds checkpoints under one folder.
#[derive(Debug, Clone)]
pub struct CheckpointManager {
    dir: PathBuf,
    keep_last: usize,
}

impl CheckpointManager {
    /// Manages checkpoints in `dir` (created on first save), keeping the last `keep_last`
    /// (at least 1).
    pub fn new(dir: impl Into<PathBuf>, keep_last: usize) -> Self {
        Self {
            dir: dir.into(),
            keep_last: keep_last.max(1),
        }
    }

    /// The managed folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// True when `dir` is a complete checkpoint folder (its `state.json`, written last, exists).
    pub fn is_checkpoint(dir: &Path) -> bool {
        dir.join(STATE_FILE).is_file()
    }

    /// The folder name of the checkpoint of `step`.
    pub fn name_for(step: u64) -> String {
        format!("step-{step:08}")
    }

    /// Complete checkpoints, oldest first, as `(step, folder)`.
    ///
    /// # Errors
    /// The folder exists but cannot be read.
    pub fn list(&self) -> Result<Vec<(u64, PathBuf)>> {
        if !self.dir.exists() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(num) = name.strip_prefix("step-") else {
                continue;
            };
            let Ok(step) = num.parse::<u64>() else {
                continue;
            };
            if entry.path().join(STATE_FILE).is_file() {
                out.push((step, entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The newest complete checkpoint folder.
    ///
    /// # Errors
    /// The folder cannot be read.
    pub fn latest(&self) -> Result<Option<PathBuf>> {
        Ok(self.list()?.pop().map(|(_, p)| p))
    }

    /// Writes `ckpt` atomically as `step-<counters.step>` and prunes old checkpoints.
    /// Returns the final folder.
    ///
    /// # Errors
    /// Non-finite values (nothing is written; older checkpoints are untouched), I/O errors.
    pub fn save(&self, ckpt: &Checkpoint) -> Result<PathBuf> {
        fs::create_dir_all(&self.dir).map_err(io_err("create folder", &self.dir))?;
        self.remove_temporaries()?;
        let name = Self::name_for(ckpt.counters.step);
        let tmp = self.dir.join(format!(".tmp-{name}-{}", std::process::id()));
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io_err("remove", &tmp))?;
        }
        if let Err(e) = ckpt.write_to(&tmp) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let dst = self.dir.join(&name);
        if dst.exists() {
            // Re-saving a step after resuming from an older checkpoint: move the old one aside
            // first so that a complete checkpoint of this step exists at every instant.
            let old = self.dir.join(format!(".old-{name}-{}", std::process::id()));
            fs::rename(&dst, &old).map_err(io_err("rename", &dst))?;
            fs::rename(&tmp, &dst).map_err(io_err("rename", &tmp))?;
            let _ = fs::remove_dir_all(&old);
        } else {
            fs::rename(&tmp, &dst).map_err(io_err("rename", &tmp))?;
        }
        sync_dir(&self.dir)?;
        self.prune()?;
        Ok(dst)
    }

    fn remove_temporaries(&self) -> Result<()> {
        for entry in fs::read_dir(&self.dir).map_err(io_err("list", &self.dir))? {
            let entry = entry.map_err(io_err("list", &self.dir))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with(".tmp-step-") || name.starts_with(".old-step-") {
                let p = entry.path();
                fs::remove_dir_all(&p).map_err(io_err("remove", &p))?;
            }
        }
        Ok(())
    }

    /// Deletes all but the newest `keep_last` checkpoints.
    ///
    /// # Errors
    /// I/O errors.
    pub fn prune(&self) -> Result<()> {
        let list = self.list()?;
        let n = list.len().saturating_sub(self.keep_last);
        for (_, p) in list.into_iter().take(n) {
            fs::remove_dir_all(&p).map_err(io_err("remove", &p))?;
        }
        Ok(())
    }
}

/// The keys of the run configuration (dotted paths into its JSON) that fix the adapter a
/// checkpoint holds: its tensor names and shapes (`lora.rank`, `lora.target_modules`, …) or how
/// they are applied (`lora.alpha`, `lora.use_rslora`, …). A run resumed with another value
/// would fail on a tensor shape or silently train a different adapter.
pub const ADAPTER_CONFIG_KEYS: &[&str] = &[
    "lora.rank",
    "lora.alpha",
    "lora.target_modules",
    "lora.exclude_modules",
    "lora.rank_pattern",
    "lora.alpha_pattern",
    "lora.use_dora",
    "lora.use_rslora",
    "lora.network_module",
    "train.train_text_encoder",
];

/// One key of [`ADAPTER_CONFIG_KEYS`] whose value differs between a checkpoint and a run.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigMismatch {
    /// Dotted key, e.g. `lora.rank`.
    pub key: &'static str,
    /// The value the checkpoint was written with (JSON).
    pub checkpoint: serde_json::Value,
    /// The value of the run's configuration (JSON).
    pub config: serde_json::Value,
}

/// The [`ADAPTER_CONFIG_KEYS`] whose values differ between `saved` (a checkpoint's recorded
/// configuration, [`Checkpoint::read_config`]) and `run` (this run's, serialized the same way),
/// in the order of that list. Lists compare as sets (`[q_proj, v_proj]` = `[v_proj, q_proj]`);
/// a key missing on either side (an older writer, a `Null` config) is not compared. `skip`
/// leaves keys out (e.g. the rank and alpha that `memory.auto_fit` chooses).
pub fn adapter_config_mismatches(
    saved: &serde_json::Value,
    run: &serde_json::Value,
    skip: &[&str],
) -> Vec<ConfigMismatch> {
    fn at<'a>(v: &'a serde_json::Value, key: &str) -> Option<&'a serde_json::Value> {
        key.split('.').try_fold(v, |v, k| v.get(k))
    }
    fn normalized(v: &serde_json::Value) -> serde_json::Value {
        match v {
            serde_json::Value::Array(items) => {
                let mut items: Vec<serde_json::Value> = items.iter().map(normalized).collect();
                items.sort_by_key(|x| x.to_string());
                items.dedup();
                serde_json::Value::Array(items)
            }
            other => other.clone(),
        }
    }
    ADAPTER_CONFIG_KEYS
        .iter()
        .filter(|k| !skip.contains(k))
        .filter_map(|&key| {
            let (a, b) = (at(saved, key)?, at(run, key)?);
            (normalized(a) != normalized(b)).then(|| ConfigMismatch {
                key,
                checkpoint: a.clone(),
                config: b.clone(),
            })
        })
        .collect()
}

/// A checkpoint folder's `state.json`, checked for this build's format version.
fn read_state(dir: &Path) -> Result<StateFile> {
    let path = dir.join(STATE_FILE);
    let text = fs::read(&path).map_err(io_err("read", &path))?;
    let st: StateFile = serde_json::from_slice(&text).map_err(|e| TrainError::State {
        what: "checkpoint state.json".into(),
        message: format!("`{}`: {e}", path.display()),
    })?;
    if st.format_version != FORMAT_VERSION {
        return Err(TrainError::State {
            what: "checkpoint".into(),
            message: format!(
                "`{}` has format version {}, this build reads {FORMAT_VERSION}",
                dir.display(),
                st.format_version
            ),
        });
    }
    Ok(st)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(step: u64, v: f32) -> Checkpoint {
        let mut optimizer = OptimizerState::default();
        optimizer
            .tensors
            .insert("g0.p0.exp_avg".into(), Tensor::from_slice(&[v, 2.0 * v]));
        optimizer
            .tensors
            .insert("g0.p0.codes".into(), Tensor::from_slice(&[1u8, 2, 255]));
        optimizer.meta = serde_json::json!({"optimizer": "AdamW", "steps": step});
        Checkpoint {
            adapter: vec![
                (
                    "b.lora_B".into(),
                    Tensor::from_slice(&[v, -v, 1e-30]).reshape([3, 1]),
                ),
                (
                    "a.lora_A".into(),
                    Tensor::from_slice(&[0.1f32, 0.2]).to_kind(Kind::BFloat16),
                ),
            ],
            optimizer,
            scheduler: None,
            counters: TrainerCounters {
                step,
                micro_batch_split: 1,
                lr_factor: 1.0,
                ..Default::default()
            },
            rng_cpu: vec![0, 1, 254, 255],
            rng_cuda: None,
            rng_cpu_ranks: vec![vec![0, 1, 254, 255], vec![7, 8]],
            rng_cuda_ranks: Vec::new(),
            loader: serde_json::json!({"cursor": step}),
            config: serde_json::json!({"lr": 1e-4}),
            scaler: None,
        }
    }

    #[test]
    fn counters_of_another_world_size_map_onto_the_same_place_of_the_plan() {
        let saved = |world_size, per_step, batches_in_epoch| TrainerCounters {
            step: 3,
            epoch: 1,
            batches_in_epoch,
            world_size,
            global_batches_per_step: per_step,
            ..Default::default()
        };
        // 2 ranks × 1 micro-batch, 3 steps into the epoch → 1 process accumulating 2: 6 batches
        let mut c = saved(2, 2, 3);
        c.remap_world_size(1, 2).unwrap();
        assert_eq!(
            (c.batches_in_epoch, c.world_size, c.global_batches_per_step),
            (6, 1, 2)
        );
        // and back
        c.remap_world_size(2, 1).unwrap();
        assert_eq!((c.batches_in_epoch, c.world_size), (3, 2));
        // the same world size: unchanged
        let mut c = saved(2, 2, 3);
        c.remap_world_size(2, 1).unwrap();
        assert_eq!(c, saved(2, 2, 3));
        // another global batch: refused, with the accumulation that keeps it
        let e = saved(2, 2, 3)
            .remap_world_size(1, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gradient_accumulation_steps: 2"), "{e}");
        let e = saved(2, 2, 3)
            .remap_world_size(4, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not split over 4 ranks"), "{e}");
        // 6 batches of each of 2 ranks are 12 of the plan: 3 for each of 4 ranks; the 3
        // batches of one process do not split over 2 ranks
        let mut c = saved(2, 4, 6);
        c.remap_world_size(4, 1).unwrap();
        assert_eq!(c.batches_in_epoch, 3);
        let e = saved(1, 2, 3)
            .remap_world_size(2, 1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("after 3 batches of epoch 1"), "{e}");
        // a checkpoint that recorded neither (one process): its global batch is taken as kept
        let mut c = saved(0, 0, 4);
        c.remap_world_size(2, 1).unwrap();
        assert_eq!((c.batches_in_epoch, c.world_size), (2, 2));
    }

    #[test]
    fn roundtrip_is_bit_exact_and_keeps_order() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 2);
        let p = m.save(&sample(3, 0.3)).unwrap();
        let c = Checkpoint::read_from(&p).unwrap();
        assert_eq!(c.adapter[0].0, "b.lora_B");
        assert!(c.adapter[0].1.equal(&sample(3, 0.3).adapter[0].1));
        assert_eq!(c.adapter[1].1.kind(), Kind::BFloat16);
        assert_eq!(c.rng_cpu, vec![0, 1, 254, 255]);
        assert_eq!(c.rng_cpu_ranks, vec![vec![0, 1, 254, 255], vec![7, 8]]);
        assert!(c.rng_cuda_ranks.is_empty());
        assert_eq!(c.loader["cursor"], 3);
        assert_eq!(c.optimizer.tensors["g0.p0.codes"].kind(), Kind::Uint8);
        assert_eq!(c.counters.step, 3);
    }

    #[test]
    fn the_same_state_writes_byte_identical_files() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let pa = CheckpointManager::new(a.path(), 2)
            .save(&sample(5, 0.5))
            .unwrap();
        let mut reordered = sample(5, 0.5);
        reordered.adapter.reverse();
        let pb = CheckpointManager::new(b.path(), 2)
            .save(&reordered)
            .unwrap();
        for f in [ADAPTER_FILE, OPTIMIZER_FILE] {
            let (x, y) = (fs::read(pa.join(f)).unwrap(), fs::read(pb.join(f)).unwrap());
            assert_eq!(x, y, "{f}");
        }
        let st = SafeTensors::deserialize(&fs::read(pa.join(OPTIMIZER_FILE)).unwrap())
            .unwrap()
            .tensor("g0.p0.codes")
            .unwrap()
            .data()
            .to_vec();
        assert_eq!(st, [1u8, 2, 255]);
    }

    #[test]
    fn keeps_last_k_and_ignores_temporaries() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 2);
        for s in [1, 2, 3] {
            m.save(&sample(s, s as f32)).unwrap();
        }
        // A half-written checkpoint left by a crash is neither listed nor kept.
        fs::create_dir_all(dir.path().join(".tmp-step-00000004-1")).unwrap();
        let steps: Vec<u64> = m.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![2, 3]);
        m.save(&sample(4, 4.0)).unwrap();
        assert!(!dir.path().join(".tmp-step-00000004-1").exists());
        assert_eq!(
            m.latest().unwrap().unwrap(),
            dir.path().join("step-00000004")
        );
    }

    #[test]
    fn adapter_config_mismatches_name_each_key_and_both_values() {
        let saved = serde_json::json!({
            "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"],
                     "use_dora": false},
            "train": {"learning_rate": 1e-4},
        });
        // Same adapter; other settings and the order of target_modules may change.
        let same = serde_json::json!({
            "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["v_proj", "q_proj"],
                     "use_dora": false},
            "train": {"learning_rate": 5e-4},
        });
        assert!(adapter_config_mismatches(&saved, &same, &[]).is_empty());
        let changed = serde_json::json!({
            "lora": {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj"], "use_dora": false},
        });
        let m = adapter_config_mismatches(&saved, &changed, &[]);
        let keys: Vec<&str> = m.iter().map(|m| m.key).collect();
        assert_eq!(keys, ["lora.rank", "lora.alpha", "lora.target_modules"]);
        assert_eq!(m[0].checkpoint, serde_json::json!(4));
        assert_eq!(m[0].config, serde_json::json!(8));
        assert_eq!(m[2].config, serde_json::json!(["q_proj"]));
        // Keys left out, and a checkpoint that recorded no config, are not compared.
        let m = adapter_config_mismatches(&saved, &changed, &["lora.rank", "lora.alpha"]);
        assert_eq!(m.len(), 1);
        assert!(adapter_config_mismatches(&serde_json::Value::Null, &changed, &[]).is_empty());
    }

    #[test]
    fn non_finite_values_are_never_written() {
        let dir = tempfile::tempdir().unwrap();
        let m = CheckpointManager::new(dir.path(), 3);
        m.save(&sample(1, 1.0)).unwrap();
        let err = m.save(&sample(2, f32::NAN)).unwrap_err().to_string();
        assert!(err.contains("NaN/Inf") && err.contains("b.lora_B"), "{err}");
        let steps: Vec<u64> = m.list().unwrap().into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, vec![1]);
        let mut bad = sample(2, 1.0);
        bad.optimizer.tensors.insert(
            "g0.p0.exp_avg_sq".into(),
            Tensor::from_slice(&[f32::INFINITY]),
        );
        assert!(m.save(&bad).is_err());
        assert_eq!(m.list().unwrap().len(), 1);
    }
}
