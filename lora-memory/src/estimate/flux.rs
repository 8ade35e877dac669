//! The FLUX.1 estimate: transformer weights (dense, fp8, NF4 or GGUF, minus the blocks swapped
//! to the host), adapters and optimizer, the saved activations of the double- and single-stream
//! blocks, and the phase before training where the text encoders and the autoencoder fill the
//! caches.

use super::{
    Ctx, FinishArgs, ctx, finish, frozen_models_on_device, full_trainable, lora_input_bytes,
    lora_state, no_target_error, optimizer_bytes, step_temporaries, targeted, vae_decode_elements,
};
use crate::error::{Error, Result};
use crate::flux::{FLUX_MLP_RATIO, FluxDescriptor};
use crate::model::LinearSite;
use crate::settings::{Attention, BaseDtype, Device, Method, Settings};
use crate::units::Bytes;
use serde::{Deserialize, Serialize};

use super::Estimate;

/// FLUX-specific detail of an [`Estimate`] (what `lora-train plan` shows for a FLUX config).
/// The byte counts of the training phase are already in the [`super::Breakdown`] terms.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct FluxDetail {
    /// Image size `[width, height]` in pixels (the largest bucket when bucketing).
    pub image_size: [u32; 2],
    /// Image tokens per sample: `(W/16)·(H/16)` (VAE ÷8, then 2 × 2 patches).
    pub image_tokens: u64,
    /// T5 tokens per sample.
    pub text_tokens: u64,
    /// Transformer weights on the device during training (swapped blocks excluded, their
    /// staging buffer included).
    pub transformer_weights: Bytes,
    /// Blocks kept on the host: `[double, single]`.
    pub swapped_blocks: [u64; 2],
    /// Host memory the swapped blocks hold (pinned, outside the device budget).
    pub host_bytes: Bytes,
    /// Text-encoder weights on the device during training (0 when their outputs are cached).
    pub text_encoder_weights: Bytes,
    /// Autoencoder weights on the device during training (0 when latents are cached).
    pub vae_weights: Bytes,
    /// Saved transformer activations at the backward peak (part of `activations`).
    pub transformer_activations: Bytes,
    /// Whole-process peak on the device while the caches are filled (text encoders, then the
    /// autoencoder, each alone on the device); 0 when nothing is cached.
    pub caching_peak: Bytes,
    /// What drawing the sample grid of [`Settings::sample_images`] adds next to the weights,
    /// adapters, optimizer states and gradients, whether or not it is the peak (see
    /// [`super::Breakdown::sample_images`]); 0 without sample images.
    #[serde(default)]
    pub sample_images: Bytes,
}

/// Live elements per token while one single-stream block runs without gradients: its input,
/// the modulated LayerNorm output, q/k/v `3h`, the MLP input `f` and its GELU `f`, the attention
/// output `h`, their concatenation `h + f`, and the output: `8h + 3f` (lora-models
/// `FluxSingleBlock`), the largest of the two block kinds, plus `h` for what the transformer
/// holds around it (the modulation, the packed input and the rotary tables). With the counting
/// allocator on the tiny FLUX.1-dev pipeline's whole transformer: 647.0, 644.6 and 643.5 floats
/// per token over 32, 80 and 272 tokens, against `8h + 3f` = 640 and this count's 672 at
/// `h` = 32.
fn single_block_inference_elements(h: f64, f: f64) -> f64 {
    9.0 * h + 3.0 * f
}

/// The staging buffers block swapping keeps on the device: one block, of the largest kind
/// swapped, into which the next host block is copied while the current one computes.
pub const FLUX_SWAP_STAGING_BLOCKS: u64 = 1;

/// Storage bytes per parameter of the frozen text encoders while on the device.
fn te_bytes_per_param(s: &Settings) -> f64 {
    match s.text_encoder_dtype {
        Some(d) => d.bytes_per_param(),
        None if s.base_dtype == BaseDtype::F32 => 4.0,
        None => 2.0,
    }
}

/// A base kept in a GGUF file's own block types: the file's stored bytes replace
/// `params × bytes/param`.
fn as_stored(d: &FluxDescriptor, s: &Settings) -> Option<f64> {
    d.stored_bytes
        .filter(|_| s.base_dtype.is_gguf())
        .map(|b| b as f64)
}

/// Saved bytes per token of one block, without checkpointing (`double`: per token of either
/// stream, each stream has the same structure). `is` tells whether a site name is adapted.
///
/// Always saved (the gradient flows through every block to the adapters before it): the
/// LayerNorm inputs (fp32 under autocast, `nb`), the q/k RMSNorm inputs (diffusers' `RMSNorm`
/// computes in fp32: an fp32 copy and the input, `(4 + e)` each), the attention kernel's q, k, v
/// and output, the GELU input (`4h`) and the outputs the two gates multiply. Saved only when
/// adapted ([`lora_input_bytes`]): the inputs of the adapted linears and their LoRA A outputs.
fn block_bytes_per_token(
    c: &Ctx,
    s: &Settings,
    d: &FluxDescriptor,
    double: bool,
    is: &dyn Fn(&str) -> bool,
) -> f64 {
    let h = d.hidden as f64;
    let f = (FLUX_MLP_RATIO * d.hidden) as f64;
    let nb = if c.autocast { 4.0 } else { c.r };
    let full = s.method == Method::Full;
    let lin = |names: &[&str], width: f64| {
        let k = names.iter().filter(|n| is(n)).count();
        lora_input_bytes(c, s, full, k, width)
    };
    let qk_norm = (4.0 + c.e) * 2.0 * h;
    // the attention kernel's q, k, v and output (its per-head statistics are counted per block)
    let attn = c.e * 4.0 * h;
    if double {
        let always = nb * 2.0 * h + qk_norm + attn + c.e * (f + 2.0 * h);
        always
            + lin(&["attn.to_q", "attn.to_k", "attn.to_v"], h).max(lin(
                &["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
                h,
            ))
            + lin(&["attn.to_out.0"], h).max(lin(&["attn.to_add_out"], h))
            + lin(&["ff.net.0.proj"], h).max(lin(&["ff_context.net.0.proj"], h))
            + lin(&["ff.net.2"], f).max(lin(&["ff_context.net.2"], f))
    } else {
        let always = nb * h + qk_norm + attn + c.e * (f + h);
        always
            + lin(&["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"], h)
            + lin(&["proj_out"], h + f)
    }
}

pub(super) fn estimate_flux(d: &FluxDescriptor, s: &Settings) -> Result<Estimate> {
    if !s.modules_to_save.is_empty() || s.quantize_lm_head {
        return Err(Error::InvalidSetting {
            key: if s.quantize_lm_head {
                "quantize_lm_head"
            } else {
                "modules_to_save"
            },
            reason: format!(
                "{} is a FLUX model: modules_to_save and quantize_lm_head apply to decoders",
                d.name
            ),
        });
    }
    if s.train_text_encoder && s.cache_text_encoder_outputs {
        return Err(Error::InvalidSetting {
            key: "cache_text_encoder_outputs",
            reason: "text-encoder outputs cannot be cached while the text encoder is trained; turn one off".into(),
        });
    }
    let (swap_d, swap_s) = d.swapped_blocks(s.blocks_to_swap)?;
    let c = ctx(s);
    let all_sites = d.sites();
    // only the trained blocks' sites can carry LoRA (kohya's `networks.lora_flux`: the blocks,
    // selected by `train_blocks` and block indices)
    let trainable_sites = match s.flux_trained_blocks {
        Some((td, ts)) => {
            d.sites_with_blocks(td.min(d.double_blocks), ts.min(d.single_blocks), false)
        }
        None => all_sites.clone(),
    };
    // a trained text encoder is CLIP-L (kohya trains T5 only with `train_t5xxl`)
    let usable: Vec<LinearSite> = trainable_sites
        .iter()
        .filter(|x| {
            x.component == "transformer" || (s.train_text_encoder && x.component == "text_encoder")
        })
        .cloned()
        .collect();
    let sites = targeted(&usable, s);
    if s.method != Method::Full && sites.is_empty() {
        return Err(no_target_error(&usable, s));
    }
    let full = s.method == Method::Full;
    let mut notes = Vec::new();

    // --- weights
    let linear_params: u64 = all_sites
        .iter()
        .filter(|x| x.component == "transformer")
        .map(|x| x.weight_params() * x.count)
        .sum::<u64>()
        .min(d.transformer_params);
    let other_bytes = if s.base_dtype == BaseDtype::F32 {
        4.0
    } else {
        2.0
    };
    let dense_total = linear_params as f64 * s.base_dtype.bytes_per_param()
        + (d.transformer_params - linear_params) as f64 * other_bytes;
    let total = as_stored(d, s).unwrap_or(dense_total);
    let per_param = total / d.transformer_params.max(1) as f64;
    let (pd, ps) = (
        d.double_block_params() as f64,
        d.single_block_params() as f64,
    );
    // on the CPU the host memory is the device's: swapped blocks stay in the same memory
    let swaps = s.device.is_cuda();
    let host = if swaps {
        (swap_d as f64 * pd + swap_s as f64 * ps) * per_param
    } else {
        0.0
    };
    let staging = if !swaps {
        0.0
    } else if swap_d > 0 {
        pd
    } else if swap_s > 0 {
        ps
    } else {
        0.0
    } * per_param
        * FLUX_SWAP_STAGING_BLOCKS as f64;
    let transformer_weights = total - host + staging;
    if swap_d + swap_s > 0 && !swaps {
        notes.push(format!(
            "blocks_to_swap {} saves nothing on the CPU: host memory is the memory the run is planned for",
            s.blocks_to_swap
        ));
    } else if swap_d + swap_s > 0 {
        notes.push(format!(
            "blocks_to_swap {}: {swap_d} double-stream and {swap_s} single-stream blocks ({}) stay in host memory and are copied in for their forward and backward passes; the device keeps one block-sized staging buffer",
            s.blocks_to_swap,
            Bytes::from_f64(host)
        ));
    }
    let (vae_stays, te_stays) = frozen_models_on_device(s);
    let teb = te_bytes_per_param(s);
    let te_weights = if te_stays {
        d.text_encoder_params() as f64 * teb
    } else {
        0.0
    };
    let vae_weights = if vae_stays {
        d.vae_params as f64 * other_bytes
    } else {
        0.0
    };
    let base = transformer_weights + te_weights + vae_weights;
    // a 32-bit base under autocast: every frozen linear is cast per op and kept for its
    // backward; a quantized / fp8 base: one layer's weight decoded at a time
    let autocast_copies = if c.autocast && s.base_dtype == BaseDtype::F32 {
        2.0 * linear_params as f64
    } else {
        0.0
    };
    let h = d.hidden as f64;
    let f = (FLUX_MLP_RATIO * d.hidden) as f64;
    let decode_transient = if s.base_dtype.is_quantized() && s.device.is_cuda() {
        // the largest linear, single-stream `h → 7h` (q, k, v and the MLP input), dense
        c.e * h * (3.0 * h + f)
    } else {
        0.0
    };

    // --- trainable
    let (trainable, adapter_bytes, grad_bytes, state_bytes) = if full {
        let mut p = d.transformer_params;
        if s.train_text_encoder {
            p += d.text_encoders.first().map_or(0, |t| t.params);
        }
        full_trainable(s, &usable, p, (h * (3.0 * h + f)) as u64)
    } else {
        lora_state(&c, s, &sites)
    };
    let gradients = trainable.params as f64 * grad_bytes;
    let (states, foreach_tmp) = optimizer_bytes(&trainable, s.optimizer, state_bytes);
    let step_tmp = step_temporaries(&trainable, s, foreach_tmp, state_bytes);

    // --- activations
    let [wpx, hpx] = s.largest_bucket.unwrap_or([s.resolution, s.resolution]);
    let patch = (d.vae_scale.max(1) * 2) as f64;
    let n_img = (f64::from(wpx) / patch).floor() * (f64::from(hpx) / patch).floor();
    let n_txt = f64::from(s.text_tokens.unwrap_or(d.default_text_tokens() as u32));
    let n = n_img + n_txt;
    let samples = f64::from(s.micro_batch) * if s.prior_preservation { 2.0 } else { 1.0 };
    let is = |name: &str| {
        full || sites
            .iter()
            .any(|x| x.component == "transformer" && x.name == name)
    };
    let per_double = block_bytes_per_token(&c, s, d, true, &is) * n;
    let per_single = block_bytes_per_token(&c, s, d, false, &is) * n;
    let heads = d.heads as f64;
    let (maps, map_work) = match s.attention {
        // the kernel keeps a logsumexp per head and query
        Attention::Sdpa => (4.0 * heads * n, 0.0),
        // scores and their softmax, and their gradients in the backward
        Attention::Math => (c.e * heads * n * n, 2.0 * c.e * heads * n * n),
    };
    // backward working set of one block: the gradients of the two residual streams and of the
    // block output, the GELU gradient (4h) and the attention gradients (q, k, v)
    let working = c.e * (3.0 * h + f + 3.0 * h) * n + map_work;
    let (nd, ns) = (d.double_blocks as f64, d.single_blocks as f64);
    // norm_out (fp32 LayerNorm input under autocast) and proj_out's input over the image tokens
    let head_bytes = (if c.autocast { 4.0 } else { c.r } + c.e) * h * n_img;
    let stored = nd * (per_double + maps) + ns * (per_single + maps) + head_bytes;
    // checkpointing keeps each block's input (both streams, `r` bytes) and recomputes one block
    let ckpt = (nd + ns) * c.r * h * n + per_double.max(per_single) + maps + head_bytes;
    let act_per_sample = if s.gradient_checkpointing {
        ckpt + working
    } else {
        stored + working
    };
    let mut te_act = 0.0;
    if let Some(te) = d.text_encoders.first().filter(|_| s.train_text_encoder) {
        {
            let th = te.hidden as f64;
            let tok = te.max_tokens as f64;
            let attn = match s.attention {
                Attention::Sdpa => 4.0 * te.heads as f64,
                Attention::Math => c.e * te.heads as f64 * tok,
            };
            te_act =
                te.layers as f64 * tok * (c.e * (12.0 * th + 2.0 * te.intermediate as f64) + attn);
        }
    }
    // what every block reads, alive through the step: the rotary tables cos/sin `[n, head_dim]`
    // (fp32), the position ids `[n, 3]` and the timestep and guidance sinusoids `[b, 256]`
    // (fp32; lora-models `FluxTransformer2DModel::prepare`)
    let step_context = 8.0 * n * d.head_dim() as f64 + 8.0 * 3.0 * n + samples * 2.0 * 4.0 * 256.0;
    let activations = samples * (act_per_sample + te_act) + step_context;
    // packed latents, noise, noisy input and target (fp32) + T5 and pooled CLIP embeddings
    let batch = samples
        * (4.0 * 4.0 * d.in_channels as f64 * n_img
            + 4.0 * n_txt * d.joint_attention_dim as f64
            + 4.0 * d.pooled_projection_dim as f64);

    // --- the phase that fills the caches: each frozen model alone on the device
    let ctx_bytes = match s.device {
        Device::Cuda { context, workspace } => (context + workspace).as_f64(),
        Device::Cpu { runtime } => runtime.as_f64(),
    };
    let mut caching: f64 = 0.0;
    if !te_stays {
        // T5-XXL's feed-forward over one caption: the two 10240-wide halves and their product
        let t5 = d.text_encoders.last();
        let t5_act = t5.map_or(0.0, |t| 3.0 * c.e * n_txt * t.intermediate as f64);
        caching = caching.max(d.text_encoder_params() as f64 * teb + t5_act);
    }
    if !vae_stays {
        // encoder at full resolution without gradients: a few 128-channel maps of the image
        let vae_act = 3.0 * c.e * 128.0 * f64::from(wpx) * f64::from(hpx);
        caching = caching.max(d.vae_params as f64 * other_bytes + vae_act);
    }
    let caching_peak = if caching > 0.0 {
        caching + ctx_bytes
    } else {
        0.0
    };

    // --- a sample grid between steps: one prompt at a time through the transformer (batch 1,
    // no classifier-free guidance), the text encoders and the autoencoder running where they
    // are (lora-models `FluxPipeline::sample`): on the device only when they stay there
    let sample_images = s.sample_images.as_ref().map_or(0.0, |g| {
        let [sw, sh] = g.size.unwrap_or([wpx, hpx]);
        let n_img_s = (f64::from(sw) / patch).floor() * (f64::from(sh) / patch).floor();
        let n_s = n_img_s + n_txt;
        let prompts = f64::from(g.prompts.max(1));
        let nb = if c.autocast { 4.0 } else { c.r };
        let maps_s = match s.attention {
            Attention::Sdpa => 4.0 * heads * n_s,
            Attention::Math => 2.0 * c.e * heads * n_s * n_s,
        };
        let transformer =
            (nb * h + c.e * (single_block_inference_elements(h, f) - h)) * n_s + maps_s;
        let lc = d.latent_channels as f64;
        let n0 = 4.0 * n_img_s;
        let pixels = f64::from(sw) * f64::from(sh);
        let decode = if vae_stays {
            let (ch, per_level) = d.vae_decoder_shape();
            other_bytes * vae_decode_elements(&ch, per_level, lc, n0, pixels, false)
        } else {
            0.0
        };
        // T5 over every prompt at once (its feed-forward halves and their product)
        let text = if te_stays {
            d.text_encoders
                .last()
                .map_or(0.0, |t| 3.0 * c.e * prompts * n_txt * t.intermediate as f64)
        } else {
            0.0
        };
        // the conditioning of every prompt, the grid's noise (fp32) and, on a CPU run, the
        // finished images (fp32) in the same memory
        let cond =
            prompts * teb * (n_txt * d.joint_attention_dim as f64 + d.pooled_projection_dim as f64);
        let noise = 4.0 * lc * n0 * prompts;
        let images = if s.device.is_cuda() {
            0.0
        } else {
            4.0 * 3.0 * pixels * prompts
        };
        transformer.max(decode).max(text) + cond + noise + images
    });

    // what the data source keeps (CPU): fp32 latents `[C, H/f, W/f]` at the training size; T5's
    // states `[L, D]` and CLIP's pooled output in the dtype the text encoders compute in (fp32
    // for an fp32 model, whatever the transformer's or T5's storage; else 16 bit), and the T5
    // mask (int64)
    let te_out = if s.base_dtype == BaseDtype::F32 || s.quantized_compute_f32 {
        4.0
    } else {
        2.0
    };
    let kept_data = super::kept_data_bytes(
        s,
        4.0 * d.latent_channels as f64
            * (f64::from(wpx) / d.vae_scale.max(1) as f64).floor()
            * (f64::from(hpx) / d.vae_scale.max(1) as f64).floor(),
        te_out * (n_txt * d.joint_attention_dim as f64 + d.pooled_projection_dim as f64)
            + 8.0 * n_txt,
        0.0,
    );
    let mut e = finish(FinishArgs {
        model: d.name.clone(),
        s,
        trainable: trainable.params,
        base_weights: base,
        autocast_copies,
        adapter_bytes,
        gradients,
        states,
        step_tmp,
        step_tmp_small_pool: trainable.largest as f64 * state_bytes <= 1_048_576.0,
        activations,
        logits_loss: 0.0,
        batch,
        rounding: 0.0,
        notes,
        diffusion: None,
        buffers_persistent: 0.0,
        buffers_backward: decode_transient,
        sample_images,
        kept_data,
    })?;
    if Bytes::from_f64(caching_peak) > e.peak_process {
        e.notes.push(format!(
            "the peak is while the caches are filled ({}): the text encoders ({}) are on the device then; an fp8 T5 (text_encoder_dtype) halves them",
            Bytes::from_f64(caching_peak),
            Bytes::from_f64(d.text_encoder_params() as f64 * teb)
        ));
        e.peak_process = Bytes::from_f64(caching_peak);
        e.peak = e.peak_process;
    }
    e.flux = Some(FluxDetail {
        image_size: [wpx, hpx],
        image_tokens: n_img as u64,
        text_tokens: n_txt as u64,
        transformer_weights: Bytes::from_f64(transformer_weights),
        swapped_blocks: [swap_d, swap_s],
        host_bytes: Bytes::from_f64(host),
        text_encoder_weights: Bytes::from_f64(te_weights),
        vae_weights: Bytes::from_f64(vae_weights),
        transformer_activations: Bytes::from_f64(samples * act_per_sample),
        caching_peak: Bytes::from_f64(caching_peak),
        sample_images: Bytes::from_f64(sample_images),
    });
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimate;
    use crate::model::ModelDescriptor;

    /// kohya sd-scripts' FLUX.1 LoRA sample command at batch 1 (the public boundary cases
    /// `KF-*` in [`crate::cases`] check its VRAM table).
    fn kohya() -> Settings {
        crate::cases::boundary_cases()
            .into_iter()
            .find(|c| c.id == "KF-16")
            .map(|c| c.settings)
            .unwrap()
    }

    fn dev() -> ModelDescriptor {
        ModelDescriptor::preset("FLUX.1-dev").unwrap()
    }

    #[test]
    fn kept_latents_and_captions_count_on_the_cpu_only() {
        let m = dev();
        let cpu = kohya().with_device(crate::settings::Device::cpu());
        let kept = crate::settings::KeptData {
            latents: 20,
            captions: 10,
            eval_samples: 8,
        };
        let base = estimate(&m, &cpu).unwrap();
        let with = estimate(&m, &cpu.clone().with_kept_data(Some(kept))).unwrap();
        // 1024² px: latents [16, 128, 128] fp32; 512 T5 tokens × 4096 and the 768-d pooled
        // output in 16 bit (KF-16's T5), the mask in int64
        let latent = 4.0 * 16.0 * 128.0 * 128.0;
        let text = 2.0 * (512.0 * 4096.0 + 768.0) + 8.0 * 512.0;
        let want = 20.0 * latent + 10.0 * text + 8.0 * (latent + text);
        assert_eq!(with.breakdown.kept_data.0, want as u64);
        assert_eq!(
            with.peak_allocated.0 - base.peak_allocated.0,
            with.breakdown.kept_data.0
        );
        assert_eq!(with.persistent.0 - base.persistent.0, want as u64);
        // caches that fill during the steps grow the steps' RSS: counted there too
        assert_eq!(with.step_delta.0 - base.step_delta.0, want as u64);
        // host memory on a CUDA run
        let cuda = kohya().with_kept_data(Some(kept));
        let on_gpu = estimate(&m, &cuda).unwrap();
        assert_eq!(on_gpu.breakdown.kept_data.0, 0);
        assert_eq!(on_gpu.peak, estimate(&m, &kohya()).unwrap().peak);
    }

    fn gib(x: f64) -> Bytes {
        Bytes::from_gib(x)
    }

    #[test]
    fn a_sample_grid_counts_the_transformer_at_batch_one_and_a_decode_only_where_the_vae_is() {
        let m = dev();
        let ModelDescriptor::Flux(d) = &m else {
            unreachable!()
        };
        let s = kohya();
        let plain = estimate(&m, &s).unwrap();
        assert_eq!(plain.flux.as_ref().unwrap().sample_images.0, 0);
        let grid = |s: &Settings, prompts: u32| {
            s.clone()
                .with_sample_images(Some(crate::settings::SampleImages {
                    size: Some([1024, 1024]),
                    prompts,
                    guidance: false,
                }))
        };
        // kohya's command caches latents and text-encoder outputs: on CUDA the autoencoder and
        // the encoders sample where they were moved (the CPU); the device holds one
        // single-stream block's inference tensors over 4,096 + 512 tokens
        let cuda = estimate(&m, &grid(&s, 2)).unwrap();
        let on_device = cuda.flux.as_ref().unwrap().sample_images.as_f64();
        let (h, f) = (d.hidden as f64, 4.0 * d.hidden as f64);
        let tokens = 4096.0 + 512.0;
        let block = 2.0 * (9.0 * h + 3.0 * f) * tokens;
        assert!(
            on_device >= block && on_device < 1.1 * block,
            "{on_device} vs {block}"
        );
        // sampling stays below kohya's training step there
        assert_eq!(cuda.peak, plain.peak);
        assert_eq!(cuda.breakdown.sample_images.0, 0);
        // the prompts go one at a time: more of them add only their noise and conditioning
        let four = estimate(&m, &grid(&s, 4)).unwrap();
        let more = four.flux.as_ref().unwrap().sample_images.as_f64() - on_device;
        assert!(more > 0.0 && more < 20e6, "{more}");
        // with the autoencoder kept on the device its 1024² decode (128–512 channels over
        // every pixel, in 16 bit) is counted, and is the larger of the two
        let kept = s.clone().with_keep_models_loaded(true);
        let with_vae = estimate(&m, &grid(&kept, 2)).unwrap();
        let decode_floor = 2.0 * (3.0 * 256.0 + 128.0) * 1024.0 * 1024.0;
        assert!(
            with_vae.flux.as_ref().unwrap().sample_images.as_f64() >= decode_floor,
            "{:?}",
            with_vae.flux
        );
    }

    #[test]
    fn swapping_moves_block_weights_to_the_host_and_keeps_one_staging_block() {
        let m = dev();
        let ModelDescriptor::Flux(d) = &m else {
            unreachable!()
        };
        let s = kohya();
        let a = estimate(&m, &s).unwrap();
        let b = estimate(&m, &s.clone().with_blocks_to_swap(16)).unwrap();
        let (fa, fb) = (a.flux.unwrap(), b.flux.unwrap());
        assert_eq!(fb.swapped_blocks, [8, 16]);
        // fp8: 1 byte per linear parameter; the biases and norm scales (16-bit) ride along
        let host = fb.host_bytes.as_f64();
        let linear = (8 * d.double_block_params() + 16 * d.single_block_params()) as f64;
        assert!((host / linear - 1.0).abs() < 0.01, "{host} vs {linear}");
        let staging = d.double_block_params() as f64;
        let saved = fa.transformer_weights.as_f64() - fb.transformer_weights.as_f64();
        assert!(((host - staging * host / linear) - saved).abs() < 1e6);
        assert_eq!(fa.host_bytes, Bytes::ZERO);
        // activations do not change
        assert_eq!(fa.transformer_activations, fb.transformer_activations);
        // on the CPU nothing moves anywhere
        let cpu = s.clone().with_device(crate::settings::Device::cpu());
        let c0 = estimate(&m, &cpu).unwrap();
        let c16 = estimate(&m, &cpu.clone().with_blocks_to_swap(16)).unwrap();
        assert_eq!(c0.peak, c16.peak);
        assert!(
            c16.notes
                .iter()
                .any(|n| n.contains("saves nothing on the CPU"))
        );
        // past 35 is refused by name
        let e = estimate(&m, &s.with_blocks_to_swap(36)).unwrap_err();
        assert!(e.to_string().contains("blocks_to_swap"), "{e}");
    }

    #[test]
    fn training_only_some_blocks_counts_only_their_adapters() {
        let m = dev();
        let s = kohya();
        let all = estimate(&m, &s.clone().with_flux_trained_blocks(Some((19, 38))))
            .unwrap()
            .trainable_params;
        // without a block selection the list `proj_out` also reaches the output head
        let head = 4 * (3072 + 64);
        assert_eq!(estimate(&m, &s).unwrap().trainable_params, all + head);
        let single = estimate(&m, &s.clone().with_flux_trained_blocks(Some((0, 38))))
            .unwrap()
            .trainable_params;
        let double = estimate(&m, &s.clone().with_flux_trained_blocks(Some((19, 0))))
            .unwrap()
            .trainable_params;
        // r4 on every block linear of 3072 wide blocks: single-stream q, k, v (3072 → 3072),
        // proj_mlp (3072 → 12288), proj_out (15360 → 3072), norm.linear (3072 → 9216)
        let per_single =
            4 * ((3 * (3072 + 3072)) + (3072 + 12288) + (15360 + 3072) + (3072 + 9216));
        assert_eq!(single, 38 * per_single);
        assert_eq!(single + double, all);
        // half the single-stream blocks: half their adapters
        let half = estimate(&m, &s.with_flux_trained_blocks(Some((0, 19))))
            .unwrap()
            .trainable_params;
        assert_eq!(half, 19 * per_single);
    }

    #[test]
    fn a_16_bit_t5_makes_caching_the_peak_on_a_small_card() {
        let m = dev();
        let s = kohya().with_blocks_to_swap(28);
        let e16 = estimate(&m, &s).unwrap();
        let e8 = estimate(&m, &s.clone().with_text_encoder_dtype(Some(BaseDtype::Fp8))).unwrap();
        let (f16, f8) = (e16.flux.clone().unwrap(), e8.flux.clone().unwrap());
        // T5-XXL + CLIP-L in 16 bit ≈ 9.8 GB, in fp8 ≈ 4.9 GB
        assert!(
            f16.caching_peak.gb() > 9.8 && f16.caching_peak.gb() < 11.0,
            "{}",
            f16.caching_peak
        );
        assert!(
            f8.caching_peak.gb() > 4.9 && f8.caching_peak.gb() < 6.5,
            "{}",
            f8.caching_peak
        );
        assert_eq!(e16.peak, f16.caching_peak);
        assert!(e16.notes.iter().any(|n| n.contains("caches are filled")));
        assert!(e8.peak < e16.peak);
        // without caching the encoders stay for the whole run instead
        let no_cache = estimate(&m, &s.with_cache_text_encoder_outputs(false)).unwrap();
        let nf = no_cache.flux.unwrap();
        assert!(
            nf.text_encoder_weights.gb() > 9.7,
            "{}",
            nf.text_encoder_weights
        );
        // only the autoencoder fills a cache then: its weights and a few 1024² maps
        assert!(nf.caching_peak.gb() < 2.0, "{}", nf.caching_peak);
    }

    #[test]
    fn fit_swaps_blocks_before_it_lowers_the_resolution() {
        let m = dev();
        let s = kohya();
        let f = crate::fit::fit(&m, &s, gib(10.0)).unwrap();
        let settings: Vec<&str> = f.changes.iter().map(|c| c.setting.as_str()).collect();
        assert!(settings.contains(&"blocks_to_swap"), "{settings:?}");
        assert!(!settings.contains(&"resolution"), "{settings:?}");
        assert_eq!(f.settings.resolution, 1024);
        // a bf16 base is first stored in fp8
        let g = crate::fit::fit(&m, &s.with_base_dtype(BaseDtype::Bf16), gib(16.0)).unwrap();
        assert!(
            g.changes
                .iter()
                .any(|c| c.setting == "base_dtype" && c.to.contains("fp8")),
            "{:?}",
            g.changes
        );
    }
}
