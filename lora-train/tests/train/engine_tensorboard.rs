//! The TensorBoard event files the metrics logger writes are read back by the real
//! `tensorboard` package (its `EventAccumulator`, what the TensorBoard UI loads them with).

use lora_train::engine::metrics::TensorBoardWriter;
use std::process::Command;

#[test]
fn tensorboard_reads_our_event_files_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut w = TensorBoardWriter::create(dir.path()).unwrap();
    let steps: Vec<(u64, f32, f32)> = (1..=5)
        .map(|s| (s, 2.0 / s as f32, 1e-4 * s as f32))
        .collect();
    for (step, loss, lr) in &steps {
        w.add_scalars(*step, &[("train/loss", *loss), ("train/lr", *lr)])
            .unwrap();
    }
    w.flush().unwrap();
    drop(w);
    let code = r#"
import sys, json
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1])
acc.Reload()
tags = acc.Tags()["scalars"]
print(json.dumps({t: [[e.step, e.value] for e in acc.Scalars(t)] for t in sorted(tags)}))
"#;
    let out = Command::new(super::sd_fixture::python())
        .args(["-c", code])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for (tag, col) in [("train/loss", 1), ("train/lr", 2)] {
        let got = read[tag]
            .as_array()
            .unwrap_or_else(|| panic!("{tag}: {read}"));
        assert_eq!(got.len(), steps.len(), "{tag}");
        for (g, s) in got.iter().zip(&steps) {
            assert_eq!(g[0].as_u64(), Some(s.0));
            let want = if col == 1 { s.1 } else { s.2 };
            let v = g[1].as_f64().unwrap() as f32;
            assert_eq!(v, want, "{tag} at step {}", s.0);
        }
    }
}
