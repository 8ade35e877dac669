//! FLUX LoRA files in the two layouts other tools read: diffusers' keys and kohya / ComfyUI's
//! keys in Black Forest Labs' fused layout.
//!
//! Our FLUX adapters live on diffusers' module paths ([`super::model`]), so an adapter is an
//! [`AdapterWeights`] keyed `transformer_blocks.0.attn.to_q`, … . On disk:
//!
//! - **diffusers** ([`write_diffusers`]): `transformer.<module>.lora_A.weight` `[r, in]` /
//!   `.lora_B.weight` `[out, r]`, as `FluxPipeline.save_lora_weights` writes them
//!   (`FluxLoraLoaderMixin.transformer_name = "transformer"`, diffusers 0.42.1). The file holds no
//!   alpha: `FluxPipeline.lora_state_dict` would only take `*.alpha` keys as kohya-style network
//!   alphas, which PEFT's `load_lora_adapter` maps onto `lora_alpha` by module-name patterns, so the
//!   scaling `alpha / r` (or `alpha / √r` with rsLoRA) is folded into `lora_B` (`B' = B · scaling`,
//!   alpha = r implied) — what [`lora_core::formats::diffusers::write`] does for every pipeline.
//! - **kohya / ComfyUI** ([`write_kohya`]): one module per BFL module
//!   (`lora_unet_double_blocks_0_img_attn_qkv`), `.lora_down.weight` `[r_total, in]`,
//!   `.lora_up.weight` `[out_total, r_total]`, `.alpha` (f32, 0-d), built by [`to_bfl_lora`]
//!   from the per-module adapters through the fusion table [`bfl_modules`]; header metadata
//!   `ss_network_module = networks.lora_flux` and `ss_base_model_version = flux1` as sd-scripts'
//!   `flux_train_network.py` writes them.
//!
//! [`read_adapter`] reads either layout back into per-module adapters on diffusers' paths
//! ([`from_bfl_lora`] splits fused modules exactly).
//!
//! ```no_run
//! # fn main() -> lora_models::Result<()> {
//! use lora_core::formats::AdapterWeights;
//! use lora_models::flux::FluxTransformer2DModel;
//! use lora_models::flux::lora::{read_adapter, write_diffusers, write_kohya};
//! use lora_models::sd::LoadOptions;
//! let opts = LoadOptions::default();
//! let mut model = FluxTransformer2DModel::from_single_file("flux1-dev.safetensors".as_ref(), &opts, None)?;
//! // … inject and train adapter "default" …
//! let w = AdapterWeights::from_model(&mut model, "default")?;
//! write_diffusers(&w, "out/pytorch_lora_weights.safetensors".as_ref())?; // FluxPipeline.load_lora_weights
//! write_kohya(&w, model.config(), "out/my_flux_lora.safetensors".as_ref())?; // ComfyUI, Forge, kohya
//! let back = read_adapter("out/my_flux_lora.safetensors".as_ref(), model.config())?;
//! println!("{} modules on diffusers paths", back.modules.len());
//! # Ok(()) }
//! ```
//!
//! # Fusing adapters exactly
//! A fused BFL module is the row concatenation of diffusers modules (`img_attn.qkv` = `to_q` ‖
//! `to_k` ‖ `to_v`). With member adapters `(A_i [r_i, in], B_i [out_i, r_i], s_i)` the fused
//! adapter is `down = [A_1; A_2; …]` (`[Σr_i, in]`) and `up` block-diagonal: the rows of member
//! `i` hold `B_i` in the columns of `A_i` and zeros elsewhere, so `up · down` restricted to
//! member `i`'s rows is `B_i · A_i`. kohya has one alpha per module (scaling `alpha / r_total`,
//! sd-scripts `networks/lora_flux.py`); when every member has the same scaling `s`, alpha =
//! `s · r_total` and `up` holds the `B_i` as trained; otherwise each `B_i` is multiplied by its
//! own `s_i` and alpha = `r_total`. Members without an adapter contribute no rank and zero rows
//! of `up`. `final_layer.adaLN_modulation.1` (`norm_out.linear` with its halves swapped) is the
//! same construction with the rows of `up` reordered. Modules under `final_layer` always have their
//! scaling folded (alpha = `r_total`): diffusers' converter discards their alpha.
//!
//! # What diffusers 0.42.1 does with a kohya FLUX file
//! `FluxPipeline.load_lora_weights` converts it with `_convert_kohya_flux_lora_to_diffusers`
//! (`loaders/lora_conversion_utils.py`), which recognises the block-diagonal `up` and splits it
//! back (or, when it cannot, copies `down` to every member: still exact). Two limits of that
//! converter, not of the file:
//! - it assumes FLUX.1's widths for `single_blocks.N.linear1` (3072, 3072, 3072, 12288 rows), so
//!   linear1 of a model of another width fails there (ComfyUI applies it);
//! - it names the modules outside the blocks (`img_in`, `txt_in`, `time_in`, `vector_in`,
//!   `guidance_in`, `final_layer`) without the `transformer.` prefix, so `load_lora_weights`
//!   silently leaves them out. Adapters on those modules reach diffusers through the diffusers
//!   layout; kohya's own FLUX LoRAs train the blocks only (sd-scripts' default).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use lora_core::config::scaling;
use lora_core::formats::kohya::{self, KOHYA_UNET_PREFIX};
use lora_core::formats::{AdapterWeights, ModuleLora, diffusers};
use lora_core::layer::SiteKind;
use tch::{Kind, Tensor};

use super::config::FluxConfig;
use super::convert::{BflModule, BflModuleKind, bfl_modules};
use crate::error::{Error, Result};

/// The kohya prefix of FLUX transformer modules (`lora_unet`, sd-scripts `lora_flux.py`
/// `LORA_PREFIX_FLUX`).
pub const KOHYA_FLUX_PREFIX: &str = KOHYA_UNET_PREFIX;

/// The component prefix of the transformer in diffusers LoRA files (`FluxPipeline`'s
/// `transformer_name`).
pub const DIFFUSERS_COMPONENT: &str = "transformer";

/// kohya's `ss_network_module` for FLUX LoRAs (sd-scripts `networks/lora_flux.py`).
pub const KOHYA_FLUX_NETWORK_MODULE: &str = "networks.lora_flux";

/// kohya's `ss_base_model_version` for FLUX.1 (sd-scripts `flux_train_network.py`).
pub const KOHYA_FLUX_BASE_MODEL_VERSION: &str = "flux1";

/// The distinct diffusers modules of `m`, in the order of their first rows.
fn members(m: &BflModule) -> Vec<&str> {
    let mut out: Vec<&str> = Vec::new();
    for p in &m.parts {
        if !out.contains(&p.module.as_str()) {
            out.push(&p.module);
        }
    }
    out
}

fn linear_modules(config: &FluxConfig) -> Vec<BflModule> {
    bfl_modules(config)
        .into_iter()
        .filter(|m| m.kind == BflModuleKind::Linear)
        .collect()
}

fn unsupported(value: &str, hint: &str) -> Error {
    Error::Unsupported {
        what: "FLUX LoRA module",
        value: value.to_string(),
        hint: hint.to_string(),
    }
}

/// The adapter `w` (keyed by diffusers module paths of a FLUX transformer of `config`'s shape)
/// as per-module adapters of BFL's layout (keyed `double_blocks.0.img_attn.qkv`, …), each
/// fused exactly as the module docs say; plain `alpha / r` scaling (`use_rslora` false),
/// `w`'s metadata kept. BFL modules none of whose members is adapted are left out.
///
/// # Shapes
/// A fused module of members `i`: `lora_a` `[Σr_i, in]`, `lora_b` `[Σout_i, Σr_i]`, in `w`'s dtypes.
///
/// # Errors
/// [`Error::Unsupported`] for DoRA modules (no kohya `networks.lora_flux` equivalent) and for
/// modules that are not linears of the transformer (listed); [`Error::Shape`] when a module's
/// `lora_b` rows or the members' input widths do not fit `config`; [`Error::Torch`].
pub fn to_bfl_lora(w: &AdapterWeights, config: &FluxConfig) -> Result<AdapterWeights> {
    let mut out = AdapterWeights {
        metadata: w.metadata.clone(),
        ..AdapterWeights::default()
    };
    let mut used = BTreeSet::new();
    for m in linear_modules(config) {
        let names = members(&m);
        let adapted: Vec<(&str, &ModuleLora)> = names
            .iter()
            .filter_map(|n| w.modules.get(*n).map(|l| (*n, l)))
            .collect();
        if adapted.is_empty() {
            continue;
        }
        for (name, l) in &adapted {
            if l.magnitude.is_some() {
                return Err(unsupported(
                    name,
                    "a DoRA module has no kohya networks.lora_flux equivalent; save as PEFT or diffusers",
                ));
            }
            if l.kind != SiteKind::Linear {
                return Err(unsupported(
                    name,
                    "FLUX transformer adapters are on linears only",
                ));
            }
            used.insert(name.to_string());
        }
        let r_total: i64 = adapted.iter().map(|(_, l)| l.rank()).sum();
        let scales: Vec<f64> = adapted
            .iter()
            .map(|(_, l)| scaling(l.alpha, l.rank(), w.use_rslora))
            .collect();
        let uniform = scales.iter().all(|s| *s == scales[0]);
        let fold = !uniform || m.bfl.starts_with("final_layer");
        let alpha = if fold {
            r_total as f64
        } else {
            scales[0] * r_total as f64
        };
        let in_dim = adapted[0].1.lora_a.size()[1];
        for (name, l) in &adapted {
            if l.lora_a.size()[1] != in_dim {
                return Err(Error::Shape {
                    name: format!("{name}.lora_A"),
                    expected: vec![l.rank(), in_dim],
                    found: l.lora_a.size(),
                });
            }
        }
        let downs: Vec<&Tensor> = adapted.iter().map(|(_, l)| &l.lora_a).collect();
        let down = Tensor::f_cat(&downs, 0)?;
        // each member's column block of `up`
        let mut cols: BTreeMap<&str, (i64, i64, f64, &Tensor)> = BTreeMap::new();
        let mut offset = 0;
        for ((name, l), s) in adapted.iter().zip(&scales) {
            let s = if fold { *s } else { 1.0 };
            cols.insert(name, (offset, l.rank(), s, &l.lora_b));
            offset += l.rank();
        }
        let b_kind = adapted[0].1.lora_b.kind();
        let device = adapted[0].1.lora_b.device();
        let mut rows = Vec::with_capacity(m.parts.len());
        for p in &m.parts {
            let Some(&(start, r, s, b)) = cols.get(p.module.as_str()) else {
                rows.push(Tensor::f_zeros([p.rows, r_total], (b_kind, device))?);
                continue;
            };
            let out_rows = m
                .parts
                .iter()
                .filter(|q| q.module == p.module)
                .map(|q| q.start + q.rows)
                .max()
                .unwrap_or(0);
            if b.size()[0] != out_rows {
                return Err(Error::Shape {
                    name: format!("{}.lora_B", p.module),
                    expected: vec![out_rows, r],
                    found: b.size(),
                });
            }
            let mut block = b.f_narrow(0, p.start, p.rows)?;
            if s != 1.0 {
                block = block.f_mul_scalar(s)?.f_to_kind(b_kind)?;
            }
            let left = Tensor::f_zeros([p.rows, start], (b_kind, device))?;
            let right = Tensor::f_zeros([p.rows, r_total - start - r], (b_kind, device))?;
            rows.push(Tensor::f_cat(&[left, block, right], 1)?);
        }
        let up = Tensor::f_cat(&rows, 0)?;
        out.modules.insert(
            m.bfl.clone(),
            ModuleLora {
                kind: SiteKind::Linear,
                lora_a: down,
                lora_b: up,
                alpha,
                magnitude: None,
            },
        );
    }
    let left: Vec<&str> = w
        .modules
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .map(String::as_str)
        .collect();
    if !left.is_empty() {
        return Err(unsupported(
            &left.join(", "),
            "not a linear of this FLUX transformer's shape (expected diffusers module paths such as \
             transformer_blocks.0.attn.to_q)",
        ));
    }
    Ok(out)
}

/// The inverse of [`to_bfl_lora`]: per-module adapters of BFL's layout (keyed
/// `double_blocks.0.img_attn.qkv`, as a kohya file holds them, alpha resolved) split into
/// adapters on diffusers' module paths, exactly: each member module of a fused BFL module gets
/// the rows of `up` that are its own (reassembled in its row order, for
/// `final_layer.adaLN_modulation.1`) and, of the `r_total` rank columns, those where those rows
/// are not all zero, with the matching rows of `down`; its alpha is `r_i · alpha / r_total`, so
/// `scaling · B_i·A_i` equals the member's rows of the fused product. A fused module whose `up`
/// is dense (sd-scripts' `split_qkv = false` layout: one shared `down`) gives every member the
/// whole `down`. Members whose rows are all zero get no adapter. Plain scaling (`use_rslora`
/// false) is assumed, as kohya files have it; metadata is kept.
///
/// # Errors
/// [`Error::Unsupported`] for modules that are not linears of BFL's layout at `config`'s shape
/// (listed), and DoRA modules; [`Error::Shape`] when `up` does not have the module's rows;
/// [`Error::Torch`].
pub fn from_bfl_lora(bfl: &AdapterWeights, config: &FluxConfig) -> Result<AdapterWeights> {
    let mut out = AdapterWeights {
        metadata: bfl.metadata.clone(),
        ..AdapterWeights::default()
    };
    let mut used = BTreeSet::new();
    for m in linear_modules(config) {
        let Some(l) = bfl.modules.get(&m.bfl) else {
            continue;
        };
        used.insert(m.bfl.clone());
        if l.magnitude.is_some() {
            return Err(unsupported(
                &m.bfl,
                "DoRA modules are not split; load it as a BFL-layout checkpoint",
            ));
        }
        if l.lora_b.size()[0] != m.rows() {
            return Err(Error::Shape {
                name: format!("{}.lora_up", m.bfl),
                expected: vec![m.rows(), l.rank()],
                found: l.lora_b.size(),
            });
        }
        let s = scaling(l.alpha, l.rank(), bfl.use_rslora);
        for name in members(&m) {
            // this member's rows of `up`, in the member's own row order
            let mut mine: Vec<(i64, Tensor)> = Vec::new();
            let mut offset = 0;
            for p in &m.parts {
                if p.module == name {
                    mine.push((p.start, l.lora_b.f_narrow(0, offset, p.rows)?));
                }
                offset += p.rows;
            }
            mine.sort_by_key(|(start, _)| *start);
            let rows: Vec<Tensor> = mine.into_iter().map(|(_, t)| t).collect();
            let b = Tensor::f_cat(&rows, 0)?;
            let used_cols = b
                .f_abs()?
                .f_sum_dim_intlist(Some(&[0i64][..]), false, Kind::Float)?
                .f_gt(0.0)?
                .f_nonzero()?
                .f_reshape([-1])?;
            let r = used_cols.size()[0];
            if r == 0 {
                continue;
            }
            out.modules.insert(
                name.to_string(),
                ModuleLora {
                    kind: SiteKind::Linear,
                    lora_a: l.lora_a.f_index_select(0, &used_cols)?,
                    lora_b: b.f_index_select(1, &used_cols)?,
                    alpha: s * r as f64,
                    magnitude: None,
                },
            );
        }
    }
    let left: Vec<&str> = bfl
        .modules
        .keys()
        .filter(|k| !used.contains(k.as_str()))
        .map(String::as_str)
        .collect();
    if !left.is_empty() {
        return Err(unsupported(
            &left.join(", "),
            "not a linear of BFL's FLUX layout at this model's shape (expected double_blocks.N.*, \
             single_blocks.N.*, final_layer.*, img_in, txt_in, time_in.*, vector_in.*, guidance_in.*)",
        ));
    }
    Ok(out)
}

/// Writes `w` (a FLUX transformer adapter on diffusers' module paths) as diffusers'
/// `pytorch_lora_weights.safetensors` at `path`: `transformer.<module>.lora_A.weight` /
/// `.lora_B.weight`, scaling folded into `lora_B` (see the module docs), `w`'s metadata in the
/// header. `FluxPipeline.load_lora_weights` reads it.
///
/// # Errors
/// lora-core's format and I/O errors with the path.
pub fn write_diffusers(w: &AdapterWeights, path: &Path) -> Result<()> {
    diffusers::write(path, &[(DIFFUSERS_COMPONENT, w)])?;
    Ok(())
}

/// Writes `w` (a FLUX transformer adapter on diffusers' module paths, of a model of `config`'s
/// shape) as a kohya / ComfyUI file at `path`: fused through [`to_bfl_lora`], modules named
/// `lora_unet_<BFL module with '.' → '_'>`, f32 0-d `.alpha`. Header: `w`'s metadata, with
/// `ss_network_module = networks.lora_flux` and `ss_base_model_version = flux1` set, and
/// `ss_network_dim` / `ss_network_alpha` (the most common per-module rank and alpha of `w`,
/// kohya's `network_dim` / `network_alpha`) unless already present.
///
/// # Errors
/// As [`to_bfl_lora`]; lora-core's format and I/O errors with the path.
pub fn write_kohya(w: &AdapterWeights, config: &FluxConfig, path: &Path) -> Result<()> {
    let mut bfl = to_bfl_lora(w, config)?;
    let (r, a) = w.dominant_rank_alpha();
    let a = if w.use_rslora {
        a * (r as f64).sqrt()
    } else {
        a
    };
    let meta = &mut bfl.metadata;
    meta.insert("ss_network_module".into(), KOHYA_FLUX_NETWORK_MODULE.into());
    meta.insert(
        "ss_base_model_version".into(),
        KOHYA_FLUX_BASE_MODEL_VERSION.into(),
    );
    meta.entry("ss_network_dim".into())
        .or_insert_with(|| r.to_string());
    meta.entry("ss_network_alpha".into())
        .or_insert_with(|| a.to_string());
    kohya::write(path, &[(KOHYA_FLUX_PREFIX, &bfl)])?;
    Ok(())
}

/// Reads a FLUX transformer LoRA file of either layout into adapters on diffusers' module paths
/// of a model of `config`'s shape, ready for [`AdapterWeights::load_into`]:
/// - kohya / ComfyUI (keys `lora_unet_…`): fused modules split by [`from_bfl_lora`];
/// - diffusers (`transformer.<module>.lora_A.weight`, …): as stored (alpha from `.alpha` keys
///   when present, else rank).
///
/// # Errors
/// [`lora_core::Error::Format`] (as [`Error::Core`]) naming the file for keys of other
/// components (text encoders) or of no module of the model; the readers' errors.
pub fn read_adapter(path: &Path, config: &FluxConfig) -> Result<AdapterWeights> {
    let header = lora_core::formats::read_header(path)?;
    let format_err = |reason: String| {
        Error::Core(lora_core::Error::Format {
            file: path.to_path_buf(),
            reason,
        })
    };
    let head = format!("{KOHYA_FLUX_PREFIX}_");
    if header.tensors.keys().any(|k| k.starts_with(&head)) {
        let mut file = kohya::read(path)?;
        let names: Vec<String> = linear_modules(config).into_iter().map(|m| m.bfl).collect();
        let bfl = file.take_prefix(KOHYA_FLUX_PREFIX, &names)?;
        if let Some(k) = file.modules.keys().next() {
            return Err(format_err(format!(
                "module {k:?} is not a FLUX transformer module (lora_unet_…); text-encoder \
                 adapters are not read here"
            )));
        }
        return from_bfl_lora(&bfl, config);
    }
    let mut parts = diffusers::read(path)?;
    let w = parts.remove(DIFFUSERS_COMPONENT).ok_or_else(|| {
        format_err(format!(
            "no {DIFFUSERS_COMPONENT}.… or {KOHYA_FLUX_PREFIX}_… keys: not a FLUX transformer LoRA"
        ))
    })?;
    if let Some(k) = parts.keys().next() {
        return Err(format_err(format!(
            "component {k:?}: only the FLUX `{DIFFUSERS_COMPONENT}` is read here"
        )));
    }
    let names: BTreeSet<String> = linear_modules(config)
        .iter()
        .flat_map(|m| members(m).into_iter().map(String::from).collect::<Vec<_>>())
        .collect();
    if let Some(k) = w.modules.keys().find(|k| !names.contains(k.as_str())) {
        return Err(format_err(format!(
            "module {DIFFUSERS_COMPONENT}.{k} is not a linear of this FLUX transformer"
        )));
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn tiny() -> FluxConfig {
        FluxConfig {
            in_channels: 4,
            num_layers: 1,
            num_single_layers: 1,
            attention_head_dim: 4,
            num_attention_heads: 2,
            joint_attention_dim: 6,
            pooled_projection_dim: 5,
            guidance_embeds: true,
            axes_dims_rope: vec![2, 2],
            ..FluxConfig::default()
        }
    }

    fn module(r: i64, out: i64, inp: i64, alpha: f64) -> ModuleLora {
        let f = (Kind::Double, Device::Cpu);
        ModuleLora {
            kind: SiteKind::Linear,
            lora_a: Tensor::randn([r, inp], f),
            lora_b: Tensor::randn([out, r], f),
            alpha,
            magnitude: None,
        }
    }

    /// `scaling · B·A`
    fn delta(w: &AdapterWeights, name: &str) -> Tensor {
        let m = &w.modules[name];
        m.lora_b.matmul(&m.lora_a) * w.scaling(name).unwrap()
    }

    fn close(a: &Tensor, b: &Tensor) -> bool {
        a.size() == b.size() && f64::try_from((a - b).abs().max()).unwrap() < 1e-12
    }

    #[test]
    fn fused_modules_hold_each_members_product_and_split_back() {
        let cfg = tiny();
        let (d, m) = (cfg.inner_dim(), cfg.mlp_hidden_dim());
        let mut w = AdapterWeights::default();
        // img qkv: ranks 2 / 3, scalings 2 and 1 (folded); v left out
        w.modules.insert(
            "transformer_blocks.0.attn.to_q".into(),
            module(2, d, d, 4.0),
        );
        w.modules.insert(
            "transformer_blocks.0.attn.to_k".into(),
            module(3, d, d, 3.0),
        );
        // linear1: only the MLP member (scaling 1)
        w.modules.insert(
            "single_transformer_blocks.0.proj_mlp".into(),
            module(2, m, d, 2.0),
        );
        w.modules
            .insert("norm_out.linear".into(), module(2, 2 * d, d, 4.0));
        w.modules
            .insert("transformer_blocks.0.ff.net.2".into(), module(2, d, m, 6.0));
        let bfl = to_bfl_lora(&w, &cfg).unwrap();
        let names: Vec<&str> = bfl.modules.keys().map(String::as_str).collect();
        assert_eq!(
            names,
            [
                "double_blocks.0.img_attn.qkv",
                "double_blocks.0.img_mlp.2",
                "final_layer.adaLN_modulation.1",
                "single_blocks.0.linear1",
            ]
        );
        let qkv = &bfl.modules["double_blocks.0.img_attn.qkv"];
        assert_eq!(qkv.lora_a.size(), [5, d]);
        assert_eq!(qkv.lora_b.size(), [3 * d, 5]);
        assert_eq!(qkv.alpha, 5.0);
        let fused = delta(&bfl, "double_blocks.0.img_attn.qkv");
        assert!(close(
            &fused.narrow(0, 0, d),
            &delta(&w, "transformer_blocks.0.attn.to_q")
        ));
        assert!(close(
            &fused.narrow(0, d, d),
            &delta(&w, "transformer_blocks.0.attn.to_k")
        ));
        assert_eq!(
            f64::try_from(fused.narrow(0, 2 * d, d).abs().max()).unwrap(),
            0.0
        );
        // uniform scaling kept as alpha: 1.0 · 2
        let l1 = &bfl.modules["single_blocks.0.linear1"];
        assert_eq!((l1.alpha, l1.lora_b.size()), (2.0, vec![3 * d + m, 2]));
        assert!(
            l1.lora_b
                .narrow(0, 3 * d, m)
                .equal(&w.modules["single_transformer_blocks.0.proj_mlp"].lora_b)
        );
        // a rename keeps its alpha; the final layer's is folded
        assert_eq!(bfl.modules["double_blocks.0.img_mlp.2"].alpha, 6.0);
        assert_eq!(bfl.modules["final_layer.adaLN_modulation.1"].alpha, 2.0);
        let fl = delta(&bfl, "final_layer.adaLN_modulation.1");
        let no = delta(&w, "norm_out.linear");
        assert!(close(&fl.narrow(0, 0, d), &no.narrow(0, d, d)));
        assert!(close(&fl.narrow(0, d, d), &no.narrow(0, 0, d)));

        let back = from_bfl_lora(&bfl, &cfg).unwrap();
        assert_eq!(
            back.modules.keys().collect::<Vec<_>>(),
            w.modules.keys().collect::<Vec<_>>()
        );
        for (name, m) in &w.modules {
            assert_eq!(back.modules[name].rank(), m.rank(), "{name}");
            assert!(close(&delta(&back, name), &delta(&w, name)), "{name}");
        }
    }

    #[test]
    fn a_shared_down_is_given_to_every_member() {
        // sd-scripts' split_qkv = false: one down for q, k and v, a dense up
        let cfg = tiny();
        let d = cfg.inner_dim();
        let mut bfl = AdapterWeights::default();
        bfl.modules.insert(
            "double_blocks.0.txt_attn.qkv".into(),
            module(4, 3 * d, d, 2.0),
        );
        let fused = delta(&bfl, "double_blocks.0.txt_attn.qkv");
        let w = from_bfl_lora(&bfl, &cfg).unwrap();
        for (i, p) in ["add_q_proj", "add_k_proj", "add_v_proj"]
            .iter()
            .enumerate()
        {
            let name = format!("transformer_blocks.0.attn.{p}");
            assert_eq!(w.modules[&name].rank(), 4);
            assert!(close(&delta(&w, &name), &fused.narrow(0, i as i64 * d, d)));
        }
    }

    #[test]
    fn what_kohya_cannot_hold_is_refused_by_name() {
        let cfg = tiny();
        let d = cfg.inner_dim();
        let mut w = AdapterWeights::default();
        let mut dora = module(2, d, d, 2.0);
        dora.magnitude = Some(Tensor::ones([d], (Kind::Double, Device::Cpu)));
        w.modules
            .insert("transformer_blocks.0.attn.to_v".into(), dora);
        let e = to_bfl_lora(&w, &cfg).unwrap_err().to_string();
        assert!(
            e.contains("transformer_blocks.0.attn.to_v") && e.contains("DoRA"),
            "{e}"
        );
        let mut bfl = AdapterWeights::default();
        bfl.modules.insert(
            "double_blocks.7.img_attn.qkv".into(),
            module(2, 3 * d, d, 2.0),
        );
        let e = from_bfl_lora(&bfl, &cfg).unwrap_err().to_string();
        assert!(e.contains("double_blocks.7.img_attn.qkv"), "{e}");
        let mut bfl = AdapterWeights::default();
        bfl.modules
            .insert("double_blocks.0.img_attn.qkv".into(), module(2, d, d, 2.0));
        let e = from_bfl_lora(&bfl, &cfg).unwrap_err().to_string();
        assert!(e.contains("double_blocks.0.img_attn.qkv.lora_up"), "{e}");
    }
}
