//! proptest invariants of `estimate` and `fit`.

use lora_memory::{
    Attention, BaseDtype, Bytes, Check, MixedPrecision, ModelDescriptor, Optimizer, Profile,
    Settings, estimate, fit, max_micro_batch,
};
use proptest::prelude::*;

fn decoder() -> impl Strategy<Value = ModelDescriptor> {
    prop::sample::select(vec![
        "SmolLM2-135M",
        "Llama-3.2-1B",
        "Llama-2-7B",
        "Qwen3-8B",
        "Mistral-7B",
    ])
    .prop_map(|n| ModelDescriptor::preset(n).unwrap())
}

fn settings() -> impl Strategy<Value = Settings> {
    (
        prop::sample::select(vec![
            BaseDtype::F32,
            BaseDtype::Bf16,
            BaseDtype::Nf4 { double_quant: true },
            BaseDtype::Q4_1,
        ]),
        prop::sample::select(vec![
            MixedPrecision::No,
            MixedPrecision::Bf16,
            MixedPrecision::FullBf16,
        ]),
        1u32..16,
        prop::sample::select(vec![64u32, 128, 256, 512, 1024, 2048]),
        prop::sample::select(vec![4u32, 8, 16, 64]),
        any::<bool>(),
        prop::sample::select(vec![
            Optimizer::AdamW,
            Optimizer::AdamW8bit,
            Optimizer::Adafactor,
            Optimizer::Sgd { momentum: 0.9 },
        ]),
        prop::sample::select(vec![
            Profile::ours(),
            Profile::peft_transformers(),
            Profile::torchtune(),
            Profile::bitsandbytes_old(),
        ]),
        prop::sample::select(vec![Attention::Sdpa, Attention::Math]),
        prop::sample::select(vec![
            vec!["q_proj", "v_proj"],
            vec!["all-linear"],
            vec!["gate_proj", "down_proj"],
        ]),
    )
        .prop_map(|(dt, mp, mb, seq, rank, ck, opt, profile, attn, targets)| {
            Settings::default()
                .with_base_dtype(dt)
                .with_mixed_precision(mp)
                .with_micro_batch(mb)
                .with_seq_len(seq)
                .with_rank(rank)
                .with_gradient_checkpointing(ck)
                .with_optimizer(opt)
                .with_profile(profile)
                .with_attention(attn)
                .with_target_modules(&targets)
        })
}

fn peak(m: &ModelDescriptor, s: &Settings) -> Bytes {
    estimate(m, s).unwrap().peak
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn monotone_in_batch_seq_and_rank(m in decoder(), s in settings()) {
        let p = peak(&m, &s);
        prop_assert!(peak(&m, &s.clone().with_micro_batch(s.micro_batch + 1)) >= p);
        prop_assert!(peak(&m, &s.clone().with_seq_len(s.seq_len * 2)) >= p);
        prop_assert!(peak(&m, &s.clone().with_rank(s.lora.rank * 2)) >= p);
    }

    #[test]
    fn checkpointing_never_raises_the_peak(m in decoder(), s in settings()) {
        let off = peak(&m, &s.clone().with_gradient_checkpointing(false));
        let on = peak(&m, &s.clone().with_gradient_checkpointing(true));
        prop_assert!(on <= off, "{on} > {off}");
    }

    #[test]
    fn eight_bit_states_are_smaller_than_fp32_states(m in decoder(), s in settings()) {
        let b = estimate(&m, &s.clone().with_optimizer(Optimizer::AdamW8bit)).unwrap();
        // fp32 AdamW states: 2 × 4 B per trainable parameter. bitsandbytes keeps tensors under
        // 4096 elements (min_8bit_size) in 32 bit: 8-bit states are never larger, and strictly
        // smaller once an adapter matrix reaches that size.
        let fp32_states = Bytes(8 * b.trainable_params);
        prop_assert!(b.breakdown.optimizer_states <= fp32_states);
        let ModelDescriptor::Decoder(d) = &m else { unreachable!() };
        if d.hidden * u64::from(s.lora.rank) >= 4096 {
            prop_assert!(b.breakdown.optimizer_states < fp32_states);
        }
    }

    #[test]
    fn fit_results_re_estimate_within_budget(m in decoder(), s in settings(), gib in 2u64..48) {
        let budget = Bytes(gib << 30);
        if let Ok(f) = fit(&m, &s, budget) {
            let again = estimate(&m, &f.settings).unwrap();
            prop_assert!(again.peak <= budget);
            prop_assert_eq!(again.peak, f.estimate.peak);
            prop_assert_eq!(f.headroom, budget - again.peak);
            prop_assert_eq!(f.settings.effective_batch(), s.effective_batch());
        }
    }

    #[test]
    fn max_micro_batch_fits_and_the_next_does_not(m in decoder(), s in settings(), gib in 1u64..64) {
        let free = Bytes(gib << 30);
        let b = max_micro_batch(&m, &s, free).unwrap();
        let fits = |b: u32| Check::new(&estimate(&m, &s.clone().with_micro_batch(b)).unwrap(), free, Bytes::ZERO).fits();
        if b > 0 {
            prop_assert!(fits(b) && peak(&m, &s.clone().with_micro_batch(b)) <= free);
        }
        if b < 4096 {
            prop_assert!(!fits(b + 1));
        }
    }
}

fn diffusion_settings() -> impl Strategy<Value = Settings> {
    (
        1u32..4,
        prop::sample::select(vec![512u32, 768, 1024]),
        prop::sample::select(vec![4u32, 16, 32]),
        any::<bool>(),
        any::<bool>(),
        prop::sample::select(vec![Attention::Sdpa, Attention::Math]),
    )
        .prop_map(|(mb, res, rank, ck, te, attn)| {
            Settings::default()
                .with_base_dtype(BaseDtype::F16)
                .with_mixed_precision(MixedPrecision::Fp16)
                .with_micro_batch(mb)
                .with_resolution(res)
                .with_rank(rank)
                .with_gradient_checkpointing(ck)
                .with_train_text_encoder(te)
                .with_attention(attn)
                .with_target_modules(&["to_q", "to_k", "to_v", "to_out.0", "q_proj", "v_proj"])
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn diffusion_is_monotone_in_resolution_batch_and_rank(sdxl in any::<bool>(), s in diffusion_settings()) {
        let m = ModelDescriptor::preset(if sdxl { "SDXL" } else { "SD1.5" }).unwrap();
        let p = peak(&m, &s);
        prop_assert!(peak(&m, &s.clone().with_resolution(s.resolution + 128)) >= p);
        prop_assert!(peak(&m, &s.clone().with_micro_batch(s.micro_batch + 1)) >= p);
        prop_assert!(peak(&m, &s.clone().with_rank(s.lora.rank * 2)) >= p);
        prop_assert!(peak(&m, &s.clone().with_gradient_checkpointing(true)) <= peak(&m, &s.clone().with_gradient_checkpointing(false)));
    }
}
