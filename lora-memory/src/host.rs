//! What the operating system says about this machine's and this process's memory (Linux
//! `/proc`): the numbers a CPU run's budget and measurements come from.

/// A `Key:   1234 kB` field of a `/proc` text (`/proc/meminfo`, `/proc/self/status`), in bytes;
/// `None` when the key is absent or its value is not a number of kB.
pub fn proc_field_bytes(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| {
        l.strip_prefix(key)
            .is_some_and(|rest| rest.starts_with(':'))
    })?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// `MemTotal` and `MemAvailable` of `/proc/meminfo`, in bytes: the machine's RAM and what new
/// allocations can still get without swapping. `None` where there is no such file (not Linux).
pub fn ram() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some((
        proc_field_bytes(&text, "MemTotal")?,
        proc_field_bytes(&text, "MemAvailable")?,
    ))
}

/// `VmRSS` and `VmHWM` (resident set now and its peak) of this process, in bytes; zeros where
/// `/proc/self/status` is missing.
pub fn process_rss() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        proc_field_bytes(&text, "VmRSS").unwrap_or(0),
        proc_field_bytes(&text, "VmHWM").unwrap_or(0),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_fields_are_read_in_bytes_by_their_exact_key() {
        let t = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12288000 kB\nHugePages_Total:       0\n";
        assert_eq!(proc_field_bytes(t, "MemTotal"), Some(24_576_000 * 1024));
        assert_eq!(proc_field_bytes(t, "MemAvailable"), Some(12_288_000 * 1024));
        // `Mem` is no key of its own; a missing key is None
        assert_eq!(proc_field_bytes(t, "Mem"), None);
        assert_eq!(proc_field_bytes(t, "SwapTotal"), None);
        if let Some((total, avail)) = ram() {
            assert!(total > 0 && avail <= total);
        }
    }
}
