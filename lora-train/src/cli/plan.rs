//! `lora-train plan`: the memory plan of a config, from headers only (causal LMs and Stable
//! Diffusion).

use super::{CliError, EXIT_DOES_NOT_FIT, EXIT_OK};
use lora_memory::Budget;
use lora_train::config::TrainConfig;
use lora_train::llm;
use std::path::Path;

/// Runs `plan`; exit 3 when a budget is known and the plan does not fit it.
pub fn run(
    config: &Path,
    gpu: Option<&str>,
    budget: Option<&str>,
    json: bool,
) -> Result<i32, CliError> {
    let mut cfg = TrainConfig::from_file(config)?;
    let override_budget = match (gpu, budget) {
        (Some(g), _) => Some(Budget::gpu(g).map_err(CliError::usage)?),
        (None, Some(b)) => Some(Budget::parse(b).map_err(CliError::usage)?),
        (None, None) => None,
    };
    // A GPU budget plans for CUDA; otherwise the config's device decides ("auto" = CUDA when a
    // GPU budget is set in the config, else CPU — plan never touches libtorch).
    // A budget written for a device (`"cuda: 6GB"`, `"max_memory: cuda: 6GB"`) plans for it.
    let budget_device = budget.and_then(|b| {
        let parts: Vec<&str> = b.split(':').map(str::trim).collect();
        (parts.len() > 1)
            .then(|| parts[parts.len() - 2].to_ascii_lowercase())
            .filter(|d| d != "max_memory")
    });
    if let Some(d) = &budget_device
        && !(d == "cuda" || d.starts_with("cuda") || d == "cpu" || d.parse::<u32>().is_ok())
    {
        return Err(CliError::usage(format!(
            "--budget {:?}: unknown device {d:?} before the size; write \"cuda: 6GB\", \"cpu: 16GB\" or just \"6GB\"",
            budget.unwrap_or_default()
        )));
    }
    let cuda = gpu.is_some()
        || budget_device
            .as_deref()
            .is_some_and(|d| d.starts_with("cuda") || d.parse::<u32>().is_ok())
        || cfg.system.device.starts_with("cuda")
        || (cfg.system.device == "auto" && cfg.memory.gpu.is_some());
    // Stable Diffusion configs (model.kind sd15/sdxl, a diffusers folder, an SD single-file
    // checkpoint or a diffusion preset) get the SD plan; everything else the causal-LM plan.
    let p = if lora_train::sd_plan::is_sd_config(&cfg, config.parent()) {
        lora_train::sd_plan::plan(&mut cfg, config.parent(), override_budget, cuda)?
    } else {
        llm::plan(&mut cfg, config.parent(), override_budget, cuda)?
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&p).map_err(CliError::runtime)?
        );
    } else {
        print!("{}", p.report());
    }
    Ok(if p.fits == Some(false) {
        EXIT_DOES_NOT_FIT
    } else {
        EXIT_OK
    })
}
