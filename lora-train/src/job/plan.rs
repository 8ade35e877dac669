//! The memory plan of a run ([`Plan`]) and how it reads: the language-model report, the
//! diffusion report (image and latent sizes, what is cached, UNet / VAE / text-encoder rows) and
//! the verdict; the config ↔ lora-memory [`Settings`] mapping and the budget a run is held to.

use crate::config::{BaseWeights, Dtype, Precision, TargetModules, TrainConfig};
use crate::job::error::Result;
use lora_memory::{
    BaseDtype, Budget, Bytes, Change, Check, Device, Estimate, MixedPrecision, ModelDescriptor,
    Profile, Settings, Verdict,
};
use serde::Serialize;

/// The memory plan of a run.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    /// Model name from the header.
    pub model: String,
    /// Where the descriptor came from (file path or preset).
    pub model_source: String,
    /// The shapes the plan was made from (read from the header or a preset).
    pub descriptor: ModelDescriptor,
    /// Settings estimated (after `auto_fit`, if applied).
    pub settings: Settings,
    /// The estimate for `settings`.
    pub estimate: Estimate,
    /// The budget, when one is known.
    pub budget: Option<Budget>,
    /// `Some(false)` when a budget is known and the run does not fit it ([`Verdict::DoesNotFit`]:
    /// a run refuses to start); `Some(true)` when it fits or is tight (it starts; a tight plan
    /// warns). Kept in step with `check` by [`Plan::judge`].
    pub fits: Option<bool>,
    /// The safe verdict against the budget, with its numbers ([`Check`]), when a budget is known.
    pub check: Option<Check>,
    /// Changes made by `auto_fit`.
    pub changes: Vec<Change>,
    /// Notes (assumed units, approximations).
    pub notes: Vec<String>,
    /// When the plan does not fit and `auto_fit` is off: the changes `fit()` would make and the
    /// peak they reach (`memory.auto_fit: true` applies them). Empty otherwise: no budget, the
    /// plan fits, `auto_fit` applied them, or nothing on the ladder fits
    /// ([`Plan::ladder_smallest_peak`]).
    pub suggestion: Vec<Change>,
    /// When the fitting ladder was walked ([`Plan::fit_to_budget`]) and nothing on it fits the
    /// budget: the smallest peak it reached.
    pub ladder_smallest_peak: Option<lora_memory::Bytes>,
}

impl Plan {
    /// A plan of `estimate` for `settings` against `budget` (judged, no changes, no notes).
    pub fn new(
        descriptor: ModelDescriptor,
        model_source: String,
        settings: Settings,
        estimate: Estimate,
        budget: Option<Budget>,
    ) -> Plan {
        let mut p = Plan {
            model: descriptor.name().to_string(),
            model_source,
            descriptor,
            settings,
            estimate,
            budget,
            fits: None,
            check: None,
            changes: Vec::new(),
            notes: Vec::new(),
            suggestion: Vec::new(),
            ladder_smallest_peak: None,
        };
        p.judge();
        p
    }

    /// Recomputes [`Plan::check`] and [`Plan::fits`] from the estimate and the budget (after
    /// either changed). The budget is what the run may use: a size or a card's memory, or the
    /// memory free right now (NVML), which already leaves out what other processes hold.
    pub fn judge(&mut self) {
        self.check = self
            .budget
            .as_ref()
            .map(|b| Check::for_budget(&self.estimate, b));
        self.fits = self
            .check
            .as_ref()
            .map(|c| c.verdict != Verdict::DoesNotFit);
    }

    /// The plan per rank of a data-parallel run of `world_size` processes, one per GPU, each
    /// holding the whole model and training its own micro-batches: the estimate again with
    /// [`Settings::world_size`] (the all-reduce's gradient buffer added), judged against the
    /// same budget, which is then one GPU's. `auto_fit`'s choices, made before, stay; the
    /// fitting ladder's findings for one process ([`Plan::suggestion`],
    /// [`Plan::ladder_smallest_peak`]) are dropped, as they do not hold per rank.
    ///
    /// # Errors
    /// An estimate error (a world size of 0).
    pub fn for_world_size(mut self, world_size: u32) -> Result<Plan> {
        if world_size == self.settings.world_size {
            return Ok(self);
        }
        self.suggestion.clear();
        self.ladder_smallest_peak = None;
        self.settings.world_size = world_size;
        self.estimate = lora_memory::estimate(&self.descriptor, &self.settings)?;
        self.judge();
        Ok(self)
    }

    /// The plan with an image job's kept data counted ([`Settings::kept_data`], known once the
    /// dataset is read): the estimate again, judged against the same budget. `auto_fit`'s
    /// choices, made before, stay (they are not revisited); when the estimate changes (kept
    /// data counts on a CPU run only), the fitting ladder's findings are dropped, as they were
    /// found without it.
    ///
    /// # Errors
    /// An estimate error.
    pub fn with_kept_data(mut self, kept: lora_memory::KeptData) -> Result<Plan> {
        let mut settings = self.settings.clone();
        settings.kept_data = Some(kept);
        let estimate = lora_memory::estimate(&self.descriptor, &settings)?;
        self.settings = settings;
        if estimate != self.estimate {
            self.estimate = estimate;
            self.suggestion.clear();
            self.ladder_smallest_peak = None;
            self.judge();
        }
        Ok(self)
    }

    /// The verdict, when a budget is known.
    pub fn verdict_kind(&self) -> Option<Verdict> {
        self.check.as_ref().map(|c| c.verdict)
    }

    /// When the plan is tight or does not fit its budget: walks `lora_memory::fit`'s ladder
    /// (`ladder` names its rungs for the notes) and, with `auto_fit`, takes the settings that
    /// fit ([`Plan::changes`]), else keeps them as the suggestion ([`Plan::suggestion`]); when
    /// nothing on the ladder fits, a note says the smallest peak reached.
    ///
    /// # Errors
    /// Estimate errors of the ladder's settings.
    pub fn fit_to_budget(&mut self, auto_fit: bool, ladder: &str) -> Result<()> {
        let Some(b) = self.budget.clone() else {
            return Ok(());
        };
        if !matches!(
            self.verdict_kind(),
            Some(Verdict::Tight | Verdict::DoesNotFit)
        ) {
            return Ok(());
        }
        match lora_memory::fit(&self.descriptor, &self.settings, b.bytes) {
            Ok(f) if auto_fit => {
                self.settings = f.settings;
                self.estimate = f.estimate;
                self.changes = f.changes;
                self.judge();
            }
            Ok(f) => self.suggestion = f.changes,
            Err(lora_memory::FitError::DoesNotFit {
                smallest_peak,
                changes,
                ..
            }) => {
                self.ladder_smallest_peak = Some(smallest_peak);
                self.notes.push(format!(
                "{}nothing on the fitting ladder ({ladder}) fits this budget with its safety margin; the smallest peak reachable is {smallest_peak}{}",
                if auto_fit { "auto_fit: " } else { "" },
                if auto_fit {
                    format!(", after {} changes", changes.len())
                } else {
                    String::new()
                }
            ));
            }
            Err(lora_memory::FitError::Estimate(e)) => return Err(e.into()),
            Err(other) => return Err(crate::job::JobError::Fit(other)),
        }
        Ok(())
    }

    /// The frontier rows of [`Plan::frontier_report`] for one reference profile (on CUDA, the
    /// plan's other settings as they are).
    ///
    /// # Errors
    /// An estimate error for settings the estimator refuses.
    pub fn frontier(
        &self,
        profile: Profile,
    ) -> std::result::Result<Vec<lora_memory::FrontierRow>, lora_memory::Error> {
        let mut s = self.settings.clone().with_profile(profile);
        if !s.device.is_cuda() {
            s.device = Device::cuda();
        }
        lora_memory::frontier(&self.descriptor, &s, &lora_memory::frontier_cards())
    }

    /// The frontier of this plan's settings on CUDA cards of 8, 12, 16, 24, 40, 48 and 80 GB
    /// ([`lora_memory::fit::FRONTIER_CARDS_GIB`]): the longest sequence at the plan's
    /// micro-batch and the largest micro-batch at its sequence length (diffusion: at its
    /// resolution) that *fit* — the safe verdict, margin included, nothing else on the card —
    /// for this SDK's trainer and, with the same settings, for HF transformers + PEFT
    /// ([`Profile::peft_transformers`]).
    ///
    /// # Errors
    /// An estimate error for settings the estimator refuses.
    pub fn frontier_report(&self) -> std::result::Result<String, lora_memory::Error> {
        let a = self.frontier(Profile::ours())?;
        let b = self.frontier(Profile::peft_transformers())?;
        let decoder = matches!(self.descriptor, ModelDescriptor::Decoder(_));
        let s = &self.settings;
        let mut out = if decoder {
            format!(
                "frontier of {} on CUDA cards: longest sequence at micro_batch {}, largest micro_batch at seq_len {} (\"fits\" with the safety margin, nothing else on the card)\n",
                self.model, s.micro_batch, s.seq_len
            )
        } else {
            format!(
                "frontier of {} on CUDA cards: largest micro_batch at this resolution (\"fits\" with the safety margin, nothing else on the card)\n",
                self.model
            )
        };
        let shown = |n: Option<u32>, cap: u32| match n {
            Some(0) => "does not fit".to_string(),
            Some(n) if n >= cap => format!("≥ {n}"),
            Some(n) => n.to_string(),
            None => "—".to_string(),
        };
        let seq_cap = lora_memory::fit::MAX_FRONTIER_SEQ_LEN;
        let batch_cap = lora_memory::fit::MAX_FRONTIER_MICRO_BATCH;
        let peer = if decoder { "HF+PEFT" } else { "diffusers+PEFT" };
        out += &format!(
            "{:>6}  {:>14}  {:>14}  {:>12}  {:>12}\n",
            "card",
            "seq (ours)",
            format!("seq ({peer})"),
            "batch (ours)",
            format!("batch ({peer})")
        );
        for ((card, x), y) in lora_memory::fit::FRONTIER_CARDS_GIB.iter().zip(&a).zip(&b) {
            out += &format!(
                "{:>4}GB  {:>14}  {:>14}  {:>12}  {:>12}\n",
                card,
                shown(x.max_seq_len, seq_cap),
                shown(y.max_seq_len, seq_cap),
                shown(Some(x.max_micro_batch), batch_cap),
                shown(Some(y.max_micro_batch), batch_cap)
            );
        }
        Ok(out)
    }

    /// Writes the settings `auto_fit` chose ([`Plan::changes`]) into `cfg` (micro-batch and
    /// accumulation, precision, checkpointing, optimizer, rank, …; see [`apply_settings`]).
    /// Planning itself never edits a config: a run applies its plan to its own copy, and an app
    /// calls this when it wants the fitted config. Does nothing when nothing was changed.
    pub fn apply_to(&self, cfg: &mut TrainConfig) {
        if self.changes.is_empty() {
            return;
        }
        if self.estimate.flux.is_some() {
            apply_flux_settings(cfg, &self.settings);
        } else if self.estimate.diffusion.is_some() {
            apply_diffusion_settings(cfg, &self.settings);
        } else {
            apply_settings(cfg, &self.settings);
        }
    }

    /// A human-readable report: settings, the breakdown table and the verdict. A Stable
    /// Diffusion plan (one with diffusion detail) is printed by [`diffusion_report`].
    pub fn report(&self) -> String {
        if self.estimate.flux.is_some() {
            return flux_report(self);
        }
        if self.estimate.diffusion.is_some() {
            return diffusion_report(self);
        }
        let s = &self.settings;
        let mut out = String::new();
        // The model's name (GGUF `general.name` as written, else the architecture or preset)
        // once, in this header; the table's own title line repeats it, so it is dropped.
        let e = &self.estimate;
        out += &format!(
            "plan: {} ({}), trainable params: {}\n",
            self.model, self.model_source, e.trainable_params
        );
        out += &format!(
            "  device {}  base {}  mixed precision {}  LoRA r{} α{} on {:?}\n",
            if s.device.is_cuda() { "cuda" } else { "cpu" },
            s.base_dtype.name(),
            s.mixed_precision.name(),
            s.lora.rank,
            s.lora.alpha,
            s.lora.target_modules
        );
        out += &format!(
            "  micro_batch {} × gradient_accumulation_steps {}{}  seq_len {}  gradient checkpointing {}  optimizer {:?}\n",
            s.micro_batch,
            s.gradient_accumulation_steps,
            if s.world_size > 1 {
                format!(" × world_size {}", s.world_size)
            } else {
                String::new()
            },
            s.seq_len,
            if s.gradient_checkpointing {
                "on"
            } else {
                "off"
            },
            s.optimizer
        );
        let table = e.to_table();
        let title = format!("{}  (trainable params: {})\n", e.model, e.trainable_params);
        out += table.strip_prefix(title.as_str()).unwrap_or(&table);
        for c in &self.changes {
            out += &format!(
                "auto_fit: {} {} → {} ({}); peak after {}\n",
                c.setting, c.from, c.to, c.reason, c.peak_after
            );
        }
        for n in &self.notes {
            out += &format!("note: {n}\n");
        }
        if !self.suggestion.is_empty() {
            out += "would fit with (set memory.auto_fit: true to apply, or change the config):\n";
            for c in &self.suggestion {
                out += &format!(
                    "  {} {} → {} ({}); peak after {}\n",
                    c.setting, c.from, c.to, c.reason, c.peak_after
                );
            }
        }
        out += &self.verdict();
        out
    }

    /// The verdict line of [`Plan::report`] (LLM and SD plans): the predicted peak against the
    /// budget, the budget in both units (the one it was written in first) and where it came
    /// from; then, for a CUDA plan with a decimal budget near a GPU's size,
    /// [`Budget::unit_hint`] on a `hint:` line.
    pub fn verdict(&self) -> String {
        let peak = self.estimate.peak;
        let mut out = match (&self.budget, &self.check) {
            (Some(b), Some(c)) => match c.verdict {
                Verdict::Fits => format!(
                    "verdict: fits — predicted peak {peak} + safety margin {} within budget {} ({}), headroom {}\n",
                    c.margin,
                    b.amount(),
                    budget_source(b),
                    Bytes(u64::try_from(c.headroom).unwrap_or(0))
                ),
                Verdict::Tight => format!(
                    "verdict: TIGHT — predicted peak {peak} is within budget {} ({}) but inside the safety margin of {} (the estimate's spread, allocator splits, CUDA context): the run may go out of memory; free {} more to be safe\n",
                    b.amount(),
                    budget_source(b),
                    c.margin,
                    Bytes(c.headroom.unsigned_abs())
                ),
                Verdict::DoesNotFit => format!(
                    "verdict: DOES NOT FIT — predicted peak {peak} exceeds budget {} ({}) by {}\n",
                    b.amount(),
                    budget_source(b),
                    peak.saturating_sub(b.bytes)
                ),
            },
            _ => format!("verdict: predicted peak {peak} (no budget given)\n"),
        };
        let n = self.settings.world_size;
        if n > 1 {
            let device = if self.settings.device.is_cuda() {
                "GPU"
            } else {
                "machine"
            };
            out += &match (&self.budget, self.verdict_kind()) {
                (Some(b), Some(v)) => {
                    let cards = match &b.source {
                        lora_memory::BudgetSource::Gpu { name } => format!("{n} × {name}"),
                        _ => format!("{n} × {} ({device}s of this budget)", b.amount()),
                    };
                    match v {
                        Verdict::Fits => format!(
                            "data-parallel: fits on {cards} — the peak above is per rank, one rank per {device}\n"
                        ),
                        Verdict::Tight => format!(
                            "data-parallel: TIGHT on {cards} — the peak above is per rank, one rank per {device}\n"
                        ),
                        Verdict::DoesNotFit => format!(
                            "data-parallel: does not fit on {cards} — each rank holds the whole model, so more ranks do not lower the peak per {device}; a smaller micro_batch per rank does, with gradient_accumulation_steps keeping the global batch\n"
                        ),
                    }
                }
                _ => format!(
                    "data-parallel: {n} ranks — the peak above is per rank, one rank per {device}\n"
                ),
            };
            if !self.settings.device.is_cuda() {
                // CPU ranks started on one machine (--nproc-per-node) share its memory
                out += &format!(
                    "data-parallel on the CPU: ranks on one machine share its memory — {n} on one machine need {n} × {peak} = {}\n",
                    Bytes(peak.0.saturating_mul(u64::from(n)))
                );
            }
        }
        if self.settings.device.is_cuda()
            && let Some(h) = self.budget.as_ref().and_then(Budget::unit_hint)
        {
            out += &format!("hint: {h}\n");
        }
        out
    }
}

/// Describes a budget's origin in words.
pub fn budget_source(b: &Budget) -> String {
    match &b.source {
        lora_memory::BudgetSource::Size { input, assumed } => match assumed {
            Some(a) => format!("{input:?}, {a}"),
            None => format!("{input:?}"),
        },
        lora_memory::BudgetSource::Gpu { name } => {
            format!("GPU preset {name}, assuming nothing else holds the card")
        }
        lora_memory::BudgetSource::NvmlFree {
            device_index,
            name,
            total,
        } => {
            let name = if name.is_empty() {
                String::new()
            } else {
                format!(" {name},")
            };
            format!(
                "cuda:{device_index}{name} {total} of which {} free now (NVML)",
                b.bytes
            )
        }
    }
}

/// lora-memory settings for a config. `file_quant` is the storage type of the file's layer
/// linears (GGUF), used when `model.weights: quantized`; a dense base kept quantized (`None`:
/// safetensors) is planned as NF4 with double quantization, what the loaders quantize it to
/// (QLoRA); `cuda` selects the device model.
pub fn settings_for(
    cfg: &TrainConfig,
    file_quant: Option<BaseDtype>,
    cuda: bool,
) -> (Settings, Vec<String>) {
    let mut notes = Vec::new();
    let base_dtype = match cfg.model.weights {
        BaseWeights::Dense => match cfg.model.dtype {
            Dtype::F32 => BaseDtype::F32,
            Dtype::Bf16 => BaseDtype::Bf16,
            Dtype::F16 => BaseDtype::F16,
        },
        BaseWeights::Quantized => match file_quant {
            Some(q) if q.is_quantized() => q,
            _ => BaseDtype::Nf4 { double_quant: true },
        },
    };
    let mixed_precision = match cfg.train.mixed_precision {
        Precision::Fp32 => MixedPrecision::No,
        Precision::Fp16 => MixedPrecision::Fp16,
        Precision::Bf16 => MixedPrecision::Bf16,
        Precision::FullBf16 => MixedPrecision::FullBf16,
    };
    // a precision `train` refuses on this device (fp16 on the CPU), said in the engine's words;
    // the plan still counts it as written
    if !cuda
        && let Err(crate::engine::TrainError::Invalid { value, hint, .. }) =
            cfg.train.mixed_precision.check_device(tch::Device::Cpu)
    {
        notes.push(format!(
            "train.mixed_precision {value:?} on the CPU: `train` refuses it before loading ({hint})"
        ));
    }
    if let Some(e) = cfg.unwritable_export() {
        notes.push(format!("`train` refuses this config before loading: {e}"));
    }
    let targets = match &cfg.lora.target_modules {
        TargetModules::List(l) => l.clone(),
        TargetModules::Regex(r) => {
            if r != "all-linear" {
                notes.push(format!(
                    "lora.target_modules is a regex ({r:?}); the plan counts the sites whose name matches it as a plain name"
                ));
            }
            vec![r.clone()]
        }
    };
    let optimizer = cfg
        .train
        .optimizer
        .memory_term(crate::job::lower::sgd_momentum(&cfg.train));
    let mut s = Settings::default()
        .with_base_dtype(base_dtype)
        .with_mixed_precision(mixed_precision)
        .with_method(if cfg.lora.use_dora {
            lora_memory::Method::Dora
        } else {
            lora_memory::Method::Lora
        })
        .with_rank(cfg.lora.rank)
        .with_alpha(cfg.lora.alpha as f32)
        .with_target_modules(&targets)
        .with_lora_dropout(cfg.lora.dropout as f32)
        .with_micro_batch(cfg.train.batch_size)
        .with_gradient_accumulation_steps(cfg.train.gradient_accumulation_steps)
        .with_seq_len(cfg.data.seq_len)
        .with_gradient_checkpointing(cfg.train.gradient_checkpointing)
        .with_optimizer(optimizer)
        .with_device(if cuda { Device::cuda() } else { Device::cpu() })
        // a base kept quantized holds its other weights (embedding, norms, head) in fp32
        // whatever `model.dtype` says (lora-models `WeightMode::KeepQuantized`)
        .with_quantized_compute_f32(
            cfg.model.dtype == Dtype::F32 || cfg.model.weights == BaseWeights::Quantized,
        )
        .with_quantized_compute_f32_only(true);
    if let Some([w, h]) = cfg.data.resolution {
        s = s.with_resolution(w.max(h));
    }
    if let Some(c) = cfg.data.cache_latents {
        s = s.with_cache_latents(c);
    }
    (s, notes)
}

/// [`apply_settings`] for a diffusion run: also the training resolution (the largest bucket when
/// bucketing) and whether the text encoder is trained.
pub fn apply_diffusion_settings(cfg: &mut TrainConfig, s: &Settings) {
    apply_settings(cfg, s);
    let [w, h] = s.largest_bucket.unwrap_or([s.resolution, s.resolution]);
    if cfg.data.resolution.map(|[a, b]| a.max(b)) != Some(s.resolution) {
        cfg.data.resolution = Some(if s.largest_bucket.is_some() {
            [w, h]
        } else {
            [s.resolution, s.resolution]
        });
    }
    cfg.train.train_text_encoder = s.train_text_encoder;
}

/// [`apply_diffusion_settings`] for a FLUX run: a float8 base is `flux.fp8_base` (the weights
/// stay `dense` in the config: they are stored in fp8 at load), and `flux.blocks_to_swap`.
pub fn apply_flux_settings(cfg: &mut TrainConfig, s: &Settings) {
    let weights = cfg.model.weights;
    apply_diffusion_settings(cfg, s);
    if s.base_dtype == BaseDtype::Fp8 {
        cfg.flux.fp8_base = true;
        cfg.model.weights = weights;
    }
    cfg.flux.blocks_to_swap = s.blocks_to_swap;
}

/// Writes fitted settings back into the config (what `auto_fit` changes).
pub fn apply_settings(cfg: &mut TrainConfig, s: &Settings) {
    cfg.train.batch_size = s.micro_batch;
    cfg.train.gradient_accumulation_steps = s.gradient_accumulation_steps;
    cfg.data.seq_len = s.seq_len;
    cfg.train.gradient_checkpointing = s.gradient_checkpointing;
    cfg.lora.rank = s.lora.rank;
    cfg.lora.alpha = f64::from(s.lora.alpha);
    cfg.train.mixed_precision = match s.mixed_precision {
        MixedPrecision::No => Precision::Fp32,
        MixedPrecision::Fp16 => Precision::Fp16,
        MixedPrecision::Bf16 => Precision::Bf16,
        MixedPrecision::FullBf16 => Precision::FullBf16,
        // Not a mode of this trainer, and the fit ladder never proposes it (it only moves fp32
        // to bf16 autocast); the nearest mode if settings from elsewhere carry it.
        MixedPrecision::FullFp16 => Precision::Fp16,
    };
    cfg.train.optimizer =
        crate::engine::optim::OptimizerName::of_memory_term(s.optimizer, cfg.train.optimizer);
    match s.base_dtype {
        BaseDtype::F32 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::F32),
        BaseDtype::Bf16 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::Bf16),
        BaseDtype::F16 => (cfg.model.weights, cfg.model.dtype) = (BaseWeights::Dense, Dtype::F16),
        _ => {
            cfg.model.weights = BaseWeights::Quantized;
            if !s.quantized_compute_f32 && cfg.model.dtype == Dtype::F32 {
                cfg.model.dtype = Dtype::Bf16;
            }
        }
    }
}

/// The budget for a run: an explicit override, else `memory.gpu` / `memory.budget` from the
/// config (`memory.gpu: local` is this machine's card, read from the driver), else, for a run
/// on `system.device: cuda[:N]`, that card's free memory when the driver can be asked (NVML,
/// feature `nvml`), else none.
///
/// The second value is a note for the plan when a `cuda` run's card could not be read (the
/// plan then has no budget, and says why).
///
/// # Errors
/// Unknown GPU names (with the list of known ones); `local` without a card or NVML.
pub fn budget_for(
    cfg: &TrainConfig,
    override_budget: Option<Budget>,
) -> Result<(Option<Budget>, Option<String>)> {
    if override_budget.is_some() {
        return Ok((override_budget, None));
    }
    if let Some(g) = &cfg.memory.gpu {
        return Ok((Some(Budget::gpu(g)?), None));
    }
    if let Some(b) = &cfg.memory.budget {
        return Ok((Some(Budget::parse(&b.text)?), None));
    }
    let device = cfg.system.device.trim().to_ascii_lowercase();
    if device.starts_with("cuda") {
        // the card the run will use; no driver to ask is not an error, just no budget
        return Ok(match Budget::gpu(&device) {
            Ok(b) => (Some(b), None),
            Err(e) => (
                None,
                Some(format!(
                    "no memory check: system.device is {device:?} but its free memory could not be read ({e})"
                )),
            ),
        });
    }
    Ok((None, None))
}

fn yes_no(b: bool) -> &'static str {
    if b { "on" } else { "off" }
}

/// The SD plan as text: the run's shape (image and latent size, batch, what is cached and what
/// is trained), one row per memory term that applies to diffusion (no sequence length, tokens
/// or logits), the totals, notes, suggested changes and the verdict.
///
/// A plan without diffusion detail (a language-model plan) is printed by [`Plan::report`].
pub fn diffusion_report(p: &Plan) -> String {
    let Some(d) = &p.estimate.diffusion else {
        return p.report();
    };
    let s = &p.settings;
    let e = &p.estimate;
    let b = &e.breakdown;
    let cuda = s.device.is_cuda();
    let mut out = format!(
        "plan: {} ({}) — Stable Diffusion LoRA\n",
        p.model, p.model_source
    );
    out += &format!(
        "  device {}  UNet {}  mixed precision {}  LoRA r{} α{} on {:?}{}\n",
        if cuda { "cuda" } else { "cpu" },
        s.base_dtype.name(),
        s.mixed_precision.name(),
        s.lora.rank,
        s.lora.alpha,
        s.lora.target_modules,
        if s.train_text_encoder {
            " + text encoder q/k/v/out_proj"
        } else {
            ""
        }
    );
    out += &format!(
        "  image {}×{} px → latents {}×{}  micro_batch {}{} × gradient_accumulation_steps {}  gradient checkpointing {}  optimizer {:?}\n",
        d.image_size[0],
        d.image_size[1],
        d.latent_size[0],
        d.latent_size[1],
        s.micro_batch,
        if d.images_per_micro_batch != s.micro_batch {
            format!(
                " ({} images with prior preservation)",
                d.images_per_micro_batch
            )
        } else {
            String::new()
        },
        s.gradient_accumulation_steps,
        yes_no(s.gradient_checkpointing),
        s.optimizer
    );
    out += &format!(
        "  latents cached: {}{}  text encoder: {}\n",
        if s.cache_latents && s.random_crop {
            "no, random crops are encoded as drawn"
        } else if s.cache_latents {
            "yes"
        } else {
            "no"
        },
        if s.keep_models_loaded && !(s.cache_latents && s.random_crop) {
            " (VAE kept loaded for first-epoch encoding and samples)"
        } else {
            ""
        },
        if s.train_text_encoder {
            "trained (LoRA), runs every step"
        } else if s.cache_text_encoder_outputs && s.varying_captions {
            "frozen, runs every step (captions change between epochs)"
        } else if s.cache_text_encoder_outputs {
            "frozen, outputs cached"
        } else {
            "frozen, runs every step"
        }
    );
    let mut rows: Vec<(&str, Bytes, String)> = vec![
        (
            "UNet weights",
            d.unet_weights,
            format!("UNet params × {} B", s.base_dtype.bytes_per_param()),
        ),
        (
            "VAE weights",
            d.vae_weights,
            if d.vae_weights.0 == 0 {
                "not on the device (latents cached)".into()
            } else {
                "VAE params, 16-bit (32-bit for an fp32 base)".into()
            },
        ),
        (
            "text-encoder weights",
            d.text_encoder_weights,
            if d.text_encoder_weights.0 == 0 {
                "not on the device (outputs cached)".into()
            } else {
                "text-encoder params, 16-bit (32-bit for an fp32 base)".into()
            },
        ),
        (
            "autocast weight copies",
            b.autocast_weight_copies,
            "2 B × UNet linear params (32-bit base under autocast)".into(),
        ),
    ];
    rows.extend(trainable_rows(p));
    // at a sample-grid peak the training step's rows below are what the step holds, not part
    // of the peak
    let step_only = if b.sample_images.0 > 0 {
        " (the training step's, below the peak)"
    } else {
        ""
    };
    rows.extend([
        (
            "UNet activations",
            d.unet_activations,
            if s.gradient_checkpointing {
                format!("unit inputs + one recomputed unit, × images{step_only}")
            } else {
                format!("saved ResNet/transformer tensors at the latent size, × images{step_only}")
            },
        ),
        (
            "text-encoder activations",
            d.text_encoder_activations,
            if s.train_text_encoder {
                "77 tokens × layers, × images".into()
            } else {
                "none (not trained)".into()
            },
        ),
        (
            "batch data",
            b.batch_data,
            "latents, noise, noisy latents, prediction + conditioning (fp32)".into(),
        ),
    ]);
    rows.extend(sample_images_row(p, "UNet", d.image_size, d.sample_images));
    rows.extend(runtime_rows(p));
    out += &rows_and_verdict(p, rows);
    out
}

/// The `sample images` row of a diffusion report when the run draws sample images: their bytes
/// when drawing them is the peak (0 otherwise, with what they would add in the text), the size
/// (`training_size` unless the settings give one) and how `model` runs them; `grid` is what the
/// grid adds next to the persistent tensors (the estimate's detail).
fn sample_images_row(
    p: &Plan,
    model: &str,
    training_size: [u32; 2],
    grid: Bytes,
) -> Option<(&'static str, Bytes, String)> {
    let g = p.settings.sample_images.as_ref()?;
    let bytes = p.estimate.breakdown.sample_images;
    let [w, h] = g.size.unwrap_or(training_size);
    Some((
        "sample images",
        bytes,
        if bytes.0 > 0 {
            format!(
                "the peak: {w}×{h} px, one prompt at a time ({model} at batch {}, no grad), one image's decode",
                if g.guidance { 2 } else { 1 }
            )
        } else {
            format!(
                "{w}×{h} px, one prompt at a time: {:.3} GB, below the training step",
                grid.gb()
            )
        },
    ))
}

/// The rows of the trainable state every report shows: adapter, gradients, optimizer states and
/// step temporaries.
fn trainable_rows(p: &Plan) -> Vec<(&'static str, Bytes, String)> {
    let (b, e) = (&p.estimate.breakdown, &p.estimate);
    vec![
        (
            "adapter params",
            b.adapter_params,
            format!("{} trainable × adapter bytes", e.trainable_params),
        ),
        ("gradients", b.gradients, "trainable × grad bytes".into()),
        (
            "optimizer states",
            b.optimizer_states,
            "AdamW 8 B / 8-bit 2 B / Adafactor 4(n+m) / SGD 4 B".into(),
        ),
        (
            "optimizer step temporaries",
            b.optimizer_step_temporaries,
            "largest tensor's state (or one foreach list)".into(),
        ),
    ]
}

/// The runtime rows every report shows: CUDA context / CPU runtime and the allocator margin.
fn runtime_rows(p: &Plan) -> Vec<(&'static str, Bytes, String)> {
    let b = &p.estimate.breakdown;
    let cuda = p.settings.device.is_cuda();
    vec![
        (
            "context / workspace",
            b.context_workspace,
            if cuda {
                "CUDA context + cuBLAS workspace".into()
            } else {
                "CPU runtime: libtorch, heap, threads".into()
            },
        ),
        (
            "allocator margin",
            b.allocator_margin,
            if cuda {
                "caching allocator: reserved − allocated".into()
            } else {
                "none on CPU (the block cache stays within the live peak)".into()
            },
        ),
    ]
}

/// The term table of an image-model plan (`rows`: name, bytes, formula), then the totals,
/// notes, changes, suggestion and verdict.
fn rows_and_verdict(p: &Plan, mut rows: Vec<(&str, Bytes, String)>) -> String {
    let e = &p.estimate;
    let cuda = p.settings.device.is_cuda();
    // what the data source keeps (a CPU run's, once the dataset is read), before the runtime
    if let Some(k) = p.settings.kept_data
        && e.breakdown.kept_data.0 > 0
    {
        let at = rows
            .iter()
            .position(|r| r.0 == "context / workspace")
            .unwrap_or(rows.len());
        rows.insert(
            at,
            (
                "kept data",
                e.breakdown.kept_data,
                format!(
                    "{} latents + {} captions' text-encoder outputs + {} evaluation samples, in memory all run",
                    k.latents, k.captions, k.eval_samples
                ),
            ),
        );
    }
    let mut out = String::new();
    let mut table: Vec<(String, String, String, String)> = rows
        .into_iter()
        .map(|(n, v, f)| {
            (
                n.to_string(),
                format!("{:.3}", v.gb()),
                format!("{:.3}", v.gib()),
                f,
            )
        })
        .collect();
    table.push(("─".repeat(3), String::new(), String::new(), String::new()));
    for (n, v, f) in [
        (
            "peak allocated",
            e.peak_allocated,
            if cuda {
                "max_memory_allocated"
            } else {
                "peak live tensor bytes"
            },
        ),
        (
            "peak reserved",
            e.peak_reserved,
            if cuda {
                "max_memory_reserved"
            } else {
                "= allocated on CPU"
            },
        ),
        (
            "total (process peak)",
            e.peak_process,
            if cuda {
                "nvidia-smi"
            } else {
                "process peak RSS"
            },
        ),
    ] {
        table.push((
            n.to_string(),
            format!("{:.3}", v.gb()),
            format!("{:.3}", v.gib()),
            f.to_string(),
        ));
    }
    let w0 = table.iter().map(|r| r.0.chars().count()).max().unwrap_or(4);
    let w1 = table.iter().map(|r| r.1.len()).max().unwrap_or(2).max(2);
    let w2 = table.iter().map(|r| r.2.len()).max().unwrap_or(3).max(3);
    out += &format!(
        "{:<w0$}  {:>w1$}  {:>w2$}  {}\n",
        "term", "GB", "GiB", "formula"
    );
    for r in table {
        out += &format!("{:<w0$}  {:>w1$}  {:>w2$}  {}\n", r.0, r.1, r.2, r.3);
    }
    for n in e.notes.iter().chain(&p.notes) {
        out += &format!("note: {n}\n");
    }
    for c in &p.changes {
        out += &format!(
            "auto_fit: {} {} → {} ({}); peak after {}\n",
            c.setting, c.from, c.to, c.reason, c.peak_after
        );
    }
    if !p.suggestion.is_empty() {
        out += "would fit with (set memory.auto_fit: true to apply, or change the config):\n";
        for c in &p.suggestion {
            out += &format!(
                "  {} {} → {} ({}); peak after {}\n",
                c.setting, c.from, c.to, c.reason, c.peak_after
            );
        }
    }
    out += &p.verdict();
    out
}

/// The FLUX plan as text: image and text tokens, what is cached, swapped and stored how, one
/// row per memory term that applies, the caching phase, the totals, notes and the verdict.
///
/// A plan without FLUX detail is printed by [`Plan::report`].
pub fn flux_report(p: &Plan) -> String {
    let Some(d) = &p.estimate.flux else {
        return p.report();
    };
    let s = &p.settings;
    let e = &p.estimate;
    let b = &e.breakdown;
    let cuda = s.device.is_cuda();
    let mut out = format!("plan: {} ({}) — FLUX.1 LoRA\n", p.model, p.model_source);
    out += &format!(
        "  device {}  transformer {}  mixed precision {}  LoRA r{} α{} on {} module kinds\n",
        if cuda { "cuda" } else { "cpu" },
        s.base_dtype.name(),
        s.mixed_precision.name(),
        s.lora.rank,
        s.lora.alpha,
        s.lora.target_modules.len()
    );
    out += &format!(
        "  image {}×{} px → {} image tokens + {} T5 tokens  micro_batch {} × gradient_accumulation_steps {}  gradient checkpointing {}  optimizer {:?}\n",
        d.image_size[0],
        d.image_size[1],
        d.image_tokens,
        d.text_tokens,
        s.micro_batch,
        s.gradient_accumulation_steps,
        yes_no(s.gradient_checkpointing),
        s.optimizer
    );
    out += &format!(
        "  blocks_to_swap {} ({} double + {} single blocks in host memory, {})  T5 {}  latents and text-encoder outputs cached: {}\n",
        s.blocks_to_swap,
        d.swapped_blocks[0],
        d.swapped_blocks[1],
        d.host_bytes,
        s.text_encoder_dtype
            .map_or_else(|| "16-bit".to_string(), |t| t.name()),
        match (
            s.cache_latents && !s.random_crop,
            s.cache_text_encoder_outputs && !s.varying_captions,
        ) {
            (true, true) => "yes",
            (true, false) => "latents only",
            (false, true) => "text-encoder outputs only",
            (false, false) => "no",
        }
    );
    let mut rows: Vec<(&str, Bytes, String)> = vec![
        (
            "transformer weights",
            d.transformer_weights,
            if s.blocks_to_swap > 0 {
                "blocks on the device + one staging block".into()
            } else {
                format!("params × {} B", s.base_dtype.bytes_per_param())
            },
        ),
        (
            "text-encoder weights",
            d.text_encoder_weights,
            if d.text_encoder_weights.0 == 0 {
                "not on the device in training (outputs cached)".into()
            } else {
                "T5-XXL + CLIP-L on the device".into()
            },
        ),
        (
            "autoencoder weights",
            d.vae_weights,
            if d.vae_weights.0 == 0 {
                "not on the device in training (latents cached)".into()
            } else {
                "16-bit".into()
            },
        ),
    ];
    rows.extend(trainable_rows(p));
    rows.extend([
        (
            "transformer activations",
            d.transformer_activations,
            if s.gradient_checkpointing {
                "block inputs + one recomputed block, × images".into()
            } else {
                "saved tensors of 19 double + 38 single blocks, × images".into()
            },
        ),
        (
            "dequantized layer",
            b.framework_buffers,
            "one fp8/quantized linear decoded at a time".into(),
        ),
        (
            "batch data",
            b.batch_data,
            "packed latents, noise, target + T5/CLIP embeddings (fp32)".into(),
        ),
    ]);
    rows.extend(sample_images_row(
        p,
        "transformer",
        d.image_size,
        d.sample_images,
    ));
    rows.extend(runtime_rows(p));
    rows.extend([(
        "caching phase (process)",
        d.caching_peak,
        "before training: T5 + CLIP, then the autoencoder, alone on the device".into(),
    )]);
    out += &rows_and_verdict(p, rows);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_data_is_judged_on_the_cpu_and_leaves_a_cuda_plan_as_it_was() {
        let desc = ModelDescriptor::preset("SD1.5").unwrap();
        let kept = lora_memory::KeptData {
            latents: 8_000,
            captions: 8_000,
            eval_samples: 8,
        };
        let plan = |s: Settings, budget: Option<Budget>| {
            let e = lora_memory::estimate(&desc, &s).unwrap();
            Plan::new(desc.clone(), "preset".into(), s, e, budget)
        };
        let cpu = Settings::default()
            .with_target_modules(&["to_q", "to_v"])
            .with_device(lora_memory::Device::cpu());
        // a budget the plan fits (with its 256 MiB safety margin) without the kept data and not
        // with it: 8,000 images' 64×64 latents and 77×768 prompt embeddings in 16 bit, ≈ 1.1 GB
        let peak = plan(cpu.clone(), None).estimate.peak;
        let budget = Budget::parse(&format!("{}B", peak.0 + (300 << 20))).unwrap();
        let before = plan(cpu.clone(), Some(budget.clone()));
        assert_eq!(before.fits, Some(true));
        let after = before.with_kept_data(kept).unwrap();
        let bytes = after.estimate.breakdown.kept_data.0;
        assert!(bytes > 1_000_000_000, "{bytes}");
        assert_eq!(after.estimate.peak.0, peak.0 + bytes);
        assert_eq!(after.settings.kept_data, Some(kept));
        assert_eq!(after.fits, Some(false), "{:?}", after.check);
        // on CUDA the caches are host memory: the estimate and the fitting findings stay
        let mut gpu = plan(cpu.with_device(lora_memory::Device::cuda()), None);
        gpu.suggestion = vec![Change {
            setting: "micro_batch".into(),
            from: "2".into(),
            to: "1".into(),
            reason: "a test".into(),
            peak_after: Bytes(1),
        }];
        let same = gpu.clone().with_kept_data(kept).unwrap();
        assert_eq!(same.estimate, gpu.estimate);
        assert_eq!(same.suggestion, gpu.suggestion);
        assert_eq!(same.settings.kept_data, Some(kept));
    }

    #[test]
    fn fp16_planned_for_the_cpu_says_that_train_refuses_it() {
        let cfg = TrainConfig::from_yaml_str("train: {mixed_precision: fp16}\n").unwrap();
        let refused = |cuda: bool| {
            settings_for(&cfg, None, cuda)
                .1
                .into_iter()
                .find(|n| n.contains("refuses"))
        };
        let note = refused(false).expect("a note on the CPU");
        assert!(
            note.starts_with("train.mixed_precision \"fp16\" on the CPU") && note.contains("bf16"),
            "{note}"
        );
        assert_eq!(refused(true), None);
        let bf16 = TrainConfig::from_yaml_str("train: {mixed_precision: bf16}\n").unwrap();
        assert!(
            settings_for(&bf16, None, false)
                .1
                .iter()
                .all(|n| !n.contains("refuses"))
        );
    }

    #[test]
    fn settings_follow_the_config() {
        let mut cfg = TrainConfig::from_yaml_str(
            "lora: {rank: 16, alpha: 32}\ntrain: {batch_size: 4, gradient_accumulation_steps: 2, optimizer: AdamW8bit, mixed_precision: bf16}\ndata: {seq_len: 512}\n",
        )
        .unwrap();
        let (s, _) = settings_for(&cfg, Some(BaseDtype::Q4_1), false);
        assert_eq!(
            (
                s.lora.rank,
                s.micro_batch,
                s.gradient_accumulation_steps,
                s.seq_len
            ),
            (16, 4, 2, 512)
        );
        assert_eq!(s.optimizer, lora_memory::Optimizer::AdamW8bit);
        assert_eq!(s.mixed_precision, MixedPrecision::Bf16);
        assert_eq!(s.base_dtype, BaseDtype::F32, "dense weights default to f32");
        assert!(!s.device.is_cuda());
        cfg.model.weights = BaseWeights::Quantized;
        let (s, _) = settings_for(&cfg, Some(BaseDtype::Q4_1), true);
        assert_eq!(s.base_dtype, BaseDtype::Q4_1);
        assert!(s.device.is_cuda());
    }
}
