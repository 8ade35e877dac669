//! Adapter files at every save, as kohya sd-scripts writes them: beside each resume checkpoint a
//! loadable adapter named `<output_name>-step00000050` (a save every N steps) or
//! `<output_name>-000002` (a save at the end of epoch 2) — sd-scripts' `get_step_ckpt_name` /
//! `get_epoch_ckpt_name` — in the dtype of `train.save_precision`, in every export format of the
//! run; kohya's `save_last_n_steps` / `save_last_n_epochs` remove the older ones.
//!
//! The files are made from the checkpoint the trainer just wrote (its `adapter.safetensors`,
//! keyed by the run's VarStore names), so a snapshot is exactly the state a resume would start
//! from, and no model has to be borrowed during training.

use std::path::{Path, PathBuf};

use lora_core::formats::AdapterWeights;
use tch::{Device, Kind};

use crate::engine::{Callback, Control, TrainError};

/// One model's adapter in the run: its name in the writer (`"unet"`, `"text_encoder"`, or
/// `"model"` for an LLM), the VarStore prefix of its tensors (`""`, `"text_encoder."`), and its
/// adapter's layout (module paths, kinds, alphas; the tensors come from each save's checkpoint).
#[derive(Debug)]
pub struct SnapshotPart {
    /// The part's name, as the writer expects it.
    pub component: &'static str,
    /// Prefix of the part's tensors in the checkpoint (`<prefix><module>.lora_A.<adapter>.weight`).
    pub var_prefix: String,
    /// The adapter's layout as injected.
    pub template: AdapterLayout,
}

/// An adapter without its tensors: what a snapshot needs to rebuild [`AdapterWeights`] from a
/// checkpoint's tensors. Keeps no copy of the weights, so holding it for a whole run costs no
/// memory beside the trained adapter.
#[derive(Debug, Clone)]
pub struct AdapterLayout {
    /// Per module path (as the model's sites are named): its layer kind, its alpha (with the
    /// mixing weight folded in, as [`AdapterWeights::from_model`] gives it) and whether it has
    /// a DoRA magnitude.
    pub modules: std::collections::BTreeMap<String, ModuleLayout>,
    /// Scaling is `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Metadata the snapshot files carry (see [`AdapterWeights::metadata`]).
    pub metadata: std::collections::BTreeMap<String, String>,
}

/// One module of an [`AdapterLayout`].
#[derive(Debug, Clone, Copy)]
pub struct ModuleLayout {
    /// The wrapped layer type.
    pub kind: lora_core::layer::SiteKind,
    /// Alpha (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).
    pub alpha: f64,
    /// Whether the module has a DoRA magnitude vector.
    pub magnitude: bool,
}

impl AdapterLayout {
    /// The layout of `w` (its tensors are not kept).
    pub fn of(w: &AdapterWeights) -> Self {
        AdapterLayout {
            modules: w
                .modules
                .iter()
                .map(|(path, m)| {
                    (
                        path.clone(),
                        ModuleLayout {
                            kind: m.kind,
                            alpha: m.alpha,
                            magnitude: m.magnitude.is_some(),
                        },
                    )
                })
                .collect(),
            use_rslora: w.use_rslora,
            metadata: w.metadata.clone(),
        }
    }
}

/// Writes one snapshot: the parts (tensors already in the save dtype), the output folder and
/// the file stem (`<output_name>-step00000050`); returns what it wrote (files or folders).
pub type SnapshotWriter = Box<
    dyn FnMut(&[(&'static str, AdapterWeights)], &Path, &str) -> crate::job::Result<Vec<PathBuf>>,
>;

/// How many snapshot files stay (kohya's options).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Keep {
    /// `save_last_n_steps`: the snapshots of step saves taken within the last N steps.
    pub last_n_steps: Option<u64>,
    /// `save_last_n_epochs`: the last N snapshots of epoch saves.
    pub last_n_epochs: Option<u32>,
}

/// The [`Callback`] that writes the snapshots.
pub struct AdapterSnapshots {
    parts: Vec<SnapshotPart>,
    adapter_name: String,
    writer: SnapshotWriter,
    out_dir: PathBuf,
    output_name: String,
    kind: Option<Kind>,
    keep: Keep,
    /// The last finished epoch (1-based) and the step it ended at.
    epoch_end: Option<(u64, u64)>,
    /// Snapshots written: `(step, epoch when an epoch save, paths)`.
    written: Vec<(u64, Option<u64>, Vec<PathBuf>)>,
}

impl std::fmt::Debug for AdapterSnapshots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterSnapshots")
            .field("parts", &self.parts.len())
            .field("out_dir", &self.out_dir)
            .field("output_name", &self.output_name)
            .field("keep", &self.keep)
            .finish()
    }
}

impl AdapterSnapshots {
    /// Snapshots of adapter `adapter_name` of `parts`, written by `writer` into `out_dir` as
    /// `<output_name>-…` in `kind` (`None` = as trained), pruned by `keep`.
    pub fn new(
        parts: Vec<SnapshotPart>,
        adapter_name: &str,
        writer: SnapshotWriter,
        out_dir: &Path,
        output_name: &str,
        kind: Option<Kind>,
        keep: Keep,
    ) -> Self {
        AdapterSnapshots {
            parts,
            adapter_name: adapter_name.to_string(),
            writer,
            out_dir: out_dir.to_path_buf(),
            output_name: output_name.to_string(),
            kind,
            keep,
            epoch_end: None,
            written: Vec::new(),
        }
    }

    /// Snapshots of adapter `default` as a run's config asks: into `out_dir` as
    /// `train.output_name`, in `train.save_precision`, pruned by `train.save_last_n_steps` /
    /// `save_last_n_epochs`.
    pub fn for_run(
        parts: Vec<SnapshotPart>,
        writer: SnapshotWriter,
        cfg: &crate::config::TrainConfig,
        out_dir: &Path,
    ) -> Self {
        Self::new(
            parts,
            "default",
            writer,
            out_dir,
            &cfg.train.output_name,
            cfg.train
                .save_precision
                .map(crate::config::SavePrecision::kind),
            Keep {
                last_n_steps: cfg.train.save_last_n_steps,
                last_n_epochs: cfg.train.save_last_n_epochs,
            },
        )
    }

    /// The file stem of a save at `step` (`epoch` for a save at an epoch's end): sd-scripts'
    /// `<name>-step%08d` / `<name>-%06d`.
    pub fn stem(output_name: &str, step: u64, epoch: Option<u64>) -> String {
        match epoch {
            Some(e) => format!("{output_name}-{e:06}"),
            None => format!("{output_name}-step{step:08}"),
        }
    }

    /// The parts with the tensors of the checkpoint at `dir`.
    fn parts_from(&self, dir: &Path) -> Result<Vec<(&'static str, AdapterWeights)>, TrainError> {
        let file = dir.join("adapter.safetensors");
        let st = lora_core::safetensors::SafetensorsFile::open(&file).map_err(|e| {
            TrainError::State {
                what: "adapter snapshot".into(),
                message: format!(
                    "reading {}: {e}; the checkpoint was just written: check the disk",
                    file.display()
                ),
            }
        })?;
        let get = |name: &str| -> Result<tch::Tensor, TrainError> {
            let kind = self.kind.unwrap_or(Kind::Float);
            st.tensor_as(name, kind, Device::Cpu)
                .map_err(|e| TrainError::State {
                    what: "adapter snapshot".into(),
                    message: format!("{}: {name}: {e}", file.display()),
                })?
                .ok_or_else(|| TrainError::State {
                    what: "adapter snapshot".into(),
                    message: format!(
                        "{} has no tensor {name}: the checkpoint does not match the run's adapter",
                        file.display()
                    ),
                })
        };
        let mut out = Vec::new();
        for part in &self.parts {
            let mut w = AdapterWeights {
                modules: Default::default(),
                use_rslora: part.template.use_rslora,
                metadata: part.template.metadata.clone(),
            };
            for (path, m) in &part.template.modules {
                let embedding = m.kind == lora_core::layer::SiteKind::Embedding;
                let prefix = format!("{}{path}", part.var_prefix);
                let name = |slot: &str| {
                    if embedding {
                        format!("{prefix}.{slot}.{}", self.adapter_name)
                    } else {
                        format!("{prefix}.{slot}.{}.weight", self.adapter_name)
                    }
                };
                let (a, b) = if embedding {
                    ("lora_embedding_A", "lora_embedding_B")
                } else {
                    ("lora_A", "lora_B")
                };
                let module = lora_core::formats::ModuleLora {
                    kind: m.kind,
                    lora_a: get(&name(a))?,
                    lora_b: get(&name(b))?,
                    alpha: m.alpha,
                    magnitude: if m.magnitude {
                        Some(get(&name("lora_magnitude_vector"))?)
                    } else {
                        None
                    },
                };
                w.modules.insert(path.clone(), module);
            }
            out.push((part.component, w));
        }
        Ok(out)
    }

    /// Removes the snapshots `keep` no longer keeps after a save at `step`: step saves more
    /// than `last_n_steps` steps old, and all but the last `last_n_epochs` epoch saves.
    fn prune(&mut self, step: u64) {
        let keep = self.keep;
        let epoch_saves = self.written.iter().filter(|(_, e, _)| e.is_some()).count();
        let mut extra_epochs = keep
            .last_n_epochs
            .map_or(0, |n| epoch_saves.saturating_sub(n as usize));
        let mut gone: Vec<PathBuf> = Vec::new();
        self.written.retain(|(s, e, paths)| {
            let old = match e {
                None => keep.last_n_steps.is_some_and(|n| *s + n < step),
                Some(_) if extra_epochs > 0 => {
                    extra_epochs -= 1;
                    true
                }
                Some(_) => false,
            };
            if old {
                gone.extend(paths.iter().cloned());
            }
            !old
        });
        for p in gone {
            // a file the user already moved is no error
            let _ = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
        }
    }

    /// The snapshots on disk: `(step, paths)`.
    pub fn written(&self) -> Vec<(u64, Vec<PathBuf>)> {
        self.written
            .iter()
            .map(|(s, _, p)| (*s, p.clone()))
            .collect()
    }
}

impl Callback for AdapterSnapshots {
    fn on_epoch(
        &mut self,
        epoch: u64,
        last: Option<&crate::engine::StepInfo>,
    ) -> crate::engine::Result<Control> {
        if let Some(info) = last {
            self.epoch_end = Some((epoch + 1, info.step));
        }
        Ok(Control::Continue)
    }

    fn on_checkpoint(&mut self, step: u64, path: &Path) -> crate::engine::Result<Control> {
        let epoch = self.epoch_end.filter(|(_, s)| *s == step).map(|(e, _)| e);
        let parts = self.parts_from(path)?;
        let stem = Self::stem(&self.output_name, step, epoch);
        let written =
            (self.writer)(&parts, &self.out_dir, &stem).map_err(|e| TrainError::State {
                what: "adapter snapshot".into(),
                message: format!(
                    "writing {stem}: {e}; check the output folder's disk space and permissions"
                ),
            })?;
        self.written.retain(|(s, _, _)| *s != step);
        self.written.push((step, epoch, written));
        self.prune(step);
        Ok(Control::Continue)
    }
}
