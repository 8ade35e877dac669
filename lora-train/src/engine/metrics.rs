//! Run metrics on disk: a JSONL line per step, TensorBoard event files, and (feature `plot`) a
//! loss-curve PNG.
//!
//! TensorBoard files are written directly in their on-disk format — a TFRecord stream of
//! `tensorflow.Event` protobufs (`tensorboard/compat/proto/event.proto`, `summary.proto`): each
//! record is `u64 length (LE) | masked CRC-32C of the length | payload | masked CRC-32C of the
//! payload`, with `mask(c) = ((c >> 15) | (c << 17)) + 0xa282ead8`
//! (`tensorflow/core/lib/hash/crc32c.h`). The first event carries `file_version = "brain.Event:2"`;
//! each step adds `Summary.Value { tag, simple_value }` scalars.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::engine::callbacks::{Callback, Control, StepInfo, TrainEvent};
use crate::engine::error::{Result, TrainError};
use crate::engine::report::TrainReport;

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> TrainError + 'a {
    move |source| TrainError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !crc
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7f) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_len_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, ((field << 3) | 2) as u64);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// Encodes an `Event` protobuf: `wall_time` (1, double), `step` (2, int64), and either
/// `file_version` (3, string) or `summary` (5) with scalar values.
fn encode_event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(0x09); // field 1, fixed64
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10); // field 2, varint
    put_varint(&mut out, step as u64);
    if let Some(v) = file_version {
        put_len_field(&mut out, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut val = Vec::new();
            put_len_field(&mut val, 1, tag.as_bytes()); // Value.tag
            val.push(0x15); // Value.simple_value, field 2, fixed32
            val.extend_from_slice(&value.to_le_bytes());
            put_len_field(&mut summary, 1, &val); // Summary.value
        }
        put_len_field(&mut out, 5, &summary);
    }
    out
}

/// Frames `payload` as one TFRecord.
pub fn tfrecord(payload: &[u8]) -> Vec<u8> {
    let len = (payload.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(payload.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(payload);
    out.extend_from_slice(&masked_crc(payload).to_le_bytes());
    out
}

/// Reads back the records of a TFRecord file, checking both CRCs of each.
///
/// # Errors
/// I/O errors, truncated records or CRC mismatches.
pub fn read_tfrecords(path: &Path) -> Result<Vec<Vec<u8>>> {
    let bytes = fs::read(path).map_err(io_err("read", path))?;
    let bad = |m: &str| TrainError::State {
        what: "event file".into(),
        message: format!("`{}`: {m}", path.display()),
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if i + 12 > bytes.len() {
            return Err(bad("truncated record header"));
        }
        let len_bytes = &bytes[i..i + 8];
        let mut crc = [0u8; 4];
        crc.copy_from_slice(&bytes[i + 8..i + 12]);
        if u32::from_le_bytes(crc) != masked_crc(len_bytes) {
            return Err(bad("length CRC mismatch"));
        }
        let mut l = [0u8; 8];
        l.copy_from_slice(len_bytes);
        let n = u64::from_le_bytes(l) as usize;
        let start = i + 12;
        if start + n + 4 > bytes.len() {
            return Err(bad("truncated record"));
        }
        let payload = &bytes[start..start + n];
        crc.copy_from_slice(&bytes[start + n..start + n + 4]);
        if u32::from_le_bytes(crc) != masked_crc(payload) {
            return Err(bad("payload CRC mismatch"));
        }
        out.push(payload.to_vec());
        i = start + n + 4;
    }
    Ok(out)
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes scalars to a TensorBoard event file `events.out.tfevents.<time>.lora-train` in a folder.
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl std::fmt::Debug for TensorBoardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorBoardWriter")
            .field("path", &self.path)
            .finish()
    }
}

impl TensorBoardWriter {
    /// Creates the folder and a new event file in it.
    ///
    /// # Errors
    /// I/O errors.
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).map_err(io_err("create folder", dir))?;
        let t = now_s();
        let path = dir.join(format!(
            "events.out.tfevents.{}.lora-train.{}",
            t as u64,
            std::process::id()
        ));
        let f = File::create(&path).map_err(io_err("create", &path))?;
        let mut w = Self {
            path,
            out: BufWriter::new(f),
        };
        let first = encode_event(t, 0, Some("brain.Event:2"), &[]);
        w.write_record(&first)?;
        Ok(w)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn write_record(&mut self, payload: &[u8]) -> Result<()> {
        let path = self.path.clone();
        self.out
            .write_all(&tfrecord(payload))
            .map_err(io_err("write", &path))
    }

    /// Adds scalars `(tag, value)` at `step`.
    ///
    /// # Errors
    /// I/O errors.
    pub fn add_scalars(&mut self, step: u64, scalars: &[(&str, f32)]) -> Result<()> {
        let ev = encode_event(now_s(), step as i64, None, scalars);
        self.write_record(&ev)
    }

    /// Flushes buffered records to the file.
    ///
    /// # Errors
    /// I/O errors.
    pub fn flush(&mut self) -> Result<()> {
        let path = self.path.clone();
        self.out.flush().map_err(io_err("flush", &path))
    }
}

/// A [`Callback`] that writes `metrics.jsonl` (one JSON object per step and per event),
/// TensorBoard scalars (`loss`, `lr`, `grad_norm`, `it_per_s`, `tokens_per_s`, `mem_peak_mib`)
/// under `tensorboard/`, and `loss.png` at the end (feature `plot`), all in one folder.
pub struct MetricsLogger {
    dir: PathBuf,
    jsonl: BufWriter<File>,
    tb: Option<TensorBoardWriter>,
    losses: Vec<(u64, f64)>,
    every: u64,
}

impl std::fmt::Debug for MetricsLogger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsLogger")
            .field("dir", &self.dir)
            .finish()
    }
}

impl MetricsLogger {
    /// Logs into `dir` (created); `tensorboard` switches the event files on. An existing
    /// `metrics.jsonl` is appended to (a resumed run continues it).
    ///
    /// # Errors
    /// I/O errors.
    pub fn new(dir: &Path, tensorboard: bool) -> Result<Self> {
        fs::create_dir_all(dir).map_err(io_err("create folder", dir))?;
        let p = dir.join("metrics.jsonl");
        let f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&p)
            .map_err(io_err("open", &p))?;
        let tb = if tensorboard {
            Some(TensorBoardWriter::create(&dir.join("tensorboard"))?)
        } else {
            None
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            jsonl: BufWriter::new(f),
            tb,
            losses: Vec::new(),
            every: 1,
        })
    }

    /// Writes the JSONL line and TensorBoard scalars every `n` steps (and at the last step);
    /// `loss.png` still plots every step. `n = 0` is treated as 1.
    pub fn with_every(mut self, n: u64) -> Self {
        self.every = n.max(1);
        self
    }

    fn line(&mut self, v: &serde_json::Value) -> Result<()> {
        let p = self.dir.join("metrics.jsonl");
        writeln!(self.jsonl, "{v}").map_err(io_err("write", &p))?;
        self.jsonl.flush().map_err(io_err("flush", &p))
    }
}

impl Callback for MetricsLogger {
    fn on_step(&mut self, info: &StepInfo) -> Result<Control> {
        self.losses.push((info.step, info.loss));
        if info.step % self.every != 0 && info.step != info.total_steps {
            return Ok(Control::Continue);
        }
        let mut v =
            serde_json::to_value(info).map_err(|e| TrainError::App(format!("metrics: {e}")))?;
        if let Some(o) = v.as_object_mut() {
            o.insert("type".into(), "step".into());
        }
        self.line(&v)?;
        if let Some(tb) = self.tb.as_mut() {
            let mut s: Vec<(&str, f32)> = vec![
                ("train/loss", info.loss as f32),
                ("train/lr", info.lr as f32),
                ("perf/it_per_s", info.it_per_s as f32),
                ("perf/tokens_per_s", info.tokens_per_s as f32),
                (
                    "memory/peak_mib",
                    (info.mem.peak_bytes() as f64 / (1024.0 * 1024.0)) as f32,
                ),
            ];
            if let Some(g) = info.grad_norm {
                s.push(("train/grad_norm", g as f32));
            }
            tb.add_scalars(info.step, &s)?;
            tb.flush()?;
        }
        Ok(Control::Continue)
    }

    fn on_event(&mut self, event: &TrainEvent) -> Result<()> {
        let mut v =
            serde_json::to_value(event).map_err(|e| TrainError::App(format!("metrics: {e}")))?;
        if let Some(o) = v.as_object_mut() {
            o.insert("type".into(), "event".into());
        }
        self.line(&v)
    }

    fn on_end(&mut self, report: &TrainReport) -> Result<()> {
        let mut v =
            serde_json::to_value(report).map_err(|e| TrainError::App(format!("metrics: {e}")))?;
        if let Some(o) = v.as_object_mut() {
            o.remove("losses");
            o.insert("type".into(), "end".into());
        }
        self.line(&v)?;
        if let Some(tb) = self.tb.as_mut() {
            tb.flush()?;
        }
        #[cfg(feature = "plot")]
        if self.losses.iter().filter(|l| l.1.is_finite()).count() >= 2 {
            crate::engine::plot::write_loss_png(
                &self.dir.join("loss.png"),
                &self.losses,
                800,
                400,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vector() {
        // RFC 3720 appendix B.4 check value of "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn event_file_roundtrips_with_valid_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TensorBoardWriter::create(dir.path()).unwrap();
        w.add_scalars(3, &[("train/loss", 1.5)]).unwrap();
        w.flush().unwrap();
        let recs = read_tfrecords(w.path()).unwrap();
        assert_eq!(recs.len(), 2);
        assert!(recs[0].windows(13).any(|s| s == b"brain.Event:2"));
        // step = 3 as varint after tag 0x10; the scalar's tag and value bytes follow.
        assert!(recs[1].windows(2).any(|s| s == [0x10, 3]));
        assert!(recs[1].windows(10).any(|s| s == b"train/loss"));
        assert!(recs[1].windows(4).any(|s| s == 1.5f32.to_le_bytes()));
    }
}
