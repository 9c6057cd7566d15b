//! `io::advise_random` stops a fault in a file mapping from reading ahead: an embedding
//! table left mapped is read one row per token, and with the kernel's read-ahead a
//! prompt chunk pulled megabytes of it into a page cache that a memory cgroup charges to
//! the process. Counted with `mincore` on a file out of the page cache.
#![cfg(target_os = "linux")]

use std::io::Write;
use std::os::fd::AsRawFd;

const LEN: usize = 8 << 20;

/// Pages of `len` bytes at `ptr` (a mapping) that are in the page cache.
fn cached_pages(ptr: *mut libc::c_void, len: usize) -> usize {
    let page = 4096;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `ptr` is a live mapping of `len` bytes and `vec` holds one byte per page.
    let rc = unsafe { libc::mincore(ptr, len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().filter(|&&b| b & 1 == 1).count()
}

/// Writes a file of `LEN` bytes on disk, drops it from the page cache, maps it, advises
/// the mapping random if `random`, reads one byte in its middle, and returns how many
/// of its pages are then cached.
fn pages_after_one_read(random: bool) -> usize {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("temp dir");
    let path = dir.path().join("table.bin");
    let mut f = std::fs::File::create(&path).expect("create");
    f.write_all(&vec![7u8; LEN]).expect("write");
    f.sync_all().expect("sync");
    drop(f);
    ballast_tier_stream::io::drop_file_cache(&path).expect("drop the file's cache");
    let f = std::fs::File::open(&path).expect("open");
    // SAFETY: a shared read-only mapping of a file this test owns, unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            LEN,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        ptr,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: the mapping holds LEN bytes.
    let bytes = unsafe { std::slice::from_raw_parts(ptr as *const u8, LEN) };
    if random {
        ballast_tier_stream::io::advise_random(bytes);
    }
    let before = cached_pages(ptr, LEN);
    // SAFETY: the middle of the mapping; a volatile read, so the fault happens.
    let byte = unsafe { std::ptr::read_volatile(bytes.as_ptr().add(LEN / 2)) };
    assert_eq!(byte, 7);
    let after = cached_pages(ptr, LEN);
    // SAFETY: the mapping made above, no longer borrowed after this.
    unsafe { libc::munmap(ptr, LEN) };
    after - before.min(after)
}

#[test]
fn a_random_mapping_reads_only_the_page_it_touches() {
    let plain = pages_after_one_read(false);
    if plain <= 4 {
        // tmpfs and some overlay filesystems read nothing ahead (or keep every page).
        eprintln!(
            "skipped: one read of a plain mapping cached {plain} pages here, no read-ahead to stop"
        );
        return;
    }
    let random = pages_after_one_read(true);
    assert!(
        random <= 4,
        "one read cached {random} pages with the random advice, {plain} without"
    );
}
