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
use ::safetensors::Dtype;
use ::safetensors::tensor::TensorInfo;
use std::collections::BTreeMap;
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
    pub fn dominant_rank_alpha(&self) -> (i64, f64) {
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

pub(crate) fn owned_view(key: &str, t: &Tensor) -> Result<OwnedView> {
    let dtype = dtype_of(t.kind()).ok_or_else(|| Error::Dtype {
        key: key.into(),
        found: format!("{:?}", t.kind()),
        what: "writable dtypes are f32, f16, bf16, f64, i64, i32, i16, i8, u8, bool".into(),
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

/// The largest header the safetensors crate reads back (its `MAX_HEADER_SIZE`).
const MAX_HEADER_BYTES: usize = 100_000_000;

/// A safetensors header in a fixed order: `__metadata__` first (keys sorted, left out when
/// empty), then the tensors in data order.
struct Header<'a> {
    metadata: &'a BTreeMap<String, String>,
    tensors: Vec<(&'a str, TensorInfo)>,
}

impl serde::Serialize for Header<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let has_meta = !self.metadata.is_empty();
        let mut m = s.serialize_map(Some(self.tensors.len() + usize::from(has_meta)))?;
        if has_meta {
            m.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in &self.tensors {
            m.serialize_entry(name, info)?;
        }
        m.end()
    }
}

/// The 8-byte length prefix and JSON header (space-padded to a multiple of 8, as the
/// `safetensors` crate pads it) for `views`, and the views in the order their data follows.
///
/// The order is the `safetensors` crate's own (`tensor.rs`, `prepare`): descending dtype, then
/// name; so a file without metadata is byte-identical to what `safetensors::serialize` writes.
/// Unlike that function, which takes the metadata as a `HashMap` and so writes its entries in a
/// different order on each run, the metadata is written in sorted key order: the same tensors and
/// metadata always give the same bytes.
fn encode_header<'a>(
    path: &Path,
    views: &'a BTreeMap<&'a str, OwnedView>,
    metadata: &'a BTreeMap<String, String>,
) -> Result<(Vec<u8>, Vec<&'a OwnedView>)> {
    let mut order: Vec<(&str, &OwnedView)> = views.iter().map(|(k, v)| (*k, v)).collect();
    order.sort_by(|(ln, l), (rn, r)| r.dtype.cmp(&l.dtype).then(ln.cmp(rn)));
    let mut offset = 0usize;
    let mut tensors = Vec::with_capacity(order.len());
    for (name, v) in &order {
        let end = offset + v.data.len();
        tensors.push((
            *name,
            TensorInfo {
                dtype: v.dtype,
                shape: v.shape.clone(),
                data_offsets: (offset, end),
            },
        ));
        offset = end;
    }
    let header = Header { metadata, tensors };
    let mut json = serde_json::to_vec(&header)
        .map_err(|e| st_err(path)(::safetensors::SafeTensorError::JsonError(e)))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    if json.len() > MAX_HEADER_BYTES {
        return Err(st_err(path)(::safetensors::SafeTensorError::HeaderTooLarge));
    }
    let mut bytes = Vec::with_capacity(8 + json.len());
    bytes.extend_from_slice(&(json.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    Ok((bytes, order.into_iter().map(|(_, v)| v).collect()))
}

/// Writes `tensors` (any device; f32/f16/bf16/f64/i64/i32/i16/i8/u8/bool) and `metadata` to a
/// safetensors file, creating the parent folder. This is the workspace's one safetensors writer.
///
/// The bytes depend only on the tensors and metadata: tensors are laid out in the `safetensors`
/// crate's order (descending dtype, then name) and `__metadata__` (left out when empty) lists its
/// keys sorted, so two runs that write the same values write byte-identical files.
///
/// The file appears whole or not at all: it is written in `.<file name>.partial/` beside it,
/// fsync'ed, then renamed into place; what a cut-short earlier write left there is removed first.
/// It gets mode 0644 on Unix.
///
/// # Errors
/// [`Error::Dtype`] for other dtypes; [`Error::Io`] / [`Error::SafeTensors`] with the path.
pub fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    use std::io::Write;
    let views: BTreeMap<&str, OwnedView> = tensors
        .iter()
        .map(|(k, t)| Ok((k.as_str(), owned_view(k, t)?)))
        .collect::<Result<_>>()?;
    let (header, order) = encode_header(path, &views, metadata)?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    // Stage in a folder of a known name (`.<file>.partial/`), removed once the file is in place
    // and cleared first when an earlier write of the same file was cut short, so that a kill
    // mid-write leaves nothing under a name nothing can clean.
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
    let file = std::fs::File::create(&staged).map_err(io_err(&staged))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header).map_err(io_err(&staged))?;
    for v in order {
        w.write_all(&v.data).map_err(io_err(&staged))?;
    }
    let file = w
        .into_inner()
        .map_err(|e| io_err(&staged)(e.into_error()))?;
    file.sync_all().map_err(io_err(&staged))?;
    drop(file);
    std::fs::rename(&staged, path).map_err(io_err(path))?;
    let _ = std::fs::remove_dir_all(&staging);
    // Adapters are meant to be read by other tools and services (ComfyUI, A1111, a model
    // server): give them ordinary file modes whatever the umask.
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

#[cfg(test)]
mod tests {
    use super::*;
    use ::safetensors::SafeTensors;
    use std::collections::HashMap;

    fn tensors(order: &[&str]) -> BTreeMap<String, Tensor> {
        let all = |name: &str| match name {
            "b.weight" => Tensor::from_slice(&[1.5f32, -2.0, 3.25, 0.0]).reshape([2, 2]),
            "a.weight" => Tensor::from_slice(&[0.5f32, 4.0])
                .reshape([1, 2])
                .to_kind(Kind::BFloat16),
            "c.codes" => Tensor::from_slice(&[7u8, 9, 255]),
            _ => Tensor::from_slice(&[8.0f32]).reshape(Vec::<i64>::new()),
        };
        let mut m = BTreeMap::new();
        for n in order {
            m.insert((*n).to_string(), all(n));
        }
        m
    }

    fn metadata(order: &[(&str, &str)]) -> BTreeMap<String, String> {
        order
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    const NAMES: [&str; 4] = ["b.weight", "a.weight", "c.codes", "b.alpha"];
    const META: [(&str, &str); 5] = [
        ("ss_network_dim", "4"),
        ("lora_train.steps", "12"),
        ("ss_network_alpha", "8"),
        ("format", "pt"),
        ("ss_seed", "42"),
    ];

    #[test]
    fn the_same_tensors_and_metadata_give_byte_identical_files() {
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (
            dir.path().join("1/x.safetensors"),
            dir.path().join("2/x.safetensors"),
        );
        let mut names_rev = NAMES;
        names_rev.reverse();
        let mut meta_rev = META;
        meta_rev.reverse();
        write_safetensors(&one, &tensors(&NAMES), &metadata(&META)).unwrap();
        write_safetensors(&two, &tensors(&names_rev), &metadata(&meta_rev)).unwrap();
        let (a, b) = (std::fs::read(&one).unwrap(), std::fs::read(&two).unwrap());
        assert_eq!(a, b);

        // The header lists the metadata keys sorted, then the tensors by descending dtype (F32,
        // BF16, U8), then name.
        let n = u64::from_le_bytes(a[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let header = std::str::from_utf8(&a[8..8 + n]).unwrap();
        let pos = |k: &str| header.find(&format!("\"{k}\"")).unwrap();
        let keys = [
            "__metadata__",
            "format",
            "lora_train.steps",
            "ss_network_alpha",
            "ss_network_dim",
            "ss_seed",
            "b.alpha",
            "b.weight",
            "a.weight",
            "c.codes",
        ];
        let found: Vec<usize> = keys.iter().map(|k| pos(k)).collect();
        let mut sorted = found.clone();
        sorted.sort();
        assert_eq!(found, sorted, "{header}");

        // The file reads back whole, values and metadata included.
        let st = SafeTensors::deserialize(&a).unwrap();
        let (_, meta) = SafeTensors::read_metadata(&a).unwrap();
        let meta: BTreeMap<String, String> = meta.metadata().clone().unwrap().into_iter().collect();
        assert_eq!(meta, metadata(&META));
        let w = st.tensor("b.weight").unwrap();
        assert_eq!(w.dtype(), Dtype::F32);
        assert_eq!(w.shape(), &[2, 2]);
        let vals: Vec<f32> = w
            .data()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, [1.5, -2.0, 3.25, 0.0]);
        assert_eq!(st.tensor("c.codes").unwrap().data(), &[7u8, 9, 255]);
        assert_eq!(st.tensor("b.alpha").unwrap().shape(), &[] as &[usize]);
        let (back, back_meta) = read_safetensors(&one).unwrap();
        assert_eq!(back_meta, metadata(&META));
        let a_w = back["a.weight"].to_kind(Kind::Float);
        assert_eq!(Vec::<f32>::try_from(a_w.reshape([-1])).unwrap(), [0.5, 4.0]);
    }

    #[test]
    fn the_layout_is_the_safetensors_crates_own() {
        // With at most one metadata entry the crate's HashMap has one order, so its bytes and ours
        // must agree exactly.
        let dir = tempfile::tempdir().unwrap();
        let t = tensors(&NAMES);
        for meta in [metadata(&[]), metadata(&[("format", "pt")])] {
            let path = dir.path().join("x.safetensors");
            write_safetensors(&path, &t, &meta).unwrap();
            let views: BTreeMap<&str, OwnedView> = t
                .iter()
                .map(|(k, v)| (k.as_str(), owned_view(k, v).unwrap()))
                .collect();
            let theirs = ::safetensors::serialize(
                views.iter().map(|(k, v)| (*k, CrateView(v))),
                (!meta.is_empty()).then(|| meta.clone().into_iter().collect::<HashMap<_, _>>()),
            )
            .unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), theirs);
        }
    }

    #[test]
    fn a_cut_short_earlier_write_is_cleared_and_nothing_is_left_beside_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let staging = dir.path().join(".x.safetensors.partial");
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("x.safetensors"), b"half").unwrap();
        let path = dir.path().join("x.safetensors");
        write_safetensors(&path, &tensors(&NAMES), &BTreeMap::new()).unwrap();
        let left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["x.safetensors"]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o644);
        }
    }

    /// The crate's `View` over our bytes, to compare with `safetensors::serialize`.
    struct CrateView<'a>(&'a OwnedView);

    impl ::safetensors::View for CrateView<'_> {
        fn dtype(&self) -> Dtype {
            self.0.dtype
        }
        fn shape(&self) -> &[usize] {
            &self.0.shape
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            std::borrow::Cow::Borrowed(&self.0.data)
        }
        fn data_len(&self) -> usize {
            self.0.data.len()
        }
    }
}
