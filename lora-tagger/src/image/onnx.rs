//! WD14 ONNX taggers (SmilingWolf's `wd-*-tagger-v3` and `wd-v1-4-*-tagger-v2`) through ONNX
//! Runtime, as a [`Backbone`] of the [`crate::ImageTagger`].
//!
//! A model folder as the Hugging Face repos ship it: `model.onnx` + `selected_tags.csv`. The
//! graph takes `[batch, 448, 448, 3]` float32 (NHWC, BGR, 0–255: [`Preprocess::Wd14`] at the
//! input's side) and returns `[batch, n_tags]` sigmoid probabilities — the sigmoid is inside the
//! graph, so [`Backbone::outputs_probabilities`] is true and the tagger applies no activation
//! (config `image.head: sigmoid` for an export that ends in logits). Input and output names are
//! read from the graph (`input`/`output` in v3, `input_1:0`/`predictions_sigmoid` in v2); an
//! input with a fixed batch size (re-batched exports) gets its batches split and padded.
//!
//! # The runtime
//! ONNX Runtime is a shared library loaded at run time (the `ort` crate's `load-dynamic`; nothing
//! is downloaded or linked when building). [`find_onnxruntime`] looks for it, in order: the path
//! given (`image.onnxruntime`, `lora-train tag --onnxruntime`), `ORT_DYLIB_PATH`, then the
//! `onnxruntime` (or `onnxruntime-gpu`) Python package of a virtual environment: `$VIRTUAL_ENV`,
//! the venv of `$LORA_SDK_PYTHON`, `./.venv`, and `.venv` beside the executable or up to three
//! folders above it. [`ONNXRUNTIME_PIP`] is the version the tests run against; any ONNX Runtime
//! from 1.17 on works (the bindings ask for C API version 17). One library per process: the first
//! one loaded stays.
//!
//! # Devices
//! `model_settings.device`: `cpu` runs on ONNX Runtime's CPU provider; `cuda[:N]` on its CUDA
//! provider (needs `onnxruntime-gpu`; an error when the loaded library has none); `auto` uses the
//! CUDA provider when the library has it and a GPU is visible, else the CPU.
//! [`OnnxBackbone::execution_provider`] says which one runs. Threads: the CPU provider uses as
//! many intra-op threads as libtorch (`tch::get_num_threads`).

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use ort::ep::ExecutionProvider;
use ort::session::Session;
use ort::value::ValueType;
use tch::{Device, Kind, Tensor};

use super::{Backbone, Layout, Preprocess};
use crate::error::{Error, Result};

/// The `onnxruntime` wheel the tests run against (`python/requirements.txt`); its
/// `onnxruntime/capi/libonnxruntime.so.*` is what [`find_onnxruntime`] finds in a venv.
pub const ONNXRUNTIME_PIP: &str = "onnxruntime==1.28.0";

/// The shared library's file name prefix on this platform.
#[cfg(target_os = "windows")]
const LIB_PREFIX: &str = "onnxruntime.dll";
#[cfg(target_os = "macos")]
const LIB_PREFIX: &str = "libonnxruntime";
#[cfg(not(any(target_os = "windows", target_os = "macos")))]
const LIB_PREFIX: &str = "libonnxruntime.so";

/// The ONNX Runtime library in `dir`, if any (`libonnxruntime.so` or a versioned
/// `libonnxruntime.so.1.x.y`; not the `libonnxruntime_providers_*` plug-ins).
fn lib_in(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(LIB_PREFIX) && !n.contains("providers"))
                && p.is_file()
        })
        .collect();
    found.sort();
    found.into_iter().next()
}

/// Virtual environments to look in, in order (see the module docs).
fn venv_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v));
    }
    if let Some(py) = std::env::var_os("LORA_SDK_PYTHON") {
        // <venv>/bin/python (not canonicalized: a venv's python links to the system one)
        if let Some(venv) = Path::new(&py).parent().and_then(Path::parent) {
            roots.push(venv.to_path_buf());
        }
    }
    if let Ok(cwd) = std::env::current_dir() {
        roots.push(cwd.join(".venv"));
    }
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(4).map(|d| d.join(".venv")));
    }
    let mut seen = std::collections::HashSet::new();
    roots.retain(|r| seen.insert(r.clone()));
    roots
}

/// `onnxruntime/capi` folders of the Python packages in a venv.
fn capi_dirs(venv: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in ["lib", "lib64", "Lib"] {
        let Ok(rd) = std::fs::read_dir(venv.join(lib)) else {
            continue;
        };
        let mut pys: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
        pys.sort();
        for py in pys {
            out.push(py.join("site-packages/onnxruntime/capi"));
        }
        // Windows venvs: Lib/site-packages directly.
        out.push(venv.join(lib).join("site-packages/onnxruntime/capi"));
    }
    out
}

/// Finds the ONNX Runtime shared library (order in the module docs).
///
/// `configured` may name the library file or a folder holding it.
///
/// # Errors
/// [`Error::OnnxRuntime`] when `configured` or `ORT_DYLIB_PATH` names nothing usable, or when no
/// venv has the package: the message lists where it looked and says how to get it.
pub fn find_onnxruntime(configured: Option<&Path>) -> Result<PathBuf> {
    let named = |p: &Path, from: &str| -> Result<PathBuf> {
        if p.is_file() {
            return Ok(p.to_path_buf());
        }
        if p.is_dir()
            && let Some(l) = lib_in(p)
        {
            return Ok(l);
        }
        Err(Error::OnnxRuntime {
            what: format!("{from} = {}", p.display()),
            msg: format!(
                "no ONNX Runtime library there; name the {LIB_PREFIX}* file (e.g. \
                 <venv>/lib/python3.X/site-packages/onnxruntime/capi/libonnxruntime.so.1.28.0) \
                 or the folder holding it"
            ),
        })
    };
    if let Some(p) = configured {
        return named(p, "image.onnxruntime");
    }
    if let Some(p) = std::env::var_os("ORT_DYLIB_PATH").filter(|p| !p.is_empty()) {
        return named(Path::new(&p), "ORT_DYLIB_PATH");
    }
    let mut looked = Vec::new();
    for venv in venv_roots() {
        for dir in capi_dirs(&venv) {
            if let Some(l) = lib_in(&dir) {
                return Ok(l);
            }
        }
        looked.push(venv.display().to_string());
    }
    Err(Error::OnnxRuntime {
        what: "finding the ONNX Runtime library".into(),
        msg: format!(
            "no onnxruntime Python package in the venvs looked at ({}); install it with `pip \
             install {ONNXRUNTIME_PIP}` (`onnxruntime-gpu` for CUDA) into the project's venv \
             (`cargo xtask setup` does), or point ORT_DYLIB_PATH, image.onnxruntime or \
             --onnxruntime at a libonnxruntime shared library (1.17 or newer)",
            looked.join(", ")
        ),
    })
}

/// The library loaded in this process, once one is.
static LOADED: OnceLock<PathBuf> = OnceLock::new();

/// Loads the ONNX Runtime library at `path` into the process (once; later calls return the
/// library already loaded, whatever `path` says) and returns the path in use.
///
/// # Errors
/// [`Error::OnnxRuntime`] when the file cannot be loaded, exports no ONNX Runtime API, or is
/// older than the C API version the bindings need.
pub fn load_runtime(path: &Path) -> Result<PathBuf> {
    static INIT: Mutex<()> = Mutex::new(());
    let _g = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(p) = LOADED.get() {
        return Ok(p.clone());
    }
    let builder = ort::init_from(path).map_err(|e| Error::OnnxRuntime {
        what: format!("loading {}", path.display()),
        msg: format!("{e}; install `{ONNXRUNTIME_PIP}` or point ORT_DYLIB_PATH at another build"),
    })?;
    builder.with_name("lora-tagger").commit();
    let _ = LOADED.set(path.to_path_buf());
    Ok(path.to_path_buf())
}

/// Where and how an [`OnnxBackbone`] runs.
#[derive(Debug, Clone, Default)]
pub struct OnnxOptions {
    /// The ONNX Runtime library (file or folder); `None` = [`find_onnxruntime`]'s search.
    pub runtime: Option<PathBuf>,
    /// `Some(Device::Cuda(n))` runs on the CUDA provider of GPU `n`, `Some(Device::Cpu)` on the
    /// CPU provider; `None` (auto) takes the CUDA provider when available and a GPU is visible.
    pub device: Option<Device>,
    /// CPU intra-op threads; `None` = libtorch's thread count.
    pub threads: Option<usize>,
}

fn ort_err(what: impl Into<String>) -> impl FnOnce(ort::Error) -> Error {
    let what = what.into();
    move |e| Error::OnnxRuntime {
        what,
        msg: e.to_string(),
    }
}

fn builder_err(
    what: &str,
) -> impl FnOnce(ort::Error<ort::session::builder::SessionBuilder>) -> Error {
    let what = what.to_string();
    move |e| Error::OnnxRuntime {
        what,
        msg: e.to_string(),
    }
}

/// A WD14 ONNX tagger graph in an ONNX Runtime session (see the module docs).
pub struct OnnxBackbone {
    session: Mutex<Session>,
    path: PathBuf,
    input_name: String,
    output_name: String,
    layout: Layout,
    size: Option<u32>,
    fixed_batch: Option<usize>,
    num_labels: usize,
    provider: &'static str,
    runtime: PathBuf,
}

impl std::fmt::Debug for OnnxBackbone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OnnxBackbone")
            .field("path", &self.path)
            .field("input", &self.input_name)
            .field("output", &self.output_name)
            .field("layout", &self.layout)
            .field("size", &self.size)
            .field("fixed_batch", &self.fixed_batch)
            .field("num_labels", &self.num_labels)
            .field("provider", &self.provider)
            .finish()
    }
}

/// The dimensions of an outlet's tensor type (`-1` for dynamic ones).
fn tensor_dims(t: &ValueType) -> Option<Vec<i64>> {
    match t {
        ValueType::Tensor { ty, shape, .. } if *ty == ort::value::TensorElementType::Float32 => {
            Some(shape.iter().copied().collect())
        }
        _ => None,
    }
}

impl OnnxBackbone {
    /// Opens `model.onnx` (`path`) in an ONNX Runtime session and reads its input/output layout.
    ///
    /// # Errors
    /// [`Error::OnnxRuntime`] when the library cannot be found or loaded, the CUDA provider was
    /// asked for and is missing, or the file is no valid ONNX model; [`Error::Format`] when the
    /// graph's first input is not a float32 image `[batch, h, w, 3]` or `[batch, 3, h, w]`, or its
    /// first output not float32 `[batch, n_tags]`.
    pub fn load(path: &Path, options: &OnnxOptions) -> Result<Self> {
        let lib = find_onnxruntime(options.runtime.as_deref())?;
        let runtime = load_runtime(&lib)?;
        let what = format!("opening {}", path.display());
        let mut builder = Session::builder().map_err(ort_err(&what))?;
        let threads = options
            .threads
            .unwrap_or_else(|| tch::get_num_threads().max(1) as usize);
        builder = builder
            .with_intra_threads(threads)
            .map_err(builder_err(&what))?;
        let cuda = match options.device {
            Some(Device::Cuda(n)) => Some((n, true)),
            // auto: a GPU libtorch sees
            None => (lora_core::sys::cuda_device_count().unwrap_or(0) > 0).then_some((0, false)),
            Some(_) => None,
        };
        let mut provider = "CPUExecutionProvider";
        if let Some((n, required)) = cuda {
            let ep = ort::ep::CUDA::default().with_device_id(n as i32);
            let available = ep.is_available().unwrap_or(false);
            if available {
                builder = builder
                    .with_execution_providers([ep.build().error_on_failure()])
                    .map_err(builder_err(&what))?;
                provider = "CUDAExecutionProvider";
            } else if required {
                return Err(Error::OnnxRuntime {
                    what: format!("running {} on cuda:{n}", path.display()),
                    msg: format!(
                        "the ONNX Runtime at {} has no CUDA execution provider; install \
                         onnxruntime-gpu (and point ORT_DYLIB_PATH at its library), or set \
                         model_settings.device: cpu",
                        runtime.display()
                    ),
                });
            }
        }
        let session = builder.commit_from_file(path).map_err(ort_err(&what))?;
        let fmt = |msg: String| Error::Format {
            path: path.to_path_buf(),
            msg,
        };
        let input = session
            .inputs()
            .first()
            .ok_or_else(|| fmt("the graph has no input".into()))?;
        let output = session
            .outputs()
            .first()
            .ok_or_else(|| fmt("the graph has no output".into()))?;
        let in_dims = tensor_dims(input.dtype())
            .filter(|d| d.len() == 4)
            .ok_or_else(|| {
                fmt(format!(
                    "input `{}` is {:?}; expected float32 [batch, 448, 448, 3] (WD14)",
                    input.name(),
                    input.dtype()
                ))
            })?;
        let (layout, side) = if in_dims[3] == 3 {
            (Layout::Nhwc, in_dims[1])
        } else if in_dims[1] == 3 {
            (Layout::Nchw, in_dims[2])
        } else {
            return Err(fmt(format!(
                "input `{}` has shape {in_dims:?}; expected [batch, h, w, 3] or [batch, 3, h, w]",
                input.name()
            )));
        };
        let out_dims = tensor_dims(output.dtype())
            .filter(|d| d.len() == 2)
            .ok_or_else(|| {
                fmt(format!(
                    "output `{}` is {:?}; expected float32 [batch, n_tags]",
                    output.name(),
                    output.dtype()
                ))
            })?;
        let num_labels = usize::try_from(out_dims[1]).map_err(|_| {
            fmt(format!(
                "output `{}` has a dynamic tag count ({out_dims:?}); expected [batch, n_tags]",
                output.name()
            ))
        })?;
        Ok(OnnxBackbone {
            input_name: input.name().to_string(),
            output_name: output.name().to_string(),
            session: Mutex::new(session),
            path: path.to_path_buf(),
            layout,
            size: u32::try_from(side).ok().filter(|&s| s > 0),
            fixed_batch: usize::try_from(in_dims[0]).ok().filter(|&b| b > 0),
            num_labels,
            provider,
            runtime,
        })
    }

    /// The execution provider the session runs on: `"CUDAExecutionProvider"` or
    /// `"CPUExecutionProvider"`.
    pub fn execution_provider(&self) -> &'static str {
        self.provider
    }

    /// The ONNX Runtime library in use.
    pub fn runtime(&self) -> &Path {
        &self.runtime
    }

    /// The graph's input and output names (`("input", "output")` for v3 exports).
    pub fn io_names(&self) -> (&str, &str) {
        (&self.input_name, &self.output_name)
    }

    /// The batch size the graph's input is fixed to, if it is (re-batched exports).
    pub fn fixed_batch(&self) -> Option<usize> {
        self.fixed_batch
    }

    /// Runs one batch `[b, …]` (flat f32) through the session: `[b, num_labels]` flat.
    fn run_batch(&self, dims: [i64; 4], data: Vec<f32>) -> Result<Vec<f32>> {
        let what = || format!("running {}", self.path.display());
        let input = ort::value::Tensor::from_array((dims, data)).map_err(ort_err(what()))?;
        let mut session = self.session.lock().unwrap_or_else(|e| e.into_inner());
        let outputs = session
            .run(ort::inputs![self.input_name.as_str() => input])
            .map_err(|e| {
                let msg = e.to_string();
                if lora_core::oom::is_oom_message(&msg) || msg.contains("Failed to allocate memory")
                {
                    Error::OutOfMemory {
                        model: self.path.display().to_string(),
                        msg,
                    }
                } else {
                    Error::OnnxRuntime { what: what(), msg }
                }
            })?;
        let value = outputs
            .get(self.output_name.as_str())
            .ok_or_else(|| Error::OnnxRuntime {
                what: what(),
                msg: format!("no output `{}`", self.output_name),
            })?;
        let (shape, scores) = value.try_extract_tensor::<f32>().map_err(ort_err(what()))?;
        let expect = [dims[0], self.num_labels as i64];
        if shape.iter().copied().ne(expect) {
            return Err(Error::OnnxRuntime {
                what: what(),
                msg: format!("output shape {shape:?}, expected {expect:?}"),
            });
        }
        Ok(scores.to_vec())
    }
}

impl Backbone for OnnxBackbone {
    /// The size of `model.onnx`: its initializers are the weights, and ONNX Runtime holds them
    /// once in its session (no second copy when the arena shares them).
    fn weight_bytes(&self) -> u64 {
        std::fs::metadata(&self.path).map_or(0, |m| m.len())
    }

    fn name(&self) -> &str {
        "wd14_onnx"
    }

    fn default_preprocess(&self) -> Preprocess {
        Preprocess::Wd14 {
            size: self.size.unwrap_or(448),
        }
    }

    fn layout(&self) -> Layout {
        self.layout
    }

    fn multi_label(&self) -> bool {
        true
    }

    fn outputs_probabilities(&self) -> bool {
        true
    }

    fn runs_on(&self) -> Option<String> {
        Some(format!(
            "ONNX Runtime {} ({})",
            self.provider,
            self.runtime.display()
        ))
    }

    fn num_labels(&self) -> usize {
        self.num_labels
    }

    /// Scores of a batch (probabilities for WD14 exports; see the module docs).
    ///
    /// # Shapes
    /// `x`: `[n, h, w, 3]` (or `[n, 3, h, w]` per [`Backbone::layout`]), any float kind, any
    /// device → `[n, labels]` f32 on the CPU.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x
            .f_to_device(Device::Cpu)?
            .f_to_kind(Kind::Float)?
            .f_contiguous()?;
        let size = x.size();
        let [n, d1, d2, d3] = size[..] else {
            return Err(Error::OnnxRuntime {
                what: format!("running {}", self.path.display()),
                msg: format!("input batch of shape {size:?}; expected 4 dimensions"),
            });
        };
        let flat = Vec::<f32>::try_from(&x.f_view([-1])?)?;
        let n = n.max(0) as usize;
        let per = (d1 * d2 * d3).max(0) as usize;
        let labels = self.num_labels;
        let chunk = self.fixed_batch.unwrap_or(n.max(1));
        let mut out = Vec::with_capacity(n * labels);
        let mut start = 0;
        while start < n {
            let m = chunk.min(n - start);
            let mut data = flat[start * per..(start + m) * per].to_vec();
            let b = if self.fixed_batch.is_some() {
                // a fixed-batch graph: pad with zeros, keep the first m rows
                data.resize(chunk * per, 0.0);
                chunk
            } else {
                m
            };
            let scores = self.run_batch([b as i64, d1, d2, d3], data)?;
            out.extend_from_slice(&scores[..m * labels]);
            start += m;
        }
        Ok(Tensor::f_from_slice(&out)?.f_view([n as i64, labels as i64])?)
    }

    /// ONNX Runtime's activations are not counted: an estimate of 64 input-sized buffers per
    /// image (~150 MiB at 448², f32), about what ViT-B/ConvNeXt-B WD14 taggers hold at once.
    fn activation_bytes_per_item(&self, size: u32, elem_bytes: u64) -> u64 {
        64 * 3 * size as u64 * size as u64 * elem_bytes.max(4)
    }
}
