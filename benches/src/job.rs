//! The training job both sides of the comparison run, and our side of it.
//!
//! Shared inputs, written once by [`prepare`] into a job folder:
//! - `batches.safetensors`: `input_ids` `[steps, batch, seq_len]` int64 — full rows of one
//!   document each from lora-data's packing of the Shakespeare plays (tokenized with the model's
//!   own tokenizer), so the position ids are `0..seq_len` on every row and no padding exists; the
//!   labels are the ids themselves (both models shift them inside, as HF does);
//! - `adapter_init/`: a PEFT adapter folder (`adapter_config.json`, `adapter_model.safetensors`)
//!   with the initial LoRA A (Kaiming-uniform) and B (zeros) of every target module.
//!
//! Each side then loads the base dequantized to the same dense f32 weights, loads the adapter as
//! trainable, runs `steps` optimizer steps of AdamW over the batches in order, and reports a
//! [`TrainResult`] (the Python side, `benches/python/peft_train.py`, writes the same JSON fields).

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use lora_train::config::{BaseWeights, Dtype};
use lora_train::engine::callbacks::{Callback, Control, StepInfo};
use lora_train::engine::{BatchSource, Resume, Trainer, TrainerConfig};

use crate::{BenchError, Result, lower, torch};

/// The PEFT target modules of the comparison: every linear of the LLaMA blocks.
pub const TARGET_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// File name of the token batches inside a job folder.
pub const BATCHES_FILE: &str = "batches.safetensors";
/// Folder name of the initial adapter inside a job folder.
pub const ADAPTER_DIR: &str = "adapter_init";

/// What [`prepare`] writes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrepareOptions {
    /// The base model (GGUF).
    pub model: PathBuf,
    /// A folder of `.txt` files (read in name order until enough tokens are found).
    pub text_dir: PathBuf,
    /// Optimizer steps the batches are for (one batch per step).
    pub steps: usize,
    /// Rows per batch.
    pub batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// LoRA rank `r`.
    pub rank: i64,
    /// LoRA `lora_alpha` (scaling α/r).
    pub alpha: f64,
    /// Seed of the adapter initialisation and of the packing order.
    pub seed: u64,
    /// The job folder to write.
    pub out_dir: PathBuf,
}

/// How [`train_ours`] runs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainOptions {
    /// The base model (GGUF).
    pub model: PathBuf,
    /// A job folder written by [`prepare`].
    pub job_dir: PathBuf,
    /// Optimizer steps (at most the number of batches in the job).
    pub steps: usize,
    /// Intra-op threads (`tch::set_num_threads`; set `OMP_NUM_THREADS` to the same value).
    pub threads: i32,
    /// AdamW learning rate (constant).
    pub lr: f64,
    /// AdamW decoupled weight decay (`torch.optim.AdamW`'s default 0.01).
    pub weight_decay: f64,
    /// `"cpu"` or `"cuda"` (device 0).
    pub device: String,
    /// `"fp32"` or `"bf16"` (bf16 autocast, f32 weights and adapters).
    pub precision: String,
    /// Instead of the [`Trainer`], run a bare loop (forward + loss, backward, optimizer step,
    /// zero-grad) with the same model, adapter and optimizer and time each phase, to show where
    /// the time goes.
    #[serde(default)]
    pub phases: bool,
    /// With [`TrainOptions::phases`]' bare loop, record every step after the first with
    /// libtorch's profiler ([`lora_core::profile`]) and write `ops_ours.json` (per operator:
    /// calls, self and total seconds per step; [`OpsFile`]) and `trace_ours.json` (Chrome trace)
    /// into this folder.
    #[serde(default)]
    pub profile: Option<PathBuf>,
}

/// The per-operator sums of a profiled run (`ops_<side>.json`); the Python side writes the same
/// fields from `torch.profiler`'s `key_averages()`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpsFile {
    /// `"ours"` or `"peft"`.
    pub side: String,
    /// Steps recorded (every step after the first).
    pub steps: usize,
    /// One entry per operator name, largest self time first.
    pub ops: Vec<OpEntry>,
    /// The 40 largest entries per operator name and input shapes, largest self time first.
    #[serde(default)]
    pub by_shapes: Vec<OpEntry>,
}

/// One operator of an [`OpsFile`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct OpEntry {
    /// The operator's name (`aten::mm`, `MmBackward0`, …).
    pub name: String,
    /// Its input shapes (`[256, 576], [576, 960]`) in [`OpsFile::by_shapes`]; empty in
    /// [`OpsFile::ops`].
    #[serde(default)]
    pub shapes: String,
    /// Calls per step.
    pub calls_per_step: f64,
    /// Self time per step, seconds (time inside minus the operators nested directly in it).
    pub self_s: f64,
    /// Total time per step, seconds (nested operators included).
    pub total_s: f64,
}

/// What one side measured. The Python side writes the same fields.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct TrainResult {
    /// `"ours"` or `"peft"`.
    pub side: String,
    /// `"cpu"` or `"cuda"`.
    pub device: String,
    /// `"fp32"` or `"bf16"`.
    pub precision: String,
    /// Intra-op threads.
    pub threads: i32,
    /// Rows per batch.
    pub batch: usize,
    /// Tokens per row.
    pub seq_len: usize,
    /// Seconds to load the base, dequantized, and the adapter.
    pub load_s: f64,
    /// Wall time of every optimizer step (forward, loss, backward, optimizer step, zero-grad), s.
    pub step_times_s: Vec<f64>,
    /// CPU time of the process (all threads, user + system) during every step, s — steadier than
    /// the wall time on a machine shared with other work.
    #[serde(default)]
    pub step_cpu_s: Vec<f64>,
    /// Training loss of every step (mean next-token NLL, nats).
    pub losses: Vec<f64>,
    /// Tokens per step (`batch × seq_len`).
    pub tokens_per_step: u64,
    /// Process resident set right before the first step, bytes (`VmRSS`).
    pub rss_baseline_bytes: u64,
    /// Peak resident set during the steps, bytes (`VmHWM` after `clear_refs` 5 before the steps).
    pub rss_peak_bytes: u64,
    /// `rss_peak_bytes − rss_baseline_bytes`.
    pub rss_delta_bytes: u64,
    /// Peak live CPU tensor bytes during the steps (our counting allocator; `None` on the Python
    /// side, which has no CPU allocator statistics).
    pub tensor_peak_bytes: Option<u64>,
    /// Peak CUDA allocated bytes during the steps (`max_memory_allocated`), on CUDA.
    pub cuda_peak_bytes: Option<u64>,
    /// Mean seconds per phase over the steps after the first, when the side measured them
    /// (`forward`, `backward`, `optimizer`); empty otherwise.
    #[serde(default)]
    pub phases_s: std::collections::BTreeMap<String, f64>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> BenchError + '_ {
    move |source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn text_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(BenchError::Invalid(format!(
            "{}: no .txt files; `cargo xtask setup` provisions assets/shakespeare",
            dir.display()
        )));
    }
    Ok(files)
}

/// Writes the shared inputs of the comparison into `opts.out_dir` (see the module docs) and
/// returns the paths of the batches file and of the adapter folder.
///
/// The rows are lora-data's packed rows ([`lora_data::text::TextDataset`], packing on, seed
/// `opts.seed`) that hold one document piece of exactly `seq_len` tokens, in the dataset's row
/// order. The adapter is lora-core's injection into the model (A Kaiming-uniform as PEFT, B zeros)
/// after `tch::manual_seed(seed)`, saved with [`lora_core::formats::peft::save_adapter`].
///
/// # Errors
/// [`BenchError::Invalid`] when the text gives fewer full rows than `steps × batch`; model,
/// tokenizer and I/O errors.
pub fn prepare(opts: &PrepareOptions) -> Result<(PathBuf, PathBuf)> {
    use lora_data::text::{TextConfig, TextDataset, TextFormat};
    if opts.steps == 0 || opts.batch == 0 || opts.seq_len < 2 {
        return Err(BenchError::Invalid(format!(
            "steps {} / batch {} / seq_len {}: use steps ≥ 1, batch ≥ 1, seq_len ≥ 2",
            opts.steps, opts.batch, opts.seq_len
        )));
    }
    std::fs::create_dir_all(&opts.out_dir).map_err(io(&opts.out_dir))?;
    let tok = lora_models::tokenizer::load_tokenizer_from_gguf(&opts.model)
        .map_err(lower("loading the tokenizer"))?;
    let rows_needed = opts.steps * opts.batch;
    // ~4 bytes per token for this text; read twice that so enough full rows exist.
    let bytes_needed = (rows_needed * opts.seq_len * 8) as u64;
    let mut texts: Vec<(String, String)> = Vec::new();
    let mut bytes = 0u64;
    for f in text_files(&opts.text_dir)? {
        let t = std::fs::read_to_string(&f).map_err(io(&f))?;
        bytes += t.len() as u64;
        texts.push((f.display().to_string(), t));
        if bytes >= bytes_needed {
            break;
        }
    }
    let pairs: Vec<(&str, &str)> = texts
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    let cfg = TextConfig {
        format: TextFormat::Plain,
        seq_len: opts.seq_len,
        packing: true,
        eos_token_id: tok.eos_id,
        pad_token_id: tok.pad_id.or(tok.eos_id).unwrap_or(0),
        seed: opts.seed,
        ..TextConfig::default()
    };
    let ds = TextDataset::from_texts(&pairs, tok.inner(), cfg)
        .map_err(lower("tokenizing and packing the text"))?;
    let mut ids: Vec<i64> = Vec::with_capacity(rows_needed * opts.seq_len);
    let mut rows = 0;
    for row in ds.rows() {
        if rows == rows_needed {
            break;
        }
        if let [d] = row.as_slice() {
            let doc = &ds.documents()[*d];
            if doc.ids.len() == opts.seq_len {
                ids.extend_from_slice(&doc.ids);
                rows += 1;
            }
        }
    }
    if rows < rows_needed {
        return Err(BenchError::Invalid(format!(
            "{}: only {rows} full rows of {} tokens in {} bytes of text, {rows_needed} needed; \
             use fewer steps, a smaller batch or a shorter seq_len",
            opts.text_dir.display(),
            opts.seq_len,
            bytes
        )));
    }
    let t = Tensor::f_from_slice(&ids)
        .and_then(|t| t.f_view([opts.steps as i64, opts.batch as i64, opts.seq_len as i64]))
        .map_err(torch("building the batches tensor"))?;
    let batches = opts.out_dir.join(BATCHES_FILE);
    let mut tensors = std::collections::BTreeMap::new();
    tensors.insert("input_ids".to_string(), t);
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("steps".into(), opts.steps.to_string());
    meta.insert("batch".into(), opts.batch.to_string());
    meta.insert("seq_len".into(), opts.seq_len.to_string());
    meta.insert("source".into(), opts.text_dir.display().to_string());
    lora_core::formats::write_safetensors(&batches, &tensors, &meta)
        .map_err(lower("writing the batches"))?;

    // The initial adapter.
    let (mut model, _) =
        lora_train::llm::load_base(&opts.model, BaseWeights::Dense, Dtype::F32, Device::Cpu)
            .map_err(lower("loading the base model"))?;
    tch::manual_seed(opts.seed as i64);
    let mut lcfg = lora_core::config::LoraConfig::new(opts.rank, opts.alpha, &TARGET_MODULES);
    lcfg.task_type = Some("CAUSAL_LM".into());
    let vs = tch::nn::VarStore::new(Device::Cpu);
    lora_core::inject::inject(&mut model, &lcfg, "default", &vs.root())
        .map_err(lower("injecting LoRA"))?;
    let adapter = opts.out_dir.join(ADAPTER_DIR);
    lora_core::formats::peft::save_adapter(&mut model, "default", Some(&lcfg), &adapter)
        .map_err(lower("writing the initial adapter"))?;
    Ok((batches, adapter))
}

/// The batches of a job folder, one per step, in order.
struct FixedBatches {
    ids: Tensor,
    positions: Tensor,
    mask: Tensor,
    next: i64,
    steps: i64,
}

impl FixedBatches {
    fn batch(&self, i: i64) -> tch::Result<lora_data::text::TextBatch> {
        let ids = self.ids.f_get(i)?;
        Ok(lora_data::text::TextBatch {
            labels: ids.shallow_clone(),
            input_ids: ids,
            attention_mask: self.mask.shallow_clone(),
            position_ids: self.positions.shallow_clone(),
            doc_ids: None,
        })
    }
}

impl BatchSource<lora_data::text::TextBatch> for FixedBatches {
    fn start_epoch(&mut self, _epoch: u64) -> lora_train::engine::Result<()> {
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> lora_train::engine::Result<Option<lora_data::text::TextBatch>> {
        if self.next >= self.steps {
            return Ok(None);
        }
        let b = self.batch(self.next)?;
        self.next += 1;
        Ok(Some(b))
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.steps as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "next": self.next })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> lora_train::engine::Result<()> {
        self.next = state["next"].as_i64().unwrap_or(0);
        Ok(())
    }
}

/// Records the time, CPU time and loss of every step.
struct Recorder {
    steps: Rc<RefCell<Vec<(f64, f64, f64)>>>,
    cpu_mark: f64,
}

impl Callback for Recorder {
    fn on_start(&mut self, _total: u64, _start: u64) -> lora_train::engine::Result<()> {
        self.cpu_mark = cpu_seconds();
        Ok(())
    }

    fn on_step(&mut self, info: &StepInfo) -> lora_train::engine::Result<Control> {
        let now = cpu_seconds();
        self.steps
            .borrow_mut()
            .push((info.step_time_s, now - self.cpu_mark, info.loss));
        self.cpu_mark = now;
        Ok(Control::Continue)
    }
}

/// CPU seconds used by this process so far, all threads, user + system (`/proc/self/stat`
/// fields 14 and 15, in clock ticks of 1/100 s — the Linux `USER_HZ`); 0 where unavailable.
pub fn cpu_seconds() -> f64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // The command name (field 2) is in parentheses and may hold spaces: split after it.
    let Some(rest) = s.rsplit_once(')').map(|(_, r)| r) else {
        return 0.0;
    };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest starts at field 3 (state): utime is field 14 → index 11, stime field 15 → index 12.
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (tick(11) + tick(12)) / 100.0
}

/// Reads `input_ids` `[steps, batch, seq_len]` from a job folder.
///
/// # Errors
/// [`BenchError::Invalid`] when the file lacks the tensor or it is not 3-d int64.
pub fn read_batches(job_dir: &Path) -> Result<Tensor> {
    let path = job_dir.join(BATCHES_FILE);
    let (mut tensors, _) =
        lora_core::formats::read_safetensors(&path).map_err(lower("reading the batches"))?;
    let ids = tensors.remove("input_ids").ok_or_else(|| {
        BenchError::Invalid(format!(
            "{}: no `input_ids` tensor; write the job folder with `bench-train prepare`",
            path.display()
        ))
    })?;
    if ids.dim() != 3 || ids.kind() != Kind::Int64 {
        return Err(BenchError::Invalid(format!(
            "{}: `input_ids` is {:?} {:?}, expected [steps, batch, seq_len] int64",
            path.display(),
            ids.size(),
            ids.kind()
        )));
    }
    Ok(ids)
}

/// Resident set and its high-water mark of this process, bytes (`/proc/self/status`).
pub fn rss() -> (u64, u64) {
    lora_train::job::proc_rss()
}

/// Runs the job of `opts.job_dir` through our [`Trainer`] and measures it.
///
/// The trainer runs with a constant learning rate, no warm-up, no gradient clipping, no
/// checkpoints — the loop a user writes in Python (see `benches/python/peft_train.py`). Memory:
/// `VmRSS` right before the first step, then `VmHWM` after resetting it (`/proc/self/clear_refs`
/// = 5), and the counting CPU allocator's peak of live tensor bytes during the steps (the trainer
/// resets it when it starts); on CUDA the allocator's peak.
///
/// # Errors
/// Invalid options (unknown device or precision, more steps than batches); model, adapter and
/// training errors.
pub fn train_ours(opts: &TrainOptions) -> Result<TrainResult> {
    use lora_train::engine::optim::{AdamWConfig, OptimizerKind};
    use lora_train::engine::precision::Precision;
    use lora_train::engine::sched::SchedulerKind;
    let cuda = match opts.device.as_str() {
        "cpu" => false,
        "cuda" => true,
        other => {
            return Err(BenchError::Invalid(format!(
                "device {other:?}: use \"cpu\" or \"cuda\""
            )));
        }
    };
    let precision = match opts.precision.as_str() {
        "fp32" => Precision::Fp32,
        "bf16" => Precision::Bf16,
        other => {
            return Err(BenchError::Invalid(format!(
                "precision {other:?}: use \"fp32\" or \"bf16\""
            )));
        }
    };
    let device = if cuda { Device::Cuda(0) } else { Device::Cpu };
    if !cuda {
        lora_core::sys::install_counting_cpu_allocator()
            .map_err(lower("installing the counting allocator"))?;
        // as `lora-train train` does on the CPU (`memory.cpu_return_freed`, default true)
        if std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none() {
            lora_core::sys::set_malloc_mmap_threshold(lora_core::sys::RETURN_FREED_MMAP_THRESHOLD);
        }
    }
    tch::set_num_threads(opts.threads);

    let t_load = Instant::now();
    let (mut model, _) =
        lora_train::llm::load_base(&opts.model, BaseWeights::Dense, Dtype::F32, device)
            .map_err(lower("loading the base model"))?;
    // as the causal-LM job does under autocast without checkpointing
    model.set_frozen_cast_cache(precision == Precision::Bf16);
    let vs = tch::nn::VarStore::new(device);
    lora_core::formats::peft::load_adapter(
        &mut model,
        &opts.job_dir.join(ADAPTER_DIR),
        "default",
        &vs.root(),
    )
    .map_err(lower("loading the initial adapter"))?;
    let load_s = t_load.elapsed().as_secs_f64();

    let all = read_batches(&opts.job_dir)?;
    let sz = all.size();
    let (n, b, s) = (sz[0], sz[1], sz[2]);
    if opts.steps == 0 || opts.steps as i64 > n {
        return Err(BenchError::Invalid(format!(
            "{} steps asked, the job folder {} holds {n} batches; prepare it with --steps {}",
            opts.steps,
            opts.job_dir.display(),
            opts.steps
        )));
    }
    let ids = all
        .f_to_device(device)
        .map_err(torch("moving the batches"))?;
    let positions = Tensor::f_arange(s, (Kind::Int64, device))
        .and_then(|p| p.f_view([1, s]))
        .and_then(|p| p.f_expand([b, s], false))
        .and_then(|p| p.f_contiguous())
        .map_err(torch("position ids"))?;
    let mask = Tensor::f_ones([b, s], (Kind::Int64, device)).map_err(torch("attention mask"))?;
    let mut source = FixedBatches {
        ids,
        positions,
        mask,
        next: 0,
        steps: opts.steps as i64,
    };

    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    if opts.phases || opts.profile.is_some() {
        return phase_loop(opts, &model, named, &mut source, load_s, (b, s));
    }
    let mut task = lora_train::llm::LlamaTask {
        model: &model,
        named,
        loraplus_lr_ratio: None,
    };
    let tcfg = TrainerConfig {
        lr: opts.lr,
        optimizer: OptimizerKind::AdamW(AdamWConfig {
            weight_decay: opts.weight_decay,
            ..AdamWConfig::default()
        }),
        scheduler: SchedulerKind::Constant,
        warmup_steps: 0,
        epochs: 1,
        max_steps: Some(opts.steps as u64),
        gradient_accumulation_steps: 1,
        max_grad_norm: None,
        precision,
        device,
        checkpoint_dir: None,
        seed: Some(0),
        track_cpu_memory: !cuda,
        ..TrainerConfig::default()
    };
    let mut trainer: Trainer<lora_train::llm::LlamaTask<'_>> = Trainer::new(tcfg);
    let rec = Rc::new(RefCell::new(Vec::new()));
    trainer.add_callback(Box::new(Recorder {
        steps: rec.clone(),
        cpu_mark: 0.0,
    }));

    let (rss_baseline, _) = rss();
    let _ = lora_train::job::reset_peak_rss();
    let report = trainer
        .fit(&mut task, &mut source, Resume::No)
        .map_err(lower("training"))?;
    let (_, hwm) = rss();
    let tensor_peak = if cuda {
        None
    } else {
        lora_core::sys::cpu_mem_stats().ok().map(|m| m.peak_bytes)
    };
    let cuda_peak = if cuda { Some(report.peak_bytes) } else { None };
    let rec = rec.borrow();
    Ok(TrainResult {
        side: "ours".into(),
        device: opts.device.clone(),
        precision: opts.precision.clone(),
        threads: opts.threads,
        batch: b as usize,
        seq_len: s as usize,
        load_s,
        step_times_s: rec.iter().map(|r| r.0).collect(),
        step_cpu_s: rec.iter().map(|r| r.1).collect(),
        losses: rec.iter().map(|r| r.2).collect(),
        tokens_per_step: (b * s) as u64,
        rss_baseline_bytes: rss_baseline,
        rss_peak_bytes: hwm,
        rss_delta_bytes: hwm.saturating_sub(rss_baseline),
        tensor_peak_bytes: tensor_peak,
        cuda_peak_bytes: cuda_peak,
        phases_s: Default::default(),
    })
}

/// Stops `profiler` and writes `ops_ours.json` ([`OpsFile`], per step over `steps` steps) and
/// `trace_ours.json` into `dir`.
fn write_ops(profiler: lora_core::profile::Profiler, dir: &Path, steps: usize) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let profile = profiler
        .stop(Some(&dir.join("trace_ours.json")))
        .map_err(lower("stopping the profiler"))?;
    let n = steps.max(1) as f64;
    let entries = |ops: Vec<lora_core::profile::OpStats>, top: usize| -> Vec<OpEntry> {
        ops.into_iter()
            .filter(|o| !o.cuda)
            .take(top)
            .map(|o| OpEntry {
                name: o.name,
                shapes: o.shapes,
                calls_per_step: o.calls as f64 / n,
                self_s: o.self_s / n,
                total_s: o.total_s / n,
            })
            .collect()
    };
    let file = OpsFile {
        side: "ours".into(),
        steps,
        ops: entries(profile.ops(), usize::MAX),
        by_shapes: entries(profile.ops_by_shapes(), 40),
    };
    let path = dir.join("ops_ours.json");
    let text = serde_json::to_string_pretty(&file)
        .map_err(|e| BenchError::Invalid(format!("{}: {e}", path.display())))?;
    std::fs::write(&path, text).map_err(io(&path))
}

/// The bare loop of [`TrainOptions::phases`]: the trainer's work without its bookkeeping, each
/// phase timed (CUDA synchronized between phases).
fn phase_loop(
    opts: &TrainOptions,
    model: &lora_models::llama::Llama,
    named: Vec<(String, Tensor)>,
    source: &mut FixedBatches,
    load_s: f64,
    (b, s): (i64, i64),
) -> Result<TrainResult> {
    use lora_train::engine::optim::{AdamWConfig, OptimizerKind, ParamGroup};
    let device = model.device();
    let sync = || {
        if let Device::Cuda(i) = device {
            tch::Cuda::synchronize(i as i64);
        }
    };
    let params: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    let mut opt = OptimizerKind::AdamW(AdamWConfig {
        weight_decay: opts.weight_decay,
        ..AdamWConfig::default()
    })
    .build(vec![ParamGroup::new("adapters", params)], opts.lr)
    .map_err(lower("building AdamW"))?;
    let bf16 = opts.precision == "bf16";
    // the Trainer's block cache on the CPU (`TrainerConfig::cpu_cache`, default true)
    if device == Device::Cpu {
        lora_core::sys::cpu_empty_cache().map_err(lower("emptying the CPU cache"))?;
        lora_core::sys::set_cpu_cache(true).map_err(lower("the CPU block cache"))?;
    }
    let (rss_baseline, _) = rss();
    let _ = lora_train::job::reset_peak_rss();
    let _ = lora_core::sys::cpu_reset_peak();
    if let Device::Cuda(i) = device {
        let _ = lora_core::sys::cuda_reset_peak(i);
    }
    let mut times = Vec::new();
    let mut cpu = Vec::new();
    let mut losses = Vec::new();
    let mut phases: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    let mut profiler = None;
    for i in 0..opts.steps as i64 {
        let batch = source.batch(i).map_err(torch("batch"))?;
        sync();
        if i == 1 && opts.profile.is_some() {
            profiler = Some(
                lora_core::profile::Profiler::start(lora_core::profile::ProfilerOptions {
                    cuda: matches!(device, Device::Cuda(_)),
                    record_shapes: true,
                })
                .map_err(lower("starting the profiler"))?,
            );
        }
        let c0 = cpu_seconds();
        let t = Instant::now();
        let loss = {
            let _ac = if bf16 {
                Some(
                    lora_core::sys::AutocastGuard::new(device, Kind::BFloat16)
                        .map_err(lower("autocast"))?,
                )
            } else {
                None
            };
            model
                .loss(
                    &batch.input_ids,
                    &batch.labels,
                    Some(&batch.attention_mask),
                    Some(&batch.position_ids),
                    true,
                )
                .map_err(lower("forward"))?
        };
        sync();
        let tf = t.elapsed().as_secs_f64();
        loss.f_backward().map_err(torch("backward"))?;
        sync();
        let tb = t.elapsed().as_secs_f64();
        opt.step().map_err(lower("optimizer step"))?;
        opt.zero_grad().map_err(lower("zero_grad"))?;
        let lv = loss.f_double_value(&[]).map_err(torch("loss value"))?;
        sync();
        let te = t.elapsed().as_secs_f64();
        times.push(te);
        cpu.push(cpu_seconds() - c0);
        losses.push(lv);
        phases.entry("forward".into()).or_default().push(tf);
        phases.entry("backward".into()).or_default().push(tb - tf);
        phases.entry("optimizer".into()).or_default().push(te - tb);
    }
    if let (Some(p), Some(dir)) = (profiler, &opts.profile) {
        write_ops(p, dir, opts.steps - 1)?;
    }
    let (_, hwm) = rss();
    let cuda = matches!(device, Device::Cuda(_));
    Ok(TrainResult {
        side: "ours".into(),
        device: opts.device.clone(),
        precision: opts.precision.clone(),
        threads: opts.threads,
        batch: b as usize,
        seq_len: s as usize,
        load_s,
        step_times_s: times,
        step_cpu_s: cpu,
        losses,
        tokens_per_step: (b * s) as u64,
        rss_baseline_bytes: rss_baseline,
        rss_peak_bytes: hwm,
        rss_delta_bytes: hwm.saturating_sub(rss_baseline),
        tensor_peak_bytes: if cuda {
            None
        } else {
            lora_core::sys::cpu_mem_stats().ok().map(|m| m.peak_bytes)
        },
        cuda_peak_bytes: match device {
            Device::Cuda(i) => lora_core::sys::cuda_mem_stats(i)
                .ok()
                .flatten()
                .map(|m| m.peak_allocated_bytes),
            _ => None,
        },
        phases_s: phases
            .into_iter()
            .map(|(k, v)| {
                let tail = &v[1.min(v.len())..];
                (k, tail.iter().sum::<f64>() / tail.len().max(1) as f64)
            })
            .collect(),
    })
}
