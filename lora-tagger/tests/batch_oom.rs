//! Adaptive batching under a real CPU memory limit: the shim's counting allocator
//! (`lora_core::sys::set_cpu_alloc_limit`) makes libtorch's allocator fail with "can't allocate
//! memory" past the limit, exactly as a full machine would. One test in this file: the limit is
//! process-wide.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use lora_core::sys;
use lora_tagger::batch::{AdaptiveBatcher, BatchEvent};
use lora_tagger::config::TaggerConfig;
use lora_tagger::{Error, ImageTagger, Tagger};
use tch::{Device, Kind, Tensor};

fn assets() -> PathBuf {
    PathBuf::from(std::env::var_os("LORA_SDK_ASSETS").unwrap_or_else(|| "../assets".into()))
}

fn current() -> u64 {
    sys::cpu_mem_stats().unwrap().current_bytes
}

/// Collects the batcher's events as text.
fn recorder() -> (Arc<Mutex<Vec<String>>>, lora_tagger::batch::BatchCallback) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    let cb = Box::new(move |e: &BatchEvent| l.lock().unwrap().push(e.to_string()));
    (log, cb)
}

#[test]
fn out_of_memory_halves_the_batch_and_the_first_batch_fits() {
    sys::install_counting_cpu_allocator().unwrap();
    tch::set_num_threads(1);

    // 1. The driver alone: each item needs 1 MiB of tensor memory.
    let items: Vec<i64> = (0..40).collect();
    let work = |chunk: &[i64]| -> lora_tagger::Result<Vec<i64>> {
        let scratch = Tensor::f_ones([chunk.len() as i64, 1 << 18], (Kind::Float, Device::Cpu))?;
        let per_item = scratch.f_sum_dim_intlist(1, false, Kind::Float)?; // 262144 each
        // Tensor-only ops: tch's scalar-taking `f_*` ops panic instead of returning an error.
        let x = Tensor::f_from_slice(chunk)?;
        let s = per_item.f_to_kind(Kind::Int64)?;
        let y = x.f_add(&x)?.f_add(&s)?.f_sub(&s)?;
        Ok(Vec::<i64>::try_from(&y)?)
    };
    {
        let _limit = sys::CpuAllocLimitGuard::new(current() + (6 << 20)).unwrap();
        let mut b = AdaptiveBatcher::new(16, Device::Cpu);
        let (log, cb) = recorder();
        b.set_callback(Some(cb));
        let out = b.run(&items, "toy", work).unwrap();
        assert_eq!(out, items.iter().map(|x| x * 2).collect::<Vec<_>>());
        // 16 MiB and 8 MiB do not fit in 6 MiB; 4 MiB does.
        assert_eq!((b.halvings(), b.micro_batch()), (2, 4));
        let log = log.lock().unwrap();
        assert!(
            log[0].contains("micro-batch 16, retrying with 8")
                && log[0].contains("can't allocate memory"),
            "{log:?}"
        );
        assert!(log[1].contains("micro-batch 8, retrying with 4"), "{log:?}");
        assert_eq!(log.len(), 2 + 10, "two back-offs, then 10 batches of 4");
    }
    {
        // Not even one item fits: OutOfMemory naming the model.
        let _limit = sys::CpuAllocLimitGuard::new(current() + (512 << 10)).unwrap();
        let mut b = AdaptiveBatcher::new(4, Device::Cpu);
        let err = b.run(&items, "toy", work).unwrap_err();
        assert!(matches!(err, Error::OutOfMemory { .. }), "{err:?}");
        assert!(err.to_string().contains("batch of 1 with toy"), "{err}");
    }

    // 2. The real MobileNetV2 tagger.
    let mut cfg = TaggerConfig::default();
    cfg.image.model = Some(assets().join("mobilenet_v2"));
    cfg.image.general_threshold = Some(0.05);
    cfg.model_settings.device = "cpu".into();
    cfg.generation_settings.max_batch_size = 4;
    let mut t = ImageTagger::from_config(&cfg).unwrap();
    let photos: Vec<PathBuf> = ["chelsea.png", "coffee.png", "rocket.jpg", "astronaut.png"]
        .iter()
        .map(|n| assets().join("skimage").join(n))
        .collect();
    t.set_plan_for_free_memory(false);
    // Peak tensor bytes of one image and of four in one batch, above the loaded weights.
    let base = current();
    sys::cpu_reset_peak().unwrap();
    t.tag_images(&photos[..1]).unwrap();
    let peak1 = sys::cpu_mem_stats().unwrap().peak_bytes - base;
    sys::cpu_reset_peak().unwrap();
    let free_run = t.tag_images(&photos).unwrap();
    let peak4 = sys::cpu_mem_stats().unwrap().peak_bytes - base;
    assert_eq!(t.last_micro_batch(), Some((4, 4, 0)));
    let marginal = (peak4 - peak1) / 3;
    let estimate = t.bytes_per_item();
    eprintln!(
        "peak 1 image {:.2} MiB, 4 images {:.2} MiB, marginal {:.2} MiB/image, estimate {:.2} MiB/image",
        peak1 as f64 / 1048576.0,
        peak4 as f64 / 1048576.0,
        marginal as f64 / 1048576.0,
        estimate as f64 / 1048576.0
    );
    // The estimate never underpredicts one image's peak, and is not wildly above it.
    assert!(
        estimate >= peak1 && estimate >= marginal,
        "{estimate} vs {peak1}/{marginal}"
    );
    assert!(estimate <= 3 * peak1, "{estimate} vs {peak1}");

    // Room for one image and a half: a batch of 4 fails, the tagger halves and retries, and the
    // tags equal the unconstrained run's.
    let limit = base + peak1 + marginal / 2;
    {
        let _limit = sys::CpuAllocLimitGuard::new(limit).unwrap();
        let (log, cb) = recorder();
        t.set_callback(Some(cb));
        let limited = t.tag_images(&photos).unwrap();
        let (start, last, halvings) = t.last_micro_batch().unwrap();
        assert_eq!(start, 4);
        assert!(halvings >= 1 && last < 4, "{:?}", t.last_micro_batch());
        for (a, b) in free_run.iter().zip(&limited) {
            let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.tag, y.tag);
                assert!(
                    (x.score - y.score).abs() < 1e-4,
                    "{} {} vs {}",
                    x.tag,
                    x.score,
                    y.score
                );
            }
        }
        let log = log.lock().unwrap();
        assert!(
            log.iter()
                .any(|l| l.contains("out of memory at micro-batch 4")),
            "{log:?}"
        );
        // Per-batch lines carry the resource snapshot.
        assert!(
            log.iter().any(|l| l.contains("RAM") && l.contains("limit")),
            "{log:?}"
        );
        t.set_callback(None);

        // Planning for the free memory (limit − live tensors) starts below 4 and never backs off.
        t.set_plan_for_free_memory(true);
        t.tag_images(&photos).unwrap();
        let (start, _, halvings) = t.last_micro_batch().unwrap();
        assert!(start < 4, "{start}");
        assert_eq!(halvings, 0, "the planned start fitted");
    }
}
