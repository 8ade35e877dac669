//! The causal-LM job: plan → load → inject → train → export → summary.
//!
//! [`plan`] is pure (lora-memory only): it reads the model's header, turns the [`TrainConfig`]
//! into lora-memory [`Settings`](lora_memory::Settings), estimates the peak, checks it against the budget and, with
//! `memory.auto_fit`, applies lora-memory's `fit()`.

use crate::config::{BaseWeights, Dtype, TrainConfig};
use crate::job::error::During;
use crate::job::run::ExportAside;
use crate::job::{
    JobError, MeasuredMemory, Plan, Result, RunOptions, budget_for, budget_source, check_device,
    check_not_diverged, check_output_dir, lora_config, proc_rss, reset_peak_rss, resolve_path,
    resume_checkpoint, settings_for, trainer_config,
};
use lora_memory::{BaseDtype, Budget, FitError, ModelDescriptor};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// Reads the base model's header (no tensor data): GGUF, safetensors file/folder, `config.json`,
/// or a lora-memory preset name. Returns the descriptor, a source description, and the GGUF
/// storage type of the layer linears when the file is GGUF.
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no preset; header errors.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String, Option<BaseDtype>)> {
    let written = cfg.base_model()?;
    let path = match resolve_path("model.base_model", written, config_dir) {
        Ok(p) => p,
        Err(e) => {
            return match ModelDescriptor::preset(written) {
                Ok(d) => Ok((d, format!("preset {written}"), None)),
                Err(_) => Err(e),
            };
        }
    };
    let lower = path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".gguf") {
        let desc = ModelDescriptor::from_gguf(&path)?;
        let header = lora_memory::gguf::read_header(&path)?;
        let q = header
            .tensors
            .iter()
            .find(|t| t.name.ends_with("attn_q.weight"))
            .and_then(|t| match t.ggml_type.id() {
                2 => Some(BaseDtype::Q4_0),
                3 => Some(BaseDtype::Q4_1),
                8 => Some(BaseDtype::Q8_0),
                1 => Some(BaseDtype::F16),
                30 => Some(BaseDtype::Bf16),
                0 => Some(BaseDtype::F32),
                _ => None,
            });
        Ok((desc, path.display().to_string(), q))
    } else if path.is_dir() && path.join("config.json").is_file() && !has_safetensors(&path) {
        Ok((
            ModelDescriptor::from_hf_config_json(path.join("config.json"))?,
            path.display().to_string(),
            None,
        ))
    } else if lower.ends_with("config.json") {
        Ok((
            ModelDescriptor::from_hf_config_json(&path)?,
            path.display().to_string(),
            None,
        ))
    } else {
        Ok((
            ModelDescriptor::from_safetensors(&path)?,
            path.display().to_string(),
            None,
        ))
    }
}

fn has_safetensors(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        })
        .unwrap_or(false)
}

/// Plans a run: header → settings → estimate → budget check → (auto_fit) `fit()`.
///
/// With `memory.auto_fit` and a budget, the returned plan carries the fitted settings and the
/// changes; `cfg` is not changed ([`Plan::apply_to`] writes them into a config).
///
/// # Errors
/// Config / header / budget errors. Not fitting is *not* an error here (see [`Plan::fits`]).
pub fn plan(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
    override_budget: Option<Budget>,
    cuda: bool,
) -> Result<Plan> {
    let (desc, model_source, file_quant) = read_descriptor(cfg, config_dir)?;
    let (settings, mut notes) = settings_for(cfg, file_quant, cuda);
    notes.extend(cfg.notes());
    let budget = budget_for(cfg, override_budget)?;
    let estimate = lora_memory::estimate(&desc, &settings)?;
    let mut plan = Plan {
        model: desc.name().to_string(),
        model_source,
        settings,
        fits: budget.as_ref().map(|b| estimate.peak <= b.bytes),
        estimate,
        budget,
        changes: Vec::new(),
        notes,
        suggestion: Vec::new(),
    };
    if !cfg.memory.auto_fit
        && let Some(b) = plan.budget.clone()
        && plan.fits == Some(false)
    {
        match lora_memory::fit(&desc, &plan.settings, b.bytes) {
            Ok(f) => plan.suggestion = f.changes,
            Err(FitError::DoesNotFit { smallest_peak, .. }) => plan.notes.push(format!(
                "nothing on the fitting ladder (micro-batch, precision, checkpointing, optimizer, rank, quantized base, sequence length) fits this budget; the smallest peak reachable is {smallest_peak}"
            )),
            Err(_) => {}
        }
    }
    if cfg.memory.auto_fit
        && let Some(b) = plan.budget.clone()
        && plan.fits == Some(false)
    {
        match lora_memory::fit(&desc, &plan.settings, b.bytes) {
            Ok(f) => {
                plan.fits = Some(f.estimate.peak <= b.bytes);
                plan.settings = f.settings;
                plan.estimate = f.estimate;
                plan.changes = f.changes;
            }
            Err(FitError::DoesNotFit {
                smallest_peak,
                changes,
                ..
            }) => {
                plan.notes.push(format!(
                    "auto_fit: nothing on the ladder fits; the smallest peak reached is {smallest_peak} after {} changes",
                    changes.len()
                ));
            }
            Err(FitError::Estimate(e)) => return Err(e.into()),
            Err(other) => return Err(JobError::Fit(other)),
        }
    }
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

/// Held-out evaluation of the model.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct EvalResult {
    /// Mean next-token NLL (nats).
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Tokens scored.
    pub tokens: usize,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The plan it started with.
    pub plan: Plan,
    /// Optimizer steps done.
    pub steps: u64,
    /// Training tokens seen (non-padding).
    pub tokens: u64,
    /// Seconds spent in the training steps.
    pub train_seconds: f64,
    /// Seconds for the whole run.
    pub total_seconds: f64,
    /// `(step, loss)` per logged step.
    pub losses: Vec<(u64, f64)>,
    /// Held-out evaluation before training.
    pub eval_before: Option<EvalResult>,
    /// Held-out evaluation after training.
    pub eval_after: Option<EvalResult>,
    /// Sample generation before training (greedy).
    pub sample_before: Option<String>,
    /// Sample generation after training (greedy).
    pub sample_after: Option<String>,
    /// Measured memory.
    pub memory: MeasuredMemory,
    /// Files written (adapters, summary).
    pub outputs: Vec<PathBuf>,
}

impl RunSummary {
    /// A human-readable summary.
    pub fn report(&self) -> String {
        let mut out = String::new();
        out += &format!(
            "summary: {} optimizer steps, {} tokens in {:.1} s of training ({:.0} tokens/s), {:.1} s in all\n",
            self.steps,
            self.tokens,
            self.train_seconds,
            self.tokens as f64 / self.train_seconds.max(1e-9),
            self.total_seconds
        );
        if let (Some(b), Some(a)) = (self.eval_before, self.eval_after) {
            out += &format!(
                "held-out perplexity: {:.3} → {:.3} ({:+.1}%), mean NLL {:.4} → {:.4} over {} tokens\n",
                b.perplexity,
                a.perplexity,
                100.0 * (a.perplexity / b.perplexity - 1.0),
                b.mean_nll,
                a.mean_nll,
                a.tokens
            );
        }
        if let Some(s) = &self.sample_before {
            out += &format!("sample before: {s:?}\n");
        }
        if let Some(s) = &self.sample_after {
            out += &format!("sample after:  {s:?}\n");
        }
        if self.losses.is_empty() {
            out += "memory: no training step ran in this process; nothing measured\n";
            for o in &self.outputs {
                out += &format!("wrote {}\n", o.display());
            }
            return out;
        }
        let e = &self.plan.estimate;
        let m = &self.memory;
        let pct = |pred: u64, meas: u64| 100.0 * (pred as f64 - meas as f64) / (meas.max(1) as f64);
        out += &format!(
            "memory (CPU): step RSS delta measured {} vs predicted {} ({:+.1}%)\n",
            lora_memory::Bytes(m.rss_step_delta),
            e.step_delta,
            pct(e.step_delta.0, m.rss_step_delta)
        );
        out += &format!(
            "              tensor peak (counting allocator) {} vs predicted allocated peak {} ({:+.1}%)\n",
            lora_memory::Bytes(m.tensor_peak),
            e.peak_allocated,
            pct(e.peak_allocated.0, m.tensor_peak)
        );
        out += &format!(
            "              process peak RSS {} vs predicted process peak {} ({:+.1}%)\n",
            lora_memory::Bytes(m.rss_peak_process.max(m.rss_peak_steps)),
            e.peak_process,
            pct(e.peak_process.0, m.rss_peak_process.max(m.rss_peak_steps))
        );
        for o in &self.outputs {
            out += &format!("wrote {}\n", o.display());
        }
        out
    }
}

/// Checks plain training text before the model loads: not empty, and (with
/// `data.eval_fraction` > 0 and no `data.eval_file`) a held-out tail that is not empty either.
///
/// # Errors
/// [`JobError::Input`] naming the file and what to do.
fn check_plain_text(cfg: &TrainConfig, path: &Path, text: &str) -> Result<()> {
    if text.trim().is_empty() {
        return Err(JobError::Input(format!(
            "data.train_data_dir {}: {}; point data.train_data_dir at a UTF-8 text file, or a \
             folder of .txt files, with the text to train on",
            path.display(),
            if path.is_dir() {
                "its .txt files hold no text"
            } else {
                "the file holds no text"
            }
        )));
    }
    if cfg.data.eval_file.is_none() && cfg.data.eval_fraction > 0.0 {
        let (_, held) = split_tail(text, cfg.data.eval_fraction);
        if held.trim().is_empty() {
            return Err(JobError::Input(format!(
                "data.train_data_dir {}: the held-out split (the last {}% of its {} bytes, from a \
                 line start) is empty; use more text (several lines), set data.eval_fraction: 0, or \
                 give data.eval_file",
                path.display(),
                100.0 * cfg.data.eval_fraction,
                text.len()
            )));
        }
    }
    Ok(())
}

/// When `out_dir/summary.json` says the run ended and exported at `step`, the summary of that
/// run (what a `--resume` of a finished run returns: nothing left to do).
fn finished_run(out_dir: &Path, step: u64, plan: Plan) -> Option<RunSummary> {
    let text = std::fs::read_to_string(out_dir.join("summary.json")).ok()?;
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    if v["steps"].as_u64() != Some(step) {
        return None;
    }
    let outputs = v["outputs"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_str().map(PathBuf::from))
                .collect()
        })
        .unwrap_or_default();
    Some(RunSummary {
        plan,
        steps: step,
        tokens: v["tokens"].as_u64().unwrap_or(0),
        train_seconds: 0.0,
        total_seconds: 0.0,
        losses: Vec::new(),
        eval_before: None,
        eval_after: None,
        sample_before: None,
        sample_after: None,
        memory: MeasuredMemory::default(),
        outputs,
    })
}

fn already_finished(step: u64, out_dir: &Path) -> String {
    format!(
        "run already finished at step {step}; nothing to do (its adapter and summary.json are in \
         {}). To train further, raise train.max_steps (or train.epochs) and --resume again",
        out_dir.display()
    )
}

/// Writes a report to stdout, turning a failed write (a full disk) into an error instead of
/// `print!`'s panic.
fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut so = std::io::stdout().lock();
    so.write_all(text.as_bytes())
        .and_then(|()| so.flush())
        .during("writing to stdout")
}

/// Reads the training text: one file, or every `.txt` file of a folder (sorted), cut to
/// `max_bytes` at a character boundary.
fn read_text(path: &Path, max_bytes: Option<u64>) -> Result<(String, Vec<PathBuf>)> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut v: Vec<PathBuf> = std::fs::read_dir(path)
            .during(format!("reading folder {}", path.display()))?
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "txt"))
            .collect();
        v.sort();
        v
    } else {
        vec![path.to_path_buf()]
    };
    let mut text = String::new();
    for f in &files {
        let bytes = std::fs::read(f).during(format!("reading {}", f.display()))?;
        let t = String::from_utf8(bytes).map_err(|e| {
            JobError::Config(crate::config::ConfigError::InvalidValue {
                key: "data.train_data_dir".into(),
                value: format!("{:?}", f.display().to_string()),
                expected: format!(
                    "UTF-8 text, but byte {} of {} is not valid UTF-8; convert the file \
                     (e.g. `iconv -f latin1 -t utf-8 IN > OUT`) or remove it from the folder",
                    e.utf8_error().valid_up_to(),
                    f.display()
                ),
            })
        })?;
        text.push_str(&t);
        if !text.ends_with('\n') {
            text.push('\n');
        }
        if max_bytes.is_some_and(|m| text.len() as u64 >= m) {
            break;
        }
    }
    if let Some(m) = max_bytes {
        let mut cut = (m as usize).min(text.len());
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
    }
    Ok((text, files))
}

/// Splits `text` into (train, held-out): the last `fraction` of it, starting at a line boundary.
pub fn split_tail(text: &str, fraction: f64) -> (&str, &str) {
    if fraction <= 0.0 {
        return (text, "");
    }
    let mut at = ((1.0 - fraction) * text.len() as f64) as usize;
    while at < text.len() && !text.is_char_boundary(at) {
        at += 1;
    }
    let at = text[at..]
        .find('\n')
        .map(|i| at + i + 1)
        .unwrap_or(at)
        .min(text.len());
    (&text[..at], &text[at..])
}

fn evaluate(
    model: &lora_models::llama::Llama,
    ids: &[i64],
    seq_len: usize,
) -> Result<Option<EvalResult>> {
    if ids.len() < 2 {
        return Ok(None);
    }
    let opts = lora_models::llama::PerplexityOptions {
        max_length: seq_len,
        stride: seq_len,
    };
    let r = model
        .perplexity_ids(ids, &opts)
        .during("held-out perplexity")?;
    Ok(Some(EvalResult {
        mean_nll: r.mean_nll,
        perplexity: r.perplexity,
        tokens: r.tokens_scored,
    }))
}

fn sample(
    model: &lora_models::llama::Llama,
    tok: &lora_models::tokenizer::Tokenizer,
    prompt: &str,
    max_new: u32,
) -> Result<String> {
    let ids = tok
        .encode(prompt, false)
        .during("tokenizing the sample prompt")?;
    let opts = lora_models::llama::GenerateOptions {
        max_new_tokens: max_new as usize,
        ..Default::default()
    };
    let g = model.generate(&ids, &opts).during("sample generation")?;
    tok.decode(&g.tokens, true).during("decoding the sample")
}

/// Loads a LLaMA-family base and its tokenizer from a GGUF file or an HF folder.
///
/// # Errors
/// [`JobError::Input`] for a damaged file or one this tool does not read (with what to do);
/// [`JobError::Model`] naming the file for other loader errors (out of memory, …).
pub fn load_base(
    path: &Path,
    weights: BaseWeights,
    dtype: Dtype,
    device: tch::Device,
) -> Result<(lora_models::llama::Llama, lora_models::tokenizer::Tokenizer)> {
    use lora_models::llama::{Llama, WeightMode};
    let kind = match dtype {
        Dtype::F32 => tch::Kind::Float,
        Dtype::Bf16 => tch::Kind::BFloat16,
        Dtype::F16 => tch::Kind::Half,
    };
    let mode = match weights {
        BaseWeights::Dense => WeightMode::Dense(kind),
        BaseWeights::Quantized => WeightMode::KeepQuantized,
    };
    let ctx = format!("loading {}", path.display());
    // A malformed file is bad input (exit 2 in the CLI), named with what to do; a libtorch
    // failure while loading (out of memory, …) stays a runtime error.
    let load_err = |ctx: &str| {
        let ctx = ctx.to_string();
        move |e: lora_models::Error| {
            use lora_models::Error as M;
            match e {
                M::Gguf { .. }
                | M::Safetensors { .. }
                | M::Metadata { .. }
                | M::MissingTensor { .. }
                | M::Shape { .. }
                | M::Config { .. }
                | M::Unsupported { .. } => JobError::Input(format!(
                    "{e}; the file is damaged (a truncated download?) or not a model this \
                     tool reads — check its size and checksum, or download it again"
                )),
                other => JobError::Model {
                    during: ctx.clone(),
                    source: other,
                },
            }
        }
    };
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        let model = Llama::from_gguf(path, mode, device).map_err(load_err(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer_from_gguf(path).map_err(load_err(&ctx))?;
        Ok((model, tok))
    } else {
        let model = Llama::from_safetensors(path, mode, device).map_err(load_err(&ctx))?;
        let tok = lora_models::tokenizer::load_tokenizer(path.join("tokenizer.json"))
            .map_err(load_err(&ctx))?;
        Ok((model, tok))
    }
}

/// The causal-LM [`crate::engine::TrainStep`]: a LLaMA-family model with LoRA adapters and
/// packed text batches; loss = mean next-token NLL over labels ≠ −100 ([`lora_models::llama::Llama::loss`]).
pub struct LlamaTask<'a> {
    /// The model (adapters injected).
    pub model: &'a lora_models::llama::Llama,
    /// Adapter tensors by VarStore name (`<module>.lora_A.default.weight`, …), sorted.
    pub named: Vec<(String, tch::Tensor)>,
    /// LoRA+ ratio for the B matrices, if any.
    pub loraplus_lr_ratio: Option<f64>,
}

fn model_err(e: lora_models::Error) -> crate::engine::TrainError {
    match e {
        lora_models::Error::Torch(t) => crate::engine::TrainError::Torch(t),
        other => crate::engine::TrainError::App(other.to_string()),
    }
}

impl crate::engine::TrainStep for LlamaTask<'_> {
    type Batch = lora_data::text::TextBatch;

    fn loss(&mut self, b: &Self::Batch, train: bool) -> crate::engine::Result<tch::Tensor> {
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss(&ids, &labels, Some(&mask), Some(&pos), train)
            .map_err(model_err)
    }

    /// With gradient checkpointing on, the model recomputes each decoder layer during backward
    /// ([`Llama::loss_backward`](lora_models::llama::Llama::loss_backward)); otherwise the
    /// trainer's plain path runs.
    fn loss_backward(
        &mut self,
        b: &Self::Batch,
        scale: f64,
    ) -> crate::engine::Result<Option<tch::Tensor>> {
        if !self.model.gradient_checkpointing() {
            return Ok(None);
        }
        let d = self.model.device();
        let ids = b.input_ids.f_to_device(d)?;
        let labels = b.labels.f_to_device(d)?;
        let mask = b.attention_mask.f_to_device(d)?;
        let pos = b.position_ids.f_to_device(d)?;
        self.model
            .loss_backward(&ids, &labels, Some(&mask), Some(&pos), true, scale)
            .map(Some)
            .map_err(model_err)
    }

    fn named_trainable(&self) -> Vec<(String, tch::Tensor)> {
        self.named
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn param_groups(&self) -> Vec<crate::engine::optim::ParamGroup> {
        match self.loraplus_lr_ratio {
            Some(r) => crate::engine::optim::lora_plus_groups(self.named_trainable(), r),
            None => vec![crate::engine::optim::ParamGroup::new(
                "adapters",
                self.named.iter().map(|(_, t)| t.shallow_clone()).collect(),
            )],
        }
    }

    fn micro_batch_len(&self, b: &Self::Batch) -> usize {
        b.input_ids.size().first().copied().unwrap_or(0).max(0) as usize
    }

    fn split_batch(
        &self,
        b: &Self::Batch,
        parts: usize,
    ) -> crate::engine::Result<Vec<Self::Batch>> {
        let n = parts.max(1) as i64;
        let ids = b.input_ids.f_chunk(n, 0)?;
        let labels = b.labels.f_chunk(n, 0)?;
        let mask = b.attention_mask.f_chunk(n, 0)?;
        let pos = b.position_ids.f_chunk(n, 0)?;
        let docs = match &b.doc_ids {
            Some(t) => Some(t.f_chunk(n, 0)?),
            None => None,
        };
        let mut out = Vec::new();
        for i in 0..ids.len() {
            out.push(lora_data::text::TextBatch {
                input_ids: ids[i].shallow_clone(),
                labels: labels[i].shallow_clone(),
                attention_mask: mask[i].shallow_clone(),
                position_ids: pos[i].shallow_clone(),
                doc_ids: docs.as_ref().map(|d| d[i].shallow_clone()),
            });
        }
        Ok(out)
    }

    fn batch_tokens(&self, b: &Self::Batch) -> u64 {
        b.attention_mask
            .f_sum(tch::Kind::Int64)
            .and_then(|t| t.f_int64_value(&[]))
            .unwrap_or(0)
            .max(0) as u64
    }
}

/// The trainer's batch source over lora-data's text loader: the loader's seeded per-epoch plan,
/// batches built in the training thread; the position (epoch, batch index) is checkpointed.
pub struct TextSource {
    loader: lora_data::loader::Loader<lora_data::text::TextDataset, lora_data::text::TextCollate>,
    collate: lora_data::text::TextCollate,
    plan: Vec<Vec<usize>>,
    epoch: u64,
    next: usize,
}

impl TextSource {
    /// Wraps a loader.
    pub fn new(
        loader: lora_data::loader::Loader<
            lora_data::text::TextDataset,
            lora_data::text::TextCollate,
        >,
    ) -> Self {
        let collate = loader.dataset().collate();
        TextSource {
            loader,
            collate,
            plan: Vec::new(),
            epoch: 0,
            next: 0,
        }
    }
}

fn data_err(e: lora_data::Error) -> crate::engine::TrainError {
    crate::engine::TrainError::App(format!("data: {e}"))
}

impl crate::engine::BatchSource<lora_data::text::TextBatch> for TextSource {
    fn start_epoch(&mut self, epoch: u64) -> crate::engine::Result<()> {
        self.plan = self.loader.plan(epoch);
        self.epoch = epoch;
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> crate::engine::Result<Option<lora_data::text::TextBatch>> {
        use lora_data::loader::{Collate, Dataset};
        let Some(idx) = self.plan.get(self.next) else {
            return Ok(None);
        };
        let items = idx
            .iter()
            .map(|&i| self.loader.dataset().get(i))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(data_err)?;
        self.next += 1;
        self.collate.collate(items).map(Some).map_err(data_err)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.loader.batches_per_epoch() as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({"epoch": self.epoch, "next": self.next, "rows": lora_data::loader::Dataset::len(self.loader.dataset())})
    }

    fn load_state(&mut self, state: &serde_json::Value) -> crate::engine::Result<()> {
        let bad = |m: &str| crate::engine::TrainError::State {
            what: "loader position".into(),
            message: m.into(),
        };
        let rows = state["rows"].as_u64().ok_or_else(|| bad("no row count"))?;
        if rows != lora_data::loader::Dataset::len(self.loader.dataset()) as u64 {
            return Err(bad(&format!(
                "the checkpoint was taken over {rows} rows, this dataset has {}; resume with the same data and seq_len",
                lora_data::loader::Dataset::len(self.loader.dataset())
            )));
        }
        let epoch = state["epoch"].as_u64().ok_or_else(|| bad("no epoch"))?;
        let next = state["next"]
            .as_u64()
            .ok_or_else(|| bad("no batch index"))? as usize;
        self.start_epoch(epoch)?;
        self.next = next.min(self.plan.len());
        Ok(())
    }
}

/// Runs the causal-LM job: plan (refusing a run predicted not to fit unless forced) → load →
/// inject → data → train → export → summary.
///
/// # Errors
/// [`JobError::DoesNotFit`] before loading anything; config, file and runtime errors.
pub fn run(cfg: TrainConfig, opts: &RunOptions) -> Result<RunSummary> {
    run_with(cfg, opts, Vec::new())
}

/// [`run`] with the app's own engine callbacks (progress of its own, early stopping, …), called
/// after the job's progress bar and metrics logger at every step, epoch and checkpoint. A
/// callback returning [`Control::Stop`](crate::engine::Control::Stop) ends training early; the
/// adapter is still exported and the summary says how many steps ran.
///
/// # Errors
/// As [`run`]; an error a callback returns stops the run with that error.
pub fn run_with(
    mut cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn crate::engine::Callback>>,
) -> Result<RunSummary> {
    use lora_data::loader::{Loader, LoaderConfig};
    use lora_data::text::{TextConfig, TextDataset, TextFormat};
    let t_start = std::time::Instant::now();
    let say = |s: &str| {
        if opts.verbose {
            eprintln!("[{:6.1} s] {s}", t_start.elapsed().as_secs_f64());
        }
    };
    // Count tensor bytes from the start so the weights are in the allocator peak.
    let _ = lora_core::sys::install_counting_cpu_allocator();
    if let Some(n) = cfg.system.num_threads {
        tch::set_num_threads(n as i32);
    }
    check_device(&cfg)?;
    let cuda = match cfg.system.device.as_str() {
        "cpu" => false,
        "auto" => tch::Cuda::is_available(),
        _ => true,
    };
    let device = match cfg.system.device.as_str() {
        "cpu" => tch::Device::Cpu,
        "auto" => tch::Device::cuda_if_available(),
        d => tch::Device::Cuda(
            d.strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .unwrap_or(0),
        ),
    };

    // 1–3. plan
    let plan = plan(&cfg, opts.config_dir.as_deref(), None, cuda)?;
    plan.apply_to(&mut cfg);
    if opts.verbose {
        write_stdout(&plan.report())?;
    }
    if plan.fits == Some(false) {
        let b = plan
            .budget
            .clone()
            .map(|b| (b.bytes, budget_source(&b)))
            .unwrap_or_default();
        if !(opts.force || cfg.memory.force) {
            return Err(JobError::DoesNotFit {
                peak: plan.estimate.peak,
                budget: b.0,
                source_desc: b.1,
            });
        }
        say("warning: predicted not to fit; starting anyway (forced)");
    }
    crate::job::check_fits_this_machine(&plan, cuda, opts.force || cfg.memory.force)?;

    // CPU: freed tensors go back to the OS so RSS follows the plan (see MemorySection).
    if !cuda
        && cfg.memory.cpu_return_freed
        && std::env::var_os("MALLOC_MMAP_THRESHOLD_").is_none()
        && lora_core::sys::set_malloc_mmap_threshold(lora_core::sys::RETURN_FREED_MMAP_THRESHOLD)
    {
        say("CPU allocator: blocks ≥ 128 KiB are returned to the OS when freed");
    }

    let mut lock = check_output_dir(&cfg, opts)?;
    let out_dir = PathBuf::from(&cfg.train.output_dir);
    let resume_from = resume_checkpoint(&cfg, opts)?;
    if let Some((path, counters)) = &resume_from {
        say(&format!(
            "resuming from {} (step {}{})",
            path.display(),
            counters.step,
            cfg.train
                .max_steps
                .map(|m| format!(" of {m}"))
                .unwrap_or_default()
        ));
        if let Some(m) = cfg.train.max_steps
            && counters.step >= m
            && let Some(done) = finished_run(&out_dir, counters.step, plan.clone())
        {
            say(&already_finished(counters.step, &out_dir));
            return Ok(done);
        }
    }

    // Data first: a missing or unreadable (non-UTF-8) data file fails before the model loads.
    let data_written =
        cfg.data
            .train_data_dir
            .clone()
            .ok_or_else(|| crate::config::ConfigError::Missing {
                key: "data.train_data_dir".into(),
                hint: "set it to a text file or a folder of .txt files".into(),
            })?;
    let data_path = resolve_path(
        "data.train_data_dir",
        &data_written,
        opts.config_dir.as_deref(),
    )?;
    let mut plain_text = if matches!(cfg.data.format, crate::config::DataFormat::Text) {
        let (text, files) = read_text(&data_path, cfg.data.max_bytes)?;
        check_plain_text(&cfg, &data_path, &text)?;
        Some((text, files))
    } else {
        None
    };

    // 4. load, inject
    let base_written = cfg.base_model()?.to_string();
    let base_path = resolve_path(
        "model.base_model",
        &base_written,
        opts.config_dir.as_deref(),
    )?;
    say(&format!(
        "loading {} ({:?}, {:?}) on {device:?}",
        base_path.display(),
        cfg.model.weights,
        cfg.model.dtype
    ));
    let (mut model, tok) = load_base(&base_path, cfg.model.weights, cfg.model.dtype, device)?;
    let interrupted_before_training = || JobError::Interrupted {
        step: resume_from.as_ref().map(|r| r.1.step).unwrap_or(0),
        checkpoint: resume_from.as_ref().map(|r| r.0.clone()),
    };
    if crate::engine::stop_requested() {
        return Err(interrupted_before_training());
    }
    model.set_gradient_checkpointing(cfg.train.gradient_checkpointing);
    tch::manual_seed(cfg.system.seed as i64);
    let lcfg = lora_config(&cfg, &base_written)?;
    let vs = tch::nn::VarStore::new(device);
    let report = lora_core::inject::inject(&mut model, &lcfg, "default", &vs.root())
        .during("injecting LoRA")?;
    say(&format!(
        "LoRA r{} α{} on {} modules: {} trainable of {} parameters ({:.3}%)",
        cfg.lora.rank,
        cfg.lora.alpha,
        report.modules.len(),
        report.trainable_params,
        report.all_params,
        report.trainable_percent()
    ));

    // data (read above, before the model)
    let seq_len = cfg.data.seq_len as usize;
    let text_cfg = TextConfig {
        format: match cfg.data.format {
            crate::config::DataFormat::Text => TextFormat::Plain,
            crate::config::DataFormat::Jsonl => TextFormat::Jsonl {
                text_field: "text".into(),
            },
            crate::config::DataFormat::Alpaca => TextFormat::Alpaca,
            crate::config::DataFormat::Chat => TextFormat::Conversations,
            crate::config::DataFormat::Images => {
                return Err(crate::config::ConfigError::InvalidValue {
                    key: "data.format".into(),
                    value: "\"images\"".into(),
                    expected: "a text format (text, jsonl, alpaca, chat) for the causal-LM job"
                        .into(),
                }
                .into());
            }
        },
        seq_len,
        packing: true,
        eos_token_id: tok.eos_id,
        pad_token_id: tok.pad_id.or(tok.eos_id).unwrap_or(0),
        seed: cfg.system.seed,
        ..TextConfig::default()
    };
    let (train_ds, eval_ids, data_stats) = if matches!(text_cfg.format, TextFormat::Plain) {
        let (text, files) = match plain_text.take() {
            Some(t) => t,
            None => read_text(&data_path, cfg.data.max_bytes)?,
        };
        let (train_text, mut held) = split_tail(
            &text,
            if cfg.data.eval_file.is_some() {
                0.0
            } else {
                cfg.data.eval_fraction
            },
        );
        let eval_text;
        if let Some(e) = &cfg.data.eval_file {
            let p = resolve_path("data.eval_file", e, opts.config_dir.as_deref())?;
            eval_text = std::fs::read_to_string(&p).during(format!("reading {}", p.display()))?;
            held = &eval_text;
        }
        let ds = TextDataset::from_texts(&[(&data_written, train_text)], tok.inner(), text_cfg)
            .during("building the text dataset")?;
        let eval_ids = if held.is_empty() {
            Vec::new()
        } else {
            tok.encode(held, false).during("tokenizing held-out text")?
        };
        let st = ds.stats();
        let stats = serde_json::json!({
            "files": files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>(),
            "train_bytes": train_text.len(),
            "eval_bytes": held.len(),
            "train_tokens": st.tokens,
            "rows": st.rows,
            "seq_len": seq_len,
            "eval_tokens": eval_ids.len(),
        });
        (ds, eval_ids, stats)
    } else {
        let full = TextDataset::from_files(&[&data_path], tok.inner(), text_cfg)
            .during("building the dataset")?;
        let (t, v) = full
            .split(cfg.data.eval_fraction, cfg.system.seed)
            .during("splitting the dataset")?;
        let eval_ids: Vec<i64> = v
            .documents()
            .iter()
            .flat_map(|d| d.ids.iter().copied())
            .collect();
        let st = t.stats();
        let stats = serde_json::json!({
            "files": [data_path.display().to_string()],
            "documents": st.documents, "train_tokens": st.tokens, "rows": st.rows,
            "seq_len": seq_len, "eval_tokens": eval_ids.len(),
        });
        (t, eval_ids, stats)
    };
    let rows = lora_data::loader::Dataset::len(&train_ds);
    let train_tokens = data_stats["train_tokens"].as_u64().unwrap_or(0);
    if train_tokens < 2 {
        return Err(JobError::Input(format!(
            "{}: the training text is empty ({train_tokens} tokens after the held-out split); \
             point data.train_data_dir at a file with text",
            data_path.display()
        )));
    }
    if cfg.data.eval_fraction > 0.0 && eval_ids.len() < 2 {
        return Err(JobError::Input(format!(
            "{}: the held-out split (data.eval_fraction {}) has {} tokens; use more text or set \
             data.eval_fraction: 0",
            data_path.display(),
            cfg.data.eval_fraction,
            eval_ids.len()
        )));
    }
    if rows == 0 {
        return Err(JobError::Input(format!(
            "{}: no training rows of {seq_len} tokens; use more text or a smaller data.seq_len",
            data_path.display()
        )));
    }
    let collate = train_ds.collate();
    let micro = cfg.train.batch_size as usize;
    let loader = Loader::new(
        train_ds,
        collate,
        LoaderConfig {
            batch_size: micro,
            shuffle: cfg.data_loader.shuffle,
            drop_last: false,
            seed: cfg.system.seed,
            num_workers: cfg.data_loader.num_workers as usize,
            prefetch_factor: cfg.data_loader.prefetch_factor.max(1) as usize,
            persistent_workers: cfg.data_loader.persistent_workers,
        },
    )
    .during("building the data loader")?;
    let accum = cfg.train.gradient_accumulation_steps.max(1) as usize;
    let per_epoch = loader.batches_per_epoch().div_ceil(accum) as u64;
    let total_steps = cfg
        .train
        .max_steps
        .unwrap_or(per_epoch * u64::from(cfg.train.epochs))
        .max(1);
    if cfg.train.max_steps.is_some() {
        // train.max_steps wins over train.epochs (HF Trainer `max_steps`, kohya
        // `max_train_steps`): run as many epochs as the steps need.
        let need = total_steps.div_ceil(per_epoch.max(1));
        cfg.train.epochs = u32::try_from(need)
            .unwrap_or(u32::MAX)
            .max(cfg.train.epochs);
    }
    let trainer_total = total_steps;
    let capped = if cfg.train.max_steps.is_some() && per_epoch > 0 && total_steps > per_epoch {
        format!(" ({} epochs)", total_steps.div_ceil(per_epoch))
    } else {
        String::new()
    };
    say(&format!(
        "data: {rows} rows of {seq_len} tokens, {} micro-batches of {micro} per epoch; {trainer_total} optimizer steps{capped} (gradient_accumulation_steps {accum}); {} held-out tokens",
        loader.batches_per_epoch(),
        eval_ids.len()
    ));

    // before
    if !eval_ids.is_empty() {
        say("evaluating held-out perplexity before training");
    }
    if let Some((_, counters)) = &resume_from
        && counters.step >= trainer_total
    {
        if let Some(done) = finished_run(&out_dir, counters.step, plan.clone()) {
            say(&already_finished(counters.step, &out_dir));
            return Ok(done);
        }
        say(&format!(
            "training already finished at step {} of {trainer_total}, but the run was not exported; evaluating and exporting",
            counters.step
        ));
    }
    let eval_before = evaluate(&model, &eval_ids, seq_len)?;
    if let Some(e) = eval_before {
        say(&format!(
            "held-out perplexity before: {:.3} ({} tokens)",
            e.perplexity, e.tokens
        ));
    }
    let sample_before = match &cfg.logging.sample_prompt {
        Some(p) => Some(sample(&model, &tok, p, cfg.logging.sample_max_new_tokens)?),
        None => None,
    };
    if crate::engine::stop_requested() {
        return Err(interrupted_before_training());
    }

    // 5. train (the engine's Trainer: accumulation, clipping, mixed precision, OOM back-off,
    // NaN policy, checkpoints, exact resume)
    std::fs::create_dir_all(&out_dir).during(format!("creating {}", out_dir.display()))?;
    if cfg.train.gradient_checkpointing {
        say("gradient checkpointing: each decoder layer is recomputed during backward");
    }
    let mut named: Vec<(String, tch::Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let mut task = LlamaTask {
        model: &model,
        named,
        loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
    };
    let mut source = TextSource::new(loader);
    let tcfg = trainer_config(&cfg, device, &out_dir, total_steps)?;
    let mut trainer: crate::engine::Trainer<LlamaTask<'_>> = crate::engine::Trainer::new(tcfg);
    #[cfg(feature = "progress")]
    if cfg.logging.progress && opts.verbose {
        trainer.add_callback(Box::new(
            crate::engine::progress::ProgressBar::new().every(cfg.logging.log_every_n_steps),
        ));
    }
    // a previous run in this folder: its files go aside now that this run really starts
    lock.set_aside_previous_run()?;
    let log_dir = cfg
        .logging
        .logging_dir
        .clone()
        .map(PathBuf::from)
        .unwrap_or_else(|| out_dir.join("logs"));
    // metrics.jsonl (appended on resume), TensorBoard event files when `logging.tensorboard`, and
    // loss.png at the end.
    trainer.add_callback(Box::new(
        crate::engine::metrics::MetricsLogger::new(&log_dir, cfg.logging.tensorboard)
            .during("the metrics log")?
            .with_every(cfg.logging.log_every_n_steps),
    ));
    for cb in callbacks {
        trainer.add_callback(cb);
    }
    let resume = match &resume_from {
        None => crate::engine::Resume::No,
        Some((dir, _)) => crate::engine::Resume::From(dir.clone()),
    };
    let (rss_before_steps, hwm_process) = proc_rss();
    let _ = reset_peak_rss();
    let _ = lora_core::sys::cpu_reset_peak();
    let t_train = std::time::Instant::now();
    let report = trainer
        .fit(&mut task, &mut source, resume)
        .map_err(|e| match e {
            crate::engine::TrainError::NonFinite { .. }
            | crate::engine::TrainError::OutOfMemory { .. } => JobError::Engine(e),
            other => JobError::Train {
                during: "training".into(),
                source: other,
            },
        })?;
    let step = report.steps;
    let tokens = report.tokens;
    let losses = report.losses.clone();
    if report.interrupted || crate::engine::stop_requested() {
        return Err(JobError::Interrupted {
            step: report.steps,
            checkpoint: report.last_checkpoint.clone(),
        });
    }
    if let Some(from) = report.resumed_from {
        say(&if report.steps > from {
            format!(
                "resumed at step {from}; trained steps {}–{}",
                from + 1,
                report.steps
            )
        } else {
            format!("resumed at step {from}; no steps were left to train")
        });
    }
    if report.oom_backoffs > 0 {
        say(&format!(
            "out-of-memory back-offs: {} (final micro-batch split {})",
            report.oom_backoffs, report.micro_batch_split
        ));
    }
    let train_seconds = t_train.elapsed().as_secs_f64();
    let (_, hwm_steps) = proc_rss();
    let tensor_peak = lora_core::sys::cpu_mem_stats()
        .map(|s| s.peak_bytes)
        .unwrap_or(0);
    let memory = MeasuredMemory {
        rss_before_steps,
        rss_peak_steps: hwm_steps,
        rss_step_delta: hwm_steps.saturating_sub(rss_before_steps),
        tensor_peak,
        rss_peak_process: hwm_process.max(hwm_steps),
    };

    // after
    if !eval_ids.is_empty() {
        say("evaluating held-out perplexity after training");
    }
    let eval_after = evaluate(&model, &eval_ids, seq_len)?;
    check_not_diverged(
        &report,
        "held-out loss",
        eval_after.as_ref().map(|a| a.mean_nll),
    )?;
    let sample_after = match &cfg.logging.sample_prompt {
        Some(p) => Some(sample(&model, &tok, p, cfg.logging.sample_max_new_tokens)?),
        None => None,
    };

    // 6. export
    let sha = if base_path.is_file() {
        Some(crate::export::sha256_file(&base_path).during("hashing the base model")?)
    } else {
        None
    };
    let meta = crate::export::metadata_for(
        &cfg,
        &crate::export::RunMetadata {
            base_model: base_written.clone(),
            base_model_sha256: sha,
            dataset: data_stats,
            steps: step,
            epochs: 1 + step.saturating_sub(1) / per_epoch.max(1),
        },
    );
    let kept = ExportAside::take(&cfg, opts)?;
    let mut outputs = crate::export::export_run(&mut model, "default", &lcfg, &cfg, meta, &out_dir)
        .during("exporting the adapter")?;
    kept.exported();
    let mut summary = RunSummary {
        plan,
        steps: step,
        tokens,
        train_seconds,
        total_seconds: 0.0,
        losses,
        eval_before,
        eval_after,
        sample_before,
        sample_after,
        memory,
        outputs: Vec::new(),
    };
    summary.total_seconds = t_start.elapsed().as_secs_f64();
    let summary_path = out_dir.join("summary.json");
    outputs.push(summary_path.clone());
    summary.outputs = outputs;
    let text = serde_json::to_string_pretty(&summary).during("serializing the summary")?;
    std::fs::write(&summary_path, text).during(format!("writing {}", summary_path.display()))?;
    if opts.verbose {
        write_stdout(&summary.report())?;
    }
    Ok(summary)
}

/// The causal-LM recipe: any model the other recipes do not recognise (LLaMA-family GGUF,
/// safetensors or `config.json`, or a lora-memory preset for planning).
#[derive(Debug, Clone, Copy)]
pub struct LlmRecipe;

impl crate::job::Recipe for LlmRecipe {
    fn name(&self) -> &'static str {
        "llm"
    }

    fn detect(&self, _cfg: &TrainConfig, _config_dir: Option<&Path>) -> bool {
        true
    }

    fn plan(
        &self,
        cfg: &TrainConfig,
        config_dir: Option<&Path>,
        budget: Option<Budget>,
        cuda: bool,
    ) -> Result<Plan> {
        plan(cfg, config_dir, budget, cuda)
    }

    fn train(&self, cfg: TrainConfig, opts: &RunOptions) -> Result<serde_json::Value> {
        let summary = run(cfg, opts)?;
        serde_json::to_value(&summary).during("serializing the summary")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preset_plan_against_a_small_gpu_does_not_fit_and_auto_fit_fixes_it() {
        let y = "model: {base_model: llama-2-7b, weights: dense, dtype: bf16}\ntrain: {batch_size: 8}\ndata: {seq_len: 2048}\nmemory: {gpu: RTX 3060}\n";
        let mut cfg = TrainConfig::from_yaml_str(y).unwrap();
        let p = plan(&mut cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(false), "{}", p.report());
        assert!(p.report().contains("DOES NOT FIT"));
        let mut cfg = TrainConfig::from_yaml_str(
            &format!("{y}memory: {{gpu: RTX 3060, auto_fit: true}}\n")
                .replace("memory: {gpu: RTX 3060}\n", ""),
        )
        .unwrap();
        let before = cfg.clone();
        let p = plan(&cfg, None, None, true).unwrap();
        assert_eq!(p.fits, Some(true), "{}", p.report());
        assert!(!p.changes.is_empty());
        assert!(p.estimate.peak.0 <= 12 << 30);
        assert_eq!(cfg, before, "planning leaves the config alone");
        p.apply_to(&mut cfg);
        // the config now carries the fitted settings
        assert_eq!(cfg.train.batch_size, p.settings.micro_batch);
        assert_eq!(
            u64::from(cfg.train.batch_size) * u64::from(cfg.train.gradient_accumulation_steps),
            8,
            "effective batch kept"
        );
    }

    #[test]
    fn a_cpu_run_with_no_budget_is_checked_against_this_machines_memory() {
        // Llama-2-7B in fp32 at 8 × 2048 tokens: far above any CPU machine this runs on
        let y = "model: {base_model: llama-2-7b, weights: dense}\ntrain: {batch_size: 8}\ndata: {seq_len: 2048}\nsystem: {device: cpu}\n";
        let cfg = TrainConfig::from_yaml_str(y).unwrap();
        let p = plan(&cfg, None, None, false).unwrap();
        assert_eq!(p.budget, None);
        let Some(avail) = crate::job::available_ram() else {
            return; // no /proc/meminfo
        };
        assert!(avail > 0);
        assert!(p.estimate.peak.0 > avail, "{} vs {avail}", p.estimate.peak);
        let e = crate::job::check_fits_this_machine(&p, false, false).unwrap_err();
        assert!(
            matches!(e, JobError::DoesNotFit { budget, peak, .. } if budget.0 > 0 && budget < peak),
            "{e}"
        );
        assert!(e.to_string().contains("MemAvailable"), "{e}");
        // forced, or on CUDA (the GPU's memory is not this machine's RAM), it starts
        crate::job::check_fits_this_machine(&p, false, true).unwrap();
        crate::job::check_fits_this_machine(&p, true, false).unwrap();
        // the demo-sized run fits
        let small = TrainConfig::from_yaml_str(
            "model: {base_model: smollm2-135m}\ntrain: {batch_size: 2}\ndata: {seq_len: 64}\n",
        )
        .unwrap();
        let p = plan(&small, None, None, false).unwrap();
        crate::job::check_fits_this_machine(&p, false, false).unwrap();
    }
}
