//! AutoencoderKL against diffusers 0.42.1 on a tiny random-weight VAE that
//! `tests/interop/sd_vae.py` builds and writes: encode (mean, logvar, seeded sample), decode,
//! the original single-file layout, latent scaling, LoRA sites.

use std::path::Path;
use std::sync::OnceLock;

use crate::common::diff;
use lora_core::inject::{Adaptable, site_names};
use lora_core::layer::SiteKind;
use lora_models::sd::{AttentionBackend, AutoencoderKL, LoadOptions, VaeConfig};
use safetensors::SafeTensors;
use tch::{Kind, Tensor};

fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("sd_vae.py"))
        .path()
}

fn r(name: &str) -> Tensor {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes = R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap());
    crate::common::st_tensor(bytes, name)
}

const TOL_F32: f64 = 1e-4;

fn check(vae: &AutoencoderKL, label: &str) {
    let _lock = crate::rng_lock();
    let _g = tch::no_grad_guard();
    let dist = vae.encode(&r("image")).unwrap();
    for (name, ours) in [
        ("mean", dist.mean.shallow_clone()),
        ("logvar", dist.logvar.shallow_clone()),
        ("sample", dist.sample(Some(7)).unwrap()),
        ("decoded", vae.decode(&r("latents")).unwrap()),
    ] {
        let (abs, rel) = diff(&ours, &r(name));
        println!("{label} {name}: max abs diff {abs:.3e}, relative {rel:.3e}");
        assert!(
            rel < TOL_F32,
            "{label} {name}: relative diff {rel:.3e} (abs {abs:.3e})"
        );
    }
    assert!(dist.mode().equal(&dist.mean));
    // a seeded draw leaves the caller's random stream where it was
    tch::manual_seed(3);
    let a = Tensor::randn([4], (Kind::Float, tch::Device::Cpu));
    tch::manual_seed(3);
    let _ = dist.sample(Some(7)).unwrap();
    let b = Tensor::randn([4], (Kind::Float, tch::Device::Cpu));
    assert!(a.equal(&b));
    let noise = dist.mean.zeros_like();
    assert!(dist.sample_with_noise(&noise).unwrap().equal(&dist.mean));
}

#[test]
fn vae_encode_decode_match_diffusers() {
    tch::set_num_threads(1);
    for attention in [AttentionBackend::Sdpa, AttentionBackend::Math] {
        let opts = LoadOptions {
            attention,
            ..LoadOptions::default()
        };
        let vae = AutoencoderKL::from_diffusers(fixtures(), &opts).unwrap();
        assert_eq!(
            vae.num_params(),
            i64::try_from(r("num_params").get(0)).unwrap()
        );
        check(&vae, &format!("{attention:?}"));
    }
}

#[test]
fn single_file_vae_loads_like_the_folder() {
    tch::set_num_threads(1);
    let cfg = VaeConfig::from_file(&fixtures().join("vae/config.json")).unwrap();
    assert_eq!((cfg.scaling_factor, cfg.shift_factor), (0.13025, Some(0.1)));
    let vae = AutoencoderKL::from_single_file(
        &fixtures().join("single.safetensors"),
        cfg,
        &LoadOptions::default(),
    )
    .unwrap();
    check(&vae, "single file");
    let folder = AutoencoderKL::from_diffusers(fixtures(), &LoadOptions::default()).unwrap();
    let _g = tch::no_grad_guard();
    let a = vae.decode(&r("latents")).unwrap();
    let b = folder.decode(&r("latents")).unwrap();
    assert_eq!(diff(&a, &b).0, 0.0);
}

#[test]
fn legacy_attention_names_load() {
    tch::set_num_threads(1);
    let vae =
        AutoencoderKL::from_diffusers(&fixtures().join("vae_legacy"), &LoadOptions::default())
            .unwrap();
    check(&vae, "legacy names");
    let mut vae = vae;
    let names = site_names(&mut vae).unwrap();
    assert!(
        names
            .iter()
            .any(|(n, _)| n == "decoder.mid_block.attentions.0.to_out.0")
    );
}

#[test]
fn latent_scaling_uses_the_config() {
    let vae = AutoencoderKL::from_diffusers(fixtures(), &LoadOptions::default()).unwrap();
    let z = Tensor::from_slice(&[1.1f32, -0.9]);
    let s = vae.scale_latents(&z).unwrap();
    let v = Vec::<f32>::try_from(&s).unwrap();
    assert!(
        (v[0] - 0.13025).abs() < 1e-6 && (v[1] + 0.13025).abs() < 1e-6,
        "{v:?}"
    );
    let back = Vec::<f32>::try_from(vae.unscale_latents(&s).unwrap()).unwrap();
    assert!((back[0] - 1.1).abs() < 1e-6 && (back[1] + 0.9).abs() < 1e-6);
    assert_eq!(VaeConfig::sd15().scaling_factor, 0.18215);
    assert_eq!(VaeConfig::sdxl().scaling_factor, 0.13025);
}

#[test]
fn vae_sites_cover_every_conv_and_attention_projection() {
    let mut vae = AutoencoderKL::from_diffusers(fixtures(), &LoadOptions::default()).unwrap();
    let names = site_names(&mut vae).unwrap();
    let bytes = std::fs::read(fixtures().join("vae/diffusion_pytorch_model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (n, _) in &names {
        assert!(
            st.tensor(&format!("{n}.weight")).is_ok(),
            "{n}.weight not in the checkpoint"
        );
    }
    let n_weights = st
        .names()
        .iter()
        .filter(|k| k.ends_with(".weight") && st.tensor(k).unwrap().shape().len() >= 2)
        .count();
    assert_eq!(names.len(), n_weights);
    for (n, k) in [
        (
            "encoder.down_blocks.0.downsamplers.0.conv",
            SiteKind::Conv2d,
        ),
        ("encoder.mid_block.attentions.0.to_q", SiteKind::Linear),
        ("decoder.up_blocks.0.upsamplers.0.conv", SiteKind::Conv2d),
        ("quant_conv", SiteKind::Conv2d),
    ] {
        assert!(
            names.iter().any(|(m, kind)| m == n && *kind == k),
            "{n} missing"
        );
    }
    assert_eq!(vae.frozen_param_count(), Some(vae.num_params()));
    // wrong input channels are refused with the expected shape
    let e = vae
        .encode(&Tensor::zeros(
            [1, 4, 8, 8],
            (Kind::Float, tch::Device::Cpu),
        ))
        .unwrap_err()
        .to_string();
    assert!(e.contains("[batch, 3, height, width]"), "{e}");
}

/// The FLUX.1 autoencoder's fixtures: `tests/interop/flux_vae.py`'s output.
fn flux_fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("flux_vae.py"))
        .path()
}

fn flux_r(name: &str) -> Tensor {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes =
        R.get_or_init(|| std::fs::read(flux_fixtures().join("reference.safetensors")).unwrap());
    crate::common::st_tensor(bytes, name)
}

#[test]
fn flux_vae_matches_diffusers_from_the_folder_and_ae_safetensors() {
    tch::set_num_threads(1);
    let _g = tch::no_grad_guard();
    let folder = AutoencoderKL::from_diffusers(flux_fixtures(), &LoadOptions::default()).unwrap();
    let cfg = folder.config().clone();
    assert_eq!(cfg.latent_channels, 16);
    assert!(!cfg.use_quant_conv && !cfg.use_post_quant_conv);
    assert_eq!(
        (cfg.scaling_factor, cfg.shift_factor),
        (0.3611, Some(0.1159))
    );
    let ae = AutoencoderKL::from_single_file(
        &flux_fixtures().join("ae.safetensors"),
        cfg,
        &LoadOptions::default(),
    )
    .unwrap();
    for (label, vae) in [("diffusers folder", &folder), ("ae.safetensors", &ae)] {
        assert_eq!(
            vae.num_params(),
            i64::try_from(flux_r("num_params").get(0)).unwrap()
        );
        let dist = vae.encode(&flux_r("image")).unwrap();
        for (name, ours) in [
            ("mean", dist.mean.shallow_clone()),
            ("logvar", dist.logvar.shallow_clone()),
            ("decoded", vae.decode(&flux_r("latents")).unwrap()),
        ] {
            let (abs, rel) = diff(&ours, &flux_r(name));
            println!("FLUX VAE {label} {name}: max abs diff {abs:.3e}, relative {rel:.3e}");
            assert!(rel < TOL_F32, "{label} {name}: relative diff {rel:.3e}");
        }
    }
    // same weights either way
    let a = ae.decode(&flux_r("latents")).unwrap();
    let b = folder.decode(&flux_r("latents")).unwrap();
    assert_eq!(diff(&a, &b).0, 0.0);
    // no quant convs among the sites
    let mut ae = ae;
    let names = site_names(&mut ae).unwrap();
    assert!(!names.iter().any(|(n, _)| n.contains("quant_conv")));
    // (z − 0.1159) · 0.3611 and back
    let z = Tensor::from_slice(&[1.1159f32]);
    let s = f64::try_from(ae.scale_latents(&z).unwrap().get(0)).unwrap();
    assert!((s - 0.3611).abs() < 1e-6, "{s}");
}

#[test]
fn flux_vae_preset_is_flux1s_config() {
    let f = VaeConfig::flux();
    assert_eq!(f.block_out_channels, vec![128, 256, 512, 512]);
    assert_eq!((f.latent_channels, f.layers_per_block), (16, 2));
    assert_eq!((f.scaling_factor, f.shift_factor), (0.3611, Some(0.1159)));
    assert!(!f.use_quant_conv && !f.use_post_quant_conv);
    // a file without the VAE's keys names the first missing one without the prefix
    let e = AutoencoderKL::from_flux_ae(
        &flux_fixtures().join("vae/diffusion_pytorch_model.safetensors"),
        &LoadOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("`encoder."), "{e}");
}
