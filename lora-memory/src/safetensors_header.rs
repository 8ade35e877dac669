//! Header-only safetensors reading: 8-byte little-endian length `N`, then `N` bytes of JSON
//! `{name: {dtype, shape, data_offsets}, "__metadata__": {...}}` (huggingface/safetensors
//! format spec). Only the header is read; tensor data is never touched.

use crate::error::{Error, Result};
use crate::model::{DecoderDescriptor, DiffusionFamily, ModelDescriptor};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Largest header accepted (the format caps it at 100 MB).
const MAX_HEADER: u64 = 100_000_000;

/// One tensor entry of a safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// dtype string (`BF16`, `F16`, `F32`, `I8`, …).
    pub dtype: String,
    /// Shape, outermost first.
    pub shape: Vec<u64>,
}

impl TensorEntry {
    /// Number of elements.
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Reads the tensor entries of one `.safetensors` file (header only).
///
/// # Errors
/// [`Error::Io`], [`Error::Safetensors`] for a length over 100 MB or past the end of the file,
/// invalid JSON, or an entry without `dtype`/`shape`.
pub fn read_header(path: impl AsRef<Path>) -> Result<BTreeMap<String, TensorEntry>> {
    let path = path.as_ref();
    let io = |source| Error::Io {
        path: path.into(),
        source,
    };
    let bad = |reason: String| Error::Safetensors {
        path: path.into(),
        reason,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    f.read_exact(&mut len_bytes)
        .map_err(|e| bad(format!("cannot read the 8-byte header length ({e})")))?;
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER || n.saturating_add(8) > file_len {
        return Err(bad(format!(
            "header length {n} is larger than the file or the 100 MB limit"
        )));
    }
    let mut buf = vec![0u8; n as usize];
    f.read_exact(&mut buf).map_err(io)?;
    let v: serde_json::Value = serde_json::from_slice(&buf).map_err(|source| Error::Json {
        path: path.into(),
        source,
    })?;
    let obj = v
        .as_object()
        .ok_or_else(|| bad("header is not a JSON object".into()))?;
    let mut out = BTreeMap::new();
    for (name, entry) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = entry
            .get("dtype")
            .and_then(|x| x.as_str())
            .ok_or_else(|| bad(format!("tensor {name:?} has no dtype")))?
            .to_string();
        let shape = entry
            .get("shape")
            .and_then(|x| x.as_array())
            .ok_or_else(|| bad(format!("tensor {name:?} has no shape")))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| bad(format!("tensor {name:?} has a non-integer dim")))
            })
            .collect::<Result<Vec<u64>>>()?;
        out.insert(name.clone(), TensorEntry { dtype, shape });
    }
    Ok(out)
}

fn files_of(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_dir() {
        let rd = std::fs::read_dir(path).map_err(|source| Error::Io {
            path: path.into(),
            source,
        })?;
        let mut v: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        v.sort();
        if v.is_empty() {
            return Err(Error::Safetensors {
                path: path.into(),
                reason: "folder holds no *.safetensors file".into(),
            });
        }
        Ok(v)
    } else {
        Ok(vec![path.to_path_buf()])
    }
}

impl ModelDescriptor {
    /// Reads only safetensors headers (8-byte length + JSON) of a file or a folder (all
    /// `*.safetensors` files in it, plus `config.json` when present) and derives a descriptor:
    /// LLaMA-family HF checkpoints, Stable Diffusion single-file checkpoints (original LDM keys)
    /// and diffusers UNet checkpoints.
    ///
    /// # Errors
    /// [`Error::Io`], [`Error::Safetensors`], [`Error::UnsupportedArchitecture`].
    pub fn from_safetensors(path: impl AsRef<Path>) -> Result<ModelDescriptor> {
        descriptor_from_safetensors(path.as_ref(), None)
    }

    /// [`ModelDescriptor::from_safetensors`] reading the `config.json` beside the weights as
    /// `model_type` (see [`ModelDescriptor::from_hf_config_json_as`]).
    ///
    /// # Errors
    /// As [`ModelDescriptor::from_safetensors`].
    pub fn from_safetensors_as(
        path: impl AsRef<Path>,
        model_type: &str,
    ) -> Result<ModelDescriptor> {
        descriptor_from_safetensors(path.as_ref(), Some(model_type))
    }
}

pub(crate) fn descriptor_from_safetensors(
    path: &Path,
    as_type: Option<&str>,
) -> Result<ModelDescriptor> {
    let mut all = BTreeMap::new();
    for f in files_of(path)? {
        all.extend(read_header(&f)?);
    }
    let total = |prefix: &str| -> u64 {
        all.iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, t)| t.elements())
            .sum()
    };
    let shape = |k: &str| all.get(k).map(|t| t.shape.clone());

    // FLUX.1 transformer: BFL's single file, ComfyUI's, or a diffusers `transformer/` folder
    // (checked first: ComfyUI's all-in-one files also prefix it with `model.diffusion_model.`).
    {
        let it = all.iter().map(|(k, t)| (k.as_str(), t.shape.as_slice()));
        let params = all
            .iter()
            .filter(|(k, _)| {
                let k = k.strip_prefix("model.diffusion_model.").unwrap_or(k);
                !k.starts_with("text_encoders.")
                    && !k.starts_with("vae.")
                    && !k.starts_with("first_stage_model.")
            })
            .map(|(_, t)| t.elements())
            .sum();
        if let Some(d) = crate::flux::FluxDescriptor::from_tensor_names(path, it, params, None)? {
            return Ok(ModelDescriptor::Flux(d));
        }
    }
    // Stable Diffusion single file (original LDM key layout).
    if all.keys().any(|k| k.starts_with("model.diffusion_model.")) {
        let sdxl = all.keys().any(|k| k.starts_with("conditioner.embedders.1"));
        let mut m = match ModelDescriptor::preset(if sdxl { "SDXL" } else { "SD1.5" })? {
            ModelDescriptor::Diffusion(d) => d,
            _ => unreachable_decoder(path)?,
        };
        m.name = path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or(m.name);
        m.unet_params = total("model.diffusion_model.");
        let vae = total("first_stage_model.");
        if vae > 0 {
            m.vae_params = vae;
        }
        if sdxl {
            let te1 = total("conditioner.embedders.0.");
            let te2 = total("conditioner.embedders.1.");
            if te1 > 0 && m.text_encoders.len() == 2 {
                m.text_encoders[0].params = te1;
                m.text_encoders[1].params = te2;
            }
        } else {
            let te = total("cond_stage_model.");
            if te > 0 {
                m.text_encoders[0].params = te;
            }
        }
        return Ok(ModelDescriptor::Diffusion(m));
    }
    // diffusers UNet (diffusion_pytorch_model.safetensors).
    if all
        .keys()
        .any(|k| k.starts_with("down_blocks.") || k.starts_with("unet.down_blocks."))
    {
        let prefix = if all.keys().any(|k| k.starts_with("unet.")) {
            "unet."
        } else {
            ""
        };
        let ctx = all
            .iter()
            .find(|(k, _)| k.ends_with("attn2.to_k.weight"))
            .and_then(|(_, t)| t.shape.get(1).copied())
            .unwrap_or(0);
        let family = match ctx {
            768 => DiffusionFamily::Sd1,
            2048 => DiffusionFamily::Sdxl,
            other => {
                return Err(Error::UnsupportedArchitecture {
                    path: path.into(),
                    arch: format!("diffusers UNet with cross-attention width {other}"),
                    hint: "SD1.x (768) and SDXL (2048) UNets are described".into(),
                });
            }
        };
        let mut m = match ModelDescriptor::preset(if family == DiffusionFamily::Sdxl {
            "SDXL"
        } else {
            "SD1.5"
        })? {
            ModelDescriptor::Diffusion(d) => d,
            _ => unreachable_decoder(path)?,
        };
        m.unet_params = total(prefix);
        return Ok(ModelDescriptor::Diffusion(m));
    }
    // LLaMA-family HF checkpoint.
    let embed = shape("model.embed_tokens.weight").ok_or_else(|| Error::UnsupportedArchitecture {
        path: path.into(),
        arch: format!("{} tensors, first {:?}", all.len(), all.keys().next()),
        hint: "LLaMA-family HF checkpoints (model.embed_tokens.weight, model.layers.N.…), SD single-file and diffusers UNet checkpoints are described".into(),
    })?;
    let cfg = if path.is_dir() {
        path.join("config.json")
    } else {
        path.with_file_name("config.json")
    };
    if cfg.is_file() {
        let mut m = ModelDescriptor::read_hf_config(&cfg, as_type)?;
        if let ModelDescriptor::Decoder(d) = &mut m {
            d.exact_params = Some(all.values().map(TensorEntry::elements).sum());
        }
        return Ok(m);
    }
    let missing = |k: &str| Error::Safetensors {
        path: path.into(),
        reason: format!("tensor {k:?} is missing; put config.json beside the weights"),
    };
    let (vocab, hidden) = (
        embed[0],
        *embed
            .get(1)
            .ok_or_else(|| missing("model.embed_tokens.weight"))?,
    );
    let layers = (0..)
        .take_while(|i| all.contains_key(&format!("model.layers.{i}.self_attn.q_proj.weight")))
        .count() as u64;
    let q = shape("model.layers.0.self_attn.q_proj.weight")
        .ok_or_else(|| missing("model.layers.0.self_attn.q_proj.weight"))?;
    let k = shape("model.layers.0.self_attn.k_proj.weight")
        .ok_or_else(|| missing("model.layers.0.self_attn.k_proj.weight"))?;
    let up = shape("model.layers.0.mlp.up_proj.weight")
        .ok_or_else(|| missing("model.layers.0.mlp.up_proj.weight"))?;
    // Without config.json the head width is not in the shapes: q_norm gives it (Qwen3); otherwise
    // 128 when it divides q's width and the model is wide, else 64 (the two widths in use).
    let head_dim = shape("model.layers.0.self_attn.q_norm.weight")
        .map(|s| s[0])
        .unwrap_or(if hidden >= 2048 && q[0] % 128 == 0 {
            128
        } else {
            64
        });
    let d = DecoderDescriptor::builder(&path.display().to_string())
        .hidden(hidden)
        .intermediate(up[0])
        .layers(layers)
        .heads(q[0] / head_dim)
        .kv_heads(k[0] / head_dim)
        .head_dim(head_dim)
        .vocab(vocab)
        .tied_embeddings(!all.contains_key("lm_head.weight"))
        .attention_bias(all.contains_key("model.layers.0.self_attn.q_proj.bias"))
        .qk_norm(all.contains_key("model.layers.0.self_attn.q_norm.weight"))
        .gated_mlp(all.contains_key("model.layers.0.mlp.gate_proj.weight"))
        .exact_params(all.values().map(TensorEntry::elements).sum())
        .build()
        .map_err(|e| Error::Safetensors {
            path: path.into(),
            reason: e.to_string(),
        })?;
    Ok(ModelDescriptor::Decoder(d))
}

fn unreachable_decoder<T>(path: &Path) -> Result<T> {
    Err(Error::UnsupportedArchitecture {
        path: path.into(),
        arch: "diffusion preset resolved to a decoder".into(),
        hint: "internal preset table inconsistency".into(),
    })
}

/// Test helper: writes a safetensors file holding only a header (and zero bytes for the data).
#[doc(hidden)]
pub fn write_test_file(path: &Path, tensors: &[(&str, &str, &[u64])]) -> std::io::Result<()> {
    let mut obj = serde_json::Map::new();
    let mut off = 0u64;
    for (name, dtype, shape) in tensors {
        let size: u64 = shape.iter().product::<u64>() * if *dtype == "F32" { 4 } else { 2 };
        obj.insert(
            (*name).to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}),
        );
        off += size;
    }
    let header = serde_json::Value::Object(obj).to_string();
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(header.as_bytes());
    // Data is not needed by the reader; write a short tail so the file is not truncated at the header.
    b.extend_from_slice(&[0u8; 8]);
    std::fs::write(path, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_checkpoint_without_config_is_described_from_shapes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let mut t: Vec<(String, &str, Vec<u64>)> =
            vec![("model.embed_tokens.weight".into(), "BF16", vec![1000, 256])];
        for i in 0..2 {
            for (n, s) in [
                ("self_attn.q_proj", vec![256, 256]),
                ("self_attn.k_proj", vec![128, 256]),
                ("self_attn.v_proj", vec![128, 256]),
                ("self_attn.o_proj", vec![256, 256]),
                ("mlp.gate_proj", vec![512, 256]),
                ("mlp.up_proj", vec![512, 256]),
                ("mlp.down_proj", vec![256, 512]),
            ] {
                t.push((format!("model.layers.{i}.{n}.weight"), "BF16", s));
            }
        }
        let refs: Vec<(&str, &str, &[u64])> = t
            .iter()
            .map(|(a, b, c)| (a.as_str(), *b, c.as_slice()))
            .collect();
        write_test_file(&p, &refs).unwrap();
        let ModelDescriptor::Decoder(d) = ModelDescriptor::from_safetensors(&p).unwrap() else {
            panic!()
        };
        assert_eq!(
            (d.hidden, d.intermediate, d.layers, d.vocab),
            (256, 512, 2, 1000)
        );
        assert_eq!((d.heads, d.kv_heads, d.head_dim), (4, 2, 64));
        assert!(d.tied_embeddings);
        assert_eq!(
            d.params(),
            256_000 + 2 * (256 * 256 * 2 + 128 * 256 * 2 + 512 * 256 * 3)
        );
        // The folder form reads the same.
        let ModelDescriptor::Decoder(mut from_dir) =
            ModelDescriptor::from_safetensors(dir.path()).unwrap()
        else {
            panic!()
        };
        from_dir.name.clone_from(&d.name);
        assert_eq!(from_dir, d);
    }

    #[test]
    fn sd_single_file_is_recognised() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("sd.safetensors");
        write_test_file(
            &p,
            &[
                (
                    "model.diffusion_model.input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight",
                    "F16",
                    &[320, 768],
                ),
                (
                    "first_stage_model.encoder.conv_in.weight",
                    "F16",
                    &[128, 3, 3, 3],
                ),
                (
                    "cond_stage_model.transformer.text_model.embeddings.token_embedding.weight",
                    "F16",
                    &[49408, 768],
                ),
            ],
        )
        .unwrap();
        let ModelDescriptor::Diffusion(d) = ModelDescriptor::from_safetensors(&p).unwrap() else {
            panic!()
        };
        assert_eq!(d.family, DiffusionFamily::Sd1);
        assert_eq!(d.unet_params, 320 * 768);
        assert_eq!(d.vae_params, 128 * 27);
        assert_eq!(d.text_encoders[0].params, 49408 * 768);
    }

    #[test]
    fn bad_headers_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.safetensors");
        std::fs::write(&p, u64::MAX.to_le_bytes()).unwrap();
        assert!(
            read_header(&p)
                .unwrap_err()
                .to_string()
                .contains("header length")
        );
        write_test_file(&p, &[("foo.weight", "F32", &[3])]).unwrap();
        assert!(matches!(
            ModelDescriptor::from_safetensors(&p),
            Err(Error::UnsupportedArchitecture { .. })
        ));
    }
}
