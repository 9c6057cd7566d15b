//! Reads from the model file that bypass the page cache, so that a RAM budget is not
//! silently overspent by cached file pages: `O_DIRECT` into [`AlignedBuf`]s where the
//! file system accepts it, else plain `pread` followed by
//! `posix_fadvise(POSIX_FADV_DONTNEED)` on the range just read.

use std::alloc::{self, Layout};
use std::fs::File;
use std::path::{Path, PathBuf};

use crate::plan::IO_ALIGN;

/// A heap buffer aligned to [`IO_ALIGN`], as direct I/O needs.
pub struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer owns its allocation; `&AlignedBuf` gives only shared access.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; mutation needs `&mut`.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zeroed buffer of `len` bytes (rounded up to [`IO_ALIGN`]).
    pub fn new(len: usize) -> AlignedBuf {
        let len = (len.max(1)).div_ceil(IO_ALIGN as usize) * IO_ALIGN as usize;
        let layout = Layout::from_size_align(len, IO_ALIGN as usize).expect("valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = std::ptr::NonNull::new(raw).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised (zeroed at allocation) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Capacity in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (buffers hold at least one aligned block).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.len, IO_ALIGN as usize).expect("valid layout");
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), layout) }
    }
}

/// Positional reads of a file. The store reads through this trait so that tests can
/// inject delays, errors and short reads.
pub trait ReadAt: Send + Sync {
    /// Reads up to `buf.len()` bytes at `offset`; returns how many were read (0 at the
    /// end of the file). `offset` and `buf` are aligned to [`IO_ALIGN`], and so is
    /// `buf.len()`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize>;
    /// The file's path, for error messages.
    fn path(&self) -> &Path;
    /// Length of the file.
    fn len(&self) -> u64;
    /// True if the file is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// How reads bypass the page cache (for the plan printout).
    fn mode(&self) -> &'static str;
}

/// The model file opened for reads that bypass the page cache.
pub struct DirectFile {
    file: File,
    path: PathBuf,
    len: u64,
    direct: bool,
}

impl DirectFile {
    /// Opens `path` with `O_DIRECT` if the file system allows it, else normally (reads
    /// are then followed by `POSIX_FADV_DONTNEED`). `allow_direct = false` forces the
    /// fallback.
    pub fn open(path: &Path, allow_direct: bool) -> std::io::Result<DirectFile> {
        let plain = File::open(path)?;
        let len = plain.metadata()?.len();
        #[cfg(target_os = "linux")]
        if allow_direct {
            use std::os::unix::fs::OpenOptionsExt;
            if let Ok(file) = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                // Some file systems accept the flag at open and refuse the read: try one.
                let mut probe = AlignedBuf::new(IO_ALIGN as usize);
                if len == 0 || pread(&file, probe.as_mut_slice(), 0).is_ok() {
                    return Ok(DirectFile {
                        file,
                        path: path.to_path_buf(),
                        len,
                        direct: true,
                    });
                }
            }
        }
        let _ = allow_direct;
        Ok(DirectFile {
            file: plain,
            path: path.to_path_buf(),
            len,
            direct: false,
        })
    }

    /// Whether reads use `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }
}

#[cfg(unix)]
fn pread(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    loop {
        match file.read_at(buf, offset) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

#[cfg(not(unix))]
fn pread(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::windows::fs::FileExt;
    file.seek_read(buf, offset)
}

impl ReadAt for DirectFile {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
        let n = pread(&self.file, buf, offset)?;
        #[cfg(target_os = "linux")]
        if !self.direct && n > 0 {
            use std::os::fd::AsRawFd;
            // SAFETY: a plain syscall on an open descriptor; errors are advisory.
            unsafe {
                libc::posix_fadvise(
                    self.file.as_raw_fd(),
                    offset as libc::off_t,
                    n as libc::off_t,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
        }
        Ok(n)
    }

    fn path(&self) -> &Path {
        &self.path
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn mode(&self) -> &'static str {
        if self.direct {
            "O_DIRECT"
        } else {
            "pread + posix_fadvise(DONTNEED)"
        }
    }
}

/// Drops the page cache of a whole file (`POSIX_FADV_DONTNEED`), so that the next
/// reads come from the disk. Benches call it before each run; a no-op off Linux.
pub fn drop_file_cache(path: &Path) -> std::io::Result<()> {
    let file = File::open(path)?;
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain syscall on an open descriptor.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
    }
    drop(file);
    Ok(())
}

/// Tells the kernel this process no longer needs the pages of `mapped`, part of a
/// read-only file mapping (`MADV_DONTNEED`): loading the model touched a few pages of
/// each layer (its norms), and a streaming store should not keep them resident. Later
/// accesses fault the pages in again from the file, so the bytes seen do not change.
/// A no-op off Linux.
pub fn release_mapped_pages(mapped: &[u8]) {
    // MADV_DONTNEED on a read-only file mapping only drops page-table entries; the
    // contents stay those of the file.
    #[cfg(target_os = "linux")]
    advise(mapped, libc::MADV_DONTNEED);
    #[cfg(not(target_os = "linux"))]
    let _ = mapped;
}

/// Tells the kernel that `mapped` (part of a file mapping) is read front to back and
/// not soon again: it reads ahead further and reclaims the pages behind first. For a
/// head left on disk that every token scans whole through a page cache smaller than it.
pub fn advise_sequential(mapped: &[u8]) {
    #[cfg(target_os = "linux")]
    advise(mapped, libc::MADV_SEQUENTIAL);
    #[cfg(not(target_os = "linux"))]
    let _ = mapped;
}

/// Tells the kernel that `mapped` (part of a file mapping) is read a little here and
/// there: a fault reads the page it needs, not the read-ahead window around it (up to
/// the device's `read_ahead_kb`: one byte read cached 4 MiB of a file on a disk of
/// 8 MiB). For an embedding table left mapped, of which a token reads one row: with
/// read-ahead a prompt chunk filled the page cache, which a memory cgroup charges to
/// the process and which the budget does not count.
pub fn advise_random(mapped: &[u8]) {
    #[cfg(target_os = "linux")]
    advise(mapped, libc::MADV_RANDOM);
    #[cfg(not(target_os = "linux"))]
    let _ = mapped;
}

#[cfg(target_os = "linux")]
fn advise(mapped: &[u8], advice: libc::c_int) {
    // SAFETY: `mapped` is a live shared file mapping and these advices change no
    // contents. The start is rounded down to a page inside the same mapping (mappings
    // start on a page).
    unsafe {
        let page = libc::sysconf(libc::_SC_PAGESIZE).max(4096) as usize;
        let start = mapped.as_ptr() as usize;
        let aligned = start / page * page;
        libc::madvise(
            aligned as *mut libc::c_void,
            mapped.len() + (start - aligned),
            advice,
        );
    }
}

/// Bytes this process has caused to be read from storage (`read_bytes` of
/// `/proc/self/io`: page faults of memory maps and direct reads alike), if known.
pub fn process_read_bytes() -> Option<u64> {
    read_bytes_of(std::process::id())
}

/// [`process_read_bytes`] of process `pid` (all its threads), if known.
pub fn read_bytes_of(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/io")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))?
        .trim()
        .parse()
        .ok()
}
