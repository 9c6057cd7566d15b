//! [`ByteSize`]: a number of bytes, read from text such as `512M` or `4GiB`.

use std::fmt;
use std::str::FromStr;

/// A number of bytes: a memory budget, a cache size. Reads `24G`, `512M`, `1.5GiB`
/// (binary units: K, M, G, T and KiB ...), `3GB` (decimal units: kB, MB, GB, TB) or a
/// plain number of bytes ([`FromStr`], so a command line parses it when it reads its
/// flags); shows itself in binary units (`2.0 GiB`).
///
/// ```
/// use ballast::ByteSize;
///
/// let budget: ByteSize = "512M".parse()?;
/// assert_eq!(budget.bytes(), 512 << 20);
/// assert_eq!(budget.to_string(), "512.0 MiB");
/// assert!("lots".parse::<ByteSize>().is_err());
/// # Ok::<(), ballast_tier_stream::Error>(())
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// The number of bytes.
    pub fn bytes(self) -> u64 {
        self.0
    }
}

impl From<u64> for ByteSize {
    fn from(bytes: u64) -> ByteSize {
        ByteSize(bytes)
    }
}

impl FromStr for ByteSize {
    type Err = ballast_tier_stream::Error;

    fn from_str(s: &str) -> Result<ByteSize, Self::Err> {
        ballast_tier_stream::probe::parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&human_bytes(self.0))
    }
}

/// `n` bytes in a human unit: `512 B`, `1.5 KiB`, `2.0 GiB`.
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A rate in decimal units, as disks and links are quoted: `850 MB`, `3.20 GB`.
pub fn human_rate(bytes_per_s: f64) -> String {
    if bytes_per_s >= 1e9 {
        format!("{:.2} GB", bytes_per_s / 1e9)
    } else {
        format!("{:.0} MB", bytes_per_s / 1e6)
    }
}
