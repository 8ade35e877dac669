//! End-to-end planning: headers → descriptor → estimate → fit against GPU presets.

use lora_memory::safetensors_header::write_test_file;
use lora_memory::{
    Budget, Bytes, Device, FitError, Method, Metric, MixedPrecision, ModelDescriptor, Optimizer,
    Settings, estimate, fit,
};

#[test]
fn sdxl_single_file_and_diffusers_unet_headers_are_recognised() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("sdxl.safetensors");
    write_test_file(
        &single,
        &[
            (
                "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight",
                "F16",
                &[640, 2048],
            ),
            (
                "conditioner.embedders.0.transformer.text_model.final_layer_norm.weight",
                "F16",
                &[768],
            ),
            (
                "conditioner.embedders.1.model.ln_final.weight",
                "F16",
                &[1280],
            ),
        ],
    )
    .unwrap();
    let ModelDescriptor::Diffusion(d) = ModelDescriptor::from_safetensors(&single).unwrap() else {
        panic!()
    };
    assert_eq!(d.family, lora_memory::model::DiffusionFamily::Sdxl);
    assert_eq!(d.unet_params, 640 * 2048);
    assert_eq!(d.text_encoders[1].params, 1280);

    let unet_dir = dir.path().join("unet");
    std::fs::create_dir(&unet_dir).unwrap();
    write_test_file(
        &unet_dir.join("diffusion_pytorch_model.safetensors"),
        &[
            (
                "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight",
                "F32",
                &[320, 768],
            ),
            ("conv_in.weight", "F32", &[320, 4, 3, 3]),
        ],
    )
    .unwrap();
    let ModelDescriptor::Diffusion(u) = ModelDescriptor::from_safetensors(&unet_dir).unwrap()
    else {
        panic!()
    };
    assert_eq!(u.family, lora_memory::model::DiffusionFamily::Sd1);
    assert_eq!(u.unet_params, 320 * 768 + 320 * 36);
}

#[test]
fn sdxl_lora_fits_a_3060_after_the_ladder_and_reports_each_change() {
    let m = ModelDescriptor::preset("SDXL").unwrap();
    let s = Settings::default()
        .with_base_dtype(lora_memory::BaseDtype::F32)
        .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0"])
        .with_rank(32)
        .with_resolution(1024)
        .with_micro_batch(4);
    let budget = Budget::gpu("RTX 3060").unwrap();
    let before = estimate(&m, &s).unwrap();
    assert!(
        before.peak > budget.bytes,
        "the starting config must not fit: {}",
        before.peak
    );
    let f = fit(&m, &s, budget.bytes).unwrap();
    assert!(f.estimate.peak <= budget.bytes);
    let names: Vec<&str> = f.changes.iter().map(|c| c.setting.as_str()).collect();
    assert_eq!(names[0], "micro_batch × gradient_accumulation_steps");
    assert!(
        names.contains(&"mixed_precision") && names.contains(&"gradient_checkpointing"),
        "{names:?}"
    );
    assert_eq!(f.settings.effective_batch(), 4);
    assert_eq!(f.settings.mixed_precision, MixedPrecision::Bf16);
}

#[test]
fn a_13b_full_fine_tune_does_not_fit_a_t4_and_says_how_close_it_got() {
    let m = ModelDescriptor::preset("Llama-2-13B").unwrap();
    let s = Settings::default().with_method(Method::Full);
    match fit(&m, &s, Budget::gpu("T4").unwrap().bytes) {
        Err(FitError::DoesNotFit {
            smallest_peak,
            settings,
            changes,
            ..
        }) => {
            // bf16 weights alone are 26 GB.
            assert!(smallest_peak > Bytes(26_000_000_000));
            // Weights, gradients and states dominate: the optimizer rungs are kept, and every
            // kept change saved at least 1% of the peak before it.
            assert_eq!(settings.optimizer, Optimizer::Adafactor);
            assert!(!changes.is_empty());
            let mut prev = estimate(&m, &s).unwrap().peak;
            for c in &changes {
                assert!(c.peak_after.0 + prev.0 / 100 <= prev.0, "{c:?}");
                prev = c.peak_after;
            }
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn cpu_estimates_predict_process_rss_and_the_step_delta() {
    let m = ModelDescriptor::preset("SmolLM2-135M").unwrap();
    let s = Settings::default()
        .with_base_dtype(lora_memory::BaseDtype::F32)
        .with_micro_batch(4)
        .with_seq_len(256)
        .with_device(Device::cpu());
    let e = estimate(&m, &s).unwrap();
    assert_eq!(e.metric, Metric::Process);
    assert_eq!(e.breakdown.allocator_margin, Bytes(0));
    assert_eq!(e.breakdown.context_workspace, Bytes(510_000_000));
    assert_eq!(e.peak, e.peak_allocated + Bytes(510_000_000));
    // A CPU plan speaks of the CPU runtime and RSS, not of CUDA.
    let table = e.to_table();
    assert!(table.contains("CPU runtime"), "{table}");
    assert!(table.contains("process peak RSS"), "{table}");
    assert!(!table.contains("CUDA"), "{table}");
    // The step delta excludes the weights and adapters loaded before the steps, and adds the
    // libraries' buffers.
    assert_eq!(
        e.step_delta,
        e.peak_allocated - e.breakdown.base_weights - e.breakdown.adapter_params
            + lora_memory::estimate::CPU_STEP_RUNTIME
    );
    // fp32 weights of SmolLM2: 134,515,008 × 4 B.
    assert_eq!(e.breakdown.base_weights, Bytes(134_515_008 * 4));
}

#[test]
fn fit_keeps_only_changes_that_save_memory() {
    // Llama-2-7B bf16, batch 8 × 2048 on a 12 GiB card: the optimizer and rank rungs save under
    // 1% each (a 7B model's adapters are tiny next to its activations), so they are not kept.
    let m = ModelDescriptor::preset("Llama-2-7B").unwrap();
    let s = Settings::default()
        .with_base_dtype(lora_memory::BaseDtype::Bf16)
        .with_micro_batch(8)
        .with_seq_len(2048);
    let f = fit(&m, &s, Budget::gpu("RTX 3060").unwrap().bytes).unwrap();
    let kept: Vec<&str> = f.changes.iter().map(|c| c.setting.as_str()).collect();
    assert!(!kept.contains(&"optimizer"), "{kept:?}");
    assert!(!kept.contains(&"lora.rank"), "{kept:?}");
    assert!(kept.contains(&"gradient_checkpointing"), "{kept:?}");
    assert_eq!(f.settings.optimizer, Optimizer::AdamW);
    assert!(f.estimate.peak <= Budget::gpu("RTX 3060").unwrap().bytes);
    let mut prev = estimate(&m, &s).unwrap().peak;
    for c in &f.changes {
        assert!(
            c.peak_after.0 + prev.0 / 100 <= prev.0 || c.peak_after <= f.estimate.peak,
            "{c:?} saves under 1%"
        );
        prev = c.peak_after;
    }
}
