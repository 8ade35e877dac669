//! FluxPipeline against diffusers 0.42.1's `FluxPipeline` on the tiny random-weight FLUX.1-dev
//! -like pipeline that `tests/interop/flux_pipeline.py` builds and writes: prompt encoding (CLIP
//! pooled + T5, with and without the T5 mask), image latents, sampling from the same initial
//! latents (4 Euler steps, dynamic shift, guidance 3.5) and decoding — from the diffusers folder
//! and from ComfyUI-style single files (configs from the folder, and read off the shapes).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::common::{diff, st_tensor};
use crate::rng_lock;
use lora_models::flux::{FluxFiles, FluxPipeline, FluxSampleOptions, FluxTextCond};
use tch::{Device, Kind, Tensor};

const PROMPTS: [&str; 2] = [
    "a photo of a cat",
    "the red car on the street, a photo of a dog",
];
const MAX_SEQ: usize = 16;

fn fixtures() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| crate::common::interop_fixtures("flux_pipeline.py"))
        .path()
}

fn r(name: &str) -> Tensor {
    static R: OnceLock<Vec<u8>> = OnceLock::new();
    let bytes = R.get_or_init(|| std::fs::read(fixtures().join("reference.safetensors")).unwrap());
    st_tensor(bytes, name)
}

fn folder() -> PathBuf {
    fixtures().join("pipe")
}

fn load() -> FluxPipeline {
    crate::common::init_threads();
    FluxPipeline::from_diffusers(&folder(), Kind::Float, Device::Cpu).unwrap()
}

fn single_files(tokenizers: PathBuf) -> FluxFiles {
    let s = fixtures().join("single");
    FluxFiles {
        transformer: s.join("flux1.safetensors"),
        t5xxl: s.join("t5xxl.safetensors"),
        clip_l: s.join("clip_l.safetensors"),
        ae: s.join("ae.safetensors"),
        tokenizers,
    }
}

/// Asserts a relative error (max |a − b| / max |b|) below `tol` and prints it.
fn check(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    let (abs, rel) = diff(got, want);
    eprintln!("{what}: max abs {abs:.3e}, rel {rel:.3e}");
    assert!(
        rel < tol,
        "{what}: relative error {rel:.3e} ≥ {tol:e} (abs {abs:.3e})"
    );
}

/// The reference conditioning (diffusers' own prompt embeddings).
fn reference_cond() -> FluxTextCond {
    FluxTextCond {
        t5: r("prompt_embeds"),
        pooled: r("pooled_prompt_embeds"),
        t5_mask: r("t5_mask"),
    }
}

/// Encoding, latents and sampling of `p` against the reference, prefixed with `label`.
fn check_outputs(label: &str, p: &FluxPipeline) {
    let c = p.encode_prompts(&PROMPTS, MAX_SEQ, false).unwrap();
    check(&format!("{label} t5"), &c.t5, &r("prompt_embeds"), 1e-5);
    check(
        &format!("{label} pooled"),
        &c.pooled,
        &r("pooled_prompt_embeds"),
        1e-5,
    );
    assert!(c.t5_mask.equal(&r("t5_mask")), "{label}: T5 mask differs");
    let z = p.encode_images(&r("image")).unwrap();
    check(&format!("{label} latents"), &z, &r("latents"), 1e-5);
    let s = p
        .sample_from_noise(&reference_cond(), &r("noise"), 4, 3.5)
        .unwrap();
    check(
        &format!("{label} sampled"),
        &s,
        &r("sampled_unpacked"),
        1e-4,
    );
}

#[test]
fn flux_pipeline_encodes_prompts_like_diffusers() {
    let p = load();
    assert!(p.is_dev());
    assert_eq!((p.kind(), p.device()), (Kind::Float, Device::Cpu));
    let c = p.encode_prompts(&PROMPTS, MAX_SEQ, false).unwrap();
    assert_eq!(c.t5.size(), [2, 16, 32]);
    assert_eq!(c.pooled.size(), [2, 128]);
    check("t5 (no mask)", &c.t5, &r("prompt_embeds"), 1e-5);
    check("CLIP pooled", &c.pooled, &r("pooled_prompt_embeds"), 1e-5);
    assert!(c.t5_mask.equal(&r("t5_mask")));
    assert!(c.txt_ids().unwrap().equal(&r("text_ids")));
    // kohya --apply_t5_attn_mask: the masked encoding, which differs from the unmasked one
    let m = p.encode_prompts(&PROMPTS, MAX_SEQ, true).unwrap();
    check("t5 (masked)", &m.t5, &r("prompt_embeds_masked"), 1e-5);
    assert!(diff(&m.t5, &r("prompt_embeds")).1 > 1e-2);
    assert!(m.pooled.equal(&c.pooled));
    // rows and stacking keep the values
    let back = FluxTextCond::stack(&[c.row(1).unwrap(), c.row(0).unwrap()]).unwrap();
    assert!(back.t5.get(0).equal(&c.t5.get(1)) && back.pooled.get(1).equal(&c.pooled.get(0)));
    assert!(p.encode_prompts(&[], MAX_SEQ, false).is_err());
}

#[test]
fn flux_pipeline_latents_and_decoding_match_diffusers() {
    // draws from (and reseeds) the global generator: not while another test relies on it
    let _rng = rng_lock();
    let p = load();
    assert_eq!((p.vae_factor(), p.latent_channels()), (2, 16));
    let z = p.encode_images(&r("image")).unwrap();
    assert_eq!((z.size(), z.kind()), (vec![2, 16, 16, 24], Kind::Float));
    check(
        "latents (posterior mean, shifted and scaled)",
        &z,
        &r("latents"),
        1e-5,
    );
    let img = p.decode_latents(&r("sampled_unpacked")).unwrap();
    check("decoded image in [0, 1]", &img, &r("decoded"), 1e-5);
    assert!(p.encode_images(&r("image").narrow(1, 0, 2)).is_err());
}

#[test]
fn flux_pipeline_samples_like_diffusers_from_the_same_noise() {
    // draws from (and reseeds) the global generator: not while another test relies on it
    let _rng = rng_lock();
    let p = load();
    // the scheduler config of the folder: FLUX.1-dev's dynamic shift
    assert!(p.scheduler.use_dynamic_shifting);
    let cond = reference_cond();
    let s = p.sample_from_noise(&cond, &r("noise"), 4, 3.5).unwrap();
    assert_eq!((s.size(), s.kind()), (vec![2, 16, 16, 24], Kind::Float));
    check(
        "sampled latents (4 steps, guidance 3.5)",
        &s,
        &r("sampled_unpacked"),
        1e-4,
    );
    let packed = lora_models::flux::pack_latents(&s).unwrap();
    check("sampled latents, packed", &packed, &r("sampled"), 1e-4);
    check(
        "sample → decoded",
        &p.decode_latents(&s).unwrap(),
        &r("decoded_pt"),
        1e-4,
    );
    // the guidance value reaches the model
    let s2 = p.sample_from_noise(&cond, &r("noise"), 4, 1.0).unwrap();
    assert!(diff(&s2, &r("sampled_unpacked")).1 > 1e-3);
    // wrong noise shapes and batch sizes are refused
    assert!(
        p.sample_from_noise(&cond, &r("noise").narrow(1, 0, 4), 4, 3.5)
            .is_err()
    );
    let one = FluxTextCond::stack(&[cond.row(0).unwrap()]).unwrap();
    assert!(p.sample_from_noise(&one, &r("noise"), 4, 3.5).is_err());
    assert!(p.sample_from_noise(&cond, &r("noise"), 0, 3.5).is_err());
}

#[test]
fn flux_pipeline_sample_is_seeded_and_restores_the_generator() {
    let _rng = rng_lock();
    let p = load();
    let opts = FluxSampleOptions {
        size: (48, 34), // the height rounds down to 32 px (a multiple of 2·f = 4 px)
        steps: 2,
        guidance_scale: 3.5,
        seed: 7,
    };
    let cond = reference_cond();
    tch::manual_seed(123);
    let a = p.sample(&cond, &opts).unwrap();
    let after = Tensor::randn([4], (Kind::Float, Device::Cpu));
    tch::manual_seed(123);
    let expected = Tensor::randn([4], (Kind::Float, Device::Cpu));
    assert!(
        after.equal(&expected),
        "sampling changed the global generator"
    );
    assert_eq!(a.size(), [2, 3, 32, 48]);
    let (lo, hi) = (
        f64::try_from(a.min()).unwrap(),
        f64::try_from(a.max()).unwrap(),
    );
    assert!((0.0..=1.0).contains(&lo) && (0.0..=1.0).contains(&hi) && hi > lo);
    let b = p.sample(&cond, &opts).unwrap();
    assert!(a.equal(&b));
    let c = p
        .sample(
            &cond,
            &FluxSampleOptions {
                seed: 8,
                ..opts.clone()
            },
        )
        .unwrap();
    assert!(!a.equal(&c));
    // noise of the seed, sampled by hand one prompt at a time as `sample` goes, gives the same
    // images; the two prompts sampled as one batch give them up to the GEMMs' batch rounding
    let noise = p.initial_noise(2, opts.size, opts.seed).unwrap();
    assert_eq!(noise.size(), [2, 16, 16, 24]);
    for i in 0..2 {
        let one = FluxTextCond::stack(&[cond.row(i).unwrap()]).unwrap();
        let z = p
            .sample_from_noise(&one, &noise.narrow(0, i, 1), 2, 3.5)
            .unwrap();
        assert!(p.decode_latents(&z).unwrap().equal(&a.narrow(0, i, 1)));
    }
    let z = p.sample_from_noise(&cond, &noise, 2, 3.5).unwrap();
    let batched = p.decode_latents(&z).unwrap();
    let diff = (&batched - &a).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "batched vs one at a time: {diff:e}");
}

#[test]
fn flux_pipeline_from_single_files_matches_diffusers() {
    crate::common::init_threads();
    // configs from the diffusers folder next to the tokenizers
    let p =
        FluxPipeline::from_single_files(&single_files(folder()), Kind::Float, Device::Cpu).unwrap();
    assert!(p.is_dev());
    check_outputs("single files, folder configs", &p);
    // configs read off the files' shapes: a folder with the tokenizers and the transformer's
    // config (for the RoPE axes of the tiny model) only
    let tmp = tempfile::tempdir().unwrap();
    for c in ["tokenizer", "tokenizer_2"] {
        copy_dir(&folder().join(c), &tmp.path().join(c));
    }
    std::fs::create_dir(tmp.path().join("transformer")).unwrap();
    std::fs::copy(
        folder().join("transformer/config.json"),
        tmp.path().join("transformer/config.json"),
    )
    .unwrap();
    let q = FluxPipeline::from_single_files(
        &single_files(tmp.path().to_path_buf()),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap();
    let (a, b) = (q.text_encoder.config(), p.text_encoder.config());
    assert_eq!(
        (
            a.hidden_size,
            a.num_hidden_layers,
            a.num_attention_heads,
            a.intermediate_size
        ),
        (
            b.hidden_size,
            b.num_hidden_layers,
            b.num_attention_heads,
            b.intermediate_size
        )
    );
    assert_eq!(
        (a.hidden_act, a.eos_token_id),
        (b.hidden_act, b.eos_token_id)
    );
    assert_eq!(q.vae.config().block_out_channels, [32, 64]);
    assert_eq!(q.text_encoder_2.config().num_heads, 4);
    // no scheduler config: FLUX.1-dev's schedule (dynamic shift, as the folder's)
    assert_eq!(
        q.scheduler.use_dynamic_shifting,
        p.scheduler.use_dynamic_shifting
    );
    check_outputs("single files, shapes", &q);
}

#[test]
fn flux_pipeline_move_frozen_to_the_same_device_moves_nothing() {
    let mut p = load();
    assert!(p.move_frozen(Device::Cpu, true, true).unwrap().is_empty());
    assert_eq!(
        (p.vae_device(), p.text_encoder_device()),
        (Device::Cpu, Device::Cpu)
    );
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A copy of the diffusers folder without `missing`.
fn folder_without(missing: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(folder()).unwrap() {
        let e = e.unwrap();
        if e.file_name() != missing && e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &tmp.path().join(e.file_name()));
        }
    }
    tmp
}

#[test]
fn flux_pipeline_names_missing_components() {
    for missing in ["tokenizer_2", "text_encoder_2", "vae"] {
        let tmp = folder_without(missing);
        let err = FluxPipeline::from_diffusers(tmp.path(), Kind::Float, Device::Cpu)
            .unwrap_err()
            .to_string();
        let path = tmp.path().join(missing).display().to_string();
        assert!(err.contains(&path), "{missing}: {err}");
    }
    // a T5 tokenizer folder with only spiece.model: the error names tokenizer.json
    let tmp = folder_without("tokenizer_2");
    std::fs::create_dir(tmp.path().join("tokenizer_2")).unwrap();
    std::fs::write(tmp.path().join("tokenizer_2/spiece.model"), b"x").unwrap();
    let err = FluxPipeline::from_diffusers(tmp.path(), Kind::Float, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tokenizer.json") && err.contains("spiece.model"),
        "{err}"
    );
    // single files without tokenizer_2/ in the tokenizer folder
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&folder().join("tokenizer"), &tmp.path().join("tokenizer"));
    let err = FluxPipeline::from_single_files(
        &single_files(tmp.path().to_path_buf()),
        Kind::Float,
        Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains(&tmp.path().join("tokenizer_2").display().to_string()),
        "{err}"
    );
}

#[test]
fn flux_pipeline_in_bf16_stays_close_to_the_f32_reference() {
    // draws from (and reseeds) the global generator: not while another test relies on it
    let _rng = rng_lock();
    crate::common::init_threads();
    let p = FluxPipeline::from_diffusers(&folder(), Kind::BFloat16, Device::Cpu).unwrap();
    assert_eq!(p.kind(), Kind::BFloat16);
    let c = p.encode_prompts(&PROMPTS, MAX_SEQ, false).unwrap();
    assert_eq!(
        (c.t5.kind(), c.pooled.kind()),
        (Kind::BFloat16, Kind::BFloat16)
    );
    check("bf16 t5", &c.t5, &r("prompt_embeds"), 5e-2);
    check("bf16 pooled", &c.pooled, &r("pooled_prompt_embeds"), 5e-2);
    let z = p.encode_images(&r("image")).unwrap();
    assert_eq!(z.kind(), Kind::Float);
    check("bf16 latents", &z, &r("latents"), 3e-2);
    // the f32 conditioning is cast to the pipeline's dtype
    let s = p
        .sample_from_noise(&reference_cond(), &r("noise"), 4, 3.5)
        .unwrap();
    assert_eq!(s.kind(), Kind::Float);
    check("bf16 sampled", &s, &r("sampled_unpacked"), 5e-2);
    let img = p.decode_latents(&r("sampled_unpacked")).unwrap();
    check("bf16 decoded", &img, &r("decoded"), 5e-2);
}

#[test]
fn flux_pipeline_schnell_samples_without_guidance_like_diffusers() {
    // draws from (and reseeds) the global generator: not while another test relies on it
    let _rng = rng_lock();
    crate::common::init_threads();
    let p = FluxPipeline::from_diffusers(&fixtures().join("schnell"), Kind::Float, Device::Cpu)
        .unwrap();
    assert!(!p.is_dev());
    // FLUX.1-schnell's schedule: static shift 1, no dynamic shifting
    assert!(!p.scheduler.use_dynamic_shifting);
    // the guidance scale is ignored (no guidance embedder)
    for g in [0.0, 3.5] {
        let s = p
            .sample_from_noise(&reference_cond(), &r("noise"), 2, g)
            .unwrap();
        check(
            &format!("schnell sampled (2 steps, guidance {g})"),
            &s,
            &r("schnell.sampled_unpacked"),
            1e-4,
        );
    }
}
