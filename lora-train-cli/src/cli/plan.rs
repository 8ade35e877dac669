//! `lora-train plan`: the memory plan of a config, from headers only (causal LMs and Stable
//! Diffusion).

use super::{CliError, EXIT_DOES_NOT_FIT, EXIT_OK};
use lora_memory::Budget;
use lora_train::config::TrainConfig;
use lora_train::job::Recipe;
use std::path::Path;

/// Runs `plan`; exit 3 when a budget is known and the plan does not fit it.
pub fn run(
    config: &Path,
    gpu: Option<&str>,
    budget: Option<&str>,
    json: bool,
    frontier: bool,
    nproc_per_node: Option<u32>,
) -> Result<i32, CliError> {
    if nproc_per_node == Some(0) {
        return Err(CliError::usage(
            "--nproc-per-node 0: plan for 1 or more processes",
        ));
    }
    let cfg = TrainConfig::from_file(config)?;
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
    // The command line wins over the config: `--gpu` plans for CUDA and a device written in
    // `--budget` decides the device; otherwise `system.device` does ("auto" = CUDA when the
    // config names a GPU in memory.gpu).
    let flag_cuda = if gpu.is_some() {
        Some(true)
    } else {
        budget_device.as_deref().map(|d| d != "cpu")
    };
    let config_cuda = cfg.system.device.starts_with("cuda")
        || (cfg.system.device == "auto" && cfg.memory.gpu.is_some());
    let cuda = flag_cuda.unwrap_or(config_cuda);
    let overridden = override_notes(&cfg, gpu, budget, flag_cuda, config_cuda);
    // the recipe the config is for (Stable Diffusion: model.kind sd15/sdxl, a diffusers folder,
    // an SD single file or a diffusion preset; every other model: the causal-LM recipe)
    let recipe = recipe_for(&cfg, config.parent())?;
    let mut p = recipe.plan(&cfg, config.parent(), override_budget, cuda)?;
    if let Some(n) = nproc_per_node {
        p = p.for_world_size(n)?;
    }
    p.notes.extend(overridden);
    if json {
        let mut v = serde_json::to_value(&p).map_err(CliError::runtime)?;
        if frontier {
            let ours = p.frontier(p.settings.profile).map_err(CliError::runtime)?;
            let peft = p
                .frontier(lora_memory::Profile::peft_transformers())
                .map_err(CliError::runtime)?;
            v["frontier"] = serde_json::json!({ "ours": ours, "peft_transformers": peft });
        }
        println!(
            "{}",
            serde_json::to_string_pretty(&v).map_err(CliError::runtime)?
        );
    } else {
        print!("{}", p.report());
        if frontier {
            print!("{}", p.frontier_report().map_err(CliError::runtime)?);
        }
    }
    Ok(if p.fits == Some(false) {
        EXIT_DOES_NOT_FIT
    } else {
        EXIT_OK
    })
}

/// Notes saying what the command line replaced in the config: the budget (`memory.gpu` /
/// `memory.budget`) and the device the config would plan for.
fn override_notes(
    cfg: &TrainConfig,
    gpu: Option<&str>,
    budget: Option<&str>,
    flag_cuda: Option<bool>,
    config_cuda: bool,
) -> Vec<String> {
    let flag = match (gpu, budget) {
        (Some(g), _) => format!("--gpu {g:?}"),
        (None, Some(b)) => format!("--budget {b:?}"),
        (None, None) => return Vec::new(),
    };
    let mut notes = Vec::new();
    let in_config: Vec<String> = [
        cfg.memory.gpu.as_ref().map(|g| format!("memory.gpu: {g}")),
        cfg.memory
            .budget
            .as_ref()
            .map(|b| format!("memory.budget: {}", b.text)),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !in_config.is_empty() {
        notes.push(format!(
            "{flag} replaces {} from the config (the command line wins)",
            in_config.join(" and ")
        ));
    }
    if let Some(c) = flag_cuda
        && c != config_cuda
    {
        notes.push(format!(
            "planned for {} as {flag} says; the config (system.device: {}{}) would plan for {}",
            if c { "CUDA" } else { "the CPU" },
            cfg.system.device,
            if cfg.memory.gpu.is_some() {
                ", memory.gpu set"
            } else {
                ""
            },
            if config_cuda { "CUDA" } else { "the CPU" }
        ));
    }
    notes
}

/// The recipe `cfg` is for ([`lora_train::recipes::for_config`]).
///
/// # Errors
/// A usage error naming the recipes compiled in when none takes the config.
pub(super) fn recipe_for(
    cfg: &TrainConfig,
    config_dir: Option<&Path>,
) -> Result<&'static dyn Recipe, CliError> {
    lora_train::recipes::for_config(cfg, config_dir).ok_or_else(|| {
        let names: Vec<&str> = lora_train::recipes::all()
            .iter()
            .map(|r| r.name())
            .collect();
        CliError::usage(format!(
            "no recipe of this build takes model.base_model {:?} (recipes: {})",
            cfg.base_model().unwrap_or_default(),
            names.join(", ")
        ))
    })
}
