//! Conversions between the layouts CLIP text encoders are stored in: original single-file SD
//! checkpoints (transformers' layout under an LDM/SGM prefix, or OpenCLIP's layout with fused
//! attention projections) read into transformers' `CLIPTextModel` names, and the module paths of
//! transformers 5.x (no `text_model.` level) renamed to the canonical ones.

use std::collections::HashMap;
use std::path::Path;

use lora_core::formats::AdapterWeights;
use tch::{Device, Kind, Tensor};

use super::config::{ClipActivation, ClipTextConfig};
use super::model::{ClipTextModel, ClipTextModelWithProjection};
use crate::error::{Error, Result};
use crate::weights::{SafetensorsFiles, TensorMap, TensorSource};

/// The site path of a CLIP text-encoder module path: paths of a transformers 5.x bare
/// `CLIPTextModel` (`encoder.layers.0.self_attn.q_proj`, `embeddings.…`,
/// `final_layer_norm`) get the `text_model.` level that transformers 4.x, diffusers, kohya and
/// this crate use; other paths are returned unchanged.
pub fn canonical_module_path(path: &str) -> String {
    if path.starts_with("encoder.") || path.starts_with("embeddings.") || path == "final_layer_norm"
    {
        format!("text_model.{path}")
    } else {
        path.to_string()
    }
}

/// Renames the modules of an adapter with [`canonical_module_path`] (for PEFT adapters saved
/// from a transformers 5.x `CLIPTextModel`).
pub fn canonicalize_adapter(weights: &mut AdapterWeights) {
    let modules = std::mem::take(&mut weights.modules);
    weights.modules = modules
        .into_iter()
        .map(|(k, v)| (canonical_module_path(&k), v))
        .collect();
}

/// The number of encoder layers stored under `head` (`…layers.N.` / `…resblocks.N.` names).
fn count_layers(src: &SafetensorsFiles, head: &str) -> i64 {
    src.names()
        .filter_map(|n| n.strip_prefix(head)?.split('.').next()?.parse::<i64>().ok())
        .max()
        .map_or(0, |m| m + 1)
}

fn stored_shape(src: &SafetensorsFiles, name: &str, path: &Path) -> Result<Vec<i64>> {
    src.shape(name).ok_or_else(|| Error::MissingTensor {
        name: name.into(),
        path: path.to_path_buf(),
    })
}

/// A CLIP text config read off the stored shapes of a single-file checkpoint, for encoders
/// with 64-wide heads (CLIP ViT-L/14, OpenCLIP ViT-H/14 and ViT-bigG/14 — every SD text
/// encoder): `vocab_size`, `hidden_size` from the token embedding, the positions, the layer
/// count, the MLP width; `eos_token_id` 2 as the SD/SDXL `config.json` files have it.
fn inferred_config(
    vocab_hidden: &[i64],
    positions: i64,
    layers: i64,
    intermediate: i64,
    projection_dim: Option<i64>,
    act: ClipActivation,
    path: &Path,
) -> Result<ClipTextConfig> {
    let (vocab, d) = match vocab_hidden {
        [v, d] => (*v, *d),
        other => {
            return Err(Error::Config {
                path: path.to_path_buf(),
                msg: format!("token embedding of shape {other:?}, expected [vocab, hidden]"),
            });
        }
    };
    if d % 64 != 0 || layers == 0 {
        return Err(Error::Config {
            path: path.to_path_buf(),
            msg: format!(
                "cannot infer the text encoder's config (hidden {d}, {layers} layers): pass its config.json"
            ),
        });
    }
    Ok(ClipTextConfig {
        vocab_size: vocab,
        hidden_size: d,
        intermediate_size: intermediate,
        projection_dim,
        num_hidden_layers: layers,
        num_attention_heads: d / 64,
        max_position_embeddings: positions,
        hidden_act: act,
        ..ClipTextConfig::sd15()
    })
}

impl ClipTextModel {
    /// Loads the CLIP text encoder of an original single-file checkpoint, stored in
    /// transformers' layout under `prefix`: [`crate::sd::load::LDM_TEXT_ENCODER_PREFIX`]
    /// (SD 1.x, `cond_stage_model.transformer.`) or
    /// [`crate::sd::load::SGM_TEXT_ENCODER_PREFIX`] (SDXL's first encoder,
    /// `conditioner.embedders.0.transformer.`), with or without the `text_model.` level.
    /// `config` = `None` reads the sizes off the stored shapes (64-wide heads, `quick_gelu`:
    /// OpenAI's CLIP ViT-L/14 of SD 1.x and SDXL).
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::Safetensors`] for the file; [`Error::MissingTensor`] naming the
    /// stored key; [`Error::Shape`] when the weights do not fit `config`.
    pub fn from_single_file(
        path: &Path,
        prefix: &str,
        config: Option<ClipTextConfig>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let src = SafetensorsFiles::open(&[path.to_path_buf()], path, device)?;
        let p = if src.contains(&format!(
            "{prefix}text_model.embeddings.token_embedding.weight"
        )) {
            format!("{prefix}text_model.")
        } else {
            prefix.to_string()
        };
        let config = match config {
            Some(c) => c,
            None => inferred_config(
                &stored_shape(&src, &format!("{p}embeddings.token_embedding.weight"), path)?,
                stored_shape(
                    &src,
                    &format!("{p}embeddings.position_embedding.weight"),
                    path,
                )?[0],
                count_layers(&src, &format!("{p}encoder.layers.")),
                stored_shape(&src, &format!("{p}encoder.layers.0.mlp.fc1.weight"), path)?[0],
                None,
                ClipActivation::QuickGelu,
                path,
            )?,
        };
        Self::build(config, &src, prefix, kind, device)
    }
}

impl ClipTextModelWithProjection {
    /// Loads an OpenCLIP text tower stored under `prefix` in an original single-file checkpoint
    /// — SDXL's second encoder, [`crate::sd::load::SGM_TEXT_ENCODER_2_PREFIX`]
    /// (`conditioner.embedders.1.model.`) — converting OpenCLIP's layout to transformers' as
    /// diffusers' `convert_open_clip_checkpoint` (`loaders/single_file_utils.py`) does:
    /// `token_embedding.weight`, `positional_embedding` → position embedding,
    /// `transformer.resblocks.N.{ln_1, ln_2}` → `layer_norm{1,2}`, `attn.in_proj_{weight,bias}`
    /// (`[3D, D]`, `[3D]`) split in three → `q_proj`, `k_proj`, `v_proj`, `attn.out_proj` →
    /// `out_proj`, `mlp.{c_fc, c_proj}` → `mlp.{fc1, fc2}`, `ln_final` → `final_layer_norm`,
    /// and `text_projection` `[D, P]` (used as `x @ P`) transposed into the `[P, D]` linear
    /// weight. `config` = `None` reads the sizes off the stored shapes (64-wide heads, `gelu`:
    /// ViT-bigG/14).
    ///
    /// # Errors
    /// As [`ClipTextModel::from_single_file`]; [`Error::Shape`] for an `in_proj` that is not
    /// `[3D, D]`.
    pub fn from_open_clip(
        path: &Path,
        prefix: &str,
        config: Option<ClipTextConfig>,
        kind: Kind,
        device: Device,
    ) -> Result<Self> {
        let src = SafetensorsFiles::open(&[path.to_path_buf()], path, Device::Cpu)?;
        let key = |rest: &str| format!("{prefix}{rest}");
        let layers = count_layers(&src, &key("transformer.resblocks."));
        let config = match config {
            Some(c) => c,
            None => {
                let proj = stored_shape(&src, &key("text_projection"), path)?;
                inferred_config(
                    &stored_shape(&src, &key("token_embedding.weight"), path)?,
                    stored_shape(&src, &key("positional_embedding"), path)?[0],
                    layers,
                    stored_shape(&src, &key("transformer.resblocks.0.mlp.c_fc.weight"), path)?[0],
                    proj.get(1).copied(),
                    ClipActivation::Gelu,
                    path,
                )?
            }
        };
        let get = |rest: &str| -> Result<Tensor> {
            src.tensor(&key(rest), kind)?
                .ok_or_else(|| Error::MissingTensor {
                    name: key(rest),
                    path: path.to_path_buf(),
                })
        };
        let d = config.hidden_size;
        let mut map: HashMap<String, Tensor> = HashMap::new();
        map.insert(
            "text_model.embeddings.token_embedding.weight".into(),
            get("token_embedding.weight")?,
        );
        map.insert(
            "text_model.embeddings.position_embedding.weight".into(),
            get("positional_embedding")?,
        );
        for leaf in ["weight", "bias"] {
            map.insert(
                format!("text_model.final_layer_norm.{leaf}"),
                get(&format!("ln_final.{leaf}"))?,
            );
        }
        map.insert(
            "text_projection.weight".into(),
            get("text_projection")?.f_tr()?.f_contiguous()?,
        );
        for i in 0..layers {
            let o = format!("transformer.resblocks.{i}");
            let t = format!("text_model.encoder.layers.{i}");
            for (from, to) in [
                ("ln_1", "layer_norm1"),
                ("ln_2", "layer_norm2"),
                ("attn.out_proj", "self_attn.out_proj"),
                ("mlp.c_fc", "mlp.fc1"),
                ("mlp.c_proj", "mlp.fc2"),
            ] {
                for leaf in ["weight", "bias"] {
                    map.insert(
                        format!("{t}.{to}.{leaf}"),
                        get(&format!("{o}.{from}.{leaf}"))?,
                    );
                }
            }
            for (leaf, shape) in [("weight", vec![3 * d, d]), ("bias", vec![3 * d])] {
                let name = format!("{o}.attn.in_proj_{leaf}");
                let fused = get(&format!("{o}.attn.in_proj_{leaf}"))?;
                if fused.size() != shape {
                    return Err(Error::Shape {
                        name: key(&name),
                        expected: shape,
                        found: fused.size(),
                    });
                }
                for (j, part) in fused.f_chunk(3, 0)?.into_iter().enumerate() {
                    let qkv = ["q_proj", "k_proj", "v_proj"][j];
                    map.insert(format!("{t}.self_attn.{qkv}.{leaf}"), part.f_contiguous()?);
                }
            }
        }
        drop(src);
        Self::build(config, &TensorMap::new(&map, device), "", kind, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An OpenCLIP text tower (hidden 64 = one 64-wide head, 2 layers, MLP 128, 9 tokens, 5
    /// positions, projection 16) written in OpenCLIP's layout, and the same weights in
    /// transformers' layout, built independently of `from_open_clip`.
    fn open_clip_pair(prefix: &str) -> (Vec<(String, Tensor)>, HashMap<String, Tensor>) {
        let _lock = crate::test_rng_lock();
        tch::manual_seed(5);
        let r = |s: &[i64]| Tensor::randn(s, (Kind::Float, Device::Cpu)) * 0.2;
        let (d, ff) = (64, 128);
        let mut oc: Vec<(String, Tensor)> = Vec::new();
        let mut hf: HashMap<String, Tensor> = HashMap::new();
        let both = |oc: &mut Vec<(String, Tensor)>,
                    hf: &mut HashMap<String, Tensor>,
                    o: &str,
                    h: &str,
                    t: Tensor| {
            hf.insert(h.to_string(), t.copy());
            oc.push((format!("{prefix}{o}"), t));
        };
        both(
            &mut oc,
            &mut hf,
            "token_embedding.weight",
            "text_model.embeddings.token_embedding.weight",
            r(&[9, d]),
        );
        both(
            &mut oc,
            &mut hf,
            "positional_embedding",
            "text_model.embeddings.position_embedding.weight",
            r(&[5, d]),
        );
        both(
            &mut oc,
            &mut hf,
            "ln_final.weight",
            "text_model.final_layer_norm.weight",
            r(&[d]) + 1.0,
        );
        both(
            &mut oc,
            &mut hf,
            "ln_final.bias",
            "text_model.final_layer_norm.bias",
            r(&[d]),
        );
        for i in 0..2 {
            let (o, t) = (
                format!("transformer.resblocks.{i}"),
                format!("text_model.encoder.layers.{i}"),
            );
            for (a, b, shape) in [
                ("ln_1.weight", "layer_norm1.weight", vec![d]),
                ("ln_1.bias", "layer_norm1.bias", vec![d]),
                ("ln_2.weight", "layer_norm2.weight", vec![d]),
                ("ln_2.bias", "layer_norm2.bias", vec![d]),
                (
                    "attn.out_proj.weight",
                    "self_attn.out_proj.weight",
                    vec![d, d],
                ),
                ("attn.out_proj.bias", "self_attn.out_proj.bias", vec![d]),
                ("mlp.c_fc.weight", "mlp.fc1.weight", vec![ff, d]),
                ("mlp.c_fc.bias", "mlp.fc1.bias", vec![ff]),
                ("mlp.c_proj.weight", "mlp.fc2.weight", vec![d, ff]),
                ("mlp.c_proj.bias", "mlp.fc2.bias", vec![d]),
            ] {
                both(
                    &mut oc,
                    &mut hf,
                    &format!("{o}.{a}"),
                    &format!("{t}.{b}"),
                    r(&shape),
                );
            }
            let (w, b) = (r(&[3 * d, d]), r(&[3 * d]));
            for (j, q) in ["q_proj", "k_proj", "v_proj"].iter().enumerate() {
                let j = j as i64;
                hf.insert(
                    format!("{t}.self_attn.{q}.weight"),
                    w.narrow(0, j * d, d).copy(),
                );
                hf.insert(
                    format!("{t}.self_attn.{q}.bias"),
                    b.narrow(0, j * d, d).copy(),
                );
            }
            oc.push((format!("{prefix}{o}.attn.in_proj_weight"), w));
            oc.push((format!("{prefix}{o}.attn.in_proj_bias"), b));
        }
        // OpenCLIP applies `x @ text_projection` ([D, P]); transformers a [P, D] linear
        let p = r(&[d, 16]);
        hf.insert("text_projection.weight".into(), p.tr().contiguous());
        oc.push((format!("{prefix}text_projection"), p));
        oc.push((format!("{prefix}logit_scale"), Tensor::from(4.6f32)));
        (oc, hf)
    }

    #[test]
    fn open_clip_single_file_towers_load_like_their_transformers_layout() {
        let prefix = crate::sd::load::SGM_TEXT_ENCODER_2_PREFIX;
        let (oc, hf) = open_clip_pair(prefix);
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("sdxl.safetensors");
        Tensor::write_safetensors(&oc, &file).unwrap();
        // sizes read off the stored shapes
        let m = ClipTextModelWithProjection::from_open_clip(
            &file,
            prefix,
            None,
            Kind::Float,
            Device::Cpu,
        )
        .unwrap();
        let c = m.config();
        assert_eq!(
            (
                c.vocab_size,
                c.hidden_size,
                c.num_attention_heads,
                c.num_hidden_layers
            ),
            (9, 64, 1, 2)
        );
        assert_eq!(
            (
                c.intermediate_size,
                c.max_position_embeddings,
                c.projection_dim
            ),
            (128, 5, Some(16))
        );
        assert_eq!((c.hidden_act, c.eos_token_id), (ClipActivation::Gelu, 2));
        let want =
            ClipTextModelWithProjection::from_tensors(c.clone(), &hf, "", Kind::Float, Device::Cpu)
                .unwrap();
        let ids = Tensor::from_slice(&[0i64, 3, 8, 1, 1, 0, 5, 7, 8, 1]).view([2, 5]);
        let (a, b) = tch::no_grad(|| {
            (
                m.forward_t(&ids, false).unwrap(),
                want.forward_t(&ids, false).unwrap(),
            )
        });
        let diff = |x: &Tensor, y: &Tensor| (x - y).abs().max().double_value(&[]);
        assert_eq!(diff(&a.last_hidden_state, &b.last_hidden_state), 0.0);
        let (ea, eb) = (a.text_embeds.unwrap(), b.text_embeds.unwrap());
        assert_eq!(ea.size(), [2, 16]);
        assert_eq!(diff(&ea, &eb), 0.0);
        // a fused in_proj of the wrong size is named
        let mut bad = oc;
        for (k, t) in bad.iter_mut() {
            if k.ends_with("resblocks.1.attn.in_proj_bias") {
                *t = t.narrow(0, 0, 100).copy();
            }
        }
        Tensor::write_safetensors(&bad, &file).unwrap();
        let e = ClipTextModelWithProjection::from_open_clip(
            &file,
            prefix,
            None,
            Kind::Float,
            Device::Cpu,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("resblocks.1.attn.in_proj_bias"), "{e}");
    }
}
