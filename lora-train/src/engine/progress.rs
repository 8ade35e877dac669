//! The terminal progress bar callback (feature `progress`).

use std::time::Duration;

use crate::engine::callbacks::{Callback, Control, StepInfo, TrainEvent};
use crate::engine::error::Result;
use crate::engine::report::TrainReport;

fn human_bytes(b: u64) -> String {
    let b = b as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else {
        format!("{:.0} MiB", b / (1024.0 * 1024.0))
    }
}

/// A terminal progress bar (`indicatif`) showing step, loss, lr, it/s, ETA and peak memory.
///
/// When stderr is not a terminal (a log file, CI, a pipe), it prints plain lines instead:
/// `step 40/200 [00:01:02 < 00:04:08] loss … | lr … | … it/s | mem …`, every
/// `max(1, total/20)` steps (or [`ProgressBar::every`]), at the first step and at the last.
pub struct ProgressBar {
    bar: Option<indicatif::ProgressBar>,
    plain: Option<PlainProgress>,
    every: Option<u64>,
}

struct PlainProgress {
    total: u64,
    start_step: u64,
    every: u64,
    started: std::time::Instant,
}

fn hms(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    format!("{:02}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60)
}

impl std::fmt::Debug for ProgressBar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProgressBar").finish()
    }
}

impl Default for ProgressBar {
    fn default() -> Self {
        Self::new()
    }
}

impl ProgressBar {
    /// A progress bar (created in `on_start`).
    pub fn new() -> Self {
        Self {
            bar: None,
            plain: None,
            every: None,
        }
    }

    /// Without a terminal, print a line every `n` steps (default `max(1, total/20)`).
    pub fn every(mut self, n: u64) -> Self {
        self.every = Some(n.max(1));
        self
    }

    fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => eprintln!("{line}"),
        }
    }

    /// The text after the bar for a step.
    pub fn message(info: &StepInfo) -> String {
        let gn = info
            .grad_norm
            .map(|g| format!(" | gnorm {g:.3}"))
            .unwrap_or_default();
        let tok = if info.tokens_per_s > 0.0 {
            format!(" | {:.0} tok/s", info.tokens_per_s)
        } else {
            String::new()
        };
        // a warm-up's first step trains at lr 0 (as transformers' schedules do): say "0"
        let lr = if info.lr == 0.0 {
            "0".to_string()
        } else {
            format!("{:.2e}", info.lr)
        };
        format!(
            "loss {:.4} | lr {lr}{gn} | {:.2} it/s{tok} | mem {}{}",
            info.loss,
            info.it_per_s,
            human_bytes(info.mem.peak_bytes()),
            if info.skipped { " | skipped" } else { "" }
        )
    }
}

impl Callback for ProgressBar {
    fn on_start(&mut self, total_steps: u64, start_step: u64) -> Result<()> {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            self.plain = Some(PlainProgress {
                total: total_steps,
                start_step,
                every: self.every.unwrap_or((total_steps / 20).max(1)),
                started: std::time::Instant::now(),
            });
            return Ok(());
        }
        let bar = indicatif::ProgressBar::new(total_steps);
        let style = indicatif::ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}<{eta_precise}] {bar:30} {pos}/{len} {msg}",
        )
        .map(|s| s.progress_chars("=> "))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_position(start_step);
        bar.enable_steady_tick(Duration::from_millis(500));
        self.bar = Some(bar);
        Ok(())
    }

    fn on_step(&mut self, info: &StepInfo) -> Result<Control> {
        if let Some(bar) = &self.bar {
            bar.set_position(info.step);
            bar.set_message(Self::message(info));
        }
        if let Some(p) = &self.plain
            && (info.step % p.every == 0 || info.step >= p.total || info.step == p.start_step + 1)
        {
            let elapsed = p.started.elapsed().as_secs_f64();
            let done = info.step.saturating_sub(p.start_step).max(1) as f64;
            let left = p.total.saturating_sub(info.step) as f64;
            eprintln!(
                "step {}/{} [{} < {}] {}",
                info.step,
                p.total,
                hms(elapsed),
                hms(elapsed / done * left),
                Self::message(info)
            );
        }
        Ok(Control::Continue)
    }

    fn on_event(&mut self, event: &TrainEvent) -> Result<()> {
        if self.bar.is_some() || self.plain.is_some() {
            let line = match event {
                TrainEvent::OomBackoff {
                    step,
                    micro_batch_split,
                    message,
                } => format!(
                    "step {step}: out of memory, retrying with each batch split in {micro_batch_split} ({})",
                    message.lines().next().unwrap_or("")
                ),
                TrainEvent::NonFinite {
                    step,
                    what,
                    value,
                    action,
                } => {
                    format!("step {step}: non-finite {what} ({value}); {action}")
                }
                TrainEvent::ScalerOverflow { step, scale } => {
                    format!("step {step}: fp16 overflow, step skipped, loss scale now {scale}")
                }
                TrainEvent::Resumed { step, path } => format!("resumed from {path} (step {step})"),
                TrainEvent::CheckpointRefused { step, reason } => {
                    format!("step {step}: checkpoint not written: {reason}")
                }
            };
            self.say(&line);
        }
        Ok(())
    }

    fn on_end(&mut self, _report: &TrainReport) -> Result<()> {
        if let Some(bar) = self.bar.take() {
            bar.finish();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::callbacks::MemSnapshot;

    #[test]
    fn progress_message_has_loss_lr_speed_and_memory() {
        let info = StepInfo {
            loss: 1.23456,
            lr: 2e-4,
            grad_norm: Some(0.5),
            it_per_s: 3.0,
            tokens_per_s: 900.0,
            mem: MemSnapshot {
                cpu_peak_bytes: 3 << 30,
                ..Default::default()
            },
            ..Default::default()
        };
        let m = ProgressBar::message(&info);
        assert!(
            m.contains("loss 1.2346") && m.contains("lr 2.00e-4") && m.contains("3.00 it/s"),
            "{m}"
        );
        assert!(m.contains("900 tok/s") && m.contains("3.00 GiB"), "{m}");
        // the first step of a warm-up
        let m = ProgressBar::message(&StepInfo { lr: 0.0, ..info });
        assert!(m.contains("| lr 0 |"), "{m}");
    }
}
