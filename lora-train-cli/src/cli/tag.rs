//! `lora-train tag`: caption a folder of images with the image tagger, or turn free-text
//! descriptions into tags with the LLM tagger (`lora_tagger::llm`).
//!
//! Images: every image directly in `--images DIR` gets `<stem><caption_extension>` beside it
//! (mode skip / overwrite / append, `--dry-run` to only report). Per-batch memory lines go to
//! stderr; the report and the images/s go to stdout. Exit 0 when every image succeeded, 1 when
//! some failed (the others are still written), 2 for bad usage or config.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use lora_tagger::caption::CaptionAction;
use lora_tagger::config::{LlmBackend, TaggerConfig};
use lora_tagger::{
    CachedTagger, CaptionMode, CaptionWriter, Error as TagError, ImageTagger, TagCache, Tagger,
};

use super::{CliError, EXIT_OK, EXIT_RUNTIME};

/// Arguments of `lora-train tag`.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["images", "descriptions"])))]
pub struct TagArgs {
    /// Folder of images to caption (captions are written beside them).
    #[arg(long, value_name = "DIR")]
    pub images: Option<PathBuf>,
    /// Text file of descriptions to turn into tags: one per line, or JSONL with a
    /// "description" (or "text"/"caption") field.
    #[arg(long, value_name = "FILE")]
    pub descriptions: Option<PathBuf>,
    /// Where to write the tags of --descriptions (JSONL); default stdout.
    #[arg(long, value_name = "FILE", requires = "descriptions")]
    pub out: Option<PathBuf>,
    /// Tagger config (.yaml, .yml or .toml; see examples/configs/tagger.yaml).
    #[arg(long, short)]
    pub config: Option<PathBuf>,
    /// Image model folder (model.safetensors, or a WD14 model.onnx, + selected_tags.csv);
    /// default mobilenet_v2/ in the
    /// project's assets: $LORA_SDK_ASSETS, else ./assets, else the assets/ folder beside the
    /// executable or up to two folders above it (target/debug/lora-train finds the workspace's).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// What to do with existing captions: skip (default), overwrite or append.
    #[arg(long)]
    pub mode: Option<CaptionMode>,
    /// Report what would be written; write nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Caption file extension (default .txt).
    #[arg(long, value_name = "EXT", alias = "caption_extension")]
    pub caption_extension: Option<String>,
    /// Minimum probability of a general tag (image.general_threshold; default by the model's
    /// head: 0.05 for single-label softmax classifiers such as the built-in MobileNetV2, 0.35
    /// for multi-label sigmoid taggers such as WD14).
    #[arg(
        long,
        visible_alias = "general-threshold",
        aliases = ["general_threshold", "thresh"]
    )]
    pub threshold: Option<f32>,
    /// Minimum probability of a character tag (image.character_threshold; default 0.85).
    #[arg(long, alias = "character_threshold", value_name = "P")]
    pub character_threshold: Option<f32>,
    /// Choose the general-tag threshold per image by MCut (image.general_mcut), as the WD14 v3
    /// taggers' reference app offers.
    #[arg(long, alias = "general_mcut_enabled")]
    pub general_mcut: bool,
    /// Choose the character-tag threshold per image by MCut, at least 0.15
    /// (image.character_mcut).
    #[arg(long, alias = "character_mcut_enabled")]
    pub character_mcut: bool,
    /// The ONNX Runtime shared library (or its folder) for model.onnx models (image.onnxruntime;
    /// default ORT_DYLIB_PATH, else the onnxruntime Python package of the project's venv).
    #[arg(long, value_name = "PATH")]
    pub onnxruntime: Option<PathBuf>,
    /// Comma-separated tags never written (tags.undesired_tags; kohya's --undesired_tags).
    #[arg(long, value_name = "TAGS", alias = "undesired_tags")]
    pub undesired_tags: Option<String>,
    /// Underscores → spaces in tags longer than 3 characters (tags.replace_underscores; on by
    /// default here, kohya's --remove_underscore).
    #[arg(long, alias = "remove_underscore")]
    pub remove_underscore: bool,
    /// Character tags before general tags (tags.character_first; on by default here, kohya's
    /// --character_tags_first).
    #[arg(long, alias = "character_tags_first")]
    pub character_tags_first: bool,
    /// Comma-separated tags moved to the front when found (tags.first_if_found; kohya's
    /// --always_first_tags: the last one listed ends up first).
    #[arg(long, value_name = "TAGS", alias = "always_first_tags")]
    pub always_first_tags: Option<String>,
    /// Tag replacements as kohya writes them: `source1,target1;source2,target2`, `\,` and `\;`
    /// for literal commas and semicolons (added to tags.replacements).
    #[arg(long, value_name = "SPEC", alias = "tag_replacement")]
    pub tag_replacement: Option<String>,
    /// A word written first in every caption (trigger word); repeat for several.
    #[arg(long, value_name = "WORD")]
    pub trigger: Vec<String>,
    /// At most this many model tags per caption (after the trigger words); 0 = no limit, every
    /// tag above the thresholds, as kohya's tag_images_by_wd14_tagger.py writes (the default).
    #[arg(long, value_name = "N")]
    pub max_tags: Option<usize>,
    /// Plan the image tagger's batch for this card (a GPU name such as "RTX 3060", as `plan`
    /// takes it) instead of this machine's free memory; the plan and the fixed table's answer
    /// are printed before the run (use with --dry-run to only see them).
    #[arg(long, value_name = "NAME", conflicts_with = "budget")]
    pub gpu: Option<String>,
    /// Plan the image tagger's batch for this much free memory ("8GB", "12GiB").
    #[arg(long, value_name = "SIZE")]
    pub budget: Option<String>,
    /// Caption the images with a vision-language model behind this OpenAI-compatible server
    /// root instead of the image model (vlm.base_url), e.g. http://127.0.0.1:8000/v1 (vLLM,
    /// llama.cpp's llama-server, Ollama's /v1).
    #[arg(long, value_name = "URL")]
    pub vlm: Option<String>,
    /// The served vision model's name (vlm.model).
    #[arg(long, value_name = "NAME")]
    pub vlm_model: Option<String>,
    /// What the VLM writes (vlm.preset): tags (booru tags, post-processed like any tagger's),
    /// short (a one-sentence caption; the default) or detailed (a paragraph).
    #[arg(long, value_name = "PRESET")]
    pub preset: Option<String>,
    /// An instruction sent with each image instead of the preset's (vlm.prompt).
    #[arg(long, value_name = "TEXT")]
    pub vlm_prompt: Option<String>,
    /// Longest image side sent to the VLM, pixels; larger images are scaled down, 0 sends the
    /// files as they are (vlm.max_image_side; default 1024).
    #[arg(long, value_name = "PX")]
    pub max_image_side: Option<u32>,
}

fn tag_err(e: TagError) -> CliError {
    match e {
        TagError::Config { .. } | TagError::Format { .. } | TagError::Unsupported { .. } => {
            CliError::usage(e)
        }
        TagError::Io { ref source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            CliError::usage(e)
        }
        other => CliError::runtime(other),
    }
}

/// The config file (or defaults) with the command-line overrides applied.
fn load_config(a: &TagArgs) -> Result<TaggerConfig, CliError> {
    let mut cfg = match &a.config {
        Some(p) => TaggerConfig::from_path(p).map_err(|e| match e {
            TagError::Io { .. } => CliError::usage(format!("--config: {e}")),
            other => CliError::usage(other),
        })?,
        None => TaggerConfig::default(),
    };
    if let Some(m) = &a.model {
        cfg.image.model = Some(m.clone());
    }
    if let Some(m) = a.mode {
        cfg.captions.mode = m;
    }
    if a.dry_run {
        cfg.captions.dry_run = true;
    }
    if let Some(e) = &a.caption_extension {
        cfg.captions.caption_extension = e.clone();
    }
    if let Some(t) = a.threshold {
        if !(0.0..=1.0).contains(&t) {
            return Err(CliError::usage(format!(
                "--threshold {t}: must be a probability in [0, 1]"
            )));
        }
        cfg.image.general_threshold = Some(t);
    }
    if let Some(t) = a.character_threshold {
        if !(0.0..=1.0).contains(&t) {
            return Err(CliError::usage(format!(
                "--character-threshold {t}: must be a probability in [0, 1]"
            )));
        }
        cfg.image.character_threshold = t;
    }
    if a.general_mcut {
        cfg.image.general_mcut = true;
    }
    if a.character_mcut {
        cfg.image.character_mcut = true;
    }
    if let Some(p) = &a.onnxruntime {
        cfg.image.onnxruntime = Some(p.clone());
    }
    let list = |s: &str| -> Vec<String> {
        s.split(',')
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .collect()
    };
    if let Some(u) = &a.undesired_tags {
        cfg.tags.undesired_tags.extend(list(u));
    }
    if a.remove_underscore {
        cfg.tags.replace_underscores = true;
    }
    if a.character_tags_first {
        cfg.tags.character_first = true;
    }
    if let Some(f) = &a.always_first_tags {
        cfg.tags.first_if_found = list(f);
    }
    if let Some(spec) = &a.tag_replacement {
        let r = lora_tagger::tags::parse_kohya_tag_replacement(spec)
            .map_err(|e| CliError::usage(format!("--tag-replacement: {e}")))?;
        cfg.tags.replacements.extend(r);
    }
    if !a.trigger.is_empty() {
        cfg.tags.always_first = a.trigger.clone();
    }
    if let Some(n) = a.max_tags {
        // 0 = no limit (WD14 taggers write every tag above the thresholds)
        cfg.tags.max_tags = (n > 0).then_some(n);
    }
    if let Some(u) = &a.vlm {
        cfg.vlm.base_url = Some(u.clone());
    }
    if let Some(m) = &a.vlm_model {
        cfg.vlm.model = Some(m.clone());
    }
    if let Some(p) = &a.preset {
        cfg.vlm.preset = Some(
            lora_tagger::llm::vlm::VlmPreset::parse(p)
                .map_err(|e| CliError::usage(format!("--preset: {e}")))?,
        );
    }
    if let Some(p) = &a.vlm_prompt {
        cfg.vlm.prompt = Some(p.clone());
    }
    if let Some(n) = a.max_image_side {
        cfg.vlm.max_image_side = Some(n);
    }
    let vlm_only = [
        (a.vlm_model.is_some(), "--vlm-model"),
        (a.preset.is_some(), "--preset"),
        (a.vlm_prompt.is_some(), "--vlm-prompt"),
        (a.max_image_side.is_some(), "--max-image-side"),
    ];
    if cfg.vlm.base_url.is_none()
        && let Some((_, flag)) = vlm_only.iter().find(|(given, _)| *given)
    {
        return Err(CliError::usage(format!(
            "{flag} sets up the VLM captioner, but no server is given: add --vlm URL (or \
             vlm.base_url in --config)"
        )));
    }
    Ok(cfg)
}

/// The folders the project's assets (what `cargo xtask setup` fills) are looked for in, in
/// order: `$LORA_SDK_ASSETS` (`cargo run` sets it through `.cargo/config.toml`), `assets` in the
/// current folder, then `assets` in the executable's folder and the two above it (a
/// `target/debug/lora-train` run from anywhere finds the workspace's `assets/`).
fn asset_roots() -> Vec<PathBuf> {
    let mut roots = Vec::new();
    if let Some(a) = std::env::var_os("LORA_SDK_ASSETS") {
        roots.push(PathBuf::from(a));
    }
    roots.push(
        std::env::current_dir()
            .map(|d| d.join("assets"))
            .unwrap_or_else(|_| PathBuf::from("assets")),
    );
    if let Ok(exe) = std::env::current_exe() {
        roots.extend(exe.ancestors().skip(1).take(3).map(|d| d.join("assets")));
    }
    let mut seen = std::collections::HashSet::new();
    roots.retain(|r| seen.insert(r.clone()));
    roots
}

/// The first `<root>/<rel>` over [`asset_roots`] for which `found` holds, else every path looked at.
fn find_asset(rel: &Path, found: impl Fn(&Path) -> bool) -> Result<PathBuf, Vec<PathBuf>> {
    let looked: Vec<PathBuf> = asset_roots().iter().map(|r| r.join(rel)).collect();
    match looked.iter().find(|p| found(p)) {
        Some(p) => Ok(p.clone()),
        None => Err(looked),
    }
}

/// The default image model folder (`mobilenet_v2/` of the assets), or a usage error that says
/// where it looked and how to give a model.
fn default_image_model() -> Result<PathBuf, CliError> {
    find_asset(Path::new("mobilenet_v2"), |p| {
        p.join("model.safetensors").is_file()
    })
    .map_err(|looked| {
        CliError::usage(format!(
            "no image model: --model is not given and the default MobileNetV2 \
             (mobilenet_v2/model.safetensors) is in none of: {}. Pass --model DIR (a folder with \
             model.safetensors + selected_tags.csv), set image.model in --config, or set \
             LORA_SDK_ASSETS to the assets folder `cargo xtask setup` fills",
            looked
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })
}

/// Runs `tag`.
pub fn run(a: &TagArgs) -> Result<i32, CliError> {
    let mut cfg = load_config(a)?;
    if a.images.is_some() && cfg.image.model.is_none() && cfg.vlm.base_url.is_none() {
        cfg.image.model = Some(default_image_model()?);
    }
    // The default in-process LLM is found the same way; when it is in none of the places, the
    // tagger's own error (with the `llm` settings hint below) says so.
    if a.descriptions.is_some()
        && cfg.llm.model_path.is_none()
        && matches!(cfg.llm.backend, None | Some(LlmBackend::Local))
        && let Ok(p) = find_asset(
            &Path::new("models").join(lora_tagger::llm::local::DEFAULT_MODEL_FILE),
            Path::is_file,
        )
    {
        cfg.llm.model_path = Some(p);
    }
    if a.descriptions.is_some() {
        let image_only = [
            (a.vlm.is_some(), "--vlm"),
            (a.vlm_model.is_some(), "--vlm-model"),
            (a.preset.is_some(), "--preset"),
            (a.vlm_prompt.is_some(), "--vlm-prompt"),
            (a.max_image_side.is_some(), "--max-image-side"),
            (a.gpu.is_some(), "--gpu"),
            (a.budget.is_some(), "--budget"),
        ];
        if let Some((_, flag)) = image_only.iter().find(|(given, _)| *given) {
            return Err(CliError::usage(format!(
                "{flag} applies to --images (the image tagger or the VLM captioner), not to \
                 --descriptions; the LLM for descriptions is set in the `llm` section of --config"
            )));
        }
    }
    let budget = match (&a.gpu, &a.budget) {
        (Some(g), _) => {
            Some(lora_memory::Budget::gpu(g).map_err(|e| CliError::usage(format!("--gpu: {e}")))?)
        }
        (None, Some(b)) => Some(
            lora_memory::Budget::parse(b).map_err(|e| CliError::usage(format!("--budget: {e}")))?,
        ),
        (None, None) => None,
    };
    if let Some(dir) = &a.images {
        run_images(dir, &cfg, budget)
    } else if let Some(file) = &a.descriptions {
        run_descriptions(file, a.out.as_deref(), &cfg)
    } else {
        Err(CliError::usage("give --images DIR or --descriptions FILE"))
    }
}

/// The batch the image tagger plans in `budget` (this machine's free memory when `None`), and,
/// in a dry run, what the fixed table of the LLM-tagging guides would pick for the same card.
fn print_batch_plan(tagger: &ImageTagger, budget: Option<&lora_memory::Budget>, dry_run: bool) {
    use lora_memory::inference::fixed_table_batch;
    let weights = tagger.memory().weights;
    let (bytes, what) = match budget {
        Some(b) => (b.bytes, b.amount()),
        None => {
            let device = tagger.device();
            // measured with the model loaded: its weights were free before
            let free = lora_tagger::batch::ResourceSnapshot::take(device)
                .free_for(device, None)
                .unwrap_or(0);
            let bytes = lora_memory::Bytes(free + weights.0);
            let on = match device {
                tch::Device::Cuda(i) => format!("cuda:{i}"),
                _ => "the CPU (available RAM)".to_string(),
            };
            (bytes, format!("{bytes} free on {on}"))
        }
    };
    // a GPU preset or a budget written for CUDA ("cuda: 6GB") plans with the CUDA context;
    // a plain size, for the device the tagger runs on
    use lora_memory::BudgetSource;
    let device = match budget.map(|b| &b.source) {
        Some(BudgetSource::Gpu { .. } | BudgetSource::NvmlFree { .. }) => tch::Device::Cuda(0),
        Some(BudgetSource::Size { input, .. })
            if input.trim().to_ascii_lowercase().starts_with("cuda") =>
        {
            tch::Device::Cuda(0)
        }
        _ => tagger.device(),
    };
    let plan = tagger.plan_batch(bytes, device);
    eprintln!("batch plan for {what}: {plan}");
    if dry_run {
        eprintln!(
            "  the fixed table (>= 12 GB: 8, 8-12 GB: 4, 6-8 GB: 2, else 1) would pick {} for \
             {:.1} GB, whatever the model and input size",
            fixed_table_batch(bytes),
            bytes.0 as f64 / 1e9
        );
    }
}

fn run_images(
    dir: &Path,
    cfg: &TaggerConfig,
    budget: Option<lora_memory::Budget>,
) -> Result<i32, CliError> {
    if !dir.is_dir() {
        return Err(CliError::usage(format!(
            "--images {}: {}",
            dir.display(),
            if dir.exists() {
                "not a folder (give the folder that holds the images)"
            } else {
                "no such folder"
            }
        )));
    }
    let images = lora_tagger::run::list_images(dir).map_err(tag_err)?;
    // name every image left out, in the words training uses
    for (path, why) in lora_tagger::run::list_unsupported_images(dir).map_err(tag_err)? {
        eprintln!("warning: {}: {why}", path.display());
    }
    if images.is_empty() {
        // a kohya dataset folder: the images are in its `N_concept/` subfolders
        let mut subs: Vec<String> = std::fs::read_dir(dir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| {
                        p.is_dir() && lora_tagger::run::list_images(p).is_ok_and(|v| !v.is_empty())
                    })
                    .map(|p| p.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        subs.sort();
        let hint = if subs.is_empty() {
            String::new()
        } else {
            format!(
                "; the images are in its subfolders — tag each: {}",
                subs.iter()
                    .map(|s| format!("--images {s}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        };
        return Err(CliError::usage(format!(
            "--images {}: no images directly in it (looked for {}){hint}",
            dir.display(),
            lora_tagger::run::IMAGE_EXTENSIONS.join(", ")
        )));
    }
    if cfg.vlm.base_url.is_some() {
        return run_vlm_images(&images, cfg);
    }
    let t_load = Instant::now();
    let mut inner = ImageTagger::from_config(cfg).map_err(tag_err)?;
    inner.set_callback(Some(Box::new(|e| eprintln!("  {e}"))));
    eprintln!(
        "model {}, {}, {}, loaded in {:.2} s; {} images",
        inner.model_id(),
        inner.runs_on(),
        inner.preprocess(),
        t_load.elapsed().as_secs_f64(),
        images.len()
    );
    eprintln!(
        "general-tag threshold {} ({})",
        inner.general_threshold(),
        match (cfg.image.general_threshold.is_some(), inner.multi_label()) {
            (true, _) => "image.general_threshold / --threshold",
            (false, true) =>
                "the default for multi-label sigmoid models such as WD14; --threshold to change",
            (false, false) =>
                "the default for single-label softmax classifiers such as ImageNet MobileNetV2; --threshold to change",
        }
    );
    print_batch_plan(&inner, budget.as_ref(), cfg.captions.dry_run);
    let settings = inner.settings().clone();
    let cap = cfg.memory_management.cache_size;
    let mut tagger = match &cfg.memory_management.cache_file {
        Some(p) => CachedTagger::persisted(inner, p.clone(), cap, &settings).map_err(tag_err)?,
        None => CachedTagger::new(inner, TagCache::new(cap), &settings),
    };
    let writer = CaptionWriter::new(cfg.captions.clone());
    let mut progress = TagProgress::new(images.len(), "images");
    let run = lora_tagger::run::tag_to_captions_with_progress(
        &mut tagger,
        &images,
        &cfg.tags,
        &writer,
        cfg.generation_settings.max_batch_size,
        &mut |p| progress.update(p),
    )
    .map_err(tag_err)?;
    progress.finish();
    tagger.save().map_err(tag_err)?;
    super::outln(&run.report)?;
    let stats = tagger.cache().stats();
    let mb = tagger
        .inner_mut()
        .last_micro_batch()
        .map(|(s, l, h)| format!(", micro-batch {s} → {l} ({h} halvings)"))
        .unwrap_or_default();
    finish_folder(
        &run,
        images.len(),
        &format!("{mb}; cache {} hits / {} misses", stats.hits, stats.misses),
    )
}

/// `tag --images` with a `vlm` server: captions (or, with preset `tags`, tags) from the
/// vision-language model, written like the image tagger's.
fn run_vlm_images(images: &[PathBuf], cfg: &TaggerConfig) -> Result<i32, CliError> {
    let mut vlm = lora_tagger::llm::vlm::from_config(cfg).map_err(tag_err)?;
    let preset = vlm.preset();
    eprintln!(
        "VLM {vlm}: {} images, {} requests at a time",
        images.len(),
        cfg.vlm.concurrency.unwrap_or(4)
    );
    let writer = CaptionWriter::new(cfg.captions.clone());
    let mut progress = TagProgress::new(images.len(), "images");
    // a chunk per round of requests keeps the bar moving
    let chunk = 4 * cfg.vlm.concurrency.unwrap_or(4).max(1);
    let run = if preset.is_tags() {
        // what changes the replies besides the model id: prompt, max_tokens, image side
        let settings = &cfg.vlm;
        let cap = cfg.memory_management.cache_size;
        let mut tagger = match &cfg.memory_management.cache_file {
            Some(p) => CachedTagger::persisted(vlm, p.clone(), cap, settings).map_err(tag_err)?,
            None => CachedTagger::new(vlm, TagCache::new(cap), settings),
        };
        let run = lora_tagger::run::tag_to_captions_with_progress(
            &mut tagger,
            images,
            &cfg.tags,
            &writer,
            chunk,
            &mut |p| progress.update(p),
        )
        .map_err(tag_err)?;
        tagger.save().map_err(tag_err)?;
        run
    } else {
        lora_tagger::run::caption_to_files_with_progress(
            &mut vlm,
            images,
            &cfg.tags,
            &writer,
            chunk,
            &mut |p| progress.update(p),
        )
        .map_err(tag_err)?
    };
    progress.finish();
    super::outln(&run.report)?;
    finish_folder(&run, images.len(), &format!(", preset {preset}"))
}

/// The summary line of a folder run, then the images that failed (unreadable, undecodable,
/// caption not writable) with the reason: not counted as tagged, named again after the summary.
fn finish_folder(
    run: &lora_tagger::run::FolderRun,
    total: usize,
    detail: &str,
) -> Result<i32, CliError> {
    let failed: Vec<(&Path, &str)> = run
        .report
        .entries
        .iter()
        .filter_map(|e| match &e.action {
            CaptionAction::Fail { error } => Some((e.image.as_path(), error.as_str())),
            _ => None,
        })
        .collect();
    let tagged = run.tagged.saturating_sub(failed.len());
    super::outln(format_args!(
        "tagged {tagged} images in {:.2} s: {:.2} images/s{detail}{}",
        run.tagging_s,
        if run.tagging_s > 0.0 {
            tagged as f64 / run.tagging_s
        } else {
            0.0
        },
        if failed.is_empty() {
            String::new()
        } else {
            format!("; {} failed", failed.len())
        }
    ))?;
    if failed.is_empty() {
        return Ok(EXIT_OK);
    }
    let mut msg = format!(
        "{} of {} images failed (no caption written for them):",
        failed.len(),
        total
    );
    for (img, why) in &failed {
        msg.push_str(&format!("\n  {}: {why}", img.display()));
    }
    eprintln!("{msg}");
    Ok(EXIT_RUNTIME)
}

/// One description per line; JSONL lines take "description", "text" or "caption".
fn read_descriptions(file: &Path) -> Result<Vec<String>, CliError> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| CliError::usage(format!("--descriptions {}: {e}", file.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.trim();
        if l.is_empty() {
            continue;
        }
        if l.starts_with('{') {
            let v: serde_json::Value = serde_json::from_str(l).map_err(|e| {
                CliError::usage(format!("{}:{}: invalid JSON: {e}", file.display(), i + 1))
            })?;
            let d = ["description", "text", "caption"]
                .iter()
                .find_map(|k| v.get(*k).and_then(|x| x.as_str()))
                .ok_or_else(|| {
                    CliError::usage(format!(
                        "{}:{}: no \"description\", \"text\" or \"caption\" string field",
                        file.display(),
                        i + 1
                    ))
                })?;
            out.push(d.to_string());
        } else {
            out.push(l.to_string());
        }
    }
    if out.is_empty() {
        return Err(CliError::usage(format!(
            "--descriptions {}: no descriptions",
            file.display()
        )));
    }
    Ok(out)
}

fn run_descriptions(file: &Path, out: Option<&Path>, cfg: &TaggerConfig) -> Result<i32, CliError> {
    let descriptions = read_descriptions(file)?;
    let inner = lora_tagger::llm::from_config(cfg).map_err(|e| match &e {
        // a device this machine lacks: the message says what was asked, what was found and
        // how to run on the CPU
        lora_tagger::Error::Config { key, .. } if key == "model_settings.device" => {
            CliError::usage(e.to_string())
        }
        _ => CliError::usage(format!(
            "{e}\n(an LLM backend must be configured for --descriptions: the `llm` section of \
             --config, e.g. `llm: {{backend: http, base_url: http://127.0.0.1:8080/v1, model: NAME}}`, \
             or the default local SmolLM2 from `cargo xtask setup`)"
        )),
    })?;
    let mut tagger = CachedTagger::new(
        inner,
        TagCache::new(cfg.memory_management.cache_size),
        &cfg.llm,
    );
    if let Some(plan) = descriptions
        .first()
        .and_then(|d| tagger.batch_plan(d, None))
    {
        eprintln!("batch plan for the free memory: {plan}");
    }
    let t = Instant::now();
    // In chunks, so progress shows while the model works: a bar on a terminal, a plain line per
    // chunk otherwise (logs, CI), as `train` does.
    let chunk = cfg
        .generation_settings
        .max_batch_size
        .max(cfg.llm.concurrency.unwrap_or(1))
        .max(1);
    let mut progress = TagProgress::new(descriptions.len(), "descriptions");
    let mut results = Vec::with_capacity(descriptions.len());
    for part in descriptions.chunks(chunk) {
        results.extend(tagger.tag_descriptions(part).map_err(tag_err)?);
        progress.update(lora_tagger::run::Progress {
            done: results.len(),
            total: descriptions.len(),
            elapsed_s: t.elapsed().as_secs_f64(),
        });
    }
    progress.finish();
    let secs = t.elapsed().as_secs_f64();
    let mut lines = String::new();
    let mut failed = 0;
    for (d, r) in descriptions.iter().zip(&results) {
        let v = match r {
            Ok(tags) => {
                let list = cfg.tags.apply(tags);
                serde_json::json!({
                    "description": d,
                    "tags": list,
                    "caption": lora_tagger::tags::join_tags(&list),
                })
            }
            Err(e) => {
                failed += 1;
                serde_json::json!({ "description": d, "error": e.to_string() })
            }
        };
        lines.push_str(&v.to_string());
        lines.push('\n');
    }
    match out {
        Some(p) => lora_tagger::caption::write_atomic(p, lines.as_bytes()).map_err(tag_err)?,
        None => {
            let mut so = std::io::stdout().lock();
            so.write_all(lines.as_bytes())
                .and_then(|()| so.flush())
                .map_err(super::stdout_failed)?;
        }
    }
    eprintln!(
        "tagged {} descriptions with {} in {:.2} s: {:.2} descriptions/s; {} failed",
        descriptions.len(),
        tagger.model_id(),
        secs,
        descriptions.len() as f64 / secs.max(1e-9),
        failed
    );
    Ok(if failed > 0 { EXIT_RUNTIME } else { EXIT_OK })
}

/// Tagging progress: on a terminal a bar with the rate and an ETA; otherwise (logs, CI) a plain
/// line at most every 10 s and one at the end, as `train` reports.
struct TagProgress {
    bar: Option<indicatif::ProgressBar>,
    what: &'static str,
    last_line: Option<Instant>,
}

impl TagProgress {
    /// Seconds between plain progress lines when stderr is not a terminal.
    const LINE_EVERY_S: f64 = 10.0;

    fn new(total: usize, what: &'static str) -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let b = indicatif::ProgressBar::new(total as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(&format!(
                    "{{bar:30}} {{pos}}/{{len}} {what}  {{per_sec}}  eta {{eta}}"
                ))
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
            );
            b
        });
        TagProgress {
            bar,
            what,
            last_line: None,
        }
    }

    fn update(&mut self, p: lora_tagger::run::Progress) {
        if let Some(b) = &self.bar {
            b.set_length(p.total as u64);
            b.set_position(p.done as u64);
            return;
        }
        let due = self
            .last_line
            .is_none_or(|t| t.elapsed().as_secs_f64() >= Self::LINE_EVERY_S);
        if due || p.done == p.total {
            self.last_line = Some(Instant::now());
            eprintln!("{}", progress_line(&p, self.what));
        }
    }

    fn finish(self) {
        if let Some(b) = self.bar {
            b.finish_and_clear();
        }
    }
}

/// `tagged 12/40 images (3.10 images/s, eta 9 s)`.
fn progress_line(p: &lora_tagger::run::Progress, what: &str) -> String {
    let rate = p.done as f64 / p.elapsed_s.max(1e-9);
    let eta = match p.eta_s() {
        Some(s) if p.done < p.total => format!(", eta {:.0} s", s.ceil()),
        _ => String::new(),
    };
    format!(
        "tagged {}/{} {what} ({rate:.2} {what}/s{eta})",
        p.done, p.total
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use lora_tagger::run::Progress;

    #[test]
    fn a_progress_line_has_the_rate_and_an_eta_until_the_end() {
        let p = Progress {
            done: 12,
            total: 40,
            elapsed_s: 4.0,
        };
        // 3 images/s; 28 left → 9.33 s, rounded up
        assert_eq!(
            progress_line(&p, "images"),
            "tagged 12/40 images (3.00 images/s, eta 10 s)"
        );
        let end = Progress { done: 40, ..p };
        assert_eq!(
            progress_line(&end, "images"),
            "tagged 40/40 images (10.00 images/s)"
        );
        assert_eq!(Progress { done: 0, ..p }.eta_s(), None);
    }
}
