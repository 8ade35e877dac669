//! Out-of-memory back-off on CPU: under a CPU allocation limit (the shim's counting allocator)
//! a step whose micro-batch does not fit fails inside libtorch with "DefaultCPUAllocator: can't
//! allocate memory"; the trainer drops the step's tensors, halves the micro-batch, doubles the
//! accumulation and retries the same step. One test per process: the limit is process-wide.

use crate::engine_common;

use std::sync::{Arc, Mutex};

use engine_common::{ToyData, ToyLora};
use lora_core::sys;
use lora_train::engine::callbacks::{Callback, TrainEvent};
use lora_train::engine::optim::{OptimizerKind, SgdConfig};
use lora_train::engine::{Resume, Trainer, TrainerConfig};

#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<TrainEvent>>>);

impl Callback for Events {
    fn on_event(&mut self, e: &TrainEvent) -> lora_train::engine::Result<()> {
        self.0.lock().unwrap().push(e.clone());
        Ok(())
    }
}

fn run(limit: Option<u64>) -> (ToyLora, lora_train::engine::TrainReport, Vec<TrainEvent>) {
    run_with(limit, false)
}

fn run_with(
    limit: Option<u64>,
    scalar_op: bool,
) -> (ToyLora, lora_train::engine::TrainReport, Vec<TrainEvent>) {
    tch::set_num_threads(1);
    let mut task = ToyLora::new();
    task.scratch_with_scalar_op = scalar_op;
    task.dropout = 0.0;
    // 1 MiB of simulated activations per sample: a batch of 16 needs 16 MiB.
    task.scratch_bytes_per_sample = 1 << 20;
    let mut data = ToyData::new(32, 16, 5);
    let cfg = TrainerConfig {
        lr: 0.05,
        optimizer: OptimizerKind::Sgd(SgdConfig::default()),
        scheduler: lora_train::engine::sched::SchedulerKind::Constant,
        epochs: 2,
        max_grad_norm: None,
        ..Default::default()
    };
    let ev = Events::default();
    let mut trainer: Trainer<ToyLora> = Trainer::new(cfg);
    trainer.add_callback(Box::new(ev.clone()));
    let _guard = limit.map(|l| {
        let base = sys::cpu_mem_stats().unwrap().current_bytes;
        sys::CpuAllocLimitGuard::new(base + l).unwrap()
    });
    let report = trainer.fit(&mut task, &mut data, Resume::No).unwrap();
    let events = ev.0.lock().unwrap().clone();
    (task, report, events)
}

#[test]
fn cpu_oom_halves_the_micro_batch_and_retries_the_same_step() {
    let _l = crate::serial();
    sys::install_counting_cpu_allocator().unwrap();
    let (free, free_report, _) = run(None);
    assert_eq!(free_report.oom_backoffs, 0);
    // 12 MiB over the baseline: 16 samples (16 MiB) fail, 8 (8 MiB) fit.
    let (limited, report, events) = run(Some(12 << 20));
    assert_eq!(report.steps, free_report.steps, "no step was lost");
    assert_eq!(report.oom_backoffs, 1);
    assert_eq!(report.micro_batch_split, 2);
    match &events[0] {
        TrainEvent::OomBackoff {
            step,
            micro_batch_split,
            message,
        } => {
            assert_eq!((*step, *micro_batch_split), (1, 2));
            assert!(message.contains("can't allocate memory"), "{message}");
        }
        other => panic!("unexpected event {other:?}"),
    }
    // Same effective batch: the adapters match the unconstrained run up to summation order.
    for (a, b) in free.trainable_bits().iter().zip(limited.trainable_bits()) {
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * (1.0 + x.abs()), "{x} vs {y}");
        }
    }
    // A limit too small even for one sample ends the run with an OutOfMemory error.
    tch::set_num_threads(1);
    let mut task = ToyLora::new();
    task.scratch_bytes_per_sample = 1 << 20;
    let mut data = ToyData::new(32, 16, 5);
    let mut trainer: Trainer<ToyLora> = Trainer::new(TrainerConfig::default());
    let base = sys::cpu_mem_stats().unwrap().current_bytes;
    let _g = sys::CpuAllocLimitGuard::new(base + (512 << 10)).unwrap();
    let err = trainer.fit(&mut task, &mut data, Resume::No).unwrap_err();
    assert!(err.is_oom(), "{err}");
    assert!(err.to_string().contains("micro-batch 1"), "{err}");
}

#[test]
fn oom_inside_an_op_taking_a_scalar_backs_off_too() {
    // tch reports a failure inside such an op (here `f_full`) as a panic, not an Err; the trainer
    // turns it back into an out-of-memory error and takes the same back-off path.
    let _l = crate::serial();
    sys::install_counting_cpu_allocator().unwrap();
    let (_, report, events) = run_with(Some(12 << 20), true);
    assert_eq!(report.oom_backoffs, 1, "{events:?}");
    assert_eq!(report.micro_batch_split, 2);
    assert!(
        matches!(&events[0], TrainEvent::OomBackoff { message, .. } if message.contains("can't allocate memory"))
    );
}
