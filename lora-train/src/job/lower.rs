//! One lowering of a [`TrainConfig`] to the settings of the layers below it: the engine's
//! [`crate::engine::TrainerConfig`] and lora-core's [`lora_core::config::LoraConfig`].

use crate::config::TrainConfig;
use crate::job::error::{During, Result};
use std::path::Path;

/// The engine's settings for a config.
///
/// # Errors
/// [`JobError::Json`](crate::job::JobError::Json) when the config cannot be recorded in the
/// checkpoints.
pub fn trainer_config(
    cfg: &TrainConfig,
    device: tch::Device,
    out_dir: &Path,
    total_steps: u64,
) -> Result<crate::engine::TrainerConfig> {
    let t = &cfg.train;
    let (optimizer, scheduler) = cfg.optimizer_and_schedule().during("reading the config")?;
    Ok(crate::engine::TrainerConfig {
        lr: t.learning_rate,
        optimizer,
        scheduler,
        warmup_steps: warmup_steps(t, total_steps),
        epochs: u64::from(t.epochs),
        max_steps: Some(total_steps),
        gradient_accumulation_steps: t.gradient_accumulation_steps.max(1) as usize,
        max_grad_norm: (t.max_grad_norm > 0.0).then_some(t.max_grad_norm),
        precision: t.mixed_precision,
        device,
        non_finite: t.nan_policy,
        checkpoint_dir: Some(out_dir.join("checkpoints")),
        save_every_n_steps: t.save_every_n_steps,
        save_every_n_epochs: t.save_every_n_epochs.map(u64::from),
        keep_last: t.keep_last_checkpoints.max(1) as usize,
        seed: Some(cfg.system.seed),
        track_cpu_memory: true,
        cpu_cache: cfg.memory.cpu_cache,
        run_config: serde_json::to_value(cfg).during("serializing the config")?,
        ..crate::engine::TrainerConfig::default()
    })
}

/// The warmup steps of a run of `total_steps` optimizer steps: `ceil(warmup_ratio · total)`
/// when `train.warmup_ratio` is set (transformers' `TrainingArguments.get_warmup_steps`), else
/// `train.warmup_steps`.
pub fn warmup_steps(t: &crate::config::TrainSection, total_steps: u64) -> u64 {
    match t.warmup_ratio {
        Some(r) => (r * total_steps as f64).ceil() as u64,
        None => t.warmup_steps,
    }
}

/// The warning for a warm-up that covers the whole run: with `warmup` ≥ `total_steps` optimizer
/// steps, a schedule with warm-up (every kind but `constant`) never reaches
/// `train.learning_rate`, and its first update runs at learning rate 0 (transformers' warm-up
/// lambda `step / warmup` at step 0) — a one-step run changes nothing. `None` when the run
/// leaves its warm-up (or has none).
pub fn warmup_warning(
    kind: &crate::engine::sched::SchedulerKind,
    warmup: u64,
    total_steps: u64,
) -> Option<String> {
    if warmup == 0
        || total_steps == 0
        || warmup < total_steps
        || *kind == crate::engine::sched::SchedulerKind::Constant
    {
        return None;
    }
    let reach = if total_steps == 1 {
        "the only step runs at learning rate 0, so training changes nothing".to_string()
    } else {
        format!(
            "the learning rate only reaches {:.0}% of train.learning_rate (the first step runs at 0)",
            100.0 * (total_steps - 1) as f64 / warmup as f64
        )
    };
    Some(format!(
        "warning: {warmup} warm-up steps cover all {total_steps} optimizer steps of this run: \
         {reach}; lower train.warmup_steps (or train.warmup_ratio) or raise train.max_steps"
    ))
}

/// The PEFT `LoraConfig` of a run.
///
/// # Errors
/// [`JobError::Lora`](crate::job::JobError::Lora) when lora-core rejects the settings.
pub fn lora_config(cfg: &TrainConfig, base_model: &str) -> Result<lora_core::config::LoraConfig> {
    let c = cfg.lora.to_lora_config(
        cfg.lora.target_modules.clone(),
        base_model,
        Some("CAUSAL_LM"),
    );
    c.validate().during("validating the LoRA config")?;
    Ok(c)
}

/// The SGD momentum a config trains with: `train.momentum`, else the engine's default for the
/// optimizer's name (`SGD` 0 as `torch.optim.SGD`, `SGDNesterov`
/// [`NESTEROV_MOMENTUM`](crate::engine::optim::NESTEROV_MOMENTUM)). The memory plan uses the same
/// number (a momentum buffer exists only when it is above 0).
pub fn sgd_momentum(t: &crate::config::TrainSection) -> f64 {
    t.momentum.unwrap_or(t.optimizer.default_momentum())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::optim::{AdamWConfig, OptimizerKind as O, SgdConfig};
    use crate::engine::{NonFinitePolicy, TrainerConfig};

    fn lowered(cfg: &TrainConfig) -> TrainerConfig {
        trainer_config(cfg, tch::Device::Cpu, Path::new("out"), 10).unwrap()
    }

    #[test]
    fn a_warmup_over_the_whole_run_is_a_warning() {
        use crate::engine::sched::SchedulerKind as K;
        let cosine = K::Cosine { num_cycles: 0.5 };
        let one = warmup_warning(&cosine, 2, 1).unwrap();
        assert!(one.contains("2 warm-up steps cover all 1"), "{one}");
        assert!(
            one.contains("changes nothing") && one.contains("train.warmup_steps"),
            "{one}"
        );
        // 10 warm-up steps over 5: the last update (step 4) runs at 4/10 of the rate
        let five = warmup_warning(&K::Linear, 10, 5).unwrap();
        assert!(five.contains("40%"), "{five}");
        assert_eq!(warmup_warning(&cosine, 4, 5), None);
        assert_eq!(warmup_warning(&cosine, 0, 1), None);
        assert_eq!(warmup_warning(&K::Constant, 10, 5), None);
        assert_eq!(warmup_warning(&K::ConstantWithWarmup, 5, 0), None);
        assert!(warmup_warning(&K::ConstantWithWarmup, 5, 5).is_some());
    }

    #[test]
    fn the_config_defaults_are_the_engine_defaults() {
        let from_yaml = TrainConfig::from_yaml_str("{}\n").unwrap();
        let from_toml = TrainConfig::from_toml_str("").unwrap();
        let engine = TrainerConfig::default();
        for cfg in [TrainConfig::default(), from_yaml, from_toml] {
            let t = lowered(&cfg);
            assert_eq!(t.optimizer, engine.optimizer);
            assert_eq!(t.optimizer, O::AdamW(AdamWConfig::default()));
            assert_eq!(t.scheduler, engine.scheduler);
            assert_eq!(t.non_finite, engine.non_finite);
            assert_eq!(t.non_finite, NonFinitePolicy::Skip);
            assert_eq!(t.lr, engine.lr);
            assert_eq!(t.warmup_steps, engine.warmup_steps);
            assert_eq!(t.epochs, engine.epochs);
            assert_eq!(
                t.gradient_accumulation_steps,
                engine.gradient_accumulation_steps
            );
            assert_eq!(t.max_grad_norm, engine.max_grad_norm);
            assert_eq!(t.precision, engine.precision);
            assert_eq!(t.keep_last, engine.keep_last);
            assert_eq!(t.save_every_n_steps, engine.save_every_n_steps);
        }
    }

    #[test]
    fn sgd_nesterov_from_a_config_is_nesterov_sgd_as_the_engine_names_it() {
        let engine = crate::engine::optim::OptimizerKind::from_name("SGDNesterov").unwrap();
        for cfg in [
            TrainConfig::from_yaml_str("optimizer_type: SGDNesterov\n").unwrap(),
            TrainConfig::from_toml_str("optimizer_type = \"SGDNesterov\"\n").unwrap(),
        ] {
            let t = lowered(&cfg);
            assert_eq!(t.optimizer, engine);
            assert_eq!(
                t.optimizer,
                O::Sgd(SgdConfig {
                    momentum: 0.9,
                    nesterov: true,
                    ..SgdConfig::default()
                })
            );
        }
        let plain = lowered(&TrainConfig::from_yaml_str("optimizer_type: SGD\n").unwrap());
        assert_eq!(
            plain.optimizer,
            crate::engine::optim::OptimizerKind::from_name("SGD").unwrap(),
            "SGD from a config is the engine's SGD (no momentum unless set)"
        );
        let set = lowered(
            &TrainConfig::from_yaml_str("optimizer_type: SGD\ntrain:\n  momentum: 0.5\n").unwrap(),
        );
        assert!(matches!(set.optimizer, O::Sgd(SgdConfig { momentum, .. }) if momentum == 0.5));
        assert!(matches!(
            plain.optimizer,
            O::Sgd(SgdConfig {
                nesterov: false,
                ..
            })
        ));
    }
}
