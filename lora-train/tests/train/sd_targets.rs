//! `lora.target_modules` on Stable Diffusion: the names `lora-train plan` and `train` accept
//! before loading ([`sd_plan::check_target_modules`]) against the module names of real UNets
//! (the tiny SD 1.x and SDXL pipelines of `tests/sd_interop/make_pipeline.py`, built with
//! diffusers): every module the SD job can adapt is accepted — by its full name, by any of the
//! dot-separated endings PEFT matches, and as a regex — and every accepted name reaches a module
//! of a real UNet, as the injection matches it.

use lora_core::inject::site_names;
use lora_models::sd::{LoadOptions, UNet2DConditionModel};
use lora_train::config::TrainConfig;
use lora_train::sd_plan;
use std::path::Path;

use crate::sd_fixture::make_pipeline;

/// The UNet module names of the tiny pipeline `make_pipeline.py` writes (`--sdxl` for SDXL).
fn unet_sites(out: &Path, sdxl: bool) -> Vec<String> {
    let extra: &[&str] = if sdxl {
        &["--n", "1", "--sdxl"]
    } else {
        &["--n", "1"]
    };
    make_pipeline(out, extra);
    let dir = out.join(if sdxl { "pipeline_xl" } else { "pipeline" });
    let mut unet = UNet2DConditionModel::from_diffusers(&dir, &LoadOptions::default()).unwrap();
    site_names(&mut unet)
        .unwrap()
        .into_iter()
        .map(|(n, _)| n)
        .collect()
}

fn with_targets(yaml_value: &str) -> TrainConfig {
    TrainConfig::from_yaml_str(&format!(
        "model: {{base_model: sd15}}\nlora: {{target_modules: {yaml_value}}}\n"
    ))
    .unwrap()
}

fn accepted(yaml_value: &str) -> bool {
    sd_plan::check_target_modules(&with_targets(yaml_value)).is_ok()
}

/// PEFT's list matching, as lora-core's injection does it.
fn peft_matches(module: &str, target: &str) -> bool {
    module == target || module.ends_with(&format!(".{target}"))
}

#[test]
fn the_names_accepted_before_loading_are_the_names_real_unets_have() {
    let _serial = crate::serial();
    let dir = tempfile::tempdir().unwrap();
    let sd1 = unet_sites(dir.path(), false);
    let sdxl = unet_sites(dir.path(), true);
    assert!(sd1.len() > 30 && sdxl.len() > 30, "{sd1:?}\n{sdxl:?}");
    for must in [
        "add_embedding.linear_1",
        "down_blocks.1.attentions.0.transformer_blocks.1.attn2.to_k",
    ] {
        assert!(sdxl.iter().any(|s| s == must), "{must} not in {sdxl:?}");
    }
    for must in [
        "conv_in",
        "down_blocks.0.downsamplers.0.conv",
        "up_blocks.0.upsamplers.0.conv",
        "up_blocks.1.resnets.1.conv_shortcut",
        "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj",
    ] {
        assert!(sd1.iter().any(|s| s == must), "{must} not in {sd1:?}");
    }
    let all: Vec<&String> = sd1.iter().chain(&sdxl).collect();
    // every module: its full name, every ending PEFT would match, and the name as a regex
    for site in &all {
        let parts: Vec<&str> = site.split('.').collect();
        for k in 0..parts.len() {
            let ending = parts[k..].join(".");
            assert!(accepted(&format!("['{ending}']")), "{ending} (of {site})");
        }
        let regex = site.replace('.', "\\.");
        assert!(accepted(&format!("'{regex}'")), "regex {regex}");
    }
    // every name the error lists, and a few paths, reach a module of a real UNet
    for name in [
        "to_q",
        "to_k",
        "to_v",
        "to_out.0",
        "attn1.to_q",
        "attn2.to_v",
        "proj_in",
        "proj_out",
        "ff.net.0.proj",
        "ff.net.2",
        "conv1",
        "conv2",
        "resnets.0.conv1",
        "time_emb_proj",
        "conv_shortcut",
        "conv_in",
        "conv_out",
        "downsamplers.0.conv",
        "upsamplers.0.conv",
        "time_embedding.linear_1",
        "add_embedding.linear_2",
        "down_blocks.0.attentions.0.proj_in",
        "mid_block.resnets.1.conv2",
        "transformer_blocks.1.attn1.to_out.0",
    ] {
        assert!(accepted(&format!("['{name}']")), "{name} refused");
        assert!(
            all.iter().any(|s| peft_matches(s, name)),
            "{name} is accepted but matches no module"
        );
    }
    // names refused before loading match no module of either UNet
    for name in [
        "q_proj",
        "v_proj",
        "o_proj",
        "to_out",
        "attn3.to_q",
        "to_q.weight",
        "ff.net.1",
        "self_attn.q_proj",
        "down_blocks.x.resnets.0.conv1",
    ] {
        assert!(!accepted(&format!("['{name}']")), "{name} accepted");
        assert!(
            !all.iter().any(|s| peft_matches(s, name)),
            "{name} is refused but matches a module"
        );
    }
}
