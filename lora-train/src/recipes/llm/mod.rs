//! The causal-LM job: plan → load → inject → train → export → summary.
//!
//! [`plan`] is pure (lora-memory only): it reads the model's header, turns the [`TrainConfig`]
//! into lora-memory [`Settings`](lora_memory::Settings), estimates the peak, checks it against the budget and, with
//! `memory.auto_fit`, applies lora-memory's `fit()`.

mod data;
mod eval;
mod task;

pub use data::*;
use eval::*;
pub use task::*;

use crate::config::{BaseWeights, Dtype, TrainConfig};
use crate::job::error::During;
use crate::job::sequence::{LoadedRun, RunContext, RunOutcome, RunSteps};
use crate::job::{
    JobError, MeasuredMemory, Plan, Result, RunOptions, budget_for, lora_config,
    resolve_base_model, resolve_path, settings_for,
};
use lora_memory::{BaseDtype, Budget, ModelDescriptor};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// How a GGUF base stores its weights (from the header). The default (nothing quantized) is
/// what a dense safetensors folder or `config.json` reads as: with `model.weights: quantized`
/// the plan then counts QLoRA's base, as `Llama::from_safetensors` loads it — layer linears NF4
/// with double quantization ([`settings_for`]), the head dense (`quantize_lm_head` off).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FileStorage {
    /// Storage type of the layer linears (`attn_q.weight`).
    pub layers: Option<BaseDtype>,
    /// The output head (`output.weight`, or the tied `token_embd.weight`) is block-quantized.
    pub head_quantized: bool,
    /// The head's block format when it is block-quantized (often wider than the layers': Q8_0
    /// or Q6_K beside Q4 layers).
    pub head: Option<BaseDtype>,
}

/// Reads the base model's header (no tensor data): GGUF, safetensors file/folder, `config.json`,
/// or a lora-memory preset name. Returns the descriptor, a source description, and how a GGUF
/// file stores its weights (default for the other formats).
///
/// # Errors
/// [`JobError::MissingFile`] when the path does not exist and is no preset; header errors.
pub fn read_descriptor(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<(ModelDescriptor, String, FileStorage)> {
    let written = cfg.base_model()?;
    let as_type = cfg.model.model_type.as_deref();
    let path = match resolve_base_model(written, config_dir) {
        Ok(p) => p,
        Err(e) => {
            return match ModelDescriptor::preset(written) {
                Ok(d) => Ok((d, format!("preset {written}"), FileStorage::default())),
                Err(_) => Err(e),
            };
        }
    };
    let lower = path.to_string_lossy().to_ascii_lowercase();
    if lower.ends_with(".gguf") {
        let desc = ModelDescriptor::from_gguf(&path)?;
        let header = lora_memory::gguf::read_header(&path)?;
        let type_of = |name: &str| {
            header
                .tensors
                .iter()
                .find(|t| t.name.ends_with(name))
                .map(|t| t.ggml_type)
        };
        // the top-level names exactly: `blk.N.attn_output.weight` also ends in "output.weight"
        let type_named = |name: &str| {
            header
                .tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.ggml_type)
        };
        let head = type_named("output.weight").or_else(|| type_named("token_embd.weight"));
        let storage = FileStorage {
            layers: type_of("attn_q.weight").and_then(BaseDtype::from_ggml),
            // blocks of more than one element: a quantized type
            head_quantized: head
                .and_then(|t| t.block_layout())
                .is_some_and(|(n, _)| n > 1),
            head: head
                .and_then(BaseDtype::from_ggml)
                .filter(|d| d.is_quantized()),
        };
        Ok((desc, path.display().to_string(), storage))
    } else if path.is_dir() && path.join("config.json").is_file() && !has_safetensors(&path) {
        Ok((
            hf_config(&path.join("config.json"), as_type)?,
            path.display().to_string(),
            FileStorage::default(),
        ))
    } else if lower.ends_with("config.json") {
        Ok((
            hf_config(&path, as_type)?,
            path.display().to_string(),
            FileStorage::default(),
        ))
    } else if path.is_dir() && !path.join("config.json").is_file() && !has_safetensors(&path) {
        // a folder that is not a model: say what is in it that could be
        let ggufs: Vec<String> = std::fs::read_dir(&path)
            .map(|rd| {
                rd.filter_map(|e| e.ok().map(|e| e.path()))
                    .filter(|p| {
                        p.extension()
                            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
                    })
                    .map(|p| p.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        let hint = match ggufs.as_slice() {
            [] => "give a .gguf file, a .safetensors file, a model folder with config.json, or a \
                   preset name"
                .to_string(),
            [one] => format!("it holds {one}: give that file"),
            many => format!("it holds {}: give one of those files", many.join(", ")),
        };
        Err(JobError::Input(format!(
            "model.base_model = {written:?}: the folder {} has no config.json and no \
             *.safetensors file, so it is not a model folder; {hint}",
            path.display()
        )))
    } else if path.is_file() && !lower.ends_with(".safetensors") {
        Err(JobError::Input(format!(
            "model.base_model = {written:?}: {} is not a model file this recipe reads; give a \
             .gguf file, a .safetensors file, a model folder with config.json, or a preset name",
            path.display()
        )))
    } else {
        let desc = match as_type {
            Some(t) => ModelDescriptor::from_safetensors_as(&path, t)?,
            None => ModelDescriptor::from_safetensors(&path)?,
        };
        let beside = if path.is_dir() {
            path.join("config.json")
        } else {
            path.with_file_name("config.json")
        };
        if beside.is_file() {
            loadable(&beside)?;
        }
        Ok((desc, path.display().to_string(), FileStorage::default()))
    }
}

/// The decoder's site names (`self_attn.q_proj`, …, `lm_head`) that `lora.target_modules` and
/// `lora.exclude_modules` select, matched against each site's module path in layer 0
/// (`model.layers.0.self_attn.q_proj`; `lm_head`) with the injection's matcher; and the list
/// entries that select nothing. A diffusion descriptor keeps the targets as written.
///
/// # Errors
/// An invalid regex; [`JobError::Input`] when nothing is selected, listing the layers.
fn decoder_targets(
    desc: &ModelDescriptor,
    cfg: &TrainConfig,
) -> Result<(Vec<String>, Vec<String>)> {
    use lora_core::config::{LoraConfig, TargetMatcher, TargetModules};
    let ModelDescriptor::Decoder(d) = desc else {
        return Ok((Vec::new(), Vec::new()));
    };
    let lora = LoraConfig {
        target_modules: Some(cfg.lora.target_modules.clone()),
        exclude_modules: cfg.lora.exclude_modules.clone(),
        ..LoraConfig::default()
    };
    let matcher = TargetMatcher::new(&lora).during("planning lora.target_modules")?;
    let path = |site: &str| {
        if site == "lm_head" {
            site.to_string()
        } else {
            format!("model.layers.0.{site}")
        }
    };
    let sites: Vec<String> = d.sites().into_iter().map(|x| x.name).collect();
    let chosen: Vec<String> = sites
        .iter()
        .filter(|x| matcher.matches(&path(x), true))
        .cloned()
        .collect();
    let unmatched = match &cfg.lora.target_modules {
        TargetModules::List(l) => l
            .iter()
            .filter(|e| {
                !sites
                    .iter()
                    .any(|x| *x == **e || path(x).ends_with(&format!(".{e}")) || path(x) == **e)
            })
            .cloned()
            .collect(),
        TargetModules::Regex(_) => Vec::new(),
    };
    if chosen.is_empty() {
        return Err(JobError::Input(format!(
            "lora.target_modules {} selects no layer of {}; its layers are {} (paths like model.layers.0.self_attn.q_proj)",
            cfg.lora.target_modules,
            desc.name(),
            sites.join(", ")
        )));
    }
    Ok((chosen, unmatched))
}

/// Reads a `config.json`, as `model.model_type` says when set.
fn hf_config(path: &Path, as_type: Option<&str>) -> Result<ModelDescriptor> {
    let desc = planner_config(path, as_type)?;
    loadable(path)?;
    Ok(desc)
}

/// What `train` would refuse when loading a `config.json`, refused when planning too: the
/// model loader's own check (architecture, activation, rope type).
fn loadable(config_json: &Path) -> Result<()> {
    lora_models::llama::LlamaConfig::from_hf_json(config_json)
        .map(|_| ())
        .during(format!(
            "{}: this recipe loads LLaMA-family decoders",
            config_json.display()
        ))
}

fn planner_config(path: &Path, as_type: Option<&str>) -> Result<ModelDescriptor> {
    match as_type {
        Some(t) => Ok(ModelDescriptor::from_hf_config_json_as(path, t)?),
        None => ModelDescriptor::from_hf_config_json(path).map_err(|e| match &e {
            lora_memory::Error::Config { key, .. } if key == "model_type" => JobError::Input(
                format!("{e}: set model.model_type in the run config (e.g. model_type: generic)"),
            ),
            _ => e.into(),
        }),
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
    let (desc, model_source, storage) = read_descriptor(cfg, config_dir)?;
    let (mut settings, mut notes) = settings_for(cfg, storage.layers, cuda);
    // the layers `lora.target_modules` / `exclude_modules` reach, matched as the injection
    // matches them (PEFT semantics: list entries, a regex over the whole module path)
    notes.retain(|n| !n.starts_with("lora.target_modules is a regex"));
    let (targets, unmatched) = decoder_targets(&desc, cfg)?;
    if !unmatched.is_empty() {
        notes.push(format!(
            "lora.target_modules entries {unmatched:?} match no layer of {}; LoRA goes on the others",
            desc.name()
        ));
    }
    settings.lora.target_modules = targets;
    // a quantized base keeps a quantized head quantized (GGUF files quantize it); a dense
    // safetensors base quantized to NF4 at load keeps its head dense, as bitsandbytes does
    settings.quantize_lm_head =
        cfg.model.weights == BaseWeights::Quantized && storage.head_quantized;
    settings.lm_head_dtype = storage.head.filter(|_| settings.quantize_lm_head);
    notes.extend(cfg.notes());
    notes.extend(cfg.image_only_settings().into_iter().map(|(key, value)| {
        format!("`{key}` = {value}: applies to image models (SD 1.x, SDXL, FLUX.1) only; this language-model run does not use it")
    }));
    let (budget, budget_note) = budget_for(cfg, override_budget)?;
    notes.extend(budget_note);
    let estimate = lora_memory::estimate(&desc, &settings)?;
    let mut plan = Plan::new(desc.clone(), model_source, settings, estimate, budget);
    plan.notes = notes;
    plan.fit_to_budget(
        cfg.memory.auto_fit,
        "micro-batch, precision, checkpointing, optimizer, rank, quantized base, sequence length",
    )?;
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
        let pct = crate::job::run::vs_plan;
        out += &format!(
            "memory (CPU): step RSS delta measured {} vs predicted {} ({})\n",
            lora_memory::Bytes(m.rss_step_delta),
            e.step_delta,
            pct(e.step_delta.0, m.rss_step_delta)
        );
        out += &format!(
            "              tensor peak (counting allocator) {} vs predicted allocated peak {} ({})\n",
            lora_memory::Bytes(m.tensor_peak),
            e.peak_allocated,
            pct(e.peak_allocated.0, m.tensor_peak)
        );
        out += &format!(
            "              process peak RSS {} vs predicted process peak {} ({})\n",
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

/// Runs the causal-LM job in the one sequence of [`crate::job::sequence`]: plan (refusing a run
/// predicted not to fit unless forced) → data → load → inject → train → export → summary.
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
    cfg: TrainConfig,
    opts: &RunOptions,
    callbacks: Vec<Box<dyn crate::engine::Callback>>,
) -> Result<RunSummary> {
    crate::job::sequence::run(LlmSteps::default(), cfg, opts, callbacks)
}

/// The causal-LM run before its model loads: the training data as read.
#[derive(Debug, Default)]
struct LlmSteps {
    /// `data.train_data_dir` as written and resolved.
    data: Option<(String, PathBuf)>,
    /// Plain text (`data.format: text`): the text and the files it came from.
    plain_text: Option<(String, Vec<PathBuf>)>,
}

/// Says which kernel computes causal attention on the CPU (`LORA_CPU_ATTENTION`), with a
/// warning for a value it ignores.
fn say_cpu_attention(ctx: &RunContext<'_>) {
    ctx.say_cpu_kernel(
        "causal attention",
        "LORA_CPU_ATTENTION",
        &lora_core::sys::cpu_attention_request(),
        lora_core::sys::causal_attention_available(),
        (
            lora_core::sys::cpu_causal_attention_by_lsdk(),
            "lora-core's AVX2 kernel where it applies (f32, up to 512 positions, a (sequence, kv head) pair per thread), libtorch's flash kernel otherwise",
            "libtorch's flash kernel",
        ),
    );
}

impl RunSteps for LlmSteps {
    type Loaded = LlmRun;
    type Summary = RunSummary;

    fn plan(&self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<Option<Plan>> {
        plan(cfg, ctx.config_dir(), None, ctx.cuda).map(Some)
    }

    fn finished(ctx: &RunContext<'_>, step: u64, plan: Option<&Plan>) -> Option<RunSummary> {
        finished_run(&ctx.out_dir, step, plan?.clone())
    }

    fn read_data(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<()> {
        if !ctx.cuda {
            say_cpu_attention(ctx);
        }
        let written =
            cfg.data
                .train_data_dir
                .clone()
                .ok_or_else(|| crate::config::ConfigError::Missing {
                    key: "data.train_data_dir".into(),
                    hint: "set it to a text file or a folder of .txt files".into(),
                })?;
        let path = resolve_path("data.train_data_dir", &written, ctx.config_dir())?;
        if matches!(cfg.data.format, crate::config::DataFormat::Text) {
            let (text, files) = read_text(&path, cfg.data.max_bytes)?;
            check_plain_text(cfg, &path, &text)?;
            self.plain_text = Some((text, files));
        }
        self.data = Some((written, path));
        Ok(())
    }

    fn load(
        self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        vs: &tch::nn::VarStore,
    ) -> Result<LlmRun> {
        let (data_written, data_path) = self
            .data
            .ok_or(JobError::Internal("the training data was not read"))?;
        let base_path = ctx.base_path()?;
        ctx.say(&format!(
            "loading {} ({}, {}) on {}",
            base_path.display(),
            cfg.model.weights.name(),
            cfg.model.dtype.name(),
            lora_core::sys::device_name(ctx.device)
        ));
        let (mut model, tok) =
            load_base(&base_path, cfg.model.weights, cfg.model.dtype, ctx.device)?;
        // chat data is rendered with the model's own template, ChatML when it has none
        let template = match cfg.data.format {
            crate::config::DataFormat::Alpaca | crate::config::DataFormat::Chat => {
                let t =
                    lora_models::tokenizer::ChatTemplate::for_model(&base_path).map_err(|e| {
                        JobError::Input(format!(
                            "{e}; the model's chat template cannot be used — fix it in the \
                             model's files or use another base"
                        ))
                    })?;
                ctx.say(&match &t {
                    lora_models::tokenizer::ChatTemplate::Jinja(j) => {
                        format!("chat template: the model's own ({})", j.name())
                    }
                    _ => "chat template: ChatML (the model has none)".to_string(),
                });
                Some(t.to_data_template())
            }
            _ => None,
        };
        if crate::engine::stop_requested() {
            return Err(ctx.interrupted_before_training());
        }
        model.set_gradient_checkpointing(cfg.train.gradient_checkpointing);
        // autocast's casts of the frozen f32 weights, kept from step to step: the plan already
        // counts them all at the peak of a step without checkpointing (`autocast weight copies`)
        model.set_frozen_cast_cache(
            !cfg.train.gradient_checkpointing
                && matches!(
                    cfg.train.mixed_precision,
                    crate::engine::precision::Precision::Bf16
                        | crate::engine::precision::Precision::Fp16
                ),
        );
        tch::manual_seed(cfg.system.seed as i64);
        let lcfg = lora_config(cfg, &ctx.base_written)?;
        let report = lora_core::inject::inject(&mut model, &lcfg, "default", &vs.root())
            .during("injecting LoRA")?;
        ctx.say(&format!(
            "LoRA r{} α{} on {} modules: {} trainable of {} parameters ({:.3}%)",
            cfg.lora.rank,
            cfg.lora.alpha,
            report.modules.len(),
            report.trainable_params,
            report.all_params,
            report.trainable_percent()
        ));
        // the adapter's layout as injected (no copy of its tensors): what each save fills in
        let snapshot_template =
            if cfg.train.save_every_n_steps.is_some() || cfg.train.save_every_n_epochs.is_some() {
                Some(crate::job::snapshots::AdapterLayout::of(
                    &lora_core::formats::AdapterWeights::from_model(&mut model, "default")
                        .during("reading the injected adapter")?,
                ))
            } else {
                None
            };
        Ok(LlmRun {
            model,
            tok,
            template,
            lcfg,
            snapshot_template,
            data_written,
            data_path,
            plain_text: self.plain_text,
            eval_ids: Vec::new(),
            data_stats: serde_json::Value::Null,
            rows: 0,
            batches_per_epoch: 0,
            eval_before: None,
            eval_after: None,
            sample_before: None,
            sample_after: None,
        })
    }
}

/// The causal-LM run once the base is loaded and LoRA injected.
struct LlmRun {
    model: lora_models::llama::Llama,
    tok: lora_models::tokenizer::Tokenizer,
    /// The renderer of alpaca/chat data: the model's chat template (`None` for other formats).
    template: Option<std::sync::Arc<dyn lora_data::text::ChatTemplate>>,
    lcfg: lora_core::config::LoraConfig,
    /// The injected adapter, for the snapshots at each save (when the run saves).
    snapshot_template: Option<crate::job::snapshots::AdapterLayout>,
    data_written: String,
    data_path: PathBuf,
    plain_text: Option<(String, Vec<PathBuf>)>,
    eval_ids: Vec<i64>,
    data_stats: serde_json::Value,
    rows: usize,
    batches_per_epoch: usize,
    eval_before: Option<EvalResult>,
    eval_after: Option<EvalResult>,
    sample_before: Option<String>,
    sample_after: Option<String>,
}

impl LoadedRun for LlmRun {
    type Batch = lora_data::text::TextBatch;
    type Task<'a> = LlamaTask<'a>;
    type Source = TextSource;
    type Summary = RunSummary;

    fn callbacks(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
    ) -> Result<Vec<Box<dyn crate::engine::Callback>>> {
        let Some(template) = self.snapshot_template.take() else {
            return Ok(Vec::new());
        };
        let (lcfg, run_cfg) = (self.lcfg.clone(), cfg.clone());
        let writer: crate::job::snapshots::SnapshotWriter = Box::new(move |parts, dir, stem| {
            let mut out = Vec::new();
            for (_, w) in parts {
                out.extend(
                    crate::export::write_formats(w, &lcfg, &run_cfg, dir, stem)
                        .during("writing an adapter snapshot")?,
                );
            }
            Ok(out)
        });
        Ok(vec![Box::new(
            crate::job::snapshots::AdapterSnapshots::for_run(
                vec![crate::job::snapshots::SnapshotPart {
                    component: "model",
                    var_prefix: String::new(),
                    template,
                }],
                writer,
                cfg,
                &ctx.out_dir,
            ),
        )])
    }

    fn source(&mut self, cfg: &TrainConfig, ctx: &RunContext<'_>) -> Result<TextSource> {
        use lora_data::loader::{Loader, LoaderConfig};
        use lora_data::text::{TextConfig, TextDataset, TextFormat};
        let tok = &self.tok;
        let data_path = &self.data_path;
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
            template: match &self.template {
                Some(t) => t.clone(),
                None => TextConfig::default().template,
            },
            ..TextConfig::default()
        };
        let (train_ds, eval_ids, data_stats) = if matches!(text_cfg.format, TextFormat::Plain) {
            let (text, files) = match self.plain_text.take() {
                Some(t) => t,
                None => read_text(data_path, cfg.data.max_bytes)?,
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
                let p = resolve_path("data.eval_file", e, ctx.config_dir())?;
                eval_text =
                    std::fs::read_to_string(&p).during(format!("reading {}", p.display()))?;
                held = &eval_text;
            }
            let ds =
                TextDataset::from_texts(&[(&self.data_written, train_text)], tok.inner(), text_cfg)
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
            let full = TextDataset::from_files(&[data_path], tok.inner(), text_cfg)
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
        let loader = Loader::new(
            train_ds,
            collate,
            LoaderConfig {
                batch_size: cfg.train.batch_size as usize,
                shuffle: cfg.data_loader.shuffle,
                drop_last: false,
                seed: cfg.system.seed,
                num_workers: cfg.data_loader.num_workers as usize,
                prefetch_factor: cfg.data_loader.prefetch_factor.max(1) as usize,
                persistent_workers: cfg.data_loader.persistent_workers,
                // data-parallel: this rank's share of each epoch, as DistributedSampler deals
                num_replicas: ctx.loader_shard().0,
                rank: ctx.loader_shard().1,
            },
        )
        .during("building the data loader")?;
        self.rows = rows;
        self.batches_per_epoch = loader.batches_per_epoch();
        self.eval_ids = eval_ids;
        self.data_stats = data_stats;
        Ok(TextSource::new(loader))
    }

    fn describe_data(&self, cfg: &TrainConfig, ctx: &RunContext<'_>, total_steps: u64) {
        let accum = cfg.train.gradient_accumulation_steps.max(1) as usize;
        let per_epoch = self.batches_per_epoch.div_ceil(accum) as u64;
        let capped = if cfg.train.max_steps.is_some() && per_epoch > 0 && total_steps > per_epoch {
            format!(" ({} epochs)", total_steps.div_ceil(per_epoch))
        } else {
            String::new()
        };
        ctx.say(&format!(
            "data: {} rows of {} tokens, {} micro-batches of {} per epoch; {total_steps} optimizer step{}{capped} (gradient_accumulation_steps {accum}); {} held-out tokens",
            self.rows,
            cfg.data.seq_len,
            self.batches_per_epoch,
            cfg.train.batch_size,
            if total_steps == 1 { "" } else { "s" },
            self.eval_ids.len()
        ));
    }

    fn before(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        _source: &mut TextSource,
    ) -> Result<()> {
        if !self.eval_ids.is_empty() {
            ctx.say("evaluating held-out perplexity before training");
        }
        self.eval_before = evaluate(&self.model, &self.eval_ids, cfg.data.seq_len as usize)?;
        if let Some(e) = self.eval_before {
            ctx.say(&format!(
                "held-out perplexity before: {:.3} ({} tokens)",
                e.perplexity, e.tokens
            ));
        }
        self.sample_before = match &cfg.logging.sample_prompt {
            Some(p) => Some(sample(
                &self.model,
                &self.tok,
                p,
                cfg.logging.sample_max_new_tokens,
            )?),
            None => None,
        };
        if cfg.train.gradient_checkpointing {
            ctx.say("gradient checkpointing: each decoder layer is recomputed during backward");
        }
        Ok(())
    }

    fn task(&self, cfg: &TrainConfig, named: Vec<(String, tch::Tensor)>) -> Result<LlamaTask<'_>> {
        Ok(LlamaTask {
            model: &self.model,
            named,
            loraplus_lr_ratio: cfg.train.loraplus_lr_ratio,
        })
    }

    fn after(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        _source: TextSource,
        _report: &crate::engine::TrainReport,
    ) -> Result<Option<(&'static str, f64)>> {
        // training is over: the kept casts go
        self.model.set_frozen_cast_cache(false);
        if !self.eval_ids.is_empty() {
            ctx.say("evaluating held-out perplexity after training");
        }
        self.eval_after = evaluate(&self.model, &self.eval_ids, cfg.data.seq_len as usize)?;
        Ok(self.eval_after.map(|a| ("held-out loss", a.mean_nll)))
    }

    fn finish(
        &mut self,
        cfg: &TrainConfig,
        _ctx: &RunContext<'_>,
        _report: &crate::engine::TrainReport,
    ) -> Result<()> {
        self.sample_after = match &cfg.logging.sample_prompt {
            Some(p) => Some(sample(
                &self.model,
                &self.tok,
                p,
                cfg.logging.sample_max_new_tokens,
            )?),
            None => None,
        };
        Ok(())
    }

    fn dataset_metadata(&self) -> serde_json::Value {
        self.data_stats.clone()
    }

    fn base_sha256(&self, ctx: &RunContext<'_>) -> Result<Option<String>> {
        let base_path = ctx.base_path()?;
        if base_path.is_file() {
            Ok(Some(
                crate::export::sha256_file(&base_path).during("hashing the base model")?,
            ))
        } else {
            Ok(None)
        }
    }

    fn export(
        &mut self,
        cfg: &TrainConfig,
        ctx: &RunContext<'_>,
        metadata: std::collections::BTreeMap<String, String>,
    ) -> Result<Vec<PathBuf>> {
        crate::export::export_run(
            &mut self.model,
            "default",
            &self.lcfg,
            cfg,
            metadata,
            &ctx.out_dir,
        )
        .during("exporting the adapter")
    }

    fn summary(self, outcome: RunOutcome) -> Result<RunSummary> {
        Ok(RunSummary {
            plan: outcome
                .plan
                .ok_or(JobError::Internal("the causal-LM run has no plan"))?,
            steps: outcome.report.steps,
            tokens: outcome.report.tokens,
            train_seconds: outcome.train_seconds,
            total_seconds: outcome.total_seconds,
            losses: outcome.report.losses,
            eval_before: self.eval_before,
            eval_after: self.eval_after,
            sample_before: self.sample_before,
            sample_after: self.sample_after,
            memory: outcome.memory,
            outputs: outcome.outputs,
        })
    }

    fn report(summary: &RunSummary, _ctx: &RunContext<'_>) -> String {
        summary.report()
    }
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
    fn target_modules_are_planned_as_the_injection_matches_them() {
        let cfg = |targets: &str| {
            TrainConfig::from_yaml_str(&format!(
                "model: {{base_model: SmolLM2-135M}}\nlora: {{target_modules: {targets}}}\n"
            ))
            .unwrap()
        };
        // a regex over the whole module path, as PEFT's re.fullmatch
        let p = plan(&cfg("'.*(q|v)_proj'"), None, None, false).unwrap();
        assert_eq!(
            p.settings.lora.target_modules,
            ["self_attn.q_proj", "self_attn.v_proj"]
        );
        assert!(
            !p.notes.iter().any(|n| n.contains("regex")),
            "{:?}",
            p.notes
        );
        // an entry that matches nothing is named; nothing matched at all is an error
        let p = plan(&cfg("[q_proj, bogus]"), None, None, false).unwrap();
        assert_eq!(p.settings.lora.target_modules, ["self_attn.q_proj"]);
        assert!(
            p.notes.iter().any(|n| n.contains("\"bogus\"")),
            "{:?}",
            p.notes
        );
        let e = plan(&cfg("[bogus]"), None, None, false).unwrap_err();
        assert!(
            matches!(e, JobError::Input(_)) && e.to_string().contains("self_attn.q_proj"),
            "{e}"
        );
        // exclusions apply
        let mut c = cfg("all-linear");
        c.lora.exclude_modules = Some(crate::config::TargetModules::list(&["mlp.down_proj"]));
        let p = plan(&c, None, None, false).unwrap();
        assert_eq!(p.settings.lora.target_modules.len(), 6);
        assert!(
            !p.settings
                .lora
                .target_modules
                .contains(&"mlp.down_proj".to_string())
        );
    }

    #[test]
    fn a_config_json_this_recipe_cannot_load_is_refused_when_planning() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type":"phi3","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
               "num_attention_heads":4,"vocab_size":100,"hidden_act":"silu"}"#,
        )
        .unwrap();
        let mut cfg = TrainConfig::default();
        cfg.model.base_model = Some(dir.path().display().to_string());
        let e = plan(&cfg, None, None, false).unwrap_err().to_string();
        assert!(e.contains("phi3") && e.contains("llama"), "{e}");
        // a file that states its type is not overridden
        cfg.model.model_type = Some("generic".into());
        let e = plan(&cfg, None, None, false).unwrap_err().to_string();
        assert!(e.contains("model_type") && e.contains("\"phi3\""), "{e}");
    }

    #[test]
    fn a_file_that_is_no_model_is_named_with_what_to_give() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("notes.txt");
        std::fs::write(&f, "not a model\n").unwrap();
        let mut cfg = TrainConfig::default();
        cfg.model.base_model = Some(f.display().to_string());
        let e = read_descriptor(&cfg, None).unwrap_err();
        assert!(matches!(e, JobError::Input(_)), "{e:?}");
        let m = e.to_string();
        assert!(
            m.contains("model.base_model") && m.contains("notes.txt") && m.contains(".gguf"),
            "{m}"
        );
    }

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
