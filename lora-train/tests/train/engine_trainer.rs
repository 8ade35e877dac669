//! The training loop on a tiny LoRA task: learning, exact resume (bit-identical adapters and the
//! same learning rates), NaN/Inf policies, schedulers against transformers.

use crate::engine_common;

use std::sync::{Arc, Mutex};

use engine_common::{ToyData, ToyLora};
use lora_train::engine::callbacks::{Callback, Control, StepInfo, StopAfter, TrainEvent};
use lora_train::engine::checkpoint::{Checkpoint, CheckpointManager};
use lora_train::engine::optim::{AdamWConfig, OptimizerKind};
use lora_train::engine::sched::{Scheduler, SchedulerKind};
use lora_train::engine::{
    NonFinitePolicy, Resume, TrainError, TrainReport, Trainer, TrainerConfig,
};

#[derive(Clone, Default)]
struct Record(Arc<Mutex<Vec<StepInfo>>>, Arc<Mutex<Vec<TrainEvent>>>);

impl Callback for Record {
    fn on_step(&mut self, info: &StepInfo) -> lora_train::engine::Result<Control> {
        self.0.lock().unwrap().push(info.clone());
        Ok(Control::Continue)
    }
    fn on_event(&mut self, e: &TrainEvent) -> lora_train::engine::Result<()> {
        self.1.lock().unwrap().push(e.clone());
        Ok(())
    }
}

fn config(dir: Option<&std::path::Path>, optimizer: OptimizerKind) -> TrainerConfig {
    TrainerConfig {
        lr: 5e-2,
        optimizer,
        scheduler: SchedulerKind::Cosine { num_cycles: 0.5 },
        warmup_steps: 2,
        epochs: 3,
        gradient_accumulation_steps: 2,
        max_grad_norm: Some(1.0),
        checkpoint_dir: dir.map(|d| d.to_path_buf()),
        save_every_n_steps: Some(3),
        keep_last: 2,
        seed: Some(7),
        run_config: serde_json::json!({"task": "toy"}),
        ..Default::default()
    }
}

fn train(
    cfg: TrainerConfig,
    stop_after: Option<u64>,
    resume: Resume,
    rec: &Record,
) -> (ToyLora, TrainReport) {
    let mut task = ToyLora::new();
    let mut data = ToyData::new(40, 4, 3);
    let mut trainer: Trainer<ToyLora> = Trainer::new(cfg);
    trainer.add_callback(Box::new(rec.clone()));
    if let Some(k) = stop_after {
        trainer.add_callback(Box::new(StopAfter(k)));
    }
    let report = trainer.fit(&mut task, &mut data, resume).unwrap();
    (task, report)
}

#[test]
fn loss_goes_down() {
    let _serial = engine_common::serial();
    tch::set_num_threads(1);
    let rec = Record::default();
    let mut cfg = config(None, OptimizerKind::AdamW(AdamWConfig::default()));
    cfg.epochs = 6;
    let (_, report) = train(cfg, None, Resume::No, &rec);
    // 40 samples / batch 4 / accumulation 2 = 5 steps per epoch.
    assert_eq!(report.steps, 30);
    assert_eq!(report.epochs, 6);
    let first: f64 = report.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = report.losses[25..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    println!("toy loss: first epoch {first:.4}, last epoch {last:.4}");
    assert!(last < 0.8 * first, "loss did not drop: {first} -> {last}");
    let infos = rec.0.lock().unwrap();
    assert_eq!(infos[0].samples, 8);
    assert_eq!(infos[0].tokens, 64);
    assert_eq!(infos[0].lr, 0.0, "warm-up starts at 0");
    assert!(infos.iter().all(|i| i.grad_norm.unwrap().is_finite()));
    assert!(infos.last().unwrap().mem.cpu_peak_bytes > 0);
}

fn resume_is_bit_identical(optimizer: OptimizerKind, stop: u64) {
    let _serial = engine_common::serial();
    tch::set_num_threads(1);
    let rec_full = Record::default();
    let (full, full_report) = train(config(None, optimizer.clone()), None, Resume::No, &rec_full);

    let dir = tempfile::tempdir().unwrap();
    let rec_a = Record::default();
    let (_, ra) = train(
        config(Some(dir.path()), optimizer.clone()),
        Some(stop),
        Resume::No,
        &rec_a,
    );
    assert_eq!(ra.steps, stop);
    assert!(ra.stopped_early);
    // Scramble the global RNG between the runs: resume must restore it.
    let _ = tch::Tensor::randn([1000], (tch::Kind::Float, tch::Device::Cpu));
    let rec_b = Record::default();
    let (resumed, rb) = train(
        config(Some(dir.path()), optimizer),
        None,
        Resume::Latest,
        &rec_b,
    );
    assert_eq!(rb.resumed_from, Some(stop));
    assert_eq!(rb.steps, full_report.steps);
    for (a, b) in full.trainable_bits().iter().zip(resumed.trainable_bits()) {
        let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "resumed adapter differs from the uninterrupted run");
    }
    // The learning rate and loss of every step after the resume equal the uninterrupted run's.
    let full_infos = rec_full.0.lock().unwrap();
    let b_infos = rec_b.0.lock().unwrap();
    assert_eq!(b_infos.len() as u64, full_report.steps - stop);
    for b in b_infos.iter() {
        let f = &full_infos[(b.step - 1) as usize];
        assert_eq!(f.lr.to_bits(), b.lr.to_bits(), "lr at step {}", b.step);
        assert_eq!(
            f.loss.to_bits(),
            b.loss.to_bits(),
            "loss at step {}",
            b.step
        );
    }
    // keep_last = 2 checkpoints remain, the newest is the final step.
    let m = CheckpointManager::new(dir.path(), 2);
    let list = m.list().unwrap();
    assert_eq!(list.len(), 2);
    assert_eq!(list.last().unwrap().0, full_report.steps);
    let ck = Checkpoint::read_from(&list.last().unwrap().1).unwrap();
    assert_eq!(ck.config["task"], "toy");
    assert_eq!(ck.adapter.len(), 4);
}

#[test]
fn resume_mid_epoch_is_bit_identical_adamw() {
    resume_is_bit_identical(OptimizerKind::AdamW(AdamWConfig::default()), 7);
}

#[test]
fn resume_at_epoch_boundary_is_bit_identical_adamw8bit() {
    // 40 samples / batch 4 / accumulation 2 = 5 steps per epoch.
    resume_is_bit_identical(OptimizerKind::from_name("AdamW8bit").unwrap(), 10);
}

#[test]
fn resume_is_bit_identical_adafactor_and_sgd() {
    resume_is_bit_identical(OptimizerKind::from_name("Adafactor").unwrap(), 4);
    resume_is_bit_identical(OptimizerKind::from_name("SGDNesterov").unwrap(), 12);
}

fn nan_run(
    policy: NonFinitePolicy,
    dir: &std::path::Path,
) -> (Result<TrainReport, TrainError>, Record, ToyLora) {
    let _serial = engine_common::serial();
    tch::set_num_threads(1);
    let rec = Record::default();
    let mut cfg = config(Some(dir), OptimizerKind::AdamW(AdamWConfig::default()));
    cfg.non_finite = policy;
    cfg.save_every_n_steps = Some(1);
    cfg.epochs = 1;
    let mut task = ToyLora::new();
    // Call 5 = the first micro-batch of step 3.
    task.nan_on_call = Some(5);
    let mut data = ToyData::new(40, 4, 3);
    let mut trainer: Trainer<ToyLora> = Trainer::new(cfg);
    trainer.add_callback(Box::new(rec.clone()));
    let r = trainer.fit(&mut task, &mut data, Resume::No);
    (r, rec, task)
}

#[test]
fn nan_loss_skip_policy_skips_the_update_and_keeps_checkpoints_finite() {
    let dir = tempfile::tempdir().unwrap();
    let (r, rec, task) = nan_run(NonFinitePolicy::Skip, dir.path());
    let report = r.unwrap();
    assert_eq!(report.steps, 5);
    assert_eq!(report.skipped_steps, 1);
    let infos = rec.0.lock().unwrap();
    assert!(infos[2].skipped && infos[2].loss.is_nan());
    assert!(!infos[3].skipped);
    assert!(
        task.trainable_bits()
            .iter()
            .flatten()
            .all(|v| v.is_finite())
    );
    let events = rec.1.lock().unwrap();
    assert!(
        matches!(&events[0], TrainEvent::NonFinite { step: 3, action, .. } if action == "skip")
    );
    for (_, p) in CheckpointManager::new(dir.path(), 2).list().unwrap() {
        let ck = Checkpoint::read_from(&p).unwrap();
        for (_, t) in &ck.adapter {
            assert!(bool::try_from(t.isfinite().all()).unwrap());
        }
    }
}

#[test]
fn nan_loss_lower_lr_policy_halves_the_learning_rate() {
    let dir = tempfile::tempdir().unwrap();
    let (r, rec, _) = nan_run(NonFinitePolicy::LowerLr { factor: 0.5 }, dir.path());
    r.unwrap();
    let infos = rec.0.lock().unwrap();
    let sched = Scheduler::new(SchedulerKind::Cosine { num_cycles: 0.5 }, 5e-2, 2, 5).unwrap();
    assert_eq!(infos[1].lr, sched.lr_at(1));
    assert_eq!(infos[3].lr, 0.5 * sched.lr_at(3));
    assert_eq!(infos[4].lr, 0.5 * sched.lr_at(4));
}

#[test]
fn nan_loss_stop_policy_stops_with_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let (r, _, _) = nan_run(NonFinitePolicy::Stop, dir.path());
    let err = r.unwrap_err();
    assert!(
        matches!(
            err,
            TrainError::NonFinite {
                what: "loss",
                step: 3,
                ..
            }
        ),
        "{err}"
    );
    // The checkpoints written before the NaN are intact.
    let steps: Vec<u64> = CheckpointManager::new(dir.path(), 2)
        .list()
        .unwrap()
        .into_iter()
        .map(|s| s.0)
        .collect();
    assert_eq!(steps, vec![1, 2]);
}

#[test]
fn schedulers_match_transformers() {
    let _serial = crate::serial();
    let f: serde_json::Value =
        serde_json::from_str(include_str!("../fixtures/sched_ref.json")).unwrap();
    for case in f["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let mut kind = SchedulerKind::from_name(name).unwrap();
        match &mut kind {
            SchedulerKind::CosineWithRestarts { num_cycles } => {
                *num_cycles = case["kwargs"]["num_cycles"].as_f64().unwrap()
            }
            SchedulerKind::Polynomial { lr_end, power } => {
                *lr_end = case["kwargs"]["lr_end"].as_f64().unwrap();
                *power = case["kwargs"]["power"].as_f64().unwrap();
            }
            _ => {}
        }
        let s = Scheduler::new(kind, case["base_lr"].as_f64().unwrap(), 10, 100).unwrap();
        for (step, want) in case["lrs"].as_array().unwrap().iter().enumerate() {
            let want = want.as_f64().unwrap();
            let got = s.lr_at(step as u64);
            assert!(
                (got - want).abs() <= 1e-12 + 1e-9 * want.abs(),
                "{name} step {step}: {got} vs {want}"
            );
        }
    }
}

#[test]
fn bf16_autocast_trains_with_fp32_adapters_and_fp16_needs_cuda() {
    let _serial = engine_common::serial();
    tch::set_num_threads(1);
    let rec = Record::default();
    let mut cfg = config(None, OptimizerKind::AdamW(AdamWConfig::default()));
    cfg.epochs = 6;
    cfg.precision = lora_train::engine::precision::Precision::Bf16;
    let (task, report) = train(cfg, None, Resume::No, &rec);
    let first: f64 = report.losses[..5].iter().map(|l| l.1).sum::<f64>() / 5.0;
    let last: f64 = report.losses[25..].iter().map(|l| l.1).sum::<f64>() / 5.0;
    println!("toy loss with bf16 autocast: first epoch {first:.4}, last epoch {last:.4}");
    assert!(last < 0.8 * first, "loss did not drop: {first} -> {last}");
    for (_, t) in lora_train::engine::TrainStep::named_trainable(&task) {
        assert_eq!(t.kind(), tch::Kind::Float);
    }
    let mut fp16 = config(None, OptimizerKind::AdamW(AdamWConfig::default()));
    fp16.precision = lora_train::engine::precision::Precision::Fp16;
    let mut trainer: Trainer<ToyLora> = Trainer::new(fp16);
    let err = trainer
        .fit(&mut ToyLora::new(), &mut ToyData::new(8, 4, 1), Resume::No)
        .unwrap_err();
    assert!(err.to_string().contains("CUDA"), "{err}");
}

#[test]
fn resuming_a_finished_run_reports_its_steps_and_epochs() {
    let _serial = engine_common::serial();
    tch::set_num_threads(1);
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = config(
        Some(dir.path()),
        OptimizerKind::AdamW(AdamWConfig::default()),
    );
    cfg.save_every_n_steps = Some(1);
    let (_, full) = train(cfg.clone(), None, Resume::No, &Record::default());
    assert_eq!((full.steps, full.epochs), (15, 3));
    // the last checkpoint was taken at the epoch's last batch: nothing is left to train
    let (_, again) = train(cfg, None, Resume::Latest, &Record::default());
    assert_eq!(again.resumed_from, Some(15));
    assert_eq!((again.steps, again.epochs), (15, 3));
}
