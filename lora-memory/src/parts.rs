//! Building blocks that the model descriptors of every family share: one kind of
//! LoRA-targetable layer, a text encoder, the VAE decoder's shape. Re-exported by
//! [`crate::model`], whose paths they keep.

use serde::{Deserialize, Serialize};

/// One kind of LoRA-targetable layer, repeated `count` times in the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearSite {
    /// Module path relative to its block, HF / diffusers naming (`self_attn.q_proj`,
    /// `attn2.to_k`, `resnets.conv1`, `lm_head`).
    pub name: String,
    /// Which sub-model holds it: `"decoder"`, `"unet"`, `"text_encoder"`, `"text_encoder_2"`.
    pub component: String,
    /// Input features (conv: input channels).
    pub in_features: u64,
    /// Output features (conv: output channels).
    pub out_features: u64,
    /// Kernel area `k·k` (1 for linear layers).
    pub kernel_area: u64,
    /// How many such layers the model holds.
    pub count: u64,
    /// A convolution (targeted only by conv LoRA / LoCon).
    pub conv: bool,
}

impl LinearSite {
    /// Weight parameters of one such layer: `in · out · k²`.
    pub fn weight_params(&self) -> u64 {
        self.in_features
            .saturating_mul(self.out_features)
            .saturating_mul(self.kernel_area)
    }

    /// LoRA parameters of one such layer at rank `r`: `r · (in · k² + out)`
    /// (lora_A / lora_down `[r, in, k, k]`, lora_B / lora_up `[out, r, 1, 1]`; LoRA,
    /// arXiv:2106.09685; kohya LoCon for convs).
    pub fn lora_params(&self, rank: u64) -> u64 {
        rank.saturating_mul(
            self.in_features
                .saturating_mul(self.kernel_area)
                .saturating_add(self.out_features),
        )
    }

    /// PEFT-style target matching: a target equals the site name or the site name ends with
    /// `"." + target`; `"all-linear"` matches every non-conv site except `lm_head`.
    pub fn matches(&self, target: &str) -> bool {
        if target == "all-linear" {
            return !self.conv && self.name != "lm_head";
        }
        self.name == target || self.name.ends_with(&format!(".{target}"))
    }
}

/// A text encoder (CLIP-style transformer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TextEncoderDescriptor {
    /// `text_encoder` or `text_encoder_2`.
    pub name: String,
    /// Parameter count.
    pub params: u64,
    /// Width.
    pub hidden: u64,
    /// MLP width.
    pub intermediate: u64,
    /// Layers.
    pub layers: u64,
    /// Heads.
    pub heads: u64,
    /// Context length (77 for CLIP).
    pub max_tokens: u64,
}

/// `block_out_channels` of the VAE of SD 1.x, SD 2.x and SDXL (diffusers `AutoencoderKL`
/// config of runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-xl-base-1.0).
pub const SD_VAE_CHANNELS: [u64; 4] = [128, 256, 512, 512];

/// `(block_out_channels, layers_per_block + 1)` of an `AutoencoderKL` config, SD's (and FLUX.1's)
/// `[128, 256, 512, 512]` and 2 for what is not given (empty, 0).
pub(crate) fn decoder_shape(channels: &[u64], layers_per_block: u64) -> (Vec<u64>, u64) {
    let ch = if channels.is_empty() {
        SD_VAE_CHANNELS.to_vec()
    } else {
        channels.to_vec()
    };
    let layers = if layers_per_block == 0 {
        2
    } else {
        layers_per_block
    };
    (ch, layers + 1)
}
