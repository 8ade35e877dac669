//! Memory budgets: a size string, a GPU preset, or live free memory (NVML).

use crate::error::{Error, Result};
use crate::units::{Bytes, GIB, MIB, parse_size};
use serde::{Deserialize, Serialize};

/// Where a budget came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// A size string; `assumed` says how an ambiguous unit was read.
    Size {
        /// The text.
        input: String,
        /// Interpretation note, if any.
        assumed: Option<String>,
    },
    /// A GPU preset (total memory of the card).
    Gpu {
        /// Canonical card name.
        name: String,
    },
    /// Free memory of a local card reported by the driver right now (the budget's bytes); what
    /// is not free is held by other processes.
    NvmlFree {
        /// CUDA device index.
        device_index: u32,
        /// The card's name as the driver reports it.
        #[serde(default)]
        name: String,
        /// The card's total memory.
        #[serde(default)]
        total: Bytes,
    },
}

/// A number of bytes a run must fit in, with its origin.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// The budget.
    pub bytes: Bytes,
    /// Its origin.
    pub source: BudgetSource,
}

/// A GPU preset: canonical name, model token, memory in bytes as reported by `nvidia-smi`
/// (total), and whether it is the default variant for its model token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPreset {
    /// Canonical name.
    pub name: &'static str,
    /// Normalized model token (`"3060"`, `"a100"`).
    pub model: &'static str,
    /// Marketing size in GB (as printed on the box; NVIDIA's "GB" are GiB for GDDR cards).
    pub marketed_gb: u32,
    /// Total memory in bytes.
    pub bytes: u64,
    /// Chosen when only the model token is given.
    pub default: bool,
}

const fn gib(n: u64) -> u64 {
    n * GIB
}

const fn mib(n: u64) -> u64 {
    n * MIB
}

/// The GPU table. Consumer cards: marketed size in GiB; data-centre cards: `nvidia-smi` totals
/// (e.g. A100 80GB = 81,920 MiB, H100 80GB = 81,559 MiB, H200 = 143,771 MiB, T4 = 15,360 MiB,
/// L40S = 46,068 MiB).
pub const GPU_PRESETS: &[GpuPreset] = &[
    GpuPreset {
        name: "GTX 1060 6GB",
        model: "1060",
        marketed_gb: 6,
        bytes: gib(6),
        default: true,
    },
    GpuPreset {
        name: "GTX 1070 8GB",
        model: "1070",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "GTX 1080 8GB",
        model: "1080",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "GTX 1080 Ti 11GB",
        model: "1080ti",
        marketed_gb: 11,
        bytes: gib(11),
        default: true,
    },
    GpuPreset {
        name: "RTX 2060 6GB",
        model: "2060",
        marketed_gb: 6,
        bytes: gib(6),
        default: true,
    },
    GpuPreset {
        name: "RTX 2060 12GB",
        model: "2060",
        marketed_gb: 12,
        bytes: gib(12),
        default: false,
    },
    GpuPreset {
        name: "RTX 2070 8GB",
        model: "2070",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 2080 8GB",
        model: "2080",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 2080 Ti 11GB",
        model: "2080ti",
        marketed_gb: 11,
        bytes: gib(11),
        default: true,
    },
    GpuPreset {
        name: "RTX 3050 8GB",
        model: "3050",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 3060 12GB",
        model: "3060",
        marketed_gb: 12,
        bytes: gib(12),
        default: true,
    },
    GpuPreset {
        name: "RTX 3060 8GB",
        model: "3060",
        marketed_gb: 8,
        bytes: gib(8),
        default: false,
    },
    GpuPreset {
        name: "RTX 3060 Ti 8GB",
        model: "3060ti",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 3070 8GB",
        model: "3070",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 3070 Ti 8GB",
        model: "3070ti",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 3080 10GB",
        model: "3080",
        marketed_gb: 10,
        bytes: gib(10),
        default: true,
    },
    GpuPreset {
        name: "RTX 3080 12GB",
        model: "3080",
        marketed_gb: 12,
        bytes: gib(12),
        default: false,
    },
    GpuPreset {
        name: "RTX 3080 Ti 12GB",
        model: "3080ti",
        marketed_gb: 12,
        bytes: gib(12),
        default: true,
    },
    GpuPreset {
        name: "RTX 3090 24GB",
        model: "3090",
        marketed_gb: 24,
        bytes: gib(24),
        default: true,
    },
    GpuPreset {
        name: "RTX 3090 Ti 24GB",
        model: "3090ti",
        marketed_gb: 24,
        bytes: gib(24),
        default: true,
    },
    GpuPreset {
        name: "RTX 4060 8GB",
        model: "4060",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 4060 Ti 8GB",
        model: "4060ti",
        marketed_gb: 8,
        bytes: gib(8),
        default: true,
    },
    GpuPreset {
        name: "RTX 4060 Ti 16GB",
        model: "4060ti",
        marketed_gb: 16,
        bytes: gib(16),
        default: false,
    },
    GpuPreset {
        name: "RTX 4070 12GB",
        model: "4070",
        marketed_gb: 12,
        bytes: gib(12),
        default: true,
    },
    GpuPreset {
        name: "RTX 4070 Ti 12GB",
        model: "4070ti",
        marketed_gb: 12,
        bytes: gib(12),
        default: true,
    },
    GpuPreset {
        name: "RTX 4070 Ti Super 16GB",
        model: "4070tisuper",
        marketed_gb: 16,
        bytes: gib(16),
        default: true,
    },
    GpuPreset {
        name: "RTX 4080 16GB",
        model: "4080",
        marketed_gb: 16,
        bytes: gib(16),
        default: true,
    },
    GpuPreset {
        name: "RTX 4090 24GB",
        model: "4090",
        marketed_gb: 24,
        bytes: gib(24),
        default: true,
    },
    GpuPreset {
        name: "RTX 5080 16GB",
        model: "5080",
        marketed_gb: 16,
        bytes: gib(16),
        default: true,
    },
    GpuPreset {
        name: "RTX 5090 32GB",
        model: "5090",
        marketed_gb: 32,
        bytes: gib(32),
        default: true,
    },
    GpuPreset {
        name: "RTX A6000 48GB",
        model: "a6000",
        marketed_gb: 48,
        bytes: mib(49_140),
        default: true,
    },
    GpuPreset {
        name: "RTX 6000 Ada 48GB",
        model: "6000ada",
        marketed_gb: 48,
        bytes: mib(49_140),
        default: true,
    },
    GpuPreset {
        name: "T4 16GB",
        model: "t4",
        marketed_gb: 16,
        bytes: mib(15_360),
        default: true,
    },
    GpuPreset {
        name: "V100 16GB",
        model: "v100",
        marketed_gb: 16,
        bytes: mib(16_384),
        default: true,
    },
    GpuPreset {
        name: "V100 32GB",
        model: "v100",
        marketed_gb: 32,
        bytes: mib(32_768),
        default: false,
    },
    GpuPreset {
        name: "A10 24GB",
        model: "a10",
        marketed_gb: 24,
        bytes: mib(23_028),
        default: true,
    },
    GpuPreset {
        name: "A10G 24GB",
        model: "a10g",
        marketed_gb: 24,
        bytes: mib(23_028),
        default: true,
    },
    GpuPreset {
        name: "L4 24GB",
        model: "l4",
        marketed_gb: 24,
        bytes: mib(23_034),
        default: true,
    },
    GpuPreset {
        name: "L40S 48GB",
        model: "l40s",
        marketed_gb: 48,
        bytes: mib(46_068),
        default: true,
    },
    GpuPreset {
        name: "A100 40GB",
        model: "a100",
        marketed_gb: 40,
        bytes: mib(40_960),
        default: true,
    },
    GpuPreset {
        name: "A100 80GB",
        model: "a100",
        marketed_gb: 80,
        bytes: mib(81_920),
        default: false,
    },
    GpuPreset {
        name: "H100 80GB",
        model: "h100",
        marketed_gb: 80,
        bytes: mib(81_559),
        default: true,
    },
    GpuPreset {
        name: "H200 141GB",
        model: "h200",
        marketed_gb: 141,
        bytes: mib(143_771),
        default: true,
    },
];

const NOISE: &[&str] = &[
    "nvidia", "geforce", "tesla", "quadro", "rtx", "gtx", "pcie", "sxm5", "sxm4", "sxm", "nvl",
    "gpu",
];

/// Splits a normalized name into (model token, memory in GB if given).
fn split_name(name: &str) -> (String, Option<u32>) {
    let lower = name.to_ascii_lowercase();
    // Find a memory size: digits followed by "gb"/"gib"/"g" as a separate word or suffix.
    let mut mem = None;
    let mut rest = String::new();
    for word in lower.split(|c: char| {
        c.is_whitespace() || c == '-' || c == '_' || c == '/' || c == '(' || c == ')'
    }) {
        let w = word.trim_end_matches("ib").trim_end_matches('b');
        let digits: String = w.chars().take_while(|c| c.is_ascii_digit()).collect();
        if !digits.is_empty() && w.len() == digits.len() + 1 && w.ends_with('g') {
            mem = digits.parse().ok();
            continue;
        }
        rest.push_str(word);
    }
    let mut compact: String = rest.chars().filter(|c| c.is_ascii_alphanumeric()).collect();
    // Sizes glued to the model ("3060-12gb" was split above; "306012gb" is handled here).
    for n in NOISE {
        compact = compact.replace(n, "");
    }
    if mem.is_none()
        && let Some(stripped) = compact
            .strip_suffix("gb")
            .or_else(|| compact.strip_suffix("g"))
    {
        // Try every split point: model token + digits.
        for p in GPU_PRESETS {
            if let Some(num) = stripped.strip_prefix(p.model)
                && let Ok(v) = num.parse::<u32>()
            {
                return (p.model.to_string(), Some(v));
            }
        }
    }
    (compact, mem)
}

/// The unit system a budget was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Units {
    /// Powers of ten: `KB`, `MB`, `GB`, `TB`, or bytes.
    Decimal,
    /// Powers of two: `KiB`, `MiB`, `GiB`, `TiB`, and the single letters `K`, `M`, `G`, `T`
    /// (read as binary), and GPU memory (NVIDIA's "GB" on the box are GiB).
    Binary,
}

/// The unit system of a size string as [`crate::parse_size`] reads it (the letters after the
/// number; a device prefix before `:` is ignored).
fn written_units(text: &str) -> Units {
    let value = text.rsplit(':').next().unwrap_or(text);
    let compact: String = value.chars().filter(|c| !c.is_whitespace()).collect();
    let unit_len = compact
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_alphabetic())
        .count();
    let unit = compact[compact.len() - unit_len..].to_ascii_lowercase();
    if unit.ends_with("ib") || matches!(unit.as_str(), "k" | "m" | "g" | "t") {
        Units::Binary
    } else {
        Units::Decimal
    }
}

/// `bytes` in `units` first and the other system in parentheses: `8.00 GB (7.45 GiB)`,
/// `8.00 GiB (8.59 GB)`; below a gigabyte (gibibyte) in MB (MiB).
fn format_in(bytes: Bytes, units: Units) -> String {
    match units {
        Units::Decimal => bytes.to_string(),
        Units::Binary if bytes.0 >= GIB => {
            format!("{:.2} GiB ({:.2} GB)", bytes.gib(), bytes.gb())
        }
        Units::Binary if bytes.0 >= MIB => format!(
            "{:.1} MiB ({:.1} MB)",
            bytes.0 as f64 / MIB as f64,
            bytes.mb()
        ),
        Units::Binary => format!("{} B", bytes.0),
    }
}

impl Budget {
    /// Parses a size string (`"6GB"`, `"12GiB"`) or the `max_memory` form `"cuda: 6GB"` /
    /// `"max_memory: cuda: 6GB"` (a device prefix before `:` is ignored).
    ///
    /// # Errors
    /// [`Error::InvalidSize`] for what [`parse_size`] rejects and for a zero budget (nothing
    /// fits 0 bytes; a zero is a typo, not a plan).
    pub fn parse(text: &str) -> Result<Budget> {
        let value = text.rsplit(':').next().unwrap_or(text).trim();
        let p = parse_size(value)?;
        if p.bytes == Bytes(0) {
            return Err(Error::InvalidSize {
                input: text.to_string(),
                reason: "a budget must be more than 0 bytes".into(),
            });
        }
        if p.assumed.is_some() && p.bytes.0 < 1 << 20 {
            // "--budget 8" meant 8 GB, not 8 bytes
            return Err(Error::InvalidSize {
                input: text.to_string(),
                reason: format!(
                    "{} bytes is no training budget; a number without a unit is read as bytes: write the unit, e.g. \"{value}GB\" or \"{value}GiB\"",
                    p.bytes.0
                ),
            });
        }
        Ok(Budget {
            bytes: p.bytes,
            source: BudgetSource::Size {
                input: text.to_string(),
                assumed: p.assumed,
            },
        })
    }

    /// The total memory of a GPU by name. Matching ignores case, spaces, dashes and the words
    /// NVIDIA / GeForce / RTX / GTX / Tesla; a size picks the variant (`"3060 8GB"`); without one
    /// the common variant is used (`"A100"` = 40 GB, `"3060"` = 12 GB).
    ///
    /// `"local"` (or `"local:1"`, `"cuda:1"`) is this machine's card: its free memory right now
    /// ([`Budget::local`]).
    ///
    /// # Errors
    /// [`Error::UnknownGpu`] listing the known names; for `"local"`, [`Error::NoGpu`] when
    /// there is no card, no driver, or this build has no NVML (feature `nvml`).
    ///
    /// ```
    /// let b = lora_memory::Budget::gpu("nvidia geforce rtx 3060").unwrap();
    /// assert_eq!(b.bytes, lora_memory::Bytes(12 << 30));
    /// ```
    pub fn gpu(name: &str) -> Result<Budget> {
        if let Some(index) = local_index(name)? {
            return Budget::local(index);
        }
        let (model, mem) = split_name(name);
        let hit = GPU_PRESETS
            .iter()
            .find(|p| p.model == model && mem.map(|m| m == p.marketed_gb).unwrap_or(p.default));
        match hit {
            Some(p) => Ok(Budget {
                bytes: Bytes(p.bytes),
                source: BudgetSource::Gpu {
                    name: p.name.to_string(),
                },
            }),
            None => Err(Error::UnknownGpu {
                name: name.to_string(),
                known: GPU_PRESETS
                    .iter()
                    .map(|p| p.name)
                    .collect::<Vec<_>>()
                    .join(", "),
            }),
        }
    }

    /// The unit system the budget was written in: a size string's own
    /// (`"8GB"` decimal, `"8GiB"` / `"8G"` binary), binary for GPU memory.
    pub fn units(&self) -> Units {
        match &self.source {
            BudgetSource::Size { input, .. } => written_units(input),
            BudgetSource::Gpu { .. } | BudgetSource::NvmlFree { .. } => Units::Binary,
        }
    }

    /// The budget in both units, the one it was written in first: `"8GB"` gives
    /// `8.00 GB (7.45 GiB)`, `"8GiB"` and GPU presets `8.00 GiB (8.59 GB)`.
    ///
    /// ```
    /// let b = lora_memory::Budget::parse("cuda: 8GB").unwrap();
    /// assert_eq!(b.amount(), "8.00 GB (7.45 GiB)");
    /// ```
    pub fn amount(&self) -> String {
        format_in(self.bytes, self.units())
    }

    /// A hint for a budget written in decimal units (GB) that is within 10% of the memory of a
    /// GPU sold as that many "GB" (which are GiB: an "8 GB" card has 8 GiB = 8.59 GB), saying
    /// how to write the card's size instead. `None` for binary budgets, GPU presets, and sizes
    /// near no card's (or equal to one's within 0.5%).
    ///
    /// ```
    /// let h = lora_memory::Budget::parse("8GB").unwrap().unit_hint().unwrap();
    /// assert!(h.contains("8GiB"), "{h}");
    /// assert!(lora_memory::Budget::parse("8GiB").unwrap().unit_hint().is_none());
    /// ```
    pub fn unit_hint(&self) -> Option<String> {
        let BudgetSource::Size { input, .. } = &self.source else {
            return None;
        };
        if self.units() != Units::Decimal {
            return None;
        }
        let b = self.bytes.as_f64();
        // cards whose "GB" on the box are GiB: the one sold as the number written ("8GB" → an
        // "8 GB" card), else the nearest
        let written_gb = (b / 1e9).round();
        let (gb, rel) = GPU_PRESETS
            .iter()
            .filter(|p| p.bytes == gib(u64::from(p.marketed_gb)))
            .map(|p| {
                let size = p.bytes as f64;
                (p.marketed_gb, (b - size).abs() / size)
            })
            .min_by(|x, y| {
                let other = |gb: u32| f64::from(gb) != written_gb;
                (other(x.0), x.1)
                    .partial_cmp(&(other(y.0), y.1))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })?;
        if !(0.005..=0.10).contains(&rel) {
            return None;
        }
        let example = GPU_PRESETS
            .iter()
            .filter(|p| p.default && p.marketed_gb == gb && p.bytes == gib(u64::from(gb)))
            // a consumer card when there is one
            .max_by_key(|p| p.name.starts_with("RTX ") || p.name.starts_with("GTX "))
            .map_or_else(String::new, |p| format!(", e.g. \"{}\"", p.name));
        Some(format!(
            "{input:?} is {}, but a card sold as \"{gb} GB\" has {gb} GiB = {:.2} GB: for such a card write {gb}GiB (--budget {gb}GiB, memory.budget) or name the card (--gpu, memory.gpu{example})",
            self.amount(),
            gib(u64::from(gb)) as f64 / 1e9
        ))
    }

    /// Free memory of CUDA device `device_index` right now, from the NVIDIA driver (NVML).
    ///
    /// # Errors
    /// [`Error::NoGpu`] when the driver library is absent (a normal answer on CPU machines), the
    /// index does not exist, or the query fails.
    #[cfg(feature = "nvml")]
    pub fn nvml_free(device_index: u32) -> Result<Budget> {
        let no = |e: &dyn std::fmt::Display| Error::NoGpu {
            reason: e.to_string(),
        };
        let nvml = nvml_wrapper::Nvml::init().map_err(|e| Error::NoGpu {
            reason: format!(
                "the NVIDIA driver cannot be asked about cuda:{device_index} ({e}); on a machine without one, name the card (--gpu / memory.gpu, e.g. \"RTX 4090\") or give a size (--budget / memory.budget, e.g. 24GB)"
            ),
        })?;
        let dev = nvml.device_by_index(device_index).map_err(|e| no(&e))?;
        let info = dev.memory_info().map_err(|e| no(&e))?;
        Ok(Budget {
            bytes: Bytes(info.free),
            source: BudgetSource::NvmlFree {
                device_index,
                name: dev.name().unwrap_or_default(),
                total: Bytes(info.total),
            },
        })
    }

    /// This machine's CUDA device `device_index`: its free memory right now, from the driver
    /// (NVML). What is not free is held by other processes ([`Budget::held_by_others`]); the
    /// run itself has not started, so none of it is this run's.
    ///
    /// # Errors
    /// [`Error::NoGpu`] when the driver library is absent (a normal answer on CPU machines), the
    /// index does not exist, the query fails, or this build has no NVML (feature `nvml`).
    pub fn local(device_index: u32) -> Result<Budget> {
        #[cfg(feature = "nvml")]
        {
            Budget::nvml_free(device_index)
        }
        #[cfg(not(feature = "nvml"))]
        {
            Err(Error::NoGpu {
                reason: format!(
                    "cuda:{device_index} cannot be queried: this build has no NVML (build with the `nvml` feature); name the card instead (--gpu / memory.gpu, e.g. \"RTX 4090\") or give a size (--budget / memory.budget, e.g. 24GB)"
                ),
            })
        }
    }

    /// Memory of the card the budget is for: a local card's total, else the budget itself.
    pub fn card_bytes(&self) -> Bytes {
        match &self.source {
            BudgetSource::NvmlFree { total, .. } if total.0 >= self.bytes.0 => *total,
            _ => self.bytes,
        }
    }

    /// Memory other processes hold on a local card (total − free when the budget was read);
    /// zero for a size or a preset, which assume nothing else holds the card.
    pub fn held_by_others(&self) -> Bytes {
        self.card_bytes().saturating_sub(self.bytes)
    }
}

/// `Some(index)` for the names of this machine's card: `local`, `local:N`, `cuda`, `cuda:N`.
fn local_index(name: &str) -> Result<Option<u32>> {
    let n = name.trim().to_ascii_lowercase();
    let rest = match ["local", "cuda"].iter().find_map(|p| n.strip_prefix(p)) {
        Some(r) => r.trim(),
        None => return Ok(None),
    };
    if rest.is_empty() {
        return Ok(Some(0));
    }
    match rest.strip_prefix(':').map(|i| i.trim().parse::<u32>()) {
        Some(Ok(i)) => Ok(Some(i)),
        _ => Err(Error::UnknownGpu {
            name: name.to_string(),
            known: "local, local:N, cuda:N (this machine's card N), or a card name such as \"RTX 4090\"".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_names_match_forgivingly() {
        let g = |n: &str| Budget::gpu(n).unwrap();
        assert_eq!(g("RTX 2060").bytes, Bytes(6 * GIB));
        assert_eq!(g("NVIDIA GeForce RTX 3060").bytes, Bytes(12 * GIB));
        assert_eq!(g("rtx-3060-8gb").bytes, Bytes(8 * GIB));
        assert_eq!(g("3060 8 GB").bytes, Bytes(8 * GIB));
        assert_eq!(g("RTX3090").bytes, Bytes(24 * GIB));
        assert_eq!(g("4090").bytes, Bytes(24 * GIB));
        assert_eq!(g("A100-SXM4-80GB").bytes, Bytes(81_920 * MIB));
        assert_eq!(g("a100").bytes, Bytes(40_960 * MIB));
        assert_eq!(g("Tesla T4").bytes, Bytes(15_360 * MIB));
        assert_eq!(g("H100 PCIe").bytes, Bytes(81_559 * MIB));
        assert_eq!(g("H200").bytes, Bytes(143_771 * MIB));
        assert_eq!(g("L40S").bytes, Bytes(46_068 * MIB));
        assert_eq!(g("RTX 4060 Ti 16GB").bytes, Bytes(16 * GIB));
        assert_eq!(g("rtx 3080 ti").bytes, Bytes(12 * GIB));
        let e = Budget::gpu("Voodoo 3").unwrap_err().to_string();
        assert!(e.contains("Voodoo 3") && e.contains("RTX 3090 24GB"), "{e}");
    }

    #[test]
    fn size_budgets_accept_the_max_memory_form() {
        assert_eq!(Budget::parse("6GB").unwrap().bytes, Bytes(6_000_000_000));
        assert_eq!(
            Budget::parse("cuda: 6GB").unwrap().bytes,
            Bytes(6_000_000_000)
        );
        assert_eq!(
            Budget::parse("max_memory: cuda: 12GiB").unwrap().bytes,
            Bytes(12 * GIB)
        );
        assert!(Budget::parse("cuda: lots").is_err());
    }

    #[test]
    fn zero_and_unrepresentable_budgets_are_errors_naming_the_input() {
        for bad in ["0GB", "cuda: 0", "0.0 GiB", "99999999TB", "1e30GB"] {
            let e = Budget::parse(bad).unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        assert!(
            Budget::parse("0GB")
                .unwrap_err()
                .to_string()
                .contains("more than 0 bytes")
        );
        assert_eq!(Budget::parse("8e9").unwrap().bytes, Bytes(8_000_000_000));
    }

    #[test]
    fn a_bare_small_number_asks_for_a_unit() {
        let e = Budget::parse("8").unwrap_err().to_string();
        assert!(e.contains("\"8GB\"") && e.contains("\"8GiB\""), "{e}");
        assert!(Budget::parse("cuda: 12").is_err());
        // explicit units and large bare byte counts stay valid
        assert_eq!(Budget::parse("8MB").unwrap().bytes, Bytes(8_000_000));
        assert_eq!(
            Budget::parse("8000000000").unwrap().bytes,
            Bytes(8_000_000_000)
        );
    }

    #[test]
    fn amounts_lead_with_the_units_written() {
        let a = |s: &str| Budget::parse(s).unwrap().amount();
        assert_eq!(a("8GB"), "8.00 GB (7.45 GiB)");
        assert_eq!(a("cuda: 8GB"), "8.00 GB (7.45 GiB)");
        assert_eq!(a("8 gb"), "8.00 GB (7.45 GiB)");
        assert_eq!(a("8e9"), "8.00 GB (7.45 GiB)");
        assert_eq!(a("8GiB"), "8.00 GiB (8.59 GB)");
        assert_eq!(a("max_memory: cuda: 12GiB"), "12.00 GiB (12.88 GB)");
        assert_eq!(a("8G"), "8.00 GiB (8.59 GB)");
        assert_eq!(a("500MB"), "500.0 MB (476.8 MiB)");
        assert_eq!(a("512MiB"), "512.0 MiB (536.9 MB)");
        assert_eq!(a("1.5e3MB"), "1.50 GB (1.40 GiB)");
        let card = Budget::gpu("RTX 4060").unwrap();
        assert_eq!(card.units(), Units::Binary);
        assert_eq!(card.amount(), "8.00 GiB (8.59 GB)");
        assert_eq!(Budget::parse("8GB").unwrap().units(), Units::Decimal);
    }

    #[test]
    fn a_decimal_budget_near_a_card_size_hints_at_gib() {
        let h = |s: &str| Budget::parse(s).unwrap().unit_hint();
        let eight = h("8GB").unwrap();
        for part in [
            "\"8GB\" is 8.00 GB (7.45 GiB)",
            "\"8 GB\" has 8 GiB = 8.59 GB",
            "--budget 8GiB",
            "--gpu",
        ] {
            assert!(eight.contains(part), "{part:?} missing: {eight}");
        }
        // 12 GB is 11.18 GiB: 6.9% under a 12 GiB card (and 1.6% over an 11 GiB one, but
        // "12GB" was written for a 12 GB card)
        assert!(h("cuda: 12GB").unwrap().contains("--budget 12GiB"));
        // A100 80GB: 81,920 MiB = 80 GiB
        assert!(h("80GB").unwrap().contains("--budget 80GiB"));
        // 16.5 GB is 15.37 GiB: the nearest card is 16 GiB (3.9% under)
        assert!(h("16.5GB").unwrap().contains("16 GiB"));
        // 7 GB (6.52 GiB) is 18% under 8 GiB and 8.7% over 6 GiB: the 6 GiB card is meant
        assert!(h("7GB").unwrap().contains("\"6 GB\""));
        // binary budgets, card presets, sizes equal to a card's and sizes far from any: none
        assert_eq!(h("8GiB"), None);
        assert_eq!(h("8G"), None);
        assert_eq!(Budget::gpu("RTX 4060").unwrap().unit_hint(), None);
        assert_eq!(h("8.59GB"), None);
        assert_eq!(h("14.5GB"), None, "12.5% over 12 GiB, 15.6% under 16 GiB");
        assert_eq!(h("500MB"), None);
    }

    #[cfg(feature = "nvml")]
    #[test]
    fn nvml_without_a_driver_is_a_no_gpu_answer() {
        match Budget::nvml_free(0) {
            Ok(b) => assert!(b.bytes.0 > 0),
            Err(e) => assert!(matches!(e, Error::NoGpu { .. }), "{e}"),
        }
        // An index that cannot exist is always a NoGpu answer.
        assert!(matches!(
            Budget::nvml_free(10_000),
            Err(Error::NoGpu { .. })
        ));
        assert!(matches!(
            Budget::gpu("local:10000"),
            Err(Error::NoGpu { .. })
        ));
    }

    #[test]
    fn local_names_this_machines_card() {
        assert_eq!(local_index("local").unwrap(), Some(0));
        assert_eq!(local_index("cuda:1").unwrap(), Some(1));
        assert_eq!(local_index(" Local : 2 ").unwrap(), Some(2));
        assert_eq!(local_index("RTX 4090").unwrap(), None);
        let e = local_index("local:x").unwrap_err().to_string();
        assert!(e.contains("local:x") && e.contains("local:N"), "{e}");
        // without a card (or without NVML in the build) a clear answer, never a guess
        match Budget::gpu("local") {
            Ok(b) => assert!(b.card_bytes() >= b.bytes && b.bytes.0 > 0),
            Err(e) => assert!(matches!(e, Error::NoGpu { .. }), "{e}"),
        }
    }

    #[test]
    fn a_local_card_reports_what_others_hold() {
        let b = Budget {
            bytes: Bytes(20 << 30),
            source: BudgetSource::NvmlFree {
                device_index: 0,
                name: "NVIDIA GeForce RTX 4090".into(),
                total: Bytes(24 << 30),
            },
        };
        assert_eq!(b.card_bytes(), Bytes(24 << 30));
        assert_eq!(b.held_by_others(), Bytes(4 << 30));
        let preset = Budget::gpu("RTX 4090").unwrap();
        assert_eq!(preset.held_by_others(), Bytes(0));
        assert_eq!(preset.card_bytes(), preset.bytes);
    }
}
