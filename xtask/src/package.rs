//! The crates as others get them: the MSRV claim, `cargo package`, a docs.rs-style build of each
//! packaged crate, and apps outside the repository built against the packaged crates
//! (`xtask/consumer/README.md`).

use crate::util;
use crate::{Env, cargo};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Workspace members that are not published (`publish = false`) are left out by `cargo package`
/// itself; these are the packages it must produce, in dependency order.
const PUBLISHED: [&str; 8] = [
    "lora-build",
    "lora-memory",
    "lora-core",
    "lora-data",
    "lora-models",
    "lora-train",
    "lora-tagger",
    "lora-train-cli",
];

/// The apps of `xtask/consumer/`.
const APPS: [&str; 2] = ["plan-app", "train-app"];

fn metadata(root: &Path) -> Result<serde_json::Value> {
    let out = cargo()
        .current_dir(root)
        .args(["metadata", "--format-version", "1", "--locked"])
        .output()
        .context("could not run cargo metadata")?;
    if !out.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// `major.minor.patch` as numbers, missing parts 0: `"1.88"` and `"1.88.0"` compare equal.
fn version_tuple(v: &str) -> [u64; 3] {
    let mut out = [0; 3];
    for (slot, part) in out.iter_mut().zip(v.split('.')) {
        *slot = part.trim().parse().unwrap_or(0);
    }
    out
}

/// The workspace's `rust-version` holds: no dependency declares a newer one, and clippy's
/// `incompatible_msrv` finds no std item stabilised after it.
pub fn msrv(root: &Path, env: &Env) -> Result<()> {
    let t = Instant::now();
    let meta = metadata(root)?;
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m.as_str()).collect())
        .unwrap_or_default();
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    let ours = packages
        .iter()
        .find(|p| p["name"] == "lora-core")
        .and_then(|p| p["rust_version"].as_str())
        .context("lora-core has no rust-version")?
        .to_string();
    let mut newer = Vec::new();
    for p in &packages {
        let id = p["id"].as_str().unwrap_or("");
        let rv = p["rust_version"].as_str().unwrap_or("0");
        if members.contains(&id) {
            if rv != ours {
                newer.push(format!("{} says rust-version {rv}", p["name"]));
            }
        } else if version_tuple(rv) > version_tuple(&ours) {
            newer.push(format!("{} {} needs Rust {rv}", p["name"], p["version"]));
        }
    }
    if !newer.is_empty() {
        bail!(
            "the workspace claims rust-version {ours}, but: {}; raise `rust-version` in Cargo.toml",
            newer.join("; ")
        );
    }
    eprintln!("== msrv: {ours}: every dependency builds with it; clippy::incompatible_msrv");
    let mut clippy = cargo();
    clippy.current_dir(root).args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--quiet",
        "--",
        "-A",
        "clippy::all",
        "-D",
        "clippy::incompatible_msrv",
    ]);
    crate::configure(&mut clippy, env);
    util::run(
        &mut clippy,
        "clippy's incompatible_msrv check (is clippy installed? `rustup component add clippy`)",
    )?;
    eprintln!("== msrv: ok in {:.0} s", t.elapsed().as_secs_f64());
    Ok(())
}

/// One packaged crate, unpacked.
struct Packed {
    name: String,
    dir: PathBuf,
    crate_bytes: u64,
    files: usize,
    unpacked_bytes: u64,
}

/// `cargo package` of every published crate, each `.crate` unpacked into `<work>/crates/` (left
/// as it is when the `.crate` did not change, so warm runs rebuild nothing).
fn package_all(root: &Path, work: &Path, version: &str) -> Result<Vec<Packed>> {
    let mut cmd = cargo();
    cmd.current_dir(root).args([
        "package",
        "--workspace",
        "--exclude",
        "lora-examples",
        "--exclude",
        "lora-benches",
        "--exclude",
        "xtask",
        "--no-verify",
        "--allow-dirty",
        "--quiet",
    ]);
    util::run(&mut cmd, "cargo package --workspace")?;
    let crates = work.join("crates");
    std::fs::create_dir_all(&crates)?;
    let mut out = Vec::new();
    for name in PUBLISHED {
        let file = root
            .join("target/package")
            .join(format!("{name}-{version}.crate"));
        if !file.is_file() {
            bail!(
                "cargo package wrote no {}: is {name} still published?",
                file.display()
            );
        }
        let sum = util::sha256_file(&file)?;
        let dir = crates.join(format!("{name}-{version}"));
        let stamp = crates.join(format!("{name}-{version}.sha256"));
        if std::fs::read_to_string(&stamp).ok().as_deref() != Some(sum.as_str()) {
            if dir.exists() {
                std::fs::remove_dir_all(&dir)?;
            }
            let gz = flate2::read::GzDecoder::new(std::fs::File::open(&file)?);
            let mut archive = tar::Archive::new(gz);
            // `.crate` files carry fixed mtimes; cargo would take the new sources for the old
            archive.set_preserve_mtime(false);
            archive
                .unpack(&crates)
                .with_context(|| format!("unpacking {}", file.display()))?;
            std::fs::write(&stamp, &sum)?;
        }
        let (unpacked_bytes, files) = util::tree_size(&dir);
        out.push(Packed {
            name: name.to_string(),
            dir,
            crate_bytes: std::fs::metadata(&file)?.len(),
            files: files as usize,
            unpacked_bytes,
        });
    }
    Ok(out)
}

/// Writes `path` only when its content changes (cargo's fingerprints see mtimes).
fn write_if_changed(path: &Path, text: &str) -> Result<()> {
    if std::fs::read_to_string(path).ok().as_deref() == Some(text) {
        return Ok(());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let dst = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &dst)?;
        } else {
            let text = std::fs::read_to_string(entry.path())
                .with_context(|| format!("reading {}", entry.path().display()))?;
            write_if_changed(&dst, &text)?;
        }
    }
    Ok(())
}

/// The consumer workspace: the apps, plus the unpacked crates as members (so each can be
/// documented with its own features), every `lora-*` requirement patched to its unpacked crate,
/// the repository's profiles (so registry dependencies built by the main suite are reused) and
/// its lockfile (the same dependency versions).
fn write_workspace(root: &Path, work: &Path, packed: &[Packed]) -> Result<()> {
    for app in APPS {
        copy_tree(&root.join("xtask/consumer").join(app), &work.join(app))?;
    }
    let manifest: toml::Table = std::fs::read_to_string(root.join("Cargo.toml"))?.parse()?;
    let mut members: Vec<String> = APPS.iter().map(|a| a.to_string()).collect();
    let mut patch = toml::Table::new();
    for p in packed {
        let rel = p
            .dir
            .strip_prefix(work)
            .unwrap_or(&p.dir)
            .display()
            .to_string();
        members.push(rel.clone());
        let mut dep = toml::Table::new();
        dep.insert("path".into(), rel.into());
        patch.insert(p.name.clone(), dep.into());
    }
    let mut ws = toml::Table::new();
    ws.insert("resolver".into(), "3".into());
    ws.insert(
        "members".into(),
        toml::Value::Array(members.into_iter().map(Into::into).collect()),
    );
    let mut doc = toml::Table::new();
    doc.insert("workspace".into(), ws.into());
    let mut patches = toml::Table::new();
    patches.insert("crates-io".into(), patch.into());
    doc.insert("patch".into(), patches.into());
    if let Some(profile) = manifest.get("profile") {
        doc.insert("profile".into(), profile.clone());
    }
    let text = format!(
        "# Written by `cargo xtask consumer`: apps that use the packaged lora-sdk crates.\n{}",
        toml::to_string(&doc)?
    );
    write_if_changed(&work.join("Cargo.toml"), &text)?;
    let lock = std::fs::read_to_string(root.join("Cargo.lock"))?;
    if !work.join("Cargo.lock").is_file() {
        write_if_changed(&work.join("Cargo.lock"), &lock)?;
    }
    Ok(())
}

/// A cargo command in the consumer workspace with none of the repository's environment: no
/// `[env]` of its `.cargo/config.toml` (the workspace sits outside it), no `LD_LIBRARY_PATH`.
fn consumer_cargo(work: &Path, target: &Path) -> Command {
    let mut cmd = cargo();
    cmd.current_dir(work)
        .env("CARGO_TARGET_DIR", target)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBTORCH")
        .env_remove("LIBTORCH_USE_PYTORCH")
        .env_remove("LORA_SDK_ASSETS")
        .env_remove("RUSTDOCFLAGS")
        .env_remove("RUSTFLAGS");
    cmd
}

/// The features docs.rs builds a package with (`[package.metadata.docs.rs] features`).
fn docs_rs_features(manifest: &Path) -> Result<Vec<String>> {
    let t: toml::Table = std::fs::read_to_string(manifest)?.parse()?;
    Ok(t.get("package")
        .and_then(|p| p.get("metadata"))
        .and_then(|m| m.get("docs"))
        .and_then(|d| d.get("rs"))
        .and_then(|r| r.get("features"))
        .and_then(|f| f.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default())
}

/// Packages the workspace, documents each packaged crate as docs.rs would, and builds and runs
/// the consumer apps against the packaged crates.
pub fn consumer(root: &Path, env: &Env) -> Result<()> {
    let t = Instant::now();
    let meta = metadata(root)?;
    let version = meta["packages"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["name"] == "lora-train"))
        .and_then(|p| p["version"].as_str())
        .context("no lora-train in cargo metadata")?
        .to_string();
    // Outside the repository: its .cargo/config.toml (LIBTORCH, LD_LIBRARY_PATH) must not apply.
    let work = std::env::temp_dir().join(format!(
        "lora-sdk-consumer-{}",
        &hex::encode(<sha2::Sha256 as sha2::Digest>::digest(
            root.display().to_string()
        ))[..12]
    ));
    std::fs::create_dir_all(&work)?;
    eprintln!("== consumer: cargo package into {}", work.display());
    let packed = package_all(root, &work, &version)?;
    eprintln!(
        "   {:<16} {:>6} {:>12} {:>10}",
        "crate", "files", "unpacked", ".crate"
    );
    for p in &packed {
        eprintln!(
            "   {:<16} {:>6} {:>12} {:>10}",
            p.name,
            p.files,
            util::human(p.unpacked_bytes),
            util::human(p.crate_bytes)
        );
    }
    write_workspace(root, &work, &packed)?;

    // docs.rs: no libtorch, no network, nightly rustdoc features through RUSTC_BOOTSTRAP.
    let t_docs = Instant::now();
    let docs_target = root.join("target/docsrs");
    // The offline builds below need every package of the lock file, including the optional ones
    // of non-default features (NVML's libloading) that no build of the repository downloaded on
    // a fresh machine: fetch them first (the registry is reachable; the builds stay offline).
    let mut fetch = consumer_cargo(&work, &docs_target);
    fetch.args(["fetch", "--quiet"]);
    util::run(&mut fetch, "cargo fetch for the packaged crates")?;
    // the binary package has no library to document; it is compiled below
    for p in packed.iter().filter(|p| p.name != "lora-train-cli") {
        let features = docs_rs_features(&p.dir.join("Cargo.toml"))?;
        let mut doc = consumer_cargo(&work, &docs_target);
        doc.args(["doc", "--no-deps", "--offline", "--quiet", "-p", &p.name])
            .env("DOCS_RS", "1")
            .env("RUSTC_BOOTSTRAP", "1")
            .env("RUSTDOCFLAGS", "--cfg docsrs -D warnings");
        if !features.is_empty() {
            doc.arg("--features").arg(features.join(","));
        }
        eprintln!(
            "== consumer: docs.rs build of {} (features: {})",
            p.name,
            if features.is_empty() {
                "default".to_string()
            } else {
                features.join(", ")
            }
        );
        util::run(&mut doc, &format!("the docs.rs-style build of {}", p.name))?;
        let index = docs_target
            .join("doc")
            .join(p.name.replace('-', "_"))
            .join("index.html");
        if !index.is_file() {
            bail!("rustdoc wrote no {}", index.display());
        }
    }
    // doc_cfg: feature-gated items are marked (the recipe modules of lora-train, listed on the
    // page of `lora_train::recipes`)
    let recipes_page = docs_target.join("doc/lora_train/recipes/index.html");
    let page = std::fs::read_to_string(&recipes_page)
        .with_context(|| format!("rustdoc wrote no {}", recipes_page.display()))?;
    if !page.contains("crate feature `llm`") || !page.contains("crate feature `sd`") {
        bail!(
            "{} does not say that `llm` and `sd` need their features: is `#![cfg_attr(docsrs, feature(doc_cfg))]` still in lora-train's lib.rs?",
            recipes_page.display()
        );
    }
    let docs_s = t_docs.elapsed().as_secs_f64();

    // The apps, with libtorch given only as LIBTORCH (what torch-sys reads), run with a bare
    // environment: the rpath from lora-build is all they have.
    let t_apps = Instant::now();
    let target = root.join("target");
    let mut build = consumer_cargo(&work, &target);
    build
        .args(["build", "--offline"])
        .env("LIBTORCH", &env.libtorch)
        .env("LIBTORCH_CXX11_ABI", "1");
    for app in APPS {
        build.args(["-p", app]);
    }
    eprintln!("== consumer: building {}", APPS.join(", "));
    util::run(&mut build, "building the consumer apps")?;
    let mut check = consumer_cargo(&work, &target);
    check
        .args(["check", "--offline", "--quiet", "-p", "lora-train-cli"])
        .env("LIBTORCH", &env.libtorch)
        .env("LIBTORCH_CXX11_ABI", "1");
    eprintln!("== consumer: checking the packaged lora-train-cli");
    util::run(&mut check, "cargo check of the packaged lora-train-cli")?;
    let assets = root.join("assets");
    let scratch = work.join("scratch");
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch)?;
    }
    std::fs::create_dir_all(&scratch)?;
    let bare = |app: &str| {
        let mut cmd = Command::new(target.join("debug").join(app));
        cmd.current_dir(&scratch)
            .env_remove("LD_LIBRARY_PATH")
            .env_remove("LIBTORCH")
            .env("OMP_NUM_THREADS", "2");
        cmd
    };
    eprintln!("== consumer: plan-app (lora-memory alone)");
    util::run(
        bare("plan-app").arg(assets.join("models/SmolLM2-135M-Instruct.Q4_1.gguf")),
        "plan-app",
    )?;
    eprintln!("== consumer: train-app (lora-train, feature llm; no LD_LIBRARY_PATH)");
    util::run(bare("train-app").arg(&assets).arg(&scratch), "train-app")?;
    eprintln!(
        "== consumer: passed in {:.0} s (docs.rs builds {docs_s:.0} s, apps {:.0} s)",
        t.elapsed().as_secs_f64(),
        t_apps.elapsed().as_secs_f64()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::version_tuple;

    #[test]
    fn rust_versions_compare_with_missing_parts_as_zero() {
        assert_eq!(version_tuple("1.88"), version_tuple("1.88.0"));
        assert!(version_tuple("1.88.1") > version_tuple("1.88"));
        assert!(version_tuple("1.92") > version_tuple("1.88.0"));
        assert!(version_tuple("1.9") < version_tuple("1.88"));
    }
}
