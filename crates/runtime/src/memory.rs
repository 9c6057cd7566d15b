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

/// Bytes per second this machine reads from memory with `threads` threads, each summing
/// its share of a buffer of `bytes` (best of three passes): the roofline a decode step,
/// which reads every weight once, cannot beat. `bytes` should exceed the last-level
/// cache (256 MiB does on the machines this project targets).
pub fn read_bandwidth(bytes: usize, threads: usize) -> f64 {
    let words = (bytes / 8).max(1);
    let threads = threads.clamp(1, words);
    // Every page written once, so the passes read memory, not the zero page.
    let buffer: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads);
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let start = std::time::Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let parts: Vec<_> = buffer
                .chunks(share)
                .map(|part| s.spawn(move || part.iter().fold(0u64, |a, &w| a.wrapping_add(w))))
                .collect();
            parts
                .into_iter()
                .map(|p| p.join().unwrap_or(0))
                .fold(0u64, u64::wrapping_add)
        });
        std::hint::black_box(total);
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words * 8) as f64 / best.max(1e-9)
}
