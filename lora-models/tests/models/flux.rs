//! FluxTransformer2DModel against diffusers 0.42.1 on tiny random-weight models that
//! `tests/interop/flux_transformer.py` builds and writes (dev-like with guidance embedding,
//! schnell-like without), loaded from the diffusers folders and from BFL-layout single files;
//! the BFL ↔ diffusers key mapping against diffusers' own converter; latent packing against
//! `FluxPipeline`'s static methods; checkpointed gradients against plain ones.

use std::collections::HashMap;
use std::path::Path;
use std::sync::OnceLock;

pub(super) use crate::common::{diff, python};
use crate::rng_lock;
use lora_core::inject::{Adaptable, site_names};
use lora_core::layer::SiteKind;
use lora_models::flux::{
    BflKeyMap, FluxCheckpointInfo, FluxConfig, FluxInputs, FluxLayout, FluxTransformer2DModel,
    latent_image_ids, pack_latents, unpack_latents,
};
use lora_models::sd::{AttentionBackend, LoadOptions};
use tch::{Kind, Tensor};

/// Runs the script once per test binary; returns its output folder.
pub(super) fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("flux_transformer.py"))
        .path()
}

fn reference() -> &'static [u8] {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap())
}

pub(super) fn r(name: &str) -> Tensor {
    crate::common::st_tensor(reference(), name)
}

fn json(name: &str) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(fixtures().join(name)).unwrap()).unwrap()
}

fn opts(attention: AttentionBackend) -> LoadOptions {
    LoadOptions {
        attention,
        ..LoadOptions::default()
    }
}

/// Runs `m` on the reference inputs of `prefix` and returns (output, reference output).
pub(super) fn run(m: &FluxTransformer2DModel, prefix: &str) -> (Tensor, Tensor) {
    let g = m
        .config()
        .guidance_embeds
        .then(|| r(&format!("{prefix}.guidance")));
    let (hs, ehs, pooled, t, img_ids, txt_ids) = (
        r(&format!("{prefix}.hs")),
        r(&format!("{prefix}.ehs")),
        r(&format!("{prefix}.pooled")),
        r(&format!("{prefix}.t")),
        r(&format!("{prefix}.img_ids")),
        r(&format!("{prefix}.txt_ids")),
    );
    let out = m
        .forward(&FluxInputs {
            hidden_states: &hs,
            encoder_hidden_states: &ehs,
            pooled_projections: &pooled,
            timestep: &t,
            img_ids: &img_ids,
            txt_ids: &txt_ids,
            guidance: g.as_ref(),
        })
        .unwrap();
    (out, r(&format!("{prefix}.out")))
}

#[test]
fn dev_and_schnell_match_diffusers_from_the_diffusers_folder() {
    for (name, guidance) in [("dev", true), ("schnell", false)] {
        for backend in [AttentionBackend::Sdpa, AttentionBackend::Math] {
            let m = FluxTransformer2DModel::from_diffusers(&fixtures().join(name), &opts(backend))
                .unwrap();
            assert_eq!(m.config().guidance_embeds, guidance);
            assert_eq!(m.blocks().len(), 4);
            let (out, want) = run(&m, name);
            let (abs, rel) = diff(&out, &want);
            println!("{name} {backend:?}: max abs err {abs:.3e}, max rel err {rel:.3e}");
            assert!(rel < 1e-5, "{name} {backend:?}: relative error {rel:.3e}");
        }
        // bf16 weights and activations: the same function within bf16's precision
        let bf16 = LoadOptions {
            kind: Kind::BFloat16,
            ..LoadOptions::default()
        };
        let m = FluxTransformer2DModel::from_diffusers(&fixtures().join(name), &bf16).unwrap();
        let (out, want) = run(&m, name);
        assert_eq!(out.kind(), Kind::BFloat16);
        let (_, rel32) = diff(&out, &want);
        let (abs, rel) = diff(&out, &r(&format!("{name}.out_bf16")));
        println!(
            "{name} bf16: vs diffusers in bf16 max abs err {abs:.3e}, max rel err {rel:.3e} \
             (vs the fp32 reference {rel32:.3e})"
        );
        assert!(rel < 2e-2, "{name} bf16: relative error {rel:.3e}");
    }
    // the schnell folder is sharded: its index was followed
    assert!(
        fixtures()
            .join("schnell/transformer/diffusion_pytorch_model.safetensors.index.json")
            .exists()
    );
}

#[test]
fn bfl_single_files_load_detected_and_match_diffusers() {
    for (name, guidance, prefix) in [
        ("dev", true, ""),
        ("schnell", false, "model.diffusion_model."),
    ] {
        let path = fixtures().join(format!("{name}_bfl.safetensors"));
        let m = FluxTransformer2DModel::from_single_file(
            &path,
            &opts(AttentionBackend::Sdpa),
            Some(vec![4, 6, 6]),
        )
        .unwrap();
        let folder =
            FluxConfig::from_file(&fixtures().join(name).join("transformer/config.json")).unwrap();
        assert_eq!(m.config(), &folder, "{name}: detected config");
        assert_eq!(m.config().guidance_embeds, guidance);
        let (out, want) = run(&m, name);
        let (abs, rel) = diff(&out, &want);
        println!(
            "{name} from BFL single file (prefix {prefix:?}): max abs err {abs:.3e}, rel {rel:.3e}"
        );
        assert!(rel < 1e-5, "{name}: relative error {rel:.3e}");
        // the layout and prefix were read off the keys
        let st = lora_models::weights::SafetensorsFiles::open(
            std::slice::from_ref(&path),
            &path,
            tch::Device::Cpu,
        )
        .unwrap();
        let info =
            FluxCheckpointInfo::detect(&path, st.names(), |n| st.shape(n), Some(vec![4, 6, 6]))
                .unwrap();
        assert_eq!(info.layout, FluxLayout::Bfl);
        assert_eq!(info.prefix, prefix);
    }
    // without axes the head width (16, not FLUX.1's 128) is refused with a hint
    let e = FluxTransformer2DModel::from_single_file(
        &fixtures().join("dev_bfl.safetensors"),
        &LoadOptions::default(),
        None,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("axes_dims_rope"), "{e}");
}

#[test]
fn diffusers_folder_config_and_param_count_match_diffusers() {
    let counts = json("params.json");
    let full = |k: &str| counts[k].as_i64().unwrap();
    assert_eq!(FluxConfig::dev().num_params(), full("dev"));
    assert_eq!(FluxConfig::schnell().num_params(), full("schnell"));
    for name in ["dev", "schnell"] {
        let m =
            FluxTransformer2DModel::from_diffusers(&fixtures().join(name), &LoadOptions::default())
                .unwrap();
        assert_eq!(m.num_params(), full(&format!("tiny_{name}")), "{name}");
        assert_eq!(m.config().num_params(), m.num_params(), "{name}");
    }
}

/// `(name, start, rows)` runs of a JSON provenance list.
fn runs(v: &serde_json::Value) -> Vec<(String, i64, i64)> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r[0].as_str().unwrap().to_string(),
                r[1].as_i64().unwrap(),
                r[2].as_i64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn key_mapping_matches_diffusers_converter_both_ways() {
    let km = json("keymap.json");
    let bfl = km["bfl"].as_object().unwrap();
    let conv = km["diffusers"].as_object().unwrap();
    // the converter ran on a full-shaped FLUX.1-dev checkpoint of one double and one single block
    let cfg = FluxConfig {
        num_layers: 1,
        num_single_layers: 1,
        ..FluxConfig::dev()
    };
    // the checkpoint's names and shapes say so
    let shapes: HashMap<String, Vec<i64>> = bfl
        .iter()
        .map(|(k, v)| {
            (
                k.clone(),
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_i64().unwrap())
                    .collect(),
            )
        })
        .collect();
    let info = FluxCheckpointInfo::detect(
        Path::new("keymap.json"),
        shapes.keys().map(String::as_str),
        |n| shapes.get(n).cloned(),
        None,
    )
    .unwrap();
    assert_eq!(info.layout, FluxLayout::Bfl);
    assert_eq!(info.config, cfg);

    let map = BflKeyMap::new(&cfg);
    // same name sets both ways
    let mut ours_d: Vec<&str> = map.diffusers_names().collect();
    let mut theirs_d: Vec<&str> = conv.keys().map(String::as_str).collect();
    ours_d.sort_unstable();
    theirs_d.sort_unstable();
    assert_eq!(ours_d, theirs_d);
    let mut ours_b: Vec<&str> = map.bfl_names().collect();
    let mut theirs_b: Vec<&str> = bfl.keys().map(String::as_str).collect();
    ours_b.sort_unstable();
    theirs_b.sort_unstable();
    assert_eq!(ours_b, theirs_b);

    // BFL → diffusers: our recipe cuts the same rows of the same BFL tensors, in order
    for (name, v) in conv {
        let want = runs(&v["runs"]);
        let ours: Vec<(String, i64, i64)> = map
            .diffusers_from_bfl(name)
            .unwrap()
            .iter()
            .map(|p| (p.name.clone(), p.start, p.rows))
            .collect();
        assert_eq!(ours, want, "{name}");
        // and the shape: rows from the pieces, columns of the source
        let shape: Vec<i64> = v["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_i64().unwrap())
            .collect();
        let rows: i64 = ours.iter().map(|p| p.2).sum();
        assert_eq!(shape[0], rows, "{name}");
        assert_eq!(shape[1..], shapes[&want[0].0][1..], "{name}");
    }

    // diffusers → BFL: assembling each BFL tensor from the converter's outputs with our
    // reverse recipe gives back rows 0..n of that BFL tensor, in order
    let provenance: HashMap<&str, Vec<(String, i64)>> = conv
        .iter()
        .map(|(k, v)| {
            let rows = runs(&v["runs"])
                .into_iter()
                .flat_map(|(n, s, len)| (s..s + len).map(move |r| (n.clone(), r)))
                .collect();
            (k.as_str(), rows)
        })
        .collect();
    for (name, shape) in &shapes {
        let pieces = map.bfl_from_diffusers(name).unwrap();
        let mut rows = Vec::new();
        for p in pieces {
            let src = &provenance[p.name.as_str()];
            rows.extend_from_slice(&src[p.start as usize..(p.start + p.rows) as usize]);
        }
        let want: Vec<(String, i64)> = (0..shape[0]).map(|r| (name.clone(), r)).collect();
        assert_eq!(rows, want, "{name}");
    }
}

#[test]
fn peft_lora_matches_diffusers() {
    let _lock = rng_lock();
    let mut m =
        FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
            .unwrap();
    let (base, _) = run(&m, "dev");
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let dir = fixtures().join("lora");
    let (cfg, report) =
        lora_core::formats::peft::load_adapter(&mut m, &dir, "default", &vs.root()).unwrap();
    assert_eq!((cfg.r, cfg.lora_alpha), (4, 8.0));
    let want: Vec<String> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("modules.json")).unwrap()).unwrap();
    let mut got = report.modules.clone();
    got.sort();
    assert_eq!(got, want, "the adapter landed on other modules than PEFT's");
    let (out, _) = run(&m, "dev");
    let want_out = r("lora.out");
    let (abs, rel) = diff(&out, &want_out);
    let (moved, _) = diff(&base, &want_out);
    println!(
        "FLUX lora: max abs diff {abs:.3e}, relative {rel:.3e}; the adapter moves the output by {moved:.3e}"
    );
    assert!(rel < 1e-5, "lora: relative diff {rel:.3e}");
    assert!(
        moved > 100.0 * abs,
        "the adapter barely changes the output: {moved:.3e}"
    );
}

#[test]
fn packing_matches_flux_pipeline() {
    let lat = r("pack.latents");
    let packed = pack_latents(&lat).unwrap();
    assert!(packed.equal(&r("pack.packed")));
    let unpacked = unpack_latents(&packed, 6, 10).unwrap();
    assert!(unpacked.equal(&r("pack.unpacked")));
    assert!(unpacked.equal(&lat));
    let ids = latent_image_ids(3, 5, tch::Device::Cpu).unwrap();
    assert!(ids.equal(&r("pack.ids")));
}

#[test]
fn sites_are_diffusers_linear_modules() {
    let counts = json("params.json");
    for name in ["dev", "schnell"] {
        let mut m =
            FluxTransformer2DModel::from_diffusers(&fixtures().join(name), &LoadOptions::default())
                .unwrap();
        let mut ours: Vec<String> = site_names(&mut m)
            .unwrap()
            .into_iter()
            .map(|(n, kind)| {
                assert_eq!(kind, SiteKind::Linear, "{n}");
                n
            })
            .collect();
        let mut theirs: Vec<String> = counts[format!("tiny_{name}_linears")]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        ours.sort_unstable();
        theirs.sort_unstable();
        assert_eq!(
            ours, theirs,
            "{name}: LoRA sites vs diffusers' nn.Linear modules"
        );
    }
    let mut m =
        FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
            .unwrap();
    // a block visits its own sites under their full paths
    let mut block_sites = Vec::new();
    m.blocks_mut()[2]
        .visit_sites(&mut |n, _| {
            block_sites.push(n.to_string());
            Ok(())
        })
        .unwrap();
    assert_eq!(block_sites[0], "single_transformer_blocks.0.norm.linear");
}

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    let _lock = rng_lock();
    use lora_core::config::{LoraConfig, TargetModules};
    let mut m =
        FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
            .unwrap();
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    // LoRA with dropout on the time embedder, attention, modulation and MLP: gradients must reach
    // the time embedder through every block, and recomputation must redraw the same masks
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.2,
        target_modules: Some(TargetModules::List(vec![
            "timestep_embedder.linear_1".into(),
            "to_q".into(),
            "add_v_proj".into(),
            "norm1.linear".into(),
            "proj_mlp".into(),
            "proj_out".into(),
        ])),
        ..LoraConfig::default()
    };
    lora_core::inject::inject(&mut m, &cfg, "default", &vs.root()).unwrap();
    // B starts at zero: give it values so that A's gradients are not zero
    tch::no_grad(|| {
        for (n, mut v) in vs.variables() {
            if n.contains("lora_B") {
                v.copy_(&(v.randn_like() * 0.1));
            }
        }
    });
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    let vars: Vec<Tensor> = named.iter().map(|(_, t)| t.shallow_clone()).collect();
    let (hs, ehs, pooled, t, img_ids, txt_ids, g) = (
        r("dev.hs"),
        r("dev.ehs").set_requires_grad(true),
        r("dev.pooled"),
        r("dev.t"),
        r("dev.img_ids"),
        r("dev.txt_ids"),
        r("dev.guidance"),
    );
    let target = r("dev.out").randn_like();
    let mut run = |ck: bool| -> (f64, Vec<Tensor>, Tensor) {
        m.set_gradient_checkpointing(ck);
        for v in vars.iter().chain([&ehs]) {
            let mut g = v.grad();
            if g.defined() {
                let _ = g.zero_();
            }
        }
        tch::manual_seed(11);
        let inputs = FluxInputs {
            hidden_states: &hs,
            encoder_hidden_states: &ehs,
            pooled_projections: &pooled,
            timestep: &t,
            img_ids: &img_ids,
            txt_ids: &txt_ids,
            guidance: Some(&g),
        };
        let loss = m
            .loss_backward(&inputs, true, 0.5, |pred| {
                Ok(pred.f_sub(&target)?.f_square()?.f_mean(Kind::Float)?)
            })
            .unwrap();
        let after = Tensor::randn([4], (Kind::Float, tch::Device::Cpu));
        let grads = vars
            .iter()
            .map(|v| v.grad().copy())
            .chain([after])
            .collect();
        (loss.double_value(&[]), grads, ehs.grad().copy())
    };
    let (l_plain, g_plain, e_plain) = run(false);
    let (l_ck, g_ck, e_ck) = run(true);
    assert!((l_plain - l_ck).abs() < 1e-9, "{l_plain} vs {l_ck}");
    let mut worst = 0.0f64;
    for (a, b) in g_plain.iter().zip(&g_ck) {
        let scale = f64::try_from(a.abs().max()).unwrap().max(1e-12);
        worst = worst.max(f64::try_from((a - b).abs().max()).unwrap() / scale);
    }
    let (_, ctx_rel) = diff(&e_ck, &e_plain);
    println!(
        "FLUX checkpointing: loss {l_ck:.6}, worst relative gradient diff {worst:.3e}, \
         encoder_hidden_states grad {ctx_rel:.3e}"
    );
    assert!(worst < 1e-4, "gradients differ: {worst:.3e}");
    assert!(ctx_rel < 1e-4);
    assert!(f64::try_from(e_plain.abs().sum(Kind::Float)).unwrap() > 0.0);
    for needle in [
        "timestep_embedder.linear_1.lora_A",
        "transformer_blocks.0.attn.to_q.lora_A",
        "single_transformer_blocks.1.proj_mlp.lora_A",
    ] {
        let i = named
            .iter()
            .position(|(n, _)| n.contains(needle))
            .unwrap_or_else(|| panic!("{needle} not injected"));
        assert!(
            f64::try_from(g_ck[i].abs().sum(Kind::Float)).unwrap() > 0.0,
            "{needle}: zero gradient"
        );
    }
}

#[test]
fn blocks_run_one_by_one_equal_the_forward_pass() {
    let m =
        FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
            .unwrap();
    let (hs, ehs, pooled, t, img_ids, txt_ids, g) = (
        r("dev.hs"),
        r("dev.ehs"),
        r("dev.pooled"),
        r("dev.t"),
        r("dev.img_ids"),
        r("dev.txt_ids"),
        r("dev.guidance"),
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
    let whole = m.forward(&inputs).unwrap();
    let (mut x, ctx) = m.prepare(&inputs, false).unwrap();
    assert_eq!(x.size(), [2, 5 + 12, 32]);
    assert_eq!(ctx.txt_len, 5);
    for block in m.blocks() {
        // each block's inputs as a block-swapping caller would hand them over
        let moved = ctx.to_device(tch::Device::Cpu).unwrap();
        x = block.forward(&x, &moved, false).unwrap();
    }
    let out = m.head(&x, &ctx, false).unwrap();
    assert!(out.equal(&whole));
    assert!(diff(&out, &r("dev.out")).1 < 1e-5);
}

#[test]
fn inputs_are_checked() {
    let m =
        FluxTransformer2DModel::from_diffusers(&fixtures().join("dev"), &LoadOptions::default())
            .unwrap();
    let (hs, ehs, pooled, t, img_ids, txt_ids) = (
        r("dev.hs"),
        r("dev.ehs"),
        r("dev.pooled"),
        r("dev.t"),
        r("dev.img_ids"),
        r("dev.txt_ids"),
    );
    let base = FluxInputs {
        hidden_states: &hs,
        encoder_hidden_states: &ehs,
        pooled_projections: &pooled,
        timestep: &t,
        img_ids: &img_ids,
        txt_ids: &txt_ids,
        guidance: None,
    };
    let e = m.forward(&base).unwrap_err().to_string();
    assert!(e.contains("guidance"), "{e}");
    let short = img_ids.narrow(0, 0, 3);
    let e = m
        .forward(&FluxInputs {
            img_ids: &short,
            guidance: Some(&t),
            ..base
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("img_ids"), "{e}");
}
