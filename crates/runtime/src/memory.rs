//! The process's own memory figures, from `/proc/self/status` where there is one.

/// Peak resident set size of this process in KiB (`VmHWM`), if the OS reports it.
pub fn peak_rss_kib() -> Option<u64> {
    status_field("VmHWM:")
}

/// Current resident set size of this process in KiB (`VmRSS`), if the OS reports it.
pub fn current_rss_kib() -> Option<u64> {
    status_field("VmRSS:")
}

fn status_field(name: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}
