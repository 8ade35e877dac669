//! Every public case of `memory-cases/PUBLIC.md` as a test: the prediction of the measured metric
//! (allocated / reserved / process / CPU RSS delta, GB vs GiB as published) must be within the
//! case's stated tolerance. `cargo run -p lora-memory --example cases` prints the same table.

use lora_memory::cases::{CaseGroup, evaluate, public_cases, summary};

fn check(id: &str) {
    let cases: Vec<_> = public_cases().into_iter().filter(|c| c.id == id).collect();
    assert_eq!(cases.len(), 1, "case {id} must exist exactly once");
    let r = evaluate(&cases).unwrap().remove(0);
    assert!(
        r.ok(),
        "{id}: predicted {:.3} GB vs measured {:.3} GB ({:?}): error {:+.1}% outside [{:+.0}%, {:+.0}%] — {}",
        r.predicted.gb(),
        r.case.measured.gb(),
        r.case.metric,
        100.0 * r.error,
        100.0 * r.case.tolerance.0,
        100.0 * r.case.tolerance.1,
        r.case.note
    );
}

macro_rules! case_test {
    ($name:ident, $id:expr) => {
        #[test]
        fn $name() {
            check($id);
        }
    };
}

case_test!(t1, "T1");
case_test!(t2, "T2");
case_test!(t3, "T3");
case_test!(t4, "T4");
case_test!(t6, "T6");
case_test!(t8, "T8");
case_test!(t7, "T7");
case_test!(t10, "T10");
case_test!(t12, "T12");
case_test!(p1, "P1");
case_test!(p2, "P2");
case_test!(p3, "P3");
case_test!(p4, "P4");
case_test!(p5, "P5");
case_test!(p1_max, "P1-max");
case_test!(p5_max, "P5-max");
case_test!(p1_persistent, "P1-persistent");
case_test!(p5_persistent, "P5-persistent");
case_test!(f1, "F1");
case_test!(f2, "F2");
case_test!(q4_256, "Q4-256");
case_test!(q4q_256, "Q4q-256");
case_test!(q4_512, "Q4-512");
case_test!(q4q_512, "Q4q-512");
case_test!(q4_1024, "Q4-1024");
case_test!(q4q_1024, "Q4q-1024");
case_test!(q4_2048, "Q4-2048");
case_test!(q4q_2048, "Q4q-2048");
case_test!(q4_4096, "Q4-4096");
case_test!(q4q_4096, "Q4q-4096");
case_test!(q4_8192, "Q4-8192");
case_test!(q4q_8192, "Q4q-8192");
case_test!(s1_full, "S1-full");
case_test!(s1_lora, "S1-lora");
case_test!(s1_lora_ckpt, "S1-lora-ckpt");
case_test!(s2, "S2");
case_test!(cpu_fp32_1x256, "cpu-fp32-1x256");
case_test!(cpu_bf16_1x256, "cpu-bf16-1x256");
case_test!(cpu_fp32_2x256, "cpu-fp32-2x256");
case_test!(cpu_bf16_2x256, "cpu-bf16-2x256");
case_test!(cpu_fp32_4x128, "cpu-fp32-4x128");
case_test!(cpu_bf16_4x128, "cpu-bf16-4x128");
case_test!(cpu_fp32_4x256, "cpu-fp32-4x256");
case_test!(cpu_bf16_4x256, "cpu-bf16-4x256");
case_test!(cpu_fp32_4x512, "cpu-fp32-4x512");
case_test!(cpu_bf16_4x512, "cpu-bf16-4x512");
case_test!(cpu_fp32_8x256, "cpu-fp32-8x256");
case_test!(cpu_bf16_8x256, "cpu-bf16-8x256");
case_test!(flux_hf_nf4, "FX-NF4");
case_test!(flux_hf_bf16, "FX-BF16");

#[test]
fn every_case_has_a_test() {
    assert_eq!(public_cases().len(), 50);
}

/// The target on the allocated/reserved cases: MAPE ≤ 10 %, no underprediction worse
/// than −10 %.
#[test]
fn alloc_reserved_mape_and_worst_underprediction_meet_the_target() {
    let results = evaluate(&public_cases()).unwrap();
    let (mape, worst, n) = summary(&results, CaseGroup::AllocReserved);
    println!(
        "allocated/reserved: n={n} MAPE {:.1}% worst underprediction {:+.1}%",
        100.0 * mape,
        100.0 * worst
    );
    assert!(n >= 10);
    assert!(mape <= 0.10, "MAPE {mape}");
    assert!(worst >= -0.10, "worst underprediction {worst}");
    // Percentile cases (p99) are never above the peak prediction.
    let (_, worst_p99, _) = summary(&results, CaseGroup::Percentile);
    assert!(worst_p99 >= 0.0);
}

/// The published fits / out-of-memory outcomes: the verdict never says "fits" for a run that ran
/// out of memory, and a run that fit is never short of more than 10% of its card.
#[test]
fn boundary_verdicts_are_never_unsafe() {
    use lora_memory::Verdict;
    use lora_memory::cases::{Outcome, boundary_cases, boundary_report, evaluate_boundaries};
    let results = evaluate_boundaries(&boundary_cases()).unwrap();
    let report = boundary_report(&results);
    assert!(results.len() >= 10, "{report}");
    assert!(
        results
            .iter()
            .any(|r| r.case.outcome == Outcome::OutOfMemory)
            && results.iter().any(|r| r.case.outcome == Outcome::Fit),
        "{report}"
    );
    for r in &results {
        assert!(
            !r.unsafe_miss(),
            "unsafe verdict on {}:\n{report}",
            r.case.id
        );
        assert!(r.card_given_up() <= 0.10, "{}:\n{report}", r.case.id);
        if r.case.outcome == Outcome::Fit {
            // a run that fit is at worst tight, never "does not fit"
            assert_ne!(
                r.check.verdict,
                Verdict::DoesNotFit,
                "{}:\n{report}",
                r.case.id
            );
        }
    }
}
