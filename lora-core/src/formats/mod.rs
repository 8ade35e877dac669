//! Adapter files: PEFT ([`peft`]), kohya ([`kohya`]) and diffusers ([`diffusers`]) layouts.
//!
//! All formats go through [`AdapterWeights`], a format-neutral set of per-module `(A, B, alpha,
//! magnitude)`; conversions between formats preserve the adapter's strength (the product
//! `scaling · B·A`), whatever alpha, rank and rsLoRA setting were used.
//!
//! safetensors files are read through the crate's one reader, [`crate::safetensors`] (a `memmap2`
//! map parsed by the `safetensors` crate; tch's own reader loads whole files and ignores
//! `__metadata__`); [`read_header`] parses only the header.

pub mod diffusers;
pub mod kohya;
pub mod peft;

use crate::config::{AdapterSpec, scaling};
use crate::error::{Error, Result, TchContext};
use crate::inject::{Adaptable, InjectionReport, count_params};
use crate::layer::SiteKind;
use crate::safetensors::{SafetensorsFile, dtype_of};
use ::safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// One module's LoRA weights, format-neutral.
#[derive(Debug)]
pub struct ModuleLora {
    /// The wrapped layer type.
    pub kind: SiteKind,
    /// A: `[r, in]` (Linear), `[r, in, kh, kw]` (Conv2d), `[r, num_embeddings]` (Embedding).
    pub lora_a: Tensor,
    /// B: `[out, r]`, `[out, r, 1, 1]`, `[dim, r]`.
    pub lora_b: Tensor,
    /// Alpha (scaling = alpha / r, or alpha / sqrt(r) with rsLoRA).
    pub alpha: f64,
    /// DoRA magnitude `[out]`.
    pub magnitude: Option<Tensor>,
}

impl ModuleLora {
    /// The rank (`A.size(0)`).
    pub fn rank(&self) -> i64 {
        self.lora_a.size()[0]
    }
}

/// A whole adapter, format-neutral: module path → weights, plus settings and free-form metadata.
#[derive(Debug, Default)]
pub struct AdapterWeights {
    /// Per-module weights keyed by module path (as the model's sites are named).
    pub modules: BTreeMap<String, ModuleLora>,
    /// Scaling is `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Free-form metadata (written to the safetensors `__metadata__` by the formats that keep it).
    pub metadata: BTreeMap<String, String>,
}

impl AdapterWeights {
    /// The same adapter with every floating-point tensor (`lora_A`, `lora_B`, DoRA magnitudes)
    /// in `kind` — the dtype a file is written in (kohya's `save_precision`). `alpha` stays a
    /// number (the formats write it as f32).
    ///
    /// # Errors
    /// [`crate::Error::Torch`] when a conversion fails.
    pub fn to_kind(&self, kind: Kind) -> Result<AdapterWeights> {
        let mut modules = BTreeMap::new();
        for (name, m) in &self.modules {
            modules.insert(
                name.clone(),
                ModuleLora {
                    kind: m.kind,
                    lora_a: m
                        .lora_a
                        .f_to_kind(kind)
                        .ctx(|| format!("{name}: lora_A to {kind:?}"))?,
                    lora_b: m
                        .lora_b
                        .f_to_kind(kind)
                        .ctx(|| format!("{name}: lora_B to {kind:?}"))?,
                    alpha: m.alpha,
                    magnitude: m
                        .magnitude
                        .as_ref()
                        .map(|t| t.f_to_kind(kind))
                        .transpose()
                        .ctx(|| format!("{name}: magnitude to {kind:?}"))?,
                },
            );
        }
        Ok(AdapterWeights {
            modules,
            use_rslora: self.use_rslora,
            metadata: self.metadata.clone(),
        })
    }

    /// A second handle on the same adapter: the tensors are shared (`shallow_clone`), the
    /// module map and metadata copied.
    pub fn clone_shallow(&self) -> AdapterWeights {
        AdapterWeights {
            modules: self
                .modules
                .iter()
                .map(|(k, m)| {
                    (
                        k.clone(),
                        ModuleLora {
                            kind: m.kind,
                            lora_a: m.lora_a.shallow_clone(),
                            lora_b: m.lora_b.shallow_clone(),
                            alpha: m.alpha,
                            magnitude: m.magnitude.as_ref().map(Tensor::shallow_clone),
                        },
                    )
                })
                .collect(),
            use_rslora: self.use_rslora,
            metadata: self.metadata.clone(),
        }
    }

    /// The scaling of `module`'s adapter, if present.
    pub fn scaling(&self, module: &str) -> Option<f64> {
        self.modules
            .get(module)
            .map(|m| scaling(m.alpha, m.rank(), self.use_rslora))
    }

    /// Whether any module carries a DoRA magnitude.
    pub fn use_dora(&self) -> bool {
        self.modules.values().any(|m| m.magnitude.is_some())
    }

    /// Copies adapter `adapter_name` out of `model` (detached, on the CPU).
    ///
    /// # Errors
    /// [`Error::Adapter`] when no site has the adapter, or its sites mix rsLoRA and plain scaling.
    pub fn from_model(model: &mut dyn Adaptable, adapter_name: &str) -> Result<Self> {
        let mut modules = BTreeMap::new();
        let mut rslora: Option<bool> = None;
        let mut mixed = false;
        model.visit_sites(&mut |path, site| {
            let layer = site.layer_ref();
            if let Some(ad) = layer.adapter(adapter_name) {
                let cp = |t: &Tensor| {
                    t.f_detach_copy()
                        .and_then(|t| t.f_to_device(Device::Cpu))
                        .and_then(|t| t.f_contiguous())
                        .ctx(|| format!("copying adapter tensors of {path}"))
                };
                if rslora.is_some_and(|r| r != ad.spec().use_rslora) {
                    mixed = true;
                }
                rslora = Some(ad.spec().use_rslora);
                // the mixing weight is part of the strength: fold it into alpha
                modules.insert(
                    path.to_string(),
                    ModuleLora {
                        kind: layer.site_kind(),
                        lora_a: cp(ad.lora_a())?,
                        lora_b: cp(ad.lora_b())?,
                        alpha: ad.alpha() * ad.weight(),
                        magnitude: ad.magnitude().map(cp).transpose()?,
                    },
                );
            }
            Ok(())
        })?;
        if modules.is_empty() {
            return Err(Error::Adapter {
                name: adapter_name.into(),
                reason: "no site of the model has it".into(),
            });
        }
        if mixed {
            return Err(Error::Adapter {
                name: adapter_name.into(),
                reason:
                    "mixes rsLoRA and plain scaling across modules; no file format can express that"
                        .into(),
            });
        }
        Ok(Self {
            modules,
            use_rslora: rslora.unwrap_or(false),
            metadata: BTreeMap::new(),
        })
    }

    /// Adds these weights to `model` as adapter `adapter_name` (tensors created in `vs`, then
    /// overwritten with the file's values, cast to `vs`'s dtype). Every module must exist in the
    /// model with matching shapes; `dropout` applies to every module (training only).
    ///
    /// # Errors
    /// [`Error::Format`]-like [`Error::Adapter`] listing modules the model lacks; [`Error::Shape`]
    /// naming the module and tensor whose shape does not fit the model's site.
    pub fn load_into(
        &self,
        model: &mut dyn Adaptable,
        adapter_name: &str,
        vs: &tch::nn::Path,
        dropout: f64,
    ) -> Result<InjectionReport> {
        let mut seen = Vec::new();
        let mut added = 0i64;
        model.visit_sites(&mut |path, mut site| {
            let Some(m) = self.modules.get(path) else {
                return Ok(());
            };
            let layer = site.layer();
            if layer.site_kind() != m.kind {
                return Err(Error::Adapter {
                    name: adapter_name.into(),
                    reason: format!(
                        "module {path} is a {:?} in the file but a {:?} in the model",
                        m.kind,
                        layer.site_kind()
                    ),
                });
            }
            let r = m.rank();
            let (a_shape, b_shape) = layer.adapter_shapes(r);
            for (what, t, want) in [
                ("lora_A", &m.lora_a, &a_shape),
                ("lora_B", &m.lora_b, &b_shape),
            ] {
                if &t.size() != want {
                    return Err(Error::Shape {
                        key: format!("{path}.{what}"),
                        expected: want.clone(),
                        found: t.size(),
                    });
                }
            }
            let spec = AdapterSpec {
                rank: r,
                alpha: m.alpha,
                use_rslora: self.use_rslora,
                use_dora: m.magnitude.is_some(),
                dropout,
                init: crate::config::InitLoraWeights::Kaiming,
            };
            added += layer.add_adapter(path, adapter_name, &spec, vs)?;
            let ad = layer
                .adapter(adapter_name)
                .ok_or_else(|| crate::layer::missing(adapter_name))?;
            let _g = tch::no_grad_guard();
            let fill = |dst: &Tensor, src: &Tensor, what: &str| -> Result<()> {
                let ctx = || format!("loading {path}.{what}");
                if dst.size() != src.size() {
                    return Err(Error::Shape {
                        key: format!("{path}.{what}"),
                        expected: dst.size(),
                        found: src.size(),
                    });
                }
                let mut d = dst.shallow_clone();
                d.f_copy_(src).ctx(ctx)
            };
            fill(ad.lora_a(), &m.lora_a, "lora_A")?;
            fill(ad.lora_b(), &m.lora_b, "lora_B")?;
            if let (Some(dst), Some(src)) = (ad.magnitude(), &m.magnitude) {
                let src = src
                    .f_reshape([-1])
                    .ctx(|| format!("reshaping {path}.lora_magnitude_vector"))?;
                fill(dst, &src, "lora_magnitude_vector")?;
            }
            seen.push(path.to_string());
            Ok(())
        })?;
        let missing: Vec<&str> = self
            .modules
            .keys()
            .filter(|k| !seen.iter().any(|s| s == *k))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() {
            return Err(Error::Adapter {
                name: adapter_name.into(),
                reason: format!("the model has no site named [{}]", missing.join(", ")),
            });
        }
        let (trainable, all) = count_params(model)?;
        Ok(InjectionReport {
            adapter_name: adapter_name.into(),
            modules: seen,
            params_added: added,
            trainable_params: trainable,
            all_params: all,
        })
    }

    /// The most common rank and alpha (for a config's `r` / `lora_alpha`).
    pub(crate) fn dominant_rank_alpha(&self) -> (i64, f64) {
        let mut counts: BTreeMap<(i64, u64), usize> = BTreeMap::new();
        for m in self.modules.values() {
            *counts.entry((m.rank(), m.alpha.to_bits())).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|(_, c)| *c)
            .map(|((r, a), _)| (r, f64::from_bits(a)))
            .unwrap_or((8, 8.0))
    }
}

/// A safetensors header read without loading tensor data.
#[derive(Debug, Clone, Default)]
pub struct SafetensorsHeader {
    /// `__metadata__` (string → string).
    pub metadata: BTreeMap<String, String>,
    /// Tensor name → (dtype, shape).
    pub tensors: BTreeMap<String, (Dtype, Vec<usize>)>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        path: path.to_path_buf(),
        source,
    }
}

fn st_err(path: &Path) -> impl FnOnce(::safetensors::SafeTensorError) -> Error + '_ {
    move |source| Error::SafeTensors {
        path: path.to_path_buf(),
        source,
    }
}

/// Reads a safetensors file's header (names, dtypes, shapes, `__metadata__`) through a memory map,
/// touching only the header bytes.
///
/// # Errors
/// [`Error::Io`] / [`Error::SafeTensors`] with the path.
pub fn read_header(path: &Path) -> Result<SafetensorsHeader> {
    let file = SafetensorsFile::open(path)?;
    let mut h = SafetensorsHeader {
        metadata: file.metadata(),
        ..SafetensorsHeader::default()
    };
    for name in file.names() {
        if let Some(info) = file.info(name) {
            h.tensors.insert(name.to_string(), info);
        }
    }
    Ok(h)
}

/// A safetensors file's tensors loaded as CPU tensors (copied out of the map) plus metadata.
pub(crate) struct Loaded {
    pub tensors: BTreeMap<String, Tensor>,
    pub metadata: BTreeMap<String, String>,
    pub path: PathBuf,
}

/// Reads a whole safetensors file (through a memory map) into CPU tensors plus its `__metadata__`.
///
/// # Errors
/// [`Error::Io`] / [`Error::SafeTensors`] with the path; [`Error::Dtype`] for unsupported dtypes.
pub fn read_safetensors(
    path: &Path,
) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, String>)> {
    let l = load_safetensors(path)?;
    Ok((l.tensors, l.metadata))
}

pub(crate) fn load_safetensors(path: &Path) -> Result<Loaded> {
    let file = SafetensorsFile::open(path)?;
    Ok(Loaded {
        tensors: file.tensors()?,
        metadata: file.metadata(),
        path: path.to_path_buf(),
    })
}

impl Loaded {
    /// Takes tensor `key`, requiring a float dtype (f32/f16/bf16/f64) and returning it as `kind`.
    pub(crate) fn take_float(&mut self, key: &str) -> Result<Tensor> {
        let t = self.tensors.remove(key).ok_or_else(|| Error::MissingKey {
            key: key.into(),
            file: self.path.clone(),
        })?;
        if !matches!(
            t.kind(),
            Kind::Float | Kind::Half | Kind::BFloat16 | Kind::Double
        ) {
            return Err(Error::Dtype {
                key: key.into(),
                found: format!("{:?}", t.kind()),
                what: "lora weights must be f32, f16, bf16 or f64".into(),
            });
        }
        Ok(t)
    }

    /// Takes a scalar alpha (0-d or `[1]`, any float or integer dtype).
    pub(crate) fn take_alpha(&mut self, key: &str) -> Result<Option<f64>> {
        let Some(t) = self.tensors.remove(key) else {
            return Ok(None);
        };
        if t.numel() != 1 {
            return Err(Error::Shape {
                key: key.into(),
                expected: vec![],
                found: t.size(),
            });
        }
        let v = t
            .f_to_kind(Kind::Double)
            .and_then(|t| t.f_reshape([-1]))
            .and_then(|t| t.f_double_value(&[0]));
        Ok(Some(v.ctx(|| format!("reading alpha {key}"))?))
    }
}

/// A tensor's bytes in a form safetensors can write.
pub(crate) struct OwnedView {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for &OwnedView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

pub(crate) fn owned_view(key: &str, t: &Tensor) -> Result<OwnedView> {
    let dtype = dtype_of(t.kind()).ok_or_else(|| Error::Dtype {
        key: key.into(),
        found: format!("{:?}", t.kind()),
        what: "writable dtypes are f32, f16, bf16, f64, i64, i32".into(),
    })?;
    let ctx = || format!("serializing {key}");
    let c = t
        .f_detach()
        .and_then(|t| t.f_to_device(Device::Cpu))
        .and_then(|t| t.f_contiguous())
        .ctx(ctx)?;
    let numel = c.numel();
    let mut data = vec![0u8; numel * c.kind().elt_size_in_bytes()];
    c.f_copy_data_u8(&mut data, numel).ctx(ctx)?;
    Ok(OwnedView {
        dtype,
        shape: c.size().iter().map(|&d| d as usize).collect(),
        data,
    })
}

/// Writes `tensors` (any device; f32/f16/bf16/f64/i64/i32) and `metadata` to a safetensors file,
/// creating the parent folder. The file appears whole or not at all (written in
/// `.<file name>.partial/` beside it, then renamed into place); what a cut-short earlier write left
/// there is removed first.
///
/// # Errors
/// [`Error::Dtype`] for other dtypes; [`Error::Io`] / [`Error::SafeTensors`] with the path.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let views: Vec<(String, OwnedView)> = tensors
        .iter()
        .map(|(k, t)| Ok((k.clone(), owned_view(k, t)?)))
        .collect::<Result<_>>()?;
    let meta: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // The safetensors writer stages through a randomly named `.tmpXXXXXX` beside its target; a
    // kill mid-write would leave that behind under a name nothing can clean. Stage it in a
    // folder of a known name instead (`.<file>.partial/`), removed once the file is in place and
    // cleared first when an earlier write of the same file was cut short.
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "adapter.safetensors".into());
    let staging = dir.join(format!(".{name}.partial"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(io_err(&staging))?;
    }
    std::fs::create_dir_all(&staging).map_err(io_err(&staging))?;
    let staged = staging.join(&name);
    ::safetensors::serialize_to_file(
        views.iter().map(|(k, v)| (k.as_str(), v)),
        if meta.is_empty() { None } else { Some(meta) },
        &staged,
    )
    .map_err(st_err(path))?;
    std::fs::rename(&staged, path).map_err(io_err(path))?;
    let _ = std::fs::remove_dir_all(&staging);
    // The safetensors writer creates the file owner-only (0600); adapters are meant to be read by
    // other tools and services (ComfyUI, A1111, a model server), so give them ordinary file modes.
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
            .map_err(io_err(path))?;
    }
    Ok(())
}

/// Infers the site kind from A's rank-dimension count (2 → Linear, 4 → Conv2d).
pub(crate) fn kind_from_a(key: &str, a: &Tensor) -> Result<SiteKind> {
    match a.dim() {
        2 => Ok(SiteKind::Linear),
        4 => Ok(SiteKind::Conv2d),
        _ => Err(Error::Shape {
            key: key.into(),
            expected: vec![-1, -1],
            found: a.size(),
        }),
    }
}

/// Checks that A and B agree on the rank and B has the right trailing dims.
pub(crate) fn check_pair(key: &str, kind: SiteKind, a: &Tensor, b: &Tensor) -> Result<()> {
    let (sa, sb) = (a.size(), b.size());
    let ok = match kind {
        SiteKind::Linear => sb.len() == 2 && sb[1] == sa[0],
        SiteKind::Conv2d => sb.len() == 4 && sb[1] == sa[0] && sb[2] == 1 && sb[3] == 1,
        SiteKind::Embedding => sb.len() == 2 && sb[1] == sa[0],
    };
    if ok {
        Ok(())
    } else {
        let mut expected = vec![-1, sa[0]];
        if kind == SiteKind::Conv2d {
            expected.extend([1, 1]);
        }
        Err(Error::Shape {
            key: key.into(),
            expected,
            found: sb,
        })
    }
}
