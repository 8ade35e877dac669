//! The FLUX.1 pipeline: transformer, CLIP-L and T5-XXL text encoders with their tokenizers,
//! the 16-channel autoencoder and the flow-matching schedule, loaded from a diffusers folder
//! (`FluxPipeline.save_pretrained` layout) or from ComfyUI's single files; text conditioning,
//! latents, and sampling with the Euler flow sampler.
//!
//! - **Text**: diffusers `pipelines/flux/pipeline_flux.py::FluxPipeline.encode_prompt` — CLIP's
//!   pooled output (77 tokens) and T5's `last_hidden_state` padded to `max_sequence_length`
//!   (512 for dev, 256 for schnell); kohya sd-scripts `library/strategy_flux.py`
//!   (`FluxTokenizeStrategy`, `FluxTextEncodingStrategy`) does the same and, with
//!   `--apply_t5_attn_mask`, passes T5 its attention mask.
//! - **Latents**: `(z − shift_factor) · scaling_factor` of the autoencoder's posterior mean,
//!   packed 2×2 into tokens ([`super::pack_latents`]) for the transformer.
//! - **Sampling**: `FluxPipeline.__call__` — seeded noise, `sigmas = linspace(1, 1/n, n)` shifted
//!   with `μ` of the packed sequence length ([`FlowMatchEulerSampler::flux`]), the transformer at
//!   `t / 1000` with FLUX.1-dev's guidance embedding (no classifier-free guidance), Euler steps.
//! - **Memory**: the frozen autoencoder and text encoders can leave the device
//!   ([`FluxPipeline::move_frozen`]); they then run where they are.

use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

use crate::clip::{ClipTextConfig, ClipTextModel, ClipTokenizer};
use crate::diffusion::{FlowMatchConfig, FlowMatchEulerSampler, sample_flow};
use crate::error::{Error, Result};
use crate::flux::{
    FluxBaseFormat, FluxConfig, FluxInputs, FluxTransformer2DModel, latent_image_ids,
};
use crate::flux::{pack_latents, unpack_latents};
use crate::sd::{AutoencoderKL, LoadOptions, VaeConfig};
use crate::t5::{T5Config, T5EncoderModel, T5Tokenizer};
use crate::weights::SafetensorsFiles;

/// Adds what was being done to a lower error ([`Error::Context`]).
trait During<T> {
    fn during(self, what: impl Into<String>) -> Result<T>;
}

impl<T, E: Into<Error>> During<T> for std::result::Result<T, E> {
    fn during(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| Error::Context {
            during: what.into(),
            source: Box::new(e.into()),
        })
    }
}

/// The folders of a diffusers FLUX.1 pipeline (`FluxPipeline.save_pretrained`), each with what
/// it must hold; `scheduler/` is optional.
const COMPONENTS: [(&str, &str); 6] = [
    (
        "transformer",
        "FluxTransformer2DModel: config.json + weights",
    ),
    (
        "text_encoder",
        "CLIPTextModel: config.json + model.safetensors",
    ),
    (
        "text_encoder_2",
        "T5EncoderModel: config.json + model.safetensors",
    ),
    (
        "tokenizer",
        "the CLIP tokenizer: tokenizer.json or vocab.json + merges.txt",
    ),
    ("tokenizer_2", "the T5 tokenizer: tokenizer.json"),
    ("vae", "AutoencoderKL: config.json + weights"),
];

// ---------------------------------------------------------------------------------------------
// Text conditioning
// ---------------------------------------------------------------------------------------------

/// Text conditioning of a batch, on the CPU or a device (the dtype the text encoders computed
/// in).
///
/// # Shapes
/// `t5` `[B, L, joint_attention_dim]` (FLUX.1: `[B, 512, 4096]` dev, `[B, 256, 4096]` schnell),
/// `pooled` `[B, pooled_projection_dim]` (CLIP-L: `[B, 768]`), `t5_mask` `[B, L]` int64 (1 =
/// token, 0 = padding; what the T5 tokenizer returned, whether or not T5 was given it).
#[derive(Debug)]
pub struct FluxTextCond {
    /// T5's `last_hidden_state`: the transformer's `encoder_hidden_states`.
    pub t5: Tensor,
    /// CLIP's pooled output: the transformer's `pooled_projections`.
    pub pooled: Tensor,
    /// The T5 attention mask.
    pub t5_mask: Tensor,
}

impl FluxTextCond {
    /// Row `i` of the batch as one sample, without the batch axis (`t5` `[L, D]`, `pooled`
    /// `[P]`, `t5_mask` `[L]`), as [`crate::sd::TextCond::row`] gives it: what a text cache
    /// keeps per caption.
    ///
    /// # Errors
    /// [`Error::Torch`] when `i` is out of range.
    pub fn row(&self, i: i64) -> Result<Self> {
        Ok(Self {
            t5: self.t5.f_select(0, i)?,
            pooled: self.pooled.f_select(0, i)?,
            t5_mask: self.t5_mask.f_select(0, i)?,
        })
    }

    /// A batch from per-sample conditionings ([`Self::row`]s: `t5` `[L, D]`, stacked on a new
    /// batch axis) or from batches (`t5` `[B_i, L, D]`, concatenated on the batch axis).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty list or a mix of samples and batches;
    /// [`Error::Torch`] for mismatched shapes (different T5 lengths), dtypes or devices.
    pub fn stack(conds: &[Self]) -> Result<Self> {
        let Some(first) = conds.first() else {
            return Err(Error::InvalidArgument(
                "FluxTextCond::stack needs at least one conditioning".into(),
            ));
        };
        let rank = first.t5.dim();
        if conds.iter().any(|c| c.t5.dim() != rank) || !(rank == 2 || rank == 3) {
            return Err(Error::InvalidArgument(format!(
                "FluxTextCond::stack takes samples (t5 [seq, dim]) or batches (t5 [batch, seq, dim]), not a mix; got t5 ranks {:?}",
                conds.iter().map(|c| c.t5.dim()).collect::<Vec<_>>()
            )));
        }
        let join = |f: fn(&Self) -> &Tensor| -> Result<Tensor> {
            let v: Vec<&Tensor> = conds.iter().map(f).collect();
            Ok(if rank == 2 {
                Tensor::f_stack(&v, 0)?
            } else {
                Tensor::f_cat(&v, 0)?
            })
        };
        Ok(Self {
            t5: join(|c| &c.t5)?,
            pooled: join(|c| &c.pooled)?,
            t5_mask: join(|c| &c.t5_mask)?,
        })
    }

    /// The same conditioning on device `d`.
    ///
    /// # Errors
    /// [`Error::Torch`] (out of memory, …).
    pub fn to_device(&self, d: Device) -> Result<Self> {
        Ok(Self {
            t5: self.t5.f_to_device(d)?,
            pooled: self.pooled.f_to_device(d)?,
            t5_mask: self.t5_mask.f_to_device(d)?,
        })
    }

    /// The conditioning as a batch: a sample of [`Self::row`] gets a batch axis of 1, a batch
    /// is returned as it is (shared tensors).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `t5` is neither `[B, L, D]` nor `[L, D]`;
    /// [`Error::Torch`].
    pub fn batched(&self) -> Result<Self> {
        match self.t5.dim() {
            3 => return Ok(self.shallow_clone()),
            2 => {}
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "FLUX text conditioning must be [batch, seq, dim] or [seq, dim], got {:?}",
                    self.t5.size()
                )));
            }
        }
        Ok(Self {
            t5: self.t5.f_unsqueeze(0)?,
            pooled: self.pooled.f_unsqueeze(0)?,
            t5_mask: self.t5_mask.f_unsqueeze(0)?,
        })
    }

    /// A second handle on the same tensors.
    pub fn shallow_clone(&self) -> Self {
        Self {
            t5: self.t5.shallow_clone(),
            pooled: self.pooled.shallow_clone(),
            t5_mask: self.t5_mask.shallow_clone(),
        }
    }

    /// The batch size `B` (1 for a sample of [`Self::row`]).
    pub fn batch_size(&self) -> i64 {
        match self.t5.size().as_slice() {
            [b, _, _] => *b,
            _ => 1,
        }
    }

    /// The transformer's `txt_ids`: zeros `[L, 3]` float32 on the conditioning's device
    /// (diffusers `FluxPipeline.encode_prompt`'s `text_ids`; kohya's `txt_ids` are the same
    /// zeros per sample).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `t5` is neither `[B, L, D]` nor `[L, D]`;
    /// [`Error::Torch`].
    pub fn txt_ids(&self) -> Result<Tensor> {
        let len = match self.t5.size().as_slice() {
            [_, l, _] | [l, _] => *l,
            sz => {
                return Err(Error::InvalidArgument(format!(
                    "FLUX text conditioning must be [batch, seq, dim] or [seq, dim], got {sz:?}"
                )));
            }
        };
        Ok(Tensor::f_zeros([len, 3], (Kind::Float, self.t5.device()))?)
    }
}

// ---------------------------------------------------------------------------------------------
// Options and files
// ---------------------------------------------------------------------------------------------

/// How [`FluxPipeline::sample`] makes images.
#[derive(Debug, Clone, PartialEq)]
pub struct FluxSampleOptions {
    /// Image size `(width, height)` in pixels; rounded down to a multiple of
    /// `2 · vae_factor` (16 for FLUX.1), as `FluxPipeline.prepare_latents` does.
    pub size: (u32, u32),
    /// Euler steps (FLUX.1-dev ≈ 20–50, schnell 1–4).
    pub steps: usize,
    /// FLUX.1-dev's distilled guidance (the guidance embedding, e.g. 3.5); ignored by schnell
    /// (no guidance embedder). There is no classifier-free guidance.
    pub guidance_scale: f64,
    /// Seed of the initial noise (CPU generator; the global generator is restored afterwards).
    pub seed: u64,
}

/// ComfyUI's / kohya's FLUX.1 single files and the folder their tokenizers come from.
///
/// Component configurations: taken from `tokenizers/<component>/config.json` when that file
/// exists (a diffusers FLUX.1 folder: `text_encoder/`, `text_encoder_2/`, `vae/`,
/// `transformer/` (only its `axes_dims_rope`), `scheduler/scheduler_config.json`); otherwise read
/// off the files' tensor shapes over the presets (CLIP ViT-L: 64-wide heads, `quick_gelu`;
/// T5 v1.1: `gated-gelu`, heads from the relative attention bias, max distance 128; the
/// autoencoder: FLUX.1's `scaling_factor` 0.3611 / `shift_factor` 0.1159, 32 norm groups;
/// the schedule of FLUX.1-dev or schnell by the guidance embedder).
#[derive(Debug, Clone, PartialEq)]
pub struct FluxFiles {
    /// The transformer: `flux1-dev.safetensors` / `flux1-schnell.safetensors` in BFL's layout,
    /// or diffusers' keys (optionally under `model.diffusion_model.` / `transformer.`).
    pub transformer: PathBuf,
    /// T5-XXL: transformers' `T5EncoderModel` keys (`t5xxl_fp16.safetensors`).
    pub t5xxl: PathBuf,
    /// CLIP-L: transformers' `CLIPTextModel` keys, with or without `text_model.`
    /// (`clip_l.safetensors`).
    pub clip_l: PathBuf,
    /// The autoencoder in BFL's layout (`ae.safetensors`).
    pub ae: PathBuf,
    /// A folder with `tokenizer/` (CLIP: `tokenizer.json` or `vocab.json` + `merges.txt`) and
    /// `tokenizer_2/` (T5: `tokenizer.json`), e.g. a diffusers FLUX.1 folder.
    pub tokenizers: PathBuf,
}

/// Where the frozen components come from, to load them again on another device.
#[derive(Debug, Clone)]
enum Origin {
    /// A diffusers folder.
    Folder(PathBuf),
    /// Single files (the configurations are the loaded models').
    Files(Box<FluxFiles>),
}

impl Origin {
    fn display(&self) -> String {
        match self {
            Origin::Folder(p) => p.display().to_string(),
            Origin::Files(f) => f.transformer.display().to_string(),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading configurations off single files
// ---------------------------------------------------------------------------------------------

/// The first of `prefixes` under which `probe` is stored in `files`.
fn find_prefix<'p>(
    files: &SafetensorsFiles,
    prefixes: &[&'p str],
    probe: &[&str],
) -> Option<&'p str> {
    prefixes.iter().copied().find(|p| {
        probe
            .iter()
            .any(|k| files.shape(&format!("{p}{k}")).is_some())
    })
}

/// `1 +` the largest `N` of the stored names `"{head}N.…"` (0 when none).
fn count_indexed(files: &SafetensorsFiles, head: &str) -> i64 {
    files
        .names()
        .filter_map(|n| n.strip_prefix(head))
        .filter_map(|rest| rest.split('.').next()?.parse::<i64>().ok())
        .map(|i| i + 1)
        .max()
        .unwrap_or(0)
}

/// The shape of the stored tensor `name`, which must have `rank` dimensions.
fn stored_shape(
    files: &SafetensorsFiles,
    name: &str,
    rank: usize,
    path: &Path,
) -> Result<Vec<i64>> {
    let sz = files.shape(name).ok_or_else(|| Error::MissingTensor {
        name: name.to_string(),
        path: path.to_path_buf(),
    })?;
    if sz.len() != rank {
        return Err(Error::Config {
            path: path.to_path_buf(),
            msg: format!("tensor `{name}` has shape {sz:?}, expected {rank} dimensions"),
        });
    }
    Ok(sz)
}

/// Prefixes of T5-XXL inside a file: none (`t5xxl_fp16.safetensors`) or SD3-style combined files.
const T5_PREFIXES: [&str; 2] = ["", "text_encoders.t5xxl.transformer."];
/// Prefixes of CLIP-L inside a file: none (`clip_l.safetensors`) or SD3-style combined files.
const CLIP_PREFIXES: [&str; 2] = ["", "text_encoders.clip_l.transformer."];

/// T5's configuration read off a single file's shapes over [`T5Config::t5_xxl`]: `d_model` and
/// vocabulary from the embedding, layers counted, heads from the relative attention bias
/// `[buckets, heads]`, `d_kv = inner / heads`, `d_ff` and gating from the first feed-forward.
fn t5_config_from_shapes(files: &SafetensorsFiles, prefix: &str, path: &Path) -> Result<T5Config> {
    let p = |k: &str| format!("{prefix}{k}");
    let emb_name = if files.shape(&p("shared.weight")).is_some() {
        p("shared.weight")
    } else {
        p("encoder.embed_tokens.weight")
    };
    let emb = stored_shape(files, &emb_name, 2, path)?;
    let bias = stored_shape(
        files,
        &p("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        2,
        path,
    )?;
    let q = stored_shape(
        files,
        &p("encoder.block.0.layer.0.SelfAttention.q.weight"),
        2,
        path,
    )?;
    let gated = files
        .shape(&p("encoder.block.0.layer.1.DenseReluDense.wi_0.weight"))
        .is_some();
    let wi = stored_shape(
        files,
        &p(if gated {
            "encoder.block.0.layer.1.DenseReluDense.wi_0.weight"
        } else {
            "encoder.block.0.layer.1.DenseReluDense.wi.weight"
        }),
        2,
        path,
    )?;
    let (vocab, d, buckets, heads) = (emb[0], emb[1], bias[0], bias[1]);
    if heads <= 0 || q[0] % heads != 0 {
        return Err(Error::Config {
            path: path.to_path_buf(),
            msg: format!(
                "cannot infer T5's head width: attention width {} over {heads} heads; give a folder with text_encoder_2/config.json",
                q[0]
            ),
        });
    }
    let base = T5Config::t5_xxl();
    Ok(T5Config {
        vocab_size: vocab,
        d_model: d,
        d_kv: q[0] / heads,
        d_ff: wi[0],
        num_layers: count_indexed(files, &p("encoder.block.")),
        num_heads: heads,
        relative_attention_num_buckets: buckets,
        feed_forward_proj: if gated {
            base.feed_forward_proj.clone()
        } else {
            "relu".into()
        },
        ..base
    })
}

/// The autoencoder's configuration read off `ae.safetensors`' shapes (BFL / LDM names, with or
/// without `first_stage_model.`) over [`VaeConfig::flux`]: block widths, layers per block,
/// latent channels, image channels and the mid-block attention.
fn vae_config_from_shapes(files: &SafetensorsFiles, path: &Path) -> Result<VaeConfig> {
    let pre = find_prefix(
        files,
        &["", "first_stage_model."],
        &["encoder.conv_in.weight"],
    )
    .ok_or_else(|| Error::MissingTensor {
        name: "encoder.conv_in.weight".into(),
        path: path.to_path_buf(),
    })?;
    let p = |k: &str| format!("{pre}{k}");
    let levels = count_indexed(files, &p("encoder.down."));
    let mut widths = Vec::with_capacity(levels as usize);
    for i in 0..levels {
        widths.push(
            stored_shape(
                files,
                &p(&format!("encoder.down.{i}.block.0.conv1.weight")),
                4,
                path,
            )?[0],
        );
    }
    let conv_in = stored_shape(files, &p("encoder.conv_in.weight"), 4, path)?;
    let conv_out = stored_shape(files, &p("encoder.conv_out.weight"), 4, path)?;
    let dec_out = stored_shape(files, &p("decoder.conv_out.weight"), 4, path)?;
    let n = widths.len();
    Ok(VaeConfig {
        in_channels: conv_in[1],
        out_channels: dec_out[0],
        down_block_types: vec!["DownEncoderBlock2D".into(); n],
        up_block_types: vec!["UpDecoderBlock2D".into(); n],
        block_out_channels: widths,
        layers_per_block: count_indexed(files, &p("encoder.down.0.block.")),
        latent_channels: conv_out[0] / 2,
        mid_block_add_attention: files.shape(&p("encoder.mid.attn_1.q.weight")).is_some(),
        ..VaeConfig::flux()
    })
}

// ---------------------------------------------------------------------------------------------
// The pipeline
// ---------------------------------------------------------------------------------------------

/// Transformer + CLIP-L + T5-XXL + tokenizers + autoencoder + flow-matching schedule of a
/// FLUX.1 (dev or schnell) model.
#[derive(Debug)]
pub struct FluxPipeline {
    /// The denoiser (adapters are injected here).
    pub transformer: FluxTransformer2DModel,
    /// CLIP ViT-L text encoder (its pooled output conditions the transformer).
    pub text_encoder: ClipTextModel,
    /// CLIP tokenizer (rows of 77 ids).
    pub tokenizer: ClipTokenizer,
    /// T5-XXL encoder (its hidden states are the transformer's text tokens).
    pub text_encoder_2: T5EncoderModel,
    /// T5 tokenizer.
    pub tokenizer_2: T5Tokenizer,
    /// The autoencoder (16 latent channels, `shift_factor` set).
    pub vae: AutoencoderKL,
    /// The flow-matching schedule (`scheduler/scheduler_config.json`, else FLUX.1-dev's or
    /// schnell's).
    pub scheduler: FlowMatchConfig,
    origin: Origin,
    /// The transformer's device.
    device: Device,
    /// The autoencoder's device (the text encoders know theirs).
    vae_device: Device,
    kind: Kind,
}

impl FluxPipeline {
    /// Loads a diffusers FLUX.1 folder (`FluxPipeline.save_pretrained`: `transformer/`,
    /// `text_encoder/` (CLIPTextModel), `text_encoder_2/` (T5EncoderModel), `tokenizer/` (CLIP:
    /// `tokenizer.json` or `vocab.json` + `merges.txt`), `tokenizer_2/` (T5: `tokenizer.json`;
    /// a folder with only `spiece.model` is refused with how to convert it), `vae/`, and
    /// optionally `scheduler/scheduler_config.json`) with every component in dtype `kind` on
    /// `device`.
    ///
    /// # Errors
    /// [`Error::Unusable`] naming a missing component folder or tokenizer file and what it must
    /// hold; [`Error::Context`] naming the component, with the loader's error as the source.
    pub fn from_diffusers(dir: &Path, kind: Kind, device: Device) -> Result<Self> {
        Self::from_diffusers_with_base(dir, kind, device, FluxBaseFormat::Dense)
    }

    /// [`Self::from_diffusers`] with the frozen transformer held as `base` says (kohya's
    /// `fp8_base`, or NF4 at load; see [`FluxBaseFormat`]).
    ///
    /// # Errors
    /// As [`Self::from_diffusers`].
    pub fn from_diffusers_with_base(
        dir: &Path,
        kind: Kind,
        device: Device,
        base: FluxBaseFormat,
    ) -> Result<Self> {
        for (c, what) in COMPONENTS {
            let sub = dir.join(c);
            if !sub.is_dir() {
                return Err(Error::Unusable {
                    what: dir.display().to_string(),
                    reason: format!(
                        "not a diffusers FLUX.1 folder: {} is missing ({what})",
                        sub.display()
                    ),
                });
            }
        }
        let ctx = |c: &str| format!("loading {c} of {}", dir.display());
        let opts = LoadOptions {
            kind,
            device,
            ..LoadOptions::default()
        };
        let transformer =
            FluxTransformer2DModel::from_diffusers_with_base(&dir.join("transformer"), &opts, base)
                .during(ctx("transformer"))?;
        let text_encoder = ClipTextModel::from_pretrained(dir.join("text_encoder"), kind, device)
            .during(ctx("text_encoder"))?;
        let tokenizer = ClipTokenizer::from_dir(dir.join("tokenizer")).during(ctx("tokenizer"))?;
        let text_encoder_2 =
            T5EncoderModel::from_pretrained(dir.join("text_encoder_2"), kind, device)
                .during(ctx("text_encoder_2"))?;
        let tokenizer_2 = t5_tokenizer(&dir.join("tokenizer_2"))?;
        let vae = AutoencoderKL::from_diffusers(dir, &opts).during(ctx("vae"))?;
        let scheduler = read_scheduler(dir, transformer.config())?;
        Ok(Self {
            transformer,
            text_encoder,
            tokenizer,
            text_encoder_2,
            tokenizer_2,
            vae,
            scheduler,
            origin: Origin::Folder(dir.to_path_buf()),
            device,
            vae_device: device,
            kind,
        })
    }

    /// Loads ComfyUI's / kohya's single files ([`FluxFiles`]: the transformer in BFL's or
    /// diffusers' keys, `clip_l.safetensors`, `t5xxl_fp16.safetensors`, `ae.safetensors`) and
    /// the tokenizers of `files.tokenizers`, every component in dtype `kind` on `device`. The
    /// configurations come from `files.tokenizers` when it holds them, else from the files'
    /// shapes (see [`FluxFiles`]).
    ///
    /// # Errors
    /// [`Error::Unusable`] for a missing tokenizer folder or file; [`Error::Context`] naming the
    /// component and file, with the loader's error as the source ([`Error::MissingTensor`] /
    /// [`Error::Shape`] when a file is not what its field says).
    pub fn from_single_files(files: &FluxFiles, kind: Kind, device: Device) -> Result<Self> {
        Self::from_single_files_with_base(files, kind, device, FluxBaseFormat::Dense)
    }

    /// [`Self::from_single_files`] with the frozen transformer held as `base` says; a GGUF
    /// transformer file (`flux1-dev-Q4_K_S.gguf`) is kept in its own block types and takes
    /// only [`FluxBaseFormat::Dense`].
    ///
    /// # Errors
    /// As [`Self::from_single_files`].
    pub fn from_single_files_with_base(
        files: &FluxFiles,
        kind: Kind,
        device: Device,
        base: FluxBaseFormat,
    ) -> Result<Self> {
        let comp = &files.tokenizers;
        for c in ["tokenizer", "tokenizer_2"] {
            if !comp.join(c).is_dir() {
                return Err(Error::Unusable {
                    what: comp.display().to_string(),
                    reason: format!(
                        "{} is missing: FluxFiles.tokenizers must be a folder with tokenizer/ (CLIP: tokenizer.json or vocab.json + merges.txt) and tokenizer_2/ (T5: tokenizer.json), e.g. a diffusers FLUX.1 folder",
                        comp.join(c).display()
                    ),
                });
            }
        }
        let ctx = |c: &str, p: &Path| format!("loading {c} from {}", p.display());
        let tokenizer = ClipTokenizer::from_dir(comp.join("tokenizer"))
            .during(ctx("the CLIP tokenizer", comp))?;
        let tokenizer_2 = t5_tokenizer(&comp.join("tokenizer_2"))?;
        let opts = LoadOptions {
            kind,
            device,
            ..LoadOptions::default()
        };
        let axes = match companion(comp, "transformer/config.json") {
            Some(p) => Some(
                FluxConfig::from_file(&p)
                    .during(ctx("the transformer config", &p))?
                    .axes_dims_rope,
            ),
            None => None,
        };
        let transformer = FluxTransformer2DModel::from_single_file_with_base(
            &files.transformer,
            &opts,
            axes,
            base,
        )
        .during(ctx("the transformer", &files.transformer))?;
        let clip_cfg = match companion(comp, "text_encoder/config.json") {
            Some(p) => Some(ClipTextConfig::from_file(&p).during(ctx("the CLIP config", &p))?),
            None => None,
        };
        let text_encoder = load_clip_l(&files.clip_l, clip_cfg, kind, device)
            .during(ctx("CLIP-L", &files.clip_l))?;
        let t5_cfg = match companion(comp, "text_encoder_2/config.json") {
            Some(p) => Some(T5Config::from_file(&p).during(ctx("the T5 config", &p))?),
            None => None,
        };
        let text_encoder_2 =
            load_t5(&files.t5xxl, t5_cfg, kind, device).during(ctx("T5-XXL", &files.t5xxl))?;
        let vae_cfg = match companion(comp, "vae/config.json") {
            Some(p) => Some(VaeConfig::from_file(&p).during(ctx("the VAE config", &p))?),
            None => None,
        };
        let vae = load_ae(&files.ae, vae_cfg, &opts).during(ctx("the autoencoder", &files.ae))?;
        let scheduler = read_scheduler(comp, transformer.config())?;
        Ok(Self {
            transformer,
            text_encoder,
            tokenizer,
            text_encoder_2,
            tokenizer_2,
            vae,
            scheduler,
            origin: Origin::Files(Box::new(files.clone())),
            device,
            vae_device: device,
            kind,
        })
    }

    /// Whether the transformer has FLUX.1-dev's guidance embedder (`guidance_embeds`); schnell
    /// has none.
    pub fn is_dev(&self) -> bool {
        self.transformer.config().guidance_embeds
    }

    /// The dtype the components were loaded in.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// The transformer's device (where training and sampling run).
    pub fn device(&self) -> Device {
        self.device
    }

    /// The autoencoder's device: the transformer's, or another after [`Self::move_frozen`].
    pub fn vae_device(&self) -> Device {
        self.vae_device
    }

    /// The text encoders' device.
    pub fn text_encoder_device(&self) -> Device {
        self.text_encoder.device()
    }

    /// The autoencoder's spatial factor `2^(levels − 1)` (8 for FLUX.1).
    pub fn vae_factor(&self) -> i64 {
        1i64 << self.vae.config().block_out_channels.len().saturating_sub(1)
    }

    /// The latent channels `C` (16 for FLUX.1; the transformer takes `4C` per packed token).
    pub fn latent_channels(&self) -> i64 {
        self.vae.config().latent_channels
    }

    /// Encodes prompts as `FluxPipeline.encode_prompt` does: CLIP ids padded / truncated to 77
    /// → `pooler_output` `[B, hidden]`; T5 ids padded / truncated to `max_sequence_length`
    /// (512 dev, 256 schnell) → `last_hidden_state` `[B, L, D]`. With `apply_t5_attn_mask`
    /// T5 gets the attention mask (kohya `--apply_t5_attn_mask`; diffusers passes none, so
    /// padding tokens attend to everything). Runs without grad on the text encoders' device and
    /// returns the tensors there, in their dtype; `t5_mask` is always the tokenizer's mask.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no prompts or `max_sequence_length == 0`;
    /// [`Error::Tokenizer`]; model errors.
    pub fn encode_prompts(
        &self,
        prompts: &[&str],
        max_sequence_length: usize,
        apply_t5_attn_mask: bool,
    ) -> Result<FluxTextCond> {
        if prompts.is_empty() {
            return Err(Error::InvalidArgument(
                "encode_prompts needs at least one prompt".into(),
            ));
        }
        let _g = tch::no_grad_guard();
        let ids = self.tokenizer.encode_batch(prompts)?;
        let pooled = self
            .text_encoder
            .forward_t(&ids.f_to_device(self.text_encoder.device())?, false)?
            .pooled;
        let (ids2, mask) = self
            .tokenizer_2
            .encode_batch(prompts, max_sequence_length)?;
        let dev2 = self.text_encoder_2.device();
        let mask = mask.f_to_device(dev2)?;
        let t5 = self.text_encoder_2.forward_t(
            &ids2.f_to_device(dev2)?,
            apply_t5_attn_mask.then_some(&mask),
            false,
        )?;
        Ok(FluxTextCond {
            t5,
            pooled,
            t5_mask: mask,
        })
    }

    /// Latents of `pixels` `[B, 3, H, W]` (f32, `[-1, 1]`; `H`, `W` multiples of the VAE factor)
    /// → `[B, C, H/f, W/f]` f32 on the CPU (FLUX.1: `[B, 16, H/8, W/8]`):
    /// `(posterior mean − shift_factor) · scaling_factor`, without grad, computed where the
    /// autoencoder is. The mean, as [`crate::sd::SdPipeline::encode_images`] takes it: kohya
    /// sd-scripts (`flux_models.AutoEncoder.encode`) and diffusers'
    /// `train_dreambooth_lora_flux.py` draw a sample of the posterior instead; a cached latent
    /// fixes one draw either way, the mean is the reproducible one.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong shape; model errors.
    pub fn encode_images(&self, pixels: &Tensor) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let x = pixels.f_to_device(self.vae_device)?;
        let z = self.vae.encode(&x)?.mode();
        Ok(self
            .vae
            .scale_latents(&z)?
            .f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?)
    }

    /// The inverse of [`Self::encode_images`]: latents `[B, C, h, w]` (any device, any float
    /// dtype) → images `[B, 3, h·f, w·f]` f32 in `[0, 1]` on the CPU: `z / scaling_factor +
    /// shift_factor` decoded where the autoencoder is, then `(x / 2 + 0.5).clamp(0, 1)` as
    /// diffusers' `VaeImageProcessor.postprocess` does. One image at a time
    /// ([`AutoencoderKL::decode_each`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong channel count; model errors.
    pub fn decode_latents(&self, latents: &Tensor) -> Result<Tensor> {
        let _g = tch::no_grad_guard();
        let z = latents.f_to_device(self.vae_device)?;
        let img = self.vae.decode_each(&self.vae.unscale_latents(&z)?)?;
        Ok(img
            .f_to_kind(Kind::Float)?
            .f_div_scalar(2.0)?
            .f_add_scalar(0.5)?
            .f_clamp(0.0, 1.0)?
            .f_to_device(Device::Cpu)?)
    }

    /// The velocity the transformer predicts for packed latents `x` `[B, N, 4C]` at `timestep`
    /// `[B]` f32 (σ, i.e. `t / 1000`) for latents of `latent_size = (h, w)` (even), under `cond`
    /// (a batch, or one sample; moved to the transformer's device and dtype); `guidance` `[B]`
    /// f32 for dev (ignored by schnell). `img_ids` are [`latent_image_ids`] of the
    /// `(h/2) × (w/2)` token grid, `txt_ids` zeros.
    /// `train` turns LoRA dropout on and keeps the graph.
    ///
    /// # Errors
    /// Model errors; [`Error::InvalidArgument`] for mismatched shapes.
    pub fn predict(
        &self,
        x: &Tensor,
        timestep: &Tensor,
        cond: &FluxTextCond,
        latent_size: (i64, i64),
        guidance: Option<&Tensor>,
        train: bool,
    ) -> Result<Tensor> {
        let dev = self.device;
        let cond = cond.batched()?;
        let img_ids = latent_image_ids(latent_size.0 / 2, latent_size.1 / 2, dev)?;
        let t5 = cond.t5.f_to_device(dev)?.f_to_kind(self.kind)?;
        let pooled = cond.pooled.f_to_device(dev)?.f_to_kind(self.kind)?;
        let txt_ids = cond.txt_ids()?.f_to_device(dev)?;
        let g = if self.is_dev() {
            guidance.map(|g| g.f_to_device(dev)).transpose()?
        } else {
            None
        };
        self.transformer.forward_t(
            &FluxInputs {
                hidden_states: &x.f_to_device(dev)?,
                encoder_hidden_states: &t5,
                pooled_projections: &pooled,
                timestep: &timestep.f_to_device(dev)?,
                img_ids: &img_ids,
                txt_ids: &txt_ids,
                guidance: g.as_ref(),
            },
            train,
        )
    }

    /// Runs the Euler flow sampler from given initial latents `noise` `[B, C, h, w]` (unpacked,
    /// `h`, `w` even; σ = 1), as `FluxPipeline.__call__(latents=pack(noise), …)`: the schedule
    /// of [`FlowMatchEulerSampler::flux`] with `μ` of the packed length `(h/2)·(w/2)`, the
    /// transformer at `t / 1000`, FLUX.1-dev's guidance embedding filled with
    /// `guidance_scale` (schnell: none), no classifier-free guidance. The latents are kept in
    /// the pipeline's dtype between steps (each step computed in f32), as diffusers keeps them
    /// in the prompt embeddings' dtype. The T5 mask is not applied in the transformer (diffusers
    /// applies none). Returns `[B, C, h, w]` f32 on the CPU, in the scaled latent space
    /// ([`Self::decode_latents`] decodes them).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a wrong noise shape, batch size or `steps == 0`; model
    /// errors.
    pub fn sample_from_noise(
        &self,
        cond: &FluxTextCond,
        noise: &Tensor,
        steps: usize,
        guidance_scale: f64,
    ) -> Result<Tensor> {
        let sz = noise.size();
        let c = self.latent_channels();
        if sz.len() != 4 || sz[1] != c || sz[2] % 2 != 0 || sz[3] % 2 != 0 {
            return Err(Error::InvalidArgument(format!(
                "FLUX noise must be [batch, {c}, h, w] with even h and w, got {sz:?}"
            )));
        }
        if sz[0] != cond.batch_size() {
            return Err(Error::InvalidArgument(format!(
                "noise batch {} differs from the text conditioning's batch {}",
                sz[0],
                cond.batch_size()
            )));
        }
        let _g = tch::no_grad_guard();
        let (h, w) = (sz[2], sz[3]);
        let dev = self.device;
        let cond = cond.batched()?.to_device(dev)?;
        let packed = pack_latents(&noise.f_to_device(dev)?.f_to_kind(self.kind)?)?;
        let sampler =
            FlowMatchEulerSampler::flux(self.scheduler.clone(), steps, (h / 2) * (w / 2))?;
        let guidance = self.is_dev().then_some(guidance_scale);
        let out = sample_flow(&sampler, &packed, guidance, |x, t, g| {
            self.predict(x, t, &cond, (h, w), g, false)
        })?;
        Ok(unpack_latents(&out, h, w)?
            .f_to_kind(Kind::Float)?
            .f_to_device(Device::Cpu)?)
    }

    /// The initial noise of [`Self::sample`] for `n` images of `size` `(width, height)` px:
    /// `randn [n, C, 2·⌊H/(2f)⌋, 2·⌊W/(2f)⌋]` f32 on the CPU from the CPU generator seeded with
    /// `seed` (`FluxPipeline.prepare_latents`' shape; the generator is restored afterwards).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the size is smaller than `2f` pixels; [`Error::Torch`].
    pub fn initial_noise(&self, n: i64, size: (u32, u32), seed: u64) -> Result<Tensor> {
        let f2 = 2 * self.vae_factor();
        let (h, w) = (2 * (i64::from(size.1) / f2), 2 * (i64::from(size.0) / f2));
        if h == 0 || w == 0 {
            return Err(Error::InvalidArgument(format!(
                "sample size {}×{} px is smaller than {f2} px (2 × the VAE factor)",
                size.0, size.1
            )));
        }
        let saved = lora_core::sys::rng_state(Device::Cpu).ok();
        tch::manual_seed(seed as i64);
        let noise = Tensor::f_randn(
            [n, self.latent_channels(), h, w],
            (Kind::Float, Device::Cpu),
        );
        if let Some(s) = saved {
            let _ = lora_core::sys::set_rng_state(Device::Cpu, &s);
        }
        Ok(noise?)
    }

    /// Generates one image per row of `cond`: seeded noise for the whole batch
    /// ([`Self::initial_noise`]), then for each row on its own [`Self::sample_from_noise`] with
    /// `opts.steps` and `opts.guidance_scale` and [`Self::decode_latents`] → `[B, 3, H, W]` f32
    /// in `[0, 1]` on the CPU (`H`, `W` rounded down to multiples of `2f`). One row at a time,
    /// as kohya's sd-scripts draws its samples: the transformer runs at batch 1 and one image is
    /// decoded at a time whatever the number of prompts, and each finished image leaves the
    /// device before the next row starts.
    ///
    /// # Errors
    /// As the three calls.
    pub fn sample(&self, cond: &FluxTextCond, opts: &FluxSampleOptions) -> Result<Tensor> {
        let n = cond.batch_size();
        let noise = self.initial_noise(n, opts.size, opts.seed)?;
        let batch = cond.batched()?;
        let mut images = Vec::with_capacity(usize::try_from(n).unwrap_or(0));
        for i in 0..n {
            let one = FluxTextCond {
                t5: batch.t5.f_narrow(0, i, 1)?,
                pooled: batch.pooled.f_narrow(0, i, 1)?,
                t5_mask: batch.t5_mask.f_narrow(0, i, 1)?,
            };
            let z = self.sample_from_noise(
                &one,
                &noise.f_narrow(0, i, 1)?,
                opts.steps,
                opts.guidance_scale,
            )?;
            images.push(self.decode_latents(&z)?);
        }
        Ok(Tensor::f_cat(&images, 0)?)
    }

    /// Moves the autoencoder (`vae`) and the text encoders (`text_encoders`) to `to`, as kohya
    /// sd-scripts moves them to the CPU once latents and text-encoder outputs are cached: the
    /// copies on `to` are loaded again from the pipeline's files with the loaded models'
    /// configurations and the old ones dropped, which frees their memory on the device. A
    /// component already on `to` stays as it is. Afterwards they run where they are
    /// ([`Self::encode_prompts`] on the text encoders' device, [`Self::encode_images`] /
    /// [`Self::decode_latents`] on the autoencoder's).
    ///
    /// Returns the components moved (`"vae"`, `"text_encoder"`, `"text_encoder_2"`).
    ///
    /// # Errors
    /// [`Error::Context`] naming the component and the files when loading fails;
    /// [`Error::Unusable`] when the text encoders carry LoRA adapters (loading them again would
    /// drop the adapters).
    pub fn move_frozen(
        &mut self,
        to: Device,
        vae: bool,
        text_encoders: bool,
    ) -> Result<Vec<&'static str>> {
        let origin = self.origin.display();
        let ctx = |c: &str| format!("loading {c} of {origin} on {to:?}");
        let mut moved = Vec::new();
        if text_encoders && self.text_encoder.device() != to {
            let adapters = lora_core::inject::count_params(&mut self.text_encoder)
                .during(ctx("text_encoder"))?
                .0
                + lora_core::inject::count_params(&mut self.text_encoder_2)
                    .during(ctx("text_encoder_2"))?
                    .0;
            if adapters > 0 {
                return Err(Error::Unusable {
                    what: origin.clone(),
                    reason: format!(
                        "the text encoders carry LoRA adapters ({adapters} parameters) and are not moved (loading them again would drop the adapters)"
                    ),
                });
            }
            let (te, te2) = self.load_text_encoders(to)?;
            self.text_encoder = te;
            self.text_encoder_2 = te2;
            moved.push("text_encoder");
            moved.push("text_encoder_2");
        }
        if vae && self.vae_device != to {
            self.vae = self.load_vae(to).during(ctx("the VAE"))?;
            self.vae_device = to;
            moved.push("vae");
        }
        Ok(moved)
    }

    /// The text encoders loaded again from the pipeline's files onto `device`.
    fn load_text_encoders(&self, device: Device) -> Result<(ClipTextModel, T5EncoderModel)> {
        let kind = self.kind;
        let ctx = |c: &str, p: &Path| format!("loading {c} from {} on {device:?}", p.display());
        match &self.origin {
            Origin::Folder(dir) => Ok((
                ClipTextModel::from_pretrained(dir.join("text_encoder"), kind, device)
                    .during(ctx("text_encoder", dir))?,
                T5EncoderModel::from_pretrained(dir.join("text_encoder_2"), kind, device)
                    .during(ctx("text_encoder_2", dir))?,
            )),
            Origin::Files(f) => Ok((
                load_clip_l(
                    &f.clip_l,
                    Some(self.text_encoder.config().clone()),
                    kind,
                    device,
                )
                .during(ctx("CLIP-L", &f.clip_l))?,
                load_t5(
                    &f.t5xxl,
                    Some(self.text_encoder_2.config().clone()),
                    kind,
                    device,
                )
                .during(ctx("T5-XXL", &f.t5xxl))?,
            )),
        }
    }

    /// The autoencoder loaded again from the pipeline's files onto `device`.
    fn load_vae(&self, device: Device) -> Result<AutoencoderKL> {
        let opts = LoadOptions {
            kind: self.kind,
            device,
            ..LoadOptions::default()
        };
        match &self.origin {
            Origin::Folder(dir) => AutoencoderKL::from_diffusers(dir, &opts),
            Origin::Files(f) => load_ae(&f.ae, Some(self.vae.config().clone()), &opts),
        }
    }
}

/// `<dir>/<rel>` when it is a file.
fn companion(dir: &Path, rel: &str) -> Option<PathBuf> {
    Some(dir.join(rel)).filter(|p| p.is_file())
}

/// The T5 tokenizer of a `tokenizer_2/` folder (`tokenizer.json`).
fn t5_tokenizer(dir: &Path) -> Result<T5Tokenizer> {
    let json = dir.join("tokenizer.json");
    if !json.is_file() {
        let spiece = if dir.join("spiece.model").is_file() {
            " (it has spiece.model: write tokenizer.json with transformers, `T5TokenizerFast.from_pretrained(dir).save_pretrained(dir)`)"
        } else {
            ""
        };
        return Err(Error::Unusable {
            what: dir.display().to_string(),
            reason: format!(
                "no tokenizer.json: the T5 tokenizer is read from {}{spiece}",
                json.display()
            ),
        });
    }
    T5Tokenizer::from_file(&json).during(format!("loading the T5 tokenizer {}", json.display()))
}

/// The flow-matching schedule of `dir/scheduler/scheduler_config.json`, else FLUX.1-dev's
/// (guidance embedder) or schnell's.
fn read_scheduler(dir: &Path, config: &FluxConfig) -> Result<FlowMatchConfig> {
    let file = dir.join("scheduler/scheduler_config.json");
    if file.is_file() {
        FlowMatchConfig::from_file(&file).during(format!("reading {}", file.display()))
    } else if config.guidance_embeds {
        Ok(FlowMatchConfig::flux_dev())
    } else {
        Ok(FlowMatchConfig::flux_schnell())
    }
}

/// CLIP-L from a single file (transformers keys, with or without `text_model.`, optionally
/// under an SD3-style prefix); `config` `None` reads the sizes off the shapes.
fn load_clip_l(
    path: &Path,
    config: Option<ClipTextConfig>,
    kind: Kind,
    device: Device,
) -> Result<ClipTextModel> {
    let files = SafetensorsFiles::open(&[path.to_path_buf()], path, device)?;
    let prefix = find_prefix(
        &files,
        &CLIP_PREFIXES,
        &[
            "text_model.embeddings.token_embedding.weight",
            "embeddings.token_embedding.weight",
        ],
    )
    .ok_or_else(|| Error::MissingTensor {
        name: "text_model.embeddings.token_embedding.weight".into(),
        path: path.to_path_buf(),
    })?;
    drop(files);
    ClipTextModel::from_single_file(path, prefix, config, kind, device)
}

/// T5 from a single file (transformers keys, optionally under an SD3-style prefix); `config`
/// `None` reads it off the shapes.
fn load_t5(
    path: &Path,
    config: Option<T5Config>,
    kind: Kind,
    device: Device,
) -> Result<T5EncoderModel> {
    let files = SafetensorsFiles::open(&[path.to_path_buf()], path, device)?;
    let prefix = find_prefix(
        &files,
        &T5_PREFIXES,
        &["shared.weight", "encoder.embed_tokens.weight"],
    )
    .ok_or_else(|| Error::MissingTensor {
        name: "shared.weight".into(),
        path: path.to_path_buf(),
    })?;
    let config = match config {
        Some(c) => c,
        None => t5_config_from_shapes(&files, prefix, path)?,
    };
    let prefix = prefix.to_string();
    let src = files.with_key_map(move |n| Some(format!("{prefix}{n}")));
    T5EncoderModel::build(config, &src, kind, device)
}

/// The autoencoder from `ae.safetensors`; `config` `None` reads it off the shapes.
fn load_ae(path: &Path, config: Option<VaeConfig>, opts: &LoadOptions) -> Result<AutoencoderKL> {
    let config = match config {
        Some(c) => c,
        None => {
            let files = SafetensorsFiles::open(&[path.to_path_buf()], path, opts.device)?;
            vae_config_from_shapes(&files, path)?
        }
    };
    AutoencoderKL::from_single_file(path, config, opts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cond(b: i64, l: i64) -> FluxTextCond {
        let f = (Kind::Float, Device::Cpu);
        FluxTextCond {
            t5: Tensor::arange(b * l * 2, f).reshape([b, l, 2]),
            pooled: Tensor::arange(b * 3, f).reshape([b, 3]),
            t5_mask: Tensor::ones([b, l], (Kind::Int64, Device::Cpu)),
        }
    }

    #[test]
    fn rows_stack_back_into_the_batch() {
        let c = cond(3, 4);
        let rows: Vec<FluxTextCond> = (0..3).map(|i| c.row(i).unwrap()).collect();
        assert_eq!(rows[1].t5.size(), [4, 2]);
        assert_eq!(rows[2].pooled.size(), [3]);
        assert_eq!(rows[2].t5_mask.size(), [4]);
        assert!(rows[1].t5.equal(&c.t5.get(1)));
        assert_eq!(rows[0].txt_ids().unwrap().size(), [4, 3]);
        let back = FluxTextCond::stack(&rows).unwrap();
        assert!(
            back.t5.equal(&c.t5) && back.pooled.equal(&c.pooled) && back.t5_mask.equal(&c.t5_mask)
        );
        assert_eq!((back.batch_size(), rows[0].batch_size()), (3, 1));
        // batches concatenate
        let two = FluxTextCond::stack(&[c.shallow_clone(), c.shallow_clone()]).unwrap();
        assert_eq!(two.t5.size(), [6, 4, 2]);
        assert!(two.pooled.narrow(0, 3, 3).equal(&c.pooled));
        assert!(FluxTextCond::stack(&[]).is_err());
        assert!(FluxTextCond::stack(&[c.shallow_clone(), rows[0].shallow_clone()]).is_err());
        assert!(c.row(3).is_err());
        let ids = c.txt_ids().unwrap();
        assert_eq!((ids.size(), ids.kind()), (vec![4, 3], Kind::Float));
        assert_eq!(f64::try_from(ids.abs().sum(Kind::Float)).unwrap(), 0.0);
    }
}
