//! How much RAM this process may use: `MemAvailable` from `/proc/meminfo`, and the
//! memory limit of its cgroup (v1 `memory.limit_in_bytes`, v2 `memory.max`, the
//! smallest along the path to the root): a container's limit wins. Also the parsers of
//! sizes (`24G`) and rates (`6.5GB/s`) the command line takes.

use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RamProbe {
    /// `MemAvailable` (free plus reclaimable page cache), if readable.
    pub mem_available: Option<u64>,
    /// The tightest cgroup memory limit and the file it came from, if any is set.
    pub cgroup_limit: Option<(u64, PathBuf)>,
    /// Bytes the cgroup already uses, if known (`memory.current` / `usage_in_bytes`).
    pub cgroup_usage: Option<u64>,
}

impl RamProbe {
    /// The RAM budget: the smaller of `MemAvailable` and the cgroup limit minus
    /// `own` (what this process holds besides what a plan places: see
    /// [`ProcessReserve`]). `None` if nothing could be read.
    ///
    /// What the cgroup already uses ([`RamProbe::cgroup_usage`]) is not subtracted: it
    /// counts the pages of the memory-mapped model that happen to be resident (and
    /// the page cache charged to the group), which the kernel drops under the limit,
    /// so the same command would get a different budget on each run.
    pub fn budget(&self, own: u64) -> Option<u64> {
        let limit = self
            .cgroup_limit
            .as_ref()
            .map(|(l, _)| l.saturating_sub(own));
        match (self.mem_available, limit) {
            (Some(a), Some(l)) => Some(a.min(l)),
            (a, l) => a.or(l),
        }
    }

    /// Whether the cgroup limit (less `own`) is what [`RamProbe::budget`] gives, rather
    /// than `MemAvailable`.
    pub fn limit_decides(&self, own: u64) -> bool {
        match (&self.cgroup_limit, self.mem_available) {
            (Some((l, _)), Some(a)) => l.saturating_sub(own) <= a,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

/// What a Ballast process holds in RAM besides what a plan places (weights, KV cache,
/// activations, scratch and the plan's margin): the code of the binary and its
/// libraries in use, the allocator's and the runtime's own memory, thread stacks,
/// and the GGUF's metadata parsed into the heap with the tokenizer built from it,
/// which is most of it (about 30 MiB for SmolLM2's vocabulary of 49,152 tokens).
///
/// It is computed from the run's inputs, never read from the resident set, so a
/// command sizes itself the same way every time: the resident set at start-up counts
/// whichever pages of the mapped model happen to be in memory, pages the kernel drops
/// under a limit. The constants come from the anonymous memory measured before the
/// budget is taken (`RssAnon` when the compute threads start) on three models:
/// SmolLM2-135M (49,152 tokens, 48,900 merges) 29 MiB, Qwen2.5-Coder-0.5B (151,936
/// tokens, 151,387 merges) 96 MiB, Gemma-3-270M (262,144 tokens, no merges) 72 MiB;
/// each is below what [`ProcessReserve::bytes`] gives it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcessReserve {
    /// Threads the process computes with (each has a stack and per-thread buffers).
    pub threads: usize,
    /// Tokens of the vocabulary (`tokenizer.ggml.tokens`).
    pub vocab: u64,
    /// BPE merges (`tokenizer.ggml.merges`).
    pub merges: u64,
}

impl ProcessReserve {
    /// The binary's and its libraries' code and data in use (SmolLM2 touches 12 MiB
    /// of them in a debug build), the allocator's arenas, the async runtime and the
    /// main thread.
    pub const BASE: u64 = 12 << 20;
    /// One compute thread: its stack as touched and its per-thread buffers (the heap
    /// grew by 1 MiB from 2 to 4 threads).
    pub const PER_THREAD: u64 = 512 << 10;
    /// One token of the vocabulary: its string in the parsed metadata, again in the
    /// tokenizer, and its entries in the tokenizer's maps.
    pub const PER_TOKEN: u64 = 320;
    /// One merge: its string in the parsed metadata, again in the tokenizer, and its
    /// entry in the tokenizer's rank map.
    pub const PER_MERGE: u64 = 400;

    /// The reserve in bytes.
    pub fn bytes(&self) -> u64 {
        Self::BASE
            .saturating_add(Self::PER_THREAD.saturating_mul(self.threads as u64))
            .saturating_add(Self::PER_TOKEN.saturating_mul(self.vocab))
            .saturating_add(Self::PER_MERGE.saturating_mul(self.merges))
    }
}

/// `MemAvailable` in bytes from the text of `/proc/meminfo`.
pub fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line
        .trim_start_matches("MemAvailable:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

/// A cgroup limit file's value: `max` (v2) or a v1 "unlimited" (a page-rounded
/// `i64::MAX`) give `None`.
pub fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    let v: u64 = t.parse().ok()?;
    // v1 reports "no limit" as LONG_MAX rounded down to a page.
    (v < (1u64 << 62)).then_some(v)
}

/// From the text of `/proc/self/cgroup`: the v2 path (`0::/path`) and the v1 memory
/// controller's path (`N:memory:/path`, or a line listing `memory` among others).
pub fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrls), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && ctrls.is_empty() {
            v2 = Some(path.to_string());
        } else if ctrls.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// The smallest limit in `file` of `dir/path` and of each of its parents up to `dir`.
fn tightest(root: &Path, path: &str, file: &str) -> Option<(u64, PathBuf)> {
    let mut best: Option<(u64, PathBuf)> = None;
    let mut p = PathBuf::from(path.trim_start_matches('/'));
    loop {
        let f = root.join(&p).join(file);
        if let Some(v) = std::fs::read_to_string(&f)
            .ok()
            .and_then(|t| parse_limit(&t))
        {
            if best.as_ref().is_none_or(|(b, _)| v < *b) {
                best = Some((v, f));
            }
        }
        if !p.pop() {
            break;
        }
    }
    best
}

/// Probes this machine (Linux; elsewhere everything is `None`).
pub fn probe_ram() -> RamProbe {
    let mem_available = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| parse_meminfo(&t));
    let (v2, v1) = std::fs::read_to_string("/proc/self/cgroup")
        .map(|t| parse_proc_cgroup(&t))
        .unwrap_or((None, None));
    let mut cgroup_limit = None;
    let mut cgroup_usage = None;
    if let Some(p) = &v1 {
        let root = Path::new("/sys/fs/cgroup/memory");
        cgroup_limit = tightest(root, p, "memory.limit_in_bytes");
        cgroup_usage = read_u64(
            &root
                .join(p.trim_start_matches('/'))
                .join("memory.usage_in_bytes"),
        );
    }
    if let Some(p) = &v2 {
        for root in [
            Path::new("/sys/fs/cgroup"),
            Path::new("/sys/fs/cgroup/unified"),
        ] {
            if let Some((v, f)) = tightest(root, p, "memory.max") {
                if cgroup_limit.as_ref().is_none_or(|(b, _)| v < *b) {
                    cgroup_limit = Some((v, f));
                    cgroup_usage =
                        read_u64(&root.join(p.trim_start_matches('/')).join("memory.current"));
                }
            }
        }
    }
    RamProbe {
        mem_available,
        cgroup_limit,
        cgroup_usage,
    }
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn split_number(s: &str) -> Option<(f64, String)> {
    let t = s.trim();
    let end = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let v: f64 = t[..end].parse().ok()?;
    (v.is_finite() && v >= 0.0).then(|| (v, t[end..].trim().to_ascii_lowercase()))
}

fn unit_factor(unit: &str) -> Option<f64> {
    Some(match unit {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    })
}

/// Parses a size: `24G`, `512M`, `1.5GiB` (binary units: K, M, G, T and KiB ...),
/// `3GB` (decimal units: kB, MB, GB, TB), or a plain number of bytes.
pub fn parse_size(s: &str) -> Result<u64> {
    let bad = || Error::BadQuantity {
        what: "size",
        text: s.to_string(),
        expected: "a number with an optional unit: 512M, 24G, 1.5GiB, 3GB",
    };
    let (v, unit) = split_number(s).ok_or_else(bad)?;
    let f = unit_factor(&unit).ok_or_else(bad)?;
    let bytes = v * f;
    if bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes.round() as u64)
}

/// Parses a rate in bytes per second: `6.5GB/s`, `3GB/s`, `800MiB/s` (the `/s` may be
/// left out).
pub fn parse_rate(s: &str) -> Result<f64> {
    let t = s.trim();
    let t = t
        .strip_suffix("/s")
        .or_else(|| t.strip_suffix("/S"))
        .unwrap_or(t);
    let v = parse_size(t).map_err(|_| Error::BadQuantity {
        what: "rate",
        text: s.to_string(),
        expected: "bytes per second: 6.5GB/s, 3GB/s, 800MiB/s",
    })?;
    if v == 0 {
        return Err(Error::BadQuantity {
            what: "rate",
            text: s.to_string(),
            expected: "a rate above zero",
        });
    }
    Ok(v as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meminfo_and_limits() {
        let m = "MemTotal:       24000000 kB\nMemFree: 1 kB\nMemAvailable:   23386184 kB\n";
        assert_eq!(parse_meminfo(m), Some(23386184 * 1024));
        assert_eq!(parse_meminfo("MemFree: 1 kB"), None);
        assert_eq!(parse_limit("max\n"), None);
        assert_eq!(parse_limit("9223372036854771712\n"), None);
        assert_eq!(parse_limit("1073741824\n"), Some(1 << 30));
        assert_eq!(parse_limit("garbage"), None);
    }

    #[test]
    fn proc_cgroup_paths() {
        let v1 = "9:name=systemd:/\n4:memory:/process_api/abc\n0::/\n";
        assert_eq!(
            parse_proc_cgroup(v1),
            (Some("/".into()), Some("/process_api/abc".into()))
        );
        let v2 = "0::/user.slice/ballast\n";
        assert_eq!(
            parse_proc_cgroup(v2),
            (Some("/user.slice/ballast".into()), None)
        );
        let joint = "3:cpu,memory:/x\n";
        assert_eq!(parse_proc_cgroup(joint), (None, Some("/x".into())));
    }

    #[test]
    fn budget_takes_the_smaller() {
        let p = RamProbe {
            mem_available: Some(10 << 30),
            cgroup_limit: Some((1 << 30, PathBuf::from("memory.max"))),
            cgroup_usage: None,
        };
        assert_eq!(p.budget(100 << 20), Some((1 << 30) - (100 << 20)));
        let q = RamProbe {
            cgroup_limit: None,
            ..p
        };
        assert_eq!(q.budget(100 << 20), Some(10 << 30));
    }

    #[test]
    fn the_same_inputs_give_the_same_budget_whatever_the_group_holds() {
        let reserve = ProcessReserve {
            threads: 2,
            vocab: 49_152,
            merges: 48_900,
        };
        let own = reserve.bytes();
        assert_eq!(own, reserve.bytes());
        let limit = 64u64 << 20;
        let probe = |usage| RamProbe {
            mem_available: Some(20 << 30),
            cgroup_limit: Some((limit, PathBuf::from("memory.limit_in_bytes"))),
            cgroup_usage: Some(usage),
        };
        // Whatever the group holds (here: none of the mapped model resident, then
        // 40 MiB of it), the budget is the limit less the process's own reserve.
        let cold = probe(2 << 20).budget(own);
        let warm = probe(42 << 20).budget(own);
        assert_eq!(cold, Some(limit - own));
        assert_eq!(cold, warm);
        assert!(probe(0).limit_decides(own));
        // More threads reserve more, each the same.
        let more = ProcessReserve {
            threads: 8,
            ..reserve
        };
        assert_eq!(
            more.bytes() - own,
            6 * ProcessReserve::PER_THREAD,
            "each thread reserves the same"
        );
        // A reserve above the limit leaves no budget (saturating, not wrapping).
        let huge = ProcessReserve {
            threads: 1,
            vocab: limit,
            merges: 0,
        };
        assert_eq!(probe(0).budget(huge.bytes()), Some(0));
        // MemAvailable below the limit decides.
        let tight = RamProbe {
            mem_available: Some(1 << 20),
            ..probe(0)
        };
        assert_eq!(tight.budget(own), Some(1 << 20));
        assert!(!tight.limit_decides(own));
    }

    #[test]
    fn sizes_and_rates() {
        assert_eq!(parse_size("24G").unwrap(), 24 << 30);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("3GB").unwrap(), 3_000_000_000);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert!(parse_size("24X").is_err());
        assert!(parse_size("-1G").is_err());
        assert!(parse_size("").is_err());
        assert_eq!(parse_rate("6.5GB/s").unwrap(), 6.5e9);
        assert!(parse_rate("0GB/s").is_err());
        let e = parse_rate("fast").unwrap_err().to_string();
        assert!(e.contains("fast"), "{e}");
    }
}
