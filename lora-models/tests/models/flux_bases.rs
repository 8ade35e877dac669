//! Compact FLUX bases against diffusers on `tests/interop/flux_bases.py`'s tiny model of
//! FLUX.1's head width: a city96-style GGUF file kept quantized (fused BFL rows cut as blocks),
//! kohya's `fp8_base` from a dense and from an fp8 file, NF4 at load; and block swapping on the
//! tiny model of `flux_transformer.py` grown to 4 + 6 blocks.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

use lora_core::base::BaseWeight;
use lora_core::config::{LoraConfig, TargetModules};
use lora_core::inject::{Adaptable, SiteMut};
use lora_core::layer::LoraLayer;
use lora_core::quant::{QuantKind, QuantWeight};
use lora_models::flux::{FluxBaseFormat, FluxConfig, FluxInputs, FluxTransformer2DModel};
use lora_models::sd::LoadOptions;
use lora_models::weights::{TensorMap, WeightMode};
use tch::{Device, Kind, Tensor};

use crate::common::diff;
use crate::rng_lock;

fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("flux_bases.py"))
        .path()
}

fn r(name: &str) -> Tensor {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes = R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap());
    crate::common::st_tensor(bytes, name)
}

/// The model's output on the fixture's inputs, as f32.
fn run(m: &FluxTransformer2DModel) -> Tensor {
    let (hs, ehs, pooled, t, img_ids, txt_ids, g) = (
        r("hs"),
        r("ehs"),
        r("pooled"),
        r("t"),
        r("img_ids"),
        r("txt_ids"),
        r("guidance"),
    );
    let _ng = tch::no_grad_guard();
    m.forward(&FluxInputs {
        hidden_states: &hs,
        encoder_hidden_states: &ehs,
        pooled_projections: &pooled,
        timestep: &t,
        img_ids: &img_ids,
        txt_ids: &txt_ids,
        guidance: Some(&g),
    })
    .unwrap()
    .to_kind(Kind::Float)
}

/// The base of the linear site `path`.
fn with_base<R>(m: &mut FluxTransformer2DModel, path: &str, f: impl FnOnce(&BaseWeight) -> R) -> R {
    let mut f = Some(f);
    let mut out = None;
    m.visit_sites(&mut |p, s| {
        if p == path
            && let SiteMut::Linear(l) = s
            && let Some(f) = f.take()
        {
            out = Some(f(l.base()));
        }
        Ok(())
    })
    .unwrap();
    out.unwrap_or_else(|| panic!("no linear site {path}"))
}

fn quant_kind(b: &BaseWeight) -> Option<QuantKind> {
    match b {
        BaseWeight::Quant(q) => Some(q.kind()),
        _ => None,
    }
}

#[test]
fn gguf_file_keeps_its_blocks_and_matches_diffusers_on_the_dequantized_weights() {
    let path = fixtures().join("flux.gguf");
    let opts = LoadOptions::default();
    let mut m =
        FluxTransformer2DModel::from_gguf(&path, WeightMode::KeepQuantized, &opts, None).unwrap();
    assert_eq!(m.config().inner_dim(), 256);
    // fused rows are cut as blocks: q/k/v of `img_attn.qkv` (Q4_K), the four parts of
    // `linear1` (Q5_K), and the reordered halves of the final modulation (Q8_0)
    for (site, kind, shape) in [
        (
            "transformer_blocks.0.attn.to_q",
            Some(QuantKind::Q4_K),
            [256, 256],
        ),
        (
            "transformer_blocks.0.attn.to_v",
            Some(QuantKind::Q4_K),
            [256, 256],
        ),
        (
            "transformer_blocks.0.attn.add_k_proj",
            Some(QuantKind::Q8_0),
            [256, 256],
        ),
        (
            "transformer_blocks.0.ff.net.2",
            Some(QuantKind::Q8_0),
            [256, 1024],
        ),
        (
            "transformer_blocks.0.ff_context.net.2",
            Some(QuantKind::Q5_K),
            [256, 1024],
        ),
        (
            "transformer_blocks.0.ff.net.0.proj",
            Some(QuantKind::Q6_K),
            [1024, 256],
        ),
        (
            "single_transformer_blocks.0.attn.to_k",
            Some(QuantKind::Q5_K),
            [256, 256],
        ),
        (
            "single_transformer_blocks.0.proj_mlp",
            Some(QuantKind::Q5_K),
            [1024, 256],
        ),
        (
            "single_transformer_blocks.0.proj_out",
            Some(QuantKind::Q6_K),
            [256, 1280],
        ),
        ("norm_out.linear", Some(QuantKind::Q8_0), [512, 256]),
        ("context_embedder", Some(QuantKind::Q8_0), [256, 32]),
        (
            "time_text_embed.timestep_embedder.linear_2",
            Some(QuantKind::Q8_0),
            [256, 256],
        ),
        ("x_embedder", None, [256, 16]),
        (
            "time_text_embed.timestep_embedder.linear_1",
            None,
            [256, 256],
        ),
        ("proj_out", None, [16, 256]),
    ] {
        with_base(&mut m, site, |b| {
            assert_eq!(quant_kind(b), kind, "{site}");
            assert_eq!(b.shape(), shape, "{site}");
        });
    }
    let out = run(&m);
    let (abs, rel) = diff(&out, &r("gguf.out"));
    println!(
        "GGUF kept quantized (f32 compute) vs diffusers on dequantized weights: abs {abs:.3e}, rel {rel:.3e}"
    );
    assert!(rel < 1e-5, "relative error {rel:.3e}");
    // the same file through from_single_file (recognised by its magic) gives the same model
    let m2 = FluxTransformer2DModel::from_single_file(&path, &opts, None).unwrap();
    assert!(run(&m2).equal(&out));
    let e =
        FluxTransformer2DModel::from_single_file_with_base(&path, &opts, None, FluxBaseFormat::Fp8)
            .unwrap_err()
            .to_string();
    assert!(e.contains("GGUF"), "{e}");
    // dequantized at load: same function, four bytes per weight
    let dense =
        FluxTransformer2DModel::from_gguf(&path, WeightMode::Dense(Kind::Float), &opts, None)
            .unwrap();
    let (_, rel_dense) = diff(&run(&dense), &r("gguf.out"));
    assert!(rel_dense < 1e-5, "{rel_dense:.3e}");
    let (q, d) = (m.weight_bytes(), dense.weight_bytes());
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("bytes.json")).unwrap()).unwrap();
    println!(
        "GGUF resident weight bytes {} (file tensor data {}), dense f32 {}",
        q.total(),
        file["gguf_data"],
        d.total()
    );
    assert_eq!(d.total(), file["dense_f32"].as_u64().unwrap());
    assert!(q.total() * 4 < d.total(), "{q:?} vs {d:?}");
    assert_eq!(q.host, 0);
    // bf16 compute on the kept blocks
    let bf16 = LoadOptions {
        kind: Kind::BFloat16,
        ..LoadOptions::default()
    };
    let mb =
        FluxTransformer2DModel::from_gguf(&path, WeightMode::KeepQuantized, &bf16, None).unwrap();
    let (_, rel_bf16) = diff(&run(&mb), &r("gguf.out"));
    println!("GGUF kept quantized, bf16 compute (vs the f32 reference): rel {rel_bf16:.3e}");
    assert!(rel_bf16 < 6e-2, "{rel_bf16:.3e}");
}

#[test]
fn fp8_base_matches_diffusers_on_fp8_rounded_weights_from_dense_and_fp8_files() {
    let opts = LoadOptions::default();
    let mut from_dense = FluxTransformer2DModel::from_single_file_with_base(
        &fixtures().join("dense_bfl.safetensors"),
        &opts,
        None,
        FluxBaseFormat::Fp8,
    )
    .unwrap();
    let out = run(&from_dense);
    let (abs, rel) = diff(&out, &r("fp8.out"));
    let (_, rel_vs_dense) = diff(&out, &r("dense.out"));
    println!(
        "fp8 base (f32 compute) vs diffusers on fp8-rounded weights: abs {abs:.3e}, rel {rel:.3e}; \
         vs the unrounded model: rel {rel_vs_dense:.3e}"
    );
    assert!(rel < 1e-5, "relative error {rel:.3e}");
    assert!(
        rel_vs_dense > 1e-3,
        "fp8 rounding left no trace: {rel_vs_dense:.3e}"
    );
    // the fp8 file (F8_E4M3 weights) keeps its bits: the same model exactly
    let from_fp8 = FluxTransformer2DModel::from_single_file_with_base(
        &fixtures().join("fp8_bfl.safetensors"),
        &opts,
        None,
        FluxBaseFormat::Fp8,
    )
    .unwrap();
    assert!(run(&from_fp8).equal(&out));
    // every linear weight is fp8, including the embedders and the head (kohya casts all)
    let mut n = 0;
    from_dense
        .visit_sites(&mut |p, s| {
            if let SiteMut::Linear(l) = s {
                assert_eq!(quant_kind(l.base()), Some(QuantKind::Fp8E4m3), "{p}");
                // biases hold fp8 values
                let b = l.bias().unwrap();
                let rounded = b.to_kind(Kind::Float8e4m3fn).to_kind(Kind::Float);
                assert!(b.equal(&rounded), "{p} bias");
                n += 1;
            }
            Ok(())
        })
        .unwrap();
    assert!(n > 20);
    let dense = FluxTransformer2DModel::from_single_file(
        &fixtures().join("dense_bfl.safetensors"),
        &opts,
        None,
    )
    .unwrap();
    let (f, d) = (from_dense.weight_bytes(), dense.weight_bytes());
    println!("fp8 weight bytes {}, dense f32 {}", f.total(), d.total());
    assert!(f.total() * 3 < d.total());
    // bf16 compute, as kohya trains
    let bf16 = LoadOptions {
        kind: Kind::BFloat16,
        ..LoadOptions::default()
    };
    let mb = FluxTransformer2DModel::from_single_file_with_base(
        &fixtures().join("fp8_bfl.safetensors"),
        &bf16,
        None,
        FluxBaseFormat::Fp8,
    )
    .unwrap();
    let (_, rel_bf16) = diff(&run(&mb), &r("fp8.out"));
    println!("fp8 base, bf16 compute (vs the f32 reference): rel {rel_bf16:.3e}");
    assert!(rel_bf16 < 6e-2, "{rel_bf16:.3e}");
}

#[test]
fn nf4_base_equals_the_dense_model_on_nf4_rounded_weights() {
    let path = fixtures().join("dense_bfl.safetensors");
    let opts = LoadOptions::default();
    for double_quant in [false, true] {
        let kind = QuantKind::Nf4 { double_quant };
        let nf4 = FluxTransformer2DModel::from_single_file_with_base(
            &path,
            &opts,
            None,
            FluxBaseFormat::Nf4 { double_quant },
        )
        .unwrap();
        // the reference: the dense model with each linear weight replaced by its NF4 rounding
        let mut reference = FluxTransformer2DModel::from_single_file(&path, &opts, None).unwrap();
        reference
            .visit_sites(&mut |_, s| {
                if let SiteMut::Linear(l) = s {
                    let w = l.base().weight(Kind::Float)?;
                    let q = QuantWeight::quantize(&w, kind)?.dequantize(Kind::Float)?;
                    l.replace_base(BaseWeight::Dense(q))?;
                }
                Ok(())
            })
            .unwrap();
        let (out, want) = (run(&nf4), run(&reference));
        let (abs, rel) = diff(&out, &want);
        let (_, rel_vs_dense) = diff(&out, &r("dense.out"));
        println!(
            "NF4 (double_quant {double_quant}) vs dense on NF4-rounded weights: abs {abs:.3e}, \
             rel {rel:.3e}; vs the unrounded model (diffusers): rel {rel_vs_dense:.3e}"
        );
        assert!(rel < 1e-5, "relative error {rel:.3e}");
        let (b, d) = (nf4.weight_bytes(), reference.weight_bytes());
        println!("NF4 weight bytes {}, dense f32 {}", b.total(), d.total());
        assert!(b.total() * 6 < d.total());
    }
}

/// The tiny dev model of `flux_transformer.py` (2 + 2 blocks) grown to 4 double and 6 single
/// blocks (block `i` a copy of block `i % 2`), so that kohya's swap counts have room.
fn grown_model(base: FluxBaseFormat) -> FluxTransformer2DModel {
    let dir = crate::flux::fixtures().join("dev/transformer");
    let file = lora_core::safetensors::SafetensorsFile::open(
        &dir.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let mut map = HashMap::new();
    for name in file.names() {
        let t = file.tensor(name).unwrap().unwrap();
        let mut put = |prefix: &str, blocks: i64| {
            if let Some(rest) = name.strip_prefix(prefix) {
                let (i, leaf) = rest.split_once('.').unwrap();
                let i: i64 = i.parse().unwrap();
                for j in (i..blocks).step_by(2) {
                    map.insert(format!("{prefix}{j}.{leaf}"), t.copy());
                }
                true
            } else {
                false
            }
        };
        if !put("single_transformer_blocks.", 6) && !put("transformer_blocks.", 4) {
            map.insert(name.to_string(), t);
        }
    }
    let config = FluxConfig {
        num_layers: 4,
        num_single_layers: 6,
        ..FluxConfig::from_file(&dir.join("config.json")).unwrap()
    };
    let src = TensorMap::new(&map, Device::Cpu);
    FluxTransformer2DModel::new_with_base(config, &src, &LoadOptions::default(), base).unwrap()
}

#[test]
fn swapped_blocks_give_the_same_outputs_and_lora_gradients() {
    let _rng = rng_lock();
    for base in [FluxBaseFormat::Dense, FluxBaseFormat::Fp8] {
        let mut m = grown_model(base);
        let vs = tch::nn::VarStore::new(Device::Cpu);
        let cfg = LoraConfig {
            r: 2,
            lora_alpha: 4.0,
            lora_dropout: 0.1,
            target_modules: Some(TargetModules::List(vec![
                "to_q".into(),
                "to_v".into(),
                "proj_mlp".into(),
                "ff.net.2".into(),
                "norm1.linear".into(),
            ])),
            ..LoraConfig::default()
        };
        tch::manual_seed(5);
        lora_core::inject::inject(&mut m, &cfg, "default", &vs.root()).unwrap();
        tch::no_grad(|| {
            for (n, mut v) in vs.variables() {
                if n.contains("lora_B") {
                    v.copy_(&(v.randn_like() * 0.1));
                }
            }
        });
        let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        named.sort_by(|a, b| a.0.cmp(&b.0));
        let (hs, ehs, pooled, t, img_ids, txt_ids, g) = (
            crate::flux::r("dev.hs"),
            crate::flux::r("dev.ehs"),
            crate::flux::r("dev.pooled"),
            crate::flux::r("dev.t"),
            crate::flux::r("dev.img_ids"),
            crate::flux::r("dev.txt_ids"),
            crate::flux::r("dev.guidance"),
        );
        let inputs = FluxInputs {
            hidden_states: &hs,
            encoder_hidden_states: &ehs,
            pooled_projections: &pooled,
            timestep: &t,
            img_ids: &img_ids,
            txt_ids: &txt_ids,
            guidance: Some(&g),
        };
        let target = tch::no_grad(|| m.forward(&inputs).unwrap().randn_like());
        let step = |m: &FluxTransformer2DModel| -> (Tensor, Tensor, Vec<Tensor>) {
            for (_, v) in &named {
                let mut g = v.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
            let out = tch::no_grad(|| m.forward(&inputs).unwrap());
            tch::manual_seed(11);
            let loss = m
                .loss_backward(&inputs, true, 1.0, |pred| {
                    Ok(pred.f_sub(&target)?.f_square()?.f_mean(Kind::Float)?)
                })
                .unwrap();
            (
                out,
                loss,
                named.iter().map(|(_, v)| v.grad().copy()).collect(),
            )
        };
        m.set_gradient_checkpointing(true);
        let unswapped = m.weight_bytes();
        let (out0, loss0, grads0) = step(&m);
        // kohya's count: 4 → 2 double and 4 single blocks, the last of each kind
        m.set_blocks_to_swap(4, Device::Cpu).unwrap();
        assert_eq!(m.blocks_to_swap(), 4);
        let swapped: Vec<bool> = m.blocks().iter().map(|b| b.is_swapped()).collect();
        assert_eq!(
            swapped,
            [
                false, false, true, true, false, false, true, true, true, true
            ],
            "{base:?}"
        );
        let host: u64 = m
            .blocks()
            .iter()
            .filter(|b| b.is_swapped())
            .flat_map(|b| b.linears())
            .map(|l| l.base().storage_bytes())
            .sum();
        let wb = m.weight_bytes();
        println!(
            "{base:?}: blocks_to_swap 4 keeps {} of {} weight bytes on the host",
            wb.host,
            wb.total()
        );
        assert_eq!(wb.host, host);
        assert_eq!(wb.total(), unswapped.total());
        for b in m.blocks().iter().filter(|b| b.is_swapped()) {
            for l in b.linears() {
                assert!(l.base().is_offloaded());
                assert_eq!(l.base().storage_device(), Device::Cpu);
                assert_eq!(l.base().device(), m.device());
                assert_eq!(l.base().is_quantized(), base == FluxBaseFormat::Fp8);
            }
        }
        let (out1, loss1, grads1) = step(&m);
        assert!(out1.equal(&out0), "{base:?}: outputs differ");
        assert!(loss1.equal(&loss0));
        for ((n, _), (a, b)) in named.iter().zip(grads0.iter().zip(&grads1)) {
            assert!(a.equal(b), "{base:?}: gradient of {n} differs");
        }
        assert!(f64::try_from(grads1[0].abs().sum(Kind::Float)).unwrap() > 0.0);
        // moving the model keeps the swapped blocks swapped
        m.to_device(Device::Cpu).unwrap();
        assert_eq!(m.weight_bytes(), wb);
        // swapping needs checkpointing
        m.set_gradient_checkpointing(false);
        let e = m
            .loss_backward(&inputs, true, 1.0, |p| Ok(p.f_mean(Kind::Float)?))
            .unwrap_err()
            .to_string();
        assert!(e.contains("gradient checkpointing"), "{e}");
        // kohya's limit: two blocks of each kind stay
        let e = m
            .set_blocks_to_swap(5, Device::Cpu)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blocks_to_swap"), "{e}");
        m.set_blocks_to_swap(0, Device::Cpu).unwrap();
        assert!(m.blocks().iter().all(|b| !b.is_swapped()));
        assert_eq!(m.weight_bytes(), unswapped);
        assert!(tch::no_grad(|| m.forward(&inputs).unwrap()).equal(&out0));
    }
}
